"""Route traces (cflow.runtime.routes, native cf_engine_set_routes): recording what the routers
choose and what speculation predicts, and replaying it in place of the routers.

Held against: the engine's own run (replaying a run's own trace gives the same logits bit for bit,
in RAM and with experts on disk, and on disk the same cache hits, misses and predictions); the
routing counts (a replayed foreign trace is what the model routes by); the disk bytes (exactly the
missing experts' spans); the speculation predictor (recorded predictions equal the top-k of the
later layer's router on the earlier layer's input, computed in numpy from the file's weights).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

pytest.importorskip("torch")

from cflow.runtime import Engine  # noqa: E402
from cflow.runtime.routes import RouteTrace, RouteTraceError  # noqa: E402
from test_engine import small_config, write_random_model  # noqa: E402
from test_experts_disk import PREFILL, STEPS, budget_bytes, load_disk, round_up, run, tokens  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, preset, kw in (("a24", "arch2_4_combined", {}), ("arch1", "arch1", {}),
                             ("e6k3", "arch4", {"n_experts": 6, "top_k": 3})):
        path = tmp_path_factory.mktemp(name) / "m.cflow"
        write_random_model(path, small_config(preset, tied=False, **kw), "q4_0", (64, 64))
        out[name] = path
    return out


def recorded(path, seed=0):
    eng = Engine.load(path, threads=2, experts="ram", max_batch=8)
    eng.record_routes(PREFILL + STEPS + 5)
    logits = run(eng, seed)
    trace = eng.route_trace(text="random tokens")
    eng.close()
    return trace, logits


@pytest.mark.parametrize("name", ["a24", "arch1", "e6k3"])
def test_replaying_a_runs_own_trace_is_bit_identical(models, name):
    trace, want = recorded(models[name])
    assert trace.rows == PREFILL + STEPS  # one row per routed token, not the buffer's size
    assert trace.chosen.min() >= 0
    eng = Engine.load(models[name], threads=2, experts="ram", max_batch=8)
    eng.replay_routes(trace)
    got = run(eng)
    for i, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(g, w), f"{name}: call {i} differs"


def test_a_foreign_trace_is_what_the_model_routes_by(models):
    path = models["a24"]
    eng = Engine.load(path, threads=1, experts="ram", max_batch=8)
    cfg = eng.config
    own, want = recorded(path)
    forced = own.chosen.copy()
    forced[...] = np.arange(cfg.top_k)  # every row, every layer: experts 0..top_k-1
    eng.reset_counters()
    eng.replay_routes(RouteTrace(forced, own.pred))
    got = run(eng)
    hits = np.array(eng.expert_hits())
    assert hits[:, cfg.top_k:].sum() == 0 and (hits[:, :cfg.top_k] == PREFILL + STEPS).all()
    assert not np.array_equal(got[-1], want[-1])  # other experts, other logits
    # back to the routers: the model's own logits again
    eng.stop_routes()
    assert all(np.array_equal(g, w) for g, w in zip(run(eng), want))


def test_a_short_trace_wraps_around(models):
    path = models["arch1"]
    own, _ = recorded(path)
    short = RouteTrace(own.chosen[:3], own.pred[:3])
    eng = Engine.load(path, threads=1, experts="ram", max_batch=8)
    eng.reset_counters()
    eng.replay_routes(short)
    run(eng)
    n = PREFILL + STEPS
    want = np.zeros((eng.config.n_layers, eng.config.n_experts), np.int64)
    for t in range(n):
        for layer in range(eng.config.n_layers):
            want[layer, short.chosen[t % 3, layer]] += 1
    assert np.array_equal(np.array(eng.expert_hits()), want)


def test_a_recorded_trace_is_well_formed(models):
    """Every distance is recorded: depth L - 1; a prediction past the last layer is -1, the others
    top_k distinct experts."""
    path = models["arch1"]
    eng = Engine.load(path, threads=1, experts="ram", max_batch=8)
    cfg = eng.config
    eng.record_routes(8)
    eng.prefill(tokens(cfg, 8))
    trace = eng.route_trace()
    L, K = cfg.n_layers, cfg.top_k
    assert trace.rows == 8 and trace.depth == L - 1
    for layer in range(L):
        for j in range(trace.depth):
            p = trace.pred[:, layer, j]
            if layer + 1 + j >= L:
                assert (p == -1).all()
            else:
                assert ((p >= 0) & (p < cfg.n_experts)).all()
                assert all(len(set(row)) == K for row in p)


def test_predictions_from_shared_weights_are_the_choice(tmp_path):
    """arch5 shares weight sets between layers: a layer predicting a later layer of its own set
    evaluates the same router and norm on the same input, so the prediction is its own choice."""
    path = tmp_path / "m.cflow"
    write_random_model(path, small_config("arch5", tied=False), "q4_0", (64, 64))
    eng = Engine.load(path, threads=1, experts="ram", max_batch=8)
    cfg = eng.config
    eng.record_routes(9)
    eng.prefill(tokens(cfg, 9))
    trace = eng.route_trace()
    same = 0
    for layer in range(cfg.n_layers):
        for j in range(trace.depth):
            target = layer + 1 + j
            if target < cfg.n_layers and cfg.weight_layer(target) == cfg.weight_layer(layer):
                same += 1
                assert np.array_equal(np.sort(trace.pred[:, layer, j], axis=-1),
                                      np.sort(trace.chosen[:, layer], axis=-1))
    assert same > 0


@pytest.mark.parametrize("io", ["async", "sync"])
def test_replay_on_disk_reads_like_the_run_it_came_from(models, io, monkeypatch):
    """Experts on disk, the middle budget: the replayed run has the recorded run's logits, and its
    cache hits and misses (sync) or predictions (async, speculating); sync reads are exactly the
    misses' spans."""
    monkeypatch.setenv("CFLOW_EXPERT_DIRECT", "1")
    path = models["a24"]
    budget = budget_bytes(path, "mid", io)

    def disk_run(trace=None):
        eng = load_disk(path, budget, io, 2)
        if trace is None:
            eng.record_routes(PREFILL + STEPS)
        else:
            eng.replay_routes(trace)
        logits = run(eng)
        c = eng.counters()
        span = {round_up(n) for _, n in eng.file.experts.values()}
        out = (logits, c, eng.route_trace() if trace is None else None, span)
        eng.close()
        return out

    want, c0, trace, span = disk_run()
    got, c1, _, _ = disk_run(trace)
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    # With async reads the hits and misses depend on when reads land (a loading slot cannot be
    # evicted): two plain runs of this model differ by a few. What is a function of the routing
    # alone is compared: sync's hits, misses and bytes; async's predictions and their hits.
    keys = ["speculation_predicted", "speculation_hits"] if io == "async" else ["cache_hits", "cache_misses",
                                                                              "disk_bytes"]
    assert {k: c1[k] for k in keys} == {k: c0[k] for k in keys}
    if io == "sync":
        assert len(span) == 1 and c1["disk_bytes"] == c1["cache_misses"] * span.pop()


@pytest.mark.parametrize("gate_next", ["1", "0"])
def test_speculation_follows_the_traces_predictions(models, monkeypatch, gate_next):
    """A trace whose predictions are always wrong: nothing predicted is chosen. With the gate on
    every distance (the default) no read starts for them at all; with the next layer always trusted
    (CFLOW_SPEC_GATE_NEXT=0) reads start and are wasted (speculation_reads > speculation_reads_used = 0)."""
    monkeypatch.setenv("CFLOW_EXPERT_DIRECT", "1")
    monkeypatch.setenv("CFLOW_SPEC_GATE_NEXT", gate_next)
    path = models["a24"]
    own, _ = recorded(path)
    eng = load_disk(path, budget_bytes(path, "mid"), "async", 2)
    cfg = eng.config
    K, E = cfg.top_k, cfg.n_experts
    chosen = own.chosen.copy()
    chosen[...] = np.arange(K)
    pred = np.where(own.pred < 0, -1, np.arange(E - K, E)[None, None, None, :]).astype(np.int32)
    eng.replay_routes(RouteTrace(chosen, pred))
    run(eng)
    c = eng.counters()
    assert c["speculation_predicted"] > 0 and c["speculation_hits"] == 0
    if gate_next == "1":
        assert c["speculation_reads"] == 0
    else:
        assert c["speculation_reads"] > 0 and c["speculation_reads_used"] == 0


def test_bad_traces_are_named_errors(models, tmp_path):
    path = models["a24"]
    own, _ = recorded(path)
    eng = Engine.load(path, threads=1, experts="ram", max_batch=8)
    cfg = eng.config
    bad = own.chosen.copy()
    bad[2, 1, 0] = cfg.n_experts
    with pytest.raises(RouteTraceError, match="expert"):
        eng.replay_routes(RouteTrace(bad, own.pred))
    dup = own.chosen.copy()
    dup[0, 0, :] = 1
    with pytest.raises(RouteTraceError, match="chosen twice"):
        eng.replay_routes(RouteTrace(dup, own.pred))
    with pytest.raises(RouteTraceError, match="same layers and top_k"):
        eng.replay_routes(RouteTrace(own.chosen[:, :-1], own.pred[:, :-1]))
    with pytest.raises(RouteTraceError, match="does not match"):
        RouteTrace(own.chosen, own.pred[:2])
    with pytest.raises(RouteTraceError, match="record_routes first"):
        eng.route_trace()
    # a trace too shallow for the engine's speculation
    disk = load_disk(path, budget_bytes(path, "mid"), "async", 2)
    with pytest.raises(RouteTraceError, match="speculation looks"):
        disk.replay_routes(RouteTrace(own.chosen, own.pred[:, :, :1]))
    disk.close()
    # the file
    f = own.save(tmp_path / "t.npz")
    back = RouteTrace.load(f)
    assert np.array_equal(back.chosen, own.chosen) and np.array_equal(back.pred, own.pred)
    assert back.meta["text"] == "random tokens"
    (tmp_path / "junk.npz").write_bytes(b"not a trace")
    with pytest.raises(RouteTraceError, match="not a route trace"):
        RouteTrace.load(tmp_path / "junk.npz")


def test_a_dense_model_has_no_routes(tmp_path):
    path = tmp_path / "d.cflow"
    write_random_model(path, small_config("llama", tied=False), "q4_0", (64, 64))
    eng = Engine.load(path, threads=1, experts="ram")
    with pytest.raises(RouteTraceError, match="routes no experts"):
        eng.record_routes(4)


@contextlib.contextmanager
def expert_io_ab(monkeypatch):
    """benchmarks/expert_io_ab.py as a module, with benchmarks/ on sys.path only while it runs (it
    imports route_trace) and the variables it sets per mode restored afterwards."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    for var in ("CFLOW_EXPERT_READER", "CFLOW_EXPERT_QD", "CFLOW_EXPERT_KEEP", "CFLOW_SPEC_GATE_NEXT"):
        monkeypatch.setenv(var, os.environ.get(var, ""))
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("expert_io_ab", bench / "expert_io_ab.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(bench))


def test_the_replay_benchmark_runs_models_together(models, tmp_path, monkeypatch):
    """benchmarks/expert_io_ab.py --trace --together on two small models: one row per model and mode,
    the second model's ratios to the first's same mode, the trace's routing in effect."""
    import json

    with expert_io_ab(monkeypatch) as mod:
        trace, _ = recorded(models["a24"])
        tpath = trace.save(tmp_path / "a24.npz")
        out = tmp_path / "ab"
        assert mod.main([str(models["a24"]), str(models["a24"]), "--trace", str(tpath), "--together",
                         "--budgets", "0.6", "--modes", "sync,async:off", "--rounds", "2", "--per-round", "2",
                         "--warmup", "2", "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert len(res) == 2 and all(set(r["modes"]) == {"sync", "async:off"} for r in res)
    assert res[0]["modes"]["sync"]["ratio_to_first"] is None and len(res[1]["modes"]["sync"]["ratio_to_first"]) == 3
    assert res[1]["routes"] == "a trace"  # recorded() names no source


def test_the_replay_benchmark_loads_one_file_as_each_preset(models, tmp_path, monkeypatch):
    """expert_io_ab.py --as-arch: one file, one engine per preset named (its delays and MoE input in
    the config, so its plan), arch1 twice as the A/A control; the trace routes all of them alike,
    so in sync mode (which hides nothing) every engine misses the same experts of the same file."""
    import json

    from cflow.config import PRESETS

    with expert_io_ab(monkeypatch) as mod:
        with Engine.load(models["a24"], threads=1, experts="ram") as probe:
            cfg = probe.config
        for arch in ("arch1", "arch4"):
            got = mod.as_arch(cfg, arch)
            assert (got.delta_dense, got.delta_expert, got.moe_input) == tuple(
                PRESETS[arch][k] for k in ("delta_dense", "delta_expert", "moe_input"))
            assert got.d_model == cfg.d_model and got.n_experts == cfg.n_experts
        trace, _ = recorded(models["a24"])
        tpath = trace.save(tmp_path / "a24.npz")
        out = tmp_path / "ab"
        assert mod.main([str(models["a24"]), "--as-arch", "arch1,arch1,arch2_4_combined", "--trace", str(tpath),
                         "--budgets", "0.6", "--modes", "sync,async:2:opennext", "--rounds", "2", "--per-round", "2",
                         "--warmup", "2", "--out", str(out)]) == 0
        with pytest.raises(SystemExit):
            mod.main([str(models["a24"]), "--as-arch", "arch1,nonsense", "--budgets", "0.6"])
    res = json.loads(out.with_suffix(".json").read_text())
    assert [r["model"].rsplit(" as ", 1)[1] for r in res] == ["arch1", "arch1", "arch2_4_combined"]
    syncs = {r["modes"]["sync"]["disk_mb_per_token"] for r in res}
    assert len(syncs) == 1 and syncs.pop() > 0  # the same routing, file and budget: the same misses
    assert res[1]["modes"]["async:2:opennext"]["ratio_to_first"] is not None


def test_the_replay_benchmark_balances_load_order_across_processes(models, tmp_path, monkeypatch):
    """expert_io_ab.py --processes N: N fresh processes, process p loading the engines rotated by p
    (each model in each load position once when N = the number of models), pooled: every process's
    rounds concatenated, and the load-order-balanced ratios beside the plain ones."""
    import json

    with expert_io_ab(monkeypatch) as mod:
        trace, _ = recorded(models["a24"])
        tpath = trace.save(tmp_path / "a24.npz")
        out = tmp_path / "ab"
        assert mod.main([str(models["a24"]), "--as-arch", "arch1,arch1,arch2_4_combined", "--trace", str(tpath),
                         "--budgets", "0.6", "--modes", "sync,async:off", "--rounds", "2", "--per-round", "2",
                         "--warmup", "2", "--processes", "3", "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert [r["model"].rsplit(" as ", 1)[1] for r in res] == ["arch1", "arch1", "arch2_4_combined"]
    for r in res:
        assert r["process_rounds"] == [2, 2, 2] and r["load_rotations"] == [0, 1, 2] and r["rounds"] == 6
        for x in r["modes"].values():
            assert len(x["samples_ms"]) == 6 and len(x["stall_samples_ms"]) == 6
            assert x["ratio_to_sync_latin"] > 0
    assert res[0]["modes"]["sync"]["ratio_to_first_latin"] is None and res[1]["modes"]["sync"]["ratio_to_first_latin"] > 0
    assert res[0]["modes"]["sync"]["ratio_to_sync_latin"] == pytest.approx(1.0)


def test_the_load_balanced_ratio_cancels_a_handicap_that_follows_the_load_order(monkeypatch):
    """Two identical engines; whichever a process loads first runs 1.25x slower. One process (A first)
    shows a 1.25x A/A gap; two processes with the order swapped pool to 1.0 under the balanced
    statistic. The plain pooled median does not cancel it when the processes' spreads differ."""
    with expert_io_ab(monkeypatch) as mod:
        a = [125.0, 126.0, 124.0, 100.0, 101.0, 99.0]  # process 0: A loaded first; process 1: B first
        b = [100.0, 100.0, 100.0, 125.0, 125.0, 125.0]
        one = mod.ratio(a[:3], b[:3])[0]
        assert one == pytest.approx(1.25)
        assert mod.latin(a, b, [3, 3]) == pytest.approx(1.0, abs=0.01)
        runs = [[{"model": m, "budget": 0.5, "threads": 1, "rounds": 3, "per_round": 1, "tokens": "random",
                  "routes": "own", "load_rotation": p,
                  "modes": {"sync": {"ms_per_token": 0, "stall_ms_per_token": 0, "disk_mb_per_token": 1.0,
                                     "cache_hit_rate": 0.5, "speculation_hit_rate": None,
                                     "samples_ms": s[3 * p:3 * p + 3], "stall_samples_ms": [0.0] * 3}}}
                 for m, s in (("A", a), ("B", b))] for p in (0, 1)]
        pooled = mod.pool(runs)
    assert pooled[1]["modes"]["sync"]["ratio_to_first_latin"] == pytest.approx(1.0, abs=0.01)
    assert pooled[1]["modes"]["sync"]["samples_ms"] == b and pooled[0]["process_rounds"] == [3, 3]
