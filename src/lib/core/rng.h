/*
 * rng.h — the project's one pseudo-random generator: splitmix64 (a 64-bit
 * state that steps by a fixed odd constant, each value a mix of the state).
 * Header-only, so the library (model init, data windows, the sampler), the
 * test harness, the test / bench support and the benchmarks draw the same
 * stream from the same seed.
 */
#ifndef MST_RNG_H
#define MST_RNG_H

#include <stdint.h>

#define MST_SPLITMIX_GAMMA 0x9E3779B97F4A7C15ull /* the step of the state */

/* The value of state z. */
static inline uint64_t mst_splitmix_mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* The next 64 random bits of state *s. */
static inline uint64_t mst_splitmix64(uint64_t* s) { return mst_splitmix_mix(*s += MST_SPLITMIX_GAMMA); }

/* Value k (from 1) of the stream from state s, without stepping through the
 * ones before: value k of a sequential stream, drawn in any order. */
static inline uint64_t mst_splitmix64_at(uint64_t s, uint64_t k) { return mst_splitmix_mix(s + k * MST_SPLITMIX_GAMMA); }

/* A uniform double in [0, 1): the top 53 bits of the next value. */
static inline double mst_splitmix_unit(uint64_t* s) { return (double)(mst_splitmix64(s) >> 11) * 0x1.0p-53; }

#endif
