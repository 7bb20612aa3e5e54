// rotary_emb's rotate-half (NeoX) kernels side by side: the library's (kernels/rotary.cu: each
// thread takes two 16-byte chunks, the lower and the upper half of 8 pairs) and the two it replaced,
// which live only here now:
//   pair   partner lanes: a thread loads one 16-byte chunk of a row and swaps it with the lane that
//          holds the other half of the same 8 pairs (D / 8 a power of two <= 32, so a row's chunks
//          fit one warp);
//   eight  8 bytes of each half per thread (four pairs, no shuffles), D in {64, 128, 256} as a
//          template constant (with a runtime half offset ptxas kept eight row pointers live and
//          spilled the head loop's counter).
// Each is checked bit for bit against a plain one-thread-per-pair kernel (every path does the same
// fp32 operations with the roundings spelled out, ro_lo / ro_hi) and timed with CUDA events.
// docs/rotary_emb.md has the figures; bf16, x [T, H, D] contiguous, freqs [T, D/2, 2] float32.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a benchmarks/probe/rotary_half_variants.cu -o /tmp/rh
//   /tmp/rh [kernel [T H D]]   kernel: 0 reference, 1 two (the library's), 2 pair, 3 eight; none: all
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));     \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

using T = __nv_bfloat16;
constexpr int kThreads = 256;

struct Args {
    const T *x;
    T *out;
    const float *freqs;
    int64_t S, H, D;  // tokens, heads, head dim; rows contiguous
};

// ---- shared helpers (as in kernels/rotary.cu and common.cuh) -----------------------------------

__device__ __forceinline__ float word_half(uint32_t w, int hi) { return __uint_as_float(hi ? w & 0xffff0000u : w << 16); }
__device__ __forceinline__ uint32_t bits(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
__device__ __forceinline__ uint32_t pack(float lo, float hi) { return bits(lo) | (bits(hi) << 16); }
__device__ __forceinline__ uint32_t &word(uint4 &v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }
__device__ __forceinline__ float ro_lo(float e, float o, float c, float s) { return __fmaf_rn(e, c, -__fmul_rn(o, s)); }
__device__ __forceinline__ float ro_hi(float e, float o, float c, float s) { return __fmaf_rn(o, c, __fmul_rn(e, s)); }

__device__ __forceinline__ uint4 load16(const void *p) { return *static_cast<const uint4 *>(p); }
__device__ __forceinline__ void store16(void *p, uint4 v) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ void ld(const void *p, uint2 &v) { v = *static_cast<const uint2 *>(p); }
__device__ __forceinline__ void ld(const void *p, uint4 &v) { v = load16(p); }
__device__ __forceinline__ void st(void *p, uint2 v) {
    asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}
__device__ __forceinline__ void st(void *p, uint4 v) { store16(p, v); }

// The two rotate-half pairs of word wl (lower half) and wh (upper half).
__device__ __forceinline__ void rotate_word_pair(uint32_t &wl, uint32_t &wh, float c0, float s0, float c1, float s1) {
    const float e0 = word_half(wl, 0), o0 = word_half(wh, 0), e1 = word_half(wl, 1), o1 = word_half(wh, 1);
    wl = pack(ro_lo(e0, o0, c0, s0), ro_lo(e1, o1, c1, s1));
    wh = pack(ro_hi(e0, o0, c0, s0), ro_hi(e1, o1, c1, s1));
}
__device__ __forceinline__ void rotate_halves(uint4 &lo, uint4 &hi, const float (&c)[8], const float (&sn)[8]) {
#pragma unroll
    for (int q = 0; q < 4; q++) rotate_word_pair(word(lo, q), word(hi, q), c[2 * q], sn[2 * q], c[2 * q + 1], sn[2 * q + 1]);
}
__device__ __forceinline__ void rotate_halves(uint2 &lo, uint2 &hi, const float (&c)[4], const float (&sn)[4]) {
    rotate_word_pair(lo.x, hi.x, c[0], sn[0], c[1], sn[1]);
    rotate_word_pair(lo.y, hi.y, c[2], sn[2], c[3], sn[3]);
}
// One side of eight pairs whose halves sit in two lanes: own is this lane's chunk, other the partner's.
__device__ __forceinline__ uint4 rotate_half_side(uint4 own, uint4 other, bool upper, const float (&c)[8],
                                                  const float (&sn)[8]) {
    uint4 r;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const uint32_t wl = upper ? word(other, q) : word(own, q), wh = upper ? word(own, q) : word(other, q);
        const float e0 = word_half(wl, 0), o0 = word_half(wh, 0), e1 = word_half(wl, 1), o1 = word_half(wh, 1);
        const int p = 2 * q;
        word(r, q) = upper ? pack(ro_hi(e0, o0, c[p], sn[p]), ro_hi(e1, o1, c[p + 1], sn[p + 1]))
                           : pack(ro_lo(e0, o0, c[p], sn[p]), ro_lo(e1, o1, c[p + 1], sn[p + 1]));
    }
    return r;
}
__device__ __forceinline__ uint4 shfl_xor(unsigned mask, uint4 v, int m) {
    return make_uint4(__shfl_xor_sync(mask, v.x, m), __shfl_xor_sync(mask, v.y, m), __shfl_xor_sync(mask, v.z, m),
                      __shfl_xor_sync(mask, v.w, m));
}
// (cos, sin) of pairs i0 .. i0 + P - 1 of one token (pairs contiguous, 16-byte aligned).
template <int P> __device__ __forceinline__ void load_freqs(const float *f, int64_t i0, float (&c)[P], float (&s)[P]) {
    const float4 *q = reinterpret_cast<const float4 *>(f + 2 * i0);
#pragma unroll
    for (int k = 0; k < P / 2; k++) {
        const float4 v = __ldg(q + k);
        c[2 * k] = v.x;
        s[2 * k] = v.y;
        c[2 * k + 1] = v.z;
        s[2 * k + 1] = v.w;
    }
}

// ---- the reference: one thread per (token, head, pair) ------------------------------------------

__global__ void rotary_ref(Args a) {
    const int64_t half = a.D / 2, n = a.S * a.H * half;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t p = i % half, row = i / half, s = row / a.H;
        const T *x = a.x + row * a.D;
        T *o = a.out + row * a.D;
        const float c = a.freqs[(s * half + p) * 2], sn = a.freqs[(s * half + p) * 2 + 1];
        const float e = __bfloat162float(x[p]), od = __bfloat162float(x[p + half]);
        o[p] = __float2bfloat16_rn(ro_lo(e, od, c, sn));
        o[p + half] = __float2bfloat16_rn(ro_hi(e, od, c, sn));
    }
}

// ---- the variants: the library kernel's decomposition (a block owns tpb tokens; a thread owns chunk
// j of a row and walks heads hs, hs + hpar, ... two at a time), one rotate-half body each -----------

enum { kTwo = 1, kPair = 2, kEight = 3 };

// Rotate-half, P pairs per thread (V: uint2 for P = 4, uint4 for P = 8) of chunk j, heads h and h + hpar.
template <int P, typename V>
__device__ __forceinline__ void half_heads(const T *xt, T *ot, const float *ft, int j, int64_t hs, int64_t H, int hpar,
                                           int64_t D, int64_t half) {
    float c[P], sn[P];
    load_freqs<P>(ft, P * (int64_t)j, c, sn);
    for (int64_t h = hs; h < H; h += 2 * hpar) {
        const bool two = h + hpar < H;
        const T *x0 = xt + h * D + P * j, *x1 = xt + (h + hpar) * D + P * j;
        V lo0, hi0, lo1, hi1;
        ld(x0, lo0);
        ld(x0 + half, hi0);
        lo1 = lo0, hi1 = hi0;
        if (two) {
            ld(x1, lo1);
            ld(x1 + half, hi1);
        }
        rotate_halves(lo0, hi0, c, sn);
        rotate_halves(lo1, hi1, c, sn);
        T *o0 = ot + h * D + P * j, *o1 = ot + (h + hpar) * D + P * j;
        st(o0, lo0);
        st(o0 + half, hi0);
        if (two) {
            st(o1, lo1);
            st(o1 + half, hi1);
        }
    }
}

template <int kMode, int kD = 0>
__global__ void __launch_bounds__(kThreads, kMode == kTwo ? 3 : 4)
    rotary_half(Args a, int nc, int nct, int hpar, int tpb, int64_t ngroups) {
    const int tid = threadIdx.x;
    const int jt = tid % nct, r = tid / nct;
    const int hs = r % hpar, tl = r / hpar;
    if (tl >= tpb) return;
    const int64_t H = a.H, D = kD ? kD : a.D, half = D / 2;
    for (int64_t grp = blockIdx.x; grp < ngroups; grp += gridDim.x) {
        const int64_t s = grp * tpb + tl;
        if (s >= a.S) continue;
        const T *xt = a.x + s * H * D;
        T *ot = a.out + s * H * D;
        const float *ft = a.freqs + s * D;
        for (int j = jt; j < nc; j += nct) {
            if (kMode == kPair) {
                // Chunks j and j ^ (nc / 2) are the two halves of pairs 8 (j % (nc / 2)) .. + 7, held
                // by partner lanes of one warp (nct == nc, a power of two <= 32).
                const int hc = nc / 2;
                const bool upper = j >= hc;
                const unsigned pair = (1u << (tid & 31)) | (1u << ((tid ^ hc) & 31));
                float c[8], sn[8];
                load_freqs<8>(ft, 8 * (int64_t)(j & (hc - 1)), c, sn);
                for (int64_t h = hs; h < H; h += 2 * hpar) {
                    const bool two = h + hpar < H;  // the same for both partners
                    uint4 v0 = load16(xt + h * D + 8 * j), v1 = v0;
                    if (two) v1 = load16(xt + (h + hpar) * D + 8 * j);
                    const uint4 p0 = shfl_xor(pair, v0, hc), p1 = shfl_xor(pair, v1, hc);
                    store16(ot + h * D + 8 * j, rotate_half_side(v0, p0, upper, c, sn));
                    if (two) store16(ot + (h + hpar) * D + 8 * j, rotate_half_side(v1, p1, upper, c, sn));
                }
            } else if (kMode == kEight) {
                half_heads<4, uint2>(xt, ot, ft, j, hs, H, hpar, D, half);  // pairs 4j .. 4j + 3
            } else {
                half_heads<8, uint4>(xt, ot, ft, j, hs, H, hpar, D, half);  // pairs 8j .. 8j + 7
            }
        }
    }
}

// The launch of kernels/rotary.cu (bf16, contiguous): false where the variant does not apply.
bool launch(int mode, const Args &a, int sms, cudaStream_t st) {
    if (mode == 0) {
        rotary_ref<<<sms * 8, kThreads, 0, st>>>(a);
        return true;
    }
    const int64_t c8 = a.D / 8;
    if (a.D % 16 || (mode == kPair && (c8 < 2 || c8 > 32 || (c8 & (c8 - 1)))) ||
        (mode == kEight && a.D != 64 && a.D != 128 && a.D != 256))
        return false;
    const int nc = (int)(mode == kTwo ? a.D / 16 : a.D / 8);
    const int nct = nc < kThreads ? nc : kThreads, per_token = kThreads / nct;
    const int64_t heads = (a.H + 1) / 2;
    const int hpar = (int)(heads < per_token ? heads : per_token), tpb = per_token / hpar;
    const int64_t ngroups = (a.S + tpb - 1) / tpb, cap = (int64_t)sms * 32;
    const unsigned grid = (unsigned)(ngroups < cap ? ngroups : cap);
    if (mode == kTwo) rotary_half<kTwo><<<grid, kThreads, 0, st>>>(a, nc, nct, hpar, tpb, ngroups);
    else if (mode == kPair) rotary_half<kPair><<<grid, kThreads, 0, st>>>(a, nc, nct, hpar, tpb, ngroups);
    else if (a.D == 64) rotary_half<kEight, 64><<<grid, kThreads, 0, st>>>(a, nc, nct, hpar, tpb, ngroups);
    else if (a.D == 128) rotary_half<kEight, 128><<<grid, kThreads, 0, st>>>(a, nc, nct, hpar, tpb, ngroups);
    else rotary_half<kEight, 256><<<grid, kThreads, 0, st>>>(a, nc, nct, hpar, tpb, ngroups);
    return true;
}

int main(int argc, char **argv) {
    static const char *names[] = {"reference", "two (library)", "pair", "eight"};
    const int only = argc > 1 ? atoi(argv[1]) : -1;
    const int64_t S = argc > 4 ? atoll(argv[2]) : 32768, H = argc > 4 ? atoll(argv[3]) : 32,
                  D = argc > 4 ? atoll(argv[4]) : 128;
    if (only < -1 || only > 3 || S < 1 || H < 1 || D < 2 || D % 2) {
        fprintf(stderr, "usage: %s [kernel 0-3 [T H D]]\n", argv[0]);
        return 2;
    }
    int dev, sms;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    const size_t n = (size_t)(S * H * D), nf = (size_t)(S * D);
    std::vector<T> hx(n);
    std::vector<float> hf(nf);
    srand(1);
    for (auto &v : hx) v = __float2bfloat16(2.f * rand() / RAND_MAX - 1.f);
    for (size_t i = 0; i < nf / 2; i++) {
        const float ang = 10.f * rand() / RAND_MAX;
        hf[2 * i] = cosf(ang);
        hf[2 * i + 1] = sinf(ang);
    }
    T *x, *ref, *out;
    float *f;
    CK(cudaMalloc(&x, n * sizeof(T)));
    CK(cudaMalloc(&ref, n * sizeof(T)));
    CK(cudaMalloc(&out, n * sizeof(T)));
    CK(cudaMalloc(&f, nf * sizeof(float)));
    CK(cudaMemcpy(x, hx.data(), n * sizeof(T), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(f, hf.data(), nf * sizeof(float), cudaMemcpyHostToDevice));
    launch(0, Args{x, ref, f, S, H, D}, sms, 0);
    CK(cudaDeviceSynchronize());
    std::vector<T> want(n), got(n);
    CK(cudaMemcpy(want.data(), ref, n * sizeof(T), cudaMemcpyDeviceToHost));

    const double bytes = 2.0 * n * sizeof(T) + nf * sizeof(float);  // x read, out written, the table once
    printf("rotate-half T=%lld H=%lld D=%lld bf16: %.1f MB per call\n", (long long)S, (long long)H, (long long)D,
           bytes / 1e6);
    cudaEvent_t t0, t1;
    CK(cudaEventCreate(&t0));
    CK(cudaEventCreate(&t1));
    for (int mode = 0; mode < 4; mode++) {
        if (only >= 0 && mode != only) continue;
        const Args a{x, out, f, S, H, D};
        CK(cudaMemset(out, 0xff, n * sizeof(T)));  // NaN: every element must be written
        if (!launch(mode, a, sms, 0)) {
            printf("  %-14s does not apply to D = %lld\n", names[mode], (long long)D);
            continue;
        }
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(got.data(), out, n * sizeof(T), cudaMemcpyDeviceToHost));
        size_t bad = 0;
        for (size_t i = 0; i < n; i++) bad += memcmp(&got[i], &want[i], sizeof(T)) != 0;
        const int reps = 50;
        for (int i = 0; i < 5; i++) launch(mode, a, sms, 0);
        CK(cudaEventRecord(t0));
        for (int i = 0; i < reps; i++) launch(mode, a, sms, 0);
        CK(cudaEventRecord(t1));
        CK(cudaEventSynchronize(t1));
        float ms;
        CK(cudaEventElapsedTime(&ms, t0, t1));
        const double us = 1e3 * ms / reps;
        printf("  %-14s %9.1f us %6.2f TB/s  %s (%zu of %zu elements differ from the reference)\n", names[mode], us,
               bytes / us / 1e6, bad ? "FAIL" : "bitwise equal", bad, n);
    }
    CK(cudaFree(x));
    CK(cudaFree(ref));
    CK(cudaFree(out));
    CK(cudaFree(f));
    return 0;
}
