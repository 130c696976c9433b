"""Async vs sync expert I/O, side by side in one process (claim C5).

moe_bench.py runs every configuration in its own cold process under a memory limit: right for
comparing with llama.cpp, but one run per row, and this VM's disk and memory bandwidth drift by a
third within minutes, so two rows minutes apart do not compare. This script loads one engine per
expert-I/O mode on the same model and cache budget (experts on disk, O_DIRECT), brings each cache
to its steady state, then decodes the same teacher-forced tokens in rounds, the engines taking
turns (the order rotates every round), and reports per mode the median ms/token, the I/O stall,
and the ratio of each mode to sync per round (median and spread). A round ends when its engine's
speculative reads have landed, so no engine's reads run in another's round.

In sync mode the stall counter is the time spent reading, so its split of a token into I/O and
compute says where the budget sits on the curve (I/O / compute about 1 is where overlap can at best
double the speed).

    python benchmarks/make_moe.py --preset fine-small --gguf fine.gguf --cflow fine.cflow
    python benchmarks/expert_io_ab.py fine.cflow --budgets 0.9,0.95,0.97 --modes sync,async:off,async:1,async:16

Learned routing: `--corpus` teacher-forces a trained model on held-out stories; `--trace` routes a
model (e.g. one with Mixtral-sized experts and the same layers and top_k) by a trained model's
recorded routing (benchmarks/route_trace.py), speculation predicting what the trained model's
predictor predicted.

The delays alone: `--as-arch arch1,arch1,arch4,arch2_4_combined` loads ONE file once per preset
named, with the file's config given that preset's delays and MoE input (cflow.config.PRESETS: the
tensors are the same shapes for every preset, and with random weights and replayed routing nothing
but the plan differs), so every engine reads the same bytes of the same file: no difference of
files, of where they sit on the disk or of what the host has cached of them can enter the
comparison. A preset named twice is the A/A control (two engines, two caches, one plan).

Load order (`--processes N`): on the VM these pages were measured on, the first engine a process loads
decodes 1.1-1.3x slower than identical engines loaded after it (an A/A control caught it; cause not
found), so an engine's place in the load order is a bias no rotation of turns inside a process can
remove. `--processes N` runs the comparison in N fresh processes one after the other, process p
loading the models (and each model's modes) rotated by p -- with N = the number of models, a Latin
square: every model is loaded in every position once -- and pools them: per-round samples
concatenated (rounds pair within a process), and each ratio also as the geometric mean over the
processes of each process's median per-round ratio (`*_latin`), which weighs every load order
alike. `--rotate-load P` is one such process by hand.

Each engine holds its own cache (budget x all experts' bytes): four modes at 97% of a 2.7 GB model
take about 10 GB of memory. Not for a memory-limited run (use moe_bench.py --limits).
"""

from __future__ import annotations

import argparse
import json
import os
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def parse_mode(text: str) -> tuple[str, str, str, bool, bool]:
    """"sync" or "async:SPECULATION[:TAG...]" -> (io, expert speculation, reader, keep, gate_next).
    SPECULATION: off, next-layer, auto or a depth. TAGs: the reader, auto (the default), threads
    (CFLOW_EXPERT_READER) or qdN (io_uring with N reads in the kernel at once, CFLOW_EXPERT_QD);
    nokeep: the cache without keep ranks (CFLOW_EXPERT_KEEP=0; experts.h), to measure what they add;
    opennext: the next layer's predictions read whatever their precision (CFLOW_SPEC_GATE_NEXT=0,
    engine_spec.c spec_trusted), to measure what gating them does."""
    io, _, rest = text.partition(":")
    sp, *tags = rest.split(":") if rest else [""]
    reader, keep, gate_next = "auto", True, True
    for tag in tags:
        if tag in ("auto", "threads") or (tag.startswith("qd") and tag[2:].isdigit()):
            reader = tag
        elif tag == "nokeep":
            keep = False
        elif tag == "opennext":
            gate_next = False
        else:
            io = "?"
    if io not in ("sync", "async") or (io == "sync" and (sp not in ("", "off") or tags)):
        raise SystemExit(f"mode {text!r}: use sync or async:off|next-layer|auto|N[:auto|threads|qdN][:nokeep][:opennext]")
    return io, (sp or "off") if io == "async" else "off", reader, keep, gate_next


def settle(eng) -> None:
    """Wait until every read the engine started has landed (speculative reads nobody waited for)."""
    from cflow.runtime.experts import settle_reads

    settle_reads(eng, timeout=5.0)


def as_arch(cfg, arch: str | None):
    """The config with preset `arch`'s delays and MoE input (None: as the file says)."""
    import dataclasses

    from cflow.config import PRESETS

    if arch is None:
        return cfg
    keys = ("delta_dense", "delta_expert", "moe_input")
    return dataclasses.replace(cfg, **{k: PRESETS[arch][k] for k in keys if k in PRESETS[arch]})


def open_engine(sub: dict, **kw):
    """An engine over the subject's file, with the subject's preset's plan when it names one."""
    from cflow.fileformat import open_model
    from cflow.runtime import Engine

    if sub.get("arch") is None:
        return Engine.load(sub["converted"], verify=False, **kw)
    cf = open_model(sub["converted"])
    cf.config = as_arch(cf.config, sub["arch"])
    return Engine(cf, **kw)


def prepare(path: str, n_tok: int, corpus: str | None, trace, arch: str | None = None) -> dict:
    """A model's converted file, its total expert bytes and the tokens its engines decode."""
    from cflow.fileformat import open_model
    from cflow.runtime import Engine

    with Engine.load(path, threads=1, n_ctx=max(16, n_tok + 8), experts="ram") as probe:
        converted, vocab = probe.path, probe.config.vocab_size
        if trace is not None:
            trace.check_fits(probe.config)
        if corpus:  # a trained model reads text it was not trained on: its learned routing
            from route_trace import held_out_stream

            toks = held_out_stream(probe, corpus, n_tok)
        else:  # a random model: any tokens route alike
            toks = [int(t) for t in np.random.default_rng(0).integers(1, vocab, n_tok)]
    with open_model(converted) as cf:
        expert_bytes = sum(n for _, n in cf.experts.values())
    return {"path": str(path), "converted": converted, "expert_bytes": expert_bytes, "tokens": toks,
            "trace": trace, "corpus": corpus, "arch": arch}


def rotated(items: list, by: int) -> list:
    k = by % len(items) if items else 0
    return items[k:] + items[:k]


def measure(subjects: list[dict], budget: float, modes: list[str], threads: int, rounds: int, per_round: int,
            warmup: int, rotate: int = 0) -> list[dict]:
    """Every (subject, mode) engine decodes its subject's tokens; all of them take turns in each
    round (the order rotating), so a drift of the machine hits every engine alike. The engines are
    loaded subject by subject, the subjects and each subject's modes rotated by `rotate` (the
    process's row of the load-order Latin square; results stay in the subjects' order)."""
    from cflow.runtime.experts import speculation_hit_rate

    engines = {}
    for si in rotated(list(range(len(subjects))), rotate):
        sub = subjects[si]
        for m in rotated(list(modes), rotate):
            io, sp, reader, keep, gate_next = parse_mode(m)
            os.environ["CFLOW_EXPERT_READER"] = "threads" if reader == "threads" else "auto"  # read at load
            os.environ["CFLOW_EXPERT_QD"] = reader[2:] if reader.startswith("qd") else ""
            os.environ["CFLOW_EXPERT_KEEP"] = "1" if keep else "0"
            os.environ["CFLOW_SPEC_GATE_NEXT"] = "1" if gate_next else "0"
            eng = open_engine(sub, threads=threads, n_ctx=len(sub["tokens"]) + 8, experts="disk",
                              expert_cache=int(budget * sub["expert_bytes"]), expert_io=io, expert_speculation=sp)
            if sub["trace"] is not None:  # every engine of the subject routes by its trace, row after row
                eng.replay_routes(sub["trace"])
            for i, t in enumerate(sub["tokens"][:warmup]):  # the cache's steady state
                eng.step(t, i)
            settle(eng)
            eng.reset_counters()
            engines[si, m] = eng
    keys = list(engines)
    ms: dict = {k: [] for k in keys}
    stall: dict = {k: [] for k in keys}
    for r in range(rounds):
        order = keys[r % len(keys):] + keys[:r % len(keys)]
        for k in order:
            eng, toks, lo = engines[k], subjects[k[0]]["tokens"], warmup + r * per_round
            c0 = eng.counters()
            t0 = time.perf_counter()
            for i in range(lo, lo + per_round):
                eng.step(toks[i], i)
            dt = time.perf_counter() - t0
            settle(eng)
            ms[k].append(dt / per_round * 1e3)
            stall[k].append((eng.counters()["io_stall_ns"] - c0["io_stall_ns"]) / per_round / 1e6)

    results = []
    for si, sub in enumerate(subjects):
        trace = sub["trace"]
        out = {"model": sub["path"] + (f" as {sub['arch']}" if sub.get("arch") else ""), "budget": budget, "threads": threads, "rounds": rounds, "per_round": per_round,
               "tokens": "held-out stories of " + sub["corpus"] if sub["corpus"] else "random",
               "routes": trace.meta.get("source", "a trace") if trace is not None else "the model's own",
               "load_rotation": rotate, "modes": {}}
        for m in modes:
            c = engines[si, m].counters()
            looked = c["cache_hits"] + c["cache_misses"]
            out["modes"][m] = {
                "ms_per_token": statistics.median(ms[si, m]), "stall_ms_per_token": statistics.median(stall[si, m]),
                "disk_mb_per_token": c["disk_bytes"] / (rounds * per_round) / 1e6,
                "cache_hit_rate": c["cache_hits"] / looked if looked else None,
                "speculation_hit_rate": speculation_hit_rate(c),
                "ratio_to_sync": ratio(ms[si, "sync"], ms[si, m]) if "sync" in modes else None,
                # the same mode on the first subject, round by round (--together)
                "ratio_to_first": ratio(ms[0, m], ms[si, m]) if si else None,
                "samples_ms": ms[si, m], "stall_samples_ms": stall[si, m]}
            engines[si, m].close()
        results.append(out)
    return results


def ratio(num: list[float], den: list[float]) -> list[float]:
    """Per round, num's ms over den's ms (den's engine's speed-up): [median, min, max]."""
    per = [a / b for a, b in zip(num, den)]
    return [statistics.median(per), min(per), max(per)]


def balanced(series: list[list[float]], blocks: list[int]) -> float:
    """The geometric mean over processes (blocks of rounds) of each process's median, the median of
    that process's rounds of every series pooled."""
    meds, lo = [], 0
    for n in blocks:
        meds.append(statistics.median(v for s in series for v in s[lo:lo + n]))
        lo += n
    return math.exp(sum(math.log(v) for v in meds) / len(meds))


def latin(num: list[float], den: list[float], blocks: list[int]) -> float:
    """The geometric mean over processes of each process's median per-round ratio num / den."""
    return balanced([[a / b for a, b in zip(num, den)]], blocks)


def pool(runs: list[list[dict]]) -> list[dict]:
    """One result list from several processes' (each a list over the same subjects and modes):
    samples concatenated in process order (round i of a process pairs with round i of the same
    process), medians and ratios over the concatenation, counters averaged, and each ratio's
    load-order-balanced value (`ratio_to_sync_latin`, `ratio_to_first_latin`)."""
    blocks = [runs_i[0]["rounds"] for runs_i in runs]
    pooled = []
    for si, first in enumerate(runs[0]):
        out = {k: v for k, v in first.items() if k not in ("modes", "load_rotation", "rounds")}
        out.update(rounds=sum(blocks), process_rounds=blocks, load_rotations=[r[si]["load_rotation"] for r in runs],
                   modes={})
        for m in first["modes"]:
            per = [r[si]["modes"][m] for r in runs]
            samples = [x for p in per for x in p["samples_ms"]]
            stalls = [x for p in per for x in p["stall_samples_ms"]]

            def mean(key):
                vals = [p[key] for p in per if p[key] is not None]
                return sum(vals) / len(vals) if vals else None

            x = {"ms_per_token": statistics.median(samples), "stall_ms_per_token": statistics.median(stalls),
                 "disk_mb_per_token": mean("disk_mb_per_token"), "cache_hit_rate": mean("cache_hit_rate"),
                 "speculation_hit_rate": mean("speculation_hit_rate"), "samples_ms": samples, "stall_samples_ms": stalls}
            out["modes"][m] = x
        pooled.append(out)
    modes = list(pooled[0]["modes"])
    for si, out in enumerate(pooled):
        for m, x in out["modes"].items():
            sync = pooled[si]["modes"].get("sync")
            x["ratio_to_sync"] = ratio(sync["samples_ms"], x["samples_ms"]) if sync else None
            x["ratio_to_sync_latin"] = latin(sync["samples_ms"], x["samples_ms"], blocks) if sync else None
            ref = pooled[0]["modes"][m]["samples_ms"]
            x["ratio_to_first"] = ratio(ref, x["samples_ms"]) if si else None
            x["ratio_to_first_latin"] = latin(ref, x["samples_ms"], blocks) if si else None
    assert all(set(o["modes"]) == set(modes) for o in pooled)
    return pooled


def in_processes(argv: list[str], n: int) -> list[dict]:
    """Run this script's comparison (argv without --processes/--out) in n fresh processes, process
    p loading the engines rotated by p; pool their results (per budget)."""
    with tempfile.TemporaryDirectory(prefix="expert_io_ab.") as tmp:
        runs = []
        for p in range(n):
            out = Path(tmp) / f"p{p}"
            print(f"-- process {p + 1}/{n}: load order rotated by {p}", flush=True)
            subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv, "--rotate-load", str(p),
                            "--out", str(out)], check=True)
            runs.append(json.loads(out.with_suffix(".json").read_text()))
    n_groups = len(runs[0])
    if any(len(r) != n_groups for r in runs):
        raise SystemExit("the processes reported different numbers of results")
    # each process's list: budgets x groups x subjects, in the same order; pool position by position
    results, i = [], 0
    while i < n_groups:
        width = sum(1 for r in runs[0][i:] if r["budget"] == runs[0][i]["budget"])
        results += pool([r[i:i + width] for r in runs])
        i += width
    return results


def table(results: list[dict]) -> str:
    first = any(x.get("ratio_to_first") for r in results for x in r["modes"].values())
    latin_cols = any("ratio_to_sync_latin" in x for r in results for x in r["modes"].values())
    lines = ["| model | routes | budget | mode | ms/token | tok/s | I/O stall ms/token | sync: I/O / compute "
             "| disk MB/token | cache hits | speculation hits | × sync (median, min–max over rounds) |"
             + (" × the first model's same mode |" if first else "")
             + (" × sync, load-balanced | × the first model's, load-balanced |" if latin_cols else ""),
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|" + ("---|" if first else "")
             + ("---:|---:|" if latin_cols else "")]
    for r in results:
        sync = r["modes"].get("sync")
        split = (f"{sync['stall_ms_per_token'] / max(sync['ms_per_token'] - sync['stall_ms_per_token'], 1e-9):.2f}"
                 if sync else "–")
        routes = r.get("routes", "the model's own")
        routes = Path(routes).name if routes != "the model's own" else "own"
        for m, x in r["modes"].items():
            pct = (lambda v: "–" if v is None else f"{v:.0%}")
            rat = (lambda v: f"{v[0]:.2f}× ({v[1]:.2f}–{v[2]:.2f})" if v else "–")
            num = (lambda v: "–" if v is None else f"{v:.2f}×")
            lines.append(f"| {Path(r['model']).name} | {routes} | {r['budget']:.0%} | {m} | {x['ms_per_token']:.1f} | "
                         f"{1e3 / x['ms_per_token']:.1f} | {x['stall_ms_per_token']:.1f} | {split} | "
                         f"{x['disk_mb_per_token']:.1f} | {pct(x['cache_hit_rate'])} | {pct(x['speculation_hit_rate'])} | "
                         f"{rat(x['ratio_to_sync'])} |" + (f" {rat(x.get('ratio_to_first'))} |" if first else "")
                         + (f" {num(x.get('ratio_to_sync_latin'))} | {num(x.get('ratio_to_first_latin'))} |"
                            if latin_cols else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="MoE GGUF or .cflow files")
    ap.add_argument("--budgets", default="0.9,0.95,0.97", help="expert-cache budgets, fractions of all experts")
    ap.add_argument("--modes", default="sync,async:off,async:1,async:16",
                    help="sync and async:SPECULATION[:TAG...] (expert speculation: off, next-layer, auto, or a "
                    "depth; TAGs: the reader, auto = io_uring where the kernel offers it, threads = pread threads, "
                    "qdN = io_uring with N reads in the kernel; nokeep = no keep ranks in the cache); sync is the unit")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--per-round", type=int, default=8, help="tokens per engine per round")
    ap.add_argument("--warmup", type=int, default=48,
                    help="tokens each engine decodes before the rounds (the speculation gate needs 32 predictions "
                    "per distance, and the cache's keep ranks then some misses, to settle)")
    ap.add_argument("--corpus", help="teacher-force the corpus's held-out stories instead of random tokens "
                    "(for trained models: their learned routing)")
    ap.add_argument("--trace", help="route the engines by a route trace (benchmarks/route_trace.py) instead of "
                    "the model's routers: one model's learned routing through another's expert cache; one file for "
                    "every model, or a comma-separated list, one per model")
    ap.add_argument("--together", action="store_true",
                    help="alternate every model's engines in one loop (the models compare round by round: "
                    "ratio_to_first); otherwise one model after the other")
    ap.add_argument("--as-arch", help="comma-separated presets: load the ONE model file once per preset, with "
                    "that preset's delays and MoE input (the delays alone, on the same bytes; a preset twice is "
                    "the A/A control); implies --together")
    ap.add_argument("--processes", type=int, default=1,
                    help="run the comparison in N fresh processes, process p loading the models and modes rotated "
                    "by p (N = the number of models: a Latin square of load orders), and pool them (see above)")
    ap.add_argument("--rotate-load", type=int, default=0, help="load the models and modes rotated by P (one "
                    "process of --processes)")
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    if args.processes < 1:
        ap.error("--processes must be >= 1")
    if args.processes > 1:
        child = strip_options(argv, {"--processes": 1, "--out": 1, "--rotate-load": 1})
        results = in_processes(child, args.processes)
        return report(results, argv, args.out)
    from cflow.runtime.routes import RouteTrace

    modes = args.modes.split(",")
    for m in modes:
        parse_mode(m)
    archs: list[str | None] = [None] * len(args.models)
    paths = list(args.models)
    if args.as_arch:
        if len(paths) != 1:
            ap.error("--as-arch loads one model file as each preset: give exactly one model")
        archs = args.as_arch.split(",")
        from cflow.config import PRESETS

        if bad := [a for a in archs if a not in PRESETS]:
            ap.error(f"--as-arch: {', '.join(bad)} not a preset; choose from {', '.join(sorted(PRESETS))}")
        paths, args.together = paths * len(archs), True
    traces = [RouteTrace.load(t) if t else None for t in (args.trace.split(",") if args.trace else [])]
    if len(traces) > 1 and len(traces) != len(paths):
        ap.error(f"--trace has {len(traces)} files for {len(paths)} engines: give one, or one per model "
                 f"(or per --as-arch preset)")
    traces = traces * len(paths) if len(traces) == 1 else traces or [None] * len(paths)
    n_tok = args.warmup + args.rounds * args.per_round
    subjects = [prepare(p, n_tok, args.corpus, t, a) for p, t, a in zip(paths, traces, archs)]
    groups = [subjects] if args.together else [[s] for s in subjects]
    results = []
    for b in (float(x) for x in args.budgets.split(",")):
        for group in groups:
            got = measure(group, b, modes, args.threads, args.rounds, args.per_round, args.warmup, args.rotate_load)
            results += got
            print(table(got).split("\n", 2)[2], flush=True)
    return report(results, argv, args.out)


def strip_options(argv: list[str], drop: dict[str, int]) -> list[str]:
    """argv without the named options (each with its value, as `--opt V` or `--opt=V`)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in drop:
            i += 1 + drop[a]
            continue
        if a.split("=", 1)[0] in drop and "=" in a:
            i += 1
            continue
        out.append(a)
        i += 1
    return out


def report(results: list[dict], argv: list[str], out_path: str | None) -> int:
    text = f"Command: `python benchmarks/expert_io_ab.py {' '.join(argv)}`\n\n" + table(results) + "\n"
    print(text)
    if out_path:
        out = Path(out_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(text)
        out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
