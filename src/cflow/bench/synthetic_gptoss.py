"""Random-weight gpt-oss GGUFs for benchmarks (benchmarks/make_gptoss.py, docs/results/gptoss.md).

`write_gptoss_gguf` writes llama.cpp's gpt-oss layout (llm_build_openai_moe_iswa) at any geometry,
gpt-oss-20b's by default (GPTOSS_20B): per layer attn_norm, attn_{q,k,v,output} in Q8_0 with F32
biases, attn_sinks [heads], post_attention_norm (the norm before the MoE), the F32 router
ffn_gate_inp with its bias, and the experts ffn_{gate,up,down}_exps in MXFP4 (3-D, ggml ne
[d, d_exp, E] / [d_exp, d, E]) with F32 biases [E, rows]; token_embd and output in Q8_0; YaRN
(factor 32 over 4096 positions, theta 150000) and a sliding window of 128 on the even layers, as
gpt-oss-20b's file carries them; cflow.bench.synthetic's byte-level tokenizer.

Weights are random but valid: Q8_0 blocks from cflow.bench.synthetic.random_rows (std
~0.5/sqrt(inputs)); MXFP4 blocks are random E2M1 nibbles under one E8M0 exponent per tensor chosen
for the same std; biases and sinks small random F32; norms 1. Each tensor has its own
RNG (synthetic.tensor_rng), so a file is reproducible bit for bit; a tensor is made whole (an
expert stack of gpt-oss-20b: 141 MB) before it is written.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from cflow.bench.synthetic import GAIN, _random_bytes, _write_tensors, add_tokenizer, random_rows, router_values, \
    start_gguf, tensor_rng
from cflow.quant import row_bytes

# gpt-oss-20b's geometry (its config.json: hidden 2880, 24 layers, 64 query heads and 8 KV heads of
# 64, 32 experts of 2880, top 4, vocabulary 201088, window 128)
GPTOSS_20B = dict(layers=24, d_model=2880, d_ff=2880, heads=64, kv_heads=8, head_dim=64, vocab=201088, experts=32,
                  top_k=4, window=128)
_MXFP4_BLOCK = 17  # bytes of 32 weights: one E8M0 exponent, 16 bytes of E2M1 nibbles
_E2M1_STD = 2.8  # the std of a uniformly random E2M1 value (+-{0, .5, 1, 1.5, 2, 3, 4, 6})


def mxfp4_rows(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random MXFP4 blocks [rows, row bytes]: nibbles random, every exponent the one giving weight
    std ~GAIN/sqrt(cols)."""
    data = _random_bytes(rng, rows * cols // 32 * _MXFP4_BLOCK).reshape(-1, _MXFP4_BLOCK)
    data[:, 0] = 127 + round(math.log2(GAIN / math.sqrt(cols) / _E2M1_STD))
    return data.reshape(rows, -1)


def write_gptoss_gguf(path: str | os.PathLike, *, layers: int, d_model: int, d_ff: int, heads: int, kv_heads: int,
                      head_dim: int, vocab: int, experts: int, top_k: int, window: int, seed: int = 0,
                      ctx: int = 4096) -> Path:
    """A random-weight gpt-oss GGUF of this geometry (module docstring); d_ff is each expert's."""
    import gguf

    T = gguf.GGMLQuantizationType
    q_dim, kv = heads * head_dim, kv_heads * head_dim
    tensors: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (vocab, d_model), "q")]
    for i in range(layers):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", (d_model,), "n"),
                    (b + "attn_q.weight", (q_dim, d_model), "q"), (b + "attn_q.bias", (q_dim,), "f"),
                    (b + "attn_k.weight", (kv, d_model), "q"), (b + "attn_k.bias", (kv,), "f"),
                    (b + "attn_v.weight", (kv, d_model), "q"), (b + "attn_v.bias", (kv,), "f"),
                    (b + "attn_output.weight", (d_model, q_dim), "q"), (b + "attn_output.bias", (d_model,), "f"),
                    (b + "attn_sinks.weight", (heads,), "f"), (b + "post_attention_norm.weight", (d_model,), "n"),
                    (b + "ffn_gate_inp.weight", (experts, d_model), "r"), (b + "ffn_gate_inp.bias", (experts,), "f"),
                    (b + "ffn_gate_exps.weight", (experts, d_ff, d_model), "x"),
                    (b + "ffn_gate_exps.bias", (experts, d_ff), "f"),
                    (b + "ffn_up_exps.weight", (experts, d_ff, d_model), "x"),
                    (b + "ffn_up_exps.bias", (experts, d_ff), "f"),
                    (b + "ffn_down_exps.weight", (experts, d_model, d_ff), "x"),
                    (b + "ffn_down_exps.bias", (experts, d_model), "f")]
    tensors += [("output_norm.weight", (d_model,), "n"), ("output.weight", (vocab, d_model), "q")]

    def nbytes(shape: tuple[int, ...], kind: str) -> int:
        rows, cols = int(np.prod(shape[:-1])), shape[-1]
        if kind == "q":
            return rows * row_bytes("q8_0", cols)
        if kind == "x":
            return rows * cols // 32 * _MXFP4_BLOCK
        return 4 * int(np.prod(shape))

    kinds = {name: kind for name, _, kind in tensors}

    def data(name: str, shape: tuple[int, ...]) -> np.ndarray:
        rng, kind = tensor_rng(seed, name), kinds[name]
        rows, cols = int(np.prod(shape[:-1])), shape[-1]
        if kind == "q":
            return random_rows(rng, "q8_0", rows, cols)
        if kind == "x":
            return mxfp4_rows(rng, rows, cols)
        if kind == "r":
            return router_values(rng, rows, cols)
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.1)  # biases, sinks

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    wr = start_gguf(tmp, "gpt-oss", f"random gpt-oss {layers}L d{d_model} E{experts} top{top_k} mxfp4", layers=layers,
                    ctx=ctx, d_model=d_model, d_ff=d_ff, heads=heads, kv_heads=kv_heads, rope_theta=150000.0,
                    eps=1e-5, file_type=gguf.LlamaFileType.MOSTLY_MXFP4_MOE, key_length=head_dim,
                    value_length=head_dim, rope_dims=head_dim)
    wr.add_sliding_window(window)
    wr.add_expert_count(experts)
    wr.add_expert_used_count(top_k)
    wr.add_expert_feed_forward_length(d_ff)
    wr.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    wr.add_rope_scaling_factor(32.0)
    wr.add_rope_scaling_orig_ctx_len(4096)
    add_tokenizer(wr, vocab)
    return _write_tensors(wr, tensors, nbytes, {"q": T.Q8_0, "x": T.MXFP4, "f": T.F32, "r": T.F32}, data, tmp, path)
