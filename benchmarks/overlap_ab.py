"""A/B of Engine.overlap (attn(l) beside dense(l) on two thread groups; docs/DESIGN.md,
"Overlapping independent nodes"): one engine, overlap off and on alternating in the same process,
decode tokens/s per sample and the on/off ratio per adjacent pair (mean ± sd), so a machine that
drifts shows as spread, not bias.

    python benchmarks/make_moe.py --layers 8 --d-model 1024 --d-ff 2816 --heads 16 --kv-heads 4 --cflow m.cflow
    python benchmarks/overlap_ab.py m.cflow -t 1,2 --pairs 16
"""

from __future__ import annotations

import argparse
import statistics
import time

from cflow.runtime import Engine


def decode_tps(eng: Engine, n: int, pos0: int) -> float:
    tok, t0 = 5, time.perf_counter()
    for i in range(n):
        tok = int(eng.step(tok, pos0 + i).argmax())
    return n / (time.perf_counter() - t0)


def ab(path: str, threads: int, pairs: int, n: int) -> dict:
    eng = Engine.load(path, threads=threads, n_ctx=n + 8)
    try:
        eng.prefill([1, 2, 3])
        decode_tps(eng, n, 3)  # warm-up: pages in, threads awake
        tps: dict[bool, list[float]] = {False: [], True: []}
        for r in range(pairs):
            for on in (False, True) if r % 2 == 0 else (True, False):
                eng.overlap = on
                tps[on].append(decode_tps(eng, n, 3))
    finally:
        eng.close()
    ratios = [b / a for a, b in zip(tps[False], tps[True])]
    sd = (lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0)
    return {"threads": threads, "off": statistics.mean(tps[False]), "off_sd": sd(tps[False]),
            "on": statistics.mean(tps[True]), "on_sd": sd(tps[True]), "ratio": statistics.mean(ratios),
            "ratio_sd": sd(ratios), "pairs": pairs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a .cflow/.vflow (delta_dense >= 1 for anything to pair)")
    ap.add_argument("-t", "--threads", default="2", help="thread counts, comma-separated (default 2)")
    ap.add_argument("--pairs", type=int, default=12, help="off/on pairs per thread count (default 12)")
    ap.add_argument("-n", type=int, default=32, help="decode steps per sample (default 32)")
    a = ap.parse_args()
    print("| threads | overlap off tok/s | overlap on tok/s | on / off per pair |")
    print("|---:|---:|---:|---:|")
    for t in (int(x) for x in a.threads.split(",")):
        r = ab(a.model, t, a.pairs, a.n)
        print(f"| {t} | {r['off']:.1f} ± {r['off_sd']:.1f} | {r['on']:.1f} ± {r['on_sd']:.1f} | "
              f"{r['ratio']:.3f} ± {r['ratio_sd']:.3f} ({r['pairs']} pairs) |", flush=True)


if __name__ == "__main__":
    main()
