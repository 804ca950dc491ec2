"""GGUF headers checked before llama.cpp opens a file: ``check.validate_gguf`` and the attention,
per-architecture and vocabulary checks it runs, the per-architecture facts they share, and
``kv_overrides`` applied as llama.cpp's loader applies them. No native calls here: the header
comes parsed from ``gguf_reader``."""
