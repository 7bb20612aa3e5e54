// fused_norm_residual: LayerNorm over the last dim, * gamma + beta, dropout, + residual.
//
// Work decomposition: one warp per row.  Rows of up to 1024 values whose rows are 16-byte
// vectorisable stay in registers (K 16-byte chunks per lane), so x is read once: mean, then the
// variance of the deviations from the registers (two-pass), then the output with streaming stores.
// Both passes work on x - x[row, 0]: for a row with mean 1e4 and unit spread the shifted values
// are of unit size, so neither the fp32 sum nor the deviations lose digits to the mean.  Other rows take the scalar kernel, which reads
// the row three times (the re-reads hit L1/L2).  Bytes: read x and residual, write out (R*H*3
// elements, plus gamma/beta once); fp32 R=1M H=128: 1.5 GB.  The dropout mask is
// qk_dropout_keep(seed, r*H + h) from qkernels/philox.h, bit-identical to the CPU kernel's.
#include "common.cuh"
#include "qkernels/philox.h"

namespace {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

constexpr int kRowsPerBlock = 8;

// The dropout seed: the int of the call, or the value of its seed tensor now (so a captured graph
// replays with whatever the tensor holds).
__device__ __forceinline__ uint64_t nr_seed(const int64_t *p, uint64_t seed) {
    return p ? (uint64_t)__ldg(reinterpret_cast<const long long *>(p)) : seed;
}

template <typename T, int K, bool kTrain>
__global__ void __launch_bounds__(kRowsPerBlock * 32) nr_registers(qk_fused_norm_residual_args a) {
    constexpr int V = qk_vec<T>::N;
    const int lane = threadIdx.x & 31;
    const int nvec = (int)(a.H / V);
    const T *x = static_cast<const T *>(a.x), *res = static_cast<const T *>(a.residual);
    const T *gamma = static_cast<const T *>(a.gamma), *beta = static_cast<const T *>(a.beta);
    T *out = static_cast<T *>(a.out);
    const float inv_h = 1.f / (float)a.H;
    const uint64_t seed = kTrain ? nr_seed(a.seed_ptr, a.seed) : 0;
    for (int64_t r = (int64_t)blockIdx.x * kRowsPerBlock + (threadIdx.x >> 5); r < a.R;
         r += (int64_t)gridDim.x * kRowsPerBlock) {
        float v[K][V];
        qk_vec<T> rv[K];
        float sum = 0.f;
        const float shift = qk_to_float(x[r * a.x_stride[0]]);
        // The residual is loaded up front so its latency hides behind the two reductions.
#pragma unroll
        for (int k = 0; k < K; k++)
            if (lane + 32 * k < nvec) rv[k] = qk_load_vec(res + r * a.res_stride[0] + (lane + 32 * k) * V);
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int c = lane + 32 * k;
            if (c < nvec) {
                const qk_vec<T> xv = qk_load_vec(x + r * a.x_stride[0] + c * V);
#pragma unroll
                for (int j = 0; j < V; j++) sum += (v[k][j] = qk_to_float(xv.v[j]) - shift);
            }
        }
        const float mean = warp_sum(sum) * inv_h;  // of the shifted values
        float sq = 0.f;
#pragma unroll
        for (int k = 0; k < K; k++)
            if (lane + 32 * k < nvec)
#pragma unroll
                for (int j = 0; j < V; j++) sq += (v[k][j] - mean) * (v[k][j] - mean);
        const float rstd = rsqrtf(warp_sum(sq) * inv_h + a.eps);
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int c = lane + 32 * k;
            if (c >= nvec) continue;
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

template <typename T, int K>
const void *nr_pick(bool train) {
    return train ? (const void *)nr_registers<T, K, true> : (const void *)nr_registers<T, K, false>;
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

// The sum over each aligned group of L lanes (every lane of the warp takes part).
template <int L>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = L / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

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
    QK_CUDA_TRY(cudaMallocAsync((void **)&scratch, scratch_bytes, s));
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
    const int freed = (int)cudaFreeAsync(scratch, s);
    return status ? status : freed;
}

}  // namespace

extern "C" int qk_fused_norm_residual_backward_cuda(const qk_fused_norm_residual_backward_args *a, void *stream) {
    if (a->H == 0) return QK_OK;
    QK_DISPATCH_FLOAT(a->dtype, T, return nr_bwd_launch<T>(a, (cudaStream_t)stream);)
    return QK_OK;
}

extern "C" int qk_fused_norm_residual_cuda(const qk_fused_norm_residual_args *a, void *stream) {
    if (a->R == 0 || a->H == 0) return QK_OK;
    qk_fused_norm_residual_args p = *a;
    void *args[] = {&p};
    // One row per warp, no grid-stride loop: faster than a grid-stride grid of 64 blocks per SM
    // (docs/graph-ops.md).
    const int grid = qk_grid_for(a->R, kRowsPerBlock, 1 << 30);
    QK_DISPATCH_FLOAT(a->dtype, T, {
        const void *kernel;
        switch (nr_chunks_per_lane<T>(a)) {
        case 1: kernel = nr_pick<T, 1>(a->training); break;
        case 2: kernel = nr_pick<T, 2>(a->training); break;
        case 4: kernel = nr_pick<T, 4>(a->training); break;
        case 8: kernel = nr_pick<T, 8>(a->training); break;
        default: kernel = (const void *)nr_scalar<T>;
        }
        return qk_launch(kernel, dim3(grid), dim3(kRowsPerBlock * 32), 0, (cudaStream_t)stream, args);
    })
    return QK_OK;
}
