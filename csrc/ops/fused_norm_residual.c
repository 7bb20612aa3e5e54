/* fused_norm_residual(x, residual, gamma, beta, *, p=0.0, training=False, eps=1e-5, seed=None,
 *                     batch=None, num_graphs=None, out=None, stream=None) */
#include "../qk.h"
#include "../cpu/cpu.h"

#include <math.h>
#include <stdatomic.h>
#include <time.h>

#define OP "fused_norm_residual"

QK_DOCS(fused_norm_residual,
    "x, residual, gamma, beta, *, p=0.0, training=False, eps=1e-5, seed=None, batch=None, num_graphs=None, out=None",
    "LayerNorm over the last dim (population variance, two-pass), * gamma + beta, dropout with\n"
    "probability p when training (kept values scaled by 1/(1-p)), + residual.  x, residual [R, H];\n"
    "gamma, beta [H].  The dropout mask is a Philox4x32-10 draw keyed by (seed, r * H + h): the same\n"
    "on cpu and cuda for the same seed.  seed is an int (its low 64 bits), a one-element int64 tensor\n"
    "on x's device (shape [] or [1]; read when the kernel runs, never copied to the host, so a\n"
    "captured CUDA graph replayed after the tensor changes uses the new value), or None (a fresh\n"
    "seed per call).  With batch ([R] int32/int64 graph ids in [0, num_graphs), on x's device) the\n"
    "statistics are per graph over all its rows and channels, as PyG's LayerNorm(mode=\"graph\"):\n"
    "y = (x - mean_g) / sqrt(var_g + eps) * gamma + beta (eps on the variance), then dropout and\n"
    "residual as above; num_graphs is then required.  Sorted batch is the fast path; unsorted is\n"
    "right too.  Deterministic.  On cuda a row whose id is out of range gets out = residual.\n" QK_GRAPH_DOC)

QK_DOCS(fused_norm_residual_backward,
    "grad_out, x, gamma, *, p=0.0, training=False, eps=1e-5, seed=None, batch=None, num_graphs=None",
    "Gradients of fused_norm_residual -> (grad_x [R, H], grad_gamma [H], grad_beta [H]).  grad_out\n"
    "[R, H] is the gradient of the forward's output; the residual's gradient is grad_out itself, so\n"
    "it is not returned (the caller uses grad_out).  p, training, eps and seed must be the forward's:\n"
    "the dropout mask is regenerated from the seed (an int or the forward's int64 tensor), and seed\n"
    "is required when training with p > 0.  Mean and rstd are recomputed from x.  With\n"
    "xhat = (x - mean) * rstd and g = grad_out * mask / (1 - p) (training) or grad_out:\n"
    "grad_x = rstd * (g*gamma - mean_h(g*gamma) - xhat * mean_h(g*gamma*xhat)),\n"
    "grad_gamma = sum_r g*xhat, grad_beta = sum_r g (fp32 accumulation, in gamma's dtype).  The\n"
    "column sums are deterministic (fixed-order partial sums, no float atomics).  batch and\n"
    "num_graphs must be the forward's: mean, rstd, mean_h are then per graph, over all its rows and\n"
    "channels (on cuda a row whose id is out of range gets grad_x = 0 and adds nothing).\n" QK_GRAPH_DOC)

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

/* The dropout and normalisation keywords shared by the forward and the backward: p, training, eps. */
static int nr_options(const char *op, PyObject *p_obj, PyObject *training_obj, PyObject *eps_obj, double *p,
                      int *training, double *eps) {
    if (qk_float_arg(op, "p", p_obj, 0.0, p) < 0 || qk_float_arg(op, "eps", eps_obj, 1e-5, eps) < 0) return -1;
    if (!(*p >= 0.0 && *p <= 1.0)) {
        PyErr_Format(PyExc_ValueError, "%s: p must be in [0, 1], got %R", op, p_obj);
        return -1;
    }
    if (qk_eps_check(op, *eps, eps_obj) < 0) return -1;
    return qk_bool_arg(op, "training", training_obj, 0, training);
}

/* Both ops' arguments: n required tensors, then p, training, eps (nr_options) and stream at a[stream_at]. */
static int nr_args(const char *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                   const char *const *names, int n, int stream_at, PyObject **a, void **stream, int *stream_given,
                   double *p, int *training, double *eps) {
    return qk_parse_args(op, args, nargs, kwnames, names, n, n, a) < 0 ||
                   qk_stream_arg(op, a[stream_at], stream, stream_given) < 0 ||
                   nr_options(op, a[n], a[n + 1], a[n + 2], p, training, eps) < 0
               ? -1
               : 0;
}

/* seed=: an int (its low 64 bits key the generator; 1 is returned), None (0), or a tensor (2),
 * imported into *sv for the caller to check (nr_seed_check) once the device is known. */
static int nr_seed_arg(qk_state *st, const char *op, PyObject *obj, void *stream, uint64_t *seed, qk_view *sv) {
    if (obj == NULL || obj == Py_None) return 0;
    if (PyLong_Check(obj)) {
        *seed = PyLong_AsUnsignedLongLongMask(obj);
        if (*seed == (uint64_t)-1 && PyErr_Occurred()) return -1;
        return 1;
    }
    if (!qk_is_tensor(st, obj) && !PyCapsule_CheckExact(obj) && !PyObject_HasAttr(obj, st->str_dlpack)) {
        PyErr_Format(PyExc_TypeError, "%s: seed must be an int, a one-element int64 tensor or None, got %.200s", op,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    return qk_import(st, obj, op, "seed", stream, sv) < 0 ? -1 : 2;
}

static int nr_seed_check(const char *op, const qk_view *sv) {
    if (sv->dtype != QK_I64) {
        PyErr_Format(PyExc_TypeError, "%s: seed must be an int64 tensor, got %s", op, qk_dtype_name(sv->dtype));
        return -1;
    }
    if (sv->ndim > 1 || (sv->ndim == 1 && sv->shape[0] != 1)) {
        char got[160];
        qk_shape_str(got, sizeof got, sv->shape, sv->ndim);
        PyErr_Format(PyExc_ValueError, "%s: seed must hold one element (shape [] or [1]), got shape %s", op, got);
        return -1;
    }
    return 0;
}

/* batch= and num_graphs=: neither (0), or batch imported into *bv with *G set (1); -1 with an exception. */
static int nr_batch_arg(qk_state *st, const char *op, PyObject *batch_obj, PyObject *ng_obj, void *stream,
                        qk_view *bv, int64_t *G) {
    const int has_batch = batch_obj && batch_obj != Py_None, has_ng = ng_obj && ng_obj != Py_None;
    if (!has_batch) {
        if (has_ng) {
            PyErr_Format(PyExc_ValueError, "%s: num_graphs is given without batch", op);
            return -1;
        }
        return 0;
    }
    if (!has_ng) {
        PyErr_Format(PyExc_ValueError, "%s: batch needs num_graphs (the number of graphs, an int >= 1)", op);
        return -1;
    }
    const long long g = qk_num_graphs_arg(op, ng_obj, 64);
    if (g < 0) return -1;
    *G = g;
    return qk_import(st, batch_obj, op, "batch", stream, bv) < 0 ? -1 : 1;
}

static int nr_batch_check(const char *op, const qk_view *bv, int64_t R, int64_t G) {
    if (qk_check_ndim(op, "batch", bv, 1, "[R]") < 0 || qk_check_dtype_index(op, "batch", bv) < 0 ||
        qk_check_dim(op, "batch", bv, 0, R, "[R] = [%lld]", (long long)R) < 0)
        return -1;
    if (bv->device_type == kDLCUDA && G > INT32_MAX) { /* graph ids are ints in the CUDA kernels' registers */
        PyErr_Format(PyExc_ValueError, "%s: num_graphs must be below 2^31 on cuda, got %lld", op, (long long)G);
        return -1;
    }
    return 0;
}

/* Run the launcher when run; with batch on cuda and QKERNELS_CHECK=1 validate the ids first.  A bad id
 * raises ValueError naming batch and its first bad position; ok = 1 on success. */
#define NR_RUN(ok, st, l, name, args, op, run) \
    QK_RUN_GRAPH_IDS(ok, st, l, name, args, op, run, "batch", (args)->batch, (args)->R, (args)->batch_stride)

/* drop when the 32-bit draw < p * 2^32; p = 1 drops everything (scale 0 zeroes the lone survivor) */
static void nr_dropout(double p, uint32_t *threshold, float *scale) {
    const double thr = ldexp(p, 32);
    *threshold = thr >= 4294967295.0 ? 0xFFFFFFFFu : (uint32_t)thr;
    *scale = p < 1.0 ? (float)(1.0 / (1.0 - p)) : 0.f;
}

/* What both ops import after their n leading tensors (in_names[0..n)): seed= (a[n + 3]) and batch=,
 * num_graphs= (a[n + 4], a[n + 5]), appended to in and in_names as given; then one device for all and
 * the seed tensor checked.  A seed not given for dropout (training with p > 0) is drawn fresh, or with
 * seed_required (the backward, which must regenerate the forward's mask) a ValueError. */
typedef struct {
    int seed_kind, seed_at, batch_kind, batch_at;
    uint64_t seed;
    int64_t G;
} nr_extras;

static int nr_inputs(qk_state *st, const char *op, PyObject **a, int n, void *stream, int dropout, int seed_required,
                     qk_view *in, const char **in_names, int *n_in, nr_extras *x) {
    for (; *n_in < n; (*n_in)++)
        if (qk_import(st, a[*n_in], op, in_names[*n_in], stream, &in[*n_in]) < 0) return -1;
    x->seed_kind = nr_seed_arg(st, op, a[n + 3], stream, &x->seed, &in[*n_in]);
    if (x->seed_kind < 0) return -1;
    if (x->seed_kind == 2) in_names[x->seed_at = (*n_in)++] = "seed";
    if (x->seed_kind == 0 && dropout && seed_required) {
        PyErr_Format(PyExc_ValueError, "%s: seed is required when training with p > 0 (the forward's seed)", op);
        return -1;
    }
    if (x->seed_kind == 0 && dropout) x->seed = nr_fresh_seed();
    x->batch_kind = nr_batch_arg(st, op, a[n + 4], a[n + 5], stream, &in[*n_in], &x->G);
    if (x->batch_kind < 0) return -1;
    if (x->batch_kind == 1) in_names[x->batch_at = (*n_in)++] = "batch";
    if (qk_same_device(op, in, in_names, *n_in) < 0) return -1;
    return x->seed_kind == 2 ? nr_seed_check(op, &in[x->seed_at]) : 0;
}

/* The fields both args structs (forward's, backward's: a macro, as they differ) take from the options
 * and nr_inputs' x; the batch only for R > 0 (nothing to normalise: an empty batch may have no data). */
#define NR_FILL(args, x, in, p, training, eps, R, st)                                                        \
    do {                                                                                                    \
        (args).eps = (float)(eps);                                                                          \
        (args).training = (training) && (p) > 0;                                                            \
        nr_dropout(p, &(args).drop_threshold, &(args).scale);                                               \
        (args).seed = (x).seed;                                                                             \
        (args).seed_ptr = (x).seed_kind == 2 ? (const int64_t *)(in)[(x).seed_at].data : NULL;              \
        (args).dtype = (in)[0].dtype;                                                                       \
        (args).num_threads = (st)->num_threads;                                                             \
        if ((x).batch_kind == 1 && (R) > 0) {                                                               \
            (args).batch = (in)[(x).batch_at].data;                                                         \
            (args).batch_stride = (in)[(x).batch_at].strides[0];                                            \
            (args).index_dtype = (in)[(x).batch_at].dtype;                                                  \
            (args).num_graphs = (x).G;                                                                      \
        }                                                                                                   \
    } while (0)

PyObject *qk_op_fused_norm_residual(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"x", "residual", "gamma", "beta", "p", "training", "eps", "seed", "batch",
                                        "num_graphs", "out", "stream", NULL};
    const char *in_names[6] = {"x", "residual", "gamma", "beta"};
    qk_state *st = qk_get_state(module);
    PyObject *a[12] = {NULL};
    void *stream;
    int stream_given, training;
    double p, eps;
    if (nr_args(OP, args, nargs, kwnames, names, 4, 11, a, &stream, &stream_given, &p, &training, &eps) < 0)
        return NULL;

    qk_view in[6] = {{0}}, ov = {0};
    qk_output o = {0};
    qk_launch l = {0};
    int ok = 0, launched = 0, n_in = 0;
    nr_extras x = {0};
    if (nr_inputs(st, OP, a, 4, stream, training && p > 0, 0, in, in_names, &n_in, &x) < 0) goto done;
    if (qk_check_ndim(OP, "x", &in[0], 2, "[R, H]") < 0 || qk_check_ndim(OP, "residual", &in[1], 2, "[R, H]") < 0 ||
        qk_check_ndim(OP, "gamma", &in[2], 1, "[H]") < 0 || qk_check_ndim(OP, "beta", &in[3], 1, "[H]") < 0)
        goto done;
    if (qk_check_dtype_float(OP, "x", &in[0]) < 0) goto done;
    for (int i = 1; i < 4; i++)
        if (qk_check_same_dtype(OP, in_names[i], &in[i], "x's", &in[0]) < 0) goto done;
    const int64_t R = in[0].shape[0], H = in[0].shape[1];
    const long long r_ = (long long)R, h_ = (long long)H;
    if (qk_check_dim(OP, "residual", &in[1], 0, R, "[R, H] = [%lld, %lld]", r_, h_) < 0 ||
        qk_check_dim(OP, "residual", &in[1], 1, H, "[R, H] = [%lld, %lld]", r_, h_) < 0 ||
        qk_check_dim(OP, "gamma", &in[2], 0, H, "[H] = [%lld]", h_) < 0 ||
        qk_check_dim(OP, "beta", &in[3], 0, H, "[H] = [%lld]", h_) < 0)
        goto done;
    if (x.batch_kind == 1 && nr_batch_check(OP, &in[x.batch_at], R, x.G) < 0) goto done;
    if (qk_launch_begin(st, OP, &in[0], stream, stream_given, &l) < 0) goto done;
    launched = 1;
    const int64_t shape[2] = {R, H};
    if (qk_output_prepare(st, OP, a[10], &in[0], in[0].dtype, 2, shape, &l, &ov, &o) < 0 ||
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
    NR_FILL(nr, x, in, p, training, eps, R, st);
    /* H = 0 in graph mode: the cpu launcher still checks the ids */
    NR_RUN(ok, st, &l, fused_norm_residual, &nr, OP, R > 0 && (H > 0 || nr.batch));
done:
    return qk_op_finish(&l, launched, &o, &ov, ok, in, n_in);
}

#undef OP
#define OP "fused_norm_residual_backward"

PyObject *qk_op_fused_norm_residual_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                             PyObject *kwnames) {
    static const char *const names[] = {"grad_out", "x", "gamma", "p", "training", "eps", "seed", "batch", "num_graphs",
                                        "stream", NULL};
    const char *in_names[5] = {"grad_out", "x", "gamma"};
    qk_state *st = qk_get_state(module);
    PyObject *a[10] = {NULL};
    void *stream;
    int stream_given, training;
    double p, eps;
    if (nr_args(OP, args, nargs, kwnames, names, 3, 9, a, &stream, &stream_given, &p, &training, &eps) < 0)
        return NULL;

    qk_view in[5] = {{0}}, ov[3] = {{0}};
    qk_output o[3] = {{0}};
    qk_launch l = {0};
    int ok = 0, launched = 0, n_in = 0;
    nr_extras x = {0};
    if (nr_inputs(st, OP, a, 3, stream, training && p > 0, 1, in, in_names, &n_in, &x) < 0) goto done;
    if (qk_check_ndim(OP, "grad_out", &in[0], 2, "[R, H]") < 0 || qk_check_ndim(OP, "x", &in[1], 2, "[R, H]") < 0 ||
        qk_check_ndim(OP, "gamma", &in[2], 1, "[H]") < 0)
        goto done;
    if (qk_check_dtype_float(OP, "grad_out", &in[0]) < 0 ||
        qk_check_same_dtype(OP, "x", &in[1], "grad_out's", &in[0]) < 0 ||
        qk_check_same_dtype(OP, "gamma", &in[2], "grad_out's", &in[0]) < 0)
        goto done;
    const int64_t R = in[1].shape[0], H = in[1].shape[1];
    const long long r_ = (long long)R, h_ = (long long)H;
    if (qk_check_dim(OP, "grad_out", &in[0], 0, R, "[R, H] = [%lld, %lld]", r_, h_) < 0 ||
        qk_check_dim(OP, "grad_out", &in[0], 1, H, "[R, H] = [%lld, %lld]", r_, h_) < 0 ||
        qk_check_dim(OP, "gamma", &in[2], 0, H, "[H] = [%lld]", h_) < 0)
        goto done;
    if (x.batch_kind == 1 && nr_batch_check(OP, &in[x.batch_at], R, x.G) < 0) goto done;
    if (qk_launch_begin(st, OP, &in[0], stream, stream_given, &l) < 0) goto done;
    launched = 1;
    const int64_t shape[2] = {R, H};
    if (qk_output_prepare(st, OP, NULL, &in[1], in[1].dtype, 2, shape, &l, &ov[0], &o[0]) < 0 ||
        qk_output_prepare(st, OP, NULL, &in[2], in[2].dtype, 1, &shape[1], &l, &ov[1], &o[1]) < 0 ||
        qk_output_prepare(st, OP, NULL, &in[2], in[2].dtype, 1, &shape[1], &l, &ov[2], &o[2]) < 0)
        goto done;

    qk_fused_norm_residual_backward_args nb = {0};
    nb.grad_out = in[0].data;
    nb.x = in[1].data;
    nb.gamma = in[2].data;
    nb.grad_x = ov[0].data;
    nb.grad_gamma = ov[1].data;
    nb.grad_beta = ov[2].data;
    nb.R = R;
    nb.H = H;
    for (int i = 0; i < 2; i++) {
        nb.go_stride[i] = in[0].strides[i];
        nb.x_stride[i] = in[1].strides[i];
        nb.gx_stride[i] = ov[0].strides[i];
    }
    nb.gamma_stride = in[2].strides[0];
    nb.gg_stride = ov[1].strides[0];
    nb.gb_stride = ov[2].strides[0];
    NR_FILL(nb, x, in, p, training, eps, R, st); /* R = 0: the row mode's zero column sums */
    /* R = 0: zero column sums; H = 0 in graph mode: the cpu launcher still checks the ids */
    NR_RUN(ok, st, &l, fused_norm_residual_backward, &nb, OP, H > 0 || nb.batch);
done:
    return qk_op_finish_many(&l, launched, o, ov, 3, ok, in, n_in);
}
