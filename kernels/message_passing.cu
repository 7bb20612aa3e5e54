// message_passing: a gated message-passing layer (include/qkernels/launch.h) in two kernels.
//
// mp_rows: a warp takes a tile of kRows rows, either nodes (v = x w_v, into scratch) or edges (the
// edge features, the MLP, the gates into scratch, and e_out = LayerNorm(msg) + e).  Its rows sit in
// shared memory and each lane owns output columns, so one weight load feeds kRows rows.
// mp_nodes: a warp per tile of kRows nodes gathers its CSR rows' gated v rows (the entries' indices
// loaded a warp-width at a time), then agg w_o and x_out = LayerNorm(.) + x.
// fp32 only; the weights are read through L1 (a few KB at the decoder's H = 32).  An out-of-range
// index reads as a zero row (edges) or is skipped (CSR entries), never read out of bounds.
#include "common.cuh"

namespace {

constexpr int kWarps = 4;  // warps per block
constexpr int kRows = 8;   // rows per warp tile

__device__ __forceinline__ int64_t mp_index(const void *p, int dtype, int64_t pos) {
    return dtype == QK_I32 ? (int64_t)__ldg(static_cast<const int32_t *>(p) + pos)
                           : (int64_t)__ldg(static_cast<const int64_t *>(p) + pos);
}

// acc[r][j] += sum over i < n of in[r * ld + i] * w[i * ws0 + c * ws1] for lane column c = lane + 32 j
// (< cols); in is shared memory, zero from n up to n rounded up to 4 (16-byte broadcast reads).
template <int C>
__device__ __forceinline__ void mp_product(float (&acc)[kRows][C], const float *in, int ld, int n, const float *w,
                                           int64_t ws0, int64_t ws1, int cols, int lane) {
#pragma unroll 2
    for (int i = 0; i < n; i += 4) {
        float wv[4][C];
#pragma unroll
        for (int q = 0; q < 4; q++)
#pragma unroll
            for (int j = 0; j < C; j++) {
                const int c = lane + 32 * j;
                wv[q][j] = i + q < n && c < cols ? __ldg(w + (int64_t)(i + q) * ws0 + (int64_t)c * ws1) : 0.f;
            }
#pragma unroll
        for (int r = 0; r < kRows; r++) {
            const float4 f = *reinterpret_cast<const float4 *>(in + r * ld + i);
#pragma unroll
            for (int j = 0; j < C; j++) acc[r][j] += f.x * wv[0][j] + f.y * wv[1][j] + f.z * wv[2][j] + f.w * wv[3][j];
        }
    }
}

// Each of the tile's row values summed over the warp's lanes, the rows' butterflies side by side.
__device__ __forceinline__ void mp_warp_sums(float (&v)[kRows]) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int r = 0; r < kRows; r++) v[r] += __shfl_xor_sync(0xffffffffu, v[r], o);
}

// The tile's rows as LayerNorm(y) * gamma + beta + res (fused_norm_residual's: two-pass population
// variance, eps on it), row r stored at out + r * H for the lane's columns lane + 32 j and rows < rows;
// the rows' warp sums run side by side.
template <int C>
__device__ __forceinline__ void mp_norm_store(const float (&y)[kRows][C], const float (&res)[kRows][C],
                                              const float *gamma, int64_t gs, const float *beta, int64_t bs, float eps,
                                              int H, int lane, int rows, float *out) {
    float mean[kRows], rstd[kRows];
#pragma unroll
    for (int r = 0; r < kRows; r++) {
        mean[r] = 0.f;
#pragma unroll
        for (int j = 0; j < C; j++) mean[r] += lane + 32 * j < H ? y[r][j] : 0.f;
    }
    mp_warp_sums(mean);
#pragma unroll
    for (int r = 0; r < kRows; r++) {
        mean[r] /= (float)H;
        rstd[r] = 0.f;
#pragma unroll
        for (int j = 0; j < C; j++) {
            const float t = y[r][j] - mean[r];
            rstd[r] += lane + 32 * j < H ? t * t : 0.f;
        }
    }
    mp_warp_sums(rstd);
#pragma unroll
    for (int j = 0; j < C; j++) {
        const int c = lane + 32 * j;
        if (c >= H) continue;
        const float g = __ldg(gamma + c * gs), b = __ldg(beta + c * bs);
#pragma unroll
        for (int r = 0; r < kRows; r++)
            if (r < rows) out[r * H + c] = (y[r][j] - mean[r]) * rsqrtf(rstd[r] / (float)H + eps) * g + b + res[r][j];
    }
}

__host__ __device__ constexpr int mp_pad4(int n) { return (n + 3) & ~3; }

// Shared memory per warp of mp_rows<CH, CF>: kRows rows of the edge features (3H, padded) and of h (F).
template <int CH, int CF> constexpr size_t mp_rows_smem() {
    return (size_t)kWarps * kRows * (mp_pad4(3 * 32 * CH) + 32 * CF) * sizeof(float);
}

template <int CH, int CF>
__global__ void __launch_bounds__(32 * kWarps) mp_rows(qk_message_passing_args a, float *att, float *v) {
    extern __shared__ float4 mp_smem[];
    constexpr int LI = mp_pad4(3 * 32 * CH), LH = 32 * CF;  // row strides of the tiles
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float *in_s = reinterpret_cast<float *>(mp_smem) + warp * kRows * (LI + LH), *h_s = in_s + kRows * LI;
    const int H = (int)a.H, F = (int)a.F, K = (int)a.heads;
    const int64_t N = a.num_nodes, E = a.num_edges;
    const int64_t node_tiles = (N + kRows - 1) / kRows, tiles = node_tiles + (E + kRows - 1) / kRows;
    const float *x = static_cast<const float *>(a.x), *ea = static_cast<const float *>(a.e);
    qk_dependent_wait();
    for (int64_t t = (int64_t)blockIdx.x * kWarps + warp; t < tiles; t += (int64_t)gridDim.x * kWarps) {
        if (t < node_tiles) {  // v = x w_v for kRows nodes
            const int64_t n0 = t * kRows;
#pragma unroll
            for (int r = 0; r < kRows; r++)
#pragma unroll
                for (int j = 0; j < CH; j++) {
                    const int c = lane + 32 * j;
                    if (c < mp_pad4(H))
                        in_s[r * LI + c] = n0 + r < N && c < H ? __ldg(x + (n0 + r) * a.x_stride[0] + c * a.x_stride[1]) : 0.f;
                }
            __syncwarp();
            float acc[kRows][CH] = {};
            mp_product<CH>(acc, in_s, LI, H, static_cast<const float *>(a.w_v), a.wv_stride[0], a.wv_stride[1], H, lane);
#pragma unroll
            for (int r = 0; r < kRows; r++)
#pragma unroll
                for (int j = 0; j < CH; j++) {
                    const int c = lane + 32 * j;
                    if (n0 + r < N && c < H) v[(n0 + r) * H + c] = acc[r][j];
                }
            __syncwarp();
            continue;
        }
        const int64_t e0 = (t - node_tiles) * kRows;
        // The tile's indices in one round trip (lane r: edge r's src, lane kRows + r: its dst), then every
        // row's loads at once; rows past the last edge are zero.
        int64_t node = -1;
        if (lane < 2 * kRows && e0 + lane % kRows < E)
            node = mp_index(a.edge_index, a.ei_dtype, (lane / kRows) * a.ei_stride[0] + (e0 + lane % kRows) * a.ei_stride[1]);
#pragma unroll
        for (int r = 0; r < kRows; r++) {
            const int64_t s = __shfl_sync(0xffffffffu, node, r), d = __shfl_sync(0xffffffffu, node, kRows + r);
            const bool sv = s >= 0 && s < N, dv = d >= 0 && d < N, ev = e0 + r < E;
#pragma unroll
            for (int j = 0; j < CH; j++) {
                const int c = lane + 32 * j;
                if (c >= H) continue;
                const float u = sv ? __ldg(x + s * a.x_stride[0] + c * a.x_stride[1]) : 0.f;
                const float w = dv ? __ldg(x + d * a.x_stride[0] + c * a.x_stride[1]) : 0.f;
                in_s[r * LI + c] = u + w;
                in_s[r * LI + H + c] = fabsf(u - w);
                in_s[r * LI + 2 * H + c] = ev ? __ldg(ea + (e0 + r) * a.e_stride[0] + c * a.e_stride[1]) : 0.f;
            }
        }
        if (lane < 4 * kRows && 3 * H + lane % 4 < mp_pad4(3 * H)) in_s[(lane / 4) * LI + 3 * H + lane % 4] = 0.f;
        __syncwarp();
        {  // h = relu(ef w1 + b1), zero-padded to a multiple of 4
            float acc[kRows][CF] = {};
            mp_product<CF>(acc, in_s, LI, 3 * H, static_cast<const float *>(a.w1), a.w1_stride[0], a.w1_stride[1], F,
                           lane);
#pragma unroll
            for (int j = 0; j < CF; j++) {
                const int c = lane + 32 * j;
                const float b = c < F ? __ldg(static_cast<const float *>(a.b1) + c * a.b1_stride) : 0.f;
#pragma unroll
                for (int r = 0; r < kRows; r++)
                    if (c < mp_pad4(F)) h_s[r * LH + c] = c < F ? fmaxf(acc[r][j] + b, 0.f) : 0.f;
            }
        }
        __syncwarp();
        if (lane < K) {  // the gates: a lane per head
            const float *wa = static_cast<const float *>(a.w_att) + lane * a.wa_stride[1];
            float g[kRows];
#pragma unroll
            for (int r = 0; r < kRows; r++) g[r] = 0.f;
#pragma unroll 2
            for (int i = 0; i < F; i += 4) {
                float w[4];
#pragma unroll
                for (int q = 0; q < 4; q++) w[q] = i + q < F ? __ldg(wa + (i + q) * a.wa_stride[0]) : 0.f;
#pragma unroll
                for (int r = 0; r < kRows; r++) {
                    const float4 hv = *reinterpret_cast<const float4 *>(h_s + r * LH + i);
                    g[r] += hv.x * w[0] + hv.y * w[1] + hv.z * w[2] + hv.w * w[3];
                }
            }
            const float b = __ldg(static_cast<const float *>(a.b_att) + lane * a.ba_stride);
#pragma unroll
            for (int r = 0; r < kRows; r++)
                if (e0 + r < E) att[(e0 + r) * K + lane] = 1.f / (1.f + expf(-(g[r] + b)));
        }
        float msg[kRows][CH] = {}, res[kRows][CH];  // msg = h w_msg + b_msg, then e_out = LayerNorm(msg) + e
        mp_product<CH>(msg, h_s, LH, F, static_cast<const float *>(a.w_msg), a.wm_stride[0], a.wm_stride[1], H, lane);
#pragma unroll
        for (int j = 0; j < CH; j++) {
            const int c = lane + 32 * j;
            const float b = c < H ? __ldg(static_cast<const float *>(a.b_msg) + c * a.bm_stride) : 0.f;
#pragma unroll
            for (int r = 0; r < kRows; r++) {
                msg[r][j] += b;
                res[r][j] = c < H ? in_s[r * LI + 2 * H + c] : 0.f;
            }
        }
        mp_norm_store<CH>(msg, res, static_cast<const float *>(a.gamma_e), a.ge_stride,
                          static_cast<const float *>(a.beta_e), a.be_stride, a.eps, H, lane, (int)min((int64_t)kRows, E - e0),
                          static_cast<float *>(a.e_out) + e0 * H);
        __syncwarp();
    }
}

template <int CH>
__global__ void __launch_bounds__(32 * kWarps) mp_nodes(qk_message_passing_args a, const float *att, const float *v) {
    constexpr int LA = 32 * CH;
    __shared__ __align__(16) float agg_s[kWarps][kRows * LA];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float *agg = agg_s[warp];
    const int H = (int)a.H, K = (int)a.heads, hd = H / K;
    const int64_t N = a.num_nodes, M = a.num_entries, tiles = (N + kRows - 1) / kRows;
    const float *x = static_cast<const float *>(a.x);
    int head[CH];  // the gate of each of the lane's columns
#pragma unroll
    for (int j = 0; j < CH; j++) head[j] = (lane + 32 * j) / hd;
    qk_dependent_wait();
    for (int64_t t = (int64_t)blockIdx.x * kWarps + warp; t < tiles; t += (int64_t)gridDim.x * kWarps) {
        const int64_t n0 = t * kRows;
        const int rows = (int)min((int64_t)kRows, N - n0);
        // row_ptr[n0 .. n0 + rows] in lanes 0 .. rows, clamped into [0, M] and made non-decreasing (a
        // malformed row_ptr is never followed out of the CSR)
        int64_t rp = 0;
        if (lane <= rows) rp = min(max(mp_index(a.row_ptr, a.csr_dtype, (n0 + lane) * a.rp_stride), (int64_t)0), M);
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int64_t up = __shfl_up_sync(0xffffffffu, rp, o);
            if (lane >= o && lane <= rows) rp = max(rp, up);
        }
        int64_t bound[kRows + 1];
#pragma unroll
        for (int r = 0; r <= kRows; r++) bound[r] = __shfl_sync(0xffffffffu, rp, r < rows ? r : rows);
#pragma unroll
        for (int r = 0; r < kRows; r++)
#pragma unroll
            for (int j = 0; j < CH; j++) agg[r * LA + lane + 32 * j] = 0.f;
        __syncwarp();
        // The tile's entries in order, each lane holding one entry's source, edge and row per round;
        // four entries' loads in flight at a time, each added to its row in entry order.
        for (int64_t base = bound[0]; base < bound[kRows]; base += 32) {
            int64_t col = -1, ed = 0;
            int row = 0;
            if (base + lane < bound[kRows]) {
                const int64_t j = base + lane;
                col = mp_index(a.col_idx, a.csr_dtype, j * a.ci_stride);
                ed = mp_index(a.dir_edge, a.de_dtype, j * a.de_stride);
                if (col < 0 || col >= N || ed < 0 || ed >= a.num_edges) col = -1;
#pragma unroll
                for (int r = 1; r < kRows; r++) row += j >= bound[r];
            }
            const int cnt = (int)min((int64_t)32, bound[kRows] - base);
            for (int q = 0; q < cnt; q += 4) {
                float av[4][CH], vv[4][CH];
                int rq[4];
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    const int64_t cq = __shfl_sync(0xffffffffu, col, (q + u) & 31);
                    const int64_t eq = __shfl_sync(0xffffffffu, ed, (q + u) & 31);
                    rq[u] = __shfl_sync(0xffffffffu, row, (q + u) & 31);
                    const bool ok = q + u < cnt && cq >= 0;
#pragma unroll
                    for (int j = 0; j < CH; j++) {
                        const int c = lane + 32 * j;
                        av[u][j] = ok && c < H ? __ldg(att + eq * K + head[j]) : 0.f;
                        vv[u][j] = ok && c < H ? __ldg(v + cq * H + c) : 0.f;
                    }
                }
#pragma unroll
                for (int u = 0; u < 4; u++)
#pragma unroll
                    for (int j = 0; j < CH; j++) agg[rq[u] * LA + lane + 32 * j] += av[u][j] * vv[u][j];
            }
        }
        __syncwarp();
        float y[kRows][CH] = {}, res[kRows][CH];
        mp_product<CH>(y, agg, LA, H, static_cast<const float *>(a.w_o), a.wo_stride[0], a.wo_stride[1], H, lane);
#pragma unroll
        for (int r = 0; r < kRows; r++)
#pragma unroll
            for (int j = 0; j < CH; j++) {
                const int c = lane + 32 * j;
                res[r][j] = r < rows && c < H ? __ldg(x + (n0 + r) * a.x_stride[0] + c * a.x_stride[1]) : 0.f;
            }
        mp_norm_store<CH>(y, res, static_cast<const float *>(a.gamma_x), a.gx_stride, static_cast<const float *>(a.beta_x),
                          a.bx_stride, a.eps, H, lane, rows, static_cast<float *>(a.x_out) + n0 * H);
        __syncwarp();
    }
}

template <int CH, int CF>
int mp_launch(const qk_message_passing_args *a, float *att, float *v, cudaStream_t s) {
    const void *rows = (const void *)mp_rows<CH, CF>, *nodes = (const void *)mp_nodes<CH>;
    constexpr size_t smem = mp_rows_smem<CH, CF>();
    int resident, sms;
    const int opt = qk_kernel_residency(rows, 32 * kWarps, smem, &resident);
    if (opt) return opt;
    QK_CUDA_TRY((cudaError_t)qk_sm_count(&sms));
    qk_message_passing_args p = *a;
    const int64_t row_tiles = (a->num_nodes + kRows - 1) / kRows + (a->num_edges + kRows - 1) / kRows;
    void *args[] = {&p, &att, &v};
    int status = qk_launch_dependent(rows, dim3(qk_grid_for(row_tiles, kWarps, resident * sms)), dim3(32 * kWarps),
                                     smem, s, args);
    if (status) return status;
    const float *catt = att, *cv = v;
    void *nargs[] = {&p, &catt, &cv};
    const int64_t node_tiles = (a->num_nodes + kRows - 1) / kRows;
    return qk_launch_dependent(nodes, dim3(qk_grid_for(node_tiles, kWarps, 16 * sms)), dim3(32 * kWarps), 0, s, nargs);
}

template <int CH>
int mp_pick_f(const qk_message_passing_args *a, float *att, float *v, cudaStream_t s) {
    switch ((a->F + 31) / 32) {
    case 1: return mp_launch<CH, 1>(a, att, v, s);
    case 2: return mp_launch<CH, 2>(a, att, v, s);
    case 3: return mp_launch<CH, 3>(a, att, v, s);
    default: return mp_launch<CH, 4>(a, att, v, s);
    }
}

}  // namespace

extern "C" int qk_message_passing_cuda(const qk_message_passing_args *a, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    if (a->dtype != QK_F32) return QK_E_UNSUPPORTED;
    if ((a->ei_dtype != QK_I32 && a->ei_dtype != QK_I64) || (a->csr_dtype != QK_I32 && a->csr_dtype != QK_I64) ||
        (a->de_dtype != QK_I32 && a->de_dtype != QK_I64))
        return QK_E_UNSUPPORTED;
    // A lane per gate and at most four columns per lane of H and F.
    if (a->H < 1 || a->H > 128 || a->F < 1 || a->F > 128 || a->heads < 1 || a->heads > 32 || a->H % a->heads)
        return QK_E_UNSUPPORTED;
    if (a->num_nodes == 0 && a->num_edges == 0) return QK_OK;
    const size_t att_bytes = (size_t)a->num_edges * (size_t)a->heads * sizeof(float);
    const size_t bytes = att_bytes + (size_t)a->num_nodes * (size_t)a->H * sizeof(float);
    char *base = nullptr;
    QK_SCRATCH_TRY(a->scratch, bytes, s, &base);
    float *att = (float *)base, *v = (float *)(base + att_bytes);
    int status;
    switch ((a->H + 31) / 32) {
    case 1: status = mp_pick_f<1>(a, att, v, s); break;
    case 2: status = mp_pick_f<2>(a, att, v, s); break;
    case 3: status = mp_pick_f<3>(a, att, v, s); break;
    default: status = mp_pick_f<4>(a, att, v, s); break;
    }
    const int freed = qk_scratch_free(a->scratch, base, bytes, s);
    return status ? status : freed;
}
