"""Expert speculation: predicting later layers' experts and reading them early (native/engine_spec.c;
Engine.load(expert_speculation=...), --expert-speculation): with experts on disk and async reads,
route(l) also applies the routers of layers up to l+depth to its own input and starts reading the
predicted experts early. (Not the kernels' software prefetch: test_prefetch.py.)

What is held against what:
- logits bit for bit against RAM-resident experts (and so against speculation off), decode and
  prefill batches, on models without a delay (delta_expert 0: arch1, a Mixtral layout without a
  dense FFN, top-3 of 6) and on a delayed plan with speculation forced on, at budgets from the
  minimum (speculation turns itself off) to every expert, 1-3 threads, depth 1 and deeper;
- the counters: per decode step predictions are exactly top_k x (L - 1) at depth 1 (and between that
  and the two predictions a deeper layer gets at depth > 1), hits <= predictions,
  reads <= predictions, used <= reads, the cache's lookups top_k x L; every byte read is a demand
  miss or a speculative read (disk_bytes, and the kernel's own count with O_DIRECT);
- the prediction itself, exactly, where it is known: with one weight set shared by every layer the
  router and norm of layer l+k are those of layer l, so a prediction made at route(l) is route(l)'s
  own choice: layer t is predicted chosen(t-1), and at depth D > 1 also chosen(max(t-D, 0)), and
  the hits follow from the routing trace (and are > 0);
- the gate: predictions start reads only at distances whose predictions prove right, the next
  layer's too (the tiny random models here predict it far below the 90% bar, so every other test
  opens it with CFLOW_SPEC_GATE_NEXT=0 to exercise the reads); closed, depth 3 reads exactly what
  depth 1 reads, and depth 1 reads nothing at all (the inline reader makes the counts independent of
  when reads land);
- failures: an injected I/O error or short read on any of the first reads, speculative or not,
  ends in ExpertIOError naming the file or in exact logits, never a hang, and decoding goes on
  exactly; a forked child (no reader threads) still computes the same logits;
- the option: "auto" and its depth, the flag named in errors, the timings line and bench's hit rate,
  and the old flag --expert-prefetch still working after a deprecation line (the old keyword
  expert_prefetch=: test_options.py);
- the async readers (io_uring where the kernel offers it, pread threads, and the threads after the
  kernel refused io_uring_setup): the same logits and the same clean failure. (The whole of
  test_experts_disk.py also passes with CFLOW_EXPERT_READER=threads and =uring-refused.)
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("torch")

from cflow.runtime import Engine, EngineError  # noqa: E402
from cflow.runtime import experts as xp  # noqa: E402
from test_experts_disk import (PREFILL, STEPS, check_forked_step, kernel_read_bytes, ram_run, reads_started,  # noqa: E402
                               round_up, run, settle, tokens, within, write_models)

# name -> (preset, config overrides, dtype, tile)
MODELS = {
    "arch1": ("arch1", {}, "q4_0", (64, 64)),  # delta_expert 0, MoE after the dense FFN
    "mixtral": ("arch3", {"d_ff": 0}, "q8_0", (32, 64)),  # no dense FFN: the Mixtral layout
    "e6k3": ("arch1", {"n_experts": 6, "top_k": 3}, "q4_1", (16, 32)),
    "shared": ("arch1", {"n_unique_layers": 1}, "q4_0", (64, 64)),  # every layer one weight set
    "delayed": ("arch2_4_combined", {}, "q4_0", (64, 64)),  # delta_expert 2: the window, and speculation too
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_models(tmp_path_factory, MODELS)


@pytest.fixture(autouse=True)
def next_layer_always_reads(monkeypatch):
    """The tests of the reads themselves need reads: the next layer's gate open from the first route
    (the tiny random models' routing is far below the gate's bar). test_gate_* set it themselves."""
    monkeypatch.setenv("CFLOW_SPEC_GATE_NEXT", "0")


def load(path, slots=None, speculation="next-layer", threads=2, io="async", **kw):
    """Experts on disk in a cache of `slots` experts (None: the default budget)."""
    budget = None
    if slots is not None:
        probe = Engine.load(path, threads=1, experts="disk", expert_io=io, max_batch=8, expert_speculation="off")
        budget = slots * probe.expert_cache["slot_bytes"]
        probe.close()
    return Engine.load(path, threads=threads, experts="disk", expert_cache=budget, expert_io=io, max_batch=8,
                       expert_speculation=speculation, **kw)


def min_slots(path, **kw) -> int:
    eng = load(path, None, "off", 1, **kw)
    n = eng.expert_cache["min_slots"]
    eng.close()
    return n


# ---- bit for bit ----------------------------------------------------------------------------------
def depth_name(depth) -> str:
    """expert_cache["speculation"] for a depth in effect."""
    return "off" if not depth else "next-layer" if depth == 1 else f"{depth} layers"


@pytest.mark.parametrize("depth", ["next-layer", 3])
@pytest.mark.parametrize("extra", [0, 1, 3, 10**6])  # slots beyond the minimum (10**6: every expert)
@pytest.mark.parametrize("name", ["arch1", "mixtral", "e6k3", "delayed"])
def test_logits_bit_identical_with_speculation(models, name, extra, depth):
    path = models[name]
    want = ram_run(path)
    ms = min_slots(path)
    for threads in (1, 2, 3):
        eng = load(path, ms + extra, depth, threads)
        c = eng.expert_cache
        n_keys = eng.config.n_experts * eng.config.n_unique_layers
        assert c["slots"] == min(ms + extra, n_keys)
        # no slot beyond the plan's minimum: speculation turns itself off
        d = min(xp.parse_speculation(depth), eng.config.n_layers - 1)
        assert c["speculation"] == depth_name(0 if extra == 0 else d)
        assert c["speculation_slots"] == (c["slots"] - ms if extra else 0)
        got = within(60, run, eng)
        for i, (g, w) in enumerate(zip(got, want)):
            assert np.array_equal(g, w), f"{name} +{extra} slots, threads={threads}: call {i} differs"
        k = eng.counters()
        if extra:  # a cold cache: layer 1's experts cannot be cached when layer 0 predicts them
            assert k["speculation_predicted"] > 0 and k["speculation_reads"] > 0
        else:
            assert k["speculation_predicted"] == k["speculation_reads"] == k["speculation_reads_used"] == 0
        assert len(eng.expert_resident()) <= c["slots"]
        eng.close()


# ---- counters --------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("extra", [1, 4])
@pytest.mark.parametrize("name", ["arch1", "mixtral"])
def test_counters_add_up_per_step(models, name, extra, depth, monkeypatch):
    monkeypatch.setenv("CFLOW_EXPERT_DIRECT", "1")
    path = models[name]
    eng = load(path, min_slots(path) + extra, depth)
    cfg = eng.config
    span = {round_up(n) for _, n in eng.file.experts.values()}
    assert len(span) == 1  # every expert the same size here: bytes are reads x span
    span = span.pop()
    direct = eng.expert_cache["read"] == "O_DIRECT"
    spare = eng.expert_cache["speculation_slots"]
    eng.prefill(tokens(cfg, 4))
    start, io_start = settle(eng), kernel_read_bytes()
    spec_reads = 0
    for i, t in enumerate(tokens(cfg, 24, seed=5)):
        c0 = eng.counters()
        eng.step(t, 4 + i)
        c1 = eng.counters()
        d = {k: c1[k] - c0[k] for k in c1}
        # one row: top_k per layer from its previous one; deeper, layers 2.. get a second prediction
        # (from route(max(t - depth, 0))), whose union with the first has top_k .. 2 top_k experts
        once = cfg.top_k * (cfg.n_layers - 1)
        if depth == 1 or cfg.n_layers < 3:
            assert d["speculation_predicted"] == once
        else:
            assert once <= d["speculation_predicted"] <= once + cfg.top_k * (cfg.n_layers - 2)
        assert d["speculation_hits"] <= d["speculation_predicted"]
        assert d["speculation_reads"] <= d["speculation_predicted"]
        assert d["speculation_reads_used"] <= d["cache_misses"]
        assert d["cache_hits"] + d["cache_misses"] == cfg.n_layers * cfg.top_k
        # every read is a demand miss or a speculative read; speculative reads nobody waited for
        # may still be landing (disk_bytes counts a read when it lands), at most one per spare slot
        late = (reads_started(c1) - reads_started(start)) * span - (c1["disk_bytes"] - start["disk_bytes"])
        assert late % span == 0 and 0 <= late <= spare * span
        spec_reads += d["speculation_reads"]
    c = settle(eng)
    assert c["disk_bytes"] == reads_started(c) * span
    if direct and io_start is not None:  # the kernel saw exactly these reads: no readahead, no re-reads
        assert kernel_read_bytes() - io_start == c["disk_bytes"] - start["disk_bytes"]
    assert c["speculation_reads_used"] <= c["speculation_reads"]  # since the load: each read is used at most once as such
    assert spec_reads > 0
    rate = xp.speculation_hit_rate(c)
    assert rate is not None and 0 <= rate <= 1


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("slots", ["min+2", "all"])
def test_prediction_is_exact_when_every_layer_shares_its_weights(models, slots, depth):
    """One weight set for all layers: a prediction made at route(l) is layer l's own choice (same
    input, same norm, same router), so the predicted and hit counts follow from the routing trace:
    layer t is predicted from route(t-1), and at depth D > 1 also from route(max(t-D, 0)) (the
    layer entering the horizon; the call's first route predicts 1 .. D)."""
    path = models["shared"]
    n = min_slots(path) + 2 if slots == "min+2" else 10**6
    eng = load(path, n, depth)
    cfg = eng.config
    assert cfg.n_layers >= 4  # depth 3 predicts from route(t-3) for a layer
    assert cfg.n_unique_layers == 1 and eng.expert_cache["speculation"] == depth_name(depth)
    want_pred = want_hits = 0
    prev = np.array(eng.expert_hits())
    calls = [("prefill", tokens(cfg, PREFILL))] + [("step", t) for t in tokens(cfg, STEPS, seed=1)]
    for i, (kind, arg) in enumerate(calls):
        if kind == "prefill":  # one call of 8 = max_batch rows
            eng.prefill(arg[:8])
            after_prefill = eng.counters()
        else:
            eng.step(arg, 8 + i - 1)
        now = np.array(eng.expert_hits())
        chosen = [set(np.nonzero(row)[0]) for row in now - prev]  # per layer: the union over the rows
        prev = now
        for t in range(1, cfg.n_layers):
            pred = chosen[t - 1] | (chosen[max(t - depth, 0)] if depth > 1 and t >= 2 else set())
            want_pred += len(pred)
            want_hits += len(pred & chosen[t])
    c = eng.counters()
    assert (c["speculation_predicted"], c["speculation_hits"]) == (want_pred, want_hits)
    assert want_hits > 0 and xp.speculation_hit_rate(c) == want_hits / want_pred
    # decoding, what layer l chose is pinned and cached (it just ran): nothing to read early (a batch
    # reads what its first wave did not pin, for layer l's later waves and l+1 alike); an earlier
    # layer's choice may have been evicted from a small cache since
    if depth == 1 or slots == "all":
        assert c["speculation_reads"] == after_prefill["speculation_reads"]


@pytest.mark.parametrize("name", ["arch1", "mixtral"])
def test_gate_reads_only_trusted_distances(models, name, monkeypatch):
    """Predictions start reads only at distances whose predictions prove right (engine_spec.c
    spec_trusted), the next layer's included. With the bar above 100% no distance is ever trusted:
    depth 3 then reads exactly what depth 1 reads, which is nothing (both still predict, to keep
    measuring); with the bar at 0 every distance reads once 32 of its predictions are in; with the
    next layer's gate open (CFLOW_SPEC_GATE_NEXT=0, the engine before learned routing was measured)
    depth 1 reads under the closed bar. Logits stay exact every way."""
    path = models[name]
    want = ram_run(path)

    monkeypatch.setenv("CFLOW_EXPERT_READER", "inline")  # reads land when submitted: no timing in the counts
    monkeypatch.setenv("CFLOW_EXPERT_KEEP", "0")  # the gate alone: keep ranks follow it (tested below)

    def counters(depth, bar, gate_next="1"):
        monkeypatch.setenv("CFLOW_SPEC_MIN_PRECISION", bar)
        monkeypatch.setenv("CFLOW_SPEC_GATE_NEXT", gate_next)
        eng = load(path, min_slots(path) + 6, depth, threads=1)
        assert eng.expert_cache["reader"] == "inline"
        got = within(60, run, eng)
        assert all(np.array_equal(g, w) for g, w in zip(got, want))
        c = eng.counters()
        eng.close()
        return c

    keys = ("cache_hits", "cache_misses", "speculation_reads", "speculation_reads_used", "disk_bytes")
    near, closed, opened = counters(1, "2"), counters(3, "2"), counters(3, "0")
    assert near["speculation_predicted"] > 0 and near["speculation_reads"] == 0  # predicted, never read
    assert {k: closed[k] for k in keys} == {k: near[k] for k in keys}
    assert closed["speculation_predicted"] > near["speculation_predicted"]  # it still predicts (to keep measuring)
    assert opened["speculation_reads"] > near["speculation_reads"]  # 32 predictions in, every distance reads
    near_open = counters(1, "2", gate_next="0")
    assert near_open["speculation_reads"] > 0
    assert near_open["speculation_predicted"] == near["speculation_predicted"]  # the same predictions, read now


@pytest.mark.parametrize("name", ["arch1", "mixtral"])
def test_keep_ranks_hold_a_steps_first_layer(models, name, monkeypatch):
    """Keep ranks (engine.c keep_ranks): once speculation is trusted d layers ahead, the cache evicts
    layer 0's experts, whose misses no read can hide, only when no later layer's can go, so with room
    for a few layers' experts layer 0 stays wholly cached; without the ranks (CFLOW_EXPERT_KEEP=0) the
    same run leaves it partly evicted. Inline reads (no timing), same tokens; logits exact both ways."""
    path = models[name]
    want = ram_run(path)
    monkeypatch.setenv("CFLOW_EXPERT_READER", "inline")
    monkeypatch.setenv("CFLOW_SPEC_MIN_PRECISION", "0")  # every distance trusted once 32 predictions are in
    monkeypatch.setenv("CFLOW_SPEC_GATE_NEXT", "1")  # the next layer too: keep depth counts from 0
    with Engine.load(path, threads=1) as probe:
        L, E = probe.config.n_layers, probe.config.n_experts

    def held_per_layer(keep):
        monkeypatch.setenv("CFLOW_EXPERT_KEEP", keep)
        # speculation pins up to top_k experts of each later layer: room for those and layer 0
        eng = load(path, min_slots(path) + 2 * E + 2, 16, threads=1)
        got = within(60, run, eng)
        assert all(np.array_equal(g, w) for g, w in zip(got, want))
        for i, t in enumerate(tokens(eng.config, 40, seed=5)):  # the cache's steady state
            eng.step(t, PREFILL + STEPS + i)
        assert np.count_nonzero(np.array(eng.expert_hits())[0]) == E  # every expert of layer 0 was routed to
        held = [0] * L
        for layer, _ in eng.expert_resident():
            held[layer] += 1
        depth = eng.expert_cache["keep_depth"]
        eng.close()
        return depth, held

    depth, held = held_per_layer("1")
    assert depth == L - 1 and held[0] == E, held
    depth, held = held_per_layer("0")
    assert depth == 0 and held[0] < E, held


def test_depth_cap_is_the_engines():
    from cflow import _native

    sizes = xp.ModelSizes(file_bytes=1 << 30, expert_bytes=1 << 29, slot_bytes=4096, n_keys=64, top_k=2, inflight=1,
                          kv_bytes=0, delta_expert=1, n_layers=4 * _native.SPEC_MAX_DEPTH)
    asked = 2 * _native.SPEC_MAX_DEPTH
    assert xp.decide(sizes, experts="disk", expert_cache=1 << 20, expert_speculation=asked).speculation_depth == \
        _native.SPEC_MAX_DEPTH


# ---- options ---------------------------------------------------------------------------------------
def test_auto_turns_on_with_async_reads(models):
    for name, on in (("arch1", True), ("mixtral", True), ("delayed", True)):
        eng = load(models[name], 10**6, "auto")
        depth = min(xp.AUTO_SPECULATION_DEPTH, eng.config.n_layers - 1) if on else 0
        assert eng.expert_cache["speculation"] == depth_name(depth), name
        assert eng.expert_cache["speculation_depth"] == eng.residency.speculation_depth == depth
        assert ("expert speculation" in eng.residency.reason) is on
        eng.close()
    eng = load(models["arch1"], 10**6, "auto", io="sync")
    assert eng.expert_cache["speculation"] == "off" and not eng.residency.speculation_depth
    eng = load(models["arch1"], 10**6, "100")  # deeper than the model: capped at its last layer
    assert eng.residency.speculation_depth == eng.config.n_layers - 1
    eng = load(models["arch1"], 10**6, "off")
    assert eng.expert_cache["speculation"] == "off"
    eng = Engine.load(models["arch1"], threads=1, experts="ram", expert_speculation="next-layer")
    assert eng.expert_cache is None  # in RAM there is nothing to read


def test_bad_speculation_options_name_the_flag(models):
    with pytest.raises(EngineError, match="needs --expert-io async") as e:
        load(models["arch1"], 10**6, "next-layer", io="sync")
    assert e.value.flag == "--expert-speculation"
    for bad in ("always", -1, "-2", "3x", True, 2.5):
        with pytest.raises(EngineError, match="expert_speculation must be one of") as e:
            load(models["arch1"], 10**6, bad)
        assert e.value.flag == "--expert-speculation"


def test_minimum_cache_logs_that_speculation_is_off(models):
    path = models["arch1"]
    lines: list[str] = []
    eng = load(path, min_slots(path), "next-layer", log=lines.append)
    assert eng.expert_cache["speculation"] == "off" and eng.residency.speculation_depth
    assert any("speculation off" in s and "minimum" in s for s in lines)
    lines.clear()
    eng = load(path, min_slots(path) + 1, "next-layer", log=lines.append)
    assert any("speculation next-layer in up to 1 spare slots" in s for s in lines)
    lines.clear()
    eng = load(path, min_slots(path) + 2, 2, log=lines.append)
    assert any("speculation 2 layers ahead in up to 2 spare slots" in s for s in lines)


# ---- failures --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,delay_ms", [("eio", 0), ("short", 50)])
def test_io_faults_with_speculation(models, kind, delay_ms):
    """A fault on each of the first reads in turn (demand or speculative): the step raises
    ExpertIOError naming the file, or (a speculative read of an expert nobody chose) returns the
    exact logits; either way the next steps are exact."""
    path = models["arch1"]
    want = ram_run(path)
    raised = 0
    for after in range(6):
        eng = load(path, min_slots(path) + 3)
        toks = tokens(eng.config, STEPS, 1)
        eng.prefill(tokens(eng.config, PREFILL, 0))
        eng._native._inject_io_fault(after, kind, delay_ms)
        try:
            got = within(30, eng.step, toks[0], PREFILL)
            assert np.array_equal(got, want[1]), f"fault on read {after}: garbage instead of an error"
            start = 1
        except xp.ExpertIOError as e:
            msg = str(e)
            assert str(path) in msg and ("Input/output error" in msg if kind == "eio" else "returned" in msg)
            assert len(eng._cached) == PREFILL
            raised += 1
            start = 0
        for i in range(start, 4):
            assert np.array_equal(within(30, eng.step, toks[i], PREFILL + i), want[1 + i])
        eng.close()
    assert raised > 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_with_speculation(models):
    path = models["arch1"]
    check_forked_step(load(path, min_slots(path) + 3, threads=1), path)


# ---- command line, bench ---------------------------------------------------------------------------
def test_cli_and_bench_report_the_speculation_hit_rate(models, capsys):
    from cflow.bench.suite import bench
    from cflow.cli import main

    path = str(models["arch1"])
    args = ["generate", "-m", path, "-p", "abc", "-n", "8", "--temp", "0", "-t", "1", "--experts", "disk",
            "--expert-cache", "400k"]
    assert main(args + ["--expert-speculation", "off", "--no-perf"]) == 0
    off = capsys.readouterr().out
    assert main(args + ["--expert-speculation", "next-layer"]) == 0
    out, err = capsys.readouterr()
    assert out == off and "expert speculation =" in err and "chosen by the layer predicted (next-layer ahead)" in err
    assert "deprecated" not in err
    assert main(args + ["--expert-speculation", "2"]) == 0
    out, err = capsys.readouterr()
    assert out == off and "(2 layers ahead)" in err
    assert main(args + ["--expert-speculation", "soon"]) == 2
    assert "--expert-speculation" in capsys.readouterr().err
    assert main(args + ["--expert-speculation", "next-layer", "--expert-io", "sync"]) == 2
    assert "--expert-speculation" in capsys.readouterr().err
    # the old flag: the same run, and one line first saying it is deprecated
    assert main(args + ["--expert-prefetch", "2"]) == 0
    out, err = capsys.readouterr()
    assert out == off and "(2 layers ahead)" in err
    assert err.splitlines()[0] == "cflow: --expert-prefetch is deprecated; use --expert-speculation"
    assert err.count("deprecated") == 1

    r = bench(path, threads=[1], pp=8, tg=8, reps=1, warmup=False, probe=False, footprint=False,
              experts="disk", expert_cache="400k", expert_speculation="next-layer")
    row = next(x for x in r.to_dict()["rows"] if x["test"] == "tg8")
    assert 0 <= row["speculation_hit_rate"] <= 1 and r.to_dict()["experts"]["speculation"] == "next-layer"
    assert "speculation hit rate" in r.to_markdown()
    r = bench(path, threads=[1], pp=0, tg=8, reps=1, warmup=False, probe=False, footprint=False,
              experts="disk", expert_cache="400k", expert_speculation="off")
    assert r.to_dict()["rows"][0]["speculation_hit_rate"] is None


# ---- the async readers: io_uring, pread threads, and the fallback -----------------------------------
@pytest.mark.parametrize("reader", ["auto", "threads", "uring-refused"])
def test_readers_same_logits_and_clean_failures(models, reader, monkeypatch):
    """io_uring where the kernel offers it (auto), the pread threads, and the threads again after the
    kernel refused io_uring_setup (as where a container blocks it): the same logits, with speculation
    on; a failed read of an expert the first layer needs ends in ExpertIOError, then all goes on."""
    monkeypatch.setenv("CFLOW_EXPERT_READER", reader)
    path = models["arch1"]
    eng = load(path, min_slots(path) + 3)
    c = eng.expert_cache
    if reader == "auto":  # io_uring, or the threads with the kernel's reason
        assert c["reader"] == "io_uring" and c["reader_note"] == "" or \
            c["reader"] == "threads" and "io_uring" in c["reader_note"]
    elif reader == "threads":
        assert c["reader"] == "threads" and c["reader_note"] == ""
    else:
        assert c["reader"] == "threads" and "io_uring_setup: Invalid argument" in c["reader_note"]
    assert all(np.array_equal(a, b) for a, b in zip(within(60, run, eng), ram_run(path)))
    eng.close()

    ram = Engine.load(path, threads=1, experts="ram")
    t = tokens(ram.config, 1, seed=9)[0]
    want = ram.step(t, 0).copy()
    eng = load(path, min_slots(path) + 3)
    # a cold cache: the first read started is one of layer 0's own experts, needed at once
    eng._native._inject_io_fault(0, "eio", 20)
    with pytest.raises(xp.ExpertIOError, match="Input/output error") as e:
        within(30, eng.step, t, 0)
    assert str(path) in str(e.value)
    assert np.array_equal(within(30, eng.step, t, 0), want)
    eng.close()  # joins the readers: every read in flight lands first


def test_bad_reader_is_refused(models, monkeypatch):
    monkeypatch.setenv("CFLOW_EXPERT_READER", "carrier-pigeon")
    with pytest.raises(EngineError, match="CFLOW_EXPERT_READER"):
        load(models["arch1"], 10**6)
