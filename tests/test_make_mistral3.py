"""benchmarks/make_mistral3.py: the random Ministral 3 GGUF behind docs/results/mistral3.md is written as
asked (geometry, the mistral3 keys, reproducible bit for bit), converts with its YaRN and temperature,
runs, and llama.cpp loads it."""

from __future__ import annotations


import numpy as np
import pytest
from bench_scripts import assert_llama_cpp_runs, assert_rewrites_same_bytes, load_benchmark

pytest.importorskip("gguf")
SMALL = ["--layers", "2", "--d-model", "256", "--d-ff", "320", "--heads", "4", "--kv-heads", "2", "--head-dim", "96",
         "--vocab", "300"]


def make_mistral3():
    return load_benchmark("make_mistral3")


def test_writes_the_geometry_and_runs(tmp_path):
    from cflow.runtime import Engine

    out = tmp_path / "m.gguf"
    assert make_mistral3().main([*SMALL, "--out", str(out)]) == 0
    with Engine.load(out, threads=1) as eng:
        c = eng.config
        assert (c.name, c.n_layers, c.d_model, c.d_ff, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size) == (
            "mistral3", 2, 256, 320, 4, 2, 96, 300)
        assert (c.rope_theta, c.attn_temp_scale, c.attn_temp_floor) == (1e6, np.float32(0.1), 16384)
        assert c.rope_mscale == 1.0 and len(c.rope_freq_factors) == 48  # log multiplier 1: YaRN's magnitude cancels
        logits = eng.step(5, 0).copy()
    assert logits.shape == (300,) and (abs(logits) < 1e4).all()
    assert_rewrites_same_bytes(make_mistral3().main, SMALL, out, tmp_path / "again.gguf")
    assert_llama_cpp_runs(out, 300)  # llama.cpp takes the layout and keys
