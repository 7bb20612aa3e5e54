/* graph_norm_bce on the CPU, deterministic for any thread count: edges are cut into chunks whose
 * size depends only on E and num_graphs; each chunk sums its edges' terms per graph (in double, in
 * edge order), and the chunk partials are combined per graph in chunk order.
 *
 * The terms are computed in fp32 blocks by a branch-free softplus that the compiler vectorises
 * (libm's scalar log1p(exp()) was most of the time), in AVX-512 and AVX2 clones too.  They are then
 * added to their graphs' sums without one long chain of dependent adds through memory (see
 * gb_add_block). */
#include "cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define GB_BLOCK 256
#define GB_CHUNK 4096 /* edges per chunk, at least */

/* Per-graph sums over chunks of edges (the forward's terms and counts, the backward's counts). */
typedef struct {
    qk_graph_norm_bce_args *a;
    int64_t chunk, nchunks;
    double *partial;  /* [nchunks][num_graphs], valid over [lo[c], hi[c]]; NULL: counts only */
    int64_t *count;   /* [nchunks][num_graphs], likewise */
    int64_t *lo, *hi; /* [nchunks]: the graphs chunk c touched lie in [lo, hi] (lo > hi: none) */
    int64_t *bad;     /* [nchunks]: first out-of-range position in the chunk, or -1 */
    double *per_graph; /* [num_graphs] (forward) */
    int64_t *total;   /* [num_graphs]: the counts over all chunks */
    float *factor;    /* [num_graphs] (backward) */
    void *mem;        /* the one scratch block all of these live in */
    atomic_llong next; /* the next chunk to take */
} gb_job;

/* exp(-min(a, 87)) for a >= 0, branch-free: 2^n exp(r) with n = round(-a / ln2) and |r| <= ln2/2
 * (Cody-Waite), a degree-7 Taylor polynomial for exp(r).  n is rounded by adding 1.5 * 2^23, whose
 * low mantissa bits then hold n, so 2^n is built from those bits: no float-to-int conversion, which
 * kept GCC's AVX2 and AVX-512 clones from if-converting (and so vectorising) the callers' loops. */
QK_INLINE float gb_exp_neg87(float a) {
    const float x = a < 87.f ? -a : -87.f; /* 2^-126 at the end: still a normal float */
    const float k = x * 1.44269504f + 0x1.8p23f, n = k - 0x1.8p23f;
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-06f;
    const float er = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720 + r * (1.f / 5040)))))));
    uint32_t kb;
    memcpy(&kb, &k, sizeof kb);
    const uint32_t sb = (kb << 23) + (127u << 23); /* (n + 127) << 23: the bits of 2^n */
    float scale;
    memcpy(&scale, &sb, sizeof scale);
    return er * scale;
}

/* log1p(exp(-a)) for a >= 0, relative error ~1e-7, no branches: log(1 + e) = 2 atanh(e / (2 + e))
 * with e / (2 + e) <= 1/3, an odd series to s^13.  Small e keeps full relative precision; below
 * e^-87 the result is ~1e-38: close enough to 0. */
QK_INLINE float gb_softplus_neg(float a) {
    const float e = gb_exp_neg87(a);
    const float s = e / (2.f + e), s2 = s * s;
    return 2.f * s * (1.f + s2 * (1.f / 3 + s2 * (1.f / 5 + s2 * (1.f / 7 + s2 * (1.f / 9 + s2 * (1.f / 11 + s2 * (1.f / 13)))))));
}

/* pos_weight_e - 1 for edges e0 .. e0 + n - 1 of a pos_weight tensor (float32 or the logits' dtype,
 * both float32 here: the CPU kernels take float32 only). */
QK_INLINE void gb_pos_weights(const qk_graph_norm_bce_args *a, int64_t e0, int n, float *restrict out) {
    const float *pw = (const float *)a->pos_weight_t + e0 * a->pw_stride;
    const int64_t s = a->pw_stride;
    for (int i = 0; i < n; i++) out[i] = pw[i * s] - 1.f;
}

QK_INLINE void gb_terms(const qk_graph_norm_bce_args *a, int64_t e0, int n, float *restrict out) {
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

/* Graph ids e0 .. e0 + n - 1 as int64 (one loop per index type, so each vectorises). */
QK_INLINE void gb_ids(const qk_graph_norm_bce_args *a, int64_t e0, int n, int64_t *restrict out) {
    const int64_t s = a->graph_stride;
    if (a->index_dtype == QK_I32) {
        const int32_t *g = (const int32_t *)a->edge_graph + e0 * s;
        for (int i = 0; i < n; i++) out[i] = g[i * s];
    } else {
        const int64_t *g = (const int64_t *)a->edge_graph + e0 * s;
        for (int i = 0; i < n; i++) out[i] = g[i * s];
    }
}

/* Adds block terms t[0 .. n) to sum[ids[i]] (t, sum NULL: counts only) and 1 to cnt[ids[i]]
 * (graphs already range-checked), in one of two orders fixed by the ids alone.  Long runs (a sorted
 * edge_graph with many edges per graph): each run summed in registers, four lanes.  Otherwise edge
 * by edge through memory, the block as four interleaved quarters so that four independent
 * read-add-write chains overlap (one chain would wait on each add's store). */
QK_INLINE void gb_add_block(const float *restrict t, const int64_t *restrict ids, int n, double *restrict sum,
                            int64_t *restrict cnt) {
    int runs = 1;
    for (int i = 1; i < n; i++) runs += ids[i] != ids[i - 1];
    if (runs * 8 <= n) {
        int i = 0;
        while (i < n) {
            const int64_t g = ids[i];
            int k = i + 1;
            while (k < n && ids[k] == g) k++;
            if (sum) {
                double part[4] = {0, 0, 0, 0};
                int m = i;
                for (; m + 4 <= k; m += 4)
                    for (int w = 0; w < 4; w++) part[w] += t[m + w];
                double acc = (part[0] + part[1]) + (part[2] + part[3]);
                for (; m < k; m++) acc += t[m];
                sum[g] += acc;
            }
            cnt[g] += k - i;
            i = k;
        }
        return;
    }
    const int q = n / 4;
    for (int i = 0; i < q; i++)
        for (int w = 0; w < 4; w++) {
            const int64_t g = ids[w * q + i];
            if (sum) sum[g] += t[w * q + i];
            cnt[g]++;
        }
    for (int i = 4 * q; i < n; i++) {
        if (sum) sum[ids[i]] += t[i];
        cnt[ids[i]]++;
    }
}

/* Chunks of >= GB_CHUNK edges, at most 1024 of them and ~4M partial slots in all: a function of E
 * and num_graphs alone.  A chunk zeroes and reads back only the range of graphs it touched, which
 * is little for a sorted edge_graph. */
static void gb_layout(gb_job *j, int64_t E, int64_t G) {
    j->chunk = (E + 1023) / 1024 > GB_CHUNK ? (E + 1023) / 1024 : GB_CHUNK;
    j->nchunks = (E + j->chunk - 1) / j->chunk;
    if (j->nchunks < 1) j->nchunks = 1;
    if (j->nchunks * G > (1 << 22)) j->nchunks = (1 << 22) / G > 1 ? (1 << 22) / G : 1;
    j->chunk = (E + j->nchunks - 1) / j->nchunks;
    if (j->chunk == 0) j->chunk = 1;
    atomic_init(&j->next, 0);
}

/* Chunks taken one at a time: each sums its edges into its own partial row. */
QK_MULTIVERSION static void gb_chunks(void *p, int tid, int nthreads) {
    (void)tid;
    (void)nthreads;
    gb_job *j = p;
    const qk_graph_norm_bce_args *a = j->a;
    const int64_t G = a->num_graphs;
    float terms[GB_BLOCK];
    int64_t ids[GB_BLOCK];
    for (int64_t c; (c = qk_next_item(&j->next)) < j->nchunks;) {
        double *restrict sum = j->partial ? j->partial + c * G : NULL;
        int64_t *restrict cnt = j->count + c * G;
        int64_t lo = G, hi = -1, bad = -1; /* sum and cnt are zeroed over [lo, hi], grown as needed */
        const int64_t end = (c + 1) * j->chunk < a->num_edges ? (c + 1) * j->chunk : a->num_edges;
        for (int64_t b = c * j->chunk; b < end; b += GB_BLOCK) {
            const int n = (int)(end - b < GB_BLOCK ? end - b : GB_BLOCK);
            gb_ids(a, b, n, ids);
            int64_t mn = ids[0], mx = ids[0];
            for (int i = 1; i < n; i++) {
                mn = ids[i] < mn ? ids[i] : mn;
                mx = ids[i] > mx ? ids[i] : mx;
            }
            if (mn < 0 || mx >= G) {
                for (int i = 0; bad < 0; i++)
                    if (ids[i] < 0 || ids[i] >= G) bad = b + i;
                break;
            }
            if (hi < lo) { /* the chunk's first block */
                lo = mn;
                hi = mn - 1;
            }
            if (mn < lo) {
                if (sum) memset(sum + mn, 0, sizeof(double) * (size_t)(lo - mn));
                memset(cnt + mn, 0, sizeof(int64_t) * (size_t)(lo - mn));
                lo = mn;
            }
            if (mx > hi) {
                if (sum) memset(sum + hi + 1, 0, sizeof(double) * (size_t)(mx - hi));
                memset(cnt + hi + 1, 0, sizeof(int64_t) * (size_t)(mx - hi));
                hi = mx;
            }
            if (sum) gb_terms(a, b, n, terms);
            gb_add_block(sum ? terms : NULL, ids, n, sum, cnt);
        }
        j->lo[c] = lo;
        j->hi[c] = hi;
        j->bad[c] = bad;
    }
}

/* Each graph's chunk partials added in chunk order (counts into total), then its mean term, or
 * (backward) its gradient factor grad / (max(count, 1) * num_graphs). */
QK_MULTIVERSION static void gb_graphs(void *p, int tid, int nthreads) {
    gb_job *j = p;
    const int64_t G = j->a->num_graphs;
    int64_t g0, g1;
    qk_share(G, tid, nthreads, &g0, &g1);
    double *restrict s = j->per_graph;
    int64_t *restrict n = j->total;
    for (int64_t g = g0; g < g1; g++) {
        if (s) s[g] = 0;
        n[g] = 0;
    }
    for (int64_t c = 0; c < j->nchunks; c++) {
        const int64_t lo = j->lo[c] > g0 ? j->lo[c] : g0, hi = j->hi[c] < g1 - 1 ? j->hi[c] : g1 - 1;
        const double *part = j->partial ? j->partial + c * G : NULL;
        const int64_t *cnt = j->count + c * G;
        for (int64_t g = lo; g <= hi; g++) {
            if (s) s[g] += part[g];
            n[g] += cnt[g];
        }
    }
    if (s)
        for (int64_t g = g0; g < g1; g++) s[g] /= (double)(n[g] > 1 ? n[g] : 1);
    if (j->factor) {
        const double grad = *j->a->grad, G_ = (double)G;
        for (int64_t g = g0; g < g1; g++) j->factor[g] = (float)(grad / ((double)(n[g] > 1 ? n[g] : 1) * G_));
    }
}

/* The chunk pass and the per-graph pass (QK_E_INDEX at the first bad id in edge order). */
static int gb_sums(gb_job *j, int maxt) {
    qk_graph_norm_bce_args *a = j->a;
    const int64_t E = a->num_edges, G = a->num_graphs;
    const int threads = qk_threads_for(E * 64, maxt);
    int status = qk_parallel_run(j->nchunks < threads ? (int)j->nchunks : threads, gb_chunks, j);
    for (int64_t c = 0; status == QK_OK && c < j->nchunks; c++) {
        if (j->bad[c] >= 0) { /* chunks are in edge order: the first bad one is the earliest */
            a->bad_pos = j->bad[c];
            a->bad_value = qk_index(a->edge_graph, a->index_dtype, j->bad[c], a->graph_stride);
            status = QK_E_INDEX;
        }
    }
    if (status == QK_OK) status = qk_parallel_run(qk_threads_for(G * 16 + j->nchunks * 64, maxt), gb_graphs, j);
    return status;
}

/* The layout (chunk sizes) and the work arrays, in one scratch block: the forward's partial sums
 * and per-graph means, or the backward's factors. */
static int gb_alloc(gb_job *j, int forward) {
    const int64_t G = j->a->num_graphs;
    gb_layout(j, j->a->num_edges, G);
    const size_t slots = (size_t)j->nchunks * (size_t)G; /* <= 4M + G: no overflow */
    const size_t bytes = sizeof(int64_t) * (slots + 3 * (size_t)j->nchunks + (size_t)G) +
                         (forward ? sizeof(double) * (slots + (size_t)G) : sizeof(float) * (size_t)G);
    char *m = j->mem = qk_cpu_scratch(bytes);
    if (!m) return QK_E_NOMEM;
    j->count = (int64_t *)m;
    j->lo = j->count + slots;
    j->hi = j->lo + j->nchunks;
    j->bad = j->hi + j->nchunks;
    j->total = j->bad + j->nchunks;
    if (forward) {
        j->partial = (double *)(j->total + G);
        j->per_graph = j->partial + slots;
    } else {
        j->factor = (float *)(j->total + G);
    }
    return QK_OK;
}

/* One value for every edge in a pos_weight tensor: read here (host memory) as the scalar. */
static void gb_scalar_pos_weight(qk_graph_norm_bce_args *a) {
    if (a->pos_weight_t && a->pw_stride == 0) {
        a->pos_weight = *(const float *)a->pos_weight_t;
        a->pos_weight_t = NULL;
    }
}

int qk_graph_norm_bce_cpu(qk_graph_norm_bce_args *a, void *stream) {
    (void)stream;
    if (a->dtype != QK_F32) return QK_E_UNSUPPORTED;
    const int64_t G = a->num_graphs;
    gb_scalar_pos_weight(a);
    gb_job j = {0};
    j.a = a;
    int status = gb_alloc(&j, 1);
    if (status == QK_OK) status = gb_sums(&j, a->num_threads > 0 ? a->num_threads : 1);
    if (status == QK_OK) {
        double part[8] = {0}; /* lane k: graphs g = k mod 8, in order; a fixed order, not one chain */
        int64_t g = 0;
        for (; g + 8 <= G; g += 8)
            for (int k = 0; k < 8; k++) part[k] += j.per_graph[g + k];
        double total = ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
        for (; g < G; g++) total += j.per_graph[g];
        *a->out = (float)(total / (double)G);
    }
    qk_cpu_scratch_release(j.mem);
    return status;
}

/* ---- graph_norm_bce_backward ------------------------------------------------------------------
 * Two passes: the edges of each graph are counted (the forward's chunk pass without the terms;
 * integers, so the order cannot change them), then every edge's gradient is its term
 * w * (sigmoid(l) - t), computed in vectorised blocks, times its graph's factor
 * grad / (max(count, 1) * num_graphs).  Blocks are taken 16 at a time from a shared counter. */

#define GBB_BLOCKS 16

typedef struct {
    const qk_graph_norm_bce_args *a;
    const float *factor; /* [num_graphs] */
    atomic_llong next;   /* the next group of GBB_BLOCKS blocks */
} gbb_job;

QK_MULTIVERSION static void gbb_grads(void *p, int tid, int nthreads) {
    (void)tid;
    (void)nthreads;
    gbb_job *j = p;
    const qk_graph_norm_bce_args *a = j->a;
    const float pw_scalar = a->has_pos_weight ? a->pos_weight - 1.f : 0.f;
    const float *restrict factor = j->factor;
    float term[GB_BLOCK], pwm1[GB_BLOCK], fl[GB_BLOCK];
    int64_t ids[GB_BLOCK];
    const int64_t nblocks = (a->num_edges + GB_BLOCK - 1) / GB_BLOCK;
    for (int64_t grp; (grp = qk_next_item(&j->next)) * GBB_BLOCKS < nblocks;) {
        const int64_t b1 = (grp + 1) * GBB_BLOCKS < nblocks ? (grp + 1) * GBB_BLOCKS : nblocks;
        for (int64_t b = grp * GBB_BLOCKS; b < b1; b++) {
            const int64_t e0 = b * GB_BLOCK;
            const int n = (int)(a->num_edges - e0 < GB_BLOCK ? a->num_edges - e0 : GB_BLOCK);
            const float *lg = (const float *)a->logits + e0 * a->logits_stride;
            const float *tg = (const float *)a->target + e0 * a->target_stride;
            const int64_t ls = a->logits_stride, ts = a->target_stride, os = a->grad_stride;
            if (a->pos_weight_t) gb_pos_weights(a, e0, n, pwm1);
            else
                for (int i = 0; i < n; i++) pwm1[i] = pw_scalar;
            gb_ids(a, e0, n, ids);
            for (int i = 0; i < n; i++) fl[i] = factor[ids[i]]; /* scalar: faster here than a SIMD gather */
            float *out = (float *)a->grad_logits + e0 * os;
            float *restrict dst = os == 1 ? out : term;
            /* sigmoid(l) - t without cancelling 1 - e/(1+e) against t = 1 for large l (or e/(1+e) for small) */
            for (int i = 0; i < n; i++) {
                const float l = lg[i * ls], t = tg[i * ts];
                const float al = fabsf(l), e87 = gb_exp_neg87(al), e = al < 87.f ? e87 : 0.f, q = e / (1.f + e);
                dst[i] = (1.f + pwm1[i] * t) * (l >= 0.f ? (1.f - t) - q : q - t) * fl[i];
            }
            if (os != 1)
                for (int i = 0; i < n; i++) out[i * os] = term[i];
        }
    }
}

int qk_graph_norm_bce_backward_cpu(qk_graph_norm_bce_args *a, void *stream) {
    (void)stream;
    if (a->dtype != QK_F32) return QK_E_UNSUPPORTED;
    const int64_t E = a->num_edges;
    gb_scalar_pos_weight(a);
    const int maxt = a->num_threads > 0 ? a->num_threads : 1;
    gb_job counts = {0};
    counts.a = a;
    int status = gb_alloc(&counts, 0);
    if (status == QK_OK) status = gb_sums(&counts, maxt);
    float *factor = counts.factor;
    if (status == QK_OK) {
        gbb_job j = {.a = a, .factor = factor};
        atomic_init(&j.next, 0);
        status = qk_parallel_run(qk_threads_for(E * 32, maxt), gbb_grads, &j);
    }
    qk_cpu_scratch_release(counts.mem);
    return status;
}
