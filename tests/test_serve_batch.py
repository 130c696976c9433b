"""The batch generator (cflow.serve.batch), without HTTP: the scheduler the server is a thin layer over.

- On the built-in model, batched decoding (4 slots, chunked prefill, one step_batch per
  iteration) gives exactly Engine.complete's tokens, greedy and seeded; a slot's cached prefix is
  reused and changes nothing.
- On a fake backend that checks the BatchBackend contract (positions, distinct slots) and whose
  next token depends on the whole sequence in its slot: many concurrent jobs with small prefill
  chunks each get their own sequence's tokens (no cross-talk between slots), cancellation frees
  a slot, the queue is bounded, a failing step fails only the sequences in it, and the
  generator keeps serving afterwards.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest

from cflow.runtime import DEFAULT_MODEL, ContextOverflowError, Engine, EngineError
from cflow.serve.backend import BatchBackend, EngineSlots
from cflow.serve.batch import BatchGenerator, Failed, Finished, Piece, QueueFullError, token_logprobs
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
    def __init__(self, n_slots=4, n_ctx=64, vocab=50, fail_on=None, gate=None):
        self.n_slots, self.n_ctx, self.vocab_size = n_slots, n_ctx, vocab
        self.path = "fake"
        self.tokenizer = FakeTokenizer()
        self.cache = [[] for _ in range(n_slots)]
        self.fail_on, self.gate = fail_on, gate
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
        out = np.zeros((len(slot_ids), self.vocab_size), np.float32)
        for i, (s, t, p) in enumerate(zip(slot_ids, tokens, positions)):
            self._put(s, [t], p)
            out[i] = self._logits(s)
        return out

    def close(self):
        self.closed = True


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
