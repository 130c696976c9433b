"""Reading a deepseek2 GGUF (DeepSeek-V2, V2-Lite, V2.5, V3, R1, Kimi-K2): its geometry as llama.cpp
reads it, and its tensors as float arrays for the reference (cflow.model_deepseek2).

What llama.cpp 0.3.36 reads, and so what this module reads the same way or refuses by name:
- Lite or full is decided by the layer count, not by the file: a 26- or 27-layer file is read as
  the Lite variant (one plain `attn_q`, `attention.q_lora_rank` ignored); any other needs
  `attention.q_lora_rank` (0: a plain `attn_q`; > 0: `attn_q_a`, `attn_q_a_norm`, `attn_q_b`).
  A 26/27-layer file that carries the low-rank query is refused (llama.cpp would look for attn_q).
- With `attention.key_length_mla` and `value_length_mla` the head sizes come from them and the
  key/value up-projection is split per head (`attn_k_b` [H, kv_lora, nope], `attn_v_b`
  [H, v_head, kv_lora]: the MLA layout current converters write); without them, one legacy
  `attn_kv_b` [H (nope + v_head), kv_lora] with the sizes from `attention.key_length` and
  `value_length`. Both are read.
- The rotated part is `rope.dimension_count` wide (qk_rope), the rest of a query head is qk_nope.
- `expert_gating_func` 1 (or absent: V2 and V2.5 files) is softmax, 2 sigmoid (V3); 3 (softmax
  over the chosen logits) is refused. `exp_probs_b.bias`, when present, biases the choice only.
- `expert_group_count` / `expert_group_used_count` (0 or absent: no group limit) must divide the
  experts evenly; `expert_weights_norm` (default off), `expert_weights_scale` (absent or 0: 1).
- YaRN (`rope.scaling.type` "yarn"): the pairs' frequencies as for every family
  (cflow.convert.gguf._rope_scaling over the qk_rope dims); the magnitude is DeepSeek's own: cos
  and sin unscaled, the scores times mscale^2 with mscale = 1 + yarn_log_multiplier ln(factor)
  (the file stores 0.1 mscale_all_dim there), as llm_build_deepseek2's kq_scale.
- A temperature (`attention.temperature_scale`, Mistral Large 3) is refused.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from cflow.convert.gguf import GGUFError, GGUFModel, _rope_scaling, check_tensor_names
from cflow.model_deepseek2 import DeepSeek2Config

if TYPE_CHECKING:
    from cflow.config import ModelConfig

ARCH = "deepseek2"
LITE_LAYER_COUNTS = (26, 27)  # llama.cpp reads these as DeepSeek-V2-Lite: a plain attn_q
_GATING = {0: "softmax", 1: "softmax", 2: "sigmoid"}


def deepseek2_config(g: GGUFModel) -> DeepSeek2Config:
    """The geometry of a deepseek2 file as llama.cpp reads it (module docstring)."""
    if g.architecture != ARCH:
        raise GGUFError(f"{g.path.name} is a {g.architecture!r} model, not {ARCH!r}")
    p, name = f"{ARCH}.", g.path.name
    req = lambda k: int(g.require(p + k))  # noqa: E731
    opt = lambda k, d: g.get(p + k) if g.get(p + k) is not None else d  # noqa: E731
    n_layers, n_heads = req("block_count"), req("attention.head_count")
    lite = n_layers in LITE_LAYER_COUNTS
    q_lora = 0 if lite else req("attention.q_lora_rank")
    if lite and "blk.0.attn_q_a.weight" in g.tensors:
        raise GGUFError(f"{name} has {n_layers} layers, which llama.cpp reads as DeepSeek-V2-Lite (a plain attn_q), "
                        "but it carries the low-rank query (attn_q_a, attn_q_b); cflow refuses what llama.cpp "
                        "would read differently")
    mla = g.get(p + "attention.key_length_mla") is not None and g.get(p + "attention.value_length_mla") is not None
    k_len = req("attention.key_length_mla" if mla else "attention.key_length")
    v_len = req("attention.value_length_mla" if mla else "attention.value_length")
    rot = req("rope.dimension_count")
    if not 0 < rot < k_len or rot % 2:
        raise GGUFError(f"{name}: rope.dimension_count {rot} must be even and below the key head size {k_len}")
    gating_id = int(opt("expert_gating_func", 0))
    if gating_id not in _GATING:
        raise GGUFError(f"{name}: {p}expert_gating_func {gating_id} (softmax over the chosen experts' logits) is "
                        "not supported; cflow runs deepseek2 routing with softmax (1) or sigmoid (2) scores")
    n_exp, groups, used = req("expert_count"), int(opt("expert_group_count", 0)), int(opt("expert_group_used_count", 0))
    if groups > 1 and (n_exp % groups or not 1 <= used <= groups):
        raise GGUFError(f"{name}: {groups} expert groups ({used} used) do not split {n_exp} experts evenly")
    if opt("attention.temperature_scale", 0):
        raise GGUFError(f"{name} uses an attention temperature (attention.temperature_scale, Mistral Large 3); "
                        "cflow runs deepseek2 files without one")
    rs = _rope_scaling(g, p, rot)
    mscale = 1.0
    if g.get(p + "rope.scaling.type") == "yarn":
        factor = float(g.require(p + "rope.scaling.factor"))
        log_mul = float(opt("rope.scaling.yarn_log_multiplier", 0.0))
        mscale = 1.0 + log_mul * math.log(factor) if factor > 1 else 1.0
    scale = float(opt("expert_weights_scale", 0.0)) or 1.0
    return DeepSeek2Config(
        vocab_size=int(g.tensors["token_embd.weight"].shape[1]), d_model=req("embedding_length"),
        n_layers=n_layers, n_heads=n_heads, q_lora_rank=q_lora, kv_lora_rank=req("attention.kv_lora_rank"),
        qk_nope=k_len - rot, qk_rope=rot, v_head=v_len, d_ff=req("feed_forward_length"),
        n_dense_lead=int(opt("leading_dense_block_count", 0)), n_experts=n_exp, top_k=req("expert_used_count"),
        d_expert=req("expert_feed_forward_length"), n_shared=int(opt("expert_shared_count", 0)),
        gating=_GATING[gating_id], n_groups=max(groups, 1), n_groups_used=max(used, 1),
        weights_norm=bool(opt("expert_weights_norm", False)), weights_scale=scale,
        rope_theta=float(opt("rope.freq_base", 10000.0)), rope_freq_factors=rs.get("rope_freq_factors", ()),
        mscale=mscale, norm_eps=float(g.require(p + "attention.layer_norm_rms_epsilon")), name=g.get("general.name") or ARCH)


def deepseek2_weights(g: GGUFModel) -> dict[str, np.ndarray]:
    """Every tensor of the file as float32 in numpy order ([rows, cols], [E, rows, cols], ...)."""
    return {n: deepseek2_tensor(g, n) for n in g.tensors}


# ---- conversion into .cflow ------------------------------------------------------------------
def deepseek2_model_config(g: GGUFModel) -> "ModelConfig":
    """The engine's ModelConfig of a deepseek2 file: latent attention (kv_lora_rank > 0, head_dim
    the query/key head, one KV head), the leading dense layers, DeepSeek's routing, the ungated
    shared expert(s) as one of d_expert * n_shared; RoPE turns the last qk_rope dims of each head
    (rows reordered from ggml's adjacent pairs to the "half" convention at conversion), cos and sin
    unscaled, the scores times mscale^2 / sqrt(head_dim) (attn_scale)."""
    from cflow.config import ConfigError, ModelConfig

    c = deepseek2_config(g)
    if not 0 <= c.n_dense_lead < c.n_layers:
        raise GGUFError(f"{g.path.name}: {c.n_dense_lead} leading dense layers of {c.n_layers}; cflow runs deepseek2 "
                        "files with at least one MoE layer")
    bias = {f"blk.{i}.exp_probs_b.bias" in g.tensors for i in range(c.n_dense_lead, c.n_layers)}
    if len(bias) != 1:
        raise GGUFError(f"{g.path.name}: some MoE layers carry exp_probs_b.bias and some do not")
    try:
        return ModelConfig(
            vocab_size=c.vocab_size, d_model=c.d_model, n_layers=c.n_layers, n_heads=c.n_heads, n_kv_heads=1,
            head_dim=c.qk_head, d_ff=c.d_ff if c.n_dense_lead else 0, n_experts=c.n_experts, top_k=c.top_k,
            d_expert=c.d_expert, delta_dense=0, delta_expert=0, moe_input="post_attn", rope_theta=c.rope_theta,
            rope_freq_factors=c.rope_freq_factors, rope_mscale=1.0, norm_eps=c.norm_eps,
            max_seq_len=int(g.get(f"{ARCH}.context_length") or 4096), tie_embeddings="output.weight" not in g.tensors,
            moe_norm_topk=c.weights_norm, d_shared_expert=c.d_expert * c.n_shared, shared_expert_gate=False,
            kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank, qk_rope_dim=c.qk_rope, v_head_dim=c.v_head,
            n_dense_lead=c.n_dense_lead, moe_gating=c.gating, moe_router_bias=bias.pop(),
            moe_groups=c.n_groups if c.n_groups > 1 else 0, moe_groups_used=c.n_groups_used if c.n_groups > 1 else 0,
            moe_weights_scale=c.weights_scale, attn_scale=c.scores_scale, name=ARCH)
    except ConfigError as e:
        raise GGUFError(f"{g.path.name}: {e}") from None


def _half_rope_rows(rows: int, start: int, n_heads: int, head: int, rope: int) -> np.ndarray:
    """Row order that turns each head's last `rope` rows (from `start`, heads `head` apart) from
    ggml's adjacent-pair RoPE order into the "half" order the engine rotates."""
    from cflow.convert.gguf import unpermute_qk_index

    idx = np.arange(rows)
    for h in range(n_heads):
        o = start + h * head
        idx[o:o + rope] = o + unpermute_qk_index(rope, 1)
    return idx


def _q8_0(origin: str, values: np.ndarray):
    """A per-head up-projection as Q8_0 blocks (cflow.weights.MLA_SLOTS: its input is one head wide)."""
    from cflow.convert.encoder import Source
    from cflow.quant import quantize

    v = np.ascontiguousarray(values, dtype=np.float32)
    return Source(origin, "float32", v.shape[0], v.shape[1], "q8_0", blocks=quantize(v, "q8_0"))


def deepseek2_tensors(g: GGUFModel, cfg, enc):
    """TensorData in .cflow order for a deepseek2 file (module docstring's layouts)."""
    from cflow.convert.encoder import encode_model
    from cflow.convert.gguf import _check_shape, _expert_sources, plain_vector, stacked_sources

    _check_deepseek2_names(g, cfg)
    H, qk, rope, kvl, vh = cfg.n_heads, cfg.head_dim, cfg.qk_rope_dim, cfg.kv_lora_rank, cfg.v_head_dim
    nope = qk - rope
    glob = {"tok_emb": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}
    plain = {"attn_norm": "attn_norm", "attn.q_a_norm": "attn_q_a_norm", "attn.kv_a_norm": "attn_kv_a_norm",
             "ffn_norm": "ffn_norm", "moe_norm": "ffn_norm"}
    mats = {"attn.wq_a": ("attn_q_a",), "attn.wo": ("attn_output",), "ffn.w_gate_up": ("ffn_gate", "ffn_up"),
            "ffn.w_down": ("ffn_down",), "moe.shared.w_gate_up": ("ffn_gate_shexp", "ffn_up_shexp"),
            "moe.shared.w_down": ("ffn_down_shexp",)}
    w_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def kv_b(i: int) -> tuple[np.ndarray, np.ndarray]:  # (k_b [H kvl, nope], v_b [H v, kvl]) of layer i
        if i not in w_cache:
            b = f"blk.{i}."
            if b + "attn_k_b.weight" in g.tensors:
                k = deepseek2_tensor(g, b + "attn_k_b.weight").reshape(H * kvl, nope)
                v = deepseek2_tensor(g, b + "attn_v_b.weight").reshape(H * vh, kvl)
            else:
                kv = deepseek2_tensor(g, b + "attn_kv_b.weight").reshape(H, nope + vh, kvl)
                k = kv[:, :nope].transpose(0, 2, 1).reshape(H * kvl, nope)
                v = kv[:, nope:].reshape(H * vh, kvl)
            w_cache.clear()  # one layer at a time: V3's are ~70 MB of floats
            w_cache[i] = (k, v)
        return w_cache[i]

    def parts(w):
        if w.set is None:
            return g.vector(glob[w.name]) if w.plain else [g.source(glob[w.name])]
        b, slot = f"blk.{w.set}.", w.slot
        if w.expert is not None:
            return stacked_sources(_expert_sources(g, w.set, w.expert, slot.rsplit(".", 1)[1], "merged"), w)
        if slot in plain:
            return plain_vector(g, b + plain[slot] + ".weight", w)
        if slot == "moe.router":
            router = g.source(b + "ffn_gate_inp.weight")
            _check_shape(router, w.shape)
            return router.floats()
        if slot == "moe.router_bias":
            return g.vector(b + "exp_probs_b.bias")
        if slot in ("attn.wq", "attn.wq_b"):
            s = g.source(b + ("attn_q" if slot == "attn.wq" else "attn_q_b") + ".weight")
            _check_shape(s, w.shape)
            return [s.take_rows(_half_rope_rows(s.rows, nope, H, qk, rope))]
        if slot == "attn.wkv_a":
            s = g.source(b + "attn_kv_a_mqa.weight")
            _check_shape(s, w.shape)
            return [s.take_rows(_half_rope_rows(s.rows, kvl, 1, 0, rope))]
        if slot in ("attn.wk_b", "attn.wv_b"):
            k, v = kv_b(w.set)
            return [_q8_0(f"{b}{slot}", k if slot == "attn.wk_b" else v)]
        return stacked_sources([g.source(b + n + ".weight") for n in mats[slot]], w)

    return encode_model(cfg, enc, parts)


def deepseek2_tensor(g: GGUFModel, name: str) -> np.ndarray:
    from gguf.quants import dequantize

    t = g.tensors[name]
    shape = tuple(int(x) for x in reversed(list(t.shape)))
    return dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(shape)


def _check_deepseek2_names(g: GGUFModel, cfg) -> None:
    """Every tensor the config implies is there, and nothing the conversion would drop."""
    expected = {"token_embd.weight", "output_norm.weight"} | ({"output.weight"} if not cfg.tie_embeddings else set())
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        names = ["attn_norm", "attn_kv_a_mqa", "attn_kv_a_norm", "attn_output", "ffn_norm"]
        names += ["attn_q_a", "attn_q_a_norm", "attn_q_b"] if cfg.q_lora_rank else ["attn_q"]
        names += ["attn_k_b", "attn_v_b"] if b + "attn_k_b.weight" in g.tensors else ["attn_kv_b"]
        if i < cfg.n_dense_lead:
            names += ["ffn_gate", "ffn_up", "ffn_down"]
        else:
            names += ["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
            names += ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"] if cfg.d_shared_expert else []
            if cfg.moe_router_bias:
                expected.add(b + "exp_probs_b.bias")
        expected |= {b + n + ".weight" for n in names}
    check_tensor_names(g, expected, "deepseek2")
