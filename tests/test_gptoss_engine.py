"""gpt-oss through cflow: the converter, the engine and the PyTorch reference (cflow.model), held
against llama.cpp and against each other on tests/test_gptoss.py's random gpt-oss GGUF (MXFP4
experts, Q8_0 attention, embedding and output; biases on q/k/v/o, the router and the experts;
attention sinks; a window of 8 on the even layers; YaRN).

Oracles and tolerances (test_moe_llamacpp's: max|dlogit| / std(logits) per position, median <= 4%,
>= 85% of positions <= 7%, argmax equal where the oracle's margin exceeds 0.2 std):
- llama.cpp (llama-cpp-python 0.3.36, llm_build_openai_moe_iswa) on the same native file,
  teacher-forced over 64 positions: both round every quantized mat-mul's input to int8 per 32
  values, so the engine is held against llama.cpp here, not against a float graph;
- the PyTorch reference over the converted file's dequantized weights (Transformer.from_cflow ->
  ReferenceDecoder, fp32), the same tolerances;
- the PyTorch reference on the all-F32 copy against llama.cpp there, with test_gptoss's tolerances
  for that file (float weights on both sides: median <= 2%).
Controls: the float graph without each feature (sinks, the window, the clamp, the gating) and with
the window one position too short or too long misses the engine by far, so each comparison sees
each feature. The engine's prefill equals its steps, 1 and 2 threads agree bit for bit, the other
kernel tables this CPU has pass the same tests (CFLOW_ISA, a subprocess), the 8-bit KV cache runs
the sinks too, and experts read from disk (sync and async; their biases travel with them) give
RAM's logits bit for bit.
"""

from __future__ import annotations


import numpy as np
import pytest

pytestmark = pytest.mark.oracle

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from isa_runner import other_isas, run_under  # noqa: E402
from test_convert_gguf_moe import (assert_disk_experts_bit_identical, compare, gguf_values,  # noqa: E402
                                   teacher_forced, tokens)
from test_gptoss import (F32_MAX_TOL, F32_MEDIAN_TOL, F32_WITHIN, LAYERS, WINDOW, reference_logits,  # noqa: E402
                         write_gptoss_gguf)
from test_moe_llamacpp import MEDIAN_TOL, check, far, llama_cpp_logits, private_cache  # noqa: E402,F401

from cflow.convert import convert  # noqa: E402
from cflow.convert.gguf import GGUFModel, gguf_config  # noqa: E402
from cflow.fileformat import open_model  # noqa: E402

# Positions teacher-forced, as test_moe_llamacpp's: a route that flips on a near-tie of two router
# logits (the int8 roundings of two engines differ there) changes a few positions after it too, and
# the argmax check needs enough decisive positions to absorb one.
STEPS = 64


def engine_logits(path, toks: list[int], threads: int = 1, **load) -> np.ndarray:
    from cflow.runtime import Engine

    with Engine.load(path, threads=threads, **load) as eng:
        return teacher_forced(eng.step, toks)


def decoder_logits(model, toks: list[int]) -> np.ndarray:
    from cflow.model import ReferenceDecoder

    ref = ReferenceDecoder(model)
    return teacher_forced(lambda t, pos: ref.step(t).numpy(), toks)


def gguf_state(path) -> dict:
    """The PyTorch reference's state dict (cflow.model names) straight from a GGUF's values, not
    through cflow's converter: the reference's own reading of the graph."""
    g = GGUFModel(path)
    cfg = gguf_config(g)
    v = lambda n: torch.from_numpy(np.ascontiguousarray(gguf_values(g, n), dtype=np.float32))  # noqa: E731
    sd = {"tok_emb.weight": v("token_embd.weight"), "norm.weight": v("output_norm.weight"),
          "lm_head.weight": v("output.weight")}
    names = {"attn_norm.weight": "attn_norm.weight", "attn.wq.weight": "attn_q.weight", "attn.wq.bias": "attn_q.bias",
             "attn.wk.weight": "attn_k.weight", "attn.wk.bias": "attn_k.bias", "attn.wv.weight": "attn_v.weight",
             "attn.wv.bias": "attn_v.bias", "attn.wo.weight": "attn_output.weight", "attn.wo.bias": "attn_output.bias",
             "attn.sinks": "attn_sinks.weight", "moe_norm.weight": "post_attention_norm.weight",
             "moe.router.weight": "ffn_gate_inp.weight", "moe.router.bias": "ffn_gate_inp.bias",
             "moe.w_gate": "ffn_gate_exps.weight", "moe.w_up": "ffn_up_exps.weight", "moe.w_down": "ffn_down_exps.weight",
             "moe.b_gate": "ffn_gate_exps.bias", "moe.b_up": "ffn_up_exps.bias", "moe.b_down": "ffn_down_exps.bias"}
    for i in range(cfg.n_layers):
        sd.update({f"layers.{i}.{ours}": v(f"blk.{i}.{theirs}") for ours, theirs in names.items()})
    return cfg, sd


# ---- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[0, 1])
def native(request, tmp_path_factory):
    """(seed, gguf path, cflow path, tokens, engine logits) of the native layout."""
    seed = request.param
    d = tmp_path_factory.mktemp(f"gptoss_native{seed}")
    src, dst = d / "m.gguf", d / "m.cflow"
    write_gptoss_gguf(src, seed)
    convert(src, dst)
    toks = tokens(STEPS, seed=30 + seed)
    return seed, src, dst, toks, engine_logits(dst, toks)


@pytest.fixture(scope="module")
def llama_run(native):
    _, src, _, toks, _ = native
    return llama_cpp_logits(src, toks)


@pytest.fixture(scope="module")
def reference_run(native):
    from cflow.model import Transformer

    *_, dst, toks, _ = native
    model = Transformer.from_cflow(dst)
    return model, decoder_logits(model, toks)


# ---- import ----------------------------------------------------------------------------------
def test_config_and_tensors(native):
    _, src, dst, _, _ = native
    cfg = gguf_config(GGUFModel(src))
    assert cfg.name == "gpt-oss" and cfg.d_ff == 0 and cfg.qkv_bias and cfg.head_dim == 64
    assert (cfg.attn_sinks, cfg.attn_out_bias, cfg.moe_bias) == (True, True, True)
    assert (cfg.moe_gating, cfg.expert_act, cfg.moe_input) == ("softmax_topk", "swiglu_oai", "post_attn")
    assert cfg.sliding_window == WINDOW and cfg.sliding_window_pattern == 2
    assert [cfg.is_local(layer) for layer in range(LAYERS)] == [True, False, True, False]  # il % 2 == 0
    assert cfg.rope_mscale == pytest.approx(1 + 0.1 * np.log(32.0))  # YaRN's magnitude, factor 32
    f = open_model(dst)
    assert f.config == cfg
    t = f.tensors
    assert t["layers.0.moe.experts.3.w_gate_up"].dtype == "mxfp4" and t["layers.0.attn.wqkv"].dtype == "q8_0"
    for name, shape in (("layers.1.attn.sinks", (4,)), ("layers.1.attn.wo_bias", (128,)),
                        ("layers.1.moe.router_bias", (4,)), ("layers.1.moe.experts.2.b_gate_up", (192,)),
                        ("layers.1.moe.experts.2.b_down", (128,))):
        assert t[name].dtype == "f32" and tuple(t[name].shape) == shape, name
    # an expert's biases lie inside its span of the file: they travel with it to disk
    off, n = f.experts[(1, 2)]
    for name in ("w_gate_up", "w_down", "b_gate_up", "b_down"):
        e = t[f"layers.1.moe.experts.2.{name}"]
        assert off <= e.offset and e.offset + e.nbytes <= off + n, name
    f.close()


# ---- engine vs the oracles -------------------------------------------------------------------
def test_engine_matches_llama_cpp(native, llama_run):
    check(native[4], llama_run, moe=True)


def test_engine_matches_reference(native, reference_run):
    check(native[4], reference_run[1], moe=True)


def test_whole_sequence_reference_matches_the_decoder(native, reference_run):
    """Transformer.forward (whole sequence: the sinks and the window as masks) equals the
    step-by-step ReferenceDecoder."""
    model, dec = reference_run
    with torch.no_grad():
        whole = model(torch.tensor([native[3]]))[0][0].double().numpy()
    assert np.abs(whole - dec).max() / dec.std() < 1e-4


def test_reference_matches_llama_cpp_on_the_f32_copy(tmp_path):
    """cflow.model on the all-F32 file (weights read from the GGUF directly) against llama.cpp
    there: float weights on both sides, test_gptoss's tolerances for that file."""
    from cflow.model import Transformer

    path = tmp_path / "f32.gguf"
    write_gptoss_gguf(path, seed=0, native=False)
    toks = tokens(STEPS, seed=30)
    cfg, sd = gguf_state(path)
    errs, margins, agree = compare(decoder_logits(Transformer.from_state(cfg, sd), toks), llama_cpp_logits(path, toks))
    msg = f"max|dlogit|/std per position: {np.round(errs, 4)}"
    assert np.median(errs) <= F32_MEDIAN_TOL and np.mean(errs <= F32_MAX_TOL) >= F32_WITHIN, msg
    assert agree[margins > 0.2].all(), msg


@pytest.mark.parametrize("drop", ["sinks", "window", "clamp", "softmax_topk"])
def test_engine_misses_the_graph_without_a_feature(native, drop):
    """The float graph without one feature misses the engine by far (the engine is within
    tolerance of the graph with it: test_engine_matches_reference)."""
    _, src, _, toks, got = native
    assert far(got, reference_logits(src, toks, **{drop: False})), drop


@pytest.mark.parametrize("span", [WINDOW - 1, WINDOW + 1])
def test_window_boundary(native, reference_run, span):
    """A key at distance >= WINDOW is out, one at WINDOW - 1 in (llama.cpp's is_masked_swa): a
    window one position shorter or longer agrees before it binds and misses after."""
    _, src, _, toks, got = native
    off = reference_logits(src, toks, span=span)
    errs = compare(got, off)[0]
    assert np.median(errs[:span - 1]) <= MEDIAN_TOL, np.round(errs, 3)
    assert np.median(errs[WINDOW + 1:]) > 3 * MEDIAN_TOL, np.round(errs, 3)


# ---- the engine's own consistency --------------------------------------------------------------
def test_prefill_equals_steps(native):
    """Prefill (block attention with sinks, batched kernels, the swiglu_oai experts over gathered
    rows) and batched rows equal the steps, across the window and both kinds of layer."""
    from test_engine import rel_err

    from cflow.runtime import Engine

    *_, dst, toks, got = native
    with Engine.load(dst, threads=2, max_batch=7) as eng:
        for n in (WINDOW - 1, WINDOW + 3, STEPS):
            assert rel_err(eng.prefill(toks[:n]), got[n - 1]) < 1e-5, n
    with Engine.load(dst, threads=2, n_seq=2) as two:
        two.prefill(toks[:20], seq=0)
        rows = two.step_rows([0, 0, 1], [toks[20], toks[21], toks[0]], [20, 21, 0])
    assert rel_err(rows[1], got[21]) < 1e-5 and rel_err(rows[2], got[0]) < 1e-5


def test_threads_agree(native):
    *_, dst, toks, got = native
    np.testing.assert_array_equal(engine_logits(dst, toks[:12], threads=2), got[:12])


def test_q8_kv_cache(native):
    """The 8-bit KV cache through the engine (its kernels' sinks: tests/test_attention_sinks.py):
    close to the fp16 cache's logits (median <= 2x MEDIAN_TOL: its int8 rounding of K and V joins
    the activations'; measured 4.5-4.7%), far from the graph without sinks, and its prefill equals
    its steps."""
    from test_engine import rel_err

    from cflow.runtime import Engine

    *_, dst, toks, fp16 = native
    kv = dict(cache_type_k="q8_0", cache_type_v="q8_0")
    got = engine_logits(dst, toks, **kv)
    errs = compare(got, fp16)[0]
    assert np.median(errs) <= 2 * MEDIAN_TOL, np.round(errs, 3)
    assert far(got, reference_logits(native[1], toks, sinks=False))
    with Engine.load(dst, threads=2, max_batch=16, **kv) as eng:
        assert rel_err(eng.prefill(toks), got[-1]) < 1e-5


def test_experts_from_disk_are_bit_identical(native):
    *_, dst, toks, got = native
    assert_disk_experts_bit_identical(dst, toks, got)


# ---- every kernel table ------------------------------------------------------------------------
ISA_TESTS = [f"tests/test_gptoss_engine.py::{t}" for t in ("test_engine_matches_reference", "test_prefill_equals_steps",
                                                          "test_q8_kv_cache")]


@pytest.mark.parametrize("isa", other_isas())
def test_every_other_kernel_table(isa):
    run_under(isa, ISA_TESTS, 2 * len(ISA_TESTS))
