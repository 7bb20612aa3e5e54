/* graph_norm_bce(logits, target, edge_graph, num_graphs, *, pos_weight=None, stream=None) -> 0-d float32 */
#include "../qk.h"
#include "../cpu/cpu.h"

#include <math.h>

#define OP "graph_norm_bce"

QK_DOCS(graph_norm_bce, "logits, target, edge_graph, num_graphs, *, pos_weight=None",
    "Graph-normalised binary cross-entropy with logits, as a 0-d float32 tensor: the mean over\n"
    "g < num_graphs of (sum of bce(e) over edges with edge_graph[e] == g) / max(count_g, 1), where\n"
    "bce = max(l, 0) - l*t + log1p(exp(-|l|)), times 1 + (pos_weight - 1)*t when pos_weight is given.\n"
    "Graphs without edges contribute 0 but count.  Sorted edge_graph (PyG batches) is the fast path;\n"
    "unsorted is right too.  Deterministic: the same inputs give the same bits.\n" QK_GRAPH_DOC)

PyObject *qk_op_graph_norm_bce(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"logits", "target", "edge_graph", "num_graphs", "pos_weight", "stream", NULL};
    static const char *const in_names[] = {"logits", "target", "edge_graph"};
    qk_state *st = qk_get_state(module);
    PyObject *a[6] = {NULL};
    if (qk_parse_args(OP, args, nargs, kwnames, names, 4, 4, a) < 0) return NULL;
    void *stream;
    int stream_given;
    if (qk_stream_arg(OP, a[5], &stream, &stream_given) < 0) return NULL;
    if (!PyLong_Check(a[3])) {
        PyErr_Format(PyExc_TypeError, OP ": num_graphs must be an int, got %.200s", Py_TYPE(a[3])->tp_name);
        return NULL;
    }
    int overflow = 0;
    const long long G = PyLong_AsLongLongAndOverflow(a[3], &overflow);
    if (G == -1 && PyErr_Occurred()) return NULL;
    if (overflow || G < 1) {
        PyErr_Format(PyExc_ValueError, OP ": num_graphs must be between 1 and 2^63 - 1, got %R", a[3]);
        return NULL;
    }
    if (G > INT64_MAX / 32) { /* the kernels keep a few words per graph */
        PyErr_Format(PyExc_MemoryError, OP ": num_graphs = %lld needs more than 2^63 bytes of scratch", G);
        return NULL;
    }
    double pos_weight = 1.0;
    const int has_pw = a[4] && a[4] != Py_None;
    if (has_pw) {
        pos_weight = PyFloat_AsDouble(a[4]);
        if (pos_weight == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, OP ": pos_weight must be a float or None, got %.200s",
                         Py_TYPE(a[4])->tp_name);
            return NULL;
        }
    }

    if (has_pw && !isfinite((float)pos_weight)) { /* the kernels weigh in float32 */
        PyErr_Format(PyExc_ValueError, OP ": pos_weight must be finite in float32, got %R", a[4]);
        return NULL;
    }
    qk_view in[3] = {{0}}, ov = {0};
    qk_output o = {0};
    qk_launch l = {0};
    int ok = 0, launched = 0, n_in = 0;
    for (; n_in < 3; n_in++)
        if (qk_import(st, a[n_in], OP, in_names[n_in], stream, &in[n_in]) < 0) goto done;
    if (qk_same_device(OP, in, in_names, 3) < 0) goto done;
    if (qk_check_ndim(OP, "logits", &in[0], 1, "[E]") < 0 || qk_check_ndim(OP, "target", &in[1], 1, "[E]") < 0 ||
        qk_check_ndim(OP, "edge_graph", &in[2], 1, "[E]") < 0 || qk_check_dtype_index(OP, "edge_graph", &in[2]) < 0)
        goto done;
    if (qk_check_dtype_float(OP, "logits", &in[0]) < 0 ||
        qk_check_same_dtype(OP, "target", &in[1], "logits'", &in[0]) < 0)
        goto done;
    const int64_t E = in[0].shape[0];
    char layout[64];
    snprintf(layout, sizeof layout, "[E] = [%lld]", (long long)E);
    if (qk_check_dim(OP, "target", &in[1], 0, E, layout) < 0 || qk_check_dim(OP, "edge_graph", &in[2], 0, E, layout) < 0)
        goto done;
    if (qk_launch_begin(st, OP, &in[0], stream, stream_given, &l) < 0) goto done;
    launched = 1;
    if (qk_output_prepare(st, OP, NULL, &in[0], QK_F32, 0, NULL, &l, &ov, &o) < 0) goto done;

    qk_graph_norm_bce_args gb = {0};
    gb.logits = in[0].data;
    gb.target = in[1].data;
    gb.edge_graph = in[2].data;
    gb.out = (float *)ov.data;
    gb.num_edges = E;
    gb.num_graphs = G;
    gb.logits_stride = in[0].strides[0];
    gb.target_stride = in[1].strides[0];
    gb.graph_stride = in[2].strides[0];
    gb.pos_weight = (float)pos_weight;
    gb.has_pos_weight = has_pw;
    gb.dtype = in[0].dtype;
    gb.index_dtype = in[2].dtype;
    gb.num_threads = st->num_threads;
    int status;
    status = QK_OK;
    if (l.device_type == kDLCUDA && st->check_indices) /* QKERNELS_CHECK=1 */
        status = l.cuda->index_check(gb.edge_graph, gb.index_dtype, E, gb.graph_stride, 0, G, &gb.bad_pos,
                                     &gb.bad_value, l.stream);
    if (status == QK_OK) QK_RUN(status, &l, graph_norm_bce, &gb);
    if (status == QK_E_INDEX)
        PyErr_Format(PyExc_ValueError, OP ": edge_graph[%lld] = %lld is out of range for num_graphs = %lld",
                     (long long)gb.bad_pos, (long long)gb.bad_value, G);
    else if (status)
        qk_raise_status(OP, status);
    else
        ok = 1;
done:
    return qk_op_finish(&l, launched, &o, &ov, ok, in, n_in);
}
