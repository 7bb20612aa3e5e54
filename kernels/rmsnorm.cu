// rmsnorm and fused_add_rmsnorm: per row, s = x (+ residual) in fp32, residual = s rounded once, out =
// s * rsqrt(sum(s^2) / H + eps) * weight rounded once.  The norm uses the unrounded s (FlashInfer's
// fused_add_rmsnorm computes it so).
//
// Work decomposition (docs/rmsnorm.md):
//   rows:   rows of at most 1024 values whose layout takes 16-byte vectors: a group of G lanes per row
//           (G = 4, 8, 16 or 32, so short rows keep every lane busy), K vectors per lane held in
//           registers as fp32; x and residual are read once, residual is written as soon as its sum
//           is known, the norm after the group's shuffle reduction.
//   block:  longer vectorisable rows: a block of NT threads per row (NT <= 512), K vectors per thread
//           in registers, the reduction through shuffles and shared memory.
//   reread: anything else (rows too long for the registers, H not a multiple of the vector, misaligned
//           or oddly strided tensors): a block per row that sums s^2 in one pass and recomputes s in a
//           second (re-reads from L1/L2).  residual is written only in the second pass, so the
//           recomputed s is the one summed.
// Every reduction runs in a fixed order (deterministic); grids come from shapes only (CUDA-graph safe).
// x and residual are read through the coherent path: out may be x, and residual is written.
// Bytes: rmsnorm reads x and writes out, fused_add_rmsnorm reads x and residual and writes residual and
// out (R*H*2 or R*H*4 elements, plus weight); bf16 R=4096 H=4096 fused: 134 MB.
#include "common.cuh"

namespace {

constexpr int kRowsThreads = 256;  // the rows kernel's block
constexpr int kMaxNT = 1024;  // the reread kernel's block
constexpr int kBlockNT = 512;  // the block kernel's largest block: 128 registers a thread for K = 32 / V
constexpr int kBlockTarget = 128;  // and the block it aims for when there are many rows
constexpr int kManyRowsPerSM = 16;  // many: rows per SM

__device__ __forceinline__ int64_t rn_off(const int64_t (&s)[2], int64_t r, int64_t R1) {
    return (r / R1) * s[0] + (r % R1) * s[1];
}

template <int L>
__device__ __forceinline__ float rn_group_sum(float v) {
#pragma unroll
    for (int o = L / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The sum of v over the block (blockDim.x a multiple of 32), the same value in every thread, in a fixed
// order.  red holds 33 floats; callers __syncthreads before the next call (every thread must have read
// red[32] before it is written again).
__device__ __forceinline__ float rn_block_sum(float v, float *red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = rn_group_sum<32>(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < nwarps ? red[lane] : 0.f;
        t = rn_group_sum<32>(t);
        if (lane == 0) red[32] = t;
    }
    __syncthreads();
    return red[32];
}

__device__ __forceinline__ uint4 rn_load(const void *p) { return *static_cast<const uint4 *>(p); }
__device__ __forceinline__ void rn_store(void *p, uint4 v) { *static_cast<uint4 *>(p) = v; }

// V = 16 / sizeof(T) values of a 16-byte vector as fp32, and back (one rounding each).
template <typename T>
__device__ __forceinline__ void rn_unpack(uint4 raw, float (&f)[qk_vec<T>::N]) {
    const qk_vec<T> v = *reinterpret_cast<const qk_vec<T> *>(&raw);
#pragma unroll
    for (int j = 0; j < qk_vec<T>::N; j++) f[j] = qk_to_float(v.v[j]);
}
template <typename T>
__device__ __forceinline__ uint4 rn_pack(const float (&f)[qk_vec<T>::N]) {
    qk_vec<T> v;
#pragma unroll
    for (int j = 0; j < qk_vec<T>::N; j++) v.v[j] = qk_from_float<T>(f[j]);
    return *reinterpret_cast<const uint4 *>(&v);
}

// The one formula of every kernel (and of the CPU kernel): (s * rstd) * w.
__device__ __forceinline__ float rn_scale(float s, float rstd, float w) { return __fmul_rn(__fmul_rn(s, rstd), w); }
// rsqrt(sum / H + eps): the division rounded as the CPU kernel's
__device__ __forceinline__ float rn_rstd(float sum_sq, float h, float eps) {
    return rsqrtf(__fadd_rn(__fdiv_rn(sum_sq, h), eps));
}

// Load this thread's K vectors of row r (chunk c = first + k * step, valid below nvec) as fp32 sums s and
// write the rounded sums into residual; returns this thread's sum of squares.
template <typename T, int K, bool kAdd>
__device__ __forceinline__ float rn_load_row(const qk_rmsnorm_args &a, int64_t r, int first, int step, int nvec,
                                             float (&s)[K][qk_vec<T>::N]) {
    constexpr int V = qk_vec<T>::N;
    const T *xr = static_cast<const T *>(a.x) + rn_off(a.x_stride, r, a.R1);
    T *rr = kAdd ? static_cast<T *>(a.residual) + rn_off(a.res_stride, r, a.R1) : nullptr;
    uint4 xv[K], rv[K];
    // every load issued before any arithmetic: 2K requests in flight per thread
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int c = first + k * step;
        if (c < nvec) {
            xv[k] = rn_load(xr + (int64_t)c * V);
            if (kAdd) rv[k] = rn_load(rr + (int64_t)c * V);
        }
    }
    float sq = 0.f;
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int c = first + k * step;
        if (c >= nvec) continue;
        rn_unpack<T>(xv[k], s[k]);
        if (kAdd) {
            float rf[V];
            rn_unpack<T>(rv[k], rf);
#pragma unroll
            for (int j = 0; j < V; j++) s[k][j] = __fadd_rn(s[k][j], rf[j]);
            rn_store(rr + (int64_t)c * V, rn_pack<T>(s[k]));
        }
#pragma unroll
        for (int j = 0; j < V; j++) sq = __fmaf_rn(s[k][j], s[k][j], sq);
    }
    return sq;
}

template <typename T, int K>
__device__ __forceinline__ void rn_store_row(const qk_rmsnorm_args &a, int64_t r, int first, int step, int nvec,
                                             const float (&s)[K][qk_vec<T>::N], float rstd) {
    constexpr int V = qk_vec<T>::N;
    T *orow = static_cast<T *>(a.out) + rn_off(a.out_stride, r, a.R1);
    const T *w = static_cast<const T *>(a.weight);
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int c = first + k * step;
        if (c >= nvec) continue;
        float wf[V], o[V];
        rn_unpack<T>(__ldg(reinterpret_cast<const uint4 *>(w + (int64_t)c * V)), wf);
#pragma unroll
        for (int j = 0; j < V; j++) o[j] = rn_scale(s[k][j], rstd, wf[j]);
        __stcs(reinterpret_cast<uint4 *>(orow + (int64_t)c * V), rn_pack<T>(o));
    }
}

// Every kernel here launches as a programmatic dependent (qk_launch_dependent) and starts with
// qk_dependent_enter: early when the grid fits one wave (decode's few rows); with more blocks than SMs
// its resident early CTAs would only wait.

// A row per group of G lanes, K vectors per lane.
template <typename T, int K, int G, bool kAdd>
__global__ void __launch_bounds__(kRowsThreads) rn_rows(qk_rmsnorm_args a, int early) {
    qk_dependent_enter(early);
    constexpr int V = qk_vec<T>::N, kRowsPerBlock = kRowsThreads / G;
    const int lane = threadIdx.x % G, sub = threadIdx.x / G;
    const int nvec = (int)(a.H / V);
    // the loop is uniform over the warp (its shuffles need every lane); a group past R computes nothing
    for (int64_t base = (int64_t)blockIdx.x * kRowsPerBlock; base < a.R; base += (int64_t)gridDim.x * kRowsPerBlock) {
        const int64_t r = base + sub;
        const int n = r < a.R ? nvec : 0;
        float s[K][V];
        const float sq = rn_load_row<T, K, kAdd>(a, r < a.R ? r : 0, lane, G, n, s);
        const float rstd = rn_rstd(rn_group_sum<G>(sq), (float)a.H, a.eps);
        rn_store_row<T, K>(a, r < a.R ? r : 0, lane, G, n, s, rstd);
    }
}

// A row per block of blockDim.x threads, K vectors per thread.
template <typename T, int K, bool kAdd>
__global__ void __launch_bounds__(kBlockNT) rn_block(qk_rmsnorm_args a, int early) {
    qk_dependent_enter(early);
    constexpr int V = qk_vec<T>::N;
    __shared__ float red[33];
    const int nvec = (int)(a.H / V);
    for (int64_t r = blockIdx.x; r < a.R; r += gridDim.x) {
        float s[K][V];
        const float sq = rn_load_row<T, K, kAdd>(a, r, threadIdx.x, blockDim.x, nvec, s);
        const float rstd = rn_rstd(rn_block_sum(sq, red), (float)a.H, a.eps);
        rn_store_row<T, K>(a, r, threadIdx.x, blockDim.x, nvec, s, rstd);
        __syncthreads();  // red[32] read by every thread before the next row's reduction writes red
    }
}

// Element c (kVec: vector c) of row x (+ residual) as fp32 sums.
template <typename T, bool kAdd, bool kVec, int V>
__device__ __forceinline__ void rn_sum_at(const T *xr, const T *rr, int64_t c, float (&s)[V]) {
    if constexpr (kVec) {
        rn_unpack<T>(rn_load(xr + c * V), s);
        if constexpr (kAdd) {
            float rf[V];
            rn_unpack<T>(rn_load(rr + c * V), rf);
#pragma unroll
            for (int j = 0; j < V; j++) s[j] = __fadd_rn(s[j], rf[j]);
        }
    } else {
        s[0] = qk_to_float(xr[c]);
        if constexpr (kAdd) s[0] = __fadd_rn(s[0], qk_to_float(rr[c]));
    }
}

// A row per block, read twice; kVec: 16-byte vectors (H % V == 0 and aligned), else single values.
template <typename T, bool kAdd, bool kVec>
__global__ void __launch_bounds__(kMaxNT) rn_reread(qk_rmsnorm_args a, int early) {
    qk_dependent_enter(early);
    constexpr int V = kVec ? qk_vec<T>::N : 1;
    __shared__ float red[33];
    const int64_t n = a.H / V;
    const T *w = static_cast<const T *>(a.weight);
    for (int64_t r = blockIdx.x; r < a.R; r += gridDim.x) {
        const T *xr = static_cast<const T *>(a.x) + rn_off(a.x_stride, r, a.R1);
        T *rr = kAdd ? static_cast<T *>(a.residual) + rn_off(a.res_stride, r, a.R1) : nullptr;
        T *orow = static_cast<T *>(a.out) + rn_off(a.out_stride, r, a.R1);
        float sq = 0.f;
        for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
            float s[V];
            rn_sum_at<T, kAdd, kVec, V>(xr, rr, c, s);
#pragma unroll
            for (int j = 0; j < V; j++) sq = __fmaf_rn(s[j], s[j], sq);
        }
        const float rstd = rn_rstd(rn_block_sum(sq, red), (float)a.H, a.eps);
        for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
            float s[V], o[V];
            rn_sum_at<T, kAdd, kVec, V>(xr, rr, c, s);
            if constexpr (kVec) {
                float wf[V];
                rn_unpack<T>(__ldg(reinterpret_cast<const uint4 *>(w + c * V)), wf);
#pragma unroll
                for (int j = 0; j < V; j++) o[j] = rn_scale(s[j], rstd, wf[j]);
                if constexpr (kAdd) rn_store(rr + c * V, rn_pack<T>(s));
                __stcs(reinterpret_cast<uint4 *>(orow + c * V), rn_pack<T>(o));
            } else {
                if constexpr (kAdd) rr[c] = qk_from_float<T>(s[0]);
                o[0] = rn_scale(s[0], rstd, qk_to_float(__ldg(w + c * a.w_stride)));
                orow[c] = qk_from_float<T>(o[0]);
            }
        }
        __syncthreads();  // red[32] read by every thread before the next row's reduction writes red
    }
}

// The most vectors a thread holds in registers: 32 fp32 sums.
template <typename T> constexpr int rn_max_k() { return 32 / qk_vec<T>::N; }

template <typename T, bool kAdd>
const void *rn_rows_kernel(int K, int G) {
    constexpr int KM = rn_max_k<T>();
    if (K == 1) {
        switch (G) {
        case 4: return (const void *)rn_rows<T, 1, 4, kAdd>;
        case 8: return (const void *)rn_rows<T, 1, 8, kAdd>;
        case 16: return (const void *)rn_rows<T, 1, 16, kAdd>;
        default: return (const void *)rn_rows<T, 1, 32, kAdd>;
        }
    }
    if (K == 2) return (const void *)rn_rows<T, 2, 32, kAdd>;
    if (K == 4) return (const void *)rn_rows<T, 4, 32, kAdd>;
    return (const void *)rn_rows<T, KM, 32, kAdd>;  // K == 8 exists for float32 only
}

template <typename T, bool kAdd>
const void *rn_block_kernel(int K) {
    constexpr int KM = rn_max_k<T>();
    switch (K) {
    case 1: return (const void *)rn_block<T, 1, kAdd>;
    case 2: return (const void *)rn_block<T, 2, kAdd>;
    case 4: return (const void *)rn_block<T, 4, kAdd>;
    default: return (const void *)rn_block<T, KM, kAdd>;
    }
}

inline int rn_grid(int64_t blocks) { return (int)(blocks < (1LL << 30) ? (blocks > 0 ? blocks : 1) : (1LL << 30)); }

template <typename T>
int rn_launch(const qk_rmsnorm_args *a, cudaStream_t stream) {
    constexpr int V = qk_vec<T>::N, KM = rn_max_k<T>();
    const bool add = a->residual != nullptr;
    bool vec = a->H % V == 0 && a->w_stride == 1 && qk_aligned16(a->x) && qk_aligned16(a->out) &&
               qk_aligned16(a->weight) && (!add || qk_aligned16(a->residual));
    for (int i = 0; i < 2; i++)
        vec = vec && a->x_stride[i] % V == 0 && a->out_stride[i] % V == 0 && (!add || a->res_stride[i] % V == 0);
    const int64_t nvec = a->H / V;
    qk_rmsnorm_args p = *a;
    int sms = 0, early = 0;
    QK_CUDA_TRY((cudaError_t)qk_sm_count(&sms));
    void *args[] = {&p, &early};
    const int variant = a->variant;

    if (vec && nvec <= 32 * KM && variant != QK_RMSNORM_BLOCK && variant != QK_RMSNORM_REREAD) {
        int K = 1, G = 32;
        if (nvec <= 16) G = nvec <= 4 ? 4 : nvec <= 8 ? 8 : 16;
        else while (K * 32 < nvec) K *= 2;
        const void *kernel = add ? rn_rows_kernel<T, true>(K, G) : rn_rows_kernel<T, false>(K, G);
        const int64_t rows_per_block = kRowsThreads / G;
        const int blocks = rn_grid((a->R + rows_per_block - 1) / rows_per_block);
        early = blocks <= sms;
        return qk_launch_dependent(kernel, dim3(blocks), dim3(kRowsThreads), 0, stream, args);
    }
    const int grid = rn_grid(a->R);
    early = grid <= sms;
    if (vec && nvec <= (int64_t)kBlockNT * KM && variant != QK_RMSNORM_REREAD) {
        // Few rows (decode): the widest block, the fewest vectors a thread (latency).  Many rows: up to 4
        // vectors a thread, down to kBlockTarget threads, so that more rows are resident per SM and the
        // loads in flight cover each row's reduction (docs/rmsnorm.md has the figures).
        const bool many = a->R >= (int64_t)kManyRowsPerSM * sms;
        const int kmax = many && KM > 4 ? 4 : KM, target = many ? kBlockTarget : kBlockNT;
        int K = 1;
        while (K < kmax && (nvec + K - 1) / K > target) K *= 2;
        while ((nvec + K - 1) / K > kBlockNT) K *= 2;  // kmax < KM: still at most kBlockNT threads
        int64_t nt = (nvec + K - 1) / K;
        nt = (nt + 31) / 32 * 32;
        const void *kernel = add ? rn_block_kernel<T, true>(K) : rn_block_kernel<T, false>(K);
        return qk_launch_dependent(kernel, dim3(grid), dim3((unsigned)nt), 0, stream, args);
    }
    const int64_t n = vec ? nvec : a->H;
    int64_t nt = n < kMaxNT ? (n + 31) / 32 * 32 : kMaxNT;
    const void *kernel = vec ? (add ? (const void *)rn_reread<T, true, true> : (const void *)rn_reread<T, false, true>)
                             : (add ? (const void *)rn_reread<T, true, false> : (const void *)rn_reread<T, false, false>);
    return qk_launch_dependent(kernel, dim3(grid), dim3((unsigned)nt), 0, stream, args);
}

}  // namespace

extern "C" int qk_rmsnorm_cuda(const qk_rmsnorm_args *a, void *stream) {
    if (a->R <= 0 || a->H <= 0) return QK_OK;
    if (a->R1 <= 0) return QK_E_UNSUPPORTED;
    QK_DISPATCH_FLOAT(a->dtype, T, return rn_launch<T>(a, (cudaStream_t)stream);)
    return QK_OK;
}
