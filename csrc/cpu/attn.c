/* attn_decode / attn_paged_decode and attn_prefill / attn_paged_prefill on the CPU.
 *
 * Both share the row loads (fp16/bf16 converted to fp32 once per row), the 8-float vectors, the
 * token-pool index loaders and checks, and the output store.  Everything is fp32 (scale folded into
 * q), online softmax (exp of scores minus the running max), one rounding at the end; a query with no
 * kept key gives 0.  Each output row is computed by one thread in key order, so results do not
 * depend on the thread count.
 *
 * Decode: work item = (sequence b, kv head h): the G = Hq / Hkv query heads that share kv head h
 * are answered together, so each K and V row is read (and converted to fp32) once for all of them.
 * Keys are taken in blocks of AD_BLOCK kept keys: the G x AD_BLOCK scores, then one online-softmax
 * rescale per block, then the weighted V rows.  Items are split evenly between threads.
 * Paged: every index is validated before anything is written (QK_E_INDEX with bad_*), then
 * new_k/new_v are copied into the pool slots of positions len_b - 1, serially (two sequences may
 * name one slot), then the attention reads the pool.
 * Measured (2-core Xeon VM, B=2, L=2048, Hq=32, Hkv=8, D=128, one thread): fp32 5.0 ms, bf16
 * 3.3 ms, against torch 2.13's CPU scaled_dot_product_attention (enable_gqa) at 7.6 and 4.3 ms.
 *
 * Prefill: see the comment above qk_attn_prefill_cpu. */
#include "attn_prefill_isa.h"
#include "cpu.h"
#include "half.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* ---- shared by decode and prefill -------------------------------------------------------- */

/* 8 floats as one GCC/Clang vector: an AVX register, two SSE ones on the baseline clone.  Loads and
 * stores are macros, and helpers take vectors by pointer: passing 32-byte vectors by value would
 * change the ABI of the SSE2 clone (-Wpsabi). */
typedef float at_v8 __attribute__((vector_size(32)));
#define AT_LOAD8(p) (memcpy(&ld, (p), sizeof ld), ld)
#define AT_STORE8(p, v) memcpy((p), &(v), sizeof(at_v8))

/* 16 floats: a zmm register on the AVX-512 clone, two ymm or four xmm elsewhere. */
typedef float at_v16 __attribute__((vector_size(64)));
typedef int32_t at_i16 __attribute__((vector_size(64)));
typedef uint32_t at_u32x16 __attribute__((vector_size(64)));
typedef uint16_t at_h16 __attribute__((vector_size(32))); /* 16 x uint16 */
#define AT_LOAD16(p) (memcpy(&ld, (p), sizeof ld), ld)
#define AT_STORE16(p, v) memcpy((p), &(v), sizeof(at_v16))

static inline float at_hsum8(const at_v8 *v) {
    return (((*v)[0] + (*v)[4]) + ((*v)[1] + (*v)[5])) + (((*v)[2] + (*v)[6]) + ((*v)[3] + (*v)[7]));
}

/* A row of D values as fp32 in dst.  16 at a time the conversions of half.h written on vectors (the
 * same operations, so the same bits): the compiler left the scalar float16 one unvectorised, 15% of
 * a float16 prefill. */
static inline void at_row_to(float *restrict dst, const void *p, int dtype, int64_t D) {
    const uint16_t *h = p;
    if (dtype == QK_F32) {
        memcpy(dst, p, sizeof(float) * (size_t)D);
        return;
    }
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        at_h16 hv;
        memcpy(&hv, h + d, sizeof hv);
        const at_u32x16 w = __builtin_convertvector(hv, at_u32x16) << 16;
        at_u32x16 bits = w;
        if (dtype == QK_F16) {
            const at_u32x16 two_w = w + w;
            const at_v16 normal = (at_v16)((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
            const at_v16 subnormal = (at_v16)((two_w >> 17) | (126u << 23)) - 0.5f;
            const at_u32x16 sub = (at_u32x16)(two_w < (1u << 27));
            bits = (w & 0x80000000u) | (((at_u32x16)subnormal & sub) | ((at_u32x16)normal & ~sub));
        }
        memcpy(dst + d, &bits, sizeof bits);
    }
    if (dtype == QK_BF16)
        for (; d < D; d++) dst[d] = qk_bf16_to_f32(h[d]);
    else
        for (; d < D; d++) dst[d] = qk_f16_to_f32(h[d]);
}

/* A row of D values as fp32: the row itself for float32, else converted into buf. */
static inline const float *at_row(const void *p, int dtype, int64_t D, float *restrict buf) {
    if (dtype == QK_F32) return p;
    at_row_to(buf, p, dtype, D);
    return buf;
}

/* The query row times scale, as fp32. */
static inline void at_row_scaled(float *restrict dst, const void *p, int dtype, int64_t D, float scale) {
    at_row_to(dst, p, dtype, D);
    for (int64_t d = 0; d < D; d++) dst[d] *= scale;
}

/* out row = acc * inv, rounded once to the output dtype. */
static inline void at_store_row(void *op, int dtype, const float *restrict acc, float inv, int64_t D) {
    if (dtype == QK_F32) {
        for (int64_t d = 0; d < D; d++) ((float *)op)[d] = acc[d] * inv;
    } else if (dtype == QK_BF16) {
        for (int64_t d = 0; d < D; d++) ((uint16_t *)op)[d] = qk_f32_to_bf16(acc[d] * inv);
    } else {
        for (int64_t d = 0; d < D; d++) ((uint16_t *)op)[d] = qk_f32_to_f16(acc[d] * inv);
    }
}

/* Element i of an additive mask as fp32 (exact: every float16 and bfloat16 value is a float). */
static inline float at_mask_value(const void *m, int dtype, int64_t i) {
    if (dtype == QK_F32) return ((const float *)m)[i];
    const uint16_t h = ((const uint16_t *)m)[i];
    return dtype == QK_BF16 ? qk_bf16_to_f32(h) : qk_f16_to_f32(h);
}

/* The token-pool indices of a paged call (both args structs hold them under their own names). */
typedef struct {
    const void *r2t, *rpi, *kv_indptr;
    int64_t r2t_stride[2], rpi_stride, kv_indptr_stride;
    int r2t_dtype, rpi_dtype, kv_indptr_dtype;
    int64_t num_requests, max_ctx, pool_size;
} at_pool;

/* Key count of sequence b and its req_to_token row. */
static inline int64_t at_pool_length(const at_pool *p, int64_t b, const char **r2t_row) {
    const int64_t r = qk_index(p->rpi, p->rpi_dtype, b, p->rpi_stride);
    *r2t_row = (const char *)p->r2t + r * p->r2t_stride[0] * (p->r2t_dtype == QK_I32 ? 4 : 8);
    return qk_index(p->kv_indptr, p->kv_indptr_dtype, b + 1, p->kv_indptr_stride) -
           qk_index(p->kv_indptr, p->kv_indptr_dtype, b, p->kv_indptr_stride);
}

static inline int64_t at_pool_slot(const at_pool *p, const char *r2t_row, int64_t pos) {
    return qk_index(r2t_row, p->r2t_dtype, pos, p->r2t_stride[1]);
}

/* Sequence b's pool row, length and slots in range, else QK_E_INDEX with bad_arg 0 (the row),
 * 1 (the length) or 2 (a slot, at position row * max_ctx + j). */
static int at_pool_check(const at_pool *p, int64_t b, int *bad_arg, int64_t *bad_pos, int64_t *bad_value) {
    const int64_t r = qk_index(p->rpi, p->rpi_dtype, b, p->rpi_stride);
    if (r < 0 || r >= p->num_requests) {
        *bad_arg = 0, *bad_pos = b, *bad_value = r;
        return QK_E_INDEX;
    }
    const char *row;
    const int64_t len = at_pool_length(p, b, &row);
    if (len < 0 || len > p->max_ctx) {
        *bad_arg = 1, *bad_pos = b, *bad_value = len;
        return QK_E_INDEX;
    }
    for (int64_t j = 0; j < len; j++) {
        const int64_t slot = at_pool_slot(p, row, j);
        if (slot < 0 || slot >= p->pool_size) {
            *bad_arg = 2, *bad_pos = r * p->max_ctx + j, *bad_value = slot;
            return QK_E_INDEX;
        }
    }
    return QK_OK;
}

/* ---- decode ------------------------------------------------------------------------------ */

#define AD_BLOCK 32
#define AD_LANES 8

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

/* s[u] = q . kr[u] for u < t.  Four keys at a time with 8-float vectors: four independent add
 * chains, where one chain is latency-bound; the auto-vectoriser turned the same loop over four
 * partial-sum arrays into shuffles (3x slower). */
static inline void ad_scores(const float *restrict q, const float *const *kr, int t, int64_t D, float *restrict s) {
    int u = 0;
    const int64_t D8 = D & ~(int64_t)7;
    for (; u + 4 <= t; u += 4) {
        const float *k0 = kr[u], *k1 = kr[u + 1], *k2 = kr[u + 2], *k3 = kr[u + 3];
        at_v8 p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0}, ld;
        for (int64_t d = 0; d < D8; d += 8) {
            const at_v8 x = AT_LOAD8(q + d);
            p0 += x * AT_LOAD8(k0 + d);
            p1 += x * AT_LOAD8(k1 + d);
            p2 += x * AT_LOAD8(k2 + d);
            p3 += x * AT_LOAD8(k3 + d);
        }
        float r0 = at_hsum8(&p0), r1 = at_hsum8(&p1), r2 = at_hsum8(&p2), r3 = at_hsum8(&p3);
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
    at_pool pool;
    int64_t G;
    int nomem;
} ad_job;

/* Number of key positions of sequence b and, for paged, its req_to_token row. */
static inline int64_t ad_length(const ad_job *j, int64_t b, const char **r2t_row) {
    const qk_attn_decode_args *a = j->a;
    if (a->paged) return at_pool_length(&j->pool, b, r2t_row);
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
    float *mem = malloc(sizeof(float) * (size_t)((2 * G + 2 * AD_BLOCK) * D + G * AD_BLOCK + 2 * G));
    float bias[AD_BLOCK]; /* an additive mask's values of the block's keys */
    if (mem == NULL) {
        j->nomem = 1;
        return;
    }
    float *qs = mem, *acc = qs + G * D, *kbuf = acc + G * D, *vbuf = kbuf + AD_BLOCK * D;
    float *s = vbuf + AD_BLOCK * D, *m = s + G * AD_BLOCK, *l = m + G;
    const char *kbase = a->k, *vbase = a->v;
    for (int64_t item = i0; item < i1; item++) {
        const int64_t b = item / a->Hkv, h = item % a->Hkv;
        for (int64_t g = 0; g < G; g++) {
            const char *qp = (const char *)a->q + (b * a->q_stride[0] + (h * G + g) * a->q_stride[1]) * es;
            at_row_scaled(qs + g * D, qp, a->dtype, D, a->scale);
            m[g] = -INFINITY;
            l[g] = 0.f;
        }
        memset(acc, 0, sizeof(float) * (size_t)(G * D));
        const char *r2t = NULL;
        int64_t n = ad_length(j, b, &r2t);
        if (a->mask && a->mask_cols > 0 && n > a->mask_cols) n = a->mask_cols; /* a narrower mask drops the rest */
        const uint8_t *mask = a->mask && !a->mask_float ? (const uint8_t *)a->mask + b * a->mask_stride[0] : NULL;
        const int fmask = a->mask && a->mask_float;
        const float *kr[AD_BLOCK], *vr[AD_BLOCK];
        int64_t pos = 0;
        while (pos < n) {
            int t = 0;
            for (; pos < n && t < AD_BLOCK; pos++) {
                if (mask && !mask[pos * a->mask_stride[1]]) continue;
                if (fmask) { /* -inf: dropped, as a False */
                    bias[t] = at_mask_value(a->mask, a->mask_dtype, b * a->mask_stride[0] + pos * a->mask_stride[1]);
                    if (bias[t] == -INFINITY) continue;
                }
                int64_t row; /* element offset of (key pos, head h) */
                if (a->paged) {
                    const int64_t slot = at_pool_slot(&j->pool, r2t, pos);
                    row = slot * a->k_stride[1] + h * a->k_stride[2];
                    kr[t] = at_row(kbase + row * es, a->dtype, D, kbuf + t * D);
                    row = slot * a->v_stride[1] + h * a->v_stride[2];
                } else {
                    row = b * a->k_stride[0] + pos * a->k_stride[1] + h * a->k_stride[2];
                    kr[t] = at_row(kbase + row * es, a->dtype, D, kbuf + t * D);
                    row = b * a->v_stride[0] + pos * a->v_stride[1] + h * a->v_stride[2];
                }
                vr[t] = at_row(vbase + row * es, a->dtype, D, vbuf + t * D);
                t++;
            }
            if (t == 0) break;
            for (int64_t g = 0; g < G; g++) {
                float *sg = s + g * AD_BLOCK, mx = m[g];
                ad_scores(qs + g * D, kr, t, D, sg);
                if (fmask)
                    for (int u = 0; u < t; u++) sg[u] += bias[u];
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
            char *op = (char *)a->out + (b * a->out_stride[0] + (h * G + g) * a->out_stride[1]) * es;
            at_store_row(op, a->dtype, acc + g * D, l[g] > 0.f ? 1.f / l[g] : 0.f, D);
        }
    }
    free(mem);
}

static void ad_append(const ad_job *j) {
    const qk_attn_decode_args *a = j->a;
    const size_t es = a->dtype == QK_F32 ? 4 : 2, bytes = (size_t)a->D * es;
    for (int64_t b = 0; b < a->B; b++) {
        const char *row = NULL;
        const int64_t len = ad_length(j, b, &row);
        if (len == 0) continue;
        const int64_t slot = at_pool_slot(&j->pool, row, len - 1);
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
    ad_job j = {a, {0}, a->Hq / a->Hkv, 0};
    if (a->paged) {
        j.pool = (at_pool){a->req_to_token, a->req_pool_indices, a->kv_indptr, {a->r2t_stride[0], a->r2t_stride[1]},
                           a->rpi_stride, a->indptr_stride, a->r2t_dtype, a->rpi_dtype, a->indptr_dtype,
                           a->num_requests, a->max_ctx, a->pool_size};
        for (int64_t b = 0; b < a->B; b++)
            if (at_pool_check(&j.pool, b, &a->bad_arg, &a->bad_pos, &a->bad_value)) return QK_E_INDEX;
        if (a->new_k) ad_append(&j);
    }
    if (a->B == 0 || a->Hq == 0) return QK_OK;
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

/* ---- prefill ----------------------------------------------------------------------------- */

#define AP_KT QK_AP_KT /* keys per tile (attn_prefill_isa.h); the bfloat16 levels take QK_AP_KT_BF16 */
#define AP_KT_MAX (QK_AP_KT_BF16 > AP_KT ? QK_AP_KT_BF16 : AP_KT)
#define AP_ROWS 128    /* query rows (positions x the G heads of a kv head) a block aims for */
#define AP_QB_MAX 64   /* query positions per block at most */

/* e^x for 16 floats x <= 0 (scores minus their running max), about 1 ulp: 2^n e^f with
 * n = round(x log2 e), f = x - n ln 2 in two parts (Cody-Waite) and Cephes' expf polynomial for e^f.
 * x below -87 (e^x near FLT_MIN) gives exactly 0, so masked keys (-inf) weigh nothing; NaN stays
 * NaN.  There is one exponential per score, against 4 D multiply-adds: glibc's expf is scalar. */
static inline void ap_exp16(at_v16 *v) {
    const at_i16 under = *v < -87.f;
    const at_v16 x = (at_v16)(((at_i16)*v & ~under) | ((at_i16)((at_v16){0} - 87.f) & under));
    const at_v16 magic = (at_v16){0} + 0x1.8p23f; /* adding it rounds to an integer */
    const at_v16 n = (x * 1.44269504088896341f + magic) - magic;
    const at_v16 f = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    at_v16 p = (at_v16){0} + 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * (f * f) + f + 1.f;
    const at_i16 pow2 = (__builtin_convertvector(n, at_i16) + 127) << 23;
    *v = (at_v16)((at_i16)(p * (at_v16)pow2) & ~under);
}

/* *m = the lane-wise max of *m and *x (NaN in x ignored, as the scalar x > m ? x : m). */
static inline void ap_max16(at_v16 *m, const at_v16 *x) {
    const at_i16 gt = *x > *m;
    *m = (at_v16)(((at_i16)*x & gt) | ((at_i16)*m & ~gt));
}

/* st[u][r] = q[r] . k[u] for the AP_KT keys of a tile (portable level) and rows r < Rp (a multiple of 16): qt holds
 * the block's queries transposed, [D][Rp], kr the keys' rows.  The outer-product form of a small
 * GEMM with the rows in the vector lanes, 4 keys x nc (1 or 2) vectors of rows per pass; the 32 x D
 * slice of qt and the tile's keys stay in L1 while the 8 groups of keys go by. */
static inline __attribute__((always_inline)) void ap_scores_tile(float *restrict st, const float *restrict qt,
                                                                  const float *const *kr, int64_t r, int nc,
                                                                  int64_t D, int64_t Rp) {
    for (int u = 0; u < AP_KT; u += 4) {
        const float *k0 = kr[u], *k1 = kr[u + 1], *k2 = kr[u + 2], *k3 = kr[u + 3];
        at_v16 acc[4][2], ld;
        for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = (at_v16){0};
        const float *q = qt + r;
        for (int64_t d = 0; d < D; d++, q += Rp) {
            at_v16 qv[2];
            for (int c = 0; c < nc; c++) qv[c] = AT_LOAD16(q + 16 * c);
            const float kv[4] = {k0[d], k1[d], k2[d], k3[d]};
            for (int i = 0; i < 4; i++)
                for (int c = 0; c < nc; c++) acc[i][c] += kv[i] * qv[c];
        }
        for (int i = 0; i < 4; i++)
            for (int c = 0; c < nc; c++) AT_STORE16(st + (u + i) * Rp + r + 16 * c, acc[i][c]);
    }
}

static inline __attribute__((always_inline)) void ap_scores(float *restrict st, const float *restrict qt,
                                                             const float *const *kr, int64_t D, int64_t Rp) {
    int64_t r = 0;
    for (; r + 32 <= Rp; r += 32) ap_scores_tile(st, qt, kr, r, 2, D, Rp);
    if (r < Rp) ap_scores_tile(st, qt, kr, r, 1, D, Rp);
}

/* acc[r] = acc[r] corr[r] + sum_{u < t} pt[u][r] vr[u] for 4 rows from r and nc (1 or 2) vectors of
 * columns from d: one pass over the tile's V rows with the accumulators in registers. */
static inline __attribute__((always_inline)) void ap_pv_tile(float *restrict acc, const float *restrict corr,
                                                              const float *restrict pt, const float *const *vr,
                                                              int64_t r, int64_t d, int t, int64_t Dp, int64_t Rp,
                                                              int nc) {
    at_v16 o[4][2], ld;
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < nc; c++) o[i][c] = AT_LOAD16(acc + (r + i) * Dp + d + 16 * c) * corr[r + i];
    for (int u = 0; u < t; u++) {
        at_v16 v[2];
        for (int c = 0; c < nc; c++) v[c] = AT_LOAD16(vr[u] + d + 16 * c);
        const float *w = pt + u * Rp + r;
        for (int i = 0; i < 4; i++)
            for (int c = 0; c < nc; c++) o[i][c] += w[i] * v[c];
    }
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < nc; c++) AT_STORE16(acc + (r + i) * Dp + d + 16 * c, o[i][c]);
}

/* acc = acc corr + P V over rows r < Rp; Dp, the padded head dim, is a multiple of 16 and every V
 * row holds Dp floats. */
static inline __attribute__((always_inline)) void ap_accumulate(float *restrict acc, const float *restrict corr,
                                                                 const float *restrict pt, const float *const *vr,
                                                                 int64_t Rp, int t, int64_t Dp) {
    for (int64_t r = 0; r < Rp; r += 4) {
        int64_t d = 0;
        for (; d + 32 <= Dp; d += 32) ap_pv_tile(acc, corr, pt, vr, r, d, t, Dp, Rp, 2);
        if (d < Dp) ap_pv_tile(acc, corr, pt, vr, r, d, t, Dp, Rp, 1);
    }
}

/* The online-softmax step of a tile for 16 rows from r, all in vector lanes: st[u][r..] (scores,
 * -inf where not kept) become the weights e^(s - m) with m the new running max; l becomes l corr +
 * the weights' sum, corr = e^(m_old - m) rescales the accumulators.  Rows that have kept nothing yet
 * (m = -inf) get weights 0, corr 0 (their acc is 0) and keep l = 0. */
static inline __attribute__((always_inline)) void ap_softmax16(float *restrict st, int64_t r, int64_t Rp, float *m,
                                                                float *l, float *corr, int kt) {
    at_v16 ld, mx = AT_LOAD16(m + r), mc[4] = {mx, mx, mx, mx};
    for (int u = 0; u < kt; u += 4) /* four chains: the max is exact, so any order gives its value */
        for (int c = 0; c < 4; c++) {
            const at_v16 s = AT_LOAD16(st + (u + c) * Rp + r);
            ap_max16(&mc[c], &s);
        }
    ap_max16(&mc[0], &mc[1]);
    ap_max16(&mc[2], &mc[3]);
    ap_max16(&mc[0], &mc[2]);
    mx = mc[0];
    const at_i16 none = mx == -INFINITY;
    const at_v16 base = (at_v16)((at_i16)mx & ~none); /* 0 where nothing is kept: e^(-inf - 0) = 0 */
    at_v16 sum = {0}, c = AT_LOAD16(m + r) - base;
    for (int u = 0; u < kt; u++) {
        at_v16 e = AT_LOAD16(st + u * Rp + r) - base;
        ap_exp16(&e);
        AT_STORE16(st + u * Rp + r, e);
        sum += e;
    }
    ap_exp16(&c);
    const at_v16 nl = AT_LOAD16(l + r) * c + sum;
    AT_STORE16(l + r, nl);
    AT_STORE16(corr + r, c);
    AT_STORE16(m + r, mx);
}

/* Query positions [i0, i1) of sequence b; q_off/out_off: element offset of its position 0. */
typedef struct {
    int64_t b, i0, i1, q_len, kv_len, q_off, out_off;
    int64_t cost; /* rows x keys it sees */
    const char *r2t_row; /* paged */
} ap_block;

typedef struct {
    const qk_attn_prefill_args *a;
    at_pool pool;
    const ap_block *blocks; /* item i is block i / Hkv for kv head i % Hkv */
    int64_t items, G, QB, Dp, Dp32; /* QB: the most query positions of a block (sizes the scratch) */
    int level, wide, kt;            /* QK_AP_* and AVX-512 (attn_prefill_isa.h); keys per tile */
    atomic_llong next;
    atomic_int nomem;
} ap_job;

/* Scratch of one worker (Rp: rows padded to 16, kt: keys per tile): q scaled and transposed [D][Rp];
 * scores, then weights, keys-major [kt][Rp]; acc [Rp][Dp]; converted K rows [kt][D] and V rows
 * [kt][Dp] (zero-padded); a zero key row for the tile's unused columns; running max, sum and
 * rescale factor [Rp]; the rows' causal limits relative to the tile [Rp]; one q row [D].  bfloat16
 * levels: q in pairs, K and V rows as given, V and the weights packed (attn_prefill_isa.h). */
typedef struct {
    float *qt, *st, *acc, *kbuf, *vbuf, *kzero, *m, *l, *corr, *qrow;
    int32_t *lim;
    uint32_t *qp, *vp, *pp;
    uint16_t *kb16, *vb16;
    int64_t pos[AP_KT_MAX];
    const float *kr[AP_KT_MAX], *vr[AP_KT_MAX];
} ap_scratch;

/* The K and V rows of key position j of block blk's sequence, kv head h. */
static inline void ap_key_rows(const ap_job *j, const ap_block *blk, int64_t h, int64_t pos, const char **kp,
                               const char **vp) {
    const qk_attn_prefill_args *a = j->a;
    const size_t es = a->dtype == QK_F32 ? 4 : 2;
    int64_t ko, vo;
    if (a->paged) {
        const int64_t slot = at_pool_slot(&j->pool, blk->r2t_row, pos);
        ko = slot * a->k_stride[1], vo = slot * a->v_stride[1];
    } else {
        ko = blk->b * a->k_stride[0] + pos * a->k_stride[1];
        vo = blk->b * a->v_stride[0] + pos * a->v_stride[1];
    }
    *kp = (const char *)a->k + (ko + h * a->k_stride[2]) * es;
    *vp = (const char *)a->v + (vo + h * a->v_stride[2]) * es;
}

/* Block blk for kv head h: the G query heads of h over the block's positions, against the keys
 * any of them keeps, a tile of AP_KT keys at a time. */
static inline __attribute__((always_inline)) void ap_block_run(const ap_job *j, const ap_block *blk, int64_t h,
                                                                ap_scratch *w) {
    const qk_attn_prefill_args *a = j->a;
    const int64_t G = j->G, D = a->D, Dp = j->Dp, nq = blk->i1 - blk->i0, R = nq * G, Rp = (R + 15) & ~(int64_t)15;
    const size_t es = a->dtype == QK_F32 ? 4 : 2;
    const int64_t off = blk->kv_len - blk->q_len; /* query i sits at key position i + off */
    const int bf = j->level >= QK_AP_DPBF16, amx = j->level == QK_AP_AMX, kt = j->kt;
    const int64_t Dp32 = j->Dp32, DB = Dp32 / 32;
    if (bf) {
        for (int64_t r0 = 0; r0 < Rp; r0 += 16) {
            const uint16_t *rows[16];
            for (int64_t r = r0; r < r0 + 16; r++) {
                const int64_t o = blk->q_off + (blk->i0 + r / G) * a->q_stride[1] + (h * G + r % G) * a->q_stride[2];
                rows[r - r0] = r < R ? (const uint16_t *)a->q + o : NULL;
            }
            qk_ap_pack_q(w->qp + r0 * DB * 16, rows, D, Dp32);
        }
    } else {
        memset(w->qt, 0, sizeof(float) * (size_t)(D * Rp));
        for (int64_t r = 0; r < R; r++) { /* row r: position i0 + r / G, head h G + r % G */
            const int64_t o = blk->q_off + (blk->i0 + r / G) * a->q_stride[1] + (h * G + r % G) * a->q_stride[2];
            at_row_scaled(w->qrow, (const char *)a->q + o * es, a->dtype, D, a->scale);
            for (int64_t d = 0; d < D; d++) w->qt[d * Rp + r] = w->qrow[d];
        }
    }
    memset(w->acc, 0, sizeof(float) * (size_t)(Rp * Dp));
    for (int64_t r = 0; r < Rp; r++) w->m[r] = -INFINITY, w->l[r] = 0.f;

    /* keys j < hi; with causal none beyond the last query's diagonal, and every row keeps j <= lo */
    int64_t hi = blk->kv_len, lo = INT64_MAX;
    if (a->causal) {
        lo = blk->i0 + off;
        if (hi > blk->i1 + off) hi = blk->i1 + off;
    }
    if (a->mask && a->mask_cols > 0 && hi > a->mask_cols) hi = a->mask_cols; /* a narrower mask drops the rest */
    const uint8_t *mask = a->mask ? (const uint8_t *)a->mask + blk->b * a->mask_stride[0] : NULL;
    const uint8_t *key_mask = a->mask_kind == 1 ? mask : NULL;
    const uint8_t *row_mask = a->mask_kind == 2 && !a->mask_float ? mask : NULL;
    const int row_bias = a->mask_kind == 2 && a->mask_float; /* an additive per-query mask */
    const int64_t ms3 = a->mask_stride[3];
    /* float32 rows are read in place (V only when D fills whole vectors: the accumulation reads Dp) */
    const int k_in_place = a->dtype == QK_F32, v_in_place = a->dtype == QK_F32 && D == Dp;
    const int64_t row_bytes = D * (int64_t)es;
    for (int64_t cursor = 0; cursor < hi;) {
        int t = 0;
        for (; cursor < hi && t < kt; cursor++) {
            if (key_mask && !key_mask[cursor * ms3]) continue; /* a key no row keeps: not loaded */
            const char *kp, *vp;
            ap_key_rows(j, blk, h, cursor, &kp, &vp);
            if (cursor + kt < hi) { /* the next tile's row: rows of a head are far apart, one page each */
                const char *kn, *vn;
                ap_key_rows(j, blk, h, cursor + kt, &kn, &vn);
                for (int64_t byte = 0; byte < row_bytes; byte += 64) {
                    __builtin_prefetch(kn + byte);
                    __builtin_prefetch(vn + byte);
                }
            }
            if (bf) {
                memcpy(w->kb16 + t * Dp32, kp, (size_t)row_bytes);
                memcpy(w->vb16 + t * Dp, vp, (size_t)row_bytes);
                w->pos[t++] = cursor;
                continue;
            }
            if (k_in_place) w->kr[t] = (const float *)kp;
            else at_row_to(w->kbuf + t * D, kp, a->dtype, D), w->kr[t] = w->kbuf + t * D;
            if (v_in_place) w->vr[t] = (const float *)vp;
            else at_row_to(w->vbuf + t * Dp, vp, a->dtype, D), w->vr[t] = w->vbuf + t * Dp;
            w->pos[t++] = cursor;
        }
        if (t == 0) break;
        if (bf) {
            if (t < kt) { /* finite scores, masked below; zero weights times zero V rows */
                memset(w->kb16 + t * Dp32, 0, sizeof(uint16_t) * (size_t)((kt - t) * Dp32));
                memset(w->vb16 + t * Dp, 0, sizeof(uint16_t) * (size_t)((kt - t) * Dp));
            }
            qk_ap_scores_bf16(w->st, w->qp, w->kb16, Dp32, Rp, kt, a->scale, amx);
        } else {
            for (int u = t; u < AP_KT; u++) w->kr[u] = w->kzero; /* finite scores, masked below */
            if (j->level == QK_AP_FMA) qk_ap_scores_fma(w->st, w->qt, w->kr, D, Rp, j->wide);
            else ap_scores(w->st, w->qt, w->kr, D, Rp);
        }
        if (t < kt || row_mask || row_bias || w->pos[t - 1] > lo) {
            /* keep key u for row r iff u < t, pos[u] <= the row's causal limit and the row mask
             * keeps it; positions relative to the tile's first fit in 32 bits */
            const int64_t p0 = w->pos[0];
            for (int64_t r = 0; r < Rp; r++) {
                const int64_t rel = a->causal && r < R ? blk->i0 + r / G + off - p0 : INT32_MAX - 1;
                w->lim[r] = (int32_t)(rel < -1 ? -1 : (rel > INT32_MAX - 1 ? INT32_MAX - 1 : rel));
            }
            for (int u = 0; u < kt; u++) {
                const int64_t rel = u < t ? w->pos[u] - p0 : INT32_MAX;
                const int32_t pu = (int32_t)(rel < INT32_MAX ? rel : INT32_MAX);
                for (int64_t r = 0; r < Rp; r += 16) {
                    at_v16 ld, s = AT_LOAD16(w->st + u * Rp + r);
                    at_i16 li;
                    memcpy(&li, w->lim + r, sizeof li);
                    const at_i16 drop = pu > li;
                    s = (at_v16)(((at_i16)s & ~drop) | ((at_i16)((at_v16){0} - INFINITY) & drop));
                    AT_STORE16(w->st + u * Rp + r, s);
                }
            }
            if (row_mask)
                for (int64_t r = 0; r < R; r++) {
                    const uint8_t *mr = row_mask + (h * G + r % G) * a->mask_stride[1] +
                                        (blk->i0 + r / G) * a->mask_stride[2];
                    for (int u = 0; u < t; u++)
                        if (!mr[w->pos[u] * ms3]) w->st[u * Rp + r] = -INFINITY;
                }
            if (row_bias)
                for (int64_t r = 0; r < R; r++) { /* added where causal kept the key (-inf + inf is NaN) */
                    const int64_t mr = blk->b * a->mask_stride[0] + (h * G + r % G) * a->mask_stride[1] +
                                       (blk->i0 + r / G) * a->mask_stride[2];
                    for (int u = 0; u < t; u++)
                        if (w->st[u * Rp + r] != -INFINITY)
                            w->st[u * Rp + r] += at_mask_value(a->mask, a->mask_dtype, mr + w->pos[u] * ms3);
                }
        }
        if (j->level != QK_AP_PORTABLE) qk_ap_softmax(w->st, Rp, kt, w->m, w->l, w->corr, j->wide);
        else
            for (int64_t r = 0; r < Rp; r += 16) ap_softmax16(w->st, r, Rp, w->m, w->l, w->corr, kt);
        if (bf) qk_ap_pv_bf16(w->acc, w->corr, w->st, w->vb16, w->vp, w->pp, Rp, Dp, kt, amx);
        else if (j->level == QK_AP_FMA) qk_ap_pv_fma(w->acc, w->corr, w->st, w->vr, Rp, t, Dp, j->wide);
        else ap_accumulate(w->acc, w->corr, w->st, w->vr, Rp, t, Dp);
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t o = blk->out_off + (blk->i0 + r / G) * a->out_stride[1] + (h * G + r % G) * a->out_stride[2];
        at_store_row((char *)a->out + o * es, a->dtype, w->acc + r * Dp, w->l[r] > 0.f ? 1.f / w->l[r] : 0.f, D);
    }
}

QK_MULTIVERSION static void ap_worker(void *p, int tid, int nthreads) {
    (void)tid, (void)nthreads;
    ap_job *j = p;
    const int64_t D = j->a->D, Dp = j->Dp, Dp32 = j->Dp32, Rp = (j->QB * j->G + 15) & ~(int64_t)15, kt = j->kt;
    float *mem = calloc((size_t)(D * Rp + kt * Rp + Rp * Dp + kt * D + kt * Dp + D + 4 * Rp + D), sizeof(float));
    /* bfloat16 levels: qp [Rp Dp32 / 2], vp [kt Dp / 2], pp [kt Rp / 2] pairs; kb16 [kt][Dp32], vb16 [kt][Dp] */
    const int bf = j->level >= QK_AP_DPBF16;
    uint32_t *mem16 = bf ? calloc((size_t)(Rp * Dp32 / 2 + kt * Dp / 2 + kt * Rp / 2 + kt * (Dp32 + Dp) / 2), 4) : NULL;
    if (mem == NULL || (bf && mem16 == NULL)) {
        free(mem);
        free(mem16);
        atomic_store(&j->nomem, 1);
        return;
    }
    ap_scratch w;
    w.qt = mem, w.st = w.qt + D * Rp, w.acc = w.st + kt * Rp, w.kbuf = w.acc + Rp * Dp;
    w.vbuf = w.kbuf + kt * D, w.kzero = w.vbuf + kt * Dp, w.m = w.kzero + D, w.l = w.m + Rp;
    w.corr = w.l + Rp, w.lim = (int32_t *)(w.corr + Rp), w.qrow = w.corr + 2 * Rp;
    w.qp = mem16, w.vp = bf ? w.qp + Rp * Dp32 / 2 : NULL, w.pp = bf ? w.vp + kt * Dp / 2 : NULL;
    w.kb16 = bf ? (uint16_t *)(w.pp + kt * Rp / 2) : NULL, w.vb16 = bf ? w.kb16 + kt * Dp32 : NULL;
    if (j->level == QK_AP_AMX) qk_ap_amx_begin();
    for (;;) {
        const int64_t item = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (item >= j->items) break;
        ap_block_run(j, &j->blocks[item / j->a->Hkv], item % j->a->Hkv, &w);
    }
    if (j->level == QK_AP_AMX) qk_ap_amx_end();
    free(mem);
    free(mem16);
}

/* Paged: pool rows, kv lengths and slots (at_pool_check), then query rows qo_indptr[b] ..
 * qo_indptr[b+1] ascending within [0, total_q] and no more queries than keys (bad_arg 3, the
 * sequence and its q_len), and than a per-query mask's rows (bad_arg 4). */
static int ap_validate(qk_attn_prefill_args *a, const at_pool *pool) {
    for (int64_t b = 0; b < a->B; b++) {
        if (at_pool_check(pool, b, &a->bad_arg, &a->bad_pos, &a->bad_value)) return QK_E_INDEX;
        const int64_t q0 = qk_index(a->qo_indptr, a->qo_indptr_dtype, b, a->qo_indptr_stride);
        const int64_t q1 = qk_index(a->qo_indptr, a->qo_indptr_dtype, b + 1, a->qo_indptr_stride);
        const char *row;
        if (q0 < 0 || q1 < q0 || q1 > a->total_q || q1 - q0 > at_pool_length(pool, b, &row)) {
            a->bad_arg = 3, a->bad_pos = b, a->bad_value = q1 - q0;
            return QK_E_INDEX;
        }
        if (a->mask && a->mask_kind == 2 && a->mask_rows > 0 && q1 - q0 > a->mask_rows) {
            a->bad_arg = 4, a->bad_pos = b, a->bad_value = q1 - q0;
            return QK_E_INDEX;
        }
    }
    return QK_OK;
}

/* Dearest block first (ties in sequence order; qsort needs a consistent order). */
static int ap_cost_order(const void *x, const void *y) {
    const ap_block *p = x, *q = y;
    if (p->cost != q->cost) return p->cost > q->cost ? -1 : 1;
    if (p->b != q->b) return p->b < q->b ? -1 : 1;
    return (p->i0 > q->i0) - (p->i0 < q->i0);
}

/* Sequence b's query count, key count and its query rows' offset (paged: the rows of the request). */
static int64_t ap_sequence(const qk_attn_prefill_args *a, const at_pool *pool, int64_t b, ap_block *s) {
    memset(s, 0, sizeof *s);
    s->b = b;
    if (a->paged) {
        const int64_t q0 = qk_index(a->qo_indptr, a->qo_indptr_dtype, b, a->qo_indptr_stride);
        s->q_len = qk_index(a->qo_indptr, a->qo_indptr_dtype, b + 1, a->qo_indptr_stride) - q0;
        s->kv_len = at_pool_length(pool, b, &s->r2t_row);
        s->q_off = q0 * a->q_stride[1];
        s->out_off = q0 * a->out_stride[1];
    } else {
        s->q_len = a->Lq;
        s->kv_len = a->Lkv;
        s->q_off = b * a->q_stride[0];
        s->out_off = b * a->out_stride[0];
    }
    return s->q_len;
}

/* Paged: query rows outside qo_indptr[0] .. qo_indptr[B] - 1 belong to no request and are 0 (the
 * validated ranges are ascending, so these are the only rows no block writes). */
static void ap_zero_unowned_rows(const qk_attn_prefill_args *a) {
    const size_t es = a->dtype == QK_F32 ? 4 : 2;
    const int64_t first = qk_index(a->qo_indptr, a->qo_indptr_dtype, 0, a->qo_indptr_stride);
    const int64_t last = qk_index(a->qo_indptr, a->qo_indptr_dtype, a->B, a->qo_indptr_stride);
    for (int64_t t = 0; t < a->total_q; t++) {
        if (t == first) t = last;
        if (t >= a->total_q) break;
        for (int64_t hq = 0; hq < a->Hq; hq++)
            memset((char *)a->out + (t * a->out_stride[1] + hq * a->out_stride[2]) * es, 0, (size_t)a->D * es);
    }
}

/* attn_prefill and attn_paged_prefill.
 *
 * Work item = (sequence b, kv head h, block of QB query positions): the block's R = QB x G query
 * rows (all G = Hq / Hkv heads of kv head h; QB = AP_ROWS / G, at most AP_QB_MAX, twice both at the
 * bfloat16 levels) go against tiles of kt keys, so each K and V row is read (and converted or
 * packed) once per block.  The rows live in the vector lanes: q transposed [D][R] (bfloat16 levels:
 * packed in pairs), scores keys-major [kt][R], so the scores are a register-blocked GEMM with no
 * horizontal sums, and the running max, the exponentials (a vector polynomial) and the rescale of
 * the online softmax are 16 rows per instruction; then P V into the fp32 accumulators [R][D].  Key
 * tiles past the block's last diagonal are never loaded and the causal / mask_kind 2 mask is
 * applied only on tiles that cross it; with mask_kind 1 masked keys are skipped as they are
 * gathered.  float32 K and V rows are read in place.  Items are sorted by cost (rows x keys they
 * see), dearest first, and taken from a shared counter: blocks differ (causal, ragged lengths), so
 * equal shares would leave threads idle.
 *
 * The products run at the level qk_ap_level picks from the dtype and the CPU (attn_prefill_isa.h):
 * the portable tiles below (no FMA: -std=c11 keeps GCC from contracting, so every clone gives the
 * same bits), FMA tiles for fp32, VDPBF16PS or AMX for bfloat16 (the scale applied to the fp32 sums,
 * the weights rounded to bfloat16 once for P V).  The level and the blocks depend on the shapes and
 * the CPU only, never on the thread count.
 *
 * Paged: every index is validated first (QK_E_INDEX with bad_*, nothing written); rows of q that
 * belong to no request are written as 0. */
int qk_attn_prefill_cpu(qk_attn_prefill_args *a, void *stream) {
    (void)stream;
    if ((a->dtype != QK_F32 && a->dtype != QK_F16 && a->dtype != QK_BF16) || a->Hkv < 1 || a->Hq % a->Hkv ||
        a->D < 1 || a->mask_kind < 0 || a->mask_kind > 2 || (a->mask_float && a->mask_kind != 2))
        return QK_E_UNSUPPORTED;
    at_pool pool = {0};
    if (a->paged) {
        pool = (at_pool){a->req_to_token, a->req_pool_indices, a->kv_indptr, {a->r2t_stride[0], a->r2t_stride[1]},
                         a->rpi_stride, a->kv_indptr_stride, a->r2t_dtype, a->rpi_dtype, a->kv_indptr_dtype,
                         a->num_requests, a->max_ctx, a->pool_size};
        const int status = ap_validate(a, &pool);
        if (status) return status;
        if (a->Hq > 0) ap_zero_unowned_rows(a);
    }
    if (a->B == 0 || a->Hq == 0) return QK_OK;
    const int64_t G = a->Hq / a->Hkv;
    int wide;
    const int level = qk_ap_level(a->dtype, a->cpu_isa, &wide), bf = level >= QK_AP_DPBF16;
    /* the bfloat16 levels: twice the rows per packed K / V tile (the packing is vector work) */
    int64_t QB = (bf ? 2 * AP_ROWS : AP_ROWS) / G;
    QB = QB < 1 ? 1 : (QB > (bf ? 2 * AP_QB_MAX : AP_QB_MAX) ? (bf ? 2 * AP_QB_MAX : AP_QB_MAX) : QB);
    int64_t nblocks = 0;
    ap_block s;
    for (int64_t b = 0; b < a->B; b++) nblocks += (ap_sequence(a, &pool, b, &s) + QB - 1) / QB;
    if (nblocks == 0) return QK_OK;
    ap_block *blocks = malloc(sizeof(ap_block) * (size_t)nblocks);
    if (blocks == NULL) return QK_E_NOMEM;
    int64_t n = 0, work = 0, widest = 0;
    for (int64_t b = 0; b < a->B; b++) {
        ap_sequence(a, &pool, b, &s);
        for (int64_t i0 = 0; i0 < s.q_len; i0 += QB) {
            ap_block *blk = &blocks[n++];
            *blk = s;
            blk->i0 = i0;
            blk->i1 = i0 + QB < s.q_len ? i0 + QB : s.q_len;
            if (widest < blk->i1 - i0) widest = blk->i1 - i0;
            int64_t keys = s.kv_len;
            if (a->causal && keys > blk->i1 + s.kv_len - s.q_len) keys = blk->i1 + s.kv_len - s.q_len;
            blk->cost = (blk->i1 - blk->i0) * ((keys > 0 ? keys : 0) + AP_KT);
            work += blk->cost;
        }
    }
    qsort(blocks, (size_t)nblocks, sizeof(ap_block), ap_cost_order);
    ap_job j = {.a = a, .pool = pool, .blocks = blocks, .items = nblocks * a->Hkv, .G = G, .QB = widest,
                .Dp = (a->D + 15) & ~(int64_t)15, .Dp32 = (a->D + 31) & ~(int64_t)31};
    j.level = level, j.wide = wide, j.kt = bf ? QK_AP_KT_BF16 : AP_KT;
    atomic_init(&j.next, 0);
    atomic_init(&j.nomem, 0);
    int nthreads = qk_threads_for(work * a->Hq * a->D * 2, a->num_threads > 0 ? a->num_threads : 1);
    if (nthreads > j.items) nthreads = (int)j.items;
    int status = qk_parallel_run(nthreads, ap_worker, &j);
    if (status == QK_OK && atomic_load(&j.nomem)) status = QK_E_NOMEM;
    free(blocks);
    return status;
}
