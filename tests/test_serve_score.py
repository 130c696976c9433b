"""Scoring text: Engine.score (cflow.runtime.score), the batch generator's echo jobs, and
`echo` + `logprobs` on the server's /v1/completions, the request lm-eval's local-completions
model sends for loglikelihood tasks.

- Engine.score equals scoring by hand from Engine.step's logits, position by position; `start`
  skips the first positions and changes nothing else.
- An echo job in the batch generator (4 slots, small prefill chunks, other jobs decoding beside
  it) gives exactly Engine.score's numbers (==, not approx: the rows are bit-exact whatever
  shares the call), then the same tokens Engine.complete gives; max_tokens 0 scores only.
- On the fake backends of test_serve_batch, both scheduler paths (prefill + step_batch, and
  step_rows) score the prompt as the fake model's logits say, with no cross-talk.
- A live `cflow serve`: lm-eval's exact request shape (echo, logprobs=1, max_tokens 0 and 1,
  temperature 0, the prompt as text, as token ids, and as a batch of one token list) answers
  with the prompt's tokens, null first, then Engine.score's logprobs; streamed echo; echo on
  the chat endpoint and a non-boolean echo are 400s naming the field.
"""

from __future__ import annotations

import json
import queue

import numpy as np
import pytest

from cflow.runtime import DEFAULT_MODEL, Engine
from cflow.runtime.score import Scores, token_logprobs
from cflow.sampling import SamplingParams
from cflow.serve.batch import BatchGenerator, Failed, Finished, Piece, Prompt

needs_builtin = pytest.mark.skipif(not DEFAULT_MODEL.is_file(), reason="built-in model not installed")
TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play in the park with her dog. "
        "One day, the dog saw a big red ball under a tree. Lily laughed and ran after it. The sun was warm, "
        "the birds sang, and her mom called them home for cake. They ate it at the big table and then "
        "Lily read a book about a brave little fox who lived in the woods.")


@pytest.fixture(scope="module")
def engine():
    if not DEFAULT_MODEL.is_file():
        pytest.skip("built-in model not installed")
    with Engine.load(threads=1, n_ctx=256) as eng:
        yield eng


def by_hand(engine, ids: list[int]) -> list[float | None]:
    """log p(ids[i] | ids[:i]) from Engine.step, one position at a time (an oracle that shares no
    code with cflow.runtime.score)."""
    engine.reset()
    out: list[float | None] = [None]
    for pos, t in enumerate(ids[:-1]):
        x = engine.step(t, pos).astype(np.float64)
        m = x.max()
        out.append(float(x[ids[pos + 1]] - m - np.log(np.exp(x - m).sum())))
    return out


# ---- the Python API ------------------------------------------------------------------------------
@needs_builtin
def test_engine_score_equals_step_by_step(engine):
    ids = engine.encode(TEXT)
    assert len(ids) > 70  # more than one step_rows chunk (SCORE_ROWS = 64)
    s = engine.score(ids, top=3)
    ref = by_hand(engine, ids)
    assert s.tokens == ids and s.logprobs[0] is None and s.top[0] is None and s.greedy[0] is None
    assert len(s.logprobs) == len(ids)
    for got, want in zip(s.logprobs[1:], ref[1:]):
        assert got == pytest.approx(want, abs=1e-9)
    for lp, top, greedy in zip(s.logprobs[1:], s.top[1:], s.greedy[1:]):
        assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1] and lp <= top[0][1] + 1e-12
        assert greedy == (lp == top[0][1])
    assert s.total(5) == pytest.approx(sum(ref[5:]), abs=1e-7)
    # text is encoded with the model's BOS rule; start skips positions and changes nothing else
    assert engine.score(TEXT).logprobs == s.logprobs
    later = engine.score(ids, start=10)
    assert later.logprobs[:10] == [None] * 10 and later.logprobs[10:] == s.logprobs[10:]
    with pytest.raises(ValueError, match="start"):
        s.total(0)


# ---- the batch generator -------------------------------------------------------------------------
def run(gen, jobs):
    """Submit (prompt, kwargs) jobs at once; return per job (Prompt event or None, tokens, end)."""
    q: queue.SimpleQueue = queue.SimpleQueue()
    for i, (prompt, kw) in enumerate(jobs):
        gen.submit(prompt, lambda ev, i=i: q.put((i, ev)), **kw)
    out = [[None, [], None] for _ in jobs]
    while any(o[2] is None for o in out):
        i, ev = q.get(timeout=60)
        if isinstance(ev, Prompt):
            assert out[i][0] is None and not out[i][1], "one Prompt event, before any Piece"
            out[i][0] = ev
        elif isinstance(ev, Piece):
            out[i][1].append(ev.token)
        else:
            assert isinstance(ev, (Finished, Failed))
            out[i][2] = ev
    return out


@needs_builtin
def test_echo_jobs_equal_engine_score_beside_decoding_jobs(engine):
    ids = engine.encode(TEXT)
    short = engine.encode("The little dog")
    ref = engine.score(ids, top=2)
    greedy = engine.complete(ids, 5, temperature=0).tokens
    with BatchGenerator.load(parallel=4, threads=1, n_ctx=256, prefill_chunk=8) as gen:
        gen.complete_many(["The little dog ran to the park"], 4, temperature=0)  # leave a cached prefix
        res = run(gen, [(short, dict(max_tokens=40, params=None)),
                        (ids, dict(max_tokens=0, logprobs=2, echo=True)),
                        (short, dict(max_tokens=30)),
                        (ids, dict(max_tokens=5, logprobs=0, echo=True, params=SamplingParams(temperature=0)))])
    for k in (0, 2):
        assert res[k][0] is None  # not echo: no Prompt event
    scored, then = res[1], res[3]
    for r, top in ((scored, 2), (then, 0)):
        assert isinstance(r[2], Finished), r[2]
        s = r[0].scores
        assert s.tokens == ids and s.logprobs == ref.logprobs  # exactly
        assert s.top == [None] + [t[:top] for t in ref.top[1:]]
    assert scored[1] == [] and scored[2].reason == "length" and scored[2].completion_tokens == 0
    assert scored[2].cached_tokens == 0  # echo reuses no cached prefix (it needs every position's logits)
    assert then[1] == greedy and then[2].completion_tokens == 5


# ---- the fake backends: both scheduler paths -----------------------------------------------------
def fake_scores(prompt: list[int], top: int, vocab: int = 50) -> Scores:
    from test_serve_batch import next_token

    out = Scores(list(prompt), [None], [None], [None])
    for i in range(1, len(prompt)):
        x = np.zeros(vocab, np.float32)
        x[next_token(prompt[:i], vocab)] = 10.0
        lp, alts = token_logprobs(x, prompt[i], top)
        out.logprobs.append(lp)
        out.top.append(alts)
    return out


@pytest.mark.parametrize("rows", [False, True])
def test_echo_on_both_scheduler_paths(rows):
    from test_serve_batch import FakeBackend, FakeRowsBackend, reference

    prompts = [[5 + (i * 7 + j) % 40 for j in range(11 + 3 * i)] for i in range(5)]
    backend = FakeRowsBackend(n_slots=3, max_rows=6) if rows else FakeBackend(n_slots=3)
    with BatchGenerator(backend, prefill_chunk=4) as gen:
        res = run(gen, [(p, dict(max_tokens=6, logprobs=1, echo=i % 2 == 0, ignore_eos=True))
                        for i, p in enumerate(prompts)])
    for i, (p, (ev, toks, end)) in enumerate(zip(prompts, res)):
        assert isinstance(end, Finished) and toks == reference(p, 6)
        if i % 2:
            assert ev is None
            continue
        want = fake_scores(p, 1)
        assert ev.scores.logprobs == want.logprobs and ev.scores.top == want.top


# ---- the server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live():
    pytest.importorskip("starlette", reason="the serve extra is not installed: pip install 'cflow-lm[serve]'")
    pytest.importorskip("uvicorn", reason="the serve extra is not installed: pip install 'cflow-lm[serve]'")
    if not DEFAULT_MODEL.is_file():
        pytest.skip("built-in model not installed")
    from test_serve import Live

    server = Live("-np", "2", "-c", "512", "-t", "1")
    yield server
    server.stop()


def post(live, body, path="/v1/completions"):
    from test_serve import request

    status, _, raw = request(live, "POST", path, body, key=None)
    return status, json.loads(raw)


@needs_builtin
def test_lm_eval_request_shape(live, engine):
    """What lm-eval's local-completions sends for a loglikelihood request: the context and the
    continuation as one prompt, echo, logprobs 1, max_tokens 1 (it drops the generated token:
    token_logprobs[ctxlen:-1]) or 0, temperature 0."""
    context, continuation = "Once upon a time, there was a little", " girl named Lily."
    ctx = engine.encode(context)
    whole = engine.encode(context + continuation)
    assert whole[:len(ctx)] == ctx
    ref = engine.score(whole, top=1)
    for prompt in (context + continuation, whole, [whole]):
        for max_tokens in (0, 1):
            status, r = post(live, {"model": "default.cflow", "prompt": prompt, "echo": True, "logprobs": 1,
                                    "max_tokens": max_tokens, "temperature": 0, "seed": 1234})
            assert status == 200, r
            c = r["choices"][0]
            lp = c["logprobs"]
            n = len(whole) + max_tokens
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert lp["token_logprobs"][:len(whole)] == ref.logprobs  # the JSON round trip of a float is exact
            for got, want in zip(lp["top_logprobs"][1:len(whole)], ref.top[1:]):
                assert list(got.values()) == [want[0][1]]
            loglik = sum(lp["token_logprobs"][len(ctx):len(whole)])
            assert loglik == pytest.approx(ref.total(len(ctx)), abs=1e-9)
            assert c["text"].startswith(context + continuation)
            assert r["usage"]["prompt_tokens"] == len(whole) and r["usage"]["completion_tokens"] == max_tokens
            assert c["finish_reason"] == "length"
    # without logprobs: the text is echoed, logprobs null
    status, r = post(live, {"prompt": context, "echo": True, "max_tokens": 3, "temperature": 0})
    assert status == 200 and r["choices"][0]["logprobs"] is None
    assert r["choices"][0]["text"] == context + engine.complete(context, 3, temperature=0).text


@needs_builtin
def test_echo_streamed_and_bad_echo(live, engine):
    from test_serve import request

    prompt = "The little dog"
    ids = engine.encode(prompt)
    ref = engine.score(ids, top=1)
    status, _, raw = request(live, "POST", "/v1/completions",
                             {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0,
                              "stream": True}, key=None)
    assert status == 200
    chunks = [json.loads(line[6:]) for line in raw.decode().split("\n\n") if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"] == prompt and first["logprobs"]["token_logprobs"] == ref.logprobs
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == prompt + engine.complete(prompt, 4, temperature=0).text
    for path, body, code in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "echo": True},
                              "unsupported_parameter"),
                             ("/v1/completions", {"prompt": "Hi", "echo": "yes"}, "invalid_type")):
        status, r = post(live, body, path)
        assert status == 400 and r["error"]["param"] == "echo" and r["error"]["code"] == code, r


@needs_builtin
def test_tokenizer_routes(live, engine):
    """vLLM's /tokenize, /detokenize and /tokenizer_info (lm-eval's remote tokenizer backend)."""
    from test_serve import request

    tok = engine.tokenizer
    status, r = post(live, {"prompt": TEXT, "add_special_tokens": False}, "/tokenize")
    assert status == 200 and r["tokens"] == engine.encode(TEXT, add_bos=False) and r["count"] == len(r["tokens"])
    status, r2 = post(live, {"content": TEXT}, "/tokenize")  # llama-server's field; the model's BOS rule
    assert status == 200 and r2["tokens"] == engine.encode(TEXT)
    status, d = post(live, {"tokens": r["tokens"]}, "/detokenize")
    assert status == 200 and d["prompt"] == TEXT == tok.decode(r["tokens"])
    status, _, raw = request(live, "GET", "/tokenizer_info", key=None)
    info = json.loads(raw)
    assert status == 200 and info["eos_token"] == tok.token_to_piece(tok.eos_id)
    assert post(live, {"prompt": info["eos_token"], "add_special_tokens": False}, "/tokenize")[1]["tokens"] == \
        [tok.eos_id]
    for path, body, param in (("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
                              ("/detokenize", {"tokens": [1, -1]}, "tokens"), ("/detokenize", {}, "tokens")):
        status, r = post(live, body, path)
        assert status == 400 and r["error"]["param"] == param, (path, body, r)
