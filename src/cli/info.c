/*
 * info.c — `moestash info` (backends, devices, build options) and
 * `moestash selfcheck` (a small grouped linear forward on every available
 * backend against a float64 reference).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "args.h"
#include "cli.h"

/* --help only; returns -1 to go on, else the exit code. */
static int no_flags(const char* cmd, const char* usage, int argc, char** argv) {
    mst_args a;
    mst_args_init(&a, cmd, argc, argv);
    if (!mst_args_next(&a)) return -1;
    if (!mst_args_is(&a, "--help") && !mst_args_is(&a, "-h")) return mst_args_unknown(&a);
    printf("%s", usage);
    return 0;
}

static const char* kind_name(mst_backend_kind k) { return k == MST_BACKEND_CUDA ? "cuda" : "cpu"; }

int mst_cmd_info(int argc, char** argv) {
    int rc = no_flags("moestash info", "usage: moestash info\nThe version, the build options and each backend "
                      "(its device, or why it is not available).\n", argc, argv);
    if (rc >= 0) return rc;
    printf("moestash %s (library %s)\n", MST_PROGRAM_VERSION, mst_version());
#ifdef MST_HAVE_CUDA
    printf("build: CUDA backend built in (%s)\n", MST_CUDA_ARCH);
#else
    printf("build: CPU backend only (no nvcc at configure time, or MST_CUDA=OFF)\n");
#endif
    const mst_backend_kind kinds[] = {MST_BACKEND_CPU, MST_BACKEND_CUDA};
    for (int i = 0; i < 2; i++) {
        mst_ctx_t* ctx = NULL;
        const char* why = mst_backend_unavailable_why(kinds[i]);
        if (!*why && mst_ctx_create(kinds[i], 0, &ctx) != MST_OK) why = mst_last_error();
        if (*why) {
            printf("backend %-4s: not available: %s\n", kind_name(kinds[i]), why);
            continue;
        }
        printf("backend %-4s: %s\n", kind_name(kinds[i]), mst_ctx_describe(ctx));
        mst_ctx_destroy(ctx);
    }
    return 0;
}

/* y = x W[g]^T on a small ragged case; returns the relative error. */
static double selfcheck_one(mst_ctx_t* ctx, mst_status* st) {
    enum { E = 3, R = 48, I = 40, O = 24 };
    int32_t counts[E] = {17, 0, 22};
    uint16_t x[R * I], w[E * O * I], y[R * O];
    double ref[R * O] = {0}, num = 0, den = 0;
    uint64_t s = 12345;
    for (int i = 0; i < R * I; i++) x[i] = mst_fp32_to_bf16((float)((s = s * 6364136223846793005ull + 1) >> 40) / (1 << 24) - 0.5f);
    for (int i = 0; i < E * O * I; i++) w[i] = mst_fp32_to_bf16((float)((s = s * 6364136223846793005ull + 1) >> 40) / (1 << 24) - 0.5f);
    for (int g = 0, r0 = 0; g < E; r0 += counts[g++])
        for (int r = r0; r < r0 + counts[g]; r++)
            for (int o = 0; o < O; o++)
                for (int i = 0; i < I; i++)
                    ref[r * O + o] += (double)mst_bf16_to_fp32(x[r * I + i]) * mst_bf16_to_fp32(w[(g * O + o) * I + i]);
    void *dc = NULL, *dx = NULL, *dw = NULL, *dy = NULL;
    *st = mst_alloc(ctx, sizeof counts, &dc);
    if (*st == MST_OK) *st = mst_alloc(ctx, sizeof x, &dx);
    if (*st == MST_OK) *st = mst_alloc(ctx, sizeof w, &dw);
    if (*st == MST_OK) *st = mst_alloc(ctx, sizeof y, &dy);
    if (*st == MST_OK) *st = mst_copy_h2b(ctx, dc, counts, sizeof counts);
    if (*st == MST_OK) *st = mst_copy_h2b(ctx, dx, x, sizeof x);
    if (*st == MST_OK) *st = mst_copy_h2b(ctx, dw, w, sizeof w);
    mst_tensor tc = mst_tensor_make(dc, MST_DTYPE_INT32, E, 1), tx = mst_tensor_make(dx, MST_DTYPE_BF16, R, I),
               tw = mst_tensor_make(dw, MST_DTYPE_BF16, E * O, I), ty = mst_tensor_make(dy, MST_DTYPE_BF16, R, O);
    if (*st == MST_OK) *st = mst_grouped_linear_forward(ctx, &tx, &tw, NULL, NULL, &tc, &ty);
    if (*st == MST_OK) *st = mst_copy_b2h(ctx, y, dy, sizeof y);
    if (*st == MST_OK) *st = mst_ctx_check(ctx);
    for (int r = 0; r < counts[0] + counts[1] + counts[2]; r++)
        for (int o = 0; o < O; o++) {
            double d = mst_bf16_to_fp32(y[r * O + o]) - ref[r * O + o];
            num += d * d;
            den += ref[r * O + o] * ref[r * O + o];
        }
    return sqrt(num / den);
}

static const char selfcheck_usage[] =
    "usage: moestash selfcheck [--backend cpu|cuda]\n"
    "A small grouped linear forward on each available backend (or the one named) against a float64\n"
    "reference; exit 1 when one fails.\n";

int mst_cmd_selfcheck(int argc, char** argv) {
    mst_args a;
    mst_args_init(&a, "moestash selfcheck", argc, argv);
    int only = -1; /* a backend kind, or -1: every available one */
    while (mst_args_next(&a)) {
        mst_backend_kind k;
        if (mst_args_is(&a, "--help") || mst_args_is(&a, "-h")) {
            printf("%s", selfcheck_usage);
            return 0;
        }
        if (!mst_args_is(&a, "--backend")) return mst_args_unknown(&a);
        if (mst_args_backend(&a, &k)) return 2;
        only = (int)k;
    }
    int failed = 0;
    const mst_backend_kind kinds[] = {MST_BACKEND_CPU, MST_BACKEND_CUDA};
    for (int i = 0; i < 2; i++) {
        mst_ctx_t* ctx = NULL;
        if (only >= 0 ? (int)kinds[i] != only : !mst_backend_available(kinds[i])) continue;
        if (mst_ctx_create(kinds[i], 0, &ctx) != MST_OK) {
            printf("selfcheck %-4s: no context: %s\n", kind_name(kinds[i]), mst_last_error());
            failed = 1;
            continue;
        }
        mst_status st;
        double err = selfcheck_one(ctx, &st);
        int ok = st == MST_OK && err < 1e-2;
        printf("selfcheck %-4s: grouped linear forward, rel err %.2e vs float64: %s%s%s\n",
               kind_name(kinds[i]), err, ok ? "ok" : "FAILED", st ? " — " : "", st ? mst_last_error() : "");
        failed |= !ok;
        mst_ctx_destroy(ctx);
    }
    return failed;
}
