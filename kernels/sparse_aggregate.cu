// sparse_aggregate: multi-head CSR SpMM, out[i,h,:] = sum_e edge_weight[e,h] * node_feat[col_idx[e],h,:].
//
// Work decomposition (the straightforward foundation version): one warp per (row, head), lanes
// across head_dim, edges walked in order with fp32 accumulation; a grid-stride loop over the
// (row, head) pairs keeps the grid a function of the shapes only (CUDA-graph safe).
// Bytes that must move: E*(idx + H*4) + N_src*H*D*4 (each feature row read at least once) +
// N_dst*H*D*4 written.  This version rereads col_idx once per head; the graph-ops issue tunes it.
//
// Bad indices never address memory outside the tensors: row ranges are clamped to
// [0, num_edges] and edges whose column lies outside [0, num_src) are skipped.
#include "common.cuh"

namespace {

constexpr int kWarpsPerBlock = 8;

template <typename Index>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    sparse_aggregate_f32(qk_sparse_aggregate_args a) {
    const int lane = threadIdx.x & 31;
    const int64_t warps = (int64_t)gridDim.x * kWarpsPerBlock;
    const int64_t pairs = a.num_dst * a.num_heads;
    const float *ew = static_cast<const float *>(a.edge_weight);
    const float *nf = static_cast<const float *>(a.node_feat);
    float *out = static_cast<float *>(a.out);
    for (int64_t w = (int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5); w < pairs; w += warps) {
        const int64_t row = w / a.num_heads, h = w % a.num_heads;
        int64_t begin = qk_load_index<Index>(a.row_ptr, row, a.row_ptr_stride);
        int64_t end = qk_load_index<Index>(a.row_ptr, row + 1, a.row_ptr_stride);
        begin = min(max(begin, (int64_t)0), a.num_edges);
        end = min(max(end, begin), a.num_edges);
        for (int64_t d0 = 0; d0 < a.head_dim; d0 += 32) {
            const int64_t d = d0 + lane;
            float acc = 0.f;
            for (int64_t e = begin; e < end; ++e) {
                const int64_t src = qk_load_index<Index>(a.col_idx, e, a.col_idx_stride);
                if (src < 0 || src >= a.num_src) continue;
                const float wgt = __ldg(ew + e * a.ew_stride[0] + h * a.ew_stride[1]);
                if (d < a.head_dim)
                    acc = fmaf(wgt, __ldg(nf + src * a.nf_stride[0] + h * a.nf_stride[1] + d * a.nf_stride[2]), acc);
            }
            if (d < a.head_dim) out[row * a.out_stride[0] + h * a.out_stride[1] + d * a.out_stride[2]] = acc;
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

int grid_for(int64_t work, int per_block) {
    int64_t blocks = (work + per_block - 1) / per_block;
    // Enough blocks to fill any current GPU many times over; the kernels loop beyond that.
    return (int)(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

}  // namespace

extern "C" int qk_sparse_aggregate_cuda(const qk_sparse_aggregate_args *a, void *stream) {
    if (a->dtype != QK_F32) return QK_E_UNSUPPORTED;
    if (a->num_dst == 0 || a->num_heads == 0 || a->head_dim == 0) return QK_OK;
    const int grid = grid_for(a->num_dst * a->num_heads, kWarpsPerBlock);
    const void *kernel;
    switch (a->index_dtype) {
    case QK_I32: kernel = (const void *)sparse_aggregate_f32<int32_t>; break;
    case QK_I64: kernel = (const void *)sparse_aggregate_f32<int64_t>; break;
    default: return QK_E_UNSUPPORTED;
    }
    qk_sparse_aggregate_args params = *a;
    void *args[] = {&params};
    return qk_launch(kernel, dim3(grid), dim3(kWarpsPerBlock * 32), 0, (cudaStream_t)stream, args);
}

extern "C" int qk_sparse_aggregate_check_cuda(qk_sparse_aggregate_args *a, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    unsigned long long *bad = nullptr, host[3];
    QK_CUDA_TRY(cudaMallocAsync((void **)&bad, sizeof host, s));
    cudaError_t e = cudaMemsetAsync(bad, 0xff, sizeof host, s);
    const int grid = grid_for(a->num_dst + 1 > a->num_edges ? a->num_dst + 1 : a->num_edges, 256);
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
