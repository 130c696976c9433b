/* kernels_ref.h — the scalar reference pieces (kernels_ref.c) that the ISA kernel files call
 * directly, for shapes their fast paths skip: a short last row group, a head_dim that is not a
 * multiple of 8. Each is the same code the "ref" table runs, so a fallback is the reference.
 */
#ifndef CFLOW_KERNELS_REF_H
#define CFLOW_KERNELS_REF_H

#include "cflow.h"

/* out[r - g0*CF_G] = row r of W x for the rows of groups [g0, g1) (any group size). */
void cf_matvec_groups_ref(const cf_tiled *w, const cf_act_q8 *x, float *out, int g0, int g1);
void cf_attention_ref(float *out, const float *q, const cf_half *k, const cf_half *v, float *att,
                      const cf_attn_shape *s, int h0, int h1);

#endif /* CFLOW_KERNELS_REF_H */
