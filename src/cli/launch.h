/*
 * launch.h — one process per rank, as the ecosystem launches them.
 *
 * A rank learns who it is from the launcher's environment, the variables
 * torchrun sets: RANK, WORLD_SIZE, LOCAL_RANK (the GPU it takes),
 * MASTER_ADDR and MASTER_PORT (where rank 0 listens for the rendezvous that
 * hands out the NCCL unique id). None set: one process, world 1.
 *
 * `--gpus N` without that environment makes this process the launcher: it
 * starts N ranks of this same program (/proc/self/exe, the same arguments)
 * with the variables set (MASTER_ADDR 127.0.0.1, a free port), waits for
 * them, and when one fails stops the others (SIGTERM, SIGKILL after a
 * bounded wait) and exits 1 naming the first failed rank and its status.
 *
 * The rendezvous listens on MASTER_PORT, or on MASTER_PORT + 1 where
 * torchrun's agent serves its own store on MASTER_PORT
 * (TORCHELASTIC_USE_AGENT_STORE=True); MOESTASH_RDZV_PORT overrides both.
 *
 * Hidden knobs for tests: MOESTASH_FAIL_RANK=R with MOESTASH_FAIL_AT=start
 * (rank R exits 3, or MOESTASH_FAIL_CODE, before the rendezvous) or run
 * (rank R aborts once its communicator is up: a crash mid-run);
 * MOESTASH_RDZV_TIMEOUT=S bounds the
 * rendezvous (seconds, default 300).
 */
#ifndef MST_CLI_LAUNCH_H
#define MST_CLI_LAUNCH_H

#include <stdint.h>

#include "moestash.h"

typedef struct mst_launch {
    int launched;        /* 1: the launcher variables are set                */
    int32_t rank, world; /* 0, 1 when not launched                           */
    int32_t local_rank;  /* the device of this rank                          */
    char addr[256];      /* MASTER_ADDR                                      */
    int32_t port;        /* the rendezvous port: MASTER_PORT (+ 1 beside
                            torchrun's agent store), or MOESTASH_RDZV_PORT  */
    int32_t timeout_ms;  /* rendezvous bound (MOESTASH_RDZV_TIMEOUT)         */
    char who[280];       /* "CMD" or "rank R: CMD": starts every error line  */
} mst_launch;

/* Reads the environment into *out. 0, or 2 after one line on stderr naming
 * the variable and its value (bad, missing beside the others, or
 * inconsistent: RANK >= WORLD_SIZE, LOCAL_RANK >= WORLD_SIZE). */
int mst_launch_env(const char* cmd, mst_launch* out);

/* `--gpus n` given to command `sub` (argv: its arguments) in a process that
 * was not launched: runs n ranks and returns the exit code (0 all ranks
 * succeeded, 1 one failed, after the line naming it; 2 when the first rank
 * that failed exited 2: it refused its input, e.g. a memory budget no plan
 * fits, found once the ranks ran). */
int mst_launch_spawn(const char* cmd, const char* sub, int n, int argc, char** argv);

/* `--gpus n` for CUDA ranks: 0 when this machine has n devices, else 2
 * after the line. */
int mst_launch_check_devices(const char* cmd, int32_t n);

/* `--gpus n` in a launched rank: 0 when it agrees with WORLD_SIZE, else 2
 * after the line. */
int mst_launch_check_gpus(const mst_launch* l, int32_t n);

/* The hidden failure knob at point "start" or "run" of this rank: exits 3
 * or MOESTASH_FAIL_CODE (start) or aborts (run) when MOESTASH_FAIL_RANK
 * names it. */
void mst_launch_fail_point(const mst_launch* l, const char* where);

/* The communicator of a launched rank on ctx (CUDA, device local_rank):
 * rank 0 makes the NCCL id, the rendezvous at MASTER_ADDR:MASTER_PORT
 * shares it (bounded), then NCCL's communicator. Not launched: world 1. */
mst_status mst_launch_ep(const mst_launch* l, mst_ctx_t* ctx, const mst_ep_config* cfg, mst_ep_t** out);

#endif
