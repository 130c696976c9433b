"""The benchmark suite behind `cflow bench`: the cflow runner, the report, and `bench()` which runs
the read-bandwidth probe, the footprint measurement and the pp/tg tests for each thread count.

The cflow side loads the model through Engine (a .gguf is converted once into the cache); the
llama.cpp side (optional) runs the original .gguf with the same threads, interleaved in one run.
Weight bytes per token come from the engine, never from arithmetic here: what a row reports is
the C engine's own count (`Engine.counters()`); the tensor table's figure
(`Engine.weight_bytes_per_token()`) is shown beside it as a cross-check. With experts on disk
(`experts="disk"`, or "auto" choosing it) the tg rows also report what the expert cache did, from
the same counters: disk_bytes_per_token, expert_cache_hit_rate, io_stall_ms_per_token, and with
expert speculation speculation_hit_rate (share of the experts predicted for a layer that it chose).
`prefetch` (--prefetch off|default|N) sets the kernels' software prefetch (PREFETCHT0; cflow.runtime.prefetch);
every cflow row records it.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from cflow.bench.machine import machine_info
from cflow.bench.runner import BenchRow, run_tests
from cflow.errors import CflowError
from cflow.runtime import usable_threads
from cflow.runtime.files import format_size
from cflow.runtime.options import EngineOptions

BASELINES = ("llama.cpp",)
WEIGHT_COUNTERS = ("attn", "dense", "router", "experts", "embed", "lm_head")  # Engine.counters() keys


class CflowRunner:
    """The Runner protocol over cflow.Engine: batched prefill, one native call per decode step."""

    name = "cflow"

    def __init__(self, model: str | Path, threads: int, n_ctx: int | None, progress=None,
                 options: EngineOptions | None = None, **overrides: Any):
        """The model loaded with `options` (keywords override its fields, as in Engine.load), at
        `threads` threads and `n_ctx` positions (None: the engine's default)."""
        from cflow.runtime import Engine

        opts = EngineOptions.build(options, **overrides).replace(threads=threads, n_ctx=n_ctx)
        self.engine = Engine.load(model, opts, log=progress)

    def reset(self) -> None:
        self.engine.reset()
        self.engine.reset_counters()

    def reset_counters(self) -> None:
        self.engine.reset_counters()

    def prefill(self, tokens: np.ndarray, pos0: int = 0) -> None:
        self.engine.prefill(tokens, pos0)

    def step(self, token: int, pos: int) -> int:
        return int(np.argmax(self.engine.step(token, pos)))

    def weight_bytes_per_token(self) -> float | None:
        """Weight bytes the engine's own counters saw per token in the last test (KV reads excluded)."""
        c = self.engine.counters()
        if not c.get("tokens"):
            return None
        weights = sum(c[k] for k in WEIGHT_COUNTERS)
        return weights / c["tokens"]

    def expert_stats(self) -> dict | None:
        """What the disk expert cache did per token in the last test; None with experts in RAM."""
        c = self.engine.counters()
        if self.engine.expert_cache is None or not c.get("tokens"):
            return None
        from cflow.runtime.experts import speculation_hit_rate

        looked = c["cache_hits"] + c["cache_misses"]
        return {"disk_bytes_per_token": c["disk_bytes"] / c["tokens"],
                "expert_cache_hit_rate": c["cache_hits"] / looked if looked else None,
                "io_stall_ms_per_token": c["io_stall_ns"] / 1e6 / c["tokens"],
                "speculation_hit_rate": speculation_hit_rate(c)}


@dataclass
class BenchReport:
    model: str
    machine: dict
    rows: list[BenchRow]
    bandwidth_gbs: dict[int, float] = field(default_factory=dict)  # threads -> measured read GB/s
    model_bytes: int | None = None
    footprint: dict | None = None  # load time, time to first token, resident memory (fresh process)
    # the tensor table's weight bytes per token (Engine.weight_bytes_per_token): a cross-check of the
    # counted bytes in the rows (MoE: top_k experts of average size, so routing moves the count a little)
    table_bytes_per_token: float | None = None
    # prefill compute: int8 multiply-add peak of the engine's kernel table per thread count (GOP/s,
    # cflow._native.int8_peak) and the matmul multiply-adds one prompt token costs
    int8_peak_gops: dict[int, float] = field(default_factory=dict)
    macs_per_token: float | None = None
    experts: dict | None = None  # disk residency: Engine.expert_cache plus why (None: experts in RAM)
    expert_rows: dict[str, dict] = field(default_factory=dict)  # "threads:test" -> CflowRunner.expert_stats()
    prefetch: str = "default"  # cflow's software prefetch: "default", "off" or bytes ahead (prefetch.label)
    weights: dict | None = None  # where cflow's weights live: Engine.weights_memory() (cflow.runtime.pages)
    spec_rows: list = field(default_factory=list)  # cflow.bench.speculative.SpecRow per thread count (--spec)
    date: str = field(default_factory=lambda: _dt.datetime.now().isoformat(timespec="seconds"))

    def ratio(self, row: BenchRow) -> float | None:
        """cflow's tokens/s over the baseline's for the same test and threads."""
        if row.engine == "cflow":
            return None
        ours = next((r for r in self.rows if r.engine == "cflow" and r.test == row.test
                     and r.threads == row.threads), None)
        return ours.mean_ts / row.mean_ts if ours and row.mean_ts > 0 else None

    def to_dict(self) -> dict:
        return {
            "model": self.model, "date": self.date, "machine": self.machine,
            "model_bytes": self.model_bytes, "table_bytes_per_token": self.table_bytes_per_token,
            "bandwidth_gbs": {str(k): v for k, v in self.bandwidth_gbs.items()},
            "int8_peak_gops": {str(k): v for k, v in self.int8_peak_gops.items()},
            "macs_per_token": self.macs_per_token,
            "footprint": self.footprint, "experts": self.experts,
            "prefetch": self.prefetch, "weights": self.weights,
            "rows": [dict(r.to_dict(), ratio_cflow_over_this=self.ratio(r), pct_of_probe=self._pct(r),
                          prefetch=self.prefetch if r.engine == "cflow" else None,
                          **self._compute_fields(r), **self._expert_fields(r)) for r in self.rows],
            "speculative": [r.to_dict() for r in self.spec_rows],
        }

    def _expert_fields(self, row: BenchRow) -> dict:
        if self.experts is None or row.engine != "cflow":
            return {}
        keys = ("disk_bytes_per_token", "expert_cache_hit_rate", "io_stall_ms_per_token", "speculation_hit_rate")
        got = self.expert_rows.get(f"{row.threads}:{row.test}") or {}
        return {k: got.get(k) for k in keys}

    def _expert_lines(self) -> list[str]:
        x = self.experts
        if not x:
            return []
        lines = [f"experts on disk: cache {format_size(x['cache_bytes'])} ({x['slots']} slots of "
                 f"{format_size(x['slot_bytes'])}), {x['read']} reads, {x['io']} I/O, expert "
                 f"speculation {x.get('speculation', 'off')}; {x['reason']}"]
        for key, st in sorted(self.expert_rows.items()):
            rate, pred = st["expert_cache_hit_rate"], st.get("speculation_hit_rate")
            lines.append(f"  {key.split(':')[0]} thr {key.split(':')[1]}: {format_size(st['disk_bytes_per_token'])}/token "
                         f"from disk, hit rate {'–' if rate is None else f'{100 * rate:.1f}%'}, I/O stall "
                         f"{st['io_stall_ms_per_token']:.3f} ms/token"
                         + ("" if pred is None else f", speculation hit rate {100 * pred:.1f}%"))
        return lines

    def _compute_fields(self, row: BenchRow) -> dict:
        """pp rows: matmul GOP/s (2 ops per multiply-add) and its share of the int8 peak."""
        if not row.test.startswith("pp") or not self.macs_per_token:
            return {}
        gops = 2.0 * self.macs_per_token * row.mean_ts / 1e9
        peak = self.int8_peak_gops.get(row.threads)
        return {"gops": gops, "pct_of_int8_peak": 100.0 * gops / peak if peak else None}

    def _compute_lines(self) -> list[str]:
        lines = []
        for r in self.rows:
            f = self._compute_fields(r)
            if f:
                pct = f["pct_of_int8_peak"]
                lines.append(f"  {r.engine} {r.test} at {r.threads} thr: {f['gops']:.0f} GOP/s"
                             + (f" = {pct:.0f}% of the peak" if pct else ""))
        if not lines:
            return []
        isa = self.machine.get("isa")
        peak = ", ".join(f"{t} thr {g:.0f} GOP/s" for t, g in sorted(self.int8_peak_gops.items()))
        return [f"prefill compute ({2 * self.macs_per_token / 1e9:.2f} G int8 ops per prompt token in the weight "
                f"matrices; attention over the cache not counted)" + (f"; int8 multiply-add peak of the {isa} "
                                                                      f"kernels: {peak}" if peak else "") + ":",
                *lines]

    def _prefetch_words(self) -> str:
        p = self.prefetch
        return "off (no PREFETCH instruction in any kernel)" if p == "off" else (
            f"PREFETCHT0 {p} B ahead in every weight-streaming kernel")

    def _pct(self, row: BenchRow) -> float | None:
        bw = self.bandwidth_gbs.get(row.threads)
        return 100.0 * row.effective_gbs / bw if (bw and row.effective_gbs) else None

    def _footprint_lines(self) -> list[str]:
        f = self.footprint
        if not f:
            return []
        rest = f["rss_after_first_token"] - f["file_bytes"]
        return [
            f"load {f['load_s']:.2f} s; time to first token {f['ttft_s'] * 1000:.0f} ms "
            f"({f['prompt_tokens']}-token prompt, {f['threads']} threads)",
            f"resident memory: {format_size(f['rss_before_load'])} before load (Python, numpy, C core); "
            f"{format_size(f['rss_after_load'])} after load ("
            f"{'weights copied in' if f.get('weights') == 'copy' else 'mapped: weights not paged in yet'}); "
            f"{format_size(f['rss_after_first_token'])} after the first token = file "
            f"{format_size(f['file_bytes'])} (every weight page touched) + {format_size(rest)}, of which "
            f"{format_size(rest - f['rss_before_load'])} beyond the bare interpreter (tokenizer, buffers, "
            f"KV pages used so far; the KV cache reserves {format_size(f['kv_cache_bytes'])} for n_ctx "
            f"{f['n_ctx']}, resident only as the context fills)",
        ]

    def _weights_line(self) -> list[str]:
        w = self.weights
        if not w:
            return []
        if w["placement"] == "map":
            return [f"cflow weights: the file's mapping, 4 KiB pages ({w['reason']})"]
        got = w.get("huge_page_bytes")
        backed = f", {format_size(got)} of {format_size(w['bytes'])} in 2 MiB pages" if got is not None else ""
        return [f"cflow weights: copied into memory{' (MADV_HUGEPAGE)' if w['huge_pages'] else ''}{backed}"]

    def _bytes_line(self) -> list[str]:
        counted = sorted({r.bytes_per_token for r in self.rows if r.engine == "cflow" and r.bytes_per_token})
        if not counted or not self.table_bytes_per_token:
            return []
        seen = " to ".join(dict.fromkeys(format_size(b) for b in (counted[0], counted[-1])))
        return [f"weights read per token: {seen} counted by the engine in the tg tests; the tensor table "
                f"says {format_size(self.table_bytes_per_token)}"]

    def _cache_line(self) -> list[str]:
        types = sorted({(r.cache_type_k, r.cache_type_v) for r in self.rows})
        if not types or types == [("f16", "f16")]:
            return []
        return ["KV cache: " + ", ".join(f"K {k}, V {v}" for k, v in types) + " (every engine in the table)"]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_markdown(self) -> str:
        m = self.machine
        lines = [
            f"model: `{self.model}`" + (f" ({format_size(self.model_bytes)})" if self.model_bytes else ""),
            f"machine: {m['cpu']}, {m['usable_cores']} usable cores, ISA {m.get('isa')}, "
            f"cflow {m['cflow']} ({m.get('commit') or 'no git'}), {self.date}",
            *([f"cflow software prefetch: {self._prefetch_words()}"] if self.prefetch != "default" else []),
            *self._weights_line(),
            *(["read bandwidth (cflow probe): " + ", ".join(
                f"{t} thr {bw:.1f} GB/s" for t, bw in sorted(self.bandwidth_gbs.items()))]
              if self.bandwidth_gbs else []),
            *self._bytes_line(),
            *self._compute_lines(),
            *self._expert_lines(),
            *self._footprint_lines(),
            *self._cache_line(),
            *([f"llama.cpp: {m['llama_cpp_note']}"] if m.get("llama_cpp_note") else []),
            "",
            "| engine | threads | test | t/s | weight MB/token | eff. GB/s | % of probe | cflow / this |",
            "|---|---:|---|---:|---:|---:|---:|---:|",
        ]
        for r in self.rows:
            ratio = self.ratio(r)
            pct = self._pct(r)
            lines.append(
                f"| {r.engine} | {r.threads} | {r.test} | {r.mean_ts:.2f} ± {r.stddev_ts:.2f} | "
                f"{r.bytes_per_token / 1e6:.1f} | {r.effective_gbs:.1f} | " if r.bytes_per_token else
                f"| {r.engine} | {r.threads} | {r.test} | {r.mean_ts:.2f} ± {r.stddev_ts:.2f} | – | – | ")
            lines[-1] += (f"{pct:.0f}% | " if pct else "– | ") + (f"{ratio:.2f}× |" if ratio else "– |")
        if self.spec_rows:
            from cflow.bench.speculative import MARKDOWN_HEAD

            lines += ["", "Speculative decoding against plain greedy decoding from the same prompt (both generate "
                      "exactly the same number of tokens, alternating):", "", MARKDOWN_HEAD,
                      *(r.markdown_row() for r in self.spec_rows)]
            notes = [f"- {r.threads} thread(s), {r.proposer}: {r.gate_note}" for r in self.spec_rows if r.gate_note]
            if notes:
                lines += ["", "The acceptance gate:", *notes]
        return "\n".join(lines)


def bench(model: str | Path, *, threads: list[int] | None = None, pp: int = 512, tg: int = 128,
          reps: int = 5, warmup: bool = True, compare: str | None = None, n_ctx: int | None = None,
          probe: bool = True, footprint: bool = True, progress: Callable[[str], None] | None = None,
          depths: list[int] | None = None, options: EngineOptions | None = None, spec: Any = None,
          spec_prompt: str | None = None, **overrides: Any) -> BenchReport:
    """Run the suite. threads: the counts to test (default: every usable core; 0 also means that);
    the tg test always runs exactly `tg` decode steps, whatever token comes (EOS included), like
    llama-bench; depths: context depths to run each test at (llama-bench's -d; default [0]).
    `options` (EngineOptions; keywords override its fields, as in Engine.load) say how cflow loads
    the model, except its threads and n_ctx: the suite loads it once per count in `threads`, with a
    context sized to the tests (`n_ctx`, default: what the deepest test needs). verify=False skips
    the checksum check of the model's first use; experts, expert_cache, expert_io, expert_speculation
    place a MoE model's experts; prefetch is the kernels' software prefetch, None (default), 0
    (off) or bytes ahead, recorded in every cflow row. cache_type_k, cache_type_v: the KV cache's
    row types ("f16", "q8_0"), for cflow and for the llama.cpp baseline alike (its type_k / type_v;
    a q8_0 V cache needs its flash attention, which is then on for it); every row records them.
    spec (a cflow.runtime.speculative.Speculative; its draft, if any, a path loaded here at each
    thread count): also time speculative against plain greedy decoding of `tg` tokens from
    `spec_prompt` (text or token ids; default: cflow.bench.speculative.default_prompt), report.spec_rows."""
    from cflow.bench.bandwidth import int8_peak, read_bandwidth

    model = str(model)
    if not Path(model).exists():
        raise CflowError(f"model file not found: {model}")
    if compare is not None and compare not in BASELINES:
        raise CflowError(f"unknown baseline {compare!r}; choose one of {BASELINES}")
    if reps < 1:
        raise CflowError(f"--reps must be >= 1, got {reps}")
    threads = [t or usable_threads() for t in threads] if threads else [usable_threads()]
    from cflow.runtime import prefetch as prefetch_mod

    opts = EngineOptions.build(options, **overrides)  # a bad value fails before anything runs
    # Loading once up front converts a .gguf into the cache and tells us the model's context limit.
    if spec is not None and tg < 1:
        raise CflowError("the speculative test generates -n tokens: give -n >= 1")
    with CflowRunner(model, threads[0], None, progress=progress, options=opts).engine as eng:
        max_ctx = eng.config.max_seq_len
        table_bytes = eng.weight_bytes_per_token()
        macs = eng.matmul_macs_per_token()
        isa = eng.isa
        weights = eng.weights_memory()
        if spec is not None and spec_prompt is None:
            from cflow.bench.speculative import default_prompt

            spec_prompt = default_prompt(eng)
        spec_need = len(eng.encode(spec_prompt)) + tg + 1 if spec is not None else 0
        if spec is not None and spec.proposer == "mtp":
            eng.mtp  # noqa: B018 (a model without heads is refused now, before any test runs)
    depths = list(depths or [0])
    if any(d < 0 for d in depths):
        raise CflowError(f"depths must be >= 0, got {depths}")
    need = max(max(depths) + max(pp, tg), spec_need)
    n_ctx = n_ctx or min(max_ctx, need + 8)  # like llama-bench: room for the test, no more
    if need > n_ctx:
        raise CflowError(f"the test needs {need} positions (depth {max(depths)} + {max(pp, tg)}) but the context "
                         f"is {n_ctx} (model limit {max_ctx}); lower -d/-p/-n")
    report = BenchReport(model=model, machine=machine_info(), rows=[],
                         model_bytes=Path(model).stat().st_size, table_bytes_per_token=table_bytes,
                         macs_per_token=macs if pp > 0 else None, prefetch=prefetch_mod.label(opts.prefetch),
                         weights=weights)
    if footprint:
        from cflow.bench.footprint import measure_in_subprocess

        # the default context a user gets
        report.footprint = measure_in_subprocess(model, threads[-1], verify=opts.verify, hugepages=opts.hugepages)
    for t in threads:
        if probe:
            report.bandwidth_gbs[t] = read_bandwidth(threads=t)
            if progress:
                progress(f"read bandwidth with {t} thread(s): {report.bandwidth_gbs[t]:.1f} GB/s")
            if pp > 0:
                peak = int8_peak(isa, t)
                if peak:
                    report.int8_peak_gops[t] = peak
                    if progress:
                        progress(f"int8 multiply-add peak ({isa}) with {t} thread(s): {peak:.0f} GOP/s")
        runners = [CflowRunner(model, t, n_ctx, progress=progress, options=opts)]
        cache = runners[0].engine.expert_cache
        if cache is not None:
            report.experts = dict(cache, reason=runners[0].engine.residency.reason)
        stats: dict[str, dict] = {}

        def counted(runner, t=t):
            if not isinstance(runner, CflowRunner):
                return None
            st = runner.expert_stats()
            if st is not None:
                stats[str(t)] = st  # the tg test just ran (run_tests asks after each tg test)
            return runner.weight_bytes_per_token()

        if compare == "llama.cpp":
            from cflow.bench.llamacpp import LlamaCppRunner

            runners.append(LlamaCppRunner(model, t, n_ctx, cache_type_k=opts.cache_type_k,
                                          cache_type_v=opts.cache_type_v))
            if not runners[-1].repack:
                from cflow.bench.llamacpp import REPACK_OFF_REASON

                report.machine["llama_cpp_note"] = REPACK_OFF_REASON
        vocab = runners[0].engine.config.vocab_size
        rows = run_tests(runners, t, pp=pp, tg=tg, reps=reps, vocab=vocab, warmup=warmup,
                         progress=progress, bytes_per_token=counted, depths=depths)
        for r in rows:
            r.cache_type_k, r.cache_type_v = opts.cache_type_k, opts.cache_type_v
            if r.engine == "cflow" and r.test.startswith("tg") and str(t) in stats:
                report.expert_rows[f"{t}:{r.test}"] = stats[str(t)]
        # Both engines run the same weights (GGUF blocks are kept bit for bit), so the baseline's
        # tg row reads the same bytes per token; its GB/s column uses cflow's count.
        ours = {r.test: r.bytes_per_token for r in rows if r.engine == "cflow"}
        for r in rows:
            if r.bytes_per_token is None and r.test.startswith("tg"):
                r.bytes_per_token = ours.get(r.test)
        report.rows += rows
        report.machine["isa"] = runners[0].engine.isa
        if spec is not None:
            report.spec_rows.append(_spec_test(runners[0].engine, spec, spec_prompt, tg, reps, warmup, opts, n_ctx,
                                               progress))
        for r in runners:
            if hasattr(r, "close"):
                r.close()
    return report


def _spec_test(eng, spec, prompt, n: int, reps: int, warmup: bool, opts: EngineOptions, n_ctx: int,
               progress):
    """The speculative test on `eng`, its draft model (a path in `spec`) loaded with the same options."""
    import dataclasses

    from cflow.bench.speculative import run_spec_test
    from cflow.runtime import Engine
    from cflow.runtime.speculative import resolve

    draft = None
    if spec.draft is not None:
        draft = Engine.load(spec.draft, opts.replace(threads=eng.threads, n_ctx=n_ctx), log=progress)
        spec = dataclasses.replace(spec, draft=draft)
    try:
        return run_spec_test(eng, resolve(spec, eng), prompt, n, reps, warmup, progress)
    finally:
        if draft is not None:
            draft.close()
