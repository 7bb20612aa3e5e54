/* attn_decode / attn_paged_decode and attn_prefill / attn_paged_prefill on the CPU.
 *
 * Both share the row loads (fp16/bf16 converted to fp32), the 16-float vectors, the exponential,
 * the token-pool index loaders and checks, and the output store.  Online softmax (exp of scores
 * minus the running max) in fp32, one rounding at the end; a query with no kept key gives 0.  fp32
 * throughout (scale folded into q) except bfloat16 prefill, whose products are exact bf16 products
 * summed in fp32, scaled after, with the weights rounded to bf16 once for P V (docs/ops.md).
 * Results do not depend on the thread count.
 *
 * Decode (flash-decoding on the CPU): each sequence's key positions are cut into splits of
 * AD_CHUNK, a constant, and a work item is (split, group of kv heads): it streams the split's token
 * rows, whole rows when the group is every kv head, and answers all G = Hq / Hkv query heads of each
 * kv head from one pass over its K and V rows.  Keys are taken in blocks of AD_BLOCK kept keys: per
 * kv head the G x AD_BLOCK scores (16 dot products a tile, lanes reduced in one tree), one online-
 * softmax step, then P V with the accumulators in registers; bfloat16 rows are read in place (see
 * ad_load32), float16 ones converted, float32 ones read as they are.  The next block's rows are
 * prefetched.  A sequence of one split writes its output; longer ones write fp32 partials (acc, max,
 * sum) and the item that finishes a (sequence, head group) last merges its splits in split order.
 * Heads are independent and the splits fixed, so the bits depend on neither the thread count nor
 * the head grouping, which is chosen to give the threads items enough (taken from a counter).
 * Paged: every index is validated before anything is written (QK_E_INDEX with bad_*), then
 * new_k/new_v are copied into the pool slots of positions len_b - 1, serially (two sequences may
 * name one slot), then the attention reads the pool.  Figures: docs/cpu.md.
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

/* 16 floats as one GCC/Clang vector: a zmm register on the AVX-512 clone, two ymm or four xmm
 * elsewhere.  Loads and stores are macros, and helpers take vectors by pointer: passing 64-byte
 * vectors by value would change the ABI of the baseline clones (-Wpsabi). */
typedef float at_v16 __attribute__((vector_size(64)));
typedef int32_t at_i16 __attribute__((vector_size(64)));
typedef uint32_t at_u32x16 __attribute__((vector_size(64)));
typedef uint16_t at_h16 __attribute__((vector_size(32))); /* 16 x uint16 */
#define AT_LOAD16(p) (memcpy(&ld, (p), sizeof ld), ld)
#define AT_STORE16(p, v) memcpy((p), &(v), sizeof(at_v16))

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

/* e^x for 16 floats x <= 0 (scores minus their running max), about 1 ulp: 2^n e^f with
 * n = round(x log2 e), f = x - n ln 2 in two parts (Cody-Waite) and Cephes' expf polynomial for e^f.
 * x below -87 (e^x near FLT_MIN) gives exactly 0, so masked keys (-inf) weigh nothing; NaN stays
 * NaN.  There is one exponential per score, against 4 D multiply-adds: glibc's expf is scalar. */
QK_INLINE void at_exp16(at_v16 *v) {
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
QK_INLINE void at_max16(at_v16 *m, const at_v16 *x) {
    const at_i16 gt = *x > *m;
    *m = (at_v16)(((at_i16)*x & gt) | ((at_i16)*m & ~gt));
}

/* ---- decode ------------------------------------------------------------------------------ */

#define AD_BLOCK 32  /* kept keys per online-softmax step (a multiple of 16) */
#define AD_CHUNK 256 /* key positions per split: fixed, so the splits do not depend on the thread count */

/* Two-source shuffle of 16-float vectors (indices 16..31 pick from b). */
#if defined(__clang__)
#define AT_SHUF16(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define AT_SHUF16(a, b, ...) __builtin_shuffle(a, b, (at_i16){__VA_ARGS__})
#endif

/* 16 vectors of 16 lane partials -> one vector whose lane i is the sum of x[i]'s lanes, in one fixed
 * tree for every dot product (lane l + lane l + 8, then + 4, + 2, + 1): a 16 x 16 transpose folded
 * into the additions, 45 instructions for 16 sums where 16 separate horizontal sums take 128. */
QK_INLINE void ad_reduce16(at_v16 *out, const at_v16 *x) {
    at_v16 r1[8], r2[4], r3[2];
    for (int i = 0; i < 8; i++)
        r1[i] = AT_SHUF16(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                AT_SHUF16(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        r2[i] = AT_SHUF16(r1[2 * i], r1[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                AT_SHUF16(r1[2 * i], r1[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        r3[i] = AT_SHUF16(r2[2 * i], r2[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                AT_SHUF16(r2[2 * i], r2[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    *out = AT_SHUF16(r3[0], r3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           AT_SHUF16(r3[0], r3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* Elements d .. d + 31 of a row as two vectors: fp32 rows as they are; bfloat16 rows (bf) straight
 * from memory, 32 values as 16 words whose low halves (the even d) shifted up and high halves (the
 * odd d) masked are the fp32 values: two instructions where a conversion pass takes five and a
 * store.  The kernels keep q and the accumulators in the same even / odd order. */
QK_INLINE void ad_load32(const void *row, int64_t d, int bf, at_v16 *x0, at_v16 *x1) {
    if (bf) {
        at_u32x16 x;
        memcpy(&x, (const uint16_t *)row + d, sizeof x);
        *x0 = (at_v16)(x << 16);
        *x1 = (at_v16)(x & 0xFFFF0000u);
    } else {
        memcpy(x0, (const float *)row + d, sizeof *x0);
        memcpy(x1, (const float *)row + d + 16, sizeof *x1);
    }
}

/* s[g][u0 + u] = q_g . k_{u0 + u} for ng (1, 2 or 4) query rows of qs ([ng][D]) and 16 / ng keys:
 * 16 dot products at once, each in 16 lanes reduced by ad_reduce16, then the D mod 16 last terms in
 * order (fp32 rows only; bf needs D a multiple of 32).  Each K vector serves ng rows from a register;
 * dot (g, u) is lane g nk + u, so each row's scores leave as one piece. */
QK_INLINE void ad_scores16(float *restrict s, const float *restrict qs, const void *const *kr, int u0, int ng,
                           int bf, int64_t D) {
    const int nk = 16 / ng;
    at_v16 acc[16], ld, sum;
    for (int i = 0; i < 16; i++) acc[i] = (at_v16){0};
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) {
        at_v16 q0[4], q1[4];
        for (int g = 0; g < ng; g++) q0[g] = AT_LOAD16(qs + g * D + d), q1[g] = AT_LOAD16(qs + g * D + d + 16);
        for (int u = 0; u < nk; u++) {
            at_v16 k0, k1;
            ad_load32(kr[u0 + u], d, bf, &k0, &k1);
            for (int g = 0; g < ng; g++) acc[g * nk + u] += q0[g] * k0;
            for (int g = 0; g < ng; g++) acc[g * nk + u] += q1[g] * k1;
        }
    }
    if (!bf && d + 16 <= D) {
        for (int u = 0; u < nk; u++) {
            const at_v16 k0 = AT_LOAD16((const float *)kr[u0 + u] + d);
            for (int g = 0; g < ng; g++) acc[g * nk + u] += AT_LOAD16(qs + g * D + d) * k0;
        }
        d += 16;
    }
    ad_reduce16(&sum, acc);
    float r[16];
    memcpy(r, &sum, sizeof r);
    if (!bf)
        for (int g = 0; g < ng; g++)
            for (int u = 0; u < nk; u++)
                for (int64_t e = d; e < D; e++) r[g * nk + u] += qs[g * D + e] * ((const float *)kr[u0 + u])[e];
    for (int g = 0; g < ng; g++) memcpy(s + g * AD_BLOCK + u0, r + g * nk, sizeof(float) * (size_t)nk);
}

/* acc[g] = acc[g] corr[g] + sum_{u < t} w[g][u] vr[u] for ng (1, 2 or 4) rows and the columns d ..
 * d + 31 (nc = 2) or d .. d + 15 (nc = 1, fp32 only): the accumulators stay in registers over the
 * t V rows. */
QK_INLINE void ad_pv_tile(float *restrict acc, const float *restrict corr, const float *restrict w,
                          const void *const *vr, int t, int64_t d, int ng, int nc, int bf, int64_t D) {
    at_v16 o[4][2], ld;
    for (int g = 0; g < ng; g++)
        for (int c = 0; c < nc; c++) o[g][c] = AT_LOAD16(acc + g * D + d + 16 * c) * corr[g];
    for (int u = 0; u < t; u++) {
        at_v16 v[2];
        if (nc == 2) ad_load32(vr[u], d, bf, &v[0], &v[1]);
        else v[0] = AT_LOAD16((const float *)vr[u] + d);
        for (int g = 0; g < ng; g++)
            for (int c = 0; c < nc; c++) o[g][c] += w[g * AD_BLOCK + u] * v[c];
    }
    for (int g = 0; g < ng; g++)
        for (int c = 0; c < nc; c++) AT_STORE16(acc + g * D + d + 16 * c, o[g][c]);
}

QK_INLINE void ad_pv(float *restrict acc, const float *restrict corr, const float *restrict w,
                     const void *const *vr, int t, int ng, int bf, int64_t D) {
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) ad_pv_tile(acc, corr, w, vr, t, d, ng, 2, bf, D);
    if (bf) return;
    if (d + 16 <= D) ad_pv_tile(acc, corr, w, vr, t, d, ng, 1, 0, D), d += 16;
    for (; d < D; d++) /* D mod 16 last columns, the same operations in the same order */
        for (int g = 0; g < ng; g++) {
            float o = acc[g * D + d] * corr[g];
            for (int u = 0; u < t; u++) o += w[g * AD_BLOCK + u] * ((const float *)vr[u])[d];
            acc[g * D + d] = o;
        }
}

/* e^x of one float, the vector form's value. */
QK_INLINE float at_exp1(float x) {
    at_v16 v = (at_v16){0} + x;
    at_exp16(&v);
    return v[0];
}

/* The online-softmax step of one query row over a block: s[0 .. AD_BLOCK) (scores, -inf past the
 * block's keys) become the weights e^(s - m') with m' the new running max; l becomes l corr + their
 * sum, and *corr = e^(m - m') rescales the row's accumulator.  A row that has kept nothing yet
 * (m' = -inf) gets weights 0, corr 0 and keeps l = 0. */
QK_INLINE void ad_softmax(float *restrict s, float *m, float *l, float *corr) {
    at_v16 ld, s0 = AT_LOAD16(s), s1 = AT_LOAD16(s + 16), mv = (at_v16){0} + *m, x;
    at_max16(&mv, &s0);
    at_max16(&mv, &s1);
    x = AT_SHUF16(mv, mv, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    at_max16(&mv, &x);
    x = AT_SHUF16(mv, mv, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    at_max16(&mv, &x);
    x = AT_SHUF16(mv, mv, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    at_max16(&mv, &x);
    x = AT_SHUF16(mv, mv, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    at_max16(&mv, &x);
    const float mx = mv[0];
    const float base = mx == -INFINITY ? 0.f : mx;
    s0 -= base;
    s1 -= base;
    at_exp16(&s0);
    at_exp16(&s1);
    AT_STORE16(s, s0);
    AT_STORE16(s + 16, s1);
    at_v16 e = s0 + s1; /* summed in a tree: lane i + lane i + 8, then + 4, + 2, + 1 */
    e += AT_SHUF16(e, e, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    e += AT_SHUF16(e, e, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    e += AT_SHUF16(e, e, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    e += AT_SHUF16(e, e, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    const float sum = e[0];
    *corr = at_exp1(*m - base);
    *l = *l * *corr + sum;
    *m = mx;
}

typedef struct {
    const qk_attn_decode_args *a;
    at_pool pool;
    int64_t G, groups, hpg; /* kv heads in `groups` groups of hpg */
    int64_t items;          /* (split, head group) pairs: split items / groups, group items % groups */
    const int64_t *first;   /* [B + 1]: sequence b's splits are first[b] .. first[b + 1] - 1 */
    const int64_t *part;    /* [B]: its first partial slot, -1 when it has one split */
    float *ws;              /* partials, per slot: acc [Hq][D], then m [Hq], l [Hq] */
    atomic_int *left;       /* [B][groups]: splits of (b, group) not yet done */
    int bf;                 /* bfloat16 rows read in place (D a multiple of 32) */
    atomic_llong next;
    atomic_int nomem;
} ad_job;

/* Number of key positions of sequence b (cut at a narrower mask) and, for paged, its req_to_token row. */
static inline int64_t ad_length(const ad_job *j, int64_t b, const char **r2t_row) {
    const qk_attn_decode_args *a = j->a;
    int64_t n;
    if (a->paged) {
        n = at_pool_length(&j->pool, b, r2t_row);
    } else {
        n = a->Lkv;
        if (a->kv_lens) {
            const int64_t len = qk_index(a->kv_lens, a->kv_lens_dtype, b, a->kv_lens_stride);
            n = len < 0 ? 0 : (len < n ? len : n);
        }
    }
    if (a->mask && a->mask_cols > 0 && n > a->mask_cols) n = a->mask_cols; /* a narrower mask drops the rest */
    return n;
}

/* Scratch of one worker for R query rows: q scaled [R][D], acc [R][D], converted K and V rows
 * [AD_BLOCK][D], a zero key row [D], scores then weights [G][AD_BLOCK], m, l, corr [R]. */
typedef struct {
    float *qs, *acc, *kbuf, *vbuf, *kzero, *s, *m, *l, *corr;
    int64_t koff[AD_BLOCK], voff[AD_BLOCK];   /* element offsets of the block's K and V rows at head 0 */
    int64_t knext[AD_BLOCK], vnext[AD_BLOCK]; /* and of the next AD_BLOCK positions' */
    float bias[AD_BLOCK];                     /* an additive mask's values of the block's keys */
    const void *kr[AD_BLOCK], *vr[AD_BLOCK];
} ad_scratch;

/* Row x of D floats between natural order and the even / odd order of ad_load32, in place (tmp: D floats). */
static inline void ad_unshuffle(float *restrict x, float *restrict tmp, int64_t D) {
    memcpy(tmp, x, sizeof(float) * (size_t)D);
    for (int64_t d = 0; d < D; d += 32)
        for (int i = 0; i < 16; i++) x[d + 2 * i] = tmp[d + i], x[d + 2 * i + 1] = tmp[d + 16 + i];
}

static inline void ad_shuffle(float *restrict x, float *restrict tmp, int64_t D) {
    memcpy(tmp, x, sizeof(float) * (size_t)D);
    for (int64_t d = 0; d < D; d += 32)
        for (int i = 0; i < 16; i++) x[d + i] = tmp[d + 2 * i], x[d + 16 + i] = tmp[d + 2 * i + 1];
}

/* Rows r0 .. r0 + R - 1 of sequence b (query head r0 + i) as fp32 partial: acc, m and l. */
static inline void ad_put_partial(const ad_job *j, int64_t slot, int64_t r0, int64_t R, const ad_scratch *w) {
    const int64_t Hq = j->a->Hq, D = j->a->D;
    float *p = j->ws + slot * Hq * (D + 2);
    memcpy(p + r0 * D, w->acc, sizeof(float) * (size_t)(R * D));
    memcpy(p + Hq * D + r0, w->m, sizeof(float) * (size_t)R);
    memcpy(p + Hq * D + Hq + r0, w->l, sizeof(float) * (size_t)R);
}

/* Output rows r0 .. r0 + R - 1 of sequence b from its n splits' partials, merged in split order:
 * out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c with M the largest m_c. */
QK_INLINE void ad_merge(const ad_job *j, int64_t b, int64_t n, int64_t r0, int64_t R, float *restrict row) {
    const qk_attn_decode_args *a = j->a;
    const int64_t Hq = a->Hq, D = a->D, stride = Hq * (D + 2);
    const size_t es = a->dtype == QK_F32 ? 4 : 2;
    const float *p0 = j->ws + j->part[b] * stride;
    for (int64_t r = r0; r < r0 + R; r++) {
        float M = -INFINITY;
        for (int64_t c = 0; c < n; c++) {
            const float mc = p0[c * stride + Hq * D + r];
            M = mc > M ? mc : M;
        }
        float l = 0.f;
        memset(row, 0, sizeof(float) * (size_t)D);
        if (M != -INFINITY)
            for (int64_t c = 0; c < n; c++) {
                const float *p = p0 + c * stride;
                if (p[Hq * D + r] == -INFINITY) continue; /* a split that kept nothing */
                const float e = at_exp1(p[Hq * D + r] - M);
                l += p[Hq * D + Hq + r] * e;
                for (int64_t d = 0; d < D; d++) row[d] += p[r * D + d] * e;
            }
        char *op = (char *)a->out + (b * a->out_stride[0] + r * a->out_stride[1]) * es;
        at_store_row(op, a->dtype, row, l > 0.f ? 1.f / l : 0.f, D);
    }
}

/* Prefetch of the next block's rows u0 .. u1 - 1 of kv head h (K and V, into L2): a head's rows
 * are a page or half a page apart, which the hardware prefetchers do not follow.  -> u1. */
QK_INLINE int ad_prefetch(const ad_job *j, const ad_scratch *w, int64_t h, int u0, int u1) {
    const qk_attn_decode_args *a = j->a;
    const int64_t es = a->dtype == QK_F32 ? 4 : 2, bytes = a->D * es;
    for (int u = u0; u < u1; u++) {
        const char *kn = (const char *)a->k + (w->knext[u] + h * a->k_stride[2]) * es;
        const char *vn = (const char *)a->v + (w->vnext[u] + h * a->v_stride[2]) * es;
        for (int64_t byte = 0; byte < bytes; byte += 64) {
            __builtin_prefetch(kn + byte, 0, 2);
            __builtin_prefetch(vn + byte, 0, 2);
        }
    }
    return u1 > u0 ? u1 : u0;
}

/* The block's t kept keys (w->koff, w->voff) for kv head h and its G query rows (qs, acc, m, l):
 * scores, one online-softmax step, P V; the next block's rows of h are fetched meanwhile (nt). */
QK_INLINE void ad_head_block(const ad_job *j, ad_scratch *w, int64_t h, int t, int nt, float *restrict qs,
                             float *restrict acc, float *m, float *l, int bf) {
    const qk_attn_decode_args *a = j->a;
    const int64_t G = j->G, D = a->D;
    const size_t es = a->dtype == QK_F32 ? 4 : 2;
    const char *kbase = a->k, *vbase = a->v;
    const int tp = (t + 15) & ~15; /* keys rounded up to whole score tiles */
    for (int u = 0; u < t; u++) {
        const char *kp = kbase + (w->koff[u] + h * a->k_stride[2]) * es;
        w->kr[u] = bf || a->dtype == QK_F32 ? (const void *)kp : (at_row_to(w->kbuf + u * D, kp, a->dtype, D), w->kbuf + u * D);
    }
    for (int u = t; u < tp; u++) w->kr[u] = w->kzero;
    /* the next block's rows of this head are fetched a few at a time between the first tiles of
     * scores (a burst of them stalls the loads) */
    int64_t g = 0;
    int pf = 0;
    for (; g + 4 <= G; g += 4)
        for (int u = 0; u < tp; u += 4) {
            if (g == 0) pf = ad_prefetch(j, w, h, pf, u + 4 < nt ? u + 4 : nt);
            ad_scores16(w->s + g * AD_BLOCK, qs + g * D, w->kr, u, 4, bf, D);
        }
    if (g + 2 <= G) {
        for (int u = 0; u < tp; u += 8) {
            if (g == 0) pf = ad_prefetch(j, w, h, pf, u + 8 < nt ? u + 8 : nt);
            ad_scores16(w->s + g * AD_BLOCK, qs + g * D, w->kr, u, 2, bf, D);
        }
        g += 2;
    }
    if (g < G)
        for (int u = 0; u < tp; u += 16) {
            if (g == 0) pf = ad_prefetch(j, w, h, pf, u + 16 < nt ? u + 16 : nt);
            ad_scores16(w->s + g * AD_BLOCK, qs + g * D, w->kr, u, 1, bf, D);
        }
    ad_prefetch(j, w, h, pf, nt);
    for (g = 0; g < G; g++) {
        float *sg = w->s + g * AD_BLOCK;
        if (a->mask && a->mask_float)
            for (int u = 0; u < t; u++) sg[u] += w->bias[u];
        for (int u = t; u < AD_BLOCK; u++) sg[u] = -INFINITY;
        ad_softmax(sg, m + g, l + g, w->corr + g);
    }
    for (int u = 0; u < t; u++) {
        const char *vp = vbase + (w->voff[u] + h * a->v_stride[2]) * es;
        w->vr[u] = bf || a->dtype == QK_F32 ? (const void *)vp : (at_row_to(w->vbuf + u * D, vp, a->dtype, D), w->vbuf + u * D);
    }
    for (g = 0; g + 4 <= G; g += 4) ad_pv(acc + g * D, w->corr + g, w->s + g * AD_BLOCK, w->vr, t, 4, bf, D);
    if (g + 2 <= G) ad_pv(acc + g * D, w->corr + g, w->s + g * AD_BLOCK, w->vr, t, 2, bf, D), g += 2;
    if (g < G) ad_pv(acc + g * D, w->corr + g, w->s + g * AD_BLOCK, w->vr, t, 1, bf, D);
}

/* Split c of sequence b for the kv heads of group grp. */
QK_INLINE void ad_item(ad_job *j, int64_t b, int64_t c, int64_t grp, ad_scratch *w) {
    const qk_attn_decode_args *a = j->a;
    const int64_t G = j->G, D = a->D, h0 = grp * j->hpg, h1 = h0 + j->hpg < a->Hkv ? h0 + j->hpg : a->Hkv;
    const int64_t R = (h1 - h0) * G, r0 = h0 * G;
    const size_t es = a->dtype == QK_F32 ? 4 : 2;
    for (int64_t r = 0; r < R; r++) {
        const char *qp = (const char *)a->q + (b * a->q_stride[0] + (r0 + r) * a->q_stride[1]) * es;
        at_row_scaled(w->qs + r * D, qp, a->dtype, D, a->scale);
        if (j->bf) ad_shuffle(w->qs + r * D, w->kbuf, D);
        w->m[r] = -INFINITY;
        w->l[r] = 0.f;
    }
    memset(w->acc, 0, sizeof(float) * (size_t)(R * D));
    const char *r2t = NULL;
    const int64_t n = ad_length(j, b, &r2t), splits = j->first[b + 1] - j->first[b];
    const int64_t p1 = (c + 1) * AD_CHUNK < n ? (c + 1) * AD_CHUNK : n;
    const uint8_t *mask = a->mask && !a->mask_float ? (const uint8_t *)a->mask + b * a->mask_stride[0] : NULL;
    const int fmask = a->mask && a->mask_float;
    for (int64_t pos = c * AD_CHUNK; pos < p1;) {
        int t = 0;
        for (; pos < p1 && t < AD_BLOCK; pos++) {
            if (mask && !mask[pos * a->mask_stride[1]]) continue;
            if (fmask) { /* -inf: dropped, as a False */
                w->bias[t] = at_mask_value(a->mask, a->mask_dtype, b * a->mask_stride[0] + pos * a->mask_stride[1]);
                if (w->bias[t] == -INFINITY) continue;
            }
            if (a->paged) {
                const int64_t slot = at_pool_slot(&j->pool, r2t, pos);
                w->koff[t] = slot * a->k_stride[1], w->voff[t] = slot * a->v_stride[1];
            } else {
                w->koff[t] = b * a->k_stride[0] + pos * a->k_stride[1];
                w->voff[t] = b * a->v_stride[0] + pos * a->v_stride[1];
            }
            t++;
        }
        if (t == 0) break;
        int nt = 0; /* the next AD_BLOCK positions of the split, kept or not */
        for (int64_t q = pos; q < p1 && nt < AD_BLOCK; q++, nt++) {
            if (a->paged) {
                const int64_t slot = at_pool_slot(&j->pool, r2t, q);
                w->knext[nt] = slot * a->k_stride[1], w->vnext[nt] = slot * a->v_stride[1];
            } else {
                w->knext[nt] = b * a->k_stride[0] + q * a->k_stride[1];
                w->vnext[nt] = b * a->v_stride[0] + q * a->v_stride[1];
            }
        }
        for (int64_t h = h0; h < h1; h++) {
            const int64_t r = (h - h0) * G;
            if (j->bf) ad_head_block(j, w, h, t, nt, w->qs + r * D, w->acc + r * D, w->m + r, w->l + r, 1);
            else ad_head_block(j, w, h, t, nt, w->qs + r * D, w->acc + r * D, w->m + r, w->l + r, 0);
        }
    }
    if (j->bf)
        for (int64_t r = 0; r < R; r++) ad_unshuffle(w->acc + r * D, w->kbuf, D);
    if (splits == 1) {
        for (int64_t r = 0; r < R; r++) {
            char *op = (char *)a->out + (b * a->out_stride[0] + (r0 + r) * a->out_stride[1]) * es;
            at_store_row(op, a->dtype, w->acc + r * D, w->l[r] > 0.f ? 1.f / w->l[r] : 0.f, D);
        }
        return;
    }
    ad_put_partial(j, j->part[b] + c, r0, R, w);
    /* the last split of (b, group) to finish merges them: acq_rel, so it sees the others' partials */
    if (atomic_fetch_sub_explicit(&j->left[b * j->groups + grp], 1, memory_order_acq_rel) == 1)
        ad_merge(j, b, splits, r0, R, w->acc);
}

QK_MULTIVERSION static void ad_worker(void *p, int tid, int nthreads) {
    (void)tid, (void)nthreads;
    ad_job *j = p;
    const qk_attn_decode_args *a = j->a;
    const int64_t G = j->G, D = a->D, R = j->hpg * G;
    float *mem = calloc((size_t)(2 * R * D + 2 * AD_BLOCK * D + D + G * AD_BLOCK + 3 * R), sizeof(float));
    if (mem == NULL) {
        atomic_store(&j->nomem, 1);
        return;
    }
    ad_scratch w;
    w.qs = mem, w.acc = w.qs + R * D, w.kbuf = w.acc + R * D, w.vbuf = w.kbuf + AD_BLOCK * D;
    w.kzero = w.vbuf + AD_BLOCK * D, w.s = w.kzero + D, w.m = w.s + G * AD_BLOCK, w.l = w.m + R, w.corr = w.l + R;
    for (;;) {
        const int64_t item = qk_next_item(&j->next);
        if (item >= j->items) break;
        const int64_t split = item / j->groups;
        int64_t lo = 0, hi = a->B; /* the sequence whose splits hold `split` */
        while (hi - lo > 1) {
            const int64_t mid = lo + (hi - lo) / 2;
            if (j->first[mid] <= split) lo = mid;
            else hi = mid;
        }
        ad_item(j, lo, split - j->first[lo], item % j->groups, &w);
    }
    free(mem);
}

static void ad_append(const ad_job *j) {
    const qk_attn_decode_args *a = j->a;
    const size_t es = a->dtype == QK_F32 ? 4 : 2, bytes = (size_t)a->D * es;
    for (int64_t b = 0; b < a->B; b++) {
        const char *row = NULL;
        const int64_t len = at_pool_length(&j->pool, b, &row);
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

/* attn_decode and attn_paged_decode: see the comment at the top of the file. */
int qk_attn_decode_cpu(qk_attn_decode_args *a, void *stream) {
    (void)stream;
    if ((a->dtype != QK_F32 && a->dtype != QK_F16 && a->dtype != QK_BF16) || a->Hkv < 1 || a->Hq % a->Hkv ||
        a->D < 1)
        return QK_E_UNSUPPORTED;
    ad_job j = {.a = a, .G = a->Hq / a->Hkv};
    if (a->paged) {
        j.pool = (at_pool){a->req_to_token, a->req_pool_indices, a->kv_indptr, {a->r2t_stride[0], a->r2t_stride[1]},
                           a->rpi_stride, a->indptr_stride, a->r2t_dtype, a->rpi_dtype, a->indptr_dtype,
                           a->num_requests, a->max_ctx, a->pool_size};
        for (int64_t b = 0; b < a->B; b++)
            if (at_pool_check(&j.pool, b, &a->bad_arg, &a->bad_pos, &a->bad_value)) return QK_E_INDEX;
        if (a->new_k) ad_append(&j);
    }
    if (a->B == 0 || a->Hq == 0) return QK_OK;
    /* splits and partial slots per sequence; a sequence with no keys is 0 */
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(2 * a->B + 1));
    if (first == NULL) return QK_E_NOMEM;
    int64_t *part = first + a->B + 1, splits = 0, slots = 0, keys = 0;
    const size_t es = a->dtype == QK_F32 ? 4 : 2;
    for (int64_t b = 0; b < a->B; b++) {
        const char *row;
        const int64_t n = ad_length(&j, b, &row), s = (n + AD_CHUNK - 1) / AD_CHUNK;
        first[b] = splits;
        part[b] = s > 1 ? slots : -1;
        splits += s, slots += s > 1 ? s : 0, keys += n;
        if (n == 0)
            for (int64_t r = 0; r < a->Hq; r++)
                memset((char *)a->out + (b * a->out_stride[0] + r * a->out_stride[1]) * es, 0, (size_t)a->D * es);
    }
    first[a->B] = splits;
    int status = QK_OK;
    if (splits == 0) goto done;
    int nthreads = qk_threads_for((keys + a->B) * a->Hq * a->D * 2, a->num_threads > 0 ? a->num_threads : 1);
    /* heads are independent, so grouping them changes no bits: whole token rows per item when there
     * are splits enough to share out, smaller groups of heads when there are not */
    j.groups = (4 * nthreads + splits - 1) / splits;
    j.groups = j.groups < 1 ? 1 : (j.groups > a->Hkv ? a->Hkv : j.groups);
    j.hpg = (a->Hkv + j.groups - 1) / j.groups;
    j.groups = (a->Hkv + j.hpg - 1) / j.hpg;
    j.items = splits * j.groups;
    if (nthreads > j.items) nthreads = (int)j.items;
    size_t ws_floats = 0, bytes = 0;
    if (__builtin_mul_overflow((size_t)slots, (size_t)(a->Hq * (a->D + 2)), &ws_floats) ||
        __builtin_mul_overflow(ws_floats, sizeof(float), &bytes) ||
        __builtin_add_overflow(bytes, sizeof(atomic_int) * (size_t)(a->B * j.groups), &bytes)) {
        status = QK_E_NOMEM;
        goto done;
    }
    void *scratch = NULL;
    if (slots > 0) {
        scratch = qk_cpu_scratch(bytes);
        if (scratch == NULL) {
            status = QK_E_NOMEM;
            goto done;
        }
        j.left = (atomic_int *)scratch;
        j.ws = (float *)(j.left + a->B * j.groups);
        for (int64_t b = 0; b < a->B; b++)
            for (int64_t g = 0; g < j.groups; g++)
                atomic_init(&j.left[b * j.groups + g], (int)(first[b + 1] - first[b]));
    }
    j.first = first, j.part = part;
    /* ad_load32's even / odd split reads the words little-endian */
    j.bf = a->dtype == QK_BF16 && a->D % 32 == 0 && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;
    atomic_init(&j.next, 0);
    atomic_init(&j.nomem, 0);
    status = qk_parallel_run(nthreads, ad_worker, &j);
    if (status == QK_OK && atomic_load(&j.nomem)) status = QK_E_NOMEM;
    if (scratch) qk_cpu_scratch_release(scratch);
done:
    free(first);
    return status;
}

/* ---- prefill ----------------------------------------------------------------------------- */

#define AP_KT QK_AP_KT /* keys per tile (attn_prefill_isa.h); the bfloat16 levels take QK_AP_KT_BF16 */
#define AP_KT_MAX (QK_AP_KT_BF16 > AP_KT ? QK_AP_KT_BF16 : AP_KT)
#define AP_ROWS 128    /* query rows (positions x the G heads of a kv head) a block aims for */
#define AP_QB_MAX 64   /* query positions per block at most */

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
            at_max16(&mc[c], &s);
        }
    at_max16(&mc[0], &mc[1]);
    at_max16(&mc[2], &mc[3]);
    at_max16(&mc[0], &mc[2]);
    mx = mc[0];
    const at_i16 none = mx == -INFINITY;
    const at_v16 base = (at_v16)((at_i16)mx & ~none); /* 0 where nothing is kept: e^(-inf - 0) = 0 */
    at_v16 sum = {0}, c = AT_LOAD16(m + r) - base;
    for (int u = 0; u < kt; u++) {
        at_v16 e = AT_LOAD16(st + u * Rp + r) - base;
        at_exp16(&e);
        AT_STORE16(st + u * Rp + r, e);
        sum += e;
    }
    at_exp16(&c);
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
