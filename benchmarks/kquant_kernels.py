"""Mat-vec speed of every quantized dtype relative to Q4_0, timed interleaved in one process.

On a shared machine absolute GB/s mean little, but kernels timed alternately under the same load
can be compared: for each shape, each round times every dtype once (activation already
quantized, loop in C: `_native.bench_matvec`), and each dtype keeps its best round. Printed per
dtype: effective GB/s (weight bytes / the calling thread's CPU seconds, the steadier measure on
a busy machine at 1 thread) and the ratio to Q4_0 on the same shape, in three settings:
- l2:   a slice of the matrix small enough for L2 (~256 KB): instruction cost per byte alone;
- l3:   the whole matrix, hot in L3;
- dram: round-robin over copies exceeding the L3: what one decode step sees.
A ratio well below 1 in l2 means the kernel needs more instructions per byte than Q4_0; if the
dram ratio is low too, the kernel is compute-bound at that thread count.

With several tables (`--isa avxvnni avx512`) every (table, dtype) is timed in each round: an
in-process A/B of an old and a new kernel under the same load (the avx512 table's K-quant and
Q5_x mat-vecs are kernels_kquant_avx512.c's, avxvnni's the AVX2-family ones it replaced); the
ratio column is then relative to the first table's Q4_0. `--probe` prints cflow's 1-thread memory
read probe first. Prefetch defaults to the kernels' own default mode (-1), as the engine runs.

    python benchmarks/kquant_kernels.py [--dtypes q4_0 q4_k ...] [--threads 1] [--rounds 5]
                                        [--seconds 0.15] [--isa avxvnni avx512] [--prefetch -1] [--probe]
                                        [--shapes 5632x2048] [--settings l2 dram]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from cflow import _native
from cflow import kquant as K
from cflow import quant as Q

# [out x in]: Llama-1B-ish gate/up and down (dimensions multiples of 256), SmolLM2's down and up
SHAPES = [(5632, 2048), (2048, 5632), (576, 1536), (1536, 576)]
DTYPES = ["q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"]
L2_BYTES = 256 << 10
DRAM_BYTES = 96 << 20  # 3x a 32 MiB L3


def dtype_id(dtype: str) -> int:
    return K.KDTYPE_IDS.get(dtype) or Q.DTYPE_IDS[dtype]


def random_tiled(dtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """A tiled matrix of random blocks (finite fp16 scales; the values do not affect speed)."""
    if dtype in Q.QUANT_DTYPES:
        return Q.quantize_tiled(rng.standard_normal((rows, cols), dtype=np.float32), dtype)
    qb, bb = K.block_geometry(dtype)
    b = rng.integers(0, 256, (rows, cols // qb, bb), dtype=np.uint8)
    for o, _ in (v for n, v in K.GGML_FIELDS[dtype].items() if n in ("d", "dmin", "m")):
        v = (rng.standard_normal((rows, cols // qb)) * 0.01).astype(np.float16)
        b[..., o:o + 2] = v[..., None].view(np.uint8).reshape(rows, cols // qb, 2)
    return K.tile_kquant(b.reshape(rows, -1), dtype, rows, cols)


def fits(dtype: str, cols: int) -> bool:
    return cols % K.block_geometry(dtype)[0] == 0 if dtype in K.KDTYPES else cols % Q.QK == 0


def cases(dtype: str, rows: int, cols: int, rng: np.random.Generator):
    """(setting, buffer, copies, rows) for the three settings."""
    one = random_tiled(dtype, rows, cols, rng)
    l2_rows = max(8, min(rows, L2_BYTES // (one.nbytes // rows)) // 8 * 8)
    small = random_tiled(dtype, l2_rows, cols, rng)
    copies = max(2, -(-DRAM_BYTES // one.nbytes))
    return [("l2", small, 1, l2_rows), ("l3", one, 1, rows), ("dram", np.tile(one, copies), copies, rows)]


def time_one(dtype, buf, copies, rows, cols, x, isa, pool, seconds) -> float:
    """The calling thread's CPU seconds per call (wall seconds with a pool), about `seconds` long."""
    args = (buf, copies, dtype_id(dtype), rows, cols, x)
    wall, cpu = _native.bench_matvec(*args, isa=isa, pool=pool, iters=copies)
    iters = max(copies, int(seconds / max(wall, 1e-9)))
    wall, cpu = _native.bench_matvec(*args, isa=isa, pool=pool, iters=iters)
    return cpu if pool is None else wall


def run(dtypes, threads, isas, rounds, seconds, shapes=SHAPES, settings=("l2", "l3", "dram")):
    """Rows of the table; with several ISAs each (isa, dtype) is timed in every round, so an old
    and a new kernel of one dtype are compared under the same load (an in-process A/B)."""
    if isinstance(isas, str):
        isas = [isas]
    rng = np.random.default_rng(0)
    table = []
    for rows, cols in shapes:
        dts = [d for d in dtypes if fits(d, cols)]
        x = rng.standard_normal(cols, dtype=np.float32)
        bufs = {d: cases(d, rows, cols, rng) for d in dts}
        keys = [(isa, d) for d in dts for isa in isas]
        for nth in threads:
            pool = _native.Pool(nth) if nth > 1 else None
            for si, setting in enumerate(("l2", "l3", "dram")):
                if setting not in settings:
                    continue
                best = {k: float("inf") for k in keys}
                for r in range(rounds):  # interleaved: each round times every (isa, dtype) once
                    for isa, d in (keys if r % 2 == 0 else keys[::-1]):
                        _, buf, copies, rws = bufs[d][si]
                        t = time_one(d, buf, copies, rws, cols, x, isa, pool, seconds)
                        best[isa, d] = min(best[isa, d], t)
                gbs = {(isa, d): bufs[d][si][1].nbytes / bufs[d][si][2] / best[isa, d] / 1e9 for isa, d in keys}
                for isa, d in keys:
                    base = gbs.get((isas[0], "q4_0"))
                    table.append(dict(shape=f"{rows}x{cols}", threads=nth, setting=setting, isa=isa, dtype=d,
                                      gbs=gbs[isa, d], ratio=gbs[isa, d] / base if base else float("nan")))
            del pool
        del bufs
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=DTYPES, choices=list(K.ALL_QUANT))
    ap.add_argument("--threads", nargs="+", type=int, default=[1])
    ap.add_argument("--isa", nargs="+", default=[_native.isa()],
                    help="one or more tables (ISAs), timed interleaved: an A/B of old and new kernels")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=0.15, help="time per measurement")
    ap.add_argument("--shapes", nargs="+", default=[f"{r}x{c}" for r, c in SHAPES], help="OUTxIN")
    ap.add_argument("--settings", nargs="+", default=["l2", "l3", "dram"], choices=["l2", "l3", "dram"])
    ap.add_argument("--prefetch", type=int, default=-1,
                    help="PREFETCHT0 distance in bytes (0: off, -1: each kernel's default)")
    ap.add_argument("--probe", action="store_true", help="print the memory read probe first")
    args = ap.parse_args()
    _native.set_prefetch(args.prefetch)
    t0 = time.time()
    print(f"# isa {args.isa}, prefetch {args.prefetch}, {args.rounds} interleaved rounds; "
          f"GB/s per calling-thread CPU second (1 thread) or wall (pool)")
    if args.probe:
        from cflow.bench.bandwidth import read_bandwidth
        print(f"# memory read probe, 1 thread: {read_bandwidth(1):.1f} GB/s")
    print("| W [out x in] | threads | setting | isa | dtype | GB/s | / q4_0 |")
    print("|---|---|---|---|---|---|---|")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    for r in run(args.dtypes, args.threads, args.isa, args.rounds, args.seconds, shapes, args.settings):
        print(f"| {r['shape']} | {r['threads']} | {r['setting']} | {r['isa']} | {r['dtype']} | {r['gbs']:.1f} "
              f"| {r['ratio']:.2f} |")
        sys.stdout.flush()
    print(f"# {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
