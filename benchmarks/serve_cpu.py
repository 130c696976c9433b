"""CPU time per generated token in each thread of a running `cflow serve`, under serve_load.py's
workload: where a served token's CPU goes (the HTTP event loop, the scheduler + the C core's
thread 0, the C core's other threads, the tokenizer's executor), counted from /proc, not timed.

    python benchmarks/serve_cpu.py -t 2 --concurrency 1,8 --requests 16

Per level: generated tokens, then per thread kind CPU ms per token (user + system, from
/proc/PID/task/TID/stat, before and after the level). Threads are told apart by what they are:
the main thread runs the event loop (uvicorn); the thread that ran the most CPU while tokens were
generated besides the main one is the scheduler's worker, which is also the C core's thread 0; the
C core's pool threads are the next `threads - 1` busiest; everything else ("other") is the
tokenizer's executor threads and the like. On a loaded machine the per-token CPU is still a fair
count (CPU time, not wall time), though cache and frequency effects remain. Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import run_level, smollm2_gguf, spawn, stop  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of every thread of process pid."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14, 15)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default=None)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("-np", "--parallel", type=int, default=16)
    p.add_argument("-c", "--ctx", type=int, default=512)
    p.add_argument("-n", "--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=24)
    args = p.parse_args(argv)
    args.model = args.model or smollm2_gguf()
    args.verbose, args.ready_timeout, args.timeout = False, 300, 300
    levels = [int(x) for x in args.concurrency.split(",") if x]

    proc, target = spawn("cflow", args)
    try:
        async def go():
            await run_level(args, target, 1, 1, 10_000)  # warm-up
            start = 0
            for c in levels:
                before = thread_cpu(proc.pid)
                lv = await run_level(args, target, c, args.requests, start)
                after = thread_cpu(proc.pid)
                start += args.requests
                used = {t: after[t] - before.get(t, 0.0) for t in after}
                main_t = used.pop(proc.pid, 0.0)
                busy = sorted(used.items(), key=lambda kv: -kv[1])
                worker = busy[0][1] if busy else 0.0
                pool = sum(v for _, v in busy[1:args.threads])
                other = sum(v for _, v in busy[args.threads:])
                per = 1e3 / max(lv.tokens, 1)
                total = main_t + worker + pool + other
                print(f"{c} streams: {lv.tokens} tokens in {lv.wall_s:.2f} s; CPU ms per token: event loop "
                      f"{main_t * per:.3f}, worker (scheduler + C thread 0) {worker * per:.3f}, C pool "
                      f"{pool * per:.3f}, other {other * per:.3f}; total {total * per:.3f} "
                      f"(event loop {main_t / max(total, 1e-9):.0%} of the process's CPU)")

        asyncio.run(go())
    finally:
        stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
