"""Random-weight Qwen3.5 GGUFs (qwen35 dense, qwen35moe) for benchmarks (benchmarks/make_qwen35.py,
docs/results/qwen35.md), in llama.cpp's qwen35 layout (tests/test_qwen35.py's module docstring),
with cflow.bench.synthetic's random blocks, byte-level tokenizer and streaming writer.

QWEN35_9B and QWEN35_35B_A3B are the released models' text widths as this project knows them
(docs/results/qwen35.md says which could not be checked offline): Gated DeltaNet layers with 16
q/k heads and 32 v heads of 128 dims and a conv over 4 tokens, every 4th layer gated full
attention with 256-dim heads of which a quarter turn (partial RoPE, M-RoPE sections [11, 11,
10, 0]), vocabulary 248320. The benchmark takes fewer layers, experts and a smaller vocabulary.

Values: the matrices (projections, experts, attn_qkv / attn_gate / ssm_alpha / ssm_beta /
ssm_out) are random blocks of std ~0.5/sqrt(inputs); the DeltaNet's float parts are drawn so its
features act as in a trained model: conv taps of std 0.5, ssm_a = -exp(U(-1, 1)), dt biases of
std 0.5 (decays spread over (0, 1)); norms are 1; the router is random F32, the shared expert's
gate a random F32 vector.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from cflow.bench.synthetic import _write_tensors, add_tokenizer, random_rows, router_values, start_gguf, \
    tensor_rng
from cflow.quant import row_bytes

# What both members share: the DeltaNet and full-attention geometry, the layer pattern, the vocabulary.
_COMMON = dict(interval=4, ssm_k_heads=16, ssm_v_heads=32, ssm_head_dim=128, conv=4, head_dim=256,
               vocab=248320)
# Qwen3.5-9B (dense): 32 layers of width 4096, FFN 12288, 16 query heads over 4 KV heads.
QWEN35_9B = dict(layers=32, d_model=4096, d_ff=12288, heads=16, kv_heads=4, **_COMMON)
# Qwen3.5-35B-A3B (qwen35moe): 40 layers of width 2048, 16 query heads over 2 KV heads, 256 experts
# of width 512 with 8 used, one shared expert of width 512.
QWEN35_35B_A3B = dict(layers=40, d_model=2048, heads=16, kv_heads=2, experts=256, top_k=8, d_expert=512,
                      d_shared=512, **_COMMON)
ROTATED_FRACTION = 4  # partial_rotary_factor 0.25: head_dim / 4 dims of each head turn
ROPE_THETA = 1e7


def rope_sections(rot: int) -> list[int]:
    """M-RoPE sections (in pairs) over `rot` rotated dims as Qwen3.5's [11, 11, 10, 0] split 64:
    three nearly equal parts, the first ones larger (for text every section turns alike)."""
    pairs = rot // 2
    return [(pairs + 2) // 3, (pairs + 1) // 3, pairs // 3, 0]


def write_qwen35_gguf(path: str | os.PathLike, *, layers: int, d_model: int, heads: int, kv_heads: int,
                      head_dim: int, interval: int, ssm_k_heads: int, ssm_v_heads: int, ssm_head_dim: int,
                      conv: int, vocab: int, d_ff: int = 0, experts: int = 0, top_k: int = 0, d_expert: int = 0,
                      d_shared: int = 0, quant: str = "q4_0", seed: int = 0, ctx: int = 4096) -> Path:
    """A random-weight qwen35 GGUF, or qwen35moe when `experts` > 0 (then d_ff is unused): the
    tensors of tests/test_qwen35.py's layout with this module's values."""
    import gguf

    T = gguf.GGMLQuantizationType
    qtype = {"q4_0": T.Q4_0, "q4_1": T.Q4_1, "q8_0": T.Q8_0}[quant]
    moe = experts > 0
    key_dim, value_dim = ssm_k_heads * ssm_head_dim, ssm_v_heads * ssm_head_dim
    conv_dim = 2 * key_dim + value_dim
    tensors: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (vocab, d_model), "m")]
    for i in range(layers):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", (d_model,), "n"), (b + "post_attention_norm.weight", (d_model,), "n")]
        if (i + 1) % interval == 0:  # full attention: per head hd query rows then hd gate rows
            tensors += [(b + "attn_q.weight", (heads * 2 * head_dim, d_model), "m"),
                        (b + "attn_k.weight", (kv_heads * head_dim, d_model), "m"),
                        (b + "attn_v.weight", (kv_heads * head_dim, d_model), "m"),
                        (b + "attn_q_norm.weight", (head_dim,), "n"), (b + "attn_k_norm.weight", (head_dim,), "n"),
                        (b + "attn_output.weight", (d_model, heads * head_dim), "m")]
        else:
            tensors += [(b + "attn_qkv.weight", (conv_dim, d_model), "m"),
                        (b + "attn_gate.weight", (value_dim, d_model), "m"),
                        (b + "ssm_conv1d.weight", (conv_dim, conv), "f"),
                        (b + "ssm_alpha.weight", (ssm_v_heads, d_model), "m"), (b + "ssm_dt.bias", (ssm_v_heads,), "f"),
                        (b + "ssm_a", (ssm_v_heads,), "f"), (b + "ssm_beta.weight", (ssm_v_heads, d_model), "m"),
                        (b + "ssm_norm.weight", (ssm_head_dim,), "n"),
                        (b + "ssm_out.weight", (d_model, value_dim), "m")]
        if moe:
            tensors += [(b + "ffn_gate_inp.weight", (experts, d_model), "f"),
                        (b + "ffn_gate_exps.weight", (experts, d_expert, d_model), "m"),
                        (b + "ffn_up_exps.weight", (experts, d_expert, d_model), "m"),
                        (b + "ffn_down_exps.weight", (experts, d_model, d_expert), "m"),
                        (b + "ffn_gate_inp_shexp.weight", (d_model,), "f"),
                        (b + "ffn_gate_shexp.weight", (d_shared, d_model), "m"),
                        (b + "ffn_up_shexp.weight", (d_shared, d_model), "m"),
                        (b + "ffn_down_shexp.weight", (d_model, d_shared), "m")]
        else:
            tensors += [(b + "ffn_gate.weight", (d_ff, d_model), "m"), (b + "ffn_up.weight", (d_ff, d_model), "m"),
                        (b + "ffn_down.weight", (d_model, d_ff), "m")]
    tensors += [("output_norm.weight", (d_model,), "n"), ("output.weight", (vocab, d_model), "m")]

    def nbytes(shape: tuple[int, ...], kind: str) -> int:
        if kind in ("n", "f"):
            return 4 * int(np.prod(shape))
        return int(np.prod(shape[:-1])) * row_bytes(quant, shape[-1])

    def values(name: str, shape: tuple[int, ...]) -> np.ndarray:
        rng = tensor_rng(seed, name)
        if name.endswith("ffn_gate_inp.weight"):
            return router_values(rng, shape[0], shape[1])
        if name.endswith("ffn_gate_inp_shexp.weight"):
            return router_values(rng, 1, shape[0])[0]
        if name.endswith("ssm_conv1d.weight"):
            return (rng.standard_normal(shape) * 0.5).astype(np.float32)
        if name.endswith("ssm_dt.bias"):
            return (rng.standard_normal(shape) * 0.5).astype(np.float32)
        if name.endswith("ssm_a"):
            return -np.exp(rng.uniform(-1.0, 1.0, shape)).astype(np.float32)
        return random_rows(rng, quant, int(np.prod(shape[:-1])), shape[-1])

    arch = "qwen35moe" if moe else "qwen35"
    ffn = f"E{experts}x{d_expert} top{top_k} shared {d_shared}" if moe else f"ff{d_ff}"
    rot = head_dim // ROTATED_FRACTION
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    dnet = f"dnet {ssm_k_heads}/{ssm_v_heads}x{ssm_head_dim}"
    wr = start_gguf(tmp, arch, f"random {arch} {layers}L d{d_model} {ffn} {dnet} {quant}", layers=layers, ctx=ctx,
                    d_model=d_model, d_ff=d_shared if moe else d_ff, heads=heads, kv_heads=kv_heads,
                    rope_theta=ROPE_THETA, eps=1e-6, file_type=quant, key_length=head_dim, value_length=head_dim,
                    rope_dims=rot)
    wr.add_rope_dimension_sections(rope_sections(rot))
    wr.add_ssm_conv_kernel(conv)
    wr.add_ssm_inner_size(value_dim)
    wr.add_ssm_state_size(ssm_head_dim)
    wr.add_ssm_time_step_rank(ssm_v_heads)
    wr.add_ssm_group_count(ssm_k_heads)
    wr.add_full_attention_interval(interval)
    if moe:
        wr.add_expert_count(experts)
        wr.add_expert_used_count(top_k)
        wr.add_expert_feed_forward_length(d_expert)
        wr.add_expert_shared_feed_forward_length(d_shared)
    add_tokenizer(wr, vocab)
    return _write_tensors(wr, tensors, nbytes, qtype, values, tmp, path)
