"""How much memory bandwidth the compute loses while the disk streams (async expert I/O).

Async expert reads overlap compute, but the bytes they bring in cross the same memory system the
decode step streams its weights through. This measures that cost on its own: the memory read probe
(cflow.bench.bandwidth, the one every benchmark reports) idle, then while `dd` reads FILE with
O_DIRECT in a loop, alternating. On the project's VM a 3 GB/s read stream took 12-16% of a 2-thread
probe's 46-48 GB/s: an upper bound on how much faster async compute could get beside its reads.

    python benchmarks/read_interference.py /tmp/moe/small.gguf --rounds 3
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import time

from cflow.bench.bandwidth import read_bandwidth


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", help="a large file to stream with O_DIRECT (a model file)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    loop = f"while true; do dd if={shlex.quote(args.file)} of=/dev/null bs=16M iflag=direct 2>/dev/null; done"
    ratios = []
    for r in range(args.rounds):
        idle = read_bandwidth(threads=args.threads, reps=10)
        dd = subprocess.Popen(["bash", "-c", loop], start_new_session=True)
        try:
            time.sleep(1.0)  # the stream is under way
            busy = read_bandwidth(threads=args.threads, reps=10)
        finally:
            subprocess.run(["pkill", "-s", str(dd.pid)], check=False)
            dd.wait()
        time.sleep(1.0)
        ratios.append(busy / idle)
        print(f"round {r + 1}: memory read probe, {args.threads} threads: idle {idle:.1f} GB/s, "
              f"with an O_DIRECT read stream {busy:.1f} GB/s ({busy / idle:.2f})", flush=True)
    print(f"median with the stream / idle: {statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
