/* The instruction-set kernels of the cpu attn_prefill (csrc/cpu/attn_prefill_isa.h), picked at run
 * time as linear's are (qk_cpu_isa_best, capped by the call's cpu_isa):
 *   fma     float32 (and float16 converted exactly): the portable kernels' register tiles with fused
 *           multiply-adds.  Rows sit in the vector lanes, so each score and each output element is
 *           one fma chain (over d, over the keys) whatever the vector width: AVX2 gives the AVX-512
 *           bits.
 *   dpbf16  bfloat16 with AVX512-BF16: VDPBF16PS on pairs (of d for the scores, of keys for P V).
 *   Every level but the portable one also runs the softmax step here (an exponential with FMA).
 *   amx     bfloat16 with AMX: the same products on tiles, S^T = K Q^T (K rows straight into A tiles,
 *           q packed once per block into B tiles) and O += P V (the tile of weights, rounded to
 *           bfloat16, in A tiles, V's key pairs in B tiles), a 16 x 16 fp32 product per tile pair
 *           added into the fp32 accumulators after the rescale.
 * The bfloat16 levels multiply the fp32 score sums by the scale (q is not rounded again) and round
 * the softmax weights to bfloat16 once for the P V product; l sums the fp32 weights. */
#define _GNU_SOURCE
#include "attn_prefill_isa.h"
#include "cpu.h"
#include "linear_isa.h"

#include <math.h>
#include <string.h>

#ifndef QK_X86_KERNELS

int qk_ap_level(int dtype, int cpu_isa, int *wide) {
    (void)dtype, (void)cpu_isa;
    *wide = 0;
    return QK_AP_PORTABLE;
}
/* never called at QK_AP_PORTABLE */
void qk_ap_scores_fma(float *st, const float *qt, const float *const *kr, int64_t D, int64_t Rp, int wide) {
    (void)st, (void)qt, (void)kr, (void)D, (void)Rp, (void)wide;
}
void qk_ap_pv_fma(float *acc, const float *corr, const float *pt, const float *const *vr, int64_t Rp, int t,
                  int64_t Dp, int wide) {
    (void)acc, (void)corr, (void)pt, (void)vr, (void)Rp, (void)t, (void)Dp, (void)wide;
}
void qk_ap_scores_bf16(float *st, const uint32_t *qp, const uint16_t *kb, int64_t Dp32, int64_t Rp, int kt,
                       float scale, int amx) {
    (void)st, (void)qp, (void)kb, (void)Dp32, (void)Rp, (void)kt, (void)scale, (void)amx;
}
void qk_ap_pv_bf16(float *acc, const float *corr, const float *pt, const uint16_t *vb, uint32_t *vp, uint32_t *pp,
                   int64_t Rp, int64_t Dp, int kt, int amx) {
    (void)acc, (void)corr, (void)pt, (void)vb, (void)vp, (void)pp, (void)Rp, (void)Dp, (void)kt, (void)amx;
}
void qk_ap_pack_q(uint32_t *qp, const uint16_t *const *rows, int64_t D, int64_t Dp32) {
    (void)qp, (void)rows, (void)D, (void)Dp32;
}
void qk_ap_softmax(float *st, int64_t Rp, int kt, float *m, float *l, float *corr, int wide) {
    (void)st, (void)Rp, (void)kt, (void)m, (void)l, (void)corr, (void)wide;
}
void qk_ap_amx_begin(void) {}
void qk_ap_amx_end(void) {}

#else

#include <immintrin.h>

#include "x86_simd.h"

#define KT QK_AP_KT
#define T2_ISA "avx2,fma"
#define I512 static inline __attribute__((target(T512_ISA), always_inline))
#define I2 static inline __attribute__((target(T2_ISA), always_inline))
#define IBF static inline __attribute__((target(T512_ISA ",avx512bf16"), always_inline))
#define TAMX __attribute__((target(T512_ISA ",avx512bf16,amx-tile,amx-bf16")))

int qk_ap_level(int dtype, int cpu_isa, int *wide) {
    int isa = qk_cpu_isa_best();
    if (cpu_isa > 0 && cpu_isa < isa) isa = cpu_isa;
    *wide = isa >= QK_CPU_ISA_AVX512;
    if (dtype == QK_BF16 && isa >= QK_CPU_ISA_AMX) return QK_AP_AMX;
    if (dtype == QK_BF16 && isa >= QK_CPU_ISA_AVX512_BF16) return QK_AP_DPBF16;
    return isa >= QK_CPU_ISA_AVX2 ? QK_AP_FMA : QK_AP_PORTABLE;
}

/* ---- fma: float32 ---------------------------------------------------------------------------- */

/* 4 keys x nc vectors of 16 rows from r per pass: 4 broadcasts and nc loads per 4 nc fma. */
I512 void sc512(float *st, const float *qt, const float *const *kr, int64_t D, int64_t Rp, int64_t r, int nc) {
    for (int u = 0; u < KT; u += 4) {
        const float *k[4] = {kr[u], kr[u + 1], kr[u + 2], kr[u + 3]};
        __m512 acc[4][4];
        for (int i = 0; i < 4; i++)
            for (int c = 0; c < nc; c++) acc[i][c] = _mm512_setzero_ps();
        const float *q = qt + r;
        for (int64_t d = 0; d < D; d++, q += Rp) {
            __m512 qv[4];
            for (int c = 0; c < nc; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
            for (int i = 0; i < 4; i++) {
                const __m512 kv = _mm512_set1_ps(k[i][d]);
                for (int c = 0; c < nc; c++) acc[i][c] = _mm512_fmadd_ps(kv, qv[c], acc[i][c]);
            }
        }
        for (int i = 0; i < 4; i++)
            for (int c = 0; c < nc; c++) _mm512_storeu_ps(st + (u + i) * Rp + r + 16 * c, acc[i][c]);
    }
}

/* the same chains 8 rows a vector: 4 keys x 16 rows per pass (16 ymm registers) */
I2 void sc256(float *st, const float *qt, const float *const *kr, int64_t D, int64_t Rp, int64_t r) {
    for (int u = 0; u < KT; u += 4) {
        const float *k[4] = {kr[u], kr[u + 1], kr[u + 2], kr[u + 3]};
        __m256 acc[4][2];
        for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        const float *q = qt + r;
        for (int64_t d = 0; d < D; d++, q += Rp) {
            const __m256 q0 = _mm256_loadu_ps(q), q1 = _mm256_loadu_ps(q + 8);
            for (int i = 0; i < 4; i++) {
                const __m256 kv = _mm256_set1_ps(k[i][d]);
                acc[i][0] = _mm256_fmadd_ps(kv, q0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(kv, q1, acc[i][1]);
            }
        }
        for (int i = 0; i < 4; i++) {
            _mm256_storeu_ps(st + (u + i) * Rp + r, acc[i][0]);
            _mm256_storeu_ps(st + (u + i) * Rp + r + 8, acc[i][1]);
        }
    }
}

static __attribute__((target(T512_ISA))) void scores512(float *st, const float *qt, const float *const *kr,
                                                         int64_t D, int64_t Rp) {
    int64_t r = 0;
    for (; r + 64 <= Rp; r += 64) sc512(st, qt, kr, D, Rp, r, 4);
    for (; r < Rp; r += 16) sc512(st, qt, kr, D, Rp, r, 1);
}

static __attribute__((target(T2_ISA))) void scores256(float *st, const float *qt, const float *const *kr, int64_t D,
                                                       int64_t Rp) {
    for (int64_t r = 0; r < Rp; r += 16) sc256(st, qt, kr, D, Rp, r);
}

void qk_ap_scores_fma(float *st, const float *qt, const float *const *kr, int64_t D, int64_t Rp, int wide) {
    if (wide) scores512(st, qt, kr, D, Rp);
    else scores256(st, qt, kr, D, Rp);
}

/* 4 rows from r x nc vectors of 16 columns from d: the accumulators stay in registers over the keys */
I512 void pv512(float *acc, const float *corr, const float *pt, const float *const *vr, int64_t r, int64_t d, int t,
                int64_t Dp, int64_t Rp, int nc) {
    __m512 o[4][4];
    for (int i = 0; i < 4; i++) {
        const __m512 cv = _mm512_set1_ps(corr[r + i]);
        for (int c = 0; c < nc; c++) o[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r + i) * Dp + d + 16 * c), cv);
    }
    for (int u = 0; u < t; u++) {
        __m512 v[4];
        for (int c = 0; c < nc; c++) v[c] = _mm512_loadu_ps(vr[u] + d + 16 * c);
        const float *w = pt + u * Rp + r;
        for (int i = 0; i < 4; i++) {
            const __m512 wv = _mm512_set1_ps(w[i]);
            for (int c = 0; c < nc; c++) o[i][c] = _mm512_fmadd_ps(wv, v[c], o[i][c]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < nc; c++) _mm512_storeu_ps(acc + (r + i) * Dp + d + 16 * c, o[i][c]);
}

I2 void pv256(float *acc, const float *corr, const float *pt, const float *const *vr, int64_t r, int64_t d, int t,
              int64_t Dp, int64_t Rp) {
    __m256 o[4][2];
    for (int i = 0; i < 4; i++) {
        const __m256 cv = _mm256_set1_ps(corr[r + i]);
        for (int c = 0; c < 2; c++) o[i][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + (r + i) * Dp + d + 8 * c), cv);
    }
    for (int u = 0; u < t; u++) {
        const __m256 v0 = _mm256_loadu_ps(vr[u] + d), v1 = _mm256_loadu_ps(vr[u] + d + 8);
        const float *w = pt + u * Rp + r;
        for (int i = 0; i < 4; i++) {
            const __m256 wv = _mm256_set1_ps(w[i]);
            o[i][0] = _mm256_fmadd_ps(wv, v0, o[i][0]);
            o[i][1] = _mm256_fmadd_ps(wv, v1, o[i][1]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < 2; c++) _mm256_storeu_ps(acc + (r + i) * Dp + d + 8 * c, o[i][c]);
}

static __attribute__((target(T512_ISA))) void accumulate512(float *acc, const float *corr, const float *pt,
                                                             const float *const *vr, int64_t Rp, int t, int64_t Dp) {
    for (int64_t r = 0; r < Rp; r += 4) {
        int64_t d = 0;
        for (; d + 64 <= Dp; d += 64) pv512(acc, corr, pt, vr, r, d, t, Dp, Rp, 4);
        for (; d < Dp; d += 16) pv512(acc, corr, pt, vr, r, d, t, Dp, Rp, 1);
    }
}

static __attribute__((target(T2_ISA))) void accumulate256(float *acc, const float *corr, const float *pt,
                                                           const float *const *vr, int64_t Rp, int t, int64_t Dp) {
    for (int64_t r = 0; r < Rp; r += 4)
        for (int64_t d = 0; d < Dp; d += 16) pv256(acc, corr, pt, vr, r, d, t, Dp, Rp);
}

void qk_ap_pv_fma(float *acc, const float *corr, const float *pt, const float *const *vr, int64_t Rp, int t,
                  int64_t Dp, int wide) {
    if (wide) accumulate512(acc, corr, pt, vr, Rp, t, Dp);
    else accumulate256(acc, corr, pt, vr, Rp, t, Dp);
}

/* ---- bfloat16: packing shared by dpbf16 and amx ------------------------------------------------ */

/* vp[dt][p][c] = V rows 2p, 2p + 1 at column 16 dt + c, as one 32-bit pair (a B tile per dt and
 * 16 pairs) */
I512 void pack_v(uint32_t *vp, const uint16_t *vb, int64_t Dp, int kt) {
    for (int64_t dt = 0; dt < Dp / 16; dt++)
        for (int p = 0; p < kt / 2; p++) {
            const uint16_t *v0 = vb + 2 * p * Dp + dt * 16, *v1 = v0 + Dp;
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)v0));
            const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)v1));
            _mm512_storeu_si512(vp + (dt * kt / 2 + p) * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
}

/* pp[rt][g][i][p] = the weights of row 16 rt + i for keys 32 g + 2p, + 1 rounded to bfloat16 (nearest
 * even, VCVTNE2PS2BF16: subnormal weights, below 2^-126, count as 0), as one pair (an A tile per rt
 * and 32 keys): two 16 x 16 transposes of the keys-major fp32 weights, then one conversion per row. */
static inline __attribute__((target(T512_ISA ",avx512bf16"), always_inline)) void pack_p(uint32_t *pp,
                                                                                        const float *pt, int64_t Rp,
                                                                                        int kt) {
    for (int64_t rt = 0; rt < Rp / 16; rt++)
        for (int g = 0; g < kt / 32; g++) {
            __m512 lo[16], hi[16];
            for (int u = 0; u < 16; u++) {
                lo[u] = _mm512_loadu_ps(pt + (32 * g + u) * Rp + rt * 16);
                hi[u] = _mm512_loadu_ps(pt + (32 * g + 16 + u) * Rp + rt * 16);
            }
            transpose16(lo);
            transpose16(hi);
            for (int i = 0; i < 16; i++)
                _mm512_storeu_si512(pp + (rt * kt / 32 + g) * 256 + i * 16,
                                    (__m512i)_mm512_cvtne2ps_pbh(hi[i], lo[i]));
        }
}

I512 void scale_scores(float *st, int64_t Rp, int kt, float scale) {
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < kt * Rp; i += 16) _mm512_storeu_ps(st + i, _mm512_mul_ps(_mm512_loadu_ps(st + i), s));
}

/* 16 rows of q (NULL: zeros) into their pair layout, 32 d at a time: rows as 16 pairs, transposed */
static __attribute__((target(T512_ISA))) void pack_q16(uint32_t *qp, const uint16_t *const *rows, int64_t D,
                                                       int64_t DB) {
    for (int64_t db = 0; db < DB; db++) {
        const __mmask32 km = D - db * 32 >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (D - db * 32)) - 1);
        __m512 v[16];
        for (int i = 0; i < 16; i++)
            v[i] = rows[i] ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(km, rows[i] + db * 32)) : _mm512_setzero_ps();
        transpose16(v);
        for (int p = 0; p < 16; p++) _mm512_storeu_ps((float *)qp + db * 256 + p * 16, v[p]);
    }
}

void qk_ap_pack_q(uint32_t *qp, const uint16_t *const *rows, int64_t D, int64_t Dp32) {
    pack_q16(qp, rows, D, Dp32 / 32);
}

/* e^x for x <= 0 (scores minus their running max), about 2 ulp: 2^n e^f with n = round(x log2 e),
 * f = x - n ln 2 in two parts, a degree-6 Taylor polynomial with fused multiply-adds, times 2^n
 * built from its bits (n >= -126: a normal float); x below -87 gives exactly 0 (masked keys weigh
 * nothing), NaN stays NaN.  exp_neg8 runs the same operations 8 lanes wide: the same bits. */
I512 __m512 exp_neg(__m512 x) {
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
    x = _mm512_max_ps(_mm512_set1_ps(-87.f), x); /* NaN passes (MAXPS returns its second operand) */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~under, p, _mm512_castsi512_ps(e));
}

I2 __m256 exp_neg8(__m256 x) {
    const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_set1_ps(-87.f), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* attn.c's online-softmax step (ap_softmax16) for the non-portable levels, 16 rows a vector: the max
 * in four chains (exact, so any order), the weights from exp_neg, their sum in two chains */
static __attribute__((target(T512_ISA))) void softmax512(float *st, int64_t Rp, int kt, float *m, float *l,
                                                          float *corr) {
    for (int64_t r = 0; r < Rp; r += 16) {
        const __m512 m0 = _mm512_loadu_ps(m + r);
        __m512 mc[4] = {m0, m0, m0, m0};
        for (int u = 0; u < kt; u += 4)
            for (int c = 0; c < 4; c++) mc[c] = _mm512_max_ps(_mm512_loadu_ps(st + (u + c) * Rp + r), mc[c]);
        const __m512 mx = _mm512_max_ps(_mm512_max_ps(mc[0], mc[1]), _mm512_max_ps(mc[2], mc[3]));
        /* 0 where nothing is kept: e^(-inf - 0) = 0 */
        const __m512 base = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(mx, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ), mx);
        __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int u = 0; u < kt; u++) {
            const __m512 e = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(st + u * Rp + r), base));
            _mm512_storeu_ps(st + u * Rp + r, e);
            sum[u & 1] = _mm512_add_ps(sum[u & 1], e);
        }
        const __m512 c = exp_neg(_mm512_sub_ps(m0, base));
        _mm512_storeu_ps(l + r, _mm512_fmadd_ps(_mm512_loadu_ps(l + r), c, _mm512_add_ps(sum[0], sum[1])));
        _mm512_storeu_ps(corr + r, c);
        _mm512_storeu_ps(m + r, mx);
    }
}

static __attribute__((target(T2_ISA))) void softmax256(float *st, int64_t Rp, int kt, float *m, float *l,
                                                        float *corr) {
    for (int64_t r = 0; r < Rp; r += 8) {
        const __m256 m0 = _mm256_loadu_ps(m + r);
        __m256 mc[4] = {m0, m0, m0, m0};
        for (int u = 0; u < kt; u += 4)
            for (int c = 0; c < 4; c++) mc[c] = _mm256_max_ps(_mm256_loadu_ps(st + (u + c) * Rp + r), mc[c]);
        const __m256 mx = _mm256_max_ps(_mm256_max_ps(mc[0], mc[1]), _mm256_max_ps(mc[2], mc[3]));
        const __m256 base = _mm256_and_ps(_mm256_cmp_ps(mx, _mm256_set1_ps(-INFINITY), _CMP_NEQ_UQ), mx);
        __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int u = 0; u < kt; u++) {
            const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(st + u * Rp + r), base));
            _mm256_storeu_ps(st + u * Rp + r, e);
            sum[u & 1] = _mm256_add_ps(sum[u & 1], e);
        }
        const __m256 c = exp_neg8(_mm256_sub_ps(m0, base));
        _mm256_storeu_ps(l + r, _mm256_fmadd_ps(_mm256_loadu_ps(l + r), c, _mm256_add_ps(sum[0], sum[1])));
        _mm256_storeu_ps(corr + r, c);
        _mm256_storeu_ps(m + r, mx);
    }
}

void qk_ap_softmax(float *st, int64_t Rp, int kt, float *m, float *l, float *corr, int wide) {
    if (wide) softmax512(st, Rp, kt, m, l, corr);
    else softmax256(st, Rp, kt, m, l, corr);
}

/* ---- dpbf16 ----------------------------------------------------------------------------------- */

#define as_bh(x) ((__m512bh)(x))

/* 4 keys x nc vectors of 16 rows from row tile rt */
IBF void scbf(float *st, const uint32_t *qp, const uint16_t *kb, int64_t Dp32, int64_t Rp, int kt, int64_t rt,
              int nc) {
    const int64_t DB = Dp32 / 32;
    for (int u = 0; u < kt; u += 4) {
        __m512 acc[4][4];
        for (int i = 0; i < 4; i++)
            for (int c = 0; c < nc; c++) acc[i][c] = _mm512_setzero_ps();
        for (int64_t p = 0; p < Dp32 / 2; p++) {
            __m512i qv[4];
            for (int c = 0; c < nc; c++)
                qv[c] = _mm512_loadu_si512(qp + ((rt + c) * DB + p / 16) * 256 + (p % 16) * 16);
            for (int i = 0; i < 4; i++) {
                uint32_t pair;
                memcpy(&pair, kb + (u + i) * Dp32 + 2 * p, sizeof pair);
                const __m512i kv = _mm512_set1_epi32((int)pair);
                for (int c = 0; c < nc; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], as_bh(qv[c]), as_bh(kv));
            }
        }
        for (int i = 0; i < 4; i++)
            for (int c = 0; c < nc; c++) _mm512_storeu_ps(st + (u + i) * Rp + (rt + c) * 16, acc[i][c]);
    }
}

static __attribute__((target(T512_ISA ",avx512bf16"))) void scores_dpbf16(float *st, const uint32_t *qp,
                                                                           const uint16_t *kb, int64_t Dp32,
                                                                           int64_t Rp, int kt, float scale) {
    int64_t rt = 0;
    for (; rt + 4 <= Rp / 16; rt += 4) scbf(st, qp, kb, Dp32, Rp, kt, rt, 4);
    for (; rt < Rp / 16; rt++) scbf(st, qp, kb, Dp32, Rp, kt, rt, 1);
    scale_scores(st, Rp, kt, scale);
}

/* rows 16 rt + i .. + 3 x nc vectors of 16 columns from tile dt */
IBF void pvbf(float *acc, const float *corr, const uint32_t *pp, const uint32_t *vp, int64_t Dp, int kt, int64_t rt,
              int i0, int64_t dt, int nc) {
    __m512 o[4][4];
    for (int i = 0; i < 4; i++) {
        const int64_t r = rt * 16 + i0 + i;
        const __m512 cv = _mm512_set1_ps(corr[r]);
        for (int c = 0; c < nc; c++) o[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * Dp + (dt + c) * 16), cv);
    }
    for (int p = 0; p < kt / 2; p++) {
        __m512i v[4];
        for (int c = 0; c < nc; c++) v[c] = _mm512_loadu_si512(vp + ((dt + c) * kt / 2 + p) * 16);
        for (int i = 0; i < 4; i++) {
            const __m512i w = _mm512_set1_epi32((int)pp[(rt * kt / 32 + p / 16) * 256 + (i0 + i) * 16 + p % 16]);
            for (int c = 0; c < nc; c++) o[i][c] = _mm512_dpbf16_ps(o[i][c], as_bh(w), as_bh(v[c]));
        }
    }
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < nc; c++) _mm512_storeu_ps(acc + (rt * 16 + i0 + i) * Dp + (dt + c) * 16, o[i][c]);
}

static __attribute__((target(T512_ISA ",avx512bf16"))) void pv_dpbf16(float *acc, const float *corr, const float *pt,
                                                                       const uint16_t *vb, uint32_t *vp, uint32_t *pp,
                                                                       int64_t Rp, int64_t Dp, int kt) {
    pack_v(vp, vb, Dp, kt);
    pack_p(pp, pt, Rp, kt);
    for (int64_t rt = 0; rt < Rp / 16; rt++)
        for (int i0 = 0; i0 < 16; i0 += 4) {
            int64_t dt = 0;
            for (; dt + 4 <= Dp / 16; dt += 4) pvbf(acc, corr, pp, vp, Dp, kt, rt, i0, dt, 4);
            for (; dt < Dp / 16; dt++) pvbf(acc, corr, pp, vp, Dp, kt, rt, i0, dt, 1);
        }
}

/* ---- amx -------------------------------------------------------------------------------------
 * Tiles (16 rows x 64 bytes each): 0-3 fp32 products, 4-5 A, 6-7 B. */

void qk_ap_amx_begin(void) { qk_amx_tiles_16x64(); }

TAMX void qk_ap_amx_end(void) { _tile_release(); }

/* S^T for 32 keys x 32 rows per step: keys 16 kh + .. in A tile 4 + kh, rows of tile rt + rh in B
 * tile 6 + rh, the product in tile kh + 2 rh, stored keys-major into st */
TAMX static void scores_amx(float *st, const uint32_t *qp, const uint16_t *kb, int64_t Dp32, int64_t Rp, int kt,
                            float scale) {
    const int64_t DB = Dp32 / 32, RT = Rp / 16, kstride = Dp32 * 2, sstride = Rp * 4;
    for (int kg = 0; kg < kt; kg += 32, kb += 32 * Dp32, st += 32 * Rp) {
        for (int64_t rt = 0; rt < RT; rt += 2) {
            const int two = rt + 1 < RT;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t db = 0; db < DB; db++) {
                _tile_loadd(4, kb + db * 32, kstride);
                _tile_loadd(5, kb + 16 * Dp32 + db * 32, kstride);
                _tile_loadd(6, qp + (rt * DB + db) * 256, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 5, 6);
                if (two) {
                    _tile_loadd(7, qp + ((rt + 1) * DB + db) * 256, 64);
                    _tile_dpbf16ps(2, 4, 7);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, st + rt * 16, sstride);
            _tile_stored(1, st + 16 * Rp + rt * 16, sstride);
            if (two) {
                _tile_stored(2, st + rt * 16 + 16, sstride);
                _tile_stored(3, st + 16 * Rp + rt * 16 + 16, sstride);
            }
        }
    }
    st -= kt * Rp;
    scale_scores(st, Rp, kt, scale);
}

/* O += P V for 32 rows x 32 columns per step: rows of tile rt + rh in A tile 4 + rh, columns of
 * tile dt + dh in B tile 6 + dh, the product in tile rh + 2 dh; then acc = acc corr + product */
TAMX static void pv_amx(float *acc, const float *corr, const float *pt, const uint16_t *vb, uint32_t *vp,
                        uint32_t *pp, int64_t Rp, int64_t Dp, int kt) {
    pack_v(vp, vb, Dp, kt);
    pack_p(pp, pt, Rp, kt);
    const int64_t RT = Rp / 16, DT = Dp / 16, KG = kt / 32;
    float cb[4][256] __attribute__((aligned(64)));
    for (int64_t rt = 0; rt < RT; rt += 2) {
        const int tr = rt + 1 < RT;
        for (int64_t dt = 0; dt < DT; dt += 2) {
            const int td = dt + 1 < DT;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t g = 0; g < KG; g++) {
                _tile_loadd(4, pp + (rt * KG + g) * 256, 64);
                _tile_loadd(6, vp + (dt * KG + g) * 256, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (tr) {
                    _tile_loadd(5, pp + ((rt + 1) * KG + g) * 256, 64);
                    _tile_dpbf16ps(1, 5, 6);
                }
                if (td) {
                    _tile_loadd(7, vp + ((dt + 1) * KG + g) * 256, 64);
                    _tile_dpbf16ps(2, 4, 7);
                    if (tr) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, cb[0], 64);
            if (tr) _tile_stored(1, cb[1], 64);
            if (td) _tile_stored(2, cb[2], 64);
            if (tr && td) _tile_stored(3, cb[3], 64);
            for (int dh = 0; dh < 1 + td; dh++)
                for (int rh = 0; rh < 1 + tr; rh++) {
                    const float *c = cb[rh + 2 * dh];
                    for (int i = 0; i < 16; i++) {
                        const int64_t r = (rt + rh) * 16 + i;
                        float *a = acc + r * Dp + (dt + dh) * 16;
                        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_loadu_ps(a), _mm512_set1_ps(corr[r]),
                                                            _mm512_load_ps(c + i * 16)));
                    }
                }
        }
    }
}

void qk_ap_scores_bf16(float *st, const uint32_t *qp, const uint16_t *kb, int64_t Dp32, int64_t Rp, int kt,
                       float scale, int amx) {
    if (amx) scores_amx(st, qp, kb, Dp32, Rp, kt, scale);
    else scores_dpbf16(st, qp, kb, Dp32, Rp, kt, scale);
}

void qk_ap_pv_bf16(float *acc, const float *corr, const float *pt, const uint16_t *vb, uint32_t *vp, uint32_t *pp,
                   int64_t Rp, int64_t Dp, int kt, int amx) {
    if (amx) pv_amx(acc, corr, pt, vb, vp, pp, Rp, Dp, kt);
    else pv_dpbf16(acc, corr, pt, vb, vp, pp, Rp, Dp, kt);
}

#endif
