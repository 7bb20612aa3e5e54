/* fused_norm_residual on the CPU: per row, mean then variance of the deviations (two passes),
 * affine, dropout with the Philox mask shared with the CUDA kernel, + residual.  Rows are split
 * evenly between threads.
 *
 * Both passes work on x - x[row, 0] (unit-sized for a row with mean 1e4 and unit spread, so fp32
 * loses nothing to the mean) with 8 independent partial sums, which the compiler turns into SIMD
 * code; rows with unit inner strides take that path, others a strided loop in double. */
#include "cpu.h"
#include "qkernels/philox.h"

#include <math.h>
#include <stdlib.h>

#define NR_LANES 8

/* Inlined into their callers, so a multiversioned caller runs them in its own instruction set
 * (a call from an AVX-512 clone into baseline SSE code stalls on the state transition). */
#if defined(__GNUC__)
#define NR_INLINE static inline __attribute__((always_inline))
#else
#define NR_INLINE static inline
#endif

/* sum of (x - shift - mean), or with squares of its squares; 8 partial sums for SIMD */
NR_INLINE float nr_pass(const float *restrict p, int64_t n, float shift, float mean, int squares) {
    float part[NR_LANES] = {0};
    int64_t h = 0;
    for (; h + NR_LANES <= n; h += NR_LANES)
        for (int j = 0; j < NR_LANES; j++) {
            const float d = (p[h + j] - shift) - mean;
            part[j] += squares ? d * d : d;
        }
    float s = 0.f;
    for (; h < n; h++) {
        const float d = (p[h] - shift) - mean;
        s += squares ? d * d : d;
    }
    for (int j = 0; j < NR_LANES; j++) s += part[j];
    return s;
}

static void nr_row_contiguous(const qk_fused_norm_residual_args *a, int64_t r) {
    const int64_t H = a->H;
    const float *restrict x = (const float *)a->x + r * a->x_stride[0];
    const float *restrict res = (const float *)a->residual + r * a->res_stride[0];
    const float *restrict gamma = a->gamma, *restrict beta = a->beta;
    /* out may be x or residual itself (each element is read before it is written at the same index),
     * never a shifted view of them */
    float *restrict o = (float *)a->out + r * a->out_stride[0];
    const float shift = x[0];
    const float mean = nr_pass(x, H, shift, 0.f, 0) / (float)H; /* of the shifted values */
    const float var = nr_pass(x, H, shift, mean, 1) / (float)H;
    const float rstd = 1.f / sqrtf(var + a->eps);
    if (!a->training) {
        for (int64_t h = 0; h < H; h++) o[h] = ((x[h] - shift) - mean) * rstd * gamma[h] + beta[h] + res[h];
        return;
    }
    for (int64_t h = 0; h < H; h++) {
        float y = ((x[h] - shift) - mean) * rstd * gamma[h] + beta[h];
        y = qk_dropout_keep(a->seed, (uint64_t)(r * H + h), a->drop_threshold) ? y * a->scale : 0.f;
        o[h] = y + res[h];
    }
}

static void nr_row_strided(const qk_fused_norm_residual_args *a, int64_t r) {
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
    for (int64_t h = 0; h < H; h++) {
        float y = (float)((xr[h * xc] - mean) * rstd) * gamma[h * a->gamma_stride] + beta[h * a->beta_stride];
        if (a->training) y = qk_dropout_keep(a->seed, (uint64_t)(r * H + h), a->drop_threshold) ? y * a->scale : 0.f;
        o[h * a->out_stride[1]] = y + rr[h * a->res_stride[1]];
    }
}

QK_MULTIVERSION static void nr_worker(void *p, int tid, int nthreads) {
    const qk_fused_norm_residual_args *a = p;
    const int contiguous = a->x_stride[1] == 1 && a->res_stride[1] == 1 && a->out_stride[1] == 1 &&
                           a->gamma_stride == 1 && a->beta_stride == 1;
    int64_t r0, r1;
    qk_share(a->R, tid, nthreads, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        if (contiguous) nr_row_contiguous(a, r);
        else nr_row_strided(a, r);
    }
}

int qk_fused_norm_residual_cpu(qk_fused_norm_residual_args *a, void *stream) {
    (void)stream;
    if (a->dtype != QK_F32) return QK_E_UNSUPPORTED;
    if (a->seed_ptr) a->seed = (uint64_t)*a->seed_ptr; /* a seed tensor: host memory here */
    return qk_parallel_run(qk_threads_for(a->R * a->H * 8, a->num_threads > 0 ? a->num_threads : 1), nr_worker, a);
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
    float *rows;    /* [nthreads][6H]: gathered x and grad_out, xhat, g * gamma, the mask, grad_x */
} nrb_job;

/* mask[h] = scale or 0 for elements base .. base + n - 1: one Philox evaluation per 4 indices */
NR_INLINE void nrb_mask(const qk_fused_norm_residual_backward_args *a, uint64_t base, int64_t n, float *restrict mask) {
    int64_t h = 0;
    while (h < n) {
        const uint64_t i = base + (uint64_t)h;
        const qk_philox_block b = qk_philox4x32(i >> 2, a->seed);
        for (int w = (int)(i & 3); w < 4 && h < n; w++, h++) mask[h] = b.v[w] >= a->drop_threshold ? a->scale : 0.f;
    }
}

/* One row: x, go (contiguous) -> gx, and its terms added to dgamma / dbeta.  One fused pass
 * makes x-hat, g * gamma, the column terms and the two row sums (8 partial sums for SIMD); a
 * second writes grad_x. */
QK_MULTIVERSION static void nrb_row(const nrb_job *j, int64_t r, const float *restrict x, const float *restrict go,
                                    float *restrict xh, float *restrict gg, float *restrict mask, float *restrict gx,
                                    float *restrict dgamma, float *restrict dbeta) {
    const qk_fused_norm_residual_backward_args *a = j->a;
    const int64_t H = a->H;
    const float *restrict gamma = j->gamma;
    const float shift = x[0];
    const float mean = nr_pass(x, H, shift, 0.f, 0) / (float)H; /* of the shifted values */
    const float rstd = 1.f / sqrtf(nr_pass(x, H, shift, mean, 1) / (float)H + a->eps);
    if (a->training) nrb_mask(a, (uint64_t)(r * H), H, mask);
    float p1[NR_LANES] = {0}, p2[NR_LANES] = {0};
    int64_t h = 0;
    for (; h + NR_LANES <= H; h += NR_LANES)
        for (int k = 0; k < NR_LANES; k++) {
            const float xv = ((x[h + k] - shift) - mean) * rstd, g = a->training ? go[h + k] * mask[h + k] : go[h + k];
            dgamma[h + k] += g * xv;
            dbeta[h + k] += g;
            xh[h + k] = xv;
            gg[h + k] = g * gamma[h + k];
            p1[k] += gg[h + k];
            p2[k] += gg[h + k] * xv;
        }
    float s1 = 0.f, s2 = 0.f;
    for (; h < H; h++) {
        const float xv = ((x[h] - shift) - mean) * rstd, g = a->training ? go[h] * mask[h] : go[h];
        dgamma[h] += g * xv;
        dbeta[h] += g;
        xh[h] = xv;
        gg[h] = g * gamma[h];
        s1 += gg[h];
        s2 += gg[h] * xv;
    }
    for (int k = 0; k < NR_LANES; k++) {
        s1 += p1[k];
        s2 += p2[k];
    }
    const float m1 = s1 / (float)H, m2 = s2 / (float)H;
    for (h = 0; h < H; h++) gx[h] = rstd * ((gg[h] - m1) - xh[h] * m2);
}

static void nrb_chunks(void *p, int tid, int nthreads) {
    nrb_job *j = p;
    const qk_fused_norm_residual_backward_args *a = j->a;
    const int64_t H = a->H;
    float *buf = j->rows + (size_t)tid * 6 * (size_t)H;
    float *xb = buf, *gob = buf + H, *xh = buf + 2 * H, *g = buf + 3 * H, *mask = buf + 4 * H, *gxb = buf + 5 * H;
    const int x_unit = a->x_stride[1] == 1, go_unit = a->go_stride[1] == 1, gx_unit = a->gx_stride[1] == 1;
    int64_t c0, c1;
    qk_share(j->nchunks, tid, nthreads, &c0, &c1);
    for (int64_t c = c0; c < c1; c++) {
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
            nrb_row(j, r, x, go, xh, g, mask, gx_unit ? gx : gxb, dgamma, dbeta);
            if (!gx_unit)
                for (int64_t h = 0; h < H; h++) gx[h * a->gx_stride[1]] = gxb[h];
        }
    }
}

int qk_fused_norm_residual_backward_cpu(qk_fused_norm_residual_backward_args *a, void *stream) {
    (void)stream;
    if (a->dtype != QK_F32) return QK_E_UNSUPPORTED;
    const int64_t R = a->R, H = a->H;
    if (a->training && a->seed_ptr) a->seed = (uint64_t)*a->seed_ptr;
    nrb_job j = {0};
    j.a = a;
    /* chunks of >= 64 rows, at most NRB_MAX_CHUNKS of them: a function of R alone */
    j.chunk = (R + NRB_MAX_CHUNKS - 1) / NRB_MAX_CHUNKS;
    if (j.chunk < 64) j.chunk = 64;
    j.nchunks = R > 0 ? (R + j.chunk - 1) / j.chunk : 0;
    const int maxt = a->num_threads > 0 ? a->num_threads : 1;
    int nthreads = qk_threads_for(R * H * 12, maxt);
    if (nthreads > j.nchunks) nthreads = j.nchunks > 0 ? (int)j.nchunks : 1;
    j.partial = malloc(sizeof(float) * (size_t)(j.nchunks > 0 ? j.nchunks : 1) * 2 * (size_t)H);
    j.gamma = malloc(sizeof(float) * (size_t)H);
    j.rows = malloc(sizeof(float) * (size_t)nthreads * 6 * (size_t)H);
    double *sum = calloc(2 * (size_t)H, sizeof(double));
    int status = QK_E_NOMEM;
    if (j.partial && j.gamma && j.rows && sum) {
        for (int64_t h = 0; h < H; h++) j.gamma[h] = ((const float *)a->gamma)[h * a->gamma_stride];
        status = j.nchunks > 0 ? qk_parallel_run(nthreads, nrb_chunks, &j) : QK_OK;
        if (status == QK_OK) {
            for (int64_t c = 0; c < j.nchunks; c++) { /* chunk order: the same bits for any thread count */
                const float *part = j.partial + (size_t)c * 2 * (size_t)H;
                for (int64_t h = 0; h < 2 * H; h++) sum[h] += part[h];
            }
            for (int64_t h = 0; h < H; h++) {
                ((float *)a->grad_gamma)[h * a->gg_stride] = (float)sum[h];
                ((float *)a->grad_beta)[h * a->gb_stride] = (float)sum[H + h];
            }
        }
    }
    free(j.partial);
    free(j.gamma);
    free(j.rows);
    free(sum);
    return status;
}
