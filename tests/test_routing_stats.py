"""benchmarks/routing_stats.py: its predictability is 1 when nothing changes the residual stream
between layers (layer l's input is layer l+d's), and falls below 1 when the layers write into it;
reuse and load are shares."""

from __future__ import annotations


import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cflow.config import ModelConfig  # noqa: E402
from cflow.model import Transformer  # noqa: E402
from bench_scripts import load_benchmark  # noqa: E402


routing_stats = load_benchmark("routing_stats")

TINY = dict(vocab_size=67, d_model=48, n_heads=4, n_kv_heads=2, max_seq_len=40, n_layers=5, d_ff=40,
            n_experts=6, top_k=2, d_expert=24)


def model_with(writes: bool) -> Transformer:
    """Without writes (every projection into the residual stream zero) every layer's MoE input is
    the embedding, so layer l+d's router applied to layer l's input picks exactly its experts."""
    torch.manual_seed(0)
    m = Transformer(ModelConfig.from_name("arch4-s", **TINY))
    m.reset_parameters(std=0.3)
    if not writes:
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith(("attn.wo.weight", "ffn.w_down.weight", "moe.w_down")):
                    p.zero_()
    return m.eval()


def run_stats(model: Transformer) -> dict:
    windows, starts = routing_stats.random_windows(model, 4 * 32, seed=1)
    chosen, inputs = routing_stats.trace(model, windows)
    return routing_stats.stats(model, chosen, inputs, starts)


def test_an_unchanged_residual_is_perfectly_predictable():
    s = run_stats(model_with(writes=False))
    assert list(s["predictability"]) == [1, 2, 3, 4]  # l + d must stay inside the 5 layers
    assert all(v == 1.0 for v in s["predictability"].values())


def test_layers_that_write_into_the_residual_are_not():
    s = run_stats(model_with(writes=True))
    assert max(s["predictability"].values()) < 0.9
    for layer in s["layers"]:
        assert sum(layer["load"]) == pytest.approx(1.0, abs=1e-3)
        assert 0.0 < layer["load_entropy"] <= 1.0 and 0.0 <= layer["reuse"] <= 1.0


def test_the_report_says_how_to_remake_a_random_model(tmp_path):
    from cflow.bench.synthetic import Geometry, write_cflow

    g = Geometry(layers=3, d_model=256, experts=4, top_k=2, d_ff=256, heads=2, kv_heads=1, vocab=300, ctx=64,
                 residual_gain=1.0)
    write_cflow(tmp_path / "r.cflow", g, "q8_0", seed=0, progress=False)
    assert routing_stats.main(["--random", str(tmp_path / "r.cflow"), "--tokens", "128",
                               "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep.md").read_text()
    assert "make_moe.py --layers 3 --d-model 256 --experts 4 --top-k 2" in md and "--residual-gain 1.0" in md
    assert np.isfinite(list(__import__("json").loads((tmp_path / "rep.json").read_text()).values())[0]
                       ["predictability"]["1"])
