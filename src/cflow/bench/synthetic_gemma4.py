"""Random-weight Gemma 4 text GGUFs (dense and MoE) for benchmarks (benchmarks/make_gemma4.py,
docs/results/gemma4.md), in llama.cpp's gemma4 layout, with cflow.bench.synthetic's random blocks,
byte-level tokenizer and streaming writer.

GEMMA4_E2B is Gemma 4 E2B's text geometry as its published config gives it (35 layers, d 1536, 8
query heads and 1 KV head, local heads 256 and global 512, every 5th layer global, the last 20
layers sharing K/V, FFN 6144 and 12288 on the shared layers, per-layer inputs of 256, vocabulary
262144, window 512); the layer count, vocabulary and shared-layer count are flags so the file fits
a benchmark machine (the shared-KV rule needs the KV-owning layers to end on a global layer:
n_layers - shared a multiple of the pattern).

GEMMA4_26B_A4B is Gemma 4 26B-A4B's (30 layers, d 2816, 16 query heads, 8 KV heads of 256 on the
local layers and 2 of 512 on the global ones (head_count_kv per layer), the global layers' V from
K (no attn_v: attention_k_eq_v), every 6th layer global, window 1024, a dense MLP of 2112 beside
128 experts of 704, top 8, no per-layer inputs or shared-KV layers, vocabulary 262144); the same
flags scale it down (docs/results/gemma4.md: 6 layers, 32 experts, 32768 tokens).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from cflow.bench.synthetic import _write_tensors, add_tokenizer, random_rows, router_values, start_gguf, tensor_rng
from cflow.quant import row_bytes

GEMMA4_E2B = dict(layers=35, d_model=1536, d_ff=6144, d_ff_shared=12288, heads=8, kv_heads=1, kv_heads_local=1,
                  head_dim=512, head_dim_local=256, per_layer=256, shared_kv=20, pattern=5, vocab=262144, window=512,
                  experts=0, top_k=0, d_expert=0, k_eq_v=0)
GEMMA4_26B_A4B = dict(layers=30, d_model=2816, d_ff=2112, d_ff_shared=2112, heads=16, kv_heads=2, kv_heads_local=8,
                      head_dim=512, head_dim_local=256, per_layer=0, shared_kv=0, pattern=6, vocab=262144,
                      window=1024, experts=128, top_k=8, d_expert=704, k_eq_v=1)
PRESETS = {"e2b": GEMMA4_E2B, "26b-a4b": GEMMA4_26B_A4B}
ROTATED_QUARTER = 4  # proportional RoPE on the global layers: the first 1/4 of the pairs turn (factor 1)


def write_gemma4_gguf(path: str | os.PathLike, *, layers: int, d_model: int, d_ff: int, d_ff_shared: int, heads: int,
                      kv_heads: int, head_dim: int, head_dim_local: int, per_layer: int, shared_kv: int, pattern: int,
                      vocab: int, window: int, kv_heads_local: int = 0, experts: int = 0, top_k: int = 0,
                      d_expert: int = 0, k_eq_v: int = 0, quant: str = "q4_0", seed: int = 0, ctx: int = 4096) -> Path:
    """A random-weight Gemma 4 GGUF (tests/test_gemma4.py's layout): per-layer head sizes, KV head
    counts (kv_heads_local on the local layers when it differs: head_count_kv an array) and FFN
    widths, shared-KV layers without attn_k / attn_v / attn_k_norm, global layers without attn_v
    (k_eq_v), per-layer embeddings (per_layer > 0), experts beside the dense MLP in every layer
    (experts > 0: 26B-A4B's MoE layers, their scales 1), layer output scales of 1, the global
    layers' rope_freqs (1 on the first quarter of the pairs, 1e30 on the rest), a final soft cap of
    30. Norm weights are 1, so activations stay of order one."""
    import gguf

    T = gguf.GGMLQuantizationType
    qtype = {"q4_0": T.Q4_0, "q4_1": T.Q4_1, "q8_0": T.Q8_0}[quant]
    n_kv = layers - shared_kv
    local = [i % pattern < pattern - 1 for i in range(layers)]
    kv_of = [kv_heads_local if kv_heads_local and local[i] else kv_heads for i in range(layers)]
    lp = layers * per_layer
    tensors: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (vocab, d_model), "m")]
    if per_layer:
        tensors += [("per_layer_token_embd.weight", (vocab, lp), "m"),
                    ("per_layer_model_proj.weight", (lp, d_model), "m"),
                    ("per_layer_proj_norm.weight", (per_layer,), "n")]
    tensors.append(("rope_freqs.weight", (head_dim // 2,), "f"))
    for i in range(layers):
        b, hd, ff = f"blk.{i}.", head_dim_local if local[i] else head_dim, d_ff if i < n_kv else d_ff_shared
        tensors += [(b + "attn_norm.weight", (d_model,), "n"), (b + "attn_q.weight", (heads * hd, d_model), "m"),
                    (b + "attn_q_norm.weight", (hd,), "n")]
        if i < n_kv:
            tensors += [(b + "attn_k.weight", (kv_of[i] * hd, d_model), "m"), (b + "attn_k_norm.weight", (hd,), "n")]
            if local[i] or not k_eq_v:
                tensors.append((b + "attn_v.weight", (kv_of[i] * hd, d_model), "m"))
        tensors += [(b + "attn_output.weight", (d_model, heads * hd), "m"),
                    (b + "post_attention_norm.weight", (d_model,), "n"), (b + "ffn_norm.weight", (d_model,), "n"),
                    (b + "ffn_gate.weight", (ff, d_model), "m"), (b + "ffn_up.weight", (ff, d_model), "m"),
                    (b + "ffn_down.weight", (d_model, ff), "m"), (b + "post_ffw_norm.weight", (d_model,), "n")]
        if experts:
            tensors += [(b + "ffn_gate_inp.weight", (experts, d_model), "f"),
                        (b + "ffn_gate_inp.scale", (d_model,), "n"), (b + "pre_ffw_norm_2.weight", (d_model,), "n"),
                        (b + "post_ffw_norm_1.weight", (d_model,), "n"), (b + "post_ffw_norm_2.weight", (d_model,), "n"),
                        (b + "ffn_gate_up_exps.weight", (experts, 2 * d_expert, d_model), "m"),
                        (b + "ffn_down_exps.weight", (experts, d_model, d_expert), "m"),
                        (b + "ffn_down_exps.scale", (experts,), "n")]
        if per_layer:
            tensors += [(b + "inp_gate.weight", (per_layer, d_model), "m"),
                        (b + "proj.weight", (d_model, per_layer), "m"), (b + "post_norm.weight", (d_model,), "n")]
        tensors.append((b + "layer_output_scale.weight", (1,), "n"))
    tensors.append(("output_norm.weight", (d_model,), "n"))

    def nbytes(shape: tuple[int, ...], kind: str) -> int:
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        return 4 * int(np.prod(shape)) if kind in ("n", "f") else rows * row_bytes(quant, shape[-1])

    def matrix(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name == "rope_freqs.weight":
            f = np.full(shape, 1e30, np.float32)
            f[: shape[0] // ROTATED_QUARTER] = 1.0
            return f
        if name.endswith("ffn_gate_inp.weight"):  # the router reads rms(x) / sqrt(d): logits of std ~1
            return router_values(tensor_rng(seed, name), shape[0], shape[1]) * np.float32(np.sqrt(d_model))
        return random_rows(tensor_rng(seed, name), quant, int(np.prod(shape[:-1])), shape[-1])

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    moe = f" E{experts}x{d_expert} top{top_k}" if experts else ""
    wr = start_gguf(tmp, "gemma4", f"random gemma4 {layers}L d{d_model} ff{d_ff}/{d_ff_shared} hd{head_dim_local}/{head_dim} "
                    f"kv{kv_of[0]}/{kv_heads}{moe} {quant}", layers=layers, ctx=ctx, d_model=d_model,
                    d_ff=[d_ff if i < n_kv else d_ff_shared for i in range(layers)], heads=heads,
                    kv_heads=kv_of if len(set(kv_of)) > 1 else kv_heads,
                    rope_theta=1e6, eps=1e-6, file_type=quant, key_length=head_dim, value_length=head_dim,
                    rope_dims=head_dim)
    wr.add_key_length_swa(head_dim_local)
    wr.add_value_length_swa(head_dim_local)
    wr.add_rope_dimension_count_swa(head_dim_local)
    wr.add_rope_freq_base_swa(1e4)
    wr.add_sliding_window(window)
    wr.add_sliding_window_pattern(local)
    wr.add_shared_kv_layers(shared_kv)
    wr.add_embedding_length_per_layer_input(per_layer)
    if experts:
        wr.add_expert_count(experts)
        wr.add_expert_used_count(top_k)
        wr.add_expert_feed_forward_length(d_expert)
    wr.add_final_logit_softcapping(30.0)
    add_tokenizer(wr, vocab)
    return _write_tensors(wr, tensors, nbytes, qtype, matrix, tmp, path)
