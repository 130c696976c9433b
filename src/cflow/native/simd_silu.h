/* simd_silu.h — exp and SiLU on 8 floats (AVX2 + FMA) and the fused gate/up pass over a mat-vec,
 * one definition for every file that needs them bit for bit alike: kernels_avx2.inc's gate_up and
 * the avx512 table's K-quant gate_up (kernels_kquant_avx512.c) must round exactly as each other, so
 * they share these lines rather than copies; the 16-float exp/SiLU of the AVX-512 files is here too,
 * lane for lane the same operations. Include in a file compiled with -mavx2 -mfma, after cflow.h and
 * util.h (cf_tiled, cf_act_q8, CF_G, cf_min / cf_max). */
#ifndef CFLOW_SIMD_SILU_H
#define CFLOW_SIMD_SILU_H

#include <immintrin.h>

/* exp(x) for a vector: Cephes' range reduction and degree-5 polynomial (~1-2 ulp). */
static inline __attribute__((always_inline)) __m256 exp_ps(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365447504f)); /* keep 2^n a normal float */
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                               _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline __attribute__((always_inline)) __m256 silu_ps(__m256 g) {
    __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

#define CF_GATE_UP_CHUNK 32 /* pairs per pass: gate/up outputs of 512 floats stay in L1 */

/* name(dtype, w, x, y, p0, p1): y[pair p] = silu(gate) * up for pairs p0..p1 of a fused gate/up
 * matrix, over matvec_groups(dtype, w, x, out, g0, g1), which writes groups g0..g1 (gate and up
 * rows of a pair are its two groups). Each pass stops at the band edge so it walks each tile of
 * one band once. */
#define CF_DEFINE_GATE_UP(name, matvec_groups)                                                        \
    static inline __attribute__((always_inline)) void name(int dtype, const cf_tiled *w,              \
                                                           const cf_act_q8 *x, float *y, int p0,      \
                                                           int p1) {                                  \
        float gu[2 * CF_G * CF_GATE_UP_CHUNK]; /* per pair: gate[8], up[8] */                          \
        int gpb = w->tile_rows / CF_G;                                                                \
        for (int p = p0; p < p1;) {                                                                   \
            int band_end_pair = ((2 * p) / gpb + 1) * gpb / 2;                                        \
            int pe = cf_min(cf_min(p1, p + CF_GATE_UP_CHUNK), cf_max(p + 1, band_end_pair));          \
            matvec_groups(dtype, w, x, gu, 2 * p, 2 * pe);                                            \
            for (int j = 0; j < pe - p; j++) {                                                        \
                __m256 g = _mm256_loadu_ps(gu + 16 * j), u = _mm256_loadu_ps(gu + 16 * j + 8);        \
                _mm256_storeu_ps(y + (size_t)(p + j) * CF_G, _mm256_mul_ps(silu_ps(g), u));           \
            }                                                                                         \
            p = pe;                                                                                   \
        }                                                                                             \
    }

/* name(dtype, w, xs, B, y, ldy, p0, p1): the batched form, y + b*ldy for activations b < B, over
 * matmat_groups(dtype, w, xs, nb, out, ldo, g0, g1) (cflow.h's matmat contract) in passes of PAIRS
 * pairs cut at band edges and of NB activations; per row the same sums and silu as the mat-vec's
 * gate/up, so the same bits. */
#define CF_DEFINE_GATE_UP_MM(name, matmat_groups, NB, PAIRS)                                              \
    static inline __attribute__((always_inline)) void name(int dtype, const cf_tiled *w, const cf_act_q8 *xs, \
                                                           int B, float *y, int ldy, int p0, int p1) {   \
        enum { LD = 2 * CF_G * (PAIRS) };                                                                 \
        float gu[(NB) * LD]; /* [b][pair][gate 8, up 8] */                                                \
        int gpb = w->tile_rows / CF_G;                                                                    \
        for (int p = p0; p < p1;) {                                                                       \
            int band_end_pair = ((2 * p) / gpb + 1) * gpb / 2;                                            \
            int pe = cf_min(cf_min(p1, p + (PAIRS)), cf_max(p + 1, band_end_pair));                       \
            for (int b0 = 0; b0 < B; b0 += (NB)) {                                                        \
                int nb = cf_min((NB), B - b0);                                                            \
                matmat_groups(dtype, w, xs + b0, nb, gu, LD, 2 * p, 2 * pe);                              \
                for (int b = 0; b < nb; b++) {                                                            \
                    const float *gb = gu + (size_t)b * LD;                                                \
                    float *yb = y + (size_t)(b0 + b) * ldy;                                               \
                    for (int j = 0; j < pe - p; j++) {                                                    \
                        __m256 g = _mm256_loadu_ps(gb + 16 * j), u = _mm256_loadu_ps(gb + 16 * j + 8);    \
                        _mm256_storeu_ps(yb + (size_t)(p + j) * CF_G, _mm256_mul_ps(silu_ps(g), u));      \
                    }                                                                                     \
                }                                                                                         \
            }                                                                                             \
            p = pe;                                                                                       \
        }                                                                                                 \
    }

#ifdef __AVX512F__
/* exp_ps and silu_ps on 16 lanes (files compiled with AVX-512: kernels_avx512.c's gate_up_mm,
 * kernels_attn_avx512.c's softmax): the same constants and operations, each exactly rounded per
 * lane, so a lane's value is exp_ps's bit for bit. */
static inline __attribute__((always_inline)) __m512 exp_ps16(__m512 x) {
    x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3365447504f));
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201E-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

static inline __attribute__((always_inline)) __m512 silu_ps16(__m512 g) {
    __m512 e = exp_ps16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}
#endif

#endif /* CFLOW_SIMD_SILU_H */
