/* Counter-based random bits for dropout: Philox4x32-10 (Salmon et al., "Parallel random numbers:
 * as easy as 1, 2, 3", SC'11), in plain C usable from both the CPU kernels and CUDA, so that both
 * draw the same mask for the same seed.
 *
 * Element i of a tensor uses word (i % 4) of philox(counter = (i / 4, 0), key = seed): four
 * consecutive elements share one evaluation. */
#ifndef QK_PHILOX_H
#define QK_PHILOX_H

#include <stdint.h>

#ifdef __CUDACC__
#define QK_HD __host__ __device__ __forceinline__
#else
#define QK_HD static inline
#endif

typedef struct {
    uint32_t v[4];
} qk_philox_block;

QK_HD uint32_t qk_mulhilo32(uint32_t a, uint32_t b, uint32_t *hi) {
    uint64_t p = (uint64_t)a * (uint64_t)b;
    *hi = (uint32_t)(p >> 32);
    return (uint32_t)p;
}

QK_HD qk_philox_block qk_philox4x32(uint64_t counter, uint64_t seed) {
    uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = 0, c3 = 0;
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int round = 0; round < 10; round++) {
        uint32_t hi0, hi1;
        uint32_t lo0 = qk_mulhilo32(0xD2511F53u, c0, &hi0);
        uint32_t lo1 = qk_mulhilo32(0xCD9E8D57u, c2, &hi1);
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    qk_philox_block r = {{c0, c1, c2, c3}};
    return r;
}

/* 1 when element `index` survives dropout: its 32-bit draw is at least `threshold` (= p * 2^32). */
QK_HD int qk_dropout_keep(uint64_t seed, uint64_t index, uint32_t threshold) {
    return qk_philox4x32(index >> 2, seed).v[index & 3] >= threshold;
}

#endif
