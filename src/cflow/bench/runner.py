"""llama-bench-style measurement: pp (prompt processing) and tg (generation) tokens/s.

Each test runs once as a warm-up, then `reps` times; we report mean ± stddev of tokens/s. Prompt
tokens are synthetic and deterministic (seeded), as in llama-bench. A depth d (llama-bench's -d)
first fills the context with d tokens, untimed, so the test runs with d positions of KV cache
behind it: the test is named "tg128 @ d4096". With a baseline, the two
engines alternate test by test inside one run, so drift of a shared machine hits both alike and
the ratio is measured side by side.

Around the speed we report what explains it: weight bytes each token reads (from the engine's
own counters), the effective read bandwidth that implies, and its share of the read bandwidth
this machine showed to cflow's probe in the same run.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np


class Runner(Protocol):
    name: str

    def reset(self) -> None: ...
    def prefill(self, tokens: np.ndarray, pos0: int = 0) -> None: ...
    def step(self, token: int, pos: int) -> int: ...


@dataclass
class BenchRow:
    engine: str
    test: str  # "pp512" / "tg128"
    threads: int
    n_tokens: int
    samples_ts: list[float] = field(default_factory=list)
    bytes_per_token: float | None = None  # weight bytes read per generated token (tg only)
    cache_type_k: str = "f16"  # the KV cache's row types the engine ran with (cflow.runtime.kvcache)
    cache_type_v: str = "f16"

    @property
    def mean_ts(self) -> float:
        return statistics.fmean(self.samples_ts) if self.samples_ts else float("nan")

    @property
    def stddev_ts(self) -> float:
        return statistics.stdev(self.samples_ts) if len(self.samples_ts) > 1 else 0.0

    @property
    def effective_gbs(self) -> float | None:
        if self.bytes_per_token is None:
            return None
        return self.bytes_per_token * self.mean_ts / 1e9

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(avg_ts=self.mean_ts, stddev_ts=self.stddev_ts, effective_gbs=self.effective_gbs)
        return d


def synthetic_tokens(n: int, vocab: int, seed: int = 42) -> np.ndarray:
    # Skip the lowest ids, where special tokens usually live.
    rng = np.random.default_rng(seed)
    return rng.integers(min(256, vocab // 2), vocab, size=n, dtype=np.int32)


def _fill(runner: Runner, context: np.ndarray | None) -> int:
    """Reset, then prefill the depth's tokens (untimed); the position the test starts at. A runner
    with counters (cflow) zeroes them after the fill, so they count the test alone."""
    runner.reset()
    if context is not None and len(context):
        runner.prefill(context, 0)
        if hasattr(runner, "reset_counters"):
            runner.reset_counters()
        return len(context)
    return 0


def time_pp(runner: Runner, tokens: np.ndarray, context: np.ndarray | None = None) -> float:
    pos0 = _fill(runner, context)
    t0 = time.perf_counter()
    runner.prefill(tokens, pos0)
    return len(tokens) / (time.perf_counter() - t0)


def time_tg(runner: Runner, n: int, first_token: int, context: np.ndarray | None = None) -> float:
    """n decode steps after the context (empty by default), each feeding back the greedy token."""
    pos0 = _fill(runner, context)
    tok = first_token
    t0 = time.perf_counter()
    for pos in range(pos0, pos0 + n):
        tok = runner.step(tok, pos)
    return n / (time.perf_counter() - t0)


def test_name(kind: str, n: int, depth: int) -> str:
    return f"{kind}{n}" + (f" @ d{depth}" if depth else "")


def run_tests(runners: list[Runner], threads: int, *, pp: int, tg: int, reps: int, vocab: int,
              warmup: bool = True, bytes_per_token: Callable[[Runner], float | None] = lambda r: None,
              progress: Callable[[str], None] | None = None, depths: Sequence[int] = (0,)) -> list[BenchRow]:
    """Run pp/tg at each context depth for every runner, alternating runners within each repetition."""
    rows: list[BenchRow] = []
    prompt = synthetic_tokens(pp, vocab) if pp > 0 else None
    first = int(synthetic_tokens(1, vocab, seed=7)[0])
    tests = [(kind, n, depth) for depth in depths
             for kind, n in ([("pp", pp)] if pp > 0 else []) + ([("tg", tg)] if tg > 0 else [])]
    for kind, n, depth in tests:
        context = synthetic_tokens(depth, vocab, seed=11) if depth else None
        name = test_name(kind, n, depth)
        by_runner = {id(r): BenchRow(r.name, name, threads, n) for r in runners}
        for rep in range(reps + (1 if warmup else 0)):
            for r in runners:
                ts = time_pp(r, prompt, context) if kind == "pp" else time_tg(r, n, first, context)
                if warmup and rep == 0:
                    continue
                by_runner[id(r)].samples_ts.append(ts)
                if progress:
                    progress(f"{r.name} {name} t={threads} rep {rep}: {ts:.1f} tok/s")
        for r in runners:
            row = by_runner[id(r)]
            if kind == "tg":
                row.bytes_per_token = bytes_per_token(r)
            rows.append(row)
    return rows
