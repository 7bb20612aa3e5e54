// fused_edge_features: out[e] = cat(x[src]+x[dst], |x[src]-x[dst]|, edge_attr[e]) in one pass.
//
// Work decomposition: one thread per 16-byte chunk of an edge's row (4 fp32 or 8 fp16/bf16
// values): it gathers the chunk of x[src] and x[dst], copies the edge_attr chunk, and writes the
// three output chunks with streaming stores.  Rows that are not 16-byte vectorisable take the
// scalar kernel (any strides).  Bytes: E*(2 idx + 2H gathered + H attr) read, E*3H written
// (fp32 E=4M H=32: 3.2 GB).  An out-of-range index reads as a zero row.
#include "common.cuh"

namespace {

template <typename I>
__device__ __forceinline__ int64_t ef_node(const qk_fused_edge_features_args &a, int row, int64_t e, bool &valid) {
    const int64_t v = qk_load_index<I>(a.edge_index, row * a.ei_stride[0] + e * a.ei_stride[1], 1);
    valid = v >= 0 && v < a.num_nodes;
    return valid ? v : 0;
}

template <typename T, typename I, bool kAttr>
__global__ void __launch_bounds__(256) ef_vector(qk_fused_edge_features_args a) {
    constexpr int V = qk_vec<T>::N;
    const int64_t chunks = a.H / V, total = a.num_edges * chunks;
    const T *x = static_cast<const T *>(a.x);
    T *out = static_cast<T *>(a.out);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t e = i / chunks, c = (i - e * chunks) * V;
        bool sv, dv;
        const int64_t s = ef_node<I>(a, 0, e, sv), d = ef_node<I>(a, 1, e, dv);
        qk_vec<T> xs = qk_load_vec(x + s * a.x_stride[0] + c), xd = qk_load_vec(x + d * a.x_stride[0] + c);
        qk_vec<T> sum, diff;
#pragma unroll
        for (int j = 0; j < V; j++) {
            const float u = sv ? qk_to_float(xs.v[j]) : 0.f, w = dv ? qk_to_float(xd.v[j]) : 0.f;
            sum.v[j] = qk_from_float<T>(u + w);
            diff.v[j] = qk_from_float<T>(fabsf(u - w));
        }
        T *o = out + e * a.out_stride[0] + c;
        qk_store_vec(o, sum);
        qk_store_vec(o + a.H, diff);
        if (kAttr) qk_store_vec(o + 2 * a.H, qk_load_vec(static_cast<const T *>(a.edge_attr) + e * a.ea_stride[0] + c));
    }
}

template <typename T, typename I>
__global__ void __launch_bounds__(256) ef_scalar(qk_fused_edge_features_args a) {
    const int64_t total = a.num_edges * a.H;
    const T *x = static_cast<const T *>(a.x), *ea = static_cast<const T *>(a.edge_attr);
    T *out = static_cast<T *>(a.out);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t e = i / a.H, h = i - e * a.H;
        bool sv, dv;
        const int64_t s = ef_node<I>(a, 0, e, sv), d = ef_node<I>(a, 1, e, dv);
        const float u = sv ? qk_to_float(x[s * a.x_stride[0] + h * a.x_stride[1]]) : 0.f;
        const float w = dv ? qk_to_float(x[d * a.x_stride[0] + h * a.x_stride[1]]) : 0.f;
        T *o = out + e * a.out_stride[0];
        o[h * a.out_stride[1]] = qk_from_float<T>(u + w);
        o[(a.H + h) * a.out_stride[1]] = qk_from_float<T>(fabsf(u - w));
        if (ea) o[(2 * a.H + h) * a.out_stride[1]] = ea[e * a.ea_stride[0] + h * a.ea_stride[1]];
    }
}

template <typename T>
bool ef_vectorisable(const qk_fused_edge_features_args *a) {
    constexpr int V = qk_vec<T>::N;
    const bool attr_ok = !a->edge_attr || (a->ea_stride[1] == 1 && a->ea_stride[0] % V == 0 && qk_aligned16(a->edge_attr));
    return a->H % V == 0 && a->x_stride[1] == 1 && a->out_stride[1] == 1 && a->x_stride[0] % V == 0 &&
           a->out_stride[0] % V == 0 && qk_aligned16(a->x) && qk_aligned16(a->out) && attr_ok;
}

}  // namespace

extern "C" int qk_fused_edge_features_cuda(const qk_fused_edge_features_args *a, void *stream) {
    if (a->num_edges == 0 || a->H == 0) return QK_OK;
    qk_fused_edge_features_args p = *a;
    void *args[] = {&p};
    const dim3 block(256);
    QK_DISPATCH_FLOAT(a->dtype, T, QK_DISPATCH_INDEX(a->index_dtype, I, {
        const void *kernel;
        int grid;
        if (ef_vectorisable<T>(a)) {
            kernel = a->edge_attr ? (const void *)ef_vector<T, I, true> : (const void *)ef_vector<T, I, false>;
            grid = qk_grid_for(a->num_edges * (a->H / qk_vec<T>::N), 256, 132 * 16);
        } else {
            kernel = (const void *)ef_scalar<T, I>;
            grid = qk_grid_for(a->num_edges * a->H, 256, 132 * 16);
        }
        return qk_launch(kernel, dim3(grid), block, 0, (cudaStream_t)stream, args);
    }))
    return QK_OK;
}
