/* deltanet.h — one token of a Gated DeltaNet ("linear attention") layer, Qwen3.5's recurrent mixer,
 * as llama.cpp computes it (src/models/qwen35.cpp, delta-net-base.cpp; pinned down against it by
 * tests/test_qwen35.py). The projections around it (attn_qkv, attn_gate, ssm_alpha, ssm_beta in,
 * ssm_out out) are ordinary mat-vecs the caller runs; this owns what lies between them and the
 * per-sequence state that replaces a KV cache on these layers.
 *
 * Sizes: Hk q/k heads and Hv v heads (Hv a multiple of Hk; v head h reads q/k head h % Hk), one
 * head dim dh for both (llama.cpp's ssm.state_size), conv_dim = 2 Hk dh + Hv dh channels.
 * State per sequence and layer: conv (K-1) x conv_dim floats (the previous K-1 tokens' conv inputs,
 * oldest first, zeros at the start) and S, Hv x dh x dh floats (per head [key dim][value dim]).
 */
#ifndef CFLOW_DELTANET_H
#define CFLOW_DELTANET_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int n_k_heads, n_v_heads, head_dim, conv_kernel;
    float eps;            /* the file's rms eps: the L2 norms' floor and the gated RMSNorm's */
    const float *conv_w;  /* [conv_dim][conv_kernel], tap conv_kernel-1 weighs the current token */
    const float *dt_bias; /* [n_v_heads] (ssm_dt.bias) */
    const float *a;       /* [n_v_heads] (ssm_a = -exp(A_log), negative) */
    const float *norm_w;  /* [head_dim] (ssm_norm) */
} cf_deltanet_layer;

static inline int cf_deltanet_conv_dim(const cf_deltanet_layer *L) {
    return (2 * L->n_k_heads + L->n_v_heads) * L->head_dim;
}
static inline size_t cf_deltanet_conv_state_floats(const cf_deltanet_layer *L) {
    return (size_t)(L->conv_kernel - 1) * (size_t)cf_deltanet_conv_dim(L);
}
static inline size_t cf_deltanet_ssm_state_floats(const cf_deltanet_layer *L) {
    return (size_t)L->n_v_heads * (size_t)L->head_dim * (size_t)L->head_dim;
}

/* The pieces of a step, shared by the reference step and the engine (engine_deltanet.c).
 * Channels [ch0, ch1) of c = silu(conv over [state rows, u]); their state columns then drop the
 * oldest row and keep u. c may be u (the step in place). */
void cf_deltanet_conv(const cf_deltanet_layer *L, float *state, const float *u, float *c, int ch0, int ch1);
/* x / max(|x|, eps) over n values (ggml_l2_norm). */
void cf_deltanet_l2_normalise(float *x, int n, float eps);
/* v head h's decay exp(softplus(alpha + dt_bias) a) and learning rate sigmoid(beta). */
void cf_deltanet_gates(const cf_deltanet_layer *L, int h, float alpha, float beta, float *decay, float *rate);
/* A head's output o [dh] (already S^T q / sqrt(dh)) becomes rms(o) * ssm_norm * silu(z). */
void cf_deltanet_out_norm(const cf_deltanet_layer *L, float *o, const float *z);

/* One head's recurrence for one token, scalar reference (the kernel table's deltanet_head):
 * S [dh key][dh value] decays by `decay`, learns v at key k with rate beta (S += k (beta (v -
 * S^T k))^T), and o [dh] = S^T q (unscaled). q and k are already L2-normalised. */
void cf_deltanet_head_ref(float *S, const float *q, const float *k, const float *v, float decay, float beta,
                          float *o, int dh);

/* One token, scalar reference. u [conv_dim]: the token's attn_qkv projection (q | k | v);
 * z [Hv dh]: its attn_gate projection; alpha, beta [Hv]: its ssm_alpha and ssm_beta projections
 * (before softplus / sigmoid). Updates conv_state and S in place; writes out [Hv dh] (the gated,
 * normalised output ssm_out multiplies); scratch holds conv_dim floats. */
void cf_deltanet_step_ref(const cf_deltanet_layer *L, float *conv_state, float *S, const float *u,
                          const float *z, const float *alpha, const float *beta, float *scratch,
                          float *out);

#ifdef __cplusplus
}
#endif

#endif
