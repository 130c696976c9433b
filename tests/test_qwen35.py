"""Qwen3.5 (`general.architecture` = "qwen35") as llama.cpp runs it, pinned down before cflow's
engine learns it: a random-weight qwen35 GGUF in llama.cpp's exact layout at small geometry, a
float reference of the graph written from llama.cpp's qwen35 builder (src/models/qwen35.cpp and
the gated delta net of src/models/delta-net-base.cpp), the two held against each other
teacher-forced, and controls that drop one feature each and must miss.

The file (`write_qwen35_gguf`): layer il is full attention when (il + 1) % full_attention_interval
== 0, a Gated DeltaNet ("linear attention") layer otherwise. Every layer: attn_norm,
post_attention_norm (the norm before the FFN), a dense SwiGLU ffn_{gate,up,down}.
- linear layers: attn_qkv [2*Hk*dk + Hv*dv, d] (q | k | v rows, the conv's channels),
  attn_gate [Hv*dv, d] (z, the output gate), ssm_conv1d [conv_dim, d_conv] (depthwise, no bias),
  ssm_alpha [Hv, d], ssm_dt.bias [Hv], ssm_a [Hv] (= -exp(A_log): stored negative, no ".weight"),
  ssm_beta [Hv, d], ssm_norm [dv], ssm_out [d, Hv*dv];
- full layers: attn_q [H * 2*hd, d] (per head hd query rows then hd gate rows), attn_k, attn_v
  [Hkv*hd, d], attn_q_norm / attn_k_norm [hd], attn_output [d, H*hd].
Metadata: qwen35.ssm.{conv_kernel, inner_size (= Hv*dv), state_size (= dk = dv), time_step_rank
(= Hv), group_count (= Hk)}, qwen35.full_attention_interval, qwen35.rope.dimension_sections,
rope.dimension_count (the rotated dims: partial RoPE), attention.key_length / value_length
(qwen35moe.* the same).

The graph (`reference_logits`; the delta-net layer in tests/deltanet_reference.py), as
llama.cpp 0.3.36 computes it, per layer x += mix(rms(x) *
attn_norm); x += ffn(rms(x) * post_attention_norm), with mix one of:
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
  causal softmax(q k^T / sqrt(hd)), head
  h reading kv head h // (H/Hkv); o = attn * sigmoid(gate); mix = W_o o.
The FFN: SwiGLU W_down (silu(W_gate h) * W_up h) in qwen35; in qwen35moe (`moe_ffn`) the router's
softmax over all E logits (ffn_gate_inp [E, d]), the top-k of it renormalised to sum 1, SwiGLU
experts ffn_{gate,up}_exps [E, d_exp, d], ffn_down_exps [E, d, d_exp], plus a shared SwiGLU
expert ffn_{gate,up,down}_shexp scaled by sigmoid(ffn_gate_inp_shexp . h) (a [d] vector: one
gate per token); keys expert_count, expert_used_count, expert_feed_forward_length,
expert_shared_feed_forward_length. Then the final RMSNorm and the output matrix.

The oracle is checked on the all-F32 file (llama.cpp then runs float weights on float
activations); each control misses by far (see test_each_feature_matters). cflow's converter and
engine run these files: tests/test_qwen35_engine.py.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.oracle  # compares against llama.cpp (llama-cpp-python)

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="the llama.cpp oracle is not installed: pip install 'llama-cpp-python>=0.3.16'")
gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from test_convert_gguf import add_tensor, add_tiny_tokenizer, tiny_vocab  # noqa: E402
from test_convert_gguf_moe import compare, gguf_values, tokens  # noqa: E402
from test_moe_llamacpp import MEDIAN_TOL, llama_cpp_logits, private_cache  # noqa: E402,F401

from cflow.convert.gguf import GGUFModel  # noqa: E402
from cflow.model import apply_rope, rope_cos_sin  # noqa: E402
from deltanet_reference import delta_net as gated_delta_net, rms_norm  # noqa: E402

T = gguf.GGMLQuantizationType
D, LAYERS, F, INTERVAL = 128, 4, 192, 2
HEADS, KV_HEADS, HD, N_ROT = 4, 2, 32, 16  # full attention: partial RoPE over 16 of 32 dims
SECTIONS = [3, 3, 2, 0]  # M-RoPE sections (pairs), summing to N_ROT / 2 as Qwen3.5's [11, 11, 10, 0] do
HK, HV, DS, KCONV = 2, 4, 32, 4  # delta net: 2 q/k heads, 4 v heads, head dims 32, conv over 4 tokens
KEY_DIM, VALUE_DIM = HK * DS, HV * DS
CONV_DIM = 2 * KEY_DIM + VALUE_DIM
E, TOP_K, FX, FS = 8, 2, 64, 96  # qwen35moe: 8 experts of width 64, 2 used, a shared expert of width 96
CTX, THETA, EPS = 256, 10000.0, 1e-6
STEPS = 40
PREFILL = 100
# Tolerances as tests/test_gptoss.py's on its all-F32 file: median max|dlogit|/std <= 2%, >= 95%
# of positions <= 4% (llama.cpp keeps the full layers' K/V in fp16; the rest is float32). Measured
# (llama-cpp-python 0.3.36, AVX-512, seeds 0 and 1, 40 positions): qwen35 median 0.04%, max 0.11%,
# 0.03% and 0.27% through llama.cpp's one-call prefill of 100 positions; qwen35moe median 0.04%,
# max 0.15%; the controls miss by 60-400% (median).
F32_MEDIAN_TOL, F32_MAX_TOL, F32_WITHIN = 0.02, 0.04, 0.95


def is_full_attention(il: int) -> bool:
    """llama.cpp's layer pattern: every INTERVAL-th layer, counted from 1, is full attention."""
    return (il + 1) % INTERVAL == 0


def qwen35_weights(seed: int, moe: bool = False, scale: float = 1.0) -> dict[str, np.ndarray]:
    """Float weights under GGUF names (numpy order), sized so every feature moves the logits:
    decays exp(g) spread over ~0.2-0.95, betas over ~0.1-0.9, attention gates over (0, 1); with
    moe, qwen35moe's FFN (router, experts, the shared expert and its gate) instead of the dense.
    `scale` multiplies every projection's gain (not the embedding's or the conv's): below 1, the
    int8 rounding of the projections' inputs amplifies less (tests/test_qwen35_engine.py)."""
    rng = np.random.default_rng(seed)
    V = len(tiny_vocab())

    def mat(*shape, gain=1.0):
        return (rng.standard_normal(shape) * gain * scale / np.sqrt(shape[-1])).astype(np.float32)

    def vec(n, scale, mean=0.0):
        return (mean + rng.standard_normal(n) * scale).astype(np.float32)

    w = {"token_embd.weight": mat(V, D, gain=np.sqrt(D) / scale), "output_norm.weight": 1 + vec(D, 0.1),
         "output.weight": mat(V, D, gain=4.0)}
    for i in range(LAYERS):
        b = f"blk.{i}."
        w.update({b + "attn_norm.weight": 1 + vec(D, 0.1), b + "post_attention_norm.weight": 1 + vec(D, 0.1)})
        if moe:
            w.update({b + "ffn_gate_inp.weight": mat(E, D, gain=2.0),
                      b + "ffn_gate_exps.weight": mat(E, FX, D, gain=2.0), b + "ffn_up_exps.weight": mat(E, FX, D, gain=2.0),
                      b + "ffn_down_exps.weight": mat(E, D, FX, gain=1.5),
                      b + "ffn_gate_inp_shexp.weight": mat(D, gain=1.5),
                      b + "ffn_gate_shexp.weight": mat(FS, D, gain=2.0), b + "ffn_up_shexp.weight": mat(FS, D, gain=2.0),
                      b + "ffn_down_shexp.weight": mat(D, FS, gain=1.5)})
        else:
            w.update({b + "ffn_gate.weight": mat(F, D, gain=2.0), b + "ffn_up.weight": mat(F, D, gain=2.0),
                      b + "ffn_down.weight": mat(D, F)})
        if is_full_attention(i):
            w.update({b + "attn_q.weight": mat(HEADS * 2 * HD, D, gain=2.0),
                      b + "attn_k.weight": mat(KV_HEADS * HD, D, gain=2.0),
                      b + "attn_v.weight": mat(KV_HEADS * HD, D, gain=2.0),
                      b + "attn_q_norm.weight": 1 + vec(HD, 0.2), b + "attn_k_norm.weight": 1 + vec(HD, 0.2),
                      b + "attn_output.weight": mat(D, HEADS * HD, gain=2.0)})
        else:
            w.update({b + "attn_qkv.weight": mat(CONV_DIM, D, gain=2.0), b + "attn_gate.weight": mat(VALUE_DIM, D, gain=2.0),
                      b + "ssm_conv1d.weight": mat(CONV_DIM, KCONV, gain=1.5 / scale),
                      b + "ssm_alpha.weight": mat(HV, D, gain=1.0), b + "ssm_dt.bias": vec(HV, 0.5),
                      b + "ssm_a": -np.exp(vec(HV, 0.3, mean=-0.5)).astype(np.float32),
                      b + "ssm_beta.weight": mat(HV, D, gain=1.5),
                      b + "ssm_norm.weight": 1 + vec(DS, 0.2), b + "ssm_out.weight": mat(D, VALUE_DIM, gain=2.0)})
    return w


def write_qwen35_gguf(path, seed: int = 0, quant=None, moe: bool = False, scale: float = 1.0,
                      quant_embedding: bool = False) -> None:
    """The qwen35 (or with moe, qwen35moe) file of one weight seed, every tensor F32, or with
    `quant` (a GGML type) for the matrices llama.cpp quantizes (projections and experts, not the
    conv, norms or per-head vectors; the token embedding too with quant_embedding). `scale`: as
    qwen35_weights'."""
    arch = "qwen35moe" if moe else "qwen35"
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_name(f"tiny-{arch}")
    wr.add_block_count(LAYERS)
    wr.add_context_length(CTX)
    wr.add_embedding_length(D)
    wr.add_feed_forward_length(FS if moe else F)
    if moe:
        wr.add_expert_count(E)
        wr.add_expert_used_count(TOP_K)
        wr.add_expert_feed_forward_length(FX)
        wr.add_expert_shared_feed_forward_length(FS)
    wr.add_head_count(HEADS)
    wr.add_head_count_kv(KV_HEADS)
    wr.add_key_length(HD)
    wr.add_value_length(HD)
    wr.add_rope_dimension_count(N_ROT)
    wr.add_rope_dimension_sections(SECTIONS)
    wr.add_rope_freq_base(THETA)
    wr.add_layer_norm_rms_eps(EPS)
    wr.add_ssm_conv_kernel(KCONV)
    wr.add_ssm_inner_size(VALUE_DIM)
    wr.add_ssm_state_size(DS)
    wr.add_ssm_time_step_rank(HV)
    wr.add_ssm_group_count(HK)
    wr.add_full_attention_interval(INTERVAL)
    add_tiny_tokenizer(wr)
    for name, x in qwen35_weights(seed, moe, scale).items():
        quantized = (quant is not None and x.ndim >= 2 and "conv1d" not in name
                     and ("token_embd" not in name or quant_embedding))
        add_tensor(wr, name, x, quant if quantized else T.F32)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, w, EPS)


def delta_net(v, b: str, h: torch.Tensor, **drop) -> torch.Tensor:
    """The Gated DeltaNet mix of the module docstring (deltanet_reference.delta_net) at this
    file's eps; `drop` names the features a control leaves out."""
    return gated_delta_net(v, b, h, EPS, **drop)


def full_attention(v, b: str, h: torch.Tensor, gate=True, partial_rope=True) -> torch.Tensor:
    """The gated full-attention mix of the module docstring over h [n, d]."""
    n = h.shape[0]
    qg = (h @ v(b + "attn_q.weight").T).view(n, HEADS, 2 * HD)
    q, gt = qg[..., :HD], qg[..., HD:]
    k = (h @ v(b + "attn_k.weight").T).view(n, KV_HEADS, HD)
    vv = (h @ v(b + "attn_v.weight").T).view(n, KV_HEADS, HD)
    q, k = rms(q, v(b + "attn_q_norm.weight")), rms(k, v(b + "attn_k_norm.weight"))
    q, k, vv = q.transpose(0, 1), k.transpose(0, 1), vv.transpose(0, 1)  # [heads, n, hd]
    rot = N_ROT if partial_rope else HD
    cos, sin = rope_cos_sin(n, rot, THETA)
    q = torch.cat([apply_rope(q[..., :rot], cos.double(), sin.double()), q[..., rot:]], -1)
    k = torch.cat([apply_rope(k[..., :rot], cos.double(), sin.double()), k[..., rot:]], -1)
    rep = HEADS // KV_HEADS
    k, vv = k.repeat_interleave(rep, 0), vv.repeat_interleave(rep, 0)  # head h reads kv head h // rep
    s = q @ k.transpose(1, 2) / np.sqrt(HD)
    pos = torch.arange(n)
    s = s.masked_fill(~(pos[None, :] <= pos[:, None]), float("-inf"))
    o = (torch.softmax(s, -1) @ vv).transpose(0, 1)  # [n, heads, hd]
    if gate:
        o = o * torch.sigmoid(gt)
    return o.reshape(n, HEADS * HD) @ v(b + "attn_output.weight").T


def moe_ffn(v, b: str, h: torch.Tensor, norm_topk=True, shared=True, shared_gate=True) -> torch.Tensor:
    """qwen35moe's FFN of the module docstring over h [n, d]."""
    probs = torch.softmax(h @ v(b + "ffn_gate_inp.weight").T, -1)  # [n, E]
    top = probs.topk(TOP_K, dim=-1)
    wts = top.values / top.values.sum(-1, keepdim=True) if norm_topk else top.values
    wg, wu, wd = v(b + "ffn_gate_exps.weight"), v(b + "ffn_up_exps.weight"), v(b + "ffn_down_exps.weight")
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(TOP_K):
            e = int(top.indices[t, j])
            out[t] += wts[t, j] * (wd[e] @ (torch.nn.functional.silu(wg[e] @ h[t]) * (wu[e] @ h[t])))
    if shared:
        sh = torch.nn.functional.silu(h @ v(b + "ffn_gate_shexp.weight").T) * (h @ v(b + "ffn_up_shexp.weight").T)
        sh = sh @ v(b + "ffn_down_shexp.weight").T
        if shared_gate:
            sh = sh * torch.sigmoid(h @ v(b + "ffn_gate_inp_shexp.weight"))[:, None]
        out = out + sh
    return out


def reference_logits(path, toks: list[int], pattern=True, gate=True, partial_rope=True, norm_topk=True,
                     shared=True, shared_gate=True, **dnet) -> np.ndarray:
    """[n, V] logits of the graph in the module docstring (float64), from the GGUF's weights; the
    flags drop one feature each (the controls). pattern=False runs the blocks as if the full
    attention layers came first in each group (blocks 1, 0, 3, 2): a wrong layer pattern."""
    g = GGUFModel(path)
    moe = g.architecture == "qwen35moe"
    v = lambda n: torch.from_numpy(gguf_values(g, n).astype(np.float64))  # noqa: E731
    x = v("token_embd.weight")[torch.tensor(toks)]
    order = list(range(LAYERS)) if pattern else [i ^ 1 for i in range(LAYERS)]
    for i in order:
        b = f"blk.{i}."
        h = rms(x, v(b + "attn_norm.weight"))
        if is_full_attention(i):
            x = x + full_attention(v, b, h, gate=gate, partial_rope=partial_rope)
        else:
            x = x + delta_net(v, b, h, **dnet)
        h = rms(x, v(b + "post_attention_norm.weight"))
        if moe:
            x = x + moe_ffn(v, b, h, norm_topk=norm_topk, shared=shared, shared_gate=shared_gate)
            continue
        ffn = torch.nn.functional.silu(h @ v(b + "ffn_gate.weight").T) * (h @ v(b + "ffn_up.weight").T)
        x = x + ffn @ v(b + "ffn_down.weight").T
    return (rms(x, v("output_norm.weight")) @ v("output.weight").T).numpy()


@pytest.fixture(scope="module", params=[0, 1])
def q35(request, tmp_path_factory):
    """The all-F32 file of one weight seed and llama.cpp's teacher-forced logits on it."""
    seed = request.param
    path = tmp_path_factory.mktemp(f"qwen35_{seed}") / "m.gguf"
    write_qwen35_gguf(path, seed)
    toks = tokens(STEPS, seed=50 + seed)
    return path, toks, llama_cpp_logits(path, toks)


@pytest.fixture(scope="module", params=[0, 1])
def q35moe(request, tmp_path_factory):
    """The all-F32 qwen35moe file of one weight seed and llama.cpp's teacher-forced logits on it."""
    seed = request.param
    path = tmp_path_factory.mktemp(f"qwen35moe_{seed}") / "m.gguf"
    write_qwen35_gguf(path, seed, moe=True)
    toks = tokens(STEPS, seed=60 + seed)
    return path, toks, llama_cpp_logits(path, toks)


def llama_cpp_prefill_logits(path, toks: list[int]) -> np.ndarray:
    """[n, V] logits from one llama_decode of the whole sequence (llama.cpp's prefill: its chunked
    parallel form of the delta rule rather than the token-by-token recurrence)."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, logits_all=True, n_threads=1, n_threads_batch=1,
                          verbose=False)
    try:
        llm.eval(toks)
        return np.array(llm.scores[:len(toks)], dtype=np.float64)
    finally:
        llm.close()


def assert_matches(got: np.ndarray, want: np.ndarray) -> None:
    errs, margins, agree = compare(got, want)
    msg = f"max|dlogit|/std per position: {np.round(errs, 4)}"
    assert np.median(errs) <= F32_MEDIAN_TOL and np.mean(errs <= F32_MAX_TOL) >= F32_WITHIN, msg
    assert agree[margins > 0.2].all(), msg


def test_reference_matches_llama_cpp(q35):
    path, toks, lc = q35
    assert_matches(reference_logits(path, toks), lc)


def test_reference_matches_llama_cpp_prefill(q35):
    """The recurrence the reference steps is what llama.cpp's one-call prefill computes too, over
    PREFILL positions: more than one of its 64-row chunks of the delta rule's parallel form."""
    path, _, _ = q35
    toks = tokens(PREFILL, seed=70)
    assert_matches(reference_logits(path, toks), llama_cpp_prefill_logits(path, toks))


def test_moe_reference_matches_llama_cpp(q35moe):
    path, toks, lc = q35moe
    assert_matches(reference_logits(path, toks), lc)


@pytest.mark.parametrize("drop", ["norm_topk", "shared", "shared_gate"])
def test_each_moe_feature_matters(q35moe, drop):
    """qwen35moe's FFN without the top-k renormalisation, the shared expert, or its sigmoid gate
    misses llama.cpp by far."""
    path, toks, lc = q35moe
    errs, _, _ = compare(reference_logits(path, toks, **{drop: False}), lc)
    assert np.median(errs) > 3 * MEDIAN_TOL, (drop, np.round(errs, 3))


@pytest.mark.parametrize("drop", ["conv", "decay", "beta", "l2", "tiled", "gated_norm", "gate", "partial_rope",
                                  "pattern"])
def test_each_feature_matters(q35, drop):
    """Without any one of the features the reference misses llama.cpp by far (median error over
    3x test_moe_llamacpp's tolerance): the file exercises each, and the oracle sees each."""
    path, toks, lc = q35
    errs, _, _ = compare(reference_logits(path, toks, **{drop: False}), lc)
    assert np.median(errs) > 3 * MEDIAN_TOL, (drop, np.round(errs, 3))


@pytest.mark.parametrize("moe", [False, True], ids=["qwen35", "qwen35moe"])
def test_llama_cpp_runs_a_quantized_copy(tmp_path, moe):
    """The same graph with its projections in Q8_0 (what a shipped file quantizes): llama.cpp loads
    and runs it. (The float reference is not held to it: llama.cpp rounds every quantized mat-mul's
    input to int8 per 32 values, which this file's gains amplify to ~11% of the logits' std,
    median, over 16 positions; cflow's engine, which rounds the same way, is the one to compare
    with llama.cpp on such a file: tests/test_qwen35_engine.py.)"""
    path = tmp_path / "q8.gguf"
    write_qwen35_gguf(path, seed=0, quant=T.Q8_0, moe=moe)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.attn_qkv.weight"] == T.Q8_0 and types["blk.1.attn_q.weight"] == T.Q8_0
    assert types["blk.0.ssm_conv1d.weight"] == T.F32
    assert (types.get("blk.0.ffn_gate_exps.weight") == T.Q8_0) == moe
    toks = tokens(16, seed=3)
    lc = llama_cpp_logits(path, toks)
    assert lc.shape == (len(toks), len(tiny_vocab())) and np.isfinite(lc).all()
