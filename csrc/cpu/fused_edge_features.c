/* fused_edge_features on the CPU: out[e] = cat(x[src]+x[dst], |x[src]-x[dst]|, edge_attr[e]).
 * Indices are validated first (the first bad one is reported); edges are then split evenly
 * between threads, each edge written by one thread. */
#include "cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

QK_MULTIVERSION static void ef_worker(void *p, int tid, int nthreads) {
    const qk_fused_edge_features_args *a = p;
    const float *x = a->x, *ea = a->edge_attr;
    float *out = a->out;
    const int64_t H = a->H;
    int64_t e0, e1;
    qk_share(a->num_edges, tid, nthreads, &e0, &e1);
    for (int64_t e = e0; e < e1; e++) {
        const int64_t s = qk_index(a->edge_index, a->index_dtype, e * a->ei_stride[1], 1);
        const int64_t d = qk_index(a->edge_index, a->index_dtype, a->ei_stride[0] + e * a->ei_stride[1], 1);
        const float *xs = x + s * a->x_stride[0], *xd = x + d * a->x_stride[0];
        float *o = out + e * a->out_stride[0];
        const int64_t xc = a->x_stride[1], oc = a->out_stride[1];
        for (int64_t h = 0; h < H; h++) {
            const float u = xs[h * xc], v = xd[h * xc];
            o[h * oc] = u + v;
            o[(H + h) * oc] = fabsf(u - v);
        }
        if (ea) {
            const float *ae = ea + e * a->ea_stride[0];
            for (int64_t h = 0; h < H; h++) o[(2 * H + h) * oc] = ae[h * a->ea_stride[1]];
        }
    }
}

int qk_fused_edge_features_cpu(qk_fused_edge_features_args *a, void *stream) {
    (void)stream;
    if (a->dtype != QK_F32) return QK_E_UNSUPPORTED;
    for (int row = 0; row < 2; row++)
        if (qk_index_range_check(a->edge_index, a->index_dtype, a->num_edges, row * a->ei_stride[0], a->ei_stride[1],
                                 a->num_nodes, &a->bad_pos, &a->bad_value) != QK_OK) {
            a->bad_row = row;
            return QK_E_INDEX;
        }
    const int cols = a->edge_attr ? 3 : 2;
    return qk_parallel_run(qk_threads_for(a->num_edges * a->H * cols, a->num_threads > 0 ? a->num_threads : 1),
                           ef_worker, a);
}

/* ---- fused_edge_features_backward --------------------------------------------------------------
 * The 2E incidences (edge e, side 0 at src, side 1 at dst; item 2e + side) are grouped by node
 * with qk_group_by_key, which also validates edge_index; nodes are then split by cost and each
 * sums its incidences in (edge, side) order in fp32: g_sum + sign(x[n] - x[other]) * g_abs, which
 * is g_sum + s * g_abs at the source side and g_sum - s * g_abs at the destination side. */

/* sign(d) with sign(0) = 0, and 0 for NaN as torch.sign (torch's abs backward) gives. */
static inline float efb_sign(float d) { return (float)((d > 0.f) - (d < 0.f)); }

typedef struct {
    const qk_fused_edge_features_backward_args *a;
    const int64_t *off, *order;
    const int32_t *pitem; /* with a plan: entry k's item (order unused) */
    int64_t total_cost;
    int nomem;
} efb_job;

QK_MULTIVERSION static void efb_nodes(const efb_job *j, float *acc, int64_t n0, int64_t n1) {
    const qk_fused_edge_features_backward_args *a = j->a;
    const float *x = a->x, *go = a->grad_out;
    float *gx = a->grad_x;
    const int64_t H = a->H, xc = a->x_stride[1], gc = a->go_stride[1];
    const int unit = xc == 1 && gc == 1;
    for (int64_t n = n0; n < n1; n++) {
        const float *xs = x + n * a->x_stride[0];
        for (int64_t h = 0; h < H; h++) acc[h] = 0.f;
        for (int64_t k = j->off[n]; k < j->off[n + 1]; k++) {
            const int64_t item = j->pitem ? j->pitem[k] : j->order[k], e = item >> 1, other_side = 1 - (item & 1);
            if (item < 0 || e >= a->num_edges) continue; /* a plan's entry out of range: skipped */
            const int64_t other = qk_index(a->edge_index, a->index_dtype, other_side * a->ei_stride[0] + e * a->ei_stride[1], 1);
            const float *gs = go + e * a->go_stride[0], *ga = gs + H * gc;
            if (other < 0 || other >= a->num_nodes) { /* edge_index changed under a plan: a zero row, as cuda */
                for (int64_t h = 0; h < H; h++) acc[h] += gs[h * gc] + efb_sign(xs[h * xc]) * ga[h * gc];
                continue;
            }
            const float *xo = x + other * a->x_stride[0];
            if (unit)
                for (int64_t h = 0; h < H; h++) acc[h] += gs[h] + efb_sign(xs[h] - xo[h]) * ga[h];
            else
                for (int64_t h = 0; h < H; h++) acc[h] += gs[h * gc] + efb_sign(xs[h * xc] - xo[h * xc]) * ga[h * gc];
        }
        memcpy(gx + n * H, acc, sizeof(float) * (size_t)H);
    }
}

static void efb_worker(void *p, int tid, int nthreads) {
    efb_job *j = p;
    const qk_fused_edge_features_backward_args *a = j->a;
    const int64_t n0 = qk_group_at(j->off, a->num_nodes, j->total_cost * tid / nthreads);
    const int64_t n1 = tid == nthreads - 1 ? a->num_nodes : qk_group_at(j->off, a->num_nodes, j->total_cost * (tid + 1) / nthreads);
    if (n0 < n1) {
        float *acc = malloc(sizeof(float) * (size_t)(a->H > 0 ? a->H : 1));
        if (acc == NULL) {
            j->nomem = 1;
        } else {
            efb_nodes(j, acc, n0, n1);
            free(acc);
        }
    }
    float *gea = a->grad_edge_attr;
    if (gea) { /* grad_edge_attr is grad_out's last H columns: each thread copies its share of the edges */
        const float *go = a->grad_out;
        const int64_t H = a->H, gc = a->go_stride[1];
        int64_t e0, e1;
        qk_share(a->num_edges, tid, nthreads, &e0, &e1);
        for (int64_t e = e0; e < e1; e++) {
            const float *src = go + e * a->go_stride[0] + 2 * H * gc;
            if (gc == 1) memcpy(gea + e * H, src, sizeof(float) * (size_t)H);
            else
                for (int64_t h = 0; h < H; h++) gea[e * H + h] = src[h * gc];
        }
    }
}

int qk_fused_edge_features_backward_cpu(qk_fused_edge_features_backward_args *a, void *stream) {
    (void)stream;
    if (a->dtype != QK_F32 || (a->index_dtype != QK_I32 && a->index_dtype != QK_I64)) return QK_E_UNSUPPORTED;
    const int64_t m = 2 * a->num_edges;
    efb_job j = {.a = a};
    int64_t *off = malloc(sizeof(int64_t) * (size_t)(a->num_nodes + 1));
    int64_t *order = a->plan ? NULL : malloc(sizeof(int64_t) * (size_t)(m > 0 ? m : 1));
    int status = off && (order || a->plan) ? QK_OK : QK_E_NOMEM;
    if (status == QK_OK && a->plan) {
        /* the plan's segments, made non-decreasing within [0, 2E]: a malformed plan stays in bounds */
        int64_t prev = 0;
        for (int64_t n = 0; n <= a->num_nodes; n++) {
            int64_t v = a->plan[n];
            v = v < prev ? prev : v > m ? m : v;
            off[n] = prev = v;
        }
        j.pitem = a->plan + a->num_nodes + 1 + m;
    } else if (status == QK_OK) {
        const qk_key_reader keys = {a->edge_index, a->index_dtype, 2, a->ei_stride[1], a->ei_stride[0]};
        int64_t bad_item = 0, bad_key = 0;
        status = qk_group_by_key(&keys, m, a->num_nodes, a->num_threads, off, order, &bad_item, &bad_key);
        if (status == QK_E_INDEX) {
            a->bad_row = (int)(bad_item & 1);
            a->bad_pos = bad_item >> 1;
            a->bad_value = bad_key;
        }
    }
    if (status == QK_OK) {
        j.off = off;
        j.order = order;
        j.total_cost = m + a->num_nodes;
        const int64_t work = (m + a->num_nodes) * a->H * 2 + (a->grad_edge_attr ? a->num_edges * a->H : 0);
        status = qk_parallel_run(qk_threads_for(work, a->num_threads > 0 ? a->num_threads : 1), efb_worker, &j);
        if (status == QK_OK && j.nomem) status = QK_E_NOMEM;
    }
    free(off);
    free(order);
    return status;
}

/* ---- fused_edge_features_plan ------------------------------------------------------------------
 * The backward's grouping of the 2E incidences by node (qk_group_by_key, which validates
 * edge_index), kept: nodes are written by shares of equal cost. */

typedef struct {
    const qk_fused_edge_features_plan_args *a;
    const int64_t *off, *order;
    int64_t total_cost;
} efp_job;

static void efp_worker(void *p, int tid, int nthreads) {
    const efp_job *j = p;
    const qk_fused_edge_features_plan_args *a = j->a;
    const int64_t N = a->num_nodes, m = 2 * a->num_edges;
    int32_t *ptr = a->plan, *node = ptr + N + 1, *item = node + m;
    const int64_t n0 = qk_group_at(j->off, N, j->total_cost * tid / nthreads);
    const int64_t n1 = tid == nthreads - 1 ? N : qk_group_at(j->off, N, j->total_cost * (tid + 1) / nthreads);
    for (int64_t n = n0; n < n1; n++) {
        ptr[n] = (int32_t)j->off[n];
        for (int64_t k = j->off[n]; k < j->off[n + 1]; k++) {
            node[k] = (int32_t)n;
            item[k] = (int32_t)j->order[k];
        }
    }
    if (tid == nthreads - 1) ptr[N] = (int32_t)j->off[N];
}

int qk_fused_edge_features_plan_cpu(qk_fused_edge_features_plan_args *a, void *stream) {
    (void)stream;
    if (a->index_dtype != QK_I32 && a->index_dtype != QK_I64) return QK_E_UNSUPPORTED;
    if (a->num_edges > INT32_MAX / 2 || a->num_nodes >= INT32_MAX) return QK_E_UNSUPPORTED;
    const int64_t m = 2 * a->num_edges;
    const int maxt = a->num_threads > 0 ? a->num_threads : 1;
    int64_t *off = malloc(sizeof(int64_t) * (size_t)(a->num_nodes + 1));
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(m > 0 ? m : 1));
    int status = off && order ? QK_OK : QK_E_NOMEM;
    if (status == QK_OK) {
        const qk_key_reader keys = {a->edge_index, a->index_dtype, 2, a->ei_stride[1], a->ei_stride[0]};
        int64_t bad_item = 0, bad_key = 0;
        status = qk_group_by_key(&keys, m, a->num_nodes, maxt, off, order, &bad_item, &bad_key);
        if (status == QK_E_INDEX) {
            a->bad_row = (int)(bad_item & 1);
            a->bad_pos = bad_item >> 1;
            a->bad_value = bad_key;
        }
    }
    if (status == QK_OK) {
        efp_job j = {.a = a, .off = off, .order = order, .total_cost = m + a->num_nodes};
        status = qk_parallel_run(qk_threads_for(2 * m + a->num_nodes, maxt), efp_worker, &j);
    }
    free(off);
    free(order);
    return status;
}
