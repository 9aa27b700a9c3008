/*
 * main.c — the `moestash` program: dispatch to its subcommands, `--version`,
 * and `help [COMMAND]` (the same text as `COMMAND --help`).
 */
#include <stdio.h>
#include <string.h>

#include "args.h"
#include "cli.h"

static const mst_bench_entry benches[] = {
    {"mlp", "grouped MLP forward/backward TFLOP/s, graph-replayed (CUDA)", mst_bench_mlp},
    {"stash", "paged stash save/restore/spill GB/s beside cudaMemcpyAsync (CUDA)", mst_bench_stash},
    {"gemm", "grouped linear fwd/dgrad/wgrad TFLOP/s, graph-replayed, vs cuBLAS loop/grouped/dense (CUDA)", mst_bench_gemm},
    {"step", "memory-manager step per policy: time and activation memory vs keep and exact shapes", mst_bench_step},
    {"train", "the trainer's whole step, eager vs graph-replayed: tokens/s, model TFLOP/s, MFU, peak memory (CUDA)", mst_bench_train},
    {"attn", "causal attention fwd/bwd: our flash kernels and cuDNN against the cuBLAS probabilities path, ms, TFLOP/s, saved bytes", mst_bench_attn},
    {"ep", "expert-parallel dispatch/combine GB/s per GPU over NCCL vs NCCL all-to-all (CUDA, >= 1 GPU)", mst_bench_ep},
    {"ops", "the trainer's memory-bound model ops alone at a preset's shapes: ms, GB/s beside the copy roof (CUDA)", mst_bench_ops},
    {"optim", "the optimizer's passes (zero, sum of squares, AdamW fp32 / bf16 moments): bytes a parameter, GB/s, copy roof", mst_bench_optim},
    {"plan", "train --memory-budget's plan vs the fastest fitting point of a grid of policies and recompute: step time, peak", mst_bench_plan},
    {NULL, NULL, NULL},
};

static int usage(FILE* f) {
    fprintf(f,
            "usage: moestash COMMAND [ARGS]   (flags: --flag value or --flag=value)\n"
            "commands:\n"
            "  info             backends, devices and build options\n"
            "  selfcheck        grouped linear on each backend against a float64 reference\n"
            "  train            train the MoE transformer\n"
            "  sample           tokens from a Qwen3-MoE model directory (train --save, or Hugging Face)\n"
            "  eval             a model directory's mean next-token loss on a token file (the trainer's forward)\n"
            "  bench NAME       benchmarks:");
    for (const mst_bench_entry* b = benches; b->name; b++) fprintf(f, " %s", b->name);
    fprintf(f,
            "\n  help [COMMAND]   this text, or the flags of COMMAND (same as COMMAND --help)\n"
            "  --version        the program's and the library's version\n");
    return f == stderr ? 2 : 0;
}

static int bench_usage(FILE* f) {
    fprintf(f, "usage: moestash bench NAME [FLAGS]   (moestash bench NAME --help: its flags)\n");
    for (const mst_bench_entry* b = benches; b->name; b++) fprintf(f, "  %-6s %s\n", b->name, b->help);
    return f == stderr ? 2 : 0;
}

static int cmd_bench(int argc, char** argv) {
    if (argc < 1) {
        fprintf(stderr, "moestash bench: name a benchmark (moestash bench --help)\n");
        return 2;
    }
    if (strcmp(argv[0], "--help") == 0 || strcmp(argv[0], "-h") == 0) return bench_usage(stdout);
    for (const mst_bench_entry* b = benches; b->name; b++)
        if (strcmp(argv[0], b->name) == 0) return b->run(argc - 1, argv + 1);
    fprintf(stderr, "moestash bench: '%s': unknown benchmark (moestash bench --help)\n", argv[0]);
    return 2;
}

typedef struct command {
    const char* name;
    int (*run)(int argc, char** argv);
} command;

static const command commands[] = {
    {"info", mst_cmd_info}, {"selfcheck", mst_cmd_selfcheck}, {"train", mst_cmd_train}, {"sample", mst_cmd_sample},
    {"eval", mst_cmd_eval}, {"bench", cmd_bench}, {"ep-hello", mst_cmd_ep_hello}, /* hidden: the launch check */
    {NULL, NULL},
};

static const command* find(const char* name) {
    for (const command* c = commands; c->name; c++)
        if (strcmp(c->name, name) == 0) return c;
    return NULL;
}

/* help [COMMAND [NAME]]: COMMAND --help (bench NAME --help). */
static int cmd_help(int argc, char** argv) {
    if (argc == 0) return usage(stdout);
    const command* c = find(argv[0]);
    if (!c) {
        fprintf(stderr, "moestash help: '%s': no such command (moestash help)\n", argv[0]);
        return 2;
    }
    if (argc > (c->run == cmd_bench ? 2 : 1)) {
        fprintf(stderr, "moestash help: '%s': unexpected argument\n", argv[argc - 1]);
        return 2;
    }
    char help[] = "--help";
    char* args[2] = {argc == 2 ? argv[1] : help, help};
    return c->run(argc, args);
}

int main(int argc, char** argv) {
    setvbuf(stdout, NULL, _IOLBF, 0); /* progress lines show as printed, piped too */
    if (argc < 2) return usage(stderr);
    const char* cmd = argv[1];
    if (strcmp(cmd, "--version") == 0 && argc == 2) {
        printf("moestash %s (library %s)\n", MST_PROGRAM_VERSION, mst_version());
        return 0;
    }
    if (strcmp(cmd, "help") == 0) return cmd_help(argc - 2, argv + 2);
    if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0) return argc == 2 ? usage(stdout) : usage(stderr);
    const command* c = find(cmd);
    if (c) return c->run(argc - 2, argv + 2);
    fprintf(stderr, "moestash: '%s': unknown command (moestash help)\n", cmd);
    return 2;
}
