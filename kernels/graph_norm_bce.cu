// graph_norm_bce: mean over graphs of the per-graph mean BCE-with-logits, deterministic.
//
// Sorted edge_graph (PyG batches), the fast path, is one pass over the data (bce_sorted).  The
// grid is one resident wave; each warp owns a contiguous range of edges, read 256 at a time with
// coalesced vector loads, 8 consecutive edges per lane.  A lane finishes the graphs that start
// and end among its 8 edges in registers; its first and last segment meet the other lanes'
// through one warp scan, and the segment open at the end of a step is carried to the next.  The
// warps' first/last segments are folded per block, the blocks' per block by the last block to
// finish (atomic counter), all in a fixed order: no per-graph arrays, no extra kernel.
// Bytes: logits, target and edge_graph read once (E=4M fp32/int64: 64 MB, ~15 µs at 4.2 TB/s)
// plus O(blocks).  docs/graph-ops.md has the measured time.
// Unsorted input (detected on the device; no host round trip) takes a slower deterministic path,
// a second kernel that returns at once for sorted input: one block per graph scans all edges.
// Edges whose graph id is out of range are skipped.  Scratch comes from the stream-ordered
// allocator; one 8-byte memset zeroes the two block counters.
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
    Boundary *first, *last;    // per block: the segments of its range's first and last graph
    double *partial;           // per block: sum over graphs finished inside it of sum / count
    int *block_unsorted;       // per block
    unsigned int *done;        // [2] finished-block counters (zeroed by the launcher)
    int *unsorted;             // written by the sorted kernel's last block
    float *graph_sum;          // unsorted path: per graph
    unsigned int *graph_count;
    long long run_len;  // edges per warp, a multiple of 32 * kRun
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

// The last block of the sorted kernel: boundaries first_0, last_0, first_1, ... are sorted by graph.
// Thread i takes block i's pair (and its partial) in one round of loads, merges equal neighbours
// with a segmented scan, adds each merged graph's mean, then everything in a fixed order.
__device__ __noinline__ void fold_sorted(const qk_graph_norm_bce_args &a, const Work &w, int nblocks) {
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
    int unsorted = 0;
    for (int t0 = 0; t0 < nblocks; t0 += kThreads) {
        const int i = t0 + threadIdx.x;
        Boundary f = {-1, 0.f, 0u}, l = {-1, 0.f, 0u};
        if (i < nblocks) {
            f = load_boundary(w.first + i);
            l = load_boundary(w.last + i);
            acc += __ldcg(w.partial + i);
            unsorted |= __ldcg(w.block_unsorted + i);
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
    unsorted = __syncthreads_or(unsorted);
    if (threadIdx.x == 0) *w.unsorted = unsorted;
    if (unsorted) return;  // bce_per_graph takes over
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
// graph go to the boundary list for the last block's fold.  Per edge: a load, the bce and an add:
// a block scan per edge range is bound by the scan's instructions, and per-thread runs (lanes 128
// bytes apart) over-fetch DRAM (docs/graph-ops.md).  kVector: unit strides and 16-byte aligned
// arrays: whole vector loads.
template <typename T, typename I, bool kVector>
__global__ void __launch_bounds__(kThreads, kBlocksPerSM) bce_sorted(qk_graph_norm_bce_args a, Work w) {
    constexpr int kWarps = kThreads / 32;
    __shared__ Run warp_first[kWarps], warp_last[kWarps];
    __shared__ double warp_acc[kWarps];
    __shared__ bool is_last;
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
            __threadfence();  // this block's results are visible before it counts itself done
            is_last = atomicAdd(w.done, 1u) == gridDim.x - 1;
        }
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    fold_sorted(a, w, (int)gridDim.x);
}

// Unsorted input only: one block per graph, all edges, fixed-order reductions; the last block
// takes the mean over graphs.
template <typename T, typename I>
__global__ void __launch_bounds__(kThreads) bce_per_graph(qk_graph_norm_bce_args a, Work w) {
    if (!*(volatile int *)w.unsorted) return;
    using Reduce = cub::BlockReduce<float, kThreads>;
    using ReduceCount = cub::BlockReduce<unsigned int, kThreads>;
    using ReduceMean = cub::BlockReduce<double, kThreads>;
    __shared__ typename Reduce::TempStorage sum_storage;
    __shared__ typename ReduceCount::TempStorage count_storage;
    __shared__ typename ReduceMean::TempStorage mean_storage;
    __shared__ bool is_last;
    const float pw_all = pos_weight_all<T>(a);
    for (int64_t g = blockIdx.x; g < a.num_graphs; g += gridDim.x) {
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
        if (threadIdx.x == 0) {
            w.graph_sum[g] = sum;
            w.graph_count[g] = count;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        __threadfence();
        is_last = atomicAdd(w.done + 1, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    double total = 0;
    for (int64_t g = threadIdx.x; g < a.num_graphs; g += kThreads) {
        const unsigned int c = __ldcg(w.graph_count + g);
        total += (double)__ldcg(w.graph_sum + g) / (double)(c > 1 ? c : 1);
    }
    total = ReduceMean(mean_storage).Sum(total);
    if (threadIdx.x == 0) *a.out = (float)(total / (double)a.num_graphs);
}

size_t align16(size_t n) { return (n + 15) / 16 * 16; }

// Per-edge pos_weight read by whole vectors (or none per edge).
bool pos_weights_vector(const qk_graph_norm_bce_args *a) {
    return a->pos_weight_t == nullptr || a->pw_stride == 0 || (a->pw_stride == 1 && qk_aligned16(a->pos_weight_t));
}

// ---- backward -------------------------------------------------------------------------------
//
// d loss / d l_e = grad * w_e * (sigmoid(l_e) - t_e) / (max(count_g, 1) * num_graphs): a count pass
// over edge_graph, then one elementwise pass with a gather of the count.  The counts are integer
// atomics (exact in any order, so deterministic) into a [num_graphs] array from the stream-ordered
// allocator.  Each thread takes kRun consecutive edges (coalesced vector loads where the layout
// allows) and adds each run of one graph once; the run open at a lane's end joins the neighbouring
// lanes' through a segmented warp scan, so sorted ids cost about one atomic per 256 edges and
// unsorted ids stay right.  Bytes: edge_graph twice, logits and target once, grad_logits written.

constexpr int kBwdThreads = 256;

template <typename I, bool kVector>
__global__ void __launch_bounds__(kBwdThreads) bce_count(qk_graph_norm_bce_args a, unsigned long long *count) {
    const int lane = threadIdx.x & 31;
    const int64_t e0 = ((int64_t)blockIdx.x * kBwdThreads + threadIdx.x) * kRun;
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
__global__ void __launch_bounds__(kBwdThreads) bce_grad(qk_graph_norm_bce_args a, const unsigned long long *count) {
    const int64_t e0 = ((int64_t)blockIdx.x * kBwdThreads + threadIdx.x) * kRun;
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
        const unsigned long long c = g[i] >= 0 ? __ldg(count + g[i]) : 1ull;
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

}  // namespace

extern "C" int qk_graph_norm_bce_cuda(const qk_graph_norm_bce_args *a, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    if (a->num_edges == 0) return qk_memset_args(a->scratch, a->out, 0, sizeof(float), s);  // every graph contributes 0
    int sms;
    const int sm_status = qk_sm_count(&sms);
    if (sm_status) return sm_status;
    // One resident wave of blocks; warp ranges of a multiple of 32 * kRun edges: a function of E and
    // the device only, so the summation order (and the result's bits) is fixed for a given device.
    const int64_t G = a->num_graphs, warps = (int64_t)sms * kBlocksPerSM * (kThreads / 32), step = 32 * kRun;
    const int64_t run_len = ((a->num_edges + warps - 1) / warps + step - 1) / step * step;
    const int64_t nblocks = (a->num_edges + run_len * (kThreads / 32) - 1) / (run_len * (kThreads / 32));
    // Sorted input: this kernel only checks a flag, so a small grid; unsorted: one block per graph.
    const int per_graph_blocks = (int)(G < 2 * sms ? G : 2 * sms);
    if (G > 0x7fffffff) return QK_E_UNSUPPORTED;  // ids are ints in the kernels' registers
    // Scratch layout: counters | unsorted flag | first | last | partial | block_unsorted | graph_sum | graph_count
    const size_t off_flag = 16, off_first = 32, off_last = off_first + align16(nblocks * sizeof(Boundary));
    const size_t off_partial = off_last + align16(nblocks * sizeof(Boundary));
    const size_t off_bu = off_partial + align16(nblocks * sizeof(double));
    const size_t off_sum = off_bu + align16(nblocks * sizeof(int));
    const size_t off_count = off_sum + align16(G * sizeof(float)), total = off_count + align16(G * sizeof(unsigned));
    char *scratch = nullptr;
    QK_SCRATCH_TRY(a->scratch, total, s, &scratch);
    Work w = {(Boundary *)(scratch + off_first), (Boundary *)(scratch + off_last), (double *)(scratch + off_partial),
              (int *)(scratch + off_bu), (unsigned int *)scratch, (int *)(scratch + off_flag),
              (float *)(scratch + off_sum), (unsigned int *)(scratch + off_count), (long long)run_len};
    int status = (int)cudaMemsetAsync(scratch, 0, 2 * sizeof(unsigned int), s);
    const bool vector = a->logits_stride == 1 && a->target_stride == 1 && a->graph_stride == 1 &&
                        qk_aligned16(a->logits) && qk_aligned16(a->target) && qk_aligned16(a->edge_graph) &&
                        pos_weights_vector(a);
    qk_graph_norm_bce_args p = *a;
    void *args[] = {&p, &w};
    if (!status) {
        status = [&]() -> int {
            QK_DISPATCH_FLOAT(a->dtype, T, QK_DISPATCH_INDEX(a->index_dtype, I, {
                int r = qk_launch(vector ? (const void *)bce_sorted<T, I, true> : (const void *)bce_sorted<T, I, false>,
                                  dim3((unsigned)nblocks), dim3(kThreads), 0, s, args);
                // Sorted input leaves this kernel nothing to do: one small wave that exits at once.
                if (!r)
                    r = qk_launch((const void *)bce_per_graph<T, I>, dim3((unsigned)per_graph_blocks), dim3(kThreads), 0,
                                  s, args);
                return r;
            }))
            return QK_OK;
        }();
    }
    const int freed = qk_scratch_free(a->scratch, scratch, total, s);
    return status ? status : freed;
}

extern "C" int qk_graph_norm_bce_backward_cuda(const qk_graph_norm_bce_args *a, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    const int64_t E = a->num_edges, G = a->num_graphs;
    if (E == 0) return QK_OK;
    if (G > 0x7fffffff) return QK_E_UNSUPPORTED;  // ids are ints in the kernels' registers
    const int64_t blocks = (E + (int64_t)kBwdThreads * kRun - 1) / ((int64_t)kBwdThreads * kRun);
    if (blocks > 0x7fffffff) return QK_E_UNSUPPORTED;
    unsigned long long *count = nullptr;
    QK_SCRATCH_TRY(a->scratch, (size_t)G * sizeof(unsigned long long), s, &count);
    int status = (int)cudaMemsetAsync(count, 0, (size_t)G * sizeof(unsigned long long), s);
    const bool vector_ids = a->graph_stride == 1 && qk_aligned16(a->edge_graph);
    const bool vector = vector_ids && a->logits_stride == 1 && a->target_stride == 1 && a->grad_stride == 1 &&
                        qk_aligned16(a->logits) && qk_aligned16(a->target) && qk_aligned16(a->grad_logits) &&
                        pos_weights_vector(a);
    qk_graph_norm_bce_args p = *a;
    if (!status) {
        status = [&]() -> int {
            QK_DISPATCH_FLOAT(a->dtype, T, QK_DISPATCH_INDEX(a->index_dtype, I, {
                void *count_args[] = {&p, &count};
                int r = qk_launch(vector_ids ? (const void *)bce_count<I, true> : (const void *)bce_count<I, false>,
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
    }
    const int freed = qk_scratch_free(a->scratch, count, (size_t)G * sizeof(unsigned long long), s);
    return status ? status : freed;
}
