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

// ---- fused_edge_features_backward ---------------------------------------------------------------
//
// grad_x, deterministically: the 2E incidences (item 2e + side: side 0 at src, 1 at dst) are
// grouped by node (group_sort.cuh), so each node sees its incidences in (edge, side) order.
// Groups of G lanes (G = 8, 16 or 32 by H, so small H does not idle most of a warp) then walk
// `chunk` consecutive sorted incidences each (16 to 256, so that small graphs still fill
// the GPU; group_sort.cuh): the node's fp32 accumulator stays in registers,
// and each incidence gathers the grad_out row's g_sum and g_abs and both ends' x rows (several in
// flight; the node's own row comes from L1 after its first incidence) and adds
// g_sum + sign(x[n] - x[other]) * g_abs, which is
// g_sum + s * g_abs at the source and g_sum - s * g_abs at the destination.  A node whose
// incidences cross a chunk boundary leaves fp32 partials in workspace slots that a second kernel
// adds in chunk order (as sparse_aggregate_backward does); nodes without incidences are zeroed from
// the grouping's marks.  grad_edge_attr is grad_out's last H columns, copied 16 bytes a thread.
// Layouts the vector kernels cannot take, H beyond 128 vectors or 2^32 incidences take a scalar
// kernel (a thread per element of grad_x, binary searches in the sorted keys).
// Bytes: the grouping reads edge_index once and sorts 2E 8-byte pairs; the walk reads per
// incidence an index, 2H of grad_out and H of x; grad_x written once.  An out-of-range index never
// addresses memory: its incidence is left out, and as the other end it reads as a zero row.

#include "group_sort.cuh"

namespace {

using EfbArgs = qk_fused_edge_features_backward_args;

// sign(d) with sign(0) = 0, and 0 for NaN as torch.sign (torch's abs backward) gives
__device__ __forceinline__ float efb_sign(float d) { return (float)((d > 0.f) - (d < 0.f)); }

template <typename I>
__device__ __forceinline__ int64_t efb_node(const EfbArgs &a, int64_t side, int64_t e) {
    const int64_t v = qk_load_index<I>(a.edge_index, side * a.ei_stride[0] + e * a.ei_stride[1], 1);
    return v >= 0 && v < a.num_nodes ? v : -1;
}

template <typename I, typename U>
__global__ void __launch_bounds__(256) efb_prepare(EfbArgs a, U *keys, U *items, uint8_t *marked) {
    const int64_t m = 2 * a.num_edges;
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < m; k += (int64_t)gridDim.x * blockDim.x) {
        const int64_t node = efb_node<I>(a, k & 1, k >> 1);
        if (node >= 0) marked[node] = 1;
        keys[k] = (U)(node >= 0 ? node : a.num_nodes);
        items[k] = (U)k;
    }
}

// Groups of G lanes (K 16-byte chunks per lane when G = 32) walk `chunk` sorted incidences each.
// A node's piece that does not both start and end in the chunk goes to slot 2 * chunk (it
// continues from earlier chunks) or 2 * chunk + 1 (it starts here and goes on).
template <typename T, typename I, int G, int K>
__global__ void __launch_bounds__(256) efb_walk(EfbArgs a, const uint32_t *keys, const uint32_t *items, float *slots, int chunk) {
    constexpr int V = qk_vec<T>::N;
    constexpr int U = 4 / K;  // incidences in flight: 3U K 16-byte gathers per lane
    const int lane = threadIdx.x % G;
    const int H = (int)a.H, nvec = H / V;
    const int64_t M = 2 * a.num_edges, nchunks = (M + chunk - 1) / chunk;
    const int64_t groups = (int64_t)gridDim.x * (blockDim.x / G);
    const uint32_t N = (uint32_t)a.num_nodes;
    const T *x = static_cast<const T *>(a.x), *go = static_cast<const T *>(a.grad_out);
    T *gx = static_cast<T *>(a.grad_x);
    for (int64_t ch = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / G; ch < nchunks; ch += groups) {
        const int64_t k0 = ch * chunk, k1 = min(k0 + chunk, M);
        uint32_t cur = keys[k0];
        if (cur >= N) continue;  // only left-out incidences from here on
        bool before = k0 > 0 && keys[k0 - 1] == cur;
        float acc[K][V];
        auto start = [&]() {
#pragma unroll
            for (int k = 0; k < K; k++)
#pragma unroll
                for (int j = 0; j < V; j++) acc[k][j] = 0.f;
        };
        auto flush = [&](bool after) {
            if (!before && !after) {
                qk_store_row<T, G, K>(gx + (int64_t)cur * H, acc, lane, nvec);
            } else {
                float *slot = slots + (2 * ch + (before ? 0 : 1)) * H;
#pragma unroll
                for (int k = 0; k < K; k++) {
                    const int c = lane + G * k;
                    if (c < nvec)
#pragma unroll
                        for (int j = 0; j < V; j++) slot[c * V + j] = acc[k][j];
                }
            }
        };
        start();
        bool done = false;
        for (int64_t b = k0; b < k1 && !done; b += U) {
            uint32_t key[U];
            // each incidence's own row too (an L1 hit after the first of a node): no load waits
            // on a change of node
            qk_vec<T> gs[U][K], ga[U][K], xo[U][K], xs[U][K];
#pragma unroll
            for (int u = 0; u < U; u++) {
                key[u] = b + u < k1 ? keys[b + u] : N;
                int64_t e = -1, other = -1;
                const uint32_t item = key[u] < N ? items[b + u] : 0u;
                if (key[u] < N && item < M) {  // a plan's item out of range is never followed
                    e = item >> 1;
                    other = efb_node<I>(a, 1 - (item & 1), e);
                }
#pragma unroll
                for (int k = 0; k < K; k++) {
                    const int c = lane + G * k;
                    if (e >= 0 && c < nvec) {
                        gs[u][k] = qk_load_vec(go + e * a.go_stride[0] + c * V);
                        ga[u][k] = qk_load_vec(go + e * a.go_stride[0] + H + c * V);
                        xs[u][k] = qk_load_vec(x + (int64_t)key[u] * a.x_stride[0] + c * V);
                    } else {
#pragma unroll
                        for (int j = 0; j < V; j++)
                            gs[u][k].v[j] = ga[u][k].v[j] = xs[u][k].v[j] = qk_from_float<T>(0.f);
                    }
                    if (other >= 0 && c < nvec) {
                        xo[u][k] = qk_load_vec(x + other * a.x_stride[0] + c * V);
                    } else {
#pragma unroll
                        for (int j = 0; j < V; j++) xo[u][k].v[j] = qk_from_float<T>(0.f);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                if (b + u >= k1) break;
                if (key[u] != cur) {  // the previous node's incidences end here
                    flush(false);
                    cur = key[u];
                    if (cur >= N) {
                        done = true;
                        break;
                    }
                    before = false;
                    start();
                }
#pragma unroll
                for (int k = 0; k < K; k++)
#pragma unroll
                    for (int j = 0; j < V; j++)
                        acc[k][j] += qk_to_float(gs[u][k].v[j]) +
                                     efb_sign(qk_to_float(xs[u][k].v[j]) - qk_to_float(xo[u][k].v[j])) *
                                         qk_to_float(ga[u][k].v[j]);
            }
        }
        if (!done) flush(k1 < M && keys[k1] == cur);
    }
}

// Scalar grad_x: a thread per element, its node's incidences found by binary search, in order.
template <typename T, typename I, typename U>
__global__ void __launch_bounds__(256) efb_scalar(EfbArgs a, const U *keys, const U *items) {
    const T *x = static_cast<const T *>(a.x), *go = static_cast<const T *>(a.grad_out);
    T *gx = static_cast<T *>(a.grad_x);
    const int64_t M = 2 * a.num_edges, total = a.num_nodes * a.H;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t n = i / a.H, h = i - n * a.H;
        const float xs = qk_to_float(x[n * a.x_stride[0] + h * a.x_stride[1]]);
        const int64_t end = qk_lower_bound(keys, M, (uint64_t)n + 1);
        float acc = 0.f;
        for (int64_t k = qk_lower_bound(keys, M, (uint64_t)n); k < end; k++) {
            if ((uint64_t)items[k] >= (uint64_t)M) continue;  // a plan's item out of range
            const int64_t item = (int64_t)items[k], e = item >> 1, other = efb_node<I>(a, 1 - (item & 1), e);
            const float xo = other >= 0 ? qk_to_float(x[other * a.x_stride[0] + h * a.x_stride[1]]) : 0.f;
            const T *g = go + e * a.go_stride[0];
            acc += qk_to_float(g[h * a.go_stride[1]]) + efb_sign(xs - xo) * qk_to_float(g[(a.H + h) * a.go_stride[1]]);
        }
        gx[i] = qk_from_float<T>(acc);
    }
}

// grad_edge_attr = grad_out[:, 2H:], 16 bytes a thread (rows of a few hundred bytes: a pitched
// cudaMemcpy2DAsync moves them several times slower).
template <typename T>
__global__ void __launch_bounds__(256) efb_copy_attr_vec(EfbArgs a) {
    constexpr int V = qk_vec<T>::N;
    const T *go = static_cast<const T *>(a.grad_out);
    T *gea = static_cast<T *>(a.grad_edge_attr);
    const int64_t nvec = a.H / V, total = a.num_edges * nvec;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t e = i / nvec, c = i - e * nvec;
        qk_store_vec(gea + e * a.H + c * V, qk_load_vec(go + e * a.go_stride[0] + 2 * a.H + c * V));
    }
}

// grad_edge_attr = grad_out[:, 2H:] for any strides.
template <typename T>
__global__ void __launch_bounds__(256) efb_copy_attr(EfbArgs a) {
    const T *go = static_cast<const T *>(a.grad_out);
    T *gea = static_cast<T *>(a.grad_edge_attr);
    const int64_t total = a.num_edges * a.H;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t e = i / a.H, h = i - e * a.H;
        gea[i] = go[e * a.go_stride[0] + (2 * a.H + h) * a.go_stride[1]];
    }
}

// Lanes per group G and 16-byte chunks per lane K of the vector walk; G = 0: the scalar kernel.
template <typename T>
void efb_shape(const EfbArgs *a, int &G, int &K) {
    constexpr int V = qk_vec<T>::N;
    G = K = 0;
    const bool layout = a->H % V == 0 && a->x_stride[1] == 1 && a->x_stride[0] % V == 0 && a->go_stride[1] == 1 &&
                        a->go_stride[0] % V == 0 && qk_aligned16(a->x) && qk_aligned16(a->grad_out) &&
                        qk_aligned16(a->grad_x) && 2 * a->num_edges < (int64_t)UINT32_MAX &&
                        a->num_nodes < (int64_t)UINT32_MAX;
    const int64_t nvec = a->H / V;
    if (!layout || nvec > 128) return;
    G = qk_row_lanes(nvec);
    K = nvec <= 32 ? 1 : nvec <= 64 ? 2 : 4;
}

// The walk and its fix-up for groups of G lanes with K chunks a lane (G < 32: K = 1).
template <typename T, typename I>
void efb_walkers(int G, int K, const void **walker, const void **fixer) {
    if (G == 8) {
        *walker = (const void *)efb_walk<T, I, 8, 1>;
        *fixer = (const void *)qk_walk_fixup<T, 8, 1>;
    } else if (G == 16) {
        *walker = (const void *)efb_walk<T, I, 16, 1>;
        *fixer = (const void *)qk_walk_fixup<T, 16, 1>;
    } else if (K == 1) {
        *walker = (const void *)efb_walk<T, I, 32, 1>;
        *fixer = (const void *)qk_walk_fixup<T, 32, 1>;
    } else if (K == 2) {
        *walker = (const void *)efb_walk<T, I, 32, 2>;
        *fixer = (const void *)qk_walk_fixup<T, 32, 2>;
    } else {
        *walker = (const void *)efb_walk<T, I, 32, 4>;
        *fixer = (const void *)qk_walk_fixup<T, 32, 4>;
    }
}

template <typename T, typename I, typename U>
int efb_grouped(const EfbArgs *a, int G, int K, cudaStream_t s) {
    const bool vector = G > 0 && sizeof(U) == 4;
    const int64_t m = 2 * a->num_edges;
    const int chunk = vector ? qk_walk_chunk(m, 132 * (2048 / G)) : 256;  // a wave of lane groups
    const int64_t nchunks = (m + chunk - 1) / chunk;
    const int end_bit = qk_bit_width((uint64_t)a->num_nodes);
    size_t temp_bytes = 0;
    cub::DoubleBuffer<U> keys(nullptr, nullptr), items(nullptr, nullptr);
    QK_CUDA_TRY(qk_sort_pairs<U>(nullptr, temp_bytes, keys, items, (U)m, end_bit, s));
    qk_scratch_layout plan;
    const size_t bytes = (size_t)m * sizeof(U);
    const size_t o_keys0 = plan.take(bytes), o_keys1 = plan.take(bytes), o_items0 = plan.take(bytes),
                 o_items1 = plan.take(bytes), o_marked = plan.take((size_t)a->num_nodes),
                 o_slots = plan.take(vector ? (size_t)(2 * nchunks * a->H) * sizeof(float) : 0),
                 o_temp = plan.take(temp_bytes);
    char *base = nullptr;
    QK_SCRATCH_TRY(a->scratch, plan.bytes, s, &base);
    keys = cub::DoubleBuffer<U>((U *)(base + o_keys0), (U *)(base + o_keys1));
    items = cub::DoubleBuffer<U>((U *)(base + o_items0), (U *)(base + o_items1));
    uint8_t *marked = (uint8_t *)(base + o_marked);
    EfbArgs p = *a;
    int status = (int)cudaMemsetAsync(marked, 0, (size_t)a->num_nodes, s);
    if (!status) {
        U *k0 = keys.Current(), *i0 = items.Current();
        void *args[] = {&p, &k0, &i0, &marked};
        status = qk_launch((const void *)efb_prepare<I, U>, dim3(qk_grid_for(m, 256, 132 * 16)), dim3(256), 0, s, args);
    }
    if (!status) status = (int)qk_sort_pairs<U>(base + o_temp, temp_bytes, keys, items, (U)m, end_bit, s);
    const U *sk = keys.Current(), *si = items.Current();
    if (!status && vector) {
        const uint32_t *k32 = (const uint32_t *)sk, *i32 = (const uint32_t *)si;
        float *slots = (float *)(base + o_slots);
        const float *cslots = slots;
        T *gx = static_cast<T *>(a->grad_x);
        int64_t M = m;
        uint32_t N = (uint32_t)a->num_nodes;
        int H = (int)a->H, ck = chunk;
        void *walk[] = {&p, &k32, &i32, &slots, &ck};
        void *fix[] = {&gx, &k32, &cslots, &M, &ck, &N, &H};
        const void *walker, *fixer;
        efb_walkers<T, I>(G, K, &walker, &fixer);
        const dim3 grid(qk_grid_for(nchunks, 256 / G)), block(256);
        status = qk_launch(walker, grid, block, 0, s, walk);
        if (!status) status = qk_launch(fixer, grid, block, 0, s, fix);
        if (!status) {
            const uint8_t *cmarked = marked;
            int64_t rows = a->num_nodes, elems = a->H;
            void *zero[] = {&gx, &cmarked, &rows, &elems};
            status = qk_launch((const void *)qk_zero_unmarked<T>, dim3(qk_grid_for(rows, 8, 132 * 16)), dim3(256), 0,
                               s, zero);
        }
    } else if (!status) {
        void *args[] = {&p, &sk, &si};
        status = qk_launch((const void *)efb_scalar<T, I, U>, dim3(qk_grid_for(a->num_nodes * a->H, 256, 132 * 16)),
                           dim3(256), 0, s, args);
    }
    const int freed = qk_scratch_free(a->scratch, base, plan.bytes, s);
    return status ? status : freed;
}

// The same walk over a plan from fused_edge_features_plan: no grouping, the nodes without entries
// zeroed from the plan's segments.  Entries are uint32 views of the int32 plan, so a negative one
// reads as out of range and is skipped.
template <typename T, typename I>
int efb_planned(const EfbArgs *a, int G, int K, cudaStream_t s) {
    const int64_t m = 2 * a->num_edges, N = a->num_nodes;
    const int32_t *ptr = a->plan;
    const uint32_t *keys = (const uint32_t *)(ptr + N + 1), *items = keys + m;
    EfbArgs p = *a;
    if (G == 0) {
        void *args[] = {&p, &keys, &items};
        return qk_launch((const void *)efb_scalar<T, I, uint32_t>, dim3(qk_grid_for(N * a->H, 256, 132 * 16)),
                         dim3(256), 0, s, args);
    }
    const int chunk = qk_walk_chunk(m, 132 * (2048 / G));
    const int64_t nchunks = (m + chunk - 1) / chunk;
    const size_t bytes = (size_t)(2 * nchunks * a->H) * sizeof(float);
    float *slots = nullptr;
    QK_SCRATCH_TRY(a->scratch, bytes, s, &slots);
    const float *cslots = slots;
    T *gx = static_cast<T *>(a->grad_x);
    int64_t M = m;
    uint32_t NN = (uint32_t)N;
    int H = (int)a->H, ck = chunk;
    void *walk[] = {&p, &keys, &items, &slots, &ck};
    void *fix[] = {&gx, &keys, &cslots, &M, &ck, &NN, &H};
    const void *walker, *fixer;
    efb_walkers<T, I>(G, K, &walker, &fixer);
    const dim3 grid(qk_grid_for(nchunks, 256 / G)), block(256);
    int status = qk_launch(walker, grid, block, 0, s, walk);
    if (!status) status = qk_launch(fixer, grid, block, 0, s, fix);
    if (!status) {
        int64_t rows = N, elems = a->H;
        void *zero[] = {&gx, &ptr, &rows, &elems};
        status = qk_launch((const void *)qk_zero_empty<T>, dim3(qk_grid_for(rows, 8, 132 * 16)), dim3(256), 0, s, zero);
    }
    const int freed = qk_scratch_free(a->scratch, slots, bytes, s);
    return status ? status : freed;
}

}  // namespace

extern "C" int qk_fused_edge_features_plan_cuda(const qk_fused_edge_features_plan_args *a, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    if (a->index_dtype != QK_I32 && a->index_dtype != QK_I64) return QK_E_UNSUPPORTED;
    const int64_t m = 2 * a->num_edges, N = a->num_nodes;
    if (a->num_edges > INT32_MAX / 2 || N >= INT32_MAX) return QK_E_UNSUPPORTED;
    const int end_bit = qk_bit_width((uint64_t)N);
    size_t temp_bytes = 0;
    cub::DoubleBuffer<uint32_t> keys(nullptr, nullptr), items(nullptr, nullptr);
    if (m > 0) QK_CUDA_TRY(qk_sort_pairs<uint32_t>(nullptr, temp_bytes, keys, items, (uint32_t)m, end_bit, s));
    qk_scratch_layout plan;
    const size_t bytes = (size_t)m * sizeof(uint32_t);
    const size_t o_keys0 = plan.take(bytes), o_keys1 = plan.take(bytes), o_items0 = plan.take(bytes),
                 o_items1 = plan.take(bytes), o_marked = plan.take(m > 0 ? (size_t)N : 0), o_temp = plan.take(temp_bytes);
    char *base = nullptr;
    if (m > 0) QK_SCRATCH_TRY(a->scratch, plan.bytes, s, &base);
    keys = cub::DoubleBuffer<uint32_t>((uint32_t *)(base + o_keys0), (uint32_t *)(base + o_keys1));
    items = cub::DoubleBuffer<uint32_t>((uint32_t *)(base + o_items0), (uint32_t *)(base + o_items1));
    uint8_t *marked = (uint8_t *)(base + o_marked);  // written by the shared prepare kernel, unread
    EfbArgs p = {};
    p.edge_index = a->edge_index;
    p.num_nodes = N, p.num_edges = a->num_edges;
    p.ei_stride[0] = a->ei_stride[0], p.ei_stride[1] = a->ei_stride[1];
    p.index_dtype = a->index_dtype;
    int status = QK_OK;
    if (m > 0) {
        uint32_t *k0 = keys.Current(), *i0 = items.Current();
        void *args[] = {&p, &k0, &i0, &marked};
        QK_DISPATCH_INDEX(a->index_dtype, I, {
            status = qk_launch((const void *)efb_prepare<I, uint32_t>, dim3(qk_grid_for(m, 256, 132 * 16)), dim3(256), 0,
                               s, args);
        })
        if (!status && end_bit > 0)
            status = (int)qk_sort_pairs<uint32_t>(base + o_temp, temp_bytes, keys, items, (uint32_t)m, end_bit, s);
    }
    if (!status) status = qk_plan_write_launch(a->plan, keys.Current(), items.Current(), nullptr, m, N, s);
    const int freed = qk_scratch_free(a->scratch, base, plan.bytes, s);
    return status ? status : freed;
}

extern "C" int qk_fused_edge_features_backward_cuda(const qk_fused_edge_features_backward_args *a, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    if (a->dtype != QK_F32 && a->dtype != QK_F16 && a->dtype != QK_BF16) return QK_E_UNSUPPORTED;
    if (a->index_dtype != QK_I32 && a->index_dtype != QK_I64) return QK_E_UNSUPPORTED;
    const size_t esize = a->dtype == QK_F32 ? 4 : 2;
    if (a->H == 0) return QK_OK;
    if (a->grad_edge_attr && a->num_edges > 0) {
        qk_fused_edge_features_backward_args p = *a;
        void *args[] = {&p};
        QK_DISPATCH_FLOAT(a->dtype, T, {
            constexpr int V = qk_vec<T>::N;
            const bool vec = a->H % V == 0 && a->go_stride[1] == 1 && a->go_stride[0] % V == 0 &&
                             qk_aligned16(a->grad_out) && qk_aligned16(a->grad_edge_attr);
            const int status =
                vec ? qk_launch((const void *)efb_copy_attr_vec<T>,
                                dim3(qk_grid_for(a->num_edges * (a->H / V), 256, 132 * 16)), dim3(256), 0, s, args)
                    : qk_launch((const void *)efb_copy_attr<T>, dim3(qk_grid_for(a->num_edges * a->H, 256, 132 * 16)),
                                dim3(256), 0, s, args);
            if (status) return status;
        })
    }
    if (a->num_nodes == 0) return QK_OK;
    if (a->num_edges == 0) return qk_memset_args(a->scratch, a->grad_x, 0, (size_t)(a->num_nodes * a->H) * esize, s);
    QK_DISPATCH_FLOAT(a->dtype, T, QK_DISPATCH_INDEX(a->index_dtype, I, {
        int G, K;
        efb_shape<T>(a, G, K);
        if (a->plan) return efb_planned<T, I>(a, G, K, s);
        if (2 * a->num_edges < (int64_t)UINT32_MAX && a->num_nodes < (int64_t)UINT32_MAX)
            return efb_grouped<T, I, uint32_t>(a, G, K, s);
        return efb_grouped<T, I, uint64_t>(a, 0, 0, s);
    }))
    return QK_OK;
}
