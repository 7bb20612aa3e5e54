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
 * Measured on 2 cores of a Xeon VM (AVX-512): 35-50 GFLOP/s for M = 16-300 (torch/oneDNN: 30-110),
 * 4 ms for M = 1 with a 4096 x 4096 float32 weight (torch: 4.4 ms). */
#include "cpu.h"
#include "half.h"

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

static int ln_run(qk_linear_args *a, int swiglu) {
    const int64_t M = a->M, N = a->N, K = a->K;
    if (a->dtype != QK_F32 && a->dtype != QK_F16 && a->dtype != QK_BF16) return QK_E_UNSUPPORTED;
    if (swiglu && a->gate == NULL) return QK_E_UNSUPPORTED;
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
        ln_ctx c = {a, NULL, 0, m0, rows, n_blocks, 1, scratch, swiglu};
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
    return ln_run(a, 0);
}

int qk_swiglu_cpu(qk_linear_args *a, void *stream) {
    (void)stream;
    return ln_run(a, 1);
}
