/* fused_edge_features(x, edge_index, edge_attr=None, *, out=None, stream=None) */
#include "../qk.h"
#include "../cpu/cpu.h"

#define OP "fused_edge_features"

QK_DOCS(fused_edge_features, "x, edge_index, edge_attr=None, *, out=None",
    "Edge features of a message-passing layer in one pass.\n\n"
    "x [N, H], edge_index [2, E] (row 0 src, row 1 dst; int32 or int64), edge_attr [E, H] ->\n"
    "[E, 3H] = cat(x[src] + x[dst], |x[src] - x[dst]|, edge_attr), or [E, 2H] without edge_attr.\n"
    QK_GRAPH_DOC)

PyObject *qk_op_fused_edge_features(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"x", "edge_index", "edge_attr", "out", "stream", NULL};
    qk_state *st = qk_get_state(module);
    PyObject *a[5] = {NULL, NULL, NULL, NULL, NULL};
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
    for (; n_in < 2 + has_attr; n_in++)
        if (qk_import(st, a[n_in], OP, in_names[n_in], stream, &in[n_in]) < 0) goto done;
    if (qk_same_device(OP, in, in_names, n_in) < 0) goto done;
    if (qk_check_ndim(OP, "x", &in[0], 2, "[N, H]") < 0 || qk_check_ndim(OP, "edge_index", &in[1], 2, "[2, E]") < 0 ||
        (has_attr && qk_check_ndim(OP, "edge_attr", &in[2], 2, "[E, H]") < 0) ||
        qk_check_dtype_index(OP, "edge_index", &in[1]) < 0 || qk_check_dtype_float(OP, "x", &in[0]) < 0 ||
        qk_check_dim(OP, "edge_index", &in[1], 0, 2, "[2, E]") < 0)
        goto done;
    const int64_t E = in[1].shape[1], H = in[0].shape[1];
    if (has_attr) {
        char layout[96];
        snprintf(layout, sizeof layout, "[E, H] = [%lld, %lld]", (long long)E, (long long)H);
        if (qk_check_dim(OP, "edge_attr", &in[2], 0, E, layout) < 0 ||
            qk_check_dim(OP, "edge_attr", &in[2], 1, H, layout) < 0 ||
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
    int status = QK_OK;
    if (l.device_type == kDLCUDA && st->check_indices) /* QKERNELS_CHECK=1: both rows, before the kernel */
        for (int row = 0; row < 2 && status == QK_OK; row++) {
            status = l.cuda->index_check((const char *)ef.edge_index + row * ef.ei_stride[0] * qk_dtype_size(ef.index_dtype),
                                         ef.index_dtype, E, ef.ei_stride[1], 0, ef.num_nodes, &ef.bad_pos, &ef.bad_value,
                                         l.stream);
            ef.bad_row = row;
        }
    /* the CPU launcher validates edge_index even when there are no features to write */
    if (status == QK_OK && E > 0 && (H > 0 || l.device_type != kDLCUDA)) QK_RUN(status, &l, fused_edge_features, &ef);
    if (status == QK_E_INDEX)
        PyErr_Format(PyExc_ValueError, OP ": edge_index[%d, %lld] = %lld is out of range for x with N = %lld",
                     ef.bad_row, (long long)ef.bad_pos, (long long)ef.bad_value, (long long)ef.num_nodes);
    else if (status)
        qk_raise_status(OP, status);
    else
        ok = 1;
done:
    return qk_op_finish(&l, launched, &o, &ov, ok, in, n_in);
}
