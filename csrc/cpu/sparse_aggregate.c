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

/* Gathered [H, D] float rows are prefetched this many edges ahead, whole when their H*D values are
 * contiguous (stride1 == D, stride2 == 1), else their first cache line. */
enum { SA_AHEAD = 4 };

static inline int64_t sa_row_bytes(int64_t H, int64_t D, int64_t stride1, int64_t stride2) {
    return stride2 == 1 && stride1 == D ? H * D * (int64_t)sizeof(float) : 64;
}

static inline void sa_prefetch(const float *row, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)row + off);
}

/* col_idx[e], or -1 with e and a column outside [0, num_src) in *bad_pos, *bad_value (the caller's
 * thread slots); meanwhile node_feat's row for edge e + SA_AHEAD is prefetched when that edge is
 * before end and its column in range. */
QK_INLINE int64_t sa_source(const void *col_idx, int index_dtype, int64_t col_stride, int64_t num_src, const float *nf,
                            int64_t nf_stride0, int64_t e, int64_t end, int64_t bytes, int64_t *bad_pos,
                            int64_t *bad_value) {
    if (e + SA_AHEAD < end) {
        const int64_t ahead = qk_index(col_idx, index_dtype, e + SA_AHEAD, col_stride);
        if (ahead >= 0 && ahead < num_src) sa_prefetch(nf + ahead * nf_stride0, bytes);
    }
    const int64_t src = qk_index(col_idx, index_dtype, e, col_stride);
    if (src >= 0 && src < num_src) return src;
    *bad_pos = e;
    *bad_value = src;
    return -1;
}

int64_t qk_csr_row_at(const void *row_ptr, int index_dtype, int64_t stride, int64_t n, int64_t first_edge,
                      int64_t target) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (qk_index(row_ptr, index_dtype, mid, stride) - first_edge + mid < target) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static int64_t sa_row_at(const sa_job *j, int64_t target) {
    const qk_sparse_aggregate_args *a = j->a;
    return qk_csr_row_at(a->row_ptr, a->index_dtype, a->row_ptr_stride, a->num_dst, j->first_edge, target);
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
    const int64_t row_bytes = sa_row_bytes(H, D, a->nf_stride[1], a->nf_stride[2]);
    for (int64_t row = r0; row < r1; row++) {
        const int64_t begin = qk_index(a->row_ptr, a->index_dtype, row, a->row_ptr_stride);
        const int64_t end = qk_index(a->row_ptr, a->index_dtype, row + 1, a->row_ptr_stride);
        memset(acc, 0, sizeof(float) * (size_t)(H * D));
        for (int64_t e = begin; e < end; e++) {
            const int64_t src = sa_source(a->col_idx, a->index_dtype, a->col_idx_stride, a->num_src, nf,
                                          a->nf_stride[0], e, end, row_bytes, &j->bad_pos[tid], &j->bad_value[tid]);
            if (src < 0) {
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

/* Both launchers' status once their workers ran (status): QK_E_NOMEM where a worker could not
 * allocate, else QK_E_INDEX with bad_arg 1 (col_idx) where a thread recorded an out-of-range source (the
 * lowest such thread's position and value). */
static int sa_run_status(int status, int nomem, int nthreads, const int64_t *thread_pos, const int64_t *thread_value,
                         int *bad_arg, int64_t *pos, int64_t *value) {
    if (status == QK_OK && nomem) status = QK_E_NOMEM;
    for (int t = 0; status == QK_OK && t < nthreads; t++) {
        if (thread_pos[t] >= 0) {
            *bad_arg = 1;
            *pos = thread_pos[t];
            *value = thread_value[t];
            status = QK_E_INDEX;
        }
    }
    return status;
}

int qk_csr_check(const void *row_ptr, int index_dtype, int64_t stride, int64_t n, int64_t E, int whole, int64_t *pos,
                 int64_t *value) {
    int64_t prev = 0;
    for (int64_t i = 0; i <= n; i++) {
        const int64_t v = qk_index(row_ptr, index_dtype, i, stride);
        if (v < prev || v > E || (whole && ((i == 0 && v != 0) || (i == n && v != E)))) {
            *pos = i;
            *value = v;
            return QK_E_INDEX;
        }
        prev = v;
    }
    return QK_OK;
}

/* The checks both launchers start with: float32 features and int32/int64 indices (else
 * QK_E_UNSUPPORTED), and row_ptr [n + 1] a valid CSR prefix 0 <= row_ptr[0] <= ... <= row_ptr[n] <= E
 * (else QK_E_INDEX with *bad_arg 0 and the first offending position and value in *pos, *value). */
static int sa_check_csr(int dtype, const void *row_ptr, int index_dtype, int64_t stride, int64_t n, int64_t E,
                        int *bad_arg, int64_t *pos, int64_t *value) {
    if (dtype != QK_F32 || (index_dtype != QK_I32 && index_dtype != QK_I64)) return QK_E_UNSUPPORTED;
    const int status = qk_csr_check(row_ptr, index_dtype, stride, n, E, 0, pos, value);
    if (status == QK_E_INDEX) *bad_arg = 0;
    return status;
}

int qk_sparse_aggregate_cpu(qk_sparse_aggregate_args *a, void *stream) {
    (void)stream;
    const int checked = sa_check_csr(a->dtype, a->row_ptr, a->index_dtype, a->row_ptr_stride, a->num_dst,
                                     a->num_edges, &a->bad_arg, &a->bad_pos, &a->bad_value);
    if (checked != QK_OK) return checked;
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
    status = sa_run_status(status, j.nomem, nthreads, j.bad_pos, j.bad_value, &a->bad_arg, &a->bad_pos, &a->bad_value);
    free(bad);
    return status;
}

/* ---- sparse_aggregate_backward ----------------------------------------------------------------
 * grad_edge_weight alone: rows split by cost as above, each edge's H dot products from the row's
 * grad_out and the gathered node_feat row.  grad_node_feat: the edges in range are grouped by
 * column (qk_group_by_key: stable, so each source sees its edges in ascending order), then
 * sources are split by cost; a source sums edge_weight * grad_out[row] over its edges in that
 * order in fp32 and, when wanted, computes the same edges' grad_edge_weight from the grad_out rows
 * it has just read and its own node_feat row, so each grad_out row is gathered once per edge.
 * Dot products keep 8 partial sums (d mod 8) added in a fixed tree: vectorisable and the same bits
 * on every clone. */

#define SAB_LANES 8

static inline float sab_dot(const float *x, int64_t sx, const float *y, int64_t sy, int64_t n) {
    float lane[SAB_LANES] = {0};
    int64_t d = 0;
    for (; d + SAB_LANES <= n; d += SAB_LANES)
        for (int l = 0; l < SAB_LANES; l++) lane[l] += x[(d + l) * sx] * y[(d + l) * sy];
    float s = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
    for (; d < n; d++) s += x[d * sx] * y[d * sy];
    return s;
}

static inline void sab_axpy(float *restrict acc, float w, const float *x, int64_t sx, int64_t n) {
    for (int64_t d = 0; d < n; d++) acc[d] += w * x[d * sx];
}

typedef struct {
    qk_sparse_aggregate_backward_args *a;
    int64_t lo, hi, total_cost;
    const int64_t *off, *order; /* per source: its edges (as e - lo) in ascending order */
    int64_t *row_of;            /* [hi - lo]: the row of edge lo + k */
    const int32_t *pedge, *prow; /* with a plan: entry k's edge and row (order and row_of unused) */
    int64_t *bad_pos, *bad_value;
    int phase, nomem;
} sab_job;

static int64_t sab_row_at(const qk_sparse_aggregate_backward_args *a, int64_t first_edge, int64_t target) {
    return qk_csr_row_at(a->row_ptr, a->index_dtype, a->row_ptr_stride, a->num_dst, first_edge, target);
}

/* Rows [r0, r1): phase 0 records each edge's row; phase 1 computes grad_edge_weight. */
QK_MULTIVERSION static void sab_rows(sab_job *j, int tid, int64_t r0, int64_t r1) {
    const qk_sparse_aggregate_backward_args *a = j->a;
    const int64_t H = a->num_heads, D = a->head_dim;
    const float *go = a->grad_out, *nf = a->node_feat;
    float *gew = a->grad_edge_weight;
    const int unit = a->go_stride[2] == 1 && a->nf_stride[2] == 1;
    const int64_t row_bytes = sa_row_bytes(H, D, a->nf_stride[1], a->nf_stride[2]);
    for (int64_t row = r0; row < r1; row++) {
        const int64_t begin = qk_index(a->row_ptr, a->index_dtype, row, a->row_ptr_stride);
        const int64_t end = qk_index(a->row_ptr, a->index_dtype, row + 1, a->row_ptr_stride);
        if (j->phase == 0) {
            for (int64_t e = begin; e < end; e++) j->row_of[e - j->lo] = row;
            continue;
        }
        const float *g = go + row * a->go_stride[0];
        for (int64_t e = begin; e < end; e++) {
            const int64_t src = sa_source(a->col_idx, a->index_dtype, a->col_idx_stride, a->num_src, nf,
                                          a->nf_stride[0], e, end, row_bytes, &j->bad_pos[tid], &j->bad_value[tid]);
            if (src < 0) return;
            const float *x = nf + src * a->nf_stride[0];
            for (int64_t h = 0; h < H; h++)
                gew[e * H + h] = unit ? sab_dot(g + h * a->go_stride[1], 1, x + h * a->nf_stride[1], 1, D)
                                      : sab_dot(g + h * a->go_stride[1], a->go_stride[2], x + h * a->nf_stride[1],
                                                a->nf_stride[2], D);
        }
    }
}

/* Sources [s0, s1): grad_node_feat, and grad_edge_weight of their edges when wanted. */
QK_MULTIVERSION static void sab_sources(sab_job *j, float *acc, int64_t s0, int64_t s1) {
    const qk_sparse_aggregate_backward_args *a = j->a;
    const int64_t H = a->num_heads, D = a->head_dim;
    const float *go = a->grad_out, *nf = a->node_feat, *ew = a->edge_weight;
    float *gew = a->grad_edge_weight, *gnf = a->grad_node_feat;
    const int unit = a->go_stride[2] == 1 && a->nf_stride[2] == 1;
    const int64_t row_bytes = sa_row_bytes(H, D, a->go_stride[1], a->go_stride[2]);
    for (int64_t src = s0; src < s1; src++) {
        const int64_t begin = j->off[src], end = j->off[src + 1];
        const float *x = nf + src * a->nf_stride[0];
        memset(acc, 0, sizeof(float) * (size_t)(H * D));
        for (int64_t k = begin; k < end; k++) {
            int64_t e, row;
            if (j->pedge) { /* a plan's entry out of range is skipped, never followed */
                e = j->pedge[k];
                row = j->prow[k];
                if (e < 0 || e >= a->num_edges || row < 0 || row >= a->num_dst) continue;
                if (k + SA_AHEAD < end) {
                    const int64_t ahead = j->prow[k + SA_AHEAD];
                    if (ahead >= 0 && ahead < a->num_dst) sa_prefetch(go + ahead * a->go_stride[0], row_bytes);
                }
            } else {
                if (k + SA_AHEAD < end) sa_prefetch(go + j->row_of[j->order[k + SA_AHEAD]] * a->go_stride[0], row_bytes);
                e = j->lo + j->order[k];
                row = j->row_of[j->order[k]];
            }
            const float *g = go + row * a->go_stride[0];
            for (int64_t h = 0; h < H; h++) {
                const float w = ew[e * a->ew_stride[0] + h * a->ew_stride[1]];
                const float *gh = g + h * a->go_stride[1];
                if (unit) sab_axpy(acc + h * D, w, gh, 1, D);
                else sab_axpy(acc + h * D, w, gh, a->go_stride[2], D);
                if (gew)
                    gew[e * H + h] = unit ? sab_dot(gh, 1, x + h * a->nf_stride[1], 1, D)
                                          : sab_dot(gh, a->go_stride[2], x + h * a->nf_stride[1], a->nf_stride[2], D);
            }
        }
        memcpy(gnf + src * H * D, acc, sizeof(float) * (size_t)(H * D));
    }
}

static void sab_worker(void *p, int tid, int nthreads) {
    sab_job *j = p;
    const qk_sparse_aggregate_backward_args *a = j->a;
    j->bad_pos[tid] = -1;
    if (j->phase < 2) {
        const int64_t r0 = sab_row_at(a, j->lo, j->total_cost * tid / nthreads);
        const int64_t r1 = tid == nthreads - 1 ? a->num_dst : sab_row_at(a, j->lo, j->total_cost * (tid + 1) / nthreads);
        if (r0 < r1) sab_rows(j, tid, r0, r1);
        return;
    }
    const int64_t s0 = qk_group_at(j->off, a->num_src, j->total_cost * tid / nthreads);
    const int64_t s1 = tid == nthreads - 1 ? a->num_src : qk_group_at(j->off, a->num_src, j->total_cost * (tid + 1) / nthreads);
    if (s0 >= s1) return;
    float *acc = malloc(sizeof(float) * (size_t)(a->num_heads * a->head_dim > 0 ? a->num_heads * a->head_dim : 1));
    if (acc == NULL) {
        j->nomem = 1;
        return;
    }
    sab_sources(j, acc, s0, s1);
    free(acc);
}

static int sab_run(sab_job *j, int phase, int64_t work) {
    qk_sparse_aggregate_backward_args *a = j->a;
    j->phase = phase;
    const int nthreads = qk_threads_for(work, a->num_threads > 0 ? a->num_threads : 1);
    const int status = qk_parallel_run(nthreads, sab_worker, j);
    return sa_run_status(status, j->nomem, nthreads, j->bad_pos, j->bad_value, &a->bad_arg, &a->bad_pos, &a->bad_value);
}

/* The m CSR entries from lo grouped by source column (qk_group_by_key: off [num_src + 1], order);
 * a column outside [0, num_src) gives QK_E_INDEX with *bad_arg 1 and its position and value. */
static int sa_group_sources(const void *col_idx, int index_dtype, int64_t stride, int64_t lo, int64_t m, int64_t num_src,
                            int maxt, int64_t *off, int64_t *order, int *bad_arg, int64_t *bad_pos, int64_t *bad_value) {
    const int64_t first = lo * stride; /* the key of item k is col_idx[lo + k] */
    const void *base = index_dtype == QK_I32 ? (const void *)((const int32_t *)col_idx + first)
                                             : (const void *)((const int64_t *)col_idx + first);
    const qk_key_reader keys = {base, index_dtype, 1, stride, 0};
    int64_t bad_item = 0, bad_key = 0;
    const int status = qk_group_by_key(&keys, m, num_src, maxt, off, order, &bad_item, &bad_key);
    if (status == QK_E_INDEX) {
        *bad_arg = 1;
        *bad_pos = lo + bad_item;
        *bad_value = bad_key;
    }
    return status;
}

int qk_sparse_aggregate_backward_cpu(qk_sparse_aggregate_backward_args *a, void *stream) {
    (void)stream;
    const int checked = sa_check_csr(a->dtype, a->row_ptr, a->index_dtype, a->row_ptr_stride, a->num_dst,
                                     a->num_edges, &a->bad_arg, &a->bad_pos, &a->bad_value);
    if (checked != QK_OK) return checked;
    const int64_t H = a->num_heads, D = a->head_dim;
    sab_job j = {0};
    j.a = a;
    j.lo = qk_index(a->row_ptr, a->index_dtype, 0, a->row_ptr_stride);
    j.hi = qk_index(a->row_ptr, a->index_dtype, a->num_dst, a->row_ptr_stride);
    const int64_t m = j.hi - j.lo;
    float *gew = a->grad_edge_weight;
    if (gew) { /* edges outside the rows */
        memset(gew, 0, sizeof(float) * (size_t)(j.lo * H));
        memset(gew + j.hi * H, 0, sizeof(float) * (size_t)((a->num_edges - j.hi) * H));
    }
    const int maxt = a->num_threads > 0 ? a->num_threads : 1;
    int64_t *bad = malloc(sizeof(int64_t) * 2 * (size_t)maxt);
    if (bad == NULL) return QK_E_NOMEM;
    j.bad_pos = bad;
    j.bad_value = bad + maxt;
    int status = QK_OK;
    if (a->grad_node_feat == NULL) {
        j.total_cost = m + a->num_dst;
        if (gew && a->num_dst > 0) status = sab_run(&j, 1, (m + a->num_dst) * H * (D + 1));
        free(bad);
        return status;
    }
    int64_t *off = malloc(sizeof(int64_t) * (size_t)(a->num_src + 1));
    int64_t *order = a->plan ? NULL : malloc(sizeof(int64_t) * (size_t)(m > 0 ? 2 * m : 1));
    if (off == NULL || (order == NULL && !a->plan)) status = QK_E_NOMEM;
    if (status == QK_OK && a->plan) {
        /* the plan's segments, made non-decreasing within [0, E] so a malformed one cannot send a
         * walk outside its entries; edges it leaves out get grad_edge_weight 0 */
        const int32_t *ptr = a->plan;
        int64_t prev = 0;
        for (int64_t s = 0; s <= a->num_src; s++) {
            int64_t v = ptr[s];
            v = v < prev ? prev : v > a->num_edges ? a->num_edges : v;
            off[s] = prev = v;
        }
        if (gew) memset(gew, 0, sizeof(float) * (size_t)(a->num_edges * H));
        j.off = off;
        j.pedge = a->plan + a->num_src + 1 + a->num_edges;
        j.prow = j.pedge + a->num_edges;
        j.total_cost = off[a->num_src] + a->num_src;
        status = sab_run(&j, 2, (off[a->num_src] + a->num_src) * H * (gew ? 2 * D + 1 : D + 1));
        free(off);
        free(bad);
        return status;
    }
    if (status == QK_OK)
        status = sa_group_sources(a->col_idx, a->index_dtype, a->col_idx_stride, j.lo, m, a->num_src, maxt, off, order,
                                  &a->bad_arg, &a->bad_pos, &a->bad_value);
    if (status == QK_OK) {
        j.off = off;
        j.order = order;
        j.row_of = order + m;
        j.total_cost = m + a->num_dst;
        if (m > 0) status = sab_run(&j, 0, m + a->num_dst);
    }
    if (status == QK_OK) {
        j.total_cost = m + a->num_src;
        status = sab_run(&j, 2, (m + a->num_src) * H * (gew ? 2 * D + 1 : D + 1));
    }
    free(off);
    free(order);
    free(bad);
    return status;
}

/* ---- sparse_aggregate_plan ---------------------------------------------------------------------
 * The grouping of the backward, kept: the edges in range grouped by column (qk_group_by_key, which
 * validates the columns), each edge's row from row_ptr, then the entries written per source by
 * shares of equal cost, and the edges outside the rows after them. */

typedef struct {
    const qk_sparse_aggregate_plan_args *a;
    const int64_t *off, *order;
    int64_t *row_of;
    int64_t lo, hi, total_cost;
    int phase;
} sap_job;

static int64_t sap_row_at(const qk_sparse_aggregate_plan_args *a, int64_t first_edge, int64_t target) {
    return qk_csr_row_at(a->row_ptr, a->index_dtype, a->row_ptr_stride, a->num_dst, first_edge, target);
}

static void sap_worker(void *p, int tid, int nthreads) {
    sap_job *j = p;
    const qk_sparse_aggregate_plan_args *a = j->a;
    const int64_t E = a->num_edges, N = a->num_src;
    int32_t *ptr = a->plan, *src = ptr + N + 1, *edge = src + E, *row = edge + E;
    if (j->phase == 0) { /* rows split by cost: each edge's row */
        const int64_t r0 = sap_row_at(a, j->lo, j->total_cost * tid / nthreads);
        const int64_t r1 = tid == nthreads - 1 ? a->num_dst : sap_row_at(a, j->lo, j->total_cost * (tid + 1) / nthreads);
        for (int64_t r = r0; r < r1; r++) {
            const int64_t b = qk_index(a->row_ptr, a->index_dtype, r, a->row_ptr_stride);
            const int64_t e1 = qk_index(a->row_ptr, a->index_dtype, r + 1, a->row_ptr_stride);
            for (int64_t e = b; e < e1; e++) j->row_of[e - j->lo] = r;
        }
        return;
    }
    const int64_t s0 = qk_group_at(j->off, N, j->total_cost * tid / nthreads);
    const int64_t s1 = tid == nthreads - 1 ? N : qk_group_at(j->off, N, j->total_cost * (tid + 1) / nthreads);
    for (int64_t s = s0; s < s1; s++) {
        ptr[s] = (int32_t)j->off[s];
        for (int64_t k = j->off[s]; k < j->off[s + 1]; k++) {
            src[k] = (int32_t)s;
            edge[k] = (int32_t)(j->lo + j->order[k]);
            row[k] = (int32_t)j->row_of[j->order[k]];
        }
    }
    if (tid == nthreads - 1) { /* the edges outside the rows, in ascending id */
        const int64_t m = j->hi - j->lo;
        ptr[N] = (int32_t)m;
        int64_t k = m;
        for (int64_t e = 0; e < E; e++) {
            if (e >= j->lo && e < j->hi) continue;
            src[k] = (int32_t)N;
            edge[k] = (int32_t)e;
            row[k++] = 0;
        }
    }
}

int qk_sparse_aggregate_plan_cpu(qk_sparse_aggregate_plan_args *a, void *stream) {
    (void)stream;
    if (a->num_edges > INT32_MAX || a->num_src >= INT32_MAX || a->num_dst > INT32_MAX) return QK_E_UNSUPPORTED;
    const int checked = sa_check_csr(QK_F32, a->row_ptr, a->index_dtype, a->row_ptr_stride, a->num_dst,
                                     a->num_edges, &a->bad_arg, &a->bad_pos, &a->bad_value);
    if (checked != QK_OK) return checked;
    sap_job j = {.a = a};
    j.lo = qk_index(a->row_ptr, a->index_dtype, 0, a->row_ptr_stride);
    j.hi = qk_index(a->row_ptr, a->index_dtype, a->num_dst, a->row_ptr_stride);
    const int64_t m = j.hi - j.lo;
    const int maxt = a->num_threads > 0 ? a->num_threads : 1;
    int64_t *off = malloc(sizeof(int64_t) * (size_t)(a->num_src + 1));
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(m > 0 ? 2 * m : 1));
    int status = off && order ? QK_OK : QK_E_NOMEM;
    if (status == QK_OK)
        status = sa_group_sources(a->col_idx, a->index_dtype, a->col_idx_stride, j.lo, m, a->num_src, maxt, off, order,
                                  &a->bad_arg, &a->bad_pos, &a->bad_value);
    if (status == QK_OK) {
        j.off = off;
        j.order = order;
        j.row_of = order + m;
        j.total_cost = m + a->num_dst;
        if (m > 0) status = qk_parallel_run(qk_threads_for(m + a->num_dst, maxt), sap_worker, &j);
    }
    if (status == QK_OK) {
        j.phase = 1;
        j.total_cost = m + a->num_src;
        status = qk_parallel_run(qk_threads_for(3 * m + a->num_src, maxt), sap_worker, &j);
    }
    free(off);
    free(order);
    return status;
}
