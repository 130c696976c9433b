"""Where a batched serving run spends its engine calls: the scheduler (cflow.serve.batch) driven
in-process with serve_load.py's workload (closed-loop clients, distinct prompts, greedy, exactly
--max-tokens tokens each), its backend wrapped to count every model call.

    python benchmarks/serve_structure.py -t 1 --concurrency 8 --requests 32
    python benchmarks/serve_structure.py -t 2 --concurrency 8 --requests 32 --profile   # + per-op table

Printed: per kind of model call (step_rows, or with --separate prefill / step_batch) the calls, the rows they ran,
the rows that produced logits, and the seconds inside them; per generated token the calls and
rows; the worker's time outside model calls (sampling, detokenizing, delivering, scheduling).
These are counts and structure first: the seconds are only meaningful on an idle machine. With
--profile, the C core's per-op profile (cflow.bench.profile) of the decode-shaped calls is
printed too (B rows of distinct sequences).

No HTTP: what the server adds on top is the event loop's work per delivered token.
"""

from __future__ import annotations

import argparse
import collections
import queue
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import prompt, smollm2_gguf  # noqa: E402


class Counting:
    """A BatchBackend wrapper that counts calls, rows and time per method."""

    def __init__(self, inner, mixed: bool = True):
        self.inner = inner
        self.stats = collections.defaultdict(lambda: [0, 0, 0, 0.0])  # calls, rows, logit rows, s
        for name in ("n_slots", "n_ctx", "vocab_size", "path", "tokenizer", "config", "threads", "max_rows"):
            setattr(self, name, getattr(inner, name))
        if not mixed:  # the scheduler's other path: prefill calls, then one step_batch
            self.step_rows = None

    def encode(self, p, add_bos=None):
        return self.inner.encode(p, add_bos)

    def _count(self, name, rows, logit_rows, fn, *a):
        t0 = time.perf_counter()
        out = fn(*a)
        s = self.stats[name]
        s[0] += 1
        s[1] += rows
        s[2] += logit_rows
        s[3] += time.perf_counter() - t0
        return out

    def prefill(self, slot, tokens, pos0):
        return self._count("prefill", len(tokens), 1, self.inner.prefill, slot, tokens, pos0)

    def step_batch(self, slots, tokens, positions):
        return self._count("step_batch", len(slots), len(slots), self.inner.step_batch, slots, tokens, positions)

    def step_rows(self, slots, tokens, positions, want):
        return self._count("step_rows", len(slots), sum(1 for w in want if w), self.inner.step_rows,
                           slots, tokens, positions, want)

    def close(self):
        self.inner.close()


def drive(gen, n_requests: int, concurrency: int, words: int, max_tokens: int) -> tuple[int, float]:
    """serve_load.py's closed loop: `concurrency` clients, each submitting the next request when
    its last one finishes. Returns (generated tokens, seconds)."""
    from cflow.sampling import SamplingParams
    from cflow.serve.batch import Finished, Piece

    done_q: queue.SimpleQueue = queue.SimpleQueue()
    counter = iter(range(n_requests))
    lock = threading.Lock()
    tokens = [0]

    def submit_next() -> bool:
        with lock:
            i = next(counter, None)
        if i is None:
            return False

        def sink(ev):
            if isinstance(ev, Piece):
                tokens[0] += 1
            elif isinstance(ev, Finished):
                done_q.put(ev)
            else:
                done_q.put(ev)

        gen.submit(gen.backend.encode(prompt(i, words)), sink, max_tokens=max_tokens, ignore_eos=True,
                   params=SamplingParams(temperature=0))  # serve_load.py's requests are greedy
        return True

    t0 = time.perf_counter()
    live = sum(submit_next() for _ in range(concurrency))
    while live:
        ev = done_q.get()
        if not isinstance(ev, Finished):
            raise ev.error
        live -= 1
        live += submit_next()
    return tokens[0], time.perf_counter() - t0


def native_profile(backend, rows: int, steps: int):
    """The C core's per-op profile of `steps` decode-shaped calls of `rows` distinct sequences."""
    import numpy as np

    from cflow.bench.profile import Profile, _collect

    eng = backend.engine
    nat = eng._native
    eng.reset()
    seqs = list(range(rows))
    toks = [1 + s for s in seqs]
    for s in seqs:
        eng.prefill([1, 2, 3, 4 + s], 0, seq=s)
    pos = 4
    for _ in range(4):
        out = eng.step_batch(seqs, toks, [pos] * rows)
        toks = [int(t) for t in np.argmax(out, axis=1)]
        pos += 1
    eng.reset_counters()
    nat.profile_start(steps)
    for _ in range(steps):
        out = eng.step_batch(seqs, toks, [pos] * rows)
        toks = [int(t) for t in np.argmax(out, axis=1)]
        pos += 1
    nat.profile_stop()
    dec = _collect(eng, f"step_batch B={rows}", eng.counters())
    nat.profile_free()
    eng.reset()
    return Profile(str(eng.path), nat.active_threads, eng.isa, dec, None, 0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default=None)
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("-np", "--parallel", type=int, default=16)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("-n", "--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--prefill-chunk", type=int, default=None)
    p.add_argument("--separate", action="store_true",
                   help="the scheduler without step_rows: prefill calls beside one step_batch per iteration")
    p.add_argument("--profile", action="store_true", help="also the C core's per-op profile of step_batch")
    args = p.parse_args(argv)

    from cflow.serve.backend import load_backend
    from cflow.serve.batch import DEFAULT_PREFILL_CHUNK, BatchGenerator

    model = args.model or smollm2_gguf()
    backend = Counting(load_backend(model, n_slots=args.parallel, threads=args.threads, n_ctx=512), not args.separate)
    gen = BatchGenerator(backend, prefill_chunk=args.prefill_chunk or DEFAULT_PREFILL_CHUNK, own_backend=False)
    try:
        drive(gen, min(4, args.requests), args.concurrency, args.prompt_words, 4)  # warm-up
        backend.stats.clear()
        busy0 = gen.busy_s if hasattr(gen, "busy_s") else None
        n_tok, wall = drive(gen, args.requests, args.concurrency, args.prompt_words, args.max_tokens)
        busy = gen.busy_s - busy0 if busy0 is not None else None
    finally:
        gen.close()
    print(f"{model}: {args.requests} requests x {args.max_tokens} tokens, {args.concurrency} clients, "
          f"{args.parallel} slots, {args.threads} thread(s)")
    print(f"generated {n_tok} tokens in {wall:.2f} s ({n_tok / wall:.0f} tok/s; indicative only)")
    in_calls = 0.0
    print(f"{'call':<12}{'calls':>8}{'rows':>8}{'logit rows':>12}{'s':>8}{'calls/tok':>11}{'rows/tok':>10}"
          f"{'rows/call':>11}")
    for name, (calls, rows, lrows, s) in sorted(backend.stats.items()):  # noqa: B007
        in_calls += s
        print(f"{name:<12}{calls:>8}{rows:>8}{lrows:>12}{s:>8.2f}{calls / n_tok:>11.3f}{rows / n_tok:>10.3f}"
              f"{rows / max(calls, 1):>11.2f}")
    total_calls = sum(v[0] for v in backend.stats.values())
    print(f"model calls per generated token: {total_calls / n_tok:.3f}")
    print(f"seconds inside model calls {in_calls:.2f}, outside them {wall - in_calls:.2f} "
          f"({(wall - in_calls) / wall:.0%} of the wall time: sampling, detokenizing, delivery, scheduling, "
          f"the client threads)")
    if busy is not None:
        print(f"worker busy {busy:.2f} s")
    try:
        if args.profile:
            for rows in (1, args.concurrency):
                print(native_profile(backend.inner, rows, 32).to_markdown())
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
