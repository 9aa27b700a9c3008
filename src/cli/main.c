/*
 * main.c — the `moestash` program: dispatch to its subcommands.
 */
#include <stdio.h>
#include <string.h>

#include "cli.h"

static const mst_bench_entry benches[] = {
    {"mlp", "grouped MLP forward/backward TFLOP/s, graph-replayed (CUDA)", mst_bench_mlp},
    {"stash", "paged stash save/restore/spill GB/s beside cudaMemcpyAsync (CUDA)", mst_bench_stash},
    {"gemm", "grouped linear fwd/dgrad/wgrad TFLOP/s, graph-replayed, vs cuBLAS loop/grouped/dense (CUDA)", mst_bench_gemm},
    {"step", "memory-manager step per policy: time and activation memory vs keep and exact shapes", mst_bench_step},
    {"train", "the trainer's whole step, eager vs graph-replayed: tokens/s, model TFLOP/s, MFU, peak memory (CUDA)", mst_bench_train},
    {"ep", "expert-parallel dispatch/combine GB/s per GPU over NCCL vs NCCL all-to-all (CUDA, >= 1 GPU)", mst_bench_ep},
    {NULL, NULL, NULL},
};

static int usage(FILE* f) {
    fprintf(f,
            "usage: moestash COMMAND [ARGS]\n"
            "commands:\n"
            "  info         backends, devices and build options\n"
            "  selfcheck    grouped linear on each backend against a float64 reference\n"
            "  train        train the MoE transformer (moestash train --help)\n"
            "  sample       text from a checkpoint of train --save (moestash sample --help)\n"
            "  bench NAME   benchmarks:");
    for (const mst_bench_entry* b = benches; b->name; b++) fprintf(f, " %s", b->name);
    fprintf(f, "\n  help         this text\n");
    return f == stderr ? 2 : 0;
}

static int cmd_bench(int argc, char** argv) {
    if (argc < 1) {
        fprintf(stderr, "moestash bench: name a benchmark\n");
        return 2;
    }
    for (const mst_bench_entry* b = benches; b->name; b++)
        if (strcmp(argv[0], b->name) == 0) return b->run(argc - 1, argv + 1);
    fprintf(stderr, "moestash bench: unknown benchmark '%s'\n", argv[0]);
    return 2;
}

int mst_cli_backend(const char* value, mst_backend_kind* out) {
    if (!value) {
        *out = mst_backend_available(MST_BACKEND_CUDA) ? MST_BACKEND_CUDA : MST_BACKEND_CPU;
        return 0;
    }
    if (strcmp(value, "cpu") == 0) *out = MST_BACKEND_CPU;
    else if (strcmp(value, "cuda") == 0) *out = MST_BACKEND_CUDA;
    else {
        fprintf(stderr, "moestash: --backend '%s': expected cpu or cuda\n", value);
        return 2;
    }
    if (!mst_backend_available(*out)) {
        fprintf(stderr, "moestash: --backend '%s': not available (no device or not built in)\n", value);
        return 2;
    }
    return 0;
}

int main(int argc, char** argv) {
    if (argc < 2) return usage(stderr);
    const char* cmd = argv[1];
    if (strcmp(cmd, "info") == 0) return mst_cmd_info(argc - 2, argv + 2);
    if (strcmp(cmd, "selfcheck") == 0) return mst_cmd_selfcheck(argc - 2, argv + 2);
    if (strcmp(cmd, "train") == 0) return mst_cmd_train(argc - 2, argv + 2);
    if (strcmp(cmd, "sample") == 0) return mst_cmd_sample(argc - 2, argv + 2);
    if (strcmp(cmd, "bench") == 0) return cmd_bench(argc - 2, argv + 2);
    if (strcmp(cmd, "help") == 0 || strcmp(cmd, "--help") == 0) return usage(stdout);
    fprintf(stderr, "moestash: unknown command '%s'\n", cmd);
    return usage(stderr);
}
