/* A minimal fork-join over pthreads for the CPU kernels. */
#include "cpu.h"

#include <pthread.h>
#include <stdlib.h>

typedef struct {
    qk_worker_fn fn;
    void *ctx;
    int tid, nthreads;
} qk_job;

static void *qk_job_main(void *p) {
    qk_job *j = p;
    j->fn(j->ctx, j->tid, j->nthreads);
    return NULL;
}

int qk_parallel_run(int nthreads, qk_worker_fn fn, void *ctx) {
    if (nthreads <= 1) {
        fn(ctx, 0, 1);
        return QK_OK;
    }
    pthread_t *threads = malloc(sizeof(pthread_t) * nthreads);
    qk_job *jobs = malloc(sizeof(qk_job) * nthreads);
    char *started = calloc(nthreads, 1);
    if (!threads || !jobs || !started) {
        free(threads);
        free(jobs);
        free(started);
        return QK_E_NOMEM;
    }
    for (int t = 0; t < nthreads; t++) jobs[t] = (qk_job){fn, ctx, t, nthreads};
    for (int t = 1; t < nthreads; t++) started[t] = pthread_create(&threads[t], NULL, qk_job_main, &jobs[t]) == 0;
    fn(ctx, 0, nthreads);
    /* A share whose thread could not start runs here, so the result never depends on it. */
    for (int t = 1; t < nthreads; t++) {
        if (started[t]) pthread_join(threads[t], NULL);
        else fn(ctx, t, nthreads);
    }
    free(threads);
    free(jobs);
    free(started);
    return QK_OK;
}

int qk_threads_for(int64_t work, int max_threads) {
    /* Workers are started per call (no pool yet), which costs tens of µs each and more on VMs:
     * the 16-core H200 host took 4 ms for a 16k-edge sparse_aggregate spread over 16 threads. */
    int64_t t = work / (1 << 20);
    if (t < 1) t = 1;
    return (int)(t < max_threads ? t : max_threads);
}
