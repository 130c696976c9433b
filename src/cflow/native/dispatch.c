/* dispatch.c — picks the kernel table once per process from a CPU-feature probe.
 *
 * The build compiles each ISA file with its own flags and never with -march=native, so the
 * same binary runs on any x86-64; this file decides at run time which table is safe and best.
 * CFLOW_ISA=ref|avx2|avxvnni|avx512|auto overrides the choice (an unavailable name falls back to the
 * best available table; Python's cflow._native.isa() shows what was chosen).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "cflow.h"
#include "kernels_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define CF_X86 1
#endif

#ifdef CFLOW_HAVE_AVX2
const cf_kernel_table *cf_kernels_avx2(void);
#endif
#ifdef CFLOW_HAVE_AVXVNNI
const cf_kernel_table *cf_kernels_avxvnni(void);
#endif
#ifdef CFLOW_HAVE_AVX512
/* A copy of `base` (the best AVX2-family table) with its own batched kernels (kernels_avx512.c). */
const cf_kernel_table *cf_kernels_avx512(const cf_kernel_table *base);
#endif

/* The software-prefetch mode (cflow.h, claim C6); relaxed atomics: the kernels read it once per
 * call, and it never changes a result, only which lines are asked for early. */
_Atomic int cf_prefetch_mode = CF_PREFETCH_DEFAULT;

int cf_set_prefetch(int mode) {
    if (mode < CF_PREFETCH_DEFAULT || mode > CF_PREFETCH_MAX) return -1;
    atomic_store_explicit(&cf_prefetch_mode, mode, memory_order_relaxed);
    return 0;
}
int cf_get_prefetch(void) { return atomic_load_explicit(&cf_prefetch_mode, memory_order_relaxed); }

/* ---- CPU probe --------------------------------------------------------------------------- */

#ifdef CF_X86
static unsigned long long xgetbv0(void) {
    unsigned eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((unsigned long long)edx << 32) | eax;
}
#endif

static unsigned probe_features(void) {
    unsigned f = 0;
#ifdef CF_X86
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    int osxsave = (c >> 27) & 1;
    if (!osxsave) return 0;
    unsigned long long xcr0 = xgetbv0();
    int ymm_ok = (xcr0 & 0x6) == 0x6;    /* the OS saves SSE and AVX state */
    int zmm_ok = (xcr0 & 0xe6) == 0xe6;  /* ... and the AVX-512 opmask/zmm state */
    if (!ymm_ok) return 0;
    if ((c >> 28) & 1) f |= CF_CPU_AVX;
    if ((c >> 12) & 1) f |= CF_CPU_FMA;
    if ((c >> 29) & 1) f |= CF_CPU_F16C;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        if ((b >> 5) & 1) f |= CF_CPU_AVX2;
        if (zmm_ok) {
            if ((b >> 16) & 1) f |= CF_CPU_AVX512F;
            if ((b >> 30) & 1) f |= CF_CPU_AVX512BW;
            if ((b >> 31) & 1) f |= CF_CPU_AVX512VL;
            if ((c >> 11) & 1) f |= CF_CPU_AVX512VNNI;
        }
    }
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 4) & 1)) f |= CF_CPU_AVXVNNI;
#endif
    return f;
}

/* The CPU's vendor string (cpuid leaf 0: ebx, edx, ecx), "" where there is none. */
static void probe_vendor(char out[13]) {
    memset(out, 0, 13);
#ifdef CF_X86
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return;
    memcpy(out, &b, 4);
    memcpy(out + 4, &d, 4);
    memcpy(out + 8, &c, 4);
#endif
}

/* AMD family 19h with AVX-512: Zen 4 (Zen 3, the same family, has none). */
static int probe_zen4(unsigned features, const char *vendor) {
#ifdef CF_X86
    unsigned a, b, c, d;
    if (!(features & CF_CPU_AVX512F) || strcmp(vendor, "AuthenticAMD") != 0 || !__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    unsigned family = ((a >> 8) & 0xf) + (((a >> 8) & 0xf) == 0xf ? (a >> 20) & 0xff : 0);
    return family == 0x19;
#else
    (void)features;
    (void)vendor;
    return 0;
#endif
}

static unsigned g_features;
static int g_zen4, g_intel;
static pthread_once_t g_features_once = PTHREAD_ONCE_INIT;
static void features_init(void) {
    char vendor[13];
    probe_vendor(vendor);
    g_features = probe_features();
    g_zen4 = probe_zen4(g_features, vendor);
    g_intel = strcmp(vendor, "GenuineIntel") == 0;
}

unsigned cf_cpu_features(void) {
    pthread_once(&g_features_once, features_init);
    return g_features;
}

/* The one-row mat-vec's default-mode prefetch distance (cflow.h). Measured with `cflow bench
 * --prefetch off|default`, decode tokens/s at 1 / 2 threads:
 * - Zen 5 VM (2026-11-30): 8 KiB ahead helps every dtype: the ~1B Q4_0 46.6 -> 54.1 / 86.6 -> 101.6,
 *   SmolLM2 Q4_1 299.7 -> 366.1 / 445.6 -> 596.5 (off -> 8 KiB);
 * - Zen 4 VM (2026-12-05, AMD EPYC family 19h model 11h): it hurts: SmolLM2 Q4_1 off 235 / 362 against
 *   8 KiB 168 / 290 (avx512 table), 211 / 311 against 150 / 240 (avx2 table); the ~1B Q4_0 46.7 /
 *   58.4 against 34.8 / 56.5; prefill alike (pp512 835-845 / 1301-1423 against 811-826 / 1446-1470).
 * - Intel Xeon VM with AMX (2026-12-06, weights in 2 MiB pages): 4 KiB and more ahead hurts, 1-2 KiB
 *   helps: the ~1B Q4_0 off 19.3-19.6 / 33.5-35.3, 1 KiB 23.1-23.9 / 42.4-44.0, 2 KiB 22.5-24.1 /
 *   40.7-44.7, 3 KiB 20.4-20.7 / 33.2-40.4, 4 KiB 14.1-14.5 / 24.2-26.0, 8 KiB 13.0-13.6 / 21.3-23.1,
 *   16 KiB 15.3-16.7 / 30.6-30.9; SmolLM2 Q4_1 at 1 thread off 100-107, 2 KiB 119-136, 8 KiB 84-93
 *   (2-4 alternated runs of `cflow bench -p 0 --prefetch N` each; SmolLM2's 2-thread figures moved
 *   1.5x between runs of one setting). From DRAM (benchmarks/kquant_kernels.py --settings dram
 *   --shapes 5632x2048 --prefetch N) 2 KiB is the fastest of 0 / 2 / 8 KiB for every dtype but
 *   Q6_K, 14-15 GB/s at 1 thread against 8-10 at 8 KiB; Q6_K ran alike at 2 and 8 KiB.
 * So none on Zen 4, 2 KiB on Intel, 8 KiB elsewhere. Q6_K keeps 8 KiB everywhere: its two
 * interleaved streams defeat the hardware prefetcher (kernels_kquant_avx2.inc). */
int cf_matvec_default_ahead(int dtype) {
    cf_cpu_features();
    if (dtype == CF_Q6_K) return 8192;
    return g_zen4 ? 0 : g_intel ? 2048 : 8192;
}

/* Whether the avx512 table's own Q6_K mat-vec (kernels_kquant_avx512.c) keeps up with memory. Not on
 * Zen 4: measured 2026-12-05 on the Zen 4 VM (benchmarks/kquant_kernels.py --dtypes q4_0 q6_k --isa
 * avx2 avx512 --settings dram, 2816x1024): Q6_K from DRAM 11.5-12.5 GB/s through it against 20.3-22.1
 * through the AVX2-family kernel (Q4_0: 28.5) at 1 thread, 23-27 against 40-41 at 2, whatever the
 * prefetch distance (0 to 64 KiB: 9.5-13.3), while in L2 it is the faster one (35 against 26 GB/s);
 * a random 8-layer Q4_K_M file (Q6_K 37% of its bytes) decoded a token in 0.71x / 0.79x the time at
 * 1 / 2 threads with the AVX2-family Q6_K kernels (benchmarks/small_batch_ab.py, logits equal). On
 * the Zen 5 VM it streamed at Q4_0's GB/s (docs/kquants.md), so it stays everywhere else.
 * CFLOW_AVX512_Q6K=1 / 0 forces the choice (read once, when the avx512 table is built): the tests
 * run the zmm Q6_K kernels on every AVX-512 machine through it. */
int cf_avx512_q6k_streams(void) {
    cf_cpu_features();
    const char *env = getenv("CFLOW_AVX512_Q6K");
    if (env && (strcmp(env, "1") == 0 || strcmp(env, "0") == 0)) return env[0] == '1';
    return !g_zen4;
}

/* How the avx512 table's matmat runs batches of 2 to 16 Q4_0 / Q4_1 / Q8_0 tokens (speculative
 * verification, a few decode rows): one group at a time in 256-bit vectors (kernels_avx512.c,
 * "sg_") on Zen 4, whose 512-bit operations run as two 256-bit halves, so 8 rows per ymm cost
 * what 16 per zmm do and the one memory stream wins; two groups per zmm ("sb_", the pair path)
 * where a zmm operation runs at full width, so each vpdpbusd does twice the work (on an Intel
 * Xeon with AMX, steps of 2-16 rows took 0.85x-0.94x the time: kernels_avx512.c, sg_ section).
 * CFLOW_AVX512_SMALL_BATCH=group / pair forces the choice (read once, when the avx512 table is
 * built): the tests run both on every AVX-512 machine through it. */
int cf_avx512_small_batch_groups(void) {
    cf_cpu_features();
    const char *env = getenv("CFLOW_AVX512_SMALL_BATCH");
    if (env && (strcmp(env, "group") == 0 || strcmp(env, "pair") == 0)) return env[0] == 'g';
    return g_zen4;
}

/* ---- tables ------------------------------------------------------------------------------ */

static int has_all(unsigned need) { return (cf_cpu_features() & need) == need; }

#define NEED_AVX2 (CF_CPU_AVX | CF_CPU_AVX2 | CF_CPU_FMA | CF_CPU_F16C)
#define NEED_AVX512 (CF_CPU_AVX512F | CF_CPU_AVX512BW | CF_CPU_AVX512VL | CF_CPU_AVX512VNNI)

/* Every table this build knows, worst first; NULL where the CPU lacks the features. */
static int candidate_tables(const cf_kernel_table **out) {
    int n = 0;
    out[n++] = cf_kernels_ref();
#ifdef CFLOW_HAVE_AVX2
    if (has_all(NEED_AVX2)) out[n++] = cf_kernels_avx2();
#endif
#ifdef CFLOW_HAVE_AVXVNNI
    if (has_all(NEED_AVX2 | CF_CPU_AVXVNNI)) out[n++] = cf_kernels_avxvnni();
#endif
#if defined(CFLOW_HAVE_AVX512) && defined(CFLOW_HAVE_AVX2)
    /* probe_features sets the AVX-512 bits only when the OS saves zmm state (xcr0) */
    if (has_all(NEED_AVX2 | NEED_AVX512)) {
        const cf_kernel_table *base = out[n - 1]; /* the best AVX2-family table */
        out[n++] = cf_kernels_avx512(base);
    }
#endif
    return n;
}

const cf_kernel_table *cf_kernels_by_name(const char *name) {
    const cf_kernel_table *t[8];
    int n = candidate_tables(t);
    for (int i = 0; i < n; i++)
        if (name && strcmp(t[i]->name, name) == 0) return t[i];
    return NULL;
}

static const char *g_names[9];
static pthread_once_t g_names_once = PTHREAD_ONCE_INIT;

static void names_init(void) {
    const cf_kernel_table *t[8];
    int n = candidate_tables(t);
    for (int i = 0; i < n; i++) g_names[i] = t[i]->name;
    g_names[n] = NULL;
}

const char *const *cf_available_isas(void) {
    pthread_once(&g_names_once, names_init);
    return g_names;
}

static const cf_kernel_table *g_table;
static pthread_once_t g_table_once = PTHREAD_ONCE_INIT;

static void table_init(void) {
    const cf_kernel_table *t[8];
    int n = candidate_tables(t);
    g_table = t[n - 1];
    const char *env = getenv("CFLOW_ISA");
    if (env && *env && strcmp(env, "auto") != 0) {
        const cf_kernel_table *chosen = cf_kernels_by_name(env);
        if (chosen) g_table = chosen;
    }
}

const cf_kernel_table *cf_kernels(void) {
    pthread_once(&g_table_once, table_init);
    return g_table;
}
