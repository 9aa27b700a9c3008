/*
 * dtype.c — dtype sizes and names, bf16 <-> fp32 with round-to-nearest-even.
 * The CPU backend stores bf16 as uint16_t, so CPU and GPU hold the same bits
 * for the same values.
 */
#include <string.h>

#include "context.h"

size_t mst_dtype_size(mst_dtype dt) {
    switch (dt) {
    case MST_DTYPE_BF16: return 2;
    case MST_DTYPE_FP32: return 4;
    case MST_DTYPE_INT32: return 4;
    case MST_DTYPE_FP8: return 1;
    }
    return 0;
}

const char* mst_dtype_name(mst_dtype dt) {
    switch (dt) {
    case MST_DTYPE_BF16: return "bf16";
    case MST_DTYPE_FP32: return "fp32";
    case MST_DTYPE_INT32: return "int32";
    case MST_DTYPE_FP8: return "fp8";
    }
    return "unknown";
}

uint16_t mst_fp32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float mst_bf16_to_fp32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

void mst_fp32_to_bf16_array(uint16_t* dst, const float* src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = mst_fp32_to_bf16(src[i]);
}

void mst_bf16_to_fp32_array(float* dst, const uint16_t* src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = mst_bf16_to_fp32(src[i]);
}
