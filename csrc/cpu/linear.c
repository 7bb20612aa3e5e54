/* linear and swiglu on the CPU: out[m, n] = x[m] . w[n] (+ bias[n]), or (x[m] . up[n]) *
 * silu(x[m] . gate[n]), fp32 arithmetic and one rounding to the output dtype.
 *
 * Work decomposition: x is converted to fp32 a slab of rows at a time (float32 x is read in
 * place); within a slab, threads own fixed shares of (block of LN_NBLOCK weight rows, chunk of x
 * rows) units; a unit converts its weight rows to fp32 once (float32 weights are read in place)
 * and computes LN_MT x LN_NT output tiles from registers.
 *
 * Determinism: every output is reduced in one fixed order whatever the tile, thread or thread
 * count: lane l sums x[k] w[k] over k = l (mod LN_LANES) below the last multiple of LN_LANES, in
 * increasing k; the lanes are added pairwise; the tail k is added in order.  -std=c11 keeps GCC
 * from contracting a*b+c into FMAs, so each clone of QK_MULTIVERSION vectorises the lanes without
 * changing a bit.
 *
 * These are the portable kernels: on x86-64 with AVX2 or AVX-512 the forward ops go to linear_x86.c
 * (qk_linear_fast), which has its own order per instruction-set level; the backward ops, and
 * swiglu_backward's recomputed products, stay here. */
#include "cpu.h"
#include "half.h"
#include "linear_isa.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define LN_LANES 8   /* partial sums per output: one 8-float vector */
#define LN_MT 4      /* x rows per register tile; 4 x 2 accumulators + 6 loads fit AVX2's 16 registers */
#define LN_NT 2      /* weight rows per register tile */
#define LN_NBLOCK 16 /* weight rows converted per unit: 16 x K floats stay in L2 for K <= 8k */
#define LN_MSLAB 256 /* x rows converted at a time, bounding the scratch to 256 x K floats */

typedef struct {
    const qk_linear_args *a;
    const float *x32; /* the slab's first row, fp32 */
    int64_t x32_stride, m_begin, m_rows;
    int64_t n_blocks, m_chunks;
    float *scratch; /* per thread: (1 or 2) x LN_NBLOCK x K floats, when the weights are not fp32 */
    int swiglu;
    float *ga, *gb; /* swiglu_backward: the epilogue writes ga, gb [M, N] (fp32, contiguous) instead of out */
} ln_ctx;

/* LN_LANES floats as one GCC/Clang vector: one AVX register, two SSE ones on the baseline clone */
typedef float ln_vec __attribute__((vector_size(LN_LANES * sizeof(float))));

/* an unaligned load (a macro: a function returning an AVX vector would trip -Wpsabi) */
#define LN_LOAD(v, p) memcpy(&(v), (p), sizeof(ln_vec))

static inline __attribute__((always_inline)) void ln_tile(const float *const *xr, const float *const *wr,
                                                          int64_t K, int mt, int nt, float res[LN_MT][LN_NT]) {
    ln_vec acc[LN_MT][LN_NT];
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = (ln_vec){0};
    const int64_t K8 = K - K % LN_LANES;
    for (int64_t k = 0; k < K8; k += LN_LANES) {
        ln_vec w[LN_NT];
        for (int j = 0; j < nt; j++) LN_LOAD(w[j], wr[j] + k);
        for (int i = 0; i < mt; i++) {
            ln_vec x;
            LN_LOAD(x, xr[i] + k);
            for (int j = 0; j < nt; j++) acc[i][j] += x * w[j];
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) {
            const ln_vec p = acc[i][j];
            float s = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
            for (int64_t k = K8; k < K; k++) s += xr[i][k] * wr[j][k];
            res[i][j] = s;
        }
}

/* res = the mt x nt tile of dot products; constant shapes so each call is unrolled and vectorised */
static inline __attribute__((always_inline)) void ln_dots(const float *const *xr, const float *const *wr,
                                                          int64_t K, int mt, int nt, float res[LN_MT][LN_NT]) {
    if (mt == LN_MT && nt == LN_NT) {
        ln_tile(xr, wr, K, LN_MT, LN_NT, res);
    } else if (mt == LN_MT) {
        ln_tile(xr, wr, K, LN_MT, 1, res);
    } else {
        for (int i = 0; i < mt; i++) {
            float r[LN_MT][LN_NT];
            if (nt == LN_NT) ln_tile(xr + i, wr, K, 1, LN_NT, r);
            else ln_tile(xr + i, wr, K, 1, 1, r);
            for (int j = 0; j < nt; j++) res[i][j] = r[0][j];
        }
    }
}

/* Rows [n0, n1) of a weight as fp32 row pointers: in place for float32, else converted into buf. */
static inline void ln_weight_rows(const void *w, int64_t stride, int dtype, int64_t n0, int64_t n1, int64_t K,
                                  float *buf, const float **rows) {
    for (int64_t n = n0; n < n1; n++) {
        if (dtype == QK_F32) {
            rows[n - n0] = (const float *)w + n * stride;
            continue;
        }
        const uint16_t *src = (const uint16_t *)w + n * stride;
        float *dst = buf + (n - n0) * K;
        if (dtype == QK_BF16)
            for (int64_t k = 0; k < K; k++) dst[k] = qk_bf16_to_f32(src[k]);
        else
            for (int64_t k = 0; k < K; k++) dst[k] = qk_f16_to_f32(src[k]);
        rows[n - n0] = dst;
    }
}

/* swiglu_backward's gradients of one output from a = x.up, b = x.gate and dy, in fp32:
 * ga = dy silu(b), gb = dy a silu'(b), silu'(b) = s (1 + b (1 - s)) with s = 1 / (1 + e^-b) (0 for
 * b -> -inf, so both are 0 there, never NaN). */
static inline void ln_swiglu_grads(float a, float b, float dy, float *ga, float *gb) {
    const float e = expf(-b), s = 1.f / (1.f + e);
    *ga = dy * (b / (1.f + e));
    *gb = dy * a * (s * (1.f + b * (1.f - s)));
}

QK_MULTIVERSION static void ln_worker(void *p, int tid, int nthreads) {
    const ln_ctx *c = p;
    const qk_linear_args *a = c->a;
    const int64_t K = a->K, N = a->N;
    float *wbuf = c->scratch ? c->scratch + (int64_t)tid * (c->swiglu ? 2 : 1) * LN_NBLOCK * K : NULL;
    float *gbuf = wbuf ? wbuf + LN_NBLOCK * K : NULL;
    const float *wrows[LN_NBLOCK], *grows[LN_NBLOCK];
    const int64_t m_tiles = (c->m_rows + LN_MT - 1) / LN_MT;
    int64_t u0, u1, converted = -1;
    qk_share(c->n_blocks * c->m_chunks, tid, nthreads, &u0, &u1);
    for (int64_t u = u0; u < u1; u++) {
        const int64_t nb = u / c->m_chunks, mc = u % c->m_chunks;
        const int64_t n0 = nb * LN_NBLOCK, n1 = n0 + LN_NBLOCK < N ? n0 + LN_NBLOCK : N;
        if (nb != converted) { /* a thread's units run through the m chunks of one block in a row */
            ln_weight_rows(a->w, a->w_stride, a->dtype, n0, n1, K, wbuf, wrows);
            if (c->swiglu) ln_weight_rows(a->gate, a->gate_stride, a->dtype, n0, n1, K, gbuf, grows);
            converted = nb;
        }
        int64_t t0, t1;
        qk_share(m_tiles, (int)mc, (int)c->m_chunks, &t0, &t1);
        const int64_t m_end = t1 * LN_MT < c->m_rows ? t1 * LN_MT : c->m_rows;
        for (int64_t m = t0 * LN_MT; m < m_end; m += LN_MT) {
            const int mt = m_end - m < LN_MT ? (int)(m_end - m) : LN_MT;
            const float *xr[LN_MT];
            for (int i = 0; i < mt; i++) xr[i] = c->x32 + (m + i) * c->x32_stride;
            for (int64_t n = n0; n < n1; n += LN_NT) {
                const int nt = n1 - n < LN_NT ? (int)(n1 - n) : LN_NT;
                float r[LN_MT][LN_NT], g[LN_MT][LN_NT];
                ln_dots(xr, wrows + (n - n0), K, mt, nt, r);
                if (c->swiglu) ln_dots(xr, grows + (n - n0), K, mt, nt, g);
                if (c->ga) {
                    for (int j = 0; j < nt; j++)
                        for (int i = 0; i < mt; i++) {
                            const int64_t row = c->m_begin + m + i;
                            const float dy = qk_load_f32(a->grad_out, row * a->grad_out_stride + n + j, a->dtype);
                            ln_swiglu_grads(r[i][j], g[i][j], dy, c->ga + row * N + n + j, c->gb + row * N + n + j);
                        }
                    continue;
                }
                for (int j = 0; j < nt; j++) {
                    const float b = a->bias ? qk_load_f32(a->bias, (n + j) * a->bias_stride, a->dtype) : 0.f;
                    for (int i = 0; i < mt; i++) {
                        /* silu(g) = g / (1 + e^-g): -0 for g -> -inf, g for g -> +inf */
                        const float v = c->swiglu ? r[i][j] * (g[i][j] / (1.f + expf(-g[i][j]))) : r[i][j] + b;
                        qk_store_f32(a->out, (c->m_begin + m + i) * a->out_stride + n + j, a->dtype, v);
                    }
                }
            }
        }
    }
}

static int ln_run(qk_linear_args *a, int swiglu, float *ga, float *gb) {
    const int64_t M = a->M, N = a->N, K = a->K;
    if (a->dtype != QK_F32 && a->dtype != QK_F16 && a->dtype != QK_BF16) return QK_E_UNSUPPORTED;
    if (swiglu && a->gate == NULL && a->K > 0) return QK_E_UNSUPPORTED; /* an empty gate may be NULL */
    if (M <= 0 || N <= 0) return QK_OK;
    const int64_t n_blocks = (N + LN_NBLOCK - 1) / LN_NBLOCK;
    const int64_t work = M * N * (K > 0 ? K : 1) * (swiglu ? 2 : 1);
    int nthreads = qk_threads_for(work, a->num_threads > 0 ? a->num_threads : 1);
    const int64_t max_units = n_blocks * (((M < LN_MSLAB ? M : LN_MSLAB) + LN_MT - 1) / LN_MT);
    if (nthreads > max_units) nthreads = (int)max_units;
    const int convert_x = a->dtype != QK_F32;
    float *x32 = NULL, *scratch = NULL;
    if (convert_x) {
        x32 = malloc(sizeof(float) * (size_t)(M < LN_MSLAB ? M : LN_MSLAB) * (size_t)(K > 0 ? K : 1));
        scratch = malloc(sizeof(float) * (size_t)nthreads * (swiglu ? 2 : 1) * LN_NBLOCK * (size_t)(K > 0 ? K : 1));
        if (!x32 || !scratch) {
            free(x32);
            free(scratch);
            return QK_E_NOMEM;
        }
    }
    int status = QK_OK;
    for (int64_t m0 = 0; m0 < M && status == QK_OK; m0 += LN_MSLAB) {
        const int64_t rows = M - m0 < LN_MSLAB ? M - m0 : LN_MSLAB;
        ln_ctx c = {a, NULL, 0, m0, rows, n_blocks, 1, scratch, swiglu, ga, gb};
        if (convert_x) {
            for (int64_t m = 0; m < rows; m++)
                for (int64_t k = 0; k < K; k++)
                    x32[m * K + k] = qk_load_f32(a->x, (m0 + m) * a->x_stride + k, a->dtype);
            c.x32 = x32;
            c.x32_stride = K;
        } else {
            c.x32 = (const float *)a->x + m0 * a->x_stride;
            c.x32_stride = a->x_stride;
        }
        /* too few weight blocks to go round: split the rows of x as well */
        const int64_t m_tiles = (rows + LN_MT - 1) / LN_MT;
        if (n_blocks < nthreads) {
            c.m_chunks = (nthreads + n_blocks - 1) / n_blocks;
            if (c.m_chunks > m_tiles) c.m_chunks = m_tiles;
        }
        status = qk_parallel_run(nthreads, ln_worker, &c);
    }
    free(x32);
    free(scratch);
    return status;
}

int qk_linear_cpu(qk_linear_args *a, void *stream) {
    (void)stream;
    int status;
    return qk_linear_fast(a, 0, &status) ? status : ln_run(a, 0, NULL, NULL);
}

int qk_swiglu_cpu(qk_linear_args *a, void *stream) {
    (void)stream;
    int status;
    return qk_linear_fast(a, 1, &status) ? status : ln_run(a, 1, NULL, NULL);
}

/* ---- linear_backward and swiglu_backward ------------------------------------------------------
 * Each gradient is a product out[r, c] = sum over terms p, then s ascending, of A_p(s, r) B_p(s, c):
 *   grad_x [M, K]:  r = m, s = n, A = grad_out (or swiglu's ga, gb), B = the weight (up, gate);
 *   grad_w [N, K]:  r = n, s = m, A = grad_out (ga; gb for grad_gate), B = x.
 * A thread owns whole LB_RT x LB_CT output tiles.  A tile walks s in blocks of LB_SB: it converts that
 * block of A (LB_RT values per s) and of B (LB_CT values per s) to fp32, then 4 x 16 register tiles
 * add a[s][i] * b[s][j] lane by lane.  Every output is a chain of fp32 multiply-adds in (p, s) order,
 * whatever the thread count, tile or vector width: the same bits on every run and for a row alone or
 * in a batch.  grad_bias sums grad_out's rows in order, a chunk of columns per thread. */

#define LB_RT 16  /* output rows per tile */
#define LB_CT 64  /* output columns per tile */
#define LB_SB 128 /* s per converted block: A 8 KB + B 32 KB of fp32 per thread */
#define LB_BCOLS 256 /* grad_bias columns per unit */

typedef struct {
    const void *a; /* A(s, r) = a[s * a_ss + r * a_rs], float32 when a_f32, else the op's dtype */
    int64_t a_ss, a_rs;
    int a_f32;
    const void *b; /* B(s, c) = b[s * b_ss + c], the op's dtype */
    int64_t b_ss;
} lb_term;

typedef struct {
    lb_term t[2];
    int nt;
    int64_t R, C, S;
    void *out; /* out[r * out_rs + c], the op's dtype */
    int64_t out_rs;
    int dtype;
    float *scratch; /* per thread: LB_SB * (LB_RT + LB_CT) + LB_RT * LB_CT floats */
} lb_prod;

#define LB_SCRATCH (LB_SB * (LB_RT + LB_CT) + LB_RT * LB_CT)

/* acc[RT][CT] += sum over s < sb of a[s][i] b[s][j]; each acc element adds in s order */
static inline __attribute__((always_inline)) void lb_block(float *acc, const float *ab, const float *bb, int sb) {
    for (int rg = 0; rg < LB_RT; rg += 4)
        for (int cg = 0; cg < LB_CT; cg += 2 * LN_LANES) {
            ln_vec v[4][2];
            for (int i = 0; i < 4; i++)
                for (int h = 0; h < 2; h++) LN_LOAD(v[i][h], acc + (rg + i) * LB_CT + cg + h * LN_LANES);
            for (int s = 0; s < sb; s++) {
                ln_vec b0, b1;
                LN_LOAD(b0, bb + s * LB_CT + cg);
                LN_LOAD(b1, bb + s * LB_CT + cg + LN_LANES);
                for (int i = 0; i < 4; i++) {
                    const float x = ab[s * LB_RT + rg + i];
                    v[i][0] += x * b0;
                    v[i][1] += x * b1;
                }
            }
            for (int i = 0; i < 4; i++)
                for (int h = 0; h < 2; h++) memcpy(acc + (rg + i) * LB_CT + cg + h * LN_LANES, &v[i][h], sizeof(ln_vec));
        }
}

QK_MULTIVERSION static void lb_prod_worker(void *p, int tid, int nthreads) {
    const lb_prod *c = p;
    float *ab = c->scratch + (int64_t)tid * LB_SCRATCH, *bb = ab + LB_SB * LB_RT, *acc = bb + LB_SB * LB_CT;
    const int64_t rtiles = (c->R + LB_RT - 1) / LB_RT, ctiles = (c->C + LB_CT - 1) / LB_CT;
    int64_t u0, u1;
    qk_share(rtiles * ctiles, tid, nthreads, &u0, &u1);
    for (int64_t u = u0; u < u1; u++) {
        /* consecutive units share an r tile: its A blocks stay in cache */
        const int64_t r0 = u / ctiles * LB_RT, c0 = u % ctiles * LB_CT;
        const int rt = c->R - r0 < LB_RT ? (int)(c->R - r0) : LB_RT, ct = c->C - c0 < LB_CT ? (int)(c->C - c0) : LB_CT;
        memset(acc, 0, sizeof(float) * LB_RT * LB_CT);
        for (int q = 0; q < c->nt; q++) {
            const lb_term *t = &c->t[q];
            for (int64_t s0 = 0; s0 < c->S; s0 += LB_SB) {
                const int sb = c->S - s0 < LB_SB ? (int)(c->S - s0) : LB_SB;
                /* the block in fp32, zero-padded to whole tiles (padding meets only outputs not stored) */
                for (int s = 0; s < sb; s++) {
                    float *ar = ab + s * LB_RT, *br = bb + s * LB_CT;
                    const int64_t aoff = (s0 + s) * t->a_ss + r0 * t->a_rs, boff = (s0 + s) * t->b_ss + c0;
                    for (int i = 0; i < LB_RT; i++)
                        ar[i] = i >= rt ? 0.f
                                : t->a_f32 ? ((const float *)t->a)[aoff + i * t->a_rs]
                                           : qk_load_f32(t->a, aoff + i * t->a_rs, c->dtype);
                    if (c->dtype == QK_F32)
                        for (int j = 0; j < ct; j++) br[j] = ((const float *)t->b)[boff + j];
                    else if (c->dtype == QK_BF16)
                        for (int j = 0; j < ct; j++) br[j] = qk_bf16_to_f32(((const uint16_t *)t->b)[boff + j]);
                    else
                        for (int j = 0; j < ct; j++) br[j] = qk_f16_to_f32(((const uint16_t *)t->b)[boff + j]);
                    for (int j = ct; j < LB_CT; j++) br[j] = 0.f;
                }
                lb_block(acc, ab, bb, sb);
            }
        }
        for (int i = 0; i < rt; i++)
            for (int j = 0; j < ct; j++)
                qk_store_f32(c->out, (r0 + i) * c->out_rs + c0 + j, c->dtype, acc[i * LB_CT + j]);
    }
}

static int lb_run_prod(lb_prod *c, int max_threads) {
    if (c->R <= 0 || c->C <= 0) return QK_OK;
    const int64_t units = ((c->R + LB_RT - 1) / LB_RT) * ((c->C + LB_CT - 1) / LB_CT);
    int nthreads = qk_threads_for(c->R * c->C * (c->S > 0 ? c->S : 1) * c->nt, max_threads);
    if (nthreads > units) nthreads = (int)units;
    c->scratch = malloc(sizeof(float) * LB_SCRATCH * (size_t)nthreads);
    if (!c->scratch) return QK_E_NOMEM;
    const int status = qk_parallel_run(nthreads, lb_prod_worker, c);
    free(c->scratch);
    return status;
}

typedef struct {
    const qk_linear_args *a;
} lb_bias_ctx;

QK_MULTIVERSION static void lb_bias_worker(void *p, int tid, int nthreads) {
    const qk_linear_args *a = ((const lb_bias_ctx *)p)->a;
    int64_t u0, u1;
    qk_share((a->N + LB_BCOLS - 1) / LB_BCOLS, tid, nthreads, &u0, &u1);
    float acc[LB_BCOLS];
    for (int64_t u = u0; u < u1; u++) {
        const int64_t n0 = u * LB_BCOLS;
        const int nc = a->N - n0 < LB_BCOLS ? (int)(a->N - n0) : LB_BCOLS;
        for (int j = 0; j < nc; j++) acc[j] = 0.f;
        for (int64_t m = 0; m < a->M; m++) {
            const int64_t off = m * a->grad_out_stride + n0;
            if (a->dtype == QK_F32)
                for (int j = 0; j < nc; j++) acc[j] += ((const float *)a->grad_out)[off + j];
            else if (a->dtype == QK_BF16)
                for (int j = 0; j < nc; j++) acc[j] += qk_bf16_to_f32(((const uint16_t *)a->grad_out)[off + j]);
            else
                for (int j = 0; j < nc; j++) acc[j] += qk_f16_to_f32(((const uint16_t *)a->grad_out)[off + j]);
        }
        for (int j = 0; j < nc; j++) qk_store_f32(a->grad_bias, (n0 + j) * a->grad_bias_stride, a->dtype, acc[j]);
    }
}

static int lb_dtype_ok(const qk_linear_args *a) {
    return a->dtype == QK_F32 || a->dtype == QK_F16 || a->dtype == QK_BF16;
}

int qk_linear_backward_cpu(qk_linear_args *a, void *stream) {
    (void)stream;
    if (!lb_dtype_ok(a)) return QK_E_UNSUPPORTED;
    const int threads = a->num_threads > 0 ? a->num_threads : 1;
    int status = QK_OK;
    if (a->grad_x) { /* grad_x[m, k] = sum_n g[m, n] w[n, k] */
        lb_prod c = {{{a->grad_out, 1, a->grad_out_stride, 0, a->w, a->w_stride}}, 1, a->M, a->K, a->N,
                     a->grad_x, a->grad_x_stride, a->dtype, NULL};
        status = lb_run_prod(&c, threads);
    }
    if (status == QK_OK && a->grad_w) { /* grad_w[n, k] = sum_m g[m, n] x[m, k] */
        lb_prod c = {{{a->grad_out, a->grad_out_stride, 1, 0, a->x, a->x_stride}}, 1, a->N, a->K, a->M,
                     a->grad_w, a->grad_w_stride, a->dtype, NULL};
        status = lb_run_prod(&c, threads);
    }
    if (status == QK_OK && a->grad_bias && a->N > 0) {
        lb_bias_ctx c = {a};
        const int64_t units = (a->N + LB_BCOLS - 1) / LB_BCOLS;
        int nthreads = qk_threads_for(a->M * a->N, threads);
        if (nthreads > units) nthreads = (int)units;
        status = qk_parallel_run(nthreads, lb_bias_worker, &c);
    }
    return status;
}

int qk_swiglu_backward_cpu(qk_linear_args *a, void *stream) {
    (void)stream;
    if (!lb_dtype_ok(a) || (a->gate == NULL && a->N > 0 && a->K > 0)) return QK_E_UNSUPPORTED; /* empty: may be NULL */
    const int threads = a->num_threads > 0 ? a->num_threads : 1;
    const int64_t M = a->M, N = a->N;
    /* ga, gb [M, N] in fp32 from the forward products (no terms where M or N is 0) */
    float *ga = NULL, *gb = NULL;
    if (M > 0 && N > 0) {
        ga = malloc(sizeof(float) * (size_t)M * (size_t)N);
        gb = malloc(sizeof(float) * (size_t)M * (size_t)N);
        if (!ga || !gb) {
            free(ga);
            free(gb);
            return QK_E_NOMEM;
        }
    }
    int status = M > 0 && N > 0 ? ln_run(a, 1, ga, gb) : QK_OK;
    if (status == QK_OK && a->grad_x) { /* grad_x = ga up + gb gate: the up terms, then the gate terms */
        lb_prod c = {{{ga, 1, N, 1, a->w, a->w_stride}, {gb, 1, N, 1, a->gate, a->gate_stride}}, 2, M, a->K, N,
                     a->grad_x, a->grad_x_stride, a->dtype, NULL};
        status = lb_run_prod(&c, threads);
    }
    if (status == QK_OK && a->grad_w) {
        lb_prod c = {{{ga, N, 1, 1, a->x, a->x_stride}}, 1, N, a->K, M, a->grad_w, a->grad_w_stride, a->dtype, NULL};
        status = lb_run_prod(&c, threads);
    }
    if (status == QK_OK && a->grad_gate) {
        lb_prod c = {{{gb, N, 1, 1, a->x, a->x_stride}}, 1, N, a->K, M, a->grad_gate, a->grad_gate_stride, a->dtype,
                     NULL};
        status = lb_run_prod(&c, threads);
    }
    free(ga);
    free(gb);
    return status;
}
