"""benchmarks/make_qwen35.py: the random qwen35 / qwen35moe GGUFs behind docs/results/qwen35.md are
written as asked (geometry, llama.cpp's qwen35 layout, reproducible bit for bit), convert and run,
and llama.cpp loads them; bad geometry is refused by flag."""

from __future__ import annotations

import pytest
from bench_scripts import assert_llama_cpp_runs, assert_rewrites_same_bytes, load_benchmark

pytest.importorskip("gguf")
COMMON = ["--layers", "4", "--interval", "2", "--d-model", "128", "--heads", "4", "--kv-heads", "2",
          "--head-dim", "32", "--ssm-k-heads", "2", "--ssm-v-heads", "4", "--ssm-head-dim", "32", "--conv", "4",
          "--vocab", "300"]
DENSE = [*COMMON, "--d-ff", "96"]
MOE = ["--moe", *COMMON, "--experts", "8", "--top-k", "2", "--d-expert", "64", "--d-shared", "96"]


def make_qwen35():
    return load_benchmark("make_qwen35")


@pytest.mark.parametrize("moe", [False, True], ids=["qwen35", "qwen35moe"])
def test_writes_the_geometry_and_runs(tmp_path, moe):
    from cflow.runtime import Engine

    args = MOE if moe else DENSE
    out = tmp_path / "q.gguf"
    assert make_qwen35().main([*args, "--out", str(out)]) == 0
    with Engine.load(out, threads=1) as eng:
        c = eng.config
        assert (c.name, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.rope_dims, c.vocab_size) == (
            "qwen35moe" if moe else "qwen35", 4, 128, 4, 2, 32, 8, 300)
        assert (c.full_attn_interval, c.ssm_k_heads, c.ssm_v_heads, c.ssm_head_dim, c.ssm_conv_kernel) == (
            2, 2, 4, 32, 4)
        assert [c.is_recurrent(i) for i in range(4)] == [True, False, True, False]
        if moe:
            assert (c.n_experts, c.top_k, c.d_expert, c.d_shared_expert, c.d_ff) == (8, 2, 64, 96, 0)
        else:
            assert (c.n_experts, c.d_ff) == (0, 96)
        logits = [eng.step(t, p).copy() for p, t in enumerate((5, 7, 9))]
    assert all(x.shape == (300,) and (abs(x) < 1e4).all() for x in logits)
    assert abs(logits[2] - logits[1]).max() > 0  # the tokens and the state move the logits
    assert_rewrites_same_bytes(make_qwen35().main, args, out, tmp_path / "again.gguf")
    assert_llama_cpp_runs(out, 300)  # llama.cpp takes the layout and keys


def test_sections_cover_the_rotated_quarter():
    from cflow.bench.synthetic_qwen35 import rope_sections

    assert rope_sections(64) == [11, 11, 10, 0]  # Qwen3.5's: head_dim 256, a quarter turns
    for rot in range(2, 130, 2):
        assert 2 * sum(rope_sections(rot)) == rot


def test_bad_geometry_is_refused(tmp_path, capsys):
    out = tmp_path / "x.gguf"
    with pytest.raises(SystemExit) as e:
        make_qwen35().main([*DENSE, "--ssm-v-heads", "3", "--out", str(out)])
    assert e.value.code == 2 and "--ssm-v-heads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        make_qwen35().main([*DENSE, "--d-ff", "100", "--out", str(out)])
    with pytest.raises(SystemExit):
        make_qwen35().main([*MOE, "--top-k", "9", "--out", str(out)])
    with pytest.raises(SystemExit):
        make_qwen35().main([*DENSE, "--interval", "0", "--out", str(out)])
    assert not out.exists()


def test_profile_counts_every_weight_byte(tmp_path):
    """`cflow bench --profile`'s weight bytes per decode step (the tensor table's, by op: a DeltaNet
    layer's projections in attn.qkv and attn.wo) add up to what the engine counts per token; the
    DeltaNet tensors are a part of that sum the comparison sees (the control: without them it
    falls short)."""
    from cflow.bench.profile import profile_engine
    from cflow.runtime import Engine

    out = tmp_path / "q.gguf"
    assert make_qwen35().main([*DENSE, "--out", str(out)]) == 0
    with Engine.load(out, threads=1) as eng:
        per_op = profile_engine(eng, steps=2, prefill=4, warmup=1).decode.bytes_per_call
        want = eng.weight_bytes_per_token()
        ssm = sum(t.nbytes for name, t in eng.file.tensors.items() if ".ssm." in name)
    got = sum(v for op, v in per_op.items() if v and op != "attn.cache")  # attn.cache: KV bytes, not weights
    assert got == want
    assert ssm > 0 and got - ssm < want
