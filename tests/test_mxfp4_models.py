"""MXFP4 GGUF files end to end: the Mixtral-layout MoE of tests/test_convert_gguf_moe.py with its
experts in MXFP4 (as llama.cpp's MXFP4_MOE file type and gpt-oss's files store them: gate, up and
down experts MXFP4, attention and embeddings Q8_0, routers F32), and the same build as a dense
llama whose FFN matrices are MXFP4. gguf.quants quantizes the floats to MXFP4 when the file is
written; from there on nobody re-quantizes:
- cflow converts every MXFP4 tensor bit for bit (each expert's blocks in the file, untiled and
  de-interleaved, equal the GGUF's bytes of that expert) and reports nothing re-quantized;
- the engine, teacher-forced, is held against llama.cpp on the same file and against the float
  reference built from the GGUF's dequantized weights, within test_moe_llamacpp's tolerances
  (both engines round activations to int8 per 32 values before an MXFP4 dot, as for Q4_0);
- prefill (the batched MXFP4 kernels) gives the steps' logits bit for bit;
- experts streamed from disk (the smallest cache the engine takes) give RAM's logits bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.oracle  # compares against llama.cpp (llama-cpp-python)

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="the llama.cpp oracle is not installed: pip install 'llama-cpp-python>=0.3.16'")
gguf = pytest.importorskip("gguf")
pytest.importorskip("torch")

import test_convert_gguf_moe as moe_files  # noqa: E402
from test_convert_gguf_moe import (E, LAYERS, assert_disk_experts_bit_identical, expected_config,  # noqa: E402
                                   expert_blocks, file_blocks, gguf_reference_state, reference_decoder,
                                   teacher_forced, tokens)
from test_moe_llamacpp import check, llama_cpp_logits, private_cache  # noqa: E402,F401 (autouse fixture)

from cflow.convert import convert  # noqa: E402
from cflow.convert.gguf import GGUFModel  # noqa: E402
from cflow.fileformat import open_model  # noqa: E402
from cflow.runtime import Engine  # noqa: E402

T = gguf.GGMLQuantizationType
STEPS = 48
MXFP4_LAYERS = [(T.MXFP4, T.MXFP4, T.F32)] * LAYERS  # (gate and up, down, router) per layer


def write(path, n_experts: int, seed: int) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe_files, "LAYER_TYPES", MXFP4_LAYERS)
        moe_files.write_moe_gguf(path, n_experts=n_experts, d_ff=moe_files.DX if n_experts else 256, seed=seed)


@pytest.fixture(scope="module", params=[0, 1])
def mx(request, tmp_path_factory):
    seed = request.param
    d = tmp_path_factory.mktemp(f"mxfp4moe{seed}")
    src = d / "m.gguf"
    write(src, E, seed)
    result = convert(src, d / "m.cflow")
    toks = tokens(STEPS, seed=20 + seed)
    with Engine.load(d / "m.cflow", threads=2, experts="ram", max_batch=8) as eng:
        got = teacher_forced(eng.step, toks)
    with Engine.load(d / "m.cflow", threads=2, experts="ram", max_batch=8) as eng:
        prefill = np.array(eng.prefill(toks), dtype=np.float64)
    return src, d / "m.cflow", result, toks, got, prefill, llama_cpp_logits(src, toks)


def test_mxfp4_experts_are_copied_bit_for_bit(mx):
    src, dst, result, *_ = mx
    g = GGUFModel(src)
    with open_model(dst, verify=True) as f:
        for i in range(LAYERS):
            b, p = f"blk.{i}.", f"layers.{i}."
            for e in range(E):
                gu, dn = f"{p}moe.experts.{e}.w_gate_up", f"{p}moe.experts.{e}.w_down"
                assert f.tensors[gu].dtype == f.tensors[dn].dtype == "mxfp4"
                gate, up = file_blocks(f, gu)
                assert np.array_equal(gate, expert_blocks(g, b + "ffn_gate_exps.weight", e)), (i, e)
                assert np.array_equal(up, expert_blocks(g, b + "ffn_up_exps.weight", e)), (i, e)
                assert np.array_equal(file_blocks(f, dn)[0], expert_blocks(g, b + "ffn_down_exps.weight", e)), (i, e)
    assert result.report.requantized_weights == 0 and not result.report.notes


def test_engine_matches_llama_cpp(mx):
    *_, got, _, lc = mx
    check(got, lc, moe=True)


def test_engine_matches_the_float_reference(mx):
    src, _, _, toks, got, _, lc = mx
    cfg = expected_config()
    ref = reference_decoder(cfg, gguf_reference_state(src, cfg))
    want = teacher_forced(lambda t, pos: ref.step(t).numpy(), toks)
    check(got, want, moe=True)
    check(lc, want, moe=True)  # llama.cpp reads the same MXFP4 weights: the reference is the file's


def test_prefill_equals_steps(mx):
    *_, got, prefill, _ = mx
    assert np.array_equal(prefill, got[-1])


def test_experts_from_disk_are_bit_identical(mx):
    _, dst, _, toks, got, _, _ = mx
    assert_disk_experts_bit_identical(dst, toks, got, threads=2)


def test_dense_mxfp4_ffn_matches_llama_cpp(tmp_path):
    src = tmp_path / "dense.gguf"
    write(src, 0, seed=4)
    r = convert(src, tmp_path / "dense.cflow")
    assert r.report.requantized_weights == 0
    with open_model(tmp_path / "dense.cflow") as f:
        assert {f.tensors[f"layers.{i}.ffn.{m}"].dtype for i in range(LAYERS) for m in ("w_gate_up", "w_down")} \
            == {"mxfp4"}
    toks = tokens(STEPS, seed=5)
    with Engine.load(tmp_path / "dense.cflow", threads=2) as eng:
        got = teacher_forced(eng.step, toks)
    check(got, llama_cpp_logits(src, toks), moe=False)
