"""Cold-start read order (cflow.runtime.readahead, build_plan(file_order=True)): a .vflow's plan
runs in its file order, the sweeper reads ahead in that order, and neither changes a bit of the
results."""

from __future__ import annotations

import numpy as np
import pytest

from cflow import dag
from cflow.bench import disk
from cflow.bench.claims.models import random_params, write_random_model
from cflow.config import PRESETS, ModelConfig
from cflow.fileformat import open_model
from cflow.fileformat.tensors import expert_of
from cflow.runtime import Engine
from cflow.runtime import readahead as ra
from cflow.runtime.errors import EngineError
from cflow.runtime.plan import build_plan

SMALL = dict(vocab_size=512, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96, n_experts=6, top_k=2, d_expert=64,
             max_seq_len=64, tie_embeddings=False)


def cfg_of(preset: str, layers: int) -> ModelConfig:
    over = {**SMALL, "n_layers": layers}
    if PRESETS[preset].get("n_unique_layers"):
        over["n_unique_layers"] = min(PRESETS[preset]["n_unique_layers"], layers)
    return ModelConfig.from_name(preset, **over)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("layers", [1, 2, 5])
def test_file_order_plan_follows_schedule(preset, layers):
    cfg = cfg_of(preset, layers)
    plan = build_plan(cfg, file_order=True)
    nodes = [op.node for op in plan.ops if op.node is not None]
    assert nodes == [n for stage in dag.schedule(cfg) for n in stage]
    default = build_plan(cfg)
    # only the experts move (their moe slots may differ); every other op keeps its place
    def key(o):  # route's moe slot depends on how many routings may be alive (Plan.n_moe)
        return (o.kind, o.layer, o.src) if o.kind == "route" else o

    assert [key(o) for o in plan.ops if o.kind != "experts"] == [key(o) for o in default.ops if o.kind != "experts"]
    if cfg.delta_expert == 0 or not cfg.has_moe:
        assert plan.ops == default.ops


def test_delay_wins_over_file_order():
    cfg = cfg_of("arch2_4_combined", 5)
    assert build_plan(cfg, delay_experts=True, file_order=True) == build_plan(cfg, delay_experts=True)


@pytest.fixture(scope="module")
def model_pair(tmp_path_factory):
    cfg = ModelConfig.from_name("arch2_4_combined", **{**SMALL, "n_layers": 5})
    params = random_params(cfg, seed=3)
    d = tmp_path_factory.mktemp("ra")
    return {o: write_random_model(d / f"m.{o}", cfg, "q4_0", params=params) for o in ("cflow", "vflow")}


def run_tokens(path, **kw) -> tuple[np.ndarray, dict]:
    eng = Engine.load(path, threads=2, n_ctx=32, **kw)
    try:
        out = [eng.prefill([5, 9, 17, 4, 100, 3]).copy()]
        tok = int(out[0].argmax())
        for i in range(5):
            out.append(eng.step(tok, 6 + i).copy())
            tok = int(out[-1].argmax())
        return np.stack(out), eng.readahead_stats()
    finally:
        eng.close()


@pytest.mark.parametrize("order", ["cflow", "vflow"])
def test_readahead_modes_bit_identical(model_pair, order):
    base, st = run_tokens(model_pair[order], readahead="off")
    assert st["file_order"] is False
    for mode in ("auto", "order", "sweep"):
        got, st = run_tokens(model_pair[order], readahead=mode)
        np.testing.assert_array_equal(got, base)
        assert st["file_order"] is (order == "vflow")
    # and the two orders of the same weights agree
    other, _ = run_tokens(model_pair["cflow" if order == "vflow" else "vflow"], readahead="off")
    np.testing.assert_array_equal(other, base)


def test_experts_on_disk_with_sweep_bit_identical(model_pair):
    ram, _ = run_tokens(model_pair["vflow"], readahead="off", experts="ram")
    got, st = run_tokens(model_pair["vflow"], readahead="sweep", experts="disk", expert_cache="1M")
    np.testing.assert_array_equal(got, ram)
    assert st["bytes_total"] > 0


def test_sweeper_reads_everything_it_was_given(model_pair):
    cf = open_model(model_pair["vflow"])
    try:
        spans = ra.swept_spans(cf, skip_experts=False)
        sw = ra.Sweeper(cf.path, cf.buffer, spans, window=1 << 20, chunk=1 << 16)
        sw._thread.join(timeout=30)
        st = sw.stats()
        assert not st["running"] and st["error"] is None
        assert st["bytes_advised"] == st["bytes_total"] == sum(n for _, n in ra.merge(spans))
        assert ra.resident(cf.buffer, ra.merge(spans)) is not None
    finally:
        cf.close()


def test_swept_spans_skip_experts_on_disk(model_pair):
    cf = open_model(model_pair["vflow"])
    try:
        all_spans = ra.swept_spans(cf, skip_experts=False)
        dense = ra.swept_spans(cf, skip_experts=True)
        expert_bytes = sum(e.nbytes for name, e in cf.tensors.items() if expert_of(name) is not None)
        assert sum(n for _, n in all_spans) - sum(n for _, n in dense) == expert_bytes
        for off, n in dense:
            assert not any(o <= off < o + k for o, k in cf.experts.values())
    finally:
        cf.close()


@pytest.mark.parametrize("order", ["cflow", "vflow"])
def test_expert_offsets_ascend_with_expert_index(model_pair, order):
    # the engine reads a layer's chosen experts in ascending expert index: in both orders that is
    # ascending file offset (one forward sweep per layer)
    cf = open_model(model_pair[order])
    try:
        by_layer: dict[int, list[tuple[int, int]]] = {}
        for (layer, expert), (off, _) in cf.experts.items():
            by_layer.setdefault(layer, []).append((expert, off))
        for items in by_layer.values():
            offs = [off for _, off in sorted(items)]
            assert offs == sorted(offs)
    finally:
        cf.close()


def test_chunks_and_merge():
    assert ra.merge([(8192, 4096), (0, 4096), (4096, 4096)], gap=0) == [(0, 12288)]
    assert ra.merge([(0, 10), (100, 10)], gap=90) == [(0, 110)]
    assert ra.merge([(0, 10), (100, 10)], gap=89) == [(0, 10), (100, 10)]
    assert ra.chunks([(0, 10), (100, 5)], size=4) == [(0, 4), (4, 4), (8, 2), (100, 4), (104, 1)]


def test_bad_mode_is_a_named_error(model_pair):
    with pytest.raises(EngineError, match="readahead must be one of"):
        Engine.load(model_pair["vflow"], readahead="fast")


def test_auto_does_not_sweep_what_cannot_fit(model_pair, monkeypatch):
    from cflow.runtime import experts as xp

    cf = open_model(model_pair["vflow"])
    try:
        ra_spans = ra.swept_spans(cf, skip_experts=False)
        monkeypatch.setattr(xp, "probe_memory", lambda: xp.MemoryProbe(sum(n for _, n in ra_spans), "test"))
        assert not ra.fits(ra_spans)  # the headroom does not fit besides
        disk.evict(model_pair["vflow"])
        file_order, sweeper, frac = ra.start(cf, "auto", mapped=True, skip_experts=False)
        assert file_order and sweeper is None
        if frac is not None and frac < ra.COLD:  # eviction worked (not tmpfs): with room it sweeps
            monkeypatch.setattr(xp, "probe_memory", lambda: xp.MemoryProbe(1 << 40, "test"))
            _, sweeper, _ = ra.start(cf, "auto", mapped=True, skip_experts=False)
            assert sweeper is not None
            sweeper.stop()
    finally:
        cf.close()
