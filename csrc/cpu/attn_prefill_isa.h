/* The instruction-set kernels of the cpu attn_prefill (csrc/cpu/attn_prefill_x86.c), called from the
 * prefill loop of attn.c on its scratch layouts: q transposed [D][Rp] (fp32) or packed in pairs
 * (bf16), scores keys-major [AP_KT][Rp], accumulators [Rp][Dp]; Rp and Dp multiples of 16. */
#ifndef QK_ATTN_PREFILL_ISA_H
#define QK_ATTN_PREFILL_ISA_H

#include <stdint.h>

#define QK_AP_KT 32       /* keys per tile: portable and fma */
#define QK_AP_KT_BF16 128 /* keys per tile: dpbf16 and amx (a multiple of 32) */

enum { /* the prefill's kernel level, fixed per call from the dtype and the instruction set */
    QK_AP_PORTABLE = 0, /* attn.c's plain C (multiversioned), no fused multiply-add */
    QK_AP_FMA,          /* fp32 products with FMA, AVX-512 or AVX2: the same bits (rows in lanes) */
    QK_AP_DPBF16,       /* bfloat16: VDPBF16PS on pairs of d and of keys, fp32 sums */
    QK_AP_AMX,          /* bfloat16: TDPBF16PS tiles, fp32 sums */
};

/* The level for dtype under the cap cpu_isa (0: the machine's best); *wide: AVX-512 (else AVX2). */
int qk_ap_level(int dtype, int cpu_isa, int *wide);

/* FMA level.  st[u][r] = sum_d kr[u][d] qt[d][r], one fma chain over d per score;
 * acc[r] = acc[r] corr[r] + sum_{u < t} pt[u][r] vr[u], one fma chain over u per element. */
void qk_ap_scores_fma(float *st, const float *qt, const float *const *kr, int64_t D, int64_t Rp, int wide);
void qk_ap_pv_fma(float *acc, const float *corr, const float *pt, const float *const *vr, int64_t Rp, int t,
                  int64_t Dp, int wide);

/* bfloat16 levels.  qp: q row r's pairs (d 2p, 2p + 1) at qp[((r / 16) DB + p / 16) 256 + (p % 16) 16
 * + r % 16] (DB = Dp32 / 32, zero past D and the rows); kb [AP_KT][Dp32] the tile's K rows, vb
 * [AP_KT][Dp] its V rows, zero past D and past the tile's keys.  Scores st[u][r] = scale (k_u . q_r)
 * (fp32 sums of exact bf16 products); then acc[r] = acc[r] corr[r] + sum_u bf16(pt[u][r]) vb[u] with
 * the weights rounded to bfloat16 once.  vp [Dp / 16][kt / 2][16] and pp [Rp / 16][kt / 32][16][16]
 * (32-bit pairs) are scratch. */
void qk_ap_pack_q(uint32_t *qp, const uint16_t *const *rows, int64_t D, int64_t Dp32); /* one row tile: 16
                                                                                    rows, NULL: zeros */
void qk_ap_scores_bf16(float *st, const uint32_t *qp, const uint16_t *kb, int64_t Dp32, int64_t Rp, int kt,
                       float scale, int amx);
void qk_ap_pv_bf16(float *acc, const float *corr, const float *pt, const uint16_t *vb, uint32_t *vp, uint32_t *pp,
                   int64_t Rp, int64_t Dp, int kt, int amx);

/* The online-softmax step of attn.c's ap_softmax16 over all Rp rows, for every level but the
 * portable one: its exponential with fused multiply-adds; AVX2 (wide = 0) gives the AVX-512 bits. */
void qk_ap_softmax(float *st, int64_t Rp, int kt, float *m, float *l, float *corr, int wide);

/* AMX: the tile configuration for the calling thread, before its first qk_ap_*_bf16(amx = 1), and
 * the tile state released after its last. */
void qk_ap_amx_begin(void);
void qk_ap_amx_end(void);

#endif
