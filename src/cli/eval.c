/*
 * eval.c — `moestash eval --model DIR --data FILE [--seq T] [--batch B]
 * [--windows N] [--backend cpu|cuda] [--json FILE]`: the model's mean
 * next-token loss on FILE's consecutive windows of T+1 tokens, through the
 * trainer's forward on its bf16 weights (src/trainer/run/eval.h). Prints
 * one line; --json writes {"loss", "tokens", "windows", "window_loss" (each
 * window's mean), ...}. Bad input:
 * exit 2 and one line naming the flag, before any work.
 */
#include <stdio.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "trainer/io/json.h"
#include "trainer/run/eval.h"

#define CMD "moestash eval"

static void help(void) {
    printf("usage: moestash eval --model DIR --data FILE [FLAGS]\n"
           "The mean next-token loss of a Qwen3-MoE model directory on a token file, through the trainer's\n"
           "forward on the model's bf16 weights: consecutive windows of T+1 tokens from the file's start (the\n"
           "first T the inputs, the last T the targets), every full window or the first N.\n"
           "  --model DIR         a Hugging Face Qwen3-MoE directory (train --save, or save_pretrained)\n"
           "  --data FILE         an llm.c .bin token file, or text (one token a byte)\n"
           "  --seq T             tokens per window, the targets after them (128)\n"
           "  --batch B           windows per forward (4)\n"
           "  --windows N         the first N windows; 0: all that fit (0)\n"
           "  --backend cpu|cuda  backend (default: cuda when a GPU is present, else cpu)\n"
           "  --json FILE         write {\"loss\", \"tokens\", \"windows\", \"window_loss\": [...], ...}\n");
}

typedef struct eval_cli {
    mst_eval_config cfg;
    mst_backend_kind kind;
    const char* json;
} eval_cli;

static int parse(int argc, char** argv, eval_cli* e) {
    mst_args a;
    mst_args_init(&a, CMD, argc, argv);
    while (mst_args_next(&a)) {
        int rc;
        if (mst_args_is(&a, "--model")) rc = mst_args_str(&a, &e->cfg.model_dir);
        else if (mst_args_is(&a, "--data")) rc = mst_args_in_file(&a, &e->cfg.data_path);
        else if (mst_args_is(&a, "--seq")) rc = mst_args_int(&a, 2, 8192, &e->cfg.seq);
        else if (mst_args_is(&a, "--batch")) rc = mst_args_int(&a, 1, 65536, &e->cfg.batch);
        else if (mst_args_is(&a, "--windows")) rc = mst_args_int(&a, 0, INT32_MAX, &e->cfg.n_windows);
        else if (mst_args_is(&a, "--backend")) rc = mst_args_backend(&a, &e->kind);
        else if (mst_args_is(&a, "--json")) rc = mst_args_out_file(&a, &e->json);
        else rc = mst_args_unknown(&a);
        if (rc) return rc;
    }
    if (!e->cfg.model_dir) return mst_cli_bad(CMD, "--model", "", "required");
    if (!e->cfg.data_path) return mst_cli_bad(CMD, "--data", "", "required");
    return 0;
}

static int write_json(const eval_cli* e, const mst_eval_result* r, const char* device) {
    FILE* f = mst_out_open(CMD, e->json);
    if (!f) return 1;
    fprintf(f, "{\n  \"model\": ");
    mst_json_write_string(f, e->cfg.model_dir);
    fprintf(f, ",\n  \"data\": ");
    mst_json_write_string(f, e->cfg.data_path);
    fprintf(f, ",\n  \"device\": ");
    mst_json_write_string(f, device);
    fprintf(f, ",\n  \"seq\": %lld,\n  \"batch\": %lld,\n  \"windows\": %lld,\n  \"tokens\": %lld,\n  \"loss\": %.17g,\n",
            (long long)e->cfg.seq, (long long)e->cfg.batch, (long long)r->windows, (long long)r->tokens, r->loss);
    fprintf(f, "  \"window_loss\": [");
    for (int64_t w = 0; w < r->windows; w++) fprintf(f, "%s%.17g", w ? ", " : "", r->window_loss[w]);
    fprintf(f, "]\n}\n");
    return mst_out_close(CMD, e->json, f);
}

int mst_cmd_eval(int argc, char** argv) {
    if (mst_args_help(argc, argv)) {
        help();
        return 0;
    }
    eval_cli e = {.cfg = {.seq = 128, .batch = 4}, .kind = mst_default_backend()};
    if (parse(argc, argv, &e)) return 2;
    mst_ctx_t* ctx = NULL;
    if (mst_ctx_create(e.kind, 0, &ctx) != MST_OK)
        return mst_cli_bad(CMD, "--backend", e.kind == MST_BACKEND_CUDA ? "cuda" : "cpu", mst_last_error());
    mst_eval_result r;
    const mst_status st = mst_eval_run(ctx, &e.cfg, &r);
    int rc = 0;
    if (st != MST_OK) {
        fprintf(stderr, "%s: %s\n", CMD, mst_last_error());
        rc = st == MST_ERR_INVALID || st == MST_ERR_IO ? 2 : 1;
    } else {
        printf("eval loss %.6f on %lld tokens (%lld windows of %lld + 1) of %s\n", r.loss, (long long)r.tokens,
               (long long)r.windows, (long long)e.cfg.seq, e.cfg.data_path);
        if (e.json) rc = write_json(&e, &r, mst_ctx_describe(ctx));
        mst_eval_result_free(&r);
    }
    mst_ctx_destroy(ctx);
    return rc;
}
