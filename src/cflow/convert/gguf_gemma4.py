"""Reading a gemma4 GGUF (Gemma 4, text only): its geometry as llama.cpp's gemma4 graph reads it, and
its tensors under cflow's names (cflow.weights).

What llama.cpp 0.3.36 reads (tests/test_gemma4.py pins the graph down), and how cflow holds it:
- gemma3's blocks (attn_{q,k,v,output}, per-head attn_{q,k}_norm, post_attention_norm, GeGLU FFN,
  post_ffw_norm, tied embeddings times sqrt(d), NEOX RoPE), attention scale 1 (no 1/sqrt(hd)) and
  each V head through an unweighted RMSNorm (config v_norm);
- `attention.sliding_window_pattern` (per-layer flags, periodic as gemma3's), local layers with a
  head size of their own (`attention.key_length_swa` = `value_length_swa` =
  `rope.dimension_count_swa`: head_dim_local) and RoPE base (`rope.freq_base_swa`), the global
  layers' `rope_freqs.weight` as their RoPE frequency factors (Gemma 4's "proportional" RoPE);
- `attention.shared_kv_layers` N: the last N layers have no attn_k / attn_v / attn_k_norm
  (shared_kv_layers); a KV layer without attn_v takes V from K's projection (the same rows stored
  again as V: V is normed without weights, so W_k's rows give exactly llama.cpp's V);
- `attention.head_count_kv`, a number or one per layer (llama.cpp's converter writes an array when
  the HF config has num_global_key_value_heads: 26B-A4B's 8 on the local layers and 2 on the
  global ones, 31B's 16 and 4): one count on the local layers and one on the global ones
  (n_kv_heads the global layers', n_kv_heads_local the local layers' when they differ); any other
  layout is refused;
- `feed_forward_length`, a number or one per layer: one width on the KV layers and one on the
  shared ones (d_ff, d_ff_shared_kv: Gemma 4 E2B's double-wide MLP); any other layout is refused;
- per-layer embeddings (`embedding_length_per_layer_input` P: per_layer_token_embd,
  per_layer_model_proj, per_layer_proj_norm; per layer inp_gate, proj, post_norm), each layer's
  layer_output_scale, `final_logit_softcapping`.
- experts (26B-A4B: `expert_count`, `expert_used_count`, `expert_feed_forward_length`; every layer
  with ffn_gate_inp): the dense MLP stays beside them (d_ff), the router ffn_gate_inp [E, d] reads
  rms(x) * ffn_gate_inp.scale / sqrt(d) (stored as moe.router_norm: moe_router_norm), softmax over
  all experts, top-k renormalised; each expert's input rms(x) * pre_ffw_norm_2 (moe_norm), its
  gate and up the two halves of ffn_gate_up_exps (gate rows first), GeGLU, ffn_down_exps times
  ffn_down_exps.scale[e] (moe.expert_scale: expert_scale); the branches joined as
  post_ffw_norm(rms(dense) * post_ffw_norm_1 + rms(experts) * post_ffw_norm_2) (moe_out_norms).
Refused by name: attention logit soft-capping, partial RoPE,
value heads of another size than key heads, vision / audio towers (gguf_config's check).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from cflow.config import ConfigError, ModelConfig
from cflow.convert.encoder import Encoder
from cflow.convert.gguf import GGUFError, GGUFModel, _check_shape, _swa_period, check_tensor_names
from cflow.weights import model_weights

ARCH = "gemma4"
# cflow's tensor names -> the GGUF's (blk.{i}. prefixed for the layer slots)
_GLOBAL = {"tok_emb": "token_embd.weight", "norm": "output_norm.weight", "ple_emb": "per_layer_token_embd.weight",
           "ple_proj": "per_layer_model_proj.weight", "ple_norm": "per_layer_proj_norm.weight"}
_LAYER = {"attn_norm": "attn_norm", "attn.q_norm": "attn_q_norm", "attn.k_norm": "attn_k_norm",
          "attn.wo": "attn_output", "attn_post_norm": "post_attention_norm", "ffn_norm": "ffn_norm",
          "ffn.w_down": "ffn_down", "ffn_post_norm": "post_ffw_norm", "ple.w_gate": "inp_gate", "ple.w_proj": "proj",
          "ple_post_norm": "post_norm", "out_scale": "layer_output_scale",
          # the MoE layers'
          "moe_norm": "pre_ffw_norm_2", "moe.router": "ffn_gate_inp", "moe.expert_scale": "ffn_down_exps",
          "ffn_post_norm_1": "post_ffw_norm_1", "moe_post_norm": "post_ffw_norm_2"}
_SCALES = ("moe.expert_scale", "moe.router_norm")  # read from a `.scale` tensor (GGUF ffn_*.scale)


def _one(g: GGUFModel, key: str, n_layers: int) -> int:
    """A hyperparameter llama.cpp allows per layer, which cflow needs to be one number."""
    v = g.get(key)
    if isinstance(v, (list, tuple)):
        if len(set(int(x) for x in v[:n_layers])) != 1:
            raise GGUFError(f"{g.path.name}: {key} differs between layers ({list(v)}); cflow runs one value")
        v = v[0]
    return int(v) if v is not None else 0


def _kv_heads(g: GGUFModel, p: str, n_layers: int, local: list[bool]) -> tuple[int, int]:
    """(KV heads of the global layers, n_kv_heads_local: 0 when the local layers have as many)."""
    v = g.get(p + "attention.head_count_kv")
    if not isinstance(v, (list, tuple)):
        return int(v or 0), 0
    counts = [int(x) for x in v]
    if len(counts) != n_layers:
        raise GGUFError(f"{g.path.name}: {p}attention.head_count_kv has {len(counts)} entries for {n_layers} layers")
    loc = {c for c, is_local in zip(counts, local) if is_local}
    glob = {c for c, is_local in zip(counts, local) if not is_local}
    if not glob and len(loc) == 1:  # every layer local: one count
        return loc.pop(), 0
    if len(loc) > 1 or len(glob) > 1 or not glob:
        raise GGUFError(f"{g.path.name}: {p}attention.head_count_kv {counts}: cflow runs one KV head count on the "
                        "local (sliding-window) layers and one on the global layers")
    n_global = glob.pop()
    n_local = loc.pop() if loc else n_global
    return n_global, n_local if n_local != n_global else 0


def _ffn_widths(g: GGUFModel, p: str, n_layers: int, n_shared: int) -> tuple[int, int]:
    """(d_ff of the KV layers, d_ff_shared_kv: 0 when the shared layers have the same width)."""
    v = g.require(p + "feed_forward_length")
    widths = [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)] * n_layers
    if len(widths) != n_layers:
        raise GGUFError(f"{g.path.name}: {p}feed_forward_length has {len(widths)} entries for {n_layers} layers")
    n_kv = n_layers - n_shared
    own, shared = set(widths[:n_kv]), set(widths[n_kv:])
    if len(own) != 1 or len(shared) > 1:
        raise GGUFError(f"{g.path.name}: {p}feed_forward_length {widths}: cflow runs one FFN width on the layers "
                        "with K/V of their own and one on the shared-KV layers")
    d_ff, d_sh = own.pop(), shared.pop() if shared else 0
    return d_ff, d_sh if d_sh != d_ff else 0


def gemma4_config(g: GGUFModel) -> ModelConfig:
    """The ModelConfig of a gemma4 file as llama.cpp reads it (module docstring)."""
    if g.architecture != ARCH:
        raise GGUFError(f"{g.path.name} is a {g.architecture!r} model, not {ARCH!r}")
    p, name = f"{ARCH}.", g.path.name
    n_experts = int(g.get(p + "expert_count") or 0)
    moe: dict[str, Any] = dict(n_experts=0, top_k=0, d_expert=0)
    if n_experts > 0:
        if g.get(p + "expert_used_count") is None or g.get(p + "expert_feed_forward_length") is None:
            raise GGUFError(f"{name} has {n_experts} experts but no {p}expert_used_count or "
                            f"{p}expert_feed_forward_length; the file is incomplete")
        moe = dict(n_experts=n_experts, top_k=int(g.get(p + "expert_used_count")),
                   d_expert=int(g.get(p + "expert_feed_forward_length")), moe_input="post_attn", moe_norm_topk=True,
                   expert_act="gelu_tanh", moe_router_norm=True, moe_out_norms=True,
                   expert_scale="blk.0.ffn_down_exps.scale" in g.tensors)
    if g.get(p + "attn_logit_softcapping"):
        raise GGUFError(f"{name} caps its attention logits ({p}attn_logit_softcapping); cflow does not")
    L = int(g.require(p + "block_count"))
    d = int(g.require(p + "embedding_length"))
    n_heads = _one(g, p + "attention.head_count", L)
    window = int(g.get(p + "attention.sliding_window") or 0)
    pattern = _swa_period(g, p, L) if window else 0
    local = [bool(window) and (pattern == 0 or i % pattern < pattern - 1) for i in range(L)]
    n_kv, n_kv_local = _kv_heads(g, p, L, local)
    n_kv = n_kv or n_heads
    hd = int(g.require(p + "attention.key_length"))
    hd_swa = int(g.get(p + "attention.key_length_swa") or hd)
    for key, want in (("attention.value_length", hd), ("rope.dimension_count", hd),
                      ("attention.value_length_swa", hd_swa), ("rope.dimension_count_swa", hd_swa)):
        v = g.get(p + key)
        if v is not None and int(v) != want:
            raise GGUFError(f"{name}: {p}{key} = {v}, not the key head size {want}; cflow runs whole-head RoPE "
                            "and value heads as wide as key heads")
    n_shared = int(g.get(p + "attention.shared_kv_layers") or 0)
    d_ff, d_ff_shared = _ffn_widths(g, p, L, n_shared)
    factors = ()
    if "rope_freqs.weight" in g.tensors:
        factors = tuple(float(x) for x in g.vector("rope_freqs.weight"))
    emb = g.tensors.get("token_embd.weight")
    if emb is None:
        raise GGUFError(f"{name} lacks token_embd.weight")
    try:
        return ModelConfig(
            vocab_size=int(emb.shape[1]), d_model=d, n_layers=L, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd,
            d_ff=d_ff, **moe, name=ARCH,
            rope_theta=float(g.get(p + "rope.freq_base") or 10000.0), rope_freq_factors=factors,
            norm_eps=float(g.get(p + "attention.layer_norm_rms_epsilon") or 1e-6),
            max_seq_len=int(g.get(p + "context_length") or 2048), tie_embeddings="output.weight" not in g.tensors,
            qk_norm=True, sliding_window=window,
            sliding_window_pattern=pattern,
            rope_theta_local=float(g.get(p + "rope.freq_base_swa") or 10000.0) if window else 0.0,
            attn_scale=1.0, embed_scale=float(np.sqrt(np.float32(d))), post_norms=True, ffn_act="gelu_tanh",
            head_dim_local=hd_swa if hd_swa != hd else 0, n_kv_heads_local=n_kv_local, shared_kv_layers=n_shared,
            d_ff_shared_kv=d_ff_shared,
            v_norm=True, per_layer_dim=int(g.get(p + "embedding_length_per_layer_input") or 0),
            layer_out_scale="blk.0.layer_output_scale.weight" in g.tensors,
            logit_softcap=float(g.get(p + "final_logit_softcapping") or 0.0))
    except ConfigError as e:
        raise GGUFError(f"{name}: its hyperparameters do not form a valid model: {e}") from None


def _sources(g: GGUFModel, cfg: ModelConfig, slot: str, layer: int | None) -> list[str]:
    """The GGUF tensors cflow's tensor `slot` (of layer `layer`) is made of."""
    if layer is None:
        return [_GLOBAL[slot]]
    b = f"blk.{layer}."
    if slot == "attn.wqkv":  # a shared-KV layer: its query only; no attn_v: K's rows again
        if not cfg.layer_has_kv(layer):
            return [b + "attn_q.weight"]
        return [b + "attn_q.weight", b + "attn_k.weight",
                b + ("attn_v.weight" if b + "attn_v.weight" in g.tensors else "attn_k.weight")]
    if slot == "ffn.w_gate_up":
        return [b + "ffn_gate.weight", b + "ffn_up.weight"]
    if slot == "moe.router_norm":
        return [b + "ffn_gate_inp.scale"]
    if slot == "moe.expert_scale":
        return [b + "ffn_down_exps.scale"]
    if slot.startswith("moe.experts."):  # a slice of the merged stacks
        return [b + ("ffn_gate_up_exps.weight" if slot.endswith("w_gate_up") else "ffn_down_exps.weight")]
    return [b + _LAYER[slot] + ".weight"]


def gemma4_tensors(g: GGUFModel, cfg: ModelConfig, enc: Encoder) -> Iterator[Any]:
    """TensorData in .cflow order (cflow.weights.model_weights); a file tensor cflow would not use
    (or one it lacks) is refused before anything is written."""
    table = [(w, _sources(g, cfg, w.slot, w.set)) for w in model_weights(cfg)]
    used = {n for _, names in table for n in names} | ({"rope_freqs.weight"} if cfg.rope_freq_factors else set())
    check_gemma4_names(g, used)
    for w, names in table:
        if w.plain:
            v = g.vector(names[0])
            if v.size != int(np.prod(w.shape)):
                raise GGUFError(f"{g.path.name}: {names[0]} holds {v.size} values, the config implies {list(w.shape)}")
            if w.slot == "moe.router_norm":  # llama.cpp: rms(x) / sqrt(d) * scale
                v = v / np.float32(np.sqrt(cfg.d_model))
            yield enc.vector(w.name, v.reshape(w.shape))
            continue
        if w.expert is not None:
            yield _expert_tensor(g, cfg, enc, w, names[0])
            continue
        srcs = [g.source(n) for n in names]
        rows = [cfg.layer_q_dim(w.set), cfg.layer_kv_dim(w.set), cfg.layer_kv_dim(w.set)] if w.fused == "qkv" \
            else [w.shape[0] // len(srcs)] * len(srcs)
        for s, r in zip(srcs, rows):
            _check_shape(s, (r, w.shape[1]))
        if w.fused == "qkv" and len(srcs) == 3:
            yield from enc.qkv(w.name, *srcs)
        elif w.fused == "gate_up":
            yield enc.gate_up(w.name, *srcs)
        else:
            yield enc.matrix(w.name, srcs[0])


def _expert_tensor(g: GGUFModel, cfg: ModelConfig, enc: Encoder, w, name: str):
    """Expert w.expert's w_gate_up (the gate rows then the up rows of its ffn_gate_up_exps slice,
    interleaved as cflow stores a gate_up) or w_down."""
    src = g.source(name, w.expert)
    F = cfg.d_expert
    if w.fused == "gate_up":
        _check_shape(src, (2 * F, cfg.d_model))
        return enc.gate_up(w.name, src.take_rows(np.arange(F)), src.take_rows(np.arange(F, 2 * F)))
    _check_shape(src, w.shape)
    return enc.matrix(w.name, src)


def check_gemma4_names(g: GGUFModel, used: set[str]) -> None:
    """The file holds exactly the tensors the conversion reads (convert.gguf.check_tensor_names)."""
    check_tensor_names(g, used, "gemma4")
