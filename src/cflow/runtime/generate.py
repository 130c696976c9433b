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
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from cflow.constrain import compile_constraint, overlap_pays, prefetch, sample as sample_constrained
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
    # speculative decoding (cflow.runtime.speculative); spec "" when it was off
    spec: str = ""  # the proposer: "ngram" or "draft"
    drafted: int = 0  # proposed tokens the target verified (speculative.proposals_counted: after a rejection too)
    accepted: int = 0  # of which the target accepted
    rounds: int = 0  # verification calls (target calls that scored at least one proposed token)
    draft_s: float = 0.0  # of gen_s, in the proposer (the draft model's steps, the n-gram lookup)
    paused_steps: int = 0  # plain steps taken because the acceptance gate had paused speculation
    gate_note: str = ""  # why the gate started paused (speculative.make_gate), "" when it started open

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def gen_tps(self) -> float:
        return self.gen_tokens / self.gen_s if self.gen_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Share of the proposed tokens the target accepted (0 when none were proposed): accepted /
        drafted, the proposals after a rejection counted too (cflow.runtime.speculative.proposals_counted;
        llama.cpp's and vLLM's draft acceptance rate)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Proposed tokens accepted per verification call (each call also emits one token of the
        target's own: the correction or the bonus token)."""
        return self.accepted / self.rounds if self.rounds else 0.0


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
        stop: Sequence[str] | str, add_bos: bool | None, ignore_eos: bool = False,
        speculative: "Any" = None, constraint: "Any" = None) -> Iterator[tuple[int, str]]:
    """Yield (token id, newly visible text) per generated token; id -1 for a final flush.
    `speculative` (None: off) is anything cflow.runtime.speculative.resolve takes; the output is
    what plain decoding gives (greedy: token for token; sampling: the same distribution).
    `constraint` (None: off): a cflow.constrain.ConstraintSpec or a compiled Constraint; every
    generated token then fits it, and generation ends when the grammar allows nothing more."""
    gen = Generation(eng, prompt, max_tokens, params, stop, add_bos, ignore_eos, constraint)
    if speculative is not None and gen.constraint is not None:
        raise EngineError("speculative decoding under a JSON schema, grammar or regex is not supported; "
                          "drop one of the two")
    if speculative is not None:
        from cflow.runtime import speculative as spec_mod

        spec = spec_mod.resolve(speculative, eng)
        if spec is not None:
            return spec_mod.run(gen, spec)
    return _plain(gen)


def _plain(gen: "Generation") -> Iterator[tuple[int, str]]:
    """One native call per generated token: sample, emit, step."""
    eng, tm = gen.eng, gen.timings
    if gen.constraint is not None:  # the first mask, while the prompt is evaluated
        prefetch([gen.constraint])
    logits = gen.prefill()
    t_gen = time.perf_counter()
    try:
        while gen.emitted < gen.limit:
            tok = gen.sample(logits)
            piece, done = gen.emit(tok)
            if piece is not None:
                yield tok, piece
            if done:
                break
            if gen.constraint is not None:  # the next mask is computed while the step runs
                prefetch([gen.constraint])
            logits = eng.step(tok, len(gen.history) - 1)
            check_finite(eng, logits, f"at position {len(gen.history) - 1}")
        tail = gen.finish()
        if tail:
            yield -1, tail
    finally:
        tm.gen_s = time.perf_counter() - t_gen


class Generation:
    """One generation's state and its contracts, shared by the plain loop (here) and the
    speculative one (cflow.runtime.speculative): the checks on the request, the prompt's prefill
    (reusing the cached prefix), the sampler, and `emit`, which decides for each generated token
    what is shown and whether generation ends (a stop id, a stop string, max_tokens, the end of
    the context). A loop only chooses which tokens to emit and which native calls compute them."""

    def __init__(self, eng: "Engine", prompt: str | Sequence[int], max_tokens: int | None, params: SamplingParams,
                 stop: Sequence[str] | str, add_bos: bool | None, ignore_eos: bool = False,
                 constraint: "Any" = None) -> None:
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
        self.eng = eng
        self.ids = ids
        self.sampler = Sampler(params)
        self.stop_ids = frozenset() if ignore_eos else eng.tokenizer.stop_ids
        self.detok = eng.tokenizer.stream(skip_special=True)
        self.held = StopMatcher(stops)
        self.timings = eng.last_timings = Timings(load_s=eng.load_s)
        eng.last_prompt_len, eng.last_finish_reason = len(ids), "length"
        eng.seed = self.sampler.seed
        self.history = list(ids)  # the prompt, then every emitted token
        # Every sampled token but the last runs through the model; the context bounds both.
        self.limit = eng.n_ctx - len(ids) + 1
        if max_tokens is not None:
            self.limit = min(self.limit, max_tokens)
        self.emitted = 0  # tokens sampled and passed to emit (a stop id included)
        self.hit = False  # a stop string ended generation
        self.constraint = compile_constraint(constraint, eng.tokenizer, eng.config.vocab_size)
        if self.constraint is not None:  # masks ahead: sampled, and a core free to compute them
            self.constraint.eager = not self.sampler.params.greedy and overlap_pays(eng.threads)

    def prefill(self) -> np.ndarray:
        """The logits after the prompt (the cached prefix is reused); timed as prompt eval."""
        tm = self.timings
        t0 = time.perf_counter()
        logits = self.eng.eval(self.ids)
        check_finite(self.eng, logits, "for the prompt")
        tm.prompt_tokens = len(self.ids) - tm.reused_tokens
        tm.prompt_s = time.perf_counter() - t0
        return logits

    def sample(self, logits: np.ndarray) -> int:
        """Plain sampling at the next position (its history: the prompt and every emitted token)."""
        ts = time.perf_counter()
        if self.constraint is not None:
            tok = sample_constrained(self.sampler, self.constraint, logits, self.history)
        else:
            tok = self.sampler.sample(logits, self.history)
        self.timings.sample_s += time.perf_counter() - ts
        return tok

    def emit(self, tok: int) -> tuple[str | None, bool]:
        """Emit the next generated token: (the text now visible, or None for a stop id, which is
        not shown; whether generation ends here). Call only while emitted < limit."""
        self.emitted += 1
        self.timings.gen_tokens += 1
        if tok in self.stop_ids:
            self.eng.last_finish_reason = "stop"
            return None, True
        self.history.append(tok)
        text, self.hit = self.held.feed(self.detok.put(tok))
        complete = False  # the constraint allows nothing more: ends as a stop id would
        if self.constraint is not None:
            self.constraint.advance(tok)
            complete = self.constraint.finished
        if self.hit or complete:
            self.eng.last_finish_reason = "stop"
        return text, self.hit or complete or self.emitted >= self.limit

    def finish(self) -> str:
        """The text still held back (by the detokenizer or a possible stop string) when generation
        ends without a stop string."""
        if self.hit:
            return ""
        tail, _ = self.held.feed(self.detok.flush(), final=True)
        return tail


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
