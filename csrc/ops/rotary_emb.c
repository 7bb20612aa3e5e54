/* rotary_emb(x, freqs_cis, *, interleaved=True, out=None, stream=None) and
 * rotary_emb_backward(grad_out, freqs_cis, *, interleaved=True, stream=None): argument checks, then
 * the CPU or CUDA launcher by device.  In place when out is x.  The backward op runs the same
 * launcher with qk_rotary_emb_args.inverse set: a rotation's gradient is the rotation by -angle. */
#include "../qk.h"
#include "../cpu/cpu.h"

QK_DOCS(rotary_emb, "x, freqs_cis, *, interleaved=True, out=None",
    "Rotary position embedding.\n\n"
    "x [T, H, D] or [B, S, H, D] (D even), freqs_cis float32 [T, D/2, 2] or [B, S, D/2, 2] holding\n"
    "(cos, sin) per pair.  interleaved=True rotates pairs (x[2i], x[2i+1]); False the rotate-half (NeoX)\n"
    "pairs (x[i], x[i + D/2]): (xe*c - xo*s, xe*s + xo*c) in fp32, rounded once.  In place with out=x.\n"
    QK_DENSE_DOC)

QK_DOCS(rotary_emb_backward, "grad_out, freqs_cis, *, interleaved=True",
    "The gradient of rotary_emb with respect to x: grad_out rotated by the negated angles.\n\n"
    "grad_out [T, H, D] or [B, S, H, D], freqs_cis as for rotary_emb -> grad_x of grad_out's shape and\n"
    "dtype: (ge*c + go*s, go*c - ge*s) per pair, in fp32, rounded once (the transpose of the rotation).\n"
    "Deterministic.  " QK_DENSE_DOC)

/* a[] of both ops: 0 x (grad_out), 1 freqs_cis, 2 interleaved, 3 out (forward only), 4 stream */
static PyObject *ro_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int backward) {
    static const char *const fwd_names[] = {"x", "freqs_cis", "interleaved", "out", "stream", NULL};
    static const char *const bwd_names[] = {"grad_out", "freqs_cis", "interleaved", "stream", NULL};
    const char *const OP = backward ? "rotary_emb_backward" : "rotary_emb";
    const char *const *in_names = backward ? bwd_names : fwd_names;
    const char *const X = in_names[0];
    qk_state *st = qk_get_state(module);
    PyObject *p[5] = {NULL}, *a[5] = {NULL};
    if (qk_parse_args(OP, args, nargs, kwnames, in_names, 2, 2, p) < 0) return NULL;
    a[0] = p[0], a[1] = p[1], a[2] = p[2];
    a[3] = backward ? NULL : p[3];
    a[4] = backward ? p[3] : p[4];
    void *stream;
    int stream_given, interleaved;
    if (qk_stream_arg(OP, a[4], &stream, &stream_given) < 0 ||
        qk_bool_arg(OP, "interleaved", a[2], 1, &interleaved) < 0)
        return NULL;

    qk_view in[2] = {{0}}, ov = {0};
    qk_output o = {0};
    qk_launch l = {0};
    int ok = 0, launched = 0, n_in = 0;
    if (qk_import_all(st, OP, a, in_names, 2, stream, in, &n_in) < 0) goto done;
    qk_view *x = &in[0], *f = &in[1];
    const int batched = x->ndim == 4;
    if (x->ndim != 3 && x->ndim != 4) {
        char got[160];
        qk_shape_str(got, sizeof got, x->shape, x->ndim);
        PyErr_Format(PyExc_ValueError, "%s: %s must have 3 or 4 dimensions [T, H, D] or [B, S, H, D], got shape %s", OP,
                     X, got);
        goto done;
    }
    if (qk_check_dtype_llm(OP, X, x) < 0) goto done;
    if (f->dtype != QK_F32) {
        PyErr_Format(PyExc_TypeError, "%s: freqs_cis must be float32, got %s", OP, qk_dtype_name(f->dtype));
        goto done;
    }
    const int64_t B = batched ? x->shape[0] : 1, S = x->shape[x->ndim - 3], H = x->shape[x->ndim - 2],
                  D = x->shape[x->ndim - 1];
    if (D % 2) {
        PyErr_Format(PyExc_ValueError, "%s: %s's last dimension D = %lld must be even (pairs are rotated)", OP, X,
                     (long long)D);
        goto done;
    }
    /* freqs_cis's layout, [B, S, D/2, 2] or [T, D/2, 2], and the values it prints */
    const char *const layout = batched ? "[B, S, D/2, 2] = [%lld, %lld, %lld, 2]" : "[T, D/2, 2] = [%lld, %lld, 2]";
    const long long l0 = batched ? (long long)B : (long long)S, l1 = batched ? (long long)S : (long long)(D / 2),
                    l2 = (long long)(D / 2);
    if (qk_check_ndim(OP, "freqs_cis", f, x->ndim, layout, l0, l1, l2) < 0) goto done;
    const int64_t want[4] = {B, S, D / 2, 2};
    for (int i = 0; i < f->ndim; i++)
        if (qk_check_dim(OP, "freqs_cis", f, i, want[4 - f->ndim + i], layout, l0, l1, l2) < 0) goto done;
    if (qk_check_inner_unit(OP, X, x) < 0 || qk_check_inner_unit(OP, "freqs_cis", f) < 0) goto done;
    if (qk_launch_begin(st, OP, x, stream, stream_given, &l) < 0) goto done;
    launched = 1;
    if (qk_output_prepare(st, OP, a[3], x, x->dtype, x->ndim, x->shape, &l, &ov, &o) < 0 ||
        qk_out_overlap(OP, &ov, in, in_names, 2, 1u << 0) < 0) /* out=x; the backward op has no out */
        goto done;
    if (qk_check_inner_unit(OP, "out", &ov) < 0) goto done;

    qk_rotary_emb_args ra = {0};
    ra.x = x->data;
    ra.out = ov.data;
    ra.freqs = (const float *)f->data;
    ra.B = B;
    ra.S = S;
    ra.H = H;
    ra.D = D;
    const int lead = batched ? 0 : 1; /* a 3-D x is one batch: its b stride is never used */
    for (int i = 0; i < 3; i++) {
        ra.x_stride[i] = i < lead ? 0 : x->strides[i - lead];
        ra.out_stride[i] = i < lead ? 0 : ov.strides[i - lead];
        ra.f_stride[i] = i < lead ? 0 : f->strides[i - lead];
    }
    ra.interleaved = interleaved;
    ra.inverse = backward;
    ra.dtype = x->dtype;
    ra.num_threads = st->num_threads;
    int status = QK_OK;
    if (B > 0 && S > 0 && H > 0 && D > 0) QK_RUN(status, &l, rotary_emb, &ra);
    if (status) qk_raise_status(OP, status);
    else ok = 1;
done:
    return qk_op_finish(&l, launched, &o, &ov, ok, in, n_in);
}

PyObject *qk_op_rotary_emb(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return ro_op(module, args, nargs, kwnames, 0);
}

PyObject *qk_op_rotary_emb_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return ro_op(module, args, nargs, kwnames, 1);
}
