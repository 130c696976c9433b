/* engine_gemma4.c — layers of differing shapes, and Gemma 4's per-layer embeddings.
 *
 * The layer geometry (cf_layer_geo, every model): each layer's head size, KV head count and dense
 * FFN width, and where its K/V cache lies. Most models have one shape, and then the layout is the
 * one the engine always had, [seq][L][n_kv][n_ctx] rows of one size. Gemma 4 (cf_config hd_local,
 * n_kv_local, n_shared_kv, d_ff_shared_kv) has local layers with a head size and a KV head count of
 * their own (26B-A4B / 31B: 8 / 16 KV heads of 256 locally, 2 / 4 of 512 on the global layers), so
 * each KV-owning layer's cache is [n_kv][n_ctx] rows of its own count and size, and its query heads
 * group over its own KV heads (n_heads / n_kv); its last n_shared_kv layers own no cache and read
 * the last KV-owning layer of their kind's (llama.cpp's n_layer_kv_from_start - (local ? 2 : 1)),
 * whose layout is theirs (same kind: same head size and count).
 *
 * Per-layer embeddings (ple_dim P > 0), as llama.cpp's gemma4 graph computes them: at EMBED, with
 * x0 the scaled token embedding, every layer's input
 *     ple[l] = (rms(ple_proj x0 / sqrt(d))[l] * ple_norm + ple_emb[token][l] * sqrt(P)) / sqrt(2)
 * (cf_ple_inputs), and after each layer's RESID the PLE op
 *     x = (x + rms(ple.w_proj (gelu_tanh(ple.w_gate x) * ple[l])) * ple_post_norm) * out_scale
 * (cf_op_ple). Both split their mat-vecs over the threads by row groups like every other op and
 * allocate nothing: the rows live in cf_state (ple, ple_tok, ple_g, ple_gu, ple_h).
 *
 * The MoE layers (26B-A4B; the plan's dense, route, experts and RESID ops as for any MoE model):
 * the router reads its own norm of the layer input (moe.router_norm = ffn_gate_inp.scale / sqrt(d),
 * in ROUTE), each expert's output is scaled (moe.expert_scale, on its routing weight), the experts
 * are GeGLU, and RESID joins the two branches normed (cf_moe_out_norms).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine_internal.h"
#include "util.h"

const char *cf_gemma4_check_config(const cf_config *c) {
    int any = c->hd_local || c->n_kv_local || c->n_shared_kv || c->d_ff_shared_kv || c->ple_dim || c->v_norm ||
              c->out_scale;
    if ((c->moe_router_norm | c->expert_scale | c->moe_out_norms) & ~1)
        return "moe_router_norm, expert_scale and moe_out_norms must be 0 or 1";
    if ((c->moe_router_norm || c->expert_scale || c->moe_out_norms) && !c->n_experts)
        return "moe_router_norm, expert_scale and moe_out_norms need experts";
    if (c->moe_out_norms && (!c->d_ff || !c->post_norms || c->n_dense_lead))
        return "moe_out_norms joins a dense FFN beside the experts in every layer (post_norms)";
    if (c->hd_local < 0 || c->n_shared_kv < 0 || c->d_ff_shared_kv < 0 || c->ple_dim < 0 || !(c->logit_softcap >= 0) ||
        (c->v_norm | c->out_scale) & ~1)
        return "hd_local, n_shared_kv, d_ff_shared_kv, ple_dim and logit_softcap must be >= 0, v_norm and "
               "out_scale 0 or 1";
    if (!any) return NULL;
    if (c->mla_kv_lora || c->n_unique != c->n_layers)
        return "Gemma 4's per-layer shapes need a weight set per layer";
    if (c->hd_local && (c->hd_local % 2 || c->hd_local > CF_MAX_HEAD_DIM || (c->n_heads * c->hd_local) % CF_QK ||
                        c->swa_pattern <= 0 || c->sliding_window <= 0 || !(c->attn_scale > 0)))
        return "hd_local must be even, at most CF_MAX_HEAD_DIM, n_heads * hd_local a multiple of 32, and needs "
               "local and global layers (sliding_window_pattern) and an explicit attn_scale";
    if (c->n_kv_local && (c->n_kv_local < 0 || c->n_heads % c->n_kv_local || c->swa_pattern <= 0 ||
                          c->sliding_window <= 0))
        return "n_kv_local must divide n_heads and needs local and global layers (sliding_window_pattern)";
    if (c->n_shared_kv >= c->n_layers) return "n_shared_kv must leave a layer that owns its K/V";
    if (c->d_ff_shared_kv % CF_QK || (c->d_ff_shared_kv && !c->n_shared_kv))
        return "d_ff_shared_kv must be a multiple of 32 and needs n_shared_kv";
    if (c->ple_dim % CF_QK) return "ple_dim must be a multiple of 32 (it is the input width of ple.w_proj)";
    return NULL;
}

void cf_moe_out_norms(cf_engine *e, int l, int pslot, int ith) {
    const cf_layer *w = &e->w.sets[l % e->c.n_unique];
    int d = e->c.d;
    float eps = e->c.norm_eps, *z = e->ts[ith].xb + (size_t)e->max_batch * e->kmax; /* the scratch's extra row */
    const float *pend = e->s.pending + (size_t)pslot * e->max_batch * d;
    for (int b = 0; b < e->B; b++) {
        float *fn = e->ts[ith].xb + (size_t)b * e->kmax;
        e->k->rmsnorm(fn, e->s.f + (size_t)b * d, w->ffn_post_norm_1, d, eps);
        e->k->rmsnorm(z, pend + (size_t)b * d, w->moe_post_norm, d, eps);
        for (int j = 0; j < d; j++) fn[j] += z[j];
        e->k->rmsnorm(fn, fn, w->ffn_post_norm, d, eps);
    }
}

int cf_layer_geometry(cf_engine *e, char *err, size_t n) {
    const cf_config *c = &e->c;
    int L = c->n_layers, n_kv = L - c->n_shared_kv;
    e->geo = calloc(L, sizeof *e->geo);
    if (!e->geo) return cf_set_err(err, n, "out of memory"), -1;
    size_t ko = 0, vo = 0;
    e->hd_max = cf_max(c->hd, c->hd_local);
    e->kv_dim_max = 0;
    for (int l = 0; l < L; l++) {
        cf_layer_geo *g = &e->geo[l];
        int local = cf_layer_local(c, l);
        g->hd = c->hd_local && local ? c->hd_local : c->hd;
        g->n_kv = c->n_kv_local && local ? c->n_kv_local : c->n_kv;
        e->kv_dim_max = cf_max(e->kv_dim_max, g->n_kv * g->hd);
        g->has_kv = l < n_kv;
        g->d_ff = !g->has_kv && c->d_ff_shared_kv ? c->d_ff_shared_kv : c->d_ff;
        g->kv_src = g->has_kv ? l : n_kv - (local ? 2 : 1);
        g->krow = cf_kv_row_bytes(e->k_type, g->hd);
        g->vrow = c->mla_kv_lora ? 0 : cf_kv_row_bytes(e->v_type, g->hd); /* latent attention: V is K's */
        if (!g->has_kv) continue;
        g->koff = ko;
        g->voff = vo;
        ko += (size_t)g->n_kv * e->n_ctx * g->krow;
        vo += (size_t)g->n_kv * e->n_ctx * g->vrow;
    }
    for (int l = n_kv; l < L; l++) { /* a shared layer reads a cache of its own head size, count and kind */
        int src = e->geo[l].kv_src;
        if (src < 0 || e->geo[src].hd != e->geo[l].hd || e->geo[src].n_kv != e->geo[l].n_kv ||
            cf_layer_local(c, src) != cf_layer_local(c, l))
            return cf_set_err(err, n, "bad model config: shared-KV layer %d would read layer %d's cache, which is "
                              "not a KV-owning layer of its kind", l, src), -1;
    }
    e->seq_kbytes = ko;
    e->seq_vbytes = vo;
    return 0;
}

void cf_ple_inputs(cf_engine *e, int slot, int ith, int nth) {
    const cf_config *c = &e->c;
    cf_state *s = &e->s;
    cf_scratch *ts = &e->ts[ith];
    int d = c->d, P = c->ple_dim, L = c->n_layers, lp = L * P, B = e->B, g0, g1, b0, b1;
    const float *x = s->ring + (size_t)slot * e->max_batch * d;
    /* ple_proj x0 for this thread's row groups (every thread quantizes every row, privately) */
    cf_quantize_rows(e, x, d, d, ts->act, NULL, B, act_fmt(&e->w.ple_proj));
    cf_split_range(cf_n_groups(&e->w.ple_proj), ith, nth, 1, &g0, &g1);
    cf_matvec_rows(e, &e->w.ple_proj, ts->act, s->ple, lp, NULL, B, g0, g1);
    sync_threads(e, ith, CF_PK_EMBED);
    /* then this thread's rows, whole: scale, norm per layer, the token's row of ple_emb */
    const float inv_sqrt_d = 1.0f / sqrtf((float)d), sqrt_p = sqrtf((float)P), inv_sqrt2 = 1.0f / sqrtf(2.0f);
    cf_split_range(B, ith, nth, 1, &b0, &b1);
    for (int b = b0; b < b1; b++) {
        float *pl = s->ple + (size_t)b * lp, *tok = s->ple_tok + (size_t)b * lp;
        e->k->embed_row(&e->w.ple_emb, e->tokens[b], tok);
        for (int j = 0; j < lp; j++) pl[j] *= inv_sqrt_d;
        for (int l = 0; l < L; l++) e->k->rmsnorm(pl + (size_t)l * P, pl + (size_t)l * P, e->w.ple_norm, P, c->norm_eps);
        for (int j = 0; j < lp; j++) pl[j] = (pl[j] + tok[j] * sqrt_p) * inv_sqrt2;
    }
    if (ith == 0)
        e->cnt.n[CF_CNT_EMBED] += (uint64_t)B * (lp / cf_block_weights(e->w.ple_emb.dtype)) *
                                  cf_block_bytes(e->w.ple_emb.dtype) + cf_tiled_bytes(&e->w.ple_proj) +
                                  (uint64_t)P * sizeof(float);
}

void cf_op_ple(cf_engine *e, int l, int slot, int ith, int nth) {
    const cf_config *c = &e->c;
    const cf_layer *w = &e->w.sets[l % c->n_unique];
    cf_state *s = &e->s;
    cf_scratch *ts = &e->ts[ith];
    int d = c->d, P = c->ple_dim, B = e->B, lp = c->n_layers * P;
    float *x = s->ring + (size_t)slot * e->max_batch * d;
    ph(e, ith, CF_PK_RESID, l);
    if (P) {
        /* gate = gelu_tanh(ple.w_gate x) * ple[l] for this thread's groups of 8 (the table's geglu over
         * the gate interleaved with the layer's input, as geglu_rows reads a GeGLU) */
        int p0, p1;
        cf_quantize_rows(e, x, d, d, ts->act, NULL, B, act_fmt(&w->ple_gate));
        cf_split_range(P / CF_G, ith, nth, 1, &p0, &p1);
        cf_matvec_rows(e, &w->ple_gate, ts->act, s->ple_g, P, NULL, B, p0, p1);
        for (int b = 0; b < B && p0 < p1; b++) {
            float *gu = s->ple_gu + (size_t)b * 2 * P;
            const float *g = s->ple_g + (size_t)b * P, *in = s->ple + (size_t)b * lp + (size_t)l * P;
            for (int p = p0; p < p1; p++) {
                memcpy(gu + (size_t)2 * p * CF_G, g + (size_t)p * CF_G, CF_G * sizeof(float));
                memcpy(gu + (size_t)(2 * p + 1) * CF_G, in + (size_t)p * CF_G, CF_G * sizeof(float));
            }
            e->k->geglu(s->ple_h + (size_t)b * P + (size_t)p0 * CF_G, gu + (size_t)2 * p0 * CF_G, p1 - p0);
        }
        sync_threads(e, ith, CF_PK_RESID);
        /* ple.w_proj of the gated rows into y, then (whole rows: a barrier) its norm joins x */
        cf_quantize_rows(e, s->ple_h, P, P, ts->act2, NULL, B, act_fmt(&w->ple_proj));
        int glo[2], ghi[2], np = cf_d_split(cf_n_groups(&w->ple_proj), ith, nth, cf_split_whole_bands(e), glo, ghi);
        for (int q = 0; q < np; q++) cf_matvec_rows(e, &w->ple_proj, ts->act2, s->y, d, NULL, B, glo[q], ghi[q]);
        sync_threads(e, ith, CF_PK_RESID);
        for (int b = 0; b < B; b++)
            e->k->rmsnorm(ts->xb + (size_t)b * e->kmax, s->y + (size_t)b * d, w->ple_post_norm, d, c->norm_eps);
    }
    /* this thread's share of the rows (the same split as a [d, *] mat-vec): add, then scale */
    int glo[2], ghi[2], np = cf_d_split((d + CF_G - 1) / CF_G, ith, nth, cf_split_whole_bands(e), glo, ghi);
    float sc = w->out_scale ? w->out_scale[0] : 1.0f;
    for (int q = 0; q < np; q++) {
        int r0 = glo[q] * CF_G, r1 = cf_min(ghi[q] * CF_G, d);
        for (int b = 0; b < B; b++) {
            float *xr = x + (size_t)b * d;
            const float *nr = ts->xb + (size_t)b * e->kmax;
            if (P)
                for (int r = r0; r < r1; r++) xr[r] += nr[r];
            if (w->out_scale)
                for (int r = r0; r < r1; r++) xr[r] *= sc;
        }
    }
    if (ith == 0) e->cnt.n[CF_CNT_DENSE] += w->ple_bytes;
    sync_threads(e, ith, -1);
}
