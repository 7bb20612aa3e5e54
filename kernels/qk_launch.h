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
    int dtype;       /* QK_F32; cuda also QK_F16, QK_BF16 (fp32 accumulation) */
    int num_threads; /* CPU only: 0 = all cores */
    /* Filled on QK_E_INDEX: which argument, at which position, holding which value. */
    int bad_arg;     /* 0 row_ptr, 1 col_idx */
    int64_t bad_pos, bad_value;
} qk_sparse_aggregate_args;

/* fused_edge_features: out[e] = cat(x[src]+x[dst], |x[src]-x[dst]|, edge_attr[e]) with
 * src = edge_index[0,e], dst = edge_index[1,e]; out has 3H columns, or 2H without edge_attr.
 * CUDA treats an out-of-range index as a zero row (never read out of bounds). */
typedef struct {
    const void *x;          /* [num_nodes, H] */
    const void *edge_index; /* [2, num_edges], index_dtype */
    const void *edge_attr;  /* [num_edges, H] or NULL */
    void *out;              /* [num_edges, 3H or 2H] */
    int64_t num_nodes, num_edges, H;
    int64_t x_stride[2], ei_stride[2], ea_stride[2], out_stride[2];
    int index_dtype, dtype, num_threads;
    int bad_row; /* QK_E_INDEX: 0 src, 1 dst */
    int64_t bad_pos, bad_value;
} qk_edge_features_args;

/* fused_norm_residual: y = LayerNorm(x) * gamma + beta over the last dim (population variance,
 * two-pass: mean, then squared deviations), then when training dropout with probability p (kept
 * values scaled by 1/(1-p)), then + residual.  The mask bit of element (r, h) is
 * qk_dropout_keep(seed, r * H + h, threshold) from qk_philox.h, identical on cpu and cuda. */
typedef struct {
    const void *x, *residual, *gamma, *beta; /* [R, H], [R, H], [H], [H] */
    void *out;                               /* [R, H] */
    int64_t R, H;
    int64_t x_stride[2], res_stride[2], out_stride[2], gamma_stride, beta_stride;
    float eps, scale;         /* scale = 1 / (1 - p) */
    uint32_t drop_threshold;  /* drop when the 32-bit draw is below it: round(p * 2^32), saturated */
    int training;             /* 0: no dropout */
    uint64_t seed;
    int dtype, num_threads;
} qk_norm_residual_args;

/* graph_norm_bce: mean over g < num_graphs of (sum of bce(e) over edges with edge_graph[e] == g) /
 * max(count_g, 1), bce = max(l,0) - l*t + log1p(exp(-|l|)), times 1 + (pos_weight-1)*t when
 * has_pos_weight.  Writes one float32.  Deterministic: the same inputs give the same bits.
 * CUDA takes scratch space from the stream-ordered allocator (cudaMallocAsync). */
typedef struct {
    const void *logits, *target, *edge_graph; /* [E], [E], [E] index_dtype */
    float *out;                               /* one float32 */
    int64_t num_edges, num_graphs;
    int64_t logits_stride, target_stride, graph_stride;
    float pos_weight;
    int has_pos_weight;
    int dtype, index_dtype, num_threads;
    int64_t bad_pos, bad_value; /* QK_E_INDEX: edge_graph[bad_pos] = bad_value outside [0, num_graphs) */
} qk_graph_bce_args;

/* The CUDA shared object exports one symbol, qk_cuda_get_api, returning this table. */
#define QK_CUDA_ABI 3

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
    /* Make `consumer` wait for work already queued on `producer` (event record + wait; no device sync). */
    int (*stream_wait)(void *consumer, void *producer);
    int (*sparse_aggregate)(const qk_sparse_aggregate_args *a, void *stream);
    /* Debug validation (QKERNELS_CHECK=1): synchronises the stream, fills bad_* on QK_E_INDEX. */
    int (*sparse_aggregate_check)(qk_sparse_aggregate_args *a, void *stream);
    int (*edge_features)(const qk_edge_features_args *a, void *stream);
    int (*norm_residual)(const qk_norm_residual_args *a, void *stream);
    int (*graph_bce)(const qk_graph_bce_args *a, void *stream);
} qk_cuda_api;

typedef const qk_cuda_api *(*qk_cuda_get_api_fn)(int abi);

#ifdef __cplusplus
}
#endif

#endif
