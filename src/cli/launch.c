/*
 * launch.c — the launcher environment of a rank, the ranks this process
 * starts itself for `--gpus N`, and the communicator of a launched rank
 * (see launch.h).
 */
#define _GNU_SOURCE /* setenv, kill, nanosleep, prctl */
#include "launch.h"

#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "lib/internal.h"

enum { GRACE_MS = 5000, POLL_MS = 20, DEFAULT_RDZV_S = 300 };

/* ---- the environment ---------------------------------------------------- */

static int bad_env(const char* cmd, const char* name, const char* value, const char* why) {
    fprintf(stderr, "%s: environment %s='%s': %s\n", cmd, name, value ? value : "", why);
    return 2;
}

/* An integer variable in [lo, hi]: 0, or 2 after the line. */
static int env_int(const char* cmd, const char* name, int64_t lo, int64_t hi, int32_t* out) {
    const char* v = getenv(name);
    char* end = NULL;
    errno = 0;
    const long long x = v && *v ? strtoll(v, &end, 10) : 0;
    if (!v || !*v || *end || errno) return bad_env(cmd, name, v, "expected an integer");
    if (x < lo || x > hi) {
        char why[96];
        snprintf(why, sizeof why, "must be in [%lld, %lld]", (long long)lo, (long long)hi);
        return bad_env(cmd, name, v, why);
    }
    *out = (int32_t)x;
    return 0;
}

int mst_launch_env(const char* cmd, mst_launch* out) {
    static const char* const names[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"};
    memset(out, 0, sizeof *out);
    out->world = 1;
    out->timeout_ms = DEFAULT_RDZV_S * 1000;
    snprintf(out->who, sizeof out->who, "%s", cmd);
    int32_t t = 0;
    if (getenv("MOESTASH_RDZV_TIMEOUT") && env_int(cmd, "MOESTASH_RDZV_TIMEOUT", 1, INT_MAX / 1000, &t)) return 2;
    if (t) out->timeout_ms = t * 1000;
    int first_set = -1, first_missing = -1;
    for (int i = 4; i >= 0; i--) {
        if (getenv(names[i])) first_set = i;
        else first_missing = i;
    }
    if (first_set < 0) return 0;
    if (first_missing >= 0) {
        char why[160];
        snprintf(why, sizeof why, "not set, but %s is: a launched rank needs RANK, WORLD_SIZE, LOCAL_RANK, "
                 "MASTER_ADDR and MASTER_PORT", names[first_set]);
        return bad_env(cmd, names[first_missing], "", why);
    }
    out->launched = 1;
    if (env_int(cmd, "WORLD_SIZE", 1, 65536, &out->world)) return 2;
    if (env_int(cmd, "RANK", 0, INT32_MAX, &out->rank)) return 2;
    if (out->rank >= out->world) {
        char why[96];
        snprintf(why, sizeof why, "must be below WORLD_SIZE = %d", out->world);
        return bad_env(cmd, "RANK", getenv("RANK"), why);
    }
    if (env_int(cmd, "LOCAL_RANK", 0, INT32_MAX, &out->local_rank)) return 2;
    if (out->local_rank > out->rank) {
        char why[96];
        snprintf(why, sizeof why, "must be at most RANK = %d (ranks count local ones first)", out->rank);
        return bad_env(cmd, "LOCAL_RANK", getenv("LOCAL_RANK"), why);
    }
    if (env_int(cmd, "MASTER_PORT", 1, 65535, &out->port)) return 2;
    /* torchrun's agent serves its own TCP store on MASTER_PORT when it says
     * so: the rendezvous takes the port after it (or MOESTASH_RDZV_PORT) */
    const char* agent = getenv("TORCHELASTIC_USE_AGENT_STORE");
    if (agent && strcmp(agent, "True") == 0) {
        if (out->port == 65535)
            return bad_env(cmd, "MASTER_PORT", getenv("MASTER_PORT"),
                           "the launcher's store holds it and no port follows it: set MOESTASH_RDZV_PORT");
        out->port++;
    }
    if (getenv("MOESTASH_RDZV_PORT") && env_int(cmd, "MOESTASH_RDZV_PORT", 1, 65535, &out->port)) return 2;
    const char* addr = getenv("MASTER_ADDR");
    if (!*addr || strlen(addr) >= sizeof out->addr)
        return bad_env(cmd, "MASTER_ADDR", addr, *addr ? "longer than 255 characters" : "empty");
    snprintf(out->addr, sizeof out->addr, "%s", addr);
    if (out->world > 1) snprintf(out->who, sizeof out->who, "rank %d: %s", out->rank, cmd);
    return 0;
}

int mst_launch_check_gpus(const mst_launch* l, int32_t n) {
    if (!l->launched || n == l->world) return 0;
    char v[16], why[128];
    snprintf(v, sizeof v, "%d", n);
    snprintf(why, sizeof why, "contradicts the launcher's WORLD_SIZE = %d", l->world);
    fprintf(stderr, "%s: --gpus '%s': %s\n", l->who, v, why);
    return 2;
}

int mst_launch_check_devices(const char* cmd, int32_t n) {
#ifdef MST_HAVE_CUDA
    const int have = mst_cuda_device_count();
#else
    const int have = 0;
#endif
    if (n <= have) return 0;
    fprintf(stderr, "%s: --gpus '%d': %d CUDA devices present\n", cmd, n, have);
    return 2;
}

void mst_launch_fail_point(const mst_launch* l, const char* where) {
    const char *r = getenv("MOESTASH_FAIL_RANK"), *at = getenv("MOESTASH_FAIL_AT");
    if (!r || !at || atoi(r) != l->rank || strcmp(at, where) != 0) return;
    fprintf(stderr, "%s: failing on purpose (MOESTASH_FAIL_AT=%s)\n", l->who, where);
    const char* code = getenv("MOESTASH_FAIL_CODE"); /* "start": the exit code (3) */
    if (strcmp(where, "start") == 0) exit(code ? atoi(code) : 3);
    abort();
}

/* ---- the ranks this process starts -------------------------------------- */

static void nap_ms(int ms) {
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000};
    nanosleep(&t, NULL);
}

static volatile sig_atomic_t g_stop; /* SIGINT or SIGTERM reached the launcher */
static void on_stop(int sig) { g_stop = sig; }

extern char** environ;

/* The environment of rank r of n: this one without the launcher variables,
 * then those (built before fork: the child only execs). */
static char** rank_env(int r, int n, int port) {
    static const char* const ours[] = {"RANK=", "WORLD_SIZE=", "LOCAL_RANK=", "LOCAL_WORLD_SIZE=", "MASTER_ADDR=",
                                       "MASTER_PORT="};
    enum { N_OURS = sizeof ours / sizeof ours[0] };
    size_t k = 0, m = 0;
    while (environ[m]) m++;
    char** env = calloc(m + N_OURS + 1, sizeof *env);
    for (size_t i = 0; i < m; i++) {
        int mine = 0;
        for (int j = 0; j < N_OURS; j++) mine |= strncmp(environ[i], ours[j], strlen(ours[j])) == 0;
        if (!mine) env[k++] = environ[i];
    }
    const int val[N_OURS] = {r, n, r, n, -1, port};
    for (int j = 0; j < N_OURS; j++) {
        char v[64];
        if (val[j] < 0) snprintf(v, sizeof v, "%s127.0.0.1", ours[j]);
        else snprintf(v, sizeof v, "%s%d", ours[j], val[j]);
        env[k++] = strdup(v);
    }
    return env;
}

static void free_env(char** env) {
    size_t k = 0;
    while (env[k]) k++;
    for (size_t i = k - 6; i < k; i++) free(env[i]); /* the six rank_env made, last */
    free(env);
}

/* Child: this program again as one rank (args: moestash SUB ARGS..., env:
 * rank_env). It dies with the launcher (PR_SET_PDEATHSIG). Never returns. */
static void exec_rank(int r, pid_t parent, char** args, char** env) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127); /* the launcher is gone already */
    signal(SIGINT, SIG_DFL), signal(SIGTERM, SIG_DFL);
    execve("/proc/self/exe", args, env);
    fprintf(stderr, "rank %d: exec /proc/self/exe failed: %s\n", r, strerror(errno));
    _exit(127);
}

static void describe(int status, char* out, size_t n) {
    if (WIFSIGNALED(status)) snprintf(out, n, "killed by signal %d (%s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
    else snprintf(out, n, "exit code %d", WEXITSTATUS(status));
}

/* The ranks this launcher runs. */
typedef struct ranks {
    const char* cmd;
    int n, running;
    pid_t* pid;      /* [n] pid of a running rank, 0 once reaped or never started */
    int failed;      /* the first rank that failed, or -1                        */
    int usage;       /* it exited 2: it refused its input (the launcher exits 2) */
    int64_t kill_at; /* stopping: SIGKILL at this time (ms); -1 not stopping     */
} ranks;

/* SIGTERM to every running rank, SIGKILL GRACE_MS later (once). */
static void stop_ranks(ranks* rs) {
    if (rs->kill_at >= 0) return;
    for (int r = 0; r < rs->n; r++)
        if (rs->pid[r] > 0) kill(rs->pid[r], SIGTERM);
    rs->kill_at = mst_clock_ms() + GRACE_MS;
}

/* Rank r has ended with status: the first failure stops the others. */
static void reaped(ranks* rs, int r, int status) {
    rs->pid[r] = 0, rs->running--;
    if ((WIFEXITED(status) && WEXITSTATUS(status) == 0) || rs->kill_at >= 0) return;
    char st[96];
    describe(status, st, sizeof st);
    fprintf(stderr, "%s: rank %d of %d failed (%s); stopping the other ranks\n", rs->cmd, r, rs->n, st);
    rs->failed = r;
    rs->usage = WIFEXITED(status) && WEXITSTATUS(status) == 2;
    stop_ranks(rs);
}

/* Starts rank 0 .. n-1 (this program with args, the launcher variables);
 * a rank that cannot start counts as failed and stops those started. */
static void start_ranks(ranks* rs, int port, char** args) {
    const pid_t self = getpid();
    fflush(NULL); /* nothing buffered is written twice */
    for (int r = 0; r < rs->n; r++) {
        char** env = rank_env(r, rs->n, port);
        const pid_t p = fork();
        if (p == 0) exec_rank(r, self, args, env);
        free_env(env);
        if (p < 0) {
            fprintf(stderr, "%s: starting rank %d failed: %s\n", rs->cmd, r, strerror(errno));
            rs->failed = r;
            stop_ranks(rs);
            return;
        }
        rs->pid[r] = p, rs->running++;
    }
}

/* Until every rank has ended: reaps them, stops the rest after a failure or
 * a signal to the launcher, and kills what outlives the grace period. */
static void wait_ranks(ranks* rs) {
    while (rs->running > 0) {
        if (g_stop && rs->kill_at < 0) {
            fprintf(stderr, "%s: %s: stopping the %d ranks\n", rs->cmd, strsignal(g_stop), rs->n);
            stop_ranks(rs);
        }
        int status = 0;
        const pid_t p = waitpid(-1, &status, WNOHANG);
        if (p > 0) {
            for (int r = 0; r < rs->n; r++)
                if (rs->pid[r] == p) reaped(rs, r, status);
            continue;
        }
        if (p < 0 && errno != EINTR) return; /* no children left */
        if (rs->kill_at >= 0 && mst_clock_ms() >= rs->kill_at) {
            for (int r = 0; r < rs->n; r++)
                if (rs->pid[r] > 0) kill(rs->pid[r], SIGKILL);
            rs->kill_at = INT64_MAX; /* once */
        }
        nap_ms(POLL_MS);
    }
}

int mst_launch_spawn(const char* cmd, const char* sub, int n, int argc, char** argv) {
    const int port = mst_ep_free_port();
    if (port < 0) {
        fprintf(stderr, "%s: --gpus %d: no free loopback port for the rendezvous: %s\n", cmd, n, strerror(errno));
        return 1;
    }
    ranks rs = {.cmd = cmd, .n = n, .pid = calloc((size_t)n, sizeof(pid_t)), .failed = -1, .kill_at = -1};
    char** args = calloc((size_t)argc + 3, sizeof *args); /* moestash SUB ARGS... NULL */
    args[0] = (char*)"moestash", args[1] = (char*)sub;
    for (int i = 0; i < argc; i++) args[i + 2] = argv[i];
    struct sigaction sa, old_int, old_term;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    sigaction(SIGINT, &sa, &old_int), sigaction(SIGTERM, &sa, &old_term);
    start_ranks(&rs, port, args);
    wait_ranks(&rs);
    sigaction(SIGINT, &old_int, NULL), sigaction(SIGTERM, &old_term, NULL);
    free(rs.pid), free(args);
    return rs.usage ? 2 : rs.failed >= 0 || g_stop ? 1 : 0;
}

/* ---- the communicator of a rank ----------------------------------------- */

mst_status mst_launch_ep(const mst_launch* l, mst_ctx_t* ctx, const mst_ep_config* cfg, mst_ep_t** out) {
    mst_ep_id id;
    memset(&id, 0, sizeof id);
    mst_status st = l->rank == 0 ? mst_ep_id_create(&id) : MST_OK;
    if (st == MST_OK && l->world > 1) st = mst_ep_id_share(&id, l->rank, l->world, l->addr, l->port, l->timeout_ms);
    if (st != MST_OK) return st;
    return mst_ep_create(ctx, cfg, &id, l->rank, l->world, out);
}
