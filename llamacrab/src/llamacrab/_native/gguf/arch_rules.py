"""The asserts of single architectures (loader and graph), checked on a GGUF model's header.

Each rule function returns (holds, what must hold) pairs for one family of asserts; the facts
they share across architectures live in archs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llamacrab._native.fork import cached_property
from llamacrab._native.gguf import archs
from llamacrab._native.gguf.attention import HeadSize, head_sizes
from llamacrab._native.gguf_reader import (
    LLAMA_MAX_LAYERS,
    GgufArray,
    Reader,
    per_layer,
    uint,
)
from llamacrab_sys import lib

Rule = tuple[bool, str]  # (holds, what must hold)


@dataclass(frozen=True)
class _Model:
    """The header as the per-architecture rules read it, with llama.cpp's per-layer values."""

    reader: Reader
    arch: str
    metadata: dict[str, Any]
    tensors: dict[str, tuple[list[int], int]]  # name: (dims, GGML type)
    n_layer: int  # block_count
    layer0: HeadSize | None  # head sizes of layer 0; None without embedding_length

    def key(self, name: str, default: float = 0) -> float:
        """{arch}.name if it is a number, else the default (llama.cpp throws on other types; a
        required key that is absent reads as 0: llama.cpp refuses the file anyway)."""
        value = self.metadata.get(f"{self.arch}.{name}", default)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return value if number else default

    def has(self, name: str) -> bool:
        return f"{self.arch}.{name}" in self.metadata

    def layers(self, name: str, n: int | None = None) -> list[int]:
        """{arch}.name for each of n layers (block_count by default), zeros when absent."""
        n = self.n_layer if n is None else n
        return per_layer(self.reader, self.metadata, f"{self.arch}.{name}", n) or [0] * n

    def ne1(self, name: str) -> int | None:
        """ne[1] of a tensor (1 for a vector), None when the file has no such tensor."""
        dims = self.tensors[name][0] if name in self.tensors else None
        return None if dims is None else [*dims, 1][1]

    @cached_property
    def n_main(self) -> int:
        """Layers of the main graph: block_count - nextn_predict_layers."""
        return self.n_layer - (uint(self.metadata, f"{self.arch}.nextn_predict_layers") or 0)

    @cached_property
    def heads(self) -> list[int]:
        return self.layers("attention.head_count")

    @cached_property
    def heads_kv(self) -> list[int]:
        key = f"{self.arch}.attention.head_count_kv"
        return per_layer(self.reader, self.metadata, key, self.n_layer) or self.heads

    @cached_property
    def recurrent(self) -> list[bool]:
        """Which main layers are recurrent (archs.RECURRENT_*)."""
        arch, n = self.arch, self.n_main
        if arch in archs.RECURRENT_ALL:
            return [True] * n
        if arch in archs.RECURRENT_WITHOUT_KV:
            return [kv == 0 for kv in self.heads_kv[:n]]
        if arch in archs.RECURRENT_WITHOUT_KV_OR_FF:
            ff = self.layers("feed_forward_length")
            return [kv == 0 and f == 0 for kv, f in zip(self.heads_kv[:n], ff, strict=False)]
        if arch in archs.RECURRENT_INTERVAL and self.has("attention.recurrent_layers"):
            return [v != 0 for v in self.layers("attention.recurrent_layers")[:n]]
        if arch in archs.RECURRENT_INTERVAL:
            interval = self.key("full_attention_interval", archs.RECURRENT_INTERVAL[arch])
            return [interval > 0 and (il + 1) % interval != 0 for il in range(n)]
        return [False] * n

    @cached_property
    def kv_heads_match(self) -> bool:
        """Every main layer has as many KV heads as query heads (a key for every head)."""
        pairs = zip(self.heads[: self.n_main], self.heads_kv, strict=False)
        return all(kv == h for h, kv in pairs)

    @cached_property
    def attention(self) -> list[bool]:
        """Which main layers attend (in a graph of archs.HYBRID_INPUTS)."""
        if self.arch == "falcon-h1":
            return [True] * self.n_main
        if self.arch in archs.RECURRENT_WITHOUT_KV_OR_FF:
            ff = self.layers("feed_forward_length")
            return [not r and f == 0 for r, f in zip(self.recurrent, ff, strict=False)]
        return [not r for r in self.recurrent]


def _divides(d: float, n: float) -> bool:
    """d > 0 and d divides n: llama.cpp divides n by d."""
    return d > 0 and n % d == 0


def _hparam_rules(m: _Model) -> list[Rule]:
    """GGML_ASSERTs of load_arch_hparams (src/models/<arch>.cpp) on plain keys."""
    if m.arch == "gemma-embedding":
        n_embd = m.key("embedding_length")
        return [
            (m.key("dense_2_feat_in") in (0, n_embd), "dense_2_feat_in is 0 or embedding_length"),
            (m.key("dense_3_feat_out") in (0, n_embd), "dense_3_feat_out is 0 or embedding_length"),
        ]  # fmt: skip
    if m.arch == "nanbeige":
        loops = m.key("num_loops", 1)
        return [
            (loops > 0 and m.n_main * loops <= LLAMA_MAX_LAYERS, "num_loops x layers in 1..512")
        ]
    if m.arch == "hrm_text":
        stack, high = m.key("hrm.layers_per_stack"), m.key("hrm.h_cycles")
        low = m.key("hrm.l_cycles")
        return [
            (min(stack, high, low) > 0, "hrm.layers_per_stack, h_cycles and l_cycles > 0"),
            (stack * high * (low + 1) == m.n_main, "layers_per_stack x h_cycles x (l_cycles + 1) "
             "== block_count - nextn_predict_layers"),
        ]  # fmt: skip
    if m.arch == "minimax-m3":
        return [(m.key("attention.indexer.block_size") > 0, "attention.indexer.block_size > 0")]
    if m.arch == "glm5-next":
        kpool, top_k = m.key("attention.indexer.kpool"), m.key("attention.indexer.top_k")
        return [
            (kpool > 1 and top_k % kpool == 0, "attention.indexer.kpool > 1, dividing top_k"),
            (m.key("hyper_connection.count") == 4, "hyper_connection.count == 4"),
        ]
    if m.arch == "bailingmoe3":
        safe_gate = m.metadata.get(f"{m.arch}.kda.safe_gate", True)
        return [(safe_gate is True and m.key("kda.gate_lower_bound") < 0,
                 "kda.safe_gate true and kda.gate_lower_bound < 0")]  # fmt: skip
    if m.arch == "dflash" and m.key("hyper_connection.count") > 0:
        return [(m.key("attention.sliding_window") > 0, "attention.sliding_window > 0")]
    if m.arch == "deepseek4":
        ratios = m.metadata.get(f"{m.arch}.attention.compress_ratios")
        count = ratios.count if isinstance(ratios, GgufArray) else 0
        return [(count <= LLAMA_MAX_LAYERS, "attention.compress_ratios has at most 512 entries")]
    return []


def _table_rules(m: _Model) -> list[Rule]:
    """Loader asserts and divisions the archs tables describe."""
    rules = [(m.key(name) > 0, f"{name} > 0")
             for name in archs.POSITIVE_KEYS.get(m.arch, ()) if m.has(name)]  # fmt: skip
    past_dense_lead = m.key("leading_dense_block_count") < m.n_main
    if m.has("leading_dense_block_count"):  # kimi-k3's loader reads it as an int, its graph not
        rules.append((m.key("leading_dense_block_count") <= m.n_layer,
                      "leading_dense_block_count <= block_count"))  # fmt: skip
    if m.arch in archs.EXPERTS_REQUIRED or (
        m.arch in archs.EXPERTS_REQUIRED_PAST_DENSE_LEAD and past_dense_lead
    ):
        rules.append((m.key("expert_count") > 0, "expert_count > 0"))
    if m.arch not in archs.PER_LAYER_EXPERTS_USED and m.has("expert_used_count"):
        used = m.layers("expert_used_count")
        rules.append((len(set(used)) <= 1,
                      f"expert_used_count the same on every layer (its graph routes layer 0's "
                      f"count), not {used}"))  # fmt: skip
    if m.arch in archs.GATING_REQUIRED and m.key("expert_count") > 0 and past_dense_lead:
        rules.append((m.has("expert_gating_func"), "expert_gating_func (its MoE layers use it)"))
    if m.arch in archs.HEAD_COUNT_DIVIDES and archs.HEAD_COUNT_DIVIDES[m.arch] in (None, m.n_main):
        rules.append((m.heads[0] > 0, "attention.head_count > 0 (layer 0)"))
    if m.arch in archs.RECURRENT_INTERVAL and not m.has("attention.recurrent_layers"):
        rules.append((m.key("full_attention_interval", 1) > 0, "full_attention_interval > 0"))
    if m.arch in archs.SSM_INNER_TWICE_EMBEDDING:
        inner, n_embd = m.key("ssm.inner_size"), m.key("embedding_length")
        rules.append((inner == 2 * n_embd, "ssm.inner_size == 2 x embedding_length"))
    if m.arch in archs.MTP_TRUNK_OPTIONAL and m.tensors and 0 < m.n_main < m.n_layer:
        rules.append(("blk.0.attn_norm.weight" in m.tensors,
                      "the main layers' tensors (blk.0.attn_norm.weight): a file of "
                      "nextn_predict_layers only is for MTP drafting"))  # fmt: skip
    return rules


def _ssm_rules(m: _Model) -> list[Rule]:
    """ssm.* sizes the recurrent layers' graph divides by and asserts on (SSM_LAYOUT)."""
    layout = archs.SSM_LAYOUT.get(m.arch)
    if layout is None or not any(m.recurrent):
        return []
    inner, state = m.key("ssm.inner_size"), m.key("ssm.state_size")
    heads, groups = m.key("ssm.time_step_rank"), m.key("ssm.group_count")
    if layout == "mamba2":
        holds = _divides(heads, inner) and _divides(groups, inner)
        return [(holds, "ssm.time_step_rank and ssm.group_count > 0, dividing ssm.inner_size")]
    if layout == "plamo2":
        holds = groups == 0 and _divides(heads, inner)
        return [(holds, "ssm.group_count 0 and ssm.time_step_rank > 0 dividing ssm.inner_size")]
    holds = heads > 0 and _divides(groups, heads) and inner == state * heads
    what = "ssm.group_count > 0 dividing ssm.time_step_rank > 0, and ssm.inner_size == "
    return [(holds, what + "ssm.state_size x ssm.time_step_rank")]


def _attention_rules(m: _Model) -> list[Rule]:
    """Graph asserts on MLA, sparse-attention indexer and DeepSeek-V4 attention sizes."""
    if m.layer0 is None:
        return []
    rope, rules = m.layer0.rope, []
    if m.arch in archs.INDEXER_ROPE and m.has("attention.indexer.key_length"):
        rules.append((rope <= m.key("attention.indexer.key_length"),
                      "attention.indexer.key_length >= the rope dimensions (layer 0)"))  # fmt: skip
    if m.arch in archs.INDEXER_SHARED_AFTER_FULL and m.has("attention.indexer.types"):
        types = m.layers("attention.indexer.types", m.n_main)
        first = next((il for il, recurrent in enumerate(m.recurrent) if not recurrent), None)
        rules.append((first is None or types[first] != 0,
                      "attention.indexer.types != 0 on the first attention layer"))  # fmt: skip
    if m.arch in archs.MLA_NOPE:
        mla = m.key("attention.key_length_mla"), m.key("attention.value_length_mla")
        key = mla[0] if all(mla) else m.layer0.key
        rules.append((key > rope, "attention.key_length_mla (else key_length) > rope dimensions"))
    if m.arch in archs.KEYS_FOR_EVERY_HEAD:
        what = "attention.head_count_kv == head_count on every layer (a key for every query head)"
        rules.append((m.kv_heads_match, what))
    if m.arch in archs.MLA_LATENT:
        rules += _mla_rules(m)
    if m.arch in archs.INDEXER_ROTATED and m.has("attention.indexer.key_length"):
        length = int(m.key("attention.indexer.key_length"))
        rules.append((length >= 64 and length & (length - 1) == 0,
                      "attention.indexer.key_length a power of two >= 64 (its Hadamard "
                      "rotation's size)"))  # fmt: skip
    if m.arch == "olmoe":  # its key norm and query reshape span embedding_length
        n_embd = m.key("embedding_length")
        rules.append((all(h * m.layer0.key == n_embd for h in m.heads[: m.n_main]),
                      "key_length x head_count == embedding_length"))  # fmt: skip
    if m.arch in archs.NOPE_ONLY and not all(m.recurrent):
        rules.append((rope == 0, "rope.dimension_count == 0 (its MLA has no rope)"))
    hc = m.key("hyper_connection.count")
    if m.arch in archs.DSV4_ATTENTION and (m.arch != "dflash" or hc > 0):
        groups = m.key("attention.output_group_count")
        rules += [(hc == 4, "hyper_connection.count == 4"),
                  (_divides(groups, m.heads[0]),
                   "attention.output_group_count > 0, dividing head_count")]  # fmt: skip
    return rules


def _mla_rules(m: _Model) -> list[Rule]:
    """The latent key cache's width (archs.MLA_LATENT), or a key for every query head."""
    assert m.layer0 is not None
    attention = [kv for kv in m.heads_kv[: m.n_main] if kv > 0]
    if m.key("attention.key_length_mla") and m.key("attention.value_length_mla"):
        latent = m.key("attention.kv_lora_rank") + m.layer0.rope
        one = "attention.head_count_kv == 1 on attention layers (one latent key a token)"
        width = "attention.key_length == kv_lora_rank + rope dimensions (its latent key)"
        return [(all(kv == 1 for kv in attention), one), (m.layer0.key == latent, width)]
    if m.arch in archs.MLA_OR_EVERY_HEAD:
        what = "attention.head_count_kv == head_count without key_length_mla and value_length_mla"
        return [(m.kv_heads_match, f"{what} (a key for every query head)")]
    return []


def _rwkv_rules(m: _Model) -> list[Rule]:
    """RWKV graphs: the token shift each supports, and the wkv heads embedding_length splits
    into (divided by at load and in the graph; RWKV-7's a multiple of the kernel's step)."""
    shift = archs.TOKEN_SHIFT.get(m.arch)
    if shift is None:
        return []
    size, n_embd = m.key("wkv.head_size"), m.key("embedding_length")
    whole = 0 < size <= n_embd and n_embd % size == 0
    rules = [(m.key("token_shift_count", 2) == shift, f"token_shift_count == {shift}"),
             (whole, "wkv.head_size > 0, dividing embedding_length")]  # fmt: skip
    step = archs.WKV7_STEP.get(m.arch)
    if step is not None:
        what = f"wkv.head_size a multiple of {step} (the CPU kernel's step: other sizes read "
        rules.append((size % step == 0, what + "and write past its rows)"))
    if m.arch in archs.WKV_KV_GROUPS and whole:
        n_head = n_embd // size
        if m.arch == "rwkv6":  # its key and value weights are full width: no groups
            ok = all(kv in (0, n_head) for kv in m.heads_kv[: m.n_main])
            rules.append((ok, "head_count_kv 0 or embedding_length / wkv.head_size"))
        else:
            ok = all(kv in (0, n_head) or n_head % kv == 0 for kv in m.heads_kv[: m.n_main])
            rules.append((ok, "head_count_kv dividing embedding_length / wkv.head_size"))
    if m.arch == "rwkv6" and m.tensors:
        names = ("time_mix_lerp_fused", "time_mix_lerp_w")
        lerp = [{f"blk.{il}.{name}.weight" for name in names} & m.tensors.keys()
                for il in range(m.n_main)]  # fmt: skip
        rules.append((all(lerp), "blk.N.time_mix_lerp_fused or time_mix_lerp_w in every layer"))
    return rules


def _graph_rules(m: _Model) -> list[Rule]:
    """Graph and loader asserts of single architectures on per-layer values."""
    if m.arch == "deepseek2-ocr" and m.layer0 is not None:
        head = m.key("embedding_length") // m.heads[0] if m.heads[0] else 0
        return [
            (head > 0 and m.layer0.key == m.layer0.value == head,
             "key_length == value_length == embedding_length / head_count"),
            (abs(m.key("rope.freq_base", 10000.0) - 10000.0) < 1e-4, "rope.freq_base == 10000"),
        ]  # fmt: skip
    if m.arch in ("lfm2", "lfm2moe"):
        return _lfm2_rules(m)
    if m.arch == "minimax-m3":
        index_heads = m.key("attention.indexer.head_count")
        sparse = m.heads_kv[int(m.key("leading_dense_block_count")) : m.n_main]
        holds = all(kv == index_heads for kv in sparse) and _divides(index_heads, m.heads[0])
        what = "attention.indexer.head_count == head_count_kv of the layers past "
        return [(not sparse or holds, what + "leading_dense_block_count, dividing head_count")]
    if m.arch in ("nemotron_h", "nemotron_h_moe") and m.key("expert_count") > 0:
        ffn = zip(m.layers("feed_forward_length"), m.layers("expert_used_count"), strict=True)
        holds = all(used > 0 for ff, used in list(ffn)[: m.n_main] if ff > 0)
        return [(holds, "expert_used_count > 0 on every layer with feed_forward_length > 0")]
    if m.arch == "wavtokenizer-dec":
        posnet, convnext = m.key("posnet.embedding_length"), m.key("convnext.embedding_length")
        return [
            (m.key("posnet.block_count") <= 6, "posnet.block_count <= 6 (its layer kinds)"),
            (posnet == convnext, "posnet.embedding_length == convnext.embedding_length"),
        ]
    if m.arch == "eagle3":
        return [(m.n_main == 1, "block_count - nextn_predict_layers == 1")]
    if m.arch == "llama4":
        return _llama4_rules(m)
    if m.arch == "deepseek4":  # (without embedding_length llama.cpp refuses the file)
        return _deepseek4_rules(m) if m.layer0 is not None else []
    if m.arch in archs.INDEXER_ROTATED:  # the indexer's cache (and rotation) needs main layers
        rules = [(m.n_main > 0, "block_count > nextn_predict_layers (its indexer's layers)")]
        if m.arch == "dots3note" and m.has("attention.indexer.types"):
            types = m.layers("attention.indexer.types", m.n_main)
            rules.append((any(types), "a main layer with attention.indexer.types != 0"))
        return rules
    if m.arch == "granite_swa" and isinstance(
        pattern := m.metadata.get(f"{m.arch}.attention.rope_pattern"), GgufArray
    ):  # its graph builds the positions input whether a layer ropes or not
        ropes = any(pattern.values[: m.n_main]) if pattern.values is not None else True
        return [(ropes, "a layer with rope in attention.rope_pattern (its graph always "
                        "builds the positions input)")]  # fmt: skip
    if m.arch in archs.DEEPSTACK_AFTER_LAYER:
        return [(m.key("n_deepstack_layers") < m.n_main, "n_deepstack_layers < block_count")]
    if m.arch in ("deepseek2", "mistral4") and m.key("attention.temperature_scale"):
        length = m.key("attention.temperature_length")
        return [(length > 0, "attention.temperature_length > 0 with a temperature_scale")]
    if m.arch == "afmoe":  # its graph builds sliding-window inputs whatever the window
        return [(m.key("attention.sliding_window") > 0, "attention.sliding_window > 0")]
    if m.arch in archs.T5_BUCKETS:
        return _t5_rules(m)
    return []


def _deepseek4_rules(m: _Model) -> list[Rule]:
    """DeepSeek-V4 writes one key a token into caches sized by head_count_kv; its lightning
    indexer's cache holds the ratio-4 layers and the heavily compressed one the ratio-128
    layers, and an empty one whose rotation is forced (indexer key length == key_length)
    divides by zero; the rotation needs indexer keys in multiples of 64; hash layers route by
    an I32 table."""
    assert m.layer0 is not None
    value = m.metadata.get(f"{m.arch}.attention.compress_ratios")
    ratios = (
        list(value.values[: m.n_layer]) if isinstance(value, GgufArray) and value.values else []
    )
    indexer = m.key("attention.indexer.key_length")
    rules = [
        (all(kv == 1 for kv in m.heads_kv[: m.n_main]), "attention.head_count_kv == 1"),
        (4 in ratios, "a layer of attention.compress_ratios 4 (its lightning indexer's)"),
        (128 in ratios or m.layer0.key != indexer,
         "a layer of attention.compress_ratios 128 unless key_length != indexer.key_length"),
        (indexer > 0 and indexer % 64 == 0, "attention.indexer.key_length a multiple of 64"),
    ]  # fmt: skip
    hashed = min(int(m.key("hash_layer_count")), m.n_layer)  # a count, not a list, in the file
    tables = [f"blk.{il}.ffn_gate_tid2eid.weight" for il in range(hashed)]
    wrong = [t for t in tables if t in m.tensors and m.tensors[t][1] != lib.GGML_TYPE_I32]
    rules.append((not wrong, "hash layers' ffn_gate_tid2eid tables of type I32"))
    return rules


def _llama4_rules(m: _Model) -> list[Rule]:
    """Llama 4 builds the attention temperature input of its NoPE layers (every fourth) always:
    without such a layer, or with sliding_window 0 (no temperature set), it aborts filling it."""
    no_window = m.has("attention.sliding_window") and m.key("attention.sliding_window") == 0
    return [(not no_window, "attention.sliding_window > 0 where given"),
            (m.n_main >= 4, "at least 4 layers (its fourth has no rope)")]  # fmt: skip


def _t5_rules(m: _Model) -> list[Rule]:
    """T5's relative position buckets and the layer-0 biases every layer falls back to."""
    low, high = archs.T5_BUCKETS[m.arch]
    buckets = m.key("attention.relative_buckets_count")
    rules = [(low <= buckets < high, f"attention.relative_buckets_count in {low}..{high - 1}")]
    missing = [
        name for name in archs.T5_LAYER0_BIASES[m.arch] if m.tensors and name not in m.tensors
    ]
    what = "layer 0's relative position biases, every layer's fallback"
    rules.append((not missing, f"{what}; {missing[0]} is missing" if missing else what))
    return rules


def _layer_tensor_rules(m: _Model) -> list[Rule]:
    """Layers a graph that builds inputs for both kinds needs of each kind, and tensors it uses
    that its loader reads as optional (archs.HYBRID_INPUTS, archs.LAYER_TENSORS)."""
    rules = []
    if m.arch in archs.HYBRID_INPUTS and m.n_main > 0:
        why = "(its graph's inputs serve both kinds)"
        rules += [(any(m.recurrent), f"a recurrent layer {why}"),
                  (any(m.attention), f"an attention layer {why}")]  # fmt: skip
    if m.arch in archs.LAYER_TENSORS and m.tensors:
        rules.append(_layer_tensors_rule(m, *archs.LAYER_TENSORS[m.arch]))
    return rules


def _layer_tensors_rule(m: _Model, kind: str, alternatives: tuple[tuple[str, ...], ...]) -> Rule:
    """Each main layer of the kind has the tensors of the first alternative it has the first
    tensor of (else of the first alternative)."""
    what = " or ".join(", ".join(names) for names in alternatives)
    what = f"{what} in every {'recurrent ' if kind == 'recurrent' else ''}layer"
    for il in range(m.n_main):
        if kind == "recurrent" and not m.recurrent[il]:
            continue
        chosen = next((a for a in alternatives if f"blk.{il}.{a[0]}" in m.tensors), None)
        names = alternatives[0] if chosen is None else chosen
        missing = [name for name in names if f"blk.{il}.{name}" not in m.tensors]
        if missing:
            return (False, f"{what}; blk.{il}.{missing[0]} is missing")
    return (True, what)


def _lfm2_rules(m: _Model) -> list[Rule]:
    """LFM2: attention layers (head_count_kv > 0) assert equal key and value heads (layer 0's
    and their own), short-conv layers a conv of at least 2, and a centred (non-causal) conv an
    odd one, else a one-token sequence trips its size assert."""
    kv = m.heads_kv[: m.n_main]
    sizes = head_sizes(m.arch, m.metadata, m.heads[0])
    same = sizes is not None and len({*(s.key for s in sizes), *(s.value for s in sizes)}) == 1
    conv, causal = m.key("shortconv.l_cache"), m.metadata.get(f"{m.arch}.attention.causal", True)
    return [
        (not any(kv) or same, "equal key_length, value_length and their _swa values"),
        (all(kv) or conv > 1, "shortconv.l_cache > 1"),
        (all(kv) or causal is not False or conv % 2 == 1,
         "an odd shortconv.l_cache when attention.causal is false"),
    ]  # fmt: skip


def _tensor_rules(m: _Model) -> list[Rule]:
    """Loader and graph asserts comparing tensor shapes or types with the hyperparameters."""
    rules = []
    if m.arch == "laguna" and m.layer0 is not None:
        widths = [(m.ne1(f"blk.{il}.attn_gate.weight"), h) for il, h in enumerate(m.heads)]
        ok = all(w in (None, h, m.layer0.key * h) for w, h in widths[: m.n_main])
        rules.append((ok, "blk.N.attn_gate.weight of head_count or key_length x head_count rows"))
    if m.arch == "jina-bert-v2":
        n_ff = m.layers("feed_forward_length")[0]
        ups = [m.ne1(f"blk.{il}.ffn_up.weight") for il in range(m.n_main)]
        ok = all(up in (None, n_ff, 2 * n_ff) for up in ups)
        rules.append((ok, "blk.N.ffn_up.weight of feed_forward_length or twice as many rows"))
    if m.arch in ("qwen3vl", "qwen3tts"):
        out, embd = m.ne1("output.weight"), m.ne1("token_embd.weight")
        rules.append((out is None or embd is None or out <= embd,
                      "output.weight with no more rows than token_embd.weight"))  # fmt: skip
    if m.arch in ("eagle3", "dflash") and "d2t" in m.tensors:
        rules.append((m.tensors["d2t"][1] == lib.GGML_TYPE_I64, "a d2t tensor of type I64"))
    if m.arch == "dflash" and "markov_w1.weight" in m.tensors:
        block_size = uint(m.metadata, f"{m.arch}.block_size") or 0
        rules.append((block_size > 0, "block_size > 0 with a DSpark Markov head (markov_w1)"))
    if m.arch == "glm-dsa":
        rules.append(_glm_dsa_indexer_rule(m))
    if m.arch in archs.OUTPUT_EVERY_UBATCH:
        rows = m.ne1("token_embd.weight")
        rules.append((rows is None or rows >= archs.CHAMELEON_MIN_VOCAB,
                      f"a vocabulary of at least {archs.CHAMELEON_MIN_VOCAB} tokens (its "
                      "graph hides image tokens 4..8195)"))  # fmt: skip
    if m.has("embedding_length_out"):
        rules.append(_output_width_rule(m))
    return rules


def _output_width_rule(m: _Model) -> Rule:
    """llama.cpp copies embedding_length_out floats a token (or a pooled sequence) out of the
    graph's output when it returns embeddings: past a narrower row a GGML_ASSERT (an abort),
    within a wider one the values strided wrongly. Only a few graphs make their output that
    wide; LFM2's with its dense_2_out projection (whose shape llama.cpp then checks)."""
    equal = m.key("embedding_length_out") == m.key("embedding_length")
    if m.arch in archs.OWN_OUTPUT_WIDTH:
        return (True, "")
    if m.arch in ("lfm2", "lfm2moe"):
        return (
            equal or "dense_2_out.weight" in m.tensors,
            "embedding_length_out equal to embedding_length without a dense_2_out tensor",
        )
    return (equal, "embedding_length_out equal to embedding_length (its graph's output width)")


def _glm_dsa_indexer_rule(m: _Model) -> Rule:
    """glm-dsa loads the indexer tensors as optional, but its graph multiplies by them on every
    layer attention.indexer.types (or its default) marks full: a null-tensor dereference. Only
    layers whose attn_norm is there are checked (without it llama.cpp throws, or the file is
    MTP-only, refused by the MTP rule)."""
    if m.has("attention.indexer.types"):
        full = [t != 0 for t in m.layers("attention.indexer.types", m.n_main)]
    elif m.key("context_length") < archs.GLM_DSA_PATTERN_CONTEXT:
        full = [True] * m.n_main
    else:
        full = [il in archs.GLM_5_2_FULL_INDEXER_LAYERS for il in range(m.n_main)]
    missing = [
        f"blk.{il}.{name}.weight"
        for il in range(m.n_main)
        if full[il] and f"blk.{il}.attn_norm.weight" in m.tensors
        for name in archs.GLM_DSA_FULL_INDEXER_TENSORS
        if f"blk.{il}.{name}.weight" not in m.tensors
    ]
    what = "the indexer tensors on each full-indexer layer (attention.indexer.types)"
    return (not missing, f"{what}; {missing[0]} is missing" if missing else what)


_RULES = (_hparam_rules, _table_rules, _ssm_rules, _attention_rules, _rwkv_rules, _graph_rules,
          _layer_tensor_rules, _tensor_rules)  # fmt: skip


def check_arch_rules(
    reader: Reader,
    arch: str,
    metadata: dict[str, Any],
    tensors: list[Any],
    n_layer: int,
    layer0: HeadSize | None,
) -> None:
    """Raise unless every rule holds; ``tensors`` as read_file lists them, ``layer0`` as
    check_attention returns it."""
    shapes = {name: (dims, ggml_type) for name, dims, ggml_type, _ in tensors}
    m = _Model(reader, arch, metadata, shapes, n_layer, layer0)
    for rules in _RULES:
        for holds, what in rules(m):
            if not holds:
                raise m.reader.fail(f"{m.arch} needs {what}")
