"""Per-architecture facts of the pinned llama.cpp that validate_gguf needs: which archs use
sliding-window attention and with which layer pattern, which graphs assert equal head sizes,
which rope with M-RoPE sections, and the loader and graph invariants of single architectures
(experts, recurrent layers, MLA, indexers, RWKV). Names are ``general.architecture`` values;
the sources are ``src/models/<arch>.cpp`` and ``llama_model_rope_type``. docs/native-aborts.md
says how to re-derive them when llama.cpp is bumped."""

from __future__ import annotations

# load_swa_pattern(ml, default, dense_first) in load_arch_hparams; None: the arch reads
# {arch}.attention.sliding_window_pattern as a required array instead.
SwaPattern = tuple[int, bool] | None

SWA_ALWAYS: dict[str, SwaPattern] = {
    "cohere2": (4, False),
    "cohere2moe": (4, True),
    "exaone-moe": (4, False),
    "gemma-embedding": (6, False),
    "gemma2": (2, False),
    "gemma3n": (5, False),
    "gpt-oss": (2, False),
    "muse-glimmer": (4, False),
    "gemma4": None,
    "granite_swa": None,
    "maple": None,
    "mimo2": None,
    "spark2_5": None,
    "step35": None,
}
# SWA only when {arch}.attention.sliding_window > 0.
SWA_IF_WINDOW: dict[str, SwaPattern] = {
    "afmoe": (4, False),
    "gemma3": (6, False),
    "laguna": (4, True),
    "mellum": (4, False),
    "modern-bert": (3, True),
    "olmo2": (4, False),
    "plamo3": (8, False),
    "smallthinker": (4, True),
    "dflash": None,
}
# exaone4 (SWA when block_count - nextn_predict_layers == 64) and llama4 (chunked unless
# sliding_window == 0) use the pattern (4, False); deepseek4, and dflash with hyper-connections,
# mark every layer SWA.
SWA_DEFAULT = (4, False)
# Encoders without a KV cache skip create_memory's assert, but their graph input fills both
# attention masks, and asserts on one that no layer uses (left unallocated).
SWA_WITHOUT_KV_CACHE = frozenset({"gemma-embedding", "modern-bert"})
# Graphs whose output is embedding_length_out wide (src/models/<arch>.cpp builds it so): in any
# other, a different embedding_length_out is a width llama.cpp reads its outputs at wrongly.
OWN_OUTPUT_WIDTH = frozenset({"deepseek4", "gemma4-assistant", "wavtokenizer-dec"})

# Graphs that assert, at layer 0, value head size == key head size ...
HEADS_K_EQ_V = frozenset({
    "afmoe", "bailingmoe2", "bert", "bitnet", "bloom", "chatglm", "cohere2", "command-r",
    "deepseek4", "dflash", "eagle3", "eurobert", "glm4", "glm4moe", "gpt2", "gptneox",
    "granitehybrid", "jais", "laguna", "maple", "minimax-01", "minimax-m2", "minimax-m3",
    "modern-bert", "mpt", "muse-glimmer", "nanbeige", "nemotron", "nemotron_h", "neo-bert",
    "openelm", "phi2", "phi3", "qwen", "qwen35", "qwen35moe", "qwen3next", "qwen4exp", "refact",
    "spark2_5", "stablelm", "starcoder", "t5", "t5encoder"
})  # fmt: skip
# ... and also == rope dimensions.
HEADS_K_EQ_V_EQ_ROT = frozenset({
    "apertus", "arcee", "arctic", "baichuan", "chameleon", "codeshell", "cogvlm", "cohere2moe",
    "dbrx", "deci", "deepseek", "dots1", "dream", "ernie4_5", "ernie4_5-moe", "exaone",
    "exaone-moe", "exaone4", "falcon", "granite", "granite_swa", "granitemoe", "graniteswitch",
    "grok", "grovemoe", "hunyuan-dense", "hunyuan-moe", "hunyuan_vl", "hy_v3", "internlm2",
    "jais2", "llada", "llada-moe", "llama", "llama-embed", "llama4", "maincoder", "mellum",
    "minicpm", "mistral3", "olmo", "olmo2", "olmoe", "orion", "paddleocr", "pangu-embedded",
    "plamo", "pockettts",
    "qwen2", "qwen2moe", "qwen2vl", "qwen3", "qwen3moe", "qwen3tts", "qwen3vl", "qwen3vlmoe",
    "rnd1", "seed_oss", "smallthinker", "smollm3", "starcoder2", "talkie", "xverse"
})  # fmt: skip
# gemma4 asserts key == value head size on every layer (its SWA sizes are checked by a throw).
HEADS_K_EQ_V_EVERY_LAYER = frozenset({"gemma4"})
# Graphs that size a layer's heads by its own kind (sliding-window or not: n_embd_head_k(il),
# or MLA sizes of each kind). Every other graph sizes them all by layer 0's, while the KV cache
# takes each layer's, so where the kinds mix their head sizes must agree (cohere2moe with
# attention.key_length_swa = 1000 aborted in ggml_set_rows when its context was made).
HEADS_BY_LAYER_KIND = frozenset({"dots3note", "gemma4", "gemma4-assistant", "lfm2", "spark2-5"})
# Graphs whose Q/K/V are rope-dimension heads on every layer (gpt-oss and bailingmoe size
# their tensors by rope.dimension_count): the full and sliding-window key and value lengths
# (and rope dimensions) must all equal it, else the KV cache is another width.
HEADS_ALL_ROPE = frozenset({"bailingmoe", "gpt-oss"})
# Graphs that rope whole heads by rope.dimension_count (and its _swa value): ggml's CPU rope
# kernel loops for ever over 0 dimensions (ops.cpp, "skip the rotated channels"), where the
# graphs without rope, the MLA ones (a rope slice as wide as the dimensions) and glm5-next
# (which asserts 0) are fine with it.
ROPE_WHOLE_HEAD = frozenset({
    "afmoe", "bailingmoe2", "bitnet", "chatglm", "cohere2", "command-r", "eagle3", "eurobert",
    "falcon-h1", "gemma", "gemma-embedding", "gemma2", "gemma3", "gemma3n", "gemma4",
    "gemma4-assistant", "glm4", "glm4moe", "gptneox", "granitehybrid", "hrm_text",
    "jina-bert-v3", "laguna", "lfm2", "lfm2moe", "maple", "mimo2", "minimax-01", "minimax-m2",
    "minimax-m3", "modern-bert", "muse-glimmer", "nanbeige", "nemotron", "neo-bert",
    "nomic-bert", "nomic-bert-moe", "openelm", "phi2", "phi3", "phimoe", "plamo2", "plamo3",
    "qwen", "qwen3next", "spark2_5", "stablelm", "step35",
})  # fmt: skip

# Archs whose rope uses {arch}.rope.dimension_sections (M-RoPE): always, when the first two
# sections are > 0 (hparams.use_mrope), or when any section is non-zero.
MROPE_ALWAYS = frozenset(
    {"paddleocr", "qwen2vl", "qwen35", "qwen35moe", "qwen3tts", "qwen3vl", "qwen3vlmoe", "qwen4exp"}
)
MROPE_IF_FIRST_TWO = frozenset({"bailingmoe3", "glm4", "glm4moe", "hunyuan_vl"})
MROPE_IF_ANY = frozenset({"dflash"})

# gemma3n hard-codes the layer from which layers reuse earlier KV; gemma4 derives it from
# {arch}.attention.shared_kv_layers.
GEMMA3N_KV_FROM_START = 20

# dots3note reads {arch}.attention.sliding_window_pattern as is (get_arr), but its own
# create_memory branch has no "some layer is sliding-window" assert.
SWA_OWN_MEMORY = frozenset({"dots3note"})

# -- graph and loader invariants of single architectures (src/models/<arch>.cpp) ----------------

# Loaders that assert (or divide by) expert_count > 0 -- always, or once some main layer lies
# past {arch}.leading_dense_block_count. The generic checks then force expert_used_count > 0.
EXPERTS_REQUIRED = frozenset({
    "bailingmoe2", "glm4moe", "grovemoe", "llada-moe", "qwen35moe", "qwen4exp", "smallthinker"
})  # fmt: skip
EXPERTS_REQUIRED_PAST_DENSE_LEAD = frozenset({"lfm2moe"})

# Required keys a loader or graph divides by or asserts positive: a present value must be > 0.
POSITIVE_KEYS: dict[str, tuple[str, ...]] = {
    "ernie4_5-moe": ("interleave_moe_layer_step",),
    "grovemoe": ("experts_per_group",),
    "hy_v4": ("attention.key_length_mla", "attention.value_length_mla"),
    "wavtokenizer-dec": ("attention.group_norm_groups",),
}

# Loaders that divide embedding_length by head_count (layer 0): always (None), or only for the
# model type picked by that number of main layers (gemma2/gemma3 27B attention scale).
HEAD_COUNT_DIVIDES: dict[str, int | None] = {
    "gemma2": 46,
    "gemma3": 62,
    "olmo2": None,
    "phimoe": None,
}

# Which main layers are recurrent (state-space or linear attention): every one; those with
# head_count_kv == 0 (and feed_forward_length == 0 for nemotron_h); or, unless the file has
# {arch}.attention.recurrent_layers, all but every full_attention_interval-th (its default here:
# the loader divides by it).
RECURRENT_ALL = frozenset({"falcon-h1", "mamba2"})
RECURRENT_WITHOUT_KV = frozenset({
    "bailingmoe3", "glm5-next", "granitehybrid", "jamba", "kimi-k3", "kimi-linear", "lfm2",
    "lfm2moe", "plamo2",
})  # fmt: skip
RECURRENT_WITHOUT_KV_OR_FF = frozenset({"nemotron_h", "nemotron_h_moe"})
RECURRENT_INTERVAL: dict[str, int] = {
    "minimax-01": 8, "qwen35": 4, "qwen35moe": 4, "qwen3next": 4, "qwen4exp": 4
}  # fmt: skip

# Graphs whose inputs serve both kinds of layer (build_inp_mem_hybrid and its _k and _iswa
# forms): llama.cpp fills both every decode, and an input no layer of a kind uses has no buffer
# (GGML_ASSERT in ggml_backend_buffer_get_type). Attention layers are the non-recurrent ones;
# nemotron_h's those without a feed-forward too; falcon-h1's every layer (it runs both kinds).
HYBRID_INPUTS = frozenset({
    "bailingmoe3", "falcon-h1", "glm5-next", "granitehybrid", "jamba", "kimi-k3", "kimi-linear",
    "lfm2", "lfm2moe", "minimax-01", "nemotron_h", "nemotron_h_moe", "plamo2", "qwen35",
    "qwen35moe", "qwen3next", "qwen4exp",
})  # fmt: skip

# ssm.* layout the recurrent layers' graph asserts: "mamba2" (build_mamba2_layer: time_step_rank
# and group_count > 0, both dividing inner_size), "plamo2" (group_count 0, time_step_rank
# dividing inner_size), "gated_delta" (delta net: group_count > 0 dividing time_step_rank,
# inner_size == state_size x time_step_rank).
SSM_LAYOUT: dict[str, str] = {
    "falcon-h1": "mamba2", "granitehybrid": "mamba2", "mamba2": "mamba2", "nemotron_h": "mamba2",
    "nemotron_h_moe": "mamba2", "plamo2": "plamo2", "qwen35": "gated_delta",
    "qwen35moe": "gated_delta", "qwen3next": "gated_delta", "qwen4exp": "gated_delta",
}  # fmt: skip
# Loaders asserting ssm.inner_size == 2 x embedding_length.
SSM_INNER_TWICE_EMBEDDING = frozenset({"granitehybrid", "jamba"})

# Graphs that rope the sparse-attention indexer head with the model's rope dimensions.
INDEXER_ROPE = frozenset({"deepseek32", "deepseek4", "dots3note", "glm-dsa", "minimax-m3"})
# Graphs where a "shared" indexer layer (attention.indexer.types[il] == 0) reuses the top-k of
# an earlier attention layer, so the first attention layer must compute its own.
INDEXER_SHARED_AFTER_FULL = frozenset({"glm-dsa", "glm5-next"})
# MLA loaders asserting a non-rotary part: key_length_mla (else key_length) > rope dimensions.
MLA_NOPE = frozenset({"deepseek2", "hy_v4", "mistral4"})
# Graphs that build a key (and value) for every query head and store them in a cache sized
# for head_count_kv heads: ggml_set_rows / ggml_reshape assert unless the two are equal.
KEYS_FOR_EVERY_HEAD = frozenset(
    {"deepseek2-ocr", "dots1", "minicpm3", "olmoe", "plm", "t5", "t5encoder"}
)
# T5's relative position buckets (llama_relative_position_bucket, max_distance 128): a
# bidirectional encoder halves the count, then needs an exact range of at least 1 and below 128
# (else log(0) or a non-positive log(128 / range) gives negative buckets: an out-of-bounds
# ggml_get_rows); t5's causal decoder uses the whole count. Both fall back to layer 0's
# attn_rel_b, which the loader reads as optional.
T5_BUCKETS: dict[str, tuple[int, int]] = {"t5": (4, 256), "t5encoder": (4, 512)}
T5_LAYER0_BIASES: dict[str, tuple[str, ...]] = {
    "t5": ("enc.blk.0.attn_rel_b.weight", "dec.blk.0.attn_rel_b.weight"),
    "t5encoder": ("enc.blk.0.attn_rel_b.weight",),
}

# Graphs that store one latent key a token when both attention.key_length_mla and
# value_length_mla are set: every attention layer must then have one KV head of key_length ==
# kv_lora_rank + rope dimensions (the cache's width); deepseek2's (and mistral4's) other graph
# makes a key for every query head instead.
MLA_LATENT = frozenset({
    "bailingmoe3", "deepseek2", "deepseek32", "glm-dsa", "glm5-next", "hy_v4", "kimi-k3",
    "kimi-linear", "mistral4",
})  # fmt: skip
MLA_OR_EVERY_HEAD = frozenset({"deepseek2", "mistral4"})
# Graphs adding deepstack input to the first n_deepstack_layers layers' outputs, after the last
# layer kept only the output rows: the last layer must not be one of them.
DEEPSTACK_AFTER_LAYER = frozenset({"qwen3vl", "qwen3vlmoe"})
# Graphs that read head_count_kv layer by layer; every other graph sizes its keys by layer 0's
# count while the KV cache takes each layer's, so a head_count_kv array must be uniform there
# (the converters write arrays only for these).
PER_LAYER_KV_HEADS = frozenset({
    "bailingmoe3", "deci", "gemma4", "glm5-next", "granitehybrid", "jamba", "kimi-k3",
    "kimi-linear", "laguna", "lfm2", "lfm2moe", "mimo2", "nemotron_h", "nemotron_h_moe",
    "openelm", "plamo2", "plamo3", "spark2_5", "step35",
})  # fmt: skip
# Graphs that route each layer's own expert_used_count; the others route layer 0's and then
# sum each layer's count of them (past the end: an abort; fewer: wrong outputs).
PER_LAYER_EXPERTS_USED = frozenset({"nemotron_h", "nemotron_h_moe"})
# Graphs rotating the sparse-attention indexer's keys by a Hadamard matrix of 64 rows, or of
# the largest power of two dividing its key length when 128 does: the key length must be it.
INDEXER_ROTATED = frozenset({"deepseek32", "dots3note", "glm-dsa"})
# Loaders that read expert_gating_func as optional and set no default: without it the MoE
# layers reach GGML_ABORT in build_moe_ffn.
GATING_REQUIRED = frozenset({"dots1", "hy_v4", "minimax-m2", "smallthinker"})

# MLA graphs without rope at all.
NOPE_ONLY = frozenset({"glm5-next"})
# DeepSeek-V4 attention with hyper-connections (dflash only with hyper_connection.count > 0).
DSV4_ATTENTION = frozenset({"deepseek4", "dflash"})

# RWKV graphs: the token_shift_count each asserts (the key defaults to 2).
TOKEN_SHIFT: dict[str, int] = {"arwkv7": 1, "rwkv6": 2, "rwkv6qwen2": 1, "rwkv7": 2}
# RWKV-7 graphs: ggml's CPU wkv7 kernel walks each head GGML_F32_STEP floats at a time (64
# with AVX-512, 32 or 16 elsewhere) with no tail, so a head of another size reads and writes
# past its rows (garbage or NaN; the last row past the tensors).
WKV7_STEP: dict[str, int] = {"arwkv7": 64, "rwkv7": 64}
# RWKV6 time mix repeating head_count_kv groups of heads.
WKV_KV_GROUPS = frozenset({"rwkv6", "rwkv6qwen2"})

# Loaders that make the trunk tensors optional when nextn_predict_layers > 0 and
# blk.0.attn_norm.weight is missing (a file for MTP drafting only): the main graph then runs on
# null tensors.
MTP_TRUNK_OPTIONAL = frozenset({
    "bailingmoe3", "cohere2moe", "deepseek2", "deepseek32", "deepseek4", "glm-dsa", "glm4moe",
    "hy_v3", "mimo2", "mistral4", "nemotron_h", "nemotron_h_moe", "qwen35", "qwen35moe",
    "qwen3next", "step35",
})  # fmt: skip

# glm-dsa's attention.indexer.types when the file has none (load_arch_hparams): every main layer
# "full" when context_length < GLM_DSA_PATTERN_CONTEXT (GLM-5, 5.1), else GLM-5.2's pattern
# (GLM_5_2_DEFAULT_INDEXER_TYPES: layers 0, 1, then every fourth from 2 up to 74).
GLM_DSA_PATTERN_CONTEXT = 1048576
GLM_5_2_FULL_INDEXER_LAYERS = frozenset({0, 1, *range(2, 78, 4)})
# The indexer tensors the glm-dsa graph multiplies on a full-indexer layer
# (blk.N.<name>.weight); the loader reads them as optional (k_norm may be absent).
GLM_DSA_FULL_INDEXER_TENSORS = ("indexer.attn_q_b", "indexer.attn_k", "indexer.proj")

# Tensors the loaders read as optional but the graphs multiply by, on every main layer ("all")
# or every recurrent one: alternatives, the first whose first tensor a layer has being the one
# its graph takes (a null-tensor dereference without the rest). phi3 and pockettts take fused
# or separate attention weights; build_mamba2_layer adds the conv bias unconditionally;
# qwen35's delta net multiplies by its fused projections, qwen3next's by them or (legacy) ssm_in.
_MAMBA2_BIAS = ("recurrent", (("ssm_conv1d.bias",),))
_QWEN35_PROJECTIONS = ("recurrent", (("attn_qkv.weight", "attn_gate.weight"),))
LAYER_TENSORS: dict[str, tuple[str, tuple[tuple[str, ...], ...]]] = {
    "phi3": ("all", (("attn_qkv.weight",), ("attn_q.weight", "attn_k.weight", "attn_v.weight"))),
    "pockettts": ("all", (("attn_qkv.weight",),
                          ("attn_q.weight", "attn_k.weight", "attn_v.weight"))),
    "falcon-h1": _MAMBA2_BIAS, "granitehybrid": _MAMBA2_BIAS, "nemotron_h": _MAMBA2_BIAS,
    "nemotron_h_moe": _MAMBA2_BIAS,
    "qwen35": _QWEN35_PROJECTIONS, "qwen35moe": _QWEN35_PROJECTIONS,
    "qwen3next": ("recurrent", (("attn_qkv.weight", "attn_gate.weight"), ("ssm_in.weight",))),
}  # fmt: skip

# Contexts single graphs abort on, whatever the file: qwen4exp and deepseek4 say their
# embeddings are hyper_connection.count times wider than their graph's output (llama.cpp reads
# past it);
# plm's flash-attention path views its flattened values with the token count as the head
# count (a batch of two tokens or more); chameleon hides image tokens 4..8195 in each
# micro-batch's logits, asserting there are some (so an output row in every micro-batch, and
# a vocabulary past 8195).
EMBEDDINGS_ABORT = frozenset({"deepseek4", "qwen4exp"})
# Speculative drafters that read the target model's context (ctx_other): dflash's and eagle3's
# encoder takes its hidden states (an embeddings batch target_layers x its width wide), so
# encoding tokens dereferences a null input; gemma4-assistant refuses a context without it.
TARGET_DRAFTERS = frozenset({"dflash", "eagle3", "gemma4-assistant"})
NO_FLASH_ATTENTION = frozenset({"plm"})
OUTPUT_EVERY_UBATCH = frozenset({"chameleon"})
CHAMELEON_MIN_VOCAB = 8196

# Graphs that abort on embedding input (an image or audio from a projector): graniteswitch
# always (granite-switch.cpp asserts ubatch.token), these unless llama_model_rope_type is M-RoPE
# (glm4.cpp / glm4-moe.cpp: rope.dimension_sections[0] and [1] > 0, hparams.use_mrope()).
TOKENS_ONLY = frozenset({"graniteswitch"})
EMBEDDINGS_NEED_MROPE = frozenset({"glm4", "glm4moe"})

# Graphs that compute no logits, only the embeddings (an encoder without a language-model
# head): llama.cpp leaves a decode's logits unwritten, and a "generation" samples from zeros.
# src/models/<arch>.cpp without res->t_logits, with the graphs others use: bert's (jina-bert-v2
# and -v3, nomic-bert and -moe), llama's graph<true> (llama-embed), t5's graph<true> (t5encoder).
NO_LOGITS = frozenset({
    "bert", "eurobert", "gemma-embedding", "jina-bert-v2", "jina-bert-v3", "llama-embed",
    "modern-bert", "neo-bert", "nomic-bert", "nomic-bert-moe", "t5encoder", "wavtokenizer-dec",
})  # fmt: skip
# Graphs that skip their language-model head in a context with embeddings on (lfm2.cpp: res->
# t_logits under `if (!cparams.embeddings)`; lfm2moe uses its graph): no logits there either.
NO_LOGITS_WITH_EMBEDDINGS = frozenset({"lfm2", "lfm2moe"})

# Keys llama.cpp reads only where the file has them ("%s": the architecture): its loader's
# get_key_or_arr, get_arr and get_arr_n, and the vocabulary's and precision policy's direct
# gguf reads, look the key up in the file before any override, so a kv_override of one the file
# lacks is ignored. (Some archs read sliding_window_pattern with get_key, others with get_arr.)
# tests/test_kv_overrides.py derives this from the pinned source.
READ_ONLY_FROM_FILE = frozenset({
    "%s.adapters.token_ids_activate", "%s.adapters.token_ids_substitute",
    "%s.attention.compress_ratios", "%s.attention.head_count", "%s.attention.head_count_kv",
    "%s.attention.indexer.types", "%s.attention.recurrent_layers", "%s.attention.rope_pattern",
    "%s.attention.sliding_window_pattern", "%s.classifier.output_labels",
    "%s.deepstack_mapping", "%s.expert_feed_forward_length", "%s.expert_used_count",
    "%s.feed_forward_length", "%s.ple.head_offsets", "%s.ple.head_vocab_sizes",
    "%s.ple.layer_multipliers", "%s.ple.layers", "%s.rope.dimension_sections",
    "%s.swiglu_clamp_exp", "%s.swiglu_clamp_shexp", "%s.target_layers",
    "general.tensor_extra.name", "general.tensor_extra.prec_a4", "tokenizer.ggml.merges",
    "tokenizer.ggml.precompiled_charsmap", "tokenizer.ggml.scores",
    "tokenizer.ggml.suppress_tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.tokens",
    "xielu.alpha_n", "xielu.alpha_p", "xielu.beta", "xielu.eps",
})  # fmt: skip


def read_only_from_file(key: str, arch: str) -> bool:
    """Whether llama.cpp reads ``key`` of an ``arch`` model only where the file has it."""
    generic = "%s" + key[len(arch) :] if key.startswith(f"{arch}.") else key
    return generic in READ_ONLY_FROM_FILE
