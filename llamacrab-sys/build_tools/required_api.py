"""The llama.cpp API that llamacrab and llamacrab_sys use, checked against the headers being bound.

A llama.cpp install a user brings (LLAMACRAB_LLAMA_CPP_PREFIX) may be older than the pin: the build
stops with the names it lacks instead of producing a module that fails later with an
AttributeError. The core is required; a feature group (multimodal, RPC) may be absent as a whole,
because upstream builds leave libmtmd and the RPC backend out unless asked, and llamacrab then
reports that feature as unavailable. tests/sys/test_required_api.py keeps these lists in step with
the names llamacrab's sources use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from build_tools.declarations import Declarations


def _words(text: str) -> list[str]:
    return text.split()


CORE_FUNCTIONS = _words("""
ggml_backend_dev_by_name ggml_backend_dev_by_type ggml_backend_dev_count
ggml_backend_dev_description ggml_backend_dev_get ggml_backend_dev_name ggml_backend_dev_type
ggml_backend_load ggml_backend_load_all_from_path ggml_backend_reg_count
ggml_backend_reg_dev_count ggml_backend_reg_dev_get ggml_backend_reg_get ggml_backend_reg_name
ggml_blck_size ggml_row_size ggml_type_name
llama_adapter_get_alora_invocation_tokens llama_adapter_get_alora_n_invocation_tokens
llama_adapter_lora_free llama_adapter_lora_init llama_adapter_meta_count
llama_adapter_meta_key_by_index llama_adapter_meta_val_str_by_index
llama_backend_free llama_backend_init llama_chat_apply_template llama_chat_builtin_templates
llama_context_default_params llama_decode llama_detokenize llama_free llama_get_causal_attn
llama_get_embeddings_ith llama_get_embeddings_seq llama_get_logits_ith llama_get_memory
llama_get_sampled_token_ith llama_init_from_model llama_log_set llama_max_devices
llama_max_parallel_sequences llama_memory_can_shift llama_memory_clear llama_memory_seq_add
llama_memory_seq_cp llama_memory_seq_div llama_memory_seq_keep llama_memory_seq_pos_max
llama_memory_seq_pos_min llama_memory_seq_rm llama_model_chat_template llama_model_default_params
llama_ftype_name
llama_model_desc llama_model_free llama_model_ftype llama_model_get_vocab llama_model_load_from_file
llama_model_meta_count llama_model_meta_key_by_index
llama_model_meta_val_str_by_index
llama_model_cls_label
llama_model_n_cls_out llama_model_n_ctx_train llama_model_n_embd llama_model_n_embd_out
llama_model_has_encoder llama_model_is_hybrid llama_model_is_recurrent
llama_model_has_decoder llama_model_decoder_start_token llama_encode
llama_model_quantize llama_model_quantize_default_params llama_numa_init
llama_model_n_layer llama_model_n_params llama_model_n_swa llama_model_rope_type
llama_model_size llama_n_batch
llama_n_ctx llama_n_ctx_seq llama_n_threads llama_n_threads_batch llama_n_ubatch llama_pooling_type
llama_print_system_info
llama_sampler_accept llama_sampler_apply llama_sampler_chain_add llama_sampler_chain_default_params
llama_sampler_chain_get llama_sampler_chain_init llama_sampler_chain_n llama_sampler_clone
llama_sampler_free
llama_sampler_init llama_sampler_init_adaptive_p llama_sampler_init_dist llama_sampler_init_dry
llama_sampler_init_grammar llama_sampler_init_grammar_lazy_patterns llama_sampler_init_greedy
llama_sampler_init_infill llama_sampler_init_logit_bias llama_sampler_init_min_p
llama_sampler_init_mirostat llama_sampler_init_mirostat_v2 llama_sampler_init_penalties
llama_sampler_init_temp llama_sampler_init_temp_ext llama_sampler_init_top_k
llama_sampler_init_top_n_sigma llama_sampler_init_top_p llama_sampler_init_typical
llama_sampler_init_xtc llama_sampler_name llama_sampler_reset llama_sampler_sample
llama_set_abort_callback llama_set_adapter_cvec llama_set_adapters_lora llama_set_causal_attn
llama_set_sampler llama_state_get_data llama_state_get_size llama_state_seq_get_data_ext
llama_state_seq_get_size_ext llama_state_seq_set_data_ext llama_state_set_data llama_synchronize
llama_token_to_piece llama_tokenize llama_vocab_bos
llama_vocab_eos llama_vocab_eot llama_vocab_fim_mid llama_vocab_fim_pre llama_vocab_fim_rep
llama_vocab_fim_sep llama_vocab_fim_suf llama_vocab_get_add_bos llama_vocab_get_add_eos
llama_vocab_get_add_sep llama_vocab_get_suppress_tokens llama_vocab_get_text llama_vocab_is_eog
llama_vocab_n_tokens llama_vocab_nl
llama_vocab_sep
llama_vocab_type
""")

CORE_CONSTANTS = _words("""
GGML_BACKEND_DEVICE_TYPE_ACCEL GGML_BACKEND_DEVICE_TYPE_CPU GGML_BACKEND_DEVICE_TYPE_GPU
GGML_BACKEND_DEVICE_TYPE_IGPU GGML_NUMA_STRATEGY_DISTRIBUTE GGML_NUMA_STRATEGY_ISOLATE
GGML_NUMA_STRATEGY_NUMACTL GGML_LOG_LEVEL_CONT GGML_LOG_LEVEL_DEBUG GGML_LOG_LEVEL_ERROR
GGML_LOG_LEVEL_INFO GGML_LOG_LEVEL_WARN GGML_TYPE_COUNT GGML_TYPE_F32 GGML_TYPE_I16 GGML_TYPE_I32
GGML_TYPE_I64 GGML_TYPE_I8 GGML_TYPE_NVFP4 LLAMA_FLASH_ATTN_TYPE_AUTO
LLAMA_FLASH_ATTN_TYPE_DISABLED LLAMA_FLASH_ATTN_TYPE_ENABLED LLAMA_KV_OVERRIDE_TYPE_BOOL
LLAMA_KV_OVERRIDE_TYPE_FLOAT LLAMA_KV_OVERRIDE_TYPE_INT LLAMA_KV_OVERRIDE_TYPE_STR
LLAMA_LOAD_MODE_MLOCK LLAMA_LOAD_MODE_MMAP LLAMA_LOAD_MODE_MMAP_MLOCK LLAMA_LOAD_MODE_NONE
LLAMA_POOLING_TYPE_CLS LLAMA_POOLING_TYPE_LAST LLAMA_POOLING_TYPE_MEAN LLAMA_POOLING_TYPE_NONE
LLAMA_POOLING_TYPE_RANK LLAMA_POOLING_TYPE_UNSPECIFIED LLAMA_ROPE_SCALING_TYPE_LINEAR
LLAMA_ROPE_SCALING_TYPE_LONGROPE LLAMA_ROPE_SCALING_TYPE_NONE LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED
LLAMA_ROPE_SCALING_TYPE_YARN LLAMA_ROPE_TYPE_IMROPE LLAMA_ROPE_TYPE_MROPE LLAMA_SPLIT_MODE_LAYER
LLAMA_SPLIT_MODE_NONE
LLAMA_SPLIT_MODE_ROW LLAMA_VOCAB_TYPE_BPE LLAMA_VOCAB_TYPE_NONE LLAMA_VOCAB_TYPE_SPM
LLAMA_VOCAB_TYPE_UGM LLAMA_VOCAB_TYPE_WPM
""")

# Fields llamacrab reads or sets, by struct (the names the C compiler must find in the headers).
CORE_FIELDS: dict[str, list[str]] = {
    "llama_model_params": _words("""n_gpu_layers main_gpu split_mode load_mode vocab_only
        check_tensors use_extra_bufts tensor_split devices kv_overrides progress_callback
        progress_callback_user_data"""),
    "llama_context_params": _words("""n_ctx n_batch n_ubatch n_seq_max n_threads n_threads_batch
        rope_freq_base rope_freq_scale yarn_ext_factor yarn_orig_ctx embeddings offload_kqv
        swa_full kv_unified flash_attn_type pooling_type rope_scaling_type type_k type_v"""),
    "llama_batch": _words("n_tokens token embd pos n_seq_id seq_id logits"),
    "llama_chat_message": _words("role content"),
    "llama_model_kv_override": _words("tag key val_i64 val_f64 val_bool val_str"),
    "llama_logit_bias": _words("token bias"),
    "llama_token_data_array": _words("data size selected sorted"),
    "llama_token_data": _words("id logit p"),
    "llama_sampler_i": _words("name accept apply reset free"),
    "llama_sampler": ["ctx"],
}


@dataclass(frozen=True)
class Group:
    """A feature llamacrab can do without, as long as all of it is absent rather than part."""

    name: str
    functions: tuple[str, ...]
    constants: tuple[str, ...] = ()
    fields: tuple[tuple[str, tuple[str, ...]], ...] = ()


OPTIONAL_GROUPS = (
    Group(
        "multimodal (libmtmd)",
        tuple(
            _words("""
        mtmd_bitmap_free mtmd_bitmap_get_n_bytes mtmd_bitmap_init mtmd_bitmap_init_from_audio
        mtmd_context_params_default mtmd_decode_use_mrope mtmd_decode_use_non_causal
        mtmd_default_marker mtmd_encode_chunk mtmd_free mtmd_get_audio_sample_rate
        mtmd_helper_bitmap_init_from_buf
        mtmd_helper_eval_chunks mtmd_helper_get_n_pos mtmd_helper_get_n_tokens
        mtmd_helper_init_opt_default mtmd_helper_log_set mtmd_init_from_file
        mtmd_input_chunk_get_n_tokens mtmd_input_chunk_get_tokens_text mtmd_input_chunk_get_type
        mtmd_input_chunks_free
        mtmd_input_chunks_get mtmd_input_chunks_init mtmd_input_chunks_size mtmd_support_audio
        mtmd_support_vision mtmd_tokenize
        """)
        ),
        ("MTMD_INPUT_CHUNK_TYPE_TEXT",),
        (
            ("mtmd_context_params", ("use_gpu", "print_timings", "n_threads")),
            ("mtmd_input_text", ("text", "text_len", "add_special", "parse_special")),
        ),
    ),
    Group(
        "RPC (ggml-rpc)",
        ("ggml_backend_rpc_add_server", "ggml_backend_rpc_start_server"),
    ),
)

# Added by llamacrab's patches to the pinned source (build_tools/patches.py): an install a user
# brings lacks them, and llamacrab does without (an image's encoding then runs to its end; cells
# freed after an output that overflowed keep their NaN).
PATCH_FUNCTIONS = ("mtmd_set_abort_callback", "llama_memory_seq_rm_zeroed")


class ApiTooOldError(SystemExit):
    """The headers lack functions, constants or struct fields that llamacrab needs."""


def _missing(
    decls: Declarations,
    functions: Sequence[str],
    constants: Sequence[str],
    fields: Mapping[str, Sequence[str]],
) -> list[str]:
    missing = [f"function {n}" for n in functions if n not in decls.functions]
    missing += [f"constant {n}" for n in constants if n not in decls.constants]
    for struct, names in fields.items():
        have = decls.structs.get(struct)
        if have is None:
            missing.append(f"struct {struct}")
        else:
            missing += [f"field {struct}.{n}" for n in names if n not in have]
    return missing


def check(decls: Declarations, origin: str) -> list[str]:
    """Raise ApiTooOldError naming what ``origin``'s headers lack; return the absent groups."""
    problems = _missing(decls, CORE_FUNCTIONS, CORE_CONSTANTS, CORE_FIELDS)
    absent = []
    for group in OPTIONAL_GROUPS:
        if not any(name in decls.functions for name in group.functions):
            absent.append(group.name)  # not built at all: fine, the feature is unavailable
            continue
        lacking = _missing(decls, group.functions, group.constants, dict(group.fields))
        problems += [f"{item} ({group.name})" for item in lacking]
    if problems:
        raise ApiTooOldError(
            f"llamacrab: the llama.cpp at {origin} is older than llamacrab needs (or built "
            f"without part of it); missing: {', '.join(problems)}. Build a newer llama.cpp, at "
            "least the pinned commit in llamacrab-sys/pin.json."
        )
    return absent
