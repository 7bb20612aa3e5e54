// linear: out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]); swiglu: out = (x . up[n]) * silu(x . gate[n]),
// silu(g) = g / (1 + e^-g).  bf16/fp16 in, fp32 accumulation and epilogue, one rounding.
//
// Skinny GEMM on the tensor cores, computed transposed: out^T [N, M] = W [N, K] . x^T [K, M] with
// mma.sync m16n8k16, W as the 16-row A operand and x as the 8-column B operand, so one mma covers
// 16 weight rows and up to 8 rows of x.  A thread (g = lane / 4, t = lane % 4) takes 16 bytes of
// weight row g (and g + 8) at k = 32 s + 8 t, and the same 16 bytes of x row g: the k order inside a
// 32-wide step is permuted identically for both operands, so both fragments are plain 16-byte
// copies (no ldmatrix, no swizzle).
//
// Decomposition: a block of WN x WK warps owns BN = WN * NT * 16 weight rows and up to 8 * MT rows
// of x; the WK warp groups split K, the WN warps of a group split the rows and share that K
// range's x.  Loads go through a shared-memory ring, RD 32-wide steps deep, filled by cp.async
// (weights L2-only with a 256-byte L2 prefetch, read exactly once; x through L1): each thread
// copies and later reads its own weight fragments, and the warps of a group copy one x tile each
// for all of them (a named barrier per group).  On sm_90, when the row tiles alone cannot fill the
// GPU (N = 4096 at larger M, small N), a cluster of CS blocks splits K further.  Partial sums are
// reduced in a fixed order (warp groups 0..WK-1 through shared memory, then cluster ranks
// 0..CS-1 through distributed shared memory), so results are bitwise reproducible; no atomics,
// no workspace.  M > 64 runs in chunks of 64 rows of x, the chunks of one weight tile adjacent in
// the grid so the re-reads hit L2.  Any K: 32-wide steps, the K % 32 tail element by element;
// unaligned rows take element loads throughout.
// Bytes: the weight once plus x (re-read once per block: M / BN of the weight bytes) and out;
// 14336 x 4096 bf16 is 117 MB, 29 µs at 4 TB/s.
#include "common.cuh"
#include <cooperative_groups.h>

extern "C" int qk_linear_sm90(const qk_linear_args *a, int swiglu, cudaStream_t stream);  // linear_sm90.cu
extern "C" int qk_linear_lt(const qk_linear_args *a, int swiglu, cudaStream_t stream);    // linear_lt.cu

namespace {

// Asynchronous 16-byte copies global -> shared (sm_80+).  Weights: L2 only (read once) with a
// 256-byte L2 prefetch so the row's next steps are already in L2; x: through L1, which the
// blocks of an SM share.
__device__ __forceinline__ void lin_cp_w(uint32_t dst, const uint16_t *src) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void lin_cp_x(uint32_t dst, const uint16_t *src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

// Elements p[0..7], element by element (unaligned rows), zeros from index `limit` on.
__device__ __forceinline__ uint4 lin_ld8(const uint16_t *p, int64_t limit) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint32_t lo = 2 * i < limit ? __ldg(p + 2 * i) : 0u;
        const uint32_t hi = 2 * i + 1 < limit ? __ldg(p + 2 * i + 1) : 0u;
        w[i] = lo | (hi << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

template <int MT, int NT, int WN, int WK, bool kSwiglu>
struct lin_cfg {
    static constexpr int kMT = MT, kNT = NT, kWN = WN, kWK = WK;
    static constexpr bool kSwi = kSwiglu;
    static constexpr int kThreads = WN * WK * 32;
    static constexpr int BN = WN * NT * 16;  // weight rows per block
    static constexpr int MTILE = MT * 8;     // rows of x per block
    static constexpr int NW = kSwiglu ? 2 : 1;
    static constexpr int LD = BN + 4;        // padded tile row: the fragment stores hit 32 banks
    // The ring, one stage per 32-wide step: each thread's own weight fragments (WSLOTS), and the
    // x fragments of each warp group (the WN warps sharing a K range), loaded by those warps in
    // turn (x tile mt by warp mt % WN) and read by all of them.
    static constexpr int WSLOTS = NW * NT * 2;
    static constexpr int XPW = (MT + WN - 1) / WN;  // x fragments a warp loads per step
    static constexpr size_t kStageW = (size_t)WSLOTS * kThreads * 16, kStageX = (size_t)WK * MT * 32 * 16;
    static constexpr size_t kTileBytes = (size_t)NW * MTILE * LD * 4;
    // Depth in steps: about 20 loads (320 bytes) in flight per thread, at least 3 steps, and the
    // ring within the 99 KB a block may opt into on sm_86/sm_89.  The reduction tile reuses it.
    static constexpr int kRD0 = 20 / (WSLOTS + XPW) > 8 ? 8 : 20 / (WSLOTS + XPW) < 3 ? 3 : 20 / (WSLOTS + XPW);
    static constexpr int kRDCap = (int)(101376 / (kStageW + kStageX));
    static constexpr int RD = kRD0 < kRDCap ? kRD0 : kRDCap;
    static_assert(RD >= 3, "ring too shallow");
    static constexpr size_t kRingBytes = (size_t)RD * (kStageW + kStageX);
    static constexpr size_t kSmem = kRingBytes > kTileBytes ? kRingBytes : kTileBytes;
    static_assert(kSmem <= 101376, "more shared memory than sm_86/sm_89 allow");
    static constexpr int kMinBlocks = MT >= 8 && kSwiglu ? 1 : 2;
};

template <class C> struct lin_rows {
    const uint16_t *w[C::NW][C::kNT][2];  // weight rows g and g + 8 of each 16-row tile (clamped to N - 1)
    const uint16_t *x[C::kMT];            // x row g of each 8-row tile (clamped to M - 1)
};

// Queue step s (k = 32 s + 8 t) into ring stage `stage`: this thread's weight fragments, which
// only it reads (cp.async.wait_group orders the copy before the read), and its warp's share of
// the group's x fragments (a named barrier orders those for the other warps of the group).
template <class C>
__device__ __forceinline__ void lin_issue(uint32_t ring, const lin_rows<C> &r, int64_t s, int stage, int wn, int wk,
                                          int lane) {
    const int64_t k = s * 32 + 8 * (lane & 3);
    uint32_t dst = ring + (uint32_t)(stage * C::kStageW + threadIdx.x * 16);
#pragma unroll
    for (int q = 0; q < C::NW; q++)
#pragma unroll
        for (int nt = 0; nt < C::kNT; nt++)
#pragma unroll
            for (int h = 0; h < 2; h++, dst += C::kThreads * 16) lin_cp_w(dst, r.w[q][nt][h] + k);
    const uint32_t xs = ring + (uint32_t)(C::RD * C::kStageW + ((stage * C::kWK + wk) * C::kMT) * 32 * 16 + lane * 16);
#pragma unroll
    for (int j = 0; j < C::XPW; j++) {
        const int mt = wn + j * C::kWN;
        if (mt < C::kMT) lin_cp_x(xs + mt * 32 * 16, r.x[mt] + k);
    }
}

// Two mma per (16-row tile, 8-row x tile) and step: slots (2t, 2t+1 | 2t+8, 2t+9) take the
// loaded k = 8t+0,1 | 8t+2,3 first, then 8t+4,5 | 8t+6,7; x uses the same map.
template <class C, typename T>
__device__ __forceinline__ void lin_step(float (&acc)[C::NW][C::kNT][C::kMT][4], const uint4 (&w)[C::NW][C::kNT][2],
                                         const uint4 (&x)[C::kMT]) {
#pragma unroll
    for (int q = 0; q < C::NW; q++)
#pragma unroll
        for (int nt = 0; nt < C::kNT; nt++)
#pragma unroll
            for (int mt = 0; mt < C::kMT; mt++) {
                const uint4 lo = w[q][nt][0], hi = w[q][nt][1], xv = x[mt];
                qk_mma16816<T>(acc[q][nt][mt], lo.x, hi.x, lo.y, hi.y, xv.x, xv.y);
                qk_mma16816<T>(acc[q][nt][mt], lo.z, hi.z, lo.w, hi.w, xv.z, xv.w);
            }
}

// Step s from elementwise loads: unaligned rows (every step) and the zero-padded K % 32 tail.
template <class C, typename T>
__device__ __forceinline__ void lin_step_elementwise(float (&acc)[C::NW][C::kNT][C::kMT][4], const lin_rows<C> &r,
                                                     int64_t s, int t, int64_t K) {
    uint4 w[C::NW][C::kNT][2], x[C::kMT];
    const int64_t k = s * 32 + 8 * t, left = K - k;
#pragma unroll
    for (int q = 0; q < C::NW; q++)
#pragma unroll
        for (int nt = 0; nt < C::kNT; nt++)
#pragma unroll
            for (int h = 0; h < 2; h++) w[q][nt][h] = lin_ld8(r.w[q][nt][h] + k, left);
#pragma unroll
    for (int mt = 0; mt < C::kMT; mt++) x[mt] = lin_ld8(r.x[mt] + k, left);
    lin_step<C, T>(acc, w, x);
}

template <class C, typename T, bool kVec>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks) lin_kernel(qk_linear_args a, int cs, int mchunks) {
    constexpr int NW = C::NW, NT = C::kNT, MT = C::kMT, WN = C::kWN, WK = C::kWK, RD = C::RD;
    qk_dependent_wait();  // launched by qk_launch_clusters(..., dependent)
    extern __shared__ __align__(16) unsigned char lin_smem[];
    // The reduction tile reuses the ring once every warp has left the main loop.
    float(*tile)[C::MTILE][C::LD] = reinterpret_cast<float(*)[C::MTILE][C::LD]>(lin_smem);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wn = warp % WN, wk = warp / WN;
    const int g = lane >> 2, t = lane & 3;
    int rank = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (cs > 1) rank = (int)cooperative_groups::this_cluster().block_rank();
#endif
    const int64_t cluster = blockIdx.x / cs;
    const int64_t mc = cluster % mchunks, ntile = cluster / mchunks;
    const int64_t n_block = ntile * C::BN, m_block = mc * C::MTILE;
    const int64_t N = a.N, M = a.M, K = a.K;

    lin_rows<C> rows;
    {
        const uint16_t *mats[2] = {static_cast<const uint16_t *>(a.w), static_cast<const uint16_t *>(a.gate)};
        const int64_t strides[2] = {a.w_stride, a.gate_stride};
#pragma unroll
        for (int q = 0; q < NW; q++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    int64_t n = n_block + (wn * NT + nt) * 16 + g + 8 * h;
                    n = n < N ? n : N - 1;  // rows past N compute values nobody stores
                    rows.w[q][nt][h] = mats[q] + n * strides[q];
                }
        const uint16_t *x = static_cast<const uint16_t *>(a.x);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            int64_t m = m_block + mt * 8 + g;
            m = m < M ? m : M - 1;
            rows.x[mt] = x + m * a.x_stride;
        }
    }

    float acc[NW][NT][MT][4];
#pragma unroll
    for (int q = 0; q < NW; q++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[q][nt][mt][i] = 0.f;

    // This warp's share of the 32-wide steps: part (rank, wk) of cs * WK contiguous ranges.
    const int parts = cs * WK, part = rank * WK + wk;
    const int64_t steps = K / 32;
    const int64_t s_begin = steps * part / parts, n_steps = steps * (part + 1) / parts - s_begin;
    if (kVec) {
        // A ring of RD steps per thread: RD - 1 steps in flight while one is multiplied.
        const uint32_t ring = (uint32_t)__cvta_generic_to_shared(lin_smem);
        const uint4 *mine = reinterpret_cast<const uint4 *>(lin_smem) + threadIdx.x;
        const uint4 *xring = reinterpret_cast<const uint4 *>(lin_smem + C::RD * C::kStageW) + wk * MT * 32 + lane;
#pragma unroll
        for (int i = 0; i < RD - 1; i++) {
            if (i < n_steps) lin_issue<C>(ring, rows, s_begin + i, i, wn, wk, lane);
            cp_async_commit();
        }
        int stage = 0;
#pragma unroll 1
        for (int64_t i = 0; i < n_steps; i++) {
            cp_async_wait<RD - 2>();  // step i has landed (this thread's copies)
            // ... and the group's: every warp of it has also finished reading step i - 1's stage.
            if (WN > 1) asm volatile("bar.sync %0, %1;" ::"r"(1 + wk), "r"(WN * 32) : "memory");
            // Refill the stage read in the previous iteration.
            const int refill = stage == 0 ? RD - 1 : stage - 1;
            if (i + RD - 1 < n_steps) lin_issue<C>(ring, rows, s_begin + i + RD - 1, refill, wn, wk, lane);
            cp_async_commit();
            const uint4 *src = mine + stage * (C::kStageW / 16);
            uint4 w[NW][NT][2], x[MT];
            int slot = 0;
#pragma unroll
            for (int q = 0; q < NW; q++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int h = 0; h < 2; h++, slot++) w[q][nt][h] = src[slot * C::kThreads];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) x[mt] = xring[(stage * WK * MT + mt) * 32];
            lin_step<C, T>(acc, w, x);
            stage = stage == RD - 1 ? 0 : stage + 1;
        }
        cp_async_wait<0>();
    } else {
        for (int64_t i = 0; i < n_steps; i++) lin_step_elementwise<C, T>(acc, rows, s_begin + i, t, K);
    }
    if (part == parts - 1 && (K & 31)) lin_step_elementwise<C, T>(acc, rows, steps, t, K);  // the K % 32 tail

    __syncthreads();  // the ring is free: the tile takes its place
    // Warps 0..WK-1 of each row group add into the tile in turn: a fixed order.
#pragma unroll 1
    for (int p = 0; p < WK; p++) {
        if (wk == p) {
#pragma unroll
            for (int q = 0; q < NW; q++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int mt = 0; mt < MT; mt++)
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            // c0, c1: (row g, x rows 2t, 2t+1); c2, c3: row g + 8
                            float &cell = tile[q][mt * 8 + 2 * t + (i & 1)][(wn * NT + nt) * 16 + g + 8 * (i >> 1)];
                            cell = p == 0 ? acc[q][nt][mt][i] : cell + acc[q][nt][mt][i];
                        }
        }
        __syncthreads();
    }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (cs > 1) cooperative_groups::this_cluster().sync();  // every rank's tile is complete
#endif
    // Epilogue: this rank's share of the tile, x row by x row (coalesced stores along n).
    constexpr int E = C::MTILE * C::BN;
    const int e_begin = rank * E / cs, e_end = (rank + 1) * E / cs;
    const T *bias = static_cast<const T *>(a.bias);
    T *out = static_cast<T *>(a.out);
    for (int e = e_begin + (int)threadIdx.x; e < e_end; e += C::kThreads) {
        const int mi = e / C::BN, ni = e % C::BN;
        const int64_t m = m_block + mi, n = n_block + ni;
        if (m >= M || n >= N) continue;
        float v[NW];
#pragma unroll
        for (int q = 0; q < NW; q++) v[q] = tile[q][mi][ni];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if (cs > 1) {
#pragma unroll
            for (int q = 0; q < NW; q++) v[q] = qk_cluster_sum(&tile[q][mi][ni], cs);
        }
#endif
        float y;
        if (C::kSwi) {
            const float gv = v[NW - 1];
            y = qk_silu_mul(v[0], gv);
        } else {
            y = v[0];
            if (bias) y += qk_to_float(bias[n * a.bias_stride]);
        }
        out[m * a.out_stride + n] = qk_from_float<T>(y);
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (cs > 1) cooperative_groups::this_cluster().sync();  // keep the tile alive for remote readers
#endif
}

template <class C, typename T, bool kVec>
int lin_run(const qk_linear_args *a, cudaStream_t stream, int max_cs) {
    const void *kernel = (const void *)lin_kernel<C, T, kVec>;
    // The ring needs more than the default 48 KB of dynamic shared memory.
    int blocks_per_sm;
    QK_CUDA_TRY((cudaError_t)qk_kernel_residency(kernel, C::kThreads, C::kSmem, &blocks_per_sm));
    int sms, cc;
    QK_CUDA_TRY((cudaError_t)qk_sm_count(&sms));
    QK_CUDA_TRY((cudaError_t)qk_device_cc(&cc));
    const int64_t ntiles = (a->N + C::BN - 1) / C::BN, mchunks = (a->M + C::MTILE - 1) / C::MTILE;
    const int64_t blocks = ntiles * mchunks, resident = (int64_t)sms * blocks_per_sm;
    // Split K over a cluster while the doubled grid still fits in one resident wave and each warp
    // keeps a few load batches.
    int cs = 1;
    if (cc >= 90)  // clusters
        while (cs < max_cs && blocks * cs * 2 <= resident && a->K / 32 >= (int64_t)cs * 2 * C::kWK * C::RD) cs *= 2;
    if (const int forced = qk_linear_split(a)) cs = cc >= 90 ? forced : 1;
    qk_linear_args p = *a;
    int cs_arg = cs, mchunks_arg = (int)mchunks;
    void *args[] = {&p, &cs_arg, &mchunks_arg};
    const dim3 grid((unsigned)(blocks * cs)), block(C::kThreads);
    return qk_launch_clusters(kernel, grid, block, C::kSmem, stream, args, (unsigned)cs, true);
}

// max_cs: the largest cluster the launcher may split K over (what suits a tile choice).
template <class C, typename T>
int lin_pick_vec(const qk_linear_args *a, bool swiglu, cudaStream_t stream, int max_cs = 8) {
    // 16-byte loads need 16-byte aligned rows; a single row's stride is never used.
    bool vec = qk_aligned16(a->x) && qk_aligned16(a->w) && (a->M == 1 || a->x_stride % 8 == 0) &&
               (a->N == 1 || a->w_stride % 8 == 0);
    if (swiglu) vec = vec && qk_aligned16(a->gate) && (a->N == 1 || a->gate_stride % 8 == 0);
    return vec ? lin_run<C, T, true>(a, stream, max_cs) : lin_run<C, T, false>(a, stream, max_cs);
}

// ---- GEMV on the CUDA cores: M = 1 over many rows (lin_gemv_pick), M <= 8 when forced -----------
// The mma.sync kernel above reads, per warp-wide copy, 64 bytes of each of 16 weight rows (4 lanes
// a row, a 256-byte L2 prefetch for the row's next steps).  Here a warp streams R whole rows, one
// row per warp-wide load: 512 contiguous bytes (lane l: elements 8 l .. 8 l + 7 of a 256-element
// chunk), U chunks of each row in flight (8 loads of 16 bytes per lane), straight into registers
// (no shared memory, no L1 allocation); x through L1 at the same k.  8 FMA per 16 bytes of weight
// and row of x.  The lanes' sums are reduced by shuffles in a fixed order: bitwise reproducible.
__device__ __forceinline__ uint4 lin_ld_stream(const uint16_t *p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}
template <typename T> __device__ __forceinline__ void lin_unpack8(uint4 v, float (&f)[8]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 8; i++) f[i] = qk_word_half<T>(w[i / 2], i & 1);
}

constexpr int kGemvThreads = 256;

// M = 1 bounded to 64 registers, four blocks per SM, so that 14336 rows at 4 a warp (448 blocks)
// fit one wave on 132 x 4 slots; at three blocks per SM they would take 1.13 waves.
template <typename T, int MM, int R, bool kSwiglu>
__global__ void __launch_bounds__(kGemvThreads, MM == 1 ? 4 : 1) lin_gemv(qk_linear_args a) {
    constexpr int NW = kSwiglu ? 2 : 1;
    constexpr int U = 8 / (R * NW) > 0 ? 8 / (R * NW) : 1;  // chunks of each row in flight
    qk_dependent_wait();  // launched by qk_launch_dependent
    const int lane = threadIdx.x & 31;
    const int64_t n0 = ((int64_t)blockIdx.x * (kGemvThreads / 32) + (threadIdx.x >> 5)) * R;
    if (n0 >= a.N) return;
    const int M = (int)a.M;
    const uint16_t *x = static_cast<const uint16_t *>(a.x);
    const uint16_t *wrow[NW][R];
#pragma unroll
    for (int q = 0; q < NW; q++)
#pragma unroll
        for (int r = 0; r < R; r++) {
            const int64_t n = n0 + r < a.N ? n0 + r : a.N - 1;  // rows past N: a valid row, not stored
            wrow[q][r] = static_cast<const uint16_t *>(q ? a.gate : a.w) + n * (q ? a.gate_stride : a.w_stride);
        }
    float acc[NW][R][MM];
#pragma unroll
    for (int q = 0; q < NW; q++)
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int m = 0; m < MM; m++) acc[q][r][m] = 0.f;
    for (int64_t k0 = 8 * (int64_t)lane; k0 < a.K; k0 += 256 * U) {
        uint4 wv[U][NW][R];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t k = k0 + 256 * u;
#pragma unroll
            for (int q = 0; q < NW; q++)
#pragma unroll
                for (int r = 0; r < R; r++) wv[u][q][r] = k < a.K ? lin_ld_stream(wrow[q][r] + k) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t k = k0 + 256 * u;
            if (k >= a.K) break;
            float wf[NW][R][8];
#pragma unroll
            for (int q = 0; q < NW; q++)
#pragma unroll
                for (int r = 0; r < R; r++) lin_unpack8<T>(wv[u][q][r], wf[q][r]);
#pragma unroll
            for (int m = 0; m < MM; m++) {
                if (m >= M) break;
                float xf[8];
                lin_unpack8<T>(__ldg(reinterpret_cast<const uint4 *>(x + m * a.x_stride + k)), xf);
#pragma unroll
                for (int q = 0; q < NW; q++)
#pragma unroll
                    for (int r = 0; r < R; r++)
#pragma unroll
                        for (int e = 0; e < 8; e++) acc[q][r][m] = fmaf(wf[q][r][e], xf[e], acc[q][r][m]);
            }
        }
    }
    const T *bias = static_cast<const T *>(a.bias);
    T *out = static_cast<T *>(a.out);
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int m = 0; m < MM; m++) {
            float v[NW];
#pragma unroll
            for (int q = 0; q < NW; q++) {
                v[q] = acc[q][r][m];
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) v[q] += __shfl_xor_sync(0xffffffffu, v[q], off);
            }
            const int64_t n = n0 + r;
            if (lane != (r * MM + m) % 32 || m >= M || n >= a.N) continue;
            float y;
            if (kSwiglu) {
                y = qk_silu_mul(v[0], v[NW - 1]);
            } else {
                y = v[0];
                if (bias) y += qk_to_float(bias[n * a.bias_stride]);
            }
            out[m * a.out_stride + n] = qk_from_float<T>(y);
        }
}

template <typename T, int MM, bool kSwiglu>
int lin_gemv_run(const qk_linear_args *a, cudaStream_t stream) {
    int sms;
    QK_CUDA_TRY((cudaError_t)qk_sm_count(&sms));
    // Rows per warp: as many as keep ~16 warps per SM busy (more rows share each x load).
    const int64_t warps16 = (int64_t)sms * 16;
    const int R = a->N >= 4 * warps16 ? 4 : a->N >= 2 * warps16 ? 2 : 1;
    const void *kernel = R == 4 ? (const void *)lin_gemv<T, MM, 4, kSwiglu>
                         : R == 2 ? (const void *)lin_gemv<T, MM, 2, kSwiglu>
                                  : (const void *)lin_gemv<T, MM, 1, kSwiglu>;
    const int64_t rows_per_block = (int64_t)(kGemvThreads / 32) * R;
    const int64_t blocks = (a->N + rows_per_block - 1) / rows_per_block;
    if (blocks > 0x7fffffff) return QK_E_UNSUPPORTED;
    qk_linear_args p = *a;
    void *args[] = {&p};
    return qk_launch_dependent(kernel, dim3((unsigned)blocks), dim3(kGemvThreads), 0, stream, args);
}

// Where lin_gemv runs: M = 1 (linear and swiglu) with at least 4 rows per warp at 16 warps per SM
// (N >= 8448 on 132 SMs) where linear_sm90.cu's row kernel does not (GPUs other than sm_90, or
// shapes the copy engine cannot describe): there whole-row streams beat the tile kernel's 64-byte
// fragments.  Not with fewer, longer rows, nor at M > 1, where x is re-read from L1 for every row
// (docs/linear.md).  a->variant QK_LINEAR_GEMV forces it for M <= 8, any other non-zero variant
// keeps it off.  16-byte loads only: K % 8 == 0 and 16-byte aligned rows, else the tile kernels.
template <typename T, bool kSwiglu>
int lin_gemv_pick(const qk_linear_args *a, cudaStream_t stream) {
    const bool forced = a->variant == QK_LINEAR_GEMV;
    if (a->M > (forced ? 8 : 1) || a->K % 8 || (a->variant != QK_LINEAR_AUTO && !forced)) return QK_E_UNSUPPORTED;
    if (!forced) {
        int sms;
        QK_CUDA_TRY((cudaError_t)qk_sm_count(&sms));
        if (a->N < (int64_t)sms * 64) return QK_E_UNSUPPORTED;
    }
    bool ok = qk_aligned16(a->x) && qk_aligned16(a->w) && a->x_stride % 8 == 0 && a->w_stride % 8 == 0;
    if (kSwiglu) ok = ok && qk_aligned16(a->gate) && a->gate_stride % 8 == 0;
    if (!ok) return QK_E_UNSUPPORTED;
    if (a->M <= 1) return lin_gemv_run<T, 1, kSwiglu>(a, stream);
    if (a->M <= 2) return lin_gemv_run<T, 2, kSwiglu>(a, stream);
    if (a->M <= 4) return lin_gemv_run<T, 4, kSwiglu>(a, stream);
    return lin_gemv_run<T, 8, kSwiglu>(a, stream);
}

// The one place shapes become tile configurations (MT, NT, WN, WK): 8 * MT rows of x per block;
// more x rows per block share each weight fragment across more mma, so the block's rows are split
// between more warps (WN) to keep x re-reads at or below half the weight bytes.
template <typename T, bool kSwiglu>
int lin_dispatch(const qk_linear_args *a, cudaStream_t stream) {
    if (a->M <= 0 || a->N <= 0) return QK_OK;
    if (a->K > 0) {
        const int g = lin_gemv_pick<T, kSwiglu>(a, stream);
        if (g != QK_E_UNSUPPORTED) return g;
    }
    // a->tile_m (tuning sweeps): the tile configuration of M = tile_m whatever M is.  Any choice is
    // correct: a smaller tile takes the rows in chunks, a larger one computes rows past M that nobody
    // stores.
    const int64_t M = a->tile_m >= 1 && a->tile_m <= 64 ? a->tile_m : a->M;
    // Tile choices per M, N and K, from a sweep of 11 configurations (docs/linear.md); e.g. M = 16
    // past 16384 rows takes 128-row tiles whose eight warps split the rows, not K.
    const bool big = a->N >= 8192;
    if (kSwiglu) {
        if (M <= 8 && big) return lin_pick_vec<lin_cfg<1, 1, 4, 2, true>, T>(a, true, stream);
        if (M <= 4) return lin_pick_vec<lin_cfg<1, 1, 1, 8, true>, T>(a, true, stream);
        if (M <= 8) return lin_pick_vec<lin_cfg<1, 1, 2, 4, true>, T>(a, true, stream);
        if (M <= 16 && big) return lin_pick_vec<lin_cfg<2, 1, 4, 2, true>, T>(a, true, stream);
        if (M <= 16) return lin_pick_vec<lin_cfg<2, 1, 2, 4, true>, T>(a, true, stream);
        if (M <= 32) return lin_pick_vec<lin_cfg<4, 1, 4, 2, true>, T>(a, true, stream);
        return lin_pick_vec<lin_cfg<8, 1, 8, 1, true>, T>(a, true, stream);
    }
    if (M <= 4) return lin_pick_vec<lin_cfg<1, 1, 1, 8, false>, T>(a, false, stream);
    // M <= 8 past 8192 rows or K: 32-row tiles of two 16-row fragments per warp and eight
    // K-splitting warps.
    if (M <= 8 && (big || a->K >= 8192)) return lin_pick_vec<lin_cfg<1, 2, 1, 8, false>, T>(a, false, stream);
    if (M <= 8) return lin_pick_vec<lin_cfg<1, 1, 1, 8, false>, T>(a, false, stream);
    // M <= 16: 64-row tiles share x between four warps, but at N = 4096 they need a 4-block
    // cluster to fill the GPU, which is slower than 32-row tiles of eight K-splitting warps.
    if (M <= 16 && a->N >= 16384) return lin_pick_vec<lin_cfg<2, 1, 8, 1, false>, T>(a, false, stream);
    if (M <= 16 && big) return lin_pick_vec<lin_cfg<2, 1, 4, 2, false>, T>(a, false, stream);
    // ... and below 8192 rows and K, 64-row tiles over clusters of at most 2 (at K >= 8192 the
    // 32-row tiles stay ahead).
    if (M <= 16 && a->K < 8192) return lin_pick_vec<lin_cfg<2, 1, 4, 2, false>, T>(a, false, stream, 2);
    if (M <= 16) return lin_pick_vec<lin_cfg<2, 2, 1, 8, false>, T>(a, false, stream);
    if (M <= 32) return lin_pick_vec<lin_cfg<4, 1, 4, 2, false>, T>(a, false, stream);
    return lin_pick_vec<lin_cfg<8, 1, 8, 1, false>, T>(a, false, stream);
}

template <bool kSwiglu>
int lin_entry(const qk_linear_args *a, void *stream) {
    if (kSwiglu && a->gate == nullptr) return QK_E_UNSUPPORTED;
    if (a->M > 64 && a->variant == QK_LINEAR_AUTO) {  // past decode sizes: cuBLASLt, if present
        const int r = qk_linear_lt(a, kSwiglu, (cudaStream_t)stream);
        if (r != QK_E_UNSUPPORTED) return r;
    }
    {  // sm_90: the row kernel and the wgmma kernel (linear_sm90.cu), where they apply
        const int r = qk_linear_sm90(a, kSwiglu, (cudaStream_t)stream);
        if (r != QK_E_UNSUPPORTED) return r;
    }
    switch (a->dtype) {
    case QK_BF16: return lin_dispatch<__nv_bfloat16, kSwiglu>(a, (cudaStream_t)stream);
    case QK_F16: return lin_dispatch<__half, kSwiglu>(a, (cudaStream_t)stream);
    default: return QK_E_UNSUPPORTED;  // float32 on cuda is staged through the cpu backend
    }
}

}  // namespace

extern "C" int qk_linear_cuda(const qk_linear_args *a, void *stream) { return lin_entry<false>(a, stream); }

extern "C" int qk_swiglu_cuda(const qk_linear_args *a, void *stream) { return lin_entry<true>(a, stream); }
