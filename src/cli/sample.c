/*
 * sample.c — `moestash sample --model DIR (--prompt TEXT | --prompt-ids
 * LIST) [--tokens N] [--temperature T] [--top-k K] [--seed S] [--ids]
 * [--json FILE]`: tokens from a Hugging Face Qwen3-MoE model directory
 * (src/trainer/run/sample.h: the model run one token at a time with a KV
 * cache, on the host in fp32). A byte model (vocabulary 256) takes text and
 * prints the prompt, then the sampled bytes as they come; token ids in
 * (--prompt-ids, any vocabulary, no tokenizer needed) or --ids print the
 * continuation's ids on one line, space-separated, after the run. --json
 * writes {"prompt_ids", "ids", ...}. The same seed gives the same tokens.
 * Bad input: exit 2 and one line naming the flag, before any work.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "trainer/io/hf.h"
#include "trainer/io/json.h"
#include "trainer/run/sample.h"

#define CMD "moestash sample"

static void help(void) {
    printf("usage: moestash sample --model DIR (--prompt TEXT | --prompt-ids LIST) [FLAGS]\n"
           "Generates tokens from a Hugging Face Qwen3-MoE model directory (a `moestash train --save` step\n"
           "directory, or transformers' save_pretrained), on the host in fp32 with a KV cache.\n"
           "  --model DIR         the model directory (config.json, model.safetensors); --checkpoint: the same\n"
           "  --prompt TEXT       the text to continue (a byte model: vocabulary 256)\n"
           "  --prompt-ids LIST   the token ids to continue, e.g. 1,2,3 (any vocabulary)\n"
           "  --tokens N          tokens to generate (100)\n"
           "  --temperature T     0: the most likely token every time; else softmax(logits / T) (0.8)\n"
           "  --top-k K           sample among the K most likely tokens; 0: all (40)\n"
           "  --seed S            seed of the sampler (1)\n"
           "  --ids               print the generated ids (one line, space-separated) instead of text\n"
           "                      (the default with --prompt-ids)\n"
           "  --json FILE         write {\"prompt_ids\": [...], \"ids\": [...], ...}\n");
}

typedef struct sample_cli {
    const char *dir, *prompt, *prompt_ids, *json;
    int64_t tokens, top_k, seed;
    double temperature;
    int ids;
    int32_t* prompt_tok; /* [n_prompt] */
    int64_t n_prompt;
} sample_cli;

/* --prompt-ids "1,2,3" into s->prompt_tok (non-negative integers). */
static int parse_ids(sample_cli* s) {
    const char* p = s->prompt_ids;
    s->prompt_tok = (int32_t*)malloc(sizeof(int32_t) * (strlen(p) / 2 + 1));
    if (!s->prompt_tok) return mst_cli_bad(CMD, "--prompt-ids", p, "out of memory");
    for (;;) {
        char* end = NULL;
        errno = 0;
        const long long v = strtoll(p, &end, 10);
        if (*p < '0' || *p > '9' || errno || v > INT32_MAX || (*end && *end != ','))
            return mst_cli_bad(CMD, "--prompt-ids", s->prompt_ids, "expected token ids separated by commas, e.g. 1,2,3");
        s->prompt_tok[s->n_prompt++] = (int32_t)v;
        if (!*end) return 0;
        p = end + 1;
    }
}

static int parse(int argc, char** argv, sample_cli* s) {
    mst_args a;
    mst_args_init(&a, CMD, argc, argv);
    while (mst_args_next(&a)) {
        int rc;
        float t = 0;
        if (mst_args_is(&a, "--model") || mst_args_is(&a, "--checkpoint")) rc = mst_args_str(&a, &s->dir);
        else if (mst_args_is(&a, "--prompt")) rc = mst_args_str(&a, &s->prompt);
        else if (mst_args_is(&a, "--prompt-ids")) rc = mst_args_str(&a, &s->prompt_ids);
        else if (mst_args_is(&a, "--tokens")) rc = mst_args_int(&a, 1, 1 << 20, &s->tokens);
        else if (mst_args_is(&a, "--top-k")) rc = mst_args_int(&a, 0, 1 << 20, &s->top_k);
        else if (mst_args_is(&a, "--seed")) rc = mst_args_int(&a, 0, INT64_MAX, &s->seed);
        else if (mst_args_is(&a, "--ids")) rc = mst_args_switch(&a, &s->ids);
        else if (mst_args_is(&a, "--json")) rc = mst_args_out_file(&a, &s->json);
        else if (mst_args_is(&a, "--temperature")) {
            rc = mst_args_float(&a, 0, 100, &t);
            s->temperature = t;
        } else rc = mst_args_unknown(&a);
        if (rc) return rc;
    }
    if (!s->dir) return mst_cli_bad(CMD, "--model", "", "required");
    if (!s->prompt == !s->prompt_ids)
        return mst_cli_bad(CMD, s->prompt ? "--prompt-ids" : "--prompt", s->prompt ? s->prompt_ids : "",
                           s->prompt ? "contradicts --prompt (give one)" : "required (or --prompt-ids), at least one token");
    return s->prompt_ids ? parse_ids(s) : 0;
}

/* The prompt as token ids, checked against the model's config (read alone,
 * before the weights). */
static int prompt_tokens(sample_cli* s) {
    mst_model_config c = {0};
    if (mst_hf_read_config(s->dir, &c) != MST_OK) return mst_cli_bad(CMD, "--model", s->dir, mst_last_error());
    char why[160];
    for (int64_t i = 0; s->prompt_ids && i < s->n_prompt; i++)
        if (s->prompt_tok[i] >= c.vocab) {
            snprintf(why, sizeof why, "token %d is not below the model's vocabulary (%lld)", s->prompt_tok[i],
                     (long long)c.vocab);
            return mst_cli_bad(CMD, "--prompt-ids", s->prompt_ids, why);
        }
    if (s->prompt_ids) return 0;
    if (c.vocab != 256) {
        snprintf(why, sizeof why, "text needs a byte model (vocabulary 256), this one has %lld: give --prompt-ids",
                 (long long)c.vocab);
        return mst_cli_bad(CMD, "--prompt", s->prompt, why);
    }
    s->n_prompt = (int64_t)strlen(s->prompt);
    s->prompt_tok = (int32_t*)malloc(sizeof(int32_t) * (size_t)s->n_prompt);
    if (!s->prompt_tok) return mst_cli_bad(CMD, "--prompt", s->prompt, "out of memory");
    for (int64_t i = 0; i < s->n_prompt; i++) s->prompt_tok[i] = (unsigned char)s->prompt[i];
    return 0;
}

static void print_ids(FILE* f, const int32_t* v, int64_t n, const char* sep) {
    for (int64_t i = 0; i < n; i++) fprintf(f, "%s%d", i ? sep : "", v[i]);
}

static int write_json(const sample_cli* s, const int32_t* out, int64_t n) {
    FILE* f = mst_out_open(CMD, s->json);
    if (!f) return 1;
    fprintf(f, "{\n  \"model\": ");
    mst_json_write_string(f, s->dir);
    fprintf(f, ",\n  \"temperature\": %.9g,\n  \"top_k\": %lld,\n  \"seed\": %lld,\n  \"prompt_ids\": [", s->temperature,
            (long long)s->top_k, (long long)s->seed);
    print_ids(f, s->prompt_tok, s->n_prompt, ", ");
    fprintf(f, "],\n  \"ids\": [");
    print_ids(f, out, n, ", ");
    fprintf(f, "]\n}\n");
    return mst_out_close(CMD, s->json, f);
}

/* Feeds the prompt, then picks and feeds s->tokens tokens into out; text
 * mode prints each byte as it comes. */
static mst_status generate(const sample_cli* s, mst_sampler* sm, int text, int32_t* out) {
    const int64_t V = mst_sampler_config(sm)->vocab;
    float* logits = (float*)malloc(sizeof(float) * (size_t)V);
    mst_status st = logits ? MST_OK : mst_set_error(MST_ERR_OOM, "logits");
    for (int64_t i = 0; i < s->n_prompt && st == MST_OK; i++)
        st = mst_sampler_feed(sm, s->prompt_tok[i], i + 1 == s->n_prompt ? logits : NULL);
    if (text) fputs(s->prompt, stdout);
    uint64_t rng = (uint64_t)s->seed;
    for (int64_t i = 0; i < s->tokens && st == MST_OK; i++) {
        out[i] = mst_sampler_pick(logits, V, (float)s->temperature, (int32_t)s->top_k, &rng);
        if (text) {
            fputc(out[i], stdout);
            fflush(stdout);
        }
        if (i + 1 < s->tokens) st = mst_sampler_feed(sm, out[i], logits);
    }
    free(logits);
    return st;
}

int mst_cmd_sample(int argc, char** argv) {
    if (mst_args_help(argc, argv)) {
        help();
        return 0;
    }
    sample_cli s = {.tokens = 100, .top_k = 40, .seed = 1, .temperature = 0.8};
    int rc = parse(argc, argv, &s);
    if (!rc) rc = prompt_tokens(&s);
    mst_sampler* sm = NULL;
    if (!rc && mst_sampler_create(s.dir, s.n_prompt + s.tokens, &sm) != MST_OK)
        rc = mst_cli_bad(CMD, "--model", s.dir, mst_last_error());
    int32_t* out = rc ? NULL : (int32_t*)malloc(sizeof(int32_t) * (size_t)s.tokens);
    if (!rc && !out) rc = mst_cli_bad(CMD, "--tokens", "", "out of memory");
    if (rc) {
        free(s.prompt_tok);
        mst_sampler_destroy(sm);
        return rc;
    }
    const int text = !s.ids && !s.prompt_ids;
    mst_status st = generate(&s, sm, text, out);
    if (st == MST_OK) {
        if (!text) print_ids(stdout, out, s.tokens, " ");
        fputc('\n', stdout);
        if (s.json) rc = write_json(&s, out, s.tokens);
    } else {
        fprintf(stderr, "%s: %s\n", CMD, mst_last_error());
        rc = 1;
    }
    free(out), free(s.prompt_tok);
    mst_sampler_destroy(sm);
    return rc;
}
