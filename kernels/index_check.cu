// QKERNELS_CHECK=1 on cuda: the first index outside [lo, hi), found on the device.  Debug mode
// only: the launcher synchronises the stream so the host can raise a ValueError naming it.
#include "common.cuh"

namespace {

template <typename I>
__global__ void first_bad_index(const I *p, int64_t n, int64_t stride, int64_t lo, int64_t hi,
                                unsigned long long *first) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t v = (int64_t)p[i * stride];
        if (v < lo || v >= hi) atomicMin(first, (unsigned long long)i);  // the smallest position wins
    }
}

}  // namespace

extern "C" int qk_index_check_cuda(const void *p, int dtype, int64_t n, int64_t stride, int64_t lo, int64_t hi,
                                   int64_t *bad_pos, int64_t *bad_value, void *stream) {
    if (n <= 0) return QK_OK;
    cudaStream_t s = (cudaStream_t)stream;
    unsigned long long *first = nullptr, host = 0;
    QK_CUDA_TRY(cudaMallocAsync((void **)&first, sizeof host, s));
    cudaError_t e = cudaMemsetAsync(first, 0xff, sizeof host, s);
    const int grid = qk_grid_for(n, 256, 4096);
    if (e == cudaSuccess) {
        if (dtype == QK_I64) first_bad_index<int64_t><<<grid, 256, 0, s>>>(static_cast<const int64_t *>(p), n, stride, lo, hi, first);
        else first_bad_index<int32_t><<<grid, 256, 0, s>>>(static_cast<const int32_t *>(p), n, stride, lo, hi, first);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess) e = cudaMemcpyAsync(&host, first, sizeof host, cudaMemcpyDeviceToHost, s);
    cudaFreeAsync(first, s);
    if (e == cudaSuccess) e = cudaStreamSynchronize(s);
    if (e != cudaSuccess) return (int)e;
    if (host == ~0ull) return QK_OK;
    *bad_pos = (int64_t)host;
    // One element back to the host for the message.
    const size_t es = dtype == QK_I64 ? 8 : 4;
    int64_t v64 = 0;
    int32_t v32 = 0;
    e = cudaMemcpyAsync(dtype == QK_I64 ? (void *)&v64 : (void *)&v32, static_cast<const char *>(p) + (size_t)host * stride * es,
                        es, cudaMemcpyDeviceToHost, s);
    if (e == cudaSuccess) e = cudaStreamSynchronize(s);
    if (e != cudaSuccess) return (int)e;
    *bad_value = dtype == QK_I64 ? v64 : v32;
    return QK_E_INDEX;
}
