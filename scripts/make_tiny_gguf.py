"""Write tiny random-weight GGUF models for tests: fast, deterministic, no download.

Usage: python scripts/make_tiny_gguf.py OUT.gguf [--seed N] [--lora]

The model is a 2-layer llama-architecture decoder with a SentencePiece-style vocabulary (control
tokens, the 256 byte tokens and a few word pieces), so tokenization, decoding and sampling all run
through llama.cpp's real code paths. Its outputs are noise: it tests mechanics, not quality.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

import gguf
import numpy as np

N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
N_LAYER = 2
N_FF = 128
N_CTX_TRAIN = 2048
WORDS = ["▁the", "▁a", "▁cat", "▁dog", "▁sat", "▁on", "▁mat", "▁hello", "▁world", "▁is", "."]


# Fill-in-the-middle control tokens (Qwen2.5-Coder style) and the GGUF keys naming them.
FIM_TOKENS = {
    "<|fim_prefix|>": gguf.Keys.Tokenizer.FIM_PRE_ID,
    "<|fim_suffix|>": gguf.Keys.Tokenizer.FIM_SUF_ID,
    "<|fim_middle|>": gguf.Keys.Tokenizer.FIM_MID_ID,
    "<|fim_pad|>": gguf.Keys.Tokenizer.FIM_PAD_ID,
    "<|repo_name|>": gguf.Keys.Tokenizer.FIM_REP_ID,
    "<|file_sep|>": gguf.Keys.Tokenizer.FIM_SEP_ID,
}


def vocabulary(
    fim: bool = False,
    no_end_tokens: bool = False,
    extra_tokens: Sequence[tuple[str, int]] = (),
) -> tuple[list[str], list[float], list[int]]:
    """``extra_tokens``: (text, gguf.TokenType) pairs appended last. ``no_end_tokens``: the
    vocabulary of a model without end-of-generation tokens, which is read by llama.cpp's RWKV
    tokenizer (it names no special tokens): the bytes written as that tokenizer reads them
    (escapes), and token 2 spelt "<pad>", not "</s>", which llama.cpp takes for an
    end-of-generation token by its text."""
    tokens = ["<unk>", "<s>", "<pad>" if no_end_tokens else "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"\\x{b:02x}" if no_end_tokens else f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    tokens += ["▁", *WORDS]
    types += [gguf.TokenType.NORMAL] * (len(WORDS) + 1)
    scores = [0.0] * 259 + [-float(i) for i in range(len(WORDS) + 1)]
    if fim:
        tokens += list(FIM_TOKENS)
        types += [gguf.TokenType.CONTROL] * len(FIM_TOKENS)
        scores += [0.0] * len(FIM_TOKENS)
    tokens += [text for text, _ in extra_tokens]
    types += [kind for _, kind in extra_tokens]
    scores += [0.0] * len(extra_tokens)
    return tokens, scores, [int(t) for t in types]


def _metadata(
    writer: gguf.GGUFWriter,
    block_count: int,
    rms_eps: float,
    fim: bool = False,
    no_end_tokens: bool = False,
    extra_tokens: Sequence[tuple[str, int]] = (),
    name: str = "llamacrab-tiny-llama",
) -> None:
    tokens, scores, types = vocabulary(fim, no_end_tokens, extra_tokens)
    writer.add_name(name)
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(block_count)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_layer_norm_rms_eps(rms_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    # llama.cpp's RWKV tokenizer assigns no special tokens of its own, and none are named.
    writer.add_tokenizer_model("rwkv" if no_end_tokens else "llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    if not no_end_tokens:
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    writer.add_add_bos_token(not no_end_tokens)
    writer.add_add_eos_token(False)
    if fim:
        for token, key in FIM_TOKENS.items():
            writer.add_uint32(key, tokens.index(token))


def _tensors(seed: int, n_vocab: int) -> dict[str, np.ndarray]:
    """Random weights; numpy shapes are (rows, cols) = GGUF ne reversed."""
    rng = np.random.default_rng(seed)
    head_dim = N_EMBD // N_HEAD

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    tensors = {"token_embd.weight": weight(n_vocab, N_EMBD)}
    for i in range(N_LAYER):
        tensors[f"blk.{i}.attn_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        tensors[f"blk.{i}.attn_q.weight"] = weight(N_EMBD, N_EMBD)
        tensors[f"blk.{i}.attn_k.weight"] = weight(N_HEAD_KV * head_dim, N_EMBD)
        tensors[f"blk.{i}.attn_v.weight"] = weight(N_HEAD_KV * head_dim, N_EMBD)
        tensors[f"blk.{i}.attn_output.weight"] = weight(N_EMBD, N_EMBD)
        tensors[f"blk.{i}.ffn_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        tensors[f"blk.{i}.ffn_gate.weight"] = weight(N_FF, N_EMBD)
        tensors[f"blk.{i}.ffn_up.weight"] = weight(N_FF, N_EMBD)
        tensors[f"blk.{i}.ffn_down.weight"] = weight(N_EMBD, N_FF)
    tensors["output_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
    tensors["output.weight"] = weight(n_vocab, N_EMBD)
    return tensors


def write_gguf(writer: gguf.GGUFWriter, tensors: dict[str, np.ndarray]) -> None:
    """Add ``tensors`` to a writer whose metadata is set, and write the file."""
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny_llama(
    path: Path,
    seed: int = 0,
    block_count: int = N_LAYER,
    rms_eps: float = 1e-5,
    fim: bool = False,
    chat_templates: dict[str, str] | None = None,
    no_end_tokens: bool = False,
    extra_tokens: Sequence[tuple[str, int]] = (),
    name: str = "llamacrab-tiny-llama",
    suppress_tokens: Sequence[int] = (),
) -> Path:
    """Write the model; ``block_count`` and ``rms_eps`` may be set to invalid values on purpose
    (tests of files tampered with); ``fim`` adds fill-in-the-middle tokens; ``chat_templates``
    ({"": default, "name": variant}) become tokenizer.chat_template[.name];
    ``no_end_tokens`` leaves the vocabulary without EOS, EOT (and BOS) tokens, and without
    end-of-generation tokens but fim's pad, repo and file-separator tokens (llama.cpp's);
    ``extra_tokens`` ((text, gguf.TokenType) pairs) end the vocabulary; ``name`` is
    general.name, which llama.cpp reads for a few models' tokenizer quirks ("phi3");
    ``suppress_tokens`` become tokenizer.ggml.suppress_tokens (ids never to sample)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    _metadata(writer, block_count, rms_eps, fim, no_end_tokens, extra_tokens, name)
    if suppress_tokens:
        writer.add_array("tokenizer.ggml.suppress_tokens", list(suppress_tokens))
    for variant, template in (chat_templates or {}).items():
        writer.add_string("tokenizer.chat_template" + (f".{variant}" if variant else ""), template)
    write_gguf(writer, _tensors(seed, len(vocabulary(fim, extra_tokens=extra_tokens)[0])))
    return path


# The tiny model's weights by the length of their rows (what an importance matrix covers).
WEIGHTS = {f"blk.{i}.{name}.weight": length for i in range(2)
           for name, length in [("attn_q", 64), ("attn_k", 64), ("attn_v", 64),
                                ("attn_output", 64), ("ffn_gate", 64), ("ffn_up", 64),
                                ("ffn_down", 128)]} | {"output.weight": 64}  # fmt: skip


def importances(seed: int = 3) -> dict[str, tuple[np.ndarray, float]]:
    """Squared-activation sums and the token count behind them, by weight; one weight saw no
    token (its importances are then 1, as llama-quantize sets them)."""
    rng = np.random.default_rng(seed)
    sums = {name: (rng.random(n, dtype=np.float32) * 50, 7.0) for name, n in WEIGHTS.items()}
    sums["blk.1.ffn_up.weight"] = (sums["blk.1.ffn_up.weight"][0], 0.0)
    return sums


def write_gguf_imatrix(path: Path, data: dict[str, tuple[np.ndarray, float]] | None = None,
                       metadata: bool = True, counts: bool = True, dataset: str = "wiki.train.raw",
                       chunks: int | bool = 12) -> Path:  # fmt: skip
    """llama-imatrix's GGUF form of ``data`` (default: ``importances()``), the tiny model's:
    NAME.in_sum2 and NAME.counts, and its metadata."""
    data = importances() if data is None else data
    writer = gguf.GGUFWriter(str(path), "imatrix")
    if metadata:
        writer.add_array("imatrix.datasets", [dataset])
        if isinstance(chunks, bool):
            writer.add_bool("imatrix.chunk_count", chunks)
        else:
            writer.add_uint32("imatrix.chunk_count", chunks)
        writer.add_uint32("imatrix.chunk_size", 512)
    for name, (sums, count) in data.items():
        writer.add_tensor(name + ".in_sum2", sums[np.newaxis, :])
        if counts:
            writer.add_tensor(name + ".counts", np.array([[count]], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_llama_split(
    directory: Path, stem: str, n_parts: int = 2, seed: int = 0
) -> list[Path]:
    """The same model as split GGUF files ``{stem}-0000i-of-0000n.gguf``, as llama.cpp's
    gguf-split writes them: metadata in the first part, tensors spread over all of them."""
    tensors = list(_tensors(seed, len(vocabulary()[0])).items())
    per_part = -(-len(tensors) // n_parts)
    paths = []
    for i in range(n_parts):
        path = directory / f"{stem}-{i + 1:05d}-of-{n_parts:05d}.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        if i == 0:
            _metadata(writer, N_LAYER, 1e-5)
        writer.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_NO, i)
        writer.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, n_parts)
        writer.add_int32(gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, len(tensors))
        write_gguf(writer, dict(tensors[i * per_part : (i + 1) * per_part]))
        paths.append(path)
    return paths


# The selective-state-space (Mamba) layers' sizes: llama.cpp supports an expansion of 2 only.
D_INNER, D_CONV, D_STATE, DT_RANK = 2 * N_EMBD, 4, 16, N_EMBD // 16


def _recurrent_metadata(writer: gguf.GGUFWriter, name: str, n_ff: int) -> None:
    tokens, scores, types = vocabulary()
    writer.add_name(name)
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(n_ff)
    writer.add_ssm_conv_kernel(D_CONV)
    writer.add_ssm_inner_size(D_INNER)
    writer.add_ssm_state_size(D_STATE)
    writer.add_ssm_time_step_rank(DT_RANK)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _mamba_layer(weight: Callable[..., np.ndarray], i: int) -> dict[str, np.ndarray]:
    """One Mamba layer's tensors (numpy shapes are GGUF's ne reversed)."""
    return {
        f"blk.{i}.ssm_in.weight": weight(2 * D_INNER, N_EMBD),
        f"blk.{i}.ssm_conv1d.weight": weight(D_INNER, D_CONV),
        f"blk.{i}.ssm_conv1d.bias": weight(D_INNER),
        f"blk.{i}.ssm_x.weight": weight(DT_RANK + 2 * D_STATE, D_INNER),
        f"blk.{i}.ssm_dt.weight": weight(D_INNER, DT_RANK),
        f"blk.{i}.ssm_dt.bias": weight(D_INNER),
        # A = -exp(A_log) < 0: the state decays, as a trained Mamba's does.
        f"blk.{i}.ssm_a": -np.tile(np.arange(1, D_STATE + 1, dtype=np.float32), (D_INNER, 1)),
        f"blk.{i}.ssm_d": np.ones(D_INNER, dtype=np.float32),
        f"blk.{i}.ssm_out.weight": weight(N_EMBD, D_INNER),
    }


def _weights(seed: int) -> Callable[..., np.ndarray]:
    rng = np.random.default_rng(seed)
    return lambda *shape, scale=0.1: (rng.standard_normal(shape) * scale).astype(np.float32)


def _ends(weight: Callable[..., np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    n_vocab = len(vocabulary()[0])
    first = {"token_embd.weight": weight(n_vocab, N_EMBD, scale=1.0)}
    last = {"output_norm.weight": np.ones(N_EMBD, dtype=np.float32),
            "output.weight": weight(n_vocab, N_EMBD, scale=1.0)}  # fmt: skip
    return first, last


def write_tiny_mamba(path: Path, seed: int = 0) -> Path:
    """A tiny random Mamba (a recurrent model: its memory is one state per sequence, which
    cannot be cut back to an earlier position) with the tiny llama's vocabulary."""
    writer = gguf.GGUFWriter(str(path), "mamba")
    _recurrent_metadata(writer, "llamacrab-tiny-mamba", n_ff=0)
    writer.add_head_count(0)
    weight = _weights(seed)
    tensors, last = _ends(weight)
    for i in range(N_LAYER):
        tensors[f"blk.{i}.attn_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        tensors |= _mamba_layer(weight, i)
    write_gguf(writer, tensors | last)
    return path


def write_tiny_jamba(path: Path, seed: int = 0) -> Path:
    """A tiny random Jamba (a hybrid: a Mamba layer, then an attention layer, each with a
    feed-forward block), so its memory is a recurrent state beside a KV cache."""
    writer = gguf.GGUFWriter(str(path), "jamba")
    _recurrent_metadata(writer, "llamacrab-tiny-jamba", n_ff=N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv([0] + [N_HEAD_KV] * (N_LAYER - 1))  # 0: a recurrent layer
    weight = _weights(seed)
    tensors, last = _ends(weight)
    head_dim = N_EMBD // N_HEAD
    for i in range(N_LAYER):
        tensors[f"blk.{i}.attn_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        if i == 0:
            tensors |= _mamba_layer(weight, i) | {
                f"blk.{i}.ssm_dt_norm.weight": np.ones(DT_RANK, dtype=np.float32),
                f"blk.{i}.ssm_b_norm.weight": np.ones(D_STATE, dtype=np.float32),
                f"blk.{i}.ssm_c_norm.weight": np.ones(D_STATE, dtype=np.float32),
            }
        else:
            tensors |= {
                f"blk.{i}.attn_q.weight": weight(N_EMBD, N_EMBD),
                f"blk.{i}.attn_k.weight": weight(N_HEAD_KV * head_dim, N_EMBD),
                f"blk.{i}.attn_v.weight": weight(N_HEAD_KV * head_dim, N_EMBD),
                f"blk.{i}.attn_output.weight": weight(N_EMBD, N_EMBD),
            }
        tensors |= {
            f"blk.{i}.ffn_norm.weight": np.ones(N_EMBD, dtype=np.float32),
            f"blk.{i}.ffn_gate.weight": weight(N_FF, N_EMBD),
            f"blk.{i}.ffn_up.weight": weight(N_FF, N_EMBD),
            f"blk.{i}.ffn_down.weight": weight(N_EMBD, N_FF),
        }
    write_gguf(writer, tensors | last)
    return path


def write_tiny_t5(path: Path, decoder: bool = True, scale: float = 0.02) -> Path:
    """A one-layer T5 (arch ``t5``, encoder and decoder) or, without ``decoder``, its encoder
    alone (``t5encoder``), random weights over the tiny vocabulary. At the default ``scale``
    every input gives about the same logits; at 1.0 the decoder's greedy tokens follow the
    encoder's input."""
    writer = gguf.GGUFWriter(str(path), "t5" if decoder else "t5encoder")
    tokens, scores, types = vocabulary(False, False, ())
    embd, heads, n_ff, buckets = 64, 4, 128, 32
    writer.add_context_length(512)
    writer.add_embedding_length(embd)
    writer.add_block_count(1)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_relative_attn_buckets_count(buckets)
    if decoder:
        writer.add_decoder_start_token_id(0)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(True)
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    ones = np.ones(embd, np.float32)
    tensors = {"token_embd.weight": weight(len(tokens), embd), "enc.output_norm.weight": ones}
    blocks = [("enc", "attn"), ("dec", "attn"), ("dec", "cross_attn")] if decoder else [
        ("enc", "attn")
    ]  # fmt: skip
    for part, attn in blocks:
        tensors[f"{part}.blk.0.{attn}_norm.weight"] = ones
        for name in ("q", "k", "v", "o"):
            tensors[f"{part}.blk.0.{attn}_{name}.weight"] = weight(embd, embd)
        tensors[f"{part}.blk.0.{attn}_rel_b.weight"] = weight(buckets, heads)
    for part in ("enc", "dec") if decoder else ("enc",):
        tensors[f"{part}.blk.0.ffn_norm.weight"] = ones
        tensors[f"{part}.blk.0.ffn_up.weight"] = weight(n_ff, embd)
        tensors[f"{part}.blk.0.ffn_down.weight"] = weight(embd, n_ff)
    if decoder:
        tensors["dec.output_norm.weight"] = ones
        tensors["output.weight"] = weight(len(tokens), embd)
    write_gguf(writer, tensors)
    return path


def write_tiny_draft(path: Path, source: Path, seed: int = 0) -> Path:
    """A tiny random llama-architecture model with ``source``'s tokenizer (every tokenizer.*
    key copied), so it can draft for that model. Its drafts are noise: it exercises the
    mechanics of speculative decoding with a real target, not its gains."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(path), "llama")
    n_vocab = 0
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer.") or field.name.startswith("tokenizer.chat"):
            continue
        value = field.contents()
        if field.name == "tokenizer.ggml.tokens":
            n_vocab = len(value)
        if isinstance(value, list):
            writer.add_key_value(field.name, value, field.types[0], sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, value, field.types[0])
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tensors = _tensors(seed, n_vocab)
    del tensors["output.weight"]  # tied to token_embd: half the size for a big vocabulary
    tensors["token_embd.weight"] = tensors["token_embd.weight"].astype(np.float16)
    write_gguf(writer, tensors)
    return path


def write_tiny_lora(
    path: Path,
    seed: int = 1,
    rank: int = 4,
    alpha: float = 8.0,
    arch: str = "llama",
    invocation_tokens: list[int] | None = None,
    n_embd: int = N_EMBD,
) -> Path:
    """A LoRA adapter for the tiny model: low-rank deltas on every attention query/output.
    ``arch`` and ``n_embd`` may be another model's on purpose; ``invocation_tokens`` make it an
    aLoRA adapter (applied from the last occurrence of those tokens in a prompt)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    if invocation_tokens is not None:
        writer.add_key_value(
            "adapter.alora.invocation_tokens", invocation_tokens, gguf.GGUFValueType.ARRAY,
            sub_type=gguf.GGUFValueType.UINT32,
        )  # fmt: skip
    for i in range(N_LAYER):
        for name in ("attn_q", "attn_output"):
            # lora_a: ne {n_embd, rank}; lora_b: ne {rank, n_out}; numpy shapes are reversed.
            writer.add_tensor(
                f"blk.{i}.{name}.weight.lora_a",
                (rng.standard_normal((rank, n_embd)) * 0.5).astype(np.float32),
            )
            writer.add_tensor(
                f"blk.{i}.{name}.weight.lora_b",
                (rng.standard_normal((n_embd, rank)) * 0.5).astype(np.float32),
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_control_vector(
    path: Path,
    seed: int = 3,
    n_embd: int = N_EMBD,
    layers: tuple[int, ...] = (1,),
    scale: float = 1.0,
    model_hint: str | None = "llama",
) -> Path:
    """A control vector for the tiny model, as llama.cpp's cvector-generator writes one: an F32
    ``direction.<layer>`` per layer (layer 0 never has one). ``n_embd`` and ``layers`` may be
    wrong for the model on purpose."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "controlvector")
    if model_hint is not None:
        writer.add_string("controlvector.model_hint", model_hint)
    writer.add_uint32("controlvector.layer_count", len(layers))
    for layer in layers:
        writer.add_tensor(
            f"direction.{layer}", (rng.standard_normal(n_embd) * scale).astype(np.float32)
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora", action="store_true", help="write a LoRA adapter for it instead")
    args = parser.parse_args()
    writer = write_tiny_lora if args.lora else write_tiny_llama
    print(writer(args.out, args.seed))


if __name__ == "__main__":
    main()
