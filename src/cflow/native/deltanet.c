/* deltanet.c — the Gated DeltaNet token step (deltanet.h), scalar reference: plain loops in
 * llama.cpp's order of operations, to be read and to test faster versions against. The engine
 * (engine_deltanet.c) runs the same pieces split over threads (the conv by channels, the rest by
 * v heads) with the kernel table's deltanet_head in place of cf_deltanet_head_ref; prefill steps
 * the rows in order through them (llama.cpp's chunked parallel form computes the same recurrence:
 * tests/test_qwen35.py holds both to one reference). */
#include "deltanet.h"

#include <math.h>
#include <string.h>

static float silu(float x) { return x / (1.0f + expf(-x)); }

/* ggml_softplus: log(1 + e^x), x itself past 20 (where the two agree in float). */
static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

void cf_deltanet_l2_normalise(float *x, int n, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float scale = 1.0f / fmaxf(sqrtf(ss), eps);
    for (int i = 0; i < n; i++) x[i] *= scale;
}

void cf_deltanet_conv(const cf_deltanet_layer *L, float *state, const float *u, float *c, int ch0, int ch1) {
    const int C = cf_deltanet_conv_dim(L), K = L->conv_kernel;
    for (int ch = ch0; ch < ch1; ch++) {
        const float *w = L->conv_w + (size_t)ch * K;
        float acc = 0.0f;
        for (int j = 0; j < K - 1; j++) acc += w[j] * state[(size_t)j * C + ch];
        acc += w[K - 1] * u[ch];
        if (K > 1) { /* the column drops its oldest row and keeps u (before c: c may be u) */
            for (int j = 0; j < K - 2; j++) state[(size_t)j * C + ch] = state[(size_t)(j + 1) * C + ch];
            state[(size_t)(K - 2) * C + ch] = u[ch];
        }
        c[ch] = silu(acc);
    }
}

void cf_deltanet_gates(const cf_deltanet_layer *L, int h, float alpha, float beta, float *decay, float *rate) {
    *decay = expf(softplus(alpha + L->dt_bias[h]) * L->a[h]);
    *rate = 1.0f / (1.0f + expf(-beta));
}

void cf_deltanet_out_norm(const cf_deltanet_layer *L, float *o, const float *z) {
    const int dh = L->head_dim;
    float ss = 0.0f; /* the gated RMSNorm of the head: rms(o) * ssm_norm * silu(z) */
    for (int j = 0; j < dh; j++) ss += o[j] * o[j];
    const float r = 1.0f / sqrtf(ss / (float)dh + L->eps);
    for (int j = 0; j < dh; j++) o[j] = o[j] * r * L->norm_w[j] * silu(z[j]);
}

void cf_deltanet_head_ref(float *S, const float *q, const float *k, const float *v, float decay, float beta,
                          float *o, int dh) {
    for (int i = 0; i < dh * dh; i++) S[i] *= decay;
    for (int j = 0; j < dh; j++) { /* delta: beta (v - S^T k), the correction of what S recalls */
        float recalled = 0.0f;
        for (int i = 0; i < dh; i++) recalled += S[i * dh + j] * k[i];
        o[j] = beta * (v[j] - recalled);
    }
    for (int i = 0; i < dh; i++)
        for (int j = 0; j < dh; j++) S[i * dh + j] += k[i] * o[j];
    for (int j = 0; j < dh; j++) {
        float acc = 0.0f;
        for (int i = 0; i < dh; i++) acc += S[i * dh + j] * q[i];
        o[j] = acc;
    }
}

void cf_deltanet_step_ref(const cf_deltanet_layer *L, float *conv_state, float *S, const float *u,
                          const float *z, const float *alpha, const float *beta, float *scratch,
                          float *out) {
    const int Hk = L->n_k_heads, Hv = L->n_v_heads, dh = L->head_dim;
    float *c = scratch;
    cf_deltanet_conv(L, conv_state, u, c, 0, cf_deltanet_conv_dim(L));
    float *q = c, *k = c + Hk * dh, *v = c + 2 * Hk * dh;
    for (int h = 0; h < Hk; h++) {
        cf_deltanet_l2_normalise(q + h * dh, dh, L->eps);
        cf_deltanet_l2_normalise(k + h * dh, dh, L->eps);
    }
    const float q_scale = 1.0f / sqrtf((float)dh);
    for (int h = 0; h < Hv; h++) {
        const float *qh = q + (h % Hk) * dh, *kh = k + (h % Hk) * dh, *vh = v + h * dh;
        float *Sh = S + (size_t)h * dh * dh; /* Sh[i * dh + j]: key dim i, value dim j */
        float decay, rate, *oh = out + h * dh;
        cf_deltanet_gates(L, h, alpha[h], beta[h], &decay, &rate);
        cf_deltanet_head_ref(Sh, qh, kh, vh, decay, rate, oh, dh);
        for (int j = 0; j < dh; j++) oh[j] *= q_scale;
        cf_deltanet_out_norm(L, oh, z + h * dh);
    }
}
