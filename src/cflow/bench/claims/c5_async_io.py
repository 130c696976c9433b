"""C5: asynchronous expert I/O hides disk reads behind compute: up to 1.68x over synchronous.

Needs disk residency: `Engine.load(path, experts="disk", expert_cache=BYTES,
expert_io="async" | "sync")` with the `disk_bytes`, `cache_hits`, `cache_misses`, `io_stall_ns`
counters. A pipeline-native model (arch2_4_combined: experts land two layers later, so their reads
have a window) decodes at several cache budgets, sync and async alternating, with the model file's
pages evicted before each run (experts are read with O_DIRECT; the dense weights are mmapped).
Without that API the section says so (inconclusive, pending) and nothing runs.
"""

from __future__ import annotations

from cflow.bench.claims.core import (CONFIRMED, INCONCLUSIVE, REFUTED, ClaimResult, Context, Table, fmt_bytes, mean,
                                     pm, pyplot, quick_verdict, save, sd)
from cflow.bench.claims.c3_experts import disk_mode_available
from cflow.bench import synthetic
from cflow.bench.claims.models import make_moe_command, moe_geometry, write_random_model
from cflow.config import ModelConfig

ID, TITLE = "C5", "Async vs sync expert I/O"
PAPER = ("with experts on NVMe, the expert delay window lets asynchronous direct I/O overlap expert reads with "
         "the compute of the intermediate layers: up to 1.68x net speed-up over a blocking synchronous read")
PAPER_NUMBER = "up to 1.68x"
PAPER_RATIO = 1.68
# of every expert; 0 = the engine's minimum. I/O and compute take about equal time at 90-95% on this
# kind of machine (docs/results/moe.md), where the overlap's bound (2x) lies
FRACTIONS = (0.0, 0.5, 0.9, 0.95, 1.0)
FULL_GEOMETRY: dict | None = None  # or exact make_moe Geometry fields
FULL_SIZE = 2.0e9  # bytes of the full run's model


def quick_model(ctx: Context):
    cfg = ModelConfig.from_name("arch2_4_combined", vocab_size=1024, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2,
                                d_ff=256, n_experts=16, top_k=2, d_expert=512, max_seq_len=256, tie_embeddings=True)
    return (write_random_model(ctx.work / "c5.cflow", cfg, "q4_0", seed=5),
            "random arch2_4_combined, 16 experts top-2, 4 layers, d 256 (quick)", None)


def full_model(ctx: Context):
    g = moe_geometry(FULL_SIZE, FULL_GEOMETRY, min_layers=4)
    path = ctx.work / "c5.cflow"
    synthetic.write_cflow(path, g, "q4_0", progress=False)
    return path, (f"random pipeline-native MoE (cflow.bench.synthetic) (arch2_4_combined style: {g.layers} layers, d "
                  f"{g.d_model}, {g.experts} experts top-{g.top_k} of d_ff {g.d_ff})"), make_moe_command(g, "c5.cflow")


def run_one(ctx: Context, path, budget: int, io: str, n: int) -> dict:
    from cflow.bench import disk
    from cflow.bench.claims.core import forced_tps
    from cflow.runtime import Engine

    disk.evict(path)  # the dense weights come back from disk too, as on a cold start
    with Engine.load(path, threads=ctx.threads, n_ctx=n + 16, verify=False, experts="disk", expert_cache=budget,
                     expert_io=io) as eng:
        forced_tps(eng, n, seed=1)  # warm-up: the cache fills, the dense pages come in
        eng.reset_counters()
        tps = forced_tps(eng, n, seed=2)  # steady state, random tokens so routing varies
        c = eng.counters()
        info = eng.expert_cache
    looked = c["cache_hits"] + c["cache_misses"]
    return {"io": io, "budget": budget, "tokens_per_s": tps, "disk_bytes_per_token": c["disk_bytes"] / c["tokens"],
            "hit_rate": c["cache_hits"] / looked if looked else None,
            "io_stall_ms_per_token": c.get("io_stall_ns", 0) / 1e6 / c["tokens"], "read": info.get("read"),
            "slots": info.get("slots")}


def run(ctx: Context) -> ClaimResult:
    res = ClaimResult(ID, TITLE, paper=PAPER, paper_number=PAPER_NUMBER)
    res.commands = [ctx.rerun(ID)]
    ok, why = disk_mode_available()
    res.data["disk_mode"] = {"available": ok, "why": why}
    if not ok:
        res.verdict, res.measured = INCONCLUSIVE, "pending"
        res.pending = f"pending: {why}"
        res.reason = ("cannot be measured yet: experts cannot be kept on disk. The experiment is written against "
                      "the API (Engine.load(path, experts='disk', expert_cache=BYTES, "
                      "expert_io='async'|'sync') and the disk_bytes / cache_hits / cache_misses / io_stall_ns "
                      "counters) and runs once it lands.")
        res.ours = "not measured (pending)"
        return res
    from cflow.runtime import Engine, EngineError

    path, what, made = quick_model(ctx) if ctx.quick else full_model(ctx)
    if made:
        res.commands.append(made)
    # the speculation gate needs 32 predictions per distance and the cache's keep ranks some misses to
    # settle: a full run warms up as long as it measures
    n, reps = (32, 1) if ctx.quick else (64, 3)
    with Engine.load(path, threads=ctx.threads, n_ctx=64, verify=False, experts="disk") as probe:
        info = probe.expert_cache
        n_keys = len(probe.file.experts)
        top_k, layers = probe.config.top_k, probe.config.n_layers
        expert_bytes = sum(nb for _, nb in probe.file.experts.values())
    slot = info["slot_bytes"]
    lo, full = info["min_slots"] * slot, n_keys * slot
    budgets = sorted({max(lo, int(f * full) // slot * slot) for f in FRACTIONS})
    ctx.log(ID, f"{what}: experts {fmt_bytes(expert_bytes)}, budgets {[fmt_bytes(b) for b in budgets]}, "
                f"{n} tokens x {reps} reps")
    runs: dict[tuple[int, str], list[dict]] = {}
    for rep in range(reps):
        for b in budgets:
            for io in ("sync", "async"):
                try:
                    r = run_one(ctx, path, b, io, n)
                except (EngineError, KeyError, TypeError, ValueError, OSError) as e:
                    res.verdict, res.measured, res.ours = INCONCLUSIVE, "failed", "not measured"
                    res.reason = (f"the disk mode is present but failed at budget {fmt_bytes(b)}, {io}: "
                                  f"{type(e).__name__}: {e}")
                    res.pending = "a working disk residency"
                    res.data["error"] = res.reason
                    return res
                runs.setdefault((b, io), []).append(r)
                ctx.log(ID, f"budget {fmt_bytes(b)} {io}: {r['tokens_per_s']:.2f} tok/s, "
                            f"{fmt_bytes(r['disk_bytes_per_token'])}/token from disk, stall "
                            f"{r['io_stall_ms_per_token']:.2f} ms/token")
    rows, curve = [], []
    for b in budgets:
        s, a = runs[(b, "sync")], runs[(b, "async")]
        ts, ta = [r["tokens_per_s"] for r in s], [r["tokens_per_s"] for r in a]
        ratio = mean(ta) / mean(ts)
        curve.append({"budget": b, "fraction": b / full, "sync_tps": ts, "async_tps": ta, "async_over_sync": ratio,
                      "disk_bytes_per_token": mean([r["disk_bytes_per_token"] for r in a]),
                      "disk_bytes_per_token_sync": mean([r["disk_bytes_per_token"] for r in s]),
                      "hit_rate": a[-1]["hit_rate"], "stall_sync_ms": mean([r["io_stall_ms_per_token"] for r in s]),
                      "stall_async_ms": mean([r["io_stall_ms_per_token"] for r in a])})
        rows.append([fmt_bytes(b), f"{100 * b / full:.0f}%", pm(ts), pm(ta), f"**{ratio:.2f}x**",
                     fmt_bytes(curve[-1]["disk_bytes_per_token_sync"]), fmt_bytes(curve[-1]["disk_bytes_per_token"]),
                     "–" if curve[-1]["hit_rate"] is None else f"{100 * curve[-1]['hit_rate']:.0f}%",
                     f"{curve[-1]['stall_sync_ms']:.2f}", f"{curve[-1]['stall_async_ms']:.2f}"])
    res.data.update({"model": what, "expert_bytes": expert_bytes, "curve": curve, "tokens": n, "reps": reps,
                     "read": info.get("read"), "top_k": top_k, "layers": layers})
    res.tables.append(Table(
        f"Decode tokens/s with experts on disk ({what}; {ctx.threads} threads; file pages evicted before each run, "
        f"{n} warm-up tokens, then {n} timed tokens (random token ids, so routing varies) x {reps} reps; reads "
        f"{info.get('read')})",
        ["expert cache", "of all experts", "sync t/s", "async t/s", "async / sync", "disk / token sync",
         "disk / token async", "hit rate (async)",
         "stall sync ms/token", "stall async ms/token"], rows))
    res.commands.append("cflow bench -m MODEL.cflow --experts disk --expert-cache SIZE --expert-io sync|async -p 0 "
                        f"-n {n} --json")
    best = max(curve, key=lambda c: c["async_over_sync"])
    res.ours_number = f"{best['async_over_sync']:.2f}x at best (cache {100 * best['fraction']:.0f}% of experts)"
    res.ours = ("async over sync expert I/O: " + ", ".join(f"{c['async_over_sync']:.2f}x at {100 * c['fraction']:.0f}%"
                                                           for c in curve) + " of the experts cached.")
    r = best["async_over_sync"]
    if r >= 0.9 * PAPER_RATIO:
        v, why_v = CONFIRMED, f"async reaches {r:.2f}x over sync (paper: up to 1.68x)"
    elif r < 1.05:
        v, why_v = REFUTED, f"async is no faster than sync at any budget measured (best {r:.2f}x)"
    else:
        v, why_v = INCONCLUSIVE, (f"async helps ({r:.2f}x at best) but less than the paper's 1.68x; the overlap is "
                                  "bounded by 2x where I/O and compute take equal time and by less elsewhere")
    res.verdict, res.reason = quick_verdict(ctx, v, why_v, "a tens-of-MB model whose experts this machine's page-"
                                                           "cache-free reads fetch in microseconds, 1 repetition")
    odd = [c for c in curve if c["disk_bytes_per_token"] > 1.2 * c["disk_bytes_per_token_sync"] > 0]
    if odd:
        res.notes.append("Observation: at " + ", ".join(f"{fmt_bytes(c['budget'])}" for c in odd)
                         + " the async mode reads more bytes from disk per token than the sync mode ("
                         + ", ".join(f"{c['disk_bytes_per_token'] / c['disk_bytes_per_token_sync']:.2f}x" for c in odd)
                         + "): with a cache this small, reads started early evict experts that are needed again.")
    res.notes.append("Bound: overlapping I/O with compute turns I/O + compute into max(I/O, compute) per token, so "
                     "the speed-up is at most 2x, reached where the two are equal; with a big cache (few misses) both "
                     "modes converge, with a tiny one I/O dominates and both sit at the disk's bound.")
    res.notes.append("This machine lacks the paper's NVMe server: its virtual disk (and the host's cache behind it) "
                     "sets the I/O side; what scales is the ratio of expert bytes missed per token to disk bandwidth "
                     "against the compute time per token.")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = [100 * c["fraction"] for c in curve]
        for key, lbl in (("sync_tps", "sync (read, then compute)"), ("async_tps", "async (reads overlap compute)")):
            ax.errorbar(xs, [mean(c[key]) for c in curve], yerr=[sd(c[key]) for c in curve], marker="o", capsize=3,
                        label=lbl)
        ax.set_xlabel("expert cache budget (% of all experts)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title("Experts on disk: sync vs async I/O" + (" (quick run)" if ctx.quick else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, ctx.out / "c5_async_io.png")
        res.plots.append(("c5_async_io.png", "Decode tokens/s against the expert cache budget, sync and async."))
    return res
