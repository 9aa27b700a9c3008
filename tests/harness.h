/*
 * harness.h — the one test harness for every backend: a test program runs
 * its cases on the backend named by `--backend cpu|cuda` and compares against
 * float64 references computed on the host.
 *
 * Habits it makes easy: fresh random inputs (never zeros), outputs poisoned
 * before each call, guard bytes around outputs, tolerances by dtype
 * (bf16: relative norm error < 1e-2, fp32: < 1e-5, copies: bit-exact).
 */
#ifndef MST_HARNESS_H
#define MST_HARNESS_H

#include <stdint.h>
#include <stdio.h>
#include <string.h> /* CHECK_MESSAGE */

#include "moestash.h"

#define MST_TOL_BF16 1e-2
#define MST_TOL_FP32 1e-5
#define MST_POISON 0xFF /* bf16 0xFFFF and fp32 0xFFFFFFFF are NaN */

extern int mst_test_checks;   /* checks run so far      */
extern int mst_test_failures; /* checks failed so far   */

void mst_test_fail(const char* file, int line, const char* fmt, ...);

#define CHECK(cond, ...)                                                    \
    do {                                                                    \
        mst_test_checks++;                                                  \
        if (!(cond)) mst_test_fail(__FILE__, __LINE__, __VA_ARGS__);        \
    } while (0)

/* Expects `expr` to return `want`; on a mismatch prints both and the message. */
#define CHECK_STATUS(expr, want)                                                          \
    do {                                                                                  \
        mst_status got_ = (expr);                                                         \
        CHECK(got_ == (want), "%s returned %s, expected %s (%s)", #expr,                  \
              mst_status_str(got_), mst_status_str(want), mst_last_error());              \
    } while (0)
#define CHECK_OK(expr) CHECK_STATUS(expr, MST_OK)

/* Runs `run` on a context of the backend named on the command line and prints
 * "<prog>: N passed, N failed"; returns the exit code. A backend that is not
 * available (a CPU-only host) returns MST_TEST_SKIP, CTest's SKIP_RETURN_CODE,
 * unless MST_TEST_REQUIRE_GPU is set (the GPU machine: scripts/gpu-check.sh),
 * where it fails. */
#define MST_TEST_SKIP 77
int mst_test_main(int argc, char** argv, void (*run)(mst_ctx_t* ctx));

/* ---- tests of several ranks (their own main: a context a rank) ---- */
/* The backend `--backend cuda` names; the CPU otherwise. */
mst_backend_kind mst_test_backend_arg(int argc, char** argv);
/* The ranks `kind` can host: 64 on the CPU, else the devices a context opens
 * on (at most `most`). */
int mst_test_devices(mst_backend_kind kind, int most);
/* The exit of a test that needs 2 devices and has n_dev: prints
 * "<prog>: skipped: N CUDA devices, <needs>" and returns MST_TEST_SKIP, or 1
 * where there is none and MST_TEST_REQUIRE_GPU is set (the GPU machine). */
int mst_test_skip_devices(const char* prog, int n_dev, const char* needs);

/* ---- random inputs ---- */
typedef struct mst_rng { uint64_t s; } mst_rng;
uint64_t mst_rng_next(mst_rng* r);
double mst_rng_uniform(mst_rng* r);              /* [0, 1) */
double mst_rng_normal(mst_rng* r);
int64_t mst_rng_int(mst_rng* r, int64_t lo, int64_t hi); /* [lo, hi] */
void mst_rng_bf16(mst_rng* r, uint16_t* dst, size_t n, double scale); /* normal * scale */
void mst_rng_fp32(mst_rng* r, float* dst, size_t n, double lo, double hi);
/* counts [E] summing to total; skew 0 = near balanced, 1 = Zipf-like; zero
 * groups appear when total is small. */
void mst_rng_counts(mst_rng* r, int32_t* counts, int n_groups, int64_t total, double skew);

/* ---- bf16 reference, written apart from the library's converter ---- */
/* The value of bf16 bits, decoded from sign, exponent and mantissa fields. */
double mst_ref_bf16_value(uint16_t h);
/* The bf16 nearest to x (ties to the even mantissa; past the largest finite
 * value by half an ulp or more: infinity; NaN: 0x7FC0 with x's sign), found
 * by a search of the bf16 grid and a comparison with the midpoint. */
uint16_t mst_ref_bf16(double x);

/* ---- comparisons ---- */
double mst_rel_err_bf16(const uint16_t* got, const double* ref, size_t n); /* NaN -> inf */
double mst_rel_err_fp32(const float* got, const double* ref, size_t n);
/* Index of the first byte that differs, or -1. */
int64_t mst_first_diff(const void* a, const void* b, size_t n_bytes);

/* ---- guarded backend buffers: GUARD bytes of 0xA5 on each side ---- */
#define MST_GUARD_BYTES 256
typedef struct mst_guarded {
    void* base;      /* backend memory, n_bytes + 2 * MST_GUARD_BYTES */
    void* data;      /* base + MST_GUARD_BYTES */
    size_t n_bytes;
} mst_guarded;
mst_guarded mst_guarded_alloc(mst_ctx_t* ctx, size_t n_bytes);
/* Uploads host data (or poisons when host is NULL). */
void mst_guarded_put(mst_ctx_t* ctx, mst_guarded* g, const void* host);
void mst_guarded_get(mst_ctx_t* ctx, const mst_guarded* g, void* host);
/* Sets every fp32 element of the buffer to v (e.g. a main_grad sentinel). */
void mst_guarded_fill_fp32(mst_ctx_t* ctx, mst_guarded* g, float v);
/* 1 when both guard regions still hold 0xA5. */
int mst_guarded_intact(mst_ctx_t* ctx, const mst_guarded* g);
void mst_guarded_free(mst_ctx_t* ctx, mst_guarded* g);

/* ---- files ---- */
/* A fresh directory under /tmp (its path in buf [cap]); 0 on failure. */
int mst_test_tmpdir(char* buf, size_t cap, const char* stem);
/* A whole file into a NUL-terminated malloc'ed buffer, *n its size (-1 when
 * a read came short); NULL when it cannot be opened. */
unsigned char* mst_test_slurp(const char* path, long* n);
/* The library's last error message says `want`. */
#define CHECK_MESSAGE(want) \
    CHECK(strstr(mst_last_error(), (want)) != NULL, "message '%s' does not say '%s'", mst_last_error(), (want))
/* Removes dir and everything below it (the test's own scratch only). */
void mst_test_rmtree(const char* dir);

#endif
