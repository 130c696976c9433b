/* engine.h — the decode engine: one forward call per token (or per prefill batch) over the
 * tiled weights of a .cflow file mapped in memory.
 *
 * The engine does not know the architecture's delays. Python (cflow/runtime/plan.py) compiles
 * the config into a *plan*: a short list of ops per layer (attention, dense FFN, router, experts,
 * residual update) that name the buffers they read and write. The engine validates the plan once
 * and then runs it for every token, so the delay semantics have one definition (plan.py) and the
 * C side stays a plain executor.
 *
 * Short names used throughout (llama2.c style):
 *   d       model width                      B     tokens in one call (1 for decode, <= max_batch)
 *   hd      head dim                         q_dim = n_heads * hd, kv_dim = n_kv * hd
 *   d_ff    dense FFN hidden size            d_exp expert FFN hidden size, E experts, top_k
 *   L       layers; layer l uses weight set l % n_unique
 *   n_seq   KV-cache slots (sequences); a call's row b belongs to one of them
 *
 * Sequences: an engine holds n_seq independent KV caches over one set of weights (sequence s owns
 * cache rows [s][L][n_kv][n_ctx], a row hd fp16 halves or hd/32 q8_0 blocks; n_seq = 1 is the
 * single-sequence layout). cf_step_batch advances
 * B different sequences, each at its own position, in one pass over the weights: every mat-vec
 * becomes the batched kernel over the B rows, attention runs per row over that row's own sequence.
 * Rows at consecutive positions of one sequence (a prefill call, or a prompt chunk inside a
 * cf_step_rows call) run attention in blocks of rows (the table's attention_block), which gives
 * the per-row kernel's bits (cflow.h); CFLOW_ATTN_BLOCK=0 in the environment keeps it per row,
 * for timing comparisons.
 * Every op is row-local (norms, activation quantization, the router and the expert sums per row;
 * matmat equals matvec per row bit for bit, cflow.h), so a row's logits do not depend on how many
 * or which other rows share the call, nor on cf_step vs cf_step_batch vs cf_prefill.
 */
#ifndef CFLOW_ENGINE_H
#define CFLOW_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "cflow.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CF_MAX_HEAD_DIM 576         /* the widest attention head the engine takes (DeepSeek's absorbed 512 + 64) */

typedef struct {
    int vocab, d, n_layers, n_heads, n_kv, hd;
    int d_ff;                      /* 0: no dense FFN */
    int n_experts, top_k, d_exp;   /* n_experts 0: no MoE */
    int n_unique;                  /* weight sets; layer l uses l % n_unique */
    int tie_embeddings;            /* lm_head is tok_emb */
    float rope_theta, norm_eps;
    int qkv_bias;                  /* 1: q, k, v add the set's attn.qkv_bias (Qwen2) */
    int qk_norm;                   /* 1: RMSNorm of each q and k head (attn.q_norm/k_norm [hd]) before RoPE */
    int sliding_window;            /* 0: full causal; W: position p attends to max(0, p-W+1)..p */
    int moe_norm_topk;             /* 1: the top_k routing weights renormalised to sum to 1; 0: raw softmax */
    int qk_norm_full;              /* 1: qk_norm over the whole q and k vectors (OLMoE), before RoPE */
    int d_shexp;                   /* 0: none; else the shared expert's hidden size (moe.shared.*), run
                                    * on every row, scaled by sigmoid(moe.shared_gate . moe_in) */
    int n_rope_factors;            /* 0: plain RoPE; hd/2: rope_factors divide the pairs' frequencies */
    float rope_factors[CF_MAX_HEAD_DIM / 2];  /* Llama 3's rope_freqs; YaRN's interpolation */
    float rope_mscale;             /* cos and sin scaled by it (YaRN); 1: none */
    int swa_pattern;               /* 0: sliding_window on every layer; N: only on "local" layers l with
                                    * l % N < N - 1, the others attend to the whole context (Gemma 3) */
    float rope_theta_local;        /* 0: local layers rotate as the others; > 0: local layers' RoPE base,
                                    * without rope_factors / rope_mscale */
    float attn_scale;              /* 0: scores scaled by 1/sqrt(hd); else by this */
    float embed_scale;             /* the token embedding is multiplied by it (Gemma: sqrt(d)); 1: none */
    int post_norms;                /* 1: RMSNorm (attn_post_norm, ffn_post_norm [d]) of the attention and
                                    * dense FFN outputs before they join the residual (Gemma) */
    int ffn_gelu;                  /* 1: the dense FFN is GeGLU, gelu_tanh(gate) * up, instead of SwiGLU */
    float attn_temp_scale;         /* s > 0: the rotated q at position p times 1 + s ln(p / floor + 1)
                                    * (integer division; Llama 4 / Mistral 3); 0: none */
    int attn_temp_floor;           /* positions per step of that temperature (> 0 when s > 0) */
    /* DeepSeek-V2/V3. Multi-head latent attention when mla_kv_lora > 0 (engine_mla.c): then hd is
     * the absorbed head, mla_kv_lora + mla_rope (a latent cache row: the normalised latent, then
     * the roped k_pe), n_kv is 1, and RoPE turns the last mla_rope dims of each query/key head of
     * mla_qk dims (mla_q_lora > 0: the query through wq_a, q_a_norm, wq_b; 0: one wq);
     * mla_v: a head's value width (wo's input is n_heads * mla_v). */
    int mla_kv_lora, mla_q_lora, mla_qk, mla_rope, mla_v;
    int n_dense_lead;              /* > 0: sets < n_dense_lead only dense, the others only MoE */
    int moe_router_bias;           /* 1: moe.router_bias [E] added to the scores to choose (not to weigh) */
    int moe_groups, moe_groups_used; /* > 1: only the best moe_groups_used groups (sum of top 2) */
    float moe_w_scale;             /* the routing weights times it */
    int shexp_ungated;             /* 1: the shared expert joins unscaled (no moe.shared_gate) */
    /* gpt-oss (all 0: off) */
    int attn_sinks;                /* 1: query head h's sink logit attn.sinks[h] joins its softmax's
                                    * denominator only (cflow.h, cf_attn_shape.sinks) */
    int attn_out_bias;             /* 1: the output projection adds attn.wo_bias [d] */
    int moe_bias;                  /* 1: the router adds moe.router_bias [E]; each expert's gate|up and
                                    * down add b_gate_up [2 d_exp] (interleaved like w_gate_up) and b_down [d] */
    int moe_gating;                /* CF_GATING_*: how the router's logits become the top_k weights */
    int expert_act;                /* CF_ACT_*: the experts' activation */
    /* Gemma 4 (all 0: off; engine_gemma4.c). Layers differ in shape: the geometry of layer l is
     * e->geo[l] (engine_internal.h), and the KV cache is laid out per layer at its own row size */
    int hd_local;                  /* > 0: the local layers' head size (hd is the global layers') */
    int n_kv_local;                /* > 0: the local layers' KV head count (n_kv is the global layers') */
    int n_shared_kv;               /* the last n_shared_kv layers own no K/V: they attend over the cache
                                    * of the last KV-owning layer of their kind (llama.cpp's rule) */
    int d_ff_shared_kv;            /* > 0: the dense FFN width of those layers */
    int v_norm;                    /* 1: each V head through an unweighted RMSNorm before the cache */
    int ple_dim;                   /* P > 0: per-layer embeddings (global ple_emb, ple_proj, ple_norm; per
                                    * set ple.w_gate, ple.w_proj, ple_post_norm), the PLE op after RESID */
    int out_scale;                 /* 1: the PLE op multiplies the layer's output by out_scale [1] */
    float logit_softcap;           /* c > 0: logits = c tanh(logits / c) */
    /* Gemma 4's MoE layers (26B-A4B: the dense FFN beside the experts) */
    int moe_router_norm;           /* 1: the router reads rms(z) * moe.router_norm [d], not moe_in */
    int expert_scale;              /* 1: expert e's output times moe.expert_scale[e] (on its routing weight) */
    int moe_out_norms;             /* 1: RESID adds ffn_post_norm(rms(f) * ffn_post_norm_1 + rms(experts) *
                                    * moe_post_norm) instead of f and the experts' sum */
    /* Qwen3.5 (all 0: off; engine_deltanet.c). ssm_interval N > 0: layer l is full attention when
     * (l + 1) % N == 0, a Gated DeltaNet layer otherwise: ssm_hk q/k heads and ssm_hv v heads of
     * ssm_dh dims, a causal depthwise conv over ssm_conv tokens, and per sequence a recurrent
     * state (conv rows and S) beside the KV cache. A sequence's rows must then come in order: a
     * call at position p > 0 continues the state only from p (rewinds and skips are refused),
     * position 0 starts the sequence over. */
    int ssm_interval, ssm_hk, ssm_hv, ssm_dh, ssm_conv;
    int n_rot;                     /* 0: RoPE turns whole heads; else the first n_rot dims of each head */
    int attn_gate;                 /* 1: attention's output times sigmoid(attn.w_gate x) per value (Qwen3.5) */
} cf_config;

/* cf_config.moe_gating: softmax over all E logits, then top_k (renormalised when moe_norm_topk);
 * sigmoid of each logit, then top_k (DeepSeek V3: the router bias joins the scores to choose only,
 * the sum renormalising is clamped as llama.cpp's); or top_k of the raw logits (plus the router
 * bias), their weights the softmax over those k (gpt-oss). */
enum { CF_GATING_SOFTMAX, CF_GATING_SOFTMAX_TOPK, CF_GATING_SIGMOID };
/* cf_config.expert_act: SwiGLU, fused into the gate_up kernels; or OpenAI's clamped SwiGLU after
 * the gate/up biases (the table's swiglu_oai, alpha CF_OAI_ALPHA, limit CF_OAI_LIMIT: gpt-oss). */
enum { CF_ACT_SILU, CF_ACT_SWIGLU_OAI, CF_ACT_GELU };  /* CF_ACT_GELU: GeGLU experts (Gemma 4) */
#define CF_OAI_ALPHA 1.702f
#define CF_OAI_LIMIT 7.0f

/* ---- contracts with Python ---------------------------------------------------------------------
 * Every code Python hands over (descriptor fields and row order, op kinds, sources) and every
 * name it gets back (counters) is an enum here with a name table beside it, indexed by the enum
 * (engine_build.c, designated initializers). bind_engine.cpp exports the tables (_native.OP_KINDS,
 * LAYER_SLOTS, ...) and Python looks codes up by those names, so each contract is written down
 * once, here; a table entry left out shows up as a NULL the bindings refuse at import. */

/* ---- tensor descriptors (what Python hands over) ----------------------------------------------
 * The weights are described by a flat table of CF_DESC_FIELDS int64 per tensor, in the order of
 * cf_desc_index() below, and by each row's tensor name (cf_desc_name(), checked at creation); a
 * tensor that does not exist has dtype -1. F32 tensors (norms, router) are row-major [rows, cols];
 * quantized ones are tiled (tile_rows x tile_cols, DESIGN.md). */
enum { CF_DESC_OFFSET, CF_DESC_DTYPE, CF_DESC_ROWS, CF_DESC_COLS, CF_DESC_TR, CF_DESC_TC,
       CF_DESC_FIELDS };
extern const char *const cf_desc_field_names[CF_DESC_FIELDS]; /* "offset", "dtype", ... */

/* Global tensors first, then per weight set: CF_SLOTS_PER_SET fixed slots, then per expert
 * CF_EXPERT_SLOTS slots. Names: "tok_emb"; "layers.{set}.attn_norm";
 * "layers.{set}.moe.experts.{e}.w_gate_up" (the .cflow tensor names, DESIGN.md). */
enum { CF_T_TOK_EMB, CF_T_NORM, CF_T_LM_HEAD, CF_T_PLE_EMB, CF_T_PLE_PROJ, CF_T_PLE_NORM, CF_T_GLOBAL };
enum { CF_S_ATTN_NORM, CF_S_WQKV, CF_S_WO, CF_S_FFN_NORM, CF_S_GATE_UP, CF_S_DOWN, CF_S_MOE_NORM,
       CF_S_ROUTER, CF_S_QKV_BIAS, CF_S_Q_NORM, CF_S_K_NORM, CF_S_WQ, CF_S_WK, CF_S_WV, CF_S_SHEXP_GATE,
       CF_S_SHEXP_GATE_UP, CF_S_SHEXP_DOWN, CF_S_ATTN_POST_NORM, CF_S_FFN_POST_NORM,
       /* latent attention (cf_config.mla_kv_lora > 0; engine_mla.c) */
       CF_S_WQ_A, CF_S_Q_A_NORM, CF_S_WQ_B, CF_S_WKV_A, CF_S_KV_A_NORM, CF_S_WK_B, CF_S_WV_B,
       /* the router's bias (DeepSeek V3: to choose; gpt-oss: on the logits), gpt-oss's wo bias and sinks */
       CF_S_ROUTER_BIAS, CF_S_WO_BIAS, CF_S_SINKS,
       /* Gemma 4's per-layer-embedding block and layer output scale */
       CF_S_PLE_GATE, CF_S_PLE_PROJ, CF_S_PLE_POST_NORM, CF_S_OUT_SCALE,
       /* Gemma 4's MoE layers */
       CF_S_ROUTER_NORM, CF_S_EXPERT_SCALE, CF_S_FFN_POST_NORM_1, CF_S_MOE_POST_NORM,
       /* Qwen3.5: the attention output gate; a Gated DeltaNet layer's tensors (engine_deltanet.c) */
       CF_S_ATTN_GATE, CF_S_SSM_QKV, CF_S_SSM_Z, CF_S_SSM_ALPHA, CF_S_SSM_BETA, CF_S_SSM_CONV, CF_S_SSM_DT_BIAS,
       CF_S_SSM_A, CF_S_SSM_NORM, CF_S_SSM_OUT, CF_SLOTS_PER_SET };
enum { CF_E_GATE_UP, CF_E_DOWN, CF_E_B_GATE_UP, CF_E_B_DOWN, CF_EXPERT_SLOTS };
extern const char *const cf_global_names[CF_T_GLOBAL];
extern const char *const cf_slot_names[CF_SLOTS_PER_SET];
extern const char *const cf_expert_slot_names[CF_EXPERT_SLOTS];

/* Row of the descriptor table for slot `slot` of weight set `set` (expert e's slot s:
 * CF_SLOTS_PER_SET + CF_EXPERT_SLOTS * e + s). */
static inline int cf_desc_index(int n_experts, int set, int slot) {
    return CF_T_GLOBAL + set * (CF_SLOTS_PER_SET + CF_EXPERT_SLOTS * n_experts) + slot;
}
static inline int cf_desc_count(int n_experts, int n_unique) {
    return CF_T_GLOBAL + n_unique * (CF_SLOTS_PER_SET + CF_EXPERT_SLOTS * n_experts);
}
/* The tensor name of descriptor row `row` into out[n] (truncated to fit); returns its length. */
int cf_desc_name(int n_experts, int row, char *out, size_t n);

/* ---- the plan ----------------------------------------------------------------------------------
 * CF_OP_FIELDS int32 per op: {kind, layer, a, b, c}. Buffers: a ring of residuals (ring slots),
 * h (x + attention), f (dense FFN output), a ring of routings (moe slots: the normalised MoE input
 * moe_in and the chosen experts' token lists), pending expert outputs (pending slots). Per kind:
 *   EMBED   a = ring slot                    ring[a] = tok_emb[token]
 *   ATTN    a = ring slot                    h = ring[a] + Attn_l(norm(ring[a]))
 *   DENSE   a = source (SRC_H | SRC_RING), b = ring slot if SRC_RING
 *                                            f = FFN_l(norm(src))
 *   ROUTE   a = source (SRC_H | SRC_HF), b = moe slot
 *                                            moe_in[b] = norm(src); choose top_k experts
 *   EXPERTS a = pending slot, b = moe slot   pending[a] += sum_k w_k * expert_k(moe_in[b])
 *                                            (+ g * shared(moe_in[b]), g from the route)
 *   RESID   a = ring slot out, b = 1 to add f, c = pending slot to add and clear (-1: none)
 *                                            ring[a] = h + f + pending[c]
 *   FINAL   a = ring slot, b = pending slot to add (-1: none)
 *                                            logits = lm_head(norm(ring[a] + pending[b]))
 *   PLE     a = ring slot                    ring[a] = (ring[a] + PLE_l(ring[a])) * out_scale_l
 *                                            (Gemma 4, after RESID(l); engine_gemma4.c)
 * Every ROUTE(l) is followed by one EXPERTS(l) on the same moe slot, and no other ROUTE writes
 * that slot in between. The routes between a ROUTE and its EXPERTS (itself included) are the
 * layers in flight; with experts on disk, each pins top_k cache slots at most, so the cache must
 * hold top_k x (the most layers in flight) experts.
 */
enum { CF_OP_EMBED, CF_OP_ATTN, CF_OP_DENSE, CF_OP_ROUTE, CF_OP_EXPERTS, CF_OP_RESID,
       CF_OP_FINAL, CF_OP_PLE, CF_OP_KINDS };
enum { CF_SRC_H = 0, CF_SRC_RING = 1, CF_SRC_HF = 2, CF_SRC_KINDS };
#define CF_OP_FIELDS 5
extern const char *const cf_op_kind_names[CF_OP_KINDS]; /* "embed", "attn", ... */
extern const char *const cf_src_names[CF_SRC_KINDS];    /* "h", "ring", "hf" */

/* ---- counters ----------------------------------------------------------------------------------
 * Bytes of weights touched, by category, since the last reset (plus KV-cache bytes read), then
 * tokens processed (prefill + decode) and forward calls; n[CF_CNT_ATTN] is named
 * cf_counter_names[CF_CNT_ATTN] ("attn"), the key NativeEngine.counters() returns it under. */
enum { CF_CNT_ATTN, CF_CNT_DENSE, CF_CNT_ROUTER, CF_CNT_EXPERTS, CF_CNT_EMBED, CF_CNT_LM_HEAD,
       CF_CNT_KV, CF_CNT_TOKENS, CF_CNT_CALLS,
       /* experts on disk (all 0 when they are in RAM): bytes read from the file, experts found in
        * the cache / read, nanoseconds thread 0 waited for expert bytes (sync: spent reading) */
       CF_CNT_DISK_BYTES, CF_CNT_CACHE_HITS, CF_CNT_CACHE_MISSES, CF_CNT_IO_STALL_NS,
       /* expert speculation (cf_disk_experts.spec_depth, engine_spec.c): experts predicted for later
        * layers (each layer's union of predictions), those of them its route then chose, reads
        * started early for predictions, and misses such a read served (counted in cache misses
        * too: bytes read for this use, only early). Reads for experts nobody chose yet =
        * speculation_reads - speculation_reads_used. */
       CF_CNT_SPEC_PREDICTED, CF_CNT_SPEC_HITS, CF_CNT_SPEC_READS, CF_CNT_SPEC_READS_USED, CF_COUNTERS };
extern const char *const cf_counter_names[CF_COUNTERS];
typedef struct {
    uint64_t n[CF_COUNTERS];
} cf_counters;

/* Threads an engine may have: its pool and per-thread scratch are sized per thread, and beyond
 * this a spin-barrier engine only waits (Python checks against it: _native.MAX_THREADS). */
#define CF_MAX_THREADS 512
/* KV-cache slots an engine may have (each costs L x n_ctx x n_kv x (K row + V row bytes): 2 x hd
 * fp16 halves, or hd/32 x 34 bytes each for q8_0; mapped lazily). */
#define CF_MAX_SEQ 4096

typedef struct cf_engine cf_engine;

/* ---- profiling ---------------------------------------------------------------------------------
 * Off by default, and then it costs one predictable branch on a flag per phase of an op (no clock
 * read, no store). cf_engine_profile_start(e, calls) allocates, once, per-thread event buffers
 * sized from the plan for `calls` forward calls (each cf_step is one call; cf_prefill_seq one per
 * batch of max_batch tokens; cf_step_batch one per max_batch rows) and turns it on; nothing is
 * allocated on the token path afterwards. Each thread then cuts its walk of the plan into
 * contiguous segments, one CLOCK_MONOTONIC read per boundary: the phases of each op (norm and
 * int8 quantization of an op's input, the QKV mat-vec with RoPE and the K/V store, attention over
 * the cache, wo, the FFN's gate_up and down, ...) and every barrier wait between them, as
 * cf_prof_event {t0, t1, kind, layer} (ns; kind a CF_PK_* below, named cf_prof_kind_names).
 * Thread 0's segments tile its whole call, from the call's start (CF_PK_SETUP: RoPE table, clearing,
 * starting the pool) to the return (CF_PK_WAIT at the end: joining the other threads); the
 * calls are recorded too (cf_prof_call: the same first and last timestamps, and B rows). Events
 * past the buffers are counted (dropped), not stored. Results do not change: profiling only reads
 * the clock. Not while a call is running. */
enum { CF_PK_SETUP, CF_PK_EMBED, CF_PK_NORM, CF_PK_QKV, CF_PK_ATTN, CF_PK_WO, CF_PK_DENSE_GATE_UP,
       CF_PK_DENSE_DOWN, CF_PK_ROUTE, CF_PK_EXP_GATE_UP, CF_PK_EXP_DOWN, CF_PK_EXP_IO, CF_PK_RESID,
       CF_PK_LM_HEAD, CF_PK_WAIT, CF_PROF_KINDS };
extern const char *const cf_prof_kind_names[CF_PROF_KINDS]; /* "setup", "embed", "norm", ... */
typedef struct {
    int64_t t0, t1;  /* CLOCK_MONOTONIC ns */
    int32_t kind;    /* CF_PK_* */
    int32_t layer;   /* the plan op's layer (0 for embed, lm_head and setup; n_layers for the final norm) */
} cf_prof_event;
typedef struct {
    int64_t t0, t1;  /* the call's first and last timestamps (thread 0's first and last event) */
    int32_t rows;    /* B */
    int32_t pad;
} cf_prof_call;
/* Returns 0, or -1 (out of memory; profiling stays off). Replaces what an earlier start recorded. */
int cf_engine_profile_start(cf_engine *e, int calls);
void cf_engine_profile_stop(cf_engine *e);   /* stops recording; the events stay readable */
void cf_engine_profile_free(cf_engine *e);   /* stops and frees the buffers */
int cf_engine_profiling(const cf_engine *e);
/* Events thread `ith` recorded (its count; *out points into the engine's buffer), the calls, and
 * how many events did not fit. */
int cf_engine_profile_events(const cf_engine *e, int ith, const cf_prof_event **out);
int cf_engine_profile_calls(const cf_engine *e, const cf_prof_call **out);
int64_t cf_engine_profile_dropped(const cf_engine *e);
/* Events one forward call records per thread at most (from the plan): the sizing of the buffers. */
int cf_engine_profile_events_per_call(const cf_engine *e);

/* Expert speculation looks at most this many layers ahead. */
#define CF_SPEC_MAX_DEPTH 16

/* ---- experts on disk ---------------------------------------------------------------------------
 * NULL to cf_engine_create: experts are read from the buffer like every other weight. Otherwise
 * the engine never touches their bytes in the buffer (which may then hold anything there) and
 * reads them from `path` through an expert cache of `budget` bytes (experts.h). */
typedef struct {
    const char *path;     /* the model file */
    const int64_t *span;  /* [n_unique * E][2]: file offset and bytes of expert (set, e), the file's
                           * expert table; each must contain the expert's two tensors */
    int64_t budget;       /* bytes of cache slots */
    int async;            /* 1: reads start when the route has chosen (reader threads); 0: the
                           * experts op reads, then computes */
    int n_io;             /* reader threads (async) */
    int direct;           /* 1: O_DIRECT where the filesystem takes it */
    int spec_depth;       /* expert speculation (async only): at route(l), predict the experts of
                           * layers up to l + spec_depth (at most CF_SPEC_MAX_DEPTH) from route(l)'s
                           * input and start their reads (engine_spec.c); 0: off; off by itself
                           * when the cache has no slot beyond the minimum */
    int reader;           /* async: CF_XREADER_* (experts.h): io_uring where the kernel offers it, else
                           * pread threads */
} cf_disk_experts;

/* What a failed call ran into (cf_engine_error_kind): bad input, or expert I/O / the file. */
enum { CF_ERR_NONE, CF_ERR_INPUT, CF_ERR_IO };

/* Create an engine over `buf[0:buf_len]` (kept by the caller for the engine's life). names[i]
 * is the tensor name the caller put in descriptor row i; it must be cf_desc_name()'s, so a
 * caller built against other tables is refused instead of binding the wrong tensors. Returns
 * NULL and writes a message to err on bad input (names, descriptor or plan inconsistent with
 * the config, tensors outside the buffer, out of memory). n_seq (1..CF_MAX_SEQ) KV caches of n_ctx
 * positions each: 1 for a single-sequence engine. k_type, v_type: the K and V caches' row types,
 * each CF_F16 or CF_Q8_0 (cflow.h, "The 8-bit KV cache"; q8_0 needs hd a multiple of 32). */
cf_engine *cf_engine_create(const cf_config *cfg, const uint8_t *buf, size_t buf_len,
                            const int64_t *desc, const char *const *names, int n_desc,
                            const int32_t *plan, int n_ops,
                            int n_ring, int n_pending, int n_moe, int n_threads, int n_ctx,
                            int max_batch, int n_seq, int k_type, int v_type, const cf_disk_experts *disk,
                            char *err, size_t err_len);
void cf_engine_free(cf_engine *e);

/* One token of sequence 0 at position pos; logits[vocab] receives the next-token logits. The KV
 * cache must hold positions 0..pos-1 from earlier calls. Returns 0, or -1 with cf_engine_error()
 * set. */
int cf_step(cf_engine *e, int token, int pos, float *logits);
/* n tokens of sequence `seq` at positions pos0.., in batches of max_batch; logits_last[vocab] (may
 * be NULL) gets the logits after the last token. cf_prefill is sequence 0. */
int cf_prefill_seq(cf_engine *e, int seq, const int32_t *tokens, int n, int pos0, float *logits_last);
int cf_prefill(cf_engine *e, const int32_t *tokens, int n, int pos0, float *logits_last);
/* One decode step for B distinct sequences: row b runs tokens[b] at position pos[b] of sequence
 * seq[b] (attending to that sequence's positions 0..pos[b], writing its K/V at pos[b]);
 * logits[b * vocab ..] (logits may be NULL) gets its next-token logits. 1 <= B <= n_seq; rows
 * beyond max_batch take further passes (rows are independent). Bad input (a sequence out of range
 * or twice, a position outside the context, a token outside the vocabulary) fails before anything
 * runs; a failure while running leaves each sequence's positions before pos[b] intact. */
int cf_step_batch(cf_engine *e, const int *seq, const int32_t *tokens, const int *pos, int B, float *logits);
/* B rows of any sequences in one pass over the weights (passes of max_batch rows): row b runs
 * tokens[b] at position pos[b] of sequence seq[b]. A sequence may have several rows (a chunk of
 * its prompt beside other sequences' decode rows): they must come in order at consecutive
 * positions, and its positions before its first row must be in the cache. Runs of a sequence's
 * rows take the block attention of a prefill, single rows the per-query one: the same bits, so
 * every row equals what cf_step / cf_prefill_seq / cf_step_batch give for it. logits (may be NULL)
 * gets, in row order, the logits of the rows with want[b] != 0 (want NULL: every row); rows not
 * wanted skip the lm_head. Checks and failures as cf_step_batch. */
int cf_step_rows(cf_engine *e, const int *seq, const int32_t *tokens, const int *pos, const uint8_t *want, int B,
                 float *logits);
/* Copy positions 0..n-1 of sequence src's KV cache into sequence dst's (every layer): dst can then
 * go on from position n as if it had run src's first n tokens itself (the same bits). For n > 1
 * choices on one prompt: the prompt runs once. Returns 0, or -1 for a bad sequence or n. */
int cf_engine_copy_seq(cf_engine *e, int src, int dst, int n);

/* The final normed hidden state (what the lm_head reads) of the rows whose logits the last
 * forward pass wrote, for a self-speculative proposer (multi-token prediction heads run on it in
 * Python). Off by default; while on, each pass copies those rows (d floats each) into an engine
 * buffer. cf_engine_hidden points *out at that buffer and returns its row count: hidden row i
 * belongs to logits row i of the last pass (a call of more than max_batch rows runs several
 * passes: only the last one's rows are kept). The logits do not change. Not while a call runs. */
void cf_engine_set_keep_hidden(cf_engine *e, int on);
int cf_engine_hidden(const cf_engine *e, const float **out);

/* The lm_head's logits of n given normed rows x [n, d] into out [n, vocab]: the multi-token heads'
 * outputs, which are inputs of the lm_head like the final hidden state but not rows of a pass. The
 * same quantization and kernels as a pass's logits (and the logit soft-cap), on the engine's active
 * threads and their scratch: not while a call runs. Returns 0, or -1 when n is not 1..max_batch. */
int cf_engine_lm_head(cf_engine *e, const float *x, int n, float *out);

const char *cf_engine_error(const cf_engine *e);
int cf_engine_error_kind(const cf_engine *e); /* CF_ERR_* of the last failed call */
void cf_engine_counters(const cf_engine *e, cf_counters *out);
/* Per (layer, expert) routing counts since the last reset: out[L * E]. */
void cf_engine_expert_hits(const cf_engine *e, uint64_t *out);
void cf_engine_reset_counters(cf_engine *e);
/* There is no cache reset: a call at position p overwrites the K/V of p and reads only 0..p, so
 * starting a new sequence is just calling again from position 0. */

int cf_engine_n_ctx(const cf_engine *e);
int cf_engine_n_threads(const cf_engine *e);
/* Threads the next calls use, 1..n_threads (the pool keeps n_threads; results do not depend on
 * this, since every output row and head is computed the same way whoever computes it). Returns
 * the value set. Not while a call is running. */
int cf_engine_set_active_threads(cf_engine *e, int n);
/* Overlap of independent ops (off by default): with on, an attn(l) followed by a dense(l) that
 * reads the ring (delta_dense >= 1) run side by side, the first half of the active threads on
 * attn, the rest on dense (engine.c, "overlap"). Same results bit for bit. Returns 0, or -1 out
 * of memory. Not while a call is running. */
int cf_engine_set_overlap(cf_engine *e, int on);
int cf_engine_overlap(const cf_engine *e);
/* Software prefetch of this engine's calls (claim C6; the modes: cflow.h, cf_set_prefetch):
 * CF_PREFETCH_DEFAULT (-1, the initial one), CF_PREFETCH_OFF (0), or N > 0 bytes ahead. Every
 * call makes it the process-wide mode the kernels read (cf_set_prefetch) before it starts, so
 * engines with different modes each run with their own, as long as their calls do not overlap
 * in time; if they do, one may run with the other's mode: only the speed changes, never a result.
 * Returns 0, or -1 (mode unchanged) for a value outside -1..CF_PREFETCH_MAX. */
int cf_engine_set_prefetch(cf_engine *e, int mode);
int cf_engine_prefetch(const cf_engine *e);
int cf_engine_active_threads(const cf_engine *e);
int cf_engine_max_batch(const cf_engine *e);
int cf_engine_n_seq(const cf_engine *e);
const char *cf_engine_isa(const cf_engine *e);

/* Route traces: record the experts every route chooses, and what expert speculation would predict
 * for each later layer, or replay such a trace in place of the routers' own choices (benchmarks put
 * one model's learned routing onto another model's weights and expert cache; the replay of a
 * run's own trace reproduces it bit for bit). The caller owns the buffers and keeps them alive
 * while the mode is on:
 *   chosen [n, L, top_k]        the experts row t's route chose at layer l, in top-k order
 *   pred   [n, L, depth, top_k] the top_k predicted for layer l + 1 + j from route(l)'s input,
 *                               as speculation predicts (engine_spec.c); -1 past the last layer
 * Row b of a call is trace row pos + b (pos: rows recorded or replayed so far). Recording stops
 * at n rows; a replay wraps around. Replaying takes the choices from `chosen` and the routing
 * weights from the router's own probabilities of those experts; speculation predicts from `pred`
 * (depth must cover the engine's speculation depth, or L - 1). Returns 0, or -1 with err. Not
 * while a call is running. */
enum { CF_ROUTES_OFF = 0, CF_ROUTES_RECORD = 1, CF_ROUTES_REPLAY = 2 };
int cf_engine_set_routes(cf_engine *e, int mode, int32_t *chosen, int32_t *pred, int64_t n, int depth,
                         char *err, size_t nerr);
int64_t cf_engine_routes_pos(const cf_engine *e);

/* Experts on disk: the cache's geometry (0 when experts are in RAM), the (set * E + e) keys of
 * the experts it holds now (into keys[n_slots]; returns how many), the most layers in flight,
 * and a test-only fault on the read `after` reads from now (kind: CF_XFAULT_*, experts.h), which
 * fails `delay_us` after it starts. */
typedef struct {
    int n_slots, min_slots, inflight, async, n_io, direct;
    int spec_depth; /* expert speculation's depth (0: off), in spec_slots = n_slots - min_slots slots at most */
    int spec_slots;
    int keep_depth; /* the speculation depth the cache's keep ranks follow (0: ranks off) */
    int uring;                /* the async reads go through io_uring (else pread threads) */
    const char *reader_note;  /* why not, where io_uring was wanted ("" otherwise); the engine's */
    int64_t slot_bytes, cache_bytes;
} cf_expert_cache_info;
int cf_engine_expert_cache(const cf_engine *e, cf_expert_cache_info *out);
int cf_engine_expert_resident(const cf_engine *e, int *keys);
int cf_engine_inject_io_fault(cf_engine *e, int64_t after, int kind, int delay_us);
/* Layers in flight in a plan (see "the plan" above); -1 if the plan pairs routes and experts
 * wrongly. The minimum cache is top_k times this many experts. */
int cf_plan_inflight(const int32_t *plan, int n_ops, int n_moe);
/* The smallest expert cache an engine accepts, in slots: every layer in flight may pin top_k
 * experts at once (the one definition; Python asks it through _native.expert_min_slots). */
static inline int cf_expert_min_slots(int top_k, int inflight) { return top_k * inflight; }

#ifdef __cplusplus
}
#endif
#endif /* CFLOW_ENGINE_H */
