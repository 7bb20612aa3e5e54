// graph_norm_bce: mean over graphs of the per-graph mean BCE-with-logits, deterministic.
//
// Sorted edge_graph (PyG batches), the fast path, is one pass over the data (sorted_pass).  The
// grid is one resident wave; each warp owns a contiguous range of edges, read 256 at a time with
// coalesced vector loads, 8 consecutive edges per lane.  A lane finishes the graphs that start
// and end among its 8 edges in registers; its first and last segment meet the other lanes'
// through one warp scan, and the segment open at the end of a step is carried to the next.  The
// warps' first/last segments are folded per block, the blocks' by block 0 after a grid-wide sync,
// all in a fixed order: no per-graph arrays.
// Bytes: logits, target and edge_graph read once (E=4M fp32/int64: 64 MB, ~15 µs at 4.2 TB/s)
// plus O(blocks).  docs/graph-ops.md has the measured time.
// Unsorted input (detected on the device; no host round trip) takes a slower deterministic path
// after that sync: each block sums whole graphs (strided over graphs, every edge scanned per
// graph), and block 0 adds the blocks' sums after a second sync.
// One cooperative launch and no memset (nothing to zero: every slot read is written first in the
// same call); where a cooperative launch is not possible the same phases run as three launches,
// with the same arithmetic (the same bits).  Edges whose graph id is out of range are skipped.
#include "common.cuh"

#include <limits.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

namespace {

constexpr int kThreads = 512, kRun = 8;  // kRun: edges per vector step of a thread's run
constexpr int kBlocksPerSM = 2;

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
    Boundary *first, *last;    // per sorted block: the segments of its range's first and last graph
    double *partial;           // per sorted block: sum over graphs finished inside it of sum / count
    int *block_unsorted;       // per sorted block
    double *graph_partial;     // unsorted path, per block: sum over its graphs of sum / count
    long long run_len;         // edges per warp, a multiple of 32 * kRun
    int sorted_blocks;         // blocks of the sorted pass: the first of the grid
    int graph_blocks;          // blocks of the grid (of the unsorted path)
};

// pw: the edge's pos_weight (used when a.has_pos_weight).
__device__ __forceinline__ float bce_value(float l, float t, float pw, const qk_graph_norm_bce_args &a) {
    float v = fmaxf(l, 0.f) - l * t + log1pf(__expf(-fabsf(l)));
    if (a.has_pos_weight) v *= 1.f + (pw - 1.f) * t;
    return v;
}

// A pos_weight tensor: one weight per edge (pw_stride != 0), or one for all.
__device__ __forceinline__ bool pos_weight_per_edge(const qk_graph_norm_bce_args &a) {
    return a.pos_weight_t != nullptr && a.pw_stride != 0;
}

template <typename T>
__device__ __forceinline__ float pos_weight_at(const qk_graph_norm_bce_args &a, int64_t e) {
    return a.pw_dtype == QK_F32 ? __ldg(static_cast<const float *>(a.pos_weight_t) + e * a.pw_stride)
                                : qk_to_float(static_cast<const T *>(a.pos_weight_t)[e * a.pw_stride]);
}

// The pos_weight of every edge when there is one: the float of the call, or the tensor's value now.
template <typename T>
__device__ __forceinline__ float pos_weight_all(const qk_graph_norm_bce_args &a) {
    return a.pos_weight_t != nullptr && a.pw_stride == 0 ? pos_weight_at<T>(a, 0) : a.pos_weight;
}

// pw: pos_weight_all's value, used unless the weights are per edge.
template <typename T>
__device__ __forceinline__ float bce_term(const qk_graph_norm_bce_args &a, int64_t e, float pw) {
    const float l = qk_to_float(static_cast<const T *>(a.logits)[e * a.logits_stride]);
    const float t = qk_to_float(static_cast<const T *>(a.target)[e * a.target_stride]);
    return bce_value(l, t, pos_weight_per_edge(a) ? pos_weight_at<T>(a, e) : pw, a);
}

// N consecutive pos_weight values from edge e (unit stride, 16-byte aligned), as floats.
template <typename T, int N>
__device__ __forceinline__ void load_pos_weights(const qk_graph_norm_bce_args &a, int64_t e, float (&out)[N]);

template <typename I>
__device__ __forceinline__ long long graph_of(const qk_graph_norm_bce_args &a, int64_t e) {
    const long long g = (long long)qk_load_index<I>(a.edge_graph, e, a.graph_stride);
    return g >= 0 && g < a.num_graphs ? g : -1;
}

// N consecutive elements from p (aligned to their total size or 16 bytes): whole vector loads
// of up to 16 bytes.  Through L1: a lane's 16-byte loads take turns within each 32-byte sector.
template <typename T, int N>
__device__ __forceinline__ void load_run(const T *p, T (&out)[N]) {
    constexpr int bytes = N * sizeof(T);
    if constexpr (bytes % 16 == 0) {
#pragma unroll
        for (int i = 0; i < bytes / 16; i++)
            reinterpret_cast<uint4 *>(out)[i] = __ldg(reinterpret_cast<const uint4 *>(p) + i);
    } else {
        static_assert(bytes == 8, "8 bytes or whole 16-byte vectors");
        reinterpret_cast<uint2 *>(out)[0] = __ldg(reinterpret_cast<const uint2 *>(p));
    }
}

template <typename T, int N>
__device__ __forceinline__ void load_pos_weights(const qk_graph_norm_bce_args &a, int64_t e, float (&out)[N]) {
    if (a.pw_dtype == QK_F32) {
        load_run(static_cast<const float *>(a.pos_weight_t) + e, out);
    } else {
        T v[N];
        load_run(static_cast<const T *>(a.pos_weight_t) + e, v);
#pragma unroll
        for (int i = 0; i < N; i++) out[i] = qk_to_float(v[i]);
    }
}

__device__ __forceinline__ Boundary load_boundary(const Boundary *p) {
    // Written by other blocks of this grid: read through L2.
    Boundary b;
    b.graph = __ldcg(&p->graph);
    b.sum = __ldcg(&p->sum);
    b.count = __ldcg(&p->count);
    return b;
}

// One block, once every sorted block's records are written (sorted input: boundaries first_0,
// last_0, first_1, ... are sorted by graph).  Thread i takes block i's pair (and its partial) in one
// round of loads, merges equal neighbours with a segmented scan, adds each merged graph's mean, then
// everything in a fixed order.
__device__ __noinline__ void fold_sorted(const qk_graph_norm_bce_args &a, const Work &w) {
    const int nblocks = w.sorted_blocks;
    using Scan = cub::BlockScan<Seg, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;
    using Reduce = cub::BlockReduce<double, kThreads>;
    __shared__ union {
        typename Scan::TempStorage scan;
        typename Reduce::TempStorage reduce;
    } storage;
    __shared__ long long first_graph[kThreads + 1], last_graph[kThreads];
    __shared__ Seg carry;
    __shared__ long long carry_graph;
    double acc = 0;
    for (int t0 = 0; t0 < nblocks; t0 += kThreads) {
        const int i = t0 + threadIdx.x;
        Boundary f = {-1, 0.f, 0u}, l = {-1, 0.f, 0u};
        if (i < nblocks) {
            f = load_boundary(w.first + i);
            l = load_boundary(w.last + i);
            acc += __ldcg(w.partial + i);
        }
        first_graph[threadIdx.x] = f.graph;
        last_graph[threadIdx.x] = l.graph;
        if (threadIdx.x == 0) {
            first_graph[kThreads] = t0 + kThreads < nblocks ? load_boundary(w.first + t0 + kThreads).graph : -2;
            if (t0 == 0) {
                carry = {0.f, 0u, 1};
                carry_graph = -1;
            }
        }
        __syncthreads();
        const long long prev = threadIdx.x == 0 ? carry_graph : last_graph[threadIdx.x - 1];
        Seg s[2] = {{f.sum, f.count, f.graph != prev}, {l.sum, l.count, l.graph != f.graph}};
        if (threadIdx.x == 0 && !s[0].head) s[0] = SegSum()(carry, s[0]);  // continue the previous tile's segment
        Scan(storage.scan).InclusiveScan(s, s, SegSum());
        if (i < nblocks && f.graph >= 0 && l.graph != f.graph)
            acc += (double)s[0].sum / (double)(s[0].count > 1 ? s[0].count : 1);
        if (i < nblocks && l.graph >= 0 && first_graph[threadIdx.x + 1] != l.graph)
            acc += (double)s[1].sum / (double)(s[1].count > 1 ? s[1].count : 1);
        __syncthreads();
        if (threadIdx.x == kThreads - 1) {
            carry = s[1];
            carry_graph = l.graph;
        }
        __syncthreads();
    }
    acc = Reduce(storage.reduce).Sum(acc);
    if (threadIdx.x == 0) *a.out = (float)(acc / (double)a.num_graphs);
}

// A segment of one graph's edges: graph (-1: none), sum of bce, number of edges.
struct Run {
    int graph;
    float sum;
    unsigned int count;
};

__device__ __forceinline__ Run shfl_up(const Run &r, int d) {
    return {__shfl_up_sync(0xffffffffu, r.graph, d), __shfl_up_sync(0xffffffffu, r.sum, d),
            __shfl_up_sync(0xffffffffu, r.count, d)};
}

// Inclusive scan over the lanes' records, adding a lower lane's record when it holds the same
// graph.  Sorted ids make equal graphs contiguous, so this is the segmented scan (fixed order).
__device__ __forceinline__ Run warp_scan_same_graph(Run r) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const Run o = shfl_up(r, d);
        if (lane >= d && o.graph == r.graph) {
            r.sum = o.sum + r.sum;
            r.count += o.count;
        }
    }
    return r;
}

// Where a finished segment goes: the range's first graph may continue in the range before, so it
// is kept as a boundary; any other graph lies wholly inside the range and is finished here.
__device__ __forceinline__ void finish(const Run &r, int range_first, Run &first_out, double &acc) {
    if (r.graph == range_first) first_out = r;
    else acc += (double)r.sum / (double)r.count;
}

// Each warp owns a contiguous range of edges and reads it 256 edges (8 per lane, coalesced) per
// step.  A lane reduces its 8 sorted edges in registers: the graphs that start and end inside
// them are finished at once; its first and last segment meet the neighbours' through one warp
// scan; the segment still open at the step's end is carried to the next step.  The warps' first
// and last segments are folded per block by warp 0 the same way, and the block's first and last
// graph go to the boundary list for fold_sorted.  Per edge: a load, the bce and an add:
// a block scan per edge range is bound by the scan's instructions, and per-thread runs (lanes 128
// bytes apart) over-fetch DRAM (docs/graph-ops.md).  kVector: unit strides and 16-byte aligned
// arrays: whole vector loads.
template <typename T, typename I, bool kVector>
__device__ __forceinline__ void sorted_pass(const qk_graph_norm_bce_args &a, const Work &w) {
    constexpr int kWarps = kThreads / 32;
    __shared__ Run warp_first[kWarps], warp_last[kWarps];
    __shared__ double warp_acc[kWarps];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t range_len = w.run_len;  // per warp, a multiple of 32 * kRun
    const int64_t wbegin = ((int64_t)blockIdx.x * kWarps + warp) * range_len;
    const int64_t wend = min(wbegin + range_len, a.num_edges);
    const int64_t block_begin = (int64_t)blockIdx.x * kWarps * range_len;
    const int64_t block_stop = min(block_begin + kWarps * range_len, a.num_edges);
    const int wfirst = wbegin < wend ? (int)graph_of<I>(a, wbegin) : -1;
    const float pw_all = pos_weight_all<T>(a);
    const bool per_edge = pos_weight_per_edge(a);

    double acc = 0;
    bool unsorted = false;
    Run first = {-1, 0.f, 0u};                 // the warp's first graph, once finished (lane that saw it)
    Run carry = {wfirst, 0.f, 0u};             // the segment open at the end of the last step
    if (lane == 0 && wbegin > 0 && wbegin < wend) unsorted |= wfirst < (int)graph_of<I>(a, wbegin - 1);
    for (int64_t base = wbegin; base < wend; base += 32 * kRun) {
        const int64_t e0 = base + lane * kRun;
        int g[kRun];
        float v[kRun];
        if (kVector && e0 + kRun <= wend) {
            T lv[kRun], tv[kRun];
            I gv[kRun];
            load_run(static_cast<const T *>(a.logits) + e0, lv);
            load_run(static_cast<const T *>(a.target) + e0, tv);
            load_run(static_cast<const I *>(a.edge_graph) + e0, gv);
            float pw[kRun];
            if (per_edge) load_pos_weights<T>(a, e0, pw);
#pragma unroll
            for (int i = 0; i < kRun; i++) {
                g[i] = gv[i] >= 0 && gv[i] < a.num_graphs ? (int)gv[i] : -1;
                v[i] = bce_value(qk_to_float(lv[i]), qk_to_float(tv[i]), per_edge ? pw[i] : pw_all, a);
            }
        } else {
#pragma unroll
            for (int i = 0; i < kRun; i++) {
                const int64_t e = e0 + i;
                g[i] = e < wend ? (int)graph_of<I>(a, e) : INT_MAX;  // past the end: a graph of its own
                v[i] = e < wend ? bce_term<T>(a, e, pw_all) : 0.f;
            }
        }
        // This lane's edges: head segment, tail segment, graphs finished in between.  Edges past
        // the range's end (INT_MAX) are not there.
        Run head = {g[0], v[0], g[0] != INT_MAX}, tail;
        bool single = true;
        int cur = g[0];
#pragma unroll
        for (int i = 1; i < kRun; i++) {
            if (g[i] == INT_MAX) continue;
            if (g[i] == cur) {
                if (single) {
                    head.sum += v[i];
                    head.count++;
                } else {
                    tail.sum += v[i];
                    tail.count++;
                }
                continue;
            }
            unsorted |= g[i] < cur;
            if (!single) finish(tail, wfirst, first, acc);
            single = false;
            tail = {g[i], v[i], 1u};
            cur = g[i];
        }
        if (single) tail = head;
        unsorted |= g[0] < 0;
        // The lanes' tails, scanned; the carry joins every lane whose tail continues it.
        Run t = warp_scan_same_graph(tail);
        if (t.graph == carry.graph) {
            t.sum = carry.sum + t.sum;
            t.count += carry.count;
        }
        Run before = shfl_up(t, 1);  // what precedes this lane's head
        if (lane == 0) before = carry;
        unsorted |= head.graph < before.graph && head.graph != INT_MAX;
        if (lane == 0 && head.graph != carry.graph && carry.count) finish(carry, wfirst, first, acc);
        if (!single) {  // the head ends inside this lane
            if (before.graph == head.graph) {
                head.sum = before.sum + head.sum;
                head.count += before.count;
            }
            if (head.graph != INT_MAX) finish(head, wfirst, first, acc);
        }
        // A tail ends here when the next lane starts another graph; the last lane's stays open.
        const int next_head = __shfl_down_sync(0xffffffffu, head.graph, 1);
        const int last_lane = (int)min((int64_t)31, (wend - 1 - base) / kRun);
        if (lane < last_lane && next_head != t.graph) finish(t, wfirst, first, acc);
        carry = {__shfl_sync(0xffffffffu, t.graph, last_lane), __shfl_sync(0xffffffffu, t.sum, last_lane),
                 __shfl_sync(0xffffffffu, t.count, last_lane)};
    }
    // The warp's records: its first graph (finished by some lane, or still the carry) and the carry.
    unsigned int have = __ballot_sync(0xffffffffu, first.graph != -1 || first.count != 0);
    Run wf = {wfirst, 0.f, 0u};
    if (have) {
        const int src = __ffs(have) - 1;
        wf = {__shfl_sync(0xffffffffu, first.graph, src), __shfl_sync(0xffffffffu, first.sum, src),
              __shfl_sync(0xffffffffu, first.count, src)};
    }
    Run wl = carry;
    if (!have) {  // the whole range is one graph: it is the carry
        wf = carry;
        wl = {carry.graph, 0.f, 0u};
    }
    // acc: a fixed-order warp sum.
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    unsorted = __any_sync(0xffffffffu, unsorted);
    if (lane == 0) {
        warp_first[warp] = wbegin < wend ? wf : Run{-1, 0.f, 0u};
        warp_last[warp] = wbegin < wend ? wl : Run{-1, 0.f, 0u};
        warp_acc[warp] = acc;
    }
    const int any_unsorted = __syncthreads_or(unsorted);
    if (warp == 0) {
        // Fold the block's 2 * kWarps records (one per lane; sorted by graph) the same way.
        const int block_first = (int)graph_of<I>(a, block_begin), block_last = (int)graph_of<I>(a, block_stop - 1);
        Run r = (lane & 1) ? warp_last[lane >> 1] : warp_first[lane >> 1];
        const int mine = r.graph;
        Run f = warp_scan_same_graph(r);
        const int down = __shfl_down_sync(0xffffffffu, mine, 1);  // every lane takes part
        const int next = lane < 31 ? down : -3;
        double bacc = 0;
        if (mine >= 0 && next != mine) {
            if (mine == block_first) w.first[blockIdx.x] = {mine, f.sum, f.count};
            else if (mine == block_last) w.last[blockIdx.x] = {mine, f.sum, f.count};
            else bacc = (double)f.sum / (double)(f.count > 1 ? f.count : 1);
        }
        // Fixed order: lane sums, then the warps' partials in warp order.
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) bacc += __shfl_xor_sync(0xffffffffu, bacc, o);
        if (lane == 0) {
            for (int i = 0; i < kWarps; i++) bacc += warp_acc[i];
            if (block_first == block_last) w.last[blockIdx.x] = {block_last, 0.f, 0u};
            w.partial[blockIdx.x] = bacc;
            w.block_unsorted[blockIdx.x] = any_unsorted;
        }
    }
}

// Whether a sorted block saw its ids out of order (or out of range), once all have written their
// flags: the same answer in every block of the grid.
__device__ __forceinline__ bool any_unsorted(const Work &w) {
    int u = 0;
    for (int i = threadIdx.x; i < w.sorted_blocks; i += kThreads) u |= __ldcg(w.block_unsorted + i);
    return __syncthreads_or(u) != 0;
}

// Unsorted input only: block b sums the graphs b, b + graph_blocks, ..., each over all edges with
// fixed-order block reductions, and adds their means in that order.
template <typename T, typename I>
__device__ __forceinline__ void per_graph_pass(const qk_graph_norm_bce_args &a, const Work &w) {
    using Reduce = cub::BlockReduce<float, kThreads>;
    using ReduceCount = cub::BlockReduce<unsigned int, kThreads>;
    __shared__ typename Reduce::TempStorage sum_storage;
    __shared__ typename ReduceCount::TempStorage count_storage;
    const float pw_all = pos_weight_all<T>(a);
    double acc = 0;  // thread 0's
    for (int64_t g = blockIdx.x; g < a.num_graphs; g += w.graph_blocks) {
        float sum = 0.f;
        unsigned int count = 0;
        for (int64_t e = threadIdx.x; e < a.num_edges; e += kThreads) {
            if (graph_of<I>(a, e) == g) {
                sum += bce_term<T>(a, e, pw_all);
                count++;
            }
        }
        sum = Reduce(sum_storage).Sum(sum);
        count = ReduceCount(count_storage).Sum(count);
        if (threadIdx.x == 0) acc += (double)sum / (double)(count > 1 ? count : 1);
        __syncthreads();  // the reductions' storage is reused
    }
    if (threadIdx.x == 0) w.graph_partial[blockIdx.x] = acc;
}

// One block, once every block's per_graph_pass is done: the mean over graphs, in a fixed order.
__device__ __noinline__ void fold_unsorted(const qk_graph_norm_bce_args &a, const Work &w) {
    using Reduce = cub::BlockReduce<double, kThreads>;
    __shared__ typename Reduce::TempStorage storage;
    double acc = 0;
    for (int i = threadIdx.x; i < w.graph_blocks; i += kThreads) acc += __ldcg(w.graph_partial + i);
    acc = Reduce(storage).Sum(acc);
    if (threadIdx.x == 0) *a.out = (float)(acc / (double)a.num_graphs);
}

// The whole op in one cooperative launch of graph_blocks blocks (one resident wave).  Every block
// reaches both syncs or neither: the second depends only on any_unsorted, which reads flags written
// before the first and gives every block the same answer.
template <typename T, typename I, bool kVector>
__global__ void __launch_bounds__(kThreads, kBlocksPerSM) bce_cooperative(qk_graph_norm_bce_args a, Work w) {
    cooperative_groups::grid_group grid = cooperative_groups::this_grid();
    if ((int)blockIdx.x < w.sorted_blocks) sorted_pass<T, I, kVector>(a, w);
    grid.sync();
    if (!any_unsorted(w)) {
        if (blockIdx.x == 0) fold_sorted(a, w);
        return;
    }
    per_graph_pass<T, I>(a, w);
    grid.sync();
    if (blockIdx.x == 0) fold_unsorted(a, w);
}

// The same phases as three launches (kernel boundaries for the syncs) where a cooperative launch
// is not possible: the same arithmetic in the same order, so the same bits.
template <typename T, typename I, bool kVector>
__global__ void __launch_bounds__(kThreads, kBlocksPerSM) bce_sorted(qk_graph_norm_bce_args a, Work w) {
    sorted_pass<T, I, kVector>(a, w);
}

template <typename T, typename I>
__global__ void __launch_bounds__(kThreads, kBlocksPerSM) bce_graphs(qk_graph_norm_bce_args a, Work w) {
    if (any_unsorted(w)) per_graph_pass<T, I>(a, w);
}

__global__ void __launch_bounds__(kThreads) bce_fold(qk_graph_norm_bce_args a, Work w) {
    if (any_unsorted(w)) fold_unsorted(a, w);
    else fold_sorted(a, w);
}

size_t align16(size_t n) { return (n + 15) / 16 * 16; }

// Per-edge pos_weight read by whole vectors (or none per edge).
bool pos_weights_vector(const qk_graph_norm_bce_args *a) {
    return a->pos_weight_t == nullptr || a->pw_stride == 0 || (a->pw_stride == 1 && qk_aligned16(a->pos_weight_t));
}

// ---- backward -------------------------------------------------------------------------------
//
// d loss / d l_e = grad * w_e * (sigmoid(l_e) - t_e) / (max(count_g, 1) * num_graphs): a count pass
// over edge_graph, then one elementwise pass with a gather of the count, in one cooperative kernel
// (zeroing, counting and the gradient between grid syncs), else a memset and two kernels.  The
// counts are integer atomics (exact in any order, so deterministic) into a [num_graphs] scratch
// array.  Each thread takes kRun consecutive edges (coalesced vector loads where the layout
// allows) and adds each run of one graph once; the run open at a lane's end joins the neighbouring
// lanes' through a segmented warp scan, so sorted ids cost about one atomic per 256 edges and
// unsorted ids stay right.  Bytes: edge_graph twice, logits and target once, grad_logits written.

constexpr int kBwdThreads = 256;

// Block-sized chunk c of kBwdThreads * kRun edges (every lane of the block takes part).
template <typename I, bool kVector>
__device__ __forceinline__ void count_chunk(const qk_graph_norm_bce_args &a, unsigned long long *count, int64_t c) {
    const int lane = threadIdx.x & 31;
    const int64_t e0 = (c * kBwdThreads + threadIdx.x) * kRun;
    int g[kRun];  // -1: out of range, or past the end
    if (kVector && e0 + kRun <= a.num_edges) {
        I gv[kRun];
        load_run(static_cast<const I *>(a.edge_graph) + e0, gv);
#pragma unroll
        for (int i = 0; i < kRun; i++) g[i] = gv[i] >= 0 && gv[i] < a.num_graphs ? (int)gv[i] : -1;
    } else {
#pragma unroll
        for (int i = 0; i < kRun; i++) g[i] = e0 + i < a.num_edges ? (int)graph_of<I>(a, e0 + i) : -1;
    }
    int cur = g[0];
    unsigned int n = 1;
#pragma unroll
    for (int i = 1; i < kRun; i++) {
        if (g[i] == cur) {
            n++;
        } else {
            if (cur >= 0) atomicAdd(count + cur, (unsigned long long)n);
            cur = g[i];
            n = 1;
        }
    }
    // The last run: a segmented inclusive scan over the lanes (head: a run that the lane before
    // does not continue); the lane that ends its segment adds it.
    const int prev = __shfl_up_sync(0xffffffffu, cur, 1), next = __shfl_down_sync(0xffffffffu, cur, 1);
    bool head = lane == 0 || prev != cur;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const unsigned int on = __shfl_up_sync(0xffffffffu, n, d);
        const bool oh = __shfl_up_sync(0xffffffffu, head, d);
        if (lane >= d && !head) {
            n += on;
            head = oh;
        }
    }
    if (cur >= 0 && (lane == 31 || next != cur)) atomicAdd(count + cur, (unsigned long long)n);
}

// N consecutive values to p (16-byte aligned) with streaming stores.
template <typename T, int N>
__device__ __forceinline__ void store_run(T *p, const T (&v)[N]) {
    static_assert(N * sizeof(T) % 16 == 0, "whole 16-byte vectors");
#pragma unroll
    for (int i = 0; i < (int)(N * sizeof(T) / 16); i++)
        __stcs(reinterpret_cast<uint4 *>(p) + i, reinterpret_cast<const uint4 *>(v)[i]);
}

template <typename T, typename I, bool kVector>
__device__ __forceinline__ void grad_chunk(const qk_graph_norm_bce_args &a, const unsigned long long *count, int64_t c) {
    const int64_t e0 = (c * kBwdThreads + threadIdx.x) * kRun;
    if (e0 >= a.num_edges) return;
    const float grad = __ldg(a.grad), num_graphs = (float)a.num_graphs, pw_all = pos_weight_all<T>(a);
    const bool per_edge = pos_weight_per_edge(a), full = e0 + kRun <= a.num_edges;
    float l[kRun], t[kRun], pw[kRun];
    int g[kRun];
    if (kVector && full) {
        T lv[kRun], tv[kRun];
        I gv[kRun];
        load_run(static_cast<const T *>(a.logits) + e0, lv);
        load_run(static_cast<const T *>(a.target) + e0, tv);
        load_run(static_cast<const I *>(a.edge_graph) + e0, gv);
        if (per_edge) load_pos_weights<T>(a, e0, pw);
#pragma unroll
        for (int i = 0; i < kRun; i++) {
            l[i] = qk_to_float(lv[i]);
            t[i] = qk_to_float(tv[i]);
            g[i] = gv[i] >= 0 && gv[i] < a.num_graphs ? (int)gv[i] : -1;
            if (!per_edge) pw[i] = pw_all;
        }
    } else {
#pragma unroll
        for (int i = 0; i < kRun; i++) {
            const int64_t e = e0 + i;
            const bool in = e < a.num_edges;
            l[i] = in ? qk_to_float(static_cast<const T *>(a.logits)[e * a.logits_stride]) : 0.f;
            t[i] = in ? qk_to_float(static_cast<const T *>(a.target)[e * a.target_stride]) : 0.f;
            g[i] = in ? (int)graph_of<I>(a, e) : -1;
            pw[i] = in && per_edge ? pos_weight_at<T>(a, e) : pw_all;
        }
    }
    T out[kRun];
#pragma unroll
    for (int i = 0; i < kRun; i++) {
        // Through L2: the cooperative kernel wrote the counts earlier in the same launch.
        const unsigned long long c = g[i] >= 0 ? __ldcg(count + g[i]) : 1ull;
        const float w = a.has_pos_weight ? 1.f + (pw[i] - 1.f) * t[i] : 1.f;
        // sigmoid(l) - t without cancelling 1 - e/(1+e) against t = 1 for large l (or e/(1+e) for small)
        const float e = expf(-fabsf(l[i])), q = e / (1.f + e);
        const float diff = l[i] >= 0.f ? (1.f - t[i]) - q : q - t[i];
        const float d = g[i] >= 0 ? grad * w * diff / ((float)(c > 1 ? c : 1) * num_graphs) : 0.f;
        out[i] = qk_from_float<T>(d);
    }
    T *gl = static_cast<T *>(a.grad_logits);
    if (kVector && full) {
        store_run(gl + e0, out);
    } else {
#pragma unroll
        for (int i = 0; i < kRun; i++)
            if (e0 + i < a.num_edges) gl[(e0 + i) * a.grad_stride] = out[i];
    }
}

template <typename I, bool kVector>
__global__ void __launch_bounds__(kBwdThreads) bce_count(qk_graph_norm_bce_args a, unsigned long long *count) {
    count_chunk<I, kVector>(a, count, blockIdx.x);
}

template <typename T, typename I, bool kVector>
__global__ void __launch_bounds__(kBwdThreads) bce_grad(qk_graph_norm_bce_args a, const unsigned long long *count) {
    grad_chunk<T, I, kVector>(a, count, blockIdx.x);
}

// The backward in one cooperative launch of at most a resident wave: zero the counts, count, grad,
// grid-wide syncs between (no memset, one kernel).  Chunks are block-uniform, so every block
// reaches both syncs.
template <typename T, typename I, bool kVectorIds, bool kVector>
__global__ void __launch_bounds__(kBwdThreads) bce_backward_cooperative(qk_graph_norm_bce_args a,
                                                                       unsigned long long *count) {
    cooperative_groups::grid_group grid = cooperative_groups::this_grid();
    const int64_t chunks = (a.num_edges + kBwdThreads * kRun - 1) / (kBwdThreads * kRun);
    for (int64_t g = (int64_t)blockIdx.x * kBwdThreads + threadIdx.x; g < a.num_graphs;
         g += (int64_t)gridDim.x * kBwdThreads)
        count[g] = 0;
    grid.sync();
    for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) count_chunk<I, kVectorIds>(a, count, c);
    grid.sync();
    for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) grad_chunk<T, I, kVector>(a, count, c);
}

// Launch a cooperative kernel over `blocks` blocks of `threads`: QK_OK, a status, or kNoCooperative
// where this device, or its share of SMs, cannot hold them all at once (nothing launched).
constexpr int kNoCooperative = -100;
int launch_cooperative(const void *kernel, int64_t blocks, int threads, int sms, cudaStream_t s, void **args) {
    int supported, per_sm;
    QK_CUDA_TRY((cudaError_t)qk_cooperative_supported(&supported));
    if (!supported) return kNoCooperative;
    const int st = qk_kernel_residency(kernel, threads, 0, &per_sm);
    if (st) return st;
    if ((int64_t)per_sm * sms < blocks) return kNoCooperative;
    const int r = qk_launch_cooperative(kernel, dim3((unsigned)blocks), dim3(threads), 0, s, args);
    // Fewer SMs than the device has (MPS, green contexts), or a launch path without cooperative
    // kernels: the launch was refused, nothing runs.
    if (r == cudaErrorCooperativeLaunchTooLarge || r == cudaErrorNotSupported) {
        cudaGetLastError();
        return kNoCooperative;
    }
    return r;
}

}  // namespace

extern "C" int qk_graph_norm_bce_cuda(const qk_graph_norm_bce_args *a, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    const qk_scratch *sc = a->scratch;
    // out == NULL: the loss goes to the start of the scratch block, which the caller keeps.
    const size_t out_bytes = a->out ? 0 : 16;
    if (!a->out && !(sc && sc->alloc)) return QK_E_UNSUPPORTED;
    if (a->num_edges == 0) {  // every graph contributes 0
        float *out = a->out;
        if (!out) QK_SCRATCH_TRY(sc, out_bytes, s, &out);
        const int status = qk_memset_args(sc, out, 0, sizeof(float), s);
        const int freed = a->out ? QK_OK : qk_scratch_free(sc, out, out_bytes, s);
        return status ? status : freed;
    }
    int sms;
    const int sm_status = qk_sm_count(&sms);
    if (sm_status) return sm_status;
    // One resident wave of blocks; warp ranges of a multiple of 32 * kRun edges: a function of E and
    // the device only, so the summation order (and the result's bits) is fixed for a given device.
    const int64_t G = a->num_graphs, wave = (int64_t)sms * kBlocksPerSM, warps = wave * (kThreads / 32);
    const int64_t step = 32 * kRun;
    const int64_t run_len = ((a->num_edges + warps - 1) / warps + step - 1) / step * step;
    const int64_t sorted_blocks = (a->num_edges + run_len * (kThreads / 32) - 1) / (run_len * (kThreads / 32));
    // The unsorted path takes a block per graph, up to a wave; the sorted pass the first blocks.
    const int64_t blocks = sorted_blocks > (G < wave ? G : wave) ? sorted_blocks : (G < wave ? G : wave);
    if (G > 0x7fffffff) return QK_E_UNSUPPORTED;  // ids are ints in the kernels' registers
    // Scratch layout: [out] | first | last | partial | block_unsorted (per sorted block) | graph_partial
    const size_t off_first = out_bytes, off_last = off_first + align16(sorted_blocks * sizeof(Boundary));
    const size_t off_partial = off_last + align16(sorted_blocks * sizeof(Boundary));
    const size_t off_bu = off_partial + align16(sorted_blocks * sizeof(double));
    const size_t off_gp = off_bu + align16(sorted_blocks * sizeof(int));
    const size_t total = off_gp + align16(blocks * sizeof(double));
    char *scratch = nullptr;
    QK_SCRATCH_TRY(sc, total, s, &scratch);
    Work w = {(Boundary *)(scratch + off_first), (Boundary *)(scratch + off_last), (double *)(scratch + off_partial),
              (int *)(scratch + off_bu),          (double *)(scratch + off_gp),      (long long)run_len,
              (int)sorted_blocks,                 (int)blocks};
    const bool vector = a->logits_stride == 1 && a->target_stride == 1 && a->graph_stride == 1 &&
                        qk_aligned16(a->logits) && qk_aligned16(a->target) && qk_aligned16(a->edge_graph) &&
                        pos_weights_vector(a);
    qk_graph_norm_bce_args p = *a;
    if (!p.out) p.out = (float *)scratch;
    void *args[] = {&p, &w};
    const int status = [&]() -> int {
        QK_DISPATCH_FLOAT(a->dtype, T, QK_DISPATCH_INDEX(a->index_dtype, I, {
            int r = kNoCooperative;
            if (a->variant != QK_BCE_LAUNCHES)
                r = launch_cooperative(vector ? (const void *)bce_cooperative<T, I, true>
                                              : (const void *)bce_cooperative<T, I, false>,
                                       blocks, kThreads, sms, s, args);
            if (r != kNoCooperative) return r;
            r = qk_launch(vector ? (const void *)bce_sorted<T, I, true> : (const void *)bce_sorted<T, I, false>,
                          dim3((unsigned)sorted_blocks), dim3(kThreads), 0, s, args);
            if (!r) r = qk_launch((const void *)bce_graphs<T, I>, dim3((unsigned)blocks), dim3(kThreads), 0, s, args);
            if (!r) r = qk_launch((const void *)bce_fold, dim3(1), dim3(kThreads), 0, s, args);
            return r;
        }))
        return QK_OK;
    }();
    const int freed = qk_scratch_free(sc, scratch, total, s);
    return status ? status : freed;
}

extern "C" int qk_graph_norm_bce_backward_cuda(const qk_graph_norm_bce_args *a, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    const int64_t E = a->num_edges, G = a->num_graphs;
    if (E == 0) return QK_OK;
    if (G > 0x7fffffff) return QK_E_UNSUPPORTED;  // ids are ints in the kernels' registers
    const int64_t blocks = (E + (int64_t)kBwdThreads * kRun - 1) / ((int64_t)kBwdThreads * kRun);
    if (blocks > 0x7fffffff) return QK_E_UNSUPPORTED;
    int sms;
    const int sm_status = qk_sm_count(&sms);
    if (sm_status) return sm_status;
    unsigned long long *count = nullptr;
    QK_SCRATCH_TRY(a->scratch, (size_t)G * sizeof(unsigned long long), s, &count);
    const bool vector_ids = a->graph_stride == 1 && qk_aligned16(a->edge_graph);
    const bool vector = vector_ids && a->logits_stride == 1 && a->target_stride == 1 && a->grad_stride == 1 &&
                        qk_aligned16(a->logits) && qk_aligned16(a->target) && qk_aligned16(a->grad_logits) &&
                        pos_weights_vector(a);
    qk_graph_norm_bce_args p = *a;
    const int status = [&]() -> int {
        QK_DISPATCH_FLOAT(a->dtype, T, QK_DISPATCH_INDEX(a->index_dtype, I, {
            void *count_args[] = {&p, &count};
            if (a->variant != QK_BCE_LAUNCHES) {
                const void *coop = !vector_ids ? (const void *)bce_backward_cooperative<T, I, false, false>
                                   : vector    ? (const void *)bce_backward_cooperative<T, I, true, true>
                                               : (const void *)bce_backward_cooperative<T, I, true, false>;
                int per_sm;
                int r = qk_kernel_residency(coop, kBwdThreads, 0, &per_sm);
                if (r) return r;
                const int64_t wave = (int64_t)per_sm * sms;
                r = launch_cooperative(coop, blocks < wave ? blocks : wave, kBwdThreads, sms, s, count_args);
                if (r != kNoCooperative) return r;
            }
            // Without a cooperative launch: a memset and the two passes as kernels.
            int r = (int)cudaMemsetAsync(count, 0, (size_t)G * sizeof(unsigned long long), s);
            if (!r)
                r = qk_launch(vector_ids ? (const void *)bce_count<I, true> : (const void *)bce_count<I, false>,
                              dim3((unsigned)blocks), dim3(kBwdThreads), 0, s, count_args);
            const unsigned long long *ccount = count;
            void *grad_args[] = {&p, &ccount};
            if (!r)
                r = qk_launch(vector ? (const void *)bce_grad<T, I, true> : (const void *)bce_grad<T, I, false>,
                              dim3((unsigned)blocks), dim3(kBwdThreads), 0, s, grad_args);
            return r;
        }))
        return QK_OK;
    }();
    const int freed = qk_scratch_free(a->scratch, count, (size_t)G * sizeof(unsigned long long), s);
    return status ? status : freed;
}
