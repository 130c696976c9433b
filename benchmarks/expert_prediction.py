"""How well expert speculation predicts, by depth, from the engine's own counters (no timing).

For each model and each --expert-speculation depth: an engine with experts on disk and a cache of
--budget of all experts decodes --warmup teacher-forced tokens, then --tokens more, and reports per
token the cache misses, the share of predicted experts their layer then chose (each layer's union of
predictions), the share of misses a speculative read had already started, and the speculative reads
nobody used. The counts depend on routing and the cache, not on the machine's speed, so this runs on
a busy machine too (docs/results/moe.md, "How predictable routing is, and the gate").

    python benchmarks/make_moe.py --preset mixtral-small --residual-gain 1.0 --gguf small-g1.gguf
    python benchmarks/expert_prediction.py small.gguf small-g1.gguf --budget 0.95 --depths off,1,15

CFLOW_SPEC_MIN_PRECISION=0 opens the gate (every distance reads, however wrong), as the "ungated"
rows of the results page.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np


def measure(path: str, budget: float, depth: str, warmup: int, tokens: int, threads: int) -> dict:
    from cflow.fileformat import open_model
    from cflow.runtime import Engine
    from cflow.runtime.experts import speculation_hit_rate

    with Engine.load(path, threads=1, n_ctx=16, experts="ram") as probe:
        converted, vocab = probe.path, probe.config.vocab_size
    with open_model(converted) as cf:
        expert_bytes = sum(n for _, n in cf.experts.values())
    toks = [int(t) for t in np.random.default_rng(0).integers(1, vocab, warmup + tokens)]
    with Engine.load(converted, threads=threads, n_ctx=len(toks) + 8, experts="disk", verify=False,
                     expert_cache=int(budget * expert_bytes), expert_speculation=depth) as eng:
        for i, t in enumerate(toks[:warmup]):
            eng.step(t, i)
        eng.reset_counters()
        for i, t in enumerate(toks[warmup:]):
            eng.step(t, warmup + i)
        time.sleep(0.3)  # speculative reads nobody waited for land
        c = eng.counters()
    return {"model": Path(path).name, "depth": depth, "misses_per_token": c["cache_misses"] / tokens,
            "predicted_chosen": speculation_hit_rate(c),
            "misses_read_early": c["speculation_reads_used"] / c["cache_misses"] if c["cache_misses"] else None,
            "wasted_reads_per_token": (c["speculation_reads"] - c["speculation_reads_used"]) / tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--budget", type=float, default=0.95, help="expert cache, fraction of all experts")
    ap.add_argument("--depths", default="off,1,4,15", help="--expert-speculation values")
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=1)
    args = ap.parse_args(argv)
    pct = (lambda v: "–" if v is None else f"{v:.1%}")
    print("| model | depth | predicted experts chosen | misses / token | misses read early | wasted reads / token |")
    print("|---|---:|---:|---:|---:|---:|")
    for path in args.models:
        for depth in args.depths.split(","):
            r = measure(path, args.budget, depth, args.warmup, args.tokens, args.threads)
            print(f"| {r['model']} | {depth} | {pct(r['predicted_chosen'])} | {r['misses_per_token']:.2f} | "
                  f"{pct(r['misses_read_early'])} | {r['wasted_reads_per_token']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
