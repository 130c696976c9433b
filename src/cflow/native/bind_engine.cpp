// bind_engine.cpp — the decode engine (engine.c) as `cflow._native.NativeEngine`, and the
// engine's contracts by name (engine.h's name tables as _native.OP_KINDS, LAYER_SLOTS, ...).
//
// Thin on purpose: arrays in, arrays out, no copies. The file buffer (usually a read-only numpy
// view of the mmap) is held by the object for the engine's life; logits are written straight into
// a numpy array the caller preallocates. step(), prefill() and step_batch() release the GIL.
// n_seq (a trailing keyword, default 1) gives the engine that many KV caches: prefill(..., seq)
// fills one, step_batch advances several in one pass over the weights (cf_step_batch), step_rows
// mixes prompt chunks and decode rows of several sequences in one pass (cf_step_rows).
//
// Experts on disk: `experts` is a dict {"path": str, "span": int64 [n_unique * E, 2] (the file's
// expert table: offset, bytes), "budget": int, "io": "async" | "sync", "io_threads": int,
// "direct": bool, "speculation_depth": int (optional, default 0 = off: expert speculation's depth,
// engine_spec.c), "reader": "auto" | "threads" | "uring-refused" | "inline" (optional, default
// "auto": io_uring where the kernel offers it; the last one is for tests, experts.h)}. A call that fails on expert I/O or a changed file raises OSError; bad input
// raises ValueError.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine.h"
#include "experts.h"

namespace nb = nanobind;

extern "C" int cf_d_split(int ng, int ith, int nth, int whole, int lo[2], int hi[2]); /* engine_internal.h */

namespace {

using Bytes = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Desc = nb::ndarray<const int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Plan = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Tokens = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Logits = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Logits2 = nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Ints = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Spans = nb::ndarray<const int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using RouteRows = nb::ndarray<int32_t, nb::ndim<3>, nb::c_contig, nb::device::cpu>;   // [n, L, top_k]
using RoutePreds = nb::ndarray<int32_t, nb::ndim<4>, nb::c_contig, nb::device::cpu>;  // [n, L, depth, top_k]

cf_config config_from(const nb::dict &d) {
    auto i = [&](const char *k) { return nb::cast<int>(d[k]); };
    auto f = [&](const char *k) { return nb::cast<float>(d[k]); };
    auto b = [&](const char *k) { return nb::cast<bool>(d[k]) ? 1 : 0; };
    cf_config c{};
    c.vocab = i("vocab_size");
    c.d = i("d_model");
    c.n_layers = i("n_layers");
    c.n_heads = i("n_heads");
    c.n_kv = i("n_kv_heads");
    c.hd = i("head_dim");
    c.d_ff = i("d_ff");
    c.n_experts = i("n_experts");
    c.top_k = i("top_k");
    c.d_exp = i("d_expert");
    c.n_unique = i("n_unique_layers");
    c.tie_embeddings = b("tie_embeddings");
    c.rope_theta = f("rope_theta");
    c.norm_eps = f("norm_eps");
    c.qkv_bias = b("qkv_bias");
    c.qk_norm = b("qk_norm");
    c.sliding_window = i("sliding_window");
    c.qk_norm_full = b("qk_norm_full");
    c.moe_norm_topk = b("moe_norm_topk");
    c.d_shexp = i("d_shared_expert");
    nb::sequence factors = nb::cast<nb::sequence>(d["rope_freq_factors"]);
    size_t nf = nb::len(factors);
    if (nf > (size_t)(CF_MAX_HEAD_DIM / 2))
        throw nb::value_error("rope_freq_factors: more than CF_MAX_HEAD_DIM / 2 values");
    c.n_rope_factors = (int)nf;
    for (size_t j = 0; j < nf; j++) c.rope_factors[j] = nb::cast<float>(factors[j]);
    c.rope_mscale = f("rope_mscale");
    c.swa_pattern = i("sliding_window_pattern");
    c.rope_theta_local = f("rope_theta_local");
    c.attn_scale = f("attn_scale");
    c.embed_scale = f("embed_scale");
    c.post_norms = b("post_norms");
    std::string act = nb::cast<std::string>(d["ffn_act"]);
    if (act != "silu" && act != "gelu_tanh")
        throw nb::value_error("ffn_act: the engine runs \"silu\" and \"gelu_tanh\"");
    c.ffn_gelu = act == "gelu_tanh";
    c.attn_temp_scale = f("attn_temp_scale");
    c.attn_temp_floor = i("attn_temp_floor");
    c.mla_kv_lora = i("kv_lora_rank");
    if (c.mla_kv_lora) { /* the engine's head is the absorbed one: a latent cache row (engine.h) */
        c.mla_q_lora = i("q_lora_rank");
        c.mla_qk = c.hd;
        c.mla_rope = i("qk_rope_dim");
        c.mla_v = i("v_head_dim");
        c.hd = c.mla_kv_lora + c.mla_rope;
    }
    c.n_dense_lead = i("n_dense_lead");
    c.moe_router_bias = b("moe_router_bias");
    c.moe_groups = i("moe_groups");
    c.moe_groups_used = i("moe_groups_used");
    c.moe_w_scale = f("moe_weights_scale");
    c.shexp_ungated = !b("shared_expert_gate");
    c.attn_sinks = b("attn_sinks");
    c.attn_out_bias = b("attn_out_bias");
    c.moe_bias = b("moe_bias");
    std::string gating = nb::cast<std::string>(d["moe_gating"]), eact = nb::cast<std::string>(d["expert_act"]);
    if (gating != "softmax" && gating != "softmax_topk" && gating != "sigmoid")
        throw nb::value_error("moe_gating: the engine runs \"softmax\", \"softmax_topk\" and \"sigmoid\"");
    if (eact != "silu" && eact != "swiglu_oai" && eact != "gelu_tanh")
        throw nb::value_error("expert_act: the engine runs \"silu\", \"swiglu_oai\" and \"gelu_tanh\"");
    c.moe_gating = gating == "softmax_topk" ? CF_GATING_SOFTMAX_TOPK
                   : gating == "sigmoid"    ? CF_GATING_SIGMOID
                                            : CF_GATING_SOFTMAX;
    c.expert_act = eact == "swiglu_oai" ? CF_ACT_SWIGLU_OAI : eact == "gelu_tanh" ? CF_ACT_GELU : CF_ACT_SILU;
    c.hd_local = i("head_dim_local");
    c.n_kv_local = i("n_kv_heads_local");
    c.n_shared_kv = i("shared_kv_layers");
    c.d_ff_shared_kv = i("d_ff_shared_kv");
    c.v_norm = b("v_norm");
    c.ple_dim = i("per_layer_dim");
    c.out_scale = b("layer_out_scale");
    c.logit_softcap = f("logit_softcap");
    c.moe_router_norm = b("moe_router_norm");
    c.expert_scale = b("expert_scale");
    c.moe_out_norms = b("moe_out_norms");
    c.ssm_interval = i("full_attn_interval"); /* Qwen3.5 (engine_deltanet.c) */
    c.ssm_hk = i("ssm_k_heads");
    c.ssm_hv = i("ssm_v_heads");
    c.ssm_dh = i("ssm_head_dim");
    c.ssm_conv = i("ssm_conv_kernel");
    c.n_rot = i("rope_dims");
    c.attn_gate = b("attn_out_gate");
    return c;
}

struct NativeEngine {
    cf_engine *e = nullptr;
    Bytes buf;  // keeps the mapped file alive
    int vocab = 0, n_layers = 0, n_experts = 0, top_k = 0, d_model = 0;
    bool keep = false;  // keep_hidden as last set

    NativeEngine(Bytes buffer, const nb::dict &cfg, Desc desc, const std::vector<std::string> &names,
                 Plan plan, int n_ring, int n_pending, int threads, int n_ctx, int max_batch, int n_moe,
                 nb::object experts, int n_seq, int k_type, int v_type)
        : buf(buffer) {
        cf_config c = config_from(cfg);
        cf_disk_experts disk{};
        std::string path, io;
        Spans span;
        if (!experts.is_none()) {
            nb::dict x = nb::cast<nb::dict>(experts);
            path = nb::cast<std::string>(x["path"]);
            span = nb::cast<Spans>(x["span"]);
            io = nb::cast<std::string>(x["io"]);
            if (io != "async" && io != "sync") throw nb::value_error("experts['io'] must be 'async' or 'sync'");
            size_t keys = (size_t)c.n_unique * (size_t)(c.n_experts > 0 ? c.n_experts : 0);
            if (span.shape(0) != keys || span.shape(1) != 2)
                throw nb::value_error(("experts['span'] must have shape [" + std::to_string(keys) +
                                       ", 2]: (offset, bytes) per weight set and expert").c_str());
            disk.path = path.c_str();
            disk.span = span.data();
            disk.budget = nb::cast<int64_t>(x["budget"]);
            disk.async = io == "async";
            disk.n_io = nb::cast<int>(x["io_threads"]);
            disk.direct = nb::cast<bool>(x["direct"]) ? 1 : 0;
            disk.spec_depth = x.contains("speculation_depth") ? nb::cast<int>(x["speculation_depth"]) : 0;
            if (x.contains("reader")) {
                std::string r = nb::cast<std::string>(x["reader"]);
                disk.reader = -1;
                for (int k = 0; k < CF_XREADER_KINDS; k++)
                    if (r == cf_xreader_names[k]) disk.reader = k;
                if (disk.reader < 0)
                    throw nb::value_error(("experts['reader'] must be one of _native.EXPERT_READERS, got '" + r +
                                           "'").c_str());
            }
        }
        if (desc.shape(1) != CF_DESC_FIELDS || plan.shape(1) != CF_OP_FIELDS)
            throw nb::value_error("descriptor or plan array has the wrong width");
        if (names.size() != desc.shape(0))
            throw nb::value_error(("names has " + std::to_string(names.size()) + " entries, the descriptor has " +
                                   std::to_string(desc.shape(0)) + " rows; give one tensor name per row").c_str());
        std::vector<const char *> name_ptrs;
        for (const std::string &s : names) name_ptrs.push_back(s.c_str());
        char err[512] = {0};
        e = cf_engine_create(&c, buf.data(), buf.shape(0), desc.data(), name_ptrs.data(),
                             (int)desc.shape(0), plan.data(), (int)plan.shape(0), n_ring, n_pending, n_moe,
                             threads, n_ctx, max_batch, n_seq, k_type, v_type, experts.is_none() ? nullptr : &disk, err, sizeof err);
        if (!e) throw nb::value_error(err);
        vocab = c.vocab;
        d_model = c.d;
        n_layers = c.n_layers;
        n_experts = c.n_experts;
        top_k = c.top_k;
    }
    ~NativeEngine() { cf_engine_free(e); }

    // The route trace's arrays: the engine writes or reads them during calls, so they live here
    // while the mode is on (engine.h, cf_engine_set_routes).
    RouteRows route_chosen;
    RoutePreds route_pred;

    void set_routes(int mode, nb::object chosen, nb::object pred) {
        char err[512] = {0};
        if (mode == CF_ROUTES_OFF) {
            cf_engine_set_routes(e, mode, nullptr, nullptr, 0, 0, err, sizeof err);
            route_chosen = RouteRows();
            route_pred = RoutePreds();
            return;
        }
        RouteRows c = nb::cast<RouteRows>(chosen);
        RoutePreds p = pred.is_none() ? RoutePreds() : nb::cast<RoutePreds>(pred);
        int depth = pred.is_none() ? 0 : (int)p.shape(2);
        int K = top_k;
        if ((int)c.shape(1) != n_layers || (int)c.shape(2) != K)
            throw nb::value_error(("chosen must have shape [rows, " + std::to_string(n_layers) + ", " +
                                   std::to_string(K) + "] (layers, top_k)").c_str());
        if (!pred.is_none() && (p.shape(0) != c.shape(0) || (int)p.shape(1) != n_layers || (int)p.shape(3) != K))
            throw nb::value_error(("pred must have shape [rows, " + std::to_string(n_layers) + ", depth, " +
                                   std::to_string(K) + "] with chosen's rows").c_str());
        if (cf_engine_set_routes(e, mode, c.data(), depth ? p.data() : nullptr, (int64_t)c.shape(0), depth, err,
                                 sizeof err))
            throw nb::value_error(err);
        route_chosen = c;
        route_pred = p;
    }

    // A failed call: OSError for expert I/O or a changed file (the caller names the file), else
    // ValueError.
    [[noreturn]] void raise_call_error() const {
        if (cf_engine_error_kind(e) == CF_ERR_IO) {
            PyErr_SetString(PyExc_OSError, cf_engine_error(e));
            throw nb::python_error();
        }
        throw nb::value_error(cf_engine_error(e));
    }

    nb::object expert_cache() const {
        cf_expert_cache_info x;
        if (!cf_engine_expert_cache(e, &x)) return nb::none();
        nb::dict d;
        d["slots"] = x.n_slots;
        d["slot_bytes"] = x.slot_bytes;
        d["cache_bytes"] = x.cache_bytes;
        d["min_slots"] = x.min_slots;
        d["layers_in_flight"] = x.inflight;
        d["io"] = x.async ? "async" : "sync";
        d["io_threads"] = x.n_io;
        d["read"] = x.direct ? "O_DIRECT" : "buffered";
        d["speculation"] = x.spec_depth ? (x.spec_depth == 1 ? "next-layer" : std::to_string(x.spec_depth) + " layers")
                                        : "off";
        d["speculation_depth"] = x.spec_depth;
        d["speculation_slots"] = x.spec_slots;
        d["keep_depth"] = x.keep_depth;
        d["reader"] = x.async ? (x.uring ? "io_uring" : x.n_io ? "threads" : "inline") : "caller";
        d["reader_note"] = x.reader_note ? x.reader_note : "";
        return d;
    }

    nb::list expert_resident() const {
        cf_expert_cache_info x;
        nb::list out;
        if (!cf_engine_expert_cache(e, &x)) return out;
        std::vector<int> keys((size_t)x.n_slots + 1);
        int n = cf_engine_expert_resident(e, keys.data());
        for (int i = 0; i < n; i++) out.append(nb::make_tuple(keys[i] / n_experts, keys[i] % n_experts));
        return out;
    }

    void inject_io_fault(int64_t after, const std::string &kind, int delay_ms) {
        for (int k = 0; k < CF_XFAULT_KINDS; k++)
            if (kind == cf_xfault_names[k]) {
                if (cf_engine_inject_io_fault(e, after, k, delay_ms * 1000))
                    throw nb::value_error("fault injection needs experts on disk and after >= 0");
                return;
            }
        throw nb::value_error("fault kind must be 'none', 'eio' or 'short'");
    }

    float *logits_ptr(Logits &logits) {
        if (logits.shape(0) != (size_t)vocab)
            throw nb::value_error(("logits must have " + std::to_string(vocab) + " entries").c_str());
        return logits.data();
    }

    void step(int token, int pos, Logits logits) {
        float *out = logits_ptr(logits);
        int rc;
        {
            nb::gil_scoped_release nogil;
            rc = cf_step(e, token, pos, out);
        }
        if (rc) raise_call_error();
    }

    void prefill(Tokens tokens, int pos0, nb::object logits_obj, int seq) {
        float *out = nullptr;
        Logits logits;
        if (!logits_obj.is_none()) {
            logits = nb::cast<Logits>(logits_obj);
            out = logits_ptr(logits);
        }
        int rc;
        {
            nb::gil_scoped_release nogil;
            rc = cf_prefill_seq(e, seq, tokens.data(), (int)tokens.shape(0), pos0, out);
        }
        if (rc) raise_call_error();
    }

    void step_batch(Ints seqs, Tokens tokens, Ints positions, Logits2 logits) {
        size_t B = seqs.shape(0);
        if (tokens.shape(0) != B || positions.shape(0) != B)
            throw nb::value_error(("step_batch: seqs, tokens and positions must have the same length, got " +
                                   std::to_string(B) + ", " + std::to_string(tokens.shape(0)) + ", " +
                                   std::to_string(positions.shape(0))).c_str());
        if (logits.shape(0) < B || logits.shape(1) != (size_t)vocab)
            throw nb::value_error(("step_batch: logits must be float32 [>= " + std::to_string(B) + ", " +
                                   std::to_string(vocab) + "]").c_str());
        int rc;
        {
            nb::gil_scoped_release nogil;
            rc = cf_step_batch(e, seqs.data(), tokens.data(), positions.data(), (int)B, logits.data());
        }
        if (rc) raise_call_error();
    }

    void step_rows(Ints seqs, Tokens tokens, Ints positions, Bytes want, Logits2 logits) {
        size_t B = seqs.shape(0), nw = 0;
        if (tokens.shape(0) != B || positions.shape(0) != B || want.shape(0) != B)
            throw nb::value_error(("step_rows: seqs, tokens, positions and want must have the same length, got " +
                                   std::to_string(B) + ", " + std::to_string(tokens.shape(0)) + ", " +
                                   std::to_string(positions.shape(0)) + ", " + std::to_string(want.shape(0))).c_str());
        for (size_t b = 0; b < B; b++) nw += want.data()[b] != 0;
        if (logits.shape(0) < nw || logits.shape(1) != (size_t)vocab)
            throw nb::value_error(("step_rows: logits must be float32 [>= " + std::to_string(nw) + ", " +
                                   std::to_string(vocab) + "]").c_str());
        int rc;
        {
            nb::gil_scoped_release nogil;
            rc = cf_step_rows(e, seqs.data(), tokens.data(), positions.data(), want.data(), (int)B, logits.data());
        }
        if (rc) raise_call_error();
    }

    // The last pass's final normed hidden states (cf_engine_hidden) copied into out[:n]; returns n.
    int hidden(Logits2 out) const {
        const float *h;
        int n = cf_engine_hidden(e, &h);
        if (out.shape(0) < (size_t)n || out.shape(1) != (size_t)d_model)
            throw nb::value_error(("hidden: out must be float32 [>= " + std::to_string(n) + ", " +
                                   std::to_string(d_model) + "]").c_str());
        std::memcpy(out.data(), h, (size_t)n * d_model * sizeof(float));
        return n;
    }

    // The lm_head's logits of the rows x [n, d] into out [n, vocab] (cf_engine_lm_head).
    void lm_head(Logits2 x, Logits2 out) {
        if (x.shape(1) != (size_t)d_model || out.shape(0) != x.shape(0) || out.shape(1) != (size_t)vocab)
            throw nb::value_error(("lm_head: x must be float32 [n, " + std::to_string(d_model) + "] and out [n, " +
                                   std::to_string(vocab) + "]").c_str());
        int rc;
        {
            nb::gil_scoped_release nogil;
            rc = cf_engine_lm_head(e, x.data(), (int)x.shape(0), out.data());
        }
        if (rc) raise_call_error();
    }

    nb::dict counters() const {
        cf_counters c;
        cf_engine_counters(e, &c);
        nb::dict d;
        for (int i = 0; i < CF_COUNTERS; i++) d[cf_counter_names[i]] = c.n[i];
        return d;
    }

    // Profiling (engine.h): the raw records as bytes, which cflow.runtime.engine views with numpy
    // dtypes of the same layout (int64 t0, t1; int32 kind, layer / rows, pad).
    void profile_start(int calls) {
        if (calls < 1) throw nb::value_error("profile_start: calls must be >= 1");
        if (cf_engine_profile_start(e, calls)) throw std::bad_alloc();
    }

    nb::bytes profile_events(int thread) const {
        const cf_prof_event *ev;
        int n = cf_engine_profile_events(e, thread, &ev);
        return nb::bytes(reinterpret_cast<const char *>(ev), n > 0 ? (size_t)n * sizeof *ev : 0);
    }

    nb::bytes profile_calls() const {
        const cf_prof_call *c;
        int n = cf_engine_profile_calls(e, &c);
        return nb::bytes(reinterpret_cast<const char *>(c), n > 0 ? (size_t)n * sizeof *c : 0);
    }

    nb::list expert_hits() const {
        size_t n = (size_t)n_layers * n_experts;
        uint64_t *tmp = new uint64_t[n ? n : 1];
        cf_engine_expert_hits(e, tmp);
        nb::list out;
        for (int l = 0; l < n_layers; l++) {
            nb::list row;
            for (int x = 0; x < n_experts; x++) row.append(tmp[(size_t)l * n_experts + x]);
            out.append(row);
        }
        delete[] tmp;
        return out;
    }
};

// ---- contracts by name ---------------------------------------------------------------------

// The n names of a C name table, in enum order. A NULL entry is an enum value engine.c (or
// formats.c) gave no name: refuse to import rather than hand Python a table with a hole.
std::vector<std::string> table_names(const char *const *table, int n, const char *what) {
    std::vector<std::string> v;
    for (int i = 0; i < n; i++) {
        if (!table[i]) throw std::runtime_error(std::string(what) + "[" + std::to_string(i) + "] has no name");
        v.emplace_back(table[i]);
    }
    return v;
}

nb::tuple as_tuple(const std::vector<std::string> &v) { return nb::tuple(nb::cast(v)); }

nb::dict as_index(const std::vector<std::string> &v) {
    nb::dict d;
    for (size_t i = 0; i < v.size(); i++) d[v[i].c_str()] = (int)i;
    return d;
}

void bind_contracts(nb::module_ &m) {
    m.attr("OP_KINDS") = as_tuple(table_names(cf_op_kind_names, CF_OP_KINDS, "cf_op_kind_names"));
    m.attr("OP_FIELDS") = (int)CF_OP_FIELDS;
    m.attr("SOURCES") = as_index(table_names(cf_src_names, CF_SRC_KINDS, "cf_src_names"));
    m.attr("DESC_FIELDS") = as_tuple(table_names(cf_desc_field_names, CF_DESC_FIELDS, "cf_desc_field_names"));
    m.attr("GLOBAL_TENSORS") = as_tuple(table_names(cf_global_names, CF_T_GLOBAL, "cf_global_names"));
    m.attr("LAYER_SLOTS") = as_tuple(table_names(cf_slot_names, CF_SLOTS_PER_SET, "cf_slot_names"));
    m.attr("EXPERT_SLOTS") = as_tuple(table_names(cf_expert_slot_names, CF_EXPERT_SLOTS, "cf_expert_slot_names"));
    m.attr("COUNTER_NAMES") = as_tuple(table_names(cf_counter_names, CF_COUNTERS, "cf_counter_names"));
    m.attr("PROFILE_KINDS") = as_tuple(table_names(cf_prof_kind_names, CF_PROF_KINDS, "cf_prof_kind_names"));
    // dtype ids are GGML's, with holes: names by id where the core has one
    nb::dict ids;
    std::vector<std::string> dtypes;
    for (int i = 0; i < CF_DTYPE_IDS; i++)
        if (cf_dtype_names[i]) {
            ids[cf_dtype_names[i]] = i;
            dtypes.emplace_back(cf_dtype_names[i]);
        }
    m.attr("DTYPE_IDS") = ids;
    m.attr("DTYPES") = as_tuple(dtypes);
    // the block geometry the kernels and cf_tiled_bytes size tensors by, one (name, id, block
    // weights, block bytes) row per dtype by id: cflow.runtime.abi holds it against cflow.dtypes
    nb::list table;
    for (int i = 0; i < CF_DTYPE_IDS; i++)
        if (cf_dtype_names[i])
            table.append(nb::make_tuple(cf_dtype_names[i], i, cf_block_weights(i), (int)cf_block_bytes(i)));
    m.attr("DTYPE_TABLE") = nb::tuple(table);
    m.attr("ROW_GROUP") = (int)CF_G;  // rows per interleaved group in a tile (cflow.quant.G)
    // the enum counts, by their C names, so tests can hold the tuples against the enums
    nb::dict counts;
    counts["CF_OP_KINDS"] = (int)CF_OP_KINDS;
    counts["CF_SRC_KINDS"] = (int)CF_SRC_KINDS;
    counts["CF_DESC_FIELDS"] = (int)CF_DESC_FIELDS;
    counts["CF_T_GLOBAL"] = (int)CF_T_GLOBAL;
    counts["CF_SLOTS_PER_SET"] = (int)CF_SLOTS_PER_SET;
    counts["CF_EXPERT_SLOTS"] = (int)CF_EXPERT_SLOTS;
    counts["CF_COUNTERS"] = (int)CF_COUNTERS;
    counts["CF_PROF_KINDS"] = (int)CF_PROF_KINDS;
    counts["CF_DTYPE_IDS"] = (int)CF_DTYPE_IDS;
    counts["CF_XFAULT_KINDS"] = (int)CF_XFAULT_KINDS;
    counts["CF_XREADER_KINDS"] = (int)CF_XREADER_KINDS;
    m.attr("ENUM_COUNTS") = counts;
    // the older names of two of the above (cflow.engine checks them)
    m.attr("MAX_THREADS") = (int)CF_MAX_THREADS;
    m.attr("SPEC_MAX_DEPTH") = (int)CF_SPEC_MAX_DEPTH;
    m.attr("IO_FAULTS") = as_tuple(table_names(cf_xfault_names, CF_XFAULT_KINDS, "cf_xfault_names"));
    m.attr("EXPERT_READERS") = as_tuple(table_names(cf_xreader_names, CF_XREADER_KINDS, "cf_xreader_names"));
    m.attr("EXPERT_ALIGN") = (int)CF_XALIGN;
    m.attr("EXPERT_VISIT_SCORE") = (int)CF_XVISIT_SCORE;
    m.def("expert_min_slots", [](int top_k, int inflight) { return cf_expert_min_slots(top_k, inflight); },
          nb::arg("top_k"), nb::arg("inflight"), "the smallest expert cache an engine accepts, in slots");
    m.def("d_split", [](int ng, int ith, int nth, bool whole) {
        if (ng < 0 || nth < 1 || ith < 0 || ith >= nth) throw nb::value_error("d_split needs ng >= 0, 0 <= ith < nth");
        int lo[2], hi[2], n = cf_d_split(ng, ith, nth, whole, lo, hi);
        std::vector<std::pair<int, int>> out;
        for (int i = 0; i < n; i++) out.emplace_back(lo[i], hi[i]);
        return out;
    }, nb::arg("ng"), nb::arg("ith"), nb::arg("nth"), nb::arg("whole") = true,
    "the row-group ranges [lo, hi) of a [d, *] mat-vec (wo, down) that thread ith of nth owns, in the "
    "order it runs them (engine.c, d_split; whole: a one-row call's split)");
    m.def("plan_inflight", [](Plan plan, int n_moe) {
        if (plan.shape(1) != CF_OP_FIELDS) throw nb::value_error("plan array has the wrong width");
        return cf_plan_inflight(plan.data(), (int)plan.shape(0), n_moe);
    }, nb::arg("plan"), nb::arg("n_moe"),
    "layers in flight in an encoded plan (routes not yet followed by their experts op); -1 if the "
    "plan pairs routes and experts wrongly. The expert cache must hold top_k times this many.");
}

}  // namespace

void cf_bind_engine(nb::module_ &m) {
    bind_contracts(m);
    nb::class_<NativeEngine>(m, "NativeEngine",
                             "The C decode engine over one mapped .cflow file (see cflow.runtime.engine).\n"
                             "names[i] is the tensor name of descriptor row i; the engine checks each against "
                             "its own (GLOBAL_TENSORS, then per weight set LAYER_SLOTS and EXPERT_SLOTS).")
        .def(nb::init<Bytes, const nb::dict &, Desc, const std::vector<std::string> &, Plan, int, int, int, int,
                      int, int, nb::object, int, int, int>(),
             nb::arg("buffer"), nb::arg("config"), nb::arg("desc"), nb::arg("names"), nb::arg("plan"),
             nb::arg("n_ring"), nb::arg("n_pending"), nb::arg("threads"), nb::arg("n_ctx"),
             nb::arg("max_batch"), nb::arg("n_moe") = 1, nb::arg("experts") = nb::none(), nb::arg("n_seq") = 1,
             nb::arg("k_type") = (int)CF_F16, nb::arg("v_type") = (int)CF_F16)
        .def("step", &NativeEngine::step, nb::arg("token"), nb::arg("pos"), nb::arg("logits"),
             "Run one token at position pos; write next-token logits into `logits` (float32[vocab]).")
        .def("prefill", &NativeEngine::prefill, nb::arg("tokens"), nb::arg("pos0"),
             nb::arg("logits") = nb::none(), nb::arg("seq") = 0,
             "Run tokens (int32) at positions pos0.. of sequence `seq`; logits of the last one go into `logits`.")
        .def("step_batch", &NativeEngine::step_batch, nb::arg("seqs"), nb::arg("tokens"), nb::arg("positions"),
             nb::arg("logits"),
             "One decode step for B distinct sequences (int32 arrays of B): row b runs tokens[b] at "
             "positions[b] of sequence seqs[b]; its logits go into logits[b] (float32 [>= B, vocab]). "
             "Rows are bit-identical to running each alone.")
        .def("step_rows", &NativeEngine::step_rows, nb::arg("seqs"), nb::arg("tokens"), nb::arg("positions"),
             nb::arg("want"), nb::arg("logits"),
             "B rows of any sequences in one pass (int32 arrays of B, want uint8): row b runs tokens[b] at "
             "positions[b] of sequence seqs[b]; a sequence's rows come in order at consecutive positions. "
             "The logits of the rows with want[b] != 0 go into logits[0..], in row order.")
        .def("copy_seq", [](NativeEngine &s, int src, int dst, int n) {
                if (cf_engine_copy_seq(s.e, src, dst, n)) s.raise_call_error();
            }, nb::arg("src"), nb::arg("dst"), nb::arg("n"),
             "Copy positions 0..n-1 of sequence src's KV cache into sequence dst's.")
        .def("hidden", &NativeEngine::hidden, nb::arg("out"),
             "copy the final normed hidden states of the rows whose logits the last pass wrote into "
             "out[:n] (keep_hidden must be on); returns n")
        .def("lm_head", &NativeEngine::lm_head, nb::arg("x"), nb::arg("out"),
             "the lm_head's logits of the normed rows x [n, d] into out [n, vocab] (multi-token heads' outputs)")
        .def("counters", &NativeEngine::counters, "Bytes touched by category since reset_counters().")
        .def("expert_hits", &NativeEngine::expert_hits, "Routing counts per [layer][expert].")
        .def("reset_counters", [](NativeEngine &s) { cf_engine_reset_counters(s.e); })
        .def("set_routes", &NativeEngine::set_routes, nb::arg("mode"), nb::arg("chosen").none(),
             nb::arg("pred").none(),
             "record (1) or replay (2) a route trace in these int32 arrays, or stop (0): chosen [rows, L, top_k], "
             "pred [rows, L, depth, top_k] or None (engine.h, cf_engine_set_routes)")
        .def_prop_ro("routes_pos", [](const NativeEngine &s) { return cf_engine_routes_pos(s.e); },
                     "trace rows recorded or replayed since the mode was set")
        .def("profile_start", &NativeEngine::profile_start, nb::arg("calls"),
             "record per-thread phase timings for the next `calls` forward calls (buffers allocated now; "
             "a step is one call, a prefill one per max_batch tokens)")
        .def("profile_stop", [](NativeEngine &s) { cf_engine_profile_stop(s.e); },
             "stop recording (what was recorded stays readable)")
        .def("profile_free", [](NativeEngine &s) { cf_engine_profile_free(s.e); }, "stop and free the buffers")
        .def_prop_ro("profiling", [](const NativeEngine &s) { return cf_engine_profiling(s.e) != 0; })
        .def("profile_events", &NativeEngine::profile_events, nb::arg("thread"),
             "thread's events as bytes of {int64 t0, t1 (CLOCK_MONOTONIC ns); int32 kind, layer}")
        .def("profile_calls", &NativeEngine::profile_calls,
             "the profiled calls as bytes of {int64 t0, t1; int32 rows, pad}")
        .def_prop_ro("profile_dropped", [](const NativeEngine &s) { return cf_engine_profile_dropped(s.e); })
        .def_prop_ro("profile_events_per_call",
                     [](const NativeEngine &s) { return cf_engine_profile_events_per_call(s.e); })
        .def_prop_ro("expert_cache", &NativeEngine::expert_cache,
                     "the expert cache (slots, slot_bytes, cache_bytes, min_slots, layers_in_flight, io, "
                     "io_threads, read, speculation, speculation_depth, speculation_slots, keep_depth, reader, reader_note); "
                     "None when the experts are in RAM")
        .def("expert_resident", &NativeEngine::expert_resident,
             "(layer, expert) of every expert the cache holds now")
        .def("_inject_io_fault", &NativeEngine::inject_io_fault, nb::arg("after"), nb::arg("kind"),
             nb::arg("delay_ms") = 0,
             "test only: the read `after` reads from now fails once ('eio', 'short'; 'none' disarms), "
             "delay_ms after it starts")
        .def_prop_ro("n_ctx", [](const NativeEngine &s) { return cf_engine_n_ctx(s.e); })
        .def_prop_ro("threads", [](const NativeEngine &s) { return cf_engine_n_threads(s.e); })
        .def_prop_rw(
            "active_threads", [](const NativeEngine &s) { return cf_engine_active_threads(s.e); },
            [](NativeEngine &s, int n) { cf_engine_set_active_threads(s.e, n); },
            "threads the next calls use (1..threads); outputs do not depend on it")
        .def_prop_rw(
            "overlap", [](const NativeEngine &s) { return cf_engine_overlap(s.e) != 0; },
            [](NativeEngine &s, bool on) {
                if (cf_engine_set_overlap(s.e, on)) throw std::bad_alloc();
            },
            "run attn(l) beside dense(l) on two thread groups when delta_dense >= 1 (off by default); "
            "outputs do not depend on it")
        .def_prop_rw(
            "prefetch", [](const NativeEngine &s) { return cf_engine_prefetch(s.e); },
            [](NativeEngine &s, int mode) {
                if (cf_engine_set_prefetch(s.e, mode))
                    throw nb::value_error(("prefetch must be -1 (the kernels' default), 0 (off) or 1.." +
                                           std::to_string(CF_PREFETCH_MAX) + " bytes ahead, got " +
                                           std::to_string(mode)).c_str());
            },
            "software prefetch of this engine's calls: -1 the kernels' default, 0 off, N > 0 PREFETCHT0 N "
            "bytes ahead in every weight-streaming kernel; outputs do not depend on it")
        .def_prop_rw(
            "keep_hidden", [](const NativeEngine &s) { return s.keep; },
            [](NativeEngine &s, bool on) {
                cf_engine_set_keep_hidden(s.e, on);
                s.keep = on;
            },
            "keep the final normed hidden state of every row that gets logits, for hidden() (off by "
            "default; the logits do not depend on it)")
        .def_prop_ro("max_batch", [](const NativeEngine &s) { return cf_engine_max_batch(s.e); })
        .def_prop_ro("n_seq", [](const NativeEngine &s) { return cf_engine_n_seq(s.e); })
        .def_prop_ro("isa", [](const NativeEngine &s) { return std::string(cf_engine_isa(s.e)); });
}
