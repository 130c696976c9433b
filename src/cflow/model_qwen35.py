"""The float reference of Qwen3.5 (qwen35 dense, qwen35moe; cflow.convert.gguf_qwen35 reads the
files), the oracle the engine is held against beside llama.cpp (tests/test_qwen35.py holds this
reference to llama.cpp, tests/test_qwen35_engine.py the engine to both, tests/test_deltanet_step.py
the C step to `delta_net`).

Owns the graph as llama.cpp 0.3.36 computes it (src/models/qwen35.cpp, the gated delta net of
src/models/delta-net-base.cpp), over a GGUF's dequantized weights under their GGUF names, in float64,
token by token for the recurrence. Per layer x += mix(rms(x) * attn_norm);
x += ffn(rms(x) * post_attention_norm); layer il is full attention when (il + 1) %
full_attention_interval == 0, a Gated DeltaNet layer otherwise; mix one of:
- Gated DeltaNet, per token t: u = W_qkv h (the conv's input), z = W_gate h;
  c = silu(causal depthwise conv over u of the last d_conv tokens, the current one last,
  zeros before the first: the conv state holds the previous d_conv-1 rows of u);
  q, k, v = split(c) as [Hk, dk], [Hk, dk], [Hv, dv]; q, k L2-normalised per head (eps = rms eps);
  v head h reads q/k head h % Hk (ggml's repeat tiles the Hk heads, it does not interleave);
  beta = sigmoid(W_beta h); g = softplus(W_alpha h + dt_bias) * ssm_a (a log-decay, <= 0);
  per head, state S [dk, dv]: S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q / sqrt(dk);
  o = rms(o per head) * ssm_norm * silu(z); mix = W_out o.
- full attention: [q | gate] per head from attn_q; q = rms(q) * q_norm, k = rms(k) * k_norm per
  head; NEOX RoPE on the first rope.dimension_count dims of each head only (the rest pass;
  llama.cpp's M-RoPE, whose sections all carry the token's position for text, matches it);
  causal softmax(q k^T / sqrt(hd)), head h reading kv head h // (H/Hkv); o = attn * sigmoid(gate);
  mix = W_o o.
The FFN: SwiGLU W_down (silu(W_gate h) * W_up h) in qwen35; in qwen35moe (`moe_ffn`) the router's
softmax over all E logits (ffn_gate_inp [E, d]), the top-k of it renormalised to sum 1, SwiGLU
experts ffn_{gate,up}_exps [E, d_exp, d], ffn_down_exps [E, d, d_exp], plus a shared SwiGLU
expert ffn_{gate,up,down}_shexp scaled by sigmoid(ffn_gate_inp_shexp . h) (one gate per token).
Then the final RMSNorm and the output matrix (the token embedding where the file has none).

Every function takes flags that drop one feature each: the tests' controls, which must miss.
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from cflow.model import apply_rope, rope_cos_sin

Values = Callable[[str], Tensor]  # a weight under its GGUF name, float64, numpy order


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def l2norm(x: Tensor, eps: float) -> Tensor:
    """x / max(|x|, eps) over the last dim (ggml_l2_norm)."""
    return x / x.norm(dim=-1, keepdim=True).clamp(min=eps)


def delta_net(v: Values, b: str, h: Tensor, eps: float, conv=True, decay=True, beta=True, l2=True, tiled=True,
              gated_norm=True) -> Tensor:
    """[n, d]: a Gated DeltaNet layer's mix (before the residual) over its normalised input h [n, d],
    token by token (the decode recurrence: conv state and S carried from row to row), in h's
    dtype; v(name) gives a weight under its GGUF name (prefix b), and the sizes are the weights'."""
    n = h.shape[0]
    u = h @ v(b + "attn_qkv.weight").T  # [n, conv_dim]
    w_conv = v(b + "ssm_conv1d.weight")  # [conv_dim, d_conv]: column d_conv-1 weighs the current token
    (conv_dim, K), Hv, dh = w_conv.shape, v(b + "ssm_a").shape[0], v(b + "ssm_norm.weight").shape[0]
    Hk = (conv_dim - Hv * dh) // (2 * dh)
    key_dim, value_dim = Hk * dh, Hv * dh
    z = (h @ v(b + "attn_gate.weight").T).view(n, Hv, dh)
    if conv:
        padded = torch.cat([torch.zeros(K - 1, conv_dim, dtype=u.dtype), u])
        c = sum(padded[j:j + n] * w_conv[:, j] for j in range(K))
    else:  # the control: the current token's tap only
        c = u * w_conv[:, K - 1]
    c = torch.nn.functional.silu(c)
    q = c[:, :key_dim].reshape(n, Hk, dh)
    k = c[:, key_dim:2 * key_dim].reshape(n, Hk, dh)
    vv = c[:, 2 * key_dim:].reshape(n, Hv, dh)
    if l2:
        q, k = l2norm(q, eps), l2norm(k, eps)
    heads = torch.arange(Hv) % Hk if tiled else torch.arange(Hv) // (Hv // Hk)
    q, k = q[:, heads], k[:, heads]  # [n, Hv, dh]
    bt = torch.sigmoid(h @ v(b + "ssm_beta.weight").T) if beta else torch.ones(n, Hv, dtype=h.dtype)
    g = torch.nn.functional.softplus(h @ v(b + "ssm_alpha.weight").T + v(b + "ssm_dt.bias")) * v(b + "ssm_a")
    if not decay:
        g = torch.zeros_like(g)
    S = torch.zeros(Hv, dh, dh, dtype=h.dtype)  # [head, key dim, value dim]
    out = torch.empty(n, Hv, dh, dtype=h.dtype)
    for t in range(n):
        S = S * g[t].exp()[:, None, None]
        recalled = torch.einsum("hkv,hk->hv", S, k[t])
        S = S + torch.einsum("hk,hv->hkv", k[t], bt[t][:, None] * (vv[t] - recalled))
        out[t] = torch.einsum("hkv,hk->hv", S, q[t]) / np.sqrt(dh)
    o = rms_norm(out, v(b + "ssm_norm.weight"), eps)
    o = o * torch.nn.functional.silu(z) if gated_norm else o
    return o.reshape(n, value_dim) @ v(b + "ssm_out.weight").T


def full_attention(v: Values, b: str, h: Tensor, cfg, gate=True, partial_rope=True) -> Tensor:
    """[n, d]: the gated full-attention mix over h [n, d] (cfg: the file's ModelConfig)."""
    n, H, Hkv, hd = h.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qg = (h @ v(b + "attn_q.weight").T).view(n, H, 2 * hd)
    q, gt = qg[..., :hd], qg[..., hd:]
    k = (h @ v(b + "attn_k.weight").T).view(n, Hkv, hd)
    vv = (h @ v(b + "attn_v.weight").T).view(n, Hkv, hd)
    q = rms_norm(q, v(b + "attn_q_norm.weight"), cfg.norm_eps)
    k = rms_norm(k, v(b + "attn_k_norm.weight"), cfg.norm_eps)
    q, k, vv = q.transpose(0, 1), k.transpose(0, 1), vv.transpose(0, 1)  # [heads, n, hd]
    rot = (cfg.rope_dims or hd) if partial_rope else hd
    cos, sin = rope_cos_sin(n, rot, cfg.rope_theta)
    q = torch.cat([apply_rope(q[..., :rot], cos.double(), sin.double()), q[..., rot:]], -1)
    k = torch.cat([apply_rope(k[..., :rot], cos.double(), sin.double()), k[..., rot:]], -1)
    rep = H // Hkv
    k, vv = k.repeat_interleave(rep, 0), vv.repeat_interleave(rep, 0)  # head h reads kv head h // rep
    s = q @ k.transpose(1, 2) / np.sqrt(hd)
    pos = torch.arange(n)
    s = s.masked_fill(~(pos[None, :] <= pos[:, None]), float("-inf"))
    o = (torch.softmax(s, -1) @ vv).transpose(0, 1)  # [n, heads, hd]
    if gate:
        o = o * torch.sigmoid(gt)
    return o.reshape(n, H * hd) @ v(b + "attn_output.weight").T


def moe_ffn(v: Values, b: str, h: Tensor, top_k: int, norm_topk=True, shared=True, shared_gate=True) -> Tensor:
    """[n, d]: qwen35moe's FFN over h [n, d]."""
    probs = torch.softmax(h @ v(b + "ffn_gate_inp.weight").T, -1)  # [n, E]
    top = probs.topk(top_k, dim=-1)
    wts = top.values / top.values.sum(-1, keepdim=True) if norm_topk else top.values
    wg, wu, wd = v(b + "ffn_gate_exps.weight"), v(b + "ffn_up_exps.weight"), v(b + "ffn_down_exps.weight")
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(top_k):
            e = int(top.indices[t, j])
            out[t] += wts[t, j] * (wd[e] @ (torch.nn.functional.silu(wg[e] @ h[t]) * (wu[e] @ h[t])))
    if shared:
        sh = torch.nn.functional.silu(h @ v(b + "ffn_gate_shexp.weight").T) * (h @ v(b + "ffn_up_shexp.weight").T)
        sh = sh @ v(b + "ffn_down_shexp.weight").T
        if shared_gate:
            sh = sh * torch.sigmoid(h @ v(b + "ffn_gate_inp_shexp.weight"))[:, None]
        out = out + sh
    return out


def reference_logits(path: str | os.PathLike, toks: list[int], pattern=True, gate=True, partial_rope=True,
                     norm_topk=True, shared=True, shared_gate=True, **dnet) -> np.ndarray:
    """[n, V] logits (float64) of a qwen35 / qwen35moe GGUF over `toks`, token t at position t; the
    flags drop one feature each (`dnet`: delta_net's). pattern=False runs each pair of blocks
    swapped (1, 0, 3, 2, ...: a wrong layer pattern; an even layer count)."""
    from cflow.convert.gguf import GGUFModel
    from cflow.convert.gguf_qwen35 import qwen35_config

    g = GGUFModel(path)
    cfg = qwen35_config(g)
    eps = cfg.norm_eps
    v = lambda n: torch.from_numpy(g.values(n).astype(np.float64))  # noqa: E731
    x = v("token_embd.weight")[torch.tensor(toks)]
    order = list(range(cfg.n_layers)) if pattern else [i ^ 1 for i in range(cfg.n_layers)]
    for i in order:
        b = f"blk.{i}."
        h = rms_norm(x, v(b + "attn_norm.weight"), eps)
        if cfg.is_recurrent(i):
            x = x + delta_net(v, b, h, eps, **dnet)
        else:
            x = x + full_attention(v, b, h, cfg, gate=gate, partial_rope=partial_rope)
        h = rms_norm(x, v(b + "post_attention_norm.weight"), eps)
        if cfg.has_moe:
            x = x + moe_ffn(v, b, h, cfg.top_k, norm_topk=norm_topk, shared=shared, shared_gate=shared_gate)
            continue
        ffn = torch.nn.functional.silu(h @ v(b + "ffn_gate.weight").T) * (h @ v(b + "ffn_up.weight").T)
        x = x + ffn @ v(b + "ffn_down.weight").T
    head = v("output.weight") if "output.weight" in g.tensors else v("token_embd.weight")
    return (rms_norm(x, v("output_norm.weight"), eps) @ head.T).numpy()
