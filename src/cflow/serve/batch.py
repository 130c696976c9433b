"""Batched generation: many sequences decode together over one model, each in its own KV-cache
slot of a BatchBackend (cflow.serve.backend). The server is a thin layer over this; it is usable
on its own:

    from cflow.serve import BatchGenerator
    with BatchGenerator.load(path, parallel=4, threads=2) as gen:
        for c in gen.complete_many(["Once upon a time", "The capital of France is"], 32, temperature=0):
            print(c.text, c.finish_reason)

One worker thread owns the backend (engines are not thread-safe) and loops:

1. admit queued requests into free slots, first come first served; a request goes to the free slot
   whose cached tokens share the longest prefix with its prompt, and only the rest is evaluated.
   With a backend that has `copy_slot`, a longer prefix that another slot holds is copied from
   it, and one that an older request is still evaluating is waited for, then copied: n choices
   on one prompt (submit_n), or requests sharing a system prompt, evaluate it once;
2. ONE model call (`backend.step_rows`) that runs the next token of every sequence that has one
   to feed (a decode row each) together with up to `prefill_chunk` prompt tokens, the oldest
   admitted prompts first, as rows of their own sequences at consecutive positions (a long prompt
   takes several iterations, so running streams wait at most one chunk between their tokens, and
   a joining prompt rides in the same pass over the weights as the decode rows instead of a pass
   of its own). Logits come back only for the decode rows and for the last row of a prompt
   that is now fully evaluated; the call's rows are capped at the backend's `max_rows` (one
   native pass) while any prompt chunk fits beside the decode rows;
3. each decode row sampled with the sequence's own Sampler (seeded per request, so a seed
   reproduces whatever else runs beside it), detokenized as a stream, checked against its stop
   ids and stop strings; a finished or cancelled sequence leaves its slot at once, the others go
   on; a prompt fully evaluated samples its first token, which the next call feeds.
   Plain greedy rows (no bias, no penalty) take one argmax over the whole [B, V] block, and the
   chosen logit doubles as the row's finiteness check (argmax picks a NaN or +inf if there is one).

Scoring the prompt (`echo`, for loglikelihood evaluations such as lm-eval's): such a job evaluates
its whole prompt (a cached prefix has K/V but no logits) with every prompt row wanted in its
step_rows chunks, riding beside the other slots' decode rows like any prompt chunk, so continuous
batching goes on; each row's logits score the next prompt token (cflow.runtime.score, the same
definition Engine.score uses, and rows are bit-exact whatever shares the call, so the numbers
equal Engine.score's). The scores reach the sink as one Prompt event before the first Piece.

Speculative decoding per request (submit(..., speculative="ngram" | "draft" | "mtp");
cflow.serve.speculate): a speculating sequence's decode row becomes a block of rows in the same
step_rows call: its next token and the k tokens its proposer guesses after it (the n-gram lookup
over its prompt and output; the generator's draft model, run for all drafting sequences in
batched calls of its own before the target's; the model's multi-token heads on the hidden state
of the row that chose its newest token), at consecutive positions of its slot. Plain decode
rows come first; proposals get the rows the pass has left after them and the prompt chunks
(max_rows), and each sequence has its own Gate and DraftLength.
The block is verified with cflow.runtime.speculative's rule and every emitted token takes the
plain path of step 3, so the output is plain decoding's (greedy: token for token; seeded
sampling: what Engine.complete with the same settings draws). Rollback: the slot's record
(`_slot_tokens`, what prefix reuse reads) and the backend's (`truncate`) keep the next token and
the accepted proposals; the rejected ones' K/V rows are overwritten by the next call. Constrained
jobs, and backends without step_rows, decode plainly.

A backend without `step_rows` gets the same iteration as two kinds of call: `prefill` per prompt
chunk (a prompt fully evaluated samples its first token there), then one `step_batch` for the
decode rows.

A job may have a deadline (`timeout`, seconds from submit, queue wait included): past it, the
job ends with Failed(RequestTimeoutError) at the next iteration, queued or running, and its
slot is free for the next one.

Results reach the caller as events through the job's `sink`, called from the worker thread:
`Prompt` once for an echo job, `Piece` per generated token, then exactly one `Finished` or
`Failed`. The sink must not block (the server's hands events to its event loop through
cflow.serve.call.Mailbox). `submit_n` queues n jobs on one prompt (OpenAI's n), one slot each.
The generation rules are those of cflow.runtime.generate.run (same Sampler, StopMatcher, stream detokenizer, stop ids,
context limit), so greedy output equals `Engine.complete` token for token.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from cflow.errors import CflowError
from cflow.runtime.errors import ContextOverflowError, EngineError
from cflow.constrain import compile_constraint, overlap_pays, prefetch, sample as sample_constrained
from cflow.runtime.generate import Completion, StopMatcher, Timings, check_finite, common_prefix
from cflow.runtime.score import Scores, append_score, token_logprobs  # noqa: F401 (token_logprobs: its old home)
from cflow.sampling import Sampler, SamplingParams
from cflow.runtime.speculative import judge
from cflow.serve.speculate import SeqSpec, Speculation

DEFAULT_PREFILL_CHUNK = 64   # prompt tokens per scheduler iteration
DEFAULT_MAX_QUEUE = 256      # requests waiting for a slot before submit() refuses


class QueueFullError(CflowError):
    """Every slot is busy and the wait queue is full; `retry_after` estimates when to try again (s)."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class GeneratorClosedError(CflowError):
    """The generator is shut down (or shutting down): no new requests."""


class RequestTimeoutError(CflowError):
    """A job did not finish within its timeout; it was cancelled and its slot freed."""


# ---- events ------------------------------------------------------------------------------------
@dataclass(slots=True)
class Piece:
    """One generated token: the text it made visible (may be '': an incomplete UTF-8 character,
    or text held back while it may be the start of a stop string) and, when asked for, its
    log-probability and the top alternatives [(id, logprob)] under the model's raw distribution."""

    token: int
    text: str
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class Prompt:
    """The scores of a job's prompt (submit(..., echo=True)), delivered once, before its first
    Piece: scores.logprobs[i] = log p(prompt[i] | prompt[:i]) (None for i = 0) and scores.top[i]
    the job's `logprobs` alternatives (cflow.runtime.score; equal to Engine.score of the prompt)."""

    scores: Scores


@dataclass(slots=True)
class Finished:
    """The end of a job. reason: "stop" (end-of-text or a stop string), "length" (max_tokens or the
    end of the slot's context) or "cancelled". `tail` is text to show after the last Piece."""

    reason: str
    tail: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0        # prompt tokens whose K/V were reused from the slot's previous job
    queue_s: float = 0.0          # submit -> admitted into a slot
    ttft_s: float = 0.0           # submit -> first token (0 when none)
    prompt_s: float = 0.0
    gen_s: float = 0.0
    seed: int | None = None
    drafted: int = 0              # speculation: proposed tokens verified (cflow.serve.speculate)
    accepted: int = 0             # of which accepted


@dataclass(slots=True)
class Failed:
    """The job failed inside the generator (e.g. the model produced non-finite logits)."""

    error: BaseException


Event = Prompt | Piece | Finished | Failed


# ---- jobs --------------------------------------------------------------------------------------
@dataclass(eq=False)
class Job:
    """One request: built by BatchGenerator.submit. `cancel()` from any thread."""

    id: int
    prompt: list[int]
    max_tokens: int | None
    params: SamplingParams
    stop: list[str]
    ignore_eos: bool
    logprobs: int | None          # None: off; n >= 0: the chosen token's logprob and the top n
    sink: Callable[[Event], None]
    t_submit: float = field(default_factory=time.perf_counter)
    timeout: float | None = None  # seconds from t_submit (None: no limit)
    echo: bool = False            # score the prompt: a Prompt event before the first Piece
    constraint: Any = None        # a compiled cflow.constrain.Constraint of this job's own (None: free text)
    speculative: Any = None       # a resolved cflow.runtime.Speculative (None: off; cflow.serve.speculate)
    cancelled: bool = False
    done: bool = False
    _gen: Any = field(default=None, repr=False)

    def cancel(self) -> None:
        """Stop generating for this job and free its slot (a no-op once it has finished)."""
        if not self.cancelled and not self.done:
            self.cancelled = True
            if self._gen is not None:
                self._gen._cancel(self)


@dataclass(eq=False)
class _Seq:
    """A job in a slot: the state of cflow.runtime.generate.run, kept across iterations."""

    job: Job
    slot: int
    t_admit: float
    sampler: Sampler | None = None
    detok: Any = None
    held: StopMatcher | None = None
    stop_ids: frozenset[int] = frozenset()
    history: list[int] = field(default_factory=list)
    fed: int = 0                  # prompt tokens whose K/V are in the slot
    limit: int = 0                # tokens this sequence may generate
    cached: int = 0               # of which reused from the slot's previous job
    count: int = 0                # tokens sampled
    next_token: int = -1          # sampled, not yet run through the model (-1: none)
    t_first: float = 0.0
    t_prefilled: float = 0.0
    leader: "_Seq | None" = None  # an older sequence still evaluating a longer prefix of this prompt
    lead_n: int = 0               # how much of it this one will copy from the leader's slot
    scores: Scores | None = None  # echo: the prompt's scores so far (its whole prompt runs, nothing reused)
    spec: SeqSpec | None = None   # speculation (cflow.serve.speculate; None: plain decode rows)


# ---- the generator ---------------------------------------------------------------------------
class BatchGenerator:
    """Runs jobs on a BatchBackend from one worker thread (see the module docstring)."""

    def __init__(self, backend: Any, *, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 max_queue: int = DEFAULT_MAX_QUEUE, timeout: float | None = None, metrics: Any = None,
                 own_backend: bool = True, draft: Any = None) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.timeout = _check_timeout(timeout)  # a job's default timeout (s; None: none)
        self.backend = backend
        self.n_slots = int(backend.n_slots)
        self.n_ctx = int(backend.n_ctx)
        self.prefill_chunk = int(prefill_chunk)
        self.max_queue = int(max_queue)
        self.metrics = metrics
        self._own_backend = own_backend
        self._stop_ids = frozenset(backend.tokenizer.stop_ids)
        self._cond = threading.Condition()
        self._pending: collections.deque[Job] = collections.deque()
        self._slots: list[_Seq | None] = [None] * self.n_slots
        self._slot_tokens: list[list[int]] = [[] for _ in range(self.n_slots)]  # K/V held per slot
        self._order: list[_Seq] = []      # admitted sequences, oldest first
        self._ids = itertools.count(1)
        self._closing = False
        self._service_s = 1.0             # EMA of a job's time in a slot (for Retry-After)
        self._emitted = 0                 # tokens delivered since metrics last heard of them
        self.last_batch = 0               # sequences in the last decode step
        self._rows = getattr(backend, "step_rows", None)  # mixed prompt + decode calls (None: two kinds)
        self._max_rows = int(getattr(backend, "max_rows", 0) or 0)  # rows in one native pass (0: no cap)
        self._copy = getattr(backend, "copy_slot", None)  # K/V copies between slots (None: none)
        self._truncate = getattr(backend, "truncate", None)  # forget a slot's positions (speculation's rollback)
        # a model with recurrent layers (Qwen3.5) holds per slot the state after its last token only:
        # a prompt reuses a slot's tokens only when they are all its prefix, and nothing is copied
        self._recurrent = bool(getattr(getattr(backend, "config", None), "recurrent", False))
        self._threads = int(getattr(backend, "threads", 0) or os.cpu_count() or 1)
        # what jobs may speculate with (cflow.serve.speculate): the n-gram lookup; `draft`, a
        # BatchBackend over a model with the target's vocabulary (owned like the backend); the heads
        self.speculation = Speculation(backend, draft)
        self._keep_hidden = False  # whether the backend keeps its logits rows' hidden states (heads)
        self._overlap = overlap_pays(self._threads)
        self._thread = threading.Thread(target=self._loop, name="cflow-batch", daemon=True)
        self._thread.start()

    @classmethod
    def load(cls, path: Any = None, *, parallel: int = 4, threads: int | None = None, n_ctx: int | None = None,
             prefill_chunk: int = DEFAULT_PREFILL_CHUNK, max_queue: int = DEFAULT_MAX_QUEUE,
             timeout: float | None = None, model_draft: Any = None, **load_kw: Any) -> "BatchGenerator":
        """`parallel` slots of `n_ctx` positions each over the model at `path` (serve.backend.load_backend:
        one engine whose decode step advances every slot in one pass over the weights). `model_draft`:
        a model with the same vocabulary to speculate with (speculative="draft"), loaded the same way."""
        from cflow.serve.backend import load_backend

        backend = load_backend(path, n_slots=parallel, threads=threads, n_ctx=n_ctx, **load_kw)
        draft = None
        try:
            if model_draft is not None:
                draft = load_backend(model_draft, n_slots=parallel, threads=threads, n_ctx=backend.n_ctx, **load_kw)
            return cls(backend, prefill_chunk=prefill_chunk, max_queue=max_queue, timeout=timeout, draft=draft)
        except BaseException:
            backend.close()
            if draft is not None:
                draft.close()
            raise

    # ---- the caller's side -------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot."""
        return max(0, len(self._pending) - (self.n_slots - self.running))

    @property
    def alive(self) -> bool:
        """Whether the worker thread runs (False after close(), or if it died)."""
        return self._thread.is_alive() and not self._closing

    @property
    def running(self) -> int:
        return sum(s is not None for s in self._slots)

    def retry_after(self) -> int:
        """Seconds until a queued request can expect a slot (an estimate, at least 1)."""
        waves = (len(self._pending) + 1) / self.n_slots
        return int(min(60, max(1, math.ceil(self._service_s * waves))))

    def submit(self, prompt: Sequence[int], sink: Callable[[Event], None], *, max_tokens: int | None = None,
               params: SamplingParams | None = None, stop: Sequence[str] | str = (), ignore_eos: bool = False,
               logprobs: int | None = None, timeout: float | None = None, echo: bool = False,
               constraint: Any = None, speculative: Any = None) -> Job:
        """Queue a job for the token ids `prompt`; events go to `sink` (called from the worker thread).
        `timeout`: seconds from now until the job is cancelled with RequestTimeoutError (None: the
        generator's `timeout`; 0: none). `echo`: score the prompt too (a Prompt event with every
        prompt token's logprob and `logprobs` alternatives, before the first Piece); max_tokens 0
        then scores the prompt and generates nothing. `constraint`: a cflow.constrain.ConstraintSpec
        (or a compiled Constraint) that every generated token must fit (JSON schema, grammar, regex);
        the job ends with "stop" when it is complete. `speculative`: None or "off" (plain decoding),
        "ngram" (prompt lookup), "draft" (the generator's draft model), "mtp" (the model's own
        multi-token heads) or a cflow.runtime.Speculative (its proposer, draft_max, draft_min,
        ngram_min/max, min_acceptance and adaptive apply): the job's decode rows carry its proposals
        for verification (module docstring); its output is plain decoding's. A constrained job
        never speculates.

        Raises ContextOverflowError when the prompt does not fit a slot, EngineError for an empty
        prompt or bad ids, QueueFullError when the wait queue is full, GeneratorClosedError after close(),
        ConstraintError for a malformed constraint, SpeculativeError for a speculative setting the
        generator cannot run ("draft" without a draft model, "mtp" without heads)."""
        return self.submit_n(prompt, [sink], max_tokens=max_tokens, params=params, stop=stop, ignore_eos=ignore_eos,
                             logprobs=logprobs, timeout=timeout, echo=echo, constraint=constraint,
                             speculative=speculative)[0]

    def submit_n(self, prompt: Sequence[int], sinks: Sequence[Callable[[Event], None]], *,
                 max_tokens: int | None = None, params: SamplingParams | None = None, stop: Sequence[str] | str = (),
                 ignore_eos: bool = False, logprobs: int | None = None, timeout: float | None = None,
                 echo: bool = False, constraint: Any = None, speculative: Any = None) -> list[Job]:
        """One job per sink on the same prompt (OpenAI's `n`), each in its own slot, queued together
        or refused together. With a seed in `params`, job i samples with seed + i (job 0 draws what
        a single job with that seed draws); without one, each draws its own. Arguments and errors
        as submit()."""
        ids = [int(t) for t in prompt]
        if not ids:
            raise EngineError("the prompt is empty (no tokens); give some text")
        bad = [t for t in ids if not 0 <= t < self.backend.vocab_size]
        if bad:
            raise EngineError(f"token ids {bad[:5]} are outside the vocabulary (0..{self.backend.vocab_size - 1})")
        if len(ids) >= self.n_ctx:
            raise ContextOverflowError(f"the prompt has {len(ids)} tokens but a slot's context holds {self.n_ctx}; "
                                       f"shorten the prompt", flag="-c")
        if max_tokens is not None and max_tokens < 0:
            raise EngineError(f"max_tokens must be >= 0 (or None for no limit), got {max_tokens}")
        if not sinks:
            raise EngineError("submit_n needs at least one sink (one per sequence)")
        limit = self.timeout if timeout is None else _check_timeout(timeout)
        spec = self.speculation.resolve(speculative)
        stops = [s for s in ([stop] if isinstance(stop, str) else list(stop)) if s]
        params = params or SamplingParams()
        seed = params.seed
        per_job = [params if i == 0 or seed is None or seed == -1 else dataclasses.replace(params, seed=seed + i)
                   for i in range(len(sinks))]
        # compiled here, in the caller's thread (it can take a while), once; each job gets its own matcher
        first = compile_constraint(constraint, self.backend.tokenizer, self.backend.vocab_size)
        if first is not None:  # masks ahead: sampled (greedy asks about the argmax first), and a core free
            first.eager = not params.greedy and self._overlap
        constraints = [first] + [first.copy() if first is not None else None for _ in sinks[1:]]
        now = time.perf_counter()
        jobs = [Job(next(self._ids), ids, max_tokens, per_job[i], stops, bool(ignore_eos), logprobs, sink,
                    t_submit=now, timeout=limit, echo=bool(echo), constraint=constraints[i], speculative=spec,
                    _gen=self)
                for i, sink in enumerate(sinks)]
        with self._cond:
            if self._closing:
                raise GeneratorClosedError("the generator is shutting down")
            waiting = len(self._pending) + len(jobs) - (self.n_slots - self.running)  # after these
            if waiting > self.max_queue:
                ra = self.retry_after()
                if self.metrics:
                    self.metrics.rejected("queue_full")
                many = f"these {len(jobs)} requests" if len(jobs) > 1 else "this request"
                raise QueueFullError(f"all {self.n_slots} slots are busy and {len(self._pending)} requests are "
                                     f"waiting (the queue holds {self.max_queue}, too few for {many}); "
                                     f"retry in about {ra} s", ra)
            self._pending.extend(jobs)
            self._cond.notify()
        return jobs

    def complete_many(self, prompts: Sequence[str | Sequence[int]], max_tokens: int | None = 128, *,
                      stop: Sequence[str] | str = (), ignore_eos: bool = False, add_bos: bool | None = None,
                      timeout: float | None = None, speculative: Any = None, **sampling: Any) -> list[Completion]:
        """Run every prompt concurrently (batched over the slots); return a Completion each, in
        order. `sampling`: SamplingParams' fields; with a `seed`, prompt i uses seed + i. More
        prompts than the queue holds are submitted as earlier ones finish. A prompt that outlives
        `timeout` (as submit's) raises RequestTimeoutError. `speculative`: as submit's, for every prompt."""
        import queue

        spec = self.speculation.resolve(speculative)
        seed = sampling.pop("seed", None)
        params = [SamplingParams(**sampling, seed=None if seed is None or seed == -1 else seed + i)
                  for i in range(len(prompts))]
        ids = [self.backend.encode(p, add_bos) for p in prompts]
        results: queue.SimpleQueue = queue.SimpleQueue()
        jobs: list[Job] = []
        parts: list[list[str]] = [[] for _ in prompts]
        toks: list[list[int]] = [[] for _ in prompts]
        out: list[Completion | None] = [None] * len(prompts)
        done = 0
        try:
            while done < len(prompts):
                while len(jobs) < len(prompts):  # submit what the queue takes
                    i = len(jobs)
                    try:
                        jobs.append(self.submit(ids[i], lambda ev, i=i: results.put((i, ev)), max_tokens=max_tokens,
                                                params=params[i], stop=stop, ignore_eos=ignore_eos, timeout=timeout,
                                                speculative=spec))
                    except QueueFullError:
                        if len(jobs) == done:
                            raise
                        break
                i, ev = results.get()
                if isinstance(ev, Piece):
                    parts[i].append(ev.text)
                    toks[i].append(ev.token)
                elif isinstance(ev, Finished):
                    parts[i].append(ev.tail)
                    t = Timings(prompt_tokens=ev.prompt_tokens - ev.cached_tokens, prompt_s=ev.prompt_s,
                                gen_tokens=ev.completion_tokens, gen_s=ev.gen_s, reused_tokens=ev.cached_tokens,
                                spec="" if spec is None else spec.proposer, drafted=ev.drafted,
                                accepted=ev.accepted)
                    out[i] = Completion("".join(parts[i]), toks[i], ev.prompt_tokens, ev.reason, t)
                    done += 1
                else:
                    raise ev.error
        finally:
            for j in jobs:
                j.cancel()
        return out  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the worker; queued and running jobs end with Failed(GeneratorClosedError)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()
        if self._own_backend:
            self.backend.close()
            if self.speculation.draft is not None:
                self.speculation.draft.backend.close()

    def __enter__(self) -> "BatchGenerator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _cancel(self, job: Job) -> None:
        with self._cond:
            try:
                self._pending.remove(job)
            except ValueError:  # running (the worker reaps it) or finished
                self._cond.notify()
                return
            job.done = True
        if self.metrics:
            self.metrics.finished("cancelled", time.perf_counter() - job.t_submit)
        self._deliver(job, Finished("cancelled", "", len(job.prompt), 0, queue_s=time.perf_counter() - job.t_submit))

    # ---- the worker --------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closing and not self._pending and not self._order:
                    self._cond.wait()
                if self._closing:
                    break
                admitted = self._admit()
            try:
                for seq in admitted:
                    self._start(seq)
                self._expire()
                self._reap()
                if self._rows is not None:
                    self._step()
                else:
                    self._prefill()
                    self._decode()
            except BaseException as e:  # a bug must not stop the server: fail what runs, go on
                traceback.print_exc(file=sys.stderr)
                for seq in list(self._order):
                    self._end(seq, Failed(e))
        closed = GeneratorClosedError("the server is shutting down")
        for seq in list(self._order):
            self._end(seq, Failed(closed))
        with self._cond:
            pending, self._pending = list(self._pending), collections.deque()
        for job in pending:
            self._deliver(job, Failed(closed))

    def _admit(self) -> list[_Seq]:
        """(Under the lock.) Move queued jobs into free slots (a cancelled one is reaped next)."""
        out = []
        while self._pending:
            job = self._pending[0]
            free = [i for i, s in enumerate(self._slots) if s is None]
            if not free:
                break
            self._pending.popleft()
            # echo reuses nothing (it needs every position's logits): it takes the free slot whose
            # cached prefix is least use to it, leaving a shared prefix to the requests that reuse one
            sign = -1 if job.echo else 1
            slot = max(free, key=lambda i: (sign * common_prefix(self._slot_tokens[i], job.prompt), -i))
            seq = _Seq(job, slot, time.perf_counter())
            self._slots[slot] = seq
            self._order.append(seq)
            out.append(seq)
        return out

    def _start(self, seq: _Seq) -> None:
        job = seq.job
        try:
            seq.sampler = Sampler(job.params)
        except BaseException as e:
            self._end(seq, Failed(e))
            return
        tok = self.backend.tokenizer
        seq.detok = tok.stream(skip_special=True)
        seq.held = StopMatcher(job.stop)
        seq.stop_ids = frozenset() if job.ignore_eos else self._stop_ids
        seq.history = list(job.prompt)
        if job.speculative is not None and job.constraint is None:  # a constraint's masks go token by token
            seq.spec = self.speculation.sequence(job.speculative, job.params)
        n = len(job.prompt)
        keep = min(common_prefix(self._slot_tokens[seq.slot], job.prompt), n - 1)
        if self._recurrent and keep != len(self._slot_tokens[seq.slot]):
            keep = 0
        if job.echo:  # every prompt position's logits are needed, and a cached prefix has none
            keep = 0
            seq.scores = Scores(list(job.prompt), [None], [None], [None])
        del self._slot_tokens[seq.slot][keep:]
        seq.fed = seq.cached = keep
        # Every sampled token but the last runs through the model; the context bounds both (as run()).
        seq.limit = self.n_ctx - n + 1
        if job.max_tokens is not None:
            seq.limit = min(seq.limit, job.max_tokens)
        if seq.limit <= 0 and not job.echo:  # max_tokens 0: nothing to generate, nothing to evaluate
            if self.metrics:
                self.metrics.admitted(seq.t_admit - job.t_submit, n, keep)
            self._end(seq, self._finished(seq, "length", ""))
            return
        if self._copy is not None and not job.echo and not self._recurrent:
            self._share(seq)
        if self.metrics:
            self.metrics.admitted(seq.t_admit - job.t_submit, n, seq.cached)

    def _share(self, seq: _Seq) -> None:
        """Before `seq` evaluates its prompt: when another slot holds a longer prefix of it than
        its own, copy that K/V (backend.copy_slot) instead of evaluating it again; when an older
        sequence still evaluating its prompt will hold a longer one still (n choices on one
        prompt, or prompts sharing a system prompt), wait for it (seq.leader; _follow)."""
        prompt = seq.job.prompt
        cap = len(prompt) - 1  # the last token runs, for this sequence's own logits
        best, src = seq.fed, -1
        for i, held in enumerate(self._slot_tokens):
            if i != seq.slot:
                n = min(common_prefix(held, prompt), cap)
                if n > best:
                    best, src = n, i
        lead, lead_n = None, best
        for other in self._order:  # older sequences only: no cycles, and they take the budget first
            if other is seq:
                break
            if other.job.done or other.fed >= len(other.job.prompt):
                continue  # what it holds is in the scan above
            n = min(common_prefix(other.job.prompt, prompt), cap)
            if n > lead_n:
                lead, lead_n = other, n
        if lead is not None:
            seq.leader, seq.lead_n = lead, lead_n
        elif src >= 0:
            self._copy_prefix(seq, src, best)

    def _follow(self, seq: _Seq) -> bool:
        """Whether `seq` may evaluate its prompt now: its leader holds what it waits for (copied
        then), or ended."""
        lead = seq.leader
        if lead is not None and not lead.job.done and lead.fed < seq.lead_n:
            return False
        seq.leader = None
        self._share(seq)
        return seq.leader is None

    def _copy_prefix(self, seq: _Seq, src: int, n: int) -> None:
        try:
            self._copy(src, seq.slot, n)
        except Exception:  # what the slot holds is unknown: evaluate the whole prompt
            traceback.print_exc(file=sys.stderr)
            self._slot_tokens[seq.slot].clear()
            seq.fed = seq.cached = 0
            return
        self._slot_tokens[seq.slot][:] = self._slot_tokens[src][:n]
        seq.fed = seq.cached = n

    def _reap(self) -> None:
        for seq in list(self._order):
            if seq.job.cancelled:
                self._end(seq, self._finished(seq, "cancelled", ""))

    def _expire(self) -> None:
        """End the jobs past their deadline, queued or running (their slots are free again)."""
        now = time.perf_counter()
        with self._cond:
            late = [j for j in self._pending if j.timeout is not None and now - j.t_submit > j.timeout]
            for job in late:
                self._pending.remove(job)
                job.done = True
        for job in late:
            if self.metrics:
                self.metrics.finished("timeout", now - job.t_submit)
            self._deliver(job, Failed(_timed_out(job, 0)))
        for seq in list(self._order):
            job = seq.job
            if job.timeout is not None and now - job.t_submit > job.timeout and not job.done:
                self._end(seq, Failed(_timed_out(job, len(seq.history) - len(job.prompt) if seq.history else 0)))

    def _step(self) -> None:
        """One backend.step_rows call: a decode row per sequence with a token to feed (plain ones
        first, then each speculating sequence's block: its next token and its proposals), then the
        prompt chunks (module docstring, step 2)."""
        dec = [s for s in self._order if s.next_token >= 0 and not s.job.done]
        budget = self.prefill_chunk
        if self._max_rows:  # one native pass when a useful chunk fits beside the decode rows
            budget = min(budget, max(self._max_rows - len(dec), -(-self.prefill_chunk // 4)))
        chunks: list[tuple[_Seq, int]] = []
        for seq in self._order:
            if budget <= 0:
                break
            left = self._prompt_left(seq)
            if left:
                chunks.append((seq, min(budget, left)))
                budget -= chunks[-1][1]
        self.last_batch = len(dec)
        if not dec and not chunks:
            return
        # proposals fill the rows the pass has left (a proposal is a guess, a prompt row certain work)
        room = self._max_rows - len(dec) - sum(k for _, k in chunks) if self._max_rows else sys.maxsize
        plain, spec = self._propose(dec, room)
        dec = plain + spec
        slots = [s.slot for s in plain]
        tokens = [s.next_token for s in plain]
        positions = [len(s.history) - 1 for s in plain]
        want = [True] * len(plain)
        for s in spec:
            n, pos = len(s.spec.drafts), len(s.history) - 1
            slots += [s.slot] * (n + 1)
            tokens += [s.next_token] + s.spec.drafts
            positions += range(pos, pos + n + 1)
            want += [True] * (n + 1)
        for seq, k in chunks:
            slots += [seq.slot] * k
            tokens += seq.job.prompt[seq.fed:seq.fed + k]
            positions += range(seq.fed, seq.fed + k)
            if seq.scores is not None:  # echo: every row's logits score the next prompt token
                want += [True] * k
            else:
                want += [False] * (k - 1) + [seq.fed + k == len(seq.job.prompt)]
        self._prefetch_masks()
        heads = self._hidden_wanted()
        t0 = time.perf_counter()
        try:
            logits = self._rows(slots, tokens, positions, want)
        except Exception as e:
            for s in dec:  # what the failed call wrote is unknown: forget those slots' caches
                self._slot_tokens[s.slot].clear()
                self._end(s, Failed(e))
            for seq, _ in chunks:
                del self._slot_tokens[seq.slot][seq.fed:]
                self._end(seq, Failed(e))
            return
        dt = time.perf_counter() - t0
        if self.metrics:
            if dec:
                self.metrics.decode_step(len(dec), dt)
            if chunks:
                self.metrics.prompt_evaluated(sum(k for _, k in chunks), dt)
        # the hidden state of every logits row, for the sequences whose heads propose (a call of
        # more rows than one native pass keeps only its last pass's: none then)
        hidden = None
        if heads:
            h = self.backend.hidden()
            hidden = h if h.shape[0] == logits.shape[0] else None
        self._sample_rows(plain, logits, positions, hidden)
        row = len(plain)
        for s in spec:
            n = len(s.spec.drafts) + 1
            self._verify(s, logits[row:row + n], hidden[row:row + n] if hidden is not None else None)
            row += n
        for seq, k in chunks:
            self._slot_tokens[seq.slot].extend(seq.job.prompt[seq.fed:seq.fed + k])
            seq.fed += k
            if seq.scores is not None:
                first, row = row, row + k
                if not self._score(seq, logits[first:row]):
                    continue
            elif seq.fed < len(seq.job.prompt):
                continue
            else:
                row += 1
            if seq.fed < len(seq.job.prompt):
                continue
            seq.t_prefilled = time.perf_counter()
            last = logits[row - 1]
            try:
                check_finite(self.backend, last, "for the prompt")
            except Exception as e:
                self._end(seq, Failed(e))
                continue
            if seq.spec is not None and seq.spec.observes:
                seq.spec.observe(hidden[row - 1] if hidden is not None else None)
            self._prompt_done(seq, last)
        self._count_emitted()

    def _propose(self, dec: list[_Seq], room: int) -> tuple[list[_Seq], list[_Seq]]:
        """This iteration's proposals (cflow.serve.speculate) within the `room` rows the call has
        left: the n-gram lookup and the heads per sequence, the draft model for all its sequences
        in batched calls of its own. Returns the decode rows' sequences: (plain, speculating)."""
        asks = []
        for s in dec:
            st = s.spec
            if st is None or room <= 0:
                continue
            paused = st.paused
            k = st.plan(s.limit - s.count - 1, room)
            if st.paused > paused and self.metrics:
                self.metrics.speculation_paused()
            if not k:
                continue
            if st.kind == "draft":
                asks.append((st, s.slot, s.history, k, s.sampler.rng))
                room -= k
            else:
                st.propose(s.history, k, s.sampler.rng)
                room -= len(st.drafts)
        if asks:
            failed = self.speculation.draft.propose(asks)
            for s in dec:
                if s.slot in failed and s.spec is not None and s.spec.kind == "draft":
                    self._end(s, Failed(failed[s.slot]))
        plain: list[_Seq] = []
        spec: list[_Seq] = []
        for s in dec:
            if s.job.done:
                continue
            (spec if s.spec is not None and s.spec.settle() else plain).append(s)
        return plain, spec

    def _hidden_wanted(self) -> bool:
        """Whether this call must keep its rows' hidden states (a sequence proposes with the
        target's heads); tells the backend when that changes."""
        want = any(s.spec is not None and s.spec.observes for s in self._order)
        if want != self._keep_hidden:
            self.backend.keep_hidden = self._keep_hidden = want
        return want

    def _verify(self, seq: _Seq, rows: np.ndarray, hidden: np.ndarray | None = None) -> None:
        """A speculating sequence's block came back: rows[i] are the logits after its next token
        (i = 0) or its i-th proposal. Judge the proposals in order (cflow.runtime.speculative.judge),
        emitting each token down the plain path (_sample) until a rejection (its replacement is
        emitted), the bonus token after the last row, or a token that ends the sequence. The slot
        keeps the K/V of the next token and the kept proposals; the rejected ones' rows are
        forgotten (backend.truncate: the next call overwrites them). `hidden`: the rows' hidden
        states, for a sequence whose heads propose (the one of the row that emits its newest token)."""
        st, drafts, qs = seq.spec, seq.spec.drafts, seq.spec.qs
        if self.metrics:
            self.metrics.speculation_round()
        held = self._slot_tokens[seq.slot]
        pos = len(seq.history) - 1  # where the next token ran
        held.append(seq.next_token)
        seq.next_token = -1
        for i in range(len(drafts) + 1):
            draft = drafts[i] if i < len(drafts) else None
            try:
                kept, tok = judge(seq.sampler, rows[i], seq.history, draft, qs[i] if draft is not None else None,
                                  self.backend, pos + i)
            except Exception as e:
                self._end(seq, Failed(e))
                break
            if draft is not None:
                counted = st.judged(i, kept)
                if self.metrics:
                    self.metrics.speculation_judged(counted, kept)
            if kept:  # its row ran it after the text so far: its K/V are the slot's now
                held.append(draft)
            elif st.observes:  # tok comes from row i: its hidden state proposes next
                st.observe(hidden[i] if hidden is not None else None)
            self._sample(seq, rows[i], tok)
            if seq.job.done or not kept:
                break
        st.end_block()
        if self._truncate is not None:
            self._truncate(seq.slot, len(held))

    def _score(self, seq: _Seq, rows: np.ndarray) -> bool:
        """An echo sequence just fed rows.shape[0] prompt tokens ending at seq.fed: score the prompt
        tokens those rows predict. False when it failed (the sequence has ended)."""
        prompt, scores = seq.job.prompt, seq.scores
        assert scores is not None
        try:
            for j in range(len(rows)):
                nxt = len(scores.logprobs)  # the position the next row predicts
                if nxt >= len(prompt):
                    break
                check_finite(self.backend, rows[j], f"at prompt position {nxt - 1}")
                append_score(scores, rows[j], prompt[nxt], seq.job.logprobs or 0)
        except Exception as e:
            self._end(seq, Failed(e))
            return False
        return True

    def _prompt_done(self, seq: _Seq, last: np.ndarray) -> None:
        """`seq`'s prompt is in and `last` its last row's logits: deliver the prompt's scores (echo),
        then sample the first token (or end, when the job generates nothing)."""
        if seq.scores is not None:
            if not self._deliver(seq.job, Prompt(seq.scores)):
                self._end(seq, self._finished(seq, "cancelled", ""))
                return
            if seq.limit <= 0:
                self._finish(seq, "length")
                return
        self._sample(seq, last)

    def _prompt_left(self, seq: _Seq) -> int:
        """Prompt tokens `seq` has still to feed now: 0 when its prompt is in, its job is done, or it
        waits for an older request's longer shared prefix (_follow copies it once that is in)."""
        n = len(seq.job.prompt)
        if seq.fed >= n or seq.job.done or (seq.leader is not None and not self._follow(seq)):
            return 0
        return n - seq.fed

    def _prefill(self) -> None:
        budget = self.prefill_chunk
        for seq in list(self._order):
            if budget <= 0:
                break
            left = self._prompt_left(seq)
            if not left:
                continue
            n, k = len(seq.job.prompt), min(budget, left)
            # echo needs every position's logits and prefill returns the last one's: a call per token
            parts = [1] * k if seq.scores is not None else [k]
            t0 = time.perf_counter()
            for m in parts:
                chunk = seq.job.prompt[seq.fed:seq.fed + m]
                try:
                    logits = self.backend.prefill(seq.slot, chunk, seq.fed)
                    if seq.fed + m == n:
                        check_finite(self.backend, logits, "for the prompt")
                except Exception as e:
                    del self._slot_tokens[seq.slot][seq.fed:]
                    self._end(seq, Failed(e))
                    break
                self._slot_tokens[seq.slot].extend(chunk)
                seq.fed += m
                budget -= m
                if seq.scores is not None and not self._score(seq, logits[None]):
                    break
            if seq.job.done:
                continue
            if self.metrics:
                self.metrics.prompt_evaluated(k, time.perf_counter() - t0)
            if seq.fed == n:
                seq.t_prefilled = time.perf_counter()
                self._prompt_done(seq, logits)
        self._count_emitted()

    def _decode(self) -> None:
        batch = [s for s in self._order if s.next_token >= 0 and not s.job.done]
        self.last_batch = len(batch)
        if not batch:
            return
        slots = [s.slot for s in batch]
        tokens = [s.next_token for s in batch]
        positions = [len(s.history) - 1 for s in batch]
        self._prefetch_masks()
        t0 = time.perf_counter()
        try:
            logits = self.backend.step_batch(slots, tokens, positions)
        except Exception as e:
            for s in batch:  # what the failed call wrote is unknown: forget those slots' caches
                self._slot_tokens[s.slot].clear()
                self._end(s, Failed(e))
            return
        if self.metrics:
            self.metrics.decode_step(len(batch), time.perf_counter() - t0)
        self._sample_rows(batch, logits, positions)
        self._count_emitted()

    def _prefetch_masks(self) -> None:
        """Constrained sequences' next masks, computed on a background thread during the model call."""
        pending = [s.job.constraint for s in self._order if s.job.constraint is not None and not s.job.done]
        if pending:
            prefetch(pending)

    def _sample_rows(self, batch: list[_Seq], logits: np.ndarray, positions: list[int],
                     hidden: np.ndarray | None = None) -> None:
        """Rows 0..len(batch)-1 of `logits` are the decode rows of `batch` (fed their next_token
        at `positions`): record the fed tokens, sample and deliver each row's next one. `hidden`:
        the rows' hidden states, handed to the sequences whose heads propose."""
        if not batch:
            return
        plain = [s.sampler.plain_greedy and s.job.constraint is None for s in batch]
        best = logits[:len(batch)].argmax(axis=1) if all(plain) else None  # one pass for the whole block
        for i, s in enumerate(batch):
            self._slot_tokens[s.slot].append(s.next_token)
            s.next_token = -1
            row = logits[i]
            try:
                if plain[i]:
                    tok = int(best[i]) if best is not None else int(row.argmax())
                    # argmax takes the first NaN or +inf when there is one, so the chosen logit is
                    # finite exactly when the row's max is: check_finite on that one element
                    check_finite(self.backend, row[tok:tok + 1], f"at position {positions[i]}")
                else:
                    check_finite(self.backend, row, f"at position {positions[i]}")
                    tok = -1
            except Exception as e:
                self._end(s, Failed(e))
                continue
            if s.spec is not None and s.spec.observes:
                s.spec.observe(hidden[i] if hidden is not None else None)
            self._sample(s, row, tok)

    def _sample(self, seq: _Seq, logits: np.ndarray, tok: int = -1) -> None:
        """Sample the next token of `seq` from `logits` [V] (unless the caller chose it: `tok` >= 0)
        and deliver it (generate.run's rules)."""
        job = seq.job
        if tok < 0:
            try:
                if job.constraint is None:
                    tok = seq.sampler.sample(logits, seq.history)
                else:
                    tok = sample_constrained(seq.sampler, job.constraint, logits, seq.history)
            except CflowError as e:  # e.g. a logit_bias id beyond this model's vocabulary
                self._end(seq, Failed(e))
                return
        seq.count += 1
        if seq.count == 1:
            seq.t_first = time.perf_counter()
            if self.metrics:
                self.metrics.first_token(seq.t_first - job.t_submit)
        if tok in seq.stop_ids:
            self._finish(seq, "stop")
            return
        seq.history.append(tok)
        text, hit = seq.held.feed(seq.detok.put(tok))
        if job.constraint is not None:
            try:
                job.constraint.advance(tok)
            except CflowError as e:
                self._end(seq, Failed(e))
                return
        lp = top = None
        if job.logprobs is not None:
            lp, top = token_logprobs(logits, tok, job.logprobs)
        self._emitted += 1
        if not self._deliver(job, Piece(tok, text, lp, top)):
            self._end(seq, self._finished(seq, "cancelled", ""))
        elif hit:
            self._end(seq, self._finished(seq, "stop", ""))
        elif job.constraint is not None and job.constraint.finished:  # nothing may follow: as a stop id
            self._finish(seq, "stop")
        elif seq.count >= seq.limit:
            self._finish(seq, "length")
        else:
            seq.next_token = tok

    def _count_emitted(self) -> None:
        if self._emitted and self.metrics:
            self.metrics.generated(self._emitted)
        self._emitted = 0

    def _finish(self, seq: _Seq, reason: str) -> None:
        tail, _ = seq.held.feed(seq.detok.flush(), final=True)
        self._end(seq, self._finished(seq, reason, tail))

    def _finished(self, seq: _Seq, reason: str, tail: str) -> Finished:
        job, now = seq.job, time.perf_counter()
        generated = len(seq.history) - len(job.prompt) if seq.history else 0
        t_pre = seq.t_prefilled or now
        return Finished(reason, tail, len(job.prompt), generated, seq.cached, queue_s=seq.t_admit - job.t_submit,
                        ttft_s=seq.t_first - job.t_submit if seq.t_first else 0.0,
                        prompt_s=t_pre - seq.t_admit, gen_s=now - t_pre if seq.t_prefilled else 0.0,
                        seed=seq.sampler.seed if seq.sampler is not None else None,
                        drafted=seq.spec.drafted if seq.spec is not None else 0,
                        accepted=seq.spec.accepted if seq.spec is not None else 0)

    def _end(self, seq: _Seq, event: Event) -> None:
        """Deliver the last event of `seq` and free its slot."""
        job = seq.job
        if job.done:
            return
        job.done = True
        seq.next_token = -1
        if self._slots[seq.slot] is seq:
            self._slots[seq.slot] = None
        if seq in self._order:
            self._order.remove(seq)
        in_slot = time.perf_counter() - seq.t_admit
        self._service_s = 0.8 * self._service_s + 0.2 * in_slot
        if self.metrics:
            self.metrics.finished(event.reason if isinstance(event, Finished) else
                                  "timeout" if isinstance(event.error, RequestTimeoutError) else "error",
                                  time.perf_counter() - job.t_submit)
        self._deliver(job, event)

    def _deliver(self, job: Job, event: Event) -> bool:
        """Hand an event to the job's sink; False when the sink is gone (the job is then cancelled)."""
        try:
            job.sink(event)
            return True
        except Exception:
            job.cancelled = True
            return False


def _check_timeout(timeout: float | None) -> float | None:
    """A timeout in seconds (None or 0: none)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0 \
            or not math.isfinite(timeout):
        raise ValueError(f"timeout must be a finite number of seconds >= 0 (0 or None: none), got {timeout!r}")
    return float(timeout) or None


def _timed_out(job: Job, generated: int) -> RequestTimeoutError:
    return RequestTimeoutError(f"the request did not finish within its timeout of {job.timeout:g} s "
                               f"({generated} tokens generated); it was cancelled")
