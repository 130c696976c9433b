/* probe.c — a read-bandwidth probe (STREAM-like "read only" sum) so benchmarks can say what
 * share of this machine's bandwidth a decode step reaches. Runs on cflow's own thread pool. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cflow.h"
#include "util.h"

typedef struct {
    const uint64_t *buf;
    size_t n_words;
    int prefetch; /* software prefetch 4 KiB ahead, or rely on the hardware prefetchers */
    uint64_t sums[64]; /* one per thread, keeps the loads from being optimised away */
} probe_ctx;

static void probe_task(void *p, int ith, int nth) {
    probe_ctx *ctx = (probe_ctx *)p;
    size_t per = (ctx->n_words / (size_t)nth) & ~(size_t)7;
    size_t begin = per * (size_t)ith;
    size_t end = ith == nth - 1 ? ctx->n_words : begin + per;
    /* Eight independent accumulators so the adds never limit the loads. */
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    size_t i = begin;
    for (; i + 8 <= end; i += 8) {
        if (ctx->prefetch) __builtin_prefetch(&ctx->buf[i + 512], 0, 0);
        a0 += ctx->buf[i]; a1 += ctx->buf[i + 1]; a2 += ctx->buf[i + 2]; a3 += ctx->buf[i + 3];
        a4 += ctx->buf[i + 4]; a5 += ctx->buf[i + 5]; a6 += ctx->buf[i + 6]; a7 += ctx->buf[i + 7];
    }
    for (; i < end; i++) a0 += ctx->buf[i];
    if (ith < 64) ctx->sums[ith] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}

/* Best-of-`reps` read bandwidth in GB/s over a buffer of `nbytes` (choose >> last-level cache),
 * the best of a plain read loop and one that prefetches 4 KiB ahead: which one the memory system
 * rewards depends on the machine and the thread count (here: plain wins on 1 thread, prefetch
 * on 2), and a probe that reads less than a kernel can would make "% of bandwidth" meaningless.
 * Returns a negative value if the buffer cannot be allocated. */
double cf_read_bandwidth(size_t nbytes, int n_threads, int reps) {
    size_t n_words = nbytes / sizeof(uint64_t);
    uint64_t *buf = NULL;
    if (n_words < 64 || posix_memalign((void **)&buf, 4096, n_words * sizeof(uint64_t)) != 0) return -1.0;
    for (size_t i = 0; i < n_words; i++) buf[i] = i; /* fault the pages in */
    cf_pool *pool = cf_pool_create(n_threads < 1 ? 1 : n_threads);
    probe_ctx ctx;
    memset(&ctx, 0, sizeof ctx);
    ctx.buf = buf;
    ctx.n_words = n_words;
    double best = 0.0;
    for (int r = 0; r < 2 * (reps < 1 ? 1 : reps); r++) {
        ctx.prefetch = r & 1;
        double t0 = (1e-9 * (double)cf_now_ns());
        cf_pool_run(pool, probe_task, &ctx);
        double dt = (1e-9 * (double)cf_now_ns()) - t0;
        double gbs = (double)(n_words * sizeof(uint64_t)) / dt / 1e9;
        if (gbs > best) best = gbs;
    }
    cf_pool_free(pool);
    free(buf);
    return best;
}
