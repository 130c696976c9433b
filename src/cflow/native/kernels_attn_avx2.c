/* kernels_attn_avx2.c — prefill attention over a block of queries (the table's attention_block),
 * and both attention kernels over the 8-bit KV cache (attention_q8kv, attention_block_q8kv; see
 * below), AVX2 + FMA + F16C. #included by kernels_avx2.c after its per-query attention, whose
 * helpers (hsum_ps, load_halves8, softmax_avx2, attn_scores, attn_values, round_half_away) it
 * shares; not compiled on its own.
 *
 * Two passes, like the per-query kernel: scores for every (query, head) row of the block, the
 * softmax of each row, then the weighted sum of V. Both passes walk the cache in tiles of TT
 * positions: a tile of K (then V) rows is converted from fp16 once into an fp32 buffer that stays
 * in L1, and every row of the block that sees the tile's positions reads it there. Per query this
 * computes exactly what attention_avx2 does (each score: one 8-lane FMA chain over head_dim from
 * zero, hsum_ps, times scale; each output lane: FMAs over the positions in ascending order), so
 * the results are the same bits (cflow.h). That rules out an online softmax, whose running-max
 * rescaling would change the rounding, and is why prefill and step-by-step decode agree exactly.
 * The scratch the two passes need (a score row per query and head) is the caller's.
 *
 * The 8-bit KV cache (cflow.h): attention_q8kv_avx2 (decode) and attention_block_q8kv_avx2
 * (prefill) are the same kernels over q8_0 rows, K and V each fp16 or q8_0. A q8_0 value enters
 * as the fp32 d * qs, exact (cflow.h), so only the conversion of a row changes: the prefill
 * kernel dequantizes a tile of rows into the same fp32 tile and runs unchanged, and the decode
 * kernel's chains see the same values in the same order, which keeps prefill and decode bit for
 * bit equal over a q8_0 cache too.
 * Why the K . q dot is fp32 q x dequantized int8 k, not q quantized to int8 and an integer dot
 * (vpmaddubsw + vpmaddwd, or VNNI's vpdpbusd, with one float multiply per 32-block, as llama.cpp
 * does): (1) quantizing q adds its own error on top of the cache's, in every score; (2) the
 * prefill kernel converts each tile once and reuses it for ATTN_QBLOCK queries x group heads, so
 * there the conversion is nearly free and float FMAs on the tile are what it does anyway; an
 * integer decode dot would give other bits than prefill, breaking the prefill == decode contract;
 * (3) what it would save is modest: per 32 values and query head, about 5-6 vector ops (sign,
 * vpmaddubsw, vpmaddwd, convert, FMA) against 4 FMAs plus a third of 12 conversion ops (vpmovsxbd
 * from memory, vcvtdq2ps, vmulps per 8 values, shared by a GQA group of 3) here. Measured on one
 * thread (docs/results/kv_cache_speed.md), this kernel is bound by that arithmetic: its scale multiply
 * makes it ~15% slower than the fp16 kernel per call although it reads 53% of the bytes; the
 * integer dot would win back part of that, at the price of accuracy and of the contract.
 */

#define ATTN_TILE_FLOATS 4096 /* one fp32 tile of K or V rows: 16 KB */

/* Lane i = hsum_ps(v_i), by the same tree of additions ((v0+v4) + (v2+v6)) + ((v1+v5) + (v3+v7))
 * over each v_i's lanes, so the bits are hsum_ps's; eight sums cost what about two hsum_ps do. */
INLINE __m256 hsum8_ps(__m256 v0, __m256 v1, __m256 v2, __m256 v3, __m256 v4, __m256 v5, __m256 v6,
                       __m256 v7) {
#define LOHI(a, b) _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31))
    __m256 s04 = LOHI(v0, v4), s15 = LOHI(v1, v5), s26 = LOHI(v2, v6), s37 = LOHI(v3, v7);
#undef LOHI
    /* per 128-bit lane, for two vectors: [s0+s2, s1+s3, s0+s2, s1+s3] */
    __m256 p0145 = _mm256_add_ps(_mm256_shuffle_ps(s04, s15, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(s04, s15, _MM_SHUFFLE(3, 2, 3, 2)));
    __m256 p2367 = _mm256_add_ps(_mm256_shuffle_ps(s26, s37, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(s26, s37, _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_shuffle_ps(p0145, p2367, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(p0145, p2367, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* out[t] = scale * q . kt[t] for n rows of a converted tile; eight rows at a time, so that eight
 * independent FMA chains hide the latency (each chain is still one row's, in head_dim order). */
INLINE void block_scores(const float *q, const float *kt, int hd, int n, float scale, float *out) {
    const __m256 vs = _mm256_set1_ps(scale);
    int t = 0;
    for (; t + 8 <= n; t += 8) {
        const float *k0 = kt + (size_t)t * hd;
        __m256 a[8];
        for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
        for (int j = 0; j < hd; j += 8) {
            __m256 qv = _mm256_loadu_ps(q + j);
            for (int r = 0; r < 8; r++) a[r] = _mm256_fmadd_ps(qv, _mm256_load_ps(k0 + (size_t)r * hd + j), a[r]);
        }
        _mm256_storeu_ps(out + t, _mm256_mul_ps(hsum8_ps(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]), vs));
    }
    for (; t < n; t++) {
        __m256 a = _mm256_setzero_ps();
        for (int j = 0; j < hd; j += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_load_ps(kt + (size_t)t * hd + j), a);
        out[t] = hsum_ps(a) * scale;
    }
}

/* block_scores for two heads of one query (the same kv head, so the same positions): each K row
 * loaded serves both, which halves the loads per FMA. */
INLINE void block_scores2(const float *q0, const float *q1, const float *kt, int hd, int n, float scale,
                          float *out0, float *out1) {
    const __m256 vs = _mm256_set1_ps(scale);
    int t = 0;
    for (; t + 4 <= n; t += 4) {
        const float *k0 = kt + (size_t)t * hd;
        __m256 a[4], b[4];
        for (int r = 0; r < 4; r++) a[r] = b[r] = _mm256_setzero_ps();
        for (int j = 0; j < hd; j += 8) {
            __m256 qa = _mm256_loadu_ps(q0 + j), qb = _mm256_loadu_ps(q1 + j);
            for (int r = 0; r < 4; r++) {
                __m256 kv = _mm256_load_ps(k0 + (size_t)r * hd + j);
                a[r] = _mm256_fmadd_ps(qa, kv, a[r]);
                b[r] = _mm256_fmadd_ps(qb, kv, b[r]);
            }
        }
        __m256 sums = _mm256_mul_ps(hsum8_ps(a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]), vs);
        _mm_storeu_ps(out0 + t, _mm256_castps256_ps128(sums));
        _mm_storeu_ps(out1 + t, _mm256_extractf128_ps(sums, 1));
    }
    block_scores(q0, kt + (size_t)t * hd, hd, n - t, scale, out0 + t);
    block_scores(q1, kt + (size_t)t * hd, hd, n - t, scale, out1 + t);
}

/* o[0..w) += sum_t p[t] * vt[t*ld ..] over n rows of a converted tile (rows ld floats apart),
 * t ascending; 32 output lanes stay in registers across the tile. */
INLINE void block_values(float *o, const float *vt, const float *p, int w, int n, int ld) {
    int j = 0;
    for (; j + 32 <= w; j += 32) {
        __m256 o0 = _mm256_loadu_ps(o + j), o1 = _mm256_loadu_ps(o + j + 8),
               o2 = _mm256_loadu_ps(o + j + 16), o3 = _mm256_loadu_ps(o + j + 24);
        for (int t = 0; t < n; t++) {
            const float *v = vt + (size_t)t * ld + j;
            __m256 pb = _mm256_broadcast_ss(p + t);
            o0 = _mm256_fmadd_ps(pb, _mm256_load_ps(v), o0);
            o1 = _mm256_fmadd_ps(pb, _mm256_load_ps(v + 8), o1);
            o2 = _mm256_fmadd_ps(pb, _mm256_load_ps(v + 16), o2);
            o3 = _mm256_fmadd_ps(pb, _mm256_load_ps(v + 24), o3);
        }
        _mm256_storeu_ps(o + j, o0);
        _mm256_storeu_ps(o + j + 8, o1);
        _mm256_storeu_ps(o + j + 16, o2);
        _mm256_storeu_ps(o + j + 24, o3);
    }
    for (; j < w; j += 8) {
        __m256 o0 = _mm256_loadu_ps(o + j);
        for (int t = 0; t < n; t++)
            o0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + t), _mm256_load_ps(vt + (size_t)t * ld + j), o0);
        _mm256_storeu_ps(o + j, o0);
    }
}

/* block_values for two heads of one query: each V row loaded serves both. */
INLINE void block_values2(float *o0, float *o1, const float *vt, const float *p0, const float *p1, int hd,
                          int n) {
    int j = 0;
    for (; j + 32 <= hd; j += 32) {
        __m256 a[4], b[4];
        for (int c = 0; c < 4; c++) {
            a[c] = _mm256_loadu_ps(o0 + j + 8 * c);
            b[c] = _mm256_loadu_ps(o1 + j + 8 * c);
        }
        for (int t = 0; t < n; t++) {
            const float *v = vt + (size_t)t * hd + j;
            __m256 pa = _mm256_broadcast_ss(p0 + t), pb = _mm256_broadcast_ss(p1 + t);
            for (int c = 0; c < 4; c++) {
                __m256 vv = _mm256_load_ps(v + 8 * c);
                a[c] = _mm256_fmadd_ps(pa, vv, a[c]);
                b[c] = _mm256_fmadd_ps(pb, vv, b[c]);
            }
        }
        for (int c = 0; c < 4; c++) {
            _mm256_storeu_ps(o0 + j + 8 * c, a[c]);
            _mm256_storeu_ps(o1 + j + 8 * c, b[c]);
        }
    }
    if (j < hd) {
        block_values(o0 + j, vt + j, p0, hd - j, n, hd);
        block_values(o1 + j, vt + j, p1, hd - j, n, hd);
    }
}

/* Rows [t0, t1) of one kv head's cache to fp32 (the same conversion as load_halves8). */
INLINE void block_tile(float *tile, const cf_half *X, int hd, int t0, int t1) {
    const cf_half *src = X + (size_t)t0 * hd;
    size_t n = (size_t)(t1 - t0) * hd;
    for (size_t i = 0; i < n; i += 8) _mm256_store_ps(tile + i, load_halves8(src + i));
}

/* ---- q8_0 rows (cflow.h, "The 8-bit KV cache") ---- */

/* A q8_0 block's scale, broadcast (fp16 -> fp32 is exact). */
INLINE __m256 q8_scale(const uint8_t *blk) {
    cf_half h;
    memcpy(&h, blk, sizeof h);
    return _mm256_cvtph_ps(_mm_set1_epi16((short)h));
}

/* Eight int8 values times their block's scale: d * qs, exact in fp32. */
INLINE __m256 load_q8x8(const uint8_t *qs, __m256 d) {
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)qs))));
}

/* block_tile for q8_0 rows: rows [t0, t1) are (t1 - t0) * hd / 32 consecutive blocks. */
INLINE void block_tile_q8(float *tile, const uint8_t *X, int hd, int t0, int t1) {
    const uint8_t *blk = X + (size_t)t0 * cf_kv_row_bytes(CF_Q8_0, hd);
    size_t nb = (size_t)(t1 - t0) * hd / CF_QK;
    for (size_t b = 0; b < nb; b++, blk += 2 + CF_QK, tile += CF_QK) {
        __m256 d = q8_scale(blk);
        for (int i = 0; i < CF_QK; i += 8) _mm256_store_ps(tile + i, load_q8x8(blk + 2 + i, d));
    }
}

INLINE void kv_tile(float *tile, const uint8_t *X, int type, int hd, int t0, int t1) {
    if (type == CF_Q8_0)
        block_tile_q8(tile, X, hd, t0, t1);
    else
        block_tile(tile, (const cf_half *)X, hd, t0, t1);
}

/* The prefill kernel over caches of any row types (kv_tile converts a tile of either). */
INLINE void attn_block_tiles(float *out, const float *q, const uint8_t *k, const uint8_t *v, int k_type,
                             int v_type, float *att, const cf_attn_block_shape *s, int h0, int h1) {
    int hd = s->head_dim, group = s->n_heads / s->n_kv_heads, nq = s->n_q;
    size_t krb = cf_kv_row_bytes(k_type, hd), vrb = cf_kv_row_bytes(v_type, hd);
    _Alignas(32) float tile[ATTN_TILE_FLOATS];
    int TT = cf_min(ATTN_TILE_FLOATS / hd, 64);
    int t_begin = cf_attn_lo(s, 0), t_end = s->pos0 + nq;
    int n_last = t_end - cf_attn_lo(s, nq - 1); /* the longest row: the last query's */
    for (int h = h0; h < h1;) {
        int kvh = h / group, hb = cf_min(h1, (kvh + 1) * group); /* heads [h, hb) share kv head kvh */
        size_t kv_row = (size_t)kvh * s->max_seq;
        /* score row of (head hh, query i), indexed by position: row(hh, i)[t] for t in [lo_i, p_i] */
#define ROW(hh, i) (att + ((size_t)((hh) - h0) * nq + (i)) * n_last - cf_attn_lo(s, (i)))
        for (int t0 = t_begin; t0 < t_end; t0 += TT) {
            int t1 = cf_min(t_end, t0 + TT);
            kv_tile(tile, k + kv_row * krb, k_type, hd, t0, t1);
            for (int i = 0; i < nq; i++) {
                int a = cf_max(t0, cf_attn_lo(s, i)), b = cf_min(t1, s->pos0 + i + 1);
                const float *qi = q + (size_t)i * s->ldq, *kt = tile + (size_t)(a - t0) * hd;
                int hh = h;
                for (; hh + 2 <= hb && a < b; hh += 2)
                    block_scores2(qi + (size_t)hh * hd, qi + (size_t)(hh + 1) * hd, kt, hd, b - a, s->scale,
                                  ROW(hh, i) + a, ROW(hh + 1, i) + a);
                if (hh < hb && a < b) block_scores(qi + (size_t)hh * hd, kt, hd, b - a, s->scale, ROW(hh, i) + a);
            }
        }
        for (int i = 0; i < nq; i++) {
            int lo = cf_attn_lo(s, i);
            for (int hh = h; hh < hb; hh++) {
                softmax_avx2(ROW(hh, i) + lo, s->pos0 + i + 1 - lo);
                memset(out + (size_t)i * s->ldo + (size_t)hh * hd, 0, sizeof(float) * (size_t)hd);
            }
        }
        for (int t0 = t_begin; t0 < t_end; t0 += TT) {
            int t1 = cf_min(t_end, t0 + TT);
            kv_tile(tile, v + kv_row * vrb, v_type, hd, t0, t1);
            for (int i = 0; i < nq; i++) {
                int a = cf_max(t0, cf_attn_lo(s, i)), b = cf_min(t1, s->pos0 + i + 1);
                float *oi = out + (size_t)i * s->ldo;
                const float *vt = tile + (size_t)(a - t0) * hd;
                int hh = h;
                for (; hh + 2 <= hb && a < b; hh += 2)
                    block_values2(oi + (size_t)hh * hd, oi + (size_t)(hh + 1) * hd, vt, ROW(hh, i) + a,
                                  ROW(hh + 1, i) + a, hd, b - a);
                if (hh < hb && a < b) block_values(oi + (size_t)hh * hd, vt, ROW(hh, i) + a, hd, b - a, hd);
            }
        }
#undef ROW
        h = hb;
    }
}

static void attention_block_avx2(float *out, const float *q, const cf_half *k, const cf_half *v,
                                 float *att, const cf_attn_block_shape *s, int h0, int h1) {
    if (s->head_dim % 8 != 0 || s->head_dim > ATTN_TILE_FLOATS) { /* attention_avx2 runs the reference there too */
        cf_attention_block_ref(out, q, k, v, att, s, h0, h1);
        return;
    }
    attn_block_tiles(out, q, (const uint8_t *)k, (const uint8_t *)v, CF_F16, CF_F16, att, s, h0, h1);
}

static void attention_block_q8kv_avx2(float *out, const float *q, const void *k, const void *v, int k_type,
                                      int v_type, float *att, const cf_attn_block_shape *s, int h0, int h1) {
    if (k_type == CF_F16 && v_type == CF_F16) {
        attention_block_avx2(out, q, k, v, att, s, h0, h1);
        return;
    }
    if (s->head_dim % CF_QK != 0 || s->head_dim > ATTN_TILE_FLOATS) { /* the cache layout needs 32s */
        cf_attention_block_q8kv_ref(out, q, k, v, k_type, v_type, att, s, h0, h1);
        return;
    }
    attn_block_tiles(out, q, k, v, k_type, v_type, att, s, h0, h1);
}

/* ---- decode over q8_0 rows: attn_scores / attn_values (kernels_avx2.c) with d * qs for K / V */

/* att_h[t] = scale * q_h . k_t over q8_0 rows for NH <= 4 heads of one kv head: each score one FMA
 * chain over head_dim from zero, hsum_ps, times scale (attn_scores's arithmetic, and the block
 * kernel's). Two positions at a time: 2 x NH independent chains share each converted chunk's
 * loads of q, and one hsum8_ps (hsum_ps's bits in every lane) finishes all of them. */
INLINE void attn_scores_q8(int NH, const float *q, const uint8_t *K, float *att, int hd, int n_pos,
                           float scale) {
    size_t rb = cf_kv_row_bytes(CF_Q8_0, hd);
    const __m256 vs = _mm256_set1_ps(scale);
    int t = 0;
    for (; t + 2 <= n_pos; t += 2) {
        const uint8_t *b0 = K + (size_t)t * rb, *b1 = b0 + rb;
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
        for (int j = 0; j < hd; j += CF_QK, b0 += 2 + CF_QK, b1 += 2 + CF_QK) {
            __m256 d0 = q8_scale(b0), d1 = q8_scale(b1);
            for (int i = 0; i < CF_QK; i += 8) {
                __m256 k0 = load_q8x8(b0 + 2 + i, d0), k1 = load_q8x8(b1 + 2 + i, d1);
                for (int h = 0; h < NH; h++) {
                    __m256 qv = _mm256_loadu_ps(q + (size_t)h * hd + j + i);
                    a[h] = _mm256_fmadd_ps(qv, k0, a[h]);
                    a[4 + h] = _mm256_fmadd_ps(qv, k1, a[4 + h]);
                }
            }
        }
        _Alignas(32) float sc[8];
        _mm256_store_ps(sc, _mm256_mul_ps(hsum8_ps(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]), vs));
        for (int h = 0; h < NH; h++) {
            att[(size_t)h * n_pos + t] = sc[h];
            att[(size_t)h * n_pos + t + 1] = sc[4 + h];
        }
    }
    for (; t < n_pos; t++) {
        const uint8_t *blk = K + (size_t)t * rb;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int j = 0; j < hd; j += CF_QK, blk += 2 + CF_QK) {
            __m256 d = q8_scale(blk);
            for (int i = 0; i < CF_QK; i += 8) {
                __m256 kf = load_q8x8(blk + 2 + i, d);
                for (int h = 0; h < NH; h++)
                    acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)h * hd + j + i), kf, acc[h]);
            }
        }
        for (int h = 0; h < NH; h++) att[(size_t)h * n_pos + t] = hsum_ps(acc[h]) * scale;
    }
}

/* out_h = sum_t att_h[t] * v_t over q8_0 rows. Each output lane is attn_values's sum (from zero, t
 * ascending: the same bits), but the outputs stay in registers over a tile of ATTN_VT positions
 * and 16 lanes (a tile of rows stays in L1 across its hd / 16 passes), instead of being loaded and
 * stored again at every position: the per-position work is the conversion and the FMAs alone. */
#define ATTN_VT 64
INLINE void attn_values_q8(int NH, float *out, const uint8_t *V, const float *att, int hd, int n_pos) {
    size_t rb = cf_kv_row_bytes(CF_Q8_0, hd);
    for (int h = 0; h < NH; h++) memset(out + (size_t)h * hd, 0, sizeof(float) * (size_t)hd);
    for (int t0 = 0; t0 < n_pos; t0 += ATTN_VT) {
        int t1 = cf_min(n_pos, t0 + ATTN_VT);
        for (int j = 0; j < hd; j += 16) {
            const uint8_t *blk = V + (size_t)t0 * rb + (size_t)(j / CF_QK) * (2 + CF_QK);
            int jj = 2 + j % CF_QK; /* the 16 lanes' first byte in their block */
            __m256 o[4][2];
            for (int h = 0; h < NH; h++) {
                o[h][0] = _mm256_loadu_ps(out + (size_t)h * hd + j);
                o[h][1] = _mm256_loadu_ps(out + (size_t)h * hd + j + 8);
            }
            for (int t = t0; t < t1; t++, blk += rb) {
                __m256 d = q8_scale(blk);
                __m256 v0 = load_q8x8(blk + jj, d), v1 = load_q8x8(blk + jj + 8, d);
                for (int h = 0; h < NH; h++) {
                    __m256 p = _mm256_broadcast_ss(att + (size_t)h * n_pos + t);
                    o[h][0] = _mm256_fmadd_ps(p, v0, o[h][0]);
                    o[h][1] = _mm256_fmadd_ps(p, v1, o[h][1]);
                }
            }
            for (int h = 0; h < NH; h++) {
                _mm256_storeu_ps(out + (size_t)h * hd + j, o[h][0]);
                _mm256_storeu_ps(out + (size_t)h * hd + j + 8, o[h][1]);
            }
        }
    }
}

/* attn_heads with each of K and V fp16 or q8_0. */
INLINE void attn_heads_kv(int NH, float *out, const float *q, const uint8_t *K, const uint8_t *V, int k_type,
                          int v_type, float *att, const cf_attn_shape *s) {
    if (k_type == CF_Q8_0)
        attn_scores_q8(NH, q, K, att, s->head_dim, s->n_pos, s->scale);
    else
        attn_scores(NH, q, (const cf_half *)K, att, s->head_dim, s->n_pos, s->scale);
    for (int h = 0; h < NH; h++) softmax_avx2(att + (size_t)h * s->n_pos, s->n_pos);
    if (v_type == CF_Q8_0)
        attn_values_q8(NH, out, V, att, s->head_dim, s->n_pos);
    else
        attn_values(NH, out, (const cf_half *)V, att, s->head_dim, s->n_pos);
}

static void attention_q8kv_avx2(float *out, const float *q, const void *k, const void *v, int k_type,
                                int v_type, float *att, const cf_attn_shape *s, int h0, int h1) {
    int hd = s->head_dim, group = s->n_heads / s->n_kv_heads;
    if (k_type == CF_F16 && v_type == CF_F16) {
        attention_avx2(out, q, k, v, att, s, h0, h1);
        return;
    }
    if (hd % CF_QK != 0) { /* the cache layout needs 32s */
        cf_attention_q8kv_ref(out, q, k, v, k_type, v_type, att, s, h0, h1);
        return;
    }
    size_t krb = cf_kv_row_bytes(k_type, hd), vrb = cf_kv_row_bytes(v_type, hd);
    for (int h = h0; h < h1;) {
        int kvh = h / group;
        int nh = cf_min(cf_min(h1, (kvh + 1) * group) - h, 4); /* heads of this kv head, <= 4 */
        size_t kv_row = (size_t)kvh * s->max_seq;
        const uint8_t *K = (const uint8_t *)k + kv_row * krb, *V = (const uint8_t *)v + kv_row * vrb;
        float *o = out + (size_t)h * hd, *a = att + (size_t)(h - h0) * s->n_pos;
        const float *qh = q + (size_t)h * hd;
        switch (nh) {
        case 1: attn_heads_kv(1, o, qh, K, V, k_type, v_type, a, s); break;
        case 2: attn_heads_kv(2, o, qh, K, V, k_type, v_type, a, s); break;
        case 3: attn_heads_kv(3, o, qh, K, V, k_type, v_type, a, s); break;
        default: attn_heads_kv(4, o, qh, K, V, k_type, v_type, a, s); break;
        }
        h += nh;
    }
}

/* One row into q8_0 blocks: quantize_block32 (kernels_avx2.c), the activation quantizer's
 * arithmetic (the same bits as the reference), with the scale stored as fp16 (F16C, round to
 * nearest even like cf_float_to_half) before the block. */
static void f32_to_q8_0_avx2(uint8_t *out, const float *x, int n) {
    for (int b = 0; b < n / CF_QK; b++, out += 2 + CF_QK) {
        __m256i q[4];
        float d = quantize_block32(x + (size_t)b * CF_QK, (int8_t *)(out + 2), q);
        cf_half h = (cf_half)_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
        memcpy(out, &h, sizeof h);
    }
}
