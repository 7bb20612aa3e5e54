// The rotation shared by rotary_emb.cu and rotary_kv_append.cu: one formula, one rounding, so the two
// ops give the same bits for the same (x, cos, sin).
#pragma once
#include "common.cuh"

namespace {

// 16 bytes of x as four words of two values, through the coherent path (not __ldg): out may be x.
// The values are unpacked and packed by bit operations on the words: a local qk_vec<T> copied to
// a uint4 compiles to eight 2-byte stores.
__device__ __forceinline__ uint4 ro_load16(const void *p) { return *static_cast<const uint4 *>(p); }
__device__ __forceinline__ void ro_store16(void *p, uint4 v) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

template <typename T> __device__ __forceinline__ uint32_t ro_bits(float v);
template <> __device__ __forceinline__ uint32_t ro_bits<__nv_bfloat16>(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}
template <> __device__ __forceinline__ uint32_t ro_bits<__half>(float v) { return __half_as_ushort(__float2half_rn(v)); }
template <typename T> __device__ __forceinline__ uint32_t ro_pack(float lo, float hi) {
    return ro_bits<T>(lo) | (ro_bits<T>(hi) << 16);
}
__device__ __forceinline__ uint32_t &ro_word(uint4 &v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// One rotated pair: lo = e c - o s, hi = e s + o c, with the roundings spelled out so that every
// path gives the same bits whatever ptxas would contract (it may fuse the upper product either way
// round in different kernels).  torch's complex multiply rounds differently (docs/rotary_emb.md).
__device__ __forceinline__ float ro_lo(float e, float o, float c, float s) { return __fmaf_rn(e, c, -__fmul_rn(o, s)); }
__device__ __forceinline__ float ro_hi(float e, float o, float c, float s) { return __fmaf_rn(o, c, __fmul_rn(e, s)); }

// Rotate the four interleaved pairs of one 16-byte chunk (word p holds pair p).
template <typename T>
__device__ __forceinline__ void ro_rotate_pairs(uint4 &v, const float (&c)[4], const float (&sn)[4]) {
#pragma unroll
    for (int p = 0; p < 4; p++) {
        uint32_t &w = ro_word(v, p);
        const float e = qk_word_half<T>(w, 0), o = qk_word_half<T>(w, 1);
        w = ro_pack<T>(ro_lo(e, o, c[p], sn[p]), ro_hi(e, o, c[p], sn[p]));
    }
}

// Rotate the two rotate-half pairs of word wl (lower half) and wh (upper half): (c0, s0), (c1, s1).
template <typename T>
__device__ __forceinline__ void ro_rotate_word_pair(uint32_t &wl, uint32_t &wh, float c0, float s0, float c1, float s1) {
    const float e0 = qk_word_half<T>(wl, 0), o0 = qk_word_half<T>(wh, 0), e1 = qk_word_half<T>(wl, 1), o1 = qk_word_half<T>(wh, 1);
    wl = ro_pack<T>(ro_lo(e0, o0, c0, s0), ro_lo(e1, o1, c1, s1));
    wh = ro_pack<T>(ro_hi(e0, o0, c0, s0), ro_hi(e1, o1, c1, s1));
}
// Rotate the eight rotate-half pairs (lo[p], hi[p]) of two 16-byte chunks.
template <typename T>
__device__ __forceinline__ void ro_rotate_halves(uint4 &lo, uint4 &hi, const float (&c)[8], const float (&sn)[8]) {
#pragma unroll
    for (int q = 0; q < 4; q++) ro_rotate_word_pair<T>(ro_word(lo, q), ro_word(hi, q), c[2 * q], sn[2 * q], c[2 * q + 1], sn[2 * q + 1]);
}

// (cos, sin) of pairs i0 .. i0 + P - 1 of one token row of the table, sin times sg (1, or -1 for the
// backward op: an exact sign flip).
template <int P, bool kFVec>
__device__ __forceinline__ void ro_load_freqs(const float *f, int64_t i0, int64_t fs, float sg, float (&c)[P],
                                              float (&s)[P]) {
    if (kFVec) {  // pairs contiguous (fs == 2) and 16-byte aligned: P/2 float4 loads
        const float4 *q = reinterpret_cast<const float4 *>(f + 2 * i0);
#pragma unroll
        for (int k = 0; k < P / 2; k++) {
            const float4 v = __ldg(q + k);
            c[2 * k] = v.x;
            s[2 * k] = sg * v.y;
            c[2 * k + 1] = v.z;
            s[2 * k + 1] = sg * v.w;
        }
    } else {
#pragma unroll
        for (int k = 0; k < P; k++) {
            c[k] = __ldg(f + (i0 + k) * fs);
            s[k] = sg * __ldg(f + (i0 + k) * fs + 1);
        }
    }
}

}  // namespace
