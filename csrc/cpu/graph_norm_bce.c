/* graph_norm_bce on the CPU, deterministic for any thread count: edges are cut into chunks whose
 * size depends only on E and num_graphs; each chunk sums its edges' terms per graph (in double),
 * and the chunk partials are combined per graph in chunk order.
 *
 * The terms are computed in fp32 blocks by a branch-free softplus that the compiler vectorises
 * (libm's scalar log1p(exp()) was most of the time), then added to their graphs' sums. */
#include "cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define GB_BLOCK 256

typedef struct {
    const qk_graph_norm_bce_args *a;
    int64_t chunk, nchunks;
    double *partial;  /* [nchunks][num_graphs] */
    int64_t *count;   /* [nchunks][num_graphs] */
    int64_t *bad;     /* [nchunks]: first out-of-range position in the chunk, or -1 */
    double *per_graph;
} gb_job;

/* log1p(exp(-a)) for a >= 0, relative error ~1e-7, no branches.  exp(-a) = 2^n exp(r) with
 * |r| <= ln2/2 (Cody-Waite), a degree-7 Taylor polynomial; then log(1 + e) = 2 atanh(e / (2 + e))
 * with e / (2 + e) <= 1/3, an odd series to s^13.  Small e keeps full relative precision. */
static inline float gb_softplus_neg(float a) {
    const float x = a < 87.f ? -a : -87.f; /* below e^-87 the result is ~1e-38: close enough to 0 */
    const float n = (float)(int)(x * 1.44269504f - 0.5f); /* round to nearest for x <= 0 */
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-06f;
    const float er = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720 + r * (1.f / 5040)))))));
    union {
        int32_t i;
        float f;
    } scale = {((int32_t)n + 127) << 23};
    const float e = er * scale.f;
    const float s = e / (2.f + e), s2 = s * s;
    return 2.f * s * (1.f + s2 * (1.f / 3 + s2 * (1.f / 5 + s2 * (1.f / 7 + s2 * (1.f / 9 + s2 * (1.f / 11 + s2 * (1.f / 13)))))));
}

/* pos_weight_e - 1 for edges e0 .. e0 + n - 1 of a pos_weight tensor (float32 or the logits' dtype,
 * both float32 here: the CPU kernels take float32 only). */
static void gb_pos_weights(const qk_graph_norm_bce_args *a, int64_t e0, int n, float *restrict out) {
    const float *pw = (const float *)a->pos_weight_t + e0 * a->pw_stride;
    const int64_t s = a->pw_stride;
    for (int i = 0; i < n; i++) out[i] = pw[i * s] - 1.f;
}

/* Not multiversioned: its AVX-512 clone measured 2x slower than the baseline SSE build here. */
static void gb_terms(const qk_graph_norm_bce_args *a, int64_t e0, int n, float *restrict out) {
    const float *lg = (const float *)a->logits + e0 * a->logits_stride;
    const float *tg = (const float *)a->target + e0 * a->target_stride;
    const int64_t ls = a->logits_stride, ts = a->target_stride;
    const float pw = a->has_pos_weight ? a->pos_weight - 1.f : 0.f;
    if (a->pos_weight_t) {
        float pwm1[GB_BLOCK];
        gb_pos_weights(a, e0, n, pwm1);
        for (int i = 0; i < n; i++) {
            const float l = lg[i * ls], t = tg[i * ts];
            out[i] = ((l > 0.f ? l : 0.f) - l * t + gb_softplus_neg(fabsf(l))) * (1.f + pwm1[i] * t);
        }
    } else if (ls == 1 && ts == 1) {
        for (int i = 0; i < n; i++) {
            const float l = lg[i], t = tg[i];
            out[i] = ((l > 0.f ? l : 0.f) - l * t + gb_softplus_neg(fabsf(l))) * (1.f + pw * t);
        }
    } else {
        for (int i = 0; i < n; i++) {
            const float l = lg[i * ls], t = tg[i * ts];
            out[i] = ((l > 0.f ? l : 0.f) - l * t + gb_softplus_neg(fabsf(l))) * (1.f + pw * t);
        }
    }
}

static void gb_chunks(void *p, int tid, int nthreads) {
    gb_job *j = p;
    const qk_graph_norm_bce_args *a = j->a;
    const int64_t G = a->num_graphs;
    float terms[GB_BLOCK];
    int64_t c0, c1;
    qk_share(j->nchunks, tid, nthreads, &c0, &c1);
    for (int64_t c = c0; c < c1; c++) {
        double *sum = j->partial + c * G;
        int64_t *cnt = j->count + c * G;
        j->bad[c] = -1;
        const int64_t end = (c + 1) * j->chunk < a->num_edges ? (c + 1) * j->chunk : a->num_edges;
        for (int64_t b = c * j->chunk; b < end && j->bad[c] < 0; b += GB_BLOCK) {
            const int n = (int)(end - b < GB_BLOCK ? end - b : GB_BLOCK);
            gb_terms(a, b, n, terms);
            for (int i = 0; i < n; i++) {
                const int64_t g = qk_index(a->edge_graph, a->index_dtype, b + i, a->graph_stride);
                if (g < 0 || g >= G) {
                    j->bad[c] = b + i;
                    break;
                }
                sum[g] += terms[i];
                cnt[g]++;
            }
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

int qk_graph_norm_bce_cpu(qk_graph_norm_bce_args *a, void *stream) {
    (void)stream;
    if (a->dtype != QK_F32) return QK_E_UNSUPPORTED;
    const int64_t E = a->num_edges, G = a->num_graphs;
    if (a->pos_weight_t && a->pw_stride == 0) { /* one value for every edge: host memory here */
        a->pos_weight = *(const float *)a->pos_weight_t;
        a->pos_weight_t = NULL;
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
    j.bad = malloc(sizeof(int64_t) * (size_t)j.nchunks);
    j.per_graph = malloc(sizeof(double) * (size_t)G);
    int status = QK_E_NOMEM;
    if (j.partial && j.count && j.bad && j.per_graph) {
        const int maxt = a->num_threads > 0 ? a->num_threads : 1;
        status = qk_parallel_run(j.nchunks < maxt ? (int)j.nchunks : maxt, gb_chunks, &j);
        for (int64_t c = 0; status == QK_OK && c < j.nchunks; c++) {
            if (j.bad[c] >= 0) {
                a->bad_pos = j.bad[c];
                a->bad_value = qk_index(a->edge_graph, a->index_dtype, j.bad[c], a->graph_stride);
                status = QK_E_INDEX;
            }
        }
        if (status == QK_OK) status = qk_parallel_run(qk_threads_for(G * j.nchunks * 4, maxt), gb_graphs, &j);
        if (status == QK_OK) {
            double total = 0;
            for (int64_t g = 0; g < G; g++) total += j.per_graph[g];
            *a->out = (float)(total / (double)G);
        }
    }
    free(j.partial);
    free(j.count);
    free(j.bad);
    free(j.per_graph);
    return status;
}

/* ---- graph_norm_bce_backward ------------------------------------------------------------------
 * Two passes: the edges of each graph are counted (integers, so the thread split cannot change
 * them; the first bad id is found in position order), then every edge's gradient is its term
 * w * (sigmoid(l) - t), computed in vectorised blocks, times its graph's factor
 * grad / (max(count, 1) * num_graphs). */

typedef struct {
    qk_graph_norm_bce_args *a;
    int nparts;        /* count arrays: one per share of the edges */
    int64_t *count;    /* [nparts][num_graphs] */
    int64_t *bad;      /* [nparts]: first out-of-range position in the share, or -1 */
    float *factor;     /* [num_graphs] */
} gbb_job;

/* exp(-a) for a >= 0 as gb_softplus_neg computes it (0 past e^-87), vectorisable */
static inline float gb_exp_neg(float a) {
    const float x = a < 87.f ? -a : -87.f;
    const float n = (float)(int)(x * 1.44269504f - 0.5f);
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-06f;
    const float er =
        1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720 + r * (1.f / 5040)))))));
    union {
        int32_t i;
        float f;
    } scale = {((int32_t)n + 127) << 23};
    return a < 87.f ? er * scale.f : 0.f;
}

static void gbb_count(void *p, int tid, int nthreads) {
    gbb_job *j = p;
    const qk_graph_norm_bce_args *a = j->a;
    const int64_t G = a->num_graphs;
    int64_t e0, e1; /* nthreads == nparts: share tid counts into count array tid */
    qk_share(a->num_edges, tid, nthreads, &e0, &e1);
    int64_t *cnt = j->count + (size_t)tid * (size_t)G;
    j->bad[tid] = -1;
    for (int64_t e = e0; e < e1; e++) {
        const int64_t g = qk_index(a->edge_graph, a->index_dtype, e, a->graph_stride);
        if (g < 0 || g >= G) {
            j->bad[tid] = e;
            return;
        }
        cnt[g]++;
    }
}

static void gbb_grads(void *p, int tid, int nthreads) {
    gbb_job *j = p;
    const qk_graph_norm_bce_args *a = j->a;
    const float pw_scalar = a->has_pos_weight ? a->pos_weight - 1.f : 0.f;
    float term[GB_BLOCK], pwm1[GB_BLOCK];
    int64_t b0, b1;
    qk_share((a->num_edges + GB_BLOCK - 1) / GB_BLOCK, tid, nthreads, &b0, &b1);
    for (int64_t b = b0; b < b1; b++) {
        const int64_t e0 = b * GB_BLOCK;
        const int n = (int)(a->num_edges - e0 < GB_BLOCK ? a->num_edges - e0 : GB_BLOCK);
        const float *lg = (const float *)a->logits + e0 * a->logits_stride;
        const float *tg = (const float *)a->target + e0 * a->target_stride;
        const int64_t ls = a->logits_stride, ts = a->target_stride;
        if (a->pos_weight_t) gb_pos_weights(a, e0, n, pwm1);
        else
            for (int i = 0; i < n; i++) pwm1[i] = pw_scalar;
        for (int i = 0; i < n; i++) {
            const float l = lg[i * ls], t = tg[i * ts];
            /* sigmoid(l) - t without cancelling 1 - e/(1+e) against t = 1 for large l (or e/(1+e) for small) */
            const float e = gb_exp_neg(fabsf(l)), q = e / (1.f + e);
            term[i] = (1.f + pwm1[i] * t) * (l >= 0.f ? (1.f - t) - q : q - t);
        }
        float *out = (float *)a->grad_logits + e0 * a->grad_stride;
        for (int i = 0; i < n; i++)
            out[i * a->grad_stride] =
                term[i] * j->factor[qk_index(a->edge_graph, a->index_dtype, e0 + i, a->graph_stride)];
    }
}

int qk_graph_norm_bce_backward_cpu(qk_graph_norm_bce_args *a, void *stream) {
    (void)stream;
    if (a->dtype != QK_F32) return QK_E_UNSUPPORTED;
    const int64_t E = a->num_edges, G = a->num_graphs;
    if (a->pos_weight_t && a->pw_stride == 0) { /* one value for every edge */
        a->pos_weight = *(const float *)a->pos_weight_t;
        a->pos_weight_t = NULL;
    }
    const int maxt = a->num_threads > 0 ? a->num_threads : 1;
    gbb_job j = {0};
    j.a = a;
    /* one count array per thread, at most ~4M counters in all */
    j.nparts = qk_threads_for(E, maxt);
    if ((int64_t)j.nparts * G > (1 << 22)) j.nparts = (1 << 22) / G > 1 ? (int)((1 << 22) / G) : 1;
    j.count = calloc((size_t)j.nparts * (size_t)G, sizeof(int64_t));
    j.bad = malloc(sizeof(int64_t) * (size_t)j.nparts);
    j.factor = malloc(sizeof(float) * (size_t)G);
    int status = QK_E_NOMEM;
    if (j.count && j.bad && j.factor) {
        status = qk_parallel_run(j.nparts, gbb_count, &j);
        for (int t = 0; status == QK_OK && t < j.nparts; t++) {
            if (j.bad[t] >= 0) { /* shares are in position order: the first bad one is the earliest */
                a->bad_pos = j.bad[t];
                a->bad_value = qk_index(a->edge_graph, a->index_dtype, j.bad[t], a->graph_stride);
                status = QK_E_INDEX;
            }
        }
        if (status == QK_OK) {
            const double grad = *a->grad;
            for (int64_t g = 0; g < G; g++) {
                int64_t n = 0;
                for (int t = 0; t < j.nparts; t++) n += j.count[(size_t)t * (size_t)G + g];
                j.factor[g] = (float)(grad / ((double)(n > 1 ? n : 1) * (double)G));
            }
            status = qk_parallel_run(qk_threads_for(E * 8, maxt), gbb_grads, &j);
        }
    }
    free(j.count);
    free(j.bad);
    free(j.factor);
    return status;
}
