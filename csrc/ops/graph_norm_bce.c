/* graph_norm_bce(logits, target, edge_graph, num_graphs, *, pos_weight=None, stream=None) -> 0-d float32
 * The raw forward also takes the private keyword _variant= ("auto", "launches": qk_graph_norm_bce_args.variant). */
#include "../qk.h"
#include "../cpu/cpu.h"

#include <math.h>

#define OP "graph_norm_bce"

QK_DOCS(graph_norm_bce, "logits, target, edge_graph, num_graphs, *, pos_weight=None",
    "Graph-normalised binary cross-entropy with logits, as a 0-d float32 tensor: the mean over\n"
    "g < num_graphs of (sum of bce(e) over edges with edge_graph[e] == g) / max(count_g, 1), where\n"
    "bce = max(l, 0) - l*t + log1p(exp(-|l|)), times 1 + (pos_weight_e - 1)*t when pos_weight is given:\n"
    "a float, or a tensor on logits' device, [E] (one weight per edge) or of one element (shape [] or\n"
    "[1]), float32 or logits' dtype, read by the kernel (no host sync).  Graphs without edges\n"
    "contribute 0 but count.  Sorted edge_graph (PyG batches) is the fast path; unsorted is right too.\n"
    "Deterministic: the same inputs give the same bits.\n" QK_GRAPH_DOC)

QK_DOCS(graph_norm_bce_backward, "grad, logits, target, edge_graph, num_graphs, *, pos_weight=None",
    "Gradient of graph_norm_bce with respect to logits -> grad_logits [E] in logits' dtype:\n"
    "grad * w_e * (sigmoid(l_e) - t_e) / (max(count_g, 1) * num_graphs) with g = edge_graph[e] and\n"
    "w_e = 1 + (pos_weight_e - 1)*t_e (1 without pos_weight).  grad is the upstream gradient of the\n"
    "loss: a float32 tensor of one element (shape [] or [1]) on logits' device, read by the kernel\n"
    "(no host sync).  The other arguments are the forward's.  Per-graph edge counts take one pass\n"
    "over edge_graph (integer counts: deterministic); sorted or not, the result is the same.  On\n"
    "cuda an edge whose graph id is out of range gets 0.\n" QK_GRAPH_DOC)

/* pos_weight=: None (0), a float (1, in *value), or a tensor (2, imported into *v and checked
 * against logits once the others are: gb_pos_weight_check). */
static int gb_pos_weight_arg(qk_state *st, const char *op, PyObject *obj, void *stream, double *value, qk_view *v) {
    if (obj == NULL || obj == Py_None) return 0;
    if (!PyFloat_Check(obj) && !PyLong_Check(obj) &&
        (qk_is_tensor(st, obj) || PyCapsule_CheckExact(obj) || PyObject_HasAttr(obj, st->str_dlpack)))
        return qk_import(st, obj, op, "pos_weight", stream, v) < 0 ? -1 : 2;
    *value = PyFloat_AsDouble(obj);
    if (*value == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: pos_weight must be a float, a tensor or None, got %.200s", op,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (!isfinite((float)*value)) { /* the kernels weigh in float32 */
        PyErr_Format(PyExc_ValueError, "%s: pos_weight must be finite in float32, got %R", op, obj);
        return -1;
    }
    return 1;
}

static int gb_pos_weight_check(const char *op, const qk_view *pw, const qk_view *logits, int64_t E) {
    if (pw->dtype != QK_F32 && pw->dtype != logits->dtype) {
        PyErr_Format(PyExc_TypeError, "%s: pos_weight must be float32 or logits' dtype (%s), got %s", op,
                     qk_dtype_name(logits->dtype), qk_dtype_name(pw->dtype));
        return -1;
    }
    if (pw->ndim > 1 || (pw->ndim == 1 && pw->shape[0] != E && pw->shape[0] != 1)) {
        char got[160];
        qk_shape_str(got, sizeof got, pw->shape, pw->ndim);
        PyErr_Format(PyExc_ValueError, "%s: pos_weight must have shape [E] = [%lld], [1] or [], got %s", op,
                     (long long)E, got);
        return -1;
    }
    return 0;
}

/* Both ops' arguments: n required tensors, the last of them num_graphs (returned, or -1 with the
 * exception), then pos_weight and stream. */
static long long gb_args(const char *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                         const char *const *names, int n, PyObject **a, void **stream, int *stream_given) {
    if (qk_parse_args(op, args, nargs, kwnames, names, n, n, a) < 0 ||
        qk_stream_arg(op, a[n + 1], stream, stream_given) < 0)
        return -1;
    return qk_num_graphs_arg(op, a[n - 1], 32);
}

/* Imports and checks shared by the forward and the backward: logits, target, edge_graph at
 * in[first..first+2], pos_weight after them when it is a tensor.  Fills the arguments' part of gb. */
static int gb_inputs(qk_state *st, const char *op, PyObject *const *objs, PyObject *pw_obj, long long G, void *stream,
                     qk_view *in, const char *const *in_names, int first, int *n_in, qk_graph_norm_bce_args *gb) {
    double pw_value = 1.0;
    for (; *n_in < first + 3; (*n_in)++)
        if (qk_import(st, objs[*n_in - first], op, in_names[*n_in], stream, &in[*n_in]) < 0) return -1;
    const int pw_kind = gb_pos_weight_arg(st, op, pw_obj, stream, &pw_value, &in[first + 3]);
    if (pw_kind < 0) return -1;
    if (pw_kind == 2) (*n_in)++;
    if (qk_same_device(op, in, in_names, *n_in) < 0) return -1;
    const qk_view *lg = &in[first], *tg = &in[first + 1], *eg = &in[first + 2];
    if (qk_check_ndim(op, "logits", lg, 1, "[E]") < 0 || qk_check_ndim(op, "target", tg, 1, "[E]") < 0 ||
        qk_check_ndim(op, "edge_graph", eg, 1, "[E]") < 0 || qk_check_dtype_index(op, "edge_graph", eg) < 0)
        return -1;
    if (qk_check_dtype_float(op, "logits", lg) < 0 || qk_check_same_dtype(op, "target", tg, "logits'", lg) < 0)
        return -1;
    const int64_t E = lg->shape[0];
    if (qk_check_dim(op, "target", tg, 0, E, "[E] = [%lld]", (long long)E) < 0 ||
        qk_check_dim(op, "edge_graph", eg, 0, E, "[E] = [%lld]", (long long)E) < 0)
        return -1;
    if (pw_kind == 2 && gb_pos_weight_check(op, &in[first + 3], lg, E) < 0) return -1;
    gb->logits = lg->data;
    gb->target = tg->data;
    gb->edge_graph = eg->data;
    gb->num_edges = E;
    gb->num_graphs = G;
    gb->logits_stride = lg->strides[0];
    gb->target_stride = tg->strides[0];
    gb->graph_stride = eg->strides[0];
    gb->pos_weight = (float)pw_value;
    gb->has_pos_weight = pw_kind != 0;
    if (pw_kind == 2 && E > 0) { /* E = 0: nothing is read (an empty pos_weight may have no data) */
        const qk_view *pw = &in[first + 3];
        gb->pos_weight_t = pw->data;
        gb->pw_stride = pw->ndim == 1 && pw->shape[0] == E && E > 1 ? pw->strides[0] : 0; /* 0: one value */
        gb->pw_dtype = pw->dtype;
    }
    gb->dtype = lg->dtype;
    gb->index_dtype = eg->dtype;
    gb->num_threads = st->num_threads;
    return 0;
}

/* Run launcher name (graph_norm_bce or graph_norm_bce_backward), edge_graph checked first on cuda
 * under QKERNELS_CHECK=1; ok = 1 on success. */
#define GB_RUN(ok, st, l, name, gb, op)                                                               \
    QK_RUN_GRAPH_IDS(ok, st, l, name, gb, op, 1, "edge_graph", (gb)->edge_graph, (gb)->num_edges, \
                     (gb)->graph_stride)

static const char *const gb_variants[] = {[QK_BCE_AUTO] = "auto", [QK_BCE_LAUNCHES] = "launches"};

/* The forward's scratch hook on cuda with a framework allocator: its one request becomes the output,
 * a 0-d float32 at the start of a block that also holds the launcher's scratch, so a call allocates
 * once (no stream-ordered pool round trip) and the block goes with the loss tensor. */
typedef struct {
    const qk_view *like;
    const qk_launch *l;
    qk_view *ov;
    qk_output *o;
    int failed;          /* the allocation raised; its exception is in error */
    qk_saved_error error;
} gb_block;

static int gb_block_alloc(void *ctx, size_t bytes, void *stream, void **p) {
    (void)stream;
    gb_block *b = ctx;
    if (b->o->mt || b->failed) return QK_E_UNSUPPORTED; /* one block per call */
    if (qk_output_block(OP, b->like, b->l, QK_F32, bytes, b->ov, b->o) < 0) {
        b->failed = 1;
        b->error = qk_error_save();
        return QK_E_NOMEM;
    }
    *p = b->ov->data;
    return QK_OK;
}

static int gb_block_free(void *ctx, void *p, size_t bytes, void *stream) {
    (void)ctx, (void)p, (void)bytes, (void)stream; /* the output owns the block */
    return QK_OK;
}

PyObject *qk_op_graph_norm_bce(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"logits",     "target", "edge_graph", "num_graphs",
                                        "pos_weight", "stream", "_variant",   NULL};
    static const char *const in_names[] = {"logits", "target", "edge_graph", "pos_weight"};
    qk_state *st = qk_get_state(module);
    PyObject *a[7] = {NULL};
    void *stream;
    int stream_given, variant;
    const long long G = gb_args(OP, args, nargs, kwnames, names, 4, a, &stream, &stream_given);
    if (G < 0 || qk_variant_arg(OP, "_variant", a[6], gb_variants, QK_COUNT(gb_variants), &variant) < 0) return NULL;
    qk_view in[4] = {{0}}, ov = {0};
    qk_output o = {0};
    qk_launch l = {0};
    qk_graph_norm_bce_args gb = {0};
    gb_block block = {0};
    qk_scratch hook = {gb_block_alloc, gb_block_free, &block, 0, 0};
    int ok = 0, launched = 0, n_in = 0;
    if (gb_inputs(st, OP, a, a[4], G, stream, in, in_names, 0, &n_in, &gb) < 0) goto done;
    if (qk_launch_begin(st, OP, &in[0], stream, stream_given, &l) < 0) goto done;
    launched = 1;
    gb.variant = variant;
    if (l.device_type == kDLCUDA && in[0].api) {
        block.like = &in[0], block.l = &l, block.ov = &ov, block.o = &o;
        gb.scratch = &hook; /* gb.out stays NULL: the launcher writes the loss to the block's start */
    } else {
        if (qk_output_prepare(st, OP, NULL, &in[0], QK_F32, 0, NULL, &l, &ov, &o) < 0) goto done;
        gb.out = (float *)ov.data;
    }
    GB_RUN(ok, st, &l, graph_norm_bce, &gb, OP);
    if (block.failed) { /* the framework's exception, not the status's */
        PyErr_Clear();
        qk_error_restore(block.error);
        ok = 0;
    } else if (ok && gb.scratch && o.mt == NULL) {
        PyErr_SetString(PyExc_RuntimeError, OP ": the launcher did not allocate out");
        ok = 0;
    }
done:
    return qk_op_finish(&l, launched, &o, &ov, ok, in, n_in);
}

#undef OP
#define OP "graph_norm_bce_backward"

PyObject *qk_op_graph_norm_bce_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"grad", "logits", "target", "edge_graph", "num_graphs", "pos_weight",
                                        "stream", NULL};
    static const char *const in_names[] = {"grad", "logits", "target", "edge_graph", "pos_weight"};
    qk_state *st = qk_get_state(module);
    PyObject *a[7] = {NULL};
    void *stream;
    int stream_given;
    const long long G = gb_args(OP, args, nargs, kwnames, names, 5, a, &stream, &stream_given);
    if (G < 0) return NULL;
    qk_view in[5] = {{0}}, ov = {0};
    qk_output o = {0};
    qk_launch l = {0};
    qk_graph_norm_bce_args gb = {0};
    int ok = 0, launched = 0, n_in = 0;
    if (qk_import(st, a[0], OP, "grad", stream, &in[0]) < 0) goto done;
    n_in = 1;
    if (gb_inputs(st, OP, a + 1, a[5], G, stream, in, in_names, 1, &n_in, &gb) < 0) goto done;
    if (in[0].dtype != QK_F32) {
        PyErr_Format(PyExc_TypeError, OP ": grad must be float32 (the loss's dtype), got %s",
                     qk_dtype_name(in[0].dtype));
        goto done;
    }
    if (in[0].ndim > 1 || (in[0].ndim == 1 && in[0].shape[0] != 1)) {
        char got[160];
        qk_shape_str(got, sizeof got, in[0].shape, in[0].ndim);
        PyErr_Format(PyExc_ValueError, OP ": grad must hold one element (shape [] or [1]), got shape %s", got);
        goto done;
    }
    if (qk_launch_begin(st, OP, &in[0], stream, stream_given, &l) < 0) goto done;
    launched = 1;
    const int64_t E = gb.num_edges;
    if (qk_output_prepare(st, OP, NULL, &in[1], in[1].dtype, 1, &E, &l, &ov, &o) < 0) goto done;
    gb.grad = (const float *)in[0].data;
    gb.grad_logits = ov.data;
    gb.grad_stride = ov.strides[0];
    if (E > 0) GB_RUN(ok, st, &l, graph_norm_bce_backward, &gb, OP);
    else ok = 1;
done:
    return qk_op_finish(&l, launched, &o, &ov, ok, in, n_in);
}
