// How fast can TMA tile copies stream a weight matrix from DRAM on this GPU, and what in the copy
// pattern decides it?  A read-only reference for linear's one-CTA-per-SM kernels: our
// stream-K kernels read 28672x4096 at ~3.75 TB/s where cuBLAS's kernel (TMA, 128 rows x 64 K per
// stage, one CTA per SM) reads it at ~4.13.
//
// One producer thread per CTA issues 2D tensor copies of [R rows][64 bf16] boxes (128-byte swizzle)
// into a ring of S stages; one consumer warp waits for each stage, reads one word of it and frees
// it.  No math.  The matrix is [N, 4096] bf16 with N = G * R * reps (every CTA gets equal bytes),
// two copies used alternately so no call finds the other's bytes in L2.  Orders of work:
//   tile    CTA c walks tiles c, c + G, ... each along all of K (cuBLAS-like)
//   chunk   work cut into chunks of C K-steps of one tile, tile-major; CTA c takes chunks c, c + G, ...
//   kmajor  the same chunks K-chunk-major: neighbouring CTAs read the same K range of neighbouring tiles
//   dynamic chunks claimed from an atomic cursor
// Prints, per configuration, µs (median of 9 single launches, CUDA events, so launch and start-up
// included), TB/s, and the CTAs' stream-time spread (globaltimer, first copy issued to last stage
// consumed): min / median / max µs, and the rate at the median CTA.
//
// H200, 2026-11-30: every order, box height (64-256 rows), depth (48-192 KB) and
// L2 promotion streams alike: 3.7-3.9 TB/s per launch, 4.3-4.5 TB/s at the median CTA, the slowest
// CTA ~2% behind the median (a few finish ~20% early).  So one CTA per SM, each streaming its own
// rows along K, needs no split of K and no dynamic balance: linear_sm90.cu's row kernel.  The first
// version computed each stage's (tile, K step) with 64-bit div/mod in the producer thread, and that
// alone paced it at ~0.5 µs per box (1.95 TB/s with 64-row boxes): keep the producer's loop cheap.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/tma_roofline benchmarks/probe/tma_roofline.cu && /tmp/tma_roofline
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));     \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

constexpr int K = 4096, KB = 64;  // K box: 64 bf16 = one 128-byte line per row
constexpr int MAXS = 32;

struct Plan {
    int R, S, mode, chunk, hint;
    long long tiles, ksteps;
    unsigned long long *cursor;  // mode 3: a fresh zeroed counter per launch
};

__device__ __forceinline__ uint32_t sa(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bar_wait(uint64_t *b, uint32_t parity) {
    uint32_t ok = 0;
    while (!ok)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(ok)
                     : "r"(sa(b)), "r"(parity)
                     : "memory");
}
__device__ __forceinline__ unsigned long long now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// This CTA's work in order, f(tile, k step) per stage; one division per chunk at most (see above).
template <class F> __device__ __forceinline__ void walk(const Plan &p, F f) {
    const long long G = gridDim.x, c = blockIdx.x;
    if (p.mode == 3) {  // chunks claimed from an atomic cursor (producer only: f gets -1 at the end)
        const long long cpt = p.ksteps / p.chunk, nq = p.tiles * cpt;
        long long q = c;
        while (q < nq) {
            const long long next = G + atomicAdd(p.cursor, 1ull);  // claimed while this chunk streams
            const long long t = q / cpt, k0 = (q % cpt) * p.chunk;
            for (int j = 0; j < p.chunk; j++) f(t, k0 + j);
            q = next;
        }
        f(-1, -1);
        return;
    }
    if (p.mode == 0) {
        for (long long t = c; t < p.tiles; t += G)
            for (long long ks = 0; ks < p.ksteps; ks++) f(t, ks);
        return;
    }
    const long long cpt = p.ksteps / p.chunk, nq = p.tiles * cpt;
    for (long long q = c; q < nq; q += G) {
        long long t, k0;
        if (p.mode == 1) t = q / cpt, k0 = (q % cpt) * p.chunk;
        else t = q % p.tiles, k0 = (q / p.tiles) * p.chunk;
        for (int j = 0; j < p.chunk; j++) f(t, k0 + j);
    }
}

__global__ void __launch_bounds__(64, 1)
    stream(const __grid_constant__ CUtensorMap tm, Plan p, unsigned *sink, unsigned long long *times) {
    extern __shared__ unsigned char raw[];
    __shared__ __align__(8) uint64_t full[MAXS], empty[MAXS];
    __shared__ volatile int meta[MAXS];
    unsigned char *ring = (unsigned char *)(((uintptr_t)raw + 1023) & ~(uintptr_t)1023);  // 128B swizzle: 1 KB aligned
    const uint32_t stage_bytes = (uint32_t)p.R * KB * 2;
    if (threadIdx.x == 0) {
        for (int s = 0; s < p.S; s++) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(&full[s])));
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(&empty[s])));
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        uint64_t pol;
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
        times[blockIdx.x * 2] = now();
        int s = 0;
        uint32_t phase = 0;
        bool wrapped = false;
        walk(p, [&](long long tile, long long ks) {
            if (wrapped) bar_wait(&empty[s], phase ^ 1);
            if (tile < 0) {  // mode 3's end: an empty stage marked done
                meta[s] = 1;
                asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sa(&full[s])) : "memory");
                return;
            }
            meta[s] = 0;
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(&full[s])), "r"(stage_bytes)
                         : "memory");
            const int x = (int)(ks * KB), y = (int)(tile * p.R);
            if (p.hint)
                asm volatile(
                    "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
                    " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(sa(ring + (size_t)s * stage_bytes)),
                    "l"((uint64_t)&tm), "r"(x), "r"(y), "r"(sa(&full[s])), "l"(pol)
                    : "memory");
            else
                asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                             " [%0], [%1, {%2, %3}], [%4];" ::"r"(sa(ring + (size_t)s * stage_bytes)),
                             "l"((uint64_t)&tm), "r"(x), "r"(y), "r"(sa(&full[s]))
                             : "memory");
            if (++s == p.S) s = 0, phase ^= 1, wrapped = true;
        });
    } else if (threadIdx.x == 32) {
        unsigned acc = 0;
        int s = 0;
        uint32_t phase = 0, i = 0;
        auto consume = [&](long long, long long) {
            bar_wait(&full[s], phase);
            const bool done = meta[s];
            if (!done) acc ^= *(volatile unsigned *)(ring + (size_t)s * stage_bytes + (i++ & 255) * 4);
            asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sa(&empty[s])) : "memory");
            if (++s == p.S) s = 0, phase ^= 1;
            return done;
        };
        if (p.mode == 3)
            while (!consume(0, 0)) {
            }
        else
            walk(p, consume);
        times[blockIdx.x * 2 + 1] = now();
        if (acc == 0x12345678u) sink[blockIdx.x] = acc;
    }
}

static PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
    void *f = nullptr;
    cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
    return (PFN_cuTensorMapEncodeTiled_v12000)f;
}

static CUtensorMap make_map(void *base, long long N, int R, CUtensorMapL2promotion promo) {
    CUtensorMap tm;
    cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)N}, strides[1] = {(cuuint64_t)K * 2};
    cuuint32_t box[2] = {(cuuint32_t)KB, (cuuint32_t)R}, estr[2] = {1, 1};
    CUresult r = encode_fn()(&tm, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, dims, strides, box, estr,
                             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promo, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "cuTensorMapEncodeTiled failed (%d)\n", (int)r);
        exit(1);
    }
    return tm;
}

int main() {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const long long max_bytes = 320ll << 20;
    void *buf[2];
    for (auto &b : buf) {
        CK(cudaMalloc(&b, max_bytes));
        CK(cudaMemset(b, 1, max_bytes));
    }
    unsigned *sink;
    unsigned long long *times;
    CK(cudaMalloc(&sink, 4096 * 4));
    CK(cudaMalloc(&times, 4096 * 16));
    CK(cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    const char *mode_name[4] = {"tile", "chunk", "kmajor", "dynamic"};
    unsigned long long *cursors;
    CK(cudaMalloc(&cursors, 4096 * 8));
    CK(cudaMemset(cursors, 0, 4096 * 8));
    int launch = 0;
    const CUtensorMapL2promotion promos[3] = {CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B};
    const int promo_b[3] = {0, 128, 256};
    printf("%-7s %5s %4s %4s %6s %5s %4s %9s %7s %28s %8s\n", "order", "chunk", "R", "S", "flight", "promo", "G",
           "us", "TB/s", "CTA us min/med/max", "TB/s@med");
    struct Cfg {
        int mode, chunk, R, flight_kb, promo, gmul, hint;
    };
    std::vector<Cfg> cfgs;
    for (int R : {64, 128, 256})
        for (int fl : {64, 128, 192})
            for (int pr = 0; pr < 3; pr++) cfgs.push_back({0, 1, R, fl, pr, 1, 0});
    for (int R : {128}) {
        for (int fl : {96, 192}) cfgs.push_back({0, 1, R, fl, 2, 1, 1});                 // evict_first hint
        for (int fl : {48, 96}) cfgs.push_back({0, 1, R, fl, 2, 2, 0});                  // 2 CTAs per SM
        for (int c : {4, 8, 16, 32}) cfgs.push_back({1, c, R, 192, 2, 1, 0});            // chunked, tile-major
        for (int c : {8, 16}) cfgs.push_back({2, c, R, 192, 2, 1, 0});                   // K-chunk-major
        for (int c : {2, 4, 8, 16}) cfgs.push_back({3, c, R, 192, 2, 1, 0});             // dynamic claims
        for (int c : {4, 8}) cfgs.push_back({3, c, R, 96, 2, 2, 0});                     // 2 CTAs per SM
    }
    for (int c : {2, 4, 8}) cfgs.push_back({3, c, 256, 192, 2, 1, 0});
    for (const Cfg &c : cfgs) {
        const int G = sms * c.gmul;
        const long long stage = (long long)c.R * KB * 2;
        const int S = (int)std::min<long long>(MAXS, c.flight_kb * 1024ll / stage);
        const long long reps = std::max<long long>(1, max_bytes / ((long long)G * c.R * K * 2));
        const long long N = (long long)G * c.R * reps, bytes = N * K * 2;
        CUtensorMap tm[2] = {make_map(buf[0], N, c.R, promos[c.promo]), make_map(buf[1], N, c.R, promos[c.promo])};
        Plan p{c.R, S, c.mode, c.chunk, c.hint, N / c.R, K / KB, nullptr};
        const size_t smem = (size_t)S * stage + 1024;
        std::vector<float> us;
        std::vector<double> cta_med, cta_min, cta_max;
        for (int it = 0; it < 11; it++) {
            p.cursor = cursors + launch++;
            CK(cudaEventRecord(e0));
            stream<<<G, 64, smem>>>(tm[it & 1], p, sink, times);
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            CK(cudaGetLastError());
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (it < 2) continue;
            us.push_back(ms * 1e3f);
            std::vector<unsigned long long> h(2 * G);
            CK(cudaMemcpy(h.data(), times, 16 * G, cudaMemcpyDeviceToHost));
            std::vector<double> d(G);
            for (int i = 0; i < G; i++) d[i] = (h[2 * i + 1] - h[2 * i]) * 1e-3;
            std::sort(d.begin(), d.end());
            cta_min.push_back(d[0]), cta_med.push_back(d[G / 2]), cta_max.push_back(d[G - 1]);
        }
        auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
        std::sort(us.begin(), us.end());
        const double t = us[us.size() / 2], cm = med(cta_med);
        char spread[64];
        snprintf(spread, sizeof spread, "%.1f / %.1f / %.1f", med(cta_min), cm, med(cta_max));
        char chunk[16];
        snprintf(chunk, sizeof chunk, "%d", c.mode ? c.chunk : K / KB);
        printf("%-7s %5s %4d %4d %5dK %5d %4d %9.1f %7.2f %28s %8.2f%s\n", mode_name[c.mode], chunk, c.R, S,
               (int)(S * stage / 1024), promo_b[c.promo], G, t, bytes / t * 1e-6, spread, bytes / cm * 1e-6,
               c.hint ? " evict_first" : "");
        fflush(stdout);
    }
    return 0;
}
