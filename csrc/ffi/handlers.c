/* XLA FFI handlers: every op of the op table as an XLA custom call, for qkernels.jax.
 *
 * Always built into _C, against the XLA FFI C ABI as xla_ffi.h declares
 * it, so no jaxlib is needed at build time: a handler reads its buffers from the call frame and its
 * static arguments from the attributes, fills the op's args struct for contiguous row-major
 * buffers and runs the same launcher the DLPack binding runs (qk_<launcher>_cpu, or the
 * qk_cuda_api entry on the stream of the execution context).  No Python, no GIL, no environment,
 * nothing read back from the device.  Shapes, dtypes and attributes were validated at trace time
 * by qkernels/jax.py; what a handler checks again (arity, ranks, dtypes) guards against a call
 * frame built some other way, and errors name the op and the argument. */
#include "../qk.h" /* Python.h first: only the registration function at the end uses it */
#include "../cpu/cpu.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "xla_ffi.h"

/* Set once by _jax_handlers() (with the GIL held, before any handler can run). */
static int g_threads = 1;
static const qk_cuda_api *g_cuda;

/* Scratch blocks a launcher may hold at once (linear_backward's nesting holds the most, 3). */
#define FC_MAX_BLOCKS 8
#define FC_STR_(x) #x
#define FC_STR(x) FC_STR_(x)
/* Every block starts on this boundary, as cudaMallocAsync's do; XLA promises its buffers only 16 bytes,
 * so the scratch result is FC_ALIGN - 1 bytes longer than the blocks need and is aligned here. */
#define FC_ALIGN 256
/* The stand-in addresses a dry run gives the call's buffers: never dereferenced (nothing captured
 * runs), each exactly 16-byte aligned (what XLA promises; launchers choose vector paths at 16), apart
 * so that no two ranges meet.  Its scratch is real memory (qk_cuda_api.dry_run), never touched. */
#define FC_FAKE_BUFFER(i) ((void *)(((uintptr_t)1 << 44) + ((uintptr_t)(i) << 36) + 16))

typedef struct {
    XLA_FFI_CallFrame *cf;
    const char *op;
    int cuda;
    void *stream;
    XLA_FFI_Error *err;
    /* cuda: the launchers' temporaries, carved from the call's scratch result (qkernels.jax adds it at
     * trace time, sized by a dry run of this handler: qk_jax_scratch_bytes) in request order */
    qk_scratch scratch;
    char *base;             /* the result's first FC_ALIGN-aligned byte, or NULL */
    size_t cap;             /* bytes from base to the result's end */
    size_t top, peak;       /* the end of the live blocks; the most they reached */
    size_t refused, offset; /* a request that did not fit, and where it would have started */
    int too_many;           /* refused for the number of blocks, not their size */
    int nblocks;
    struct { size_t off, end; int live; } blocks[FC_MAX_BLOCKS];
    int sizing;             /* a dry run: errors go to msg, not to XLA */
    int hooked;             /* the args struct has the scratch hook (FC_SCRATCH) */
    char msg[512];
} fc;

/* The launchers' scratch (qk_scratch) from the scratch result: a stack of blocks, each on an FC_ALIGN
 * boundary.  The memory belongs to XLA's program, so a command-buffer replay finds it still there; a
 * dry run carves the same blocks from its own and keeps the peak. */
static int fc_scratch_alloc(void *ctx, size_t bytes, void *stream, void **p) {
    fc *c = (fc *)ctx;
    (void)stream;
    const size_t off = (c->top + FC_ALIGN - 1) & ~(size_t)(FC_ALIGN - 1);
    if (c->nblocks == FC_MAX_BLOCKS || off < c->top || bytes > c->cap || off > c->cap - bytes) {
        c->refused = bytes ? bytes : 1, c->offset = off, c->too_many = c->nblocks == FC_MAX_BLOCKS;
        return QK_E_NOMEM;
    }
    c->blocks[c->nblocks].off = off, c->blocks[c->nblocks].end = off + bytes, c->blocks[c->nblocks].live = 1;
    c->nblocks++;
    c->top = off + bytes;
    if (c->top > c->peak) c->peak = c->top;
    *p = c->base + off;
    return QK_OK;
}

/* A block is done with once the work enqueued so far is (the stream orders what comes after); the
 * stack shrinks past the blocks freed at its top. */
static int fc_scratch_free(void *ctx, void *p, size_t bytes, void *stream) {
    fc *c = (fc *)ctx;
    (void)stream, (void)bytes;
    int i = c->nblocks - 1;
    while (i >= 0 && !(c->blocks[i].live && c->base + c->blocks[i].off == (char *)p)) i--;
    if (i < 0) return QK_E_NOMEM; /* not ours: a launcher bug, reported */
    c->blocks[i].live = 0;
    while (c->nblocks > 0 && !c->blocks[c->nblocks - 1].live) c->nblocks--;
    c->top = c->nblocks > 0 ? c->blocks[c->nblocks - 1].end : 0;
    return QK_OK;
}

/* The scratch hook for an args struct: the scratch result on cuda (the cpu launchers take none).  A
 * handler that never asks for it runs a launcher that takes no scratch, which a dry run then skips. */
static const qk_scratch *fc_scratch_hook(fc *c) {
    c->hooked = 1;
    return c->cuda ? &c->scratch : NULL;
}
#define FC_SCRATCH(c) fc_scratch_hook(c)

/* A call's fc: the frame, the op, the platform and the scratch hook's callbacks, nothing else set. */
static void fc_init(fc *c, XLA_FFI_CallFrame *cf, const char *op, int cuda) {
    memset(c, 0, sizeof *c);
    c->cf = cf, c->op = op, c->cuda = cuda;
    c->scratch.alloc = fc_scratch_alloc, c->scratch.free = fc_scratch_free, c->scratch.ctx = c;
    c->scratch.sized_ahead = 1;
}

/* The scratch blocks' memory: from p's first FC_ALIGN boundary to p + bytes (none when shorter). */
static void fc_set_base(fc *c, void *p, size_t bytes) {
    const size_t skip = p ? (FC_ALIGN - (uintptr_t)p % FC_ALIGN) % FC_ALIGN : 0;
    c->base = p && bytes > skip ? (char *)p + skip : NULL;
    c->cap = c->base ? bytes - skip : 0;
}

/* What a dry run's handler returns for an error: the message is in c->msg. */
static XLA_FFI_Error *const FC_SIZING_ERROR = (XLA_FFI_Error *)&g_threads;

static XLA_FFI_Error *fc_fail(fc *c, XLA_FFI_Error_Code code, const char *fmt, ...) {
    char *msg = c->msg;
    int n = snprintf(msg, sizeof c->msg, "%s: ", c->op);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg + n, sizeof c->msg - (size_t)n, fmt, ap);
    va_end(ap);
    if (c->sizing) return c->err = FC_SIZING_ERROR;
    XLA_FFI_Error_Create_Args a = {XLA_FFI_Error_Create_Args_STRUCT_SIZE, NULL, msg, code};
    c->err = c->cf->api->XLA_FFI_Error_Create(&a); /* XLA copies the message */
    return c->err;
}

static int qk_from_xla(XLA_FFI_DataType t) {
    switch (t) {
    case XLA_FFI_DataType_F32: return QK_F32;
    case XLA_FFI_DataType_F16: return QK_F16;
    case XLA_FFI_DataType_BF16: return QK_BF16;
    case XLA_FFI_DataType_F64: return QK_F64;
    case XLA_FFI_DataType_S32: return QK_I32;
    case XLA_FFI_DataType_S64: return QK_I64;
    case XLA_FFI_DataType_PRED: return QK_BOOL;
    default: return -1;
    }
}

/* Argument i (ret: result i) of rank `rank` (-1: any) and a dtype qkernels knows (unless raw);
 * NULL with c->err set. */
static XLA_FFI_Buffer *fc_buf(fc *c, int ret, int i, const char *name, int rank, int raw) {
    const int64_t n = ret ? c->cf->rets.size : c->cf->args.size;
    const int is_buffer = i < n && (ret ? c->cf->rets.types[i] == XLA_FFI_RetType_BUFFER
                                        : c->cf->args.types[i] == XLA_FFI_ArgType_BUFFER);
    if (!is_buffer) {
        fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "%s (%s %d) is missing from the call", name,
                ret ? "result" : "operand", i);
        return NULL;
    }
    XLA_FFI_Buffer *b = (XLA_FFI_Buffer *)(ret ? c->cf->rets.rets[i] : c->cf->args.args[i]);
    if (rank >= 0 && b->rank != rank) {
        fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "%s must have %d dimensions, got %lld", name, rank,
                (long long)b->rank);
        return NULL;
    }
    if (!raw && qk_from_xla(b->dtype) < 0) {
        fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "%s has an XLA dtype (%d) qkernels does not take", name,
                (int)b->dtype);
        return NULL;
    }
    return b;
}
#define ARG(i, name, rank) fc_buf(c, 0, (i), (name), (rank), 0)
#define RET(i, name, rank) fc_buf(c, 1, (i), (name), (rank), 0)
#define NARGS ((int)c->cf->args.size)

static int dtype_of(const XLA_FFI_Buffer *b) { return qk_from_xla(b->dtype); }

static int64_t numel(const XLA_FFI_Buffer *b) {
    int64_t n = 1;
    for (int64_t i = 0; i < b->rank; i++) n *= b->dims[i];
    return n;
}

/* Row-major element strides of a dense buffer. */
static void dense_strides(const XLA_FFI_Buffer *b, int64_t *s) {
    int64_t acc = 1;
    for (int64_t i = b->rank - 1; i >= 0; i--) {
        s[i] = acc;
        acc *= b->dims[i];
    }
}

/* A scalar attribute as a double (any numeric XLA type); dflt when absent. */
static double fc_attr(fc *c, const char *name, double dflt) {
    const XLA_FFI_Attrs *at = &c->cf->attrs;
    const size_t len = strlen(name);
    for (int64_t i = 0; i < at->size; i++) {
        if (at->names[i]->len != len || memcmp(at->names[i]->ptr, name, len) != 0) continue;
        if (at->types[i] != XLA_FFI_AttrType_SCALAR) break;
        const XLA_FFI_Scalar *s = (const XLA_FFI_Scalar *)at->attrs[i];
        switch (s->dtype) {
        case XLA_FFI_DataType_PRED: return *(const uint8_t *)s->value != 0;
        case XLA_FFI_DataType_S8: return *(const int8_t *)s->value;
        case XLA_FFI_DataType_U8: return *(const uint8_t *)s->value;
        case XLA_FFI_DataType_S32: return *(const int32_t *)s->value;
        case XLA_FFI_DataType_U32: return *(const uint32_t *)s->value;
        case XLA_FFI_DataType_S64: return (double)*(const int64_t *)s->value;
        case XLA_FFI_DataType_U64: return (double)*(const uint64_t *)s->value;
        case XLA_FFI_DataType_F32: return *(const float *)s->value;
        case XLA_FFI_DataType_F64: return *(const double *)s->value;
        default: break;
        }
        break;
    }
    return dflt;
}

/* The attention ops' scale attribute; absent: 1/sqrt(head_dim), as the bindings default it. */
static float fc_scale(fc *c, int64_t D) { return (float)fc_attr(c, "scale", 1.0 / sqrt((double)(D > 0 ? D : 1))); }

/* An integer attribute exactly (int64 counts such as num_graphs do not survive a double). */
static int64_t fc_attr_i64(fc *c, const char *name, int64_t dflt) {
    const XLA_FFI_Attrs *at = &c->cf->attrs;
    const size_t len = strlen(name);
    for (int64_t i = 0; i < at->size; i++) {
        if (at->names[i]->len != len || memcmp(at->names[i]->ptr, name, len) != 0) continue;
        if (at->types[i] == XLA_FFI_AttrType_SCALAR) {
            const XLA_FFI_Scalar *s = (const XLA_FFI_Scalar *)at->attrs[i];
            if (s->dtype == XLA_FFI_DataType_S64) return *(const int64_t *)s->value;
            if (s->dtype == XLA_FFI_DataType_S32) return *(const int32_t *)s->value;
        }
        return (int64_t)fc_attr(c, name, (double)dflt);
    }
    return dflt;
}

/* Run launcher `name` where the call frame's platform says; status into st.  A dry run leaves out a
 * launcher without the scratch hook: it takes no scratch. */
#define FC_RUN(st, c, name, args)                                     \
    do {                                                              \
        if ((c)->sizing && !(c)->hooked) (st) = QK_OK;                \
        else if ((c)->cuda) (st) = g_cuda->name((args), (c)->stream); \
        else (st) = qk_##name##_cpu((args), NULL);                    \
    } while (0)

/* A launcher's non-zero status as an FFI error. */
static XLA_FFI_Error *fc_status(fc *c, int status) {
    if (status == QK_OK) return NULL;
    if (status == QK_E_UNSUPPORTED)
        return fc_fail(c, XLA_FFI_Error_Code_UNIMPLEMENTED, "no %s kernel for this dtype/shape combination",
                       c->cuda ? "cuda" : "cpu");
    if (status == QK_E_NOMEM && c->refused)
        return fc_fail(c, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED, "the launcher asked for %zu bytes of scratch at "
                       "offset %zu, past the %zu the call's scratch result holds (qkernels.jax sizes it at trace "
                       "time by a dry run on the default GPU: another device model may need more)",
                       c->refused, c->offset, c->cap);
    if (status == QK_E_NOMEM) return fc_fail(c, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED, "out of memory");
    if (status == QK_E_THREAD) return fc_fail(c, XLA_FFI_Error_Code_INTERNAL, "a CPU worker thread could not start");
    if (status > 0 && g_cuda)
        return fc_fail(c, XLA_FFI_Error_Code_INTERNAL, "CUDA error %d (%s)", status, g_cuda->error_string(status));
    return fc_fail(c, XLA_FFI_Error_Code_INTERNAL, "launcher status %d", status);
}

/* ---- the graph ops ------------------------------------------------------------------------- */

static XLA_FFI_Error *sa_index_error(fc *c, int bad_arg, int64_t pos, int64_t value, int64_t E, int64_t N_src) {
    if (bad_arg == 0)
        return fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                       "row_ptr must be non-decreasing with 0 <= row_ptr[i] <= E = %lld; row_ptr[%lld] = %lld",
                       (long long)E, (long long)pos, (long long)value);
    return fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                   "col_idx[%lld] = %lld is out of range for node_feat with N_src = %lld", (long long)pos,
                   (long long)value, (long long)N_src);
}

/* Command-buffer (CUDA graph) trait, per op.  XLA records a compatible handler once by stream capture
 * and replays the graph until its own buffers move, so everything a launcher writes must be one of
 * XLA's buffers: its scratch is the call's scratch result, not memory held only while the handler
 * runs.  Host-side first-use work in the launchers (cudaFuncSetAttribute, occupancy queries, loading
 * cuBLASLt) is legal under capture and already done by the trace-time dry run; nothing reads device
 * memory back.  Every op has it; an op that could not would say CB_NO here. */
enum { CB_NO = 0, CB_YES = XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE };

/* sparse_aggregate(row_ptr, col_idx, edge_weight, node_feat) -> out.  The CUDA launcher takes scratch
 * for the long rows' partials past 512 edges. */
static const unsigned cb_sparse_aggregate = CB_YES;
static XLA_FFI_Error *ffi_sparse_aggregate(fc *c) {
    XLA_FFI_Buffer *rp = ARG(0, "row_ptr", 1), *ci = rp ? ARG(1, "col_idx", 1) : NULL,
                   *ew = ci ? ARG(2, "edge_weight", 2) : NULL, *nf = ew ? ARG(3, "node_feat", 3) : NULL,
                   *out = nf ? RET(0, "out", 3) : NULL;
    if (!out) return c->err;
    qk_sparse_aggregate_args a = {0};
    a.row_ptr = rp->data, a.col_idx = ci->data, a.edge_weight = ew->data, a.node_feat = nf->data, a.out = out->data;
    a.num_dst = rp->dims[0] - 1, a.num_src = nf->dims[0], a.num_edges = ci->dims[0];
    a.num_heads = nf->dims[1], a.head_dim = nf->dims[2];
    a.row_ptr_stride = a.col_idx_stride = 1;
    dense_strides(ew, a.ew_stride);
    dense_strides(nf, a.nf_stride);
    dense_strides(out, a.out_stride);
    a.index_dtype = dtype_of(rp), a.dtype = dtype_of(nf), a.num_threads = g_threads;
    a.scratch = FC_SCRATCH(c);
    int st;
    FC_RUN(st, c, sparse_aggregate, &a);
    if (st == QK_E_INDEX) return sa_index_error(c, a.bad_arg, a.bad_pos, a.bad_value, a.num_edges, a.num_src);
    return fc_status(c, st);
}

/* sparse_aggregate_backward(grad_out, row_ptr, col_idx, edge_weight, node_feat[, plan]) -> (grad_edge_weight,
 * grad_node_feat); attributes edge_weight_grad, node_feat_grad (false: that result is [0], not
 * computed), deterministic. */
static const unsigned cb_sparse_aggregate_backward = CB_YES;
static XLA_FFI_Error *ffi_sparse_aggregate_backward(fc *c) {
    XLA_FFI_Buffer *go = ARG(0, "grad_out", 3), *rp = go ? ARG(1, "row_ptr", 1) : NULL,
                   *ci = rp ? ARG(2, "col_idx", 1) : NULL, *ew = ci ? ARG(3, "edge_weight", 2) : NULL,
                   *nf = ew ? ARG(4, "node_feat", 3) : NULL, *gw = nf ? RET(0, "grad_edge_weight", -1) : NULL,
                   *gn = gw ? RET(1, "grad_node_feat", -1) : NULL;
    if (!gn) return c->err;
    const int want_ew = fc_attr(c, "edge_weight_grad", 1) != 0, want_nf = fc_attr(c, "node_feat_grad", 1) != 0;
    qk_sparse_aggregate_backward_args a = {0};
    a.grad_out = go->data, a.row_ptr = rp->data, a.col_idx = ci->data, a.edge_weight = ew->data;
    a.node_feat = nf->data;
    a.grad_edge_weight = want_ew ? gw->data : NULL;
    a.grad_node_feat = want_nf ? gn->data : NULL;
    a.num_dst = rp->dims[0] - 1, a.num_src = nf->dims[0], a.num_edges = ci->dims[0];
    a.num_heads = nf->dims[1], a.head_dim = nf->dims[2];
    dense_strides(go, a.go_stride);
    dense_strides(ew, a.ew_stride);
    dense_strides(nf, a.nf_stride);
    a.row_ptr_stride = a.col_idx_stride = 1;
    a.index_dtype = dtype_of(rp), a.dtype = dtype_of(nf), a.num_threads = g_threads;
    a.deterministic = fc_attr(c, "deterministic", 1) != 0;
    a.scratch = FC_SCRATCH(c);
    if (NARGS > 5) { /* plan: int32 [N_src + 1 + 3E], or [0] for none */
        XLA_FFI_Buffer *plan = ARG(5, "plan", 1);
        if (!plan) return c->err;
        if (dtype_of(plan) != QK_I32) return fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "plan must be int32");
        if (plan->dims[0] != 0 && plan->dims[0] != a.num_src + 1 + 3 * a.num_edges)
            return fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "plan must have shape [N_src + 1 + 3E] = [%lld]",
                           (long long)(a.num_src + 1 + 3 * a.num_edges));
        a.plan = plan->dims[0] ? (const int32_t *)plan->data : NULL;
    }
    int st = QK_OK;
    if (want_ew || want_nf) FC_RUN(st, c, sparse_aggregate_backward, &a);
    if (st == QK_E_INDEX) return sa_index_error(c, a.bad_arg, a.bad_pos, a.bad_value, a.num_edges, a.num_src);
    return fc_status(c, st);
}

static XLA_FFI_Error *fe_index_error(fc *c, int bad_row, int64_t pos, int64_t value, int64_t N) {
    return fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "edge_index[%d, %lld] = %lld is out of range for x with N = %lld",
                   bad_row, (long long)pos, (long long)value, (long long)N);
}

/* fused_edge_features(x, edge_index[, edge_attr]) -> out */
static const unsigned cb_fused_edge_features = CB_YES;
static XLA_FFI_Error *ffi_fused_edge_features(fc *c) {
    XLA_FFI_Buffer *x = ARG(0, "x", 2), *ei = x ? ARG(1, "edge_index", 2) : NULL,
                   *ea = ei && NARGS > 2 ? ARG(2, "edge_attr", 2) : NULL, *out = ei ? RET(0, "out", 2) : NULL;
    if (!out || (NARGS > 2 && !ea)) return c->err;
    qk_fused_edge_features_args a = {0};
    a.x = x->data, a.edge_index = ei->data, a.edge_attr = ea ? ea->data : NULL, a.out = out->data;
    a.num_nodes = x->dims[0], a.num_edges = ei->dims[1], a.H = x->dims[1];
    dense_strides(x, a.x_stride);
    dense_strides(ei, a.ei_stride);
    if (ea) dense_strides(ea, a.ea_stride);
    dense_strides(out, a.out_stride);
    a.index_dtype = dtype_of(ei), a.dtype = dtype_of(x), a.num_threads = g_threads;
    int st = QK_OK;
    if (a.num_edges > 0 && a.H > 0) FC_RUN(st, c, fused_edge_features, &a);
    if (st == QK_E_INDEX) return fe_index_error(c, a.bad_row, a.bad_pos, a.bad_value, a.num_nodes);
    return fc_status(c, st);
}

/* fused_edge_features_backward(grad_out, x, edge_index[, plan]) -> (grad_x, grad_edge_attr: [E, H] when
 * grad_out has 3H columns, else [0]) */
static const unsigned cb_fused_edge_features_backward = CB_YES;
static XLA_FFI_Error *ffi_fused_edge_features_backward(fc *c) {
    XLA_FFI_Buffer *go = ARG(0, "grad_out", 2), *x = go ? ARG(1, "x", 2) : NULL,
                   *ei = x ? ARG(2, "edge_index", 2) : NULL, *gx = ei ? RET(0, "grad_x", 2) : NULL,
                   *ga = gx ? RET(1, "grad_edge_attr", -1) : NULL;
    if (!ga) return c->err;
    qk_fused_edge_features_backward_args a = {0};
    a.grad_out = go->data, a.x = x->data, a.edge_index = ei->data, a.grad_x = gx->data;
    a.num_nodes = x->dims[0], a.num_edges = ei->dims[1], a.H = x->dims[1];
    a.grad_edge_attr = go->dims[1] == 3 * a.H && a.H > 0 ? ga->data : NULL;
    dense_strides(go, a.go_stride);
    dense_strides(x, a.x_stride);
    dense_strides(ei, a.ei_stride);
    a.index_dtype = dtype_of(ei), a.dtype = dtype_of(x), a.num_threads = g_threads;
    a.scratch = FC_SCRATCH(c);
    if (NARGS > 3) { /* plan: int32 [N + 1 + 4E], or [0] for none */
        XLA_FFI_Buffer *plan = ARG(3, "plan", 1);
        if (!plan) return c->err;
        if (dtype_of(plan) != QK_I32) return fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "plan must be int32");
        if (plan->dims[0] != 0 && plan->dims[0] != a.num_nodes + 1 + 4 * a.num_edges)
            return fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "plan must have shape [N + 1 + 4E] = [%lld]",
                           (long long)(a.num_nodes + 1 + 4 * a.num_edges));
        a.plan = plan->dims[0] ? (const int32_t *)plan->data : NULL;
    }
    int st = QK_OK;
    if (a.num_nodes > 0 && a.H > 0) FC_RUN(st, c, fused_edge_features_backward, &a);
    if (st == QK_E_INDEX) return fe_index_error(c, a.bad_row, a.bad_pos, a.bad_value, a.num_nodes);
    return fc_status(c, st);
}

/* sparse_aggregate_plan(row_ptr, col_idx) -> int32 plan [num_src + 1 + 3E] (num_src from its length) */
static const unsigned cb_sparse_aggregate_plan = CB_YES;
static XLA_FFI_Error *ffi_sparse_aggregate_plan(fc *c) {
    XLA_FFI_Buffer *rp = ARG(0, "row_ptr", 1), *ci = rp ? ARG(1, "col_idx", 1) : NULL,
                   *out = ci ? RET(0, "plan", 1) : NULL;
    if (!out) return c->err;
    qk_sparse_aggregate_plan_args a = {0};
    a.row_ptr = rp->data, a.col_idx = ci->data, a.plan = (int32_t *)out->data;
    a.num_dst = rp->dims[0] - 1, a.num_edges = ci->dims[0], a.num_src = out->dims[0] - 1 - 3 * ci->dims[0];
    if (a.num_dst < 0 || a.num_src < 0)
        return fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "plan has %lld elements, fewer than 1 + 3E",
                       (long long)out->dims[0]);
    a.row_ptr_stride = a.col_idx_stride = 1;
    a.index_dtype = dtype_of(rp), a.num_threads = g_threads;
    a.scratch = FC_SCRATCH(c);
    int st;
    FC_RUN(st, c, sparse_aggregate_plan, &a);
    if (st == QK_E_INDEX) return sa_index_error(c, a.bad_arg, a.bad_pos, a.bad_value, a.num_edges, a.num_src);
    return fc_status(c, st);
}

/* fused_edge_features_plan(edge_index) -> int32 plan [num_nodes + 1 + 4E] (num_nodes from its length) */
static const unsigned cb_fused_edge_features_plan = CB_YES;
static XLA_FFI_Error *ffi_fused_edge_features_plan(fc *c) {
    XLA_FFI_Buffer *ei = ARG(0, "edge_index", 2), *out = ei ? RET(0, "plan", 1) : NULL;
    if (!out) return c->err;
    qk_fused_edge_features_plan_args a = {0};
    a.edge_index = ei->data, a.plan = (int32_t *)out->data;
    a.num_edges = ei->dims[1], a.num_nodes = out->dims[0] - 1 - 4 * ei->dims[1];
    if (a.num_nodes < 0)
        return fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "plan has %lld elements, fewer than 1 + 4E",
                       (long long)out->dims[0]);
    dense_strides(ei, a.ei_stride);
    a.index_dtype = dtype_of(ei), a.num_threads = g_threads;
    a.scratch = FC_SCRATCH(c);
    int st;
    FC_RUN(st, c, fused_edge_features_plan, &a);
    if (st == QK_E_INDEX) return fe_index_error(c, a.bad_row, a.bad_pos, a.bad_value, a.num_nodes);
    return fc_status(c, st);
}

static XLA_FFI_Error *mp_index_error(fc *c, const qk_message_passing_args *a) {
    const long long pos = (long long)a->bad_pos, value = (long long)a->bad_value;
    switch (a->bad_arg) {
    case 0:
    case 1:
        return fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "edge_index[%d, %lld] = %lld is out of range for x "
                       "with N = %lld", a->bad_arg, pos, value, (long long)a->num_nodes);
    case 2:
        return fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "row_ptr must be non-decreasing from row_ptr[0] = 0 to "
                       "row_ptr[N] = M = %lld; row_ptr[%lld] = %lld", (long long)a->num_entries, pos, value);
    case 3:
        return fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "col_idx[%lld] = %lld is out of range for x with "
                       "N = %lld", pos, value, (long long)a->num_nodes);
    default:
        return fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "dir_edge[%lld] = %lld is out of range for e with "
                       "E = %lld", pos, value, (long long)a->num_edges);
    }
}

/* message_passing(x, e, edge_index, row_ptr, col_idx, dir_edge, w1, b1, w_msg, b_msg, w_att, b_att, w_v, w_o,
 * gamma_x, beta_x, gamma_e, beta_e) -> (x_out [N, H], e_out [E, H]); attribute eps.  The CUDA launcher takes
 * scratch for the gates. */
static const unsigned cb_message_passing = CB_YES;
static XLA_FFI_Error *ffi_message_passing(fc *c) {
    static const char *const names[18] = {"x", "e", "edge_index", "row_ptr", "col_idx", "dir_edge", "w1", "b1",
                                          "w_msg", "b_msg", "w_att", "b_att", "w_v", "w_o", "gamma_x", "beta_x",
                                          "gamma_e", "beta_e"};
    static const int ranks[18] = {2, 2, 2, 1, 1, 1, 2, 1, 2, 1, 2, 1, 2, 2, 1, 1, 1, 1};
    XLA_FFI_Buffer *b[18];
    for (int i = 0; i < 18; i++)
        if (!(b[i] = ARG(i, names[i], ranks[i]))) return c->err;
    XLA_FFI_Buffer *xo = RET(0, "x_out", 2), *eo = xo ? RET(1, "e_out", 2) : NULL;
    if (!eo) return c->err;
    qk_message_passing_args a = {0};
    a.x = b[0]->data, a.e = b[1]->data, a.edge_index = b[2]->data;
    a.row_ptr = b[3]->data, a.col_idx = b[4]->data, a.dir_edge = b[5]->data;
    a.w1 = b[6]->data, a.b1 = b[7]->data, a.w_msg = b[8]->data, a.b_msg = b[9]->data;
    a.w_att = b[10]->data, a.b_att = b[11]->data, a.w_v = b[12]->data, a.w_o = b[13]->data;
    a.gamma_x = b[14]->data, a.beta_x = b[15]->data, a.gamma_e = b[16]->data, a.beta_e = b[17]->data;
    a.x_out = xo->data, a.e_out = eo->data;
    a.num_nodes = b[0]->dims[0], a.H = b[0]->dims[1], a.num_edges = b[1]->dims[0], a.num_entries = b[4]->dims[0];
    a.F = b[6]->dims[1], a.heads = b[10]->dims[1];
    /* the launchers split H into heads: a frame not built by qkernels.jax must not reach them otherwise */
    if (a.heads < 1 || a.H % a.heads != 0)
        return fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "the number of heads K = w_att.shape[1] = %lld must be "
                       ">= 1 and divide H = %lld", (long long)a.heads, (long long)a.H);
    dense_strides(b[0], a.x_stride);
    dense_strides(b[1], a.e_stride);
    dense_strides(b[2], a.ei_stride);
    dense_strides(b[6], a.w1_stride);
    dense_strides(b[8], a.wm_stride);
    dense_strides(b[10], a.wa_stride);
    dense_strides(b[12], a.wv_stride);
    dense_strides(b[13], a.wo_stride);
    a.rp_stride = a.ci_stride = a.de_stride = 1;
    a.b1_stride = a.bm_stride = a.ba_stride = a.gx_stride = a.bx_stride = a.ge_stride = a.be_stride = 1;
    a.eps = (float)fc_attr(c, "eps", 1e-5);
    a.ei_dtype = dtype_of(b[2]), a.csr_dtype = dtype_of(b[3]), a.de_dtype = dtype_of(b[5]), a.dtype = dtype_of(b[0]);
    a.num_threads = g_threads;
    a.scratch = FC_SCRATCH(c);
    int st = QK_OK;
    /* the cpu launcher checks the indices even where there is nothing to write, as the binding's call does */
    if (!c->cuda || (a.H > 0 && (a.num_nodes > 0 || a.num_edges > 0))) FC_RUN(st, c, message_passing, &a);
    if (st == QK_E_INDEX) return mp_index_error(c, &a);
    return fc_status(c, st);
}

/* drop when the 32-bit draw < p * 2^32 (as the binding) */
static void nr_dropout(double p, uint32_t *threshold, float *scale) {
    const double thr = ldexp(p, 32);
    *threshold = thr >= 4294967295.0 ? 0xFFFFFFFFu : (uint32_t)thr;
    *scale = p < 1.0 ? (float)(1.0 / (1.0 - p)) : 0.f;
}

/* The norm ops' shared part: seed (uint32 [2], low word first: the bytes of one int64, read where the
 * kernel runs) at operand seed_at and batch after it when num_graphs > 0.  T is either args struct. */
#define NR_COMMON(T, a, seed_at)                                                                        \
    do {                                                                                                \
        XLA_FFI_Buffer *seed_ = fc_buf(c, 0, (seed_at), "seed", 1, 1);                                                   \
        if (!seed_) return c->err;                                                                      \
        if (seed_->dims[0] != 2 || seed_->dtype != XLA_FFI_DataType_U32)                                \
            return fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "seed must be uint32 [2]");         \
        const double p_ = fc_attr(c, "p", 0.0);                                                         \
        (a).eps = (float)fc_attr(c, "eps", 1e-5);                                                       \
        (a).training = fc_attr(c, "training", 0) != 0 && p_ > 0;                                        \
        nr_dropout(p_, &(a).drop_threshold, &(a).scale);                                                \
        (a).seed_ptr = (a).training ? (const int64_t *)seed_->data : NULL;                              \
        const int64_t G_ = fc_attr_i64(c, "num_graphs", 0);                                             \
        if (G_ > 0) {                                                                                   \
            XLA_FFI_Buffer *batch_ = ARG((seed_at) + 1, "batch", 1);                                    \
            if (!batch_) return c->err;                                                                 \
            if ((a).R > 0) {                                                                            \
                (a).batch = batch_->data, (a).batch_stride = 1, (a).num_graphs = G_;                    \
                (a).index_dtype = dtype_of(batch_);                                                     \
            }                                                                                           \
        }                                                                                               \
        (a).num_threads = g_threads;                                                                    \
        (a).scratch = FC_SCRATCH(c);                                                                    \
    } while (0)

static XLA_FFI_Error *nr_status(fc *c, int st, int64_t pos, int64_t value, int64_t G) {
    if (st == QK_E_INDEX)
        return fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "batch[%lld] = %lld is out of range for num_graphs = %lld",
                       (long long)pos, (long long)value, (long long)G);
    return fc_status(c, st);
}

/* fused_norm_residual(x, residual, gamma, beta, seed[, batch]) -> out; attributes p, training, eps,
 * num_graphs (0: row mode).  The graph-mode CUDA launcher takes scratch. */
static const unsigned cb_fused_norm_residual = CB_YES;
static XLA_FFI_Error *ffi_fused_norm_residual(fc *c) {
    XLA_FFI_Buffer *x = ARG(0, "x", 2), *r = x ? ARG(1, "residual", 2) : NULL, *g = r ? ARG(2, "gamma", 1) : NULL,
                   *b = g ? ARG(3, "beta", 1) : NULL, *out = b ? RET(0, "out", 2) : NULL;
    if (!out) return c->err;
    qk_fused_norm_residual_args a = {0};
    a.x = x->data, a.residual = r->data, a.gamma = g->data, a.beta = b->data, a.out = out->data;
    a.R = x->dims[0], a.H = x->dims[1];
    dense_strides(x, a.x_stride);
    dense_strides(r, a.res_stride);
    dense_strides(out, a.out_stride);
    a.gamma_stride = a.beta_stride = 1;
    a.dtype = dtype_of(x);
    NR_COMMON(qk_fused_norm_residual_args, a, 4);
    int st = QK_OK;
    if (a.R > 0 && (a.H > 0 || a.batch)) FC_RUN(st, c, fused_norm_residual, &a);
    return nr_status(c, st, a.bad_pos, a.bad_value, a.num_graphs);
}

/* fused_norm_residual_backward(grad_out, x, gamma, seed[, batch]) -> (grad_x, grad_gamma, grad_beta) */
static const unsigned cb_fused_norm_residual_backward = CB_YES;
static XLA_FFI_Error *ffi_fused_norm_residual_backward(fc *c) {
    XLA_FFI_Buffer *go = ARG(0, "grad_out", 2), *x = go ? ARG(1, "x", 2) : NULL, *g = x ? ARG(2, "gamma", 1) : NULL,
                   *gx = g ? RET(0, "grad_x", 2) : NULL, *gg = gx ? RET(1, "grad_gamma", 1) : NULL,
                   *gb = gg ? RET(2, "grad_beta", 1) : NULL;
    if (!gb) return c->err;
    qk_fused_norm_residual_backward_args a = {0};
    a.grad_out = go->data, a.x = x->data, a.gamma = g->data;
    a.grad_x = gx->data, a.grad_gamma = gg->data, a.grad_beta = gb->data;
    a.R = x->dims[0], a.H = x->dims[1];
    dense_strides(go, a.go_stride);
    dense_strides(x, a.x_stride);
    dense_strides(gx, a.gx_stride);
    a.gamma_stride = a.gg_stride = a.gb_stride = 1;
    a.dtype = dtype_of(x);
    NR_COMMON(qk_fused_norm_residual_backward_args, a, 3);
    int st = QK_OK;
    if (a.H > 0 || a.batch) FC_RUN(st, c, fused_norm_residual_backward, &a);
    return nr_status(c, st, a.bad_pos, a.bad_value, a.num_graphs);
}

/* graph_norm_bce's inputs from operand `first` on: logits, target, edge_graph[, pos_weight [E] or []];
 * attributes num_graphs, pos_weight (a float; has_pos_weight says whether one was given). */
static int gb_fill(fc *c, int first, qk_graph_norm_bce_args *a) {
    XLA_FFI_Buffer *lg = ARG(first, "logits", 1), *tg = lg ? ARG(first + 1, "target", 1) : NULL,
                   *eg = tg ? ARG(first + 2, "edge_graph", 1) : NULL;
    if (!eg) return -1;
    a->logits = lg->data, a->target = tg->data, a->edge_graph = eg->data;
    a->num_edges = lg->dims[0];
    a->num_graphs = fc_attr_i64(c, "num_graphs", 1);
    a->logits_stride = a->target_stride = a->graph_stride = 1;
    a->pos_weight = (float)fc_attr(c, "pos_weight", 1.0);
    a->has_pos_weight = fc_attr(c, "has_pos_weight", 0) != 0;
    if (NARGS > first + 3) {
        XLA_FFI_Buffer *pw = ARG(first + 3, "pos_weight", -1);
        if (!pw) return -1;
        a->has_pos_weight = 1;
        if (a->num_edges > 0) {
            a->pos_weight_t = pw->data;
            a->pw_stride = numel(pw) == a->num_edges && a->num_edges > 1 ? 1 : 0;
            a->pw_dtype = dtype_of(pw);
        }
    }
    a->dtype = dtype_of(lg), a->index_dtype = dtype_of(eg), a->num_threads = g_threads;
    a->scratch = FC_SCRATCH(c);
    return 0;
}

static XLA_FFI_Error *gb_status(fc *c, int st, const qk_graph_norm_bce_args *a) {
    if (st == QK_E_INDEX)
        return fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "edge_graph[%lld] = %lld is out of range for num_graphs = %lld",
                       (long long)a->bad_pos, (long long)a->bad_value, (long long)a->num_graphs);
    return fc_status(c, st);
}

/* graph_norm_bce(logits, target, edge_graph[, pos_weight]) -> float32 [] */
static const unsigned cb_graph_norm_bce = CB_YES;
static XLA_FFI_Error *ffi_graph_norm_bce(fc *c) {
    qk_graph_norm_bce_args a = {0};
    if (gb_fill(c, 0, &a) < 0) return c->err;
    XLA_FFI_Buffer *out = RET(0, "out", 0);
    if (!out) return c->err;
    a.out = (float *)out->data;
    int st;
    FC_RUN(st, c, graph_norm_bce, &a);
    return gb_status(c, st, &a);
}

/* graph_norm_bce_backward(grad [] float32, logits, target, edge_graph[, pos_weight]) -> grad_logits [E] */
static const unsigned cb_graph_norm_bce_backward = CB_YES;
static XLA_FFI_Error *ffi_graph_norm_bce_backward(fc *c) {
    XLA_FFI_Buffer *g = ARG(0, "grad", 0);
    qk_graph_norm_bce_args a = {0};
    if (!g || gb_fill(c, 1, &a) < 0) return c->err;
    XLA_FFI_Buffer *gl = RET(0, "grad_logits", 1);
    if (!gl) return c->err;
    a.grad = (const float *)g->data, a.grad_logits = gl->data, a.grad_stride = 1;
    int st = QK_OK;
    if (a.num_edges > 0) FC_RUN(st, c, graph_norm_bce_backward, &a);
    return gb_status(c, st, &a);
}

/* ---- the dense LLM ops --------------------------------------------------------------------- */

/* rotary_emb(x [B, S, H, D], freqs_cis [B, S, D/2, 2]) -> out; attribute interleaved.  Python passes
 * 4-D (a 3-D call is B = 1). */
static XLA_FFI_Error *ro_run(fc *c, int inverse) {
    XLA_FFI_Buffer *x = ARG(0, inverse ? "grad_out" : "x", 4), *f = x ? ARG(1, "freqs_cis", 4) : NULL,
                   *out = f ? RET(0, "out", 4) : NULL;
    if (!out) return c->err;
    qk_rotary_emb_args a = {0};
    int64_t xs[4], fs[4];
    dense_strides(x, xs);
    dense_strides(f, fs);
    a.x = x->data, a.out = out->data, a.freqs = (const float *)f->data;
    a.B = x->dims[0], a.S = x->dims[1], a.H = x->dims[2], a.D = x->dims[3];
    for (int i = 0; i < 3; i++) {
        a.x_stride[i] = a.out_stride[i] = xs[i];
        a.f_stride[i] = f->dims[i] == 1 ? 0 : fs[i]; /* freqs broadcast over a size-1 batch */
    }
    a.interleaved = fc_attr(c, "interleaved", 1) != 0;
    a.inverse = inverse;
    a.dtype = dtype_of(x), a.num_threads = g_threads;
    int st = QK_OK;
    if (numel(x) > 0) FC_RUN(st, c, rotary_emb, &a);
    return fc_status(c, st);
}
static const unsigned cb_rotary_emb = CB_YES;
static XLA_FFI_Error *ffi_rotary_emb(fc *c) { return ro_run(c, 0); }
static const unsigned cb_rotary_emb_backward = CB_YES;
static XLA_FFI_Error *ffi_rotary_emb_backward(fc *c) { return ro_run(c, 1); }

/* The linear family's common end: a runs through linear, swiglu or their backward launchers when run
 * is set. */
static XLA_FFI_Error *ln_launch(fc *c, qk_linear_args *a, int swiglu, int backward, int run) {
    a->num_threads = g_threads;
    a->scratch = FC_SCRATCH(c);
    int st = QK_OK;
    if (run && backward) {
        if (swiglu) FC_RUN(st, c, swiglu_backward, a);
        else FC_RUN(st, c, linear_backward, a);
    } else if (run) {
        if (swiglu) FC_RUN(st, c, swiglu, a);
        else FC_RUN(st, c, linear, a);
    }
    return fc_status(c, st);
}

/* linear(x [M, K], weight [N, K][, bias [N]]) and swiglu(x, up, gate) -> [M, N].  Python flattens
 * leading dimensions.  Large M reaches cuBLASLt, whose workspace is scratch. */
static XLA_FFI_Error *ln_run(fc *c, int swiglu) {
    XLA_FFI_Buffer *x = ARG(0, "x", 2), *w = x ? ARG(1, swiglu ? "up_weight" : "weight", 2) : NULL,
                   *third = w && (swiglu || NARGS > 2) ? ARG(2, swiglu ? "gate_weight" : "bias", swiglu ? 2 : 1) : NULL,
                   *out = w ? RET(0, "out", 2) : NULL;
    if (!out || ((swiglu || NARGS > 2) && !third)) return c->err;
    qk_linear_args a = {0};
    a.x = x->data, a.w = w->data, a.out = out->data;
    a.gate = swiglu ? third->data : NULL;
    a.bias = !swiglu && third ? third->data : NULL;
    a.M = x->dims[0], a.K = x->dims[1], a.N = w->dims[0];
    a.x_stride = a.K, a.w_stride = a.K, a.gate_stride = swiglu ? a.K : 0, a.out_stride = a.N;
    a.bias_stride = a.bias ? 1 : 0;
    a.dtype = dtype_of(x);
    return ln_launch(c, &a, swiglu, 0, a.M > 0 && a.N > 0);
}
static const unsigned cb_linear = CB_YES;
static XLA_FFI_Error *ffi_linear(fc *c) { return ln_run(c, 0); }
static const unsigned cb_swiglu = CB_YES;
static XLA_FFI_Error *ffi_swiglu(fc *c) { return ln_run(c, 1); }

/* linear_backward(grad_out [M, N], x [M, K], weight) -> (grad_x, grad_weight, grad_bias) and
 * swiglu_backward(grad_out, x, up, gate) -> (grad_x, grad_up, grad_gate); attributes x_grad,
 * weight_grad, bias_grad (a result not asked for is [0] and not computed). */
static XLA_FFI_Error *lb_run(fc *c, int swiglu) {
    XLA_FFI_Buffer *g = ARG(0, "grad_out", 2), *x = g ? ARG(1, "x", 2) : NULL,
                   *w = x ? ARG(2, swiglu ? "up_weight" : "weight", 2) : NULL,
                   *gate = w && swiglu ? ARG(3, "gate_weight", 2) : NULL, *r0 = w ? RET(0, "grad_x", -1) : NULL,
                   *r1 = r0 ? RET(1, "grad_weight", -1) : NULL, *r2 = r1 ? RET(2, "grad_bias", -1) : NULL;
    if (!r2 || (swiglu && !gate)) return c->err;
    const int want_x = fc_attr(c, "x_grad", 1) != 0, want_w = fc_attr(c, "weight_grad", 1) != 0;
    const int want_b = !swiglu && fc_attr(c, "bias_grad", 0) != 0;
    qk_linear_args a = {0};
    a.x = x->data, a.w = w->data, a.gate = swiglu ? gate->data : NULL;
    a.M = x->dims[0], a.K = x->dims[1], a.N = w->dims[0];
    a.x_stride = a.w_stride = a.K, a.gate_stride = swiglu ? a.K : 0;
    a.grad_out = g->data, a.grad_out_stride = a.N;
    a.grad_x = want_x ? r0->data : NULL, a.grad_x_stride = a.K;
    a.grad_w = want_w ? r1->data : NULL, a.grad_w_stride = a.K;
    a.grad_gate = swiglu && want_w ? r2->data : NULL, a.grad_gate_stride = swiglu ? a.K : 0;
    a.grad_bias = want_b ? r2->data : NULL, a.grad_bias_stride = 1;
    a.dtype = dtype_of(x);
    return ln_launch(c, &a, swiglu, 1, (want_x && a.M > 0 && a.K > 0) || (want_w && a.N > 0 && a.K > 0) ||
                                           (want_b && a.N > 0));
}
static const unsigned cb_linear_backward = CB_YES;
static XLA_FFI_Error *ffi_linear_backward(fc *c) { return lb_run(c, 0); }
static const unsigned cb_swiglu_backward = CB_YES;
static XLA_FFI_Error *ffi_swiglu_backward(fc *c) { return lb_run(c, 1); }

/* ---- attention ----------------------------------------------------------------------------- */

static XLA_FFI_Error *attn_pool_error(fc *c, int bad_arg, int64_t pos, int64_t value) {
    static const char *const what[] = {"req_pool_indices", "kv_indptr (a sequence length)", "req_to_token (a slot)",
                                       "qo_indptr (a query row range)"};
    if (bad_arg == 4)
        return fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                       "mask has fewer query rows than request %lld has queries (%lld)", (long long)pos,
                       (long long)value);
    return fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "%s at position %lld holds %lld, out of range",
                   what[bad_arg >= 0 && bad_arg < 4 ? bad_arg : 0], (long long)pos, (long long)value);
}

/* A mask operand as qkernels.jax normalised it (shapes checked there, as the bindings check them):
 * [B|1, W] (decode, or a prefill key mask) or [B|1, 1|Hq, rows, W] (prefill per query), bool (True =
 * keep) or a float added to the scores; strides into s, 0 for a size-1 dimension (broadcast). */
static XLA_FFI_Buffer *fc_mask(fc *c, int i, int rank, int64_t *s, int *is_float, int *dtype) {
    XLA_FFI_Buffer *m = ARG(i, "mask", -1);
    if (!m) return NULL;
    if (m->rank != 2 && !(rank == 4 && m->rank == 4)) {
        fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "mask must have 2%s dimensions, got %lld",
                rank == 4 ? " or 4" : "", (long long)m->rank);
        return NULL;
    }
    *dtype = dtype_of(m);
    *is_float = *dtype != QK_BOOL;
    if (*is_float && *dtype != QK_F32 && *dtype != QK_F16 && *dtype != QK_BF16) {
        fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "mask must be bool or a float (float32, float16, bfloat16)");
        return NULL;
    }
    if (m->dims[m->rank - 1] < 1) {
        fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "mask must have at least one column");
        return NULL;
    }
    dense_strides(m, s);
    for (int64_t d = 0; d < m->rank; d++)
        if (m->dims[d] == 1) s[d] = 0;
    return m;
}

/* The decode ops' mask (operand i) into a. */
static int ad_mask(fc *c, int i, qk_attn_decode_args *a) {
    int64_t s[4];
    XLA_FFI_Buffer *m = fc_mask(c, i, 2, s, &a->mask_float, &a->mask_dtype);
    if (!m) return -1;
    a->mask = m->data, a->mask_cols = m->dims[1];
    a->mask_stride[0] = s[0], a->mask_stride[1] = 1;
    return 0;
}

/* The prefill ops' mask (operand i) into a: a 2-D bool mask is a key list (mask_kind 1), everything
 * else mask_kind 2; paged, a per-query mask's rows limit the queries of a request (mask_rows). */
static int ap_mask(fc *c, int i, qk_attn_prefill_args *a) {
    int64_t s[4];
    XLA_FFI_Buffer *m = fc_mask(c, i, 4, s, &a->mask_float, &a->mask_dtype);
    if (!m) return -1;
    a->mask = m->data, a->mask_cols = m->dims[m->rank - 1];
    if (m->rank == 2) {
        a->mask_kind = a->mask_float ? 2 : 1;
        a->mask_stride[0] = s[0], a->mask_stride[3] = 1;
    } else {
        a->mask_kind = 2;
        for (int d = 0; d < 4; d++) a->mask_stride[d] = s[d];
        a->mask_rows = a->paged && m->dims[2] > 1 ? m->dims[2] : 0;
    }
    return 0;
}

/* The paged ops' operands 0 .. n-1: q [rows, Hq, D], k_cache, v_cache [S, Hkv, D], req_to_token,
 * req_pool_indices, kv_indptr (and qo_indptr with n = 7), then result 0 (out) into b[n]; -1 with c->err
 * set at the first one missing or of the wrong rank, in operand order. */
static int pool_operands(fc *c, int n, XLA_FFI_Buffer **b) {
    static const char *const names[] = {"q", "k_cache", "v_cache", "req_to_token", "req_pool_indices", "kv_indptr",
                                        "qo_indptr"};
    static const int ranks[] = {3, 3, 3, 2, 1, 1, 1};
    for (int i = 0; i < n; i++)
        if (!(b[i] = ARG(i, names[i], ranks[i]))) return -1;
    return (b[n] = RET(0, "out", 3)) ? 0 : -1;
}

/* The fields both paged args structs (decode's, prefill's) take from pool_operands' b: q and out rows
 * at q_stride[lo], [lo + 1] (decode {t, h}, prefill {0, t, h}), the pools at k_stride[1], [2]
 * ({0, s, h}: stride 0 is never read) and the request table.  A macro: the structs differ. */
#define POOL_FILL(a, b, n, lo)                                                                                 \
    do {                                                                                                       \
        int64_t s_[3];                                                                                         \
        (a).paged = 1;                                                                                         \
        (a).q = (b)[0]->data, (a).out = (b)[n]->data, (a).k = (b)[1]->data, (a).v = (b)[2]->data;              \
        (a).Hq = (b)[0]->dims[1], (a).D = (b)[0]->dims[2], (a).Hkv = (b)[1]->dims[1];                          \
        (a).num_requests = (b)[3]->dims[0], (a).max_ctx = (b)[3]->dims[1], (a).pool_size = (b)[1]->dims[0];    \
        dense_strides((b)[0], s_);                                                                             \
        (a).q_stride[lo] = (a).out_stride[lo] = s_[0], (a).q_stride[(lo) + 1] = (a).out_stride[(lo) + 1] = s_[1]; \
        dense_strides((b)[1], s_);                                                                             \
        (a).k_stride[1] = (a).v_stride[1] = s_[0], (a).k_stride[2] = (a).v_stride[2] = s_[1];                  \
        (a).req_to_token = (b)[3]->data, (a).r2t_stride[0] = (a).max_ctx, (a).r2t_stride[1] = 1;               \
        (a).r2t_dtype = dtype_of((b)[3]);                                                                      \
        (a).req_pool_indices = (b)[4]->data, (a).rpi_stride = 1, (a).rpi_dtype = dtype_of((b)[4]);             \
    } while (0)

/* attn_decode(q [B, 1, Hq, D], k, v [B, Lkv, Hkv, D][, kv_lens [B]][, mask [B|1, Lkv]]) -> out;
 * attributes scale, has_kv_lens.  The CUDA launcher may take a split-K workspace as scratch. */
static const unsigned cb_attn_decode = CB_YES;
static XLA_FFI_Error *ffi_attn_decode(fc *c) {
    XLA_FFI_Buffer *q = ARG(0, "q", 4), *k = q ? ARG(1, "k", 4) : NULL, *v = k ? ARG(2, "v", 4) : NULL,
                   *out = v ? RET(0, "out", 4) : NULL;
    if (!out) return c->err;
    qk_attn_decode_args a = {0};
    int64_t s[4];
    a.q = q->data, a.out = out->data, a.k = k->data, a.v = v->data;
    a.B = q->dims[0], a.Hq = q->dims[2], a.D = q->dims[3], a.Hkv = k->dims[2], a.Lkv = k->dims[1];
    dense_strides(q, s);
    a.q_stride[0] = a.out_stride[0] = s[0], a.q_stride[1] = a.out_stride[1] = s[2];
    dense_strides(k, s);
    for (int i = 0; i < 3; i++) a.k_stride[i] = a.v_stride[i] = s[i];
    const int has_kl = fc_attr(c, "has_kv_lens", 0) != 0;
    if (has_kl) {
        XLA_FFI_Buffer *kl = ARG(3, "kv_lens", 1);
        if (!kl) return c->err;
        a.kv_lens = kl->data, a.kv_lens_stride = 1, a.kv_lens_dtype = dtype_of(kl);
    }
    if (NARGS > 3 + has_kl && ad_mask(c, 3 + has_kl, &a) < 0) return c->err;
    a.scale = fc_scale(c, a.D);
    a.dtype = dtype_of(q), a.num_threads = g_threads;
    a.scratch = FC_SCRATCH(c);
    int st = QK_OK;
    if (a.B > 0 && a.Hq > 0) FC_RUN(st, c, attn_decode, &a);
    return fc_status(c, st);
}

/* attn_paged_decode(q [B, Hq, D], k_cache, v_cache [S, Hkv, D], req_to_token, req_pool_indices,
 * kv_indptr[, new_k, new_v][, mask [B|1, W]]) -> out, or (out, k_cache, v_cache) with new_k/new_v
 * (attribute has_new): the caches alias operands 1 and 2, so the pools are written in place. */
static const unsigned cb_attn_paged_decode = CB_YES;
static XLA_FFI_Error *ffi_attn_paged_decode(fc *c) {
    XLA_FFI_Buffer *b[7];
    if (pool_operands(c, 6, b) < 0) return c->err;
    XLA_FFI_Buffer *q = b[0], *kc = b[1], *vc = b[2], *ind = b[5];
    qk_attn_decode_args a = {0};
    int64_t s[3];
    POOL_FILL(a, b, 6, 0);
    a.B = q->dims[0];
    a.kv_indptr = ind->data, a.indptr_stride = 1, a.indptr_dtype = dtype_of(ind);
    const int has_new = fc_attr(c, "has_new", 0) != 0;
    if (NARGS > 6 + 2 * has_new && ad_mask(c, 6 + 2 * has_new, &a) < 0) return c->err;
    if (has_new) {
        XLA_FFI_Buffer *nk = ARG(6, "new_k", 3), *nv = nk ? ARG(7, "new_v", 3) : NULL,
                       *ko = nv ? RET(1, "k_cache", 3) : NULL, *vo = ko ? RET(2, "v_cache", 3) : NULL;
        if (!vo) return c->err;
        if (ko->data != kc->data || vo->data != vc->data)
            return fc_fail(c, XLA_FFI_Error_Code_FAILED_PRECONDITION, "k_cache and v_cache must alias the results");
        a.new_k = nk->data, a.new_v = nv->data;
        dense_strides(nk, s);
        a.new_k_stride[0] = a.new_v_stride[0] = s[0], a.new_k_stride[1] = a.new_v_stride[1] = s[1];
    }
    a.scale = fc_scale(c, a.D);
    a.dtype = dtype_of(q), a.num_threads = g_threads;
    a.scratch = FC_SCRATCH(c);
    int st = QK_OK;
    if (a.B > 0 && a.Hq > 0) FC_RUN(st, c, attn_decode, &a);
    if (st == QK_E_INDEX) return attn_pool_error(c, a.bad_arg, a.bad_pos, a.bad_value);
    return fc_status(c, st);
}

/* attn_prefill(q [B, Lq, Hq, D], k, v [B, Lkv, Hkv, D][, mask]) -> out; attributes is_causal, scale. */
static const unsigned cb_attn_prefill = CB_YES;
static XLA_FFI_Error *ffi_attn_prefill(fc *c) {
    XLA_FFI_Buffer *q = ARG(0, "q", 4), *k = q ? ARG(1, "k", 4) : NULL, *v = k ? ARG(2, "v", 4) : NULL,
                   *out = v ? RET(0, "out", 4) : NULL;
    if (!out) return c->err;
    qk_attn_prefill_args a = {0};
    int64_t s[4];
    a.q = q->data, a.out = out->data, a.k = k->data, a.v = v->data;
    a.B = q->dims[0], a.Lq = q->dims[1], a.Hq = q->dims[2], a.D = q->dims[3], a.Lkv = k->dims[1], a.Hkv = k->dims[2];
    dense_strides(q, s);
    for (int i = 0; i < 3; i++) a.q_stride[i] = a.out_stride[i] = s[i];
    dense_strides(k, s);
    for (int i = 0; i < 3; i++) a.k_stride[i] = a.v_stride[i] = s[i];
    if (NARGS > 3 && ap_mask(c, 3, &a) < 0) return c->err;
    a.causal = fc_attr(c, "is_causal", 0) != 0;
    a.scale = fc_scale(c, a.D);
    a.dtype = dtype_of(q), a.num_threads = g_threads;
    int st = QK_OK;
    if (numel(q) > 0) FC_RUN(st, c, attn_prefill, &a);
    return fc_status(c, st);
}

/* attn_paged_prefill(q [total_q, Hq, D], k_cache, v_cache, req_to_token, req_pool_indices, kv_indptr,
 * qo_indptr[, mask]) -> out; attributes is_causal, scale. */
static const unsigned cb_attn_paged_prefill = CB_YES;
static XLA_FFI_Error *ffi_attn_paged_prefill(fc *c) {
    XLA_FFI_Buffer *b[8];
    if (pool_operands(c, 7, b) < 0) return c->err;
    XLA_FFI_Buffer *q = b[0], *rpi = b[4], *kvi = b[5], *qoi = b[6];
    qk_attn_prefill_args a = {0};
    POOL_FILL(a, b, 7, 1);
    a.B = rpi->dims[0], a.total_q = q->dims[0];
    a.kv_indptr = kvi->data, a.kv_indptr_stride = 1, a.kv_indptr_dtype = dtype_of(kvi);
    a.qo_indptr = qoi->data, a.qo_indptr_stride = 1, a.qo_indptr_dtype = dtype_of(qoi);
    if (NARGS > 7 && ap_mask(c, 7, &a) < 0) return c->err;
    a.causal = fc_attr(c, "is_causal", 0) != 0;
    a.scale = fc_scale(c, a.D);
    a.dtype = dtype_of(q), a.num_threads = g_threads;
    int st = QK_OK;
    if (numel(q) > 0 && a.B > 0) FC_RUN(st, c, attn_prefill, &a);
    if (st == QK_E_INDEX) return attn_pool_error(c, a.bad_arg, a.bad_pos, a.bad_value);
    return fc_status(c, st);
}

/* ---- rmsnorm --------------------------------------------------------------------------------- */

/* rmsnorm(x [R, H], weight [H]) -> out, and fused_add_rmsnorm(x, residual [R, H], weight) -> (out,
 * residual): the second result aliases operand 1, so residual is written in place.  Attribute eps.
 * Python flattens the leading dimensions. */
static XLA_FFI_Error *rn_run(fc *c, int fused) {
    XLA_FFI_Buffer *x = ARG(0, "x", 2), *r = x && fused ? ARG(1, "residual", 2) : NULL,
                   *w = x && (r || !fused) ? ARG(1 + fused, "weight", 1) : NULL, *out = w ? RET(0, "out", 2) : NULL,
                   *ro = out && fused ? RET(1, "residual", 2) : NULL;
    if (!out || (fused && !ro)) return c->err;
    if (fused && ro->data != r->data)
        return fc_fail(c, XLA_FFI_Error_Code_FAILED_PRECONDITION, "residual must alias the second result");
    qk_rmsnorm_args a = {0};
    a.x = x->data, a.weight = w->data, a.out = out->data, a.residual = fused ? r->data : NULL;
    a.R = x->dims[0], a.R1 = 1, a.H = x->dims[1];
    a.x_stride[0] = a.out_stride[0] = a.res_stride[0] = a.H;
    a.w_stride = 1;
    a.eps = (float)fc_attr(c, "eps", 1e-6);
    a.dtype = dtype_of(x), a.num_threads = g_threads;
    int st = QK_OK;
    if (a.R > 0 && a.H > 0) FC_RUN(st, c, rmsnorm, &a);
    return fc_status(c, st);
}
static const unsigned cb_rmsnorm = CB_YES;
static XLA_FFI_Error *ffi_rmsnorm(fc *c) { return rn_run(c, 0); }
static const unsigned cb_fused_add_rmsnorm = CB_YES;
static XLA_FFI_Error *ffi_fused_add_rmsnorm(fc *c) { return rn_run(c, 1); }

/* ---- rotary_kv_append ---------------------------------------------------------------------- */

/* rotary_kv_append(q [T, Hq, D], k, v [T, Hkv, D], cos_sin [max_pos, D/2, 2], positions [T], k_pool,
 * v_pool [S, Hkv, D], slots [T]) -> (out, k_pool, v_pool): the pools alias operands 5 and 6, so the new
 * tokens are written in place.  Attribute interleaved. */
static const unsigned cb_rotary_kv_append = CB_YES;
static XLA_FFI_Error *ffi_rotary_kv_append(fc *c) {
    XLA_FFI_Buffer *q = ARG(0, "q", 3), *k = q ? ARG(1, "k", 3) : NULL, *v = k ? ARG(2, "v", 3) : NULL,
                   *cs = v ? ARG(3, "cos_sin", 3) : NULL, *pos = cs ? ARG(4, "positions", 1) : NULL,
                   *kp = pos ? ARG(5, "k_pool", 3) : NULL, *vp = kp ? ARG(6, "v_pool", 3) : NULL,
                   *sl = vp ? ARG(7, "slots", 1) : NULL, *out = sl ? RET(0, "out", 3) : NULL,
                   *ko = out ? RET(1, "k_pool", 3) : NULL, *vo = ko ? RET(2, "v_pool", 3) : NULL;
    if (!vo) return c->err;
    if (ko->data != kp->data || vo->data != vp->data)
        return fc_fail(c, XLA_FFI_Error_Code_FAILED_PRECONDITION, "k_pool and v_pool must alias the results");
    qk_rotary_kv_append_args a = {0};
    int64_t s[3];
    a.q = q->data, a.k = k->data, a.v = v->data, a.out = out->data, a.k_pool = kp->data, a.v_pool = vp->data;
    a.cos_sin = (const float *)cs->data, a.positions = pos->data, a.slots = sl->data;
    a.T = q->dims[0], a.Hq = q->dims[1], a.D = q->dims[2], a.Hkv = k->dims[1], a.max_pos = cs->dims[0], a.S = kp->dims[0];
    dense_strides(q, s);
    a.q_stride[0] = a.out_stride[0] = s[0], a.q_stride[1] = a.out_stride[1] = s[1];
    dense_strides(k, s);
    a.k_stride[0] = a.v_stride[0] = s[0], a.k_stride[1] = a.v_stride[1] = s[1];
    dense_strides(kp, s);
    a.kp_stride[0] = a.vp_stride[0] = s[0], a.kp_stride[1] = a.vp_stride[1] = s[1];
    a.cs_stride[0] = a.D, a.cs_stride[1] = 2;
    a.pos_stride = a.slot_stride = 1;
    a.interleaved = fc_attr(c, "interleaved", 1) != 0;
    a.dtype = dtype_of(q), a.pos_dtype = dtype_of(pos), a.slot_dtype = dtype_of(sl), a.num_threads = g_threads;
    int st = QK_OK;
    if (a.T > 0 && a.D > 0 && (a.Hq > 0 || a.Hkv > 0)) FC_RUN(st, c, rotary_kv_append, &a);
    if (st == QK_E_INDEX && a.bad_arg == 2)
        return fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "slots[%lld] = slots[%lld] = %lld: two tokens would "
                       "write one pool slot", (long long)a.bad_other, (long long)a.bad_pos, (long long)a.bad_value);
    if (st == QK_E_INDEX)
        return fc_fail(c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "%s[%lld] = %lld is out of range [0, %lld)",
                       a.bad_arg ? "slots" : "positions", (long long)a.bad_pos, (long long)a.bad_value,
                       (long long)(a.bad_arg ? a.S : a.max_pos));
    return fc_status(c, st);
}

/* ---- the entry points XLA calls, one pair per row of the op table -------------------------- */

/* XLA's metadata query (before the first call): the header's API version and the handler's traits. */
static XLA_FFI_Error *fc_metadata(XLA_FFI_CallFrame *cf, unsigned traits) {
    XLA_FFI_Metadata_Extension *ext = (XLA_FFI_Metadata_Extension *)cf->extension_start;
    XLA_FFI_Metadata *m = ext->metadata;
    if (ext->extension_base.struct_size < XLA_FFI_Metadata_Extension_STRUCT_SIZE ||
        m->struct_size < XLA_FFI_Metadata_STRUCT_SIZE) {
        XLA_FFI_Error_Create_Args a = {XLA_FFI_Error_Create_Args_STRUCT_SIZE, NULL,
                                       "qkernels: XLA's FFI metadata structs are older than version " FC_STR(
                                           XLA_FFI_API_MAJOR) "." FC_STR(XLA_FFI_API_MINOR) ", which qkernels needs",
                                       XLA_FFI_Error_Code_FAILED_PRECONDITION};
        return cf->api->XLA_FFI_Error_Create(&a);
    }
    m->api_version.struct_size = XLA_FFI_Api_Version_STRUCT_SIZE;
    m->api_version.extension_start = NULL;
    m->api_version.major_version = XLA_FFI_API_MAJOR;
    m->api_version.minor_version = XLA_FFI_API_MINOR;
    m->traits = traits;
    if (m->struct_size >= QK_FFI_SIZE_THROUGH(XLA_FFI_Metadata, state_type_id))
        m->state_type_id.type_id = 0; /* stateless (a field newer runtimes have) */
    return NULL;
}

static XLA_FFI_Error *fc_enter(XLA_FFI_CallFrame *cf, const char *op, int cuda, unsigned traits,
                               XLA_FFI_Error *(*body)(fc *)) {
    if (cf->extension_start && cf->extension_start->type == XLA_FFI_Extension_Metadata)
        return fc_metadata(cf, traits);
    if (cf->api->struct_size < QK_FFI_API_MIN_SIZE || cf->api->api_version.major_version != XLA_FFI_API_MAJOR) {
        XLA_FFI_Error_Create_Args a = {XLA_FFI_Error_Create_Args_STRUCT_SIZE, NULL,
                                       "qkernels: this jaxlib's XLA FFI API is older than version " FC_STR(
                                           XLA_FFI_API_MAJOR) "." FC_STR(XLA_FFI_API_MINOR) ", which qkernels needs",
                                       XLA_FFI_Error_Code_FAILED_PRECONDITION};
        return cf->api->XLA_FFI_Error_Create(&a);
    }
    fc c;
    fc_init(&c, cf, op, cuda);
    if (cf->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL; /* only the execute stage is registered */
    if (cuda) {
        if (!g_cuda)
            return fc_fail(&c, XLA_FFI_Error_Code_FAILED_PRECONDITION, "the CUDA kernels are not loaded");
        XLA_FFI_Stream_Get_Args sa = {XLA_FFI_Stream_Get_Args_STRUCT_SIZE, NULL, cf->ctx, NULL};
        XLA_FFI_Error *e = cf->api->XLA_FFI_Stream_Get(&sa);
        if (e) return e;
        c.stream = sa.stream;
        /* Attribute scratch: the last result is the launcher's scratch, uint8 [bytes].  The cpu
         * handler ignores one (a cpu launcher takes none). */
        if (fc_attr(&c, "scratch", 0) != 0) {
            XLA_FFI_Buffer *sb = fc_buf(&c, 1, cf->rets.size > 0 ? (int)cf->rets.size - 1 : 0, "scratch", 1, 1);
            if (!sb) return c.err;
            if (sb->dtype != XLA_FFI_DataType_U8)
                return fc_fail(&c, XLA_FFI_Error_Code_INVALID_ARGUMENT, "scratch must be uint8 [bytes]");
            fc_set_base(&c, sb->data, sb->dims[0] > 0 ? (size_t)sb->dims[0] : 0);
        }
    }
    return body(&c);
}

/* The dry run's callback: the handler's body on the capturing stream. */
typedef struct {
    fc *c;
    XLA_FFI_Error *(*body)(fc *);
    size_t cap; /* the blocks' capacity this attempt (the dry run's scratch is FC_ALIGN - 1 bytes more) */
    XLA_FFI_Error *result;
} fc_dry;

static int fc_dry_body(void *ctx, void *stream, void *scratch) {
    fc_dry *d = (fc_dry *)ctx;
    fc *c = d->c;
    c->stream = stream, c->err = NULL;
    fc_set_base(c, scratch, d->cap + FC_ALIGN - 1);
    c->cap = d->cap; /* the attempt's capacity exactly, whatever the alignment left over */
    c->top = c->peak = c->refused = c->offset = 0, c->nblocks = 0, c->too_many = 0, c->hooked = 0;
    d->result = d->body(c);
    return 0;
}

#define QK_FFI_DEFINE(op, launcher, family, deciding)                                                       \
    static XLA_FFI_Error *qk_ffi_##op##_cpu(XLA_FFI_CallFrame *cf) {                                       \
        return fc_enter(cf, #op, 0, 0, ffi_##op);                                                          \
    }                                                                                                      \
    static XLA_FFI_Error *qk_ffi_##op##_cuda(XLA_FFI_CallFrame *cf) {                                      \
        return fc_enter(cf, #op, 1, cb_##op, ffi_##op);                                                    \
    }
QK_OPS(QK_FFI_DEFINE)
#undef QK_FFI_DEFINE

/* _jax_handlers(cuda) -> {op: (cpu capsule, cuda capsule or None, command-buffer compatible)} */
PyObject *qk_jax_handlers(PyObject *module, PyObject *cuda_obj) {
    qk_state *st = qk_get_state(module);
    const int want_cuda = PyObject_IsTrue(cuda_obj);
    if (want_cuda < 0) return NULL;
    g_threads = st->num_threads;
    if (want_cuda && !(g_cuda = qk_cuda(st, "qkernels.jax"))) return NULL;
    PyObject *d = PyDict_New();
    if (!d) return NULL;
#define QK_FFI_ENTRY(op, launcher, family, deciding)                                                           \
    {                                                                                                          \
        PyObject *cpu = PyCapsule_New((void *)(uintptr_t)qk_ffi_##op##_cpu, NULL, NULL);                        \
        PyObject *gpu = want_cuda ? PyCapsule_New((void *)(uintptr_t)qk_ffi_##op##_cuda, NULL, NULL)             \
                                  : Py_NewRef(Py_None);                                                         \
        PyObject *t = cpu && gpu ? Py_BuildValue("(OOO)", cpu, gpu, cb_##op ? Py_True : Py_False) : NULL;       \
        Py_XDECREF(cpu);                                                                                       \
        Py_XDECREF(gpu);                                                                                       \
        if (!t || PyDict_SetItemString(d, #op, t) < 0) {                                                       \
            Py_XDECREF(t);                                                                                     \
            Py_DECREF(d);                                                                                      \
            return NULL;                                                                                       \
        }                                                                                                      \
        Py_DECREF(t);                                                                                          \
    }
    QK_OPS(QK_FFI_ENTRY)
#undef QK_FFI_ENTRY
    return d;
}

/* ---- trace-time scratch sizing ------------------------------------------------------------- */

#define FC_MAX_OPERANDS 24 /* message_passing takes the most, 18 */
#define FC_MAX_RESULTS 8
#define FC_MAX_ATTRS 16
#define FC_MAX_RANK 8

static const struct {
    const char *name;
    XLA_FFI_DataType type;
} fc_dtypes[] = {{"float32", XLA_FFI_DataType_F32}, {"float16", XLA_FFI_DataType_F16},
                 {"bfloat16", XLA_FFI_DataType_BF16}, {"float64", XLA_FFI_DataType_F64},
                 {"int32", XLA_FFI_DataType_S32},    {"int64", XLA_FFI_DataType_S64},
                 {"bool", XLA_FFI_DataType_PRED},    {"uint8", XLA_FFI_DataType_U8},
                 {"int8", XLA_FFI_DataType_S8},      {"uint32", XLA_FFI_DataType_U32},
                 {"uint64", XLA_FFI_DataType_U64}};

/* (dtype name, shape) pairs into buffers; -1 with an exception set. */
static int fc_parse_buffers(PyObject *seq, const char *what, int max, XLA_FFI_Buffer *bufs,
                            int64_t (*dims)[FC_MAX_RANK], void **ptrs, int *n) {
    PyObject *fast = PySequence_Fast(seq, "_jax_scratch_bytes: operands and results must be sequences");
    if (!fast) return -1;
    const Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    if (count > max) {
        PyErr_Format(PyExc_ValueError, "_jax_scratch_bytes: more than %d %s", max, what);
        goto fail;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        const char *dt;
        PyObject *shape, *sf = NULL;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "sO", &dt, &shape)) goto fail;
        XLA_FFI_Buffer *b = &bufs[i];
        memset(b, 0, sizeof *b);
        b->struct_size = sizeof *b;
        b->dtype = XLA_FFI_DataType_INVALID;
        for (size_t k = 0; k < sizeof fc_dtypes / sizeof fc_dtypes[0]; k++)
            if (!strcmp(dt, fc_dtypes[k].name)) b->dtype = fc_dtypes[k].type;
        if (b->dtype == XLA_FFI_DataType_INVALID) {
            PyErr_Format(PyExc_TypeError, "_jax_scratch_bytes: %s %zd has dtype %s, which no handler takes", what,
                         i, dt);
            goto fail;
        }
        if (!(sf = PySequence_Fast(shape, "_jax_scratch_bytes: a shape must be a sequence"))) goto fail;
        const Py_ssize_t rank = PySequence_Fast_GET_SIZE(sf);
        if (rank > FC_MAX_RANK) {
            PyErr_Format(PyExc_ValueError, "_jax_scratch_bytes: %s %zd has more than %d dimensions", what, i,
                         FC_MAX_RANK);
            Py_DECREF(sf);
            goto fail;
        }
        for (Py_ssize_t d = 0; d < rank; d++) {
            const long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(sf, d));
            if (v == -1 && PyErr_Occurred()) {
                Py_DECREF(sf);
                goto fail;
            }
            if (v < 0) {
                PyErr_Format(PyExc_ValueError, "_jax_scratch_bytes: %s %zd has a negative dimension", what, i);
                Py_DECREF(sf);
                goto fail;
            }
            dims[i][d] = v;
        }
        Py_DECREF(sf);
        b->rank = rank, b->dims = dims[i], b->data = ptrs[i];
    }
    *n = (int)count;
    Py_DECREF(fast);
    return 0;
fail:
    Py_DECREF(fast);
    return -1;
}

/* _jax_scratch_bytes(op, device, operands, results, attrs, aliases) -> (requested, result_bytes): the
 * bytes of scratch op's CUDA handler asks for with these operands, results ((dtype name, shape) each),
 * attributes ({name: bool, int or float}) and input-output aliases ({operand: result}), found by running
 * the handler itself on stand-in buffers inside a dry run on CUDA device `device` (qk_cuda_api.dry_run:
 * captured, never executed), and the size of the uint8 result that holds them at any alignment (0 when
 * none is needed).  The handler's own args filling and the launcher's own sizing decide, so the two
 * cannot disagree; the launcher's cuBLASLt plan is the one the real call finds in its cache. */
PyObject *qk_jax_scratch_bytes(PyObject *module, PyObject *args) {
    (void)module;
    const char *op;
    int device;
    PyObject *ops, *res, *attrs, *aliases;
    if (!PyArg_ParseTuple(args, "siOOO!O!:_jax_scratch_bytes", &op, &device, &ops, &res, &PyDict_Type, &attrs,
                          &PyDict_Type, &aliases))
        return NULL;
    XLA_FFI_Error *(*body)(fc *) = NULL;
#define QK_FFI_BODY(name, launcher, family, deciding) \
    if (!body && !strcmp(op, #name)) body = ffi_##name;
    QK_OPS(QK_FFI_BODY)
#undef QK_FFI_BODY
    if (!body) return PyErr_Format(PyExc_ValueError, "_jax_scratch_bytes: unknown op %s", op);
    if (!g_cuda) {
        PyErr_SetString(PyExc_RuntimeError, "_jax_scratch_bytes: the CUDA handlers are not registered");
        return NULL;
    }

    /* The call frame's parts, on this call's stack (a few kilobytes): nothing shared between calls. */
    XLA_FFI_Buffer in[FC_MAX_OPERANDS], out[FC_MAX_RESULTS];
    int64_t in_dims[FC_MAX_OPERANDS][FC_MAX_RANK], out_dims[FC_MAX_RESULTS][FC_MAX_RANK];
    XLA_FFI_ArgType in_types[FC_MAX_OPERANDS];
    XLA_FFI_RetType out_types[FC_MAX_RESULTS];
    void *in_ptrs[FC_MAX_OPERANDS], *out_ptrs[FC_MAX_RESULTS], *in_bufs[FC_MAX_OPERANDS], *out_bufs[FC_MAX_RESULTS];
    XLA_FFI_ByteSpan names[FC_MAX_ATTRS], *name_ptrs[FC_MAX_ATTRS];
    XLA_FFI_Scalar scalars[FC_MAX_ATTRS];
    void *attr_ptrs[FC_MAX_ATTRS];
    XLA_FFI_AttrType attr_types[FC_MAX_ATTRS];
    union { uint8_t b; int64_t i; double f; } values[FC_MAX_ATTRS];

    for (int i = 0; i < FC_MAX_OPERANDS; i++) in_ptrs[i] = FC_FAKE_BUFFER(i), in_types[i] = XLA_FFI_ArgType_BUFFER;
    for (int i = 0; i < FC_MAX_RESULTS; i++)
        out_ptrs[i] = FC_FAKE_BUFFER(FC_MAX_OPERANDS + i), out_types[i] = XLA_FFI_RetType_BUFFER;
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(aliases, &pos, &k, &v)) {
        const long o = PyLong_AsLong(k), r = PyLong_AsLong(v);
        if ((o == -1 || r == -1) && PyErr_Occurred()) return NULL;
        if (o < 0 || o >= FC_MAX_OPERANDS || r < 0 || r >= FC_MAX_RESULTS)
            return PyErr_Format(PyExc_ValueError, "_jax_scratch_bytes: alias %ld -> %ld is out of range", o, r);
        out_ptrs[r] = in_ptrs[o];
    }
    int nin, nout;
    if (fc_parse_buffers(ops, "operands", FC_MAX_OPERANDS, in, in_dims, in_ptrs, &nin) < 0 ||
        fc_parse_buffers(res, "results", FC_MAX_RESULTS, out, out_dims, out_ptrs, &nout) < 0)
        return NULL;
    for (int i = 0; i < nin; i++) in_bufs[i] = &in[i];
    for (int i = 0; i < nout; i++) out_bufs[i] = &out[i];

    if (PyDict_Size(attrs) > FC_MAX_ATTRS)
        return PyErr_Format(PyExc_ValueError, "_jax_scratch_bytes: more than %d attributes", FC_MAX_ATTRS);
    int na = 0;
    pos = 0;
    while (PyDict_Next(attrs, &pos, &k, &v)) {
        Py_ssize_t len;
        const char *name = PyUnicode_Check(k) ? PyUnicode_AsUTF8AndSize(k, &len) : NULL;
        if (!name) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "_jax_scratch_bytes: attribute names are strings");
            return NULL;
        }
        names[na].ptr = name, names[na].len = (size_t)len, name_ptrs[na] = &names[na];
        if (PyBool_Check(v)) {
            values[na].b = v == Py_True, scalars[na].dtype = XLA_FFI_DataType_PRED;
        } else if (PyLong_Check(v)) {
            values[na].i = PyLong_AsLongLong(v), scalars[na].dtype = XLA_FFI_DataType_S64;
            if (values[na].i == -1 && PyErr_Occurred()) return NULL;
        } else if (PyFloat_Check(v)) {
            values[na].f = PyFloat_AsDouble(v), scalars[na].dtype = XLA_FFI_DataType_F64;
        } else {
            return PyErr_Format(PyExc_TypeError, "_jax_scratch_bytes: attribute %s must be a bool, int or float", name);
        }
        scalars[na].value = &values[na];
        attr_ptrs[na] = &scalars[na], attr_types[na] = XLA_FFI_AttrType_SCALAR;
        na++;
    }

    XLA_FFI_CallFrame cf;
    memset(&cf, 0, sizeof cf);
    cf.struct_size = sizeof cf;
    cf.stage = XLA_FFI_ExecutionStage_EXECUTE;
    cf.args.struct_size = sizeof cf.args, cf.args.size = nin, cf.args.types = in_types, cf.args.args = in_bufs;
    cf.rets.struct_size = sizeof cf.rets, cf.rets.size = nout, cf.rets.types = out_types, cf.rets.rets = out_bufs;
    cf.attrs.struct_size = sizeof cf.attrs, cf.attrs.size = na, cf.attrs.types = attr_types;
    cf.attrs.names = name_ptrs, cf.attrs.attrs = attr_ptrs;

    fc c;
    fc_init(&c, &cf, op, 1);
    c.sizing = 1, c.scratch.dry_run = 1;
    /* Real scratch, since CUB's sorts memset theirs: a guess, grown past each refused request and run
     * again (the requests do not depend on the capacity until one is refused). */
    fc_dry d = {&c, body, 0, NULL};
    size_t cap = (size_t)1 << 20;
    for (int attempt = 0;; attempt++) {
        d.cap = cap, c.refused = 0, d.result = NULL;
        const int st = g_cuda->dry_run(device, cap + FC_ALIGN - 1, fc_dry_body, &d);
        if (c.refused && !c.too_many && attempt < 48) { /* even where the launcher went on without it */
            const size_t need = c.offset + c.refused;
            if (need < c.offset || need > (size_t)1 << 46)
                return PyErr_Format(PyExc_MemoryError, "%s: the launcher asked for %zu bytes of scratch", op, c.refused);
            cap = need > 2 * cap ? need : 2 * cap;
            continue;
        }
        if (d.result)
            return PyErr_Format(PyExc_RuntimeError, "%s (in the trace-time dry run that sizes its scratch)", c.msg);
        if (st)
            return PyErr_Format(PyExc_RuntimeError, "%s: CUDA error %d (%s) in the trace-time dry run that sizes "
                                "its scratch", op, st, g_cuda->error_string(st));
        break;
    }
    if (c.nblocks)
        return PyErr_Format(PyExc_RuntimeError, "%s: the launcher kept %d scratch blocks past its return", op,
                            c.nblocks);
    const unsigned long long peak = c.peak;
    return Py_BuildValue("(KK)", peak, peak ? peak + FC_ALIGN - 1 : 0ull);
}
