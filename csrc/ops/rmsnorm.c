/* rmsnorm(x, weight, *, eps=1e-06, out=None, stream=None) and
 * fused_add_rmsnorm(x, residual, weight, *, eps=1e-06, out=None, stream=None): argument checks, the
 * leading dimensions collapsed to at most two strided row dimensions, then the CPU or CUDA launcher
 * by device.  fused_add_rmsnorm writes residual + x into residual (a torch residual's version moves,
 * as an in-place torch op's does).  out may be x itself (the in-place form); it never overlaps
 * residual, and residual never overlaps x.  The raw ops also take the private keyword _variant=
 * ("auto", "rows", "block", "reread": qk_rmsnorm_args.variant). */
#include "../qk.h"
#include "../cpu/cpu.h"

#include <math.h>

QK_DOCS(rmsnorm, "x, weight, *, eps=1e-06, out=None",
    "RMSNorm over the last dimension.\n\n"
    "x [*, H], weight [H] -> [*, H]: x * rsqrt(mean(x^2) + eps) * weight, in fp32, rounded once.  float32,\n"
    "float16 or bfloat16 on cpu and cuda, weight of x's dtype; x's last dimension unit-stride, rows may be\n"
    "strided.  In place with out=x.  backend= picks cuda or cpu (see qkernels.explain).")

QK_DOCS(fused_add_rmsnorm, "x, residual, weight, *, eps=1e-06, out=None",
    "Residual add and RMSNorm: residual += x in place, then the norm of the sum.\n\n"
    "x, residual [*, H], weight [H] -> [*, H].  s = x + residual in fp32; residual is overwritten with s\n"
    "rounded once to its dtype, and the result is s * rsqrt(mean(s^2) + eps) * weight of the unrounded s\n"
    "(FlashInfer's fused_add_rmsnorm; it writes the result into x, which out=x does here).  float32,\n"
    "float16 or bfloat16 on cpu and cuda, all of one dtype; last dimensions unit-stride.  out may be x,\n"
    "never residual.  backend= picks cuda or cpu (see qkernels.explain).")

static const char *const rn_variants[] = {[QK_RMSNORM_AUTO] = "auto", [QK_RMSNORM_ROWS] = "rows",
                                          [QK_RMSNORM_BLOCK] = "block", [QK_RMSNORM_REREAD] = "reread"};

/* eps: a number >= 0 that stays finite in float32 (the kernels add it in fp32). */
static int rn_eps(const char *op, PyObject *obj, float *eps) {
    double v = 1e-6;
    if (obj && obj != Py_None) {
        if (PyBool_Check(obj) || !(PyFloat_Check(obj) || PyLong_Check(obj))) {
            PyErr_Format(PyExc_TypeError, "%s: eps must be a float, got %.200s", op, Py_TYPE(obj)->tp_name);
            return -1;
        }
        v = PyFloat_AsDouble(obj);
        if (v == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s: eps must be a finite value >= 0, got %R", op, obj);
            return -1;
        }
    }
    if (!(v >= 0.0) || isinf((float)v)) {
        PyErr_Format(PyExc_ValueError, "%s: eps must be a finite value >= 0 (in float32), got %R", op,
                     obj ? obj : Py_None);
        return -1;
    }
    *eps = (float)v;
    return 0;
}

/* float32, float16 or bfloat16 on either device */
static int rn_check_float(const char *op, const char *arg, const qk_view *v) {
    if (v->dtype == QK_F32 || v->dtype == QK_F16 || v->dtype == QK_BF16) return 0;
    PyErr_Format(PyExc_TypeError, "%s: %s must be float32, float16 or bfloat16, got %s", op, arg,
                 qk_dtype_name(v->dtype));
    return -1;
}

/* [lo, hi) bytes a view can touch (empty when it has no elements). */
static void rn_span(const qk_view *v, uintptr_t *lo, uintptr_t *hi) {
    int64_t first = 0, last = 0;
    for (int i = 0; i < v->ndim; i++) {
        if (v->shape[i] == 0) {
            *lo = *hi = 0;
            return;
        }
        const int64_t step = (v->shape[i] - 1) * v->strides[i];
        if (step < 0) first += step;
        else last += step;
    }
    const int64_t size = (int64_t)qk_dtype_size(v->dtype);
    *lo = (uintptr_t)v->data + (uintptr_t)(first * size);
    *hi = (uintptr_t)v->data + (uintptr_t)((last + 1) * size);
}

static int rn_overlap(const qk_view *a, const qk_view *b) {
    uintptr_t alo, ahi, blo, bhi;
    rn_span(a, &alo, &ahi);
    rn_span(b, &blo, &bhi);
    return alo < ahi && blo < bhi && alo < bhi && blo < ahi;
}

/* The leading dimensions of the n views (same shape) as at most two row dimensions {R0, R1} with
 * per-view strides: size-1 dimensions dropped, neighbours merged where every view steps evenly across
 * them.  -1 (no exception) when more than two remain. */
static int rn_rows(const qk_view *v, int n, int64_t *R0, int64_t *R1, int64_t (*strides)[2]) {
    int64_t shape[QK_MAX_DIMS], st[3][QK_MAX_DIMS];
    int k = 0;
    for (int d = 0; d < v[0].ndim - 1; d++) {
        if (v[0].shape[d] == 1) continue;
        if (k > 0) {
            int merge = 1;
            for (int i = 0; i < n; i++) merge &= st[i][k - 1] == v[i].strides[d] * v[0].shape[d];
            if (merge) {
                shape[k - 1] *= v[0].shape[d];
                for (int i = 0; i < n; i++) st[i][k - 1] = v[i].strides[d];
                continue;
            }
        }
        shape[k] = v[0].shape[d];
        for (int i = 0; i < n; i++) st[i][k] = v[i].strides[d];
        k++;
    }
    if (k > 2) return -1;
    *R0 = k == 2 ? shape[0] : 1;
    *R1 = k >= 1 ? shape[k - 1] : 1;
    for (int i = 0; i < n; i++) {
        strides[i][0] = k == 2 ? st[i][0] : 0;
        strides[i][1] = k >= 1 ? st[i][k - 1] : 0;
    }
    return 0;
}

/* a[]: 0 x, 1 residual (fused only), 2 weight, 3 eps, 4 out, 5 stream, 6 _variant */
static PyObject *rn_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int fused) {
    static const char *const plain_names[] = {"x", "weight", "eps", "out", "stream", "_variant", NULL};
    static const char *const fused_names[] = {"x", "residual", "weight", "eps", "out", "stream", "_variant", NULL};
    const char *const OP = fused ? "fused_add_rmsnorm" : "rmsnorm";
    qk_state *st = qk_get_state(module);
    PyObject *p[7] = {NULL}, *a[7] = {NULL};
    if (qk_parse_args(OP, args, nargs, kwnames, fused ? fused_names : plain_names, 2 + fused, 2 + fused, p) < 0)
        return NULL;
    a[0] = p[0];
    a[1] = fused ? p[1] : NULL;
    for (int i = 2; i < 7; i++) a[i] = p[i - 1 + fused];
    void *stream;
    int stream_given, variant;
    float eps;
    if (qk_stream_arg(OP, a[5], &stream, &stream_given) < 0 ||
        qk_variant_arg(OP, "_variant", a[6], rn_variants, QK_COUNT(rn_variants), &variant) < 0 ||
        rn_eps(OP, a[3], &eps) < 0)
        return NULL;

    /* in[]: x, weight, then residual (fused) */
    const char *in_names[3] = {"x", "weight", "residual"};
    PyObject *in_objs[3] = {a[0], a[2], a[1]};
    const int n_want = 2 + fused;
    qk_view in[3] = {{0}}, ov = {0};
    qk_output o = {0};
    qk_launch l = {0};
    int ok = 0, launched = 0, n_in = 0;
    if (qk_import_all(st, OP, in_objs, in_names, n_want, stream, in, &n_in) < 0) goto done;
    qk_view *x = &in[0], *w = &in[1], *res = fused ? &in[2] : NULL;
    if (x->ndim < 1) {
        PyErr_Format(PyExc_ValueError, "%s: x must have at least one dimension [*, H], got a 0-d tensor", OP);
        goto done;
    }
    if (rn_check_float(OP, "x", x) < 0 || qk_check_ndim(OP, "weight", w, 1, "[H]") < 0 ||
        qk_check_same_dtype(OP, "weight", w, "x's", x) < 0)
        goto done;
    const int64_t H = x->shape[x->ndim - 1];
    if (qk_check_dim(OP, "weight", w, 0, H, "[H] = [%lld]", (long long)H) < 0 || qk_check_inner_unit(OP, "x", x) < 0) goto done;
    if (fused) {
        if (qk_check_same_dtype(OP, "residual", res, "x's", x) < 0) goto done;
        int same = res->ndim == x->ndim;
        for (int d = 0; same && d < x->ndim; d++) same = res->shape[d] == x->shape[d];
        if (!same) {
            char want[160], got[160];
            qk_shape_str(want, sizeof want, x->shape, x->ndim);
            qk_shape_str(got, sizeof got, res->shape, res->ndim);
            PyErr_Format(PyExc_ValueError, "%s: residual must have x's shape %s, got %s", OP, want, got);
            goto done;
        }
        if (qk_check_inner_unit(OP, "residual", res) < 0) goto done;
        int empty = 0;
        for (int d = 0; d < res->ndim; d++) empty |= res->shape[d] == 0;
        for (int d = 0; d < res->ndim && !empty; d++) {
            if (res->strides[d] == 0 && res->shape[d] > 1) {
                PyErr_Format(PyExc_ValueError,
                             "%s: residual has stride 0 in dimension %d, so its elements overlap, but each is written; "
                             "pass a tensor with distinct elements", OP, d);
                goto done;
            }
        }
        if (res->readonly) {
            PyErr_Format(PyExc_BufferError, "%s: residual is read-only, but residual + x is written into it", OP);
            goto done;
        }
        if (rn_overlap(res, x)) {
            PyErr_Format(PyExc_ValueError, "%s: residual overlaps x in memory, but residual is written while x is "
                         "read; pass separate tensors", OP);
            goto done;
        }
        if (rn_overlap(res, w)) {
            PyErr_Format(PyExc_ValueError, "%s: residual overlaps weight in memory, but residual is written while "
                         "weight is read; pass separate tensors", OP);
            goto done;
        }
    }
    if (qk_launch_begin(st, OP, x, stream, stream_given, &l) < 0) goto done;
    launched = 1;
    if (qk_output_prepare(st, OP, a[4], x, x->dtype, x->ndim, x->shape, &l, &ov, &o) < 0 ||
        qk_out_overlap(OP, &ov, in, in_names, n_in, 1u << 0) < 0 || /* out=x */
        qk_check_inner_unit(OP, "out", &ov) < 0)
        goto done;

    qk_rmsnorm_args ra = {0};
    qk_view rows[3] = {*x, ov, fused ? *res : *x};
    int64_t strides[3][2] = {{0}}, R0 = 0, R1 = 1; /* R = 0 when x is empty: nothing to address */
    int nonempty = 1;
    for (int d = 0; d < x->ndim; d++) nonempty &= x->shape[d] != 0;
    if (nonempty && rn_rows(rows, 2 + fused, &R0, &R1, strides) < 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: the leading dimensions of x%s and out cannot be stepped as two strided row dimensions; pass "
                     "contiguous copies", OP, fused ? ", residual" : "");
        goto done;
    }
    ra.x = x->data;
    ra.out = ov.data;
    ra.weight = w->data;
    ra.residual = fused ? res->data : NULL;
    ra.R = R0 * R1; /* x's element count bounds it: no overflow */
    ra.R1 = R1;
    ra.H = H;
    for (int i = 0; i < 2; i++) {
        ra.x_stride[i] = strides[0][i];
        ra.out_stride[i] = strides[1][i];
        ra.res_stride[i] = fused ? strides[2][i] : 0;
    }
    ra.w_stride = w->strides[0];
    ra.eps = eps;
    ra.dtype = x->dtype;
    ra.num_threads = st->num_threads;
    ra.variant = variant;
    int status = QK_OK;
    if (ra.R > 0 && H > 0) QK_RUN(status, &l, rmsnorm, &ra);
    if (status) {
        qk_raise_status(OP, status);
    } else if (fused && ra.R > 0 && H > 0) {
        PyObject *bump = qk_version_bumper(st, a[1]); /* borrowed */
        ok = 1;
        if (bump) {
            PyObject *tensors = PyTuple_Pack(1, a[1]);
            PyObject *moved = tensors ? PyObject_CallOneArg(bump, tensors) : NULL;
            Py_XDECREF(tensors);
            ok = moved != NULL;
            Py_XDECREF(moved);
        }
    } else {
        ok = 1;
    }
done:
    return qk_op_finish(&l, launched, &o, &ov, ok, in, n_in);
}

PyObject *qk_op_rmsnorm(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return rn_op(module, args, nargs, kwnames, 0);
}

PyObject *qk_op_fused_add_rmsnorm(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return rn_op(module, args, nargs, kwnames, 1);
}
