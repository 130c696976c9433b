/* probe.c — a read-bandwidth probe (STREAM-like "read only" sum) so benchmarks can say what
 * share of this machine's bandwidth a decode step reaches. Runs on cflow's own thread pool. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
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
    /* 2 MiB-aligned and advised MADV_HUGEPAGE, as the engine's copy of the weights is
     * (cflow.runtime.pages): with 4 KiB pages the probe would time TLB misses as well as memory,
     * and on a VM those cost more than the reads (measured on a 2-core Xeon VM: 6-8 GB/s on one
     * thread with 4 KiB pages, where a decode step streams 19 GB/s from 2 MiB pages). */
    if (n_words < 64 || posix_memalign((void **)&buf, 2u << 20, n_words * sizeof(uint64_t)) != 0) return -1.0;
#ifdef MADV_HUGEPAGE
    madvise(buf, n_words * sizeof(uint64_t), MADV_HUGEPAGE);
#endif
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

/* ---- int8 compute peak --------------------------------------------------------------------- */
/* The ceiling prefill's batched kernels work under: the multiply-add instruction they are built
 * on, issued back to back into independent accumulators with no loads, on every thread. Reported
 * as int8 ops/s (a multiply-add is 2 ops), so "prefill GOP/s ÷ peak" says how close the matmat
 * kernels come to what the cores can compute. One instruction form per kernel table:
 * avx512 = vpdpbusd zmm (64 MACs), avxvnni = vpdpbusd ymm (32), avx2 = vpmaddubsw+vpmaddwd+vpaddd
 * (32 MACs for three instructions). */
#if defined(__x86_64__) && (defined(CFLOW_HAVE_AVX2) || defined(CFLOW_HAVE_AVX512))
#include <immintrin.h>
#endif

#define PEAK_ACC 12 /* independent chains: enough to cover latency x issue width on current cores */
/* Without this the compiler sees a constant product added n times and folds the loop away (it
 * did: "1 TOP/s" on one core). The empty asm makes a and b unknown each iteration, at no cost. */
#define OPAQUE(a, b) __asm__("" : "+v"(a), "+v"(b))

typedef struct {
    int isa;               /* 0 avx2, 1 avxvnni, 2 avx512 */
    long iters;
    int32_t sink[64];
} peak_ctx;

#if defined(__x86_64__) && defined(CFLOW_HAVE_AVX512)
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static int32_t peak_avx512(long iters) {
    __m512i acc[PEAK_ACC], a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-5);
    for (int j = 0; j < PEAK_ACC; j++) acc[j] = _mm512_set1_epi32(j);
    for (long i = 0; i < iters; i++) {
        OPAQUE(a, b);
        for (int j = 0; j < PEAK_ACC; j++) acc[j] = _mm512_dpbusd_epi32(acc[j], a, b);
    }
    __m512i s = acc[0];
    for (int j = 1; j < PEAK_ACC; j++) s = _mm512_add_epi32(s, acc[j]);
    return _mm512_reduce_add_epi32(s);
}
#endif

#if defined(__x86_64__) && defined(CFLOW_HAVE_AVXVNNI)
__attribute__((target("avx2,avxvnni")))
static int32_t peak_avxvnni(long iters) {
    __m256i acc[PEAK_ACC], a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-5);
    for (int j = 0; j < PEAK_ACC; j++) acc[j] = _mm256_set1_epi32(j);
    for (long i = 0; i < iters; i++) {
        OPAQUE(a, b);
        for (int j = 0; j < PEAK_ACC; j++) acc[j] = _mm256_dpbusd_avx_epi32(acc[j], a, b);
    }
    __m256i s = acc[0];
    for (int j = 1; j < PEAK_ACC; j++) s = _mm256_add_epi32(s, acc[j]);
    return _mm256_extract_epi32(s, 0) + _mm256_extract_epi32(s, 7);
}
#endif

#if defined(__x86_64__) && defined(CFLOW_HAVE_AVX2)
__attribute__((target("avx2")))
static int32_t peak_avx2(long iters) {
    __m256i acc[PEAK_ACC], a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-5), ones = _mm256_set1_epi16(1);
    for (int j = 0; j < PEAK_ACC; j++) acc[j] = _mm256_set1_epi32(j);
    for (long i = 0; i < iters; i++) {
        OPAQUE(a, b);
        for (int j = 0; j < PEAK_ACC; j++)
            acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
    }
    __m256i s = acc[0];
    for (int j = 1; j < PEAK_ACC; j++) s = _mm256_add_epi32(s, acc[j]);
    return _mm256_extract_epi32(s, 0) + _mm256_extract_epi32(s, 7);
}
#endif

static void peak_task(void *p, int ith, int nth) {
    (void)nth;
    peak_ctx *ctx = (peak_ctx *)p;
    int32_t r = 0;
#if defined(__x86_64__) && defined(CFLOW_HAVE_AVX512)
    if (ctx->isa == 2) r = peak_avx512(ctx->iters);
#endif
#if defined(__x86_64__) && defined(CFLOW_HAVE_AVXVNNI)
    if (ctx->isa == 1) r = peak_avxvnni(ctx->iters);
#endif
#if defined(__x86_64__) && defined(CFLOW_HAVE_AVX2)
    if (ctx->isa == 0) r = peak_avx2(ctx->iters);
#endif
    if (ith < 64) ctx->sink[ith] = r;
}

/* Best-of-`reps` int8 multiply-add throughput in GOP/s (2 ops per MAC) on `n_threads` threads for
 * the kernel table `isa` ("avx2", "avxvnni", "avx512"). Returns -1 when that form was not compiled
 * in or the CPU lacks it (the caller checks cpu_features; this only guards the compile). */
double cf_int8_peak(const char *isa, int n_threads, int reps) {
    int id = isa == NULL ? -1 : strcmp(isa, "avx512") == 0 ? 2 : strcmp(isa, "avxvnni") == 0 ? 1
           : strcmp(isa, "avx2") == 0 ? 0 : -1;
    int compiled = 0;
#if defined(__x86_64__) && defined(CFLOW_HAVE_AVX512)
    compiled |= id == 2;
#endif
#if defined(__x86_64__) && defined(CFLOW_HAVE_AVXVNNI)
    compiled |= id == 1;
#endif
#if defined(__x86_64__) && defined(CFLOW_HAVE_AVX2)
    compiled |= id == 0;
#endif
    if (!compiled) return -1.0;
    const double macs_per_iter = PEAK_ACC * (id == 2 ? 64.0 : 32.0);
    cf_pool *pool = cf_pool_create(n_threads < 1 ? 1 : n_threads);
    if (!pool) return -1.0;
    peak_ctx ctx;
    memset(&ctx, 0, sizeof ctx);
    ctx.isa = id;
    ctx.iters = 1L << 16;
    double best = 0.0;
    for (int r = 0; r < (reps < 1 ? 1 : reps); r++) {
        double t0 = (1e-9 * (double)cf_now_ns());
        cf_pool_run(pool, peak_task, &ctx);
        double dt = (1e-9 * (double)cf_now_ns()) - t0;
        if (dt < 0.05 && r == 0) { /* too short to time well: scale to ~0.1 s and start over */
            ctx.iters = (long)((double)ctx.iters * 0.1 / (dt > 1e-6 ? dt : 1e-6));
            r = -1;
            continue;
        }
        double gops = 2.0 * macs_per_iter * (double)ctx.iters * (double)cf_pool_size(pool) / dt / 1e9;
        if (gops > best) best = gops;
    }
    cf_pool_free(pool);
    return best;
}
