"""C3: only the top-k experts a token routes to are read (up to 16x fewer expert bytes).

Small random MoE models at several (E, k) up to E = 64: the engine's own byte counters
(`Engine.counters()["experts"]`, which count every weight byte the experts op touches) over a run
of decode steps, against the analytic top-k bytes (`cflow.weights.token_bytes` over the file's
tensor sizes) and against reading every expert of every layer. With experts on disk
(`Engine.load(..., experts="disk")`), also the bytes read from the file against the misses of the
expert cache times the size of an expert's span.
"""

from __future__ import annotations

import numpy as np

from cflow import weights
from cflow.bench.claims.core import (CONFIRMED, INCONCLUSIVE, REFUTED, ClaimResult, Context, Table, fmt_bytes,
                                     pyplot, save, signature_has)
from cflow.bench.claims.models import write_random_model
from cflow.config import ModelConfig
from cflow.runtime import EngineError

ID, TITLE = "C3", "Only the top-k experts are read"
PAPER = ("conditional expert loading: the expert offset table lets the runtime read only the tiles of the top-k "
         "experts, up to 16x less expert weight bandwidth on large MoE models (standard loading reads every expert "
         "of a layer, wasting up to 15x on models like Gemma 4)")
PAPER_NUMBER = "up to 16x fewer expert bytes"


def disk_mode_available() -> tuple[bool, str]:
    """Issue #10's disk residency: Engine.load(experts=..., expert_cache=...) and the disk counters."""
    from cflow import _native
    from cflow.runtime import Engine

    if not signature_has(Engine.load, "experts", "expert_cache", "expert_io"):
        return False, "Engine.load has no experts= / expert_cache= / expert_io= parameters yet"
    names = set(getattr(_native, "COUNTER_NAMES", ()))
    if not {"disk_bytes", "cache_hits", "cache_misses"} <= names:
        return False, "the C core exports no disk_bytes / cache_hits / cache_misses counters yet"
    return True, "Engine.load(experts='disk', expert_cache=..., expert_io=...) and disk counters present"


def model_config(E: int, k: int, quick: bool) -> ModelConfig:
    d = 64 if quick else 128
    return ModelConfig.from_name("arch2_4_combined", vocab_size=512, d_model=d, n_layers=3 if quick else 4, n_heads=2,
                                 n_kv_heads=1, d_ff=d, n_experts=E, top_k=k, d_expert=d, max_seq_len=128,
                                 tie_embeddings=True)


def measure_ram(ctx: Context, E: int, k: int, n_tokens: int) -> dict:
    from cflow.runtime import Engine

    cfg = model_config(E, k, ctx.quick)
    path = write_random_model(ctx.work / f"c3_E{E}_k{k}.cflow", cfg, "q4_0", seed=E * 100 + k)
    kw = {"experts": "ram"} if signature_has(Engine.load, "experts") else {}
    with Engine.load(path, threads=ctx.threads, n_ctx=n_tokens + 8, verify=False, **kw) as eng:
        sizes = {n: e.nbytes for n, e in eng.file.tensors.items()}
        toks = np.random.default_rng(E + k).integers(0, cfg.vocab_size, n_tokens)
        eng.reset()
        eng.reset_counters()
        for pos, t in enumerate(toks):
            eng.step(int(t), pos)
        c = eng.counters()
        hits = np.array(eng.expert_hits())
    analytic = weights.token_bytes(cfg, lambda w: sizes[w.name])["experts"]
    all_experts = sum(sizes[w.name] for layer in range(cfg.n_layers)
                      for w in weights.layer_weights(cfg, cfg.weight_layer(layer)) if w.expert is not None)
    measured = c["experts"] / c["tokens"]
    return {"E": E, "k": k, "tokens": int(c["tokens"]), "layers": cfg.n_layers, "d_model": cfg.d_model,
            "expert_bytes_per_token": measured, "analytic_topk_bytes": analytic, "all_experts_bytes": all_experts,
            "measured_over_analytic": measured / analytic, "all_over_measured": all_experts / measured,
            "expected_reduction": E / k, "distinct_experts_per_layer": [int((h > 0).sum()) for h in hits],
            "routed_per_layer": [int(h.sum()) for h in hits], "path": str(path)}


def measure_disk(ctx: Context, row: dict, n_tokens: int) -> dict:
    """The same model with its experts on disk and a cache of a quarter of them (the minimum if larger)."""
    from cflow.runtime import Engine, EngineError

    path = row["path"]
    toks = np.random.default_rng(row["E"] + row["k"]).integers(0, 512, n_tokens)
    with Engine.load(path, threads=ctx.threads, n_ctx=n_tokens + 8, verify=False, experts="disk") as probe:
        info = probe.expert_cache
        spans = dict(probe.file.experts)
    full = info["slot_bytes"] * len(spans)
    budget = max(info["min_slots"] * info["slot_bytes"], full // 4)
    try:
        eng = Engine.load(path, threads=ctx.threads, n_ctx=n_tokens + 8, verify=False, experts="disk",
                          expert_cache=budget, expert_io="sync")
    except EngineError:
        budget = full
        eng = Engine.load(path, threads=ctx.threads, n_ctx=n_tokens + 8, verify=False, experts="disk",
                          expert_cache=budget, expert_io="sync")
    with eng:
        eng.reset()
        eng.reset_counters()
        for pos, t in enumerate(toks):
            eng.step(int(t), pos)
        c = eng.counters()
        read = eng.expert_cache.get("read")
    span = float(np.mean([n for _, n in spans.values()]))
    aligned = float(np.mean([-(-n // 4096) * 4096 for _, n in spans.values()]))  # what an O_DIRECT read covers
    misses = c["cache_misses"]
    return {"E": row["E"], "k": row["k"], "budget": budget, "full_cache": full, "read": read,
            "disk_bytes_per_token": c["disk_bytes"] / c["tokens"], "cache_hits": c["cache_hits"],
            "cache_misses": misses, "expert_span_bytes": span, "expert_span_aligned": aligned,
            "disk_over_misses_x_span": c["disk_bytes"] / (misses * span) if misses else None,
            "disk_over_misses_x_aligned": c["disk_bytes"] / (misses * aligned) if misses else None,
            "disk_over_all_experts": (c["disk_bytes"] / c["tokens"]) / row["all_experts_bytes"]}


def _r(v: float | None) -> str:
    return "–" if v is None else f"{v:.4f}"


def run(ctx: Context) -> ClaimResult:
    res = ClaimResult(ID, TITLE, paper=PAPER, paper_number=PAPER_NUMBER)
    combos = [(8, 2), (64, 4)] if ctx.quick else [(4, 1), (8, 1), (8, 2), (16, 2), (32, 4), (64, 1), (64, 4), (64, 8)]
    n_tokens = 16 if ctx.quick else 64
    rows = []
    for E, k in combos:
        r = measure_ram(ctx, E, k, n_tokens)
        rows.append(r)
        ctx.log(ID, f"E={E} k={k}: {r['expert_bytes_per_token']:.0f} B/token measured, analytic "
                    f"{r['analytic_topk_bytes']:.0f}, all experts {r['all_experts_bytes']}")
    res.data["ram"] = [{k: v for k, v in r.items() if k != "path"} for r in rows]
    res.tables.append(Table(
        f"Expert weight bytes per decode token (random arch2_4_combined models, q4_0, {rows[0]['layers']} layers, "
        f"d_model {rows[0]['d_model']}, {n_tokens} decode steps; measured = the engine's counters)",
        ["E", "top-k", "measured bytes/token", "analytic top-k bytes", "measured / analytic",
         "all experts bytes/token", "all / measured", "E / k", "distinct experts used per layer"],
        [[r["E"], r["k"], f"{r['expert_bytes_per_token']:,.0f}", f"{r['analytic_topk_bytes']:,.0f}",
          f"{r['measured_over_analytic']:.4f}", f"{r['all_experts_bytes']:,}", f"{r['all_over_measured']:.2f}x",
          f"{r['expected_reduction']:.2f}x", "/".join(map(str, r["distinct_experts_per_layer"]))] for r in rows]))
    exact = all(abs(r["measured_over_analytic"] - 1) < 1e-9 for r in rows)
    reductions = all(abs(r["all_over_measured"] - r["expected_reduction"]) < 1e-6 for r in rows)
    best = max(rows, key=lambda r: r["all_over_measured"])
    res.commands = [ctx.rerun(ID)]
    # disk
    ok, why = disk_mode_available()
    res.data["disk_mode"] = {"available": ok, "why": why}
    disk_rows = []
    if ok:
        try:
            for r in rows if not ctx.quick else rows[-1:]:
                disk_rows.append(measure_disk(ctx, r, n_tokens))
        except (EngineError, KeyError, TypeError, ValueError, OSError) as e:
            ok, why = False, f"the disk mode is present but failed here: {type(e).__name__}: {e}"
            res.data["disk_error"] = why
    if ok:
        for d in disk_rows:
            ctx.log(ID, f"disk E={d['E']} k={d['k']}: {d['disk_bytes_per_token']:.0f} B/token from disk, "
                        f"{d['cache_misses']} misses, ratio {d['disk_over_misses_x_span']}")
        res.data["disk"] = disk_rows
        res.tables.append(Table(
            "Experts on disk (Engine.load(experts='disk', expert_cache=budget, expert_io='sync')): bytes read from "
            "the file against the cache's misses x the expert's span in the file (O_DIRECT reads whole 4096-byte "
            "pages, so a span is read rounded up to 4096)",
            ["E", "top-k", "cache budget", "read", "disk bytes/token", "hits", "misses", "span bytes (aligned)",
             "disk / (misses x aligned span)", "disk / (misses x span)", "disk / all experts per token"],
            [[d["E"], d["k"], fmt_bytes(d["budget"]), d["read"], f"{d['disk_bytes_per_token']:,.0f}", d["cache_hits"],
              d["cache_misses"], f"{d['expert_span_bytes']:,.0f} ({d['expert_span_aligned']:,.0f})",
              _r(d["disk_over_misses_x_aligned"]), _r(d["disk_over_misses_x_span"]),
              f"{d['disk_over_all_experts']:.3f}"] for d in disk_rows]))
        disk_exact = all(d["disk_over_misses_x_aligned"] is not None and abs(d["disk_over_misses_x_aligned"] - 1) < 1e-9
                         for d in disk_rows)
        res.parts.append({"name": "bytes from disk", "verdict": CONFIRMED if disk_exact else INCONCLUSIVE,
                          "reason": "every byte read from the file is a page of an expert the cache missed: disk / "
                                    "(misses x 4096-aligned span) = " + ", ".join(
                                        _r(d["disk_over_misses_x_aligned"]) for d in disk_rows)
                                    + " (these test experts are ~10 kB, so page rounding shows; on real experts of "
                                      "MBs it is below 0.1%)"})
        res.commands.append("cflow bench -m MODEL.cflow --experts disk --expert-cache SIZE --expert-io sync --json")
    else:
        res.pending = f"bytes read from disk with experts on disk: {why}"
        res.parts.append({"name": "bytes from disk", "verdict": INCONCLUSIVE, "reason": why})
    lo, hi = min(r["measured_over_analytic"] for r in rows), max(r["measured_over_analytic"] for r in rows)
    res.ours_number = (f"{best['all_over_measured']:.2f}x at E={best['E']}, k={best['k']}; measured / analytic = "
                       f"{lo:.4f}–{hi:.4f}")
    res.ours = (f"the engine's counters show exactly the analytic top-k expert bytes per token at every (E, k) "
                f"measured (ratio {min(r['measured_over_analytic'] for r in rows):.4f}–"
                f"{max(r['measured_over_analytic'] for r in rows):.4f}), i.e. E/k fewer than reading every expert: "
                f"{best['all_over_measured']:.0f}x at E={best['E']}, k={best['k']}.")
    if exact and reductions:
        res.verdict, res.reason = CONFIRMED, (
            "counted, not computed: the C engine's byte counters over real decode steps equal the top-k bytes of "
            "cflow.weights exactly, and routing spreads over many experts (so this is not one expert re-read). The "
            "'up to 16x' is E/k: 64 experts, top-4 gives 16x here as in the paper. Counters on a random model "
            "measure the mechanism; the speed it buys is C4/C5's subject.")
    else:
        res.verdict, res.reason = REFUTED, "the counters differ from the analytic top-k bytes (see table)"
    res.notes.append("Scaling: the ratio is E/k whatever the model size, because each expert of a layer has the "
                     "same bytes; the paper's large MoE (30.9B parameters) is not needed to check it. What changes "
                     "with size is whether the bytes come from RAM or disk, which is C5.")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(8, 4))
        labels = [f"E={r['E']}\nk={r['k']}" for r in rows]
        x = np.arange(len(rows))
        ax.bar(x - 0.2, [r["all_experts_bytes"] / 1e3 for r in rows], 0.4, label="all experts (standard loading)",
               color="0.6")
        ax.bar(x + 0.2, [r["expert_bytes_per_token"] / 1e3 for r in rows], 0.4, label="measured (engine counters)",
               color="#1f77b4")
        ax.plot(x + 0.2, [r["analytic_topk_bytes"] / 1e3 for r in rows], "k_", markersize=18, label="analytic top-k")
        ax.set_yscale("log")
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel("expert kB per token")
        ax.set_title("Expert bytes per token: top-k vs every expert")
        ax.legend(fontsize=8)
        save(fig, ctx.out / "c3_expert_bytes.png")
        res.plots.append(("c3_expert_bytes.png", "Expert bytes per decode token, all experts vs the top-k the "
                                                 "engine counted (log scale)."))
    return res
