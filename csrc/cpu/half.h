/* float16 / bfloat16 <-> float32 for the CPU kernels, in plain C (no _Float16, no F16C intrinsics,
 * so any C11 compiler builds it and every multiversioned clone gives the same bits).
 *
 * Both narrowing conversions round to nearest even and keep NaN a (quiet) NaN.  The float16 pair
 * follows the branch-free method of Maratyszcza's FP16 library (MIT): float arithmetic does the
 * rounding, so it relies on round-to-nearest and no -ffast-math, which setup.py never sets. */
#ifndef QK_HALF_H
#define QK_HALF_H

#include <stdint.h>
#include <string.h>

#include "cpu.h"

QK_INLINE float qk_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

QK_INLINE uint32_t qk_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

QK_INLINE float qk_bf16_to_f32(uint16_t h) { return qk_bits_f32((uint32_t)h << 16); }

QK_INLINE uint16_t qk_f32_to_bf16(float f) {
    const uint32_t u = qk_f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

QK_INLINE float qk_f16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    /* normal (and inf/NaN): move exponent and mantissa into place, rebias by 2^-112 */
    const float normal = qk_bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    /* subnormal: the mantissa as the low bits of 0.5 * 2^k, minus 0.5 */
    const float subnormal = qk_bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    return qk_bits_f32(sign | qk_f32_bits(two_w < (1u << 27) ? subnormal : normal));
}

QK_INLINE uint16_t qk_f32_to_f16(float f) {
    const uint32_t w = qk_f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    /* scale so overflow becomes inf and the float adder rounds the mantissa to 10 bits */
    float base = ((f < 0 ? -f : f) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = qk_bits_f32((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = qk_f32_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

/* Element i of a float16/bfloat16/float32 array as float32, and the reverse (one rounding). */
QK_INLINE float qk_load_f32(const void *p, int64_t i, int dtype) {
    if (dtype == QK_F32) return ((const float *)p)[i];
    const uint16_t h = ((const uint16_t *)p)[i];
    return dtype == QK_BF16 ? qk_bf16_to_f32(h) : qk_f16_to_f32(h);
}

QK_INLINE void qk_store_f32(void *p, int64_t i, int dtype, float v) {
    if (dtype == QK_F32) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = dtype == QK_BF16 ? qk_f32_to_bf16(v) : qk_f32_to_f16(v);
}

#endif
