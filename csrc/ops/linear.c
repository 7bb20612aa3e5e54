/* linear(x, weight, bias=None, *, out=None, stream=None),
 * swiglu(x, up_weight, gate_weight, *, out=None, stream=None),
 * linear_backward(grad_out, x, weight, *, x_grad=True, weight_grad=True, bias_grad=False, stream=None) and
 * swiglu_backward(grad_out, x, up_weight, gate_weight, *, x_grad=True, weight_grad=True, stream=None):
 * argument checks, then the CPU or CUDA launcher by device.  All fill qk_linear_args.  x is [*, K]
 * like torch.nn.functional.linear: its leading dimensions are the M rows, which must step by one
 * stride (a 1-D x is one row).  The raw forward ops also take the private tuning keywords _variant=
 * (a name below), _split= and _tile_m= (qk_linear_args' variant, split and tile_m), and _isa= (the
 * cpu backend's highest instruction set, a name of qk_cpu_isa_names: tests run each path the machine
 * has; levels above the machine's fall back to the best it has); the raw backward
 * ops _variant= and _split= (the partial sums the CUDA kernels reduce). */
#include "../qk.h"
#include "../cpu/cpu.h"
#include "../cpu/linear_isa.h"

QK_DOCS(linear, "x, weight, bias=None, *, out=None",
    "x @ weight^T + bias.\n\n"
    "x [*, K] (any leading dimensions, or [K]), weight [N, K], bias [N] -> [*, N]; fp32 accumulation, bias\n"
    "added in fp32, one rounding.  x's leading dimensions must step by one stride (else ValueError: pass\n"
    "x.contiguous()).\n" QK_DENSE_DOC)

QK_DOCS(swiglu, "x, up_weight, gate_weight, *, out=None",
    "The gated MLP's first half in one pass: linear(x, up_weight) * silu(linear(x, gate_weight)).\n\n"
    "x [*, K] (any leading dimensions, or [K]), up_weight and gate_weight [N, K] -> [*, N]; fp32\n"
    "throughout (silu(g) = g / (1 + exp(-g))), one rounding.\n" QK_DENSE_DOC)

QK_DOCS(linear_backward, "grad_out, x, weight, *, x_grad=True, weight_grad=True, bias_grad=False",
    "The gradients of linear(x, weight, bias): (grad_x, grad_weight, grad_bias).\n\n"
    "grad_out [*, N], x [*, K] (the same leading dimensions), weight [N, K] -> grad_x = grad_out @ weight\n"
    "[*, K], grad_weight = grad_out^T @ x [N, K] (summed over every leading position), grad_bias = grad_out\n"
    "summed over the rows [N]; each None unless asked for (x_grad, weight_grad, bias_grad).  fp32\n"
    "accumulation, one rounding to x's dtype; deterministic (every sum in a fixed order).\n" QK_DENSE_DOC)

QK_DOCS(swiglu_backward, "grad_out, x, up_weight, gate_weight, *, x_grad=True, weight_grad=True",
    "The gradients of swiglu(x, up_weight, gate_weight): (grad_x, grad_up_weight, grad_gate_weight).\n\n"
    "grad_out [*, N], x [*, K] (the same leading dimensions), up_weight and gate_weight [N, K].  With\n"
    "a = x up^T, b = x gate^T recomputed in fp32, s = sigmoid(b): ga = grad_out * silu(b),\n"
    "gb = grad_out * a * s * (1 + b * (1 - s)); grad_x = ga @ up + gb @ gate [*, K], grad_up = ga^T x and\n"
    "grad_gate = gb^T x [N, K]; None where not asked for (x_grad, weight_grad).  fp32 accumulation,\n"
    "one rounding to x's dtype; on cuda ga and gb are rounded to that dtype before the products (as\n"
    "autograd of the unfused formulation would).  Deterministic.\n" QK_DENSE_DOC)

static const char *const ln_variants[] = {
    [QK_LINEAR_AUTO] = "auto", [QK_LINEAR_MMA] = "mma", [QK_LINEAR_GEMV] = "gemv", [QK_LINEAR_ROWS] = "rows"};
static const char *const lb_variants[] = {
    [QK_LINEAR_BWD_AUTO] = "auto", [QK_LINEAR_BWD_TILES] = "tiles", [QK_LINEAR_BWD_LT] = "lt"};

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

/* The operands both directions fill alike: x as M rows of K at x_stride, the (up) weight w [N, K] and
 * swiglu's gate_weight (NULL for linear), and the options. */
static void ln_fill(qk_linear_args *la, const qk_view *x, int64_t M, int64_t x_stride, const qk_view *w,
                    const qk_view *gate, int variant, int split, int num_threads) {
    la->x = x->data;
    la->w = w->data;
    la->gate = gate ? gate->data : NULL;
    la->M = M;
    la->N = w->shape[0];
    la->K = x->shape[x->ndim - 1];
    la->x_stride = x_stride;
    la->w_stride = w->strides[0];
    la->gate_stride = gate ? gate->strides[0] : 0;
    la->dtype = x->dtype;
    la->num_threads = num_threads;
    la->variant = variant;
    la->split = split;
}

/* in[0] x, in[1] the (up) weight, in[2] bias (linear) or gate_weight (swiglu) */
static PyObject *ln_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int swiglu) {
    static const char *const linear_names[] = {"x", "weight", "bias", "out", "stream", "_variant", "_split", "_tile_m",
                                               "_isa", NULL};
    static const char *const swiglu_names[] = {"x", "up_weight", "gate_weight", "out", "stream", "_variant", "_split",
                                               "_tile_m", "_isa", NULL};
    const char *const op = swiglu ? "swiglu" : "linear";
    const char *const *names = swiglu ? swiglu_names : linear_names;
    qk_state *st = qk_get_state(module);
    PyObject *a[9] = {NULL};
    if (qk_parse_args(op, args, nargs, kwnames, names, 3, swiglu ? 3 : 2, a) < 0) return NULL;
    void *stream;
    int stream_given, variant, split, tile_m, isa;
    if (qk_stream_arg(op, a[4], &stream, &stream_given) < 0 ||
        qk_variant_arg(op, "_variant", a[5], ln_variants, QK_COUNT(ln_variants), &variant) < 0 ||
        qk_tuning_int_arg(op, "_split", a[6], 8, 1, &split) < 0 ||
        qk_tuning_int_arg(op, "_tile_m", a[7], 64, 0, &tile_m) < 0 ||
        qk_variant_arg(op, "_isa", a[8], qk_cpu_isa_names, QK_CPU_ISA_COUNT, &isa) < 0)
        return NULL;
    const int has_third = swiglu || (a[2] != NULL && a[2] != Py_None); /* swiglu's gate None: a TypeError */

    qk_view in[3] = {{0}}, ov = {0};
    qk_output o = {0};
    qk_launch l = {0};
    int ok = 0, launched = 0, n_in = 0;
    if (qk_import_all(st, op, a, names, 2 + has_third, stream, in, &n_in) < 0) goto done;
    qk_view *x = &in[0];
    if (ln_check_x(op, "x", x) < 0 || qk_check_dtype_llm(op, "x", x) < 0) goto done;
    const int64_t K = x->shape[x->ndim - 1];
    const int64_t N = in[1].ndim == 2 ? in[1].shape[0] : 0;
    const long long n_ = (long long)N, k_ = (long long)K;
    for (int i = 1; i < n_in; i++) {
        if (qk_check_same_dtype(op, names[i], &in[i], "x's", x) < 0) goto done;
        if (i == 2 && !swiglu) {
            if (qk_check_ndim(op, "bias", &in[2], 1, "[N]") < 0 || qk_check_dim(op, "bias", &in[2], 0, N, "[N] = [%lld]", n_) < 0)
                goto done;
            continue;
        }
        /* the weight fixes N; K comes from x */
        if (qk_check_ndim(op, names[i], &in[i], 2, "[N, K]") < 0 ||
            qk_check_dim(op, names[i], &in[i], 0, N, "[N, K] = [%lld, %lld]", n_, k_) < 0 ||
            qk_check_dim(op, names[i], &in[i], 1, K, "[N, K] = [%lld, %lld]", n_, k_) < 0 ||
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
    ln_fill(&la, x, M, x_stride, &in[1], swiglu ? &in[2] : NULL, variant, split, st->num_threads);
    la.bias = !swiglu && has_third ? in[2].data : NULL;
    la.bias_stride = !swiglu && has_third ? in[2].strides[0] : 0;
    la.out = ov.data;
    la.out_stride = out_stride;
    la.tile_m = tile_m;
    la.cpu_isa = isa;
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

/* The backward ops.  in[0] grad_out, in[1] x, in[2] the (up) weight, in[3] gate_weight (swiglu);
 * outputs o[0] grad_x, o[1] grad_weight (up's), o[2] grad_bias (linear) or grad_gate_weight (swiglu). */
static PyObject *lb_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int swiglu) {
    static const char *const linear_names[] = {"grad_out", "x", "weight", "x_grad", "weight_grad", "bias_grad",
                                               "stream", "_variant", "_split", NULL};
    static const char *const swiglu_names[] = {"grad_out", "x", "up_weight", "gate_weight", "x_grad", "weight_grad",
                                               "stream", "_variant", "_split", NULL};
    const char *const op = swiglu ? "swiglu_backward" : "linear_backward";
    const char *const *names = swiglu ? swiglu_names : linear_names;
    const int n_tensors = swiglu ? 4 : 3;
    qk_state *st = qk_get_state(module);
    PyObject *p[9] = {NULL};
    if (qk_parse_args(op, args, nargs, kwnames, names, n_tensors, n_tensors, p) < 0) return NULL;
    /* p: the tensors, then the flags (three for linear, two for swiglu), stream, _variant, _split */
    PyObject *const *kw = p + n_tensors;
    const int n_flags = swiglu ? 2 : 3;
    void *stream;
    int stream_given, variant, split, want_x, want_w, want_b = 0;
    if (qk_stream_arg(op, kw[n_flags], &stream, &stream_given) < 0 ||
        qk_variant_arg(op, "_variant", kw[n_flags + 1], lb_variants, QK_COUNT(lb_variants), &variant) < 0 ||
        qk_tuning_int_arg(op, "_split", kw[n_flags + 2], 64, 0, &split) < 0 ||
        qk_bool_arg(op, "x_grad", kw[0], 1, &want_x) < 0 || qk_bool_arg(op, "weight_grad", kw[1], 1, &want_w) < 0 ||
        (!swiglu && qk_bool_arg(op, "bias_grad", kw[2], 0, &want_b) < 0))
        return NULL;

    qk_view in[4] = {{0}}, ov[3] = {{0}};
    qk_output o[3] = {{0}};
    qk_launch l = {0};
    int ok = 0, launched = 0, n_in = 0;
    if (qk_import_all(st, op, p, names, n_tensors, stream, in, &n_in) < 0) goto done;
    qk_view *g = &in[0], *x = &in[1];
    if (qk_check_dtype_llm(op, "grad_out", g) < 0) goto done;
    if (ln_check_x(op, "x", x) < 0 || qk_check_same_dtype(op, "x", x, "grad_out's", g) < 0) goto done;
    const int64_t K = x->shape[x->ndim - 1];
    const int64_t N = in[2].ndim == 2 ? in[2].shape[0] : 0;
    const long long n_ = (long long)N, k_ = (long long)K;
    for (int i = 2; i < n_in; i++) /* the (up) weight fixes N; K comes from x */
        if (qk_check_same_dtype(op, names[i], &in[i], "grad_out's", g) < 0 ||
            qk_check_ndim(op, names[i], &in[i], 2, "[N, K]") < 0 ||
            qk_check_dim(op, names[i], &in[i], 0, N, "[N, K] = [%lld, %lld]", n_, k_) < 0 ||
            qk_check_dim(op, names[i], &in[i], 1, K, "[N, K] = [%lld, %lld]", n_, k_) < 0 ||
            qk_check_inner_unit(op, names[i], &in[i]) < 0)
            goto done;
    {   /* grad_out: x's leading dimensions, then N */
        int64_t want[QK_MAX_DIMS];
        for (int i = 0; i < x->ndim - 1; i++) want[i] = x->shape[i];
        want[x->ndim - 1] = N;
        int bad = g->ndim != x->ndim;
        for (int i = 0; !bad && i < x->ndim; i++) bad = g->shape[i] != want[i];
        if (bad) {
            char w[160], got[160];
            qk_shape_str(w, sizeof w, want, x->ndim);
            qk_shape_str(got, sizeof got, g->shape, g->ndim);
            PyErr_Format(PyExc_ValueError, "%s: grad_out must have shape %s (x's leading dimensions, then N = %lld), "
                         "got %s", op, w, (long long)N, got);
            goto done;
        }
    }
    int64_t M, x_stride, g_stride, gx_stride = 0, m2;
    if (qk_check_inner_unit(op, "grad_out", g) < 0 || qk_check_inner_unit(op, "x", x) < 0 ||
        ln_rows(op, "grad_out", g, &M, &g_stride) < 0 || ln_rows(op, "x", x, &M, &x_stride) < 0)
        goto done;
    if (qk_launch_begin(st, op, x, stream, stream_given, &l) < 0) goto done;
    launched = 1;
    const int64_t wshape[2] = {N, K};
    if (want_x && (qk_output_prepare(st, op, NULL, x, x->dtype, x->ndim, x->shape, &l, &ov[0], &o[0]) < 0 ||
                   ln_rows(op, "grad_x", &ov[0], &m2, &gx_stride) < 0))
        goto done;
    if (want_w && qk_output_prepare(st, op, NULL, x, x->dtype, 2, wshape, &l, &ov[1], &o[1]) < 0) goto done;
    if (swiglu && want_w && qk_output_prepare(st, op, NULL, x, x->dtype, 2, wshape, &l, &ov[2], &o[2]) < 0) goto done;
    if (want_b && qk_output_prepare(st, op, NULL, x, x->dtype, 1, wshape, &l, &ov[2], &o[2]) < 0) goto done;

    qk_linear_args la = {0};
    ln_fill(&la, x, M, x_stride, &in[2], swiglu ? &in[3] : NULL, variant, split, st->num_threads);
    la.grad_out = g->data;
    la.grad_out_stride = g_stride;
    la.grad_x = want_x ? ov[0].data : NULL;
    la.grad_x_stride = gx_stride;
    la.grad_w = want_w ? ov[1].data : NULL;
    la.grad_w_stride = want_w ? ov[1].strides[0] : 0;
    la.grad_gate = swiglu && want_w ? ov[2].data : NULL;
    la.grad_gate_stride = swiglu && want_w ? ov[2].strides[0] : 0;
    la.grad_bias = want_b ? ov[2].data : NULL;
    la.grad_bias_stride = want_b ? ov[2].strides[0] : 0;
    int status = QK_OK;
    /* empty gradients need no kernel; the launchers write zeros where a sum has no terms */
    const int work = (want_x && M > 0 && K > 0) || (want_w && N > 0 && K > 0) || (want_b && N > 0);
    if (work) {
        if (swiglu) QK_RUN(status, &l, swiglu_backward, &la);
        else QK_RUN(status, &l, linear_backward, &la);
    }
    if (status) qk_raise_status(op, status);
    else ok = 1;
done:
    return qk_op_finish_many(&l, launched, o, ov, 3, ok, in, n_in);
}

PyObject *qk_op_linear_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return lb_op(module, args, nargs, kwnames, 0);
}

PyObject *qk_op_swiglu_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return lb_op(module, args, nargs, kwnames, 1);
}

/* _C._cpu_isa(): the best instruction-set level of the cpu linear and swiglu on this machine */
PyObject *qk_cpu_isa_py(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    (void)module;
    return PyUnicode_FromString(qk_cpu_isa_names[qk_cpu_isa_best()]);
}
