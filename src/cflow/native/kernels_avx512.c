/* kernels_avx512.c — the batched (prefill) kernels on 512-bit registers with AVX512-VNNI.
 *
 * Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mfma -mf16c (CMakeLists.txt) and
 * chosen by dispatch.c only on CPUs that report all four AVX-512 features with zmm state saved
 * by the OS. The table is a copy of the best AVX2-family table (dispatch.c passes it in) with
 * only matmat and gate_up_mm of Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K, deltanet_head (Qwen3.5's
 * recurrence, below its own heading), the K-quant mat-vec (kernels_kquant_avx512.c) and the
 * fp16-cache attention pair (kernels_attn_avx512.c) replaced, so every entry added to the AVX2
 * tables later is inherited as it is.
 *
 * The contract (cflow.h) is that matmat equals this table's matvec row by row, bit for bit, and
 * matvec is the inherited kernels_avx2.inc one. Its float operations per row of a tile are (the
 * K-quants': below, at their kernel):
 *   acc = 0; per block: Q4_0 acc = fma(d, fma(isum, dx, -8 sx), acc)
 *                       Q4_1 acc = fma(d, isum * dx, acc); acc = fma(m, sx, acc)
 *                       Q8_0 acc = fma(d, isum * dx, acc)
 *   then out += acc, tile after tile; the short last group through the reference.
 * isum is an exact integer however it is summed, and every float operation above is lane-wise,
 * so the kernels below do exactly these operations with 16 rows (two groups) per zmm.
 *
 * Layout of the work: per tile share and batch of tokens, up to MM5_NP pairs of groups have
 * their blocks transposed once into an L1 buffer (lane i of v[t] = bytes 4t..4t+3 of row i, the
 * rows of two groups side by side, in row order), then a micro-kernel runs MM5_NT tokens x
 * MM5_NP pairs at once: per activation dword it broadcasts NT dwords and issues NT x NP
 * vpdpbusd against NP weight vectors, so each weight vector loaded serves NT tokens and each
 * broadcast serves NP x 16 rows. Q4_0 / Q4_1 / Q8_0 batches of at most SB_MAX_B = 32 tokens
 * (serve's decode steps, step_rows) skip the buffer: each block is unpacked into registers and
 * used right away by up to 8 tokens (below, "small batches"); same values, and faster at every
 * B up to 32 with the weights streamed from memory (measured, below). On Zen 4, batches of 2 to
 * SG_MAX_B = 16 tokens (speculative verification, a few decode rows) read one group at a time
 * instead, one block of its 8 rows per ymm, so that the weights stream as the mat-vec's do (below,
 * "one group at a time in 256-bit vectors"; elsewhere the pair path keeps them: dispatch.c,
 * cf_avx512_small_batch_groups); a lone token's matmat (SQ_MAX_B = 1) two blocks per zmm ("one
 * group at a time").
 *
 * Software prefetch (cflow.h, cf_set_prefetch): with a distance N, each run of groups about to be
 * unpacked first asks for the lines N bytes ahead of it (cf_prefetch_ahead); off: never. In the
 * default mode they prefetch MM5_AHEAD bytes ahead (the small-batch path SB_AHEAD), because the
 * unpacking reads two groups' chunks in turn (two streams a group apart, 64-byte loads across
 * lines), which the hardware prefetcher does not follow: measured 2026-11-30, 1 thread, one
 * process switching modes (Engine.prefetch), per call of 8 rows (the buffer path): SmolLM2 10.4 -> 6.7 ms, the ~1B Q4_0 model 73.6 -> 43.6
 * ms; of 64 rows (prefill), 1B: 295 -> 280 ms. Small batches (serve's decode steps) expose the
 * memory stalls that 64 tokens of compute per weight byte hide. The inherited mat-vec and gate/up
 * follow the mode in kernels_avx2.inc.
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "cflow.h"
#include "kquant_scales.h"
#include "kernels_internal.h"
#include "kernels_ref.h"
#include "simd_silu.h"

#define INLINE static inline __attribute__((always_inline))

#ifndef MM5_NT
#define MM5_NT 4   /* tokens per micro-kernel: NT x NP int + float accumulators in zmm */
#endif
#ifndef MM5_NP
#define MM5_NP 2   /* pairs of groups (32 rows) per micro-kernel and per unpacked buffer */
#endif
#if MM5_NT < 1 || MM5_NT > 8 || MM5_NP < 1 || MM5_NP > 2
#error "MM5_NT must be 1..8 and MM5_NP 1..2"
#endif
#define MM5_KT 16  /* most blocks per tile row the buffer holds (tile_cols <= 512): 16 KiB */
#define MM5_TB 64  /* tokens per batch (Q8_0's per-token block sums live on the stack) */
#define MM5_AHEAD 4096 /* default-mode prefetch distance (above): 2048-8192 measured alike */

/* The table this one copies; its matmat also runs tiles wider than MM5_KT blocks (same values:
 * both equal the same matvec). */
static _Atomic(const cf_kernel_table *) g_base;

/* ---- unpacking: two groups' block into 8 transposed vectors ----------------------------- */

/* Q4 (16 nibble bytes per row, 8 rows per group; group b at qb, pass qb = qa for one group):
 * lane i of t_k = bytes 4k..4k+3 of row i (rows of b in lanes 8..15). v[k] gets the low
 * nibbles (weights 4k..4k+3, against activation dword k), v[4+k] the high ones (weights
 * 16+4k.., against dword 4+k). */
INLINE void unpack_q4_pair(const uint8_t *qa, const uint8_t *qb, __m512i v[8]) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512i a0 = _mm512_loadu_si512(qa), a1 = _mm512_loadu_si512(qa + 64);
    __m512i b0 = _mm512_loadu_si512(qb), b1 = _mm512_loadu_si512(qb + 64);
    for (int k = 0; k < 4; k++) {
        /* row i of a group sits at dword 4i + k of (x0, x1) */
        __m512i idx = _mm512_setr_epi32(k, 4 + k, 8 + k, 12 + k, 16 + k, 20 + k, 24 + k, 28 + k,
                                        k, 4 + k, 8 + k, 12 + k, 16 + k, 20 + k, 24 + k, 28 + k);
        __m512i t = _mm512_mask_blend_epi32(0xff00, _mm512_permutex2var_epi32(a0, idx, a1),
                                            _mm512_permutex2var_epi32(b0, idx, b1));
        v[k] = _mm512_and_si512(t, m4);
        v[4 + k] = _mm512_and_si512(_mm512_srli_epi16(t, 4), m4);
    }
}

/* Q8_0 (32 int8 per row): lane i of v[k] = bytes 4k..4k+3 of row i, offset by +128 (XOR 0x80)
 * so the weights are vpdpbusd's unsigned operand; the kernel subtracts 128 * sum(x). */
INLINE void unpack_q8_pair(const uint8_t *qa, const uint8_t *qb, __m512i v[8]) {
    const __m512i x80 = _mm512_set1_epi8((char)0x80);
    __m512i a[4], b[4];
    for (int j = 0; j < 4; j++) { /* a[j] = rows 2j, 2j+1 */
        a[j] = _mm512_loadu_si512(qa + 64 * j);
        b[j] = _mm512_loadu_si512(qb + 64 * j);
    }
    for (int k = 0; k < 8; k++) {
        /* row 4h + i (i < 4) sits at dword 8i + k of (x[2h], x[2h+1]) */
        __m512i idx = _mm512_setr_epi32(k, 8 + k, 16 + k, 24 + k, k, 8 + k, 16 + k, 24 + k,
                                        k, 8 + k, 16 + k, 24 + k, k, 8 + k, 16 + k, 24 + k);
        __m512i t = _mm512_permutex2var_epi32(a[0], idx, a[1]);
        t = _mm512_mask_blend_epi32(0x00f0, t, _mm512_permutex2var_epi32(a[2], idx, a[3]));
        t = _mm512_mask_blend_epi32(0x0f00, t, _mm512_permutex2var_epi32(b[0], idx, b[1]));
        t = _mm512_mask_blend_epi32(0xf000, t, _mm512_permutex2var_epi32(b[2], idx, b[3]));
        v[k] = _mm512_xor_si512(t, x80);
    }
}

/* 16 fp16 scales: 8 of group a, then 8 of group b. */
INLINE __m512 load_halves16(const uint8_t *pa, const uint8_t *pb) {
    __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)pa)),
                                        _mm_loadu_si128((const __m128i *)pb), 1);
    return _mm512_cvtph_ps(h);
}

/* The unpacked blocks of up to MM5_NP pairs of one tile: [pair][block]. */
typedef struct {
    __m512i v[MM5_NP * MM5_KT][8];
    __m512 d[MM5_NP * MM5_KT], m[MM5_NP * MM5_KT];
} mm5_buf;

/* Unpack pair q (groups at pa, pb; pb = pa for a lone last group) of nkt blocks. */
INLINE void unpack_pair(int dtype, const uint8_t *pa, const uint8_t *pb, int nkt, mm5_buf *buf, int q) {
    size_t chunk = cf_block_bytes(dtype) * CF_G, qs_off = cf_chunk_qs_offset(dtype, CF_G);
    for (int kb = 0; kb < nkt; kb++) {
        const uint8_t *ca = pa + kb * chunk, *cb = pb + kb * chunk;
        int i = q * MM5_KT + kb;
        buf->d[i] = load_halves16(ca, cb);
        if (dtype == CF_Q4_1) buf->m[i] = load_halves16(ca + 16, cb + 16);
        if (dtype == CF_Q8_0) unpack_q8_pair(ca + qs_off, cb + qs_off, buf->v[i]);
        else unpack_q4_pair(ca + qs_off, cb + qs_off, buf->v[i]);
    }
}

/* ---- the micro-kernel ------------------------------------------------------------------ */

/* NT tokens (xs[0..NT)) x NP pairs of one tile: out + j*ldo + 16q gets += the tile's share of
 * rows 16q.. for token j (lanes of mask[q] only). corr[j * MM5_KT + kb] = 128 * sum of token j's
 * int8 block kb (Q8_0 only). */
INLINE void mm5_kernel(int NT, int NP, int dtype, const mm5_buf *buf, int nkt, const cf_act_q8 *xs,
                       int kb0, const int32_t *corr, float *out, int ldo, const __mmask16 *mask) {
    const int32_t *x4[MM5_NT];
    const float *xd[MM5_NT], *xsum[MM5_NT];
    __m512 acc[MM5_NP][MM5_NT];
    for (int j = 0; j < NT; j++) {
        x4[j] = (const int32_t *)(xs[j].qs + (size_t)kb0 * CF_QK);
        xd[j] = xs[j].d + kb0;
        xsum[j] = xs[j].s + kb0;
        for (int q = 0; q < NP; q++) acc[q][j] = _mm512_setzero_ps();
    }
    for (int kb = 0; kb < nkt; kb++) {
        __m512i is[MM5_NP][MM5_NT];
        for (int j = 0; j < NT; j++) {
            __m512i init = dtype == CF_Q8_0 ? _mm512_set1_epi32(-corr[j * MM5_KT + kb]) : _mm512_setzero_si512();
            for (int q = 0; q < NP; q++) is[q][j] = init;
        }
        for (int t = 0; t < 8; t++) {
            __m512i xb[MM5_NT];
            for (int j = 0; j < NT; j++) xb[j] = _mm512_set1_epi32(x4[j][kb * 8 + t]);
            for (int q = 0; q < NP; q++) {
                __m512i w = buf->v[q * MM5_KT + kb][t];
                for (int j = 0; j < NT; j++) is[q][j] = _mm512_dpbusd_epi32(is[q][j], w, xb[j]);
            }
        }
        for (int j = 0; j < NT; j++) {
            __m512 bd = _mm512_set1_ps(xd[j][kb]), bs = _mm512_set1_ps(xsum[j][kb]);
            for (int q = 0; q < NP; q++) {
                int i = q * MM5_KT + kb;
                __m512 fsum = _mm512_cvtepi32_ps(is[q][j]);
                if (dtype == CF_Q4_0) {
                    __m512 neg8s = _mm512_mul_ps(bs, _mm512_set1_ps(-8.0f));
                    acc[q][j] = _mm512_fmadd_ps(buf->d[i], _mm512_fmadd_ps(fsum, bd, neg8s), acc[q][j]);
                } else {
                    acc[q][j] = _mm512_fmadd_ps(buf->d[i], _mm512_mul_ps(fsum, bd), acc[q][j]);
                    if (dtype == CF_Q4_1) acc[q][j] = _mm512_fmadd_ps(buf->m[i], bs, acc[q][j]);
                }
            }
        }
    }
    for (int j = 0; j < NT; j++)
        for (int q = 0; q < NP; q++) {
            float *o = out + (size_t)j * ldo + 16 * q;
            __m512 prev = _mm512_maskz_loadu_ps(mask[q], o);
            _mm512_mask_storeu_ps(o, mask[q], _mm512_add_ps(prev, acc[q][j]));
        }
}

/* corr[j * MM5_KT + kb] = 128 * the sum of token j's int8s in block kb0 + kb: what Q8_0's +128
 * weight offset adds to each row's integer sum. */
INLINE void q8_block_sums(const cf_act_q8 *xs, int nb, int kb0, int nkt, int32_t *corr) {
    const __m256i ones = _mm256_set1_epi8(1);
    for (int j = 0; j < nb; j++)
        for (int kb = 0; kb < nkt; kb++) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(xs[j].qs + (size_t)(kb0 + kb) * CF_QK));
            __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, x);
            corr[j * MM5_KT + kb] = 128 * _mm512_reduce_add_epi32(_mm512_zextsi256_si512(s));
        }
}

/* Every (NT, NP) the walk needs, with constants so the loops unroll into registers. */
INLINE void mm5_run(int nt, int np, int dtype, const mm5_buf *buf, int nkt, const cf_act_q8 *xs,
                    int kb0, const int32_t *corr, float *out, int ldo, const __mmask16 *mask) {
#define MM5_CASE(NT, NP, DT)                                                                   \
    if (NT <= MM5_NT && NP <= MM5_NP && nt == NT && np == NP && dtype == DT) {                 \
        mm5_kernel(NT, NP, DT, buf, nkt, xs, kb0, corr, out, ldo, mask);                       \
        return;                                                                                \
    }
#define MM5_NTS(NP, DT)                                                                        \
    MM5_CASE(1, NP, DT) MM5_CASE(2, NP, DT) MM5_CASE(3, NP, DT) MM5_CASE(4, NP, DT)              \
    MM5_CASE(5, NP, DT) MM5_CASE(6, NP, DT) MM5_CASE(7, NP, DT) MM5_CASE(8, NP, DT)
#define MM5_DTS(DT) MM5_NTS(1, DT) MM5_NTS(2, DT)
    MM5_DTS(CF_Q4_0)
    MM5_DTS(CF_Q4_1)
    MM5_DTS(CF_Q8_0)
#undef MM5_DTS
#undef MM5_NTS
#undef MM5_CASE
}

/* ---- small batches (serve's decode steps): blocks unpacked into registers ------------------ */

/* Batches of at most SB_MAX_B tokens take this path instead of the buffer: per pair of groups and
 * block, the 8 transposed vectors and the scales are unpacked into registers once and multiplied
 * right away against up to SB_NB tokens' int8 activations, as llama.cpp's mat-mul does with
 * several columns per call (nrc). No round trip through the L1 buffer; per weight vector the
 * tokens' vpdpbusd follow each other (independent), each with its activation dword as an
 * embedded broadcast; the float operations per token and block are mm5_kernel's, in the same
 * order, so the results are the same bit for bit. The activations of a pass are first packed per
 * block (sb_pack) so that one pointer reaches them all.
 *
 * Measured 2026-11-30 on the Zen 5 VM (indicative: a shared machine), time against the buffer
 * path. benchmarks/small_batch_kernel.c (1536 x 576, tile 128 x 256, best of 100), streamed from
 * memory: Q4_1 B = 1 0.64x, 2 0.65x, 4 0.63x, 8 0.71x, 16 0.77x, 32 0.87x; Q8_0 8 0.66x, 16 0.77x,
 * 32 0.87x; in L2: Q4_1 8 0.82x, 16 0.93x, 32 0.98x. SmolLM2 Q4_1 decode steps of B rows at 1
 * thread (benchmarks/small_batch_ab.py: this build against the one before, alternating): B = 2
 * 0.81x, 4 0.79x, 8 0.83x, 16 0.89x, 24 0.94x, 32 0.97x, 48 0.99x, 64 1.01x; hence SB_MAX_B = 32,
 * and prefill's 64-token batches keep the buffer. The default-mode prefetch distance is 8 KiB (the
 * mat-vec's): a pass over a pair is short at a few tokens, and 2-row steps ran 7% faster at 8 KiB
 * than at 4 KiB (8 rows alike). */
#ifndef SB_MAX_B
#define SB_MAX_B 32 /* most tokens that take this path (-DSB_MAX_B=0: the buffer path only) */
#endif
#define SB_NB 8        /* most tokens per pass: v[8] + 8 int + 8 float accumulators in zmm */
#define SB_2CHAIN_MAX 4 /* up to this many tokens, two vpdpbusd chains per token (latency) */
#define SB_AHEAD 8192  /* default-mode prefetch distance */

/* acc += w . (the dword at x in every lane): vpdpbusd with an embedded broadcast. GCC does not
 * fold _mm512_set1_epi32 into vpdpbusd's memory operand, and the separate vpbroadcastd is one more
 * op per vpdpbusd in a loop that is short of issue slots. */
INLINE __m512i dpbusd_x4(__m512i acc, __m512i w, const int32_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
    return acc;
}

/* This path unpacks with in-lane shuffles and 128-bit lane moves only (no vpermt2d and its index
 * registers, fewer ops): the rows come out in an order of their own, lane i of every vector
 * holding row sb_row_*[i]; the scales are permuted to match once per block, each accumulator
 * back to row order once per tile. Q4: lane 4L + p (128-bit lane L, dword p) holds row 4p + L;
 * Q8_0: row 8(L/2) + 2p + L%2. Lanes never mix, so the order changes no value. */
static const int32_t sb_row_q4[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15}; /* own inverse */
static const int32_t sb_row_q8[16] = {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15};
static const int32_t sb_lane_q8[16] = {0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15}; /* inverse */

/* Q4 (16 nibble bytes per row; group b at qb, qb = qa for one group): v[k] = the low nibbles of
 * dword k of each row (weights 4k..4k+3), v[4+k] the high ones (16+4k..), rows as sb_row_q4. */
INLINE void sb_unpack_q4(const uint8_t *qa, const uint8_t *qb, __m512i v[8]) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512i a0 = _mm512_loadu_si512(qa), a1 = _mm512_loadu_si512(qa + 64); /* rows 0-3, 4-7 */
    __m512i b0 = _mm512_loadu_si512(qb), b1 = _mm512_loadu_si512(qb + 64);
    __m512i t0 = _mm512_unpacklo_epi32(a0, a1), t1 = _mm512_unpackhi_epi32(a0, a1);
    __m512i t2 = _mm512_unpacklo_epi32(b0, b1), t3 = _mm512_unpackhi_epi32(b0, b1);
    __m512i x[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                    _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
    for (int k = 0; k < 4; k++) {
        v[k] = _mm512_and_si512(x[k], m4);
        v[4 + k] = _mm512_and_si512(_mm512_srli_epi16(x[k], 4), m4);
    }
}

/* Q8_0 (32 int8 per row): v[k] = dword k of each row, XOR 0x80 as in unpack_q8_pair, rows as
 * sb_row_q8: a 4 x 4 dword transpose inside each 128-bit lane per group, then the halves of the
 * rows (dwords 0-3 in lanes 0 and 2, 4-7 in lanes 1 and 3) gathered by vshufi32x4. */
INLINE void sb_unpack_q8(const uint8_t *qa, const uint8_t *qb, __m512i v[8]) {
    const __m512i x80 = _mm512_set1_epi8((char)0x80);
    __m512i u[2][4];
    for (int g = 0; g < 2; g++) {
        const uint8_t *q = g ? qb : qa;
        __m512i z0 = _mm512_loadu_si512(q), z1 = _mm512_loadu_si512(q + 64);
        __m512i z2 = _mm512_loadu_si512(q + 128), z3 = _mm512_loadu_si512(q + 192);
        __m512i t0 = _mm512_unpacklo_epi32(z0, z1), t1 = _mm512_unpackhi_epi32(z0, z1);
        __m512i t2 = _mm512_unpacklo_epi32(z2, z3), t3 = _mm512_unpackhi_epi32(z2, z3);
        u[g][0] = _mm512_unpacklo_epi64(t0, t2);
        u[g][1] = _mm512_unpackhi_epi64(t0, t2);
        u[g][2] = _mm512_unpacklo_epi64(t1, t3);
        u[g][3] = _mm512_unpackhi_epi64(t1, t3);
    }
    for (int k = 0; k < 4; k++) {
        v[k] = _mm512_xor_si512(_mm512_shuffle_i32x4(u[0][k], u[1][k], 0x88), x80);
        v[4 + k] = _mm512_xor_si512(_mm512_shuffle_i32x4(u[0][k], u[1][k], 0xdd), x80);
    }
}

/* A pass's activations for the blocks of one tile, packed so that one pointer reaches them all:
 * per block, a record of the NB tokens' 32 int8 (NB x 8 dwords), then their NB scales d, NB sums
 * s and (Q8_0) NB corrections -128 * s_int (q8_block_sums). */
#define SB_REC(NB) ((size_t)(NB) * (CF_QK + 12))

static void sb_pack(int dtype, const cf_act_q8 *xs, int nb, int kb0, int nkt, uint8_t *rec) {
    int32_t corr[SB_NB * MM5_KT];
    if (dtype == CF_Q8_0) q8_block_sums(xs, nb, kb0, nkt, corr);
    for (int kb = 0; kb < nkt; kb++, rec += SB_REC(nb)) {
        float *d = (float *)(rec + (size_t)nb * CF_QK), *sm = d + nb;
        int32_t *c = (int32_t *)(sm + nb);
        for (int j = 0; j < nb; j++) {
            memcpy(rec + (size_t)j * CF_QK, xs[j].qs + (size_t)(kb0 + kb) * CF_QK, CF_QK);
            d[j] = xs[j].d[kb0 + kb];
            sm[j] = xs[j].s[kb0 + kb];
            c[j] = dtype == CF_Q8_0 ? -corr[j * MM5_KT + kb] : 0;
        }
    }
}

/* NB tokens x one pair of groups (chunks at pa, pb; pb = pa for a lone group) over the nkt blocks
 * of a tile: out + j*ldo (lanes of mask, in row order) += the tile's share for token j. */
INLINE void sb_pair(int NB, int dtype, const uint8_t *pa, const uint8_t *pb, int nkt, const uint8_t *rec,
                    float *out, int ldo, __mmask16 mask) {
    size_t chunk = cf_block_bytes(dtype) * CF_G, qs_off = cf_chunk_qs_offset(dtype, CF_G);
    const __m512i row = _mm512_loadu_si512(dtype == CF_Q8_0 ? sb_row_q8 : sb_row_q4);
    __m512 acc[SB_NB];
    for (int j = 0; j < NB; j++) acc[j] = _mm512_setzero_ps();
    for (int kb = 0; kb < nkt; kb++, rec += SB_REC(NB)) {
        const uint8_t *ca = pa + kb * chunk, *cb = pb + kb * chunk;
        const int32_t *x4 = (const int32_t *)rec;
        const float *xd = (const float *)(rec + NB * CF_QK), *xsum = xd + NB;
        const int32_t *xc = (const int32_t *)(xsum + NB);
        __m512i v[8];
        if (dtype == CF_Q8_0) sb_unpack_q8(ca + qs_off, cb + qs_off, v);
        else sb_unpack_q4(ca + qs_off, cb + qs_off, v);
        __m512 d = _mm512_permutexvar_ps(row, load_halves16(ca, cb));
        __m512 m = dtype == CF_Q4_1 ? _mm512_permutexvar_ps(row, load_halves16(ca + 16, cb + 16))
                                    : _mm512_setzero_ps();
        /* weight vector after weight vector, the NB tokens in a row: independent vpdpbusd */
        __m512i is0[SB_NB], is1[SB_NB];
        for (int j = 0; j < NB; j++) {
            is0[j] = dtype == CF_Q8_0 ? _mm512_set1_epi32(xc[j]) : _mm512_setzero_si512();
            is1[j] = _mm512_setzero_si512();
        }
        for (int t = 0; t < 8; t++)
            for (int j = 0; j < NB; j++) {
                if (NB <= SB_2CHAIN_MAX && (t & 1)) is1[j] = dpbusd_x4(is1[j], v[t], x4 + j * 8 + t);
                else is0[j] = dpbusd_x4(is0[j], v[t], x4 + j * 8 + t);
            }
        for (int j = 0; j < NB; j++) {
            __m512i isum = NB <= SB_2CHAIN_MAX ? _mm512_add_epi32(is0[j], is1[j]) : is0[j];
            __m512 fsum = _mm512_cvtepi32_ps(isum);
            __m512 bd = _mm512_set1_ps(xd[j]), bs = _mm512_set1_ps(xsum[j]);
            if (dtype == CF_Q4_0) {
                __m512 neg8s = _mm512_mul_ps(bs, _mm512_set1_ps(-8.0f));
                acc[j] = _mm512_fmadd_ps(d, _mm512_fmadd_ps(fsum, bd, neg8s), acc[j]);
            } else {
                acc[j] = _mm512_fmadd_ps(d, _mm512_mul_ps(fsum, bd), acc[j]);
                if (dtype == CF_Q4_1) acc[j] = _mm512_fmadd_ps(m, bs, acc[j]);
            }
        }
    }
    const __m512i lane = _mm512_loadu_si512(dtype == CF_Q8_0 ? sb_lane_q8 : sb_row_q4);
    for (int j = 0; j < NB; j++) {
        float *o = out + (size_t)j * ldo;
        __m512 y = _mm512_permutexvar_ps(lane, acc[j]); /* back to row order */
        _mm512_mask_storeu_ps(o, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, o), y));
    }
}

/* The pairs of one tile share (groups [ga, gb) at sp->ptr) for NB tokens whose blocks are packed
 * in rec; token j's rows of group ga + i go to out + j*ldo + 8i. */
INLINE void sb_pairs(int NB, int dtype, const cf_span *sp, size_t group_bytes, const uint8_t *rec,
                     float *out, int ldo, int pf, const uint8_t *end) {
    for (int gr = sp->ga; gr < sp->gb; gr += 2) {
        int lone = gr + 1 >= sp->gb; /* a last group without a partner: half a zmm */
        const uint8_t *pa = sp->ptr + (size_t)(gr - sp->ga) * group_bytes;
        cf_prefetch_ahead(pf, pa, (size_t)(lone ? 1 : 2) * group_bytes, end);
        sb_pair(NB, dtype, pa, lone ? pa : pa + group_bytes, sp->nkt, rec, out + (size_t)(gr - sp->ga) * CF_G,
                ldo, lone ? 0x00ff : 0xffff);
    }
}

/* The body of sb_run / sq_run: call FN's instance for this (row count nb <= LIMIT, dtype) and
 * return; the instances have nb and dtype as compile-time constants. */
#define RUN_NB_CASE(FN, LIMIT, NB, DT)                                                         \
    if (NB <= LIMIT && nb == NB && dtype == DT) {                                              \
        FN(NB, DT, sp, group_bytes, rec, out, ldo, pf, end);                                   \
        return;                                                                                \
    }
#define RUN_NBS(FN, LIMIT, DT) RUN_NB_CASE(FN, LIMIT, 1, DT) RUN_NB_CASE(FN, LIMIT, 2, DT)     \
    RUN_NB_CASE(FN, LIMIT, 3, DT) RUN_NB_CASE(FN, LIMIT, 4, DT) RUN_NB_CASE(FN, LIMIT, 5, DT)  \
    RUN_NB_CASE(FN, LIMIT, 6, DT) RUN_NB_CASE(FN, LIMIT, 7, DT) RUN_NB_CASE(FN, LIMIT, 8, DT)
#define RUN_EVERY_NB(FN, LIMIT) RUN_NBS(FN, LIMIT, CF_Q4_0) RUN_NBS(FN, LIMIT, CF_Q4_1) RUN_NBS(FN, LIMIT, CF_Q8_0)

INLINE void sb_run(int nb, int dtype, const cf_span *sp, size_t group_bytes, const uint8_t *rec, float *out,
                   int ldo, int pf, const uint8_t *end) {
    RUN_EVERY_NB(sb_pairs, SB_NB)
}

/* One tile share for B <= SB_MAX_B tokens (out: its first group's rows): passes of at most SB_NB
 * tokens, as even as can be (9 = 5 + 4, not 8 + 1), each packing its activations once; the
 * share's weights stay in cache for a second pass, so only the first asks for lines ahead. */
INLINE void sb_share(int dtype, const cf_span *sp, size_t group_bytes, const cf_act_q8 *xs, int B,
                     float *out, int ldo, int pf, const uint8_t *end) {
    _Alignas(64) uint8_t rec[MM5_KT * SB_REC(SB_NB)];
    int passes = (B + SB_NB - 1) / SB_NB;
    for (int b0 = 0, nb; b0 < B; b0 += nb, passes--) {
        nb = (B - b0 + passes - 1) / passes;
        sb_pack(dtype, xs + b0, nb, sp->kb0, sp->nkt, rec);
        sb_run(nb, dtype, sp, group_bytes, rec, out + (size_t)b0 * ldo, ldo, b0 == 0 ? pf : 0, end);
    }
}

/* matmat_groups for B <= SB_MAX_B (the same contract): the same walk, each tile share by
 * sb_share. */
INLINE void sb_matmat_groups(int dtype, const cf_tiled *w, const cf_act_q8 *xs, int B, float *out, int ldo,
                             int g0, int g1) {
    size_t bb = cf_block_bytes(dtype);
    int pf = cf_prefetch_distance(SB_AHEAD);
    const uint8_t *end = pf ? cf_tiled_end(w) : NULL;
    CF_FOR_EACH_SHARE(sp, w, g0, g1, xs, B, out, ldo) {
        sb_share(dtype, &sp, (size_t)CF_G * sp.nkt * bb, xs, B, out + (size_t)(sp.ga - g0) * CF_G, ldo, pf,
                 end);
    }
}

/* ---- small batches, one group at a time: two blocks per zmm ------------------------------------
 *
 * The pair path above reads two groups' chunks in turn (two streams a group apart). On Zen 4 (the
 * 2-core EPYC VM this project now measures on) that access pattern streams from memory at about
 * half the rate of the mat-vec's one stream, software prefetch or not, and the compute of the
 * extra rows then adds to the memory time instead of hiding under it. This path keeps one stream:
 * a group's chunks in file order, blocks kb and kb + 1 of the same 8 rows unpacked into one zmm by
 * the same sb_unpack_* (group "b" is the next block), so lane i holds virtual row sb_row_*[i]:
 * rows 0-7 the group's rows in block kb, 8-15 the same rows in block kb + 1. Each token's
 * activation dwords are packed to match (sq_pack), and the float operations run in block order:
 * block kb's on the low lanes, then block kb + 1's moved onto them (sq_second), mm5_kernel's
 * operations in mm5_kernel's order, so the sums are the mat-vec's bit for bit. It pays for the
 * one stream with three more float operations per token and block pair (the second block's
 * moves and fmas). The hardware prefetcher follows one stream by itself, so the default mode
 * asks for no lines ahead (SQ_AHEAD 0); a mode N > 0 prefetches N bytes ahead per group.
 *
 * Measured 2026-12-05 on the Zen 4 VM (indicative: a shared machine). One thread, a 3072 x 576
 * Q4_1 matrix (tile 128 x 256) streamed from memory, us per call, best of 40, this path / the pair
 * path: 1 token 49 / 102, 2: 61 / 90, 3: 87 / 95, 4: 111 / 92, 8: 219 / 136 (the AVX2 mat-vec, one
 * token: 52); in L2 30 / 27, 41 / 35, 55 / 43, 70 / 52: the pair path computes less per token,
 * this one streams better. SmolLM2 Q4_1 steps of B rows (benchmarks/small_batch_ab.py, against
 * the build before, alternating, 80 repeats, logits equal), 2 threads: B = 2 0.85x, 3 0.88x,
 * 4 1.01x, 5 1.00x; 1 thread 0.87x, 0.87x, 1.01x; with this path up to 8 tokens, 4-8 rows ran
 * 1.03x-1.20x. Hence SQ_MAX_B = 3 then; since the 256-bit one-group path below (sg_) took 2-16
 * tokens (faster at 2 and 3 rows too, SG_MAX_B), this one runs a lone token's matmat only. */
#ifndef SQ_MAX_B
#define SQ_MAX_B 1 /* most tokens that take this path (-DSQ_MAX_B=0: the next path only) */
#endif
#if SQ_MAX_B > SB_NB
#error "SQ_MAX_B must be at most SB_NB (one pass)"
#endif
#ifndef SQ_AHEAD
#define SQ_AHEAD 0 /* default-mode prefetch distance: none (above) */
#endif

/* Per block pair and token, SQ_VECS zmm: the 8 activation dwords t (in the lanes of block kb
 * x_kb[t] broadcast, in those of kb + 1 x_kb+1[t]), Q8_0's vpdpbusd start (-128 x the block's
 * int8 sum, as in unpack_q8_pair; 0 for Q4), the token's scales d and its block sums s (Q4_0:
 * -8 s, mm5_kernel's neg8s) laid out the same way, and s of block kb + 1 on the low lanes. A
 * lone last block (odd nkt) repeats block kb in the second half, which sq_group ignores. */
enum { SQ_X = 0, SQ_INIT = 8, SQ_D = 9, SQ_S = 10, SQ_S2 = 11, SQ_VECS = 12 };

#define SQ_HI_Q4 ((__mmask16)0xcccc) /* block kb + 1 in the Q4 order: dwords 2, 3 of each 128-bit lane */
#define SQ_HI_Q8 ((__mmask16)0xff00) /* ... in the Q8_0 order: the upper 256 bits */

INLINE __mmask16 sq_hi(int dtype) { return dtype == CF_Q8_0 ? SQ_HI_Q8 : SQ_HI_Q4; }

/* Block kb + 1's lanes of v moved onto block kb's (lane for lane the same row). */
INLINE __m512 sq_second(int dtype, __m512 v) {
    return dtype == CF_Q8_0 ? _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(3, 2, 3, 2))
                            : _mm512_shuffle_ps(v, v, _MM_SHUFFLE(3, 2, 3, 2));
}

INLINE __m512 sq_pair_ps(__mmask16 hi, float a, float b) {
    return _mm512_mask_blend_ps(hi, _mm512_set1_ps(a), _mm512_set1_ps(b));
}

INLINE __m512 sq_pair_epi32(__mmask16 hi, int32_t a, int32_t b) {
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(hi, _mm512_set1_epi32(a), _mm512_set1_epi32(b)));
}

static void sq_pack(int dtype, const cf_act_q8 *xs, int nb, int kb0, int nkt, __m512 *rec) {
    int32_t corr[SB_NB * MM5_KT];
    __mmask16 hi = sq_hi(dtype);
    if (dtype == CF_Q8_0) q8_block_sums(xs, nb, kb0, nkt, corr);
    for (int kb = 0; kb < nkt; kb += 2)
        for (int j = 0; j < nb; j++, rec += SQ_VECS) {
            int k2 = kb + 1 < nkt ? kb + 1 : kb, a = kb0 + kb, b = kb0 + k2;
            const int32_t *x4 = (const int32_t *)xs[j].qs;
            for (int t = 0; t < 8; t++) rec[SQ_X + t] = sq_pair_epi32(hi, x4[a * 8 + t], x4[b * 8 + t]);
            rec[SQ_INIT] = dtype == CF_Q8_0 ? sq_pair_epi32(hi, -corr[j * MM5_KT + kb], -corr[j * MM5_KT + k2])
                                            : _mm512_setzero_ps();
            rec[SQ_D] = sq_pair_ps(hi, xs[j].d[a], xs[j].d[b]);
            __m512 s = sq_pair_ps(hi, xs[j].s[a], xs[j].s[b]);
            rec[SQ_S] = dtype == CF_Q4_0 ? _mm512_mul_ps(s, _mm512_set1_ps(-8.0f)) : s;
            rec[SQ_S2] = sq_second(dtype, rec[SQ_S]);
        }
}

/* NB tokens x one group (chunks at p) over the nkt blocks of a tile share: out + j*ldo (its 8
 * rows) += the share's sums for token j. */
INLINE void sq_group(int NB, int dtype, const uint8_t *p, int nkt, const __m512 *rec, float *out, int ldo) {
    size_t chunk = cf_block_bytes(dtype) * CF_G, qs_off = cf_chunk_qs_offset(dtype, CF_G);
    const __m512i row = _mm512_loadu_si512(dtype == CF_Q8_0 ? sb_row_q8 : sb_row_q4);
    __m512 acc[SB_NB];
    for (int j = 0; j < NB; j++) acc[j] = _mm512_setzero_ps();
    for (int kb = 0; kb < nkt; kb += 2, rec += NB * SQ_VECS) {
        int two = kb + 1 < nkt;
        const uint8_t *ca = p + kb * chunk, *cb = two ? ca + chunk : ca;
        __m512i v[8];
        if (dtype == CF_Q8_0) sb_unpack_q8(ca + qs_off, cb + qs_off, v);
        else sb_unpack_q4(ca + qs_off, cb + qs_off, v);
        __m512 d = _mm512_permutexvar_ps(row, load_halves16(ca, cb)), d2 = sq_second(dtype, d);
        __m512 m = _mm512_setzero_ps(), m2 = m;
        if (dtype == CF_Q4_1) {
            m = _mm512_permutexvar_ps(row, load_halves16(ca + 16, cb + 16));
            m2 = sq_second(dtype, m);
        }
        /* weight vector after weight vector, the NB tokens in a row: independent vpdpbusd */
        __m512i is0[SB_NB], is1[SB_NB];
        for (int j = 0; j < NB; j++) {
            is0[j] = _mm512_castps_si512(rec[j * SQ_VECS + SQ_INIT]);
            is1[j] = _mm512_setzero_si512();
        }
        for (int t = 0; t < 8; t++)
            for (int j = 0; j < NB; j++) {
                __m512i x = _mm512_castps_si512(rec[j * SQ_VECS + SQ_X + t]);
                if (NB <= SB_2CHAIN_MAX && (t & 1)) is1[j] = _mm512_dpbusd_epi32(is1[j], v[t], x);
                else is0[j] = _mm512_dpbusd_epi32(is0[j], v[t], x);
            }
        for (int j = 0; j < NB; j++) {
            const __m512 *r = rec + j * SQ_VECS;
            __m512i isum = NB <= SB_2CHAIN_MAX ? _mm512_add_epi32(is0[j], is1[j]) : is0[j];
            __m512 fsum = _mm512_cvtepi32_ps(isum);
            if (dtype == CF_Q4_0) {
                __m512 inner = _mm512_fmadd_ps(fsum, r[SQ_D], r[SQ_S]);
                acc[j] = _mm512_fmadd_ps(d, inner, acc[j]);
                if (two) acc[j] = _mm512_fmadd_ps(d2, sq_second(dtype, inner), acc[j]);
            } else {
                __m512 scaled = _mm512_mul_ps(fsum, r[SQ_D]);
                acc[j] = _mm512_fmadd_ps(d, scaled, acc[j]);
                if (dtype == CF_Q4_1) acc[j] = _mm512_fmadd_ps(m, r[SQ_S], acc[j]);
                if (two) {
                    acc[j] = _mm512_fmadd_ps(d2, sq_second(dtype, scaled), acc[j]);
                    if (dtype == CF_Q4_1) acc[j] = _mm512_fmadd_ps(m2, r[SQ_S2], acc[j]);
                }
            }
        }
    }
    /* block kb's lanes hold the 8 rows: back to row order (the pair path's inverse), 8 stored */
    const __m512i lane = _mm512_loadu_si512(dtype == CF_Q8_0 ? sb_lane_q8 : sb_row_q4);
    for (int j = 0; j < NB; j++) {
        float *o = out + (size_t)j * ldo;
        __m256 y = _mm512_castps512_ps256(_mm512_permutexvar_ps(lane, acc[j]));
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), y));
    }
}

/* The groups of one tile share (groups [ga, gb) at sp->ptr) one after another, as they lie in
 * memory, for NB tokens packed in rec; token j's rows of group ga + i go to out + j*ldo + 8i. */
INLINE void sq_groups(int NB, int dtype, const cf_span *sp, size_t group_bytes, const __m512 *rec,
                      float *out, int ldo, int pf, const uint8_t *end) {
    for (int gr = sp->ga; gr < sp->gb; gr++) {
        const uint8_t *p = sp->ptr + (size_t)(gr - sp->ga) * group_bytes;
        cf_prefetch_ahead(pf, p, group_bytes, end);
        sq_group(NB, dtype, p, sp->nkt, rec, out + (size_t)(gr - sp->ga) * CF_G, ldo);
    }
}

INLINE void sq_run(int nb, int dtype, const cf_span *sp, size_t group_bytes, const __m512 *rec, float *out,
                   int ldo, int pf, const uint8_t *end) {
    RUN_EVERY_NB(sq_groups, SQ_MAX_B)
}

/* matmat_groups for B <= SQ_MAX_B (<= SB_NB) tokens (the same contract): the same walk, each tile
 * share's activations packed once, then its groups in memory order. */
INLINE void sq_matmat_groups(int dtype, const cf_tiled *w, const cf_act_q8 *xs, int B, float *out, int ldo,
                             int g0, int g1) {
    size_t bb = cf_block_bytes(dtype);
    __m512 rec[(MM5_KT + 1) / 2 * SB_NB * SQ_VECS];
    int pf = cf_prefetch_distance(SQ_AHEAD);
    const uint8_t *end = pf ? cf_tiled_end(w) : NULL;
    CF_FOR_EACH_SHARE(sp, w, g0, g1, xs, B, out, ldo) {
        sq_pack(dtype, xs, B, sp.kb0, sp.nkt, rec);
        sq_run(B, dtype, &sp, (size_t)CF_G * sp.nkt * bb, rec, out + (size_t)(sp.ga - g0) * CF_G, ldo, pf, end);
    }
}

/* ---- small batches, one group at a time in 256-bit vectors ---------------------------------
 *
 * The verification rows of speculative decoding (4-8 tokens: n-gram proposals) through one
 * memory stream, as the mat-vec reads the weights: each group's chunks in file order, one block
 * of its 8 rows per ymm (v[t] lane i = dword t of row i, rows in order), right away against up to
 * SB_NB tokens whose activation dwords come as embedded broadcasts (sb_pack's records, no
 * expanded copies in L1), the float operations per token and block mm5_kernel's, in its order:
 * bit for bit the mat-vec. On Zen 4 a zmm operation runs as two 256-bit halves, so 8 rows per
 * ymm cost what 16 per zmm do per weight, and one group at a time needs neither the pair path's
 * second stream nor the sq path's block-pair shuffles and per-token vectors (12 zmm per token and
 * block pair: 48 KiB for 8 tokens and a 16-block tile, past L1, which is why it lost at 4-8).
 * Batches of more than SB_NB tokens run in passes over a tile share, as sb_share's.
 *
 * Measured 2026-12-05 on the Zen 4 VM (indicative: a shared machine), SmolLM2 Q4_1 steps of B
 * rows, this build against the one before (sq_ at 2-3 tokens, the pair path at 4+), alternating,
 * logits equal (benchmarks/small_batch_ab.py, 40-60 repeats): 2 threads, B = 2 0.96x, 3 0.86x,
 * 4 0.84x, 5 0.90x, 6 0.85x, 7 0.86x, 8 0.87-0.88x, 9 0.97x, 12 0.95x, 16 0.96x (an 8-row step
 * 2.26x a 1-row step, was 2.57-2.69x); 1 thread (sg_ from 4 tokens): 4 0.81x, 5 0.88x, 6 0.81x,
 * 7 0.85x, 8 0.87x. benchmarks/small_batch_kernel.c (1536 x 576 Q4_1, 1 thread, best of 100) shows
 * why it is a memory-stream win: streamed from memory 4-8 tokens 0.75x-0.99x of the pair path,
 * in L2 1.07x-1.20x (the pair path computes less per weight; the weights of a decode step are
 * never in L2). Past 16 tokens (serve's larger steps) untested: the pair path stays.
 *
 * Not on Intel: where a zmm operation runs at full width, a ymm vpdpbusd does half a zmm's work
 * for the same slot. Measured 2026-12-06 on a 2-core Intel Xeon VM with AMX (a shared host: steps
 * ran at about half the previous day's speed), SmolLM2 Q4_1 steps of B rows, the pair path
 * against this one in one build (benchmarks/small_batch_ab.py --old-env
 * CFLOW_AVX512_SMALL_BATCH=group, 60 alternating repeats, logits equal): 2 threads, B = 2 0.86x,
 * 3 0.85x, 4 0.94x, 5 0.91x, 6 0.91x, 8 0.89x, 12 0.90x, 16 0.88x; 1 thread 0.86x, 0.85x, 0.87x,
 * 0.90x, 0.92x, 0.87x, 0.91x, 0.88x. So this path runs on Zen 4 only (g_sg_max_b, below).
 *
 * Tried on the same Xeon and not kept: AMX-INT8 tiles for the integer sums of 2-16 tokens (the
 * pair path's unpacked v[0..7] stored as a B tile, sb_pack's record as the A tile, one TDPBSUD
 * per block and pair, C stored and read back for the same float operations: bit for bit the
 * pair path's sums). A block's 32 weights per row make each tile multiply small and each needs
 * its own C (the scales are per block), so the tile loads, the multiply and the C store cost a
 * fixed ~40 cycles per block and pair whatever the batch: 1536 x 576 Q4_1 in L2 took 34-47 us at
 * 2-8 tokens against the pair path's 20-45, streamed 51-69 against 39-54; it won only from 9
 * tokens (0.75-0.85x at 9-16, where the pair path needs a second pass). With every block's
 * weights stored before the first tile load (a tile load waits for earlier stores to retire),
 * against 66-88 us (2-16 tokens) with the loads right after the stores. For prefill-size batches
 * (16-token chunks, a pair's weights unpacked once for all chunks, block kb's tile multiply issued
 * before block kb-1's or kb-2's float operations) a chunk still cost ~100 cycles per block and
 * pair: 0.79x / 0.90x the small-batch path at 32 tokens (in L2 / streamed), 0.93-1.03x the L1
 * buffer path at 48-64, 1.11-1.27x at 17 and 33 (the padding). The float operations the mat-vec's
 * order fixes (about 6 per token, block and 16 rows) and the tile unit's own work did not
 * overlap. */
#ifndef SG_MAX_B
#define SG_MAX_B 16 /* most tokens that take this path (-DSG_MAX_B=0: the pair path instead) */
#endif
#ifndef SG_AHEAD
#define SG_AHEAD 0 /* default-mode prefetch distance: none, as the sq path's (one stream) */
#endif

/* Most tokens that take this path on this CPU: SG_MAX_B where a zmm operation runs as two 256-bit
 * halves (Zen 4), else 0, the pair path (dispatch.c, cf_avx512_small_batch_groups; set once, when
 * the table is built). */
static int g_sg_max_b = SG_MAX_B;

/* acc += w . (the dword at x in every lane), 8 lanes: sb's dpbusd_x4 in a ymm. */
INLINE __m256i dpbusd_x4_256(__m256i acc, __m256i w, const int32_t *x) {
    __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
    return acc;
}

/* Q4 (16 nibble bytes per row at q + 16r): v[k] lane r = the low nibbles of dword k of row r
 * (weights 4k..4k+3), v[4+k] the high ones (16+4k..). Rows r and r+4 share a ymm, so the
 * in-lane 4 x 4 dword transpose leaves the rows in order. */
INLINE void sg_unpack_q4(const uint8_t *q, __m256i v[8]) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256i z[4];
    for (int r = 0; r < 4; r++)
        z[r] = _mm256_loadu2_m128i((const __m128i *)(q + 16 * (r + 4)), (const __m128i *)(q + 16 * r));
    __m256i t0 = _mm256_unpacklo_epi32(z[0], z[1]), t1 = _mm256_unpackhi_epi32(z[0], z[1]);
    __m256i t2 = _mm256_unpacklo_epi32(z[2], z[3]), t3 = _mm256_unpackhi_epi32(z[2], z[3]);
    __m256i x[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                    _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_and_si256(x[k], m4);
        v[4 + k] = _mm256_and_si256(_mm256_srli_epi16(x[k], 4), m4);
    }
}

/* Q8_0 (32 int8 per row at q + 32r): v[k] lane r = dword k of row r, XOR 0x80 as in
 * unpack_q8_pair: an in-lane 4 x 4 transpose of rows 0-3 and of rows 4-7 (dwords k and 4+k
 * side by side), then their 128-bit halves gathered. */
INLINE void sg_unpack_q8(const uint8_t *q, __m256i v[8]) {
    const __m256i x80 = _mm256_set1_epi8((char)0x80);
    __m256i u[2][4];
    for (int h = 0; h < 2; h++) {
        const uint8_t *p = q + 128 * h;
        __m256i z0 = _mm256_loadu_si256((const __m256i *)p), z1 = _mm256_loadu_si256((const __m256i *)(p + 32));
        __m256i z2 = _mm256_loadu_si256((const __m256i *)(p + 64)), z3 = _mm256_loadu_si256((const __m256i *)(p + 96));
        __m256i t0 = _mm256_unpacklo_epi32(z0, z1), t1 = _mm256_unpackhi_epi32(z0, z1);
        __m256i t2 = _mm256_unpacklo_epi32(z2, z3), t3 = _mm256_unpackhi_epi32(z2, z3);
        u[h][0] = _mm256_unpacklo_epi64(t0, t2); /* rows 4h..4h+3: dword 0 | dword 4 */
        u[h][1] = _mm256_unpackhi_epi64(t0, t2);
        u[h][2] = _mm256_unpacklo_epi64(t1, t3);
        u[h][3] = _mm256_unpackhi_epi64(t1, t3);
    }
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_xor_si256(_mm256_permute2x128_si256(u[0][k], u[1][k], 0x20), x80);
        v[4 + k] = _mm256_xor_si256(_mm256_permute2x128_si256(u[0][k], u[1][k], 0x31), x80);
    }
}

/* NB tokens x one group (chunks at p) over the nkt blocks of a tile share, activations packed by
 * sb_pack in rec: out + j*ldo (its 8 rows) += the share's sums for token j. */
INLINE void sg_group(int NB, int dtype, const uint8_t *p, int nkt, const uint8_t *rec, float *out, int ldo) {
    size_t chunk = cf_block_bytes(dtype) * CF_G, qs_off = cf_chunk_qs_offset(dtype, CF_G);
    __m256 acc[SB_NB];
    for (int j = 0; j < NB; j++) acc[j] = _mm256_setzero_ps();
    for (int kb = 0; kb < nkt; kb++, rec += SB_REC(NB)) {
        const uint8_t *c = p + kb * chunk;
        const int32_t *x4 = (const int32_t *)rec;
        const float *xd = (const float *)(rec + NB * CF_QK), *xsum = xd + NB;
        const int32_t *xc = (const int32_t *)(xsum + NB);
        __m256i v[8];
        if (dtype == CF_Q8_0) sg_unpack_q8(c + qs_off, v);
        else sg_unpack_q4(c + qs_off, v);
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)c));
        __m256 m = dtype == CF_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(c + 16)))
                                    : _mm256_setzero_ps();
        /* weight vector after weight vector, the NB tokens in a row: independent vpdpbusd */
        __m256i is0[SB_NB], is1[SB_NB];
        for (int j = 0; j < NB; j++) {
            is0[j] = dtype == CF_Q8_0 ? _mm256_set1_epi32(xc[j]) : _mm256_setzero_si256();
            is1[j] = _mm256_setzero_si256();
        }
        for (int t = 0; t < 8; t++)
            for (int j = 0; j < NB; j++) {
                if (NB <= SB_2CHAIN_MAX && (t & 1)) is1[j] = dpbusd_x4_256(is1[j], v[t], x4 + j * 8 + t);
                else is0[j] = dpbusd_x4_256(is0[j], v[t], x4 + j * 8 + t);
            }
        for (int j = 0; j < NB; j++) {
            __m256i isum = NB <= SB_2CHAIN_MAX ? _mm256_add_epi32(is0[j], is1[j]) : is0[j];
            __m256 fsum = _mm256_cvtepi32_ps(isum);
            __m256 bd = _mm256_set1_ps(xd[j]), bs = _mm256_set1_ps(xsum[j]);
            if (dtype == CF_Q4_0) {
                __m256 neg8s = _mm256_mul_ps(bs, _mm256_set1_ps(-8.0f));
                acc[j] = _mm256_fmadd_ps(d, _mm256_fmadd_ps(fsum, bd, neg8s), acc[j]);
            } else {
                acc[j] = _mm256_fmadd_ps(d, _mm256_mul_ps(fsum, bd), acc[j]);
                if (dtype == CF_Q4_1) acc[j] = _mm256_fmadd_ps(m, bs, acc[j]);
            }
        }
    }
    for (int j = 0; j < NB; j++) {
        float *o = out + (size_t)j * ldo;
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc[j]));
    }
}

/* The groups of one tile share one after another, as they lie in memory (sq_groups' walk). */
INLINE void sg_groups(int NB, int dtype, const cf_span *sp, size_t group_bytes, const uint8_t *rec,
                      float *out, int ldo, int pf, const uint8_t *end) {
    for (int gr = sp->ga; gr < sp->gb; gr++) {
        const uint8_t *p = sp->ptr + (size_t)(gr - sp->ga) * group_bytes;
        cf_prefetch_ahead(pf, p, group_bytes, end);
        sg_group(NB, dtype, p, sp->nkt, rec, out + (size_t)(gr - sp->ga) * CF_G, ldo);
    }
}

INLINE void sg_run(int nb, int dtype, const cf_span *sp, size_t group_bytes, const uint8_t *rec, float *out,
                   int ldo, int pf, const uint8_t *end) {
    RUN_EVERY_NB(sg_groups, SB_NB)
}

/* matmat_groups for B <= SB_MAX_B tokens (the same contract): the same walk, each tile share in
 * passes of at most SB_NB tokens (sb_share's split), each packing its activations once; the
 * share's weights stay in cache for a second pass, so only the first asks for lines ahead. */
INLINE void sg_matmat_groups(int dtype, const cf_tiled *w, const cf_act_q8 *xs, int B, float *out, int ldo,
                             int g0, int g1) {
    size_t bb = cf_block_bytes(dtype);
    _Alignas(64) uint8_t rec[MM5_KT * SB_REC(SB_NB)];
    int pf = cf_prefetch_distance(SG_AHEAD);
    const uint8_t *end = pf ? cf_tiled_end(w) : NULL;
    CF_FOR_EACH_SHARE(sp, w, g0, g1, xs, B, out, ldo) {
        float *o = out + (size_t)(sp.ga - g0) * CF_G;
        int passes = (B + SB_NB - 1) / SB_NB;
        for (int b0 = 0, nb; b0 < B; b0 += nb, passes--) {
            nb = (B - b0 + passes - 1) / passes;
            sb_pack(dtype, xs + b0, nb, sp.kb0, sp.nkt, rec);
            sg_run(nb, dtype, &sp, (size_t)CF_G * sp.nkt * bb, rec, o + (size_t)b0 * ldo, ldo, b0 == 0 ? pf : 0,
                   end);
        }
    }
}

/* ---- the walk ---------------------------------------------------------------------------- */

/* out[b*ldo + r - g0*8] for the rows of groups [g0, g1) and activations b < B: the tile shares
 * in the mat-vec's order (band, tile), and within one, batches of MM5_TB tokens over chunks of
 * MM5_NP pairs unpacked once; the short last group goes through the reference, as in matvec.
 * At most SB_MAX_B tokens: sb_matmat_groups. */
INLINE void matmat_groups(int dtype, const cf_tiled *w, const cf_act_q8 *xs, int B, float *out,
                          int ldo, int g0, int g1) {
    size_t bb = cf_block_bytes(dtype);
    mm5_buf buf;
    int32_t corr[MM5_TB * MM5_KT];
    int pf = cf_prefetch_distance(MM5_AHEAD);
    const uint8_t *end = pf ? cf_tiled_end(w) : NULL;
    CF_FOR_EACH_SHARE(sp, w, g0, g1, xs, B, out, ldo) {
        size_t group_bytes = (size_t)CF_G * sp.nkt * bb;
        for (int b0 = 0; b0 < B; b0 += MM5_TB) {
            int nb = cf_min(MM5_TB, B - b0);
            if (dtype == CF_Q8_0) q8_block_sums(xs + b0, nb, sp.kb0, sp.nkt, corr);
            for (int gr = sp.ga; gr < sp.gb; gr += 2 * MM5_NP) {
                int ng = cf_min(2 * MM5_NP, sp.gb - gr), np = (ng + 1) / 2;
                __mmask16 mask[MM5_NP];
                const uint8_t *p = sp.ptr + (size_t)(gr - sp.ga) * group_bytes;
                if (b0 == 0) /* later batches re-read these groups from cache */
                    cf_prefetch_ahead(pf, p, (size_t)ng * group_bytes, end);
                for (int q = 0; q < np; q++) {
                    int lone = 2 * q + 1 >= ng; /* a last group without a partner */
                    mask[q] = lone ? 0x00ff : 0xffff;
                    const uint8_t *pa = p + (size_t)(2 * q) * group_bytes;
                    unpack_pair(dtype, pa, lone ? pa : pa + group_bytes, sp.nkt, &buf, q);
                }
                float *o = out + (size_t)b0 * ldo + (size_t)(gr - g0) * CF_G;
                for (int j = 0; j < nb; j += MM5_NT)
                    mm5_run(cf_min(MM5_NT, nb - j), np, dtype, &buf, sp.nkt, xs + b0 + j, sp.kb0,
                            corr + j * MM5_KT, o + (size_t)j * ldo, ldo, mask);
            }
        }
    }
}

/* ---- K-quants (Q4_K, Q5_K, Q6_K): the same walk over 256-weight super-blocks ------------ */

/* The inherited mat-vec (kernels_kquant_avx2.inc, kq_finish) does per row and super-block
 *   acc = fma(d * dx, sum_qd, acc); Q4_K / Q5_K: acc = fnmadd(dmin * dx, sum_mb, acc)
 * with the exact integers of docs/kquants.md ("The integer dot products"); so does this. */
#define KQ5_KT 2 /* super-blocks per tile row the buffer holds (tile_cols <= 512): 16 KiB */

/* A pair's super-blocks: v[t][k] lane i = weights 32t + 4k .. +3 of row i (u8: Q4_K 0..15,
 * Q5_K 0..31, Q6_K 0..63); sc[s] lane i = row i's scale of sub-block s (Q4_K / Q5_K 8 of 32
 * weights, Q6_K 16 of 16); mp[j] lane i = int16 pair: Q4_K / Q5_K (m_j, m_j) against bsums (2j, 2j+1), so one vpdpwssd
 * per j forms m_j * bsum32_j; Q6_K (sc_2j, sc_2j+1), the -32 term's sum_s sc_s * bsums_s. */
typedef struct {
    __m512i v[MM5_NP * KQ5_KT][8][8];
    __m512i sc[MM5_NP * KQ5_KT][16];
    __m512i mp[MM5_NP * KQ5_KT][8];
    __m512 d[MM5_NP * KQ5_KT], dmin[MM5_NP * KQ5_KT];
} kq5_buf;

/* Row i's dword at byte offset `off` of its field (rows `size` bytes apart, groups `gstride`
 * bytes apart; gstride 0 for a lone group), for the 16 rows of a pair. */
INLINE __m512i gather_rows(const uint8_t *field, int size, int gstride, int off) {
    __m512i row = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512i grp = _mm512_mask_blend_epi32(0xff00, _mm512_setzero_si512(), _mm512_set1_epi32(gstride));
    __m512i idx = _mm512_add_epi32(_mm512_add_epi32(_mm512_mullo_epi32(row, _mm512_set1_epi32(size)), grp),
                                   _mm512_set1_epi32(off));
    return _mm512_i32gather_epi32(idx, field, 1);
}

/* Unpack pair q (chunks at ca, cb; cb = ca for a lone group) of nkt super-blocks; chunk
 * offsets (g = 8): Q4_K d@0 dmin@16 scales[8][12]@32 qs[8][128]@128 (1152 B);
 * Q5_K d@0 dmin@16 scales[8][12]@32 qh[8][32]@128 qs[8][128]@384 (1408 B);
 * Q6_K d@0 scales[8][16]@16 ql[8][128]@144 qh[8][64]@1168 (1680 B). */
INLINE void kq5_unpack_pair(int dtype, const uint8_t *ca, const uint8_t *cb, int nkt, kq5_buf *buf, int q) {
    size_t chunk = cf_block_bytes(dtype) * CF_G;
    int gstride = (int)(cb - ca);
    const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(3);
    for (int kb = 0; kb < nkt; kb++) {
        const uint8_t *c = ca + kb * chunk;
        int n = q * KQ5_KT + kb;
        buf->d[n] = load_halves16(c, c + gstride);
        int32_t sc[16][16], mp[8][16]; /* [sub-block][lane] */
        if (dtype == CF_Q4_K || dtype == CF_Q5_K) {
            buf->dmin[n] = load_halves16(c + 16, c + gstride + 16);
            for (int i = 0; i < 16; i++) {
                uint8_t s8[8], m8[8];
                kq_scale_min_k4(c + (i < 8 ? 0 : gstride) + 32 + 12 * (i & 7), s8, m8);
                for (int j = 0; j < 8; j++) {
                    sc[j][i] = s8[j];
                    mp[j][i] = (int32_t)((uint32_t)m8[j] << 16 | m8[j]);
                }
            }
            const int q5k = dtype == CF_Q5_K;
            const __m512i one = _mm512_set1_epi8(1);
            for (int t = 0; t < 8; t++) /* sub-block t: run t/2 of qs, low or high nibbles */
                for (int k = 0; k < 8; k++) {
                    __m512i raw = gather_rows(c + (q5k ? 384 : 128), 128, gstride, 32 * (t / 2) + 4 * k);
                    __m512i v = _mm512_and_si512(t & 1 ? _mm512_srli_epi16(raw, 4) : raw, m4);
                    if (q5k) { /* bit t of qh[l]: the 5th bit of weight 32t + l */
                        __m512i qh = gather_rows(c + 128, 32, gstride, 4 * k);
                        v = _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, t), one), 4));
                    }
                    buf->v[n][t][k] = v;
                }
        } else {
            buf->dmin[n] = _mm512_setzero_ps();
            for (int i = 0; i < 16; i++) {
                const int8_t *s16 = (const int8_t *)(c + (i < 8 ? 0 : gstride) + 16 + 16 * (i & 7));
                for (int j = 0; j < 16; j++) sc[j][i] = s16[j];
                for (int j = 0; j < 8; j++)
                    mp[j][i] = (int32_t)((uint32_t)(uint16_t)(int16_t)s16[2 * j + 1] << 16 | (uint16_t)(int16_t)s16[2 * j]);
            }
            for (int t = 0; t < 8; t++) { /* weights 128h + 32s + l, t = 4h + s (kernels_kquant_avx2.inc) */
                int h = t / 4, sh = t % 4;
                for (int k = 0; k < 8; k++) {
                    __m512i ql = gather_rows(c + 144, 128, gstride, 64 * h + 32 * (sh & 1) + 4 * k);
                    __m512i qh = gather_rows(c + 1168, 64, gstride, 32 * h + 4 * k);
                    __m512i lo = _mm512_and_si512(sh >= 2 ? _mm512_srli_epi16(ql, 4) : ql, m4);
                    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(qh, 2 * sh), m2);
                    buf->v[n][t][k] = _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
                }
            }
        }
        for (int j = 0; j < 16; j++) buf->sc[n][j] = _mm512_loadu_si512(sc[j]);
        for (int j = 0; j < 8; j++) buf->mp[n][j] = _mm512_loadu_si512(mp[j]);
    }
}

/* NT tokens x NP pairs of one tile, as mm5_kernel. */
INLINE void kq5_kernel(int NT, int NP, int dtype, const kq5_buf *buf, int nkt, const cf_act_q8 *xs,
                       int kb0, float *out, int ldo, const __mmask16 *mask) {
    __m512 acc[MM5_NP][MM5_NT];
    for (int q = 0; q < NP; q++)
        for (int j = 0; j < NT; j++) acc[q][j] = _mm512_setzero_ps();
    for (int kb = 0; kb < nkt; kb++) {
        const int32_t *x4[MM5_NT], *b2[MM5_NT];
        for (int j = 0; j < NT; j++) {
            x4[j] = (const int32_t *)(xs[j].qk + (size_t)(kb0 + kb) * CF_QK_K);
            b2[j] = (const int32_t *)(xs[j].bsums + (size_t)(kb0 + kb) * (CF_QK_K / 16));
        }
        __m512i qd[MM5_NP][MM5_NT], mb[MM5_NP][MM5_NT];
        for (int q = 0; q < NP; q++)
            for (int j = 0; j < NT; j++) {
                qd[q][j] = _mm512_setzero_si512();
                mb[q][j] = _mm512_setzero_si512();
            }
        for (int t = 0; t < 8; t++) {
            __m512i lo[MM5_NP][MM5_NT], hi[MM5_NP][MM5_NT];
            for (int q = 0; q < NP; q++)
                for (int j = 0; j < NT; j++) lo[q][j] = hi[q][j] = _mm512_setzero_si512();
            for (int k = 0; k < 8; k++) {
                __m512i xb[MM5_NT];
                for (int j = 0; j < NT; j++) xb[j] = _mm512_set1_epi32(x4[j][8 * t + k]);
                for (int q = 0; q < NP; q++) {
                    __m512i w = buf->v[q * KQ5_KT + kb][t][k];
                    for (int j = 0; j < NT; j++) {
                        /* Q6_K: dwords 0..3 and 4..7 are two sub-blocks of 16 */
                        if (dtype == CF_Q6_K && k >= 4) hi[q][j] = _mm512_dpbusd_epi32(hi[q][j], w, xb[j]);
                        else lo[q][j] = _mm512_dpbusd_epi32(lo[q][j], w, xb[j]);
                    }
                }
            }
            for (int q = 0; q < NP; q++) {
                const __m512i *sc = buf->sc[q * KQ5_KT + kb];
                for (int j = 0; j < NT; j++) {
                    if (dtype == CF_Q6_K) {
                        qd[q][j] = _mm512_add_epi32(qd[q][j], _mm512_mullo_epi32(lo[q][j], sc[2 * t]));
                        qd[q][j] = _mm512_add_epi32(qd[q][j], _mm512_mullo_epi32(hi[q][j], sc[2 * t + 1]));
                    } else {
                        qd[q][j] = _mm512_add_epi32(qd[q][j], _mm512_mullo_epi32(lo[q][j], sc[t]));
                    }
                }
            }
        }
        for (int q = 0; q < NP; q++) {
            int n = q * KQ5_KT + kb;
            for (int j = 0; j < NT; j++) {
                for (int s = 0; s < 8; s++) /* bsums 2s, 2s+1 as one int16 pair */
                    mb[q][j] = _mm512_dpwssd_epi32(mb[q][j], buf->mp[n][s], _mm512_set1_epi32(b2[j][s]));
                __m512 dx = _mm512_set1_ps(xs[j].dk[kb0 + kb]);
                if (dtype == CF_Q6_K) { /* sum_qd = sum_s sc_s dot_s - 32 sum_s sc_s bsums_s */
                    __m512i v = _mm512_sub_epi32(qd[q][j], _mm512_slli_epi32(mb[q][j], 5));
                    acc[q][j] = _mm512_fmadd_ps(_mm512_mul_ps(buf->d[n], dx), _mm512_cvtepi32_ps(v), acc[q][j]);
                } else {
                    acc[q][j] = _mm512_fmadd_ps(_mm512_mul_ps(buf->d[n], dx), _mm512_cvtepi32_ps(qd[q][j]), acc[q][j]);
                    acc[q][j] = _mm512_fnmadd_ps(_mm512_mul_ps(buf->dmin[n], dx), _mm512_cvtepi32_ps(mb[q][j]), acc[q][j]);
                }
            }
        }
    }
    for (int j = 0; j < NT; j++)
        for (int q = 0; q < NP; q++) {
            float *o = out + (size_t)j * ldo + 16 * q;
            __m512 prev = _mm512_maskz_loadu_ps(mask[q], o);
            _mm512_mask_storeu_ps(o, mask[q], _mm512_add_ps(prev, acc[q][j]));
        }
}

INLINE void kq5_run(int nt, int np, int dtype, const kq5_buf *buf, int nkt, const cf_act_q8 *xs,
                    int kb0, float *out, int ldo, const __mmask16 *mask) {
#define KQ5_CASE(NT, NP, DT)                                                                   \
    if (NT <= MM5_NT && NP <= MM5_NP && nt == NT && np == NP && dtype == DT) {                 \
        kq5_kernel(NT, NP, DT, buf, nkt, xs, kb0, out, ldo, mask);                             \
        return;                                                                                \
    }
#define KQ5_NTS(NP, DT) KQ5_CASE(1, NP, DT) KQ5_CASE(2, NP, DT) KQ5_CASE(3, NP, DT) KQ5_CASE(4, NP, DT)
    KQ5_NTS(1, CF_Q4_K)
    KQ5_NTS(2, CF_Q4_K)
    KQ5_NTS(1, CF_Q5_K)
    KQ5_NTS(2, CF_Q5_K)
    KQ5_NTS(1, CF_Q6_K)
    KQ5_NTS(2, CF_Q6_K)
#undef KQ5_NTS
#undef KQ5_CASE
}

INLINE void kq5_matmat_groups(int dtype, const cf_tiled *w, const cf_act_q8 *xs, int B, float *out,
                              int ldo, int g0, int g1) {
    size_t bb = cf_block_bytes(dtype);
    kq5_buf buf;
    int pf = cf_prefetch_distance(MM5_AHEAD);
    const uint8_t *end = pf ? cf_tiled_end(w) : NULL;
    CF_FOR_EACH_SHARE(sp, w, g0, g1, xs, B, out, ldo) {
        size_t group_bytes = (size_t)CF_G * sp.nkt * bb;
        for (int gr = sp.ga; gr < sp.gb; gr += 2 * MM5_NP) {
            int ng = cf_min(2 * MM5_NP, sp.gb - gr), np = (ng + 1) / 2;
            __mmask16 mask[MM5_NP];
            const uint8_t *p = sp.ptr + (size_t)(gr - sp.ga) * group_bytes;
            cf_prefetch_ahead(pf, p, (size_t)ng * group_bytes, end);
            for (int q = 0; q < np; q++) {
                int lone = 2 * q + 1 >= ng;
                mask[q] = lone ? 0x00ff : 0xffff;
                const uint8_t *pa = p + (size_t)(2 * q) * group_bytes;
                kq5_unpack_pair(dtype, pa, lone ? pa : pa + group_bytes, sp.nkt, &buf, q);
            }
            float *o = out + (size_t)(gr - g0) * CF_G;
            for (int j = 0; j < B; j += MM5_NT)
                kq5_run(cf_min(MM5_NT, B - j), np, dtype, &buf, sp.nkt, xs + j, sp.kb0,
                        o + (size_t)j * ldo, ldo, mask);
        }
    }
}

/* Each walk of each dtype in a function of its own, the dtype a constant inside, so that each
 * micro-kernel dispatch (mm5_run, sb_run, kq5_run) reduces to that dtype's cases and each walk
 * keeps its own stack frame. (Left to the compiler's cloning, the small-batch path's code tipped
 * it into one function with the dtype at run time: the buffer path ran 5-8% slower at 33-64
 * tokens, 3% in one function per dtype for both walks; so, within the A/B's noise of 1-3%.) */
#define NOINLINE static __attribute__((noinline))
#define DEFINE_GROUPS(NAME, DT)                                                                \
    NOINLINE void NAME##_sq(const cf_tiled *w, const cf_act_q8 *xs, int B, float *out, int ldo, \
                            int g0, int g1) {                                                  \
        sq_matmat_groups(DT, w, xs, B, out, ldo, g0, g1);                                      \
    }                                                                                          \
    NOINLINE void NAME##_sb(const cf_tiled *w, const cf_act_q8 *xs, int B, float *out, int ldo, \
                            int g0, int g1) {                                                  \
        sb_matmat_groups(DT, w, xs, B, out, ldo, g0, g1);                                      \
    }                                                                                          \
    NOINLINE void NAME##_sg(const cf_tiled *w, const cf_act_q8 *xs, int B, float *out, int ldo, \
                            int g0, int g1) {                                                  \
        sg_matmat_groups(DT, w, xs, B, out, ldo, g0, g1);                                      \
    }                                                                                          \
    NOINLINE void NAME##_mm(const cf_tiled *w, const cf_act_q8 *xs, int B, float *out, int ldo, \
                            int g0, int g1) {                                                  \
        matmat_groups(DT, w, xs, B, out, ldo, g0, g1);                                         \
    }
DEFINE_GROUPS(groups_q4_0, CF_Q4_0)
DEFINE_GROUPS(groups_q4_1, CF_Q4_1)
DEFINE_GROUPS(groups_q8_0, CF_Q8_0)
#define DEFINE_KQ_GROUPS(NAME, DT)                                                             \
    NOINLINE void NAME(const cf_tiled *w, const cf_act_q8 *xs, int B, float *out, int ldo, int g0, \
                       int g1) {                                                               \
        kq5_matmat_groups(DT, w, xs, B, out, ldo, g0, g1);                                     \
    }
DEFINE_KQ_GROUPS(groups_q4_k, CF_Q4_K)
DEFINE_KQ_GROUPS(groups_q5_k, CF_Q5_K)
DEFINE_KQ_GROUPS(groups_q6_k, CF_Q6_K)

INLINE void any_matmat_groups(int dtype, const cf_tiled *w, const cf_act_q8 *xs, int B, float *out,
                              int ldo, int g0, int g1) {
    /* the one-stream path, the pair path, the L1 buffer: by batch size (measured, above) */
#define PICK(NAME) (B <= SQ_MAX_B ? NAME##_sq : B <= g_sg_max_b ? NAME##_sg : B <= SB_MAX_B ? NAME##_sb : NAME##_mm)
    switch (dtype) {
    case CF_Q4_0: PICK(groups_q4_0)(w, xs, B, out, ldo, g0, g1); break;
    case CF_Q4_1: PICK(groups_q4_1)(w, xs, B, out, ldo, g0, g1); break;
    case CF_Q8_0: PICK(groups_q8_0)(w, xs, B, out, ldo, g0, g1); break;
    case CF_Q4_K: groups_q4_k(w, xs, B, out, ldo, g0, g1); break;
    case CF_Q5_K: groups_q5_k(w, xs, B, out, ldo, g0, g1); break;
    default: groups_q6_k(w, xs, B, out, ldo, g0, g1); break;
    }
#undef PICK
}

/* Tiles wider than the buffer (tile_cols > 512) take the base table's matmat: the same values. */
static int fits(const cf_tiled *w) {
    return cf_is_kquant(w->dtype) ? w->tile_cols / CF_QK_K <= KQ5_KT : w->tile_cols / CF_QK <= MM5_KT;
}

#define DEFINE_MATMAT(NAME, DT)                                                                \
    static void NAME(const cf_tiled *w, const cf_act_q8 *xs, int B, float *y, int ldy, int g0,  \
                     int g1) {                                                                 \
        if (!fits(w)) {                                                                        \
            atomic_load(&g_base)->matmat[DT](w, xs, B, y, ldy, g0, g1);                                      \
            return;                                                                            \
        }                                                                                      \
        any_matmat_groups(DT, w, xs, B, y + (size_t)g0 * CF_G, ldy, g0, g1);                   \
    }
DEFINE_MATMAT(matmat_q4_0_avx512, CF_Q4_0)
DEFINE_MATMAT(matmat_q4_1_avx512, CF_Q4_1)
DEFINE_MATMAT(matmat_q8_0_avx512, CF_Q8_0)
DEFINE_MATMAT(matmat_q4_k_avx512, CF_Q4_K)
DEFINE_MATMAT(matmat_q5_k_avx512, CF_Q5_K)
DEFINE_MATMAT(matmat_q6_k_avx512, CF_Q6_K)

/* ---- fused gate+up+SiLU, batched ----------------------------------------------------------- */

/* exp_ps16 / silu_ps16: simd_silu.h, lane for lane its exp_ps / silu_ps, so gate_up_mm equals the
 * inherited gate_up bit for bit. */

#define GATE_UP_MM_NB 64   /* tokens per pass */
#define GATE_UP_MM_PAIRS 8 /* pairs per pass: the gate/up scratch is 64 x 128 floats, 32 KiB */

/* kernels_avx2.inc's gate_up_mm over this file's matmat_groups: passes of pairs cut at band edges
 * (a row's sum depends only on its tiles' order), then y = silu(gate) * up two pairs per zmm. */
static void gate_up_mm(int dtype, const cf_tiled *w, const cf_act_q8 *xs, int B, float *y, int ldy,
                       int p0, int p1) {
    enum { LD = 2 * CF_G * GATE_UP_MM_PAIRS };
    float gu[GATE_UP_MM_NB * LD]; /* [b][pair][gate 8, up 8] */
    const __m512i gate_idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i up_idx = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    int gpb = w->tile_rows / CF_G;
    for (int p = p0; p < p1;) {
        int band_end_pair = ((2 * p) / gpb + 1) * gpb / 2;
        int pe = cf_min(cf_min(p1, p + GATE_UP_MM_PAIRS), cf_max(p + 1, band_end_pair));
        for (int b0 = 0; b0 < B; b0 += GATE_UP_MM_NB) {
            int nb = cf_min(GATE_UP_MM_NB, B - b0);
            any_matmat_groups(dtype, w, xs + b0, nb, gu, LD, 2 * p, 2 * pe);
            for (int b = 0; b < nb; b++) {
                const float *gb = gu + (size_t)b * LD;
                float *yb = y + (size_t)(b0 + b) * ldy + (size_t)p * CF_G;
                for (int j = 0; j < pe - p; j += 2) {
                    /* pairs j, j+1: [gate 8, up 8, gate 8, up 8]; a lone last pair reads zeros */
                    int pair2 = j + 1 < pe - p;
                    __mmask16 m = pair2 ? 0xffff : 0x00ff;
                    __m512 lo = _mm512_loadu_ps(gb + 16 * j);
                    __m512 hi = _mm512_maskz_loadu_ps(pair2 ? 0xffff : 0, gb + 16 * j + 16);
                    __m512 g = _mm512_permutex2var_ps(lo, gate_idx, hi), u = _mm512_permutex2var_ps(lo, up_idx, hi);
                    _mm512_mask_storeu_ps(yb + 8 * j, m, _mm512_mul_ps(silu_ps16(g), u));
                }
            }
        }
        p = pe;
    }
}

#define DEFINE_GATE_UP_MM(NAME, DT)                                                            \
    static void NAME(const cf_tiled *w, const cf_act_q8 *xs, int B, float *y, int ldy, int p0,  \
                     int p1) {                                                                 \
        if (!fits(w)) {                                                                        \
            atomic_load(&g_base)->gate_up_mm[DT](w, xs, B, y, ldy, p0, p1);                                  \
            return;                                                                            \
        }                                                                                      \
        gate_up_mm(DT, w, xs, B, y, ldy, p0, p1);                                              \
    }
DEFINE_GATE_UP_MM(gate_up_mm_q4_0_avx512, CF_Q4_0)
DEFINE_GATE_UP_MM(gate_up_mm_q4_1_avx512, CF_Q4_1)
DEFINE_GATE_UP_MM(gate_up_mm_q8_0_avx512, CF_Q8_0)
DEFINE_GATE_UP_MM(gate_up_mm_q4_k_avx512, CF_Q4_K)
DEFINE_GATE_UP_MM(gate_up_mm_q5_k_avx512, CF_Q5_K)
DEFINE_GATE_UP_MM(gate_up_mm_q6_k_avx512, CF_Q6_K)

/* ---- Gated DeltaNet head (cflow.h deltanet_head) ----------------------------------------- */

/* The head in column blocks of up to DN_COLS value dims whose sums stay in zmm registers over the
 * key rows (kernels_avx2.inc's version keeps them in memory, a load and a store per row and
 * vector). Pass 1 only reads S: rec = decay (S^T k), the same sum as the reference's over the
 * decayed S up to rounding (decay factored out of it); pass 2 writes S = decay S + k delta and
 * sums S^T q, the reference's operations per element. Per value dim the sums run over the key
 * dims in the reference's order. The last vector of a block is masked (odd head dims). */
#define DN_COLS 128 /* 8 zmm of sums per pass (Qwen3.5's head dim: one block) */

INLINE void dn_block(float *S, int dh, int j0, const float *q, const float *k, const float *v, float decay,
                     float beta, float *o, const int nv, __mmask16 tail) {
    __m512 sum[DN_COLS / 16], delta[DN_COLS / 16];
    const __m512 vdecay = _mm512_set1_ps(decay), vbeta = _mm512_set1_ps(beta);
#define DN_MASK(t) ((t) == nv - 1 ? tail : (__mmask16)0xFFFF)
    for (int t = 0; t < nv; t++) sum[t] = _mm512_setzero_ps();
    for (int i = 0; i < dh; i++) { /* pass 1: S^T k */
        const float *Si = S + (size_t)i * dh + j0;
        const __m512 ki = _mm512_set1_ps(k[i]);
        for (int t = 0; t < nv; t++)
            sum[t] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(DN_MASK(t), Si + 16 * t), ki, sum[t]);
    }
    for (int t = 0; t < nv; t++) { /* the correction beta (v - decay S^T k) */
        const __m512 vj = _mm512_maskz_loadu_ps(DN_MASK(t), v + j0 + 16 * t);
        delta[t] = _mm512_mul_ps(vbeta, _mm512_sub_ps(vj, _mm512_mul_ps(sum[t], vdecay)));
        sum[t] = _mm512_setzero_ps();
    }
    for (int i = 0; i < dh; i++) { /* pass 2: S = decay S + k delta, and S^T q */
        float *Si = S + (size_t)i * dh + j0;
        const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
        for (int t = 0; t < nv; t++) {
            __m512 s = _mm512_mul_ps(_mm512_maskz_loadu_ps(DN_MASK(t), Si + 16 * t), vdecay);
            s = _mm512_fmadd_ps(ki, delta[t], s);
            _mm512_mask_storeu_ps(Si + 16 * t, DN_MASK(t), s);
            sum[t] = _mm512_fmadd_ps(s, qi, sum[t]);
        }
    }
    for (int t = 0; t < nv; t++) _mm512_mask_storeu_ps(o + j0 + 16 * t, DN_MASK(t), sum[t]);
#undef DN_MASK
}

static void deltanet_head_avx512(float *S, const float *q, const float *k, const float *v, float decay, float beta,
                                 float *o, int dh) {
    for (int j0 = 0; j0 < dh; j0 += DN_COLS) {
        const int nj = dh - j0 < DN_COLS ? dh - j0 : DN_COLS, nv = (nj + 15) / 16;
        const __mmask16 tail = (__mmask16)(nj % 16 ? (1u << (nj % 16)) - 1 : 0xFFFF);
        switch (nv) { /* a constant count per case: the sums stay in registers */
        case 8: dn_block(S, dh, j0, q, k, v, decay, beta, o, 8, tail); break;
        case 7: dn_block(S, dh, j0, q, k, v, decay, beta, o, 7, tail); break;
        case 6: dn_block(S, dh, j0, q, k, v, decay, beta, o, 6, tail); break;
        case 5: dn_block(S, dh, j0, q, k, v, decay, beta, o, 5, tail); break;
        case 4: dn_block(S, dh, j0, q, k, v, decay, beta, o, 4, tail); break;
        case 3: dn_block(S, dh, j0, q, k, v, decay, beta, o, 3, tail); break;
        case 2: dn_block(S, dh, j0, q, k, v, decay, beta, o, 2, tail); break;
        default: dn_block(S, dh, j0, q, k, v, decay, beta, o, 1, tail); break;
        }
    }
}

/* ---- the table --------------------------------------------------------------------------- */

/* kernels_kquant_avx512.c: K-quant-file mat-vec, gate/up, small batches */
void cf_kquant_avx512_install(cf_kernel_table *t, const cf_kernel_table *base);
/* kernels_attn_avx512.c: attention over the fp16 cache, per query and in blocks */
void cf_attn_avx512_install(cf_kernel_table *t, const cf_kernel_table *base);
static cf_kernel_table g_table;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void table_init(void) {
    g_table = *atomic_load(&g_base);
    g_table.name = "avx512";
    g_sg_max_b = cf_avx512_small_batch_groups() ? SG_MAX_B : 0;
    g_table.matmat[CF_Q4_0] = matmat_q4_0_avx512;
    g_table.matmat[CF_Q4_1] = matmat_q4_1_avx512;
    g_table.matmat[CF_Q8_0] = matmat_q8_0_avx512;
    g_table.gate_up_mm[CF_Q4_0] = gate_up_mm_q4_0_avx512;
    g_table.gate_up_mm[CF_Q4_1] = gate_up_mm_q4_1_avx512;
    g_table.gate_up_mm[CF_Q8_0] = gate_up_mm_q8_0_avx512;
    g_table.matmat[CF_Q4_K] = matmat_q4_k_avx512;
    g_table.matmat[CF_Q5_K] = matmat_q5_k_avx512;
    g_table.matmat[CF_Q6_K] = matmat_q6_k_avx512;
    g_table.gate_up_mm[CF_Q4_K] = gate_up_mm_q4_k_avx512;
    g_table.gate_up_mm[CF_Q5_K] = gate_up_mm_q5_k_avx512;
    g_table.gate_up_mm[CF_Q6_K] = gate_up_mm_q6_k_avx512;
    g_table.deltanet_head = deltanet_head_avx512;
    cf_kquant_avx512_install(&g_table, atomic_load(&g_base));
    cf_attn_avx512_install(&g_table, atomic_load(&g_base));
}

/* base: the best AVX2-family table of this CPU (always the same one; the first call wins). */
const cf_kernel_table *cf_kernels_avx512(const cf_kernel_table *base) {
    const cf_kernel_table *none = NULL;
    atomic_compare_exchange_strong(&g_base, &none, base);
    pthread_once(&g_once, table_init);
    return &g_table;
}
