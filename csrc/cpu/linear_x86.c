/* linear and swiglu on x86-64 with AVX2, AVX-512 and AMX, picked at run time (csrc/cpu/linear_isa.h).
 *
 * The kernels are compiled for their own instruction sets with target attributes, so the rest of
 * the build stays x86-64 baseline:
 *   amx    bfloat16: TDPBF16PS on 16 x 32 tiles.  The product is computed transposed,
 *          out^T [N, M] = W x^T: the weight rows load straight into A tiles (no repacking of the
 *          large operand); x is packed per call into VNNI pairs for the B tiles.
 *   lanes  float32, and float16 (or bfloat16 without AVX512-BF16) converted to fp32 exactly: dot
 *          products with 16 consecutive k in the lanes of a vector, both operands loaded straight
 *          from their rows, fused multiply-adds; with AVX512-BF16 (no AMX) bfloat16 takes the same
 *          tiles with pairs of k and VDPBF16PS; on AVX2 the same sums in 8-float halves.
 *
 * Determinism.  On one machine every output is reduced in one fixed order whatever M, the tiling,
 * the thread count or the share of rows a thread gets.  amx: one fp32 chain over k in increasing
 * order, from 0 (TDPBF16PS adds a row's 16 pairs in k order and the tiles follow in k order).
 * lanes: 16 chains over the steps in order, lane l taking k = l mod 16 (pairs: 2l, 2l + 1 mod 32),
 * then one fixed tree over the lanes; the AVX2 kernel runs the same chains and tree, so it gives
 * the AVX-512 level's bits.  Padding (k past K, rows past N or M) is zeros, and each output
 * element depends on its own row and column only.  Partial sums parked in memory between k chunks
 * are stored exactly.  The level is fixed per process (the best the CPU offers, or the cap the
 * caller passes), never chosen from M.
 *
 * The epilogue (bias, silu, the rounding to the output dtype) runs on 16 (AVX2: 8) outputs of a
 * row at a time in the same vector code for every position: silu's exp is a polynomial of our
 * own, so its bits do not depend on libm. */
#define _GNU_SOURCE
#include "cpu.h"
#include "half.h"
#include "linear_isa.h"

#include <stdlib.h>
#include <string.h>

const char *const qk_cpu_isa_names[QK_CPU_ISA_COUNT] = {
    [QK_CPU_ISA_AUTO] = "auto", [QK_CPU_ISA_PORTABLE] = "portable", [QK_CPU_ISA_AVX2] = "avx2", [QK_CPU_ISA_AVX512] = "avx512",
    [QK_CPU_ISA_AVX512_BF16] = "avx512_bf16", [QK_CPU_ISA_AMX] = "amx"};

#ifndef QK_X86_KERNELS

int qk_cpu_isa_best(void) { return QK_CPU_ISA_PORTABLE; }

int qk_linear_fast(const qk_linear_args *a, int swiglu, int *status) {
    (void)a, (void)swiglu, (void)status;
    return 0;
}

#else

#include <cpuid.h>
#include <immintrin.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "x86_simd.h"

/* ---- detection ------------------------------------------------------------------------------ */

static int isa_best = QK_CPU_ISA_PORTABLE;
static pthread_once_t isa_once = PTHREAD_ONCE_INIT;

/* Linux hands out the 8 KB AMX tile state only to processes that ask (since 5.16). */
static int amx_permitted(void) {
#if defined(__linux__) && defined(SYS_arch_prctl)
    enum { ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    unsigned long bits = 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bits) != 0) return 0;
    return (bits >> XFEATURE_XTILEDATA) & 1;
#else
    return 0;
#endif
}

static void isa_detect(void) {
    __builtin_cpu_init();
    /* __builtin_cpu_supports checks that the OS saves the AVX and AVX-512 state too */
    unsigned a, b, c, d, f16c;
    if (!__get_cpuid(1, &a, &b, &f16c, &d) || !(f16c & (1u << 29))) return;
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return;
    isa_best = QK_CPU_ISA_AVX2;
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")))
        return;
    isa_best = QK_CPU_ISA_AVX512;
    unsigned max_sub, edx7;
    if (!__get_cpuid_count(7, 0, &max_sub, &b, &c, &edx7) || max_sub < 1) return;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return; /* AVX512_BF16 */
    isa_best = QK_CPU_ISA_AVX512_BF16;
    if ((edx7 & (1u << 22)) && (edx7 & (1u << 24)) && amx_permitted()) isa_best = QK_CPU_ISA_AMX; /* AMX-BF16, -TILE */
}

int qk_cpu_isa_best(void) {
    pthread_once(&isa_once, isa_detect);
    return isa_best;
}

/* 64-byte aligned scratch: a vector load that straddles two cache lines costs two */
static void *alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* ---- AVX-512 helpers ------------------------------------------------------------------------- */

#define TBF16 static __attribute__((target(T512_ISA ",avx512bf16")))
#define TAMX static __attribute__((target(T512_ISA ",avx512bf16,amx-tile,amx-bf16")))
#define TFMA static __attribute__((target(T512_ISA)))

T512 __mmask16 mask16(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n > 0 ? n : 0)) - 1); }
T512 __mmask32 mask32(int64_t n) { return n >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (n > 0 ? n : 0)) - 1); }

/* 16 elements of a float32/bfloat16/float16 array as fp32 (exact), masked lanes 0 */
T512 __m512 load16(const void *p, int dtype, __mmask16 m) {
    if (dtype == QK_F32) return _mm512_maskz_loadu_ps(m, p);
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    if (dtype == QK_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* the rounding of qk_store_f32 (nearest even, NaN kept quiet), 16 at a time */
T512 void store16(void *p, int dtype, __m512 v, __mmask16 m) {
    if (dtype == QK_F32) {
        _mm512_mask_storeu_ps(p, m, v);
        return;
    }
    __m256i h;
    if (dtype == QK_BF16) {
        const __m512i u = _mm512_castps_si512(v);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
        h = _mm512_cvtepi32_epi16(r);
    } else {
        h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm256_mask_storeu_epi16(p, m, h);
}

/* e^x for silu: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial, scaled by 2^n (scalef
 * overflows to inf and underflows to 0 past fp32's range; x is clamped so n stays finite). */
T512 __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(89.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* out[m, n0 .. n0 + cnt) from fp32 sums: linear adds the bias; swiglu up * silu(gate) with
 * silu(g) = g / (1 + e^-g) */
T512 void epilogue16(const qk_linear_args *a, int swiglu, int64_t m, int64_t n0, int64_t cnt, __m512 up, __m512 gate) {
    const __mmask16 msk = mask16(cnt);
    __m512 v;
    if (swiglu) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate));
        v = _mm512_mul_ps(up, _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
    } else if (a->bias) {
        __m512 b;
        if (a->bias_stride == 1) {
            b = load16((const char *)a->bias + n0 * (a->dtype == QK_F32 ? 4 : 2), a->dtype, msk);
        } else {
            float t[16] = {0};
            for (int j = 0; j < cnt; j++) t[j] = qk_load_f32(a->bias, (n0 + j) * a->bias_stride, a->dtype);
            b = _mm512_loadu_ps(t);
        }
        v = _mm512_add_ps(up, b);
    } else {
        v = up;
    }
    store16((char *)a->out + (m * a->out_stride + n0) * (a->dtype == QK_F32 ? 4 : 2), a->dtype, v, msk);
}

/* ---- the lane kernel ---------------------------------------------------------------------------
 * Dot products with k in the lanes: a vector holds 16 consecutive k of a row of x and of a weight
 * row (VDPBF16PS: 16 pairs), so both operands load straight from their rows and a lone row of x
 * streams the weights without any shuffling.  Lane l of an output's accumulator is one chain over
 * the steps in order (fma: k = l mod 16; pairs: k = 2l, 2l + 1 mod 32); the last, partial step is
 * masked, its missing k zero.  At the end the 16 lanes are added in one fixed tree (ll_reduce16),
 * so every output is reduced the same way whatever M, the tile, the chunking or the thread.
 *
 * Blocking: a unit is LL_NG weight rows (swiglu: LL_NG / 2 of each weight) by LL_MB rows of x.  It
 * walks k in chunks of LL_KC: within a chunk each tile of LL_NT weight rows (kept in L1) meets every
 * tile of LL_MT rows of x of the unit (from L2); the 16-lane partial sums wait in memory between
 * chunks, stored exactly.  A unit with up to two tiles of x rows (the weights pass once) takes K in
 * one chunk; the first tile of x rows prefetches the weight rows.  16-bit weights are converted to
 * fp32 on load when they stream, else once per chunk into a copy that the tiles of x rows share;
 * 16-bit x is converted once per slab of rows. */

#define LL_MT 4
#define LL_NT 6
#define LL_TILES 8                 /* weight tiles per unit */
#define LL_NG (LL_TILES * LL_NT)   /* weight rows per unit */
#define LL_MB 64                   /* rows of x per unit */
#define LL_KC 1024                 /* k per chunk: a weight tile's chunk is 24 KB of fp32 */
#define LL_ACC (LL_MT * LL_NT * 16) /* floats of one tile's accumulators */
#define LL_PREFETCH 1024           /* bytes ahead in each streamed weight row */

typedef struct {
    const qk_linear_args *a;
    int swiglu, dp;       /* dp: bfloat16 by VDPBF16PS (x and weights read as pairs in place) */
    const char *x;        /* row m at x + m * xs: fp32 (in place or converted), or bfloat16 (dp) */
    int64_t xs, n_groups, m_blocks, wbuf_k;
    int64_t m_base, m_rows; /* the slab of x rows this run covers */
    float *scratch;       /* per thread: accumulators, results, a weight copy */
    int64_t scratch_floats, acc_floats;
} ll_ctx;

/* 16 elements of a weight row as fp32 (masked lanes 0) */
T512 __m512 ll_wload(const char *p, int wdt, __mmask16 m) {
    if (wdt == QK_F32) return _mm512_maskz_loadu_ps(m, p);
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    if (wdt == QK_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* The tile kernels' accumulators: rows i < MT of c from acc (zero with init), and back. */
static inline __attribute__((target(T512_ISA), always_inline)) void ll_acc_load(__m512 c[LL_MT][LL_NT], const float *acc,
                                                                                int MT, int init) {
#pragma GCC unroll 4
    for (int i = 0; i < MT; i++)
#pragma GCC unroll 6
        for (int j = 0; j < LL_NT; j++) c[i][j] = init ? _mm512_setzero_ps() : _mm512_load_ps(acc + (i * LL_NT + j) * 16);
}

static inline __attribute__((target(T512_ISA), always_inline)) void ll_acc_store(__m512 c[LL_MT][LL_NT], float *acc,
                                                                                 int MT) {
#pragma GCC unroll 4
    for (int i = 0; i < MT; i++)
#pragma GCC unroll 6
        for (int j = 0; j < LL_NT; j++) _mm512_store_ps(acc + (i * LL_NT + j) * 16, c[i][j]);
}

/* acc[i * LL_NT + j] (+)= the 16-lane products of x row i (x + i xs, fp32) and weight row j (w + j ws,
 * dtype wdt) over n elements; rows past MT are not touched.  pf: prefetch the weight rows. */
static inline __attribute__((target(T512_ISA), always_inline)) void
ll_fma_tile(const char *x, int64_t xs, const char *w, int64_t ws, int64_t n, int MT, int wdt, float *acc, int init,
            int pf) {
    const int es = wdt == QK_F32 ? 4 : 2;
    __m512 c[LL_MT][LL_NT];
    ll_acc_load(c, acc, MT, init);
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        __m512 wv[LL_NT];
#pragma GCC unroll 6
        for (int j = 0; j < LL_NT; j++) {
            if (pf) _mm_prefetch(w + j * ws + k * es + LL_PREFETCH, _MM_HINT_T0);
            wv[j] = ll_wload(w + j * ws + k * es, wdt, 0xFFFF);
        }
#pragma GCC unroll 4
        for (int i = 0; i < MT; i++) {
            const __m512 xv = _mm512_loadu_ps((const float *)(x + i * xs) + k);
#pragma GCC unroll 6
            for (int j = 0; j < LL_NT; j++) c[i][j] = _mm512_fmadd_ps(xv, wv[j], c[i][j]);
        }
    }
    if (k < n) {
        const __mmask16 m = mask16(n - k);
        __m512 wv[LL_NT];
#pragma GCC unroll 6
        for (int j = 0; j < LL_NT; j++) wv[j] = ll_wload(w + j * ws + k * es, wdt, m);
#pragma GCC unroll 4
        for (int i = 0; i < MT; i++) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, (const float *)(x + i * xs) + k);
#pragma GCC unroll 6
            for (int j = 0; j < LL_NT; j++) c[i][j] = _mm512_fmadd_ps(xv, wv[j], c[i][j]);
        }
    }
    ll_acc_store(c, acc, MT);
}

/* ll_fma_tile for bfloat16 pairs: n bfloat16 elements of x (bfloat16) and the weights, VDPBF16PS */
static inline __attribute__((target(T512_ISA ",avx512bf16"), always_inline)) void
ll_dp_tile(const char *x, int64_t xs, const char *w, int64_t ws, int64_t n, int MT, int wdt, float *acc, int init,
           int pf) {
    (void)wdt;
    __m512 c[LL_MT][LL_NT];
    ll_acc_load(c, acc, MT, init);
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
        __m512i wv[LL_NT];
#pragma GCC unroll 6
        for (int j = 0; j < LL_NT; j++) {
            if (pf) _mm_prefetch(w + j * ws + k * 2 + LL_PREFETCH, _MM_HINT_T0);
            wv[j] = _mm512_loadu_si512(w + j * ws + k * 2);
        }
#pragma GCC unroll 4
        for (int i = 0; i < MT; i++) {
            const __m512i xv = _mm512_loadu_si512(x + i * xs + k * 2);
#pragma GCC unroll 6
            for (int j = 0; j < LL_NT; j++) c[i][j] = _mm512_dpbf16_ps(c[i][j], (__m512bh)xv, (__m512bh)wv[j]);
        }
    }
    if (k < n) {
        const __mmask32 m = mask32(n - k);
        __m512i wv[LL_NT];
#pragma GCC unroll 6
        for (int j = 0; j < LL_NT; j++) wv[j] = _mm512_maskz_loadu_epi16(m, w + j * ws + k * 2);
#pragma GCC unroll 4
        for (int i = 0; i < MT; i++) {
            const __m512i xv = _mm512_maskz_loadu_epi16(m, x + i * xs + k * 2);
#pragma GCC unroll 6
            for (int j = 0; j < LL_NT; j++) c[i][j] = _mm512_dpbf16_ps(c[i][j], (__m512bh)xv, (__m512bh)wv[j]);
        }
    }
    ll_acc_store(c, acc, MT);
}

/* lane i of the result: the 16 lanes of v[i] added as ((l + l+8) + (l+4 + l+12)) for l < 4, then
 * (0 + 2) + (1 + 3): the same tree for every output, whichever vectors share the call */
T512 __m512 ll_reduce16(const float *v, int count) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++) {
        const __m512 a = 2 * i < count ? _mm512_load_ps(v + 2 * i * 16) : _mm512_setzero_ps();
        const __m512 b = 2 * i + 1 < count ? _mm512_load_ps(v + (2 * i + 1) * 16) : _mm512_setzero_ps();
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
    /* element 4 j + e holds vector 4 e + j */
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), r);
}

/* the tile's accumulators (rows < mt) reduced into res[i][col + j] (row length LL_NG) */
T512 void ll_finish_tile(const float *acc, int mt, float *res, int col) {
    float s[32] __attribute__((aligned(64)));
    const int cnt = mt * LL_NT;
    _mm512_store_ps(s, ll_reduce16(acc, cnt < 16 ? cnt : 16));
    if (cnt > 16) _mm512_store_ps(s + 16, ll_reduce16(acc + 256, cnt - 16));
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < LL_NT; j++) res[i * LL_NG + col + j] = s[i * LL_NT + j];
}

/* rows [0, valid) of a weight tile, elements [k0, k0 + n), into buf (row length ld elements of fp32,
 * or of bfloat16 when keep16), rows past valid repeating row 0 (their results are dropped) */
T512 void ll_copy_tile(const char *w, int64_t ws, int wdt, int valid, int64_t k0, int64_t n, int keep16, char *buf,
                       int64_t ld) {
    const int es = wdt == QK_F32 ? 4 : 2;
    for (int j = 0; j < LL_NT; j++) {
        const char *row = w + (j < valid ? j : 0) * ws + k0 * es;
        if (keep16) {
            for (int64_t k = 0; k < n; k += 32)
                _mm512_storeu_si512(buf + j * ld * 2 + k * 2, _mm512_maskz_loadu_epi16(mask32(n - k), row + k * 2));
        } else {
            for (int64_t k = 0; k < n; k += 16) {
                _mm_prefetch(row + k * es + LL_PREFETCH, _MM_HINT_T0);
                _mm512_store_ps((float *)buf + j * ld + k, ll_wload(row + k * es, wdt, mask16(n - k)));
            }
        }
    }
}

#define LL_CASE(TILE, V, WDT, R) \
    case V * LL_MT + R - 1: TILE(x, c->xs, w, ws, n, R, WDT, acc, init, mt == 0); break;
#define LL_CASES(TILE, V, WDT) \
    LL_CASE(TILE, V, WDT, 1) LL_CASE(TILE, V, WDT, 2) LL_CASE(TILE, V, WDT, 3) LL_CASE(TILE, V, WDT, 4)

/* out[m, n0 ..] from the fp32 sums pu[0 .. cnt) (swiglu: and pg), ncnt <= cnt of them stored */
T512 void ll_epilogue(const qk_linear_args *a, int swiglu, int64_t m, int64_t n0, int64_t ncnt, int64_t cnt,
                      const float *pu, const float *pg) {
    const __m512 up = _mm512_maskz_loadu_ps(mask16(cnt), pu);
    epilogue16(a, swiglu, m, n0, ncnt, up, swiglu ? _mm512_maskz_loadu_ps(mask16(cnt), pg) : up);
}

#define LL_WORKER(NAME, ATTR, TILE, DP, COPY, FINISH, EPI)                                                                           \
    ATTR void NAME(void *p, int tid, int nthreads) {                                                              \
        const ll_ctx *c = p;                                                                                      \
        const qk_linear_args *a = c->a;                                                                           \
        const int64_t K = a->K, N = a->N, M = c->m_rows;                                                          \
        const int half = c->swiglu ? LL_NG / 2 : LL_NG, wes = a->dtype == QK_F32 ? 4 : 2;                         \
        float *res = c->scratch + (int64_t)tid * c->scratch_floats; /* [LL_MB][LL_NG] */                          \
        char *wbuf = (char *)(res + LL_MB * LL_NG);                 /* [LL_NT][wbuf_k] */                          \
        float *accs = res + LL_MB * LL_NG + LL_NT * c->wbuf_k;      /* [m tiles][LL_TILES][LL_ACC] */             \
        int64_t u0, u1;                                                                                           \
        qk_share(c->n_groups * c->m_blocks, tid, nthreads, &u0, &u1);                                             \
        for (int64_t u = u0; u < u1; u++) {                                                                       \
            const int64_t n0 = u / c->m_blocks * half, m0 = u % c->m_blocks * LL_MB;                              \
            const int mrows = M - m0 < LL_MB ? (int)(M - m0) : LL_MB, mtiles = (mrows + LL_MT - 1) / LL_MT;         \
            const int stream = mtiles <= 2; /* the weights pass once: whole K, converted on load */              \
            const int64_t kc = stream ? (K > 0 ? K : 1) : LL_KC;                                                  \
            const int conv = !(DP) && a->dtype != QK_F32 && !stream;                                              \
            for (int64_t k0 = 0; k0 < K || k0 == 0; k0 += kc) {                                                   \
                const int64_t n = K - k0 < kc ? K - k0 : kc;                                                      \
                const int last = k0 + kc >= K;                                                                    \
                for (int t = 0; t < LL_TILES; t++) {                                                              \
                    const int gate = c->swiglu && t >= LL_TILES / 2;                                              \
                    const int64_t first = n0 + (gate ? t - LL_TILES / 2 : t) * LL_NT;                             \
                    if (first >= N) continue;                                                                     \
                    const int valid = N - first < LL_NT ? (int)(N - first) : LL_NT;                              \
                    const int64_t ws0 = (gate ? a->gate_stride : a->w_stride) * wes;                              \
                    const char *w = (const char *)(gate ? a->gate : a->w) + first * ws0 + k0 * wes;                \
                    int64_t ws = ws0;                                                                             \
                    int wdt = a->dtype;                                                                           \
                    if (valid < LL_NT || conv) {                                                                  \
                        COPY(w, ws0, a->dtype, valid, 0, n, DP, wbuf, c->wbuf_k);                                 \
                        w = wbuf;                                                                                 \
                        ws = c->wbuf_k * ((DP) ? 2 : 4);                                                          \
                        wdt = (DP) ? QK_BF16 : QK_F32;                                                            \
                    }                                                                                             \
                    for (int mt = 0; mt < mtiles; mt++) {                                                         \
                        const int rows = mrows - mt * LL_MT < LL_MT ? mrows - mt * LL_MT : LL_MT;                 \
                        const char *x = c->x + (m0 + mt * LL_MT) * c->xs + k0 * ((DP) ? 2 : 4);                   \
                        float *acc = accs + ((int64_t)mt * LL_TILES + t) * LL_ACC;                                \
                        const int init = k0 == 0;                                                                 \
                        const int v = (DP) || wdt == QK_F32 ? 0 : wdt == QK_F16 ? 1 : 2;                          \
                        switch (v * LL_MT + rows - 1) { /* constant shapes, each call unrolled */                 \
                        LL_CASES(TILE, 0, QK_F32)                                                                 \
                        LL_CASES(TILE, 1, QK_F16)                                                                 \
                        LL_CASES(TILE, 2, QK_BF16)                                                                \
                        }                                                                                         \
                        if (last) FINISH(acc, rows, res + mt * LL_MT * LL_NG, (int)(t * LL_NT));                  \
                    }                                                                                             \
                }                                                                                                 \
                if (K == 0) break;                                                                                \
            }                                                                                                     \
            for (int m = 0; m < mrows; m++)                                                                       \
                for (int j0 = 0; j0 < half; j0 += 16) {                                                           \
                    const int64_t cnt = half - j0 < 16 ? half - j0 : 16;                                          \
                    const int64_t ncnt = N - n0 - j0 < cnt ? N - n0 - j0 : cnt;                                   \
                    if (ncnt <= 0) break;                                                                         \
                    EPI(a, c->swiglu, c->m_base + m0 + m, n0 + j0, ncnt, cnt, res + m * LL_NG + j0,                \
                        res + m * LL_NG + half + j0);                                                             \
                }                                                                                                 \
        }                                                                                                         \
    }

LL_WORKER(ll_worker_fma, TFMA, ll_fma_tile, 0, ll_copy_tile, ll_finish_tile, ll_epilogue)
LL_WORKER(ll_worker_dp, TBF16, ll_dp_tile, 1, ll_copy_tile, ll_finish_tile, ll_epilogue)

/* ---- the AVX2 kernel ----------------------------------------------------------------------------
 * For x86-64 with AVX2, FMA and F16C but no AVX-512: the lane kernel's order exactly, each 16-lane
 * accumulator held as two 8-float halves (k mod 16 < 8 and >= 8), so it gives the fma level's bits.
 * The tile runs as 2 x 3 sub-tiles (12 accumulator registers of the 16); the partial last step
 * goes through zero-padded copies (AVX2 has no masked 16-bit loads). */

#define T256_ISA "avx2,fma,f16c"
#define T256 static inline __attribute__((target(T256_ISA), always_inline))
#define TAVX2 static __attribute__((target(T256_ISA)))

T256 __m256 l2_wload(const char *p, int wdt) {
    if (wdt == QK_F32) return _mm256_loadu_ps((const float *)p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (wdt == QK_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* acc rows i < MI, columns j < NJ of a tile (stride LL_NT), over n elements (a multiple of 16) */
T256 void l2_pass(const char *x, int64_t xs, const char *w, int64_t ws, int64_t n, int MI, int NJ, int wdt, float *acc,
                  int init, int pf) {
    const int es = wdt == QK_F32 ? 4 : 2;
    __m256 c[2][3][2];
#pragma GCC unroll 2
    for (int i = 0; i < MI; i++)
#pragma GCC unroll 3
        for (int j = 0; j < NJ; j++)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++)
                c[i][j][h] = init ? _mm256_setzero_ps() : _mm256_load_ps(acc + (i * LL_NT + j) * 16 + 8 * h);
    for (int64_t k = 0; k < n; k += 16)
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m256 wv[3];
#pragma GCC unroll 3
            for (int j = 0; j < NJ; j++) {
                if (pf && h == 0) _mm_prefetch(w + j * ws + k * es + LL_PREFETCH, _MM_HINT_T0);
                wv[j] = l2_wload(w + j * ws + (k + 8 * h) * es, wdt);
            }
#pragma GCC unroll 2
            for (int i = 0; i < MI; i++) {
                __m256 xv = _mm256_loadu_ps((const float *)(x + i * xs) + k + 8 * h);
                __asm__("" : "+x"(xv));
#pragma GCC unroll 3
                for (int j = 0; j < NJ; j++) c[i][j][h] = _mm256_fmadd_ps(xv, wv[j], c[i][j][h]);
            }
        }
#pragma GCC unroll 2
    for (int i = 0; i < MI; i++)
#pragma GCC unroll 3
        for (int j = 0; j < NJ; j++)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) _mm256_store_ps(acc + (i * LL_NT + j) * 16 + 8 * h, c[i][j][h]);
}

/* ll_fma_tile's contract on AVX2 */
T256 void l2_tile(const char *x, int64_t xs, const char *w, int64_t ws, int64_t n, int MT, int wdt, float *acc, int init,
                  int pf) {
    const int64_t nf = n / 16 * 16;
    const int es = wdt == QK_F32 ? 4 : 2;
    for (int pass = 0; pass < 2; pass++) {
        const char *xp = x, *wp = w;
        int64_t xsp = xs, wsp = ws, np = nf;
        int wdtp = wdt, initp = init;
        float xt[LL_MT][16] __attribute__((aligned(32))), wt[LL_NT][16] __attribute__((aligned(32)));
        if (pass == 1) { /* the partial last step, zero-padded */
            if (nf == n) break;
            memset(xt, 0, sizeof xt);
            memset(wt, 0, sizeof wt);
            for (int i = 0; i < MT; i++) memcpy(xt[i], (const float *)(x + i * xs) + nf, (size_t)(n - nf) * 4);
            for (int j = 0; j < LL_NT; j++)
                for (int64_t k = nf; k < n; k++) {
                    const char *e = w + j * ws + k * es;
                    wt[j][k - nf] = wdt == QK_F32 ? *(const float *)e
                                    : wdt == QK_BF16 ? qk_bf16_to_f32(*(const uint16_t *)e)
                                                     : qk_f16_to_f32(*(const uint16_t *)e);
                }
            xp = (const char *)xt, wp = (const char *)wt, xsp = wsp = 64, np = 16, wdtp = QK_F32, initp = 0;
        }
        for (int i0 = 0; i0 < MT; i0 += 2)
            for (int j0 = 0; j0 < LL_NT; j0 += 3) {
                const char *xq = xp + i0 * xsp, *wq = wp + j0 * wsp;
                float *aq = acc + (i0 * LL_NT + j0) * 16;
                const int pfq = pf && i0 == 0 && pass == 0;
                if (MT - i0 >= 2) {
                    if (wdtp == QK_F32) l2_pass(xq, xsp, wq, wsp, np, 2, 3, QK_F32, aq, initp, pfq);
                    else if (wdtp == QK_F16) l2_pass(xq, xsp, wq, wsp, np, 2, 3, QK_F16, aq, initp, pfq);
                    else l2_pass(xq, xsp, wq, wsp, np, 2, 3, QK_BF16, aq, initp, pfq);
                } else {
                    if (wdtp == QK_F32) l2_pass(xq, xsp, wq, wsp, np, 1, 3, QK_F32, aq, initp, pfq);
                    else if (wdtp == QK_F16) l2_pass(xq, xsp, wq, wsp, np, 1, 3, QK_F16, aq, initp, pfq);
                    else l2_pass(xq, xsp, wq, wsp, np, 1, 3, QK_BF16, aq, initp, pfq);
                }
            }
    }
}

/* ll_reduce16's tree, one output at a time: (l + l+8), then + (l+4 + l+12), then (0 + 2) + (1 + 3) */
T256 float l2_reduce(const float *v) {
    const __m256 t = _mm256_add_ps(_mm256_load_ps(v), _mm256_load_ps(v + 8));
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    const __m128 u = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
}

T256 void l2_finish_tile(const float *acc, int mt, float *res, int col) {
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < LL_NT; j++) res[i * LL_NG + col + j] = l2_reduce(acc + (i * LL_NT + j) * 16);
}

/* ll_copy_tile for fp32 copies (AVX2 has no pairs form) */
T256 void l2_copy_tile(const char *w, int64_t ws, int wdt, int valid, int64_t k0, int64_t n, int keep16, char *buf,
                       int64_t ld) {
    (void)keep16;
    const int es = wdt == QK_F32 ? 4 : 2;
    for (int j = 0; j < LL_NT; j++) {
        const char *row = w + (j < valid ? j : 0) * ws + k0 * es;
        float *dst = (float *)buf + j * ld;
        int64_t k = 0;
        for (; k + 8 <= n; k += 8) _mm256_storeu_ps(dst + k, l2_wload(row + k * es, wdt));
        for (; k < n; k++)
            dst[k] = wdt == QK_F32 ? ((const float *)row)[k]
                     : wdt == QK_BF16 ? qk_bf16_to_f32(((const uint16_t *)row)[k])
                                      : qk_f16_to_f32(((const uint16_t *)row)[k]);
    }
}

/* exp16's steps on 8 lanes; 2^n as two exact power-of-two factors, so the product rounds once, as
 * scalef does (n in [-150, 128]) */
T256 __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.f)), _mm256_set1_ps(89.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
    const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

/* epilogue16 on 8 outputs; cnt <= 8 are stored */
T256 void epilogue8(const qk_linear_args *a, int swiglu, int64_t m, int64_t n0, int cnt, const float *pu, const float *pg) {
    const __m256 up = _mm256_loadu_ps(pu);
    __m256 v = up;
    if (swiglu) {
        const __m256 g = _mm256_loadu_ps(pg);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        v = _mm256_mul_ps(up, _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
    } else if (a->bias) {
        float t[8] = {0};
        for (int j = 0; j < cnt; j++) t[j] = qk_load_f32(a->bias, (n0 + j) * a->bias_stride, a->dtype);
        v = _mm256_add_ps(up, _mm256_loadu_ps(t));
    }
    char *dst = (char *)a->out + (m * a->out_stride + n0) * (a->dtype == QK_F32 ? 4 : 2);
    if (a->dtype == QK_F32) {
        float t[8];
        _mm256_storeu_ps(t, v);
        memcpy(dst, t, (size_t)cnt * 4);
        return;
    }
    uint16_t h[8];
    if (a->dtype == QK_F16) {
        _mm_storeu_si128((__m128i *)h, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
        float t[8];
        _mm256_storeu_ps(t, v);
        for (int j = 0; j < cnt; j++) h[j] = qk_f32_to_bf16(t[j]);
    }
    memcpy(dst, h, (size_t)cnt * 2);
}

T256 void l2_epilogue(const qk_linear_args *a, int swiglu, int64_t m, int64_t n0, int64_t ncnt, int64_t cnt,
                      const float *pu, const float *pg) {
    (void)cnt;
    for (int h = 0; h < ncnt; h += 8)
        epilogue8(a, swiglu, m, n0 + h, ncnt - h < 8 ? (int)(ncnt - h) : 8, pu + h, pg + h);
}

LL_WORKER(ll_worker_avx2, TAVX2, l2_tile, 0, l2_copy_tile, l2_finish_tile, l2_epilogue)

typedef struct {
    const qk_linear_args *a;
    float *x32;
    int64_t ld, m_base, rows;
} ll_conv_ctx;

/* 16-bit x to fp32 rows of ld floats, ranges of rows per thread */
TFMA void ll_conv_worker(void *p, int tid, int nthreads) {
    const ll_conv_ctx *c = p;
    const qk_linear_args *a = c->a;
    int64_t m0, m1;
    qk_share(c->rows, tid, nthreads, &m0, &m1);
    for (int64_t m = m0; m < m1; m++)
        for (int64_t k = 0; k < a->K; k += 16)
            _mm512_store_ps(c->x32 + m * c->ld + k, ll_wload((const char *)a->x + ((c->m_base + m) * a->x_stride + k) * 2,
                                                            a->dtype, mask16(a->K - k)));
}

/* the same conversion in plain C (the AVX2 level) */
static void ll_conv_worker_c(void *p, int tid, int nthreads) {
    const ll_conv_ctx *c = p;
    const qk_linear_args *a = c->a;
    int64_t m0, m1;
    qk_share(c->rows, tid, nthreads, &m0, &m1);
    for (int64_t m = m0; m < m1; m++)
        for (int64_t k = 0; k < a->K; k++)
            c->x32[m * c->ld + k] = qk_load_f32(a->x, (c->m_base + m) * a->x_stride + k, a->dtype);
}

/* dp: bfloat16 pairs (AVX512-BF16); avx2: the AVX2 kernel.  x in slabs of LL_SLAB rows, so that
 * 16-bit x converted to fp32 needs LL_SLAB rows of scratch whatever M. */
#define LL_SLAB 512 /* a multiple of LL_MB: only M's last block of rows can be short */
static int ll_run(const qk_linear_args *a, int swiglu, int dp, int avx2) {
    const int64_t M = a->M, N = a->N, K = a->K;
    ll_ctx c = {.a = a, .swiglu = swiglu, .dp = dp};
    const int half = swiglu ? LL_NG / 2 : LL_NG;
    c.n_groups = (N + half - 1) / half;
    const int64_t mtiles = ((M < LL_MB ? M : LL_MB) + LL_MT - 1) / LL_MT;
    const int64_t kpad = (K + 31) / 32 * 32, ld = kpad > 0 ? kpad : 32;
    /* a block of up to 8 rows (M's only one, or its last) copies whole rows of K */
    const int64_t last_tiles = (M - (M - 1) / LL_MB * LL_MB + LL_MT - 1) / LL_MT;
    c.wbuf_k = mtiles <= 2 || last_tiles <= 2 ? (kpad > LL_KC ? kpad : LL_KC) : LL_KC;
    c.acc_floats = mtiles * LL_TILES * LL_ACC;
    c.scratch_floats = LL_MB * LL_NG + LL_NT * c.wbuf_k + c.acc_floats;
    const int64_t slab = M < LL_SLAB ? M : LL_SLAB;
    const int max_threads = qk_threads_for(M * N * (K > 0 ? K : 1) * (swiglu ? 2 : 1), a->num_threads > 0 ? a->num_threads : 1);
    const int convert_x = !dp && a->dtype != QK_F32;
    const size_t scratch_bytes = sizeof(float) * (size_t)c.scratch_floats * (size_t)max_threads;
    const size_t x_bytes = convert_x ? sizeof(float) * (size_t)slab * (size_t)ld : 0;
    char *mem = qk_cpu_scratch(scratch_bytes + x_bytes + 64);
    if (!mem) return QK_E_NOMEM;
    char *base = (char *)(((uintptr_t)mem + 63) & ~(uintptr_t)63);
    c.scratch = (float *)base;
    int status = QK_OK;
    for (int64_t m0 = 0; m0 < M && status == QK_OK; m0 += LL_SLAB) {
        c.m_base = m0;
        c.m_rows = M - m0 < LL_SLAB ? M - m0 : LL_SLAB;
        c.m_blocks = (c.m_rows + LL_MB - 1) / LL_MB;
        int nthreads = max_threads;
        if (nthreads > c.n_groups * c.m_blocks) nthreads = (int)(c.n_groups * c.m_blocks);
        if (convert_x) {
            ll_conv_ctx cv = {a, (float *)(base + scratch_bytes), ld, m0, c.m_rows};
            status = qk_parallel_run(qk_threads_for(c.m_rows * K * 16, nthreads), avx2 ? ll_conv_worker_c : ll_conv_worker,
                                     &cv);
            c.x = (const char *)cv.x32;
            c.xs = ld * 4;
        } else {
            c.xs = a->x_stride * (dp ? 2 : 4);
            c.x = a->x ? (const char *)a->x + m0 * c.xs : NULL; /* K = 0: never read */
        }
        if (status == QK_OK)
            status = qk_parallel_run(nthreads, dp ? ll_worker_dp : avx2 ? ll_worker_avx2 : ll_worker_fma, &c);
    }
    qk_cpu_scratch_release(mem);
    return status;
}

/* ---- the AMX kernel ---------------------------------------------------------------------------
 * Tiles: 0-3 accumulators C (16 weight rows x 16 rows of x, fp32), 4-5 A (16 weight rows x 32 k),
 * 6-7 B (16 pairs of k x 16 rows of x, VNNI).  A unit is 2 A tiles (linear: 32 weight rows;
 * swiglu: 16 up rows and the same 16 gate rows) by 1 or 2 B tiles (16 or 32 rows of x, 1 when
 * M <= 16).  x is packed per slab of AX_MSLAB rows into [m tile][k block][16][32] bf16, zero
 * past M and K, by a first parallel pass. */

#define AX_MSLAB 512

typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} ax_tilecfg;

__attribute__((target(T512_ISA ",amx-tile"))) void qk_amx_tiles_16x64(void) {
    ax_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    /* GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes: keep the whole 64 stored */
    __asm__ __volatile__("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

typedef struct {
    const qk_linear_args *a;
    int swiglu;
    uint16_t *xp; /* per thread: the blocks of x it uses, packed */
    int64_t xp_per_thread;
    int msplit;   /* threads split the blocks of x (else the units) */
    float *park;  /* per thread: AX_MSLAB / 32 blocks of 4 C tiles */
    int64_t m_begin, m_rows, m_tiles, k_blocks, n_blocks, m_blocks, mt_per_unit;
} ax_ctx;

/* m tiles [t0, t1) of the slab into xp (its tile t0 first) */
TAMX void ax_pack(const ax_ctx *c, int64_t t0, int64_t t1, uint16_t *xp) {
    const qk_linear_args *a = c->a;
    for (int64_t mt = t0; mt < t1; mt++)
        for (int64_t kb = 0; kb < c->k_blocks; kb++) {
            const int64_t k0 = kb * 32;
            const __mmask32 km = mask32(a->K - k0);
            __m512 r[16];
            for (int i = 0; i < 16; i++) {
                const int64_t m = mt * 16 + i;
                r[i] = m < c->m_rows ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(
                                           km, (const uint16_t *)a->x + (c->m_begin + m) * a->x_stride + k0))
                                     : _mm512_setzero_ps();
            }
            transpose16(r); /* row j: the pair k0 + 2 j, k0 + 2 j + 1 of the 16 rows of x */
            float *dst = (float *)(xp + ((mt - t0) * c->k_blocks + kb) * 512);
            for (int i = 0; i < 16; i++) _mm512_store_ps(dst + i * 16, r[i]);
        }
}

/* the A tile of weight rows [n, n + valid) at k0 into buf, zero past valid rows and K */
TAMX void ax_pad_a(const uint16_t *w, int64_t stride, int64_t valid, int64_t krem, uint16_t *buf) {
    const __mmask32 km = mask32(krem);
    for (int i = 0; i < 16; i++)
        _mm512_store_si512(buf + i * 32, i < valid ? _mm512_maskz_loadu_epi16(km, w + i * stride) : _mm512_setzero_si512());
}

#define AX_PREFETCH 256 /* bytes ahead in each weight row */
#define AX_KCB 8        /* k blocks per chunk: 2 weight tiles of 8 KB each */

/* a finished unit's outputs, waiting in cb while the next unit's tile products run, so that the
 * vector work of its epilogue overlaps them: step t writes the 16 rows of x of B tile t */
typedef struct {
    float cb[4][256] __attribute__((aligned(64)));
    int64_t n0, valid[2], mt0;
    int steps; /* 0: nothing pending */
} ax_pending;

/* The outputs of B tile t, still [weight row][row of x]: bias or silu there (per element, as in
 * epilogue16), rounded, two weight rows packed per 32-bit lane, and one 16 x 16 transpose of those
 * pairs gives each row of x its 32 outputs (linear: both A tiles; swiglu: 16) as one store. */
TAMX void ax_epilogue_step(const ax_ctx *c, const ax_pending *q, int t) {
    const qk_linear_args *a = c->a;
    __m512 v[16];
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 8; i++) {
            __m512i bits[2];
            for (int e = 0; e < 2; e++) {
                const int r = 2 * i + e;
                __m512 y = _mm512_load_ps(q->cb[2 * h + t] + r * 16);
                if (c->swiglu) {
                    if (h == 1) break;
                    const __m512 g = _mm512_load_ps(q->cb[2 + t] + r * 16);
                    const __m512 ex = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
                    y = _mm512_mul_ps(y, _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), ex)));
                } else if (a->bias && r < q->valid[h]) {
                    y = _mm512_add_ps(y, _mm512_set1_ps(qk_load_f32(a->bias, (q->n0 + 16 * h + r) * a->bias_stride, a->dtype)));
                }
                bits[e] = bf16_bits(y);
            }
            v[8 * h + i] = c->swiglu && h == 1 ? _mm512_setzero_ps()
                                               : _mm512_castsi512_ps(_mm512_or_si512(bits[0], _mm512_slli_epi32(bits[1], 16)));
        }
    transpose16(v); /* v[m]: the 16 pairs of weight rows of row m of x */
    const int64_t cols = c->swiglu ? q->valid[0] : q->valid[0] + q->valid[1];
    const __mmask32 cm = mask32(cols);
    for (int i = 0; i < 16; i++) {
        const int64_t m = (q->mt0 + t) * 16 + i;
        if (m >= c->m_rows) break;
        _mm512_mask_storeu_epi16((uint16_t *)a->out + (c->m_begin + m) * a->out_stride + q->n0, cm, _mm512_castps_si512(v[i]));
    }
}

TAMX void ax_worker(void *p, int tid, int nthreads) {
    const ax_ctx *c = p;
    const qk_linear_args *a = c->a;
    const int64_t K = a->K, N = a->N, KB = c->k_blocks;
    qk_amx_tiles_16x64();
    uint16_t pad[2][16 * 32] __attribute__((aligned(64)));
    ax_pending pend[2];
    int cur = 0, done = 0; /* pend[cur]: the unit whose epilogue runs; done: its steps taken */
    pend[0].steps = pend[1].steps = 0;
    float *park = c->park + (int64_t)tid * AX_MSLAB / 32 * 1024; /* C tiles between k chunks, per block of x */
    const int per = c->swiglu ? 16 : 32; /* output columns per unit */
    const int stream = c->m_blocks == 1;  /* each weight read once: fetch ahead of the tile loads */
    /* Many blocks of x: each thread takes a range of them across every weight block, packing only
     * its own; else ranges of (weight block, block of x) units, each thread packing every block. */
    int64_t mb_lo = 0, mb_cnt = c->m_blocks, u0, u1;
    if (c->msplit) {
        qk_share(c->m_blocks, tid, nthreads, &mb_lo, &mb_cnt);
        mb_cnt -= mb_lo;
        u0 = 0;
        u1 = c->n_blocks * mb_cnt;
    } else {
        qk_share(c->n_blocks * c->m_blocks, tid, nthreads, &u0, &u1);
    }
    const int64_t mt_lo = mb_lo * c->mt_per_unit;
    const int64_t mt_hi = (mb_lo + mb_cnt) * c->mt_per_unit < c->m_tiles ? (mb_lo + mb_cnt) * c->mt_per_unit : c->m_tiles;
    uint16_t *xp = c->xp + (int64_t)tid * c->xp_per_thread;
    ax_pack(c, mt_lo, mt_hi, xp);
    for (int64_t u = u0; u < u1;) {
        /* a group: the thread's units on one block of weight rows */
        const int64_t nb = u / mb_cnt, mb0 = mb_lo + u % mb_cnt;
        const int64_t mb1 = mb0 + (u1 - u) < mb_lo + mb_cnt ? mb0 + (u1 - u) : mb_lo + mb_cnt;
        u += mb1 - mb0;
        const int64_t n0 = nb * per;
        const uint16_t *src[2];
        int64_t stride[2], valid[2];
        if (c->swiglu) {
            src[0] = (const uint16_t *)a->w + n0 * a->w_stride;
            src[1] = (const uint16_t *)a->gate + n0 * a->gate_stride;
            stride[0] = a->w_stride;
            stride[1] = a->gate_stride;
            valid[0] = valid[1] = N - n0 < 16 ? N - n0 : 16;
        } else {
            src[0] = (const uint16_t *)a->w + n0 * a->w_stride;
            src[1] = src[0] + 16 * a->w_stride;
            stride[0] = stride[1] = a->w_stride;
            valid[0] = N - n0 < 16 ? N - n0 : 16;
            valid[1] = N - n0 - 16 < 16 ? (N - n0 - 16 > 0 ? N - n0 - 16 : 0) : 16;
        }
        if (valid[1] == 0) src[1] = src[0]; /* never read: its products are skipped */
        /* k in chunks whose weight tiles (2 x AX_KCB KB) stay in L1 while the group's blocks of x
         * stream past them from L2 */
        const int64_t kcb = mb1 - mb0 > 1 ? AX_KCB : (KB > 0 ? KB : 1);
        for (int64_t kc0 = 0; kc0 < KB || kc0 == 0; kc0 += kcb) {
            const int64_t kc1 = kc0 + kcb < KB ? kc0 + kcb : KB, last = kc1 >= KB;
            for (int64_t mb = mb0; mb < mb1; mb++) {
                const int64_t mt0 = mb * c->mt_per_unit;
                const int two = c->mt_per_unit == 2 && mt0 + 1 < c->m_tiles;
                float *pk = park + (mb - mb0) * 1024;
                if (kc0 == 0) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                } else {
                    _tile_loadd(0, pk, 64);
                    _tile_loadd(1, pk + 256, 64);
                    _tile_loadd(2, pk + 512, 64);
                    _tile_loadd(3, pk + 768, 64);
                }
                const uint16_t *b0 = xp + (mt0 - mt_lo) * KB * 512, *b1 = two ? b0 + KB * 512 : b0;
                for (int64_t kb = kc0; kb < kc1; kb++) {
                    const int64_t k0 = kb * 32;
                    const int full = k0 + 32 <= K;
                    if (stream && k0 * 2 + AX_PREFETCH < K * 2 && valid[0] == 16 && valid[1] == 16)
#pragma GCC unroll 16
                        for (int i = 0; i < 16; i++) {
                            _mm_prefetch((const char *)(src[0] + i * stride[0] + k0) + AX_PREFETCH, _MM_HINT_T0);
                            _mm_prefetch((const char *)(src[1] + i * stride[1] + k0) + AX_PREFETCH, _MM_HINT_T0);
                        }
                    if (full && valid[0] == 16) _tile_loadd(4, src[0] + k0, stride[0] * 2);
                    else {
                        ax_pad_a(src[0] + k0, stride[0], valid[0], K - k0, pad[0]);
                        _tile_loadd(4, pad[0], 64);
                    }
                    _tile_loadd(6, b0 + kb * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (valid[1] > 0) {
                        if (full && valid[1] == 16) _tile_loadd(5, src[1] + k0, stride[1] * 2);
                        else {
                            ax_pad_a(src[1] + k0, stride[1], valid[1], K - k0, pad[1]);
                            _tile_loadd(5, pad[1], 64);
                        }
                        _tile_dpbf16ps(2, 5, 6);
                    }
                    if (two) {
                        _tile_loadd(7, b1 + kb * 512, 64);
                        _tile_dpbf16ps(1, 4, 7);
                        if (valid[1] > 0) _tile_dpbf16ps(3, 5, 7);
                    }
                    if (done < pend[cur].steps) ax_epilogue_step(c, &pend[cur], done++);
                }
                if (!last) {
                    _tile_stored(0, pk, 64);
                    _tile_stored(1, pk + 256, 64);
                    _tile_stored(2, pk + 512, 64);
                    _tile_stored(3, pk + 768, 64);
                    continue;
                }
                while (done < pend[cur].steps) ax_epilogue_step(c, &pend[cur], done++);
                cur ^= 1;
                done = 0;
                ax_pending *q = &pend[cur];
                _tile_stored(0, q->cb[0], 64);
                _tile_stored(1, q->cb[1], 64);
                _tile_stored(2, q->cb[2], 64);
                _tile_stored(3, q->cb[3], 64);
                q->n0 = n0;
                q->valid[0] = valid[0];
                q->valid[1] = valid[1];
                q->mt0 = mt0;
                q->steps = 1 + two;
            }
            if (KB == 0) break;
        }
    }
    while (done < pend[cur].steps) ax_epilogue_step(c, &pend[cur], done++);
    _tile_release();
}

static int ax_run(const qk_linear_args *a, int swiglu) {
    const int64_t M = a->M, N = a->N, K = a->K;
    ax_ctx c = {.a = a, .swiglu = swiglu};
    c.k_blocks = (K + 31) / 32;
    c.n_blocks = (N + (swiglu ? 15 : 31)) / (swiglu ? 16 : 32);
    c.mt_per_unit = M <= 16 ? 1 : 2;
    const int64_t slab = M < AX_MSLAB ? M : AX_MSLAB;
    const int64_t slab_tiles = (slab + 15) / 16;
    const int64_t work = M * N * (K > 0 ? K : 1) * (swiglu ? 2 : 1);
    const int max_threads = qk_threads_for(work, a->num_threads > 0 ? a->num_threads : 1);
    c.xp_per_thread = slab_tiles * (c.k_blocks > 0 ? c.k_blocks : 1) * 512;
    c.xp = alloc64((size_t)max_threads * (size_t)c.xp_per_thread * 2);
    c.park = alloc64((size_t)max_threads * AX_MSLAB / 32 * 4096);
    if (!c.xp || !c.park) {
        free(c.xp);
        free(c.park);
        return QK_E_NOMEM;
    }
    int status = QK_OK;
    for (int64_t m0 = 0; m0 < M && status == QK_OK; m0 += AX_MSLAB) {
        c.m_begin = m0;
        c.m_rows = M - m0 < AX_MSLAB ? M - m0 : AX_MSLAB;
        c.m_tiles = (c.m_rows + 15) / 16;
        c.m_blocks = (c.m_tiles + c.mt_per_unit - 1) / c.mt_per_unit;
        int t = max_threads;
        if (t > c.n_blocks * c.m_blocks) t = (int)(c.n_blocks * c.m_blocks);
        /* enough blocks of x for every thread: each reads all weights but packs only its own x */
        c.msplit = c.m_blocks >= 4 * t;
        status = qk_parallel_run(t, ax_worker, &c);
    }
    free(c.xp);
    free(c.park);
    return status;
}

int qk_linear_fast(const qk_linear_args *a, int swiglu, int *status) {
    int isa = qk_cpu_isa_best();
    if (a->cpu_isa > 0 && a->cpu_isa < isa) isa = a->cpu_isa;
    if (isa < QK_CPU_ISA_AVX2 || a->M <= 0 || a->N <= 0) return 0;
    if (a->dtype == QK_BF16 && isa >= QK_CPU_ISA_AMX) *status = ax_run(a, swiglu);
    else if (a->dtype == QK_BF16 && isa >= QK_CPU_ISA_AVX512_BF16) *status = ll_run(a, swiglu, 1, 0);
    else if (a->dtype == QK_F32 || a->dtype == QK_F16 || a->dtype == QK_BF16)
        *status = ll_run(a, swiglu, 0, isa == QK_CPU_ISA_AVX2);
    else return 0;
    return 1;
}

#endif
