/* small_batch_kernel.c — the avx512 table's matmat with its small-batch paths (kernels_avx512.c:
 * B <= SQ_MAX_B one group at a time two blocks per zmm, B <= SG_MAX_B one group at a time in
 * ymm, B <= SB_MAX_B pairs of groups) against the same file built with OLD_FLAGS (default
 * -DSB_MAX_B=0 -DSQ_MAX_B=0 -DSG_MAX_B=0: the L1-buffer path for every B; -DSG_MAX_B=0 alone: the
 * pair path where the ymm one-group path would run),
 * in one process, alternating, best of many repeats; no Python, no engine. Weights of a
 * SmolLM2-like 1536 x 576 matrix (tile 128 x 256), either one copy (in L2) or enough copies to
 * stream from memory, with the default prefetch mode. Prints time per call and the new/old ratio,
 * and flags a batch size whose sums differ between the two builds (they must be equal bit for bit).
 * Indicative only on a shared machine. Build and run from the repository root (x86-64, GCC):
 *
 *   N=src/cflow/native
 *   F="-O3 -fno-math-errno -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx2 -mfma -mf16c -I$N"
 *   gcc $F -c $N/kernels_avx512.c -o /tmp/sbk_new.o
 *   gcc $F ${OLD_FLAGS:--DSB_MAX_B=0 -DSQ_MAX_B=0 -DSG_MAX_B=0} -Dcf_kernels_avx512=cf_kernels_avx512_buffer -c $N/kernels_avx512.c -o /tmp/sbk_old.o
 *   gcc $F benchmarks/small_batch_kernel.c $N/formats.c $N/kernels_ref.c $N/kernels_kquant_ref.c \
 *       $N/kernels_kquant_avx512.c $N/deltanet.c /tmp/sbk_new.o /tmp/sbk_old.o -lm -lpthread -o /tmp/sbk && /tmp/sbk
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cflow.h"

_Atomic int cf_prefetch_mode = CF_PREFETCH_DEFAULT; /* dispatch.c's, which this does not link */
int cf_matvec_default_ahead(int dtype) { /* dispatch.c's: the Zen 4 answer (none), the CPU measured here */
    (void)dtype;
    return 0;
}
int cf_avx512_q6k_streams(void) { return 1; } /* dispatch.c's; this measures no Q6_K */
int cf_avx512_small_batch_groups(void) { return 1; } /* dispatch.c's: the paths as built (SG_MAX_B) */

const cf_kernel_table *cf_kernels_avx512(const cf_kernel_table *base);
const cf_kernel_table *cf_kernels_avx512_buffer(const cf_kernel_table *base);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint32_t rnd(uint32_t *s) { return *s = *s * 1664525u + 1013904223u; }

/* One matrix's tiled bytes: random quants, fp16 scales (and Q4_1 mins) of about 0.01. */
static void fill(uint8_t *p, size_t bytes, uint32_t seed) {
    for (size_t i = 0; i < bytes; i++) p[i] = (uint8_t)(rnd(&seed) >> 24);
    for (size_t i = 1; i < bytes; i += 2) p[i] = (p[i] & 0x83) | 0x20; /* every half a small normal */
}

static double run(const cf_kernel_table *k, cf_tiled *ws, int nw, const cf_act_q8 *xs, int B, float *y) {
    double t0 = now();
    for (int i = 0; i < nw; i++)
        k->matmat[ws[i].dtype](&ws[i], xs, B, y, ws[i].rows, 0, (ws[i].rows + 7) / 8);
    return (now() - t0) / nw;
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 200;
    const int rows = 1536, cols = 576, Bs[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32};
    const int dtypes[] = {CF_Q4_0, CF_Q4_1, CF_Q8_0};
    const char *names[] = {"q4_0", "q4_1", "q8_0"};
    cf_kernel_table base;
    memset(&base, 0, sizeof base); /* the small shapes here never fall back to the base table */
    base.name = "none";
    const cf_kernel_table *knew = cf_kernels_avx512(&base), *kold = cf_kernels_avx512_buffer(&base);
    cf_act_q8 xs[64];
    uint32_t seed = 1;
    for (int b = 0; b < 64; b++) {
        xs[b].n = cols;
        xs[b].qs = aligned_alloc(64, cols);
        xs[b].d = malloc(sizeof(float) * cols / CF_QK);
        xs[b].s = malloc(sizeof(float) * cols / CF_QK);
        int ss = 0;
        for (int i = 0; i < cols; i++) ss += xs[b].qs[i] = (int8_t)(rnd(&seed) >> 24);
        for (int i = 0; i < cols / CF_QK; i++) {
            xs[b].d[i] = 0.01f;
            xs[b].s[i] = 0.01f * ss / (cols / CF_QK);
        }
    }
    float *y = aligned_alloc(64, sizeof(float) * 64 * rows);
    float *y2 = aligned_alloc(64, sizeof(float) * 64 * rows); /* the other build's sums: equal to y's */
    printf("matmat %d x %d, tile 128 x 256, best of %d: us per call, old = OLD_FLAGS\n", rows,
           cols, reps);
    for (int di = 0; di < 3; di++) {
        cf_tiled w = {NULL, dtypes[di], rows, cols, 128, 256};
        size_t bytes = cf_tiled_bytes(&w);
        int ncopy_mem = (int)(48e6 / bytes) + 1; /* more than the L3 */
        for (int mem = 0; mem < 2; mem++) {
            int nw = mem ? ncopy_mem : 1;
            cf_tiled *ws = malloc(sizeof(cf_tiled) * nw);
            for (int i = 0; i < nw; i++) {
                uint8_t *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
                fill(p, bytes, 7 + i);
                ws[i] = w;
                ws[i].data = p;
            }
            printf("%s, %s:\n", names[di], mem ? "streamed from memory" : "in L2");
            for (size_t bi = 0; bi < sizeof Bs / sizeof Bs[0]; bi++) {
                int B = Bs[bi];
                double best_new = 1e9, best_old = 1e9;
                for (int r = 0; r < (mem ? reps / 10 + 3 : reps); r++) {
                    double a = run(kold, ws, nw, xs, B, y), b = run(knew, ws, nw, xs, B, y);
                    if (a < best_old) best_old = a;
                    if (b < best_new) best_new = b;
                }
                kold->matmat[ws[0].dtype](&ws[0], xs, B, y, rows, 0, (rows + 7) / 8);
                knew->matmat[ws[0].dtype](&ws[0], xs, B, y2, rows, 0, (rows + 7) / 8);
                int same = memcmp(y, y2, sizeof(float) * (size_t)B * rows) == 0;
                double mac = (double)rows * cols * B;
                printf("  B=%2d  old %8.2f us (%4.0f GMAC/s)  new %8.2f us (%4.0f GMAC/s)  new/old %.3f%s\n",
                       B, best_old * 1e6, mac / best_old / 1e9, best_new * 1e6, mac / best_new / 1e9,
                       best_new / best_old, same ? "" : "  SUMS DIFFER");
            }
            for (int i = 0; i < nw; i++) free((void *)ws[i].data);
            free(ws);
        }
    }
    return 0;
}
