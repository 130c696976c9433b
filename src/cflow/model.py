"""PyTorch reference of the pipeline-native architecture family, for training and as the
numerical oracle of the C engine.

Owns: the modules (RMSNorm, rotary embeddings, GQA attention, SwiGLU, MoE, Block, Transformer),
the delayed residual wiring, weight init, and `ReferenceDecoder`, a plain token-by-token decode
that is the algorithm the C runtime mirrors. Parameter names are the contract in docs/DESIGN.md.

Layer l (x_l = residual entering layer l, x_0 = token embeddings; indices < 0 clamp to x_0):

    a_l = Attn_l(norm(x_l));  h_l = x_l + a_l
    u_l = h_l if delta_dense == 0 else x_{l+1-delta_dense}
    f_l = FFN_l(norm(u_l))                                  (0 when d_ff == 0)
    z_l = h_l + f_l if moe_input == "post_dense" else h_l
    m_l = MoE_l(norm(z_l))                                  (0 when n_experts == 0)
    x_{l+1} = h_l + f_l + sum(m_j for j + delta_expert == l)

Expert outputs whose target layer j + delta_expert lies past the last layer are added to x_L
before the final norm. The delays act along the layer axis only, so causal masking is unchanged.

Multi-token prediction (cfg.mtp_heads = N > 0): with h_t = norm(x_L) at position t (what the
lm_head reads), head j = 0..N-1 predicts token t+2+j as lm_head(MtpHead_j(h_t)), MtpHead_j(h) =
RMSNorm_j(h + w_down_j silu(w_up_j h)) (the shared lm_head; its w_down starts small, so a fresh
head starts as a copy of the next-token prediction). forward() returns their logits in
aux["mtp_logits"]; the training loss adds their cross-entropy (cflow.train.loop.compute_loss).

Conventions the C engine must share:
- RMSNorm: x * rsqrt(mean(x^2) + eps) * weight, computed in float32.
- Rotary ("half" / GPT-NeoX / HF Llama): pairs (x[j], x[j + hd/2]) rotate by angle
  pos * theta^(-2j/hd); angles are computed in float64, then cos/sin rounded to float32.
- Family options: the q/k/v bias is added before anything else; qk_norm is RMSNorm over each head's
  hd values (same eps), before RoPE (qk_norm_full: over the whole q and the whole k vector); a
  sliding window W masks keys older than p - W + 1 on the local layers (cfg.is_local: all, or all
  but every sliding_window_pattern-th), which rotate with rope_theta_local when it is set
  (cfg.layer_rope); scores are scaled by cfg.scores_scale; the rotated q at position p is multiplied
  by cfg.q_temperature(p) (Llama 4 / Mistral 3).
- Gemma options: x_0 = tok_emb[token] * embed_scale; post_norms: h = x + post_attn_norm(a),
  x' = h + post_ffn_norm(f); ffn_act "gelu_tanh": w_down(gelu_tanh(w_gate x) * w_up x).
- GQA: query head h reads kv head h // (n_heads / n_kv_heads); scores are scaled by 1/sqrt(hd).
- SwiGLU: w_down(silu(w_gate x) * w_up x) (GeGLU with ffn_act "gelu_tanh").
- Router: softmax over all E logits (float32), top-k, the k weights renormalised to sum to 1
  (moe_norm_topk; off: the k softmax probabilities as they are).
- Shared expert (d_shared_expert > 0): every token adds sigmoid(shared_gate . zn) * swiglu_sh(zn)
  to the routed sum m (zn = norm(z), the router's input).
- gpt-oss options: attn_sinks: head h's softmax runs over its scores and one more logit
  attn.sinks[h], whose share is dropped (softmax([s, sink])[:-1]); attn_out_bias: wo adds a bias;
  moe_bias: the router and each expert's gate, up and down add biases; moe_gating "softmax_topk":
  the top-k of the router logits (plus bias), weighted by the softmax over those k; expert_act
  "swiglu_oai": g = min(w_gate x + b, 7), u = clamp(w_up x + b, -7, 7),
  w_down(g * sigmoid(1.702 g) * (u + 1)) + b_down.
- Layer l uses weight set l % n_unique_layers (arch5 really shares the parameter tensors).

Short names: B batch, T time, d d_model, V vocab, E experts, k top_k, hd head_dim,
nh n_heads, nkv n_kv_heads, L n_layers, N = B*T tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cflow.config import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, ModelConfig
from cflow.errors import CflowError


class ModelError(CflowError, ValueError):
    """Bad input to the reference model: a sequence too long, or a state dict that does not fit."""


# ---- building blocks -------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # float32 statistics even under low-precision training, as the C engine does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_cos_sin(n_pos: int, head_dim: int, theta: float, factors: tuple = (),
                 mscale: float = 1.0) -> tuple[Tensor, Tensor]:
    """cos, sin tables [n_pos, head_dim/2] (float32) for positions 0..n_pos-1; `factors` (Llama 3's
    rope_freqs, YaRN's interpolation: head_dim/2 of them) divide the pairs' frequencies, and
    `mscale` (YaRN's) multiplies both tables."""
    j = torch.arange(head_dim // 2, dtype=torch.float64)
    inv_freq = theta ** (-2.0 * j / head_dim)  # [hd/2]
    if factors:
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float64)
    ang = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [n_pos, hd/2]
    return (mscale * ang.cos()).float(), (mscale * ang.sin()).float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [..., T, hd] by cos/sin [T, hd/2] in the "half" convention."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class Attention(nn.Module):
    """Grouped-query causal self-attention with rotary embeddings (training path: whole sequence).
    Options of the imported families: biases on q, k, v (qkv_bias), a per-head RMSNorm of q and
    of k before RoPE (qk_norm), and a sliding window of the last W positions (sliding_window)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.scale = cfg.attn_scale or None  # None: SDPA's own 1/sqrt(hd)
        self.wq = nn.Linear(cfg.d_model, cfg.q_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.q_dim, cfg.d_model, bias=cfg.attn_out_bias)
        if cfg.attn_sinks:  # [nh] one learned logit per query head (gpt-oss)
            self.sinks = nn.Parameter(torch.zeros(cfg.n_heads))
        self.qk_full = cfg.qk_norm_full
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.q_dim if self.qk_full else cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.kv_dim if self.qk_full else cfg.head_dim, cfg.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, window: int = 0, q_scale: Tensor | None = None) -> Tensor:
        """`window`: the layer's sliding window (0: the whole context; cfg.layer_window); `q_scale`
        [T]: each position's query temperature (cfg.q_temperature), or None."""
        B, T, _ = x.shape
        q, k = self.wq(x), self.wk(x)
        if self.qk_full:  # OLMoE: over all heads at once
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.nh, self.hd).transpose(1, 2)  # [B, nh, T, hd]
        k = k.view(B, T, self.nkv, self.hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.wv(x).view(B, T, self.nkv, self.hd).transpose(1, 2)  # [B, nkv, T, hd]
        if hasattr(self, "q_norm") and not self.qk_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if q_scale is not None:
            q = q * q_scale.to(q.dtype)[:, None]
        rep = self.nh // self.nkv
        # repeat_interleave: query head h reads kv head h // rep (HF Llama's repeat_kv).
        k = k.repeat_interleave(rep, dim=1)  # [B, nh, T, hd]
        v = v.repeat_interleave(rep, dim=1)
        if hasattr(self, "sinks"):
            y = attend_with_sinks(q, k, v, self.sinks, window, self.scale or 1.0 / math.sqrt(self.hd))
        elif window:
            t = torch.arange(T, device=x.device)
            ago = t[:, None] - t[None, :]  # [T, T] query position minus key position
            mask = (ago >= 0) & (ago < window)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)  # [B, nh, T, hd]
        return self.wo(y.transpose(1, 2).reshape(B, T, self.nh * self.hd))


def attend_with_sinks(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, window: int, scale: float) -> Tensor:
    """Causal attention (q, k, v [B, nh, T, hd], k and v already repeated per query head) whose
    head h softmax also holds the logit sinks[h], its share dropped; `window` > 0 keeps the last
    `window` positions."""
    T = q.shape[2]
    t = torch.arange(T, device=q.device)
    ago = t[:, None] - t[None, :]
    mask = (ago >= 0) & ((ago < window) if window else True)
    s = (q @ k.transpose(-1, -2)) * scale  # [B, nh, T, T]
    s = s.masked_fill(~mask, float("-inf"))
    sink = sinks.to(s.dtype).view(1, -1, 1, 1).expand(s.shape[0], -1, T, 1)
    a = torch.cat([s, sink], dim=-1).softmax(dim=-1)[..., :T]
    return a @ v


def swiglu_oai(g: Tensor, u: Tensor) -> Tensor:
    """OpenAI's clamped SwiGLU (gpt-oss's experts) on the biased gate and up pre-activations."""
    g = g.clamp(max=SWIGLU_OAI_LIMIT)
    u = u.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    return g * torch.sigmoid(SWIGLU_OAI_ALPHA * g) * (u + 1)


def ffn_act(name: str):
    """The gate activation of config ffn_act: silu (SwiGLU) or gelu_tanh (GeGLU)."""
    return F.silu if name == "silu" else (lambda x: F.gelu(x, approximate="tanh"))


class SwiGLU(nn.Module):
    """SwiGLU, or with act="gelu_tanh" GeGLU: w_down(act(w_gate x) * w_up x)."""

    def __init__(self, d_model: int, d_hidden: int, act: str = "silu") -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_hidden, bias=False)
        self.w_up = nn.Linear(d_model, d_hidden, bias=False)
        self.w_down = nn.Linear(d_hidden, d_model, bias=False)
        self.act = ffn_act(act)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_down(self.act(self.w_gate(x)) * self.w_up(x))


class MoE(nn.Module):
    """Top-k softmax-routed SwiGLU experts with stacked parameters [E, ...].

    Training computes each expert only on the tokens routed to it, so the cost is k/E of running
    every expert on every token: the N*k (token, expert) choices are sorted by expert once, the
    tokens gathered once in that order, each expert runs on its contiguous slice, and one weighted
    index_add puts the outputs back (one gather and one scatter per layer instead of one per expert).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, d, dx = cfg.n_experts, cfg.d_model, cfg.d_expert
        self.n_experts, self.top_k, self.norm_topk = E, cfg.top_k, cfg.moe_norm_topk
        self.gating, self.oai = cfg.moe_gating, cfg.expert_act == "swiglu_oai"
        self.router = nn.Linear(d, E, bias=cfg.moe_bias)
        self.w_gate = nn.Parameter(torch.empty(E, dx, d))
        self.w_up = nn.Parameter(torch.empty(E, dx, d))
        self.w_down = nn.Parameter(torch.empty(E, d, dx))
        if cfg.moe_bias:  # gpt-oss: each expert's gate, up and down biases
            self.b_gate = nn.Parameter(torch.zeros(E, dx))
            self.b_up = nn.Parameter(torch.zeros(E, dx))
            self.b_down = nn.Parameter(torch.zeros(E, d))
        if cfg.has_shared_expert:
            self.shared = SwiGLU(d, cfg.d_shared_expert)
            self.shared_gate = nn.Parameter(torch.empty(d))  # [d], the table's moe.shared_gate

    def shared_out(self, x: Tensor) -> Tensor:
        """The gated shared expert on x [N, d] (zeros without one)."""
        if not hasattr(self, "shared"):
            return torch.zeros_like(x)
        gate = torch.sigmoid((x @ self.shared_gate).float()).to(x.dtype)  # [N]
        return gate[:, None] * self.shared(x)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [N, d] -> (router logits [N, E] f32, probs [N, E], weights [N, k], experts [N, k])."""
        logits = self.router(x).float()
        probs = logits.softmax(dim=-1)
        if self.gating == "softmax_topk":  # gpt-oss: the softmax over the k chosen logits
            top, idx = logits.topk(self.top_k, dim=-1)
            return logits, probs, top.softmax(dim=-1), idx
        w, idx = probs.topk(self.top_k, dim=-1)
        return logits, probs, w / w.sum(dim=-1, keepdim=True) if self.norm_topk else w, idx

    def forward(self, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """x [N, d] (already normalised) -> (y [N, d], {"load_balance", "router_z"})."""
        logits, probs, w, idx = self.route(x)
        y = self.shared_out(x)
        y.index_add_(0, *self._dispatch(x, w, idx))
        return y, self._aux(logits, probs, idx)

    # The experts' token counts are data: torch.compile would trace a graph per count pattern, and
    # its dynamic-shape guards on the concatenated length fail (torch 2.13: "282 not in
    # VR[8192, 8192]" after some hundred steps), so the dispatch stays eager around a compiled rest.
    @torch.compiler.disable
    def _dispatch(self, x: Tensor, w: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
        """(the token of each routing choice [N*k], its weighted expert output [N*k, d])."""
        flat = idx.reshape(-1)  # [N*k] the expert of each (token, slot), token-major
        order = torch.argsort(flat, stable=True)  # choices grouped by expert, token order kept inside
        tok = order // self.top_k  # [N*k] the token of each sorted choice
        xs = x[tok]  # [N*k, d]
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        # split, not a slice per expert: a slice's backward writes its gradient into a zero tensor
        # of all N*k rows, E of them per layer; split's backward is one concatenation.
        # Empty slices still run, so every parameter gets a (zero) gradient: DDP-safe.
        outs = [self.expert(e, xe) for e, xe in enumerate(torch.split(xs, counts))]  # [n_e, d] each
        return tok, torch.cat(outs) * w.reshape(-1)[order, None].to(x.dtype)  # [N*k, d]

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert e on x [n, d]: SwiGLU, or (gpt-oss) the biased clamped SwiGLU."""
        if self.oai:
            g = x @ self.w_gate[e].T + self.b_gate[e]
            u = x @ self.w_up[e].T + self.b_up[e]
            return swiglu_oai(g, u) @ self.w_down[e].T + self.b_down[e]
        return (F.silu(x @ self.w_gate[e].T) * (x @ self.w_up[e].T)) @ self.w_down[e].T

    def _aux(self, logits: Tensor, probs: Tensor, idx: Tensor) -> dict[str, Tensor]:
        # Switch-Transformer balance: E * sum_e f_e * P_e, with f_e the share of the N*k routing
        # slots that chose e and P_e the mean router probability of e (1.0 when uniform).
        counts = torch.bincount(idx.flatten(), minlength=self.n_experts).float()  # [E]
        f = counts / idx.numel()
        lb = self.n_experts * (f * probs.mean(dim=0)).sum()
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        return {"load_balance": lb, "router_z": z}


class Block(nn.Module):
    """One weight set: attention, optional dense FFN, optional MoE, each behind its RMSNorm.

    The residual wiring (which x feeds which part, where expert outputs land) lives in
    Transformer.forward, because with delays it spans several layers.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        if cfg.post_norms:
            self.attn_post_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.has_dense:
            self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.ffn = SwiGLU(cfg.d_model, cfg.d_ff, cfg.ffn_act)
            if cfg.post_norms:
                self.ffn_post_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.has_moe:
            self.moe_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.moe = MoE(cfg)

    def attend(self, x: Tensor, cos: Tensor, sin: Tensor, window: int = 0, q_scale: Tensor | None = None) -> Tensor:
        a = self.attn(self.attn_norm(x), cos, sin, window, q_scale)
        return self.attn_post_norm(a) if hasattr(self, "attn_post_norm") else a

    def dense(self, u: Tensor) -> Tensor:
        f = self.ffn(self.ffn_norm(u))
        return self.ffn_post_norm(f) if hasattr(self, "ffn_post_norm") else f

    def experts(self, z: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        B, T, d = z.shape
        y, aux = self.moe(self.moe_norm(z).reshape(B * T, d))
        return y.view(B, T, d), aux


class MtpHead(nn.Module):
    """One multi-token prediction head: h [.., d] (the final normed hidden state) -> the normed
    input of the shared lm_head for a token further ahead. A residual MLP (2 d^2 parameters)."""

    def __init__(self, d_model: int, eps: float) -> None:
        super().__init__()
        self.w_up = nn.Linear(d_model, d_model, bias=False)
        self.w_down = nn.Linear(d_model, d_model, bias=False)
        self.norm = RMSNorm(d_model, eps)

    def forward(self, h: Tensor) -> Tensor:
        return self.norm(h + self.w_down(F.silu(self.w_up(h))))


# ---- the model -------------------------------------------------------------------------------


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.mla or cfg.n_dense_lead or cfg.moe_gating == "sigmoid" or cfg.moe_router_bias or cfg.moe_groups \
                or cfg.moe_weights_scale != 1.0 or not cfg.shared_expert_gate:
            raise ModelError(f"config {cfg.name!r} is DeepSeek's (latent attention, leading dense layers or its "
                             "routing), which this trainable model does not build; its float reference is "
                             "cflow.model_deepseek2 (from the GGUF)")
        from cflow.model_gemma4 import is_gemma4

        if is_gemma4(cfg):
            raise ModelError(f"config {cfg.name!r} is Gemma 4's (per-layer shapes, shared K/V, per-layer embeddings), "
                             "which this trainable model does not build; its float reference is cflow.model_gemma4")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # Only the unique weight sets exist; layer l calls layers[l % n_unique_layers].
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_unique_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # an empty ModuleList has no parameters: models without heads keep their state dict
        self.mtp = nn.ModuleList(MtpHead(cfg.d_model, cfg.norm_eps) for _ in range(cfg.mtp_heads))
        cos, sin = rope_cos_sin(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta, cfg.rope_freq_factors, cfg.rope_mscale)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_seq_len, hd/2]
        self.register_buffer("rope_sin", sin, persistent=False)
        if cfg.rope_theta_local > 0:  # the local layers' own (unscaled) RoPE
            cos, sin = rope_cos_sin(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta_local)
            self.register_buffer("rope_cos_local", cos, persistent=False)
            self.register_buffer("rope_sin_local", sin, persistent=False)
        self.reset_parameters()

    def block(self, layer: int) -> Block:
        return self.layers[self.cfg.weight_layer(layer)]

    # ---- init --------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, std) weights; projections into the residual stream (wo, w_down, expert
        w_down) get std / sqrt(2 * n_layers) so the residual variance does not grow with depth
        (GPT-2). Norm weights are 1, biases 0."""
        resid_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name.endswith(("attn.wo.weight", "ffn.w_down.weight", "moe.w_down", "shared.w_down.weight")) or (
                    name.startswith("mtp.") and name.endswith("w_down.weight")):
                p.normal_(0.0, resid_std)
            else:
                p.normal_(0.0, std)

    def num_params(self, non_embedding: bool = False) -> int:
        """Unique parameters (shared arch5 sets count once); optionally without the embedding
        table (an untied lm_head is always counted)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_emb.weight.numel() if non_embedding else n

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, idx: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """idx [B, T] -> (logits [B, T, V] float32, {"load_balance", "router_z"} averaged over
        the MoE layers; zeros without MoE; with mtp_heads N > 0 also "mtp_logits": N tensors
        [B, T, V], head j's at position t predicting token t+2+j)."""
        cfg = self.cfg
        B, T = idx.shape
        if T > cfg.max_seq_len:
            raise ModelError(f"sequence length {T} exceeds max_seq_len {cfg.max_seq_len}; "
                             f"crop the input or raise max_seq_len in the config")
        L, dd, de = cfg.n_layers, cfg.delta_dense, cfg.delta_expert
        q_scale = None
        if cfg.attn_temp_scale:
            q_scale = torch.tensor([cfg.q_temperature(p) for p in range(T)], dtype=torch.float32, device=idx.device)
        emb = self.tok_emb(idx)
        xs = [emb * cfg.embed_scale if cfg.embed_scale != 1.0 else emb]  # xs[l] = x_l [B, T, d]
        # pending[t]: expert outputs that join x_{t+1}; pending[L]: added before the final norm.
        pending: list[list[Tensor]] = [[] for _ in range(L + 1)]
        aux: list[dict[str, Tensor]] = []
        for layer in range(L):
            blk, x = self.block(layer), xs[layer]
            local = cfg.rope_theta_local > 0 and cfg.is_local(layer)
            cos = (self.rope_cos_local if local else self.rope_cos)[:T]
            sin = (self.rope_sin_local if local else self.rope_sin)[:T]
            h = x + blk.attend(x, cos, sin, cfg.layer_window(layer), q_scale)
            f = blk.dense(h if dd == 0 else xs[max(layer + 1 - dd, 0)]) if cfg.has_dense else None
            if cfg.has_moe:
                z = h + f if (cfg.moe_input == "post_dense" and f is not None) else h
                m, stats = blk.experts(z)
                pending[min(layer + de, L)].append(m)
                aux.append(stats)
            x_next = h if f is None else h + f
            for m in pending[layer]:
                x_next = x_next + m
            xs.append(x_next)
        x = xs[L]
        for m in pending[L]:
            x = x + m
        xn = self.norm(x)
        logits = self.logits(xn)
        out = self._mean_aux(aux, logits)
        if len(self.mtp):
            out["mtp_logits"] = self.mtp_logits(xn)
        return logits, out

    def mtp_logits(self, xn: Tensor) -> list[Tensor]:
        """The heads' logits from final normed hidden states xn [.., d]: one [.., V] per head."""
        return [self.logits(head(xn)) for head in self.mtp]

    def logits(self, xn: Tensor) -> Tensor:
        w = self.tok_emb.weight if self.lm_head is None else self.lm_head.weight  # [V, d]
        return F.linear(xn, w).float()

    @staticmethod
    def _mean_aux(aux: list[dict[str, Tensor]], like: Tensor) -> dict[str, Tensor]:
        if not aux:
            zero = like.new_zeros(())
            return {"load_balance": zero, "router_z": zero.clone()}
        return {k: torch.stack([a[k] for a in aux]).mean() for k in ("load_balance", "router_z")}

    # ---- loading -----------------------------------------------------------------------------
    @classmethod
    def from_state(cls, cfg: ModelConfig, state_dict: dict[str, Tensor]) -> "Transformer":
        """Build a model for `cfg` and load `state_dict` (names as in docs/DESIGN.md) strictly."""
        model = cls(cfg)
        own = model.state_dict()
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise ModelError(f"state dict does not match config {cfg.name!r}: missing {missing[:6]}"
                             f"{'...' if len(missing) > 6 else ''}, unexpected {unexpected[:6]}"
                             f"{'...' if len(unexpected) > 6 else ''}; "
                             f"load the config.json saved with these weights")
        for name, t in state_dict.items():
            if tuple(t.shape) != tuple(own[name].shape):
                raise ModelError(f"tensor {name!r} has shape {tuple(t.shape)}, config {cfg.name!r} "
                                 f"expects {tuple(own[name].shape)}; load the matching config.json")
        model.load_state_dict(state_dict, strict=True)
        return model

    @classmethod
    def from_cflow(cls, path) -> "Transformer":
        """The model whose weights are exactly a .cflow file's, dequantized (the fp32 reference the
        engine is held against: tests and `cflow bench claims` C7)."""
        import numpy as np

        from cflow.convert.encoder import split_fused, stored_values
        from cflow.fileformat import open_model
        from cflow import weights
        from cflow.quant import deinterleave_gate_up
        from cflow.weights import QKV_PARTS

        cf = open_model(path)
        cfg = cf.config

        def val(name: str) -> "np.ndarray":
            return stored_values(cf, name)

        def parts(name: str) -> list:
            return split_fused(val(name), cf.tensors[name].meta)

        sd = {"tok_emb.weight": val("tok_emb"), "norm.weight": val("norm")}
        if not cfg.tie_embeddings:
            sd["lm_head.weight"] = val("lm_head")
        for w in weights.mtp_weights(cfg):
            sd[w.name + ".weight"] = val(w.name)
        for i in range(cfg.n_unique_layers):
            p = f"layers.{i}."
            sd[p + "attn_norm.weight"] = val(p + "attn_norm")
            by_parts = p + QKV_PARTS[0] in cf.tensors  # q, k, v stored apart (cflow.weights)
            qkv = [val(p + s) for s in QKV_PARTS] if by_parts else parts(p + "attn.wqkv")
            sd[p + "attn.wq.weight"], sd[p + "attn.wk.weight"], sd[p + "attn.wv.weight"] = qkv
            if cfg.qkv_bias:
                b = val(p + "attn.qkv_bias")
                sd[p + "attn.wq.bias"], sd[p + "attn.wk.bias"], sd[p + "attn.wv.bias"] = np.split(
                    b, [cfg.q_dim, cfg.q_dim + cfg.kv_dim])
            if cfg.qk_norm:
                sd[p + "attn.q_norm.weight"] = val(p + "attn.q_norm")
                sd[p + "attn.k_norm.weight"] = val(p + "attn.k_norm")
            sd[p + "attn.wo.weight"] = val(p + "attn.wo")
            if cfg.attn_out_bias:
                sd[p + "attn.wo.bias"] = val(p + "attn.wo_bias")
            if cfg.attn_sinks:
                sd[p + "attn.sinks"] = val(p + "attn.sinks")
            if cfg.post_norms:
                sd[p + "attn_post_norm.weight"] = val(p + "attn_post_norm")
                if cfg.has_dense:
                    sd[p + "ffn_post_norm.weight"] = val(p + "ffn_post_norm")
            if cfg.has_dense:
                sd[p + "ffn_norm.weight"] = val(p + "ffn_norm")
                sd[p + "ffn.w_gate.weight"], sd[p + "ffn.w_up.weight"] = parts(p + "ffn.w_gate_up")
                sd[p + "ffn.w_down.weight"] = val(p + "ffn.w_down")
            if cfg.has_moe:
                sd[p + "moe_norm.weight"] = val(p + "moe_norm")
                sd[p + "moe.router.weight"] = val(p + "moe.router")
                ex = [parts(f"{p}moe.experts.{e}.w_gate_up") + [val(f"{p}moe.experts.{e}.w_down")]
                      for e in range(cfg.n_experts)]
                for j, key in enumerate(("moe.w_gate", "moe.w_up", "moe.w_down")):
                    sd[p + key] = np.stack([x[j] for x in ex])
                if cfg.moe_bias:
                    sd[p + "moe.router.bias"] = val(p + "moe.router_bias")
                    bias = [list(deinterleave_gate_up(val(f"{p}moe.experts.{e}.b_gate_up")))
                            + [val(f"{p}moe.experts.{e}.b_down")] for e in range(cfg.n_experts)]
                    for j, key in enumerate(("moe.b_gate", "moe.b_up", "moe.b_down")):
                        sd[p + key] = np.stack([b[j] for b in bias])
                if cfg.has_shared_expert:
                    sd[p + "moe.shared_gate"] = val(p + "moe.shared_gate")
                    sd[p + "moe.shared.w_gate.weight"], sd[p + "moe.shared.w_up.weight"] = parts(
                        p + "moe.shared.w_gate_up")
                    sd[p + "moe.shared.w_down.weight"] = val(p + "moe.shared.w_down")
        cf.close()
        return cls.from_state(cfg, {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()})


# ---- plain incremental decode (the C engine's algorithm) -------------------------------------


def _rmsnorm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean() + eps) * w


def _swiglu(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, act=F.silu) -> Tensor:
    return w_down @ (act(w_gate @ x) * (w_up @ x))


class ReferenceDecoder:
    """Token-by-token decode of a Transformer, written plainly as the C runtime will do it.

    State (allocated once, float32):
      k_cache, v_cache  [L, max_seq_len, nkv, hd]   one per layer, also when weights are shared
      ring              [H, d]    H = cfg.history_depth = max(dd, de) + 1; x_l lives in ring[l % H]
      pending           [de+1, d] pending[t % (de+1)] accumulates expert outputs that join x_{t+1}
      late              [d]       expert outputs whose target t = l + de is >= L (added before
                                  the final norm)

    step(token) at position p = number of tokens seen so far:
      ring[0] = tok_emb[token] * embed_scale; pending = 0; late = 0   # x_0
      for l in 0..L-1 (weights W = set l % n_unique_layers):
        x  = ring[l % H]
        xn = rmsnorm(x, W.attn_norm)
        q = W.wq xn; k = W.wk xn; v = W.wv xn                         # [nh*hd], [nkv*hd] x2
        (qkv_bias: + W.bq, W.bk, W.bv; qk_norm: rmsnorm each q head by W.q_norm, each k head by W.k_norm)
        t0 = max(0, p - W + 1) with W = cfg.layer_window(l) > 0 (a local layer), else 0
        rotate q and k per head at position p ("half" convention; RoPE of layer_rope(l)), q times
        q_temperature(p); store k, v at k/v_cache[l, p]
        for head h: g = h // (nh/nkv)
          s[t] = q_h . k_cache[l, t, g] / sqrt(hd) (or * attn_scale), t = t0..p
          o_h = sum_t softmax(s)[t] v_cache[l, t, g]   (attn_sinks: softmax([s, sinks[h]])[:-1])
        h = x + W.wo o (+ W.wo_bias)           (post_norms: x + rmsnorm(W.wo o, W.attn_post_norm))
        f = 0
        if dense: u = h if dd == 0 else ring[max(l + 1 - dd, 0) % H]   # x_{l+1-dd}, clamped to x_0
                  f = swiglu(rmsnorm(u, W.ffn_norm))   (gelu_tanh: geglu; post_norms: rmsnorm(f, W.ffn_post_norm))
        if moe:   z = h + f if moe_input == "post_dense" else h
                  zn = rmsnorm(z, W.moe_norm); probs = softmax(W.router zn)   # [E], float32
                  top-k experts e_i with weights w_i = probs[e_i] / sum_i probs[e_i]
                  (moe_norm_topk off: w_i = probs[e_i]; moe_gating "softmax_topk": e_i the top-k
                  of the logits (+ router bias), w = softmax of those k; expert_act "swiglu_oai":
                  each expert the biased clamped SwiGLU of the module docstring)
                  m = sum_i w_i * swiglu_{e_i}(zn)  (+ sigmoid(shared_gate . zn) * swiglu_sh(zn))
                  t = l + de; if t < L: pending[t % (de+1)] += m  else: late += m
        x_next = h + f + pending[l % (de+1)]; pending[l % (de+1)] = 0    # slot reused by l+de+1
        ring[(l + 1) % H] = x_next
      logits = lm_head(rmsnorm(ring[L % H] + late, norm))                 # tok_emb when tied

    Why the ring is deep enough: layer l reads x_{l+1-dd} >= x_{l+2-H}, and writing x_{l+1}
    evicts x_{l+1-H}, which no later layer reads. The clamp to x_0 only happens for l < dd - 1,
    before slot 0 is reused. Only dd of the H slots are ever read back; the expert delay needs
    no old residual here because this plain version runs the experts of layer l at layer l and
    parks their output in `pending`. A pipelined engine that runs them later must also keep
    norm(z_l) until then.
    """

    def __init__(self, model: Transformer, max_seq_len: int | None = None) -> None:
        cfg = model.cfg
        self.cfg = cfg
        self.max_seq_len = max_seq_len or cfg.max_seq_len
        self.sets = [{k: v.detach().float() for k, v in blk.state_dict().items()} for blk in model.layers]
        self.tok_emb = model.tok_emb.weight.detach().float()  # [V, d]
        self.out_w = self.tok_emb if model.lm_head is None else model.lm_head.weight.detach().float()
        self.norm_w = model.norm.weight.detach().float()
        # [S, hd/2] per layer: global layers' and (rope_theta_local) local layers' tables
        tables = {}
        self.rope = []
        for layer in range(cfg.n_layers):
            key = cfg.layer_rope(layer)
            if key not in tables:
                tables[key] = rope_cos_sin(self.max_seq_len, cfg.head_dim, *key)
            self.rope.append(tables[key])
        L, d, S = cfg.n_layers, cfg.d_model, self.max_seq_len
        self.k_cache = torch.zeros(L, S, cfg.n_kv_heads, cfg.head_dim)
        self.v_cache = torch.zeros(L, S, cfg.n_kv_heads, cfg.head_dim)
        self.ring = torch.zeros(cfg.history_depth, d)
        self.pending = torch.zeros(cfg.delta_expert + 1, d)
        self.late = torch.zeros(d)
        self.pos = 0

    def reset(self) -> None:
        """Forget the sequence (the caches are overwritten, not cleared: positions >= pos are
        never read)."""
        self.pos = 0

    @torch.no_grad()
    def step(self, token: int) -> Tensor:
        """Feed one token at the next position; return its logits [V] (float32)."""
        cfg = self.cfg
        if self.pos >= self.max_seq_len:
            raise ModelError(f"decoder is full ({self.max_seq_len} positions); call reset() "
                             f"or build it with a larger max_seq_len")
        if not 0 <= token < cfg.vocab_size:
            raise ModelError(f"token id {token} is outside the vocabulary (0..{cfg.vocab_size - 1})")
        L, H, P = cfg.n_layers, cfg.history_depth, cfg.delta_expert + 1
        self.ring[0] = self.tok_emb[token] * cfg.embed_scale
        self.pending.zero_()
        self.late.zero_()
        for layer in range(L):
            W = self.sets[cfg.weight_layer(layer)]
            x = self.ring[layer % H].clone()
            a = self._attention(W, layer, _rmsnorm(x, W["attn_norm.weight"], cfg.norm_eps))
            if cfg.post_norms:
                a = _rmsnorm(a, W["attn_post_norm.weight"], cfg.norm_eps)
            h = x + a
            f = torch.zeros_like(h)
            if cfg.has_dense:
                u = h if cfg.delta_dense == 0 else self.ring[max(layer + 1 - cfg.delta_dense, 0) % H]
                f = _swiglu(_rmsnorm(u, W["ffn_norm.weight"], cfg.norm_eps),
                            W["ffn.w_gate.weight"], W["ffn.w_up.weight"], W["ffn.w_down.weight"], ffn_act(cfg.ffn_act))
                if cfg.post_norms:
                    f = _rmsnorm(f, W["ffn_post_norm.weight"], cfg.norm_eps)
            if cfg.has_moe:
                z = h + f if cfg.moe_input == "post_dense" else h
                m = self._experts(W, _rmsnorm(z, W["moe_norm.weight"], cfg.norm_eps))
                target = layer + cfg.delta_expert
                if target < L:
                    self.pending[target % P] += m
                else:
                    self.late += m
            self.ring[(layer + 1) % H] = h + f + self.pending[layer % P]
            self.pending[layer % P] = 0.0
        x = self.ring[L % H] + self.late
        self.pos += 1
        return self.out_w @ _rmsnorm(x, self.norm_w, cfg.norm_eps)  # [V]

    def _attention(self, W: dict[str, Tensor], layer: int, xn: Tensor) -> Tensor:
        cfg, p = self.cfg, self.pos
        nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q = W["attn.wq.weight"] @ xn
        k = W["attn.wk.weight"] @ xn
        v = W["attn.wv.weight"] @ xn
        if cfg.qkv_bias:
            q, k, v = q + W["attn.wq.bias"], k + W["attn.wk.bias"], v + W["attn.wv.bias"]
        if cfg.qk_norm_full:  # the whole vectors (OLMoE), before RoPE
            q = _rmsnorm(q, W["attn.q_norm.weight"], cfg.norm_eps)
            k = _rmsnorm(k, W["attn.k_norm.weight"], cfg.norm_eps)
        q, k, v = q.view(nh, hd), k.view(nkv, hd), v.view(nkv, hd)
        if cfg.qk_norm and not cfg.qk_norm_full:  # per head, before RoPE
            q = torch.stack([_rmsnorm(h, W["attn.q_norm.weight"], cfg.norm_eps) for h in q])
            k = torch.stack([_rmsnorm(h, W["attn.k_norm.weight"], cfg.norm_eps) for h in k])
        cos, sin = (t[p : p + 1] for t in self.rope[layer])  # [1, hd/2]
        self.k_cache[layer, p] = apply_rope(k, cos, sin)
        self.v_cache[layer, p] = v
        q = apply_rope(q, cos, sin) * float(torch.tensor(cfg.q_temperature(p), dtype=torch.float32))
        o = torch.empty(nh, hd)
        rep = nh // nkv
        window = cfg.layer_window(layer)
        first = max(0, p - window + 1) if window else 0
        for head in range(nh):
            keys = self.k_cache[layer, first : p + 1, head // rep]  # [n, hd]
            vals = self.v_cache[layer, first : p + 1, head // rep]  # [n, hd]
            s = keys @ q[head] * cfg.attn_scale if cfg.attn_scale else keys @ q[head] / math.sqrt(hd)
            if cfg.attn_sinks:  # the sink joins the softmax; its share is dropped
                att = torch.cat([s, W["attn.sinks"][head:head + 1]]).softmax(dim=0)[:-1]
            else:
                att = s.softmax(dim=0)  # [n]
            o[head] = att @ vals
        out = W["attn.wo.weight"] @ o.flatten()
        return out + W["attn.wo.bias"] if cfg.attn_out_bias else out

    def _experts(self, W: dict[str, Tensor], zn: Tensor) -> Tensor:
        logits = W["moe.router.weight"] @ zn  # [E]
        if self.cfg.moe_bias:
            logits = logits + W["moe.router.bias"]
        if self.cfg.moe_gating == "softmax_topk":  # the top-k logits, then the softmax over them
            top, idx = logits.topk(self.cfg.top_k)
            w = top.softmax(dim=0)
        else:
            w, idx = logits.softmax(dim=0).topk(self.cfg.top_k)
        if self.cfg.moe_norm_topk and self.cfg.moe_gating == "softmax":
            w = w / w.sum()
        m = torch.zeros_like(zn)
        if self.cfg.has_shared_expert:
            gate = torch.sigmoid(W["moe.shared_gate"] @ zn)
            m += gate * _swiglu(zn, W["moe.shared.w_gate.weight"], W["moe.shared.w_up.weight"],
                                W["moe.shared.w_down.weight"])
        for wi, e in zip(w.tolist(), idx.tolist()):
            if self.cfg.expert_act == "swiglu_oai":
                g = W["moe.w_gate"][e] @ zn + W["moe.b_gate"][e]
                u = W["moe.w_up"][e] @ zn + W["moe.b_up"][e]
                m += wi * (W["moe.w_down"][e] @ swiglu_oai(g, u) + W["moe.b_down"][e])
            else:
                m += wi * _swiglu(zn, W["moe.w_gate"][e], W["moe.w_up"][e], W["moe.w_down"][e])
        return m
