// attn_decode / attn_paged_decode: split-KV flash decoding for one query token per sequence.
//
// Work: one CTA per (split of the keys, kv head and group of up to kG query heads, sequence).
// Every K/V row of a kv head is read once for all the query heads that share it (GQA).  The
// split count comes from the shapes only (B, Hkv, Lkv or max_ctx, SM count), never from the
// lengths on the device, so a captured CUDA graph replays correctly when the lengths change;
// splits past a sequence's length do no loads and leave an empty partial.
//
// Inside a CTA, each of the 4 warps streams its own tiles of the split (tile t of the split goes
// to warp t % 4) through a private kStages-deep cp.async pipeline in shared memory: 4 KB of K+V
// per tile (1024/D keys), so about 48 KB per warp are in flight - HBM latency is hidden without
// block-wide barriers.  A key's row is spread over D/8 lanes (16 bytes each); a lane keeps its
// 8 elements of q (pre-scaled by scale*log2 e) for the kG heads in registers, the dot products
// are reduced across those lanes with shuffles, and an online softmax (exp2) updates the lane's
// running max, sum and 8 output elements per head.  At the end the key slots of a warp, then the
// 4 warps, are merged; with one split the CTA writes the output, otherwise fp32 partials
// (max, sum, unnormalised output) go to a workspace and a second kernel combines the splits in a
// fixed order.  Keys that are masked, past the length or at an out-of-range slot are not loaded
// and get probability 0; a sequence with no kept key gives 0.
//
// Paged: key j of sequence b is pool slot req_to_token[req_pool_indices[b], j]; the slots of the
// next tile are loaded one tile ahead so the index load does not stall the pipeline.  With
// new_k/new_v, position len_b - 1 is read from new_k/new_v, and the CTA owning it (head group 0)
// also writes them into the pool.
#include "common.cuh"

#include <math.h>

namespace {

constexpr int kWarps = 4, kThreads = 32 * kWarps;
constexpr int kStages = 4;
constexpr int kTileBytes = 2048;  // of K per tile (and as much of V)

__device__ __forceinline__ int64_t clamp_len(int64_t v, int64_t hi) { return v < 0 ? 0 : (v > hi ? hi : v); }

__device__ __forceinline__ int64_t load_index(const void *p, int dtype, int64_t pos) {
    return dtype == QK_I64 ? (int64_t)__ldg(static_cast<const int64_t *>(p) + pos)
                           : (int64_t)__ldg(static_cast<const int32_t *>(p) + pos);
}

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool valid) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    // src-size 0: nothing is read and the 16 bytes are zero-filled.
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Sequence b's length (keys before any mask).
__device__ __forceinline__ int64_t seq_len(const qk_attn_decode_args &a, int64_t b, bool paged) {
    if (paged) {
        const int64_t lo = load_index(a.kv_indptr, a.indptr_dtype, b * a.indptr_stride);
        const int64_t hi = load_index(a.kv_indptr, a.indptr_dtype, (b + 1) * a.indptr_stride);
        return clamp_len(hi - lo, a.max_ctx);
    }
    if (!a.kv_lens) return a.Lkv;
    return clamp_len(load_index(a.kv_lens, a.kv_lens_dtype, b * a.kv_lens_stride), a.Lkv);
}

// Where key j of the tile comes from: an element offset into k (and one into v), or new_k/new_v.
struct KeySrc {
    int64_t k_off, v_off;
    bool ok;      // kept: inside the split, not masked, valid slot
    bool fresh;   // read from new_k/new_v
};

template <typename T, int D, int kG, bool kPaged>
__global__ void __launch_bounds__(kThreads) decode_split(qk_attn_decode_args a, float *ws, int nsplit, int64_t chunk) {
    constexpr int kLanesPerKey = D / 8;                 // 16-byte chunks per row
    constexpr int kKeysPerPass = 32 / kLanesPerKey;
    constexpr int kTile = kTileBytes / (D * 2);         // keys per tile
    constexpr int kPasses = kTile / kKeysPerPass;       // 4
    constexpr int kRowsPerLane = kTile * kLanesPerKey / 32;  // = kPasses: rows a lane issues per tile
    static_assert(kPasses == 4 && kRowsPerLane == 4, "tile geometry");
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int split = blockIdx.x, b = blockIdx.z;
    const int G = (int)(a.Hq / a.Hkv), groups = (G + kG - 1) / kG;
    const int hk = blockIdx.y / groups, grp = blockIdx.y % groups;
    const int h0 = hk * G + grp * kG;                   // first query head of this CTA
    const int nheads = min(kG, G - grp * kG);

    const int64_t len = seq_len(a, b, kPaged);
    const int64_t ks0 = (int64_t)split * chunk, ks1 = min(ks0 + chunk, len);
    int64_t pool_row = 0;
    bool row_ok = true;
    if (kPaged) {
        pool_row = load_index(a.req_pool_indices, a.rpi_dtype, b * a.rpi_stride);
        row_ok = pool_row >= 0 && pool_row < a.num_requests;
    }
    const bool has_fresh = kPaged && a.new_k != nullptr && row_ok && len > 0;

    // new_k/new_v into the pool, once per (b, hk): by the CTA whose split holds position len - 1.
    if (has_fresh && grp == 0 && ks0 <= len - 1 && len - 1 < ks1 && warp == 0) {
        const int64_t slot = load_index(a.req_to_token, a.r2t_dtype, pool_row * a.r2t_stride[0] + (len - 1) * a.r2t_stride[1]);
        if (slot >= 0 && slot < a.pool_size) {
            const T *nk = static_cast<const T *>(a.new_k) + b * a.new_k_stride[0] + hk * a.new_k_stride[1];
            const T *nv = static_cast<const T *>(a.new_v) + b * a.new_v_stride[0] + hk * a.new_v_stride[1];
            T *pk = static_cast<T *>(a.k) + slot * a.k_stride[1] + hk * a.k_stride[2];
            T *pv = static_cast<T *>(a.v) + slot * a.v_stride[1] + hk * a.v_stride[2];
            for (int i = lane; i < D; i += 32) {
                pk[i] = nk[i];
                pv[i] = nv[i];
            }
        }
    }

    // q for this lane's 8 elements of every head of the group, pre-scaled for exp2.
    const int slot_in_pass = lane / kLanesPerKey, chunk_id = lane % kLanesPerKey;
    float q[kG][8];
    const float qscale = a.scale * 1.4426950408889634f;
#pragma unroll
    for (int g = 0; g < kG; g++) {
        if (g < nheads) {
            const qk_vec<T> v = qk_load_vec(static_cast<const T *>(a.q) + b * a.q_stride[0] + (h0 + g) * a.q_stride[1] + chunk_id * 8);
#pragma unroll
            for (int i = 0; i < 8; i++) q[g][i] = qk_to_float(v.v[i]) * qscale;
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) q[g][i] = 0.f;
        }
    }
    float m[kG], l[kG], acc[kG][8];
#pragma unroll
    for (int g = 0; g < kG; g++) {
        m[g] = -INFINITY;
        l[g] = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) acc[g][i] = 0.f;
    }

    // This warp's pipeline: stage s holds K [kTile][D] then V [kTile][D], and kTile keep flags.
    constexpr int kStageBytes = 2 * kTileBytes + 32;
    unsigned char *wsmem = smem + warp * kStages * kStageBytes;
    const int64_t span = ks1 > ks0 ? ks1 - ks0 : 0;
    const int64_t tiles_total = (span + kTile - 1) / kTile;
    const int ntiles = tiles_total > warp ? (int)((tiles_total - warp + kWarps - 1) / kWarps) : 0;
    const T *kbase = static_cast<const T *>(a.k), *vbase = static_cast<const T *>(a.v);
    const int64_t kh = kPaged ? hk * a.k_stride[2] : b * a.k_stride[0] + hk * a.k_stride[2];
    const int64_t vh = kPaged ? hk * a.v_stride[2] : b * a.v_stride[0] + hk * a.v_stride[2];
    const uint8_t *mask = static_cast<const uint8_t *>(a.mask);

    // The rows this lane issues for tile t: row r_i = (lane + 32 i) / kLanesPerKey, i < 4.
    auto key_source = [&](int t, int i) -> KeySrc {
        const int r = (lane + 32 * i) / kLanesPerKey;
        const int64_t j = ks0 + ((int64_t)t * kWarps + warp) * kTile + r;
        KeySrc s = {0, 0, false, false};
        if (j >= ks1) return s;
        if (mask && !mask[b * a.mask_stride[0] + j * a.mask_stride[1]]) return s;
        if (kPaged) {
            if (!row_ok) return s;
            if (has_fresh && j == len - 1) {
                s.ok = s.fresh = true;
                return s;
            }
            const int64_t slot = load_index(a.req_to_token, a.r2t_dtype, pool_row * a.r2t_stride[0] + j * a.r2t_stride[1]);
            if (slot < 0 || slot >= a.pool_size) return s;
            s.k_off = slot * a.k_stride[1] + kh;
            s.v_off = slot * a.v_stride[1] + vh;
        } else {
            s.k_off = j * a.k_stride[1] + kh;
            s.v_off = j * a.v_stride[1] + vh;
        }
        s.ok = true;
        return s;
    };
    const T *fresh_k = has_fresh ? static_cast<const T *>(a.new_k) + b * a.new_k_stride[0] + hk * a.new_k_stride[1] : nullptr;
    const T *fresh_v = has_fresh ? static_cast<const T *>(a.new_v) + b * a.new_v_stride[0] + hk * a.new_v_stride[1] : nullptr;
    auto issue = [&](int t, const KeySrc (&src)[kRowsPerLane]) {
        unsigned char *st = wsmem + (t % kStages) * kStageBytes;
        T *sk = reinterpret_cast<T *>(st), *sv = reinterpret_cast<T *>(st + kTileBytes);
        uint8_t *keep = st + 2 * kTileBytes;
#pragma unroll
        for (int i = 0; i < kRowsPerLane; i++) {
            const int idx = lane + 32 * i, r = idx / kLanesPerKey, c = idx % kLanesPerKey;
            const T *gk = src[i].fresh ? fresh_k : kbase + src[i].k_off;
            const T *gv = src[i].fresh ? fresh_v : vbase + src[i].v_off;
            cp_async16(sk + r * D + c * 8, src[i].ok ? gk + c * 8 : kbase, src[i].ok);
            cp_async16(sv + r * D + c * 8, src[i].ok ? gv + c * 8 : vbase, src[i].ok);
            if (c == 0) keep[r] = src[i].ok;
        }
    };

    KeySrc next[kRowsPerLane];
    // Prologue: tiles 0 .. kStages-2 in flight; sources of tile kStages-1 loaded.
#pragma unroll
    for (int t = 0; t < kStages - 1; t++) {
        if (t < ntiles) {
            KeySrc src[kRowsPerLane];
#pragma unroll
            for (int i = 0; i < kRowsPerLane; i++) src[i] = key_source(t, i);
            issue(t, src);
        }
        cp_async_commit();
    }
#pragma unroll
    for (int i = 0; i < kRowsPerLane; i++) next[i] = key_source(kStages - 1, i);

    for (int t = 0; t < ntiles; t++) {
        if (t + kStages - 1 < ntiles) issue(t + kStages - 1, next);
        cp_async_commit();
        if (t + kStages < ntiles) {
#pragma unroll
            for (int i = 0; i < kRowsPerLane; i++) next[i] = key_source(t + kStages, i);
        }
        cp_async_wait<kStages - 1>();
        __syncwarp();
        const unsigned char *st = wsmem + (t % kStages) * kStageBytes;
        const T *sk = reinterpret_cast<const T *>(st), *sv = reinterpret_cast<const T *>(st + kTileBytes);
        const uint8_t *keep = st + 2 * kTileBytes;
#pragma unroll
        for (int p = 0; p < kPasses; p++) {
            const int r = p * kKeysPerPass + slot_in_pass;
            const bool kept = keep[r];
            const qk_vec<T> kv = *reinterpret_cast<const qk_vec<T> *>(sk + r * D + chunk_id * 8);
            float kf[8];
#pragma unroll
            for (int i = 0; i < 8; i++) kf[i] = qk_to_float(kv.v[i]);
            float s[kG];
#pragma unroll
            for (int g = 0; g < kG; g++) {
                float d = 0.f;
#pragma unroll
                for (int i = 0; i < 8; i++) d = fmaf(q[g][i], kf[i], d);
#pragma unroll
                for (int o = kLanesPerKey / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                s[g] = d;
            }
            if (!kept) continue;  // uniform over the key's lanes
            const qk_vec<T> vv = *reinterpret_cast<const qk_vec<T> *>(sv + r * D + chunk_id * 8);
            float vf[8];
#pragma unroll
            for (int i = 0; i < 8; i++) vf[i] = qk_to_float(vv.v[i]);
#pragma unroll
            for (int g = 0; g < kG; g++) {
                const float mn = fmaxf(m[g], s[g]);
                const float alpha = exp2f(m[g] - mn);  // m = -inf the first time: 0
                const float pr = exp2f(s[g] - mn);
                m[g] = mn;
                l[g] = l[g] * alpha + pr;
#pragma unroll
                for (int i = 0; i < 8; i++) acc[g][i] = fmaf(pr, vf[i], acc[g][i] * alpha);
            }
        }
        __syncwarp();  // the stage is refilled by the next iteration's issue
    }
    cp_async_wait<0>();

    // Merge the key slots of the warp (lanes with the same chunk hold the same elements).
#pragma unroll
    for (int o = kLanesPerKey; o < 32; o <<= 1) {
#pragma unroll
        for (int g = 0; g < kG; g++) {
            const float mo = __shfl_xor_sync(0xffffffffu, m[g], o), lo = __shfl_xor_sync(0xffffffffu, l[g], o);
            const float mn = fmaxf(m[g], mo);
            const float x = mn == -INFINITY ? 0.f : exp2f(m[g] - mn), y = mn == -INFINITY ? 0.f : exp2f(mo - mn);
            l[g] = l[g] * x + lo * y;
#pragma unroll
            for (int i = 0; i < 8; i++) acc[g][i] = acc[g][i] * x + __shfl_xor_sync(0xffffffffu, acc[g][i], o) * y;
            m[g] = mn;
        }
    }
    // Merge the warps through shared memory (the pipeline buffers are free now).
    __syncthreads();
    float *red = reinterpret_cast<float *>(smem);  // [kWarps][kG][D + 2]
    if (lane < kLanesPerKey) {
#pragma unroll
        for (int g = 0; g < kG; g++) {
            float *r = red + (warp * kG + g) * (D + 2);
#pragma unroll
            for (int i = 0; i < 8; i++) r[chunk_id * 8 + i] = acc[g][i];
            if (chunk_id == 0) {
                r[D] = m[g];
                r[D + 1] = l[g];
            }
        }
    }
    __syncthreads();
    // Thread x of the CTA finishes element (g, d) pairs in a fixed order.
    for (int e = threadIdx.x; e < kG * D; e += kThreads) {
        const int g = e / D, d = e % D;
        if (g >= nheads) continue;
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < kWarps; w++) mx = fmaxf(mx, red[(w * kG + g) * (D + 2) + D]);
        float sum = 0.f, val = 0.f;
        if (mx != -INFINITY) {
#pragma unroll
            for (int w = 0; w < kWarps; w++) {
                const float *r = red + (w * kG + g) * (D + 2);
                const float f = exp2f(r[D] - mx);
                sum += r[D + 1] * f;
                val += r[d] * f;
            }
        }
        const int h = h0 + g;
        if (nsplit == 1) {
            T *o = static_cast<T *>(a.out) + b * a.out_stride[0] + h * a.out_stride[1];
            o[d] = qk_from_float<T>(sum > 0.f ? val / sum : 0.f);
        } else {
            // Partials: [B][Hq][nsplit] x (D values, max, sum)
            float *p = ws + (((int64_t)b * a.Hq + h) * nsplit + split) * (D + 2);
            p[d] = val;
            if (d == 0) {
                p[D] = mx;
                p[D + 1] = sum;
            }
        }
    }
}

// One warp per (b, query head): the splits' partials in split order.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) decode_combine(qk_attn_decode_args a, const float *ws, int nsplit) {
    const int64_t row = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (row >= a.B * a.Hq) return;
    const int lane = threadIdx.x & 31;
    const int64_t b = row / a.Hq, h = row % a.Hq;
    const float *p = ws + row * nsplit * (D + 2);
    float mx = -INFINITY;
    for (int s = 0; s < nsplit; s++) mx = fmaxf(mx, p[s * (D + 2) + D]);
    constexpr int kPer = (D + 31) / 32;
    float val[kPer] = {}, sum = 0.f;
    if (mx != -INFINITY) {
        for (int s = 0; s < nsplit; s++) {
            const float *ps = p + s * (D + 2);
            const float f = exp2f(ps[D] - mx);  // empty split: exp2(-inf) = 0
            sum += ps[D + 1] * f;
#pragma unroll
            for (int i = 0; i < kPer; i++)
                if (lane + 32 * i < D) val[i] += ps[lane + 32 * i] * f;
        }
    }
    T *o = static_cast<T *>(a.out) + b * a.out_stride[0] + h * a.out_stride[1];
#pragma unroll
    for (int i = 0; i < kPer; i++)
        if (lane + 32 * i < D) o[lane + 32 * i] = qk_from_float<T>(sum > 0.f ? val[i] / sum : 0.f);
}

template <typename T, int D, int kG, bool kPaged>
int launch(const qk_attn_decode_args *a, cudaStream_t s, int sms) {
    const int G = (int)(a->Hq / a->Hkv), groups = (G + kG - 1) / kG;
    const int64_t units = a->B * a->Hkv * groups;
    const int64_t lcap = a->paged ? a->max_ctx : a->Lkv;
    constexpr int kTile = kTileBytes / (D * 2);
    const size_t smem = (size_t)kWarps * kStages * (2 * kTileBytes + 32);
    static_assert((size_t)kWarps * kG * (D + 2) * 4 <= (size_t)kWarps * kStages * (2 * kTileBytes + 32), "merge fits");
    // Per device (the attribute belongs to the device's module): the shared-memory opt-in and how
    // many CTAs fit on an SM.
    static int resident[64];
    int dev;
    QK_CUDA_TRY(cudaGetDevice(&dev));
    if (dev < 0 || dev >= 64) return QK_E_UNSUPPORTED;
    if (!resident[dev]) {
        QK_CUDA_TRY(cudaFuncSetAttribute(decode_split<T, D, kG, kPaged>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        int n = 0;
        QK_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, decode_split<T, D, kG, kPaged>, kThreads, smem));
        resident[dev] = n > 0 ? n : 1;
    }
    // Splits: enough CTAs to fill the chip, rounded so the last wave is nearly full (B=64 L=8k
    // without splits is 512 CTAs on 396 slots: 1.3 waves), and each warp at least 2 tiles.
    const int64_t slots = (int64_t)resident[dev] * sms;
    const int64_t max_split = lcap > 0 ? (lcap + 2 * kWarps * kTile - 1) / (2 * kWarps * kTile) : 1;
    int64_t nsplit = (slots + units - 1) / units;
    if (nsplit > max_split) nsplit = max_split;
    for (int64_t ns = nsplit; ns <= max_split && ns <= 4 * nsplit && ns <= 1024; ns++) {
        const int64_t ctas = units * ns, waves = (ctas + slots - 1) / slots;
        if (ctas * 10 >= waves * slots * 9) {  // at least 90% of the last wave busy
            nsplit = ns;
            break;
        }
    }
    if (nsplit < 1) nsplit = 1;
    if (nsplit > 1024) nsplit = 1024;
    const int64_t chunk = lcap > 0 ? (lcap + nsplit - 1) / nsplit : 1;
    float *ws = nullptr;
    if (nsplit > 1) QK_CUDA_TRY(cudaMallocAsync((void **)&ws, (size_t)(a->B * a->Hq * nsplit * (D + 2)) * sizeof(float), s));
    qk_attn_decode_args p = *a;
    int ns = (int)nsplit;
    int64_t ch = chunk;
    void *args[] = {&p, &ws, &ns, &ch};
    int status = qk_launch((const void *)decode_split<T, D, kG, kPaged>,
                           dim3((unsigned)nsplit, (unsigned)(a->Hkv * groups), (unsigned)a->B), dim3(kThreads), smem, s, args);
    if (nsplit > 1) {
        if (!status) {
            void *cargs[] = {&p, &ws, &ns};
            status = qk_launch((const void *)decode_combine<T, D>, dim3((unsigned)((a->B * a->Hq + kWarps - 1) / kWarps)),
                               dim3(kThreads), 0, s, cargs);
        }
        const int freed = (int)cudaFreeAsync(ws, s);
        if (!status) status = freed;
    }
    return status;
}

template <typename T, int D, bool kPaged>
int pick_group(const qk_attn_decode_args *a, cudaStream_t s, int sms) {
    const int64_t G = a->Hq / a->Hkv;
    if (G <= 1) return launch<T, D, 1, kPaged>(a, s, sms);
    if (G <= 2) return launch<T, D, 2, kPaged>(a, s, sms);
    if (G <= 4) return launch<T, D, 4, kPaged>(a, s, sms);
    return launch<T, D, 8, kPaged>(a, s, sms);
}

template <typename T, bool kPaged>
int pick_dim(const qk_attn_decode_args *a, cudaStream_t s, int sms) {
    switch (a->D) {
    case 32: return pick_group<T, 32, kPaged>(a, s, sms);
    case 64: return pick_group<T, 64, kPaged>(a, s, sms);
    case 128: return pick_group<T, 128, kPaged>(a, s, sms);
    case 256: return pick_group<T, 256, kPaged>(a, s, sms);
    default: return QK_E_UNSUPPORTED;
    }
}

bool aligned_rows(const void *p, const int64_t *strides, int n) {
    if (!qk_aligned16(p)) return false;
    for (int i = 0; i < n; i++)
        if (strides[i] % 8) return false;  // in elements: 16 bytes of bf16/fp16
    return true;
}

}  // namespace

extern "C" int qk_attn_decode_cuda(const qk_attn_decode_args *a, void *stream) {
    if (a->B == 0 || a->Hq == 0) return QK_OK;
    if (a->Hkv <= 0 || a->Hq % a->Hkv || a->B > 65535 || a->Hq > 65535) return QK_E_UNSUPPORTED;  // grid y/z limits
    // 16-byte rows everywhere: q, out, k, v (and new_k/new_v).  The binding keeps the last dim
    // unit-stride; other layouts have no kernel.
    const int64_t ks[3] = {a->paged ? 0 : a->k_stride[0], a->k_stride[1], a->k_stride[2]};
    const int64_t vs[3] = {a->paged ? 0 : a->v_stride[0], a->v_stride[1], a->v_stride[2]};
    if (!aligned_rows(a->q, a->q_stride, 2) || !aligned_rows(a->k, ks, 3) || !aligned_rows(a->v, vs, 3))
        return QK_E_UNSUPPORTED;
    if (a->new_k && (!aligned_rows(a->new_k, a->new_k_stride, 2) || !aligned_rows(a->new_v, a->new_v_stride, 2)))
        return QK_E_UNSUPPORTED;
    int sms;
    const int st = qk_sm_count(&sms);
    if (st) return st;
    cudaStream_t s = (cudaStream_t)stream;
    switch (a->dtype) {
    case QK_BF16: return a->paged ? pick_dim<__nv_bfloat16, true>(a, s, sms) : pick_dim<__nv_bfloat16, false>(a, s, sms);
    case QK_F16: return a->paged ? pick_dim<__half, true>(a, s, sms) : pick_dim<__half, false>(a, s, sms);
    default: return QK_E_UNSUPPORTED;
    }
}
