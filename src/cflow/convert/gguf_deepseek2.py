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

import numpy as np

from cflow.convert.gguf import GGUFError, GGUFModel, _rope_scaling
from cflow.model_deepseek2 import DeepSeek2Config

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
    from gguf.quants import dequantize

    out = {}
    for n, t in g.tensors.items():
        shape = tuple(int(x) for x in reversed(list(t.shape)))
        out[n] = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(shape)
    return out
