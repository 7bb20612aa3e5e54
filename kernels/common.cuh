// Helpers shared by the .cu files: status-returning error checks and index loads.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cooperative_groups.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "qkernels/launch.h"

// fp32 arithmetic for every storage type.
__device__ __forceinline__ float qk_to_float(float v) { return v; }
__device__ __forceinline__ float qk_to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float qk_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
// Value hi (0: the low 16 bits, 1: the high) of a word holding two 2-byte values, by bit
// operations on the word (16-byte vectors unpacked without local copies).
template <typename T> __device__ __forceinline__ float qk_word_half(uint32_t w, int hi);
template <> __device__ __forceinline__ float qk_word_half<__nv_bfloat16>(uint32_t w, int hi) {
    return __uint_as_float(hi ? w & 0xffff0000u : w << 16);
}
template <> __device__ __forceinline__ float qk_word_half<__half>(uint32_t w, int hi) {
    return __half2float(__ushort_as_half((unsigned short)(hi ? w >> 16 : w & 0xffffu)));
}
template <typename T> __device__ __forceinline__ T qk_from_float(float v);
template <> __device__ __forceinline__ float qk_from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half qk_from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 qk_from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// 16 bytes of T, for vector loads and stores.
template <typename T> struct alignas(16) qk_vec {
    static constexpr int N = 16 / sizeof(T);
    T v[N];
};

template <typename T> __device__ __forceinline__ qk_vec<T> qk_load_vec(const T *p) {
    uint4 raw = __ldg(reinterpret_cast<const uint4 *>(p));
    return *reinterpret_cast<qk_vec<T> *>(&raw);
}
// Streaming store: outputs written once are kept out of the way of gathered inputs in L2.
template <typename T> __device__ __forceinline__ void qk_store_vec(T *p, const qk_vec<T> &v) {
    __stcs(reinterpret_cast<uint4 *>(p), *reinterpret_cast<const uint4 *>(&v));
}

// Lanes of the group that owns a row of nvec 16-byte vectors: 8 or 16 for short rows, so a warp
// serves several rows instead of idling most of its lanes, else the warp.
inline int qk_row_lanes(int64_t nvec) { return nvec <= 8 ? 8 : nvec <= 16 ? 16 : 32; }

// A row of fp32 accumulators rounded once to T and stored: lane `lane` of a group of G lanes owns the
// 16-byte vectors lane + G*k (k < K) of the row's nvec.
template <typename T, int G, int K>
__device__ __forceinline__ void qk_store_row(T *row, const float (&acc)[K][qk_vec<T>::N], int lane, int nvec) {
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int c = lane + G * k;
        if (c >= nvec) continue;
        qk_vec<T> o;
#pragma unroll
        for (int j = 0; j < qk_vec<T>::N; j++) o.v[j] = qk_from_float<T>(acc[k][j]);
        qk_store_vec(row + c * qk_vec<T>::N, o);
    }
}

// Tensor-core mma.sync m16n8k16 with fp32 accumulation, d += A * B: A row-major 16x16 in four
// registers of two elements, B column-major 16x8 in two (PTX ISA "Matrix Fragments for
// mma.m16n8k16").  Shared by linear and the decode attention kernels.
template <typename T>
__device__ __forceinline__ void qk_mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                            uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void qk_mma16816<__nv_bfloat16>(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                                           uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void qk_mma16816<__half>(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                    uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

inline bool qk_aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

// The one place runtime dtypes become template parameters.
#define QK_DISPATCH_FLOAT(dtype, T, ...)                         \
    switch (dtype) {                                             \
    case QK_F32: { using T = float; __VA_ARGS__; break; }        \
    case QK_F16: { using T = __half; __VA_ARGS__; break; }       \
    case QK_BF16: { using T = __nv_bfloat16; __VA_ARGS__; break; } \
    default: return QK_E_UNSUPPORTED;                            \
    }
#define QK_DISPATCH_INDEX(dtype, I, ...)                         \
    switch (dtype) {                                             \
    case QK_I32: { using I = int32_t; __VA_ARGS__; break; }      \
    case QK_I64: { using I = int64_t; __VA_ARGS__; break; }      \
    default: return QK_E_UNSUPPORTED;                            \
    }

// Grid for a grid-stride loop over `work` items: enough blocks to fill any current GPU, a
// function of the shapes only (CUDA-graph safe).
inline int qk_grid_for(int64_t work, int per_block, int max_blocks = 65536) {
    int64_t blocks = (work + per_block - 1) / per_block;
    return (int)(blocks < max_blocks ? (blocks > 0 ? blocks : 1) : max_blocks);
}

// Return the CUDA status from the enclosing launcher instead of printing or exiting.
#define QK_CUDA_TRY(expr)                                  \
    do {                                                   \
        cudaError_t qk_err_ = (expr);                      \
        if (qk_err_ != cudaSuccess) return (int)qk_err_;   \
    } while (0)

// A launcher's temporary device memory: from the args struct's scratch hook when it has one (under
// qkernels.jax a block of the call's scratch result), else the stream-ordered pool.  Every launcher goes
// through these two.
inline int qk_scratch_alloc(const qk_scratch *sc, size_t bytes, cudaStream_t s, void **p) {
    *p = nullptr;
    if (bytes == 0) return QK_OK;
    if (sc && sc->alloc) return sc->alloc(sc->ctx, bytes, (void *)s, p);
    return (int)cudaMallocAsync(p, bytes, s);
}
inline int qk_scratch_free(const qk_scratch *sc, void *p, size_t bytes, cudaStream_t s) {
    if (!p) return QK_OK;
    if (sc && sc->free) return sc->free(sc->ctx, p, bytes, (void *)s);
    return (int)cudaFreeAsync(p, s);
}
// cudaMemsetAsync on a launcher's arguments, left out in a dry run (qk_scratch.dry_run), whose
// arguments are stand-in addresses the driver would refuse at capture.
inline int qk_memset_args(const qk_scratch *sc, void *p, int value, size_t bytes, cudaStream_t s) {
    if (sc && sc->dry_run) return QK_OK;
    return (int)cudaMemsetAsync(p, value, bytes, s);
}
#define QK_SCRATCH_TRY(sc, bytes, s, pp)                                  \
    do {                                                                  \
        const int qk_st_ = qk_scratch_alloc((sc), (bytes), (s), (void **)(pp)); \
        if (qk_st_) return qk_st_;                                        \
    } while (0)

// Launch `kernel` (a __global__ function's address) with its parameters in `args`, through the
// driver's cuLaunchKernel and a context-independent kernel handle: less host time per call than
// <<<>>> (benchmarks/probe/launch_cost.cu), which matters for decode-sized calls.  Falls back to
// cudaLaunchKernel.  Returns a status (runtime.cu).
int qk_launch(const void *kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, void **args);

// The same, as a programmatic dependent of the previous kernel on the stream where the device
// supports it (sm_90): the kernel may start before that one ends and must begin with
// griddepcontrol.wait before reading its results.  Otherwise a plain launch.
int qk_launch_dependent(const void *kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, void **args);

// A cudaLaunchKernelExC configuration with the n launch attributes at attr (which must outlive it),
// and the attribute for thread-block clusters of x CTAs along x (sm_90).
inline cudaLaunchConfig_t qk_launch_config(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, cudaLaunchAttribute *attr,
                                           unsigned n = 1) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = n;
    return cfg;
}
// The attribute that makes a launch a programmatic dependent of the previous kernel on its stream.
inline cudaLaunchAttribute qk_dependent_attr() {
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    return attr;
}
inline cudaLaunchAttribute qk_cluster_attr(unsigned x) {
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = x;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    return attr;
}
// `kernel` in thread-block clusters of cs CTAs along x (sm_90); cs == 1: a plain launch.  dependent:
// also as a programmatic dependent (see qk_launch_dependent; clusters exist only from sm_90, as it).
inline int qk_launch_clusters(const void *kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, void **args,
                              unsigned cs, bool dependent = false) {
    if (cs == 1)
        return dependent ? qk_launch_dependent(kernel, grid, block, smem, stream, args)
                         : qk_launch(kernel, grid, block, smem, stream, args);
    cudaLaunchAttribute attr[2] = {qk_cluster_attr(cs), qk_dependent_attr()};
    const cudaLaunchConfig_t cfg = qk_launch_config(grid, block, smem, stream, attr, dependent ? 2 : 1);
    return (int)cudaLaunchKernelExC(&cfg, kernel, args);
}

// In a kernel launched as a programmatic dependent: wait until the previous kernel on the stream
// has finished and its writes are visible (nothing in global memory may be touched before).
// Without qk_dependent_launch the next kernel is scheduled when this one ends.  No-op on a plain
// launch and before sm_90.
__device__ __forceinline__ void qk_dependent_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// Let the next kernel on the stream be scheduled now (it waits with qk_dependent_wait, so that is
// always safe).  It pays where this grid keeps one CTA per SM to the end (the row kernel) and where
// the grid fits one wave (the norms, rotary append and decode attention at decode sizes:
// docs/decode-step.md); where blocks share SMs the early start can cost (the GEMV does not trigger;
// docs/linear.md).
__device__ __forceinline__ void qk_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// The start of a small kernel launched as a programmatic dependent: wait for the previous kernel,
// then, where its grid fits one wave (early), let the next one be scheduled at once.
__device__ __forceinline__ void qk_dependent_enter(int early) {
    qk_dependent_wait();
    if (early) qk_dependent_launch();
}

// swiglu's epilogue in fp32, before its one rounding: up * silu(gate), silu(g) = g / (1 + e^-g)
// (the CPU kernel, csrc/cpu/linear.c, computes the same expression).
__device__ __forceinline__ float qk_silu_mul(float up, float gate) { return up * (gate / (1.f + expf(-gate))); }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The sum over the ranks 0 .. cs-1 of a thread-block cluster of the float at `p` in each rank's
// shared memory (cs <= 8), added in rank order (bitwise reproducible: the linear kernels' split-K merge).
__device__ __forceinline__ float qk_cluster_sum(const float *p, int cs) {
    cooperative_groups::cluster_group cl = cooperative_groups::this_cluster();
    float part[8];  // every rank's partial loaded before the sum: the loads overlap
#pragma unroll
    for (int r = 0; r < 8; r++) part[r] = r < cs ? cl.map_shared_rank(p, r)[0] : 0.f;
    float sum = part[0];
#pragma unroll
    for (int r = 1; r < 8; r++)
        if (r < cs) sum += part[r];
    return sum;
}
#endif

// cp.async groups (sm_80+): close the copies issued so far into a group; wait until at most N
// groups are pending.  The copies themselves are per kernel family (attn_common.cuh, linear.cu).
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// The K-split cluster size a->split forces on linear's sm_90 kernels (include/qkernels/launch.h), or 0 where the
// launcher picks (0, or not one of 1, 2, 4, 8).
inline int qk_linear_split(const qk_linear_args *a) {
    const int v = a->split;
    return v >= 1 && v <= 8 && (v & (v - 1)) == 0 ? v : 0;
}

// Raise `kernel`'s dynamic shared-memory limit to `smem` on the current device and report how many
// CTAs of `threads` threads fit on one SM (*per_sm >= 1; per_sm may be null).  Once per kernel and device (the
// attribute belongs to the device's module); later calls read a cache.  Returns a status.
int qk_kernel_residency(const void *kernel, int threads, size_t smem, int *per_sm);

// A CUDA driver function by name (the 12.0 ABI), resolved through the runtime so the library does
// not link libcuda; nullptr when the driver lacks it.
void *qk_driver_entry(const char *name);

// The current device's compute capability as 10 * major + minor (cached), for kernel choices.
int qk_device_cc(int *cc);

// The current device's SM count (cached), for grids sized to one resident wave.
int qk_sm_count(int *count);

// Whether the current device takes cooperative launches (cached; *supported 0 or 1).
int qk_cooperative_supported(int *supported);

// qk_launch as a cooperative launch (all blocks resident at once: grid-wide syncs are allowed), through
// the driver's cuLaunchKernelEx where it resolves.  The caller checks that the grid fits one wave.
int qk_launch_cooperative(const void *kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, void **args);

template <typename Index>
__device__ __forceinline__ int64_t qk_load_index(const void *base, int64_t pos, int64_t stride) {
    return (int64_t)__ldg(static_cast<const Index *>(base) + pos * stride);
}
