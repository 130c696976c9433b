"""benchmarks/make_gemma3.py: the random Gemma 3 GGUF behind docs/results/gemma3.md is written as asked
(geometry, llama.cpp's gemma3 layout, reproducible bit for bit), converts and runs, and llama.cpp loads
it; bad geometry is refused by flag."""

from __future__ import annotations


import pytest
from bench_scripts import assert_llama_cpp_runs, assert_rewrites_same_bytes, load_benchmark

pytest.importorskip("gguf")
SMALL = ["--layers", "7", "--d-model", "256", "--d-ff", "320", "--heads", "4", "--kv-heads", "1", "--head-dim", "96",
         "--vocab", "300", "--window", "8"]


def make_gemma3():
    return load_benchmark("make_gemma3")


def test_writes_the_geometry_and_runs(tmp_path):
    from cflow.runtime import Engine

    out = tmp_path / "g.gguf"
    assert make_gemma3().main([*SMALL, "--out", str(out)]) == 0
    with Engine.load(out, threads=1) as eng:
        c = eng.config
        assert (c.name, c.n_layers, c.d_model, c.d_ff, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size) == (
            "gemma3", 7, 256, 320, 4, 1, 96, 300)
        assert (c.sliding_window, c.sliding_window_pattern, c.post_norms, c.ffn_act) == (8, 6, True, "gelu_tanh")
        assert [c.is_local(layer) for layer in range(7)] == [True] * 5 + [False, True]
        logits = eng.step(5, 0).copy()
    assert logits.shape == (300,) and (abs(logits) < 1e4).all()
    assert_rewrites_same_bytes(make_gemma3().main, SMALL, out, tmp_path / "again.gguf")
    assert_llama_cpp_runs(out, 300)  # llama.cpp takes the layout and keys


def test_bad_geometry_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        make_gemma3().main(["--d-model", "250", "--out", str(tmp_path / "x.gguf")])
    assert e.value.code == 2 and "multiples of 32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        make_gemma3().main(["--heads", "4", "--kv-heads", "3", "--out", str(tmp_path / "x.gguf")])
    assert not (tmp_path / "x.gguf").exists()
