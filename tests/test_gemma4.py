"""Gemma 4 (`general.architecture` = "gemma4", text only) as llama.cpp runs it, pinned down before
cflow's engine learns it: a random-weight gemma4 GGUF in llama.cpp's exact layout at small
geometry, a float reference of the graph written from llama.cpp's llama_model_gemma4 graph, the two
held against each other teacher-forced over 40 positions, and controls that drop one feature each
and must miss.

The file (`write_gemma4_gguf`), 6 layers, d 128, 4 heads / 2 KV heads:
- gemma3's blocks (attn_norm, attn_{q,k,v,output}, attn_{q,k}_norm, post_attention_norm, ffn_norm,
  ffn_{gate,up,down} GeGLU, post_ffw_norm, tied embeddings scaled by sqrt(d), NEOX RoPE), with:
- `attention.sliding_window_pattern` as a per-layer bool array (local layers 0, 1, 3, 4);
  local layers have their own head size (`attention.key_length_swa` / `value_length_swa` 32,
  `rope.dimension_count_swa` 32, `rope.freq_base_swa` 10; real files: 1e4 local, 1e6 global, here
  10 and 1000 so that both bases and the factors turn the pairs visibly within 40 positions), global
  ones 64 (`key_length`) and the
  one shared `rope_freqs.weight` [64 / 2] as RoPE frequency factors (Gemma 4's "proportional"
  RoPE: factor 1 on the first quarter of the pairs, 1e30 on the rest, which leaves them unrotated);
- `attention.shared_kv_layers` 3: layers 3..5 own no K/V (no attn_k / attn_v / attn_k_norm) and read
  the cache of layer n_kv - 2 = 1 when local, n_kv - 1 = 2 when global (llama.cpp's reuse rule
  n_layer_kv_from_start - (is_swa ? 2 : 1));
- layer 2 has no attn_v: V is K's projection (before k_norm), as llama.cpp's "use_alternative_
  attention" path does when the tensor is absent;
- per-layer embeddings (`embedding_length_per_layer_input` P 32): per_layer_token_embd [V, L*P],
  per_layer_model_proj [L*P, d], per_layer_proj_norm [P]; per layer inp_gate [P, d], proj [d, P],
  post_norm [d];
- per-layer `feed_forward_length` (an array: 96 on the KV layers, 192 on the shared ones, as
  Gemma 4 E2B's double-wide MLP), blk.N.layer_output_scale [1], final_logit_softcapping.

The graph (`reference_logits`), as llama.cpp (llama-cpp-python 0.3.36) computes it:
  x0 = E[t] * sqrt(d)
  ple[l] = (rms(x0 W_mp / sqrt(d))[l] * proj_norm + E_pl[t][l] * sqrt(P)) / sqrt(2)   per layer l
  per layer: h = rms(x) * attn_norm
    q = rms_head(W_q h) * q_norm, RoPE (the layer's base, head size, factors)
    if the layer owns K/V: k = rms_head(W_k h) * k_norm, RoPE; v = rms_head(W_v h or W_k h) (no
      weight); else k, v are the reused layer's
    scores = q . k  (scale 1: no 1/sqrt(head_dim)), local layers masked to the last 8 positions
    x = x + rms(W_o softmax(scores) v) * post_attention_norm
    x = x + rms(W_d (gelu_tanh(W_g f) * W_u f)) * post_ffw_norm,   f = rms(x) * ffn_norm
    x = x + rms(W_proj (gelu_tanh(W_gate x) * ple[l])) * post_norm
    x = x * layer_output_scale
  logits = cap * tanh((rms(x) * output_norm) E^T / cap)

A second file adds Gemma 4's MoE to every layer (26B-A4B's layers; llama.cpp builds them where
blk.N.ffn_gate_inp is present; keys expert_count, expert_used_count, expert_feed_forward_length):
the dense MLP stays as a shared expert, and the FFN branch becomes
    f = rms(dense MLP(rms(x) * ffn_norm)) * post_ffw_norm_1 + rms(experts(x)) * post_ffw_norm_2
before post_ffw_norm, with `experts` as its docstring says (router ffn_gate_inp [E, d] on
rms(x) / sqrt(d) * ffn_gate_inp.scale [d], merged ffn_gate_up_exps [E, 2 F, d] gate rows first,
ffn_down_exps [E, d, F] times ffn_down_exps.scale [E], expert input rms(x) * pre_ffw_norm_2).
A third file is the MoE one with `attention.head_count_kv` an array (26B-A4B's and 31B's: one KV
head count on the local layers, KV_LOCAL = 4, and another on the global ones, KV_HEADS = 2); each
layer's query heads group over its own KV heads (head h reads KV head h // (HEADS / count)), a
shared-KV layer over its source's.
Not covered: the vision / audio towers (and their projector files).

The vocabulary: `tokenizer.ggml.model` "gemma4" is a new vocabulary type in llama.cpp: BPE (merge
ranks, `tokenizer.ggml.merges`) over raw UTF-8 characters, not GPT-2's byte alphabet; spaces escaped
to U+2581 before merging; pre-split only into runs of newlines and runs of anything else
(`[^\\n]+|[\\n]+`: a merge across a newline never applies); a piece left without a token falls back to
<0xXX> byte tokens; add_bos is on without the file saying so (the tokenize call can still ask for
none).
`gemma4_tokenize` writes that down and is held against llama.cpp on a trained vocabulary; so is
cflow's tokenizer for the type (cflow.tokenizer_gemma4), special tokens and decoding included, and
through a converted .cflow (a Llama carrying the vocabulary) in the engine.

cflow converts and runs both files (tests/test_gemma4_engine.py holds its engine against this
oracle).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

pytestmark = pytest.mark.oracle  # compares against llama.cpp (llama-cpp-python)

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="the llama.cpp oracle is not installed: pip install 'llama-cpp-python>=0.3.16'")
gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from test_convert_gguf import add_tensor  # noqa: E402
from test_convert_gguf_moe import compare, gguf_values  # noqa: E402
from test_moe_llamacpp import MEDIAN_TOL, llama_cpp_logits, private_cache  # noqa: E402,F401
from test_tokenizer_gguf import CORPUS, TRICKY, detokenize  # noqa: E402

from cflow.convert.gguf import GGUFModel  # noqa: E402
from cflow.tokenizer_spm import byte_token  # noqa: E402

T = gguf.GGMLQuantizationType
ARCH = "gemma4"
D, HEADS, KV_HEADS, LAYERS, P = 128, 4, 2, 6, 32
HD, HD_SWA = 64, 32  # global / local layers' head size
LOCAL = [True, True, False, True, True, False]  # attention.sliding_window_pattern
SHARED_KV = 3  # attention.shared_kv_layers: layers 3..5 reuse layer 1's (local) or 2's (global) cache
N_KV = LAYERS - SHARED_KV
FF = [96, 96, 96, 192, 192, 192]
NO_V = {2}  # layers without attn_v (V from K's projection)
WINDOW, CTX, THETA, THETA_SWA, EPS, SOFTCAP = 8, 256, 1000.0, 10.0, 1e-6, 10.0
ROTATED_PAIRS = 8  # of HD // 2: rope_freqs is 1 on these, 1e30 (no rotation) on the rest
E, TOP_K, F_EXP = 4, 2, 64  # the MoE file's experts (every layer: the dense MLP as shared expert)
KV_LOCAL = 4  # the per-layer-KV file's local layers' KV heads (its global ones keep KV_HEADS; 26B-A4B: 8 / 2)
STEPS = 40
# The oracle's tolerances (measured, llama-cpp-python 0.3.36, AVX-512). All-F32 file, seeds 0 and 1:
# median max|dlogit|/std 0.06-0.13%, every position <= 0.25% (llama.cpp keeps K/V in fp16 and its
# CPU GELU reads an fp16 table; nothing else separates it from the float64 reference), so median
# <= 0.5%, every position <= 1%; the controls miss by 16-820% (median), 32x that at least. The F32
# MoE file: median 0.06-0.10%, every position <= 0.23%, its controls miss by 22-90%. The Q8_0 file
# (llama.cpp rounds each mat-mul's input to int8 per 32 values, which the scale-1 attention's peaked
# softmax amplifies): median 4.5%, max 8.9%, argmax equal at all 40 decisive positions; held to
# median <= 8% (half the smallest control's miss) and argmax where decisive.
F32_MEDIAN_TOL, F32_MAX_TOL = 0.005, 0.01
Q8_MEDIAN_TOL = 0.08


# ---- the vocabulary ---------------------------------------------------------------------------
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>"]
SPECIAL_TYPES = [3, 3, 3, 2, 3, 3, 3]  # control, but <unk>


def gemma4_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, types, merges) of a small "gemma4" vocabulary laid out as Gemma 4's: the specials
    (<pad> 0, <eos> 1, <bos> 2, <unk> 3, ...), the 256 byte tokens, then the pieces of a BPE trained
    here over CORPUS with spaces escaped to U+2581 and nothing pre-split (characters first, then the
    merged pieces in merge order)."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers, trainers

    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=360, show_progress=False))
    model = json.loads(tk.to_str())["model"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    pieces = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    tokens = SPECIALS + [byte_token(b) for b in range(256)] + pieces
    types = SPECIAL_TYPES + [6] * 256 + [1] * len(pieces)
    return tokens, types, merges


def add_gemma4_vocab(wr) -> None:
    tokens, types, merges = gemma4_vocab()
    wr.add_tokenizer_model("gemma4")
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_scores([0.0] * len(tokens))
    wr.add_token_merges(merges)
    wr.add_bos_token_id(2)
    wr.add_eos_token_id(1)
    wr.add_unk_token_id(3)
    wr.add_pad_token_id(0)


def gemma4_tokenize(text: str, add_bos: bool = True) -> list[int]:
    """The "gemma4" vocabulary type as the module docstring states it (plain text, no special-token
    parsing): escape spaces, split into newline / non-newline runs, merge by rank over characters,
    unknown pieces as byte tokens."""
    tokens, _, merges = gemma4_vocab()
    ids = {t: i for i, t in enumerate(tokens)}
    rank = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    out = [ids["<bos>"]] if add_bos else []
    for word in re.findall(r"[^\n]+|\n+", text.replace(" ", "▁")):
        syms = list(word)
        while len(syms) > 1:
            pairs = [(rank.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(syms, syms[1:]))]
            best, i = min(pairs)
            if best == 1 << 30:
                break
            syms[i:i + 2] = [syms[i] + syms[i + 1]]
        for s in syms:
            out += [ids[s]] if s in ids else [ids[byte_token(b)] for b in s.encode()]
    return out


# ---- the model file ---------------------------------------------------------------------------
def has_kv(layer: int) -> bool:
    return layer < N_KV


def kv_source(layer: int, same_type: bool = True) -> int:
    """The layer whose cache `layer` attends over (llama.cpp's reuse rule; same_type=False: the
    control that reuses the first layer of the same kind instead)."""
    if has_kv(layer):
        return layer
    if not same_type:
        return LOCAL.index(LOCAL[layer])
    return N_KV - (2 if LOCAL[layer] else 1)


def head_dim(layer: int) -> int:
    return HD_SWA if LOCAL[layer] else HD


def kv_heads(layer: int, kv_local: int | None = None) -> int:
    """KV heads of `layer`'s cache: kv_local on the local layers of the per-layer-KV file."""
    return kv_local if kv_local and LOCAL[layer] else KV_HEADS


def gemma4_weights(seed: int, moe: bool = False, kv_local: int | None = None) -> dict[str, np.ndarray]:
    """Float weights under GGUF names (numpy order). Embeddings large enough that the tied logits
    reach the soft cap; q/k norms around 1, so with attention scale 1 the scores are peaked and the
    RoPE bases, factors and the window matter; post-norms and per-layer scales spread so that every
    branch moves the residual."""
    rng = np.random.default_rng(seed)
    V = len(gemma4_vocab()[0])

    def mat(*shape, gain=1.0):
        return (gain * rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def norm(n=D, mean=1.0, spread=0.1):
        return (mean + spread * rng.standard_normal(n)).astype(np.float32)

    factors = np.full(HD // 2, 1e30, np.float32)
    factors[:ROTATED_PAIRS] = 1.0
    w = {"token_embd.weight": (0.3 * rng.standard_normal((V, D))).astype(np.float32),
         "output_norm.weight": norm(), "rope_freqs.weight": factors,
         "per_layer_token_embd.weight": (0.5 * rng.standard_normal((V, LAYERS * P))).astype(np.float32),
         "per_layer_model_proj.weight": mat(LAYERS * P, D), "per_layer_proj_norm.weight": norm(P)}
    for i in range(LAYERS):
        b, hd = f"blk.{i}.", head_dim(i)
        w.update({b + "attn_norm.weight": norm(), b + "attn_q.weight": mat(HEADS * hd, D),
                  b + "attn_output.weight": mat(D, HEADS * hd), b + "attn_q_norm.weight": norm(hd, 1.0, 0.2),
                  b + "post_attention_norm.weight": norm(mean=0.5), b + "ffn_norm.weight": norm(),
                  b + "ffn_gate.weight": mat(FF[i], D), b + "ffn_up.weight": mat(FF[i], D),
                  b + "ffn_down.weight": mat(D, FF[i]), b + "post_ffw_norm.weight": norm(mean=0.5),
                  b + "inp_gate.weight": mat(P, D, gain=2.0), b + "proj.weight": mat(D, P),
                  b + "post_norm.weight": norm(mean=0.5),
                  b + "layer_output_scale.weight": rng.uniform(0.4, 1.6, 1).astype(np.float32)})
        if has_kv(i):
            kv = kv_heads(i, kv_local)
            w.update({b + "attn_k.weight": mat(kv * hd, D), b + "attn_k_norm.weight": norm(hd, 1.0, 0.5)})
            if i not in NO_V:  # uneven column gains: |W_v h| varies from token to token, so V's norm matters
                w[b + "attn_v.weight"] = mat(kv * hd, D) * np.exp(1.5 * rng.standard_normal(D)).astype(np.float32)
        if moe:
            w.update({b + "ffn_gate_inp.weight": mat(E, D, gain=16.0), b + "ffn_gate_inp.scale": norm(spread=0.3),
                      b + "pre_ffw_norm_2.weight": norm(), b + "post_ffw_norm_1.weight": norm(mean=0.5),
                      b + "post_ffw_norm_2.weight": norm(mean=0.5),
                      b + "ffn_gate_up_exps.weight": mat(E, 2 * F_EXP, D, gain=2.0),
                      b + "ffn_down_exps.weight": mat(E, D, F_EXP),
                      b + "ffn_down_exps.scale": np.exp(rng.standard_normal(E)).astype(np.float32)})
    return w


def write_gemma4_gguf(path, seed: int = 0, native: bool | str = False, moe: bool = False,
                      kv_local: int | None = None) -> None:
    """The test's gemma4 GGUF; native=True stores the matrices Q8_0 (norms, scales and factors F32),
    native="experts" the expert stacks too, else every tensor F32; moe: every layer also has experts
    (26B-A4B's layers); kv_local: `attention.head_count_kv` per layer, kv_local on the local layers
    and KV_HEADS on the global ones (26B-A4B's and 31B's array; their global layers lack attn_v, as
    this file's global KV layer 2 does)."""
    wr = gguf.GGUFWriter(str(path), ARCH)
    wr.add_name("tiny-gemma4")
    wr.add_block_count(LAYERS)
    wr.add_context_length(CTX)
    wr.add_embedding_length(D)
    wr.add_feed_forward_length(FF)
    wr.add_head_count(HEADS)
    wr.add_head_count_kv([kv_heads(i, kv_local) for i in range(LAYERS)] if kv_local else KV_HEADS)
    wr.add_key_length(HD)
    wr.add_value_length(HD)
    wr.add_key_length_swa(HD_SWA)
    wr.add_value_length_swa(HD_SWA)
    wr.add_rope_dimension_count(HD)
    wr.add_rope_dimension_count_swa(HD_SWA)
    wr.add_rope_freq_base(THETA)
    wr.add_rope_freq_base_swa(THETA_SWA)
    wr.add_layer_norm_rms_eps(EPS)
    wr.add_sliding_window(WINDOW)
    wr.add_sliding_window_pattern(LOCAL)
    wr.add_shared_kv_layers(SHARED_KV)
    wr.add_embedding_length_per_layer_input(P)
    wr.add_final_logit_softcapping(SOFTCAP)
    if moe:
        wr.add_expert_count(E)
        wr.add_expert_used_count(TOP_K)
        wr.add_expert_feed_forward_length(F_EXP)
    add_gemma4_vocab(wr)
    for name, x in gemma4_weights(seed, moe, kv_local).items():
        add_tensor(wr, name, x, T.Q8_0 if native and (x.ndim == 2 or (x.ndim == 3 and native == "experts")) else T.F32)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


# ---- the float reference ----------------------------------------------------------------------
def rms(x: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return y if w is None else y * w


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


def rope(x: torch.Tensor, theta: float, factors: torch.Tensor) -> torch.Tensor:
    """NEOX RoPE over the whole head of x [heads, n, hd]: pair (j, j + hd/2) turns by
    pos * theta^(-2j/hd) / factors[j]."""
    n, hd = x.shape[1], x.shape[2]
    inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd) / factors
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cos(ang), torch.sin(ang)
    a, b = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def reference_logits(path, toks: list[int], ple: bool = True, ple_tokens: bool = True, shared_kv: bool = True,
                     value_norm: bool = True, unit_scale: bool = True, window: bool = True,
                     rope_factors: bool = True, local_base: bool = True, out_scale: bool = True,
                     softcap: bool = True, v_raw_k: bool = True, layer_groups: bool = True,
                     **moe_drops) -> np.ndarray:
    """[n, V] logits of the graph in the module docstring (float64), from the GGUF's dequantized
    weights; each flag set False drops one feature (the controls)."""
    g = GGUFModel(path)
    names = set(g.tensors)

    def v(name):
        return torch.from_numpy(gguf_values(g, name).astype(np.float64))

    n, idx = len(toks), torch.tensor(toks)
    E = v("token_embd.weight")
    x = E[idx] * np.sqrt(np.float32(D))
    if ple:
        proj = (x @ v("per_layer_model_proj.weight").T / np.sqrt(D)).view(n, LAYERS, P)
        per_layer = rms(proj, v("per_layer_proj_norm.weight"))
        if ple_tokens:
            per_layer = per_layer + v("per_layer_token_embd.weight")[idx].view(n, LAYERS, P) * np.sqrt(P)
        per_layer = per_layer / np.sqrt(2)
    pos = torch.arange(n)
    causal = pos[None, :] <= pos[:, None]
    local = causal & (pos[:, None] - pos[None, :] < WINDOW)
    ones = torch.ones(HD // 2, dtype=torch.float64)
    factors = v("rope_freqs.weight") if rope_factors else ones
    cache = {}
    for i in range(LAYERS):
        b, hd, loc = f"blk.{i}.", head_dim(i), LOCAL[i]
        theta = THETA_SWA if (loc and local_base) else THETA
        ff = ones[: hd // 2] if loc else factors
        h = rms(x, v(b + "attn_norm.weight"))
        q = rms((h @ v(b + "attn_q.weight").T).view(n, HEADS, hd), v(b + "attn_q_norm.weight")).transpose(0, 1)
        q = rope(q, theta, ff)
        if has_kv(i):
            kp = (h @ v(b + "attn_k.weight").T).view(n, -1, hd)  # the layer's own KV head count
            kn = rms(kp, v(b + "attn_k_norm.weight"))
            if b + "attn_v.weight" in names:
                vp = (h @ v(b + "attn_v.weight").T).view(n, -1, hd)
            else:  # V is K's projection before k_norm (v_raw_k=False: the control takes the normed K)
                vp = kp if v_raw_k else kn
            k = rope(kn.transpose(0, 1), theta, ff)
            vv = (rms(vp) if value_norm else vp).transpose(0, 1)
            cache[i] = k, vv
        k, vv = cache[kv_source(i, shared_kv)]
        kv = k.shape[0]
        reads = torch.arange(HEADS) // (HEADS // kv)  # head h reads kv head h // (its layer's group)
        if not layer_groups:  # the control: every layer grouped as layer 0 (a local one), wrapped to its heads
            reads = (torch.arange(HEADS) // (HEADS // cache[0][0].shape[0])) % kv
        k, vv = k[reads], vv[reads]
        s = q @ k.transpose(1, 2) * (1.0 if unit_scale else 1 / np.sqrt(hd))
        s = s.masked_fill(~(local if (loc and window) else causal), float("-inf"))
        o = (torch.softmax(s, dim=-1) @ vv).transpose(0, 1).reshape(n, HEADS * hd)
        x = x + rms(o @ v(b + "attn_output.weight").T, v(b + "post_attention_norm.weight"))
        f = rms(x, v(b + "ffn_norm.weight"))
        f = (gelu_tanh(f @ v(b + "ffn_gate.weight").T) * (f @ v(b + "ffn_up.weight").T)) @ v(b + "ffn_down.weight").T
        if b + "ffn_gate_inp.weight" in names:
            f = rms(f, v(b + "post_ffw_norm_1.weight")) + rms(experts(v, b, x, **moe_drops), v(b + "post_ffw_norm_2.weight"))
        x = x + rms(f, v(b + "post_ffw_norm.weight"))
        if ple:
            gate = gelu_tanh(x @ v(b + "inp_gate.weight").T) * per_layer[:, i]
            x = x + rms(gate @ v(b + "proj.weight").T, v(b + "post_norm.weight"))
        if out_scale:
            x = x * v(b + "layer_output_scale.weight")
    logits = rms(x, v("output_norm.weight")) @ E.T
    if softcap:
        logits = SOFTCAP * torch.tanh(logits / SOFTCAP)
    return logits.numpy()


def experts(v, b: str, x: torch.Tensor, router_norm: bool = True, weighted: bool = True, gate_first: bool = True,
            down_scale: bool = True) -> torch.Tensor:
    """The MoE branch of a layer on the residual x (after attention): router logits
    W_r (rms(x) / sqrt(d) * ffn_gate_inp.scale), softmax over all experts, the top k kept and
    renormalised to sum 1 (a factor per token that post_ffw_norm_2 cancels: no control can see
    it); expert e: W_down,e (gelu_tanh(g) * u) * ffn_down_exps.scale[e], [g; u] (gate rows first) =
    W_gate_up,e (rms(x) * pre_ffw_norm_2). The flags drop one feature each."""
    r = (rms(x) / np.sqrt(D) * v(b + "ffn_gate_inp.scale")) if router_norm else x
    probs = torch.softmax(r @ v(b + "ffn_gate_inp.weight").T, dim=-1)
    top = probs.topk(TOP_K, dim=-1)
    wts = top.values / top.values.sum(-1, keepdim=True) if weighted else torch.full_like(top.values, 1 / TOP_K)
    h = rms(x, v(b + "pre_ffw_norm_2.weight"))
    gu, down, scale = v(b + "ffn_gate_up_exps.weight"), v(b + "ffn_down_exps.weight"), v(b + "ffn_down_exps.scale")
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(TOP_K):
            e = int(top.indices[t, j])
            g, u = (gu[e] @ h[t]).split(F_EXP) if gate_first else (gu[e] @ h[t]).split(F_EXP)[::-1]
            out[t] += wts[t, j] * (down[e] @ (gelu_tanh(g) * u)) * (scale[e] if down_scale else 1.0)
    return out


def sequence(n: int = STEPS, seed: int = 7) -> list[int]:
    """Token ids over the vocabulary's ordinary pieces (the bytes and the trained pieces)."""
    return [int(t) for t in np.random.default_rng(seed).integers(len(SPECIALS), len(gemma4_vocab()[0]), n)]


# ---- the oracle -------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[0, 1])
def g4(request, tmp_path_factory):
    """The all-F32 file of one weight seed and llama.cpp's teacher-forced logits on it."""
    seed = request.param
    path = tmp_path_factory.mktemp(f"gemma4_{seed}") / "m.gguf"
    write_gemma4_gguf(path, seed)
    toks = sequence(seed=30 + seed)
    return path, toks, llama_cpp_logits(path, toks)


def test_the_file_is_llama_cpps_layout(g4):
    """What llama.cpp's loader accepted: per-layer head sizes, the shared layers without K/V, a
    layer without attn_v, per-layer FFN widths, the per-layer-embedding tensors."""
    path = g4[0]
    shapes = {t.name: tuple(int(s) for s in t.shape) for t in gguf.GGUFReader(str(path)).tensors}
    assert shapes["blk.0.attn_q.weight"] == (D, HEADS * HD_SWA) and shapes["blk.2.attn_q.weight"] == (D, HEADS * HD)
    assert "blk.3.attn_k.weight" not in shapes and "blk.2.attn_v.weight" not in shapes
    assert shapes["blk.5.ffn_up.weight"] == (D, FF[5]) and shapes["per_layer_token_embd.weight"][0] == LAYERS * P
    assert shapes["blk.0.layer_output_scale.weight"] == (1,) and "output.weight" not in shapes


def test_reference_matches_llama_cpp(g4):
    path, toks, lc = g4
    errs, margins, agree = compare(reference_logits(path, toks), lc)
    msg = f"max|dlogit|/std per position: {np.round(errs, 4)}"
    assert np.median(errs) <= F32_MEDIAN_TOL and errs.max() <= F32_MAX_TOL, msg
    assert agree[margins > 0.2].all(), msg


CONTROLS = {
    "no per-layer embeddings": dict(ple=False),
    "per-layer embeddings without their token table": dict(ple_tokens=False),
    "shared layers reading the first layer of their kind": dict(shared_kv=False),
    "V not normalised": dict(value_norm=False),
    "V from the normed K where attn_v is absent": dict(v_raw_k=False),
    "scores scaled by 1/sqrt(head_dim)": dict(unit_scale=False),
    "local layers without their window": dict(window=False),
    "global layers without the proportional RoPE factors": dict(rope_factors=False),
    "local layers with the global RoPE base": dict(local_base=False),
    "no layer output scale": dict(out_scale=False),
    "no final soft cap": dict(softcap=False),
}


@pytest.mark.parametrize("control", list(CONTROLS))
def test_each_feature_matters(g4, control):
    """Without any one feature the reference misses llama.cpp by far (median error over 3x
    test_moe_llamacpp's tolerance, i.e. > 12% of the logits' std; measured 16-820%): the file
    exercises each, and the oracle sees each."""
    path, toks, lc = g4
    errs, _, _ = compare(reference_logits(path, toks, **CONTROLS[control]), lc)
    assert np.median(errs) > 3 * MEDIAN_TOL, (control, np.round(errs, 3))


@pytest.fixture(scope="module", params=[0, 1])
def g4_moe(request, tmp_path_factory):
    """The all-F32 MoE file of one weight seed and llama.cpp's teacher-forced logits on it."""
    seed = request.param
    path = tmp_path_factory.mktemp(f"gemma4_moe_{seed}") / "m.gguf"
    write_gemma4_gguf(path, seed, moe=True)
    toks = sequence(seed=30 + seed)
    return path, toks, llama_cpp_logits(path, toks)


def test_moe_reference_matches_llama_cpp(g4_moe):
    """Measured median 0.06-0.10%, every position <= 0.23% (seeds 0 and 1): the F32 tolerances."""
    path, toks, lc = g4_moe
    errs, margins, agree = compare(reference_logits(path, toks), lc)
    msg = f"max|dlogit|/std per position: {np.round(errs, 4)}"
    assert np.median(errs) <= F32_MEDIAN_TOL and errs.max() <= F32_MAX_TOL, msg
    assert agree[margins > 0.2].all(), msg


MOE_CONTROLS = {
    "router on the raw residual": dict(router_norm=False),
    "experts averaged, not weighted by the router": dict(weighted=False),
    "up rows first in ffn_gate_up_exps": dict(gate_first=False),
    "no per-expert output scale": dict(down_scale=False),
}


@pytest.mark.parametrize("control", list(MOE_CONTROLS))
def test_each_moe_feature_matters(g4_moe, control):
    """Without any one MoE feature the reference misses by far (measured 22-90%, median over
    positions). The top-k renormalisation has no control: post_ffw_norm_2 cancels it."""
    path, toks, lc = g4_moe
    errs, _, _ = compare(reference_logits(path, toks, **MOE_CONTROLS[control]), lc)
    assert np.median(errs) > 3 * MEDIAN_TOL, (control, np.round(errs, 3))


@pytest.fixture(scope="module")
def g4_kv(tmp_path_factory):
    """The all-F32 MoE file with a KV head count per layer (KV_LOCAL on the local layers, KV_HEADS on
    the global ones: 26B-A4B's layers) and llama.cpp's teacher-forced logits on it (one seed: the
    other features are the MoE file's, held above on two)."""
    path = tmp_path_factory.mktemp("gemma4_kv") / "m.gguf"
    write_gemma4_gguf(path, 2, moe=True, kv_local=KV_LOCAL)
    toks = sequence(seed=32)
    return path, toks, llama_cpp_logits(path, toks)


def test_per_layer_kv_heads_file(g4_kv):
    """What llama.cpp's loader accepted: head_count_kv an array (4 on the local layers, 2 on the global
    ones), K rows per layer at its count, the global KV layer without attn_v."""
    g = GGUFModel(g4_kv[0])
    assert list(g.get(f"{ARCH}.attention.head_count_kv")) == [KV_LOCAL if loc else KV_HEADS for loc in LOCAL]
    shapes = {n: tuple(int(x) for x in t.shape) for n, t in g.tensors.items()}
    assert shapes["blk.0.attn_k.weight"][-2:] == (KV_LOCAL * HD_SWA, D)
    assert shapes["blk.2.attn_k.weight"][-2:] == (KV_HEADS * HD, D) and "blk.2.attn_v.weight" not in shapes


def test_per_layer_kv_reference_matches_llama_cpp(g4_kv):
    """Each layer's query heads grouped over its own KV heads: within the F32 tolerances; grouped as
    the local layers' on every layer (query head h reading KV head h mod 2 on the global layers
    instead of h // 2), the reference misses by over 3x test_moe_llamacpp's tolerance."""
    path, toks, lc = g4_kv
    errs, margins, agree = compare(reference_logits(path, toks), lc)
    msg = f"max|dlogit|/std per position: {np.round(errs, 4)}"
    assert np.median(errs) <= F32_MEDIAN_TOL and errs.max() <= F32_MAX_TOL, msg
    assert agree[margins > 0.2].all(), msg
    miss, _, _ = compare(reference_logits(path, toks, layer_groups=False), lc)
    assert np.median(miss) > 3 * MEDIAN_TOL, np.round(miss, 3)


def test_llama_cpp_runs_the_q8_0_file(tmp_path):
    """The matrices Q8_0: llama.cpp runs it within Q8_MEDIAN_TOL of the float reference over the
    dequantized weights, the same argmax where decisive (cflow's engine on it:
    tests/test_gemma4_engine.py)."""
    path = tmp_path / "q8.gguf"
    write_gemma4_gguf(path, seed=0, native=True)
    assert {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}["blk.0.attn_q.weight"] == T.Q8_0
    toks = sequence(seed=30)
    errs, margins, agree = compare(reference_logits(path, toks), llama_cpp_logits(path, toks))
    safe = margins > 0.2
    assert np.median(errs) <= Q8_MEDIAN_TOL and safe.sum() >= 10 and agree[safe].mean() >= 0.95, np.round(errs, 3)


# ---- the vocabulary ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vocab_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma4_vocab") / "m.gguf"
    write_gemma4_gguf(path, seed=0)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    yield path, llm
    llm.close()


def test_vocabulary_type_is_as_stated(vocab_llm):
    """llama.cpp reads "gemma4" as a BPE vocabulary that adds BOS by default, and tokenizes as
    `gemma4_tokenize` (with and without BOS) over the tricky strings, detokenizing back."""
    _, llm = vocab_llm
    tokens = gemma4_vocab()[0]
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    assert llama_cpp.llama_vocab_type(vocab) == llama_cpp.LLAMA_VOCAB_TYPE_BPE
    assert llama_cpp.llama_vocab_get_add_bos(vocab) and not llama_cpp.llama_vocab_get_add_eos(vocab)
    for text in TRICKY:
        theirs = llm.tokenize(text.encode(), add_bos=True, special=False)
        assert theirs == gemma4_tokenize(text), (text, theirs, [tokens[i] for i in theirs])
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == gemma4_tokenize(text, add_bos=False)
        assert detokenize(llama_cpp, llm, theirs, remove_special=True, unparse_special=False) == text


def test_vocabulary_controls(vocab_llm):
    """What makes the type differ from its neighbours, each seen by llama.cpp: spaces escaped (not
    GPT-2's byte alphabet, where " " is "Ġ"), newline runs split off (a merge across them never
    applies), no space prefix, and the byte fallback for characters the vocabulary lacks."""
    _, llm = vocab_llm
    tokens = gemma4_vocab()[0]
    ids = llm.tokenize(b"Hello world", add_bos=False, special=False)
    assert "▁" in "".join(tokens[i] for i in ids) and not tokens[ids[0]].startswith("▁")
    assert all("Ġ" not in tokens[i] for i in ids)
    assert any("\n" in m and m.strip("\n ") for m in gemma4_vocab()[2])  # merges across newlines exist
    ids = llm.tokenize("\n\nNew line here. Ж".encode(), add_bos=False, special=False)
    pieces = [tokens[i] for i in ids]
    assert pieces[0].strip("\n") == "" and all("\n" not in p for p in pieces[1:]), pieces
    assert pieces[-2:] == [byte_token(b) for b in "Ж".encode()], pieces


CHAT = ["Fine,   thanks.\n\nNew line here.", "<|turn>user\nHi there<turn|>\n<|turn>model\n", "<bos>x<eos> <pad>y", "<|turn><|turn>", "Hello\n\n<turn|>"]


def test_cflow_tokenizes_as_llama_cpp(vocab_llm):
    """cflow's reading of the file's "gemma4" vocabulary (cflow.tokenizer_gemma4) gives llama.cpp's ids
    with and without BOS (special tokens written in the text parsed, as cflow always does) over the
    tricky strings and turn markup, and decodes as llama_detokenize."""
    from test_tokenizer_gguf import cflow_from_gguf

    path, llm = vocab_llm
    tok = cflow_from_gguf(path)
    assert tok.model == "gemma4" and tok.add_bos and not tok.add_space_prefix and tok.bos_id == 2
    for text in TRICKY + CHAT:
        for bos in (False, True):
            assert tok.encode(text, add_bos=bos) == llm.tokenize(text.encode(), add_bos=bos, special=True), text
        ids = llm.tokenize(text.encode(), add_bos=True, special=False)
        assert tok.decode(ids) == detokenize(llama_cpp, llm, ids, remove_special=False, unparse_special=True)


@pytest.mark.parametrize("change, match", [
    (dict(merges=[]), "needs its 'merges'"),
    (dict(merges=["▁ zzz"]), "not all tokens"),
    (dict(merges=["▁"]), "not two tokens"),
    (dict(pre="gpt2"), "no 'pre'"),
    (dict(token_types=None), "needs 'token_types'"),
])
def test_bad_gemma4_headers_are_named(vocab_llm, change, match):
    from test_tokenizer_gguf import cflow_from_gguf

    from cflow.tokenizer import Tokenizer, TokenizerError

    header = {**cflow_from_gguf(vocab_llm[0]).to_header(), **change}
    with pytest.raises(TokenizerError, match=match):
        Tokenizer(header)


def test_a_gemma4_vocabulary_without_byte_tokens_is_refused(tmp_path):
    """llama.cpp falls back to <0xXX> tokens for characters outside the vocabulary; without them
    cflow refuses the file by name rather than tokenize differently."""
    from test_tokenizer_gguf import write_vocab_gguf

    from cflow.convert.gguf import gguf_tokenizer
    from cflow.tokenizer import TokenizerError

    tokens, types, merges = gemma4_vocab()
    keep = [i for i, t in enumerate(types) if t != 6]
    path = write_vocab_gguf(tmp_path / "v.gguf", "gemma4", [tokens[i] for i in keep], [types[i] for i in keep],
                            merges=merges)
    with pytest.raises(TokenizerError, match="'gemma4' tokenizer that cflow cannot use.*byte-fallback"):
        gguf_tokenizer(GGUFModel(path))


def test_a_gemma4_vocabulary_survives_conversion(tmp_path):
    """A random one-layer Llama carrying the "gemma4" vocabulary (the vocabulary alone):
    the .cflow keeps the tokenizer, the engine encodes like llama.cpp and streams what it decodes."""
    from test_tokenizer_gguf import write_vocab_gguf

    from cflow.convert.gguf import convert_gguf
    from cflow.runtime import Engine

    tokens, types, merges = gemma4_vocab()
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (len(tokens), 64), "output_norm.weight": (64,), "output.weight": (len(tokens), 64)}
    shapes.update({f"blk.0.{n}.weight": s for n, s in {
        "attn_norm": (64,), "attn_q": (64, 64), "attn_k": (64, 64), "attn_v": (64, 64), "attn_output": (64, 64),
        "ffn_norm": (64,), "ffn_gate": (128, 64), "ffn_up": (128, 64), "ffn_down": (64, 128)}.items()})
    weights = {n: (rng.standard_normal(s) * 0.1 + (len(s) == 1)).astype(np.float32) for n, s in shapes.items()}
    path = write_vocab_gguf(tmp_path / "m.gguf", "gemma4", tokens, types, merges=merges, tensors=weights,
                            extra={"add_bos_token_id": 2, "add_eos_token_id": 1})
    convert_gguf(path, tmp_path / "m.cflow", quant="q8_0")
    eng = Engine.load(tmp_path / "m.cflow", threads=1, n_ctx=64)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        assert eng.tokenizer.model == "gemma4"
        for text in TRICKY + CHAT:
            assert eng.encode(text) == llm.tokenize(text.encode(), add_bos=True, special=True), text
    finally:
        llm.close()
    out = eng.complete("Once upon a time", max_tokens=6, temperature=0.0, ignore_eos=True)
    tok = eng.tokenizer
    assert len(out.tokens) == 6 and out.text == b"".join(
        tok.token_to_bytes(i) for i in out.tokens if not tok.is_special(i)).decode("utf-8", "replace")
