/* kernels_avx2.c — AVX2 + FMA + F16C versions of the kernels in cf_kernel_table.
 *
 * Compiled with -mavx2 -mfma -mf16c only (never -march=native) and chosen by dispatch.c when the
 * CPU has all three. Every function falls through to a scalar tail (or to the reference for
 * shapes its fast path does not cover), so results match kernels_ref.c within float rounding
 * (quantize_act, f16 conversion: bit for bit).
 *
 * Tiled mat-vec, per 32-block of a full 8-row group (DESIGN.md "Tile layout"):
 *   one vcvtph2ps turns the 8 rows' fp16 scales into a vector (lane i = row i);
 *   Q4: one 32-byte load holds the nibbles of two adjacent rows; their u8 x s8 dot products with
 *   the activation (maddubs + madd, or one vpdpbusd per nibble half with VNNI) leave 4 partial
 *   sums per row, and three hadds + one permute fold the 4 row pairs into one vector of the 8
 *   rows' sums. Q8_0 weights are signed, so maddubs gets |w| and sign(x, w), one row at a time;
 *   then one FMA applies d_w * d_x, and the block's s = d_x*sum(q_x) applies Q4_0's -8 or
 *   Q4_1's +m once per block instead of per weight.
 * A thread's share of a tile (a range of groups) is one contiguous run of bytes, read in order,
 * and every row is summed in the same order whatever the split, so results do not depend on
 * the number of threads.
 *
 * Q5_0, Q5_1 and the K-quants (Q4_K, Q5_K, Q6_K) are in kernels_kquant_avx2.c, included below:
 * group_dot and matmat_groups hand those dtypes to it.
 *
 * Tiled mat-mat (prefill, B activations): a Q4 block is transposed once (4x4 dword shuffles) so
 * that lane i of each vector holds 4 bytes of row i; one vpdpbusd (or maddubs) against 4
 * activation bytes broadcast to all lanes then adds to every row's own lane, so no horizontal
 * fold is needed per activation, and the unpacked blocks of 4 groups serve all B activations
 * from L1. Per row the float operations are the mat-vec's, so matmat == B mat-vecs bit for bit.
 *
 * Software prefetch (claim C6; modes in cflow.h, cf_set_prefetch): each weight-streaming kernel
 * here (matvec_groups, so mat-vec and gate/up; matmat_groups and kq_matmat_groups, so matmat and
 * gate_up_mm; matvec_f32) reads its distance once per call (cf_prefetch_distance) and, before each
 * contiguous run of weights it reads from memory, calls cf_prefetch_ahead: with distance 0 that is
 * one not-taken branch per run, and no PREFETCH instruction executes.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "cflow.h"
#include "kernels_internal.h"
#include "kernels_ref.h"
#include "simd_silu.h"

/* kernels_avxvnni.c compiles this file again with -mavxvnni and CF_ISA_VNNI=1: the integer dot
 * products then use vpdpbusd (u8 x s8 -> s32 in one instruction) instead of maddubs + madd. */
#ifndef CF_ISA_VNNI
#define CF_ISA_VNNI 0
#endif
#if CF_ISA_VNNI
#define CF_TABLE_NAME "avxvnni"
#define CF_TABLE_GETTER cf_kernels_avxvnni
#else
#define CF_TABLE_NAME "avx2"
#define CF_TABLE_GETTER cf_kernels_avx2
#endif

#define INLINE static inline __attribute__((always_inline))

/* ---- small helpers ----------------------------------------------------------------------- */

INLINE float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE float hmax_ps(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
}

/* Lane i of the result = sum of the 8 lanes of v_i. */
INLINE __m256i hsum8_epi32(__m256i v0, __m256i v1, __m256i v2, __m256i v3, __m256i v4,
                           __m256i v5, __m256i v6, __m256i v7) {
    __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
    __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v4, v5), _mm256_hadd_epi32(v6, v7));
    /* a = [v0..v3 over lanes 0-3 | v0..v3 over lanes 4-7], b likewise for v4..v7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                            _mm256_permute2x128_si256(a, b, 0x31));
}

INLINE __m256 load_halves8(const void *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* 16 bytes of nibbles -> 32 bytes 0..15: low nibbles (weights 0..15) then high (16..31). */
INLINE __m256i bytes_from_nibbles(const uint8_t *p) {
    __m128i t = _mm_loadu_si128((const __m128i *)p);
    __m256i b = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_and_si256(b, _mm256_set1_epi8(0x0f));
}

/* exp_ps / silu_ps: simd_silu.h (one definition, the same bits everywhere). */

/* ---- activation quantization ------------------------------------------------------------- */

/* round half away from zero, exactly like roundf: trunc, then step away if |frac| >= 0.5
 * (v - trunc(v) is exact, unlike the floor(v + 0.5) shortcut). */
INLINE __m256 round_half_away(__m256 v) {
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m256 frac = _mm256_andnot_ps(sign_mask, _mm256_sub_ps(v, t));
    __m256 step = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(sign_mask, v));
    return _mm256_add_ps(t, _mm256_and_ps(step, _mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ)));
}

/* One block of 32 floats to int8 (the reference's arithmetic: d = max|x| / 127, q = round half
 * away of x * (1/d) in float32), packed in order at qs; q[] keeps the 32 values as 4 x 8 int32
 * for callers that sum them. Returns d. Shared by the activation quantizer and the q8_0 KV rows
 * (kernels_attn_avx2.c). */
INLINE float quantize_block32(const float *xb, int8_t *qs, __m256i q[4]) {
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[i]));
    }
    float d = hmax_ps(amax) / 127.0f;
    /* multiply by the float32 reciprocal (not divide): the same bits as the reference */
    __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    for (int i = 0; i < 4; i++)
        q[i] = _mm256_cvtps_epi32(round_half_away(_mm256_mul_ps(v[i], id)));
    /* pack 32 x s32 -> 32 x s8; packs works per 128-bit lane, so fix the dword order */
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)qs, p);
    return d;
}

static void quantize_act_avx2(const float *x, cf_act_q8 *out) {
    for (int b = 0; b < out->n / CF_QK; b++) {
        __m256i q[4];
        float d = quantize_block32(x + b * CF_QK, out->qs + b * CF_QK, q);
        int sum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
        out->d[b] = d;
        out->s[b] = d * (float)sum;
    }
}

/* ---- tiled mat-vec: one full 8-row group over the blocks of one tile --------------------- */

/* Two rows of a Q4 block at once: their 2 x 16 nibble bytes are adjacent (rows are stored one
 * after another in a chunk), so one 32-byte load holds both. lo = [row a w0..15 | row b w0..15],
 * hi = [row a w16..31 | row b w16..31]; against xa = x0..15 in both lanes and xb = x16..31 in
 * both lanes, maddubs + add (|sum of 4 products| <= 4*15*127, fits int16) + madd leave
 * [row a: 4 x s32 | row b: 4 x s32]. */
INLINE __m256i dot_q4_pair_unpacked(__m256i lo, __m256i hi, __m256i xa, __m256i xb) {
#if CF_ISA_VNNI
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, xa), hi, xb);
#else
    __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xb));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
}

/* The two rows' nibbles at q as bytes 0..15: *lo = weights 0..15, *hi = weights 16..31. */
INLINE void unpack_q4_pair(const uint8_t *q, __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256i v = _mm256_loadu_si256((const __m256i *)q);
    *lo = _mm256_and_si256(v, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
}

INLINE __m256i dot_q4_pair(const uint8_t *q, __m256i xa, __m256i xb) {
    __m256i lo, hi;
    unpack_q4_pair(q, &lo, &hi);
    return dot_q4_pair_unpacked(lo, hi, xa, xb);
}

/* The 8 row sums of a Q4 block of a full group (nibbles at q, 16 bytes per row), in row order:
 * three hadds fold the 4 pair vectors to [r0 r2 r4 r6 | r1 r3 r5 r7], one permute sorts. */
INLINE __m256i group_isum_q4(const uint8_t *q, __m256i xa, __m256i xb) {
    __m256i a = _mm256_hadd_epi32(dot_q4_pair(q, xa, xb), dot_q4_pair(q + 32, xa, xb));
    __m256i b = _mm256_hadd_epi32(dot_q4_pair(q + 64, xa, xb), dot_q4_pair(q + 96, xa, xb));
    return _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(a, b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Row i's 8 partial int32 dot sums for a Q8_0 block: |w| x sign(x, w) keeps maddubs' first
 * operand unsigned (|w| <= 128, |pair sum| <= 2*128*127 fits int16). */
INLINE __m256i dot_q8(const uint8_t *q, __m256i xq) {
    __m256i w = _mm256_loadu_si256((const __m256i *)q);
#if CF_ISA_VNNI
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w));
#else
    __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
}

INLINE __m256i group_isum_q8(const uint8_t *q, __m256i xq) {
    return hsum8_epi32(dot_q8(q, xq), dot_q8(q + 32, xq), dot_q8(q + 64, xq), dot_q8(q + 96, xq),
                       dot_q8(q + 128, xq), dot_q8(q + 160, xq), dot_q8(q + 192, xq), dot_q8(q + 224, xq));
}

/* Q5_0, Q5_1 and the K-quants: kq_group_dot, kq_matmat_groups, quantize_act_k_avx2. */
#include "kernels_kquant_avx2.c"

/* acc (lane i = row i) += W[8 rows, tile blocks] . x[tile blocks] for one group's chunks at p. */
INLINE __m256 group_dot(int dtype, const uint8_t *p, int nkt, const cf_act_q8 *x, int kb0) {
    if (KQ_DTYPE(dtype)) return kq_group_dot(dtype, p, nkt, x, kb0);
    __m256 acc = _mm256_setzero_ps();
    const int8_t *xq = x->qs + (size_t)kb0 * CF_QK;
    const float *xd = x->d + kb0, *xs = x->s + kb0;
    for (int kb = 0; kb < nkt; kb++) {
        const int8_t *xk = xq + kb * CF_QK;
        __m256 bd = _mm256_broadcast_ss(xd + kb);
        if (dtype == CF_Q4_0) { /* chunk: 8 x fp16 d, 8 x 16 nibble bytes (144 B) */
            __m256i xa = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)xk));
            __m256i xb = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xk + 16)));
            __m256 d = load_halves8(p);
            __m256i isum = group_isum_q4(p + 16, xa, xb);
            __m256 neg8s = _mm256_mul_ps(_mm256_broadcast_ss(xs + kb), _mm256_set1_ps(-8.0f));
            acc = _mm256_fmadd_ps(d, _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), bd, neg8s), acc);
            p += 144;
        } else if (dtype == CF_Q4_1) { /* 8 x fp16 d, 8 x fp16 m, 8 x 16 nibble bytes (160 B) */
            __m256i xa = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)xk));
            __m256i xb = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xk + 16)));
            __m256 d = load_halves8(p), m = load_halves8(p + 16);
            __m256i isum = group_isum_q4(p + 32, xa, xb);
            acc = _mm256_fmadd_ps(d, _mm256_mul_ps(_mm256_cvtepi32_ps(isum), bd), acc);
            acc = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xs + kb), acc);
            p += 160;
        } else { /* Q8_0: 8 x fp16 d, 8 x 32 int8 (272 B) */
            __m256i xv = _mm256_loadu_si256((const __m256i *)xk);
            __m256 d = load_halves8(p);
            __m256i isum = group_isum_q8(p + 16, xv);
            acc = _mm256_fmadd_ps(d, _mm256_mul_ps(_mm256_cvtepi32_ps(isum), bd), acc);
            p += 272;
        }
    }
    return acc;
}

/* The default mode's prefetch distance of the mat-vec (and gate/up) for every dtype: 8 KiB, as
 * Q6_K had on its own (KQ_Q6K_AHEAD). Measured 2026-11-30 on the Zen 5 VM, one process switching
 * Engine.prefetch between steps, tokens/s off -> 4096 -> 8192 -> 16384 B: the ~1B Q4_0 model at
 * 1 thread 46.6 -> 51.8 -> 54.1 -> 55.8, at 2 threads 86.6 -> 95.0 -> 101.6 -> 98.8; SmolLM2 Q4_1
 * 299.7 -> 336.9 -> 366.1 -> 369.9 and 445.6 -> 539.7 -> 596.5 -> 587.9. The hardware prefetcher
 * alone leaves a single core's stream short of the read bandwidth (claim C6). */
#define MATVEC_AHEAD 8192

/* out[r - g0*8] for the rows of groups [g0, g1); full groups here, the short last group (if
 * any) through the reference. Software prefetch (cf_prefetch_ahead) one group ahead of each
 * group's read: the distance of the mode, or in the default mode MATVEC_AHEAD. */
INLINE void matvec_groups(int dtype, const cf_tiled *w, const cf_act_q8 *x, float *out, int g0,
                          int g1) {
    int g1_full = cf_min(g1, w->rows / CF_G);
    size_t bb = cf_block_bytes(dtype);
    int pf = cf_prefetch_distance(MATVEC_AHEAD);
    const uint8_t *end = pf ? cf_tiled_end(w) : NULL;
    if (g0 < g1_full) {
        memset(out, 0, sizeof(float) * (size_t)(g1_full - g0) * CF_G);
        cf_span sp;
        for (cf_span_begin(&sp, w, g0, g1_full); cf_span_next(&sp);) {
            const uint8_t *p = sp.ptr;
            size_t group_bytes = (size_t)CF_G * sp.nkt * bb;
            for (int gr = sp.ga; gr < sp.gb; gr++, p += group_bytes) {
                cf_prefetch_ahead(pf, p, group_bytes, end);
                float *o = out + (size_t)(gr - g0) * CF_G;
                __m256 acc = group_dot(dtype, p, sp.nkt, x, sp.kb0);
                _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc));
            }
        }
    }
    if (g1 > g1_full && g1 > g0) {
        int gs = cf_max(g0, g1_full);
        cf_matvec_groups_ref(w, x, out + (size_t)(gs - g0) * CF_G, gs, g1);
    }
}

#define DEFINE_MATVEC(NAME, DT)                                                                \
    static void NAME(const cf_tiled *w, const cf_act_q8 *x, float *y, int g0, int g1) {        \
        matvec_groups(DT, w, x, y + (size_t)g0 * CF_G, g0, g1);                                \
    }
DEFINE_MATVEC(matvec_q4_0_avx2, CF_Q4_0)
DEFINE_MATVEC(matvec_q4_1_avx2, CF_Q4_1)
DEFINE_MATVEC(matvec_q8_0_avx2, CF_Q8_0)
DEFINE_MATVEC(matvec_q5_0_avx2, CF_Q5_0)
DEFINE_MATVEC(matvec_q5_1_avx2, CF_Q5_1)
DEFINE_MATVEC(matvec_q4_k_avx2, CF_Q4_K)
DEFINE_MATVEC(matvec_q5_k_avx2, CF_Q5_K)
DEFINE_MATVEC(matvec_q6_k_avx2, CF_Q6_K)

/* ---- tiled mat-mat (prefill): each weight block decoded once for many activations -------- */

/* Two paths. Q4 tiles of <= MM_KT blocks (the default 256 columns): q4_groups_mm unpacks up to
 * MM_GB groups of a tile into an L1 buffer once and runs every activation over it. Q8_0, and
 * Q4 tiles wider than the buffer: group_dot_mm, MM_NB activations per pass over one group. */
#ifndef MM_NB
#define MM_NB 4 /* 8 weight vectors + 4 accumulators + scales nearly fill the 16 ymm registers */
#endif
#if MM_NB < 3 || MM_NB > 6
#error "MM_NB must be 3..6"
#endif

/* Rows of a transposed Q4 block, lane by lane (see load_q4_block_t). */
#define MM_ROW_ORDER _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)
/* Lane i of this permutation of a transposed-order vector holds row i again. */
#define MM_ROW_UNDO _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)

/* A full group's Q4 block (8 rows x 16 nibble bytes at q), transposed so that one vpdpbusd
 * against 4 broadcast activation bytes gives each row's partial sum in its own 32-bit lane: no
 * horizontal fold per activation. Each pair load holds rows (2j | 2j+1); a 4x4 dword transpose
 * within the 128-bit lanes of the 4 loads leaves R_k = bytes 4k..4k+3 of rows
 * [0 2 4 6 | 1 3 5 7] (MM_ROW_ORDER). v[k] = low nibbles of R_k (weights 4k..4k+3) and
 * v[4+k] = high nibbles (weights 16+4k..16+4k+3), so v[t] pairs with activation dword t. */
INLINE void load_q4_block_t(const uint8_t *q, __m256i v[8]) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256i a = _mm256_loadu_si256((const __m256i *)q), b = _mm256_loadu_si256((const __m256i *)(q + 32));
    __m256i c = _mm256_loadu_si256((const __m256i *)(q + 64)), d = _mm256_loadu_si256((const __m256i *)(q + 96));
    __m256i t0 = _mm256_unpacklo_epi32(a, b), t1 = _mm256_unpacklo_epi32(c, d);
    __m256i t2 = _mm256_unpackhi_epi32(a, b), t3 = _mm256_unpackhi_epi32(c, d);
    __m256i r[4] = {_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1),
                    _mm256_unpacklo_epi64(t2, t3), _mm256_unpackhi_epi64(t2, t3)};
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_and_si256(r[k], m4);
        v[4 + k] = _mm256_and_si256(_mm256_srli_epi16(r[k], 4), m4);
    }
}

/* The 8 row sums (MM_ROW_ORDER lanes) of a transposed Q4 block against 32 activation int8s. */
INLINE __m256i isum_q4_t(const __m256i v[8], const int8_t *xk) {
    const int32_t *x4 = (const int32_t *)xk; /* 8 dwords of 4 int8 each */
#if CF_ISA_VNNI
    /* two chains halve the dependent vpdpbusd latency */
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int t = 0; t < 8; t += 2) {
        s0 = _mm256_dpbusd_avx_epi32(s0, v[t], _mm256_set1_epi32(x4[t]));
        s1 = _mm256_dpbusd_avx_epi32(s1, v[t + 1], _mm256_set1_epi32(x4[t + 1]));
    }
    return _mm256_add_epi32(s0, s1);
#else
    /* each int16 lane sums 8 pairs of 2 products: |16 * 15 * 127| = 30480 fits int16 */
    __m256i s = _mm256_maddubs_epi16(v[0], _mm256_set1_epi32(x4[0]));
    for (int t = 1; t < 8; t++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(v[t], _mm256_set1_epi32(x4[t])));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}

/* acc[b] (lane i = row i) = the tile's share of W[8 rows] . xs[b] for b < NB. Each row sees
 * exactly the float operations of group_dot (Q4 lanes run in MM_ROW_ORDER and are put back at
 * the end), so the values are the mat-vec's bit for bit, but every Q4 block is loaded,
 * transposed, unpacked and its scales converted once for all NB activations. */
INLINE void group_dot_mm(int NB, int dtype, const uint8_t *p, int nkt, const cf_act_q8 *xs,
                         int kb0, __m256 *acc) {
    const int8_t *xq[MM_NB];
    const float *xd[MM_NB], *xsum[MM_NB];
    for (int b = 0; b < NB; b++) {
        acc[b] = _mm256_setzero_ps();
        xq[b] = xs[b].qs + (size_t)kb0 * CF_QK;
        xd[b] = xs[b].d + kb0;
        xsum[b] = xs[b].s + kb0;
    }
    for (int kb = 0; kb < nkt; kb++) {
        if (dtype == CF_Q8_0) { /* signed weights: the sign trick needs each x; share d only */
            __m256 d = load_halves8(p);
            for (int b = 0; b < NB; b++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq[b] + kb * CF_QK));
                __m256i isum = group_isum_q8(p + 16, xv);
                __m256 bd = _mm256_broadcast_ss(xd[b] + kb);
                acc[b] = _mm256_fmadd_ps(d, _mm256_mul_ps(_mm256_cvtepi32_ps(isum), bd), acc[b]);
            }
            p += 272;
            continue;
        }
        const int q41 = dtype == CF_Q4_1;
        __m256 d = _mm256_permutevar8x32_ps(load_halves8(p), MM_ROW_ORDER);
        __m256 m = q41 ? _mm256_permutevar8x32_ps(load_halves8(p + 16), MM_ROW_ORDER) : _mm256_setzero_ps();
        __m256i v[8];
        load_q4_block_t(p + (q41 ? 32 : 16), v);
        for (int b = 0; b < NB; b++) {
            __m256 fsum = _mm256_cvtepi32_ps(isum_q4_t(v, xq[b] + kb * CF_QK));
            __m256 bd = _mm256_broadcast_ss(xd[b] + kb);
            if (q41) {
                acc[b] = _mm256_fmadd_ps(d, _mm256_mul_ps(fsum, bd), acc[b]);
                acc[b] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xsum[b] + kb), acc[b]);
            } else {
                __m256 neg8s = _mm256_mul_ps(_mm256_broadcast_ss(xsum[b] + kb), _mm256_set1_ps(-8.0f));
                acc[b] = _mm256_fmadd_ps(d, _mm256_fmadd_ps(fsum, bd, neg8s), acc[b]);
            }
        }
        p += q41 ? 160 : 144;
    }
    if (dtype != CF_Q8_0)
        for (int b = 0; b < NB; b++) acc[b] = _mm256_permutevar8x32_ps(acc[b], MM_ROW_UNDO);
}

#ifndef MM_GB
#define MM_GB 6 /* Q4 groups unpacked together (6 accumulators + 8 activation dwords in registers;
                 * measured ~4% faster than 4 on Zen 5, SmolLM2 shapes) */
#endif
#if MM_GB < 4 || MM_GB > 6
#error "MM_GB must be 4..6"
#endif
#define MM_KT 16 /* most blocks per tile row the unpacked buffer holds (tile_cols <= 512):
                  * MM_GB * 16 * 256 B = 24 KiB of transposed nibbles, in L1 */

/* The 8 row sums (MM_ROW_ORDER lanes) of transposed block v against activation dwords xb[8]
 * (each broadcast to all lanes). */
INLINE __m256i isum_q4_tx(const __m256i *v, const __m256i *xb) {
#if CF_ISA_VNNI
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int t = 0; t < 8; t += 2) {
        s0 = _mm256_dpbusd_avx_epi32(s0, v[t], xb[t]);
        s1 = _mm256_dpbusd_avx_epi32(s1, v[t + 1], xb[t + 1]);
    }
    return _mm256_add_epi32(s0, s1);
#else
    __m256i s = _mm256_maddubs_epi16(v[0], xb[0]); /* int16 bound: see isum_q4_t */
    for (int t = 1; t < 8; t++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(v[t], xb[t]));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}

/* NG (<= MM_GB) full Q4 groups of one tile (the first at p, group_bytes apart; nkt <= MM_KT
 * blocks) against all B activations: the groups' blocks are transposed, unpacked and their
 * scales converted ONCE into an L1 buffer, then each activation's 8 broadcast dwords per block
 * serve all NG groups. out + b*ldo: the first group's 8 rows of activation b (+= the tile's
 * share). Per row the float operations are group_dot's, so the results are the mat-vec's. */
INLINE void q4_groups_mm(int NG, int dtype, const uint8_t *p, size_t group_bytes, int nkt,
                         const cf_act_q8 *xs, int B, int kb0, float *out, int ldo) {
    const int q41 = dtype == CF_Q4_1;
    const size_t chunk = q41 ? 160 : 144;
    __m256i V[MM_GB * MM_KT * 8]; /* [group][block][8]: 16 KiB */
    __m256 D[MM_GB * MM_KT], M[MM_GB * MM_KT];
    for (int g = 0; g < NG; g++)
        for (int kb = 0; kb < nkt; kb++) {
            const uint8_t *c = p + g * group_bytes + kb * chunk;
            int i = g * MM_KT + kb;
            D[i] = _mm256_permutevar8x32_ps(load_halves8(c), MM_ROW_ORDER);
            if (q41) M[i] = _mm256_permutevar8x32_ps(load_halves8(c + 16), MM_ROW_ORDER);
            load_q4_block_t(c + (q41 ? 32 : 16), &V[(size_t)i * 8]);
        }
    for (int b = 0; b < B; b++) {
        const int8_t *xq = xs[b].qs + (size_t)kb0 * CF_QK;
        const float *xd = xs[b].d + kb0, *xsum = xs[b].s + kb0;
        __m256 acc[MM_GB];
        for (int g = 0; g < NG; g++) acc[g] = _mm256_setzero_ps();
        for (int kb = 0; kb < nkt; kb++) {
            const int32_t *x4 = (const int32_t *)(xq + kb * CF_QK);
            __m256i xb[8];
            for (int t = 0; t < 8; t++) xb[t] = _mm256_set1_epi32(x4[t]);
            __m256 bd = _mm256_broadcast_ss(xd + kb), bs = _mm256_broadcast_ss(xsum + kb);
            __m256 neg8s = _mm256_mul_ps(bs, _mm256_set1_ps(-8.0f));
            for (int g = 0; g < NG; g++) {
                int i = g * MM_KT + kb;
                __m256 fsum = _mm256_cvtepi32_ps(isum_q4_tx(&V[(size_t)i * 8], xb));
                if (q41) {
                    acc[g] = _mm256_fmadd_ps(D[i], _mm256_mul_ps(fsum, bd), acc[g]);
                    acc[g] = _mm256_fmadd_ps(M[i], bs, acc[g]);
                } else {
                    acc[g] = _mm256_fmadd_ps(D[i], _mm256_fmadd_ps(fsum, bd, neg8s), acc[g]);
                }
            }
        }
        for (int g = 0; g < NG; g++) {
            float *o = out + (size_t)b * ldo + g * CF_G;
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), _mm256_permutevar8x32_ps(acc[g], MM_ROW_UNDO)));
        }
    }
}

#if CF_ISA_VNNI
/* Q8_0 through q8_groups_mm from this many activations on; below it the per-activation
 * group_dot_mm is faster (the transposition costs ~5 activations' dots; measured, SmolLM2's
 * 49152 x 576 lm_head on Zen 5: B = 4 0.75x, B = 8 1.2x, B >= 12 ~2x). Either path gives the
 * mat-vec's values, so the choice never changes a result. */
#define MM_Q8T_MIN_B 8
/* A full group's Q8_0 block (8 rows x 32 int8 at q), transposed (an 8x8 dword transpose) so that
 * lane i of v[t] holds bytes 4t..4t+3 of row i, in row order, and offset by +128 (XOR 0x80) so
 * the weights are the unsigned operand of vpdpbusd. */
INLINE void load_q8_block_t(const uint8_t *q, __m256i v[8]) {
    __m256i a[8];
    for (int r = 0; r < 8; r++) a[r] = _mm256_loadu_si256((const __m256i *)(q + 32 * r));
    transpose8x8_epi32(a, v);
    const __m256i x80 = _mm256_set1_epi8((char)0x80);
    for (int k = 0; k < 8; k++) v[k] = _mm256_xor_si256(v[k], x80);
}

/* q4_groups_mm for Q8_0 (VNNI only: the u8 x s8 products of weights + 128 need vpdpbusd's int32
 * accumulation, maddubs would saturate): each group's blocks are transposed once for all B
 * activations; a row's integer sum is sum((w + 128) x) - 128 sum(x), exactly group_isum_q8's, and
 * the float operations are group_dot's, so the results are the mat-vec's bit for bit. */
INLINE void q8_groups_mm(int NG, const uint8_t *p, size_t group_bytes, int nkt, const cf_act_q8 *xs, int B,
                         int kb0, float *out, int ldo) {
    __m256i V[MM_GB * MM_KT * 8];
    __m256 D[MM_GB * MM_KT];
    for (int g = 0; g < NG; g++)
        for (int kb = 0; kb < nkt; kb++) {
            const uint8_t *c = p + g * group_bytes + kb * 272;
            int i = g * MM_KT + kb;
            D[i] = load_halves8(c);
            load_q8_block_t(c + 16, &V[(size_t)i * 8]);
        }
    const __m256i ones = _mm256_set1_epi8(1);
    for (int b = 0; b < B; b++) {
        const int8_t *xq = xs[b].qs + (size_t)kb0 * CF_QK;
        const float *xd = xs[b].d + kb0;
        __m256 acc[MM_GB];
        for (int g = 0; g < NG; g++) acc[g] = _mm256_setzero_ps();
        for (int kb = 0; kb < nkt; kb++) {
            const int32_t *x4 = (const int32_t *)(xq + kb * CF_QK);
            __m256i xb[8];
            for (int t = 0; t < 8; t++) xb[t] = _mm256_set1_epi32(x4[t]);
            /* 128 * sum(x), in every lane */
            __m256i s4 = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ones,
                                                 _mm256_loadu_si256((const __m256i *)(xq + kb * CF_QK)));
            __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
            s2 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0x4e));
            s2 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xb1));
            __m256i corr = _mm256_slli_epi32(_mm256_broadcastd_epi32(s2), 7);
            __m256 bd = _mm256_broadcast_ss(xd + kb);
            for (int g = 0; g < NG; g++) {
                const __m256i *v = &V[(size_t)(g * MM_KT + kb) * 8];
                __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
                for (int t = 0; t < 8; t += 2) {
                    s0 = _mm256_dpbusd_avx_epi32(s0, v[t], xb[t]);
                    s1 = _mm256_dpbusd_avx_epi32(s1, v[t + 1], xb[t + 1]);
                }
                __m256i isum = _mm256_sub_epi32(_mm256_add_epi32(s0, s1), corr);
                acc[g] = _mm256_fmadd_ps(D[g * MM_KT + kb], _mm256_mul_ps(_mm256_cvtepi32_ps(isum), bd), acc[g]);
            }
        }
        for (int g = 0; g < NG; g++) {
            float *o = out + (size_t)b * ldo + g * CF_G;
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc[g]));
        }
    }
}
#endif

/* out[b*ldo + r - g0*8] for the rows of groups [g0, g1) and activations b < B. Walks each tile
 * share once (band, tile, group, as the mat-vec does) and runs all B activations over a group's
 * chunks while they sit in L1; the short last group goes through the reference. With a prefetch
 * distance, each run of groups read from memory (1 or ng of them) prefetches ahead first. */
INLINE void matmat_groups(int dtype, const cf_tiled *w, const cf_act_q8 *xs, int B, float *out,
                          int ldo, int g0, int g1) {
    if (KQ_DTYPE(dtype)) {
        kq_matmat_groups(dtype, w, xs, B, out, ldo, g0, g1);
        return;
    }
    int g1_full = cf_min(g1, w->rows / CF_G);
    size_t bb = cf_block_bytes(dtype);
    int pf = cf_prefetch_distance(0);
    const uint8_t *end = pf ? cf_tiled_end(w) : NULL;
    if (g0 < g1_full) {
        for (int b = 0; b < B; b++)
            memset(out + (size_t)b * ldo, 0, sizeof(float) * (size_t)(g1_full - g0) * CF_G);
        cf_span sp;
        for (cf_span_begin(&sp, w, g0, g1_full); cf_span_next(&sp);) {
            const uint8_t *p = sp.ptr;
            size_t group_bytes = (size_t)CF_G * sp.nkt * bb;
            for (int gr = sp.ga; gr < sp.gb; gr++, p += group_bytes) {
                float *o = out + (size_t)(gr - g0) * CF_G;
#if CF_ISA_VNNI
                if (dtype == CF_Q8_0 && sp.nkt <= MM_KT && B >= MM_Q8T_MIN_B) { /* Q8_0 transposed */
                    int ng = cf_min(MM_GB, sp.gb - gr);
                    cf_prefetch_ahead(pf, p, (size_t)ng * group_bytes, end);
#define GB8_CASE(N) case N: q8_groups_mm(N, p, group_bytes, sp.nkt, xs, B, sp.kb0, o, ldo); break
                    switch (ng) {
                    GB8_CASE(1); GB8_CASE(2); GB8_CASE(3); GB8_CASE(4);
#if MM_GB > 4
                    GB8_CASE(5); GB8_CASE(6);
#endif
                    }
#undef GB8_CASE
                    gr += ng - 1;
                    p += (size_t)(ng - 1) * group_bytes;
                    continue;
                }
#endif
                if (dtype != CF_Q8_0 && sp.nkt <= MM_KT) { /* up to MM_GB groups at once */
                    int ng = cf_min(MM_GB, sp.gb - gr);
                    cf_prefetch_ahead(pf, p, (size_t)ng * group_bytes, end);
#define GB_CASE(N) case N: q4_groups_mm(N, dtype, p, group_bytes, sp.nkt, xs, B, sp.kb0, o, ldo); break
                    switch (ng) { /* constant NG per call: the group loop unrolls into registers */
                    GB_CASE(1); GB_CASE(2); GB_CASE(3); GB_CASE(4);
#if MM_GB > 4
                    GB_CASE(5); GB_CASE(6);
#endif
                    }
#undef GB_CASE
                    gr += ng - 1;
                    p += (size_t)(ng - 1) * group_bytes;
                    continue;
                }
                cf_prefetch_ahead(pf, p, group_bytes, end); /* one group, re-read per MM_NB from L1 */
                for (int b0 = 0; b0 < B; b0 += MM_NB) {
                    __m256 acc[MM_NB];
                    int nb = cf_min(MM_NB, B - b0);
                    /* constant NB per call so the activation loop unrolls into registers */
#define MM_CASE(N) case N: group_dot_mm(N, dtype, p, sp.nkt, xs + b0, sp.kb0, acc); break
                    switch (nb) {
                    MM_CASE(1); MM_CASE(2); MM_CASE(3);
#if MM_NB >= 4
                    MM_CASE(4);
#endif
#if MM_NB >= 5
                    MM_CASE(5);
#endif
#if MM_NB >= 6
                    MM_CASE(6);
#endif
                    }
#undef MM_CASE
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

#define DEFINE_MATMAT(NAME, DT)                                                                \
    static void NAME(const cf_tiled *w, const cf_act_q8 *xs, int B, float *y, int ldy, int g0,  \
                     int g1) {                                                                 \
        matmat_groups(DT, w, xs, B, y + (size_t)g0 * CF_G, ldy, g0, g1);                       \
    }
DEFINE_MATMAT(matmat_q4_0_avx2, CF_Q4_0)
DEFINE_MATMAT(matmat_q4_1_avx2, CF_Q4_1)
DEFINE_MATMAT(matmat_q8_0_avx2, CF_Q8_0)
DEFINE_MATMAT(matmat_q5_0_avx2, CF_Q5_0)
DEFINE_MATMAT(matmat_q5_1_avx2, CF_Q5_1)
DEFINE_MATMAT(matmat_q4_k_avx2, CF_Q4_K)
DEFINE_MATMAT(matmat_q5_k_avx2, CF_Q5_K)
DEFINE_MATMAT(matmat_q6_k_avx2, CF_Q6_K)

/* ---- fused gate+up+SiLU ------------------------------------------------------------------ */

CF_DEFINE_GATE_UP(gate_up, matvec_groups)

#define GATE_UP_MM_NB 64    /* activations per pass (the engine's default batch): each Q4
                             * block is unpacked once per 64 */
#define GATE_UP_MM_PAIRS 8 /* pairs per pass: the gate/up scratch is 64 x 128 floats, 32 KiB */

/* gate_up for B activations: passes of pairs cut at band edges like gate_up's (a row's sum
 * depends only on its tiles' order, so any pass size gives the mat-vec's values), each pass run
 * for GATE_UP_MM_NB activations at a time through matmat_groups. */
INLINE void gate_up_mm(int dtype, const cf_tiled *w, const cf_act_q8 *xs, int B, float *y,
                       int ldy, int p0, int p1) {
    enum { LD = 2 * CF_G * GATE_UP_MM_PAIRS };
    float gu[GATE_UP_MM_NB * LD]; /* [b][pair][gate 8, up 8] */
    int gpb = w->tile_rows / CF_G;
    for (int p = p0; p < p1;) {
        int band_end_pair = ((2 * p) / gpb + 1) * gpb / 2;
        int pe = cf_min(cf_min(p1, p + GATE_UP_MM_PAIRS), cf_max(p + 1, band_end_pair));
        for (int b0 = 0; b0 < B; b0 += GATE_UP_MM_NB) {
            int nb = cf_min(GATE_UP_MM_NB, B - b0);
            matmat_groups(dtype, w, xs + b0, nb, gu, LD, 2 * p, 2 * pe);
            for (int b = 0; b < nb; b++) {
                const float *gb = gu + (size_t)b * LD;
                float *yb = y + (size_t)(b0 + b) * ldy;
                for (int j = 0; j < pe - p; j++) {
                    __m256 g = _mm256_loadu_ps(gb + 16 * j), u = _mm256_loadu_ps(gb + 16 * j + 8);
                    _mm256_storeu_ps(yb + (size_t)(p + j) * CF_G, _mm256_mul_ps(silu_ps(g), u));
                }
            }
        }
        p = pe;
    }
}

#define DEFINE_GATE_UP_MM(NAME, DT)                                                            \
    static void NAME(const cf_tiled *w, const cf_act_q8 *xs, int B, float *y, int ldy, int p0,  \
                     int p1) {                                                                 \
        gate_up_mm(DT, w, xs, B, y, ldy, p0, p1);                                              \
    }
DEFINE_GATE_UP_MM(gate_up_mm_q4_0_avx2, CF_Q4_0)
DEFINE_GATE_UP_MM(gate_up_mm_q4_1_avx2, CF_Q4_1)
DEFINE_GATE_UP_MM(gate_up_mm_q8_0_avx2, CF_Q8_0)
DEFINE_GATE_UP_MM(gate_up_mm_q5_0_avx2, CF_Q5_0)
DEFINE_GATE_UP_MM(gate_up_mm_q5_1_avx2, CF_Q5_1)
DEFINE_GATE_UP_MM(gate_up_mm_q4_k_avx2, CF_Q4_K)
DEFINE_GATE_UP_MM(gate_up_mm_q5_k_avx2, CF_Q5_K)
DEFINE_GATE_UP_MM(gate_up_mm_q6_k_avx2, CF_Q6_K)

#define DEFINE_GATE_UP(NAME, DT)                                                               \
    static void NAME(const cf_tiled *w, const cf_act_q8 *x, float *y, int p0, int p1) {        \
        gate_up(DT, w, x, y, p0, p1);                                                          \
    }
DEFINE_GATE_UP(gate_up_q4_0_avx2, CF_Q4_0)
DEFINE_GATE_UP(gate_up_q4_1_avx2, CF_Q4_1)
DEFINE_GATE_UP(gate_up_q8_0_avx2, CF_Q8_0)
DEFINE_GATE_UP(gate_up_q5_0_avx2, CF_Q5_0)
DEFINE_GATE_UP(gate_up_q5_1_avx2, CF_Q5_1)
DEFINE_GATE_UP(gate_up_q4_k_avx2, CF_Q4_K)
DEFINE_GATE_UP(gate_up_q5_k_avx2, CF_Q5_K)
DEFINE_GATE_UP(gate_up_q6_k_avx2, CF_Q6_K)

/* ---- embedding row ----------------------------------------------------------------------- */

static void embed_row_avx2(const cf_tiled *w, int r, float *out) {
    if (KQ_DTYPE(w->dtype)) { /* one row per token, off the hot path: the reference's bits */
        cf_embed_row_ref(w, r, out);
        return;
    }
    size_t bb = cf_block_bytes(w->dtype);
    int gr = r / CF_G, i = r % CF_G, g = cf_min(CF_G, w->rows - gr * CF_G);
    size_t qs_bytes = cf_qs_bytes(w->dtype), qs_off = cf_chunk_qs_offset(w->dtype, g);
    cf_span sp;
    for (cf_span_begin(&sp, w, gr, gr + 1); cf_span_next(&sp);) {
        for (int kb = 0; kb < sp.nkt; kb++) {
            const uint8_t *chunk = sp.ptr + (size_t)kb * g * bb;
            const cf_half *scales = (const cf_half *)chunk;
            const uint8_t *q = chunk + qs_off + (size_t)i * qs_bytes;
            __m256 d = _mm256_set1_ps(cf_half_to_float(scales[i]));
            float *o = out + (size_t)(sp.kb0 + kb) * CF_QK;
            if (w->dtype == CF_Q8_0) {
                for (int j = 0; j < 4; j++) {
                    __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * j)));
                    _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(d, _mm256_cvtepi32_ps(v)));
                }
            } else {
                float mf = w->dtype == CF_Q4_1 ? cf_half_to_float(scales[g + i])
                                               : -8.0f * cf_half_to_float(scales[i]);
                __m256 m = _mm256_set1_ps(mf);
                __m256i b = bytes_from_nibbles(q);
                __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
                __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
                for (int j = 0; j < 4; j++) {
                    __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]));
                    _mm256_storeu_ps(o + 8 * j, _mm256_fmadd_ps(d, v, m));
                }
            }
        }
    }
}

/* ---- fp32 vector kernels ----------------------------------------------------------------- */

static float dot_f32_avx2(const float *a, const float *b, int n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float s = hsum_ps(_mm256_add_ps(s0, s1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Row-major fp32 weights (the MoE router, the shared-expert gate): with a prefetch distance,
 * each row prefetches ahead before it is read, like the tiled kernels' groups. */
static void matvec_f32_avx2(float *y, const float *W, const float *x, int rows, int cols) {
    int pf = cf_prefetch_distance(0);
    size_t row_bytes = sizeof(float) * (size_t)cols;
    const uint8_t *end = (const uint8_t *)W + row_bytes * (size_t)rows;
    for (int r = 0; r < rows; r++) {
        cf_prefetch_ahead(pf, (const uint8_t *)(W + (size_t)r * cols), row_bytes, end);
        y[r] = dot_f32_avx2(W + (size_t)r * cols, x, cols);
    }
}

static void rmsnorm_avx2(float *out, const float *x, const float *w, int n, float eps) {
    float ss = dot_f32_avx2(x, x, n);
    __m256 inv = _mm256_set1_ps(1.0f / sqrtf(ss / (float)n + eps));
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv),
                                                _mm256_loadu_ps(w + i)));
    float invs = _mm256_cvtss_f32(inv);
    for (; i < n; i++) out[i] = x[i] * invs * w[i];
}

static void softmax_avx2(float *x, int n) {
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + i));
    float mx = hmax_ps(vmax);
    for (; i < n; i++) mx = fmaxf(mx, x[i]);
    __m256 vm = _mm256_set1_ps(mx), vsum = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
        __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        _mm256_storeu_ps(x + i, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum_ps(vsum);
    for (; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
    for (; i < n; i++) x[i] *= 1.0f / sum;
}

static void rope_avx2(float *x, int n_heads, int head_dim, const float *cos, const float *sin) {
    int half = head_dim / 2;
    for (int h = 0; h < n_heads; h++) {
        float *a = x + (size_t)h * head_dim, *b = a + half;
        int j = 0;
        for (; j + 8 <= half; j += 8) {
            __m256 va = _mm256_loadu_ps(a + j), vb = _mm256_loadu_ps(b + j);
            __m256 c = _mm256_loadu_ps(cos + j), s = _mm256_loadu_ps(sin + j);
            _mm256_storeu_ps(a + j, _mm256_fmsub_ps(va, c, _mm256_mul_ps(vb, s)));
            _mm256_storeu_ps(b + j, _mm256_fmadd_ps(va, s, _mm256_mul_ps(vb, c)));
        }
        for (; j < half; j++) {
            float va = a[j], vb = b[j];
            a[j] = va * cos[j] - vb * sin[j];
            b[j] = va * sin[j] + vb * cos[j];
        }
    }
}

/* ---- attention ----------------------------------------------------------------------------- */

/* Scores of NH query heads (sharing one kv head) against positions [0, n_pos): each K row is
 * converted once and used by all NH heads. att_h[t] = scale * q_h . k_t. */
INLINE void attn_scores(int NH, const float *q, const cf_half *K, float *att, int hd, int n_pos,
                        float scale) {
    for (int t = 0; t < n_pos; t++) {
        const cf_half *kt = K + (size_t)t * hd;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int j = 0; j < hd; j += 8) {
            __m256 kf = load_halves8(kt + j);
            for (int h = 0; h < NH; h++)
                acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)h * hd + j), kf, acc[h]);
        }
        for (int h = 0; h < NH; h++) att[(size_t)h * n_pos + t] = hsum_ps(acc[h]) * scale;
    }
}

/* out_h = sum_t att_h[t] * v_t for NH heads; each V row converted once. */
INLINE void attn_values(int NH, float *out, const cf_half *V, const float *att, int hd, int n_pos) {
    for (int h = 0; h < NH; h++) memset(out + (size_t)h * hd, 0, sizeof(float) * (size_t)hd);
    for (int t = 0; t < n_pos; t++) {
        const cf_half *vt = V + (size_t)t * hd;
        __m256 p[4];
        for (int h = 0; h < NH; h++) p[h] = _mm256_broadcast_ss(att + (size_t)h * n_pos + t);
        for (int j = 0; j < hd; j += 8) {
            __m256 vf = load_halves8(vt + j);
            for (int h = 0; h < NH; h++) {
                float *o = out + (size_t)h * hd + j;
                _mm256_storeu_ps(o, _mm256_fmadd_ps(p[h], vf, _mm256_loadu_ps(o)));
            }
        }
    }
}

INLINE void attn_heads(int NH, float *out, const float *q, const cf_half *K, const cf_half *V,
                       float *att, const cf_attn_shape *s) {
    attn_scores(NH, q, K, att, s->head_dim, s->n_pos, s->scale);
    for (int h = 0; h < NH; h++) softmax_avx2(att + (size_t)h * s->n_pos, s->n_pos);
    attn_values(NH, out, V, att, s->head_dim, s->n_pos);
}

static void attention_avx2(float *out, const float *q, const cf_half *k, const cf_half *v,
                           float *att, const cf_attn_shape *s, int h0, int h1) {
    int hd = s->head_dim, group = s->n_heads / s->n_kv_heads;
    if (hd % 8 != 0) {
        cf_attention_ref(out, q, k, v, att, s, h0, h1);
        return;
    }
    for (int h = h0; h < h1;) {
        int kvh = h / group;
        int nh = cf_min(cf_min(h1, (kvh + 1) * group) - h, 4); /* heads of this kv head, <= 4 */
        size_t kv_off = (size_t)kvh * s->max_seq * hd;
        float *o = out + (size_t)h * hd, *a = att + (size_t)(h - h0) * s->n_pos;
        const float *qh = q + (size_t)h * hd;
        /* constant NH per call so the per-head loops unroll and stay in registers */
        switch (nh) {
        case 1: attn_heads(1, o, qh, k + kv_off, v + kv_off, a, s); break;
        case 2: attn_heads(2, o, qh, k + kv_off, v + kv_off, a, s); break;
        case 3: attn_heads(3, o, qh, k + kv_off, v + kv_off, a, s); break;
        default: attn_heads(4, o, qh, k + kv_off, v + kv_off, a, s); break;
        }
        h += nh;
    }
}

/* attention_block_avx2: the prefill form of the above, over a block of queries */
#include "kernels_attn_avx2.c"

/* ---- fp16 conversion (K/V into the cache) ------------------------------------------------ */

static void f32_to_f16_avx2(cf_half *out, const float *x, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) out[i] = cf_float_to_half(x[i]);
}

/* ---- top-k --------------------------------------------------------------------------------- */

/* k passes of a vector max over a private copy, each taken entry replaced by NaN: the max below
 * has the loaded vector first, so NaN lanes never win, and an equality scan finds the lowest
 * index holding the max, as the reference's strict ">" does. Inputs are NaN-free (contract). */
#define TOPK_MAX_N 256
static void topk_avx2(const float *x, int n, int k, int *idx, float *val) {
    if (n > TOPK_MAX_N) { /* routers have far fewer experts; no stack copy for the rare case */
        cf_topk(x, n, k, idx, val);
        return;
    }
    float buf[TOPK_MAX_N];
    memcpy(buf, x, (size_t)n * sizeof(float));
    for (int j = 0; j < k; j++) {
        __m256 m = _mm256_set1_ps(-INFINITY);
        int i = 0;
        for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_loadu_ps(buf + i), m);
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        float best = _mm_cvtss_f32(h);
        for (; i < n; i++)
            if (buf[i] > best) best = buf[i];
        int bi = -1;
        const __m256 vb = _mm256_set1_ps(best);
        for (i = 0; i + 8 <= n && bi < 0; i += 8) {
            int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(buf + i), vb, _CMP_EQ_OQ));
            if (mask) bi = i + __builtin_ctz((unsigned)mask);
        }
        for (; i < n && bi < 0; i++)
            if (buf[i] == best) bi = i;
        idx[j] = bi;
        val[j] = x[bi];
        buf[bi] = NAN;
    }
}

/* ---- the table --------------------------------------------------------------------------- */

#define ALL_QDTYPES(PRE)                                                                       \
    {[CF_Q4_0] = PRE##_q4_0_avx2, [CF_Q4_1] = PRE##_q4_1_avx2, [CF_Q5_0] = PRE##_q5_0_avx2,      \
     [CF_Q5_1] = PRE##_q5_1_avx2, [CF_Q8_0] = PRE##_q8_0_avx2, [CF_Q4_K] = PRE##_q4_k_avx2,      \
     [CF_Q5_K] = PRE##_q5_k_avx2, [CF_Q6_K] = PRE##_q6_k_avx2}

static const cf_kernel_table TABLE = {
    .name = CF_TABLE_NAME,
    .quantize_act = quantize_act_avx2,
    .matvec = ALL_QDTYPES(matvec),
    .rmsnorm = rmsnorm_avx2,
    .matvec_f32 = matvec_f32_avx2,
    .gate_up = ALL_QDTYPES(gate_up),
    .softmax = softmax_avx2,
    .rope = rope_avx2,
    .attention = attention_avx2,
    .attention_block = attention_block_avx2,
    .embed_row = embed_row_avx2,
    .f32_to_f16 = f32_to_f16_avx2,
    .matmat = ALL_QDTYPES(matmat),
    .gate_up_mm = ALL_QDTYPES(gate_up_mm),
    .topk = topk_avx2,
    .quantize_act_k = quantize_act_k_avx2,
    .attention_q8kv = attention_q8kv_avx2,
    .attention_block_q8kv = attention_block_q8kv_avx2,
    .f32_to_q8_0 = f32_to_q8_0_avx2,
};

const cf_kernel_table *CF_TABLE_GETTER(void) { return &TABLE; }
