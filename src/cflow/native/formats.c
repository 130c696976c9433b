/* formats.c — the block formats' scalar definitions: dtype names, bytes per block and per tiled
 * matrix, and the fp16 <-> fp32 conversions. Kernels of every ISA and the engine use these, so
 * they live apart from any kernel file (kernels_internal.h's tile walk needs cf_block_bytes).
 *
 * Out of line on purpose: they are called once per tile or per scale, and keeping them in one
 * object file keeps every kernel's code exactly what it was.
 */
#include <string.h>

#include "cflow.h"

/* ---- dtypes ------------------------------------------------------------------------------ */

/* Names as cflow.dtypes spells them; NULL where GGML has an id the core does not run. */
const char *const cf_dtype_names[CF_DTYPE_IDS] = {
    [CF_F32] = "f32",   [CF_F16] = "f16",   [CF_Q4_0] = "q4_0", [CF_Q4_1] = "q4_1",
    [CF_Q5_0] = "q5_0", [CF_Q5_1] = "q5_1", [CF_Q8_0] = "q8_0", [CF_Q4_K] = "q4_k",
    [CF_Q5_K] = "q5_k", [CF_Q6_K] = "q6_k", [CF_MXFP4] = "mxfp4",
};

/* ---- tile geometry ----------------------------------------------------------------------- */

size_t cf_block_bytes(int dtype) {
    switch (dtype) {
    case CF_F32: return 128;
    case CF_F16: return 64;
    case CF_Q4_0: return 18;
    case CF_Q4_1: return 20;
    case CF_Q5_0: return 22;
    case CF_Q5_1: return 24;
    case CF_Q8_0: return 34;
    case CF_Q4_K: return 144;
    case CF_Q5_K: return 176;
    case CF_Q6_K: return 210;
    case CF_MXFP4: return 17;
    default: return 0;
    }
}

size_t cf_tiled_bytes(const cf_tiled *w) {
    /* Tiling only reorders blocks, so the size is that of the plain blocks. */
    return (size_t)w->rows * (size_t)(w->cols / cf_block_weights(w->dtype)) * cf_block_bytes(w->dtype);
}

/* ---- fp16 -------------------------------------------------------------------------------- */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float cf_half_to_float(cf_half h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 31) return f32_from_bits(sign | 0x7f800000u | (m << 13)); /* inf / nan */
    if (e != 0) return f32_from_bits(sign | ((e + 112) << 23) | (m << 13));
    if (m == 0) return f32_from_bits(sign);
    /* Subnormal: shift the mantissa up until its leading one becomes the implicit bit. */
    uint32_t ef = 113;
    while (!(m & 0x400)) {
        m <<= 1;
        ef--;
    }
    return f32_from_bits(sign | (ef << 23) | ((m & 0x3ff) << 13));
}

/* Integer-only, so it rounds exactly like vcvtps2ph (nearest even) whatever the FP flags. */
cf_half cf_float_to_half(float f) {
    uint32_t x = f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) /* inf stays inf; nan stays a quiet nan */
        return (cf_half)(sign | (ax > 0x7f800000u ? 0x7e00 | ((ax >> 13) & 0x3ff) : 0x7c00));
    if (ax >= 0x477ff000u) return (cf_half)(sign | 0x7c00); /* >= 65520 rounds to inf */
    if (ax >= 0x38800000u) {                                  /* normal half */
        uint32_t r = ax - 0x38000000u;                        /* rebias 127 -> 15 */
        r += 0xfff + ((r >> 13) & 1);
        return (cf_half)(sign | (r >> 13));
    }
    if (ax <= 0x33000000u) return (cf_half)sign; /* <= 2^-25 rounds to zero */
    /* Subnormal half: value in units of 2^-24 is m * 2^(e - 126); round the shifted-out bits. */
    uint32_t e = ax >> 23, m = (ax & 0x7fffff) | 0x800000;
    uint32_t shift = 126 - e; /* 14..24 */
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) q++;
    return (cf_half)(sign | q);
}
