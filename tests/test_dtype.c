/*
 * test_dtype.c — bf16 <-> fp32, bit for bit: a hand-written table of fp32
 * bit patterns and the bf16 each must give (ties both ways, carries into the
 * exponent, overflow to infinity, subnormals, signed zeros, NaNs); every tie
 * and both of its neighbours for all 65536 upper halves; random patterns;
 * every bf16 back to fp32. References: the table, and the harness's
 * mst_ref_bf16 / mst_ref_bf16_value (a grid search and field decoding that
 * share no code with the library). The array forms against the scalar ones.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static int is_nan16(uint16_t h) { return (h & 0x7F80) == 0x7F80 && (h & 0x7F) != 0; }

/* fp32 bits -> the bf16 they must round to, worked out by hand. */
static const struct { uint32_t in; uint16_t out; const char* what; } table[] = {
    {0x3F800000u, 0x3F80, "1.0 exact"},
    {0x3F807FFFu, 0x3F80, "just below the midpoint: down"},
    {0x3F808000u, 0x3F80, "tie, even below (0x3F80): down"},
    {0x3F808001u, 0x3F81, "just above the midpoint: up"},
    {0x3F818000u, 0x3F82, "tie, odd below (0x3F81): up to even"},
    {0x3F828000u, 0x3F82, "tie, even below (0x3F82): down"},
    {0xBF808000u, 0xBF80, "negative tie, even below: toward zero"},
    {0xBF818000u, 0xBF82, "negative tie, odd below: away from zero"},
    {0xBF80C000u, 0xBF81, "negative, past the midpoint"},
    {0x3FFF8000u, 0x4000, "tie, odd below: carries into the exponent (2.0)"},
    {0x3FFFFFFFu, 0x4000, "just below 2: up into the next binade"},
    {0x7F7F0000u, 0x7F7F, "largest finite bf16 exact"},
    {0x7F7F7FFFu, 0x7F7F, "below the midpoint to infinity: largest finite"},
    {0x7F7F8000u, 0x7F80, "tie between largest finite (odd) and infinity: infinity"},
    {0x7F7FFFFFu, 0x7F80, "largest fp32: infinity"},
    {0xFF7F8000u, 0xFF80, "negative tie to infinity"},
    {0x7F800000u, 0x7F80, "+infinity"},
    {0xFF800000u, 0xFF80, "-infinity"},
    {0x00000000u, 0x0000, "+0"},
    {0x80000000u, 0x8000, "-0"},
    {0x00008000u, 0x0000, "subnormal tie at zero (even): +0"},
    {0x80008000u, 0x8000, "negative subnormal tie at zero: -0"},
    {0x00008001u, 0x0001, "subnormal past the midpoint: smallest bf16 subnormal"},
    {0x00018000u, 0x0002, "subnormal tie, odd below: up"},
    {0x007F8000u, 0x0080, "largest subnormal tie: carries to the smallest normal"},
    {0x00800000u, 0x0080, "smallest normal"},
    {0x4049000Fu, 0x4049, "pi-ish, below the midpoint"},
    {0xC2F6E979u, 0xC2F7, "-123.456: up in magnitude"},
};

static void test_table(void) {
    for (size_t i = 0; i < sizeof table / sizeof *table; i++) {
        uint16_t got = mst_fp32_to_bf16(from_bits(table[i].in));
        CHECK(got == table[i].out, "fp32 0x%08x (%s): bf16 0x%04x, expected 0x%04x", table[i].in, table[i].what,
              got, table[i].out);
        uint16_t ref = mst_ref_bf16(from_bits(table[i].in));
        CHECK(ref == table[i].out, "the harness reference gives 0x%04x for 0x%08x, the table 0x%04x", ref,
              table[i].in, table[i].out);
    }
}

/* NaN in: NaN out with the sign kept and the quiet bit set, even when the
 * payload sits only in the 16 bits that are dropped. */
static void test_nan(void) {
    const uint32_t nans[] = {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7F80FFFFu, 0x7FBF0000u, 0x7FFFFFFFu};
    for (size_t i = 0; i < sizeof nans / sizeof *nans; i++) {
        uint16_t got = mst_fp32_to_bf16(from_bits(nans[i]));
        CHECK(is_nan16(got) && (got & 0x40) && (got >> 15) == (nans[i] >> 31),
              "fp32 NaN 0x%08x: bf16 0x%04x, expected a quiet NaN of the same sign", nans[i], got);
    }
}

/* Reference check of one fp32 pattern; returns 1 when it agrees. */
static int agrees(uint32_t u) {
    float f = from_bits(u);
    uint16_t got = mst_fp32_to_bf16(f);
    if (isnan(f)) return is_nan16(got) && (got >> 15) == (u >> 31);
    return got == mst_ref_bf16(f);
}

/* Every upper half with lower halves 0x7FFF, 0x8000 (the tie), 0x8001, 0 and
 * 0xFFFF; then random patterns. */
static void test_sweep(void) {
    static const uint32_t lows[] = {0x7FFFu, 0x8000u, 0x8001u, 0x0000u, 0xFFFFu};
    int64_t bad = 0;
    uint32_t first = 0;
    for (uint32_t hi = 0; hi < 0x10000u; hi++)
        for (size_t j = 0; j < sizeof lows / sizeof *lows; j++) {
            uint32_t u = hi << 16 | lows[j];
            if (!agrees(u) && bad++ == 0) first = u;
        }
    CHECK(bad == 0, "fp32 -> bf16 disagrees with the reference on %lld of the tie sweep's patterns (first 0x%08x -> 0x%04x, "
          "reference 0x%04x)", (long long)bad, first, mst_fp32_to_bf16(from_bits(first)), mst_ref_bf16(from_bits(first)));
    mst_rng r = {41};
    bad = 0;
    for (int i = 0; i < 1 << 20; i++) {
        uint32_t u = (uint32_t)mst_rng_next(&r);
        if (!agrees(u) && bad++ == 0) first = u;
    }
    CHECK(bad == 0, "fp32 -> bf16 disagrees with the reference on %lld of 2^20 random patterns (first 0x%08x)",
          (long long)bad, first);
}

/* Every bf16 to fp32: the value of its fields, exactly (NaN stays NaN). */
static void test_widen(void) {
    int64_t bad = 0;
    uint32_t first = 0;
    for (uint32_t h = 0; h < 0x10000u; h++) {
        float f = mst_bf16_to_fp32((uint16_t)h);
        double want = mst_ref_bf16_value((uint16_t)h);
        int ok = isnan(want) ? isnan(f) && !signbit(f) == !signbit(want) : (double)f == want && !signbit(f) == !signbit(want);
        if (!ok && bad++ == 0) first = h;
    }
    CHECK(bad == 0, "bf16 -> fp32 wrong for %lld of 65536 patterns (first 0x%04x -> %a)", (long long)bad, first,
          (double)mst_bf16_to_fp32((uint16_t)first));
}

/* The array forms: element for element the scalar ones, nothing written past n. */
static void test_arrays(void) {
    enum { N = 4099, PAD = 8 };
    float* f = (float*)malloc(sizeof(float) * (N + PAD));
    uint16_t* h = (uint16_t*)malloc(sizeof(uint16_t) * (N + PAD));
    mst_rng r = {7};
    for (int i = 0; i < N + PAD; i++) f[i] = from_bits((uint32_t)mst_rng_next(&r) & 0xBFFFFFFFu); /* finite */
    for (int i = 0; i < N + PAD; i++) h[i] = 0xA5A5;
    mst_fp32_to_bf16_array(h, f, N);
    int bad = 0, past = 0;
    for (int i = 0; i < N; i++) bad += h[i] != mst_ref_bf16(f[i]);
    for (int i = N; i < N + PAD; i++) past += h[i] != 0xA5A5;
    CHECK(bad == 0 && past == 0, "fp32 -> bf16 array: %d of %d differ from the reference, %d written past n", bad, N, past);
    float keep = f[N];
    mst_bf16_to_fp32_array(f, h, N);
    bad = 0;
    for (int i = 0; i < N; i++) bad += (double)f[i] != mst_ref_bf16_value(h[i]);
    CHECK(bad == 0 && memcmp(&f[N], &keep, sizeof keep) == 0, "bf16 -> fp32 array: %d of %d wrong or written past n",
          bad, N);
    free(f);
    free(h);
}

static void run(mst_ctx_t* ctx) {
    (void)ctx; /* host conversions: the same on every backend */
    test_table();
    test_nan();
    test_sweep();
    test_widen();
    test_arrays();
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
