"""The float reference of DeepSeek-V2 / V3 / Kimi-K2 (GGUF architecture "deepseek2"), in two forms.

Owns the equations of multi-head latent attention (MLA) and DeepSeek's routing, written from
llama.cpp's llm_build_deepseek2 and build_moe_ffn, which tests/test_deepseek2.py holds this module
to, teacher-forced. The weights are the GGUF's tensors by their GGUF names, dequantized, in numpy
order (outermost dimension first); `DeepSeek2Config` (cflow.convert.gguf_deepseek2 reads it from a
file) carries the geometry. Layer l (x the residual entering it):

    h  = rms(x) * attn_norm
    q  = W_q_b (rms(W_q_a h) * q_a_norm)       (q_lora_rank > 0; else W_q h), n_head x (nope | rope)
    ck = W_kv_a h = [c (kv_lora_rank) | k_pe (qk_rope)];  c = rms(c) * kv_a_norm
    q_pe, k_pe rotated by ggml's adjacent-pair ("NORM") RoPE over the qk_rope dims (YaRN
    frequencies from the file); k_pe is one vector per token, shared by every head
    per head: k_nope = W_k_b c, v = W_v_b c; scores = (q_nope . k_nope + q_pe . k_pe) * scale,
    scale = mscale^2 / sqrt(qk_nope + qk_rope) (mscale = 1 + 0.1 mscale_all_dim ln(factor) under YaRN)
    x += W_o concat_heads(softmax(scores) v)
    layers < n_dense_lead: x += FFN(rms(x) * ffn_norm)   (SwiGLU)
    others: z = rms(x) * ffn_norm; p = softmax(W_r z) (V2) or sigmoid(W_r z) (V3);
            choose with p + exp_probs_b (V3's correction bias; the weights stay p), first keeping
            the n_group_used groups of experts whose two best scores sum highest, then the top_k;
            w = p[chosen], / sum(w) when weights_norm, * weights_scale;
            x += sum_k w_k expert_k(z) + shared(z)   (the shared expert(s): one SwiGLU, ungated)
    logits = W_out (rms(x) * output_norm)

`forward(tokens)` is the plain form: every head's k_nope and v are expanded from the latent.
`DeepSeek2Cache` is the absorbed form llama.cpp decodes with: the cache holds, per layer and
token, only c (kv_lora_rank floats, normalised) and the roped k_pe (qk_rope floats); a query
head is taken into latent space (q_lat = W_k_b^T q_nope), scores are q_lat . c + q_pe . k_pe, and
the attention output, a mix of latents, leaves through W_v_b then W_o. The two forms are the same
function (matrix products reassociated); tests/test_deepseek2.py holds them equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch
from torch import Tensor

GATINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class DeepSeek2Config:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    q_lora_rank: int  # 0: one plain query matrix (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    d_ff: int  # the leading dense layers' FFN
    n_dense_lead: int
    n_experts: int
    top_k: int
    d_expert: int
    n_shared: int  # shared experts, run as one SwiGLU of d_expert * n_shared
    gating: str  # "softmax" (V2) or "sigmoid" (V3)
    n_groups: int = 1  # expert groups; 1: no group limit
    n_groups_used: int = 1
    weights_norm: bool = False
    weights_scale: float = 1.0
    rope_theta: float = 10000.0
    rope_freq_factors: tuple = ()  # qk_rope / 2 divisors of the pairs' frequencies (YaRN), () none
    mscale: float = 1.0  # YaRN's attention magnitude: the scores are scaled by mscale^2 / sqrt(qk)
    rope_mscale: float = 1.0  # what cos and sin are multiplied by
    norm_eps: float = 1e-6
    name: str = field(default="deepseek2", compare=False)

    @property
    def qk_head(self) -> int:
        return self.qk_nope + self.qk_rope

    @property
    def scores_scale(self) -> float:
        return self.mscale * self.mscale / math.sqrt(self.qk_head)

    @property
    def cache_floats_per_token(self) -> int:
        """What the latent cache stores per layer and token: c and the roped k_pe."""
        return self.kv_lora_rank + self.qk_rope


def rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_pairs(x: Tensor, pos: Tensor, cfg: DeepSeek2Config) -> Tensor:
    """ggml's NORM RoPE of x [..., T, qk_rope]: pair (2j, 2j+1) turns by pos * theta^(-2j/qk_rope)
    / factor_j (the convention llama.cpp runs deepseek2 with)."""
    j = torch.arange(cfg.qk_rope // 2, dtype=torch.float64)
    inv = cfg.rope_theta ** (-2.0 * j / cfg.qk_rope)
    if cfg.rope_freq_factors:
        inv = inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float64)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    c, s = (cfg.rope_mscale * ang.cos()).to(x.dtype), (cfg.rope_mscale * ang.sin()).to(x.dtype)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)


def route(z: Tensor, w: Mapping[str, Tensor], b: str, cfg: DeepSeek2Config) -> tuple[Tensor, Tensor]:
    """(chosen experts [T, top_k], their weights [T, top_k]) as llama.cpp's build_moe_ffn."""
    logits = z @ w[b + "ffn_gate_inp.weight"].T
    probs = torch.softmax(logits, -1) if cfg.gating == "softmax" else torch.sigmoid(logits)
    sel = probs + w[b + "exp_probs_b.bias"] if b + "exp_probs_b.bias" in w else probs
    if cfg.n_groups > 1:
        per = cfg.n_experts // cfg.n_groups
        grouped = sel.view(-1, cfg.n_groups, per)
        gscore = grouped.topk(min(2, per), dim=-1).values.sum(-1)  # [T, groups]
        keep = gscore.topk(cfg.n_groups_used, dim=-1).indices
        mask = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, keep, True)
        sel = grouped.masked_fill(~mask[..., None], float("-inf")).view(-1, cfg.n_experts)
    chosen = sel.topk(cfg.top_k, dim=-1).indices
    wts = probs.gather(1, chosen)
    if cfg.weights_norm:
        wts = wts / wts.sum(-1, keepdim=True).clamp(min=6.103515625e-5)
    return chosen, wts * cfg.weights_scale


def swiglu(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


class DeepSeek2Reference:
    """The graph of the module docstring over float64 weights (GGUF names, numpy order)."""

    def __init__(self, cfg: DeepSeek2Config, weights: Mapping[str, np.ndarray]) -> None:
        self.cfg = cfg
        self.w = {k: torch.from_numpy(np.asarray(v, dtype=np.float64)) for k, v in weights.items()}
        for i in range(cfg.n_layers):  # older files: one attn_kv_b [H (nope + v), kv_lora]; split it
            b = f"blk.{i}."
            kv = self.w.pop(b + "attn_kv_b.weight", None)
            if kv is not None:
                kv = kv.view(cfg.n_heads, cfg.qk_nope + cfg.v_head, cfg.kv_lora_rank)
                self.w[b + "attn_k_b.weight"] = kv[:, :cfg.qk_nope].transpose(1, 2).contiguous()
                self.w[b + "attn_v_b.weight"] = kv[:, cfg.qk_nope:].contiguous()

    # ---- pieces shared by both forms ----------------------------------------------------------
    def _query(self, h: Tensor, b: str) -> tuple[Tensor, Tensor]:
        """(q_nope [H, T, nope], q_pe [H, T, rope]) before RoPE."""
        c, w = self.cfg, self.w
        if c.q_lora_rank:
            q = rms(h @ w[b + "attn_q_a.weight"].T, w[b + "attn_q_a_norm.weight"], c.norm_eps) @ w[b + "attn_q_b.weight"].T
        else:
            q = h @ w[b + "attn_q.weight"].T
        q = q.view(-1, c.n_heads, c.qk_head).transpose(0, 1)
        return q[..., :c.qk_nope], q[..., c.qk_nope:]

    def _latent(self, h: Tensor, b: str, pos: Tensor) -> tuple[Tensor, Tensor]:
        """(c [T, kv_lora] normalised, k_pe [T, rope] roped): what the cache keeps."""
        c, w = self.cfg, self.w
        ck = h @ w[b + "attn_kv_a_mqa.weight"].T
        lat = rms(ck[:, :c.kv_lora_rank], w[b + "attn_kv_a_norm.weight"], c.norm_eps)
        return lat, rope_pairs(ck[:, c.kv_lora_rank:], pos, c)

    def _k_b(self, b: str) -> Tensor:
        return self.w[b + "attn_k_b.weight"]  # [H, kv_lora, nope]

    def _v_b(self, b: str) -> Tensor:
        return self.w[b + "attn_v_b.weight"]  # [H, v_head, kv_lora]

    def _ffn(self, x: Tensor, i: int) -> Tensor:
        c, w, b = self.cfg, self.w, f"blk.{i}."
        z = rms(x, w[b + "ffn_norm.weight"], c.norm_eps)
        if i < c.n_dense_lead:
            return swiglu(z, w[b + "ffn_gate.weight"], w[b + "ffn_up.weight"], w[b + "ffn_down.weight"])
        chosen, wts = route(z, w, b, c)
        out = torch.zeros_like(z)
        g, u, d = w[b + "ffn_gate_exps.weight"], w[b + "ffn_up_exps.weight"], w[b + "ffn_down_exps.weight"]
        for t in range(z.shape[0]):
            for k in range(c.top_k):
                e = int(chosen[t, k])
                out[t] += wts[t, k] * swiglu(z[t], g[e], u[e], d[e])
        if c.n_shared:
            out = out + swiglu(z, w[b + "ffn_gate_shexp.weight"], w[b + "ffn_up_shexp.weight"],
                               w[b + "ffn_down_shexp.weight"])
        return out

    def _head(self, x: Tensor) -> Tensor:
        w = self.w
        out = w["output.weight"] if "output.weight" in w else w["token_embd.weight"]
        return rms(x, w["output_norm.weight"], self.cfg.norm_eps) @ out.T

    # ---- the plain (expanded) form ------------------------------------------------------------
    def forward(self, tokens: list[int]) -> np.ndarray:
        """[T, vocab] logits of the whole sequence, causal, every head's K and V expanded."""
        c, w = self.cfg, self.w
        n = len(tokens)
        pos = torch.arange(n)
        causal = pos[None, :] <= pos[:, None]
        x = w["token_embd.weight"][torch.tensor(tokens)]
        for i in range(c.n_layers):
            b = f"blk.{i}."
            h = rms(x, w[b + "attn_norm.weight"], c.norm_eps)
            q_nope, q_pe = self._query(h, b)
            q_pe = rope_pairs(q_pe, pos, c)
            lat, k_pe = self._latent(h, b, pos)
            k_nope = torch.einsum("hrn,tr->htn", self._k_b(b), lat)  # [H, T, nope]
            v = torch.einsum("hvr,tr->htv", self._v_b(b), lat)  # [H, T, v_head]
            s = (q_nope @ k_nope.transpose(1, 2) + q_pe @ k_pe.T) * c.scores_scale
            a = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
            o = (a @ v).transpose(0, 1).reshape(n, c.n_heads * c.v_head)
            x = x + o @ w[b + "attn_output.weight"].T
            x = x + self._ffn(x, i)
        return self._head(x).numpy()


class DeepSeek2Cache:
    """The absorbed form, one token per step over a latent cache (llama.cpp's MLA decode)."""

    def __init__(self, ref: DeepSeek2Reference) -> None:
        self.ref = ref
        c = ref.cfg
        self.lat = [torch.zeros(0, c.kv_lora_rank, dtype=torch.float64) for _ in range(c.n_layers)]
        self.k_pe = [torch.zeros(0, c.qk_rope, dtype=torch.float64) for _ in range(c.n_layers)]

    def cache_floats(self) -> int:
        """Floats the cache holds now (every layer, every token so far)."""
        return sum(a.numel() + p.numel() for a, p in zip(self.lat, self.k_pe))

    def step(self, token: int) -> np.ndarray:
        ref, c, w = self.ref, self.ref.cfg, self.ref.w
        pos = torch.tensor([self.lat[0].shape[0]])
        x = w["token_embd.weight"][torch.tensor([token])]
        for i in range(c.n_layers):
            b = f"blk.{i}."
            h = rms(x, w[b + "attn_norm.weight"], c.norm_eps)
            q_nope, q_pe = ref._query(h, b)  # [H, 1, *]
            q_pe = rope_pairs(q_pe, pos, c)
            lat, k_pe = ref._latent(h, b, pos)
            self.lat[i] = torch.cat([self.lat[i], lat])
            self.k_pe[i] = torch.cat([self.k_pe[i], k_pe])
            q_lat = torch.einsum("hrn,htn->htr", ref._k_b(b), q_nope)  # the query in latent space
            s = (q_lat @ self.lat[i].T + q_pe @ self.k_pe[i].T) * c.scores_scale  # [H, 1, T]
            o_lat = torch.softmax(s, -1) @ self.lat[i]  # [H, 1, kv_lora]
            o = torch.einsum("hvr,htr->thv", ref._v_b(b), o_lat).reshape(1, c.n_heads * c.v_head)
            x = x + o @ w[b + "attn_output.weight"].T
            x = x + ref._ffn(x, i)
        return ref._head(x).numpy()[0]
