/* message_passing on the CPU: one gated message-passing layer (launch.h has the formulas).
 *
 * Every index is validated first (the first bad one is reported).  The weights are small, so they
 * are packed once into contiguous fp32 blocks whose rows are padded to whole tiles of MP_C columns
 * (zeros): every product is then a tile of MP_R rows times MP_C columns held in registers while
 * the weight rows stream past, each output summed over its inner index in order from its bias.
 * Phase 1 splits the edges evenly: per edge its features, hidden layer, message (normalised into
 * e_out) and gates (into an [E, K] buffer).  Phase 2 splits the nodes by CSR cost: per node the
 * gated sum of its neighbours' rows of x per head, times head k's columns of w_v, times w_o,
 * normalised into x_out.  Every output is written by one thread, and no row's value depends on the
 * rows it shares a tile with: the bits do not depend on the thread count. */
#include "cpu.h"
#include "norm.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { MP_R = 4, MP_C = 16 }; /* a tile: rows (edges or nodes) by columns */

/* n rounded up to whole tiles of columns */
static inline int64_t mp_cols(int64_t n) { return (n + MP_C - 1) / MP_C * MP_C; }

/* The packed weights, one block, rows padded with zeros to the widths below: w1 [3H, Fp], then
 * w_msg and w_att side by side [F, Cm] (msg columns 0 .. H-1, gates H .. H+K-1), w_v per head
 * [K][H, Dp] (head k's columns), w_o [H, Hp]; b1 [Fp], b_msg and b_att side by side [Cm]; gamma_x,
 * beta_x, gamma_e, beta_e [H]. */
typedef struct {
    float *w1, *wma, *wv, *wo, *b1, *bma, *gx, *bx, *ge, *be;
    int64_t Fp, Cm, Dp, Hp;
} mp_weights;

typedef struct {
    const qk_message_passing_args *a;
    mp_weights w;
    float *att;     /* [E, K] */
    float *scratch; /* [threads][per_thread] */
    size_t per_thread;
    int64_t total_cost; /* entries + nodes */
} mp_job;

/* dst [rows, ld] = src [rows, cols] (strides rs, cs), the columns past cols zero */
static void mp_pack(float *dst, int64_t ld, const float *src, int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < ld; c++) dst[r * ld + c] = c < cols ? src[r * rs + c * cs] : 0.f;
}

/* A row of a tile, one vector (GCC's vector extension: one AVX-512 register, two AVX2 or four SSE
 * ones), so that the tile's accumulators stay in registers. */
typedef float mp_vec __attribute__((vector_size(MP_C * sizeof(float))));

/* out[r, c] = bias[c] (0 without) + sum over i < inner, in order, of in[r, i] * w[i, c], for MP_R rows
 * and cols columns (a multiple of MP_C; w's rows and out's are cols wide). */
QK_INLINE void mp_tile(float *restrict out, const float *restrict in, int64_t ldi, const float *restrict w,
                       const float *restrict bias, int64_t inner, int64_t cols) {
    for (int64_t c0 = 0; c0 < cols; c0 += MP_C) {
        mp_vec acc[MP_R], b = {0};
        if (bias) memcpy(&b, bias + c0, sizeof b);
        for (int r = 0; r < MP_R; r++) acc[r] = b;
        for (int64_t i = 0; i < inner; i++) {
            mp_vec wr;
            memcpy(&wr, w + i * cols + c0, sizeof wr);
            for (int r = 0; r < MP_R; r++) acc[r] += in[r * ldi + i] * wr;
        }
        for (int r = 0; r < MP_R; r++) memcpy(out + r * cols + c0, &acc[r], sizeof acc[r]);
    }
}

/* y[0 .. n) += s * w[0 .. n) */
QK_INLINE void mp_axpy(float *restrict y, float s, const float *restrict w, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += s * w[i];
}

/* o[h] = LayerNorm(y) * gamma + beta + res[h * rs] over the contiguous row y [H], as
 * fused_norm_residual's contiguous rows */
QK_INLINE void mp_norm_row(float *restrict o, const float *restrict y, const float *res, int64_t rs,
                           const float *restrict gamma, const float *restrict beta, int64_t H, float eps) {
    float shift, mean, rstd;
    nr_stats(y, H, eps, &shift, &mean, &rstd);
    if (rs == 1)
        for (int64_t h = 0; h < H; h++) o[h] = ((y[h] - shift) - mean) * rstd * gamma[h] + beta[h] + res[h];
    else
        for (int64_t h = 0; h < H; h++) o[h] = ((y[h] - shift) - mean) * rstd * gamma[h] + beta[h] + res[h * rs];
}

/* Phase 1 per thread: ef [MP_R, 3H], hidden [MP_R, Fp], msg and gates [MP_R, Cm] */
static size_t mp_edge_floats(int64_t H, const mp_weights *w) { return MP_R * (size_t)(3 * H + w->Fp + w->Cm); }

/* Phase 2 per thread: z [MP_R, K, H], agg [MP_R, H], one head's product [MP_R, Dp], y [MP_R, Hp] */
static size_t mp_node_floats(int64_t H, int64_t K, const mp_weights *w) {
    return MP_R * (size_t)(K * H + H + w->Dp + w->Hp);
}

QK_MULTIVERSION static void mp_edges(void *p, int tid, int nthreads) {
    const mp_job *j = p;
    const qk_message_passing_args *a = j->a;
    const mp_weights *w = &j->w;
    const int64_t H = a->H, F = a->F, K = a->heads, Fp = w->Fp, Cm = w->Cm;
    float *ef = j->scratch + (size_t)tid * j->per_thread, *hid = ef + MP_R * 3 * H, *mo = hid + MP_R * Fp;
    const float *x = a->x, *e = a->e;
    float *e_out = a->e_out;
    const int64_t xc = a->x_stride[1], ec = a->e_stride[1];
    int64_t e0, e1;
    qk_share(a->num_edges, tid, nthreads, &e0, &e1);
    for (int64_t i0 = e0; i0 < e1; i0 += MP_R) {
        const int nb = e1 - i0 < MP_R ? (int)(e1 - i0) : MP_R;
        for (int r = 0; r < MP_R; r++) {
            float *f = ef + r * 3 * H;
            if (r >= nb) { /* a partial tile: rows of zeros, computed and dropped */
                memset(f, 0, sizeof(float) * (size_t)(3 * H));
                continue;
            }
            const int64_t i = i0 + r;
            const int64_t s = qk_index(a->edge_index, a->ei_dtype, i * a->ei_stride[1], 1);
            const int64_t d = qk_index(a->edge_index, a->ei_dtype, a->ei_stride[0] + i * a->ei_stride[1], 1);
            const float *xs = x + s * a->x_stride[0], *xd = x + d * a->x_stride[0], *er = e + i * a->e_stride[0];
            for (int64_t h = 0; h < H; h++) {
                const float u = xs[h * xc], v = xd[h * xc];
                f[h] = u + v;
                f[H + h] = fabsf(u - v);
                f[2 * H + h] = er[h * ec];
            }
        }
        mp_tile(hid, ef, 3 * H, w->w1, w->b1, 3 * H, Fp);
        for (int64_t c = 0; c < MP_R * Fp; c++) hid[c] = hid[c] < 0.f ? 0.f : hid[c]; /* relu; NaN stays NaN */
        mp_tile(mo, hid, Fp, w->wma, w->bma, F, Cm);
        for (int r = 0; r < nb; r++) {
            const int64_t i = i0 + r;
            const float *m = mo + r * Cm;
            float *g = j->att + i * K;
            for (int64_t k = 0; k < K; k++) g[k] = 1.f / (1.f + expf(-m[H + k]));
            mp_norm_row(e_out + i * H, m, e + i * a->e_stride[0], ec, w->ge, w->be, H, a->eps);
        }
    }
}

QK_MULTIVERSION static void mp_nodes(void *p, int tid, int nthreads) {
    const mp_job *j = p;
    const qk_message_passing_args *a = j->a;
    const mp_weights *w = &j->w;
    const int64_t N = a->num_nodes, H = a->H, K = a->heads, D = H / K, Dp = w->Dp, Hp = w->Hp;
    float *z = j->scratch + (size_t)tid * j->per_thread, *agg = z + MP_R * K * H, *t = agg + MP_R * H,
          *y = t + MP_R * Dp;
    const float *x = a->x;
    float *x_out = a->x_out;
    const int64_t xc = a->x_stride[1];
    const int64_t n0 = qk_csr_row_at(a->row_ptr, a->csr_dtype, a->rp_stride, N, 0, j->total_cost * tid / nthreads);
    const int64_t n1 = tid == nthreads - 1 ? N
                                           : qk_csr_row_at(a->row_ptr, a->csr_dtype, a->rp_stride, N, 0,
                                                           j->total_cost * (tid + 1) / nthreads);
    for (int64_t m0 = n0; m0 < n1; m0 += MP_R) {
        const int nb = n1 - m0 < MP_R ? (int)(n1 - m0) : MP_R;
        memset(z, 0, sizeof(float) * (size_t)(MP_R * K * H));
        for (int r = 0; r < nb; r++) { /* z[r, k] = sum over node m0 + r's entries of att[edge, k] * x[neighbour] */
            float *zr = z + r * K * H;
            const int64_t begin = qk_index(a->row_ptr, a->csr_dtype, m0 + r, a->rp_stride);
            const int64_t end = qk_index(a->row_ptr, a->csr_dtype, m0 + r + 1, a->rp_stride);
            for (int64_t m = begin; m < end; m++) {
                const float *xr = x + qk_index(a->col_idx, a->csr_dtype, m, a->ci_stride) * a->x_stride[0];
                const float *g = j->att + qk_index(a->dir_edge, a->de_dtype, m, a->de_stride) * K;
                for (int64_t k = 0; k < K; k++) {
                    if (xc == 1) mp_axpy(zr + k * H, g[k], xr, H);
                    else
                        for (int64_t h = 0; h < H; h++) zr[k * H + h] += g[k] * xr[h * xc];
                }
            }
        }
        for (int64_t k = 0; k < K; k++) { /* head k's channels: z[., k] times head k's columns of w_v */
            mp_tile(t, z + k * H, K * H, w->wv + k * H * Dp, NULL, H, Dp);
            for (int r = 0; r < MP_R; r++) memcpy(agg + r * H + k * D, t + r * Dp, sizeof(float) * (size_t)D);
        }
        mp_tile(y, agg, H, w->wo, NULL, H, Hp);
        for (int r = 0; r < nb; r++)
            mp_norm_row(x_out + (m0 + r) * H, y + r * Hp, x + (m0 + r) * a->x_stride[0], xc, w->gx, w->bx, H, a->eps);
    }
}

/* argument arg's indices (see qk_index_range_check), arg in a->bad_arg when one is out of range */
static int mp_check_range(const void *idx, int dtype, int64_t n, int64_t offset, int64_t stride, int64_t hi, int arg,
                          qk_message_passing_args *a) {
    const int status = qk_index_range_check(idx, dtype, n, offset, stride, hi, &a->bad_pos, &a->bad_value);
    if (status == QK_E_INDEX) a->bad_arg = arg;
    return status;
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
    if (status == QK_OK) status = mp_check_range(a->dir_edge, a->de_dtype, M, 0, a->de_stride, E, 4, a);
    return status;
}

/* *acc += a * b; nonzero when that overflows */
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
        (a->csr_dtype != QK_I32 && a->csr_dtype != QK_I64) ||
        (a->de_dtype != QK_I32 && a->de_dtype != QK_I64) || K < 1 || H % K != 0)
        return QK_E_UNSUPPORTED;
    int status = mp_check_indices(a);
    if (status != QK_OK || H == 0) return status;

    mp_job j = {.a = a, .total_cost = M + N};
    mp_weights *w = &j.w;
    const int64_t D = H / K;
    w->Fp = mp_cols(F), w->Cm = mp_cols(H + K), w->Dp = mp_cols(D), w->Hp = mp_cols(H);
    /* bytes, overflow-checked (stride-0 views can have any shape; each factor is at most a tensor's
     * element count, padded): the packed weights, the scratch of each thread, the gates */
    const size_t h = (size_t)H, f = (size_t)F, k = (size_t)K, fl = sizeof(float);
    const size_t Fp = (size_t)w->Fp, Cm = (size_t)w->Cm, Dp = (size_t)w->Dp, Hp = (size_t)w->Hp;
    const int maxt = a->num_threads > 0 ? a->num_threads : 1;
    size_t weights = 0, scratch_n = 0, att_n = 0;
    int over = mp_madd(&weights, 3 * h * fl, Fp) | mp_madd(&weights, f * fl, Cm) | mp_madd(&weights, k * h * fl, Dp) |
               mp_madd(&weights, h * fl, Hp) | mp_madd(&weights, fl, Fp + Cm + 4 * h);
    const size_t edge_n = mp_edge_floats(H, w), node_n = mp_node_floats(H, K, w);
    j.per_thread = (edge_n > node_n ? edge_n : node_n) + 16; /* threads' rows apart by a cache line */
    over |= mp_madd(&scratch_n, j.per_thread * fl, (size_t)maxt) | mp_madd(&att_n, (size_t)(E > 0 ? E : 1) * fl, k);
    if (over) return QK_E_NOMEM;
    float *block = malloc(weights);
    j.att = malloc(att_n);
    j.scratch = malloc(scratch_n);
    if (!block || !j.att || !j.scratch) {
        status = QK_E_NOMEM;
        goto done;
    }
    w->w1 = block;
    w->wma = w->w1 + 3 * h * Fp;
    w->wv = w->wma + f * Cm;
    w->wo = w->wv + k * h * Dp;
    w->b1 = w->wo + h * Hp;
    w->bma = w->b1 + Fp;
    w->gx = w->bma + Cm;
    w->bx = w->gx + h;
    w->ge = w->bx + h;
    w->be = w->ge + h;
    mp_pack(w->w1, w->Fp, a->w1, 3 * H, F, a->w1_stride[0], a->w1_stride[1]);
    mp_pack(w->b1, w->Fp, a->b1, 1, F, 0, a->b1_stride);
    for (int64_t r = 0; r < F; r++) { /* [w_msg | w_att] */
        float *row = w->wma + r * w->Cm;
        mp_pack(row, H, (const float *)a->w_msg + r * a->wm_stride[0], 1, H, 0, a->wm_stride[1]);
        mp_pack(row + H, w->Cm - H, (const float *)a->w_att + r * a->wa_stride[0], 1, K, 0, a->wa_stride[1]);
    }
    mp_pack(w->bma, H, a->b_msg, 1, H, 0, a->bm_stride);
    mp_pack(w->bma + H, w->Cm - H, a->b_att, 1, K, 0, a->ba_stride);
    for (int64_t q = 0; q < K; q++) /* head q's columns of w_v */
        mp_pack(w->wv + q * H * w->Dp, w->Dp, (const float *)a->w_v + q * D * a->wv_stride[1], H, D,
                a->wv_stride[0], a->wv_stride[1]);
    mp_pack(w->wo, w->Hp, a->w_o, H, H, a->wo_stride[0], a->wo_stride[1]);
    mp_pack(w->gx, H, a->gamma_x, 1, H, 0, a->gx_stride);
    mp_pack(w->bx, H, a->beta_x, 1, H, 0, a->bx_stride);
    mp_pack(w->ge, H, a->gamma_e, 1, H, 0, a->ge_stride);
    mp_pack(w->be, H, a->beta_e, 1, H, 0, a->be_stride);

    const double hd = (double)H, per_edge = (double)F * (4.0 * hd + (double)K) + 8.0 * hd;
    const double per_entry = (double)K * hd, per_node = 2.0 * hd * hd + 8.0 * hd;
    if (E > 0) status = qk_parallel_run(qk_threads_for(mp_work((double)E * per_edge), maxt), mp_edges, &j);
    if (status == QK_OK && N > 0)
        status = qk_parallel_run(qk_threads_for(mp_work((double)M * per_entry + (double)N * per_node), maxt), mp_nodes,
                                 &j);
done:
    free(block);
    free(j.att);
    free(j.scratch);
    return status;
}
