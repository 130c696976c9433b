"""benchmarks/make_dense.py: the random dense Llama GGUF behind the ~1B table (docs/results/dense.md) is written as
asked (geometry, type, reproducible bit for bit) and runs; bad geometry is refused by flag."""

from __future__ import annotations

import hashlib

import pytest
from bench_scripts import load_benchmark

pytest.importorskip("gguf")
SMALL = ["--layers", "2", "--d-model", "256", "--d-ff", "320", "--heads", "4", "--kv-heads", "2", "--vocab", "300"]


def make_dense():
    return load_benchmark("make_dense")


@pytest.mark.parametrize("quant", ["q4_0", "q8_0"])
def test_writes_the_geometry_and_runs(tmp_path, quant):
    from cflow.runtime import Engine

    out = tmp_path / f"d-{quant}.gguf"
    assert make_dense().main([*SMALL, "--quant", quant, "--out", str(out)]) == 0
    with Engine.load(out, threads=1) as eng:
        c = eng.config
        assert (c.n_layers, c.d_model, c.d_ff, c.n_heads, c.n_kv_heads, c.vocab_size) == (2, 256, 320, 4, 2, 300)
        assert not c.has_moe
        logits = eng.step(5, 0).copy()
    assert logits.shape == (300,) and (abs(logits) < 1e4).all()
    again = tmp_path / "again.gguf"
    make_dense().main([*SMALL, "--quant", quant, "--out", str(again)])
    assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(again.read_bytes()).digest()


def test_bad_geometry_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        make_dense().main(["--d-model", "250", "--heads", "5", "--kv-heads", "5", "--out", str(tmp_path / "x.gguf")])
    assert e.value.code == 2 and "multiples of 32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        make_dense().main(["--heads", "32", "--kv-heads", "5", "--out", str(tmp_path / "x.gguf")])
    assert not (tmp_path / "x.gguf").exists()
