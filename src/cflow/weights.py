"""The weights of a model: one table of every tensor a config implies, and the bytes a token reads.

This is the single statement of the model's tensors (docs/DESIGN.md). The converters
build tensors by these names, the file format validates shapes against them and orders them, the
engine binds them (checked by name against the C core's own table), and the DAG and the benchmark
count bytes from them:

    name                               shape              node      stored
    tok_emb                            [vocab, d]         embed     quantized (one row per token)
    ple_emb                            [vocab, L P]       embed     quantized (per_layer_dim P > 0: a row
    ple_proj                           [L P, d]           embed     quantized  per token, the projection
    ple_norm                           [P]                embed     f32        and norm of every token)
    layers.{i}.attn_norm               [d]                attn      f32
    layers.{i}.attn.wqkv               [q + 2 kv, d]      attn      quantized (wq, wk, wv fused)
      or layers.{i}.attn.wq / wk / wv  [q, d] [kv, d] [kv, d]       the same rows as three tensors,
                                                                    when their dtypes differ
    layers.{i}.attn.qkv_bias           [q + 2 kv]         attn      f32      (qkv_bias: bq, bk, bv)
    layers.{i}.attn.q_norm             [hd] or [q]        attn      f32      (qk_norm; [q], [kv] with
    layers.{i}.attn.k_norm             [hd] or [kv]       attn      f32       qk_norm_full)
    layers.{i}.attn.wo                 [d, q]             attn      quantized
    layers.{i}.attn.wo_bias            [d]                attn      f32      (attn_out_bias)
    layers.{i}.attn.sinks              [n_heads]          attn      f32      (attn_sinks)
    layers.{i}.attn.w_gate             [q, d]             attn      quantized (attn_out_gate: Qwen3.5)
    layers.{i}.attn_post_norm          [d]                attn      f32      (post_norms: Gemma)
    layers.{i}.ffn_norm                [d]                dense     f32      (d_ff > 0)
    layers.{i}.ffn.w_gate_up           [2 d_ff, d]        dense     quantized (gate, up interleaved)
    layers.{i}.ffn.w_down              [d, d_ff]          dense     quantized
    layers.{i}.ffn_post_norm           [d]                dense     f32      (post_norms, d_ff > 0)
    layers.{i}.moe_norm                [d]                router    f32      (n_experts > 0)
    layers.{i}.moe.router              [E, d]             router    f32
    layers.{i}.moe.router_bias         [E]                router    f32      (moe_bias)
    layers.{i}.moe.shared_gate         [d]                router    f32      (d_shared_expert > 0)
    layers.{i}.moe.shared.w_gate_up    [2 d_sh, d]        experts   quantized (the shared expert:
    layers.{i}.moe.shared.w_down       [d, d_sh]          experts   quantized  every token, in RAM)
    layers.{i}.moe.experts.{e}.w_gate_up [2 d_exp, d]     experts   quantized
    layers.{i}.moe.experts.{e}.w_down  [d, d_exp]         experts   quantized
    layers.{i}.moe.experts.{e}.b_gate_up [2 d_exp]        experts   f32      (moe_bias: gate, up biases
    layers.{i}.moe.experts.{e}.b_down  [d]                experts   f32       interleaved as w_gate_up's rows)
    layers.{i}.moe.router_norm         [d]                router    f32      (Gemma 4's MoE: moe_router_norm;
    layers.{i}.moe.expert_scale        [E]                router    f32       expert_scale;
    layers.{i}.ffn_post_norm_1         [d]                dense     f32       moe_out_norms: the
    layers.{i}.moe_post_norm           [d]                dense     f32       branches' norms)
    layers.{i}.ple.w_gate              [P, d]             dense     quantized (per_layer_dim P > 0:
    layers.{i}.ple.w_proj              [d, P]             dense     quantized  Gemma 4's per-layer
    layers.{i}.ple_post_norm           [d]                dense     f32        embeddings' block)
    layers.{i}.out_scale               [1]                dense     f32      (layer_out_scale)
    norm                               [d]                lm_head   f32
    lm_head                            [vocab, d]         lm_head   quantized (absent when tied)
    mtp.{j}.w_up                       [d, d]             mtp       f32      (mtp_heads > 0: head j,
    mtp.{j}.w_down                     [d, d]             mtp       f32       j = 0..mtp_heads-1)
    mtp.{j}.norm                       [d]                mtp       f32

A Gated DeltaNet layer (Qwen3.5: cfg.is_recurrent(i)) has, after attn_norm, SSM_SLOTS in place of
the attention tensors (C = conv_dim = (2 Hk + Hv) dh, V = Hv dh; node attn):
    layers.{i}.ssm.w_qkv  [C, d] quantized    layers.{i}.ssm.w_z   [V, d] quantized (the output gate)
    layers.{i}.ssm.w_alpha [Hv, d] quantized  layers.{i}.ssm.w_beta [Hv, d] quantized
    layers.{i}.ssm.conv   [C, K] f32          layers.{i}.ssm.dt_bias [Hv] f32   layers.{i}.ssm.a [Hv] f32
    layers.{i}.ssm.norm   [dh] f32            layers.{i}.ssm.w_out [d, V] quantized

The shared expert belongs to the experts node (it runs beside the routed ones, scaled per row by
sigmoid(shared_gate . norm(z)), which the router computes) but is not one of the E experts: it
has no expert index, is not in the expert table, and stays in RAM when the routed experts live on
disk. A token reads it whole, like a dense FFN.

Gemma 4's layers differ in shape (config head_dim_local, shared_kv_layers, d_ff_shared_kv): set i
(= layer i there) has q = n_heads * layer_head_dim(i), kv = layer_kv_dim(i) (0 on a shared-KV
layer: attn.wqkv holds only q rows and there is no k_norm) and d_ff = layer_d_ff(i).

`i` is a weight set (0..n_unique_layers-1); layer l reads set l % n_unique_layers. Ordered as
`.cflow` stores them: embeddings, each set, then the final norm and lm_head, then the
multi-token prediction heads. Those are not part of the decode step (no DAG node reads them, the
C core does not bind them): the speculative proposer runs them in numpy from the hidden state the
core hands back (cflow.runtime.mtp), so they stay f32 whatever the file's quant (2 d^2 + d floats a
head).

An expert's biases (moe_bias) are tensors of the expert, stored right after its matrices, so they
are inside the expert's span of the file and travel with it when experts are read from disk.

A tiled matrix has one dtype. GGUF K-quant files often store attn_v in another type than attn_q
and attn_k (Q4_K_M: Q6_K or Q8_0 beside Q4_K / Q5_0); cflow keeps every block as it is, so such a
weight set stores its projection as the three parts (`split_qkv`), and the engine runs them as
three mat-vecs into the same q|k|v rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Iterator

from cflow.config import ModelConfig

NODE_KINDS = ("embed", "attn", "dense", "router", "experts", "lm_head")
# The tensor names, for the file format, which needs them without the compiled core. The C core
# names the same tensors (_native.GLOBAL_TENSORS, LAYER_SLOTS, EXPERT_SLOTS) in the order of its
# descriptor rows, an ABI order of its own (new slots go last) that Python never relies on: the
# descriptor is built from the core's names and bound by name (cflow.runtime.abi). The names are
# one set on both sides; tests/test_native_contract.py holds them equal.
GLOBAL_NAMES = ("tok_emb", "norm", "lm_head", "ple_emb", "ple_proj", "ple_norm")
# A weight set's slots in `.cflow` order (layer_weights yields them so), plus QKV_PARTS in
# attn.wqkv's place when the projection is stored by parts.
LAYER_SLOTS = ("attn_norm", "attn.wqkv", "attn.qkv_bias", "attn.q_norm", "attn.k_norm", "attn.w_gate", "attn.wo",
               "attn.wo_bias",
               "attn.sinks", "attn_post_norm", "ffn_norm", "ffn.w_gate_up", "ffn.w_down", "ffn_post_norm", "moe_norm",
               "moe.router", "moe.router_bias", "moe.shared_gate", "moe.shared.w_gate_up", "moe.shared.w_down",
               "moe.router_norm", "moe.expert_scale", "ffn_post_norm_1", "moe_post_norm",
               "ple.w_gate", "ple.w_proj", "ple_post_norm", "out_scale")
# Multi-head latent attention's tensors (config kv_lora_rank > 0), in attn.wqkv's place: the query
# (attn.wq, or attn.wq_a -> attn.q_a_norm -> attn.wq_b), the latent and k_pe projection and the
# latent's norm, and per head the latent's up-projections for keys (attn.wk_b [H kv_lora, qk_nope])
# and values (attn.wv_b [H v_head, kv_lora]), always stored Q8_0 (their inputs, qk_nope or
# kv_lora_rank wide, need not fill a K-quant's 256-block).
MLA_SLOTS = ("attn.wq_a", "attn.q_a_norm", "attn.wq_b", "attn.wkv_a", "attn.kv_a_norm", "attn.wk_b", "attn.wv_b")
EXPERT_SLOTS = ("w_gate_up", "w_down", "b_gate_up", "b_down")
# A Gated DeltaNet layer's tensors (config full_attn_interval > 0, cfg.is_recurrent), in place of
# the attention's, and the gated attention's output gate (attn_out_gate).
SSM_SLOTS = ("ssm.w_qkv", "ssm.w_z", "ssm.w_alpha", "ssm.w_beta", "ssm.conv", "ssm.dt_bias", "ssm.a", "ssm.norm",
             "ssm.w_out")
ATTN_GATE_SLOT = "attn.w_gate"
QKV_PARTS = ("attn.wq", "attn.wk", "attn.wv")  # attn.wqkv stored by parts (see above)


@dataclass(frozen=True)
class Weight:
    """One tensor of the table."""

    name: str
    shape: tuple[int, ...]
    node: str  # the decode-step DAG node kind that reads it (NODE_KINDS), or "mtp" (read by no node)
    plain: bool  # stored f32 (norms, router); otherwise quantized at the model's quant
    set: int | None = None  # weight set, for tensors inside the layers
    expert: int | None = None

    @property
    def fused(self) -> str | None:
        """"qkv" (wq, wk, wv rows) or "gate_up" (gate and up interleaved), else None."""
        return "qkv" if self.name.endswith("attn.wqkv") else "gate_up" if self.name.endswith("w_gate_up") else None

    @property
    def slot(self) -> str:
        """The name inside its weight set ("attn.wqkv", "moe.experts.3.w_down"), or the whole name."""
        return self.name.split(".", 2)[2] if self.set is not None else self.name


def layer_name(i: int, slot: str) -> str:
    return f"layers.{i}.{slot}"


def expert_name(i: int, e: int, slot: str) -> str:
    return f"layers.{i}.moe.experts.{e}.{slot}"


def split_qkv_sets(names: Iterable[str]) -> frozenset[int]:
    """The weight sets whose names include the by-parts projection (`layers.{i}.attn.wq`)."""
    out = set()
    for n in names:
        head, _, slot = n.rpartition(".attn.")
        if slot == "wq" and head.startswith("layers.") and head[7:].isdigit():
            out.add(int(head[7:]))
    return frozenset(out)


def layer_weights(cfg: ModelConfig, i: int, experts: Iterable[int] | None = None,
                  split_qkv: bool = False) -> list[Weight]:
    """Tensors of weight set i (and of the given experts, default all), in `.cflow` order;
    split_qkv: the projection as its three parts instead of attn.wqkv."""
    d, p = cfg.d_model, f"layers.{i}."
    # the set's geometry: the model's, or Gemma 4's per-layer head size / shared K/V (set i = layer i)
    q_dim, kv_dim = cfg.layer_q_dim(i), cfg.layer_kv_dim(i)
    out = [Weight(p + "attn_norm", (d,), "attn", True, i)]
    if cfg.is_recurrent(i):
        out += _ssm_weights(cfg, i)
    elif cfg.mla:
        out += _mla_weights(cfg, i)
    elif split_qkv:
        out += [Weight(p + part, (rows, d), "attn", False, i)
                for part, rows in zip(QKV_PARTS, (q_dim, kv_dim, kv_dim))]
    else:
        out.append(Weight(p + "attn.wqkv", (q_dim + 2 * kv_dim, d), "attn", False, i))
    if not cfg.is_recurrent(i):
        out += _attention_tail(cfg, i)
    if cfg.layer_has_dense(i):
        d_ff = cfg.layer_d_ff(i)
        out += [Weight(p + "ffn_norm", (d,), "dense", True, i),
                Weight(p + "ffn.w_gate_up", (2 * d_ff, d), "dense", False, i),
                Weight(p + "ffn.w_down", (d, d_ff), "dense", False, i)]
        if cfg.post_norms:
            out.append(Weight(p + "ffn_post_norm", (d,), "dense", True, i))
    expert_weights = []
    if cfg.layer_has_moe(i):
        out += [Weight(p + "moe_norm", (d,), "router", True, i),
                Weight(p + "moe.router", (cfg.n_experts, d), "router", True, i)]
        if cfg.moe_router_bias or cfg.moe_bias:
            out.append(Weight(p + "moe.router_bias", (cfg.n_experts,), "router", True, i))
        if cfg.has_shared_expert:
            ds = cfg.d_shared_expert
            if cfg.shared_expert_gate:
                out.append(Weight(p + "moe.shared_gate", (d,), "router", True, i))
            out += [Weight(p + "moe.shared.w_gate_up", (2 * ds, d), "experts", False, i),
                    Weight(p + "moe.shared.w_down", (d, ds), "experts", False, i)]
        if cfg.moe_router_norm:
            out.append(Weight(p + "moe.router_norm", (d,), "router", True, i))
        if cfg.expert_scale:
            out.append(Weight(p + "moe.expert_scale", (cfg.n_experts,), "router", True, i))
        if cfg.moe_out_norms:
            out += [Weight(p + "ffn_post_norm_1", (d,), "dense", True, i), Weight(p + "moe_post_norm", (d,), "dense", True, i)]
        for e in range(cfg.n_experts) if experts is None else experts:
            expert_weights += [Weight(expert_name(i, e, "w_gate_up"), (2 * cfg.d_expert, d), "experts", False, i, e),
                               Weight(expert_name(i, e, "w_down"), (d, cfg.d_expert), "experts", False, i, e)]
            if cfg.moe_bias:
                expert_weights += [Weight(expert_name(i, e, "b_gate_up"), (2 * cfg.d_expert,), "experts", True, i, e),
                                   Weight(expert_name(i, e, "b_down"), (d,), "experts", True, i, e)]
    if cfg.per_layer_dim:
        P = cfg.per_layer_dim
        out += [Weight(p + "ple.w_gate", (P, d), "dense", False, i), Weight(p + "ple.w_proj", (d, P), "dense", False, i),
                Weight(p + "ple_post_norm", (d,), "dense", True, i)]
    if cfg.layer_out_scale:
        out.append(Weight(p + "out_scale", (1,), "dense", True, i))
    return out + expert_weights


def _attention_tail(cfg: ModelConfig, i: int) -> list[Weight]:
    """An attention layer's tensors after its projection: bias, norms, the output gate, wo and its
    options."""
    d, p, out = cfg.d_model, f"layers.{i}.", []
    # the set's geometry: the model's, or Gemma 4's per-layer head size / shared K/V (set i = layer i)
    hd, q_dim, kv_dim = cfg.layer_head_dim(i), cfg.layer_q_dim(i), cfg.layer_kv_dim(i)
    if cfg.qkv_bias:
        out.append(Weight(p + "attn.qkv_bias", (q_dim + 2 * kv_dim,), "attn", True, i))
    if cfg.qk_norm:
        full = cfg.qk_norm_full
        out.append(Weight(p + "attn.q_norm", (q_dim if full else hd,), "attn", True, i))
        if kv_dim:  # Gemma 4's shared-KV layers have no K of their own
            out.append(Weight(p + "attn.k_norm", (kv_dim if full else hd,), "attn", True, i))
    if cfg.attn_out_gate:
        out.append(Weight(p + ATTN_GATE_SLOT, (q_dim, d), "attn", False, i))
    out.append(Weight(p + "attn.wo", (d, cfg.n_heads * cfg.v_head_dim if cfg.mla else q_dim), "attn", False, i))
    if cfg.attn_out_bias:
        out.append(Weight(p + "attn.wo_bias", (d,), "attn", True, i))
    if cfg.attn_sinks:
        out.append(Weight(p + "attn.sinks", (cfg.n_heads,), "attn", True, i))
    if cfg.post_norms:
        out.append(Weight(p + "attn_post_norm", (d,), "attn", True, i))
    return out


def _ssm_weights(cfg: ModelConfig, i: int) -> list[Weight]:
    """A Gated DeltaNet layer's tensors (SSM_SLOTS), after attn_norm."""
    d, p, hv, dh = cfg.d_model, f"layers.{i}.", cfg.ssm_v_heads, cfg.ssm_head_dim
    conv, value = (2 * cfg.ssm_k_heads + hv) * dh, hv * dh
    shapes = {"ssm.w_qkv": (conv, d), "ssm.w_z": (value, d), "ssm.w_alpha": (hv, d), "ssm.w_beta": (hv, d),
              "ssm.conv": (conv, cfg.ssm_conv_kernel), "ssm.dt_bias": (hv,), "ssm.a": (hv,), "ssm.norm": (dh,),
              "ssm.w_out": (d, value)}
    plain = {"ssm.conv", "ssm.dt_bias", "ssm.a", "ssm.norm"}
    return [Weight(p + slot, shapes[slot], "attn", slot in plain, i) for slot in SSM_SLOTS]


def _mla_weights(cfg: ModelConfig, i: int) -> list[Weight]:
    """Latent attention's projections of weight set i (MLA_SLOTS), attn.wo aside."""
    d, p, H, ql, kvl = cfg.d_model, f"layers.{i}.", cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    if ql:
        out = [Weight(p + "attn.wq_a", (ql, d), "attn", False, i), Weight(p + "attn.q_a_norm", (ql,), "attn", True, i),
               Weight(p + "attn.wq_b", (cfg.q_dim, ql), "attn", False, i)]
    else:
        out = [Weight(p + "attn.wq", (cfg.q_dim, d), "attn", False, i)]
    return out + [Weight(p + "attn.wkv_a", (kvl + cfg.qk_rope_dim, d), "attn", False, i),
                  Weight(p + "attn.kv_a_norm", (kvl,), "attn", True, i),
                  Weight(p + "attn.wk_b", (H * kvl, cfg.head_dim - cfg.qk_rope_dim), "attn", False, i),
                  Weight(p + "attn.wv_b", (H * cfg.v_head_dim, kvl), "attn", False, i)]


def global_weights(cfg: ModelConfig) -> tuple[list[Weight], list[Weight]]:
    """(the tensors before the layers, the tensors after them)."""
    head = [Weight("tok_emb", (cfg.vocab_size, cfg.d_model), "embed", False)]
    if cfg.per_layer_dim:
        lp = cfg.n_layers * cfg.per_layer_dim
        head += [Weight("ple_emb", (cfg.vocab_size, lp), "embed", False),
                 Weight("ple_proj", (lp, cfg.d_model), "embed", False),
                 Weight("ple_norm", (cfg.per_layer_dim,), "embed", True)]
    tail = [Weight("norm", (cfg.d_model,), "lm_head", True)]
    if not cfg.tie_embeddings:
        tail.append(Weight("lm_head", (cfg.vocab_size, cfg.d_model), "lm_head", False))
    return head, tail


MTP_SLOTS = ("w_up", "w_down", "norm")  # a multi-token prediction head's tensors, `mtp.{j}.{slot}`


def mtp_name(j: int, slot: str) -> str:
    return f"mtp.{j}.{slot}"


def mtp_weights(cfg: ModelConfig) -> list[Weight]:
    """The multi-token prediction heads' tensors (none when cfg.mtp_heads is 0): head j computes
    norm(h + w_down silu(w_up h)) from the final normed hidden state h (cflow.model.MtpHead)."""
    d = cfg.d_model
    shapes = {"w_up": (d, d), "w_down": (d, d), "norm": (d,)}
    return [Weight(mtp_name(j, s), shapes[s], "mtp", True) for j in range(cfg.mtp_heads) for s in MTP_SLOTS]


def model_weights(cfg: ModelConfig, split_qkv: Collection[int] = ()) -> Iterator[Weight]:
    """Every tensor a model of this config stores, in `.cflow` (layer-major) order; the weight
    sets in `split_qkv` store their projection by parts."""
    head, tail = global_weights(cfg)
    yield from head
    for i in range(cfg.n_unique_layers):
        yield from layer_weights(cfg, i, split_qkv=i in split_qkv)
    yield from tail
    yield from mtp_weights(cfg)


def count(cfg: ModelConfig, n_split_qkv: int = 0) -> int:
    """How many tensors `model_weights(cfg)` yields (with `n_split_qkv` sets stored by parts),
    computed without building it (a damaged header may claim billions of layers)."""
    # attention: attn_norm, wo (+ bias, sinks), then wqkv (+ bias, norms) or latent attention's (MLA_SLOTS, wq or 3)
    attn = 2 + cfg.post_norms + cfg.attn_out_bias + cfg.attn_sinks + cfg.attn_out_gate \
        + (5 + 2 * bool(cfg.q_lora_rank) if cfg.mla else 1 + cfg.qkv_bias + 2 * cfg.qk_norm)
    # every full_attn_interval-th layer is attention, the others recurrent (arithmetic, not a loop)
    n_rec = cfg.n_unique_layers - cfg.n_unique_layers // cfg.full_attn_interval if cfg.full_attn_interval else 0
    ssm = 1 + len(SSM_SLOTS)  # attn_norm and the DeltaNet tensors
    dense = (3 + cfg.post_norms) * cfg.has_dense
    per_expert = 2 + 2 * cfg.moe_bias  # its matrices, and gpt-oss's biases
    moe = (2 + per_expert * cfg.n_experts + (cfg.moe_router_bias or cfg.moe_bias)
           + (2 + cfg.shared_expert_gate) * cfg.has_shared_expert
           + cfg.moe_router_norm + cfg.expert_scale + 2 * cfg.moe_out_norms) * cfg.has_moe
    sets, lead = cfg.n_unique_layers, cfg.n_dense_lead  # leading dense layers: dense or MoE, not both
    layers = (sets - n_rec) * attn + n_rec * ssm + (lead * dense + (sets - lead) * moe if lead else sets * (dense + moe))
    # Gemma 4: no k_norm on the shared-KV layers; the per-layer block; the output scale
    layers += sets * (3 * bool(cfg.per_layer_dim) + cfg.layer_out_scale) - cfg.qk_norm * cfg.shared_kv_layers
    layers += 3 * bool(cfg.per_layer_dim)  # ple_emb, ple_proj, ple_norm
    # (latent attention's plain query is named attn.wq, which split_qkv_sets counts; it splits nothing)
    return 2 + layers + (not cfg.tie_embeddings) + 2 * n_split_qkv * (not cfg.mla) + len(MTP_SLOTS) * cfg.mtp_heads


def node_weights(cfg: ModelConfig, kind: str, weight_set: int = 0, split_qkv: Collection[int] = ()) -> list[Weight]:
    """The tensors one node of `kind` reads (for layer nodes: of the given weight set). `embed`
    reads one row of tok_emb and `lm_head` reads tok_emb itself when embeddings are tied."""
    if kind == "embed":
        return global_weights(cfg)[0]
    if kind == "lm_head":  # tied: tok_emb itself (not the per-layer embeddings beside it)
        head, tail = global_weights(cfg)
        return tail + (head[:1] if cfg.tie_embeddings else [])
    return [w for w in layer_weights(cfg, weight_set, split_qkv=weight_set in split_qkv) if w.node == kind]


# ---- bytes per token -------------------------------------------------------------------------
def token_bytes(cfg: ModelConfig, size: Callable[[Weight], int], split_qkv: Collection[int] = ()) -> dict[str, float]:
    """Weight bytes one decode step reads, by node kind, with `size(w)` the stored bytes of a
    tensor: every layer streams its weight set once; embed reads one row of tok_emb; a MoE layer
    reads top_k experts (their average size, since experts may differ in dtype) and its shared
    expert whole. KV-cache reads
    are not weights and are not counted here (the engine's counters report them separately)."""
    out = dict.fromkeys(NODE_KINDS, 0.0)
    emb, *ple = global_weights(cfg)[0]
    out["embed"] = size(emb) / cfg.vocab_size
    if ple:  # Gemma 4: a row of ple_emb, and ple_proj and ple_norm whole
        out["embed"] += size(ple[0]) / cfg.vocab_size + size(ple[1]) + size(ple[2])
    out["lm_head"] = float(sum(size(w) for w in node_weights(cfg, "lm_head")))
    for layer in range(cfg.n_layers):
        ws = layer_weights(cfg, cfg.weight_layer(layer), split_qkv=cfg.weight_layer(layer) in split_qkv)
        for w in ws:
            if w.expert is None:  # the shared expert too: every token reads it
                out[w.node] += size(w)
        if cfg.layer_has_moe(layer):
            per = [0] * cfg.n_experts
            for w in ws:
                if w.expert is not None:
                    per[w.expert] += size(w)
            out["experts"] += cfg.top_k * sum(per) / cfg.n_experts
    return out
