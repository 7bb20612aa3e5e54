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

template <typename Index>
__device__ __forceinline__ int64_t qk_load_index(const void *base, int64_t pos, int64_t stride) {
    return (int64_t)__ldg(static_cast<const Index *>(base) + pos * stride);
}
