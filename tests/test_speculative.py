"""Speculative decoding (cflow.runtime.speculative): the output is plain decoding's.

- greedy: token for token what plain greedy decoding gives, for every proposer (n-gram lookup, a
  different random draft model, the model as its own draft: 100% acceptance), at 1 and 2 threads,
  on small random models and on SmolLM2 (an input-grounded prompt, so the n-gram lookup is
  accepted), and on every other kernel table this CPU runs (CFLOW_ISA, in a subprocess);
- sampling: the acceptance rule's output distribution is the target's exactly (computed, not
  sampled: p(x) = q(x) min(1, p/q) + P(reject) residual(x)), and a wrong rule is not; through the
  whole loop, 2000 seeded runs give tokens 2 and 3 with the target's exact joint distribution
  (chi-square against the distribution enumerated with the engine, penalties included), and the
  same test catches a loop run with a wrong rule;
- rollback: after rejections the cache holds exactly the accepted text, and continuing gives what a
  fresh engine gives on that text;
- stop ids, stop strings, max_tokens and the context end inside an accepted block stop where plain
  decoding stops;
- the gate, the timings, the CLI flags, and the named errors for bad settings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cflow import _native
from cflow.bench.claims.models import random_params, small_config, write_random_model
from cflow.runtime import DraftVocabularyError, Engine, Speculative, SpeculativeError
from cflow.runtime import speculative as sp
from cflow.sampling import Sampler, SamplingParams

ROOT = Path(__file__).resolve().parents[1]


# ---- models ------------------------------------------------------------------------------------
def _write(path: Path, seed: int, gain: float = 2.0, noise: float = 0.0, **kw) -> Path:
    """A random model; noise > 0: the seed's weights with noise of that scale on the final norm (a
    draft whose distributions overlap the target's: it agrees often, but not always)."""
    cfg = small_config("llama", **kw)
    # gain > 1: logits spread enough that sampling is far from uniform and greedy has few near-ties
    params = random_params(cfg, seed, gain=gain)
    if noise:  # on the final norm's weights only: the layers are chaotic, the logits' mix is not
        rng = np.random.default_rng(seed + 1000)
        w = params["norm.weight"]
        params["norm.weight"] = w + np.float32(noise) * rng.standard_normal(w.shape, dtype=np.float32)
    write_random_model(path, cfg, "q8_0", (128, 256), seed=seed, params=params)
    return path


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("spec")
    return {"target": _write(d / "target.cflow", 0, max_seq_len=512),
            "draft": _write(d / "draft.cflow", 0, noise=0.1, max_seq_len=512),
            "small_draft": _write(d / "small.cflow", 1, n_layers=2, max_seq_len=512),
            "other_vocab": _write(d / "other.cflow", 2, vocab_size=320, max_seq_len=512)}


@pytest.fixture(scope="module")
def engines(paths):
    """Target and draft at 1 thread (the sampling tests), loaded once."""
    t = Engine.load(paths["target"], threads=1)
    d = Engine.load(paths["draft"], threads=1)
    yield t, d
    t.close()
    d.close()


# A prompt whose suffixes recur, so the n-gram lookup proposes from the first token on
PROMPT = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 20, 21, 22, 5, 6, 7, 8, 9]


def _spec(kind: str, paths, threads: int) -> Speculative | str:
    if kind == "ngram":
        # never paused, one-token matches too: random models' text repeats few longer n-grams
        return Speculative("ngram", ngram_min=1, min_acceptance=0)
    name = kind if kind in ("draft", "small_draft") else "target"
    return Speculative(draft=Engine.load(paths[name], threads=threads), min_acceptance=0)


# ---- greedy: token for token -------------------------------------------------------------------
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["ngram", "draft", "small_draft", "self"])
def test_greedy_is_plain_greedy_token_for_token(paths, kind, threads):
    eng = Engine.load(paths["target"], threads=threads)
    spec = _spec(kind, paths, threads)
    # (at 2 threads one prompt: two engines' spinning workers share the cores, slow on a busy machine)
    cases = ((PROMPT, 80), (PROMPT[:3], 40), (list(range(40, 90)), 60)) if threads == 1 else ((PROMPT, 50),)
    for prompt, n in cases:
        plain = eng.complete(prompt, n, temperature=0)
        got = eng.complete(prompt, n, temperature=0, speculative=spec)
        assert got.tokens == plain.tokens and got.text == plain.text
        assert got.finish_reason == plain.finish_reason
        t = got.timings
        assert t.spec == ("ngram" if kind == "ngram" else "draft") and t.drafted > 0 and t.rounds > 0
        assert t.gen_tokens == plain.timings.gen_tokens
        if kind == "self":  # its own draft: the same logits bit for bit, so everything is accepted
            assert t.accepted == t.drafted and t.acceptance_rate == 1.0
            assert t.mean_accepted > 4
    # penalties and a logit bias see the history at each verified position, as in plain decoding
    kw = dict(temperature=0, repeat_penalty=1.5, repeat_last_n=8, frequency_penalty=0.3,
              logit_bias={plain.tokens[0]: 2.0})
    assert eng.complete(PROMPT, 40, speculative=spec, **kw).tokens == eng.complete(PROMPT, 40, **kw).tokens


def test_smollm2_greedy_is_plain_greedy_and_accepts(smollm2_converted):
    """An input-grounded request (repeat a passage with one change): the n-gram lookup is accepted
    often, and the output, through generate/complete/chat, is plain greedy decoding's."""
    passage = ("The Amazon rainforest covers much of the Amazon basin of South America. The basin "
               "encompasses seven million square kilometres, of which five and a half million are "
               "covered by the rainforest. The region includes territory belonging to nine nations.")
    msgs = [{"role": "user", "content": f"Copy this text exactly, but write 'Amazon' in capitals:\n\n{passage}"}]
    for threads in (1, 2):
        eng = Engine.load(smollm2_converted, threads=threads, n_ctx=512)
        plain = eng.chat(msgs, 70, temperature=0)
        got = eng.chat(msgs, 70, temperature=0, speculative="ngram")
        assert got.tokens == plain.tokens and got.text == plain.text
        assert got.timings.accepted > 10 and got.timings.acceptance_rate > 0.3, got.timings
        streamed = "".join(eng.chat_stream(msgs, 70, temperature=0, speculative="ngram"))
        assert streamed == plain.text
        if threads == 1:  # the model as its own draft: every proposed token accepted
            own = Engine.load(smollm2_converted, threads=1, n_ctx=512)
            c = eng.chat(msgs, 40, temperature=0, speculative=own)
            assert c.tokens == plain.tokens[:40] and c.timings.acceptance_rate == 1.0
            own.close()
        eng.close()


_ISA_SCRIPT = """
import sys
from cflow import _native
from cflow.runtime import Engine, Speculative
print('kernel table:', _native.isa(), flush=True)
path = sys.argv[1]
eng = Engine.load(path, threads=2)
own = Engine.load(path, threads=2)
prompt = %r
plain = eng.complete(prompt, 60, temperature=0)
for spec in (Speculative('ngram', min_acceptance=0), Speculative(draft=own)):
    got = eng.complete(prompt, 60, temperature=0, speculative=spec)
    assert got.tokens == plain.tokens, (spec, got.tokens, plain.tokens)
assert got.timings.acceptance_rate == 1.0
print('identical')
""" % (PROMPT,)


@pytest.mark.parametrize("isa", [i for i in _native.available_isas() if i != _native.isa()] or [
    pytest.param(None, marks=pytest.mark.skip(reason="this CPU runs one kernel table"))])
def test_greedy_identity_on_every_other_kernel_table(paths, isa):
    r = subprocess.run([sys.executable, "-c", _ISA_SCRIPT, str(paths["target"])], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "CFLOW_ISA": isa})
    out = r.stdout + r.stderr
    assert f"kernel table: {isa}\n" in out and r.returncode == 0 and "identical" in out, out[-3000:]


# ---- sampling: exactly the target's distribution -------------------------------------------------
def _output_distribution(p_ids, p, q_ids, q, x=None) -> dict[int, float]:
    """The exact distribution of the token verify() emits: a proposal x ~ q (or the fixed x of a
    point-mass proposer) kept with accept_probability, else a draw from the residual."""
    out: dict[int, float] = {}
    proposals = [(x, 1.0)] if q is None else list(zip(q_ids.tolist(), q.tolist()))
    for y, qy in proposals:
        a = sp.accept_probability(sp.prob_of(p_ids, p, y), 1.0 if q is None else qy)
        out[y] = out.get(y, 0.0) + qy * a
        if a < 1:
            r = sp.residual(p_ids, p, q_ids, q, y)
            r = r / r.sum()
            for i, ri in zip(p_ids.tolist(), r.tolist()):
                out[i] = out.get(i, 0.0) + qy * (1 - a) * ri
    return out


def _max_gap(dist: dict[int, float], p_ids, p) -> float:
    target = dict(zip(p_ids.tolist(), p.tolist()))
    return max(abs(dist.get(i, 0.0) - target.get(i, 0.0)) for i in set(dist) | set(target))


PARAMS = [dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
          dict(temperature=0.7, top_k=12, top_p=0.9, min_p=0.05, repeat_penalty=1.3, presence_penalty=0.2)]


@pytest.mark.parametrize("params", PARAMS)
def test_acceptance_rule_gives_the_target_distribution_exactly(engines, params, monkeypatch):
    target, draft = engines
    pr = SamplingParams(**params)
    hist = list(PROMPT)
    p_ids, p = Sampler(pr).probs(target.eval(hist).copy(), hist)
    q_ids, q = Sampler(pr).probs(draft.eval(hist).copy(), hist)
    assert _max_gap(dict(zip(q_ids.tolist(), q.tolist())), p_ids, p) > 0.05  # the draft really differs
    assert _max_gap(_output_distribution(p_ids, p, q_ids, q), p_ids, p) < 1e-12
    for x in (int(p_ids[0]), int(p_ids[-1]), 299):  # a point-mass proposer, x likely, unlikely, impossible
        assert _max_gap(_output_distribution(p_ids, p, None, None, x), p_ids, p) < 1e-12
    # the computation catches a wrong rule: keeping every proposal, or keeping x with p(x) instead of
    # min(1, p(x)/q(x)) (which is right only for a point mass)
    for wrong in (lambda px, qx: 1.0, lambda px, qx: px):
        monkeypatch.setattr(sp, "accept_probability", wrong)
        assert _max_gap(_output_distribution(p_ids, p, q_ids, q), p_ids, p) > 0.01


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 0.001 (z: the normal's), Wilson-Hilferty (no scipy needed)."""
    h = 2.0 / (9 * df)
    return df * (1 - h + z * np.sqrt(h)) ** 3


def _exact_joint(eng: Engine, prompt: list[int], pr: SamplingParams) -> dict[tuple[int, int], float]:
    """P(tokens 2 and 3 = (b, c)) of plain sampling, enumerated with the engine (penalties see the
    history as plain sampling does)."""
    s = Sampler(pr)
    n = len(prompt)
    ids1, p1 = s.probs(eng.eval(prompt).copy(), prompt)
    joint: dict[tuple[int, int], float] = {}
    for a, pa in zip(ids1.tolist(), p1.tolist()):
        eng.truncate(n)
        h1 = prompt + [a]
        ids2, p2 = s.probs(eng.step(a, n).copy(), h1)
        for b, pb in zip(ids2.tolist(), p2.tolist()):
            eng.truncate(n + 1)
            ids3, p3 = s.probs(eng.step(b, n + 1).copy(), h1 + [b])
            for c, pc in zip(ids3.tolist(), p3.tolist()):
                joint[(b, c)] = joint.get((b, c), 0.0) + pa * pb * pc
    eng.reset()
    return joint


def _chi2(counts: dict, expected: dict[tuple[int, int], float], n: int) -> tuple[float, float]:
    """(statistic, critical value) with cells of expected count < 5 pooled into one."""
    small = [k for k, v in expected.items() if v * n < 5]
    big = [k for k in expected if k not in small]
    obs = [counts.get(k, 0) for k in big] + [sum(counts.get(k, 0) for k in small)
                                            + sum(v for k, v in counts.items() if k not in expected)]
    exp = [expected[k] * n for k in big] + [max(sum(expected[k] for k in small) * n, 1e-9)]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return stat, _chi2_critical(len(obs) - 1)


SAMPLE_PARAMS = dict(temperature=1.0, top_k=6, top_p=1.0, min_p=0.0, repeat_penalty=1.4, repeat_last_n=4)
N_SEEDS = 2000  # runs of the right rule
N_WRONG = 500  # of a wrong one: far enough off that fewer runs show it


@pytest.fixture(scope="module")
def exact(engines):
    target, _ = engines
    return {name: _exact_joint(target, prompt, SamplingParams(**SAMPLE_PARAMS)) for name, prompt in
            (("draft", PROMPT), ("ngram", NGRAM_PROMPT))}


# every token of the vocabulary once: the n-gram lookup always finds the last token and proposes
NGRAM_PROMPT = [int(t) for t in np.random.default_rng(3).permutation(300)]


def _sampled(eng, prompt, spec, n: int) -> dict[tuple[int, int], int]:
    counts: dict[tuple[int, int], int] = {}
    for seed in range(n):
        c = eng.complete(prompt, 3, seed=seed, speculative=spec, ignore_eos=True, **SAMPLE_PARAMS)
        key = tuple(c.tokens[1:3])
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_sampling_through_the_loop_has_the_target_distribution(engines, exact, kind, monkeypatch):
    """2000 seeded runs of 3 tokens: token 1 is sampled plainly, token 2 verified against a proposal
    (the draft's sample, or the n-gram lookup's point mass), token 3 the bonus or a plain step.
    Their joint must be the target's (chi-square at 0.1%); the loop run with the rule 'keep every
    proposal' must fail the same test."""
    target, draft = engines
    prompt = PROMPT if kind == "draft" else NGRAM_PROMPT
    spec = (Speculative(draft=draft, min_acceptance=0) if kind == "draft"
            else Speculative("ngram", ngram_min=1, min_acceptance=0))
    counts = _sampled(target, prompt, spec, N_SEEDS)
    t = target.last_timings
    assert t.rounds == 1 and t.drafted == 1  # (the last run) the second token was verified
    stat, crit = _chi2(counts, exact[kind], N_SEEDS)
    assert stat < crit, (stat, crit)
    monkeypatch.setattr(sp, "accept_probability", lambda px, qx: 1.0)
    stat, crit = _chi2(_sampled(target, prompt, spec, N_WRONG), exact[kind], N_WRONG)
    assert stat > 3 * crit, (stat, crit)


def test_a_seed_reproduces_a_sampled_run(engines):
    target, draft = engines
    for spec in ("ngram", Speculative(draft=draft)):
        kw = dict(temperature=0.9, seed=5, speculative=spec)
        a, b = target.complete(PROMPT, 40, **kw), target.complete(PROMPT, 40, **kw)
        assert a.tokens == b.tokens and a.timings.drafted == b.timings.drafted
        assert target.complete(PROMPT, 40, **{**kw, "seed": 6}).tokens != a.tokens


# ---- rollback ----------------------------------------------------------------------------------
def test_rollback_leaves_the_accepted_text_and_continuing_equals_a_fresh_run(paths):
    eng = Engine.load(paths["target"], threads=1)
    draft = Engine.load(paths["draft"], threads=1)
    c = eng.complete(PROMPT, 50, temperature=0, speculative=Speculative(draft=draft, min_acceptance=0))
    t = c.timings
    assert 0 < t.accepted < t.drafted  # there were rejections to roll back
    text = PROMPT + c.tokens
    # the cache holds the accepted text (all but the last emitted token, which never ran) or less,
    # never a rejected token: its list says what its K/V rows are
    held = eng.cached()
    assert held == text[:len(held)] and len(held) >= len(text) - 2
    # stepping on from there gives a fresh engine's logits bit for bit
    fresh = Engine.load(paths["target"], threads=1)
    fresh.prefill(text[:-1])
    want = fresh.step(text[-1], len(text) - 1).copy()
    eng.truncate(len(text) - 1) if len(held) >= len(text) - 1 else eng.prefill(text[len(held):-1], len(held))
    assert np.array_equal(eng.step(text[-1], len(text) - 1), want)
    # and a generation continuing the text (reusing the cache) equals a fresh engine's
    more = eng.complete(text, 30, temperature=0, speculative=Speculative(draft=draft, min_acceptance=0))
    fresh.reset()
    assert more.tokens == fresh.complete(text, 30, temperature=0).tokens


# ---- where generation stops ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["ngram", "self"])
def test_stops_inside_an_accepted_block_where_plain_decoding_stops(paths, kind):
    eng = Engine.load(paths["target"], threads=1)
    spec = _spec(kind, paths, 1)
    plain = eng.complete(PROMPT, 40, temperature=0)
    # max_tokens at every length: a block is cut where the limit falls
    for n in range(0, 14):
        got = eng.complete(PROMPT, n, temperature=0, speculative=spec)
        assert got.tokens == plain.tokens[:n] and got.finish_reason == "length"
    # a stop string in the middle of the text
    cut = plain.text[len(plain.text) // 2:][:2]
    want = eng.complete(PROMPT, 40, temperature=0, stop=[cut])
    got = eng.complete(PROMPT, 40, temperature=0, stop=[cut], speculative=spec)
    assert (got.text, got.tokens, got.finish_reason) == (want.text, want.tokens, "stop")
    # an end-of-sequence id: the 7th greedy token (its first occurrence)
    eos = plain.tokens[6]
    eng.tokenizer.eos_id = eos
    want = eng.complete(PROMPT, 40, temperature=0)
    got = eng.complete(PROMPT, 40, temperature=0, speculative=spec)
    assert got.tokens == want.tokens == plain.tokens[:plain.tokens.index(eos)] and got.finish_reason == "stop"
    assert got.timings.gen_tokens == want.timings.gen_tokens
    if kind == "self":  # proposals after the stop were never judged: they count as neither
        assert got.timings.accepted == got.timings.drafted > 0
    eng.tokenizer.eos_id = None
    # the end of the context
    small = Engine.load(paths["target"], threads=1, n_ctx=len(PROMPT) + 9)
    spec_small = spec if kind == "ngram" else Speculative(draft=Engine.load(paths["target"], threads=1, n_ctx=24),
                                                          min_acceptance=0)
    want = small.complete(PROMPT, None, temperature=0)
    got = small.complete(PROMPT, None, temperature=0, speculative=spec_small)
    assert got.tokens == want.tokens and len(got.tokens) == 10 and got.finish_reason == "length"


# ---- the gate ------------------------------------------------------------------------------------
def test_gate_pauses_while_acceptance_is_low_and_doubles_the_pause():
    g = sp.Gate(min_rate=0.5, window=4, pause=3, max_pause=10)
    for _ in range(4):
        assert g.open()
        g.record(8, 1)
    assert [g.open() for _ in range(4)] == [False, False, False, True]  # paused 3 steps
    for _ in range(4):
        g.record(8, 0)
    assert g.paused == 6 and g.pause == 10  # failed again: twice as long, then capped
    g.paused = 0
    for _ in range(4):
        g.record(8, 6)
    assert g.paused == 0 and g.pause == 3  # a window that passes resets the pause
    g.record(8, 0)  # one bad round among good ones: the window's rate still passes
    assert g.open()


def test_gate_charges_the_proposal_cost_per_round():
    """A window keeping 3 of 8 proposals a round passes at a row cost of 0.25 alone (3 >= 2), and
    fails once each round's proposal also costs 1.5 steps (3 < 2 + 1.5)."""
    for round_cost, pauses in ((0.0, False), (1.5, True)):
        g = sp.Gate(min_rate=0.25, window=4, pause=3, round_cost=round_cost)
        for _ in range(4):
            g.record(8, 3)
        assert (g.paused > 0) is pauses, round_cost


def test_gate_started_paused_probes_rarely_until_a_window_passes():
    g = sp.Gate(min_rate=0.5, window=2, pause=3, max_pause=10, start_paused=True)
    assert [g.open() for _ in range(11)] == [False] * 10 + [True]  # the longest pause first
    g.record(4, 0)
    g.record(4, 0)
    assert g.paused == 10  # the probe failed: as long again
    g.paused = 0
    g.record(4, 4)
    g.record(4, 4)
    assert g.paused == 0 and g.pause == 3  # the probe passed: the usual pauses from now on
    assert not sp.Gate(0.5).paused  # not asked: open from the start


def test_rounds_lose_compares_every_round_length():
    # head 0 right 58% of the time, all three 21%: a round of k keeps 0.58, 0.92, 1.13
    chain = [0.58, 0.34, 0.21]
    assert sp.rounds_lose(chain, 0.6, 0.0, 3)  # each kept share below 0.6 k
    assert not sp.rounds_lose(chain, 0.5, 0.0, 3)  # k = 1 pays at a row cost of 0.5
    assert sp.rounds_lose(chain, 0.5, 0.1, 3)  # ... until proposing costs 0.1 a round
    assert not sp.rounds_lose(chain, 0.3, 0.3, 3)  # k = 2 pays: 0.92 > 2 x 0.3 + 0.3
    assert not sp.rounds_lose(chain, 0.6, 0.0, 0) and not sp.rounds_lose([], 0.6, 0.0, 3)  # nothing to judge


def test_make_gate_adds_the_heads_cost_and_starts_paused_only_when_they_cannot_pay(monkeypatch):
    monkeypatch.setattr(sp, "engine_row_cost", lambda eng: 0.5)
    monkeypatch.setattr(sp, "engine_heads_cost", lambda eng, heads: 0.2)

    class _Heads:
        chain = [0.58, 0.34, 0.21]

    g = sp.make_gate(Speculative("mtp"), object(), _Heads())
    assert (g.min_rate, g.round_cost) == (0.5, 0.2) and g.paused == sp.GATE_MAX_PAUSE  # 0.58 <= 0.5 + 0.2
    monkeypatch.setattr(sp, "engine_heads_cost", lambda eng, heads: 0.0)
    assert sp.make_gate(Speculative("mtp"), object(), _Heads()).paused == 0  # 0.58 > 0.5: it may pay
    _Heads.chain = None  # heads that recorded nothing (trained with the model): no starting pause
    assert sp.make_gate(Speculative("mtp"), object(), _Heads()).paused == 0
    g = sp.make_gate(Speculative("mtp", min_acceptance=0.0), object(), _Heads())
    assert (g.min_rate, g.round_cost, g.paused) == (0.0, 0.0, 0)  # the setting is taken as it is
    assert sp.make_gate(Speculative("ngram"), object()).round_cost == 0.0


def test_recorded_chain_is_read_only_when_well_formed():
    from cflow.runtime.mtp import recorded_chain

    assert recorded_chain({"val_chain": [0.5, 0.25]}, 2) == [0.5, 0.25]
    assert recorded_chain({"val_chain": [1, 0]}, 2) == [1.0, 0.0]
    for meta in ({"val_chain": [0.5]}, {"val_chain": [0.5, 1.5]}, {"val_chain": [0.5, "x"]}, {"val_chain": None},
                 {}, None, "0.5", {"val_chain": [0.5, True]}):
        assert recorded_chain(meta, 2) is None, meta


def test_call_cost_is_the_ratio_to_a_one_row_call():
    clock = _Clock()
    assert sp.measure_call_cost(clock.call([2.0, 1.0]), clock.call([0.42]), clock=clock) == pytest.approx(0.4)
    assert sp.measure_call_cost(clock.call([1.0]), clock.call([9.0]), clock=clock) == sp.HEADS_COST_MAX


def test_gate_pauses_a_losing_proposer_and_output_is_unchanged(paths):
    eng = Engine.load(paths["target"], threads=1)
    prompt = list(range(100, 160))  # no repeats in the prompt: the lookup's guesses are rarely right
    plain = eng.complete(prompt, 120, temperature=0)
    got = eng.complete(prompt, 120, temperature=0, speculative=Speculative("ngram", ngram_min=1, min_acceptance=0.99))
    assert got.tokens == plain.tokens
    assert got.timings.paused_steps > 0 and got.timings.rounds >= sp.GATE_WINDOW


class _Clock:
    """A clock that the calls it times advance by the cost they are given (no real timing)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def call(self, costs: list[float]):
        def run() -> None:
            self.t += costs.pop(0) if len(costs) > 1 else costs[0]
        return run


def test_row_cost_is_measured_from_a_one_row_and_a_k_row_call():
    clock = _Clock()
    # a one-row call takes 1.0 (a slow first one ignored: the fastest counts); 5 rows 1 + 4 x 0.3
    got = sp.measure_row_cost(clock.call([3.0, 1.0]), clock.call([2.2]), 5, clock=clock)
    assert got == pytest.approx(0.3)
    # the control: a dearer k-row call gives a higher cost, on the grid
    assert sp.measure_row_cost(clock.call([1.0]), clock.call([1 + 4 * 0.46]), 5, clock=clock) == pytest.approx(0.45)
    assert sp.measure_row_cost(clock.call([1.0]), clock.call([0.5]), 5, clock=clock) == 0.0  # kept in [0, 1]
    with pytest.raises(ValueError, match="2 or more rows"):
        sp.measure_row_cost(clock.call([1.0]), clock.call([1.0]), 1, clock=clock)


def test_the_gate_threshold_follows_the_injected_row_cost():
    """At a row cost of 0.46 (a 2-thread step), a proposer accepted 30% of the time pauses; at the
    old constant 0.2 the same counts stay on. A draft model adds its byte share."""
    class _Eng:
        def __init__(self, b: float) -> None:
            self.b = b

        def weight_bytes_per_token(self) -> float:
            return self.b

    ngram = Speculative("ngram")
    for cost, pauses in ((0.46, True), (0.2, False)):
        g = sp.Gate(sp.min_rate(ngram, _Eng(100.0), row_cost=cost), window=4, pause=3)
        for _ in range(4):
            g.record(10, 3)
        assert (g.paused > 0) is pauses, cost
    draft = Speculative.__new__(Speculative)  # a draft setting without loading a draft Engine
    object.__setattr__(draft, "proposer", "draft")
    object.__setattr__(draft, "min_acceptance", None)
    object.__setattr__(draft, "draft", _Eng(10.0))
    assert sp.min_rate(draft, _Eng(100.0), row_cost=0.3) == pytest.approx(0.4)
    assert sp.min_rate(Speculative("ngram", min_acceptance=0.7), _Eng(1.0), row_cost=0.3) == 0.7  # the setting wins
    assert sp.engine_row_cost(_Eng(1.0)) == sp.ROW_COST  # not an Engine: nothing to measure


def test_engine_row_cost_is_measured_once_and_leaves_the_text(paths, monkeypatch):
    eng = Engine.load(paths["target"], threads=1)
    eng.prefill(PROMPT, 0)
    held = eng.cached(0)
    cost = sp.engine_row_cost(eng)
    assert 0.0 <= cost <= 1.0 and cost == pytest.approx(round(cost / sp.ROW_COST_GRID) * sp.ROW_COST_GRID)
    assert eng.cached(0) == held  # the measuring rows were forgotten
    calls = []
    monkeypatch.setattr(sp, "measure_row_cost", lambda *a, **k: calls.append(a) or 0.9)
    assert sp.engine_row_cost(eng) == cost and not calls  # cached per engine and thread count
    assert sp.min_rate(Speculative("ngram"), eng) == cost
    other = Engine.load(paths["target"], threads=1)
    assert sp.engine_row_cost(other) == 0.9 and len(calls) == 1  # another engine measures its own


def test_draft_length_follows_the_accepted_runs():
    d = sp.DraftLength(8, start=4)
    assert d.k == 4
    d.record(4, 4)
    assert d.k == 8  # all kept: twice as many
    d.record(8, 8)
    assert d.k == 8  # at most draft_max
    d.record(8, 2)
    assert d.k == 3  # a rejection: one more than were kept
    d.record(3, 0)
    assert d.k == 1


def test_fixed_length_when_not_adaptive(paths):
    eng = Engine.load(paths["target"], threads=1)
    own = Engine.load(paths["target"], threads=1)
    c = eng.complete(PROMPT, 31, temperature=0, speculative=Speculative(draft=own, draft_max=5, adaptive=False))
    t = c.timings
    assert t.rounds == 5 and t.drafted == 25 and t.accepted == 25  # 1 + 5 x (5 kept + 1 bonus) tokens


# ---- proposers -----------------------------------------------------------------------------------
def test_ngram_proposes_the_latest_match_longest_first_and_extends_loops():
    rng = np.random.default_rng(0)
    p = sp.NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 2, 3], 3, rng)[0] == [7, 2, 3]  # "2 3" latest: followed by 7
    p = sp.NgramProposer(1, 3)
    assert p.propose([2, 3, 8, 1, 2, 3, 9, 2, 3], 2, rng)[0] == [9, 2]  # "2 3": the latest of two matches
    p = sp.NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 8, 5, 2, 3, 9, 1, 2, 3], 2, rng)[0] == [8, 5]  # "1 2 3" before the later "2 3"
    p = sp.NgramProposer(1, 3)
    assert p.propose([5, 6, 5, 6], 5, rng)[0] == [5, 6, 5, 6, 5]  # a loop is proposed as a loop
    assert sp.NgramProposer(2, 3).propose([1, 2, 3, 4], 3, rng)[0] == []  # no match: nothing
    # incremental: the index grows with the text
    p = sp.NgramProposer(1, 2)
    h = [1, 2, 3]
    assert p.propose(h, 2, rng)[0] == []
    h += [1]
    assert p.propose(h, 2, rng)[0] == [2, 3]


def test_ngram_length_follows_the_match():
    """Given k_max (the loop adapts), a match of only ngram_min tokens proposes at most
    SHORT_MATCH_DRAFT (and at most k), a longer one k_max; without k_max, k whatever the match."""
    rng = np.random.default_rng(0)
    short = [7, 2, 3, 4, 5, 6, 1, 8, 2, 3]  # "2 3" matches, "8 2 3" does not
    longer = [1, 2, 3, 4, 5, 6, 1, 8, 1, 2, 3]  # "1 2 3" matches
    edge = [1, 2, 3, 4, 5, 6, 1, 2, 9, 1, 2]  # lookup 2-2: "1 2" matches, and so does the token before
    assert sp.SHORT_MATCH_DRAFT == 2
    assert sp.NgramProposer(2, 3).propose(short, 5, rng, 7)[0] == [4, 5]
    assert sp.NgramProposer(2, 3).propose(short, 1, rng, 7)[0] == [4]
    assert sp.NgramProposer(2, 3).propose(short, 5, rng)[0] == [4, 5, 6, 1, 8]
    assert sp.NgramProposer(2, 3).propose(longer, 1, rng, 6)[0] == [4, 5, 6, 1, 8, 1]
    assert sp.NgramProposer(2, 3).propose(longer, 1, rng)[0] == [4]
    assert sp.NgramProposer(2, 2).propose(edge, 5, rng, 7)[0] == [9, 1]  # "6 1 2" vs "9 1 2": no
    assert sp.NgramProposer(2, 2).propose([9, 1, 2, 3, 4, 5, 6, 7, 9, 1, 2], 1, rng, 4)[0] == [3, 4, 5, 6]


@pytest.mark.parametrize("ngram_min, min_acceptance, prompt", [
    (2, 0.2, PROMPT), (1, 0.2, PROMPT[:3]), (1, 0.99, list(range(100, 160)))])
def test_replay_counts_what_the_loop_does(paths, ngram_min, min_acceptance, prompt):
    """benchmarks/speculative_replay.py replays the loop's policy on a recorded greedy answer: its
    rounds, proposals and kept proposals are the real loop's (the last case's gate pauses)."""
    from bench_scripts import load_benchmark

    replay = load_benchmark("speculative_replay").replay
    eng = Engine.load(paths["target"], threads=1)
    spec = Speculative("ngram", ngram_min=ngram_min, min_acceptance=min_acceptance)
    got = eng.complete(prompt, 90, temperature=0, speculative=spec)
    answer = [int(t) for t in got.tokens]
    assert answer == eng.complete(prompt, 90, temperature=0).tokens
    count_rounds = [0.0] + [1.0] * (sp.DEFAULT_DRAFT_MAX + 1)  # a plain step costs 0, a call 1
    rounds, proposed, kept = replay(lambda: sp.NgramProposer(ngram_min, sp.DEFAULT_NGRAM_MAX), list(prompt), answer,
                                    count_rounds, sp.DEFAULT_DRAFT_MAX, min_acceptance)
    t = got.timings
    assert (int(rounds), proposed, kept) == (t.rounds, t.drafted, t.accepted)
    assert t.rounds > 0 and t.drafted > t.accepted  # some rejections, whose trailing proposals count
    if min_acceptance > 0.5:
        assert t.paused_steps > 0


# ---- settings, errors, CLI -----------------------------------------------------------------------
def test_bad_settings_raise_named_errors(paths, engines):
    target, _ = engines
    with pytest.raises(SpeculativeError, match="unknown speculative proposer 'bogus'.*ngram, draft"):
        Speculative("bogus")
    with pytest.raises(SpeculativeError, match="draft_max must be an int >= 1") as e:
        Speculative("ngram", draft_max=0)
    assert e.value.flag == "--draft-max"
    with pytest.raises(SpeculativeError, match="draft_min .* larger than draft_max"):
        Speculative("ngram", draft_max=2, draft_min=3)
    with pytest.raises(SpeculativeError, match="needs the draft model"):
        Speculative("draft")
    with pytest.raises(SpeculativeError, match="speculative= takes"):
        target.complete(PROMPT, 4, speculative=42)
    with pytest.raises(SpeculativeError, match="unknown speculative proposer"):
        target.complete(PROMPT, 4, speculative="lookahead")
    with pytest.raises(SpeculativeError, match="an Engine of its own"):
        target.complete(PROMPT, 4, speculative=target)
    other = Engine.load(paths["other_vocab"], threads=1)
    with pytest.raises(DraftVocabularyError, match="320 tokens against the target's 300.*same family"):
        target.complete(PROMPT, 4, speculative=other)
    assert target.complete(PROMPT, 4, temperature=0, speculative="off").timings.spec == ""


def test_cli_generate_and_chat_speculate_and_report(paths, capsys, monkeypatch, private_cache):
    import io

    from cflow.cli import main

    m = str(paths["target"])
    base = ["generate", "-m", m, "-t", "1", "--temp", "0", "-n", "30", "--no-display-prompt"]
    assert main(base + ["abcabcabc"]) == 0
    plain = capsys.readouterr().out
    assert main(base + ["abcabcabc", "--spec", "ngram"]) == 0
    out, err = capsys.readouterr()
    assert out == plain and "speculative = ngram:" in err and "proposed tokens accepted" in err
    assert main(base + ["abcabcabc", "-md", m, "--draft-max", "4", "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["text"] + "\n" == plain and j["timings"]["spec"] == "draft"
    assert j["timings"]["acceptance_rate"] == 1.0 and j["timings"]["mean_accepted"] > 1
    for flags, says in ((["--spec", "bogus"], "--spec: unknown speculative proposer"),
                        (["--spec", "ngram", "--draft-max", "0"], "--draft-max: draft_max must be"),
                        (["--spec", "draft"], "--model-draft: speculation with a draft model needs"),
                        (["--spec", "off", "-md", m], "--spec: --model-draft was given with --spec off"),
                        (["-md", str(paths["other_vocab"])], "--model-draft: the draft model"),
                        (["-md", str(paths["target"]) + ".missing"], "--model-draft: model file")):
        assert main(base + ["abc"] + flags) == 2, flags
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err
    monkeypatch.setattr("sys.stdin", io.StringIO("abcabc\n"))
    assert main(["chat", "-m", m, "-t", "1", "--temp", "0", "-n", "12", "--spec", "ngram", "--perf"]) == 0
    assert "ngram:" in capsys.readouterr().err


def test_help_teaches_the_flags(capsys):
    from cflow.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("--spec off|ngram|draft", "--model-draft FILE", "--draft-max N", "--draft-min N",
                  "exactly what plain decoding gives", "summaries, rewrites, code edits"):
        assert words in text, words
