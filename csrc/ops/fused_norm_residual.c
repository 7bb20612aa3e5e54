/* fused_norm_residual(x, residual, gamma, beta, *, p=0.0, training=False, eps=1e-5, seed=None,
 *                     out=None, stream=None) */
#include "../qk.h"
#include "../cpu/cpu.h"

#include <math.h>
#include <stdatomic.h>
#include <time.h>

#define OP "fused_norm_residual"

QK_DOCS(fused_norm_residual, "x, residual, gamma, beta, *, p=0.0, training=False, eps=1e-5, seed=None, out=None",
    "LayerNorm over the last dim (population variance, two-pass), * gamma + beta, dropout with\n"
    "probability p when training (kept values scaled by 1/(1-p)), + residual.  x, residual [R, H];\n"
    "gamma, beta [H].  The dropout mask is a Philox4x32-10 draw keyed by (seed, r * H + h): the same\n"
    "on cpu and cuda for the same seed; seed=None draws a fresh one.\n" QK_GRAPH_DOC)

/* seed=None: a fresh seed per call (splitmix64 of a process counter and the clock). */
static uint64_t nr_fresh_seed(void) {
    static atomic_ullong counter;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t z = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^
                 (atomic_fetch_add(&counter, 1) * 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static int nr_float_arg(PyObject *obj, const char *arg, double dflt, double *v) {
    *v = dflt;
    if (obj == NULL || obj == Py_None) return 0;
    *v = PyFloat_AsDouble(obj);
    if (*v == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, OP ": %s must be a float, got %.200s", arg, Py_TYPE(obj)->tp_name);
        return -1;
    }
    return 0;
}

PyObject *qk_op_fused_norm_residual(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"x", "residual", "gamma", "beta", "p", "training", "eps", "seed", "out",
                                        "stream", NULL};
    static const char *const in_names[] = {"x", "residual", "gamma", "beta"};
    qk_state *st = qk_get_state(module);
    PyObject *a[10] = {NULL};
    if (qk_parse_args(OP, args, nargs, kwnames, names, 4, 4, a) < 0) return NULL;
    void *stream;
    int stream_given;
    if (qk_stream_arg(OP, a[9], &stream, &stream_given) < 0) return NULL;
    double p, eps;
    if (nr_float_arg(a[4], "p", 0.0, &p) < 0 || nr_float_arg(a[6], "eps", 1e-5, &eps) < 0) return NULL;
    if (!(p >= 0.0 && p <= 1.0)) {
        PyErr_Format(PyExc_ValueError, OP ": p must be in [0, 1], got %R", a[4]);
        return NULL;
    }
    if (!(eps >= 0.0) || isinf((float)eps)) { /* the kernels add eps in float32 */
        PyErr_Format(PyExc_ValueError, OP ": eps must be a finite value >= 0, got %R", a[6]);
        return NULL;
    }
    int training = a[5] ? PyObject_IsTrue(a[5]) : 0;
    if (training < 0) { /* e.g. a NumPy array of several elements: name the op and the argument */
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, OP ": training must be a bool, got %.200s", Py_TYPE(a[5])->tp_name);
        return NULL;
    }
    uint64_t seed = 0;
    if (a[7] && a[7] != Py_None) {
        if (!PyLong_Check(a[7])) {
            PyErr_Format(PyExc_TypeError, OP ": seed must be an int or None, got %.200s", Py_TYPE(a[7])->tp_name);
            return NULL;
        }
        seed = PyLong_AsUnsignedLongLongMask(a[7]); /* any int; its low 64 bits key the generator */
        if (seed == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    } else if (training && p > 0) {
        seed = nr_fresh_seed();
    }

    qk_view in[4] = {{0}}, ov = {0};
    qk_output o = {0};
    qk_launch l = {0};
    int ok = 0, launched = 0, n_in = 0;
    for (; n_in < 4; n_in++)
        if (qk_import(st, a[n_in], OP, in_names[n_in], stream, &in[n_in]) < 0) goto done;
    if (qk_same_device(OP, in, in_names, 4) < 0) goto done;
    if (qk_check_ndim(OP, "x", &in[0], 2, "[R, H]") < 0 || qk_check_ndim(OP, "residual", &in[1], 2, "[R, H]") < 0 ||
        qk_check_ndim(OP, "gamma", &in[2], 1, "[H]") < 0 || qk_check_ndim(OP, "beta", &in[3], 1, "[H]") < 0)
        goto done;
    if (qk_check_dtype_float(OP, "x", &in[0]) < 0) goto done;
    for (int i = 1; i < 4; i++)
        if (qk_check_same_dtype(OP, in_names[i], &in[i], "x's", &in[0]) < 0) goto done;
    const int64_t R = in[0].shape[0], H = in[0].shape[1];
    char layout[96];
    snprintf(layout, sizeof layout, "[R, H] = [%lld, %lld]", (long long)R, (long long)H);
    if (qk_check_dim(OP, "residual", &in[1], 0, R, layout) < 0 || qk_check_dim(OP, "residual", &in[1], 1, H, layout) < 0)
        goto done;
    snprintf(layout, sizeof layout, "[H] = [%lld]", (long long)H);
    if (qk_check_dim(OP, "gamma", &in[2], 0, H, layout) < 0 || qk_check_dim(OP, "beta", &in[3], 0, H, layout) < 0)
        goto done;
    if (qk_launch_begin(st, OP, &in[0], stream, stream_given, &l) < 0) goto done;
    launched = 1;
    const int64_t shape[2] = {R, H};
    if (qk_output_prepare(st, OP, a[8], &in[0], in[0].dtype, 2, shape, &l, &ov, &o) < 0 ||
        qk_out_overlap(OP, &ov, in, in_names, n_in, 1u << 0 | 1u << 1) < 0) /* out=x, out=residual */
        goto done;

    qk_fused_norm_residual_args nr = {0};
    nr.x = in[0].data;
    nr.residual = in[1].data;
    nr.gamma = in[2].data;
    nr.beta = in[3].data;
    nr.out = ov.data;
    nr.R = R;
    nr.H = H;
    for (int i = 0; i < 2; i++) {
        nr.x_stride[i] = in[0].strides[i];
        nr.res_stride[i] = in[1].strides[i];
        nr.out_stride[i] = ov.strides[i];
    }
    nr.gamma_stride = in[2].strides[0];
    nr.beta_stride = in[3].strides[0];
    nr.eps = (float)eps;
    nr.training = training && p > 0;
    /* drop when the 32-bit draw < p * 2^32; p = 1 drops everything (scale 0 zeroes the lone survivor) */
    const double thr = ldexp(p, 32);
    nr.drop_threshold = thr >= 4294967295.0 ? 0xFFFFFFFFu : (uint32_t)thr;
    nr.scale = p < 1.0 ? (float)(1.0 / (1.0 - p)) : 0.f;
    nr.seed = seed;
    nr.dtype = in[0].dtype;
    nr.num_threads = st->num_threads;
    int status = QK_OK;
    if (R > 0 && H > 0) QK_RUN(status, &l, fused_norm_residual, &nr);
    if (status) qk_raise_status(OP, status);
    else ok = 1;
done:
    return qk_op_finish(&l, launched, &o, &ov, ok, in, n_in);
}
