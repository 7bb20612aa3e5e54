// sparse_aggregate: multi-head CSR SpMM, out[i,h,:] = sum_e edge_weight[e,h] * node_feat[col_idx[e],h,:].
//
// Fast path (node_feat rows of H*D contiguous values, D a multiple of the 16-byte vector, H*D up
// to 1024 fp32 / 2048 fp16-bf16 values): one warp per destination row handles all heads in one
// pass, so col_idx and the edge_weight row are read once per edge, not once per head; each lane
// keeps K 16-byte chunks of the row's accumulator in registers and the edge loop is unrolled by 4
// so 4*K gathers per lane are in flight.  fp32 accumulation.
// Long rows (more than kSplit edges: power-law hubs with 1e5-1e6 edges) would serialise on one
// warp, so the edge array is cut into chunks of kSplit edges; a first kernel sums each chunk's
// share of each long row into a workspace slot (at most two long rows touch a chunk), and the row
// kernel then adds the slots of its long row in chunk order: deterministic, no atomics, and the
// work per warp is bounded by kSplit edges.  Everything is planned on the device from row_ptr
// (CUDA-graph safe).  Other layouts take the scalar kernel: one warp per (row, head).
// Bytes: E*(idx + H*elt) + E*H*D*elt gathered + N_dst*H*D*elt written; the gathers dominate.
// Bad indices never address memory outside the tensors: row ranges are clamped to
// [0, num_edges] and edges whose column lies outside [0, num_src) are skipped.
#include "common.cuh"

namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int64_t kSplit = 512;  // edges per chunk; rows longer than this are split

template <typename I>
__device__ __forceinline__ void row_range(const qk_sparse_aggregate_args &a, int64_t row, int64_t &begin, int64_t &end) {
    begin = qk_load_index<I>(a.row_ptr, row, a.row_ptr_stride);
    end = qk_load_index<I>(a.row_ptr, row + 1, a.row_ptr_stride);
    begin = min(max(begin, (int64_t)0), a.num_edges);
    end = min(max(end, begin), a.num_edges);
}

// acc[k][:] += sum over edges [begin, end) of w[e, head of chunk k] * x[col[e], chunk k]
template <typename T, typename I, int K>
__device__ __forceinline__ void accumulate(const qk_sparse_aggregate_args &a, int64_t begin, int64_t end, int lane,
                                           float (&acc)[K][qk_vec<T>::N]) {
    constexpr int V = qk_vec<T>::N;
    const int nvec = (int)(a.num_heads * a.head_dim / V);
    const T *nf = static_cast<const T *>(a.node_feat), *ew = static_cast<const T *>(a.edge_weight);
    int head[K];
#pragma unroll
    for (int k = 0; k < K; k++) head[k] = (int)(((lane + 32 * k) * V) / a.head_dim);
    constexpr int U = K >= 8 ? 1 : 8 / K;  // edges in flight: U*K gathers per lane, within the register budget
    for (int64_t e0 = begin; e0 < end; e0 += U) {
        int64_t src[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            src[u] = e0 + u < end ? qk_load_index<I>(a.col_idx, e0 + u, a.col_idx_stride) : -1;
            if (src[u] >= a.num_src) src[u] = -1;
        }
        qk_vec<T> xv[U][K];
        float w[U][K];
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int k = 0; k < K; k++) {
                const int c = lane + 32 * k;
                if (src[u] >= 0 && c < nvec) {
                    xv[u][k] = qk_load_vec(nf + src[u] * a.nf_stride[0] + c * V);
                    w[u][k] = qk_to_float(__ldg(ew + (e0 + u) * a.ew_stride[0] + head[k] * a.ew_stride[1]));
                } else {
                    w[u][k] = 0.f;
                }
            }
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int k = 0; k < K; k++)
                if (w[u][k] != 0.f)
#pragma unroll
                    for (int j = 0; j < V; j++) acc[k][j] = fmaf(w[u][k], qk_to_float(xv[u][k].v[j]), acc[k][j]);
    }
}

// Chunk c holds edges [c*kSplit, (c+1)*kSplit).  For each long row meeting it, the chunk's share
// goes to partial[(2c + slot) * H*D]: slot 0 for the row holding the chunk's first edge, slot 1
// for a long row that starts inside the chunk (at most one can).
template <typename T, typename I, int K>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) sa_long_rows(qk_sparse_aggregate_args a, float *partial) {
    constexpr int V = qk_vec<T>::N;
    const int lane = threadIdx.x & 31;
    const int64_t hd = a.num_heads * a.head_dim, nchunks = (a.num_edges + kSplit - 1) / kSplit;
    for (int64_t c = (int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5); c < nchunks;
         c += (int64_t)gridDim.x * kWarpsPerBlock) {
        const int64_t c0 = c * kSplit, c1 = min(c0 + kSplit, a.num_edges);
        // the row holding edge c0: the last row whose start is <= c0 (rows are non-decreasing)
        int64_t lo = 0, hi = a.num_dst;
        while (lo < hi) {
            const int64_t mid = (lo + hi + 1) / 2;
            if (qk_load_index<I>(a.row_ptr, mid, a.row_ptr_stride) <= c0) lo = mid;
            else hi = mid - 1;
        }
        // Rows meeting the chunk, 32 at a time (one per lane); the long ones among them are summed.
        for (int64_t row = lo; row < a.num_dst; row += 32) {
            const int64_t r = row + lane;
            int64_t begin = c1, end = c1;
            if (r < a.num_dst) row_range<I>(a, r, begin, end);
            const bool inside = r < a.num_dst && begin < c1;
            const unsigned inside_mask = __ballot_sync(0xffffffffu, inside);
            for (unsigned m = __ballot_sync(0xffffffffu, inside && end - begin > kSplit); m; m &= m - 1) {
                const int l = __ffs(m) - 1;
                const int64_t b = __shfl_sync(0xffffffffu, begin, l), e = __shfl_sync(0xffffffffu, end, l);
                float acc[K][V] = {};
                accumulate<T, I, K>(a, max(b, c0), min(e, c1), lane, acc);
                float *dst = partial + (2 * c + (b <= c0 ? 0 : 1)) * hd;
#pragma unroll
                for (int k = 0; k < K; k++)
                    if (lane + 32 * k < hd / V)
#pragma unroll
                        for (int j = 0; j < V; j++) dst[(lane + 32 * k) * V + j] = acc[k][j];
            }
            if (inside_mask != 0xffffffffu) break;  // the rows that meet the chunk end among these lanes
        }
    }
}

template <typename T, typename I, int K>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) sa_rows(qk_sparse_aggregate_args a, const float *partial) {
    constexpr int V = qk_vec<T>::N;
    const int lane = threadIdx.x & 31;
    const int64_t hd = a.num_heads * a.head_dim;
    const int nvec = (int)(hd / V);
    T *out = static_cast<T *>(a.out);
    for (int64_t row = (int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5); row < a.num_dst;
         row += (int64_t)gridDim.x * kWarpsPerBlock) {
        int64_t begin, end;
        row_range<I>(a, row, begin, end);
        float acc[K][V] = {};
        if (end - begin <= kSplit) {
            accumulate<T, I, K>(a, begin, end, lane, acc);
        } else {  // the chunk slots written by sa_long_rows, in chunk order
            for (int64_t c = begin / kSplit; c * kSplit < end; c++) {
                const float *src = partial + (2 * c + (begin <= c * kSplit ? 0 : 1)) * hd;
#pragma unroll
                for (int k = 0; k < K; k++)
                    if (lane + 32 * k < nvec)
#pragma unroll
                        for (int j = 0; j < V; j++) acc[k][j] += src[(lane + 32 * k) * V + j];
            }
        }
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int c = lane + 32 * k;
            if (c >= nvec) continue;
            qk_vec<T> o;
#pragma unroll
            for (int j = 0; j < V; j++) o.v[j] = qk_from_float<T>(acc[k][j]);
            qk_store_vec(out + row * a.out_stride[0] + c * V, o);
        }
    }
}

template <typename T, typename I>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) sa_scalar(qk_sparse_aggregate_args a) {
    const int lane = threadIdx.x & 31;
    const int64_t warps = (int64_t)gridDim.x * kWarpsPerBlock;
    const int64_t pairs = a.num_dst * a.num_heads;
    const T *ew = static_cast<const T *>(a.edge_weight), *nf = static_cast<const T *>(a.node_feat);
    T *out = static_cast<T *>(a.out);
    for (int64_t w = (int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5); w < pairs; w += warps) {
        const int64_t row = w / a.num_heads, h = w % a.num_heads;
        int64_t begin, end;
        row_range<I>(a, row, begin, end);
        for (int64_t d0 = 0; d0 < a.head_dim; d0 += 32) {
            const int64_t d = d0 + lane;
            float acc = 0.f;
            for (int64_t e = begin; e < end; ++e) {
                const int64_t src = qk_load_index<I>(a.col_idx, e, a.col_idx_stride);
                if (src < 0 || src >= a.num_src) continue;
                const float wgt = qk_to_float(ew[e * a.ew_stride[0] + h * a.ew_stride[1]]);
                if (d < a.head_dim)
                    acc = fmaf(wgt, qk_to_float(nf[src * a.nf_stride[0] + h * a.nf_stride[1] + d * a.nf_stride[2]]), acc);
            }
            if (d < a.head_dim) out[row * a.out_stride[0] + h * a.out_stride[1] + d * a.out_stride[2]] = qk_from_float<T>(acc);
        }
    }
}

// QKERNELS_CHECK=1: record one bad index (any) as {arg, pos, value}; arg stays -1 when all are valid.
template <typename Index>
__global__ void sparse_aggregate_validate(qk_sparse_aggregate_args a, unsigned long long *bad) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t first = qk_load_index<Index>(a.row_ptr, 0, a.row_ptr_stride);
    const int64_t last = qk_load_index<Index>(a.row_ptr, a.num_dst, a.row_ptr_stride);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i <= a.num_dst; i += stride) {
        const int64_t v = qk_load_index<Index>(a.row_ptr, i, a.row_ptr_stride);
        const bool ok = v >= 0 && v <= a.num_edges &&
                        (i == 0 || v >= qk_load_index<Index>(a.row_ptr, i - 1, a.row_ptr_stride));
        if (!ok && atomicCAS(bad, ~0ull, 0ull) == ~0ull) {
            bad[1] = (unsigned long long)i;
            bad[2] = (unsigned long long)v;
        }
    }
    if (first < 0 || last > a.num_edges || first > last) return;  // reported above
    for (int64_t e = first + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < last; e += stride) {
        const int64_t v = qk_load_index<Index>(a.col_idx, e, a.col_idx_stride);
        if ((v < 0 || v >= a.num_src) && atomicCAS(bad, ~0ull, 1ull) == ~0ull) {
            bad[1] = (unsigned long long)e;
            bad[2] = (unsigned long long)v;
        }
    }
}

// Chunks of 16 bytes per lane the fast path keeps in registers, or 0 when the layout needs the
// scalar kernel.
template <typename T>
int sa_chunks_per_lane(const qk_sparse_aggregate_args *a) {
    constexpr int V = qk_vec<T>::N;
    const int64_t hd = a->num_heads * a->head_dim;
    const bool layout = a->head_dim % V == 0 && a->nf_stride[2] == 1 && a->nf_stride[1] == a->head_dim &&
                        a->nf_stride[0] % V == 0 && a->out_stride[2] == 1 && a->out_stride[1] == a->head_dim &&
                        a->out_stride[0] % V == 0 && qk_aligned16(a->node_feat) && qk_aligned16(a->out);
    if (!layout) return 0;
    const int64_t per_lane = (hd / V + 31) / 32;
    for (int k = 1; k <= 8; k *= 2)
        if (per_lane <= k) return k;
    return 0;
}

template <typename T, typename I, int K>
int sa_launch_fast(const qk_sparse_aggregate_args *a, cudaStream_t s) {
    qk_sparse_aggregate_args p = *a;
    float *partial = nullptr;
    const int64_t hd = a->num_heads * a->head_dim, nchunks = (a->num_edges + kSplit - 1) / kSplit;
    if (a->num_edges > kSplit) {  // only then can a row be long
        QK_CUDA_TRY(cudaMallocAsync((void **)&partial, (size_t)(2 * nchunks * hd) * sizeof(float), s));
        void *args[] = {&p, &partial};
        const int status = qk_launch((const void *)sa_long_rows<T, I, K>,
                                     dim3(qk_grid_for(nchunks, kWarpsPerBlock, 132 * 32)), dim3(kWarpsPerBlock * 32), 0,
                                     s, args);
        if (status) {
            cudaFreeAsync(partial, s);
            return status;
        }
    }
    const float *cpartial = partial;
    void *args[] = {&p, &cpartial};
    int status = qk_launch((const void *)sa_rows<T, I, K>, dim3(qk_grid_for(a->num_dst, kWarpsPerBlock, 132 * 64)),
                           dim3(kWarpsPerBlock * 32), 0, s, args);
    if (partial) {
        const int freed = (int)cudaFreeAsync(partial, s);
        if (!status) status = freed;
    }
    return status;
}

}  // namespace

extern "C" int qk_sparse_aggregate_cuda(const qk_sparse_aggregate_args *a, void *stream) {
    if (a->num_dst == 0 || a->num_heads == 0 || a->head_dim == 0) return QK_OK;
    cudaStream_t s = (cudaStream_t)stream;
    QK_DISPATCH_FLOAT(a->dtype, T, QK_DISPATCH_INDEX(a->index_dtype, I, {
        switch (sa_chunks_per_lane<T>(a)) {
        case 1: return sa_launch_fast<T, I, 1>(a, s);
        case 2: return sa_launch_fast<T, I, 2>(a, s);
        case 4: return sa_launch_fast<T, I, 4>(a, s);
        case 8: return sa_launch_fast<T, I, 8>(a, s);
        default: {
            qk_sparse_aggregate_args p = *a;
            void *args[] = {&p};
            return qk_launch((const void *)sa_scalar<T, I>,
                             dim3(qk_grid_for(a->num_dst * a->num_heads, kWarpsPerBlock)), dim3(kWarpsPerBlock * 32),
                             0, s, args);
        }
        }
    }))
    return QK_OK;
}

extern "C" int qk_sparse_aggregate_check_cuda(qk_sparse_aggregate_args *a, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    unsigned long long *bad = nullptr, host[3];
    QK_CUDA_TRY(cudaMallocAsync((void **)&bad, sizeof host, s));
    cudaError_t e = cudaMemsetAsync(bad, 0xff, sizeof host, s);
    const int grid = qk_grid_for(a->num_dst + 1 > a->num_edges ? a->num_dst + 1 : a->num_edges, 256);
    if (e == cudaSuccess) {
        if (a->index_dtype == QK_I32) sparse_aggregate_validate<int32_t><<<grid, 256, 0, s>>>(*a, bad);
        else sparse_aggregate_validate<int64_t><<<grid, 256, 0, s>>>(*a, bad);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess) e = cudaMemcpyAsync(host, bad, sizeof host, cudaMemcpyDeviceToHost, s);
    cudaFreeAsync(bad, s);
    if (e == cudaSuccess) e = cudaStreamSynchronize(s);  // debug mode only: the host must see the verdict
    if (e != cudaSuccess) return (int)e;
    if (host[0] == ~0ull) return QK_OK;
    a->bad_arg = (int)host[0];
    a->bad_pos = (int64_t)host[1];
    a->bad_value = (int64_t)host[2];
    return QK_E_INDEX;
}
