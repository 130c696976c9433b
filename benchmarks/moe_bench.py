"""MoE decode side by side with llama.cpp, in RAM and under a memory limit (claims C3/C5).

Every measurement runs in a fresh child process, optionally inside a cgroup-v1 memory limit
(/sys/fs/cgroup/memory; root), after the page cache is dropped for cold runs. The same limit holds
for cflow and llama.cpp. A child loads the model, prefills a short prompt and decodes greedily,
then reports tokens/s, the bytes it read from the block device (/proc/self/io), its peak resident
memory, and for cflow the engine's counters (expert bytes, disk bytes, cache hits, I/O stalls).
In the same run: the memory read probe and the disk read probe, so every number has its bound.

    python benchmarks/moe_bench.py --gguf moe.gguf [--cflow moe-pn.cflow] --limits 1,0.5 \
        --budgets 0.25,0.5,1 --io sync,async [--expert-speculation off,next-layer] --tokens 32 --out docs/results/moe

--expert-speculation runs each async disk configuration once per expert-speculation mode (Engine.load's
expert_speculation: auto, off, next-layer or a depth N; default "auto": on for the delay-free Mixtral
layout, off for the pipeline-native model) and reports the speculation hit rate beside the cache hits.
(--prefetch, its old name, still works and says it is deprecated.)

The async/sync curve (async should approach max(I/O, compute) where the two are equal):

    python benchmarks/moe_bench.py --gguf moe.gguf --limits budget --budgets 0.8,0.9,0.95,1 \
        --io sync,async --expert-speculation off,1,15 --warmup 32 --tokens 64

`--limits budget` gives each cflow run a memory limit of the dense weights + its expert-cache budget +
--limit-margin (so the page cache cannot hold the experts the cache lacks), and runs llama.cpp once per
budget under the same limit. `--warmup N` decodes N tokens before the timed ones, so the expert cache is
in its steady state (a cold cache at a 95% budget would otherwise miss for the first tokens only). In a
sync run the I/O stall is the time spent reading; the rest of the token is compute, so sync rows say
where I/O and compute are equal, and the summary table gives async / sync per budget beside it.

llama.cpp runs with repacking off under a limit (its repacked copy of the weights cannot fit
there; `--no-repack`) and with its default in RAM. Writes OUT.md, OUT.json and OUT.png (tok/s
against the expert-cache budget for cflow sync, cflow async and llama.cpp).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")

# Runs in the child: load, prefill, decode; print one JSON line.
CHILD = r"""
import json, os, resource, sys, time
import numpy as np
spec = json.loads(sys.argv[1])

def disk_read():
    with open("/proc/self/io") as f:
        return int(next(l for l in f if l.startswith("read_bytes:")).split()[1])

# The same tokens for both engines, fed teacher-forced: greedy decoding of a random model repeats
# one token, and then every step routes to the same experts, which flatters any cache.
rng = np.random.default_rng(0)
prompt = [int(t) for t in rng.integers(1, spec["vocab"], spec["prompt"])]
feed = [int(t) for t in rng.integers(1, spec["vocab"], spec["tokens"])]
warm = [int(t) for t in rng.integers(1, spec["vocab"], spec.get("warmup", 0))]
out = {"engine": spec["engine"]}
t0 = time.perf_counter()
if spec["engine"] == "cflow":
    from cflow.runtime import Engine
    eng = Engine.load(spec["model"], threads=spec["threads"], n_ctx=spec["prompt"] + len(warm) + spec["tokens"] + 8,
                      verify=False, **spec.get("load", {}))
    out["load_s"] = time.perf_counter() - t0
    eng.prefill(prompt)
    pos = len(prompt)
    for tok in warm:  # the expert cache's steady state
        eng.step(tok, pos)
        pos += 1
    eng.reset_counters()
    d0, t1 = disk_read(), time.perf_counter()
    for tok in feed:
        eng.step(tok, pos)
        pos += 1
    dt = time.perf_counter() - t1
    out["counters"] = eng.counters()
else:
    from cflow.bench.llamacpp import LlamaCppRunner
    r = LlamaCppRunner(spec["model"], spec["threads"], spec["prompt"] + len(warm) + spec["tokens"] + 8,
                       repack=spec.get("repack", True))
    out["load_s"] = time.perf_counter() - t0
    r.prefill(np.array(prompt))
    pos = len(prompt)
    for tok in warm:
        r.step(tok, pos)
        pos += 1
    d0, t1 = disk_read(), time.perf_counter()
    for tok in feed:
        r.step(tok, pos)
        pos += 1
    dt = time.perf_counter() - t1
out["tok_s"] = spec["tokens"] / dt
out["disk_bytes_per_token"] = (disk_read() - d0) / spec["tokens"]
out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("RESULT " + json.dumps(out))
"""


# ---- the machine -----------------------------------------------------------------------------
def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


class MemoryLimit:
    """A cgroup-v1 memory limit for one child process (page cache included, as the kernel counts it)."""

    def __init__(self, nbytes: int | None) -> None:
        self.nbytes = nbytes
        self.path = CGROUP_ROOT / f"cflow-bench-{os.getpid()}"

    def __enter__(self) -> "MemoryLimit":
        if self.nbytes is not None:
            if not CGROUP_ROOT.is_dir():
                sys.exit(f"no cgroup-v1 memory controller at {CGROUP_ROOT}: cannot limit memory here")
            self.path.mkdir(exist_ok=True)
            (self.path / "memory.limit_in_bytes").write_text(str(self.nbytes))
        return self

    def join(self) -> None:  # runs in the child between fork and exec
        if self.nbytes is not None:
            (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def __exit__(self, *exc: object) -> None:
        if self.nbytes is not None:
            for _ in range(50):  # the child may take a moment to leave
                try:
                    self.path.rmdir()
                    return
                except OSError:
                    time.sleep(0.1)


def run_child(spec: dict, limit: int | None, cold: bool, timeout: float) -> dict:
    if cold:
        drop_caches()
    with MemoryLimit(limit) as cg:
        try:
            p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True,
                               timeout=timeout, preexec_fn=cg.join)
        except subprocess.TimeoutExpired:
            return {**spec, "error": f"timed out after {timeout:.0f} s"}
    line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        return {**spec, "error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1][:300]}
    return {**spec, **json.loads(line[len("RESULT "):])}


# ---- the report ------------------------------------------------------------------------------
def fmt_row(r: dict, file_bytes: int) -> str:
    lim = "RAM" if r["limit"] is None else f"{r['limit'] / file_bytes:.0%} of file"
    what = r["engine"] + (f" {r['label']}" if r.get("label") else "") + (
        f", cache {r['budget']:.0%} of experts" if "budget" in r else "")
    if "limit_kind" in r:
        lim = f"{r['limit'] / 1e9:.2f} GB (dense + cache + margin)"
    if "error" in r:
        return f"| {what} | {lim} | – | – | – | – | – | – | {r['error']} |"
    c = r.get("counters", {})
    hits, misses = c.get("cache_hits"), c.get("cache_misses")
    rate = f"{hits / (hits + misses):.0%}" if hits is not None and misses is not None and hits + misses else "–"
    pred = f"{c['speculation_hits'] / c['speculation_predicted']:.0%}" if c.get("speculation_predicted") else "–"
    stall = f"{c['io_stall_ns'] / 1e6 / r['tokens']:.1f}" if "io_stall_ns" in c else "–"
    return (f"| {what} | {lim} | {r['tok_s']:.2f} | {r['disk_bytes_per_token'] / 1e6:.1f} | {rate} | {pred} | "
            f"{stall} | {r['peak_rss_bytes'] / 1e9:.2f} | |")


def summary(results: list[dict], disk_gbs: float | None) -> list[str]:
    """async / sync per model and budget, beside sync's split of a token into I/O and compute, and
    two bounds for the async row: perfect overlap of sync's own I/O and compute (1000 / max of the
    two, ms), and the disk probe over the bytes the async run read per token."""
    ok = [r for r in results if r["engine"] == "cflow" and "budget" in r and "tok_s" in r]
    lines = ["| model | budget | sync tok/s | sync ms/token: I/O + compute | I/O / compute | async mode | "
             "async tok/s | async / sync | async I/O stall ms/token | overlap bound tok/s | disk bound tok/s |",
             "|---|---:|---:|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in ok:
        if " sync" not in r["label"]:
            continue
        model = r["label"].split(" disk")[0]
        ms = 1e3 / r["tok_s"]
        io = r["counters"]["io_stall_ns"] / 1e6 / r["tokens"]
        for a in ok:
            if a["label"].startswith(f"{model} disk async") and a["budget"] == r["budget"]:
                mode = a["label"].split("async", 1)[1].strip() or "speculation auto"
                stall = a["counters"]["io_stall_ns"] / 1e6 / a["tokens"]
                disk = (f"{disk_gbs * 1e9 / a['disk_bytes_per_token']:.1f}"
                        if disk_gbs and a["disk_bytes_per_token"] > 0 else "–")
                lines.append(f"| {model} | {r['budget']:.0%} | {r['tok_s']:.2f} | {io:.1f} + {ms - io:.1f} | "
                             f"{io / max(ms - io, 1e-9):.2f} | {mode} | {a['tok_s']:.2f} | "
                             f"{a['tok_s'] / r['tok_s']:.2f}× | {stall:.1f} | {1e3 / max(io, ms - io):.1f} | {disk} |")
    return lines if len(lines) > 2 else []  # no sync run beside an async one: no table


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label in sorted({r.get("label", "") for r in results if r["engine"] == "cflow" and "budget" in r}):
        pts = sorted((r["budget"], r["tok_s"]) for r in results
                     if r["engine"] == "cflow" and r.get("label") == label and "tok_s" in r and "budget" in r)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"cflow {label}")
    curve = sorted((r["budget"], r["tok_s"]) for r in results if r["engine"] == "llama.cpp" and "budget" in r
                   and "tok_s" in r)
    if curve:  # one llama.cpp run per budget, under the same limit as cflow's
        ax.plot(*zip(*curve), marker="s", ls="--", color="gray", label="llama.cpp, same memory limit")
    base = [r for r in results if r["engine"] == "llama.cpp" and "tok_s" in r and r["limit"] is not None
            and "budget" not in r]
    for r in base:
        ax.axhline(r["tok_s"], ls="--", color="gray")
        ax.text(0.02, r["tok_s"], f"llama.cpp, limit {r['limit'] / 1e9:.1f} GB", va="bottom", fontsize=8,
                transform=ax.get_yaxis_transform())
    ax.set_xlabel("expert cache budget (fraction of all experts)")
    ax.set_ylabel("decode tok/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    from cflow.cli.common import DeprecatedFlag

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True, help="a Mixtral-layout GGUF (both engines run it)")
    ap.add_argument("--cflow", help="also run this pipeline-native .cflow (e.g. arch2_4_combined) with cflow")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--limits", default="1,0.5",
                    help="memory limits as fractions of the GGUF's size; 0 = no limit (default 1,0.5); 'budget': "
                    "per run, the dense weights + that run's expert-cache budget + --limit-margin")
    ap.add_argument("--limit-margin", type=float, default=0.3, help="GB above dense + cache with --limits budget")
    ap.add_argument("--skip-llama", action="store_true", help="cflow runs only (exploring settings)")
    ap.add_argument("--warmup", type=int, default=0, help="tokens decoded before the timed ones (both engines)")
    ap.add_argument("--budgets", default="0.25,0.5,1",
                    help="cflow expert-cache budgets as fractions of all experts' bytes (disk mode)")
    ap.add_argument("--io", default="sync,async", help="cflow expert I/O modes to compare")
    ap.add_argument("--expert-speculation", default="auto",
                    help="expert speculation modes for the async disk runs (auto, off, next-layer, or a depth N "
                    "in layers; e.g. off,1,15 to compare)")
    ap.add_argument("--prefetch", dest="expert_speculation", action=DeprecatedFlag, new="--expert-speculation",
                    default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # the old name, in older results' commands
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--warm", action="store_true", help="keep the page cache between runs (default: cold)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per child run")
    ap.add_argument("--out", default="docs/results/moe_bench", help="OUT.md, OUT.json, OUT.png")
    args = ap.parse_args(argv)

    from cflow.bench.bandwidth import read_bandwidth
    from cflow.fileformat import open_model
    from cflow.runtime import Engine

    gguf = Path(args.gguf).resolve()
    file_bytes = gguf.stat().st_size
    # the converted file (cflow runs the GGUF through its cache) and its experts' total bytes
    with Engine.load(gguf, threads=1, n_ctx=16, experts="ram") as eng:
        converted, vocab = eng.path, eng.config.vocab_size
    with open_model(converted) as cf:
        expert_bytes = sum(n for _, n in cf.experts.values())
    pn_expert_bytes = 0
    if args.cflow:
        with open_model(args.cflow) as cf:
            pn_expert_bytes = sum(n for _, n in cf.experts.values())
    machine = {"memory_read_gbs": read_bandwidth(args.threads)}
    try:
        from cflow.bench import disk

        machine["disk_read_gbs"] = disk.probe(converted).gbs
    except (ImportError, AttributeError) as e:
        machine["disk_read_gbs"] = None
        print(f"(no disk probe: {e})", file=sys.stderr)

    budgets = [float(x) for x in args.budgets.split(",")]
    by_budget = args.limits == "budget"
    limits = [None] if by_budget else [None if float(x) == 0 else int(float(x) * file_bytes)
                                       for x in args.limits.split(",")]
    # (io, speculation) per disk configuration: speculation needs async reads, so sync runs once
    # ("auto" is off with sync reads)
    speculation = args.expert_speculation.split(",")
    modes = [(io, sp) for io in args.io.split(",") for sp in (speculation if io == "async" else ["auto"])]

    def sp_label(sp: str) -> str:  # the labels of earlier runs when speculation is left alone
        return "" if sp == "auto" else f" speculation {sp}" if not sp.isdigit() else f" speculation depth {sp}"

    def budget_limit(total: int, experts: int, b: float) -> int:  # dense + cache + margin
        return int(total - experts + b * experts + args.limit_margin * 1e9)

    def disk_runs(model: str, label: str, experts: int, total: int, limit: int | None) -> list[dict]:
        runs = []
        for io, sp in modes:
            for b in budgets:
                run = dict(engine="cflow", model=model, label=f"{label} disk {io}{sp_label(sp)}", budget=b,
                           load={"experts": "disk", "expert_cache": max(1, int(b * experts)), "expert_io": io,
                                 "expert_speculation": sp}, limit=limit)
                if by_budget:
                    run.update(limit=budget_limit(total, experts, b), limit_kind="budget")
                runs.append(run)
        return runs

    results: list[dict] = []
    for limit in limits:
        if by_budget:  # llama.cpp under each budget's limit (what cflow's Mixtral runs get)
            runs = [dict(engine="llama.cpp", model=str(gguf), repack=False, label="", budget=b,
                         limit=budget_limit(file_bytes, expert_bytes, b), limit_kind="budget") for b in budgets]
        else:
            runs = [dict(engine="llama.cpp", model=str(gguf), repack=limit is None, label="", limit=limit)]
        if limit is None and not by_budget:
            runs.append(dict(engine="cflow", model=str(converted), label="Mixtral-layout ram", load={"experts": "ram"},
                             limit=None))
        runs += disk_runs(str(converted), "Mixtral-layout", expert_bytes, file_bytes, limit)
        if args.cflow:  # the pipeline-native model: its experts land 2 layers later, so async can overlap
            pn = str(Path(args.cflow).resolve())
            if not by_budget:
                runs.append(dict(engine="cflow", model=pn, label="pipeline-native auto", load={"experts": "auto"},
                                 limit=limit))
            runs += disk_runs(pn, "pipeline-native", pn_expert_bytes, Path(pn).stat().st_size, limit)
        if args.skip_llama:
            runs = [r for r in runs if r["engine"] != "llama.cpp"]
        for spec in runs:
            spec.update(threads=args.threads, tokens=args.tokens, prompt=args.prompt, vocab=vocab,
                        warmup=args.warmup)
            r = run_child(spec, spec["limit"], cold=not args.warm, timeout=args.timeout)
            results.append(r)
            print(fmt_row(r, file_bytes), flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"gguf": str(gguf), "file_bytes": file_bytes, "expert_bytes": expert_bytes, "machine": machine,
              "threads": args.threads, "tokens": args.tokens, "warmup": args.warmup, "cold": not args.warm,
              "results": results}
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = [f"# MoE decode: cflow vs llama.cpp ({gguf.name}, {file_bytes / 1e9:.2f} GB, experts "
             f"{expert_bytes / 1e9:.2f} GB)", "",
             f"Command: `python benchmarks/moe_bench.py {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             f"Memory read probe {machine['memory_read_gbs']:.1f} GB/s; disk read probe "
             + (f"{machine['disk_read_gbs']:.2f} GB/s" if machine["disk_read_gbs"] else "n/a")
             + f"; {args.threads} threads; {'cold' if not args.warm else 'warm'} page cache per run.", "",
             "| engine | memory | tok/s | disk MB/token | expert cache hits | speculation hits | I/O stall ms/token "
             "| peak RSS GB | note |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    lines += [fmt_row(r, file_bytes) for r in results]
    pairs = summary(results, machine["disk_read_gbs"])
    if pairs:
        lines += ["", "## async / sync", ""] + pairs
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.md')}, .json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
