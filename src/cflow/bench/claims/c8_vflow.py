"""C8: does the `.vflow` data order (execution stage across layers) help a cold start? Inconclusive in
the paper; reported here whatever it shows.

The same pipeline-native model (arch2_4_combined, random weights) is written in both orders; each
run evicts the file from the page cache, then a fresh process loads it (checksums already verified,
so loading reads nothing) and decodes: the first token faults every weight page in, in the order
the engine touches them. `.cflow` and `.vflow` alternate. The engine reads `.vflow` exactly like
`.cflow` today (mmap, layer plan); reading it in file order with experts on disk is issue #10 §4.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from cflow.bench.claims.core import (CONFIRMED, INCONCLUSIVE, REFUTED, ClaimResult, Context, Table, fmt_bytes, mean,
                                     pm, pyplot, quick_verdict, save, sd)
from cflow.bench.claims.models import load_benchmark, make_moe_command, moe_geometry, random_params, write_random_model
from cflow.config import ModelConfig

ID, TITLE = "C8", "Cold-cache .cflow vs .vflow"
PAPER = ("the .vflow stage-major layout's theoretical readahead benefit was inconclusive at the scales tested: it "
         "needs asynchronous I/O overlap that was not fully implemented for non-expert weights, and the variance seen "
         "was attributed to SSD cache states")
PAPER_NUMBER = "inconclusive"
FULL_GEOMETRY: dict | None = None  # or exact make_moe Geometry fields
FULL_SIZE = 1.0e9
DROP_CACHES = "/proc/sys/vm/drop_caches"

_CHILD = r"""
import json, sys, time
args = json.load(sys.stdin)
t0 = time.perf_counter()
from cflow.runtime import Engine
t_import = time.perf_counter() - t0
t1 = time.perf_counter()
eng = Engine.load(args["path"], threads=args["threads"], n_ctx=64, verify=False)
load_s = time.perf_counter() - t1
t2 = time.perf_counter()
logits = eng.prefill(list(range(3, 11)))
tok = int(logits.argmax())
first_s = time.perf_counter() - t2
t3 = time.perf_counter()
for i in range(args["n"]):
    tok = int(eng.step(tok, 8 + i).argmax())
next_s = time.perf_counter() - t3
print(json.dumps({"import_s": t_import, "load_s": load_s, "first_token_s": first_s, "next_tokens_s": next_s}))
"""


def make_models(ctx: Context) -> tuple[dict, str, list[str]]:
    if ctx.quick:
        cfg = ModelConfig.from_name("arch2_4_combined", vocab_size=2048, d_model=256, n_layers=4, n_heads=4,
                                    n_kv_heads=2, d_ff=512, n_experts=8, top_k=2, d_expert=512, max_seq_len=128,
                                    tie_embeddings=True)
        params = random_params(cfg, seed=8)
        paths = {o: write_random_model(ctx.work / f"c8.{o}", cfg, "q4_0", params=params) for o in ("cflow", "vflow")}
        return paths, "random arch2_4_combined, 4 layers, d 256, 8 experts top-2 (quick)", []
    mm = load_benchmark("make_moe")
    if mm is None:
        raise FileNotFoundError("benchmarks/make_moe.py is not beside this package (a source checkout has it)")
    g = moe_geometry(mm, FULL_SIZE, FULL_GEOMETRY, min_layers=4)
    paths = {}
    for o in ("cflow", "vflow"):
        paths[o] = ctx.work / f"c8.{o}"
        mm.write_cflow(paths[o], g, "q4_0", seed=8, progress=False)
    return paths, (f"random pipeline-native MoE from make_moe.py ({g.layers} layers, d {g.d_model}, {g.experts} "
                   f"experts top-{g.top_k})"), [make_moe_command(g, f"c8.{o}") for o in ("cflow", "vflow")]


def make_cold(path, full: bool) -> str:
    """Evict the file (and, on a full run as root, the whole page cache). Says how."""
    from cflow.bench import disk

    how = "posix_fadvise(DONTNEED) on the model file"
    if full and os.access(DROP_CACHES, os.W_OK):
        os.sync()
        try:
            with open(DROP_CACHES, "w") as f:
                f.write("3\n")
            how = "sync; echo 3 > /proc/sys/vm/drop_caches"
        except OSError:
            pass
    disk.evict(path)
    return how


def run_child(path, threads: int, n: int) -> dict:
    args = json.dumps({"path": str(path), "threads": threads, "n": n})
    r = subprocess.run([sys.executable, "-c", _CHILD], input=args, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"cold-start child failed: {r.stderr.strip()[-400:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(ctx: Context) -> ClaimResult:
    from cflow.bench import disk
    from cflow.runtime import Engine

    res = ClaimResult(ID, TITLE, paper=PAPER, paper_number=PAPER_NUMBER)
    paths, what, made = make_models(ctx)
    res.commands = [ctx.rerun(ID), *made, "cflow convert MODEL model.vflow --format vflow   # any model, either order",
                    "sync; echo 3 > /proc/sys/vm/drop_caches   # as root, before each run",
                    "cflow generate -m model.vflow -p 'Once upon a time' -n 8 --no-verify"]
    for p in paths.values():  # verify once, warm: later loads skip it, so a cold load reads only what it uses
        Engine.load(p, threads=1, n_ctx=16).close()
    reps, n = (2, 4) if ctx.quick else (5, 16)
    size = os.path.getsize(paths["cflow"])
    fs = disk.filesystem_type(paths["cflow"])
    runs: dict[str, list[dict]] = {o: [] for o in paths}
    how = ""
    for rep in range(reps):
        for o, p in (list(paths.items()) if rep % 2 == 0 else list(reversed(paths.items()))):
            how = make_cold(p, full=not ctx.quick)
            resident = disk.resident_fraction(p)
            r = run_child(p, ctx.threads, n)
            r["resident_before"] = resident
            r["total_s"] = r["load_s"] + r["first_token_s"]
            runs[o].append(r)
            ctx.log(ID, f".{o} rep {rep + 1}/{reps}: load {r['load_s'] * 1e3:.1f} ms, first token "
                        f"{r['first_token_s'] * 1e3:.1f} ms (resident before: "
                        f"{'?' if resident is None else f'{100 * resident:.1f}%'})")
    res.data.update({"model": what, "file_bytes": size, "filesystem": fs, "cold": how, "reps": reps, "runs": runs})
    rows = []
    for o, rs in runs.items():
        rows.append([f".{o}", pm([r["load_s"] * 1e3 for r in rs], ".1f"),
                     pm([r["first_token_s"] * 1e3 for r in rs], ".1f"),
                     pm([r["total_s"] * 1e3 for r in rs], ".1f"),
                     pm([r["next_tokens_s"] * 1e3 / n for r in rs], ".2f"),
                     f"{100 * max((r['resident_before'] or 0) for r in rs):.1f}%"])
    res.tables.append(Table(
        f"Cold start ({what}; {fmt_bytes(size)} on {fs}; {how} before each run; {reps} alternating runs per order, "
        f"{ctx.threads} thread(s))",
        ["order", "load ms", "first token ms (8-token prompt)", "load + first token ms", "next tokens ms/token",
         "file resident before (max)"], rows))
    tc, tv = [r["total_s"] for r in runs["cflow"]], [r["total_s"] for r in runs["vflow"]]
    gain = mean(tc) / mean(tv) - 1
    noise = max(0.05, 2 * (sd(tc) + sd(tv)) / mean(tc) / max(len(tc), 1) ** 0.5)
    faster = f"{abs(100 * gain):.1f}% {'faster' if gain >= 0 else 'slower'}"
    res.ours_number = f".vflow {faster} to load + first token (noise ±{100 * noise:.0f}%)"
    res.ours = (f"load + first token from a cold page cache: .cflow {pm([t * 1e3 for t in tc], '.1f')} ms, .vflow "
                f"{pm([t * 1e3 for t in tv], '.1f')} ms (.vflow {faster}).")
    if gain > noise:
        v, why = CONFIRMED, f".vflow starts {100 * gain:.1f}% faster, beyond the noise (±{100 * noise:.0f}%)"
    elif gain < -noise:
        v, why = REFUTED, f".vflow starts {-100 * gain:.1f}% slower, beyond the noise (±{100 * noise:.0f}%)"
    else:
        v, why = INCONCLUSIVE, (f"the difference ({100 * gain:+.1f}%) is within the noise (±{100 * noise:.0f}%), "
                                "as in the paper")
    res.verdict, res.reason = quick_verdict(ctx, v, why, f"a {fmt_bytes(size)} model, {reps} runs per order, file "
                                                         "eviction only")
    res.reason += (". Today the engine touches a .vflow's pages in the same order as a .cflow's (mmap, one op at a "
                   "time), so only the kernel's readahead over the file order can differ; reading .vflow as one "
                   "forward sweep with experts on disk is issue #10 §4.")
    res.pending = ("a runtime that reads .vflow in its file order (one forward sweep per step, experts on disk): "
                   "issue #10 §4")
    res.measured = "partial"
    res.notes.append("Cold means what the guest kernel can drop: in a VM the host may still cache the image's blocks, "
                     "so a 'cold' read can come back at memory speed. The resident column is mincore's view before "
                     "each run (0% = nothing of the file in this machine's page cache).")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, (o, rs) in enumerate(runs.items()):
            ys = [r["total_s"] * 1e3 for r in rs]
            ax.scatter([i] * len(ys), ys, alpha=0.7)
            ax.errorbar([i + 0.1], [mean(ys)], yerr=[sd(ys)], fmt="k_", capsize=4)
        ax.set_xticks(range(len(runs)))
        ax.set_xlim(-0.6, len(runs) - 0.4)
        ax.set_xticklabels([f".{o}" for o in runs])
        ax.set_ylabel("load + first token (ms), cold page cache")
        ax.set_title("Cold start: .cflow vs .vflow" + (" (quick run)" if ctx.quick else ""))
        ax.grid(alpha=0.3)
        save(fig, ctx.out / "c8_cold_start.png")
        res.plots.append(("c8_cold_start.png", "Load + first token from a cold page cache, each run a dot."))
    return res
