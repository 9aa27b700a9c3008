/*
 * test_ep_rendezvous.c — mst_ep_id_share over TCP on 127.0.0.1, ranks as
 * processes (fork): every rank gets rank 0's id although the others start
 * first (they retry); a rank that finds no rank 0, and a rank 0 whose world
 * never completes, fail within their timeout with a message naming the rank
 * (and the peers that did join fail too instead of hanging); bad arguments.
 * The backend flag is ignored (no device work).
 */
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "lib/internal.h"
#include "harness.h"

static void pattern(mst_ep_id* id, unsigned seed) {
    for (size_t i = 0; i < sizeof id->bytes; i++) id->bytes[i] = (char)(seed * 131 + i * 7 + 1);
}

/* Child process of rank r: 0 when it got the id it should (want_ok) or
 * failed with MST_ERR_IO as it should (!want_ok), else 1. */
static pid_t spawn(int r, int world, int port, int timeout_ms, unsigned seed, int want_ok) {
    pid_t pid = fork();
    if (pid != 0) return pid;
    mst_ep_id id, want;
    memset(&id, 0xEE, sizeof id); /* poisoned */
    pattern(&want, seed);
    mst_status st = mst_ep_id_share(&id, r, world, "127.0.0.1", port, timeout_ms);
    if (want_ok) _exit(st == MST_OK && !memcmp(&id, &want, sizeof id) ? 0 : 1);
    _exit(st == MST_ERR_IO ? 0 : 1);
}

static int child_ok(pid_t pid) {
    int status = 0;
    return waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

static void run(mst_ctx_t* ctx) {
    (void)ctx;
    /* a world of 4: the others start first and retry until rank 0 listens */
    int port = mst_ep_free_port();
    pid_t kids[3];
    for (int r = 1; r < 4; r++) kids[r - 1] = spawn(r, 4, port, 10000, 42, 1);
    usleep(300 * 1000);
    mst_ep_id id;
    pattern(&id, 42);
    CHECK_OK(mst_ep_id_share(&id, 0, 4, "127.0.0.1", port, 10000));
    for (int r = 1; r < 4; r++) CHECK(child_ok(kids[r - 1]), "rank %d did not get rank 0's id", r);

    /* no rank 0: rank 1 gives up within its timeout, naming itself */
    port = mst_ep_free_port();
    double t0 = mst_clock_s();
    CHECK_STATUS(mst_ep_id_share(&id, 1, 2, "127.0.0.1", port, 300), MST_ERR_IO);
    CHECK(strstr(mst_last_error(), "rank 1") && strstr(mst_last_error(), "300 ms"), "message: %s", mst_last_error());
    CHECK(mst_clock_s() - t0 < 5.0, "rank 1 waited %.1f s for a 300 ms timeout", mst_clock_s() - t0);

    /* a world of 3 where rank 2 never comes: rank 0 and rank 1 both fail */
    port = mst_ep_free_port();
    pid_t one = spawn(1, 3, port, 1500, 7, 0);
    pattern(&id, 7);
    t0 = mst_clock_s();
    CHECK_STATUS(mst_ep_id_share(&id, 0, 3, "127.0.0.1", port, 800), MST_ERR_IO);
    CHECK(strstr(mst_last_error(), "2 of 3 ranks joined") != NULL, "message: %s", mst_last_error());
    CHECK(child_ok(one), "rank 1 did not fail with MST_ERR_IO when the world never completed");
    CHECK(mst_clock_s() - t0 < 10.0, "the failing world took %.1f s", mst_clock_s() - t0);

    /* bad arguments, named */
    CHECK_STATUS(mst_ep_id_share(&id, 0, 2, "127.0.0.1", 0, 100), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "port = 0") != NULL, "message: %s", mst_last_error());
    CHECK_STATUS(mst_ep_id_share(&id, 2, 2, "127.0.0.1", port, 100), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "rank = 2") != NULL, "message: %s", mst_last_error());
    CHECK_OK(mst_ep_id_share(&id, 0, 1, "127.0.0.1", port, 100)); /* world 1: nothing to share */
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
