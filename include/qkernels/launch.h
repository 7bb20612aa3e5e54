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

/* Kernel choices, in the args structs' variant fields (tests, benchmarks and tuning sweeps set them
 * through the raw ops' private keywords, named in csrc/ops/).  0 is automatic: the launcher picks
 * from the shapes and the device.  A forced kernel that cannot take a call (shape, alignment,
 * device) leaves it to the kernels that remain. */
enum {
    QK_LINEAR_AUTO = 0,
    QK_LINEAR_MMA,  /* linear.cu's mma.sync tile kernel only */
    QK_LINEAR_GEMV, /* the CUDA-core GEMV wherever M <= 8; neither cuBLASLt nor the sm_90 row kernel */
    QK_LINEAR_ROWS, /* the sm_90 one-CTA-per-SM row kernel wherever M <= 64; neither cuBLASLt nor the GEMV */
};
enum { /* qk_linear_args.cpu_isa: the highest instruction set the cpu linear and swiglu may use */
    QK_CPU_ISA_AUTO = 0,    /* the best this machine has */
    QK_CPU_ISA_PORTABLE,    /* plain C (vectorised by the compiler), every machine */
    QK_CPU_ISA_AVX2,        /* AVX2 FMA (and F16C): the avx512 level's sums, 8 lanes at a time */
    QK_CPU_ISA_AVX512,      /* AVX-512F FMA, 16-bit inputs converted to fp32 */
    QK_CPU_ISA_AVX512_BF16, /* + VDPBF16PS for bfloat16 */
    QK_CPU_ISA_AMX,         /* + AMX tiles (TDPBF16PS) for bfloat16 */
    QK_CPU_ISA_COUNT
};
enum { /* linear_backward and swiglu_backward (qk_linear_args.variant) */
    QK_LINEAR_BWD_AUTO = 0,
    QK_LINEAR_BWD_TILES, /* linear_backward.cu's kernels at every M (no cuBLASLt) */
    QK_LINEAR_BWD_LT,    /* cuBLASLt's products at every M, where it loads */
};
enum {
    QK_DECODE_AUTO = 0,
    QK_DECODE_WORKSPACE, /* no on-chip cluster merge: the splits merge through a workspace and a second kernel */
    QK_DECODE_ROWS,      /* paged: a CTA per (sequence, split) reading whole token rows, wherever it takes the call */
    QK_DECODE_HEADS,     /* paged: the CTA per (sequence, kv head, split) kernel only, never the row kernel */
};
enum {
    QK_RMSNORM_AUTO = 0,
    QK_RMSNORM_ROWS,  /* a lane group per row (rows that fit its registers), else the block kernel */
    QK_RMSNORM_BLOCK, /* a block per row, the row in registers where it fits, else as REREAD */
    QK_RMSNORM_REREAD, /* a block per row reading the row twice (the kernel for rows too long or misaligned) */
};
enum {
    QK_PREFILL_AUTO = 0,
    QK_PREFILL_MMA,   /* the mma.sync kernel, also on sm_90 */
    QK_PREFILL_WGMMA, /* on sm_90 the cp.async wgmma kernel, not the TMA one */
};

/* Where a CUDA launcher takes its temporary device memory (the `scratch` field of the args structs
 * that have one).  NULL (a zero-initialised struct): cudaMallocAsync / cudaFreeAsync on the launch
 * stream.  Otherwise alloc returns 0 and *p, or a non-zero status (QK_E_NOMEM, or a cudaError_t);
 * free releases p (of the size it was asked for) once the work already enqueued on stream is done
 * with it.  The XLA FFI handlers pass a block the caller owns, carved in request order, whose size
 * a dry run of the same launcher found at trace time (qk_cuda_api.dry_run): sized_ahead is then
 * set, and a launcher's requests may depend on its data pointers' alignment only up to 16 bytes
 * (all XLA promises), since the dry run sees stand-in pointers. */
typedef struct qk_scratch {
    int (*alloc)(void *ctx, size_t bytes, void *stream, void **p);
    int (*free)(void *ctx, void *p, size_t bytes, void *stream);
    void *ctx;
    int sized_ahead;
    /* Nothing enqueued will run (qk_cuda_api.dry_run): a launcher leaves out the memsets it issues on
     * its arguments, since the driver checks a memset's address when it is captured and a dry run's
     * arguments are stand-ins (its scratch is real memory, never touched). */
    int dry_run;
} qk_scratch;

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
    const qk_scratch *scratch; /* CUDA temporaries (see qk_scratch); NULL: the stream-ordered pool */
} qk_sparse_aggregate_args;

/* sparse_aggregate_backward: the gradients of sparse_aggregate for grad_out [num_dst, H, D] (same
 * index rules; row i holds the edges row_ptr[i] <= e < row_ptr[i+1]):
 *   grad_edge_weight[e,h] = grad_out[i,h,:] . node_feat[col_idx[e],h,:]   (0 for e outside
 *                           [row_ptr[0], row_ptr[num_dst]));
 *   grad_node_feat[j,h,:] = sum over the edges e with col_idx[e] == j, in ascending e, of
 *                           edge_weight[e,h] * grad_out[i(e),h,:].
 * An output left NULL is not computed.  Outputs are contiguous (the binding allocates them).
 * deterministic = 0 lets CUDA scatter float32 grad_node_feat with float atomics (run-to-run bits
 * may differ); otherwise the sums run in the order above on both backends.  CUDA builds the
 * transposed graph in scratch from the stream-ordered allocator (cudaMallocAsync). */
typedef struct {
    const void *grad_out;    /* [num_dst, num_heads, head_dim], dtype */
    const void *row_ptr, *col_idx, *edge_weight, *node_feat; /* as in qk_sparse_aggregate_args */
    void *grad_edge_weight;  /* [num_edges, num_heads] or NULL */
    void *grad_node_feat;    /* [num_src, num_heads, head_dim] or NULL */
    int64_t num_dst, num_src, num_edges, num_heads, head_dim;
    int64_t go_stride[3], row_ptr_stride, col_idx_stride, ew_stride[2], nf_stride[3];
    int index_dtype, dtype, num_threads;
    int deterministic;
    int bad_arg; /* QK_E_INDEX: 0 row_ptr, 1 col_idx */
    int64_t bad_pos, bad_value;
    const qk_scratch *scratch; /* CUDA temporaries (see qk_scratch); NULL: the stream-ordered pool */
    /* sparse_aggregate_plan's output (int32 [num_src + 1 + 3 num_edges]) or NULL: grad_node_feat walks
     * it instead of grouping the edges; entries outside their arrays' ranges are skipped. */
    const int32_t *plan;
} qk_sparse_aggregate_backward_args;

/* sparse_aggregate_plan: the transposed graph the backward groups by source, int32
 * [num_src + 1 + 3E]: ptr[num_src + 1] (source j's entries are [ptr[j], ptr[j+1]); ptr[num_src]
 * counts the entries kept), then per entry k (sorted by source, ascending edge id within one)
 * src[E], edge[E] and row[E] (the row holding the edge).  Edges outside [row_ptr[0],
 * row_ptr[num_dst]) and, on cuda, edges with a bad column follow the kept ones in ascending edge
 * id with src = num_src and row 0; the cpu launcher refuses a bad column (QK_E_INDEX, bad_arg 1). */
typedef struct {
    const void *row_ptr, *col_idx; /* as in qk_sparse_aggregate_args */
    int32_t *plan;
    int64_t num_dst, num_src, num_edges, row_ptr_stride, col_idx_stride;
    int index_dtype, num_threads;
    int bad_arg; /* QK_E_INDEX: 0 row_ptr, 1 col_idx */
    int64_t bad_pos, bad_value;
    const qk_scratch *scratch;
} qk_sparse_aggregate_plan_args;

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
} qk_fused_edge_features_args;

/* fused_edge_features_backward: for grad_out [E, 3H] (with edge_attr) or [E, 2H], with
 * g_sum = grad_out[e, :H], g_abs = grad_out[e, H:2H] and s = sign(x[src] - x[dst]) (0 at a tie or NaN):
 *   grad_x[n] = sum over the incidences of n, ordered by (edge, side), of g_sum + s * g_abs at
 *               the source side and g_sum - s * g_abs at the destination side;
 *   grad_edge_attr = grad_out[:, 2H:] (when given).
 * Outputs are contiguous.  Deterministic; CUDA groups the 2E incidences per node in scratch from
 * the stream-ordered allocator, and treats an out-of-range index as a zero row, as the forward. */
typedef struct {
    const void *grad_out;   /* [num_edges, 2H or 3H] */
    const void *x;          /* [num_nodes, H] */
    const void *edge_index; /* [2, num_edges], index_dtype */
    void *grad_x;           /* [num_nodes, H] */
    void *grad_edge_attr;   /* [num_edges, H] or NULL */
    int64_t num_nodes, num_edges, H;
    int64_t go_stride[2], x_stride[2], ei_stride[2];
    int index_dtype, dtype, num_threads;
    int bad_row; /* QK_E_INDEX: 0 src, 1 dst */
    int64_t bad_pos, bad_value;
    const qk_scratch *scratch; /* CUDA temporaries (see qk_scratch); NULL: the stream-ordered pool */
    /* fused_edge_features_plan's output (int32 [num_nodes + 1 + 4 num_edges]) or NULL: grad_x walks it
     * instead of grouping the incidences; entries outside their arrays' ranges are skipped. */
    const int32_t *plan;
} qk_fused_edge_features_backward_args;

/* fused_edge_features_plan: the 2E incidences grouped by node, int32 [num_nodes + 1 + 4E]:
 * ptr[num_nodes + 1], then per entry k (sorted by node, ascending item within one) node[2E] and
 * item[2E] (item 2e + side: side 0 at src, 1 at dst).  On cuda an incidence with a bad node follows
 * the kept ones with node = num_nodes; the cpu launcher refuses it (QK_E_INDEX). */
typedef struct {
    const void *edge_index; /* [2, num_edges], index_dtype */
    int32_t *plan;
    int64_t num_nodes, num_edges, ei_stride[2];
    int index_dtype, num_threads;
    int bad_row; /* QK_E_INDEX: 0 src, 1 dst */
    int64_t bad_pos, bad_value;
    const qk_scratch *scratch;
} qk_fused_edge_features_plan_args;

/* message_passing: one message-passing layer of a gated graph network, fused (forward only):
 *   ef    = cat(x[src] + x[dst], |x[src] - x[dst]|, e)           [E, 3H]  (src, dst = edge_index)
 *   h     = relu(ef w1 + b1)                                     [E, F]
 *   msg   = h w_msg + b_msg                                      [E, H]
 *   att   = sigmoid(h w_att + b_att)                             [E, K]   (K heads, H % K == 0)
 *   agg[n, k] = sum over CSR row n (entries j in row_ptr[n] .. row_ptr[n+1]) of
 *               att[dir_edge[j], k] * (x[col_idx[j]] w_v)[k H/K .. (k+1) H/K]
 *   x_out = LayerNorm(agg w_o) * gamma_x + beta_x + x                [N, H]
 *   e_out = LayerNorm(msg) * gamma_e + beta_e + e                    [E, H]
 * LayerNorm as fused_norm_residual's (population variance, eps on the variance); fp32 math.  The
 * aggregation is computed as (sum_j att x[col]) w_v, the same product regrouped.  Outputs are
 * contiguous.  CUDA treats an out-of-range index as a zero row or a skipped entry (never read out
 * of bounds); the cpu launcher refuses it (QK_E_INDEX). */
typedef struct {
    const void *x;          /* [N, H] */
    const void *e;          /* [E, H] */
    const void *edge_index; /* [2, E], ei_dtype */
    const void *row_ptr;    /* [N + 1], csr_dtype */
    const void *col_idx;    /* [M], csr_dtype */
    const void *dir_edge;   /* [M], de_dtype */
    const void *w1, *b1;       /* [3H, F], [F] */
    const void *w_msg, *b_msg; /* [F, H], [H] */
    const void *w_att, *b_att; /* [F, K], [K] */
    const void *w_v, *w_o;     /* [H, H], [H, H] */
    const void *gamma_x, *beta_x, *gamma_e, *beta_e; /* [H] */
    void *x_out;            /* [N, H], contiguous */
    void *e_out;            /* [E, H], contiguous */
    int64_t num_nodes, num_edges, num_entries, H, F, heads;
    int64_t x_stride[2], e_stride[2], ei_stride[2], rp_stride, ci_stride, de_stride;
    int64_t w1_stride[2], wm_stride[2], wa_stride[2], wv_stride[2], wo_stride[2];
    int64_t b1_stride, bm_stride, ba_stride, gx_stride, bx_stride, ge_stride, be_stride;
    float eps;
    int ei_dtype, csr_dtype, de_dtype, dtype, num_threads; /* csr_dtype: row_ptr and col_idx */
    int bad_arg; /* QK_E_INDEX: 0 edge_index[0], 1 edge_index[1], 2 row_ptr, 3 col_idx, 4 dir_edge */
    int64_t bad_pos, bad_value;
    const qk_scratch *scratch; /* CUDA temporaries (the gates, [E, K] fp32); NULL: the stream-ordered pool */
} qk_message_passing_args;

/* fused_norm_residual: y = LayerNorm(x) * gamma + beta over the last dim (population variance,
 * two-pass: mean, then squared deviations), then when training dropout with probability p (kept
 * values scaled by 1/(1-p)), then + residual.  The mask bit of element (r, h) is
 * qk_dropout_keep(seed, r * H + h, threshold) from qkernels/philox.h, identical on cpu and cuda. */
typedef struct {
    const void *x, *residual, *gamma, *beta; /* [R, H], [R, H], [H], [H] */
    void *out;                               /* [R, H] */
    int64_t R, H;
    int64_t x_stride[2], res_stride[2], out_stride[2], gamma_stride, beta_stride;
    float eps, scale;         /* scale = 1 / (1 - p) */
    uint32_t drop_threshold;  /* drop when the 32-bit draw is below it: round(p * 2^32), saturated */
    int training;             /* 0: no dropout */
    uint64_t seed;
    const int64_t *seed_ptr;  /* NULL: seed; else the seed is *seed_ptr, read where the kernel runs */
    int dtype, num_threads;
    /* Graph mode (batch != NULL; PyG LayerNorm(mode="graph")): mean and variance are taken over all
     * rows r with batch[r] == g and all H channels, per graph g < num_graphs, instead of per row;
     * gamma, beta, dropout and residual as above.  Per-graph sums in a fixed order (no float
     * atomics); sorted batch takes binary-searched segments, unsorted a stable counting sort.
     * The CPU launcher returns QK_E_INDEX with bad_* at the first id outside [0, num_graphs); CUDA
     * leaves such a row out of every graph and writes out = residual for it. */
    const void *batch;        /* [R], index_dtype, element stride batch_stride */
    int64_t num_graphs, batch_stride;
    int index_dtype;
    int64_t bad_pos, bad_value;
    const qk_scratch *scratch; /* CUDA temporaries (see qk_scratch); NULL: the stream-ordered pool */
} qk_fused_norm_residual_args;

/* fused_norm_residual_backward: the gradients of fused_norm_residual's output with respect to x,
 * gamma and beta, given grad_out (the residual's gradient is grad_out itself).  Per row, with mean
 * and rstd recomputed from x as in the forward, xhat = (x - mean) * rstd, g = grad_out * mask *
 * scale when training (the forward's Philox mask, regenerated from the seed), else grad_out:
 *   grad_x = rstd * (g*gamma - mean_h(g*gamma) - xhat * mean_h(g*gamma*xhat)),
 *   grad_gamma = sum_r g * xhat, grad_beta = sum_r g.
 * The column sums are deterministic: per-block partial sums in a fixed order, then a second pass
 * over the blocks (no float atomics); CUDA takes the partials from the stream-ordered allocator. */
typedef struct {
    const void *grad_out, *x, *gamma;      /* [R, H], [R, H], [H] */
    void *grad_x, *grad_gamma, *grad_beta; /* [R, H], [H], [H] */
    int64_t R, H;
    int64_t go_stride[2], x_stride[2], gx_stride[2], gamma_stride, gg_stride, gb_stride;
    float eps, scale;         /* as the forward's */
    uint32_t drop_threshold;
    int training;
    uint64_t seed;
    const int64_t *seed_ptr;
    int dtype, num_threads;
    /* Graph mode, as the forward's: mean_g, rstd_g over each graph's rows and channels, and
     *   grad_x = rstd_g * (g*gamma - mean_g(g*gamma) - xhat * mean_g(g*gamma*xhat))
     * with mean_g over the graph's rows and channels; CUDA gives a row with a bad id grad_x = 0 and
     * no share of grad_gamma or grad_beta. */
    const void *batch;
    int64_t num_graphs, batch_stride;
    int index_dtype;
    int64_t bad_pos, bad_value;
    const qk_scratch *scratch; /* CUDA temporaries (see qk_scratch); NULL: the stream-ordered pool */
} qk_fused_norm_residual_backward_args;

/* graph_norm_bce: mean over g < num_graphs of (sum of bce(e) over edges with edge_graph[e] == g) /
 * max(count_g, 1), bce = max(l,0) - l*t + log1p(exp(-|l|)), times w_e = 1 + (pw_e - 1)*t when
 * has_pos_weight, pw_e = pos_weight, or pos_weight_t[e * pw_stride] when pos_weight_t is given
 * (pw_stride 0: one value for every edge; read where the kernel runs).  Writes one float32.
 * Deterministic: the same inputs give the same bits.  CUDA scratch: O(SMs) bytes forward, 8 per
 * graph backward.  CUDA forward with out == NULL (scratch hook required): the loss goes to the
 * first float of the one block it asks for, which the caller keeps as the output.
 * graph_norm_bce_backward (the same struct): grad_logits[e] = grad[0] * w_e * (sigmoid(l_e) - t_e)
 * / (max(count_g, 1) * num_graphs), g = edge_graph[e]; grad is read where the kernel runs.  CUDA
 * gives an edge whose graph id is out of range a zero gradient. */
typedef struct {
    const void *logits, *target, *edge_graph; /* [E], [E], [E] index_dtype */
    float *out;                               /* one float32 (forward) */
    const float *grad;                        /* one float32 (backward) */
    void *grad_logits;                        /* [E] with grad_stride, dtype (backward) */
    const void *pos_weight_t;                 /* NULL, or [E] with pw_stride, pw_dtype QK_F32 or dtype */
    int64_t num_edges, num_graphs;
    int64_t logits_stride, target_stride, graph_stride, pw_stride, grad_stride;
    float pos_weight;
    int has_pos_weight;
    int dtype, index_dtype, pw_dtype, num_threads;
    int64_t bad_pos, bad_value; /* QK_E_INDEX: edge_graph[bad_pos] = bad_value outside [0, num_graphs) */
    const qk_scratch *scratch; /* CUDA temporaries (see qk_scratch); NULL: the stream-ordered pool */
    int variant;               /* forward: 0 auto, QK_BCE_LAUNCHES */
} qk_graph_norm_bce_args;
enum { QK_BCE_AUTO = 0, QK_BCE_LAUNCHES /* no cooperative launch: the forward's phases as three launches */ };

/* attn_decode and attn_paged_decode: one query token per sequence,
 *   out[b,h,:] = sum_j softmax_j(scale * q[b,h,:].k_j) v_j   over the kept keys j of sequence b,
 * with kv head h / (Hq / Hkv) for query head h (GQA).  fp32 scores, softmax and accumulation;
 * a sequence with no kept key gives 0.  All strides are in elements; the last dim of q, k, v,
 * out, new_k and new_v is unit-stride (the binding checks).
 *
 * Contiguous (paged == 0): k, v [B, Lkv, Hkv, D] with strides {b, l, h}; sequence b keeps keys
 *   j < min(kv_lens[b], Lkv) (all Lkv when kv_lens is NULL; negative lengths count as 0) for which
 *   mask[b, j] != 0 (when mask is given).
 * mask_float: the mask is additive, of mask_dtype (QK_F32, QK_F16 or QK_BF16): mask[b, j] is added
 *   to the scaled score (fp32); -inf drops the key.  mask_cols > 0: positions j >= mask_cols are
 *   not kept (a paged mask narrower than max_ctx); 0: the mask covers every position.
 * Paged (paged == 1): k, v are token pools [S, Hkv, D] with strides {0, s, h}; sequence b has
 *   len_b = kv_indptr[b+1] - kv_indptr[b] tokens, token j in slot
 *   req_to_token[req_pool_indices[b], j].  When new_k/new_v are given they are first written to
 *   the slot of position len_b - 1 (so the pools are written) and used as that position's K/V.
 *   mask, when given, is [B, mask_cols or max_ctx].
 * Index checks: the CPU launcher returns QK_E_INDEX with bad_* filled for a pool row outside
 *   [0, num_requests), a length outside [0, max_ctx], or a slot outside [0, pool_size).  The CUDA
 *   launcher clamps lengths to [0, max_ctx] and skips out-of-range rows and slots (never reads or
 *   writes outside the tensors).
 * CUDA graph safety: the CUDA launcher reads nothing on the host and sizes its grid from shapes
 *   only (B, Hkv, Lkv or max_ctx), so captured graphs replay correctly when lengths change. */
typedef struct {
    const void *q;   /* [B, Hq, D]; strides {b, h} */
    void *out;       /* [B, Hq, D]; strides {b, h} */
    void *k, *v;     /* see above; written only when paged with new_k/new_v */
    const void *mask; /* bool as uint8 (or mask_float), or NULL; strides {b, j} */
    const void *kv_lens; /* contiguous: [B] or NULL, kv_lens_dtype */
    /* paged only */
    const void *req_to_token;     /* [num_requests, max_ctx], r2t_dtype */
    const void *req_pool_indices; /* [B], rpi_dtype */
    const void *kv_indptr;        /* [B + 1], indptr_dtype */
    const void *new_k, *new_v;    /* [B, Hkv, D] or NULL; strides {b, h} */
    int64_t B, Hq, Hkv, D;
    int64_t Lkv;                  /* contiguous: keys per sequence */
    int64_t num_requests, max_ctx, pool_size; /* paged */
    int64_t q_stride[2], out_stride[2], k_stride[3], v_stride[3], mask_stride[2];
    int64_t kv_lens_stride, r2t_stride[2], rpi_stride, indptr_stride, new_k_stride[2], new_v_stride[2];
    int64_t mask_cols;
    float scale;
    int paged, mask_float, mask_dtype;
    int dtype;        /* QK_BF16, QK_F16; cpu also QK_F32 */
    int kv_lens_dtype, r2t_dtype, rpi_dtype, indptr_dtype; /* QK_I32 or QK_I64 */
    int num_threads;
    int variant;      /* 0 auto, QK_DECODE_WORKSPACE, QK_DECODE_ROWS, QK_DECODE_HEADS */
    int splits;       /* 0 auto, else the keys of each sequence in this many splits (at most one per 64 keys) */
    /* Filled on QK_E_INDEX: bad_arg 0 req_pool_indices, 1 kv_indptr (a length), 2 req_to_token (a slot) */
    int bad_arg;
    int64_t bad_pos, bad_value;
    const qk_scratch *scratch; /* CUDA temporaries (see qk_scratch); NULL: the stream-ordered pool */
} qk_attn_decode_args;

/* attn_prefill and attn_paged_prefill: many query tokens per sequence,
 *   out[., i, h, :] = sum_j softmax_j(scale * q[., i, h, :].k_j) v_j   over the kept keys j,
 * with kv head h / (Hq / Hkv) (GQA).  fp32 scores, softmax and accumulation; a query with no kept
 * key gives 0.  All strides are in elements; the last dim of q, k, v and out is unit-stride.
 * A sequence with q_len queries and kv_len keys places its queries at key positions
 * kv_len - q_len .. kv_len - 1: with causal, query i (0-based) keeps keys j <= i + kv_len - q_len
 * (bottom-right alignment).
 *
 * Dense (paged == 0): q, out [B, Lq, Hq, D] with strides {b, i, h}; k, v [B, Lkv, Hkv, D] with
 *   strides {b, j, h}; q_len = Lq and kv_len = Lkv for every sequence.
 *   mask_kind 0: none.  1: mask [B, Lkv], strides {b, j} in mask_stride[0], [3].
 *   2: mask [B, Hm, Lq, Lkv] with Hm = 1 or Hq, strides {b, h, i, j} (h stride 0 when Hm = 1).
 * Paged (paged == 1): q, out [total_q, Hq, D] with strides {0, t, h} (q_stride[0] unused); request
 *   b's queries are rows qo_indptr[b] .. qo_indptr[b+1] - 1, its kv_len = kv_indptr[b+1] -
 *   kv_indptr[b], key j in pool slot req_to_token[req_pool_indices[b], j]; k, v are token pools
 *   [S, Hkv, D] with strides {0, s, h}.  mask_kind 1: mask [B, max_ctx] over each request's keys;
 *   2: mask [B, Hm, Mq, max_ctx], query i of a request (0-based within it) reading row i.
 * mask_float (mask_kind 2 only): the mask is additive, of mask_dtype (QK_F32, QK_F16 or QK_BF16),
 *   added to the scaled score (fp32); -inf drops the key.  mask_cols > 0: key positions j >=
 *   mask_cols are not kept (paged masks narrower than max_ctx); mask_rows > 0 (paged, mask_kind 2):
 *   the mask has that many query rows, a request with more queries is QK_E_INDEX (bad_arg 4) on the
 *   cpu and keeps nothing in those rows on cuda; 0: no limit (dense, or a row broadcast).
 * Index checks: the CPU launcher returns QK_E_INDEX with bad_* filled for a pool row outside
 *   [0, num_requests), a kv length outside [0, max_ctx], query rows outside [0, total_q] or not
 *   ascending, q_len > kv_len, or a slot outside [0, pool_size).  The CUDA launcher never reads or
 *   writes outside the tensors: it clamps lengths and row ranges and skips bad rows and slots.
 * CUDA graph safety: nothing is read on the host; the grid comes from shapes only (for paged,
 *   total_q and B), so captured graphs replay correctly when lengths change. */
typedef struct {
    const void *q;
    void *out;
    const void *k, *v;
    const void *mask;             /* bool as uint8, or NULL */
    /* paged only */
    const void *req_to_token;     /* [num_requests, max_ctx], r2t_dtype */
    const void *req_pool_indices; /* [B], rpi_dtype */
    const void *kv_indptr;        /* [B + 1], kv_indptr_dtype */
    const void *qo_indptr;        /* [B + 1], qo_indptr_dtype */
    int64_t B, Lq, Lkv, Hq, Hkv, D; /* Lq, Lkv: dense only */
    int64_t total_q, num_requests, max_ctx, pool_size; /* paged only */
    int64_t q_stride[3], out_stride[3], k_stride[3], v_stride[3];
    int64_t mask_stride[4], mask_rows, mask_cols;
    int64_t r2t_stride[2], rpi_stride, kv_indptr_stride, qo_indptr_stride;
    float scale;
    int causal, paged, mask_kind, mask_float, mask_dtype;
    int dtype;                    /* QK_BF16, QK_F16; cpu also QK_F32 */
    int r2t_dtype, rpi_dtype, kv_indptr_dtype, qo_indptr_dtype; /* QK_I32 or QK_I64 */
    int num_threads;
    int variant;                  /* 0 auto, QK_PREFILL_MMA, QK_PREFILL_WGMMA */
    int cpu_isa;                  /* cpu: 0 auto, else the highest QK_CPU_ISA_* level to use */
    /* Filled on QK_E_INDEX: bad_arg 0 req_pool_indices, 1 kv_indptr (a length), 2 req_to_token
     * (a slot), 3 qo_indptr (a row range, or q_len > kv_len), 4 mask (q_len > mask_rows) */
    int bad_arg;
    int64_t bad_pos, bad_value;
} qk_attn_prefill_args;

/* rotary_emb: for each token (b, s), head h and pair i < D/2, with (c, s') = freqs[b, s, i, :]:
 *   interleaved: (x[2i], x[2i+1])       -> (x[2i] c - x[2i+1] s', x[2i] s' + x[2i+1] c)
 *   rotate-half: (x[i], x[i + D/2])     -> the same formula on that pair (NeoX)
 * computed in fp32, rounded once.  A 3-D input [T, H, D] is B = 1, S = T.  out may be x (in place).
 * Strides in elements; x's and out's last dim and each (cos, sin) pair are unit-stride. */
typedef struct {
    const void *x;
    void *out;
    const float *freqs;            /* [B, S, D/2, 2] */
    int64_t B, S, H, D;
    int64_t x_stride[3], out_stride[3]; /* {b, s, h} */
    int64_t f_stride[3];                /* {b, s, i} */
    int interleaved, dtype, num_threads;
    int inverse; /* rotary_emb_backward: rotate by -angle (s' negated), the transpose of the rotation */
} qk_rotary_emb_args;

/* rotary_kv_append: a decode or prefill step's rotary embedding and KV-cache append.  For token t < T with
 * p = positions[t], s = slots[t] and (c, s') = cos_sin[p, i, :] for pair i < D/2:
 *   out[t, h, :] = rotate(q[t, h, :])              h < Hq
 *   k_pool[s, h, :] = rotate(k[t, h, :]), v_pool[s, h, :] = v[t, h, :]   h < Hkv
 * rotate as rotary_emb's (interleaved or rotate-half pairs), in fp32, rounded once; v is copied.
 * out may be q (in place); the pools overlap none of q, k, v, out (the binding checks).  Strides in
 * elements; rows and each (cos, sin) pair unit-stride.
 * Index checks: the CPU launcher returns QK_E_INDEX before writing anything, with bad_arg 0 (a position
 *   outside [0, max_pos)), 1 (a slot outside [0, S)) or 2 (a slot given twice: bad_pos the later token,
 *   bad_other the earlier one), bad_value the index.  The CUDA launcher never reads or writes outside
 *   the tensors: a token with a bad position writes zeros to its out rows and nothing to the pools, a
 *   token with a bad slot writes its out rows only; two tokens with one slot leave either's row there.
 * CUDA graph safety: the grid comes from T and the SM count; nothing is read on the host. */
typedef struct {
    const void *q, *k, *v;
    void *out, *k_pool, *v_pool;
    const float *cos_sin;          /* [max_pos, D/2, 2] */
    const void *positions, *slots; /* [T], pos_dtype and slot_dtype */
    int64_t T, Hq, Hkv, D, max_pos, S;
    int64_t q_stride[2], k_stride[2], v_stride[2], out_stride[2]; /* {t, h} */
    int64_t kp_stride[2], vp_stride[2];                            /* {s, h} */
    int64_t cs_stride[2];                                          /* {p, i} */
    int64_t pos_stride, slot_stride;
    int interleaved, dtype, pos_dtype, slot_dtype; /* dtype QK_BF16, QK_F16; cpu also QK_F32 */
    int num_threads;
    int bad_arg;
    int64_t bad_pos, bad_value, bad_other;
} qk_rotary_kv_append_args;

/* linear: out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]), fp32 accumulation, bias added in fp32, one
 *   rounding.  swiglu: out[m, n] = (x w_up[n]) * silu(x w_gate[n]) with w = up, gate = gate weight,
 *   fp32 throughout, one rounding.  Rows of x, w, gate and out are unit-stride along k / n.
 * linear_backward (g = grad_out [M, N]; out and bias unused): grad_x = g w, grad_w = g^T x, grad_bias[n] =
 *   sum_m g[m, n].  swiglu_backward: with a = x up^T, b = x gate^T in fp32 and s = sigmoid(b),
 *   ga = g silu(b), gb = g a s (1 + b (1 - s)); grad_x = ga up + gb gate, grad_w = ga^T x (up's),
 *   grad_gate = gb^T x.  fp32 accumulation, one rounding of each gradient; a gradient whose pointer is
 *   NULL is not computed.  Every output element is summed in a fixed order (no float atomics). */
typedef struct {
    const void *x;      /* [M, K] */
    const void *w;      /* [N, K] (swiglu: up) */
    const void *gate;   /* swiglu: [N, K]; linear: NULL */
    const void *bias;   /* linear: [N] or NULL */
    void *out;          /* [M, N] */
    int64_t M, N, K;
    int64_t x_stride, w_stride, gate_stride, bias_stride, out_stride; /* row strides; bias element stride */
    int dtype;          /* QK_BF16, QK_F16; cpu also QK_F32 */
    int num_threads;
    int variant;        /* 0 auto, QK_LINEAR_MMA, QK_LINEAR_GEMV, QK_LINEAR_ROWS */
    int split;          /* 0 auto, else the cluster size 1, 2, 4 or 8 over which sm_90 splits K */
    int tile_m;         /* 0 auto, else 1..64: the mma.sync kernel's tile configuration for that M */
    int cpu_isa;        /* cpu: 0 auto, else the highest QK_CPU_ISA_* level to use */
    /* the backward ops: rows unit-stride along their last dimension; bias stride in elements */
    const void *grad_out;                           /* [M, N] */
    void *grad_x, *grad_w, *grad_gate, *grad_bias;  /* [M, K], [N, K], [N, K], [N]; NULL: not wanted */
    int64_t grad_out_stride, grad_x_stride, grad_w_stride, grad_gate_stride, grad_bias_stride;
    const qk_scratch *scratch; /* CUDA temporaries (see qk_scratch); NULL: the stream-ordered pool */
} qk_linear_args;

/* rmsnorm: out[r, :] = s * rsqrt(mean(s^2) + eps) * weight, s = x[r, :] in fp32, one rounding per output.
 * fused_add_rmsnorm (residual != NULL): s = x[r, :] + residual[r, :] in fp32; residual[r, :] = s rounded once
 *   to the dtype, and the norm is of the unrounded s (as FlashInfer's kernel computes it).
 * Rows: r in [0, R) is (i, j) = (r / R1, r % R1), so two strided leading dimensions reach every row
 *   (the binding collapses the leading dimensions to these two); strides in elements, rows unit-stride.
 * Aliasing: out may be x itself (each element of x is read before the same thread writes it); out never
 *   overlaps residual, and residual never overlaps x (the binding checks). */
typedef struct {
    const void *x;        /* [R, H] */
    void *residual;       /* [R, H], read and written; NULL for rmsnorm */
    const void *weight;   /* [H] */
    void *out;            /* [R, H] */
    int64_t R, R1, H;
    int64_t x_stride[2], res_stride[2], out_stride[2]; /* {i, j} row strides */
    int64_t w_stride;
    float eps;
    int dtype;            /* QK_F32, QK_F16, QK_BF16 (every tensor) */
    int num_threads;
    int variant;          /* 0 auto, or a QK_RMSNORM_* kernel */
} qk_rmsnorm_args;

/* The op table.  Every layer follows these two lists; adding an op is a row in each (see
 * docs/adding-an-op.md).
 *
 * QK_LAUNCHERS(X): X(name, args), one row per kernel entry point.  The CPU launcher is
 *   int qk_<name>_cpu(qk_<args>_args *a, void *stream) (csrc/cpu/), the CUDA launcher
 *   int qk_<name>_cuda(const qk_<args>_args *a, void *stream) (kernels/), reached through the
 *   qk_cuda_api entry <name>.
 * QK_OPS(X): X(op, launcher, family, deciding), one row per public op qkernels.<op>: its binding
 *   is qk_op_<op> (csrc/ops/), its docstrings qk_doc_<op> / qk_raw_doc_<op>, it runs launcher
 *   <launcher>, belongs to dispatch family <family> (the names use_backend and QKERNELS_OPS take),
 *   and its argument at position <deciding> picks the backend. */
#define QK_LAUNCHERS(X)                         \
    X(sparse_aggregate, sparse_aggregate)       \
    X(sparse_aggregate_backward, sparse_aggregate_backward) \
    X(sparse_aggregate_plan, sparse_aggregate_plan) \
    X(fused_edge_features, fused_edge_features) \
    X(fused_edge_features_backward, fused_edge_features_backward) \
    X(fused_edge_features_plan, fused_edge_features_plan) \
    X(fused_norm_residual, fused_norm_residual) \
    X(fused_norm_residual_backward, fused_norm_residual_backward) \
    X(graph_norm_bce, graph_norm_bce)           \
    X(graph_norm_bce_backward, graph_norm_bce)  \
    X(message_passing, message_passing)         \
    X(attn_decode, attn_decode)                 \
    X(attn_prefill, attn_prefill)               \
    X(rotary_emb, rotary_emb)                   \
    X(linear, linear)                           \
    X(swiglu, linear)                           \
    X(linear_backward, linear)                  \
    X(swiglu_backward, linear)                  \
    X(rmsnorm, rmsnorm)                         \
    X(rotary_kv_append, rotary_kv_append)

#define QK_OPS(X)                                                         \
    X(sparse_aggregate, sparse_aggregate, sparse_aggregate, 3)            \
    X(sparse_aggregate_backward, sparse_aggregate_backward, sparse_aggregate, 0) \
    X(sparse_aggregate_plan, sparse_aggregate_plan, graph_plan, 0)        \
    X(fused_edge_features, fused_edge_features, fused_edge_features, 0)   \
    X(fused_edge_features_backward, fused_edge_features_backward, fused_edge_features, 0) \
    X(fused_edge_features_plan, fused_edge_features_plan, graph_plan, 0)  \
    X(fused_norm_residual, fused_norm_residual, fused_norm_residual, 0)   \
    X(fused_norm_residual_backward, fused_norm_residual_backward, fused_norm_residual, 0) \
    X(graph_norm_bce, graph_norm_bce, graph_norm_bce, 0)                  \
    X(graph_norm_bce_backward, graph_norm_bce_backward, graph_norm_bce, 0) \
    X(message_passing, message_passing, message_passing, 0)              \
    X(rotary_emb, rotary_emb, rotary_emb, 0)                              \
    X(rotary_emb_backward, rotary_emb, rotary_emb, 0)                     \
    X(linear, linear, linear, 0)                                          \
    X(linear_backward, linear_backward, linear, 0)                        \
    X(swiglu, swiglu, swiglu, 0)                                          \
    X(swiglu_backward, swiglu_backward, swiglu, 0)                        \
    X(attn_decode, attn_decode, attention, 0)                             \
    X(attn_paged_decode, attn_decode, attention, 0)                       \
    X(attn_prefill, attn_prefill, attention, 0)                           \
    X(attn_paged_prefill, attn_prefill, attention, 0)                     \
    X(rmsnorm, rmsnorm, rmsnorm, 0)                                       \
    X(fused_add_rmsnorm, rmsnorm, rmsnorm, 0)                             \
    X(rotary_kv_append, rotary_kv_append, rotary_emb, 0)

/* The CUDA shared object exports one symbol, qk_cuda_get_api, returning this table. */
#define QK_CUDA_ABI 17

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
    /* Debug validation (QKERNELS_CHECK=1): synchronises the stream, fills bad_* on QK_E_INDEX. */
    int (*sparse_aggregate_check)(qk_sparse_aggregate_args *a, void *stream);
    /* Debug validation (QKERNELS_CHECK=1), synchronises the stream: the first of n indices
     * p[i * stride] (dtype QK_I32/QK_I64) outside [lo, hi) -> QK_E_INDEX with *bad_pos, *bad_value. */
    int (*index_check)(const void *p, int dtype, int64_t n, int64_t stride, int64_t lo, int64_t hi,
                       int64_t *bad_pos, int64_t *bad_value, void *stream);
    /* Where to look for cuBLASLt besides the loader's path and an nvidia wheel, set once by the binding
     * before any launch (the kernels read no environment): a library path tried first (or NULL), and
     * ':'-separated CUDA install roots tried after the others (or NULL). */
    void (*set_cublaslt_search)(const char *library, const char *roots);
    /* run(ctx, stream, scratch) on `device` with `stream` in stream capture (relaxed mode), the captured
     * graph discarded: launchers called there enqueue nothing that ever runs, while their scratch
     * requests reach their hook as in a real call.  scratch: scratch_bytes of device memory allocated on
     * the stream before the capture and freed after it, never touched (CUB's sorts memset their
     * temporaries, and the driver checks a captured memset's address), or NULL for 0 bytes.  Returns
     * run's status, else the capture's; the caller's current device is restored. */
    int (*dry_run)(int device, size_t scratch_bytes, int (*run)(void *ctx, void *stream, void *scratch), void *ctx);
    /* One entry per launcher, named as in QK_LAUNCHERS. */
#define QK_CUDA_ENTRY(name, args) int (*name)(const qk_##args##_args *a, void *stream);
    QK_LAUNCHERS(QK_CUDA_ENTRY)
#undef QK_CUDA_ENTRY
} qk_cuda_api;

typedef const qk_cuda_api *(*qk_cuda_get_api_fn)(int abi);

#ifdef __cplusplus
}
#endif

#endif
