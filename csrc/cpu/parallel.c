/* Fork-join for the CPU kernels over a persistent pool of pthreads.
 *
 * Starting threads per call cost tens of µs each (more on VMs: the 16-core H200 host took 4 ms
 * for a 16k-edge sparse_aggregate spread over 16 fresh threads), so workers are started once and
 * wait for jobs: a short spin on the job counter, then a condition variable.  One job runs at a
 * time; a call that finds the pool busy (another Python thread inside a CPU op, the GIL released)
 * starts its own threads as before, so concurrent calls never wait on each other.  After fork()
 * the child forgets the parent's workers (they do not exist there) and starts its own. */
#include "cpu.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#define QK_POOL_MAX 64
_Static_assert(QK_POOL_MAX < 256, "a job's thread count fits the low byte of pool.gen");
#define QK_SPIN 2000 /* the caller's pause-loop iterations before it yields: ~20 µs */
/* A worker waits this long for the next job before it sleeps: a sleeping worker takes 10-25 µs to
 * wake on a VM, more than a small job, and the Python between two ops (a forward and its backward)
 * is tens of µs.  Past QK_WORKER_YIELD_NS it yields between checks, so other threads get the core. */
#define QK_WORKER_SPIN_NS 300000
#define QK_WORKER_YIELD_NS 50000

#if defined(__x86_64__) || defined(__i386__)
#define qk_relax() __builtin_ia32_pause()
#else
#define qk_relax() ((void)0)
#endif

static struct {
    pthread_mutex_t owner; /* held by the caller running a job */
    pthread_mutex_t mu;    /* with cv: sleeping workers */
    pthread_cond_t cv;
    int nworkers;
    /* (job number << 8) | the job's thread count: one word, so a worker decides from what it read
     * whether it takes part.  Workers that sit a job out are not waited for; had they read the
     * count from a field of its own, the next job could rewrite it first, and a worker woken for a
     * small job would run a share of the next one twice, the second time after its call returned
     * (on its freed context: a rare SIGSEGV; qk_parallel_selftest counts such shares). */
    atomic_ulong gen;
    atomic_int remaining;
    qk_worker_fn fn; /* read only by the job's participants, which the caller waits for */
    void *ctx;
    /* claim[k] = the job's gen word while share k + 1 is free: worker k takes it by swapping in 0,
     * or the caller does once its own share is done.  A worker that wakes late (a futex wake on a
     * VM can take tens of µs) finds its share done and leaves, so no job waits for a wake-up; one
     * still asleep from an older job fails the compare (the word is the new job's). */
    atomic_ulong claim[QK_POOL_MAX];
    unsigned long start_gen[QK_POOL_MAX];
} pool = {.owner = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

#define QK_SCRATCH_MAX ((size_t)16 << 20)

static struct {
    atomic_flag busy;      /* held by the caller using block */
    _Atomic(void *) block; /* atomic: a release from a malloc'd pointer compares against it */
    size_t size;
} scratch = {ATOMIC_FLAG_INIT, NULL, 0};

static void pool_after_fork_child(void) {
    pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t c = PTHREAD_COND_INITIALIZER;
    pool.owner = m;
    pool.mu = m;
    pool.cv = c;
    pool.nworkers = 0; /* the parent's workers were not copied */
    atomic_flag_clear(&scratch.busy); /* a call the fork interrupted does not exist here */
}

static void pool_init(void) { pthread_atfork(NULL, NULL, pool_after_fork_child); }

static void *pool_worker(void *arg) {
    const int id = (int)(intptr_t)arg; /* runs share id + 1 */
    unsigned long seen = pool.start_gen[id];
    for (;;) {
        unsigned long g;
        unsigned spins = 0;
        int64_t t0 = -1;
        while ((g = atomic_load_explicit(&pool.gen, memory_order_acquire)) == seen) {
            qk_relax();
            if (++spins % 64) continue;
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            const int64_t t = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
            if (t0 < 0) t0 = t;
            if (t - t0 < QK_WORKER_SPIN_NS) {
                if (t - t0 > QK_WORKER_YIELD_NS) sched_yield();
                continue;
            }
            pthread_mutex_lock(&pool.mu);
            while ((g = atomic_load_explicit(&pool.gen, memory_order_acquire)) == seen)
                pthread_cond_wait(&pool.cv, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
            break;
        }
        seen = g;
        /* fn and ctx were written before gen (release) and are read after it (acquire), by
         * participants only: the next job cannot start before each has counted itself done. */
        const int nthreads = (int)(g & 0xff);
        unsigned long expected = g;
        if (id + 1 < nthreads && atomic_compare_exchange_strong_explicit(&pool.claim[id], &expected, 0,
                                                                         memory_order_acq_rel, memory_order_relaxed)) {
            pool.fn(pool.ctx, id + 1, nthreads);
            atomic_fetch_sub_explicit(&pool.remaining, 1, memory_order_release);
        }
    }
    return NULL;
}

/* Threads started for this call only: the path for a busy pool. */
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

static int spawn_run(int nthreads, qk_worker_fn fn, void *ctx) {
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

int qk_parallel_run(int nthreads, qk_worker_fn fn, void *ctx) {
    if (nthreads <= 1) {
        fn(ctx, 0, 1);
        return QK_OK;
    }
    if (nthreads > QK_POOL_MAX) return spawn_run(nthreads, fn, ctx);
    pthread_once(&pool_once, pool_init);
    if (pthread_mutex_trylock(&pool.owner) != 0) return spawn_run(nthreads, fn, ctx);
    while (pool.nworkers < nthreads - 1) {
        pthread_attr_t attr;
        pthread_t t;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pool.start_gen[pool.nworkers] = atomic_load(&pool.gen);
        const int ok = pthread_create(&t, &attr, pool_worker, (void *)(intptr_t)pool.nworkers) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        pool.nworkers++;
    }
    if (pool.nworkers < nthreads - 1) { /* could not grow the pool */
        pthread_mutex_unlock(&pool.owner);
        return spawn_run(nthreads, fn, ctx);
    }
    pool.fn = fn;
    pool.ctx = ctx;
    atomic_store_explicit(&pool.remaining, nthreads - 1, memory_order_relaxed);
    const unsigned long g0 = atomic_load_explicit(&pool.gen, memory_order_relaxed); /* only the owner writes it */
    const unsigned long g = (((g0 >> 8) + 1) << 8) | (unsigned long)nthreads;
    for (int k = 0; k < nthreads - 1; k++) atomic_store_explicit(&pool.claim[k], g, memory_order_relaxed);
    pthread_mutex_lock(&pool.mu);
    atomic_store_explicit(&pool.gen, g, memory_order_release);
    pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
    fn(ctx, 0, nthreads);
    for (int k = 0; k < nthreads - 1; k++) { /* the shares no worker has taken yet: run them here */
        unsigned long expected = g;
        if (atomic_compare_exchange_strong_explicit(&pool.claim[k], &expected, 0, memory_order_acq_rel,
                                                    memory_order_relaxed)) {
            fn(ctx, k + 1, nthreads);
            atomic_fetch_sub_explicit(&pool.remaining, 1, memory_order_relaxed);
        }
    }
    for (int spins = 0; atomic_load_explicit(&pool.remaining, memory_order_acquire) > 0; spins++) {
        if (spins < QK_SPIN) qk_relax();
        else sched_yield(); /* few cores: let the workers run */
    }
    pthread_mutex_unlock(&pool.owner);
    return QK_OK;
}

void *qk_cpu_scratch(size_t bytes) {
    if (bytes == 0) bytes = 1;
    if (bytes > QK_SCRATCH_MAX || atomic_flag_test_and_set_explicit(&scratch.busy, memory_order_acquire))
        return malloc(bytes);
    void *b = atomic_load_explicit(&scratch.block, memory_order_relaxed);
    if (scratch.size < bytes) {
        free(b);
        b = malloc(bytes);
        scratch.size = b ? bytes : 0;
        atomic_store_explicit(&scratch.block, b, memory_order_relaxed);
        if (!b) {
            atomic_flag_clear_explicit(&scratch.busy, memory_order_release);
            return NULL;
        }
    }
    return b;
}

void qk_cpu_scratch_release(void *p) {
    if (p && p == atomic_load_explicit(&scratch.block, memory_order_relaxed))
        atomic_flag_clear_explicit(&scratch.busy, memory_order_release);
    else
        free(p);
}

int qk_threads_for(int64_t work, int max_threads) {
    /* Pooled workers cost a few µs to wake, so a thread pays off from ~256k units of work. */
    int64_t t = work / (1 << 18);
    if (t < 1) t = 1;
    return (int)(t < max_threads ? t : max_threads);
}

/* ---- qk_group_by_key --------------------------------------------------------------------------
 * Each share of the items counts its keys into a row of its own, the rows are turned into each
 * share's first slot per key (key-major, share order within a key), and each share places its
 * items in its own order: stable, so the result is the same for any number of shares.  Shares are
 * capped at n / num_keys so the count rows never outgrow the items. */
typedef struct {
    const qk_key_reader *keys;
    int64_t n, num_keys;
    int64_t *counts; /* [shares][num_keys]: counts, then each share's next slot per key */
    int64_t *offsets, *order, *block;
    int64_t *bad_item, *bad_key; /* per share: the first bad item (-1 none) */
    int rows, phase;
} qk_group_job;

static inline int64_t qk_key_at(const qk_key_reader *k, int64_t i) {
    const int64_t pos = k->per == 1 ? i * k->stride_q : (i >> 1) * k->stride_q + (i & 1) * k->stride_r;
    return k->dtype == QK_I32 ? (int64_t)((const int32_t *)k->base)[pos] : ((const int64_t *)k->base)[pos];
}

static void qk_group_worker(void *p, int tid, int nthreads) {
    qk_group_job *j = p;
    int64_t *row = j->counts + (int64_t)tid * j->num_keys;
    int64_t i0, i1;
    if (j->phase == 0) { /* count this share's keys */
        qk_share(j->n, tid, nthreads, &i0, &i1);
        j->bad_item[tid] = -1;
        for (int64_t i = i0; i < i1; i++) {
            const int64_t key = qk_key_at(j->keys, i);
            if (key < 0 || key >= j->num_keys) {
                j->bad_item[tid] = i;
                j->bad_key[tid] = key;
                return;
            }
            row[key]++;
        }
    } else if (j->phase == 1 || j->phase == 2) { /* this share of the keys: totals, then first slots */
        qk_share(j->num_keys, tid, nthreads, &i0, &i1);
        int64_t run = j->phase == 2 ? j->block[tid] : 0;
        for (int64_t key = i0; key < i1; key++) {
            if (j->phase == 2) j->offsets[key] = run;
            for (int t = 0; t < j->rows; t++) {
                int64_t *c = j->counts + (int64_t)t * j->num_keys + key;
                const int64_t count = *c;
                if (j->phase == 2) *c = run;
                run += count;
            }
        }
        if (j->phase == 1) j->block[tid] = run;
    } else { /* place this share's items, in order */
        qk_share(j->n, tid, nthreads, &i0, &i1);
        for (int64_t i = i0; i < i1; i++) j->order[row[qk_key_at(j->keys, i)]++] = i;
    }
}

int qk_group_by_key(const qk_key_reader *keys, int64_t n, int64_t num_keys, int max_threads, int64_t *offsets,
                    int64_t *order, int64_t *bad_item, int64_t *bad_key) {
    int64_t shares = num_keys > 0 ? n / num_keys : 1;
    const int cap = qk_threads_for(4 * n, max_threads > 0 ? max_threads : 1);
    if (shares > cap) shares = cap;
    if (shares < 1) shares = 1;
    const int t = (int)shares;
    qk_group_job j = {.keys = keys, .n = n, .num_keys = num_keys, .offsets = offsets, .order = order, .rows = t};
    j.counts = calloc((size_t)(t * num_keys > 0 ? t * num_keys : 1), sizeof(int64_t));
    int64_t *scratch = malloc(sizeof(int64_t) * 3 * (size_t)t);
    if (j.counts == NULL || scratch == NULL) {
        free(j.counts);
        free(scratch);
        return QK_E_NOMEM;
    }
    j.block = scratch;
    j.bad_item = scratch + t;
    j.bad_key = scratch + 2 * t;
    int status = qk_parallel_run(t, qk_group_worker, &j);
    for (int s = 0; status == QK_OK && s < t; s++) {
        if (j.bad_item[s] >= 0) { /* shares hold ascending items: the first share's is the smallest */
            *bad_item = j.bad_item[s];
            *bad_key = j.bad_key[s];
            status = QK_E_INDEX;
        }
    }
    /* the key ranges of the scan: as many shares as pay for num_keys * t reads */
    const int scan = qk_threads_for(num_keys * t, t);
    if (status == QK_OK) {
        j.phase = 1;
        status = qk_parallel_run(scan, qk_group_worker, &j);
    }
    if (status == QK_OK) {
        int64_t run = 0;
        for (int s = 0; s < scan; s++) {
            const int64_t total = j.block[s];
            j.block[s] = run;
            run += total;
        }
        offsets[num_keys] = run;
        j.phase = 2;
        status = qk_parallel_run(scan, qk_group_worker, &j);
    }
    if (status == QK_OK) {
        j.phase = 3;
        status = qk_parallel_run(t, qk_group_worker, &j);
    }
    free(j.counts);
    free(scratch);
    return status;
}

/* ---- a self-test of the pool (tests/test_parallel.py) ----------------------------------------
 * Jobs alternate between few and many threads, as the CPU ops' thread counts do from one call to
 * the next; every share records itself in its job's row, and a share still running after its
 * qk_parallel_run returned records that too.  The rows live on the heap until the end, so a late
 * share never touches freed memory. */
typedef struct {
    atomic_int runs[QK_POOL_MAX];
    atomic_int finished; /* set once qk_parallel_run has returned */
    atomic_int late;
} selftest_job;

static void selftest_share(void *ctx, int tid, int nthreads) {
    selftest_job *j = ctx;
    (void)nthreads;
    for (volatile int i = 0; i < 64; i++) { /* a little work, so shares overlap the next job's set-up */
    }
    atomic_fetch_add(&j->runs[tid], 1);
    if (atomic_load(&j->finished)) atomic_fetch_add(&j->late, 1);
}

int qk_parallel_selftest(int jobs, int few, int many, int64_t *bad_runs, int64_t *late_runs) {
    if (jobs < 1 || few < 1 || many < 1 || few > QK_POOL_MAX || many > QK_POOL_MAX) return QK_E_UNSUPPORTED;
    selftest_job *rows = calloc((size_t)jobs, sizeof *rows);
    if (!rows) return QK_E_NOMEM;
    int status = QK_OK;
    for (int i = 0; i < jobs && status == QK_OK; i++) {
        status = qk_parallel_run(i % 2 ? many : few, selftest_share, &rows[i]);
        atomic_store(&rows[i].finished, 1);
    }
    struct timespec pause = {0, 20 * 1000 * 1000}; /* let any straggler finish before counting */
    nanosleep(&pause, NULL);
    int64_t bad = 0, late = 0;
    for (int i = 0; i < jobs; i++) {
        const int n = i % 2 ? many : few;
        for (int t = 0; t < QK_POOL_MAX; t++) bad += atomic_load(&rows[i].runs[t]) != (t < n);
        late += atomic_load(&rows[i].late);
    }
    free(rows);
    *bad_runs = bad;
    *late_runs = late;
    return status;
}

