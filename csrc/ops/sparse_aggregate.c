/* sparse_aggregate(row_ptr, col_idx, edge_weight, node_feat, *, out=None, stream=None):
 * argument checks, then the CPU or CUDA launcher by device. */
#include "../qk.h"
#include "../cpu/cpu.h"

#include <stdlib.h>

#define OP "sparse_aggregate"

QK_DOCS(sparse_aggregate, "row_ptr, col_idx, edge_weight, node_feat, *, out=None",
    "Multi-head CSR SpMM (message aggregation of a GNN layer).\n\n"
    "row_ptr [N_dst+1] and col_idx [E] (int32 or int64, the same for both), edge_weight [E, H],\n"
    "node_feat [N_src, H, D] -> [N_dst, H, D] with out[i,h,:] = sum over e in [row_ptr[i], row_ptr[i+1])\n"
    "of edge_weight[e,h] * node_feat[col_idx[e],h,:]; rows without edges are 0.\n" QK_GRAPH_DOC)

enum { ROW_PTR, COL_IDX, EDGE_WEIGHT, NODE_FEAT, NUM_INPUTS };

static int sa_check(qk_view *in) {
    static const char *const where = "[N_dst + 1]";
    if (qk_check_ndim(OP, "row_ptr", &in[ROW_PTR], 1, where) < 0 ||
        qk_check_ndim(OP, "col_idx", &in[COL_IDX], 1, "[E]") < 0 ||
        qk_check_ndim(OP, "edge_weight", &in[EDGE_WEIGHT], 2, "[E, H]") < 0 ||
        qk_check_ndim(OP, "node_feat", &in[NODE_FEAT], 3, "[N_src, H, D]") < 0)
        return -1;
    if (qk_check_dtype_index(OP, "row_ptr", &in[ROW_PTR]) < 0 || qk_check_dtype_index(OP, "col_idx", &in[COL_IDX]) < 0)
        return -1;
    if (in[COL_IDX].dtype != in[ROW_PTR].dtype) {
        PyErr_Format(PyExc_TypeError, OP ": col_idx must have the same dtype as row_ptr (%s), got %s",
                     qk_dtype_name(in[ROW_PTR].dtype), qk_dtype_name(in[COL_IDX].dtype));
        return -1;
    }
    if (qk_check_dtype_float(OP, "node_feat", &in[NODE_FEAT]) < 0 ||
        qk_check_same_dtype(OP, "edge_weight", &in[EDGE_WEIGHT], "node_feat's", &in[NODE_FEAT]) < 0)
        return -1;
    if (in[ROW_PTR].shape[0] < 1) {
        PyErr_SetString(PyExc_ValueError, OP ": row_ptr must have shape [N_dst + 1] with at least one element, got [0]");
        return -1;
    }
    const int64_t E = in[COL_IDX].shape[0], H = in[NODE_FEAT].shape[1];
    char layout[96];
    snprintf(layout, sizeof layout, "[E, H] = [%lld, %lld]", (long long)E, (long long)H);
    if (qk_check_dim(OP, "edge_weight", &in[EDGE_WEIGHT], 0, E, layout) < 0 ||
        qk_check_dim(OP, "edge_weight", &in[EDGE_WEIGHT], 1, H, layout) < 0)
        return -1;
    return 0;
}

static int sa_raise_index(const qk_sparse_aggregate_args *a) {
    if (a->bad_arg == 0)
        PyErr_Format(PyExc_ValueError,
                     OP ": row_ptr must be non-decreasing with 0 <= row_ptr[i] <= E = %lld; row_ptr[%lld] = %lld",
                     (long long)a->num_edges, (long long)a->bad_pos, (long long)a->bad_value);
    else
        PyErr_Format(PyExc_ValueError, OP ": col_idx[%lld] = %lld is out of range for node_feat with N_src = %lld",
                     (long long)a->bad_pos, (long long)a->bad_value, (long long)a->num_src);
    return -1;
}

PyObject *qk_op_sparse_aggregate(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"row_ptr", "col_idx", "edge_weight", "node_feat", "out", "stream", NULL};
    static const char *const input_names[] = {"row_ptr", "col_idx", "edge_weight", "node_feat"};
    qk_state *st = qk_get_state(module);
    PyObject *a[6] = {NULL, NULL, NULL, NULL, NULL, NULL};
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
    if (qk_same_device(OP, order, order_names, NUM_INPUTS) < 0 || sa_check(in) < 0) goto done;
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
    if (status == QK_E_INDEX) sa_raise_index(&sa);
    else if (status) qk_raise_status(OP, status);
    else ok = 1;
done:
    return qk_op_finish(&l, launched, &o, &ov, ok, in, n_in);
}

