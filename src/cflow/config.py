"""Model configuration: one frozen dataclass for the whole architecture family, plus named presets.

Owns every architectural knob of the family and its validation. Nothing here imports torch, so the
runtime (engine, fileformat, dag) can read a config without the training stack.

Layer l of the family computes (x_l = residual entering layer l):

    a_l = Attn_l(norm(x_l));  h_l = x_l + a_l
    u_l = h_l if delta_dense == 0 else x_{l+1-delta_dense}
    f_l = FFN_l(norm(u_l))                         (absent when d_ff == 0)
    z_l = h_l + f_l if moe_input == "post_dense" else h_l
    m_l = MoE_l(norm(z_l))                         (absent when n_experts == 0)
    x_{l+1} = h_l + f_l + sum(m_j for j + delta_expert == l)

Expert outputs whose target layer lies past the last layer are added before the final norm.
Attention options of the imported families (all off by default, so older files load unchanged):
qkv_bias (Qwen2), qk_norm (Qwen3; with qk_norm_full, OLMoE: one RMSNorm over the whole q and
the whole k vector instead of one per head) and sliding_window (a query at position p attends to
positions max(0, p - W + 1)..p), on every layer, or (sliding_window_pattern N > 0, Gemma 3) on
the "local" layers l with l % N < N - 1 while every N-th layer attends to the whole context;
rope_theta_local > 0 gives the local layers a RoPE base of their own and no RoPE scaling (the
global layers keep rope_theta, rope_freq_factors and rope_mscale); attn_scale > 0 replaces the
scores' 1/sqrt(head_dim); attn_temp_scale > 0 (Llama 4 / Mistral 3's attention temperature)
multiplies the query at position p by 1 + attn_temp_scale * ln(floor(p / attn_temp_floor) + 1).
Gemma options: embed_scale multiplies the token embeddings (sqrt(d_model)); post_norms adds an
RMSNorm of the attention output and of the dense FFN output before each joins the residual (h_l =
x_l + norm(a_l), x_{l+1} = h_l + norm(f_l)); ffn_act "gelu_tanh" makes the dense FFN a GeGLU,
w_down(gelu_tanh(w_gate x) * w_up x), instead of SwiGLU ("silu"). MoE options of the imported
families: moe_norm_topk (default on: the top_k routing weights renormalised to sum to 1, as Mixtral
and Qwen3-MoE; off: the raw softmax
probabilities, as Qwen2-MoE and OLMoE) and d_shared_expert (Qwen2-MoE: one SwiGLU expert every
token runs, its output scaled by sigmoid(shared_gate . norm(z)), added to the routed sum).
gpt-oss options (all off by default): attn_sinks (each query head's learned logit joins its
softmax's denominator only, attn.sinks [n_heads]), attn_out_bias (the output projection adds
attn.wo_bias [d]), moe_bias (the router adds moe.router_bias [E]; each expert's gate, up and down
add their biases, stored beside the expert's matrices so they travel with it to disk),
moe_gating "softmax_topk" (the top_k chosen on the raw logits, their weights the softmax over
those k; default "softmax": over all E, then top_k) and expert_act "swiglu_oai" (OpenAI's clamped
SwiGLU, min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1); default "silu").
Gemma 4 options (all off by default): head_dim_local > 0 gives the local layers a head size of
their own (head_dim is then the global layers'), n_kv_heads_local > 0 a KV head count of their own
(n_kv_heads is then the global layers'; 26B-A4B: 8 local, 2 global); shared_kv_layers N > 0: the last N layers own no
K/V and attend over the cache of an earlier layer of their kind (kv_source: llama.cpp's rule, the
last KV-owning local layer for a local one, the last global one for a global one); d_ff_shared_kv
> 0 is the FFN width of those layers (Gemma 4 E2B's double-wide MLP); v_norm: each V head through
an unweighted RMSNorm before the cache; per_layer_dim P > 0: per-layer embeddings (cflow.weights:
ple_emb [vocab, L P], ple_proj [L P, d], ple_norm [P]; per layer ple.w_gate [P, d], ple.w_proj
[d, P], ple_post_norm [d]): with x0 the scaled embedding, layer l's input
ple_l = (rms(ple_proj x0 / sqrt(d))[l] * ple_norm + ple_emb[t][l] sqrt(P)) / sqrt(2), and after the
layer's FFN x += rms(ple.w_proj (gelu_tanh(ple.w_gate x) * ple_l)) * ple_post_norm; layer_out_scale:
then x *= out_scale [1] of the layer; logit_softcap c > 0: logits = c tanh(logits / c). Gemma 4's
MoE layers (26B-A4B: the dense FFN beside the experts, moe_input "post_attn", expert_act
"gelu_tanh"): moe_router_norm: the router reads rms(z) * moe.router_norm [d] instead of the
experts' input norm(z); expert_scale: expert e's output times moe.expert_scale[e]; moe_out_norms:
x_{l+1} = h + ffn_post_norm(rms(f) * ffn_post_norm_1 + rms(m) * moe_post_norm), m the experts' sum.
Qwen3.5 options (all off by default): full_attn_interval N > 0 makes layer l a Gated DeltaNet
("linear attention") layer unless (l + 1) % N == 0 (those keep full attention): ssm_k_heads q/k
heads and ssm_v_heads v heads of ssm_head_dim dims, a causal depthwise conv over ssm_conv_kernel
tokens, a per-sequence recurrent state instead of a KV cache (tests/test_qwen35.py's docstring
has the equations); rope_dims > 0 turns only the first rope_dims dims of each q/k head (partial
RoPE); attn_out_gate multiplies attention's output by sigmoid(W_gate x) per value before wo.
mtp_heads (default 0) adds multi-token prediction heads: head j predicts token t+2+j from the
final normed hidden state of position t (`cflow train --mtp N`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

from cflow.errors import CflowError

MOE_INPUTS = ("post_dense", "post_attn")
FFN_ACTS = ("silu", "gelu_tanh")
MOE_GATINGS = ("softmax", "sigmoid", "softmax_topk")
EXPERT_ACTS = ("silu", "swiglu_oai", "gelu_tanh")
# OpenAI's SwiGLU (expert_act "swiglu_oai"): llama.cpp's build_moe_ffn hard-codes them for gpt-oss
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0
# More heads than this predict so far ahead that their guesses are rarely accepted.
MAX_MTP_HEADS = 8


class ConfigError(CflowError, ValueError):
    """A model configuration is inconsistent or an override is malformed."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 4096
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 0  # 0: d_model // n_heads
    d_ff: int = 256  # dense SwiGLU hidden size; 0: no dense FFN
    n_experts: int = 0  # 0: no MoE block
    top_k: int = 0
    d_expert: int = 0  # hidden size of each expert's SwiGLU
    delta_dense: int = 0
    delta_expert: int = 0
    moe_input: str = "post_dense"
    n_unique_layers: int = 0  # 0: every layer has its own weights; k: layer l uses weights of l % k
    rope_theta: float = 10000.0
    # Llama 3's RoPE frequency factors (GGUF rope_freqs): () plain RoPE; else head_dim/2 divisors,
    # rotation pair j turning by pos * rope_theta^(-2j/head_dim) / rope_freq_factors[j]
    rope_freq_factors: tuple = ()
    # YaRN's magnitude correction: cos and sin (so q and k) scaled by it; 1.0 without YaRN
    rope_mscale: float = 1.0
    norm_eps: float = 1e-5
    max_seq_len: int = 512
    tie_embeddings: bool = True
    qkv_bias: bool = False  # q, k and v projections add a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and on k before RoPE (Qwen3)
    qk_norm_full: bool = False  # qk_norm over the whole q [q_dim] and k [kv_dim] vectors (OLMoE)
    sliding_window: int = 0  # 0: full causal attention; W: each query sees its last W positions
    # 0: the window (if any) on every layer; N > 0: only layers l with l % N < N - 1 ("local") are
    # windowed, every N-th layer is global (llama.cpp's swa pattern, Gemma 3: N = 6)
    sliding_window_pattern: int = 0
    rope_theta_local: float = 0.0  # 0: local layers rotate like global ones; > 0: their own base, unscaled
    attn_scale: float = 0.0  # 0: scores scaled by 1/sqrt(head_dim); else by this
    # Llama 4 / Mistral 3 attention temperature: q at position p times 1 + s * ln(floor(p / floor) + 1)
    attn_temp_scale: float = 0.0  # s; 0: none
    attn_temp_floor: int = 0  # positions per step of the temperature (the YaRN original context)
    embed_scale: float = 1.0  # the token embeddings are multiplied by it (Gemma: sqrt(d_model))
    post_norms: bool = False  # RMSNorm of the attention and dense FFN outputs before the residual (Gemma)
    ffn_act: str = "silu"  # the dense FFN's gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    moe_norm_topk: bool = True  # renormalise the top_k routing weights to sum to 1
    d_shared_expert: int = 0  # 0: none; else hidden size of the gated shared expert (Qwen2-MoE)
    # DeepSeek-V2/V3 (GGUF deepseek2). Multi-head latent attention when kv_lora_rank > 0: head_dim is
    # a query/key head (qk_nope + qk_rope_dim), n_kv_heads 1 (one latent per token: kv_lora_rank
    # normalised floats + the roped qk_rope_dim-wide k_pe, the whole KV cache); q_lora_rank > 0: the
    # query through a rank-q_lora_rank bottleneck with an RMSNorm; v_head_dim: a head's value width.
    # The rotated part is the last qk_rope_dim of each head ("half" convention after conversion).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    # layers 0..n_dense_lead-1 have only the dense FFN, the others only the MoE block (0: every layer both)
    n_dense_lead: int = 0
    # router scores: "softmax" over all experts, then top_k; "sigmoid" each (DeepSeek V3); "softmax_topk":
    # top_k of the logits (plus moe_bias's router bias), their weights the softmax over those k (gpt-oss)
    moe_gating: str = "softmax"
    moe_router_bias: bool = False  # a per-expert bias added to the scores for choosing only (V3)
    moe_groups: int = 0  # > 1: experts in that many equal groups; only the moe_groups_used best
    moe_groups_used: int = 0  # groups (by the sum of their two best scores) may be chosen
    moe_weights_scale: float = 1.0  # the routing weights are multiplied by it (routed_scaling_factor)
    shared_expert_gate: bool = True  # False: the shared expert joins unscaled (DeepSeek) instead of sigmoid-gated
    attn_sinks: bool = False  # each query head's learned sink logit joins its softmax's denominator (gpt-oss)
    attn_out_bias: bool = False  # the output projection adds a bias (gpt-oss)
    moe_bias: bool = False  # router and expert gate/up/down biases (gpt-oss)
    expert_act: str = "silu"  # the experts' activation: "silu" (SwiGLU) or "swiglu_oai" (gpt-oss)
    # Gemma 4 (module docstring); all off by default
    head_dim_local: int = 0  # 0: local layers have head_dim; else their own head size
    n_kv_heads_local: int = 0  # 0: local layers have n_kv_heads; else their own KV head count
    shared_kv_layers: int = 0  # the last N layers reuse an earlier layer's K/V (kv_source)
    d_ff_shared_kv: int = 0  # 0: d_ff; else the FFN width of the shared-KV layers
    v_norm: bool = False  # V heads through an unweighted RMSNorm
    per_layer_dim: int = 0  # P: per-layer embeddings; 0: none
    layer_out_scale: bool = False  # each layer's output times its out_scale
    logit_softcap: float = 0.0  # c > 0: logits = c tanh(logits / c)
    moe_router_norm: bool = False  # the router reads rms(z) * moe.router_norm, not the experts' input
    expert_scale: bool = False  # expert e's output times moe.expert_scale[e]
    moe_out_norms: bool = False  # f and the experts' sum each normed, their sum through ffn_post_norm
    # Multi-token prediction: head j (0..mtp_heads-1) maps the final normed hidden state h_t to a
    # prediction of token t+2+j through the shared lm_head (cflow.model.MtpHead); the engine uses
    # them as a self-speculative proposer (cflow.runtime.speculative.MtpProposer). 0: none.
    mtp_heads: int = 0
    # Qwen3.5 (see the module docstring): the layer pattern and Gated DeltaNet sizes, partial RoPE,
    # the attention output gate. 0 / False: off.
    full_attn_interval: int = 0
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    ssm_head_dim: int = 0
    ssm_conv_kernel: int = 0
    rope_dims: int = 0
    attn_out_gate: bool = False
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        self._check_types()  # first: the derivations below do arithmetic on the fields
        # Derived fields are resolved here so every consumer sees concrete numbers.
        if self.head_dim == 0 and self.n_heads > 0 and self.d_model % self.n_heads == 0:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.n_unique_layers == 0:
            object.__setattr__(self, "n_unique_layers", self.n_layers)
        self.validate()

    # ---- validation -------------------------------------------------------------------------
    def _check_types(self) -> None:
        # JSON and hand-written dicts can carry any type; catch that before any comparison does.
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", int):
                ok, what = isinstance(v, int) and not isinstance(v, bool), "an int"
            elif f.type in ("float", float):
                ok, what = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), \
                    "a finite number"
                if ok:
                    object.__setattr__(self, f.name, float(v))
            elif f.type in ("bool", bool):
                ok, what = isinstance(v, bool), "true or false"
            elif f.type in ("tuple", tuple):  # of finite numbers (JSON gives a list)
                ok = isinstance(v, (list, tuple)) and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)
                what = "a list of finite numbers"
                if ok:
                    object.__setattr__(self, f.name, tuple(float(x) for x in v))
            else:
                ok, what = isinstance(v, str), "a string"
            if not ok:
                raise ConfigError(f"{f.name} must be {what}, got {v!r} (config {self.name!r})")

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{msg} (config {self.name!r})")

        self._check_types()
        need(self.vocab_size > 0, f"vocab_size must be positive, got {self.vocab_size}")
        need(self.d_model > 0, f"d_model must be positive, got {self.d_model}")
        need(self.n_layers > 0, f"n_layers must be positive, got {self.n_layers}")
        need(self.n_heads > 0 and self.n_kv_heads > 0, "n_heads and n_kv_heads must be positive")
        need(self.n_heads % self.n_kv_heads == 0,
             f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        need(self.head_dim > 0, f"head_dim must be positive (or d_model divisible by n_heads), got {self.head_dim}")
        need(self.head_dim % 2 == 0, f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        need(self.d_ff >= 0, f"d_ff must be >= 0, got {self.d_ff}")
        need(self.n_experts >= 0, f"n_experts must be >= 0, got {self.n_experts}")
        if self.n_experts > 0:
            need(1 <= self.top_k <= self.n_experts,
                 f"top_k must be in 1..n_experts ({self.n_experts}), got {self.top_k}")
            need(self.d_expert > 0, f"d_expert must be positive when n_experts > 0, got {self.d_expert}")
            need(self.d_shared_expert >= 0, f"d_shared_expert must be >= 0 (0: none), got {self.d_shared_expert}")
        else:
            need(self.d_shared_expert == 0, "d_shared_expert needs experts (n_experts > 0)")
            need(self.top_k == 0, f"top_k must be 0 without experts, got {self.top_k}")
            need(self.delta_expert == 0, "delta_expert needs experts (n_experts > 0)")
        need(self.d_ff > 0 or self.n_experts > 0, "a layer needs a dense FFN (d_ff > 0) or experts (n_experts > 0)")
        need(self.delta_dense >= 0, f"delta_dense must be >= 0, got {self.delta_dense}")
        need(self.delta_expert >= 0, f"delta_expert must be >= 0, got {self.delta_expert}")
        if self.delta_dense > 0:
            need(self.d_ff > 0, "delta_dense needs a dense FFN (d_ff > 0)")
        need(self.moe_input in MOE_INPUTS, f"moe_input must be one of {MOE_INPUTS}, got {self.moe_input!r}")
        need(1 <= self.n_unique_layers <= self.n_layers,
             f"n_unique_layers must be in 1..n_layers ({self.n_layers}), got {self.n_unique_layers}")
        need(self.rope_theta > 0, f"rope_theta must be positive, got {self.rope_theta}")
        need(not self.rope_freq_factors or (len(self.rope_freq_factors) == self.rope_dim // 2
                                            and all(x > 0 for x in self.rope_freq_factors)),
             f"rope_freq_factors must be empty or rope_dim/2 = {self.rope_dim // 2} positive numbers, "
             f"got {len(self.rope_freq_factors)}")
        need(self.rope_mscale > 0, f"rope_mscale must be positive, got {self.rope_mscale}")
        need(self.norm_eps > 0, f"norm_eps must be positive, got {self.norm_eps}")
        need(self.max_seq_len > 0, f"max_seq_len must be positive, got {self.max_seq_len}")
        need(self.qk_norm or not self.qk_norm_full, "qk_norm_full needs qk_norm")
        need(self.sliding_window >= 0, f"sliding_window must be >= 0 (0: none), got {self.sliding_window}")
        need(self.sliding_window_pattern >= 0,
             f"sliding_window_pattern must be >= 0 (0: every layer windowed), got {self.sliding_window_pattern}")
        need(self.sliding_window > 0 or (self.sliding_window_pattern == 0 and self.rope_theta_local == 0),
             "sliding_window_pattern and rope_theta_local describe windowed layers: they need sliding_window > 0")
        need(self.rope_theta_local >= 0, f"rope_theta_local must be >= 0 (0: as global layers), got "
             f"{self.rope_theta_local}")
        need(self.attn_scale >= 0, f"attn_scale must be >= 0 (0: 1/sqrt(head_dim)), got {self.attn_scale}")
        need(self.embed_scale > 0, f"embed_scale must be positive, got {self.embed_scale}")
        need(self.attn_temp_scale >= 0 and self.attn_temp_floor >= 0 and (self.attn_temp_scale == 0) == (
             self.attn_temp_floor == 0), "attn_temp_scale and attn_temp_floor are >= 0 and set together "
             f"(got {self.attn_temp_scale}, {self.attn_temp_floor})")
        need(self.ffn_act in FFN_ACTS, f"ffn_act must be one of {FFN_ACTS}, got {self.ffn_act!r}")
        need(self.n_experts == 0 or self.moe_out_norms or (self.ffn_act == "silu" and not self.post_norms),
             "ffn_act gelu_tanh and post_norms are for dense models (n_experts = 0) or Gemma 4's (moe_out_norms)")
        self._validate_deepseek(need)
        self._validate_gemma4(need)
        need(self.expert_act in EXPERT_ACTS, f"expert_act must be one of {EXPERT_ACTS}, got {self.expert_act!r}")
        need(self.n_experts > 0 or (not self.moe_bias and self.moe_gating == "softmax" and self.expert_act == "silu"),
             "moe_bias, moe_gating and expert_act describe experts: they need n_experts > 0")
        need(not (self.moe_bias and self.moe_router_bias),
             "moe_bias (gpt-oss) and moe_router_bias (DeepSeek) are two uses of one router bias: one at most")
        self._validate_qwen35(need)
        need(0 <= self.mtp_heads <= MAX_MTP_HEADS,
             f"mtp_heads must be in 0..{MAX_MTP_HEADS} (0: no multi-token prediction heads), got {self.mtp_heads}")

    def _validate_deepseek(self, need) -> None:
        """The DeepSeek-V2/V3 options (multi-head latent attention, leading dense layers, routing)."""
        if self.kv_lora_rank:
            need(self.kv_lora_rank > 0 and self.q_lora_rank >= 0, "kv_lora_rank and q_lora_rank must be >= 0")
            need(self.n_kv_heads == 1, f"latent attention (kv_lora_rank > 0) has one KV head, got {self.n_kv_heads}")
            need(0 < self.qk_rope_dim < self.head_dim and self.qk_rope_dim % 2 == 0,
                 f"qk_rope_dim must be even and in 1..head_dim-1 ({self.head_dim}), got {self.qk_rope_dim}")
            need(self.v_head_dim > 0, f"v_head_dim must be positive with latent attention, got {self.v_head_dim}")
            need(not (self.qkv_bias or self.qk_norm or self.sliding_window or self.post_norms or self.attn_temp_scale),
                 "latent attention does not go with qkv_bias, qk_norm, sliding windows, post_norms or a temperature")
        else:
            need(self.q_lora_rank == 0 and self.qk_rope_dim == 0 and self.v_head_dim == 0,
                 "q_lora_rank, qk_rope_dim and v_head_dim belong to latent attention (kv_lora_rank > 0)")
        need(self.moe_gating in MOE_GATINGS, f"moe_gating must be one of {MOE_GATINGS}, got {self.moe_gating!r}")
        need(self.moe_weights_scale > 0, f"moe_weights_scale must be positive, got {self.moe_weights_scale}")
        if self.moe_groups > 1:
            need(self.n_experts % self.moe_groups == 0 and 1 <= self.moe_groups_used <= self.moe_groups,
                 f"moe_groups ({self.moe_groups}) must divide n_experts ({self.n_experts}) and moe_groups_used "
                 f"({self.moe_groups_used}) be in 1..moe_groups")
        else:
            need(self.moe_groups_used <= 1, "moe_groups_used needs moe_groups > 1")
        if self.n_dense_lead:
            need(0 < self.n_dense_lead < self.n_layers and self.has_dense and self.has_moe,
                 f"n_dense_lead ({self.n_dense_lead}) must be in 1..n_layers-1 with both a dense FFN and experts")
            need(self.delta_dense == 0 and self.delta_expert == 0 and self.moe_input == "post_attn"
                 and self.n_unique_layers == self.n_layers,
                 "n_dense_lead runs undelayed layers (delta_dense = delta_expert = 0, moe_input post_attn) "
                 "with weights of their own (n_unique_layers = n_layers)")

    def _validate_gemma4(self, need) -> None:
        """The Gemma 4 options: per-layer geometry needs one weight set per layer and a dense model."""
        g4 = (self.head_dim_local or self.n_kv_heads_local or self.shared_kv_layers or self.d_ff_shared_kv
              or self.per_layer_dim)
        need(min(self.head_dim_local, self.n_kv_heads_local, self.shared_kv_layers, self.d_ff_shared_kv,
                 self.per_layer_dim) >= 0 and self.logit_softcap >= 0,
             "head_dim_local, n_kv_heads_local, shared_kv_layers, d_ff_shared_kv, per_layer_dim and logit_softcap "
             "must be >= 0")
        if g4 or self.layer_out_scale or self.v_norm:
            need(self.n_unique_layers == self.n_layers and not self.mla and self.delta_dense == 0
                 and self.history_depth == 1,
                 "head_dim_local, n_kv_heads_local, shared_kv_layers, d_ff_shared_kv, per_layer_dim, v_norm and "
                 "layer_out_scale (Gemma 4) need a weight set per layer and no delays")
        if self.moe_router_norm or self.expert_scale or self.moe_out_norms:
            need(self.has_moe, "moe_router_norm, expert_scale and moe_out_norms (Gemma 4) need experts")
        if self.moe_out_norms:
            need(self.has_dense and self.post_norms and not self.n_dense_lead and self.moe_input == "post_attn",
                 "moe_out_norms joins a dense FFN beside the experts in every layer (post_norms, moe_input "
                 "post_attn)")
        if self.head_dim_local:
            need(self.head_dim_local % 2 == 0 and self.sliding_window_pattern > 0,
                 f"head_dim_local ({self.head_dim_local}) must be even and needs local and global layers "
                 "(sliding_window_pattern > 0)")
        if self.n_kv_heads_local:
            need(self.n_heads % self.n_kv_heads_local == 0 and self.sliding_window_pattern > 0,
                 f"n_kv_heads_local ({self.n_kv_heads_local}) must divide n_heads ({self.n_heads}) and needs local "
                 "and global layers (sliding_window_pattern > 0)")
        if self.d_ff_shared_kv:
            need(self.shared_kv_layers > 0, "d_ff_shared_kv needs shared_kv_layers > 0")
        if self.shared_kv_layers:
            need(self.shared_kv_layers < self.n_layers,
                 f"shared_kv_layers ({self.shared_kv_layers}) must leave a layer with K/V of its own")
            for layer in range(self.n_layers - self.shared_kv_layers, self.n_layers):
                src = self.kv_source(layer)
                need(0 <= src and self.is_local(src) == self.is_local(layer),
                     f"shared-KV layer {layer} would read layer {src}'s cache, which is not of its kind "
                     "(local / global)")

    def layer_has_kv(self, layer: int) -> bool:
        """Whether layer `layer` computes K/V of its own (the shared-KV layers read another's)."""
        return layer < self.n_layers - self.shared_kv_layers

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V cache `layer` attends over: itself, or for a shared-KV layer the last
        KV-owning layer of its kind, counted as llama.cpp does (n_kv - 2 local, n_kv - 1 global)."""
        if self.layer_has_kv(layer):
            return layer
        return self.n_layers - self.shared_kv_layers - (2 if self.is_local(layer) else 1)

    def layer_head_dim(self, layer: int) -> int:
        return self.head_dim_local if self.head_dim_local and self.is_local(layer) else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        """The KV head count of layer `layer` (of the cache it reads: a shared-KV layer's source is of
        its kind, so of its count); its query heads group over them, n_heads / that many each."""
        return self.n_kv_heads_local if self.n_kv_heads_local and self.is_local(layer) else self.n_kv_heads

    def layer_q_dim(self, layer: int) -> int:
        return self.n_heads * self.layer_head_dim(layer)

    def layer_kv_dim(self, layer: int) -> int:
        """The K (and V) width layer `layer` projects: 0 on the shared-KV layers."""
        return self.layer_kv_heads(layer) * self.layer_head_dim(layer) if self.layer_has_kv(layer) else 0

    def layer_d_ff(self, layer: int) -> int:
        return self.d_ff_shared_kv if self.d_ff_shared_kv and not self.layer_has_kv(layer) else self.d_ff
    def _validate_qwen35(self, need) -> None:
        """The Qwen3.5 options (Gated DeltaNet layers, partial RoPE, the output gate)."""
        need(self.rope_dims == 0 or (0 < self.rope_dims <= self.head_dim and self.rope_dims % 2 == 0
                                     and not self.mla),
             f"rope_dims must be 0 (whole heads) or even and in 2..head_dim ({self.head_dim}), without latent "
             f"attention, got {self.rope_dims}")
        sizes = (self.ssm_k_heads, self.ssm_v_heads, self.ssm_head_dim, self.ssm_conv_kernel)
        if not self.full_attn_interval:
            need(not any(sizes), "ssm_k_heads, ssm_v_heads, ssm_head_dim and ssm_conv_kernel describe Gated "
                 "DeltaNet layers: they need full_attn_interval > 0")
            return
        need(self.full_attn_interval > 0 and all(x > 0 for x in sizes),
             f"full_attn_interval, ssm_k_heads, ssm_v_heads, ssm_head_dim and ssm_conv_kernel must be positive, got "
             f"{(self.full_attn_interval, *sizes)}")
        need(self.ssm_v_heads % self.ssm_k_heads == 0,
             f"ssm_v_heads ({self.ssm_v_heads}) must be a multiple of ssm_k_heads ({self.ssm_k_heads})")
        need(not self.mla and self.n_unique_layers == self.n_layers and self.delta_dense == 0
             and self.delta_expert == 0,
             "Gated DeltaNet layers need plain attention layers with weights of their own and no delays")

    def is_recurrent(self, layer: int) -> bool:
        """Whether layer `layer` is a Gated DeltaNet layer (Qwen3.5) rather than attention."""
        n = self.full_attn_interval
        return n > 0 and (layer + 1) % n != 0

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a recurrent state (it cannot be rewound like a KV cache)."""
        return self.full_attn_interval > 1  # then layer 0 is recurrent ((0 + 1) % N != 0)

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention (DeepSeek)."""
        return self.kv_lora_rank > 0

    def layer_has_dense(self, layer: int) -> bool:
        return self.has_dense and (not self.n_dense_lead or layer < self.n_dense_lead)

    def layer_has_moe(self, layer: int) -> bool:
        return self.has_moe and (not self.n_dense_lead or layer >= self.n_dense_lead)

    # ---- derived quantities -----------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def rope_dim(self) -> int:
        """How many dims of a head RoPE turns: all of it, or qk_rope_dim under latent attention."""
        return self.qk_rope_dim if self.kv_lora_rank else self.rope_dims or self.head_dim

    @property
    def has_dense(self) -> bool:
        return self.d_ff > 0

    @property
    def has_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def has_shared_expert(self) -> bool:
        return self.n_experts > 0 and self.d_shared_expert > 0

    @property
    def history_depth(self) -> int:
        """Residuals the decoder must keep: max(delta_dense, delta_expert) + 1."""
        return max(self.delta_dense, self.delta_expert) + 1

    def is_local(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window (a "local" layer)."""
        n = self.sliding_window_pattern
        return self.sliding_window > 0 and (n == 0 or layer % n < n - 1)

    def layer_window(self, layer: int) -> int:
        """The window of layer `layer`: sliding_window on local layers, 0 (the whole context) on others."""
        return self.sliding_window if self.is_local(layer) else 0

    def layer_rope(self, layer: int) -> tuple[float, tuple, float]:
        """(theta, frequency factors, mscale) layer `layer` rotates q and k with."""
        if self.rope_theta_local > 0 and self.is_local(layer):
            return self.rope_theta_local, (), 1.0
        return self.rope_theta, self.rope_freq_factors, self.rope_mscale

    def q_temperature(self, pos: int) -> float:
        """What the query at position `pos` is multiplied by (attn_temp_scale; 1 without it)."""
        if not self.attn_temp_scale:
            return 1.0
        return math.log(pos // self.attn_temp_floor + 1) * self.attn_temp_scale + 1.0

    @property
    def scores_scale(self) -> float:
        """What the attention scores q.k are multiplied by."""
        return self.attn_scale if self.attn_scale > 0 else 1.0 / math.sqrt(self.head_dim)

    def weight_layer(self, layer: int) -> int:
        """Index of the weight set layer `layer` uses (arch5 shares weights across layers)."""
        return layer % self.n_unique_layers

    # ---- (de)serialization ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON shapes them (a tuple as a list), so to_dict() == json.loads(to_json())."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; known keys: {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError("config JSON must be an object")
        return cls.from_dict(d)

    def replace(self, **overrides: Any) -> "ModelConfig":
        # Fields derived in __post_init__ are re-derived when what they came from changes.
        if "head_dim" not in overrides and ("d_model" in overrides or "n_heads" in overrides):
            if self.head_dim * self.n_heads == self.d_model:
                overrides["head_dim"] = 0
        if "n_unique_layers" not in overrides and "n_layers" in overrides:
            if self.n_unique_layers == self.n_layers:
                overrides["n_unique_layers"] = 0
        return dataclasses.replace(self, **overrides)

    def with_overrides(self, assignments: list[str]) -> "ModelConfig":
        """Apply `key=value` strings (the CLI's --set), each checked against the field's type."""
        return self.replace(**parse_overrides(assignments))

    @classmethod
    def from_name(cls, preset: str, **overrides: Any) -> "ModelConfig":
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        d = dict(PRESETS[preset])
        d.update(overrides)
        d.setdefault("name", preset)
        return cls(**d)


def parse_overrides(assignments: list[str]) -> dict[str, Any]:
    """Parse `key=value` strings into typed values; unknown keys and bad types raise ConfigError."""
    types = {f.name: f.type for f in fields(ModelConfig)}
    out: dict[str, Any] = {}
    for a in assignments:
        if "=" not in a:
            raise ConfigError(f"override {a!r} must look like key=value")
        key, raw = a.split("=", 1)
        key = key.strip()
        if key not in types:
            raise ConfigError(f"unknown config key {key!r}; known keys: {sorted(types)}")
        t = types[key]
        try:
            if t in ("int", int):
                out[key] = int(raw)
            elif t in ("float", float):
                out[key] = float(raw)
            elif t in ("tuple", tuple):
                out[key] = tuple(float(x) for x in raw.split(",") if x.strip())
            elif t in ("bool", bool):
                low = raw.strip().lower()
                if low not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(raw)
                out[key] = low in ("1", "true", "yes")
            else:
                out[key] = raw
        except ValueError:
            raise ConfigError(f"override {key}={raw!r}: expected a value of type {t}") from None
    return out


# ---- presets ---------------------------------------------------------------------------------
# An architecture (the delays and the MoE input) times a size. The bare names are the smallest size
# (about 3.8M parameters, 4 experts top-1); "-s" is one size up and sparse enough for expert
# streaming to matter (13.3M parameters, 5.4M of them active per token: 8 experts top-2), sized so
# one run of ~8M tokens takes about an hour on 2 cores. Override any field with --set.
_SMALL = dict(vocab_size=4096, d_model=128, n_layers=6, n_heads=4, n_kv_heads=2, max_seq_len=256)
_MOE = dict(d_ff=256, n_experts=4, top_k=1, d_expert=256)
_SIZE_S = dict(vocab_size=4096, d_model=192, n_layers=6, n_heads=6, n_kv_heads=2, max_seq_len=512,
               d_ff=384, n_experts=8, top_k=2, d_expert=384)

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "arch1": {"delta_dense": 0, "delta_expert": 0, "moe_input": "post_dense"},
    "arch3": {"delta_dense": 0, "delta_expert": 0, "moe_input": "post_attn"},
    "arch2": {"delta_dense": 1, "delta_expert": 0, "moe_input": "post_attn"},
    "arch4": {"delta_dense": 0, "delta_expert": 2, "moe_input": "post_attn"},
    "arch2_4_combined": {"delta_dense": 1, "delta_expert": 2, "moe_input": "post_attn"},
    "arch5": {"delta_dense": 1, "delta_expert": 2, "moe_input": "post_attn", "n_unique_layers": 2},
}

PRESETS: dict[str, dict[str, Any]] = {
    **{name: {**_SMALL, **_MOE, **arch} for name, arch in ARCHITECTURES.items()},
    **{f"{name}-s": {**_SIZE_S, **arch} for name, arch in ARCHITECTURES.items() if name != "arch5"},
    "llama": {**_SMALL, "d_ff": 384, "n_experts": 0, "top_k": 0, "d_expert": 0},
    # A dense draft for SmolLM2 (train it with `--tokenizer SmolLM2.gguf`, whose 49,152-token
    # vocabulary sets vocab_size): the tied embedding, 9.4M of its 11M parameters, is also the output
    # layer, so d_model decides what a draft step costs; four narrow layers add 1.6M.
    "draft-smollm2": {"vocab_size": 49152, "d_model": 192, "n_layers": 4, "n_heads": 6, "n_kv_heads": 2,
                      "d_ff": 512, "n_experts": 0, "top_k": 0, "d_expert": 0, "max_seq_len": 2048},
}
