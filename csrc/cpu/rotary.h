/* The rotation both rotary ops apply to one row on the CPU: pair i is (x[2i], x[2i+1]) interleaved or
 * (x[i], x[i + D/2]) rotate-half, turned by the angle whose (cos, sin) are f[i * f_stride + 0/1], sin
 * times sign (-1: the inverse rotation of rotary_emb_backward, an exact flip). */
#ifndef QK_CPU_ROTARY_H
#define QK_CPU_ROTARY_H

#include "half.h"

QK_INLINE void qk_rotate_row(const void *x, void *out, const float *f,
                                                                int64_t f_stride, int64_t half, int interleaved,
                                                                int dtype, float sign) {
    for (int64_t i = 0; i < half; i++) {
        const float c = f[i * f_stride], s = sign * f[i * f_stride + 1];
        const int64_t ie = interleaved ? 2 * i : i, io = interleaved ? 2 * i + 1 : i + half;
        const float xe = qk_load_f32(x, ie, dtype), xo = qk_load_f32(x, io, dtype);
        qk_store_f32(out, ie, dtype, xe * c - xo * s);
        qk_store_f32(out, io, dtype, xe * s + xo * c);
    }
}

#endif
