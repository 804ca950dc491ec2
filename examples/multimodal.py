"""Images and audio in completions and chat, through a multimodal projector (mmproj).

Usage: python examples/multimodal.py [TEXT_MODEL.gguf MMPROJ.gguf IMAGE_OR_AUDIO_FILE]

With a real pair (for example a Gemma 3 4B GGUF and its mmproj file, or a Qwen2-Audio pair),
the answers describe the input. Without arguments it builds a tiny random text model with
tiny random vision and audio projectors (scripts/make_tiny_*.py): the mechanics run, the
answers are noise. Image files need Pillow (pip install 'llamacrab[media]').
"""

from __future__ import annotations

import base64
import sys
import tempfile
from pathlib import Path

import numpy as np

from llamacrab import Audio, Image, Llama

REPO = Path(__file__).resolve().parent.parent


def tiny_models() -> tuple[Path, Path, Path]:
    sys.path.insert(0, str(REPO / "scripts"))
    from make_tiny_gguf import write_tiny_llama
    from make_tiny_mmproj import write_tiny_audio_mmproj, write_tiny_vision_mmproj

    out = Path(tempfile.mkdtemp())
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    text = write_tiny_llama(out / "text.gguf", chat_templates={"": template})
    return (
        text,
        write_tiny_vision_mmproj(out / "vision.gguf"),
        write_tiny_audio_mmproj(out / "audio.gguf"),
    )


def main() -> None:
    if len(sys.argv) == 4:
        text_model, projector, media_file = (Path(a) for a in sys.argv[1:])
        with Llama(text_model, mmproj=projector, n_ctx=4096) as llm:
            kind = "image" if llm.projector and llm.projector.vision else "audio"
            media = Image.from_file(media_file) if kind == "image" else Audio.from_file(media_file)
            prompt = f"Describe this {kind}: {llm.media_marker}\nAnswer:"
            print(llm.create_completion(prompt, media=[media], max_tokens=64).text)
        return
    text_model, vision, audio = tiny_models()
    pixels = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    with Llama(text_model, mmproj=vision, n_ctx=512) as llm:
        prompt = f"the cat {llm.media_marker} sat"
        result = llm.create_completion(prompt, media=[Image(pixels=pixels)], max_tokens=4)
        print(f"image prompt: {result.usage.prompt_tokens} tokens (16 from the image)")
        png = base64.b64encode(_png(pixels)).decode()
        messages = [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
        ]}]  # fmt: skip
        chat = llm.create_chat_completion(messages, max_tokens=4)
        print(f"chat with an image_url part: {chat.usage.prompt_tokens} prompt tokens")
    with Llama(text_model, mmproj=audio, n_ctx=2048) as llm:
        rate = llm.projector.sample_rate if llm.projector else 16000
        tone = np.sin(2 * np.pi * 440 * np.arange(8000) / 8000).astype(np.float32)
        sound = Audio(samples=tone, sample_rate=8000)  # resampled to the projector's rate
        result = llm.create_completion(f"hear {llm.media_marker} now", media=[sound], max_tokens=4)
        print(f"audio prompt at {rate} Hz: {result.usage.prompt_tokens} tokens")


def _png(pixels: np.ndarray) -> bytes:
    import io

    from PIL import Image as PILImage

    buffer = io.BytesIO()
    PILImage.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


if __name__ == "__main__":
    main()
