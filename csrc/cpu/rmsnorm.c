/* rmsnorm and fused_add_rmsnorm on the CPU: per row, the sum of squares of s = x (+ residual) in fp32
 * with 32 independent partial sums (four chains of 8 SIMD lanes), then a second pass that
 * recomputes s, writes the rounded sum into residual and s * rstd * weight into out.  Rows are
 * split evenly between threads and each row is summed in a fixed order, so the bits do not depend
 * on the thread count.
 *
 * The second pass reads the row again (from L1/L2: a row of 4096 bf16 values and its residual are
 * 16 KB) instead of keeping s in a scratch buffer; residual is written only in that pass, so the
 * recomputed s is the same.  out may be x itself: each element of x is read before it is written. */
#include "cpu.h"
#include "half.h"

#include <math.h>

#define RN_LANES 8

#if defined(__GNUC__)
/* 8 partial sums as one vector: written as an array, GCC vectorised the loop over h instead and
 * added into each partial sum in order, one lane at a time (fold-left). The same sums either way. */
typedef float rn_lanes __attribute__((vector_size(RN_LANES * sizeof(float))));
#endif

/* s[j] = x[h + j] (+ res[h + j]) for j < RN_LANES */
#if defined(__GNUC__)
QK_INLINE void rn_load(rn_lanes *s, const void *x, const void *res, int64_t h, int dtype, int add) {
    for (int j = 0; j < RN_LANES; j++) {
        (*s)[j] = qk_load_f32(x, h + j, dtype);
        if (add) (*s)[j] += qk_load_f32(res, h + j, dtype);
    }
}
#endif

/* Four chains of 8 lanes: one chain waited an add latency per 8 elements, which held the first pass
 * below the rate memory delivers a row at (docs/rmsnorm.md). The chains are added in a fixed tree. */
QK_INLINE float rn_sum_squares(const void *x, const void *res, int64_t H, int dtype, int add) {
    int64_t h = 0;
#if defined(__GNUC__)
    rn_lanes p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0};
    for (; h + 4 * RN_LANES <= H; h += 4 * RN_LANES) {
        rn_lanes s0, s1, s2, s3;
        rn_load(&s0, x, res, h, dtype, add);
        rn_load(&s1, x, res, h + RN_LANES, dtype, add);
        rn_load(&s2, x, res, h + 2 * RN_LANES, dtype, add);
        rn_load(&s3, x, res, h + 3 * RN_LANES, dtype, add);
        p0 += s0 * s0;
        p1 += s1 * s1;
        p2 += s2 * s2;
        p3 += s3 * s3;
    }
    for (; h + RN_LANES <= H; h += RN_LANES) {
        rn_lanes s;
        rn_load(&s, x, res, h, dtype, add);
        p0 += s * s;
    }
    const rn_lanes part = (p0 + p1) + (p2 + p3);
#else
    float p[4][RN_LANES] = {{0}}, part[RN_LANES];
    for (; h + 4 * RN_LANES <= H; h += 4 * RN_LANES) {
        for (int c = 0; c < 4; c++) {
            for (int j = 0; j < RN_LANES; j++) {
                float s = qk_load_f32(x, h + c * RN_LANES + j, dtype);
                if (add) s += qk_load_f32(res, h + c * RN_LANES + j, dtype);
                p[c][j] += s * s;
            }
        }
    }
    for (; h + RN_LANES <= H; h += RN_LANES) {
        for (int j = 0; j < RN_LANES; j++) {
            float s = qk_load_f32(x, h + j, dtype);
            if (add) s += qk_load_f32(res, h + j, dtype);
            p[0][j] += s * s;
        }
    }
    for (int j = 0; j < RN_LANES; j++) part[j] = (p[0][j] + p[1][j]) + (p[2][j] + p[3][j]);
#endif
    float tail = 0.f;
    for (; h < H; h++) {
        float s = qk_load_f32(x, h, dtype);
        if (add) s += qk_load_f32(res, h, dtype);
        tail += s * s;
    }
    float sum = 0.f;
    for (int j = 0; j < RN_LANES; j++) sum += part[j];
    return sum + tail;
}

/* One row; dtype, add and unit (weight unit-stride) are constants in each call, so every loop is
 * specialised. */
QK_INLINE void rn_row(const void *x, void *res, const void *w, int64_t ws, void *out, int64_t H, float eps,
                      int dtype, int add, int unit) {
    const float rstd = 1.f / sqrtf(rn_sum_squares(x, res, H, dtype, add) / (float)H + eps);
    for (int64_t h = 0; h < H; h++) {
        float s = qk_load_f32(x, h, dtype);
        if (add) {
            s += qk_load_f32(res, h, dtype);
            qk_store_f32(res, h, dtype, s);
        }
        qk_store_f32(out, h, dtype, s * rstd * qk_load_f32(w, unit ? h : h * ws, dtype));
    }
}

#define RN_ROW(dt, add, unit) rn_row(x, res, a->weight, a->w_stride, o, H, a->eps, dt, add, unit)

QK_MULTIVERSION static void rn_worker(void *p, int tid, int nthreads) {
    const qk_rmsnorm_args *a = p;
    const int64_t H = a->H, R1 = a->R1;
    const size_t esize = a->dtype == QK_F32 ? 4 : 2;
    const int add = a->residual != NULL, unit = a->w_stride == 1;
    int64_t r0, r1;
    qk_share(a->R, tid, nthreads, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const int64_t i = r / R1, j = r % R1;
        const char *x = (const char *)a->x + (i * a->x_stride[0] + j * a->x_stride[1]) * (int64_t)esize;
        char *o = (char *)a->out + (i * a->out_stride[0] + j * a->out_stride[1]) * (int64_t)esize;
        char *res = add ? (char *)a->residual + (i * a->res_stride[0] + j * a->res_stride[1]) * (int64_t)esize : NULL;
        if (a->dtype == QK_F32) {
            if (add) unit ? RN_ROW(QK_F32, 1, 1) : RN_ROW(QK_F32, 1, 0);
            else unit ? RN_ROW(QK_F32, 0, 1) : RN_ROW(QK_F32, 0, 0);
        } else if (a->dtype == QK_BF16) {
            if (add) unit ? RN_ROW(QK_BF16, 1, 1) : RN_ROW(QK_BF16, 1, 0);
            else unit ? RN_ROW(QK_BF16, 0, 1) : RN_ROW(QK_BF16, 0, 0);
        } else {
            if (add) unit ? RN_ROW(QK_F16, 1, 1) : RN_ROW(QK_F16, 1, 0);
            else unit ? RN_ROW(QK_F16, 0, 1) : RN_ROW(QK_F16, 0, 0);
        }
    }
}

int qk_rmsnorm_cpu(qk_rmsnorm_args *a, void *stream) {
    (void)stream;
    if (a->dtype != QK_F32 && a->dtype != QK_F16 && a->dtype != QK_BF16) return QK_E_UNSUPPORTED;
    if (a->R <= 0 || a->H <= 0) return QK_OK;
    if (a->R1 <= 0) return QK_E_UNSUPPORTED;
    return qk_parallel_run(qk_threads_for(a->R * a->H * 4, a->num_threads > 0 ? a->num_threads : 1), rn_worker, a);
}
