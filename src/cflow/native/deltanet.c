/* deltanet.c — the Gated DeltaNet token step (deltanet.h), scalar reference: plain loops in
 * llama.cpp's order of operations, to be read and to test faster versions against. Prefill steps
 * the rows in order through it (llama.cpp's chunked parallel form computes the same recurrence:
 * tests/test_qwen35.py holds both to one reference). */
#include "deltanet.h"

#include <math.h>
#include <string.h>

static float silu(float x) { return x / (1.0f + expf(-x)); }

/* ggml_softplus: log(1 + e^x), x itself past 20 (where the two agree in float). */
static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* x / max(|x|, eps) over n values (ggml_l2_norm). */
static void l2_normalise(float *x, int n, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float scale = 1.0f / fmaxf(sqrtf(ss), eps);
    for (int i = 0; i < n; i++) x[i] *= scale;
}

/* c = silu(conv over [state rows, u]); the state then drops its oldest row and keeps u. */
static void conv_step(const cf_deltanet_layer *L, float *state, const float *u, float *c) {
    const int C = cf_deltanet_conv_dim(L), K = L->conv_kernel;
    for (int ch = 0; ch < C; ch++) {
        const float *w = L->conv_w + (size_t)ch * K;
        float acc = 0.0f;
        for (int j = 0; j < K - 1; j++) acc += w[j] * state[(size_t)j * C + ch];
        acc += w[K - 1] * u[ch];
        c[ch] = silu(acc);
    }
    if (K > 1) {
        memmove(state, state + C, (size_t)(K - 2) * C * sizeof(float));
        memcpy(state + (size_t)(K - 2) * C, u, (size_t)C * sizeof(float));
    }
}

void cf_deltanet_step_ref(const cf_deltanet_layer *L, float *conv_state, float *S, const float *u,
                          const float *z, const float *alpha, const float *beta, float *scratch,
                          float *out) {
    const int Hk = L->n_k_heads, Hv = L->n_v_heads, dh = L->head_dim;
    float *c = scratch;
    conv_step(L, conv_state, u, c);
    float *q = c, *k = c + Hk * dh, *v = c + 2 * Hk * dh;
    for (int h = 0; h < Hk; h++) {
        l2_normalise(q + h * dh, dh, L->eps);
        l2_normalise(k + h * dh, dh, L->eps);
    }
    const float q_scale = 1.0f / sqrtf((float)dh);
    for (int h = 0; h < Hv; h++) {
        const float *qh = q + (h % Hk) * dh, *kh = k + (h % Hk) * dh, *vh = v + h * dh;
        float *Sh = S + (size_t)h * dh * dh; /* Sh[i * dh + j]: key dim i, value dim j */
        const float decay = expf(softplus(alpha[h] + L->dt_bias[h]) * L->a[h]);
        const float b = 1.0f / (1.0f + expf(-beta[h]));
        float *oh = out + h * dh;
        for (int i = 0; i < dh * dh; i++) Sh[i] *= decay;
        for (int j = 0; j < dh; j++) { /* delta: beta (v - S^T k), the correction of what S recalls */
            float recalled = 0.0f;
            for (int i = 0; i < dh; i++) recalled += Sh[i * dh + j] * kh[i];
            oh[j] = b * (vh[j] - recalled);
        }
        for (int i = 0; i < dh; i++)
            for (int j = 0; j < dh; j++) Sh[i * dh + j] += kh[i] * oh[j];
        for (int j = 0; j < dh; j++) {
            float acc = 0.0f;
            for (int i = 0; i < dh; i++) acc += Sh[i * dh + j] * qh[i];
            oh[j] = acc * q_scale;
        }
        float ss = 0.0f; /* the gated RMSNorm of the head: rms(o) * ssm_norm * silu(z) */
        for (int j = 0; j < dh; j++) ss += oh[j] * oh[j];
        const float r = 1.0f / sqrtf(ss / (float)dh + L->eps);
        for (int j = 0; j < dh; j++) oh[j] = oh[j] * r * L->norm_w[j] * silu(z[h * dh + j]);
    }
}
