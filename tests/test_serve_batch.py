"""The batch generator (cflow.serve.batch), without HTTP: the scheduler the server is a thin layer over.

- On the built-in model, batched decoding (4 slots, chunked prefill, one step_rows call per
  iteration: prompt chunks beside the decode rows) gives exactly Engine.complete's tokens,
  greedy and seeded; a slot's cached prefix is reused and changes nothing.
- Jobs with different sampling settings in one batch (plain greedy rows take the batched argmax,
  rows with a logit bias or penalties their own sampler) each equal Engine.complete with theirs;
  n jobs on one prompt (submit_n) draw seed, seed + 1, ...
- On a fake backend that checks the BatchBackend contract (positions, distinct slots) and whose
  next token depends on the whole sequence in its slot: many concurrent jobs with small prefill
  chunks each get their own sequence's tokens (no cross-talk between slots), cancellation frees
  a slot, the queue is bounded, a failing step fails only the sequences in it, non-finite logits
  fail their row on every sampling path, a job past its timeout (queued or running) fails with
  RequestTimeoutError and frees its slot, and the generator keeps serving afterwards.
- The same fake with step_rows: one call per iteration carries prompt chunks beside decode
  rows (within the backend's max_rows), every job still gets its own tokens, and a failing or
  non-finite call fails only its rows.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest

from cflow.runtime import DEFAULT_MODEL, ContextOverflowError, CorruptModelError, Engine, EngineError
from cflow.serve.backend import BatchBackend, EngineSlots
from cflow.serve.batch import (BatchGenerator, Failed, Finished, Piece, QueueFullError, RequestTimeoutError,
                               token_logprobs)
from cflow.sampling import SamplingParams

needs_builtin = pytest.mark.skipif(not DEFAULT_MODEL.is_file(), reason="built-in model not installed")

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They saw",
           "One day, a big red ball", "The sun was shining and", "Tim had a toy car. He",
           "Mom said: \"Time for bed!\"", "There was a cat named", "x"]


# ---- real engines -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    if not DEFAULT_MODEL.is_file():
        pytest.skip("built-in model not installed")
    with Engine.load(threads=1) as eng:
        yield eng


@pytest.fixture(scope="module")
def gen4():
    if not DEFAULT_MODEL.is_file():
        pytest.skip("built-in model not installed")
    with BatchGenerator.load(parallel=4, threads=1, prefill_chunk=8) as g:
        yield g


def test_default_backend_is_one_batched_engine(gen4):
    from cflow.serve.backend import EngineBatch

    assert isinstance(gen4.backend, EngineBatch) and isinstance(gen4.backend, BatchBackend)
    assert gen4.n_slots == 4 and gen4.backend.engine.n_seq == 4


def test_engine_slots_is_a_batch_backend():
    # the reference backend: one Engine per slot over one mapping of the weights
    from cflow.runtime import DEFAULT_MODEL

    b = EngineSlots.load(DEFAULT_MODEL, n_slots=3, threads=1)
    try:
        assert isinstance(b, BatchBackend) and b.n_slots == 3 and len({id(e) for e in b.engines}) == 3
        assert len({id(e.file) for e in b.engines}) == 1
    finally:
        b.close()


def test_engine_slots_mixed_calls_and_copies_equal_engine_complete(engine):
    # the reference backend's step_rows (a prefill per stretch) and copy_slot (the tokens evaluated
    # again): n choices and mixed calls give Engine.complete's tokens
    with BatchGenerator(EngineSlots.load(n_slots=3, threads=1), prefill_chunk=4) as g:
        ids = engine.encode(PROMPTS[2])
        q: queue.SimpleQueue = queue.SimpleQueue()
        g.submit_n(ids, [lambda ev, i=i: q.put((i, ev)) for i in range(2)], max_tokens=12,
                   params=SamplingParams(temperature=0))
        got = g.complete_many(PROMPTS[:1], 12, temperature=0)  # beside them
        toks, ends = [[], []], [None, None]
        while any(e is None for e in ends):
            i, ev = q.get(timeout=60)
            if isinstance(ev, Piece):
                toks[i].append(ev.token)
            else:
                ends[i] = ev
    want = engine.complete(PROMPTS[2], 12, temperature=0).tokens
    assert toks == [want, want] and ends[1].cached_tokens == len(ids) - 1
    assert got[0].tokens == engine.complete(PROMPTS[0], 12, temperature=0).tokens


def test_batched_greedy_equals_engine_complete(engine, gen4):
    got = gen4.complete_many(PROMPTS, 40, temperature=0, stop=["\n\n"])
    for p, c in zip(PROMPTS, got):
        ref = engine.complete(p, 40, temperature=0, stop=["\n\n"])
        assert (c.text, c.tokens, c.finish_reason, c.prompt_tokens) == \
            (ref.text, ref.tokens, ref.finish_reason, ref.prompt_tokens), p


def test_batched_seeded_sampling_equals_engine_complete(engine, gen4):
    got = gen4.complete_many(PROMPTS, 30, temperature=1.0, top_k=0, top_p=0.9, seed=100)
    for i, (p, c) in enumerate(zip(PROMPTS, got)):
        ref = engine.complete(p, 30, temperature=1.0, top_k=0, top_p=0.9, seed=100 + i)
        assert c.tokens == ref.tokens and c.text == ref.text, p


def run_job_events(gen, jobs, timeout: float = 60):
    """Submit (prompt ids, submit kwargs) pairs at once; the Pieces and the end event of each."""
    q: queue.SimpleQueue = queue.SimpleQueue()
    for i, (ids, kw) in enumerate(jobs):
        gen.submit(ids, lambda ev, i=i: q.put((i, ev)), **kw)
    pieces: list[list[Piece]] = [[] for _ in jobs]
    ends: list = [None] * len(jobs)
    while any(e is None for e in ends):
        i, ev = q.get(timeout=timeout)
        if isinstance(ev, Piece):
            pieces[i].append(ev)
        else:
            ends[i] = ev
    return pieces, ends


def run_jobs(gen, jobs):
    """run_job_events, with each job's tokens instead of its Pieces."""
    pieces, ends = run_job_events(gen, jobs)
    return [[p.token for p in ps] for ps in pieces], ends


def test_mixed_sampling_settings_in_one_batch_equal_engine_complete(engine, gen4):
    greedy_tok = engine.complete(PROMPTS[0], 1, temperature=0).tokens[0]
    settings = [dict(temperature=0), dict(temperature=0, logit_bias={greedy_tok: -100.0}),
                dict(temperature=0, frequency_penalty=1.5, presence_penalty=0.5),
                dict(temperature=0.9, seed=5, frequency_penalty=0.8, logit_bias={greedy_tok: 4.0}),
                dict(temperature=0), dict(temperature=0, repeat_penalty=1.3, presence_penalty=-0.5)]
    jobs = [(engine.encode(PROMPTS[i % 3]), dict(max_tokens=24, params=SamplingParams(**kw)))
            for i, kw in enumerate(settings)]
    toks, ends = run_jobs(gen4, jobs)
    for i, kw in enumerate(settings):
        ref = engine.complete(PROMPTS[i % 3], 24, **kw)
        assert toks[i] == ref.tokens and ends[i].reason == ref.finish_reason, kw
    assert toks[1][0] != greedy_tok and toks[0] != toks[1]  # the bias changed the answer
    assert toks[2] != engine.complete(PROMPTS[2], 24, temperature=0).tokens  # so did the penalties


def test_n_jobs_on_one_prompt_draw_consecutive_seeds(engine, gen4):
    ids = engine.encode(PROMPTS[1])
    q: queue.SimpleQueue = queue.SimpleQueue()
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=77)
    jobs = gen4.submit_n(ids, [lambda ev, i=i: q.put((i, ev)) for i in range(3)], max_tokens=16, params=params)
    assert len(jobs) == 3
    toks: list[list[int]] = [[], [], []]
    ended = 0
    while ended < 3:
        i, ev = q.get(timeout=60)
        if isinstance(ev, Piece):
            toks[i].append(ev.token)
        else:
            assert isinstance(ev, Finished) and ev.seed == 77 + i
            assert i == 0 or ev.cached_tokens == len(ids) - 1  # copied from job 0's slot
            ended += 1
    for i in range(3):
        assert toks[i] == engine.complete(PROMPTS[1], 16, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                          seed=77 + i).tokens
    assert len({tuple(t) for t in toks}) == 3


def test_context_end_and_max_tokens_zero(engine, gen4):
    long, zero = gen4.complete_many(["Once upon a time", "Hello"], None, temperature=0, ignore_eos=True)[0], \
        gen4.complete_many(["Hello"], 0)[0]
    ref = engine.complete("Once upon a time", None, temperature=0, ignore_eos=True)
    assert long.tokens == ref.tokens and long.finish_reason == "length"
    assert long.prompt_tokens + len(long.tokens) == gen4.n_ctx + 1  # the last sampled token is never run
    assert zero.tokens == [] and zero.text == "" and zero.finish_reason == "length"


def test_prefix_is_reused_from_the_slot(engine):
    with BatchGenerator.load(parallel=1, threads=1) as g:
        a, = g.complete_many(["Once upon a time, in a big forest,"], 12, temperature=0)
        b, = g.complete_many(["Once upon a time, in a big forest, there"], 12, temperature=0)
    assert a.timings.reused_tokens == 0 and b.timings.reused_tokens > 5
    assert b.tokens == engine.complete("Once upon a time, in a big forest, there", 12, temperature=0).tokens


def test_submit_refuses_bad_prompts(gen4):
    sink = lambda ev: None  # noqa: E731
    with pytest.raises(ContextOverflowError):
        gen4.submit([1] * gen4.n_ctx, sink)
    with pytest.raises(EngineError):
        gen4.submit([], sink)
    with pytest.raises(EngineError):
        gen4.submit([gen4.backend.vocab_size], sink)


def test_token_logprobs():
    x = np.array([1.0, 3.0, 2.0, 3.0], np.float32)
    lp, top = token_logprobs(x, 2, 3)
    ls = x - np.log(np.exp(x).sum())
    assert lp == pytest.approx(ls[2])
    assert [i for i, _ in top] == [1, 3, 2] and top[0][1] == pytest.approx(ls[1])


# ---- a fake backend that checks the contract ----------------------------------------------------
class FakeTokenizer:
    stop_ids = frozenset({0})

    class _Stream:
        def put(self, t: int) -> str:
            return chr(ord("a") + t % 26)

        def flush(self) -> str:
            return ""

    def stream(self, skip_special: bool = False):
        return self._Stream()


def next_token(seq: list[int], vocab: int) -> int:
    """The fake model: the next token depends on the whole sequence (never 0, the stop id)."""
    h = 0
    for t in seq:
        h = (h * 31 + t + 7) % 1000003
    return 1 + h % (vocab - 1)


class FakeBackend:
    def __init__(self, n_slots=4, n_ctx=64, vocab=50, fail_on=None, gate=None, poison=None, delay=0.0):
        self.n_slots, self.n_ctx, self.vocab_size = n_slots, n_ctx, vocab
        self.path = "fake"
        self.tokenizer = FakeTokenizer()
        self.cache = [[] for _ in range(n_slots)]
        self.fail_on, self.gate = fail_on, gate
        self.poison = poison or {}   # token -> a value (NaN, inf) its step writes into logit 3 of its row
        self.delay = delay           # seconds per step
        self.steps: list[int] = []
        self.closed = False

    def encode(self, prompt, add_bos=None):
        return [1 + ord(c) % (self.vocab_size - 1) for c in prompt] if isinstance(prompt, str) else list(prompt)

    def _logits(self, slot):
        out = np.zeros(self.vocab_size, np.float32)
        out[next_token(self.cache[slot], self.vocab_size)] = 10.0
        return out

    def _put(self, slot, tokens, pos0):
        assert 0 <= pos0 <= len(self.cache[slot]), (pos0, len(self.cache[slot]))
        assert pos0 + len(tokens) <= self.n_ctx
        del self.cache[slot][pos0:]
        self.cache[slot].extend(tokens)

    def prefill(self, slot, tokens, pos0):
        assert len(tokens) >= 1
        self._put(slot, list(tokens), pos0)
        return self._logits(slot)

    def step_batch(self, slot_ids, tokens, positions):
        if self.gate is not None:
            self.gate.wait()
        assert len(set(slot_ids)) == len(slot_ids) == len(tokens) == len(positions)
        self.steps.append(len(slot_ids))
        if self.fail_on is not None and self.fail_on in tokens:
            raise EngineError("the fake step failed")
        time.sleep(self.delay)
        out = np.zeros((len(slot_ids), self.vocab_size), np.float32)
        for i, (s, t, p) in enumerate(zip(slot_ids, tokens, positions)):
            self._put(s, [t], p)
            out[i] = self._logits(s)
            if t in self.poison:
                out[i, 3] = self.poison[t]
        return out

    def close(self):
        self.closed = True


class FakeRowsBackend(FakeBackend):
    """FakeBackend with step_rows (the scheduler's one-call-per-iteration path): checks that a
    slot's rows come in order at consecutive positions from what its cache holds, and records
    each call's (decode rows, prompt rows, rows)."""

    def __init__(self, *a, max_rows=0, **kw):
        super().__init__(*a, **kw)
        self.max_rows = max_rows
        self.calls: list[tuple[int, int, int]] = []
        self.copies: list[tuple[int, int, int]] = []

    def step_batch(self, slot_ids, tokens, positions):
        raise AssertionError("a backend with step_rows gets no step_batch call")

    def prefill(self, slot, tokens, pos0):
        raise AssertionError("a backend with step_rows gets no prefill call")

    def copy_slot(self, src, dst, n):
        assert 0 <= n <= len(self.cache[src])
        self.copies.append((src, dst, n))
        self.cache[dst] = self.cache[src][:n]

    def step_rows(self, slot_ids, tokens, positions, want):
        if self.gate is not None:
            self.gate.wait()
        assert len(slot_ids) == len(tokens) == len(positions) == len(want) >= 1
        counts = {s: slot_ids.count(s) for s in set(slot_ids)}
        decode = sum(1 for s in slot_ids if counts[s] == 1)
        self.calls.append((decode, len(slot_ids) - decode, len(slot_ids)))
        self.steps.append(decode)
        if self.fail_on is not None and self.fail_on in tokens:
            raise EngineError("the fake step failed")
        time.sleep(self.delay)
        out, last = [], {}
        for s, t, p, w in zip(slot_ids, tokens, positions, want):
            assert last.get(s, p - 1) == p - 1, "a slot's rows out of order"
            last[s] = p
            self._put(s, [t], p)
            if w:
                row = self._logits(s)
                if t in self.poison:
                    row[3] = self.poison[t]
                out.append(row)
        return np.array(out, np.float32).reshape(len(out), self.vocab_size)


def reference(prompt: list[int], n: int, vocab: int = 50) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        t = next_token(seq, vocab)
        out.append(t)
        seq.append(t)
    return out


def collect(gen, prompts, **kw):
    q: queue.SimpleQueue = queue.SimpleQueue()
    jobs = [gen.submit(p, lambda ev, i=i: q.put((i, ev)), **kw) for i, p in enumerate(prompts)]
    toks = [[] for _ in prompts]
    ends: list = [None] * len(prompts)
    while any(e is None for e in ends):
        i, ev = q.get(timeout=10)
        if isinstance(ev, Piece):
            assert ends[i] is None, "a piece after the end"
            toks[i].append(ev.token)
        else:
            ends[i] = ev
    return jobs, toks, ends


def test_concurrent_jobs_get_their_own_tokens():
    rng = np.random.default_rng(0)
    be = FakeBackend(n_slots=4, n_ctx=64)
    prompts = [list(rng.integers(1, 50, int(rng.integers(1, 30)))) for _ in range(24)]
    with BatchGenerator(be, prefill_chunk=5) as g:
        _, toks, ends = collect(g, prompts, max_tokens=20, params=SamplingParams(temperature=0))
    for p, t, e in zip(prompts, toks, ends):
        n = min(20, 64 - len(p) + 1)
        assert isinstance(e, Finished) and e.reason == "length" and e.completion_tokens == n
        assert t == reference(p, n)
    assert max(be.steps) == 4 and be.closed


@pytest.mark.parametrize("max_rows", [0, 7])
def test_mixed_calls_run_prompt_chunks_beside_decode_rows(max_rows):
    rng = np.random.default_rng(1)
    be = FakeRowsBackend(n_slots=4, n_ctx=64, max_rows=max_rows)
    prompts = [list(rng.integers(1, 50, int(rng.integers(1, 30)))) for _ in range(24)]
    with BatchGenerator(be, prefill_chunk=5) as g:
        _, toks, ends = collect(g, prompts, max_tokens=20, params=SamplingParams(temperature=0))
    for p, t, e in zip(prompts, toks, ends):
        n = min(20, 64 - len(p) + 1)
        assert isinstance(e, Finished) and e.reason == "length" and e.completion_tokens == n
        assert t == reference(p, n)
    assert any(d and c for d, c, _ in be.calls), "no call carried prompt rows beside decode rows"
    assert max(c for _, c, _ in be.calls) <= 5 and max(be.steps) == 4
    if max_rows:  # a chunk fits beside 4 decode rows in 7: the cap holds (else ceil(5 / 4) = 2 rows)
        assert max(r for *_, r in be.calls) <= 7
    # one model call per iteration, each with at least one decode row or one prompt row
    assert len(be.calls) < sum(len(p) for p in prompts) + sum(len(t) for t in toks)


def test_mixed_calls_fail_their_rows_and_go_on():
    p_bad = [1, 2, 3]
    bad_token = reference(p_bad, 1)[0]
    be = FakeRowsBackend(n_slots=2, fail_on=bad_token)
    with BatchGenerator(be) as g:
        _, toks, ends = collect(g, [p_bad], max_tokens=5, params=SamplingParams(temperature=0))
        assert isinstance(ends[0], Failed) and "fake step failed" in str(ends[0].error)
        be.fail_on = None
        _, toks, ends = collect(g, [[9, 9], p_bad], max_tokens=4, params=SamplingParams(temperature=0))
        assert all(isinstance(e, Finished) for e in ends) and toks == [reference([9, 9], 4), reference(p_bad, 4)]
    poisoned = FakeRowsBackend(n_slots=2, poison={p_bad[-1]: float("nan")})  # the prompt's last row
    with BatchGenerator(poisoned) as g:
        _, toks, ends = collect(g, [p_bad, [7, 8]], max_tokens=3, params=SamplingParams(temperature=0))
    assert isinstance(ends[0], Failed) and isinstance(ends[0].error, CorruptModelError)
    assert "for the prompt" in str(ends[0].error) and toks[0] == []
    assert isinstance(ends[1], Finished) and toks[1] == reference([7, 8], 3)


def test_n_choices_and_shared_prefixes_evaluate_the_prompt_once():
    be = FakeRowsBackend(n_slots=4, n_ctx=64)
    prompt = list(range(1, 21))
    with BatchGenerator(be, prefill_chunk=6) as g:
        q: queue.SimpleQueue = queue.SimpleQueue()
        g.submit_n(prompt, [lambda ev, i=i: q.put((i, ev)) for i in range(3)], max_tokens=5,
                   params=SamplingParams(temperature=0))
        toks, ends = [[], [], []], [None] * 3
        while any(e is None for e in ends):
            i, ev = q.get(timeout=10)
            if isinstance(ev, Piece):
                toks[i].append(ev.token)
            else:
                ends[i] = ev
        # the prompt ran once; the two others copied 19 positions and ran their last token; then
        # 4 decode rows each (the 5th token is not fed)
        assert sum(r for *_, r in be.calls) == 20 + 2 + 3 * 4
        assert sorted(n for *_, n in be.copies) == [19, 19]
        assert toks == [reference(prompt, 5)] * 3 and [e.cached_tokens for e in ends] == [0, 19, 19]
        # two requests sharing a 12-token prefix beside a running one: the second copies it
        be.calls.clear(), be.copies.clear()
        a, b = list(range(30, 42)) + [5, 6, 7], list(range(30, 42)) + [8, 9]
        _, toks, ends = collect(g, [a, b], max_tokens=4, params=SamplingParams(temperature=0))
        assert toks == [reference(a, 4), reference(b, 4)] and ends[1].cached_tokens == 12
        assert be.copies and be.copies[-1][2] == 12 and sum(r for *_, r in be.calls) == 15 + 2 + 2 * 3


def test_prefix_reuse_and_slot_choice():
    be = FakeBackend(n_slots=2, n_ctx=64)
    with BatchGenerator(be) as g:
        collect(g, [[5, 6, 7, 8, 9]], max_tokens=3, params=SamplingParams(temperature=0))
        _, toks, ends = collect(g, [[5, 6, 7, 8, 9, 10, 11]], max_tokens=3, params=SamplingParams(temperature=0))
    assert ends[0].cached_tokens == 5 and toks[0] == reference([5, 6, 7, 8, 9, 10, 11], 3)


def test_stop_strings_and_stop_ids():
    be = FakeBackend(n_slots=1)
    p = [3, 4, 5]
    ref = reference(p, 10)
    text = "".join(chr(ord("a") + t % 26) for t in ref)
    stop = text[4:6]
    with BatchGenerator(be) as g:
        _, toks, ends = collect(g, [p], max_tokens=10, params=SamplingParams(temperature=0), stop=[stop])
    assert ends[0].reason == "stop" and text.index(stop) + len(stop) - 1 <= len(toks[0]) <= 6


def test_cancel_frees_the_slot_and_queue_is_bounded():
    gate = threading.Event()
    be = FakeBackend(n_slots=1, n_ctx=64, gate=gate)
    with BatchGenerator(be, max_queue=1) as g:
        q: queue.SimpleQueue = queue.SimpleQueue()
        a = g.submit([1, 2], q.put, max_tokens=50, ignore_eos=True)
        g.submit([3, 4], q.put, max_tokens=2)
        with pytest.raises(QueueFullError) as e:
            g.submit([5], q.put)
        assert e.value.retry_after >= 1
        a.cancel()
        gate.set()
        events = []
        while not (events and sum(isinstance(x, Finished) for x in events) == 2):
            events.append(q.get(timeout=10))
        ends = [x for x in events if isinstance(x, Finished)]
        assert ends[0].reason == "cancelled" and ends[0].completion_tokens < 50
        assert ends[1].reason == "length" and ends[1].completion_tokens == 2
        assert g.running == 0 and g.queue_depth == 0


def test_cancel_while_queued():
    gate = threading.Event()
    be = FakeBackend(n_slots=1, gate=gate)
    with BatchGenerator(be) as g:
        q: queue.SimpleQueue = queue.SimpleQueue()
        a = g.submit([1, 2], q.put, max_tokens=5)
        b = g.submit([3, 4], q.put, max_tokens=5)
        b.cancel()
        ev = q.get(timeout=10)
        assert isinstance(ev, Finished) and ev.reason == "cancelled" and ev.completion_tokens == 0
        gate.set()
        a.cancel()


def test_a_failing_step_fails_its_batch_and_the_generator_goes_on():
    p_bad = [1, 2, 3]
    bad_token = reference(p_bad, 1)[0]
    be = FakeBackend(n_slots=2, fail_on=bad_token)
    with BatchGenerator(be) as g:
        _, toks, ends = collect(g, [p_bad], max_tokens=5, params=SamplingParams(temperature=0))
        assert isinstance(ends[0], Failed) and "fake step failed" in str(ends[0].error)
        be.fail_on = None
        _, toks, ends = collect(g, [[9, 9]], max_tokens=4, params=SamplingParams(temperature=0))
        assert isinstance(ends[0], Finished) and toks[0] == reference([9, 9], 4)


def test_a_sink_that_raises_cancels_only_its_job():
    be = FakeBackend(n_slots=2)
    with BatchGenerator(be) as g:
        def broken(ev):
            raise RuntimeError("gone")
        g.submit([1, 2], broken, max_tokens=30)
        _, toks, ends = collect(g, [[4, 5]], max_tokens=10, params=SamplingParams(temperature=0))
        assert toks[0] == reference([4, 5], 10) and ends[0].reason == "length"


def test_close_fails_queued_and_running_jobs():
    gate = threading.Event()
    be = FakeBackend(n_slots=1, gate=gate)
    g = BatchGenerator(be)
    q: queue.SimpleQueue = queue.SimpleQueue()
    g.submit([1], q.put, max_tokens=5)
    g.submit([2], q.put, max_tokens=5)
    closer = threading.Thread(target=g.close)
    closer.start()
    gate.set()
    closer.join(10)
    assert not closer.is_alive()
    ends = []
    while not q.empty():
        ev = q.get()
        if not isinstance(ev, Piece):
            ends.append(ev)
    assert len(ends) == 2 and be.closed


def test_complete_many_submits_beyond_the_queue_as_jobs_finish():
    be = FakeBackend(n_slots=2)
    prompts = [[i + 1, i + 2] for i in range(9)]
    with BatchGenerator(be, max_queue=1) as g:
        got = g.complete_many(prompts, 5, temperature=0)
    assert [c.tokens for c in got] == [reference(p, 5) for p in prompts]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("mixed", [False, True])
def test_non_finite_logits_fail_their_row_on_every_sampling_path(bad, mixed):
    # the poisoned row is a plain greedy one: alone with another greedy row (the batched argmax) or
    # beside a sampled row (its own argmax); then a sampled poisoned row
    p_bad, p_ok = [1, 2, 3], [7, 8]
    first = reference(p_bad, 1)[0]
    be = FakeBackend(n_slots=2, poison={first: bad})
    other = SamplingParams(temperature=1.0, seed=1) if mixed else SamplingParams(temperature=0)
    with BatchGenerator(be) as g:
        toks, ends = run_jobs(g, [(p_bad, dict(max_tokens=5, params=SamplingParams(temperature=0))),
                                  (p_ok, dict(max_tokens=5, params=other))])
        assert isinstance(ends[0], Failed) and isinstance(ends[0].error, CorruptModelError), ends[0]
        assert "non-finite logits at position 3" in str(ends[0].error) and toks[0] == [first]
        assert isinstance(ends[1], Finished) and len(toks[1]) == 5
        if not mixed:
            assert toks[1] == reference(p_ok, 5)
        toks, ends = run_jobs(g, [(p_bad, dict(max_tokens=5, params=SamplingParams(temperature=0.5, seed=2,
                                                                                   logit_bias={first: 50})))])
        assert isinstance(ends[0], Failed) and isinstance(ends[0].error, CorruptModelError)


def test_a_job_past_its_timeout_fails_and_frees_its_slot():
    be = FakeBackend(n_slots=1, n_ctx=4000, delay=0.01)
    with BatchGenerator(be, timeout=30) as g:
        q: queue.SimpleQueue = queue.SimpleQueue()
        t0 = time.perf_counter()
        g.submit([1, 2], lambda ev: q.put(("a", ev)), max_tokens=3000, ignore_eos=True, timeout=0.3)
        g.submit([3, 4], lambda ev: q.put(("b", ev)), max_tokens=5, timeout=0.1)  # expires while queued
        ends, pieces = {}, 0
        while len(ends) < 2:
            who, ev = q.get(timeout=10)
            if isinstance(ev, Piece):
                pieces += who == "a"
            else:
                ends[who] = (ev, time.perf_counter() - t0)
        (a, ta), (b, tb) = ends["a"], ends["b"]
        assert isinstance(a, Failed) and isinstance(a.error, RequestTimeoutError) and 0.3 <= ta < 5
        assert f"within its timeout of 0.3 s ({pieces} tokens generated)" in str(a.error) and 0 < pieces < 3000
        assert isinstance(b, Failed) and isinstance(b.error, RequestTimeoutError) and "(0 tokens" in str(b.error)
        assert 0.1 <= tb < 5
        assert g.running == 0 and g.queue_depth == 0
        # the slot serves the next job; its timeout is the generator's (30 s), or none with 0
        _, toks, ends2 = collect(g, [[5, 6]], max_tokens=6, params=SamplingParams(temperature=0))
        assert isinstance(ends2[0], Finished) and toks[0] == reference([5, 6], 6)
        _, toks, ends2 = collect(g, [[5, 6]], max_tokens=6, params=SamplingParams(temperature=0), timeout=0)
        assert isinstance(ends2[0], Finished)
    with pytest.raises(ValueError, match="timeout"):
        BatchGenerator(FakeBackend(), timeout=-1)


def test_submit_n_is_queued_or_refused_as_a_whole():
    gate = threading.Event()
    be = FakeBackend(n_slots=2, gate=gate)
    with BatchGenerator(be, max_queue=1) as g:
        q: queue.SimpleQueue = queue.SimpleQueue()
        with pytest.raises(QueueFullError, match="too few for these 4 requests"):
            g.submit_n([1, 2], [q.put] * 4, max_tokens=3)  # 2 slots + 1 place in the queue
        assert g.queue_depth == 0 and g.running == 0
        jobs = g.submit_n([1, 2], [lambda ev, i=i: q.put((i, ev)) for i in range(3)], max_tokens=3,
                          params=SamplingParams(temperature=0))
        gate.set()
        toks: list[list[int]] = [[], [], []]
        ended = 0
        while ended < 3:
            i, ev = q.get(timeout=10)
            if isinstance(ev, Piece):
                toks[i].append(ev.token)
            else:
                ended += 1
        assert toks == [reference([1, 2], 3)] * 3 and len({j.id for j in jobs}) == 3
