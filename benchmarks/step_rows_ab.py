"""A/B of a serving iteration in one process: a joining prompt as its own prefill call beside the
decode step of the running sequences (A: Engine.prefill + Engine.step_batch, the scheduler's old
two kinds of call) against the same rows in one Engine.step_rows call (B: the prompt's rows and
the decode rows in one pass over the weights, logits only for the decode rows and the prompt's
last row). Also the decode rows alone, one sequence per call against all in one step_batch
(the engine's own ceiling for the n-stream / 1-stream throughput ratio). They alternate, many
repeats, on the same positions; the rows' logits are checked equal (bit for bit) once. Medians
only: on a shared machine this is an indicative signal, not a benchmark.

    python benchmarks/step_rows_ab.py -t 1 --decode 8 --prompt 36 --repeats 40
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import smollm2_gguf  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default=None)
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("--decode", type=int, default=8, help="running sequences (decode rows)")
    p.add_argument("--prompt", type=int, default=36, help="tokens of the joining prompt")
    p.add_argument("--context", type=int, default=60, help="tokens each running sequence holds")
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args(argv)

    from cflow.runtime import Engine

    eng = Engine.load(args.model or smollm2_gguf(), threads=args.threads, n_ctx=512, n_seq=args.decode + 1)
    rng = np.random.default_rng(0)
    v = eng.config.vocab_size
    ctx = args.context
    for s in range(args.decode):
        eng.prefill(rng.integers(0, v, ctx).tolist(), 0, seq=s)
    prompt = rng.integers(0, v, args.prompt).tolist()
    dseq = list(range(args.decode))
    dtok = rng.integers(0, v, args.decode).tolist()
    new = args.decode

    def a() -> tuple[np.ndarray, np.ndarray]:
        last = eng.prefill(prompt, 0, seq=new).copy()
        return eng.step_batch(dseq, dtok, [ctx] * args.decode).copy(), last

    def b() -> tuple[np.ndarray, np.ndarray]:
        out = eng.step_rows(dseq + [new] * len(prompt), dtok + prompt,
                            [ctx] * args.decode + list(range(len(prompt))),
                            [True] * args.decode + [False] * (len(prompt) - 1) + [True])
        return out[:args.decode].copy(), out[args.decode].copy()

    def c() -> None:  # the decode rows one sequence at a time: B passes over the weights
        for s, t in zip(dseq, dtok):
            eng.step_batch([s], [t], [ctx])

    def d() -> None:  # the decode rows together: one pass
        eng.step_batch(dseq, dtok, [ctx] * args.decode)

    ra, rb = a(), b()
    same = np.array_equal(ra[0], rb[0]) and np.array_equal(ra[1], rb[1])
    ta, tb, tc, td = [], [], [], []
    for _ in range(args.repeats):
        for f, ts in ((a, ta), (b, tb), (c, tc), (d, td)):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
    ma, mb, mc, md = (statistics.median(x) for x in (ta, tb, tc, td))
    print(f"{args.decode} decode rows (context {ctx}) + a {args.prompt}-token prompt, {args.threads} thread(s), "
          f"{args.repeats} alternating repeats; logits equal: {same}")
    print(f"A prefill + step_batch: median {ma * 1e3:.2f} ms   B step_rows: median {mb * 1e3:.2f} ms   "
          f"B/A {mb / ma:.3f} (indicative)")
    print(f"decode rows alone: {args.decode} x step_batch(B=1) median {mc * 1e3:.2f} ms   step_batch(B={args.decode}) "
          f"median {md * 1e3:.2f} ms   speed-up of the batched step {mc / md:.2f}x (indicative; the bound on "
          f"{args.decode} streams / 1 stream before any serving overhead)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
