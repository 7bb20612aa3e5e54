// Helpers shared by the .cu files: status-returning error checks and index loads.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>
#include "qk_launch.h"

// Return the CUDA status from the enclosing launcher instead of printing or exiting.
#define QK_CUDA_TRY(expr)                                  \
    do {                                                   \
        cudaError_t qk_err_ = (expr);                      \
        if (qk_err_ != cudaSuccess) return (int)qk_err_;   \
    } while (0)

// After a <<<>>> launch: configuration errors surface here, not at the next sync.
#define QK_LAUNCH_CHECK() QK_CUDA_TRY(cudaGetLastError())

// Launch `kernel` (a __global__ function's address) with its parameters in `args`, through the
// driver's cuLaunchKernel and a context-independent kernel handle: on the H200 VM that costs
// ~0.3 µs less host time per call than <<<>>> (benchmarks/probe/launch_cost.cu), which matters
// for decode-sized calls.  Falls back to cudaLaunchKernel.  Returns a status (runtime.cu).
int qk_launch(const void *kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, void **args);

template <typename Index>
__device__ __forceinline__ int64_t qk_load_index(const void *base, int64_t pos, int64_t stride) {
    return (int64_t)__ldg(static_cast<const Index *>(base) + pos * stride);
}
