/* engine_internal.h — the engine's structs and the calls between its files (not an API).
 *
 * The engine is one object in four files: engine.c (the per-token interpreter: the ops, overlap,
 * the calls), engine_spec.c (the route's side of experts on disk: cache slots, waves, expert
 * speculation), engine_profile.c (the profiler) and engine_build.c (validation, binding the
 * weights, allocation, the accessors and the contract names). Everything here is shared by them;
 * nothing outside the engine includes it.
 */
#ifndef CF_ENGINE_INTERNAL_H
#define CF_ENGINE_INTERNAL_H

#include <time.h>

#include "deltanet.h"
#include "engine.h"
#include "experts.h"

// ---------------------------------------------------------------------------------------------
// weights, state

typedef struct {
    const float *attn_norm, *ffn_norm, *moe_norm; /* [d] */
    const float *router;                          /* [E, d] row-major */
    const float *qkv_bias;                        /* [q_dim + 2 kv_dim] or NULL */
    const float *q_norm, *k_norm;                 /* [hd] or NULL */
    const float *attn_post_norm, *ffn_post_norm;  /* [d] or NULL (post_norms) */
    const float *wo_bias;                         /* [d] or NULL (attn_out_bias) */
    const float *sinks;                           /* [n_heads] or NULL (attn_sinks) */
    const float *router_bias;                     /* [E] or NULL (moe_bias: on the logits; moe_router_bias:
                                                   * added to the scores to choose) */
    cf_tiled wqkv;                                /* [q_dim + 2 kv_dim, d] */
    cf_tiled wq, wk, wv;                          /* its three parts, when stored apart (qkv_split) */
    int qkv_split;                                /* 1: q, k, v are three matrices (their dtypes differ) */
    int qkv_fmt, exp_fmt;                         /* activation formats the projection / experts read */
    cf_tiled wo;                                  /* [d, q_dim] */
    cf_tiled gate_up;                             /* [2 d_ff, d], gate/up interleaved per group */
    cf_tiled down;                                /* [d, d_ff] */
    cf_tiled *exp_gate_up, *exp_down;             /* [E] of [2 d_exp, d] and [d, d_exp] */
    const float **exp_b_gate_up, **exp_b_down;    /* [E] of [2 d_exp] and [d], NULL without moe_bias;
                                                   * in RAM, pointers into the buffer (on disk: xrel) */
    const float *shexp_gate;                      /* [d] or NULL: the shared expert's gate */
    cf_tiled shexp_gate_up, shexp_down;           /* [2 d_shexp, d], [d, d_shexp]: always in RAM */
    /* latent attention (engine_mla.c); wq above is its plain query when there is no q_a */
    cf_tiled wq_a, wq_b, wkv_a;                   /* [q_lora, d], [H qk, q_lora], [kv_lora + rope, d] */
    cf_tiled wk_b, wv_b;                          /* [H kv_lora, qk - rope], [H v, kv_lora]: per head */
    const float *q_a_norm, *kv_a_norm;            /* [q_lora], [kv_lora] */
    /* Gemma 4: the per-layer-embedding block (ple_dim > 0) and the layer output scale */
    cf_tiled ple_gate, ple_proj;                  /* [P, d], [d, P] */
    const float *ple_post_norm, *out_scale;       /* [d], [1] or NULL */
    const float *router_norm, *expert_scale;      /* [d], [E] or NULL (Gemma 4's MoE) */
    const float *ffn_post_norm_1, *moe_post_norm; /* [d] or NULL (moe_out_norms) */
    uint64_t ple_bytes;                           /* counted as dense */
    cf_tiled w_gate;                              /* [q_dim, d] attention output gate (attn_gate) */
    /* a Gated DeltaNet layer (engine_deltanet.c) in place of attention: q|k|v conv input, z, out */
    cf_tiled ssm_qkv, ssm_z, ssm_out;             /* [conv_dim, d], [Hv dh, d], [d, Hv dh] */
    cf_tiled ssm_alpha, ssm_beta;                 /* [Hv, d] */
    cf_deltanet_layer dn;                         /* its sizes, conv, dt_bias, a, norm */
    uint64_t attn_bytes, dense_bytes, router_bytes, shexp_bytes;
    uint64_t *exp_bytes;                          /* [E] gate_up + down */
} cf_layer;

typedef struct {
    cf_tiled tok_emb;   /* [vocab, d] */
    cf_tiled lm_head;   /* [vocab, d]; a copy of tok_emb when tied */
    const float *norm;  /* [d] */
    cf_layer *sets;     /* [n_unique] */
    cf_tiled ple_emb, ple_proj; /* [vocab, L P], [L P, d] (ple_dim > 0) */
    const float *ple_norm;      /* [P] */
} cf_weights;

/* The shape of one layer (Gemma 4's differ; every other model's are all the same): its head size,
 * KV head count and dense FFN width, whether it owns K/V, whose cache it attends over, and where
 * that cache's rows lie: layer kv_src's K rows of sequence s start at kcache + s * seq_kbytes +
 * koff, one row krow bytes, [n_kv][n_ctx] of them (V alike). */
typedef struct {
    int hd, n_kv, d_ff, has_kv, kv_src;
    size_t koff, voff, krow, vrow;
} cf_layer_geo;

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
    float *rope_local; /* [B, hd] the same for local layers with a base of their own (rope_theta_local), or NULL */
    float *gu;         /* [B, 2 hmax] raw gate|up rows of a GeGLU (ffn_gelu) or of swiglu_oai experts, or NULL */
    /* Gemma 4's per-layer embeddings (ple_dim P > 0; NULL without): every layer's input of each
     * row, made by the EMBED op; the token's row of ple_emb; the PLE op's gate and gated rows */
    float *ple, *ple_tok;   /* [B, L P] each */
    float *ple_g, *ple_gu;  /* [B, P], [B, 2 P] (gelu's input interleaved with the layer's input) */
    float *ple_h;           /* [B, P] */
    float *ones;            /* [hd] 1.0: v_norm's unweighted RMSNorm */
    uint8_t *kcache;   /* [n_seq, L, n_kv, n_ctx] rows of krow bytes (fp16 or q8_0), rotated keys */
    uint8_t *vcache;   /* [n_seq, L, n_kv, n_ctx] rows of vrow bytes */
    float *mla_a;      /* [B, q_lora + kv_lora + rope] latent attention: the low-rank query, then latent | k_pe */
    float *mla_q;      /* [B, H qk] its query heads (nope | rope) */
    float *mla_o;      /* [B, H v] its heads' values (wo's input) */
    float *agate;      /* [B, q_dim] the attention output gate's logits (attn_gate), or NULL */
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

/* Expert speculation (engine_spec.c): predicted experts of later layers and the reads started for
 * them. Thread 0 only. */
typedef struct {
    int depth;           /* predict up to this many layers ahead; 0: off */
    int room;            /* slots speculation may occupy: n_slots - min_slots */
    int *slot;           /* [room] slots it pins, or whose read it started and is in flight */
    int *target;         /* [room] the layer a pinned slot was predicted for; -1: not pinned */
    int n;               /* entries of slot / target in use */
    int horizon;         /* the furthest layer predicted in this call; -1: none yet */
    uint16_t *mark;      /* [L, E] bit k-1: predicted at distance k for a layer not routed yet in this call */
    uint32_t dist_pred[CF_SPEC_MAX_DEPTH + 1], dist_hit[CF_SPEC_MAX_DEPTH + 1]; /* per distance, decayed */
    double min_precision; /* SPEC_MIN_PRECISION, or CFLOW_SPEC_MIN_PRECISION (tests, benchmarks) */
    int gate_next;        /* 1: the next layer's predictions pass the same gate; 0: always read (CFLOW_SPEC_GATE_NEXT=0) */
    int keep;            /* 1: rank the cache's layers by how much of a miss speculation can hide */
    int keep_depth;      /* the trusted depth the ranks were last set for; -1: not set yet */
    int *votes;          /* [E] rows whose prediction chose each expert */
} cf_spec;

/* A route trace being recorded or replayed (engine.h, cf_engine_set_routes). */
typedef struct {
    int mode;          /* CF_ROUTES_* */
    int32_t *chosen;   /* [n, L, top_k] */
    int32_t *pred;     /* [n, L, depth, top_k] */
    int64_t n;         /* rows of the trace */
    int depth;         /* predicted layers per route in pred */
    int64_t pos;       /* rows recorded or replayed before the call in flight */
} cf_routes;

struct cf_engine {
    cf_config c;
    cf_weights w;
    cf_state s;
    cf_scratch *ts; /* [n_threads] */
    int n_threads, n_ctx, max_batch, kmax, hmax;
    float attn_scale; /* what q.k is multiplied by: c.attn_scale, or 1/sqrt(hd) */
    int n_seq;      /* KV-cache slots: sequence s owns kcache/vcache[s] */
    size_t seq_kv;  /* cache rows per sequence slot: L * n_kv * n_ctx */
    int k_type, v_type; /* cache row types, CF_F16 or CF_Q8_0 (cflow.h, "The 8-bit KV cache") */
    size_t krow, vrow;  /* bytes of one K / V row: cf_kv_row_bytes(type, hd) */
    cf_layer_geo *geo;  /* [n_layers] each layer's shape and cache place */
    size_t seq_kbytes, seq_vbytes; /* one sequence's K / V cache */
    int hd_max;         /* the widest head of any layer */
    int kv_dim_max;     /* the widest K (or V) projection of any layer: n_kv * hd */
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
    /* the final normed hidden state of those rows, hidden row i for lrow[i] (cf_engine_hidden),
     * written only while keep_hidden is on; n_hidden rows valid (the last forward pass's) */
    float *hidden;      /* [max_batch, d] */
    int keep_hidden, n_hidden;
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
    int64_t *xrel;       /* [n_unique * E][CF_EXPERT_SLOTS] each expert tensor's offset inside the expert's span
                          * (the biases' only with moe_bias) */
    int *xwave;          /* [E] slots a wave must read (thread 0) */
    int wave_end;        /* published by thread 0 before a barrier (op_experts_disk) */
    cf_spec spec;        /* expert speculation (engine_spec.c); off when spec.depth is 0 */
    cf_routes routes;    /* route trace recorded or replayed (engine.h); mode 0: off */
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
    /* Gated DeltaNet layers (engine_deltanet.c; NULL / 0 without them) */
    float *dn_state;     /* [n_seq][dn_seq] each sequence's conv rows and S of every recurrent layer */
    size_t dn_seq;       /* floats per sequence */
    size_t *dn_off;      /* [L] layer l's offset inside a sequence's state */
    int *dn_pos;         /* [n_seq] the position each sequence's state continues from; -1: start over */
    float *dn_u, *dn_z, *dn_ab, *dn_o; /* [B, conv_dim], [B, Hv dh], [B, 2 Hv] (alpha | beta), [B, Hv dh] */
};

/* Activation formats (cflow.h cf_act_q8): the 32-block one most dtypes read, the 256-block one
 * of the K-quants. A vector is quantized once per format the matrices it feeds need. */
enum { ACT_Q8 = 1, ACT_Q8K = 2 };
static inline int act_fmt(const cf_tiled *w) { return cf_is_kquant(w->dtype) ? ACT_Q8K : ACT_Q8; }

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
 * same layer). Returns the timestamp. engine_profile.c. */
__attribute__((noinline, cold)) int64_t cf_prof_mark(cf_engine *e, int ith, int kind, int layer);
/* Open a segment on thread ith, discarding whatever a failed call left open. */
__attribute__((cold)) int64_t cf_prof_open(cf_engine *e, int ith, int kind, int layer);

/* A phase boundary: free when profiling is off (one branch on the flag). */
static inline void ph(cf_engine *e, int ith, int kind, int layer) {
    if (__builtin_expect(e->prof_on, 0)) cf_prof_mark(e, ith, kind, layer);
}

/* The barrier between phases; profiled as a CF_PK_WAIT segment, after which a segment of `next`
 * opens (-1: the next op opens its own). */
static inline void sync_threads(cf_engine *e, int ith, int next) {
    if (e->bar.n > 1) {
        ph(e, ith, CF_PK_WAIT, -1);
        cf_barrier_wait(&e->bar);
    }
    if (next >= 0) ph(e, ith, next, -1);
}

// ---------------------------------------------------------------------------------------------
// between the files

/* engine.c: rows of the per-thread attention score scratch (alloc_state sizes it). */
int cf_attn_score_rows(const cf_engine *e);
/* engine.c, for engine_mla.c: the pieces every attention shares. */
void cf_quantize_rows(const cf_engine *e, const float *x, int stride, int K, cf_act_q8 *act, const int *tok, int n,
                      int fmt);
void cf_matvec_rows(const cf_engine *e, const cf_tiled *w, const cf_act_q8 *act, float *y, int ystride,
                    const int *tok, int n, int g0, int g1);
int cf_d_split(int ng, int ith, int nth, int whole, int lo[2], int hi[2]);
/* d_split's `whole` for this call: a [d, *] mat-vec's leftover bands go out whole when decoding one
 * row (streaming; see engine.c, d_split); every d_split of a call must pass the same value. */
static inline int cf_split_whole_bands(const cf_engine *e) { return e->B == 1; }
int cf_attn_first(const cf_engine *e, int b, int l);
/* Query rows per work item of the block attention (engine.c's attn_plan blocks). */
#define ATTN_QBLOCK 16

/* engine_gemma4.c: Gemma 4's per-layer embeddings. The EMBED op's second half (after a barrier:
 * ring[slot] whole): every layer's per-layer input of each row into s->ple; ends without a barrier. */
void cf_ple_inputs(cf_engine *e, int slot, int ith, int nth);
/* The PLE op: ring[slot] = (ring[slot] + the per-layer block of layer l) * out_scale. */
void cf_op_ple(cf_engine *e, int l, int slot, int ith, int nth);
/* Gemma 4's MoE layer, in RESID (every thread, whole rows, after the experts' barrier): each row
 * b's ffn_post_norm(rms(f) * ffn_post_norm_1 + rms(pending[pslot]) * moe_post_norm) into
 * ts[ith].xb row b (what RESID adds to h). */
void cf_moe_out_norms(cf_engine *e, int l, int pslot, int ith);
/* What of the config the Gemma 4 pieces cannot run with (NULL: fine). */
const char *cf_gemma4_check_config(const cf_config *c);
/* Lay the layers out (e->geo, seq_kbytes / seq_vbytes, hd_max) from the config and the cache row
 * types: kv_src per llama.cpp's rule, cache offsets per KV-owning layer. -1 with err on failure. */
int cf_layer_geometry(cf_engine *e, char *err, size_t n);
/* Whether layer l is "local": it attends through the sliding window (every layer when there is a
 * window and no pattern; with a pattern N, the layers l % N < N - 1, as llama.cpp's swa pattern). */
static inline int cf_layer_local(const cf_config *c, int l) {
    return c->sliding_window > 0 && (c->swa_pattern == 0 || l % c->swa_pattern < c->swa_pattern - 1);
}
/* The first K (V) row of layer l's cache in sequence slot seq: kv head h, position p is row
 * h * n_ctx + p past it. */
static inline uint8_t *cf_kv_rows(const cf_engine *e, int seq, int l, int is_k) {
    const cf_layer_geo *g = &e->geo[e->geo[l].kv_src];
    return is_k ? e->s.kcache + (size_t)seq * e->seq_kbytes + g->koff
                : e->s.vcache + (size_t)seq * e->seq_vbytes + g->voff;
}

/* engine_mla.c: multi-head latent attention (cf_config.mla_kv_lora > 0), the ATTN op of such a
 * model: h = ring[slot] + Attn_l(norm(ring[slot])) over the latent cache. */
void cf_op_attn_mla(cf_engine *e, int l, int slot, int ith, int nth);
/* What of the config latent attention cannot run with (NULL: fine). */
const char *cf_mla_check_config(const cf_config *c);

/* engine_deltanet.c: Qwen3.5's Gated DeltaNet layers. */
static inline int cf_layer_recurrent(const cf_config *c, int l) {
    return c->ssm_interval > 0 && (l + 1) % c->ssm_interval != 0;
}
/* The ATTN op of a recurrent layer: h = ring[slot] + DeltaNet_l(norm(ring[slot])). */
void cf_op_deltanet(cf_engine *e, int l, int slot, int ith, int nth);
const char *cf_deltanet_check_config(const cf_config *c);
int cf_deltanet_alloc(cf_engine *e); /* the states and row buffers, once; -1 out of memory */
void cf_deltanet_free(cf_engine *e);
/* Before a call: each sequence's first row must start it over (position 0) or continue its state
 * (the position it stopped at); -1 with e->err set otherwise. rows: B (seq, pos) pairs, a
 * sequence's rows in order. */
int cf_deltanet_check_rows(cf_engine *e, const int *seq, const int *pos, int B);
/* After a pass: (ok) the states continue from each row's position + 1, or (failed) must start over. */
void cf_deltanet_advance(cf_engine *e, int ok);
/* cf_engine_copy_seq's part: dst's state becomes src's, if src's continues from n; else -1. */
int cf_deltanet_copy_seq(cf_engine *e, int src, int dst, int n);

/* engine_spec.c, thread 0. After the route of layer l into moe slot ms: list the chosen experts,
 * acquire the first wave (async), score and extend the speculation. */
void cf_route_disk(cf_engine *e, int l, int ms, int src_kind);
/* Pin slots for list[i0..) of moe slot ms, at most max; returns the index after the last acquired. */
int cf_acquire_wave(cf_engine *e, int l, int ms, int i0, int max);
/* When a call starts. */
void cf_spec_begin(cf_engine *e);
/* Set speculation up for an opened expert cache (depth <= 0: off); -1 with err on failure. */
int cf_spec_open(cf_engine *e, int depth, char *err, size_t n);
void cf_spec_free(cf_spec *sp);
/* The route trace's entries of row b of the call in flight at layer l: its top_k choices and
 * (pred) its predictions [depth][top_k]. NULL when the mode does not record or replay rows
 * there (recording past the trace's end). */
int32_t *cf_routes_chosen(const cf_engine *e, int b, int l);
/* engine_spec.c: speculation's prediction of row b's route at layer target (top_k into chosen). */
void cf_predict_route(cf_engine *e, int b, int target, int src_kind, int *chosen);
int32_t *cf_routes_pred(const cf_engine *e, int b, int l);

#endif
