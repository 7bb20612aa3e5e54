/* sparse_aggregate(row_ptr, col_idx, edge_weight, node_feat, *, out=None, stream=None):
 * argument checks, then the CPU or CUDA launcher by device. */
#include "../qk.h"
#include "../cpu/cpu.h"

#include <stdlib.h>

#define OP "sparse_aggregate"

QK_DOCS(sparse_aggregate, "row_ptr, col_idx, edge_weight, node_feat, *, out=None, plan=None",
    "Multi-head CSR SpMM (message aggregation of a GNN layer).\n\n"
    "row_ptr [N_dst+1] and col_idx [E] (int32 or int64, the same for both), edge_weight [E, H],\n"
    "node_feat [N_src, H, D] -> [N_dst, H, D] with out[i,h,:] = sum over e in [row_ptr[i], row_ptr[i+1])\n"
    "of edge_weight[e,h] * node_feat[col_idx[e],h,:]; rows without edges are 0.  plan is ignored (the\n"
    "autograd layers take it here to hand it to sparse_aggregate_backward).\n" QK_GRAPH_DOC)

enum { ROW_PTR, COL_IDX, EDGE_WEIGHT, NODE_FEAT, NUM_INPUTS };

/* The forward's inputs, also checked by the backward (op names the caller). */
static int sa_check_op(const char *op, qk_view *in) {
    static const char *const where = "[N_dst + 1]";
    if (qk_check_ndim(op, "row_ptr", &in[ROW_PTR], 1, where) < 0 ||
        qk_check_ndim(op, "col_idx", &in[COL_IDX], 1, "[E]") < 0 ||
        qk_check_ndim(op, "edge_weight", &in[EDGE_WEIGHT], 2, "[E, H]") < 0 ||
        qk_check_ndim(op, "node_feat", &in[NODE_FEAT], 3, "[N_src, H, D]") < 0)
        return -1;
    if (qk_check_dtype_index(op, "row_ptr", &in[ROW_PTR]) < 0 || qk_check_dtype_index(op, "col_idx", &in[COL_IDX]) < 0)
        return -1;
    if (in[COL_IDX].dtype != in[ROW_PTR].dtype) {
        PyErr_Format(PyExc_TypeError, "%s: col_idx must have the same dtype as row_ptr (%s), got %s", op,
                     qk_dtype_name(in[ROW_PTR].dtype), qk_dtype_name(in[COL_IDX].dtype));
        return -1;
    }
    if (qk_check_dtype_float(op, "node_feat", &in[NODE_FEAT]) < 0 ||
        qk_check_same_dtype(op, "edge_weight", &in[EDGE_WEIGHT], "node_feat's", &in[NODE_FEAT]) < 0)
        return -1;
    if (in[ROW_PTR].shape[0] < 1) {
        PyErr_Format(PyExc_ValueError, "%s: row_ptr must have shape [N_dst + 1] with at least one element, got [0]", op);
        return -1;
    }
    const int64_t E = in[COL_IDX].shape[0], H = in[NODE_FEAT].shape[1];
    if (qk_check_dim(op, "edge_weight", &in[EDGE_WEIGHT], 0, E, "[E, H] = [%lld, %lld]", (long long)E, (long long)H) < 0 ||
        qk_check_dim(op, "edge_weight", &in[EDGE_WEIGHT], 1, H, "[E, H] = [%lld, %lld]", (long long)E, (long long)H) < 0)
        return -1;
    return 0;
}

static int sa_raise_index_op(const char *op, int bad_arg, int64_t bad_pos, int64_t bad_value, int64_t E, int64_t N_src) {
    if (bad_arg == 0)
        PyErr_Format(PyExc_ValueError,
                     "%s: row_ptr must be non-decreasing with 0 <= row_ptr[i] <= E = %lld; row_ptr[%lld] = %lld", op,
                     (long long)E, (long long)bad_pos, (long long)bad_value);
    else
        PyErr_Format(PyExc_ValueError, "%s: col_idx[%lld] = %lld is out of range for node_feat with N_src = %lld", op,
                     (long long)bad_pos, (long long)bad_value, (long long)N_src);
    return -1;
}

/* QKERNELS_CHECK=1 on cuda: the forward's validation of a CSR before an op that takes it unchecked;
 * its status, with the offending argument, position and value on QK_E_INDEX. */
static int sa_check_csr_cuda(const qk_launch *l, const void *row_ptr, const void *col_idx, int index_dtype,
                             int64_t rp_stride, int64_t ci_stride, int64_t N_dst, int64_t N_src, int64_t E,
                             int *bad_arg, int64_t *bad_pos, int64_t *bad_value) {
    qk_sparse_aggregate_args fa = {0};
    fa.row_ptr = row_ptr;
    fa.col_idx = col_idx;
    fa.num_dst = N_dst;
    fa.num_src = N_src;
    fa.num_edges = E;
    fa.row_ptr_stride = rp_stride;
    fa.col_idx_stride = ci_stride;
    fa.index_dtype = index_dtype;
    const int status = l->cuda->sparse_aggregate_check(&fa, l->stream);
    *bad_arg = fa.bad_arg;
    *bad_pos = fa.bad_pos;
    *bad_value = fa.bad_value;
    return status;
}

PyObject *qk_op_sparse_aggregate(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"row_ptr", "col_idx", "edge_weight", "node_feat", "out", "stream", "plan", NULL};
    static const char *const input_names[] = {"row_ptr", "col_idx", "edge_weight", "node_feat"};
    qk_state *st = qk_get_state(module);
    PyObject *a[7] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    if (qk_parse_args(OP, args, nargs, kwnames, names, 4, 4, a) < 0) return NULL;
    void *stream;
    int stream_given;
    if (qk_stream_arg(OP, a[5], &stream, &stream_given) < 0) return NULL;

    qk_view in[NUM_INPUTS] = {{0}}, ov = {0};
    qk_output o = {0};
    qk_launch l = {0};
    int ok = 0, launched = 0, n_in = 0;
    for (; n_in < NUM_INPUTS; n_in++)
        if (qk_import(st, a[n_in], OP, input_names[n_in], stream, &in[n_in]) < 0) goto done;
    /* node_feat sets the device so the message blames the odd one out against the features */
    qk_view order[NUM_INPUTS] = {in[NODE_FEAT], in[ROW_PTR], in[COL_IDX], in[EDGE_WEIGHT]};
    static const char *const order_names[] = {"node_feat", "row_ptr", "col_idx", "edge_weight"};
    if (qk_same_device(OP, order, order_names, NUM_INPUTS) < 0 || sa_check_op(OP, in) < 0) goto done;
    if (qk_launch_begin(st, OP, &in[NODE_FEAT], stream, stream_given, &l) < 0) goto done;
    launched = 1;
    const int64_t shape[3] = {in[ROW_PTR].shape[0] - 1, in[NODE_FEAT].shape[1], in[NODE_FEAT].shape[2]};
    if (qk_output_prepare(st, OP, a[4], &in[NODE_FEAT], in[NODE_FEAT].dtype, 3, shape, &l, &ov, &o) < 0 ||
        qk_out_overlap(OP, &ov, in, input_names, NUM_INPUTS, 0) < 0)
        goto done;

    qk_sparse_aggregate_args sa = {0};
    sa.row_ptr = in[ROW_PTR].data;
    sa.col_idx = in[COL_IDX].data;
    sa.edge_weight = in[EDGE_WEIGHT].data;
    sa.node_feat = in[NODE_FEAT].data;
    sa.out = ov.data;
    sa.num_dst = shape[0];
    sa.num_src = in[NODE_FEAT].shape[0];
    sa.num_edges = in[COL_IDX].shape[0];
    sa.num_heads = shape[1];
    sa.head_dim = shape[2];
    sa.row_ptr_stride = in[ROW_PTR].strides[0];
    sa.col_idx_stride = in[COL_IDX].strides[0];
    for (int i = 0; i < 2; i++) sa.ew_stride[i] = in[EDGE_WEIGHT].strides[i];
    for (int i = 0; i < 3; i++) sa.nf_stride[i] = in[NODE_FEAT].strides[i];
    for (int i = 0; i < 3; i++) sa.out_stride[i] = ov.strides[i];
    sa.index_dtype = in[ROW_PTR].dtype;
    sa.dtype = in[NODE_FEAT].dtype;
    sa.num_threads = st->num_threads;

    int status = QK_OK;
    if (l.device_type == kDLCUDA && st->check_indices) status = l.cuda->sparse_aggregate_check(&sa, l.stream);
    if (status == QK_OK) QK_RUN(status, &l, sparse_aggregate, &sa);
    if (status == QK_E_INDEX) sa_raise_index_op(OP, sa.bad_arg, sa.bad_pos, sa.bad_value, sa.num_edges, sa.num_src);
    else if (status) qk_raise_status(OP, status);
    else ok = 1;
done:
    return qk_op_finish(&l, launched, &o, &ov, ok, in, n_in);
}


/* sparse_aggregate_backward(grad_out, row_ptr, col_idx, edge_weight, node_feat, *, edge_weight_grad=True,
 * node_feat_grad=True, deterministic=True, stream=None) -> (grad_edge_weight or None, grad_node_feat or None) */
#undef OP
#define OP "sparse_aggregate_backward"

QK_DOCS(sparse_aggregate_backward,
    "grad_out, row_ptr, col_idx, edge_weight, node_feat, *, edge_weight_grad=True, node_feat_grad=True, "
    "deterministic=True, plan=None",
    "Gradients of sparse_aggregate: -> (grad_edge_weight [E, H], grad_node_feat [N_src, H, D]), None\n"
    "where edge_weight_grad / node_feat_grad is False.\n\n"
    "grad_out [N_dst, H, D]; the other arguments as sparse_aggregate's.  grad_edge_weight[e,h] =\n"
    "grad_out[i,h,:] . node_feat[col_idx[e],h,:] for the row i holding e (0 for edges outside\n"
    "[row_ptr[0], row_ptr[-1])); grad_node_feat[j,h,:] = sum over the edges e with col_idx[e] == j, in\n"
    "ascending e, of edge_weight[e,h] * grad_out[i,h,:].  Deterministic: the same inputs give the same\n"
    "bits.  deterministic=False lets cuda scatter a float32 grad_node_feat with atomic adds instead of\n"
    "grouping the edges by source (nondeterministic: the last bits may differ from call to call); cpu,\n"
    "float16 and bfloat16 ignore it.  plan: sparse_aggregate_plan(row_ptr, col_idx, N_src) for this graph;\n"
    "grad_node_feat then walks it instead of grouping the edges by source on every call (the same bits).\n"
    "A plan of another graph gives wrong gradients but never reads out of bounds.\n" QK_GRAPH_DOC)

PyObject *qk_op_sparse_aggregate_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                          PyObject *kwnames) {
    static const char *const names[] = {"grad_out", "row_ptr", "col_idx", "edge_weight", "node_feat",
                                        "edge_weight_grad", "node_feat_grad", "deterministic", "stream", "plan", NULL};
    static const char *const input_names[] = {"grad_out", "row_ptr", "col_idx", "edge_weight", "node_feat"};
    qk_state *st = qk_get_state(module);
    PyObject *a[10] = {NULL};
    if (qk_parse_args(OP, args, nargs, kwnames, names, 5, 5, a) < 0) return NULL;
    void *stream;
    int stream_given, want_ew, want_nf, deterministic;
    if (qk_stream_arg(OP, a[8], &stream, &stream_given) < 0 ||
        qk_bool_arg(OP, "edge_weight_grad", a[5], 1, &want_ew) < 0 ||
        qk_bool_arg(OP, "node_feat_grad", a[6], 1, &want_nf) < 0 ||
        qk_bool_arg(OP, "deterministic", a[7], 1, &deterministic) < 0)
        return NULL;

    enum { GRAD_OUT, NUM_VIEWS = 5 };
    qk_view v[NUM_VIEWS + 1] = {{0}}, ov[2] = {{0}}; /* + plan */
    qk_output o[2] = {{0}};
    qk_launch l = {0};
    int ok = 0, launched = 0, n_in = 0;
    for (; n_in < NUM_VIEWS; n_in++)
        if (qk_import(st, a[n_in], OP, input_names[n_in], stream, &v[n_in]) < 0) goto done;
    qk_view *in = v + 1; /* row_ptr, col_idx, edge_weight, node_feat: the forward's inputs */
    if (qk_same_device(OP, v, input_names, NUM_VIEWS) < 0 || sa_check_op(OP, in) < 0 ||
        qk_check_ndim(OP, "grad_out", &v[GRAD_OUT], 3, "[N_dst, H, D]") < 0 ||
        qk_check_same_dtype(OP, "grad_out", &v[GRAD_OUT], "node_feat's", &in[NODE_FEAT]) < 0)
        goto done;
    const int64_t N_dst = in[ROW_PTR].shape[0] - 1, H = in[NODE_FEAT].shape[1], D = in[NODE_FEAT].shape[2];
    for (int d = 0; d < 3; d++)
        if (qk_check_dim(OP, "grad_out", &v[GRAD_OUT], d, d == 0 ? N_dst : d == 1 ? H : D, "[N_dst, H, D] = [%lld, %lld, %lld]",
                         (long long)N_dst, (long long)H, (long long)D) < 0)
            goto done;
    const int64_t E = in[COL_IDX].shape[0], N_src = in[NODE_FEAT].shape[0];
    const int has_plan = qk_plan_arg(st, a[9], OP, stream, N_src + 1 + 3 * E, "N_src + 1 + 3E", &v[GRAD_OUT], &v[NUM_VIEWS]);
    if (has_plan < 0) goto done;
    n_in += has_plan;
    if (qk_launch_begin(st, OP, &v[GRAD_OUT], stream, stream_given, &l) < 0) goto done;
    launched = 1;
    const int64_t ew_shape[2] = {E, H}, nf_shape[3] = {N_src, H, D};
    const int dtype = in[NODE_FEAT].dtype;
    if ((want_ew && qk_output_prepare(st, OP, NULL, &v[GRAD_OUT], dtype, 2, ew_shape, &l, &ov[0], &o[0]) < 0) ||
        (want_nf && qk_output_prepare(st, OP, NULL, &v[GRAD_OUT], dtype, 3, nf_shape, &l, &ov[1], &o[1]) < 0))
        goto done;

    qk_sparse_aggregate_backward_args sb = {0};
    sb.grad_out = v[GRAD_OUT].data;
    sb.row_ptr = in[ROW_PTR].data;
    sb.col_idx = in[COL_IDX].data;
    sb.edge_weight = in[EDGE_WEIGHT].data;
    sb.node_feat = in[NODE_FEAT].data;
    sb.grad_edge_weight = want_ew ? ov[0].data : NULL;
    sb.grad_node_feat = want_nf ? ov[1].data : NULL;
    sb.num_dst = N_dst;
    sb.num_src = N_src;
    sb.num_edges = E;
    sb.num_heads = H;
    sb.head_dim = D;
    for (int i = 0; i < 3; i++) {
        sb.go_stride[i] = v[GRAD_OUT].strides[i];
        sb.nf_stride[i] = in[NODE_FEAT].strides[i];
    }
    sb.row_ptr_stride = in[ROW_PTR].strides[0];
    sb.col_idx_stride = in[COL_IDX].strides[0];
    for (int i = 0; i < 2; i++) sb.ew_stride[i] = in[EDGE_WEIGHT].strides[i];
    sb.index_dtype = in[ROW_PTR].dtype;
    sb.dtype = dtype;
    sb.num_threads = st->num_threads;
    sb.deterministic = deterministic;
    sb.plan = has_plan ? (const int32_t *)v[NUM_VIEWS].data : NULL;

    int status = QK_OK;
    if ((want_ew || want_nf) && l.device_type == kDLCUDA && st->check_indices)
        status = sa_check_csr_cuda(&l, sb.row_ptr, sb.col_idx, sb.index_dtype, sb.row_ptr_stride, sb.col_idx_stride,
                                   N_dst, N_src, E, &sb.bad_arg, &sb.bad_pos, &sb.bad_value);
    if (status == QK_OK && (want_ew || want_nf)) QK_RUN(status, &l, sparse_aggregate_backward, &sb);
    if (status == QK_E_INDEX) sa_raise_index_op(OP, sb.bad_arg, sb.bad_pos, sb.bad_value, E, N_src);
    else if (status) qk_raise_status(OP, status);
    else ok = 1;
done:
    return qk_op_finish_many(&l, launched, o, ov, 2, ok, v, n_in);
}


/* sparse_aggregate_plan(row_ptr, col_idx, num_src, *, stream=None) -> int32 [num_src + 1 + 3E] */
#undef OP
#define OP "sparse_aggregate_plan"

QK_DOCS(sparse_aggregate_plan, "row_ptr, col_idx, num_src",
    "The transposed graph sparse_aggregate_backward groups by source, built once for a graph that\n"
    "several backward calls share (pass it as their plan=).\n\n"
    "row_ptr [N_dst+1], col_idx [E] as sparse_aggregate's, num_src = N_src -> int32 [N_src + 1 + 3E]:\n"
    "ptr [N_src + 1] (source j's entries are ptr[j] .. ptr[j+1] - 1; ptr[N_src] counts the kept ones),\n"
    "then src [E], edge [E] and row [E] per entry: the edges sorted by source, ascending edge id within\n"
    "one, and the row holding each.  Edges outside [row_ptr[0], row_ptr[-1]) follow the kept ones in\n"
    "ascending id with src = N_src and row 0.  E, N_src and N_dst must be below 2^31.\n" QK_GRAPH_DOC)

PyObject *qk_op_sparse_aggregate_plan(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"row_ptr", "col_idx", "num_src", "stream", NULL};
    static const char *const in_names[] = {"row_ptr", "col_idx"};
    qk_state *st = qk_get_state(module);
    PyObject *a[4] = {NULL, NULL, NULL, NULL};
    if (qk_parse_args(OP, args, nargs, kwnames, names, 3, 3, a) < 0) return NULL;
    void *stream;
    int stream_given;
    if (qk_stream_arg(OP, a[3], &stream, &stream_given) < 0) return NULL;
    const long long N_src = qk_count_arg(OP, "num_src", a[2], INT32_MAX - 1);
    if (N_src < 0) return NULL;
    qk_view in[2] = {{0}}, ov = {0};
    qk_output o = {0};
    qk_launch l = {0};
    int ok = 0, launched = 0, n_in = 0;
    if (qk_import_all(st, OP, a, in_names, 2, stream, in, &n_in) < 0) goto done;
    if (qk_check_ndim(OP, "row_ptr", &in[0], 1, "[N_dst + 1]") < 0 || qk_check_ndim(OP, "col_idx", &in[1], 1, "[E]") < 0 ||
        qk_check_dtype_index(OP, "row_ptr", &in[0]) < 0 || qk_check_dtype_index(OP, "col_idx", &in[1]) < 0)
        goto done;
    if (in[1].dtype != in[0].dtype) {
        PyErr_Format(PyExc_TypeError, "%s: col_idx must have the same dtype as row_ptr (%s), got %s", OP,
                     qk_dtype_name(in[0].dtype), qk_dtype_name(in[1].dtype));
        goto done;
    }
    if (in[0].shape[0] < 1) {
        PyErr_Format(PyExc_ValueError, "%s: row_ptr must have shape [N_dst + 1] with at least one element, got [0]", OP);
        goto done;
    }
    const int64_t E = in[1].shape[0];
    if (E > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: the plan holds int32 edge ids: E = %lld must be below 2^31", OP, (long long)E);
        goto done;
    }
    /* checked before the CSR walk: a broadcast row_ptr can be any length */
    if (in[0].shape[0] - 1 > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: the plan holds int32 row ids: N_dst = %lld must be below 2^31", OP,
                     (long long)(in[0].shape[0] - 1));
        goto done;
    }
    if (qk_launch_begin(st, OP, &in[0], stream, stream_given, &l) < 0) goto done;
    launched = 1;
    const int64_t shape[1] = {N_src + 1 + 3 * E};
    if (qk_output_prepare(st, OP, NULL, &in[0], QK_I32, 1, shape, &l, &ov, &o) < 0) goto done;

    qk_sparse_aggregate_plan_args p = {0};
    p.row_ptr = in[0].data;
    p.col_idx = in[1].data;
    p.plan = (int32_t *)ov.data;
    p.num_dst = in[0].shape[0] - 1;
    p.num_src = N_src;
    p.num_edges = E;
    p.row_ptr_stride = in[0].strides[0];
    p.col_idx_stride = in[1].strides[0];
    p.index_dtype = in[0].dtype;
    p.num_threads = st->num_threads;

    int status = QK_OK;
    if (l.device_type == kDLCUDA && st->check_indices)
        status = sa_check_csr_cuda(&l, p.row_ptr, p.col_idx, p.index_dtype, p.row_ptr_stride, p.col_idx_stride,
                                   p.num_dst, N_src, E, &p.bad_arg, &p.bad_pos, &p.bad_value);
    if (status == QK_OK) QK_RUN(status, &l, sparse_aggregate_plan, &p);
    if (status == QK_E_INDEX) sa_raise_index_op(OP, p.bad_arg, p.bad_pos, p.bad_value, E, N_src);
    else if (status) qk_raise_status(OP, status);
    else ok = 1;
done:
    return qk_op_finish(&l, launched, &o, &ov, ok, in, n_in);
}
