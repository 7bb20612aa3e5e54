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
