/* The row statistics of LayerNorm shared by the CPU kernels that normalise rows
 * (fused_norm_residual, message_passing), so that both give the same bits for the same row. */
#ifndef QK_CPU_NORM_H
#define QK_CPU_NORM_H

#include "cpu.h"

#include <math.h>

/* Row sums in 32 lanes (lane j: elements h = j mod 32, in order), added pairwise in a fixed tree:
 * four independent 8-wide chains, so a 128-wide row is not one chain of dependent adds.  The
 * order is the same in every clone, and C11 mode keeps GCC from contracting a*b+c, so the bits
 * are too. */
#define NR_LANES 32

/* The lanes' sum: a pairwise tree, then the tail's sum t (elements past the last full 32) */
QK_INLINE float nr_reduce(float *restrict part, float t) {
    _Static_assert(NR_LANES == 32, "the tree below is written out for 32 lanes");
    for (int j = 0; j < 16; j++) part[j] += part[j + 16]; /* constant widths: whole-vector adds */
    for (int j = 0; j < 8; j++) part[j] += part[j + 8];
    for (int j = 0; j < 4; j++) part[j] += part[j + 4];
    return ((part[0] + part[2]) + (part[1] + part[3])) + t;
}

/* sum of (x - shift - mean), or with squares of its squares */
QK_INLINE float nr_pass(const float *restrict p, int64_t n, float shift, float mean, int squares) {
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
    return nr_reduce(part, s);
}

/* mean (of the values shifted by shift = p[0]) and 1 / sqrt(variance + eps) of a contiguous row of
 * n > 0 floats: two passes, population variance.  Normalised element h is ((p[h] - shift) - mean) * rstd. */
QK_INLINE void nr_stats(const float *restrict p, int64_t n, float eps, float *shift, float *mean, float *rstd) {
    *shift = p[0];
    *mean = nr_pass(p, n, *shift, 0.f, 0) / (float)n;
    *rstd = 1.f / sqrtf(nr_pass(p, n, *shift, *mean, 1) / (float)n + eps);
}

#endif
