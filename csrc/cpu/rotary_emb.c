/* rotary_emb on the CPU: each (token, head) row of D values is rotated pair by pair with that
 * token's (cos, sin) table, in fp32, rounded once.  Rows are split evenly between threads.
 * rotary_emb_backward (inverse) rotates by the negated angle: the same formula with sin negated, an
 * exact sign flip, so it rounds as the forward does.
 *
 * In place (out == x) is safe: both values of a pair are read before either is written, and the
 * pairs of a row are disjoint. */
#include "cpu.h"
#include "half.h"
#include "rotary.h"

QK_MULTIVERSION static void ro_worker(void *p, int tid, int nthreads) {
    const qk_rotary_emb_args *a = p;
    const int64_t S = a->S, H = a->H, half = a->D / 2;
    const size_t esize = a->dtype == QK_F32 ? 4 : 2;
    const float sign = a->inverse ? -1.f : 1.f;
    int64_t r0, r1;
    qk_share(a->B * S * H, tid, nthreads, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const int64_t b = r / (S * H), s = (r / H) % S, h = r % H;
        const char *x = (const char *)a->x + (b * a->x_stride[0] + s * a->x_stride[1] + h * a->x_stride[2]) * esize;
        char *o = (char *)a->out + (b * a->out_stride[0] + s * a->out_stride[1] + h * a->out_stride[2]) * esize;
        const float *f = a->freqs + b * a->f_stride[0] + s * a->f_stride[1];
        /* constant dtype and convention per call, so each loop is specialised */
        if (a->interleaved) {
            if (a->dtype == QK_F32) qk_rotate_row(x, o, f, a->f_stride[2], half, 1, QK_F32, sign);
            else if (a->dtype == QK_BF16) qk_rotate_row(x, o, f, a->f_stride[2], half, 1, QK_BF16, sign);
            else qk_rotate_row(x, o, f, a->f_stride[2], half, 1, QK_F16, sign);
        } else {
            if (a->dtype == QK_F32) qk_rotate_row(x, o, f, a->f_stride[2], half, 0, QK_F32, sign);
            else if (a->dtype == QK_BF16) qk_rotate_row(x, o, f, a->f_stride[2], half, 0, QK_BF16, sign);
            else qk_rotate_row(x, o, f, a->f_stride[2], half, 0, QK_F16, sign);
        }
    }
}

int qk_rotary_emb_cpu(qk_rotary_emb_args *a, void *stream) {
    (void)stream;
    if (a->dtype != QK_F32 && a->dtype != QK_F16 && a->dtype != QK_BF16) return QK_E_UNSUPPORTED;
    if (a->D % 2) return QK_E_UNSUPPORTED;
    const int64_t rows = a->B * a->S * a->H;
    if (rows <= 0 || a->D <= 0) return QK_OK;
    return qk_parallel_run(qk_threads_for(rows * a->D * 4, a->num_threads > 0 ? a->num_threads : 1), ro_worker, a);
}
