"""The float reference of one Gated DeltaNet ("linear attention") layer as llama.cpp computes it
(src/models/qwen35.cpp, src/models/delta-net-base.cpp), shared by tests/test_qwen35.py (which
holds it to llama.cpp inside whole qwen35 / qwen35moe models) and tests/test_deltanet_step.py
(which holds cflow's C step to it). The equations are in test_qwen35's module docstring.
"""

from __future__ import annotations

import numpy as np
import torch


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def l2norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / max(|x|, eps) over the last dim (ggml_l2_norm)."""
    return x / x.norm(dim=-1, keepdim=True).clamp(min=eps)


def delta_net(v, b: str, h: torch.Tensor, eps: float, conv=True, decay=True, beta=True, l2=True, tiled=True,
               gated_norm=True) -> torch.Tensor:
    """[n, d]: the layer's mix (before the residual) over its normalised input h [n, d], token by
    token (the decode recurrence: conv state and S carried from row to row), in h's dtype; v(name)
    gives a weight under its GGUF name (numpy order, prefix b), and the sizes are the weights'.
    The flags drop one feature each (the controls)."""
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
