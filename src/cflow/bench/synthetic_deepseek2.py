"""Random-weight deepseek2 GGUFs (DeepSeek-V3's attention and expert shapes) for benchmarks.

`write_deepseek2_gguf` writes llama.cpp's deepseek2 layout as current converters do (the split
attn_k_b / attn_v_b, head_count_kv 1, key_length_mla / value_length_mla; V3's sigmoid routing with
the exp_probs_b bias, expert groups, weights renormalised and scaled 2.5; one shared expert; no
RoPE scaling) with cflow.bench.synthetic's random blocks, byte-level tokenizer and tensor writer.
Norms are 1, the routers random F32 (cflow.bench.synthetic.router_values), the correction biases 0.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from cflow.bench.synthetic import _write_tensors, add_tokenizer, random_rows, router_values, start_gguf, \
    tensor_rng
from cflow.quant import row_bytes

# DeepSeek-V3 (671B): its widths; the benchmark takes fewer layers and experts (--layers, --experts).
DEEPSEEK_V3 = dict(layers=3, dense_layers=1, d_model=7168, heads=128, q_lora=1536, kv_lora=512, qk_nope=128,
                   qk_rope=64, v_head=128, d_ff=18432, experts=32, top_k=8, d_expert=2048, shared=1, groups=8,
                   groups_used=4, vocab=32768)


def write_deepseek2_gguf(path: str | os.PathLike, *, layers: int, dense_layers: int, d_model: int, heads: int,
                         q_lora: int, kv_lora: int, qk_nope: int, qk_rope: int, v_head: int, d_ff: int, experts: int,
                         top_k: int, d_expert: int, shared: int, groups: int, groups_used: int, vocab: int,
                         quant: str = "q4_0", seed: int = 0, ctx: int = 4096) -> Path:
    import gguf

    T = gguf.GGMLQuantizationType
    qtype = {"q4_0": T.Q4_0, "q4_1": T.Q4_1, "q8_0": T.Q8_0}[quant]
    qk = qk_nope + qk_rope
    tensors: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (vocab, d_model), "m")]
    for i in range(layers):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", (d_model,), "n"), (b + "attn_q_a.weight", (q_lora, d_model), "m"),
                    (b + "attn_q_a_norm.weight", (q_lora,), "n"), (b + "attn_q_b.weight", (heads * qk, q_lora), "m"),
                    (b + "attn_kv_a_mqa.weight", (kv_lora + qk_rope, d_model), "m"),
                    (b + "attn_kv_a_norm.weight", (kv_lora,), "n"),
                    (b + "attn_k_b.weight", (heads, kv_lora, qk_nope), "m"),
                    (b + "attn_v_b.weight", (heads, v_head, kv_lora), "m"),
                    (b + "attn_output.weight", (d_model, heads * v_head), "m"), (b + "ffn_norm.weight", (d_model,), "n")]
        if i < dense_layers:
            tensors += [(b + "ffn_gate.weight", (d_ff, d_model), "m"), (b + "ffn_up.weight", (d_ff, d_model), "m"),
                        (b + "ffn_down.weight", (d_model, d_ff), "m")]
            continue
        tensors += [(b + "ffn_gate_inp.weight", (experts, d_model), "f"), (b + "exp_probs_b.bias", (experts,), "f"),
                    (b + "ffn_gate_exps.weight", (experts, d_expert, d_model), "m"),
                    (b + "ffn_up_exps.weight", (experts, d_expert, d_model), "m"),
                    (b + "ffn_down_exps.weight", (experts, d_model, d_expert), "m"),
                    (b + "ffn_gate_shexp.weight", (d_expert * shared, d_model), "m"),
                    (b + "ffn_up_shexp.weight", (d_expert * shared, d_model), "m"),
                    (b + "ffn_down_shexp.weight", (d_model, d_expert * shared), "m")]
    tensors += [("output_norm.weight", (d_model,), "n"), ("output.weight", (vocab, d_model), "m")]

    def nbytes(shape: tuple[int, ...], kind: str) -> int:
        n = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        return 4 * int(np.prod(shape)) if kind in ("n", "f") else n * row_bytes(quant, shape[-1])

    def values(name: str, shape: tuple[int, ...]) -> np.ndarray:
        rng = tensor_rng(seed, name)
        if name.endswith("exp_probs_b.bias"):
            return np.zeros(shape, np.float32)
        if name.endswith("ffn_gate_inp.weight"):
            return router_values(rng, shape[0], shape[1])
        return random_rows(rng, quant, int(np.prod(shape[:-1])), shape[-1])

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    wr = start_gguf(tmp, "deepseek2", f"random deepseek2 {layers}L d{d_model} h{heads} kv{kv_lora} E{experts} {quant}",
                    layers=layers, ctx=ctx, d_model=d_model, d_ff=d_ff, heads=heads, kv_heads=1, rope_theta=10000.0,
                    eps=1e-6, file_type=quant, key_length=kv_lora + qk_rope, value_length=kv_lora,
                    rope_dims=qk_rope)
    wr.add_key_length_mla(qk)
    wr.add_value_length_mla(v_head)
    wr.add_q_lora_rank(q_lora)
    wr.add_kv_lora_rank(kv_lora)
    wr.add_leading_dense_block_count(dense_layers)
    wr.add_expert_count(experts)
    wr.add_expert_used_count(top_k)
    wr.add_expert_feed_forward_length(d_expert)
    wr.add_expert_shared_count(shared)
    wr.add_expert_weights_scale(2.5)
    wr.add_expert_weights_norm(True)
    wr.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    wr.add_expert_group_count(groups)
    wr.add_expert_group_used_count(groups_used)
    add_tokenizer(wr, vocab)
    return _write_tensors(wr, tensors, nbytes, qtype, values, tmp, path)
