/* Argument checks shared by the attention bindings (see attn_common.h). */
#include "attn_common.h"

#include <math.h>

int qk_attn_import(qk_state *st, const char *op, PyObject **a, const char *const *names, int nrequired, int n,
                   void *stream,
                   qk_view *in, int *n_in) {
    for (*n_in = 0; *n_in < n; (*n_in)++)
        if ((*n_in < nrequired || QK_GIVEN(a[*n_in])) && /* a required None: TypeError naming it */
            qk_import(st, a[*n_in], op, names[*n_in], stream, &in[*n_in]) < 0)
            return -1;
    qk_view present[16];
    const char *present_names[16];
    int k = 0;
    for (int i = 0; i < n; i++)
        if (QK_GIVEN(a[i])) present[k] = in[i], present_names[k++] = names[i];
    return qk_same_device(op, present, present_names, k);
}

int qk_attn_output(qk_state *st, const char *op, PyObject *out_obj, const qk_view *in, const char *const *names, int n,
                   void *stream, int stream_given, int ndim, const int64_t *shape, int rows16, qk_launch *l,
                   int *launched, qk_view *ov, qk_output *o) {
    if (qk_launch_begin(st, op, &in[0], stream, stream_given, l) < 0) return -1;
    *launched = 1;
    return qk_output_prepare(st, op, out_obj, &in[0], in[0].dtype, ndim, shape, l, ov, o) < 0 ||
                   qk_out_overlap(op, ov, in, names, n, 1u << 0) < 0 || qk_attn_check_unit(op, "out", ov) < 0 ||
                   (rows16 && qk_attn_check_rows16(op, "out", ov) < 0)
               ? -1
               : 0;
}

int qk_attn_check_unit(const char *op, const char *arg, const qk_view *v) {
    for (int i = 0; i < v->ndim; i++)
        if (v->shape[i] == 0) return 0;
    return qk_check_inner_unit(op, arg, v);
}

/* Other layouts are rejected here rather than by the kernel, so the message names the argument. */
int qk_attn_check_rows16(const char *op, const char *arg, const qk_view *v) {
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

int qk_attn_check_heads(const char *op, const char *q, const char *k, int64_t Hq, int64_t Hkv, int64_t D, int cuda) {
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

/* The checks after the shapes, common to both layouts. */
static int attn_check_rows(const char *op, const qk_view *q, const char *k_name, const qk_view *k, const char *v_name,
                           const qk_view *v) {
    const int64_t Hq = q->shape[q->ndim - 2], Hkv = k->shape[k->ndim - 2], D = q->shape[q->ndim - 1];
    return qk_attn_check_heads(op, "q", k_name, Hq, Hkv, D, q->device_type == kDLCUDA) < 0 ||
                   qk_attn_check_unit(op, "q", q) < 0 || qk_attn_check_unit(op, k_name, k) < 0 ||
                   qk_attn_check_unit(op, v_name, v) < 0 || qk_attn_check_rows16(op, "q", q) < 0 ||
                   qk_attn_check_rows16(op, k_name, k) < 0 || qk_attn_check_rows16(op, v_name, v) < 0
               ? -1
               : 0;
}

int qk_attn_check_dense_kv(const char *op, const qk_view *q, const qk_view *k, const qk_view *v) {
    if (qk_check_ndim(op, "k", k, 4, "[B, Lkv, Hkv, D]") < 0 || qk_check_ndim(op, "v", v, 4, "[B, Lkv, Hkv, D]") < 0 ||
        qk_check_same_dtype(op, "k", k, "q's", q) < 0 || qk_check_same_dtype(op, "v", v, "q's", q) < 0)
        return -1;
#define KV_LAYOUT "[B, Lkv, Hkv, D] = [%lld, %lld, %lld, %lld]", (long long)q->shape[0], (long long)k->shape[1], \
                  (long long)k->shape[2], (long long)q->shape[3]
    if (qk_check_dim(op, "k", k, 0, q->shape[0], KV_LAYOUT) < 0 || qk_check_dim(op, "k", k, 3, q->shape[3], KV_LAYOUT) < 0)
        return -1;
    for (int d = 0; d < 4; d++)
        if (qk_check_dim(op, "v", v, d, k->shape[d], KV_LAYOUT) < 0) return -1;
#undef KV_LAYOUT
    return attn_check_rows(op, q, "k", k, "v", v);
}

int qk_attn_check_pool(const char *op, const qk_view *q, const qk_view *p, int64_t B) {
    static const char *const names[5] = {"k_cache", "v_cache", "req_to_token", "req_pool_indices", "kv_indptr"};
    static const char *const layouts[5] = {"[S, Hkv, D]", "[S, Hkv, D]", "[R, max_ctx]", "[B]", "[B + 1]"};
    static const int ndims[5] = {3, 3, 2, 1, 1};
    for (int i = 0; i < 5; i++)
        if (qk_check_ndim(op, names[i], &p[i], ndims[i], "%s", layouts[i]) < 0) return -1;
    for (int i = 0; i < 5; i++) {
        const int bad = i < 2 ? qk_check_same_dtype(op, names[i], &p[i], "q's", q) < 0
                              : qk_check_dtype_index(op, names[i], &p[i]) < 0;
        if (bad) return -1;
    }
    const int64_t D = q->shape[q->ndim - 1];
#define POOL_LAYOUT "[S, Hkv, D] = [%lld, %lld, %lld]", (long long)p[0].shape[0], (long long)p[0].shape[1], (long long)D
    if (qk_check_dim(op, names[0], &p[0], 2, D, POOL_LAYOUT) < 0) return -1;
    for (int d = 0; d < 3; d++)
        if (qk_check_dim(op, names[1], &p[1], d, p[0].shape[d], POOL_LAYOUT) < 0) return -1;
#undef POOL_LAYOUT
    if (qk_check_dim(op, names[3], &p[3], 0, B, "[B] = [%lld]", (long long)B) < 0 ||
        qk_check_dim(op, names[4], &p[4], 0, B + 1, "[B + 1] = [%lld]", (long long)(B + 1)) < 0)
        return -1;
    return attn_check_rows(op, q, names[0], &p[0], names[1], &p[1]);
}

int qk_attn_scale(const char *op, PyObject *obj, int64_t D, float *scale) {
    if (!QK_GIVEN(obj)) {
        *scale = (float)(1.0 / sqrt((double)D));
        return 0;
    }
    const double s = PyFloat_AsDouble(obj);
    if (s == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: scale must be a float or None, got %.200s", op, Py_TYPE(obj)->tp_name);
        return -1;
    }
    /* Checked as the kernels use it: in float32, times log2(e) for exp2. */
    if (!isfinite((float)s) || !isfinite((float)s * 1.4426950408889634f)) {
        PyErr_Format(PyExc_ValueError, "%s: scale must be finite in float32 (|scale| < 2.3e38), got %R", op, obj);
        return -1;
    }
    *scale = (float)s;
    return 0;
}

int qk_attn_mask_dtype(const char *op, const qk_view *m, const qk_view *q, int *dtype) {
    *dtype = m->dtype;
    if (m->dtype == QK_BOOL) return 0;
    if (m->dtype == QK_F32 || (m->dtype == q->dtype && (q->dtype == QK_F16 || q->dtype == QK_BF16))) return 1;
    if (q->dtype == QK_F32)
        PyErr_Format(PyExc_TypeError, "%s: mask must be bool (True = keep) or float32 (added to the scores), got %s",
                     op, qk_dtype_name(m->dtype));
    else
        PyErr_Format(PyExc_TypeError,
                     "%s: mask must be bool (True = keep), or float32 or q's dtype %s (added to the scores), got %s", op,
                     qk_dtype_name(q->dtype), qk_dtype_name(m->dtype));
    return -1;
}

const void *qk_attn_mask_data(const qk_view *m) {
    static const unsigned char none;
    return m->data ? m->data : (const void *)&none;
}

/* The last dim of a key mask: L, or with QK_ATTN_MASK_NARROW from 1 to L. */
static int attn_mask_width(const char *op, const qk_view *m, int64_t L, const char *L_name, int flags,
                           const char *layout) {
    const int64_t W = m->shape[m->ndim - 1];
    if (!(flags & QK_ATTN_MASK_NARROW) || W == L) return qk_check_dim(op, "mask", m, m->ndim - 1, L, "%s", layout);
    if (W >= 1 && W <= L) return 0;
    char got[160];
    qk_shape_str(got, sizeof got, m->shape, m->ndim);
    PyErr_Format(PyExc_ValueError,
                 "%s: mask must have shape %s with 1 <= W <= %s = %lld in dimension %d (positions from W on are "
                 "masked out), got %s",
                 op, layout, L_name, (long long)L, m->ndim - 1, got);
    return -1;
}

int qk_attn_check_mask(const char *op, const qk_view *m, int64_t B, int64_t L, const char *L_name, int flags) {
    const int allow_3d = flags & QK_ATTN_MASK_3D;
    const char *W = flags & QK_ATTN_MASK_NARROW ? "W" : L_name;
    char layout[96];
    if (allow_3d && (m->ndim == 3 || m->ndim == 4)) { /* SDPA's decode masks: [B|1, 1, L], [B|1, 1, 1, L] */
        snprintf(layout, sizeof layout, m->ndim == 3 ? "[B|1, 1, %s] = [%lld|1, 1, %lld]" : "[B|1, 1, 1, %s] = "
                 "[%lld|1, 1, 1, %lld]", W, (long long)B, (long long)L);
        if (m->shape[0] != 1 && qk_check_dim(op, "mask", m, 0, B, "%s", layout) < 0) return -1;
        for (int d = 1; d < m->ndim - 1; d++)
            if (qk_check_dim(op, "mask", m, d, 1, "%s", layout) < 0) return -1;
        return attn_mask_width(op, m, L, L_name, flags, layout);
    }
    snprintf(layout, sizeof layout, allow_3d ? "[B, %s] or [B, 1, %s]" : "[B, %s]", W, W);
    if (qk_check_ndim(op, "mask", m, 2, "%s", layout) < 0) return -1;
    snprintf(layout, sizeof layout, "[B, %s] = [%lld, %lld]", W, (long long)B, (long long)L);
    return (!(allow_3d && m->shape[0] == 1) && qk_check_dim(op, "mask", m, 0, B, "%s", layout) < 0) ||
                   attn_mask_width(op, m, L, L_name, flags, layout) < 0
               ? -1
               : 0;
}

void qk_attn_raise_pool_index(const char *op, int bad_arg, int64_t bad_pos, int64_t bad_value, int64_t num_requests,
                              int64_t max_ctx, int64_t pool_size) {
    if (bad_arg == 0)
        PyErr_Format(PyExc_ValueError,
                     "%s: req_pool_indices[%lld] = %lld is out of range for req_to_token with R = %lld rows", op,
                     (long long)bad_pos, (long long)bad_value, (long long)num_requests);
    else if (bad_arg == 1)
        PyErr_Format(PyExc_ValueError,
                     "%s: kv_indptr gives sequence %lld the length kv_indptr[%lld] - kv_indptr[%lld] = %lld, outside "
                     "[0, max_ctx = %lld]",
                     op, (long long)bad_pos, (long long)bad_pos + 1, (long long)bad_pos, (long long)bad_value,
                     (long long)max_ctx);
    else
        PyErr_Format(PyExc_ValueError,
                     "%s: req_to_token[%lld, %lld] = %lld is out of range for the KV pool with S = %lld slots", op,
                     (long long)(bad_pos / max_ctx), (long long)(bad_pos % max_ctx), (long long)bad_value,
                     (long long)pool_size);
}
