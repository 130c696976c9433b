/* kernels_internal.h — what the kernel files share and callers do not need: the walk over a
 * tiled matrix (which bytes hold which row groups of which tile) and chunk geometry. It needs
 * only cflow.h, util.h and formats.c (cf_block_bytes), never a kernel file; the reference
 * pieces the ISA files fall back to are declared in kernels_ref.h.
 *
 * The walk is the C statement of DESIGN.md "Tile layout" (docs/kquants.md for the K-quants):
 *   for band (TR rows): for tile (TK cols): for group (8 rows; last may be short): for block
 *   (32 weights, or a 256-weight super-block for the K-quants):
 *     chunk = the block's fields one after another, g rows of each (cf_tile_fields): g scales d
 *     (Q4_1: then g mins m), then g rows of GGML quant bytes; the K-quants' scales first too
 * Only the matrix's last group can have g < 8 rows (TR is a multiple of 8), so every group
 * before a given one in its band is a full 8 rows: that is what makes a group range of a tile
 * one contiguous byte run, found with one multiplication.
 */
#ifndef CFLOW_KERNELS_INTERNAL_H
#define CFLOW_KERNELS_INTERNAL_H

#include <stdatomic.h>
#include <string.h>

#include "cflow.h"
#include "kernels_ref.h"
#include "util.h"

/* ---- software prefetch (claim C6; the modes: cflow.h, cf_set_prefetch) --------------------
 * A kernel asks once per call for its distance, then, before it reads a contiguous run of weight
 * bytes [p, p + n), calls cf_prefetch_ahead(dist, p, n, end): nothing when dist is 0, else one
 * PREFETCHT0 per cache line of [p + dist, p + dist + n). Runs that follow each other in memory
 * then prefetch each line once (a line belongs to the run its first byte falls in). `end` is the
 * tensor's end: nothing at or past it is asked for (PREFETCHT0 of an unmapped address does not
 * fault on x86, but it can cost a page walk, and the range should mean something). */
extern _Atomic int cf_prefetch_mode;

/* The distance to use now: N in mode N > 0, `builtin` (the kernel's own default, 0 for most) in
 * the default mode, 0 when off. */
static inline int cf_prefetch_distance(int builtin) {
    int m = atomic_load_explicit(&cf_prefetch_mode, memory_order_relaxed);
    return m > 0 ? m : m == CF_PREFETCH_DEFAULT ? builtin : 0;
}

#define CF_LINE 64 /* cache line bytes (every x86-64 CPU this build targets) */

static inline void cf_prefetch_ahead(int dist, const uint8_t *p, size_t n, const uint8_t *end) {
    if (dist <= 0) return;
    uintptr_t a = (uintptr_t)p + (uintptr_t)dist, b = a + n, e = (uintptr_t)end;
    if (b > e) b = e;
    for (uintptr_t q = (a + CF_LINE - 1) & ~(uintptr_t)(CF_LINE - 1); q < b; q += CF_LINE)
        __builtin_prefetch((const void *)q, 0, 3); /* read, locality 3: PREFETCHT0 on x86 */
}

/* One past the last byte of a tiled matrix: cf_prefetch_ahead's `end`. */
static inline const uint8_t *cf_tiled_end(const cf_tiled *w) { return w->data + cf_tiled_bytes(w); }

/* Bytes of one row's quant payload in a block (after the scales): 16 nibble bytes or 32 int8. */
static inline size_t cf_qs_bytes(int dtype) { return dtype == CF_Q8_0 ? 32 : 16; }
/* Offset of the quant payload inside a chunk of g rows (the scales come first). */
static inline size_t cf_chunk_qs_offset(int dtype, int g) {
    return (size_t)g * (dtype == CF_Q4_1 ? 4 : 2);
}

/* The fields of one block in a tile chunk of g rows, in chunk order (cflow.kquant.TILE_FIELDS):
 * field f of row i is the `size` bytes at chunk + g * tile + i * size, and at offset `ggml` of
 * the row's GGML block. For the 32-block formats Q5_0 / Q5_1 / MXFP4 and the K-quants. */
typedef struct {
    int n;
    struct {
        uint8_t ggml, tile, size;
    } f[5];
} cf_kfields;

static inline const cf_kfields *cf_tile_fields(int dtype) {
    static const cf_kfields q5_0 = {3, {{0, 0, 2}, {2, 2, 4}, {6, 6, 16}}};             /* d qh qs */
    static const cf_kfields q5_1 = {4, {{0, 0, 2}, {2, 2, 2}, {4, 4, 4}, {8, 8, 16}}};  /* d m qh qs */
    static const cf_kfields q4_k = {4, {{0, 0, 2}, {2, 2, 2}, {4, 4, 12}, {16, 16, 128}}}; /* d dmin scales qs */
    static const cf_kfields q5_k = {5, {{0, 0, 2}, {2, 2, 2}, {4, 4, 12}, {16, 16, 32}, {48, 48, 128}}}; /* + qh */
    static const cf_kfields q6_k = {4, {{208, 0, 2}, {192, 2, 16}, {0, 18, 128}, {128, 146, 64}}}; /* d scales ql qh */
    static const cf_kfields mxfp4 = {2, {{0, 0, 1}, {1, 1, 16}}}; /* e qs */
    switch (dtype) {
    case CF_Q5_0: return &q5_0;
    case CF_Q5_1: return &q5_1;
    case CF_Q4_K: return &q4_k;
    case CF_Q5_K: return &q5_k;
    case CF_Q6_K: return &q6_k;
    case CF_MXFP4: return &mxfp4;
    default: return NULL;
    }
}

/* One step of the walk: the share of one tile that belongs to groups [ga, gb). */
typedef struct {
    const uint8_t *ptr; /* first chunk of group ga in this tile; chunks follow contiguously */
    int ga, gb;         /* global group indices */
    int kb0, nkt;       /* the tile's first block column and its number of blocks (blocks of
                         * cf_block_weights(dtype) weights: 32, or 256 for the K-quants) */
    /* walk state */
    const cf_tiled *w;
    int g0, g1, band, band_end, tile, n_tiles;
    /* the driver's frame (cf_walk_begin; a bare cf_span_begin walk leaves it unset) */
    const cf_act_q8 *xs;
    float *out;
    size_t ldo;
    int B, g_end; /* g_end: the end of the whole range, short last group included */
} cf_span;

static inline void cf_span_begin(cf_span *s, const cf_tiled *w, int g0, int g1) {
    int gpb = w->tile_rows / CF_G; /* groups per band */
    s->w = w;
    s->g0 = g0;
    s->g1 = g1;
    s->n_tiles = (w->cols + w->tile_cols - 1) / w->tile_cols;
    s->tile = -1;
    s->band = g0 < g1 ? g0 / gpb : 0;
    s->band_end = g0 < g1 ? (g1 - 1) / gpb + 1 : 0;
}

/* Advance to the next (band, tile); 0 when the range is exhausted. */
static inline int cf_span_next(cf_span *s) {
    const cf_tiled *w = s->w;
    if (++s->tile == s->n_tiles) {
        s->tile = 0;
        s->band++;
    }
    if (s->band >= s->band_end) return 0;
    size_t bb = cf_block_bytes(w->dtype);
    int qb = cf_block_weights(w->dtype);
    int gpb = w->tile_rows / CF_G, nkb = w->cols / qb;
    int band_row0 = s->band * w->tile_rows;
    int band_rows = cf_min(w->tile_rows, w->rows - band_row0);
    int k0 = s->tile * w->tile_cols;
    s->kb0 = k0 / qb;
    s->nkt = cf_min(w->tile_cols, w->cols - k0) / qb;
    s->ga = cf_max(s->g0, s->band * gpb);
    s->gb = cf_min(s->g1, (s->band + 1) * gpb);
    s->ptr = w->data + (size_t)band_row0 * nkb * bb /* bands above */
             + (size_t)band_rows * s->kb0 * bb        /* tiles to the left */
             + (size_t)(s->ga - s->band * gpb) * CF_G * s->nkt * bb; /* groups above */
    return 1;
}

/* ---- the walk driver -----------------------------------------------------------------------
 * Every fast kernel over the groups [g0, g1) of a tiled matrix has the same frame, written once
 * here: zero the outputs of the full groups, visit their tile shares in file order, then send the
 * short last group (a matrix whose rows are not a multiple of 8; no fast path handles it) through
 * the reference. A kernel writes only what it does with one share:
 *
 *     CF_FOR_EACH_SHARE(sp, w, g0, g1, xs, B, out, ldo) {
 *         ... groups [sp.ga, sp.gb) of one tile, from sp.ptr: output row r of activation b is
 *             out[b * ldo + r - g0 * 8], already zeroed, to be accumulated into ...
 *     }
 *
 * A mat-vec passes its one activation with B = 1 (ldo is then unused). The body must not `break`
 * out of the walk: the short last group is computed when the shares run out. */
#define CF_FOR_EACH_SHARE(sp, w, g0, g1, xs, B, out, ldo) \
    for (cf_span sp = cf_walk_begin((w), (g0), (g1), (xs), (B), (out), (ldo)); cf_walk_next(&sp);)

static inline cf_span cf_walk_begin(const cf_tiled *w, int g0, int g1, const cf_act_q8 *xs, int B,
                                    float *out, size_t ldo) {
    int full_end = cf_max(g0, cf_min(g1, w->rows / CF_G)); /* [g0, full_end): full groups */
    cf_span s;
    cf_span_begin(&s, w, g0, full_end);
    s.xs = xs;
    s.out = out;
    s.ldo = ldo;
    s.B = B;
    s.g_end = g1;
    if (full_end > g0)
        for (int b = 0; b < B; b++)
            memset(out + (size_t)b * ldo, 0, sizeof(float) * (size_t)(full_end - g0) * CF_G);
    return s;
}

/* The next share (1), or, when the full groups are done, the short last group through the
 * reference (0: the walk is over). */
static inline int cf_walk_next(cf_span *s) {
    if (cf_span_next(s)) return 1;
    if (s->g_end > s->g1) /* s->g1: the end of the full groups, >= g0 */
        for (int b = 0; b < s->B; b++)
            cf_matvec_groups_ref(s->w, &s->xs[b], s->out + (size_t)b * s->ldo + (size_t)(s->g1 - s->g0) * CF_G,
                                 s->g1, s->g_end);
    return 0;
}

#endif /* CFLOW_KERNELS_INTERNAL_H */
