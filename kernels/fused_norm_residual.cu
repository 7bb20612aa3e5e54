// fused_norm_residual: LayerNorm over the last dim, * gamma + beta, dropout, + residual.
//
// Work decomposition: one warp per row (8 or 16 lanes for rows of 8 or 16 vectors).  Rows of up to
// 1024 values whose rows are 16-byte vectorisable stay in registers (K 16-byte chunks per lane), so
// x is read once: mean, then the
// variance of the deviations from the registers (two-pass), then the output with streaming stores.
// Both passes work on x - x[row, 0]: for a row with mean 1e4 and unit spread the shifted values
// are of unit size, so neither the fp32 sum nor the deviations lose digits to the mean.  Other rows take the scalar kernel, which reads
// the row three times (the re-reads hit L1/L2).  Bytes: read x and residual, write out (R*H*3
// elements, plus gamma/beta once); fp32 R=1M H=128: 1.5 GB.  The dropout mask is
// qk_dropout_keep(seed, r*H + h) from qkernels/philox.h, bit-identical to the CPU kernel's.
#include "common.cuh"
#include "qkernels/philox.h"

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

namespace {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The sum over each aligned group of L lanes (every lane of the warp takes part).
template <int L>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = L / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

constexpr int kRowsPerBlock = 8;

// The dropout seed: the int of the call, or the value of its seed tensor now (so a captured graph
// replays with whatever the tensor holds).
__device__ __forceinline__ uint64_t nr_seed(const int64_t *p, uint64_t seed) {
    return p ? (uint64_t)__ldg(reinterpret_cast<const long long *>(p)) : seed;
}

// A row per group of G lanes (G < 32 when the row is 8 or 16 vectors: a warp serves 32 / G rows).
template <typename T, int K, bool kTrain, int G>
__global__ void __launch_bounds__(kRowsPerBlock * 32) nr_registers(qk_fused_norm_residual_args a) {
    constexpr int V = qk_vec<T>::N;
    constexpr int kRowsPerWarp = 32 / G;
    const int lane = threadIdx.x % G, sub = (threadIdx.x & 31) / G;
    const int nvec = (int)(a.H / V);
    const T *x = static_cast<const T *>(a.x), *res = static_cast<const T *>(a.residual);
    const T *gamma = static_cast<const T *>(a.gamma), *beta = static_cast<const T *>(a.beta);
    T *out = static_cast<T *>(a.out);
    const float inv_h = 1.f / (float)a.H;
    const uint64_t seed = kTrain ? nr_seed(a.seed_ptr, a.seed) : 0;
    // the loop is uniform over the warp (its shuffles need every lane); a lane past R masks its row
    for (int64_t r0 = ((int64_t)blockIdx.x * kRowsPerBlock + (threadIdx.x >> 5)) * kRowsPerWarp; r0 < a.R;
         r0 += (int64_t)gridDim.x * kRowsPerBlock * kRowsPerWarp) {
        const int64_t r = r0 + sub;
        const int n = r < a.R ? nvec : 0;  // this lane group's vectors
        float v[K][V];
        qk_vec<T> rv[K];
        float sum = 0.f;
        const float shift = n ? qk_to_float(x[r * a.x_stride[0]]) : 0.f;
        // The residual is loaded up front so its latency hides behind the two reductions.
#pragma unroll
        for (int k = 0; k < K; k++)
            if (lane + G * k < n) rv[k] = qk_load_vec(res + r * a.res_stride[0] + (lane + G * k) * V);
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int c = lane + G * k;
            if (c < n) {
                const qk_vec<T> xv = qk_load_vec(x + r * a.x_stride[0] + c * V);
#pragma unroll
                for (int j = 0; j < V; j++) sum += (v[k][j] = qk_to_float(xv.v[j]) - shift);
            }
        }
        const float mean = group_sum<G>(sum) * inv_h;  // of the shifted values
        float sq = 0.f;
#pragma unroll
        for (int k = 0; k < K; k++)
            if (lane + G * k < n)
#pragma unroll
                for (int j = 0; j < V; j++) sq += (v[k][j] - mean) * (v[k][j] - mean);
        const float rstd = rsqrtf(group_sum<G>(sq) * inv_h + a.eps);
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int c = lane + G * k;
            if (c >= n) continue;
            const qk_vec<T> g = qk_load_vec(gamma + c * V), b = qk_load_vec(beta + c * V);
            const uint64_t index = (uint64_t)(r * a.H + c * V);  // a multiple of 4: H % V == 0
            qk_vec<T> o;
#pragma unroll
            for (int j0 = 0; j0 < V; j0 += 4) {
                qk_philox_block bits;
                if (kTrain) bits = qk_philox4x32((index + j0) >> 2, seed);
#pragma unroll
                for (int j = j0; j < j0 + 4; j++) {
                    float y = (v[k][j] - mean) * rstd * qk_to_float(g.v[j]) + qk_to_float(b.v[j]);
                    if (kTrain) y = bits.v[j - j0] >= a.drop_threshold ? y * a.scale : 0.f;
                    o.v[j] = qk_from_float<T>(y + qk_to_float(rv[k].v[j]));
                }
            }
            qk_store_vec(out + r * a.out_stride[0] + c * V, o);
        }
    }
}

template <typename T>
__global__ void __launch_bounds__(kRowsPerBlock * 32) nr_scalar(qk_fused_norm_residual_args a) {
    const int lane = threadIdx.x & 31;
    const T *x = static_cast<const T *>(a.x), *res = static_cast<const T *>(a.residual);
    const T *gamma = static_cast<const T *>(a.gamma), *beta = static_cast<const T *>(a.beta);
    T *out = static_cast<T *>(a.out);
    const float inv_h = 1.f / (float)a.H;
    const uint64_t seed = a.training ? nr_seed(a.seed_ptr, a.seed) : 0;
    for (int64_t r = (int64_t)blockIdx.x * kRowsPerBlock + (threadIdx.x >> 5); r < a.R;
         r += (int64_t)gridDim.x * kRowsPerBlock) {
        const T *xr = x + r * a.x_stride[0];
        const float shift = qk_to_float(xr[0]);
        float sum = 0.f;
        for (int64_t h = lane; h < a.H; h += 32) sum += qk_to_float(xr[h * a.x_stride[1]]) - shift;
        const float mean = warp_sum(sum) * inv_h;  // of the shifted values
        float sq = 0.f;
        for (int64_t h = lane; h < a.H; h += 32) {
            const float dv = (qk_to_float(xr[h * a.x_stride[1]]) - shift) - mean;
            sq += dv * dv;
        }
        const float rstd = rsqrtf(warp_sum(sq) * inv_h + a.eps);
        for (int64_t h = lane; h < a.H; h += 32) {
            float y = ((qk_to_float(xr[h * a.x_stride[1]]) - shift) - mean) * rstd *
                          qk_to_float(gamma[h * a.gamma_stride]) +
                      qk_to_float(beta[h * a.beta_stride]);
            if (a.training) y = qk_dropout_keep(seed, (uint64_t)(r * a.H + h), a.drop_threshold) ? y * a.scale : 0.f;
            out[r * a.out_stride[0] + h * a.out_stride[1]] =
                qk_from_float<T>(y + qk_to_float(res[r * a.res_stride[0] + h * a.res_stride[1]]));
        }
    }
}

template <typename T>
int nr_chunks_per_lane(const qk_fused_norm_residual_args *a) {
    constexpr int V = qk_vec<T>::N;
    const bool layout = a->H % V == 0 && a->x_stride[1] == 1 && a->res_stride[1] == 1 && a->out_stride[1] == 1 &&
                        a->gamma_stride == 1 && a->beta_stride == 1 && a->x_stride[0] % V == 0 &&
                        a->res_stride[0] % V == 0 && a->out_stride[0] % V == 0 && qk_aligned16(a->x) &&
                        qk_aligned16(a->residual) && qk_aligned16(a->out) && qk_aligned16(a->gamma) &&
                        qk_aligned16(a->beta);
    if (!layout) return 0;
    const int64_t per_lane = (a->H / V + 31) / 32;
    for (int k = 1; k <= 8; k *= 2)
        if (per_lane <= k && k * V <= 32) return k;  // at most 32 values per lane in registers
    return 0;
}

template <typename T, int K, int G = 32>
const void *nr_pick(bool train) {
    return train ? (const void *)nr_registers<T, K, true, G> : (const void *)nr_registers<T, K, false, G>;
}

// ---- backward -------------------------------------------------------------------------------
//
// grad_x needs each row's mean and rstd (recomputed from x: the forward keeps nothing) and two row
// sums; grad_gamma and grad_beta are column sums over all rows.  The register kernel reads
// grad_out and x once and writes grad_x once (3 R*H elements, the minimum without saved
// statistics): groups of L lanes own a row each (L = the row's 16-byte chunks rounded up to a power
// of two, so small H keeps every lane busy), with the row in registers as in the forward.  A block
// owns a contiguous range of rows and each lane keeps the column sums of its own chunks in
// registers across the rows it sees; at the end the groups' sums are added through shuffles and
// the warps' through shared memory, in a fixed order, into one partial per block.  The grid is one
// resident wave (SMs x blocks per SM), a function of the shapes and the device only, so the bits
// are fixed for a GPU model.  A second kernel adds the blocks' partials per column in block order:
// deterministic, no float atomics.  Other layouts take a scalar kernel (a warp per row, re-reads
// from L1/L2) that stores each row's mean and rstd, and a column kernel that sums fixed row chunks.

constexpr int kBwdWarps = 8;
constexpr int kColGroups = 32;  // row groups of the column kernels (x 32 columns per block)

// Blocks per SM the register kernel is built for: 64 registers fit up to 8 values per lane
// without spills (half-precision conversions and Philox included); 16 values need more.
constexpr int nr_bwd_min_blocks(int values_per_lane) { return values_per_lane <= 8 ? 4 : 2; }

template <typename T, int L, int K, bool kTrain>
__global__ void __launch_bounds__(kBwdWarps * 32, nr_bwd_min_blocks(K * qk_vec<T>::N)) nr_bwd_registers(qk_fused_norm_residual_backward_args a,
                                                                   float *partial) {
    constexpr int V = qk_vec<T>::N, RPW = 32 / L, HMAX = L * K * V;
    __shared__ float warp_sums[kBwdWarps][2 * HMAX];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane / L, col = lane % L;
    const int nvec = (int)(a.H / V);
    const T *go = static_cast<const T *>(a.grad_out), *x = static_cast<const T *>(a.x);
    const T *gamma = static_cast<const T *>(a.gamma);
    T *gx = static_cast<T *>(a.grad_x);
    const float inv_h = 1.f / (float)a.H;
    const uint64_t seed = kTrain ? nr_seed(a.seed_ptr, a.seed) : 0;
    const int64_t r0 = a.R * blockIdx.x / gridDim.x, r1 = a.R * (blockIdx.x + 1) / gridDim.x;
    float dg[K][V], db[K][V];  // this lane's column sums: sum g*xhat, sum g
#pragma unroll
    for (int k = 0; k < K; k++)
#pragma unroll
        for (int j = 0; j < V; j++) dg[k][j] = db[k][j] = 0.f;
    // The loop bound is the same for the whole warp (the shuffles need every lane); a group past
    // the block's rows computes on zeros and adds nothing.
    for (int64_t base = r0 + (int64_t)warp * RPW; base < r1; base += (int64_t)kBwdWarps * RPW) {
        const int64_t r = base + sub;
        const bool active = r < r1;
        float v[K][V], g[K][V];
        const float shift = active ? qk_to_float(x[r * a.x_stride[0]]) : 0.f;
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int c = col + L * k;
            if (active && c < nvec) {
                const qk_vec<T> gv = qk_load_vec(go + r * a.go_stride[0] + c * V);
                const qk_vec<T> xv = qk_load_vec(x + r * a.x_stride[0] + c * V);
#pragma unroll
                for (int j = 0; j < V; j++) {
                    g[k][j] = qk_to_float(gv.v[j]);
                    sum += (v[k][j] = qk_to_float(xv.v[j]) - shift);
                }
            } else {
#pragma unroll
                for (int j = 0; j < V; j++) g[k][j] = v[k][j] = 0.f;
            }
        }
        const float mean = group_sum<L>(sum) * inv_h;  // of the shifted values
        float sq = 0.f;
#pragma unroll
        for (int k = 0; k < K; k++)
            if (col + L * k < nvec)
#pragma unroll
                for (int j = 0; j < V; j++) sq += (v[k][j] - mean) * (v[k][j] - mean);
        const float rstd = rsqrtf(group_sum<L>(sq) * inv_h + a.eps);
        float s1 = 0.f, s2 = 0.f;  // sum g*gamma, sum g*gamma*xhat
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int c = col + L * k;
            if (!active || c >= nvec) continue;
            const qk_vec<T> gm = qk_load_vec(gamma + c * V);
            const uint64_t index = (uint64_t)(r * a.H + c * V);  // a multiple of 4: H % V == 0
#pragma unroll
            for (int j0 = 0; j0 < V; j0 += 4) {
                qk_philox_block bits;
                if (kTrain) bits = qk_philox4x32((index + j0) >> 2, seed);
#pragma unroll
                for (int j = j0; j < j0 + 4; j++) {
                    if (kTrain) g[k][j] = bits.v[j - j0] >= a.drop_threshold ? g[k][j] * a.scale : 0.f;
                    const float xh = (v[k][j] - mean) * rstd;
                    v[k][j] = xh;
                    dg[k][j] += g[k][j] * xh;
                    db[k][j] += g[k][j];
                    g[k][j] *= qk_to_float(gm.v[j]);
                    s1 += g[k][j];
                    s2 += g[k][j] * xh;
                }
            }
        }
        s1 = group_sum<L>(s1) * inv_h;
        s2 = group_sum<L>(s2) * inv_h;
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int c = col + L * k;
            if (!active || c >= nvec) continue;
            qk_vec<T> o;
#pragma unroll
            for (int j = 0; j < V; j++) o.v[j] = qk_from_float<T>(rstd * ((g[k][j] - s1) - v[k][j] * s2));
            qk_store_vec(gx + r * a.gx_stride[0] + c * V, o);
        }
    }
    // The warp's groups hold sums of the same columns: add them (a fixed xor tree), then the
    // warps' in warp order.
#pragma unroll
    for (int k = 0; k < K; k++)
#pragma unroll
        for (int j = 0; j < V; j++)
#pragma unroll
            for (int o = L; o < 32; o <<= 1) {
                dg[k][j] += __shfl_xor_sync(0xffffffffu, dg[k][j], o);
                db[k][j] += __shfl_xor_sync(0xffffffffu, db[k][j], o);
            }
    if (sub == 0) {
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int c = col + L * k;
            if (c < nvec)
#pragma unroll
                for (int j = 0; j < V; j++) {
                    warp_sums[warp][c * V + j] = dg[k][j];
                    warp_sums[warp][a.H + c * V + j] = db[k][j];
                }
        }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < 2 * a.H; t += kBwdWarps * 32) {
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < kBwdWarps; w++) s += warp_sums[w][t];
        partial[(int64_t)blockIdx.x * 2 * a.H + t] = s;
    }
}

// Any layout: a warp per row; the row is read from memory once per pass (the re-reads hit L1/L2).
// Each row's mean (of x - x[r, 0]) and rstd go to stats for the column kernel.
template <typename T>
__global__ void __launch_bounds__(kRowsPerBlock * 32) nr_bwd_scalar(qk_fused_norm_residual_backward_args a,
                                                                    float2 *stats) {
    const int lane = threadIdx.x & 31;
    const T *go = static_cast<const T *>(a.grad_out), *x = static_cast<const T *>(a.x);
    const T *gamma = static_cast<const T *>(a.gamma);
    T *gx = static_cast<T *>(a.grad_x);
    const float inv_h = 1.f / (float)a.H;
    const uint64_t seed = a.training ? nr_seed(a.seed_ptr, a.seed) : 0;
    for (int64_t r = (int64_t)blockIdx.x * kRowsPerBlock + (threadIdx.x >> 5); r < a.R;
         r += (int64_t)gridDim.x * kRowsPerBlock) {
        const T *xr = x + r * a.x_stride[0], *gr = go + r * a.go_stride[0];
        const float shift = qk_to_float(xr[0]);
        float sum = 0.f;
        for (int64_t h = lane; h < a.H; h += 32) sum += qk_to_float(xr[h * a.x_stride[1]]) - shift;
        const float mean = warp_sum(sum) * inv_h;  // of the shifted values
        float sq = 0.f;
        for (int64_t h = lane; h < a.H; h += 32) {
            const float dv = (qk_to_float(xr[h * a.x_stride[1]]) - shift) - mean;
            sq += dv * dv;
        }
        const float rstd = rsqrtf(warp_sum(sq) * inv_h + a.eps);
        float s1 = 0.f, s2 = 0.f;
        for (int64_t h = lane; h < a.H; h += 32) {
            float g = qk_to_float(gr[h * a.go_stride[1]]);
            if (a.training) g = qk_dropout_keep(seed, (uint64_t)(r * a.H + h), a.drop_threshold) ? g * a.scale : 0.f;
            g *= qk_to_float(gamma[h * a.gamma_stride]);
            s1 += g;
            s2 += g * (((qk_to_float(xr[h * a.x_stride[1]]) - shift) - mean) * rstd);
        }
        s1 = warp_sum(s1) * inv_h;
        s2 = warp_sum(s2) * inv_h;
        for (int64_t h = lane; h < a.H; h += 32) {
            float g = qk_to_float(gr[h * a.go_stride[1]]);
            if (a.training) g = qk_dropout_keep(seed, (uint64_t)(r * a.H + h), a.drop_threshold) ? g * a.scale : 0.f;
            g *= qk_to_float(gamma[h * a.gamma_stride]);
            const float xh = ((qk_to_float(xr[h * a.x_stride[1]]) - shift) - mean) * rstd;
            gx[r * a.gx_stride[0] + h * a.gx_stride[1]] = qk_from_float<T>(rstd * ((g - s1) - xh * s2));
        }
        if (lane == 0) stats[r] = make_float2(mean, rstd);
    }
}

// The scalar path's column sums: block (column tile of 32, row chunk y) sums g*xhat and g over its
// chunk's rows, kColGroups row groups added in group order, into partial[y].
template <typename T>
__global__ void __launch_bounds__(32 * kColGroups) nr_bwd_column_chunks(qk_fused_norm_residual_backward_args a,
                                                                        const float2 *stats, float *partial) {
    __shared__ float sums[2][kColGroups][33];
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    const int64_t h = (int64_t)blockIdx.x * 32 + tx;
    const int64_t r0 = a.R * blockIdx.y / gridDim.y, r1 = a.R * (blockIdx.y + 1) / gridDim.y;
    const T *go = static_cast<const T *>(a.grad_out), *x = static_cast<const T *>(a.x);
    const uint64_t seed = a.training ? nr_seed(a.seed_ptr, a.seed) : 0;
    float sg = 0.f, sb = 0.f;
    if (h < a.H) {
        for (int64_t r = r0 + ty; r < r1; r += kColGroups) {
            const float2 st = stats[r];
            const T *xr = x + r * a.x_stride[0];
            const float xh = ((qk_to_float(xr[h * a.x_stride[1]]) - qk_to_float(xr[0])) - st.x) * st.y;
            float g = qk_to_float(go[r * a.go_stride[0] + h * a.go_stride[1]]);
            if (a.training) g = qk_dropout_keep(seed, (uint64_t)(r * a.H + h), a.drop_threshold) ? g * a.scale : 0.f;
            sg += g * xh;
            sb += g;
        }
    }
    sums[0][ty][tx] = sg;
    sums[1][ty][tx] = sb;
    __syncthreads();
    if (ty < 2 && h < a.H) {
        float s = 0.f;
        for (int i = 0; i < kColGroups; i++) s += sums[ty][i][tx];
        partial[(int64_t)blockIdx.y * 2 * a.H + ty * a.H + h] = s;
    }
}

// grad_gamma and grad_beta: the nblocks partials [nblocks][2H] added per column in block order
// (kColGroups strided groups of blocks, then the groups in order).  nblocks = 0 (R = 0) writes 0.
template <typename T>
__global__ void __launch_bounds__(32 * kColGroups) nr_bwd_columns(qk_fused_norm_residual_backward_args a,
                                                                  const float *partial, int nblocks) {
    __shared__ float sums[kColGroups][33];
    qk_dependent_wait();  // launched as a dependent of the kernel that writes partial
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    const int64_t c = (int64_t)blockIdx.x * 32 + tx, n = 2 * a.H;  // column c of [grad_gamma, grad_beta]
    float s = 0.f;
    if (c < n) {
#pragma unroll 4
        for (int b = ty; b < nblocks; b += kColGroups) s += __ldcg(partial + (int64_t)b * n + c);
    }
    sums[ty][tx] = s;
    __syncthreads();
    if (ty == 0 && c < n) {
        float t = 0.f;
        for (int i = 0; i < kColGroups; i++) t += sums[i][tx];
        if (c < a.H) static_cast<T *>(a.grad_gamma)[c * a.gg_stride] = qk_from_float<T>(t);
        else static_cast<T *>(a.grad_beta)[(c - a.H) * a.gb_stride] = qk_from_float<T>(t);
    }
}

// (L, K) of the register kernel for this call (lanes per row, 16-byte chunks per lane), or false
// when the layout or H needs the scalar path.  K * V <= 16 values per lane: the lane also keeps
// 2 K V column sums in registers.
template <typename T>
bool nr_bwd_shape(const qk_fused_norm_residual_backward_args *a, int *L, int *K) {
    constexpr int V = qk_vec<T>::N;
    const bool layout = a->H % V == 0 && a->go_stride[1] == 1 && a->x_stride[1] == 1 && a->gx_stride[1] == 1 &&
                        a->gamma_stride == 1 && a->go_stride[0] % V == 0 && a->x_stride[0] % V == 0 &&
                        a->gx_stride[0] % V == 0 && qk_aligned16(a->grad_out) && qk_aligned16(a->x) &&
                        qk_aligned16(a->grad_x) && qk_aligned16(a->gamma);
    if (!layout) return false;
    const int64_t nvec = a->H / V;
    for (int l = 4; l <= 32; l *= 2)
        if (nvec <= l) {
            *L = l;
            *K = 1;
            return true;
        }
    for (int k = 2; k * V <= 16; k *= 2)
        if (nvec <= 32 * k) {
            *L = 32;
            *K = k;
            return true;
        }
    return false;
}

template <typename T, int L, int K>
const void *nr_bwd_pick(bool train) {
    return train ? (const void *)nr_bwd_registers<T, L, K, true> : (const void *)nr_bwd_registers<T, L, K, false>;
}

template <typename T>
const void *nr_bwd_kernel(int L, int K, bool train) {
    if (L == 4) return nr_bwd_pick<T, 4, 1>(train);
    if (L == 8) return nr_bwd_pick<T, 8, 1>(train);
    if (L == 16) return nr_bwd_pick<T, 16, 1>(train);
    if (K == 1) return nr_bwd_pick<T, 32, 1>(train);
    if (K == 2) return nr_bwd_pick<T, 32, 2>(train);
    if constexpr (qk_vec<T>::N == 4) return nr_bwd_pick<T, 32, 4>(train);
    return nullptr;
}

template <typename T>
int nr_bwd_launch(const qk_fused_norm_residual_backward_args *a, cudaStream_t s) {
    qk_fused_norm_residual_backward_args p = *a;
    const int col_blocks = (int)((2 * a->H + 31) / 32);
    if (a->R == 0) {  // the column sums are 0
        const float *none = nullptr;
        int zero = 0;
        void *args[] = {&p, &none, &zero};
        return qk_launch((const void *)nr_bwd_columns<T>, dim3(col_blocks), dim3(32 * kColGroups), 0, s, args);
    }
    int L = 0, K = 0, nblocks;
    const void *kernel = nr_bwd_shape<T>(a, &L, &K) ? nr_bwd_kernel<T>(L, K, a->training != 0) : nullptr;
    size_t partial_bytes, scratch_bytes;
    if (kernel) {
        int sms, per_sm;
        QK_CUDA_TRY((cudaError_t)qk_sm_count(&sms));
        QK_CUDA_TRY((cudaError_t)qk_kernel_residency(kernel, kBwdWarps * 32, 0, &per_sm));
        const int64_t groups = (a->R + kBwdWarps * (32 / L) - 1) / (kBwdWarps * (32 / L));
        nblocks = (int)(groups < (int64_t)sms * per_sm ? groups : (int64_t)sms * per_sm);
        partial_bytes = scratch_bytes = (size_t)nblocks * 2 * (size_t)a->H * sizeof(float);
    } else {
        const int64_t chunks = (a->R + 63) / 64;  // row chunks of >= 64 rows, at most 1024: a function of R
        nblocks = (int)(chunks < 1024 ? chunks : 1024);
        partial_bytes = ((size_t)nblocks * 2 * (size_t)a->H * sizeof(float) + 15) / 16 * 16;
        scratch_bytes = partial_bytes + (size_t)a->R * sizeof(float2);
    }
    char *scratch = nullptr;
    QK_SCRATCH_TRY(a->scratch, scratch_bytes, s, &scratch);
    float *partial = reinterpret_cast<float *>(scratch);
    int status;
    if (kernel) {
        void *args[] = {&p, &partial};
        status = qk_launch(kernel, dim3(nblocks), dim3(kBwdWarps * 32), 0, s, args);
    } else {
        float2 *stats = reinterpret_cast<float2 *>(scratch + partial_bytes);
        void *row_args[] = {&p, &stats};
        status = qk_launch((const void *)nr_bwd_scalar<T>, dim3(qk_grid_for(a->R, kRowsPerBlock, 1 << 30)),
                           dim3(kRowsPerBlock * 32), 0, s, row_args);
        const float2 *cstats = stats;
        void *col_args[] = {&p, &cstats, &partial};
        if (!status)
            status = qk_launch((const void *)nr_bwd_column_chunks<T>, dim3((unsigned)((a->H + 31) / 32), nblocks),
                               dim3(32 * kColGroups), 0, s, col_args);
    }
    const float *cpartial = partial;
    void *args[] = {&p, &cpartial, &nblocks};
    if (!status)
        status = qk_launch_dependent((const void *)nr_bwd_columns<T>, dim3(col_blocks), dim3(32 * kColGroups), 0, s,
                                     args);
    const int freed = qk_scratch_free(a->scratch, scratch, scratch_bytes, s);
    return status ? status : freed;
}

// ---- graph mode -----------------------------------------------------------------------------
//
// batch= given: mean and variance per graph over all its rows and channels (PyG's
// LayerNorm(mode="graph")).  Every graph statistic is a sum over the graph's rows of per-row sums,
// in an order fixed by the data: positions 0 .. R-1 list the rows graph by graph (a sorted batch is
// its own list; an unsorted one is listed by a stable counting sort), one block sums a chunk of
// kChunk positions (a warp per graph that meets the chunk, lanes striding, xor tree), and a graph
// spanning several chunks adds its chunk pieces in chunk order.  No float atomics: the same bits on
// every run.  Sortedness is found on the device: the binary-search kernel returns at once for
// unsorted input and the one-block sort at once for sorted input, and every grid comes from R and
// num_graphs, so a captured CUDA graph replays right for any batch.  A graph's values are shifted
// by its first row's x[., 0] (as the row mode's x[r, 0]), so fp32 row sums lose nothing to a large
// mean.  A row whose id is out of range is in no graph: out = residual, grad_x = 0.

constexpr int kChunk = 128;      // positions per block of the chunk kernels
constexpr int kGraphWarps = 8;   // warps per block of the graph-mode kernels
constexpr int kSortThreads = 256, kSortItems = 4, kTileBits = 10;  // 1024 rows per tile of the sort
constexpr int kStats = 5;        // per graph: shift, mean (of the shifted values), rstd, and the
                                 // backward's mean_g(g*gamma), mean_g(g*gamma*xhat)
enum { kSum = 0, kSquares = 1, kGrads = 2 };

// What the statistic kernels read, from either op's args (go, gamma and the dropout: backward).
struct GraphArgs {
    const void *x, *go, *gamma, *batch;
    int64_t R, H, G;
    int64_t x_stride[2], go_stride[2], gamma_stride, batch_stride;
    float eps, scale;
    uint32_t drop_threshold;
    int training;
    uint64_t seed;
    const int64_t *seed_ptr;
};

struct GraphWork {
    int *unsorted;               // [1]: batch decreases somewhere (set by gn_flag)
    long long *off;              // [G + 1]: graph g holds positions off[g] .. off[g + 1] - 1
    long long *order;            // [R]: the row at each position (unsorted batch only)
    unsigned long long *cursor;  // [G]: the sort's counts, then its write cursors
    double *piece;               // [chunks][2][2]: a chunk's part of the graph that covers its first
                                 // position (0) and of one that runs past its end (1), per value
    double *whole;               // [G][2]: the sums of graphs that lie within one chunk
    float *stat;                 // [G][kStats]
};

template <typename I>
__device__ __forceinline__ long long gn_id(const void *batch, int64_t stride, int64_t r) {
    return (long long)qk_load_index<I>(batch, r, stride);
}

__device__ __forceinline__ int64_t gn_row(const GraphWork &w, bool unsorted, int64_t pos) {
    return unsorted ? (int64_t)w.order[pos] : pos;
}

__device__ __forceinline__ double warp_sum_double(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

struct GnMax {
    __device__ __forceinline__ int operator()(int a, int b) const { return a > b ? a : b; }
};

// unsorted = 1 when some batch[r] < batch[r - 1] (ids out of range included).
template <typename I>
__global__ void __launch_bounds__(256) gn_flag(GraphArgs a, GraphWork w) {
    bool down = false;
    for (int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x + 1; r < a.R; r += (int64_t)gridDim.x * blockDim.x)
        down |= gn_id<I>(a.batch, a.batch_stride, r) < gn_id<I>(a.batch, a.batch_stride, r - 1);
    if (down) atomicOr(w.unsorted, 1);
}

// Sorted batch: off[g] = the first row whose id is >= g (ids out of range sort before graph 0 or
// after the last, outside [off[0], off[G])), and each graph's shift.
template <typename T, typename I>
__global__ void __launch_bounds__(256) gn_bounds(GraphArgs a, GraphWork w) {
    if (*(volatile int *)w.unsorted) return;
    for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g <= a.G; g += (int64_t)gridDim.x * blockDim.x) {
        int64_t lo = 0, hi = a.R;
        while (lo < hi) {
            const int64_t mid = lo + (hi - lo) / 2;
            if (gn_id<I>(a.batch, a.batch_stride, mid) < g) lo = mid + 1;
            else hi = mid;
        }
        w.off[g] = lo;
        if (g < a.G)
            w.stat[g * kStats] = lo < a.R && gn_id<I>(a.batch, a.batch_stride, lo) == g
                                     ? qk_to_float(static_cast<const T *>(a.x)[lo * a.x_stride[0]])
                                     : 0.f;
    }
}

// Unsorted batch, one block: count the rows of each graph (integer atomics), off = the exclusive
// scan of the counts, then tiles of 1024 rows in row order: each tile sorted by (graph, row) in
// shared memory, a run of one graph written at the graph's cursor, the cursor moved on.  Every
// graph's rows land in row order (a stable counting sort).  Rows with ids out of range are left out.
template <typename T, typename I>
__global__ void __launch_bounds__(kSortThreads) gn_sort(GraphArgs a, GraphWork w, int end_bit) {
    constexpr int kTile = kSortThreads * kSortItems;
    using Sort = cub::BlockRadixSort<unsigned long long, kSortThreads, kSortItems>;
    using Scan = cub::BlockScan<long long, kSortThreads>;
    using RunScan = cub::BlockScan<int, kSortThreads>;
    __shared__ union {
        typename Sort::TempStorage sort;
        typename Scan::TempStorage scan;
        typename RunScan::TempStorage run;
    } tmp;
    __shared__ unsigned long long sorted[kTile];
    if (!*(volatile int *)w.unsorted) return;
    const int t = threadIdx.x;
    const long long G = a.G;
    for (long long g = t; g < G; g += kSortThreads) w.cursor[g] = 0;
    __syncthreads();
    for (int64_t r = t; r < a.R; r += kSortThreads) {
        const long long g = gn_id<I>(a.batch, a.batch_stride, r);
        if (g >= 0 && g < G) atomicAdd(w.cursor + g, 1ull);
    }
    __syncthreads();
    long long carry = 0;  // the same in every thread
    for (long long g0 = 0; g0 < G; g0 += kSortThreads) {
        const long long g = g0 + t, count = g < G ? (long long)w.cursor[g] : 0;
        long long before, total;
        Scan(tmp.scan).ExclusiveSum(count, before, total);
        if (g < G) {
            w.off[g] = carry + before;
            w.cursor[g] = (unsigned long long)(carry + before);
        }
        carry += total;
        __syncthreads();  // tmp is reused
    }
    if (t == 0) w.off[G] = carry;
    __syncthreads();
    for (int64_t t0 = 0; t0 < a.R; t0 += kTile) {
        // keys (graph, place in the tile): unique, so the sort's order is the stable one
        unsigned long long key[kSortItems];
#pragma unroll
        for (int i = 0; i < kSortItems; i++) {
            const int j = t * kSortItems + i;
            long long g = t0 + j < a.R ? gn_id<I>(a.batch, a.batch_stride, t0 + j) : G;
            if (g < 0 || g > G) g = G;  // out of range (and past R): sorted last, not placed
            key[i] = (unsigned long long)g << kTileBits | (unsigned)j;
        }
        Sort(tmp.sort).Sort(key, 0, end_bit);  // blocked: thread t holds ranks t * kSortItems + i
#pragma unroll
        for (int i = 0; i < kSortItems; i++) sorted[t * kSortItems + i] = key[i];
        __syncthreads();
        int start[kSortItems];  // the rank where each key's graph run starts
#pragma unroll
        for (int i = 0; i < kSortItems; i++) {
            const int j = t * kSortItems + i;
            start[i] = j == 0 || (sorted[j - 1] >> kTileBits) != (key[i] >> kTileBits) ? j : 0;
        }
        RunScan(tmp.run).InclusiveScan(start, start, GnMax());
#pragma unroll
        for (int i = 0; i < kSortItems; i++) {
            const long long g = (long long)(key[i] >> kTileBits);
            if (g < G)
                w.order[(long long)w.cursor[g] + (t * kSortItems + i - start[i])] =
                    t0 + (long long)(key[i] & (kTile - 1));
        }
        __syncthreads();  // every cursor read before one moves
#pragma unroll
        for (int i = 0; i < kSortItems; i++) {
            const int j = t * kSortItems + i;
            const long long g = (long long)(key[i] >> kTileBits);
            if (g < G && (j == kTile - 1 || (sorted[j + 1] >> kTileBits) != (unsigned long long)g))
                w.cursor[g] += (unsigned long long)(j - start[i] + 1);
        }
        __syncthreads();
    }
    for (long long g = t; g < G; g += kSortThreads)
        w.stat[g * kStats] = w.off[g] < w.off[g + 1]
                                 ? qk_to_float(static_cast<const T *>(a.x)[w.order[w.off[g]] * a.x_stride[0]])
                                 : 0.f;
}

// One block per chunk of kChunk positions: a warp per row computes the row's sum (kSum: of
// x - shift; kSquares: of the squared deviations; kGrads: of g*gamma and g*gamma*xhat), then a warp
// per graph that meets the chunk adds its rows' sums: into whole[g] when the graph lies within the
// chunk, else into the chunk's piece for it.
template <typename T, typename I, int kKind>
__global__ void __launch_bounds__(kGraphWarps * 32) gn_chunks(GraphArgs a, GraphWork w) {
    constexpr int NV = kKind == kGrads ? 2 : 1;
    __shared__ double vals[NV][kChunk];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool unsorted = *(volatile int *)w.unsorted != 0;
    const int64_t p0 = (int64_t)blockIdx.x * kChunk;
    const int64_t q0 = max(p0, (int64_t)w.off[0]), q1 = min(min(p0 + kChunk, a.R), (int64_t)w.off[a.G]);
    if (q0 >= q1) return;  // no graph's rows here
    const T *x = static_cast<const T *>(a.x), *go = static_cast<const T *>(a.go);
    const T *gamma = static_cast<const T *>(a.gamma);
    const uint64_t seed = kKind == kGrads && a.training ? nr_seed(a.seed_ptr, a.seed) : 0;
    for (int64_t i = q0 + warp; i < q1; i += kGraphWarps) {
        const int64_t r = gn_row(w, unsorted, i);
        const float *st = w.stat + gn_id<I>(a.batch, a.batch_stride, r) * kStats;
        const float shift = st[0];
        const T *xr = x + r * a.x_stride[0];
        float s0 = 0.f, s1 = 0.f;
        for (int64_t h = lane; h < a.H; h += 32) {
            const float v = qk_to_float(xr[h * a.x_stride[1]]) - shift;
            if (kKind == kSum) {
                s0 += v;
            } else if (kKind == kSquares) {
                s0 += (v - st[1]) * (v - st[1]);
            } else {
                float g = qk_to_float(go[r * a.go_stride[0] + h * a.go_stride[1]]);
                if (a.training)
                    g = qk_dropout_keep(seed, (uint64_t)(r * a.H + h), a.drop_threshold) ? g * a.scale : 0.f;
                g *= qk_to_float(gamma[h * a.gamma_stride]);
                s0 += g;
                s1 += g * ((v - st[1]) * st[2]);
            }
        }
        s0 = warp_sum(s0);
        if (NV == 2) s1 = warp_sum(s1);
        if (lane == 0) {
            vals[0][i - p0] = s0;
            if (NV == 2) vals[NV - 1][i - p0] = s1;
        }
    }
    __syncthreads();
    // positions are in graph order: the graphs meeting [q0, q1) are those from q0's to (q1 - 1)'s
    const long long g0 = gn_id<I>(a.batch, a.batch_stride, gn_row(w, unsorted, q0));
    const long long g1 = gn_id<I>(a.batch, a.batch_stride, gn_row(w, unsorted, q1 - 1));
    for (long long g = g0 + warp; g <= g1; g += kGraphWarps) {
        const int64_t lo = w.off[g], hi = w.off[g + 1], b0 = max(lo, q0), b1 = min(hi, q1);
        if (b0 >= b1) continue;  // an empty graph (warp-uniform)
#pragma unroll
        for (int k = 0; k < NV; k++) {
            double s = 0;
            for (int64_t i = b0 + lane; i < b1; i += 32) s += vals[k][i - p0];
            s = warp_sum_double(s);
            if (lane == 0) {
                if (lo >= p0 && hi <= p0 + kChunk) w.whole[g * 2 + k] = s;
                else w.piece[((int64_t)blockIdx.x * 2 + (lo <= p0 ? 0 : 1)) * 2 + k] = s;
            }
        }
    }
}

// A warp per graph: the graph's sum (whole, or its chunk pieces in chunk order), then the statistic.
template <int kKind>
__global__ void __launch_bounds__(kGraphWarps * 32) gn_graphs(GraphArgs a, GraphWork w) {
    constexpr int NV = kKind == kGrads ? 2 : 1;
    const int lane = threadIdx.x & 31;
    for (int64_t g = (int64_t)blockIdx.x * kGraphWarps + (threadIdx.x >> 5); g < a.G;
         g += (int64_t)gridDim.x * kGraphWarps) {
        const int64_t lo = w.off[g], hi = w.off[g + 1];
        if (hi <= lo) continue;  // no rows use an empty graph's statistics
        const int64_t c0 = lo / kChunk, c1 = (hi - 1) / kChunk;
        double s[NV];
#pragma unroll
        for (int k = 0; k < NV; k++) {
            if (c0 == c1) {
                s[k] = w.whole[g * 2 + k];
            } else {
                double v = 0;
                for (int64_t c = c0 + lane; c <= c1; c += 32)
                    v += w.piece[(c * 2 + (lo <= c * kChunk ? 0 : 1)) * 2 + k];
                s[k] = warp_sum_double(v);
            }
        }
        const double inv_n = 1.0 / ((double)(hi - lo) * (double)a.H);
        if (lane == 0) {
            float *st = w.stat + g * kStats;
            if (kKind == kSum) {
                st[1] = (float)(s[0] * inv_n);
            } else if (kKind == kSquares) {
                st[2] = (float)(1.0 / sqrt(s[0] * inv_n + (double)a.eps));
            } else {
                st[3] = (float)(s[0] * inv_n);
                st[NV + 2] = (float)(s[NV - 1] * inv_n);
            }
        }
    }
}

// The forward's output, a warp per row.
template <typename T, typename I, bool kTrain>
__global__ void __launch_bounds__(kGraphWarps * 32) gn_out(qk_fused_norm_residual_args a, GraphWork w) {
    const int lane = threadIdx.x & 31;
    const T *x = static_cast<const T *>(a.x), *res = static_cast<const T *>(a.residual);
    const T *gamma = static_cast<const T *>(a.gamma), *beta = static_cast<const T *>(a.beta);
    T *out = static_cast<T *>(a.out);
    const uint64_t seed = kTrain ? nr_seed(a.seed_ptr, a.seed) : 0;
    for (int64_t r = (int64_t)blockIdx.x * kGraphWarps + (threadIdx.x >> 5); r < a.R;
         r += (int64_t)gridDim.x * kGraphWarps) {
        const long long g = gn_id<I>(a.batch, a.batch_stride, r);
        const bool in = g >= 0 && g < a.num_graphs;
        const float *st = w.stat + (in ? g : 0) * kStats;
        const float shift = in ? st[0] : 0.f, mean = in ? st[1] : 0.f, rstd = in ? st[2] : 0.f;
        for (int64_t h = lane; h < a.H; h += 32) {
            float y = in ? ((qk_to_float(x[r * a.x_stride[0] + h * a.x_stride[1]]) - shift) - mean) * rstd *
                                   qk_to_float(gamma[h * a.gamma_stride]) +
                               qk_to_float(beta[h * a.beta_stride])
                         : 0.f;
            if (kTrain) y = qk_dropout_keep(seed, (uint64_t)(r * a.H + h), a.drop_threshold) ? y * a.scale : 0.f;
            out[r * a.out_stride[0] + h * a.out_stride[1]] =
                qk_from_float<T>(y + qk_to_float(res[r * a.res_stride[0] + h * a.res_stride[1]]));
        }
    }
}

// The backward's column sums of g*xhat and g over row chunk blockIdx.y (as nr_bwd_column_chunks).
template <typename T, typename I>
__global__ void __launch_bounds__(32 * kColGroups) gn_column_chunks(qk_fused_norm_residual_backward_args a,
                                                                    GraphWork w, float *partial) {
    __shared__ float sums[2][kColGroups][33];
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    const int64_t h = (int64_t)blockIdx.x * 32 + tx;
    const int64_t r0 = a.R * blockIdx.y / gridDim.y, r1 = a.R * (blockIdx.y + 1) / gridDim.y;
    const T *go = static_cast<const T *>(a.grad_out), *x = static_cast<const T *>(a.x);
    const uint64_t seed = a.training ? nr_seed(a.seed_ptr, a.seed) : 0;
    float sg = 0.f, sb = 0.f;
    if (h < a.H) {
        for (int64_t r = r0 + ty; r < r1; r += kColGroups) {
            const long long g = gn_id<I>(a.batch, a.batch_stride, r);
            if (g < 0 || g >= a.num_graphs) continue;
            const float *st = w.stat + g * kStats;
            const float xh = ((qk_to_float(x[r * a.x_stride[0] + h * a.x_stride[1]]) - st[0]) - st[1]) * st[2];
            float gm = qk_to_float(go[r * a.go_stride[0] + h * a.go_stride[1]]);
            if (a.training) gm = qk_dropout_keep(seed, (uint64_t)(r * a.H + h), a.drop_threshold) ? gm * a.scale : 0.f;
            sg += gm * xh;
            sb += gm;
        }
    }
    sums[0][ty][tx] = sg;
    sums[1][ty][tx] = sb;
    __syncthreads();
    if (ty < 2 && h < a.H) {
        float s = 0.f;
        for (int i = 0; i < kColGroups; i++) s += sums[ty][i][tx];
        partial[(int64_t)blockIdx.y * 2 * a.H + ty * a.H + h] = s;
    }
}

// grad_x, a warp per row.
template <typename T, typename I>
__global__ void __launch_bounds__(kGraphWarps * 32) gn_grad_x(qk_fused_norm_residual_backward_args a, GraphWork w) {
    const int lane = threadIdx.x & 31;
    const T *go = static_cast<const T *>(a.grad_out), *x = static_cast<const T *>(a.x);
    const T *gamma = static_cast<const T *>(a.gamma);
    T *gx = static_cast<T *>(a.grad_x);
    const uint64_t seed = a.training ? nr_seed(a.seed_ptr, a.seed) : 0;
    for (int64_t r = (int64_t)blockIdx.x * kGraphWarps + (threadIdx.x >> 5); r < a.R;
         r += (int64_t)gridDim.x * kGraphWarps) {
        const long long g = gn_id<I>(a.batch, a.batch_stride, r);
        const bool in = g >= 0 && g < a.num_graphs;
        const float *st = w.stat + (in ? g : 0) * kStats;
        for (int64_t h = lane; h < a.H; h += 32) {
            float d = 0.f;
            if (in) {
                const float xh = ((qk_to_float(x[r * a.x_stride[0] + h * a.x_stride[1]]) - st[0]) - st[1]) * st[2];
                float gm = qk_to_float(go[r * a.go_stride[0] + h * a.go_stride[1]]);
                if (a.training)
                    gm = qk_dropout_keep(seed, (uint64_t)(r * a.H + h), a.drop_threshold) ? gm * a.scale : 0.f;
                d = st[2] * ((gm * qk_to_float(gamma[h * a.gamma_stride]) - st[3]) - xh * st[4]);
            }
            gx[r * a.gx_stride[0] + h * a.gx_stride[1]] = qk_from_float<T>(d);
        }
    }
}

size_t gn_align(size_t n) { return (n + 15) / 16 * 16; }

// Scratch of the graph-mode launchers, from the stream-ordered allocator: the GraphWork arrays,
// then (backward) the column partials.
struct GraphScratch {
    size_t off, order, cursor, piece, whole, stat, partial, total;
};

GraphScratch gn_scratch(int64_t R, int64_t G, int64_t chunks, size_t partial_bytes) {
    GraphScratch s;
    s.off = 16;  // after the flag
    s.order = s.off + gn_align((size_t)(G + 1) * sizeof(long long));
    s.cursor = s.order + gn_align((size_t)R * sizeof(long long));
    s.piece = s.cursor + gn_align((size_t)G * sizeof(unsigned long long));
    s.whole = s.piece + gn_align((size_t)chunks * 4 * sizeof(double));
    s.stat = s.whole + gn_align((size_t)G * 2 * sizeof(double));
    s.partial = s.stat + gn_align((size_t)G * kStats * sizeof(float));
    s.total = s.partial + gn_align(partial_bytes);
    return s;
}

GraphWork gn_work(char *base, const GraphScratch &s) {
    GraphWork w;
    w.unsorted = reinterpret_cast<int *>(base);
    w.off = reinterpret_cast<long long *>(base + s.off);
    w.order = reinterpret_cast<long long *>(base + s.order);
    w.cursor = reinterpret_cast<unsigned long long *>(base + s.cursor);
    w.piece = reinterpret_cast<double *>(base + s.piece);
    w.whole = reinterpret_cast<double *>(base + s.whole);
    w.stat = reinterpret_cast<float *>(base + s.stat);
    return w;
}

// The flag, the graphs' positions and the statistics: mean and rstd, and with grads the backward's
// two graph means.
template <typename T, typename I>
int gn_statistics(GraphArgs &ga, GraphWork &w, int64_t chunks, bool grads, cudaStream_t s) {
    int bits = 0;
    for (int64_t g = ga.G; g > 0; g >>= 1) bits++;  // the graph ids and G itself (out of range)
    int end_bit = kTileBits + bits;
    void *args[] = {&ga, &w};
    void *sort_args[] = {&ga, &w, &end_bit};
    const dim3 block(kGraphWarps * 32), graph_grid(qk_grid_for(ga.G, kGraphWarps, 65536));
    int status = (int)cudaMemsetAsync(w.unsorted, 0, sizeof(int), s);
    const dim3 row_grid(qk_grid_for(ga.R, 256, 4096)), bound_grid(qk_grid_for(ga.G + 1, 256));
    if (!status) status = qk_launch((const void *)gn_flag<I>, row_grid, dim3(256), 0, s, args);
    if (!status) status = qk_launch((const void *)gn_bounds<T, I>, bound_grid, dim3(256), 0, s, args);
    if (!status) status = qk_launch((const void *)gn_sort<T, I>, dim3(1), dim3(kSortThreads), 0, s, sort_args);
    if (!status) status = qk_launch((const void *)gn_chunks<T, I, kSum>, dim3((unsigned)chunks), block, 0, s, args);
    if (!status) status = qk_launch((const void *)gn_graphs<kSum>, graph_grid, block, 0, s, args);
    if (!status) status = qk_launch((const void *)gn_chunks<T, I, kSquares>, dim3((unsigned)chunks), block, 0, s, args);
    if (!status) status = qk_launch((const void *)gn_graphs<kSquares>, graph_grid, block, 0, s, args);
    if (grads) {
        if (!status)
            status = qk_launch((const void *)gn_chunks<T, I, kGrads>, dim3((unsigned)chunks), block, 0, s, args);
        if (!status) status = qk_launch((const void *)gn_graphs<kGrads>, graph_grid, block, 0, s, args);
    }
    return status;
}

int64_t gn_chunk_count(int64_t R) { return (R + kChunk - 1) / kChunk; }

template <typename T, typename I>
int gn_forward(const qk_fused_norm_residual_args *a, cudaStream_t s) {
    const int64_t chunks = gn_chunk_count(a->R);
    if (a->num_graphs > 0x7fffffff || chunks > 0x7fffffff) return QK_E_UNSUPPORTED;
    GraphArgs ga = {a->x, nullptr, a->gamma, a->batch, a->R, a->H, a->num_graphs, {a->x_stride[0], a->x_stride[1]},
                    {0, 0}, a->gamma_stride, a->batch_stride, a->eps, a->scale, a->drop_threshold, 0, 0, nullptr};
    const GraphScratch layout = gn_scratch(a->R, a->num_graphs, chunks, 0);
    char *scratch = nullptr;
    QK_SCRATCH_TRY(a->scratch, layout.total, s, &scratch);
    GraphWork w = gn_work(scratch, layout);
    int status = gn_statistics<T, I>(ga, w, chunks, false, s);
    qk_fused_norm_residual_args p = *a;
    void *args[] = {&p, &w};
    if (!status)
        status = qk_launch(a->training ? (const void *)gn_out<T, I, true> : (const void *)gn_out<T, I, false>,
                           dim3(qk_grid_for(a->R, kGraphWarps, 1 << 20)), dim3(kGraphWarps * 32), 0, s, args);
    const int freed = qk_scratch_free(a->scratch, scratch, layout.total, s);
    return status ? status : freed;
}

template <typename T, typename I>
int gn_backward(const qk_fused_norm_residual_backward_args *a, cudaStream_t s) {
    const int64_t chunks = gn_chunk_count(a->R);
    if (a->num_graphs > 0x7fffffff || chunks > 0x7fffffff) return QK_E_UNSUPPORTED;
    GraphArgs ga = {a->x, a->grad_out, a->gamma, a->batch, a->R, a->H, a->num_graphs,
                    {a->x_stride[0], a->x_stride[1]}, {a->go_stride[0], a->go_stride[1]}, a->gamma_stride,
                    a->batch_stride, a->eps, a->scale, a->drop_threshold, a->training, a->seed, a->seed_ptr};
    const int64_t row_chunks = (a->R + 63) / 64;  // as the row mode's column kernel: a function of R
    int nblocks = (int)(row_chunks < 1024 ? row_chunks : 1024);
    const size_t partial_bytes = (size_t)nblocks * 2 * (size_t)a->H * sizeof(float);
    const GraphScratch layout = gn_scratch(a->R, a->num_graphs, chunks, partial_bytes);
    char *scratch = nullptr;
    QK_SCRATCH_TRY(a->scratch, layout.total, s, &scratch);
    GraphWork w = gn_work(scratch, layout);
    float *partial = reinterpret_cast<float *>(scratch + layout.partial);
    int status = gn_statistics<T, I>(ga, w, chunks, true, s);
    qk_fused_norm_residual_backward_args p = *a;
    void *col_args[] = {&p, &w, &partial};
    if (!status)
        status = qk_launch((const void *)gn_column_chunks<T, I>, dim3((unsigned)((a->H + 31) / 32), nblocks),
                           dim3(32 * kColGroups), 0, s, col_args);
    const float *cpartial = partial;
    void *sum_args[] = {&p, &cpartial, &nblocks};
    if (!status)
        status = qk_launch_dependent((const void *)nr_bwd_columns<T>, dim3((unsigned)((2 * a->H + 31) / 32)),
                                     dim3(32 * kColGroups), 0, s, sum_args);
    void *gx_args[] = {&p, &w};
    if (!status)
        status = qk_launch((const void *)gn_grad_x<T, I>, dim3(qk_grid_for(a->R, kGraphWarps, 1 << 20)),
                           dim3(kGraphWarps * 32), 0, s, gx_args);
    const int freed = qk_scratch_free(a->scratch, scratch, layout.total, s);
    return status ? status : freed;
}

}  // namespace

extern "C" int qk_fused_norm_residual_backward_cuda(const qk_fused_norm_residual_backward_args *a, void *stream) {
    if (a->H == 0) return QK_OK;
    if (a->batch && a->R > 0) {
        QK_DISPATCH_FLOAT(a->dtype, T, QK_DISPATCH_INDEX(a->index_dtype, I,
                                                         return gn_backward<T, I>(a, (cudaStream_t)stream);))
        return QK_OK;
    }
    QK_DISPATCH_FLOAT(a->dtype, T, return nr_bwd_launch<T>(a, (cudaStream_t)stream);)
    return QK_OK;
}

extern "C" int qk_fused_norm_residual_cuda(const qk_fused_norm_residual_args *a, void *stream) {
    if (a->R == 0 || a->H == 0) return QK_OK;
    if (a->batch) {
        QK_DISPATCH_FLOAT(a->dtype, T, QK_DISPATCH_INDEX(a->index_dtype, I,
                                                         return gn_forward<T, I>(a, (cudaStream_t)stream);))
        return QK_OK;
    }
    qk_fused_norm_residual_args p = *a;
    void *args[] = {&p};
    // One row per warp (or lane group), no grid-stride loop: faster than a grid-stride grid of 64
    // blocks per SM (docs/graph-ops.md).
    QK_DISPATCH_FLOAT(a->dtype, T, {
        const void *kernel;
        const int K = nr_chunks_per_lane<T>(a), nvec = (int)(a->H / qk_vec<T>::N);
        const int lanes = K ? qk_row_lanes(nvec) : 32;  // K > 1 only past 32 vectors; the scalar kernel: a warp
        const int grid = qk_grid_for(a->R, kRowsPerBlock * (32 / lanes), 1 << 30);
        switch (K) {
        case 1:
            kernel = lanes == 8 ? nr_pick<T, 1, 8>(a->training)
                     : lanes == 16 ? nr_pick<T, 1, 16>(a->training) : nr_pick<T, 1>(a->training);
            break;
        case 2: kernel = nr_pick<T, 2>(a->training); break;
        case 4: kernel = nr_pick<T, 4>(a->training); break;
        case 8: kernel = nr_pick<T, 8>(a->training); break;
        default: kernel = (const void *)nr_scalar<T>;
        }
        return qk_launch(kernel, dim3(grid), dim3(kRowsPerBlock * 32), 0, (cudaStream_t)stream, args);
    })
    return QK_OK;
}
