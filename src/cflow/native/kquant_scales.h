/* kquant_scales.h — Q4_K / Q5_K's packed 6-bit scales and mins: one definition of the decoding
 * (ggml's get_scale_min_k4) for every kernel that reads them. kq_scale_min_k4 is the plain one row
 * at a time (the reference kernels, the avx512 batched unpack); kq_scale_min_pair decodes two rows
 * at once with AVX2 for the AVX2-family K-quant kernels (kernels_kquant_avx2.inc) and the avx512
 * table's (kernels_kquant_avx512.c), which lay the result out differently but must read the same
 * values. The vector one is defined only where the file is compiled with -mavx2. */
#ifndef CFLOW_KQUANT_SCALES_H
#define CFLOW_KQUANT_SCALES_H

#include <stdint.h>

/* The 12 scale bytes at s -> 8 scales and 8 mins, each 0..63:
 *   j < 4:  sc_j = s[j] & 63              m_j = s[j+4] & 63
 *   j >= 4: sc_j = (s[j+4] & 15) | (s[j-4] >> 6) << 4    m_j = (s[j+4] >> 4) | (s[j] >> 6) << 4 */
static inline void kq_scale_min_k4(const uint8_t *s, uint8_t *sc, uint8_t *m) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 15) | (s[j] >> 6) << 4);
        m[j + 4] = (uint8_t)((s[j + 8] >> 4) | (s[j + 4] >> 6) << 4);
    }
}

#ifdef __AVX2__
#include <immintrin.h>

/* kq_scale_min_k4 for the two rows whose 12-byte scale fields are the 24 bytes at s (row 2j in the
 * low 128-bit lane, 2j+1 in the high one). Per lane, bytes 0..7 = the scales, 8..15 = the mins.
 * Loads 32 bytes at s: the caller's chunk must hold 8 more after the pair. */
static inline __attribute__((always_inline)) __m256i kq_scale_min_pair(const uint8_t *s) {
    const __m256i pick = _mm256_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11,
                                          0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11);
    const __m256i tops = _mm256_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7,
                                          -1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7);
    const __m256i m_low = _mm256_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0,
                                           63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
    const __m256i m_nib = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15,
                                           0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15);
    __m256i v = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)s),
                                            _mm256_setr_epi32(0, 1, 2, 2, 3, 4, 5, 5));
    __m256i a = _mm256_shuffle_epi8(v, pick), b = _mm256_shuffle_epi8(v, tops);
    __m256i low = _mm256_or_si256(_mm256_and_si256(a, m_low), _mm256_and_si256(_mm256_srli_epi16(a, 4), m_nib));
    return _mm256_or_si256(low, _mm256_and_si256(_mm256_srli_epi16(b, 2), _mm256_set1_epi8(0x30)));
}

#endif /* __AVX2__ */

#endif /* CFLOW_KQUANT_SCALES_H */
