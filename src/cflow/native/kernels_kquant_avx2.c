/* kernels_kquant_avx2.c — the AVX2 kernels of Q5_0, Q5_1 and the K-quants (Q4_K, Q5_K, Q6_K),
 * and the 256-block activation quantizer. Not compiled alone: kernels_avx2.c includes it, so the
 * avx2 and avxvnni tables both get it with their own flags and it shares that file's helpers
 * (group_dot and matmat_groups hand these dtypes to kq_group_dot / kq_matmat_groups). The avx512
 * table inherits all of it but the mat-vec and gate/up of these five dtypes, which
 * kernels_kquant_avx512.c replaces (the same integers and float operations on zmm: 1.7-1.9x this
 * file's speed from L2 on Zen 5, the DRAM bound at one thread).
 *
 * Every full 8-row group of a tile is handled in two steps:
 *   unpack  one block (a 32-block of Q5_x, a 256-weight super-block of a K-quant) of the 8 rows
 *           into unsigned bytes in weight order, and the scales into int16 vectors;
 *   dot     the unpacked group against one activation: per sub-block u8 x s8 maddubs, the
 *           sub-block scale applied in integer (madd with the int16 scale), summed over the
 *           super-block in int32; then one float FMA per row and super-block (Q4_K / Q5_K: a
 *           second for the mins, whose integer part sum_s m_s * bsum_s needs no weights at all).
 * Speed (docs/kquants.md, "Speed"): the mat-vec is instruction-bound at one thread, so the work
 * per byte is kept small: Q4_K / Q5_K's packed 6-bit scales of all 8 rows are decoded with SIMD
 * two rows per vector, into a table of dwords whose vpbroadcastd (a plain load) is madd's scale
 * operand, instead of a shuffle per sub-block; the 5th / 6th bits move into place with one shift
 * and one mask; the compiler hoists the activation's 8 vectors out of the row loop (most stay in
 * registers, the rest in L1). What remains is the per-sub-block scale multiply: twice Q4_0's
 * multiply-port work per weight, which this row-major layout cannot avoid.
 * The mat-vec unpacks one row at a time and uses it at once (one activation); the mat-mat
 * unpacks the group once into an L1 buffer and runs up to KQ_NB activations over it, loading
 * each 32 activations once for the 8 rows (under VNNI transposed, lane i = row i, so one
 * vpdpbusd per 4 activation bytes serves all 8 rows and a vpmulld applies each sub-block's 8
 * scales). All paths form the same exact integers and apply the same float operations in the
 * same order (kq_finish_qd), so matmat == B mat-vecs bit for bit. The integer bounds (no int16
 * saturation, no int32 overflow) are in docs/kquants.md.
 *
 * The K-quant mat-vec's sub-block scales need the int16 stage, so the VNNI table keeps maddubs
 * there and applies the scale with vpdpwssd (madd + add in one); Q5_0 / Q5_1 use vpdpbusd like
 * Q4_0 (dot_q4_pair_unpacked).
 * Q6_K's field starts inside a chunk are not 32-byte aligned: every load is unaligned.
 */

#define KQ_DTYPE(dt) ((dt) == CF_Q5_0 || (dt) == CF_Q5_1 || cf_is_kquant(dt))

#include "kquant_scales.h"

/* ---- the 256-block activation ------------------------------------------------------------ */

/* cf_quantize_act_k_ref's arithmetic, vectorised: the same max, reciprocal and rounding, so
 * the same bits. */
static void quantize_act_k_avx2(const float *x, cf_act_q8 *out) {
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < out->n / CF_QK_K; b++) {
        const float *xb = x + (size_t)b * CF_QK_K;
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < CF_QK_K; i += 8)
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, _mm256_loadu_ps(xb + i)));
        float d = hmax_ps(amax) / 127.0f;
        __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        for (int k = 0; k < CF_QK_K / 32; k++) {
            __m256i q[4];
            for (int i = 0; i < 4; i++)
                q[i] = _mm256_cvtps_epi32(round_half_away(_mm256_mul_ps(_mm256_loadu_ps(xb + 32 * k + 8 * i), id)));
            out->bsums[(size_t)b * 16 + 2 * k] = (int16_t)hsum_epi32(_mm256_add_epi32(q[0], q[1]));
            out->bsums[(size_t)b * 16 + 2 * k + 1] = (int16_t)hsum_epi32(_mm256_add_epi32(q[2], q[3]));
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(out->qk + (size_t)b * CF_QK_K + 32 * k), p);
        }
        out->dk[b] = d;
    }
}

/* ---- unpacking one block of a full group --------------------------------------------------- */

/* The 8 row sums of 4 row-pair vectors [row 2j: 4 x s32 | row 2j+1: 4 x s32], in row order
 * (three hadds leave [r0 r2 r4 r6 | r1 r3 r5 r7], one permute sorts). */
INLINE __m256i fold_pairs(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
    __m256i a = _mm256_hadd_epi32(p0, p1), b = _mm256_hadd_epi32(p2, p3);
    return _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(a, b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Q5_0 / Q5_1, one 32-block of 8 rows: v[2j], v[2j+1] = rows (2j | 2j+1), weights 0..15 and
 * 16..31 (unpack_q4_pair's arrangement), with the 5th bit from the rows' qh words. */
typedef struct {
    __m256 d, m;
    __m256i v[8];
} q5_group;

/* 0x10 in byte k of each 128-bit lane where bit (k + 16*half) of that lane's qh word is set
 * (lane 0: row a, lane 1: row b); ggml's bytes_from_bits trick. */
INLINE __m256i q5_high_bits(__m256i h, int half) {
    const __m256i shuf = half ? _mm256_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
                                                 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3)
                              : _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(h, shuf), _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL));
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi8(-1)), _mm256_set1_epi8(0x10));
}

/* chunk (g = 8): Q5_0 d[8] | qh[8][4] | qs[8][16] (176 B); Q5_1 d[8] | m[8] | qh | qs (192 B). */
INLINE void q5_unpack(int dtype, const uint8_t *c, q5_group *G) {
    const int q51 = dtype == CF_Q5_1;
    const uint8_t *qh = c + (q51 ? 32 : 16), *qs = qh + 32;
    G->d = load_halves8(c);
    G->m = q51 ? load_halves8(c + 16) : _mm256_setzero_ps();
    __m256i qh8 = _mm256_loadu_si256((const __m256i *)qh); /* dword i = row i's qh */
    for (int j = 0; j < 4; j++) {
        /* lane 0: row 2j's qh word, lane 1: row 2j+1's */
        __m256i h = _mm256_permutevar8x32_epi32(qh8, _mm256_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1,
                                                                       2 * j + 1, 2 * j + 1, 2 * j + 1));
        __m256i lo, hi;
        unpack_q4_pair(qs + 32 * j, &lo, &hi);
        G->v[2 * j] = _mm256_or_si256(lo, q5_high_bits(h, 0));
        G->v[2 * j + 1] = _mm256_or_si256(hi, q5_high_bits(h, 1));
    }
}

/* The 8 rows' integer dots with activation block xk (u8 0..31 x s8: maddubs pair sums <= 7874,
 * two added <= 15748, fit int16). */
INLINE __m256i q5_isum(const q5_group *G, const int8_t *xk) {
    __m256i xa = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)xk));
    __m256i xb = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xk + 16)));
    return fold_pairs(dot_q4_pair_unpacked(G->v[0], G->v[1], xa, xb), dot_q4_pair_unpacked(G->v[2], G->v[3], xa, xb),
                      dot_q4_pair_unpacked(G->v[4], G->v[5], xa, xb), dot_q4_pair_unpacked(G->v[6], G->v[7], xa, xb));
}

/* acc += the block's share: Q5_0 d * (isum * dx - 16 s), Q5_1 d * (isum * dx) + m * s. */
INLINE __m256 q5_update(int dtype, const q5_group *G, const cf_act_q8 *x, int kb, __m256 acc) {
    __m256 fsum = _mm256_cvtepi32_ps(q5_isum(G, x->qs + (size_t)kb * CF_QK));
    __m256 bd = _mm256_broadcast_ss(x->d + kb), bs = _mm256_broadcast_ss(x->s + kb);
    if (dtype == CF_Q5_1) {
        acc = _mm256_fmadd_ps(G->d, _mm256_mul_ps(fsum, bd), acc);
        return _mm256_fmadd_ps(G->m, bs, acc);
    }
    __m256 neg16s = _mm256_mul_ps(bs, _mm256_set1_ps(-16.0f));
    return _mm256_fmadd_ps(G->d, _mm256_fmadd_ps(fsum, bd, neg16s), acc);
}

/* One row of a K-quant super-block: q[t] = weights 32t .. 32t+31 (unsigned); Q6_K's scales as
 * int16: sc / sc2 = scales 0..7 / 8..15 in both 128-bit lanes, s16 = all 16 (lane 0: 0..7,
 * lane 1: 8..15). Q4_K / Q5_K keep their scales in the group's kq_scales table instead. */
typedef struct {
    __m256i q[8];
    __m256i sc, sc2, s16;
} kq_row;

/* The decoded 6-bit scales and mins of a Q4_K / Q5_K group's super-block: sc32[i][t] = scale t
 * of row i in both int16 halves of a dword, so that madd's operand is one vpbroadcastd from
 * memory (a load, no shuffle); mins[j] = the int16 mins of rows 2j (lane 0) and 2j+1 (lane 1),
 * the arrangement fold_pairs sums. Q6_K: unused. */
typedef struct {
    uint32_t sc32[CF_G][8];
    __m256i mins[CF_G / 2];
} kq_scales;

/* The mat-mat's unpacked group. Without VNNI, scl[i][t] = madd's scale operand for row i's q[t]
 * (Q4_K / Q5_K: s.sc32[i][t] broadcast; Q6_K: kq_q6_scale), built once per unpack so that each
 * activation's madd takes it from memory as is (no broadcast or shuffle per activation); under
 * VNNI kq_transpose reads s and sc / sc2 instead. */
typedef struct {
    __m256 d, dmin;
    kq_scales s; /* Q4_K / Q5_K */
    kq_row r[CF_G];
#if !CF_ISA_VNNI
    __m256i scl[CF_G][8];
#endif
} kq_group;

/* Q4_K / Q5_K's packed scales of all 8 rows (8 x 12 bytes at s) -> kq_scales, two rows per vector
 * (kq_scale_min_pair, kquant_scales.h: row 2j in lane 0, 2j+1 in lane 1; per lane bytes 0..7 the
 * scales, 8..15 the mins). The last pair's load reads 8 bytes past the scales, still inside the
 * chunk: the quants follow. */
INLINE void kq_scales_k4(const uint8_t *s, kq_scales *S) {
    const __m256i zero = _mm256_setzero_si256();
    for (int j = 0; j < CF_G / 2; j++) {
        __m256i sm = kq_scale_min_pair(s + 24 * j);
        __m256i sc16 = _mm256_unpacklo_epi8(sm, zero);
        S->mins[j] = _mm256_unpackhi_epi8(sm, zero);
        __m256i lo = _mm256_unpacklo_epi16(sc16, sc16), hi = _mm256_unpackhi_epi16(sc16, sc16);
        _mm256_storeu_si256((__m256i *)S->sc32[2 * j], _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_storeu_si256((__m256i *)S->sc32[2 * j + 1], _mm256_permute2x128_si256(lo, hi, 0x31));
    }
}

/* (v << n) for n >= 0, (v >> -n) otherwise, in 16-bit lanes; callers mask to bits that stay in
 * their byte. */
INLINE __m256i shift16(__m256i v, int n) {
    return n > 0 ? _mm256_slli_epi16(v, n) : n < 0 ? _mm256_srli_epi16(v, -n) : v;
}

/* Row i's quants of a full group's super-block chunk c (g = 8, offsets: docs/kquants.md, tile
 * layout), and Q6_K's scales:
 *   Q4_K d[8]@0 dmin[8]@16 scales[8][12]@32 qs[8][128]@128                 (1152 B)
 *   Q5_K d[8]@0 dmin[8]@16 scales[8][12]@32 qh[8][32]@128 qs[8][128]@384   (1408 B)
 *   Q6_K d[8]@0 scales[8][16]@16 ql[8][128]@144 qh[8][64]@1168             (1680 B)
 * Extra bits are moved into place with one shift and one mask each (bit b of a byte to bit 4:
 * a 16-bit shift by 4 - b, |4 - b| <= 4, never takes a bit from the neighbouring byte once
 * masked). */
INLINE void kq_unpack_row(int dtype, const uint8_t *c, int i, kq_row *R) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    if (dtype == CF_Q6_K) {
        const uint8_t *sc = c + 16 + 16 * i, *ql = c + 144 + 128 * i, *qh = c + 1168 + 64 * i;
        const __m256i m2 = _mm256_set1_epi8(0x30);
        for (int h = 0; h < 2; h++) { /* weight 128h + 32s + l: ql[64h + 32(s&1) + l], qh[32h + l] bits 2s.. */
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
            __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            __m256i lo4[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                              _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
            for (int s = 0; s < 4; s++) /* bits 2s, 2s+1 -> 4, 5 */
                R->q[4 * h + s] = _mm256_or_si256(lo4[s], _mm256_and_si256(shift16(hb, 4 - 2 * s), m2));
        }
        R->sc = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)sc)));
        R->sc2 = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(sc + 8))));
        R->s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        return;
    }
    const int q5k = dtype == CF_Q5_K;
    const uint8_t *qs = c + (q5k ? 384 : 128) + 128 * i;
    __m256i hb = q5k ? _mm256_loadu_si256((const __m256i *)(c + 128 + 32 * i)) : _mm256_setzero_si256();
    const __m256i b4 = _mm256_set1_epi8(0x10);
    for (int k = 0; k < 4; k++) { /* run k: sub-block 2k in the low nibbles, 2k+1 in the high */
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * k));
        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (q5k) { /* bit s of qh[l]: the 5th bit of weight 32s + l */
            lo = _mm256_or_si256(lo, _mm256_and_si256(shift16(hb, 4 - 2 * k), b4));
            hi = _mm256_or_si256(hi, _mm256_and_si256(shift16(hb, 3 - 2 * k), b4));
        }
        R->q[2 * k] = lo;
        R->q[2 * k + 1] = hi;
    }
    R->sc = R->sc2 = R->s16 = _mm256_setzero_si256();
}

/* int16 lane j of v in every int16 lane (per 128-bit lane: lane 0 takes j0, lane 1 takes j1). */
INLINE __m256i bcast16(__m256i v, int j0, int j1) {
    int b0 = (2 * j0 + 1) << 8 | 2 * j0, b1 = (2 * j1 + 1) << 8 | 2 * j1;
    return _mm256_shuffle_epi8(v, _mm256_setr_epi16((short)b0, (short)b0, (short)b0, (short)b0, (short)b0, (short)b0,
                                                    (short)b0, (short)b0, (short)b1, (short)b1, (short)b1, (short)b1,
                                                    (short)b1, (short)b1, (short)b1, (short)b1));
}

/* Q6_K's madd scale operand for row R's q[t]: sub-block 2t's scale in every int16 lane of the
 * low 128-bit lane, 2t+1's in the high one. */
INLINE __m256i kq_q6_scale(const kq_row *R, int t) {
    return bcast16(t < 4 ? R->sc : R->sc2, 2 * (t & 3), 2 * (t & 3) + 1);
}

INLINE void kq_unpack(int dtype, const uint8_t *c, kq_group *G) {
    G->d = load_halves8(c);
    G->dmin = dtype == CF_Q6_K ? _mm256_setzero_ps() : load_halves8(c + 16);
    if (dtype != CF_Q6_K) kq_scales_k4(c + 32, &G->s);
    for (int i = 0; i < CF_G; i++) kq_unpack_row(dtype, c, i, &G->r[i]);
#if !CF_ISA_VNNI
    for (int i = 0; i < CF_G; i++)
        for (int t = 0; t < 8; t++)
            G->scl[i][t] = dtype == CF_Q6_K ? kq_q6_scale(&G->r[i], t) : _mm256_set1_epi32((int)G->s.sc32[i][t]);
#endif
}

/* ---- the integer dot products of one super-block ------------------------------------------- */

/* acc + the int32 pair sums of p * scale (int16 x int16): one vpdpwssd with VNNI. */
INLINE __m256i madd_acc(__m256i acc, __m256i p, __m256i scale) {
#if CF_ISA_VNNI
    return _mm256_dpwssd_avx_epi32(acc, p, scale);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, scale));
#endif
}

/* Row R's sum_qd over one super-block as 8 int32 partials. Q4_K / Q5_K: sum_t sc_t * dot_t over
 * the 8 sub-blocks of 32 (maddubs pair sums <= 2*31*127, times sc <= 63 in madd; sc32 = the
 * row's kq_scales entry). Q6_K: 16 sub-blocks of 16 (q[t] covers sub-blocks 2t, 2t+1, one per
 * 128-bit lane; pair sums <= 16002), minus 32 * sum_s sc_s * bsums[s], so the weights' -32 never
 * enters the byte products. */
INLINE __m256i kq_row_qd(int dtype, const kq_row *R, const uint32_t *sc32, const int8_t *xq, __m256i bs16) {
    /* two accumulators: vpdpwssd's latency would otherwise chain the 8 sub-blocks */
    __m256i acc2[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 8
    for (int t = 0; t < 8; t++) {
        __m256i p = _mm256_maddubs_epi16(R->q[t], _mm256_loadu_si256((const __m256i *)(xq + 32 * t)));
        __m256i scale = dtype == CF_Q6_K ? kq_q6_scale(R, t) : _mm256_set1_epi32((int)sc32[t]);
        acc2[t & 1] = madd_acc(acc2[t & 1], p, scale);
    }
    __m256i acc = _mm256_add_epi32(acc2[0], acc2[1]);
    if (dtype == CF_Q6_K) acc = _mm256_sub_epi32(acc, _mm256_slli_epi32(_mm256_madd_epi16(R->s16, bs16), 5));
    return acc;
}

/* acc (lane i = row i) += one super-block of the 8 rows, given their sum_qd (qd, lane i = row i)
 * and (Q4_K / Q5_K) mins (kq_scales' mins: rows 2j | 2j+1), against activation x's block kb:
 *   y += (d dx) sum_qd - (dmin dx) sum_mb       (Q6_K: no mins)
 * The one place these float operations are written: mat-vec and mat-mat both end here. */
INLINE __m256 kq_finish_qd(int dtype, __m256 d, __m256 dmin, __m256i qd, const __m256i *mins,
                           const cf_act_q8 *x, int kb, __m256 acc) {
    __m256 dx = _mm256_broadcast_ss(x->dk + kb);
    acc = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(qd), acc);
    if (dtype != CF_Q6_K) {
        /* the sums of each 32 activations (|.| <= 4064, fit int16), one madd per row pair */
        const int16_t *bs = x->bsums + (size_t)kb * (CF_QK_K / 16);
        __m256i b32 = _mm256_broadcastsi128_si256(
            _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)bs), _mm_loadu_si128((const __m128i *)(bs + 8))));
        __m256i mb = fold_pairs(_mm256_madd_epi16(mins[0], b32), _mm256_madd_epi16(mins[1], b32),
                                _mm256_madd_epi16(mins[2], b32), _mm256_madd_epi16(mins[3], b32));
        acc = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(mb), acc);
    }
    return acc;
}

/* kq_finish_qd from per-row partial vectors r[i] (summed across lanes first). */
INLINE __m256 kq_finish(int dtype, __m256 d, __m256 dmin, const __m256i *r, const __m256i *mins,
                        const cf_act_q8 *x, int kb, __m256 acc) {
    __m256i qd = hsum8_epi32(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7]);
    return kq_finish_qd(dtype, d, dmin, qd, mins, x, kb, acc);
}

INLINE __m256i act_bsums(const cf_act_q8 *x, int kb) {
    return _mm256_loadu_si256((const __m256i *)(x->bsums + (size_t)kb * (CF_QK_K / 16)));
}

/* The mat-vec's step: the group's scales decoded together, then each row unpacked and used at
 * once (nothing kept but its partials). */
INLINE __m256 kq_update_rows(int dtype, const uint8_t *c, const cf_act_q8 *x, int kb, __m256 acc) {
    const int8_t *xq = x->qk + (size_t)kb * CF_QK_K;
    __m256i bs16 = act_bsums(x, kb);
    kq_scales S;
    if (dtype != CF_Q6_K) kq_scales_k4(c + 32, &S);
    __m256i r[CF_G];
    for (int i = 0; i < CF_G; i++) {
        kq_row R;
        kq_unpack_row(dtype, c, i, &R);
        r[i] = kq_row_qd(dtype, &R, S.sc32[i], xq, bs16);
    }
    __m256 d = load_halves8(c), dmin = dtype == CF_Q6_K ? _mm256_setzero_ps() : load_halves8(c + 16);
    return kq_finish(dtype, d, dmin, r, S.mins, x, kb, acc);
}

/* Lane i of v[k] = dword k of a[i]: an 8x8 transpose of 32-bit elements. */
INLINE void transpose8x8_epi32(const __m256i a[8], __m256i v[8]) {
    __m256i t[8], u[8];
    for (int r = 0; r < 8; r += 2) {
        t[r] = _mm256_unpacklo_epi32(a[r], a[r + 1]);     /* dwords 0,1 | 4,5 of rows r, r+1 */
        t[r + 1] = _mm256_unpackhi_epi32(a[r], a[r + 1]); /* dwords 2,3 | 6,7 */
    }
    for (int h = 0; h < 8; h += 4) { /* rows h..h+3 */
        u[h] = _mm256_unpacklo_epi64(t[h], t[h + 2]);         /* dword 0 | 4 */
        u[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]);     /* dword 1 | 5 */
        u[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]); /* dword 2 | 6 */
        u[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]); /* dword 3 | 7 */
    }
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x20);
        v[4 + k] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x31);
    }
}

#if CF_ISA_VNNI
/* An unpacked K-quant group transposed for the mat-mat: T[8t + k] lane i = bytes 4k..4k+3 of
 * row i's q[t] (weights 32t + 4k ..), SC[s] lane i = row i's scale of sub-block s (int32). One
 * vpdpbusd against 4 broadcast activation bytes then adds to every row's own lane: no fold of
 * the 8 rows per activation, and each sub-block's sums are scaled with one vpmulld. */
typedef struct {
    __m256 d, dmin;
    __m256i T[64], SC[16];
    __m256i mins[CF_G / 2];
} kq_group_t;

INLINE void kq_transpose(int dtype, const kq_group *G, kq_group_t *GT) {
    __m256i a[CF_G];
    GT->d = G->d;
    GT->dmin = G->dmin;
    for (int t = 0; t < 8; t++) {
        for (int i = 0; i < CF_G; i++) a[i] = G->r[i].q[t];
        transpose8x8_epi32(a, &GT->T[8 * t]);
    }
    if (dtype == CF_Q6_K) { /* sc / sc2: int16 scales 0..7 / 8..15, widened with their sign */
        for (int h = 0; h < 2; h++) {
            for (int i = 0; i < CF_G; i++) a[i] = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(h ? G->r[i].sc2 : G->r[i].sc));
            transpose8x8_epi32(a, &GT->SC[8 * h]);
        }
    } else { /* sc32[i][t] holds scale t (0..63) in both int16 halves: keep the high one */
        for (int i = 0; i < CF_G; i++) a[i] = _mm256_loadu_si256((const __m256i *)G->s.sc32[i]);
        transpose8x8_epi32(a, GT->SC);
        for (int t = 0; t < 8; t++) GT->SC[t] = _mm256_srli_epi32(GT->SC[t], 16);
        for (int j = 0; j < CF_G / 2; j++) GT->mins[j] = G->s.mins[j];
    }
}

/* kq_update over a transposed group: the same exact sum_qd per row (Q4_K / Q5_K: sum_t sc_t *
 * dot_t; Q6_K: sum_s sc_s * (dot_s - 32 bsums_s)), then the same float operations. */
INLINE __m256 kq_update_t(int dtype, const kq_group_t *GT, const cf_act_q8 *x, int kb, __m256 acc) {
    const int32_t *x4 = (const int32_t *)(x->qk + (size_t)kb * CF_QK_K); /* 64 dwords of 4 int8 */
    __m256i qd = _mm256_setzero_si256();
    if (dtype == CF_Q6_K) {
        const int16_t *bs = x->bsums + (size_t)kb * (CF_QK_K / 16);
        for (int s = 0; s < 16; s++) { /* sub-block s: dwords 4s .. 4s+3 */
            __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256();
            d0 = _mm256_dpbusd_avx_epi32(d0, GT->T[4 * s], _mm256_set1_epi32(x4[4 * s]));
            d1 = _mm256_dpbusd_avx_epi32(d1, GT->T[4 * s + 1], _mm256_set1_epi32(x4[4 * s + 1]));
            d0 = _mm256_dpbusd_avx_epi32(d0, GT->T[4 * s + 2], _mm256_set1_epi32(x4[4 * s + 2]));
            d1 = _mm256_dpbusd_avx_epi32(d1, GT->T[4 * s + 3], _mm256_set1_epi32(x4[4 * s + 3]));
            __m256i dot = _mm256_sub_epi32(_mm256_add_epi32(d0, d1), _mm256_set1_epi32(32 * bs[s]));
            qd = _mm256_add_epi32(qd, _mm256_mullo_epi32(dot, GT->SC[s]));
        }
    } else {
        for (int t = 0; t < 8; t++) { /* sub-block t: dwords 8t .. 8t+7; two chains halve the latency */
            __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256();
            for (int k = 0; k < 8; k += 2) {
                d0 = _mm256_dpbusd_avx_epi32(d0, GT->T[8 * t + k], _mm256_set1_epi32(x4[8 * t + k]));
                d1 = _mm256_dpbusd_avx_epi32(d1, GT->T[8 * t + k + 1], _mm256_set1_epi32(x4[8 * t + k + 1]));
            }
            qd = _mm256_add_epi32(qd, _mm256_mullo_epi32(_mm256_add_epi32(d0, d1), GT->SC[t]));
        }
    }
    return kq_finish_qd(dtype, GT->d, GT->dmin, qd, GT->mins, x, kb, acc);
}
#else
/* The mat-mat's step: an unpacked group against one activation, sub-block by sub-block so each
 * 32 activations are loaded once for the 8 rows (the same exact integers as kq_row_qd). */
INLINE __m256 kq_update(int dtype, const kq_group *G, const cf_act_q8 *x, int kb, __m256 acc) {
    const int8_t *xq = x->qk + (size_t)kb * CF_QK_K;
    __m256i r[CF_G];
    for (int i = 0; i < CF_G; i++) r[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int t = 0; t < 8; t++) {
        __m256i xt = _mm256_loadu_si256((const __m256i *)(xq + 32 * t));
        for (int i = 0; i < CF_G; i++)
            r[i] = madd_acc(r[i], _mm256_maddubs_epi16(G->r[i].q[t], xt), G->scl[i][t]);
    }
    if (dtype == CF_Q6_K) {
        __m256i bs16 = act_bsums(x, kb);
        for (int i = 0; i < CF_G; i++)
            r[i] = _mm256_sub_epi32(r[i], _mm256_slli_epi32(_mm256_madd_epi16(G->r[i].s16, bs16), 5));
    }
    return kq_finish(dtype, G->d, G->dmin, r, G->s.mins, x, kb, acc);
}
#endif

/* ---- mat-vec: group_dot for these dtypes ---------------------------------------------------- */

/* Q6_K's chunk (1680 B, not a whole number of cache lines) read as two interleaved streams
 * (ql, then qh 1 KiB further) defeats the hardware prefetcher: from DRAM its mat-vec ran at
 * under half of Q4_K's bytes per second, and at Q4_K's or better with the lines fetched ahead
 * in software. So in the default prefetch mode (cflow.h, cf_set_prefetch) matvec_groups
 * prefetches Q6_K's weights this far ahead, one group's lines before each group (with the
 * default 256-column tiles a group is one chunk); since 2026-11-30 every dtype's mat-vec does the
 * same by default (kernels_avx2.c, MATVEC_AHEAD), which was measured to help them all.
 * Mode 0 turns this off too; a distance N > 0 replaces it. */
#ifndef KQ_Q6K_AHEAD
#define KQ_Q6K_AHEAD 8192
#endif

INLINE __m256 kq_group_dot(int dtype, const uint8_t *p, int nkt, const cf_act_q8 *x, int kb0) {
    __m256 acc = _mm256_setzero_ps();
    size_t chunk = (size_t)CF_G * cf_block_bytes(dtype);
    for (int kb = 0; kb < nkt; kb++, p += chunk) {
        if (dtype == CF_Q5_0 || dtype == CF_Q5_1) {
            q5_group G;
            q5_unpack(dtype, p, &G);
            acc = q5_update(dtype, &G, x, kb0 + kb, acc);
        } else {
            acc = kq_update_rows(dtype, p, x, kb0 + kb, acc);
        }
    }
    return acc;
}

/* ---- mat-mat: each block unpacked once for up to KQ_NB activations ------------------------- */

#define KQ_NB 16 /* activations per pass: their accumulators (512 B) stay in L1 beside the
                  * unpacked super-block (~5 KiB, and ~3 KiB more transposed under VNNI) */

/* out[b*ldo + r - g0*8] for groups [g0, g1) and b < B; the short last group through the
 * reference, as in matvec_groups. Per (group, tile) each activation's accumulator sees exactly
 * kq_group_dot's operations, so the results are the mat-vec's bit for bit. */
INLINE void kq_matmat_groups(int dtype, const cf_tiled *w, const cf_act_q8 *xs, int B, float *out,
                             int ldo, int g0, int g1) {
    int g1_full = cf_min(g1, w->rows / CF_G);
    size_t chunk = (size_t)CF_G * cf_block_bytes(dtype);
    int pf = cf_prefetch_distance(0); /* the group's bytes come from memory once, in its first pass */
    const uint8_t *end = pf ? cf_tiled_end(w) : NULL;
    if (g0 < g1_full) {
        for (int b = 0; b < B; b++)
            memset(out + (size_t)b * ldo, 0, sizeof(float) * (size_t)(g1_full - g0) * CF_G);
        cf_span sp;
        for (cf_span_begin(&sp, w, g0, g1_full); cf_span_next(&sp);) {
            const uint8_t *p = sp.ptr;
            for (int gr = sp.ga; gr < sp.gb; gr++, p += sp.nkt * chunk) {
                cf_prefetch_ahead(pf, p, sp.nkt * chunk, end);
                float *o = out + (size_t)(gr - g0) * CF_G;
                for (int b0 = 0; b0 < B; b0 += KQ_NB) {
                    int nb = cf_min(KQ_NB, B - b0);
                    __m256 acc[KQ_NB];
                    for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_ps();
                    for (int kb = 0; kb < sp.nkt; kb++) {
                        const uint8_t *c = p + kb * chunk;
                        if (dtype == CF_Q5_0 || dtype == CF_Q5_1) {
                            q5_group G;
                            q5_unpack(dtype, c, &G);
                            for (int b = 0; b < nb; b++) acc[b] = q5_update(dtype, &G, &xs[b0 + b], sp.kb0 + kb, acc[b]);
                        } else {
                            kq_group G;
                            kq_unpack(dtype, c, &G);
#if CF_ISA_VNNI
                            kq_group_t GT;
                            kq_transpose(dtype, &G, &GT);
                            for (int b = 0; b < nb; b++) acc[b] = kq_update_t(dtype, &GT, &xs[b0 + b], sp.kb0 + kb, acc[b]);
#else
                            for (int b = 0; b < nb; b++) acc[b] = kq_update(dtype, &G, &xs[b0 + b], sp.kb0 + kb, acc[b]);
#endif
                        }
                    }
                    for (int b = 0; b < nb; b++) {
                        float *ob = o + (size_t)(b0 + b) * ldo;
                        _mm256_storeu_ps(ob, _mm256_add_ps(_mm256_loadu_ps(ob), acc[b]));
                    }
                }
            }
        }
    }
    if (g1 > g1_full && g1 > g0) {
        int gs = cf_max(g0, g1_full);
        for (int b = 0; b < B; b++)
            cf_matvec_groups_ref(w, &xs[b], out + (size_t)b * ldo + (size_t)(gs - g0) * CF_G, gs, g1);
    }
}
