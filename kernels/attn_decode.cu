// attn_decode / attn_paged_decode: split-KV flash decoding for one query token per sequence.
//
// Work: one CTA per (split of the keys, kv head and group of up to 16 query heads, sequence).
// Every K/V row of a kv head is read once for all the query heads that share it (GQA).  The
// split count comes from the shapes only (B, Hkv, Lkv or max_ctx, SM count), never from the
// lengths on the device, so a captured CUDA graph replays correctly when the lengths change;
// splits past a sequence's length do no loads and leave an empty partial.
//
// Tensor cores: the group's query heads are the 16 rows of mma.m16n8k16's A operand (with at
// most 8 heads, rows 8-15 are zero registers), so S = q K^T is two n8 tiles per 16 keys and
// O += P V takes P straight from the score fragments (FlashAttention-2's register reuse): a
// CUDA-core loop over the keys is instruction-bound well below the copy rate (docs/attention.md).
//
// Inside a CTA, each of the 4 warps streams its own 16-key tiles of the split (tile t goes to
// warp t % 4) through a private cp.async pipeline (stages<D>() deep; 8 KB of K+V per stage at
// D=128, two CTAs per SM), so HBM latency is hidden without block-wide barriers.  Per tile: an
// online softmax in exp2 units over the 16 keys, one rescale of the output fragments.  At the
// end the 4 warps merge through shared memory; with one split the CTA writes the output,
// otherwise fp32 partials (max, sum, unnormalised output) go to a workspace and a second kernel,
// launched as a programmatic dependent, combines the splits in a fixed order.  Keys that are
// masked, past the length or at an out-of-range slot are not loaded (zero-filled) and get
// probability 0; a sequence with no kept key gives 0.  An additive (float) mask: the lane that looks
// up a key's source also reads its mask value (-inf: skipped), which goes to shared memory next to
// the keep flags and is added to the scores in log2 units; a uniform branch per tile.
//
// On sm_90, when each split is short (at most 512 keys once the splits are capped at 16), the
// splits of a (sequence, head group) are launched as one thread-block cluster and merge their
// partials through distributed shared memory instead: no workspace allocation, no second kernel
// (a->variant QK_DECODE_WORKSPACE keeps the workspace path).
//
// Paged: key j of sequence b is pool slot req_to_token[req_pool_indices[b], j]; lane k of a warp
// loads the slot of key k of the tile one tile ahead and the copies get it by shuffle.  With
// new_k/new_v, position len_b - 1 is read from new_k/new_v, and the CTA owning it (head group 0)
// also writes them into the pool.  Paged calls with rows of at most 2 KB can go to decode_rows
// instead (a CTA per sequence and split reading whole token rows; rows_take has the policy).
#include "attn_common.cuh"

#include <cooperative_groups.h>
#include <math.h>

namespace {
using namespace qk_attn;

constexpr int kWarps = 4, kThreads = 32 * kWarps;
constexpr int kTile = 16;  // keys per tile: one k16 step of P.V, two n8 tiles of Q.K^T

// Pipeline depth per warp: about 8 KB a stage for D=128 (3 stages: two CTAs fit an SM, 128 KB
// in flight per SM), deeper for small heads whose tiles are small.
template <int D> __host__ __device__ constexpr int stages() { return D <= 64 ? 4 : 3; }

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

constexpr int64_t kSkip = -1, kFresh = -2;  // key sources besides a row / pool slot

// Key and value rows go in with a 128-byte L2 fetch (a row of D=128 is 256 bytes): a little faster
// here than 256 (the other attention kernels') or none (docs/attention.md).
constexpr int kDecodeL2 = 128;

// One 16-key tile of a warp's online softmax, in exp2 units: S = q K^T (q_of(kk, f) gives q's A
// fragment for k-step kk), scaled (plus an additive mask's bias), masked by keep, the running max
// and sum of rows g and g + 8 rescaled once, O += P V.  sk, sv: the tile's swizzled K and V [16][D].
template <typename T, int D, int kM, class QOf>
__device__ __forceinline__ void attend_tile(const QOf &q_of, const T *sk, const T *sv, const uint8_t *keep, const float *tbias,
                                            bool fmask, float qscale, float (&m)[2], float (&l)[2], float (&o)[D / 8][4]) {
    const int lane = threadIdx.x & 31, t4 = lane & 3;
    // S = q K^T for the 16 keys: s[n] holds rows g, g+8 x keys 8n + 2t, +1.
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        uint32_t qa[4], kb[4];
        q_of(kk, qa);
        const int mi = lane >> 3;  // matrices: keys 0-7 | 8-15, chunk 2kk | 2kk+1
        ldsm_x4(kb, sk + at<D>((lane & 7) + 8 * (mi >> 1), 2 * kk + (mi & 1)) * 8);
        qk_mma16816<T>(s[0], qa[0], qa[1], qa[2], qa[3], kb[0], kb[1]);
        qk_mma16816<T>(s[1], qa[0], qa[1], qa[2], qa[3], kb[2], kb[3]);
    }
    // Online softmax over the tile, in log2 units; skipped keys get probability 0.
    float mx[2] = {m[0], m[1]};
    if (fmask) {  // uniform; the plain path below stays as it is without the mask
#pragma unroll
        for (int n = 0; n < 2; n++) {
            const uint16_t kp = *reinterpret_cast<const uint16_t *>(keep + 8 * n + 2 * t4);
            const float2 bias = *reinterpret_cast<const float2 *>(tbias + 8 * n + 2 * t4);  // keys 8n + 2t4, +1
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const bool kept = (kp >> (8 * (e & 1))) & 0xff;
                s[n][e] = kept ? fmaf(s[n][e], qscale, (e & 1) ? bias.y : bias.x) : -INFINITY;
            }
        }
    } else {
#pragma unroll
        for (int n = 0; n < 2; n++) {
            const uint16_t kp = *reinterpret_cast<const uint16_t *>(keep + 8 * n + 2 * t4);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const bool kept = (kp >> (8 * (e & 1))) & 0xff;
                s[n][e] = kept ? s[n][e] * qscale : -INFINITY;
            }
        }
    }
#pragma unroll
    for (int n = 0; n < 2; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
        const float ref = mx[h] == -INFINITY ? 0.f : mx[h];  // nothing kept yet: all p are 0
        alpha[h] = exp2f(m[h] - ref);
        m[h] = mx[h];
        l[h] *= alpha[h];
    }
#pragma unroll
    for (int n = 0; n < 2; n++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float ref = mx[e >> 1] == -INFINITY ? 0.f : mx[e >> 1];
            s[n][e] = (kM == 16 || e < 2) ? exp2f(s[n][e] - ref) : 0.f;
            l[e >> 1] += s[n][e];
        }
    }
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
        o[n][0] *= alpha[0];
        o[n][1] *= alpha[0];
        if constexpr (kM == 16) {
            o[n][2] *= alpha[1];
            o[n][3] *= alpha[1];
        }
    }
    // O += P V: P (16 x 16 keys) is the A fragment straight from the score fragments.
    const uint32_t pa0 = pack2<T>(s[0][0], s[0][1]), pa1 = kM == 16 ? pack2<T>(s[0][2], s[0][3]) : 0u;
    const uint32_t pa2 = pack2<T>(s[1][0], s[1][1]), pa3 = kM == 16 ? pack2<T>(s[1][2], s[1][3]) : 0u;
#pragma unroll
    for (int n = 0; n < D / 8; n += 2) {
        uint32_t vb[4];
        const int mi = lane >> 3;  // matrices: keys 0-7 | 8-15, chunk n | n+1 (transposed)
        ldsm_x4_trans(vb, sv + at<D>((lane & 7) + 8 * (mi & 1), n + (mi >> 1)) * 8);
        qk_mma16816<T>(o[n], pa0, pa1, pa2, pa3, vb[0], vb[1]);
        qk_mma16816<T>(o[n + 1], pa0, pa1, pa2, pa3, vb[2], vb[3]);
    }
}

// kM query heads (8 or 16; rows past the group's heads are zero) against one kv head's split.
// kCluster (sm_90): the nsplit CTAs of a (sequence, head group) form one thread-block cluster and
// merge their partials through distributed shared memory, with no workspace and no second kernel
// (the latency-bound small-batch cases pay for both).
template <typename T, int D, int kM, bool kPaged, bool kCluster>
__global__ void __launch_bounds__(kThreads) decode_split(qk_attn_decode_args a, float *ws, int nsplit, int64_t chunk) {
    constexpr int kChunks = D / 8;                       // 16-byte chunks per row
    constexpr int kStages = stages<D>();
    constexpr int kTileBytes = kTile * D * 2;            // of K (and as much of V)
    // K and V of a stage; the keep flags sit after the whole ring, so every stage (and row) starts
    // 128-byte aligned: a row's copy that straddles shared-memory segments goes to L2 as 24 sectors
    // instead of 16.  The paged kernel keeps a 16-byte stage offset, which its scattered rows ran
    // faster with (docs/attention.md, paged decode).
    constexpr int kStageBytes = 2 * kTileBytes + (kPaged ? 16 : 0);
    static_assert(kPaged || ((kM * D * 2) % 128 == 0 && kStageBytes % 128 == 0), "contiguous stages 128-byte aligned");
    constexpr int kPerLane = kTile * kChunks / 32;       // chunks of K (and of V) a lane copies per tile
    constexpr bool kQRegs = D <= 128;                    // q fragments held in registers
    extern __shared__ __align__(128) unsigned char smem[];
    T *sq = reinterpret_cast<T *>(smem);                 // [kM][D]
    unsigned char *pipe = smem + kM * D * 2;
    // Launched as a programmatic dependent: nothing in memory is touched before the previous kernel
    // ends.  The combine kernel may then be scheduled; it waits for this grid's end before reading.
    qk_dependent_wait();
    if (!kCluster) qk_dependent_launch();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int split = blockIdx.x, b = blockIdx.z;
    const int G = (int)(a.Hq / a.Hkv), groups = (G + kM - 1) / kM;
    const int hk = blockIdx.y / groups, grp = blockIdx.y % groups;
    const int h0 = hk * G + grp * kM;                    // first query head of this CTA
    const int nheads = min(kM, G - grp * kM);

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

    // q rows of the group into shared memory; zero rows pad the group to kM.
    for (int e = threadIdx.x; e < kM * kChunks; e += kThreads) {
        const int r = e / kChunks, c = e % kChunks;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < nheads) v = __ldg(reinterpret_cast<const uint4 *>(static_cast<const T *>(a.q) + b * a.q_stride[0] + (h0 + r) * a.q_stride[1] + c * 8));
        *reinterpret_cast<uint4 *>(sq + at<D>(r, c) * 8) = v;
    }
    __syncthreads();
    // A fragment of q for k-step kk (PTX m16n8k16 layout): rows g, g+8; columns 2t.., 2t+8...
    // With kM = 8 the rows g+8 are zero registers.
    const int g = lane >> 2, t4 = lane & 3;
    auto q_frag = [&](int kk, uint32_t (&f)[4]) {
        if constexpr (kM == 16) {
            const int mi = lane >> 3;  // matrices: rows 0-7 | 8-15, chunk 2kk | 2kk+1
            ldsm_x4(f, sq + at<D>((lane & 7) + 8 * (mi & 1), 2 * kk + (mi >> 1)) * 8);
        } else {
            const int mi = (lane >> 3) & 1;  // rows 0-7, chunk 2kk | 2kk+1
            uint32_t r[4];
            ldsm_x4(r, sq + at<D>(lane & 7, 2 * kk + mi) * 8);
            f[0] = r[0];
            f[1] = 0;
            f[2] = r[1];
            f[3] = 0;
        }
    };
    uint32_t qreg[kQRegs ? D / 16 : 1][4];
    if constexpr (kQRegs) {
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) q_frag(kk, qreg[kk]);
    }
    const float qscale = a.scale * 1.4426950408889634f;  // scores in log2 units for exp2
    auto q_of = [&](int kk, uint32_t (&f)[4]) {
        if constexpr (kQRegs) {
#pragma unroll
            for (int i = 0; i < 4; i++) f[i] = qreg[kk][i];
        } else {
            q_frag(kk, f);
        }
    };

    // Running max and sum of rows g and g+8 (the sum is this lane's share until the end), and
    // the output fragments: o[n] holds rows g, g+8 x columns 8n + 2t, +1.
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

    unsigned char *wsmem = pipe + warp * kStages * kStageBytes;
    uint8_t *wkeep = pipe + kWarps * kStages * kStageBytes + warp * kStages * kTile;  // [stage][key]
    // an additive mask's values of the stages' keys in log2 units [stage][key], after the flags
    float *wbias = reinterpret_cast<float *>(pipe + kWarps * kStages * (kStageBytes + kTile)) + warp * kStages * kTile;
    const int64_t span = ks1 > ks0 ? ks1 - ks0 : 0;
    const int64_t tiles_total = (span + kTile - 1) / kTile;
    const int ntiles = tiles_total > warp ? (int)((tiles_total - warp + kWarps - 1) / kWarps) : 0;
    const T *kbase = static_cast<const T *>(a.k), *vbase = static_cast<const T *>(a.v);
    const int64_t kh = kPaged ? hk * a.k_stride[2] : b * a.k_stride[0] + hk * a.k_stride[2];
    const int64_t vh = kPaged ? hk * a.v_stride[2] : b * a.v_stride[0] + hk * a.v_stride[2];
    const uint8_t *mask = static_cast<const uint8_t *>(a.mask);
    const bool fmask = mask != nullptr && a.mask_float;  // uniform
    const T *fresh_k = has_fresh ? static_cast<const T *>(a.new_k) + b * a.new_k_stride[0] + hk * a.new_k_stride[1] : nullptr;
    const T *fresh_v = has_fresh ? static_cast<const T *>(a.new_v) + b * a.new_v_stride[0] + hk * a.new_v_stride[1] : nullptr;

    // Where key (lane % 16) of this warp's tile t comes from: its row (contiguous) or pool slot
    // (paged), kFresh for new_k/new_v, kSkip when it is outside the split, masked or at an
    // out-of-range slot.  One index load per key; the copies get it by shuffle.
    // An additive mask's value of the key goes to bias.
    auto key_src = [&](int t, float &bias) -> int64_t {
        const int64_t j = ks0 + ((int64_t)t * kWarps + warp) * kTile + (lane & (kTile - 1));
        if (j >= ks1) return kSkip;
        if (mask) {
            if (a.mask_cols > 0 && j >= a.mask_cols) return kSkip;  // past a narrower paged mask
            const int64_t mi = b * a.mask_stride[0] + j * a.mask_stride[1];
            if (fmask) {
                bias = mask_bias_log2(mask, a.mask_dtype, mi);
                if (bias == -INFINITY) return kSkip;
            } else if (!mask[mi]) {
                return kSkip;
            }
        }
        if (!kPaged) return j;
        if (!row_ok) return kSkip;
        if (has_fresh && j == len - 1) return kFresh;
        const int64_t slot = load_index(a.req_to_token, a.r2t_dtype, pool_row * a.r2t_stride[0] + j * a.r2t_stride[1]);
        return slot >= 0 && slot < a.pool_size ? slot : kSkip;
    };
    // Contiguous keys and no mask (the common case): row r of tile t is key jt + r, kept while below
    // ks1, so each lane steps its row pointers by a fixed stride.  Elsewhere each row's source comes
    // by shuffle from the lane that looked it up, which costs many more instructions per copy
    // (64-bit shuffles, multiplies, selects).
    const bool direct = !kPaged && mask == nullptr;
    auto issue = [&](int t, int64_t src, float bias) {
        unsigned char *st = wsmem + (t % kStages) * kStageBytes;
        T *sk = reinterpret_cast<T *>(st), *sv = reinterpret_cast<T *>(st + kTileBytes);
        if (direct) {
            constexpr int kRowStep = 32 / kChunks;  // rows apart of a lane's copies (kChunks divides 32)
            const int r0 = lane / kChunks, c = lane % kChunks;
            const int64_t j0 = ks0 + ((int64_t)t * kWarps + warp) * kTile + r0;
            const T *gk = kbase + j0 * a.k_stride[1] + kh + c * 8;
            const T *gv = vbase + j0 * a.v_stride[1] + vh + c * 8;
            const int64_t dk = kRowStep * a.k_stride[1], dv = kRowStep * a.v_stride[1];
#pragma unroll
            for (int i = 0; i < kPerLane; i++, gk += dk, gv += dv) {
                const int r = r0 + i * kRowStep;
                const bool ok = j0 + i * kRowStep < ks1;
                cp_async16<kDecodeL2>(sk + at<D>(r, c) * 8, ok ? gk : kbase, ok);
                cp_async16<kDecodeL2>(sv + at<D>(r, c) * 8, ok ? gv : vbase, ok);
            }
        } else {
#pragma unroll
            for (int i = 0; i < kPerLane; i++) {
                const int idx = lane + 32 * i, r = idx / kChunks, c = idx % kChunks;
                const int64_t s = shfl64(src, r);
                const bool ok = s != kSkip;
                const T *gk = s == kFresh ? fresh_k : kbase + s * a.k_stride[1] + kh;
                const T *gv = s == kFresh ? fresh_v : vbase + s * a.v_stride[1] + vh;
                cp_async16<kDecodeL2>(sk + at<D>(r, c) * 8, ok ? gk + c * 8 : kbase, ok);
                cp_async16<kDecodeL2>(sv + at<D>(r, c) * 8, ok ? gv + c * 8 : vbase, ok);
            }
        }
        if (lane < kTile) wkeep[(t % kStages) * kTile + lane] = src != kSkip;
        if (fmask && lane < kTile) wbias[(t % kStages) * kTile + lane] = bias;
    };

    // Prologue: tiles 0 .. kStages-2 in flight; the sources of tile kStages-1 loaded.
    float next_bias = 0.f;
#pragma unroll
    for (int t = 0; t < kStages - 1; t++) {
        if (t < ntiles) {
            const int64_t src = key_src(t, next_bias);
            issue(t, src, next_bias);
        }
        cp_async_commit();
    }
    int64_t next = key_src(kStages - 1, next_bias);

    for (int t = 0; t < ntiles; t++) {
        if (t + kStages - 1 < ntiles) issue(t + kStages - 1, next, next_bias);
        cp_async_commit();
        if (t + kStages < ntiles) next = key_src(t + kStages, next_bias);
        cp_async_wait<kStages - 1>();
        __syncwarp();
        const unsigned char *st = wsmem + (t % kStages) * kStageBytes;
        const T *sk = reinterpret_cast<const T *>(st), *sv = reinterpret_cast<const T *>(st + kTileBytes);
        const uint8_t *keep = wkeep + (t % kStages) * kTile;
        const float *tbias = wbias + (t % kStages) * kTile;

        attend_tile<T, D, kM>(q_of, sk, sv, keep, tbias, fmask, qscale, m, l, o);
        __syncwarp();  // the stage is refilled by the next iteration's issue
    }
    cp_async_wait<0>();
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }

    // Merge the warps through shared memory (q and the pipeline buffers are free now).
    __syncthreads();
    float *red = reinterpret_cast<float *>(smem);  // [kWarps][kM][D + 2]
#pragma unroll
    for (int h = 0; h < kM / 8; h++) {
        float *r = red + (warp * kM + g + 8 * h) * (D + 2);
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            r[8 * n + 2 * t4] = o[n][2 * h];
            r[8 * n + 2 * t4 + 1] = o[n][2 * h + 1];
        }
        if (t4 == 0) {
            r[D] = m[h];
            r[D + 1] = l[h];
        }
    }
    __syncthreads();
    // Cluster: this CTA's partial, [kM][D + 2] after the warps' (read by the other CTAs).
    float *part = red + kWarps * kM * (D + 2);
    // Thread x of the CTA finishes (head, element) pairs in a fixed order.
    for (int e = threadIdx.x; e < kM * D; e += kThreads) {
        const int gh = e / D, d = e % D;
        if (gh >= nheads) continue;
        float mxw = -INFINITY;
#pragma unroll
        for (int w = 0; w < kWarps; w++) mxw = fmaxf(mxw, red[(w * kM + gh) * (D + 2) + D]);
        float sum = 0.f, val = 0.f;
        if (mxw != -INFINITY) {
#pragma unroll
            for (int w = 0; w < kWarps; w++) {
                const float *r = red + (w * kM + gh) * (D + 2);
                const float f = exp2f(r[D] - mxw);
                sum += r[D + 1] * f;
                val += r[d] * f;
            }
        }
        const int h = h0 + gh;
        if (kCluster) {
            part[gh * (D + 2) + d] = val;
            if (d == 0) {
                part[gh * (D + 2) + D] = mxw;
                part[gh * (D + 2) + D + 1] = sum;
            }
        } else if (nsplit == 1) {
            T *out = static_cast<T *>(a.out) + b * a.out_stride[0] + h * a.out_stride[1];
            out[d] = qk_from_float<T>(sum > 0.f ? val / sum : 0.f);
        } else {
            // Partials: [B][Hq][nsplit] x (D values, max, sum)
            float *p = ws + (((int64_t)b * a.Hq + h) * nsplit + split) * (D + 2);
            p[d] = val;
            if (d == 0) {
                p[D] = mxw;
                p[D + 1] = sum;
            }
        }
    }
    if constexpr (kCluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        // Every CTA of the cluster combines a share of the (head, element) pairs, reading the
        // partials of all nsplit CTAs in split (rank) order, as decode_combine does.
        namespace cg = cooperative_groups;
        cg::cluster_group cluster = cg::this_cluster();
        cluster.sync();  // every partial written
        for (int e = split * kThreads + threadIdx.x; e < kM * D; e += nsplit * kThreads) {
            const int gh = e / D, d = e % D;
            if (gh >= nheads) continue;
            float mx = -INFINITY;
            for (int r = 0; r < nsplit; r++) mx = fmaxf(mx, cluster.map_shared_rank(part, r)[gh * (D + 2) + D]);
            float sum = 0.f, val = 0.f;
            if (mx != -INFINITY) {
                for (int r = 0; r < nsplit; r++) {
                    const float *pr = cluster.map_shared_rank(part, r) + gh * (D + 2);
                    const float w = exp2f(pr[D] - mx);
                    sum += pr[D + 1] * w;
                    val += pr[d] * w;
                }
            }
            T *out = static_cast<T *>(a.out) + b * a.out_stride[0] + (h0 + gh) * a.out_stride[1];
            out[d] = qk_from_float<T>(sum > 0.f ? val / sum : 0.f);
        }
        cluster.sync();  // no CTA leaves while another reads its shared memory
#endif
    }
}

// The splits' partials of each (b, query head) merged in split order.  Launched as a programmatic
// dependent of decode_split (sm_90), so its launch overlaps the split kernel's tail;
// griddepcontrol.wait returns once decode_split has finished and its writes are visible.
// kWide (more than 8 splits): a warp per (row, 32 output columns), each lane one column, so that a
// batch's 32 splits' loads are in flight at once instead of a chain of dependent L2 round trips.
// Up to 8 splits the warp per row already has them all in flight, without kWide's extra warps
// (docs/attention.md).  Either way each column adds its splits in the same order.
// Warps per output row: the kernel's row mapping and the launcher's grid both come from here.
template <int D, bool kWide> __host__ __device__ constexpr int combine_slices() { return kWide ? (D + 31) / 32 : 1; }
template <typename T, int D, bool kWide>
__global__ void __launch_bounds__(kThreads) decode_combine(qk_attn_decode_args a, const float *ws, int nsplit) {
    qk_dependent_wait();
    qk_dependent_launch();  // a small grid: the next kernel's launch may overlap it
    constexpr int kSlices = combine_slices<D, kWide>();
    constexpr int kPer = kWide ? 1 : (D + 31) / 32;     // columns per lane, 32 apart
    const int64_t wid = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
    const int64_t row = wid / kSlices;
    if (row >= a.B * a.Hq) return;
    const int lane = threadIdx.x & 31, c0 = (int)(wid % kSlices) * 32 + lane;
    const int64_t b = row / a.Hq, h = row % a.Hq;
    const float *p = ws + row * nsplit * (D + 2);
    // The maxima lane-parallel (a split per lane), so no chain of dependent loads.
    float mx = -INFINITY;
    for (int s = lane; s < nsplit; s += 32) mx = fmaxf(mx, p[s * (D + 2) + D]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float val[kPer] = {}, sum = 0.f;
    if (mx != -INFINITY) {
        for (int s0 = 0; s0 < nsplit; s0 += 32) {
            // Lane j weighs split s0 + j (an empty split: exp2(-inf) = 0); the weights are broadcast.
            float w = 0.f;
            if (s0 + lane < nsplit) {
                const float *ps = p + (s0 + lane) * (D + 2);
                w = exp2f(ps[D] - mx);
                sum += ps[D + 1] * w;
            }
            const int n = min(32, nsplit - s0);
            if constexpr (kWide) {
                float x[32];
#pragma unroll
                for (int j = 0; j < 32; j++) x[j] = j < n && c0 < D ? p[(s0 + j) * (D + 2) + c0] : 0.f;
#pragma unroll
                for (int j = 0; j < 32; j++) {
                    const float wj = __shfl_sync(0xffffffffu, w, j);
                    if (j < n) val[0] += x[j] * wj;
                }
            } else {
#pragma unroll 8
                for (int j = 0; j < n; j++) {
                    const float wj = __shfl_sync(0xffffffffu, w, j);
                    const float *ps = p + (s0 + j) * (D + 2);
#pragma unroll
                    for (int i = 0; i < kPer; i++)
                        if (c0 + 32 * i < D) val[i] += ps[c0 + 32 * i] * wj;
                }
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    }
    T *o = static_cast<T *>(a.out) + b * a.out_stride[0] + h * a.out_stride[1];
#pragma unroll
    for (int i = 0; i < kPer; i++)
        if (c0 + 32 * i < D) o[c0 + 32 * i] = qk_from_float<T>(sum > 0.f ? val[i] / sum : 0.f);
}

// ---- Paged decode over whole token rows -------------------------------------------------------
// decode_rows: one CTA per (split of the positions, sequence) and a warp per kv head.  A pool slot
// holds a token's K (or V) for every kv head in one row of Hkv * D elements; decode_split's CTA of
// one kv head reads a D-element piece of each randomly placed row, here the CTA's copies of a tile
// cover its 16 rows whole (a warp's copy instruction reads 512 contiguous bytes), and one slot
// lookup serves every head.  The tiles go through a block-wide cp.async ring of kRowStages stages
// with one barrier per tile; the tile's sources, keep flags and mask values are staged in shared
// memory kRowStages tiles ahead by threads 0-15, which look them up one tile before that (the
// lookup's latency hides behind a tile).  Each warp runs decode_split's tile math on its head's
// slice for its own G <= 16 query heads and writes its own partial: no merge between warps.
// Rows of up to 2 KB (Hkv * D <= 1024): 3 stages of K and V are 192 KB, one CTA per SM.
constexpr int kRowStages = 3, kRowMeta = kRowStages + 1;
template <int D> __host__ __device__ constexpr int rows_max_warps() { return 1024 / D; }
// decode_rows' shared memory for hkv heads: the ring, then per meta slot 16 sources (int64), mask
// values (float) and keep flags (bytes).
inline size_t rows_smem(int64_t hkv, int D) {
    return (size_t)kRowStages * 2 * kTile * (size_t)hkv * D * 2 + (size_t)kRowMeta * kTile * (8 + 4 + 1);
}

template <typename T, int D, int kM>
__global__ void __launch_bounds__(32 * rows_max_warps<D>()) decode_rows(qk_attn_decode_args a, float *ws, int nsplit, int64_t chunk) {
    constexpr int kChunks = D / 8;               // 16-byte chunks of one head's row
    constexpr int kTileBytes = kTile * D * 2;    // one head's K (or V) of a tile
    constexpr int kRowStep = 256 / D;            // rows apart of a thread's copies: 32 * Hkv threads / (Hkv * kChunks)
    constexpr int kPerThread = kTile / kRowStep; // copies of K (and of V) per thread per tile
    static_assert(kTile % kRowStep == 0 && kTileBytes % 128 == 0, "tile geometry");
    extern __shared__ __align__(128) unsigned char smem[];
    // A programmatic dependent, as decode_split: nothing in memory is touched before the wait.
    qk_dependent_wait();
    qk_dependent_launch();
    const int hkv = (int)a.Hkv;                  // the block is 32 * Hkv threads (launch_rows)
    const int lane = threadIdx.x & 31, hk = threadIdx.x >> 5;
    const int split = blockIdx.x, b = blockIdx.y;
    const int G = (int)(a.Hq / a.Hkv);           // <= kM (launch_rows)
    const int h0 = hk * G;                       // this warp's first query head
    const size_t stage_bytes = (size_t)2 * hkv * kTileBytes;  // K of every head, then V
    int64_t *msrc = reinterpret_cast<int64_t *>(smem + kRowStages * stage_bytes);  // [kRowMeta][kTile]
    float *mbias = reinterpret_cast<float *>(msrc + kRowMeta * kTile);             // [kRowMeta][kTile]
    uint8_t *mkeep = reinterpret_cast<uint8_t *>(mbias + kRowMeta * kTile);         // [kRowMeta][kTile]

    const int64_t len = seq_len(a, b, true);
    const int64_t ks0 = (int64_t)split * chunk, ks1 = min(ks0 + chunk, len);
    const int64_t pool_row = load_index(a.req_pool_indices, a.rpi_dtype, b * a.rpi_stride);
    const bool row_ok = pool_row >= 0 && pool_row < a.num_requests;
    const bool has_fresh = a.new_k != nullptr && row_ok && len > 0;
    const T *kbase = static_cast<const T *>(a.k), *vbase = static_cast<const T *>(a.v);

    // new_k/new_v into the pool, once per sequence: by the CTA whose split holds position len - 1,
    // each warp its head's piece (this CTA reads that position from new_k/new_v themselves).
    if (has_fresh && ks0 <= len - 1 && len - 1 < ks1 && lane < kChunks) {
        const int64_t slot = load_index(a.req_to_token, a.r2t_dtype, pool_row * a.r2t_stride[0] + (len - 1) * a.r2t_stride[1]);
        if (slot >= 0 && slot < a.pool_size) {
            const T *nk = static_cast<const T *>(a.new_k) + b * a.new_k_stride[0] + hk * a.new_k_stride[1] + lane * 8;
            const T *nv = static_cast<const T *>(a.new_v) + b * a.new_v_stride[0] + hk * a.new_v_stride[1] + lane * 8;
            T *pk = static_cast<T *>(a.k) + slot * a.k_stride[1] + hk * a.k_stride[2] + lane * 8;
            T *pv = static_cast<T *>(a.v) + slot * a.v_stride[1] + hk * a.v_stride[2] + lane * 8;
            *reinterpret_cast<uint4 *>(pk) = __ldg(reinterpret_cast<const uint4 *>(nk));
            *reinterpret_cast<uint4 *>(pv) = __ldg(reinterpret_cast<const uint4 *>(nv));
        }
    }

    // q's A fragments (PTX m16n8k16 layout) straight from global memory: rows g, g + 8 of the warp's
    // heads (zero past G), columns 16kk + 2t4, +1 and 16kk + 8 + 2t4, +1.
    const int g = lane >> 2, t4 = lane & 3;
    uint32_t qreg[D / 16][4];
    {
        const T *qb = static_cast<const T *>(a.q) + b * a.q_stride[0];
        const bool ok0 = g < G, ok1 = kM == 16 && g + 8 < G;
        const uint32_t *q0 = reinterpret_cast<const uint32_t *>(qb + (int64_t)(ok0 ? h0 + g : h0) * a.q_stride[1]);
        const uint32_t *q1 = reinterpret_cast<const uint32_t *>(qb + (int64_t)(ok1 ? h0 + g + 8 : h0) * a.q_stride[1]);
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            qreg[kk][0] = ok0 ? __ldg(q0 + 8 * kk + t4) : 0u;
            qreg[kk][1] = ok1 ? __ldg(q1 + 8 * kk + t4) : 0u;
            qreg[kk][2] = ok0 ? __ldg(q0 + 8 * kk + 4 + t4) : 0u;
            qreg[kk][3] = ok1 ? __ldg(q1 + 8 * kk + 4 + t4) : 0u;
        }
    }
    auto q_of = [&](int kk, uint32_t (&f)[4]) {
#pragma unroll
        for (int i = 0; i < 4; i++) f[i] = qreg[kk][i];
    };
    const float qscale = a.scale * 1.4426950408889634f;  // scores in log2 units for exp2
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

    const uint8_t *mask = static_cast<const uint8_t *>(a.mask);
    const bool fmask = mask != nullptr && a.mask_float;  // uniform
    // Where key threadIdx.x (< 16) of tile t comes from: a pool slot, kFresh or kSkip, as decode_split's.
    auto key_src = [&](int t, float &bias) -> int64_t {
        const int64_t j = ks0 + (int64_t)t * kTile + threadIdx.x;
        bias = 0.f;
        if (j >= ks1) return kSkip;
        if (mask) {
            if (a.mask_cols > 0 && j >= a.mask_cols) return kSkip;  // past a narrower mask
            const int64_t mi = b * a.mask_stride[0] + j * a.mask_stride[1];
            if (fmask) {
                bias = mask_bias_log2(mask, a.mask_dtype, mi);
                if (bias == -INFINITY) return kSkip;
            } else if (!mask[mi]) {
                return kSkip;
            }
        }
        if (!row_ok) return kSkip;
        if (has_fresh && j == len - 1) return kFresh;
        const int64_t slot = load_index(a.req_to_token, a.r2t_dtype, pool_row * a.r2t_stride[0] + j * a.r2t_stride[1]);
        return slot >= 0 && slot < a.pool_size ? slot : kSkip;
    };
    auto stage_meta = [&](int t, int64_t src, float bias) {
        const int i = (t % kRowMeta) * kTile + threadIdx.x;
        msrc[i] = src;
        mbias[i] = bias;
        mkeep[i] = src != kSkip;
    };

    // This thread's copies: 16-byte chunk cc of head ch of rows r0, r0 + kRowStep, ... of a tile, so
    // that consecutive threads read consecutive chunks of a row.
    const int rowchunks = hkv * kChunks;
    const int r0 = threadIdx.x / rowchunks, ch = (threadIdx.x % rowchunks) / kChunks, cc = threadIdx.x % kChunks;
    const int64_t koff = ch * a.k_stride[2] + cc * 8, voff = ch * a.v_stride[2] + cc * 8;
    const T *fk = has_fresh ? static_cast<const T *>(a.new_k) + b * a.new_k_stride[0] + ch * a.new_k_stride[1] + cc * 8 : kbase;
    const T *fv = has_fresh ? static_cast<const T *>(a.new_v) + b * a.new_v_stride[0] + ch * a.new_v_stride[1] + cc * 8 : vbase;
    const uint32_t sdk = (uint32_t)__cvta_generic_to_shared(smem) + ch * kTileBytes, sdv = sdk + hkv * kTileBytes;
    auto issue = [&](int t) {
        const uint32_t st = (uint32_t)((t % kRowStages) * stage_bytes);
        const int64_t *src = msrc + (t % kRowMeta) * kTile;
#pragma unroll
        for (int i = 0; i < kPerThread; i++) {
            const int r = r0 + i * kRowStep;
            const int64_t s = src[r];
            const bool ok = s != kSkip;
            const T *gk = s == kFresh ? fk : kbase + s * a.k_stride[1] + koff;
            const T *gv = s == kFresh ? fv : vbase + s * a.v_stride[1] + voff;
            const uint32_t so = st + at<D>(r, cc) * 16;
            cp_async16<kDecodeL2>(sdk + so, ok ? gk : kbase, ok);
            cp_async16<kDecodeL2>(sdv + so, ok ? gv : vbase, ok);
        }
    };

    const int64_t span = ks1 > ks0 ? ks1 - ks0 : 0;
    const int ntiles = (int)((span + kTile - 1) / kTile);
    // Prologue: the sources of tiles 0 .. kRowStages-1 staged, tile kRowStages's looked up; tiles
    // 0 .. kRowStages-2 in flight.  Lookups past the split give kSkip.
    int64_t next = kSkip;
    float next_bias = 0.f;
    if (threadIdx.x < kTile) {
#pragma unroll
        for (int t = 0; t < kRowStages; t++) {
            float bias;
            const int64_t src = key_src(t, bias);
            stage_meta(t, src, bias);
        }
        next = key_src(kRowStages, next_bias);
    }
    __syncthreads();
#pragma unroll
    for (int t = 0; t < kRowStages - 1; t++) {
        if (t < ntiles) issue(t);
        cp_async_commit();
    }
    for (int t = 0; t < ntiles; t++) {
        cp_async_wait<kRowStages - 2>();  // this thread's copies of tile t
        // Every thread's copies of tile t have landed, and every warp is done with tile t - 1, whose
        // stage the issue below refills and whose meta slot (t + kRowStages) % kRowMeta takes the
        // sources of tile t + kRowStages.
        __syncthreads();
        if (t + kRowStages - 1 < ntiles) issue(t + kRowStages - 1);
        cp_async_commit();
        if (threadIdx.x < kTile) {
            stage_meta(t + kRowStages, next, next_bias);
            next = key_src(t + kRowStages + 1, next_bias);
        }
        __syncwarp();  // warp 0 converged again for the tile's ldmatrix and mma
        const unsigned char *st = smem + (t % kRowStages) * stage_bytes;
        const T *sk = reinterpret_cast<const T *>(st + hk * kTileBytes);
        const T *sv = reinterpret_cast<const T *>(st + (hkv + hk) * kTileBytes);
        const int mi = (t % kRowMeta) * kTile;
        attend_tile<T, D, kM>(q_of, sk, sv, mkeep + mi, mbias + mi, fmask, qscale, m, l, o);
    }
    cp_async_wait<0>();
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
    // Rows g (and g + 8) of the warp's heads: the output, or the split's partial for decode_combine
    // ([B][Hq][nsplit] x (D values, max, sum), as decode_split's).
#pragma unroll
    for (int h = 0; h < kM / 8; h++) {
        const int gh = g + 8 * h;
        if (gh >= G) continue;
        const int64_t qh = h0 + gh;
        if (nsplit == 1) {
            T *out = static_cast<T *>(a.out) + b * a.out_stride[0] + qh * a.out_stride[1];
            const float sum = l[h];
#pragma unroll
            for (int n = 0; n < D / 8; n++) {
                out[8 * n + 2 * t4] = qk_from_float<T>(sum > 0.f ? o[n][2 * h] / sum : 0.f);
                out[8 * n + 2 * t4 + 1] = qk_from_float<T>(sum > 0.f ? o[n][2 * h + 1] / sum : 0.f);
            }
        } else {
            float *p = ws + (((int64_t)b * a.Hq + qh) * nsplit + split) * (D + 2);
#pragma unroll
            for (int n = 0; n < D / 8; n++) {
                p[8 * n + 2 * t4] = o[n][2 * h];
                p[8 * n + 2 * t4 + 1] = o[n][2 * h + 1];
            }
            if (t4 == 0) {
                p[D] = m[h];
                p[D + 1] = l[h];
            }
        }
    }
}

// The cluster launch (see decode_split): QK_E_UNSUPPORTED where clusters are not available (below
// sm_90, or a cluster of that size cannot be scheduled), so the caller takes the workspace path.
// a->variant QK_DECODE_WORKSPACE turns it off (comparison and tests).
template <typename T, int D, int kM, bool kPaged>
int launch_cluster(const qk_attn_decode_args *a, cudaStream_t s, int ncl, int64_t chunk, int64_t groups_y, size_t smem) {
    if (a->variant == QK_DECODE_WORKSPACE) return QK_E_UNSUPPORTED;
    int cc;
    const int st = qk_device_cc(&cc);
    if (st) return st;
    if (cc < 90 || a->B > 65535 || groups_y > 65535) return QK_E_UNSUPPORTED;
    const void *fn = (const void *)decode_split<T, D, kM, kPaged, true>;
    const int opt = qk_kernel_residency(fn, kThreads, smem, nullptr);
    if (opt) return opt;
    if (ncl > 8 && cudaFuncSetAttribute(fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
        cudaGetLastError();
        return QK_E_UNSUPPORTED;
    }
    // The cluster shape, then (for the launch only) the programmatic dependence on the previous kernel.
    cudaLaunchAttribute attr[2] = {qk_cluster_attr((unsigned)ncl), qk_dependent_attr()};
    cudaLaunchConfig_t cfg =
        qk_launch_config(dim3((unsigned)ncl, (unsigned)groups_y, (unsigned)a->B), dim3(kThreads), smem, s, attr, 1);
    int clusters = 0;  // can a cluster of ncl CTAs with this much shared memory be placed at all?
    if (cudaOccupancyMaxActiveClusters(&clusters, fn, &cfg) != cudaSuccess || clusters < 1) {
        cudaGetLastError();
        return QK_E_UNSUPPORTED;
    }
    cfg.numAttrs = 2;
    qk_attn_decode_args p = *a;
    float *ws = nullptr;
    int ns = ncl;
    void *args[] = {&p, &ws, &ns, &chunk};
    return (int)cudaLaunchKernelExC(&cfg, fn, args);
}

// After a split kernel (status its launch): with several splits, decode_combine merges them, and
// the workspace goes back whatever happened; the first failure is returned.
template <typename T, int D>
int merge_splits(qk_attn_decode_args *p, float *ws, size_t ws_bytes, int ns, int status, cudaStream_t s) {
    if (ns <= 1) return status;
    if (!status) {
        void *cargs[] = {p, &ws, &ns};
        const bool wide = ns > 8;
        const int64_t warps = p->B * p->Hq * (wide ? combine_slices<D, true>() : combine_slices<D, false>());
        status = qk_launch_dependent(wide ? (const void *)decode_combine<T, D, true> : (const void *)decode_combine<T, D, false>,
                                     dim3((unsigned)((warps + kWarps - 1) / kWarps)), dim3(kThreads), 0, s, cargs);
    }
    const int freed = qk_scratch_free(p->scratch, ws, ws_bytes, s);
    return status ? status : freed;
}

template <typename T, int D, int kM, bool kPaged>
int launch(const qk_attn_decode_args *a, cudaStream_t s, int sms) {
    const int G = (int)(a->Hq / a->Hkv), groups = (G + kM - 1) / kM;
    const int64_t units = a->B * a->Hkv * groups;
    const int64_t lcap = a->paged ? a->max_ctx : a->Lkv;
    constexpr size_t row = D * 2;
    // q, then per warp and stage K and V (and the paged kernel's 16-byte offset), then per warp
    // and stage the keep flags and an additive mask's values (with or without one: the size of a
    // kernel's shared memory is fixed, and these few bytes change no residency)
    constexpr size_t smem = kM * row + (size_t)kWarps * stages<D>() * (2 * kTile * row + kTile + (kPaged ? 16 : 0)) +
                            (size_t)kWarps * stages<D>() * kTile * sizeof(float);
    static_assert((size_t)(kWarps + 1) * kM * (D + 2) * 4 <= smem, "merge and cluster partial fit");
    int resident;
    const int opt = qk_kernel_residency((const void *)decode_split<T, D, kM, kPaged, false>, kThreads, smem, &resident);
    if (opt) return opt;
    // Splits: as many as fit one wave of resident CTAs, and no more (a second wave costs more than
    // it spreads); each warp gets at least two tiles (128-key splits) where the keys allow it.
    // docs/attention.md has the sweep.
    const int64_t slots = (int64_t)resident * sms;
    const int64_t max_split = lcap > 0 ? (lcap + kWarps * kTile - 1) / (kWarps * kTile) : 1;
    const int64_t pref_split = lcap > 0 ? (lcap + 2 * kWarps * kTile - 1) / (2 * kWarps * kTile) : 1;
    int64_t nsplit = slots / units;
    if (nsplit > pref_split) nsplit = pref_split;
    // a->splits = n (tuning sweeps): n splits whatever the shape asks for (capped by max_split: each
    // warp keeps at least one tile).
    if (a->splits >= 1) nsplit = a->splits < max_split ? a->splits : max_split;
    if (nsplit < 1) nsplit = 1;
    if (nsplit > 1024) nsplit = 1024;
    // Latency-bound shapes (at most 512 keys per split, every cluster in one wave) on sm_90: the
    // splits of a (sequence, head group) as one cluster of at most 16 CTAs that merge on chip.
    // Longer splits, or clusters whose CTAs do not fit one per SM (a cluster is placed whole within
    // a GPC), run faster through the workspace (docs/attention.md).
    if (nsplit > 1) {
        const int64_t ncl = nsplit < 16 ? nsplit : 16;
        const int64_t cl_chunk = lcap > 0 ? (lcap + ncl - 1) / ncl : 1;
        if (cl_chunk <= 512 && units * ncl <= sms) {
            const int st = launch_cluster<T, D, kM, kPaged>(a, s, (int)ncl, cl_chunk, units / a->B, smem);
            if (st != QK_E_UNSUPPORTED) return st;
        }
    }
    const int64_t chunk = lcap > 0 ? (lcap + nsplit - 1) / nsplit : 1;
    float *ws = nullptr;
    const size_t ws_bytes = nsplit > 1 ? (size_t)(a->B * a->Hq * nsplit * (D + 2)) * sizeof(float) : 0;
    QK_SCRATCH_TRY(a->scratch, ws_bytes, s, &ws);
    qk_attn_decode_args p = *a;
    int ns = (int)nsplit;
    int64_t ch = chunk;
    void *args[] = {&p, &ws, &ns, &ch};
    int status = qk_launch_dependent((const void *)decode_split<T, D, kM, kPaged, false>,
                           dim3((unsigned)nsplit, (unsigned)(a->Hkv * groups), (unsigned)a->B), dim3(kThreads), smem, s, args);
    return merge_splits<T, D>(&p, ws, ws_bytes, ns, status, s);
}

// decode_rows for a paged call whose query-head groups fit one warp (G <= kM <= 16) and whose rows
// fit the ring (Hkv <= rows_max_warps<D>()): launch_rows' caller checks.
template <typename T, int D, int kM>
int launch_rows(const qk_attn_decode_args *a, cudaStream_t s, int sms) {
    const int hkv = (int)a->Hkv;
    const void *fn = (const void *)decode_rows<T, D, kM>;
    // The shared-memory limit and the residency are cached per kernel, so they are asked at the
    // largest block (rows_max_warps heads); a smaller block takes proportionally less of everything.
    int resident;
    const int opt = qk_kernel_residency(fn, 32 * rows_max_warps<D>(), rows_smem(rows_max_warps<D>(), D), &resident);
    if (opt) return opt;
    int64_t per_sm = (int64_t)resident * rows_max_warps<D>() / hkv;
    if (per_sm > 32) per_sm = 32;  // CTAs an SM holds at most
    // Splits as decode_split's: one wave, each of at least 128 keys (8 tiles) where the keys allow,
    // a->splits forcing a count (at least one tile each); every split a whole number of tiles.
    const int64_t lcap = a->max_ctx;
    const int64_t max_split = lcap > 0 ? (lcap + kTile - 1) / kTile : 1;
    const int64_t pref_split = lcap > 0 ? (lcap + 8 * kTile - 1) / (8 * kTile) : 1;
    int64_t nsplit = per_sm * sms / a->B;
    if (nsplit > pref_split) nsplit = pref_split;
    if (a->splits >= 1) nsplit = a->splits < max_split ? a->splits : max_split;
    if (nsplit < 1) nsplit = 1;
    if (nsplit > 1024) nsplit = 1024;
    int64_t chunk = lcap > 0 ? (lcap + nsplit - 1) / nsplit : 1;
    chunk = (chunk + kTile - 1) / kTile * kTile;
    float *ws = nullptr;
    const size_t ws_bytes = nsplit > 1 ? (size_t)(a->B * a->Hq * nsplit * (D + 2)) * sizeof(float) : 0;
    QK_SCRATCH_TRY(a->scratch, ws_bytes, s, &ws);
    qk_attn_decode_args p = *a;
    int ns = (int)nsplit;
    void *args[] = {&p, &ws, &ns, &chunk};
    int status = qk_launch_dependent(fn, dim3((unsigned)nsplit, (unsigned)a->B), dim3((unsigned)(32 * hkv)), rows_smem(hkv, D), s, args);
    return merge_splits<T, D>(&p, ws, ws_bytes, ns, status, s);
}

// The paged policy: decode_rows where it takes the call (D of 64 or 128, rows of at most 2 KB,
// G <= 16) and, picked automatically, where its (sequence, split) CTAs of >= 128 keys fill a wave;
// fewer, longer CTAs would leave SMs idle that decode_split's per-head CTAs use.  a->variant
// QK_DECODE_ROWS forces it wherever it takes the call; QK_DECODE_HEADS and QK_DECODE_WORKSPACE
// keep decode_split.
template <int D> bool rows_take(const qk_attn_decode_args *a, int sms) {
    if (D != 64 && D != 128) return false;
    if (a->Hq / a->Hkv > 16 || a->Hkv > rows_max_warps<D>()) return false;
    if (a->variant == QK_DECODE_ROWS) return true;
    if (a->variant != QK_DECODE_AUTO) return false;
    const int64_t pref_split = a->max_ctx > 0 ? (a->max_ctx + 8 * kTile - 1) / (8 * kTile) : 1;
    return a->B * pref_split >= sms;
}

template <typename T, int D, bool kPaged>
int pick_group(const qk_attn_decode_args *a, cudaStream_t s, int sms) {
    const int64_t G = a->Hq / a->Hkv;
    if constexpr (kPaged && (D == 64 || D == 128)) {
        if (rows_take<D>(a, sms)) return G <= 8 ? launch_rows<T, D, 8>(a, s, sms) : launch_rows<T, D, 16>(a, s, sms);
    }
    // The query heads of a kv head are the 16 rows of the mma's A operand: half of them when
    // there are at most 8 (the other half are zero registers), else groups of 16.
    if (G <= 8) return launch<T, D, 8, kPaged>(a, s, sms);
    return launch<T, D, 16, kPaged>(a, s, sms);
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
