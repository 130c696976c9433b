"""The float reference of Gemma 4 (dense, text; cflow.convert.gguf_gemma4 reads the files), the fp32
oracle the engine is held against beside llama.cpp (tests/test_gemma4_engine.py).

Owns Gemma 4's forward pass over cflow's tensors (cflow.weights' names, dequantized), driven by the
config's fields (cflow.config, "Gemma 4 options"); the layer shapes differ, which the trainable
cflow.model.Transformer does not build. With x0 = tok_emb[t] * embed_scale and, per layer l (hd its
head size, its KV head count, the layer's RoPE base and factors, window and cache source from the config):

    ple[l] = (rms(ple_proj x0 / sqrt(d))[l] * ple_norm + ple_emb[t][l] * sqrt(P)) / sqrt(2)
    h = rms(x) * attn_norm; q = rope(rms_head(W_q h) * q_norm)
    KV-owning layer: k = rope(rms_head(W_k h) * k_norm), v = rms_head(W_v h) (v_norm: no weight)
    shared-KV layer: k, v of layer kv_source(l)
    x += rms(W_o softmax(q . k * attn_scale, causal, window) v) * attn_post_norm
    x += rms(W_down (gelu_tanh(W_gate f) * W_up f)) * ffn_post_norm,   f = rms(x) * ffn_norm
      (MoE layers: x += rms(rms(that FFN) * ffn_post_norm_1 + rms(m) * moe_post_norm) * ffn_post_norm,
       m = sum over the top_k of softmax(router (rms(x) * router_norm)), renormalised, of
       w_e expert_scale[e] W_down,e (gelu_tanh(W_gate,e u) * W_up,e u), u = rms(x) * moe_norm)
    x += rms(ple.w_proj (gelu_tanh(ple.w_gate x) * ple[l])) * ple_post_norm;  x *= out_scale
    logits = c tanh(((rms(x) * norm) lm_head^T) / c)

in float32 (torch's default), the RoPE tables as cflow.model's (angles in float64).
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from cflow.config import ModelConfig
from cflow.model import apply_rope, ffn_act, rope_cos_sin


def is_gemma4(cfg: ModelConfig) -> bool:
    """Whether the config uses a Gemma 4 field (this module's, not cflow.model.Transformer's)."""
    return bool(cfg.head_dim_local or cfg.n_kv_heads_local or cfg.shared_kv_layers or cfg.d_ff_shared_kv
                or cfg.per_layer_dim or cfg.v_norm or cfg.layer_out_scale or cfg.logit_softcap
                or cfg.moe_router_norm or cfg.expert_scale or cfg.moe_out_norms)


def _rms(x: Tensor, w: Tensor | None, eps: float) -> Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


class Gemma4Reference:
    """Teacher-forced logits of a Gemma 4 config over its weights (cflow names; a fused attn.wqkv
    given as its parts `attn.wq` / `attn.wk` / `attn.wv`, ffn.w_gate_up as `ffn.w_gate` / `ffn.w_up`)."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, np.ndarray]) -> None:
        self.cfg = cfg
        self.w = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in weights.items()}

    @classmethod
    def from_cflow(cls, path, cfg: ModelConfig | None = None) -> "Gemma4Reference":
        """The reference over a .cflow file's weights, exactly as stored (dequantized); `cfg`
        replaces the file's config (the tests' controls)."""
        from cflow.convert.encoder import split_fused, stored_values
        from cflow.fileformat import open_model

        cf = open_model(path)
        w: dict[str, np.ndarray] = {}
        for name, entry in cf.tensors.items():
            v = stored_values(cf, name)
            fused = entry.meta.get("fused")
            if fused:
                base = name.rsplit(".", 1)[0]
                keys = ("wq", "wk", "wv") if fused == "qkv" else ("w_gate", "w_up")
                w.update({f"{base}.{k}": part for k, part in zip(keys, split_fused(v, entry.meta))})
            elif name.endswith("attn.wqkv"):  # a shared-KV layer's: its query only
                w[name[: -len("wqkv")] + "wq"] = v
            else:
                w[name] = v
        config = cf.config
        cf.close()
        return cls(cfg or config, w)

    def forward(self, tokens: list[int]) -> np.ndarray:
        """[n, V] logits (float64 array of the float32 values), token t at position t."""
        cfg, W = self.cfg, self.w
        n, d, eps, idx = len(tokens), cfg.d_model, cfg.norm_eps, torch.tensor(tokens)
        x = W["tok_emb"][idx] * cfg.embed_scale
        if cfg.per_layer_dim:
            L, P = cfg.n_layers, cfg.per_layer_dim
            proj = (x @ W["ple_proj"].T / math.sqrt(d)).view(n, L, P)
            ple = (_rms(proj, W["ple_norm"], eps) + W["ple_emb"][idx].view(n, L, P) * math.sqrt(P)) / math.sqrt(2)
        pos = torch.arange(n)
        ago = pos[:, None] - pos[None, :]
        act = ffn_act(cfg.ffn_act)
        cache: dict[int, tuple[Tensor, Tensor]] = {}
        for layer in range(cfg.n_layers):
            p, hd = f"layers.{layer}.", cfg.layer_head_dim(layer)
            cos, sin = rope_cos_sin(n, hd, *cfg.layer_rope(layer))
            h = _rms(x, W[p + "attn_norm"], eps)
            q = (h @ W[p + "attn.wq"].T).view(n, cfg.n_heads, hd)
            q = _rms(q, W[p + "attn.q_norm"], eps) if cfg.qk_norm else q
            q = apply_rope(q.transpose(0, 1), cos, sin)
            if cfg.layer_has_kv(layer):
                k = (h @ W[p + "attn.wk"].T).view(n, cfg.layer_kv_heads(layer), hd)
                k = _rms(k, W[p + "attn.k_norm"], eps) if cfg.qk_norm else k
                v = (h @ W[p + "attn.wv"].T).view(n, cfg.layer_kv_heads(layer), hd)
                cache[layer] = apply_rope(k.transpose(0, 1), cos, sin), (_rms(v, None, eps) if cfg.v_norm else v
                                                                         ).transpose(0, 1)
            group = cfg.n_heads // cfg.layer_kv_heads(layer)  # query head j reads KV head j // group
            k, v = (t.repeat_interleave(group, 0) for t in cache[cfg.kv_source(layer)])
            window = cfg.layer_window(layer)
            mask = (ago >= 0) & ((ago < window) if window else True)
            s = (q @ k.transpose(1, 2)) * (cfg.attn_scale or 1 / math.sqrt(hd))
            o = (torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v).transpose(0, 1).reshape(n, -1)
            a = o @ W[p + "attn.wo"].T
            x = x + (_rms(a, W[p + "attn_post_norm"], eps) if cfg.post_norms else a)
            f = _rms(x, W[p + "ffn_norm"], eps)
            f = (act(f @ W[p + "ffn.w_gate"].T) * (f @ W[p + "ffn.w_up"].T)) @ W[p + "ffn.w_down"].T
            if cfg.has_moe:
                m = self._experts(layer, x)
                if cfg.moe_out_norms:
                    f = _rms(f, W[p + "ffn_post_norm_1"], eps) + _rms(m, W[p + "moe_post_norm"], eps)
                else:
                    f = (_rms(f, W[p + "ffn_post_norm"], eps) if cfg.post_norms else f) + m
            x = x + (_rms(f, W[p + "ffn_post_norm"], eps) if cfg.post_norms else f)
            if cfg.per_layer_dim:
                g = F.gelu(x @ W[p + "ple.w_gate"].T, approximate="tanh") * ple[:, layer]
                x = x + _rms(g @ W[p + "ple.w_proj"].T, W[p + "ple_post_norm"], eps)
            if cfg.layer_out_scale:
                x = x * W[p + "out_scale"]
        logits = _rms(x, W["norm"], eps) @ W["tok_emb" if cfg.tie_embeddings else "lm_head"].T
        if cfg.logit_softcap:
            logits = cfg.logit_softcap * torch.tanh(logits / cfg.logit_softcap)
        return logits.double().numpy()

    def _experts(self, layer: int, z: Tensor) -> Tensor:
        """The experts' sum of layer `layer` on its input z [n, d] (the module docstring)."""
        cfg, W, p, eps = self.cfg, self.w, f"layers.{layer}.", self.cfg.norm_eps
        u = _rms(z, W[p + "moe_norm"], eps)
        r = _rms(z, W[p + "moe.router_norm"], eps) if cfg.moe_router_norm else u
        top = torch.softmax(r @ W[p + "moe.router"].T, -1).topk(cfg.top_k, -1)
        wts = top.values / top.values.sum(-1, keepdim=True) if cfg.moe_norm_topk else top.values
        act, out = ffn_act(cfg.expert_act), torch.zeros_like(z)
        for t in range(z.shape[0]):
            for j in range(cfg.top_k):
                e = int(top.indices[t, j])
                q = f"{p}moe.experts.{e}."
                y = W[q + "w_down"] @ (act(W[q + "w_gate"] @ u[t]) * (W[q + "w_up"] @ u[t]))
                out[t] += wts[t, j] * y * (W[p + "moe.expert_scale"][e] if cfg.expert_scale else 1.0)
        return out

