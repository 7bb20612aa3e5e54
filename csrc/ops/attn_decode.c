/* attn_decode(q, k, v, *, kv_lens=None, mask=None, scale=None, out=None, stream=None)
 * attn_paged_decode(q, k_cache, v_cache, req_to_token, req_pool_indices, kv_indptr, *, new_k=None,
 *                   new_v=None, mask=None, scale=None, out=None, stream=None)
 * One qk_attn_decode_args serves both (paged flag); the CPU or CUDA launcher by device. */
#include "../qk.h"
#include "../cpu/cpu.h"

#include <math.h>

#define AD_GIVEN(obj) ((obj) != NULL && (obj) != Py_None)

/* The kernels read head_dim rows as unit-stride vectors; an empty tensor's strides are arbitrary
 * (NumPy exports 0s). */
static int ad_check_unit(const char *op, const char *arg, const qk_view *v) {
    for (int i = 0; i < v->ndim; i++)
        if (v->shape[i] == 0) return 0;
    return qk_check_inner_unit(op, arg, v);
}

/* cuda reads rows as 16-byte vectors: the data pointer and the stride of every dimension but the
 * last (when it holds more than one row) must be multiples of 16 bytes.  Other layouts are
 * rejected here rather than by the kernel, so the message names the argument. */
static int ad_check_rows16(const char *op, const char *arg, const qk_view *v) {
    if (v->device_type != kDLCUDA) return 0;
    for (int i = 0; i < v->ndim; i++)
        if (v->shape[i] == 0) return 0;
    const int64_t es = (int64_t)qk_dtype_size(v->dtype);
    int ok = ((uintptr_t)v->data % 16) == 0;
    for (int i = 0; i + 1 < v->ndim; i++)
        if (v->shape[i] > 1 && (v->strides[i] * es) % 16) ok = 0;
    if (!ok)
        PyErr_Format(PyExc_ValueError,
                     "%s: %s must have 16-byte aligned rows on cuda (data pointer and outer strides multiples of 16 "
                     "bytes); make it contiguous",
                     op, arg);
    return ok ? 0 : -1;
}

/* A size-1 dimension's stride is never used; 0 keeps the kernel's alignment test off it. */
static int64_t ad_stride(const qk_view *v, int dim) { return v->shape[dim] > 1 ? v->strides[dim] : 0; }

static int ad_check_heads(const char *op, const char *q, const char *k, int64_t Hq, int64_t Hkv, int64_t D,
                          int cuda) {
    if (D < 1) {
        PyErr_Format(PyExc_ValueError, "%s: head_dim must be at least 1, got %s with D = 0", op, q);
        return -1;
    }
    if (Hkv < 1 || Hq % Hkv) {
        PyErr_Format(PyExc_ValueError,
                     "%s: the query heads of %s (Hq = %lld) must be a multiple of the kv heads of %s (Hkv = %lld, "
                     "at least 1)",
                     op, q, (long long)Hq, k, (long long)Hkv);
        return -1;
    }
    if (cuda && D != 32 && D != 64 && D != 128 && D != 256) {
        PyErr_Format(PyExc_ValueError, "%s: head_dim D = %lld is not supported on cuda; expected 32, 64, 128 or 256",
                     op, (long long)D);
        return -1;
    }
    return 0;
}

static int ad_scale(const char *op, PyObject *obj, int64_t D, float *scale) {
    if (obj == NULL || obj == Py_None) {
        *scale = (float)(1.0 / sqrt((double)D));
        return 0;
    }
    const double s = PyFloat_AsDouble(obj);
    if (s == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: scale must be a float or None, got %.200s", op, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (!isfinite(s)) {
        PyErr_Format(PyExc_ValueError, "%s: scale must be finite, got %R", op, obj);
        return -1;
    }
    *scale = (float)s;
    return 0;
}

static int ad_check_mask(const char *op, const qk_view *m, int64_t B, int64_t L, const char *L_name, int allow_3d) {
    if (m->dtype != QK_BOOL) {
        PyErr_Format(PyExc_TypeError, "%s: mask must be bool (True = keep), got %s", op, qk_dtype_name(m->dtype));
        return -1;
    }
    char layout[96];
    if (allow_3d && m->ndim == 3) {
        snprintf(layout, sizeof layout, "[B, 1, %s] = [%lld, 1, %lld]", L_name, (long long)B, (long long)L);
        return qk_check_dim(op, "mask", m, 0, B, layout) < 0 || qk_check_dim(op, "mask", m, 1, 1, layout) < 0 ||
                       qk_check_dim(op, "mask", m, 2, L, layout) < 0
                   ? -1
                   : 0;
    }
    snprintf(layout, sizeof layout, allow_3d ? "[B, %s] or [B, 1, %s]" : "[B, %s]", L_name, L_name);
    if (qk_check_ndim(op, "mask", m, 2, layout) < 0) return -1;
    snprintf(layout, sizeof layout, "[B, %s] = [%lld, %lld]", L_name, (long long)B, (long long)L);
    return qk_check_dim(op, "mask", m, 0, B, layout) < 0 || qk_check_dim(op, "mask", m, 1, L, layout) < 0 ? -1 : 0;
}

static void ad_set_mask(qk_attn_decode_args *a, const qk_view *m) {
    a->mask = m->data;
    a->mask_stride[0] = m->strides[0];
    a->mask_stride[1] = m->strides[m->ndim - 1];
}

/* Import the tensor arguments that were given (None and absent stay zeroed views). */
static int ad_import(qk_state *st, const char *op, PyObject **a, const char *const *names, int n, void *stream,
                     qk_view *in, int *n_in) {
    for (*n_in = 0; *n_in < n; (*n_in)++)
        if (AD_GIVEN(a[*n_in]) && qk_import(st, a[*n_in], op, names[*n_in], stream, &in[*n_in]) < 0)
            return -1;
    qk_view present[16];
    const char *present_names[16];
    int k = 0;
    for (int i = 0; i < n; i++)
        if (AD_GIVEN(a[i])) present[k] = in[i], present_names[k++] = names[i];
    return qk_same_device(op, present, present_names, k);
}

#undef OP
#define OP "attn_decode"

PyObject *qk_op_attn_decode(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"q", "k", "v", "kv_lens", "mask", "scale", "out", "stream", NULL};
    enum { Q, K, V, KV_LENS, MASK, NUM_INPUTS };
    qk_state *st = qk_get_state(module);
    PyObject *a[8] = {NULL};
    if (qk_parse_args(OP, args, nargs, kwnames, names, 3, 3, a) < 0) return NULL;
    void *stream;
    int stream_given;
    if (qk_stream_arg(OP, a[7], &stream, &stream_given) < 0) return NULL;

    qk_view in[NUM_INPUTS] = {{0}}, ov = {0};
    qk_output o = {0};
    qk_launch l = {0};
    int ok = 0, launched = 0, n_in = 0;
    if (ad_import(st, OP, a, names, NUM_INPUTS, stream, in, &n_in) < 0) goto done;
    if (qk_check_ndim(OP, "q", &in[Q], 4, "[B, 1, Hq, D]") < 0 || qk_check_ndim(OP, "k", &in[K], 4, "[B, Lkv, Hkv, D]") < 0 ||
        qk_check_ndim(OP, "v", &in[V], 4, "[B, Lkv, Hkv, D]") < 0 || qk_check_dtype_llm(OP, "q", &in[Q]) < 0 ||
        qk_check_same_dtype(OP, "k", &in[K], "q's", &in[Q]) < 0 || qk_check_same_dtype(OP, "v", &in[V], "q's", &in[Q]) < 0)
        goto done;
    const int64_t B = in[Q].shape[0], Hq = in[Q].shape[2], D = in[Q].shape[3];
    const int64_t Lkv = in[K].shape[1], Hkv = in[K].shape[2];
    char layout[128];
    snprintf(layout, sizeof layout, "[B, 1, Hq, D] = [%lld, 1, %lld, %lld]", (long long)B, (long long)Hq, (long long)D);
    if (qk_check_dim(OP, "q", &in[Q], 1, 1, layout) < 0) goto done;
    snprintf(layout, sizeof layout, "[B, Lkv, Hkv, D] = [%lld, %lld, %lld, %lld]", (long long)B, (long long)Lkv,
             (long long)Hkv, (long long)D);
    if (qk_check_dim(OP, "k", &in[K], 0, B, layout) < 0 || qk_check_dim(OP, "k", &in[K], 3, D, layout) < 0) goto done;
    for (int d = 0; d < 4; d++)
        if (qk_check_dim(OP, "v", &in[V], d, in[K].shape[d], layout) < 0) goto done;
    if (ad_check_heads(OP, "q", "k", Hq, Hkv, D, in[Q].device_type == kDLCUDA) < 0 ||
        ad_check_unit(OP, "q", &in[Q]) < 0 || ad_check_unit(OP, "k", &in[K]) < 0 || ad_check_unit(OP, "v", &in[V]) < 0)
        goto done;
    if (AD_GIVEN(a[KV_LENS])) {
        snprintf(layout, sizeof layout, "[B] = [%lld]", (long long)B);
        if (qk_check_ndim(OP, "kv_lens", &in[KV_LENS], 1, "[B]") < 0 ||
            qk_check_dtype_index(OP, "kv_lens", &in[KV_LENS]) < 0 ||
            qk_check_dim(OP, "kv_lens", &in[KV_LENS], 0, B, layout) < 0)
            goto done;
    }
    if (AD_GIVEN(a[MASK]) && ad_check_mask(OP, &in[MASK], B, Lkv, "Lkv", 1) < 0) goto done;
    if (ad_check_rows16(OP, "q", &in[Q]) < 0 || ad_check_rows16(OP, "k", &in[K]) < 0 ||
        ad_check_rows16(OP, "v", &in[V]) < 0)
        goto done;
    float scale;
    if (ad_scale(OP, a[5], D, &scale) < 0) goto done;
    if (qk_launch_begin(st, OP, &in[Q], stream, stream_given, &l) < 0) goto done;
    launched = 1;
    const int64_t shape[4] = {B, 1, Hq, D};
    if (qk_output_prepare(st, OP, a[6], &in[Q], in[Q].dtype, 4, shape, &l, &ov, &o) < 0 ||
        ad_check_unit(OP, "out", &ov) < 0)
        goto done;

    qk_attn_decode_args ad = {0};
    ad.q = in[Q].data;
    ad.out = ov.data;
    ad.k = in[K].data;
    ad.v = in[V].data;
    ad.B = B;
    ad.Hq = Hq;
    ad.Hkv = Hkv;
    ad.D = D;
    ad.Lkv = Lkv;
    ad.q_stride[0] = ad_stride(&in[Q], 0);
    ad.q_stride[1] = ad_stride(&in[Q], 2);
    ad.out_stride[0] = ov.strides[0];
    ad.out_stride[1] = ov.strides[2];
    for (int i = 0; i < 3; i++) {
        ad.k_stride[i] = ad_stride(&in[K], i);
        ad.v_stride[i] = ad_stride(&in[V], i);
    }
    if (AD_GIVEN(a[KV_LENS])) {
        ad.kv_lens = in[KV_LENS].data;
        ad.kv_lens_stride = in[KV_LENS].strides[0];
        ad.kv_lens_dtype = in[KV_LENS].dtype;
    }
    if (AD_GIVEN(a[MASK])) ad_set_mask(&ad, &in[MASK]);
    ad.scale = scale;
    ad.dtype = in[Q].dtype;
    ad.num_threads = st->num_threads;
    int status = QK_OK;
    if (B > 0 && Hq > 0) QK_RUN(status, &l, attn_decode, qk_attn_decode_cpu, &ad);
    if (status) qk_raise_status(OP, status);
    else ok = 1;
done:
    return qk_op_finish(&l, launched, &o, &ov, ok, in, n_in);
}

#undef OP
#define OP "attn_paged_decode"

static void ad_raise_index(const qk_attn_decode_args *a) {
    if (a->bad_arg == 0)
        PyErr_Format(PyExc_ValueError, OP ": req_pool_indices[%lld] = %lld is out of range for req_to_token with R = %lld rows",
                     (long long)a->bad_pos, (long long)a->bad_value, (long long)a->num_requests);
    else if (a->bad_arg == 1)
        PyErr_Format(PyExc_ValueError,
                     OP ": kv_indptr gives sequence %lld the length kv_indptr[%lld] - kv_indptr[%lld] = %lld, outside "
                        "[0, max_ctx = %lld]",
                     (long long)a->bad_pos, (long long)a->bad_pos + 1, (long long)a->bad_pos, (long long)a->bad_value,
                     (long long)a->max_ctx);
    else
        PyErr_Format(PyExc_ValueError, OP ": req_to_token[%lld, %lld] = %lld is out of range for the KV pool with S = %lld slots",
                     (long long)(a->bad_pos / a->max_ctx), (long long)(a->bad_pos % a->max_ctx), (long long)a->bad_value,
                     (long long)a->pool_size);
}

PyObject *qk_op_attn_paged_decode(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"q", "k_cache", "v_cache", "req_to_token", "req_pool_indices", "kv_indptr",
                                        "new_k", "new_v", "mask", "scale", "out", "stream", NULL};
    enum { Q, KC, VC, R2T, RPI, INDPTR, NEW_K, NEW_V, MASK, NUM_INPUTS };
    qk_state *st = qk_get_state(module);
    PyObject *a[12] = {NULL};
    if (qk_parse_args(OP, args, nargs, kwnames, names, 6, 6, a) < 0) return NULL;
    void *stream;
    int stream_given;
    if (qk_stream_arg(OP, a[11], &stream, &stream_given) < 0) return NULL;
    const int has_new_k = AD_GIVEN(a[NEW_K]), has_new_v = AD_GIVEN(a[NEW_V]);
    if (has_new_k != has_new_v) {
        PyErr_Format(PyExc_TypeError, OP ": new_k and new_v must be given together (got %s without %s)",
                     has_new_k ? "new_k" : "new_v", has_new_k ? "new_v" : "new_k");
        return NULL;
    }

    qk_view in[NUM_INPUTS] = {{0}}, ov = {0};
    qk_output o = {0};
    qk_launch l = {0};
    int ok = 0, launched = 0, n_in = 0;
    if (ad_import(st, OP, a, names, NUM_INPUTS, stream, in, &n_in) < 0) goto done;
    if (qk_check_ndim(OP, "q", &in[Q], 3, "[B, Hq, D]") < 0 ||
        qk_check_ndim(OP, "k_cache", &in[KC], 3, "[S, Hkv, D]") < 0 ||
        qk_check_ndim(OP, "v_cache", &in[VC], 3, "[S, Hkv, D]") < 0 ||
        qk_check_ndim(OP, "req_to_token", &in[R2T], 2, "[R, max_ctx]") < 0 ||
        qk_check_ndim(OP, "req_pool_indices", &in[RPI], 1, "[B]") < 0 ||
        qk_check_ndim(OP, "kv_indptr", &in[INDPTR], 1, "[B + 1]") < 0 || qk_check_dtype_llm(OP, "q", &in[Q]) < 0 ||
        qk_check_same_dtype(OP, "k_cache", &in[KC], "q's", &in[Q]) < 0 ||
        qk_check_same_dtype(OP, "v_cache", &in[VC], "q's", &in[Q]) < 0 ||
        qk_check_dtype_index(OP, "req_to_token", &in[R2T]) < 0 ||
        qk_check_dtype_index(OP, "req_pool_indices", &in[RPI]) < 0 ||
        qk_check_dtype_index(OP, "kv_indptr", &in[INDPTR]) < 0)
        goto done;
    const int64_t B = in[Q].shape[0], Hq = in[Q].shape[1], D = in[Q].shape[2];
    const int64_t S = in[KC].shape[0], Hkv = in[KC].shape[1];
    const int64_t R = in[R2T].shape[0], max_ctx = in[R2T].shape[1];
    char layout[128];
    snprintf(layout, sizeof layout, "[S, Hkv, D] = [%lld, %lld, %lld]", (long long)S, (long long)Hkv, (long long)D);
    if (qk_check_dim(OP, "k_cache", &in[KC], 2, D, layout) < 0) goto done;
    for (int d = 0; d < 3; d++)
        if (qk_check_dim(OP, "v_cache", &in[VC], d, in[KC].shape[d], layout) < 0) goto done;
    snprintf(layout, sizeof layout, "[B] = [%lld]", (long long)B);
    if (qk_check_dim(OP, "req_pool_indices", &in[RPI], 0, B, layout) < 0) goto done;
    snprintf(layout, sizeof layout, "[B + 1] = [%lld]", (long long)B + 1);
    if (qk_check_dim(OP, "kv_indptr", &in[INDPTR], 0, B + 1, layout) < 0) goto done;
    if (ad_check_heads(OP, "q", "k_cache", Hq, Hkv, D, in[Q].device_type == kDLCUDA) < 0 ||
        ad_check_unit(OP, "q", &in[Q]) < 0 || ad_check_unit(OP, "k_cache", &in[KC]) < 0 ||
        ad_check_unit(OP, "v_cache", &in[VC]) < 0)
        goto done;
    if (has_new_k) {
        snprintf(layout, sizeof layout, "[B, Hkv, D] = [%lld, %lld, %lld]", (long long)B, (long long)Hkv, (long long)D);
        static const char *const nn[2] = {"new_k", "new_v"};
        for (int i = 0; i < 2; i++) {
            const qk_view *v = &in[NEW_K + i];
            if (qk_check_ndim(OP, nn[i], v, 3, "[B, Hkv, D]") < 0 || qk_check_same_dtype(OP, nn[i], v, "q's", &in[Q]) < 0 ||
                qk_check_dim(OP, nn[i], v, 0, B, layout) < 0 || qk_check_dim(OP, nn[i], v, 1, Hkv, layout) < 0 ||
                qk_check_dim(OP, nn[i], v, 2, D, layout) < 0 || ad_check_unit(OP, nn[i], v) < 0)
                goto done;
        }
        for (int i = 0; i < 2; i++) {
            if (in[KC + i].readonly) {
                PyErr_Format(PyExc_BufferError, OP ": %s is read-only, but new_k/new_v are written into it",
                             i ? "v_cache" : "k_cache");
                goto done;
            }
        }
    }
    if (AD_GIVEN(a[MASK]) && ad_check_mask(OP, &in[MASK], B, max_ctx, "max_ctx", 0) < 0) goto done;
    if (ad_check_rows16(OP, "q", &in[Q]) < 0 || ad_check_rows16(OP, "k_cache", &in[KC]) < 0 ||
        ad_check_rows16(OP, "v_cache", &in[VC]) < 0 ||
        (AD_GIVEN(a[NEW_K]) && (ad_check_rows16(OP, "new_k", &in[NEW_K]) < 0 || ad_check_rows16(OP, "new_v", &in[NEW_V]) < 0)))
        goto done;
    float scale;
    if (ad_scale(OP, a[9], D, &scale) < 0) goto done;
    if (qk_launch_begin(st, OP, &in[Q], stream, stream_given, &l) < 0) goto done;
    launched = 1;
    const int64_t shape[3] = {B, Hq, D};
    if (qk_output_prepare(st, OP, a[10], &in[Q], in[Q].dtype, 3, shape, &l, &ov, &o) < 0 ||
        ad_check_unit(OP, "out", &ov) < 0)
        goto done;

    qk_attn_decode_args ad = {0};
    ad.paged = 1;
    ad.q = in[Q].data;
    ad.out = ov.data;
    ad.k = in[KC].data;
    ad.v = in[VC].data;
    ad.req_to_token = in[R2T].data;
    ad.req_pool_indices = in[RPI].data;
    ad.kv_indptr = in[INDPTR].data;
    ad.B = B;
    ad.Hq = Hq;
    ad.Hkv = Hkv;
    ad.D = D;
    ad.num_requests = R;
    ad.max_ctx = max_ctx;
    ad.pool_size = S;
    ad.q_stride[0] = ad_stride(&in[Q], 0);
    ad.q_stride[1] = ad_stride(&in[Q], 1);
    ad.out_stride[0] = ov.strides[0];
    ad.out_stride[1] = ov.strides[1];
    ad.k_stride[1] = ad_stride(&in[KC], 0);
    ad.k_stride[2] = ad_stride(&in[KC], 1);
    ad.v_stride[1] = ad_stride(&in[VC], 0);
    ad.v_stride[2] = ad_stride(&in[VC], 1);
    ad.r2t_stride[0] = in[R2T].strides[0];
    ad.r2t_stride[1] = in[R2T].strides[1];
    ad.rpi_stride = in[RPI].strides[0];
    ad.indptr_stride = in[INDPTR].strides[0];
    ad.r2t_dtype = in[R2T].dtype;
    ad.rpi_dtype = in[RPI].dtype;
    ad.indptr_dtype = in[INDPTR].dtype;
    if (has_new_k) {
        ad.new_k = in[NEW_K].data;
        ad.new_v = in[NEW_V].data;
        for (int i = 0; i < 2; i++) {
            ad.new_k_stride[i] = ad_stride(&in[NEW_K], i);
            ad.new_v_stride[i] = ad_stride(&in[NEW_V], i);
        }
    }
    if (AD_GIVEN(a[MASK])) ad_set_mask(&ad, &in[MASK]);
    ad.scale = scale;
    ad.dtype = in[Q].dtype;
    ad.num_threads = st->num_threads;
    int status = QK_OK;
    if (B > 0 && l.device_type == kDLCUDA && st->check_indices) { /* QKERNELS_CHECK=1: the pool rows */
        status = l.cuda->index_check(ad.req_pool_indices, ad.rpi_dtype, B, ad.rpi_stride, 0, R, &ad.bad_pos,
                                     &ad.bad_value, l.stream);
        ad.bad_arg = 0;
    }
    if (B > 0 && status == QK_OK) QK_RUN(status, &l, attn_decode, qk_attn_decode_cpu, &ad);
    if (status == QK_E_INDEX) ad_raise_index(&ad);
    else if (status) qk_raise_status(OP, status);
    else ok = 1;
done:
    return qk_op_finish(&l, launched, &o, &ov, ok, in, n_in);
}
