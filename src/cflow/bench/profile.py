"""Where the time of a forward call goes: per-op times of decode steps and prefill batches, as a
table and as a Chrome trace (`cflow bench --profile [--trace FILE.json]`, `profile_engine(engine)`).

    prof = profile_engine(Engine.load("smollm2.gguf", threads=2), steps=64, prefill=512)
    print(prof.to_markdown())                       # the decode-step and prefill-batch tables
    prof.write_trace("t.json")                      # open in https://ui.perfetto.dev or chrome://tracing

What is measured (engine.h, "profiling"): while profiling is on, every thread of the C core cuts
its walk of the op plan into contiguous segments, one CLOCK_MONOTONIC read per boundary: the
phases of each op (`norm`: RMSNorm and int8 quantization of an op's input, done redundantly by
every thread; `attn.qkv`: the fused QKV mat-vec with RoPE and the K/V store; `attn.cache`:
attention over the KV cache; `attn.wo`: wo plus the residual (on a Gated DeltaNet layer: its
projections in, the conv and the recurrence, ssm_out plus the residual); `dense.gate_up`, `dense.down`;
`route`: MoE norm, router and top-k, on thread 0; `experts.gate_up`, `experts.down`, `experts.io`:
waiting for experts read from disk; `resid`; `lm_head`; `embed`) and `wait`, the time a thread
spent at a barrier for the slowest one. Thread 0's segments tile the whole call: `setup` (RoPE
table, clearing, starting the pool) first, and the final `wait` is its join of the other threads.
Profiling only reads the clock, so the logits are bit-identical with it on or off; when off, each
phase boundary costs one predictable branch on a flag.

The table (per call: one decode step, or one prefill batch of max_batch tokens) gives per op the
time mean over the profiled calls and over the threads, its share of the call (wall time from the
call's start to its return), each thread's own time, and where the engine's counters give bytes,
the bytes the op reads per call and the rate that is over its time (waits excluded: what that
phase achieved while it ran). `(unaccounted)` is the part of the call the mean thread spent
outside any segment: a worker waking up after the call started, or done before it returned.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cflow import weights

EVENT_DTYPE = np.dtype([("t0", "<i8"), ("t1", "<i8"), ("kind", "<i4"), ("layer", "<i4")])
CALL_DTYPE = np.dtype([("t0", "<i8"), ("t1", "<i8"), ("rows", "<i4"), ("pad", "<i4")])
# kinds whose segments are not tied to one layer of the plan (named without "L{layer}" in traces)
GLOBAL_KINDS = ("setup", "embed", "lm_head")


@dataclass
class PhaseProfile:
    """One profiled run of calls: decode steps (one token each), prefill batches, or batched
    decode steps (one token of each of `rows` sequences: Engine.step_batch, what a server runs)."""

    name: str                      # "decode" | "prefill" | "batch"
    kinds: tuple[str, ...]         # _native.PROFILE_KINDS: kind id -> name
    calls: np.ndarray              # CALL_DTYPE [n_calls]
    events: list[np.ndarray]       # per thread, EVENT_DTYPE
    bytes_per_call: dict[str, float] = field(default_factory=dict)  # kind -> bytes one call reads
    flops_per_call: dict[str, float] = field(default_factory=dict)  # kind -> multiply-adds x 2 per call

    @property
    def n_calls(self) -> int:
        return len(self.calls)

    @property
    def call_ns(self) -> float:
        """Mean wall time of a call (ns)."""
        return float(np.mean(self.calls["t1"] - self.calls["t0"])) if self.n_calls else 0.0

    @property
    def tokens_per_call(self) -> float:
        return float(np.mean(self.calls["rows"])) if self.n_calls else 0.0

    def per_thread_ns(self) -> np.ndarray:
        """[threads, kinds]: each thread's total time per kind, per call (ns)."""
        out = np.zeros((len(self.events), len(self.kinds)))
        for t, ev in enumerate(self.events):
            if len(ev):
                np.add.at(out[t], ev["kind"], (ev["t1"] - ev["t0"]).astype(np.float64))
        return out / max(self.n_calls, 1)

    def rows(self) -> list[dict[str, Any]]:
        """The table: one row per kind that occurred, then "(unaccounted)" and "total"."""
        per = self.per_thread_ns()
        mean = per.mean(axis=0) if len(per) else np.zeros(len(self.kinds))
        call = self.call_ns
        out = []
        for k, name in enumerate(self.kinds):
            if not per[:, k].any():
                continue
            b, f = self.bytes_per_call.get(name), self.flops_per_call.get(name)
            ns = float(mean[k])
            out.append({"op": name, "ms": ns / 1e6, "share": ns / call if call else 0.0,
                        "thread_ms": [float(v) / 1e6 for v in per[:, k]],
                        "mb": b / 1e6 if b else None,
                        "gbs": b / ns if b and ns > 0 else None,
                        "gflops": f / ns if f and ns > 0 else None})
        covered = float(mean.sum())
        out.append({"op": "(unaccounted)", "ms": (call - covered) / 1e6,
                    "share": (call - covered) / call if call else 0.0,
                    "thread_ms": [(call - float(v)) / 1e6 for v in per.sum(axis=1)], "mb": None, "gbs": None,
                    "gflops": None})
        total_b = sum(v for v in self.bytes_per_call.values() if v)
        total_f = sum(v for v in self.flops_per_call.values() if v)
        out.append({"op": "total", "ms": call / 1e6, "share": 1.0, "thread_ms": [call / 1e6] * len(per),
                    "mb": total_b / 1e6 if total_b else None, "gbs": total_b / call if call and total_b else None,
                    "gflops": total_f / call if call and total_f else None})
        return out

    def wait_share(self) -> list[float]:
        """Per thread: the share of the call spent waiting at barriers (and, for thread 0, joining)."""
        per = self.per_thread_ns()
        k = self.kinds.index("wait")
        return [float(v) / self.call_ns if self.call_ns else 0.0 for v in per[:, k]]

    def layer_ns(self) -> dict[str, list[float]]:
        """kind -> mean time per call of each layer (mean over threads), for the layer ops."""
        per_layer: dict[str, list[float]] = {}
        n_threads = max(len(self.events), 1)
        L = 1 + max((int(ev["layer"].max()) for ev in self.events if len(ev)), default=0)
        for k, name in enumerate(self.kinds):
            if name in GLOBAL_KINDS:
                continue
            acc = np.zeros(L)
            for ev in self.events:
                sel = ev[ev["kind"] == k]
                np.add.at(acc, sel["layer"], (sel["t1"] - sel["t0"]).astype(np.float64))
            if acc.any():
                per_layer[name] = (acc / n_threads / max(self.n_calls, 1)).tolist()
        return per_layer

    def to_dict(self) -> dict:
        return {"name": self.name, "calls": self.n_calls, "tokens_per_call": self.tokens_per_call,
                "call_ms": self.call_ns / 1e6, "threads": len(self.events), "rows": self.rows(),
                "wait_share_per_thread": self.wait_share(), "layer_ms": {
                    k: [v / 1e6 for v in vs] for k, vs in self.layer_ns().items()}}

    def to_markdown(self) -> str:
        nt = len(self.events)
        what = ("decode step" if self.name == "decode" else
                f"batched step of {self.tokens_per_call:.0f} sequences" if self.name == "batch" else
                f"prefill batch of {self.tokens_per_call:.0f} tokens")
        lines = [f"{self.name}: {self.n_calls} calls, {self.call_ns / 1e6:.3f} ms per {what} "
                 f"({1e9 * self.tokens_per_call / self.call_ns if self.call_ns else 0:.1f} tok/s), {nt} thread(s); "
                 "waiting at barriers: " + ", ".join(f"thread {t} {100 * w:.1f}%" for t, w in enumerate(self.wait_share())),
                 "",
                 "| op | ms/call | share | " + " | ".join(f"thr {t} ms" for t in range(nt)) + " | MB/call | GB/s |",
                 "|---|---:|---:|" + "---:|" * nt + "---:|---:|---:|"]
        lines[2] = lines[2].replace(" | GB/s |", " | GB/s | GFLOP/s |")
        for r in self.rows():
            mb = f"{r['mb']:.2f}" if r["mb"] else "–"
            gbs = f"{r['gbs']:.1f}" if r["gbs"] else "–"
            gf = f"{r['gflops']:.1f}" if r["gflops"] else "–"
            lines.append(f"| {r['op']} | {r['ms']:.4f} | {100 * r['share']:.1f}% | "
                         + " | ".join(f"{v:.4f}" for v in r["thread_ms"]) + f" | {mb} | {gbs} | {gf} |")
        return "\n".join(lines)

    def trace_events(self, pid: int, base_ns: int) -> list[dict]:
        """Chrome-trace "X" events: per thread (tid) one event per call enclosing its segments."""
        us = lambda ns: round((int(ns) - base_ns) / 1000.0, 3)  # noqa: E731
        out = []
        for t, ev in enumerate(self.events):
            for i, c in enumerate(self.calls):
                out.append({"name": f"{self.name} {i}" + (f" ({c['rows']} tokens)" if self.name != "decode" else ""),
                            "cat": self.name, "ph": "X", "pid": pid, "tid": t, "ts": us(c["t0"]),
                            "dur": round((int(c["t1"]) - int(c["t0"])) / 1000.0, 3), "args": {"call": i}})
            for e in ev:
                kind = self.kinds[e["kind"]]
                name = kind if kind in GLOBAL_KINDS else f"L{e['layer']} {kind}"
                out.append({"name": name, "cat": kind, "ph": "X", "pid": pid, "tid": t, "ts": us(e["t0"]),
                            "dur": round((int(e["t1"]) - int(e["t0"])) / 1000.0, 3),
                            "args": {"layer": int(e["layer"])}})
        return out


@dataclass
class Profile:
    """The prefill batches, the decode steps and the batched decode steps of one
    engine."""

    model: str
    threads: int
    isa: str
    decode: PhaseProfile | None
    prefill: PhaseProfile | None
    dropped: int = 0  # events that did not fit the buffers (0 unless something is wrong)
    batch: PhaseProfile | None = None

    def phases(self) -> list[PhaseProfile]:
        return [p for p in (self.decode, self.batch, self.prefill) if p is not None and p.n_calls]

    def to_dict(self) -> dict:
        return {"model": self.model, "threads": self.threads, "isa": self.isa, "dropped": self.dropped,
                **{p.name: p.to_dict() for p in self.phases()}}

    def to_markdown(self) -> str:
        head = f"profile of `{self.model}`, {self.threads} thread(s), ISA {self.isa}"
        return "\n\n".join([head] + [p.to_markdown() for p in self.phases()])

    def trace_events(self, pid: int = 1, base_ns: int | None = None) -> list[dict]:
        phases = self.phases()
        if base_ns is None:
            base_ns = min((int(p.calls["t0"].min()) for p in phases), default=0)
        n = max((len(p.events) for p in phases), default=0)
        meta = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                 "args": {"name": f"cflow {Path(self.model).name}, {self.threads} thread(s)"}},
                {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": t, "args": {"name": f"thread {t}"}}
                 for t in range(n)]
        return meta + [e for p in phases for e in p.trace_events(pid, base_ns)]

    def chrome_trace(self) -> dict:
        return chrome_trace([self])

    def write_trace(self, path: str | Path) -> None:
        write_trace(path, [self])


def chrome_trace(profiles: list[Profile]) -> dict:
    """One trace of several profiles (e.g. one per thread count), one process each, on one timeline."""
    starts = [int(p.calls["t0"].min()) for prof in profiles for p in prof.phases()]
    base = min(starts, default=0)
    events = [e for i, prof in enumerate(profiles) for e in prof.trace_events(pid=i + 1, base_ns=base)]
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"source": "cflow bench --profile", "clock": "CLOCK_MONOTONIC"}}


def write_trace(path: str | Path, profiles: list[Profile]) -> None:
    Path(path).write_text(json.dumps(chrome_trace(profiles), separators=(",", ":")))


# ---- running it ------------------------------------------------------------------------------


def _table_bytes(eng: Any) -> dict[str, float]:
    """Weight bytes one call reads by profile kind, from the file's tensor table (the engine's
    counters agree with it exactly: tests/test_bytes_per_token.py); experts come from the counters."""
    cfg, t = eng.config, eng.file.tensors
    size = lambda name: float(t[name].nbytes) if name in t else 0.0  # noqa: E731
    out: dict[str, float] = dict.fromkeys(("norm", "attn.qkv", "attn.wo", "dense.gate_up", "dense.down",
                                           "route", "lm_head"), 0.0)
    for layer in range(cfg.n_layers):
        p = f"layers.{cfg.weight_layer(layer)}."
        out["norm"] += size(p + "attn_norm") + size(p + "ffn_norm") + size(p + "moe_norm")
        out["attn.qkv"] += size(p + "attn.wqkv") + sum(size(p + part) for part in weights.QKV_PARTS)
        out["attn.qkv"] += size(p + weights.ATTN_GATE_SLOT)
        # a Gated DeltaNet layer's projections in, and its small f32 parts, read in the same phase
        out["attn.qkv"] += sum(size(p + slot) for slot in weights.SSM_SLOTS if slot != "ssm.w_out")
        out["attn.wo"] += size(p + "attn.wo") + size(p + "ssm.w_out")
        out["dense.gate_up"] += size(p + "ffn.w_gate_up")
        out["dense.down"] += size(p + "ffn.w_down")
        out["route"] += size(p + "moe.router")
    out["norm"] += size("norm")
    out["lm_head"] = size("lm_head") if "lm_head" in t else size("tok_emb")
    return out


def _expert_split(eng: Any) -> float:
    """The share of an expert's bytes that is gate_up (the rest is down), over the file's experts."""
    t = eng.file.tensors
    gu = sum(e.nbytes for n, e in t.items() if ".experts." in n and n.endswith("w_gate_up"))
    dn = sum(e.nbytes for n, e in t.items() if ".experts." in n and n.endswith("w_down"))
    return gu / (gu + dn) if gu + dn else 0.0


def _flops(eng: Any, counters: dict[str, int], n_calls: int, rows: float, hits: int,
           logit_rows: float = 1.0) -> dict[str, float]:
    """2 x multiply-adds per call by kind: the mat-vecs over `rows` tokens per call, attention from
    the KV bytes it read (each K/V half meets n_heads / n_kv query heads in one multiply-add),
    lm_head over the rows that got logits (`logit_rows` per call that computed any: the lm_head
    counter counts calls), the experts over the routed tokens (`hits`)."""
    c = eng.config
    d, L, n = c.d_model, c.n_layers, max(n_calls, 1)
    # summed over the attention layers, each at its own widths (Gemma 4's differ: head sizes, KV
    # heads, FFN); Gated DeltaNet layers (Qwen3.5) count their own projections below
    att = [layer for layer in range(L) if not c.is_recurrent(layer)]
    rec = L - len(att)
    q = sum(c.layer_q_dim(layer) for layer in att)
    kv = sum(c.layer_kv_dim(layer) for layer in att)
    ff = sum(c.layer_d_ff(layer) for layer in range(L)) if c.d_ff else 0
    out = {"attn.qkv": 2.0 * d * (q * (2 if c.attn_out_gate else 1) + 2 * kv) * rows, "attn.wo": 2.0 * q * d * rows,
           "attn.cache": counters.get("kv", 0) / 2 * 2 * (c.n_heads / c.n_kv_heads) / n}
    if rec:
        v = c.ssm_v_heads * c.ssm_head_dim
        conv = (2 * c.ssm_k_heads * c.ssm_head_dim + v)
        out["attn.qkv"] += 2.0 * d * (conv + v + 2 * c.ssm_v_heads) * rec * rows
        out["attn.wo"] += 2.0 * v * d * rec * rows
    if c.d_ff:
        out["dense.gate_up"] = 2.0 * d * 2 * ff * rows
        out["dense.down"] = 2.0 * ff * d * rows
    t = eng.file.tensors
    head = t["lm_head"].nbytes if "lm_head" in t else t["tok_emb"].nbytes
    out["lm_head"] = 2.0 * d * c.vocab_size * counters.get("lm_head", 0) / (head + 4 * d) / n * logit_rows
    if c.has_moe:
        out["route"] = 2.0 * d * c.n_experts * L * rows
        out["experts.gate_up"] = 2.0 * d * 2 * c.d_expert * hits / n
        out["experts.down"] = 2.0 * c.d_expert * d * hits / n
    return out


def _collect(eng: Any, name: str, counters: dict[str, int]) -> PhaseProfile:
    from cflow.runtime import abi

    nat = eng._native
    kinds = tuple(abi.native_module().PROFILE_KINDS)
    calls = np.frombuffer(nat.profile_calls(), CALL_DTYPE).copy()
    events = [np.frombuffer(nat.profile_events(t), EVENT_DTYPE).copy() for t in range(nat.active_threads)]
    n = max(len(calls), 1)
    b = _table_bytes(eng)
    b["lm_head"] = counters.get("lm_head", 0) / n  # a prefill computes logits in its last batch only
    b["embed"] = counters.get("embed", 0) / n
    b["attn.cache"] = counters.get("kv", 0) / n
    xb = counters.get("experts", 0) / n
    if xb:
        s = _expert_split(eng)
        b["experts.gate_up"], b["experts.down"] = xb * s, xb * (1 - s)
    hits = int(sum(sum(r) for r in eng.expert_hits())) if eng.config.has_moe else 0
    rows = float(np.mean(calls["rows"])) if len(calls) else 0.0
    f = _flops(eng, counters, len(calls), rows, hits, rows if name == "batch" else 1.0)
    return PhaseProfile(name, kinds, calls, events, {k: v for k, v in b.items() if v},
                        {k: v for k, v in f.items() if v})


def profile_engine(eng: Any, *, steps: int = 64, prefill: int = 512, warmup: int = 4,
                   threads: int | None = None, batch: int = 0) -> Profile:
    """Profile `prefill` prompt tokens (in batches of the engine's max_batch, from position 0) and
    then `steps` decode steps from position `warmup` (after `warmup` untimed steps, like the tg
    test: each step feeds back the most likely token). batch > 1: also `steps` batched decode
    steps of `batch` sequences (Engine.step_batch; the engine needs n_seq >= batch), each from
    position `warmup` like the decode steps. threads: the threads to use (default: the engine's);
    the thread tuner, if any, is held off meanwhile. The engine's sequences are reset."""
    from cflow.bench.runner import synthetic_tokens
    from cflow.runtime.errors import EngineError

    if steps < 0 or prefill < 0 or warmup < 0 or steps + prefill == 0:
        raise EngineError(f"profile needs steps >= 0 and prefill >= 0, not both 0 (got {steps}, {prefill})")
    if batch > 1 and (not steps or batch > eng.n_seq):
        raise EngineError(f"profiling batched steps of {batch} sequences needs steps > 0 and an engine with "
                          f"n_seq >= {batch} (it has {eng.n_seq})")
    if max(prefill, warmup + steps) > eng.n_ctx:
        raise EngineError(f"profiling {prefill} prompt tokens and {warmup} + {steps} steps needs a context "
                          f"of {max(prefill, warmup + steps)}; the engine has {eng.n_ctx} (load with a larger "
                          f"n_ctx)", flag="-c")
    nat = eng._native
    tuner, before = eng.tuner, nat.active_threads
    eng.tuner = None
    nat.active_threads = threads or eng.threads
    dropped = 0
    try:
        vocab = eng.config.vocab_size
        toks = synthetic_tokens(max(prefill, 1) + warmup + steps, vocab)
        pre = None
        # warm-up (untimed): page the weights in, let the pool spin up
        eng.reset()
        eng.prefill(toks[:min(len(toks), nat.max_batch, eng.n_ctx)])  # the context may be shorter than a batch
        if prefill:
            eng.reset()
            eng.reset_counters()
            nat.profile_start(-(-prefill // nat.max_batch))
            eng.prefill(toks[:prefill])
            nat.profile_stop()
            pre = _collect(eng, "prefill", eng.counters())
            dropped += nat.profile_dropped
        dec = None
        if steps:
            eng.reset()
            tok = int(toks[0])
            for pos in range(warmup):
                tok = int(np.argmax(eng.step(tok, pos)))
            eng.reset_counters()
            nat.profile_start(steps)
            for pos in range(warmup, warmup + steps):
                tok = int(np.argmax(eng.step(tok, pos)))
            nat.profile_stop()
            dec = _collect(eng, "decode", eng.counters())
            dropped += nat.profile_dropped
        bat = None
        if batch > 1:
            eng.reset()
            seqs = list(range(batch))
            toks = [int(t) for t in synthetic_tokens(batch, vocab)]
            for pos in range(warmup):
                toks = [int(t) for t in np.argmax(eng.step_batch(seqs, toks, [pos] * batch), axis=1)]
            eng.reset_counters()
            nat.profile_start(steps)
            for pos in range(warmup, warmup + steps):
                toks = [int(t) for t in np.argmax(eng.step_batch(seqs, toks, [pos] * batch), axis=1)]
            nat.profile_stop()
            bat = _collect(eng, "batch", eng.counters())
            dropped += nat.profile_dropped
        return Profile(str(eng.path), nat.active_threads, eng.isa, dec, pre, dropped, bat)
    finally:
        nat.profile_free()
        nat.active_threads = before
        eng.tuner = tuner
        eng.reset()


def profile_model(model: str | Path, *, threads: list[int] | None = None, steps: int = 128, prefill: int = 512,
                  warmup: int = 4, progress=None, batch: int = 0, options: Any = None,
                  **overrides: Any) -> list[Profile]:
    """`cflow bench --profile`: load the model once per thread count (with a context that holds
    the test, and `batch` sequences when batch > 1) and profile it (profile_engine). `options`
    (EngineOptions; keywords override its fields, as in Engine.load: verify, the expert and KV
    cache options, software prefetch) say how; threads, n_ctx and n_seq are the profile's own."""
    from cflow.runtime import Engine, usable_threads
    from cflow.runtime.options import EngineOptions

    opts = EngineOptions.build(options, **overrides)
    out = []
    for t in [t or usable_threads() for t in threads] if threads else [usable_threads()]:
        with Engine.load(model, opts.replace(threads=t, n_ctx=None, n_seq=1), log=progress) as probe:
            limit = probe.config.max_seq_len
        n_ctx = min(limit, max(prefill, warmup + steps) + 8)
        n_seq = batch if batch > 1 else 1
        with Engine.load(model, opts.replace(threads=t, n_ctx=n_ctx, n_seq=n_seq)) as eng:
            if progress:
                more = f" and {steps} batched steps of {batch} sequences" if batch > 1 else ""
                progress(f"profiling {prefill} prompt tokens and {steps} decode steps{more} with {t} thread(s)")
            out.append(profile_engine(eng, steps=steps, prefill=prefill, warmup=warmup, batch=batch))
    return out
