// linear and swiglu on Hopper (sm_90a) with the products on the warpgroup tensor cores (wgmma),
// computed transposed like linear.cu: out^T [N, M] = W [N, K] . x^T [K, M], so W is the m64
// operand and the (at most 64) rows of x the n one.  Two kernels:
//
// lin_rows (M <= 64, linear and swiglu; picked by lin_rows_pays): one CTA per SM, each streaming
// its own contiguous run of weight rows along all of K through TMA; described at the kernel.
//
// lin_wgmma (linear, 16 < M <= 64 where lin_rows is not picked): why wgmma at all: linear.cu's
// mma.sync kernel reads every x fragment from shared memory once per warp and every weight
// fragment once per thread; at M = 64 that is ~5 bytes of shared-memory reads per weight byte,
// near the SM's shared-memory bandwidth at the copy rate (docs/linear.md).
// wgmma reads both operands from shared memory once per warpgroup: 2 bytes per weight byte at
// M = 64.  Work: a CTA owns kLBN = 128 weight rows (two consumer warpgroups of 64) and all M rows
// of x; a producer warp's first thread copies 64-wide K steps of W ([128][64]) and x ([M][64],
// rows_x_box) with TMA in the 128-byte swizzle into a
// kLStages-deep ring of 'full' (bytes landed) and 'empty' (both consumer warpgroups done)
// mbarriers.  When the weight tiles alone cannot fill the GPU, a cluster of up to 8 CTAs splits K
// and their partial tiles are added through distributed shared memory in rank order, as in
// linear.cu: bitwise reproducible, no atomics, no workspace.
//
// Both: any K (the copy engine zero-fills the tail) with K % 8 == 0 and 16-byte aligned rows (the
// tensor map's rules), else linear.cu's kernels run.
#include "common.cuh"
#include "sm90.cuh"
#include "wgmma.cuh"

#include <cooperative_groups.h>
#include <cudaTypedefs.h>
#include <stdlib.h>

#if defined(QK_SM90A)
namespace {
using namespace qk_sm90;

constexpr int kLWG = 2;                     // consumer warpgroups
constexpr int kLThreads = 128 * kLWG + 32;  // + the producer warp (last, so warpgroups stay aligned)
constexpr int kLBN = 64 * kLWG;             // weight rows per CTA
constexpr int kLMX = 64;                    // rows of x (the wgmma n)
constexpr int kLKC = 64;                    // K per stage: one 128-byte swizzle row
constexpr int kLStages = 4;
constexpr uint32_t kLWBytes = kLBN * kLKC * 2, kLXBytes = kLMX * kLKC * 2, kLStageBytes = kLWBytes + kLXBytes;
constexpr int kLLD = kLBN + 4;  // padded row of the reduction tile
constexpr size_t kLRing = (size_t)kLStages * kLStageBytes, kLTile = (size_t)kLMX * kLLD * 4;
constexpr size_t kLSmem = 1024 + (kLRing > kLTile ? kLRing : kLTile);  // +1024: stages on 1024-byte boundaries

// x's box in both kernels: its M rows, at most NX.  A box that ran past M would have the copy engine
// zero-fill the rest on every stage, which is slow.  The ring's rows past M keep stale values; they
// meet only the accumulators of x rows past M, which nobody stores.
__host__ __device__ inline int rows_x_box(int64_t M, int NX) { return M < NX ? (int)M : NX; }

template <typename T>
__global__ void __launch_bounds__(kLThreads, 2)
    lin_wgmma(const __grid_constant__ CUtensorMap tw, const __grid_constant__ CUtensorMap tx, qk_linear_args a, int cs) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) uint64_t bars[2 * kLStages];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
    const uint32_t ring = (raw + 1023) & ~1023u;
    const uint32_t bar0 = (uint32_t)__cvta_generic_to_shared(bars);
    auto full = [&](int st) { return bar0 + 8 * st; };
    auto empty = [&](int st) { return bar0 + 8 * (kLStages + st); };
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int rank = 0;
    if (cs > 1) rank = (int)cooperative_groups::this_cluster().block_rank();
    const int64_t n0 = (int64_t)(blockIdx.x / cs) * kLBN;
    const int64_t steps = (a.K + kLKC - 1) / kLKC;
    const int64_t s0 = steps * rank / cs;
    const int nst = (int)(steps * (rank + 1) / cs - s0);

    if (tid == 0) {
        for (int st = 0; st < kLStages; st++) {
            mbar_init(full(st), 1);
            mbar_init(empty(st), 4 * kLWG);  // the consumer warps
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    // Launched by qk_launch_clusters(..., dependent): the set-up above may overlap the previous kernel.
    qk_dependent_wait();
    qk_dependent_launch();
    __syncthreads();

    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; i++) acc[i] = 0.f;
    if (warp == 4 * kLWG) {  // the producer warp
        if (lane == 0) {
            const uint32_t bytes = kLWBytes + (uint32_t)rows_x_box(a.M, kLMX) * kLKC * 2;
            for (int i = 0; i < nst; i++) {
                const int st = i % kLStages, ph = (i / kLStages) & 1;
                if (i >= kLStages) mbar_wait(empty(st), ph ^ 1);
                const uint32_t dst = ring + st * kLStageBytes;
                const int k = (int)((s0 + i) * kLKC);
                mbar_expect_tx(full(st), bytes);
                tma_load_2d(dst, &tw, k, (int)n0, full(st));
                tma_load_2d(dst + kLWBytes, &tx, k, 0, full(st));
            }
        }
        __syncwarp();
    } else {
        // Warp-uniform (a shuffle from lane 0), so the descriptors below live in uniform
        // registers and ptxas keeps the wgmma asynchronous.
        const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0);
        for (int i = 0; i < nst; i++) {
            const int st = i % kLStages, ph = (i / kLStages) & 1;
            mbar_wait(full(st), ph);
            const uint32_t ws = ring + st * kLStageBytes + wg * 64 * 128, xs = ring + st * kLStageBytes + kLWBytes;
            const uint64_t dw = make_desc(ws, 16, 1024), dx = make_desc(xs, 16, 1024);
            pin(acc);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < kLKC / 16; kk++)  // 32 bytes along the swizzled row per k16 step
                qk_wgmma::SS<T, 64>::template mma<0, 0>(acc, dw + ((kk * 32) >> 4), dx + ((kk * 32) >> 4), 1);
            wg_commit();
            wg_wait<1>();  // the previous step's products are done: release its stage
            pin(acc);
            if (i > 0 && lane == 0) mbar_arrive(empty((i - 1) % kLStages));
        }
        wg_wait<0>();
        pin(acc);
    }
    __syncthreads();  // every product done, every copy consumed: the ring becomes the tile

    // acc: rows (weight) 16 * (warp % 4) + g and + 8 of the warpgroup's 64; columns (x rows)
    // 8 n + 2 t, + 1.  The tile is [x row][weight row], so the epilogue stores run along n.
    float(*tile)[kLLD] = reinterpret_cast<float(*)[kLLD]>(smem_raw + (ring - raw));
    if (warp < 4 * kLWG) {
        const int g = lane >> 2, t = lane & 3;
        const int r = (warp >> 2) * 64 + 16 * (warp & 3) + g;
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) tile[8 * n + 2 * t + (e & 1)][r + 8 * (e >> 1)] = acc[4 * n + e];
    }
    if (cs > 1) {
        cooperative_groups::this_cluster().sync();  // every rank's tile is complete
    } else {
        __syncthreads();
    }
    // This rank's share of the tile, summed over the ranks in order.
    constexpr int E = kLMX * kLBN;
    const int e_begin = rank * E / cs, e_end = (rank + 1) * E / cs;
    const T *bias = static_cast<const T *>(a.bias);
    T *out = static_cast<T *>(a.out);
    for (int e = e_begin + tid; e < e_end; e += kLThreads) {
        const int mi = e / kLBN, ni = e % kLBN;
        const int64_t n = n0 + ni;
        if (mi >= a.M || n >= a.N) continue;
        float y = tile[mi][ni];
        if (cs > 1) y = qk_cluster_sum(&tile[mi][ni], cs);
        if (bias) y += qk_to_float(bias[n * a.bias_stride]);
        out[mi * a.out_stride + n] = qk_from_float<T>(y);
    }
    if (cs > 1) cooperative_groups::this_cluster().sync();  // keep the tile alive for remote readers
#endif
}

// A [rows, K] row-major matrix as a 2D tensor map with [box_rows][64] boxes in the 128-byte
// swizzle; false when the copy engine cannot describe it (alignment, strides) or when a box
// coordinate would not fit the int the kernels pass (K or rows past 2^31 - 1).
bool lin_map(CUtensorMap *tm, const void *base, int dtype, int64_t rows, int64_t K, int64_t stride, int box_rows,
             CUtensorMapL2promotion promo = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
    static const auto encode = (PFN_cuTensorMapEncodeTiled_v12000)qk_driver_entry("cuTensorMapEncodeTiled");
    if (!encode || !qk_aligned16(base) || K % 8 || (rows > 1 && stride % 8) || K >= (1ll << 31) || rows >= (1ll << 31))
        return false;
    const int64_t st = rows > 1 ? stride * 2 : K * 2;  // a single row's stride is never used
    cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)st};
    cuuint32_t box[2] = {(cuuint32_t)kLKC, (cuuint32_t)box_rows}, estr[2] = {1, 1};
    return encode(tm, dtype == QK_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
                  const_cast<void *>(base), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  promo, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <typename T> int lin_wgmma_run(const qk_linear_args *a, cudaStream_t stream) {
    alignas(64) CUtensorMap tw, tx;
    if (!lin_map(&tw, a->w, a->dtype, a->N, a->K, a->w_stride, kLBN) ||
        !lin_map(&tx, a->x, a->dtype, a->M, a->K, a->x_stride, rows_x_box(a->M, kLMX)))
        return QK_E_UNSUPPORTED;
    const void *kernel = (const void *)lin_wgmma<T>;
    int per_sm, sms;
    QK_CUDA_TRY((cudaError_t)qk_kernel_residency(kernel, kLThreads, kLSmem, &per_sm));
    QK_CUDA_TRY((cudaError_t)qk_sm_count(&sms));
    const int64_t ntiles = (a->N + kLBN - 1) / kLBN, steps = (a->K + kLKC - 1) / kLKC;
    // Split K over a cluster while the doubled grid still fits one CTA per SM and each rank keeps
    // at least two rings' worth of steps; filling both resident slots is slower (docs/linear.md).
    int cs = 1;
    while (cs < 8 && ntiles * cs * 2 <= sms && steps >= (int64_t)cs * 2 * 2 * kLStages) cs *= 2;
    if (const int forced = qk_linear_split(a)) cs = forced;
    if (ntiles * cs > 0x7fffffff) return QK_E_UNSUPPORTED;
    qk_linear_args p = *a;
    int cs_arg = cs;
    void *args[] = {&tw, &tx, &p, &cs_arg};
    const dim3 grid((unsigned)(ntiles * cs)), block(kLThreads);
    return qk_launch_clusters(kernel, grid, block, kLSmem, stream, args, (unsigned)cs, true);
}

// ---- lin_rows: one CTA per SM, each owning a contiguous run of weight rows over all of K --------
// For M <= 64, where streaming the weights is the whole cost.  CTA c of G owns rows
// [c N / G, (c+1) N / G) (counts differ by at most one) and streams them through a ring of
// [BR][64] TMA boxes, BR = ceil(N / G) rows (swiglu: an up and a gate box per stage), plus x's
// [NX][64] box, so no CTA waits for another, no K is split and no partial sum is written: out is
// stored straight from the fp32 accumulators (bias or silu(gate) * up in fp32, one rounding, as
// linear.cu).  A CTA's box may take one row of its neighbour's, which both read at about the same
// time (an L2 hit).  Why: one CTA per SM streaming TMA boxes keeps its CTAs close together and
// streams faster than the tile kernels' 8-row x 64-byte cp.async fragments
// (benchmarks/probe/tma_roofline.cu, weight_roofline.py; docs/linear.md).  Each stage
// holds MB m64 blocks per weight (MB * 64 >= BR); rows past BR compute values nobody stores.
// kAlt (MB = 1): the two consumer warpgroups take alternate stages of the one block and add their
// sums at the end (warpgroup 0's plus warpgroup 1's: a fixed order, bitwise reproducible).
// SW > 0 (swapped operands, for boxes of at most SW rows at M > 32): x's 64 rows are the m64
// operand and the box's weight rows the n = SW one, so a 32-row box does not pad an m64 block
// with 32 rows of nothing.

template <int NX, int MB, bool kSwiglu, bool kAlt, int SW> struct rows_cfg {
    static constexpr int NW = kSwiglu ? 2 : 1;               // weight matrices (up, gate)
    static constexpr int kWG = kAlt || MB >= 2 ? 2 : 1;      // consumer warpgroups
    static constexpr int kBPW = kAlt ? 1 : MB / kWG;         // m64 blocks per warpgroup
    static constexpr int kThreads = 128 * kWG + 32;          // + the producer warp
    static constexpr int kWRows = SW ? SW : MB * 64;         // a stage's rows of one weight
    static constexpr uint32_t kWBytes = kWRows * kLKC * 2;
    static constexpr uint32_t kStage = NW * kWBytes + NX * kLKC * 2;
    static constexpr int kN = SW ? SW : NX;                  // the wgmma n
    static constexpr int kMaxStages = 32;
    static_assert(kAlt ? MB == 1 : kWG * kBPW == MB, "MB splits evenly over the warpgroups");
    static_assert(!SW || (kAlt && NX == 64), "swapped operands: x's 64 rows, one block");
    static_assert(kN % 8 == 0 && kN <= 64, "wgmma n");
};

template <typename T, int NX, int MB, bool kSwiglu, bool kAlt, int SW>
__global__ void __launch_bounds__(rows_cfg<NX, MB, kSwiglu, kAlt, SW>::kThreads, 1)
    lin_rows(const __grid_constant__ CUtensorMap tw, const __grid_constant__ CUtensorMap tg,
             const __grid_constant__ CUtensorMap tx, qk_linear_args a, int box_rows, int x_box, int stages) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using C = rows_cfg<NX, MB, kSwiglu, kAlt, SW>;
    constexpr int NW = C::NW, NA = C::kN / 2;  // NA: accumulators per thread and block
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) uint64_t bars[2 * C::kMaxStages];
    const uint32_t ring = ((uint32_t)__cvta_generic_to_shared(smem_raw) + 1023) & ~1023u;
    const uint32_t bar0 = (uint32_t)__cvta_generic_to_shared(bars);
    auto full = [&](int st) { return bar0 + 8 * st; };
    auto empty = [&](int st) { return bar0 + 8 * (C::kMaxStages + st); };
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t G = gridDim.x, c = blockIdx.x;
    const int64_t row0 = c * a.N / G, rows = (c + 1) * a.N / G - row0;
    const int steps = (int)((a.K + kLKC - 1) / kLKC);

    if (tid == 4 * C::kWG * 32) {  // the producer: fetch the descriptors while the barriers are set up
        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tw)) : "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tx)) : "memory");
        if (kSwiglu) asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tg)) : "memory");
    }
    if (tid == 0) {
        for (int st = 0; st < stages; st++) {
            mbar_init(full(st), 1);
            mbar_init(empty(st), kAlt ? 4 : 4 * C::kWG);  // the consumer warps that read the stage
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    // A programmatic dependent (qk_launch_dependent): the set-up above may overlap the previous
    // kernel's tail, as cuBLAS's consecutive calls overlap (docs/linear.md).
    qk_dependent_wait();
    qk_dependent_launch();
    __syncthreads();

    float acc[NW * C::kBPW][NA];  // [q * BPW + b]: weight q, m64 block b
#pragma unroll
    for (int b = 0; b < NW * C::kBPW; b++)
#pragma unroll
        for (int i = 0; i < NA; i++) acc[b][i] = 0.f;
    if (warp == 4 * C::kWG) {  // the producer warp
        if (lane == 0) {
            const uint32_t bytes = (uint32_t)(NW * box_rows + x_box) * kLKC * 2;
            int st = 0, ph = 0;
            for (int i = 0; i < steps; i++) {
                if (i >= stages) mbar_wait(empty(st), ph ^ 1);
                const uint32_t dst = ring + st * C::kStage;
                mbar_expect_tx(full(st), bytes);
                tma_load_2d(dst, &tw, i * kLKC, (int)row0, full(st));
                if (kSwiglu) tma_load_2d(dst + C::kWBytes, &tg, i * kLKC, (int)row0, full(st));
                tma_load_2d(dst + NW * C::kWBytes, &tx, i * kLKC, 0, full(st));
                if (++st == stages) st = 0, ph ^= 1;
            }
        }
        __syncwarp();
    } else {
        // Warp-uniform (a shuffle from lane 0), so the descriptors stay in uniform registers and
        // ptxas keeps the wgmma asynchronous.
        const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0);
        const int step = kAlt ? 2 : 1;  // kAlt: the two warpgroups take alternate stages
        int st = kAlt ? wg : 0, ph = 0, prev = 0;
        for (int i = kAlt ? wg : 0; i < steps; i += step) {
            mbar_wait(full(st), ph);
            const uint32_t base = ring + st * C::kStage;
            const uint64_t dx = make_desc(base + NW * C::kWBytes, 16, 1024);
#pragma unroll
            for (int b = 0; b < NW * C::kBPW; b++) pin(acc[b]);
            wg_fence();
#pragma unroll
            for (int q = 0; q < NW; q++)
#pragma unroll
                for (int b = 0; b < C::kBPW; b++) {
                    const int blk = kAlt ? 0 : wg * C::kBPW + b;
                    const uint64_t dw = make_desc(base + q * C::kWBytes + blk * 64 * 128, 16, 1024);
#pragma unroll
                    for (int kk = 0; kk < kLKC / 16; kk++) {  // 32 bytes along the swizzled row per k16 step
                        const uint64_t ow = dw + ((kk * 32) >> 4), ox = dx + ((kk * 32) >> 4);
                        if (SW) qk_wgmma::SS<T, C::kN>::template mma<0, 0>(acc[q * C::kBPW + b], ox, ow, 1);
                        else qk_wgmma::SS<T, C::kN>::template mma<0, 0>(acc[q * C::kBPW + b], ow, ox, 1);
                    }
                }
            wg_commit();
            // The previous step's products are done: release its stage (releasing this step's at
            // once would wait for the products just issued: slower, docs/linear.md).
            wg_wait<1>();
#pragma unroll
            for (int b = 0; b < NW * C::kBPW; b++) pin(acc[b]);
            if (i >= step && lane == 0) mbar_arrive(empty(prev));
            prev = st;
            st += step;
            if (st >= stages) st -= stages, ph ^= 1;
        }
        wg_wait<0>();
#pragma unroll
        for (int b = 0; b < NW * C::kBPW; b++) pin(acc[b]);
        if (kAlt) {  // warpgroup 1's sums into warpgroup 0's, through the ring (every stage consumed)
            float *red = reinterpret_cast<float *>(smem_raw + (ring - (uint32_t)__cvta_generic_to_shared(smem_raw)));
            const int ct = tid & 127;
            asm volatile("bar.sync 1, 256;" ::: "memory");
            if (wg == 1) {
#pragma unroll
                for (int q = 0; q < NW; q++)
#pragma unroll
                    for (int i = 0; i < NA; i++) red[(q * NA + i) * 128 + ct] = acc[q][i];
            }
            asm volatile("bar.sync 1, 256;" ::: "memory");
            if (wg == 1) return;
#pragma unroll
            for (int q = 0; q < NW; q++)
#pragma unroll
                for (int i = 0; i < NA; i++) acc[q][i] += red[(q * NA + i) * 128 + ct];
        }
        // acc[b][4 j + 2 h + e]: the m64 row 64 (wg BPW + b) + 16 (warp % 4) + g + 8 h and the n column
        // 8 j + 2 t + e; the m row is a weight row and the column an x row, or the reverse with SW.
        const int g = lane >> 2, t = lane & 3;
        const T *bias = static_cast<const T *>(a.bias);
        T *out = static_cast<T *>(a.out);
        // out[m, row0 + r] from accumulator i of block b, in fp32 with one rounding.
        auto emit = [&](int64_t m, int r, int b, int i) {
            if (m >= a.M || r >= rows) return;
            const int64_t n = row0 + r;
            float y;
            if (kSwiglu) {
                y = qk_silu_mul(acc[b][i], acc[C::kBPW + b][i]);
            } else {
                y = acc[b][i];
                if (bias) y += qk_to_float(bias[n * a.bias_stride]);
            }
            out[m * a.out_stride + n] = qk_from_float<T>(y);
        };
#pragma unroll
        for (int b = 0; b < C::kBPW; b++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int mrow = (kAlt ? 0 : wg * C::kBPW + b) * 64 + 16 * (warp & 3) + g + 8 * h;
#pragma unroll
                for (int j = 0; j < C::kN / 8; j++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int ncol = 8 * j + 2 * t + e, i = 4 * j + 2 * h + e;
                        if (SW) emit(mrow, ncol, b, i);
                        else emit(ncol, mrow, b, i);
                    }
            }
    }
#endif
}

template <typename T, int NX, int MB, bool kSwiglu, bool kAlt, int SW = 0>
int lin_rows_launch(const qk_linear_args *a, cudaStream_t stream, int64_t G, int br) {
    using C = rows_cfg<NX, MB, kSwiglu, kAlt, SW>;
    alignas(64) CUtensorMap tw, tg, tx;
    const int x_box = rows_x_box(a->M, NX);
    // The weights' L2 promotion: 128 bytes (the box's row) for linear, 256 for swiglu: the faster
    // one for each (docs/linear.md).
    const CUtensorMapL2promotion promo = kSwiglu ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B : CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
    if (!lin_map(&tw, a->w, a->dtype, a->N, a->K, a->w_stride, br, promo) ||
        !lin_map(&tx, a->x, a->dtype, a->M, a->K, a->x_stride, x_box))
        return QK_E_UNSUPPORTED;
    if (kSwiglu ? !lin_map(&tg, a->gate, a->dtype, a->N, a->K, a->gate_stride, br, promo) : (tg = tw, false))
        return QK_E_UNSUPPORTED;
    // As deep a ring as fits (227 KB a block, less the 1 KB alignment pad).
    int stages = (int)((227 * 1024 - 1024) / C::kStage);
    stages = stages > C::kMaxStages ? C::kMaxStages : stages;
    if (stages < 2) return QK_E_UNSUPPORTED;
    const size_t smem = 1024 + (size_t)stages * C::kStage;
    const void *kernel = (const void *)lin_rows<T, NX, MB, kSwiglu, kAlt, SW>;
    // The shared-memory opt-in, once per kernel and device (smem is fixed per instantiation).
    QK_CUDA_TRY((cudaError_t)qk_kernel_residency(kernel, C::kThreads, smem, nullptr));
    qk_linear_args p = *a;
    int br_arg = br, xb_arg = x_box, st_arg = stages;
    void *args[] = {&tw, &tg, &tx, &p, &br_arg, &xb_arg, &st_arg};
    return qk_launch_dependent(kernel, dim3((unsigned)G), dim3(C::kThreads), smem, stream, args);
}

template <typename T, int NX, bool kSwiglu>
int lin_rows_mb(const qk_linear_args *a, cudaStream_t stream, int64_t G, int br) {
    // Boxes of at most 64 rows fill one m64 block: two warpgroups take alternate stages, so one
    // waits on its stage while the other multiplies.  At M > 32 a box of at most 32 rows takes the
    // swapped operands, x the m64 one, instead of padding half an m64 block (docs/linear.md).
    if (NX == 64 && br <= 32) return lin_rows_launch<T, 64, 1, kSwiglu, true, 32>(a, stream, G, br);
    if (br <= 64) return lin_rows_launch<T, NX, 1, kSwiglu, true>(a, stream, G, br);
    if (br <= 128) return lin_rows_launch<T, NX, 2, kSwiglu, false>(a, stream, G, br);
    return lin_rows_launch<T, NX, 4, kSwiglu, false>(a, stream, G, br);
}

template <typename T, bool kSwiglu> int lin_rows_run(const qk_linear_args *a, cudaStream_t stream) {
    if (a->M > 64) return QK_E_UNSUPPORTED;
    int sms;
    QK_CUDA_TRY((cudaError_t)qk_sm_count(&sms));
    // One CTA per SM, at most 256 rows each (the copy engine's box); more CTAs past 256 * SMs rows.
    int64_t G = sms;
    if (G > a->N) G = a->N;
    if ((a->N + G - 1) / G > 256) G = (a->N + 255) / 256;
    if (G > 0x7fffffff) return QK_E_UNSUPPORTED;
    const int br = (int)((a->N + G - 1) / G);
    if (a->M <= 8) return lin_rows_mb<T, 8, kSwiglu>(a, stream, G, br);
    if (a->M <= 16) return lin_rows_mb<T, 16, kSwiglu>(a, stream, G, br);
    if (a->M <= 32) return lin_rows_mb<T, 32, kSwiglu>(a, stream, G, br);
    return lin_rows_mb<T, 64, kSwiglu>(a, stream, G, br);
}

}  // namespace
#endif

// Where the row kernel runs when nothing is forced: M <= 64 with at least 16 weight rows per SM and
// K >= 2048 (the measured region is N and K >= 4096), M = 1 included: as a programmatic dependent
// it is ahead of linear.cu's GEMV there too (docs/linear.md).
bool lin_rows_pays(const qk_linear_args *a, int sms) {
    return a->M <= kLMX && a->N >= 16ll * sms && a->K >= 2048;
}

// linear and swiglu on a compute-capability-9.0 GPU: the row kernel (M <= 64, see lin_rows_pays),
// and for the rest of linear at 16 < M <= 64 the cluster wgmma kernel; else QK_E_UNSUPPORTED and the
// caller runs linear.cu's kernels.  a->variant QK_LINEAR_MMA forces those, QK_LINEAR_ROWS the row
// kernel wherever the copy engine can describe the operands (tests and benchmarks compare them).
extern "C" int qk_linear_sm90(const qk_linear_args *a, int swiglu, cudaStream_t stream) {
#if defined(QK_SM90A)
    const int pick = a->variant;
    if (pick == QK_LINEAR_MMA || a->M <= 0 || a->M > kLMX || a->N <= 0 || a->K <= 0) return QK_E_UNSUPPORTED;
    if (a->dtype != QK_BF16 && a->dtype != QK_F16) return QK_E_UNSUPPORTED;
    int cc, sms;
    int st = qk_device_cc(&cc);
    if (st) return st;
    if (cc != 90) return QK_E_UNSUPPORTED;
    QK_CUDA_TRY((cudaError_t)qk_sm_count(&sms));
    const bool bf16 = a->dtype == QK_BF16;
    if (pick == QK_LINEAR_ROWS || (pick == QK_LINEAR_AUTO && lin_rows_pays(a, sms))) {
        st = swiglu ? (bf16 ? lin_rows_run<__nv_bfloat16, true>(a, stream) : lin_rows_run<__half, true>(a, stream))
                    : (bf16 ? lin_rows_run<__nv_bfloat16, false>(a, stream) : lin_rows_run<__half, false>(a, stream));
        if (st != QK_E_UNSUPPORTED || pick == QK_LINEAR_ROWS) return st;
    }
    if (swiglu || a->M <= 16) return QK_E_UNSUPPORTED;
    return bf16 ? lin_wgmma_run<__nv_bfloat16>(a, stream) : lin_wgmma_run<__half>(a, stream);
#else
    (void)a;
    (void)swiglu;
    (void)stream;
    return QK_E_UNSUPPORTED;
#endif
}
