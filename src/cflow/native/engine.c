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
 * the next layer's experts and starts their reads (speculative prefetch, below route_disk).
 *
 * Profiling (cf_engine_profile_start, engine.h): every phase boundary calls ph() and every barrier
 * goes through sync_threads(), which with profiling on cut each thread's walk into contiguous
 * timestamped segments (op phases and waits) in buffers allocated when profiling starts; with it
 * off each is one branch on e->prof_on.
 *
 * Nothing on the per-token path allocates. Names: see engine.h.
 */
#include "engine.h"

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "experts.h"
#include "util.h"

// ---------------------------------------------------------------------------------------------
// barrier

/* Phase-counting barrier: spin, then sleep on a futex. Spinning keeps the wake-up latency in
 * the 100 ns range, which matters with ~150 barriers per token. A waiter whose peer has not come
 * within ~BARRIER_SPIN pauses sleeps instead of spinning or yielding: when other processes take
 * cores, two of our threads can end up on one core's run queue, and a waiter that stays runnable
 * (spinning, or sched_yield, which CFS does not honour across priorities) steals the time slice
 * of the very thread it waits for — measured: 3.6 tok/s instead of ~190 on SmolLM2 with two
 * busy processes beside a 2-thread decode. The last arriver wakes sleepers only when there are
 * any, so the uncontended path makes no system call. */
typedef struct {
    atomic_int count;
    _Atomic uint32_t phase;
    _Atomic uint32_t sleepers;
    int n;
} cf_barrier;

#define BARRIER_SPIN 2000 /* pause iterations: tens of microseconds */

static void barrier_wait(cf_barrier *b) {
    if (b->n <= 1) return;
    uint32_t phase = atomic_load_explicit(&b->phase, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->count, 1, memory_order_acq_rel) == b->n - 1) {
        atomic_store_explicit(&b->count, 0, memory_order_relaxed);
        /* seq_cst on both sides: either a sleeper's increment is seen here, or its futex_wait
         * sees the new phase and returns at once. */
        atomic_fetch_add(&b->phase, 1);
        if (atomic_load(&b->sleepers) > 0) cf_word_wake(&b->phase, INT_MAX);
        return;
    }
    cf_word_wait_spin(&b->phase, phase, BARRIER_SPIN, &b->sleepers);
}

// ---------------------------------------------------------------------------------------------
// weights, state

typedef struct {
    const float *attn_norm, *ffn_norm, *moe_norm; /* [d] */
    const float *router;                          /* [E, d] row-major */
    const float *qkv_bias;                        /* [q_dim + 2 kv_dim] or NULL */
    const float *q_norm, *k_norm;                 /* [hd] or NULL */
    cf_tiled wqkv;                                /* [q_dim + 2 kv_dim, d] */
    cf_tiled wq, wk, wv;                          /* its three parts, when stored apart (qkv_split) */
    int qkv_split;                                /* 1: q, k, v are three matrices (their dtypes differ) */
    int qkv_fmt, exp_fmt;                         /* activation formats the projection / experts read */
    cf_tiled wo;                                  /* [d, q_dim] */
    cf_tiled gate_up;                             /* [2 d_ff, d], gate/up interleaved per group */
    cf_tiled down;                                /* [d, d_ff] */
    cf_tiled *exp_gate_up, *exp_down;             /* [E] of [2 d_exp, d] and [d, d_exp] */
    const float *shexp_gate;                      /* [d] or NULL: the shared expert's gate */
    cf_tiled shexp_gate_up, shexp_down;           /* [2 d_shexp, d], [d, d_shexp]: always in RAM */
    uint64_t attn_bytes, dense_bytes, router_bytes, shexp_bytes;
    uint64_t *exp_bytes;                          /* [E] gate_up + down */
} cf_layer;

typedef struct {
    cf_tiled tok_emb;   /* [vocab, d] */
    cf_tiled lm_head;   /* [vocab, d]; a copy of tok_emb when tied */
    const float *norm;  /* [d] */
    cf_layer *sets;     /* [n_unique] */
} cf_weights;

typedef struct {
    float *xb;        /* [B, kmax] normalised activations */
    cf_act_q8 *act;   /* [B] quantized input of the current mat-vec */
    cf_act_q8 *act2;  /* [B] quantized FFN hidden (experts keep act for the next expert) */
    cf_act_q8 *gather; /* [B] descriptors of the tokens routed to one expert (views of act) */
    float *scores;    /* [attn_score_rows, n_ctx] attention scores */
    void *mem;        /* one allocation behind all of the above */
} cf_scratch;

typedef struct {
    float *ring;       /* [n_ring, B, d] residual history */
    float *h, *f;      /* [B, d] x + attention; dense FFN output */
    float *pending;    /* [n_pending, B, d] expert outputs waiting for their layer */
    float *moe_in;     /* [n_moe, B, d] normalised MoE input, per moe slot */
    float *qkv;        /* [B, q_dim + 2 kv_dim] */
    float *att;        /* [B, q_dim] attention output (pre wo) */
    float *hid;        /* [B, hmax] silu(gate) * up */
    float *y;          /* [B, d] expert down-projection output */
    float *rope;       /* [B, hd] cos[hd/2] then sin[hd/2] for each token's position */
    uint8_t *kcache;   /* [n_seq, L, n_kv, n_ctx] rows of krow bytes (fp16 or q8_0), rotated keys */
    uint8_t *vcache;   /* [n_seq, L, n_kv, n_ctx] rows of vrow bytes */
    float *rlogits;    /* [B, E] router probabilities */
    /* the routing of each moe slot */
    int *exp_tok;      /* [n_moe, E, B] tokens routed to each expert */
    float *exp_w;      /* [n_moe, E, B] their routing weights */
    float *shexp_w;    /* [n_moe, B] each row's shared-expert weight, sigmoid(gate . moe_in) */
    int *exp_n;        /* [n_moe, E] */
    /* experts on disk only */
    int *exp_list;     /* [n_moe, E] the chosen experts, ascending (the order of the sums) */
    int *exp_cnt;      /* [n_moe] how many */
    int *exp_pre;      /* [n_moe] leading entries of exp_list the route acquired */
    int *exp_slot;     /* [n_moe, E] cache slot of each acquired expert */
} cf_state;

struct cf_engine {
    cf_config c;
    cf_weights w;
    cf_state s;
    cf_scratch *ts; /* [n_threads] */
    int n_threads, n_ctx, max_batch, kmax, hmax;
    int n_seq;      /* KV-cache slots: sequence s owns kcache/vcache[s] */
    size_t seq_kv;  /* cache rows per sequence slot: L * n_kv * n_ctx */
    int k_type, v_type; /* cache row types, CF_F16 or CF_Q8_0 (cflow.h, "The 8-bit KV cache") */
    size_t krow, vrow;  /* bytes of one K / V row: cf_kv_row_bytes(type, hd) */
    int active; /* threads a call uses (<= n_threads); the others return at once */
    int prefetch; /* software-prefetch mode of this engine's calls (cf_engine_set_prefetch) */
    int32_t *plan;
    int n_ops, n_ring, n_pending, n_moe, inflight;
    const cf_kernel_table *k;
    cf_pool *pool;
    cf_barrier bar;
    /* the call in flight */
    const int32_t *tokens;
    int B;
    int *rseq, *rpos; /* [max_batch] each row's sequence slot and position */
    float *logits;
    int *lrow, n_lrow; /* [max_batch] the rows whose logits the call writes, ascending: logits row i
                        * is row lrow[i]'s */
    /* attention work (forward(), thread 0): blocks of consecutive positions of one sequence that
     * take attention_block (<= ATTN_QBLOCK rows: first row, count), and the rows that go
     * one by one through the per-query kernel */
    int *ablk, n_ablk;  /* [max_batch][2] */
    int *arow, n_arow;  /* [max_batch] */
    int *seen;          /* [n_seq] scratch of the row checks (cf_step_rows) */
    uint8_t *ones;      /* [max_batch] all 1: cf_step_batch wants every row's logits */
    cf_counters cnt;
    uint64_t *hits; /* [L, E] */
    /* experts on disk (xs NULL: in RAM) */
    cf_xstore *xs;
    int xasync;
    const uint8_t *buf;  /* the weights buffer: tensor offsets are pointers into it */
    int64_t *xrel;       /* [n_unique * E][2] gate_up, down offsets inside the expert's span */
    int *xwave;          /* [E] slots a wave must read (thread 0) */
    int wave_end;        /* published by thread 0 before a barrier (op_experts_disk) */
    /* speculative prefetch (thread 0; "speculative prefetch" below) */
    int xspec;           /* depth: predict up to this many layers ahead; 0: off */
    int spec_room;       /* slots speculation may occupy: n_slots - min_slots */
    int *spec_slot;      /* [spec_room] slots it pins, or whose read it started and is in flight */
    int *spec_for;       /* [spec_room] the layer a pinned slot was predicted for; -1: not pinned */
    int n_spec;
    int spec_horizon;    /* the furthest layer predicted in this call; -1: none yet */
    uint16_t *pred_mark; /* [L, E] bit k-1: predicted at distance k for a layer not routed yet in this call */
    uint32_t dist_pred[CF_SPEC_MAX_DEPTH + 1], dist_hit[CF_SPEC_MAX_DEPTH + 1]; /* per distance, decayed */
    double spec_min_precision; /* SPEC_MIN_PRECISION, or CFLOW_SPEC_MIN_PRECISION (tests, benchmarks) */
    int xkeep;           /* 1: rank the cache's layers by how much of a miss speculation can hide */
    int keep_depth;      /* the trusted depth the ranks were last set for; -1: not set yet */
    int *pred_votes;     /* [E] rows whose prediction chose each expert */
    uint64_t disk_base;  /* cf_xstore_bytes_read at the last counter reset */
    int failed;          /* CF_ERR_* of the call in flight; set by thread 0 */
    int err_kind;
    char err[512];
    /* profiling (engine.h): prof_on is read by every thread, written only between calls */
    int prof_on;
    struct cf_prof_thread *prof; /* [n_threads], NULL until the first profile_start */
    cf_prof_call *prof_calls;    /* [prof_calls_cap] */
    int prof_cap, prof_calls_cap, prof_ncalls;
    int64_t prof_dropped_calls;
    /* overlap of independent ops (cf_engine_set_overlap; "overlap" below): the two thread groups'
     * views of this engine, refreshed by forward() before each call; NULL when off */
    struct cf_engine *grp;
};

// ---------------------------------------------------------------------------------------------
// profiling: each thread cuts its walk of the plan into contiguous segments (engine.h)

/* One thread's events, on cache lines of its own (every mark writes here). */
typedef struct cf_prof_thread {
    _Alignas(64) cf_prof_event *ev;
    int n;           /* events stored */
    int kind, layer; /* the open segment (kind -1: none) */
    int64_t last;    /* when it opened */
    int64_t dropped;
} cf_prof_thread;

/* Close thread ith's open segment (if any) and open one of `kind` (-1: none) at `layer` (-1: the
 * same layer). Returns the timestamp. */
__attribute__((noinline, cold)) static int64_t prof_mark(cf_engine *e, int ith, int kind, int layer) {
    cf_prof_thread *p = &e->prof[ith];
    int64_t now = (int64_t)cf_now_ns();
    if (p->kind >= 0) {
        if (p->n < e->prof_cap) p->ev[p->n++] = (cf_prof_event){p->last, now, p->kind, p->layer};
        else p->dropped++;
    }
    p->kind = kind;
    if (layer >= 0) p->layer = layer;
    p->last = now;
    return now;
}

/* A phase boundary: free when profiling is off (one branch on the flag). */
static inline void ph(cf_engine *e, int ith, int kind, int layer) {
    if (__builtin_expect(e->prof_on, 0)) prof_mark(e, ith, kind, layer);
}

/* The barrier between phases; profiled as a CF_PK_WAIT segment, after which a segment of `next`
 * opens (-1: the next op opens its own). */
static void sync_threads(cf_engine *e, int ith, int next) {
    if (e->bar.n > 1) {
        ph(e, ith, CF_PK_WAIT, -1);
        barrier_wait(&e->bar);
    }
    if (next >= 0) ph(e, ith, next, -1);
}

/* Open a segment on thread ith, discarding whatever a failed call left open. */
__attribute__((cold)) static int64_t prof_open(cf_engine *e, int ith, int kind, int layer) {
    e->prof[ith].kind = -1;
    return prof_mark(e, ith, kind, layer);
}

// ---------------------------------------------------------------------------------------------
// small ops (plain C: cheap next to the mat-vecs)

/* Activation formats (cflow.h cf_act_q8): the 32-block one most dtypes read, the 256-block one
 * of the K-quants. A vector is quantized once per format the matrices it feeds need. */
enum { ACT_Q8 = 1, ACT_Q8K = 2 };
static inline int act_fmt(const cf_tiled *w) { return cf_is_kquant(w->dtype) ? ACT_Q8K : ACT_Q8; }

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
 * threads are shared out as whole bands; the groups after them (a part band, or bands left over)
 * are split evenly by groups. So no thread's share starts inside a tile band except in the
 * leftover, which every thread has a piece of. With rows a plain split would cut mid-band
 * (d = 576 = 4.5 bands at 2 threads: bands 0-1 + 4 groups vs 12 groups + bands 3-4), the thread
 * with the later rows ran ~45% longer on equal bytes; this evens it out. A function of
 * (ng, ith, nth) only: the RESID op calls it for the same rows as a [d, *] mat-vec (see ffn()).
 * SPLIT_BAND is the default tile_rows / CF_G; for other tilings only the speed differs. */
enum { SPLIT_BAND = 16 };
static int d_split(int ng, int ith, int nth, int lo[2], int hi[2]) {
    int nb = ng / SPLIT_BAND / nth * nth; /* whole bands shared evenly */
    int b0, b1, r0, r1, k = 0;
    cf_split_range(nb, ith, nth, 1, &b0, &b1);
    cf_split_range(ng - nb * SPLIT_BAND, ith, nth, 1, &r0, &r1);
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

/* One SwiGLU FFN (fused gate_up, then down) for tokens tok[0..n) whose quantized input is in
 * ts->act; out[t, own rows] = down(hid). When `scale` is given, out[t] += scale[i] * result
 * instead (expert outputs into a pending slot). A barrier separates gate_up from down; the one
 * after down is skipped when `tail` is 0: the caller's next step only touches this thread's own
 * rows (the RESID op splits rows exactly like a [d, *] mat-vec does). */
static void ffn(cf_engine *e, const cf_tiled *gate_up, const cf_tiled *down, int hdim,
                const int *tok, int n, float *out, const float *scale, int tail, int pk, int ith, int nth) {
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
    gate_up_rows(e, gate_up, in, s->hid, e->hmax, rows, n, p0, p1);
    sync_threads(e, ith, pk + 1);

    quantize_rows(e, s->hid, e->hmax, hdim, ts->act2, rows, n, act_fmt(down));
    int glo[2], ghi[2], np = d_split(cf_n_groups(down), ith, nth, glo, ghi);
    float *dst = scale ? s->y : out;
    for (int q = 0; q < np; q++) matvec_rows(e, down, ts->act2, dst, d, rows, n, glo[q], ghi[q]);
    for (int q = 0; q < np && scale; q++) {
        int g0 = glo[q], g1 = ghi[q];
        int r0 = g0 * CF_G, r1 = cf_min(g1 * CF_G, d);
        for (int i = 0; i < n; i++) {
            int t = tok ? tok[i] : i;
            float *o = out + (size_t)t * d;
            const float *yy = s->y + (size_t)(rows ? rows[i] : i) * d;
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
    for (int b = b0; b < b1; b++) e->k->embed_row(&e->w.tok_emb, e->tokens[b], x + (size_t)b * d);
    if (ith == 0)
        e->cnt.n[CF_CNT_EMBED] += (uint64_t)e->B * (d / cf_block_weights(e->w.tok_emb.dtype)) *
                                  cf_block_bytes(e->w.tok_emb.dtype);
    sync_threads(e, ith, -1);
}

/* Heads [u0, u1) of token b's fused QKV output (q heads, then k heads, then v heads): add the
 * bias, normalise q and k heads (qk_norm), rotate them; store k and v in the cache at the token's
 * position (fp16, or q8_0 blocks). layer_kv: the layer's first cache row. */
static void qkv_heads(cf_engine *e, const cf_layer *w, size_t layer_kv, int b, int u0, int u1) {
    const cf_config *c = &e->c;
    int hd = c->hd, nh = c->n_heads, p = e->rpos[b];
    size_t base = (size_t)e->rseq[b] * e->seq_kv + layer_kv; /* the row's own sequence slot */
    float *row = e->s.qkv + (size_t)b * (nh + 2 * c->n_kv) * hd;
    const float *cs = e->s.rope + (size_t)b * hd;
    for (int u = u0; u < u1; u++) {
        float *v = row + (size_t)u * hd;
        int kvh = u < nh + c->n_kv ? u - nh : u - nh - c->n_kv;
        if (w->qkv_bias)
            for (int i = 0; i < hd; i++) v[i] += w->qkv_bias[(size_t)u * hd + i];
        if (u < nh + c->n_kv) {
            if (w->q_norm && !c->qk_norm_full) e->k->rmsnorm(v, v, u < nh ? w->q_norm : w->k_norm, hd, c->norm_eps);
            e->k->rope(v, 1, hd, cs, cs + hd / 2);
        }
        if (u < nh) continue;
        int is_k = u < nh + c->n_kv, type = is_k ? e->k_type : e->v_type;
        uint8_t *row = (is_k ? e->s.kcache : e->s.vcache) + (base + (size_t)kvh * e->n_ctx + p) * (is_k ? e->krow : e->vrow);
        if (type == CF_Q8_0)
            e->k->f32_to_q8_0(row, v, hd);
        else
            e->k->f32_to_f16((cf_half *)row, v, hd);
    }
}

/* Row groups [g0, g1) of the q|k|v projection for the B tokens into s->qkv: one mat-vec over the
 * fused matrix, or the pieces of [g0, g1) that fall in each of its three parts. */
static void qkv_rows(const cf_engine *e, const cf_layer *w, const cf_act_q8 *act, int B, int g0, int g1) {
    int qkv_dim = (e->c.n_heads + 2 * e->c.n_kv) * e->c.hd;
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

/* First cached position row b attends to: the sliding window keeps the last W. */
static int attn_first(const cf_engine *e, int b) {
    int W = e->c.sliding_window;
    return W > 0 && e->rpos[b] >= W ? e->rpos[b] - W + 1 : 0;
}

/* Query rows per work item of the block attention: each K/V row converted once serves
 * ATTN_QBLOCK queries times the query heads of its kv head. */
#define ATTN_QBLOCK 16

/* Rows of n_ctx floats in each thread's score scratch: one per query head (the per-query kernel),
 * or one per query head of a kv head and row of a block (attn_blocks), whichever is more. */
static int attn_score_rows(const cf_engine *e) {
    return cf_max(e->c.n_heads, e->c.n_heads / e->c.n_kv * cf_min(ATTN_QBLOCK, e->max_batch));
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

/* Block attention (attn_plan's blocks): work items are (block, kv head), dealt round robin, kv
 * heads fastest, so both the causal growth of the rows and the heads spread over the threads;
 * an item writes only its heads of its rows. The thread's scratch holds a whole block's score
 * rows: group * min(ATTN_QBLOCK, max_batch) rows of at most n_ctx (attn_score_rows). */
static void attn_blocks(cf_engine *e, size_t layer_kv, float *scores, int ith, int nth) {
    const cf_config *c = &e->c;
    int hd = c->hd, group = c->n_heads / c->n_kv, q_dim = c->n_heads * hd;
    int qkv_dim = q_dim + 2 * c->n_kv * hd;
    for (int it = ith; it < e->n_ablk * c->n_kv; it += nth) {
        int kvh = it % c->n_kv, b0 = e->ablk[2 * (it / c->n_kv)], nq = e->ablk[2 * (it / c->n_kv) + 1];
        size_t base = (size_t)e->rseq[b0] * e->seq_kv + layer_kv;
        cf_attn_block_shape sh = {.n_heads = c->n_heads, .n_kv_heads = c->n_kv, .head_dim = hd,
                                  .max_seq = e->n_ctx, .scale = 1.0f / sqrtf((float)hd),
                                  .pos0 = e->rpos[b0], .n_q = nq, .window = c->sliding_window,
                                  .ldq = qkv_dim, .ldo = q_dim};
        float *out = e->s.att + (size_t)b0 * q_dim, *q = e->s.qkv + (size_t)b0 * qkv_dim;
        const uint8_t *k = e->s.kcache + base * e->krow, *v = e->s.vcache + base * e->vrow;
        if (e->k_type == CF_F16 && e->v_type == CF_F16)
            e->k->attention_block(out, q, (const cf_half *)k, (const cf_half *)v, scores, &sh, kvh * group,
                                  (kvh + 1) * group);
        else
            e->k->attention_block_q8kv(out, q, k, v, e->k_type, e->v_type, scores, &sh, kvh * group,
                                       (kvh + 1) * group);
    }
}

static void op_attn(cf_engine *e, int l, int slot, int ith, int nth) {
    const cf_config *c = &e->c;
    const cf_layer *w = &e->w.sets[l % c->n_unique];
    cf_state *s = &e->s;
    cf_scratch *ts = &e->ts[ith];
    int d = c->d, hd = c->hd, B = e->B, q_dim = c->n_heads * hd, kv_dim = c->n_kv * hd;
    int qkv_dim = q_dim + 2 * kv_dim;
    const float *x = s->ring + (size_t)slot * e->max_batch * d;

    // norm, quantize (every thread, private), then this thread's heads of the fused QKV
    ph(e, ith, CF_PK_NORM, l);
    for (int b = 0; b < B; b++) e->k->rmsnorm(ts->xb + (size_t)b * e->kmax, x + (size_t)b * d,
                                              w->attn_norm, d, c->norm_eps);
    quantize_rows(e, ts->xb, e->kmax, d, ts->act, NULL, B, w->qkv_fmt);
    ph(e, ith, CF_PK_QKV, l);
    size_t layer_kv = (size_t)l * c->n_kv * e->n_ctx; /* the layer's first cache row */
    int g0, g1, i0, i1, n_units = c->n_heads + 2 * c->n_kv; /* q heads, k heads, v heads */
    if (hd % CF_G == 0 && !c->qk_norm_full) {
        // Split by whole heads, so the thread that computes a head also rotates it and stores
        // it in the cache: no barrier between the projection and RoPE.
        int u0, u1, gph = hd / CF_G;
        // Larger shares first: the thread with the later rows streams them slower (d_split).
        split_big_first(n_units, ith, nth, &u0, &u1);
        qkv_rows(e, w, ts->act, B, u0 * gph, u1 * gph);
        for (int b = 0; b < B; b++) qkv_heads(e, w, layer_kv, b, u0, u1);
    } else {
        cf_split_range(qkv_dim / CF_G + (qkv_dim % CF_G != 0), ith, nth, 1, &g0, &g1);
        qkv_rows(e, w, ts->act, B, g0, g1);
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
        for (int i = i0; i < i1; i++) qkv_heads(e, w, layer_kv, i / n_units, i % n_units, i % n_units + 1);
    }
    sync_threads(e, ith, CF_PK_ATTN);

    // attention: runs of a sequence's consecutive rows in blocks (each K/V row read once per
    // block), then this thread's (row, head) items of the other rows, one kernel call per row
    attn_blocks(e, layer_kv, ts->scores, ith, nth);
    cf_split_range(e->n_arow * c->n_heads, ith, nth, 1, &i0, &i1);
    for (int i = i0; i < i1;) {
        int b = e->arow[i / c->n_heads], h0 = i % c->n_heads, h1 = cf_min(c->n_heads, h0 + i1 - i);
        int t0 = attn_first(e, b);
        cf_attn_shape sh = {.n_heads = c->n_heads, .n_kv_heads = c->n_kv, .head_dim = hd,
                            .max_seq = e->n_ctx, .n_pos = e->rpos[b] + 1 - t0,
                            .scale = 1.0f / sqrtf((float)hd)};
        /* row b sees only its sequence, from position t0 on */
        size_t base = (size_t)e->rseq[b] * e->seq_kv + layer_kv + (size_t)t0;
        const uint8_t *k = s->kcache + base * e->krow, *v = s->vcache + base * e->vrow;
        if (e->k_type == CF_F16 && e->v_type == CF_F16)
            e->k->attention(s->att + (size_t)b * q_dim, s->qkv + (size_t)b * qkv_dim, (const cf_half *)k,
                            (const cf_half *)v, ts->scores, &sh, h0, h1);
        else
            e->k->attention_q8kv(s->att + (size_t)b * q_dim, s->qkv + (size_t)b * qkv_dim, k, v, e->k_type,
                                 e->v_type, ts->scores, &sh, h0, h1);
        i += h1 - h0;
    }
    sync_threads(e, ith, CF_PK_WO);

    // output projection into h, plus the residual, for this thread's rows
    quantize_rows(e, s->att, q_dim, q_dim, ts->act, NULL, B, act_fmt(&w->wo));
    int glo[2], ghi[2], np = d_split(cf_n_groups(&w->wo), ith, nth, glo, ghi);
    for (int q = 0; q < np; q++) matvec_rows(e, &w->wo, ts->act, s->h, d, NULL, B, glo[q], ghi[q]);
    for (int q = 0; q < np; q++) {
        int r0 = glo[q] * CF_G, r1 = cf_min(ghi[q] * CF_G, d);
        for (int b = 0; b < B; b++)
            for (int r = r0; r < r1; r++) s->h[(size_t)b * d + r] += x[(size_t)b * d + r];
    }
    if (ith == 0) {
        e->cnt.n[CF_CNT_ATTN] += w->attn_bytes;
        for (int b = 0; b < B; b++)
            e->cnt.n[CF_CNT_KV] += (uint64_t)(e->rpos[b] + 1 - attn_first(e, b)) * c->n_kv * (e->krow + e->vrow);
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
    ffn(e, &w->gate_up, &w->down, e->c.d_ff, NULL, B, e->s.f, NULL, tail, CF_PK_DENSE_GATE_UP, ith, nth);
}

// ---------------------------------------------------------------------------------------------
// experts on disk (experts.h): acquiring cache slots, waves, waiting for bytes

/* Thread 0: pin cache slots for the chosen experts list[i0..) of moe slot ms, at most `max`, and
 * stop at the first that finds no evictable slot; the missing ones are queued for the readers
 * (async) or read here (sync). Returns the index after the last one acquired. */
static int acquire_wave(cf_engine *e, int l, int ms, int i0, int max) {
    int set = l % e->c.n_unique;
    cf_state *s = &e->s;
    int E = e->c.n_experts, n = s->exp_cnt[ms], nm = 0, i = i0;
    const int *list = s->exp_list + (size_t)ms * E;
    int *slot = s->exp_slot + (size_t)ms * E;
    for (; i < n && i - i0 < max; i++) {
        int miss, sl = cf_xstore_acquire(e->xs, set * E + list[i], &miss);
        if (sl < 0) break;
        slot[list[i]] = sl;
        e->cnt.n[miss ? CF_CNT_CACHE_MISSES : CF_CNT_CACHE_HITS]++;
        if (miss == 2) e->cnt.n[CF_CNT_PREFETCH_USED]++; /* read early by speculation */
        if (miss == 1) e->xwave[nm++] = sl;
    }
    if (e->xasync) {
        cf_xstore_submit(e->xs, e->xwave, nm, l);
    } else if (nm) { /* sync: read, then compute; the reading is the stall */
        uint64_t t0 = cf_now_ns();
        for (int j = 0; j < nm; j++) cf_xstore_read_now(e->xs, e->xwave[j]);
        e->cnt.n[CF_CNT_IO_STALL_NS] += cf_now_ns() - t0;
    }
    return i;
}

// ---------------------------------------------------------------------------------------------
// speculative prefetch: at route(l), predict the experts of layers l+1 .. l+depth and start reads
//
// With delta_expert = 0 (plain Mixtral) experts(l) follows route(l) at once, so a layer's reads
// overlap only each other and that layer's expert compute. Speculation starts later layers' reads
// earlier: right after route(l) has queued its own reads (they go first), thread 0 predicts what
// route(l+k) will choose and queues reads of the predicted experts the cache lacks, which then
// overlap the compute of the layers in between. One expert of a Mixtral-sized model takes about
// ten layers' compute to read from an SSD, so one layer ahead (depth 1, "next-layer") hides little
// of it; a deeper horizon starts each read up to `depth` layers before it is needed.
//
// What is predicted from what: route(l+k) will normalise a residual that does not exist yet. The
// latest vector that does is route(l)'s own input z_l (h_l, or h_l + f_l with moe_input
// post_dense): the prediction is the top_k of softmax(router_{l+k}(rmsnorm(z_l) * moe_norm_{l+k})),
// computed as route does (so two layers sharing a weight set predict exactly what the first chose:
// tested). The residual stream changes little from one layer to the next, so this often picks the
// same experts, and less often the further ahead (measured by the predict counters). With
// B rows, the union of the rows' top_k is predicted, and reads start for the most-voted first.
//
// Which layers each route predicts: the next one (from the freshest input) and the one entering
// the horizon, l + depth (the first route of a call predicts all of 1 .. depth). A layer's marks
// are the union of its predictions; its route scores them (expert_predict_hits / expert_predicted:
// the share of predicted experts the layer chose). Two router evaluations per route, whatever the
// depth: a router is E x d floats, and re-predicting every layer in the horizon at every route
// would read depth of them.
//
// Slots: the plan's own pins never exceed min_slots = top_k x layers in flight (engine.h, "the
// plan"), the smallest cache accepted. Speculation gets only the n_slots - min_slots beyond that
// (off when there are none), counted in spec_slot: every slot it pins until the layer it was
// predicted for routes (those it reads, and the predicted experts already cached, so that reads for
// other layers do not evict them first), and every slot whose speculative read is still in flight
// after the pin is gone (a LOADING slot cannot be evicted). So whenever the plan needs a slot
// (each of a route's first top_k, the first of a wave) at most min_slots - 1 of its own pins and
// spec_room other slots are not evictable: the plan's acquires never fail, speculation never waits for a slot and
// never evicts a pinned or loading one; nearer layers are served first, and a horizon that does
// not fit the spare slots is cut short. At route(l) the pins predicted for l are dropped after its
// first wave is pinned: the experts it chose sit in their slots (their acquire counts a cache miss
// and prefetch_used), the others stay cached at a low score (their layer never chose them),
// evicted first. Results are bit for bit those without speculation: it only changes which bytes
// are read when.

#define SPEC_MIN_PRECISION 0.9 /* share of a distance's predictions chosen for it to start reads */
#define SPEC_MIN_SAMPLES 32    /* predictions at a distance before the gate judges it */
#define SPEC_WINDOW 512        /* predictions per distance before the counts halve */

/* Thread 0 at route(l): drop the speculative pins predicted for layers up to l; forget the slots
 * that are neither pinned nor loading any more. */
static void spec_release(cf_engine *e, int l) {
    int k = 0;
    for (int i = 0; i < e->n_spec; i++) {
        int sl = e->spec_slot[i], target = e->spec_for[i];
        if (target >= 0 && target <= l) {
            cf_xstore_release(e->xs, sl);
            target = -1;
        }
        if (target >= 0 || cf_xstore_loading(e->xs, sl)) {
            e->spec_slot[k] = sl;
            e->spec_for[k++] = target;
        }
    }
    e->n_spec = k;
}

/* Thread 0, at route(l): how many of the experts predicted for l it chose (cnt: its routing), in
 * all (the counters) and per distance the prediction was made from (the gate, spec_trusted). */
static void spec_score(cf_engine *e, int l, const int *cnt) {
    uint16_t *mark = e->pred_mark + (size_t)l * e->c.n_experts;
    for (int x = 0; x < e->c.n_experts; x++) {
        if (!mark[x]) continue;
        if (cnt[x]) e->cnt.n[CF_CNT_PREDICT_HITS]++;
        for (int k = 1; k <= CF_SPEC_MAX_DEPTH; k++)
            if (mark[x] >> (k - 1) & 1) {
                if (++e->dist_pred[k] > SPEC_WINDOW) { /* decay: recent routing counts most */
                    e->dist_pred[k] /= 2;
                    e->dist_hit[k] /= 2;
                }
                e->dist_hit[k] += cnt[x] > 0;
            }
        mark[x] = 0;
    }
}

/* May predictions made k layers ahead start reads? The next layer's always may (the issue's
 * next-layer prefetch); further ones once SPEC_MIN_SAMPLES predictions at that distance are in, and
 * while at least SPEC_MIN_PRECISION of them were chosen, over the last ~SPEC_WINDOW. A wrong read
 * costs a read and evicts a cached expert: where routing changes much from layer to layer, deep
 * predictions are often wrong, and reading them made a 95% cache miss twice as often, plus a wasted
 * read per token (docs/results/moe.md); the gate keeps the predicting (to keep measuring) and
 * stops the reading. */
static int spec_trusted(const cf_engine *e, int k) {
    if (k <= 1) return 1;
    if (e->dist_pred[k] < SPEC_MIN_SAMPLES) return 0;
    return (double)e->dist_hit[k] >= e->spec_min_precision * (double)e->dist_pred[k];
}

/* Keep ranks (experts.h): which layers' misses the cache should avoid. Speculation trusted up to
 * d layers ahead (spec_trusted at every distance 1..d) starts the read of a layer l >= d when
 * route(l - d) runs, d layers before it is needed, but the read of a layer l < d only at the
 * call's first route, l layers before: a step's first layers cannot be predicted before the step
 * exists, and layer 0 not at all. So layer l's misses are exposed by max(0, d - l) layers more than
 * the rest; that is its rank, and the cache evicts low ranks first. With uniform routing this moves
 * misses to layers whose reads overlap compute and adds few (+7% in the replay of
 * tests/test_experts_disk.py: the churning last layers lose experts to the misses just before
 * them); with skewed routing it can cost more hits, which a step's first layers then do not stall
 * on. Off without speculation (sync reads hide nothing), or with CFLOW_EXPERT_KEEP=0 (benchmarks:
 * the policy alone). Measured: docs/results/moe.md. */
static void keep_ranks(cf_engine *e) {
    if (!e->xkeep) return;
    int d = 1;
    while (d < e->xspec && spec_trusted(e, d + 1)) d++;
    if (d == e->keep_depth) return;
    e->keep_depth = d;
    for (int set = 0; set < e->c.n_unique; set++) /* a shared set is first used by layer `set` */
        cf_xstore_keep(e->xs, set, cf_max(0, d - set));
}

/* Thread 0, when a call starts: cf_xstore_begin dropped every pin (a failed call may have left
 * some); reads still in flight stay counted until they land. */
static void spec_begin(cf_engine *e) {
    if (!e->xspec) return;
    for (int i = 0; i < e->n_spec; i++) e->spec_for[i] = -1;
    e->spec_horizon = -1;
    memset(e->pred_mark, 0, (size_t)e->c.n_layers * e->c.n_experts * sizeof *e->pred_mark);
    keep_ranks(e);
}

/* Thread 0: pin a cached (or loading) slot predicted for layer target, so no other read evicts it
 * before target routes; a slot speculation holds already keeps its pin until the later layer. */
static void spec_hold(cf_engine *e, int sl, int target) {
    for (int i = 0; i < e->n_spec; i++)
        if (e->spec_slot[i] == sl) {
            if (e->spec_for[i] < 0) cf_xstore_pin(e->xs, sl); /* a read landing after its pin was dropped */
            e->spec_for[i] = cf_max(e->spec_for[i], target);
            return;
        }
    cf_xstore_pin(e->xs, sl);
    e->spec_slot[e->n_spec] = sl;
    e->spec_for[e->n_spec++] = target;
}

/* Thread 0, after route(l)'s own reads are queued: predict route(target) from route(l)'s input
 * and start the reads of predicted experts nobody has cached or is reading. */
static void spec_predict(cf_engine *e, int l, int target, int src_kind) {
    int k_ahead = target - l, trusted = spec_trusted(e, k_ahead);
    const cf_config *c = &e->c;
    cf_state *s = &e->s;
    int E = c->n_experts, d = c->d, set = target % c->n_unique, most = 0, nm = 0;
    const cf_layer *w = &e->w.sets[set];
    float *z = e->ts[0].xb, *zn = z + e->kmax, *pr = s->rlogits; /* free once route(l) is done */
    int *votes = e->pred_votes, chosen[64];
    uint16_t *mark = e->pred_mark + (size_t)target * E;
    float val[64];
    memset(votes, 0, (size_t)E * sizeof *votes);
    for (int b = 0; b < e->B; b++) {
        const float *hb = s->h + (size_t)b * d;
        for (int i = 0; i < d; i++) z[i] = hb[i] + (src_kind == CF_SRC_HF ? s->f[(size_t)b * d + i] : 0.0f);
        e->k->rmsnorm(zn, z, w->moe_norm, d, c->norm_eps);
        e->k->matvec_f32(pr, w->router, zn, E, d);
        e->k->softmax(pr, E);
        e->k->topk(pr, E, c->top_k, chosen, val);
        for (int k = 0; k < c->top_k; k++) most = cf_max(most, ++votes[chosen[k]]);
    }
    for (int x = 0; x < E; x++)
        if (votes[x] > 0) {
            if (!mark[x]) e->cnt.n[CF_CNT_PREDICTED]++;
            mark[x] |= (uint16_t)(1u << (k_ahead - 1));
        }
    if (!trusted) return;
    for (int v = most; v > 0 && e->n_spec < e->spec_room; v--)
        for (int x = 0; x < E && e->n_spec < e->spec_room; x++) {
            if (votes[x] != v) continue;
            int sl = cf_xstore_lookup(e->xs, set * E + x);
            if (sl >= 0) { /* cached or coming: keep it until target routes */
                spec_hold(e, sl, target);
                continue;
            }
            if ((sl = cf_xstore_prefetch(e->xs, set * E + x)) < 0) { /* cannot happen within spec_room */
                v = 0;
                break;
            }
            e->spec_slot[e->n_spec] = sl;
            e->spec_for[e->n_spec++] = target;
            e->xwave[nm++] = sl;
        }
    e->cnt.n[CF_CNT_PREFETCH_READS] += (uint64_t)nm;
    cf_xstore_submit(e->xs, e->xwave, nm, target);
}

/* Thread 0 at route(l): the next layer, then those entering the horizon (spec_horizon: the
 * furthest layer predicted in this call; at its first route, all of l+2 .. l+depth). */
static void spec_ahead(cf_engine *e, int l, int src_kind) {
    int last = cf_min(l + e->xspec, e->c.n_layers - 1);
    if (l + 1 > last) return;
    spec_predict(e, l, l + 1, src_kind);
    for (int t = cf_max(e->spec_horizon + 1, l + 2); t <= last; t++) spec_predict(e, l, t, src_kind);
    e->spec_horizon = cf_max(e->spec_horizon, last);
}

/* Thread 0, after the route of layer l into moe slot ms: list the chosen experts in ascending order
 * (the order their outputs are summed in RAM too, so results are bit for bit the same) and, with
 * async I/O, pin and start reading up to top_k of them now: their bytes arrive while the layers up
 * to the experts op run. top_k per layer in flight is what the smallest cache guarantees; a batch
 * that routes to more experts reads the rest in waves (op_experts_disk). With speculation, then
 * predict layer l+1 (above). */
static void route_disk(cf_engine *e, int l, int ms, int src_kind) {
    cf_state *s = &e->s;
    int E = e->c.n_experts, n = 0;
    const int *cnt = s->exp_n + (size_t)ms * E;
    int *list = s->exp_list + (size_t)ms * E;
    for (int x = 0; x < E; x++)
        if (cnt[x]) list[n++] = x;
    s->exp_cnt[ms] = n;
    cf_xstore_visit(e->xs, l % e->c.n_unique, list, n);
    s->exp_pre[ms] = e->xasync ? acquire_wave(e, l, ms, 0, e->c.top_k) : 0;
    if (!e->xspec) return;
    spec_score(e, l, cnt);
    spec_release(e, l); /* after the first wave: the chosen ones are pinned by it now */
    spec_ahead(e, l, src_kind);
}

// ---------------------------------------------------------------------------------------------
// the MoE ops

/* Thread 0 normalises the MoE input, runs the router (f32) and fills per-expert token lists:
 * softmax over all E logits, top-k, the k weights renormalised to sum to 1 (moe_norm_topk; else
 * kept as they are). With a shared expert it also computes each row's weight for it. */
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
            e->k->matvec_f32(pr, w->router, mi, E, d);
            e->k->softmax(pr, E);
            int chosen[64];
            float val[64], wsum = 0.0f;
            e->k->topk(pr, E, c->top_k, chosen, val);
            for (int k = 0; k < c->top_k; k++) wsum += val[k];
            if (!c->moe_norm_topk) wsum = 1.0f;
            for (int k = 0; k < c->top_k; k++) {
                int x = chosen[k], n = exp_n[x]++;
                exp_tok[(size_t)x * B + n] = b;
                exp_w[(size_t)x * B + n] = val[k] / wsum;
                e->hits[(size_t)l * E + x]++;
            }
        }
        if (c->d_shexp)
            for (int b = 0; b < e->B; b++) {
                float g;
                e->k->matvec_f32(&g, w->shexp_gate, moe_in + (size_t)b * d, 1, d);
                s->shexp_w[(size_t)ms * B + b] = 1.0f / (1.0f + expf(-g));
            }
        e->cnt.n[CF_CNT_ROUTER] += w->router_bytes;
        if (e->xs) route_disk(e, l, ms, src_kind);
    }
    sync_threads(e, ith, -1);
}

/* The shared expert on every row of moe slot ms, scaled by the route's per-row weight, into out;
 * its weights are in RAM whatever the routed experts' residency, and it runs before them in both
 * experts ops (the same summation order). The routed experts that follow (a route chooses at
 * least one) need the barrier that ends it. The input must already be quantized in ts->act. */
static void shared_expert(cf_engine *e, const cf_layer *w, int ms, float *out, int ith, int nth) {
    if (!e->c.d_shexp) return;
    if (ith == 0) e->cnt.n[CF_CNT_EXPERTS] += w->shexp_bytes;
    ffn(e, &w->shexp_gate_up, &w->shexp_down, e->c.d_shexp, NULL, e->B, out,
        e->s.shexp_w + (size_t)ms * e->max_batch, 1, CF_PK_EXP_GATE_UP, ith, nth);
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
    int last = -1;
    for (int x = 0; x < c->n_experts; x++)
        if (exp_n[x]) last = x;
    for (int x = 0; x <= last; x++) {
        int n = exp_n[x];
        if (!n) continue; // untouched: its tiles are never read
        if (ith == 0) e->cnt.n[CF_CNT_EXPERTS] += w->exp_bytes[x];
        ffn(e, &w->exp_gate_up[x], &w->exp_down[x], c->d_exp, exp_tok + (size_t)x * B, n, out,
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
                e->wave_end = acquire_wave(e, l, ms, i, n);
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
        gu.data = data + e->xrel[2 * key];
        dn.data = data + e->xrel[2 * key + 1];
        if (ith == 0) e->cnt.n[CF_CNT_EXPERTS] += w->exp_bytes[x];
        ffn(e, &gu, &dn, c->d_exp, exp_tok + (size_t)x * B, exp_n[x], out, exp_w + (size_t)x * B,
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
    // the same rows as this thread's share of a [d, *] mat-vec (wo, down): d_split, see ffn()
    int glo[2], ghi[2], np = d_split((d + CF_G - 1) / CF_G, ith, nth, glo, ghi);
    float *x = s->ring + (size_t)slot * e->max_batch * d;
    float *pend = pslot >= 0 ? s->pending + (size_t)pslot * e->max_batch * d : NULL;
    for (int q = 0; q < np; q++) {
        int r0 = glo[q] * CF_G, r1 = cf_min(ghi[q] * CF_G, d);
        for (int b = 0; b < e->B; b++) {
            size_t o = (size_t)b * d;
            for (int r = r0; r < r1; r++) {
                float v = s->h[o + r];
                if (add_f) v += s->f[o + r];
                if (pend) {
                    v += pend[o + r];
                    pend[o + r] = 0.0f;
                }
                x[o + r] = v;
            }
        }
    }
    sync_threads(e, ith, -1);
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
    }
    quantize_rows(e, ts->xb, e->kmax, d, ts->act, NULL, nb, act_fmt(&e->w.lm_head));
    ph(e, ith, CF_PK_LM_HEAD, 0);
    int g0, g1;
    cf_split_range(cf_n_groups(&e->w.lm_head), ith, nth, 1, &g0, &g1);
    matvec_rows(e, &e->w.lm_head, ts->act, e->logits, e->c.vocab, NULL, nb, g0, g1);
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
        int tail = i + 1 == e->n_ops || op[CF_OP_FIELDS] != CF_OP_RESID; /* barrier needed after */
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
        case CF_OP_ATTN: op_attn(e, l, a, ith, nth); break;
        case CF_OP_DENSE: op_dense(e, l, a, b, tail, ith, nth); break;
        case CF_OP_ROUTE: op_route(e, l, a, b, ith); break;
        case CF_OP_EXPERTS:
            if (!e->xs) op_experts(e, l, a, b, tail, ith, nth);
            else if (op_experts_disk(e, l, a, b, tail, ith, nth)) return; /* every thread leaves */
            break;
        case CF_OP_RESID: op_resid(e, l, a, b, c, ith, nth); break;
        case CF_OP_FINAL: op_final(e, a, b, ith, nth); break;
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
    int64_t pt0 = e->prof_on ? prof_open(e, 0, CF_PK_SETUP, 0) : 0;
    for (int b = 0; b < B; b++) {
        float *cs = e->s.rope + (size_t)b * c->hd;
        cf_rope_table(cs, cs + c->hd / 2, c->hd, e->rpos[b], c->rope_theta);
    }
    memset(e->s.pending, 0, (size_t)e->n_pending * e->max_batch * c->d * sizeof(float));
    e->failed = CF_ERR_NONE;
    if (e->xs && cf_xstore_begin(e->xs, e->err, sizeof e->err)) {
        if (e->prof_on) e->prof[0].kind = -1;
        e->err_kind = CF_ERR_IO;
        return -1;
    }
    spec_begin(e);
    /* the mode is process-wide in the kernels: make it this engine's for this call (a call of
     * another engine running at the same time may switch it; that changes speed, never results) */
    cf_set_prefetch(e->prefetch);
    e->tokens = tokens;
    e->B = B;
    e->logits = logits;
    e->n_lrow = 0;
    for (int b = want ? 0 : B - 1; b < B; b++)
        if (!want || want[b]) e->lrow[e->n_lrow++] = b;
    attn_plan(e);
    if (e->grp) overlap_begin(e);
    if (e->active == 1)
        forward_task(e, 0, 1); /* no need to wake the pool (sleeping workers take ~50 us) */
    else
        cf_pool_run(e->pool, forward_task, e);
    if (e->prof_on) {
        int64_t pt1 = prof_mark(e, 0, -1, -1);
        if (e->prof_ncalls < e->prof_calls_cap) e->prof_calls[e->prof_ncalls++] = (cf_prof_call){pt0, pt1, B, 0};
        else e->prof_dropped_calls++;
    }
    if (e->grp) overlap_end(e);
    if (e->failed) {
        e->err_kind = e->failed;
        return -1;
    }
    e->cnt.n[CF_CNT_TOKENS] += B;
    e->cnt.n[CF_CNT_CALLS]++;
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
    if (bad) return -1;
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

int cf_engine_copy_seq(cf_engine *e, int src, int dst, int n) {
    e->err_kind = CF_ERR_INPUT;
    if (check_seq(e, src, 0) || check_seq(e, dst, 1)) return -1;
    if (n < 0 || n > e->n_ctx) {
        cf_set_err(e->err, sizeof e->err, "cannot copy %d positions: the context holds %d", n, e->n_ctx);
        return -1;
    }
    e->err_kind = CF_ERR_NONE;
    if (src == dst || n == 0) return 0;
    /* [s][L][n_kv][n_ctx] rows (krow / vrow bytes each, fp16 or q8_0): one contiguous run of n
     * rows per (layer, kv head) */
    size_t runs = (size_t)e->c.n_layers * e->c.n_kv;
    for (size_t r = 0; r < runs; r++) {
        size_t from = (size_t)src * e->seq_kv + r * e->n_ctx, to = (size_t)dst * e->seq_kv + r * e->n_ctx;
        memcpy(e->s.kcache + to * e->krow, e->s.kcache + from * e->krow, (size_t)n * e->krow);
        memcpy(e->s.vcache + to * e->vrow, e->s.vcache + from * e->vrow, (size_t)n * e->vrow);
    }
    return 0;
}

const char *cf_engine_error(const cf_engine *e) { return e->err; }
int cf_engine_error_kind(const cf_engine *e) { return e->err_kind; }
void cf_engine_counters(const cf_engine *e, cf_counters *out) {
    *out = e->cnt;
    if (e->xs) out->n[CF_CNT_DISK_BYTES] = cf_xstore_bytes_read(e->xs) - e->disk_base;
}
void cf_engine_expert_hits(const cf_engine *e, uint64_t *out) {
    memcpy(out, e->hits, (size_t)e->c.n_layers * e->c.n_experts * sizeof *out);
}
void cf_engine_reset_counters(cf_engine *e) {
    memset(&e->cnt, 0, sizeof e->cnt);
    if (e->xs) e->disk_base = cf_xstore_bytes_read(e->xs);
    memset(e->hits, 0, (size_t)e->c.n_layers * e->c.n_experts * sizeof *e->hits);
}
int cf_engine_n_ctx(const cf_engine *e) { return e->n_ctx; }
int cf_engine_n_threads(const cf_engine *e) { return e->n_threads; }
int cf_engine_active_threads(const cf_engine *e) { return e->active; }
int cf_engine_set_active_threads(cf_engine *e, int n) {
    e->active = e->bar.n = cf_min(cf_max(n, 1), e->n_threads);
    return e->active;
}
int cf_engine_set_overlap(cf_engine *e, int on) {
    if (!on) {
        free(e->grp);
        e->grp = NULL;
        return 0;
    }
    if (!e->grp && !(e->grp = calloc(2, sizeof *e->grp))) return -1;
    return 0;
}
int cf_engine_overlap(const cf_engine *e) { return e->grp != NULL; }
int cf_engine_set_prefetch(cf_engine *e, int mode) {
    if (mode < CF_PREFETCH_DEFAULT || mode > CF_PREFETCH_MAX) return -1;
    e->prefetch = mode;
    return 0;
}
int cf_engine_prefetch(const cf_engine *e) { return e->prefetch; }
int cf_engine_max_batch(const cf_engine *e) { return e->max_batch; }
int cf_engine_n_seq(const cf_engine *e) { return e->n_seq; }
const char *cf_engine_isa(const cf_engine *e) { return e->k->name; }

int cf_engine_expert_cache(const cf_engine *e, cf_expert_cache_info *out) {
    memset(out, 0, sizeof *out);
    out->inflight = e->inflight;
    out->min_slots = e->c.top_k * e->inflight;
    if (!e->xs) return 0;
    cf_xstore_info xi;
    cf_xstore_get_info(e->xs, &xi);
    out->n_slots = xi.n_slots;
    out->async = xi.async;
    out->n_io = xi.n_io;
    out->direct = xi.direct;
    out->slot_bytes = xi.slot_bytes;
    out->cache_bytes = xi.cache_bytes;
    out->speculate = e->xspec;
    out->spec_slots = e->spec_room;
    out->keep_depth = cf_max(0, e->keep_depth); /* -1 (or 0: no speculation) until ranks are set */
    out->uring = xi.uring;
    out->reader_note = xi.note;
    return 1;
}
int cf_engine_expert_resident(const cf_engine *e, int *keys) {
    return e->xs ? cf_xstore_resident(e->xs, keys) : 0;
}
int cf_engine_inject_io_fault(cf_engine *e, int64_t after, int kind, int delay_us) {
    if (!e->xs || kind < 0 || kind >= CF_XFAULT_KINDS || after < 0) return -1;
    cf_xstore_inject_fault(e->xs, after, kind, delay_us);
    return 0;
}

// ---------------------------------------------------------------------------------------------
// profiling (engine.h)

/* Upper bound of the events one call records on one thread, from the plan: every phase and
 * barrier an op can pass, with the most experts a batch can route to, each possibly its own wave. */
int cf_engine_profile_events_per_call(const cf_engine *e) {
    int64_t n = 4; /* setup, the join */
    int nx = cf_min(e->c.n_experts, e->c.top_k * e->max_batch);
    for (int i = 0; i < e->n_ops; i++) {
        switch (e->plan[(size_t)i * CF_OP_FIELDS]) {
        case CF_OP_EMBED: n += 2; break;
        case CF_OP_ATTN: n += 10; break;  /* norm, qkv, (wait, qkv), wait, attn, wait, wo, wait */
        case CF_OP_DENSE: n += 5; break;  /* norm, gate_up, wait, down, wait */
        case CF_OP_ROUTE: n += 2; break;
        case CF_OP_EXPERTS: n += 1 + 8 * (int64_t)nx; break; /* io, wave wait, io, gate_up, wait, down, wait */
        case CF_OP_RESID: n += 2; break;
        case CF_OP_FINAL: n += 2; break;
        }
    }
    return n > INT_MAX / 2 ? INT_MAX / 2 : (int)n;
}

void cf_engine_profile_free(cf_engine *e) {
    e->prof_on = 0;
    if (e->prof)
        for (int t = 0; t < e->n_threads; t++) free(e->prof[t].ev);
    free(e->prof);
    free(e->prof_calls);
    e->prof = NULL;
    e->prof_calls = NULL;
    e->prof_cap = e->prof_calls_cap = e->prof_ncalls = 0;
    e->prof_dropped_calls = 0;
}

int cf_engine_profile_start(cf_engine *e, int calls) {
    cf_engine_profile_free(e);
    if (calls < 1) calls = 1;
    int64_t cap = (int64_t)calls * cf_engine_profile_events_per_call(e);
    if (cap > INT_MAX) cap = INT_MAX;
    size_t sz = (size_t)e->n_threads * sizeof(cf_prof_thread);
    e->prof = aligned_alloc(64, (sz + 63) & ~(size_t)63);
    e->prof_calls = calloc((size_t)calls, sizeof(cf_prof_call));
    if (!e->prof || !e->prof_calls) {
        free(e->prof);
        e->prof = NULL;
        cf_engine_profile_free(e);
        return -1;
    }
    memset(e->prof, 0, sz);
    int fail = 0;
    for (int t = 0; t < e->n_threads; t++) {
        e->prof[t].kind = -1;
        /* touched now, so the first events do not fault pages in on the token path */
        e->prof[t].ev = calloc((size_t)cap, sizeof(cf_prof_event));
        if (!e->prof[t].ev) fail = 1;
        else memset(e->prof[t].ev, 0, (size_t)cap * sizeof(cf_prof_event));
    }
    if (fail) {
        cf_engine_profile_free(e);
        return -1;
    }
    e->prof_cap = (int)cap;
    e->prof_calls_cap = calls;
    e->prof_on = 1;
    return 0;
}

void cf_engine_profile_stop(cf_engine *e) { e->prof_on = 0; }
int cf_engine_profiling(const cf_engine *e) { return e->prof_on; }
int cf_engine_profile_events(const cf_engine *e, int ith, const cf_prof_event **out) {
    *out = NULL;
    if (!e->prof || ith < 0 || ith >= e->n_threads) return 0;
    *out = e->prof[ith].ev;
    return e->prof[ith].n;
}
int cf_engine_profile_calls(const cf_engine *e, const cf_prof_call **out) {
    *out = e->prof_calls;
    return e->prof_ncalls;
}
int64_t cf_engine_profile_dropped(const cf_engine *e) {
    int64_t n = e->prof_dropped_calls;
    if (e->prof)
        for (int t = 0; t < e->n_threads; t++) n += e->prof[t].dropped;
    return n;
}

// ---------------------------------------------------------------------------------------------
// names: the one definition of each contract with Python (engine.h), exported by bind_engine.cpp

const char *const cf_desc_field_names[CF_DESC_FIELDS] = {
    [CF_DESC_OFFSET] = "offset", [CF_DESC_DTYPE] = "dtype", [CF_DESC_ROWS] = "rows",
    [CF_DESC_COLS] = "cols", [CF_DESC_TR] = "tile_rows", [CF_DESC_TC] = "tile_cols",
};
const char *const cf_global_names[CF_T_GLOBAL] = {
    [CF_T_TOK_EMB] = "tok_emb", [CF_T_NORM] = "norm", [CF_T_LM_HEAD] = "lm_head",
};
const char *const cf_slot_names[CF_SLOTS_PER_SET] = {
    [CF_S_ATTN_NORM] = "attn_norm", [CF_S_WQKV] = "attn.wqkv", [CF_S_WO] = "attn.wo",
    [CF_S_FFN_NORM] = "ffn_norm", [CF_S_GATE_UP] = "ffn.w_gate_up", [CF_S_DOWN] = "ffn.w_down",
    [CF_S_MOE_NORM] = "moe_norm", [CF_S_ROUTER] = "moe.router", [CF_S_QKV_BIAS] = "attn.qkv_bias",
    [CF_S_Q_NORM] = "attn.q_norm", [CF_S_K_NORM] = "attn.k_norm", [CF_S_WQ] = "attn.wq", [CF_S_WK] = "attn.wk",
    [CF_S_WV] = "attn.wv", [CF_S_SHEXP_GATE] = "moe.shared_gate", [CF_S_SHEXP_GATE_UP] = "moe.shared.w_gate_up",
    [CF_S_SHEXP_DOWN] = "moe.shared.w_down",
};
const char *const cf_expert_slot_names[CF_EXPERT_SLOTS] = {
    [CF_E_GATE_UP] = "w_gate_up", [CF_E_DOWN] = "w_down",
};
const char *const cf_op_kind_names[CF_OP_KINDS] = {
    [CF_OP_EMBED] = "embed", [CF_OP_ATTN] = "attn", [CF_OP_DENSE] = "dense",
    [CF_OP_ROUTE] = "route", [CF_OP_EXPERTS] = "experts", [CF_OP_RESID] = "resid",
    [CF_OP_FINAL] = "final",
};
const char *const cf_prof_kind_names[CF_PROF_KINDS] = {
    [CF_PK_SETUP] = "setup", [CF_PK_EMBED] = "embed", [CF_PK_NORM] = "norm", [CF_PK_QKV] = "attn.qkv",
    [CF_PK_ATTN] = "attn.cache", [CF_PK_WO] = "attn.wo", [CF_PK_DENSE_GATE_UP] = "dense.gate_up",
    [CF_PK_DENSE_DOWN] = "dense.down", [CF_PK_ROUTE] = "route", [CF_PK_EXP_GATE_UP] = "experts.gate_up",
    [CF_PK_EXP_DOWN] = "experts.down", [CF_PK_EXP_IO] = "experts.io", [CF_PK_RESID] = "resid",
    [CF_PK_LM_HEAD] = "lm_head", [CF_PK_WAIT] = "wait",
};
const char *const cf_src_names[CF_SRC_KINDS] = {
    [CF_SRC_H] = "h", [CF_SRC_RING] = "ring", [CF_SRC_HF] = "hf",
};
const char *const cf_counter_names[CF_COUNTERS] = {
    [CF_CNT_ATTN] = "attn", [CF_CNT_DENSE] = "dense", [CF_CNT_ROUTER] = "router",
    [CF_CNT_EXPERTS] = "experts", [CF_CNT_EMBED] = "embed", [CF_CNT_LM_HEAD] = "lm_head",
    [CF_CNT_KV] = "kv", [CF_CNT_TOKENS] = "tokens", [CF_CNT_CALLS] = "calls",
    [CF_CNT_DISK_BYTES] = "disk_bytes", [CF_CNT_CACHE_HITS] = "cache_hits",
    [CF_CNT_CACHE_MISSES] = "cache_misses", [CF_CNT_IO_STALL_NS] = "io_stall_ns",
    [CF_CNT_PREDICTED] = "expert_predicted", [CF_CNT_PREDICT_HITS] = "expert_predict_hits",
    [CF_CNT_PREFETCH_READS] = "prefetch_reads", [CF_CNT_PREFETCH_USED] = "prefetch_used",
};

int cf_desc_name(int n_experts, int row, char *out, size_t n) {
    if (row < CF_T_GLOBAL) return snprintf(out, n, "%s", cf_global_names[row]);
    int per_set = CF_SLOTS_PER_SET + CF_EXPERT_SLOTS * n_experts;
    int set = (row - CF_T_GLOBAL) / per_set, slot = (row - CF_T_GLOBAL) % per_set;
    if (slot < CF_SLOTS_PER_SET) return snprintf(out, n, "layers.%d.%s", set, cf_slot_names[slot]);
    slot -= CF_SLOTS_PER_SET;
    return snprintf(out, n, "layers.%d.moe.experts.%d.%s", set, slot / CF_EXPERT_SLOTS,
                    cf_expert_slot_names[slot % CF_EXPERT_SLOTS]);
}

// ---------------------------------------------------------------------------------------------
// construction: validate the config, the tensor table and the plan, then allocate everything

static int check_config(const cf_config *c, char *err, size_t n) {
    const char *bad = NULL;
    if (c->vocab <= 0 || c->d <= 0 || c->n_layers <= 0 || c->n_heads <= 0 || c->n_kv <= 0)
        bad = "sizes must be positive";
    else if (c->hd <= 0 || c->hd % 2)
        bad = "head_dim must be positive and even";
    else if (c->n_heads % c->n_kv)
        bad = "n_heads must be a multiple of n_kv_heads";
    else if (c->d % CF_QK || (c->n_heads * c->hd) % CF_QK)
        bad = "d_model and n_heads*head_dim must be multiples of 32 (the block size)";
    else if (c->d_ff < 0 || c->d_ff % CF_QK)
        bad = "d_ff must be a multiple of 32 (it is the input width of w_down)";
    else if (c->n_experts < 0 || c->n_experts > 4096)
        bad = "n_experts must be in 0..4096";
    else if (c->n_experts && (c->top_k < 1 || c->top_k > c->n_experts || c->top_k > 64))
        bad = "top_k must be in 1..min(n_experts, 64)";
    else if (c->n_experts && (c->d_exp <= 0 || c->d_exp % CF_QK))
        bad = "d_expert must be a positive multiple of 32";
    else if (c->n_unique < 1 || c->n_unique > c->n_layers)
        bad = "n_unique_layers must be in 1..n_layers";
    else if (!(c->norm_eps > 0) || !(c->rope_theta > 0))
        bad = "norm_eps and rope_theta must be positive";
    else if ((c->qkv_bias | c->qk_norm | c->moe_norm_topk) & ~1 || c->sliding_window < 0)
        bad = "qkv_bias, qk_norm and moe_norm_topk must be 0 or 1, sliding_window >= 0";
    else if (c->qk_norm_full & ~1 || (c->qk_norm_full && (!c->qk_norm || c->qkv_bias)))
        bad = "qk_norm_full must be 0 or 1, needs qk_norm, and does not go with qkv_bias";
    else if (c->d_shexp < 0 || c->d_shexp % CF_QK || (c->d_shexp && !c->n_experts))
        bad = "d_shared_expert must be a multiple of 32, and needs experts";
    if (bad) cf_set_err(err, n, "bad model config: %s", bad);
    return bad ? -1 : 0;
}

/* Fill one tensor from descriptor row i, checking shape, dtype, layout and bounds. */
static int bind_tensor(const int64_t *desc, int n_experts, int i, int rows, int cols, int want_f32,
                       const uint8_t *buf, size_t buf_len, cf_tiled *t, const float **f32,
                       char *err, size_t n) {
    const int64_t *row = desc + (size_t)i * CF_DESC_FIELDS;
    int64_t off = row[CF_DESC_OFFSET], dt = row[CF_DESC_DTYPE];
    char what[96];
    cf_desc_name(n_experts, i, what, sizeof what);
    if (dt < 0) {
        cf_set_err(err, n, "tensor %s is missing from the file; re-convert the model", what);
        return -1;
    }
    if (row[CF_DESC_ROWS] != rows || row[CF_DESC_COLS] != cols) {
        cf_set_err(err, n, "tensor %s has shape [%lld, %lld], the config needs [%d, %d]", what,
                (long long)row[CF_DESC_ROWS], (long long)row[CF_DESC_COLS], rows, cols);
        return -1;
    }
    size_t nbytes;
    if (want_f32) {
        if (dt != CF_F32) {
            cf_set_err(err, n, "tensor %s must be F32 (dtype id 0), got dtype id %lld", what, (long long)dt);
            return -1;
        }
        nbytes = (size_t)rows * cols * 4;
    } else {
        int64_t tr = row[CF_DESC_TR], tc = row[CF_DESC_TC];
        if (dt <= CF_F16 || dt >= CF_DTYPE_IDS || !cf_dtype_names[dt]) {
            cf_set_err(err, n, "tensor %s has dtype id %lld; the engine runs Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
                    "Q4_K, Q5_K or Q6_K matrices (re-convert the model)", what, (long long)dt);
            return -1;
        }
        int qb = cf_block_weights((int)dt); /* a tile holds whole blocks */
        if (tr <= 0 || tr % CF_G || tr > 1 << 20 || tc <= 0 || tc % qb || tc > 1 << 20 || cols % qb) {
            cf_set_err(err, n, "tensor %s (%s) has tile %lldx%lld; tile rows must be a multiple of %d and "
                    "tile columns and matrix columns multiples of %d", what, cf_dtype_names[dt], (long long)tr,
                    (long long)tc, CF_G, qb);
            return -1;
        }
        nbytes = (size_t)rows * (cols / qb) * cf_block_bytes((int)dt);
        *t = (cf_tiled){.dtype = (int)dt, .rows = rows, .cols = cols, .tile_rows = (int)tr, .tile_cols = (int)tc};
    }
    if (off < 0 || (uint64_t)off > buf_len || nbytes > buf_len - (size_t)off || (want_f32 && off % 4)) {
        cf_set_err(err, n, "tensor %s (offset %lld, %zu bytes) lies outside the %zu-byte file or is "
                "misaligned; the file is truncated or corrupt", what, (long long)off, nbytes, buf_len);
        return -1;
    }
    if (want_f32) *f32 = (const float *)(buf + off);
    else t->data = buf + off;
    return 0;
}

/* Check that the caller named every descriptor row as we do (a cflow built against other tables
 * would otherwise bind, say, ffn_norm as attn_norm: same shape, no other error), then fill every
 * tensor from its row. */
static int bind_weights(cf_engine *e, const uint8_t *buf, size_t len, const int64_t *desc,
                        const char *const *names, int n_desc, char *err, size_t n) {
    const cf_config *c = &e->c;
    int E = c->n_experts, q_dim = c->n_heads * c->hd, kv_dim = c->n_kv * c->hd;
    if (n_desc != cf_desc_count(E, c->n_unique)) {
        cf_set_err(err, n, "tensor table has %d rows, the config needs %d", n_desc, cf_desc_count(E, c->n_unique));
        return -1;
    }
    char name[96];
    for (int i = 0; i < n_desc; i++) {
        cf_desc_name(E, i, name, sizeof name);
        if (strcmp(names[i], name) != 0) {
            cf_set_err(err, n, "descriptor row %d is named '%s', the engine expects '%s' there (cflow "
                    "and its compiled core disagree; rebuild with `pip install -e .`)", i, names[i], name);
            return -1;
        }
    }
#define BIND(i, r, k, f32, t, fp) \
    if (bind_tensor(desc, E, i, r, k, f32, buf, len, t, fp, err, n)) return -1
    cf_tiled dummy;
    const float *fdummy;
    BIND(CF_T_TOK_EMB, c->vocab, c->d, 0, &e->w.tok_emb, &fdummy);
    BIND(CF_T_NORM, 1, c->d, 1, &dummy, &e->w.norm);
    if (c->tie_embeddings) e->w.lm_head = e->w.tok_emb;
    else BIND(CF_T_LM_HEAD, c->vocab, c->d, 0, &e->w.lm_head, &fdummy);
    e->w.sets = calloc(c->n_unique, sizeof *e->w.sets);
    if (!e->w.sets) return cf_set_err(err, n, "out of memory"), -1;
    const uint64_t norm_bytes = (uint64_t)c->d * sizeof(float);
    for (int i = 0; i < c->n_unique; i++) {
        cf_layer *L = &e->w.sets[i];
#define SET(slot, r, k, f32, t, fp) BIND(cf_desc_index(E, i, slot), r, k, f32, t, fp)
        SET(CF_S_ATTN_NORM, 1, c->d, 1, &dummy, &L->attn_norm);
        /* q|k|v fused, or its three parts when the file stores them apart (cflow.weights) */
        L->qkv_split = desc[(size_t)cf_desc_index(E, i, CF_S_WQKV) * CF_DESC_FIELDS + CF_DESC_DTYPE] < 0 &&
                       desc[(size_t)cf_desc_index(E, i, CF_S_WQ) * CF_DESC_FIELDS + CF_DESC_DTYPE] >= 0;
        if (L->qkv_split) {
            if (q_dim % CF_G || kv_dim % CF_G)
                return cf_set_err(err, n, "weight set %d stores q, k, v apart, which needs q_dim and kv_dim "
                                  "multiples of %d (got %d, %d)", i, CF_G, q_dim, kv_dim), -1;
            SET(CF_S_WQ, q_dim, c->d, 0, &L->wq, &fdummy);
            SET(CF_S_WK, kv_dim, c->d, 0, &L->wk, &fdummy);
            SET(CF_S_WV, kv_dim, c->d, 0, &L->wv, &fdummy);
            L->qkv_fmt = act_fmt(&L->wq) | act_fmt(&L->wk) | act_fmt(&L->wv);
        } else {
            SET(CF_S_WQKV, q_dim + 2 * kv_dim, c->d, 0, &L->wqkv, &fdummy);
            L->qkv_fmt = act_fmt(&L->wqkv);
        }
        SET(CF_S_WO, c->d, q_dim, 0, &L->wo, &fdummy);
        /* the counters count every weight byte a node reads, its f32 norms and bias included
         * (cflow.weights) */
        L->attn_bytes = norm_bytes + cf_tiled_bytes(&L->wo) +
                        (L->qkv_split ? cf_tiled_bytes(&L->wq) + cf_tiled_bytes(&L->wk) + cf_tiled_bytes(&L->wv)
                                      : cf_tiled_bytes(&L->wqkv));
        if (c->qkv_bias) {
            SET(CF_S_QKV_BIAS, 1, q_dim + 2 * kv_dim, 1, &dummy, &L->qkv_bias);
            L->attn_bytes += (uint64_t)(q_dim + 2 * kv_dim) * sizeof(float);
        }
        if (c->qk_norm) { /* per head [hd], or over the whole q [q_dim] and k [kv_dim] (qk_norm_full) */
            int qn = c->qk_norm_full ? q_dim : c->hd, kn = c->qk_norm_full ? kv_dim : c->hd;
            SET(CF_S_Q_NORM, 1, qn, 1, &dummy, &L->q_norm);
            SET(CF_S_K_NORM, 1, kn, 1, &dummy, &L->k_norm);
            L->attn_bytes += (uint64_t)(qn + kn) * sizeof(float);
        }
        if (c->d_ff) {
            SET(CF_S_FFN_NORM, 1, c->d, 1, &dummy, &L->ffn_norm);
            SET(CF_S_GATE_UP, 2 * c->d_ff, c->d, 0, &L->gate_up, &fdummy);
            SET(CF_S_DOWN, c->d, c->d_ff, 0, &L->down, &fdummy);
            L->dense_bytes = norm_bytes + cf_tiled_bytes(&L->gate_up) + cf_tiled_bytes(&L->down);
        }
        if (!E) continue;
        SET(CF_S_MOE_NORM, 1, c->d, 1, &dummy, &L->moe_norm);
        SET(CF_S_ROUTER, E, c->d, 1, &dummy, &L->router);
        L->router_bytes = norm_bytes + (uint64_t)E * c->d * 4;
        if (c->d_shexp) {
            SET(CF_S_SHEXP_GATE, 1, c->d, 1, &dummy, &L->shexp_gate);
            SET(CF_S_SHEXP_GATE_UP, 2 * c->d_shexp, c->d, 0, &L->shexp_gate_up, &fdummy);
            SET(CF_S_SHEXP_DOWN, c->d, c->d_shexp, 0, &L->shexp_down, &fdummy);
            L->router_bytes += norm_bytes; /* the route computes the shared expert's weight */
            L->shexp_bytes = cf_tiled_bytes(&L->shexp_gate_up) + cf_tiled_bytes(&L->shexp_down);
            L->exp_fmt |= act_fmt(&L->shexp_gate_up);
        }
        L->exp_gate_up = calloc(E, sizeof(cf_tiled));
        L->exp_down = calloc(E, sizeof(cf_tiled));
        L->exp_bytes = calloc(E, sizeof(uint64_t));
        if (!L->exp_gate_up || !L->exp_down || !L->exp_bytes) return cf_set_err(err, n, "out of memory"), -1;
        for (int x = 0; x < E; x++) {
            int s0 = CF_SLOTS_PER_SET + CF_EXPERT_SLOTS * x;
            SET(s0 + CF_E_GATE_UP, 2 * c->d_exp, c->d, 0, &L->exp_gate_up[x], &fdummy);
            SET(s0 + CF_E_DOWN, c->d, c->d_exp, 0, &L->exp_down[x], &fdummy);
            L->exp_bytes[x] = cf_tiled_bytes(&L->exp_gate_up[x]) + cf_tiled_bytes(&L->exp_down[x]);
            L->exp_fmt |= act_fmt(&L->exp_gate_up[x]);
        }
#undef SET
    }
#undef BIND
    return 0;
}

static int check_plan(const cf_engine *e, const int32_t *plan, int n_ops, char *err, size_t n) {
    const cf_config *c = &e->c;
    if (n_ops < 2 || plan[0] != CF_OP_EMBED || plan[(size_t)(n_ops - 1) * CF_OP_FIELDS] != CF_OP_FINAL)
        return cf_set_err(err, n, "plan must start with EMBED and end with FINAL"), -1;
    for (int i = 0; i < n_ops; i++) {
        const int32_t *op = plan + (size_t)i * CF_OP_FIELDS;
        int k = op[0], l = op[1], a = op[2], b = op[3], cc = op[4];
        int ring_ok = a >= 0 && a < e->n_ring, ok = 1;
        int pend_ok = a >= 0 && a < e->n_pending, moe_ok = b >= 0 && b < e->n_moe;
        if (k < 0 || k >= CF_OP_KINDS || l < 0 || l >= c->n_layers) ok = 0;
        else if (k == CF_OP_EMBED || k == CF_OP_ATTN) ok = ring_ok;
        else if (k == CF_OP_DENSE)
            ok = c->d_ff > 0 && (a == CF_SRC_H || (a == CF_SRC_RING && b >= 0 && b < e->n_ring));
        else if (k == CF_OP_ROUTE)
            ok = c->n_experts > 0 && (a == CF_SRC_H || (a == CF_SRC_HF && c->d_ff > 0)) && moe_ok;
        else if (k == CF_OP_EXPERTS)
            ok = c->n_experts > 0 && pend_ok && moe_ok;
        else if (k == CF_OP_RESID)
            ok = ring_ok && (b == 0 || (b == 1 && c->d_ff > 0)) && cc >= -1 && cc < e->n_pending;
        else if (k == CF_OP_FINAL)
            ok = ring_ok && b >= -1 && b < e->n_pending && i == n_ops - 1;
        if (!ok) {
            cf_set_err(err, n, "plan op %d {%d, %d, %d, %d, %d} is invalid for this model", i, k, l, a, b, cc);
            return -1;
        }
    }
    if (cf_plan_inflight(plan, n_ops, e->n_moe) < 0)
        return cf_set_err(err, n, "plan pairs its route and experts ops wrongly: each route(l) needs one "
                       "experts(l) on the same moe slot, with no other route into that slot between"), -1;
    return 0;
}

int cf_plan_inflight(const int32_t *plan, int n_ops, int n_moe) {
    int owner[64], live = 0, most = 0; /* owner[slot]: the layer whose routing the slot holds */
    if (n_moe < 1 || n_moe > 64) return -1;
    for (int m = 0; m < n_moe; m++) owner[m] = -1;
    for (int i = 0; i < n_ops; i++) {
        const int32_t *op = plan + (size_t)i * CF_OP_FIELDS;
        int l = op[1], b = op[3];
        if (op[0] != CF_OP_ROUTE && op[0] != CF_OP_EXPERTS) continue;
        if (b < 0 || b >= n_moe) return -1;
        if (op[0] == CF_OP_ROUTE) {
            if (owner[b] >= 0) return -1; /* would overwrite a routing whose experts have not run */
            owner[b] = l;
            most = cf_max(most, ++live);
        } else {
            if (owner[b] != l) return -1;
            owner[b] = -1;
            live--;
        }
    }
    return live ? -1 : most;
}

static void *xcalloc(size_t count, size_t size, int *fail) {
    void *p = calloc(count ? count : 1, size);
    if (!p) *fail = 1;
    return p;
}

/* A bump allocator over one per-thread block: each piece starts on its own cache line. */
static size_t carve_size(size_t n) { return (n + 63) & ~(size_t)63; }
static void *carve(uint8_t **m, size_t n) {
    void *p = *m;
    *m += carve_size(n);
    return p;
}

static int alloc_state(cf_engine *e) {
    const cf_config *c = &e->c;
    cf_state *s = &e->s;
    size_t B = e->max_batch, d = c->d, q_dim = (size_t)c->n_heads * c->hd, kv_dim = (size_t)c->n_kv * c->hd;
    size_t E = c->n_experts, M = e->n_moe;
    e->seq_kv = (size_t)c->n_layers * c->n_kv * e->n_ctx;
    size_t kv = e->seq_kv * e->n_seq; /* rows of each cache */
    int fail = 0;
    s->ring = xcalloc(e->n_ring * B * d, sizeof(float), &fail);
    s->h = xcalloc(B * d, sizeof(float), &fail);
    s->f = xcalloc(B * d, sizeof(float), &fail);
    s->pending = xcalloc(e->n_pending * B * d, sizeof(float), &fail);
    s->moe_in = xcalloc(M * B * d, sizeof(float), &fail);
    s->qkv = xcalloc(B * (q_dim + 2 * kv_dim), sizeof(float), &fail);
    s->att = xcalloc(B * q_dim, sizeof(float), &fail);
    s->hid = xcalloc(B * e->hmax, sizeof(float), &fail);
    s->y = xcalloc(B * d, sizeof(float), &fail);
    s->rope = xcalloc(B * c->hd, sizeof(float), &fail);
    // calloc'd pages are mapped lazily, so a long context costs memory only once it is used
    s->kcache = xcalloc(kv, e->krow, &fail);
    s->vcache = xcalloc(kv, e->vrow, &fail);
    s->rlogits = xcalloc(B * E, sizeof(float), &fail);
    s->exp_tok = xcalloc(M * E * B, sizeof(int), &fail);
    s->exp_w = xcalloc(M * E * B, sizeof(float), &fail);
    s->shexp_w = xcalloc(M * B, sizeof(float), &fail);
    s->exp_n = xcalloc(M * E, sizeof(int), &fail);
    s->exp_list = xcalloc(M * E, sizeof(int), &fail);
    s->exp_cnt = xcalloc(M, sizeof(int), &fail);
    s->exp_pre = xcalloc(M, sizeof(int), &fail);
    s->exp_slot = xcalloc(M * E, sizeof(int), &fail);
    e->hits = xcalloc((size_t)c->n_layers * E, sizeof(uint64_t), &fail);
    e->rseq = xcalloc(B, sizeof(int), &fail);
    e->rpos = xcalloc(B, sizeof(int), &fail);
    e->seen = xcalloc(e->n_seq, sizeof(int), &fail);
    e->lrow = xcalloc(B, sizeof(int), &fail);
    e->ablk = xcalloc(2 * B, sizeof(int), &fail);
    e->arow = xcalloc(B, sizeof(int), &fail);
    e->ones = xcalloc(B, 1, &fail);
    e->ts = xcalloc(e->n_threads, sizeof(cf_scratch), &fail);
    if (fail) return -1;
    memset(e->ones, 1, B);
    size_t K = e->kmax, KB = K / CF_QK, KK = (K + CF_QK_K - 1) / CF_QK_K, KS = (K / 16 * 2 + 3) / 4 * 4;
    /* one row more than a call's tokens: op_final sums each row's input there */
    size_t xb = (size_t)(e->max_batch + 1) * K * 4;
    /* per activation: d, s (32-block); dk, bsums (256-block); qs; qk */
    size_t scores = (size_t)attn_score_rows(e) * e->n_ctx * 4, act = 2 * KB * 4 + KK * 4 + KS + 2 * K;
    size_t bytes = 64 + carve_size(3 * B * sizeof(cf_act_q8)) + carve_size(xb) + carve_size(scores) +
                   2 * B * carve_size(act);
    for (int t = 0; t < e->n_threads; t++) {
        cf_scratch *ts = &e->ts[t];
        uint8_t *m = ts->mem = xcalloc(bytes, 1, &fail);
        if (fail) return -1;
        m = (uint8_t *)(((uintptr_t)m + 63) & ~(uintptr_t)63);
        cf_act_q8 *acts = carve(&m, 3 * B * sizeof(cf_act_q8));
        ts->act = acts;
        ts->act2 = acts + B;
        ts->gather = acts + 2 * B;
        ts->xb = carve(&m, xb);
        ts->scores = carve(&m, scores);
        for (size_t i = 0; i < 2 * B; i++) {
            uint8_t *a = carve(&m, act);
            uint8_t *k = a + 2 * KB * 4; /* the 256-block fields */
            acts[i] = (cf_act_q8){.d = (float *)a, .s = (float *)(a + KB * 4), .dk = (float *)k,
                                  .bsums = (int16_t *)(k + KK * 4), .qs = (int8_t *)(k + KK * 4 + KS),
                                  .qk = (int8_t *)(k + KK * 4 + KS + K), .n = (int)K};
        }
    }
    return 0;
}

/* Experts on disk: check that each expert's span (the file's expert table) holds its two tensors,
 * keep their offsets inside the span, and open the cache (experts.h). */
static int open_disk_experts(cf_engine *e, const cf_disk_experts *dx, char *err, size_t n) {
    const cf_config *c = &e->c;
    int E = c->n_experts, n_keys = c->n_unique * E;
    if (!E) return cf_set_err(err, n, "this model has no experts; there is nothing to keep on disk"), -1;
    e->xrel = calloc((size_t)n_keys * 2, sizeof *e->xrel);
    e->xwave = calloc(E, sizeof *e->xwave);
    int64_t *off = malloc(sizeof(int64_t) * n_keys), *len = malloc(sizeof(int64_t) * n_keys);
    if (!e->xrel || !e->xwave || !off || !len) {
        free(off);
        free(len);
        return cf_set_err(err, n, "out of memory"), -1;
    }
    int bad = -1;
    for (int k = 0; k < n_keys && bad < 0; k++) {
        const cf_layer *L = &e->w.sets[k / E];
        const cf_tiled *t[2] = {&L->exp_gate_up[k % E], &L->exp_down[k % E]};
        off[k] = dx->span[2 * k];
        len[k] = dx->span[2 * k + 1];
        for (int j = 0; j < 2; j++) {
            int64_t at = (int64_t)(t[j]->data - e->buf);
            e->xrel[2 * k + j] = at - off[k];
            if (at < off[k] || at + (int64_t)cf_tiled_bytes(t[j]) > off[k] + len[k]) bad = k;
        }
    }
    if (bad >= 0) {
        cf_set_err(err, n, "the expert table says expert %d of layer %d spans %lld bytes at offset %lld, which do "
                "not hold its tensors; the file is inconsistent: re-convert it", bad % E, bad / E,
                (long long)len[bad], (long long)off[bad]);
    } else {
        cf_xstore_opts o = {.path = dx->path, .n_keys = n_keys, .n_experts = E, .offset = off, .nbytes = len,
                            .budget = dx->budget, .min_slots = c->top_k * e->inflight, .async = dx->async,
                            .n_io = dx->n_io, .direct = dx->direct, .reader = dx->reader};
        e->xs = cf_xstore_open(&o, err, n);
        e->xasync = dx->async ? 1 : 0;
    }
    free(off);
    free(len);
    if (!e->xs) return -1;
    cf_xstore_info xi;
    cf_xstore_get_info(e->xs, &xi);
    /* speculation needs reads that run beside compute, and slots beyond the plan's own */
    if (dx->speculate > 0 && e->xasync && xi.n_slots > c->top_k * e->inflight) {
        e->spec_room = xi.n_slots - c->top_k * e->inflight;
        e->spec_slot = calloc((size_t)e->spec_room, sizeof *e->spec_slot);
        e->spec_for = calloc((size_t)e->spec_room, sizeof *e->spec_for);
        e->pred_mark = calloc((size_t)c->n_layers * E, sizeof *e->pred_mark);
        e->pred_votes = calloc((size_t)E, sizeof *e->pred_votes);
        if (!e->spec_slot || !e->spec_for || !e->pred_mark || !e->pred_votes)
            return cf_set_err(err, n, "out of memory"), -1;
        e->xspec = cf_min(dx->speculate, CF_SPEC_MAX_DEPTH);
        const char *mp = getenv("CFLOW_SPEC_MIN_PRECISION"); /* 0: every distance reads; > 1: only the next layer */
        e->spec_min_precision = mp && *mp ? atof(mp) : SPEC_MIN_PRECISION;
        e->spec_horizon = -1;
        const char *kp = getenv("CFLOW_EXPERT_KEEP"); /* 0: the policy without keep ranks */
        e->xkeep = !(kp && *kp == '0');
        e->keep_depth = -1;
    }
    return 0;
}

cf_engine *cf_engine_create(const cf_config *cfg, const uint8_t *buf, size_t buf_len,
                            const int64_t *desc, const char *const *names, int n_desc,
                            const int32_t *plan, int n_ops,
                            int n_ring, int n_pending, int n_moe, int n_threads, int n_ctx,
                            int max_batch, int n_seq, int k_type, int v_type, const cf_disk_experts *disk,
                            char *err, size_t err_len) {
    if (check_config(cfg, err, err_len)) return NULL;
    for (int i = 0; i < 2; i++) {
        int type = i ? v_type : k_type;
        const char *which = i ? "cache_type_v" : "cache_type_k";
        if (type != CF_F16 && type != CF_Q8_0) {
            cf_set_err(err, err_len, "%s: cache type id %d is not one of %d (f16), %d (q8_0)", which, type, CF_F16,
                       CF_Q8_0);
            return NULL;
        }
        if (type == CF_Q8_0 && cfg->hd % CF_QK) {
            cf_set_err(err, err_len, "%s q8_0 stores rows in blocks of %d values, and this model's head_dim is %d; "
                       "use f16", which, CF_QK, cfg->hd);
            return NULL;
        }
    }
    if (n_threads < 1 || n_threads > CF_MAX_THREADS || n_ctx < 1 || max_batch < 1 || max_batch > 4096 ||
        n_ring < 1 || n_ring > 64 || n_pending < 0 || n_pending > 64 || n_moe < 1 || n_moe > 64 ||
        n_seq < 1 || n_seq > CF_MAX_SEQ) {
        cf_set_err(err, err_len, "bad engine sizes: threads %d, n_ctx %d, max_batch %d, ring %d, "
                "pending %d, moe slots %d, sequences %d (1..%d)", n_threads, n_ctx, max_batch, n_ring,
                n_pending, n_moe, n_seq, CF_MAX_SEQ);
        return NULL;
    }
    cf_engine *e = calloc(1, sizeof *e);
    if (!e) return cf_set_err(err, err_len, "out of memory"), NULL;
    e->c = *cfg;
    e->k = cf_kernels();
    // every entry of the table: it holds exactly what the engine calls (cflow.h)
    int dts[] = {CF_Q4_0, CF_Q4_1, CF_Q5_0, CF_Q5_1, CF_Q8_0, CF_Q4_K, CF_Q5_K, CF_Q6_K};
    int missing = !e->k->quantize_act || !e->k->quantize_act_k || !e->k->rmsnorm ||
        !e->k->matvec_f32 || !e->k->softmax || !e->k->rope || !e->k->attention || !e->k->attention_block ||
        !e->k->embed_row || !e->k->f32_to_f16 || !e->k->topk || !e->k->attention_q8kv ||
        !e->k->attention_block_q8kv || !e->k->f32_to_q8_0;
    for (int i = 0; i < (int)(sizeof dts / sizeof *dts); i++)
        missing |= !e->k->matvec[dts[i]] || !e->k->gate_up[dts[i]] || !e->k->matmat[dts[i]] ||
                    !e->k->gate_up_mm[dts[i]];
    if (missing) {
        cf_set_err(err, err_len, "kernel table '%s' lacks kernels the engine needs", e->k->name);
        free(e);
        return NULL;
    }
    e->n_threads = n_threads;
    e->n_ctx = n_ctx;
    e->max_batch = max_batch;
    e->n_seq = n_seq;
    e->k_type = k_type;
    e->v_type = v_type;
    e->krow = cf_kv_row_bytes(k_type, cfg->hd);
    e->vrow = cf_kv_row_bytes(v_type, cfg->hd);
    e->n_ring = n_ring;
    e->n_pending = n_pending;
    e->n_moe = n_moe;
    e->buf = buf;
    e->n_ops = n_ops;
    e->hmax = cf_max(cfg->d_ff, cfg->n_experts ? cf_max(cfg->d_exp, cfg->d_shexp) : 0);
    e->kmax = cf_max(cf_max(cfg->d, cfg->n_heads * cfg->hd), e->hmax);
    e->bar.n = e->active = n_threads;
    e->prefetch = CF_PREFETCH_DEFAULT;
    if (bind_weights(e, buf, buf_len, desc, names, n_desc, err, err_len) ||
        check_plan(e, plan, n_ops, err, err_len)) {
        cf_engine_free(e);
        return NULL;
    }
    e->inflight = cf_plan_inflight(plan, n_ops, n_moe);
    if (disk && open_disk_experts(e, disk, err, err_len)) {
        cf_engine_free(e);
        return NULL;
    }
    e->plan = malloc((size_t)n_ops * CF_OP_FIELDS * sizeof *plan);
    if (!e->plan || alloc_state(e) || !(e->pool = cf_pool_create(n_threads))) {
        cf_set_err(err, err_len, "out of memory (KV cache for %d sequence(s) of n_ctx=%d needs %.1f MiB; try a "
                "smaller context)", n_seq, n_ctx,
                (double)cfg->n_layers * cfg->n_kv * n_ctx * (e->krow + e->vrow) * n_seq / 1048576.0);
        cf_engine_free(e);
        return NULL;
    }
    memcpy(e->plan, plan, (size_t)n_ops * CF_OP_FIELDS * sizeof *plan);
    return e;
}

void cf_engine_free(cf_engine *e) {
    if (!e) return;
    if (e->pool) cf_pool_free(e->pool);
    cf_engine_profile_free(e);
    cf_xstore_free(e->xs); /* joins its readers: nothing writes into our memory after this */
    free(e->xrel);
    free(e->xwave);
    free(e->spec_slot);
    free(e->spec_for);
    free(e->pred_mark);
    free(e->pred_votes);
    free(e->grp);
    if (e->w.sets) {
        for (int i = 0; i < e->c.n_unique; i++) {
            free(e->w.sets[i].exp_gate_up);
            free(e->w.sets[i].exp_down);
            free(e->w.sets[i].exp_bytes);
        }
        free(e->w.sets);
    }
    cf_state *s = &e->s;
    void *bufs[] = {s->ring, s->h, s->f, s->pending, s->moe_in, s->qkv, s->att, s->hid, s->y,
                    s->rope, s->kcache, s->vcache, s->rlogits, s->exp_tok, s->exp_w, s->exp_n,
                    s->shexp_w, s->exp_list, s->exp_cnt, s->exp_pre, s->exp_slot, e->hits, e->plan,
                    e->rseq, e->rpos, e->seen, e->lrow, e->ablk, e->arow, e->ones};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
    if (e->ts)
        for (int t = 0; t < e->n_threads; t++) free(e->ts[t].mem);
    free(e->ts);
    free(e);
}
