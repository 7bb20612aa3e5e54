/* linear(x, weight, bias=None, *, out=None, stream=None) and
 * swiglu(x, up_weight, gate_weight, *, out=None, stream=None): argument checks, then the CPU or
 * CUDA launcher by device.  Both fill qk_linear_args; a 1-D x [K] is one row and gives out [N].
 * The raw ops also take the private tuning keywords _variant= (a name below), _split= and _tile_m=
 * (qk_linear_args' variant, split and tile_m). */
#include "../qk.h"
#include "../cpu/cpu.h"

QK_DOCS(linear, "x, weight, bias=None, *, out=None",
    "x @ weight^T + bias.\n\n"
    "x [M, K] (or [K], giving [N]), weight [N, K], bias [N] -> [M, N]; fp32 accumulation, bias added in\n"
    "fp32, one rounding.\n" QK_DENSE_DOC)

QK_DOCS(swiglu, "x, up_weight, gate_weight, *, out=None",
    "The gated MLP's first half in one pass: linear(x, up_weight) * silu(linear(x, gate_weight)).\n\n"
    "x [M, K] (or [K]), up_weight and gate_weight [N, K] -> [M, N] (or [N]); fp32 throughout\n"
    "(silu(g) = g / (1 + exp(-g))), one rounding.\n" QK_DENSE_DOC)

static const char *const ln_variants[] = {
    [QK_LINEAR_AUTO] = "auto", [QK_LINEAR_MMA] = "mma", [QK_LINEAR_GEMV] = "gemv", [QK_LINEAR_ROWS] = "rows"};

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
    if (x->ndim != 1 && x->ndim != 2) {
        char got[160];
        qk_shape_str(got, sizeof got, x->shape, x->ndim);
        PyErr_Format(PyExc_ValueError, "%s: x must have 1 or 2 dimensions [K] or [M, K], got shape %s", op, got);
        goto done;
    }
    if (qk_check_dtype_llm(op, "x", x) < 0) goto done;
    const int64_t M = x->ndim == 2 ? x->shape[0] : 1, K = x->shape[x->ndim - 1];
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
    if (qk_check_inner_unit(op, "x", x) < 0) goto done;
    if (qk_launch_begin(st, op, x, stream, stream_given, &l) < 0) goto done;
    launched = 1;
    const int64_t shape2[2] = {M, N}, shape1[1] = {N};
    if (qk_output_prepare(st, op, a[3], x, x->dtype, x->ndim, x->ndim == 2 ? shape2 : shape1, &l, &ov, &o) < 0 ||
        qk_out_overlap(op, &ov, in, names, n_in, 0) < 0)
        goto done;
    if (qk_check_inner_unit(op, "out", &ov) < 0) goto done;

    qk_linear_args la = {0};
    la.x = x->data;
    la.w = in[1].data;
    la.gate = swiglu ? in[2].data : NULL;
    la.bias = !swiglu && has_third ? in[2].data : NULL;
    la.out = ov.data;
    la.M = M;
    la.N = N;
    la.K = K;
    la.x_stride = x->ndim == 2 ? x->strides[0] : K;
    la.w_stride = in[1].strides[0];
    la.gate_stride = swiglu ? in[2].strides[0] : 0;
    la.bias_stride = !swiglu && has_third ? in[2].strides[0] : 0;
    la.out_stride = ov.ndim == 2 ? ov.strides[0] : N;
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
