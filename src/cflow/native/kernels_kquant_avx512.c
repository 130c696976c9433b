/* kernels_kquant_avx512.c — the mat-vec (and fused gate/up) of the K-quant files' types (Q4_K,
 * Q5_K, Q6_K, and the 32-block Q5_0 / Q5_1 that llama.cpp writes at widths not a multiple of 256)
 * and of MXFP4 (gpt-oss's experts) on 512-bit registers
 * with AVX512-VNNI, for the avx512 table (kernels_avx512.c installs them: cf_kquant_avx512_install).
 *
 * Compiled with the avx512 object's flags (-mavx512f -mavx512bw -mavx512vl -mavx512vnni, no VBMI).
 * Why: at one thread the AVX2-family K-quant mat-vec is instruction-bound (docs/kquants.md,
 * "Speed": Q4_K at ~0.65 of Q4_0's GB/s from DRAM on Zen 5), and Zen 5 runs zmm at full width.
 * The tile layout is unchanged (row-major chunks of 8 rows); per row and super-block:
 *
 *   Q4_K  two 64-byte loads of qs; nibbles masked (and, shift + and): four vectors whose 256-bit
 *         halves are two sub-blocks of 32 ([0|2], [1|3], [4|6], [5|7]). vpdpbusd against the
 *         activation arranged the same way gives per dword a sum of 4 products (<= 4*15*127,
 *         fits int16); vpackssdw pairs two such vectors (exact), and one vpdpwssd applies the
 *         sub-block scales of 4 sub-blocks at once (the scale operand: one vpermw of the row's
 *         8 decoded scales). So 4 vpdpbusd + 2 vpdpwssd per 256 weights, against AVX2's
 *         8 maddubs + 8 madd (or vpdpwssd).
 *   Q5_K  Q4_K plus the 5th bit: one 32-byte broadcast of qh per row; per nibble vector one
 *         vprolvd (a per-half rotate brings bit t of every byte to bit 4) and one vpternlogd.
 *   Q6_K  two 64-byte loads of ql, two 32-byte broadcasts of qh; the two high bits shifted into
 *         place with one vpsllvw / vpsrlvw (the two 256-bit halves need different shifts) and
 *         merged with one vpternlogd. Each 128-bit lane is one sub-block of 16. The -32 of the
 *         weights is folded into vpdpbusd's accumulator: it starts from -32 * (the sum of each
 *         4 activations), computed once per super-block for all rows, so each dword is
 *         sum (q - 32) x over 4 weights (|.| <= 4*32*127, fits int16); vpackssdw + vpdpwssd
 *         with the int8 scales as for Q4_K.
 *   Q5_0 / Q5_1  four rows per zmm (q5_update512); per 32-weight block of the group 2 loads,
 *         the 5th bits as byte masks (vpshufb + vptestmb) added by a masked vpaddb, 4 vpdpbusd,
 *         a 5-instruction fold, then q5_update's float operations.
 *   MXFP4 four rows per zmm as Q5_0 (mx_update512): nibbles -> doubled E2M1 values + 12 (unsigned)
 *         by one vpshufb against the 16-entry table, 4 vpdpbusd started from -12 * (each 4
 *         activations) so the 12 * sum(x) of the block comes out inside the dot, the fold:
 *         kernels_kquant_avx2.inc's exact integers, then mx_update's float operations. Two
 *         blocks per step (mx_update512_pair): one more unpack level leaves both blocks' 16 row
 *         sums in one zmm, converted, scaled by dx and given their 2^(e - 128) (a masked shift
 *         for e < 2) as one vector each; the two fmas stay in block order. Measured
 *         (benchmarks/kquant_kernels.py, 1 thread, 2-core Zen 4 VM, the old build and the new
 *         alternated process by process, gpt-oss-20b's 5760x2880 and 2880x2880): GB/s from L2
 *         21.5 -> 26.8 (0.76 -> 0.94 of Q4_0's), from DRAM 0.85 -> 1.02-1.06 of Q4_0's. Forming
 *         the offsets once per tile share instead of per group was no faster.
 * The 8 rows' 16-dword partials are folded into one vector (lane i = row i) once per
 * super-block; then the float operations of kernels_kquant_avx2.inc's kq_finish_qd (and of
 * kernels_avx512.c's batched K-quant kernels) per row and super-block:
 *   acc = fma(d * dx, sum_qd, acc); Q4_K / Q5_K: acc = fnmadd(dmin * dx, sum_mb, acc)
 * on the same exact integers (docs/kquants.md, "The integer math"), so this mat-vec equals the
 * table's matmat bit for bit, and the AVX2-family mat-vec too. The short last group goes
 * through the reference, as everywhere. The batched kernels (matmat, gate_up_mm) stay
 * kernels_avx512.c's (and the base table's) except for small batches ("small batches" below).
 *
 * Measured (benchmarks/kquant_kernels.py --isa avxvnni avx512, in-process A/B, 1 thread, shared
 * Zen 5 VM, indicative): GB/s from L2, old -> new: Q4_K 32 -> 60, Q5_K 31 -> 52, Q6_K 35 -> 66
 * (Q4_0: 46); from DRAM (96 MB cycled): Q4_K 0.72 -> 1.04, Q5_K 0.66 -> 0.98, Q6_K 0.80 -> 1.06 of
 * Q4_0's GB/s on the same shape. Q5_0 / Q5_1 (1536x576, 2048x5632): L2 27 -> 52, DRAM 0.65 -> 1.06.
 *
 * Software prefetch as kernels_avx2.inc's matvec_groups: in the default mode 8 KiB ahead of each
 * group (cf_matvec_default_ahead there: 8 KiB, none on Zen 4, 2 KiB on Intel; Q6_K 8 KiB
 * everywhere), the mode's distance otherwise, none when off. Measured with these kernels
 * (indicative): off loses half of Q6_K's speed from DRAM; 4 / 8 / 16 KiB are alike for Q4_K;
 * PREFETCHT1 / T2 instead of T0 lose 15-20% on Q6_K; the ~1B Q4_K_M decode at 1 thread
 * (Engine.prefetch switched between steps) was fastest at the default 8 KiB.
 */
#include <immintrin.h>
#include <string.h>

#include "cflow.h"
#include "kernels_internal.h"
#include "kernels_ref.h"
#include "kquant_scales.h"
#include "simd_silu.h"

#define INLINE static inline __attribute__((always_inline))


void cf_kquant_avx512_install(cf_kernel_table *t, const cf_kernel_table *base);

/* ---- helpers ------------------------------------------------------------------------------ */

INLINE __m256 load_halves8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* Lane i = the sum of the 16 dwords of r[i]. */
INLINE __m256i fold8(const __m512i r[CF_G]) {
    __m512i a[4], b[2];
    for (int j = 0; j < 4; j++) /* per 128-bit lane [r_2j, r_2j+1, r_2j, r_2j+1] */
        a[j] = _mm512_add_epi32(_mm512_unpacklo_epi32(r[2 * j], r[2 * j + 1]),
                                _mm512_unpackhi_epi32(r[2 * j], r[2 * j + 1]));
    for (int j = 0; j < 2; j++) /* per 128-bit lane [r_4j .. r_4j+3] */
        b[j] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * j], a[2 * j + 1]),
                                _mm512_unpackhi_epi64(a[2 * j], a[2 * j + 1]));
    /* lanes [b0.0 + b0.1, b1.0 + b1.1, b0.2 + b0.3, b1.2 + b1.3], then the two halves added */
    __m512i c = _mm512_add_epi32(_mm512_shuffle_i32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_i32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
    c = _mm512_shuffle_i32x4(c, c, _MM_SHUFFLE(3, 1, 2, 0));
    return _mm256_add_epi32(_mm512_castsi512_si256(c), _mm512_extracti64x4_epi64(c, 1));
}

/* The 8 row sums of 4 row-pair vectors [row 2j: 4 x s32 | row 2j+1: 4 x s32] (kernels_kquant_avx2.inc). */
INLINE __m256i fold_pairs(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
    __m256i a = _mm256_hadd_epi32(p0, p1), b = _mm256_hadd_epi32(p2, p3);
    return _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(a, b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* int16 index vector: in 128-bit lane j, 4 x a_j then 4 x b_j. */
INLINE __m512i idx16(int a0, int b0, int a1, int b1, int a2, int b2, int a3, int b3) {
    return _mm512_set_epi16(b3, b3, b3, b3, a3, a3, a3, a3, b2, b2, b2, b2, a2, a2, a2, a2,
                            b1, b1, b1, b1, a1, a1, a1, a1, b0, b0, b0, b0, a0, a0, a0, a0);
}

/* da, db: 16 dwords each, every dword a sum over 4 weights of the sub-block its 128-bit lane
 * holds. vpackssdw puts, per 128-bit lane, da's 4 dwords then db's as int16 (exact: every value
 * fits), so one vpdpwssd against sc (int16 per lane: 4 x da's scale, 4 x db's) adds
 * scale * dot for both sub-blocks of every lane to acc. */
INLINE __m512i scale_pair(__m512i acc, __m512i da, __m512i db, __m512i sc) {
    return _mm512_dpwssd_epi32(acc, _mm512_packs_epi32(da, db), sc);
}

/* ---- Q4_K ----------------------------------------------------------------------------------- */

/* One full group's super-block against activation block kb; acc lane i = row i. Chunk c
 * (g = 8): Q4_K d[8]@0 dmin[8]@16 scales[8][12]@32 qs[8][128]@128; Q5_K the same with
 * qh[8][32]@128 and qs@384 (bit t of qh[l]: the 5th bit of weight 32t + l). */
INLINE __m256 q45k_update(int dtype, const uint8_t *c, const cf_act_q8 *x, int kb, __m256 acc) {
    const int q5k = dtype == CF_Q5_K;
    const int8_t *xq = x->qk + (size_t)kb * CF_QK_K;
    /* activations arranged as the unpacked nibbles: [sb0|sb2], [sb1|sb3], [sb4|sb6], [sb5|sb7] */
    __m512i xv[4];
    for (int k = 0; k < 4; k++) {
        const int8_t *p = xq + 128 * (k >> 1) + 32 * (k & 1);
        xv[k] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                                   _mm256_loadu_si256((const __m256i *)(p + 64)), 1);
    }
    /* the 6-bit scales and mins of the 8 rows, two rows per ymm (kq_scale_min_pair, as
     * kernels_kquant_avx2.inc's kq_scales_k4): per 128-bit lane bytes 0..7 scales, 8..15 mins */
    /* scale operands of row 2j (+8 selects row 2j+1's lane): W0 = [sb0 sb1 | sb0 sb1 | sb2 sb3 |
     * sb2 sb3] per 128-bit lane, W1 the same for sub-blocks 4..7 */
    const __m512i i0 = idx16(0, 1, 0, 1, 2, 3, 2, 3), i1 = idx16(4, 5, 4, 5, 6, 7, 6, 7);
    const __m512i eight = _mm512_set1_epi16(8), m4 = _mm512_set1_epi8(0x0f), zero = _mm512_setzero_si512();
    const uint8_t *sc = c + 32, *qs = c + (q5k ? 384 : 128);
    /* Q5_K: bit t of each qh byte to bit 4, for the sub-blocks of each half of the 4 vectors
     * ([0|2], [1|3], [4|6], [5|7]): one vprolvd (a rotate left by 4 - t mod 32 moves bit t of
     * every byte of a dword to bit 4 of the same byte), one vpternlogd to mask and merge */
    const __m512i rot[4] = {_mm512_inserti64x4(_mm512_set1_epi32(4), _mm256_set1_epi32(2), 1),
                            _mm512_inserti64x4(_mm512_set1_epi32(3), _mm256_set1_epi32(1), 1),
                            _mm512_inserti64x4(_mm512_set1_epi32(0), _mm256_set1_epi32(30), 1),
                            _mm512_inserti64x4(_mm512_set1_epi32(31), _mm256_set1_epi32(29), 1)};
    const __m512i m10 = _mm512_set1_epi8(0x10);
    __m512i r[CF_G];
    __m256i mins[CF_G / 2];
    for (int j = 0; j < CF_G / 2; j++) {
        /* rows 2j, 2j+1: 24 contiguous bytes (the last pair's load reads into qs) */
        __m256i sm = kq_scale_min_pair(sc + 24 * j);
        __m512i sc16 = _mm512_castsi256_si512(_mm256_unpacklo_epi8(sm, _mm256_setzero_si256()));
        mins[j] = _mm256_unpackhi_epi8(sm, _mm256_setzero_si256());
        for (int h = 0; h < 2; h++) {
            int i = 2 * j + h;
            __m512i s0 = _mm512_permutexvar_epi16(h ? _mm512_add_epi16(i0, eight) : i0, sc16);
            __m512i s1 = _mm512_permutexvar_epi16(h ? _mm512_add_epi16(i1, eight) : i1, sc16);
            const uint8_t *q = qs + 128 * i;
            __m512i v0 = _mm512_loadu_si512(q), v1 = _mm512_loadu_si512(q + 64);
            __m512i u[4] = {_mm512_and_si512(v0, m4), _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4),
                            _mm512_and_si512(v1, m4), _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4)};
            if (q5k) {
                __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(c + 128 + 32 * i)));
                for (int k = 0; k < 4; k++) /* (a & b) | c: 0xEA */
                    u[k] = _mm512_ternarylogic_epi32(_mm512_rolv_epi32(hb, rot[k]), m10, u[k], 0xEA);
            }
            __m512i d0 = _mm512_dpbusd_epi32(zero, u[0], xv[0]), d1 = _mm512_dpbusd_epi32(zero, u[1], xv[1]);
            __m512i d2 = _mm512_dpbusd_epi32(zero, u[2], xv[2]), d3 = _mm512_dpbusd_epi32(zero, u[3], xv[3]);
            r[i] = scale_pair(scale_pair(zero, d0, d1, s0), d2, d3, s1);
        }
    }
    __m256i qd = fold8(r);
    /* kq_finish_qd's float operations */
    __m256 dx = _mm256_broadcast_ss(x->dk + kb);
    acc = _mm256_fmadd_ps(_mm256_mul_ps(load_halves8(c), dx), _mm256_cvtepi32_ps(qd), acc);
    const int16_t *bs = x->bsums + (size_t)kb * (CF_QK_K / 16);
    __m256i b32 = _mm256_broadcastsi128_si256(
        _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)bs), _mm_loadu_si128((const __m128i *)(bs + 8))));
    __m256i mb = fold_pairs(_mm256_madd_epi16(mins[0], b32), _mm256_madd_epi16(mins[1], b32),
                            _mm256_madd_epi16(mins[2], b32), _mm256_madd_epi16(mins[3], b32));
    return _mm256_fnmadd_ps(_mm256_mul_ps(load_halves8(c + 16), dx), _mm256_cvtepi32_ps(mb), acc);
}

/* ---- Q6_K ----------------------------------------------------------------------------------- */

/* One full group's super-block (chunk c, g = 8: d[8]@0 scales[8][16]@16 ql[8][128]@144
 * qh[8][64]@1168) against activation block kb. In half h (weights 128h ..), ql[64h + l] holds
 * weight 128h + l (l < 64) in its low nibble and 128h + 64 + l in its high one; qh[32h + l] bits
 * 2s, 2s+1 the top bits of weight 128h + 32s + l. So the 64 ql bytes' low nibbles are weights
 * 128h + 0..63 in order (128-bit lane j = sub-block 8h + j), the high ones 128h + 64..127
 * (sub-block 8h + 4 + j), and the qh bytes serve both 256-bit halves of each. */
INLINE __m256 q6k_update(const uint8_t *c, const cf_act_q8 *x, int kb, __m256 acc) {
    const int8_t *xq = x->qk + (size_t)kb * CF_QK_K;
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30), zero = _mm512_setzero_si512();
    /* bits 2s, 2s+1 -> 4, 5: s = 0 | 1 (low nibbles) shift left 4 | 2, s = 2 | 3 right 0 | 2 */
    const __m512i shl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i shr = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    /* scale operands: half h pairs sub-block 8h + j (low nibbles) with 8h + 4 + j in lane j */
    const __m512i i0 = idx16(0, 4, 1, 5, 2, 6, 3, 7), i1 = idx16(8, 12, 9, 13, 10, 14, 11, 15);
    __m512i xv[4], y[4];
    for (int k = 0; k < 4; k++) {
        xv[k] = _mm512_loadu_si512(xq + 64 * k);
        /* -32 * (sum of each 4 activations): vpdpbusd's start, so each dword is sum (q - 32) x */
        __m512i s4 = _mm512_dpbusd_epi32(zero, _mm512_set1_epi8(1), xv[k]);
        y[k] = _mm512_sub_epi32(zero, _mm512_slli_epi32(s4, 5));
    }
    __m512i r[CF_G];
    for (int i = 0; i < CF_G; i++) {
        const uint8_t *ql = c + 144 + 128 * i, *qh = c + 1168 + 64 * i;
        __m512i s16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + 16 + 16 * i))));
        __m512i acc_i = zero;
        for (int h = 0; h < 2; h++) {
            __m512i v = _mm512_loadu_si512(ql + 64 * h);
            __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qh + 32 * h)));
            /* (a & b) | c: 0xEA */
            __m512i lo = _mm512_ternarylogic_epi32(_mm512_sllv_epi16(hb, shl), m30, _mm512_and_si512(v, m4), 0xEA);
            __m512i hi = _mm512_ternarylogic_epi32(_mm512_srlv_epi16(hb, shr), m30,
                                                   _mm512_and_si512(_mm512_srli_epi16(v, 4), m4), 0xEA);
            __m512i dl = _mm512_dpbusd_epi32(y[2 * h], lo, xv[2 * h]);
            __m512i dh = _mm512_dpbusd_epi32(y[2 * h + 1], hi, xv[2 * h + 1]);
            acc_i = scale_pair(acc_i, dl, dh, _mm512_permutexvar_epi16(h ? i1 : i0, s16));
        }
        r[i] = acc_i;
    }
    __m256 dx = _mm256_broadcast_ss(x->dk + kb);
    return _mm256_fmadd_ps(_mm256_mul_ps(load_halves8(c), dx), _mm256_cvtepi32_ps(fold8(r)), acc);
}

/* ---- Q5_0 / Q5_1 (32-weight blocks) ------------------------------------------------------------ */

/* One full group's block (chunk c, g = 8: Q5_0 d[8]@0 qh[8][4]@16 qs[8][16]@48, 176 B; Q5_1
 * d[8]@0 m[8]@16 qh@32 qs@64, 192 B) against activation block kb: four rows per zmm (128-bit lane
 * r = row 4h + r), low nibbles = weights 0..15, high = 16..31; the 5th bit of each weight as a
 * byte mask (vpshufb spreads the row's qh bytes over its lane, vptestmb picks bit k % 8 of byte
 * k) and one masked vpaddb of 16; one vpdpbusd per 64 weights, lows and highs into one
 * accumulator, then kernels_kquant_avx2.inc's q5_update float operations. */
INLINE __m256 q5_update512(int dtype, const uint8_t *c, const cf_act_q8 *x, int kb, __m256 acc) {
    const int q51 = dtype == CF_Q5_1;
    const uint8_t *qh = c + (q51 ? 32 : 16), *qs = qh + 32;
    const int8_t *xk = x->qs + (size_t)kb * CF_QK;
    const __m512i m4 = _mm512_set1_epi8(0x0f), b16 = _mm512_set1_epi8(0x10), zero = _mm512_setzero_si512();
    const __m512i spread_lo = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
    const __m512i spread_hi = _mm512_broadcast_i32x4(_mm_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m512i bitsel = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128));
    __m512i xa = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)xk));
    __m512i xb = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xk + 16)));
    __m512i qh8 = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)qh)); /* dword i = row i's qh */
    __m512i a[2];
    for (int h = 0; h < 2; h++) {
        __m512i hq = _mm512_permutexvar_epi32(_mm512_setr_epi32(4 * h, 4 * h, 4 * h, 4 * h, 4 * h + 1, 4 * h + 1, 4 * h + 1,
                                                                4 * h + 1, 4 * h + 2, 4 * h + 2, 4 * h + 2, 4 * h + 2,
                                                                4 * h + 3, 4 * h + 3, 4 * h + 3, 4 * h + 3), qh8);
        __m512i v = _mm512_loadu_si512(qs + 64 * h);
        __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(_mm512_shuffle_epi8(hq, spread_lo), bitsel), lo, b16);
        hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(_mm512_shuffle_epi8(hq, spread_hi), bitsel), hi, b16);
        a[h] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, xa), hi, xb);
    }
    /* per lane r: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] (a = rows 0..3, b = rows 4..7), then
     * [sum a, sum b, sum a, sum b]; dword 0 of each lane, then dword 1: rows 0..7 */
    __m512i p = _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]), _mm512_unpackhi_epi32(a[0], a[1]));
    p = _mm512_add_epi32(p, _mm512_shuffle_epi32(p, _MM_SHUFFLE(1, 0, 3, 2)));
    __m256i isum = _mm512_castsi512_si256(
        _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), p));
    /* q5_update's float operations */
    __m256 fsum = _mm256_cvtepi32_ps(isum), d = load_halves8(c);
    __m256 bd = _mm256_broadcast_ss(x->d + kb), bs = _mm256_broadcast_ss(x->s + kb);
    if (q51) {
        acc = _mm256_fmadd_ps(d, _mm256_mul_ps(fsum, bd), acc);
        return _mm256_fmadd_ps(load_halves8(c + 16), bs, acc);
    }
    __m256 neg16s = _mm256_mul_ps(bs, _mm256_set1_ps(-16.0f));
    return _mm256_fmadd_ps(d, _mm256_fmadd_ps(fsum, bd, neg16s), acc);
}

/* ---- MXFP4 (32-weight blocks) ------------------------------------------------------------------- */

/* Lane i = the bits of 2^(e_i - 128) for the exponents e (dwords 0..255): kernels_kquant_avx2.inc's
 * e8m0_half8 (cf_e8m0_half) in one op fewer: (e - 1) << 23 as e << 23 plus a constant, and the
 * two subnormals (e < 2: 0x00200000 << e) by a masked shift instead of a compare and a blend. */
INLINE __m512i e8m0_half16_bits(__m512i e) {
    __m512i norm = _mm512_add_epi32(_mm512_slli_epi32(e, 23), _mm512_set1_epi32(-(1 << 23)));
    __mmask16 tiny = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    return _mm512_mask_sllv_epi32(norm, tiny, _mm512_set1_epi32(0x00200000), e);
}

/* Lane i = 2^(e_i - 128) from the 8 exponent bytes at p (the odd last block of a share). */
INLINE __m256 e8m0_half8(const uint8_t *p) {
    __m512i e = _mm512_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_castsi256_ps(_mm512_castsi512_si256(e8m0_half16_bits(e)));
}

/* The block's activation as vpdpbusd operands: xa / xb = weights 0..15 / 16..31 in every
 * 128-bit lane; neg = vpdpbusd's starting value, -12 * (the sum of each 4 of xa and of xb), so
 * the 4 dwords of every lane add up to -12 * sum(x): the offset of the table's values (exact),
 * folded into the dot instead of formed and subtracted apart. (Formed once per tile share for
 * all its groups instead, it was no faster: measured, 1 thread, L2.) */
typedef struct {
    __m512i xa, xb, neg;
} mx_act512;

INLINE mx_act512 mx_act(const cf_act_q8 *x, int kb) {
    const int8_t *xk = x->qs + (size_t)kb * CF_QK;
    const __m512i twelve = _mm512_set1_epi8(12), zero = _mm512_setzero_si512();
    mx_act512 a;
    a.xa = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)xk));
    a.xb = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xk + 16)));
    a.neg = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, twelve, a.xa), twelve, a.xb));
    return a;
}

/* The 32-bit partials of one full group's block (chunk c, g = 8: e[8]@0 qs[8][16]@8, 136 B):
 * 128-bit lane r of a[h] = row 4h + r (4 dwords adding up to its exact dot, offset included);
 * low nibbles weights 0..15, high 16..31, each turned into its doubled E2M1 value + 12 (an
 * unsigned 0..24) by one vpshufb against the 16-entry table. */
INLINE void mx_partials(const uint8_t *c, const mx_act512 *xa, __m512i a[2]) {
    static const int8_t values_u[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)values_u)); /* values + 12 */
    for (int h = 0; h < 2; h++) {
        __m512i v = _mm512_loadu_si512(c + 8 + 64 * h);
        __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, m4));
        __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
        a[h] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(xa->neg, lo, xa->xa), hi, xa->xb);
    }
}

/* Per 128-bit lane r: [row r, row 4 + r, row r, row 4 + r] (each the sum of its 4 dwords). */
INLINE __m512i mx_lane_sums(const __m512i a[2]) {
    __m512i p = _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]), _mm512_unpackhi_epi32(a[0], a[1]));
    return _mm512_add_epi32(p, _mm512_shuffle_epi32(p, _MM_SHUFFLE(1, 0, 3, 2)));
}

/* One full group's block against activation block kb: the exact row sums of mx_update, then its
 * float operation, acc = fma(2^(e - 128), isum * dx, acc). */
INLINE __m256 mx_update512(const uint8_t *c, const cf_act_q8 *x, int kb, __m256 acc) {
    mx_act512 xa = mx_act(x, kb);
    __m512i a[2];
    mx_partials(c, &xa, a);
    __m256i isum = _mm512_castsi512_si256(
        _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), mx_lane_sums(a)));
    __m256 fsum = _mm256_cvtepi32_ps(isum);
    return _mm256_fmadd_ps(e8m0_half8(c), _mm256_mul_ps(fsum, _mm256_broadcast_ss(x->d + kb)), acc);
}

/* Two consecutive blocks of one full group (chunks c and c + chunk, activation blocks kb, kb + 1):
 * mx_update512's operations for both, with the lane folds and the float conversions shared: one
 * more unpack level leaves the 16 row sums in one vector ([block kb | block kb + 1] after one
 * permute), whose conversion, scale bits and dx product are each one 512-bit op; the two fmas stay
 * in block order, so acc gets exactly what two mx_update512 calls give it. */
INLINE __m256 mx_update512_pair(const uint8_t *c, size_t chunk, const cf_act_q8 *x, int kb, __m256 acc) {
    mx_act512 x0 = mx_act(x, kb), x1 = mx_act(x, kb + 1);
    __m512i a[2], b[2];
    mx_partials(c, &x0, a);
    mx_partials(c + chunk, &x1, b);
    __m512i pa = _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]), _mm512_unpackhi_epi32(a[0], a[1]));
    __m512i pb = _mm512_add_epi32(_mm512_unpacklo_epi32(b[0], b[1]), _mm512_unpackhi_epi32(b[0], b[1]));
    /* per 128-bit lane r: [kb row r, kb row 4 + r, kb + 1 row r, kb + 1 row 4 + r] */
    __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(pa, pb), _mm512_unpackhi_epi64(pa, pb));
    s = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), s);
    __m512 dx = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                      _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(x->d + kb)))));
    __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(s), dx);
    /* the 16 exponent bytes of both blocks */
    __m512i e = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)c),
                                                        _mm_loadl_epi64((const __m128i *)(c + chunk))));
    __m512 d = _mm512_castsi512_ps(e8m0_half16_bits(e));
    acc = _mm256_fmadd_ps(_mm512_castps512_ps256(d), _mm512_castps512_ps256(y), acc);
    return _mm256_fmadd_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(d), 1)),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y), 1)), acc);
}

/* ---- the walk: kernels_avx2.inc's matvec_groups ------------------------------------------------ */

/* One full group's chunks at p (nkt blocks of the tile share) against activation x: lane i = row
 * i's share of the dot, the mat-vec's float operations in block order. */
INLINE __m256 kq512_group_dot(int dtype, const uint8_t *p, size_t chunk, int nkt, const cf_act_q8 *x, int kb0) {
    __m256 acc = _mm256_setzero_ps();
    int kb = 0;
    if (dtype == CF_MXFP4) /* two blocks at a time; an odd last one alone */
        for (; kb + 2 <= nkt; kb += 2) acc = mx_update512_pair(p + kb * chunk, chunk, x, kb0 + kb, acc);
    for (; kb < nkt; kb++) {
        const uint8_t *c = p + kb * chunk;
        if (dtype == CF_MXFP4) acc = mx_update512(c, x, kb0 + kb, acc);
        else if (dtype == CF_Q6_K) acc = q6k_update(c, x, kb0 + kb, acc);
        else if (dtype == CF_Q4_K || dtype == CF_Q5_K) acc = q45k_update(dtype, c, x, kb0 + kb, acc);
        else acc = q5_update512(dtype, c, x, kb0 + kb, acc);
    }
    return acc;
}

/* out + b*ldo (rows of groups [g0, g1)) += W . xs[b] for b < B: the mat-vec's walk, each group's
 * dot taken for every activation while its chunks sit in L1 (B = 1: the mat-vec). */
INLINE void kq512_groups(int dtype, const cf_tiled *w, const cf_act_q8 *xs, int B, float *out, int ldo, int g0,
                         int g1) {
    size_t chunk = (size_t)CF_G * cf_block_bytes(dtype);
    int pf = cf_prefetch_distance(cf_matvec_default_ahead(dtype));
    const uint8_t *end = pf ? cf_tiled_end(w) : NULL;
    CF_FOR_EACH_SHARE(sp, w, g0, g1, xs, B, out, ldo) {
        const uint8_t *p = sp.ptr;
        size_t group_bytes = sp.nkt * chunk;
        for (int gr = sp.ga; gr < sp.gb; gr++, p += group_bytes) {
            cf_prefetch_ahead(pf, p, group_bytes, end);
            float *o = out + (size_t)(gr - g0) * CF_G;
            for (int b = 0; b < B; b++, o += ldo)
                _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), kq512_group_dot(dtype, p, chunk, sp.nkt, xs + b,
                                                                                          sp.kb0)));
        }
    }
}

INLINE void kq512_matvec_groups(int dtype, const cf_tiled *w, const cf_act_q8 *x, float *out, int g0, int g1) {
    kq512_groups(dtype, w, x, 1, out, 0, g0, g1);
}

static void matvec_q5_0_avx512(const cf_tiled *w, const cf_act_q8 *x, float *y, int g0, int g1) {
    kq512_matvec_groups(CF_Q5_0, w, x, y + (size_t)g0 * CF_G, g0, g1);
}

static void matvec_q5_1_avx512(const cf_tiled *w, const cf_act_q8 *x, float *y, int g0, int g1) {
    kq512_matvec_groups(CF_Q5_1, w, x, y + (size_t)g0 * CF_G, g0, g1);
}

static void matvec_q4_k_avx512(const cf_tiled *w, const cf_act_q8 *x, float *y, int g0, int g1) {
    kq512_matvec_groups(CF_Q4_K, w, x, y + (size_t)g0 * CF_G, g0, g1);
}

static void matvec_q5_k_avx512(const cf_tiled *w, const cf_act_q8 *x, float *y, int g0, int g1) {
    kq512_matvec_groups(CF_Q5_K, w, x, y + (size_t)g0 * CF_G, g0, g1);
}

static void matvec_q6_k_avx512(const cf_tiled *w, const cf_act_q8 *x, float *y, int g0, int g1) {
    kq512_matvec_groups(CF_Q6_K, w, x, y + (size_t)g0 * CF_G, g0, g1);
}

static void matvec_mxfp4_avx512(const cf_tiled *w, const cf_act_q8 *x, float *y, int g0, int g1) {
    kq512_matvec_groups(CF_MXFP4, w, x, y + (size_t)g0 * CF_G, g0, g1);
}

/* ---- fused gate+up+SiLU: kernels_avx2.inc's gate_up over this mat-vec --------------------------- */

/* exp_ps / silu_ps: simd_silu.h (one definition, the same bits everywhere). */

CF_DEFINE_GATE_UP(kq512_gate_up, kq512_matvec_groups)

static void gate_up_q5_0_avx512(const cf_tiled *w, const cf_act_q8 *x, float *y, int p0, int p1) {
    kq512_gate_up(CF_Q5_0, w, x, y, p0, p1);
}

static void gate_up_q5_1_avx512(const cf_tiled *w, const cf_act_q8 *x, float *y, int p0, int p1) {
    kq512_gate_up(CF_Q5_1, w, x, y, p0, p1);
}

static void gate_up_q4_k_avx512(const cf_tiled *w, const cf_act_q8 *x, float *y, int p0, int p1) {
    kq512_gate_up(CF_Q4_K, w, x, y, p0, p1);
}

static void gate_up_q5_k_avx512(const cf_tiled *w, const cf_act_q8 *x, float *y, int p0, int p1) {
    kq512_gate_up(CF_Q5_K, w, x, y, p0, p1);
}

static void gate_up_q6_k_avx512(const cf_tiled *w, const cf_act_q8 *x, float *y, int p0, int p1) {
    kq512_gate_up(CF_Q6_K, w, x, y, p0, p1);
}

static void gate_up_mxfp4_avx512(const cf_tiled *w, const cf_act_q8 *x, float *y, int p0, int p1) {
    kq512_gate_up(CF_MXFP4, w, x, y, p0, p1);
}

/* ---- small batches: the mat-vec per activation, the weights read once -------------------------
 *
 * The 2-16 rows of a speculative verification call (or of serve's batched decode) through
 * kq512_groups: each group's chunks come from memory once and serve every activation from L1,
 * each activation through the mat-vec's own dot, so every row is the mat-vec's bit for bit. The
 * batched kernels of these types (kernels_avx512.c's kq5 buffer for Q4_K / Q5_K / Q6_K, the base
 * table's for Q5_0 / Q5_1 / MXFP4) unpack every block into a buffer that only many tokens pay
 * for: measured 2026-12-05 on the Zen 4 VM (benchmarks/small_batch_ab.py, a random 8-layer
 * d = 1024 Q4_K_M file, 2 threads), a 2-row step cost 5.4x a 1-row step through them. Past
 * KQ512_SMALL_B the batched kernels keep the call. */
#ifndef KQ512_SMALL_B
#define KQ512_SMALL_B 16
#endif

static cf_matmat_fn g_batched_matmat[CF_DTYPE_IDS], g_small_matmat[CF_DTYPE_IDS];
static cf_gate_up_mm_fn g_batched_gate_up_mm[CF_DTYPE_IDS], g_small_gate_up_mm[CF_DTYPE_IDS];

/* gate_up_mm for B <= KQ512_SMALL_B: the gate and up rows through kq512_groups, then silu(gate) *
 * up as the mat-vec's gate_up does it (simd_silu.h). */
CF_DEFINE_GATE_UP_MM(kq512_gate_up_small, kq512_groups, KQ512_SMALL_B, CF_GATE_UP_CHUNK)

/* Per dtype: the zmm small-batch kernels (matmat_X_zmm / gate_up_mm_X_zmm) and the table's entries
 * (matmat_X / gate_up_mm_X), which send a call to the small-batch kernel the install chose or to
 * the batched one by its size. */
#define DEFINE_SMALL_BATCH(DT, X)                                                                           \
    static void matmat_##X##_zmm(const cf_tiled *w, const cf_act_q8 *xs, int B, float *y, int ldy, int g0,  \
                                 int g1) {                                                                  \
        kq512_groups(DT, w, xs, B, y + (size_t)g0 * CF_G, ldy, g0, g1);                                     \
    }                                                                                                       \
    static void gate_up_mm_##X##_zmm(const cf_tiled *w, const cf_act_q8 *xs, int B, float *y, int ldy,     \
                                     int p0, int p1) {                                                      \
        kq512_gate_up_small(DT, w, xs, B, y, ldy, p0, p1);                                                  \
    }                                                                                                       \
    static void matmat_##X(const cf_tiled *w, const cf_act_q8 *xs, int B, float *y, int ldy, int g0, int g1) { \
        (B > KQ512_SMALL_B ? g_batched_matmat : g_small_matmat)[DT](w, xs, B, y, ldy, g0, g1);              \
    }                                                                                                       \
    static void gate_up_mm_##X(const cf_tiled *w, const cf_act_q8 *xs, int B, float *y, int ldy, int p0,    \
                               int p1) {                                                                    \
        (B > KQ512_SMALL_B ? g_batched_gate_up_mm : g_small_gate_up_mm)[DT](w, xs, B, y, ldy, p0, p1);      \
    }
DEFINE_SMALL_BATCH(CF_Q5_0, q5_0)
DEFINE_SMALL_BATCH(CF_Q5_1, q5_1)
DEFINE_SMALL_BATCH(CF_Q4_K, q4_k)
DEFINE_SMALL_BATCH(CF_Q5_K, q5_k)
DEFINE_SMALL_BATCH(CF_Q6_K, q6_k)
DEFINE_SMALL_BATCH(CF_MXFP4, mxfp4)

/* Called by kernels_avx512.c's table_init on its copy of the AVX2-family table `base`, after it
 * set its own batched kernels: every other entry (Q4_0 / Q4_1 / Q8_0) stays as it is; the batched
 * entries of these types keep their calls of more than KQ512_SMALL_B tokens. Where the zmm Q6_K
 * mat-vec does not keep up with memory (cf_avx512_q6k_streams, dispatch.c), Q6_K's mat-vec, gate/up
 * and small batches stay the base table's. */
void cf_kquant_avx512_install(cf_kernel_table *t, const cf_kernel_table *base) {
#define INSTALL(DT, X)                                                                                      \
    do {                                                                                                    \
        g_batched_matmat[DT] = t->matmat[DT];                                                               \
        g_batched_gate_up_mm[DT] = t->gate_up_mm[DT];                                                       \
        int zmm = (DT) != CF_Q6_K || cf_avx512_q6k_streams();                                               \
        g_small_matmat[DT] = zmm ? matmat_##X##_zmm : base->matmat[DT];                                     \
        g_small_gate_up_mm[DT] = zmm ? gate_up_mm_##X##_zmm : base->gate_up_mm[DT];                         \
        t->matmat[DT] = matmat_##X;                                                                         \
        t->gate_up_mm[DT] = gate_up_mm_##X;                                                                 \
        if (zmm) {                                                                                          \
            t->matvec[DT] = matvec_##X##_avx512;                                                            \
            t->gate_up[DT] = gate_up_##X##_avx512;                                                          \
        }                                                                                                   \
    } while (0)
    INSTALL(CF_Q5_0, q5_0);
    INSTALL(CF_Q5_1, q5_1);
    INSTALL(CF_Q4_K, q4_k);
    INSTALL(CF_Q5_K, q5_k);
    INSTALL(CF_Q6_K, q6_k);
    INSTALL(CF_MXFP4, mxfp4);
#undef INSTALL
}
