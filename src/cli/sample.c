/*
 * sample.c — `moestash sample --checkpoint DIR --prompt TEXT --tokens N
 * [--temperature T] [--top-k K] [--seed S]`: text from a trained checkpoint
 * (src/trainer/run/sample.h: the model run one byte at a time with a KV cache,
 * on the host in fp32 from the checkpoint's bf16 weights). The prompt is
 * printed, then the sampled bytes as they come. The same seed gives the same
 * text. Bad input: exit 2 and one line naming the flag, before any work.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "trainer/run/sample.h"

static void help(void) {
    printf("usage: moestash sample --checkpoint DIR --prompt TEXT [FLAGS]\n"
           "Generates bytes from a checkpoint of `moestash train --save` (on the host, with a KV cache).\n"
           "  --checkpoint DIR    a checkpoint directory (DIR/step-N or DIR/final)\n"
           "  --prompt TEXT       the text to continue (at least one byte)\n"
           "  --tokens N          bytes to generate (100)\n"
           "  --temperature T     0: the most likely byte every time; else softmax(logits / T) (0.8)\n"
           "  --top-k K           sample among the K most likely bytes; 0: all (40)\n"
           "  --seed S            seed of the sampler (1)\n");
}

typedef struct sample_cli {
    const char *dir, *prompt;
    int64_t tokens, top_k, seed;
    double temperature;
} sample_cli;

static int parse(int argc, char** argv, sample_cli* s) {
    mst_args a;
    mst_args_init(&a, "moestash sample", argc, argv);
    while (mst_args_next(&a)) {
        int rc;
        float t = 0;
        if (mst_args_is(&a, "--checkpoint")) rc = mst_args_str(&a, &s->dir);
        else if (mst_args_is(&a, "--prompt")) rc = mst_args_str(&a, &s->prompt);
        else if (mst_args_is(&a, "--tokens")) rc = mst_args_int(&a, 1, 1 << 20, &s->tokens);
        else if (mst_args_is(&a, "--top-k")) rc = mst_args_int(&a, 0, 1 << 20, &s->top_k);
        else if (mst_args_is(&a, "--seed")) rc = mst_args_int(&a, 0, INT64_MAX, &s->seed);
        else if (mst_args_is(&a, "--temperature")) {
            rc = mst_args_float(&a, 0, 100, &t);
            s->temperature = t;
        } else rc = mst_args_unknown(&a);
        if (rc) return rc;
    }
    if (!s->dir) return mst_cli_bad("moestash sample", "--checkpoint", "", "required");
    if (!s->prompt) return mst_cli_bad("moestash sample", "--prompt", "", "required, at least one byte");
    return 0;
}

int mst_cmd_sample(int argc, char** argv) {
    if (mst_args_help(argc, argv)) {
        help();
        return 0;
    }
    sample_cli s = {NULL, NULL, 100, 40, 1, 0.8};
    if (parse(argc, argv, &s)) return 2;
    const int64_t n_prompt = (int64_t)strlen(s.prompt);
    mst_sampler* sm = NULL;
    if (mst_sampler_create(s.dir, n_prompt + s.tokens, &sm) != MST_OK) return mst_cli_bad("moestash sample", "--checkpoint", s.dir, mst_last_error());
    const int64_t V = mst_sampler_config(sm)->vocab;
    float* logits = (float*)malloc(sizeof(float) * (size_t)V);
    mst_status st = logits ? MST_OK : mst_set_error(MST_ERR_OOM, "logits");
    for (int64_t i = 0; i < n_prompt && st == MST_OK; i++)
        st = mst_sampler_feed(sm, (unsigned char)s.prompt[i], i + 1 == n_prompt ? logits : NULL);
    fputs(s.prompt, stdout);
    uint64_t rng = (uint64_t)s.seed;
    for (int64_t i = 0; i < s.tokens && st == MST_OK; i++) {
        const int32_t t = mst_sampler_pick(logits, V, (float)s.temperature, (int32_t)s.top_k, &rng);
        fputc(t, stdout);
        fflush(stdout);
        if (i + 1 < s.tokens) st = mst_sampler_feed(sm, t, logits);
    }
    fputc('\n', stdout);
    free(logits);
    mst_sampler_destroy(sm);
    if (st != MST_OK) {
        fprintf(stderr, "moestash sample: %s\n", mst_last_error());
        return 1;
    }
    return 0;
}
