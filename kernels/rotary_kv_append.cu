// rotary_kv_append: one decode or prefill step's rotary embedding and KV-cache append.  Token t reads
// p = positions[t] and s = slots[t]; its q rows are rotated into out, its k rows rotated into
// k_pool[s], its v rows copied into v_pool[s].  The rotation is rotary_emb's (rotary.cuh): the same
// bits as rotary_emb with freqs_cis = cos_sin[positions].
//
// Work decomposition: a 256-thread block takes one token at a time (blocks stride over the tokens).
// Inside it a thread owns chunk j of a row (16 bytes = 4 interleaved pairs; rotate-half: 8 pairs, the
// 16 bytes at 8j of each half; the scalar path one pair) and walks the rotated rows r = hs, hs + hpar,
// ... of the token (the Hq rows of q, then the Hkv rows of k) two at a time, so that chunk's (cos, sin)
// is read once per token and two rows' loads are in flight.  v is copied in 16-byte pieces by every
// thread of the block.  In place (out == q) is safe: each thread reads a chunk before writing it, and
// no two threads own the same element; the pools overlap nothing else (the binding checks).
//
// Indices: a position outside [0, max_pos) writes zeros to the token's out rows and nothing to the
// pools; a slot outside [0, S) skips the pools.  Both are block-uniform branches.  The grid comes from
// T and the SM count only, and nothing is read on the host (CUDA-graph safe).
// Bytes per call: read q, k, v and T*D*4 of the table, write out, k and v rows:
// 2 * T*(Hq + 2 Hkv)*D*2 + T*D*4; T = 32k, Hq = 32, Hkv = 8, D = 128, bf16: 822 MB.
#include "common.cuh"
#include "rotary.cuh"

namespace {

constexpr int kThreads = 256;

enum { kScalar = 0, kVecInterleaved = 1, kVecHalf = 2 };

__device__ __forceinline__ int64_t rka_index(const void *p, int dtype, int64_t i, int64_t stride) {
    return dtype == QK_I32 ? (int64_t)__ldg(static_cast<const int32_t *>(p) + i * stride)
                           : (int64_t)__ldg(static_cast<const long long *>(p) + i * stride);
}

// Rotated row r of token t: q's row r into out (r < Hq), else k's row r - Hq into the pool slot's
// (dst NULL when the slot is bad: rotated, not stored).
template <typename T>
__device__ __forceinline__ void rka_row(const qk_rotary_kv_append_args &a, int64_t r, const T *qt, const T *kt, T *ot,
                                        T *kp, const T *&src, T *&dst) {
    if (r < a.Hq) {
        src = qt + r * a.q_stride[1];
        dst = ot + r * a.out_stride[1];
    } else {
        src = kt + (r - a.Hq) * a.k_stride[1];
        dst = kp ? kp + (r - a.Hq) * a.kp_stride[1] : nullptr;
    }
}

// Rows r and r + step, the vector kernels' pair (more loads in flight per thread): false, with the
// second row's pointers NULL, when r + step is past the last row R - 1.
template <typename T>
__device__ __forceinline__ bool rka_row_pair(const qk_rotary_kv_append_args &a, int64_t r, int64_t step, int64_t R,
                                             const T *qt, const T *kt, T *ot, T *kp, const T *&s0, T *&d0,
                                             const T *&s1, T *&d1) {
    rka_row<T>(a, r, qt, kt, ot, kp, s0, d0);
    s1 = nullptr;
    d1 = nullptr;
    if (r + step >= R) return false;
    rka_row<T>(a, r + step, qt, kt, ot, kp, s1, d1);
    return true;
}

template <typename T, int kMode, bool kFVec>
__global__ void __launch_bounds__(kThreads, kMode == kVecHalf ? 3 : 4)
    rka_kernel(qk_rotary_kv_append_args a, int nc, int nct, int hpar, int early) {
    // A programmatic dependent (qk_launch_dependent); early: the grid fits one wave (decode's few tokens).
    qk_dependent_enter(early);
    const int tid = threadIdx.x;
    const int jt = tid % nct, hs = tid / nct;
    const int64_t R = a.Hq + a.Hkv, D = a.D, half = D / 2;
    const T *q = static_cast<const T *>(a.q), *k = static_cast<const T *>(a.k), *v = static_cast<const T *>(a.v);
    T *out = static_cast<T *>(a.out), *k_pool = static_cast<T *>(a.k_pool), *v_pool = static_cast<T *>(a.v_pool);
    constexpr int kPiece = kMode == kScalar ? 1 : 8;  // v is copied in pieces of this many values
    const int64_t pieces = D / kPiece, vpieces = a.Hkv * pieces;
    // The next token's indices are loaded at the top of each iteration, before any store, so a token's
    // table row and data are one memory latency away, not two.
    int64_t p_next = 0, s_next = 0;
    if (blockIdx.x < a.T) {
        p_next = rka_index(a.positions, a.pos_dtype, blockIdx.x, a.pos_stride);
        s_next = rka_index(a.slots, a.slot_dtype, blockIdx.x, a.slot_stride);
    }
    for (int64_t t = blockIdx.x; t < a.T; t += gridDim.x) {
        const int64_t p = p_next, s = s_next;
        if (t + gridDim.x < a.T) {
            p_next = rka_index(a.positions, a.pos_dtype, t + gridDim.x, a.pos_stride);
            s_next = rka_index(a.slots, a.slot_dtype, t + gridDim.x, a.slot_stride);
        }
        T *ot = out + t * a.out_stride[0];
        if (p < 0 || p >= a.max_pos) {  // never followed: zeros in the out rows, the pools untouched
            for (int64_t i = tid; i < a.Hq * D; i += kThreads) ot[(i / D) * a.out_stride[1] + i % D] = qk_from_float<T>(0.f);
            continue;
        }
        const bool slot_ok = s >= 0 && s < a.S;
        const T *qt = q + t * a.q_stride[0], *kt = k + t * a.k_stride[0];
        T *kp = slot_ok ? k_pool + s * a.kp_stride[0] : nullptr;
        const float *ft = a.cos_sin + p * a.cs_stride[0];
        // v: a copy, read through the read-only path (the pools overlap no input).  The thread's first
        // 16-byte piece is loaded here and stored after the rotation, so that its load is in flight with
        // the table's and q's, behind no store.
        const T *vt = v + t * a.v_stride[0];
        T *vp = slot_ok ? v_pool + s * a.vp_stride[0] : nullptr;
        const bool v_early = kMode != kScalar && vp && tid < vpieces;
        uint4 v_first = make_uint4(0, 0, 0, 0);
        if (v_early) v_first = __ldg(reinterpret_cast<const uint4 *>(vt + (tid / pieces) * a.v_stride[1] + (tid % pieces) * kPiece));
        if (hs < hpar) {
            for (int j = jt; j < nc; j += nct) {
                if (kMode == kScalar) {
                    const float c = __ldg(ft + j * a.cs_stride[1]), sn = __ldg(ft + j * a.cs_stride[1] + 1);
                    const int64_t ie = a.interleaved ? 2 * j : j, io = a.interleaved ? 2 * j + 1 : j + half;
                    for (int64_t r = hs; r < R; r += hpar) {
                        const T *src;
                        T *dst;
                        rka_row<T>(a, r, qt, kt, ot, kp, src, dst);
                        const float xe = qk_to_float(src[ie]), xo = qk_to_float(src[io]);
                        if (dst) {
                            dst[ie] = qk_from_float<T>(ro_lo(xe, xo, c, sn));
                            dst[io] = qk_from_float<T>(ro_hi(xe, xo, c, sn));
                        }
                    }
                } else if (kMode == kVecInterleaved) {
                    float c[4], sn[4];
                    ro_load_freqs<4, kFVec>(ft, 4 * (int64_t)j, a.cs_stride[1], 1.f, c, sn);
                    for (int64_t r = hs; r < R; r += 2 * hpar) {
                        const T *s0, *s1;
                        T *d0, *d1;
                        const bool two = rka_row_pair<T>(a, r, hpar, R, qt, kt, ot, kp, s0, d0, s1, d1);
                        // Both rows' loads before any store: out may be q.
                        uint4 v0 = ro_load16(s0 + 8 * j), v1 = v0;
                        if (two) v1 = ro_load16(s1 + 8 * j);
                        ro_rotate_pairs<T>(v0, c, sn);
                        ro_rotate_pairs<T>(v1, c, sn);
                        if (d0) ro_store16(d0 + 8 * j, v0);
                        if (d1) ro_store16(d1 + 8 * j, v1);
                    }
                } else {  // kVecHalf: pairs 8j .. 8j+7 are src[8j ..] and src[half + 8j ..]
                    float c[8], sn[8];
                    ro_load_freqs<8, kFVec>(ft, 8 * (int64_t)j, a.cs_stride[1], 1.f, c, sn);
                    for (int64_t r = hs; r < R; r += 2 * hpar) {
                        const T *s0, *s1;
                        T *d0, *d1;
                        const bool two = rka_row_pair<T>(a, r, hpar, R, qt, kt, ot, kp, s0, d0, s1, d1);
                        uint4 lo0 = ro_load16(s0 + 8 * j), hi0 = ro_load16(s0 + half + 8 * j), lo1 = lo0, hi1 = hi0;
                        if (two) {
                            lo1 = ro_load16(s1 + 8 * j);
                            hi1 = ro_load16(s1 + half + 8 * j);
                        }
                        ro_rotate_halves<T>(lo0, hi0, c, sn);
                        ro_rotate_halves<T>(lo1, hi1, c, sn);
                        if (d0) {
                            ro_store16(d0 + 8 * j, lo0);
                            ro_store16(d0 + half + 8 * j, hi0);
                        }
                        if (d1) {
                            ro_store16(d1 + 8 * j, lo1);
                            ro_store16(d1 + half + 8 * j, hi1);
                        }
                    }
                }
            }
        }
        if (vp) {
            if (v_early) ro_store16(vp + (tid / pieces) * a.vp_stride[1] + (tid % pieces) * kPiece, v_first);
            for (int64_t i = kMode == kScalar ? tid : tid + kThreads; i < vpieces; i += kThreads) {
                const int64_t h = i / pieces, e = (i % pieces) * kPiece;
                if (kMode == kScalar) vp[h * a.vp_stride[1] + e] = vt[h * a.v_stride[1] + e];
                else ro_store16(vp + h * a.vp_stride[1] + e, __ldg(reinterpret_cast<const uint4 *>(vt + h * a.v_stride[1] + e)));
            }
        }
    }
}

template <typename T>
int rka_launch(const qk_rotary_kv_append_args *a, cudaStream_t stream) {
    constexpr int V = 8;  // 16 bytes of a 2-byte type
    bool vec = qk_aligned16(a->q) && qk_aligned16(a->k) && qk_aligned16(a->v) && qk_aligned16(a->out) &&
               qk_aligned16(a->k_pool) && qk_aligned16(a->v_pool);
    for (int i = 0; i < 2; i++)
        vec = vec && a->q_stride[i] % V == 0 && a->k_stride[i] % V == 0 && a->v_stride[i] % V == 0 &&
              a->out_stride[i] % V == 0 && a->kp_stride[i] % V == 0 && a->vp_stride[i] % V == 0;
    int mode = kScalar;
    if (vec && a->interleaved && a->D % 8 == 0) mode = kVecInterleaved;
    if (vec && !a->interleaved && a->D % 16 == 0) mode = kVecHalf;
    const bool fvec = a->cs_stride[1] == 2 && qk_aligned16(a->cos_sin) && a->cs_stride[0] % 4 == 0;
    const int64_t nc64 = mode == kVecInterleaved ? a->D / 8 : mode == kVecHalf ? a->D / 16 : a->D / 2;
    // Threads of a block: nct over chunks, then hpar over the token's rotated rows.
    const int nct = (int)(nc64 < kThreads ? nc64 : kThreads);
    const int64_t rows = a->Hq + a->Hkv, per_row = kThreads / nct;
    const int hpar = (int)(rows < per_row ? rows : per_row);
    int sms;
    QK_CUDA_TRY((cudaError_t)qk_sm_count(&sms));
    // Enough blocks for every SM to hold all it can; more tokens are taken by the grid-stride loop.
    const int64_t cap = (int64_t)sms * 16;
    const unsigned blocks = (unsigned)(a->T < cap ? a->T : cap);
    qk_rotary_kv_append_args p = *a;
    int nc = (int)nc64, nct_ = nct, hpar_ = hpar, early = blocks <= (unsigned)sms;
    void *args[] = {&p, &nc, &nct_, &hpar_, &early};
    const void *kernel;
    if (mode == kVecInterleaved)
        kernel = fvec ? (const void *)rka_kernel<T, kVecInterleaved, true> : (const void *)rka_kernel<T, kVecInterleaved, false>;
    else if (mode == kVecHalf)
        kernel = fvec ? (const void *)rka_kernel<T, kVecHalf, true> : (const void *)rka_kernel<T, kVecHalf, false>;
    else
        kernel = (const void *)rka_kernel<T, kScalar, false>;
    return qk_launch_dependent(kernel, dim3(blocks), dim3(kThreads), 0, stream, args);
}

}  // namespace

extern "C" int qk_rotary_kv_append_cuda(const qk_rotary_kv_append_args *a, void *stream) {
    if (a->T <= 0 || a->D <= 0 || (a->Hq <= 0 && a->Hkv <= 0)) return QK_OK;
    if (a->D % 2 || (a->pos_dtype != QK_I32 && a->pos_dtype != QK_I64) ||
        (a->slot_dtype != QK_I32 && a->slot_dtype != QK_I64))
        return QK_E_UNSUPPORTED;
    switch (a->dtype) {
    case QK_F16: return rka_launch<__half>(a, (cudaStream_t)stream);
    case QK_BF16: return rka_launch<__nv_bfloat16>(a, (cudaStream_t)stream);
    default: return QK_E_UNSUPPORTED;  // float32 on cuda is staged through the cpu backend
    }
}
