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

#define NR_LANES 8

/* sum of (x - shift - mean), or with squares of its squares; 8 partial sums for SIMD */
static float nr_pass(const float *restrict p, int64_t n, float shift, float mean, int squares) {
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
    return qk_parallel_run(qk_threads_for(a->R * a->H * 8, a->num_threads > 0 ? a->num_threads : 1), nr_worker, a);
}
