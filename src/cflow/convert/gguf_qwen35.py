"""Reading a qwen35 / qwen35moe GGUF (Qwen3.5): its geometry as llama.cpp reads it, and its tensors
in cflow's table (cflow.weights: SSM_SLOTS, attn.w_gate).

The graph is cflow.model_qwen35's (held to llama.cpp by tests/test_qwen35.py, whose module
docstring has the file's layout). What this module reads, and what it refuses by name:
- layer il is full attention when (il + 1) % full_attention_interval == 0, a Gated DeltaNet layer
  otherwise; ssm.group_count (Hk), ssm.time_step_rank (Hv), ssm.state_size (the head dim, for keys
  and values alike), ssm.conv_kernel, and ssm.inner_size, which must be Hv x state_size;
- partial RoPE: rope.dimension_count of each head turn (NEOX). The M-RoPE sections must cover
  exactly those dims: for text every section carries the token's position, so they rotate as one;
- attn_q [H 2 hd, d] holds per head hd query rows then hd gate rows: the query rows go into
  attn.wqkv (with attn_k, attn_v), the gate rows into attn.w_gate, both moved as whole rows
  (lossless on blocks);
- the DeltaNet layer's f32 parts (ssm_conv1d, ssm_dt.bias, ssm_a, ssm_norm) stay f32; attn_qkv,
  attn_gate, ssm_alpha, ssm_beta and ssm_out are matrices (alpha and beta too: llama.cpp runs them
  on int8 activations like the others, and the decays and rates amplify that rounding, so the
  engine runs them the same way);
- the norm before the FFN is post_attention_norm; qwen35moe's FFN is the softmax router over all
  experts with the top-k renormalised, and a shared expert gated by sigmoid(ffn_gate_inp_shexp . x);
- multi-token prediction layers (nextn_predict_layers, *.nextn.* tensors) and vision towers are
  refused by name.
"""

from __future__ import annotations

import numpy as np

from cflow.convert.gguf import (GGUFError, GGUFModel, UnsupportedArchitectureError, _check_shape, _expert_sources,
                                plain_vector, refuse_vision, stacked_sources)

ARCHS = ("qwen35", "qwen35moe")
# GGUF names per cflow slot (cflow.weights): matrices and plain tensors of a layer
_MATRICES = {"ssm.w_qkv": "attn_qkv", "ssm.w_z": "attn_gate", "ssm.w_out": "ssm_out", "ssm.w_alpha": "ssm_alpha",
             "ssm.w_beta": "ssm_beta", "attn.wo": "attn_output",
             "ffn.w_down": "ffn_down", "moe.shared.w_down": "ffn_down_shexp"}
_GATE_UPS = {"ffn.w_gate_up": ("ffn_gate", "ffn_up"), "moe.shared.w_gate_up": ("ffn_gate_shexp", "ffn_up_shexp")}
_PLAIN = {"attn_norm": "attn_norm.weight", "ffn_norm": "post_attention_norm.weight",
          "moe_norm": "post_attention_norm.weight", "attn.q_norm": "attn_q_norm.weight",
          "attn.k_norm": "attn_k_norm.weight", "ssm.dt_bias": "ssm_dt.bias", "ssm.a": "ssm_a",
          "ssm.norm": "ssm_norm.weight", "moe.shared_gate": "ffn_gate_inp_shexp.weight"}
_FLOAT_MATRICES = {"ssm.conv": "ssm_conv1d.weight", "moe.router": "ffn_gate_inp.weight"}
_GLOBAL = {"tok_emb": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}
_SSM_TENSORS = ("attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_alpha.weight", "ssm_dt.bias", "ssm_a",
                "ssm_beta.weight", "ssm_norm.weight", "ssm_out.weight")
_ATTN_TENSORS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q_norm.weight", "attn_k_norm.weight",
                 "attn_output.weight")


def qwen35_config(g: GGUFModel):
    """The engine's ModelConfig of a qwen35 / qwen35moe file (module docstring)."""
    from cflow.config import ConfigError, ModelConfig

    arch, name = g.architecture, g.path.name
    if arch not in ARCHS:
        raise GGUFError(f"{name} is a {arch!r} model, not one of {ARCHS}")
    refuse_vision(g)
    p = f"{arch}."
    req = lambda k: int(g.require(p + k))  # noqa: E731
    mtp = int(g.get(p + "nextn_predict_layers") or 0)
    nextn = sorted(n for n in g.tensors if ".nextn." in n)
    if mtp or nextn:
        raise UnsupportedArchitectureError(
            f"{name} carries multi-token prediction layers ({p}nextn_predict_layers = {mtp}, tensors such as "
            f"{nextn[:2]}); cflow does not run Qwen3.5's MTP layers: convert a file without them")
    n_heads, hd = req("attention.head_count"), req("attention.key_length")
    if int(g.get(p + "attention.value_length") or hd) != hd:
        raise GGUFError(f"{name}: value heads of another size than key heads ({p}attention.value_length); unsupported")
    rot = int(g.get(p + "rope.dimension_count") or hd)
    sections = [int(x) for x in (g.get(p + "rope.dimension_sections") or [])]
    if sections and 2 * sum(sections) != rot:
        raise GGUFError(f"{name}: the M-RoPE sections {sections} cover {2 * sum(sections)} dims, rope.dimension_count "
                        f"says {rot}; cflow runs text, where every section turns by the token's position")
    hk, hv, dh = req("ssm.group_count"), req("ssm.time_step_rank"), req("ssm.state_size")
    if req("ssm.inner_size") != hv * dh:
        raise GGUFError(f"{name}: {p}ssm.inner_size {req('ssm.inner_size')} is not ssm.time_step_rank x "
                        f"ssm.state_size = {hv * dh}")
    emb = g.tensors.get("token_embd.weight")
    if emb is None:
        raise GGUFError(f"{name} lacks token_embd.weight")
    if arch == "qwen35moe":
        n_experts, top_k = req("expert_count"), req("expert_used_count")
        ffn = dict(d_ff=0, n_experts=n_experts, top_k=top_k, d_expert=req("expert_feed_forward_length"),
                   d_shared_expert=req("expert_shared_feed_forward_length"), moe_norm_topk=True, moe_input="post_attn")
    else:
        ffn = dict(d_ff=req("feed_forward_length"), n_experts=0, top_k=0, d_expert=0)
    try:
        return ModelConfig(
            vocab_size=int(emb.shape[1]), d_model=req("embedding_length"), n_layers=req("block_count"),
            n_heads=n_heads, n_kv_heads=int(g.get(p + "attention.head_count_kv") or n_heads), head_dim=hd,
            rope_theta=float(g.get(p + "rope.freq_base") or 10000.0),
            norm_eps=float(g.get(p + "attention.layer_norm_rms_epsilon") or 1e-6),
            max_seq_len=int(g.get(p + "context_length") or 4096), tie_embeddings="output.weight" not in g.tensors,
            qk_norm=True, delta_dense=0, delta_expert=0, full_attn_interval=req("full_attention_interval"),
            ssm_k_heads=hk, ssm_v_heads=hv, ssm_head_dim=dh, ssm_conv_kernel=req("ssm.conv_kernel"),
            rope_dims=rot if rot != hd else 0, attn_out_gate=True, name=arch, **ffn)
    except ConfigError as e:
        raise GGUFError(f"{name}: its hyperparameters do not form a valid model: {e}") from None


def _check_names(g: GGUFModel, cfg) -> None:
    """Exactly the tensors the config implies: a missing one or one cflow would drop is refused."""
    want = {"token_embd.weight", "output_norm.weight"} | ({"output.weight"} if not cfg.tie_embeddings else set())
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        want |= {b + "attn_norm.weight", b + "post_attention_norm.weight"}
        want |= {b + n for n in (_SSM_TENSORS if cfg.is_recurrent(i) else _ATTN_TENSORS)}
        if cfg.has_moe:
            want |= {b + n + ".weight" for n in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                                                 "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp",
                                                 "ffn_down_shexp")}
        else:
            want |= {b + n + ".weight" for n in ("ffn_gate", "ffn_up", "ffn_down")}
    have = set(g.tensors)
    missing, extra = sorted(want - have), sorted(have - want)
    if missing:
        raise GGUFError(f"{g.path.name} lacks tensors {missing[:6]}; is it a complete {cfg.name} model?")
    if extra:
        raise GGUFError(f"{g.path.name} has tensors cflow does not know how to use: {extra[:6]}; converting would "
                        "silently drop them")


def qwen35_tensors(g: GGUFModel, cfg, enc):
    """TensorData in .cflow order for a qwen35 / qwen35moe file (module docstring)."""
    from cflow.convert.encoder import encode_model

    _check_names(g, cfg)
    H, hd = cfg.n_heads, cfg.head_dim
    heads = np.arange(H)[:, None] * 2 * hd
    q_rows = (heads + np.arange(hd)).reshape(-1)  # attn_q's query rows, head by head
    gate_rows = q_rows + hd  # and its gate rows

    def query(b: str, rows: np.ndarray):
        s = g.source(b + "attn_q.weight")
        _check_shape(s, (2 * cfg.q_dim, cfg.d_model))
        return s.take_rows(rows)

    def parts(w):
        if w.set is None:
            return g.vector(_GLOBAL[w.name]) if w.plain else [g.source(_GLOBAL[w.name])]
        b, slot = f"blk.{w.set}.", w.slot
        if w.expert is not None:
            return stacked_sources(_expert_sources(g, w.set, w.expert, slot.rsplit(".", 1)[1], "merged"), w)
        if slot in _PLAIN:
            return plain_vector(g, b + _PLAIN[slot], w)
        if slot in _FLOAT_MATRICES:
            s = g.source(b + _FLOAT_MATRICES[slot])
            _check_shape(s, w.shape)
            return s.floats()
        if slot == "attn.wqkv":
            k, v = g.source(b + "attn_k.weight"), g.source(b + "attn_v.weight")
            for s in (k, v):
                _check_shape(s, (cfg.kv_dim, cfg.d_model))
            return [query(b, q_rows), k, v]
        if slot == "attn.w_gate":
            return [query(b, gate_rows)]
        names = _GATE_UPS[slot] if slot in _GATE_UPS else (_MATRICES[slot],)
        return stacked_sources([g.source(b + n + ".weight") for n in names], w)

    return encode_model(cfg, enc, parts)
