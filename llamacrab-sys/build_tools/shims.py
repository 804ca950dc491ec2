"""Generate an exception-safe C++ shim for every function of the headers whose implementation is
C++.

`safe_<name>(args..., llamacrab_error *err)` calls `<name>(args...)` inside try/catch, so no C++
exception can unwind through cffi's C frames into Python: it becomes a code and a message in `err`.
One thing passes: glibc's forced unwind (`abi::__forced_unwind`), which is not an error but a
thread ending in `pthread_exit`. Python ends that way a daemon thread that wants the GIL back
while the interpreter shuts down, also from inside a callback llama.cpp makes (a log line while a
model loads); a `catch (...)` that swallowed it made glibc abort the process ("FATAL: exception
not rethrown"), so the shims rethrow it and are not `noexcept` (a rethrow there would terminate).
"""

from __future__ import annotations

import copy

from pycparser import c_ast, c_generator

from build_tools.declarations import SHIMMED_HEADERS, Declarations

SHIM_PREFIX = "safe_"

ERROR_STRUCT = """\
typedef struct llamacrab_error {
  int code;              /* LLAMACRAB_OK or one of the codes below */
  char message[1024];    /* what(), NUL-terminated, truncated to fit */
} llamacrab_error;
"""
# Hand-written helpers beside the generated shims.
HELPERS = """\
/* What llamacrab_abort_on_flags reads: ggml polls it at every graph node, so cancelling a decode
   needs no GIL. `cancel` nonzero aborts. `sigint_armed` nonzero aborts as well once a SIGINT
   arrives after llamacrab_watch_sigint wrote `sigint_seen`: Python runs its Ctrl-C handler only
   when the decode returns, which for a long prompt is seconds to minutes later. */
typedef struct llamacrab_abort_flags {
  int cancel;
  int sigint_armed;
  unsigned int sigint_seen;
} llamacrab_abort_flags;
bool llamacrab_abort_on_flags(void *flags);
/* Count SIGINTs from now on, calling the handler installed before (Python's) as well; writes the
   count so far to `seen`. Returns 1, or 0 where it cannot: no function handles SIGINT (default or
   ignored), or no POSIX sigaction (Windows). Installs again if the handler was replaced since. */
int llamacrab_watch_sigint(unsigned int *seen);
/* The end-of-generation tokens of a vocabulary, in one call instead of one per token (a
   262k-token vocabulary costs 30 ms through Python). Returns how many there are; writes at most
   `capacity` of them to `out`. */
int32_t llamacrab_vocab_eog_tokens(const struct llama_vocab *vocab, int32_t *out, int32_t capacity);
/* Walk `count` GGUF strings (u64 length + bytes) from `offset` in `data` of `size` bytes: the end
   offset, or SIZE_MAX if one runs past the end; where `starts` is not NULL, the offset of each
   string's first byte goes to starts[i]. Vocabularies hold 100k+ strings to check before
   llama.cpp reads a file; in Python that walk costs 20 ms per model load, reading them 300 ms. */
size_t llamacrab_gguf_skip_strings(const uint8_t *data, size_t size, size_t offset, uint64_t count,
                                   uint64_t *starts);
/* The index of the first of `count` GGUF strings that equals an earlier one as llama.cpp keeps
   them (cut at a NUL, an empty one renamed [EMPTY_<index>]), or -1 if all differ; -2 if memory
   ran out. String i starts at starts[i] of `data` and ends 8 bytes (the next one's length) before
   starts[i + 1], the last one at `end`: what llamacrab_gguf_skip_strings noted, already checked
   to lie inside the file. Python's set of 262k Gemma tokens cost ~100 ms of each model load. */
int64_t llamacrab_gguf_first_repeated_string(const uint8_t *data, size_t end,
                                             const uint64_t *starts, uint64_t count);
/* Sample output `idx` of `ctx` with `chain`, whose samplers before top_k(k) change no logit but
   through logit_bias on the `n_extra` tokens of `extra`: the chain is handed the k + n_extra
   largest logits and those tokens, a set that holds whatever top_k keeps, instead of every token
   of the vocabulary (262k for Gemma 3: 0.4 ms a token). Same candidates after top_k, same
   random draws. The `n_banned` tokens of `banned` are left out, as if their logits were -inf
   before the chain (min_tokens' end-of-generation ban). `scratch` holds k + 2 * n_extra
   entries. Returns the token, accepted into the chain, or -1 (LLAMA_TOKEN_NULL) when the output
   has no logits, the chain selected none, or a C++ exception was caught. */
int32_t llamacrab_sample_top_k_first(struct llama_sampler *chain, struct llama_context *ctx,
                                     int32_t idx, int32_t k, const llama_token *extra,
                                     int32_t n_extra, const llama_token *banned,
                                     int32_t n_banned, llama_token_data *scratch);
/* Every token's text as llama_detokenize gives it for that token alone with special tokens
   rendered (remove_special false, unparse_special true: what llama_sampler_init_dry reads of
   each token), one after another in `out`; token i's ends at ends[i]. Returns the bytes they all
   take: where that is more than `capacity`, a text that does not fit is left out (ends is still
   complete), so call again with that much room. -1 on a C++ exception, reported in `err`. One
   call instead of one per token: a 262k-token vocabulary costs 0.14 s through Python. */
int64_t llamacrab_vocab_token_texts(const struct llama_vocab *vocab, char *out, int64_t capacity,
                                    int64_t *ends, llamacrab_error *err);
/* The DRY sampler llama_sampler_init_dry makes of `vocab` and these settings, given the sequence
   breakers as it processes them (its walk over the vocabulary done by the caller): the token
   heads[i] followed by tail_lengths[i] tokens, the next ones of `tails`, for each of the
   `n_breakers`, in the order llama.cpp inserts them. Through llama.cpp's
   llama_sampler_init_dry_testing (src/llama-sampler.h), which Windows DLLs do not export: where
   llamacrab_dry_from_tokens_available() is false this returns NULL (LLAMACRAB_UNAVAILABLE).
   NULL as well, with `err` set, on a C++ exception. */
struct llama_sampler *llamacrab_dry_from_tokens(const struct llama_vocab *vocab, float multiplier,
                                                float base, int32_t allowed_length,
                                                int32_t penalty_last_n, const llama_token *heads,
                                                const int32_t *tail_lengths, size_t n_breakers,
                                                const llama_token *tails, llamacrab_error *err);
bool llamacrab_dry_from_tokens_available(void);
/* ggml's one process-wide mutex (ggml_critical_section, in no public header: held for a moment
   by every ggml_init, and while ggml_quantize_init builds its grid tables). A child forked while
   another thread holds it would wait for ever at its first ggml_init, so fork() takes it first
   and both sides give it back after (the child's one thread is the one that took it). Try-take
   returns 1 when taken, 0 while another thread holds it, -1 where the libraries do not export it
   (Windows DLLs, which need none: there is no fork). Called through ctypes.PyDLL, keeping the
   GIL: a cffi call lets other threads run, and a fork just after would copy whatever Python
   lock they took meanwhile (a log handler's stream) held. */
int llamacrab_try_take_ggml_mutex(void);
void llamacrab_give_back_ggml_mutex(void);
"""
# LLAMACRAB_UNAVAILABLE: a helper's llama.cpp function is not in the libraries it was built with.
ERROR_CODES = {"LLAMACRAB_OK": 0, "LLAMACRAB_STD_EXCEPTION": 1, "LLAMACRAB_BAD_ALLOC": 2,
               "LLAMACRAB_UNKNOWN_EXCEPTION": 3, "LLAMACRAB_UNAVAILABLE": 4}  # fmt: skip

_CPP_PRELUDE = """\
// Generated by build_tools/shims.py from the llama.cpp headers; do not edit.
#include <algorithm>
#include <atomic>
#if defined(__GLIBCXX__)
#include <cxxabi.h>
#endif
#include <cstdint>
#include <cstdio>
#include <cstring>
#if !defined(_WIN32)
#include <signal.h>
#endif
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>
#include "llamacrab_shims.h"

// Deprecated entry points are still part of the ABI users may call.
#if defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif

// A thread ending in pthread_exit unwinds with this: it must pass (see build_tools/shims.py).
#if defined(__GLIBCXX__)
#define LLAMACRAB_PASS_FORCED_UNWIND catch (abi::__forced_unwind &) { throw; }
#else
#define LLAMACRAB_PASS_FORCED_UNWIND
#endif

namespace {
void fail(llamacrab_error *err, int code, const char *what) noexcept {
    if (err == nullptr) return;
    err->code = code;
    std::snprintf(err->message, sizeof(err->message), "%s", what ? what : "");
}
}  // namespace

namespace {
// Read with a relaxed atomic load: a field Python writes through cffi while a decode polls it on
// another thread. MSVC has no __atomic builtins; it reads a volatile aligned int in one load.
template <typename T>
T load_relaxed(const T *field) noexcept {
#if defined(__GNUC__)
    return __atomic_load_n(field, __ATOMIC_RELAXED);
#else
    return *static_cast<const volatile T *>(field);
#endif
}

// Only ever grows; compared, never read as a number. Lock-free, so a signal handler may touch it.
std::atomic<unsigned int> sigint_count{0};
static_assert(std::atomic<unsigned int>::is_always_lock_free, "on_sigint must not take a lock");
#if !defined(_WIN32)
struct sigaction sigint_previous;  // written only while on_sigint is not installed

void on_sigint(int number, siginfo_t *info, void *context) {
    sigint_count.fetch_add(1u, std::memory_order_relaxed);
    if (sigint_previous.sa_flags & SA_SIGINFO) {
        sigint_previous.sa_sigaction(number, info, context);
    } else if (sigint_previous.sa_handler != SIG_DFL && sigint_previous.sa_handler != SIG_IGN) {
        sigint_previous.sa_handler(number);
    }
}
#endif
}  // namespace

extern "C" bool llamacrab_abort_on_flags(void *flags) {
    if (flags == nullptr) return false;
    auto *f = static_cast<llamacrab_abort_flags *>(flags);
    if (load_relaxed(&f->cancel) != 0) return true;
    return load_relaxed(&f->sigint_armed) != 0 &&
           sigint_count.load(std::memory_order_relaxed) != f->sigint_seen;
}

extern "C" int llamacrab_watch_sigint(unsigned int *seen) {
#if defined(_WIN32)
    (void)seen;
    return 0;
#else
    struct sigaction current;
    if (sigaction(SIGINT, nullptr, &current) != 0) return 0;
    const bool info = (current.sa_flags & SA_SIGINFO) != 0;
    if (!(info && current.sa_sigaction == on_sigint)) {
        if (!info && (current.sa_handler == SIG_DFL || current.sa_handler == SIG_IGN)) return 0;
        sigint_previous = current;
        struct sigaction mine = current;
        mine.sa_sigaction = on_sigint;
        mine.sa_flags = current.sa_flags | SA_SIGINFO;
        if (sigaction(SIGINT, &mine, nullptr) != 0) return 0;
    }
    *seen = sigint_count.load(std::memory_order_relaxed);
    return 1;
#endif
}

extern "C" size_t llamacrab_gguf_skip_strings(const uint8_t *data, size_t size, size_t offset,
                                               uint64_t count, uint64_t *starts) {
    for (uint64_t i = 0; i < count; ++i) {
        uint64_t length;
        if (offset > size || size - offset < sizeof length) {
            return SIZE_MAX;
        }
        std::memcpy(&length, data + offset, sizeof length);  // GGUF is little-endian, as are we
        offset += sizeof length;
        if (length > size - offset) {
            return SIZE_MAX;
        }
        if (starts != nullptr) {
            starts[i] = offset;
        }
        offset += length;
    }
    return offset;
}

extern "C" int64_t llamacrab_gguf_first_repeated_string(const uint8_t *data, size_t end,
                                                        const uint64_t *starts,
                                                        uint64_t count) {
    try {
        // Open addressing over indices (no allocation per string): at most half full.
        size_t n_slots = 2;
        while (n_slots < 2 * count) {
            n_slots *= 2;
        }
        std::vector<uint32_t> slots(n_slots, UINT32_MAX);
        std::vector<std::string_view> words(count);
        std::deque<std::string> renamed;  // a deque: its strings never move, views stay valid
        const std::hash<std::string_view> hash;
        for (uint64_t i = 0; i < count; ++i) {
            const size_t stop = i + 1 < count ? starts[i + 1] - sizeof(uint64_t) : end;
            std::string_view word(reinterpret_cast<const char *>(data) + starts[i],
                                  stop - starts[i]);
            word = word.substr(0, word.find('\\0'));
            if (word.empty()) {
                word = renamed.emplace_back("[EMPTY_" + std::to_string(i) + "]");
            }
            words[i] = word;
            size_t slot = hash(word) & (n_slots - 1);
            for (; slots[slot] != UINT32_MAX; slot = (slot + 1) & (n_slots - 1)) {
                if (words[slots[slot]] == word) {
                    return static_cast<int64_t>(i);
                }
            }
            slots[slot] = static_cast<uint32_t>(i);
        }
        return -1;
    } LLAMACRAB_PASS_FORCED_UNWIND catch (...) {
        return -2;
    }
}

extern "C" int32_t llamacrab_sample_top_k_first(struct llama_sampler *chain,
                                                struct llama_context *ctx, int32_t idx,
                                                int32_t k, const llama_token *extra,
                                                int32_t n_extra, const llama_token *banned,
                                                int32_t n_banned,
                                                llama_token_data *scratch) {
    try {
        const float *logits = llama_get_logits_ith(ctx, idx);
        if (logits == nullptr || k <= 0 || n_extra < 0 || n_banned < 0) {
            return LLAMA_TOKEN_NULL;
        }
        const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
        // A handful of end-of-generation tokens: a linear search, run only for the few tokens
        // that beat the threshold.
        const auto is_banned = [banned, n_banned](llama_token id) {
            return std::find(banned, banned + n_banned, id) != banned + n_banned;
        };
        // k + n_extra: whatever logit_bias does to the extra tokens, the k largest of the
        // others are among these.
        const int32_t m = k + n_extra;
        // The m largest so far in a heap whose top, the threshold, is the smallest of them.
        // Blocks of logits are first compared with it all at once (the compiler vectorizes
        // that): past the first few blocks almost none holds a logit that beats it.
        const auto larger = [](const llama_token_data &a, const llama_token_data &b) {
            return a.logit > b.logit;
        };
        int32_t held = 0;
        llama_token next = 0;
        for (; next < n_vocab && held < m; ++next) {
            if (!is_banned(next)) {
                scratch[held++] = llama_token_data{next, logits[next], 0.0f};
                std::push_heap(scratch, scratch + held, larger);
            }
        }
        constexpr int32_t block = 64;
        float threshold = held > 0 ? scratch[0].logit : 0.0f;
        for (int32_t start = next; start < n_vocab; start += block) {
            const int32_t end = std::min(start + block, n_vocab);
            int beaten = 0;  // an int: GCC vectorizes the comparisons into it, not into a bool
            for (int32_t id = start; id < end; ++id) {
                beaten |= logits[id] > threshold;
            }
            if (!beaten) {
                continue;
            }
            for (llama_token id = start; id < end; ++id) {
                if (logits[id] > threshold && !is_banned(id)) {
                    std::pop_heap(scratch, scratch + held, larger);
                    scratch[held - 1] = llama_token_data{id, logits[id], 0.0f};
                    std::push_heap(scratch, scratch + held, larger);
                    threshold = scratch[0].logit;
                }
            }
        }
        int32_t count = held;
        for (int32_t i = 0; i < n_extra; ++i) {
            const llama_token id = extra[i];
            const bool listed = std::any_of(
                scratch, scratch + count, [id](const llama_token_data &c) { return c.id == id; });
            if (id >= 0 && id < n_vocab && !listed && !is_banned(id)) {
                scratch[count++] = llama_token_data{id, logits[id], 0.0f};
            }
        }
        if (count == 0) {  // every token banned: nothing to hand the chain
            return LLAMA_TOKEN_NULL;
        }
        // Unsorted: the chain's logit_bias goes first, then top_k sorts what it keeps.
        llama_token_data_array cur_p = {scratch, static_cast<size_t>(count), -1, false};
        llama_sampler_apply(chain, &cur_p);
        if (cur_p.selected < 0 || cur_p.selected >= static_cast<int64_t>(cur_p.size)) {
            return LLAMA_TOKEN_NULL;
        }
        const llama_token token = cur_p.data[cur_p.selected].id;
        llama_sampler_accept(chain, token);
        return token;
    } LLAMACRAB_PASS_FORCED_UNWIND catch (...) {
        return LLAMA_TOKEN_NULL;
    }
}

extern "C" int32_t llamacrab_vocab_eog_tokens(const struct llama_vocab *vocab, int32_t *out,
                                              int32_t capacity) {
    int32_t found = 0;
    const int32_t n_tokens = llama_vocab_n_tokens(vocab);
    for (llama_token token = 0; token < n_tokens; ++token) {
        if (llama_vocab_is_eog(vocab, token)) {
            if (found < capacity) {
                out[found] = token;
            }
            ++found;
        }
    }
    return found;
}

#define LLAMACRAB_CATCH(err) \\
    LLAMACRAB_PASS_FORCED_UNWIND \\
    catch (const std::bad_alloc &e) { fail(err, LLAMACRAB_BAD_ALLOC, e.what()); } \\
    catch (const std::exception &e) { fail(err, LLAMACRAB_STD_EXCEPTION, e.what()); } \\
    catch (...) { fail(err, LLAMACRAB_UNKNOWN_EXCEPTION, "unknown C++ exception"); }

extern "C" int64_t llamacrab_vocab_token_texts(const struct llama_vocab *vocab, char *out,
                                               int64_t capacity, int64_t *ends,
                                               llamacrab_error *err) {
    if (err) err->code = 0;
    try {
        int64_t used = 0;
        const int32_t n_tokens = llama_vocab_n_tokens(vocab);
        for (llama_token token = 0; token < n_tokens; ++token) {
            // Room for this text alone, nothing once one did not fit: the needed size comes back.
            const int64_t room = std::min<int64_t>(std::max<int64_t>(capacity - used, 0),
                                                   INT32_MAX);
            int32_t n = llama_detokenize(vocab, &token, 1, room > 0 ? out + used : out,
                                         static_cast<int32_t>(room), false, true);
            if (n < 0) {
                n = -n;
                capacity = used;  // later texts must not land after this hole
            }
            used += n;
            ends[token] = used;
        }
        return used;
    } LLAMACRAB_CATCH(err)
    return -1;
}

// llama.cpp's own, for its tests (src/llama-sampler.h; C++, not in llama.h). Referenced weakly:
// a libllama without it, or with another signature, leaves it null instead of failing the
// module's load. Windows DLLs export only LLAMA_API functions, which it is not.
using dry_testing_fn = struct llama_sampler *(*)(float, float, int32_t, int32_t,
                                                 const std::vector<std::vector<llama_token>> &);
#if defined(_WIN32)
const dry_testing_fn dry_testing = nullptr;
#else
struct llama_sampler *llama_sampler_init_dry_testing(
    float dry_multiplier, float dry_base, int32_t dry_allowed_length, int32_t dry_penalty_last_n,
    const std::vector<std::vector<llama_token>> &seq_breakers) __attribute__((weak));
const dry_testing_fn dry_testing = &llama_sampler_init_dry_testing;
#endif

extern "C" bool llamacrab_dry_from_tokens_available(void) { return dry_testing != nullptr; }

#if defined(_WIN32)
extern "C" int llamacrab_try_take_ggml_mutex(void) { return -1; }
extern "C" void llamacrab_give_back_ggml_mutex(void) {}
#else
// ggml's (ggml/src/ggml-threading.cpp): exported, though in no header, and only through it can
// the mutex be tried (ggml_critical_section_start waits). Referenced weakly as the DRY helper.
extern std::mutex ggml_critical_section_mutex __attribute__((weak));

extern "C" int llamacrab_try_take_ggml_mutex(void) {
    std::mutex *mutex = &ggml_critical_section_mutex;
    if (mutex == nullptr) return -1;
    return mutex->try_lock() ? 1 : 0;
}

extern "C" void llamacrab_give_back_ggml_mutex(void) {
    std::mutex *mutex = &ggml_critical_section_mutex;
    if (mutex != nullptr) mutex->unlock();
}
#endif

extern "C" struct llama_sampler *llamacrab_dry_from_tokens(
    const struct llama_vocab *vocab, float multiplier, float base, int32_t allowed_length,
    int32_t penalty_last_n, const llama_token *heads, const int32_t *tail_lengths,
    size_t n_breakers, const llama_token *tails, llamacrab_error *err) {
    if (err) err->code = 0;
    try {
        // As llama_sampler_init_dry decides. Disabled, it makes a sampler that does nothing,
        // which llama_sampler_init_dry_testing would cast to the DRY state (out of bounds); with
        // no breakers it reads no vocabulary: either way, llama_sampler_init_dry itself.
        const bool enabled =
            multiplier != 0.0f && base >= 1.0f && std::max(penalty_last_n, 0) != 0;
        if (!enabled || n_breakers == 0) {
            return llama_sampler_init_dry(vocab, multiplier, base, allowed_length,
                                          penalty_last_n, nullptr, 0);
        }
        if (dry_testing == nullptr) {
            fail(err, LLAMACRAB_UNAVAILABLE,
                 "this libllama does not export llama_sampler_init_dry_testing");
            return nullptr;
        }
        std::vector<std::vector<llama_token>> breakers(n_breakers);
        for (size_t i = 0; i < n_breakers; ++i) {
            if (tail_lengths[i] < 0) {
                throw std::invalid_argument("a DRY sequence breaker's tail length is negative");
            }
            breakers[i].reserve(1 + static_cast<size_t>(tail_lengths[i]));
            breakers[i].push_back(heads[i]);
            breakers[i].insert(breakers[i].end(), tails, tails + tail_lengths[i]);
            tails += tail_lengths[i];
        }
        return dry_testing(multiplier, base, allowed_length, penalty_last_n, breakers);
    } LLAMACRAB_CATCH(err)
    return nullptr;
}
"""


def _params(func: c_ast.FuncDecl) -> list[c_ast.Node]:
    params = list(func.args.params) if func.args else []
    if len(params) == 1 and c_generator.CGenerator().visit(params[0]).strip() == "void":
        return []
    return params


def _rename_declarator(node: c_ast.Node, name: str) -> None:
    """Give a parameter (possibly unnamed in the header) a name we can forward."""
    node.name = name
    inner = node.type
    while not isinstance(inner, (c_ast.TypeDecl, c_ast.IdentifierType)) and hasattr(inner, "type"):
        inner = inner.type
    if isinstance(inner, c_ast.TypeDecl):
        inner.declname = name


def _shim(decl: c_ast.Decl) -> tuple[str, str]:
    """Return (prototype, C++ definition) of the shim for one function."""
    gen = c_generator.CGenerator()
    shim = copy.deepcopy(decl)
    func: c_ast.FuncDecl = shim.type
    params = _params(func)
    for i, param in enumerate(params):
        _rename_declarator(param, f"a{i}")
    err = c_ast.Decl(
        name="err", quals=[], align=[], storage=[], funcspec=[], init=None, bitsize=None,
        type=c_ast.PtrDecl(quals=[], type=c_ast.TypeDecl("err", [], None,
                           c_ast.IdentifierType(["llamacrab_error"]))),
    )  # fmt: skip
    func.args = c_ast.ParamList([*params, err])
    _rename_declarator(shim, SHIM_PREFIX + decl.name)
    prototype = gen.visit(shim)

    returns_void = gen.visit(func.type).strip() == "void" or (
        isinstance(func.type, c_ast.TypeDecl)
        and isinstance(func.type.type, c_ast.IdentifierType)
        and func.type.type.names == ["void"]
    )
    call = f"{decl.name}({', '.join(f'a{i}' for i in range(len(params)))})"
    if returns_void:
        body = f"    try {{ {call}; }}\n    LLAMACRAB_CATCH(err)\n"
    else:
        body = f"    try {{ return {call}; }}\n    LLAMACRAB_CATCH(err)\n    return {{}};\n"
    definition = f'extern "C" {prototype} {{\n    if (err) err->code = 0;\n{body}}}\n'
    return prototype, definition


def generate(decls: Declarations) -> tuple[str, str, str]:
    """Return (header for C and C++, C++ source, cdef text for cffi) of all shims."""
    names = sorted(n for n, h in decls.function_headers.items() if h in SHIMMED_HEADERS)
    shims = [_shim(decls.functions[n]) for n in names]
    codes = "".join(f"#define {k} {v}\n" for k, v in ERROR_CODES.items())
    prototypes = "".join(p + ";\n" for p, _ in shims)
    header = (
        "// Generated by build_tools/shims.py; do not edit.\n#pragma once\n"
        + "".join(f'#include "{h}"\n' for h in decls.headers if h in SHIMMED_HEADERS)
        + f'{codes}#ifdef __cplusplus\nextern "C" {{\n#endif\n'
        + ERROR_STRUCT
        + HELPERS
        + prototypes
        + "#ifdef __cplusplus\n}\n#endif\n"
    )
    source = _CPP_PRELUDE + "\n".join(d for _, d in shims)
    cdef = codes + ERROR_STRUCT + HELPERS + prototypes
    return header, source, cdef
