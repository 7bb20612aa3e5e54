/* message_passing on the CPU: one gated message-passing layer (launch.h has the formulas).
 *
 * Every index is validated first (the first bad one is reported).  The weights are small, so they
 * are packed once into contiguous fp32 rows: each product below is a sum of rows of a weight
 * matrix scaled by one input element (unit-stride, vectorised).  Phase 1 splits the edges evenly:
 * per edge its features, hidden layer, message (normalised into e_out) and gates (into an [E, K]
 * buffer).  Phase 2 splits the nodes by CSR cost: per node the gated sum of its neighbours' rows of
 * x per head, times w_v (each head's columns from its own sum), times w_o, normalised into x_out.
 * Every output is written by one thread in a fixed order, in fp32: the bits do not depend on the
 * thread count. */
#include "cpu.h"
#include "norm.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The packed weights, one block: w1 [3H, F], w_msg [F, H], w_att [F, K], w_v [H, H], w_o [H, H],
 * then b1 [F], b_msg [H], b_att [K] and gamma_x, beta_x, gamma_e, beta_e [H]. */
typedef struct {
    float *w1, *wm, *wa, *wv, *wo, *b1, *bm, *ba, *gx, *bx, *ge, *be;
} mp_weights;

typedef struct {
    const qk_message_passing_args *a;
    mp_weights w;
    float *att;     /* [E, K] */
    float *scratch; /* [threads][per_thread] */
    size_t per_thread;
    int64_t total_cost; /* entries + nodes */
} mp_job;

static void mp_pack(float *dst, const float *src, int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) dst[r * cols + c] = src[r * rs + c * cs];
}

/* y[0 .. n) += s * w[0 .. n) */
QK_INLINE void mp_axpy(float *restrict y, float s, const float *restrict w, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += s * w[i];
}

/* out = b + in [rows] w [rows, cols] (w row-major, contiguous) */
QK_INLINE void mp_affine(float *restrict out, const float *restrict in, const float *restrict w,
                         const float *restrict b, int64_t rows, int64_t cols) {
    memcpy(out, b, sizeof(float) * (size_t)cols);
    for (int64_t r = 0; r < rows; r++) mp_axpy(out, in[r], w + r * cols, cols);
}

/* o[h * os] = LayerNorm(y) * gamma + beta + res[h * rs] over the contiguous row y [H], as
 * fused_norm_residual's contiguous rows */
QK_INLINE void mp_norm_row(float *o, int64_t os, const float *restrict y, const float *res, int64_t rs,
                           const float *restrict gamma, const float *restrict beta, int64_t H, float eps) {
    float shift, mean, rstd;
    nr_stats(y, H, eps, &shift, &mean, &rstd);
    if (os == 1 && rs == 1)
        for (int64_t h = 0; h < H; h++) o[h] = ((y[h] - shift) - mean) * rstd * gamma[h] + beta[h] + res[h];
    else
        for (int64_t h = 0; h < H; h++)
            o[h * os] = ((y[h] - shift) - mean) * rstd * gamma[h] + beta[h] + res[h * rs];
}

QK_MULTIVERSION static void mp_edges(void *p, int tid, int nthreads) {
    const mp_job *j = p;
    const qk_message_passing_args *a = j->a;
    const mp_weights *w = &j->w;
    const int64_t H = a->H, F = a->F, K = a->heads;
    float *ef = j->scratch + (size_t)tid * j->per_thread, *hid = ef + 3 * H, *msg = hid + F;
    const float *x = a->x, *e = a->e;
    float *e_out = a->e_out;
    const int64_t xc = a->x_stride[1], ec = a->e_stride[1];
    int64_t e0, e1;
    qk_share(a->num_edges, tid, nthreads, &e0, &e1);
    for (int64_t i = e0; i < e1; i++) {
        const int64_t s = qk_index(a->edge_index, a->ei_dtype, i * a->ei_stride[1], 1);
        const int64_t d = qk_index(a->edge_index, a->ei_dtype, a->ei_stride[0] + i * a->ei_stride[1], 1);
        const float *xs = x + s * a->x_stride[0], *xd = x + d * a->x_stride[0], *er = e + i * a->e_stride[0];
        for (int64_t h = 0; h < H; h++) {
            const float u = xs[h * xc], v = xd[h * xc];
            ef[h] = u + v;
            ef[H + h] = fabsf(u - v);
            ef[2 * H + h] = er[h * ec];
        }
        mp_affine(hid, ef, w->w1, w->b1, 3 * H, F);
        for (int64_t f = 0; f < F; f++) hid[f] = hid[f] < 0.f ? 0.f : hid[f]; /* relu; NaN stays NaN */
        mp_affine(msg, hid, w->wm, w->bm, F, H);
        float *g = j->att + i * K;
        mp_affine(g, hid, w->wa, w->ba, F, K);
        for (int64_t k = 0; k < K; k++) g[k] = 1.f / (1.f + expf(-g[k]));
        mp_norm_row(e_out + i * H, 1, msg, er, ec, w->ge, w->be, H, a->eps);
    }
}

QK_MULTIVERSION static void mp_nodes(void *p, int tid, int nthreads) {
    const mp_job *j = p;
    const qk_message_passing_args *a = j->a;
    const mp_weights *w = &j->w;
    const int64_t N = a->num_nodes, H = a->H, K = a->heads, D = H / K;
    float *z = j->scratch + (size_t)tid * j->per_thread, *agg = z + K * H, *y = agg + H;
    const float *x = a->x;
    float *x_out = a->x_out;
    const int64_t xc = a->x_stride[1];
    const int64_t n0 = qk_csr_row_at(a->row_ptr, a->csr_dtype, a->rp_stride, N, 0, j->total_cost * tid / nthreads);
    const int64_t n1 = tid == nthreads - 1 ? N
                                           : qk_csr_row_at(a->row_ptr, a->csr_dtype, a->rp_stride, N, 0,
                                                           j->total_cost * (tid + 1) / nthreads);
    for (int64_t n = n0; n < n1; n++) {
        const int64_t begin = qk_index(a->row_ptr, a->csr_dtype, n, a->rp_stride);
        const int64_t end = qk_index(a->row_ptr, a->csr_dtype, n + 1, a->rp_stride);
        memset(z, 0, sizeof(float) * (size_t)(K * H));
        for (int64_t m = begin; m < end; m++) { /* z[k] = sum of att[edge, k] * x[neighbour] */
            const float *xr = x + qk_index(a->col_idx, a->csr_dtype, m, a->ci_stride) * a->x_stride[0];
            const float *g = j->att + qk_index(a->dir_edge, a->csr_dtype, m, a->de_stride) * K;
            for (int64_t k = 0; k < K; k++) {
                if (xc == 1) mp_axpy(z + k * H, g[k], xr, H);
                else
                    for (int64_t h = 0; h < H; h++) z[k * H + h] += g[k] * xr[h * xc];
            }
        }
        memset(agg, 0, sizeof(float) * (size_t)H);
        for (int64_t k = 0; k < K; k++) /* head k's columns of z[k] w_v */
            for (int64_t i = 0; i < H; i++) mp_axpy(agg + k * D, z[k * H + i], w->wv + i * H + k * D, D);
        memset(y, 0, sizeof(float) * (size_t)H);
        for (int64_t i = 0; i < H; i++) mp_axpy(y, agg[i], w->wo + i * H, H);
        mp_norm_row(x_out + n * H, 1, y, x + n * a->x_stride[0], xc, w->gx, w->bx, H, a->eps);
    }
}

/* The first of the n indices idx[offset + i * stride] outside [0, hi): argument arg, its position
 * and value in a->bad_*, QK_E_INDEX. */
static int mp_check_range(const void *idx, int dtype, int64_t n, int64_t offset, int64_t stride, int64_t hi, int arg,
                          qk_message_passing_args *a) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t v = qk_index(idx, dtype, offset + i * stride, 1);
        if (v < 0 || v >= hi) {
            a->bad_arg = arg;
            a->bad_pos = i;
            a->bad_value = v;
            return QK_E_INDEX;
        }
    }
    return QK_OK;
}

/* edge_index's rows, row_ptr, col_idx, dir_edge, in that order (bad_arg 0 .. 4) */
static int mp_check_indices(qk_message_passing_args *a) {
    const int64_t N = a->num_nodes, E = a->num_edges, M = a->num_entries;
    int status = QK_OK;
    for (int row = 0; row < 2 && status == QK_OK; row++)
        status = mp_check_range(a->edge_index, a->ei_dtype, E, row * a->ei_stride[0], a->ei_stride[1], N, row, a);
    if (status == QK_OK) {
        status = qk_csr_check(a->row_ptr, a->csr_dtype, a->rp_stride, N, M, 1, &a->bad_pos, &a->bad_value);
        if (status == QK_E_INDEX) a->bad_arg = 2;
    }
    if (status == QK_OK) status = mp_check_range(a->col_idx, a->csr_dtype, M, 0, a->ci_stride, N, 3, a);
    if (status == QK_OK) status = mp_check_range(a->dir_edge, a->csr_dtype, M, 0, a->de_stride, E, 4, a);
    return status;
}

/* *acc += a * b; nonzero when that or a factor (h * f, ..., each a product of tensor dimensions
 * whose tensors exist, so of at most 2^62) overflows */
static int mp_madd(size_t *acc, size_t a, size_t b) {
    size_t p;
    return __builtin_mul_overflow(a, b, &p) || __builtin_add_overflow(*acc, p, acc);
}

/* A thread count's work estimate, saturated rather than overflowed. */
static int64_t mp_work(double madds) { return madds < 1e18 ? (int64_t)madds : (int64_t)1e18; }

int qk_message_passing_cpu(qk_message_passing_args *a, void *stream) {
    (void)stream;
    const int64_t N = a->num_nodes, E = a->num_edges, M = a->num_entries, H = a->H, F = a->F, K = a->heads;
    if (a->dtype != QK_F32 || (a->ei_dtype != QK_I32 && a->ei_dtype != QK_I64) ||
        (a->csr_dtype != QK_I32 && a->csr_dtype != QK_I64) || K < 1 || H % K != 0)
        return QK_E_UNSUPPORTED;
    int status = mp_check_indices(a);
    if (status != QK_OK || H == 0) return status;

    /* bytes, overflow-checked (stride-0 views can have any shape): the packed weights; per thread
     * ef, hidden and msg (phase 1) or z per head, agg and y (phase 2), apart by a cache line; the gates */
    const size_t h = (size_t)H, f = (size_t)F, k = (size_t)K, fl = sizeof(float);
    const int maxt = a->num_threads > 0 ? a->num_threads : 1;
    size_t weights = 0, edge_need = 0, node_need = 0, per_thread = 16, scratch_n = 0, att_n = 0;
    int over = mp_madd(&weights, 3 * fl, h * f) | mp_madd(&weights, fl, f * h) | mp_madd(&weights, fl, f * k) |
               mp_madd(&weights, 2 * fl, h * h) | mp_madd(&weights, fl, f + 6 * h + k);
    over |= mp_madd(&edge_need, 4, h) | mp_madd(&edge_need, 1, f) | mp_madd(&node_need, k, h) |
            mp_madd(&node_need, 2, h);
    over |= mp_madd(&per_thread, 1, edge_need > node_need ? edge_need : node_need) |
            mp_madd(&scratch_n, per_thread * fl, (size_t)maxt) | mp_madd(&att_n, (size_t)(E > 0 ? E : 1) * fl, k);
    if (over) return QK_E_NOMEM;
    float *block = malloc(weights);
    float *att = malloc(att_n);
    float *scratch = malloc(scratch_n);
    if (!block || !att || !scratch) {
        status = QK_E_NOMEM;
        goto done;
    }
    mp_job j = {.a = a, .att = att, .scratch = scratch, .per_thread = per_thread, .total_cost = M + N};
    mp_weights *w = &j.w;
    w->w1 = block;
    w->wm = w->w1 + 3 * h * f;
    w->wa = w->wm + f * h;
    w->wv = w->wa + f * k;
    w->wo = w->wv + h * h;
    w->b1 = w->wo + h * h;
    w->bm = w->b1 + f;
    w->ba = w->bm + h;
    w->gx = w->ba + k;
    w->bx = w->gx + h;
    w->ge = w->bx + h;
    w->be = w->ge + h;
    mp_pack(w->w1, a->w1, 3 * H, F, a->w1_stride[0], a->w1_stride[1]);
    mp_pack(w->wm, a->w_msg, F, H, a->wm_stride[0], a->wm_stride[1]);
    mp_pack(w->wa, a->w_att, F, K, a->wa_stride[0], a->wa_stride[1]);
    mp_pack(w->wv, a->w_v, H, H, a->wv_stride[0], a->wv_stride[1]);
    mp_pack(w->wo, a->w_o, H, H, a->wo_stride[0], a->wo_stride[1]);
    mp_pack(w->b1, a->b1, 1, F, 0, a->b1_stride);
    mp_pack(w->bm, a->b_msg, 1, H, 0, a->bm_stride);
    mp_pack(w->ba, a->b_att, 1, K, 0, a->ba_stride);
    mp_pack(w->gx, a->gamma_x, 1, H, 0, a->gx_stride);
    mp_pack(w->bx, a->beta_x, 1, H, 0, a->bx_stride);
    mp_pack(w->ge, a->gamma_e, 1, H, 0, a->ge_stride);
    mp_pack(w->be, a->beta_e, 1, H, 0, a->be_stride);

    const double hd = (double)H, per_edge = (double)F * (4.0 * hd + (double)K) + 8.0 * hd;
    const double per_entry = (double)K * hd, per_node = 2.0 * hd * hd + 8.0 * hd;
    if (E > 0) status = qk_parallel_run(qk_threads_for(mp_work((double)E * per_edge), maxt), mp_edges, &j);
    if (status == QK_OK && N > 0)
        status = qk_parallel_run(qk_threads_for(mp_work((double)M * per_entry + (double)N * per_node), maxt), mp_nodes,
                                 &j);
done:
    free(block);
    free(att);
    free(scratch);
    return status;
}
