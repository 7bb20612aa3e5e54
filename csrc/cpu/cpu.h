/* The torch-free CPU kernels: the same launcher shape as the CUDA ones (args struct in, status
 * out), run with the GIL released by the caller. */
#ifndef QK_CPU_H
#define QK_CPU_H

#include "../../kernels/qk_launch.h"

int qk_sparse_aggregate_cpu(qk_sparse_aggregate_args *a, void *stream);

/* Run fn(ctx, tid, nthreads) on nthreads threads (the caller's thread is tid 0).  Each worker
 * owns a fixed share of the work, so results do not depend on scheduling. */
typedef void (*qk_worker_fn)(void *ctx, int tid, int nthreads);
int qk_parallel_run(int nthreads, qk_worker_fn fn, void *ctx);

/* Threads worth using for `work` multiply-adds: one per ~64k, at most max_threads. */
int qk_threads_for(int64_t work, int max_threads);

#endif
