/* engine_build.c — making an engine: validate the config, the tensor table and the plan, bind the
 * weights (pointers into the caller's buffer), allocate every buffer the per-token path uses; then
 * the small accessors, and the names of every contract with Python (engine.h), exported by
 * bind_engine.cpp. */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_internal.h"
#include "util.h"

// ---------------------------------------------------------------------------------------------
// names: the one definition of each contract with Python (engine.h), exported by bind_engine.cpp

const char *const cf_desc_field_names[CF_DESC_FIELDS] = {
    [CF_DESC_OFFSET] = "offset", [CF_DESC_DTYPE] = "dtype", [CF_DESC_ROWS] = "rows",
    [CF_DESC_COLS] = "cols", [CF_DESC_TR] = "tile_rows", [CF_DESC_TC] = "tile_cols",
};
const char *const cf_global_names[CF_T_GLOBAL] = {
    [CF_T_TOK_EMB] = "tok_emb", [CF_T_NORM] = "norm", [CF_T_LM_HEAD] = "lm_head",
    [CF_T_PLE_EMB] = "ple_emb", [CF_T_PLE_PROJ] = "ple_proj", [CF_T_PLE_NORM] = "ple_norm",
};
const char *const cf_slot_names[CF_SLOTS_PER_SET] = {
    [CF_S_ATTN_NORM] = "attn_norm", [CF_S_WQKV] = "attn.wqkv", [CF_S_WO] = "attn.wo",
    [CF_S_FFN_NORM] = "ffn_norm", [CF_S_GATE_UP] = "ffn.w_gate_up", [CF_S_DOWN] = "ffn.w_down",
    [CF_S_MOE_NORM] = "moe_norm", [CF_S_ROUTER] = "moe.router", [CF_S_QKV_BIAS] = "attn.qkv_bias",
    [CF_S_Q_NORM] = "attn.q_norm", [CF_S_K_NORM] = "attn.k_norm", [CF_S_WQ] = "attn.wq", [CF_S_WK] = "attn.wk",
    [CF_S_WV] = "attn.wv", [CF_S_SHEXP_GATE] = "moe.shared_gate", [CF_S_SHEXP_GATE_UP] = "moe.shared.w_gate_up",
    [CF_S_SHEXP_DOWN] = "moe.shared.w_down", [CF_S_ATTN_POST_NORM] = "attn_post_norm",
    [CF_S_FFN_POST_NORM] = "ffn_post_norm", [CF_S_WQ_A] = "attn.wq_a", [CF_S_Q_A_NORM] = "attn.q_a_norm",
    [CF_S_WQ_B] = "attn.wq_b", [CF_S_WKV_A] = "attn.wkv_a", [CF_S_KV_A_NORM] = "attn.kv_a_norm",
    [CF_S_WK_B] = "attn.wk_b", [CF_S_WV_B] = "attn.wv_b", [CF_S_ROUTER_BIAS] = "moe.router_bias",
    [CF_S_WO_BIAS] = "attn.wo_bias", [CF_S_SINKS] = "attn.sinks", [CF_S_PLE_GATE] = "ple.w_gate",
    [CF_S_PLE_PROJ] = "ple.w_proj", [CF_S_PLE_POST_NORM] = "ple_post_norm", [CF_S_OUT_SCALE] = "out_scale",
    [CF_S_ROUTER_NORM] = "moe.router_norm", [CF_S_EXPERT_SCALE] = "moe.expert_scale",
    [CF_S_FFN_POST_NORM_1] = "ffn_post_norm_1", [CF_S_MOE_POST_NORM] = "moe_post_norm",
    [CF_S_ATTN_GATE] = "attn.w_gate", [CF_S_SSM_QKV] = "ssm.w_qkv", [CF_S_SSM_Z] = "ssm.w_z",
    [CF_S_SSM_ALPHA] = "ssm.w_alpha", [CF_S_SSM_BETA] = "ssm.w_beta", [CF_S_SSM_CONV] = "ssm.conv",
    [CF_S_SSM_DT_BIAS] = "ssm.dt_bias", [CF_S_SSM_A] = "ssm.a", [CF_S_SSM_NORM] = "ssm.norm",
    [CF_S_SSM_OUT] = "ssm.w_out",
};
const char *const cf_expert_slot_names[CF_EXPERT_SLOTS] = {
    [CF_E_GATE_UP] = "w_gate_up", [CF_E_DOWN] = "w_down", [CF_E_B_GATE_UP] = "b_gate_up", [CF_E_B_DOWN] = "b_down",
};
const char *const cf_op_kind_names[CF_OP_KINDS] = {
    [CF_OP_EMBED] = "embed", [CF_OP_ATTN] = "attn", [CF_OP_DENSE] = "dense",
    [CF_OP_ROUTE] = "route", [CF_OP_EXPERTS] = "experts", [CF_OP_RESID] = "resid",
    [CF_OP_FINAL] = "final", [CF_OP_PLE] = "ple",
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
    [CF_CNT_SPEC_PREDICTED] = "speculation_predicted", [CF_CNT_SPEC_HITS] = "speculation_hits",
    [CF_CNT_SPEC_READS] = "speculation_reads", [CF_CNT_SPEC_READS_USED] = "speculation_reads_used",
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
    else if (c->hd <= 0 || c->hd % 2 || c->hd > CF_MAX_HEAD_DIM)
        bad = "head_dim must be positive, even and at most CF_MAX_HEAD_DIM (576)";
    else if (c->n_rope_factors != 0 && c->n_rope_factors != (c->mla_kv_lora ? c->mla_rope : c->hd) / 2)
        bad = "rope_freq_factors must be empty or rope_dim/2 values";
    else if (!(c->rope_mscale > 0))
        bad = "rope_mscale must be positive";
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
    else if (c->swa_pattern < 0 || !(c->rope_theta_local >= 0) || !(c->attn_scale >= 0) || !(c->embed_scale > 0))
        bad = "sliding_window_pattern, rope_theta_local and attn_scale must be >= 0, embed_scale positive";
    else if ((c->post_norms | c->ffn_gelu) & ~1 || ((c->post_norms || c->ffn_gelu) && c->n_experts && !c->moe_out_norms))
        bad = "post_norms and ffn_gelu must be 0 or 1, and are for dense models (no experts) but Gemma 4's";
    else if (!(c->attn_temp_scale >= 0) || c->attn_temp_floor < 0 ||
             (c->attn_temp_scale > 0) != (c->attn_temp_floor > 0))
        bad = "attn_temp_scale and attn_temp_floor must be >= 0 and set together";
    else if ((c->attn_sinks | c->attn_out_bias | c->moe_bias | c->moe_router_bias) & ~1)
        bad = "attn_sinks, attn_out_bias, moe_bias and moe_router_bias must be 0 or 1";
    else if (c->attn_out_bias && c->post_norms)
        bad = "attn_out_bias does not go with post_norms";
    else if ((c->moe_gating != CF_GATING_SOFTMAX && c->moe_gating != CF_GATING_SOFTMAX_TOPK &&
              c->moe_gating != CF_GATING_SIGMOID) ||
             (c->expert_act != CF_ACT_SILU && c->expert_act != CF_ACT_SWIGLU_OAI && c->expert_act != CF_ACT_GELU))
        bad = "moe_gating and expert_act must be one of the engine's (CF_GATING_*, CF_ACT_*)";
    else if (!c->n_experts && (c->moe_bias || c->moe_router_bias || c->moe_gating || c->expert_act))
        bad = "moe_bias, moe_router_bias, moe_gating and expert_act need experts";
    else if (c->moe_bias && c->moe_router_bias)
        bad = "moe_bias (gpt-oss) and moe_router_bias (DeepSeek) are two uses of one router bias: one at most";
    else if (c->expert_act == CF_ACT_SWIGLU_OAI && c->d_shexp)
        bad = "expert_act swiglu_oai does not go with a shared expert";
    if (!bad) bad = cf_mla_check_config(c);
    if (!bad) bad = cf_gemma4_check_config(c);
    if (!bad) bad = cf_deltanet_check_config(c);
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
                    "Q4_K, Q5_K, Q6_K or MXFP4 matrices (re-convert the model)", what, (long long)dt);
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
    int E = c->n_experts;
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
    if (c->ple_dim) { /* Gemma 4's per-layer embeddings (engine_gemma4.c) */
        BIND(CF_T_PLE_EMB, c->vocab, c->n_layers * c->ple_dim, 0, &e->w.ple_emb, &fdummy);
        BIND(CF_T_PLE_PROJ, c->n_layers * c->ple_dim, c->d, 0, &e->w.ple_proj, &fdummy);
        BIND(CF_T_PLE_NORM, 1, c->ple_dim, 1, &dummy, &e->w.ple_norm);
    }
    e->w.sets = calloc(c->n_unique, sizeof *e->w.sets);
    if (!e->w.sets) return cf_set_err(err, n, "out of memory"), -1;
    const uint64_t norm_bytes = (uint64_t)c->d * sizeof(float);
    for (int i = 0; i < c->n_unique; i++) {
        cf_layer *L = &e->w.sets[i];
        /* the set's geometry (e->geo: Gemma 4's layers differ; a set per layer there) */
        const cf_layer_geo *G = &e->geo[i];
        int hd = G->hd, q_dim = c->n_heads * hd, kv_dim = G->has_kv ? G->n_kv * hd : 0, d_ff = G->d_ff;
#define SET(slot, r, k, f32, t, fp) BIND(cf_desc_index(E, i, slot), r, k, f32, t, fp)
        SET(CF_S_ATTN_NORM, 1, c->d, 1, &dummy, &L->attn_norm);
        const int rec = cf_layer_recurrent(c, i);
        if (rec) { /* Gated DeltaNet (engine_deltanet.c): no attention tensors */
            int C = (2 * c->ssm_hk + c->ssm_hv) * c->ssm_dh, V = c->ssm_hv * c->ssm_dh;
            cf_deltanet_layer *dn = &L->dn;
            *dn = (cf_deltanet_layer){.n_k_heads = c->ssm_hk, .n_v_heads = c->ssm_hv, .head_dim = c->ssm_dh,
                                      .conv_kernel = c->ssm_conv, .eps = c->norm_eps};
            SET(CF_S_SSM_QKV, C, c->d, 0, &L->ssm_qkv, &fdummy);
            SET(CF_S_SSM_Z, V, c->d, 0, &L->ssm_z, &fdummy);
            SET(CF_S_SSM_ALPHA, c->ssm_hv, c->d, 0, &L->ssm_alpha, &fdummy);
            SET(CF_S_SSM_BETA, c->ssm_hv, c->d, 0, &L->ssm_beta, &fdummy);
            SET(CF_S_SSM_CONV, C, c->ssm_conv, 1, &dummy, &dn->conv_w);
            SET(CF_S_SSM_DT_BIAS, 1, c->ssm_hv, 1, &dummy, &dn->dt_bias);
            SET(CF_S_SSM_A, 1, c->ssm_hv, 1, &dummy, &dn->a);
            SET(CF_S_SSM_NORM, 1, c->ssm_dh, 1, &dummy, &dn->norm_w);
            SET(CF_S_SSM_OUT, c->d, V, 0, &L->ssm_out, &fdummy);
            L->qkv_fmt = act_fmt(&L->ssm_qkv) | act_fmt(&L->ssm_z) | act_fmt(&L->ssm_alpha) | act_fmt(&L->ssm_beta);
            L->attn_bytes = norm_bytes + cf_tiled_bytes(&L->ssm_qkv) + cf_tiled_bytes(&L->ssm_z) +
                            cf_tiled_bytes(&L->ssm_alpha) + cf_tiled_bytes(&L->ssm_beta) + cf_tiled_bytes(&L->ssm_out) +
                            (uint64_t)(C * c->ssm_conv + 2 * c->ssm_hv + c->ssm_dh) * 4;
        } else if (c->mla_kv_lora) { /* latent attention (engine_mla.c) */
            int H = c->n_heads, ql = c->mla_q_lora, kvl = c->mla_kv_lora, qdim = H * c->mla_qk;
            if (ql) {
                SET(CF_S_WQ_A, ql, c->d, 0, &L->wq_a, &fdummy);
                SET(CF_S_Q_A_NORM, 1, ql, 1, &dummy, &L->q_a_norm);
                SET(CF_S_WQ_B, qdim, ql, 0, &L->wq_b, &fdummy);
                L->qkv_fmt = act_fmt(&L->wq_a);
                L->attn_bytes = cf_tiled_bytes(&L->wq_a) + (uint64_t)ql * 4 + cf_tiled_bytes(&L->wq_b);
            } else {
                SET(CF_S_WQ, qdim, c->d, 0, &L->wq, &fdummy);
                L->qkv_fmt = act_fmt(&L->wq);
                L->attn_bytes = cf_tiled_bytes(&L->wq);
            }
            SET(CF_S_WKV_A, kvl + c->mla_rope, c->d, 0, &L->wkv_a, &fdummy);
            SET(CF_S_KV_A_NORM, 1, kvl, 1, &dummy, &L->kv_a_norm);
            SET(CF_S_WK_B, H * kvl, c->mla_qk - c->mla_rope, 0, &L->wk_b, &fdummy);
            SET(CF_S_WV_B, H * c->mla_v, kvl, 0, &L->wv_b, &fdummy);
            SET(CF_S_WO, c->d, H * c->mla_v, 0, &L->wo, &fdummy);
            if (cf_is_kquant(L->wk_b.dtype) || cf_is_kquant(L->wv_b.dtype))
                return cf_set_err(err, n, "weight set %d: attn.wk_b and attn.wv_b must be a 32-block type (Q8_0), "
                                  "their inputs are one head wide; re-convert the model", i), -1;
            L->qkv_fmt |= act_fmt(&L->wkv_a);
            L->attn_bytes += norm_bytes + cf_tiled_bytes(&L->wkv_a) + (uint64_t)kvl * 4 + cf_tiled_bytes(&L->wk_b) +
                             cf_tiled_bytes(&L->wv_b) + cf_tiled_bytes(&L->wo);
        } else {
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
            if (c->attn_gate) { /* Qwen3.5's output gate, from the same normed input as q|k|v */
                SET(CF_S_ATTN_GATE, q_dim, c->d, 0, &L->w_gate, &fdummy);
                L->qkv_fmt |= act_fmt(&L->w_gate);
            }
            if (c->attn_out_bias) SET(CF_S_WO_BIAS, 1, c->d, 1, &dummy, &L->wo_bias);
            if (c->attn_sinks) SET(CF_S_SINKS, 1, c->n_heads, 1, &dummy, &L->sinks);
            if (c->post_norms) {
                SET(CF_S_ATTN_POST_NORM, 1, c->d, 1, &dummy, &L->attn_post_norm);
                if (c->d_ff) SET(CF_S_FFN_POST_NORM, 1, c->d, 1, &dummy, &L->ffn_post_norm);
            }
            /* the counters count every weight byte a node reads, its f32 norms and bias included
             * (cflow.weights) */
            L->attn_bytes = norm_bytes + cf_tiled_bytes(&L->wo) +
                            (L->qkv_split ? cf_tiled_bytes(&L->wq) + cf_tiled_bytes(&L->wk) + cf_tiled_bytes(&L->wv)
                                          : cf_tiled_bytes(&L->wqkv));
            if (c->attn_gate) L->attn_bytes += cf_tiled_bytes(&L->w_gate);
        }
        if (c->post_norms) L->attn_bytes += norm_bytes;
        L->attn_bytes += (uint64_t)(c->attn_out_bias * c->d + c->attn_sinks * c->n_heads) * sizeof(float);
        if (c->qkv_bias && !rec) {
            SET(CF_S_QKV_BIAS, 1, q_dim + 2 * kv_dim, 1, &dummy, &L->qkv_bias);
            L->attn_bytes += (uint64_t)(q_dim + 2 * kv_dim) * sizeof(float);
        }
        if (c->qk_norm && !rec) { /* per head [hd], or over the whole q [q_dim] and k [kv_dim] (qk_norm_full) */
            int qn = c->qk_norm_full ? q_dim : hd, kn = !G->has_kv ? 0 : c->qk_norm_full ? kv_dim : hd;
            SET(CF_S_Q_NORM, 1, qn, 1, &dummy, &L->q_norm);
            if (kn) SET(CF_S_K_NORM, 1, kn, 1, &dummy, &L->k_norm); /* none where the layer has no K */
            L->attn_bytes += (uint64_t)(qn + kn) * sizeof(float);
        }
        if (c->d_ff && (!c->n_dense_lead || i < c->n_dense_lead)) {
            SET(CF_S_FFN_NORM, 1, c->d, 1, &dummy, &L->ffn_norm);
            SET(CF_S_GATE_UP, 2 * d_ff, c->d, 0, &L->gate_up, &fdummy);
            SET(CF_S_DOWN, c->d, d_ff, 0, &L->down, &fdummy);
            L->dense_bytes = norm_bytes * (1 + (c->post_norms != 0)) + cf_tiled_bytes(&L->gate_up) +
                             cf_tiled_bytes(&L->down);
        }
        if (c->ple_dim) {
            SET(CF_S_PLE_GATE, c->ple_dim, c->d, 0, &L->ple_gate, &fdummy);
            SET(CF_S_PLE_PROJ, c->d, c->ple_dim, 0, &L->ple_proj, &fdummy);
            SET(CF_S_PLE_POST_NORM, 1, c->d, 1, &dummy, &L->ple_post_norm);
            L->ple_bytes = cf_tiled_bytes(&L->ple_gate) + cf_tiled_bytes(&L->ple_proj) + norm_bytes;
        }
        if (c->out_scale) {
            SET(CF_S_OUT_SCALE, 1, 1, 1, &dummy, &L->out_scale);
            L->ple_bytes += sizeof(float);
        }
        if (!E || i < c->n_dense_lead) continue;
        SET(CF_S_MOE_NORM, 1, c->d, 1, &dummy, &L->moe_norm);
        SET(CF_S_ROUTER, E, c->d, 1, &dummy, &L->router);
        L->router_bytes = norm_bytes + (uint64_t)E * c->d * 4;
        if (c->moe_router_bias || c->moe_bias) {
            SET(CF_S_ROUTER_BIAS, 1, E, 1, &dummy, &L->router_bias);
            L->router_bytes += (uint64_t)E * 4;
        }
        if (c->moe_router_norm) {
            SET(CF_S_ROUTER_NORM, 1, c->d, 1, &dummy, &L->router_norm);
            L->router_bytes += norm_bytes;
        }
        if (c->expert_scale) {
            SET(CF_S_EXPERT_SCALE, 1, E, 1, &dummy, &L->expert_scale);
            L->router_bytes += (uint64_t)E * 4;
        }
        if (c->moe_out_norms) { /* counted with the dense FFN, whose output they norm */
            SET(CF_S_FFN_POST_NORM_1, 1, c->d, 1, &dummy, &L->ffn_post_norm_1);
            SET(CF_S_MOE_POST_NORM, 1, c->d, 1, &dummy, &L->moe_post_norm);
            L->dense_bytes += 2 * norm_bytes;
        }
        if (c->d_shexp) {
            if (!c->shexp_ungated) SET(CF_S_SHEXP_GATE, 1, c->d, 1, &dummy, &L->shexp_gate);
            SET(CF_S_SHEXP_GATE_UP, 2 * c->d_shexp, c->d, 0, &L->shexp_gate_up, &fdummy);
            SET(CF_S_SHEXP_DOWN, c->d, c->d_shexp, 0, &L->shexp_down, &fdummy);
            if (!c->shexp_ungated) L->router_bytes += norm_bytes; /* the route computes the shared expert's weight */
            L->shexp_bytes = cf_tiled_bytes(&L->shexp_gate_up) + cf_tiled_bytes(&L->shexp_down);
            L->exp_fmt |= act_fmt(&L->shexp_gate_up);
        }
        L->exp_gate_up = calloc(E, sizeof(cf_tiled));
        L->exp_down = calloc(E, sizeof(cf_tiled));
        L->exp_bytes = calloc(E, sizeof(uint64_t));
        L->exp_b_gate_up = calloc(E, sizeof(float *));
        L->exp_b_down = calloc(E, sizeof(float *));
        if (!L->exp_gate_up || !L->exp_down || !L->exp_bytes || !L->exp_b_gate_up || !L->exp_b_down)
            return cf_set_err(err, n, "out of memory"), -1;
        for (int x = 0; x < E; x++) {
            int s0 = CF_SLOTS_PER_SET + CF_EXPERT_SLOTS * x;
            SET(s0 + CF_E_GATE_UP, 2 * c->d_exp, c->d, 0, &L->exp_gate_up[x], &fdummy);
            SET(s0 + CF_E_DOWN, c->d, c->d_exp, 0, &L->exp_down[x], &fdummy);
            L->exp_bytes[x] = cf_tiled_bytes(&L->exp_gate_up[x]) + cf_tiled_bytes(&L->exp_down[x]);
            if (c->moe_bias) {
                SET(s0 + CF_E_B_GATE_UP, 1, 2 * c->d_exp, 1, &dummy, &L->exp_b_gate_up[x]);
                SET(s0 + CF_E_B_DOWN, 1, c->d, 1, &dummy, &L->exp_b_down[x]);
                L->exp_bytes[x] += (uint64_t)(2 * c->d_exp + c->d) * sizeof(float);
            }
            L->exp_fmt |= act_fmt(&L->exp_gate_up[x]);
        }
#undef SET
    }
#undef BIND
    return 0;
}

/* With leading dense layers (n_dense_lead) a layer has the dense FFN or the MoE block, not both. */
static int lead_ok(const cf_config *c, int l, int dense) {
    return !c->n_dense_lead || (dense ? l < c->n_dense_lead : l >= c->n_dense_lead);
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
            ok = c->d_ff > 0 && (a == CF_SRC_H || (a == CF_SRC_RING && b >= 0 && b < e->n_ring)) && lead_ok(c, l, 1);
        else if (k == CF_OP_ROUTE)
            ok = c->n_experts > 0 && (a == CF_SRC_H || (a == CF_SRC_HF && c->d_ff > 0)) && moe_ok && lead_ok(c, l, 0);
        else if (k == CF_OP_EXPERTS)
            ok = c->n_experts > 0 && pend_ok && moe_ok && lead_ok(c, l, 0);
        else if (k == CF_OP_RESID)
            ok = ring_ok && (b == 0 || (b == 1 && c->d_ff > 0 && lead_ok(c, l, 1))) && cc >= -1 && cc < e->n_pending;
        else if (k == CF_OP_FINAL)
            ok = ring_ok && b >= -1 && b < e->n_pending && i == n_ops - 1;
        else if (k == CF_OP_PLE)
            ok = ring_ok && (c->ple_dim > 0 || c->out_scale);
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
    size_t B = e->max_batch, d = c->d, q_dim = (size_t)c->n_heads * e->hd_max, kv_dim = (size_t)e->kv_dim_max;
    size_t E = c->n_experts, M = e->n_moe;
    e->seq_kv = (size_t)c->n_layers * c->n_kv * e->n_ctx; /* latent attention's rows (one head size) */
    int fail = 0;
    s->ring = xcalloc(e->n_ring * B * d, sizeof(float), &fail);
    s->h = xcalloc(B * d, sizeof(float), &fail);
    s->f = xcalloc(B * d, sizeof(float), &fail);
    s->pending = xcalloc(e->n_pending * B * d, sizeof(float), &fail);
    s->moe_in = xcalloc(M * B * d, sizeof(float), &fail);
    s->qkv = xcalloc(B * (q_dim + 2 * kv_dim), sizeof(float), &fail);
    s->att = xcalloc(B * q_dim, sizeof(float), &fail);
    /* a one-row call's routed experts each take a row (experts_one_row) */
    size_t hid_rows = cf_max((int)B, c->n_experts ? c->top_k : 1);
    s->hid = xcalloc(hid_rows * e->hmax, sizeof(float), &fail);
    s->y = xcalloc(B * d, sizeof(float), &fail);
    s->rope = xcalloc(B * c->hd, sizeof(float), &fail);
    if (c->mla_kv_lora) { /* latent attention's own rows (engine_mla.c) */
        s->mla_a = xcalloc(B * (c->mla_q_lora + c->mla_kv_lora + c->mla_rope), sizeof(float), &fail);
        s->mla_q = xcalloc(B * c->n_heads * c->mla_qk, sizeof(float), &fail);
        s->mla_o = xcalloc(B * c->n_heads * c->mla_v, sizeof(float), &fail);
    }
    if (c->attn_gate) s->agate = xcalloc(B * q_dim, sizeof(float), &fail);
    if (c->ssm_interval && cf_deltanet_alloc(e)) fail = 1;
    if (c->rope_theta_local > 0) s->rope_local = xcalloc(B * e->hd_max, sizeof(float), &fail);
    if (c->ple_dim) {
        size_t lp = (size_t)c->n_layers * c->ple_dim, P = c->ple_dim;
        s->ple = xcalloc(B * lp, sizeof(float), &fail);
        s->ple_tok = xcalloc(B * lp, sizeof(float), &fail);
        s->ple_g = xcalloc(B * P, sizeof(float), &fail);
        s->ple_gu = xcalloc(B * 2 * P, sizeof(float), &fail);
        s->ple_h = xcalloc(B * P, sizeof(float), &fail);
    }
    s->ones = xcalloc(e->hd_max, sizeof(float), &fail);
    for (int i = 0; !fail && i < e->hd_max; i++) s->ones[i] = 1.0f;
    if (c->ffn_gelu || c->expert_act != CF_ACT_SILU) s->gu = xcalloc(hid_rows * 2 * e->hmax, sizeof(float), &fail);
    // calloc'd pages are mapped lazily, so a long context costs memory only once it is used
    s->kcache = xcalloc(e->n_seq, e->seq_kbytes, &fail);
    s->vcache = xcalloc(e->n_seq, e->seq_vbytes, &fail);
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
    e->hidden = xcalloc((size_t)B * c->d, sizeof(float), &fail);
    e->ts = xcalloc(e->n_threads, sizeof(cf_scratch), &fail);
    if (fail) return -1;
    memset(e->ones, 1, B);
    size_t K = e->kmax, KB = K / CF_QK, KK = (K + CF_QK_K - 1) / CF_QK_K, KS = (K / 16 * 2 + 3) / 4 * 4;
    /* one row more than a call's tokens: op_final sums each row's input there */
    size_t xb = (size_t)(e->max_batch + 1) * K * 4;
    /* per activation: d, s (32-block); dk, bsums (256-block); qs; qk */
    size_t scores = (size_t)cf_attn_score_rows(e) * e->n_ctx * 4, act = 2 * KB * 4 + KK * 4 + KS + 2 * K;
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
    e->xrel = calloc((size_t)n_keys * CF_EXPERT_SLOTS, sizeof *e->xrel);
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
        off[k] = len[k] = 0;
        if (k / E < c->n_dense_lead) continue; /* a leading dense layer: no experts, never routed */
        /* the expert's tensors (CF_E_* order): its matrices, and with moe_bias its biases */
        const void *at_[CF_EXPERT_SLOTS] = {L->exp_gate_up[k % E].data, L->exp_down[k % E].data,
                                            c->moe_bias ? L->exp_b_gate_up[k % E] : NULL,
                                            c->moe_bias ? L->exp_b_down[k % E] : NULL};
        uint64_t nb_[CF_EXPERT_SLOTS] = {cf_tiled_bytes(&L->exp_gate_up[k % E]), cf_tiled_bytes(&L->exp_down[k % E]),
                                         (uint64_t)2 * c->d_exp * sizeof(float), (uint64_t)c->d * sizeof(float)};
        off[k] = dx->span[2 * k];
        len[k] = dx->span[2 * k + 1];
        for (int j = 0; j < CF_EXPERT_SLOTS; j++) {
            if (!at_[j]) continue;
            int64_t at = (int64_t)((const uint8_t *)at_[j] - e->buf);
            e->xrel[(size_t)CF_EXPERT_SLOTS * k + j] = at - off[k];
            if (at < off[k] || at + (int64_t)nb_[j] > off[k] + len[k]) bad = k;
        }
    }
    if (bad >= 0) {
        cf_set_err(err, n, "the expert table says expert %d of layer %d spans %lld bytes at offset %lld, which do "
                "not hold its tensors; the file is inconsistent: re-convert it", bad % E, bad / E,
                (long long)len[bad], (long long)off[bad]);
    } else {
        cf_xstore_opts o = {.path = dx->path, .n_keys = n_keys, .n_experts = E, .offset = off, .nbytes = len,
                            .budget = dx->budget, .min_slots = cf_expert_min_slots(c->top_k, e->inflight), .async = dx->async,
                            .n_io = dx->n_io, .direct = dx->direct, .reader = dx->reader};
        e->xs = cf_xstore_open(&o, err, n);
        e->xasync = dx->async ? 1 : 0;
    }
    free(off);
    free(len);
    if (!e->xs) return -1;
    return cf_spec_open(e, dx->spec_depth, err, n);
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
    int dts[] = {CF_Q4_0, CF_Q4_1, CF_Q5_0, CF_Q5_1, CF_Q8_0, CF_Q4_K, CF_Q5_K, CF_Q6_K, CF_MXFP4};
    int missing = !e->k->quantize_act || !e->k->quantize_act_k || !e->k->rmsnorm ||
        !e->k->matvec_f32 || !e->k->softmax || !e->k->rope || !e->k->attention || !e->k->attention_block ||
        !e->k->embed_row || !e->k->f32_to_f16 || !e->k->topk || !e->k->attention_q8kv ||
        !e->k->attention_block_q8kv || !e->k->f32_to_q8_0 || !e->k->deltanet_head;
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
    e->vrow = cfg->mla_kv_lora ? 0 : cf_kv_row_bytes(v_type, cfg->hd); /* latent attention: V is K's latent */
    if (cfg->mla_kv_lora) e->v_type = k_type;
    e->n_ring = n_ring;
    e->n_pending = n_pending;
    e->n_moe = n_moe;
    e->buf = buf;
    e->n_ops = n_ops;
    if (cf_layer_geometry(e, err, err_len)) {
        cf_engine_free(e);
        return NULL;
    }
    e->hmax = cf_max(cf_max(cfg->d_ff, cfg->d_ff_shared_kv), cfg->n_experts ? cf_max(cfg->d_exp, cfg->d_shexp) : 0);
    e->kmax = cf_max(cf_max(cfg->d, cfg->n_heads * e->hd_max), e->hmax);
    e->kmax = cf_max(e->kmax, cfg->ssm_hv * cfg->ssm_dh); /* ssm.w_out's input (Gated DeltaNet) */
    e->attn_scale = cfg->attn_scale > 0 ? cfg->attn_scale : 1.0f / sqrtf((float)cfg->hd);
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
                (double)(e->seq_kbytes + e->seq_vbytes) * n_seq / 1048576.0);
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
    cf_spec_free(&e->spec);
    free(e->grp);
    if (e->w.sets) {
        for (int i = 0; i < e->c.n_unique; i++) {
            free(e->w.sets[i].exp_gate_up);
            free(e->w.sets[i].exp_down);
            free(e->w.sets[i].exp_bytes);
            free((void *)e->w.sets[i].exp_b_gate_up);
            free((void *)e->w.sets[i].exp_b_down);
        }
        free(e->w.sets);
    }
    cf_state *s = &e->s;
    void *bufs[] = {s->ring, s->h, s->f, s->pending, s->moe_in, s->qkv, s->att, s->hid, s->y,
                    s->rope, s->rope_local, s->gu, s->kcache, s->vcache, s->rlogits, s->exp_tok, s->exp_w, s->exp_n,
                    s->shexp_w, s->exp_list, s->exp_cnt, s->exp_pre, s->exp_slot, e->hits, e->plan,
                    e->rseq, e->rpos, e->seen, e->lrow, e->ablk, e->arow, e->ones, e->hidden, s->mla_a, s->mla_q,
                    s->mla_o, s->ple, s->ple_tok, s->ple_g, s->ple_gu, s->ple_h, s->ones, e->geo, s->agate};
    cf_deltanet_free(e);
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
    if (e->ts)
        for (int t = 0; t < e->n_threads; t++) free(e->ts[t].mem);
    free(e->ts);
    free(e);
}

// ---------------------------------------------------------------------------------------------
// accessors

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
    out->min_slots = cf_expert_min_slots(e->c.top_k, e->inflight);
    if (!e->xs) return 0;
    cf_xstore_info xi;
    cf_xstore_get_info(e->xs, &xi);
    out->n_slots = xi.n_slots;
    out->async = xi.async;
    out->n_io = xi.n_io;
    out->direct = xi.direct;
    out->slot_bytes = xi.slot_bytes;
    out->cache_bytes = xi.cache_bytes;
    out->spec_depth = e->spec.depth;
    out->spec_slots = e->spec.room;
    out->keep_depth = cf_max(0, e->spec.keep_depth); /* -1 (or 0: no speculation) until ranks are set */
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
// route traces (engine.h)

int cf_engine_set_routes(cf_engine *e, int mode, int32_t *chosen, int32_t *pred, int64_t n, int depth,
                         char *err, size_t nerr) {
    const cf_config *c = &e->c;
    int L = c->n_layers, K = c->top_k, E = c->n_experts;
    if (mode == CF_ROUTES_OFF) {
        memset(&e->routes, 0, sizeof e->routes);
        return 0;
    }
    if (mode != CF_ROUTES_RECORD && mode != CF_ROUTES_REPLAY)
        return cf_set_err(err, nerr, "route trace mode %d is not off (0), record (1) or replay (2)", mode), -1;
    if (E <= 0 || K <= 0)
        return cf_set_err(err, nerr, "the model routes no experts: there is nothing to record or replay"), -1;
    if (!chosen || n < 1 || depth < 0 || depth > CF_SPEC_MAX_DEPTH || (depth > 0 && !pred))
        return cf_set_err(err, nerr, "a route trace needs at least one row and 0..%d predicted layers "
                          "(got %lld rows, depth %d)", CF_SPEC_MAX_DEPTH, (long long)n, depth), -1;
    if (mode == CF_ROUTES_REPLAY) {
        int need = cf_min(e->spec.depth, L - 1);
        if (depth < need)
            return cf_set_err(err, nerr, "the trace predicts %d layers ahead, but this engine's expert "
                              "speculation looks %d ahead: record the trace with depth >= %d, or load the "
                              "engine with a shallower speculation depth", depth, need, need), -1;
        for (int64_t i = 0; i < n * L; i++) {
            const int32_t *row = chosen + i * K;
            for (int k = 0; k < K; k++) {
                if (row[k] < 0 || row[k] >= E)
                    return cf_set_err(err, nerr, "trace row %lld, layer %d: expert %d is not one of the "
                                      "model's %d", (long long)(i / L), (int)(i % L), row[k], E), -1;
                for (int j = 0; j < k; j++)
                    if (row[j] == row[k])
                        return cf_set_err(err, nerr, "trace row %lld, layer %d: expert %d chosen twice",
                                          (long long)(i / L), (int)(i % L), row[k]), -1;
            }
        }
        for (int64_t i = 0; i < n * L * depth; i++) { /* a layer past the last one predicts -1 */
            const int32_t *row = pred + i * K;
            int past = (int)(i / depth % L) + 1 + (int)(i % depth) >= L;
            for (int k = 0; k < K; k++)
                if (past ? row[k] != -1 : (row[k] < 0 || row[k] >= E))
                    return cf_set_err(err, nerr, "trace row %lld, layer %d, %d ahead: prediction %d is %s",
                                      (long long)(i / depth / L), (int)(i / depth % L), (int)(i % depth) + 1,
                                      row[k], past ? "not -1 past the last layer" : "not an expert of the model"), -1;
        }
    }
    e->routes = (cf_routes){mode, chosen, pred, n, depth, 0};
    return 0;
}

int64_t cf_engine_routes_pos(const cf_engine *e) { return e->routes.pos; }

static int64_t routes_row(const cf_engine *e, int b) {
    int64_t t = e->routes.pos + b;
    if (e->routes.mode == CF_ROUTES_REPLAY) return t % e->routes.n;
    return t < e->routes.n ? t : -1;
}

int32_t *cf_routes_chosen(const cf_engine *e, int b, int l) {
    if (!e->routes.mode) return NULL;
    int64_t t = routes_row(e, b);
    return t < 0 ? NULL : e->routes.chosen + ((size_t)t * e->c.n_layers + l) * e->c.top_k;
}

int32_t *cf_routes_pred(const cf_engine *e, int b, int l) {
    if (!e->routes.mode || !e->routes.depth) return NULL;
    int64_t t = routes_row(e, b);
    return t < 0 ? NULL : e->routes.pred + (((size_t)t * e->c.n_layers + l) * e->routes.depth) * e->c.top_k;
}
