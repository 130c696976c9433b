"""C6: explicit PREFETCHT0 does not help (a negative claim of the paper).

What exists today: `cflow._native.set_prefetch(bytes_ahead)` (C: `cf_set_prefetch`, a process-wide
distance, 0 = off). It is read by `matvec_groups` in kernels_avx2.c (also compiled as the AVX-VNNI
table), which the decode step reaches through the tiled mat-vec and the fused gate/up+SiLU kernel.
SmolLM2 decodes with every setting, alternating in one process, and prefill runs as a control
(its batched kernels never prefetch).
"""

from __future__ import annotations

import time

from cflow.bench.claims.core import (CONFIRMED, INCONCLUSIVE, REFUTED, ClaimResult, Context, Table, decode_tps, mean,
                                     pm, pyplot, quick_verdict, save, sd)
from cflow.bench.claims.models import SMOLLM2_MISSING, smollm2_gguf

ID, TITLE = "C6", "Explicit PREFETCHT0 on/off"
PAPER = ("explicit PREFETCHT0 hints gave no benefit and were sometimes harmful (4% slower): the hardware prefetcher "
         "already saturates linear streaming from RAM, and the hints add cache pressure without adding overlap")
PAPER_NUMBER = "no gain; up to 4% slower"
NOT_COVERED = ("the batched prefill kernels (matmat, gate_up_mm in kernels_avx2.c), the scalar reference table "
               "(kernels_ref.c, used where AVX2 is absent), embedding-row reads, the f32 router mat-vec and the "
               "KV-cache reads of attention; and the switch is reachable only as cflow._native.set_prefetch, not "
               "from Engine or `cflow bench` (issue #13 asks for one covering every weight-streaming kernel: C work "
               "for the native engineer)")


def run(ctx: Context) -> ClaimResult:
    from cflow import _native
    from cflow.runtime import Engine

    res = ClaimResult(ID, TITLE, paper=PAPER, paper_number=PAPER_NUMBER)
    res.commands = [ctx.rerun(ID)]
    gguf = smollm2_gguf()
    if gguf is None:
        res.verdict, res.reason, res.measured, res.ours = INCONCLUSIVE, SMOLLM2_MISSING, "failed", "not measured"
        return res
    if not hasattr(_native, "set_prefetch"):
        res.verdict, res.measured, res.ours = INCONCLUSIVE, "pending", "not measured"
        res.reason = "the C core exports no prefetch switch (cf_set_prefetch)"
        return res
    settings = [0, 1024] if ctx.quick else [0, 256, 512, 1024, 2048, 4096]
    n, reps = (32, 3) if ctx.quick else (128, 7)
    pp = 0 if ctx.quick else 128
    old = _native.get_prefetch()
    tg: dict[int, list[float]] = {s: [] for s in settings}
    ppr: dict[int, list[float]] = {s: [] for s in (0, 1024)}
    try:
        with Engine.load(gguf, threads=ctx.threads, n_ctx=max(n, pp) + 16) as eng:
            isa = eng.isa
            prompt = list(range(300, 300 + pp))
            for rep in range(reps + 1):  # the first round warms up
                for s in settings:
                    _native.set_prefetch(s)
                    v = decode_tps(eng, n, first=504)
                    if rep:
                        tg[s].append(v)
                        ctx.log(ID, f"prefetch {s} B ahead: tg{n} {v:.1f} tok/s")
                for s in ppr if pp else ():
                    _native.set_prefetch(s)
                    eng.reset()
                    t0 = time.perf_counter()
                    eng.prefill(prompt)
                    if rep:
                        ppr[s].append(pp / (time.perf_counter() - t0))
    finally:
        _native.set_prefetch(old)
    base = mean(tg[0])
    rows = []
    for s in settings:
        r = mean(tg[s]) / base
        rows.append([("off" if s == 0 else f"{s} B ahead"), pm(tg[s], ".1f"), f"{r:.3f}"])
    res.tables.append(Table(f"SmolLM2-135M Q4_1 decode (tg{n}) with each prefetch distance, interleaved, {reps} reps, "
                            f"{ctx.threads} threads, kernels {isa}", ["PREFETCHT0", "tokens/s", "vs off"], rows))
    if pp:
        res.tables.append(Table(f"Control: prefill pp{pp} (batched kernels, which never prefetch)",
                                ["PREFETCHT0", "tokens/s", "vs off"],
                                [[("off" if s == 0 else f"{s} B ahead"), pm(v, ".1f"), f"{mean(v) / mean(ppr[0]):.3f}"]
                                 for s, v in ppr.items()]))
    res.data.update({"isa": isa, "settings": settings, "tg": {str(k): v for k, v in tg.items()},
                     "pp": {str(k): v for k, v in ppr.items()} if pp else None, "tokens": n, "reps": reps})
    res.commands.append("python -c \"from cflow import _native; _native.set_prefetch(1024)\"  # then decode in the "
                        "same process (no CLI switch exists)")
    on = [s for s in settings if s]
    best = max(on, key=lambda s: mean(tg[s]))
    gain = mean(tg[best]) / base - 1
    noise = max(0.02, 2 * (sd(tg[0]) + sd(tg[best])) / base / max(len(tg[0]), 1) ** 0.5)
    worst = min(on, key=lambda s: mean(tg[s]))
    loss = 1 - mean(tg[worst]) / base
    if len(on) > 1:
        res.ours_number = f"best {100 * gain:+.1f}% ({best} B ahead), worst {-100 * loss:+.1f}% ({worst} B)"
        res.ours = (f"on SmolLM2 decode ({isa} kernels), the best prefetch distance changes speed by "
                    f"{100 * gain:+.1f}% ({best} B ahead) and the worst by {-100 * loss:+.1f}% ({worst} B ahead), "
                    f"against a noise band of ±{100 * noise:.1f}%.")
    else:
        res.ours_number = f"{100 * gain:+.1f}% ({best} B ahead)"
        res.ours = (f"on SmolLM2 decode ({isa} kernels), prefetching {best} B ahead changes speed by "
                    f"{100 * gain:+.1f}%, against a noise band of ±{100 * noise:.1f}%.")
    if isa not in ("avx2", "avxvnni"):
        v, why = INCONCLUSIVE, f"the engine runs the {isa} kernels, which never prefetch: nothing was switched"
    elif gain > noise:
        v, why = REFUTED, (f"prefetching {best} B ahead is {100 * gain:.1f}% faster, beyond the noise "
                           f"(±{100 * noise:.1f}%)")
    else:
        v, why = CONFIRMED, (f"no distance helps beyond the noise (best {100 * gain:+.1f}%, noise ±{100 * noise:.1f}%)"
                             + (f"; the worst costs {100 * loss:.1f}%" if loss > noise else ""))
    res.verdict, res.reason = quick_verdict(ctx, v, why, f"2 settings, {n} tokens, {reps} reps")
    res.reason += f". Partial switch: it does not cover {NOT_COVERED.split('; and')[0]}."
    res.measured = "partial"
    res.pending = ("a prefetch switch covering every weight-streaming kernel, reachable from Engine and `cflow bench` "
                   "(issue #13; C work in src/cflow/native/)")
    res.notes.append(f"What `set_prefetch` covers: decode's tiled mat-vecs (Q/K/V/O, dense and expert down "
                     f"projections, lm_head) and fused gate/up+SiLU (AVX2 and AVX-VNNI tables, through matvec_groups). "
                     f"What it does not: {NOT_COVERED}.")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.errorbar(range(len(settings)), [mean(tg[s]) for s in settings], yerr=[sd(tg[s]) for s in settings],
                    marker="o", capsize=3)
        ax.set_xticks(range(len(settings)))
        ax.set_xticklabels(["off" if s == 0 else f"{s} B" for s in settings])
        ax.set_xlabel("PREFETCHT0 distance")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"SmolLM2 decode vs software prefetch ({isa})" + (" (quick run)" if ctx.quick else ""))
        ax.grid(alpha=0.3)
        save(fig, ctx.out / "c6_prefetch.png")
        res.plots.append(("c6_prefetch.png", "Decode tokens/s for each prefetch distance (mean ± sd)."))
    return res
