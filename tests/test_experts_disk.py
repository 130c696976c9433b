"""Experts on disk (cflow.runtime.experts, native/experts.c): the engine reads a MoE model's experts from
the file into a bounded cache instead of keeping them in the mapping.

What is held against what:
- logits bit for bit (np.array_equal) against the same model with its experts in RAM, for prefill
  (batches that route to more experts than the cache holds: waves) and decode, async and sync I/O,
  O_DIRECT and buffered reads, budgets from the minimum (constant eviction) to every expert, and
  1-3 threads;
- the bytes read: per step exactly the rounded spans of the experts that were missing (the engine's
  counter, and the kernel's own per-process count of storage reads, /proc/self/io, with O_DIRECT);
- the cache's hits and misses against cachesim.simulate (tests/cachesim.py), the Python statement of the
  eviction policy (recency-weighted frequency on each layer's clock), on the routing trace of the
  same run;
- the budget: never more slots than it pays for, a budget below top_k x layers in flight refused
  with the minimum, the default chosen from the memory probe, `auto` picking disk under a limit;
- failures: an injected I/O error or short read, a file changed on disk: a named error naming the
  file, within seconds (a hang fails the test), and the engine goes on afterwards.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from cflow.runtime import Engine, EngineError  # noqa: E402
from cflow.runtime import experts as xp  # noqa: E402
from cflow.runtime import pages  # noqa: E402
import cachesim  # noqa: E402 (tests/cachesim.py: the policy replayed)
from test_engine import small_config, write_random_model  # noqa: E402

# name -> (preset, config overrides, dtype, tile)
MODELS = {
    "arch2_4_combined": ("arch2_4_combined", {}, "q4_0", (64, 64)),
    "arch1": ("arch1", {}, "q8_0", (16, 32)),
    "arch4": ("arch4", {}, "q4_1", (128, 256)),
    "arch5": ("arch5", {}, "q4_0", (64, 64)),  # two weight sets shared by five layers
    "e8k1": ("arch2_4_combined", {"n_experts": 8, "top_k": 1}, "q8_0", (32, 64)),
    # three outputs per token: only here does the order of the sum show in the last bits
    "e6k3": ("arch4", {"n_experts": 6, "top_k": 3}, "q4_0", (64, 64)),
}
BUDGETS = ("min", "mid", "all")
PREFILL = 13  # with max_batch 8: a full batch and a partial one
STEPS = 12


def round_up(n: int) -> int:
    from cflow import _native

    return -(-n // _native.EXPERT_ALIGN) * _native.EXPERT_ALIGN


def write_models(tmp_path_factory, table: dict) -> dict:
    """{name: path} of a random untied model per row {name: (preset, overrides, dtype, tile)}."""
    out = {}
    for name, (preset, kw, dtype, tile) in table.items():
        path = tmp_path_factory.mktemp(name) / "m.cflow"
        write_random_model(path, small_config(preset, tied=False, **kw), dtype, tile)
        out[name] = path
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_models(tmp_path_factory, MODELS)


def tokens(cfg, n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, cfg.vocab_size, n)]


def run(eng, seed=0):
    """Prefill PREFILL tokens, then STEPS decode steps; every logits vector, copied."""
    cfg = eng.config
    out = [eng.prefill(tokens(cfg, PREFILL, seed)).copy()]
    for i, t in enumerate(tokens(cfg, STEPS, seed + 1)):
        out.append(eng.step(t, PREFILL + i).copy())
    return out


def slot_bytes(path) -> int:
    from cflow.fileformat import open_model

    with open_model(path) as cf:
        return round_up(max(n for _, n in cf.experts.values()))


def budget_bytes(path, which: str, io: str = "async") -> int:
    """"min": exactly the smallest cache the engine takes; "mid": half the experts; "all": every one."""
    probe = load_disk(path, None, io, 1)
    c = probe.expert_cache
    n_keys = probe.config.n_unique_layers * probe.config.n_experts
    probe.close()
    slots = {"min": c["min_slots"], "mid": max(c["min_slots"], n_keys // 2), "all": n_keys}[which]
    return slots * c["slot_bytes"] + c["slot_bytes"] // 2  # half a slot more must buy nothing


def load_disk(path, budget, io="async", threads=2, **kw):
    """io: "async" (experts delayed to the end of their window), "async-undelayed", "sync"."""
    if io == "async-undelayed":
        io, kw["expert_delay"] = "async", False
    return Engine.load(path, threads=threads, experts="disk", expert_cache=budget, expert_io=io, max_batch=8, **kw)


_ram_runs: dict = {}


def ram_run(path):
    if path not in _ram_runs:
        _ram_runs[path] = run(Engine.load(path, threads=2, experts="ram", max_batch=8))
    return _ram_runs[path]


def within(seconds, fn, *args):
    """fn(*args) on a thread; fail if it has not returned after `seconds` (a hang)."""
    box = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s: a waiter was never woken"
    if "error" in box:
        raise box["error"]
    return box.get("value")


# ---- bit for bit against RAM ----------------------------------------------------------------------
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("io", ["async", "async-undelayed", "sync"])
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_bit_identical_to_ram(models, name, io, budget, monkeypatch):
    path = models[name]
    want = ram_run(path)
    b = budget_bytes(path, budget, io)
    # the buffered path (no O_DIRECT) on the middle budget, O_DIRECT on the others
    monkeypatch.setenv("CFLOW_EXPERT_DIRECT", "0" if budget == "mid" else "1")
    for threads in (1, 2, 3):
        eng = load_disk(path, b, io, threads)
        assert eng.expert_cache["read"] == ("buffered" if budget == "mid" else "O_DIRECT")
        assert eng.expert_cache["io"] == io.split("-")[0]
        got = run(eng)
        for i, (g, w) in enumerate(zip(got, want)):
            assert np.array_equal(g, w), f"{name} {io} {budget} threads={threads}: call {i} differs"
        c = eng.counters()
        assert c["cache_misses"] > 0 and c["disk_bytes"] > 0
        if budget == "all":  # every expert read once (on demand, or early by speculation), then only hits
            c = settle(eng)
            assert reads_started(c) == len(set(eng.expert_resident())) <= eng.config.n_experts * eng.config.n_unique_layers
        eng.close()


reads_started = xp.reads_started
settle = xp.settle_reads  # the counters once every read started has landed


def test_ram_residency_reads_nothing_from_disk(models):
    eng = Engine.load(models["arch2_4_combined"], threads=2, experts="ram")
    run(eng)
    c = eng.counters()
    assert eng.expert_cache is None and eng.expert_resident() == []
    assert c["disk_bytes"] == c["cache_hits"] == c["cache_misses"] == c["io_stall_ns"] == 0


# ---- bytes read and the policy --------------------------------------------------------------------
def kernel_read_bytes() -> int | None:
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


@pytest.mark.parametrize("budget", ["min", "all"])
def test_disk_bytes_are_exactly_the_missing_experts(models, budget, monkeypatch):
    monkeypatch.setenv("CFLOW_EXPERT_DIRECT", "1")
    path = models["e8k1"]
    # the demand path alone (speculative reads, counted apart: test_expert_speculation.py)
    eng = load_disk(path, budget_bytes(path, budget), "async", 2, expert_speculation="off")
    cfg = eng.config
    span = {key: round_up(n) for key, (_, n) in eng.file.experts.items()}
    eng.prefill(tokens(cfg, 4))  # dense pages mapped; the cache warm
    direct = eng.expert_cache["read"] == "O_DIRECT"
    resident = set(eng.expert_resident())
    hits = np.array(eng.expert_hits())
    for i, t in enumerate(tokens(cfg, 24, seed=3)):
        c0, io0 = eng.counters(), kernel_read_bytes()
        eng.step(t, 4 + i)
        c1, io1 = eng.counters(), kernel_read_bytes()
        now = np.array(eng.expert_hits())
        chosen = {(int(l) % cfg.n_unique_layers, int(x)) for l, x in zip(*np.nonzero(now - hits))}
        hits = now
        d = {k: c1[k] - c0[k] for k in ("disk_bytes", "cache_hits", "cache_misses")}
        if budget == "all":  # every expert fits: a miss is exactly an expert not read before
            missing = chosen - resident
            assert d["cache_misses"] == len(missing) and d["cache_hits"] == len(chosen) - len(missing)
            assert d["disk_bytes"] == sum(span[k] for k in missing)
        else:  # all experts have the same span here
            assert len(set(span.values())) == 1
            assert d["disk_bytes"] == d["cache_misses"] * next(iter(span.values()))
        assert d["cache_hits"] + d["cache_misses"] == cfg.n_layers * cfg.top_k
        if direct and io0 is not None:  # the kernel saw exactly these reads: no readahead, no re-reads
            assert io1 - io0 == d["disk_bytes"]
        resident = set(eng.expert_resident())
        assert budget != "all" or chosen <= resident


@pytest.mark.parametrize("name", ["e8k1", "arch5", "arch2_4_combined"])
@pytest.mark.parametrize("io", ["async", "sync"])
def test_hits_follow_the_policy(models, name, io):
    """The engine's hits and misses are those of the policy's replay of the same routing trace, and not
    those of LRU (so the comparison can tell the two apart)."""
    path = models[name]
    lru_differs = False
    for budget in ("min", "mid"):
        # the policy alone: the replay knows nothing of speculative reads
        eng = load_disk(path, budget_bytes(path, budget, io), io, 2, expert_speculation="off")
        cache = eng.expert_cache
        trace = cachesim.routing_trace(eng, tokens(eng.config, 40, seed=7))
        c = eng.counters()
        kw = dict(n_experts=eng.config.n_experts, n_unique=eng.config.n_unique_layers,
                  inflight=cache["layers_in_flight"])
        ours = cachesim.simulate(trace, cache["slots"], "lrfu", **kw)
        assert (c["cache_hits"], c["cache_misses"]) == (ours.hits, ours.misses), (name, io, budget)
        lru = cachesim.simulate(trace, cache["slots"], "lru", **kw)
        opt = cachesim.simulate(trace, cache["slots"], "opt", **kw)
        assert opt.hits >= max(ours.hits, lru.hits)
        lru_differs |= (lru.hits, lru.misses) != (ours.hits, ours.misses)
        eng.close()
    assert lru_differs, "this trace cannot tell LFU from LRU: the test would not see the policy change"


def test_policy_beats_lru_when_a_token_needs_more_than_the_cache():
    """Four layers, each routing to its expert 0 70% of the time, a cache of 3 experts: a token
    touches 4, so between two uses of an expert 3 others come in and LRU has always just evicted it;
    the layer-clocked scores keep favourites."""
    rng = np.random.default_rng(0)
    trace = [[[0 if rng.random() < 0.7 else int(rng.integers(1, 4))] for _ in range(4)] for _ in range(500)]
    rate = {p: cachesim.simulate(trace, 3, p, n_experts=4).hit_rate for p in cachesim.POLICIES}
    assert rate["lru"] < 0.05 and rate["lrfu"] > 0.25 and rate["opt"] >= max(rate.values()), rate
    with pytest.raises(ValueError):
        cachesim.simulate(trace, 3, "fifo", n_experts=4)


def test_keep_ranks_move_misses_to_a_steps_last_layers():
    """Keep ranks (cf_xstore_keep, set by engine.c keep_ranks): with routing spread uniformly, ranking
    the layers 8 - l moves the misses out of a step's first layers (there only the cold cache misses)
    into the last ones, where speculation's reads hide them. The count grows a little (here 7%): the
    churning last layers lose experts to the misses of the layers just before them."""
    rng = np.random.default_rng(3)
    L, E = 8, 8
    trace = [[sorted(rng.choice(E, 2, replace=False).tolist()) for _ in range(L)] for _ in range(400)]
    plain = cachesim.simulate(trace, 48, n_experts=E)
    ranked = cachesim.simulate(trace, 48, n_experts=E, keep=[max(0, L - l) for l in range(L)])
    assert plain.misses < ranked.misses <= 1.1 * plain.misses, (ranked.misses, plain.misses)
    assert all(m <= E for m in ranked.layer_misses[:5]), ranked.layer_misses  # cold misses only
    assert sum(ranked.layer_misses[5:]) > 0.95 * ranked.misses
    assert min(plain.layer_misses) > 2 * E  # the plain policy misses everywhere: the test can tell
    assert sum(plain.layer_misses) == plain.misses and sum(ranked.layer_misses) == ranked.misses


# ---- the delay window (cflow.runtime.plan, delay_experts) -----------------------------------------
@pytest.mark.parametrize("moe_input", ["post_dense", "post_attn"])
@pytest.mark.parametrize("dd", [0, 1, 2])
@pytest.mark.parametrize("de", [0, 1, 2, 3])
def test_delayed_plan_feeds_every_op_what_the_undelayed_one_does(de, dd, moe_input):
    """Run both plans symbolically: each experts(l) reads layer l's routing, adds into the pending slot
    the undelayed plan adds into, before the op that consumes that slot and after route(l); the C core
    accepts the pairing and counts de + 1 layers in flight."""
    from cflow import _native
    from cflow.config import ModelConfig
    from cflow.runtime.plan import build_plan

    for L in (1, 2, 3, 6):
        cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=L, n_heads=2, n_kv_heads=1, d_ff=32, n_experts=2,
                          top_k=1, d_expert=32, delta_dense=dd, delta_expert=de, moe_input=moe_input)
        plain, delayed = build_plan(cfg), build_plan(cfg, delay_experts=True)
        assert delayed.n_moe == de + 1 and plain.n_moe == 1 and delayed.stages == plain.stages
        assert sorted(map(repr, plain.ops)) == sorted(
            repr(o if o.kind not in ("route", "experts") else type(o)(o.kind, o.layer, o.a if o.kind == "experts" else 0,
                                                                       0, o.c, o.src)) for o in delayed.ops)
        moe: list = [None] * delayed.n_moe
        pending: list[set] = [set() for _ in range(delayed.n_pending)]
        for op in delayed.ops:
            if op.kind == "route":
                assert moe[op.a] is None, "a routing overwritten before its experts ran"
                moe[op.a] = op.layer
            elif op.kind == "experts":
                assert moe[op.b] == op.layer
                moe[op.b] = None
                pending[op.a].add(op.layer)
            elif op.kind == "resid":
                assert pending[op.c] == {j for j in range(L) if j + de == op.layer}
                pending[op.c] = set()
            elif op.kind == "final":
                assert pending[op.b] == {j for j in range(L) if j + de >= L} and moe == [None] * delayed.n_moe
        assert xp.plan_inflight(delayed, _native) == min(de, L - 1) + 1 and xp.plan_inflight(plain, _native) == 1


def test_core_refuses_a_plan_that_overwrites_a_live_routing(models):
    from cflow import _native
    from cflow.runtime import abi
    from cflow.runtime.plan import build_plan

    eng = Engine.load(models["arch2_4_combined"], threads=1, experts="ram")
    plan = build_plan(eng.config, delay_experts=True)
    enc = abi.encode_plan(plan, _native)
    desc, names = abi.descriptor(eng.file, _native)
    args = (eng.file.buffer, eng.config.to_dict(), desc, names)
    sizes = (plan.n_ring, plan.n_pending, 1, 16, 4)
    _native.NativeEngine(*args, enc, *sizes, plan.n_moe, None)  # as built: fine
    with pytest.raises(ValueError, match="invalid"):  # slot 2 does not exist with 2 moe slots
        _native.NativeEngine(*args, enc, *sizes, plan.n_moe - 1, None)
    route = _native.OP_KINDS.index("route")
    bad = enc.copy()
    bad[bad[:, 0] == route, 3] = 0  # every route into moe slot 0, while layer 0's experts wait
    with pytest.raises(ValueError, match="pairs its route and experts"):
        _native.NativeEngine(*args, bad, *sizes, plan.n_moe, None)
    assert _native.plan_inflight(bad, plan.n_moe) == -1


# ---- the budget ----------------------------------------------------------------------------------
@pytest.mark.parametrize("io", ["async", "sync"])
def test_budget_is_never_exceeded(models, io):
    path = models["arch2_4_combined"]
    sb = slot_bytes(path)
    for budget in (budget_bytes(path, "min", io), budget_bytes(path, "mid", io), 10**9):
        eng = load_disk(path, budget, io, 2)
        c = eng.expert_cache
        n_keys = eng.config.n_experts * eng.config.n_unique_layers
        assert c["slot_bytes"] == sb and c["budget"] == budget
        assert c["slots"] == min(budget // sb, n_keys) and c["cache_bytes"] == c["slots"] * sb <= budget
        cfg = eng.config
        eng.prefill(tokens(cfg, 16))
        assert len(eng.expert_resident()) <= c["slots"]
        for i, t in enumerate(tokens(cfg, 10, seed=2)):
            eng.step(t, 16 + i)
            assert len(eng.expert_resident()) <= c["slots"]
        eng.close()


@pytest.mark.parametrize("io", ["async", "async-undelayed", "sync"])
def test_too_small_budget_is_refused_with_the_minimum(models, io):
    """top_k experts per layer in flight: delta_expert + 1 layers when the experts are delayed
    (async), 1 otherwise."""
    path = models["arch2_4_combined"]
    ok = load_disk(path, None, io, 1)
    c, cfg = ok.expert_cache, ok.config
    assert c["layers_in_flight"] == (cfg.delta_expert + 1 if io == "async" else 1)
    assert c["min_slots"] == cfg.top_k * c["layers_in_flight"]
    minimum = c["min_slots"] * c["slot_bytes"]
    with pytest.raises(EngineError) as e:
        load_disk(path, minimum - 1, io, 1)
    assert e.value.flag == "--expert-cache" and f"at least {minimum} bytes" in str(e.value)
    eng = load_disk(path, minimum, io, 1)
    assert eng.expert_cache["slots"] == c["min_slots"]
    with pytest.raises(EngineError, match="size"):
        Engine.load(path, experts="disk", expert_cache="lots")


def test_core_refuses_a_small_cache_on_its_own(models):
    """The C core checks the minimum too (a caller that skips Python's check)."""
    from cflow import _native
    from cflow.runtime import abi

    eng = Engine.load(models["arch2_4_combined"], threads=1, experts="ram")
    cf, plan = eng.file, eng.plan
    desc, names = abi.descriptor(cf, _native)
    res = xp.Residency("disk", "async", slot_bytes(cf.path) * eng.config.top_k - 1, "test")
    opts = xp.native_options(cf, res, 1)
    with pytest.raises(ValueError, match="needs at least"):
        _native.NativeEngine(cf.buffer, eng.config.to_dict(), desc, names, abi.encode_plan(plan, _native),
                             plan.n_ring, plan.n_pending, 1, 16, 4, plan.n_moe, opts)


def test_default_budget_comes_from_the_memory_probe(models, monkeypatch):
    path = models["e8k1"]
    from cflow.fileformat import open_model

    with open_model(path) as cf:
        file_bytes = cf.buffer.size
    sb = slot_bytes(path)
    # plenty of memory: every expert; a tight limit: the minimum, said so
    monkeypatch.setattr(xp, "probe_memory", lambda root="/": xp.MemoryProbe(10**12, "test"))
    eng = Engine.load(path, threads=1, experts="disk")
    assert eng.expert_cache["slots"] == eng.config.n_experts * eng.config.n_unique_layers
    monkeypatch.setattr(xp, "probe_memory", lambda root="/": xp.MemoryProbe(file_bytes // 4, "test"))
    eng = Engine.load(path, threads=1, experts="disk")
    assert eng.expert_cache["slots"] == eng.expert_cache["min_slots"] and "tight" in eng.residency.reason
    assert eng.expert_cache["slot_bytes"] == sb


def test_auto_picks_disk_when_the_model_does_not_fit(models, monkeypatch):
    path = models["arch2_4_combined"]
    lines: list[str] = []
    monkeypatch.setattr(xp, "probe_memory", lambda root="/": xp.MemoryProbe(100_000, "cgroup memory.max (test)"))
    eng = Engine.load(path, threads=2, log=lines.append)  # experts="auto" is the default
    assert eng.residency.mode == "disk" and eng.expert_cache is not None
    assert any("experts on disk" in s and "do not fit" in s and "cgroup memory.max (test)" in s for s in lines)
    assert np.array_equal(run(eng)[-1], ram_run(path)[-1])
    monkeypatch.setattr(xp, "probe_memory", lambda root="/": xp.MemoryProbe(10**12, "test"))
    lines.clear()
    eng = Engine.load(path, threads=2, log=lines.append)
    assert eng.residency.mode == "ram" and eng.expert_cache is None and "fit" in eng.residency.reason
    assert not lines


def test_memory_probe_reads_cgroup_limits(tmp_path):
    """A fake /proc and /sys: the smallest of MemAvailable and each cgroup's limit minus its use
    (less the page cache it can drop), v2 and v1, the group's own directory or its parent's."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text("MemTotal: 32000000 kB\nMemAvailable: 16000000 kB\n")
    (tmp_path / "proc/self/cgroup").write_text("0::/jobs/mine\n")
    g = tmp_path / "sys/fs/cgroup/jobs"
    (g / "mine").mkdir(parents=True)
    (g / "mine/memory.max").write_text("max\n")
    (g / "memory.max").write_text(f"{3 << 30}\n")
    (g / "memory.current").write_text(f"{2 << 30}\n")
    (g / "memory.stat").write_text(f"anon 1\ninactive_file {512 << 20}\n")
    m = xp.probe_memory(tmp_path)
    assert m.available == (3 << 30) - (2 << 30) + (512 << 20) and "memory.max" in m.source
    (g / "memory.max").write_text("max\n")
    m = xp.probe_memory(tmp_path)
    assert m.available == 16000000 * 1024 and "MemAvailable" in m.source
    (tmp_path / "proc/self/cgroup").write_text("4:memory:/box\n0::/\n")
    v1 = tmp_path / "sys/fs/cgroup/memory/box"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{1 << 30}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{1 << 29}\n")
    m = xp.probe_memory(tmp_path)
    assert m.available == 1 << 29 and "limit_in_bytes" in m.source


def test_dense_models(tmp_path):
    path = tmp_path / "llama.cflow"
    write_random_model(path, small_config("llama"), "q8_0", (32, 64))
    with pytest.raises(EngineError, match="no experts") as e:
        Engine.load(path, experts="disk")
    assert e.value.flag == "--experts"
    for mode in ("auto", "ram"):
        eng = Engine.load(path, threads=1, experts=mode, expert_cache="1G", expert_io="sync")
        assert eng.residency.mode == "ram" and eng.expert_cache is None
    with pytest.raises(EngineError) as e:
        Engine.load(path, experts="sometimes")
    assert e.value.flag == "--experts"
    with pytest.raises(EngineError) as e:
        Engine.load(path, expert_io="later")
    assert e.value.flag == "--expert-io"


def test_no_mmap_copies_all_but_the_experts(models):
    path = models["arch2_4_combined"]
    eng = Engine.load(path, threads=2, experts="disk", mmap=False, max_batch=8)
    assert all(np.array_equal(a, b) for a, b in zip(run(eng), ram_run(path)))
    copy, raw = pages.copy_weights(eng.file), np.fromfile(path, np.uint8)
    experts = np.zeros(raw.size, bool)
    for off, n in eng.file.experts.values():
        experts[off:off + n] = True
    assert experts.any() and not copy[experts].any() and np.array_equal(copy[~experts], raw[~experts])


# ---- failures -----------------------------------------------------------------------------------
@pytest.mark.parametrize("delay_ms", [0, 50])  # 50: every waiter is asleep on the slot when it fails
@pytest.mark.parametrize("kind", ["eio", "short"])
@pytest.mark.parametrize("io", ["async", "sync"])
@pytest.mark.parametrize("threads", [1, 2])
def test_io_fault_raises_names_the_file_and_recovers(models, kind, io, threads, delay_ms):
    path = models["arch2_4_combined"]
    eng = load_disk(path, budget_bytes(path, "min", io), io, threads)
    cfg = eng.config
    want = ram_run(path)
    toks = tokens(cfg, STEPS, 1)
    eng.prefill(tokens(cfg, PREFILL, 0))
    eng._native._inject_io_fault(1, kind, delay_ms)  # the second read from now fails
    with pytest.raises(xp.ExpertIOError) as e:
        within(30, eng.step, toks[0], PREFILL)
    msg = str(e.value)
    assert str(path) in msg and ("Input/output error" in msg if kind == "eio" else "returned" in msg)
    # the positions before the failed one are intact: decoding goes on from there, bit for bit
    assert len(eng._cached) == PREFILL
    for i, t in enumerate(toks):
        assert np.array_equal(within(30, eng.step, t, PREFILL + i), want[1 + i])


@pytest.mark.parametrize("io", ["async", "sync"])
def test_fault_during_prefill_waves(models, io):
    path = models["e8k1"]
    eng = load_disk(path, budget_bytes(path, "min", io), io, 2)
    eng._native._inject_io_fault(5, "eio")
    with pytest.raises(xp.ExpertIOError):
        within(30, eng.prefill, tokens(eng.config, PREFILL, 0))
    assert eng._cached == []
    assert np.array_equal(within(30, eng.prefill, tokens(eng.config, PREFILL, 0)), ram_run(path)[0])


def check_forked_step(eng, path) -> None:
    """After a prefill, a forked child decodes one step and reports whether it matched RAM (within
    30 s: a child waiting for reader threads it does not have would hang); then the parent does."""
    import select

    want = ram_run(path)
    eng.prefill(tokens(eng.config, PREFILL, 0))
    step = tokens(eng.config, STEPS, 1)[0]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one step, then report whether it matched, and leave at once
        try:
            os.write(w, b"1" if np.array_equal(eng.step(step, PREFILL), want[1]) else b"0")
        finally:
            os._exit(0)
    os.close(w)
    ready, _, _ = select.select([r], [], [], 30)
    got = os.read(r, 1) if ready else b""
    if not ready:
        os.kill(pid, 9)
    os.waitpid(pid, 0)
    assert got == b"1", "the forked child hung or computed something else"
    assert np.array_equal(eng.step(step, PREFILL), want[1])  # the parent is unaffected


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_reads_without_the_readers(models):
    """Threads do not survive fork: a child that inherits an engine reads in its own thread instead
    of waiting forever for readers it does not have."""
    path = models["arch2_4_combined"]
    check_forked_step(load_disk(path, budget_bytes(path, "min"), "async", 1), path)


def test_file_changed_on_disk_is_an_error(models, tmp_path):
    src = models["arch2_4_combined"]
    path = tmp_path / "m.cflow"
    path.write_bytes(src.read_bytes())
    eng = load_disk(path, budget_bytes(path, "min"), "async", 2, mmap=False)
    cfg = eng.config
    eng.prefill(tokens(cfg, PREFILL, 0))
    os.truncate(path, os.path.getsize(path) - 8192)  # the last experts and the tail are gone
    with pytest.raises(xp.ExpertIOError, match="changed on disk") as e:
        within(30, eng.step, 5, PREFILL)
    assert str(path) in str(e.value)


def test_memory_filesystem(models):
    """A model on tmpfs: O_DIRECT where the kernel takes it there (Linux >= 6.6), else buffered; the
    same logits either way."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    path = shm / f"cflow-test-{os.getpid()}.cflow"
    try:
        path.write_bytes(models["arch2_4_combined"].read_bytes())
        eng = load_disk(path, budget_bytes(path, "min"), "async", 2)
        assert eng.expert_cache["read"] in ("O_DIRECT", "buffered")
        assert all(np.array_equal(a, b) for a, b in zip(run(eng), ram_run(models["arch2_4_combined"])))
        eng.close()
    finally:
        path.unlink(missing_ok=True)


def test_file_replaced_by_rename_keeps_the_loaded_one(models, tmp_path):
    """A new file renamed over the path does not change what the engine reads (it holds the old
    inode, as the mapping does): results stay those of the loaded model."""
    path = tmp_path / "m.cflow"
    path.write_bytes(models["arch2_4_combined"].read_bytes())
    eng = load_disk(path, budget_bytes(path, "min"), "async", 2)
    other = tmp_path / "other.cflow"
    other.write_bytes(models["arch1"].read_bytes())
    os.replace(other, path)
    assert all(np.array_equal(a, b) for a, b in zip(run(eng), ram_run(models["arch2_4_combined"])))


# ---- command line, bench --------------------------------------------------------------------------
def test_cli_flags(models, capsys):
    from cflow.cli import main

    path = str(models["arch2_4_combined"])
    args = ["generate", "-m", path, "-p", "abc", "-n", "8", "--temp", "0", "-t", "1", "--no-perf"]
    assert main(args + ["--experts", "ram"]) == 0
    ram_out = capsys.readouterr().out
    assert main(args + ["--experts", "disk", "--expert-cache", "50k", "--expert-io", "sync"]) == 0
    out, err = capsys.readouterr()
    assert out == ram_out and "experts on disk" in err and "sync I/O" in err
    assert main(args[:-1] + ["--experts", "disk", "--expert-cache", "150k"]) == 0  # with the timings
    assert "experts on disk =" in capsys.readouterr().err
    assert main(args + ["--experts", "disk", "--expert-cache", "1k"]) == 2
    err = capsys.readouterr().err
    assert "--expert-cache" in err and "at least" in err and "Traceback" not in err


def test_bench_reports_the_expert_cache(models):
    from cflow.bench.suite import bench

    path = models["arch2_4_combined"]
    r = bench(path, threads=[1], pp=8, tg=8, reps=1, warmup=False, probe=False, footprint=False,
              experts="disk", expert_cache=budget_bytes(path, "min"))
    row = next(x for x in r.to_dict()["rows"] if x["test"] == "tg8")
    assert row["disk_bytes_per_token"] > 0 and 0 <= row["expert_cache_hit_rate"] <= 1
    assert row["io_stall_ms_per_token"] >= 0 and r.to_dict()["experts"]["read"] in ("O_DIRECT", "buffered")
    assert "from disk" in r.to_markdown()
    ram = bench(path, threads=[1], pp=0, tg=8, reps=1, warmup=False, probe=False, footprint=False, experts="ram")
    assert ram.to_dict()["experts"] is None and "disk_bytes_per_token" not in ram.to_dict()["rows"][0]
