// linear_backward and swiglu_backward: bf16/fp16 in, fp32 accumulation, one rounding per gradient.
//
//   grad_x [M, K] = sum over terms p of dy_p [M, N] W_p [N, K]   (linear: dy, W; swiglu: ga, up and gb, gate)
//   grad_w [N, K] = dy^T x                                          (swiglu: ga^T x and gb^T x)
//   grad_b [N]    = the rows of dy summed
//
// In the decode range (M <= 64) these are bandwidth-bound on the weight: grad_x reads W once, grad_w
// writes N x K once, and the rows of dy and x are small and re-read from L2.  Past M = 64 (or with
// _variant="lt") cuBLASLt takes the products (linear_lt.cu), the tile kernels below where it is absent
// or declines.  All products use mma.sync m16n8k16 with fragments from shared memory by ldmatrix:
//
// lb_dgrad (grad_x): computed transposed, grad_x^T [K, M] = W^T dy^T, W as the 16-row A operand
//   (ldmatrix.trans of [32 n][BK k] tiles: the reduction runs along W's rows) and up to 64 rows of dy
//   as the 8-column B operands.  A CTA of 4 warps owns BK = 64 or 128 columns of k (16 or 32 a warp)
//   and one of `nsplit` contiguous ranges of the reduction (the concatenated rows of the terms'
//   weights); a cp.async ring of kStages 32-row steps streams them.  Split partial sums go to an fp32
//   workspace [nsplit, M, K] and lb_finish adds them in split order: no atomics, bitwise reproducible.
// lb_wgrad (grad_w): output-stationary.  A CTA of 8 warps owns a [64 n][128 k] tile of grad_w, loads
//   dy[:, its n] and x[:, its k] 64 rows of M at a time (both through ldmatrix.trans: the reduction
//   runs along their rows), and stores the tile through shared memory in 16-byte rows.  Nothing is
//   split: each output is one chain of mma over M in order.
// lb_fwd (swiglu's a = x up^T, b = x gate^T, fp32): both weights' [64 n][32 k] tiles streamed by a
//   ring like lb_dgrad's, K split over `nsplit` CTAs into fp32 partials; lb_swiglu_ab adds the splits in
//   order and forms ga = dy silu(b), gb = dy a silu'(b), rounded to the input dtype into scratch [M, N]
//   (what the products' tensor cores take, as autograd of the unfused formulation would hold them).
// lb_colsum (grad_b): a thread per column over a range of rows, split ranges added by lb_finish.
//
// Scratch (workspaces, ga / gb) comes from a->scratch (qk_scratch_alloc: the call's scratch result under
// qkernels.jax, else cudaMallocAsync on the caller's stream); grids come from the
// shapes and the SM count only and nothing is read back: CUDA-graph safe.  Rows that are not 16-byte
// vectorisable (K or N % 8, unaligned pointers or strides) are loaded element by element into the same
// tiles (the kVec = false instances).
#include "common.cuh"

extern "C" int qk_linear_lt_gemm(int in_dtype, int transa, int transb, int64_t m, int64_t n, int64_t k, const void *A,
                                 int64_t lda, const void *B, int64_t ldb, void *D, int out_f32, int64_t ldd, int accumulate,
                                 cudaStream_t stream, const qk_scratch *sc);  // linear_lt.cu

namespace {

constexpr int kStages = 4;  // cp.async ring depth of lb_dgrad and lb_fwd
constexpr int kRing = 128;  // their threads: 4 warps

__device__ __forceinline__ uint32_t lb_smem(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared, bypassing L1; valid == false fills zeros (no byte is read).
__device__ __forceinline__ void lb_cp16(uint32_t dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

// Four 8 x 8 b16 matrices; lanes 8q .. 8q + 7 give the row addresses of matrix q, register q receives
// it: lane 4r + w gets row r, elements 2w, 2w + 1 (.trans: column r, rows 2w, 2w + 1).
__device__ __forceinline__ void lb_ldsm(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void lb_ldsm_t(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

template <typename T> __device__ __forceinline__ uint16_t lb_bits(float v);
template <> __device__ __forceinline__ uint16_t lb_bits<__nv_bfloat16>(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}
template <> __device__ __forceinline__ uint16_t lb_bits<__half>(float v) { return __half_as_ushort(__float2half_rn(v)); }

// Up to 64 rows of M per CTA as MT 8-row tiles: 1, 2, 4 or 8.
inline int lb_mt(int64_t M) { return M <= 8 ? 1 : M <= 16 ? 2 : M <= 32 ? 4 : 8; }

// ---- grad_x -----------------------------------------------------------------------------------

// The terms of grad_x: dy_p [M, N] (row stride dys[p]) times W_p [N, K] (row stride ws[p]), p < np.
// The reduction index s runs over [0, np N): term s / N, row s % N.
struct lb_terms {
    const uint16_t *dy[2], *w[2];
    int64_t dys[2], ws[2];
    int np;
};

template <int MT>
struct lb_dcfg {
    static constexpr int WKT = MT >= 4 ? 2 : 1;      // 16-column k tiles per warp: dy fragments serve WKT of them
    static constexpr int BK = 64 * WKT;              // k columns per CTA
    static constexpr int BS = 32;                    // reduction rows per step
    static constexpr int PW = BK + 8;                // padded rows: ldmatrix's 8 row addresses hit 8 bank groups
    static constexpr int PD = BS + 8;
    static constexpr int DROWS = (MT + 1) / 2 * 16;  // dy tile rows (x4 loads take two 8-row tiles)
    static constexpr int kStageW = BS * PW, kStage = kStageW + DROWS * PD;  // elements
    static constexpr size_t kSmem = (size_t)kStages * kStage * 2;
};

template <typename T, int MT, bool kVec>
__global__ void __launch_bounds__(kRing) lb_dgrad(lb_terms tm, int64_t M, int64_t N, int64_t K, int64_t ktiles,
                                                  int nsplit, T *out, int64_t out_stride, float *ws) {
    using C = lb_dcfg<MT>;
    constexpr int WKT = C::WKT, BK = C::BK, BS = C::BS;
    extern __shared__ __align__(16) uint16_t lb_dsm[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t k0 = (int64_t)(blockIdx.x % ktiles) * BK, m0 = (int64_t)(blockIdx.x / ktiles) * 64;
    const int split = blockIdx.y;
    const int64_t S = tm.np * N, steps = (S + BS - 1) / BS;
    const int64_t st0 = steps * split / nsplit, nsteps = steps * (split + 1) / nsplit - st0;
    // the terms by selects, not a dynamically indexed copy of tm (local memory)
    const uint16_t *const w0 = tm.w[0], *const w1 = tm.w[1], *const d0 = tm.dy[0], *const d1 = tm.dy[1];
    const int64_t ws0 = tm.ws[0], ws1 = tm.ws[1], ds0 = tm.dys[0], ds1 = tm.dys[1];
    auto wrow = [&](int64_t s) { return s >= N ? w1 + (s - N) * ws1 : w0 + s * ws0; };    // W row of index s
    auto dyat = [&](int64_t m, int64_t s) { return s >= N ? d1 + m * ds1 + (s - N) : d0 + m * ds0 + s; };

    // One 32-row step into a stage: W_p rows [BS][BK] and dy_p columns [MT * 8][BS], zeros outside.
    auto load = [&](uint16_t *sw, int64_t step) {
        uint16_t *sd = sw + C::kStageW;
        const int64_t s0 = step * BS;
        if (kVec) {
#pragma unroll
            for (int i = 0; i < BS * (BK / 8) / kRing; i++) {
                const int c = tid + i * kRing, r = c / (BK / 8), c8 = c % (BK / 8);
                const int64_t s = s0 + r, k = k0 + 8 * c8;
                const bool ok = s < S && k < K;
                lb_cp16(lb_smem(sw + r * C::PW + 8 * c8), ok ? wrow(s) + k : w0, ok);
            }
#pragma unroll
            for (int i = 0; i < (MT * 8 * (BS / 8) + kRing - 1) / kRing; i++) {
                const int c = tid + i * kRing, r = c / (BS / 8), c8 = c % (BS / 8);
                if (c >= MT * 8 * (BS / 8)) break;
                const int64_t m = m0 + r, s = s0 + 8 * c8;
                const bool ok = m < M && s < S;  // N % 8 == 0: a chunk never straddles two terms
                lb_cp16(lb_smem(sd + r * C::PD + 8 * c8), ok ? dyat(m, s) : d0, ok);
            }
        } else {
            for (int e = tid; e < BS * BK; e += kRing) {
                const int r = e / BK, c = e % BK;
                const int64_t s = s0 + r, k = k0 + c;
                sw[r * C::PW + c] = s < S && k < K ? __ldg(wrow(s) + k) : (uint16_t)0;
            }
            for (int e = tid; e < MT * 8 * BS; e += kRing) {
                const int r = e / BS, c = e % BS;
                const int64_t m = m0 + r, s = s0 + c;
                sd[r * C::PD + c] = m < M && s < S ? __ldg(dyat(m, s)) : (uint16_t)0;
            }
        }
    };

    float acc[WKT][MT][4];
#pragma unroll
    for (int j = 0; j < WKT; j++)
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[j][mt][i] = 0.f;

    const int q = lane >> 3, r8 = lane & 7;
    auto compute = [&](const uint16_t *sw) {
        const uint16_t *sd = sw + C::kStageW;
#pragma unroll
        for (int kk = 0; kk < BS; kk += 16) {
            // A = W^T: [16 k][16 s]; matrix q is the 8 x 8 block (s + 8 (q >> 1), k + 8 (q & 1)), transposed
            uint32_t a[WKT][4];
#pragma unroll
            for (int j = 0; j < WKT; j++)
                lb_ldsm_t(a[j], lb_smem(sw + (kk + 8 * (q >> 1) + r8) * C::PW + (warp * WKT + j) * 16 + 8 * (q & 1)));
#pragma unroll
            for (int mt = 0; mt < MT; mt += 2) {
                // B = dy^T: [16 s][8 m]; matrix q is (m tile mt + (q >> 1), s + 8 (q & 1)), as stored
                uint32_t b[4];
                lb_ldsm(b, lb_smem(sd + ((mt + (q >> 1)) * 8 + r8) * C::PD + kk + 8 * (q & 1)));
#pragma unroll
                for (int j = 0; j < WKT; j++) {
                    qk_mma16816<T>(acc[j][mt], a[j][0], a[j][1], a[j][2], a[j][3], b[0], b[1]);
                    if (mt + 1 < MT) qk_mma16816<T>(acc[j][mt + 1], a[j][0], a[j][1], a[j][2], a[j][3], b[2], b[3]);
                }
            }
        }
    };

    if (kVec) {
        // RD - 1 steps in flight while one is multiplied; the stage refilled at step i was read at i - 1
#pragma unroll
        for (int i = 0; i < kStages - 1; i++) {
            if (i < nsteps) load(lb_dsm + i * C::kStage, st0 + i);
            cp_async_commit();
        }
#pragma unroll 1
        for (int64_t i = 0; i < nsteps; i++) {
            cp_async_wait<kStages - 2>();
            __syncthreads();
            const int64_t next = i + kStages - 1;
            if (next < nsteps) load(lb_dsm + (int)(next % kStages) * C::kStage, st0 + next);
            cp_async_commit();
            compute(lb_dsm + (int)(i % kStages) * C::kStage);
        }
        cp_async_wait<0>();
    } else {
#pragma unroll 1
        for (int64_t i = 0; i < nsteps; i++) {
            __syncthreads();
            load(lb_dsm, st0 + i);
            __syncthreads();
            compute(lb_dsm);
        }
    }

    // c0, c1: (k row g, m columns 2t, 2t + 1); c2, c3: k row g + 8
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < WKT; j++)
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int64_t k = k0 + (warp * WKT + j) * 16 + g + 8 * (i >> 1), m = m0 + mt * 8 + 2 * t + (i & 1);
                if (m >= M || k >= K) continue;
                if (nsplit == 1) out[m * out_stride + k] = qk_from_float<T>(acc[j][mt][i]);
                else ws[(split * M + m) * K + k] = acc[j][mt][i];
            }
}

// out[r * ors + c * ocs] = sum over s < S, in order, of ws[s][r][c]; S = 0 writes zeros.
template <typename T>
__global__ void lb_finish(const float *ws, int S, int64_t R, int64_t C, T *out, int64_t ors, int64_t ocs) {
    const int64_t n = R * C;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        float v = 0.f;
        for (int s = 0; s < S; s++) v += ws[s * n + e];
        out[(e / C) * ors + (e % C) * ocs] = qk_from_float<T>(v);
    }
}

template <typename T>
int lb_finish_run(const float *ws, int S, int64_t R, int64_t C, T *out, int64_t ors, int64_t ocs, cudaStream_t stream) {
    if (R <= 0 || C <= 0) return QK_OK;
    int S_ = S;
    void *args[] = {&ws, &S_, &R, &C, &out, &ors, &ocs};
    return qk_launch((const void *)lb_finish<T>, dim3(qk_grid_for(R * C, 256)), dim3(256), 0, stream, args);
}

// A scratch buffer (qk_scratch_alloc), freed on the stream when the guard goes.
struct lb_scratch {
    void *p = nullptr;
    size_t bytes = 0;
    cudaStream_t stream;
    const qk_scratch *sc;
    lb_scratch(cudaStream_t s, const qk_scratch *hook) : stream(s), sc(hook) {}
    int alloc(size_t n) {
        bytes = n;
        return qk_scratch_alloc(sc, n, stream, &p);
    }
    // the free's status where nothing failed before
    int release(int status) {
        if (!p) return status;
        const int f = qk_scratch_free(sc, p, bytes, stream);
        p = nullptr;
        return status != QK_OK ? status : f;
    }
    ~lb_scratch() { release(QK_OK); }
};

inline bool lb_al16(const void *p) { return ((uintptr_t)p & 15) == 0; }

// grad_x = sum of the terms' products into out [M, K] (row stride out_stride).  forced: a->split.
template <typename T, int MT>
int lb_dgrad_mt(const lb_terms &tm, int64_t M, int64_t N, int64_t K, T *out, int64_t out_stride, int forced,
                cudaStream_t stream, const qk_scratch *sc) {
    using C = lb_dcfg<MT>;
    bool vec = N % 8 == 0 && K % 8 == 0;
    for (int p = 0; p < tm.np; p++)
        vec = vec && lb_al16(tm.w[p]) && lb_al16(tm.dy[p]) && (N == 1 || tm.ws[p] % 8 == 0) &&
              (M == 1 || tm.dys[p] % 8 == 0);
    const void *kernel = vec ? (const void *)lb_dgrad<T, MT, true> : (const void *)lb_dgrad<T, MT, false>;
    int per_sm, sms;
    QK_CUDA_TRY((cudaError_t)qk_kernel_residency(kernel, kRing, C::kSmem, &per_sm));
    QK_CUDA_TRY((cudaError_t)qk_sm_count(&sms));
    const int64_t ktiles = (K + C::BK - 1) / C::BK, mchunks = (M + 63) / 64, base = ktiles * mchunks;
    const int64_t steps = (tm.np * N + C::BS - 1) / C::BS;
    int64_t nsplit;
    if (forced) {
        nsplit = forced;
    } else {
        // Split the reduction until the grid fills the GPU, each split keeping 8 steps and the fp32
        // partials at most an eighth of the weight bytes read.
        nsplit = ((int64_t)sms * per_sm + base - 1) / base;
        const int64_t by_steps = steps / 8, by_bytes = (tm.np * N * K * 2 / 8) / (M * K * 4);
        nsplit = nsplit < by_steps ? nsplit : by_steps;
        nsplit = nsplit < by_bytes ? nsplit : by_bytes;
        nsplit = nsplit < 64 ? nsplit : 64;
    }
    nsplit = nsplit < steps ? nsplit : steps;
    if (nsplit < 1) nsplit = 1;
    if (base > 0x7fffffff) return QK_E_UNSUPPORTED;
    lb_scratch ws(stream, sc);
    if (nsplit > 1) QK_CUDA_TRY((cudaError_t)ws.alloc((size_t)nsplit * M * K * sizeof(float)));
    lb_terms tm_ = tm;
    int64_t M_ = M, N_ = N, K_ = K, kt_ = ktiles, os_ = out_stride;
    int ns_ = (int)nsplit;
    T *out_ = out;
    float *ws_ = (float *)ws.p;
    void *args[] = {&tm_, &M_, &N_, &K_, &kt_, &ns_, &out_, &os_, &ws_};
    int st = qk_launch(kernel, dim3((unsigned)base, (unsigned)nsplit), dim3(kRing), C::kSmem, stream, args);
    if (st == QK_OK && nsplit > 1) st = lb_finish_run<T>(ws_, ns_, M, K, out, out_stride, 1, stream);
    return ws.release(st);
}

template <typename T>
int lb_dgrad_run(const lb_terms &tm, int64_t M, int64_t N, int64_t K, T *out, int64_t out_stride, int forced,
                 cudaStream_t stream, const qk_scratch *sc) {
    if (M <= 0 || K <= 0) return QK_OK;
    if (N <= 0) return lb_finish_run<T>(nullptr, 0, M, K, out, out_stride, 1, stream);  // no terms: zeros
    switch (lb_mt(M)) {
    case 1: return lb_dgrad_mt<T, 1>(tm, M, N, K, out, out_stride, forced, stream, sc);
    case 2: return lb_dgrad_mt<T, 2>(tm, M, N, K, out, out_stride, forced, stream, sc);
    case 4: return lb_dgrad_mt<T, 4>(tm, M, N, K, out, out_stride, forced, stream, sc);
    default: return lb_dgrad_mt<T, 8>(tm, M, N, K, out, out_stride, forced, stream, sc);
    }
}

// ---- grad_w -----------------------------------------------------------------------------------

constexpr int kWThreads = 256;           // 8 warps: 2 along n (32 rows each) x 4 along k (32 columns each)
constexpr int kWN = 64, kWK = 128;       // the output tile
constexpr int kWPD = kWN + 8, kWPX = kWK + 8, kWPO = kWK + 8;  // padded rows of the dy, x and out tiles
constexpr int kWSmem = 64 * kWPD + 64 * kWPX;  // elements: 64 rows of M of dy and x; the out tile reuses them
static_assert(kWN * kWPO <= kWSmem, "the out tile fits in the input tiles' space");

template <typename T, bool kVec>
__global__ void __launch_bounds__(kWThreads) lb_wgrad(const uint16_t *dy, int64_t dys, const uint16_t *x, int64_t xs,
                                                      int64_t M, int64_t N, int64_t K, int64_t ktiles, T *out,
                                                      int64_t os, int vec_out) {
    __shared__ __align__(16) uint16_t sm[kWSmem];
    uint16_t *sdy = sm, *sx = sm + 64 * kWPD;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wn = warp & 1, wk = warp >> 1;
    const int64_t k0 = (int64_t)(blockIdx.x % ktiles) * kWK, n0 = (int64_t)(blockIdx.x / ktiles) * kWN;
    const int q = lane >> 3, r8 = lane & 7;

    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

#pragma unroll 1
    for (int64_t mc = 0; mc < M; mc += 64) {
        const int rows = M - mc < 64 ? (int)(M - mc) : 64, rows16 = (rows + 15) & ~15;  // rows past M load as 0
        if (kVec) {
            for (int c = tid; c < rows16 * (kWN / 8); c += kWThreads) {
                const int r = c / (kWN / 8), c8 = c % (kWN / 8);
                const int64_t m = mc + r, n = n0 + 8 * c8;
                const bool ok = r < rows && n < N;
                lb_cp16(lb_smem(sdy + r * kWPD + 8 * c8), ok ? dy + m * dys + n : dy, ok);
            }
            for (int c = tid; c < rows16 * (kWK / 8); c += kWThreads) {
                const int r = c / (kWK / 8), c8 = c % (kWK / 8);
                const int64_t m = mc + r, k = k0 + 8 * c8;
                const bool ok = r < rows && k < K;
                lb_cp16(lb_smem(sx + r * kWPX + 8 * c8), ok ? x + m * xs + k : x, ok);
            }
            cp_async_commit();
            cp_async_wait<0>();
        } else {
            for (int e = tid; e < rows16 * kWN; e += kWThreads) {
                const int r = e / kWN, c = e % kWN;
                sdy[r * kWPD + c] = r < rows && n0 + c < N ? __ldg(dy + (mc + r) * dys + n0 + c) : (uint16_t)0;
            }
            for (int e = tid; e < rows16 * kWK; e += kWThreads) {
                const int r = e / kWK, c = e % kWK;
                sx[r * kWPX + c] = r < rows && k0 + c < K ? __ldg(x + (mc + r) * xs + k0 + c) : (uint16_t)0;
            }
        }
        __syncthreads();
#pragma unroll 1
        for (int mm = 0; mm < rows16; mm += 16) {
            // A = dy^T: [16 n][16 m]; matrix q is the block (m + 8 (q >> 1), n + 8 (q & 1)), transposed
            uint32_t a[2][4];
#pragma unroll
            for (int i = 0; i < 2; i++)
                lb_ldsm_t(a[i], lb_smem(sdy + (mm + 8 * (q >> 1) + r8) * kWPD + wn * 32 + i * 16 + 8 * (q & 1)));
            // B = x: [16 m][8 k]; matrix q is the block (m + 8 (q & 1), k + 8 (q >> 1)), transposed: two k tiles
#pragma unroll
            for (int jj = 0; jj < 2; jj++) {
                uint32_t b[4];
                lb_ldsm_t(b, lb_smem(sx + (mm + 8 * (q & 1) + r8) * kWPX + wk * 32 + jj * 16 + 8 * (q >> 1)));
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    qk_mma16816<T>(acc[i][2 * jj], a[i][0], a[i][1], a[i][2], a[i][3], b[0], b[1]);
                    qk_mma16816<T>(acc[i][2 * jj + 1], a[i][0], a[i][1], a[i][2], a[i][3], b[2], b[3]);
                }
            }
        }
        __syncthreads();  // before the next rows (or the out tile) overwrite the tiles
    }

    // The tile in the input dtype through shared memory, then 16-byte rows to global memory.
    uint16_t *so = sm;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {  // c0, c1: (n row g, k columns 2t, 2t + 1); c2, c3: row g + 8
                const int nl = wn * 32 + i * 16 + g + 8 * h, kl = wk * 32 + j * 8 + 2 * t;
                const uint32_t v = lb_bits<T>(acc[i][j][2 * h]) | ((uint32_t)lb_bits<T>(acc[i][j][2 * h + 1]) << 16);
                *reinterpret_cast<uint32_t *>(so + nl * kWPO + kl) = v;
            }
    __syncthreads();
    uint16_t *o = reinterpret_cast<uint16_t *>(out);
    for (int c = tid; c < kWN * (kWK / 8); c += kWThreads) {
        const int r = c / (kWK / 8), c8 = c % (kWK / 8);
        const int64_t n = n0 + r, k = k0 + 8 * c8;
        if (n >= N || k >= K) continue;
        const uint16_t *src = so + r * kWPO + 8 * c8;
        if (vec_out && k + 8 <= K) {
            *reinterpret_cast<uint4 *>(o + n * os + k) = *reinterpret_cast<const uint4 *>(src);
        } else {
            for (int e = 0; e < 8 && k + e < K; e++) o[n * os + k + e] = src[e];
        }
    }
}

// out [N, K] (row stride os) = dy^T x: dy [M, N], x [M, K]; M = 0 gives zeros.
template <typename T>
int lb_wgrad_run(const uint16_t *dy, int64_t dys, const uint16_t *x, int64_t xs, int64_t M, int64_t N, int64_t K, T *out,
                 int64_t os, cudaStream_t stream) {
    if (N <= 0 || K <= 0) return QK_OK;
    const bool vec = N % 8 == 0 && K % 8 == 0 && lb_al16(dy) && lb_al16(x) && (M <= 1 || (dys % 8 == 0 && xs % 8 == 0));
    int vec_out = lb_al16(out) && (N == 1 || os % 8 == 0);
    const int64_t ktiles = (K + kWK - 1) / kWK, tiles = ktiles * ((N + kWN - 1) / kWN);
    if (tiles > 0x7fffffff) return QK_E_UNSUPPORTED;
    int64_t dys_ = dys, xs_ = xs, M_ = M, N_ = N, K_ = K, kt_ = ktiles, os_ = os;
    void *args[] = {&dy, &dys_, &x, &xs_, &M_, &N_, &K_, &kt_, &out, &os_, &vec_out};
    const void *kernel = vec ? (const void *)lb_wgrad<T, true> : (const void *)lb_wgrad<T, false>;
    return qk_launch(kernel, dim3((unsigned)tiles), dim3(kWThreads), 0, stream, args);
}

// ---- grad_b -----------------------------------------------------------------------------------

// A thread per column: rows [M split / nsplit, M (split + 1) / nsplit) in order, into out (nsplit == 1)
// or ws[split][n].
template <typename T>
__global__ void lb_colsum(const T *dy, int64_t dys, int64_t M, int64_t N, int nsplit, T *out, int64_t obs, float *ws) {
    const int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    const int split = blockIdx.y;
    const int64_t r0 = M * split / nsplit, r1 = M * (split + 1) / nsplit;
    float acc = 0.f;
    int64_t m = r0;
    for (; m + 4 <= r1; m += 4) {  // four loads in flight, added in row order
        const float v0 = qk_to_float(dy[m * dys + n]), v1 = qk_to_float(dy[(m + 1) * dys + n]);
        const float v2 = qk_to_float(dy[(m + 2) * dys + n]), v3 = qk_to_float(dy[(m + 3) * dys + n]);
        acc = (((acc + v0) + v1) + v2) + v3;
    }
    for (; m < r1; m++) acc += qk_to_float(dy[m * dys + n]);
    if (nsplit == 1) out[n * obs] = qk_from_float<T>(acc);
    else ws[split * N + n] = acc;
}

template <typename T>
int lb_colsum_run(const T *dy, int64_t dys, int64_t M, int64_t N, T *out, int64_t obs, int forced, cudaStream_t stream,
                  const qk_scratch *sc) {
    if (N <= 0) return QK_OK;
    int sms;
    QK_CUDA_TRY((cudaError_t)qk_sm_count(&sms));
    const int64_t bx = (N + 255) / 256;
    int64_t nsplit = forced ? forced : ((int64_t)sms * 8 + bx - 1) / bx;  // ~8 blocks per SM
    const int64_t by_rows = M / 64;  // each split 64 rows or more
    if (!forced) nsplit = nsplit < by_rows ? nsplit : by_rows;
    nsplit = nsplit < 64 ? nsplit : 64;
    if (nsplit > M) nsplit = M;
    if (nsplit < 1) nsplit = 1;
    if (bx > 0x7fffffff) return QK_E_UNSUPPORTED;
    lb_scratch ws(stream, sc);
    if (nsplit > 1) QK_CUDA_TRY((cudaError_t)ws.alloc((size_t)nsplit * N * sizeof(float)));
    int64_t dys_ = dys, M_ = M, N_ = N, obs_ = obs;
    int ns_ = (int)nsplit;
    float *ws_ = (float *)ws.p;
    void *args[] = {&dy, &dys_, &M_, &N_, &ns_, &out, &obs_, &ws_};
    int st = qk_launch((const void *)lb_colsum<T>, dim3((unsigned)bx, (unsigned)nsplit), dim3(256), 0, stream, args);
    if (st == QK_OK && nsplit > 1) st = lb_finish_run<T>(ws_, ns_, 1, N, out, 0, obs, stream);
    return ws.release(st);
}

// ---- swiglu's products and gradients of a and b -------------------------------------------------

template <int MT>
struct lb_fcfg {
    static constexpr int BN = 64;                    // weight rows per CTA: 16 a warp
    static constexpr int BK = 32;                    // k per step
    static constexpr int P = BK + 8;                 // padded rows of every tile
    static constexpr int XROWS = (MT + 1) / 2 * 16;  // x tile rows (x4 loads take two 8-row tiles)
    static constexpr int kStageW = BN * P, kStage = 2 * kStageW + XROWS * P;  // up, gate, x (elements)
    static constexpr size_t kSmem = (size_t)kStages * kStage * 2;
};

// part[split][q][m][n] = sum over split's k of x[m, k] W_q[n, k], q = 0 up, 1 gate (fp32).
template <typename T, int MT, bool kVec>
__global__ void __launch_bounds__(kRing) lb_fwd(const uint16_t *x, int64_t xs, const uint16_t *up, int64_t us,
                                                const uint16_t *gate, int64_t gs, int64_t M, int64_t N, int64_t K,
                                                int64_t ntiles, int nsplit, float *part) {
    using C = lb_fcfg<MT>;
    constexpr int BN = C::BN, BK = C::BK;
    extern __shared__ __align__(16) uint16_t lb_fsm[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t n0 = (int64_t)(blockIdx.x % ntiles) * BN, m0 = (int64_t)(blockIdx.x / ntiles) * 64;
    const int split = blockIdx.y;
    const int64_t steps = (K + BK - 1) / BK;
    const int64_t st0 = steps * split / nsplit, nsteps = steps * (split + 1) / nsplit - st0;

    auto load = [&](uint16_t *sw, int64_t step) {
        uint16_t *sx = sw + 2 * C::kStageW;
        const int64_t kb = step * BK;
        if (kVec) {
#pragma unroll
            for (int i = 0; i < 2 * BN * (BK / 8) / kRing; i++) {
                const int c = tid + i * kRing, qq = c / (BN * (BK / 8)), rem = c % (BN * (BK / 8));
                const int r = rem / (BK / 8), c8 = rem % (BK / 8);
                const int64_t n = n0 + r, k = kb + 8 * c8;
                const bool ok = n < N && k < K;
                const uint16_t *src = qq ? gate + n * gs + k : up + n * us + k;
                lb_cp16(lb_smem(sw + qq * C::kStageW + r * C::P + 8 * c8), ok ? src : up, ok);
            }
#pragma unroll
            for (int i = 0; i < (MT * 8 * (BK / 8) + kRing - 1) / kRing; i++) {
                const int c = tid + i * kRing, r = c / (BK / 8), c8 = c % (BK / 8);
                if (c >= MT * 8 * (BK / 8)) break;
                const int64_t m = m0 + r, k = kb + 8 * c8;
                const bool ok = m < M && k < K;
                lb_cp16(lb_smem(sx + r * C::P + 8 * c8), ok ? x + m * xs + k : x, ok);
            }
        } else {
            for (int e = tid; e < 2 * BN * BK; e += kRing) {
                const int qq = e / (BN * BK), rem = e % (BN * BK), r = rem / BK, c = rem % BK;
                const int64_t n = n0 + r, k = kb + c;
                sw[qq * C::kStageW + r * C::P + c] =
                    n < N && k < K ? __ldg(qq ? gate + n * gs + k : up + n * us + k) : (uint16_t)0;
            }
            for (int e = tid; e < MT * 8 * BK; e += kRing) {
                const int r = e / BK, c = e % BK;
                const int64_t m = m0 + r, k = kb + c;
                sx[r * C::P + c] = m < M && k < K ? __ldg(x + m * xs + k) : (uint16_t)0;
            }
        }
    };

    float acc[2][MT][4];
#pragma unroll
    for (int qq = 0; qq < 2; qq++)
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[qq][mt][i] = 0.f;

    const int q = lane >> 3, r8 = lane & 7;
    auto compute = [&](const uint16_t *sw) {
        const uint16_t *sx = sw + 2 * C::kStageW;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            // A = W_q: [16 n][16 k]; matrix q is the block (n + 8 (q & 1), k + 8 (q >> 1)), as stored
            uint32_t a[2][4];
#pragma unroll
            for (int qq = 0; qq < 2; qq++)
                lb_ldsm(a[qq], lb_smem(sw + qq * C::kStageW + (warp * 16 + 8 * (q & 1) + r8) * C::P + kk + 8 * (q >> 1)));
#pragma unroll
            for (int mt = 0; mt < MT; mt += 2) {
                // B = x^T: [16 k][8 m]; matrix q is (m tile mt + (q >> 1), k + 8 (q & 1)), as stored
                uint32_t b[4];
                lb_ldsm(b, lb_smem(sx + ((mt + (q >> 1)) * 8 + r8) * C::P + kk + 8 * (q & 1)));
#pragma unroll
                for (int qq = 0; qq < 2; qq++) {
                    qk_mma16816<T>(acc[qq][mt], a[qq][0], a[qq][1], a[qq][2], a[qq][3], b[0], b[1]);
                    if (mt + 1 < MT) qk_mma16816<T>(acc[qq][mt + 1], a[qq][0], a[qq][1], a[qq][2], a[qq][3], b[2], b[3]);
                }
            }
        }
    };

    if (kVec) {
#pragma unroll
        for (int i = 0; i < kStages - 1; i++) {
            if (i < nsteps) load(lb_fsm + i * C::kStage, st0 + i);
            cp_async_commit();
        }
#pragma unroll 1
        for (int64_t i = 0; i < nsteps; i++) {
            cp_async_wait<kStages - 2>();
            __syncthreads();
            const int64_t next = i + kStages - 1;
            if (next < nsteps) load(lb_fsm + (int)(next % kStages) * C::kStage, st0 + next);
            cp_async_commit();
            compute(lb_fsm + (int)(i % kStages) * C::kStage);
        }
        cp_async_wait<0>();
    } else {
#pragma unroll 1
        for (int64_t i = 0; i < nsteps; i++) {
            __syncthreads();
            load(lb_fsm, st0 + i);
            __syncthreads();
            compute(lb_fsm);
        }
    }

    // c0, c1: (n row g, m columns 2t, 2t + 1); c2, c3: n row g + 8
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int qq = 0; qq < 2; qq++)
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int64_t n = n0 + warp * 16 + g + 8 * (i >> 1), m = m0 + mt * 8 + 2 * t + (i & 1);
                if (m < M && n < N) part[((int64_t)(split * 2 + qq) * M + m) * N + n] = acc[qq][mt][i];
            }
}

// ga, gb [M, N] (contiguous, the input dtype) from the split products (added in split order) and dy:
// ga = dy silu(b), gb = dy a s (1 + b (1 - s)), s = 1 / (1 + e^-b); the CPU kernel's expression.
template <typename T>
__global__ void lb_swiglu_ab(const float *part, int nsplit, int64_t M, int64_t N, const T *dy, int64_t dys, T *ga, T *gb) {
    const int64_t n_all = M * N;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n_all; e += (int64_t)gridDim.x * blockDim.x) {
        float a = 0.f, b = 0.f;
        for (int s = 0; s < nsplit; s++) {
            a += part[(int64_t)(2 * s) * n_all + e];
            b += part[(int64_t)(2 * s + 1) * n_all + e];
        }
        const int64_t m = e / N, n = e % N;
        const float d = qk_to_float(dy[m * dys + n]);
        const float ex = expf(-b), s = 1.f / (1.f + ex);
        ga[e] = qk_from_float<T>(d * (b / (1.f + ex)));
        gb[e] = qk_from_float<T>(d * a * (s * (1.f + b * (1.f - s))));
    }
}

template <typename T, int MT>
int lb_fwd_mt(const qk_linear_args *a, int forced, float **part, int *nsplit_out, lb_scratch &ps, cudaStream_t stream) {
    using C = lb_fcfg<MT>;
    const int64_t M = a->M, N = a->N, K = a->K;
    const bool vec = K % 8 == 0 && lb_al16(a->x) && lb_al16(a->w) && lb_al16(a->gate) && (M == 1 || a->x_stride % 8 == 0) &&
                     (N == 1 || (a->w_stride % 8 == 0 && a->gate_stride % 8 == 0));
    const void *kernel = vec ? (const void *)lb_fwd<T, MT, true> : (const void *)lb_fwd<T, MT, false>;
    int per_sm, sms;
    QK_CUDA_TRY((cudaError_t)qk_kernel_residency(kernel, kRing, C::kSmem, &per_sm));
    QK_CUDA_TRY((cudaError_t)qk_sm_count(&sms));
    const int64_t ntiles = (N + C::BN - 1) / C::BN, mchunks = (M + 63) / 64, base = ntiles * mchunks;
    const int64_t steps = (K + C::BK - 1) / C::BK;
    int64_t nsplit;
    if (forced) {
        nsplit = forced;
    } else {  // as lb_dgrad: fill the GPU, 8 steps a split, partials within an eighth of the weight bytes
        nsplit = ((int64_t)sms * per_sm + base - 1) / base;
        const int64_t by_steps = steps / 8, by_bytes = (2 * N * K * 2 / 8) / (2 * M * N * 4);
        nsplit = nsplit < by_steps ? nsplit : by_steps;
        nsplit = nsplit < by_bytes ? nsplit : by_bytes;
        nsplit = nsplit < 64 ? nsplit : 64;
    }
    nsplit = nsplit < steps ? nsplit : steps;
    if (nsplit < 1) nsplit = 1;
    if (base > 0x7fffffff) return QK_E_UNSUPPORTED;
    QK_CUDA_TRY((cudaError_t)ps.alloc((size_t)nsplit * 2 * M * N * sizeof(float)));
    *part = (float *)ps.p;
    *nsplit_out = (int)nsplit;
    const uint16_t *x = (const uint16_t *)a->x, *up = (const uint16_t *)a->w, *gate = (const uint16_t *)a->gate;
    int64_t xs = a->x_stride, us = a->w_stride, gs = a->gate_stride, M_ = M, N_ = N, K_ = K, nt_ = ntiles;
    int ns_ = (int)nsplit;
    float *p_ = *part;
    void *args[] = {&x, &xs, &up, &us, &gate, &gs, &M_, &N_, &K_, &nt_, &ns_, &p_};
    return qk_launch(kernel, dim3((unsigned)base, (unsigned)nsplit), dim3(kRing), C::kSmem, stream, args);
}

// ---- the launchers ------------------------------------------------------------------------------

// cuBLASLt for a product from M = min_m on (at any M when forced): on the H200 it matches cuBLAS from
// M = 1 for grad_x and the tile kernels win only grad_weight and swiglu at M = 1 (docs/linear.md).
bool lb_use_lt(const qk_linear_args *a, int64_t min_m) {
    return a->variant == QK_LINEAR_BWD_LT || (a->variant == QK_LINEAR_BWD_AUTO && a->M >= min_m);
}

// In cuBLAS's column-major terms (lt_gemm): a row-major [R, C] matrix with row stride ld is C x R.
template <typename T>
int lb_linear(const qk_linear_args *a, cudaStream_t stream) {
    const int64_t M = a->M, N = a->N, K = a->K;
    const uint16_t *dy = (const uint16_t *)a->grad_out, *x = (const uint16_t *)a->x, *w = (const uint16_t *)a->w;
    const bool lt = lb_use_lt(a, 1), lt_w = lb_use_lt(a, 2);
    int st = QK_OK;
    if (a->grad_x && M > 0 && K > 0) {
        // grad_x^T [K, M] = (W as K x N) (dy as N x M)
        st = lt ? qk_linear_lt_gemm(a->dtype, 0, 0, K, M, N, w, a->w_stride, dy, a->grad_out_stride, a->grad_x, 0,
                                    a->grad_x_stride, 0, stream, a->scratch)
                : QK_E_UNSUPPORTED;
        if (st == QK_E_UNSUPPORTED) {
            lb_terms tm = {{dy, nullptr}, {w, nullptr}, {a->grad_out_stride, 0}, {a->w_stride, 0}, 1};
            st = lb_dgrad_run<T>(tm, M, N, K, (T *)a->grad_x, a->grad_x_stride, a->split, stream, a->scratch);
        }
    }
    if (st == QK_OK && a->grad_w && N > 0 && K > 0) {
        // grad_w^T [K, N] = (x as K x M) (dy as N x M)^T
        st = lt_w && M > 0 ? qk_linear_lt_gemm(a->dtype, 0, 1, K, N, M, x, a->x_stride, dy, a->grad_out_stride, a->grad_w, 0,
                                             a->grad_w_stride, 0, stream, a->scratch)
                         : QK_E_UNSUPPORTED;
        if (st == QK_E_UNSUPPORTED)
            st = lb_wgrad_run<T>(dy, a->grad_out_stride, x, a->x_stride, M, N, K, (T *)a->grad_w, a->grad_w_stride, stream);
    }
    if (st == QK_OK && a->grad_bias)
        st = lb_colsum_run<T>((const T *)a->grad_out, a->grad_out_stride, M, N, (T *)a->grad_bias, a->grad_bias_stride,
                              a->split, stream, a->scratch);
    return st;
}

template <typename T>
int lb_swiglu(const qk_linear_args *a, cudaStream_t stream) {
    const int64_t M = a->M, N = a->N, K = a->K;
    const uint16_t *x = (const uint16_t *)a->x, *up = (const uint16_t *)a->w, *gate = (const uint16_t *)a->gate;
    if (M <= 0 || N <= 0) {  // no terms: zero gradients
        int st = a->grad_x ? lb_finish_run<T>(nullptr, 0, M, K, (T *)a->grad_x, a->grad_x_stride, 1, stream) : QK_OK;
        if (st == QK_OK && a->grad_w) st = lb_finish_run<T>(nullptr, 0, N, K, (T *)a->grad_w, a->grad_w_stride, 1, stream);
        if (st == QK_OK && a->grad_gate)
            st = lb_finish_run<T>(nullptr, 0, N, K, (T *)a->grad_gate, a->grad_gate_stride, 1, stream);
        return st;
    }
    const bool lt = lb_use_lt(a, 2);
    lb_scratch gab(stream, a->scratch);  // ga, gb [M, N]
    QK_CUDA_TRY((cudaError_t)gab.alloc(2 * (size_t)M * N * sizeof(T)));
    T *ga = (T *)gab.p, *gb = ga + M * N;
    int st;
    {
        // a and b in fp32: cuBLASLt's two products, or lb_fwd's split partials
        lb_scratch ps(stream, a->scratch);
        float *part = nullptr;
        int nsplit = 1;
        st = QK_E_UNSUPPORTED;
        if (lt && K > 0) {
            st = ps.alloc(2 * (size_t)M * N * sizeof(float));
            part = (float *)ps.p;
            // a^T [N, M] = (up as K x N)^T (x as K x M), into part[0] (row-major [M, N])
            if (st == QK_OK)
                st = qk_linear_lt_gemm(a->dtype, 1, 0, N, M, K, up, a->w_stride, x, a->x_stride, part, 1, N, 0, stream, a->scratch);
            if (st == QK_OK)
                st = qk_linear_lt_gemm(a->dtype, 1, 0, N, M, K, gate, a->gate_stride, x, a->x_stride, part + M * N, 1, N, 0,
                                       stream, a->scratch);
            if (st == QK_E_UNSUPPORTED) st = ps.release(QK_E_UNSUPPORTED);
        }
        if (st == QK_E_UNSUPPORTED) {
            const int forced = a->split;
            switch (lb_mt(M)) {
            case 1: st = lb_fwd_mt<T, 1>(a, forced, &part, &nsplit, ps, stream); break;
            case 2: st = lb_fwd_mt<T, 2>(a, forced, &part, &nsplit, ps, stream); break;
            case 4: st = lb_fwd_mt<T, 4>(a, forced, &part, &nsplit, ps, stream); break;
            default: st = lb_fwd_mt<T, 8>(a, forced, &part, &nsplit, ps, stream); break;
            }
        }
        if (st == QK_OK) {
            const T *dy = (const T *)a->grad_out;
            int64_t M_ = M, N_ = N, dys = a->grad_out_stride;
            void *args[] = {&part, &nsplit, &M_, &N_, &dy, &dys, &ga, &gb};
            st = qk_launch((const void *)lb_swiglu_ab<T>, dim3(qk_grid_for(M * N, 256)), dim3(256), 0, stream, args);
        }
        st = ps.release(st);
    }
    if (st == QK_OK && a->grad_x && K > 0) {
        st = QK_E_UNSUPPORTED;
        if (lt) {  // grad_x^T [K, M] = (up as K x N)(ga as N x M) + (gate as K x N)(gb as N x M), in fp32
            lb_scratch acc(stream, a->scratch);
            st = acc.alloc((size_t)M * K * sizeof(float));
            float *d = (float *)acc.p;
            if (st == QK_OK)
                st = qk_linear_lt_gemm(a->dtype, 0, 0, K, M, N, up, a->w_stride, ga, N, d, 1, K, 0, stream, a->scratch);
            if (st == QK_OK)
                st = qk_linear_lt_gemm(a->dtype, 0, 0, K, M, N, gate, a->gate_stride, gb, N, d, 1, K, 1, stream, a->scratch);
            if (st == QK_OK) st = lb_finish_run<T>(d, 1, M, K, (T *)a->grad_x, a->grad_x_stride, 1, stream);
            st = acc.release(st);
        }
        if (st == QK_E_UNSUPPORTED) {
            const lb_terms tm = {{(const uint16_t *)ga, (const uint16_t *)gb}, {up, gate}, {N, N},
                                 {a->w_stride, a->gate_stride}, 2};
            st = lb_dgrad_run<T>(tm, M, N, K, (T *)a->grad_x, a->grad_x_stride, a->split, stream, a->scratch);
        }
    }
    for (int qq = 0; qq < 2 && st == QK_OK; qq++) {
        T *out = (T *)(qq ? a->grad_gate : a->grad_w);
        const int64_t os = qq ? a->grad_gate_stride : a->grad_w_stride;
        const uint16_t *g = (const uint16_t *)(qq ? gb : ga);
        if (!out || K <= 0) continue;
        // grad^T [K, N] = (x as K x M) (g as N x M)^T
        st = lt ? qk_linear_lt_gemm(a->dtype, 0, 1, K, N, M, x, a->x_stride, g, N, out, 0, os, 0, stream, a->scratch) : QK_E_UNSUPPORTED;
        if (st == QK_E_UNSUPPORTED) st = lb_wgrad_run<T>(g, N, x, a->x_stride, M, N, K, out, os, stream);
    }
    return gab.release(st);
}

template <bool kSwiglu>
int lb_entry(const qk_linear_args *a, void *stream) {
    if (kSwiglu && a->gate == nullptr && a->N > 0 && a->K > 0) return QK_E_UNSUPPORTED;  // an empty one may be null
    switch (a->dtype) {
    case QK_BF16:
        return kSwiglu ? lb_swiglu<__nv_bfloat16>(a, (cudaStream_t)stream) : lb_linear<__nv_bfloat16>(a, (cudaStream_t)stream);
    case QK_F16: return kSwiglu ? lb_swiglu<__half>(a, (cudaStream_t)stream) : lb_linear<__half>(a, (cudaStream_t)stream);
    default: return QK_E_UNSUPPORTED;  // float32 on cuda is staged through the cpu backend
    }
}

}  // namespace

extern "C" int qk_linear_backward_cuda(const qk_linear_args *a, void *stream) { return lb_entry<false>(a, stream); }

extern "C" int qk_swiglu_backward_cuda(const qk_linear_args *a, void *stream) { return lb_entry<true>(a, stream); }
