/* threadpool.c — a persistent pool of pthreads for the per-token path.
 *
 * cf_pool_run(fn, ctx) splits the call into nth shares fn(ctx, ith, nth), ith in [0, nth). The
 * caller publishes (fn, ctx), bumps a generation counter and runs share 0 itself; workers
 * notice the new generation and claim the remaining shares one at a time from an atomic
 * counter. When the caller is done with share 0 it claims whatever shares are still unclaimed,
 * so a worker that the OS has not scheduled yet (a busy or oversubscribed machine) delays the
 * call by nothing instead of by a time slice. Each share runs exactly once, on some thread;
 * shares may rely on running concurrently (barriers between shares are fine), because a thread
 * only claims a further share after finishing one, and a share that waits at a barrier cannot
 * finish before every share has been claimed.
 *
 * Both sides spin first (a decode step issues hundreds of runs microseconds apart, and a futex
 * round trip costs more than most of them) and sleep on a futex once a spin budget has passed,
 * so an idle pool costs no CPU. Nothing is allocated per run.
 *
 * Lost wake-ups are impossible because each side publishes before it checks: the caller bumps
 * `gen` then reads `sleepers`; a worker bumps `sleepers` then re-reads `gen` inside futex_wait.
 * With sequentially consistent atomics at least one of them sees the other's write. The claim
 * word carries the generation in its high half, so a late worker can never claim a share of a
 * newer run with the older run's (fn, ctx).
 * The spin budget is CFLOW_SPIN_US microseconds (default 100).
 */
#define _GNU_SOURCE
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cflow.h"
#include "util.h"

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define CACHE_LINE 64
#define DEFAULT_SPIN_US 100

struct cf_pool {
    /* Each hot word on its own cache line: workers poll gen while the caller's thread 0
     * and finishing workers hammer pending. */
    _Alignas(CACHE_LINE) _Atomic uint32_t gen;
    _Alignas(CACHE_LINE) _Atomic uint64_t work;    /* gen << 32 | next unclaimed share */
    _Alignas(CACHE_LINE) _Atomic uint32_t pending; /* shares 1..n-1 not finished yet */
    _Alignas(CACHE_LINE) _Atomic int sleepers;  /* workers asleep (or about to be) on gen */
    _Atomic int caller_sleeping;                 /* caller asleep (or about to be) on pending */
    _Atomic int stop;
    cf_task_fn fn;
    void *ctx;
    int n;
    long spin_ns;
    pthread_t *threads; /* [n - 1] */
#ifndef __linux__
    pthread_mutex_t mu;
    pthread_cond_t cv;
#endif
};

/* ---- wait / wake on a 32-bit word --------------------------------------------------------- */

#ifdef __linux__
void cf_word_wait(_Atomic uint32_t *addr, uint32_t val) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}
void cf_word_wake(_Atomic uint32_t *addr, int n) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}
static void word_wait(cf_pool *p, _Atomic uint32_t *addr, uint32_t val) {
    (void)p;
    cf_word_wait(addr, val);
}
static void word_wake(cf_pool *p, _Atomic uint32_t *addr, int n) {
    (void)p;
    cf_word_wake(addr, n);
}
#else
void cf_word_wait(_Atomic uint32_t *addr, uint32_t val) {
    if (atomic_load(addr) == val) sched_yield();
}
void cf_word_wake(_Atomic uint32_t *addr, int n) {
    (void)addr;
    (void)n;
}
/* The pool has a mutex and condition variable to sleep on where there is no futex. */
static void word_wait(cf_pool *p, _Atomic uint32_t *addr, uint32_t val) {
    pthread_mutex_lock(&p->mu);
    while (atomic_load(addr) == val) pthread_cond_wait(&p->cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
static void word_wake(cf_pool *p, _Atomic uint32_t *addr, int n) {
    (void)addr;
    (void)n;
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}
#endif

void cf_word_wait_spin(_Atomic uint32_t *word, uint32_t val, int spin, _Atomic uint32_t *sleepers) {
    for (int spins = 0; atomic_load_explicit(word, memory_order_acquire) == val; spins++) {
        if (spins < spin) {
            cf_cpu_relax();
            continue;
        }
        atomic_fetch_add(sleepers, 1);
        cf_word_wait(word, val);
        atomic_fetch_sub(sleepers, 1);
    }
}

/* Spin until *addr != val or the budget runs out; returns the last value seen. */
static uint32_t spin_while_equal(const cf_pool *p, _Atomic uint32_t *addr, uint32_t val) {
    long deadline = 0;
    for (unsigned i = 0;; i++) {
        uint32_t cur = atomic_load_explicit(addr, memory_order_acquire);
        if (cur != val) return cur;
        cf_cpu_relax();
        if ((i & 63) == 63) { /* read the clock rarely: it costs ~20 ns */
            long t = (long)cf_now_ns();
            if (deadline == 0) deadline = t + p->spin_ns;
            else if (t > deadline) return val;
        }
    }
}

/* ---- workers ----------------------------------------------------------------------------- */

static uint32_t wait_new_generation(cf_pool *p, uint32_t seen) {
    uint32_t g = spin_while_equal(p, &p->gen, seen);
    if (g != seen) return g;
    atomic_fetch_add(&p->sleepers, 1);
    while ((g = atomic_load(&p->gen)) == seen) word_wait(p, &p->gen, seen);
    atomic_fetch_sub(&p->sleepers, 1);
    return g;
}

/* Claim the next share of run `g`; -1 when all are taken or the run is no longer current. */
static int claim_share(cf_pool *p, uint32_t g) {
    uint64_t w = atomic_load(&p->work);
    for (;;) {
        if ((uint32_t)(w >> 32) != g || (int)(uint32_t)w >= p->n) return -1;
        if (atomic_compare_exchange_weak(&p->work, &w, w + 1)) return (int)(uint32_t)w;
    }
}

/* Run every share of run `g` this thread can claim (fn and ctx belong to run g: the caller
 * does not publish another run before all of g's shares are finished). */
static void run_shares(cf_pool *p, uint32_t g) {
    int ith;
    while ((ith = claim_share(p, g)) >= 0) {
        p->fn(p->ctx, ith, p->n);
        if (atomic_fetch_sub(&p->pending, 1) == 1 && atomic_load(&p->caller_sleeping))
            word_wake(p, &p->pending, 1);
    }
}

static void *worker_main(void *arg) {
    cf_pool *p = (cf_pool *)arg;
    uint32_t seen = 0;
    for (;;) {
        seen = wait_new_generation(p, seen);
        if (atomic_load(&p->stop)) break;
        run_shares(p, seen);
    }
    return NULL;
}

/* The caller's side: spin until every worker has counted down, then sleep until the last one
 * (which sees caller_sleeping) wakes us. A futex_wait on a stale count returns at once. */
static void wait_all_done(cf_pool *p) {
    long deadline = 0;
    for (unsigned i = 0;; i++) {
        if (atomic_load_explicit(&p->pending, memory_order_acquire) == 0) return;
        cf_cpu_relax();
        if ((i & 63) == 63) {
            long t = (long)cf_now_ns();
            if (deadline == 0) deadline = t + p->spin_ns;
            else if (t > deadline) break;
        }
    }
    atomic_store(&p->caller_sleeping, 1);
    uint32_t left;
    while ((left = atomic_load(&p->pending)) != 0) word_wait(p, &p->pending, left);
    atomic_store(&p->caller_sleeping, 0);
}

/* ---- public API -------------------------------------------------------------------------- */

static long spin_budget_ns(void) {
    const char *env = getenv("CFLOW_SPIN_US");
    long us = env && *env ? atol(env) : DEFAULT_SPIN_US;
    return (us < 0 ? 0 : us) * 1000L;
}

cf_pool *cf_pool_create(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    cf_pool *p = NULL;
    if (posix_memalign((void **)&p, CACHE_LINE, sizeof *p) != 0) return NULL;
    memset(p, 0, sizeof *p);
    p->n = n_threads;
    p->spin_ns = spin_budget_ns();
#ifndef __linux__
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
#endif
    int nw = n_threads - 1;
    p->threads = calloc((size_t)(nw > 0 ? nw : 1), sizeof *p->threads);
    if (!p->threads) {
        free(p);
        return NULL;
    }
    for (int i = 0; i < nw; i++) {
        if (pthread_create(&p->threads[i], NULL, worker_main, p) != 0) {
            p->n = i + 1; /* shut down the workers that did start */
            cf_pool_free(p);
            return NULL;
        }
    }
    return p;
}

void cf_pool_free(cf_pool *p) {
    if (!p) return;
    atomic_store(&p->stop, 1);
    atomic_fetch_add(&p->gen, 1);
    word_wake(p, &p->gen, INT_MAX);
    for (int i = 0; i < p->n - 1; i++) pthread_join(p->threads[i], NULL);
#ifndef __linux__
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
#endif
    free(p->threads);
    free(p);
}

int cf_pool_size(const cf_pool *p) { return p->n; }

void cf_pool_run(cf_pool *p, cf_task_fn fn, void *ctx) {
    if (p->n == 1) {
        fn(ctx, 0, 1);
        return;
    }
    uint32_t g = atomic_load(&p->gen) + 1;
    p->fn = fn;
    p->ctx = ctx;
    atomic_store(&p->pending, (uint32_t)(p->n - 1));
    atomic_store(&p->work, (uint64_t)g << 32 | 1); /* share 0 is the caller's */
    atomic_store(&p->gen, g);                      /* publishes fn, ctx, pending, work */
    if (atomic_load(&p->sleepers) > 0) word_wake(p, &p->gen, INT_MAX);
    fn(ctx, 0, p->n);
    run_shares(p, g); /* shares no worker has picked up yet */
    wait_all_done(p);
}

// ---------------------------------------------------------------------------------------------
// the barrier between the shares of a run (cflow.h)

#define BARRIER_SPIN 2000 /* pause iterations: tens of microseconds */

void cf_barrier_wait(cf_barrier *b) {
    if (b->n <= 1) return;
    uint32_t phase = atomic_load_explicit(&b->phase, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->count, 1, memory_order_acq_rel) == b->n - 1) {
        atomic_store_explicit(&b->count, 0, memory_order_relaxed);
        /* seq_cst on both sides: either a sleeper's increment is seen here, or its futex_wait
         * sees the new phase and returns at once. */
        atomic_fetch_add(&b->phase, 1);
        if (atomic_load(&b->sleepers) > 0) cf_word_wake(&b->phase, INT_MAX);
        return;
    }
    cf_word_wait_spin(&b->phase, phase, BARRIER_SPIN, &b->sleepers);
}
