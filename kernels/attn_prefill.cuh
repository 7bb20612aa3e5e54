// Per-CTA work assignment shared by the prefill kernels (attn_prefill.cu: mma.sync, any
// sm_80+; attn_prefill_sm90.cu: wgmma, sm_90a).  See attn_prefill.cu for the layout.
#pragma once
#include "attn_common.cuh"

namespace qk_attn {

struct Seq {
    int64_t b = -1;               // sequence (request); -1: this CTA has no work
    int64_t q_row0 = 0;           // row of query 0 (dense: index into Lq; paged: into total_q)
    int64_t q_len = 0, kv_len = 0;
    int64_t tile = 0;             // query tile within the sequence
    int64_t pool_row = 0;         // paged
    bool row_ok = true;
};

// Paged: which (request, query tile) the CTA's linear tile index t falls in.  Requests are
// scanned in chunks of kThreads with a block-wide prefix sum of their tile counts.
template <int kBM, int kThreads> __device__ Seq find_request(const qk_attn_prefill_args &a, int64_t t) {
    constexpr int kWarps = kThreads / 32;
    __shared__ int64_t found_b, found_base, warp_sum[kWarps];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) found_b = -1;
    __syncthreads();
    int64_t base = 0;
    for (int64_t c0 = 0; c0 < a.B; c0 += kThreads) {
        const int64_t b = c0 + tid;
        int64_t n = 0;
        if (b < a.B) {
            const int64_t lo = clamp_len(load_index(a.qo_indptr, a.qo_indptr_dtype, b * a.qo_indptr_stride), a.total_q);
            const int64_t hi = clamp_len(load_index(a.qo_indptr, a.qo_indptr_dtype, (b + 1) * a.qo_indptr_stride), a.total_q);
            n = hi > lo ? (hi - lo + kBM - 1) / kBM : 0;
        }
        int64_t incl = n;  // inclusive prefix within the warp, then across warps
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int64_t y = shfl64_up(incl, o);
            if (lane >= o) incl += y;
        }
        if (lane == 31) warp_sum[warp] = incl;
        __syncthreads();
        int64_t before = base, total = 0;
        for (int w = 0; w < kWarps; w++) {
            if (w < warp) before += warp_sum[w];
            total += warp_sum[w];
        }
        const int64_t excl = before + incl - n;
        if (n > 0 && t >= excl && t < excl + n) {
            found_b = b;
            found_base = excl;
        }
        base += total;
        __syncthreads();
        if (found_b >= 0 || base > t) break;  // uniform: shared / identical values
    }
    Seq s;
    const int64_t b = found_b;
    if (b < 0) return s;
    s.b = b;
    s.tile = t - found_base;
    s.q_row0 = clamp_len(load_index(a.qo_indptr, a.qo_indptr_dtype, b * a.qo_indptr_stride), a.total_q);
    const int64_t q_end = clamp_len(load_index(a.qo_indptr, a.qo_indptr_dtype, (b + 1) * a.qo_indptr_stride), a.total_q);
    s.q_len = q_end > s.q_row0 ? q_end - s.q_row0 : 0;
    const int64_t k0 = load_index(a.kv_indptr, a.kv_indptr_dtype, b * a.kv_indptr_stride);
    const int64_t k1 = load_index(a.kv_indptr, a.kv_indptr_dtype, (b + 1) * a.kv_indptr_stride);
    s.kv_len = clamp_len(k1 - k0, a.max_ctx);
    s.pool_row = load_index(a.req_pool_indices, a.rpi_dtype, b * a.rpi_stride);
    s.row_ok = s.pool_row >= 0 && s.pool_row < a.num_requests;
    return s;
}


// The sequence and query tile this CTA owns.  Dense: grid (tiles, Hq, B), tiles scheduled longest
// first (reverse order, so the causal triangle's long tiles do not form the tail).  Paged: grid
// (tiles bound, Hq), found by find_request; rows of q before qo_indptr[0] or from qo_indptr[B] on
// belong to no request and are zeroed here, as on the cpu (every CTA a grid-stride share; usually
// there are none).  s.b < 0: no work.
template <int kBM, int kThreads, int D, bool kPaged> __device__ Seq prefill_seq(const qk_attn_prefill_args &a) {
    Seq s;
    if (kPaged) {
        const int64_t lo = clamp_len(load_index(a.qo_indptr, a.qo_indptr_dtype, 0), a.total_q);
        const int64_t hi = max(lo, clamp_len(load_index(a.qo_indptr, a.qo_indptr_dtype, a.B * a.qo_indptr_stride), a.total_q));
        const int64_t per_row = a.Hq * (D / 8);
        const int64_t n = (lo + a.total_q - hi) * per_row;
        const int64_t nthreads = (int64_t)gridDim.x * gridDim.y * kThreads;
        for (int64_t e = ((int64_t)blockIdx.y * gridDim.x + blockIdx.x) * kThreads + threadIdx.x; e < n; e += nthreads) {
            const int64_t r = e / per_row, hh = (e % per_row) / (D / 8), c = e % (D / 8);
            const int64_t t = r < lo ? r : hi + (r - lo);
            *reinterpret_cast<uint4 *>(static_cast<uint16_t *>(a.out) + t * a.out_stride[1] + hh * a.out_stride[2] + c * 8) =
                make_uint4(0, 0, 0, 0);
        }
        s = find_request<kBM, kThreads>(a, (int64_t)gridDim.x - 1 - blockIdx.x);
    } else {
        s.b = blockIdx.z;
        s.q_len = a.Lq;
        s.kv_len = a.Lkv;
        s.tile = (int64_t)gridDim.x - 1 - blockIdx.x;
    }
    if (s.b >= 0 && s.tile * kBM >= s.q_len) s.b = -1;
    return s;
}

// One past the last key any of the CTA's queries q0 .. q0 + kBM - 1 may see: kv_len, cut at the
// causal diagonal of its last query; 0 for a request whose pool row is out of range.
template <int kBM> __device__ __forceinline__ int64_t cta_key_end(const qk_attn_prefill_args &a, const Seq &s, int64_t q0) {
    int64_t key_end = s.kv_len;
    if (a.causal) key_end = min(key_end, q0 + kBM - 1 + (s.kv_len - s.q_len) + 1);
    return s.row_ok ? key_end : 0;
}

// key_row below before its pool-range check: the key position (dense) or the req_to_token entry
// as loaded (paged), -1 when the key is past key_end or dropped by a key mask (or past its width).  Split so a
// caller can issue the index load early and check it once it has landed.
template <bool kPaged>
__device__ __forceinline__ int64_t key_entry(const qk_attn_prefill_args &a, const Seq &s, int64_t key_end, int64_t j) {
    if (j >= key_end) return -1;
    if (a.mask_kind == 1 && ((a.mask_cols > 0 && j >= a.mask_cols) ||
                             !static_cast<const uint8_t *>(a.mask)[s.b * a.mask_stride[0] + j * a.mask_stride[3]]))
        return -1;
    if (!kPaged) return j;
    return load_index(a.req_to_token, a.r2t_dtype, s.pool_row * a.r2t_stride[0] + j * a.r2t_stride[1]);
}
__device__ __forceinline__ int64_t slot_in_pool(const qk_attn_prefill_args &a, int64_t slot) {
    return slot >= 0 && slot < a.pool_size ? slot : -1;
}

// The row of K/V (dense: the key position; paged: the pool slot) holding key j of the CTA's
// sequence, or -1 when the key is skipped: past key_end, dropped by a key mask, or at an
// out-of-range pool slot.
template <bool kPaged>
__device__ __forceinline__ int64_t key_row(const qk_attn_prefill_args &a, const Seq &s, int64_t key_end, int64_t j) {
    const int64_t e = key_entry<kPaged>(a, s, key_end, j);
    return kPaged ? slot_in_pool(a, e) : e;
}

}  // namespace qk_attn
