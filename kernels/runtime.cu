// The CUDA shared object's one entry point, qk_cuda_get_api: a table of device utilities and
// op launchers that the C module loads with dlopen at first CUDA use (see include/qkernels/launch.h).
#include "common.cuh"
#include <cuda.h>
#include <cudaTypedefs.h>
#include <mutex>
#include <string.h>

// ---- kernel launches through the driver ------------------------------------------------------

void *qk_driver_entry(const char *name) {
    void *fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
        cudaGetLastError();
        return nullptr;
    }
    return fn;
}

namespace {

PFN_cuLaunchKernel_v4000 resolve_cu_launch() { return (PFN_cuLaunchKernel_v4000)qk_driver_entry("cuLaunchKernel"); }

// Per kernel: its driver handle and, per device, how many of its CTAs fit on an SM once its shared-
// memory limit is raised (0: not yet).  Slots are written under the mutex and read without it once
// published.
constexpr int kMaxKernels = 1024;  // distinct kernels a process launches (template instances)
constexpr int kMaxDevices = 64;
struct KernelSlot {
    const void *fn;
    cudaKernel_t handle;
    int per_sm[kMaxDevices];
};
KernelSlot g_slots[kMaxKernels];
int g_num_slots;  // published with release semantics after the slot is filled
std::mutex g_slots_mutex;

// fn's slot, made on first use; nullptr when the table is full.
KernelSlot *kernel_slot(const void *fn) {
    const int n = __atomic_load_n(&g_num_slots, __ATOMIC_ACQUIRE);
    for (int i = 0; i < n; i++)
        if (g_slots[i].fn == fn) return &g_slots[i];
    std::lock_guard<std::mutex> lock(g_slots_mutex);
    for (int i = 0; i < g_num_slots; i++)
        if (g_slots[i].fn == fn) return &g_slots[i];
    if (g_num_slots >= kMaxKernels) return nullptr;
    cudaKernel_t h = nullptr;
    if (cudaGetKernel(&h, fn) != cudaSuccess) {
        cudaGetLastError();
        h = nullptr;
    }
    KernelSlot *slot = &g_slots[g_num_slots];
    slot->fn = fn;
    slot->handle = h;
    __atomic_store_n(&g_num_slots, g_num_slots + 1, __ATOMIC_RELEASE);
    return slot;
}

cudaKernel_t kernel_handle(const void *fn) {
    const KernelSlot *slot = kernel_slot(fn);
    return slot ? slot->handle : nullptr;
}

}  // namespace

int qk_launch(const void *kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, void **args) {
    static const PFN_cuLaunchKernel_v4000 cu_launch = resolve_cu_launch();
    const cudaKernel_t h = cu_launch ? kernel_handle(kernel) : nullptr;
    if (h == nullptr) return (int)cudaLaunchKernel(kernel, grid, block, args, smem, stream);
    // CUresult and cudaError_t share their numbering for launch errors.
    return (int)cu_launch((CUfunction)h, grid.x, grid.y, grid.z, block.x, block.y, block.z, (unsigned)smem,
                          (CUstream)stream, args, nullptr);
}

int qk_launch_dependent(const void *kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, void **args) {
    // Programmatic dependent launch needs sm_90.
    int cc;
    QK_CUDA_TRY((cudaError_t)qk_device_cc(&cc));
    if (cc >= 90) {
        cudaLaunchAttribute attr = qk_dependent_attr();
        const cudaLaunchConfig_t cfg = qk_launch_config(grid, block, smem, stream, &attr);
        const cudaError_t e = cudaLaunchKernelExC(&cfg, kernel, args);
        if (e == cudaSuccess) return 0;
        if (e != cudaErrorNotSupported && e != cudaErrorInvalidValue) return (int)e;
        cudaGetLastError();
    }
    return qk_launch(kernel, grid, block, smem, stream, args);
}

int qk_launch_cooperative(const void *kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, void **args) {
    static const PFN_cuLaunchKernelEx_v11060 cu_launch_ex =
        (PFN_cuLaunchKernelEx_v11060)qk_driver_entry("cuLaunchKernelEx");
    const cudaKernel_t h = cu_launch_ex ? kernel_handle(kernel) : nullptr;
    if (h == nullptr) {
        cudaLaunchAttribute attr = {};
        attr.id = cudaLaunchAttributeCooperative;
        attr.val.cooperative = 1;
        const cudaLaunchConfig_t cfg = qk_launch_config(grid, block, smem, stream, &attr);
        return (int)cudaLaunchKernelExC(&cfg, kernel, args);
    }
    CUlaunchAttribute attr = {};
    attr.id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attr.value.cooperative = 1;
    CUlaunchConfig cfg = {};
    cfg.gridDimX = grid.x, cfg.gridDimY = grid.y, cfg.gridDimZ = grid.z;
    cfg.blockDimX = block.x, cfg.blockDimY = block.y, cfg.blockDimZ = block.z;
    cfg.sharedMemBytes = (unsigned)smem;
    cfg.hStream = (CUstream)stream;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    return (int)cu_launch_ex(&cfg, (CUfunction)h, args, nullptr);
}

int qk_kernel_residency(const void *kernel, int threads, size_t smem, int *per_sm) {
    int dev;
    QK_CUDA_TRY(cudaGetDevice(&dev));
    if (dev < 0 || dev >= kMaxDevices) return QK_E_UNSUPPORTED;
    KernelSlot *slot = kernel_slot(kernel);
    const int cached = slot ? __atomic_load_n(&slot->per_sm[dev], __ATOMIC_RELAXED) : 0;
    if (cached > 0) {
        if (per_sm) *per_sm = cached;
        return 0;
    }
    // Idempotent: two threads racing here both set the same attribute and store the same count.
    QK_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int n = 0;
    QK_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
    if (n < 1) n = 1;
    if (per_sm) *per_sm = n;
    if (slot) __atomic_store_n(&slot->per_sm[dev], n, __ATOMIC_RELAXED);
    return 0;
}

// One integer per device, found by query(device, &value) on the first ask and cached: the
// launchers' kernel and grid choices ask on every call.
template <class Query> int cached_per_device(int (&cache)[kMaxDevices], int *out, Query query) {
    int d;
    QK_CUDA_TRY(cudaGetDevice(&d));
    const bool slot = d >= 0 && d < kMaxDevices;
    if (slot && cache[d] > 0) {
        *out = cache[d];
        return 0;
    }
    int v;
    QK_CUDA_TRY(query(d, &v));
    if (slot) cache[d] = v;
    *out = v;
    return 0;
}

int qk_device_cc(int *cc) {
    static int cached[kMaxDevices];
    return cached_per_device(cached, cc, [](int d, int *v) {
        int major, minor;
        cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d);
        if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d);
        if (e == cudaSuccess) *v = 10 * major + minor;
        return e;
    });
}

int qk_cooperative_supported(int *supported) {
    static int cached[kMaxDevices];  // 2: yes, 1: no (0 is "not asked yet")
    int v;
    QK_CUDA_TRY((cudaError_t)cached_per_device(cached, &v, [](int d, int *out) {
        int attr = 0;
        const cudaError_t e = cudaDeviceGetAttribute(&attr, cudaDevAttrCooperativeLaunch, d);
        *out = attr ? 2 : 1;
        return e;
    }));
    *supported = v == 2;
    return 0;
}

int qk_sm_count(int *count) {
    static int cached[kMaxDevices];
    return cached_per_device(cached, count,
                             [](int d, int *v) { return cudaDeviceGetAttribute(v, cudaDevAttrMultiProcessorCount, d); });
}

#define QK_DECLARE(name, args) extern "C" int qk_##name##_cuda(const qk_##args##_args *a, void *stream);
QK_LAUNCHERS(QK_DECLARE)
#undef QK_DECLARE
extern "C" int qk_sparse_aggregate_check_cuda(qk_sparse_aggregate_args *a, void *stream);
extern "C" void qk_set_cublaslt_search_cuda(const char *library, const char *roots);
extern "C" int qk_index_check_cuda(const void *p, int dtype, int64_t n, int64_t stride, int64_t lo, int64_t hi,
                                   int64_t *bad_pos, int64_t *bad_value, void *stream);

#ifndef QK_ARCHS
#define QK_ARCHS "unknown"
#endif

namespace {

int runtime_version(int *v) { return (int)cudaRuntimeGetVersion(v); }
int driver_version(int *v) { return (int)cudaDriverGetVersion(v); }
int device_count(int *n) {
    cudaError_t e = cudaGetDeviceCount(n);
    if (e != cudaSuccess) {
        *n = 0;
        cudaGetLastError();  // clear the sticky-free error so later calls are not poisoned
    }
    return (int)e;
}
int get_device(int *d) { return (int)cudaGetDevice(d); }
int set_device(int d) { return (int)cudaSetDevice(d); }

int device_props(int device, char *name, size_t name_len, int *cc, int *sm_count, size_t *total_mem) {
    cudaDeviceProp p;
    QK_CUDA_TRY(cudaGetDeviceProperties(&p, device));
    if (name_len) {
        strncpy(name, p.name, name_len - 1);
        name[name_len - 1] = 0;
    }
    *cc = p.major * 10 + p.minor;
    *sm_count = p.multiProcessorCount;
    *total_mem = p.totalGlobalMem;
    return 0;
}

const char *error_string(int status) { return cudaGetErrorString((cudaError_t)status); }
int qk_malloc(void **p, size_t n) { return (int)cudaMalloc(p, n ? n : 1); }
int qk_free(void *p) { return (int)cudaFree(p); }
int stream_wait(void *consumer, void *producer) {
    if (consumer == producer) return 0;
    cudaEvent_t ev;
    QK_CUDA_TRY(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    cudaError_t e = cudaEventRecord(ev, (cudaStream_t)producer);
    if (e == cudaSuccess) e = cudaStreamWaitEvent((cudaStream_t)consumer, ev, 0);
    cudaEventDestroy(ev);  // safe while pending: resources are released once the wait completes
    return (int)e;
}

// A dry run (qk_cuda_api.dry_run): relaxed capture, so that first-use host work in the launchers
// (cuBLASLt's handle, lazy module loading) is allowed here and already done when XLA records them.  The
// scratch is allocated before the capture (inside it, cudaMallocAsync would become a graph node).
int dry_run(int device, size_t scratch_bytes, int (*run)(void *ctx, void *stream, void *scratch), void *ctx) {
    int prev = -1;
    QK_CUDA_TRY(cudaGetDevice(&prev));
    if (prev != device) QK_CUDA_TRY(cudaSetDevice(device));
    cudaStream_t s = nullptr;
    void *scratch = nullptr;
    int st = (int)cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (st == 0 && scratch_bytes) st = (int)cudaMallocAsync(&scratch, scratch_bytes, s);
    if (st == 0) {
        st = (int)cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed);
        if (st == 0) {
            st = run(ctx, (void *)s, scratch);
            cudaGraph_t g = nullptr;
            const cudaError_t end = cudaStreamEndCapture(s, &g);  // ends it even after a failed launch
            if (g) cudaGraphDestroy(g);
            if (st == 0) st = (int)end;
        }
    }
    if (scratch) {
        const cudaError_t e = cudaFreeAsync(scratch, s);
        if (st == 0) st = (int)e;
    }
    if (s) cudaStreamDestroy(s);  // its pending free completes first
    cudaGetLastError();  // a failure here is reported through st, not left for the next launch
    if (prev != device) {
        const cudaError_t e = cudaSetDevice(prev);
        if (st == 0) st = (int)e;
    }
    return st;
}

// Filled by name: a positional table would silently call the wrong entry after a field moves.
qk_cuda_api make_api() {
    qk_cuda_api t = {};
    t.abi = QK_CUDA_ABI;
    t.archs = QK_ARCHS;
    t.runtime_version = runtime_version;
    t.driver_version = driver_version;
    t.device_count = device_count;
    t.get_device = get_device;
    t.set_device = set_device;
    t.device_props = device_props;
    t.error_string = error_string;
    t.malloc = qk_malloc;
    t.free = qk_free;
    t.stream_wait = stream_wait;
    t.sparse_aggregate_check = qk_sparse_aggregate_check_cuda;
    t.index_check = qk_index_check_cuda;
    t.set_cublaslt_search = qk_set_cublaslt_search_cuda;
    t.dry_run = dry_run;
#define QK_FILL(name, args) t.name = qk_##name##_cuda;
    QK_LAUNCHERS(QK_FILL)
#undef QK_FILL
    return t;
}

const qk_cuda_api api = make_api();

}  // namespace

extern "C" __attribute__((visibility("default"))) const qk_cuda_api *qk_cuda_get_api(int abi) {
    return abi == QK_CUDA_ABI ? &api : nullptr;
}
