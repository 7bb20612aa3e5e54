/* AVX-512 helpers shared by the cpu backend's x86-64 kernels (linear_x86.c, attn_prefill_x86.c).
 * Include only where QK_X86_KERNELS is defined (GCC >= 11 or Clang >= 12 on x86-64), after
 * <immintrin.h>; each helper is compiled for the instruction set of the function that inlines it. */
#ifndef QK_X86_SIMD_H
#define QK_X86_SIMD_H

#include <immintrin.h>

#define T512_ISA "avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"
#define T512 static inline __attribute__((target(T512_ISA), always_inline))

/* Load the AMX tile configuration the cpu kernels use, every tile 16 rows x 64 bytes (palette 1),
 * on the calling thread (linear_x86.c); qk_cpu_isa_best() must have granted AMX first. */
void qk_amx_tiles_16x64(void);

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

/* the bfloat16 bits of v (nearest even, NaN kept quiet: qk_f32_to_bf16) in the low halves */
T512 __m512i bf16_bits(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
}

#endif
