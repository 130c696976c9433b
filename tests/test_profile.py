"""The profiler (`Engine.profile`, `cflow bench --profile --trace`, engine.h "profiling") on tiny
dense and MoE models: it covers every op of the plan on every thread, its times are non-negative
and add up to the call, the Chrome trace has one track per thread with every layer's ops, and
turning it on does not change a single bit of the logits.

How closely the per-op times add up to the step time, and why: each thread cuts its walk of the
plan into *contiguous* segments (one clock read per boundary), so thread 0, which opens the call
and closes it after joining the others, tiles the call exactly except for the instant between
its last segment and the call's return: its segments sum to the call's time within 1% + 5 us
(SUM_TOL). A worker's segments start when it wakes up and end when it finishes, so they sum to at
most the call (its "(unaccounted)" rest is wake-up and early finish); the table's rows, with
"(unaccounted)", sum to the total by construction. No speed is asserted.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from cflow import _native
from cflow.cli import main
from cflow.bench.profile import profile_engine
from cflow.runtime import Engine

from test_engine import small_config, write_random_model

SUM_TOL = (0.01, 5_000)  # relative, ns: thread 0's segments vs the call (module docstring)
PER_LAYER = {"attn": ("norm", "attn.qkv", "attn.cache", "attn.wo"), "dense": ("dense.gate_up", "dense.down"),
             "route": ("route",), "experts": ("experts.gate_up", "experts.down"), "resid": ("resid",)}


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / f"{request.param}.cflow"
    if request.param == "dense":
        cfg = small_config("llama", n_layers=3)
        write_random_model(path, cfg, "q4_1", (32, 64))
    else:
        cfg = small_config("arch2_4_combined", n_layers=3)
        write_random_model(path, cfg, "q4_0", (32, 64))
    return path, cfg


def expected_segments(eng: Engine) -> set[tuple[str, int]]:
    """(kind, layer) every thread must record in every call: each plan op's phases."""
    want = {("embed", 0), ("lm_head", 0)}
    for op in eng.plan.ops:
        for kind in PER_LAYER.get(op.kind, ()):
            want.add((kind, op.layer))
    return want


@pytest.mark.parametrize("threads", [1, 2])
def test_profile_covers_every_op_and_adds_up(model, threads):
    path, cfg = model
    with Engine.load(path, threads=threads, n_ctx=64, max_batch=8) as eng:
        prof = profile_engine(eng, steps=6, prefill=20, warmup=2)
        assert not eng._native.profiling  # off again afterwards
        want = expected_segments(eng)
    assert prof.dropped == 0 and prof.threads == threads
    kinds = _native.PROFILE_KINDS
    assert prof.decode.n_calls == 6 and prof.prefill.n_calls == 3  # 20 tokens in batches of 8
    for phase in (prof.decode, prof.prefill):
        assert len(phase.events) == threads
        calls = phase.calls
        assert (calls["t1"] >= calls["t0"]).all()
        for t, ev in enumerate(phase.events):
            assert len(ev) and (ev["t1"] >= ev["t0"]).all()  # non-negative durations
            assert (ev["t0"][1:] >= ev["t1"][:-1]).all()  # a thread's segments never overlap
            got = {(kinds[k], int(l)) for k, l in zip(ev["kind"], ev["layer"])}
            missing = {w for w in want if w[0] != "lm_head" or phase.name == "decode"} - got
            assert not missing, f"{phase.name} thread {t} lacks {sorted(missing)}"
            if threads > 1:
                assert ("wait", cfg.n_layers - 1) in got
            # per call: every event lies inside its call; thread 0's tile the call
            which = np.searchsorted(calls["t0"], ev["t0"], side="right") - 1
            assert (which >= 0).all() and (ev["t1"] <= calls["t1"][which]).all()
            dur = np.bincount(which, weights=ev["t1"] - ev["t0"], minlength=len(calls))
            span = (calls["t1"] - calls["t0"]).astype(float)
            assert (dur <= span).all()
            if t == 0:
                assert (np.abs(span - dur) <= SUM_TOL[0] * span + SUM_TOL[1]).all(), (span, dur)
            # one attn.qkv per layer per call on every thread
            qkv = ev[ev["kind"] == kinds.index("attn.qkv")]
            assert np.bincount(qkv["layer"], minlength=cfg.n_layers).tolist() == [len(calls)] * cfg.n_layers
        rows = phase.rows()
        assert rows[-1]["op"] == "total" and rows[-2]["op"] == "(unaccounted)"
        assert sum(r["ms"] for r in rows[:-1]) == pytest.approx(rows[-1]["ms"])
        assert all(r["ms"] >= 0 for r in rows if r["op"] != "(unaccounted)")
        assert rows[-2]["ms"] >= -1e-9 and rows[-2]["share"] <= 1
        assert {r["op"] for r in rows} >= {"attn.qkv", "attn.wo", "lm_head"}
        assert next(r for r in rows if r["op"] == "attn.qkv")["gbs"] > 0  # bytes from the tensor table
    if cfg.has_moe:
        assert prof.decode.bytes_per_call["experts.gate_up"] > 0
    md = prof.to_markdown()
    assert "| attn.qkv |" in md and "| wait |" in md if threads > 1 else "| attn.qkv |" in md


def test_trace_has_one_track_per_thread_with_every_layer(model, tmp_path):
    path, cfg = model
    with Engine.load(path, threads=2, n_ctx=64, max_batch=8) as eng:
        prof = profile_engine(eng, steps=4, prefill=8, warmup=1)
    out = tmp_path / "t.json"
    prof.write_trace(out)
    trace = json.loads(out.read_text())
    ev = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "thread 0", 1: "thread 1"}
    xs = [e for e in ev if e["ph"] == "X"]
    assert {e["tid"] for e in xs} == {0, 1} and all(e["dur"] >= 0 and e["ts"] >= 0 for e in xs)
    for tid in (0, 1):
        mine = {e["name"] for e in xs if e["tid"] == tid}
        for l in range(cfg.n_layers):
            assert {f"L{l} attn.qkv", f"L{l} attn.wo", f"L{l} resid", f"L{l} wait"} <= mine
            assert (f"L{l} dense.gate_up" in mine) == bool(cfg.d_ff)
            assert (f"L{l} route" in mine) == cfg.has_moe
        assert {"decode 0", "prefill 0 (8 tokens)", "embed", "lm_head"} <= mine
        # every segment nests inside its call's event on the same track (Perfetto draws it below)
        calls = sorted((e["ts"], e["ts"] + e["dur"]) for e in xs if e["tid"] == tid and e["cat"] in ("decode", "prefill")
                       and e["name"].split()[0] in ("decode", "prefill"))
        for e in xs:
            if e["tid"] != tid or e["name"].startswith(("decode ", "prefill ")):
                continue
            assert any(a - 1e-3 <= e["ts"] and e["ts"] + e["dur"] <= b + 1e-3 for a, b in calls), e


def test_logits_bit_identical_with_profiling_on(model):
    path, cfg = model
    toks = [3, 17, 250, 9, 41, 77, 5, 120, 33, 8, 64]
    with Engine.load(path, threads=2, n_ctx=64, max_batch=4) as eng:
        def run():
            eng.reset()
            out = [eng.prefill(toks).copy()]
            tok = int(np.argmax(out[0]))
            for pos in range(len(toks), len(toks) + 5):
                out.append(eng.step(tok, pos).copy())
                tok = int(np.argmax(out[-1]))
            return out

        off = run()
        eng._native.profile_start(16)
        on = run()
        eng._native.profile_stop()
        assert len(np.frombuffer(eng._native.profile_calls(), np.uint8)) > 0
        eng._native.profile_free()
        again = run()
    for a, b, c in zip(off, on, again):
        assert np.array_equal(a, b) and np.array_equal(a, c)


def test_events_per_call_bound_holds_for_a_full_batch(model):
    """The buffers are sized from the plan; a batch routing to every expert must still fit."""
    path, cfg = model
    with Engine.load(path, threads=2, n_ctx=96, max_batch=64) as eng:
        prof = profile_engine(eng, steps=1, prefill=64, warmup=0)
        per_call = eng._native.profile_events_per_call
    assert prof.dropped == 0
    assert max(len(ev) for ev in prof.prefill.events) <= per_call


def test_disk_experts_profile_their_io(tmp_path):
    cfg = small_config("arch2_4_combined", n_layers=3)
    path = tmp_path / "moe.cflow"
    write_random_model(path, cfg, "q4_0", (32, 64))
    with Engine.load(path, threads=2, n_ctx=64, experts="disk", expert_cache="1G", expert_io="sync") as eng:
        prof = profile_engine(eng, steps=4, prefill=0, warmup=1)
    assert prof.prefill is None and prof.dropped == 0
    got = {r["op"] for r in prof.decode.rows()}
    assert {"experts.io", "experts.gate_up", "route"} <= got


def test_cli_bench_profile_and_trace(model, tmp_path, capsys):
    path, cfg = model
    trace = tmp_path / "t.json"
    assert main(["bench", "-m", str(path), "-t", "1,2", "-p", "16", "-n", "4", "--profile", "--trace", str(trace),
                 "-q", "--no-verify"]) == 0
    out = capsys.readouterr().out
    assert out.count("| attn.qkv |") == 4 and "1 thread(s)" in out and "2 thread(s)" in out
    ev = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in ev} == {1, 2}  # one process per thread count
    assert {e["tid"] for e in ev if e["pid"] == 2 and e["ph"] == "X"} == {0, 1}
    assert main(["bench", "-m", str(path), "-t", "1", "-p", "0", "-n", "3", "--profile", "--json", "-q"]) == 0
    d = json.loads(capsys.readouterr().out)["profiles"][0]
    assert d["decode"]["calls"] == 3 and "prefill" not in d
    assert main(["bench", "-m", str(path), "--trace", str(trace), "-q"]) == 2  # --trace needs --profile
    assert "--profile" in capsys.readouterr().err


def test_profile_context_shorter_than_a_batch(model, capsys):
    """-p 32 -n 16 sizes the context to 40 positions, fewer than a prefill batch: the untimed warm-up
    prefill must fit it (it once asked for 52 and failed with a context error)."""
    path, _ = model
    assert main(["bench", "-m", str(path), "-t", "1", "-p", "32", "-n", "16", "--profile", "-q", "--no-verify"]) == 0
    assert "| attn.qkv |" in capsys.readouterr().out


def test_batched_steps_profile(model, capsys):
    # --batch N: N sequences per step (Engine.step_batch); every row gets logits, so lm_head's
    # multiply-adds are N times a decode step's, its bytes the same
    path, cfg = model
    with Engine.load(path, threads=2, n_ctx=64, n_seq=4) as eng:
        prof = profile_engine(eng, steps=5, prefill=0, warmup=2, batch=4)
        want = expected_segments(eng)
        assert eng.cached(3) == []  # reset afterwards
    assert prof.batch.n_calls == 5 and prof.batch.tokens_per_call == 4 and prof.dropped == 0
    kinds = _native.PROFILE_KINDS
    for ev in prof.batch.events:
        assert want <= {(kinds[k], int(l)) for k, l in zip(ev["kind"], ev["layer"])}
    b, d = prof.batch, prof.decode
    assert b.flops_per_call["lm_head"] == pytest.approx(4 * d.flops_per_call["lm_head"])
    assert b.flops_per_call["attn.qkv"] == pytest.approx(4 * d.flops_per_call["attn.qkv"])
    assert b.bytes_per_call["lm_head"] == pytest.approx(d.bytes_per_call["lm_head"])
    assert "batched step of 4 sequences" in prof.to_markdown()
    with Engine.load(path, threads=1, n_ctx=64, n_seq=2) as eng, pytest.raises(Exception, match="n_seq >= 4"):
        profile_engine(eng, steps=2, prefill=0, batch=4)
    assert main(["bench", "-m", str(path), "-t", "1", "-p", "0", "-n", "3", "--profile", "--batch", "3", "--json",
                 "-q", "--no-verify"]) == 0
    d = json.loads(capsys.readouterr().out)["profiles"][0]
    assert d["batch"]["calls"] == 3 and d["batch"]["tokens_per_call"] == 3
    assert main(["bench", "-m", str(path), "--batch", "3", "-q"]) == 2  # --batch needs --profile
    assert main(["bench", "-m", str(path), "--profile", "--batch", "1", "-q"]) == 2
    capsys.readouterr()
