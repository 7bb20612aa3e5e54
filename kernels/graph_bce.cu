// graph_norm_bce: mean over graphs of the per-graph mean BCE-with-logits, deterministic.
//
// Sorted edge_graph (PyG batches), the fast path: blocks own fixed chunks of 2048 edges and run a
// segmented inclusive scan (CUB BlockScan, fixed order) over (graph, bce, 1).  A graph that lies
// inside one chunk is finished there and written by that block alone; the first and last segment
// of each chunk go to a boundary list, which one block folds with the same segmented scan before
// taking the mean over graphs (fixed-order reduction).  Bytes: logits, target and edge_graph read
// once (E=4M fp32/int64: 64 MB, ~16 µs at 4 TB/s) plus O(num_graphs + E/2048).
// Unsorted input (detected on the device; no host round trip) takes a slower deterministic path:
// one block per graph scans all edges.  Edges whose graph id is out of range are skipped.
// Scratch space comes from the stream-ordered allocator.
#include "common.cuh"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

namespace {

constexpr int kThreads = 512, kItems = 8, kChunk = kThreads * kItems;
constexpr int kFinalThreads = 512;  // 1024 would cap registers at 64 and spill

struct Seg {
    float sum;
    unsigned int count;
    int head;  // a segment starts at this item
};

struct SegSum {
    __device__ __forceinline__ Seg operator()(const Seg &a, const Seg &b) const {
        Seg r;
        r.head = a.head | b.head;
        r.sum = b.head ? b.sum : a.sum + b.sum;
        r.count = b.head ? b.count : a.count + b.count;
        return r;
    }
};

struct Boundary {
    long long graph;  // -1: no segment
    float sum;
    unsigned int count;
};

struct Work {
    float *graph_sum;
    unsigned int *graph_count;
    Boundary *first, *last;  // per chunk
    int *unsorted;
};

template <typename T>
__device__ __forceinline__ float bce_term(const qk_graph_bce_args &a, int64_t e) {
    const float l = qk_to_float(static_cast<const T *>(a.logits)[e * a.logits_stride]);
    const float t = qk_to_float(static_cast<const T *>(a.target)[e * a.target_stride]);
    float v = fmaxf(l, 0.f) - l * t + log1pf(__expf(-fabsf(l)));
    if (a.has_pos_weight) v *= 1.f + (a.pos_weight - 1.f) * t;
    return v;
}

template <typename I>
__device__ __forceinline__ long long graph_of(const qk_graph_bce_args &a, int64_t e) {
    const long long g = (long long)qk_load_index<I>(a.edge_graph, e, a.graph_stride);
    return g >= 0 && g < a.num_graphs ? g : -1;
}

// N consecutive elements from p (16-byte aligned): whole 16-byte loads.
template <typename T, int N>
__device__ __forceinline__ void load_run(const T *p, T (&out)[N]) {
    static_assert((N * sizeof(T)) % 16 == 0, "whole 16-byte vectors");
#pragma unroll
    for (int i = 0; i < (int)(N * sizeof(T) / 16); i++)
        reinterpret_cast<uint4 *>(out)[i] = __ldg(reinterpret_cast<const uint4 *>(p) + i);
}

// Each thread owns kItems consecutive edges.  kVector: unit strides and 16-byte aligned arrays,
// so a full run of items is read with 16-byte loads.
template <typename T, typename I, bool kVector>
__global__ void __launch_bounds__(kThreads) bce_chunks(qk_graph_bce_args a, Work w) {
    using Scan = cub::BlockScan<Seg, kThreads>;
    __shared__ typename Scan::TempStorage scan_storage;
    __shared__ long long first_of[kThreads + 1], last_of[kThreads];  // graph of each thread's first/last item
    const int64_t base = (int64_t)blockIdx.x * kChunk, end = min(base + kChunk, a.num_edges);
    const int64_t e0 = base + (int64_t)threadIdx.x * kItems;
    long long g[kItems];
    float l[kItems], t[kItems];
    if (kVector && e0 + kItems <= end) {
        T lv[kItems], tv[kItems];
        I gv[kItems];
        load_run(static_cast<const T *>(a.logits) + e0, lv);
        load_run(static_cast<const T *>(a.target) + e0, tv);
        load_run(static_cast<const I *>(a.edge_graph) + e0, gv);
#pragma unroll
        for (int i = 0; i < kItems; i++) {
            l[i] = qk_to_float(lv[i]);
            t[i] = qk_to_float(tv[i]);
            g[i] = gv[i] >= 0 && gv[i] < a.num_graphs ? (long long)gv[i] : -1;
        }
    } else {
#pragma unroll
        for (int i = 0; i < kItems; i++) {
            const int64_t e = e0 + i;
            g[i] = e < end ? graph_of<I>(a, e) : -1;
            l[i] = e < end ? qk_to_float(static_cast<const T *>(a.logits)[e * a.logits_stride]) : 0.f;
            t[i] = e < end ? qk_to_float(static_cast<const T *>(a.target)[e * a.target_stride]) : 0.f;
        }
    }
    first_of[threadIdx.x] = g[0];
    last_of[threadIdx.x] = g[kItems - 1];
    if (threadIdx.x == 0) first_of[kThreads] = -3;
    __syncthreads();
    long long prev = threadIdx.x > 0 ? last_of[threadIdx.x - 1] : (e0 > 0 ? graph_of<I>(a, e0 - 1) : -2);
    bool unsorted = false;
    Seg s[kItems];
#pragma unroll
    for (int i = 0; i < kItems; i++) {
        const int64_t e = e0 + i;
        const bool valid = e < end && g[i] >= 0;
        if (e < end) unsorted |= g[i] < 0 || (e > 0 && g[i] < prev);  // out-of-range ids: the careful path
        float v = 0.f;
        if (valid) {
            v = fmaxf(l[i], 0.f) - l[i] * t[i] + log1pf(__expf(-fabsf(l[i])));
            if (a.has_pos_weight) v *= 1.f + (a.pos_weight - 1.f) * t[i];
        }
        s[i].sum = v;
        s[i].count = valid;
        s[i].head = e == base || g[i] != prev;
        prev = g[i];
    }
    if (unsorted) atomicOr(w.unsorted, 1);
    Scan(scan_storage).InclusiveScan(s, s, SegSum());
    long long *next_graph = first_of;
    const long long first_graph = first_of[0];
    const long long last_graph = graph_of<I>(a, end - 1);
#pragma unroll
    for (int i = 0; i < kItems; i++) {
        const int64_t e = e0 + i;
        if (e >= end || g[i] < 0) continue;
        const long long after = e + 1 >= end ? -3 : (i + 1 < kItems ? g[i + 1] : next_graph[threadIdx.x + 1]);
        if (after == g[i]) continue;  // not the end of its segment
        const Boundary b = {g[i], s[i].sum, s[i].count};
        if (g[i] == first_graph) {
            w.first[blockIdx.x] = b;
        } else if (g[i] == last_graph) {
            w.last[blockIdx.x] = b;
        } else {  // the whole graph lies in this chunk: nobody else writes it
            w.graph_sum[g[i]] = s[i].sum;
            w.graph_count[g[i]] = s[i].count;
        }
    }
    if (threadIdx.x == 0 && first_graph == last_graph) w.last[blockIdx.x] = {last_graph, 0.f, 0u};
}

// Unsorted input only: one block per graph, all edges, fixed-order reduction.
template <typename T, typename I>
__global__ void __launch_bounds__(kThreads) bce_per_graph(qk_graph_bce_args a, Work w) {
    if (!*w.unsorted) return;
    using Reduce = cub::BlockReduce<float, kThreads>;
    using ReduceCount = cub::BlockReduce<unsigned int, kThreads>;
    __shared__ typename Reduce::TempStorage sum_storage;
    __shared__ typename ReduceCount::TempStorage count_storage;
    for (int64_t g = blockIdx.x; g < a.num_graphs; g += gridDim.x) {
        float sum = 0.f;
        unsigned int count = 0;
        for (int64_t e = threadIdx.x; e < a.num_edges; e += kThreads) {
            if (graph_of<I>(a, e) == g) {
                sum += bce_term<T>(a, e);
                count++;
            }
        }
        sum = Reduce(sum_storage).Sum(sum);
        count = ReduceCount(count_storage).Sum(count);
        if (threadIdx.x == 0) {
            w.graph_sum[g] = sum;
            w.graph_count[g] = count;
        }
        __syncthreads();
    }
}

// Sorted input: fold the chunk boundary segments (first_0, last_0, first_1, ... is sorted by
// graph).  Then, for either path, the mean over graphs in a fixed order.
__global__ void __launch_bounds__(kFinalThreads) bce_final(qk_graph_bce_args a, Work w, int64_t nchunks) {
    using Scan = cub::BlockScan<Seg, kFinalThreads>;
    using Reduce = cub::BlockReduce<double, kFinalThreads>;
    __shared__ union {
        typename Scan::TempStorage scan;
        typename Reduce::TempStorage reduce;
    } storage;
    __shared__ Seg carry;
    __shared__ long long carry_graph;
    if (!*w.unsorted) {
        const int64_t n = 2 * nchunks;
        if (threadIdx.x == 0) {
            carry = {0.f, 0u, 1};
            carry_graph = -1;
        }
        __syncthreads();
        for (int64_t t0 = 0; t0 < n; t0 += kFinalThreads) {
            const int64_t i = t0 + threadIdx.x;
            Boundary b = {-1, 0.f, 0u};
            if (i < n) b = (i & 1) ? w.last[i >> 1] : w.first[i >> 1];
            const long long prev_graph =
                i == 0 ? -1 : (i - 1 < t0 ? carry_graph : ((i - 1) & 1 ? w.last[(i - 1) >> 1].graph : w.first[(i - 1) >> 1].graph));
            Seg s = {b.sum, b.count, b.graph != prev_graph};
            if (threadIdx.x == 0 && !s.head) s = SegSum()(carry, s);  // continue the previous tile's segment
            Scan(storage.scan).InclusiveScan(s, s, SegSum());
            const long long next_graph =
                i + 1 >= n ? -2 : ((i + 1) & 1 ? w.last[(i + 1) >> 1].graph : w.first[(i + 1) >> 1].graph);
            if (i < n && b.graph >= 0 && next_graph != b.graph) {
                w.graph_sum[b.graph] = s.sum;
                w.graph_count[b.graph] = s.count;
            }
            __syncthreads();
            if (threadIdx.x == kFinalThreads - 1) {
                carry = s;
                carry_graph = b.graph;
            }
            __syncthreads();
        }
    }
    double total = 0;
    for (int64_t g = threadIdx.x; g < a.num_graphs; g += kFinalThreads) {
        const unsigned int c = w.graph_count[g];
        total += (double)w.graph_sum[g] / (double)(c > 1 ? c : 1);
    }
    total = Reduce(storage.reduce).Sum(total);
    if (threadIdx.x == 0) *a.out = (float)(total / (double)a.num_graphs);
}

}  // namespace

extern "C" int qk_graph_bce_cuda(const qk_graph_bce_args *a, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    const int64_t G = a->num_graphs, nchunks = (a->num_edges + kChunk - 1) / kChunk;
    // Scratch: per-graph sums and counts and the unsorted flag (zeroed by one memset), then the
    // per-chunk boundary segments.
    const size_t sums = (size_t)G * sizeof(float), counts = (size_t)G * sizeof(unsigned int);
    const size_t bounds = (size_t)(2 * nchunks) * sizeof(Boundary);
    const size_t off_counts = (sums + 15) / 16 * 16, off_flag = (off_counts + counts + 15) / 16 * 16;
    const size_t off_bounds = off_flag + 16, total = off_bounds + bounds;
    char *scratch = nullptr;
    QK_CUDA_TRY(cudaMallocAsync((void **)&scratch, total, s));
    Work w = {(float *)scratch, (unsigned int *)(scratch + off_counts), (Boundary *)(scratch + off_bounds),
              (Boundary *)(scratch + off_bounds) + nchunks, (int *)(scratch + off_flag)};
    int status = (int)cudaMemsetAsync(scratch, 0, off_bounds, s);
    const bool vector = a->logits_stride == 1 && a->target_stride == 1 && a->graph_stride == 1 &&
                        qk_aligned16(a->logits) && qk_aligned16(a->target) && qk_aligned16(a->edge_graph);
    qk_graph_bce_args p = *a;
    int64_t nc = nchunks;
    void *args[] = {&p, &w};
    void *final_args[] = {&p, &w, &nc};
    if (!status) {
        status = [&]() -> int {
            QK_DISPATCH_FLOAT(a->dtype, T, QK_DISPATCH_INDEX(a->index_dtype, I, {
                int r = QK_OK;
                if (nchunks > 0)
                    r = qk_launch(vector ? (const void *)bce_chunks<T, I, true> : (const void *)bce_chunks<T, I, false>,
                                  dim3((unsigned)nchunks), dim3(kThreads), 0, s, args);
                // Sorted input leaves this kernel nothing to do: few blocks, so it exits quickly.
                if (!r)
                    r = qk_launch((const void *)bce_per_graph<T, I>, dim3((unsigned)(G < 1056 ? G : 1056)),
                                  dim3(kThreads), 0, s, args);
                return r;
            }))
            return QK_OK;
        }();
    }
    if (!status) status = qk_launch((const void *)bce_final, dim3(1), dim3(kFinalThreads), 0, s, final_args);
    const int freed = (int)cudaFreeAsync(scratch, s);
    return status ? status : freed;
}
