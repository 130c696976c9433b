"""benchmarks/make_gemma4.py: the random Gemma 4 GGUF behind docs/results/gemma4.md is written as asked
(geometry, llama.cpp's gemma4 layout, reproducible bit for bit), converts and runs, and llama.cpp loads
it; bad geometry is refused by flag."""

from __future__ import annotations


import pytest
from bench_scripts import assert_llama_cpp_runs, assert_rewrites_same_bytes, load_benchmark

pytest.importorskip("gguf")
SMALL = ["--layers", "6", "--shared-kv", "3", "--pattern", "3", "--d-model", "128", "--d-ff", "96",
         "--d-ff-shared", "192", "--heads", "4", "--kv-heads", "1", "--head-dim", "64", "--head-dim-local", "32",
         "--per-layer", "32", "--vocab", "300", "--window", "8"]


def make_gemma4():
    return load_benchmark("make_gemma4")


def test_writes_the_geometry_and_runs(tmp_path):
    from cflow.runtime import Engine

    out = tmp_path / "g.gguf"
    assert make_gemma4().main([*SMALL, "--out", str(out)]) == 0
    with Engine.load(out, threads=1) as eng:
        c = eng.config
        assert (c.name, c.n_layers, c.d_model, c.d_ff, c.d_ff_shared_kv, c.n_heads, c.n_kv_heads, c.head_dim,
                c.head_dim_local, c.per_layer_dim, c.shared_kv_layers, c.vocab_size) == (
            "gemma4", 6, 128, 96, 192, 4, 1, 64, 32, 32, 3, 300)
        assert (c.sliding_window, c.sliding_window_pattern, c.logit_softcap) == (8, 3, 30.0)
        logits = eng.step(5, 0).copy()
    assert logits.shape == (300,) and (abs(logits) <= 30).all()
    assert_rewrites_same_bytes(make_gemma4().main, SMALL, out, tmp_path / "again.gguf")
    assert_llama_cpp_runs(out, 300)  # llama.cpp takes the layout and keys


def test_bad_geometry_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        make_gemma4().main([*SMALL, "--shared-kv", "2", "--out", str(tmp_path / "x.gguf")])
    assert e.value.code == 2 and "multiple of --pattern" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        make_gemma4().main([*SMALL, "--per-layer", "48", "--out", str(tmp_path / "x.gguf")])
    assert not (tmp_path / "x.gguf").exists()
