/*
 * rendezvous.c — the NCCL unique id from rank 0 to every rank over TCP, as
 * launchers set it up (MASTER_ADDR:MASTER_PORT): rank 0 listens, each other
 * rank connects (retrying until the deadline: rank 0 may start last) and
 * says who it is; rank 0 answers each with the id, once every rank of the
 * world has joined. Every wait is bounded by timeout_ms; a failure names the
 * rank, the address and what did not happen, so no rank hangs.
 *
 * Wire format: hello = magic, rank, world (3 x int32, network order);
 * answer = the 128 bytes of the id.
 */
#define _POSIX_C_SOURCE 200809L
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "../core/clock.h"
#include "ep.h"

enum { HELLO_MAGIC = 0x6d737465 /* "mste" */ };

/* Waits until fd is ready for `events` or the deadline passes: 1 ready, 0 not. */
static int wait_fd(int fd, short events, int64_t deadline) {
    for (;;) {
        const int64_t left = deadline - mst_clock_ms();
        if (left <= 0) return 0;
        struct pollfd p = {fd, events, 0};
        const int r = poll(&p, 1, (int)(left > 1000 ? 1000 : left));
        if (r > 0) return 1;
        if (r < 0 && errno != EINTR) return 0;
    }
}

/* Moves all n bytes (send or receive) before the deadline: 1 done, 0 not. */
static int move_all(int fd, void* buf, size_t n, int sending, int64_t deadline) {
    char* p = (char*)buf;
    while (n > 0) {
        if (!wait_fd(fd, sending ? POLLOUT : POLLIN, deadline)) return 0;
        const ssize_t k = sending ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
        if (k <= 0) {
            if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
            return 0;
        }
        p += k, n -= (size_t)k;
    }
    return 1;
}

static struct addrinfo* resolve(const char* host, int port, int passive) {
    char service[16];
    snprintf(service, sizeof service, "%d", port);
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = passive ? AI_PASSIVE : 0;
    return getaddrinfo(host, service, &hints, &res) == 0 ? res : NULL;
}

static mst_status share_root(const mst_ep_id* id, int world, const char* host, int port, int64_t deadline,
                             int timeout_ms) {
    struct addrinfo* ai = resolve(host, port, 1);
    if (!ai) return mst_set_error(MST_ERR_IO, "rank 0: cannot resolve %s:%d", host, port);
    int ls = socket(ai->ai_family, SOCK_STREAM, 0), one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    const int bound = ls >= 0 && bind(ls, ai->ai_addr, ai->ai_addrlen) == 0 && listen(ls, world) == 0;
    freeaddrinfo(ai);
    if (!bound) {
        const int e = errno;
        if (ls >= 0) close(ls);
        return mst_set_error(MST_ERR_IO, "rank 0: cannot listen on %s:%d: %s", host, port, strerror(e));
    }
    int* fds = (int*)malloc((size_t)world * sizeof *fds); /* [W] connection of each rank, -1 none */
    for (int r = 0; r < world; r++) fds[r] = -1;
    mst_status st = MST_OK;
    for (int joined = 1; joined < world && st == MST_OK;) {
        if (!wait_fd(ls, POLLIN, deadline)) {
            st = mst_set_error(MST_ERR_IO, "rank 0: %d of %d ranks joined at %s:%d within %d ms", joined, world,
                               host, port, timeout_ms);
            break;
        }
        const int fd = accept(ls, NULL, NULL);
        if (fd < 0) continue;
        int32_t hello[3];
        if (!move_all(fd, hello, sizeof hello, 0, deadline) || (int32_t)ntohl((uint32_t)hello[0]) != HELLO_MAGIC) {
            close(fd); /* not one of ours: keep listening */
            continue;
        }
        const int r = (int)ntohl((uint32_t)hello[1]), w = (int)ntohl((uint32_t)hello[2]);
        if (w != world || r <= 0 || r >= world || fds[r] >= 0) {
            close(fd);
            st = mst_set_error(MST_ERR_INVALID, "rank 0: a rank joined as rank %d of world %d (world here %d%s)", r, w,
                               world, r > 0 && r < world && fds[r] >= 0 ? ", rank taken" : "");
            break;
        }
        fds[r] = fd;
        joined++;
    }
    for (int r = 1; r < world && st == MST_OK; r++)
        if (!move_all(fds[r], (void*)id->bytes, sizeof id->bytes, 1, deadline))
            st = mst_set_error(MST_ERR_IO, "rank 0: sending the id to rank %d failed", r);
    for (int r = 1; r < world; r++)
        if (fds[r] >= 0) close(fds[r]);
    free(fds);
    close(ls);
    return st;
}

static mst_status share_peer(mst_ep_id* id, int rank, int world, const char* host, int port, int64_t deadline,
                             int timeout_ms) {
    for (;;) { /* rank 0 may not listen yet: retry until the deadline */
        struct addrinfo* ai = resolve(host, port, 0);
        int fd = ai ? socket(ai->ai_family, SOCK_STREAM, 0) : -1;
        const int connected = fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) == 0;
        if (ai) freeaddrinfo(ai);
        if (connected) {
            int32_t hello[3] = {(int32_t)htonl(HELLO_MAGIC), (int32_t)htonl((uint32_t)rank), (int32_t)htonl((uint32_t)world)};
            const int ok = move_all(fd, hello, sizeof hello, 1, deadline) &&
                           move_all(fd, id->bytes, sizeof id->bytes, 0, deadline);
            close(fd);
            if (ok) return MST_OK;
            return mst_set_error(MST_ERR_IO, "rank %d: no id from rank 0 at %s:%d within %d ms (a rank missing?)", rank,
                                 host, port, timeout_ms);
        }
        if (fd >= 0) close(fd);
        if (mst_clock_ms() >= deadline)
            return mst_set_error(MST_ERR_IO, "rank %d: no connection to rank 0 at %s:%d within %d ms", rank, host,
                                 port, timeout_ms);
        struct timespec nap = {0, 50 * 1000 * 1000};
        nanosleep(&nap, NULL);
    }
}

int mst_ep_free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t n = sizeof a;
    const int ok = fd >= 0 && bind(fd, (struct sockaddr*)&a, sizeof a) == 0 &&
                   getsockname(fd, (struct sockaddr*)&a, &n) == 0;
    if (fd >= 0) close(fd);
    return ok ? ntohs(a.sin_port) : -1;
}

mst_status mst_ep_id_share(mst_ep_id* id, int rank, int world, const char* host, int port, int timeout_ms) {
    if (!id) return mst_set_error(MST_ERR_INVALID, "id is NULL");
    if (!host || !host[0]) return mst_set_error(MST_ERR_INVALID, "host is empty");
    if (world < 1) return mst_set_error(MST_ERR_INVALID, "world = %d: must be >= 1", world);
    if (rank < 0 || rank >= world) return mst_set_error(MST_ERR_INVALID, "rank = %d: must be in [0, %d)", rank, world);
    if (port < 1 || port > 65535) return mst_set_error(MST_ERR_INVALID, "port = %d: must be in [1, 65535]", port);
    if (timeout_ms < 1) return mst_set_error(MST_ERR_INVALID, "timeout_ms = %d: must be >= 1", timeout_ms);
    if (world == 1) return MST_OK;
    const int64_t deadline = mst_clock_ms() + timeout_ms;
    return rank == 0 ? share_root(id, world, host, port, deadline, timeout_ms)
                     : share_peer(id, rank, world, host, port, deadline, timeout_ms);
}
