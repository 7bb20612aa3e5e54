// rotary_emb: rotate each (x_e, x_o) pair of every (token, head) row by that token's (cos, sin):
//   (x_e c - x_o s, x_e s + x_o c), fp32 arithmetic, one rounding; interleaved pairs (2i, 2i+1) or
//   rotate-half pairs (i, i + D/2).  In place when out == x: every thread reads all the pairs it
//   owns before writing them, and no two threads own the same element.  rotary_emb_backward
//   (a.inverse) runs the same kernels with s negated as it is loaded: the rotation by -angle.
//
// Work decomposition: a 256-thread block owns `tpb` tokens; inside it a thread owns one chunk j of
// a row (16 bytes = 4 interleaved pairs; rotate-half: both halves of 8 pairs, two 16-byte pieces;
// one pair on the scalar path) and walks the heads h = hs, hs + hpar, ... two at a time, so it
// loads that chunk's (cos, sin) once per token and has two heads' loads in flight.  The thread's
// (j, hs, token) split is computed once; blocks then stride over token groups, and blockIdx.y over
// the batch.  Grid from shapes and the SM count only (CUDA-graph safe).
// Bytes: read x, write out, read the table once per token: T*H*D*2*2 + T*D*4; T=32k, H=32, D=128
// bf16: 554 MB, 140 µs at 4 TB/s.
#include "common.cuh"
#include "rotary.cuh"

namespace {

constexpr int kThreads = 256;

enum { kScalar = 0, kVecInterleaved = 1, kVecHalf = 2 };

// Rotate-half, the 8 pairs of chunk j (x[8j ..] and x[half + 8j ..], 16 bytes each) of heads hs,
// hs + 2 hpar, ... of one token, two heads (h, h + hpar) a step.
template <typename T, bool kFVec>
__device__ __forceinline__ void ro_half_heads(const qk_rotary_emb_args &a, const T *xt, T *ot, const float *ft, int j,
                                              int64_t hs, int64_t H, int hpar, int64_t half) {
    float c[8], sn[8];
    ro_load_freqs<8, kFVec>(ft, 8 * (int64_t)j, a.f_stride[2], a.inverse ? -1.f : 1.f, c, sn);
    for (int64_t h = hs; h < H; h += 2 * hpar) {
        const bool two = h + hpar < H;
        const T *x0 = xt + h * a.x_stride[2] + 8 * j, *x1 = xt + (h + hpar) * a.x_stride[2] + 8 * j;
        uint4 lo0 = ro_load16(x0), hi0 = ro_load16(x0 + half), lo1 = lo0, hi1 = hi0;
        if (two) {
            lo1 = ro_load16(x1);
            hi1 = ro_load16(x1 + half);
        }
        ro_rotate_halves<T>(lo0, hi0, c, sn);
        ro_rotate_halves<T>(lo1, hi1, c, sn);
        T *o0p = ot + h * a.out_stride[2] + 8 * j, *o1p = ot + (h + hpar) * a.out_stride[2] + 8 * j;
        ro_store16(o0p, lo0);
        ro_store16(o0p + half, hi0);
        if (two) {
            ro_store16(o1p, lo1);
            ro_store16(o1p + half, hi1);
        }
    }
}

template <typename T, int kMode, bool kFVec>
__global__ void __launch_bounds__(kThreads, kMode == kVecHalf ? 3 : 4) ro_kernel(qk_rotary_emb_args a, int nc, int nct, int hpar, int tpb,
                                                      int64_t ngroups) {
    const int tid = threadIdx.x;
    const int jt = tid % nct, r = tid / nct;
    const int hs = r % hpar, tl = r / hpar;
    if (tl >= tpb) return;
    const T *x = static_cast<const T *>(a.x);
    T *out = static_cast<T *>(a.out);
    const int64_t H = a.H, half = a.D / 2;
    const float sg = a.inverse ? -1.f : 1.f;
    for (int64_t b = blockIdx.y; b < a.B; b += gridDim.y) {
        for (int64_t grp = blockIdx.x; grp < ngroups; grp += gridDim.x) {
            const int64_t s = grp * tpb + tl;
            if (s >= a.S) continue;
            const T *xt = x + b * a.x_stride[0] + s * a.x_stride[1];
            T *ot = out + b * a.out_stride[0] + s * a.out_stride[1];
            const float *ft = a.freqs + b * a.f_stride[0] + s * a.f_stride[1];
            for (int j = jt; j < nc; j += nct) {
                if (kMode == kScalar) {
                    const float c = __ldg(ft + j * a.f_stride[2]), sn = sg * __ldg(ft + j * a.f_stride[2] + 1);
                    const int64_t ie = a.interleaved ? 2 * j : j, io = a.interleaved ? 2 * j + 1 : j + half;
                    for (int64_t h = hs; h < H; h += hpar) {
                        const T *xr = xt + h * a.x_stride[2];
                        T *orow = ot + h * a.out_stride[2];
                        const float xe = qk_to_float(xr[ie]), xo = qk_to_float(xr[io]);
                        orow[ie] = qk_from_float<T>(ro_lo(xe, xo, c, sn));
                        orow[io] = qk_from_float<T>(ro_hi(xe, xo, c, sn));
                    }
                } else if (kMode == kVecInterleaved) {
                    float c[4], sn[4];
                    ro_load_freqs<4, kFVec>(ft, 4 * (int64_t)j, a.f_stride[2], sg, c, sn);
                    for (int64_t h = hs; h < H; h += 2 * hpar) {
                        const bool two = h + hpar < H;
                        // Both heads' loads before any store: out may alias x, so the compiler
                        // could not hoist the second load above the first store itself.
                        uint4 v0 = ro_load16(xt + h * a.x_stride[2] + 8 * j), v1 = v0;
                        if (two) v1 = ro_load16(xt + (h + hpar) * a.x_stride[2] + 8 * j);
                        ro_rotate_pairs<T>(v0, c, sn);
                        ro_rotate_pairs<T>(v1, c, sn);
                        ro_store16(ot + h * a.out_stride[2] + 8 * j, v0);
                        if (two) ro_store16(ot + (h + hpar) * a.out_stride[2] + 8 * j, v1);
                    }
                } else {  // kVecHalf: pairs 8j .. 8j+7 are x[8j ..] and x[half + 8j ..]
                    ro_half_heads<T, kFVec>(a, xt, ot, ft, j, hs, H, hpar, half);
                }
            }
        }
    }
}

template <typename T>
int ro_launch(const qk_rotary_emb_args *a, cudaStream_t stream) {
    constexpr int V = 8;  // 16 bytes of a 2-byte type
    bool strides_vec = qk_aligned16(a->x) && qk_aligned16(a->out);
    for (int i = 0; i < 3; i++) strides_vec = strides_vec && a->x_stride[i] % V == 0 && a->out_stride[i] % V == 0;
    int mode = kScalar;
    if (strides_vec && a->interleaved && a->D % 8 == 0) mode = kVecInterleaved;
    if (strides_vec && !a->interleaved && a->D % 16 == 0) mode = kVecHalf;
    // Rotate-half: two 16-byte chunks per thread, the lower and the upper half of 8 pairs; it beat
    // partner lanes swapping halves and 8 bytes of each half per thread (benchmarks/probe/
    // rotary_half_variants.cu holds both; docs/rotary_emb.md has the figures).
    const bool fvec = a->f_stride[2] == 2 && qk_aligned16(a->freqs) && a->f_stride[0] % 4 == 0 &&
                      a->f_stride[1] % 4 == 0;
    const int64_t nc64 = mode == kVecInterleaved ? a->D / 8 : mode == kVecHalf ? a->D / 16 : a->D / 2;
    // Threads of a block: nct over chunks, then hpar over heads, then tpb tokens.
    const int nct = (int)(nc64 < kThreads ? nc64 : kThreads);
    const int per_token = kThreads / nct;
    // Vector paths take two heads per thread where the heads allow: two rows' loads in flight and
    // the chunk's (cos, sin) loaded once for both.
    const int64_t heads = mode == kScalar ? a->H : (a->H + 1) / 2;
    const int hpar = (int)(heads < per_token ? heads : per_token);
    const int tpb = per_token / hpar;
    const int64_t ngroups = (a->S + tpb - 1) / tpb;
    int sms;
    QK_CUDA_TRY((cudaError_t)qk_sm_count(&sms));
    // Three or four 256-thread blocks fill an SM; 32 per SM bound the grid-stride loop's tail.
    const int64_t cap = (int64_t)sms * 32;
    const int64_t by = a->B < 65535 ? a->B : 65535;
    int64_t bx = (cap + by - 1) / by;
    if (bx > ngroups) bx = ngroups;
    if (bx < 1) bx = 1;
    qk_rotary_emb_args p = *a;
    int nc = (int)nc64;
    int64_t ng = ngroups;
    int nct_ = nct, hpar_ = hpar, tpb_ = tpb;
    void *args[] = {&p, &nc, &nct_, &hpar_, &tpb_, &ng};
    const void *kernel;
    if (mode == kVecInterleaved)
        kernel = fvec ? (const void *)ro_kernel<T, kVecInterleaved, true> : (const void *)ro_kernel<T, kVecInterleaved, false>;
    else if (mode == kVecHalf)
        kernel = fvec ? (const void *)ro_kernel<T, kVecHalf, true> : (const void *)ro_kernel<T, kVecHalf, false>;
    else
        kernel = (const void *)ro_kernel<T, kScalar, false>;
    return qk_launch(kernel, dim3((unsigned)bx, (unsigned)by), dim3(kThreads), 0, stream, args);
}

}  // namespace

extern "C" int qk_rotary_emb_cuda(const qk_rotary_emb_args *a, void *stream) {
    if (a->B <= 0 || a->S <= 0 || a->H <= 0 || a->D <= 0) return QK_OK;
    if (a->D % 2) return QK_E_UNSUPPORTED;
    switch (a->dtype) {
    case QK_F16: return ro_launch<__half>(a, (cudaStream_t)stream);
    case QK_BF16: return ro_launch<__nv_bfloat16>(a, (cudaStream_t)stream);
    default: return QK_E_UNSUPPORTED;  // float32 on cuda is staged through the cpu backend
    }
}
