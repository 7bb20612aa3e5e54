/* The plain-C contract between the Python binding (csrc/) and the kernels.
 *
 * Launchers take a zero-initialised args struct of plain data (pointers, sizes, element
 * strides) and return a status: 0 on success, a positive cudaError_t value for CUDA failures,
 * a negative QK_E_* value otherwise.  They never print, exit or synchronise.
 *
 * The CUDA launchers live in a separate shared object (_qkernels_cuda*.so) that csrc/ opens
 * with dlopen at first CUDA use and reaches through one table, qk_cuda_api, so a machine
 * without a GPU, driver or CUDA runtime can still import qkernels.  This header includes no
 * CUDA header. */
#ifndef QK_LAUNCH_H
#define QK_LAUNCH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
    QK_OK = 0,
    QK_E_UNSUPPORTED = -1, /* a dtype/shape combination no kernel was built for */
    QK_E_INDEX = -2,       /* an index out of range; args->bad_* say where */
    QK_E_NOMEM = -3,
    QK_E_THREAD = -4,      /* a CPU worker thread could not be started */
};

/* Element types the kernels see; the binding maps DLPack dtypes onto these. */
typedef enum {
    QK_F32 = 0,
    QK_F16 = 1,
    QK_BF16 = 2,
    QK_F64 = 3,
    QK_I32 = 4,
    QK_I64 = 5,
    QK_BOOL = 6,
} qk_dtype;

/* sparse_aggregate: out[i,h,:] = sum_{e in [row_ptr[i], row_ptr[i+1])} edge_weight[e,h] * node_feat[col_idx[e],h,:].
 * All strides are in elements.  Index bounds: the CPU launcher checks them (QK_E_INDEX); the
 * CUDA launcher clamps row ranges to [0, num_edges] and skips edges whose column is outside
 * [0, num_src), so bad indices can never address memory outside the tensors. */
typedef struct {
    const void *row_ptr;  /* [num_dst + 1], index_dtype */
    const void *col_idx;  /* [num_edges], index_dtype */
    const void *edge_weight; /* [num_edges, num_heads], dtype */
    const void *node_feat;   /* [num_src, num_heads, head_dim], dtype */
    void *out;               /* [num_dst, num_heads, head_dim], dtype */
    int64_t num_dst, num_src, num_edges, num_heads, head_dim;
    int64_t row_ptr_stride, col_idx_stride;
    int64_t ew_stride[2];
    int64_t nf_stride[3];
    int64_t out_stride[3];
    int index_dtype; /* QK_I32 or QK_I64 */
    int dtype;       /* QK_F32 (cuda: also QK_F16, QK_BF16 once tuned kernels land) */
    int num_threads; /* CPU only: 0 = all cores */
    /* Filled on QK_E_INDEX: which argument, at which position, holding which value. */
    int bad_arg;     /* 0 row_ptr, 1 col_idx */
    int64_t bad_pos, bad_value;
} qk_sparse_aggregate_args;

/* The CUDA shared object exports one symbol, qk_cuda_get_api, returning this table. */
#define QK_CUDA_ABI 1

typedef struct {
    int abi;
    const char *archs;        /* compiled architectures, e.g. "sm_80 sm_89 sm_90 +PTX" */
    int (*runtime_version)(int *version);
    int (*driver_version)(int *version);
    int (*device_count)(int *count);
    int (*get_device)(int *device);
    int (*set_device)(int device);
    /* name: at least 256 bytes; cc = 10 * major + minor */
    int (*device_props)(int device, char *name, size_t name_len, int *cc, int *sm_count, size_t *total_mem);
    const char *(*error_string)(int status);
    int (*malloc)(void **ptr, size_t bytes);
    int (*free)(void *ptr);
    int (*memcpy_async)(void *dst, const void *src, size_t bytes, void *stream);
    /* Make `consumer` wait for work already queued on `producer` (event record + wait; no device sync). */
    int (*stream_wait)(void *consumer, void *producer);
    /* Pointer attributes: memory type (0 unregistered host, 1 host, 2 device, 3 managed) and device. */
    int (*pointer_kind)(const void *ptr, int *kind, int *device);
    int (*sparse_aggregate)(const qk_sparse_aggregate_args *a, void *stream);
    /* Debug validation (QKERNELS_CHECK=1): synchronises the stream, fills bad_* on QK_E_INDEX. */
    int (*sparse_aggregate_check)(qk_sparse_aggregate_args *a, void *stream);
} qk_cuda_api;

typedef const qk_cuda_api *(*qk_cuda_get_api_fn)(int abi);

#ifdef __cplusplus
}
#endif

#endif
