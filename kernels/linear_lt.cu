// linear and swiglu past the decode range (M > 64) through cuBLASLt, loaded at run time (the cuda
// backend may call the toolkit's cuBLAS(Lt) for large M; docs/ops.md).  There the product is
// compute-bound and the skinny kernels fall far behind (docs/linear.md); a full-size wgmma GEMM of
// our own is not in scope.
//
// linear: one cublasLtMatmul computing out^T [N, M] (column-major, ld out_stride) = W^T' x^T: W [N, K]
// row-major is the K x N column-major A taken transposed, x [M, K] the K x M column-major B; the
// bias through the BIAS epilogue, added to the fp32 sum before the one rounding.  swiglu: the two
// products in fp32 into scratch, then silu(gate) * up in fp32 and one rounding (lt_swiglu_combine),
// as the other kernels.  Split-K algorithms may reduce only in fp32
// (CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE), never in the output type (lt_plan); workspace and scratch
// come from a->scratch (qk_scratch_alloc: cudaMallocAsync on the caller's stream by default, so graphs
// capture it and concurrent streams never share it).
//
// No cuBLAS header ships with every toolkit image (this machine's has none), so the few ABI pieces
// used are declared below from cublasLt.h's documented values.  The library: the copy already
// loaded (torch's), else QKERNELS_CUBLASLT (a path), else libcublasLt.so.13 by name, else the
// nvidia wheel beside an installed qkernels, else the toolkit's lib64.  Absent or of
// another major version: QK_E_UNSUPPORTED, and linear.cu's tile kernels run.
#include "common.cuh"
#include <dlfcn.h>
#include <glob.h>
#include <initializer_list>
#include <type_traits>
#include <pthread.h>

namespace {

// ---- the cuBLASLt 13 ABI (cublasLt.h) ----------------------------------------------------------
typedef void *LtHandle;
typedef void *LtDesc;
typedef void *LtLayout;
typedef void *LtPref;
struct LtAlgo {
    uint64_t data[8];
};
struct LtHeuristic {
    LtAlgo algo;
    size_t workspace_size;
    int state;
    float waves;
    int reserved[4];
};
enum {
    kLtR32F = 0, kLtR16F = 2, kLtR16BF = 14,   // cudaDataType_t
    kLtCompute32F = 68,                          // cublasComputeType_t
    kLtOpN = 0, kLtOpT = 1,                      // cublasOperation_t
    kLtDescTransA = 3, kLtDescTransB = 4, kLtDescEpilogue = 7, kLtDescBiasPointer = 8,
    kLtDescBiasDataType = 26,                    // cublasLtMatmulDescAttributes_t
    kLtEpilogueDefault = 1, kLtEpilogueBias = 4,
    kLtPrefMaxWorkspace = 1, kLtPrefAlignA = 5,  // .. D = 8
    kLtReduceComputeType = 2,                    // cublasLtReductionScheme_t
    kLtAlgoSplitK = 2, kLtAlgoReduction = 3,     // cublasLtMatmulAlgoConfigAttributes_t
    kLtStatusAllocFailed = 3,
};
constexpr int kLtMajor = 13;

struct LtApi {
    int (*create)(LtHandle *);
    size_t (*version)();
    int (*desc_create)(LtDesc *, int compute, int scale);
    int (*desc_destroy)(LtDesc);
    int (*desc_set)(LtDesc, int attr, const void *buf, size_t n);
    int (*layout_create)(LtLayout *, int type, uint64_t rows, uint64_t cols, int64_t ld);
    int (*layout_destroy)(LtLayout);
    int (*pref_create)(LtPref *);
    int (*pref_destroy)(LtPref);
    int (*pref_set)(LtPref, int attr, const void *buf, size_t n);
    int (*heuristic)(LtHandle, LtDesc, LtLayout, LtLayout, LtLayout, LtLayout, LtPref, int, LtHeuristic *, int *);
    int (*algo_config_get)(const LtAlgo *, int attr, void *buf, size_t n, size_t *written);
    int (*matmul)(LtHandle, LtDesc, const void *, const void *, LtLayout, const void *, LtLayout, const void *,
                  const void *, LtLayout, void *, LtLayout, const LtAlgo *, void *, size_t, cudaStream_t);
};

LtApi g_lt;
bool g_lt_ok = false;
pthread_once_t g_lt_once = PTHREAD_ONCE_INIT;

// The nvidia wheel's copy (what torch, CuPy and JAX install) beside an installed qkernels:
// <site-packages>/nvidia/*/lib/libcublasLt.so.13, site-packages being two levels above this library.
void *lt_open_wheel() {
    Dl_info info;
    if (!dladdr((const void *)&lt_open_wheel, &info) || !info.dli_fname) return nullptr;
    char pattern[4096];
    const char *slash = strrchr(info.dli_fname, '/');
    if (!slash) return nullptr;
    snprintf(pattern, sizeof pattern, "%.*s/../nvidia/*/lib/libcublasLt.so.13", (int)(slash - info.dli_fname), info.dli_fname);
    glob_t g;
    void *h = nullptr;
    if (glob(pattern, 0, nullptr, &g) == 0) {
        for (size_t i = 0; i < g.gl_pathc && !h; i++) h = dlopen(g.gl_pathv[i], RTLD_NOW | RTLD_LOCAL);
        globfree(&g);
    }
    return h;
}

// Set by qk_set_cublaslt_search_cuda before the first launch, read-only after.
char g_lt_library[4096];
char g_lt_roots[8192];

void *lt_open() {
    // One already in the process (torch's) first: a second copy would work but cost memory.
    if (void *h = dlopen("libcublasLt.so.13", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD)) return h;
    if (g_lt_library[0])
        if (void *h = dlopen(g_lt_library, RTLD_NOW | RTLD_LOCAL)) return h;
    if (void *h = dlopen("libcublasLt.so.13", RTLD_NOW | RTLD_LOCAL)) return h;
    if (void *h = lt_open_wheel()) return h;
    char path[4096];
    for (const char *root = g_lt_roots; *root;) {
        const char *end = strchr(root, ':');
        const int len = end ? (int)(end - root) : (int)strlen(root);
        if (len > 0) {
            snprintf(path, sizeof path, "%.*s/lib64/libcublasLt.so.13", len, root);
            if (void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL)) return h;
        }
        root += len + (end != nullptr);
    }
    return dlopen("/usr/local/cuda/lib64/libcublasLt.so.13", RTLD_NOW | RTLD_LOCAL);
}

void lt_load() {
    void *h = lt_open();
    if (!h) return;
    bool ok = true;
    auto sym = [&](auto &fn, const char *name) {
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
        ok = ok && fn != nullptr;
    };
    sym(g_lt.create, "cublasLtCreate");
    sym(g_lt.version, "cublasLtGetVersion");
    sym(g_lt.desc_create, "cublasLtMatmulDescCreate");
    sym(g_lt.desc_destroy, "cublasLtMatmulDescDestroy");
    sym(g_lt.desc_set, "cublasLtMatmulDescSetAttribute");
    sym(g_lt.layout_create, "cublasLtMatrixLayoutCreate");
    sym(g_lt.layout_destroy, "cublasLtMatrixLayoutDestroy");
    sym(g_lt.pref_create, "cublasLtMatmulPreferenceCreate");
    sym(g_lt.pref_destroy, "cublasLtMatmulPreferenceDestroy");
    sym(g_lt.pref_set, "cublasLtMatmulPreferenceSetAttribute");
    sym(g_lt.heuristic, "cublasLtMatmulAlgoGetHeuristic");
    sym(g_lt.algo_config_get, "cublasLtMatmulAlgoConfigGetAttribute");
    sym(g_lt.matmul, "cublasLtMatmul");
    // The declarations above are the 13.x ABI: another major version is not used.
    g_lt_ok = ok && g_lt.version() / 10000 == kLtMajor;
}

// One matmul's descriptors and algorithm, cached by everything the heuristic looked at.  Column-major
// cuBLAS terms: D [m, n] = op(A) [m, k] op(B) [k, n] (+ D), op = transposed where ta / tb is kLtOpT.
struct LtKey {
    int dev, in_type, out_type, bias, ta, tb;
    int64_t m, n, k, lda, ldb, ldd;
    uint32_t align[4];  // A, B, D, bias: the largest power of two (<= 256) dividing the address
    bool operator==(const LtKey &o) const { return memcmp(this, &o, sizeof *this) == 0; }
};
struct LtPlan {
    LtKey key;
    LtDesc desc;
    LtLayout la, lb, ld;
    LtAlgo algo;
    size_t workspace;
};
constexpr int kLtPlans = 64;
LtPlan g_plans[kLtPlans];
int g_nplans = 0, g_next_evict = 0;
constexpr int kLtDevices = 64;
LtHandle g_handles[kLtDevices];
pthread_mutex_t g_lt_mu = PTHREAD_MUTEX_INITIALIZER;

// The largest power of two (<= cap) dividing p's address.
uint32_t lt_align(const void *p, uint32_t cap) {
    const uintptr_t v = (uintptr_t)p;
    uint32_t a = cap;
    while (a > 1 && v % a) a >>= 1;
    return a;
}

void lt_free_plan(LtPlan &p) {  // also a partly built one: what was not created is null
    for (LtLayout l : {p.la, p.lb, p.ld})
        if (l) g_lt.layout_destroy(l);
    if (p.desc) g_lt.desc_destroy(p.desc);
}

// The plan for key (g_lt_mu held): cached, or built and cached; nullptr where cuBLASLt offers none.
LtPlan *lt_plan(const LtKey &k, const void *bias) {
    for (int i = 0; i < g_nplans; i++)
        if (g_plans[i].key == k) return &g_plans[i];
    if (!g_handles[k.dev] && g_lt.create(&g_handles[k.dev])) return nullptr;
    LtPlan p = {};
    p.key = k;
    if (g_lt.desc_create(&p.desc, kLtCompute32F, kLtR32F)) return nullptr;
    const int32_t ta = k.ta, tb = k.tb;
    const uint32_t epi = k.bias ? kLtEpilogueBias : kLtEpilogueDefault;
    const int32_t bias_type = k.out_type;
    bool ok = !g_lt.desc_set(p.desc, kLtDescTransA, &ta, sizeof ta) && !g_lt.desc_set(p.desc, kLtDescTransB, &tb, sizeof tb) &&
              !g_lt.desc_set(p.desc, kLtDescEpilogue, &epi, sizeof epi);
    if (ok && k.bias)  // the heuristic reads the bias address for its alignment
        ok = !g_lt.desc_set(p.desc, kLtDescBiasDataType, &bias_type, sizeof bias_type) &&
             !g_lt.desc_set(p.desc, kLtDescBiasPointer, &bias, sizeof bias);
    const bool an = k.ta == kLtOpN, bn = k.tb == kLtOpN;  // stored as op(.) or transposed
    ok = ok && !g_lt.layout_create(&p.la, k.in_type, (uint64_t)(an ? k.m : k.k), (uint64_t)(an ? k.k : k.m), k.lda) &&
         !g_lt.layout_create(&p.lb, k.in_type, (uint64_t)(bn ? k.k : k.n), (uint64_t)(bn ? k.n : k.k), k.ldb) &&
         !g_lt.layout_create(&p.ld, k.out_type, (uint64_t)k.m, (uint64_t)k.n, k.ldd);
    // The heuristic's best algorithm whose split-K partials (if any) are summed in fp32, never in
    // the output type.  Ranking the unfiltered list and skipping the rest keeps the heuristic's
    // first choice where it qualifies; filtering through the preference's reduction mask instead
    // changes the ranking and gave a worse first choice (docs/linear.md).
    LtPref pref = nullptr;
    LtHeuristic hs[8];
    int found = 0, pick = -1;
    if (ok && !g_lt.pref_create(&pref)) {
        const uint64_t max_ws = 32ull << 20;
        const uint32_t al[4] = {k.align[0], k.align[1], k.align[2], k.align[2]};  // A, B, C = D
        ok = !g_lt.pref_set(pref, kLtPrefMaxWorkspace, &max_ws, sizeof max_ws);
        for (int i = 0; i < 4 && ok; i++) ok = !g_lt.pref_set(pref, kLtPrefAlignA + i, &al[i], sizeof al[i]);
        ok = ok && !g_lt.heuristic(g_handles[k.dev], p.desc, p.la, p.lb, p.ld, p.ld, pref, 8, hs, &found);
        for (int i = 0; ok && i < found && pick < 0; i++) {
            uint32_t splits = 1, scheme = 0;
            size_t w1 = 0, w2 = 0;
            if (hs[i].state || g_lt.algo_config_get(&hs[i].algo, kLtAlgoSplitK, &splits, sizeof splits, &w1) ||
                g_lt.algo_config_get(&hs[i].algo, kLtAlgoReduction, &scheme, sizeof scheme, &w2))
                continue;
            if (splits <= 1 || scheme == kLtReduceComputeType) pick = i;
        }
        g_lt.pref_destroy(pref);
        ok = ok && pick >= 0;
    } else {
        ok = false;
    }
    if (!ok) {
        lt_free_plan(p);
        return nullptr;
    }
    p.algo = hs[pick].algo;
    p.workspace = hs[pick].workspace_size;
    if (g_nplans < kLtPlans) {
        g_plans[g_nplans] = p;
        return &g_plans[g_nplans++];
    }
    LtPlan &slot = g_plans[g_next_evict];  // full: replace round-robin
    g_next_evict = (g_next_evict + 1) % kLtPlans;
    lt_free_plan(slot);
    slot = p;
    return &slot;
}

// D = op(A) op(B) (+ bias, + D when accumulate) on stream, as LtKey describes: 0, a CUDA error, or
// QK_E_UNSUPPORTED where cuBLASLt is absent or declines (nothing was enqueued then).
int lt_run(LtKey k, const void *A, const void *B, void *D, const void *bias, bool accumulate, cudaStream_t stream,
           const qk_scratch *sc) {
    int dev;
    QK_CUDA_TRY(cudaGetDevice(&dev));
    if (dev < 0 || dev >= kLtDevices) return QK_E_UNSUPPORTED;
    k.dev = dev;
    k.bias = bias != nullptr;
    // Scratch sized ahead by a dry run on stand-in pointers (qk_scratch.sized_ahead): the plan, and so
    // its workspace, may depend on alignment only as far as XLA promises it (16 bytes), and the
    // heuristic reads a bias address of exactly that alignment, so the plan is a function of the key.
    const bool ahead = sc && sc->sized_ahead;
    const uint32_t cap = ahead ? 16 : 256;
    k.align[0] = lt_align(A, cap), k.align[1] = lt_align(B, cap), k.align[2] = lt_align(D, cap);
    k.align[3] = bias ? lt_align(bias, cap) : 0;
    const void *plan_bias = ahead && bias ? (const void *)(((uintptr_t)1 << 40) | k.align[3]) : bias;
    pthread_mutex_lock(&g_lt_mu);
    LtPlan *p = lt_plan(k, plan_bias);
    int st = QK_E_UNSUPPORTED;
    if (p) {
        void *ws = nullptr;
        int e = qk_scratch_alloc(sc, p->workspace, stream, &ws);
        if (e == cudaSuccess && bias) e = g_lt.desc_set(p->desc, kLtDescBiasPointer, &bias, sizeof bias) ? cudaErrorInvalidValue : cudaSuccess;
        if (e == cudaSuccess) {
            const float one = 1.f, beta = accumulate ? 1.f : 0.f;
            const int s = g_lt.matmul(g_handles[dev], p->desc, &one, A, p->la, B, p->lb, &beta, D, p->ld, D, p->ld,
                                      &p->algo, ws, p->workspace, stream);
            // A CUDA error is reported; a refusal enqueues nothing: the tile kernels take the call.
            const cudaError_t last = cudaGetLastError();
            if (last != cudaSuccess) st = (int)last;
            else if (s == 0) st = QK_OK;
            else st = s == kLtStatusAllocFailed ? (int)cudaErrorMemoryAllocation : QK_E_UNSUPPORTED;
        } else {
            st = e;
        }
        if (ws) {
            const int f = qk_scratch_free(sc, ws, p->workspace, stream);
            if (st == QK_OK && f != QK_OK) st = f;
        }
    }
    pthread_mutex_unlock(&g_lt_mu);
    return st;
}

LtKey lt_key(int in_dtype, int out_type) {
    LtKey k;
    memset(&k, 0, sizeof k);  // the key is compared bytewise
    k.in_type = in_dtype == QK_BF16 ? kLtR16BF : kLtR16F;
    k.out_type = out_type;
    return k;
}

// out (out_type, ld ldo) = x w^T (+ bias): column-major out^T [N, M] = (W as K x N)^T (x as K x M).
int lt_matmul(const qk_linear_args *a, const void *w, int64_t ldw, void *out, int out_type, int64_t ldo, const void *bias,
              cudaStream_t stream) {
    LtKey k = lt_key(a->dtype, out_type);
    k.ta = kLtOpT, k.tb = kLtOpN;
    k.m = a->N, k.n = a->M, k.k = a->K;
    k.lda = ldw, k.ldb = a->x_stride, k.ldd = ldo;
    return lt_run(k, w, a->x, out, bias, false, stream, a->scratch);
}

// out[m, n] = up * silu(gate) from the two fp32 products ([M, N] each, contiguous), one rounding.
// Rows along y, four columns a thread where N % 4 == 0 and out's rows take 8-byte stores (no 64-bit
// division per element, which a flat index would cost).
template <typename T, bool kVec4>
__global__ void lt_swiglu_combine(const float *up, const float *gate, T *out, int64_t M, int64_t N, int64_t ldo) {
    for (int64_t m = blockIdx.y; m < M; m += gridDim.y) {
        const float *u = up + m * N, *g = gate + m * N;
        T *o = out + m * ldo;
        if (kVec4) {
            for (int64_t n = 4 * ((int64_t)blockIdx.x * blockDim.x + threadIdx.x); n < N; n += 4 * (int64_t)gridDim.x * blockDim.x) {
                const float4 uv = *reinterpret_cast<const float4 *>(u + n), gv = *reinterpret_cast<const float4 *>(g + n);
                const T r[4] = {qk_from_float<T>(qk_silu_mul(uv.x, gv.x)), qk_from_float<T>(qk_silu_mul(uv.y, gv.y)),
                                qk_from_float<T>(qk_silu_mul(uv.z, gv.z)), qk_from_float<T>(qk_silu_mul(uv.w, gv.w))};
                *reinterpret_cast<uint2 *>(o + n) = *reinterpret_cast<const uint2 *>(r);
            }
        } else {
            for (int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; n < N; n += (int64_t)gridDim.x * blockDim.x)
                o[n] = qk_from_float<T>(qk_silu_mul(u[n], g[n]));
        }
    }
}

template <typename T>
int lt_combine(const float *scratch, const qk_linear_args *a, cudaStream_t stream) {
    const int64_t each = a->M * a->N;
    const bool vec = a->N % 4 == 0 && a->out_stride % 4 == 0 && (uintptr_t)a->out % 8 == 0;
    const int64_t per_block = vec ? 1024 : 256;
    const int64_t bx = (a->N + per_block - 1) / per_block;
    const dim3 grid((unsigned)(bx < 1024 ? bx : 1024), (unsigned)(a->M < 65535 ? a->M : 65535));
    T *out = static_cast<T *>(a->out);
    if (vec) lt_swiglu_combine<T, true><<<grid, 256, 0, stream>>>(scratch, scratch + each, out, a->M, a->N, a->out_stride);
    else lt_swiglu_combine<T, false><<<grid, 256, 0, stream>>>(scratch, scratch + each, out, a->M, a->N, a->out_stride);
    return (int)cudaGetLastError();
}

bool lt_shape_ok(const qk_linear_args *a) {
    // cuBLASLt's leading dimensions must cover the rows; the rest goes to the tile kernels.
    return (a->dtype == QK_BF16 || a->dtype == QK_F16) && a->M > 0 && a->N > 0 && a->K > 0 && a->x_stride >= a->K &&
           a->w_stride >= a->K && a->out_stride >= a->N && a->M < (1ll << 31) && a->N < (1ll << 31) && a->K < (1ll << 31);
}

}  // namespace

// M > 64 (the caller decides) through cuBLASLt; QK_E_UNSUPPORTED where it is absent or declines.
extern "C" void qk_set_cublaslt_search_cuda(const char *library, const char *roots) {
    snprintf(g_lt_library, sizeof g_lt_library, "%s", library ? library : "");
    snprintf(g_lt_roots, sizeof g_lt_roots, "%s", roots ? roots : "");
}

extern "C" int qk_linear_lt(const qk_linear_args *a, int swiglu, cudaStream_t stream) {
    pthread_once(&g_lt_once, lt_load);
    if (!g_lt_ok || !lt_shape_ok(a)) return QK_E_UNSUPPORTED;
    if (swiglu && a->gate_stride < a->K) return QK_E_UNSUPPORTED;
    const int out_type = a->dtype == QK_BF16 ? kLtR16BF : kLtR16F;
    if (!swiglu) {
        if (a->bias && a->bias_stride != 1) return QK_E_UNSUPPORTED;  // the epilogue reads a contiguous bias
        return lt_matmul(a, a->w, a->w_stride, a->out, out_type, a->out_stride, a->bias, stream);
    }
    const size_t each = (size_t)a->M * (size_t)a->N;
    float *scratch = nullptr;
    QK_SCRATCH_TRY(a->scratch, 2 * each * sizeof(float), stream, &scratch);
    int st = lt_matmul(a, a->w, a->w_stride, scratch, kLtR32F, a->N, nullptr, stream);
    if (st == QK_OK) st = lt_matmul(a, a->gate, a->gate_stride, scratch + each, kLtR32F, a->N, nullptr, stream);
    if (st == QK_OK) st = a->dtype == QK_BF16 ? lt_combine<__nv_bfloat16>(scratch, a, stream) : lt_combine<__half>(scratch, a, stream);
    const int f = qk_scratch_free(a->scratch, scratch, 2 * each * sizeof(float), stream);
    return st != QK_OK ? st : f;
}

// The backward ops' products past the decode range (linear_backward.cu), in cuBLAS's column-major
// terms: D [m, n] (ld ldd; float32 when out_f32, else in_dtype) = op(A) [m, k] op(B) [k, n], plus D
// when accumulate; transa / transb: 1 where A / B are stored transposed ([k, m] / [n, k]).
// QK_E_UNSUPPORTED where cuBLASLt is absent, declines, or the shape is out of its range (nothing
// enqueued).
extern "C" int qk_linear_lt_gemm(int in_dtype, int transa, int transb, int64_t m, int64_t n, int64_t k, const void *A,
                                 int64_t lda, const void *B, int64_t ldb, void *D, int out_f32, int64_t ldd, int accumulate,
                                 cudaStream_t stream, const qk_scratch *sc) {
    pthread_once(&g_lt_once, lt_load);
    if (!g_lt_ok || (in_dtype != QK_BF16 && in_dtype != QK_F16)) return QK_E_UNSUPPORTED;
    const int64_t lim = 1ll << 31;
    if (m <= 0 || n <= 0 || k <= 0 || m >= lim || n >= lim || k >= lim) return QK_E_UNSUPPORTED;
    if (lda < (transa ? k : m) || ldb < (transb ? n : k) || ldd < m) return QK_E_UNSUPPORTED;
    LtKey key = lt_key(in_dtype, out_f32 ? kLtR32F : in_dtype == QK_BF16 ? kLtR16BF : kLtR16F);
    key.ta = transa ? kLtOpT : kLtOpN, key.tb = transb ? kLtOpT : kLtOpN;
    key.m = m, key.n = n, key.k = k;
    key.lda = lda, key.ldb = ldb, key.ldd = ldd;
    return lt_run(key, A, B, D, nullptr, accumulate != 0, stream, sc);
}
