/* attn_decode and attn_paged_decode on the CPU: one query token per sequence against its keys.
 *
 * Work item = (sequence b, kv head h): the G = Hq / Hkv query heads that share kv head h are
 * answered together, so each K and V row is read (and converted to fp32) once for all of them.
 * Keys are taken in blocks of AD_BLOCK kept keys: the G x AD_BLOCK scores, then one online-softmax
 * rescale per block, then the weighted V rows.  Everything is fp32 (scale folded into q), one
 * rounding at the end; a sequence with no kept key gives 0.  Items are split evenly between
 * threads and each is computed by one thread in key order, so results do not depend on the
 * thread count.
 *
 * Paged: every index is validated before anything is written (QK_E_INDEX with bad_*), then
 * new_k/new_v are copied into the pool slots of positions len_b - 1, serially (two sequences may
 * name one slot), then the attention reads the pool.
 *
 * Measured (2-core Xeon VM, B=2, L=2048, Hq=32, Hkv=8, D=128, one thread): fp32 5.0 ms, bf16
 * 3.3 ms, against torch 2.13's CPU scaled_dot_product_attention (enable_gqa) at 7.6 and 4.3 ms. */
#include "cpu.h"
#include "half.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define AD_BLOCK 32
#define AD_LANES 8

/* A row of D values as fp32: the row itself for float32, else converted into buf. */
static inline const float *ad_row(const void *p, int dtype, int64_t D, float *restrict buf) {
    if (dtype == QK_F32) return p;
    const uint16_t *h = p;
    if (dtype == QK_BF16)
        for (int64_t d = 0; d < D; d++) buf[d] = qk_bf16_to_f32(h[d]);
    else
        for (int64_t d = 0; d < D; d++) buf[d] = qk_f16_to_f32(h[d]);
    return buf;
}

static inline float ad_dot(const float *restrict x, const float *restrict y, int64_t D) {
    float part[AD_LANES] = {0};
    int64_t d = 0;
    for (; d + AD_LANES <= D; d += AD_LANES)
        for (int i = 0; i < AD_LANES; i++) part[i] += x[d + i] * y[d + i];
    float s = 0.f;
    for (; d < D; d++) s += x[d] * y[d];
    for (int i = 0; i < AD_LANES; i++) s += part[i];
    return s;
}

/* s[u] = q . kr[u] for u < t.  Four keys at a time with 8-float vectors (GCC/Clang vector
 * extensions): four independent add chains, where one chain is latency-bound; the auto-vectoriser
 * turned the same loop over four partial-sum arrays into shuffles (3x slower). */
#if defined(__GNUC__)
typedef float ad_v8 __attribute__((vector_size(32)));

/* by pointer, not by value: passing 32-byte vectors would change the ABI of the SSE2 clone */
#define AD_LOAD8(p) (memcpy(&ld, (p), sizeof ld), ld)

static inline float ad_hsum8(const ad_v8 *v) {
    return (((*v)[0] + (*v)[4]) + ((*v)[1] + (*v)[5])) + (((*v)[2] + (*v)[6]) + ((*v)[3] + (*v)[7]));
}

static inline void ad_scores(const float *restrict q, const float *const *kr, int t, int64_t D, float *restrict s) {
    int u = 0;
    const int64_t D8 = D & ~(int64_t)7;
    for (; u + 4 <= t; u += 4) {
        const float *k0 = kr[u], *k1 = kr[u + 1], *k2 = kr[u + 2], *k3 = kr[u + 3];
        ad_v8 p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0}, ld;
        for (int64_t d = 0; d < D8; d += 8) {
            const ad_v8 x = AD_LOAD8(q + d);
            p0 += x * AD_LOAD8(k0 + d);
            p1 += x * AD_LOAD8(k1 + d);
            p2 += x * AD_LOAD8(k2 + d);
            p3 += x * AD_LOAD8(k3 + d);
        }
        float r0 = ad_hsum8(&p0), r1 = ad_hsum8(&p1), r2 = ad_hsum8(&p2), r3 = ad_hsum8(&p3);
        for (int64_t d = D8; d < D; d++) {
            r0 += q[d] * k0[d];
            r1 += q[d] * k1[d];
            r2 += q[d] * k2[d];
            r3 += q[d] * k3[d];
        }
        s[u] = r0, s[u + 1] = r1, s[u + 2] = r2, s[u + 3] = r3;
    }
    for (; u < t; u++) s[u] = ad_dot(q, kr[u], D);
}
#else
static inline void ad_scores(const float *restrict q, const float *const *kr, int t, int64_t D, float *restrict s) {
    for (int u = 0; u < t; u++) s[u] = ad_dot(q, kr[u], D);
}
#endif

/* acc += sum_u w[u] * vr[u], four rows per pass over acc. */
static inline void ad_accumulate(float *restrict acc, const float *w, const float *const *vr, int t, int64_t D) {
    int u = 0;
    for (; u + 4 <= t; u += 4) {
        const float w0 = w[u], w1 = w[u + 1], w2 = w[u + 2], w3 = w[u + 3];
        const float *restrict v0 = vr[u], *restrict v1 = vr[u + 1], *restrict v2 = vr[u + 2], *restrict v3 = vr[u + 3];
        for (int64_t d = 0; d < D; d++) acc[d] += (w0 * v0[d] + w1 * v1[d]) + (w2 * v2[d] + w3 * v3[d]);
    }
    for (; u < t; u++) {
        const float wu = w[u], *restrict vu = vr[u];
        for (int64_t d = 0; d < D; d++) acc[d] += wu * vu[d];
    }
}

typedef struct {
    const qk_attn_decode_args *a;
    int64_t G;
    int nomem;
} ad_job;

/* Number of key positions of sequence b and, for paged, its req_to_token row. */
static inline int64_t ad_length(const qk_attn_decode_args *a, int64_t b, const char **r2t_row) {
    if (a->paged) {
        const int64_t r = qk_index(a->req_pool_indices, a->rpi_dtype, b, a->rpi_stride);
        *r2t_row = (const char *)a->req_to_token + r * a->r2t_stride[0] * (a->r2t_dtype == QK_I32 ? 4 : 8);
        return qk_index(a->kv_indptr, a->indptr_dtype, b + 1, a->indptr_stride) -
               qk_index(a->kv_indptr, a->indptr_dtype, b, a->indptr_stride);
    }
    int64_t n = a->Lkv;
    if (a->kv_lens) {
        const int64_t len = qk_index(a->kv_lens, a->kv_lens_dtype, b, a->kv_lens_stride);
        n = len < 0 ? 0 : (len < n ? len : n);
    }
    return n;
}

QK_MULTIVERSION static void ad_worker(void *p, int tid, int nthreads) {
    ad_job *j = p;
    const qk_attn_decode_args *a = j->a;
    const int64_t G = j->G, D = a->D;
    const size_t es = a->dtype == QK_F32 ? 4 : 2;
    int64_t i0, i1;
    qk_share(a->B * a->Hkv, tid, nthreads, &i0, &i1);
    if (i0 >= i1) return;
    /* q (scaled) and acc [G][D]; k and v rows converted [AD_BLOCK][D]; scores [G][AD_BLOCK]; m, l [G] */
    float *mem = malloc(sizeof(float) * (size_t)((2 * G + 2 * AD_BLOCK) * D + G * AD_BLOCK + 2 * G + D));
    if (mem == NULL) {
        j->nomem = 1;
        return;
    }
    float *qs = mem, *acc = qs + G * D, *kbuf = acc + G * D, *vbuf = kbuf + AD_BLOCK * D;
    float *s = vbuf + AD_BLOCK * D, *m = s + G * AD_BLOCK, *l = m + G, *tmp = l + G;
    const char *kbase = a->k, *vbase = a->v;
    for (int64_t item = i0; item < i1; item++) {
        const int64_t b = item / a->Hkv, h = item % a->Hkv;
        for (int64_t g = 0; g < G; g++) {
            const char *qp = (const char *)a->q + (b * a->q_stride[0] + (h * G + g) * a->q_stride[1]) * es;
            const float *qr = ad_row(qp, a->dtype, D, tmp);
            for (int64_t d = 0; d < D; d++) qs[g * D + d] = qr[d] * a->scale;
            m[g] = -INFINITY;
            l[g] = 0.f;
        }
        memset(acc, 0, sizeof(float) * (size_t)(G * D));
        const char *r2t = NULL;
        const int64_t n = ad_length(a, b, &r2t);
        const uint8_t *mask = a->mask ? (const uint8_t *)a->mask + b * a->mask_stride[0] : NULL;
        const float *kr[AD_BLOCK], *vr[AD_BLOCK];
        int64_t pos = 0;
        while (pos < n) {
            int t = 0;
            for (; pos < n && t < AD_BLOCK; pos++) {
                if (mask && !mask[pos * a->mask_stride[1]]) continue;
                int64_t row; /* element offset of (key pos, head h) */
                if (a->paged) {
                    const int64_t slot = qk_index(r2t, a->r2t_dtype, pos, a->r2t_stride[1]);
                    row = slot * a->k_stride[1] + h * a->k_stride[2];
                    kr[t] = ad_row(kbase + row * es, a->dtype, D, kbuf + t * D);
                    row = slot * a->v_stride[1] + h * a->v_stride[2];
                } else {
                    row = b * a->k_stride[0] + pos * a->k_stride[1] + h * a->k_stride[2];
                    kr[t] = ad_row(kbase + row * es, a->dtype, D, kbuf + t * D);
                    row = b * a->v_stride[0] + pos * a->v_stride[1] + h * a->v_stride[2];
                }
                vr[t] = ad_row(vbase + row * es, a->dtype, D, vbuf + t * D);
                t++;
            }
            if (t == 0) break;
            for (int64_t g = 0; g < G; g++) {
                float *sg = s + g * AD_BLOCK, mx = m[g];
                ad_scores(qs + g * D, kr, t, D, sg);
                for (int u = 0; u < t; u++) mx = sg[u] > mx ? sg[u] : mx;
                const float corr = expf(m[g] - mx); /* 0 on the first block (m = -inf) */
                float sum = 0.f;
                for (int u = 0; u < t; u++) {
                    sg[u] = expf(sg[u] - mx);
                    sum += sg[u];
                }
                l[g] = l[g] * corr + sum;
                m[g] = mx;
                float *restrict ag = acc + g * D;
                for (int64_t d = 0; d < D; d++) ag[d] *= corr;
                ad_accumulate(ag, sg, vr, t, D);
            }
        }
        for (int64_t g = 0; g < G; g++) {
            const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
            char *op = (char *)a->out + (b * a->out_stride[0] + (h * G + g) * a->out_stride[1]) * es;
            const float *ag = acc + g * D;
            if (a->dtype == QK_F32) {
                for (int64_t d = 0; d < D; d++) ((float *)op)[d] = ag[d] * inv;
            } else if (a->dtype == QK_BF16) {
                for (int64_t d = 0; d < D; d++) ((uint16_t *)op)[d] = qk_f32_to_bf16(ag[d] * inv);
            } else {
                for (int64_t d = 0; d < D; d++) ((uint16_t *)op)[d] = qk_f32_to_f16(ag[d] * inv);
            }
        }
    }
    free(mem);
}

/* Paged: every request row, length and slot in range, before anything is written. */
static int ad_validate(qk_attn_decode_args *a) {
    for (int64_t b = 0; b < a->B; b++) {
        const int64_t r = qk_index(a->req_pool_indices, a->rpi_dtype, b, a->rpi_stride);
        if (r < 0 || r >= a->num_requests) {
            a->bad_arg = 0, a->bad_pos = b, a->bad_value = r;
            return QK_E_INDEX;
        }
        const int64_t len = qk_index(a->kv_indptr, a->indptr_dtype, b + 1, a->indptr_stride) -
                            qk_index(a->kv_indptr, a->indptr_dtype, b, a->indptr_stride);
        if (len < 0 || len > a->max_ctx) {
            a->bad_arg = 1, a->bad_pos = b, a->bad_value = len;
            return QK_E_INDEX;
        }
        const char *row = (const char *)a->req_to_token + r * a->r2t_stride[0] * (a->r2t_dtype == QK_I32 ? 4 : 8);
        for (int64_t pos = 0; pos < len; pos++) {
            const int64_t slot = qk_index(row, a->r2t_dtype, pos, a->r2t_stride[1]);
            if (slot < 0 || slot >= a->pool_size) {
                a->bad_arg = 2, a->bad_pos = r * a->max_ctx + pos, a->bad_value = slot;
                return QK_E_INDEX;
            }
        }
    }
    return QK_OK;
}

static void ad_append(const qk_attn_decode_args *a) {
    const size_t es = a->dtype == QK_F32 ? 4 : 2, bytes = (size_t)a->D * es;
    for (int64_t b = 0; b < a->B; b++) {
        const char *row = NULL;
        const int64_t len = ad_length(a, b, &row);
        if (len == 0) continue;
        const int64_t slot = qk_index(row, a->r2t_dtype, len - 1, a->r2t_stride[1]);
        for (int64_t h = 0; h < a->Hkv; h++) {
            memcpy((char *)a->k + (slot * a->k_stride[1] + h * a->k_stride[2]) * es,
                   (const char *)a->new_k + (b * a->new_k_stride[0] + h * a->new_k_stride[1]) * es, bytes);
            memcpy((char *)a->v + (slot * a->v_stride[1] + h * a->v_stride[2]) * es,
                   (const char *)a->new_v + (b * a->new_v_stride[0] + h * a->new_v_stride[1]) * es, bytes);
        }
    }
}

int qk_attn_decode_cpu(qk_attn_decode_args *a, void *stream) {
    (void)stream;
    if ((a->dtype != QK_F32 && a->dtype != QK_F16 && a->dtype != QK_BF16) || a->Hkv < 1 || a->Hq % a->Hkv ||
        a->D < 1)
        return QK_E_UNSUPPORTED;
    if (a->paged) {
        const int status = ad_validate(a);
        if (status) return status;
        if (a->new_k) ad_append(a);
    }
    if (a->B == 0 || a->Hq == 0) return QK_OK;
    ad_job j = {a, a->Hq / a->Hkv, 0};
    const int64_t items = a->B * a->Hkv;
    /* keys in all: the lengths are validated, so kv_indptr's span is their sum */
    const int64_t keys = a->paged ? qk_index(a->kv_indptr, a->indptr_dtype, a->B, a->indptr_stride) -
                                        qk_index(a->kv_indptr, a->indptr_dtype, 0, a->indptr_stride)
                                  : a->B * a->Lkv;
    int nthreads = qk_threads_for((keys + a->B) * a->Hq * a->D * 2, a->num_threads > 0 ? a->num_threads : 1);
    if (nthreads > items) nthreads = (int)items;
    int status = qk_parallel_run(nthreads, ad_worker, &j);
    if (status == QK_OK && j.nomem) status = QK_E_NOMEM;
    return status;
}
