/* The torch-free CPU kernels: the same launcher shape as the CUDA ones (args struct in, status
 * out), run with the GIL released by the caller. */
#ifndef QK_CPU_H
#define QK_CPU_H

#include "qkernels/launch.h"

#include <stdatomic.h>

/* Hot loops are compiled for AVX-512 and AVX2 besides the x86-64 baseline, the best picked at
 * load time (GCC function multiversioning); PyTorch's CPU kernels dispatch the same way. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define QK_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define QK_MULTIVERSION
#endif

/* Helpers a hot loop calls: always inlined, so that a multiversioned caller runs them in its own
 * instruction set (a call into baseline code stalls on the state transition, and GCC does not
 * vectorise a loop that still calls a function). */
#if defined(__GNUC__)
#define QK_INLINE static inline __attribute__((always_inline))
#else
#define QK_INLINE static inline
#endif

#define QK_CPU_DECLARE(name, args) int qk_##name##_cpu(qk_##args##_args *a, void *stream);
QK_LAUNCHERS(QK_CPU_DECLARE)
#undef QK_CPU_DECLARE

static inline int64_t qk_index(const void *base, int dtype, int64_t pos, int64_t stride) {
    return dtype == QK_I32 ? (int64_t)((const int32_t *)base)[pos * stride] : ((const int64_t *)base)[pos * stride];
}

/* The first of the n indices idx[offset + i * stride] (i = 0 .. n-1) outside [0, hi): QK_E_INDEX with
 * its position i and value in *pos, *value; QK_OK when all are in range. */
static inline int qk_index_range_check(const void *idx, int dtype, int64_t n, int64_t offset, int64_t stride,
                                       int64_t hi, int64_t *pos, int64_t *value) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t v = qk_index(idx, dtype, offset + i * stride, 1);
        if (v < 0 || v >= hi) {
            *pos = i;
            *value = v;
            return QK_E_INDEX;
        }
    }
    return QK_OK;
}

/* [begin, end) of share `tid` out of `nthreads` equal shares of n items. */
static inline void qk_share(int64_t n, int tid, int nthreads, int64_t *begin, int64_t *end) {
    *begin = n * tid / nthreads;
    *end = n * (tid + 1) / nthreads;
}

/* Run fn(ctx, tid, nthreads) on nthreads threads (the caller's thread is tid 0).  Each worker
 * owns a fixed share of the work, so results do not depend on scheduling. */
typedef void (*qk_worker_fn)(void *ctx, int tid, int nthreads);
int qk_parallel_run(int nthreads, qk_worker_fn fn, void *ctx);

/* Test of the pool: `jobs` calls alternating between `few` and `many` threads; *bad_runs counts
 * shares that ran other than once, *late_runs shares still running after their call returned. */
int qk_parallel_selftest(int jobs, int few, int many, int64_t *bad_runs, int64_t *late_runs);

/* Stable grouping of n items by key (a counting sort): item i's key is the index at
 * base[(i / per) * stride_q + (i % per) * stride_r] (dtype QK_I32/QK_I64, per 1 or 2).  Fills
 * offsets[num_keys + 1] and order[n]: the items of key j are order[offsets[j] .. offsets[j+1] - 1],
 * in ascending i, whatever the thread count.  A key outside [0, num_keys) gives QK_E_INDEX with
 * *bad_item the smallest such item and *bad_key its key. */
typedef struct {
    const void *base;
    int dtype, per;
    int64_t stride_q, stride_r;
} qk_key_reader;
int qk_group_by_key(const qk_key_reader *keys, int64_t n, int64_t num_keys, int max_threads, int64_t *offsets,
                    int64_t *order, int64_t *bad_item, int64_t *bad_key);

/* The first of n groups whose cost prefix offsets[j] + j reaches target (offsets non-decreasing):
 * where to cut groups of uneven sizes into shares of equal work. */
static inline int64_t qk_group_at(const int64_t *offsets, int64_t n, int64_t target) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (offsets[mid] + mid < target) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* CSR row offsets row_ptr[i * stride], i = 0 .. n (dtype QK_I32/QK_I64), checked against E entries:
 * non-decreasing within [0, E], and with whole also starting at 0 and ending at E (every entry in a
 * row).  QK_E_INDEX with the first offending position and value in *pos, *value. */
int qk_csr_check(const void *row_ptr, int index_dtype, int64_t stride, int64_t n, int64_t E, int whole, int64_t *pos,
                 int64_t *value);

/* The first of the n rows of a valid CSR whose cost prefix (entries before it from first_entry, plus
 * the row index) reaches target: where a thread's share of rows of uneven lengths starts. */
int64_t qk_csr_row_at(const void *row_ptr, int index_dtype, int64_t stride, int64_t n, int64_t first_entry,
                      int64_t target);

/* The next item of a job whose threads take items from a shared counter (atomic_init to 0 before
 * the run): a thread that starts late (a woken worker) takes only what is left, and the pool runs
 * a share no worker has taken on the caller's thread.  Only for items whose results do not depend
 * on the thread that computes them. */
static inline int64_t qk_next_item(atomic_llong *next) {
    return (int64_t)atomic_fetch_add_explicit(next, 1, memory_order_relaxed);
}

/* Per-call work arrays from a block kept between calls: fresh pages cost a fault each, and malloc
 * hands freed memory back to the system, so a malloc'd array can fault in again at every call.
 * One caller at a time gets the kept block, grown as needed (up to 16 MiB); concurrent callers and
 * larger sizes get malloc.  NULL when out of memory.  Give it back with qk_cpu_scratch_release. */
void *qk_cpu_scratch(size_t bytes);
void qk_cpu_scratch_release(void *p);

/* Threads worth using for `work` multiply-adds: one per ~1M, at most max_threads. */
int qk_threads_for(int64_t work, int max_threads);

#endif
