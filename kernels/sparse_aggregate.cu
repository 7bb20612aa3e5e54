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

// acc[k][:] += sum over edges [begin, end) of w[e, head of chunk k] * x[col[e], chunk k], for lane
// `lane` of a group of G lanes holding chunks lane + G*k.
template <typename T, typename I, int K, int G = 32>
__device__ __forceinline__ void accumulate(const qk_sparse_aggregate_args &a, int64_t begin, int64_t end, int lane,
                                           float (&acc)[K][qk_vec<T>::N]) {
    constexpr int V = qk_vec<T>::N;
    const int nvec = (int)(a.num_heads * a.head_dim / V);
    const T *nf = static_cast<const T *>(a.node_feat), *ew = static_cast<const T *>(a.edge_weight);
    int head[K];
#pragma unroll
    for (int k = 0; k < K; k++) head[k] = (int)(((lane + G * k) * V) / a.head_dim);
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
                const int c = lane + G * k;
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

// A group of G lanes per row (G < 32 when H*D is short, so a warp serves 32 / G rows).
template <typename T, typename I, int K, int G>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) sa_rows(qk_sparse_aggregate_args a, const float *partial) {
    constexpr int V = qk_vec<T>::N;
    constexpr int kRowsPerBlock = kWarpsPerBlock * 32 / G;
    const int lane = threadIdx.x % G;
    const int64_t hd = a.num_heads * a.head_dim;
    const int nvec = (int)(hd / V);
    T *out = static_cast<T *>(a.out);
    for (int64_t row = (int64_t)blockIdx.x * kRowsPerBlock + threadIdx.x / G; row < a.num_dst;
         row += (int64_t)gridDim.x * kRowsPerBlock) {
        int64_t begin, end;
        row_range<I>(a, row, begin, end);
        float acc[K][V] = {};
        if (end - begin <= kSplit) {
            accumulate<T, I, K, G>(a, begin, end, lane, acc);
        } else {  // the chunk slots written by sa_long_rows, in chunk order
            for (int64_t c = begin / kSplit; c * kSplit < end; c++) {
                const float *src = partial + (2 * c + (begin <= c * kSplit ? 0 : 1)) * hd;
#pragma unroll
                for (int k = 0; k < K; k++)
                    if (lane + G * k < nvec)
#pragma unroll
                        for (int j = 0; j < V; j++) acc[k][j] += src[(lane + G * k) * V + j];
            }
        }
        qk_store_row<T, G, K>(out + row * a.out_stride[0], acc, lane, nvec);
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
    const size_t partial_bytes = (size_t)(2 * nchunks * hd) * sizeof(float);
    if (a->num_edges > kSplit) {  // only then can a row be long
        QK_SCRATCH_TRY(a->scratch, partial_bytes, s, &partial);
        void *args[] = {&p, &partial};
        const int status = qk_launch((const void *)sa_long_rows<T, I, K>,
                                     dim3(qk_grid_for(nchunks, kWarpsPerBlock, 132 * 32)), dim3(kWarpsPerBlock * 32), 0,
                                     s, args);
        if (status) {
            qk_scratch_free(a->scratch, partial, partial_bytes, s);
            return status;
        }
    }
    const float *cpartial = partial;
    void *args[] = {&p, &cpartial};
    const int lanes = qk_row_lanes(hd / qk_vec<T>::N);  // K > 1 only past 32 vectors: a warp
    const void *rows = (const void *)sa_rows<T, I, K, 32>;
    if (lanes == 16) rows = (const void *)sa_rows<T, I, 1, 16>;
    if (lanes == 8) rows = (const void *)sa_rows<T, I, 1, 8>;
    int status = qk_launch(rows, dim3(qk_grid_for(a->num_dst, kWarpsPerBlock * 32 / lanes, 132 * 64)),
                           dim3(kWarpsPerBlock * 32), 0, s, args);
    if (partial) {
        const int freed = qk_scratch_free(a->scratch, partial, partial_bytes, s);
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

// ---- sparse_aggregate_backward ------------------------------------------------------------------
//
// grad_node_feat (deterministic): the edges are grouped by column (group_sort.cuh: keys col_idx,
// or num_src for an edge outside the rows or with a bad column; values the edge ids), so each
// source's edges come in ascending order.  Each warp then walks `chunk` consecutive sorted
// edges (16 to 256, so that small graphs still fill the GPU; group_sort.cuh): it keeps the current source's [H*D] accumulator in registers as the forward keeps a
// row's, gathers grad_out[row(e)] (several edges in flight), adds edge_weight * grad_out, and
// writes the source's row when its edges end inside the chunk.  A source whose edges cross a
// chunk boundary leaves one fp32 partial per chunk in a workspace slot, and a second kernel adds
// them in chunk order: deterministic, no atomics, every warp's work bounded by `chunk` edges
// however skewed the in-degrees.  grad_edge_weight comes out of the same walk: each gathered
// grad_out row is dotted per head with the source's own node_feat row (loaded beside it, from L1
// after the source's first edge; lane partials, then a fixed shuffle tree), so grad_out is
// gathered once per edge for both.
// Sources without edges are zeroed from a mark array the grouping fills.
// grad_edge_weight alone: warps walk chunks of the CSR edges; the row's grad_out stays in
// registers while its edges' node_feat rows are gathered and dotted.  deterministic=False (fp32)
// uses the same walk to scatter edge_weight * grad_out into grad_node_feat with atomic adds
// instead of grouping.
// Layouts the vector kernels cannot take (odd D, strided rows, H*D over 256 vectors, heads that
// straddle lanes unevenly, 2^32 or more edges) take scalar kernels: one thread per (edge, head) for
// grad_edge_weight, one per output element (binary searches in the sorted keys) for grad_node_feat.
// Bytes (deterministic, both gradients): the grouping reads col_idx and row_ptr once and sorts
// 8-byte pairs; the walk reads E*(H + 3 indices) + E*H*D gathered + N_src*H*D own rows and writes
// E*H + N_src*H*D.  Bad indices are never followed: edges with a column outside [0, N_src) or
// outside the rows get grad_edge_weight 0 and add nothing.

#include "group_sort.cuh"

namespace {

using SabArgs = qk_sparse_aggregate_backward_args;

template <typename I>
__device__ __forceinline__ void sab_bounds(const SabArgs &a, int64_t &lo, int64_t &hi) {
    lo = min(max(qk_load_index<I>(a.row_ptr, 0, a.row_ptr_stride), (int64_t)0), a.num_edges);
    hi = min(max(qk_load_index<I>(a.row_ptr, a.num_dst, a.row_ptr_stride), lo), a.num_edges);
}

// The last row r in [r_lo, r_hi] with row_ptr[r] <= e (row_ptr non-decreasing; any input gives a
// row in range).
template <typename I>
__device__ __forceinline__ int64_t sab_row_search(const SabArgs &a, int64_t e, int64_t r_lo, int64_t r_hi) {
    while (r_lo < r_hi) {
        const int64_t mid = (r_lo + r_hi + 1) / 2;
        if (qk_load_index<I>(a.row_ptr, mid, a.row_ptr_stride) <= e) r_lo = mid;
        else r_hi = mid - 1;
    }
    return r_lo;
}

// p[k]: this lane's partial dot product over its chunk lane + 32k (V values of one head).  gd = D / V
// chunks per head: a power of two up to 32 (the lanes of a head form an aligned group) or a
// multiple of 32 (a head spans gd / 32 whole slices k).  Every lane takes part; the head sums are
// stored to row[h] by one lane each, in a fixed shuffle order.
template <typename T, int K>
__device__ __forceinline__ void sab_store_head_dots(float (&p)[K], int gd, int nvec, int lane, T *row) {
    if (gd <= 32) {
        for (int off = gd >> 1; off > 0; off >>= 1)
#pragma unroll
            for (int k = 0; k < K; k++) p[k] += __shfl_xor_sync(0xffffffffu, p[k], off);
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int c = lane + 32 * k;
            if (c < nvec && (lane & (gd - 1)) == 0) row[c / gd] = qk_from_float<T>(p[k]);
        }
        return;
    }
#pragma unroll
    for (int k = 0; k < K; k++)
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) p[k] += __shfl_xor_sync(0xffffffffu, p[k], off);
    const int slices = gd / 32;
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < K; k++) {
        s += p[k];
        if ((k + 1) % slices == 0) {
            if (lane == 0 && 32 * k < nvec) row[(32 * k) / gd] = qk_from_float<T>(s);
            s = 0.f;
        }
    }
}

template <typename T>
__device__ __forceinline__ void sab_zero_vec(qk_vec<T> &v) {
#pragma unroll
    for (int j = 0; j < qk_vec<T>::N; j++) v.v[j] = qk_from_float<T>(0.f);
}

// CSR walk: warp per `chunk` edges.  kEW: grad_edge_weight of each edge (0 outside the rows or for
// a bad column).  kScatter (fp32 only): atomically adds edge_weight * grad_out[row] into
// grad_node_feat[col] (zeroed beforehand).
template <typename T, typename I, int K, bool kEW, bool kScatter>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) sab_csr(SabArgs a, int chunk) {
    constexpr int V = qk_vec<T>::N;
    constexpr int U = K >= 8 ? 1 : 8 / K;
    const int lane = threadIdx.x & 31;
    const int H = (int)a.num_heads, hd = (int)(a.num_heads * a.head_dim), nvec = hd / V, gd = (int)(a.head_dim / V);
    const int64_t E = a.num_edges, nchunks = (E + chunk - 1) / chunk;
    const T *go = static_cast<const T *>(a.grad_out), *nf = static_cast<const T *>(a.node_feat);
    const T *ew = static_cast<const T *>(a.edge_weight);
    T *gew = static_cast<T *>(a.grad_edge_weight);
    float *gnf = static_cast<float *>(a.grad_node_feat);
    int head[K];
#pragma unroll
    for (int k = 0; k < K; k++) head[k] = (lane + 32 * k) / gd;
    int64_t lo, hi;
    sab_bounds<I>(a, lo, hi);
    for (int64_t ch = (int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5); ch < nchunks;
         ch += (int64_t)gridDim.x * kWarpsPerBlock) {
        const int64_t e0 = ch * chunk, e1 = min(e0 + chunk, E);
        if (kEW && (e0 < lo || e1 > hi))  // edges outside the rows
            for (int64_t i = lane; i < (e1 - e0) * H; i += 32) {
                const int64_t e = e0 + i / H;
                if (e < lo || e >= hi) gew[e0 * H + i] = qk_from_float<T>(0.f);
            }
        const int64_t a0 = max(e0, lo), a1 = min(e1, hi);
        if (a0 >= a1) continue;
        int64_t r = sab_row_search<I>(a, a0, 0, a.num_dst - 1);
        for (int64_t e = a0; e < a1; r++) {
            const int64_t rb = r + 1 >= a.num_dst ? a1
                                                  : min(max(qk_load_index<I>(a.row_ptr, r + 1, a.row_ptr_stride), e), a1);
            if (rb == e) continue;  // an empty row
            float g[K][V];
#pragma unroll
            for (int k = 0; k < K; k++) {
                const int c = lane + 32 * k;
                qk_vec<T> v;
                if (c < nvec) v = qk_load_vec(go + r * a.go_stride[0] + c * V);
                else sab_zero_vec(v);
#pragma unroll
                for (int j = 0; j < V; j++) g[k][j] = qk_to_float(v.v[j]);
            }
            for (int64_t b = e; b < rb; b += U) {
                int64_t col[U];
#pragma unroll
                for (int u = 0; u < U; u++) {
                    col[u] = b + u < rb ? qk_load_index<I>(a.col_idx, b + u, a.col_idx_stride) : -1;
                    if (col[u] >= a.num_src) col[u] = -1;
                }
                qk_vec<T> x[U][K];
                float w[U][K];
#pragma unroll
                for (int u = 0; u < U; u++)
#pragma unroll
                    for (int k = 0; k < K; k++) {
                        const int c = lane + 32 * k;
                        const bool live = col[u] >= 0 && c < nvec;
                        if constexpr (kEW) {
                            if (live) x[u][k] = qk_load_vec(nf + col[u] * a.nf_stride[0] + c * V);
                            else sab_zero_vec(x[u][k]);
                        }
                        if constexpr (kScatter)
                            w[u][k] = live ? qk_to_float(__ldg(ew + (b + u) * a.ew_stride[0] + head[k] * a.ew_stride[1])) : 0.f;
                    }
#pragma unroll
                for (int u = 0; u < U; u++) {
                    if (b + u >= rb) break;
                    if constexpr (kEW) {
                        float p[K];
#pragma unroll
                        for (int k = 0; k < K; k++) {
                            p[k] = 0.f;
#pragma unroll
                            for (int j = 0; j < V; j++) p[k] = fmaf(g[k][j], qk_to_float(x[u][k].v[j]), p[k]);
                        }
                        sab_store_head_dots<T, K>(p, gd, nvec, lane, gew + (b + u) * H);
                    }
                    if constexpr (kScatter) {
                        static_assert(V == 4, "atomic scatter: fp32 only");
                        if (col[u] >= 0)
#pragma unroll
                        for (int k = 0; k < K; k++) {
                            const int c = lane + 32 * k;
                            if (c >= nvec) continue;
                            float *dst = gnf + col[u] * hd + c * V;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
                            atomicAdd(reinterpret_cast<float4 *>(dst),
                                      make_float4(w[u][k] * g[k][0], w[u][k] * g[k][1], w[u][k] * g[k][2], w[u][k] * g[k][3]));
#else
#pragma unroll
                            for (int j = 0; j < V; j++) atomicAdd(dst + j, w[u][k] * g[k][j]);
#endif
                        }
                    }
                }
            }
            e = rb;
        }
    }
}

// Grouping: key col_idx[e] (num_src for an edge outside the rows or with a bad column), value e,
// the row of e, and a mark on each source with an edge.  A warp takes `per_warp` consecutive edges
// (32 to 256: a wave of warps, as the walks): the rows of its first and last edge bound each
// lane's search for the row of its own.
template <typename I, typename U>
__global__ void __launch_bounds__(256)
    sab_prepare(SabArgs a, U *keys, U *edges, U *row_of, uint8_t *marked, int per_warp) {
    const int lane = threadIdx.x & 31;
    int64_t lo, hi;
    sab_bounds<I>(a, lo, hi);
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x >> 5);
    for (int64_t base = ((int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * per_warp; base < a.num_edges;
         base += warps * per_warp) {
        int64_t ra = 0, rb = 0;
        if (lo < hi) {
            ra = sab_row_search<I>(a, min(max(base, lo), hi - 1), 0, a.num_dst - 1);
            rb = sab_row_search<I>(a, min(max(base + per_warp - 1, lo), hi - 1), ra, a.num_dst - 1);
        }
        for (int64_t e = base + lane; e < min(base + per_warp, a.num_edges); e += 32) {
            uint64_t key = (uint64_t)a.num_src, row = 0;
            if (e >= lo && e < hi) {
                const int64_t col = qk_load_index<I>(a.col_idx, e, a.col_idx_stride);
                if (col >= 0 && col < a.num_src) {
                    key = (uint64_t)col;
                    marked[col] = 1;
                }
                row = (uint64_t)sab_row_search<I>(a, e, ra, rb);
            }
            keys[e] = (U)key;
            edges[e] = (U)e;
            row_of[e] = (U)row;
        }
    }
}

// CSC walk over the sorted edges: warp per `chunk` of them.  A source's piece that does not
// both start and end inside the chunk goes to slot 2 * chunk (it continues one from earlier
// chunks) or 2 * chunk + 1 (it starts here and goes on); sab_fixup adds them up.
template <typename T, int K, bool kEW>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    sab_csc(SabArgs a, const uint32_t *keys, const uint32_t *edges, const uint32_t *row_of, float *slots, int chunk,
            int rows_by_pos) {
    constexpr int V = qk_vec<T>::N;
    constexpr int U = kEW ? (K >= 4 ? 1 : 4 / K) : (K >= 8 ? 1 : 8 / K);  // edges in flight, in the register budget
    const int lane = threadIdx.x & 31;
    const int H = (int)a.num_heads, hd = (int)(a.num_heads * a.head_dim), nvec = hd / V, gd = (int)(a.head_dim / V);
    const int64_t M = a.num_edges, nchunks = (M + chunk - 1) / chunk;
    const uint32_t N = (uint32_t)a.num_src;
    const T *go = static_cast<const T *>(a.grad_out), *nf = static_cast<const T *>(a.node_feat);
    const T *ew = static_cast<const T *>(a.edge_weight);
    T *gew = static_cast<T *>(a.grad_edge_weight), *gnf = static_cast<T *>(a.grad_node_feat);
    int head[K];
#pragma unroll
    for (int k = 0; k < K; k++) head[k] = (lane + 32 * k) / gd;
    for (int64_t ch = (int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5); ch < nchunks;
         ch += (int64_t)gridDim.x * kWarpsPerBlock) {
        const int64_t k0 = ch * chunk, k1 = min(k0 + chunk, M);
        uint32_t cur = keys[k0];
        if (!kEW && cur >= N) continue;  // only left-out edges from here on
        bool before = k0 > 0 && keys[k0 - 1] == cur;
        float acc[K][V] = {};
        auto flush = [&](bool after) {
            if (cur >= N) return;
            if (!before && !after) {
                qk_store_row<T, 32, K>(gnf + (int64_t)cur * hd, acc, lane, nvec);
            } else {
                float *slot = slots + (2 * ch + (before ? 0 : 1)) * hd;
#pragma unroll
                for (int k = 0; k < K; k++) {
                    const int c = lane + 32 * k;
                    if (c >= nvec) continue;
#pragma unroll
                    for (int j = 0; j < V; j++) slot[c * V + j] = acc[k][j];
                }
            }
        };
        for (int64_t b = k0; b < k1; b += U) {
            uint32_t key[U], e[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                key[u] = b + u < k1 ? keys[b + u] : N;
                e[u] = b + u < k1 ? edges[b + u] : 0u;
            }
            // kEW: each edge's source row too (an L1 hit after the first of a source), so no load
            // waits on a change of source
            qk_vec<T> g[U][K], own[U][K];
            float w[U][K];
#pragma unroll
            for (int u = 0; u < U; u++) {
                // a plan's entries are checked: an edge or row out of range is never followed
                int64_t row = key[u] < N && e[u] < M ? (int64_t)row_of[rows_by_pos ? b + u : e[u]] : -1;
                if (row >= a.num_dst) row = -1;
#pragma unroll
                for (int k = 0; k < K; k++) {
                    const int c = lane + 32 * k;
                    if (row >= 0 && c < nvec) {
                        g[u][k] = qk_load_vec(go + row * a.go_stride[0] + c * V);
                        w[u][k] = qk_to_float(__ldg(ew + (int64_t)e[u] * a.ew_stride[0] + head[k] * a.ew_stride[1]));
                        if constexpr (kEW) own[u][k] = qk_load_vec(nf + (int64_t)key[u] * a.nf_stride[0] + c * V);
                    } else {
                        sab_zero_vec(g[u][k]);
                        if constexpr (kEW) sab_zero_vec(own[u][k]);
                        w[u][k] = 0.f;
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                if (b + u >= k1) break;
                if (key[u] != cur) {  // the previous source's edges end here
                    flush(false);
                    cur = key[u];
                    before = false;
#pragma unroll
                    for (int k = 0; k < K; k++)
#pragma unroll
                        for (int j = 0; j < V; j++) acc[k][j] = 0.f;
                }
#pragma unroll
                for (int k = 0; k < K; k++)
#pragma unroll
                    for (int j = 0; j < V; j++) acc[k][j] = fmaf(w[u][k], qk_to_float(g[u][k].v[j]), acc[k][j]);
                if (kEW) {  // left-out edges have zero rows here: their gradient is written as 0
                    float p[K];
#pragma unroll
                    for (int k = 0; k < K; k++) {
                        p[k] = 0.f;
#pragma unroll
                        for (int j = 0; j < V; j++) p[k] = fmaf(qk_to_float(g[u][k].v[j]), qk_to_float(own[u][k].v[j]), p[k]);
                    }
                    if (e[u] < M) sab_store_head_dots<T, K>(p, gd, nvec, lane, gew + (int64_t)e[u] * H);
                }
            }
            if (!kEW && cur >= N) break;
        }
        flush(k1 < M && keys[k1] == cur);
    }
}

// Scalar grad_edge_weight: a thread per (edge, head), any strides.
template <typename T, typename I>
__global__ void __launch_bounds__(256) sab_gew_scalar(SabArgs a) {
    const T *go = static_cast<const T *>(a.grad_out), *nf = static_cast<const T *>(a.node_feat);
    T *gew = static_cast<T *>(a.grad_edge_weight);
    int64_t lo, hi;
    sab_bounds<I>(a, lo, hi);
    const int64_t total = a.num_edges * a.num_heads;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t e = i / a.num_heads, h = i - e * a.num_heads;
        float s = 0.f;
        if (e >= lo && e < hi) {
            const int64_t col = qk_load_index<I>(a.col_idx, e, a.col_idx_stride);
            if (col >= 0 && col < a.num_src) {
                const int64_t r = sab_row_search<I>(a, e, 0, a.num_dst - 1);
                const T *g = go + r * a.go_stride[0] + h * a.go_stride[1];
                const T *x = nf + col * a.nf_stride[0] + h * a.nf_stride[1];
                for (int64_t d = 0; d < a.head_dim; d++)
                    s = fmaf(qk_to_float(g[d * a.go_stride[2]]), qk_to_float(x[d * a.nf_stride[2]]), s);
            }
        }
        gew[i] = qk_from_float<T>(s);
    }
}

// Scalar grad_node_feat over the sorted edges: a thread per output element, its source's edges
// found by binary search, summed in order.
template <typename T, typename U>
__global__ void __launch_bounds__(256)
    sab_gnf_scalar(SabArgs a, const U *keys, const U *edges, const U *row_of, int rows_by_pos) {
    const T *go = static_cast<const T *>(a.grad_out), *ew = static_cast<const T *>(a.edge_weight);
    T *gnf = static_cast<T *>(a.grad_node_feat);
    const int64_t D = a.head_dim, hd = a.num_heads * D, total = a.num_src * hd;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t j = i / hd, h = (i - j * hd) / D, d = i - j * hd - h * D;
        const int64_t end = qk_lower_bound(keys, a.num_edges, (uint64_t)j + 1);
        float acc = 0.f;
        for (int64_t k = qk_lower_bound(keys, a.num_edges, (uint64_t)j); k < end; k++) {
            const uint64_t e = (uint64_t)edges[k];
            if (e >= (uint64_t)a.num_edges) continue;  // a plan's entry out of range
            const uint64_t r = (uint64_t)row_of[rows_by_pos ? (uint64_t)k : e];
            if (r >= (uint64_t)a.num_dst) continue;
            acc = fmaf(qk_to_float(ew[(int64_t)e * a.ew_stride[0] + h * a.ew_stride[1]]),
                       qk_to_float(go[(int64_t)r * a.go_stride[0] + h * a.go_stride[1] + d * a.go_stride[2]]), acc);
        }
        gnf[i] = qk_from_float<T>(acc);
    }
}

// Chunks per lane of the vector kernels (1, 2, 4 or 8 16-byte chunks of the H*D values), or 0 for
// the scalar kernels.
template <typename T>
int sab_chunks_per_lane(const SabArgs *a) {
    constexpr int V = qk_vec<T>::N;
    const int64_t D = a->head_dim, hd = a->num_heads * D, gd = D / V;
    const bool layout = D % V == 0 && a->go_stride[2] == 1 && a->go_stride[1] == D && a->go_stride[0] % V == 0 &&
                        a->nf_stride[2] == 1 && a->nf_stride[1] == D && a->nf_stride[0] % V == 0 &&
                        qk_aligned16(a->grad_out) && qk_aligned16(a->node_feat) &&
                        (!a->grad_node_feat || qk_aligned16(a->grad_node_feat));
    const bool heads = gd > 0 && ((gd <= 32 && (gd & (gd - 1)) == 0) || gd % 32 == 0);
    if (!layout || !heads) return 0;
    const int64_t per_lane = (hd / V + 31) / 32;
    for (int k = 1; k <= 8; k *= 2)
        if (per_lane <= k && (gd <= 32 || k % (gd / 32) == 0)) return k;
    return 0;
}

template <typename T, typename I, int K, bool kEW, bool kScatter>
int sab_launch_csr(const SabArgs *a, cudaStream_t s) {
    SabArgs p = *a;
    int chunk = qk_walk_chunk(a->num_edges, 132 * 64);  // a wave of warps
    void *args[] = {&p, &chunk};
    const int64_t nchunks = (a->num_edges + chunk - 1) / chunk;
    return qk_launch((const void *)sab_csr<T, I, K, kEW, kScatter>, dim3(qk_grid_for(nchunks, kWarpsPerBlock)),
                     dim3(kWarpsPerBlock * 32), 0, s, args);
}

// The deterministic grad_node_feat (and grad_edge_weight with it): group, then the vector walk
// (k > 0) or the scalar kernels.
// The walk over grouped entries and its fix-up for k 16-byte chunks a lane.
template <typename T>
void sab_walkers(int k, bool edge_grad, const void **walker, const void **fixer) {
    switch (k) {
#define SAB_CASE(KK)                                                                                          \
    case KK:                                                                                                  \
        *walker = edge_grad ? (const void *)sab_csc<T, KK, true> : (const void *)sab_csc<T, KK, false>;       \
        *fixer = (const void *)qk_walk_fixup<T, 32, KK>;                                                      \
        break;
        SAB_CASE(1)
        SAB_CASE(2)
        SAB_CASE(4)
        SAB_CASE(8)
#undef SAB_CASE
    default: *walker = *fixer = nullptr;  // launching NULL fails with an error, never a wrong answer
    }
}

template <typename T, typename I, typename U>
int sab_grouped(const SabArgs *a, int k, cudaStream_t s) {
    const int64_t E = a->num_edges, hd = a->num_heads * a->head_dim;
    const bool vector = k > 0 && sizeof(U) == 4;
    const int chunk = qk_walk_chunk(E, 132 * 64);  // a wave of warps
    const int64_t nchunks = (E + chunk - 1) / chunk;
    const int end_bit = qk_bit_width((uint64_t)a->num_src);
    size_t temp_bytes = 0;
    cub::DoubleBuffer<U> keys(nullptr, nullptr), edges(nullptr, nullptr);
    QK_CUDA_TRY(qk_sort_pairs<U>(nullptr, temp_bytes, keys, edges, (U)E, end_bit, s));
    qk_scratch_layout plan;
    const size_t items = (size_t)E * sizeof(U);
    const size_t o_keys0 = plan.take(items), o_keys1 = plan.take(items), o_edges0 = plan.take(items),
                 o_edges1 = plan.take(items), o_rows = plan.take(items), o_marked = plan.take((size_t)a->num_src),
                 o_slots = plan.take(vector ? (size_t)(2 * nchunks * hd) * sizeof(float) : 0),
                 o_temp = plan.take(temp_bytes);
    char *base = nullptr;
    QK_SCRATCH_TRY(a->scratch, plan.bytes, s, &base);
    keys = cub::DoubleBuffer<U>((U *)(base + o_keys0), (U *)(base + o_keys1));
    edges = cub::DoubleBuffer<U>((U *)(base + o_edges0), (U *)(base + o_edges1));
    U *row_of = (U *)(base + o_rows);
    uint8_t *marked = (uint8_t *)(base + o_marked);
    SabArgs p = *a;
    int status = (int)cudaMemsetAsync(marked, 0, (size_t)a->num_src, s);
    if (!status) {
        U *k0 = keys.Current(), *e0 = edges.Current();
        int per_warp = chunk < 32 ? 32 : chunk;
        void *args[] = {&p, &k0, &e0, &row_of, &marked, &per_warp};
        status = qk_launch((const void *)sab_prepare<I, U>, dim3(qk_grid_for(E, 8 * per_warp)), dim3(256), 0, s, args);
    }
    if (!status) status = (int)qk_sort_pairs<U>(base + o_temp, temp_bytes, keys, edges, (U)E, end_bit, s);
    const U *sk = keys.Current(), *se = edges.Current(), *sr = row_of;
    if (!status && vector) {
        const uint32_t *k32 = (const uint32_t *)sk, *e32 = (const uint32_t *)se, *r32 = (const uint32_t *)sr;
        float *slots = (float *)(base + o_slots);
        const float *cslots = slots;
        T *gnf = static_cast<T *>(a->grad_node_feat);
        int64_t M = E;
        uint32_t N = (uint32_t)a->num_src;
        int row_elems = (int)hd, ck = chunk, by_pos = 0;
        void *walk[] = {&p, &k32, &e32, &r32, &slots, &ck, &by_pos};
        void *fix[] = {&gnf, &k32, &cslots, &M, &ck, &N, &row_elems};
        const dim3 grid(qk_grid_for(nchunks, kWarpsPerBlock)), block(kWarpsPerBlock * 32);
        const void *walker, *fixer;
        sab_walkers<T>(k, a->grad_edge_weight != nullptr, &walker, &fixer);
        status = qk_launch(walker, grid, block, 0, s, walk);
        if (!status) status = qk_launch(fixer, grid, block, 0, s, fix);
        if (!status) {
            const uint8_t *cmarked = marked;
            int64_t rows = a->num_src, elems = hd;
            void *zero[] = {&gnf, &cmarked, &rows, &elems};
            status = qk_launch((const void *)qk_zero_unmarked<T>, dim3(qk_grid_for(rows, 8, 132 * 16)), dim3(256), 0,
                               s, zero);
        }
    } else if (!status) {
        int by_pos = 0;
        void *args[] = {&p, &sk, &se, &sr, &by_pos};
        status = qk_launch((const void *)sab_gnf_scalar<T, U>, dim3(qk_grid_for(a->num_src * hd, 256, 132 * 16)),
                           dim3(256), 0, s, args);
        if (!status && a->grad_edge_weight) {
            void *gargs[] = {&p};
            status = qk_launch((const void *)sab_gew_scalar<T, I>, dim3(qk_grid_for(E * a->num_heads, 256, 132 * 16)),
                               dim3(256), 0, s, gargs);
        }
    }
    const int freed = qk_scratch_free(a->scratch, base, plan.bytes, s);
    return status ? status : freed;
}

// The same walk over a plan from sparse_aggregate_plan (rows per position): no grouping, and the
// sources without entries zeroed from the plan's segments.  Entries are uint32 views of the int32
// plan, so a negative one reads as out of range and is skipped.
template <typename T, typename I>
int sab_planned(const SabArgs *a, int k, cudaStream_t s) {
    const int64_t E = a->num_edges, hd = a->num_heads * a->head_dim, N = a->num_src;
    const int32_t *ptr = a->plan;
    const uint32_t *keys = (const uint32_t *)(ptr + N + 1), *edges = keys + E, *rows = edges + E;
    SabArgs p = *a;
    int by_pos = 1;
    if (k == 0) {
        void *args[] = {&p, &keys, &edges, &rows, &by_pos};
        int status = qk_launch((const void *)sab_gnf_scalar<T, uint32_t>, dim3(qk_grid_for(N * hd, 256, 132 * 16)),
                               dim3(256), 0, s, args);
        if (!status && a->grad_edge_weight) {
            void *gargs[] = {&p};
            status = qk_launch((const void *)sab_gew_scalar<T, I>, dim3(qk_grid_for(E * a->num_heads, 256, 132 * 16)),
                               dim3(256), 0, s, gargs);
        }
        return status;
    }
    const int chunk = qk_walk_chunk(E, 132 * 64);
    const int64_t nchunks = (E + chunk - 1) / chunk;
    const size_t bytes = (size_t)(2 * nchunks * hd) * sizeof(float);
    float *slots = nullptr;
    QK_SCRATCH_TRY(a->scratch, bytes, s, &slots);
    const float *cslots = slots;
    T *gnf = static_cast<T *>(a->grad_node_feat);
    int64_t M = E;
    uint32_t NN = (uint32_t)N;
    int row_elems = (int)hd, ck = chunk;
    void *walk[] = {&p, &keys, &edges, &rows, &slots, &ck, &by_pos};
    void *fix[] = {&gnf, &keys, &cslots, &M, &ck, &NN, &row_elems};
    const dim3 grid(qk_grid_for(nchunks, kWarpsPerBlock)), block(kWarpsPerBlock * 32);
    const void *walker, *fixer;
    sab_walkers<T>(k, a->grad_edge_weight != nullptr, &walker, &fixer);
    int status = qk_launch(walker, grid, block, 0, s, walk);
    if (!status) status = qk_launch(fixer, grid, block, 0, s, fix);
    if (!status) {
        int64_t nrows = N, elems = hd;
        void *zero[] = {&gnf, &ptr, &nrows, &elems};
        status = qk_launch((const void *)qk_zero_empty<T>, dim3(qk_grid_for(nrows, 8, 132 * 16)), dim3(256), 0, s, zero);
    }
    const int freed = qk_scratch_free(a->scratch, slots, bytes, s);
    return status ? status : freed;
}

}  // namespace

extern "C" int qk_sparse_aggregate_plan_cuda(const qk_sparse_aggregate_plan_args *a, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    if (a->index_dtype != QK_I32 && a->index_dtype != QK_I64) return QK_E_UNSUPPORTED;
    const int64_t E = a->num_edges, N = a->num_src;
    if (E > INT32_MAX || N >= INT32_MAX) return QK_E_UNSUPPORTED;
    const int end_bit = qk_bit_width((uint64_t)N);
    size_t temp_bytes = 0;
    cub::DoubleBuffer<uint32_t> keys(nullptr, nullptr), edges(nullptr, nullptr);
    if (E > 0) QK_CUDA_TRY(qk_sort_pairs<uint32_t>(nullptr, temp_bytes, keys, edges, (uint32_t)E, end_bit, s));
    qk_scratch_layout plan;
    const size_t items = (size_t)E * sizeof(uint32_t);
    const size_t o_keys0 = plan.take(items), o_keys1 = plan.take(items), o_edges0 = plan.take(items),
                 o_edges1 = plan.take(items), o_rows = plan.take(items), o_marked = plan.take(E > 0 ? (size_t)N : 0),
                 o_temp = plan.take(temp_bytes);
    char *base = nullptr;
    if (E > 0) QK_SCRATCH_TRY(a->scratch, plan.bytes, s, &base);
    keys = cub::DoubleBuffer<uint32_t>((uint32_t *)(base + o_keys0), (uint32_t *)(base + o_keys1));
    edges = cub::DoubleBuffer<uint32_t>((uint32_t *)(base + o_edges0), (uint32_t *)(base + o_edges1));
    uint32_t *row_of = (uint32_t *)(base + o_rows);
    uint8_t *marked = (uint8_t *)(base + o_marked);  // written by the shared prepare kernel, unread
    SabArgs p = {};
    p.row_ptr = a->row_ptr, p.col_idx = a->col_idx;
    p.num_dst = a->num_dst, p.num_src = N, p.num_edges = E;
    p.row_ptr_stride = a->row_ptr_stride, p.col_idx_stride = a->col_idx_stride;
    p.index_dtype = a->index_dtype;
    int status = QK_OK;
    if (E > 0) {
        const int chunk = qk_walk_chunk(E, 132 * 64);  // the backward's grouping, step for step
        uint32_t *k0 = keys.Current(), *e0 = edges.Current();
        int per_warp = chunk < 32 ? 32 : chunk;
        void *args[] = {&p, &k0, &e0, &row_of, &marked, &per_warp};
        QK_DISPATCH_INDEX(a->index_dtype, I, {
            status = qk_launch((const void *)sab_prepare<I, uint32_t>, dim3(qk_grid_for(E, 8 * per_warp)), dim3(256), 0,
                               s, args);
        })
        if (!status && end_bit > 0)
            status = (int)qk_sort_pairs<uint32_t>(base + o_temp, temp_bytes, keys, edges, (uint32_t)E, end_bit, s);
    }
    if (!status) status = qk_plan_write_launch(a->plan, keys.Current(), edges.Current(), row_of, E, N, s);
    const int freed = qk_scratch_free(a->scratch, base, plan.bytes, s);
    return status ? status : freed;
}

extern "C" int qk_sparse_aggregate_backward_cuda(const qk_sparse_aggregate_backward_args *a, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    const int64_t E = a->num_edges, hd = a->num_heads * a->head_dim;
    const size_t esize = a->dtype == QK_F32 ? 4 : 2;
    if (!a->grad_edge_weight && !a->grad_node_feat) return QK_OK;
    if (a->dtype != QK_F32 && a->dtype != QK_F16 && a->dtype != QK_BF16) return QK_E_UNSUPPORTED;
    if (a->index_dtype != QK_I32 && a->index_dtype != QK_I64) return QK_E_UNSUPPORTED;
    // Nothing to gather: the gradients that exist are zero.
    if (hd == 0 || E == 0 || a->num_src == 0) {
        if (a->grad_edge_weight)
            QK_CUDA_TRY((cudaError_t)qk_memset_args(a->scratch, a->grad_edge_weight, 0, (size_t)(E * a->num_heads) * esize, s));
        if (a->grad_node_feat)
            QK_CUDA_TRY((cudaError_t)qk_memset_args(a->scratch, a->grad_node_feat, 0, (size_t)(a->num_src * hd) * esize, s));
        return QK_OK;
    }
    QK_DISPATCH_FLOAT(a->dtype, T, QK_DISPATCH_INDEX(a->index_dtype, I, {
        const int k = sab_chunks_per_lane<T>(a);
        if (!a->grad_node_feat) {  // grad_edge_weight alone: no grouping
            SabArgs p = *a;
            void *args[] = {&p};
            switch (k) {
            case 1: return sab_launch_csr<T, I, 1, true, false>(a, s);
            case 2: return sab_launch_csr<T, I, 2, true, false>(a, s);
            case 4: return sab_launch_csr<T, I, 4, true, false>(a, s);
            case 8: return sab_launch_csr<T, I, 8, true, false>(a, s);
            default:
                return qk_launch((const void *)sab_gew_scalar<T, I>, dim3(qk_grid_for(E * a->num_heads, 256, 132 * 16)),
                                 dim3(256), 0, s, args);
            }
        }
        if (a->plan) return sab_planned<T, I>(a, k, s);
        if (!a->deterministic && a->dtype == QK_F32 && k > 0) {  // atomics into a zeroed fp32 grad_node_feat
            QK_CUDA_TRY((cudaError_t)qk_memset_args(a->scratch, a->grad_node_feat, 0, (size_t)(a->num_src * hd) * sizeof(float), s));
            const bool ew = a->grad_edge_weight != nullptr;
            switch (k) {
            case 1: return ew ? sab_launch_csr<float, I, 1, true, true>(a, s) : sab_launch_csr<float, I, 1, false, true>(a, s);
            case 2: return ew ? sab_launch_csr<float, I, 2, true, true>(a, s) : sab_launch_csr<float, I, 2, false, true>(a, s);
            case 4: return ew ? sab_launch_csr<float, I, 4, true, true>(a, s) : sab_launch_csr<float, I, 4, false, true>(a, s);
            default: return ew ? sab_launch_csr<float, I, 8, true, true>(a, s) : sab_launch_csr<float, I, 8, false, true>(a, s);
            }
        }
        if (E < (int64_t)UINT32_MAX && a->num_src < (int64_t)UINT32_MAX) return sab_grouped<T, I, uint32_t>(a, k, s);
        return sab_grouped<T, I, uint64_t>(a, 0, s);
    }))
    return QK_OK;
}
