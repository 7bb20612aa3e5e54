/* sparse_aggregate on the CPU: out[i,h,:] = sum_e edge_weight[e,h] * node_feat[col_idx[e],h,:].
 *
 * Rows are split between threads by cost (edges + rows, a prefix sum that row_ptr already is), so
 * one huge row next to millions of small ones does not stall the others beyond its own share.
 * Each row is summed by one thread in edge order in fp32: the result is independent of the
 * thread count.  Indices are validated as they are read; the first bad one is reported.
 * Feature rows are gathered at random, so the rows of the next few edges are prefetched while
 * the current one is accumulated. */
#include "cpu.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    qk_sparse_aggregate_args *a;
    int64_t first_edge, total_cost;
    /* per-thread: first bad col_idx position seen (-1 none) and its value */
    int64_t *bad_pos, *bad_value;
    int nomem;
} sa_job;

/* First row whose cost prefix (edges before it + the row index) reaches `target`. */
static int64_t sa_row_at(const sa_job *j, int64_t target) {
    const qk_sparse_aggregate_args *a = j->a;
    int64_t lo = 0, hi = a->num_dst;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        int64_t cost = qk_index(a->row_ptr, a->index_dtype, mid, a->row_ptr_stride) - j->first_edge + mid;
        if (cost < target) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

QK_MULTIVERSION static void sa_worker(void *p, int tid, int nthreads) {
    sa_job *j = p;
    const qk_sparse_aggregate_args *a = j->a;
    const int64_t H = a->num_heads, D = a->head_dim;
    const int64_t r0 = sa_row_at(j, j->total_cost * tid / nthreads);
    const int64_t r1 = tid == nthreads - 1 ? a->num_dst : sa_row_at(j, j->total_cost * (tid + 1) / nthreads);
    j->bad_pos[tid] = -1;
    if (r0 >= r1) return;
    float *acc = malloc(sizeof(float) * (size_t)(H * D > 0 ? H * D : 1));
    if (acc == NULL) {
        j->nomem = 1;
        return;
    }
    const float *ew = a->edge_weight, *nf = a->node_feat;
    float *out = a->out;
    const int nf_unit = a->nf_stride[2] == 1;
    /* bytes of one gathered row when its H*D values are contiguous (else prefetch the first line) */
    const int64_t row_bytes = nf_unit && a->nf_stride[1] == D ? H * D * (int64_t)sizeof(float) : 64;
    enum { AHEAD = 4 };
    for (int64_t row = r0; row < r1; row++) {
        const int64_t begin = qk_index(a->row_ptr, a->index_dtype, row, a->row_ptr_stride);
        const int64_t end = qk_index(a->row_ptr, a->index_dtype, row + 1, a->row_ptr_stride);
        memset(acc, 0, sizeof(float) * (size_t)(H * D));
        for (int64_t e = begin; e < end; e++) {
            if (e + AHEAD < end) {
                const int64_t ahead = qk_index(a->col_idx, a->index_dtype, e + AHEAD, a->col_idx_stride);
                if (ahead >= 0 && ahead < a->num_src) {
                    const char *line = (const char *)(nf + ahead * a->nf_stride[0]);
                    for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(line + off);
                }
            }
            const int64_t src = qk_index(a->col_idx, a->index_dtype, e, a->col_idx_stride);
            if (src < 0 || src >= a->num_src) {
                j->bad_pos[tid] = e;
                j->bad_value[tid] = src;
                free(acc);
                return;
            }
            for (int64_t h = 0; h < H; h++) {
                const float w = ew[e * a->ew_stride[0] + h * a->ew_stride[1]];
                const float *x = nf + src * a->nf_stride[0] + h * a->nf_stride[1];
                float *y = acc + h * D;
                if (nf_unit)
                    for (int64_t d = 0; d < D; d++) y[d] += w * x[d];
                else
                    for (int64_t d = 0; d < D; d++) y[d] += w * x[d * a->nf_stride[2]];
            }
        }
        for (int64_t h = 0; h < H; h++) {
            float *o = out + row * a->out_stride[0] + h * a->out_stride[1];
            for (int64_t d = 0; d < D; d++) o[d * a->out_stride[2]] = acc[h * D + d];
        }
    }
    free(acc);
}

int qk_sparse_aggregate_cpu(qk_sparse_aggregate_args *a, void *stream) {
    (void)stream;
    if (a->dtype != QK_F32 || (a->index_dtype != QK_I32 && a->index_dtype != QK_I64)) return QK_E_UNSUPPORTED;
    /* row_ptr must be a valid CSR prefix: 0 <= row_ptr[0] <= ... <= row_ptr[N] <= E. */
    int64_t prev = 0;
    for (int64_t i = 0; i <= a->num_dst; i++) {
        const int64_t v = qk_index(a->row_ptr, a->index_dtype, i, a->row_ptr_stride);
        if (v < prev || v > a->num_edges) {
            a->bad_arg = 0;
            a->bad_pos = i;
            a->bad_value = v;
            return QK_E_INDEX;
        }
        prev = v;
    }
    if (a->num_dst == 0) return QK_OK;
    sa_job j = {0};
    j.a = a;
    j.first_edge = qk_index(a->row_ptr, a->index_dtype, 0, a->row_ptr_stride);
    const int64_t edges = qk_index(a->row_ptr, a->index_dtype, a->num_dst, a->row_ptr_stride) - j.first_edge;
    j.total_cost = edges + a->num_dst;
    const int nthreads = qk_threads_for((edges + a->num_dst) * a->num_heads * (a->head_dim + 1),
                                        a->num_threads > 0 ? a->num_threads : 1);
    int64_t *bad = malloc(sizeof(int64_t) * 2 * (size_t)nthreads);
    if (bad == NULL) return QK_E_NOMEM;
    j.bad_pos = bad;
    j.bad_value = bad + nthreads;
    int status = qk_parallel_run(nthreads, sa_worker, &j);
    if (status == QK_OK && j.nomem) status = QK_E_NOMEM;
    for (int t = 0; status == QK_OK && t < nthreads; t++) {
        if (j.bad_pos[t] >= 0) {
            a->bad_arg = 1;
            a->bad_pos = j.bad_pos[t];
            a->bad_value = j.bad_value[t];
            status = QK_E_INDEX;
        }
    }
    free(bad);
    return status;
}
