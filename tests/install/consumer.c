/*
 * consumer.c — a C program built against an installed moestash (see
 * test_install.sh): the version, then one grouped linear forward on the CPU
 * backend against a float64 reference written here. Inputs are exact bf16
 * values (fp32 with the low 16 bits cleared), so no converter of the library
 * is used; rows past sum(counts) keep their sentinel. Exit 0 when all holds.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <moestash.h>

enum { E = 3, R = 40, I = 24, O = 16 };

static uint64_t rng = 0x6d6f65737461736bull;
static uint32_t next32(void) { /* xorshift64* */
    rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
    return (uint32_t)((rng * 0x2545F4914F6CDD1Dull) >> 32);
}
/* A nonzero value in +-[1/8, 1), returned as bf16 bits. */
static uint16_t random_bf16(void) {
    float f = (0.125f + 0.875f * (float)(next32() >> 8) / (float)(1u << 24)) * (next32() & 1 ? -1.0f : 1.0f);
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)(u >> 16);
}
static double bf16_value(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static int fail(const char* what) {
    fprintf(stderr, "consumer: %s: %s\n", what, mst_last_error());
    return 1;
}

int main(void) {
    char want[32];
    snprintf(want, sizeof want, "%d.%d.%d", MST_VERSION_MAJOR, MST_VERSION_MINOR, MST_VERSION_PATCH);
    if (strcmp(mst_version(), want) != 0) {
        fprintf(stderr, "consumer: mst_version() = %s, header %s\n", mst_version(), want);
        return 1;
    }
    const int32_t counts[E] = {13, 0, 21}; /* 34 of R = 40 rows */
    const int n = counts[0] + counts[1] + counts[2];
    static uint16_t x[R * I], w[E * O * I], y[R * O];
    for (int i = 0; i < R * I; i++) x[i] = random_bf16();
    for (int i = 0; i < E * O * I; i++) w[i] = random_bf16();
    for (int i = 0; i < R * O; i++) y[i] = 0x7fc1; /* a NaN sentinel */

    mst_ctx_t* ctx = NULL;
    void *dx = NULL, *dw = NULL, *dy = NULL, *dc = NULL;
    if (mst_ctx_create(MST_BACKEND_CPU, 0, &ctx) != MST_OK) return fail("mst_ctx_create");
    if (mst_alloc(ctx, sizeof x, &dx) || mst_alloc(ctx, sizeof w, &dw) || mst_alloc(ctx, sizeof y, &dy) ||
        mst_alloc(ctx, sizeof counts, &dc))
        return fail("mst_alloc");
    if (mst_copy_h2b(ctx, dx, x, sizeof x) || mst_copy_h2b(ctx, dw, w, sizeof w) ||
        mst_copy_h2b(ctx, dy, y, sizeof y) || mst_copy_h2b(ctx, dc, counts, sizeof counts))
        return fail("mst_copy_h2b");
    mst_tensor tx = mst_tensor_make(dx, MST_DTYPE_BF16, R, I), tw = mst_tensor_make(dw, MST_DTYPE_BF16, E * O, I),
               ty = mst_tensor_make(dy, MST_DTYPE_BF16, R, O), tc = mst_tensor_make(dc, MST_DTYPE_INT32, E, 1);
    if (mst_grouped_linear_forward(ctx, &tx, &tw, NULL, NULL, &tc, &ty) != MST_OK) return fail("forward");
    if (mst_copy_b2h(ctx, y, dy, sizeof y) != MST_OK) return fail("mst_copy_b2h");
    mst_ctx_destroy(ctx); /* frees the four allocations */

    int bad = 0;
    for (int g = 0, r0 = 0; g < E; r0 += counts[g++])
        for (int r = r0; r < r0 + counts[g]; r++)
            for (int o = 0; o < O; o++) {
                double ref = 0, mag = 0;
                for (int i = 0; i < I; i++) {
                    double t = bf16_value(x[r * I + i]) * bf16_value(w[(g * O + o) * I + i]);
                    ref += t;
                    mag += fabs(t);
                }
                /* bf16 rounding of the output (half an ulp: 2^-8 relative)
                 * and fp32 accumulation of I terms */
                double got = bf16_value(y[r * O + o]), tol = 0x1p-8 * fabs(ref) + (1 + 0x1p-8) * I * 0x1p-24 * mag;
                if (!(fabs(got - ref) <= tol) && bad++ < 5)
                    fprintf(stderr, "consumer: y[%d][%d] = %.7g, reference %.7g\n", r, o, got, ref);
            }
    for (int i = n * O; i < R * O; i++)
        if (y[i] != 0x7fc1 && bad++ < 5) fprintf(stderr, "consumer: y row %d past the counts was written\n", i / O);
    printf("consumer: moestash %s, grouped linear %d x %d -> %d over %d groups: %s\n", mst_version(), n, I, O, E,
           bad ? "FAILED" : "ok");
    return bad != 0;
}
