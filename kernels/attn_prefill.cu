// attn_prefill / attn_paged_prefill: FlashAttention-2-style forward on tensor cores (mma.sync
// m16n8k16, sm_80+).
//
// Work: one CTA per (tile of queries, query head, sequence); 4 warps of 32 query rows (D <= 128;
// 16 for D = 256, where the output fragments take the registers).
// The CTA streams kBN-key tiles of K and V through a two-buffer cp.async ring shared by its warps
// (one barrier per tile: the next tile's copies are issued right after it, so they overlap this
// tile's math).  Per tile and warp: S = q K^T (q fragments in registers for D <= 128, else
// re-read from shared memory), mask, online softmax in exp2 units (one rescale of the output per
// tile), then O += P V with P taken straight from the score fragments.  An additive (float) mask is
// read per score like a per-query bool mask and added in log2 units (mask_bias_log2).
//
// Causal (bottom-right): query i of a sequence with q_len queries and kv_len keys keeps keys
// j <= i + kv_len - q_len.  Key tiles entirely above the CTA's diagonal are never loaded; tiles
// entirely below it, inside kv_len and without a mask, skip the per-element checks.  The query
// tiles are scheduled longest first (reverse order) so the causal triangle's long tiles do not
// form the tail.
//
// Paged: request b's queries are rows qo_indptr[b] .. qo_indptr[b+1] - 1 of q, its keys pool
// slots req_to_token[req_pool_indices[b], j].  The grid is sized from shapes only
// (ceil(total_q / kBM) + B tiles bounds any split of total_q into B requests); each CTA finds its
// (request, tile) with a scan over qo_indptr, so a captured graph replays correctly when the
// lengths change.  CTAs past the last tile exit at once.
//
// Bad indices never address memory outside the tensors: lengths and row ranges are clamped, and
// keys at an out-of-range pool row or slot are skipped (probability 0).
#include "attn_prefill.cuh"

#include <math.h>

namespace {
using namespace qk_attn;

constexpr int kWarps = 4, kThreads = 32 * kWarps;

// m16 tiles of queries per warp: two for D <= 128 (each K/V fragment read from shared memory
// serves 32 query rows, halving shared-memory traffic per flop), one for D = 256 (registers).
template <int D> __host__ __device__ constexpr int mtiles() { return D <= 128 ? 2 : 1; }
template <int D> __host__ __device__ constexpr int query_tile() { return 16 * kWarps * mtiles<D>(); }
template <int D> __host__ __device__ constexpr int key_tile() { return D <= 64 ? 64 : 32; }
template <int D> __host__ __device__ constexpr size_t smem_bytes() {
    return (size_t)query_tile<D>() * D * 2 + 2 * (2 * (size_t)key_tile<D>() * D * 2) + 2 * key_tile<D>();
}

template <typename T, int D, bool kPaged>
__global__ void __launch_bounds__(kThreads, 2) prefill_fwd(qk_attn_prefill_args a) {
    constexpr int kBN = key_tile<D>(), kMT = mtiles<D>(), kBM = query_tile<D>();
    constexpr int kChunks = D / 8;
    extern __shared__ __align__(128) unsigned char smem[];
    T *sq = reinterpret_cast<T *>(smem);                       // [kBM][D]
    T *sk = sq + kBM * D;                                      // [2][kBN][D]
    T *sv = sk + 2 * kBN * D;                                  // [2][kBN][D]
    uint8_t *kvalid = reinterpret_cast<uint8_t *>(sv + 2 * kBN * D);  // [2][kBN]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int h = blockIdx.y, G = (int)(a.Hq / a.Hkv), hk = h / G;

    const Seq s = prefill_seq<kBM, kThreads, D, kPaged>(a);
    if (s.b < 0) return;
    const int64_t b = s.b, q0 = s.tile * kBM;
    const int64_t offset = s.kv_len - s.q_len;  // key position of query 0
    const int64_t key_end = cta_key_end<kBM>(a, s, q0);
    const int ntiles = key_end > 0 ? (int)((key_end + kBN - 1) / kBN) : 0;

    const T *qbase = static_cast<const T *>(a.q) + (kPaged ? 0 : b * a.q_stride[0]) + h * a.q_stride[2];
    const T *kbase = static_cast<const T *>(a.k), *vbase = static_cast<const T *>(a.v);
    const int64_t kh = (kPaged ? 0 : b * a.k_stride[0]) + hk * a.k_stride[2];
    const int64_t vh = (kPaged ? 0 : b * a.v_stride[0]) + hk * a.v_stride[2];
    const uint8_t *mask = static_cast<const uint8_t *>(a.mask);

    // q tile (rows past q_len zero-filled).
    for (int e = tid; e < kBM * kChunks; e += kThreads) {
        const int r = e / kChunks, c = e % kChunks;
        const int64_t i = q0 + r;
        const bool ok = i < s.q_len;
        const T *src = ok ? qbase + (s.q_row0 + i) * a.q_stride[1] + c * 8 : qbase;
        cp_async16(sq + at<D>(r, c) * 8, src, ok);
    }
    // K and V of key tile kt into buffer kt & 1, with each key's kept flag (inside kv_len, key
    // mask, valid slot).
    // Paged: the pool rows of a tile's keys are staged in shared memory one tile ahead (thread r
    // loads key r's slot while the previous tile computes), so the copies never wait on an index
    // load; -1 marks a key that is skipped (past the end, masked, out-of-range slot).
    __shared__ int64_t sslot[2][kBN];
    auto key_row = [&](int kt, int r) { return qk_attn::key_row<kPaged>(a, s, key_end, (int64_t)kt * kBN + r); };
    auto load_kv = [&](int kt) {
        const int buf = kt & 1;
        T *dk = sk + buf * kBN * D, *dv = sv + buf * kBN * D;
        for (int e = tid; e < kBN * kChunks; e += kThreads) {
            const int r = e / kChunks, c = e % kChunks;
            const int64_t row = kPaged ? sslot[buf][r] : key_row(kt, r);
            const bool ok = row >= 0;
            cp_async16(dk + at<D>(r, c) * 8, ok ? kbase + row * a.k_stride[1] + kh + c * 8 : kbase, ok);
            cp_async16(dv + at<D>(r, c) * 8, ok ? vbase + row * a.v_stride[1] + vh + c * 8 : vbase, ok);
            if (c == 0) kvalid[buf * kBN + r] = ok;
        }
    };
    if (kPaged) {
        for (int r = tid; r < 2 * kBN; r += kThreads) sslot[r / kBN][r % kBN] = r / kBN < ntiles ? key_row(r / kBN, r % kBN) : -1;
        __syncthreads();
    }
    if (ntiles > 0) load_kv(0);
    cp_async_commit();

    // This warp's 16 * kMT query rows: m-tile mt holds rows r0 + 16 mt + g and + 8.
    const int r0 = warp * 16 * kMT;
    auto q_frag = [&](int mt, int kk, uint32_t (&f)[4]) {
        const int mi = lane >> 3;  // matrices: rows 0-7 | 8-15, chunk 2kk | 2kk+1
        ldsm_x4(f, sq + at<D>(r0 + 16 * mt + (lane & 7) + 8 * (mi & 1), 2 * kk + (mi >> 1)) * 8);
    };
    const float qscale = a.scale * 1.4426950408889634f;
    float m[kMT][2], l[kMT][2], o[kMT][D / 8][4];
    int64_t qi[kMT][2];  // this thread's query rows
#pragma unroll
    for (int mt = 0; mt < kMT; mt++) {
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.f;
        qi[mt][0] = q0 + r0 + 16 * mt + g;
        qi[mt][1] = qi[mt][0] + 8;
#pragma unroll
        for (int n = 0; n < D / 8; n++) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
    }

    for (int kt = 0; kt < ntiles; kt++) {
        cp_async_wait<0>();
        __syncthreads();  // tile kt (and q) landed; every warp is done with tile kt - 1
        if (kt + 1 < ntiles) load_kv(kt + 1);
        cp_async_commit();
        // Slots of tile kt + 2, into the buffer tile kt's slots held (read by load_kv(kt) one
        // iteration ago); stored after this tile's math so the load's latency hides behind it.
        int64_t next_slot = -1;
        if (kPaged && tid < kBN && kt + 2 < ntiles) next_slot = key_row(kt + 2, tid);
        const int buf = kt & 1;
        const T *tk = sk + buf * kBN * D, *tv = sv + buf * kBN * D;

        // S = q K^T: sc[mt][n] holds rows g, g+8 of m-tile mt x keys 8n + 2t4, +1 of the tile.
        float sc[kMT][kBN / 8][4];
#pragma unroll
        for (int mt = 0; mt < kMT; mt++)
#pragma unroll
            for (int n = 0; n < kBN / 8; n++) sc[mt][n][0] = sc[mt][n][1] = sc[mt][n][2] = sc[mt][n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t qa[kMT][4];
#pragma unroll
            for (int mt = 0; mt < kMT; mt++) q_frag(mt, kk, qa[mt]);
#pragma unroll
            for (int p = 0; p < kBN / 16; p++) {
                uint32_t kb[4];
                const int mi = lane >> 3;  // matrices: keys 16p + 0-7 | 8-15, chunk 2kk | 2kk+1
                ldsm_x4(kb, tk + at<D>(16 * p + (lane & 7) + 8 * (mi >> 1), 2 * kk + (mi & 1)) * 8);
#pragma unroll
                for (int mt = 0; mt < kMT; mt++) {
                    qk_mma16816<T>(sc[mt][2 * p], qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3], kb[0], kb[1]);
                    qk_mma16816<T>(sc[mt][2 * p + 1], qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3], kb[2], kb[3]);
                }
            }
        }
        // Masking, only where the tile may hold a dropped key (q0: the CTA's most restricted row).
        const int64_t j0 = (int64_t)kt * kBN;
        const bool full = !kPaged && a.mask_kind == 0 && j0 + kBN <= s.kv_len &&
                          (!a.causal || j0 + kBN - 1 <= q0 + offset);
#pragma unroll
        for (int mt = 0; mt < kMT; mt++) {
            float mx[2] = {m[mt][0], m[mt][1]};
#pragma unroll
            for (int n = 0; n < kBN / 8; n++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float v = sc[mt][n][e] * qscale;
                    if (!full) {
                        const int jj = 8 * n + 2 * t4 + (e & 1);
                        const int64_t j = j0 + jj, i = qi[mt][e >> 1];
                        bool keep = kvalid[buf * kBN + jj] && i < s.q_len;
                        if (a.causal) keep = keep && j <= i + offset;
                        if (keep && a.mask_kind == 2) {
                            // paged: past the mask's width or rows nothing is kept
                            keep = (a.mask_cols == 0 || j < a.mask_cols) && (a.mask_rows == 0 || i < a.mask_rows);
                            const int64_t mi = b * a.mask_stride[0] + h * a.mask_stride[1] + i * a.mask_stride[2] + j * a.mask_stride[3];
                            if (keep && a.mask_float) v += mask_bias_log2(a.mask, a.mask_dtype, mi);
                            else if (keep) keep = mask[mi] != 0;
                        }
                        if (!keep) v = -INFINITY;
                    }
                    sc[mt][n][e] = v;
                    mx[e >> 1] = fmaxf(mx[e >> 1], v);
                }
            }
            float alpha[2], ref[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                ref[r] = mx[r] == -INFINITY ? 0.f : mx[r];  // nothing kept yet: every p is 0
                alpha[r] = exp2f(m[mt][r] - ref[r]);
                m[mt][r] = mx[r];
                l[mt][r] *= alpha[r];
            }
#pragma unroll
            for (int n = 0; n < kBN / 8; n++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    sc[mt][n][e] = exp2f(sc[mt][n][e] - ref[e >> 1]);
                    l[mt][e >> 1] += sc[mt][n][e];
                }
            }
#pragma unroll
            for (int n = 0; n < D / 8; n++) {
                o[mt][n][0] *= alpha[0];
                o[mt][n][1] *= alpha[0];
                o[mt][n][2] *= alpha[1];
                o[mt][n][3] *= alpha[1];
            }
        }
        // O += P V, 16 keys per k-step; P's A fragment comes from two score n-tiles; each V
        // fragment serves every m-tile.
#pragma unroll
        for (int kk = 0; kk < kBN / 16; kk++) {
            uint32_t pa[kMT][4];
#pragma unroll
            for (int mt = 0; mt < kMT; mt++) {
                pa[mt][0] = pack2<T>(sc[mt][2 * kk][0], sc[mt][2 * kk][1]);
                pa[mt][1] = pack2<T>(sc[mt][2 * kk][2], sc[mt][2 * kk][3]);
                pa[mt][2] = pack2<T>(sc[mt][2 * kk + 1][0], sc[mt][2 * kk + 1][1]);
                pa[mt][3] = pack2<T>(sc[mt][2 * kk + 1][2], sc[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int n = 0; n < D / 8; n += 2) {
                uint32_t vb[4];
                const int mi = lane >> 3;  // matrices: keys 16kk + 0-7 | 8-15, chunk n | n+1 (transposed)
                ldsm_x4_trans(vb, tv + at<D>(16 * kk + (lane & 7) + 8 * (mi & 1), n + (mi >> 1)) * 8);
#pragma unroll
                for (int mt = 0; mt < kMT; mt++) {
                    qk_mma16816<T>(o[mt][n], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], vb[0], vb[1]);
                    qk_mma16816<T>(o[mt][n + 1], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], vb[2], vb[3]);
                }
            }
        }
        if (kPaged && tid < kBN && kt + 2 < ntiles) sslot[kt & 1][tid] = next_slot;
    }
    cp_async_wait<0>();

    // Normalise and write this thread's rows (a row with no kept key gives 0).
#pragma unroll
    for (int mt = 0; mt < kMT; mt++) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float lr = l[mt][r];
            lr += __shfl_xor_sync(0xffffffffu, lr, 1);
            lr += __shfl_xor_sync(0xffffffffu, lr, 2);
            const int64_t i = qi[mt][r];
            if (i >= s.q_len) continue;
            const float inv = lr > 0.f ? 1.f / lr : 0.f;
            T *out = static_cast<T *>(a.out) + (kPaged ? 0 : b * a.out_stride[0]) + (s.q_row0 + i) * a.out_stride[1] +
                     h * a.out_stride[2];
#pragma unroll
            for (int n = 0; n < D / 8; n++)
                *reinterpret_cast<uint32_t *>(out + 8 * n + 2 * t4) = pack2<T>(o[mt][n][2 * r] * inv, o[mt][n][2 * r + 1] * inv);
        }
    }
}

template <typename T, int D, bool kPaged>
int launch(const qk_attn_prefill_args *a, cudaStream_t s) {
    constexpr size_t smem = smem_bytes<D>();
    const int opt = qk_kernel_residency((const void *)prefill_fwd<T, D, kPaged>, kThreads, smem, nullptr);
    if (opt) return opt;
    dim3 grid;
    if (kPaged) {
        constexpr int kBM = query_tile<D>();
        const int64_t tiles = (a->total_q + kBM - 1) / kBM + a->B;  // any split into B requests fits
        if (tiles > 0x7fffffff) return QK_E_UNSUPPORTED;
        grid = dim3((unsigned)tiles, (unsigned)a->Hq, 1);
    } else {
        grid = dim3((unsigned)((a->Lq + query_tile<D>() - 1) / query_tile<D>()), (unsigned)a->Hq, (unsigned)a->B);
    }
    qk_attn_prefill_args p = *a;
    void *args[] = {&p};
    return qk_launch((const void *)prefill_fwd<T, D, kPaged>, grid, dim3(kThreads), smem, s, args);
}

template <typename T, bool kPaged> int pick_dim(const qk_attn_prefill_args *a, cudaStream_t s) {
    switch (a->D) {
    case 32: return launch<T, 32, kPaged>(a, s);
    case 64: return launch<T, 64, kPaged>(a, s);
    case 128: return launch<T, 128, kPaged>(a, s);
    case 256: return launch<T, 256, kPaged>(a, s);
    default: return QK_E_UNSUPPORTED;
    }
}

}  // namespace

extern "C" int qk_attn_prefill_sm90(const qk_attn_prefill_args *a, cudaStream_t s);  // attn_prefill_sm90.cu

extern "C" int qk_attn_prefill_cuda(const qk_attn_prefill_args *a, void *stream) {
    const int64_t nq = a->paged ? a->total_q : a->B * a->Lq;
    if (nq == 0 || a->Hq == 0) return QK_OK;
    if (a->Hkv <= 0 || a->Hq % a->Hkv || a->Hq > 65535 || (!a->paged && a->B > 65535)) return QK_E_UNSUPPORTED;
    // 16-byte rows everywhere (the binding keeps the last dim unit-stride).
    const int64_t qs[3] = {a->paged ? 0 : a->q_stride[0], a->q_stride[1], a->q_stride[2]};
    const int64_t os[3] = {a->paged ? 0 : a->out_stride[0], a->out_stride[1], a->out_stride[2]};
    const int64_t ks[3] = {a->paged ? 0 : a->k_stride[0], a->k_stride[1], a->k_stride[2]};
    const int64_t vs[3] = {a->paged ? 0 : a->v_stride[0], a->v_stride[1], a->v_stride[2]};
    if (!aligned_rows(a->q, qs, 3) || !aligned_rows(a->out, os, 3) || !aligned_rows(a->k, ks, 3) || !aligned_rows(a->v, vs, 3))
        return QK_E_UNSUPPORTED;
    cudaStream_t s = (cudaStream_t)stream;
    const int hopper = qk_attn_prefill_sm90(a, s);  // wgmma kernel where built and on sm_90
    if (hopper != QK_E_UNSUPPORTED) return hopper;
    switch (a->dtype) {
    case QK_BF16: return a->paged ? pick_dim<__nv_bfloat16, true>(a, s) : pick_dim<__nv_bfloat16, false>(a, s);
    case QK_F16: return a->paged ? pick_dim<__half, true>(a, s) : pick_dim<__half, false>(a, s);
    default: return QK_E_UNSUPPORTED;
    }
}
