/*
 * fp8_page.h — the fp8 page format of the paged stash, one source for the
 * CPU backend and the CUDA kernels (MST_HD): e4m3 rounding, block scales and
 * where a row's values and scales sit in a page.
 *
 * A pool of fp8 pages (mst_pool_create with MST_DTYPE_FP8) holds bf16 rows
 * of W elements, each cut into blocks of MST_FP8_BLOCK elements (the last
 * one shorter when W is not a multiple). A block is stored as e4m3 codes q
 * and one fp32 scale s = 2^k, the smallest power of two with
 * amax(|x|) / s <= 448 (k clamped to [MST_FP8_K_MIN, MST_FP8_K_MAX]):
 *
 *   save:    q[i] = e4m3(x[i] / s)   round to nearest even, saturating to 448
 *   restore: x'[i] = bf16(q[i] * s)  exact (an e4m3 value has 4 significant
 *                                    bits, a bf16 8; k >= MST_FP8_K_MIN keeps
 *                                    every product a bf16; saturating at the
 *                                    largest finite bf16 where k = 120)
 *
 * Every step works on the bits with integer arithmetic (a power-of-two scale
 * is an exponent shift), so both backends give the same bytes whatever their
 * float modes (FTZ, FMA contraction). Error of the round trip, per element:
 *   |x' - x| <= 2^-4 |x|           where |x| / s >= 2^-6 (e4m3 normals: 3
 *                                    mantissa bits, half an ulp)
 *   |x' - x| <= 2^-10 s            below (e4m3 subnormals, step 2^-9 s)
 * so |x' - x| <= 2^-4 max(|x|, 2^-6 s) <= 2^-4 amax: within e4m3's 2^-4
 * of the block's amax. A block holding inf or NaN is not stored: its codes
 * are zeros, its scale 1, and the save raises MST_FLAG_NONFINITE.
 *
 * Page layout (page_rows rows of W elements, nb = ceil(W / 128) blocks):
 *   [page_rows, W]  uint8 e4m3 codes, row r at byte r * W
 *   [page_rows, nb] fp32 scales, row r at byte page_rows * W + 4 r nb
 * page_rows is a multiple of 8, so the scales are 4-byte aligned; fp8 pools
 * have W a multiple of 8 (the CUDA kernels move 4 codes at a time).
 */
#ifndef MST_FP8_PAGE_H
#define MST_FP8_PAGE_H

#include <stdint.h>

#include "host_device.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MST_FP8_BLOCK 128       /* elements per scale                               */
#define MST_FP8_K_MIN (-124)    /* smallest scale exponent: restores stay bf16       */
#define MST_FP8_K_MAX 120       /* largest (amax of a bf16 row: below 2^128)         */
#define MST_E4M3_MAX 0x7e       /* code of 448, the largest finite e4m3 (0x7f: NaN)  */
#define MST_BF16_NONFINITE 0x7f80 /* |bits| at or above: inf or NaN                  */

/* Index of the highest set bit of m (1 <= m < 2^16). */
MST_HD int mst_fp8_msb(uint32_t m) {
#ifdef __CUDA_ARCH__
    return 31 - __clz((int)m);
#else
    return 31 - __builtin_clz(m);
#endif
}

/* m / 2^sh rounded to nearest, ties to even (1 <= sh <= 31). */
MST_HD uint32_t mst_fp8_rne_shr(uint32_t m, int sh) {
    const uint32_t q = m >> sh, rem = m & ((1u << sh) - 1u), half = 1u << (sh - 1);
    return q + (rem > half || (rem == half && (q & 1u)));
}

/* The magnitude of bf16 bits x (finite) as m * 2^e, m < 2^8 an integer. */
MST_HD uint32_t mst_fp8_bf16_parts(uint16_t x, int* e) {
    const uint32_t eb = (x >> 7) & 0xffu, mant = x & 0x7fu;
    *e = (eb ? (int)eb : 1) - 127 - 7;
    return eb ? (0x80u | mant) : mant;
}

/* The scale exponent k of a block whose largest magnitude has bf16 bits
 * amax (sign clear, finite): the smallest k with amax * 2^-k <= 448 = 1.75 *
 * 2^8, clamped to [MST_FP8_K_MIN, MST_FP8_K_MAX]; 0 for a block of zeros. */
MST_HD int mst_fp8_scale_exp(uint16_t amax) {
    if (amax == 0) return 0;
    int e;
    const uint32_t m = mst_fp8_bf16_parts(amax, &e);
    const int msb = mst_fp8_msb(m), top = e + msb; /* 2^top <= amax < 2^(top + 1) */
    const int k = 4 * m <= (7u << msb) ? top - 8 : top - 7; /* amax / 2^top <= 1.75 ? */
    return k < MST_FP8_K_MIN ? MST_FP8_K_MIN : k;
}

/* The fp32 scale 2^k. */
MST_HD float mst_fp8_scale_value(int k) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)(k + 127) << 23;
    return v.f;
}

/* k of a scale written by mst_fp8_scale_value. */
MST_HD int mst_fp8_scale_k(float s) {
    union { uint32_t u; float f; } v;
    v.f = s;
    return (int)((v.u >> 23) & 0xffu) - 127;
}

/* The e4m3 code of bf16 x / 2^k (x finite): round to nearest even,
 * saturating to +-448. */
MST_HD uint8_t mst_e4m3_encode(uint16_t x, int k) {
    const uint8_t sign = (uint8_t)((x >> 8) & 0x80u);
    int e;
    const uint32_t m = mst_fp8_bf16_parts(x, &e);
    if (m == 0) return sign;
    const int f = e - k, msb = mst_fp8_msb(m); /* |x| / 2^k = m 2^f */
    int ve = f + msb;                          /* its binade        */
    if (ve > 8) return sign | MST_E4M3_MAX;
    if (ve < -6) { /* an e4m3 subnormal: q 2^-9, q = round(m 2^(f + 9)) in [0, 8] (8: the least normal) */
        const int sh = -(f + 9);
        const uint32_t q = sh <= 0 ? m << -sh : sh >= 16 ? 0u : mst_fp8_rne_shr(m, sh);
        return sign | (uint8_t)q;
    }
    const int sh = msb - 3; /* keep 4 significant bits */
    uint32_t m4 = sh > 0 ? mst_fp8_rne_shr(m, sh) : m << -sh;
    if (m4 == 16) m4 = 8, ve++;
    const uint32_t code = ((uint32_t)(ve + 7) << 3) | (m4 & 7u);
    return sign | (uint8_t)(code > MST_E4M3_MAX ? MST_E4M3_MAX : code);
}

/* The bf16 bits of e4m3 code c times 2^k (k >= MST_FP8_K_MIN: exact, or
 * the largest finite bf16 where the product passes it). */
MST_HD uint16_t mst_e4m3_decode(uint8_t c, int k) {
    const uint16_t sign = (uint16_t)((c & 0x80u) << 8);
    const uint32_t ef = (c >> 3) & 15u, mt = c & 7u;
    const uint32_t m = ef ? (8u | mt) : mt;
    if (m == 0) return sign;
    const int g = (ef ? (int)ef - 10 : -9) + k, msb = mst_fp8_msb(m); /* m 2^g */
    const int ve = g + msb;
    if (ve > 127) return sign | 0x7f7fu;
    if (ve < -126) return sign | (uint16_t)(m << (g + 133)); /* a bf16 subnormal, m 2^g = mant 2^-133 */
    return sign | (uint16_t)(((uint32_t)(ve + 127) << 7) | ((m << (7 - msb)) & 0x7fu));
}

/* Blocks of a row of w elements. */
MST_HD int64_t mst_fp8_blocks(int64_t w) { return (w + MST_FP8_BLOCK - 1) / MST_FP8_BLOCK; }

/* Bytes one row takes in an fp8 page: w codes and its scales. */
MST_HD int64_t mst_fp8_row_bytes(int64_t w) { return w + 4 * mst_fp8_blocks(w); }

/* Row r (< page_rows) of an fp8 page: its codes [w] and scales [nb]. */
MST_HD uint8_t* mst_fp8_codes(char* page, int64_t r, int64_t w) { return (uint8_t*)page + r * w; }
MST_HD float* mst_fp8_scales(char* page, int64_t r, int64_t w, int64_t page_rows) {
    return (float*)(page + page_rows * w) + r * mst_fp8_blocks(w);
}

/* One block x [len] bf16 (len <= MST_FP8_BLOCK) into codes q [len] and its
 * scale; returns 1, with q zeros and scale 1, when it holds inf or NaN. The
 * CPU backend's save; the CUDA kernel runs the same steps a warp per block. */
MST_HD int mst_fp8_block_save(const uint16_t* x, int64_t len, uint8_t* q, float* scale) {
    uint16_t amax = 0;
    for (int64_t i = 0; i < len; i++) {
        const uint16_t a = x[i] & 0x7fffu;
        amax = a > amax ? a : amax;
    }
    const int bad = amax >= MST_BF16_NONFINITE, k = bad ? 0 : mst_fp8_scale_exp(amax);
    for (int64_t i = 0; i < len; i++) q[i] = bad ? 0 : mst_e4m3_encode(x[i], k);
    *scale = mst_fp8_scale_value(k);
    return bad;
}

/* The restore of a block: x [len] bf16 from codes q [len] and its scale. */
MST_HD void mst_fp8_block_restore(const uint8_t* q, float scale, int64_t len, uint16_t* x) {
    const int k = mst_fp8_scale_k(scale);
    for (int64_t i = 0; i < len; i++) x[i] = mst_e4m3_decode(q[i], k);
}

#ifdef __cplusplus
}
#endif
#endif /* MST_FP8_PAGE_H */
