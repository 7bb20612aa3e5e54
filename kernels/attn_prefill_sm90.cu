// attn_prefill / attn_paged_prefill on Hopper: the same function as attn_prefill.cu, with
// the two matrix products on the warpgroup tensor cores (wgmma, sm_90a), for D = 64, 128, 256.
//
// Work: one CTA per (tile of kBM = 128 queries, query head, sequence); two warpgroups of 4 warps,
// each owning 64 query rows (one m64 wgmma row block).  K and V stream through shared memory in
// kBN-key tiles (128 keys for D <= 128, 64 for D = 256), each in its own two-buffer ring filled by
// cp.async from all threads (which also gathers the pool rows of the paged op), laid out in the
// 128-byte swizzle the wgmma descriptors read: a [rows][D] tile is D/64 column blocks of
// [rows][64] elements, 16-byte chunk c of row r stored at chunk c ^ (r & 7).
//
// Per warpgroup and key tile j (FlashAttention-3's intra-warpgroup overlap): issue S_j = Q K_j^T
// and O += P_{j-1} V_{j-1} together, wait for S_j only, run the masked online softmax on S_j in
// place while the P V product is still on the tensor cores, then wait for it, rescale O and
// round P_j into the A fragments (only then: the in-flight product reads P_{j-1} from them).  K_{j+1}
// and V_j are copied during iteration j, so every copy has a whole iteration to land.  The two
// warpgroups of a CTA keep each other's tensor cores busy while one of them is in its softmax.
//
// Dense calls without a mask take prefill_ws below instead: the same math with the copies on
// the tensor memory accelerator and a producer warp (the cp.async kernel stays for the paged op,
// key masks, and layouts a tensor map cannot describe).
//
// Bytes and flops: 4 * Lq * Lkv * D flops per head (half for causal); K and V read once per
// 128-query tile.  Causal skipping and masking as in attn_prefill.cu.  docs/attention.md
// has where it stands against SDPA and cuDNN.
#include "attn_prefill.cuh"
#include "sm90.cuh"
#include "wgmma.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <math.h>

#if defined(QK_SM90A)
namespace {
using namespace qk_attn;
using namespace qk_sm90;

constexpr int kWG = 2, kThreads = 128 * kWG, kBM = 64 * kWG;

// Key tile: 128 keys for D = 128; 64 for D = 256 (registers) and for D = 64, whose smaller
// registers and shared memory then fit two CTAs per SM (the softmax, the same work per score at
// every D, is a larger share there and wants the other CTA's tensor-core work beside it).
template <int D> __host__ __device__ constexpr int key_tile() { return D == 128 ? 128 : 64; }
template <int D> __host__ __device__ constexpr int ctas_per_sm() { return D == 64 ? 2 : 1; }
// Q [kBM][D], K [2][kBN][D], V [2][kBN][D]; +1024 so the tiles can start on a 1024-byte boundary
// (the swizzle pattern repeats every 8 rows of 128 bytes, and the hardware applies it to
// absolute shared addresses).
template <int D> constexpr size_t smem_bytes() {
    return 1024 + 2 * ((size_t)kBM * D + 4 * (size_t)key_tile<D>() * D);
}

// Device helpers, compiled only where the kernels' bodies are (sm_90a).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// 2^x on the special-function unit, flushing denormal results to 0 (exp2f adds range handling
// the scores never need: x <= 0 here).
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// ---- the per-tile steps both sm_90 kernels share ---------------------------------------------
// A thread's share of its warpgroup's 64 query rows: rows g and g + 8 of its warp's 16; the
// accumulators hold, per 8-column block n, (row g: cols 8n + 2 t4, +1; row g + 8: the same).

// S = Q K^T for one key tile (k_tile: a [kBN][D] stage; q_rows: the warpgroup's 64 rows of Q).
// Descriptors are advanced by adding (byte offset >> 4) to the address field: k-step kk is
// column block kk / 4, 32 bytes in per step.
template <typename T, int D, int kBN>
__device__ __forceinline__ void issue_qk(float (&sc)[kBN / 2], uint32_t q_rows, uint32_t k_tile) {
    const uint64_t dq = make_desc(q_rows, 16, 1024), kd = make_desc(k_tile, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
        qk_wgmma::SS<T, kBN>::template mma<0, 0>(sc, dq + (((kk >> 2) * kBM * 128 + (kk & 3) * 32) >> 4),
                                                 kd + (((kk >> 2) * kBN * 128 + (kk & 3) * 32) >> 4), kk > 0);
}

// O += P V for one key tile (v_tile: a [kBN][D] stage, MN-major: 16 keys = 2048 bytes per step,
// column blocks kBN * 128 bytes apart).
template <typename T, int D, int kBN>
__device__ __forceinline__ void issue_pv(float (&o)[D / 2], const uint32_t (&frag)[kBN / 16][4], uint32_t v_tile) {
    const uint64_t vd = make_desc(v_tile, kBN * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < kBN / 16; kk++) qk_wgmma::RS<T, D>::template mma<1>(o, frag[kk], vd + ((kk * 16 * 128) >> 4), 1);
}

// The thread's keys of a key tile, in the order of its scores (k = 2 n + e: key 8 n + 2 t4 + e), as
// bits of a mask: kBN / 4 bits.  From one byte per key (0: dropped) ...
template <int kBN> __device__ __forceinline__ uint32_t kv_bits_from_bytes(const uint8_t *kv, int t4) {
    uint32_t m = 0;
#pragma unroll
    for (int n = 0; n < kBN / 8; n++) {
        const uint32_t two = *reinterpret_cast<const uint16_t *>(kv + 8 * n + 2 * t4);
        m |= ((two & 0xffu) != 0 ? 1u : 0u) << (2 * n);
        m |= ((two >> 8) != 0 ? 1u : 0u) << (2 * n + 1);
    }
    return m;
}
// ... or from a bit per key (word w: keys 32 w .. 32 w + 31): the thread's bits of word w sit at
// 8 i + 2 t4 + {0, 1}, i < 4.
template <int kBN> __device__ __forceinline__ uint32_t kv_bits_from_words(const uint32_t *words, int t4) {
    uint32_t m = 0;
#pragma unroll
    for (int w = 0; w < kBN / 32; w++) {
        const uint32_t x = words[w] >> (2 * t4);
        m |= ((x & 0x3u) | ((x >> 6) & 0xcu) | ((x >> 12) & 0x30u) | ((x >> 18) & 0xc0u)) << (8 * w);
    }
    return m;
}

// Masked online softmax of one key tile (keys j0 ..) for the thread's rows qi.  Unless full, row
// r keeps the keys jj <= its limit (inside key_end, causal) that, when use_kv, kv_bits() (the
// thread's keys as a mask, above; called only then) keeps: 32-bit compares and a bit test, so the
// code stays small (a byte read and a branch per score bloat the hot loop).  The row maxima m are
// kept on the raw scores and the scale folded into one FMA per score before the exp2 (scale > 0,
// checked by the launcher).  Leaves the probabilities in sc (fp32) and the rescale factor of the
// rows' earlier output in alpha.  Touches only sc, m and l, so it runs while the previous P V
// product is on the tensor cores.
template <int kBN, bool kBranch, typename KvBits>
__device__ __forceinline__ void tile_softmax(float (&sc)[kBN / 2], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                             float qscale, bool full, const int64_t (&qi)[2], int64_t j0,
                                             int64_t key_end, bool causal, int64_t offset, int64_t q_len,
                                             bool use_kv, KvBits kv_bits, int t4) {
    int lim[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int64_t last = key_end - 1 - j0;
        if (causal) last = min(last, qi[r] + offset - j0);
        if (qi[r] >= q_len) last = -1;
        lim[r] = (int)max((int64_t)-1, min(last, (int64_t)kBN - 1));
    }
    const uint32_t kv = !full && use_kv ? kv_bits() : ~0u;
    float mx[2] = {m[0], m[1]};
    // kBranch: two loops, not one with the mask predicated, which is issued on every tile (2
    // instructions per score dense, 4 paged) where most tiles are full.  (Not in prefill_wgmma:
    // there it spilled at D = 64.)
    if (kBranch && full) {
#pragma unroll
        for (int i = 0; i < kBN / 2; i++) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], sc[i]);
    } else {
#pragma unroll
        for (int n = 0; n < kBN / 8; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float v = sc[4 * n + e];
                if (!full) {
                    const int jj = 8 * n + 2 * t4 + (e & 1);
                    if (jj > lim[e >> 1] || (use_kv && !((kv >> (2 * n + (e & 1))) & 1u))) v = -INFINITY;
                }
                sc[4 * n + e] = v;
                mx[e >> 1] = fmaxf(mx[e >> 1], v);
            }
        }
    }
    float ref[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        ref[r] = mx[r] == -INFINITY ? 0.f : mx[r] * qscale;  // nothing kept yet: every p is 0
        alpha[r] = ex2(m[r] * qscale - ref[r]);
        m[r] = mx[r];
        l[r] *= alpha[r];
    }
#pragma unroll
    for (int i = 0; i < kBN / 2; i++) {
        sc[i] = ex2(fmaf(sc[i], qscale, -ref[(i >> 1) & 1]));
        l[(i >> 1) & 1] += sc[i];
    }
}

// Scale the thread's output rows by the softmax's rescale factors (rows g and g + 8: alpha[0], [1]).
template <int D> __device__ __forceinline__ void rescale_o(float (&o)[D / 2], const float (&alpha)[2]) {
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
        o[4 * n + 0] *= alpha[0];
        o[4 * n + 1] *= alpha[0];
        o[4 * n + 2] *= alpha[1];
        o[4 * n + 3] *= alpha[1];
    }
}

// P (rounded to T) as the A fragments of the P V product: keys 16 kk .. +15 are (row g, keys
// 2 t4, +1), (row g + 8, same), (row g, keys 8 + 2 t4, +1), (row g + 8, same).
template <typename T, int kBN>
__device__ __forceinline__ void pack_p(uint32_t (&p)[kBN / 16][4], const float (&sc)[kBN / 2]) {
#pragma unroll
    for (int kk = 0; kk < kBN / 16; kk++)
#pragma unroll
        for (int i = 0; i < 4; i++) p[kk][i] = pack2<T>(sc[8 * kk + 2 * i], sc[8 * kk + 2 * i + 1]);
}

// Normalise and write the thread's rows of O (a row with no kept key gives 0); rows: the output
// at query row 0 of the sequence and this head, row_stride apart.
template <typename T, int D>
__device__ __forceinline__ void write_rows(const float (&o)[D / 2], const float (&l)[2], const int64_t (&qi)[2],
                                           int64_t q_len, T *rows, int64_t row_stride, int t4) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float lr = l[r];
        lr += __shfl_xor_sync(0xffffffffu, lr, 1);
        lr += __shfl_xor_sync(0xffffffffu, lr, 2);
        const int64_t i = qi[r];
        if (i >= q_len) continue;
        const float inv = lr > 0.f ? 1.f / lr : 0.f;
        T *out = rows + i * row_stride;
#pragma unroll
        for (int n = 0; n < D / 8; n++)
            *reinterpret_cast<uint32_t *>(out + 8 * n + 2 * t4) = pack2<T>(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
    }
}
#endif

template <typename T, int D, bool kPaged>
__global__ void __launch_bounds__(kThreads, ctas_per_sm<D>()) prefill_wgmma(qk_attn_prefill_args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int kBN = key_tile<D>(), kChunks = D / 8;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
    const uint32_t sq = (raw + 1023) & ~1023u;                 // [kBM][D]
    const uint32_t sk = sq + kBM * D * 2;                      // [2][kBN][D]
    const uint32_t sv = sk + 2 * kBN * D * 2;                  // [2][kBN][D]
    __shared__ __align__(16) uint8_t kvalid[2][kBN];
    __shared__ int64_t sslot[3][kBN];
    __shared__ uint8_t sall[3][kBN / 32];  // paged: every key of a 32-key group of the tile kept
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // Warp-uniform to the compiler (a shuffle from lane 0), so the wgmma descriptors built from it
    // live in uniform registers: a descriptor computed in ordinary registers between two wgmma
    // makes ptxas serialise them (warning C7513).
    const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0);
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

    // Row of K/V holding key r of tile kt, or -1 when the key is skipped (past the end, key mask,
    // out-of-range pool slot).
    auto key_row = [&](int kt, int r) { return qk_attn::key_row<kPaged>(a, s, key_end, (int64_t)kt * kBN + r); };
    // Paged: a tile's pool rows are staged in sslot[kt % 3] one iteration before its copies, so
    // the copies never wait on an index load.  kvalid: the kept flags of the keys of K tiles
    // whose copies were predicated (read by the softmax only for such tiles).
    // Copies: thread tid always moves 16-byte chunk lc of rows lr, lr + kRP, ... of a tile, so its
    // shared offsets are fixed (r & 7 does not change) and a whole tile inside the keys is kRP-row
    // strides off one pointer, with no per-chunk index math or predicates.
    constexpr int kRP = kThreads / kChunks;
    const int lc = tid % kChunks, lr = tid / kChunks;
    auto load_tile = [&](uint32_t dst, const T *base, int64_t stride, int kt, bool is_k) {
        dst += (lc >> 3) * kBN * 128 + lr * 128 + (((lc & 7) ^ (lr & 7)) << 4);
        base += lc * 8;
        const int64_t j0 = (int64_t)kt * kBN;
        if (!kPaged && a.mask_kind != 1 && j0 + kBN <= key_end) {
            const T *src = base + (j0 + lr) * stride;
#pragma unroll
            for (int i = 0; i < kBN / kRP; i++) cp_async16(dst + i * kRP * 128, src + i * kRP * stride, true);
        } else if (kPaged) {
#pragma unroll
            for (int i = 0; i < kBN / kRP; i++) {
                const int r = lr + i * kRP;
                const int64_t row = sslot[kt % 3][r];
                cp_async16(dst + i * kRP * 128, row >= 0 ? base + row * stride : base, row >= 0);
                if (is_k && lc == 0) kvalid[kt & 1][r] = row >= 0;
            }
        } else {  // the last tile, or a key mask: rare, so kept small
#pragma unroll 1
            for (int i = 0; i < kBN / kRP; i++) {
                const int r = lr + i * kRP;
                const int64_t row = key_row(kt, r);
                cp_async16(dst + i * kRP * 128, row >= 0 ? base + row * stride : base, row >= 0);
                if (is_k && lc == 0) kvalid[kt & 1][r] = row >= 0;
            }
        }
    };
    auto load_k = [&](int kt) { load_tile(sk + (kt & 1) * kBN * D * 2, kbase + kh, a.k_stride[1], kt, true); };
    auto load_v = [&](int kt) { load_tile(sv + (kt & 1) * kBN * D * 2, vbase + vh, a.v_stride[1], kt, false); };

    // Prologue: q and K_0 (group 1), then K_1 and V_0 (group 2).
    {
        const uint32_t dst = sq + (lc >> 3) * kBM * 128 + lr * 128 + (((lc & 7) ^ (lr & 7)) << 4);
        const T *src = qbase + lc * 8 + (s.q_row0 + q0 + lr) * a.q_stride[1];
#pragma unroll
        for (int i = 0; i < kBM / kRP; i++) {
            const bool ok = q0 + lr + i * kRP < s.q_len;
            cp_async16(dst + i * kRP * 128, ok ? src + i * kRP * a.q_stride[1] : qbase, ok);
        }
    }
    if (kPaged) {
        for (int r = tid; r < 3 * kBN; r += kThreads) {  // whole warps: 3 kBN is a multiple of 32
            const int64_t row = r / kBN < ntiles ? key_row(r / kBN, r % kBN) : -1;
            sslot[r / kBN][r % kBN] = row;
            const bool all = __all_sync(0xffffffffu, row >= 0);
            if (lane == 0) sall[r / kBN][(r % kBN) / 32] = all;
        }
        __syncthreads();
    }
    if (ntiles > 0) load_k(0);
    cp_async_commit();
    if (ntiles > 1) load_k(1);
    if (ntiles > 0) load_v(0);
    cp_async_commit();

    // This thread's rows: warp w of warpgroup wg holds rows 64 wg + 16 (w % 4) + g and + 8; the
    // accumulators hold, per 8-column block n, (row g: cols 8n + 2 t4, +1; row g + 8: the same).
    const int64_t qi[2] = {q0 + 64 * wg + 16 * (warp & 3) + g, q0 + 64 * wg + 16 * (warp & 3) + g + 8};
    const float qscale = a.scale * 1.4426950408889634f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float o[D / 2], sc[kBN / 2];
    uint32_t p[kBN / 16][4];
#pragma unroll
    for (int i = 0; i < D / 2; i++) o[i] = 0.f;

    const uint32_t q_rows = sq + wg * 64 * 128;  // this warpgroup's 64 rows of every column block
    auto issue_s = [&](int kt) { issue_qk<T, D, kBN>(sc, q_rows, sk + (kt & 1) * kBN * D * 2); };
    auto issue_v = [&](int kt, const uint32_t (&frag)[kBN / 16][4]) { issue_pv<T, D, kBN>(o, frag, sv + (kt & 1) * kBN * D * 2); };
    auto softmax = [&](int kt, float (&alpha)[2]) {
        const int64_t j0 = (int64_t)kt * kBN;
        bool kept = a.mask_kind == 0;  // every key of the tile has K/V (paged: a valid slot)
        if (kPaged) {
#pragma unroll
            for (int w = 0; w < kBN / 32; w++) kept = kept && sall[kt % 3][w];
        }
        const bool full = kept && j0 + kBN <= key_end && (!a.causal || j0 + kBN - 1 <= q0 + 64 * wg + offset);
        const bool use_kvalid = kPaged || a.mask_kind == 1;  // kvalid: paged slots, key mask
        tile_softmax<kBN, false>(sc, m, l, alpha, qscale, full, qi, j0, key_end, a.causal, offset, s.q_len, use_kvalid,
                          [&] { return kv_bits_from_bytes<kBN>(kvalid[kt & 1], t4); }, t4);
    };

    if (ntiles > 0) {
        cp_async_wait<1>();  // q and K_0
        fence_async_smem();
        __syncthreads();
        pin(sc);
        wg_fence();
        issue_s(0);
        wg_commit();
        wg_wait<0>();
        pin(sc);
        float alpha[2];
        softmax(0, alpha);
        pack_p<T, kBN>(p, sc);
    }
    for (int kt = 1; kt < ntiles; kt++) {
        cp_async_wait<0>();  // K_kt and V_{kt-1}
        fence_async_smem();
        __syncthreads();     // ... for every thread; every warpgroup is done with K_{kt-1} and V_{kt-2}
        // Paged: the pool rows of tile kt + 2, loaded now and stored at the end of the iteration
        // (into the entry tile kt - 1 used), so the load's latency hides behind this tile's math.
        int64_t next_slot = -1;
        if (kPaged && tid < kBN && kt + 2 < ntiles) next_slot = key_row(kt + 2, tid);
        if (kt + 1 < ntiles) load_k(kt + 1);
        load_v(kt);
        cp_async_commit();
        pin(sc);
        pin(o);
        pin(p);  // every operand final before the fence
        wg_fence();
        issue_s(kt);
        wg_commit();
        issue_v(kt - 1, p);
        wg_commit();
        wg_wait<1>();  // S_kt; the P V product may still run
        pin(sc);
        float alpha[2];
        softmax(kt, alpha);
        wg_wait<0>();
        pin(o);
        pin(p);
        rescale_o<D>(o, alpha);
        pack_p<T, kBN>(p, sc);
        if (kPaged && tid < kBN) {
            sslot[(kt + 2) % 3][tid] = next_slot;
            const bool all = __all_sync(0xffffffffu, next_slot >= 0);
            if (lane == 0) sall[(kt + 2) % 3][tid / 32] = all;
        }
    }
    if (ntiles > 0) {
        cp_async_wait<0>();  // V_last
        fence_async_smem();
        __syncthreads();
        pin(o);
        pin(p);
        wg_fence();
        issue_v(ntiles - 1, p);
        wg_commit();
        wg_wait<0>();
        pin(o);
        pin(p);
    }
    cp_async_wait<0>();

    write_rows<T, D>(o, l, qi, s.q_len,
                     static_cast<T *>(a.out) + (kPaged ? 0 : b * a.out_stride[0]) + s.q_row0 * a.out_stride[1] + h * a.out_stride[2],
                     a.out_stride[1], t4);
#endif
}

// ---- dense, warp-specialised: a TMA producer warp and two consumer warpgroups -----------------
//
// The same per-tile math as prefill_wgmma, for dense K/V without a mask.  Warpgroup 0's first
// thread loads Q, K and V with the bulk tensor copy engine (TMA, 128-byte swizzle: the layout the
// descriptors read) into two-stage K and V rings; each stage has a 'full' mbarrier (the copy's
// bytes landed) and an 'empty' one (all eight consumer warps are done with it), so no CTA-wide
// barrier paces the consumers and the two warpgroups drift apart, one's softmax beside the other's
// matrix products.  Registers move from the producer (40) to the consumers (232) by setmaxnreg.
constexpr int kWsThreads = 384;

template <int D> __host__ __device__ constexpr int ws_key_tile() { return D <= 128 ? 128 : 64; }
template <int D> constexpr size_t ws_smem_bytes() {
    return 1024 + 2 * ((size_t)kBM * D + 4 * (size_t)ws_key_tile<D>() * D);
}


// Ping-pong between the two consumer warpgroups (FA3): each issues its matrix products only in
// its turn, so they reach the tensor cores alternately and one warpgroup's softmax runs under
// the other's products.  Named barrier 1 + w is warpgroup w's turn: it completes when w's 128
// threads sync on it and the other warpgroup's 128 arrive.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void turn_wait(int wg) { asm volatile("bar.sync %0, 256;\n" ::"r"(1 + wg) : "memory"); }
__device__ __forceinline__ void turn_pass(int wg) { asm volatile("bar.arrive %0, 256;\n" ::"r"(2 - wg) : "memory"); }
#endif

// Where the row, head and batch coordinates go among a tensor map's dims 1..3 (the dims are
// ordered by stride; see make_map).
struct WsCoords {
    int row, head, batch;
};
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void tma_box(uint32_t dst, const CUtensorMap *tm, const WsCoords &pos, int col, int row, int head,
                                        int batch, uint32_t bar) {
    int c[4] = {col, 0, 0, 0};
    c[pos.row] = row;
    c[pos.head] = head;
    c[pos.batch] = batch;
    tma_load(dst, tm, c[0], c[1], c[2], c[3], bar);
}
#endif

template <typename T, int D, bool kPaged>
__global__ void __launch_bounds__(kWsThreads, 1)
    prefill_ws(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
               const __grid_constant__ CUtensorMap tv, WsCoords qpos, WsCoords kpos, WsCoords vpos, qk_attn_prefill_args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int kBN = ws_key_tile<D>();
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) uint64_t bars[9];  // q_full, k_full[2], k_empty[2], v_full[2], v_empty[2]
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
    const uint32_t sq = (raw + 1023) & ~1023u;  // [D/64][kBM][64]
    const uint32_t sk = sq + kBM * D * 2;       // [2][D/64][kBN][64]
    const uint32_t sv = sk + 2 * kBN * D * 2;   // [2][D/64][kBN][64]
    const uint32_t bar0 = (uint32_t)__cvta_generic_to_shared(bars);
    const uint32_t q_full = bar0;
    auto k_full = [&](int st) { return bar0 + 8 * (1 + st); };
    auto k_empty = [&](int st) { return bar0 + 8 * (3 + st); };
    auto v_full = [&](int st) { return bar0 + 8 * (5 + st); };
    auto v_empty = [&](int st) { return bar0 + 8 * (7 + st); };
    __shared__ __align__(16) uint32_t kbits[2][4];  // paged: bit i of word w: key 32 w + i of a K stage has a valid slot
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int role = __shfl_sync(0xffffffffu, warp >> 2, 0);  // 0: producer; 1, 2: consumers

    const int h = blockIdx.y, G = (int)(a.Hq / a.Hkv), hk = h / G;
    const Seq s = prefill_seq<kBM, kWsThreads, D, kPaged>(a);
    if (s.b < 0) return;
    const int b = (int)s.b;
    const int64_t q0 = s.tile * kBM;
    const int64_t offset = s.kv_len - s.q_len;
    const int64_t key_end = cta_key_end<kBM>(a, s, q0);
    const int ntiles = key_end > 0 ? (int)((key_end + kBN - 1) / kBN) : 0;

    if (tid == 0) {
        mbar_init(q_full, 1);
        for (int st = 0; st < 2; st++) {
            // Paged stages complete on the 128 producer threads' cp.async arrivals; a K stage also
            // on one plain arrival per producer warp, which releases its kbits store.
            mbar_init(k_full(st), kPaged ? 128 + 4 : 1);
            mbar_init(v_full(st), kPaged ? 128 : 1);
            mbar_init(k_empty(st), 8);  // the consumer warps
            mbar_init(v_empty(st), 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    constexpr uint32_t kTileBytes = kBN * D * 2;
    if (role == 0) {
        if constexpr (kPaged) {
            asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");
            if (tid == 0 && ntiles > 0) {  // as below: no copy the consumers will not wait for
                mbar_expect_tx(q_full, kBM * D * 2);
                for (int c = 0; c < D / 64; c++)
                    tma_box(sq + c * kBM * 128, &tq, qpos, 64 * c, (int)(s.q_row0 + q0), h, 0, q_full);
            }
            // The pool rows are gathered with cp.async by all 128 producer threads: thread t
            // always copies chunk lc of rows lr, lr + kRP, ...; each thread's copies complete on
            // the stage's mbarrier, so the producer runs up to two tiles ahead.  The pool row of
            // key kt * kBN + t is looked up by thread t one tile ahead (its load in flight while
            // tile kt is copied) and shared through rows_s: looked up per copy, the dependent
            // index loads would pace the producer.
            static_assert(kBN <= 128, "one key per producer thread");
            constexpr int kChunks = D / 8, kRP = 128 / kChunks, kRows = kBN / kRP;  // kRows rows per thread
            static_assert(kRows % 4 == 0 && (kRP & (kRP - 1)) == 0, "rows read as int4; kRP a power of two");
            // A stage's pool rows (-1: key skipped), transposed so that thread lr's kRows rows sit
            // together (key r at (r % kRP) * kRows + r / kRP): kRows / 4 16-byte reads.  Rows < 2^31.
            __shared__ __align__(16) int32_t rows_s[2][kBN];
            const int lc = tid % kChunks, lr = tid / kChunks;
            const char *kbase = reinterpret_cast<const char *>(static_cast<const T *>(a.k) + hk * a.k_stride[2] + lc * 8);
            const char *vbase = reinterpret_cast<const char *>(static_cast<const T *>(a.v) + hk * a.v_stride[2] + lc * 8);
            // Row strides in bytes, < 2^32 (the launcher checks): a copy's source is one 32 x 32 ->
            // 64-bit multiply-add, which keeps the producer's instructions per copy (and its 56
            // registers) few.
            const uint32_t kstride = (uint32_t)(a.k_stride[1] * (int64_t)sizeof(T));
            const uint32_t vstride = (uint32_t)(a.v_stride[1] * (int64_t)sizeof(T));
            // Shared offset of this thread's chunk of row lr; row lr + i kRP lies i kRP 128 bytes on
            // with its swizzle XORed by (i kRP) & 7 (adding a power of two kRP mod 8 is an XOR when
            // lr < kRP), so every copy's destination is one register plus a constant.
            const uint32_t doff = (lc >> 3) * kBN * 128 + lr * 128 + (((lc & 7) ^ (lr & 7)) << 4);
            int64_t entry = -1;  // the next tile's req_to_token entry for this thread's key, unchecked
            auto fetch = [&](int kt) {
                entry = tid < kBN && kt < ntiles ? key_entry<true>(a, s, key_end, (int64_t)kt * kBN + tid) : -1;
            };
            // This thread's rows of the tile, read once for K and V; a 256-byte L2 fetch per
            // copy (one row of D = 128 per fetch).  A skipped key's copy reads nothing (source
            // size 0: zeros) from the head's first row, a valid address.
            int32_t rr[kRows];
            auto gather = [&](uint32_t dst, const char *base, uint32_t stride) {
#pragma unroll
                for (int i = 0; i < kRows; i++) {
                    const bool ok = rr[i] >= 0;
                    const char *src = base + (uint64_t)(uint32_t)(ok ? rr[i] : 0) * stride;
                    const uint32_t d = dst + (doff ^ (((i * kRP) & 7) << 4)) + i * kRP * 128;
                    cp_async16(d, src, ok);
                }
            };
            fetch(0);
            for (int kt = 0; kt < ntiles; kt++) {
                const int st = kt & 1, ph = (kt >> 1) & 1;
                const int32_t row = (int32_t)slot_in_pool(a, entry);  // pool rows < 2^31 (the launcher checks)
                fetch(kt + 1);
                // rows_s[st] was last read in tile kt - 2, before every producer thread passed
                // this barrier in tile kt - 1.
                if (tid < kBN) rows_s[st][(tid % kRP) * kRows + tid / kRP] = row;
                asm volatile("bar.sync 3, 128;\n" ::: "memory");
                if (kt >= 2) mbar_wait(k_empty(st), ph ^ 1);
                const uint32_t valid = __ballot_sync(0xffffffffu, tid < kBN && row >= 0);
                if (lane == 0 && warp < kBN / 32) kbits[st][warp] = valid;
                const int4 *mine = reinterpret_cast<const int4 *>(&rows_s[st][lr * kRows]);
#pragma unroll
                for (int q = 0; q < kRows / 4; q++) {
                    const int4 v4 = mine[q];
                    rr[4 * q] = v4.x;
                    rr[4 * q + 1] = v4.y;
                    rr[4 * q + 2] = v4.z;
                    rr[4 * q + 3] = v4.w;
                }
                gather(sk + st * kTileBytes, kbase, kstride);
                asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(k_full(st)) : "memory");
                if (lane == 0) mbar_arrive(k_full(st));  // releases its kbits store
                if (kt >= 2) mbar_wait(v_empty(st), ph ^ 1);
                gather(sv + st * kTileBytes, vbase, vstride);
                asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(v_full(st)) : "memory");
            }
            asm volatile("cp.async.wait_all;\n" ::: "memory");  // leave no copy in flight at exit
            return;
        }
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        // No key tile (no keys, or all above the causal diagonal): the consumers write zeros and
        // wait for nothing, so nothing is copied (a copy in flight must not outlive the CTA).
        if (tid != 0 || ntiles == 0) return;
        mbar_expect_tx(q_full, kBM * D * 2);
        for (int c = 0; c < D / 64; c++) tma_box(sq + c * kBM * 128, &tq, qpos, 64 * c, (int)q0, h, b, q_full);
        for (int kt = 0; kt < ntiles; kt++) {
            const int st = kt & 1, ph = (kt >> 1) & 1;
            if (kt >= 2) mbar_wait(k_empty(st), ph ^ 1);  // tile kt - 2 released by every consumer warp
            mbar_expect_tx(k_full(st), kTileBytes);
            for (int c = 0; c < D / 64; c++)
                tma_box(sk + st * kTileBytes + c * kBN * 128, &tk, kpos, 64 * c, kt * kBN, hk, b, k_full(st));
            if (kt >= 2) mbar_wait(v_empty(st), ph ^ 1);
            mbar_expect_tx(v_full(st), kTileBytes);
            for (int c = 0; c < D / 64; c++)
                tma_box(sv + st * kTileBytes + c * kBN * 128, &tv, vpos, 64 * c, kt * kBN, hk, b, v_full(st));
        }
        return;
    }
    if constexpr (kPaged) {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n" ::: "memory");
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    }
    const int wg = role - 1;
    const int g = lane >> 2, t4 = lane & 3;
    const int64_t qi[2] = {q0 + 64 * wg + 16 * (warp & 3) + g, q0 + 64 * wg + 16 * (warp & 3) + g + 8};
    const float qscale = a.scale * 1.4426950408889634f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float o[D / 2], sc[kBN / 2];
    uint32_t p[kBN / 16][4];
#pragma unroll
    for (int i = 0; i < D / 2; i++) o[i] = 0.f;

    const uint32_t q_rows = sq + wg * 64 * 128;
    auto issue_s = [&](int kt) { issue_qk<T, D, kBN>(sc, q_rows, sk + (kt & 1) * kBN * D * 2); };
    auto issue_v = [&](int kt) { issue_pv<T, D, kBN>(o, p, sv + (kt & 1) * kBN * D * 2); };
    // Paged keys without a valid slot (or masked) are dropped through kbits; a tile whose keys
    // all have one takes the unmasked path.
    auto softmax = [&](int kt, float (&alpha)[2]) {
        const int64_t j0 = (int64_t)kt * kBN;
        // The tile's key bits in one 16-byte read (kBN = 128; 8 for 64): a flag per key would be
        // 8 reads of 16 bytes per thread and tile on top of the wgmma operand reads.
        uint32_t kw[4] = {~0u, ~0u, ~0u, ~0u};
        bool kept = true;
        if constexpr (kPaged) {
            if constexpr (kBN == 128) {
                const uint4 v = *reinterpret_cast<const uint4 *>(kbits[kt & 1]);
                kw[0] = v.x, kw[1] = v.y, kw[2] = v.z, kw[3] = v.w;
            } else {
                const uint2 v = *reinterpret_cast<const uint2 *>(kbits[kt & 1]);
                kw[0] = v.x, kw[1] = v.y;
            }
            kept = (kw[0] & kw[1] & kw[2] & kw[3]) == ~0u;
        }
        const bool full = kept && j0 + kBN <= key_end && (!a.causal || j0 + kBN - 1 <= q0 + 64 * wg + offset);
        tile_softmax<kBN, true>(sc, m, l, alpha, qscale, full, qi, j0, key_end, a.causal, offset, s.q_len, kPaged,
                          [&] { return kv_bits_from_words<kBN>(kw, t4); }, t4);
    };

    // Turns for D >= 128 only: D = 64's products are too short to hide a softmax behind
    // (docs/attention.md).
    constexpr bool kPingPong = D >= 128;
    // Turns: ntiles + 1 issue phases per warpgroup (the first S, ntiles - 1 S + P V pairs, the last
    // P V).  Warpgroup 1 passes the first turn to warpgroup 0 and does not pass after its last
    // phase, so every barrier phase completes and none is left half-arrived at exit.
    if (kPingPong && ntiles > 0 && wg == 1) turn_pass(1);
    // Paged stages are written by cp.async (generic proxy): a proxy fence before the tensor cores
    // read them; their kbits are read by the softmax, so the K stage is released after it.
    if (ntiles > 0) {
        mbar_wait(q_full, 0);
        mbar_wait(k_full(0), 0);
        if (kPaged) fence_async_smem();
        pin(sc);
        if constexpr (kPingPong) turn_wait(wg);
        wg_fence();
        issue_s(0);
        wg_commit();
        if constexpr (kPingPong) turn_pass(wg);
        wg_wait<0>();
        pin(sc);
        if (!kPaged && lane == 0) mbar_arrive(k_empty(0));
        float alpha[2];
        softmax(0, alpha);
        if (kPaged && lane == 0) mbar_arrive(k_empty(0));
        pack_p<T, kBN>(p, sc);
    }
    for (int kt = 1; kt < ntiles; kt++) {
        mbar_wait(k_full(kt & 1), (kt >> 1) & 1);
        mbar_wait(v_full((kt - 1) & 1), ((kt - 1) >> 1) & 1);
        if (kPaged) fence_async_smem();
        pin(sc);
        pin(o);
        pin(p);
        if constexpr (kPingPong) turn_wait(wg);
        wg_fence();
        issue_s(kt);
        wg_commit();
        issue_v(kt - 1);
        wg_commit();
        if constexpr (kPingPong) turn_pass(wg);
        wg_wait<1>();
        pin(sc);
        if (!kPaged && lane == 0) mbar_arrive(k_empty(kt & 1));
        float alpha[2];
        softmax(kt, alpha);
        if (kPaged && lane == 0) mbar_arrive(k_empty(kt & 1));
        wg_wait<0>();
        pin(o);
        pin(p);
        if (lane == 0) mbar_arrive(v_empty((kt - 1) & 1));
        rescale_o<D>(o, alpha);
        pack_p<T, kBN>(p, sc);
    }
    if (ntiles > 0) {
        mbar_wait(v_full((ntiles - 1) & 1), ((ntiles - 1) >> 1) & 1);
        if (kPaged) fence_async_smem();
        pin(o);
        pin(p);
        if constexpr (kPingPong) turn_wait(wg);
        wg_fence();
        issue_v(ntiles - 1);
        wg_commit();
        if (kPingPong && wg == 0) turn_pass(0);
        wg_wait<0>();
        pin(o);
        pin(p);
    }
    write_rows<T, D>(o, l, qi, s.q_len,
                     static_cast<T *>(a.out) + (kPaged ? 0 : (int64_t)b * a.out_stride[0]) + s.q_row0 * a.out_stride[1] +
                         h * a.out_stride[2],
                     a.out_stride[1], t4);
#endif
}

// A 4-D tensor map over a [B, L, H, D] tensor (element strides s[3] = {b, l, h}, D unit-stride):
// dims (D, then L, H, B ordered by stride, as the copy engine wants each stride to cover the
// dims below it), boxes of 64 columns x rows rows.  False when the layout does not qualify.
bool make_map(CUtensorMap *tm, WsCoords *pos, const void *base, int dtype, int64_t B, int64_t L, int64_t H, int64_t D,
              const int64_t s[3], int rows) {
    static const auto encode = (PFN_cuTensorMapEncodeTiled_v12000)qk_driver_entry("cuTensorMapEncodeTiled");
    if (!encode) return false;
    struct Dim {
        int64_t size, stride;
        int which;  // 0 row, 1 head, 2 batch
    } d[3] = {{L, s[1], 0}, {H, s[2], 1}, {B, s[0], 2}};
    for (int i = 0; i < 3; i++)  // size-1 dims take any stride: put them last
        if (d[i].size == 1) d[i].stride = INT64_MAX;
    for (int i = 1; i < 3; i++)
        for (int j = i; j > 0 && d[j].stride < d[j - 1].stride; j--) {
            const Dim t = d[j];
            d[j] = d[j - 1];
            d[j - 1] = t;
        }
    cuuint64_t dims[4] = {(cuuint64_t)D, 0, 0, 0}, strides[3];
    cuuint32_t box[4] = {64, 1, 1, 1}, estr[4] = {1, 1, 1, 1};
    int64_t prev = D * 2;
    for (int i = 0; i < 3; i++) {
        dims[i + 1] = (cuuint64_t)d[i].size;
        const int64_t st = d[i].size == 1 ? prev : d[i].stride * 2;
        if (st <= 0 || st % 16) return false;
        strides[i] = (cuuint64_t)st;
        prev = st * d[i].size;
        if (d[i].which == 0) {
            box[i + 1] = (cuuint32_t)rows;
            pos->row = i + 1;
        } else if (d[i].which == 1) {
            pos->head = i + 1;
        } else {
            pos->batch = i + 1;
        }
    }
    const CUresult r = encode(tm, dtype == QK_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                              const_cast<void *>(base), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS;
}

template <typename T, int D, bool kPaged> int launch_ws(const qk_attn_prefill_args *a, cudaStream_t s) {
    constexpr int kBN = ws_key_tile<D>();
    alignas(64) CUtensorMap tq, tk, tv;
    WsCoords qp, kp = {}, vp = {};
    const int64_t qs[3] = {a->q_stride[0], a->q_stride[1], a->q_stride[2]};
    const int64_t ks[3] = {a->k_stride[0], a->k_stride[1], a->k_stride[2]};
    const int64_t vs[3] = {a->v_stride[0], a->v_stride[1], a->v_stride[2]};
    dim3 grid;
    if (kPaged) {  // q is [total_q, Hq, D]: one sequence of total_q rows; K/V are gathered
        // The producer keeps pool rows in 32 bits and row strides in 32-bit byte counts.
        if (a->pool_size > 0x7fffffff) return QK_E_UNSUPPORTED;
        for (const int64_t rs : {a->k_stride[1], a->v_stride[1]})
            if (rs < 0 || rs * (int64_t)sizeof(T) > 0xffffffffll) return QK_E_UNSUPPORTED;
        if (!make_map(&tq, &qp, a->q, a->dtype, 1, a->total_q, a->Hq, D, qs, kBM)) return QK_E_UNSUPPORTED;
        tk = tv = tq;
        const int64_t tiles = (a->total_q + kBM - 1) / kBM + a->B;  // any split into B requests fits
        if (tiles > 0x7fffffff || a->total_q > 0x7fffffff) return QK_E_UNSUPPORTED;
        grid = dim3((unsigned)tiles, (unsigned)a->Hq, 1);
    } else {
        if (!make_map(&tq, &qp, a->q, a->dtype, a->B, a->Lq, a->Hq, D, qs, kBM) ||
            !make_map(&tk, &kp, a->k, a->dtype, a->B, a->Lkv, a->Hkv, D, ks, kBN) ||
            !make_map(&tv, &vp, a->v, a->dtype, a->B, a->Lkv, a->Hkv, D, vs, kBN))
            return QK_E_UNSUPPORTED;
        grid = dim3((unsigned)((a->Lq + kBM - 1) / kBM), (unsigned)a->Hq, (unsigned)a->B);
    }
    constexpr size_t smem = ws_smem_bytes<D>();
    const int opt = qk_kernel_residency((const void *)prefill_ws<T, D, kPaged>, kWsThreads, smem, nullptr);
    if (opt) return opt;
    qk_attn_prefill_args p = *a;
    void *args[] = {&tq, &tk, &tv, &qp, &kp, &vp, &p};
    return qk_launch((const void *)prefill_ws<T, D, kPaged>, grid, dim3(kWsThreads), smem, s, args);
}

template <typename T> int pick_ws(const qk_attn_prefill_args *a, cudaStream_t s) {
    switch (a->D) {
    case 64: return a->paged ? launch_ws<T, 64, true>(a, s) : launch_ws<T, 64, false>(a, s);
    case 128: return a->paged ? launch_ws<T, 128, true>(a, s) : launch_ws<T, 128, false>(a, s);
    case 256: return a->paged ? launch_ws<T, 256, true>(a, s) : launch_ws<T, 256, false>(a, s);
    default: return QK_E_UNSUPPORTED;
    }
}

template <typename T, int D, bool kPaged> int launch(const qk_attn_prefill_args *a, cudaStream_t s) {
    constexpr size_t smem = smem_bytes<D>();
    const int opt = qk_kernel_residency((const void *)prefill_wgmma<T, D, kPaged>, kThreads, smem, nullptr);
    if (opt) return opt;
    dim3 grid;
    if (kPaged) {
        const int64_t tiles = (a->total_q + kBM - 1) / kBM + a->B;  // any split into B requests fits
        if (tiles > 0x7fffffff) return QK_E_UNSUPPORTED;
        grid = dim3((unsigned)tiles, (unsigned)a->Hq, 1);
    } else {
        grid = dim3((unsigned)((a->Lq + kBM - 1) / kBM), (unsigned)a->Hq, (unsigned)a->B);
    }
    qk_attn_prefill_args p = *a;
    void *args[] = {&p};
    return qk_launch((const void *)prefill_wgmma<T, D, kPaged>, grid, dim3(kThreads), smem, s, args);
}

template <typename T, bool kPaged> int pick_dim(const qk_attn_prefill_args *a, cudaStream_t s) {
    switch (a->D) {
    case 64: return launch<T, 64, kPaged>(a, s);
    case 128: return launch<T, 128, kPaged>(a, s);
    case 256: return launch<T, 256, kPaged>(a, s);
    default: return QK_E_UNSUPPORTED;
    }
}
}  // namespace
#endif

// QK_E_UNSUPPORTED unless this build has sm_90a code and the current device is compute
// capability 9.0 (the caller then uses the mma.sync kernel).  a->variant QK_PREFILL_MMA forces that
// kernel (tests and benchmarks compare the two).
extern "C" int qk_attn_prefill_sm90(const qk_attn_prefill_args *a, cudaStream_t s) {
#if defined(QK_SM90A)
    if (a->variant == QK_PREFILL_MMA) return QK_E_UNSUPPORTED;
    int cc;
    const int st = qk_device_cc(&cc);
    if (st) return st;
    // Per-query masks (mask_kind 2: bool [B, H, Lq, Lkv], and every additive float mask) stay on
    // the mma.sync kernel: a load per score would double this kernel's code and its masked path is
    // sized for 32-bit compares.
    if (cc != 90 || a->mask_kind == 2 || !(a->scale > 0.f)) return QK_E_UNSUPPORTED;
    // The warp-specialised kernel (a->variant QK_PREFILL_WGMMA keeps the cp.async one): dense calls
    // without a mask, paged calls with at most a key mask; it declines layouts the copy engine cannot
    // describe.
    if ((a->paged ? a->mask_kind <= 1 : a->mask_kind == 0) && a->variant != QK_PREFILL_WGMMA) {
        const int r = a->dtype == QK_BF16 ? pick_ws<__nv_bfloat16>(a, s) : pick_ws<__half>(a, s);
        if (r != QK_E_UNSUPPORTED) return r;
    }
    switch (a->dtype) {
    case QK_BF16: return a->paged ? pick_dim<__nv_bfloat16, true>(a, s) : pick_dim<__nv_bfloat16, false>(a, s);
    case QK_F16: return a->paged ? pick_dim<__half, true>(a, s) : pick_dim<__half, false>(a, s);
    default: return QK_E_UNSUPPORTED;
    }
#else
    (void)a;
    (void)s;
    return QK_E_UNSUPPORTED;
#endif
}
