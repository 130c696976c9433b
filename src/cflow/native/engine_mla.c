/* engine_mla.c — multi-head latent attention (DeepSeek-V2/V3, Kimi-K2: cf_config.mla_kv_lora > 0),
 * the ATTN op of such a model, decoding in the absorbed form llama.cpp runs.
 *
 * The KV cache holds, per layer and token, one row of hd = kv_lora + rope values (fp16, or q8_0
 * blocks): the token's normalised latent c, then its roped k_pe, shared by every head. Nothing
 * per head is cached. For each query head h the nope part is taken into latent space through the
 * head's slice of W_k_b (q_lat = W_k_b[h] q_nope, kv_lora wide) and the roped q_pe appended, so a
 * head's query is one hd-wide row against the cache rows: scores q_lat . c + q_pe . k_pe. That is
 * multi-query attention over the cache with V = K, which the kernel table's `attention` /
 * `attention_block` run as for any model (n_kv_heads 1, head_dim hd, the same V pointer as K):
 * their output per head is softmax-mixed rows, of which the first kv_lora values (the mixed
 * latent) go through the head's slice of W_v_b into v_head values; the mixed k_pe tail is unused.
 * Then W_o as usual. The mat-vecs are the engine's (int8 activations against the tiled weights),
 * split over the threads by row groups or by (row, head) items; every output value is written by
 * one thread, so the results do not depend on the thread count.
 *
 * Phases, each ending at a barrier: norm and the projections of x (wq_a and wkv_a, or wq and
 * wkv_a); [q_a_norm and wq_b] with the latent's norm, k_pe's RoPE and the cache store beside it;
 * the absorption of each (row, head); attention; W_v_b per (row, head); W_o and the residual.
 */
#include <math.h>
#include <string.h>

#include "engine_internal.h"
#include "util.h"

const char *cf_mla_check_config(const cf_config *c) {
    if (!c->mla_kv_lora) return (c->mla_q_lora | c->mla_qk | c->mla_rope | c->mla_v) ? "mla_* sizes need mla_kv_lora" : NULL;
    int nope = c->mla_qk - c->mla_rope;
    if (c->n_kv != 1 || c->hd != c->mla_kv_lora + c->mla_rope)
        return "latent attention has one KV head of head_dim kv_lora_rank + qk_rope_dim";
    if (c->mla_rope <= 0 || c->mla_rope % 2 || nope <= 0 || nope % CF_QK || c->mla_kv_lora % CF_QK ||
        c->mla_q_lora < 0 || c->mla_q_lora % CF_QK || c->mla_v <= 0 || (c->n_heads * c->mla_v) % CF_QK ||
        c->mla_rope % CF_G || (c->n_heads * c->mla_qk) % CF_G)
        return "latent attention needs qk_nope, kv_lora_rank, q_lora_rank and n_heads*v_head_dim multiples of 32, "
               "qk_rope_dim a positive multiple of 8";
    if (c->qkv_bias || c->qk_norm || c->sliding_window || c->post_norms || c->attn_temp_scale > 0)
        return "latent attention does not go with qkv_bias, qk_norm, sliding windows, post_norms or a temperature";
    if (c->moe_groups > 64 || (c->moe_groups > 1 && (c->n_experts % c->moe_groups || c->moe_groups_used < 1 ||
                                                     c->moe_groups_used > c->moe_groups)))
        return "moe_groups must be at most 64 and divide n_experts, moe_groups_used in 1..moe_groups";
    return NULL;
}

/* Row groups [g0, g1) of the parts' concatenated rows, each part's into its own rows of y. */
typedef struct {
    const cf_tiled *w;
    float *y;
    int ystride;
} mla_part;

static void parts_rows(const cf_engine *e, const mla_part *part, int n_parts, const cf_act_q8 *act, int B, int g0,
                       int g1) {
    for (int k = 0, p0 = 0; k < n_parts; p0 += cf_n_groups(part[k].w), k++) {
        int a = cf_max(g0, p0), b = cf_min(g1, p0 + cf_n_groups(part[k].w));
        if (a < b) cf_matvec_rows(e, part[k].w, act, part[k].y, part[k].ystride, NULL, B, a - p0, b - p0);
    }
}

static void split_parts(const cf_engine *e, const mla_part *part, int n_parts, const cf_act_q8 *act, int ith,
                        int nth) {
    int ng = 0, g0, g1;
    for (int k = 0; k < n_parts; k++) ng += cf_n_groups(part[k].w);
    cf_split_range(ng, ith, nth, 1, &g0, &g1);
    parts_rows(e, part, n_parts, act, e->B, g0, g1);
}

/* Row b's latent (in place: normalised) and k_pe (roped) into its cache row at its position. */
static void store_latent(cf_engine *e, const cf_layer *w, int l, int b) {
    const cf_config *c = &e->c;
    int kvl = c->mla_kv_lora, A = c->mla_q_lora + kvl + c->mla_rope;
    float *ck = e->s.mla_a + (size_t)b * A + c->mla_q_lora;
    const float *cs = e->s.rope + (size_t)b * c->hd;
    e->k->rmsnorm(ck, ck, w->kv_a_norm, kvl, c->norm_eps);
    e->k->rope(ck + kvl, 1, c->mla_rope, cs, cs + c->mla_rope / 2);
    size_t row = (size_t)e->rseq[b] * e->seq_kv + (size_t)l * e->n_ctx + e->rpos[b];
    uint8_t *dst = e->s.kcache + row * e->krow;
    if (e->k_type == CF_Q8_0) e->k->f32_to_q8_0(dst, ck, c->hd);
    else e->k->f32_to_f16((cf_half *)dst, ck, c->hd);
}

/* Item i = (row, head): its absorbed query, q_lat = W_k_b[h] q_nope then the roped q_pe, into s->qkv. */
static void absorb(cf_engine *e, const cf_layer *w, cf_act_q8 *act, int i) {
    const cf_config *c = &e->c;
    int H = c->n_heads, b = i / H, h = i % H, kvl = c->mla_kv_lora, nope = c->mla_qk - c->mla_rope;
    float *q = e->s.mla_q + (size_t)b * H * c->mla_qk + (size_t)h * c->mla_qk;
    float *out = e->s.qkv + (size_t)b * H * c->hd + (size_t)h * c->hd;
    const float *cs = e->s.rope + (size_t)b * c->hd;
    act->n = nope;
    e->k->quantize_act(q, act);
    /* the kernel writes W_k_b's rows h kvl.. at y + row: shift y so they land at out */
    cf_matvec_rows(e, &w->wk_b, act, out - (size_t)h * kvl, 0, NULL, 1, h * kvl / CF_G, (h + 1) * kvl / CF_G);
    memcpy(out + kvl, q + nope, (size_t)c->mla_rope * sizeof(float));
    e->k->rope(out + kvl, 1, c->mla_rope, cs, cs + c->mla_rope / 2);
}

/* Item i = (row, head): the head's mixed latent through W_v_b[h] into its v_head values of s->mla_o. */
static void values(cf_engine *e, const cf_layer *w, cf_act_q8 *act, int i) {
    const cf_config *c = &e->c;
    int H = c->n_heads, b = i / H, h = i % H;
    act->n = c->mla_kv_lora;
    e->k->quantize_act(e->s.att + (size_t)b * H * c->hd + (size_t)h * c->hd, act);
    cf_matvec_rows(e, &w->wv_b, act, e->s.mla_o + (size_t)b * H * c->mla_v, 0, NULL, 1, h * c->mla_v / CF_G,
                   (h + 1) * c->mla_v / CF_G);
}

/* Attention of every row over its sequence's latent cache: consecutive rows in blocks (attn_plan),
 * the others one row at a time, split by items as op_attn does. */
static void attend(cf_engine *e, int l, float *scores, int ith, int nth) {
    const cf_config *c = &e->c;
    int H = c->n_heads, hd = c->hd, ld = H * hd, i0, i1;
    size_t layer_kv = (size_t)l * e->n_ctx;
    int f16 = e->k_type == CF_F16;
    for (int it = ith; it < e->n_ablk; it += nth) {
        int b0 = e->ablk[2 * it], nq = e->ablk[2 * it + 1];
        const uint8_t *k = e->s.kcache + ((size_t)e->rseq[b0] * e->seq_kv + layer_kv) * e->krow;
        cf_attn_block_shape sh = {.n_heads = H, .n_kv_heads = 1, .head_dim = hd, .max_seq = e->n_ctx,
                                  .scale = e->attn_scale, .pos0 = e->rpos[b0], .n_q = nq, .window = 0,
                                  .ldq = ld, .ldo = ld};
        float *out = e->s.att + (size_t)b0 * ld, *q = e->s.qkv + (size_t)b0 * ld;
        if (f16) e->k->attention_block(out, q, (const cf_half *)k, (const cf_half *)k, scores, &sh, 0, H);
        else e->k->attention_block_q8kv(out, q, k, k, e->k_type, e->k_type, scores, &sh, 0, H);
    }
    cf_split_range(e->n_arow * H, ith, nth, 1, &i0, &i1);
    for (int i = i0; i < i1;) {
        int b = e->arow[i / H], h0 = i % H, h1 = cf_min(H, h0 + i1 - i);
        cf_attn_shape sh = {.n_heads = H, .n_kv_heads = 1, .head_dim = hd, .max_seq = e->n_ctx,
                            .n_pos = e->rpos[b] + 1, .scale = e->attn_scale};
        const uint8_t *k = e->s.kcache + ((size_t)e->rseq[b] * e->seq_kv + layer_kv) * e->krow;
        float *out = e->s.att + (size_t)b * ld, *q = e->s.qkv + (size_t)b * ld;
        if (f16) e->k->attention(out, q, (const cf_half *)k, (const cf_half *)k, scores, &sh, h0, h1);
        else e->k->attention_q8kv(out, q, k, k, e->k_type, e->k_type, scores, &sh, h0, h1);
        i += h1 - h0;
    }
}

void cf_op_attn_mla(cf_engine *e, int l, int slot, int ith, int nth) {
    const cf_config *c = &e->c;
    const cf_layer *w = &e->w.sets[l % c->n_unique];
    cf_state *s = &e->s;
    cf_scratch *ts = &e->ts[ith];
    int d = c->d, B = e->B, H = c->n_heads, ql = c->mla_q_lora, A = ql + c->mla_kv_lora + c->mla_rope, b0, b1;
    const float *x = s->ring + (size_t)slot * e->max_batch * d;

    ph(e, ith, CF_PK_NORM, l);
    for (int b = 0; b < B; b++)
        e->k->rmsnorm(ts->xb + (size_t)b * e->kmax, x + (size_t)b * d, w->attn_norm, d, c->norm_eps);
    cf_quantize_rows(e, ts->xb, e->kmax, d, ts->act, NULL, B, w->qkv_fmt);
    ph(e, ith, CF_PK_QKV, l);
    mla_part first[2] = {{ql ? &w->wq_a : &w->wq, ql ? s->mla_a : s->mla_q, ql ? A : H * c->mla_qk},
                         {&w->wkv_a, s->mla_a + ql, A}};
    split_parts(e, first, 2, ts->act, ith, nth);
    sync_threads(e, ith, CF_PK_QKV);

    cf_split_range(B, ith, nth, 1, &b0, &b1);
    for (int b = b0; b < b1; b++) store_latent(e, w, l, b);
    if (ql) { /* the low-rank query: its norm (every thread, private), then wq_b */
        for (int b = 0; b < B; b++)
            e->k->rmsnorm(ts->xb + (size_t)b * e->kmax, s->mla_a + (size_t)b * A, w->q_a_norm, ql, c->norm_eps);
        cf_quantize_rows(e, ts->xb, e->kmax, ql, ts->act, NULL, B, act_fmt(&w->wq_b));
        mla_part qb = {&w->wq_b, s->mla_q, H * c->mla_qk};
        split_parts(e, &qb, 1, ts->act, ith, nth);
    }
    sync_threads(e, ith, CF_PK_QKV);

    int i0, i1;
    cf_split_range(B * H, ith, nth, 1, &i0, &i1);
    for (int i = i0; i < i1; i++) absorb(e, w, ts->act2, i);
    sync_threads(e, ith, CF_PK_ATTN);

    attend(e, l, ts->scores, ith, nth);
    sync_threads(e, ith, CF_PK_WO);

    for (int i = i0; i < i1; i++) values(e, w, ts->act2, i);
    sync_threads(e, ith, CF_PK_WO);

    int vdim = H * c->mla_v, glo[2], ghi[2];
    cf_quantize_rows(e, s->mla_o, vdim, vdim, ts->act, NULL, B, act_fmt(&w->wo));
    int np = cf_d_split(cf_n_groups(&w->wo), ith, nth, cf_split_whole_bands(e), glo, ghi);
    for (int q = 0; q < np; q++) cf_matvec_rows(e, &w->wo, ts->act, s->h, d, NULL, B, glo[q], ghi[q]);
    for (int q = 0; q < np; q++) {
        int r0 = glo[q] * CF_G, r1 = cf_min(ghi[q] * CF_G, d);
        for (int b = 0; b < B; b++)
            for (int r = r0; r < r1; r++) s->h[(size_t)b * d + r] += x[(size_t)b * d + r];
    }
    if (ith == 0) {
        e->cnt.n[CF_CNT_ATTN] += w->attn_bytes;
        for (int b = 0; b < B; b++) e->cnt.n[CF_CNT_KV] += (uint64_t)(e->rpos[b] + 1) * e->krow;
    }
    sync_threads(e, ith, -1);
}
