"""Two builds of cflow, one regression verdict: alternate them process by process on the same files.

A refactor of the C core must not make decode or prefill slower. On a VM whose bandwidth drifts
from one half hour to the next, timing the old build now and the new one later measures the
drift, so this runs `cflow bench` under each build in turn, round after round, swapping which goes
first each round, and takes the median of the per-round ratios new / old. Each build is a Python
interpreter whose environment holds it (a venv with the old wheel, another with the new build):

    python benchmarks/build_ab.py --old /work/venv-old/bin/python --new /work/venv/bin/python \\
        -m SmolLM2-135M-Instruct.Q4_1.gguf -m 1b.gguf -t 1,2 --rounds 5 --compare llama.cpp \\
        --out docs/results/build_ab.json

The rule, fixed here before any run: for every model, thread count and test (ppN, tgN), the median
over rounds of new / old tokens/s must be >= 0.97 (a 3% band, chosen for a 2-core VM whose runs
agree to 1-3%); the verdict is "no regression" only if every cell passes. Run an A/A control too
(--old and --new the same interpreter): on a noisier machine the same build against itself fails
the band, and the A/B says only as much as the A/A allows (docs/results/dense.md). With --compare llama.cpp each `cflow
bench` also runs llama.cpp beside it, and the table shows each build's own ratio over llama.cpp
(context for the reader; the verdict uses new / old only).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

THRESHOLD = 0.97  # median new / old per cell; written before the first run


def bench_once(python: str, model: str, threads: str, args: argparse.Namespace) -> list[dict]:
    """One `cflow bench` under `python`; its result rows."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [python, "-m", "cflow", "bench", "-m", model, "-t", threads, "-p", str(args.n_prompt),
               "-n", str(args.n_gen), "-r", str(args.repetitions), "--no-probe", "--no-footprint",
               "--json", "--out", str(out)]
        if args.compare:
            cmd += ["--compare", args.compare]
        # From a neutral folder, so neither build can import a source tree by accident.
        subprocess.run(cmd, check=True, cwd=tmp, stdout=subprocess.DEVNULL,
                       stderr=None if args.verbose else subprocess.DEVNULL)
        return json.loads(out.read_text())["rows"]


def cell_key(row: dict) -> tuple:
    return row["test"], row["threads"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--old", required=True, help="the Python interpreter whose environment holds the old build")
    ap.add_argument("--new", default=sys.executable, help="the one holding the new build (default: this one)")
    ap.add_argument("-m", "--model", action="append", required=True, help="a model file (repeatable)")
    ap.add_argument("-t", "--threads", default="1,2")
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("-r", "--repetitions", type=int, default=3, help="timed repetitions per bench call")
    ap.add_argument("--rounds", type=int, default=5, help="old/new alternations (the verdict's sample)")
    ap.add_argument("--compare", choices=["llama.cpp"], default=None)
    ap.add_argument("--out", type=Path, default=None, help="write every sample and the verdict as JSON")
    ap.add_argument("-v", "--verbose", action="store_true", help="show cflow bench's own output")
    args = ap.parse_args(argv)
    for m in args.model:
        if not os.path.isfile(m):
            ap.error(f"no model file {m!r}")
    args.model = [os.path.abspath(m) for m in args.model]
    builds = {"old": args.old, "new": args.new}

    # samples[model][cell][build] -> per-round cflow tok/s; llama[model][cell][build] -> llama.cpp tok/s
    samples: dict = {}
    llama: dict = {}
    for rnd in range(args.rounds):
        order = ["old", "new"] if rnd % 2 == 0 else ["new", "old"]
        for model in args.model:
            for name in order:
                rows = bench_once(builds[name], model, args.threads, args)
                for row in rows:
                    target = samples if row["engine"] == "cflow" else llama
                    target.setdefault(model, {}).setdefault(cell_key(row), {}).setdefault(name, []).append(
                        row["avg_ts"])
            print(f"round {rnd + 1}/{args.rounds}: {Path(model).name} done", file=sys.stderr)

    report = {"threshold": THRESHOLD, "rounds": args.rounds, "cells": []}
    lines = ["| model | test | threads | old tok/s (median) | new tok/s (median) | per-round new/old | "
             "median new/old | old / llama.cpp | new / llama.cpp | pass |", "|---|---|---:|---:|---:|---|---:|---:|---:|---|"]
    ok = True
    for model, cells in samples.items():
        for (test, threads), by in sorted(cells.items()):
            ratios = [n / o for n, o in zip(by["new"], by["old"])]
            med = statistics.median(ratios)
            passed = med >= THRESHOLD
            ok &= passed
            vs = {}
            for name in ("old", "new"):
                base = llama.get(model, {}).get((test, threads), {}).get(name)
                vs[name] = statistics.median(c / b for c, b in zip(by[name], base)) if base else None
            report["cells"].append({"model": model, "test": test, "threads": threads, "old": by["old"],
                                    "new": by["new"], "ratios": ratios, "median_ratio": med, "pass": passed,
                                    "old_over_llama_cpp": vs["old"], "new_over_llama_cpp": vs["new"]})
            fmt = lambda v: "–" if v is None else f"{v:.2f}×"  # noqa: E731
            lines.append(f"| {Path(model).name} | {test} | {threads} | {statistics.median(by['old']):.1f} | "
                         f"{statistics.median(by['new']):.1f} | {' '.join(f'{r:.3f}' for r in ratios)} | "
                         f"{med:.3f} | {fmt(vs['old'])} | {fmt(vs['new'])} | {'yes' if passed else 'NO'} |")
    report["verdict"] = "no regression" if ok else "regression"
    print("\n".join(lines))
    print(f"\nrule: median over {args.rounds} rounds of new/old >= {THRESHOLD} in every cell -> {report['verdict']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
