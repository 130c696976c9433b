"""The verdicts of docs/results/delay_window.md's rule, computed from expert_io_ab.py's JSON (--as-arch
runs, or files given in the rule's order: arch1, its A/A copy, arch4, arch2_4_combined).

    python benchmarks/delay_window_verdicts.py same_routing.json own_routing.json

Per file: the A/A control and the sync control by mode (the run is valid only within 0.95-1.05;
the sync control counts in a same-routing run, named by "same" in the file name), each delayed
preset's ratio to arch1 in the same mode and its verdict (>= 1.05 buys, <= 0.95 costs), the
issue's target (arch4 async:16 over its sync, and over arch1's fastest async mode), and the
next-layer gate's pooled ratio async:16 / async:16:opennext.

Every ratio is the rule's statistic for the file's protocol: the median of the per-round ratios for
one process (the rule of 2026-12-03); for a file pooled from `expert_io_ab.py --processes N` (its
results carry `process_rounds`: the rule as revised on 2026-12-05), each process's median
per-round ratio, then their geometric mean, so that every load order weighs alike.
"""
import json
import statistics
import sys
from pathlib import Path

from expert_io_ab import balanced, latin


def verdicts(path, same_routing):
    res = json.load(open(path))
    blocks = res[0].get("process_rounds")  # rounds per process (None: one process)

    def med_ratio(a, b):  # tok/s of b's engine over a's: a_ms / b_ms per round, the rule's statistic
        return latin(a, b, blocks or [len(a)])

    names = [r["model"].rsplit(" as ", 1)[-1] if " as " in r["model"] else Path(r["model"]).stem.replace("-s", "")
             for r in res]
    names[1] = names[1] + " (A/A)"
    modes = list(res[0]["modes"])
    ms = {(names[i], m): res[i]["modes"][m]["samples_ms"] for i in range(len(res)) for m in modes}
    base = names[0]
    out = {"file": path, "budget": res[0]["budget"], "rounds": res[0]["rounds"], "process_rounds": blocks}
    aa = {m: med_ratio(ms[base, m], ms[names[1], m]) for m in modes}
    out["aa"] = aa
    valid = all(0.95 <= v <= 1.05 for v in aa.values())
    sync_ctrl = {n: med_ratio(ms[base, "sync"], ms[n, "sync"]) for n in names[2:]}
    out["sync_control"] = sync_ctrl
    if same_routing:
        valid = valid and all(0.95 <= v <= 1.05 for v in sync_ctrl.values())
    out["valid"] = valid
    table = {}
    for n in names[2:]:
        for m in modes:
            v = med_ratio(ms[base, m], ms[n, m])
            table[n, m] = v
    out["vs_arch1"] = {f"{n} {m}": v for (n, m), v in table.items()}
    out["verdict"] = {k: ("buys" if v >= 1.05 else "costs" if v <= 0.95 else "no difference") for k, v in out["vs_arch1"].items()}
    # target: arch4 async:16 vs its sync, and vs arch1's best async mode (highest median tok/s)
    a1_async = [m for m in modes if m.startswith("async")]
    best = min(a1_async, key=lambda m: statistics.median(ms[base, m]))
    out["best_arch1_mode"] = best
    if ("arch4", "async:16") in ms:
        out["target_vs_sync"] = med_ratio(ms["arch4", "sync"], ms["arch4", "async:16"])
        out["target_vs_best_d0"] = med_ratio(ms[base, best], ms["arch4", "async:16"])
        out["target_met"] = out["target_vs_sync"] >= 1.5 and out["target_vs_best_d0"] >= 1.2
    # gate: async:16 / async:16:opennext per round, pooled over arch1, arch4, a24 (not the A/A copy)
    if "async:16:opennext" in modes:  # per process: the median over its rounds of all three presets
        series = {n: [o / g for g, o in zip(ms[n, "async:16"], ms[n, "async:16:opennext"])] for n in [base] + names[2:]}
        out["gate_ratio"] = balanced(list(series.values()), blocks or [len(ms[base, "sync"])])
        out["gate_ships"] = out["gate_ratio"] >= 1.0
        out["gate_per_preset"] = {n: med_ratio(ms[n, "async:16:opennext"], ms[n, "async:16"]) for n in [base] + names[2:]}
    return out

if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(json.dumps(verdicts(p, "same" in p), indent=1))
