/* fused_norm_residual on the CPU: per row, mean then variance of the deviations (two passes, in
 * double: no cancellation for rows with a large mean), affine, dropout with the Philox mask shared
 * with the CUDA kernel, + residual.  Rows are split evenly between threads. */
#include "cpu.h"
#include "../../kernels/qk_philox.h"

#include <math.h>

static void nr_worker(void *p, int tid, int nthreads) {
    const qk_norm_residual_args *a = p;
    const float *x = a->x, *res = a->residual, *gamma = a->gamma, *beta = a->beta;
    float *out = a->out;
    const int64_t H = a->H;
    int64_t r0, r1;
    qk_share(a->R, tid, nthreads, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * a->x_stride[0];
        const int64_t xc = a->x_stride[1];
        double sum = 0;
        for (int64_t h = 0; h < H; h++) sum += xr[h * xc];
        const double mean = sum / (double)H;
        double sq = 0;
        for (int64_t h = 0; h < H; h++) {
            const double dv = xr[h * xc] - mean;
            sq += dv * dv;
        }
        const double rstd = 1.0 / sqrt(sq / (double)H + (double)a->eps);
        const float *rr = res + r * a->res_stride[0];
        float *o = out + r * a->out_stride[0];
        for (int64_t h = 0; h < H; h++) {
            /* the deviation in double: the mean rounded to fp32 would cost digits when it is large */
            float y = (float)((xr[h * xc] - mean) * rstd) * gamma[h * a->gamma_stride] + beta[h * a->beta_stride];
            if (a->training) y = qk_dropout_keep(a->seed, (uint64_t)(r * H + h), a->drop_threshold) ? y * a->scale : 0.f;
            o[h * a->out_stride[1]] = y + rr[h * a->res_stride[1]];
        }
    }
}

int qk_norm_residual_cpu(qk_norm_residual_args *a, void *stream) {
    (void)stream;
    if (a->dtype != QK_F32) return QK_E_UNSUPPORTED;
    return qk_parallel_run(qk_threads_for(a->R * a->H * 8, a->num_threads > 0 ? a->num_threads : 1), nr_worker, a);
}
