/* c2_tiles.c — claim C2: L1-d read misses of cflow's tile layout vs a plain row-major layout.
 *
 * The same Q4_0 weights W[rows, cols] in two layouts, multiplied by the same activation with the
 * same arithmetic; only the order in which bytes are visited differs:
 *
 *   tiled  docs/DESIGN.md "Tile layout" (cflow.quant.tile_matrix): row bands of TR rows, tiles of
 *          TK inputs left to right, groups of G = 8 rows, and per 32-column block a chunk of the
 *          g rows' fp16 scales followed by their 16 nibble bytes each.
 *   rows   GGML's row-major blocks: row r's blocks (fp16 d + 16 nibble bytes) back to back.
 *
 * Two arithmetics, each identical in both layouts (the same partial sums, added in the same
 * order, so the outputs agree bit for bit):
 *
 *   q8     cflow's kernels: the activation quantized per 32-block to int8 (d = max|x| / 127,
 *          round half away from zero), integer block dots, `acc += d_w * d_x * isum`;
 *   f32    float activations: `acc += d_w * sum((q - 8) * x)` per block (the classic
 *          dequantize-and-dot of a reference kernel), 4 bytes of activation per input.
 *
 * Each (row, 32-column block) term is summed per tile column range first, then added to the row,
 * in both layouts. The kernels are scalar C compiled without -march flags, so the instruction
 * mix is the same for both layouts too (cachegrind reports Ir to show it).
 *
 * Usage: c2_tiles FILE tiled|rows q8|f32 REPS OUT
 *   FILE: written by cflow.bench.claims.c2_tiles (header, tiled bytes, row-major bytes, x as f32);
 *   OUT:  the outputs y[rows] as f32, for the caller to check against cflow.quant.
 *        c2_tiles FILE time q8|f32 REPS OUT
 *   times one mat-vec in three copies of the weights, natively (not under valgrind): tiled,
 *   row-major, and a second row-major copy in its own allocation (the control: row-major on both
 *   sides). Each of REPS rounds runs the three once, in an order that rotates from round to round
 *   so no copy always goes first; OUT gets one line per round, "ns_tiled ns_rows ns_rows2". Exits
 *   1 if the three outputs are not bit-identical.
 * Under `valgrind --tool=cachegrind`, the kernel's own counts are the per-function lines of
 * mv_<arith>_<layout> in the output file; reading FILE and quantizing x happen elsewhere.
 * Built by the claims report with the system C compiler into a temp dir; not part of the package.
 */
#define _POSIX_C_SOURCE 200112L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>

#define QK 32
#define G 8
#define BLK 18 /* Q4_0: fp16 d + 16 bytes of nibbles */
#define MAGIC 0x31543243u /* "C2T1" little-endian */

typedef struct {
    int rows, cols, tr, tk;
    const uint8_t *w;  /* the layout being measured */
    const float *x;    /* f32 activation [cols] */
    const int8_t *xq;  /* int8 activation [cols] */
    const float *xd;   /* its scale per 32-block [cols / 32] */
} mat;

static inline float h2f(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* sum over the block of (q - 8) * xq, exact in int32 */
static inline int32_t dot_q8(const uint8_t *qs, const int8_t *x) {
    int32_t s = 0;
    for (int j = 0; j < 16; j++) {
        s += ((qs[j] & 0x0f) - 8) * x[j];
        s += ((qs[j] >> 4) - 8) * x[j + 16];
    }
    return s;
}

/* sum over the block of (q - 8) * x in float */
static inline float dot_f32(const uint8_t *qs, const float *x) {
    float s = 0.0f;
    for (int j = 0; j < 16; j++) {
        s += (float)((qs[j] & 0x0f) - 8) * x[j];
        s += (float)((qs[j] >> 4) - 8) * x[j + 16];
    }
    return s;
}

static inline int imin(int a, int b) { return a < b ? a : b; }

/* ---- tiled: band, tile, row group, 32-block; chunk = g scales then g x 16 nibble bytes ------ */
#define TILED_KERNEL(NAME, TERM)                                                                \
    __attribute__((noinline)) void NAME(const mat *m, float *y) {                               \
        memset(y, 0, sizeof(float) * (size_t)m->rows);                                          \
        const uint8_t *p = m->w;                                                                \
        for (int r0 = 0; r0 < m->rows; r0 += m->tr) {                                           \
            int br = imin(m->tr, m->rows - r0);                                                 \
            for (int k0 = 0; k0 < m->cols; k0 += m->tk) {                                       \
                int nkb = imin(m->tk, m->cols - k0) / QK;                                       \
                for (int g0 = 0; g0 < br; g0 += G) {                                            \
                    int g = imin(G, br - g0);                                                   \
                    float part[G] = {0};                                                        \
                    for (int b = 0; b < nkb; b++) {                                             \
                        int kb = k0 / QK + b;                                                   \
                        const uint8_t *qs = p + 2 * g;                                          \
                        for (int i = 0; i < g; i++) part[i] += TERM(p + 2 * i, qs + 16 * i, kb); \
                        p += (size_t)g * BLK;                                                   \
                    }                                                                           \
                    for (int i = 0; i < g; i++) y[r0 + g0 + i] += part[i];                      \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
    }

/* ---- rows: row by row, blocks left to right, the same per-tile partial sums ---------------- */
#define ROWS_KERNEL(NAME, TERM)                                                                 \
    __attribute__((noinline)) void NAME(const mat *m, float *y) {                               \
        int nb = m->cols / QK;                                                                  \
        size_t rb = (size_t)nb * BLK;                                                           \
        for (int r = 0; r < m->rows; r++) {                                                     \
            const uint8_t *row = m->w + (size_t)r * rb;                                         \
            float acc = 0.0f;                                                                   \
            for (int k0 = 0; k0 < m->cols; k0 += m->tk) {                                       \
                int nkb = imin(m->tk, m->cols - k0) / QK;                                       \
                float part = 0.0f;                                                              \
                for (int b = 0; b < nkb; b++) {                                                 \
                    int kb = k0 / QK + b;                                                       \
                    const uint8_t *blk = row + (size_t)kb * BLK;                                \
                    part += TERM(blk, blk + 2, kb);                                             \
                }                                                                               \
                acc += part;                                                                    \
            }                                                                                   \
            y[r] = acc;                                                                         \
        }                                                                                       \
    }

#define TERM_Q8(dp, qs, kb) (h2f(dp) * m->xd[kb] * (float)dot_q8((qs), m->xq + (size_t)(kb) * QK))
#define TERM_F32(dp, qs, kb) (h2f(dp) * dot_f32((qs), m->x + (size_t)(kb) * QK))

TILED_KERNEL(mv_q8_tiled, TERM_Q8)
TILED_KERNEL(mv_f32_tiled, TERM_F32)
ROWS_KERNEL(mv_q8_rows, TERM_Q8)
ROWS_KERNEL(mv_f32_rows, TERM_F32)

/* the activation as cflow quantizes it (docs/DESIGN.md): d = max|x| / 127, q = round(x / d) */
static void quantize_act(const float *x, int n, int8_t *q, float *d) {
    for (int b = 0; b < n / QK; b++) {
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[b * QK + j]));
        float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        d[b] = db;
        for (int j = 0; j < QK; j++) q[b * QK + j] = (int8_t)roundf(x[b * QK + j] * id);
    }
}

static void *xalloc(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? n : 64)) {
        fprintf(stderr, "c2_tiles: out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return p;
}

static void xread(FILE *f, void *dst, size_t n, const char *what) {
    if (fread(dst, 1, n, f) != n) {
        fprintf(stderr, "c2_tiles: short read of %s\n", what);
        exit(1);
    }
}

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

/* time mode: see the header comment */
static int time_layouts(mat m, const uint8_t *wt, const uint8_t *wr, size_t nbytes, int f32, int reps,
                        const char *out) {
    uint8_t *wr2 = xalloc(nbytes);
    memcpy(wr2, wr, nbytes);
    const uint8_t *ws[3] = {wt, wr, wr2};
    void (*kern[3])(const mat *, float *) = {f32 ? mv_f32_tiled : mv_q8_tiled, f32 ? mv_f32_rows : mv_q8_rows,
                                             f32 ? mv_f32_rows : mv_q8_rows};
    float *ys[3];
    mat ms[3];
    for (int i = 0; i < 3; i++) {
        ys[i] = xalloc(sizeof(float) * (size_t)m.rows);
        ms[i] = m;
        ms[i].w = ws[i];
        for (int w = 0; w < 2; w++) kern[i](&ms[i], ys[i]); /* warm-up */
    }
    for (int i = 1; i < 3; i++) {
        if (memcmp(ys[0], ys[i], sizeof(float) * (size_t)m.rows)) {
            fprintf(stderr, "c2_tiles: copy %d's output differs from the tiled one\n", i);
            return 1;
        }
    }
    FILE *o = fopen(out, "w");
    if (!o) {
        perror(out);
        return 1;
    }
    for (int r = 0; r < reps; r++) {
        double ns[3];
        for (int j = 0; j < 3; j++) {
            int i = (r + j) % 3;
            double t0 = now_ns();
            kern[i](&ms[i], ys[i]);
            ns[i] = now_ns() - t0;
        }
        fprintf(o, "%.0f %.0f %.0f\n", ns[0], ns[1], ns[2]);
    }
    if (fclose(o)) {
        perror(out);
        return 1;
    }
    for (int i = 0; i < 3; i++) free(ys[i]);
    free(wr2);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s FILE tiled|rows|time q8|f32 REPS OUT\n", argv[0]);
        return 2;
    }
    int timing = !strcmp(argv[2], "time");
    int tiled = !strcmp(argv[2], "tiled"), f32 = !strcmp(argv[3], "f32");
    if ((!tiled && !timing && strcmp(argv[2], "rows")) || (!f32 && strcmp(argv[3], "q8"))) {
        fprintf(stderr, "c2_tiles: layout must be tiled|rows|time and arithmetic q8|f32\n");
        return 2;
    }
    int reps = atoi(argv[4]);
    FILE *f = fopen(argv[1], "rb");
    if (!f) {
        perror(argv[1]);
        return 1;
    }
    uint32_t hdr[6];
    uint64_t nbytes;
    xread(f, hdr, sizeof hdr, "header");
    xread(f, &nbytes, sizeof nbytes, "header");
    if (hdr[0] != MAGIC || hdr[2] % QK || hdr[4] % QK) {
        fprintf(stderr, "c2_tiles: %s is not a c2 input file\n", argv[1]);
        return 1;
    }
    mat m = {(int)hdr[1], (int)hdr[2], (int)hdr[3], (int)hdr[4], NULL, NULL, NULL, NULL};
    if (nbytes != (uint64_t)m.rows * (m.cols / QK) * BLK) {
        fprintf(stderr, "c2_tiles: size mismatch in %s\n", argv[1]);
        return 1;
    }
    /* both copies are read (only the measured one is kept outside time mode) */
    uint8_t *wt = xalloc(nbytes), *wr = xalloc(nbytes);
    xread(f, wt, nbytes, "tiled weights");
    xread(f, wr, nbytes, "row-major weights");
    float *x = xalloc(sizeof(float) * (size_t)m.cols);
    xread(f, x, sizeof(float) * (size_t)m.cols, "activation");
    fclose(f);
    int8_t *xq = xalloc((size_t)m.cols);
    float *xd = xalloc(sizeof(float) * (size_t)(m.cols / QK));
    quantize_act(x, m.cols, xq, xd);
    m.x = x;
    m.xq = xq;
    m.xd = xd;
    int rc = 0;
    if (timing) {
        rc = time_layouts(m, wt, wr, nbytes, f32, reps, argv[5]);
    } else {
        if (tiled) {
            free(wr);
            wr = NULL;
        } else {
            free(wt);
            wt = NULL;
        }
        m.w = tiled ? wt : wr;
        float *y = xalloc(sizeof(float) * (size_t)m.rows);
        void (*kernel)(const mat *, float *) =
            tiled ? (f32 ? mv_f32_tiled : mv_q8_tiled) : (f32 ? mv_f32_rows : mv_q8_rows);
        for (int r = 0; r < reps; r++) kernel(&m, y);
        FILE *o = fopen(argv[5], "wb");
        if (!o || fwrite(y, sizeof(float), (size_t)m.rows, o) != (size_t)m.rows || fclose(o)) {
            perror(argv[5]);
            rc = 1;
        }
        free(y);
    }
    free(wt);
    free(wr);
    free(x);
    free(xq);
    free(xd);
    return rc;
}
