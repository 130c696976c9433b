"""benchmarks/make_deepseek2.py: the random deepseek2 GGUF behind docs/results/deepseek2.md is written
as asked (geometry, llama.cpp's deepseek2 layout, reproducible bit for bit), converts and runs, and
llama.cpp loads it; bad geometry is refused by flag."""

from __future__ import annotations


import pytest
from bench_scripts import assert_llama_cpp_runs, assert_rewrites_same_bytes, load_benchmark

pytest.importorskip("gguf")
SMALL = ["--layers", "3", "--dense-layers", "1", "--d-model", "256", "--heads", "4", "--q-lora", "64",
         "--kv-lora", "64", "--qk-nope", "32", "--qk-rope", "16", "--v-head", "32", "--d-ff", "320",
         "--experts", "8", "--top-k", "2", "--d-expert", "64", "--shared", "1", "--groups", "4", "--groups-used", "2",
         "--vocab", "300"]


def make_deepseek2():
    return load_benchmark("make_deepseek2")


def test_writes_the_geometry_and_runs(tmp_path):
    from cflow.runtime import Engine

    out = tmp_path / "d.gguf"
    assert make_deepseek2().main([*SMALL, "--out", str(out)]) == 0
    with Engine.load(out, threads=1) as eng:
        c = eng.config
        assert (c.name, c.n_layers, c.n_dense_lead, c.d_model, c.n_heads, c.q_lora_rank, c.kv_lora_rank,
                c.head_dim, c.qk_rope_dim, c.v_head_dim, c.d_ff, c.vocab_size) == (
            "deepseek2", 3, 1, 256, 4, 64, 64, 48, 16, 32, 320, 300)
        assert (c.n_experts, c.top_k, c.d_expert, c.d_shared_expert, c.moe_groups, c.moe_groups_used,
                c.moe_gating, c.moe_router_bias) == (8, 2, 64, 64, 4, 2, "sigmoid", True)
        logits = eng.step(5, 0).copy()
    assert logits.shape == (300,) and (abs(logits) < 1e4).all()
    assert_rewrites_same_bytes(make_deepseek2().main, SMALL, out, tmp_path / "again.gguf")
    assert_llama_cpp_runs(out, 300)  # llama.cpp takes the layout and keys


def test_bad_geometry_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        make_deepseek2().main([*SMALL, "--kv-lora", "50", "--out", str(tmp_path / "x.gguf")])
    assert e.value.code == 2 and "multiple of 32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        make_deepseek2().main([*SMALL, "--groups", "3", "--out", str(tmp_path / "x.gguf")])
    with pytest.raises(SystemExit):
        make_deepseek2().main([*SMALL, "--dense-layers", "3", "--out", str(tmp_path / "x.gguf")])
    assert not (tmp_path / "x.gguf").exists()
