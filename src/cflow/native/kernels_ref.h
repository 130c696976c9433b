/* kernels_ref.h — the scalar reference pieces (kernels_ref.c) that the ISA kernel files call
 * directly, for shapes their fast paths skip: a short last row group, a head_dim that is not a
 * multiple of 8. Each is the same code the "ref" table runs, so a fallback is the reference.
 */
#ifndef CFLOW_KERNELS_REF_H
#define CFLOW_KERNELS_REF_H

#include "cflow.h"

/* out[r - g0*CF_G] = row r of W x for the rows of groups [g0, g1) (any group size). */
void cf_matvec_groups_ref(const cf_tiled *w, const cf_act_q8 *x, float *out, int g0, int g1);
/* Row r of W dequantized, any dtype (the ref table's embed_row). */
void cf_embed_row_ref(const cf_tiled *w, int r, float *out);
void cf_attention_ref(float *out, const float *q, const cf_half *k, const cf_half *v, float *att,
                      const cf_attn_shape *s, int h0, int h1);
void cf_attention_block_ref(float *out, const float *q, const cf_half *k, const cf_half *v,
                            float *att, const cf_attn_block_shape *s, int h0, int h1);
void cf_attention_q8kv_ref(float *out, const float *q, const void *k, const void *v, int k_type, int v_type,
                           float *att, const cf_attn_shape *s, int h0, int h1);
void cf_attention_block_q8kv_ref(float *out, const float *q, const void *k, const void *v, int k_type,
                                 int v_type, float *att, const cf_attn_block_shape *s, int h0, int h1);

/* kernels_kquant_ref.c: the Q5_0 / Q5_1 / MXFP4 / K-quant blocks, one row and one block at a time. */
extern const int8_t cf_mxfp4_values[16]; /* MXFP4's E2M1 values doubled, by nibble */
float cf_e8m0_half(uint8_t e);           /* half an E8M0 scale, 2^(e - 128), as ggml decodes it */
#define CF_KBLOCK_MAX 210 /* bytes of the largest block (Q6_K) */
void cf_quantize_act_k_ref(const float *x, cf_act_q8 *out);
/* Row i's block out of a chunk of g rows (cf_tile_fields), back in GGML byte order. */
void cf_kq_gather(int dtype, const uint8_t *chunk, int g, int i, uint8_t *blk);
/* One GGML block (block column kb) times the activation: Q5_0 / Q5_1 / MXFP4 read x's 32-block fields,
 * the K-quants its 256-block fields (cflow.h). */
float cf_kq_block_dot(int dtype, const uint8_t *blk, const cf_act_q8 *x, int kb);
/* One GGML block to fp32, bit for bit cflow.kquant.dequantize_k. */
void cf_kq_dequant_block(int dtype, const uint8_t *blk, float *out);

#endif /* CFLOW_KERNELS_REF_H */
