"""C6: explicit PREFETCHT0 does not help (a negative claim of the paper).

The switch is `Engine.load(prefetch=...)` / `Engine.prefetch` (cflow.runtime.prefetch; C:
`cf_engine_set_prefetch`, `cf_set_prefetch`): off (no PREFETCH instruction in any kernel), the
kernels' default (the mat-vec 8 KiB, the avx512 batched kernels 4 KiB ahead), or N bytes ahead in every weight-streaming
kernel: the tiled mat-vec, fused gate/up, and the batched prefill kernels matmat / gate_up_mm of
the avx2, avxvnni and avx512 tables, every dtype, dense and expert weights, and the fp32 router.
SmolLM2 decodes (tg) and prefills (pp) with every mode, alternating in one process and one engine,
repeated; each mode is compared with off. Deliberately not switched (NOT_SWITCHED): the KV-cache
reads of attention, the embedding row and the `_ref` table.
"""

from __future__ import annotations

import time

from cflow.bench.claims.core import (CONFIRMED, INCONCLUSIVE, REFUTED, ClaimResult, Context, Table, decode_tps, mean,
                                     pm, pyplot, quick_verdict, save, sd, shell)
from cflow.bench.claims.models import SMOLLM2_MISSING, smollm2_gguf

ID, TITLE = "C6", "Explicit PREFETCHT0 on/off"
PAPER = ("explicit PREFETCHT0 hints gave no benefit and were sometimes harmful (4% slower): the hardware prefetcher "
         "already saturates linear streaming from RAM, and the hints add cache pressure without adding overlap")
PAPER_NUMBER = "no gain; up to 4% slower"
NOT_SWITCHED = ("the KV-cache reads of attention (not weights; each head's cached rows are short contiguous runs the "
                "hardware prefetcher follows, and a different kernel family), the embedding row (one row of about "
                "1 kB per token: no stream to run ahead of) and the scalar `_ref` table (it defines the semantics, "
                "not the speed; used only where AVX2 is absent)")
OFF, DEFAULT = 0, None  # Engine.prefetch values
FULL_MODES = [OFF, DEFAULT, 256, 512, 1024, 2048, 4096, 8192]
QUICK_MODES = [OFF, DEFAULT, 1024]


def label(mode: int | None) -> str:
    return "default" if mode is None else "off" if mode == 0 else f"{mode} B ahead"


def prefill_tps(eng, prompt: list[int]) -> float:
    eng.reset()
    t0 = time.perf_counter()
    eng.prefill(prompt)
    return len(prompt) / (time.perf_counter() - t0)


def measure(ctx: Context, eng, modes, n: int, pp: int, reps: int) -> tuple[dict, dict]:
    """tg and pp tokens/s per mode: each repetition runs every mode once, in turn (the first
    round warms up and is dropped), so drift of the machine hits all modes alike."""
    tg: dict = {m: [] for m in modes}
    ppr: dict = {m: [] for m in modes}
    prompt = [300 + (7 * i) % 40000 for i in range(pp)]
    for rep in range(reps + 1):
        for m in modes:
            eng.prefetch = m
            v = decode_tps(eng, n, first=504)
            w = prefill_tps(eng, prompt)
            if rep:
                tg[m].append(v)
                ppr[m].append(w)
                ctx.log(ID, f"rep {rep}/{reps} prefetch {label(m)}: tg{n} {v:.1f} tok/s, pp{pp} {w:.1f} tok/s")
    return tg, ppr


def noise_band(xs: dict, a, b) -> float:
    """Twice the standard error of the difference of two means, at least 2%."""
    base = mean(xs[OFF])
    k = max(len(xs[a]), 1)
    return max(0.02, 2 * (sd(xs[a]) ** 2 / k + sd(xs[b]) ** 2 / k) ** 0.5 / base)


def compare(xs: dict, modes) -> dict:
    """Each mode against off: ratio, and the best and worst mode with their noise bands."""
    base = mean(xs[OFF])
    on = [m for m in modes if m != OFF]
    best = max(on, key=lambda m: mean(xs[m]))
    worst = min(on, key=lambda m: mean(xs[m]))
    return {"ratio": {label(m): mean(xs[m]) / base for m in modes}, "best": best, "worst": worst,
            "gain": mean(xs[best]) / base - 1, "loss": 1 - mean(xs[worst]) / base,
            "noise_best": noise_band(xs, best, OFF), "noise_worst": noise_band(xs, worst, OFF)}


def table_rows(xs: dict, modes) -> list[list[str]]:
    base = mean(xs[OFF])
    return [[label(m), pm(xs[m], ".1f"), f"{mean(xs[m]) / base:.3f}"] for m in modes]


def run(ctx: Context) -> ClaimResult:
    from cflow.runtime import Engine

    res = ClaimResult(ID, TITLE, paper=PAPER, paper_number=PAPER_NUMBER)
    res.commands = [ctx.rerun(ID)]
    gguf = smollm2_gguf()
    if gguf is None:
        res.verdict, res.reason, res.measured, res.ours = INCONCLUSIVE, SMOLLM2_MISSING, "failed", "not measured"
        return res
    modes = QUICK_MODES if ctx.quick else FULL_MODES
    n, pp, reps = (16, 32, 2) if ctx.quick else (128, 256, 7)
    with Engine.load(gguf, threads=ctx.threads, n_ctx=max(n, pp) + 16) as eng:
        isa = eng.isa
        dtypes = sorted({t.dtype for t in eng.file.tensors.values()} - {"f32"})
        tg, ppr = measure(ctx, eng, modes, n, pp, reps)
    cmp_tg, cmp_pp = compare(tg, modes), compare(ppr, modes)
    head = ["software prefetch", "tokens/s", "vs off"]
    res.tables.append(Table(f"SmolLM2-135M Q4_1 decode (tg{n}) per prefetch mode, interleaved, {reps} reps, "
                            f"{ctx.threads} threads, kernels {isa}", head, table_rows(tg, modes)))
    res.tables.append(Table(f"SmolLM2-135M Q4_1 prefill (pp{pp}, batched kernels) per prefetch mode, same runs",
                            head, table_rows(ppr, modes)))
    res.data.update({"isa": isa, "modes": [label(m) for m in modes], "weight_dtypes": dtypes,
                     "tg": {label(k): v for k, v in tg.items()}, "pp": {label(k): v for k, v in ppr.items()},
                     "tg_vs_off": cmp_tg["ratio"], "pp_vs_off": cmp_pp["ratio"], "tokens": n, "prompt": pp,
                     "reps": reps})
    res.commands += [f"cflow bench -m {shell([str(gguf)])} -t {ctx.threads} -p {pp} -n {n} -r {reps} --prefetch {p}"
                     for p in ("off", "default", "1024")]
    parts = []
    for name, c in (("decode", cmp_tg), ("prefill", cmp_pp)):
        parts.append(f"{name}: best {100 * c['gain']:+.1f}% ({label(c['best'])}, noise ±{100 * c['noise_best']:.1f}%), "
                     f"worst {-100 * c['loss']:+.1f}% ({label(c['worst'])}, noise ±{100 * c['noise_worst']:.1f}%)")
    res.ours_number = (f"tg best {100 * cmp_tg['gain']:+.1f}%, worst {-100 * cmp_tg['loss']:+.1f}%; "
                       f"pp best {100 * cmp_pp['gain']:+.1f}%, worst {-100 * cmp_pp['loss']:+.1f}% (vs off)")
    res.ours = (f"on SmolLM2 ({isa} kernels, every weight-streaming kernel switched), against prefetch off: "
                + "; ".join(parts) + ".")
    wins = [(name, c) for name, c in (("decode", cmp_tg), ("prefill", cmp_pp)) if c["gain"] > c["noise_best"]]
    losses = [f"{name} {label(c['worst'])} costs {100 * c['loss']:.1f}%"
              for name, c in (("decode", cmp_tg), ("prefill", cmp_pp)) if c["loss"] > c["noise_worst"]]
    if isa == "ref":
        v, why = INCONCLUSIVE, "the engine runs the scalar ref table, which never prefetches"
    elif wins:
        v, why = REFUTED, "; ".join(f"{name}: {label(c['best'])} is {100 * c['gain']:.1f}% faster than off, beyond "
                                    f"the noise (±{100 * c['noise_best']:.1f}%)" for name, c in wins)
    else:
        v, why = CONFIRMED, ("no prefetch mode helps decode or prefill beyond the noise"
                             + (f"; {', '.join(losses)}" if losses else ""))
    res.verdict, res.reason = quick_verdict(ctx, v, why, f"{len(modes)} modes, tg{n}/pp{pp}, {reps} reps")
    res.notes.append("What the switch covers: decode's tiled mat-vecs (Q/K/V/O, dense, shared and routed expert "
                     "projections, lm_head) and fused gate/up+SiLU, prefill's batched matmat and gate_up_mm, in the "
                     "avx2, avxvnni and avx512 tables, every dtype, and the fp32 router mat-vec. \"default\" is what "
                     "cflow ships, chosen from these measurements: the mat-vec and gate/up prefetch 8 KiB ahead and the "
                     "avx512 batched kernels 4 KiB ahead (this model's weight dtypes: "
                     f"{', '.join(dtypes) or 'unknown'}). "
                     f"Deliberately not switched: {NOT_SWITCHED}.")
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, xs, what in ((axes[0], tg, f"decode tg{n}"), (axes[1], ppr, f"prefill pp{pp}")):
            ax.errorbar(range(len(modes)), [mean(xs[m]) for m in modes], yerr=[sd(xs[m]) for m in modes],
                        marker="o", capsize=3)
            ax.set_xticks(range(len(modes)))
            ax.set_xticklabels([label(m).replace(" ahead", "") for m in modes], rotation=30)
            ax.set_xlabel("software prefetch")
            ax.set_ylabel("tokens/s")
            ax.set_title(what)
            ax.grid(alpha=0.3)
        fig.suptitle(f"SmolLM2 vs software prefetch ({isa})" + (" (quick run)" if ctx.quick else ""))
        save(fig, ctx.out / "c6_prefetch.png")
        res.plots.append(("c6_prefetch.png", "Decode and prefill tokens/s per prefetch mode (mean ± sd)."))
    return res
