/*
 * sample.c — `moestash sample --checkpoint DIR --prompt TEXT --tokens N
 * [--temperature T] [--top-k K] [--seed S]`: text from a trained checkpoint
 * (src/model/sample.h: the model run one byte at a time with a KV cache,
 * on the host in fp32 from the checkpoint's bf16 weights). The prompt is
 * printed, then the sampled bytes as they come. The same seed gives the same
 * text. Bad input: exit 2 and one line naming the flag, before any work.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "model/sample.h"

static int bad(const char* flag, const char* value, const char* why) {
    fprintf(stderr, "moestash sample: %s '%s': %s\n", flag, value ? value : "", why);
    return 2;
}

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
    int64_t tokens, top_k;
    uint64_t seed;
    double temperature;
} sample_cli;

static int num(const char* flag, const char* v, double lo, double hi, double* out) {
    char* end = NULL;
    errno = 0;
    double x = v ? strtod(v, &end) : 0;
    if (!v || !*v || *end || errno || !isfinite(x) || x < lo || x > hi) {
        char why[80];
        snprintf(why, sizeof why, "expected a number in %g .. %g", lo, hi);
        return bad(flag, v, why);
    }
    *out = x;
    return 0;
}

static int parse(int argc, char** argv, sample_cli* s) {
    for (int i = 0; i < argc; i++) {
        const char* f = argv[i];
        if (strncmp(f, "--", 2) != 0) return bad("argument", f, "not a flag (see moestash sample --help)");
        if (i + 1 >= argc) return bad(f, "", "missing value");
        const char* v = argv[++i];
        double x = 0;
        int rc = 0;
        if (strcmp(f, "--checkpoint") == 0) s->dir = v;
        else if (strcmp(f, "--prompt") == 0) s->prompt = v;
        else if (strcmp(f, "--tokens") == 0) rc = num(f, v, 1, 1 << 20, &x), s->tokens = (int64_t)x;
        else if (strcmp(f, "--top-k") == 0) rc = num(f, v, 0, 1 << 20, &x), s->top_k = (int64_t)x;
        else if (strcmp(f, "--seed") == 0) rc = num(f, v, 0, 9007199254740992.0, &x), s->seed = (uint64_t)x;
        else if (strcmp(f, "--temperature") == 0) rc = num(f, v, 0, 100, &s->temperature);
        else return bad(f, v, "unknown flag (see moestash sample --help)");
        if (rc) return rc;
        if ((strcmp(f, "--tokens") == 0 || strcmp(f, "--top-k") == 0 || strcmp(f, "--seed") == 0) && x != floor(x))
            return bad(f, v, "expected an integer");
    }
    if (!s->dir) return bad("--checkpoint", "", "required");
    if (!s->prompt || !*s->prompt) return bad("--prompt", s->prompt ? s->prompt : "", "required, at least one byte");
    return 0;
}

int mst_cmd_sample(int argc, char** argv) {
    for (int i = 0; i < argc; i++)
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) return help(), 0;
    sample_cli s = {NULL, NULL, 100, 40, 1, 0.8};
    if (parse(argc, argv, &s)) return 2;
    const int64_t n_prompt = (int64_t)strlen(s.prompt);
    mst_sampler* sm = NULL;
    if (mst_sampler_create(s.dir, n_prompt + s.tokens, &sm) != MST_OK) return bad("--checkpoint", s.dir, mst_last_error());
    const int64_t V = mst_sampler_config(sm)->vocab;
    float* logits = (float*)malloc(sizeof(float) * (size_t)V);
    mst_status st = logits ? MST_OK : mst_set_error(MST_ERR_OOM, "logits");
    for (int64_t i = 0; i < n_prompt && st == MST_OK; i++)
        st = mst_sampler_feed(sm, (unsigned char)s.prompt[i], i + 1 == n_prompt ? logits : NULL);
    fputs(s.prompt, stdout);
    uint64_t rng = s.seed;
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
