/* rotary_kv_append(q, k, v, cos_sin, positions, k_pool, v_pool, slots, *, interleaved=True, out=None,
 * stream=None): argument checks, then the CPU or CUDA launcher by device.  The pools are written in place
 * (a torch pool's version moves, as an in-place torch op's does); out may be q itself.  Index values are
 * checked by the CPU launcher, on cuda under QKERNELS_CHECK=1 (ranges only), as the paged attention
 * ops do. */
#include "../qk.h"
#include "../cpu/cpu.h"

#define OP "rotary_kv_append"

QK_DOCS(rotary_kv_append, "q, k, v, cos_sin, positions, k_pool, v_pool, slots, *, interleaved=True, out=None",
    "Rotary embedding of q and k at each token's position, and the KV-cache append, in one pass.\n\n"
    "q [T, Hq, D], k and v [T, Hkv, D] (D even), cos_sin float32 [max_pos, D/2, 2] holding (cos, sin) per\n"
    "position and pair, positions [T] and slots [T] (int32 or int64), k_pool and v_pool [S, Hkv, D] token\n"
    "pools -> q rotated, [T, Hq, D].  k rotated is written to k_pool[slots[t]] and v to v_pool[slots[t]]\n"
    "(in place).  The rotation is rotary_emb's with freqs_cis = cos_sin[positions] (interleaved=True:\n"
    "pairs (x[2i], x[2i+1]); False: rotate-half (NeoX) pairs (x[i], x[i + D/2])), in fp32, rounded once.\n"
    "A contiguous cache [B, L, Hkv, D] is the pool [B*L, Hkv, D] with slot b*L + position.  Slots must be\n"
    "distinct; out may be q (in place); the pools overlap no other argument.  bfloat16/float16 on cuda,\n"
    "also float32 on cpu; rows may be strided, last dimensions unit-stride.  Index values are checked on\n"
    "cpu; on cuda a bad position zeroes the token's rows of the result and a bad slot skips its append\n"
    "(QKERNELS_CHECK=1 raises instead).  backend= picks cuda or cpu (see qkernels.explain).")

enum { Q, K, V, CS, POS, KP, VP, SLOTS, NUM_INPUTS };

static void rka_raise_index(const qk_rotary_kv_append_args *a) {
    if (a->bad_arg == 0)
        PyErr_Format(PyExc_ValueError, OP ": positions[%lld] = %lld is out of range for cos_sin with max_pos = %lld rows",
                     (long long)a->bad_pos, (long long)a->bad_value, (long long)a->max_pos);
    else if (a->bad_arg == 1)
        PyErr_Format(PyExc_ValueError, OP ": slots[%lld] = %lld is out of range for the KV pools with S = %lld slots",
                     (long long)a->bad_pos, (long long)a->bad_value, (long long)a->S);
    else
        PyErr_Format(PyExc_ValueError,
                     OP ": slots[%lld] = slots[%lld] = %lld: two tokens would write one pool slot; give each token "
                        "its own slot",
                     (long long)a->bad_other, (long long)a->bad_pos, (long long)a->bad_value);
}

/* A pool: [S, Hkv, D] of q's dtype, unit-stride rows, writable, distinct elements. */
static int rka_check_pool(const char *name, const qk_view *p, const qk_view *q, int64_t Hkv, const qk_view *like) {
    const int64_t D = q->shape[2];
    /* like: the k pool the v pool must match; NULL for the k pool itself */
#define POOL_LAYOUT "[S, Hkv, D] = [%lld, %lld, %lld]", (long long)(like ? like->shape[0] : p->shape[0]), (long long)Hkv, \
                    (long long)D
    if (qk_check_ndim(OP, name, p, 3, "[S, Hkv, D]") < 0 || qk_check_same_dtype(OP, name, p, "q's", q) < 0 ||
        qk_check_dim(OP, name, p, 2, D, POOL_LAYOUT) < 0 || qk_check_dim(OP, name, p, 1, Hkv, POOL_LAYOUT) < 0 ||
        (like && qk_check_dim(OP, name, p, 0, like->shape[0], POOL_LAYOUT) < 0) || qk_check_inner_unit(OP, name, p) < 0)
        return -1;
#undef POOL_LAYOUT
    if (p->readonly) {
        PyErr_Format(PyExc_BufferError, OP ": %s is read-only, but the new tokens are written into it", name);
        return -1;
    }
    for (int d = 0; d < 3; d++)
        if (p->shape[0] && p->shape[1] && p->shape[2] && p->strides[d] == 0 && p->shape[d] > 1) {
            PyErr_Format(PyExc_ValueError,
                         OP ": %s has stride 0 in dimension %d, so its elements overlap, but each is written; pass a "
                            "tensor with distinct elements", name, d);
            return -1;
        }
    return 0;
}

PyObject *qk_op_rotary_kv_append(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"q", "k", "v", "cos_sin", "positions", "k_pool", "v_pool", "slots",
                                        "interleaved", "out", "stream", NULL};
    qk_state *st = qk_get_state(module);
    PyObject *a[11] = {NULL};
    if (qk_parse_args(OP, args, nargs, kwnames, names, NUM_INPUTS, NUM_INPUTS, a) < 0) return NULL;
    void *stream;
    int stream_given, interleaved;
    if (qk_stream_arg(OP, a[10], &stream, &stream_given) < 0 || qk_bool_arg(OP, "interleaved", a[8], 1, &interleaved) < 0)
        return NULL;

    qk_view in[NUM_INPUTS] = {{0}}, ov = {0};
    qk_output o = {0};
    qk_launch l = {0};
    int ok = 0, launched = 0, n_in = 0;
    if (qk_import_all(st, OP, a, names, NUM_INPUTS, stream, in, &n_in) < 0) goto done;
    const qk_view *q = &in[Q];
    if (qk_check_ndim(OP, "q", q, 3, "[T, Hq, D]") < 0 || qk_check_dtype_llm(OP, "q", q) < 0) goto done;
    const int64_t T = q->shape[0], Hq = q->shape[1], D = q->shape[2];
    if (D % 2) {
        PyErr_Format(PyExc_ValueError, OP ": q's last dimension D = %lld must be even (pairs are rotated)", (long long)D);
        goto done;
    }
    if (qk_check_ndim(OP, "k", &in[K], 3, "[T, Hkv, D]") < 0 || qk_check_same_dtype(OP, "k", &in[K], "q's", q) < 0)
        goto done;
    const int64_t Hkv = in[K].shape[1];
#define KV_LAYOUT "[T, Hkv, D] = [%lld, %lld, %lld]", (long long)T, (long long)Hkv, (long long)D
    if (qk_check_dim(OP, "k", &in[K], 0, T, KV_LAYOUT) < 0 || qk_check_dim(OP, "k", &in[K], 2, D, KV_LAYOUT) < 0 ||
        qk_check_ndim(OP, "v", &in[V], 3, "[T, Hkv, D]") < 0 || qk_check_same_dtype(OP, "v", &in[V], "q's", q) < 0)
        goto done;
    for (int d = 0; d < 3; d++)
        if (qk_check_dim(OP, "v", &in[V], d, in[K].shape[d], KV_LAYOUT) < 0) goto done;
#undef KV_LAYOUT
    if (in[CS].dtype != QK_F32) {
        PyErr_Format(PyExc_TypeError, OP ": cos_sin must be float32, got %s", qk_dtype_name(in[CS].dtype));
        goto done;
    }
    if (qk_check_ndim(OP, "cos_sin", &in[CS], 3, "[max_pos, D/2, 2]") < 0 ||
        qk_check_dim(OP, "cos_sin", &in[CS], 1, D / 2, "[max_pos, D/2, 2] = [max_pos, %lld, 2]", (long long)(D / 2)) < 0 ||
        qk_check_dim(OP, "cos_sin", &in[CS], 2, 2, "[max_pos, D/2, 2] = [max_pos, %lld, 2]", (long long)(D / 2)) < 0)
        goto done;
    if (rka_check_pool("k_pool", &in[KP], q, Hkv, NULL) < 0 || rka_check_pool("v_pool", &in[VP], q, Hkv, &in[KP]) < 0)
        goto done;
    const int64_t S = in[KP].shape[0];
    static const int idx_args[2] = {POS, SLOTS};
    for (int i = 0; i < 2; i++) {
        const qk_view *v = &in[idx_args[i]];
        const char *name = names[idx_args[i]];
        if (qk_check_ndim(OP, name, v, 1, "[T]") < 0 || qk_check_dtype_index(OP, name, v) < 0 ||
            qk_check_dim(OP, name, v, 0, T, "[T] = [%lld]", (long long)T) < 0)
            goto done;
    }
    if (qk_check_inner_unit(OP, "q", q) < 0 || qk_check_inner_unit(OP, "k", &in[K]) < 0 ||
        qk_check_inner_unit(OP, "v", &in[V]) < 0 || qk_check_inner_unit(OP, "cos_sin", &in[CS]) < 0)
        goto done;
    for (int p = KP; p <= VP; p++)
        for (int i = 0; i < NUM_INPUTS; i++)
            if (i != p && !(p == VP && i == KP) && qk_views_overlap(&in[p], &in[i])) {
                PyErr_Format(PyExc_ValueError,
                             OP ": %s overlaps %s in memory, but the pools are written while the other arguments are "
                                "read; pass separate tensors", names[p], names[i]);
                goto done;
            }
    if (qk_launch_begin(st, OP, q, stream, stream_given, &l) < 0) goto done;
    launched = 1;
    if (qk_output_prepare(st, OP, a[9], q, q->dtype, 3, q->shape, &l, &ov, &o) < 0 ||
        qk_out_overlap(OP, &ov, in, names, NUM_INPUTS, 1u << Q) < 0 || qk_check_inner_unit(OP, "out", &ov) < 0)
        goto done;

    qk_rotary_kv_append_args ra = {0};
    ra.q = q->data, ra.k = in[K].data, ra.v = in[V].data;
    ra.out = ov.data, ra.k_pool = in[KP].data, ra.v_pool = in[VP].data;
    ra.cos_sin = (const float *)in[CS].data;
    ra.positions = in[POS].data, ra.slots = in[SLOTS].data;
    ra.T = T, ra.Hq = Hq, ra.Hkv = Hkv, ra.D = D, ra.max_pos = in[CS].shape[0], ra.S = S;
    for (int i = 0; i < 2; i++) {
        ra.q_stride[i] = q->strides[i];
        ra.k_stride[i] = in[K].strides[i];
        ra.v_stride[i] = in[V].strides[i];
        ra.out_stride[i] = ov.strides[i];
        ra.kp_stride[i] = in[KP].strides[i];
        ra.vp_stride[i] = in[VP].strides[i];
        ra.cs_stride[i] = in[CS].strides[i];
    }
    ra.pos_stride = in[POS].strides[0], ra.slot_stride = in[SLOTS].strides[0];
    ra.interleaved = interleaved;
    ra.dtype = q->dtype, ra.pos_dtype = in[POS].dtype, ra.slot_dtype = in[SLOTS].dtype;
    ra.num_threads = st->num_threads;
    int status = QK_OK;
    const int work = T > 0 && D > 0 && (Hq > 0 || Hkv > 0);
    if (work) { /* QKERNELS_CHECK=1 on cuda: the ranges (the CPU launcher checks them itself) */
        status = qk_index_check(st, &l, ra.positions, ra.pos_dtype, T, ra.pos_stride, ra.max_pos, &ra.bad_pos,
                                &ra.bad_value);
        if (status == QK_OK) {
            status = qk_index_check(st, &l, ra.slots, ra.slot_dtype, T, ra.slot_stride, S, &ra.bad_pos, &ra.bad_value);
            ra.bad_arg = status == QK_E_INDEX;
        }
    }
    if (work && status == QK_OK) QK_RUN(status, &l, rotary_kv_append, &ra);
    if (status == QK_E_INDEX) {
        rka_raise_index(&ra);
    } else if (status) {
        qk_raise_status(OP, status);
    } else {
        ok = 1;
        PyObject *bump = work && Hkv > 0 ? qk_version_bumper(st, a[KP]) : NULL; /* borrowed */
        if (bump) {
            PyObject *pools = PyTuple_Pack(2, a[KP], a[VP]);
            PyObject *moved = pools ? PyObject_CallOneArg(bump, pools) : NULL;
            Py_XDECREF(pools);
            ok = moved != NULL;
            Py_XDECREF(moved);
        }
    }
done:
    return qk_op_finish(&l, launched, &o, &ov, ok, in, n_in);
}
