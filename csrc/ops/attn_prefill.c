/* attn_prefill(q, k, v, *, is_causal=False, mask=None, scale=None, out=None, stream=None)
 * attn_paged_prefill(q, k_cache, v_cache, req_to_token, req_pool_indices, kv_indptr, qo_indptr, *,
 *                    is_causal=False, mask=None, scale=None, out=None, stream=None)
 * One qk_attn_prefill_args serves both (paged flag); the CPU or CUDA launcher by device.  The checks
 * shared with attn_decode.c are in attn_common.c.  The raw ops also take the private tuning keyword
 * _variant= (a name below: qk_attn_prefill_args' variant) and _isa= (a cap on the cpu backend's
 * instruction set, a name of qk_cpu_isa_names: tests run each path the machine has). */
#include "attn_common.h" /* first: Python.h before any system header */
#include "../cpu/cpu.h"
#include "../cpu/linear_isa.h"

QK_DOCS(attn_prefill, "q, k, v, *, is_causal=False, mask=None, scale=None, out=None",
    "Prefill attention: many query tokens per sequence against its keys.\n\n"
    "q [B, Lq, Hq, D], k and v [B, Lkv, Hkv, D] -> [B, Lq, Hq, D], out[b,i,h] = softmax(scale * q.k_j) v_j\n"
    "over the kept keys j, with kv head h // (Hq / Hkv) (GQA).  The queries are the last Lq of the Lkv\n"
    "positions: is_causal keeps j <= i + Lkv - Lq (bottom-right aligned; with Lq > Lkv the first\n"
    "Lq - Lkv queries keep nothing and give 0).  mask [B, Lkv] (per key), or per query as\n"
    "scaled_dot_product_attention broadcasts it: [B|1, 1|Hq, Lq|1, Lkv] or [1|Hq, Lq|1, Lkv]; bool, True =\n"
    "keep, or float (float32, or q's dtype for float16 and bfloat16) added to the scaled scores, -inf =\n"
    "drop, as scaled_dot_product_attention takes it; with is_causal both apply.\n"
    QK_ATTN_DOC)

QK_DOCS(attn_paged_prefill, "q, k_cache, v_cache, req_to_token, req_pool_indices, kv_indptr, qo_indptr, *, "
     "is_causal=False, mask=None, scale=None, out=None",
    "Prefill attention over a token-pool KV cache, a ragged batch.\n\n"
    "q [total_q, Hq, D]: request b's queries are rows qo_indptr[b] .. qo_indptr[b+1] - 1 (q_len_b), the\n"
    "last q_len_b of its kv_len_b = kv_indptr[b+1] - kv_indptr[b] keys (q_len_b <= kv_len_b); key j is\n"
    "pool slot req_to_token[req_pool_indices[b], j] of k_cache, v_cache [S, Hkv, D] -> [total_q, Hq, D].\n"
    "is_causal keeps j <= i + kv_len_b - q_len_b for query i of request b.  mask [B, W] over each request's\n"
    "keys, or per query [B|1, 1|Hq, Mq, W] (row i for query i of the request; Mq = 1 broadcasts, else\n"
    "Mq >= every q_len_b), W <= max_ctx (positions from W on are dropped); bool, True = keep, or float\n"
    "added to the scaled scores as attn_prefill's.  Rows of q outside qo_indptr[0] .. qo_indptr[B] - 1\n"
    "give 0.\n"
    QK_ATTN_DOC)

static const char *const ap_variants[] = {[QK_PREFILL_AUTO] = "auto", [QK_PREFILL_MMA] = "mma",
                                          [QK_PREFILL_WGMMA] = "wgmma"};

/* The prefill ops' mask against [B, Hq, Lq, L] (dense: L = Lkv; paged, Lq < 0: L = max_ctx, any
 * query rows Mq, a key width W <= max_ctx).  2-D [B, L]: per key, bool as mask_kind 1 (masked keys
 * are never loaded), float as mask_kind 2 with stride-0 head and query dims.  Per query (mask_kind
 * 2) as scaled_dot_product_attention broadcasts it, trailing dimensions aligned: [B|1, 1|Hq, Lq|1, L]
 * or [1|Hq, Lq|1, L]; a dimension of size 1 is read with stride 0. */
static int ap_mask(const char *op, const qk_view *m, const qk_view *q, int64_t B, int64_t Hq, int64_t Lq, int64_t L,
                   qk_attn_prefill_args *pa) {
    const int paged = Lq < 0;
    const int kind = qk_attn_mask_dtype(op, m, q, &pa->mask_dtype);
    if (kind < 0) return -1;
    pa->mask_float = kind;
    if (m->ndim == 2) {
        if (qk_attn_check_mask(op, m, B, L, paged ? "max_ctx" : "Lkv", paged ? QK_ATTN_MASK_NARROW : 0) < 0)
            return -1;
        pa->mask_kind = kind ? 2 : 1;
        pa->mask_stride[0] = qk_attn_stride(m, 0);
        pa->mask_stride[3] = qk_attn_stride(m, 1);
    } else if (m->ndim == 4 || m->ndim == 3) {
        /* the mask's dims aligned to the trailing dims of [B, Hq, Lq, L]; a 3-D mask has no batch dim */
        const int four = m->ndim == 4, ib = four ? 0 : -1, ih = four ? 1 : 0, ii = ih + 1, ij = ih + 2;
        char layout[160], rows[48], cols[48];
        if (paged) {
            snprintf(rows, sizeof rows, "Mq");
            snprintf(cols, sizeof cols, "W");
        } else {
            snprintf(rows, sizeof rows, "%lld|1", (long long)Lq);
            snprintf(cols, sizeof cols, "%lld", (long long)L);
        }
        if (four)
            snprintf(layout, sizeof layout, "[B|1, 1|Hq, %s, %s] = [%lld|1, 1|%lld, %s, %s]", paged ? "Mq" : "Lq|1",
                     paged ? "W" : "Lkv", (long long)B, (long long)Hq, rows, cols);
        else
            snprintf(layout, sizeof layout, "[1|Hq, %s, %s] = [1|%lld, %s, %s]", paged ? "Mq" : "Lq|1",
                     paged ? "W" : "Lkv", (long long)Hq, rows, cols);
        if ((four && m->shape[ib] != 1 && qk_check_dim(op, "mask", m, ib, B, "%s", layout) < 0) ||
            (m->shape[ih] != 1 && qk_check_dim(op, "mask", m, ih, Hq, "%s", layout) < 0) ||
            (!paged && m->shape[ii] != 1 && qk_check_dim(op, "mask", m, ii, Lq, "%s", layout) < 0) ||
            (paged && m->shape[ii] < 1 && qk_check_dim(op, "mask", m, ii, 1, "%s", layout) < 0))
            return -1;
        if (paged) {
            const int64_t W = m->shape[ij];
            if (W != L && (W < 1 || W > L)) {
                char got[160];
                qk_shape_str(got, sizeof got, m->shape, m->ndim);
                PyErr_Format(PyExc_ValueError,
                             "%s: mask must have shape %s with 1 <= W <= max_ctx = %lld in dimension %d (positions "
                             "from W on are masked out), got %s",
                             op, layout, (long long)L, ij, got);
                return -1;
            }
            pa->mask_rows = m->shape[ii] > 1 ? m->shape[ii] : 0; /* one row broadcasts to every query */
        } else if (qk_check_dim(op, "mask", m, ij, L, "%s", layout) < 0) {
            return -1;
        }
        pa->mask_kind = 2;
        pa->mask_stride[0] = four ? qk_attn_stride(m, ib) : 0;
        pa->mask_stride[1] = qk_attn_stride(m, ih);
        pa->mask_stride[2] = qk_attn_stride(m, ii);
        pa->mask_stride[3] = qk_attn_stride(m, ij);
    } else {
        char got[160];
        qk_shape_str(got, sizeof got, m->shape, m->ndim);
        if (paged)
            PyErr_Format(PyExc_ValueError, "%s: mask must be [B, W], [1|Hq, Mq, W] or [B|1, 1|Hq, Mq, W] with W <= "
                         "max_ctx (2, 3 or 4 dimensions), got shape %s", op, got);
        else
            PyErr_Format(PyExc_ValueError, "%s: mask must be [B, Lkv], [1|Hq, Lq|1, Lkv] or [B|1, 1|Hq, Lq|1, Lkv] "
                         "(2, 3 or 4 dimensions), got shape %s", op, got);
        return -1;
    }
    pa->mask_cols = m->shape[m->ndim - 1];
    pa->mask = qk_attn_mask_data(m);
    return 0;
}

/* Both prefill ops' arguments: n required tensors, then mask, is_causal, scale, out, stream, _variant,
 * _isa; stream, is_causal, _variant and _isa read here. */
static int ap_args(const char *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                   const char *const *names, int n, PyObject **a, void **stream, int *stream_given, int *causal,
                   int *variant, int *isa) {
    if (qk_parse_args(op, args, nargs, kwnames, names, n, n, a) < 0) return -1;
    PyObject *const *kw = a + n;
    return qk_stream_arg(op, kw[4], stream, stream_given) < 0 || qk_bool_arg(op, "is_causal", kw[1], 0, causal) < 0 ||
                   qk_variant_arg(op, "_variant", kw[5], ap_variants, QK_COUNT(ap_variants), variant) < 0 ||
                   qk_variant_arg(op, "_isa", kw[6], qk_cpu_isa_names, QK_CPU_ISA_COUNT, isa) < 0
               ? -1
               : 0;
}

/* The fields both prefill ops fill alike: q [B, Lq, Hq, D] or [total_q, Hq, D] and out of its shape,
 * k and v [B, Lkv, Hkv, D] or token pools [S, Hkv, D] (strides {b, i or j, h}: the ragged forms have
 * no b); the options. */
static void ap_fill(qk_attn_prefill_args *pa, const qk_view *q, const qk_view *out, const qk_view *k, const qk_view *v,
                    int causal, int variant, int num_threads) {
    const int lead = 4 - q->ndim;
    pa->q = q->data;
    pa->out = out->data;
    pa->k = k->data;
    pa->v = v->data;
    pa->Hq = q->shape[q->ndim - 2];
    pa->Hkv = k->shape[k->ndim - 2];
    pa->D = q->shape[q->ndim - 1];
    for (int i = lead; i < 3; i++) {
        pa->q_stride[i] = qk_attn_stride(q, i - lead);
        pa->out_stride[i] = qk_attn_stride(out, i - lead);
        pa->k_stride[i] = qk_attn_stride(k, i - lead);
        pa->v_stride[i] = qk_attn_stride(v, i - lead);
    }
    pa->causal = causal;
    pa->variant = variant;
    pa->dtype = q->dtype;
    pa->num_threads = num_threads;
}

#undef OP
#define OP "attn_prefill"

PyObject *qk_op_attn_prefill(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"q",   "k",      "v",        "mask", "is_causal", "scale",
                                        "out", "stream", "_variant", "_isa", NULL};
    enum { Q, K, V, MASK, NUM_INPUTS };
    qk_state *st = qk_get_state(module);
    PyObject *a[10] = {NULL};
    void *stream;
    int stream_given, causal, variant, isa;
    if (ap_args(OP, args, nargs, kwnames, names, MASK, a, &stream, &stream_given, &causal, &variant, &isa) < 0)
        return NULL;

    qk_view in[NUM_INPUTS] = {{0}}, ov = {0};
    qk_output o = {0};
    qk_launch l = {0};
    qk_attn_prefill_args pa = {0};
    int ok = 0, launched = 0, n_in = 0;
    if (qk_attn_import(st, OP, a, names, 3, NUM_INPUTS, stream, in, &n_in) < 0) goto done;
    if (qk_check_ndim(OP, "q", &in[Q], 4, "[B, Lq, Hq, D]") < 0 || qk_check_dtype_llm(OP, "q", &in[Q]) < 0 ||
        qk_attn_check_dense_kv(OP, &in[Q], &in[K], &in[V]) < 0)
        goto done;
    const int64_t B = in[Q].shape[0], Lq = in[Q].shape[1], Hq = in[Q].shape[2], D = in[Q].shape[3];
    const int64_t Lkv = in[K].shape[1];
    if (QK_GIVEN(a[MASK]) && ap_mask(OP, &in[MASK], &in[Q], B, Hq, Lq, Lkv, &pa) < 0) goto done;
    if (qk_attn_scale(OP, a[5], D, &pa.scale) < 0) goto done;
    const int64_t shape[4] = {B, Lq, Hq, D};
    if (qk_attn_output(st, OP, a[6], in, names, NUM_INPUTS, stream, stream_given, 4, shape, 1, &l, &launched, &ov,
                       &o) < 0)
        goto done;

    ap_fill(&pa, &in[Q], &ov, &in[K], &in[V], causal, variant, st->num_threads);
    pa.cpu_isa = isa;
    pa.B = B;
    pa.Lq = Lq;
    pa.Lkv = Lkv;
    int status = QK_OK;
    if (B > 0 && Lq > 0 && Hq > 0) QK_RUN(status, &l, attn_prefill, &pa);
    if (status) qk_raise_status(OP, status);
    else ok = 1;
done:
    return qk_op_finish(&l, launched, &o, &ov, ok, in, n_in);
}

#undef OP
#define OP "attn_paged_prefill"

/* bad_arg 3: sequence bad_pos's query rows (read back here: the CPU launcher is the one that checks). */
static void ap_raise_rows(const qk_attn_prefill_args *a) {
    const int64_t b = a->bad_pos;
    const int64_t q0 = qk_index(a->qo_indptr, a->qo_indptr_dtype, b, a->qo_indptr_stride);
    const int64_t q1 = qk_index(a->qo_indptr, a->qo_indptr_dtype, b + 1, a->qo_indptr_stride);
    const int64_t kv_len = qk_index(a->kv_indptr, a->kv_indptr_dtype, b + 1, a->kv_indptr_stride) -
                           qk_index(a->kv_indptr, a->kv_indptr_dtype, b, a->kv_indptr_stride);
    if (q0 < 0 || q1 < q0 || q1 > a->total_q)
        PyErr_Format(PyExc_ValueError,
                     OP ": qo_indptr gives sequence %lld the query rows qo_indptr[%lld] = %lld to qo_indptr[%lld] = "
                        "%lld, not an ascending range within [0, total_q = %lld]",
                     (long long)b, (long long)b, (long long)q0, (long long)b + 1, (long long)q1, (long long)a->total_q);
    else
        PyErr_Format(PyExc_ValueError,
                     OP ": sequence %lld has q_len = %lld queries (qo_indptr) but kv_len = %lld keys (kv_indptr); its "
                        "queries are the last q_len of its keys, so q_len must not exceed kv_len",
                     (long long)b, (long long)(q1 - q0), (long long)kv_len);
}

PyObject *qk_op_attn_paged_prefill(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"q", "k_cache", "v_cache", "req_to_token", "req_pool_indices", "kv_indptr",
                                        "qo_indptr", "mask", "is_causal", "scale", "out", "stream", "_variant",
                                        "_isa", NULL};
    enum { Q, KC, VC, R2T, RPI, KV_INDPTR, QO_INDPTR, MASK, NUM_INPUTS };
    qk_state *st = qk_get_state(module);
    PyObject *a[14] = {NULL};
    void *stream;
    int stream_given, causal, variant, isa;
    if (ap_args(OP, args, nargs, kwnames, names, MASK, a, &stream, &stream_given, &causal, &variant, &isa) < 0)
        return NULL;

    qk_view in[NUM_INPUTS] = {{0}}, ov = {0};
    qk_output o = {0};
    qk_launch l = {0};
    qk_attn_prefill_args pa = {0};
    int ok = 0, launched = 0, n_in = 0;
    if (qk_attn_import(st, OP, a, names, 7, NUM_INPUTS, stream, in, &n_in) < 0) goto done;
    if (qk_check_ndim(OP, "q", &in[Q], 3, "[total_q, Hq, D]") < 0 || qk_check_dtype_llm(OP, "q", &in[Q]) < 0 ||
        qk_check_ndim(OP, "req_pool_indices", &in[RPI], 1, "[B]") < 0 ||
        qk_attn_check_pool(OP, &in[Q], &in[KC], in[RPI].shape[0]) < 0)
        goto done;
    const int64_t total_q = in[Q].shape[0], Hq = in[Q].shape[1], D = in[Q].shape[2];
    const int64_t S = in[KC].shape[0];
    const int64_t R = in[R2T].shape[0], max_ctx = in[R2T].shape[1], B = in[RPI].shape[0];
    if (qk_check_ndim(OP, "qo_indptr", &in[QO_INDPTR], 1, "[B + 1]") < 0 ||
        qk_check_dtype_index(OP, "qo_indptr", &in[QO_INDPTR]) < 0 ||
        qk_check_dim(OP, "qo_indptr", &in[QO_INDPTR], 0, B + 1, "[B + 1] = [%lld]", (long long)B + 1) < 0)
        goto done;
    if (QK_GIVEN(a[MASK]) && ap_mask(OP, &in[MASK], &in[Q], B, Hq, -1, max_ctx, &pa) < 0) goto done;
    if (qk_attn_scale(OP, a[9], D, &pa.scale) < 0) goto done;
    const int64_t shape[3] = {total_q, Hq, D};
    if (qk_attn_output(st, OP, a[10], in, names, NUM_INPUTS, stream, stream_given, 3, shape, 1, &l, &launched, &ov,
                       &o) < 0)
        goto done;

    ap_fill(&pa, &in[Q], &ov, &in[KC], &in[VC], causal, variant, st->num_threads);
    pa.cpu_isa = isa;
    pa.paged = 1;
    pa.req_to_token = in[R2T].data;
    pa.req_pool_indices = in[RPI].data;
    pa.kv_indptr = in[KV_INDPTR].data;
    pa.qo_indptr = in[QO_INDPTR].data;
    pa.B = B;
    pa.total_q = total_q;
    pa.num_requests = R;
    pa.max_ctx = max_ctx;
    pa.pool_size = S;
    for (int i = 0; i < 2; i++) pa.r2t_stride[i] = in[R2T].strides[i];
    pa.rpi_stride = in[RPI].strides[0];
    pa.kv_indptr_stride = in[KV_INDPTR].strides[0];
    pa.qo_indptr_stride = in[QO_INDPTR].strides[0];
    pa.r2t_dtype = in[R2T].dtype;
    pa.rpi_dtype = in[RPI].dtype;
    pa.kv_indptr_dtype = in[KV_INDPTR].dtype;
    pa.qo_indptr_dtype = in[QO_INDPTR].dtype;
    int status = QK_OK;
    if (B > 0) /* QKERNELS_CHECK=1: the pool rows (bad_arg stays 0) */
        status = qk_index_check(st, &l, pa.req_pool_indices, pa.rpi_dtype, B, pa.rpi_stride, R, &pa.bad_pos,
                                &pa.bad_value);
    /* B = 0 still runs when there are query rows: they belong to no request and are written as 0 */
    if ((B > 0 || total_q > 0) && Hq > 0 && status == QK_OK)
        QK_RUN(status, &l, attn_prefill, &pa);
    if (status == QK_E_INDEX && pa.bad_arg == 3) ap_raise_rows(&pa);
    else if (status == QK_E_INDEX && pa.bad_arg == 4)
        PyErr_Format(PyExc_ValueError, OP ": mask has Mq = %lld query rows, but sequence %lld has q_len = %lld queries",
                     (long long)pa.mask_rows, (long long)pa.bad_pos, (long long)pa.bad_value);
    else if (status == QK_E_INDEX) qk_attn_raise_pool_index(OP, pa.bad_arg, pa.bad_pos, pa.bad_value, R, max_ctx, S);
    else if (status) qk_raise_status(OP, status);
    else ok = 1;
done:
    return qk_op_finish(&l, launched, &o, &ov, ok, in, n_in);
}
