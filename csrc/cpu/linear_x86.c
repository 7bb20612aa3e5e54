/* linear and swiglu on x86-64 with AVX-512 and AMX, picked at run time (csrc/cpu/linear_isa.h).
 *
 * The kernels are compiled for their own instruction sets with target attributes, so the rest of
 * the build stays x86-64 baseline:
 *   amx   bfloat16: TDPBF16PS on 16 x 32 tiles.  The product is computed transposed,
 *         out^T [N, M] = W x^T: the weight rows load straight into A tiles (no repacking of the
 *         large operand); x is packed per call into VNNI pairs for the B tiles.
 *   fma   float32, and float16 (or bfloat16 without AVX512-BF16) converted to fp32 exactly: fused
 *         multiply-adds, x packed as [k][rows] and each weight element broadcast (M > 8), or 16
 *         weight rows transposed in registers and each row of x broadcast (M <= 8).
 *   pairs bfloat16 with AVX512-BF16 but no AMX: the fma kernel's forms with a pair of k as the step
 *         and VDPBF16PS as the multiply-add.
 *
 * Determinism.  On one machine every output is reduced in one fixed order whatever M, the tiling,
 * the thread count or the share of rows a thread gets: one fp32 chain over k (pairs of k) in
 * increasing order, from 0.  TDPBF16PS adds a row's 16 pairs in k order and the tiles follow in k
 * order; padding (k past K, rows past N or M) is zeros, and each output element depends on its own
 * row and column only.  Both fma forms run the same chains (a * b + c rounded once is symmetric in
 * a and b).  Partial sums parked in memory between k chunks are stored exactly.  The level is fixed
 * per process (the best the CPU offers, or the cap the caller passes), never chosen from M.
 *
 * The epilogue (bias, silu, the rounding to the output dtype) runs on 16 outputs of a row at a
 * time, with masks for the edges, in the same vector code for every position: silu's exp is a
 * polynomial of our own, so its bits do not depend on libm. */
#define _GNU_SOURCE
#include "cpu.h"
#include "half.h"
#include "linear_isa.h"

#include <stdlib.h>
#include <string.h>

const char *const qk_cpu_isa_names[QK_CPU_ISA_COUNT] = {
    [QK_CPU_ISA_AUTO] = "auto", [QK_CPU_ISA_PORTABLE] = "portable", [QK_CPU_ISA_AVX512] = "avx512",
    [QK_CPU_ISA_AVX512_BF16] = "avx512_bf16", [QK_CPU_ISA_AMX] = "amx"};

#if defined(__x86_64__) && defined(__GNUC__) && \
    ((!defined(__clang__) && __GNUC__ >= 11) || (defined(__clang__) && __clang_major__ >= 12))
#define QK_X86_KERNELS 1
#endif

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
    /* __builtin_cpu_supports checks that the OS saves the AVX-512 state too */
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma")))
        return;
    unsigned a, b, c, d, f16c;
    if (!__get_cpuid(1, &a, &b, &f16c, &d) || !(f16c & (1u << 29))) return;
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

#define T512_ISA "avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"
#define T512 static inline __attribute__((target(T512_ISA), always_inline))
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

/* a 16 x 16 transpose of 32-bit elements in registers */
T512 void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d t0 = _mm512_castps_pd(t[4 * i]), t1 = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d t2 = _mm512_castps_pd(t[4 * i + 2]), t3 = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
    }
    /* r[4 i + c], 128-bit lane j: column 4 j + c of rows 4 i .. 4 i + 3 */
    for (int c = 0; c < 4; c++) {
        const __m512 p = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88), q = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
        const __m512 s = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88),
                     u = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
        t[c] = _mm512_shuffle_f32x4(p, s, 0x88);
        t[8 + c] = _mm512_shuffle_f32x4(p, s, 0xDD);
        t[4 + c] = _mm512_shuffle_f32x4(q, u, 0x88);
        t[12 + c] = _mm512_shuffle_f32x4(q, u, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* ---- the fma kernel ----------------------------------------------------------------------------
 * Each output is one chain of fused multiply-adds over k in increasing order, the product computed
 * transposed: x is packed into blocks of 16 V rows laid out [k][rows] (fp32, zero past M), so a
 * vector holds 16 rows of x at one k; a weight element is broadcast from its row (converted to fp32
 * a chunk at a time when 16-bit).  A register tile is LF_NT weight rows by V vectors of rows of x
 * (V = 2: 24 accumulators; 1 when M <= 16); a unit is LF_TILES such tiles by one block of x and
 * walks k in chunks of LF_KC, so that the block's chunk (16 KB) stays in L1 for the 4 tiles.
 * M <= LS_MAX_M goes to the transposed-weights form below, with the same chains. */

#define LF_KC 128
#define LF_TILES 4
#define LF_WB (LF_KC + 16) /* floats per row of the weight copy: a chunk and a half pair, rounded */
#define LF_MSLAB 512
#define LF_NT(v) 12
#define LF_NB (LF_TILES * 12) /* weight rows per unit */

typedef struct {
    const qk_linear_args *a;
    int swiglu, v; /* v: vectors of x rows per tile, 1 or 2 */
    int pairs;     /* bfloat16 by VDPBF16PS: a step is a pair of k (K odd: the last pair ends in 0) */
    float *xt;     /* per thread: the blocks of x it uses, packed [block][kp][16 v] (pairs: 32-bit pairs) */
    int64_t xt_per_thread, kp, m_begin, m_rows, m_blocks, n_blocks;
    int msplit;    /* threads split the blocks of x (else the units) */
    float *scratch;
    int64_t scratch_floats;
} lf_ctx;

/* blocks [b0, b1) of the slab's rows of x into xt (its block b0 first) */
TFMA void lf_pack(const lf_ctx *c, int64_t b0, int64_t b1, float *xt) {
    const qk_linear_args *a = c->a;
    const int64_t rows = 16 * c->v;
    const int esize = a->dtype == QK_F32 ? 4 : 2;
    for (int64_t mb = b0; mb < b1; mb++)
        for (int64_t h = 0; h < c->v; h++)
            for (int64_t k0 = 0; k0 < c->kp; k0 += 16) {
                const __mmask16 km = mask16(a->K - k0);
                const __mmask32 pm = mask32(a->K - 2 * k0);
                __m512 r[16];
                for (int i = 0; i < 16; i++) {
                    const int64_t m = mb * rows + h * 16 + i;
                    const int64_t row = (c->m_begin + m) * a->x_stride;
                    r[i] = m >= c->m_rows ? _mm512_setzero_ps()
                           : c->pairs     ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(pm, (const uint16_t *)a->x + row + 2 * k0))
                                          : load16((const char *)a->x + (row + k0) * esize, a->dtype, km);
                }
                transpose16(r);
                float *dst = xt + (mb - b0) * c->kp * rows + k0 * rows + h * 16;
                for (int i = 0; i < 16; i++) _mm512_storeu_ps(dst + i * rows, r[i]);
            }
}

/* The 12 weight rows of a tile sit one stride apart (sb bytes: the weight's row stride, or the
 * scratch copy's), addressed from 4 bases as b[j / 3] + (j % 3) sb: 4 + 2 registers instead of 12
 * row pointers, which did not fit beside the accumulators and were reloaded at every k. */
#define LF_ROW(b, sb, j) ((const char *)(b)[(j) / 3] + ((j) % 3) * (sb))

/* acc[j][h] (+)= sum over the chunk of w_j[k] xt[k][16 h ..]: one fma chain per element */
static inline __attribute__((target(T512_ISA), always_inline)) void
lf_tile(const char *w, int64_t sb, const float *xt, int64_t kc, int V, float *acc, int init) {
    enum { NT = 12 };
    __m512 c[NT][2];
    const char *b[4] = {w, w + 3 * sb, w + 6 * sb, w + 9 * sb};
#pragma GCC unroll 12
    for (int j = 0; j < NT; j++)
#pragma GCC unroll 2
        for (int h = 0; h < V; h++) c[j][h] = init ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + (j * V + h) * 16);
    for (int64_t k = 0; k < kc; k++) {
        __m512 xv[2];
#pragma GCC unroll 2
        for (int h = 0; h < V; h++) xv[h] = _mm512_loadu_ps(xt + k * 16 * V + h * 16);
#pragma GCC unroll 12
        for (int j = 0; j < NT; j++) {
            const __m512 wv = _mm512_set1_ps(*(const float *)LF_ROW(b, sb, j));
#pragma GCC unroll 2
            for (int h = 0; h < V; h++) c[j][h] = _mm512_fmadd_ps(wv, xv[h], c[j][h]);
        }
        for (int q = 0; q < 4; q++) b[q] += 4;
    }
#pragma GCC unroll 12
    for (int j = 0; j < NT; j++)
#pragma GCC unroll 2
        for (int h = 0; h < V; h++) _mm512_storeu_ps(acc + (j * V + h) * 16, c[j][h]);
}

/* lf_tile for bfloat16 pairs: acc[j][h] (+)= the dot products of kc pairs of w_j with xt; with
 * odd, one more pair whose second element is past K (0; never read from the row) */
static inline __attribute__((target(T512_ISA ",avx512bf16"), always_inline)) void
lp_tile(const char *w, int64_t sb, const float *xt, int64_t kc, int odd, int V, float *acc, int init) {
    enum { NT = 12 };
    __m512 c[NT][2];
    const char *b[4] = {w, w + 3 * sb, w + 6 * sb, w + 9 * sb};
#pragma GCC unroll 12
    for (int j = 0; j < NT; j++)
#pragma GCC unroll 2
        for (int h = 0; h < V; h++) c[j][h] = init ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + (j * V + h) * 16);
    for (int64_t k = 0; k < kc + odd; k++) {
        __m512 xv[2];
#pragma GCC unroll 2
        for (int h = 0; h < V; h++) xv[h] = _mm512_loadu_ps(xt + k * 16 * V + h * 16);
#pragma GCC unroll 12
        for (int j = 0; j < NT; j++) {
            uint32_t pair;
            if (k < kc) memcpy(&pair, LF_ROW(b, sb, j), 4);
            else pair = *(const uint16_t *)LF_ROW(b, sb, j);
            const __m512bh wv = (__m512bh)_mm512_set1_epi32((int)pair);
#pragma GCC unroll 2
            for (int h = 0; h < V; h++) c[j][h] = _mm512_dpbf16_ps(c[j][h], (__m512bh)xv[h], wv);
        }
        for (int q = 0; q < 4; q++) b[q] += 4;
    }
#pragma GCC unroll 12
    for (int j = 0; j < NT; j++)
#pragma GCC unroll 2
        for (int h = 0; h < V; h++) _mm512_storeu_ps(acc + (j * V + h) * 16, c[j][h]);
}

/* the tile variants, called through a pointer so that the worker itself needs no AVX512-BF16 */
typedef void (*lf_tile_fn)(const char *w, int64_t sb, const float *xt, int64_t kc, int odd, float *acc, int init);
#define LF_TILE_VARIANT(NAME, ATTR, CALL)                                                                   \
    ATTR void NAME(const char *w, int64_t sb, const float *xt, int64_t kc, int odd, float *acc, int init) { \
        (void)odd;                                                                                          \
        CALL;                                                                                               \
    }
LF_TILE_VARIANT(lf_tile_1, TFMA, lf_tile(w, sb, xt, kc, 1, acc, init))
LF_TILE_VARIANT(lf_tile_2, TFMA, lf_tile(w, sb, xt, kc, 2, acc, init))
LF_TILE_VARIANT(lp_tile_1, TBF16, lp_tile(w, sb, xt, kc, odd, 1, acc, init))
LF_TILE_VARIANT(lp_tile_2, TBF16, lp_tile(w, sb, xt, kc, odd, 2, acc, init))

TFMA void lf_worker(void *p, int tid, int nthreads) {
    const lf_ctx *c = p;
    const qk_linear_args *a = c->a;
    const int64_t K = a->K, N = a->N;
    const int V = c->v, nt = LF_NT(V), nb = LF_TILES * nt, half = c->swiglu ? nb / 2 : nb, rows = 16 * V;
    const int conv = a->dtype != QK_F32 && !c->pairs, esize = a->dtype != QK_F32 ? 2 : 4;
    const int64_t steps = c->pairs ? K / 2 : K; /* whole steps; pairs: K odd adds a half pair */
    const int odd = c->pairs && K % 2;
    const lf_tile_fn tile = c->pairs ? (V == 2 ? lp_tile_2 : lp_tile_1) : (V == 2 ? lf_tile_2 : lf_tile_1);
    float *acc = c->scratch + tid * c->scratch_floats; /* [LF_TILES][nt][V][16] */
    float *wbuf = acc + LF_TILES * 28 * 16;            /* [nt][LF_WB] */
    /* as the AMX kernel: ranges of blocks of x across all weights when there are many, else ranges
     * of units; each thread packs the blocks of x it uses */
    int64_t mb_lo = 0, mb_cnt = c->m_blocks, u0, u1;
    if (c->msplit) {
        qk_share(c->m_blocks, tid, nthreads, &mb_lo, &mb_cnt);
        mb_cnt -= mb_lo;
        u0 = 0;
        u1 = c->n_blocks * mb_cnt;
    } else {
        qk_share(c->n_blocks * c->m_blocks, tid, nthreads, &u0, &u1);
    }
    float *xts = c->xt + (int64_t)tid * c->xt_per_thread;
    lf_pack(c, mb_lo, mb_lo + mb_cnt, xts);
    for (int64_t u = u0; u < u1; u++) {
        const int64_t ib = u / mb_cnt, mb = mb_lo + u % mb_cnt, n0 = ib * half, m0 = mb * rows;
        const float *xt = xts + (mb - mb_lo) * c->kp * rows;
        const char *wsrc[LF_NB];
        for (int r = 0; r < nb; r++) { /* rows past N repeat row n0; their results are dropped */
            int64_t n = n0 + r % half;
            if (n >= N) n = n0;
            const int gate = c->swiglu && r >= half;
            wsrc[r] = (const char *)(gate ? a->gate : a->w) + n * (gate ? a->gate_stride : a->w_stride) * esize;
        }
        for (int64_t k0 = 0; k0 < steps || k0 == 0; k0 += LF_KC) {
            const int64_t kc = steps - k0 < LF_KC ? steps - k0 : LF_KC;
            const int last = k0 + LF_KC >= steps; /* the half pair of an odd K ends the last chunk */
            for (int t = 0; t < LF_TILES; t++) {
                /* rows in place when the tile's 12 rows all exist, one stride apart; else (16-bit
                 * weights for fp32, the edge of N) a copy, rows past N repeating the first */
                const int64_t first = n0 + (t * nt) % half;
                const int whole = first + nt <= N;
                const int64_t wsb = (c->swiglu && t * nt >= half ? a->gate_stride : a->w_stride) * esize;
                const char *src = wsrc[t * nt] + k0 * esize * (c->pairs ? 2 : 1);
                if (whole && !conv) {
                    tile(src, wsb, xt + k0 * rows, kc, odd && last, acc + t * nt * V * 16, k0 == 0);
                    continue;
                }
                for (int j = 0; j < nt; j++) {
                    const char *row = wsrc[t * nt + j] + k0 * esize * (c->pairs ? 2 : 1);
                    if (c->pairs) {
                        const int64_t n16 = 2 * kc + (odd && last);
                        for (int64_t k = 0; k < n16; k += 32)
                            _mm512_storeu_si512((char *)(wbuf + j * LF_WB) + k * 2,
                                                _mm512_maskz_loadu_epi16(mask32(n16 - k), row + k * 2));
                    } else {
                        for (int64_t k = 0; k < kc; k += 16)
                            _mm512_storeu_ps(wbuf + j * LF_WB + k, load16(row + k * esize, a->dtype, mask16(kc - k)));
                    }
                }
                tile((const char *)wbuf, LF_WB * 4, xt + k0 * rows, kc, odd && last, acc + t * nt * V * 16, k0 == 0);
            }
            if (steps == 0) break;
        }
        /* acc [weight row][h][16 rows of x]: 16 weight rows at a time transposed into rows of x */
        const int64_t mrows = c->m_rows - m0 < rows ? c->m_rows - m0 : rows;
        for (int h = 0; h < V; h++)
            for (int j0 = 0; j0 < half; j0 += 16) {
                const int64_t cnt = half - j0 < 16 ? half - j0 : 16, ncnt = N - n0 - j0 < cnt ? N - n0 - j0 : cnt;
                if (ncnt <= 0 || h * 16 >= mrows) break;
                __m512 up[16], gate[16];
                for (int q = 0; q < 16; q++) {
                    up[q] = q < cnt ? _mm512_loadu_ps(acc + ((j0 + q) * V + h) * 16) : _mm512_setzero_ps();
                    gate[q] = c->swiglu && q < cnt ? _mm512_loadu_ps(acc + ((half + j0 + q) * V + h) * 16) : up[q];
                }
                transpose16(up);
                if (c->swiglu) transpose16(gate);
                for (int q = 0; q < 16 && h * 16 + q < mrows; q++)
                    epilogue16(a, c->swiglu, c->m_begin + m0 + h * 16 + q, n0 + j0, ncnt, up[q], c->swiglu ? gate[q] : up[q]);
            }
    }
}

/* Few rows of x (M <= LS_MAX_M): the same fma chains with the weights in the lanes instead, 16
 * weight rows transposed in registers per 16 k, and each row of x broadcast; one fma per 16
 * products instead of one per product and block of x rows, for the same bits. */
#define LS_MAX_M 8
#define LS_PREFETCH 512 /* bytes ahead in each weight row */

typedef struct {
    const qk_linear_args *a;
    int swiglu;
    const float *x;     /* [M][x_stride] fp32 */
    const uint32_t *xp; /* pairs: [M][x_stride] pairs of bfloat16, the half pair of an odd K ending in 0 */
    int64_t x_stride, n_blocks;
} ls_ctx;

/* acc[b * M + m] += the products of the 16 weight rows of block b < NB (rows past N repeat the
 * block's first, k past K masked) with the M rows of x, k in increasing order.  Several blocks
 * give the fma chains of a lone row of x something to overlap. */
static inline __attribute__((target(T512_ISA), always_inline)) void
ls_rows(const ls_ctx *c, const char *const *w, int64_t ws, const int64_t *nvalid, int NB, int M, __m512 *acc) {
    const qk_linear_args *a = c->a;
    const int64_t K = a->K;
    const int esize = a->dtype == QK_F32 ? 4 : 2;
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
        const __mmask16 km = mask16(K - k0);
        const int kn = K - k0 < 16 ? (int)(K - k0) : 16;
        for (int b = 0; b < NB; b++) {
            __m512 r[16];
            for (int i = 0; i < 16; i++) {
                const char *row = w[b] + ((i < nvalid[b] ? i : 0) * ws + k0) * esize;
                _mm_prefetch(row + LS_PREFETCH, _MM_HINT_T0);
                r[i] = load16(row, a->dtype, km);
            }
            transpose16(r); /* r[kk]: k0 + kk of the 16 rows */
            for (int kk = 0; kk < kn; kk++)
                for (int m = 0; m < M; m++)
                    acc[b * M + m] = _mm512_fmadd_ps(_mm512_set1_ps(c->x[m * c->x_stride + k0 + kk]), r[kk], acc[b * M + m]);
        }
    }
}

/* ls_rows for bfloat16 pairs (VDPBF16PS): the chains of lf's pairs */
static inline __attribute__((target(T512_ISA ",avx512bf16"), always_inline)) void
lsp_rows(const ls_ctx *c, const char *const *w, int64_t ws, const int64_t *nvalid, int NB, int M, __m512 *acc) {
    const int64_t K = c->a->K, P = (K + 1) / 2;
    for (int64_t p0 = 0; p0 < P; p0 += 16) {
        const __mmask32 km = mask32(K - 2 * p0);
        const int pn = P - p0 < 16 ? (int)(P - p0) : 16;
        for (int b = 0; b < NB; b++) {
            __m512 r[16];
            for (int i = 0; i < 16; i++) {
                const uint16_t *row = (const uint16_t *)w[b] + (i < nvalid[b] ? i : 0) * ws + 2 * p0;
                _mm_prefetch((const char *)row + LS_PREFETCH, _MM_HINT_T0);
                r[i] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(km, row));
            }
            transpose16(r); /* r[pp]: pair p0 + pp of the 16 rows */
            for (int pp = 0; pp < pn; pp++)
                for (int m = 0; m < M; m++)
                    acc[b * M + m] = _mm512_dpbf16_ps(acc[b * M + m],
                                                      (__m512bh)_mm512_set1_epi32((int)c->xp[m * c->x_stride + p0 + pp]),
                                                      (__m512bh)_mm512_castps_si512(r[pp]));
        }
    }
}

#define LS_WORKER(NAME, ATTR, ROWS) \
    ATTR void NAME(void *p, int tid, int nthreads) {                                                           \
        const ls_ctx *c = p;                                                                                   \
        const qk_linear_args *a = c->a;                                                                        \
        const int M = (int)a->M, NB = a->dtype == QK_F32 ? (M <= 4 ? 2 : 1) : (M <= 2 ? 4 : M <= 4 ? 2 : 1);   \
        const int esize = a->dtype == QK_F32 ? 4 : 2;                                                          \
        int64_t u0, u1;                                                                                        \
        qk_share((c->n_blocks + NB - 1) / NB, tid, nthreads, &u0, &u1);                                        \
        for (int64_t u = u0; u < u1; u++) {                                                                    \
            int64_t nvalid[4];                                                                                 \
            const char *wu[4], *wg[4];                                                                         \
            int nb = 0;                                                                                        \
            for (; nb < NB && (u * NB + nb) * 16 < a->N; nb++) {                                               \
                const int64_t n0 = (u * NB + nb) * 16;                                                         \
                nvalid[nb] = a->N - n0 < 16 ? a->N - n0 : 16;                                                  \
                wu[nb] = (const char *)a->w + n0 * a->w_stride * esize;                                        \
                wg[nb] = c->swiglu ? (const char *)a->gate + n0 * a->gate_stride * esize : NULL;               \
            }                                                                                                  \
            __m512 up[LS_MAX_M], gate[LS_MAX_M];                                                               \
            for (int m = 0; m < LS_MAX_M; m++) up[m] = gate[m] = _mm512_setzero_ps();                          \
            for (int h = 0; h <= c->swiglu; h++) {                                                             \
                const char *const *w = h ? wg : wu;                                                            \
                const int64_t ws = h ? a->gate_stride : a->w_stride;                                           \
                __m512 *acc = h ? gate : up;                                                                   \
                if (nb == 4 && M == 1) ROWS(c, w, ws, nvalid, 4, 1, acc);                                      \
                else if (nb == 4 && M == 2) ROWS(c, w, ws, nvalid, 4, 2, acc);                                 \
                else if (nb == 2 && M == 1) ROWS(c, w, ws, nvalid, 2, 1, acc);                                 \
                else if (nb == 2 && M == 2) ROWS(c, w, ws, nvalid, 2, 2, acc);                                 \
                else if (nb == 2 && M == 3) ROWS(c, w, ws, nvalid, 2, 3, acc);                                 \
                else if (nb == 2 && M == 4) ROWS(c, w, ws, nvalid, 2, 4, acc);                                 \
                else                                                                                           \
                    for (int b = 0; b < nb; b++) ROWS(c, w + b, ws, nvalid + b, 1, M, acc + b * M);            \
            }                                                                                                  \
            for (int b = 0; b < nb; b++)                                                                       \
                for (int m = 0; m < M; m++)                                                                    \
                    epilogue16(a, c->swiglu, m, (u * NB + b) * 16, nvalid[b], up[b * M + m], gate[b * M + m]); \
        }                                                                                                      \
    }

LS_WORKER(ls_worker, TFMA, ls_rows)
LS_WORKER(lsp_worker, TBF16, lsp_rows)

static int ls_run(const qk_linear_args *a, int swiglu, int pairs) {
    const int64_t M = a->M, N = a->N, K = a->K;
    ls_ctx c = {.a = a, .swiglu = swiglu, .n_blocks = (N + 15) / 16};
    float *x32 = NULL;
    uint32_t *xp = NULL;
    if (pairs) {
        const int64_t P = (K + 1) / 2;
        xp = malloc(sizeof(uint32_t) * (size_t)M * (size_t)(P > 0 ? P : 1));
        if (!xp) return QK_E_NOMEM;
        for (int64_t m = 0; m < M; m++) {
            const uint16_t *row = (const uint16_t *)a->x + m * a->x_stride;
            for (int64_t q = 0; q < P; q++)
                xp[m * P + q] = row[2 * q] | (2 * q + 1 < K ? (uint32_t)row[2 * q + 1] << 16 : 0u);
        }
        c.xp = xp;
        c.x_stride = P;
    } else if (a->dtype == QK_F32) {
        c.x = a->x;
        c.x_stride = a->x_stride;
    } else {
        x32 = malloc(sizeof(float) * (size_t)M * (size_t)(K > 0 ? K : 1));
        if (!x32) return QK_E_NOMEM;
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k++) x32[m * K + k] = qk_load_f32(a->x, m * a->x_stride + k, a->dtype);
        c.x = x32;
        c.x_stride = K;
    }
    int t = qk_threads_for(M * N * (K > 0 ? K : 1) * (swiglu ? 2 : 1), a->num_threads > 0 ? a->num_threads : 1);
    if (t > c.n_blocks) t = (int)c.n_blocks;
    const int status = qk_parallel_run(t, pairs ? lsp_worker : ls_worker, &c);
    free(x32);
    free(xp);
    return status;
}

static int lf_run(const qk_linear_args *a, int swiglu, int pairs) {
    const int64_t M = a->M, N = a->N, K = a->K;
    if (M <= LS_MAX_M) return ls_run(a, swiglu, pairs);
    lf_ctx c = {.a = a, .swiglu = swiglu, .v = M <= 16 ? 1 : 2, .pairs = pairs};
    const int nb = LF_TILES * LF_NT(c.v), half = swiglu ? nb / 2 : nb, rows = 16 * c.v;
    c.n_blocks = (N + half - 1) / half;
    c.kp = ((pairs ? (K + 1) / 2 : K) + 15) / 16 * 16;
    const int64_t slab = M < LF_MSLAB ? M : LF_MSLAB, slab_blocks = (slab + rows - 1) / rows;
    const int64_t work = M * N * (K > 0 ? K : 1) * (swiglu ? 2 : 1);
    const int max_threads = qk_threads_for(work, a->num_threads > 0 ? a->num_threads : 1);
    int nthreads = max_threads;
    if (nthreads > c.n_blocks * slab_blocks) nthreads = (int)(c.n_blocks * slab_blocks);
    c.scratch_floats = LF_TILES * 28 * 16 + 12 * LF_WB;
    c.scratch = alloc64(sizeof(float) * (size_t)c.scratch_floats * (size_t)nthreads);
    c.xt_per_thread = slab_blocks * rows * (c.kp > 0 ? c.kp : 1);
    c.xt = alloc64(sizeof(float) * (size_t)c.xt_per_thread * (size_t)nthreads);
    if (!c.scratch || !c.xt) {
        free(c.scratch);
        free(c.xt);
        return QK_E_NOMEM;
    }
    int status = QK_OK;
    for (int64_t m0 = 0; m0 < M && status == QK_OK; m0 += LF_MSLAB) {
        c.m_begin = m0;
        c.m_rows = M - m0 < LF_MSLAB ? M - m0 : LF_MSLAB;
        c.m_blocks = (c.m_rows + rows - 1) / rows;
        int t = nthreads;
        if (t > c.n_blocks * c.m_blocks) t = (int)(c.n_blocks * c.m_blocks);
        c.msplit = c.m_blocks >= 4 * t;
        status = qk_parallel_run(t, lf_worker, &c);
    }
    free(c.scratch);
    free(c.xt);
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

/* the bfloat16 bits of v (nearest even, NaN kept quiet: qk_f32_to_bf16) in the low halves */
T512 __m512i bf16_bits(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
}

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
    ax_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
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
    if (isa < QK_CPU_ISA_AVX512 || a->M <= 0 || a->N <= 0) return 0;
    if (a->dtype == QK_BF16 && isa >= QK_CPU_ISA_AMX) *status = ax_run(a, swiglu);
    else if (a->dtype == QK_BF16 && isa >= QK_CPU_ISA_AVX512_BF16) *status = lf_run(a, swiglu, 1);
    else if (a->dtype == QK_F32 || a->dtype == QK_F16 || a->dtype == QK_BF16) *status = lf_run(a, swiglu, 0);
    else return 0;
    return 1;
}

#endif
