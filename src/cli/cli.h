/*
 * cli.h — the subcommands of the `moestash` program. Each takes the arguments
 * after its own name and returns the exit code (0 ok, 1 failure, 2 bad usage).
 */
#ifndef MST_CLI_H
#define MST_CLI_H

#include "moestash.h"

int mst_cmd_info(int argc, char** argv);
int mst_cmd_selfcheck(int argc, char** argv);
int mst_cmd_train(int argc, char** argv); /* train.c */
int mst_cmd_sample(int argc, char** argv); /* sample.c */
int mst_cmd_eval(int argc, char** argv); /* eval.c */
int mst_cmd_ep_hello(int argc, char** argv); /* ep_hello.c: hidden, the launch path without the trainer */
/* train.c: the configuration of `moestash train` on a backend, the value of
 * the current flag a (--preset NAME) applied to it, *name set (exit code 2
 * and one line for an unknown name), and `moestash train --help`. */
struct mst_train_config;
struct mst_args;
void mst_train_defaults(struct mst_train_config* t, mst_backend_kind kind);
int mst_train_preset(struct mst_args* a, struct mst_train_config* t, const char** name);
void mst_train_help(void);

/* Benchmarks (bench/): `moestash bench NAME [--json FILE] ...` */
typedef struct mst_bench_entry {
    const char* name;
    const char* help;
    int (*run)(int argc, char** argv);
} mst_bench_entry;

int mst_bench_mlp(int argc, char** argv); /* bench/bench_mlp.c */
int mst_bench_step(int argc, char** argv); /* bench/bench_step.c */
int mst_bench_stash(int argc, char** argv); /* bench/bench_stash.c */
int mst_bench_gemm(int argc, char** argv); /* bench/bench_gemm.c */
int mst_bench_train(int argc, char** argv); /* bench/bench_train.c */
int mst_bench_optim(int argc, char** argv); /* bench/bench_optim.c */
int mst_bench_ep(int argc, char** argv); /* bench/bench_ep.c */
int mst_bench_plan(int argc, char** argv); /* bench/bench_plan.c */
int mst_bench_attn(int argc, char** argv); /* bench/bench_attn.c */
int mst_bench_ops(int argc, char** argv); /* bench/bench_ops.c */

#endif
