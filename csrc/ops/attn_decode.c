/* attn_decode(q, k, v, *, kv_lens=None, mask=None, scale=None, out=None, stream=None)
 * attn_paged_decode(q, k_cache, v_cache, req_to_token, req_pool_indices, kv_indptr, *, new_k=None,
 *                   new_v=None, mask=None, scale=None, out=None, stream=None)
 * One qk_attn_decode_args serves both (paged flag); the CPU or CUDA launcher by device.  The checks
 * shared with attn_prefill.c are in attn_common.c.  The raw ops also take the private tuning keywords
 * _variant= (a name below) and _splits= (qk_attn_decode_args' variant and splits). */
#include "attn_common.h" /* first: Python.h before any system header */
#include "../cpu/cpu.h"

static const char *const ad_variants[] = {[QK_DECODE_AUTO] = "auto", [QK_DECODE_WORKSPACE] = "workspace",
                                          [QK_DECODE_ROWS] = "rows", [QK_DECODE_HEADS] = "heads"};

/* The mask's dtype (bool or additive float) and shape; paged masks may be narrower than max_ctx. */
static int ad_check_mask(const char *op, const qk_view *m, const qk_view *q, int64_t B, int64_t L, int paged,
                         qk_attn_decode_args *a) {
    const int kind = qk_attn_mask_dtype(op, m, q, &a->mask_dtype);
    if (kind < 0 || qk_attn_check_mask(op, m, B, L, paged ? "max_ctx" : "Lkv",
                                       QK_ATTN_MASK_3D | (paged ? QK_ATTN_MASK_NARROW : 0)) < 0)
        return -1;
    a->mask = qk_attn_mask_data(m);
    a->mask_float = kind;
    a->mask_cols = m->shape[m->ndim - 1];
    a->mask_stride[0] = qk_attn_stride(m, 0); /* 0 for a mask broadcast over the batch */
    a->mask_stride[1] = m->strides[m->ndim - 1];
    return 0;
}

/* Both decode ops' arguments: n required tensors, n_inputs tensors in all, then the keywords they end
 * with (scale, out, stream, _variant, _splits); stream, _variant and _splits read here. */
static int ad_args(const char *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                   const char *const *names, int n, int n_inputs, PyObject **a, void **stream, int *stream_given,
                   int *variant, int *splits) {
    if (qk_parse_args(op, args, nargs, kwnames, names, n, n, a) < 0) return -1;
    PyObject *const *kw = a + n_inputs;
    return qk_stream_arg(op, kw[2], stream, stream_given) < 0 ||
                   qk_variant_arg(op, "_variant", kw[3], ad_variants, QK_COUNT(ad_variants), variant) < 0 ||
                   qk_tuning_int_arg(op, "_splits", kw[4], INT_MAX, 0, splits) < 0
               ? -1
               : 0;
}

/* The fields both decode ops fill alike: q [B, 1, Hq, D] or [B, Hq, D] and out of its shape; k and v
 * [B, Lkv, Hkv, D] or token pools [S, Hkv, D] (strides {b, j, h}: a pool has no b); the options. */
static void ad_fill(qk_attn_decode_args *ad, const qk_view *q, const qk_view *out, const qk_view *k, const qk_view *v,
                    float scale, int variant, int splits, int num_threads) {
    const int h = q->ndim - 2, lead = 4 - k->ndim;
    ad->q = q->data;
    ad->out = out->data;
    ad->k = k->data;
    ad->v = v->data;
    ad->B = q->shape[0];
    ad->Hq = q->shape[h];
    ad->Hkv = k->shape[k->ndim - 2];
    ad->D = q->shape[h + 1];
    ad->q_stride[0] = qk_attn_stride(q, 0);
    ad->q_stride[1] = qk_attn_stride(q, h);
    ad->out_stride[0] = out->strides[0];
    ad->out_stride[1] = out->strides[h];
    for (int i = lead; i < 3; i++) {
        ad->k_stride[i] = qk_attn_stride(k, i - lead);
        ad->v_stride[i] = qk_attn_stride(v, i - lead);
    }
    ad->scale = scale;
    ad->dtype = q->dtype;
    ad->num_threads = num_threads;
    ad->variant = variant;
    ad->splits = splits;
}

#undef OP
#define OP "attn_decode"

QK_DOCS(attn_decode, "q, k, v, *, kv_lens=None, mask=None, scale=None, out=None",
    "Decode attention: one query token per sequence against its KV cache.\n\n"
    "q [B, 1, Hq, D], k and v [B, Lkv, Hkv, D] -> [B, 1, Hq, D], out[b,0,h] = softmax(scale * q.k_j) v_j\n"
    "over the kept keys j of sequence b, with kv head h // (Hq / Hkv) (GQA).  kv_lens [B] (int32 or\n"
    "int64) keeps keys j < min(kv_lens[b], Lkv); mask [B, Lkv], [B, 1, Lkv] or [B, 1, 1, Lkv] (B may be 1:\n"
    "one mask for every sequence): bool, True = keep, or float (float32, or q's dtype for float16 and\n"
    "bfloat16) added to the scaled scores, -inf = drop, as scaled_dot_product_attention takes it.\n"
    QK_ATTN_DOC)

QK_DOCS(attn_paged_decode, "q, k_cache, v_cache, req_to_token, req_pool_indices, kv_indptr, *, new_k=None, "
     "new_v=None, mask=None, scale=None, out=None",
    "Decode attention over a token-pool KV cache.\n\n"
    "q [B, Hq, D]; k_cache, v_cache [S, Hkv, D] token pools; req_to_token [R, max_ctx] maps (request,\n"
    "position) to a pool slot; sequence b is request req_pool_indices[b] with kv_indptr[b+1] - kv_indptr[b]\n"
    "tokens (the new one included) -> [B, Hq, D].  new_k, new_v [B, Hkv, D] (both or neither) are first\n"
    "written into the pools at position len_b - 1 and used there.  mask [B, W] (or [B, 1, W], [B, 1, 1, W]),\n"
    "W <= max_ctx, over each sequence's positions (those from W on are dropped): bool, True = keep, or\n"
    "float added to the scaled scores, as attn_decode's.\n"
    QK_ATTN_DOC)

PyObject *qk_op_attn_decode(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"q", "k", "v", "kv_lens", "mask", "scale", "out", "stream", "_variant",
                                        "_splits", NULL};
    enum { Q, K, V, KV_LENS, MASK, NUM_INPUTS };
    qk_state *st = qk_get_state(module);
    PyObject *a[10] = {NULL};
    void *stream;
    int stream_given, variant, splits;
    if (ad_args(OP, args, nargs, kwnames, names, 3, NUM_INPUTS, a, &stream, &stream_given, &variant, &splits) < 0)
        return NULL;

    qk_view in[NUM_INPUTS] = {{0}}, ov = {0};
    qk_output o = {0};
    qk_launch l = {0};
    int ok = 0, launched = 0, n_in = 0;
    if (qk_attn_import(st, OP, a, names, 3, NUM_INPUTS, stream, in, &n_in) < 0) goto done;
    if (qk_check_ndim(OP, "q", &in[Q], 4, "[B, 1, Hq, D]") < 0 || qk_check_dtype_llm(OP, "q", &in[Q]) < 0) goto done;
    const int64_t B = in[Q].shape[0], Hq = in[Q].shape[2], D = in[Q].shape[3];
    if (qk_check_dim(OP, "q", &in[Q], 1, 1, "[B, 1, Hq, D] = [%lld, 1, %lld, %lld]", (long long)B, (long long)Hq,
                     (long long)D) < 0 ||
        qk_attn_check_dense_kv(OP, &in[Q], &in[K], &in[V]) < 0)
        goto done;
    const int64_t Lkv = in[K].shape[1];
    if (QK_GIVEN(a[KV_LENS])) {
        if (qk_check_ndim(OP, "kv_lens", &in[KV_LENS], 1, "[B]") < 0 ||
            qk_check_dtype_index(OP, "kv_lens", &in[KV_LENS]) < 0 ||
            qk_check_dim(OP, "kv_lens", &in[KV_LENS], 0, B, "[B] = [%lld]", (long long)B) < 0)
            goto done;
    }
    qk_attn_decode_args ad = {0};
    if (QK_GIVEN(a[MASK]) && ad_check_mask(OP, &in[MASK], &in[Q], B, Lkv, 0, &ad) < 0) goto done;
    float scale;
    if (qk_attn_scale(OP, a[5], D, &scale) < 0) goto done;
    const int64_t shape[4] = {B, 1, Hq, D};
    if (qk_attn_output(st, OP, a[6], in, names, NUM_INPUTS, stream, stream_given, 4, shape, 0, &l, &launched, &ov,
                       &o) < 0)
        goto done;

    ad_fill(&ad, &in[Q], &ov, &in[K], &in[V], scale, variant, splits, st->num_threads);
    ad.Lkv = Lkv;
    if (QK_GIVEN(a[KV_LENS])) {
        ad.kv_lens = in[KV_LENS].data;
        ad.kv_lens_stride = in[KV_LENS].strides[0];
        ad.kv_lens_dtype = in[KV_LENS].dtype;
    }
    int status = QK_OK;
    if (B > 0 && Hq > 0) QK_RUN(status, &l, attn_decode, &ad);
    if (status) qk_raise_status(OP, status);
    else ok = 1;
done:
    return qk_op_finish(&l, launched, &o, &ov, ok, in, n_in);
}

#undef OP
#define OP "attn_paged_decode"

PyObject *qk_op_attn_paged_decode(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"q", "k_cache", "v_cache", "req_to_token", "req_pool_indices", "kv_indptr",
                                        "new_k", "new_v", "mask", "scale", "out", "stream", "_variant", "_splits",
                                        NULL};
    enum { Q, KC, VC, R2T, RPI, INDPTR, NEW_K, NEW_V, MASK, NUM_INPUTS };
    qk_state *st = qk_get_state(module);
    PyObject *a[14] = {NULL};
    void *stream;
    int stream_given, variant, splits;
    if (ad_args(OP, args, nargs, kwnames, names, 6, NUM_INPUTS, a, &stream, &stream_given, &variant, &splits) < 0)
        return NULL;
    const int has_new_k = QK_GIVEN(a[NEW_K]), has_new_v = QK_GIVEN(a[NEW_V]);
    if (has_new_k != has_new_v) {
        PyErr_Format(PyExc_TypeError, OP ": new_k and new_v must be given together (got %s without %s)",
                     has_new_k ? "new_k" : "new_v", has_new_k ? "new_v" : "new_k");
        return NULL;
    }

    qk_view in[NUM_INPUTS] = {{0}}, ov = {0};
    qk_output o = {0};
    qk_launch l = {0};
    int ok = 0, launched = 0, n_in = 0;
    if (qk_attn_import(st, OP, a, names, 6, NUM_INPUTS, stream, in, &n_in) < 0) goto done;
    if (qk_check_ndim(OP, "q", &in[Q], 3, "[B, Hq, D]") < 0 || qk_check_dtype_llm(OP, "q", &in[Q]) < 0 ||
        qk_attn_check_pool(OP, &in[Q], &in[KC], in[Q].shape[0]) < 0)
        goto done;
    const int64_t B = in[Q].shape[0], Hq = in[Q].shape[1], D = in[Q].shape[2];
    const int64_t S = in[KC].shape[0], Hkv = in[KC].shape[1];
    const int64_t R = in[R2T].shape[0], max_ctx = in[R2T].shape[1];
    if (has_new_k) {
        static const char *const nn[2] = {"new_k", "new_v"};
#define NEW_LAYOUT "[B, Hkv, D] = [%lld, %lld, %lld]", (long long)B, (long long)Hkv, (long long)D
        for (int i = 0; i < 2; i++) {
            const qk_view *v = &in[NEW_K + i];
            if (qk_check_ndim(OP, nn[i], v, 3, "[B, Hkv, D]") < 0 || qk_check_same_dtype(OP, nn[i], v, "q's", &in[Q]) < 0 ||
                qk_check_dim(OP, nn[i], v, 0, B, NEW_LAYOUT) < 0 || qk_check_dim(OP, nn[i], v, 1, Hkv, NEW_LAYOUT) < 0 ||
                qk_check_dim(OP, nn[i], v, 2, D, NEW_LAYOUT) < 0 || qk_attn_check_unit(OP, nn[i], v) < 0)
                goto done;
        }
#undef NEW_LAYOUT
        for (int i = 0; i < 2; i++) {
            if (in[KC + i].readonly) {
                PyErr_Format(PyExc_BufferError, OP ": %s is read-only, but new_k/new_v are written into it",
                             i ? "v_cache" : "k_cache");
                goto done;
            }
        }
    }
    qk_attn_decode_args ad = {0};
    if (QK_GIVEN(a[MASK]) && ad_check_mask(OP, &in[MASK], &in[Q], B, max_ctx, 1, &ad) < 0) goto done;
    if (has_new_k &&
        (qk_attn_check_rows16(OP, "new_k", &in[NEW_K]) < 0 || qk_attn_check_rows16(OP, "new_v", &in[NEW_V]) < 0))
        goto done;
    float scale;
    if (qk_attn_scale(OP, a[9], D, &scale) < 0) goto done;
    const int64_t shape[3] = {B, Hq, D};
    if (qk_attn_output(st, OP, a[10], in, names, NUM_INPUTS, stream, stream_given, 3, shape, 0, &l, &launched, &ov,
                       &o) < 0)
        goto done;

    ad_fill(&ad, &in[Q], &ov, &in[KC], &in[VC], scale, variant, splits, st->num_threads);
    ad.paged = 1;
    ad.req_to_token = in[R2T].data;
    ad.req_pool_indices = in[RPI].data;
    ad.kv_indptr = in[INDPTR].data;
    ad.num_requests = R;
    ad.max_ctx = max_ctx;
    ad.pool_size = S;
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
            ad.new_k_stride[i] = qk_attn_stride(&in[NEW_K], i);
            ad.new_v_stride[i] = qk_attn_stride(&in[NEW_V], i);
        }
    }
    int status = QK_OK;
    if (B > 0) /* QKERNELS_CHECK=1: the pool rows (bad_arg stays 0) */
        status = qk_index_check(st, &l, ad.req_pool_indices, ad.rpi_dtype, B, ad.rpi_stride, R, &ad.bad_pos,
                                &ad.bad_value);
    if (B > 0 && status == QK_OK) QK_RUN(status, &l, attn_decode, &ad);
    if (status == QK_E_INDEX) qk_attn_raise_pool_index(OP, ad.bad_arg, ad.bad_pos, ad.bad_value, R, max_ctx, S);
    else if (status) qk_raise_status(OP, status);
    else ok = 1;
done:
    return qk_op_finish(&l, launched, &o, &ov, ok, in, n_in);
}
