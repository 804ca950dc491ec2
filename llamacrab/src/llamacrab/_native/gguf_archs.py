"""Per-architecture facts of the pinned llama.cpp that validate_gguf needs: which archs use
sliding-window attention and with which layer pattern, which graphs assert equal head sizes, and
which rope with M-RoPE sections. Names are ``general.architecture`` values; the sources are
``src/models/<arch>.cpp`` and ``llama_model_rope_type``. docs/native-aborts.md says how to
re-derive them when llama.cpp is bumped."""

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

# Graphs that assert, at layer 0, value head size == key head size ...
HEADS_K_EQ_V = frozenset({
    "afmoe", "bailingmoe2", "bert", "bitnet", "bloom", "chatglm", "cohere2", "command-r",
    "deepseek4", "dflash", "eagle3", "eurobert", "glm4", "glm4moe", "gpt2", "gptneox",
    "granitehybrid", "jais", "laguna", "maple", "minimax-01", "minimax-m2", "minimax-m3",
    "modern-bert", "mpt", "muse-glimmer", "nanbeige", "nemotron", "nemotron_h", "neo-bert",
    "openelm", "phi2", "phi3", "qwen", "qwen35", "qwen35moe", "qwen3next", "qwen4exp", "refact",
    "spark2_5", "stablelm", "starcoder", "t5"
})  # fmt: skip
# ... and also == rope dimensions.
HEADS_K_EQ_V_EQ_ROT = frozenset({
    "apertus", "arcee", "arctic", "baichuan", "chameleon", "codeshell", "cogvlm", "cohere2moe",
    "dbrx", "deci", "deepseek", "dots1", "dream", "ernie4_5", "ernie4_5-moe", "exaone",
    "exaone-moe", "exaone4", "falcon", "granite", "granite_swa", "graniteswitch", "grok",
    "grovemoe", "hunyuan-dense", "hunyuan-moe", "hunyuan_vl", "hy_v3", "internlm2", "jais2",
    "llada", "llada-moe", "llama", "llama-embed", "llama4", "maincoder", "mellum", "mistral3",
    "olmo", "olmo2", "olmoe", "orion", "paddleocr", "pangu-embedded", "plamo", "pockettts",
    "qwen2", "qwen2moe", "qwen2vl", "qwen3", "qwen3moe", "qwen3tts", "qwen3vl", "qwen3vlmoe",
    "rnd1", "seed_oss", "smallthinker", "smollm3", "starcoder2", "talkie", "xverse"
})  # fmt: skip
# gemma4 asserts key == value head size on every layer (its SWA sizes are checked by a throw).
HEADS_K_EQ_V_EVERY_LAYER = frozenset({"gemma4"})

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
