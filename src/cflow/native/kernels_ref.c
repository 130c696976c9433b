/* kernels_ref.c — the scalar reference of every kernel in cf_kernel_table, plus the table-free
 * scalar routines (rope tables, top-k). The block formats' helpers (fp16, block sizes) are in
 * formats.c; the blocks of Q5_0, Q5_1 and the K-quants (one row's dot, dequantization, the
 * 256-block activation) in kernels_kquant_ref.c, which the walk here calls for those dtypes.
 *
 * These are the plain loops the ISA versions are tested against: one row, one block, one
 * weight at a time, written to be read. Compiled for the baseline ISA (no -m flags), so they
 * run anywhere and serve as the fallback and as CFLOW_ISA=ref.
 */
#include <math.h>
#include <string.h>

#include "cflow.h"
#include "deltanet.h"
#include "kernels_internal.h"
#include "kernels_ref.h"
#include "util.h"

/* ---- activation quantization ------------------------------------------------------------- */

/* d = max|x| / 127, q = round_half_away(x * (1/d)) (0 where d = 0), s = d * sum(q): the
 * definition in DESIGN.md and cflow.quant.quantize_act, bit for bit (multiply by the float32
 * reciprocal, as ggml does, not divide). */
static void quantize_act_ref(const float *x, cf_act_q8 *out) {
    for (int b = 0; b < out->n / CF_QK; b++) {
        const float *xb = x + b * CF_QK;
        float amax = 0.0f;
        for (int j = 0; j < CF_QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < CF_QK; j++) {
            int q = (int)roundf(xb[j] * id); /* roundf: half away from zero */
            out->qs[b * CF_QK + j] = (int8_t)q;
            sum += q;
        }
        out->d[b] = d;
        out->s[b] = d * (float)sum;
    }
}

/* ---- tiled mat-vec ----------------------------------------------------------------------- */

/* Integer dot of one row's 32-block (GGML bytes `q`) with 32 activation int8s. */
static int block_dot(int dtype, const uint8_t *q, const int8_t *xq) {
    int sum = 0;
    if (dtype == CF_Q8_0) {
        for (int j = 0; j < CF_QK; j++) sum += (int8_t)q[j] * xq[j];
    } else { /* Q4_0 / Q4_1: byte j holds weight j (low nibble) and weight j+16 (high) */
        for (int j = 0; j < CF_QK / 2; j++) sum += (q[j] & 15) * xq[j] + (q[j] >> 4) * xq[j + 16];
    }
    return sum;
}

/* One chunk's contribution to row i of its group: the weight block of that row times the
 * activation block kb, folded with the block's scales (the s trick for Q4_0's -8, Q4_1's m). */
static float chunk_row_dot(int dtype, const uint8_t *chunk, int g, int i, const cf_act_q8 *x,
                           int kb) {
    if (cf_tile_fields(dtype)) { /* Q5_0, Q5_1 and the K-quants: kernels_kquant_ref.c */
        uint8_t blk[CF_KBLOCK_MAX];
        cf_kq_gather(dtype, chunk, g, i, blk);
        return cf_kq_block_dot(dtype, blk, x, kb);
    }
    const cf_half *scales = (const cf_half *)chunk; /* d[g] (then m[g] for Q4_1) */
    float d = cf_half_to_float(scales[i]);
    int isum = block_dot(dtype, chunk + cf_chunk_qs_offset(dtype, g) + (size_t)i * cf_qs_bytes(dtype),
                         x->qs + (size_t)kb * CF_QK);
    float dot = d * (x->d[kb] * (float)isum);
    if (dtype == CF_Q4_0) dot -= 8.0f * d * x->s[kb];
    if (dtype == CF_Q4_1) dot += cf_half_to_float(scales[g + i]) * x->s[kb];
    return dot;
}

/* out[r - g0*8] for the rows of groups [g0, g1): walks bands, tiles, groups and blocks in the
 * file's order (cf_span, kernels_internal.h); tests check it against cflow.quant. */
void cf_matvec_groups_ref(const cf_tiled *w, const cf_act_q8 *x, float *out, int g0, int g1) {
    size_t bb = cf_block_bytes(w->dtype);
    int r0 = g0 * CF_G, r1 = cf_min(g1 * CF_G, w->rows);
    for (int r = r0; r < r1; r++) out[r - r0] = 0.0f;
    cf_span sp;
    for (cf_span_begin(&sp, w, g0, g1); cf_span_next(&sp);) {
        /* sp: one tile's groups [sp.ga, sp.gb) starting at sp.ptr, sp.nkt blocks per row */
        const uint8_t *p = sp.ptr;
        for (int gr = sp.ga; gr < sp.gb; gr++) {
            int g = cf_min(CF_G, w->rows - gr * CF_G);
            for (int kb = 0; kb < sp.nkt; kb++, p += (size_t)g * bb) {
                for (int i = 0; i < g; i++)
                    out[gr * CF_G + i - r0] += chunk_row_dot(w->dtype, p, g, i, x, sp.kb0 + kb);
            }
        }
    }
}

static void matvec_ref(const cf_tiled *w, const cf_act_q8 *x, float *y, int g0, int g1) {
    cf_matvec_groups_ref(w, x, y + (size_t)g0 * CF_G, g0, g1);
}

static void gate_up_ref(const cf_tiled *w, const cf_act_q8 *x, float *y, int p0, int p1) {
    float gu[2 * CF_G]; /* gate[8] then up[8] of one pair */
    for (int p = p0; p < p1; p++) {
        cf_matvec_groups_ref(w, x, gu, 2 * p, 2 * p + 2);
        for (int i = 0; i < CF_G; i++) y[p * CF_G + i] = cf_silu(gu[i]) * gu[CF_G + i];
    }
}

/* The batched forms, as B single-activation calls: the definition the ISA versions must match. */
static void matmat_ref(const cf_tiled *w, const cf_act_q8 *xs, int B, float *y, int ldy, int g0,
                       int g1) {
    for (int b = 0; b < B; b++) matvec_ref(w, &xs[b], y + (size_t)b * ldy, g0, g1);
}

static void gate_up_mm_ref(const cf_tiled *w, const cf_act_q8 *xs, int B, float *y, int ldy,
                           int p0, int p1) {
    for (int b = 0; b < B; b++) gate_up_ref(w, &xs[b], y + (size_t)b * ldy, p0, p1);
}

/* Row r, dequantized: find r's group in every tile of its band and expand its blocks. */
void cf_embed_row_ref(const cf_tiled *w, int r, float *out) {
    size_t bb = cf_block_bytes(w->dtype);
    int qb = cf_block_weights(w->dtype);
    int gr = r / CF_G, i = r % CF_G, g = cf_min(CF_G, w->rows - gr * CF_G);
    cf_span sp;
    for (cf_span_begin(&sp, w, gr, gr + 1); cf_span_next(&sp);) {
        for (int kb = 0; kb < sp.nkt; kb++) {
            const uint8_t *chunk = sp.ptr + (size_t)kb * g * bb;
            if (cf_tile_fields(w->dtype)) {
                uint8_t blk[CF_KBLOCK_MAX];
                cf_kq_gather(w->dtype, chunk, g, i, blk);
                cf_kq_dequant_block(w->dtype, blk, out + (size_t)(sp.kb0 + kb) * qb);
                continue;
            }
            const cf_half *scales = (const cf_half *)chunk;
            const uint8_t *q = chunk + cf_chunk_qs_offset(w->dtype, g) + (size_t)i * cf_qs_bytes(w->dtype);
            float d = cf_half_to_float(scales[i]);
            float *o = out + (size_t)(sp.kb0 + kb) * CF_QK;
            if (w->dtype == CF_Q8_0) {
                for (int j = 0; j < CF_QK; j++) o[j] = d * (float)(int8_t)q[j];
            } else {
                float m = w->dtype == CF_Q4_1 ? cf_half_to_float(scales[g + i]) : -8.0f * d;
                for (int j = 0; j < CF_QK / 2; j++) {
                    o[j] = d * (float)(q[j] & 15) + m;
                    o[j + 16] = d * (float)(q[j] >> 4) + m;
                }
            }
        }
    }
}

/* ---- fp32 vector kernels ----------------------------------------------------------------- */

static void rmsnorm_ref(float *out, const float *x, const float *w, int n, float eps) {
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float inv = (float)(1.0 / sqrt(ss / n + eps));
    for (int i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

static float dot_f32_ref(const float *a, const float *b, int n) {
    double s = 0.0;
    for (int i = 0; i < n; i++) s += (double)a[i] * b[i];
    return (float)s;
}

static void matvec_f32_ref(float *y, const float *W, const float *x, int rows, int cols) {
    for (int r = 0; r < rows; r++) y[r] = dot_f32_ref(W + (size_t)r * cols, x, cols);
}

static void geglu_ref(float *h, const float *gu, int n_pairs) {
    for (int p = 0; p < n_pairs; p++)
        for (int j = 0; j < CF_G; j++) {
            float x = gu[2 * p * CF_G + j], u = gu[(2 * p + 1) * CF_G + j];
            h[p * CF_G + j] = 0.5f * x * (1.0f + tanhf(0.79788456080286535588f * x * (1.0f + 0.044715f * x * x))) * u;
        }
}

static void swiglu_oai_ref(float *h, const float *gu, int n_pairs, float alpha, float limit) {
    for (int p = 0; p < n_pairs; p++)
        for (int j = 0; j < CF_G; j++) {
            float x = fminf(gu[2 * p * CF_G + j], limit);
            float y = fmaxf(fminf(gu[(2 * p + 1) * CF_G + j], limit), -limit);
            h[p * CF_G + j] = x / (1.0f + expf(-alpha * x)) * (y + 1.0f);
        }
}

/* softmax of x[0..n) in place; with a sink (attention sinks, cflow.h) one more logit *sink joins
 * the max and the denominator, its own weight dropped. */
static void softmax_sink_ref(float *x, int n, const float *sink) {
    float mx = x[0];
    for (int i = 1; i < n; i++) mx = fmaxf(mx, x[i]);
    if (sink) mx = fmaxf(mx, *sink);
    double sum = 0.0;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    if (sink) sum += expf(*sink - mx);
    float inv = (float)(1.0 / sum);
    for (int i = 0; i < n; i++) x[i] *= inv;
}

static void softmax_ref(float *x, int n) { softmax_sink_ref(x, n, NULL); }

static void rope_ref(float *x, int n_heads, int head_dim, const float *cos, const float *sin) {
    int half = head_dim / 2;
    for (int h = 0; h < n_heads; h++) {
        float *xh = x + (size_t)h * head_dim;
        for (int j = 0; j < half; j++) {
            float a = xh[j], b = xh[j + half];
            xh[j] = a * cos[j] - b * sin[j];
            xh[j + half] = a * sin[j] + b * cos[j];
        }
    }
}

void cf_attention_ref(float *out, const float *q, const cf_half *k, const cf_half *v,
                          float *att, const cf_attn_shape *s, int h0, int h1) {
    int hd = s->head_dim, group = s->n_heads / s->n_kv_heads;
    for (int h = h0; h < h1; h++) {
        const float *qh = q + (size_t)h * hd;
        size_t kv_off = (size_t)(h / group) * s->max_seq * hd;
        float *a = att + (size_t)(h - h0) * s->n_pos;
        for (int t = 0; t < s->n_pos; t++) {
            const cf_half *kt = k + kv_off + (size_t)t * hd;
            float dot = 0.0f;
            for (int j = 0; j < hd; j++) dot += qh[j] * cf_half_to_float(kt[j]);
            a[t] = dot * s->scale;
        }
        softmax_sink_ref(a, s->n_pos, s->sinks ? s->sinks + h : NULL);
        float *oh = out + (size_t)h * hd;
        for (int j = 0; j < hd; j++) oh[j] = 0.0f;
        for (int t = 0; t < s->n_pos; t++) {
            const cf_half *vt = v + kv_off + (size_t)t * hd;
            for (int j = 0; j < hd; j++) oh[j] += a[t] * cf_half_to_float(vt[j]);
        }
    }
}

/* By definition: each query alone, over its own span of the cache. */
void cf_attention_block_ref(float *out, const float *q, const cf_half *k, const cf_half *v,
                            float *att, const cf_attn_block_shape *s, int h0, int h1) {
    for (int i = 0; i < s->n_q; i++) {
        int lo = cf_attn_lo(s, i);
        cf_attn_shape one = {.n_heads = s->n_heads, .n_kv_heads = s->n_kv_heads, .head_dim = s->head_dim,
                             .max_seq = s->max_seq, .n_pos = s->pos0 + i + 1 - lo, .scale = s->scale, .sinks = s->sinks};
        size_t off = (size_t)lo * s->head_dim;
        cf_attention_ref(out + (size_t)i * s->ldo, q + (size_t)i * s->ldq, k + off, v + off, att, &one, h0, h1);
    }
}

static void f32_to_f16_ref(cf_half *out, const float *x, int n) {
    for (int i = 0; i < n; i++) out[i] = cf_float_to_half(x[i]);
}

/* ---- the 8-bit KV cache (cflow.h) ------------------------------------------------------- */

/* Value j of a cache row of `type`: an fp16 value, or d * qs[j] of its q8_0 block (exact). */
static float kv_value(const uint8_t *row, int type, int j) {
    cf_half h;
    if (type == CF_Q8_0) {
        const uint8_t *b = row + (size_t)(j / CF_QK) * (2 + CF_QK);
        memcpy(&h, b, sizeof h);
        return cf_half_to_float(h) * (float)(int8_t)b[2 + j % CF_QK];
    }
    memcpy(&h, row + (size_t)j * sizeof h, sizeof h);
    return cf_half_to_float(h);
}

/* cf_attention_ref with each K and V value read by kv_value: over an fp16 cache, the same loops. */
void cf_attention_q8kv_ref(float *out, const float *q, const void *k, const void *v, int k_type, int v_type,
                           float *att, const cf_attn_shape *s, int h0, int h1) {
    int hd = s->head_dim, group = s->n_heads / s->n_kv_heads;
    size_t krb = cf_kv_row_bytes(k_type, hd), vrb = cf_kv_row_bytes(v_type, hd);
    for (int h = h0; h < h1; h++) {
        const float *qh = q + (size_t)h * hd;
        size_t row0 = (size_t)(h / group) * s->max_seq;
        float *a = att + (size_t)(h - h0) * s->n_pos;
        for (int t = 0; t < s->n_pos; t++) {
            const uint8_t *kt = (const uint8_t *)k + (row0 + t) * krb;
            float dot = 0.0f;
            for (int j = 0; j < hd; j++) dot += qh[j] * kv_value(kt, k_type, j);
            a[t] = dot * s->scale;
        }
        softmax_sink_ref(a, s->n_pos, s->sinks ? s->sinks + h : NULL);
        float *oh = out + (size_t)h * hd;
        for (int j = 0; j < hd; j++) oh[j] = 0.0f;
        for (int t = 0; t < s->n_pos; t++) {
            const uint8_t *vt = (const uint8_t *)v + (row0 + t) * vrb;
            for (int j = 0; j < hd; j++) oh[j] += a[t] * kv_value(vt, v_type, j);
        }
    }
}

/* By definition: each query alone, over its own span of the cache. */
void cf_attention_block_q8kv_ref(float *out, const float *q, const void *k, const void *v, int k_type,
                                 int v_type, float *att, const cf_attn_block_shape *s, int h0, int h1) {
    size_t krb = cf_kv_row_bytes(k_type, s->head_dim), vrb = cf_kv_row_bytes(v_type, s->head_dim);
    for (int i = 0; i < s->n_q; i++) {
        int lo = cf_attn_lo(s, i);
        cf_attn_shape one = {.n_heads = s->n_heads, .n_kv_heads = s->n_kv_heads, .head_dim = s->head_dim,
                             .max_seq = s->max_seq, .n_pos = s->pos0 + i + 1 - lo, .scale = s->scale, .sinks = s->sinks};
        cf_attention_q8kv_ref(out + (size_t)i * s->ldo, q + (size_t)i * s->ldq, (const uint8_t *)k + lo * krb,
                              (const uint8_t *)v + lo * vrb, k_type, v_type, att, &one, h0, h1);
    }
}

/* d = max|x| / 127, qs = roundf(x * (1/d)) (0 where d = 0), d stored as fp16: ggml's
 * quantize_row_q8_0_ref and cflow.quant.quantize(x, "q8_0"). */
static void f32_to_q8_0_ref(uint8_t *out, const float *x, int n) {
    for (int b = 0; b < n / CF_QK; b++, out += 2 + CF_QK) {
        const float *xb = x + (size_t)b * CF_QK;
        float amax = 0.0f;
        for (int j = 0; j < CF_QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        cf_half h = cf_float_to_half(d);
        memcpy(out, &h, sizeof h);
        for (int j = 0; j < CF_QK; j++) out[2 + j] = (uint8_t)(int8_t)(int)roundf(xb[j] * id);
    }
}

/* ---- table-free helpers ------------------------------------------------------------------ */

void cf_rope_table(float *cos_, float *sin_, int head_dim, int pos, float theta, const float *factors,
                   float mscale) {
    for (int j = 0; j < head_dim / 2; j++) {
        double angle = (double)pos * pow((double)theta, -2.0 * j / head_dim);
        if (factors) angle /= (double)factors[j];
        cos_[j] = (float)(mscale * cos(angle));
        sin_[j] = (float)(mscale * sin(angle));
    }
}

/* Selection by repeated scans: k and n are small (router logits), so O(n*k) beats sorting. */
void cf_topk(const float *x, int n, int k, int *idx, float *val) {
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int i = 0; i < n; i++) {
            int taken = 0;
            for (int t = 0; t < j && !taken; t++) taken = idx[t] == i;
            if (!taken && (best < 0 || x[i] > x[best])) best = i;
        }
        idx[j] = best;
        val[j] = x[best];
    }
}

/* ---- the table --------------------------------------------------------------------------- */

/* Every quantized dtype runs through the same walk (chunk_row_dot picks the block format). */
#define CF_ALL_QDTYPES(FN)                                                                     \
    {[CF_Q4_0] = FN, [CF_Q4_1] = FN, [CF_Q5_0] = FN, [CF_Q5_1] = FN, [CF_Q8_0] = FN,            \
     [CF_Q4_K] = FN, [CF_Q5_K] = FN, [CF_Q6_K] = FN, [CF_MXFP4] = FN}

static const cf_kernel_table TABLE_REF = {
    .name = "ref",
    .quantize_act = quantize_act_ref,
    .matvec = CF_ALL_QDTYPES(matvec_ref),
    .rmsnorm = rmsnorm_ref,
    .matvec_f32 = matvec_f32_ref,
    .gate_up = CF_ALL_QDTYPES(gate_up_ref),
    .softmax = softmax_ref,
    .rope = rope_ref,
    .topk = cf_topk,
    .attention = cf_attention_ref,
    .attention_block = cf_attention_block_ref,
    .embed_row = cf_embed_row_ref,
    .f32_to_f16 = f32_to_f16_ref,
    .matmat = CF_ALL_QDTYPES(matmat_ref),
    .gate_up_mm = CF_ALL_QDTYPES(gate_up_mm_ref),
    .quantize_act_k = cf_quantize_act_k_ref,
    .attention_q8kv = cf_attention_q8kv_ref,
    .attention_block_q8kv = cf_attention_block_q8kv_ref,
    .f32_to_q8_0 = f32_to_q8_0_ref,
    .geglu = geglu_ref,
    .swiglu_oai = swiglu_oai_ref,
    .deltanet_head = cf_deltanet_head_ref,
};

const cf_kernel_table *cf_kernels_ref(void) { return &TABLE_REF; }
