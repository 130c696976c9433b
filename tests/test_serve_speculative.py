"""Speculative decoding per request inside continuous batching (cflow.serve.speculate, cflow.serve.batch).

- greedy, on SmolLM2 (an input-grounded prompt the n-gram lookup copies from): several jobs at once,
  some speculating and some not, with stop strings and max_tokens that cut inside an accepted run,
  logprobs, penalties, prompts sharing a prefix: each job's text, tokens and logprobs are what the
  same job gives without speculation and what Engine.complete gives; the slots hold only accepted
  tokens (the scheduler's record equals the engine's), and a repeated prompt reuses its slot's
  cache after the rollbacks and still gives the same text; the reference backend (EngineSlots)
  too; proposals fit the rows a pass has left (max_rows);
- acceptance happens: proposals are accepted and the step_rows calls are fewer than the tokens;
- sampling: 1000 seeded jobs of 3 tokens, token 2 verified against the lookup's proposal, give
  tokens 2 and 3 with plain sampling's exact joint distribution (chi-square against the joint
  enumerated with the engine, penalties included), on a small random model (nearly every proposal
  rejected: the residual path) and on SmolLM2 repeating a paragraph (nearly every one kept: the
  bonus path); a wrong rule (keep every proposal; keep none) fails the same test; and a seeded
  job draws exactly what Engine.complete with the same speculative settings draws;
- through a live `cflow serve --spec ngram`: its answers equal a plain server's, the request
  field turns speculation on and off, bad values get 400 naming the field, /metrics counts the
  proposed and accepted tokens; "draft" without a draft model and "mtp" without heads get 400;
- a draft model (random target, a noisy copy as draft): several jobs at once, greedy ones give
  plain greedy's tokens and seeded sampled ones exactly what Engine.complete with the same draft
  draws (same proposal counts), at 1 and 2 threads; the draft's calls serve all drafting jobs
  together; a failing draft ends only its jobs; the draft's slots follow the accepted text;
  through a live `cflow serve --model-draft`: answers equal the plain server's, metrics count;
- what a generator or `cflow serve` cannot run is refused by name (no draft model, no heads, a
  draft of another vocabulary, the reference backend for heads), the CLI before listening.
(The heads in the server: tests/test_mtp.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cflow.runtime import Engine, Speculative, SpeculativeError
from cflow.runtime import speculative as sp
from cflow.sampling import SamplingParams
from cflow.serve.backend import EngineSlots, load_backend
from cflow.serve.batch import BatchGenerator, Failed
from cflow.serve.protocol import BadRequest, Defaults, parse_chat, parse_completion

from test_serve_batch import run_job_events

PASSAGE = ("Photosynthesis is the process by which green plants use sunlight to make food from carbon dioxide and "
           "water. It takes place in the chloroplasts, which contain the green pigment chlorophyll. Oxygen is "
           "released as a by-product. Almost all life on Earth depends on this process, directly or indirectly.")
GROUNDED = [{"role": "user", "content": f"Repeat the following paragraph exactly, word for word:\n\n{PASSAGE}"}]
# shares GROUNDED's chat prefix (the template's system prompt and the start of the message)
GROUNDED_2 = [{"role": "user", "content": f"Repeat the following paragraph exactly, word for word:\n\n{PASSAGE[:150]}"}]
FREE = [{"role": "user", "content": "Write a short poem about the sea."}]
N = 80


# ---- SmolLM2 ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol(smollm2_converted):
    with Engine.load(smollm2_converted, threads=1, n_ctx=512) as eng:
        yield smollm2_converted, eng


def run_jobs(gen, jobs):
    """test_serve_batch.run_job_events (the Pieces and the end event of each job), none failed."""
    pieces, ends = run_job_events(gen, jobs, timeout=120)
    for end in ends:
        assert not isinstance(end, Failed), end.error
    return pieces, ends


def text_of(pieces, end) -> str:
    return "".join(p.text for p in pieces) + end.tail


def check_slots(gen, texts) -> None:
    """Every slot's record is the engine's, and holds only tokens of a text that ran (accepted ones):
    a prefix of some prompt + output, plus at most the stop id that ended it (it ran, as a kept
    proposal, before it ended the sequence)."""
    stops = gen.backend.tokenizer.stop_ids
    for slot in range(gen.n_slots):
        held = gen._slot_tokens[slot]
        assert held == gen.backend.engine.cached(slot)
        if held:
            assert any(held == t[:len(held)] or (held[:-1] == t and held[-1] in stops) for t in texts), slot


def test_greedy_jobs_with_and_without_speculation_equal_engine_complete(smol):
    path, eng = smol
    ids, ids2, free = eng.chat_tokens(GROUNDED), eng.chat_tokens(GROUNDED_2), eng.chat_tokens(FREE)
    ref = eng.complete(ids, N, temperature=0)
    assert ref.finish_reason == "stop" and len(ref.tokens) > 40
    # a stop string and a max_tokens that fall inside the copied passage (one long accepted run)
    cut = ref.text.index("chlorophyll")
    greedy = SamplingParams(temperature=0)
    penal = SamplingParams(temperature=0, repeat_penalty=1.2, frequency_penalty=0.2)
    cases = [(ids, dict(speculative="ngram")), (ids, dict()),
             (ids, dict(stop=["chlorophyll"], speculative="ngram")), (ids, dict(stop=["chlorophyll"])),
             (ids, dict(max_tokens=23, speculative="ngram")), (ids2, dict(speculative="ngram")),
             (free, dict(speculative="ngram")), (ids, dict(logprobs=3, speculative="ngram")),
             (ids, dict(logprobs=3)), (ids, dict(params=penal, speculative="ngram")),
             (ids, dict(speculative=Speculative("ngram", draft_max=3, adaptive=False, min_acceptance=0)))]
    jobs = [(p, {"max_tokens": N, "params": greedy, **kw}) for p, kw in cases]
    with BatchGenerator.load(path, parallel=4, threads=1, n_ctx=512, prefill_chunk=16) as gen:
        pieces, ends = run_jobs(gen, jobs)
        texts = []
        for (p, kw), ps, end in zip(jobs, pieces, ends):
            toks = [x.token for x in ps]
            texts.append(p + toks)
            want = eng.complete(p, kw["max_tokens"], temperature=0, stop=kw.get("stop", ()),
                                **({"repeat_penalty": 1.2, "frequency_penalty": 0.2} if kw["params"] is penal else {}))
            assert (toks, text_of(ps, end), end.reason) == (want.tokens, want.text, want.finish_reason), kw
            assert end.completion_tokens == len(toks) and end.accepted <= end.drafted
            if "speculative" not in kw:
                assert end.drafted == 0
            elif p is not free and kw["params"] is greedy:  # (the penalties end the answer early)
                assert end.drafted > 0, kw
        assert ends[2].reason == "stop" and text_of(pieces[2], ends[2]) == ref.text[:cut]
        assert ends[4].reason == "length" and len(pieces[4]) == 23
        assert ends[0].accepted > 30 and ends[1].drafted == 0
        # logprobs: each emitted token's own row, as without speculation
        assert [(x.token, x.logprob, x.top) for x in pieces[7]] == [(x.token, x.logprob, x.top) for x in pieces[8]]
        check_slots(gen, texts)
        # the same prompt again reuses its slot's cache (all but the last prompt token) after the rollbacks
        (again,), (end,) = run_jobs(gen, [(ids, dict(max_tokens=N, params=greedy, speculative="ngram"))])
        assert [x.token for x in again] == ref.tokens and end.cached_tokens == len(ids) - 1
        check_slots(gen, texts)


def test_acceptance_and_fewer_calls_than_tokens(smol):
    path, eng = smol
    ids = eng.chat_tokens(GROUNDED)
    backend = load_backend(path, n_slots=2, threads=1, n_ctx=512)
    rows: list[int] = []
    inner = backend.step_rows

    def counted(slots, tokens, positions, want):
        rows.append(len(slots))
        return inner(slots, tokens, positions, want)

    backend.step_rows = counted
    with BatchGenerator(backend) as gen:
        calls = {}
        for spec in (None, "ngram"):
            rows.clear()
            (ps,), (end,) = run_jobs(gen, [(ids, dict(max_tokens=N, params=SamplingParams(temperature=0),
                                                      speculative=spec))])
            calls[spec] = len(rows)
        assert end.completion_tokens == len(ps) > 40
        assert end.drafted > 0 and end.accepted > 30 and end.accepted / end.drafted > 0.7
        # (the second job reuses the first's prompt: one call for its last token, then the decode calls)
        assert calls["ngram"] < len(ps) / 3 < len(ps) <= calls[None]
        assert max(rows) > 1
        # a constrained job does not speculate (its masks go token by token)
        from cflow.constrain import ConstraintSpec

        (ps,), (end,) = run_jobs(gen, [(ids, dict(max_tokens=20, params=SamplingParams(temperature=0),
                                                  speculative="ngram",
                                                  constraint=ConstraintSpec("regex", "[A-Za-z ,.]+")))])
        assert end.drafted == 0 and len(ps) > 0


def test_reference_backend_and_row_cap(smol):
    path, eng = smol
    ids = eng.chat_tokens(GROUNDED)
    want = eng.complete(ids, N, temperature=0).tokens
    with BatchGenerator(EngineSlots.load(path, n_slots=2, threads=1, n_ctx=512)) as gen:
        (ps,), (end,) = run_jobs(gen, [(ids, dict(max_tokens=N, params=SamplingParams(temperature=0),
                                                  speculative="ngram"))])
        assert [x.token for x in ps] == want and end.accepted > 30
        assert gen._slot_tokens[0] == gen.backend.engines[0].cached(0)
    # a pass of at most 7 rows: 3 decode rows and a prompt chunk of up to 4 leave few rows to proposals
    backend = load_backend(path, n_slots=3, threads=1, n_ctx=512)
    rows: list[int] = []
    inner = backend.step_rows
    backend.step_rows = lambda s, t, p, w: rows.append(len(s)) or inner(s, t, p, w)
    with BatchGenerator(backend, prefill_chunk=4) as gen:
        gen._max_rows = 7
        jobs = [(ids, dict(max_tokens=N, params=SamplingParams(temperature=0), speculative="ngram"))] * 3
        pieces, ends = run_jobs(gen, jobs)
    assert all([x.token for x in ps] == want for ps in pieces)
    assert max(rows) <= 7 and sum(e.drafted for e in ends) > 0


# ---- sampling: the target's distribution ----------------------------------------------------------
@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    from test_speculative import _write

    return _write(tmp_path_factory.mktemp("spec-serve") / "target.cflow", 0, max_seq_len=512)


N_SEEDS = 1000
N_WRONG = 300
# one-token matches and never paused: a job's second token is verified whenever its first one occurs earlier
LOOKUP = Speculative("ngram", ngram_min=1, min_acceptance=0)


def _sampled(gen, prompt, n: int) -> tuple[dict[tuple[int, int], int], int, int]:
    """Tokens 2 and 3 of n seeded jobs of 3 tokens: their counts, the proposals judged and kept."""
    from test_speculative import SAMPLE_PARAMS

    counts: dict[tuple[int, int], int] = {}
    drafted = accepted = 0
    for first in range(0, n, 100):  # the queue holds 256
        jobs = [(prompt, dict(max_tokens=3, ignore_eos=True, speculative=LOOKUP,
                              params=SamplingParams(**SAMPLE_PARAMS, seed=seed)))
                for seed in range(first, min(n, first + 100))]
        pieces, ends = run_jobs(gen, jobs)
        for ps in pieces:
            key = (ps[1].token, ps[2].token)
            counts[key] = counts.get(key, 0) + 1
        drafted += sum(e.drafted for e in ends)
        accepted += sum(e.accepted for e in ends)
    return counts, drafted, accepted


@pytest.mark.parametrize("model", ["random", "smollm2"])
def test_sampling_has_the_target_distribution(model, request, monkeypatch):
    """Token 1 is sampled plainly, token 2 verified against the lookup's proposal (when token 1
    occurs in the prompt), token 3 the bonus (from the block's second row) or a plain row. On a
    random model over a prompt holding every token once, every job verifies and nearly every
    proposal is rejected (the residual path); on SmolLM2 repeating a paragraph, most proposals
    are kept (the bonus path). Either way tokens 2 and 3 have plain sampling's exact joint
    distribution, and a wrong rule (random: keep every proposal; SmolLM2: keep none) does not."""
    from test_speculative import SAMPLE_PARAMS, _chi2, _exact_joint

    if model == "random":
        from test_speculative import NGRAM_PROMPT as prompt

        path = request.getfixturevalue("random_model")
        eng = Engine.load(path, threads=1)
        wrong = 1.0
    else:
        path, eng = request.getfixturevalue("smol")
        prompt = eng.chat_tokens(GROUNDED)
        wrong = 0.0
    exact = _exact_joint(eng, prompt, SamplingParams(**SAMPLE_PARAMS))
    # a seeded job draws what the single-sequence loop draws with the same settings and seed
    refs = [eng.complete(prompt, 24, seed=s, speculative=LOOKUP, ignore_eos=True, **SAMPLE_PARAMS) for s in range(3)]
    if model == "random":
        eng.close()
    with BatchGenerator.load(path, parallel=4, threads=1, n_ctx=512) as gen:
        pieces, ends = run_jobs(gen, [(prompt, dict(max_tokens=24, ignore_eos=True, speculative=LOOKUP,
                                                    params=SamplingParams(**SAMPLE_PARAMS, seed=s)))
                                      for s in range(3)])
        for ps, end, ref in zip(pieces, ends, refs):
            assert [x.token for x in ps] == ref.tokens
            assert (end.drafted, end.accepted) == (ref.timings.drafted, ref.timings.accepted)
        counts, drafted, accepted = _sampled(gen, prompt, N_SEEDS)
        if model == "random":
            assert drafted == N_SEEDS and accepted < N_SEEDS / 10
        else:
            assert drafted > N_SEEDS / 2 and accepted > 0.9 * drafted
        stat, crit = _chi2(counts, exact, N_SEEDS)
        assert stat < crit, (stat, crit)
        monkeypatch.setattr(sp, "accept_probability", lambda px, qx: wrong)
        counts, _, _ = _sampled(gen, prompt, N_WRONG)
        stat, crit = _chi2(counts, exact, N_WRONG)
        assert stat > 3 * crit, (stat, crit)


# ---- a draft model ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft_pair(tmp_path_factory):
    """test_speculative's random target and a draft that agrees with it often (its weights with
    noise on the final norm), and a draft with another vocabulary."""
    from test_speculative import _write

    d = tmp_path_factory.mktemp("spec-serve-draft")
    return (_write(d / "target.cflow", 0, max_seq_len=512), _write(d / "draft.cflow", 0, noise=0.1, max_seq_len=512),
            _write(d / "other.cflow", 2, vocab_size=320, max_seq_len=512))


DRAFT_PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [40, 41, 42], list(range(60, 110)), [5, 6, 7, 8]]


def check_draft_slots(gen) -> None:
    """The draft's record of each slot is the draft engine's own, and a prefix of some text the
    target's slot holds or held (the draft follows the accepted text)."""
    dr = gen.speculation.draft
    for slot in range(gen.n_slots):
        assert dr.held[slot] == dr.engine.cached(slot), slot


@pytest.mark.parametrize("threads", [1, 2])
def test_draft_model_greedy_and_seeded_jobs_equal_engine_complete(draft_pair, threads):
    """Several jobs at once through a draft model, some plain: greedy jobs give plain greedy's
    tokens; seeded sampled jobs (penalties included) draw exactly what Engine.complete with the
    same draft model and seed draws, with the same proposal counts; the draft's slots follow."""
    from test_speculative import SAMPLE_PARAMS

    target, draft, _ = draft_pair
    spec = Speculative(draft=draft, min_acceptance=0)  # the path stands for the generator's draft model
    with Engine.load(target, threads=1) as eng, Engine.load(draft, threads=1) as d:
        ref_spec = Speculative(draft=d, min_acceptance=0)
        greedy = [eng.complete(p, 40, temperature=0, ignore_eos=True).tokens for p in DRAFT_PROMPTS]
        sampled = [eng.complete(p, 30, seed=7 + i, ignore_eos=True, speculative=ref_spec, **SAMPLE_PARAMS)
                   for i, p in enumerate(DRAFT_PROMPTS)]
    with BatchGenerator.load(target, parallel=4, threads=threads, n_ctx=512, model_draft=draft) as gen:
        jobs = [(p, dict(max_tokens=40, ignore_eos=True, params=SamplingParams(temperature=0),
                         speculative=spec if i != 1 else None)) for i, p in enumerate(DRAFT_PROMPTS)]
        pieces, ends = run_jobs(gen, jobs)
        for i, (ps, end) in enumerate(zip(pieces, ends)):
            assert [x.token for x in ps] == greedy[i], i
            assert (end.drafted > 0) == (i != 1)
        assert sum(e.accepted for e in ends) > 20
        check_draft_slots(gen)
        jobs = [(p, dict(max_tokens=30, ignore_eos=True, speculative=spec,
                         params=SamplingParams(**SAMPLE_PARAMS, seed=7 + i))) for i, p in enumerate(DRAFT_PROMPTS)]
        pieces, ends = run_jobs(gen, jobs)
        for ps, end, ref in zip(pieces, ends, sampled):
            assert [x.token for x in ps] == ref.tokens
            assert (end.drafted, end.accepted) == (ref.timings.drafted, ref.timings.accepted)
        assert sum(e.drafted for e in ends) > sum(e.accepted for e in ends) > 0  # kept and rejected both
        check_draft_slots(gen)


def test_draft_model_batches_its_calls_and_a_failure_ends_only_its_jobs(draft_pair):
    """The draft runs one catch-up call and then one call per further proposal for all drafting
    jobs together (not one per job); a draft call that fails ends the drafting jobs with its error
    and the others go on."""
    target, draft, _ = draft_pair
    with BatchGenerator.load(target, parallel=3, threads=1, n_ctx=512, model_draft=draft) as gen:
        backend = gen.speculation.draft.backend
        inner = backend.step_rows
        calls: list[list[int]] = []
        backend.step_rows = lambda s, t, p, w: calls.append(list(s)) or inner(s, t, p, w)
        jobs = [(p, dict(max_tokens=12, ignore_eos=True, params=SamplingParams(temperature=0),
                         speculative=Speculative("draft", draft=draft, draft_max=3, adaptive=False,
                                                 min_acceptance=0))) for p in DRAFT_PROMPTS[:3]]
        run_jobs(gen, jobs)
        assert any(len(set(c)) == 3 for c in calls), "the three jobs' draft rows never shared a call"

        def broken(s, t, p, w):
            raise RuntimeError("draft exploded")

        backend.step_rows = broken
        pieces, ends = run_job_events(gen, [(DRAFT_PROMPTS[0], dict(max_tokens=8, speculative="draft")),
                                            (DRAFT_PROMPTS[1], dict(max_tokens=8))], timeout=60)
        assert isinstance(ends[0], Failed) and "draft exploded" in str(ends[0].error)
        assert not isinstance(ends[1], Failed) and ends[1].completion_tokens == 8


# ---- settings ------------------------------------------------------------------------------------
def test_paused_rows_are_counted_and_the_output_is_unchanged(random_model):
    """A job whose proposals keep losing (a one-token lookup held to 99% acceptance, on a prompt
    with no repeats): its gate pauses, its plain rows are counted (SeqSpec.paused,
    cflow_spec_paused_steps_total), and its tokens are plain greedy's."""
    from cflow.serve.metrics import Metrics

    prompt = list(range(100, 160))
    losing = Speculative("ngram", ngram_min=1, min_acceptance=0.99)
    metrics = Metrics()
    with BatchGenerator(load_backend(random_model, n_slots=1, threads=1, n_ctx=256), metrics=metrics) as gen:
        (plain,), _ = run_jobs(gen, [(prompt, dict(max_tokens=120, params=SamplingParams(temperature=0)))])
        (spec,), (end,) = run_jobs(gen, [(prompt, dict(max_tokens=120, params=SamplingParams(temperature=0),
                                                       speculative=losing))])
    assert [p.token for p in spec] == [p.token for p in plain] and len(plain) > 60
    assert end.drafted > 0 and metrics.spec_rounds >= sp.GATE_WINDOW
    assert metrics.spec_paused > 0
    assert f"cflow_spec_paused_steps_total {metrics.spec_paused}" in metrics.render()


def test_submit_refuses_what_the_generator_cannot_run(random_model, draft_pair):
    from cflow.runtime.mtp import NoMtpHeadsError
    from cflow.runtime.speculative import DraftVocabularyError

    sink = lambda ev: None  # noqa: E731
    with BatchGenerator.load(random_model, parallel=1, threads=1) as gen:
        for bad in ("draft", Speculative("draft", draft="x.gguf")):
            with pytest.raises(SpeculativeError, match="no draft model.*--model-draft"):
                gen.submit([1, 2, 3], sink, speculative=bad)
        for bad in ("mtp", Speculative("mtp")):
            with pytest.raises(NoMtpHeadsError, match="cflow train --mtp"):
                gen.submit([1, 2, 3], sink, speculative=bad)
        for bad in ("fast", 3):
            with pytest.raises(SpeculativeError, match="ngram"):
                gen.submit([1, 2, 3], sink, speculative=bad)
    target, _, other = draft_pair
    with pytest.raises(DraftVocabularyError, match="vocabulary"):
        BatchGenerator.load(target, parallel=1, threads=1, model_draft=other)
    # the reference backend has no hidden states for the heads
    with BatchGenerator(EngineSlots.load(target, n_slots=1, threads=1)) as gen:
        with pytest.raises(SpeculativeError, match="batched backend"):
            gen.submit([1, 2, 3], sink, speculative="mtp")


def test_reference_backend_has_one_engine_accessor_for_speculation(draft_pair):
    """EngineSlots.engine is its first slot's Engine, and speculation's target and the draft checks
    read it: a draft over EngineSlots is checked against the target's vocabulary (the control, a
    draft of another vocabulary, is refused), and a backend with no Engine is refused by name."""
    from cflow.runtime.speculative import DraftVocabularyError
    from cflow.serve.speculate import DraftSlots, Speculation

    target, draft, other = draft_pair
    t = EngineSlots.load(target, n_slots=2, threads=1)
    d = EngineSlots.load(draft, n_slots=2, threads=1)
    o = EngineSlots.load(other, n_slots=2, threads=1)
    try:
        assert t.engine is t.engines[0]
        assert Speculation(t).target is t.engines[0]
        assert DraftSlots(d, t).engine is d.engines[0]
        with pytest.raises(DraftVocabularyError, match="vocabulary"):
            DraftSlots(o, t)

        class NoEngine:
            n_slots = 2
            step_rows = t.step_rows

        with pytest.raises(SpeculativeError, match="Engine backends on both sides"):
            DraftSlots(NoEngine(), t)
        assert Speculation(NoEngine()).target is None
    finally:
        for b in (t, d, o):
            b.close()


def test_request_field_parses():
    d = Defaults()
    on = Defaults(speculative=Speculative("ngram", draft_max=6))
    body = {"prompt": "x"}
    assert parse_completion(body, d).speculative is None
    assert parse_completion(body, on).speculative == on.speculative
    assert parse_completion({**body, "speculative": "off"}, on).speculative is None
    assert parse_completion({**body, "speculative": False}, on).speculative is None
    assert parse_completion({**body, "speculative": "ngram"}, d).speculative == Speculative("ngram")
    assert parse_completion({**body, "speculative": True}, on).speculative == on.speculative
    got = parse_chat({"messages": [{"role": "user", "content": "x"}], "speculative": {"n_max": 3, "n_min": 2}}, on)
    assert got.speculative == Speculative("ngram", draft_max=3, draft_min=2)
    # "draft" and "mtp" go to the generator by name, or as the server's default when it is that proposer
    assert parse_completion({**body, "speculative": "draft"}, on).speculative == "draft"
    assert parse_completion({**body, "speculative": "mtp"}, d).speculative == "mtp"
    drafting = Defaults(speculative=Speculative("draft", draft="small.gguf", draft_max=5))
    assert parse_completion({**body, "speculative": "draft"}, drafting).speculative == drafting.speculative
    assert parse_completion({**body, "speculative": {"n_max": 2}}, drafting).speculative == \
        Speculative("draft", draft="small.gguf", draft_max=2)
    for bad in ("yes", "Draft", 3, [], {"n_max": 0}, {"n_max": 100}, {"n_max": "4"}, {"p_min": 0.5},
                {"n_max": 2, "n_min": 3}):
        with pytest.raises(BadRequest) as e:
            parse_completion({**body, "speculative": bad}, d)
        assert e.value.param == "speculative" and e.value.status == 400, bad
    # llama-server's flat keys read as the object; with the object too, or wrong, a named 400
    flat = parse_completion({**body, "speculative.n_max": 3, "speculative.n_min": 2}, d).speculative
    assert flat == Speculative("ngram", draft_max=3, draft_min=2)
    assert parse_completion({**body, "speculative.n_max": 4}, on).speculative == Speculative("ngram", draft_max=4)
    for bad in ({"speculative.n_max": 0}, {"speculative.p_min": 0.5}, {"speculative.n_max": 3, "speculative": "ngram"}):
        with pytest.raises(BadRequest) as e:
            parse_completion({**body, **bad}, d)
        assert e.value.param == "speculative" and e.value.status == 400, bad


def test_cli_refuses_what_it_cannot_run_before_listening(tmp_path, draft_pair):
    target, draft, other = draft_pair
    cases = ((["--model-draft", "missing.gguf"], "--model-draft", "does not exist"),
             (["--spec", "draft"], "--model-draft", "needs the draft model"),
             (["-m", str(target), "--spec", "mtp"], "", "cflow train --mtp"),
             (["-m", str(target), "--model-draft", str(other)], "", "vocabulary"))
    for args, flag, why in cases:
        r = subprocess.run([sys.executable, "-m", "cflow", "serve", "--port", "0", "-np", "1", "-t", "1", *args],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert r.returncode != 0 and flag in r.stderr and why in r.stderr, (args, r.stderr)


# ---- the live server -----------------------------------------------------------------------------
def test_live_server_speculates_per_request(smol):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from test_serve import KEY, Live, metrics, request

    path, eng = smol
    plain_srv = Live("-m", str(path), "-np", "2", "-t", "1", "-c", "1024", "--api-key", KEY)
    spec_srv = None
    try:
        spec_srv = Live("-m", str(path), "-np", "2", "-t", "1", "-c", "1024", "--api-key", KEY, "--spec", "ngram")

        def ask(srv, extra=None, route="/v1/chat/completions", **kw):
            body = ({"messages": GROUNDED} if route.endswith("chat/completions") else
                    {"prompt": PASSAGE + "\n\n" + PASSAGE[:60]})
            body.update(max_tokens=60, temperature=0, **(extra or {}))
            status, _, raw = request(srv, "POST", route, body, key=KEY, **kw)
            return status, json.loads(raw)

        def text(r):
            c = r["choices"][0]
            return c["message"]["content"] if "message" in c else c["text"]

        def drafted(srv):
            return metrics(srv)["cflow_spec_draft_tokens_total"]

        answers = {}
        for route in ("/v1/completions", "/v1/chat/completions"):
            s1, plain = ask(plain_srv, route=route)
            s2, spec = ask(spec_srv, route=route)
            assert s1 == s2 == 200 and text(plain) == text(spec)
            details = spec["usage"].pop("completion_tokens_details")  # the speculation's count, plain has none
            assert plain["usage"] == spec["usage"] and "completion_tokens_details" not in plain["usage"]
            assert details["accepted_prediction_tokens"] > 0 and details["rejected_prediction_tokens"] >= 0
            answers[route] = text(plain)
        m = metrics(spec_srv)
        assert m["cflow_spec_draft_tokens_total"] > 0 and m["cflow_spec_accepted_tokens_total"] > 0
        assert m["cflow_spec_rounds_total"] > 0 and drafted(plain_srv) == 0
        # the field: off on the speculating server, on (and with n_max) on the plain one
        before = drafted(spec_srv)
        assert text(ask(spec_srv, {"speculative": "off"})[1]) == text(plain)  # (the chat answer)
        assert drafted(spec_srv) == before
        assert text(ask(plain_srv, {"speculative": "ngram"})[1]) == text(plain) and drafted(plain_srv) > 0
        before = drafted(plain_srv)
        assert text(ask(plain_srv, {"speculative": {"n_max": 2}})[1]) == text(plain)
        assert drafted(plain_srv) > before
        # streamed, with logprobs: the same text
        status, _, raw = request(spec_srv, "POST", "/v1/completions",
                                 {"prompt": PASSAGE + "\n\n" + PASSAGE[:60], "max_tokens": 60, "temperature": 0,
                                  "stream": True, "logprobs": 2}, key=KEY)
        chunks = [json.loads(x[6:]) for x in raw.decode().split("\n\n") if x.startswith("data: {")]
        assert status == 200 and "".join(c["choices"][0]["text"] for c in chunks) == answers["/v1/completions"]
        for bad in ("draft", "mtp", 7, {"n_max": 0}, {"q": 1}):  # no draft model, no heads
            status, err = ask(spec_srv, {"speculative": bad})
            assert status == 400 and err["error"]["param"] == "speculative", err
    finally:
        plain_srv.stop()
        if spec_srv is not None:
            spec_srv.stop()


def test_live_server_speculates_with_a_draft_model(draft_pair):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from test_serve import KEY, Live, metrics, request

    target, draft, _ = draft_pair
    srv = Live("-m", str(target), "-np", "2", "-t", "1", "-c", "1024", "--api-key", KEY, "--model-draft", str(draft))
    try:
        def ask(extra):
            status, _, raw = request(srv, "POST", "/v1/completions",
                                     {"prompt": DRAFT_PROMPTS[0], "max_tokens": 40, "temperature": 0,
                                      "ignore_eos": True, **extra}, key=KEY)
            assert status == 200, raw
            return json.loads(raw)

        plain = ask({"speculative": "off"})
        assert metrics(srv)["cflow_spec_draft_tokens_total"] == 0
        for extra in ({}, {"speculative": "draft"}, {"speculative": {"n_max": 3}}):  # the default is the draft
            before = metrics(srv)["cflow_spec_draft_tokens_total"]
            got = ask(extra)
            assert got["choices"][0]["text"] == plain["choices"][0]["text"], extra
            assert got["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
            assert metrics(srv)["cflow_spec_draft_tokens_total"] > before
        status, _, raw = request(srv, "POST", "/v1/completions", {"prompt": "x", "speculative": "mtp"}, key=KEY)
        assert status == 400 and json.loads(raw)["error"]["param"] == "speculative"
    finally:
        srv.stop()
