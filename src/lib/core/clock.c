/*
 * clock.c — the monotonic clock (clock.h).
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include "clock.h"

#include <time.h>

double mst_clock_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int64_t mst_clock_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}
