/* kernels_kquant_ref.c — the scalar reference of the K-quant formats (Q4_K, Q5_K, Q6_K), of
 * the 32-block formats llama.cpp writes beside them (Q5_0, Q5_1) and of MXFP4 (gpt-oss's experts:
 * an E8M0 exponent byte and 32 E2M1 nibbles, cf_mxfp4_values): the 256-block activation
 * quantizer, one row's dot product with one block, and one block dequantized. kernels_ref.c
 * walks the tiles and calls these for the new dtypes; the ISA files fall back to them.
 *
 * Each block is first gathered out of its tile chunk into GGML's byte order (cf_kq_gather), so
 * the arithmetic below reads like ggml's and like cflow/kquant.py, which it must match: the dot
 * products form exactly the integers of kquant.kquant_dots (then scale them in float32), and
 * the dequantization is bit for bit kquant.dequantize_k (same float32 operations in the same
 * order; CMakeLists.txt builds this file with -ffp-contract=off so no FMA fuses them).
 */
#include <math.h>
#include <string.h>

#include "cflow.h"
#include "kernels_internal.h"
#include "kquant_scales.h"
#include "kernels_ref.h"

/* ---- the 256-block activation ------------------------------------------------------------ */

/* Per 256 values d = max|x| / 127, q = round_half_away(x * (1/d)) (0 where d = 0), and the sum of
 * each 16 q as int16 (|sum| <= 2032): the 32-block rule of quantize_act over 256 values. */
void cf_quantize_act_k_ref(const float *x, cf_act_q8 *out) {
    for (int b = 0; b < out->n / CF_QK_K; b++) {
        const float *xb = x + (size_t)b * CF_QK_K;
        int8_t *q = out->qk + (size_t)b * CF_QK_K;
        float amax = 0.0f;
        for (int j = 0; j < CF_QK_K; j++) amax = fmaxf(amax, fabsf(xb[j]));
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < CF_QK_K; j++) q[j] = (int8_t)(int)roundf(xb[j] * id);
        for (int j = 0; j < CF_QK_K / 16; j++) {
            int sum = 0;
            for (int k = 0; k < 16; k++) sum += q[16 * j + k];
            out->bsums[(size_t)b * (CF_QK_K / 16) + j] = (int16_t)sum;
        }
        out->dk[b] = d;
    }
}

/* ---- one block --------------------------------------------------------------------------- */

/* MXFP4's E2M1 values doubled (0, .5, 1, 1.5, 2, 3, 4, 6, negatives; nibble 8 is -0), so the
 * kernels dot integers; the scale is halved to match (cf_e8m0_half). cflow.kquant.MXFP4_VALUES. */
const int8_t cf_mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

float cf_e8m0_half(uint8_t e) {
    /* 2^(e - 128): the float with exponent field e - 1, or for e < 2 the subnormal 2^-128 / 2^-127
     * (ggml's GGML_E8M0_TO_FP32_HALF; no NaN for 255) */
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

void cf_kq_gather(int dtype, const uint8_t *chunk, int g, int i, uint8_t *blk) {
    const cf_kfields *fs = cf_tile_fields(dtype);
    for (int f = 0; f < fs->n; f++)
        memcpy(blk + fs->f[f].ggml, chunk + (size_t)g * fs->f[f].tile + (size_t)i * fs->f[f].size, fs->f[f].size);
}

static float half_at(const uint8_t *p) {
    cf_half h;
    memcpy(&h, p, 2);
    return cf_half_to_float(h);
}

/* The unsigned quants of a GGML block in weight order (cflow.kquant.unpack_q). */
static void unpack_q(int dtype, const uint8_t *b, uint8_t *q) {
    switch (dtype) {
    case CF_MXFP4: /* the nibbles' indices into cf_mxfp4_values, Q4_0's order */
        for (int j = 0; j < 16; j++) {
            q[j] = b[1 + j] & 15;
            q[j + 16] = b[1 + j] >> 4;
        }
        break;
    case CF_Q5_0:
    case CF_Q5_1: {
        const uint8_t *qh = b + (dtype == CF_Q5_0 ? 2 : 4), *qs = qh + 4;
        uint32_t h = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
        for (int j = 0; j < 16; j++) {
            q[j] = (uint8_t)((qs[j] & 15) | ((h >> j) & 1) << 4);
            q[j + 16] = (uint8_t)((qs[j] >> 4) | ((h >> (j + 16)) & 1) << 4);
        }
        break;
    }
    case CF_Q4_K:
    case CF_Q5_K: {
        const uint8_t *qh = b + 16, *qs = b + (dtype == CF_Q4_K ? 16 : 48);
        for (int c = 0; c < 4; c++) /* run c: sub-block 2c in the low nibbles, 2c+1 in the high */
            for (int l = 0; l < 32; l++) {
                q[64 * c + l] = qs[32 * c + l] & 15;
                q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
            }
        if (dtype == CF_Q5_K) /* bit s of qh[l]: the 5th bit of weight 32 s + l */
            for (int s = 0; s < 8; s++)
                for (int l = 0; l < 32; l++) q[32 * s + l] |= (uint8_t)(((qh[l] >> s) & 1) << 4);
        break;
    }
    case CF_Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++)
                for (int s = 0; s < 4; s++) { /* weight 128h + 32s + l */
                    uint8_t lo = ql[64 * h + 32 * (s & 1) + l];
                    lo = s < 2 ? lo & 15 : lo >> 4;
                    q[128 * h + 32 * s + l] = (uint8_t)(lo | ((qh[32 * h + l] >> (2 * s)) & 3) << 4);
                }
        break;
    }
    }
}

float cf_kq_block_dot(int dtype, const uint8_t *b, const cf_act_q8 *x, int kb) {
    uint8_t q[CF_QK_K];
    unpack_q(dtype, b, q);
    if (dtype == CF_MXFP4) { /* no offset: the values are signed; one scale per block */
        const int8_t *xq = x->qs + (size_t)kb * CF_QK;
        int isum = 0;
        for (int j = 0; j < CF_QK; j++) isum += cf_mxfp4_values[q[j]] * xq[j];
        return cf_e8m0_half(b[0]) * (x->d[kb] * (float)isum);
    }
    float d = half_at(b + (dtype == CF_Q6_K ? 208 : 0));
    if (dtype == CF_Q5_0 || dtype == CF_Q5_1) { /* as Q4_0 / Q4_1: the offset through s */
        const int8_t *xq = x->qs + (size_t)kb * CF_QK;
        int isum = 0;
        for (int j = 0; j < CF_QK; j++) isum += q[j] * xq[j];
        float dot = d * (x->d[kb] * (float)isum);
        if (dtype == CF_Q5_0) dot -= 16.0f * d * x->s[kb];
        else dot += half_at(b + 2) * x->s[kb];
        return dot;
    }
    const int8_t *xq = x->qk + (size_t)kb * CF_QK_K;
    const int16_t *bs = x->bsums + (size_t)kb * (CF_QK_K / 16);
    float dx = x->dk[kb];
    int sum_qd = 0;
    if (dtype == CF_Q6_K) { /* 16 sub-blocks of 16, int8 scales; the -32 through the sums */
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int s = 0; s < 16; s++) {
            int dot = 0;
            for (int j = 0; j < 16; j++) dot += q[16 * s + j] * xq[16 * s + j];
            sum_qd += sc[s] * (dot - 32 * bs[s]);
        }
        return d * dx * (float)sum_qd;
    }
    uint8_t sc[8], m[8];
    int sum_mb = 0;
    kq_scale_min_k4(b + 4, sc, m);
    for (int s = 0; s < 8; s++) {
        int dot = 0;
        for (int j = 0; j < 32; j++) dot += q[32 * s + j] * xq[32 * s + j];
        sum_qd += sc[s] * dot;
        sum_mb += m[s] * (bs[2 * s] + bs[2 * s + 1]);
    }
    return d * dx * (float)sum_qd - half_at(b + 2) * dx * (float)sum_mb;
}

void cf_kq_dequant_block(int dtype, const uint8_t *b, float *out) {
    uint8_t q[CF_QK_K];
    unpack_q(dtype, b, q);
    if (dtype == CF_MXFP4) {
        float d = cf_e8m0_half(b[0]);
        for (int j = 0; j < CF_QK; j++) out[j] = d * (float)cf_mxfp4_values[q[j]];
        return;
    }
    float d = half_at(b + (dtype == CF_Q6_K ? 208 : 0));
    switch (dtype) {
    case CF_Q5_0:
        for (int j = 0; j < CF_QK; j++) out[j] = d * (float)(q[j] - 16);
        break;
    case CF_Q5_1: {
        float m = half_at(b + 2);
        for (int j = 0; j < CF_QK; j++) out[j] = d * (float)q[j] + m;
        break;
    }
    case CF_Q4_K:
    case CF_Q5_K: {
        uint8_t sc[8], m[8];
        kq_scale_min_k4(b + 4, sc, m);
        float dmin = half_at(b + 2);
        for (int s = 0; s < 8; s++) {
            float dl = d * (float)sc[s], ml = dmin * (float)m[s];
            for (int j = 0; j < 32; j++) out[32 * s + j] = dl * (float)q[32 * s + j] - ml;
        }
        break;
    }
    case CF_Q6_K: {
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int s = 0; s < 16; s++) {
            float dl = d * (float)sc[s];
            for (int j = 0; j < 16; j++) out[16 * s + j] = dl * (float)(q[16 * s + j] - 32);
        }
        break;
    }
    }
}
