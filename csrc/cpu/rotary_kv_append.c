/* rotary_kv_append on the CPU: the indices are checked first (positions in range, slots in range and
 * distinct), so a bad call writes nothing; then each row of the step (a q row, a k row or a v row of one
 * token) is one item, split evenly between threads.  q and k rows are rotated pair by pair with the
 * (cos, sin) row of the token's position, in fp32, rounded once, as rotary_emb's; v rows are copied.
 *
 * In place (out == q) is safe: both values of a pair are read before either is written, and the pairs of
 * a row are disjoint.  Distinct slots make every pool row the work of one item. */
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "half.h"
#include "rotary.h"

QK_MULTIVERSION static void rka_worker(void *p, int tid, int nthreads) {
    const qk_rotary_kv_append_args *a = p;
    const int64_t Hq = a->Hq, Hkv = a->Hkv, per_token = Hq + 2 * Hkv, half = a->D / 2;
    const size_t esize = a->dtype == QK_F32 ? 4 : 2;
    int64_t r0, r1;
    qk_share(a->T * per_token, tid, nthreads, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const int64_t t = r / per_token, h = r % per_token;
        const int64_t slot = qk_index(a->slots, a->slot_dtype, t, a->slot_stride);
        const char *x;
        char *o;
        if (h < Hq) {
            x = (const char *)a->q + (t * a->q_stride[0] + h * a->q_stride[1]) * esize;
            o = (char *)a->out + (t * a->out_stride[0] + h * a->out_stride[1]) * esize;
        } else if (h < Hq + Hkv) {
            x = (const char *)a->k + (t * a->k_stride[0] + (h - Hq) * a->k_stride[1]) * esize;
            o = (char *)a->k_pool + (slot * a->kp_stride[0] + (h - Hq) * a->kp_stride[1]) * esize;
        } else {
            const int64_t hv = h - Hq - Hkv;
            memcpy((char *)a->v_pool + (slot * a->vp_stride[0] + hv * a->vp_stride[1]) * esize,
                   (const char *)a->v + (t * a->v_stride[0] + hv * a->v_stride[1]) * esize, (size_t)a->D * esize);
            continue;
        }
        const float *f = a->cos_sin + qk_index(a->positions, a->pos_dtype, t, a->pos_stride) * a->cs_stride[0];
        /* constant dtype and convention per call, so each loop is specialised */
        if (a->interleaved) {
            if (a->dtype == QK_F32) qk_rotate_row(x, o, f, a->cs_stride[1], half, 1, QK_F32, 1.f);
            else if (a->dtype == QK_BF16) qk_rotate_row(x, o, f, a->cs_stride[1], half, 1, QK_BF16, 1.f);
            else qk_rotate_row(x, o, f, a->cs_stride[1], half, 1, QK_F16, 1.f);
        } else {
            if (a->dtype == QK_F32) qk_rotate_row(x, o, f, a->cs_stride[1], half, 0, QK_F32, 1.f);
            else if (a->dtype == QK_BF16) qk_rotate_row(x, o, f, a->cs_stride[1], half, 0, QK_BF16, 1.f);
            else qk_rotate_row(x, o, f, a->cs_stride[1], half, 0, QK_F16, 1.f);
        }
    }
}

typedef struct {
    int64_t slot, t;
} rka_entry;

static int rka_by_slot(const void *pa, const void *pb) {
    const rka_entry *a = pa, *b = pb;
    if (a->slot != b->slot) return a->slot < b->slot ? -1 : 1;
    return a->t < b->t ? -1 : a->t > b->t;
}

/* QK_E_INDEX for the first bad position, else the first bad slot, else the slot given twice whose later
 * token comes first; QK_OK when every index is good. */
static int rka_check(qk_rotary_kv_append_args *a) {
    for (int arg = 0; arg < 2; arg++) {
        const void *idx = arg ? a->slots : a->positions;
        const int dtype = arg ? a->slot_dtype : a->pos_dtype;
        const int64_t stride = arg ? a->slot_stride : a->pos_stride, hi = arg ? a->S : a->max_pos;
        if (qk_index_range_check(idx, dtype, a->T, 0, stride, hi, &a->bad_pos, &a->bad_value) != QK_OK) {
            a->bad_arg = arg;
            return QK_E_INDEX;
        }
    }
    if (a->T < 2) return QK_OK;
    rka_entry *e = qk_cpu_scratch((size_t)a->T * sizeof *e);
    if (!e) return QK_E_NOMEM;
    for (int64_t t = 0; t < a->T; t++) e[t] = (rka_entry){qk_index(a->slots, a->slot_dtype, t, a->slot_stride), t};
    qsort(e, (size_t)a->T, sizeof *e, rka_by_slot);
    int64_t later = -1, earlier = -1;
    for (int64_t i = 1; i < a->T; i++) /* in a run of one slot, entry 1 is its second token */
        if (e[i].slot == e[i - 1].slot && (i < 2 || e[i - 2].slot != e[i].slot) && (later < 0 || e[i].t < later))
            later = e[i].t, earlier = e[i - 1].t;
    qk_cpu_scratch_release(e);
    if (later < 0) return QK_OK;
    a->bad_arg = 2, a->bad_pos = later, a->bad_other = earlier;
    a->bad_value = qk_index(a->slots, a->slot_dtype, later, a->slot_stride);
    return QK_E_INDEX;
}

int qk_rotary_kv_append_cpu(qk_rotary_kv_append_args *a, void *stream) {
    (void)stream;
    if (a->dtype != QK_F32 && a->dtype != QK_F16 && a->dtype != QK_BF16) return QK_E_UNSUPPORTED;
    if (a->D % 2 || (a->pos_dtype != QK_I32 && a->pos_dtype != QK_I64) ||
        (a->slot_dtype != QK_I32 && a->slot_dtype != QK_I64))
        return QK_E_UNSUPPORTED;
    if (a->T <= 0) return QK_OK;
    const int status = rka_check(a);
    if (status != QK_OK) return status;
    const int64_t rows = a->T * (a->Hq + 2 * a->Hkv);
    if (rows <= 0 || a->D <= 0) return QK_OK;
    return qk_parallel_run(qk_threads_for(rows * a->D * 4, a->num_threads > 0 ? a->num_threads : 1), rka_worker, a);
}
