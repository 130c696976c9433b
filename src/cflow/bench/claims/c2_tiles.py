"""C2: the tile layout cuts L1-d read misses ~7.3x against a row-major layout.

The paper measured hardware counters on a Xeon E5-2650. Here `perf` is tried first; where the
machine exposes no hardware cache events (this VM: `perf stat -e L1-dcache-load-misses` says
<not supported>), `valgrind --tool=cachegrind` simulates the L1 of this CPU and of the paper's
Xeon on `c2_tiles.c` (beside this module): one Q4_0 matrix stored twice (cflow's tiles, GGML's row-major
blocks), multiplied by one activation with the same arithmetic in both layouts, the outputs
checked against cflow.quant's reference and against each other (bit for bit). Two arithmetics
are measured because the result hinges on them: cflow's int8 activations (K bytes + scales) and
float activations (4K bytes), which a row-major kernel re-reads for every row. The verdict rests on
the int8 arithmetic, the one the engine runs (RULE_MISSES_INT8), and on the time of that mat-vec
tiled vs row-major from the same weights (RULE_TIME_INT8); the float figure is context.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np

from cflow import quant
from cflow.bench.claims.core import (INCONCLUSIVE, ClaimResult, Context, Rule, Table, pyplot, quick_verdict, save,
                                     shell)

ID, TITLE = "C2", "L1-d read misses: tile layout vs row-major"
PAPER = ("the tile-streaming layout (128x256 Q4 tiles, ~18 KB, in consumption order) cuts L1-d read misses "
         "7.29x against a row-major baseline on a Xeon E5-2650, measured with hardware performance counters")
PAPER_NUMBER = "7.29x fewer L1-d read misses"
PAPER_RATIO = 7.29
MAGIC = 0x31543243
TILE = quant.TILE
ARITHS = ("q8", "f32")
LAYOUTS = ("tiled", "rows")
# (size, ways, line) of each level cachegrind simulates
XEON_E5_2650 = {"I1": (32768, 8, 64), "D1": (32768, 8, 64), "LL": (20 * 1024 * 1024, 20, 64)}
XEON_NAME = "Xeon E5-2650 (the paper's)"

SHAPES_QUICK = [(256, 8192), (256, 14336)]
SHAPES_FULL = [(512, 2048), (512, 5632), (512, 8192), (512, 14336)]
# The judged matrix: 14336 inputs, the down projection of a 7-8B dense model (Mistral-7B, Llama-3-8B),
# the widest row measured, where a row-major sweep of the activation is most likely to overflow L1d
# (so the claim gets its best case, chosen before the run, not picked from the results).
JUDGED_K = 14336
TIME_REPS = 31

# The verdict rules, on cflow's int8 activations (the arithmetic the engine runs). Misses: the paper
# says 7.29x; confirmed within 35% of it (>= 4.74x, the paper's magnitude), refuted under 2x (a quarter of
# it: not the claimed effect). Cachegrind is exact, so one run, no repetitions.
RULE_MISSES_INT8 = Rule(
    "L1-d read misses, int8 activations",
    f"row-major / tiled L1-d read misses (cachegrind D1mr of the mat-vec function alone, one run: the simulation "
    f"is deterministic) with cflow's int8 activations, at the matrix of R rows x {JUDGED_K} inputs (R = "
    f"{SHAPES_FULL[-1][0]} full, {SHAPES_QUICK[-1][0]} quick), the paper's Xeon E5-2650 L1d simulated (32 KiB, "
    f"8-way, 64 B lines)",
    confirm=PAPER_RATIO * 0.65, refute=2.0)
# Time: the same int8 mat-vec, both layouts from the same weights, natively. Rounds rotate the order in one
# process; the row-major copy against a second row-major copy came out 0.996-1.012 in six trials here
# (measured before fixing these), so a gain under 5% is none beyond noise (refuted) and 10% confirms.
RULE_TIME_INT8 = Rule(
    "mat-vec time, int8 activations",
    f"row-major / tiled ns per mat-vec (c2_tiles.c time mode, the same scalar int8 arithmetic in both layouts, "
    f"same weights, outputs bit-identical) at the judged matrix (R x {JUDGED_K}), median over {TIME_REPS} rounds "
    f"of the per-round ratio, one thread",
    confirm=1.10, refute=1.05)


class C2Unavailable(RuntimeError):
    pass


def host_caches() -> dict[str, tuple[int, int, int]] | None:
    """This CPU's L1i, L1d and last level as (size, ways, line), from sysfs."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    found: dict[str, tuple[int, int, int]] = {}
    try:
        for idx in sorted(base.glob("index*")):
            level = int((idx / "level").read_text())
            kind = (idx / "type").read_text().strip()
            size = (idx / "size").read_text().strip()
            n = int(size[:-1]) * {"K": 1024, "M": 1 << 20}[size[-1]] if size[-1] in "KM" else int(size)
            ways = int((idx / "ways_of_associativity").read_text())
            line = int((idx / "coherency_line_size").read_text())
            key = {(1, "Data"): "D1", (1, "Instruction"): "I1"}.get((level, kind))
            if key:
                found[key] = (n, ways, line)
            elif kind == "Unified" and level >= found.get("_lvl", (0,))[0]:
                found["LL"] = (n, ways, line)
                found["_lvl"] = (level, 0, 0)
    except (OSError, ValueError, KeyError):
        return None
    found.pop("_lvl", None)
    return found if {"D1", "I1", "LL"} <= set(found) else None


def _valid(c: tuple[int, int, int]) -> bool:
    size, ways, line = c
    sets = size // (ways * line) if ways and line else 0
    return sets > 0 and sets * ways * line == size and sets & (sets - 1) == 0


def cache_flags(caches: dict[str, tuple[int, int, int]] | None) -> list[str]:
    if not caches or not all(_valid(caches[k]) for k in ("I1", "D1", "LL")):
        return []  # cachegrind's own choice
    return [f"--{k}={','.join(map(str, caches[k]))}" for k in ("I1", "D1", "LL")]


def perf_hw_events() -> tuple[bool, str]:
    """Whether `perf stat` can count L1-d load misses here, and what it said."""
    exe = shutil.which("perf")
    if not exe:
        return False, "perf is not installed"
    try:
        r = subprocess.run([exe, "stat", "-x,", "-e", "L1-dcache-load-misses", "true"], capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"perf failed: {e}"
    text = (r.stderr or "") + (r.stdout or "")
    if "not supported" in text or "not counted" in text:
        return False, ("`perf stat -e L1-dcache-load-misses` reports <not supported>: this machine exposes no hardware "
                       "cache events (a VM without a virtual PMU)")
    if r.returncode != 0:
        return False, f"`perf stat -e L1-dcache-load-misses` failed: {text.strip()[-200:]}"
    return True, "hardware cache events available"


def compile_driver(work: Path) -> tuple[Path, list[str]]:
    src = Path(__file__).with_name("c2_tiles.c")  # shipped beside this module
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise C2Unavailable("no C compiler (cc) to build c2_tiles.c")
    exe = work / "c2_tiles"
    argv = [cc, "-O2", "-std=c11", "-o", str(exe), str(src), "-lm"]
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise C2Unavailable(f"compiling c2_tiles.c failed: {r.stderr.strip()[-400:]}")
    return exe, ["cc", "-O2", "-std=c11", "-o", "c2_tiles", "c2_tiles.c", "-lm"]


def write_input(path: Path, rows: int, cols: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols), dtype=np.float32) / np.float32(np.sqrt(cols))
    blocks = quant.quantize(w, "q4_0")
    tiled = quant.tile_matrix(blocks, "q4_0", rows, cols, TILE)
    x = rng.standard_normal(cols, dtype=np.float32)
    with open(path, "wb") as f:
        f.write(struct.pack("<6IQ", MAGIC, rows, cols, TILE[0], TILE[1], 0, blocks.size))
        f.write(tiled.tobytes())
        f.write(blocks.tobytes())
        f.write(x.tobytes())
    return {"blocks": blocks, "tiled": tiled, "x": x}


def check_outputs(ys: dict[tuple[str, str], np.ndarray], inp: dict, rows: int, cols: int) -> dict:
    """The driver computes what cflow.quant says it should, and both layouts agree bit for bit."""
    ref = {"q8": quant.matvec_q8_ref(inp["tiled"], "q4_0", rows, cols, inp["x"], TILE),
           "f32": quant.dequantize(inp["blocks"], "q4_0", cols).astype(np.float64) @ inp["x"].astype(np.float64)}
    out = {}
    for arith in ARITHS:
        a, b = ys[("tiled", arith)], ys[("rows", arith)]
        err = float(np.abs(a - ref[arith]).max() / max(np.abs(ref[arith]).max(), 1e-30))
        out[arith] = {"rel_err_vs_reference": err, "layouts_bit_identical": bool(np.array_equal(a, b))}
        if err > 1e-4 or not out[arith]["layouts_bit_identical"]:
            raise RuntimeError(f"c2_tiles {arith}: outputs wrong (rel err {err:.2e}, identical "
                               f"{out[arith]['layouts_bit_identical']})")
    return out


def parse_cachegrind(path: Path, fn: str) -> dict[str, int]:
    """The per-function totals of `fn` in a cachegrind output file."""
    events: list[str] = []
    tot: dict[str, int] | None = None
    current = None
    for line in path.read_text().splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
            tot = dict.fromkeys(events, 0)
        elif line.startswith("fn="):
            current = line[3:]
        elif line.startswith(("fl=", "summary:", "totals:")):
            current = None
        elif current == fn and line and line[0].isdigit() and tot is not None:
            nums = [int(v) for v in line.split()[1:]]
            for k, v in zip(events, nums):
                tot[k] += v
    if not tot or not any(tot.values()):
        raise RuntimeError(f"no counts for {fn} in {path.name}")
    return tot


def run_cachegrind(exe: Path, inp: Path, layout: str, arith: str, flags: list[str],
                   work: Path) -> tuple[dict, list[str]]:
    vg = shutil.which("valgrind")
    cg = work / f"cg.{layout}.{arith}.out"
    y = work / f"y.{layout}.{arith}"
    argv = [vg, "--tool=cachegrind", "--cache-sim=yes", *flags, f"--cachegrind-out-file={cg}", str(exe), str(inp),
            layout, arith, "1", str(y)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"cachegrind failed: {r.stderr.strip()[-400:]}")
    counts = parse_cachegrind(cg, f"mv_{arith}_{layout}")
    counts["_y"] = np.fromfile(y, np.float32)
    shown = ["valgrind", "--tool=cachegrind", "--cache-sim=yes", *flags, "./c2_tiles", inp.name, layout, arith, "1",
             "y.out"]
    return counts, shown


def run_perf(exe: Path, inp: Path, layout: str, arith: str, reps: int, work: Path) -> dict:
    """L1-d load misses per mat-vec from hardware counters: (reps runs - 0 runs) / reps."""
    def count(n: int) -> float:
        r = subprocess.run(["perf", "stat", "-x,", "-e", "L1-dcache-load-misses,L1-dcache-loads", str(exe), str(inp),
                            layout, arith, str(n), os.devnull], capture_output=True, text=True, timeout=600)
        vals = {}
        for line in r.stderr.splitlines():
            parts = line.split(",")
            if len(parts) > 2 and parts[0].strip().isdigit():
                vals[parts[2]] = float(parts[0])
        return vals.get("L1-dcache-load-misses", float("nan"))

    return {"l1d_load_misses_per_matvec": (count(reps) - count(0)) / reps}


def run_time(exe: Path, inp: Path, arith: str, reps: int, work: Path) -> dict:
    """ns per mat-vec of the three copies (tiled, row-major, a second row-major copy) over `reps`
    rounds in one process (c2_tiles.c time mode)."""
    out = work / f"time.{inp.stem}.{arith}.txt"
    r = subprocess.run([str(exe), str(inp), "time", arith, str(reps), str(out)], capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"c2_tiles time mode failed: {r.stderr.strip()[-400:]}")
    a = np.loadtxt(out, ndmin=2)
    return {"ns_tiled": a[:, 0].tolist(), "ns_rows": a[:, 1].tolist(), "ns_rows2": a[:, 2].tolist(),
            "rows_over_tiled": float(np.median(a[:, 1] / a[:, 0])),
            "rows_over_rows2": float(np.median(a[:, 1] / a[:, 2]))}


def run(ctx: Context) -> ClaimResult:
    res = ClaimResult(ID, TITLE, paper=PAPER, paper_number=PAPER_NUMBER, commands=[ctx.rerun(ID)])
    vg = shutil.which("valgrind")
    hw, hw_msg = perf_hw_events()
    res.data["perf"] = {"hardware_events": hw, "message": hw_msg}
    res.notes.append(f"Hardware counters: {hw_msg}." + ("" if hw else " So the misses below come from cachegrind's "
                     "simulation of the caches named in each row, which counts every load of the kernel exactly "
                     "(deterministic: one run is enough)."))
    if not vg and not hw:
        res.verdict, res.measured = INCONCLUSIVE, "failed"
        res.reason = "neither valgrind (`apt-get install valgrind`) nor hardware cache counters are available here"
        res.ours = "not measurable on this machine"
        return res
    try:
        exe, cc_cmd = compile_driver(ctx.work)
    except C2Unavailable as e:
        res.verdict, res.reason, res.measured, res.ours = INCONCLUSIVE, str(e), "failed", "not measured"
        return res
    shapes = SHAPES_QUICK if ctx.quick else SHAPES_FULL
    judged = shapes[-1]
    assert judged[1] == JUDGED_K
    host = host_caches()
    machines = [("this CPU", host), (XEON_NAME, XEON_E5_2650)]
    control_misses = None
    rows_t, results = [], []
    commands = res.commands + [shell(cc_cmd)]
    for R, K in shapes:
        inp = ctx.work / f"c2_{R}x{K}.bin"
        data = write_input(inp, R, K)
        for mname, caches in (machines if vg else []):
            flags = cache_flags(caches)
            counts = {}
            for layout in LAYOUTS:
                for arith in ARITHS:
                    counts[(layout, arith)], shown = run_cachegrind(exe, inp, layout, arith, flags, ctx.work)
                    if (R, K) == judged and mname == XEON_NAME and arith == "q8":
                        commands.append(shell(shown))
            if (R, K) == judged and mname == XEON_NAME:
                # the control: row-major on both sides, each side its own cachegrind run
                again, _ = run_cachegrind(exe, inp, "rows", "q8", flags, ctx.work)
                y_again = again.pop("_y")
                control_misses = {"rows": counts[("rows", "q8")]["D1mr"], "rows_again": again["D1mr"],
                                  "identical_outputs": bool(np.array_equal(y_again, counts[("rows", "q8")]["_y"]))}
            check = check_outputs({k: v.pop("_y") for k, v in counts.items()}, data, R, K)
            d1 = caches["D1"] if caches else None
            for arith in ARITHS:
                t, r_ = counts[("tiled", arith)], counts[("rows", arith)]
                ratio = r_["D1mr"] / max(t["D1mr"], 1)
                act = K * 4 if arith == "f32" else K + K // 32 * 4
                entry = {"rows": R, "cols": K, "caches": mname, "D1": d1, "arith": arith, "activation_bytes": act,
                         "tiled": {k: v for k, v in t.items()}, "rows_major": {k: v for k, v in r_.items()},
                         "ratio_rows_over_tiled": ratio, "check": check[arith],
                         "weight_lines": R * (K // 32) * 18 // 64}
                results.append(entry)
                rows_t.append([f"{R}x{K}", mname + (f" (L1d {d1[0] // 1024} KiB, {d1[1]}-way)" if d1 else ""),
                               "int8 (cflow)" if arith == "q8" else "f32", f"{act / 1024:.1f} KiB",
                               f"{t['D1mr']:,}", f"{r_['D1mr']:,}", f"**{ratio:.2f}x**",
                               f"{r_['Ir'] / t['Ir']:.2f}", f"{entry['weight_lines']:,}"])
                ctx.log(ID, f"{R}x{K} {mname} {arith}: D1 read misses tiled {t['D1mr']:,} rows {r_['D1mr']:,} "
                            f"-> {ratio:.2f}x")
    perf_rows = []
    if hw:
        for R, K in shapes:
            inp = ctx.work / f"c2_{R}x{K}.bin"
            for arith in ARITHS:
                pt = run_perf(exe, inp, "tiled", arith, 20, ctx.work)["l1d_load_misses_per_matvec"]
                pr = run_perf(exe, inp, "rows", arith, 20, ctx.work)["l1d_load_misses_per_matvec"]
                perf_rows.append([f"{R}x{K}", arith, f"{pt:,.0f}", f"{pr:,.0f}", f"{pr / pt:.2f}x"])
        res.tables.append(Table("Hardware counters (perf stat, L1-dcache-load-misses per mat-vec)",
                                ["matrix", "activation", "tiled", "row-major", "row-major / tiled"], perf_rows))
    res.data["cachegrind"] = results
    res.data["shapes"] = shapes
    res.commands = commands
    if not results:  # hardware counters only
        res.verdict, res.measured = INCONCLUSIVE, "partial"
        res.reason = "valgrind is not installed: only the hardware-counter table above, without the simulated Xeon L1"
        res.ours = "see the hardware-counter table"
        return res
    res.tables.append(Table(
        "L1-d read misses of one Q4_0 mat-vec (cachegrind D1mr of the kernel function alone; same weights, same "
        "activation, outputs bit-identical between layouts)",
        ["matrix (rows x inputs)", "simulated caches", "activation", "activation size", "tiled misses",
         "row-major misses", "row-major / tiled", "instructions row-major / tiled", "weight cache lines"], rows_t))
    # what the numbers say: the judged point first, then the float context
    jq = next(e for e in results if (e["rows"], e["cols"]) == judged and e["arith"] == "q8" and e["caches"] == XEON_NAME)
    jf = next(e for e in results if (e["rows"], e["cols"]) == judged and e["arith"] == "f32" and e["caches"] == XEON_NAME)
    verdict, why = res.apply(RULE_MISSES_INT8, jq["ratio_rows_over_tiled"])
    res.apply(RULE_MISSES_INT8, control_misses["rows"] / max(control_misses["rows_again"], 1), control=True)
    res.data["control_misses"] = control_misses
    res.parts.append({"name": "L1-d read misses, int8 (the engine's arithmetic)", "verdict": verdict, "reason": why})
    # time of the same mat-vec, natively
    inp = ctx.work / f"c2_{judged[0]}x{judged[1]}.bin"
    timing = {arith: run_time(exe, inp, arith, TIME_REPS, ctx.work) for arith in ARITHS}
    res.data["time"] = timing
    commands.append(shell(["./c2_tiles", inp.name, "time", "q8", str(TIME_REPS), "times.txt"]))
    tq = timing["q8"]
    tv, twhy = res.apply(RULE_TIME_INT8, tq["rows_over_tiled"])
    res.apply(RULE_TIME_INT8, tq["rows_over_rows2"], control=True)  # row-major against a row-major copy
    tv, twhy = quick_verdict(ctx, tv, twhy, f"{TIME_REPS} rounds on a shared machine")
    res.parts.append({"name": "mat-vec time, int8", "verdict": tv, "reason": twhy})
    res.tables.append(Table(
        f"Time of one mat-vec at {judged[0]}x{judged[1]} on this CPU (c2_tiles.c time mode, natively, one thread; "
        f"median over {TIME_REPS} rounds whose order rotates; the second row-major copy is the control)",
        ["activation", "tiled µs", "row-major µs", "row-major copy µs", "row-major / tiled (median of rounds)",
         "row-major / row-major copy"],
        [["int8 (cflow)" if a == "q8" else "f32", f"{np.median(t['ns_tiled']) / 1e3:.1f}",
          f"{np.median(t['ns_rows']) / 1e3:.1f}", f"{np.median(t['ns_rows2']) / 1e3:.1f}",
          f"**{t['rows_over_tiled']:.3f}x**", f"{t['rows_over_rows2']:.3f}x"] for a, t in timing.items()]))
    f32 = [e for e in results if e["arith"] == "f32"]
    q8 = [e for e in results if e["arith"] == "q8"]
    best_f32 = max(f32, key=lambda e: e["ratio_rows_over_tiled"])
    q8_max = max(e["ratio_rows_over_tiled"] for e in q8)
    big = best_f32
    res.ours_number = (f"{jq['ratio_rows_over_tiled']:.2f}x with cflow's int8 activations ({judged[0]}x{judged[1]}, "
                       f"paper's Xeon L1d); tiled mat-vec {tq['rows_over_tiled']:.2f}x faster; float-activation "
                       f"context {jf['ratio_rows_over_tiled']:.2f}x")
    res.ours = (f"cachegrind, the engine's int8 activations, {judged[0]}x{judged[1]} on the paper's Xeon L1d: row-major "
                f"/ tiled L1-d read misses = {jq['ratio_rows_over_tiled']:.2f}x ({q8_max:.2f}x at most over every "
                f"shape and cache measured), since the int8 activation stays in L1 either way and both layouts "
                f"then miss once per weight line. The same mat-vec runs {tq['rows_over_tiled']:.2f}x as long "
                f"row-major as tiled on this CPU. Context: with float activations, which the engine does not use, "
                f"the ratio is {jf['ratio_rows_over_tiled']:.2f}x at that point ({big['ratio_rows_over_tiled']:.2f}x "
                f"at most, {big['rows']}x{big['cols']}, {big['caches']}), where the {big['activation_bytes'] // 1024} "
                f"KiB activation overflows L1d and a row-major kernel re-reads it for every row.")
    res.verdict = verdict
    res.reason = (f"on the engine's own int8 arithmetic the tile layout does not cut L1-d read misses the way the paper "
                  f"says: {why}. The paper's magnitude appears only with float activations "
                  f"({jf['ratio_rows_over_tiled']:.2f}x here), a kernel cflow does not run: it is a property of "
                  f"activation size vs L1, not of the layout alone. Time of the int8 mat-vec, row-major / tiled: "
                  f"{tq['rows_over_tiled']:.3f}x ({tv})." if verdict != "confirmed" else
                  f"on the engine's own int8 arithmetic: {why}. Time of the int8 mat-vec, row-major / tiled: "
                  f"{tq['rows_over_tiled']:.3f}x ({tv}).")
    if ctx.quick:
        res.reason += (" (Quick run: two matrix shapes of 256 rows; cachegrind is exact, so the miss counts stand, "
                       "and the full run adds shapes.)")
    res.notes.append(
        "Why mat-vec time and not decode time: the engine's SIMD kernels read only the tile layout, so a decode "
        "with row-major weights would need a second set of engine kernels. c2_tiles.c times the same mat-vec, "
        "with the engine's int8 arithmetic in scalar C, from the same weights in both layouts (outputs "
        "bit-identical). The two loops differ in more than the order of bytes: the tiled one keeps 8 rows' "
        "partial sums in flight, which gives the CPU independent work, and the row-major loop executes "
        f"{jq['rows_major']['Ir'] / jq['tiled']['Ir']:.2f}x the instructions (cachegrind Ir at the judged point), "
        "so with equal misses the time ratio is mostly that instruction count, not cache behaviour. At these sizes the weights (a few MB) sit in L2/L3, so the time shows L1/L2 behaviour, "
        "not DRAM streaming.")
    res.notes.append(
        "How to read it: both layouts hold exactly the same bytes, so each weight cache line is missed once either "
        "way (the 'weight cache lines' column is that floor). The difference is the activation: the tiled kernel "
        "reads a 256-input slice (1 KiB as f32, 288 B as int8) for 128 rows before moving on, the row-major kernel "
        "sweeps the whole activation once per row. When that sweep is larger than L1d, LRU evicts it before the next "
        "row needs it and every row pays for it again; the ratio then approaches (activation lines + weight lines "
        "per row) / weight lines per row. The paper's 7.29x matches that regime; cflow quantizes activations to "
        "int8 (about 1.1 bytes per input), which keeps them in L1 for any K up to ~40k on this CPU, so its tiles "
        "earn their keep elsewhere (one SIMD load feeds 8 rows, a thread's share is one contiguous run, a tile "
        "stays in L2).")
    res.notes.append("The paper's machine (Xeon E5-2650, 32 KiB 8-way L1d) is simulated too: cachegrind models the "
                     "cache geometry, not the CPU's hardware prefetchers, which hide some misses from timing but not "
                     "from the counters the paper read.")
    if pyplot() is not None:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for arith, marker in (("f32", "o"), ("q8", "s")):
            for mname, ls in (("this CPU", "-"), ("Xeon E5-2650 (the paper's)", "--")):
                pts = sorted((e["cols"], e["ratio_rows_over_tiled"]) for e in results
                             if e["arith"] == arith and e["caches"] == mname)
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, ls, marker=marker,
                            label=f"{'float' if arith == 'f32' else 'int8 (cflow)'} activation, {mname}")
        ax.axhline(PAPER_RATIO, color="k", ls=":", lw=1, label="paper: 7.29x")
        ax.axhline(1.0, color="0.6", lw=0.8)
        ax.set_xlabel("inputs per row (K)")
        ax.set_ylabel("L1-d read misses, row-major / tiled")
        ks = sorted({e["cols"] for e in results})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks)
        ax.set_xticklabels([str(k) for k in ks])
        ax.minorticks_off()
        ax.set_title("Tile layout vs row-major: L1-d read-miss ratio (cachegrind)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        save(fig, ctx.out / "c2_l1_misses.png")
        res.plots.append(("c2_l1_misses.png", "Row-major / tiled L1-d read misses against the row length K: the "
                                              "ratio jumps once a row's activation no longer fits in L1d."))
    return res
