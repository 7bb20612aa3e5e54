/* message_passing(x, e, edge_index, row_ptr, col_idx, dir_edge, w1, b1, w_msg, b_msg, w_att, b_att, w_v, w_o,
 * gamma_x, beta_x, gamma_e, beta_e, *, eps=1e-5, stream=None) -> (x_out, e_out) */
#include "../qk.h"
#include "../cpu/cpu.h"

#define OP "message_passing"

QK_DOCS(message_passing,
    "x, e, edge_index, row_ptr, col_idx, dir_edge, w1, b1, w_msg, b_msg, w_att, b_att, w_v, w_o, gamma_x, beta_x, "
    "gamma_e, beta_e, *, eps=1e-5",
    "One layer of a gated message-passing network, fused (forward, inference) -> (x_out [N, H], e_out [E, H]).\n\n"
    "With src, dst = edge_index [2, E]:\n"
    "  h = relu(cat(x[src] + x[dst], |x[src] - x[dst]|, e) @ w1 + b1)         [E, F]\n"
    "  msg = h @ w_msg + b_msg;  att = sigmoid(h @ w_att + b_att)             [E, H], [E, K]\n"
    "  agg[n, k] = sum over row_ptr[n] <= j < row_ptr[n + 1] of att[dir_edge[j], k] * (x @ w_v)[col_idx[j], k]\n"
    "  x_out = LayerNorm(agg.view(N, H) @ w_o) * gamma_x + beta_x + x\n"
    "  e_out = LayerNorm(msg) * gamma_e + beta_e + e\n"
    "the heads k splitting H into K = w_att.shape[1] blocks of H/K channels (K must divide H).  Shapes:\n"
    "x [N, H], e [E, H], row_ptr [N + 1] (from 0 to M), col_idx and dir_edge [M], w1 [3H, F], b1 [F],\n"
    "w_msg [F, H], b_msg [H], w_att [F, K], b_att [K], w_v and w_o [H, H], gamma_x, beta_x, gamma_e,\n"
    "beta_e [H].  LayerNorm as fused_norm_residual's (population variance, eps on the variance).\n"
    "float32 only (fp32 arithmetic); edge_index, row_ptr and dir_edge int32 or int64 each, col_idx of\n"
    "row_ptr's dtype.  Any strides; the outputs are fresh and contiguous.  Deterministic: the\n"
    "same bits for any thread count.  A bad index is refused on cpu (ValueError naming it); on cuda\n"
    "it is skipped (a zero row), and QKERNELS_CHECK=1 validates every index first.")

enum { X, EE, EI, RP, CI, DE, W1, B1, WM, BM, WA, BA, WV, WO, GX, BX, GE, BE, NUM_INPUTS };

static const char *const mp_names[] = {"x",     "e",     "edge_index", "row_ptr", "col_idx", "dir_edge",
                                       "w1",    "b1",    "w_msg",      "b_msg",   "w_att",   "b_att",
                                       "w_v",   "w_o",   "gamma_x",    "beta_x",  "gamma_e", "beta_e"};

/* Every argument's rank and dtype (float32 tensors; the index tensors int32 or int64, col_idx of
 * row_ptr's dtype), then the sizes each shares with the others. */
static int mp_check(const qk_view *in) {
    static const int ndim[NUM_INPUTS] = {2, 2, 2, 1, 1, 1, 2, 1, 2, 1, 2, 1, 2, 2, 1, 1, 1, 1};
    static const char *const layout[NUM_INPUTS] = {"[N, H]", "[E, H]", "[2, E]", "[N + 1]", "[M]", "[M]",
                                                   "[3H, F]", "[F]", "[F, H]", "[H]", "[F, K]", "[K]",
                                                   "[H, H]", "[H, H]", "[H]", "[H]", "[H]", "[H]"};
    for (int i = 0; i < NUM_INPUTS; i++)
        if (qk_check_ndim(OP, mp_names[i], &in[i], ndim[i], "%s", layout[i]) < 0) return -1;
    for (int i = 0; i < NUM_INPUTS; i++) {
        if (i == EI || i == RP || i == DE) {
            if (qk_check_dtype_index(OP, mp_names[i], &in[i]) < 0) return -1;
        } else if (i == CI) {
            if (qk_check_same_dtype(OP, mp_names[i], &in[i], "row_ptr's", &in[RP]) < 0) return -1;
        } else if (in[i].dtype != QK_F32) {
            PyErr_Format(PyExc_TypeError, OP ": %s must be float32, got %s", mp_names[i], qk_dtype_name(in[i].dtype));
            return -1;
        }
    }
    const int64_t N = in[X].shape[0], H = in[X].shape[1], E = in[EE].shape[0], M = in[CI].shape[0];
    const int64_t F = in[W1].shape[1], K = in[WA].shape[1];
    int64_t H3, N1;
    if (__builtin_mul_overflow(H, (int64_t)3, &H3) || __builtin_add_overflow(N, (int64_t)1, &N1)) {
        PyErr_Format(PyExc_ValueError, OP ": x of shape [%lld, %lld] is too large (3H or N + 1 overflows)",
                     (long long)N, (long long)H);
        return -1;
    }
    if (qk_check_dim(OP, "e", &in[EE], 1, H, "[E, H] = [%lld, %lld]", (long long)E, (long long)H) < 0 ||
        qk_check_dim(OP, "edge_index", &in[EI], 0, 2, "[2, E] = [2, %lld]", (long long)E) < 0 ||
        qk_check_dim(OP, "edge_index", &in[EI], 1, E, "[2, E] = [2, %lld]", (long long)E) < 0 ||
        qk_check_dim(OP, "row_ptr", &in[RP], 0, N1, "[N + 1] = [%lld]", (long long)N1) < 0 ||
        qk_check_dim(OP, "dir_edge", &in[DE], 0, M, "[M] = [%lld]", (long long)M) < 0 ||
        qk_check_dim(OP, "w1", &in[W1], 0, H3, "[3H, F] = [%lld, %lld]", (long long)H3, (long long)F) < 0 ||
        qk_check_dim(OP, "b1", &in[B1], 0, F, "[F] = [%lld]", (long long)F) < 0)
        return -1;
    for (int d = 0; d < 2; d++)
        if (qk_check_dim(OP, "w_msg", &in[WM], d, d ? H : F, "[F, H] = [%lld, %lld]", (long long)F, (long long)H) < 0 ||
            qk_check_dim(OP, "w_v", &in[WV], d, H, "[H, H] = [%lld, %lld]", (long long)H, (long long)H) < 0 ||
            qk_check_dim(OP, "w_o", &in[WO], d, H, "[H, H] = [%lld, %lld]", (long long)H, (long long)H) < 0)
            return -1;
    if (qk_check_dim(OP, "b_msg", &in[BM], 0, H, "[H] = [%lld]", (long long)H) < 0 ||
        qk_check_dim(OP, "w_att", &in[WA], 0, F, "[F, K] = [%lld, %lld]", (long long)F, (long long)K) < 0 ||
        qk_check_dim(OP, "b_att", &in[BA], 0, K, "[K] = [%lld]", (long long)K) < 0)
        return -1;
    for (int i = GX; i <= BE; i++)
        if (qk_check_dim(OP, mp_names[i], &in[i], 0, H, "[H] = [%lld]", (long long)H) < 0) return -1;
    if (K < 1 || H % K != 0) {
        PyErr_Format(PyExc_ValueError,
                     OP ": the number of heads K = w_att.shape[1] = %lld must be >= 1 and divide H = %lld",
                     (long long)K, (long long)H);
        return -1;
    }
    return 0;
}

/* QKERNELS_CHECK=1 on cuda: every index validated before the kernel follows it, in the cpu launcher's
 * order (edge_index's rows, row_ptr, col_idx, dir_edge); QK_E_INDEX with a->bad_* filled. */
static int mp_check_cuda(const qk_state *st, const qk_launch *l, qk_message_passing_args *a) {
    if (l->device_type != kDLCUDA || !st->check_indices) return QK_OK;
    const int64_t N = a->num_nodes, E = a->num_edges, M = a->num_entries;
    const int64_t ei_row = a->ei_stride[0] * (int64_t)qk_dtype_size(a->ei_dtype);
    const int64_t csr = (int64_t)qk_dtype_size(a->csr_dtype);
    int status = QK_OK;
    for (int row = 0; row < 2 && status == QK_OK; row++) {
        status = qk_index_check(st, l, (const char *)a->edge_index + row * ei_row, a->ei_dtype, E, a->ei_stride[1], N,
                                &a->bad_pos, &a->bad_value);
        a->bad_arg = row;
    }
    if (status != QK_OK) return status;
    a->bad_arg = 2; /* row_ptr[0] must be 0 and row_ptr[N] M; in between, sparse_aggregate's check */
    status = l->cuda->index_check(a->row_ptr, a->csr_dtype, 1, 1, 0, 1, &a->bad_pos, &a->bad_value, l->stream);
    if (status == QK_OK) {
        status = l->cuda->index_check((const char *)a->row_ptr + N * a->rp_stride * csr, a->csr_dtype, 1, 1,
                                      M, M + 1, &a->bad_pos, &a->bad_value, l->stream);
        a->bad_pos = N;
    }
    if (status == QK_OK) {
        qk_sparse_aggregate_args sa = {0};
        sa.row_ptr = a->row_ptr;
        sa.col_idx = a->col_idx;
        sa.num_dst = N;
        sa.num_src = N;
        sa.num_edges = M;
        sa.row_ptr_stride = a->rp_stride;
        sa.col_idx_stride = a->ci_stride;
        sa.index_dtype = a->csr_dtype;
        status = l->cuda->sparse_aggregate_check(&sa, l->stream);
        a->bad_arg = sa.bad_arg == 0 ? 2 : 3;
        a->bad_pos = sa.bad_pos;
        a->bad_value = sa.bad_value;
    }
    if (status != QK_OK) return status;
    a->bad_arg = 4;
    return qk_index_check(st, l, a->dir_edge, a->de_dtype, M, a->de_stride, E, &a->bad_pos, &a->bad_value);
}

static int mp_raise_index(const qk_message_passing_args *a) {
    const long long pos = (long long)a->bad_pos, v = (long long)a->bad_value;
    switch (a->bad_arg) {
    case 0:
    case 1:
        PyErr_Format(PyExc_ValueError, OP ": edge_index[%d, %lld] = %lld is out of range for x with N = %lld",
                     a->bad_arg, pos, v, (long long)a->num_nodes);
        break;
    case 2:
        PyErr_Format(PyExc_ValueError,
                     OP ": row_ptr must be non-decreasing from row_ptr[0] = 0 to row_ptr[N] = M = %lld; "
                     "row_ptr[%lld] = %lld", (long long)a->num_entries, pos, v);
        break;
    case 3:
        PyErr_Format(PyExc_ValueError, OP ": col_idx[%lld] = %lld is out of range for x with N = %lld", pos, v,
                     (long long)a->num_nodes);
        break;
    default:
        PyErr_Format(PyExc_ValueError, OP ": dir_edge[%lld] = %lld is out of range for e with E = %lld", pos, v,
                     (long long)a->num_edges);
    }
    return -1;
}

PyObject *qk_op_message_passing(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"x",     "e",     "edge_index", "row_ptr", "col_idx", "dir_edge", "w1",
                                        "b1",    "w_msg", "b_msg",      "w_att",   "b_att",   "w_v",      "w_o",
                                        "gamma_x", "beta_x", "gamma_e", "beta_e",  "eps",     "stream",   NULL};
    qk_state *st = qk_get_state(module);
    PyObject *a[NUM_INPUTS + 2] = {NULL};
    if (qk_parse_args(OP, args, nargs, kwnames, names, NUM_INPUTS, NUM_INPUTS, a) < 0) return NULL;
    void *stream;
    int stream_given;
    double eps;
    if (qk_stream_arg(OP, a[NUM_INPUTS + 1], &stream, &stream_given) < 0 ||
        qk_float_arg(OP, "eps", a[NUM_INPUTS], 1e-5, &eps) < 0 || qk_eps_check(OP, eps, a[NUM_INPUTS]) < 0)
        return NULL;
    qk_view in[NUM_INPUTS] = {{0}}, ov[2] = {{0}};
    qk_output o[2] = {{0}};
    qk_launch l = {0};
    int ok = 0, launched = 0, n_in = 0;
    if (qk_import_all(st, OP, a, mp_names, NUM_INPUTS, stream, in, &n_in) < 0 || mp_check(in) < 0) goto done;
    if (qk_launch_begin(st, OP, &in[X], stream, stream_given, &l) < 0) goto done;
    launched = 1;
    const int64_t N = in[X].shape[0], H = in[X].shape[1], E = in[EE].shape[0];
    const int64_t x_shape[2] = {N, H}, e_shape[2] = {E, H};
    if (qk_output_prepare(st, OP, NULL, &in[X], QK_F32, 2, x_shape, &l, &ov[0], &o[0]) < 0 ||
        qk_output_prepare(st, OP, NULL, &in[X], QK_F32, 2, e_shape, &l, &ov[1], &o[1]) < 0)
        goto done;

    qk_message_passing_args mp = {0};
    mp.x = in[X].data;
    mp.e = in[EE].data;
    mp.edge_index = in[EI].data;
    mp.row_ptr = in[RP].data;
    mp.col_idx = in[CI].data;
    mp.dir_edge = in[DE].data;
    mp.w1 = in[W1].data;
    mp.b1 = in[B1].data;
    mp.w_msg = in[WM].data;
    mp.b_msg = in[BM].data;
    mp.w_att = in[WA].data;
    mp.b_att = in[BA].data;
    mp.w_v = in[WV].data;
    mp.w_o = in[WO].data;
    mp.gamma_x = in[GX].data;
    mp.beta_x = in[BX].data;
    mp.gamma_e = in[GE].data;
    mp.beta_e = in[BE].data;
    mp.x_out = ov[0].data;
    mp.e_out = ov[1].data;
    mp.num_nodes = N;
    mp.num_edges = E;
    mp.num_entries = in[CI].shape[0];
    mp.H = H;
    mp.F = in[W1].shape[1];
    mp.heads = in[WA].shape[1];
    for (int i = 0; i < 2; i++) {
        mp.x_stride[i] = in[X].strides[i];
        mp.e_stride[i] = in[EE].strides[i];
        mp.ei_stride[i] = in[EI].strides[i];
        mp.w1_stride[i] = in[W1].strides[i];
        mp.wm_stride[i] = in[WM].strides[i];
        mp.wa_stride[i] = in[WA].strides[i];
        mp.wv_stride[i] = in[WV].strides[i];
        mp.wo_stride[i] = in[WO].strides[i];
    }
    mp.rp_stride = in[RP].strides[0];
    mp.ci_stride = in[CI].strides[0];
    mp.de_stride = in[DE].strides[0];
    mp.b1_stride = in[B1].strides[0];
    mp.bm_stride = in[BM].strides[0];
    mp.ba_stride = in[BA].strides[0];
    mp.gx_stride = in[GX].strides[0];
    mp.bx_stride = in[BX].strides[0];
    mp.ge_stride = in[GE].strides[0];
    mp.be_stride = in[BE].strides[0];
    mp.eps = (float)eps;
    mp.ei_dtype = in[EI].dtype;
    mp.csr_dtype = in[RP].dtype;
    mp.de_dtype = in[DE].dtype;
    mp.dtype = QK_F32;
    mp.num_threads = st->num_threads;

    int status = mp_check_cuda(st, &l, &mp);
    /* the cpu launcher validates the indices even when there is nothing to write */
    if (status == QK_OK && (l.device_type != kDLCUDA || (H > 0 && (N > 0 || E > 0))))
        QK_RUN(status, &l, message_passing, &mp);
    if (status == QK_E_INDEX) mp_raise_index(&mp);
    else ok = qk_raise_status(OP, status) == 0;
done:
    return qk_op_finish_many(&l, launched, o, ov, 2, ok, in, n_in);
}
