/* engine.c — the per-token decode step (and batched prefill) over tiled weights in an mmap.
 *
 * One call from Python runs a whole forward pass for B tokens (B = 1 when decoding): the caller
 * thread and the pool's workers all enter forward_task() once (one cf_pool_run per call) and walk
 * the plan together, meeting at a spin barrier between phases. Every mat-vec is split over the
 * threads by ranges of 8-row groups, so each thread streams a contiguous slice of every tile and
 * writes only its own output rows; the small serial pieces (RMSNorm, activation quantization) are
 * done redundantly by every thread into private scratch, which costs less than a barrier.
 *
 * Prefill runs the same code with B > 1 through the batched kernels (matmat, gate_up_mm): a
 * thread's share of each tile is read once and every weight block is unpacked once for all B
 * activations, so weights come from DRAM once per batch and cost one decode per batch. The
 * tokens routed to an expert are gathered (their activation descriptors, not the data) so they
 * take the batched kernels too.
 *
 * Several sequences (cf_step_batch): the engine holds n_seq KV caches, and each row of a call
 * carries its own sequence slot and position (rseq, rpos), so one pass advances B different
 * sequences: the same batched kernels as prefill read each weight tile once for all rows, RoPE,
 * the K/V store and attention use the row's own position and cache, and op_final writes every
 * row's logits. Nothing else changes: every op is already row-local, which is what makes a row's
 * result independent of the other rows (engine.h).
 *
 * Experts may live on disk instead (cf_disk_experts, experts.h): then the route op, on thread 0,
 * pins cache slots for the chosen experts and queues the reads of the missing ones, and the experts
 * op waits on each slot's word for the expert it needs next. With experts in RAM that costs one
 * pointer test per MoE op; nothing else on that path changes. Optionally the route also predicts
 * the next layers' experts and starts their reads (expert speculation, engine_spec.c).
 *
 * Profiling (cf_engine_profile_start, engine.h): every phase boundary calls ph() and every barrier
 * goes through sync_threads(), which with profiling on cut each thread's walk into contiguous
 * timestamped segments (op phases and waits) in buffers allocated when profiling starts; with it
 * off each is one branch on e->prof_on.
 *
 * Nothing on the per-token path allocates. Names: see engine.h.
 */
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine_internal.h"
#include "util.h"

// ---------------------------------------------------------------------------------------------
// small ops (plain C: cheap next to the mat-vecs)

static void quantize_rows(const cf_engine *e, const float *x, int stride, int K, cf_act_q8 *act,
                          const int *tok, int n, int fmt) {
    for (int i = 0; i < n; i++) {
        int t = tok ? tok[i] : i;
        act[t].n = K;
        if (fmt & ACT_Q8) e->k->quantize_act(x + (size_t)t * stride, &act[t]);
        if (fmt & ACT_Q8K) e->k->quantize_act_k(x + (size_t)t * stride, &act[t]);
    }
}

/* fn(w, act[t], y[t], ...) over the unit range [u0, u1) for the n tokens in tok (NULL: 0..n-1).
 * With several tokens the range is cut at tile-band boundaries (`band` units) and each piece is
 * applied to every token before moving on, so the band's bytes are reused from L2. */
static void band_loop(cf_matvec_fn fn, const cf_tiled *w, const cf_act_q8 *act, float *y,
                      int ystride, const int *tok, int n, int u0, int u1, int band) {
    if (u0 >= u1) return;
    if (n == 1) {
        int t = tok ? tok[0] : 0;
        fn(w, &act[t], y + (size_t)t * ystride, u0, u1);
        return;
    }
    for (int a = u0; a < u1;) {
        int b = cf_min((a / band + 1) * band, u1);
        for (int i = 0; i < n; i++) {
            int t = tok ? tok[i] : i;
            fn(w, &act[t], y + (size_t)t * ystride, a, b);
        }
        a = b;
    }
}


/* Split of n units over nth threads like cf_split_range, but with the larger pieces first (when
 * n is not a multiple of nth, the first threads get one more unit, not the last). */
static void split_big_first(int n, int ith, int nth, int *lo, int *hi) {
    int a, b;
    cf_split_range(n, nth - 1 - ith, nth, 1, &a, &b);
    *lo = n - b;
    *hi = n - a;
}

/* Row groups of a [d, *] mat-vec (wo, down) that thread ith owns: at most two ranges, returned
 * in lo/hi, their number returned. The whole SPLIT_BAND-group bands that divide evenly over the
 * threads are shared out as whole bands. The groups after them (a part band, or bands left over)
 * go out as whole bands too, one thread each, in a one-row call (`whole`: cf_split_whole_bands) when
 * that leaves no thread more than 5/4 of an even share; otherwise they are split evenly by groups.
 * Why whole bands when decoding one row: a band is stored tile by tile with all its groups in each
 * tile, so threads that split a band's groups read interleaved pieces of the same tiles, and that
 * band streamed at a fraction of the rate of the others. Measured on
 * the 2-core Zen 4 VM, 2 threads, `cflow bench --profile`, alternating: Gemma 3 1B's down
 * projection (d 1152 = 9 bands) at 0.97-1.0x the gate/up's GB/s instead of 0.78-0.82x, its wo
 * 0.78-0.86x instead of 0.69-0.78x; SmolLM2's (d 576 = 4.5 bands) down 37-39 GB/s instead of
 * 30-32. A call of many rows (prefill) computes more than it streams, so there the imbalance of
 * whole bands costs (Gemma 3 1B pp64 ~0.95x) and the even group split stays. (With rows split
 * plainly, mid-band, the thread with the later rows ran ~45% longer.) A function of (ng, ith, nth,
 * whole) only, and every d_split of one call passes the same `whole`: the RESID op calls it for the
 * same rows as a [d, *] mat-vec (see ffn()), expert outputs included. SPLIT_BAND is the default
 * tile_rows / CF_G; for other tilings only the speed differs. */
enum { SPLIT_BAND = 16 };
static int d_split(int ng, int ith, int nth, int whole, int lo[2], int hi[2]) {
    int nb = ng / SPLIT_BAND / nth * nth; /* whole bands shared evenly */
    int left = ng - nb * SPLIT_BAND, lb = (left + SPLIT_BAND - 1) / SPLIT_BAND;
    int b0, b1, r0, r1, k = 0;
    cf_split_range(nb, ith, nth, 1, &b0, &b1);
    int largest = nb / nth * SPLIT_BAND + cf_min((lb + nth - 1) / nth * SPLIT_BAND, left);
    if (whole && 4 * largest * nth <= 5 * ng) { /* the leftover by whole bands */
        int u0, u1;
        cf_split_range(lb, ith, nth, 1, &u0, &u1);
        r0 = cf_min(u0 * SPLIT_BAND, left);
        r1 = cf_min(u1 * SPLIT_BAND, left);
    } else
        cf_split_range(left, ith, nth, 1, &r0, &r1);
    if (b0 < b1) {
        lo[k] = b0 * SPLIT_BAND;
        hi[k++] = b1 * SPLIT_BAND;
    }
    if (r0 < r1) {
        lo[k] = nb * SPLIT_BAND + r0;
        hi[k++] = nb * SPLIT_BAND + r1;
    }
    return k;
}

/* y[t, rows of groups g0..g1) = W x_t for the n tokens in tok (NULL: 0..n-1). With several tokens
 * the range is walked one tile band at a time so the band is reused from L2 across tokens. */
static void matvec_rows(const cf_engine *e, const cf_tiled *w, const cf_act_q8 *act, float *y,
                        int ystride, const int *tok, int n, int g0, int g1) {
    if (!tok && n > 1) { /* contiguous tokens: the batched kernel unpacks each block once */
        if (g0 < g1) e->k->matmat[w->dtype](w, act, n, y, ystride, g0, g1);
        return;
    }
    band_loop(e->k->matvec[w->dtype], w, act, y, ystride, tok, n, g0, g1, w->tile_rows / CF_G);
}

/* hid[t, 8p..8p+8) = silu(gate) * up for the group pairs [p0, p1) of an interleaved gate_up. */
static void gate_up_rows(const cf_engine *e, const cf_tiled *w, const cf_act_q8 *act, float *hid,
                         int hstride, const int *tok, int n, int p0, int p1) {
    if (!tok && n > 1) {
        if (p0 < p1) e->k->gate_up_mm[w->dtype](w, act, n, hid, hstride, p0, p1);
        return;
    }
    band_loop(e->k->gate_up[w->dtype], w, act, hid, hstride, tok, n, p0, p1,
              cf_max(1, w->tile_rows / (2 * CF_G)));
}

/* hid[t, 8p..8p+8) = gelu_tanh(gate) * up for the group pairs [p0, p1) (a GeGLU, ffn_gelu): the
 * interleaved matrix's rows (gate group p is its group 2p, up group p its group 2p + 1) through the
 * plain mat-vec into s->gu, then the table's geglu per pair (f32; llama.cpp's CPU backend reads
 * GELU from a table over fp16 inputs instead, within 0.1% of it). The pairs are the thread's own:
 * no barrier. */
static void geglu_rows(const cf_engine *e, const cf_tiled *w, const cf_act_q8 *act, int hstride, const int *tok,
                       int n, int p0, int p1) {
    if (p0 >= p1) return;
    int gstride = 2 * e->hmax;
    matvec_rows(e, w, act, e->s.gu, gstride, tok, n, 2 * p0, 2 * p1);
    for (int i = 0; i < n; i++) {
        size_t t = tok ? (size_t)tok[i] : (size_t)i;
        e->k->geglu(e->s.hid + t * hstride + (size_t)p0 * CF_G, e->s.gu + t * gstride + (size_t)2 * p0 * CF_G,
                    p1 - p0);
    }
}

/* hid[t, 8p..8p+8) = swiglu_oai(gate + b_gate, up + b_up) for the group pairs [p0, p1) (gpt-oss's
 * experts, CF_ACT_SWIGLU_OAI): like geglu_rows, the raw rows through the plain mat-vec into s->gu,
 * then the bias (interleaved like the rows; NULL: none) and the table's swiglu_oai per pair. */
static void swiglu_oai_rows(const cf_engine *e, const cf_tiled *w, const float *bias, const cf_act_q8 *act,
                            float *hid, float *gu_rows, int hstride, const int *tok, int n, int p0, int p1) {
    if (p0 >= p1) return;
    int gstride = 2 * e->hmax, n_rows = 2 * (p1 - p0) * CF_G;
    matvec_rows(e, w, act, gu_rows, gstride, tok, n, 2 * p0, 2 * p1);
    for (int i = 0; i < n; i++) {
        size_t t = tok ? (size_t)tok[i] : (size_t)i;
        float *gu = gu_rows + t * gstride + (size_t)2 * p0 * CF_G;
        if (bias)
            for (int j = 0; j < n_rows; j++) gu[j] += bias[(size_t)2 * p0 * CF_G + j];
        e->k->swiglu_oai(hid + t * hstride + (size_t)p0 * CF_G, gu, p1 - p0, CF_OAI_ALPHA, CF_OAI_LIMIT);
    }
}

/* The activations ffn() runs: SwiGLU (fused into the gate_up kernels), GeGLU, OpenAI's SwiGLU. */
enum { FFN_SILU, FFN_GELU, FFN_OAI };

/* One SwiGLU FFN (fused gate_up, then down; GeGLU when act is FFN_GELU: geglu_rows; OpenAI's
 * SwiGLU with the expert's biases b_gu (gate|up, interleaved) and b_down when FFN_OAI) for tokens
 * tok[0..n) whose quantized input is in ts->act; out[t, own rows] = down(hid). When `scale` is
 * given, out[t] += scale[i] * result instead (expert outputs into a pending slot). A barrier
 * separates gate_up from down; the one after down is skipped when `tail` is 0: the caller's next
 * step only touches this thread's own rows (the RESID op splits rows exactly like a [d, *] mat-vec
 * does). */
static void ffn(cf_engine *e, const cf_tiled *gate_up, const cf_tiled *down, int hdim, int act, const float *b_gu,
                const float *b_down, const int *tok, int n, float *out, const float *scale, int tail, int pk, int ith,
                int nth) {
    cf_state *s = &e->s;
    cf_scratch *ts = &e->ts[ith];
    int d = e->c.d, p0, p1;
    const cf_act_q8 *in = ts->act;
    const int *rows = tok; /* which rows of hid and y hold token tok[i] (NULL: row i) */
    if (tok && n > 1 && scale) {
        // Several routed tokens: gather their activation descriptors so the batched kernels
        // apply; hid and y (scratch) then hold them in compact rows 0..n-1.
        for (int i = 0; i < n; i++) ts->gather[i] = ts->act[tok[i]];
        in = ts->gather;
        rows = NULL;
    }
    ph(e, ith, pk, -1); /* pk: the gate_up phase; pk + 1 the down phase */
    cf_split_range(hdim / CF_G, ith, nth, 1, &p0, &p1);
    if (act == FFN_GELU) geglu_rows(e, gate_up, in, e->hmax, rows, n, p0, p1);
    else if (act == FFN_OAI) swiglu_oai_rows(e, gate_up, b_gu, in, s->hid, s->gu, e->hmax, rows, n, p0, p1);
    else gate_up_rows(e, gate_up, in, s->hid, e->hmax, rows, n, p0, p1);
    sync_threads(e, ith, pk + 1);

    quantize_rows(e, s->hid, e->hmax, hdim, ts->act2, rows, n, act_fmt(down));
    int glo[2], ghi[2], np = d_split(cf_n_groups(down), ith, nth, cf_split_whole_bands(e), glo, ghi);
    float *dst = scale ? s->y : out;
    for (int q = 0; q < np; q++) matvec_rows(e, down, ts->act2, dst, d, rows, n, glo[q], ghi[q]);
    for (int q = 0; q < np && scale; q++) {
        int g0 = glo[q], g1 = ghi[q];
        int r0 = g0 * CF_G, r1 = cf_min(g1 * CF_G, d);
        for (int i = 0; i < n; i++) {
            int t = tok ? tok[i] : i;
            float *o = out + (size_t)t * d;
            const float *yy = s->y + (size_t)(rows ? rows[i] : i) * d;
            if (b_down) /* the expert's down bias joins before its routing weight, as in llama.cpp */
                for (int r = r0; r < r1; r++) o[r] += scale[i] * (yy[r] + b_down[r]);
            else
                for (int r = r0; r < r1; r++) o[r] += scale[i] * yy[r];
        }
    }
    if (tail) sync_threads(e, ith, -1);
}

// ---------------------------------------------------------------------------------------------
// plan ops; each runs on every thread and ends at a barrier (FINAL ends with the pool run)

static void op_embed(cf_engine *e, int slot, int ith, int nth) {
    int d = e->c.d, b0, b1;
    ph(e, ith, CF_PK_EMBED, 0);
    cf_split_range(e->B, ith, nth, 1, &b0, &b1);
    float *x = e->s.ring + (size_t)slot * e->max_batch * d;
    for (int b = b0; b < b1; b++) {
        float *xb = x + (size_t)b * d, sc = e->c.embed_scale;
        e->k->embed_row(&e->w.tok_emb, e->tokens[b], xb);
        if (sc != 1.0f) /* Gemma: the embedding times sqrt(d), in f32 as llama.cpp's ggml_scale */
            for (int j = 0; j < d; j++) xb[j] *= sc;
    }
    if (ith == 0)
        e->cnt.n[CF_CNT_EMBED] += (uint64_t)e->B * (d / cf_block_weights(e->w.tok_emb.dtype)) *
                                  cf_block_bytes(e->w.tok_emb.dtype);
    if (e->c.ple_dim) { /* Gemma 4: every layer's input from the whole embedded rows */
        sync_threads(e, ith, CF_PK_EMBED);
        cf_ple_inputs(e, slot, ith, nth);
    }
    sync_threads(e, ith, -1);
}

static inline int layer_local(const cf_config *c, int l) { return cf_layer_local(c, l); }

/* The window of layer l: 0 (the whole context) on global layers. */
static inline int layer_window(const cf_config *c, int l) { return layer_local(c, l) ? c->sliding_window : 0; }

/* Width of a row of s->qkv at layer l: its q heads, and its k and v heads when it owns K/V. */
static inline int qkv_width(const cf_engine *e, int l) {
    return (e->c.n_heads + (e->geo[l].has_kv ? 2 * e->geo[l].n_kv : 0)) * e->geo[l].hd;
}

/* Heads [u0, u1) of token b's fused QKV output (q heads, then k heads, then v heads): add the
 * bias, normalise q and k heads (qk_norm), rotate them; store k and v in the cache at the token's
 * position (fp16, or q8_0 blocks), v normalised first with v_norm (Gemma 4). */
static void qkv_heads(cf_engine *e, const cf_layer *w, int l, int b, int u0, int u1) {
    const cf_config *c = &e->c;
    int hd = e->geo[l].hd, nh = c->n_heads, nkv = e->geo[l].n_kv, p = e->rpos[b];
    size_t krow = e->geo[l].krow, vrow = e->geo[l].vrow;
    float *row = e->s.qkv + (size_t)b * qkv_width(e, l);
    /* local layers with a RoPE base of their own (Gemma 3) take their own table */
    const float *cs = e->s.rope_local && layer_local(c, l) ? e->s.rope_local + (size_t)b * e->hd_max
                                                           : e->s.rope + (size_t)b * c->hd;
    const int rd = c->n_rot ? c->n_rot : hd;
    /* the attention temperature (Llama 4 / Mistral 3): rotated q heads times 1 + s ln(p / floor + 1),
     * as llama.cpp's ggml_mul of Qcur by its per-position scale (log in double, rounded to float) */
    float qt = 1.0f;
    if (c->attn_temp_scale > 0) qt = (float)(log((double)(p / c->attn_temp_floor) + 1.0) * c->attn_temp_scale + 1.0);
    for (int u = u0; u < u1; u++) {
        float *v = row + (size_t)u * hd;
        int kvh = u < nh + nkv ? u - nh : u - nh - nkv;
        if (w->qkv_bias)
            for (int i = 0; i < hd; i++) v[i] += w->qkv_bias[(size_t)u * hd + i];
        if (u < nh + nkv) {
            if (w->q_norm && !c->qk_norm_full) e->k->rmsnorm(v, v, u < nh ? w->q_norm : w->k_norm, hd, c->norm_eps);
            e->k->rope(v, 1, rd, cs, cs + rd / 2); /* partial RoPE: the first n_rot dims turn */
        }
        if (u < nh) {
            if (qt != 1.0f)
                for (int i = 0; i < hd; i++) v[i] *= qt;
            continue;
        }
        int is_k = u < nh + nkv, type = is_k ? e->k_type : e->v_type;
        if (!is_k && c->v_norm) e->k->rmsnorm(v, v, e->s.ones, hd, c->norm_eps);
        uint8_t *row = cf_kv_rows(e, e->rseq[b], l, is_k) + ((size_t)kvh * e->n_ctx + p) * (is_k ? krow : vrow);
        if (type == CF_Q8_0)
            e->k->f32_to_q8_0(row, v, hd);
        else
            e->k->f32_to_f16((cf_half *)row, v, hd);
    }
}

/* Row groups [g0, g1) of the q|k|v projection for the B tokens into s->qkv: one mat-vec over the
 * fused matrix, or the pieces of [g0, g1) that fall in each of its three parts. */
static void qkv_rows(const cf_engine *e, const cf_layer *w, const cf_act_q8 *act, int l, int B, int g0, int g1) {
    int qkv_dim = qkv_width(e, l);
    if (!w->qkv_split) {
        matvec_rows(e, &w->wqkv, act, e->s.qkv, qkv_dim, NULL, B, g0, g1);
        return;
    }
    const cf_tiled *part[3] = {&w->wq, &w->wk, &w->wv};
    for (int k = 0, p0 = 0; k < 3; p0 += cf_n_groups(part[k]), k++) { /* p0: the part's first group */
        int a = cf_max(g0, p0), b = cf_min(g1, p0 + cf_n_groups(part[k]));
        if (a < b) matvec_rows(e, part[k], act, e->s.qkv + (size_t)p0 * CF_G, qkv_dim, NULL, B, a - p0, b - p0);
    }
}

/* First cached position row b attends to at layer l: a local layer's sliding window keeps the last W. */
static int attn_first(const cf_engine *e, int b, int l) {
    int W = layer_window(&e->c, l);
    return W > 0 && e->rpos[b] >= W ? e->rpos[b] - W + 1 : 0;
}

/* ATTN_QBLOCK (engine_internal.h): each K/V row converted once serves that many queries times the
 * query heads of its kv head. */

/* Rows of n_ctx floats in each thread's score scratch: one per query head (the per-query kernel),
 * or one per query head of a kv head and row of a block (attn_blocks), whichever is more; the
 * largest group of any layer (Gemma 4's layers have KV head counts of their own). */
int cf_attn_score_rows(const cf_engine *e) {
    int min_kv = e->c.n_kv_local ? cf_min(e->c.n_kv, e->c.n_kv_local) : e->c.n_kv;
    return cf_max(e->c.n_heads, e->c.n_heads / min_kv * cf_min(ATTN_QBLOCK, e->max_batch));
}

/* Thread 0, before a call: how op_attn splits the rows. A run of consecutive rows at consecutive
 * positions of one sequence (a prompt, or a prompt's chunk beside other sequences' decode rows:
 * cf_step_rows) goes in blocks of up to ATTN_QBLOCK rows through attention_block; the rows of
 * runs of one row (decode steps) go one by one through the per-query kernel. Both give the same
 * bits (cflow.h). CFLOW_ATTN_BLOCK=0 in the environment sends every row through the per-query
 * kernel: the comparison `cflow bench` timings need. Read per call, so a process can switch. */
static void attn_plan(cf_engine *e) {
    const char *env = getenv("CFLOW_ATTN_BLOCK");
    int blocks = !env || strcmp(env, "0") != 0;
    e->n_ablk = e->n_arow = 0;
    for (int b0 = 0, b1; b0 < e->B; b0 = b1) {
        for (b1 = b0 + 1; b1 < e->B && e->rseq[b1] == e->rseq[b0] && e->rpos[b1] == e->rpos[b1 - 1] + 1; b1++) {}
        if (!blocks || b1 - b0 < 2) {
            for (int b = b0; b < b1; b++) e->arow[e->n_arow++] = b;
            continue;
        }
        for (int b = b0; b < b1; b += ATTN_QBLOCK) {
            e->ablk[2 * e->n_ablk] = b;
            e->ablk[2 * e->n_ablk++ + 1] = cf_min(ATTN_QBLOCK, b1 - b);
        }
    }
}

/* Block j's query heads [h0, h1) (attn_plan's blocks) through the block kernel. */
static void attn_block_heads(cf_engine *e, int l, int j, float *scores, int h0, int h1) {
    const cf_config *c = &e->c;
    const cf_layer *w = &e->w.sets[l % c->n_unique];
    int hd = e->geo[l].hd, nkv = e->geo[l].n_kv, q_dim = c->n_heads * hd, qkv_dim = qkv_width(e, l);
    int b0 = e->ablk[2 * j], nq = e->ablk[2 * j + 1];
    cf_attn_block_shape sh = {.n_heads = c->n_heads, .n_kv_heads = nkv, .head_dim = hd,
                              .max_seq = e->n_ctx, .scale = e->attn_scale,
                              .pos0 = e->rpos[b0], .n_q = nq, .window = layer_window(c, l),
                              .ldq = qkv_dim, .ldo = q_dim, .sinks = w->sinks};
    float *out = e->s.att + (size_t)b0 * q_dim, *q = e->s.qkv + (size_t)b0 * qkv_dim;
    const uint8_t *k = cf_kv_rows(e, e->rseq[b0], l, 1), *v = cf_kv_rows(e, e->rseq[b0], l, 0);
    if (e->k_type == CF_F16 && e->v_type == CF_F16)
        e->k->attention_block(out, q, (const cf_half *)k, (const cf_half *)v, scores, &sh, h0, h1);
    else
        e->k->attention_block_q8kv(out, q, k, v, e->k_type, e->v_type, scores, &sh, h0, h1);
}

/* Block attention (attn_plan's blocks): work items are (block, kv head), dealt round robin, kv
 * heads fastest, so both the causal growth of the rows and the heads spread over the threads;
 * an item writes only its heads of its rows. Few items for the threads (a verification call's
 * one block: SmolLM2's 3 kv heads give 2 threads 2 + 1, 6 query heads against 3) split each
 * block's query heads instead, a contiguous range per thread (5 + 4), whenever that leaves the
 * busiest thread fewer heads; a kv head split between two threads has its tiles converted by
 * both. Each (query, head) is computed alone, so the split changes no bit. The thread's scratch
 * holds a whole block's score rows: group * min(ATTN_QBLOCK, max_batch) rows of at most n_ctx
 * (attn_score_rows). */
static void attn_blocks(cf_engine *e, int l, float *scores, int ith, int nth) {
    int nkv = e->geo[l].n_kv, group = e->c.n_heads / nkv, items = e->n_ablk * nkv;
    if (e->n_ablk * ((e->c.n_heads + nth - 1) / nth) < (items + nth - 1) / nth * group) {
        int h0, h1;
        cf_split_range(e->c.n_heads, ith, nth, 1, &h0, &h1);
        for (int j = 0; j < e->n_ablk; j++) /* a call per kv head: its scratch holds group heads' rows */
            for (int h = h0, hb; h < h1; h = hb) {
                hb = cf_min(h1, (h / group + 1) * group);
                attn_block_heads(e, l, j, scores, h, hb);
            }
        return;
    }
    for (int it = ith; it < items; it += nth)
        attn_block_heads(e, l, it / nkv, scores, it % nkv * group, (it % nkv + 1) * group);
}

static void op_attn(cf_engine *e, int l, int slot, int ith, int nth) {
    const cf_config *c = &e->c;
    if (cf_layer_recurrent(c, l)) { /* Qwen3.5's Gated DeltaNet layers (engine_deltanet.c) */
        cf_op_deltanet(e, l, slot, ith, nth);
        return;
    }
    const cf_layer *w = &e->w.sets[l % c->n_unique];
    cf_state *s = &e->s;
    cf_scratch *ts = &e->ts[ith];
    int d = c->d, hd = e->geo[l].hd, nkv = e->geo[l].n_kv, B = e->B, q_dim = c->n_heads * hd, kv_dim = nkv * hd;
    int qkv_dim = qkv_width(e, l);
    const float *x = s->ring + (size_t)slot * e->max_batch * d;

    // norm, quantize (every thread, private), then this thread's heads of the fused QKV
    ph(e, ith, CF_PK_NORM, l);
    for (int b = 0; b < B; b++) e->k->rmsnorm(ts->xb + (size_t)b * e->kmax, x + (size_t)b * d,
                                              w->attn_norm, d, c->norm_eps);
    quantize_rows(e, ts->xb, e->kmax, d, ts->act, NULL, B, w->qkv_fmt);
    ph(e, ith, CF_PK_QKV, l);
    /* q heads, then k heads and v heads (none on a layer that reads another's cache: Gemma 4) */
    int g0, g1, i0, i1, n_units = c->n_heads + (e->geo[l].has_kv ? 2 * nkv : 0);
    if (hd % CF_G == 0 && !c->qk_norm_full) {
        // Split by whole heads, so the thread that computes a head also rotates it and stores
        // it in the cache: no barrier between the projection and RoPE.
        int u0, u1, gph = hd / CF_G;
        // Larger shares first: the thread with the later rows streams them slower (d_split).
        split_big_first(n_units, ith, nth, &u0, &u1);
        qkv_rows(e, w, ts->act, l, B, u0 * gph, u1 * gph);
        for (int b = 0; b < B; b++) qkv_heads(e, w, l, b, u0, u1);
    } else {
        cf_split_range(qkv_dim / CF_G + (qkv_dim % CF_G != 0), ith, nth, 1, &g0, &g1);
        qkv_rows(e, w, ts->act, l, B, g0, g1);
        sync_threads(e, ith, CF_PK_QKV);
        if (c->qk_norm_full) { /* OLMoE: one RMSNorm over each token's whole q and whole k, before RoPE */
            int b0, b1;
            cf_split_range(B, ith, nth, 1, &b0, &b1);
            for (int b = b0; b < b1; b++) {
                float *q = s->qkv + (size_t)b * qkv_dim;
                e->k->rmsnorm(q, q, w->q_norm, q_dim, c->norm_eps);
                e->k->rmsnorm(q + q_dim, q + q_dim, w->k_norm, kv_dim, c->norm_eps);
            }
            sync_threads(e, ith, CF_PK_QKV);
        }
        cf_split_range(B * n_units, ith, nth, 1, &i0, &i1);
        for (int i = i0; i < i1; i++) qkv_heads(e, w, l, i / n_units, i % n_units, i % n_units + 1);
    }
    if (c->attn_gate) { /* the output gate's logits (Qwen3.5): read after attention */
        cf_split_range(q_dim / CF_G, ith, nth, 1, &g0, &g1);
        matvec_rows(e, &w->w_gate, ts->act, s->agate, q_dim, NULL, B, g0, g1);
    }
    sync_threads(e, ith, CF_PK_ATTN);

    // attention: runs of a sequence's consecutive rows in blocks (each K/V row read once per
    // block), then this thread's (row, head) items of the other rows, one kernel call per row
    attn_blocks(e, l, ts->scores, ith, nth);
    cf_split_range(e->n_arow * c->n_heads, ith, nth, 1, &i0, &i1);
    for (int i = i0; i < i1;) {
        int b = e->arow[i / c->n_heads], h0 = i % c->n_heads, h1 = cf_min(c->n_heads, h0 + i1 - i);
        int t0 = attn_first(e, b, l);
        cf_attn_shape sh = {.n_heads = c->n_heads, .n_kv_heads = nkv, .head_dim = hd,
                            .max_seq = e->n_ctx, .n_pos = e->rpos[b] + 1 - t0, .scale = e->attn_scale,
                            .sinks = w->sinks};
        /* row b sees only its sequence, from position t0 on */
        const uint8_t *k = cf_kv_rows(e, e->rseq[b], l, 1) + (size_t)t0 * e->geo[l].krow;
        const uint8_t *v = cf_kv_rows(e, e->rseq[b], l, 0) + (size_t)t0 * e->geo[l].vrow;
        if (e->k_type == CF_F16 && e->v_type == CF_F16)
            e->k->attention(s->att + (size_t)b * q_dim, s->qkv + (size_t)b * qkv_dim, (const cf_half *)k,
                            (const cf_half *)v, ts->scores, &sh, h0, h1);
        else
            e->k->attention_q8kv(s->att + (size_t)b * q_dim, s->qkv + (size_t)b * qkv_dim, k, v, e->k_type,
                                 e->v_type, ts->scores, &sh, h0, h1);
        i += h1 - h0;
    }
    sync_threads(e, ith, CF_PK_WO);
    if (c->attn_gate) { /* attention's output times sigmoid(gate), per value, before wo */
        cf_split_range(B * q_dim, ith, nth, CF_G, &i0, &i1);
        for (int i = i0; i < i1; i++) s->att[i] *= 1.0f / (1.0f + expf(-s->agate[i]));
        sync_threads(e, ith, CF_PK_WO);
    }

    // output projection into h, plus the residual, for this thread's rows; with post_norms (Gemma)
    // the projection goes to y first, and once every row is whole (a barrier) each thread norms the
    // rows (all of each, the same bits on every thread, into its own scratch) and adds its share
    quantize_rows(e, s->att, q_dim, q_dim, ts->act, NULL, B, act_fmt(&w->wo));
    int glo[2], ghi[2], np = d_split(cf_n_groups(&w->wo), ith, nth, cf_split_whole_bands(e), glo, ghi);
    const float *post = w->attn_post_norm;
    float *o = post ? s->y : s->h;
    for (int q = 0; q < np; q++) matvec_rows(e, &w->wo, ts->act, o, d, NULL, B, glo[q], ghi[q]);
    if (post) {
        sync_threads(e, ith, CF_PK_NORM);
        for (int b = 0; b < B; b++)
            e->k->rmsnorm(ts->xb + (size_t)b * e->kmax, s->y + (size_t)b * d, post, d, c->norm_eps);
    }
    for (int q = 0; q < np; q++) {
        int r0 = glo[q] * CF_G, r1 = cf_min(ghi[q] * CF_G, d);
        for (int b = 0; b < B; b++) {
            const float *xr = x + (size_t)b * d;
            float *hr = s->h + (size_t)b * d;
            if (w->wo_bias) /* gpt-oss: (W_o a + b_o) + x, as llama.cpp adds the bias, then the residual */
                for (int r = r0; r < r1; r++) hr[r] += w->wo_bias[r];
            if (post) {
                const float *nr = ts->xb + (size_t)b * e->kmax;
                for (int r = r0; r < r1; r++) hr[r] = xr[r] + nr[r];
            } else {
                for (int r = r0; r < r1; r++) hr[r] += xr[r];
            }
        }
    }
    if (ith == 0) {
        e->cnt.n[CF_CNT_ATTN] += w->attn_bytes;
        for (int b = 0; b < B; b++)
            e->cnt.n[CF_CNT_KV] += (uint64_t)(e->rpos[b] + 1 - attn_first(e, b, l)) * nkv *
                                   (e->geo[l].krow + e->geo[l].vrow);
    }
    sync_threads(e, ith, -1);
}

static const float *op_source(const cf_engine *e, int kind, int slot) {
    return kind == CF_SRC_RING ? e->s.ring + (size_t)slot * e->max_batch * e->c.d : e->s.h;
}

static void op_dense(cf_engine *e, int l, int src_kind, int slot, int tail, int ith, int nth) {
    const cf_layer *w = &e->w.sets[l % e->c.n_unique];
    cf_scratch *ts = &e->ts[ith];
    int d = e->c.d, B = e->B;
    const float *src = op_source(e, src_kind, slot);
    ph(e, ith, CF_PK_NORM, l);
    for (int b = 0; b < B; b++) e->k->rmsnorm(ts->xb + (size_t)b * e->kmax, src + (size_t)b * d,
                                              w->ffn_norm, d, e->c.norm_eps);
    quantize_rows(e, ts->xb, e->kmax, d, ts->act, NULL, B, act_fmt(&w->gate_up));
    if (ith == 0) e->cnt.n[CF_CNT_DENSE] += w->dense_bytes;
    /* with a post-norm the RESID op norms whole rows of f: they must be complete (the tail barrier) */
    ffn(e, &w->gate_up, &w->down, e->geo[l].d_ff, e->c.ffn_gelu ? FFN_GELU : FFN_SILU, NULL, NULL, NULL, B, e->s.f, NULL,
        tail || w->ffn_post_norm,
        CF_PK_DENSE_GATE_UP, ith, nth);
}

// ---------------------------------------------------------------------------------------------
// the MoE ops

/* Recording a route trace (engine.h): what speculation would predict, from this route's input, for
 * each later layer within the trace's depth (every distance, whatever the gate trusts). */
static void record_predictions(cf_engine *e, int l, int src_kind) {
    int K = e->c.top_k, L = e->c.n_layers, chosen[64];
    for (int b = 0; b < e->B; b++) {
        int32_t *rp = cf_routes_pred(e, b, l);
        if (!rp) continue;
        for (int j = 0; j < e->routes.depth; j++) {
            int32_t *out = rp + (size_t)j * K;
            if (l + 1 + j >= L) {
                for (int k = 0; k < K; k++) out[k] = -1;
                continue;
            }
            cf_predict_route(e, b, l + 1 + j, src_kind, chosen);
            for (int k = 0; k < K; k++) out[k] = chosen[k];
        }
    }
}

/* The router's scores of one row, in place in pr[E] (softmax over all, or a sigmoid each: DeepSeek-V3;
 * gpt-oss: the logits plus the router bias, chosen by them, op_route taking the softmax over the k),
 * and when choose is set its top_k choice: by the scores plus the router bias (DeepSeek-V3: the bias
 * chooses, the scores weigh), among the moe_groups_used groups whose two best biased scores sum
 * highest (moe_groups > 1), as llama.cpp's build_moe_ffn. val gets the chosen experts' scores;
 * sel (E floats of scratch) the biased scores. */
static void route_scores(const cf_engine *e, const cf_layer *w, float *pr, float *sel, int choose, int *chosen,
                         float *val) {
    const cf_config *c = &e->c;
    int E = c->n_experts;
    if (c->moe_gating == CF_GATING_SOFTMAX_TOPK) { /* gpt-oss: the biased logits; op_route weighs the k */
        if (w->router_bias)
            for (int x = 0; x < E; x++) pr[x] += w->router_bias[x];
        if (choose) e->k->topk(pr, E, c->top_k, chosen, val);
        return;
    }
    if (c->moe_gating == CF_GATING_SIGMOID)
        for (int x = 0; x < E; x++) pr[x] = 1.0f / (1.0f + expf(-pr[x]));
    else
        e->k->softmax(pr, E);
    if (!choose) return;
    if (!w->router_bias && c->moe_groups <= 1) {
        e->k->topk(pr, E, c->top_k, chosen, val);
        return;
    }
    for (int x = 0; x < E; x++) sel[x] = pr[x] + (w->router_bias ? w->router_bias[x] : 0.0f);
    if (c->moe_groups > 1) {
        int G = c->moe_groups, per = E / G, top2[2], keep[64];
        float gs[64], gv[64], v2[2];
        for (int g = 0; g < G; g++) {
            int n2 = per < 2 ? per : 2;
            e->k->topk(sel + (size_t)g * per, per, n2, top2, v2);
            gs[g] = n2 == 2 ? v2[0] + v2[1] : v2[0];
        }
        e->k->topk(gs, G, c->moe_groups_used, keep, gv);
        int used[64] = {0};
        for (int k = 0; k < c->moe_groups_used; k++) used[keep[k]] = 1;
        for (int g = 0; g < G; g++)
            if (!used[g])
                for (int x = g * per; x < (g + 1) * per; x++) sel[x] = -INFINITY;
    }
    e->k->topk(sel, E, c->top_k, chosen, val);
    for (int k = 0; k < c->top_k; k++) val[k] = pr[chosen[k]];
}

/* Thread 0 normalises the MoE input, runs the router (f32) and fills per-expert token lists:
 * softmax over all E logits, top-k, the k weights renormalised to sum to 1 (moe_norm_topk; else
 * kept as they are); or (CF_GATING_SOFTMAX_TOPK, gpt-oss) the top-k of the logits plus the
 * router's bias, weighted by the softmax over those k. With a shared expert it also computes each
 * row's weight for it. */
static void op_route(cf_engine *e, int l, int src_kind, int ms, int ith) {
    const cf_config *c = &e->c;
    const cf_layer *w = &e->w.sets[l % c->n_unique];
    cf_state *s = &e->s;
    ph(e, ith, CF_PK_ROUTE, l);
    if (ith == 0) {
        int d = c->d, E = c->n_experts;
        size_t B = e->max_batch;
        float *z = e->ts[0].xb, *moe_in = s->moe_in + (size_t)ms * B * d, *exp_w = s->exp_w + (size_t)ms * E * B;
        int *exp_n = s->exp_n + (size_t)ms * E, *exp_tok = s->exp_tok + (size_t)ms * E * B;
        memset(exp_n, 0, E * sizeof *exp_n);
        for (int b = 0; b < e->B; b++) {
            const float *hb = s->h + (size_t)b * d;
            for (int i = 0; i < d; i++) z[i] = hb[i] + (src_kind == CF_SRC_HF ? s->f[(size_t)b * d + i] : 0.0f);
            float *mi = moe_in + (size_t)b * d, *pr = s->rlogits + (size_t)b * E;
            e->k->rmsnorm(mi, z, w->moe_norm, d, c->norm_eps);
            if (w->router_norm) { /* Gemma 4: the router reads its own norm of z (scratch row 2) */
                float *rz = e->ts[0].xb + e->kmax;
                e->k->rmsnorm(rz, z, w->router_norm, d, c->norm_eps);
                e->k->matvec_f32(pr, w->router, rz, E, d);
            } else {
                e->k->matvec_f32(pr, w->router, mi, E, d);
            }
            int chosen[64];
            float val[64], wsum = 0.0f;
            int32_t *rc = cf_routes_chosen(e, b, l);
            if (rc && e->routes.mode == CF_ROUTES_REPLAY) { /* the trace's experts, the router's weights */
                route_scores(e, w, pr, NULL, 0, chosen, val);
                for (int k = 0; k < c->top_k; k++) val[k] = pr[chosen[k] = rc[k]];
            } else {
                route_scores(e, w, pr, z, 1, chosen, val);
                if (rc) memcpy(rc, chosen, (size_t)c->top_k * sizeof *rc); /* recording */
            }
            if (c->moe_gating == CF_GATING_SOFTMAX_TOPK) e->k->softmax(val, c->top_k); /* sums to 1 */
            for (int k = 0; k < c->top_k; k++) wsum += val[k];
            if (!c->moe_norm_topk || c->moe_gating == CF_GATING_SOFTMAX_TOPK) wsum = 1.0f;
            else if (c->moe_gating == CF_GATING_SIGMOID) wsum = fmaxf(wsum, 6.103515625e-5f); /* llama.cpp's clamp */
            for (int k = 0; k < c->top_k; k++) {
                int x = chosen[k], n = exp_n[x]++;
                exp_tok[(size_t)x * B + n] = b;
                exp_w[(size_t)x * B + n] = val[k] / wsum * c->moe_w_scale * (w->expert_scale ? w->expert_scale[x] : 1.0f);
                e->hits[(size_t)l * E + x]++;
            }
        }
        if (c->d_shexp && c->shexp_ungated)
            for (int b = 0; b < e->B; b++) s->shexp_w[(size_t)ms * B + b] = 1.0f;
        else if (c->d_shexp)
            for (int b = 0; b < e->B; b++) {
                float g;
                e->k->matvec_f32(&g, w->shexp_gate, moe_in + (size_t)b * d, 1, d);
                s->shexp_w[(size_t)ms * B + b] = 1.0f / (1.0f + expf(-g));
            }
        e->cnt.n[CF_CNT_ROUTER] += w->router_bytes;
        if (e->routes.mode == CF_ROUTES_RECORD) record_predictions(e, l, src_kind);
        if (e->xs) cf_route_disk(e, l, ms, src_kind);
    }
    sync_threads(e, ith, -1);
}

static inline int expert_act(const cf_config *c) {
    return c->expert_act == CF_ACT_SWIGLU_OAI ? FFN_OAI : c->expert_act == CF_ACT_GELU ? FFN_GELU : FFN_SILU;
}

/* The shared expert on every row of moe slot ms, scaled by the route's per-row weight, into out;
 * its weights are in RAM whatever the routed experts' residency, and it runs before them in both
 * experts ops (the same summation order). The routed experts that follow (a route chooses at
 * least one) need the barrier that ends it. The input must already be quantized in ts->act. */
static void shared_expert(cf_engine *e, const cf_layer *w, int ms, float *out, int ith, int nth) {
    if (!e->c.d_shexp) return;
    if (ith == 0) e->cnt.n[CF_CNT_EXPERTS] += w->shexp_bytes;
    ffn(e, &w->shexp_gate_up, &w->shexp_down, e->c.d_shexp, FFN_SILU, NULL, NULL, NULL, e->B, out,
        e->s.shexp_w + (size_t)ms * e->max_batch, 1, CF_PK_EXP_GATE_UP, ith, nth);
}

/* The routed experts of a one-row call (decode) with experts in RAM: each expert's gate/up into a
 * row of hid (and gu) of its own, one barrier, then each expert's down, summed into out in
 * ascending expert order: the operations ffn() does expert by expert, in the same order, so the
 * same bits, with 2 barriers a layer instead of 2 per expert (a barrier costs most where a thread
 * is descheduled: docs/results/gptoss.md). xs: the k chosen experts, ascending; wts: their weights. */
static void experts_one_row(cf_engine *e, const cf_layer *w, const int *xs, const float *wts, int k, float *out,
                            int tail, int ith, int nth) {
    const cf_config *c = &e->c;
    cf_state *s = &e->s;
    cf_scratch *ts = &e->ts[ith];
    int d = c->d, p0, p1, oai = c->expert_act == CF_ACT_SWIGLU_OAI, gelu = c->expert_act == CF_ACT_GELU;
    ph(e, ith, CF_PK_EXP_GATE_UP, -1);
    cf_split_range(c->d_exp / CF_G, ith, nth, 1, &p0, &p1);
    for (int i = 0; i < k; i++) {
        int x = xs[i];
        float *hid = s->hid + (size_t)i * e->hmax;
        if (oai)
            swiglu_oai_rows(e, &w->exp_gate_up[x], c->moe_bias ? w->exp_b_gate_up[x] : NULL, ts->act, hid,
                            s->gu + (size_t)i * 2 * e->hmax, e->hmax, NULL, 1, p0, p1);
        else if (gelu && p0 < p1) { /* geglu_rows' operations, into the expert's own rows of gu and hid */
            float *gu = s->gu + (size_t)i * 2 * e->hmax;
            matvec_rows(e, &w->exp_gate_up[x], ts->act, gu, 2 * e->hmax, NULL, 1, 2 * p0, 2 * p1);
            e->k->geglu(hid + (size_t)p0 * CF_G, gu + (size_t)2 * p0 * CF_G, p1 - p0);
        } else if (!gelu)
            gate_up_rows(e, &w->exp_gate_up[x], ts->act, hid, e->hmax, NULL, 1, p0, p1);
        if (ith == 0) e->cnt.n[CF_CNT_EXPERTS] += w->exp_bytes[x];
    }
    sync_threads(e, ith, CF_PK_EXP_DOWN);
    for (int i = 0; i < k; i++) {
        int x = xs[i];
        const cf_tiled *down = &w->exp_down[x];
        const float *bd = c->moe_bias ? w->exp_b_down[x] : NULL;
        quantize_rows(e, s->hid + (size_t)i * e->hmax, e->hmax, c->d_exp, ts->act2, NULL, 1, act_fmt(down));
        int glo[2], ghi[2], np = d_split(cf_n_groups(down), ith, nth, cf_split_whole_bands(e), glo, ghi);
        for (int q = 0; q < np; q++) matvec_rows(e, down, ts->act2, s->y, d, NULL, 1, glo[q], ghi[q]);
        for (int q = 0; q < np; q++) {
            int r0 = glo[q] * CF_G, r1 = cf_min(ghi[q] * CF_G, d);
            if (bd)
                for (int r = r0; r < r1; r++) out[r] += wts[i] * (s->y[r] + bd[r]);
            else
                for (int r = r0; r < r1; r++) out[r] += wts[i] * s->y[r];
        }
    }
    if (tail) sync_threads(e, ith, -1);
}

static void op_experts(cf_engine *e, int l, int pslot, int ms, int tail, int ith, int nth) {
    const cf_config *c = &e->c;
    const cf_layer *w = &e->w.sets[l % c->n_unique];
    cf_state *s = &e->s;
    size_t B = e->max_batch;
    const int *exp_n = s->exp_n + (size_t)ms * c->n_experts;
    const int *exp_tok = s->exp_tok + (size_t)ms * c->n_experts * B;
    const float *exp_w = s->exp_w + (size_t)ms * c->n_experts * B;
    float *out = s->pending + (size_t)pslot * B * c->d;
    ph(e, ith, CF_PK_NORM, l);
    quantize_rows(e, s->moe_in + (size_t)ms * B * c->d, c->d, c->d, e->ts[ith].act, NULL, e->B, w->exp_fmt);
    shared_expert(e, w, ms, out, ith, nth);
    if (e->B == 1) { /* decode: every chosen expert has the one row */
        int xs[64], k = 0;
        float wts[64];
        for (int x = 0; x < c->n_experts; x++)
            if (exp_n[x]) {
                wts[k] = exp_w[(size_t)x * B];
                xs[k++] = x;
            }
        experts_one_row(e, w, xs, wts, k, out, tail, ith, nth);
        return;
    }
    int last = -1;
    for (int x = 0; x < c->n_experts; x++)
        if (exp_n[x]) last = x;
    for (int x = 0; x <= last; x++) {
        int n = exp_n[x];
        if (!n) continue; // untouched: its tiles are never read
        if (ith == 0) e->cnt.n[CF_CNT_EXPERTS] += w->exp_bytes[x];
        ffn(e, &w->exp_gate_up[x], &w->exp_down[x], c->d_exp, expert_act(c), c->moe_bias ? w->exp_b_gate_up[x] : NULL,
            c->moe_bias ? w->exp_b_down[x] : NULL, exp_tok + (size_t)x * B, n, out,
            exp_w + (size_t)x * B, x < last || tail, CF_PK_EXP_GATE_UP, ith, nth);
    }
}

/* op_experts with the experts' bytes in cache slots. The chosen experts run in ascending order,
 * as in RAM (summing in another order would change the last bits). The route acquired a first
 * wave; whenever the loop reaches an expert without a slot, thread 0 acquires the next wave
 * (every slot that can be evicted) and publishes its end before a barrier, so every thread makes
 * the same decisions. Each expert is waited for on its slot's word (bytes of later experts keep
 * arriving meanwhile), used, and unpinned. A failed read is seen by every thread on the same word,
 * so all leave together and the call returns -1. Returns 0 or -1. */
static int op_experts_disk(cf_engine *e, int l, int pslot, int ms, int tail, int ith, int nth) {
    const cf_config *c = &e->c;
    int E = c->n_experts, set = l % c->n_unique;
    const cf_layer *w = &e->w.sets[set];
    cf_state *s = &e->s;
    size_t B = e->max_batch;
    const int *exp_n = s->exp_n + (size_t)ms * E, *list = s->exp_list + (size_t)ms * E;
    const int *slot = s->exp_slot + (size_t)ms * E;
    const int *exp_tok = s->exp_tok + (size_t)ms * E * B;
    const float *exp_w = s->exp_w + (size_t)ms * E * B;
    float *out = s->pending + (size_t)pslot * B * c->d;
    ph(e, ith, CF_PK_NORM, l);
    quantize_rows(e, s->moe_in + (size_t)ms * B * c->d, c->d, c->d, e->ts[ith].act, NULL, e->B, w->exp_fmt);
    shared_expert(e, w, ms, out, ith, nth);
    int n = s->exp_cnt[ms], covered = s->exp_pre[ms];
    for (int i = 0; i < n; i++) {
        int x = list[i], key = set * E + x;
        if (i == covered) {
            ph(e, ith, CF_PK_EXP_IO, -1);
            if (ith == 0) {
                e->wave_end = cf_acquire_wave(e, l, ms, i, n);
                if (e->wave_end == i) { /* cannot happen while the plan check holds */
                    snprintf(e->err, sizeof e->err, "expert cache exhausted at layer %d: every slot is pinned "
                             "(this is a bug in cflow; please report it)", l);
                    e->failed = CF_ERR_IO;
                }
            }
            sync_threads(e, ith, -1);
            if (e->wave_end == i) return -1;
            covered = e->wave_end;
        }
        int sl = slot[x];
        ph(e, ith, CF_PK_EXP_IO, -1);
        if (cf_xstore_wait(e->xs, sl, ith == 0 ? &e->cnt.n[CF_CNT_IO_STALL_NS] : NULL)) {
            if (ith == 0) {
                cf_xstore_error(e->xs, sl, e->err, sizeof e->err);
                e->failed = CF_ERR_IO;
            }
            return -1;
        }
        const uint8_t *data = cf_xstore_data(e->xs, sl);
        cf_tiled gu = w->exp_gate_up[x], dn = w->exp_down[x];
        const int64_t *rel = e->xrel + (size_t)CF_EXPERT_SLOTS * key;
        gu.data = data + rel[CF_E_GATE_UP];
        dn.data = data + rel[CF_E_DOWN];
        /* the biases from the slot too: they travel with the expert (cflow.weights) */
        const float *bgu = c->moe_bias ? (const float *)(data + rel[CF_E_B_GATE_UP]) : NULL;
        const float *bdn = c->moe_bias ? (const float *)(data + rel[CF_E_B_DOWN]) : NULL;
        if (ith == 0) e->cnt.n[CF_CNT_EXPERTS] += w->exp_bytes[x];
        ffn(e, &gu, &dn, c->d_exp, expert_act(c), bgu, bdn, exp_tok + (size_t)x * B, exp_n[x], out,
            exp_w + (size_t)x * B,
            i + 1 < n || tail, CF_PK_EXP_GATE_UP, ith, nth);
        /* Unpinning is safe before the other threads finish this expert: the slot is only reused
         * by a later acquire of thread 0, and those come after a barrier (the one ending this ffn,
         * unless it is the op's last expert; then the RESID/next op's). */
        if (ith == 0) cf_xstore_release(e->xs, sl);
    }
    return 0;
}

static void op_resid(cf_engine *e, int l, int slot, int add_f, int pslot, int ith, int nth) {
    cf_state *s = &e->s;
    int d = e->c.d;
    ph(e, ith, CF_PK_RESID, l);
    /* post_norms (Gemma): f joins normed; every thread norms each whole row (op_dense ended at a
     * barrier) into its scratch, the same bits everywhere, and adds its own rows */
    const float *post = add_f ? e->w.sets[l % e->c.n_unique].ffn_post_norm : NULL;
    float *fn = e->ts[ith].xb;
    int joined = post && e->c.moe_out_norms && pslot >= 0;
    if (joined) { /* Gemma 4's MoE layer: f and the experts' sum joined into fn; every thread has read the
                   * whole pending rows before any clears its share (the barrier) */
        cf_moe_out_norms(e, l, pslot, ith);
        sync_threads(e, ith, CF_PK_RESID);
    } else if (post)
        for (int b = 0; b < e->B; b++)
            e->k->rmsnorm(fn + (size_t)b * e->kmax, s->f + (size_t)b * d, post, d, e->c.norm_eps);
    // the same rows as this thread's share of a [d, *] mat-vec (wo, down): d_split, see ffn()
    int glo[2], ghi[2], np = d_split((d + CF_G - 1) / CF_G, ith, nth, cf_split_whole_bands(e), glo, ghi);
    float *x = s->ring + (size_t)slot * e->max_batch * d;
    float *pend = pslot >= 0 ? s->pending + (size_t)pslot * e->max_batch * d : NULL;
    for (int q = 0; q < np; q++) {
        int r0 = glo[q] * CF_G, r1 = cf_min(ghi[q] * CF_G, d);
        for (int b = 0; b < e->B; b++) {
            size_t o = (size_t)b * d;
            for (int r = r0; r < r1; r++) {
                float v = s->h[o + r];
                if (post) v += fn[(size_t)b * e->kmax + r];
                else if (add_f) v += s->f[o + r];
                if (pend) {
                    if (!joined) v += pend[o + r];
                    pend[o + r] = 0.0f;
                }
                x[o + r] = v;
            }
        }
    }
    sync_threads(e, ith, -1);
}

/* This thread's share of the lm_head for n quantized rows act into out [n, vocab]: its range of the
 * groups, then the logit soft-cap on those same logits (Gemma 4: c tanh(logits / c), as llama.cpp's
 * scale, tanh, scale), so no share waits for another. */
static void lm_head_share(const cf_engine *e, const cf_act_q8 *act, float *out, int n, int ith, int nth) {
    int V = e->c.vocab, g0, g1;
    cf_split_range(cf_n_groups(&e->w.lm_head), ith, nth, 1, &g0, &g1);
    matvec_rows(e, &e->w.lm_head, act, out, V, NULL, n, g0, g1);
    float cap = e->c.logit_softcap;
    if (cap > 0)
        for (int i = 0; i < n; i++) {
            float *lg = out + (size_t)i * V;
            for (int r = g0 * CF_G; r < cf_min(g1 * CF_G, V); r++) lg[r] = tanhf(lg[r] / cap) * cap;
        }
}

/* Logits of the rows in lrow (prefill: the last row; cf_step_batch: every row; cf_step_rows: the
 * rows asked for), logits row i for lrow[i]. Each row is normed, quantized and multiplied on its
 * own; matmat equals matvec per row bit for bit (cflow.h), so a row's logits do not depend on the
 * other rows of the call. */
static void op_final(cf_engine *e, int slot, int pslot, int ith, int nth) {
    if (!e->logits || !e->n_lrow) return;
    cf_scratch *ts = &e->ts[ith];
    ph(e, ith, CF_PK_NORM, e->c.n_layers); /* the final norm: "layer" n_layers */
    int d = e->c.d, nb = e->n_lrow;
    float *z = ts->xb + (size_t)e->max_batch * e->kmax; /* the scratch's extra row */
    for (int i = 0; i < nb; i++) {
        size_t b = (size_t)e->lrow[i];
        const float *x = e->s.ring + ((size_t)slot * e->max_batch + b) * d;
        const float *pd = pslot >= 0 ? e->s.pending + ((size_t)pslot * e->max_batch + b) * d : NULL;
        for (int j = 0; j < d; j++) z[j] = x[j] + (pd ? pd[j] : 0.0f);
        e->k->rmsnorm(ts->xb + (size_t)i * e->kmax, z, e->w.norm, d, e->c.norm_eps);
        /* every thread norms every row (the same bits); thread 0 hands its copy out */
        if (e->keep_hidden && ith == 0) memcpy(e->hidden + (size_t)i * d, ts->xb + (size_t)i * e->kmax,
                                               (size_t)d * sizeof(float));
    }
    if (e->keep_hidden && ith == 0) e->n_hidden = nb;
    quantize_rows(e, ts->xb, e->kmax, d, ts->act, NULL, nb, act_fmt(&e->w.lm_head));
    ph(e, ith, CF_PK_LM_HEAD, 0);
    lm_head_share(e, ts->act, e->logits, nb, ith, nth);
    if (ith == 0)
        e->cnt.n[CF_CNT_LM_HEAD] += (uint64_t)d * sizeof(float) + cf_tiled_bytes(&e->w.lm_head);
}

// ---------------------------------------------------------------------------------------------
// overlap (off by default; Engine.load(overlap=True)): attn(l) beside dense(l) when delta_dense >= 1
//
// With delta_dense >= 1, dense(l) reads x_{l+1-dd} from the ring, not h, so it does not depend on
// attn(l), and the two write disjoint state (attn: qkv, att, h, the KV cache; dense: hid, f). The
// threads then split in two groups: the first half runs attn(l), the second dense(l), each op as
// if the engine had only its group's threads, and all meet at one barrier after both. The ops are
// not changed: each group runs them on a view of the engine (a struct copy, refreshed before every
// call) whose scratch and profiler arrays start at the group's first thread, whose barrier counts
// only the group (a group of one thread never waits inside an op) and whose counters are added
// back after the call. Every output row and head is still computed whole by one thread, so the
// results are the same bit for bit (tests/test_overlap.py). What it can win is the barriers inside
// the two ops; the bytes read are the same (docs/DESIGN.md, "Overlapping independent nodes").

/* Whether ops i, i+1 are an attn(l), dense(l) pair that may run side by side. */
static int overlap_pair(const cf_engine *e, int i, int nth) {
    if (!e->grp || nth < 2 || i + 1 >= e->n_ops) return 0;
    const int32_t *op = e->plan + (size_t)i * CF_OP_FIELDS, *nx = op + CF_OP_FIELDS;
    return op[0] == CF_OP_ATTN && nx[0] == CF_OP_DENSE && nx[1] == op[1] && nx[2] == CF_SRC_RING;
}

/* Thread 0, before a call: the groups' views of the engine as it stands now. */
static void overlap_begin(cf_engine *e) {
    int na = e->active / 2, first[2] = {0, na}, n[2] = {na, e->active - na};
    for (int g = 0; g < 2; g++) {
        cf_engine *v = &e->grp[g];
        memcpy(v, e, sizeof *e);
        v->grp = NULL;
        v->ts = e->ts + first[g];
        v->prof = e->prof ? e->prof + first[g] : NULL;
        memset(&v->cnt, 0, sizeof v->cnt);
        atomic_init(&v->bar.count, 0);
        atomic_init(&v->bar.phase, 0);
        atomic_init(&v->bar.sleepers, 0);
        v->bar.n = n[g];
    }
}

/* Thread 0, after a call: the groups' counters into the engine's. */
static void overlap_end(cf_engine *e) {
    for (int g = 0; g < 2; g++)
        for (size_t k = 0; k < sizeof e->cnt.n / sizeof *e->cnt.n; k++) e->cnt.n[k] += e->grp[g].cnt.n[k];
}

static void forward_task(void *ctx, int ith, int nth) {
    cf_engine *e = ctx;
    if (ith >= e->active) return;
    nth = e->active;
    if (e->prof_on && ith) e->prof[ith].kind = -1; /* thread 0's call opened in forward() */
    for (int i = 0; i < e->n_ops; i++) {
        const int32_t *op = e->plan + (size_t)i * CF_OP_FIELDS;
        int l = op[1], a = op[2], b = op[3], c = op[4];
        /* barrier needed after (Gemma 4's RESID norms whole rows of the experts' sum) */
        int tail = i + 1 == e->n_ops || op[CF_OP_FIELDS] != CF_OP_RESID || e->c.moe_out_norms;
        if (overlap_pair(e, i, nth)) {
            const int32_t *nx = op + CF_OP_FIELDS;
            int na = e->grp[0].bar.n;
            if (ith < na) op_attn(&e->grp[0], l, a, ith, na);
            else op_dense(&e->grp[1], nx[1], nx[2], nx[3], 1, ith - na, nth - na);
            sync_threads(e, ith, -1);
            i++;
            continue;
        }
        switch (op[0]) {
        case CF_OP_EMBED: op_embed(e, a, ith, nth); break;
        case CF_OP_ATTN:
            if (e->c.mla_kv_lora) cf_op_attn_mla(e, l, a, ith, nth);
            else op_attn(e, l, a, ith, nth);
            break;
        case CF_OP_DENSE: op_dense(e, l, a, b, tail, ith, nth); break;
        case CF_OP_ROUTE: op_route(e, l, a, b, ith); break;
        case CF_OP_EXPERTS:
            if (!e->xs) op_experts(e, l, a, b, tail, ith, nth);
            else if (op_experts_disk(e, l, a, b, tail, ith, nth)) return; /* every thread leaves */
            break;
        case CF_OP_RESID: op_resid(e, l, a, b, c, ith, nth); break;
        case CF_OP_FINAL: op_final(e, a, b, ith, nth); break;
        case CF_OP_PLE: cf_op_ple(e, l, a, ith, nth); break;
        }
    }
    /* thread 0 goes on to join the others (closed in forward()); the others are done */
    ph(e, ith, ith == 0 && nth > 1 ? CF_PK_WAIT : -1, -1);
}

// ---------------------------------------------------------------------------------------------
// calls

/* One pass over the plan for rows 0..B-1, whose sequence slots and positions the caller put in
 * e->rseq / e->rpos. logits (may be NULL) gets the logits of the rows with want[b] set, in row
 * order (want NULL: the last row only). */
static int forward(cf_engine *e, const int32_t *tokens, int B, float *logits, const uint8_t *want) {
    const cf_config *c = &e->c;
    int64_t pt0 = e->prof_on ? cf_prof_open(e, 0, CF_PK_SETUP, 0) : 0;
    /* the dims RoPE turns: latent attention's k_pe part, or partial RoPE's first n_rot */
    int rd = c->mla_kv_lora ? c->mla_rope : c->n_rot ? c->n_rot : c->hd;
    for (int b = 0; b < B; b++) {
        float *cs = e->s.rope + (size_t)b * c->hd;
        cf_rope_table(cs, cs + rd / 2, rd, e->rpos[b], c->rope_theta,
                      c->n_rope_factors ? c->rope_factors : NULL, c->rope_mscale);
        if (e->s.rope_local) { /* local layers' own base, unscaled (rope_theta_local), and head size */
            int hl = c->hd_local ? c->hd_local : c->hd;
            cs = e->s.rope_local + (size_t)b * e->hd_max;
            cf_rope_table(cs, cs + hl / 2, hl, e->rpos[b], c->rope_theta_local, NULL, 1.0f);
        }
    }
    memset(e->s.pending, 0, (size_t)e->n_pending * e->max_batch * c->d * sizeof(float));
    e->failed = CF_ERR_NONE;
    if (e->xs && cf_xstore_begin(e->xs, e->err, sizeof e->err)) {
        if (e->prof_on) e->prof[0].kind = -1;
        e->err_kind = CF_ERR_IO;
        return -1;
    }
    cf_spec_begin(e);
    /* the mode is process-wide in the kernels: make it this engine's for this call (a call of
     * another engine running at the same time may switch it; that changes speed, never results) */
    cf_set_prefetch(e->prefetch);
    e->tokens = tokens;
    e->B = B;
    e->logits = logits;
    e->n_lrow = 0;
    e->n_hidden = 0; /* op_final sets it when it writes the rows' hidden states */
    for (int b = want ? 0 : B - 1; b < B; b++)
        if (!want || want[b]) e->lrow[e->n_lrow++] = b;
    attn_plan(e);
    if (e->grp) overlap_begin(e);
    if (e->active == 1)
        forward_task(e, 0, 1); /* no need to wake the pool (sleeping workers take ~50 us) */
    else
        cf_pool_run(e->pool, forward_task, e);
    if (e->prof_on) {
        int64_t pt1 = cf_prof_mark(e, 0, -1, -1);
        if (e->prof_ncalls < e->prof_calls_cap) e->prof_calls[e->prof_ncalls++] = (cf_prof_call){pt0, pt1, B, 0};
        else e->prof_dropped_calls++;
    }
    if (e->grp) overlap_end(e);
    cf_deltanet_advance(e, !e->failed); /* recurrent states: continued, or broken by the failure */
    if (e->failed) {
        e->err_kind = e->failed;
        return -1;
    }
    e->cnt.n[CF_CNT_TOKENS] += B;
    e->cnt.n[CF_CNT_CALLS]++;
    if (e->routes.mode) e->routes.pos += B;
    return 0;
}

static int check_token(cf_engine *e, int token, int i) {
    if (token >= 0 && token < e->c.vocab) return 0;
    cf_set_err(e->err, sizeof e->err, "token id %d at index %d is outside the vocabulary (0..%d)", token, i,
            e->c.vocab - 1);
    return -1;
}

static int check_seq(cf_engine *e, int seq, int i) {
    if (seq >= 0 && seq < e->n_seq) return 0;
    cf_set_err(e->err, sizeof e->err, "sequence slot %d at index %d does not exist (the engine has %d: 0..%d)",
            seq, i, e->n_seq, e->n_seq - 1);
    return -1;
}

static int check_call(cf_engine *e, int seq, const int32_t *tokens, int n, int pos0) {
    e->err_kind = CF_ERR_INPUT; /* what a failure below is; cleared when the checks pass */
    if (n < 1) {
        cf_set_err(e->err, sizeof e->err, "no tokens to process");
        return -1;
    }
    if (check_seq(e, seq, 0)) return -1;
    if (pos0 < 0 || (int64_t)pos0 + n > e->n_ctx) {
        cf_set_err(e->err, sizeof e->err,
                "positions %d..%d do not fit the context of %d tokens; load the model with a "
                "larger context (n_ctx / -c)", pos0, pos0 + n - 1, e->n_ctx);
        return -1;
    }
    for (int i = 0; i < n; i++)
        if (check_token(e, tokens[i], i)) return -1;
    if (cf_deltanet_check_rows(e, &seq, &pos0, 1)) return -1;
    e->err_kind = CF_ERR_NONE;
    return 0;
}

int cf_step(cf_engine *e, int token, int pos, float *logits) {
    int32_t t = token;
    if (check_call(e, 0, &t, 1, pos)) return -1;
    e->rseq[0] = 0;
    e->rpos[0] = pos;
    return forward(e, &t, 1, logits, NULL);
}

int cf_prefill_seq(cf_engine *e, int seq, const int32_t *tokens, int n, int pos0, float *logits_last) {
    if (check_call(e, seq, tokens, n, pos0)) return -1;
    for (int i = 0; i < n; i += e->max_batch) {
        int B = cf_min(e->max_batch, n - i);
        for (int b = 0; b < B; b++) {
            e->rseq[b] = seq;
            e->rpos[b] = pos0 + i + b;
        }
        if (forward(e, tokens + i, B, i + B == n ? logits_last : NULL, NULL)) return -1;
    }
    return 0;
}

int cf_prefill(cf_engine *e, const int32_t *tokens, int n, int pos0, float *logits_last) {
    return cf_prefill_seq(e, 0, tokens, n, pos0, logits_last);
}

/* The row checks of cf_step_batch (distinct = 1: every sequence at most once) and cf_step_rows
 * (a sequence's rows at consecutive positions, in order). e->seen[s] holds 1 + the index of
 * sequence s's last row so far; cleared before returning. */
static int check_rows(cf_engine *e, const int *seq, const int32_t *tokens, const int *pos, int B, int distinct) {
    e->err_kind = CF_ERR_INPUT;
    if (B < 1 || (distinct && B > e->n_seq)) {
        if (distinct)
            cf_set_err(e->err, sizeof e->err, "a batched step takes 1..%d rows (one per sequence slot), got %d",
                    e->n_seq, B);
        else
            cf_set_err(e->err, sizeof e->err, "no rows to process");
        return -1;
    }
    int bad = 0;
    for (int b = 0; b < B && !bad; b++) {
        int prev = check_seq(e, seq[b], b) ? -2 : e->seen[seq[b]] - 1; /* -1: its first row */
        if (prev < -1 || check_token(e, tokens[b], b)) bad = 1;
        else if (pos[b] < 0 || pos[b] >= e->n_ctx) {
            cf_set_err(e->err, sizeof e->err, "position %d of row %d does not fit the context of %d tokens; "
                    "load the model with a larger context (n_ctx / -c)", pos[b], b, e->n_ctx);
            bad = 1;
        } else if (prev >= 0 && distinct) {
            cf_set_err(e->err, sizeof e->err, "sequence slot %d appears twice in one batched step (rows %d and %d)",
                    seq[b], prev, b);
            bad = 1;
        } else if (prev >= 0 && pos[b] != pos[prev] + 1) {
            cf_set_err(e->err, sizeof e->err, "row %d of sequence slot %d is at position %d, but its previous row "
                    "(%d) is at %d: a sequence's rows must be at consecutive positions, in order", b, seq[b],
                    pos[b], prev, pos[prev]);
            bad = 1;
        } else {
            e->seen[seq[b]] = b + 1;
        }
    }
    for (int b = 0; b < B; b++)
        if (seq[b] >= 0 && seq[b] < e->n_seq) e->seen[seq[b]] = 0;
    if (bad || cf_deltanet_check_rows(e, seq, pos, B)) return -1;
    e->err_kind = CF_ERR_NONE;
    return 0;
}

/* Rows in passes of max_batch (a sequence's later rows come in a later pass, after its earlier
 * rows wrote their K/V); logits of the wanted rows in order (want NULL: every row). */
static int run_rows(cf_engine *e, const int *seq, const int32_t *tokens, const int *pos, const uint8_t *want,
                    int B, float *logits) {
    for (int i = 0, nl = 0; i < B; i += e->max_batch) {
        int nb = cf_min(e->max_batch, B - i), nw = 0;
        for (int b = 0; b < nb; b++) {
            e->rseq[b] = seq[i + b];
            e->rpos[b] = pos[i + b];
            nw += !want || want[i + b];
        }
        if (forward(e, tokens + i, nb, logits && nw ? logits + (size_t)nl * e->c.vocab : NULL,
                    want ? want + i : e->ones))
            return -1;
        nl += nw;
    }
    return 0;
}

int cf_step_batch(cf_engine *e, const int *seq, const int32_t *tokens, const int *pos, int B, float *logits) {
    if (check_rows(e, seq, tokens, pos, B, 1)) return -1;
    return run_rows(e, seq, tokens, pos, NULL, B, logits);
}

int cf_step_rows(cf_engine *e, const int *seq, const int32_t *tokens, const int *pos, const uint8_t *want, int B,
                 float *logits) {
    if (check_rows(e, seq, tokens, pos, B, 0)) return -1;
    return run_rows(e, seq, tokens, pos, want, B, logits);
}

void cf_engine_set_keep_hidden(cf_engine *e, int on) {
    e->keep_hidden = on != 0;
    e->n_hidden = 0;
}

int cf_engine_hidden(const cf_engine *e, const float **out) {
    *out = e->hidden;
    return e->n_hidden;
}

/* cf_engine_lm_head's shares: as op_final, every thread quantizes every row (the same bits) and
 * takes its lm_head_share. */
typedef struct {
    cf_engine *e;
    const float *x;
    int n;
    float *out;
} lm_head_job;

static void lm_head_task(void *ctx, int ith, int nth) {
    lm_head_job *job = ctx;
    cf_engine *e = job->e;
    (void)nth; /* the pool's size: the engine's active threads share the work */
    if (ith >= e->active) return;
    cf_act_q8 *act = e->ts[ith].act;
    quantize_rows(e, job->x, e->c.d, e->c.d, act, NULL, job->n, act_fmt(&e->w.lm_head));
    lm_head_share(e, act, job->out, job->n, ith, e->active);
}

int cf_engine_lm_head(cf_engine *e, const float *x, int n, float *out) {
    e->err_kind = CF_ERR_INPUT;
    if (n < 1 || n > e->max_batch) {
        cf_set_err(e->err, sizeof e->err, "lm_head takes 1..%d rows, got %d", e->max_batch, n);
        return -1;
    }
    e->err_kind = CF_ERR_NONE;
    cf_set_prefetch(e->prefetch);
    lm_head_job job = {e, x, n, out};
    if (e->active == 1) lm_head_task(&job, 0, 1);
    else cf_pool_run(e->pool, lm_head_task, &job);
    return 0;
}

int cf_engine_copy_seq(cf_engine *e, int src, int dst, int n) {
    e->err_kind = CF_ERR_INPUT;
    if (check_seq(e, src, 0) || check_seq(e, dst, 1)) return -1;
    if (n < 0 || n > e->n_ctx) {
        cf_set_err(e->err, sizeof e->err, "cannot copy %d positions: the context holds %d", n, e->n_ctx);
        return -1;
    }
    if (src != dst && cf_deltanet_copy_seq(e, src, dst, n)) {
        e->err_kind = CF_ERR_INPUT;
        return -1;
    }
    e->err_kind = CF_ERR_NONE;
    if (src == dst || n == 0) return 0;
    /* per KV-owning layer [n_kv][n_ctx] rows (its krow / vrow bytes each, fp16 or q8_0): one
     * contiguous run of n rows per (layer, kv head) */
    for (int l = 0; l < e->c.n_layers; l++) {
        const cf_layer_geo *g = &e->geo[l];
        if (!g->has_kv) continue;
        for (int h = 0; h < g->n_kv; h++) {
            size_t r = (size_t)h * e->n_ctx;
            memcpy(cf_kv_rows(e, dst, l, 1) + r * g->krow, cf_kv_rows(e, src, l, 1) + r * g->krow, (size_t)n * g->krow);
            memcpy(cf_kv_rows(e, dst, l, 0) + r * g->vrow, cf_kv_rows(e, src, l, 0) + r * g->vrow, (size_t)n * g->vrow);
        }
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// the shared pieces, for the other attention (engine_mla.c)

void cf_quantize_rows(const cf_engine *e, const float *x, int stride, int K, cf_act_q8 *act, const int *tok, int n,
                      int fmt) {
    quantize_rows(e, x, stride, K, act, tok, n, fmt);
}
void cf_matvec_rows(const cf_engine *e, const cf_tiled *w, const cf_act_q8 *act, float *y, int ystride,
                    const int *tok, int n, int g0, int g1) {
    matvec_rows(e, w, act, y, ystride, tok, n, g0, g1);
}
int cf_d_split(int ng, int ith, int nth, int whole, int lo[2], int hi[2]) { return d_split(ng, ith, nth, whole, lo, hi); }
int cf_attn_first(const cf_engine *e, int b, int l) { return attn_first(e, b, l); }
