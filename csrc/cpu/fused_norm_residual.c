/* fused_norm_residual on the CPU: per row, mean then variance of the deviations (two passes),
 * affine, dropout with the Philox mask shared with the CUDA kernel, + residual.  Rows are split
 * evenly between threads.
 *
 * Both passes work on x - x[row, 0] (unit-sized for a row with mean 1e4 and unit spread, so fp32
 * loses nothing to the mean) with 8 independent partial sums, which the compiler turns into SIMD
 * code; rows with unit inner strides take that path, others a strided loop in double. */
#include "cpu.h"
#include "norm.h"
#include "qkernels/philox.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define NRG_LANES 8 /* graph mode's double sums */

/* Graph mode (batch= given), at the end of the file. */
static int nrg_forward(qk_fused_norm_residual_args *a);
static int nrg_backward(qk_fused_norm_residual_backward_args *a);

/* The dropout draws of elements base .. base + n - 1 (qk_dropout_keep's words): one Philox
 * evaluation per 4 elements, the rounds unrolled so the loop over evaluations vectorises.  buf
 * holds n + 6 words; returns where element base's draw is in it. */
QK_INLINE const uint32_t *nr_draws(uint64_t seed, uint64_t base, int64_t n, uint32_t *restrict buf) {
    const uint64_t first = base >> 2;
    const int64_t nb = (int64_t)(((base & 3) + (uint64_t)n + 3) >> 2);
    for (int64_t b = 0; b < nb; b++) {
        const uint64_t ctr = first + (uint64_t)b;
        uint32_t c0 = (uint32_t)ctr, c1 = (uint32_t)(ctr >> 32), c2 = 0, c3 = 0;
        uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
#pragma GCC unroll 10
        for (int round = 0; round < 10; round++) {
            const uint64_t p0 = (uint64_t)c0 * 0xD2511F53u, p1 = (uint64_t)c2 * 0xCD9E8D57u;
            c0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
            c2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
            c1 = (uint32_t)p1;
            c3 = (uint32_t)p0;
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        buf[4 * b] = c0;
        buf[4 * b + 1] = c1;
        buf[4 * b + 2] = c2;
        buf[4 * b + 3] = c3;
    }
    return buf + (base & 3);
}

QK_INLINE void nr_row_contiguous(const qk_fused_norm_residual_args *a, int64_t r, uint32_t *restrict buf) {
    const int64_t H = a->H;
    const float *restrict x = (const float *)a->x + r * a->x_stride[0];
    const float *restrict res = (const float *)a->residual + r * a->res_stride[0];
    const float *restrict gamma = a->gamma, *restrict beta = a->beta;
    /* out may be x or residual itself (each element is read before it is written at the same index),
     * never a shifted view of them */
    float *restrict o = (float *)a->out + r * a->out_stride[0];
    float shift, mean, rstd; /* mean of the shifted values */
    nr_stats(x, H, a->eps, &shift, &mean, &rstd);
    if (!a->training) {
        for (int64_t h = 0; h < H; h++) o[h] = ((x[h] - shift) - mean) * rstd * gamma[h] + beta[h] + res[h];
        return;
    }
    const uint32_t *restrict draw = nr_draws(a->seed, (uint64_t)(r * H), H, buf);
    const uint32_t thr = a->drop_threshold;
    const float scale = a->scale;
    for (int64_t h = 0; h < H; h++) {
        const float y = ((x[h] - shift) - mean) * rstd * gamma[h] + beta[h];
        o[h] = (draw[h] >= thr ? y * scale : 0.f) + res[h];
    }
}

QK_INLINE void nr_row_strided(const qk_fused_norm_residual_args *a, int64_t r, uint32_t *restrict buf) {
    const int64_t H = a->H, xc = a->x_stride[1];
    const float *xr = (const float *)a->x + r * a->x_stride[0], *rr = (const float *)a->residual + r * a->res_stride[0];
    const float *gamma = a->gamma, *beta = a->beta;
    float *o = (float *)a->out + r * a->out_stride[0];
    double sum = 0;
    for (int64_t h = 0; h < H; h++) sum += xr[h * xc];
    const double mean = sum / (double)H;
    double sq = 0;
    for (int64_t h = 0; h < H; h++) {
        const double dv = xr[h * xc] - mean;
        sq += dv * dv;
    }
    const double rstd = 1.0 / sqrt(sq / (double)H + (double)a->eps);
    const uint32_t *draw = a->training ? nr_draws(a->seed, (uint64_t)(r * H), H, buf) : NULL;
    for (int64_t h = 0; h < H; h++) {
        float y = (float)((xr[h * xc] - mean) * rstd) * gamma[h * a->gamma_stride] + beta[h * a->beta_stride];
        if (draw) y = draw[h] >= a->drop_threshold ? y * a->scale : 0.f;
        o[h * a->out_stride[1]] = y + rr[h * a->res_stride[1]];
    }
}

typedef struct {
    const qk_fused_norm_residual_args *a;
    uint32_t *draws; /* [nthreads][H + 8] when training */
    int64_t group;     /* rows taken at a time */
    atomic_llong next; /* the next group */
} nr_job;

QK_MULTIVERSION static void nr_worker(void *p, int tid, int nthreads) {
    (void)nthreads;
    nr_job *j = p;
    const qk_fused_norm_residual_args *a = j->a;
    const int contiguous = a->x_stride[1] == 1 && a->res_stride[1] == 1 && a->out_stride[1] == 1 &&
                           a->gamma_stride == 1 && a->beta_stride == 1;
    uint32_t *buf = j->draws ? j->draws + (size_t)tid * (size_t)(a->H + 8) : NULL;
    for (int64_t grp; (grp = qk_next_item(&j->next)) * j->group < a->R;) {
        const int64_t r1 = (grp + 1) * j->group < a->R ? (grp + 1) * j->group : a->R;
        for (int64_t r = grp * j->group; r < r1; r++) {
            if (contiguous) nr_row_contiguous(a, r, buf);
            else nr_row_strided(a, r, buf);
        }
    }
}

int qk_fused_norm_residual_cpu(qk_fused_norm_residual_args *a, void *stream) {
    (void)stream;
    if (a->dtype != QK_F32) return QK_E_UNSUPPORTED;
    if (a->seed_ptr) a->seed = (uint64_t)*a->seed_ptr; /* a seed tensor: host memory here */
    if (a->batch) return nrg_forward(a);
    const int nthreads = qk_threads_for(a->R * a->H * 8, a->num_threads > 0 ? a->num_threads : 1);
    nr_job j = {.a = a, .group = 4096 / (a->H + 1) + 1}; /* ~16 KiB of x a group */
    atomic_init(&j.next, 0);
    if (a->training && !(j.draws = malloc(sizeof(uint32_t) * (size_t)nthreads * (size_t)(a->H + 8))))
        return QK_E_NOMEM;
    const int status = qk_parallel_run(nthreads, nr_worker, &j);
    free(j.draws);
    return status;
}

/* ---- fused_norm_residual_backward ------------------------------------------------------------
 * Rows are cut into chunks whose size depends only on R, so the column sums (grad_gamma,
 * grad_beta) are the same for any thread count: each chunk sums its rows' terms in row order into
 * its own fp32 partial, and the partials are added in chunk order in double.  A row is worked on
 * in contiguous fp32 buffers (strided rows are gathered first), with the forward's shift and
 * 8-lane sums. */

#define NRB_MAX_CHUNKS 1024

typedef struct {
    const qk_fused_norm_residual_backward_args *a;
    int64_t chunk, nchunks;
    float *partial; /* [nchunks][2H]: sum g*xhat, then sum g */
    float *gamma;   /* [H], contiguous */
    atomic_llong next; /* the next chunk */
    float *rows;    /* [nthreads][NRB_ROW(H)]: gathered x and grad_out, xhat, g * gamma, the mask, grad_x,
                       the dropout draws */
} nrb_job;

#define NRB_ROW(H) (7 * (size_t)(H) + 8)

/* mask[h] = scale or 0 for elements base .. base + n - 1; draws: n + 6 words of scratch */
QK_INLINE void nrb_mask(const qk_fused_norm_residual_backward_args *a, uint64_t base, int64_t n, float *restrict mask,
                        uint32_t *restrict draws) {
    const uint32_t *restrict d = nr_draws(a->seed, base, n, draws);
    const uint32_t thr = a->drop_threshold;
    const float scale = a->scale;
    for (int64_t h = 0; h < n; h++) mask[h] = d[h] >= thr ? scale : 0.f;
}

/* One row: x, go (contiguous) -> gx, and its terms added to dgamma / dbeta.  One fused pass
 * makes x-hat, g * gamma, the column terms and the two row sums (32 lanes); a second writes
 * grad_x. */
QK_INLINE void nrb_row(const nrb_job *j, int64_t r, const float *restrict x, const float *restrict go,
                       float *restrict xh, float *restrict gg, float *restrict mask, uint32_t *restrict draws,
                       float *restrict gx, float *restrict dgamma, float *restrict dbeta, const int training) {
    const qk_fused_norm_residual_backward_args *a = j->a;
    const int64_t H = a->H;
    const float *restrict gamma = j->gamma;
    float shift, mean, rstd; /* mean of the shifted values */
    nr_stats(x, H, a->eps, &shift, &mean, &rstd);
    if (training) nrb_mask(a, (uint64_t)(r * H), H, mask, draws);
    float p1[NR_LANES] = {0}, p2[NR_LANES] = {0};
    int64_t h = 0;
    for (; h + NR_LANES <= H; h += NR_LANES)
        for (int k = 0; k < NR_LANES; k++) {
            const float xv = ((x[h + k] - shift) - mean) * rstd, g = training ? go[h + k] * mask[h + k] : go[h + k];
            dgamma[h + k] += g * xv;
            dbeta[h + k] += g;
            xh[h + k] = xv;
            gg[h + k] = g * gamma[h + k];
            p1[k] += gg[h + k];
            p2[k] += gg[h + k] * xv;
        }
    float s1 = 0.f, s2 = 0.f;
    for (; h < H; h++) {
        const float xv = ((x[h] - shift) - mean) * rstd, g = training ? go[h] * mask[h] : go[h];
        dgamma[h] += g * xv;
        dbeta[h] += g;
        xh[h] = xv;
        gg[h] = g * gamma[h];
        s1 += gg[h];
        s2 += gg[h] * xv;
    }
    s1 = nr_reduce(p1, s1);
    s2 = nr_reduce(p2, s2);
    const float m1 = s1 / (float)H, m2 = s2 / (float)H;
    for (h = 0; h < H; h++) gx[h] = rstd * ((gg[h] - m1) - xh[h] * m2);
}

QK_MULTIVERSION static void nrb_chunks(void *p, int tid, int nthreads) {
    (void)nthreads;
    nrb_job *j = p;
    const qk_fused_norm_residual_backward_args *a = j->a;
    const int64_t H = a->H;
    float *buf = j->rows + (size_t)tid * NRB_ROW(H);
    float *xb = buf, *gob = buf + H, *xh = buf + 2 * H, *g = buf + 3 * H, *mask = buf + 4 * H, *gxb = buf + 5 * H;
    uint32_t *draws = (uint32_t *)(buf + 6 * H);
    const int x_unit = a->x_stride[1] == 1, go_unit = a->go_stride[1] == 1, gx_unit = a->gx_stride[1] == 1;
    for (int64_t c; (c = qk_next_item(&j->next)) < j->nchunks;) {
        float *dgamma = j->partial + (size_t)c * 2 * (size_t)H, *dbeta = dgamma + H;
        for (int64_t h = 0; h < 2 * H; h++) dgamma[h] = 0.f;
        const int64_t r1 = (c + 1) * j->chunk < a->R ? (c + 1) * j->chunk : a->R;
        for (int64_t r = c * j->chunk; r < r1; r++) {
            const float *x = (const float *)a->x + r * a->x_stride[0];
            const float *go = (const float *)a->grad_out + r * a->go_stride[0];
            float *gx = (float *)a->grad_x + r * a->gx_stride[0];
            if (!x_unit) {
                for (int64_t h = 0; h < H; h++) xb[h] = x[h * a->x_stride[1]];
                x = xb;
            }
            if (!go_unit) {
                for (int64_t h = 0; h < H; h++) gob[h] = go[h * a->go_stride[1]];
                go = gob;
            }
            if (a->training) /* two instances, so neither tests the flag per element */
                nrb_row(j, r, x, go, xh, g, mask, draws, gx_unit ? gx : gxb, dgamma, dbeta, 1);
            else
                nrb_row(j, r, x, go, xh, g, mask, draws, gx_unit ? gx : gxb, dgamma, dbeta, 0);
            if (!gx_unit)
                for (int64_t h = 0; h < H; h++) gx[h * a->gx_stride[1]] = gxb[h];
        }
    }
}

/* grad_gamma and grad_beta from the chunks' partial column sums (2H per chunk, float or double),
 * added into sum (2H, zeroed) in chunk order: the same bits for any thread count. */
static void nrb_gamma_beta(const qk_fused_norm_residual_backward_args *a, const void *partial, int part_double,
                           int64_t nchunks, double *sum) {
    const int64_t H = a->H;
    for (int64_t c = 0; c < nchunks; c++) {
        const size_t at = (size_t)c * 2 * (size_t)H;
        if (part_double)
            for (int64_t h = 0; h < 2 * H; h++) sum[h] += ((const double *)partial)[at + (size_t)h];
        else
            for (int64_t h = 0; h < 2 * H; h++) sum[h] += ((const float *)partial)[at + (size_t)h];
    }
    for (int64_t h = 0; h < H; h++) {
        ((float *)a->grad_gamma)[h * a->gg_stride] = (float)sum[h];
        ((float *)a->grad_beta)[h * a->gb_stride] = (float)sum[H + h];
    }
}

int qk_fused_norm_residual_backward_cpu(qk_fused_norm_residual_backward_args *a, void *stream) {
    (void)stream;
    if (a->dtype != QK_F32) return QK_E_UNSUPPORTED;
    const int64_t R = a->R, H = a->H;
    if (a->training && a->seed_ptr) a->seed = (uint64_t)*a->seed_ptr;
    if (a->batch) return nrg_backward(a);
    nrb_job j = {0};
    j.a = a;
    atomic_init(&j.next, 0);
    /* chunks of >= 64 rows, at most NRB_MAX_CHUNKS of them: a function of R alone */
    j.chunk = (R + NRB_MAX_CHUNKS - 1) / NRB_MAX_CHUNKS;
    if (j.chunk < 64) j.chunk = 64;
    j.nchunks = R > 0 ? (R + j.chunk - 1) / j.chunk : 0;
    const int maxt = a->num_threads > 0 ? a->num_threads : 1;
    int nthreads = qk_threads_for(R * H * 12, maxt);
    if (nthreads > j.nchunks) nthreads = j.nchunks > 0 ? (int)j.nchunks : 1;
    /* one scratch block, kept between calls so its pages are not faulted in again: the sums in
     * double first (alignment), then partials, gamma and the row buffers */
    const size_t nparts = (size_t)(j.nchunks > 0 ? j.nchunks : 1) * 2 * (size_t)H;
    char *mem = qk_cpu_scratch(sizeof(double) * 2 * (size_t)H +
                           sizeof(float) * (nparts + (size_t)H + (size_t)nthreads * NRB_ROW(H)));
    double *sum = (double *)mem;
    if (mem) {
        memset(sum, 0, sizeof(double) * 2 * (size_t)H);
        j.partial = (float *)(sum + 2 * H);
        j.gamma = j.partial + nparts;
        j.rows = j.gamma + H;
    }
    int status = QK_E_NOMEM;
    if (mem) {
        for (int64_t h = 0; h < H; h++) j.gamma[h] = ((const float *)a->gamma)[h * a->gamma_stride];
        status = j.nchunks > 0 ? qk_parallel_run(nthreads, nrb_chunks, &j) : QK_OK;
        if (status == QK_OK) nrb_gamma_beta(a, j.partial, 0, j.nchunks, sum);
    }
    qk_cpu_scratch_release(mem);
    return status;
}

/* ---- graph mode ------------------------------------------------------------------------------
 * Statistics per graph over all its rows and channels (batch= given).  Every sum has an order fixed
 * by the data alone: a row's sums (8 double lanes) come from whichever thread owns the row, then each
 * graph adds its rows' sums in ascending row order, so the bits do not depend on the thread count.
 * Sorted batch: a graph's rows are the range found by binary search, graphs summed in parallel;
 * unsorted: a stable counting sort (one serial O(R + G) pass) lists each graph's rows in row order,
 * so both add the same rows in the same order.  Mean and variance are two passes, in double. */

typedef struct {
    const float *x;
    int64_t xs0, xs1, R, H, G;
    const void *batch;
    int64_t bstride;
    int idt;
    int64_t *off;        /* [G + 1]: graph g's rows are order[off[g] .. off[g + 1]) */
    int64_t *order;      /* [R], NULL for a sorted batch (the identity) */
    double *row;         /* [2R]: per-row sums, nv of them per row */
    double *mean, *rstd; /* [G] */
    double *m1, *m2;     /* [G], backward: mean_g(g*gamma), mean_g(g*gamma*xhat) */
    int64_t *bad;        /* [nparts]: the share's first bad position, or -1 */
    int *unsorted;       /* [nparts] */
    int nparts, nv, squares;
} nrg_graphs;

static inline int64_t nrg_id(const nrg_graphs *gs, int64_t r) { return qk_index(gs->batch, gs->idt, r, gs->bstride); }

/* Range checks and sortedness, in position order per share. */
static void nrg_scan(void *p, int tid, int nthreads) {
    nrg_graphs *gs = p;
    int64_t r0, r1;
    qk_share(gs->R, tid, nthreads, &r0, &r1);
    gs->bad[tid] = -1;
    gs->unsorted[tid] = 0;
    int64_t prev = r0 > 0 ? nrg_id(gs, r0 - 1) : INT64_MIN;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t g = nrg_id(gs, r);
        if (g < 0 || g >= gs->G) {
            gs->bad[tid] = r;
            return;
        }
        gs->unsorted[tid] |= g < prev;
        prev = g;
    }
}

/* Sorted batch: off[g] = the first row whose id is >= g. */
static void nrg_bounds(void *p, int tid, int nthreads) {
    nrg_graphs *gs = p;
    int64_t g0, g1;
    qk_share(gs->G + 1, tid, nthreads, &g0, &g1);
    for (int64_t g = g0; g < g1; g++) {
        int64_t lo = 0, hi = gs->R;
        while (lo < hi) {
            const int64_t mid = lo + (hi - lo) / 2;
            if (nrg_id(gs, mid) < g) lo = mid + 1;
            else hi = mid;
        }
        gs->off[g] = lo;
    }
}

/* sum over h < n of p[h * s] - mean, or of its squares; 8 partial sums for SIMD */
QK_INLINE double nrg_row_sum(const float *restrict p, int64_t n, int64_t s, double mean, int squares) {
    double part[NRG_LANES] = {0};
    int64_t h = 0;
    for (; h + NRG_LANES <= n; h += NRG_LANES)
        for (int j = 0; j < NRG_LANES; j++) {
            const double d = (double)p[(h + j) * s] - mean;
            part[j] += squares ? d * d : d;
        }
    double t = 0;
    for (; h < n; h++) {
        const double d = (double)p[h * s] - mean;
        t += squares ? d * d : d;
    }
    for (int j = 0; j < NRG_LANES; j++) t += part[j];
    return t;
}

/* row[r] = sum_h x[r, h] (squares == 0) or sum_h (x[r, h] - mean_g)^2 */
QK_MULTIVERSION static void nrg_rows(void *p, int tid, int nthreads) {
    nrg_graphs *gs = p;
    int64_t r0, r1;
    qk_share(gs->R, tid, nthreads, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const float *x = gs->x + r * gs->xs0;
        const double m = gs->squares ? gs->mean[nrg_id(gs, r)] : 0.0;
        gs->row[r] = gs->xs1 == 1 ? nrg_row_sum(x, gs->H, 1, m, gs->squares)
                                  : nrg_row_sum(x, gs->H, gs->xs1, m, gs->squares);
    }
}

/* out_k[g] = (sum of row[nv r + k] over the graph's rows, in row order) / (max(n_g, 1) H) */
static void nrg_graph_means(void *p, int tid, int nthreads) {
    nrg_graphs *gs = p;
    double *out[2] = {gs->nv == 1 ? (gs->squares ? gs->rstd : gs->mean) : gs->m1, gs->m2};
    int64_t g0, g1;
    qk_share(gs->G, tid, nthreads, &g0, &g1);
    for (int64_t g = g0; g < g1; g++) {
        const int64_t lo = gs->off[g], hi = gs->off[g + 1];
        const double n = (double)(hi > lo ? hi - lo : 1) * (double)gs->H;
        for (int k = 0; k < gs->nv; k++) {
            double s = 0;
            for (int64_t i = lo; i < hi; i++) s += gs->row[(gs->order ? gs->order[i] : i) * gs->nv + k];
            out[k][g] = s / n;
        }
    }
}

/* The graphs' rows (off, order), mean and rstd.  QK_E_INDEX fills *bad_pos, *bad_value. */
static int nrg_prepare(nrg_graphs *gs, int maxt, float eps, int64_t *bad_pos, int64_t *bad_value) {
    const int64_t R = gs->R, G = gs->G;
    gs->nparts = qk_threads_for(R * 4, maxt);
    gs->bad = malloc(sizeof(int64_t) * (size_t)gs->nparts);
    gs->unsorted = malloc(sizeof(int) * (size_t)gs->nparts);
    gs->off = malloc(sizeof(int64_t) * (size_t)(G + 1));
    gs->row = malloc(sizeof(double) * 2 * (size_t)(R + 1));
    gs->mean = malloc(sizeof(double) * 4 * (size_t)G);
    if (!gs->bad || !gs->unsorted || !gs->off || !gs->row || !gs->mean) return QK_E_NOMEM;
    gs->rstd = gs->mean + G;
    gs->m1 = gs->mean + 2 * G;
    gs->m2 = gs->mean + 3 * G;
    int status = qk_parallel_run(gs->nparts, nrg_scan, gs);
    if (status) return status;
    int unsorted = 0;
    for (int t = 0; t < gs->nparts; t++) {
        if (gs->bad[t] >= 0) { /* shares are in position order: the first one found is the earliest */
            *bad_pos = gs->bad[t];
            *bad_value = nrg_id(gs, gs->bad[t]);
            return QK_E_INDEX;
        }
        unsorted |= gs->unsorted[t];
    }
    const int graph_threads = qk_threads_for(G * 16 + R, maxt);
    if (!unsorted) {
        status = qk_parallel_run(graph_threads, nrg_bounds, gs);
    } else { /* stable counting sort: off from the counts, then each row at its graph's cursor */
        gs->order = malloc(sizeof(int64_t) * (size_t)(R + 1));
        int64_t *cursor = malloc(sizeof(int64_t) * (size_t)G);
        if (!gs->order || !cursor) {
            free(cursor);
            return QK_E_NOMEM;
        }
        memset(gs->off, 0, sizeof(int64_t) * (size_t)(G + 1));
        for (int64_t r = 0; r < R; r++) gs->off[nrg_id(gs, r) + 1]++;
        for (int64_t g = 0; g < G; g++) gs->off[g + 1] += gs->off[g];
        memcpy(cursor, gs->off, sizeof(int64_t) * (size_t)G);
        for (int64_t r = 0; r < R; r++) gs->order[cursor[nrg_id(gs, r)]++] = r;
        free(cursor);
        status = QK_OK;
    }
    if (status || gs->H == 0) return status;
    const int row_threads = qk_threads_for(R * gs->H * 4, maxt);
    gs->nv = 1;
    for (gs->squares = 0; gs->squares < 2; gs->squares++) /* the means, then the variances about them */
        if ((status = qk_parallel_run(row_threads, nrg_rows, gs)) ||
            (status = qk_parallel_run(graph_threads, nrg_graph_means, gs)))
            return status;
    for (int64_t g = 0; g < G; g++) gs->rstd[g] = 1.0 / sqrt(gs->rstd[g] + (double)eps);
    return QK_OK;
}

static void nrg_free(nrg_graphs *gs) {
    free(gs->bad);
    free(gs->unsorted);
    free(gs->off);
    free(gs->order);
    free(gs->row);
    free(gs->mean);
}

static void nrg_init(nrg_graphs *gs, const void *x, const int64_t *x_stride, int64_t R, int64_t H, int64_t G,
                     const void *batch, int64_t bstride, int idt) {
    memset(gs, 0, sizeof *gs);
    gs->x = x;
    gs->xs0 = x_stride[0];
    gs->xs1 = x_stride[1];
    gs->R = R;
    gs->H = H;
    gs->G = G;
    gs->batch = batch;
    gs->bstride = bstride;
    gs->idt = idt;
}

typedef struct {
    const qk_fused_norm_residual_args *a;
    const nrg_graphs *gs;
    uint32_t *draws; /* [nthreads][H + 8] when training */
} nrg_forward_job;

/* One output row; out may be x or residual itself (each element is read before it is written). */
QK_INLINE void nrg_out_row(const qk_fused_norm_residual_args *a, int64_t r, double mean, double rstd, int64_t xs,
                           int64_t rs, int64_t os, int64_t gs, int64_t bs, uint32_t *restrict buf) {
    const float *x = (const float *)a->x + r * a->x_stride[0], *res = (const float *)a->residual + r * a->res_stride[0];
    const float *gamma = a->gamma, *beta = a->beta;
    float *o = (float *)a->out + r * a->out_stride[0];
    const int64_t H = a->H;
    if (!a->training) {
        for (int64_t h = 0; h < H; h++)
            o[h * os] = (float)(((double)x[h * xs] - mean) * rstd) * gamma[h * gs] + beta[h * bs] + res[h * rs];
        return;
    }
    const uint32_t *restrict draw = nr_draws(a->seed, (uint64_t)(r * H), H, buf);
    for (int64_t h = 0; h < H; h++) {
        float y = (float)(((double)x[h * xs] - mean) * rstd) * gamma[h * gs] + beta[h * bs];
        y = draw[h] >= a->drop_threshold ? y * a->scale : 0.f;
        o[h * os] = y + res[h * rs];
    }
}

QK_MULTIVERSION static void nrg_out(void *p, int tid, int nthreads) {
    const nrg_forward_job *j = p;
    const qk_fused_norm_residual_args *a = j->a;
    const int unit = a->x_stride[1] == 1 && a->res_stride[1] == 1 && a->out_stride[1] == 1 && a->gamma_stride == 1 &&
                     a->beta_stride == 1;
    uint32_t *buf = j->draws ? j->draws + (size_t)tid * (size_t)(a->H + 8) : NULL;
    int64_t r0, r1;
    qk_share(a->R, tid, nthreads, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const int64_t g = nrg_id(j->gs, r);
        const double mean = j->gs->mean[g], rstd = j->gs->rstd[g];
        if (unit) nrg_out_row(a, r, mean, rstd, 1, 1, 1, 1, 1, buf);
        else
            nrg_out_row(a, r, mean, rstd, a->x_stride[1], a->res_stride[1], a->out_stride[1], a->gamma_stride,
                        a->beta_stride, buf);
    }
}

static int nrg_forward(qk_fused_norm_residual_args *a) {
    const int maxt = a->num_threads > 0 ? a->num_threads : 1;
    nrg_graphs gs;
    nrg_init(&gs, a->x, a->x_stride, a->R, a->H, a->num_graphs, a->batch, a->batch_stride, a->index_dtype);
    int status = nrg_prepare(&gs, maxt, a->eps, &a->bad_pos, &a->bad_value);
    if (status == QK_OK && a->H > 0) {
        const int nthreads = qk_threads_for(a->R * a->H * 8, maxt);
        nrg_forward_job j = {a, &gs, NULL};
        if (a->training && !(j.draws = malloc(sizeof(uint32_t) * (size_t)nthreads * (size_t)(a->H + 8))))
            status = QK_E_NOMEM;
        else
            status = qk_parallel_run(nthreads, nrg_out, &j);
        free(j.draws);
    }
    nrg_free(&gs);
    return status;
}

/* Backward: the row sums of g*gamma and g*gamma*xhat (with the column terms of grad_gamma and
 * grad_beta, in fixed chunks of rows as the row mode's), their graph means, then grad_x. */
typedef struct {
    const qk_fused_norm_residual_backward_args *a;
    nrg_graphs *gs;
    int64_t chunk, nchunks;
    double *partial; /* [nchunks][2H]: sum g*xhat, then sum g */
    float *gamma;    /* [H], contiguous */
    float *buf;      /* [threads][NRGB_ROW(H)]: gathered x and grad_out, the mask, grad_x, the dropout draws */
} nrgb_job;

#define NRGB_ROW(H) (5 * (size_t)(H) + 8)

/* Row r's x and grad_out as contiguous rows (gathered into buf when strided), and its mask. */
static inline void nrgb_load(const nrgb_job *j, int64_t r, float *buf, const float **x, const float **go) {
    const qk_fused_norm_residual_backward_args *a = j->a;
    const int64_t H = a->H;
    *x = (const float *)a->x + r * a->x_stride[0];
    *go = (const float *)a->grad_out + r * a->go_stride[0];
    if (a->x_stride[1] != 1) {
        for (int64_t h = 0; h < H; h++) buf[h] = (*x)[h * a->x_stride[1]];
        *x = buf;
    }
    if (a->go_stride[1] != 1) {
        for (int64_t h = 0; h < H; h++) buf[H + h] = (*go)[h * a->go_stride[1]];
        *go = buf + H;
    }
    if (a->training) nrb_mask(a, (uint64_t)(r * H), H, buf + 2 * H, (uint32_t *)(buf + 4 * H));
}

QK_MULTIVERSION static void nrgb_sums(void *p, int tid, int nthreads) {
    nrgb_job *j = p;
    const qk_fused_norm_residual_backward_args *a = j->a;
    nrg_graphs *gs = j->gs;
    const int64_t H = a->H;
    const int training = a->training;
    float *buf = j->buf + (size_t)tid * NRGB_ROW(H);
    const float *restrict mask = buf + 2 * H, *restrict gamma = j->gamma;
    int64_t c0, c1;
    qk_share(j->nchunks, tid, nthreads, &c0, &c1);
    for (int64_t c = c0; c < c1; c++) {
        double *restrict dgamma = j->partial + (size_t)c * 2 * (size_t)H, *restrict dbeta = dgamma + H;
        for (int64_t h = 0; h < 2 * H; h++) dgamma[h] = 0;
        const int64_t r1 = (c + 1) * j->chunk < a->R ? (c + 1) * j->chunk : a->R;
        for (int64_t r = c * j->chunk; r < r1; r++) {
            const float *x, *go;
            nrgb_load(j, r, buf, &x, &go);
            const int64_t g = nrg_id(gs, r);
            const double mean = gs->mean[g], rstd = gs->rstd[g];
            double p1[NRG_LANES] = {0}, p2[NRG_LANES] = {0};
            int64_t h = 0;
            for (; h + NRG_LANES <= H; h += NRG_LANES)
                for (int k = 0; k < NRG_LANES; k++) {
                    const float xv = (float)(((double)x[h + k] - mean) * rstd);
                    const float gm = training ? go[h + k] * mask[h + k] : go[h + k], gy = gm * gamma[h + k];
                    dgamma[h + k] += gm * xv;
                    dbeta[h + k] += gm;
                    p1[k] += gy;
                    p2[k] += gy * xv;
                }
            double s1 = 0, s2 = 0;
            for (; h < H; h++) {
                const float xv = (float)(((double)x[h] - mean) * rstd);
                const float gm = training ? go[h] * mask[h] : go[h], gy = gm * gamma[h];
                dgamma[h] += gm * xv;
                dbeta[h] += gm;
                s1 += gy;
                s2 += gy * xv;
            }
            for (int k = 0; k < NRG_LANES; k++) {
                s1 += p1[k];
                s2 += p2[k];
            }
            gs->row[2 * r] = s1;
            gs->row[2 * r + 1] = s2;
        }
    }
}

QK_MULTIVERSION static void nrgb_grad_x(void *p, int tid, int nthreads) {
    nrgb_job *j = p;
    const qk_fused_norm_residual_backward_args *a = j->a;
    const nrg_graphs *gs = j->gs;
    const int64_t H = a->H, gxs = a->gx_stride[1];
    const int training = a->training;
    float *buf = j->buf + (size_t)tid * NRGB_ROW(H);
    const float *restrict mask = buf + 2 * H, *restrict gamma = j->gamma;
    float *restrict gxb = buf + 3 * H;
    int64_t r0, r1;
    qk_share(a->R, tid, nthreads, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const float *x, *go;
        nrgb_load(j, r, buf, &x, &go);
        const int64_t g = nrg_id(gs, r);
        const double mean = gs->mean[g], rstd = gs->rstd[g], m1 = gs->m1[g], m2 = gs->m2[g];
        float *gx = (float *)a->grad_x + r * a->gx_stride[0];
        float *restrict dst = gxs == 1 ? gx : gxb;
        for (int64_t h = 0; h < H; h++) {
            const float xv = (float)(((double)x[h] - mean) * rstd);
            const float gm = training ? go[h] * mask[h] : go[h];
            dst[h] = (float)(rstd * (((double)(gm * gamma[h]) - m1) - (double)xv * m2));
        }
        if (gxs != 1)
            for (int64_t h = 0; h < H; h++) gx[h * gxs] = gxb[h];
    }
}

static int nrg_backward(qk_fused_norm_residual_backward_args *a) {
    const int maxt = a->num_threads > 0 ? a->num_threads : 1;
    const int64_t R = a->R, H = a->H;
    nrg_graphs gs;
    nrg_init(&gs, a->x, a->x_stride, R, H, a->num_graphs, a->batch, a->batch_stride, a->index_dtype);
    int status = nrg_prepare(&gs, maxt, a->eps, &a->bad_pos, &a->bad_value);
    nrgb_job j = {0};
    double *sum = NULL;
    if (status || H == 0) goto done;
    j.a = a;
    j.gs = &gs;
    /* chunks of >= 64 rows, at most NRB_MAX_CHUNKS of them: a function of R alone */
    j.chunk = (R + NRB_MAX_CHUNKS - 1) / NRB_MAX_CHUNKS;
    if (j.chunk < 64) j.chunk = 64;
    j.nchunks = (R + j.chunk - 1) / j.chunk;
    j.partial = malloc(sizeof(double) * (size_t)j.nchunks * 2 * (size_t)H);
    j.gamma = malloc(sizeof(float) * (size_t)H);
    j.buf = malloc(sizeof(float) * (size_t)maxt * NRGB_ROW(H));
    sum = calloc(2 * (size_t)H, sizeof(double));
    status = QK_E_NOMEM;
    if (!j.partial || !j.gamma || !j.buf || !sum) goto done;
    for (int64_t h = 0; h < H; h++) j.gamma[h] = ((const float *)a->gamma)[h * a->gamma_stride];
    int nthreads = qk_threads_for(R * H * 12, maxt);
    if (nthreads > j.nchunks) nthreads = (int)j.nchunks;
    if ((status = qk_parallel_run(nthreads, nrgb_sums, &j))) goto done;
    gs.nv = 2;
    if ((status = qk_parallel_run(qk_threads_for(gs.G * 16 + R, maxt), nrg_graph_means, &gs))) goto done;
    if ((status = qk_parallel_run(qk_threads_for(R * H * 12, maxt), nrgb_grad_x, &j))) goto done;
    nrb_gamma_beta(a, j.partial, 1, j.nchunks, sum);
done:
    free(j.partial);
    free(j.gamma);
    free(j.buf);
    free(sum);
    nrg_free(&gs);
    return status;
}
