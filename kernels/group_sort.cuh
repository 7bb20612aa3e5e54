// Grouping items by node on the device, for the graph ops' backward kernels (sparse_aggregate.cu,
// fused_edge_features.cu): each item gets a key (its node, or `num_keys` for an item to leave out)
// and a value (its id), and CUB's LSD radix sort orders the pairs by key.  The sort is stable and
// the values start in ascending order, so each node's items come out in ascending id: a fixed
// summation order, whatever the GPU.  Sizes are host values and nothing is read back, so the
// launches are CUDA-graph safe.
#pragma once
#include "common.cuh"

#include <cub/device/device_radix_sort.cuh>

// Offsets of the buffers carved from one stream-ordered allocation, 256-byte aligned.
struct qk_scratch_layout {
    size_t bytes = 0;
    size_t take(size_t n) {
        const size_t off = (bytes + 255) & ~(size_t)255;
        bytes = off + n;
        return off;
    }
};

// Bits that hold every key 0 .. n (the sort's end_bit; n itself is the key of a left-out item).
inline int qk_bit_width(uint64_t n) {
    int b = 0;
    for (; n; n >>= 1) b++;
    return b;
}

// keys/values: DoubleBuffers over n items; temp == nullptr asks for temp_bytes only (host work).
// The sorted pairs are in keys.Current() / values.Current() afterwards (chosen on the host).
template <typename U>
cudaError_t qk_sort_pairs(void *temp, size_t &temp_bytes, cub::DoubleBuffer<U> &keys, cub::DoubleBuffer<U> &values,
                          U n, int end_bit, cudaStream_t s) {
    return cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys, values, n, 0, end_bit, s);
}

// Zero the rows (row_elems contiguous elements each) of the nodes no item was grouped under:
// the backward kernels write only the nodes they visit.  A warp per row, so a marked row costs
// one read of its mark.  Launch with 256 threads and qk_grid_for(rows, 8).
template <typename T>
__global__ void __launch_bounds__(256) qk_zero_unmarked(T *out, const uint8_t *marked, int64_t rows, int64_t row_elems) {
    const int lane = threadIdx.x & 31;
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x >> 5);
    for (int64_t r = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps)
        if (!marked[r])
            for (int64_t i = lane; i < row_elems; i += 32) out[r * row_elems + i] = qk_from_float<T>(0.f);
}

// Items per walker (a lane group walking consecutive sorted items): a power of two in [16, 256],
// so that small inputs still spread over every SM (one wave of `walkers` groups) while large ones
// keep 256-item walks and few boundary partials.
inline int qk_walk_chunk(int64_t items, int64_t walkers) {
    int chunk = 16;
    while (chunk < 256 && (items + chunk - 1) / chunk > walkers) chunk *= 2;
    return chunk;
}

// The nodes whose items cross chunk boundaries: the chunk where one starts adds its slot 1 and the
// following chunks' slot 0 (row_elems fp32 partials each), in chunk order, and writes the row.
// Groups of G lanes hold K 16-byte vectors each; launch with 256 threads.
template <typename T, int G, int K>
__global__ void __launch_bounds__(256) qk_walk_fixup(T *out, const uint32_t *keys, const float *slots, int64_t M,
                                                     int chunk, uint32_t N, int row_elems) {
    constexpr int V = qk_vec<T>::N;
    const int lane = threadIdx.x % G, nvec = row_elems / V;
    const int64_t nchunks = (M + chunk - 1) / chunk, groups = (int64_t)gridDim.x * (blockDim.x / G);
    for (int64_t ch = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / G; ch < nchunks; ch += groups) {
        const int64_t k0 = ch * chunk, k1 = k0 + chunk;
        if (k1 >= M) continue;
        const uint32_t j = keys[k1 - 1];
        if (j >= N || keys[k1] != j || (k0 > 0 && keys[k0] == j && keys[k0 - 1] == j)) continue;
        float acc[K][V];
#pragma unroll
        for (int k = 0; k < K; k++)
#pragma unroll
            for (int v = 0; v < V; v++) acc[k][v] = 0.f;
        for (int64_t c = ch; c < nchunks && (c == ch || keys[c * chunk] == j); c++) {
            const float *slot = slots + (2 * c + (c == ch ? 1 : 0)) * row_elems;
#pragma unroll
            for (int k = 0; k < K; k++) {
                const int cc = lane + G * k;
                if (cc < nvec)
#pragma unroll
                    for (int v = 0; v < V; v++) acc[k][v] += slot[cc * V + v];
            }
        }
        qk_store_row<T, G, K>(out + (int64_t)j * row_elems, acc, lane, nvec);
    }
}

// First position in sorted keys[0, n) whose key is >= key.
template <typename U>
__device__ __forceinline__ int64_t qk_lower_bound(const U *keys, int64_t n, uint64_t key) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if ((uint64_t)keys[mid] < key) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// Zero the rows a plan gives no entries (ptr[r] >= ptr[r + 1]): the plan-walking backward's
// counterpart of qk_zero_unmarked.  Launch with 256 threads and qk_grid_for(rows, 8).
template <typename T>
__global__ void __launch_bounds__(256) qk_zero_empty(T *out, const int32_t *ptr, int64_t rows, int64_t row_elems) {
    const int lane = threadIdx.x & 31;
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x >> 5);
    for (int64_t r = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps)
        if (ptr[r] >= ptr[r + 1])
            for (int64_t i = lane; i < row_elems; i += 32) out[r * row_elems + i] = qk_from_float<T>(0.f);
}

// A plan from the sorted pairs (sparse_aggregate_plan, fused_edge_features_plan): ptr[0..n] (the
// first position of each key, by binary search), then keys[m], values[m] and, when row_of is given,
// row_of[value] per position.  Launched by qk_plan_write_launch.
template <typename U>
__global__ void __launch_bounds__(256) qk_plan_write(int32_t *plan, const U *keys, const U *values, const U *row_of,
                                                     int64_t m, int64_t n) {
    int32_t *ptr = plan, *pk = plan + n + 1, *pv = pk + m, *pr = pv + m;
    const int64_t total = m > n + 1 ? m : n + 1;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        if (i <= n) ptr[i] = (int32_t)qk_lower_bound(keys, m, (uint64_t)i);
        if (i < m) {
            const U v = values[i];
            pk[i] = (int32_t)keys[i];
            pv[i] = (int32_t)v;
            if (row_of) pr[i] = (int32_t)row_of[v];
        }
    }
}

// qk_plan_write over m sorted pairs of keys below n (row_of may be NULL) into plan.
inline int qk_plan_write_launch(int32_t *plan, const uint32_t *keys, const uint32_t *values, const uint32_t *row_of,
                                int64_t m, int64_t n, cudaStream_t s) {
    void *args[] = {&plan, &keys, &values, &row_of, &m, &n};
    return qk_launch((const void *)qk_plan_write<uint32_t>, dim3(qk_grid_for(m > n + 1 ? m : n + 1, 256, 132 * 16)),
                     dim3(256), 0, s, args);
}
