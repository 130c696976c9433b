"""The generation loop over an Engine: encode, prefill (reusing the cached prefix), sample, step,
detokenize as a stream, stop at end-of-text, stop strings, max_tokens or the end of the context;
and the timings and result records of one generation.

Per generated token this costs one native call (the whole forward pass), one sampling call and a
few attribute lookups. Logits that are not finite (what damaged weights produce) end generation
with CorruptModelError instead of sampling garbage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from cflow.runtime.errors import ContextOverflowError, CorruptModelError, EngineError
from cflow.sampling import Sampler, SamplingParams

if TYPE_CHECKING:
    from cflow.runtime.engine import Engine


@dataclass
class Timings:
    """Wall-clock split of one generation, llama.cpp style."""

    load_s: float = 0.0
    prompt_tokens: int = 0  # tokens actually evaluated (a reused prefix is not counted)
    prompt_s: float = 0.0
    gen_tokens: int = 0
    gen_s: float = 0.0  # decode steps + sampling
    sample_s: float = 0.0  # of which sampling
    reused_tokens: int = 0  # prompt tokens whose KV cache was kept from the previous call

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def gen_tps(self) -> float:
        return self.gen_tokens / self.gen_s if self.gen_s > 0 else 0.0


@dataclass
class Completion:
    text: str
    tokens: list[int]  # generated ids (a stop id is not included)
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string), "length" (max_tokens or context end)
    timings: Timings = field(default_factory=Timings)


def check_finite(eng: "Engine", logits: np.ndarray, where: str) -> None:
    # max() propagates NaN and +inf, so one reduction (a few µs for a 49k vocabulary) catches both
    if not np.isfinite(logits.max()):
        raise CorruptModelError(f"the model computed non-finite logits {where}: its weights are damaged or the "
                                f"model is broken; check the file with `cflow inspect --verify {eng.path}`")


def run(eng: "Engine", prompt: str | Sequence[int], max_tokens: int | None, params: SamplingParams,
        stop: Sequence[str] | str, add_bos: bool | None, ignore_eos: bool = False) -> Iterator[tuple[int, str]]:
    """Yield (token id, newly visible text) per generated token; id -1 for a final flush."""
    if max_tokens is not None and max_tokens < 0:
        raise EngineError(f"max_tokens must be >= 0 (or None for no limit), got {max_tokens}", flag="-n")
    stops = [s for s in ([stop] if isinstance(stop, str) else stop) if s]
    ids = eng.encode(prompt, add_bos)
    if not ids:
        raise EngineError("the prompt is empty and the tokenizer adds no BOS token; give some text")
    if len(ids) >= eng.n_ctx:
        limit = eng.config.max_seq_len
        fix = (f"raise the context with -c / n_ctx (the model allows up to {limit})" if eng.n_ctx < limit
               else f"the context is already the model's maximum ({limit})")
        raise ContextOverflowError(f"the prompt has {len(ids)} tokens but the context holds {eng.n_ctx}; "
                                   f"shorten the prompt or {fix}", flag="-c")
    sampler = Sampler(params)
    stop_ids = frozenset() if ignore_eos else eng.tokenizer.stop_ids
    detok = eng.tokenizer.stream(skip_special=True)
    held = StopMatcher(stops)
    tm = eng.last_timings = Timings(load_s=eng.load_s)
    eng.last_prompt_len, eng.last_finish_reason = len(ids), "length"
    eng.seed = sampler.seed

    t0 = time.perf_counter()
    logits = eng.eval(ids)
    check_finite(eng, logits, "for the prompt")
    tm.prompt_tokens = len(ids) - tm.reused_tokens
    tm.prompt_s = time.perf_counter() - t0

    history = list(ids)
    # Every sampled token but the last runs through the model; the context bounds both.
    limit = eng.n_ctx - len(ids) + 1
    if max_tokens is not None:
        limit = min(limit, max_tokens)
    t_gen = time.perf_counter()
    hit = False
    try:
        for i in range(limit):
            ts = time.perf_counter()
            tok = sampler.sample(logits, history)
            tm.sample_s += time.perf_counter() - ts
            tm.gen_tokens += 1
            if tok in stop_ids:
                eng.last_finish_reason = "stop"
                break
            history.append(tok)
            text, hit = held.feed(detok.put(tok))
            yield tok, text
            if hit:
                eng.last_finish_reason = "stop"
                break
            if i + 1 < limit:
                logits = eng.step(tok, len(history) - 1)
                check_finite(eng, logits, f"at position {len(history) - 1}")
        if not hit:
            tail, _ = held.feed(detok.flush(), final=True)
            if tail:
                yield -1, tail
    finally:
        tm.gen_s = time.perf_counter() - t_gen


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class StopMatcher:
    """Holds back text that might be the start of a stop string; reports when one appears."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.buf = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, bool]:
        """(text safe to show now, whether a stop string was hit)."""
        self.buf += text
        if not self.stops:
            out, self.buf = self.buf, ""
            return out, False
        hits = [(self.buf.find(s), s) for s in self.stops if s in self.buf]
        if hits:
            at = min(i for i, _ in hits)
            out, self.buf = self.buf[:at], ""
            return out, True
        if final:
            out, self.buf = self.buf, ""
            return out, False
        keep = 0  # longest suffix of buf that is a proper prefix of some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.buf)), 0, -1):
                if self.buf.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        out = self.buf[:len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep:]
        return out, False
