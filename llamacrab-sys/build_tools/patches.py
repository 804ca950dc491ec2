"""Changes llamacrab makes to the pinned llama.cpp source before building it.

Each patch is a list of exact text replacements in one file, every old text required to occur
exactly once: a pin whose source moved under a patch fails the build with the patch's name
instead of building something else. A patch says why it exists and what would retire it
(upstream taking the change). A local checkout (LLAMACRAB_LLAMA_CPP_DIR) is built as it is.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path


class PatchError(RuntimeError):
    """A patch does not apply to the llama.cpp tree it was given."""


@dataclass(frozen=True)
class SourcePatch:
    name: str
    path: str  # relative to the llama.cpp tree
    edits: tuple[tuple[str, str], ...]  # (old text, new text), each old text exactly once
    why: str


_ENCODE_ABORT_WHY = (
    "libmtmd encodes an image or a sound in one graph computed on clip's own backends, "
    "which have no abort callback: a close() or a Ctrl-C waited for the whole encode "
    "(seconds for a large image on a real projector, on the CPU). llamacrab points "
    "clip's backends at the context's abort flags for the encode, as llama_decode's are."
)

_ZEROED_WHY = (
    "Freed KV cells keep their data, and some attention kernels read cells their mask "
    "excludes: the CPU's flash attention multiplies whole tiles (NaN + -inf is NaN), and "
    "without flash attention the V product multiplies every cell by its weight (0 * NaN is "
    "NaN). A decode whose output overflowed (a LoRA scale of 1e30) leaves NaN in its cells, "
    "and every later prompt whose attention reaches them came out NaN too: one bad request "
    "broke a context, and on a server with a unified cache the other slots' requests. "
    "llamacrab removes a sequence with this function once a decode's output was not finite. "
    "Retired when upstream kernels skip masked cells or freed cells are cleared."
)

PATCHES: tuple[SourcePatch, ...] = (
    SourcePatch(
        name="ggml-cpu-aligned-work-buffer",
        path="ggml/src/ggml-cpu/ggml-cpu.cpp",
        edits=(
            (
                "        cpu_ctx->work_data = new uint8_t[cplan.work_size];\n",
                "        cpu_ctx->work_data = new uint8_t[cplan.work_size + 64];\n",
            ),
            (
                "    cplan.work_data = (uint8_t *)cpu_ctx->work_data;\n",
                "    cplan.work_data = (uint8_t *) GGML_PAD((uintptr_t) cpu_ctx->work_data, 64);\n",
            ),
        ),
        why=(
            "The CPU backend's work buffer (quantized activations, flash attention's tiles) comes "
            "from new[], 16-byte aligned: where malloc puts it decided prefill speed by up to "
            "~15% between processes, and between contexts of one process. On a cache line it "
            "is always the fast case (docs/aligned-work-buffer.md)."
        ),
    ),
    SourcePatch(
        name="ggml-amx-tile-config",
        path="ggml/src/ggml-cpu/amx/mmq.cpp",
        edits=(
            (
                "    _tile_loadconfig(&tc);\n",
                "#if defined(__GNUC__)\n"
                "    // llamacrab: the stores to tc must happen before ldtilecfg reads it\n"
                '    __asm__ __volatile__("" : : "r"(&tc) : "memory");\n'
                "#endif\n"
                "    _tile_loadconfig(&tc);\n",
            ),
        ),
        why=(
            "GCC 12's _tile_loadconfig (Debian 12's compiler) tells the compiler that ldtilecfg "
            "reads 8 bytes of the tile configuration, so at -O2 it drops the stores of the rest: "
            "the configuration loaded was stack garbage, a general protection fault (SIGSEGV) "
            "at the first matrix product on a CPU with AMX (every prompt of a Q4_K model on a "
            "Sapphire Rapids or newer Xeon), or wrong tile shapes where the garbage happened "
            "to be valid. A compiler barrier that sees the structure's address keeps the "
            "stores. GCC 13 and clang read the whole structure; the patch is harmless there."
        ),
    ),
    SourcePatch(
        name="llama-grammar-stack-bound",
        path="src/llama-grammar.cpp",
        edits=(
            (
                "    grammar.stacks = std::move(stacks_new);\n"
                "    grammar.partial_utf8 = decoded.second;\n",
                "    grammar.stacks = std::move(stacks_new);\n"
                "    grammar.partial_utf8 = decoded.second;\n"
                "    if (grammar.stacks.size() > LLAMACRAB_GRAMMAR_MAX_STACKS) {\n"
                '        throw std::runtime_error("llamacrab: the grammar holds " +\n'
                '            std::to_string(grammar.stacks.size()) + " parse stacks after a "\n'
                '            "token; the limit is " +\n'
                "            std::to_string(LLAMACRAB_GRAMMAR_MAX_STACKS));\n"
                "    }\n",
            ),
            (
                "void llama_grammar_accept_token(",
                "// llamacrab: the ways an ambiguous grammar can go on may multiply with every "
                "token\n#define LLAMACRAB_GRAMMAR_MAX_STACKS 1024\n\n"
                "void llama_grammar_accept_token(",
            ),
        ),
        why=(
            "An ambiguous grammar (a rule that can start over inside itself after any "
            "character) keeps one parse stack per way the text so far can be read, and their "
            "number can multiply with every token: each next token then takes seconds, then "
            "minutes, inside one uninterruptible sampling call (found by a grammar search: "
            "0.01 s for the first tokens, 3.4 s for the sixth). Past 1,024 stacks accepting a "
            "token throws, as llama.cpp already does when none is left; llamacrab reports a "
            "GrammarError. Our JSON Schemas and llama.cpp's example grammars stay far below."
        ),
    ),
    SourcePatch(
        name="llama-grammar-work-budget",
        path="src/llama-grammar.cpp",
        edits=(
            (
                "// transforms a grammar pushdown stack into N possible stacks",
                "// llamacrab: the steps one apply or accept of a token may take past the first "
                "character\n"
                "// (candidate tokens looked at again, parse stacks expanded or compared): an "
                "ambiguous\n"
                "// grammar can need millions of times more than a plain one, in a call nothing "
                "interrupts.\n"
                "// The first character's pass, stacks times candidates, is the stack bound's.\n"
                "#define LLAMACRAB_GRAMMAR_MAX_WORK 67108864ULL\n"
                "static thread_local uint64_t llamacrab_grammar_work = 0;\n"
                "static thread_local uint64_t llamacrab_grammar_limit = UINT64_MAX;\n"
                "static thread_local bool llamacrab_grammar_nested = false;\n\n"
                "static void llamacrab_grammar_start(uint64_t limit) {\n"
                "    llamacrab_grammar_work = 0;\n"
                "    llamacrab_grammar_limit = limit;\n"
                "    llamacrab_grammar_nested = false;\n"
                "}\n\n"
                "static void llamacrab_grammar_spend(uint64_t steps) {\n"
                "    llamacrab_grammar_work += steps;\n"
                "    if (llamacrab_grammar_work > llamacrab_grammar_limit) {\n"
                '        throw std::runtime_error("llamacrab: the grammar needed more than " +\n'
                '            std::to_string(LLAMACRAB_GRAMMAR_MAX_WORK) + " steps to check one '
                'token, the limit");\n'
                "    }\n"
                "}\n\n"
                "// transforms a grammar pushdown stack into N possible stacks",
            ),
            (
                "        auto [curr_stack_it, inserted] = "
                "seen.insert(std::move(curr_stack_candidate));\n",
                "        llamacrab_grammar_spend(8 + 4 * new_stacks.size());  // and the duplicate "
                "search\n"
                "        auto [curr_stack_it, inserted] = "
                "seen.insert(std::move(curr_stack_candidate));\n",
            ),
            (
                "    llama_grammar_candidates rejects;\n    rejects.reserve(candidates.size());\n",
                "    llamacrab_grammar_spend(1 + (llamacrab_grammar_nested ? candidates.size() "
                ": 0));\n"
                "    llama_grammar_candidates rejects;\n    rejects.reserve(candidates.size());\n",
            ),
            (
                "    auto next_rejects = llama_grammar_reject_candidates(rules, next_stacks, "
                "next_candidates);\n",
                "    const bool nested = llamacrab_grammar_nested;\n"
                "    llamacrab_grammar_nested = true;\n"
                "    auto next_rejects = llama_grammar_reject_candidates(rules, next_stacks, "
                "next_candidates);\n"
                "    llamacrab_grammar_nested = nested;\n",
            ),
            (  # a grammar's start is bounded by its size
                "        size_t start_rule_index) {\n",
                "        size_t start_rule_index) {\n    llamacrab_grammar_start(UINT64_MAX);\n",
            ),
            (
                "                            size_t num_trigger_tokens) {\n",
                "                            size_t num_trigger_tokens) {\n"
                "    llamacrab_grammar_start(UINT64_MAX);\n",
            ),
            (
                "void llama_grammar_apply_impl(const struct llama_grammar & grammar, "
                "llama_token_data_array * cur_p) {\n",
                "void llama_grammar_apply_impl(const struct llama_grammar & grammar, "
                "llama_token_data_array * cur_p) {\n"
                "    llamacrab_grammar_start(LLAMACRAB_GRAMMAR_MAX_WORK);\n",
            ),
            (
                "void llama_grammar_accept_impl(struct llama_grammar & grammar, llama_token "
                "token) {\n",
                "void llama_grammar_accept_impl(struct llama_grammar & grammar, llama_token "
                "token) {\n"
                "    llamacrab_grammar_start(LLAMACRAB_GRAMMAR_MAX_WORK);\n",
            ),
        ),
        why=(
            "The stack bound counts the ways a grammar reads the text after a token, not the "
            "work of reading one: an ambiguous grammar (`root ::= x root x | x` with a few "
            "one-character choices for x) tries every split of each token among its nesting "
            "levels while it filters the candidates (30 s for one token of Gemma 3's 262k "
            "vocabulary with 3 choices, hours with 5), and a 128- to 256-way repeated "
            "alternation of any character re-expands and deduplicates its stacks cubically "
            "(6 to 30 s a token), both inside one sampling call no timeout, cancel or close() "
            "interrupts, with few stacks left after it. Past 2^26 steps one apply or accept "
            "throws (a candidate token looked at past its first character, a parse stack "
            "expanded, four per stack it is compared with); llamacrab reports a GrammarError. "
            "A JSON Schema's string takes ~2^22, the first character's pass over every stack "
            "is not counted (the stack bound's)."
        ),
    ),
    SourcePatch(
        name="llama-sampler-dynatemp-overflow",
        path="src/llama-sampler.cpp",
        edits=(
            (
                "static void llama_sampler_temp_ext_apply(",
                "// llamacrab: whether the largest logit divided by a temperature stays below "
                "FLT_MAX (a\n// temperature of 0, NaN or infinity never does): past it the "
                "probabilities are NaN\n"
                "static bool llamacrab_temp_fits(float max_logit, float temp) {\n"
                "    return std::fabs(max_logit) / temp < FLT_MAX && temp < FLT_MAX;\n"
                "}\n\n"
                "static void llama_sampler_temp_ext_apply(",
            ),
            (
                "        // Apply the dynamically calculated temperature scaling\n",
                "        // llamacrab: a dyn_temp that the largest logit (data[0], sorted above) "
                "does not fit\n"
                "        // is 0: greedy, the rest -inf, and data[0]'s probability 1 below\n"
                "        if (!llamacrab_temp_fits(cur_p->data[0].logit, dyn_temp)) {\n"
                "            dyn_temp = 0.0f;\n"
                "        }\n\n"
                "        // Apply the dynamically calculated temperature scaling\n",
            ),
            (
                "    data->logits = scaled_logits;\n",
                "    // llamacrab: where llamacrab_temp_fits says no, the greedy logits instead, "
                "as on the CPU\n"
                "    // (the largest kept, the rest -inf): the row of [greedy, scaled] the check "
                "selects\n"
                "    struct ggml_tensor * max_idx   = ggml_argmax(ctx, logits);\n"
                "    struct ggml_tensor * max_logit = ggml_get_rows(ctx, "
                "ggml_reshape_2d(ctx, logits, 1, logits->ne[0]), max_idx);\n"
                "    auto below_float_max = [ctx](struct ggml_tensor * x) {  "
                "// 1 or 0 (+inf, NaN)\n"
                "        return ggml_step(ctx, ggml_scale_bias(ctx, x, -1.0f, FLT_MAX));\n"
                "    };\n"
                "    struct ggml_tensor * fits      = ggml_mul(ctx,\n"
                "        below_float_max(ggml_div(ctx, ggml_abs(ctx, max_logit), dyn_temp)), "
                "below_float_max(dyn_temp));\n"
                "    struct ggml_tensor * below_max = ggml_step(ctx, "
                "ggml_scale(ctx, ggml_sub(ctx, logits, max_logit), -1.0f));\n"
                "    struct ggml_tensor * greedy    = ggml_add(ctx, logits, "
                "ggml_log(ctx, ggml_scale_bias(ctx, below_max, -1.0f, 1.0f)));\n"
                "    struct ggml_tensor * rows      = ggml_concat(ctx, greedy, scaled_logits, 1);\n"
                "    struct ggml_tensor * chosen    = ggml_get_rows(ctx, rows, "
                "ggml_cast(ctx, fits, GGML_TYPE_I32));\n"
                '    ggml_set_name(chosen, "temp_ext_fitting_logits");\n\n'
                "    data->logits = ggml_reshape_1d(ctx, chosen, logits->ne[0]);\n",
            ),
        ),
        why=(
            "Dynamic temperature (temp-ext) divides the logits by min_temp + (max_temp - "
            "min_temp) * normalized_entropy^exponent. With dynatemp_range >= temperature "
            "(min_temp 0) and a peaked distribution that is a tiny positive number: the largest "
            "logit divided by it was +inf, the probabilities NaN, and the last sampler picked an "
            "arbitrary token, generated as garbage (Gemma 3 270M, a logit_bias of +100 on one "
            "token, temperature 0.5, dynatemp_range 0.5; in the graph, any peaked distribution "
            "with an exponent of 10). No setting can be refused for it: it depends on the "
            "logits. A dyn_temp the largest logit does not fit is now 0, the greedy case "
            "llama.cpp already has for temp <= 0, on the CPU and in the graph; every other "
            "dyn_temp divides as before. Retired when upstream guards dyn_temp itself."
        ),
    ),
    SourcePatch(
        name="mtmd-audio-length-bound",
        path="tools/mtmd/mtmd-helper.cpp",
        edits=(
            (
                "#include <vector>\n",
                "#include <vector>\n#include <stdexcept>\n#include <string>\n\n"
                "// llamacrab: the longest sound file decoded, in seconds (llamacrab's "
                "MAX_AUDIO_SECONDS)\n#define LLAMACRAB_MAX_AUDIO_SECONDS 3600\n",
            ),
            (
                "    pcmf32_mono.resize(frame_count);\n",
                "    if (frame_count > (ma_uint64) LLAMACRAB_MAX_AUDIO_SECONDS * "
                "target_sampler_rate) {\n"
                "        ma_decoder_uninit(&decoder);\n"
                '        throw std::runtime_error("llamacrab: the audio decodes to " +\n'
                '            std::to_string(frame_count) + " samples at " +\n'
                '            std::to_string(target_sampler_rate) + " Hz; the limit is " +\n'
                '            std::to_string(LLAMACRAB_MAX_AUDIO_SECONDS) + " seconds");\n'
                "    }\n"
                "    pcmf32_mono.resize(frame_count);\n",
            ),
        ),
        why=(
            "A sound file's header sets its sample rate, and libmtmd resamples to the "
            "projector's rate into one buffer it allocates (and zero-fills) from the decoded "
            "length first: a 100 kB WAV declaring 1 Hz became 6 GB and 42 s before failing, and "
            "FLAC compresses silence further. Past an hour of decoded audio the helper throws "
            "before allocating; llamacrab reports a MediaError."
        ),
    ),
    SourcePatch(
        name="clip-metadata-types",
        path="tools/mtmd/clip.cpp",
        edits=(
            (
                "    void get_bool(const std::string & key, bool & output, bool required = true) "
                "const {\n",
                "    // llamacrab: gguf_get_val_* assert (abort) on a key of another type\n"
                "    void require_type(const std::string & key, int i, gguf_type type) const {\n"
                "        const gguf_type found = gguf_get_kv_type(ctx_gguf.get(), i);\n"
                "        if (found != type) {\n"
                "            // (key.c_str(): clip's string_format keeps the NUL in the string)\n"
                '            throw std::runtime_error(std::string("llamacrab: the projector\'s ") '
                "+\n"
                "                key.c_str() +\n"
                '                " is a " + gguf_type_name(found) + ", not a " + '
                "gguf_type_name(type));\n"
                "        }\n"
                "    }\n\n"
                "    void get_bool(const std::string & key, bool & output, bool required = true) "
                "const {\n",
            ),
            (
                "        output = gguf_get_val_bool(ctx_gguf.get(), i);\n",
                "        require_type(key, i, GGUF_TYPE_BOOL);\n"
                "        output = gguf_get_val_bool(ctx_gguf.get(), i);\n",
            ),
            (
                "        output = gguf_get_val_i32(ctx_gguf.get(), i);\n",
                "        require_type(key, i, GGUF_TYPE_INT32);\n"
                "        output = gguf_get_val_i32(ctx_gguf.get(), i);\n",
            ),
            (
                "        const uint32_t val = gguf_get_val_u32(ctx_gguf.get(), i);\n",
                "        require_type(key, i, GGUF_TYPE_UINT32);\n"
                "        const uint32_t val = gguf_get_val_u32(ctx_gguf.get(), i);\n",
            ),
            (
                "        output = gguf_get_val_f32(ctx_gguf.get(), i);\n",
                "        require_type(key, i, GGUF_TYPE_FLOAT32);\n"
                "        output = gguf_get_val_f32(ctx_gguf.get(), i);\n",
            ),
            (
                "        output = std::string(gguf_get_val_str(ctx_gguf.get(), i));\n",
                "        require_type(key, i, GGUF_TYPE_STRING);\n"
                "        output = std::string(gguf_get_val_str(ctx_gguf.get(), i));\n",
            ),
        ),
        why=(
            "libmtmd reads a projector's scalar metadata with gguf_get_val_*, which assert "
            "(abort) when the key holds another type or an array: a projector file with one "
            "key of the wrong type killed the process (70% of the signal deaths of the "
            "tampered-projector sections). Its array reads already check and throw; the "
            "scalar ones now do too, and the load fails with a ModelLoadError."
        ),
    ),
    # mtmd-abort-callback: the same change over four files (one SourcePatch per file).
    SourcePatch(
        name="llama-vocab-spm-byte-fallback-linear",
        path="src/llama-vocab.cpp",
        edits=(("            output.reserve(output.size() + symbol.n);\n", ""),),
        why=(
            "SPM's byte fallback reserved exactly one symbol's bytes more for every symbol no "
            "token covers: reserve() then reallocates and copies the whole output each time "
            "instead of growing it geometrically, so a run of such characters tokenized in "
            "quadratic time (200k of them: 2 s on the tiny test model; an 8 MiB request body, "
            "minutes). push_back alone grows it in amortized constant time."
        ),
    ),
    SourcePatch(
        name="llama-vocab-special-partition-linear",
        path="src/llama-vocab.cpp",
        edits=(
            (
                "    // for each special token\n"
                "    for (const llama_token special_id : cache_special_tokens) {\n",
                "    // llamacrab: the byte pairs in the text; a special token with a pair that is "
                "not there\n"
                "    // occurs in no fragment, and its pass over all of them is skipped\n"
                "    std::vector<bool> pairs(1 << 16);\n"
                "    for (const auto & fragment : buffer) {\n"
                "        if (fragment.type == FRAGMENT_BUFFER_VARIANT_TYPE_RAW_TEXT) {\n"
                "            for (uint64_t i = fragment.offset + 1; i < fragment.offset + "
                "fragment.length; ++i) {\n"
                "                pairs[(uint8_t) fragment.raw_text[i - 1] << 8 | "
                "(uint8_t) fragment.raw_text[i]] = true;\n"
                "            }\n"
                "        }\n"
                "    }\n\n"
                "    // for each special token\n"
                "    for (const llama_token special_id : cache_special_tokens) {\n",
            ),
            (
                "        // for each text fragment\n",
                "        bool may_occur = true;  // llamacrab\n"
                "        for (size_t i = 1; i < text.size() && may_occur; ++i) {\n"
                "            may_occur = pairs[(uint8_t) text[i - 1] << 8 | (uint8_t) text[i]];\n"
                "        }\n"
                "        if (!may_occur) {\n"
                "            continue;\n"
                "        }\n\n"
                "        // for each text fragment\n",
            ),
            (
                "        std::forward_list<fragment_buffer_variant>::iterator it = "
                "buffer.begin();\n",
                "        std::forward_list<fragment_buffer_variant>::iterator it = "
                "buffer.begin();\n"
                "        auto before_it = buffer.before_begin();  // llamacrab: its predecessor\n",
            ),
            (
                "                    auto source = std::distance(buffer.begin(), it);\n",
                "                    // llamacrab: the fragment matched in gives way to its "
                "pieces, unlinked through\n"
                "                    // its predecessor (no walk from the list's start)\n"
                "                    buffer.erase_after(before_it);\n"
                "                    it = before_it;\n",
            ),
            (
                "left_reminder_length);\n                            it++;\n",
                "left_reminder_length);\n                            before_it = it++;\n",
            ),
            (
                "                    buffer.emplace_after(it, special_id);\n"
                "                    it++;\n",
                "                    buffer.emplace_after(it, special_id);\n"
                "                    before_it = it++;\n",
            ),
            (
                "right_reminder_length);\n                            it++;\n",
                "right_reminder_length);\n                            before_it = it++;\n",
            ),
            (
                "#endif\n\n"
                "                        if (source == 0) {\n"
                "                            buffer.erase_after(buffer.before_begin());\n"
                "                        } else {\n"
                "                            buffer.erase_after(std::next(buffer.begin(), "
                "(source - 1)));\n"
                "                        }\n\n"
                "                        // repeat for the right side\n",
                "#endif\n\n                        // repeat for the right side\n",
            ),
            (
                "                    } else {\n"
                "                        if (source == 0) {\n"
                "                            buffer.erase_after(buffer.before_begin());\n"
                "                        } else {\n"
                "                            buffer.erase_after(std::next(buffer.begin(), "
                "(source - 1)));\n"
                "                        }\n"
                "                        break;\n"
                "                    }\n"
                "                }\n"
                "            }\n"
                "            it++;\n",
                "                    } else {\n"
                "                        break;\n"
                "                    }\n"
                "                }\n"
                "            }\n"
                "            before_it = it++;\n",
            ),
        ),
        why=(
            "Splitting a text at special tokens (tokenizer_st_partition) found, at every match, "
            "the matched fragment's position by counting from the start of a singly linked list "
            "of fragments, and walked there again to erase it: quadratic in the number of "
            "special tokens in the text. 32,768 '<end_of_turn>x' (448 kB) took ~20 s of CPU to "
            "tokenize on Gemma 3, and so did 64 kB of short lines (its '\\n' is a user-defined "
            "token, split out with parse_special off too); llama-server has the same cost. The "
            "walk now keeps the fragment before the current one and erases the matched fragment "
            "through it before inserting its pieces. Each of the vocabulary's special tokens "
            "(6,414 in Gemma 3) also passed over every fragment: one with a pair of bytes the "
            "text lacks cannot match and is skipped. The fragments, and so the tokens, are the "
            "same for every text. The early erase destroys the node that the loop's `auto & "
            "fragment` names: safe only because the loop reads nothing through `fragment` after "
            "it, and `raw_text` (`const auto & raw_text = fragment.raw_text`) binds the string "
            "that the fragment's `const std::string & raw_text` member refers to, the caller's "
            "text, not the node; a fragment that owned its text would leave it dangling. "
            "Retired when upstream stops walking the list per match."
        ),
    ),
    SourcePatch(
        name="mtmd-abort-callback",
        path="tools/mtmd/clip.h",
        edits=(
            (
                "void clip_free(struct clip_ctx * ctx);\n",
                "void clip_free(struct clip_ctx * ctx);\n\n"
                "// llamacrab: polled at every graph node of an encode; true stops it\n"
                "void clip_set_abort_callback(struct clip_ctx * ctx, ggml_abort_callback "
                "abort_callback, void * abort_callback_data);\n",
            ),
        ),
        why=_ENCODE_ABORT_WHY,
    ),
    SourcePatch(
        name="mtmd-abort-callback",
        path="tools/mtmd/clip.cpp",
        edits=(
            (
                "const char * clip_patch_merge_type(const struct clip_ctx * ctx) {\n",
                "void clip_set_abort_callback(clip_ctx * ctx, ggml_abort_callback "
                "abort_callback, void * abort_callback_data) {\n"
                "    if (ctx == nullptr) {\n"
                "        return;\n"
                "    }\n"
                "    for (ggml_backend_t backend : ctx->backend_ptrs) {\n"
                "        ggml_backend_dev_t dev = ggml_backend_get_device(backend);\n"
                "        ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : "
                "nullptr;\n"
                "        auto set_fn = reg ? (ggml_backend_set_abort_callback_t) "
                'ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_abort_callback") '
                ": nullptr;\n"
                "        if (set_fn) {\n"
                "            set_fn(backend, abort_callback, abort_callback_data);\n"
                "        }\n"
                "    }\n"
                "}\n\n"
                "const char * clip_patch_merge_type(const struct clip_ctx * ctx) {\n",
            ),
        ),
        why=_ENCODE_ABORT_WHY,
    ),
    SourcePatch(
        name="mtmd-abort-callback",
        path="tools/mtmd/mtmd.h",
        edits=(
            (
                "MTMD_API void mtmd_free(mtmd_context * ctx);\n",
                "MTMD_API void mtmd_free(mtmd_context * ctx);\n\n"
                "// llamacrab: polled at every graph node while an image or sound is encoded; "
                "returning\n// true stops the encode (it then fails). NULL removes it.\n"
                "MTMD_API void mtmd_set_abort_callback(mtmd_context * ctx, ggml_abort_callback "
                "abort_callback, void * abort_callback_data);\n",
            ),
        ),
        why=_ENCODE_ABORT_WHY,
    ),
    SourcePatch(
        name="mtmd-abort-callback",
        path="tools/mtmd/mtmd.cpp",
        edits=(
            (
                "void mtmd_free(mtmd_context * ctx) {\n    delete ctx;\n}\n",
                "void mtmd_free(mtmd_context * ctx) {\n    delete ctx;\n}\n\n"
                "void mtmd_set_abort_callback(mtmd_context * ctx, ggml_abort_callback "
                "abort_callback, void * abort_callback_data) {\n"
                "    for (clip_ctx * clip : {ctx->ctx_v, ctx->ctx_a, ctx->ctx_gen_a}) {\n"
                "        clip_set_abort_callback(clip, abort_callback, abort_callback_data);\n"
                "    }\n"
                "}\n",
            ),
        ),
        why=_ENCODE_ABORT_WHY,
    ),
    SourcePatch(
        name="llama-kv-cells-divide-shift-sign",
        path="src/llama-kv-cells.h",
        edits=(
            (
                "        pos[i]   /= d;\n        shift[i] += p_old - pos[i];\n",
                "        pos[i]   /= d;\n"
                "        shift[i] += pos[i] - p_old;  // llamacrab: the new minus the old, as "
                "pos_add\n",
            ),
        ),
        why=(
            "A division recorded the rotation its keys were owed as the old position minus "
            "the new one, where a shift (pos_add) records the new minus the old: the next "
            "decode turned divided keys away from their new positions by as much as they "
            "moved, so self-extend (Context.divide) attended with wrong positions (the next "
            "logits after dividing 0, 1 by 2 differed from those after moving 1 to 0 by 7.7 "
            "on Gemma 3, whose scale is 61). Retired when upstream records the sign as "
            "pos_add does."
        ),
    ),
    SourcePatch(
        name="llama-memory-seq-rm-zeroed",
        path="include/llama.h",
        edits=(
            (
                "    LLAMA_API bool llama_memory_seq_rm(\n"
                "            llama_memory_t mem,\n"
                "              llama_seq_id seq_id,\n"
                "                 llama_pos p0,\n"
                "                 llama_pos p1);\n",
                "    LLAMA_API bool llama_memory_seq_rm(\n"
                "            llama_memory_t mem,\n"
                "              llama_seq_id seq_id,\n"
                "                 llama_pos p0,\n"
                "                 llama_pos p1);\n\n"
                "    // llamacrab: llama_memory_seq_rm, and the K and V data of the cells it "
                "frees set to zero\n"
                "    LLAMA_API bool llama_memory_seq_rm_zeroed(\n"
                "            llama_memory_t mem,\n"
                "              llama_seq_id seq_id,\n"
                "                 llama_pos p0,\n"
                "                 llama_pos p1);\n",
            ),
        ),
        why=_ZEROED_WHY,
    ),
    SourcePatch(
        name="llama-memory-seq-rm-zeroed",
        path="src/llama-kv-cache.cpp",
        edits=(
            (
                "bool llama_kv_cache::seq_rm(llama_seq_id seq_id, llama_pos p0, llama_pos p1) {\n",
                "// llamacrab: set while llama_memory_seq_rm_zeroed runs\n"
                "static thread_local bool llamacrab_zero_freed = false;\n\n"
                "bool llama_memory_seq_rm_zeroed(llama_memory_t mem, llama_seq_id seq_id, "
                "llama_pos p0, llama_pos p1) {\n"
                "    if (!mem) {\n"
                "        return true;\n"
                "    }\n"
                "    struct unset { ~unset() { llamacrab_zero_freed = false; } } on_return;\n"
                "    llamacrab_zero_freed = true;\n"
                "    return mem->seq_rm(seq_id, p0, p1);\n"
                "}\n\n"
                "bool llama_kv_cache::seq_rm(llama_seq_id seq_id, llama_pos p0, llama_pos p1) {\n"
                "    // llamacrab: the runs of cells this frees, by stream, [first, end)\n"
                "    std::vector<std::vector<std::pair<uint32_t, uint32_t>>> freed(\n"
                "        llamacrab_zero_freed ? n_stream : 0);\n"
                "    auto note_freed = [&](uint32_t s, uint32_t i) {\n"
                "        if (freed.empty()) {\n"
                "            return;\n"
                "        }\n"
                "        auto & runs = freed[s];\n"
                "        if (!runs.empty() && runs.back().second == i) {\n"
                "            runs.back().second = i + 1;\n"
                "        } else {\n"
                "            runs.emplace_back(i, i + 1);\n"
                "        }\n"
                "    };\n",
            ),
            (
                "            if (cells.seq_has(i, seq_id) && cells.seq_rm(i, seq_id)) {\n"
                "                if (new_head == cells.size()) {\n",
                "            if (cells.seq_has(i, seq_id) && cells.seq_rm(i, seq_id)) {\n"
                "                note_freed(seq_to_stream[seq_id], i);\n"
                "                if (new_head == cells.size()) {\n",
            ),
            (
                "                cells.rm(i);\n\n                if (new_head == cells.size()) {\n",
                "                cells.rm(i);\n"
                "                note_freed(s, i);\n\n"
                "                if (new_head == cells.size()) {\n",
            ),
            (
                "    return true;\n}\n\nvoid llama_kv_cache::seq_cp(",
                "    if (!freed.empty()) {\n"
                "        // set_tensor from zeros: every buffer type has it (not so memset)\n"
                "        const std::vector<uint8_t> zeros(1 << 20, 0);\n"
                "        auto zero = [&](ggml_tensor * t, size_t offset, size_t size) {\n"
                "            for (size_t done = 0; done < size; done += zeros.size()) {\n"
                "                const size_t n = std::min(zeros.size(), size - done);\n"
                "                ggml_backend_tensor_set(t, zeros.data(), offset + done, n);\n"
                "            }\n"
                "        };\n"
                "        for (uint32_t s = 0; s < n_stream; ++s) {\n"
                "            for (const auto & layer : layers) {\n"
                "                ggml_tensor * k = layer.k_stream[s];\n"
                "                ggml_tensor * v = layer.v_stream[s];\n"
                "                for (const auto & [first, end] : freed[s]) {\n"
                "                    if (k) {\n"
                "                        zero(k, first*k->nb[1], (end - first)*k->nb[1]);\n"
                "                    }\n"
                "                    if (v && !v_trans) {\n"
                "                        zero(v, first*v->nb[1], (end - first)*v->nb[1]);\n"
                "                    } else if (v) {  // cell i of row d at d*kv_size + i\n"
                "                        const size_t size = ggml_type_size(v->type);\n"
                "                        for (int64_t d = 0; d < v->ne[0]; ++d) {\n"
                "                            zero(v, (d*v->ne[1] + first)*size, "
                "(end - first)*size);\n"
                "                        }\n"
                "                    }\n"
                "                }\n"
                "            }\n"
                "        }\n"
                "    }\n\n"
                "    return true;\n}\n\nvoid llama_kv_cache::seq_cp(",
            ),
        ),
        why=_ZEROED_WHY,
    ),
)


def names() -> tuple[str, ...]:
    return tuple(dict.fromkeys(p.name for p in PATCHES))


def digest() -> str:
    """What identifies the patch set (for cache keys): its names and edits."""
    identity = [[p.name, p.path, [list(edit) for edit in p.edits]] for p in PATCHES]
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()


def patched_text(patch: SourcePatch, text: str) -> str:
    for old, new in patch.edits:
        count = text.count(old)
        if count != 1:
            raise PatchError(
                f"llamacrab patch {patch.name!r} does not apply to {patch.path}: the text it "
                f"replaces occurs {count} times, not once (upstream changed it; refresh or drop "
                f"the patch in llamacrab-sys/build_tools/patches.py):\n{old}"
            )
        text = text.replace(old, new)
    return text


def apply(tree: Path) -> None:
    """Apply every patch to a llama.cpp tree in place."""
    for patch in PATCHES:
        target = tree / patch.path
        if not target.is_file():
            raise PatchError(f"llamacrab patch {patch.name!r}: {patch.path} is not in {tree}")
        target.write_text(patched_text(patch, target.read_text(encoding="utf-8")), "utf-8")
