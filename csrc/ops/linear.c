/* linear(x, weight, bias=None, *, out=None, stream=None) and
 * swiglu(x, up_weight, gate_weight, *, out=None, stream=None): argument checks, then the CPU or
 * CUDA launcher by device.  Both fill qk_linear_args.  x is [*, K] like torch.nn.functional.linear:
 * its leading dimensions are the M rows, which must step by one stride (a 1-D x is one row).  The raw
 * ops also take the private tuning keywords _variant= (a name below), _split= and _tile_m=
 * (qk_linear_args' variant, split and tile_m). */
#include "../qk.h"
#include "../cpu/cpu.h"

QK_DOCS(linear, "x, weight, bias=None, *, out=None",
    "x @ weight^T + bias.\n\n"
    "x [*, K] (any leading dimensions, or [K]), weight [N, K], bias [N] -> [*, N]; fp32 accumulation, bias\n"
    "added in fp32, one rounding.  x's leading dimensions must step by one stride (else ValueError: pass\n"
    "x.contiguous()).\n" QK_DENSE_DOC)

QK_DOCS(swiglu, "x, up_weight, gate_weight, *, out=None",
    "The gated MLP's first half in one pass: linear(x, up_weight) * silu(linear(x, gate_weight)).\n\n"
    "x [*, K] (any leading dimensions, or [K]), up_weight and gate_weight [N, K] -> [*, N]; fp32\n"
    "throughout (silu(g) = g / (1 + exp(-g))), one rounding.\n" QK_DENSE_DOC)

static const char *const ln_variants[] = {
    [QK_LINEAR_AUTO] = "auto", [QK_LINEAR_MMA] = "mma", [QK_LINEAR_GEMV] = "gemv", [QK_LINEAR_ROWS] = "rows"};
/* v as rows [M, last]: M = the product of its leading dimensions, *row_stride the one stride that steps
 * through them (size-1 dimensions take any stride; with at most one row it is never used and set to
 * the row length).  -1 with ValueError naming arg where the leading dimensions are not rows of one
 * stride. */
static int ln_rows(const char *op, const char *arg, const qk_view *v, int64_t *M, int64_t *row_stride) {
    int64_t m = 1, stride = v->ndim ? v->shape[v->ndim - 1] : 1, next = 0;
    int have = 0, ok = 1;
    for (int i = v->ndim - 2; i >= 0; i--) {
        if (__builtin_mul_overflow(m, v->shape[i], &m)) m = INT64_MAX; /* only with an empty last dim */
        if (v->shape[i] == 1) continue;
        if (have && v->strides[i] != next) ok = 0;
        if (!have) stride = v->strides[i];
        have = 1;
        if (__builtin_mul_overflow(v->strides[i], v->shape[i], &next)) ok = 0;
    }
    if (m <= 1) { /* nothing to step through */
        ok = 1;
        stride = v->ndim ? v->shape[v->ndim - 1] : 1;
    }
    if (!ok) {
        char shape[160], strides[160];
        qk_shape_str(shape, sizeof shape, v->shape, v->ndim);
        qk_shape_str(strides, sizeof strides, v->strides, v->ndim);
        PyErr_Format(PyExc_ValueError,
                     "%s: %s's leading dimensions (shape %s, strides %s in elements) cannot be read as rows of one "
                     "stride; pass %s.contiguous()",
                     op, arg, shape, strides, arg);
        return -1;
    }
    *M = m;
    *row_stride = stride;
    return 0;
}

/* x [*, K]: at least one dimension */
static int ln_check_x(const char *op, const char *arg, const qk_view *x) {
    if (x->ndim >= 1) return 0;
    PyErr_Format(PyExc_ValueError, "%s: %s must have at least 1 dimension [*, K], got a 0-d tensor", op, arg);
    return -1;
}

/* in[0] x, in[1] the (up) weight, in[2] bias (linear) or gate_weight (swiglu) */
static PyObject *ln_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int swiglu) {
    static const char *const linear_names[] = {"x", "weight", "bias", "out", "stream", "_variant", "_split", "_tile_m",
                                               NULL};
    static const char *const swiglu_names[] = {"x", "up_weight", "gate_weight", "out", "stream", "_variant", "_split",
                                               "_tile_m", NULL};
    const char *const op = swiglu ? "swiglu" : "linear";
    const char *const *names = swiglu ? swiglu_names : linear_names;
    qk_state *st = qk_get_state(module);
    PyObject *a[8] = {NULL};
    if (qk_parse_args(op, args, nargs, kwnames, names, 3, swiglu ? 3 : 2, a) < 0) return NULL;
    void *stream;
    int stream_given, variant, split, tile_m;
    if (qk_stream_arg(op, a[4], &stream, &stream_given) < 0 ||
        qk_variant_arg(op, "_variant", a[5], ln_variants, QK_COUNT(ln_variants), &variant) < 0 ||
        qk_tuning_int_arg(op, "_split", a[6], 8, 1, &split) < 0 ||
        qk_tuning_int_arg(op, "_tile_m", a[7], 64, 0, &tile_m) < 0)
        return NULL;
    const int has_third = swiglu || (a[2] != NULL && a[2] != Py_None); /* swiglu's gate None: a TypeError */

    qk_view in[3] = {{0}}, ov = {0};
    qk_output o = {0};
    qk_launch l = {0};
    int ok = 0, launched = 0, n_in = 0;
    for (; n_in < 2 + has_third; n_in++)
        if (qk_import(st, a[n_in], op, names[n_in], stream, &in[n_in]) < 0) goto done;
    if (qk_same_device(op, in, names, n_in) < 0) goto done;
    qk_view *x = &in[0];
    if (ln_check_x(op, "x", x) < 0 || qk_check_dtype_llm(op, "x", x) < 0) goto done;
    const int64_t K = x->shape[x->ndim - 1];
    const int64_t N = in[1].ndim == 2 ? in[1].shape[0] : 0;
    char layout[96];
    snprintf(layout, sizeof layout, "[N, K] = [%lld, %lld]", (long long)N, (long long)K);
    for (int i = 1; i < n_in; i++) {
        if (qk_check_same_dtype(op, names[i], &in[i], "x's", x) < 0) goto done;
        if (i == 2 && !swiglu) {
            snprintf(layout, sizeof layout, "[N] = [%lld]", (long long)N);
            if (qk_check_ndim(op, "bias", &in[2], 1, "[N]") < 0 || qk_check_dim(op, "bias", &in[2], 0, N, layout) < 0)
                goto done;
            continue;
        }
        /* the weight fixes N; K comes from x */
        if (qk_check_ndim(op, names[i], &in[i], 2, "[N, K]") < 0 ||
            qk_check_dim(op, names[i], &in[i], 0, N, layout) < 0 || qk_check_dim(op, names[i], &in[i], 1, K, layout) < 0 ||
            qk_check_inner_unit(op, names[i], &in[i]) < 0)
            goto done;
    }
    int64_t M, x_stride, out_M, out_stride;
    if (qk_check_inner_unit(op, "x", x) < 0 || ln_rows(op, "x", x, &M, &x_stride) < 0) goto done;
    if (qk_launch_begin(st, op, x, stream, stream_given, &l) < 0) goto done;
    launched = 1;
    int64_t shape[QK_MAX_DIMS];
    for (int i = 0; i < x->ndim - 1; i++) shape[i] = x->shape[i];
    shape[x->ndim - 1] = N;
    if (qk_output_prepare(st, op, a[3], x, x->dtype, x->ndim, shape, &l, &ov, &o) < 0 ||
        qk_out_overlap(op, &ov, in, names, n_in, 0) < 0)
        goto done;
    if (qk_check_inner_unit(op, "out", &ov) < 0 || ln_rows(op, "out", &ov, &out_M, &out_stride) < 0) goto done;

    qk_linear_args la = {0};
    la.x = x->data;
    la.w = in[1].data;
    la.gate = swiglu ? in[2].data : NULL;
    la.bias = !swiglu && has_third ? in[2].data : NULL;
    la.out = ov.data;
    la.M = M;
    la.N = N;
    la.K = K;
    la.x_stride = x_stride;
    la.w_stride = in[1].strides[0];
    la.gate_stride = swiglu ? in[2].strides[0] : 0;
    la.bias_stride = !swiglu && has_third ? in[2].strides[0] : 0;
    la.out_stride = out_stride;
    la.dtype = x->dtype;
    la.num_threads = st->num_threads;
    la.variant = variant;
    la.split = split;
    la.tile_m = tile_m;
    int status = QK_OK;
    if (M > 0 && N > 0) {
        if (swiglu) QK_RUN(status, &l, swiglu, &la);
        else QK_RUN(status, &l, linear, &la);
    }
    if (status) qk_raise_status(op, status);
    else ok = 1;
done:
    return qk_op_finish(&l, launched, &o, &ov, ok, in, n_in);
}

PyObject *qk_op_linear(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return ln_op(module, args, nargs, kwnames, 0);
}

PyObject *qk_op_swiglu(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return ln_op(module, args, nargs, kwnames, 1);
}
