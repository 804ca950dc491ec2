/* The native baseline of scripts/bench.py: prefill, then a greedy generation loop, in plain C
 * against the same libllama that llamacrab uses. End-of-generation tokens are biased away so
 * every run decodes exactly N_GEN tokens, as llamacrab's side of the benchmark does.
 *
 * usage: native_loop MODEL N_PROMPT N_GEN N_THREADS   (prints one JSON object) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "llama.h"

static void quiet(enum ggml_log_level level, const char *text, void *data) {
    (void) level; (void) text; (void) data;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s MODEL N_PROMPT N_GEN N_THREADS\n", argv[0]);
        return 2;
    }
    const int n_prompt = atoi(argv[2]), n_gen = atoi(argv[3]), n_threads = atoi(argv[4]);
    llama_log_set(quiet, NULL);
    llama_backend_init();

    const int64_t t_load = llama_time_us();
    struct llama_model *model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const struct llama_vocab *vocab = llama_model_get_vocab(model);

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_prompt + n_gen + 16;
    cp.n_batch = cp.n_ubatch = n_prompt;
    cp.n_threads = cp.n_threads_batch = n_threads;
    /* As llamacrab, llama-server and llama-bench: a sliding-window model keeps only its window's
     * cells (the C default, true, keeps a full-size cache and a different memory layout). */
    cp.swa_full = false;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot create a context\n"); return 1; }
    const double load_seconds = (llama_time_us() - t_load) / 1e6;

    /* The same synthetic prompt as bench.py: BOS, then consecutive ids wrapping in the vocab. */
    const int n_vocab = llama_vocab_n_tokens(vocab);
    llama_token *prompt = malloc(sizeof(llama_token) * n_prompt);
    prompt[0] = llama_vocab_bos(vocab);
    for (int i = 1; i < n_prompt; i++) prompt[i] = 3 + (1000 + i) % (n_vocab - 3);

    int n_bias = 0;
    llama_logit_bias *bias = malloc(sizeof(llama_logit_bias) * n_vocab);
    for (llama_token t = 0; t < n_vocab; t++) {
        if (llama_vocab_is_eog(vocab, t)) bias[n_bias++] = (llama_logit_bias){t, -INFINITY};
    }
    struct llama_sampler *chain = llama_sampler_chain_init(llama_sampler_chain_default_params());
    llama_sampler_chain_add(chain, llama_sampler_init_logit_bias(n_vocab, n_bias, bias));
    llama_sampler_chain_add(chain, llama_sampler_init_greedy());

    const int64_t t0 = llama_time_us();
    if (llama_decode(ctx, llama_batch_get_one(prompt, n_prompt)) != 0) {
        fprintf(stderr, "prompt decode failed\n");
        return 1;
    }
    const int64_t t1 = llama_time_us();

    llama_token token = llama_sampler_sample(chain, ctx, -1);
    const int64_t t2 = llama_time_us();
    for (int i = 1; i < n_gen; i++) {
        if (llama_decode(ctx, llama_batch_get_one(&token, 1)) != 0) {
            fprintf(stderr, "decode %d failed\n", i);
            return 1;
        }
        token = llama_sampler_sample(chain, ctx, -1);
    }
    const int64_t t3 = llama_time_us();

    printf("{\"prefill_tokens_per_s\": %.3f, \"decode_tokens_per_s\": %.3f, \"last_token\": %d, "
           "\"load_seconds\": %.4f}\n",
           n_prompt / ((t1 - t0) / 1e6), (n_gen - 1) / ((t3 - t2) / 1e6), token, load_seconds);
    llama_sampler_free(chain);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    free(prompt);
    free(bias);
    return 0;
}
