"""Chat: templates (the model's own, sandboxed, or llama.cpp's built-in formats), the options of a
chat request, media parts of messages and tool calls."""
