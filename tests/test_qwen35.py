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

The graph (`reference_logits`) is cflow.model_qwen35's, the package's float reference (its module
docstring has the equations, as llama.cpp 0.3.36 computes them); this file holds it to llama.cpp.
The MoE keys: expert_count, expert_used_count, expert_feed_forward_length,
expert_shared_feed_forward_length.

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
from test_convert_gguf_moe import compare, tokens  # noqa: E402
from test_moe_llamacpp import MEDIAN_TOL, llama_cpp_logits, private_cache  # noqa: E402,F401

from cflow.model_qwen35 import reference_logits  # noqa: E402

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
