// Device helpers shared by the attention kernels (attn_decode.cu, attn_prefill.cu):
// swizzled shared tiles, cp.async, ldmatrix, fragment packing and index loads.
#pragma once
#include "common.cuh"

#include <math.h>

namespace qk_attn {

// Shared tiles are [rows][D] with 16-byte chunk c of row r at chunk index at(r, c): the XOR
// spreads the 8 rows one ldmatrix reads at a fixed column over distinct banks.
template <int D> __device__ __forceinline__ int at(int r, int c) {
    constexpr int kChunks = D / 8, kRowsPer128 = kChunks >= 8 ? 1 : 8 / kChunks, kMask = kChunks >= 8 ? 7 : kChunks - 1;
    return r * kChunks + (c ^ ((r / kRowsPer128) & kMask));
}

__device__ __forceinline__ int64_t clamp_len(int64_t v, int64_t hi) { return v < 0 ? 0 : (v > hi ? hi : v); }

__device__ __forceinline__ int64_t load_index(const void *p, int dtype, int64_t pos) {
    return dtype == QK_I64 ? (int64_t)__ldg(static_cast<const int64_t *>(p) + pos)
                           : (int64_t)__ldg(static_cast<const int32_t *>(p) + pos);
}

// Entry pos of an additive mask (float32, float16 or bfloat16) as a bias in the kernels' log2 units:
// mask * log2(e), added to score * scale * log2(e).  -inf stays -inf (the key is dropped); finite
// entries below kMaskMin are raised to it, as times log2(e) they would overflow to -inf and drop a
// key the natural-log softmax keeps.  NaN stays NaN (compared, not fmaxf).
constexpr float kMaskMin = -2.35e38f;
__device__ __forceinline__ float mask_bias_log2(const void *m, int dtype, int64_t pos) {
    float v;
    if (dtype == QK_F32) {
        v = __ldg(static_cast<const float *>(m) + pos);
    } else {
        const unsigned short h = __ldg(static_cast<const unsigned short *>(m) + pos);
        v = dtype == QK_BF16 ? __uint_as_float((uint32_t)h << 16) : __half2float(__ushort_as_half(h));
    }
    if (v == -INFINITY) return v;
    return (v < kMaskMin ? kMaskMin : v) * 1.4426950408889634f;
}

// 16 bytes global -> shared without waiting, L2 only, with a kL2-byte L2 fetch (256: a K or V row
// of D=128; decode takes 128, attn_decode.cu; docs/attention.md).  src-size 0: nothing is
// read and the 16 bytes are zero-filled.  smem as a shared-window address, or as a generic pointer
// below.
template <int kL2 = 256> __device__ __forceinline__ void cp_async16(uint32_t smem, const void *gmem, bool valid) {
    static_assert(kL2 == 128 || kL2 == 256, "L2 fetch of 128 or 256 bytes");
    if constexpr (kL2 == 256)
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(valid ? 16 : 0) : "memory");
    else
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(valid ? 16 : 0) : "memory");
}
template <int kL2 = 256> __device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool valid) {
    cp_async16<kL2>((uint32_t)__cvta_generic_to_shared(smem), gmem, valid);
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((unsigned)__cvta_generic_to_shared(p))
                 : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((unsigned)__cvta_generic_to_shared(p))
                 : "memory");
}

template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&v);
}

__device__ __forceinline__ int64_t shfl64(int64_t v, int src) {
    const int lo = __shfl_sync(0xffffffffu, (int)(uint32_t)v, src), hi = __shfl_sync(0xffffffffu, (int)(v >> 32), src);
    return (int64_t)(((uint64_t)(uint32_t)hi << 32) | (uint32_t)lo);
}

__device__ __forceinline__ int64_t shfl64_up(int64_t v, int delta) {
    const int lo = __shfl_up_sync(0xffffffffu, (int)(uint32_t)v, delta), hi = __shfl_up_sync(0xffffffffu, (int)(v >> 32), delta);
    return (int64_t)(((uint64_t)(uint32_t)hi << 32) | (uint32_t)lo);
}

// Host: a bf16/fp16 tensor whose rows (the unit-stride last dim) all start 16-byte aligned, as
// cp.async and the 16-byte loads need: the base pointer and every other stride (in elements).
inline bool aligned_rows(const void *p, const int64_t *strides, int n) {
    if (!qk_aligned16(p)) return false;
    for (int i = 0; i < n; i++)
        if (strides[i] % 8) return false;  // 16 bytes of bf16/fp16
    return true;
}

}  // namespace qk_attn
