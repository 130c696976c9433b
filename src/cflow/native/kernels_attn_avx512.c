/* kernels_attn_avx512.c — the avx512 table's attention over an fp16 cache, on 512-bit registers:
 * the block kernel (prefill chunks, speculative verification rows) and the per-query kernel
 * (decode), which is the block kernel run on one query.
 *
 * The contract (cflow.h) holds within a table: the block kernel equals, bit for bit, the
 * per-query kernel on each query alone, and here both are one function. Per query and head:
 * each score is one 8-lane FMA chain over head_dim from zero (chunk c: dimensions 8c..8c+7),
 * summed across its lanes by the AVX2 kernels' tree ((x0+x4)+(x2+x6)) + ((x1+x5)+(x3+x7)), times
 * scale; the row's softmax (softmax16: simd_silu.h's exp_ps16, summed in 16 lanes); each
 * output value one FMA chain over the positions in ascending order from zero. The packing is
 * what makes it faster than kernels_attn_avx2.inc's: a converted K tile holds its positions in
 * pairs (chunk c of positions 2u and 2u+1 side by side in one zmm), so one FMA advances two
 * positions' chains, one per half, and sixteen positions' lane sums are taken together in zmm
 * shuffles; a V row is four zmm for head_dim 64, the output's lanes of up to four heads stay in
 * registers across a tile, and one query (decode) reads V rows straight from the cache. On a
 * 2-core Xeon (SmolLM2's 9 heads over 3 kv heads, head_dim 64, one thread, `_native` calls):
 * decode at 1000 positions 37 us against the AVX2 kernel's 53, a block of 8 queries at 300
 * positions 72-76 us against 103-110.
 *
 * Shapes these kernels do not take go to the base table's pair of kernels, per-query and block
 * alike, so the table's two kernels keep one definition for every shape: head_dim not a multiple
 * of 16 or too large for two positions per tile, and heads with attention sinks. The 8-bit KV
 * cache's kernels (attention_q8kv, attention_block_q8kv) stay the base table's.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "cflow.h"
#include "util.h"
#include "simd_silu.h"

#define INLINE static inline __attribute__((always_inline))
#define TILE_FLOATS 4096 /* one fp32 tile of K or V rows: 16 KB, as kernels_attn_avx2.inc's */

static const cf_kernel_table *g_base; /* the table whose kernels take the shapes these do not; set
                                       * once by cf_attn_avx512_install */

/* hsum_ps of kernels_avx2.inc: the lanes of v by ((x0+x4)+(x2+x6)) + ((x1+x5)+(x3+x7)). */
INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Lane p = the lane sum of position p's chain, for sixteen positions: z[j] holds position 2j in
 * lanes 0-7 and 2j+1 in lanes 8-15. hsum8's tree, four positions per step in 128-bit lanes. */
INLINE __m512 hsum16(const __m512 z[8]) {
    __m512 s[4]; /* s[m], 128-bit lane L: position 4m + L's [x0+x4, x1+x5, x2+x6, x3+x7] */
    for (int m = 0; m < 4; m++)
        s[m] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * m], z[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(z[2 * m], z[2 * m + 1], 0xdd));
    /* lane L: [s0+s2, s1+s3] of positions L and 4+L (p01), 8+L and 12+L (p23) */
    __m512 p01 = _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 p23 = _mm512_add_ps(_mm512_shuffle_ps(s[2], s[3], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_ps(s[2], s[3], _MM_SHUFFLE(3, 2, 3, 2)));
    /* lane 4L + m: (s0+s2) + (s1+s3) of position 4m + L; then into position order */
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(p01, p23, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(p01, p23, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, r);
}

/* ---- tiles ----------------------------------------------------------------------------------- */

/* Rows [t0, t1) of one kv head's K cache to fp32 in pairs: chunk c of rows t0+2u and t0+2u+1 at
 * tile + 2u*hd + 16c, lanes 0-7 and 8-15 (an odd last row's partner is zeros, never read). */
INLINE void k_pair_tile(float *tile, const cf_half *K, int hd, int t0, int t1) {
    for (int t = t0; t < t1; t += 2) {
        const cf_half *r0 = K + (size_t)t * hd, *r1 = r0 + hd;
        float *dst = tile + (size_t)(t - t0) * hd;
        for (int c = 0; c < hd; c += 16) { /* chunks c/8 and c/8 + 1 of both rows */
            __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r0 + c)));
            __m512 b = t + 1 < t1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r1 + c)))
                                  : _mm512_setzero_ps();
            _mm512_store_ps(dst + 2 * c, _mm512_shuffle_f32x4(a, b, 0x44));
            _mm512_store_ps(dst + 2 * c + 16, _mm512_shuffle_f32x4(a, b, 0xee));
        }
    }
}

/* Rows [t0, t1) of one kv head's V cache to fp32, row after row. */
INLINE void v_tile(float *tile, const cf_half *V, int hd, int t0, int t1) {
    const cf_half *src = V + (size_t)t0 * hd;
    size_t n = (size_t)(t1 - t0) * hd;
    for (size_t i = 0; i < n; i += 16)
        _mm512_store_ps(tile + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
}

/* ---- softmax ----------------------------------------------------------------------------- */

/* x[0..n) = softmax(x) in place, 16 lanes (a tail masked): a score row of these kernels. */
INLINE void softmax16(float *x, int n) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(x + i));
    __mmask16 tail = (__mmask16)((1u << (n - i)) - 1);
    if (tail) vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_maskz_loadu_ps(tail, x + i));
    __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(vmax)), vsum = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
        __m512 e = exp_ps16(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm));
        _mm512_storeu_ps(x + i, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    if (tail) {
        __m512 e = exp_ps16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + i), vm));
        _mm512_mask_storeu_ps(x + i, tail, e);
        vsum = _mm512_mask_add_ps(vsum, tail, vsum, e);
    }
    __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
    for (i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), inv));
    if (tail) _mm512_mask_storeu_ps(x + i, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, x + i), inv));
}

/* ---- the two passes ------------------------------------------------------------------------- */

/* x[0..8) in both halves (AVX512F's 64-bit broadcast: the DQ float one is not in this build). */
INLINE __m512 dup8(const float *x) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(x))));
}

/* One position's score alone (its half of a pair, kp = the pair's chunk 0 plus 8 * half). */
INLINE float score1(const float *q, const float *kp, int hd, float scale) {
    __m256 a = _mm256_setzero_ps();
    for (int c = 0; c < hd / 8; c++) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_load_ps(kp + 16 * c), a);
    return hsum8(a) * scale;
}

/* out[h][t] = scale * q[h] . k_t for positions [a, b) of a pair tile starting at t0, NH heads of
 * one kv head (out indexed by position): sixteen positions at a time, the rest alone. */
INLINE void pair_scores(int NH, const float *const q[2], const float *tile, int hd, int t0, int a, int b,
                        float scale, float *const out[2]) {
    const __m512 vs = _mm512_set1_ps(scale);
    int t = a;
    if ((t - t0) & 1 && t < b) {
        for (int h = 0; h < NH; h++) out[h][t] = score1(q[h], tile + (size_t)(t - 1 - t0) * hd + 8, hd, scale);
        t++;
    }
    for (; t + 16 <= b; t += 16) {
        const float *kp = tile + (size_t)(t - t0) * hd; /* eight pairs from here */
        __m512 z[2][8];
        for (int h = 0; h < NH; h++)
            for (int j = 0; j < 8; j++) z[h][j] = _mm512_setzero_ps();
        for (int c = 0; c < hd / 8; c++) {
            __m512 qd[2];
            for (int h = 0; h < NH; h++) qd[h] = dup8(q[h] + 8 * c);
            for (int j = 0; j < 8; j++) {
                __m512 kv = _mm512_load_ps(kp + (size_t)j * 2 * hd + 16 * c);
                for (int h = 0; h < NH; h++) z[h][j] = _mm512_fmadd_ps(qd[h], kv, z[h][j]);
            }
        }
        for (int h = 0; h < NH; h++) _mm512_storeu_ps(out[h] + t, _mm512_mul_ps(hsum16(z[h]), vs));
    }
    for (; t < b; t++) {
        int odd = (t - t0) & 1;
        for (int h = 0; h < NH; h++)
            out[h][t] = score1(q[h], tile + (size_t)(t - odd - t0) * hd + 8 * odd, hd, scale);
    }
}

/* pair_scores for heads [h, hb) of one query (qi: its row; score rows p0 + (hh - h) * pstride),
 * two heads at a time and a last one alone. */
INLINE void scores(const float *qi, const float *tile, float *p0, size_t pstride, int h, int hb, int hd, int t0,
                   int a, int b, float scale) {
    for (int hh = h; hh < hb; hh += 2) {
        int two = hh + 2 <= hb;
        const float *qs[2] = {qi + (size_t)hh * hd, two ? qi + (size_t)(hh + 1) * hd : NULL};
        float *rows[2] = {p0 + (size_t)(hh - h) * pstride, two ? p0 + (size_t)(hh + 1 - h) * pstride : NULL};
        if (two) pair_scores(2, qs, tile, hd, t0, a, b, scale, rows);
        else pair_scores(1, qs, tile, hd, t0, a, b, scale, rows);
    }
}

/* V row t's values [j, j + 16): from the fp32 tile (rows from t0), or converted from the fp16 cache
 * when there is no tile (vh: the kv head's cache; the same fp32 values either way). */
INLINE __m512 v16(const float *vt, const cf_half *vh, int hd, int t0, int t, int j) {
    if (vh) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(vh + (size_t)t * hd + j)));
    return _mm512_load_ps(vt + (size_t)(t - t0) * hd + j);
}

/* o[h][0..hd) += sum_t p[h][t] * v_t over positions [a, b), t ascending, NH <= 4 heads of one kv
 * head (p indexed by position); 64 output lanes per head stay in registers. V rows come from a
 * tile starting at t0 (vh NULL) or straight from the cache (vt NULL). */
INLINE void head_values(int NH, float *const o[4], const float *vt, const cf_half *vh, const float *const p[4],
                        int hd, int t0, int a, int b) {
    int j = 0;
    for (; j + 64 <= hd; j += 64) {
        __m512 acc[4][4];
        for (int h = 0; h < NH; h++)
            for (int c = 0; c < 4; c++) acc[h][c] = _mm512_loadu_ps(o[h] + j + 16 * c);
        for (int t = a; t < b; t++) {
            __m512 pb[4];
            for (int h = 0; h < NH; h++) pb[h] = _mm512_set1_ps(p[h][t]);
            for (int c = 0; c < 4; c++) {
                __m512 vv = v16(vt, vh, hd, t0, t, j + 16 * c);
                for (int h = 0; h < NH; h++) acc[h][c] = _mm512_fmadd_ps(pb[h], vv, acc[h][c]);
            }
        }
        for (int h = 0; h < NH; h++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(o[h] + j + 16 * c, acc[h][c]);
    }
    for (; j < hd; j += 16) {
        __m512 acc[4];
        for (int h = 0; h < NH; h++) acc[h] = _mm512_loadu_ps(o[h] + j);
        for (int t = a; t < b; t++) {
            __m512 vv = v16(vt, vh, hd, t0, t, j);
            for (int h = 0; h < NH; h++) acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[h][t]), vv, acc[h]);
        }
        for (int h = 0; h < NH; h++) _mm512_storeu_ps(o[h] + j, acc[h]);
    }
}

/* head_values for heads [h, hb) of query i (output oi, its score rows p0 + (hh - h) * pstride), at
 * most four per pass (NH a constant per call). */
INLINE void values(float *oi, const float *vt, const cf_half *vh, const float *p0, size_t pstride, int h, int hb,
                   int hd, int t0, int a, int b) {
    for (int hh = h; hh < hb; hh += 4) {
        int nh = cf_min(4, hb - hh);
        float *os[4];
        const float *ps[4];
        for (int u = 0; u < nh; u++) {
            os[u] = oi + (size_t)(hh + u) * hd;
            ps[u] = p0 + (size_t)(hh - h + u) * pstride;
        }
        switch (nh) {
        case 1: head_values(1, os, vt, vh, ps, hd, t0, a, b); break;
        case 2: head_values(2, os, vt, vh, ps, hd, t0, a, b); break;
        case 3: head_values(3, os, vt, vh, ps, hd, t0, a, b); break;
        default: head_values(4, os, vt, vh, ps, hd, t0, a, b); break;
        }
    }
}

/* ---- the kernels ---------------------------------------------------------------------------- */

/* Whether these kernels take a shape (else the base table's do, both of them). */
static int takes(int head_dim, const float *sinks) {
    return head_dim % 16 == 0 && head_dim <= TILE_FLOATS / 2 && !sinks;
}

/* cflow.h attention_block for the shapes `takes` accepts: per kv head of [h0, h1), scores tile by
 * tile, each row's softmax, then the values tile by tile (att rows as kernels_attn_avx2.inc's). */
static void block_tiles(float *out, const float *q, const cf_half *k, const cf_half *v, float *att,
                        const cf_attn_block_shape *s, int h0, int h1) {
    int hd = s->head_dim, group = s->n_heads / s->n_kv_heads, nq = s->n_q;
    _Alignas(64) float tile[TILE_FLOATS];
    int TT = cf_min(TILE_FLOATS / hd, 64) & ~1; /* even: a tile's pairs start at its first row */
    int t_begin = cf_attn_lo(s, 0), t_end = s->pos0 + nq;
    int n_last = t_end - cf_attn_lo(s, nq - 1); /* the longest row: the last query's */
    for (int h = h0; h < h1;) {
        int kvh = h / group, hb = cf_min(h1, (kvh + 1) * group); /* heads [h, hb) share kv head kvh */
        const cf_half *K = k + (size_t)kvh * s->max_seq * hd, *V = v + (size_t)kvh * s->max_seq * hd;
        /* score row of (head hh, query i), indexed by position: row(hh, i)[t] for t in [lo_i, p_i] */
#define ROW(hh, i) (att + ((size_t)((hh) - h0) * nq + (i)) * n_last - cf_attn_lo(s, (i)))
        for (int t0 = t_begin; t0 < t_end; t0 += TT) {
            int t1 = cf_min(t_end, t0 + TT);
            k_pair_tile(tile, K, hd, t0, t1);
            for (int i = 0; i < nq; i++) {
                int a = cf_max(t0, cf_attn_lo(s, i)), b = cf_min(t1, s->pos0 + i + 1);
                if (a < b)
                    scores(q + (size_t)i * s->ldq, tile, ROW(h, i), (size_t)nq * n_last, h, hb, hd, t0, a, b,
                           s->scale);
            }
        }
        for (int i = 0; i < nq; i++) {
            int lo = cf_attn_lo(s, i);
            for (int hh = h; hh < hb; hh++) {
                softmax16(ROW(hh, i) + lo, s->pos0 + i + 1 - lo);
                memset(out + (size_t)i * s->ldo + (size_t)hh * hd, 0, sizeof(float) * (size_t)hd);
            }
        }
        if (nq == 1) { /* one query (decode): each V row is used once per head, so no tile */
            values(out, NULL, V, ROW(h, 0), (size_t)n_last, h, hb, hd, 0, t_begin, t_end);
        } else {
            for (int t0 = t_begin; t0 < t_end; t0 += TT) {
                int t1 = cf_min(t_end, t0 + TT);
                v_tile(tile, V, hd, t0, t1);
                for (int i = 0; i < nq; i++) {
                    int a = cf_max(t0, cf_attn_lo(s, i)), b = cf_min(t1, s->pos0 + i + 1);
                    if (a < b)
                        values(out + (size_t)i * s->ldo, tile, NULL, ROW(h, i), (size_t)nq * n_last, h, hb, hd, t0,
                               a, b);
                }
            }
        }
#undef ROW
        h = hb;
    }
}

static void attention_block_avx512(float *out, const float *q, const cf_half *k, const cf_half *v, float *att,
                                   const cf_attn_block_shape *s, int h0, int h1) {
    if (!takes(s->head_dim, s->sinks)) {
        g_base->attention_block(out, q, k, v, att, s, h0, h1);
        return;
    }
    block_tiles(out, q, k, v, att, s, h0, h1);
}

/* The per-query kernel: one query at position n_pos - 1 over the cache it is given (the block
 * kernel's definition, so the two agree by construction). */
static void attention_avx512(float *out, const float *q, const cf_half *k, const cf_half *v, float *att,
                             const cf_attn_shape *s, int h0, int h1) {
    if (!takes(s->head_dim, s->sinks)) {
        g_base->attention(out, q, k, v, att, s, h0, h1);
        return;
    }
    int q_dim = s->n_heads * s->head_dim;
    cf_attn_block_shape b = {.n_heads = s->n_heads, .n_kv_heads = s->n_kv_heads, .head_dim = s->head_dim,
                             .max_seq = s->max_seq, .scale = s->scale, .pos0 = s->n_pos - 1, .n_q = 1,
                             .window = 0, .ldq = q_dim, .ldo = q_dim, .sinks = NULL};
    block_tiles(out, q, k, v, att, &b, h0, h1);
}

/* kernels_avx512.c's table_init: the fp16-cache attention entries of table t, over base's. */
void cf_attn_avx512_install(cf_kernel_table *t, const cf_kernel_table *base) {
    g_base = base;
    t->attention = attention_avx512;
    t->attention_block = attention_block_avx512;
}
