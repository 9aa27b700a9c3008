/*
 * dev/fp8_blocks.c — the fp8 page format's scale granularity: one scale per
 * 128-element block (what the pages use) against one per row, on rows of
 * 4096 bf16 values of three kinds, with fp8_page.h's own rounding. Prints
 * the round trip's relative norm error, the share of elements whose error
 * exceeds 2^-4 of their own magnitude (they fell below the e4m3 normals of
 * their scale) and the bytes of the pages per bf16 byte.
 *   cc -O2 -Isrc dev/fp8_blocks.c -lm -o /tmp/fp8_blocks && /tmp/fp8_blocks
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "lib/backend/fp8_page.h"

enum { W = 4096, ROWS = 512 };

static uint64_t s = 88172645463325252ull;
static double uni(void) { s ^= s << 13, s ^= s >> 7, s ^= s << 17; return (double)(s >> 11) / 9007199254740992.0; }
static double gauss(void) { return sqrt(-2 * log(uni() + 1e-300)) * cos(6.283185307179586 * uni()); }

static uint16_t bf16(double v) { /* round to nearest even */
    union { float f; uint32_t u; } x = {(float)v};
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}
static double val(uint16_t h) { union { uint32_t u; float f; } x = {(uint32_t)h << 16}; return x.f; }

/* kind 0 gaussian, 1 gaussian with 8 outlier channels at 100 sigma, 2 log-normal magnitudes (sigma 2) */
static double sample(int kind, int j) {
    if (kind == 1 && j % 512 == 7) return 100 * gauss();
    if (kind == 2) return (uni() < 0.5 ? -1 : 1) * exp(2 * gauss());
    return gauss();
}

int main(void) {
    static uint16_t x[W], y[W];
    static uint8_t q[W];
    const char* kinds[] = {"gaussian", "gaussian + outlier channels (8 of 4096 at 100x)", "log-normal magnitudes"};
    for (int kind = 0; kind < 3; kind++)
        for (int blk = MST_FP8_BLOCK; blk <= W; blk = blk == W ? W + 1 : W) {
            double d = 0, r = 0, over = 0;
            for (int row = 0; row < ROWS; row++) {
                for (int j = 0; j < W; j++) x[j] = bf16(sample(kind, j));
                for (int j = 0; j < W; j += blk) {
                    float sc;
                    mst_fp8_block_save(x + j, blk, q + j, &sc);
                    mst_fp8_block_restore(q + j, sc, blk, y + j);
                }
                for (int j = 0; j < W; j++) {
                    const double e = fabs(val(y[j]) - val(x[j]));
                    d += e * e, r += val(x[j]) * val(x[j]);
                    over += e > ldexp(fabs(val(x[j])), -4) * 1.0000001;
                }
            }
            printf("%-48s scale per %-9s rel norm err %.3e  elements past 2^-4 of |x| %.4f%%  bytes %.4f\n",
                   kinds[kind], blk == W ? "row" : "128", sqrt(d / r), 100 * over / ((double)ROWS * W),
                   (double)(W + 4 * (W / blk)) / (2.0 * W));
        }
    return 0;
}
