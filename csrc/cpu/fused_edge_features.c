/* fused_edge_features on the CPU: out[e] = cat(x[src]+x[dst], |x[src]-x[dst]|, edge_attr[e]).
 * Indices are validated first (the first bad one is reported); edges are then split evenly
 * between threads, each edge written by one thread. */
#include "cpu.h"

#include <math.h>

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
    for (int row = 0; row < 2; row++) {
        for (int64_t e = 0; e < a->num_edges; e++) {
            const int64_t v = qk_index(a->edge_index, a->index_dtype, row * a->ei_stride[0] + e * a->ei_stride[1], 1);
            if (v < 0 || v >= a->num_nodes) {
                a->bad_row = row;
                a->bad_pos = e;
                a->bad_value = v;
                return QK_E_INDEX;
            }
        }
    }
    const int cols = a->edge_attr ? 3 : 2;
    return qk_parallel_run(qk_threads_for(a->num_edges * a->H * cols, a->num_threads > 0 ? a->num_threads : 1),
                           ef_worker, a);
}
