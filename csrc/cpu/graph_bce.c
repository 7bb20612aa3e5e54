/* graph_norm_bce on the CPU, deterministic for any thread count: edges are cut into chunks whose
 * size depends only on E and num_graphs; each chunk sums its edges' terms per graph (in double),
 * and the chunk partials are combined per graph in chunk order. */
#include "cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const qk_graph_bce_args *a;
    int64_t chunk, nchunks;
    double *partial;  /* [nchunks][num_graphs] */
    int64_t *count;   /* [nchunks][num_graphs] */
    double *per_graph;
} gb_job;

static inline double gb_term(const qk_graph_bce_args *a, int64_t e) {
    const float *lg = a->logits, *tg = a->target;
    const double l = lg[e * a->logits_stride], t = tg[e * a->target_stride];
    double v = (l > 0 ? l : 0) - l * t + log1p(exp(-fabs(l)));
    if (a->has_pos_weight) v *= 1.0 + ((double)a->pos_weight - 1.0) * t;
    return v;
}

static void gb_chunks(void *p, int tid, int nthreads) {
    gb_job *j = p;
    const qk_graph_bce_args *a = j->a;
    int64_t c0, c1;
    qk_share(j->nchunks, tid, nthreads, &c0, &c1);
    for (int64_t c = c0; c < c1; c++) {
        double *sum = j->partial + c * a->num_graphs;
        int64_t *cnt = j->count + c * a->num_graphs;
        const int64_t e1 = (c + 1) * j->chunk < a->num_edges ? (c + 1) * j->chunk : a->num_edges;
        for (int64_t e = c * j->chunk; e < e1; e++) {
            const int64_t g = qk_index(a->edge_graph, a->index_dtype, e, a->graph_stride);
            sum[g] += gb_term(a, e);
            cnt[g]++;
        }
    }
}

static void gb_graphs(void *p, int tid, int nthreads) {
    gb_job *j = p;
    const int64_t G = j->a->num_graphs;
    int64_t g0, g1;
    qk_share(G, tid, nthreads, &g0, &g1);
    for (int64_t g = g0; g < g1; g++) {
        double s = 0;
        int64_t n = 0;
        for (int64_t c = 0; c < j->nchunks; c++) {
            s += j->partial[c * G + g];
            n += j->count[c * G + g];
        }
        j->per_graph[g] = s / (double)(n > 1 ? n : 1);
    }
}

int qk_graph_bce_cpu(qk_graph_bce_args *a, void *stream) {
    (void)stream;
    if (a->dtype != QK_F32) return QK_E_UNSUPPORTED;
    const int64_t E = a->num_edges, G = a->num_graphs;
    for (int64_t e = 0; e < E; e++) {
        const int64_t g = qk_index(a->edge_graph, a->index_dtype, e, a->graph_stride);
        if (g < 0 || g >= G) {
            a->bad_pos = e;
            a->bad_value = g;
            return QK_E_INDEX;
        }
    }
    gb_job j = {0};
    j.a = a;
    /* Chunks of >= 64k edges, and at most ~4M partial slots in all. */
    j.nchunks = E / 65536 + 1;
    if (j.nchunks * G > (1 << 22)) j.nchunks = (1 << 22) / G > 1 ? (1 << 22) / G : 1;
    j.chunk = (E + j.nchunks - 1) / j.nchunks;
    if (j.chunk == 0) j.chunk = 1;
    j.partial = calloc((size_t)(j.nchunks * G), sizeof(double));
    j.count = calloc((size_t)(j.nchunks * G), sizeof(int64_t));
    j.per_graph = malloc(sizeof(double) * (size_t)G);
    int status = QK_E_NOMEM;
    if (j.partial && j.count && j.per_graph) {
        const int maxt = a->num_threads > 0 ? a->num_threads : 1;
        status = qk_parallel_run(j.nchunks < maxt ? (int)j.nchunks : maxt, gb_chunks, &j);
        if (status == QK_OK) status = qk_parallel_run(qk_threads_for(G * j.nchunks * 4, maxt), gb_graphs, &j);
        if (status == QK_OK) {
            double total = 0;
            for (int64_t g = 0; g < G; g++) total += j.per_graph[g];
            *a->out = (float)(total / (double)G);
        }
    }
    free(j.partial);
    free(j.count);
    free(j.per_graph);
    return status;
}
