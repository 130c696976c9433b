/* engine_deltanet.c — Qwen3.5's Gated DeltaNet ("linear attention") layers in the engine: the ATTN
 * op of a recurrent layer (cf_layer_recurrent), the per-sequence recurrent state it keeps beside
 * the KV cache, and the rules that keep that state honest.
 *
 * State: per sequence and recurrent layer, the conv rows ((K-1) x conv_dim: the previous K-1
 * tokens' conv inputs) and S (Hv x dh x dh), allocated once at creation (calloc: pages are mapped
 * when a sequence first uses them). A recurrent state cannot be rewound the way a KV cache is
 * (overwriting positions from p on): so each sequence's state remembers the position it continues
 * from, a call whose first row of a sequence is at position 0 starts that state over, and any other
 * position than the remembered one is refused by name (a rewind, a skip, a prefix reused from
 * another slot without cf_engine_copy_seq) instead of silently running on the wrong state.
 *
 * The op, per call of B rows (a sequence's rows in order): norm and quantize each row; the
 * projections u = W_qkv x (the conv's input), z = W_z x, alpha = W_alpha x and beta = W_beta x (Hv
 * rows each, quantized like the others: llama.cpp rounds their input to int8 too); the conv, split
 * by channels (each channel's column of the conv state belongs to one thread, which steps the rows
 * in order); the recurrence, split by v heads (each head's S belongs to one
 * thread, which steps the rows in order: deltanet.h's pieces, the head through the kernel table's
 * deltanet_head); then W_out and the residual, as attention's wo.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine_internal.h"
#include "util.h"

/* The widest DeltaNet head the engine takes (Qwen3.5: 128). */
#define CF_MAX_SSM_DH 512

const char *cf_deltanet_check_config(const cf_config *c) {
    if ((c->n_rot < 0 || c->n_rot % 2 || c->n_rot > c->hd) || (c->attn_gate & ~1))
        return "n_rot must be even and in 0..head_dim, attn_gate 0 or 1";
    if (c->n_rot && c->n_rope_factors && c->n_rope_factors != c->n_rot / 2)
        return "rope_freq_factors must be n_rot/2 values with partial RoPE";
    if (c->ssm_interval == 0)
        return c->ssm_hk | c->ssm_hv | c->ssm_dh | c->ssm_conv ? "DeltaNet sizes need full_attn_interval > 0" : NULL;
    if (c->ssm_interval < 1 || c->ssm_hk < 1 || c->ssm_hv < 1 || c->ssm_hv % c->ssm_hk)
        return "full_attn_interval and the DeltaNet heads must be positive, the v heads a multiple of the q/k heads";
    if (c->ssm_dh < 1 || c->ssm_dh > CF_MAX_SSM_DH || c->ssm_conv < 1 || c->ssm_conv > 64)
        return "the DeltaNet head dim must be in 1..512 and its conv kernel in 1..64";
    if ((c->ssm_hv * c->ssm_dh) % CF_QK || ((2 * c->ssm_hk + c->ssm_hv) * c->ssm_dh) % CF_G)
        return "the DeltaNet value width (Hv dh) must be a multiple of 32 and its conv width of 8";
    if (c->mla_kv_lora || c->n_unique != c->n_layers)
        return "DeltaNet layers do not go with latent attention or shared weight sets";
    return NULL;
}

static size_t conv_floats(const cf_config *c) {
    return (size_t)(c->ssm_conv - 1) * (2 * c->ssm_hk + c->ssm_hv) * c->ssm_dh;
}

int cf_deltanet_alloc(cf_engine *e) {
    const cf_config *c = &e->c;
    size_t B = e->max_batch, C = (size_t)(2 * c->ssm_hk + c->ssm_hv) * c->ssm_dh, V = (size_t)c->ssm_hv * c->ssm_dh;
    e->dn_off = calloc(c->n_layers, sizeof *e->dn_off);
    e->dn_pos = malloc(sizeof *e->dn_pos * e->n_seq);
    if (!e->dn_off || !e->dn_pos) return -1;
    size_t per = 0;
    for (int l = 0; l < c->n_layers; l++) {
        e->dn_off[l] = per;
        if (cf_layer_recurrent(c, l)) per += conv_floats(c) + (size_t)c->ssm_hv * c->ssm_dh * c->ssm_dh;
    }
    e->dn_seq = per;
    for (int s = 0; s < e->n_seq; s++) e->dn_pos[s] = -1; /* nothing to continue: start at 0 */
    e->dn_state = calloc(per * e->n_seq, sizeof(float));
    e->dn_u = calloc(B * C, sizeof(float));
    e->dn_z = calloc(B * V, sizeof(float));
    e->dn_ab = calloc(B * 2 * c->ssm_hv, sizeof(float));
    e->dn_o = calloc(B * V, sizeof(float));
    return e->dn_state && e->dn_u && e->dn_z && e->dn_ab && e->dn_o ? 0 : -1;
}

void cf_deltanet_free(cf_engine *e) {
    void *bufs[] = {e->dn_state, e->dn_off, e->dn_pos, e->dn_u, e->dn_z, e->dn_ab, e->dn_o};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
}

int cf_deltanet_check_rows(cf_engine *e, const int *seq, const int *pos, int B) {
    if (!e->c.ssm_interval) return 0;
    for (int b = 0; b < B; b++) {
        int s = seq[b], first = 1;
        for (int a = 0; a < b && first; a++) first = seq[a] != s;
        if (!first || pos[b] == 0 || pos[b] == e->dn_pos[s]) continue;
        if (e->dn_pos[s] < 0)
            cf_set_err(e->err, sizeof e->err, "sequence %d has no recurrent (Gated DeltaNet) state to continue at "
                       "position %d: this model's layers keep a state, not a cache of positions, so a sequence "
                       "must start at position 0", s, pos[b]);
        else
            cf_set_err(e->err, sizeof e->err, "sequence %d's recurrent (Gated DeltaNet) state continues from "
                       "position %d, not %d: a recurrent model cannot rewind or skip positions (speculative "
                       "rollback, prefix reuse, KV rewinds); run the sequence again from position 0",
                       s, e->dn_pos[s], pos[b]);
        return -1;
    }
    return 0;
}

void cf_deltanet_advance(cf_engine *e, int ok) {
    if (!e->c.ssm_interval) return;
    for (int b = 0; b < e->B; b++) e->dn_pos[e->rseq[b]] = ok ? e->rpos[b] + 1 : -1;
}

int cf_deltanet_copy_seq(cf_engine *e, int src, int dst, int n) {
    if (!e->c.ssm_interval) return 0;
    if (n == 0) {
        e->dn_pos[dst] = -1;
        return 0;
    }
    if (e->dn_pos[src] != n) {
        cf_set_err(e->err, sizeof e->err, "cannot copy sequence %d's first %d positions: its recurrent (Gated "
                   "DeltaNet) state is the state after position %d, and a recurrent state holds no earlier ones",
                   src, n, e->dn_pos[src] - 1);
        return -1;
    }
    memcpy(e->dn_state + (size_t)dst * e->dn_seq, e->dn_state + (size_t)src * e->dn_seq, e->dn_seq * sizeof(float));
    e->dn_pos[dst] = n;
    return 0;
}

void cf_op_deltanet(cf_engine *e, int l, int slot, int ith, int nth) {
    const cf_config *c = &e->c;
    const cf_layer *w = &e->w.sets[l];
    const cf_deltanet_layer *dn = &w->dn;
    cf_scratch *ts = &e->ts[ith];
    const int d = c->d, B = e->B, Hk = c->ssm_hk, Hv = c->ssm_hv, dh = c->ssm_dh;
    const int C = (2 * Hk + Hv) * dh, V = Hv * dh;
    const float *x = e->s.ring + (size_t)slot * e->max_batch * d;

    // norm, quantize (every thread, private), then this thread's share of each projection
    ph(e, ith, CF_PK_NORM, l);
    for (int b = 0; b < B; b++) e->k->rmsnorm(ts->xb + (size_t)b * e->kmax, x + (size_t)b * d, w->attn_norm, d, c->norm_eps);
    cf_quantize_rows(e, ts->xb, e->kmax, d, ts->act, NULL, B, w->qkv_fmt);
    ph(e, ith, CF_PK_QKV, l);
    int g0, g1;
    cf_split_range(cf_n_groups(&w->ssm_qkv), ith, nth, 1, &g0, &g1);
    cf_matvec_rows(e, &w->ssm_qkv, ts->act, e->dn_u, C, NULL, B, g0, g1);
    cf_split_range(cf_n_groups(&w->ssm_z), ith, nth, 1, &g0, &g1);
    cf_matvec_rows(e, &w->ssm_z, ts->act, e->dn_z, V, NULL, B, g0, g1);
    /* alpha and beta: a few rows each, one group per thread at most */
    cf_split_range(cf_n_groups(&w->ssm_alpha), ith, nth, 1, &g0, &g1);
    cf_matvec_rows(e, &w->ssm_alpha, ts->act, e->dn_ab, 2 * Hv, NULL, B, g0, g1);
    cf_split_range(cf_n_groups(&w->ssm_beta), ith, nth, 1, &g0, &g1);
    cf_matvec_rows(e, &w->ssm_beta, ts->act, e->dn_ab + Hv, 2 * Hv, NULL, B, g0, g1);
    sync_threads(e, ith, CF_PK_ATTN);

    // the conv, by channels: each thread steps its channels' state columns through the rows in order
    // (a row at position 0 starts its sequence's columns over), the output in place of u
    int c0, c1;
    cf_split_range(C, ith, nth, 1, &c0, &c1);
    const size_t conv_n = conv_floats(c);
    for (int b = 0; b < B && c0 < c1; b++) {
        float *state = e->dn_state + (size_t)e->rseq[b] * e->dn_seq + e->dn_off[l];
        if (e->rpos[b] == 0)
            for (size_t j = 0; j < conv_n / C; j++) memset(state + j * C + c0, 0, (size_t)(c1 - c0) * sizeof(float));
        float *u = e->dn_u + (size_t)b * C;
        cf_deltanet_conv(dn, state, u, u, c0, c1);
    }
    sync_threads(e, ith, CF_PK_ATTN);

    // the recurrence, by v heads: each thread steps its heads' S through the rows in order. Heads
    // outside, rows inside: a head's S (dh x dh floats, 64 KiB at Qwen3.5's 128) stays in the
    // core's cache over a prefill's rows instead of all the thread's heads passing through it per
    // row; each head sees the same operations in the same order either way.
    int h0, h1;
    cf_split_range(Hv, ith, nth, 1, &h0, &h1);
    const float q_scale = 1.0f / sqrtf((float)dh);
    float q[CF_MAX_SSM_DH], k[CF_MAX_SSM_DH];
    for (int h = h0; h < h1; h++) {
        for (int b = 0; b < B; b++) {
            float *S = e->dn_state + (size_t)e->rseq[b] * e->dn_seq + e->dn_off[l] + conv_n + (size_t)h * dh * dh;
            const float *cr = e->dn_u + (size_t)b * C, *ab = e->dn_ab + (size_t)b * 2 * Hv;
            if (e->rpos[b] == 0) memset(S, 0, (size_t)dh * dh * sizeof(float));
            /* v head h reads q/k head h % Hk (ggml's repeat tiles the Hk heads) */
            memcpy(q, cr + (h % Hk) * dh, dh * sizeof(float));
            memcpy(k, cr + (Hk + h % Hk) * dh, dh * sizeof(float));
            cf_deltanet_l2_normalise(q, dh, c->norm_eps);
            cf_deltanet_l2_normalise(k, dh, c->norm_eps);
            float decay, rate, *o = e->dn_o + (size_t)b * V + (size_t)h * dh;
            cf_deltanet_gates(dn, h, ab[h], ab[Hv + h], &decay, &rate);
            e->k->deltanet_head(S, q, k, cr + 2 * Hk * dh + h * dh, decay, rate, o, dh);
            for (int j = 0; j < dh; j++) o[j] *= q_scale;
            cf_deltanet_out_norm(dn, o, e->dn_z + (size_t)b * V + (size_t)h * dh);
        }
    }
    sync_threads(e, ith, CF_PK_WO);

    // the output projection into h, plus the residual, for this thread's rows (as attention's wo)
    cf_quantize_rows(e, e->dn_o, V, V, ts->act, NULL, B, act_fmt(&w->ssm_out));
    int glo[2], ghi[2], np = cf_d_split(cf_n_groups(&w->ssm_out), ith, nth, cf_split_whole_bands(e), glo, ghi);
    for (int p = 0; p < np; p++) {
        cf_matvec_rows(e, &w->ssm_out, ts->act, e->s.h, d, NULL, B, glo[p], ghi[p]);
        int r0 = glo[p] * CF_G, r1 = cf_min(ghi[p] * CF_G, d);
        for (int b = 0; b < B; b++)
            for (int r = r0; r < r1; r++) e->s.h[(size_t)b * d + r] += x[(size_t)b * d + r];
    }
    if (ith == 0) e->cnt.n[CF_CNT_ATTN] += w->attn_bytes;
    sync_threads(e, ith, -1);
}
