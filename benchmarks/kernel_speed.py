"""Micro-benchmark of the tiled quantized mat-vec kernels: GB/s of weights read, per kernel table.

For SmolLM2-135M-sized matrices it times `y = W x` (activation already quantized; the timing
loop runs in C, so Python adds nothing per call) in two settings:
- hot:  the same matrix every call, so it sits in L2/L3: the kernel's instruction speed;
- cold: round-robin over enough copies to exceed the last-level cache: DRAM streaming, what one
        decode step sees.
GB/s = weight bytes / wall seconds per call; the last column divides by the calling thread's
CPU seconds instead, which on a busy shared machine is the steadier number for 1 thread.
Compare with `cflow.bench.bandwidth.read_bandwidth`.

With --batch B it instead times the prefill kernel: matmat (B activations, each weight block
unpacked once) against B separate mat-vecs, hot matrices, 1 thread, in GMAC/s (both include
quantizing the B activations, as the wrappers do); the tables take turns within each round, and
the "vs" column is each table's matmat speed relative to the first one listed (on a shared
machine trust the ratios, not the absolute numbers):
    python benchmarks/kernel_speed.py --batch 64 --isa avxvnni avx512 --dtypes q4_0

    python benchmarks/kernel_speed.py [--dtypes q4_0 q4_1 q8_0] [--threads 1 2] [--isa avx2]
                                 [--seconds 0.3] [--prefetch 8192] [--no-cold] [--batch 64]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from cflow import _native
from cflow import quant as Q

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]  # [out, in] as in SmolLM2-135M
COLD_BYTES = 128 << 20  # 4x a 32 MiB L3


def make_tiled(rows: int, cols: int, dtype: str, rng: np.random.Generator) -> np.ndarray:
    w = rng.standard_normal((rows, cols), dtype=np.float32)
    return Q.quantize_tiled(w, dtype)


def time_matvec(buf: np.ndarray, copies: int, dtype: str, rows: int, cols: int, x: np.ndarray,
                isa: str, pool, seconds: float) -> tuple[float, float]:
    """(wall, calling thread's CPU) seconds per call, best of three, each measurement lasting
    about `seconds`."""
    args = (buf, copies, Q.DTYPE_IDS[dtype], rows, cols, x)
    _native.bench_matvec(*args, isa=isa, pool=pool, iters=copies)  # warm up, page in
    t, _ = _native.bench_matvec(*args, isa=isa, pool=pool, iters=copies)
    iters = max(copies, int(seconds / max(t, 1e-9)))
    best, best_cpu = float("inf"), float("inf")
    for _ in range(3):  # best of three: the machine may be shared
        wall, cpu = _native.bench_matvec(*args, isa=isa, pool=pool, iters=iters)
        best, best_cpu = min(best, wall), min(best_cpu, cpu)
    return best, best_cpu


def run(dtypes: list[str], threads: list[int], isas: list[str], seconds: float, cold: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    rows_out = []
    for dtype in dtypes:
        for rows, cols in SHAPES:
            one = make_tiled(rows, cols, dtype, rng)
            x = rng.standard_normal(cols, dtype=np.float32)
            settings = [("hot", one, 1)]
            if cold:
                copies = max(2, -(-COLD_BYTES // one.nbytes))
                settings.append(("cold", np.tile(one, copies), copies))
            for nth in threads:
                pool = _native.Pool(nth) if nth > 1 else None
                for isa in isas:
                    for label, buf, copies in settings:
                        s, cpu = time_matvec(buf, copies, dtype, rows, cols, x, isa, pool,
                                             seconds / (10 if isa == "ref" else 1))
                        rows_out.append(dict(dtype=dtype, shape=f"{rows}x{cols}", mb=one.nbytes / 1e6,
                                             threads=nth, isa=isa, cache=label, us=s * 1e6,
                                             gbs=one.nbytes / s / 1e9, cpu_gbs=one.nbytes / cpu / 1e9))
                del pool
    return rows_out


def best_time(fn, seconds: float) -> float:
    """Best wall seconds of fn() over about `seconds` (at least 3 calls)."""
    best, t_end, n = float("inf"), time.perf_counter() + seconds, 0
    while n < 3 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        best, n = min(best, time.perf_counter() - t0), n + 1
    return best


def run_batch(dtypes: list[str], isas: list[str], B: int, seconds: float, rounds: int = 5) -> list[dict]:
    """matmat and B x matvec per table, the tables timed in turn within each of `rounds` rounds
    (best kept), so that load from others on a shared machine hits them alike: compare the
    `vs` column (matmat speed relative to the first table listed), not absolute numbers."""
    rng = np.random.default_rng(0)
    out = []
    for dtype in dtypes:
        for rows, cols in SHAPES[:3]:  # the per-layer matrices; lm_head runs for one token only
            t = make_tiled(rows, cols, dtype, rng)
            X = rng.standard_normal((B, cols), dtype=np.float32)
            dt = Q.DTYPE_IDS[dtype]
            mm = {isa: float("inf") for isa in isas}
            mv = dict(mm)
            for _ in range(rounds):
                for isa in isas:
                    s = seconds / rounds / (10 if isa == "ref" else 1)
                    mm[isa] = min(mm[isa], best_time(lambda: _native.matmat(t, dt, rows, cols, X, isa=isa), s))
                    mv[isa] = min(mv[isa], best_time(
                        lambda: [_native.matvec(t, dt, rows, cols, x, isa=isa) for x in X], s))
            macs = rows * cols * B
            for isa in isas:
                out.append(dict(dtype=dtype, shape=f"{rows}x{cols}", isa=isa, mm=macs / mm[isa] / 1e9,
                                mv=macs / mv[isa] / 1e9, vs=mm[isas[0]] / mm[isa]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["q4_0", "q4_1", "q8_0"], choices=list(Q.QUANT_DTYPES))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--isa", nargs="+", default=_native.available_isas())
    ap.add_argument("--seconds", type=float, default=0.3, help="time per measurement")
    ap.add_argument("--no-cold", action="store_true", help="skip the DRAM (cold cache) runs")
    ap.add_argument("--prefetch", type=int, default=0, help="PREFETCHT0 distance in bytes (0: off)")
    ap.add_argument("--batch", type=int, default=0, help="time matmat with this many activations instead")
    args = ap.parse_args()
    _native.set_prefetch(args.prefetch)
    t0 = time.time()
    if args.batch > 0:
        print(f"| dtype | W [out x in] | isa | matmat GMAC/s (B={args.batch}) | vs {args.isa[0]} "
              f"| {args.batch} x matvec GMAC/s |")
        print("|---|---|---|---|---|---|")
        for r in run_batch(args.dtypes, args.isa, args.batch, args.seconds):
            print(f"| {r['dtype']} | {r['shape']} | {r['isa']} | {r['mm']:.1f} | {r['vs']:.2f}x | {r['mv']:.1f} |")
        print(f"# {time.time() - t0:.0f} s")
        return
    print(f"# kernel tables: {_native.available_isas()} (default {_native.isa()}); "
          f"prefetch {args.prefetch} bytes")
    print("| dtype | W [out x in] | MB | threads | isa | cache | us/call | GB/s | GB/s per thread-0 CPU s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in run(args.dtypes, args.threads, args.isa, args.seconds, not args.no_cold):
        print(f"| {r['dtype']} | {r['shape']} | {r['mb']:.2f} | {r['threads']} | {r['isa']} | {r['cache']} "
              f"| {r['us']:.1f} | {r['gbs']:.1f} | {r['cpu_gbs']:.1f} |")
    print(f"# {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
