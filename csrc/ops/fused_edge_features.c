/* fused_edge_features(x, edge_index, edge_attr=None, *, out=None, stream=None) */
#include "../qk.h"
#include "../cpu/cpu.h"

/* The launch of both ops: QKERNELS_CHECK's validation of edge_index's two rows against [0, N) on cuda,
 * the launcher `name` when run, then ok = 1 or the exception (a bad index named by row and position). */
#define FE_RUN(ok, st, l, name, args, op, run)                                                                   \
    do {                                                                                                       \
        int status_ = QK_OK;                                                                                   \
        const size_t row_bytes_ = (size_t)(args)->ei_stride[0] * qk_dtype_size((args)->index_dtype);            \
        if ((l)->device_type == kDLCUDA && (st)->check_indices) /* QKERNELS_CHECK=1 */                         \
            for (int row_ = 0; row_ < 2 && status_ == QK_OK; row_++) {                                         \
                status_ = qk_index_check(st, l, (const char *)(args)->edge_index + row_ * row_bytes_,          \
                                         (args)->index_dtype, (args)->num_edges, (args)->ei_stride[1],         \
                                         (args)->num_nodes, &(args)->bad_pos, &(args)->bad_value);            \
                (args)->bad_row = row_;                                                                        \
            }                                                                                                  \
        if (status_ == QK_OK && (run)) QK_RUN(status_, l, name, args);                                         \
        if (status_ == QK_E_INDEX)                                                                             \
            PyErr_Format(PyExc_ValueError, "%s: edge_index[%d, %lld] = %lld is out of range for x with N = %lld", \
                         op, (args)->bad_row, (long long)(args)->bad_pos, (long long)(args)->bad_value,         \
                         (long long)(args)->num_nodes);                                                        \
        else                                                                                                   \
            (ok) = qk_raise_status(op, status_) == 0;                                                          \
    } while (0)

#define OP "fused_edge_features"

QK_DOCS(fused_edge_features, "x, edge_index, edge_attr=None, *, out=None, plan=None",
    "Edge features of a message-passing layer in one pass.\n\n"
    "x [N, H], edge_index [2, E] (row 0 src, row 1 dst; int32 or int64), edge_attr [E, H] ->\n"
    "[E, 3H] = cat(x[src] + x[dst], |x[src] - x[dst]|, edge_attr), or [E, 2H] without edge_attr.  plan\n"
    "is ignored (the autograd layers take it here to hand it to fused_edge_features_backward).\n"
    QK_GRAPH_DOC)

PyObject *qk_op_fused_edge_features(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"x", "edge_index", "edge_attr", "out", "stream", "plan", NULL};
    qk_state *st = qk_get_state(module);
    PyObject *a[6] = {NULL, NULL, NULL, NULL, NULL, NULL};
    if (qk_parse_args(OP, args, nargs, kwnames, names, 3, 2, a) < 0) return NULL;
    void *stream;
    int stream_given;
    if (qk_stream_arg(OP, a[4], &stream, &stream_given) < 0) return NULL;
    const int has_attr = a[2] && a[2] != Py_None;
    static const char *const in_names[] = {"x", "edge_index", "edge_attr"};
    qk_view in[3] = {{0}}, ov = {0};
    qk_output o = {0};
    qk_launch l = {0};
    int ok = 0, launched = 0, n_in = 0;
    if (qk_import_all(st, OP, a, in_names, 2 + has_attr, stream, in, &n_in) < 0) goto done;
    if (qk_check_ndim(OP, "x", &in[0], 2, "[N, H]") < 0 || qk_check_ndim(OP, "edge_index", &in[1], 2, "[2, E]") < 0 ||
        (has_attr && qk_check_ndim(OP, "edge_attr", &in[2], 2, "[E, H]") < 0) ||
        qk_check_dtype_index(OP, "edge_index", &in[1]) < 0 || qk_check_dtype_float(OP, "x", &in[0]) < 0 ||
        qk_check_dim(OP, "edge_index", &in[1], 0, 2, "[2, E]") < 0)
        goto done;
    const int64_t E = in[1].shape[1], H = in[0].shape[1];
    if (has_attr) {
        if (qk_check_dim(OP, "edge_attr", &in[2], 0, E, "[E, H] = [%lld, %lld]", (long long)E, (long long)H) < 0 ||
            qk_check_dim(OP, "edge_attr", &in[2], 1, H, "[E, H] = [%lld, %lld]", (long long)E, (long long)H) < 0 ||
            qk_check_same_dtype(OP, "edge_attr", &in[2], "x's", &in[0]) < 0)
            goto done;
    }
    if (qk_launch_begin(st, OP, &in[0], stream, stream_given, &l) < 0) goto done;
    launched = 1;
    const int64_t shape[2] = {E, (2 + has_attr) * H};
    if (qk_output_prepare(st, OP, a[3], &in[0], in[0].dtype, 2, shape, &l, &ov, &o) < 0 ||
        qk_out_overlap(OP, &ov, in, in_names, n_in, 0) < 0)
        goto done;

    qk_fused_edge_features_args ef = {0};
    ef.x = in[0].data;
    ef.edge_index = in[1].data;
    ef.edge_attr = has_attr ? in[2].data : NULL;
    ef.out = ov.data;
    ef.num_nodes = in[0].shape[0];
    ef.num_edges = E;
    ef.H = H;
    for (int i = 0; i < 2; i++) {
        ef.x_stride[i] = in[0].strides[i];
        ef.ei_stride[i] = in[1].strides[i];
        ef.ea_stride[i] = has_attr ? in[2].strides[i] : 0;
        ef.out_stride[i] = ov.strides[i];
    }
    ef.index_dtype = in[1].dtype;
    ef.dtype = in[0].dtype;
    ef.num_threads = st->num_threads;
    /* the CPU launcher validates edge_index even when there are no features to write */
    FE_RUN(ok, st, &l, fused_edge_features, &ef, OP, E > 0 && (H > 0 || l.device_type != kDLCUDA));
done:
    return qk_op_finish(&l, launched, &o, &ov, ok, in, n_in);
}

/* fused_edge_features_backward(grad_out, x, edge_index, *, stream=None) -> (grad_x, grad_edge_attr or None) */
#undef OP
#define OP "fused_edge_features_backward"

QK_DOCS(fused_edge_features_backward, "grad_out, x, edge_index, *, plan=None",
    "Gradients of fused_edge_features: -> (grad_x [N, H], grad_edge_attr [E, H] or None).\n\n"
    "grad_out [E, 3H] (the forward had edge_attr; grad_edge_attr is then a copy of grad_out[:, 2H:]) or\n"
    "[E, 2H] (grad_edge_attr None); H = x.shape[1].  With g_sum = grad_out[e, :H], g_abs = grad_out[e, H:2H]\n"
    "and s = sign(x[src] - x[dst]) (0 at a tie or NaN: torch.abs's subgradient), grad_x[n] sums\n"
    "g_sum + s * g_abs over the edges with src == n and g_sum - s * g_abs over those with dst == n, in\n"
    "edge order (src side first on a self-loop).  Deterministic: the same inputs give the same bits.\n"
    "plan: fused_edge_features_plan(edge_index, N) for this graph; grad_x then walks it instead of\n"
    "grouping the incidences by node on every call (the same bits).  A plan of another graph gives\n"
    "wrong gradients but never reads out of bounds.\n"
    QK_GRAPH_DOC)

PyObject *qk_op_fused_edge_features_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                             PyObject *kwnames) {
    static const char *const names[] = {"grad_out", "x", "edge_index", "stream", "plan", NULL};
    static const char *const in_names[] = {"grad_out", "x", "edge_index"};
    qk_state *st = qk_get_state(module);
    PyObject *a[5] = {NULL, NULL, NULL, NULL, NULL};
    if (qk_parse_args(OP, args, nargs, kwnames, names, 3, 3, a) < 0) return NULL;
    void *stream;
    int stream_given;
    if (qk_stream_arg(OP, a[3], &stream, &stream_given) < 0) return NULL;
    qk_view in[4] = {{0}}, ov[2] = {{0}}; /* + plan */
    qk_output o[2] = {{0}};
    qk_launch l = {0};
    int ok = 0, launched = 0, n_in = 0;
    if (qk_import_all(st, OP, a, in_names, 3, stream, in, &n_in) < 0) goto done;
    if (qk_check_ndim(OP, "grad_out", &in[0], 2, "[E, 3H] or [E, 2H]") < 0 ||
        qk_check_ndim(OP, "x", &in[1], 2, "[N, H]") < 0 || qk_check_ndim(OP, "edge_index", &in[2], 2, "[2, E]") < 0 ||
        qk_check_dtype_index(OP, "edge_index", &in[2]) < 0 || qk_check_dtype_float(OP, "x", &in[1]) < 0 ||
        qk_check_same_dtype(OP, "grad_out", &in[0], "x's", &in[1]) < 0 ||
        qk_check_dim(OP, "edge_index", &in[2], 0, 2, "[2, E]") < 0)
        goto done;
    const int64_t E = in[2].shape[1], H = in[1].shape[1], N = in[1].shape[0];
    const int64_t cols = in[0].shape[1];
    if (in[0].shape[0] != E || (cols != 3 * H && cols != 2 * H)) {
        PyErr_Format(PyExc_ValueError, OP ": grad_out must have shape [E, 3H] = [%lld, %lld] or [E, 2H] = [%lld, %lld], got [%lld, %lld]",
                     (long long)E, (long long)(3 * H), (long long)E, (long long)(2 * H), (long long)in[0].shape[0],
                     (long long)cols);
        goto done;
    }
    const int has_attr = H > 0 ? cols == 3 * H : 0;
    const int has_plan = qk_plan_arg(st, a[4], OP, stream, N + 1 + 4 * E, "N + 1 + 4E", &in[0], &in[3]);
    if (has_plan < 0) goto done;
    n_in += has_plan;
    if (qk_launch_begin(st, OP, &in[0], stream, stream_given, &l) < 0) goto done;
    launched = 1;
    const int64_t x_shape[2] = {N, H}, ea_shape[2] = {E, H};
    if (qk_output_prepare(st, OP, NULL, &in[0], in[1].dtype, 2, x_shape, &l, &ov[0], &o[0]) < 0 ||
        (has_attr && qk_output_prepare(st, OP, NULL, &in[0], in[1].dtype, 2, ea_shape, &l, &ov[1], &o[1]) < 0))
        goto done;

    qk_fused_edge_features_backward_args eb = {0};
    eb.grad_out = in[0].data;
    eb.x = in[1].data;
    eb.edge_index = in[2].data;
    eb.grad_x = ov[0].data;
    eb.grad_edge_attr = has_attr ? ov[1].data : NULL;
    eb.num_nodes = N;
    eb.num_edges = E;
    eb.H = H;
    for (int i = 0; i < 2; i++) {
        eb.go_stride[i] = in[0].strides[i];
        eb.x_stride[i] = in[1].strides[i];
        eb.ei_stride[i] = in[2].strides[i];
    }
    eb.index_dtype = in[2].dtype;
    eb.dtype = in[1].dtype;
    eb.num_threads = st->num_threads;
    eb.plan = has_plan ? (const int32_t *)in[3].data : NULL;
    FE_RUN(ok, st, &l, fused_edge_features_backward, &eb, OP, 1);
done:
    return qk_op_finish_many(&l, launched, o, ov, 2, ok, in, n_in);
}


/* fused_edge_features_plan(edge_index, num_nodes, *, stream=None) -> int32 [num_nodes + 1 + 4E] */
#undef OP
#define OP "fused_edge_features_plan"

QK_DOCS(fused_edge_features_plan, "edge_index, num_nodes",
    "The incidences fused_edge_features_backward groups by node, built once for a graph that several\n"
    "backward calls share (pass it as their plan=).\n\n"
    "edge_index [2, E] (int32 or int64), num_nodes = N -> int32 [N + 1 + 4E]: ptr [N + 1] (node n's\n"
    "entries are ptr[n] .. ptr[n+1] - 1), then node [2E] and item [2E] per entry: the incidences\n"
    "(item 2e + side, side 0 at src, 1 at dst) sorted by node, ascending item within one.  2E and N\n"
    "must be below 2^31.\n" QK_GRAPH_DOC)

PyObject *qk_op_fused_edge_features_plan(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"edge_index", "num_nodes", "stream", NULL};
    static const char *const in_names[] = {"edge_index"};
    qk_state *st = qk_get_state(module);
    PyObject *a[3] = {NULL, NULL, NULL};
    if (qk_parse_args(OP, args, nargs, kwnames, names, 2, 2, a) < 0) return NULL;
    void *stream;
    int stream_given;
    if (qk_stream_arg(OP, a[2], &stream, &stream_given) < 0) return NULL;
    const long long N = qk_count_arg(OP, "num_nodes", a[1], INT32_MAX - 1);
    if (N < 0) return NULL;
    qk_view in[1] = {{0}}, ov = {0};
    qk_output o = {0};
    qk_launch l = {0};
    int ok = 0, launched = 0, n_in = 0;
    if (qk_import_all(st, OP, a, in_names, 1, stream, in, &n_in) < 0) goto done;
    if (qk_check_ndim(OP, "edge_index", &in[0], 2, "[2, E]") < 0 || qk_check_dtype_index(OP, "edge_index", &in[0]) < 0 ||
        qk_check_dim(OP, "edge_index", &in[0], 0, 2, "[2, E]") < 0)
        goto done;
    const int64_t E = in[0].shape[1];
    if (E > INT32_MAX / 2) {
        PyErr_Format(PyExc_ValueError, "%s: the plan holds int32 incidence ids: 2E = %lld must be below 2^31", OP,
                     (long long)(2 * E));
        goto done;
    }
    if (qk_launch_begin(st, OP, &in[0], stream, stream_given, &l) < 0) goto done;
    launched = 1;
    const int64_t shape[1] = {N + 1 + 4 * E};
    if (qk_output_prepare(st, OP, NULL, &in[0], QK_I32, 1, shape, &l, &ov, &o) < 0) goto done;

    qk_fused_edge_features_plan_args p = {0};
    p.edge_index = in[0].data;
    p.plan = (int32_t *)ov.data;
    p.num_nodes = N;
    p.num_edges = E;
    for (int i = 0; i < 2; i++) p.ei_stride[i] = in[0].strides[i];
    p.index_dtype = in[0].dtype;
    p.num_threads = st->num_threads;
    FE_RUN(ok, st, &l, fused_edge_features_plan, &p, OP, 1);
done:
    return qk_op_finish(&l, launched, &o, &ov, ok, in, n_in);
}
