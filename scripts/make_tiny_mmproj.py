"""Tiny random multimodal projectors (mmproj GGUFs) for libmtmd, for tests with no real model.

- ``write_tiny_vision_mmproj``: a LLaVA-style projector ("mlp") on a small CLIP ViT: 32x32
  images in 8x8 patches give 16 embeddings per image;
- ``write_tiny_gemma3_mmproj``: a Gemma 3-style projector ("gemma3") on the same ViT, whose
  image embeddings libmtmd decodes with non-causal attention (all of them in one micro-batch);
- ``write_tiny_audio_mmproj``: a Qwen2-Audio-style projector ("qwen2a") on a small Whisper
  encoder: 16 kHz audio, 750 embeddings per 30-second chunk.

Both project to ``n_embd_text`` (the tiny text model's 64 by default), which libmtmd checks
against the text model. Random weights: they exercise shapes and flow, not understanding.
Tensor shapes below are numpy shapes, the reverse of GGUF's ne order.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_gguf import write_gguf

VISION = {"image": 32, "patch": 8, "embd": 32, "ff": 64, "heads": 4, "blocks": 2, "proj": 48}
# 4,096 patches through 4 blocks: an encode of seconds on two cores, to interrupt.
SLOW_VISION = {**VISION, "image": 512, "embd": 128, "ff": 256, "blocks": 4}
AUDIO = {"mel": 16, "embd": 32, "ff": 64, "heads": 4, "blocks": 1, "positions": 1500}
AUDIO_SAMPLE_RATE = 16000  # what libmtmd's Whisper preprocessing uses


class _Random:
    """Small random float32 weights of any shape."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def __call__(self, *shape: int) -> np.ndarray:
        return (self.rng.standard_normal(shape) * 0.05).astype(np.float32)


def _norm(tensors: dict[str, np.ndarray], name: str, width: int) -> None:
    tensors[f"{name}.weight"] = np.ones(width, dtype=np.float32)
    tensors[f"{name}.bias"] = np.zeros(width, dtype=np.float32)


def _write(
    path: Path, tensors: dict[str, np.ndarray], describe: Callable[[gguf.GGUFWriter], None]
) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "clip")
    describe(writer)
    write_gguf(writer, tensors)
    return path


def _encoder_block(
    tensors: dict[str, np.ndarray], weight: _Random, block: str, embd: int, ff: int,
    biased: tuple[str, ...],
) -> None:  # fmt: skip
    """One pre-norm transformer block of a ViT or Whisper encoder."""
    for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
        tensors[f"{block}.{part}.weight"] = weight(embd, embd)
    for part in biased:
        tensors[f"{block}.{part}.bias"] = np.zeros(embd, dtype=np.float32)
    _norm(tensors, f"{block}.ln1", embd)
    _norm(tensors, f"{block}.ln2", embd)
    tensors[f"{block}.ffn_up.weight"] = weight(ff, embd)
    tensors[f"{block}.ffn_up.bias"] = np.zeros(ff, dtype=np.float32)
    tensors[f"{block}.ffn_down.weight"] = weight(embd, ff)
    tensors[f"{block}.ffn_down.bias"] = np.zeros(embd, dtype=np.float32)


def _vit(weight: _Random, v: dict[str, int]) -> dict[str, np.ndarray]:
    """The small ViT both vision projectors sit on (``v``: VISION or another size)."""
    embd, n_patches = v["embd"], (v["image"] // v["patch"]) ** 2
    tensors = {
        "v.patch_embd.weight": weight(embd, 3, v["patch"], v["patch"]),
        "v.position_embd.weight": weight(n_patches, embd),
    }
    _norm(tensors, "v.pre_ln", embd)
    for i in range(v["blocks"]):
        _encoder_block(tensors, weight, f"v.blk.{i}", embd, v["ff"],
                       ("attn_q", "attn_k", "attn_v", "attn_out"))  # fmt: skip
    return tensors


def _describe_vit(
    writer: gguf.GGUFWriter, name: str, projector: str, n_embd_text: int, v: dict[str, int]
) -> None:
    writer.add_name(name)
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(projector)
    writer.add_vision_image_size(v["image"])
    writer.add_vision_patch_size(v["patch"])
    writer.add_vision_embedding_length(v["embd"])
    writer.add_vision_feed_forward_length(v["ff"])
    writer.add_vision_projection_dim(n_embd_text)
    writer.add_vision_block_count(v["blocks"])
    writer.add_vision_head_count(v["heads"])
    writer.add_vision_attention_layernorm_eps(1e-5)
    writer.add_vision_image_mean([0.5, 0.5, 0.5])
    writer.add_vision_image_std([0.5, 0.5, 0.5])
    writer.add_bool("clip.use_gelu", True)


def write_tiny_vision_mmproj(path: Path, n_embd_text: int = 64, seed: int = 0) -> Path:
    v = VISION
    weight = _Random(seed)
    tensors = _vit(weight, v)
    # The LLaVA projector: mm.0 -> GELU -> mm.2 (no mm.3: that would make it another type).
    tensors["mm.0.weight"] = weight(v["proj"], v["embd"])
    tensors["mm.0.bias"] = np.zeros(v["proj"], dtype=np.float32)
    tensors["mm.2.weight"] = weight(n_embd_text, v["proj"])
    tensors["mm.2.bias"] = np.zeros(n_embd_text, dtype=np.float32)

    def describe(writer: gguf.GGUFWriter) -> None:
        _describe_vit(writer, "llamacrab-tiny-vision-mmproj", "mlp", n_embd_text, v)

    return _write(path, tensors, describe)


def write_tiny_gemma3_mmproj(
    path: Path,
    n_embd_text: int = 64,
    seed: int = 0,
    merge: int = 1,
    vision: dict[str, int] = VISION,
) -> Path:
    """Gemma 3's projector: the ViT's patches average-pooled ``merge`` x ``merge`` (so
    ``(4 // merge) ** 2`` embeddings per image with VISION), RMS-normed and projected to the
    text model. A larger ``vision`` (SLOW_VISION) makes an encode that takes seconds."""
    weight = _Random(seed)
    tensors = _vit(weight, vision)
    tensors["mm.soft_emb_norm.weight"] = np.ones(vision["embd"], dtype=np.float32)
    tensors["mm.input_projection.weight"] = weight(vision["embd"], n_embd_text)

    def describe(writer: gguf.GGUFWriter) -> None:
        _describe_vit(writer, "llamacrab-tiny-gemma3-mmproj", "gemma3", n_embd_text, vision)
        writer.add_uint32("clip.vision.projector.scale_factor", merge)

    return _write(path, tensors, describe)


def write_tiny_audio_mmproj(path: Path, n_embd_text: int = 64, seed: int = 0) -> Path:
    a = AUDIO
    weight = _Random(seed)
    embd = a["embd"]
    tensors = {
        "a.conv1d.1.weight": weight(embd, a["mel"], 3),
        "a.conv1d.1.bias": np.zeros((embd, 1), dtype=np.float32),
        "a.conv1d.2.weight": weight(embd, embd, 3),
        "a.conv1d.2.bias": np.zeros((embd, 1), dtype=np.float32),
        "a.position_embd.weight": weight(a["positions"], embd),
    }
    for i in range(a["blocks"]):
        # Whisper's key projection has no bias (libmtmd asserts that).
        _encoder_block(tensors, weight, f"a.blk.{i}", embd, a["ff"],
                       ("attn_q", "attn_v", "attn_out"))  # fmt: skip
    _norm(tensors, "a.post_ln", embd)
    tensors["mm.a.fc.weight"] = weight(n_embd_text, embd)
    tensors["mm.a.fc.bias"] = np.zeros(n_embd_text, dtype=np.float32)

    def describe(writer: gguf.GGUFWriter) -> None:
        writer.add_name("llamacrab-tiny-audio-mmproj")
        writer.add_clip_has_audio_encoder(True)
        writer.add_clip_projector_type("qwen2a")
        writer.add_audio_num_mel_bins(a["mel"])
        writer.add_audio_embedding_length(embd)
        writer.add_audio_feed_forward_length(a["ff"])
        writer.add_audio_projection_dim(n_embd_text)
        writer.add_audio_block_count(a["blocks"])
        writer.add_audio_head_count(a["heads"])
        writer.add_audio_attention_layernorm_eps(1e-5)

    return _write(path, tensors, describe)


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    print(write_tiny_vision_mmproj(out / "tiny-vision-mmproj.gguf"))
    print(write_tiny_gemma3_mmproj(out / "tiny-gemma3-mmproj.gguf"))
    print(write_tiny_audio_mmproj(out / "tiny-audio-mmproj.gguf"))
