"""C1: arch2_4_combined halves the critical-path weight bytes (9.00 -> 4.50 MB/token).

Analytic (cflow.dag.analyze) for every preset, in the paper's geometry (the README's `--set`
values) and in the presets' own; a sweep of arch2_4_combined's ratio over a fixed grid of
geometries (vocabulary, layers, top-k, dense width), the paper's point marked; a picture of the
arch1 and arch2_4_combined DAGs on the critical-path byte clock; and decode time of the two at
equal bytes per token, which is what the shorter chain is meant to buy once the runtime overlaps
independent nodes. The verdict rules are the RULE_* constants below, fixed before any measurement.
"""

from __future__ import annotations

import shutil
import subprocess

from cflow import dag
import itertools
import statistics

from cflow.bench.claims.core import (INCONCLUSIVE, ClaimResult, Context, Rule, Table,
                                     forced_tps, interleaved, pm, pyplot, quick_verdict, save, signature_has)
from cflow.config import PRESETS, ModelConfig

ID, TITLE = "C1", "Critical-path weight bytes of the pipeline-native DAG"
QUANT = "q4_0"
# the paper's main model (README "Pipeline-native architectures and the critical path")
PAPER_GEOMETRY = dict(vocab_size=5663, d_model=320, n_layers=13, n_heads=10, n_kv_heads=2, d_ff=480, n_experts=4,
                      top_k=1, d_expert=384)
ORDER = ["arch1", "arch3", "arch2", "arch4", "arch2_4_combined", "arch5", "llama"]
PAPER_RATIO = {"arch1": "1.00x", "arch3": "1.00x", "arch4": "none (1.00x)", "arch2_4_combined": "2.00x"}
LANES = ["embed", "attn", "dense", "router", "experts", "lm_head"]

# The geometry sweep: a full grid around the paper's model, its other fields (d_model, heads, 4 experts,
# d_expert) held. Each axis spans small-model proportions on both sides of the paper's value, which is
# on every axis, so the paper's point is one of the grid's points. Fixed here, before any run.
SWEEP = {"vocab_size": (2048, 5663, 16384, 32768), "n_layers": (6, 13, 24, 32), "top_k": (1, 2, 4),
         "d_ff": (256, 480, 960, 1920)}
SWEEP_POINTS = len(list(itertools.product(*SWEEP.values())))

# Decode timing: tokens per round and interleaved rounds (quick, full). Each round times arch1,
# arch2_4_combined, a second engine on arch1's file (the null pair: the noise band), and that engine
# decoding every token twice (the control, built to fail: same chain, twice the work) one after another.
DECODE_QUICK = (128, 11)
DECODE_FULL = (256, 9)

# The verdict rules. The paper reports 2.00x (9.00 -> 4.50 MB/token) for its own model: the first rule
# judges exactly that point. confirm 1.95: "halves" within the paper's own rounding (2.5%); refute 1.80:
# 10% short of halving means the headline does not hold even at the paper's point.
RULE_PAPER_POINT = Rule(
    "critical-path halving at the paper's geometry",
    "total / critical-path weight bytes per decode step of arch2_4_combined (q4_0, norms and routers f32; "
    "cflow.dag.analyze, exact, one evaluation) at the paper's own geometry (the README's --set values, "
    "PAPER_GEOMETRY), the only point judged",
    confirm=1.95, refute=1.80)
# Whether the halving is a property of the architecture or of the geometry the paper picked: the median
# over every point of the fixed grid SWEEP (not its best point). 1.80 / 1.50: the typical geometry keeps
# 90% of the halving, or loses more than a quarter of it.
RULE_SWEEP = Rule(
    "critical-path ratio across geometries",
    f"median over all {SWEEP_POINTS} points of the fixed grid SWEEP (vocab x layers x top-k x d_ff, every point "
    f"counted once, the paper's included) of arch2_4_combined's total / critical-path bytes (analytic)",
    confirm=1.80, refute=1.50)
# What the shorter chain should buy: time at equal bytes. Rounds are interleaved, so drift on a shared
# machine hits both models alike; on this shared 2-core machine the median of per-round ratios of arch1
# against itself came out 0.95-0.98 (four trials, measured before fixing these). So: a speed-up under 5%
# is none beyond noise (refuted: the delay window did not buy speed); 10%, twice that band, confirms.
# The null pair is shown beside it, not judged as the control: at 1.00 it sits inside that band, where
# one noisy round could tip it; the control is a pair that must lose by a wide margin.
RULE_DECODE_TIME = Rule(
    "decode speed-up at equal bytes",
    f"arch1 ms/token / arch2_4_combined ms/token, same weights (equal bytes per token), runtime overlap on, "
    f"the paper's geometry in a full run ({DECODE_FULL[0]} tokens x {DECODE_FULL[1]} rounds; quick: the "
    f"presets' geometry, {DECODE_QUICK[0]} x {DECODE_QUICK[1]}), all the run's threads; median over the "
    f"interleaved rounds of the per-round ratio",
    confirm=1.10, refute=1.05)


def _set_flags(geo: dict) -> str:
    return " ".join(f"--set {k}={v}" for k, v in geo.items())


def analyze_all() -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {"paper": {}, "preset": {}}
    presets = [p for p in ORDER if p in PRESETS] + sorted(set(PRESETS) - set(ORDER))
    for p in presets:
        for geo_name, geo in (("paper", PAPER_GEOMETRY), ("preset", {})):
            rep = dag.analyze(ModelConfig.from_name(p, **geo), QUANT)
            out[geo_name][p] = {"total_bytes": rep.total_bytes, "critical_bytes": rep.critical_bytes,
                                "ratio": rep.ratio, "split": rep.split, "critical_split": rep.critical_split}
    return out


def _weight_preds(g: dag.Dag) -> dict[str, list[str]]:
    """Each weight node's weight-node predecessors, looking through the zero-byte joins."""
    memo: dict[str, set[str]] = {}

    def up(n: str) -> set[str]:
        if n not in memo:
            s: set[str] = set()
            for p in g.preds[n]:
                s |= up(p) if g.nodes[p].kind == "join" else {p}
            memo[n] = s
        return memo[n]

    return {n.name: sorted(up(n.name)) for n in g.weight_nodes()}


def draw_dags(path, presets: list[str], geo: dict) -> None:
    """Each preset's decode-step DAG on the byte clock: a box per weight-reading node from its
    earliest start to its end (MB streamed on the longest path before it), one lane per node kind,
    critical nodes red, dependencies grey."""
    plt = pyplot()
    fig, axes = plt.subplots(len(presets), 1, figsize=(12, 2.6 * len(presets)), sharex=True)
    for ax, p in zip(axes, presets):
        cfg = ModelConfig.from_name(p, **geo)
        g = dag.build_dag(cfg, QUANT)
        t = dag.timings(g)
        lane = {k: i for i, k in enumerate(LANES)}
        preds = _weight_preds(g)
        for n in g.weight_nodes():
            x0, w = t[n.name].earliest_start / 1e6, n.nbytes / 1e6
            y = lane[n.kind]
            for pr in preds[n.name]:
                pn = g.nodes[pr]
                ax.plot([(t[pr].earliest_start + pn.nbytes) / 1e6, x0], [lane[pn.kind], y], color="0.75", lw=0.5,
                        zorder=1)
            crit = t[n.name].slack == 0
            ax.add_patch(plt.Rectangle((x0, y - 0.35), max(w, 0.004), 0.7, facecolor="#d62728" if crit else "#1f77b4",
                                       edgecolor="black", lw=0.3, alpha=0.9 if crit else 0.6, zorder=2))
            if n.kind in ("attn", "dense", "experts") and w > 0.06:
                ax.text(x0 + w / 2, y, str(n.layer), ha="center", va="center", fontsize=6, color="white", zorder=3)
        rep = dag.analyze(cfg, QUANT)
        ax.set_yticks(range(len(LANES)))
        ax.set_yticklabels(LANES, fontsize=8)
        ax.set_ylim(-0.7, len(LANES) - 0.3)
        ax.axvline(rep.critical_bytes / 1e6, color="#d62728", ls="--", lw=0.8)
        ax.set_title(f"{p}: {rep.total_bytes / 1e6:.2f} MB/token in total, critical path "
                     f"{rep.critical_bytes / 1e6:.2f} MB (ratio {rep.ratio:.2f}x)", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("MB of weights streamed on the longest chain before the node can start "
                        "(red: on the critical path; numbers: layer)")
    save(fig, path)


def render_dot(g: dag.Dag, stem) -> str | None:
    """Write the --dot source; render it to PNG when Graphviz `dot` is installed. The PNG's name, or None."""
    src = stem.with_suffix(".dot")
    src.write_text(dag.to_dot(g))
    exe = shutil.which("dot")
    if not exe:
        return None
    png = stem.with_suffix(".dot.png")
    r = subprocess.run([exe, "-Tpng", str(src), "-o", str(png)], capture_output=True, timeout=120)
    return png.name if r.returncode == 0 and png.is_file() else None


def sweep() -> list[dict]:
    """arch2_4_combined's and arch1's critical-path ratio at every point of SWEEP (analytic)."""
    rows = []
    for values in itertools.product(*SWEEP.values()):
        geo = {**PAPER_GEOMETRY, **dict(zip(SWEEP, values))}
        row = {k: geo[k] for k in SWEEP}
        for p in ("arch2_4_combined", "arch1"):
            rep = dag.analyze(ModelConfig.from_name(p, **geo), QUANT)
            row[p] = {"total_bytes": rep.total_bytes, "critical_bytes": rep.critical_bytes, "ratio": rep.ratio}
        row["paper"] = all(geo[k] == PAPER_GEOMETRY[k] for k in SWEEP)
        rows.append(row)
    return rows


def sweep_tables(rows: list[dict]) -> list[Table]:
    """One table: each axis varied alone around the paper's point, then the whole grid's spread."""
    def ratio_at(**fix) -> dict:
        return next(r for r in rows if all(r[k] == fix.get(k, PAPER_GEOMETRY[k]) for k in SWEEP))

    out = []
    for axis, values in SWEEP.items():
        for v in values:
            r = ratio_at(**{axis: v})
            a = r["arch2_4_combined"]
            out.append([axis, str(v) + (" (paper)" if v == PAPER_GEOMETRY[axis] else ""),
                        f"{a['total_bytes'] / 1e6:.3f}", f"{a['critical_bytes'] / 1e6:.3f}", f"{a['ratio']:.3f}x"])
    ratios = sorted(r["arch2_4_combined"]["ratio"] for r in rows)
    lo, hi = min(rows, key=lambda r: r["arch2_4_combined"]["ratio"]), max(rows, key=lambda r: r["arch2_4_combined"]["ratio"])

    def where(r: dict) -> str:
        return ", ".join(f"{k} {r[k]}" for k in SWEEP)

    out += [["whole grid", f"minimum ({where(lo)})", "", "", f"{ratios[0]:.3f}x"],
            ["whole grid", f"median of {len(ratios)} points", "", "", f"{statistics.median(ratios):.3f}x"],
            ["whole grid", f"maximum ({where(hi)})", "", "", f"{ratios[-1]:.3f}x"]]
    return [Table(f"arch2_4_combined's critical-path ratio over the geometry sweep ({QUANT}, analytic; the "
                  f"paper's d_model {PAPER_GEOMETRY['d_model']}, {PAPER_GEOMETRY['n_experts']} experts of "
                  f"{PAPER_GEOMETRY['d_expert']} held): each axis varied alone around the paper's point, then the "
                  f"spread over all {len(rows)} points of the grid",
                  ["axis", "value", "total MB/token", "critical MB", "ratio"], out)]


def draw_sweep(path, rows: list[dict]) -> None:
    """Each axis varied alone around the paper's point (four panels), and every grid point sorted by
    ratio (the fifth), the paper's point marked in red throughout."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 5, figsize=(16, 3.6), gridspec_kw={"width_ratios": [1, 1, 1, 1, 2]})
    for ax, (axis, values) in zip(axes, SWEEP.items()):
        ys = [next(r for r in rows if all(r[k] == (v if k == axis else PAPER_GEOMETRY[k]) for k in SWEEP))
              ["arch2_4_combined"]["ratio"] for v in values]
        ax.plot(values, ys, "o-", color="#1f77b4")
        i = values.index(PAPER_GEOMETRY[axis])
        ax.plot([values[i]], [ys[i]], "*", color="#d62728", markersize=14, label="paper's geometry")
        if axis != "top_k":
            ax.set_xscale("log", base=2)
        ax.set_xticks(values)
        ax.set_xticklabels([str(v) for v in values], fontsize=7)
        ax.minorticks_off()
        ax.set_xlabel(axis)
        ax.axhline(2.0, color="0.6", ls=":", lw=0.8)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("total / critical-path bytes")
    axes[0].legend(fontsize=7)
    srt = sorted(rows, key=lambda r: r["arch2_4_combined"]["ratio"])
    ax = axes[-1]
    ax.plot(range(len(srt)), [r["arch2_4_combined"]["ratio"] for r in srt], ".", color="#1f77b4",
            label=f"all {len(srt)} grid points, sorted")
    i = next(j for j, r in enumerate(srt) if r["paper"])
    ax.plot([i], [srt[i]["arch2_4_combined"]["ratio"]], "*", color="#d62728", markersize=14, label="paper's geometry")
    ax.axhline(statistics.median(r["arch2_4_combined"]["ratio"] for r in srt), color="k", ls="--", lw=0.8,
               label="median (judged by the sweep rule)")
    ax.axhline(2.0, color="0.6", ls=":", lw=0.8)
    ax.set_xlabel("grid point (by ratio)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.suptitle("arch2_4_combined: critical-path ratio over geometries (q4_0, analytic)", fontsize=10)
    save(fig, path)


def measure_decode(ctx: Context, res: ClaimResult) -> dict:
    """arch1 vs arch2_4_combined, same weights (same tensor shapes: equal bytes per token), plus a
    second engine on arch1's own file: once as the null pair (equally long chains), once decoding
    every token twice (the control)."""
    from cflow.bench.claims.models import random_params, write_random_model
    from cflow.runtime import Engine

    geo = {} if ctx.quick else PAPER_GEOMETRY
    n, reps = DECODE_QUICK if ctx.quick else DECODE_FULL
    cfgs = {p: ModelConfig.from_name(p, **geo, max_seq_len=max(n + 8, 64)) for p in ("arch1", "arch2_4_combined")}
    params = random_params(cfgs["arch1"], seed=1)
    overlap = signature_has(Engine.load, "overlap")
    engines, info = {}, {}
    kw = {"overlap": True} if overlap else {}
    for p, cfg in cfgs.items():
        path = write_random_model(ctx.work / f"c1_{p}.cflow", cfg, QUANT, params=params)
        engines[p] = Engine.load(path, threads=ctx.threads, n_ctx=n + 8, verify=False, **kw)
        info[p] = {"bytes_per_token": engines[p].weight_bytes_per_token(), "file": path.name}
    engines["arch1 (again)"] = Engine.load(ctx.work / info["arch1"]["file"], threads=ctx.threads, n_ctx=n + 8,
                                           verify=False, **kw)
    info["arch1 (again)"] = {"bytes_per_token": engines["arch1 (again)"].weight_bytes_per_token(),
                             "file": info["arch1"]["file"]}
    ctx.log(ID, f"decode {n} tokens x {reps} reps, arch1 vs arch2_4_combined vs arch1 again "
                f"({info['arch1']['bytes_per_token'] / 1e6:.2f} MB/token each)")
    twice = "arch1 (again), every token twice"
    info[twice] = {**info["arch1 (again)"], "bytes_per_token": 2 * info["arch1 (again)"]["bytes_per_token"]}
    fns = {p: (lambda e=e: forced_tps(e, n, seed=3)) for p, e in engines.items()}
    e2 = engines["arch1 (again)"]
    fns[twice] = lambda: 1 / (1 / forced_tps(e2, n, seed=3) + 1 / forced_tps(e2, n, seed=3))
    try:
        samples = interleaved(fns, reps, log=lambda m: ctx.log(ID, m))
    finally:
        for e in engines.values():
            e.close()
    ms = {p: [1e3 / s for s in v] for p, v in samples.items()}
    # per round: arch1's time over the other's (> 1: the other is faster)
    per_round = [a / b for a, b in zip(ms["arch1"], ms["arch2_4_combined"])]
    null = [a / b for a, b in zip(ms["arch1"], ms["arch1 (again)"])]
    control = [a / b for a, b in zip(ms["arch1"], ms[twice])]
    res.tables.append(Table(
        f"Decode time at equal bytes per token ({'preset' if ctx.quick else 'paper'} geometry, {QUANT}, random "
        f"weights, {ctx.threads} thread(s), {n} tokens x {reps} interleaved rounds"
        f"{', runtime overlap on: attn(l) beside dense(l) on two thread groups' if overlap else ', runtime runs ops in order'}"
        f"{'' if ctx.threads >= 2 or not overlap else ' (one thread: nothing to overlap)'}; the last two rows: a "
        f"second engine on arch1's file (the null pair, the noise band) and the same decoding every token twice "
        f"(the control))",
        ["model", "weight MB/token", "ms/token", "tokens/s", "arch1 ms / this ms, median of rounds"],
        [[p, f"{info[p]['bytes_per_token'] / 1e6:.3f}", pm(ms[p], ".3f"), pm(samples[p], ".1f"),
          "–" if p == "arch1" else f"{statistics.median({'arch2_4_combined': per_round, twice: control}.get(p, null)):.3f}"]
         for p in ms]))
    return {"geometry": "preset" if ctx.quick else "paper", "tokens": n, "reps": reps, "overlap": overlap,
            "threads": ctx.threads, "ms_per_token": ms, "tokens_per_s": samples, "per_round_ratio": per_round,
            "null_per_round_ratio": null, "control_per_round_ratio": control,
            "arch1_over_arch2_4_time": statistics.median(per_round), "arch1_over_arch1_time": statistics.median(null),
            "arch1_over_arch1_twice_time": statistics.median(control), "models": info}


def run(ctx: Context) -> ClaimResult:
    res = ClaimResult(
        ID, TITLE,
        paper="arch2_4_combined (delta_dense = 1, delta_expert = 2) halves the weight bytes on the decode step's "
              "critical path relative to the sequential schedule: 9.00 -> 4.50 MB/token (2.00x); arch1/arch3 "
              "are listed at 1.00x and arch4 with no reduction. The shorter chain is what lets a runtime overlap "
              "layers (vertical pipelining).",
        paper_number="2.00x (9.00 -> 4.50 MB/token)", measured="analytic")
    data = analyze_all()
    res.data["analysis"] = data
    pa, pr = data["paper"], data["preset"]
    a24 = pa["arch2_4_combined"]
    res.ours_number = (f"{a24['ratio']:.3f}x ({a24['total_bytes'] / 1e6:.2f} -> "
                       f"{a24['critical_bytes'] / 1e6:.2f} MB/token)")
    res.ours = (f"cflow.dag.analyze gives arch2_4_combined {a24['total_bytes'] / 1e6:.3f} MB/token in total and "
                f"{a24['critical_bytes'] / 1e6:.3f} MB on the critical path in the paper's geometry: ratio "
                f"{a24['ratio']:.3f}x; arch1 {pa['arch1']['ratio']:.3f}x. In the presets' own small geometry "
                f"arch2_4_combined gives {pr['arch2_4_combined']['ratio']:.3f}x.")
    rows = []
    for p in pa:
        rows.append([p, f"{pa[p]['total_bytes'] / 1e6:.3f}", f"{pa[p]['critical_bytes'] / 1e6:.3f}",
                     f"{pa[p]['ratio']:.3f}x", PAPER_RATIO.get(p, "–"), f"{pr[p]['total_bytes'] / 1e6:.3f}",
                     f"{pr[p]['critical_bytes'] / 1e6:.3f}", f"{pr[p]['ratio']:.3f}x"])
    res.tables.append(Table(
        f"Weight bytes per decode step ({QUANT}; norms and routers f32), analytic",
        ["preset", "paper geometry: total MB", "critical MB", "ratio", "paper's ratio", "preset geometry: total MB",
         "critical MB", "ratio"], rows))
    res.commands = [ctx.rerun(ID),
                    f"cflow analyze --preset arch2_4_combined --quant {QUANT} {_set_flags(PAPER_GEOMETRY)}",
                    f"cflow analyze --preset arch1 --quant {QUANT} {_set_flags(PAPER_GEOMETRY)}",
                    f"cflow analyze --preset arch2_4_combined --quant {QUANT} --dot c1_arch2_4_combined.dot"]
    exact = round(a24["total_bytes"] / 1e4) == 900 and round(a24["critical_bytes"] / 1e4) == 450
    verdict, why = res.apply(RULE_PAPER_POINT, a24["ratio"])
    # control: arch1, whose chain is every node, at the same geometry
    res.apply(RULE_PAPER_POINT, pa["arch1"]["ratio"], control=True)
    res.parts.append({"name": "analytic halving (paper geometry)", "verdict": verdict,
                      "reason": f"{why}; total {a24['total_bytes']:,} B, critical {a24['critical_bytes']:,} B"
                                + (" (the paper's 9.00 -> 4.50 MB exactly)" if exact else
                                   " (not the paper's 9.00 -> 4.50 MB)")})
    others = [p for p in ("arch3", "arch2", "arch4") if abs(pa[p]["ratio"] - 1.0) > 0.005]
    if others:
        res.parts.append({
            "name": "the other presets", "verdict": INCONCLUSIVE,
            "reason": "the architecture's equations also shorten " + ", ".join(f"{p} ({pa[p]['ratio']:.2f}x)" for p in others)
                      + ", where the paper's summary lists 1.00x (arch3) and no reduction (arch4); the summary does "
                        "not say how the paper counted those, so this is a difference of accounting we cannot "
                        "resolve from it (cflow.dag's docstring)."})
    # the sweep
    grid = sweep()
    res.data["sweep"] = {"axes": {k: list(v) for k, v in SWEEP.items()}, "points": grid}
    ratios = [r["arch2_4_combined"]["ratio"] for r in grid]
    sv, swhy = res.apply(RULE_SWEEP, statistics.median(ratios))
    res.apply(RULE_SWEEP, statistics.median(r["arch1"]["ratio"] for r in grid), control=True)  # arch1's grid
    res.parts.append({"name": "across geometries (sweep)", "verdict": sv,
                      "reason": f"{swhy}; over the {len(grid)} points the ratio runs from {min(ratios):.3f}x to "
                                f"{max(ratios):.3f}x, the paper's point gives {a24['ratio']:.3f}x"})
    res.tables += sweep_tables(grid)
    if pyplot() is not None:
        draw_sweep(ctx.out / "c1_sweep.png", grid)
        res.plots.append(("c1_sweep.png", "arch2_4_combined's total / critical-path weight bytes as each axis "
                                          "varies around the paper's geometry (red star), and at every point of the "
                                          "grid, sorted (right; dashed: the median the sweep rule judges)."))
    # pictures
    geo_pic = PAPER_GEOMETRY
    if pyplot() is not None:
        draw_dags(ctx.out / "c1_dag.png", ["arch1", "arch2_4_combined"], geo_pic)
        res.plots.append(("c1_dag.png", "arch1 (top) and arch2_4_combined (bottom) in the paper's geometry: each "
                                        "box is a weight-reading node placed at its earliest start on the byte "
                                        "clock; the chain of red boxes is the critical path."))
    for p in ("arch1", "arch2_4_combined"):
        png = render_dot(dag.build_dag(ModelConfig.from_name(p, **geo_pic), QUANT), ctx.out / f"c1_{p}")
        if png:
            res.plots.append((png, f"Graphviz rendering of `cflow analyze --preset {p} --dot` (paper geometry)"))
    res.data["graphviz"] = bool(shutil.which("dot"))
    if not shutil.which("dot"):
        res.notes.append("Graphviz `dot` is not installed here: the DAG is drawn with matplotlib; the `--dot` "
                         "sources are written beside the report (c1_arch1.dot, c1_arch2_4_combined.dot).")
    # timing
    timing = measure_decode(ctx, res)
    res.data["decode"] = timing
    r = timing["arch1_over_arch2_4_time"]
    tv, twhy = res.apply(RULE_DECODE_TIME, r)
    res.apply(RULE_DECODE_TIME, timing["arch1_over_arch1_twice_time"], control=True)  # arch1 against itself, 2x work
    setting = (f"runtime overlap of attn(l) beside dense(l) (the one pair it overlaps yet: Engine.load(overlap=True)), "
               f"{ctx.threads} thread(s)" if timing["overlap"] else "the runtime runs ops strictly in order")
    tv, twhy = quick_verdict(ctx, tv, f"{twhy} ({setting})",
                             f"the presets' small geometry, {DECODE_QUICK[0]} tokens x {DECODE_QUICK[1]} rounds")
    res.parts.append({"name": "decode time at equal bytes", "verdict": tv, "reason": twhy})
    if timing["overlap"]:
        res.pending = ("overlap of experts(l) with the layers after it (delta_expert): needs per-node hidden/output "
                       "buffers (docs/DESIGN.md, \"Overlapping independent nodes\"); only attn(l) beside dense(l) "
                       "runs concurrently today")
    else:
        res.pending = ("measured speed-up from the shorter chain: the runtime runs the per-token plan one op at a "
                       "time (engine.c forward_task); overlapping independent nodes beyond attn(l) beside dense(l) is not built")
    res.verdict = verdict
    res.reason = (f"judged at the paper's own geometry: the DAG tool gives {a24['total_bytes'] / 1e6:.2f} -> "
                  f"{a24['critical_bytes'] / 1e6:.2f} MB/token ({a24['ratio']:.3f}x) for arch2_4_combined ({why}). "
                  f"This is arithmetic on the dependency graph at the geometry the paper reports: over the fixed "
                  f"sweep of {len(grid)} geometries the ratio runs {min(ratios):.2f}-{max(ratios):.2f}x (median "
                  f"{statistics.median(ratios):.2f}x: {sv}), and total bytes per token do not shrink (every preset "
                  f"reads {a24['total_bytes'] / 1e6:.2f} MB), only the sequential chain does. Whether the shorter "
                  f"chain buys time is the decode-time rule: arch1 / arch2_4_combined time = {r:.3f} ({tv}).")
    res.notes.append("Where the paper's point sits: the paper's geometry (the README's --set values) is the one "
                     "that gives its 9.00 -> 4.50 MB exactly; the first rule judges that point because it is the "
                     "paper's, and the sweep shows how much the ratio owes to it. The ratio is total bytes over the "
                     "bytes of the longest chain, so it moves with the share of nodes the delays take off that "
                     "chain; the sweep table shows which way each axis moves it (the embedding and lm_head, for "
                     "one, stay on the chain, so a larger vocabulary lowers it).")
    res.notes.append("What the ratio does and does not mean: the delays remove no weight byte; what halves is "
                     "the chain of reads that must happen one after another. A runtime that overlaps independent "
                     "nodes can keep more memory requests in flight and hide latency (or disk I/O); it still "
                     "cannot beat bandwidth / total bytes per token.")
    return res
