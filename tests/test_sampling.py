"""cflow.sampling: each stage against a plain definition, the chain's order, seeds, statistics."""

from __future__ import annotations

import numpy as np
import pytest

from cflow.sampling import (Sampler, SamplingError, SamplingParams, apply_penalties, apply_repeat_penalty, min_p,
                            top_k, top_p)


def logits_of(probs) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


def params(**kw) -> SamplingParams:
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, seed=0)
    base.update(kw)
    return SamplingParams(**base)


# ---- stages against their definitions ----------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000])
def test_top_k_is_the_k_largest_sorted(n):
    rng = np.random.default_rng(n)
    x = rng.normal(size=n).astype(np.float32)
    for k in (0, 1, 2, 5, n, n + 3):
        ids, vals = top_k(x, k)
        want = np.argsort(-x, kind="stable")[: (n if k <= 0 else min(k, n))]
        assert ids.tolist() == want.tolist() and np.array_equal(vals, x[want])


def test_top_k_on_a_large_vocabulary_with_ties():
    # 50k entries take the chunk-maxima shortcut; quantized values make many ties at the boundary
    rng = np.random.default_rng(3)
    x = np.round(rng.normal(size=50_000) * 4).astype(np.float32)
    for k in (1, 7, 40, 100):
        ids, vals = top_k(x, k)
        want = np.lexsort((np.arange(x.size), -x))[:k]
        assert ids.tolist() == want.tolist() and np.array_equal(vals, x[want])


def test_top_k_ties_keep_lower_ids():
    x = np.array([1.0, 3.0, 3.0, 0.0, 3.0], np.float32)
    assert top_k(x, 2)[0].tolist() == [1, 2]


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    ids, vals = top_k(logits_of(p), 0)
    # float32 logits leave cum[0] a few 1e-9 above 0.5, so this is not the cum == p boundary;
    # the boundary itself is tested on exact probabilities below
    assert top_p(ids, vals, 0.5)[0].tolist() == [0]
    assert top_p(ids, vals, 0.51)[0].tolist() == [0, 1]     # the crossing token is kept
    assert top_p(ids, vals, 0.95)[0].tolist() == [0, 1, 2]
    assert top_p(ids, vals, 0.96)[0].tolist() == [0, 1, 2, 3]
    assert top_p(ids, vals, 1.0)[0].tolist() == [0, 1, 2, 3]


def test_min_p_is_relative_to_the_top_token():
    p = np.array([0.4, 0.3, 0.2, 0.1])
    ids, vals = top_k(logits_of(p), 0)
    assert min_p(ids, vals, 0.49)[0].tolist() == [0, 1, 2]  # keeps p >= 0.196
    assert min_p(ids, vals, 0.51)[0].tolist() == [0, 1]     # keeps p >= 0.204
    assert min_p(ids, vals, 1.0)[0].tolist() == [0]
    assert min_p(ids, vals, 0.0)[0].tolist() == [0, 1, 2, 3]


def test_repeat_penalty_divides_positive_and_multiplies_negative():
    x = np.array([2.0, -2.0, 1.0, 0.5], np.float32)
    y = apply_repeat_penalty(x, [0, 1, 1, 3, 99], 2.0)  # duplicates and out-of-range ids are harmless
    assert y.tolist() == [1.0, -4.0, 1.0, 0.25]
    assert x.tolist() == [2.0, -2.0, 1.0, 0.5]  # the input is not modified


def test_repeat_last_n_window():
    x = np.zeros(10, np.float32)
    x[1], x[2] = 5.0, 5.5
    s = Sampler(params(temperature=0, repeat_penalty=100.0, repeat_last_n=2))
    assert s.sample(x, history=[2, 7, 7]) == 2   # 2 is outside the last 2 tokens
    assert s.sample(x, history=[7, 2, 7]) == 1   # now it is inside and penalised
    assert Sampler(params(temperature=0, repeat_penalty=100.0, repeat_last_n=0)).sample(x, [1, 2]) == 2  # off
    x[3] = 1.0
    long = [1, 2] + [7] * 100
    assert Sampler(params(temperature=0, repeat_penalty=100.0, repeat_last_n=64)).sample(x, long) == 2
    assert Sampler(params(temperature=0, repeat_penalty=100.0, repeat_last_n=-1)).sample(x, long) == 3


def test_frequency_and_presence_penalties_on_a_literal_example():
    # OpenAI: logit -= count * frequency + (count > 0) * presence; counts over the window
    x = np.array([1.0, 2.0, 3.0, 0.5, -1.0], np.float32)
    recent = [0, 2, 2, 4, 99]  # id 2 twice; an id outside the vocabulary is ignored
    assert apply_penalties(x, recent, frequency=0.5, presence=0.25).tolist() == [0.25, 2.0, 1.75, 0.5, -1.75]
    assert apply_penalties(x, recent, frequency=0.5).tolist() == [0.5, 2.0, 2.0, 0.5, -1.5]
    assert apply_penalties(x, recent, presence=-1.0).tolist() == [2.0, 2.0, 4.0, 0.5, 0.0]  # < 0 favours repeats
    # llama.cpp's order: the repeat penalty first (halve positive, double negative), then the subtraction
    assert apply_penalties(x, recent, 2.0, 0.5, 0.25).tolist() == [-0.25, 2.0, 0.25, 0.5, -2.75]
    assert x.tolist() == [1.0, 2.0, 3.0, 0.5, -1.0]  # the input is not modified
    assert apply_penalties(x, recent) is x and apply_penalties(x, [], 2.0, 1.0, 1.0) is x


def test_frequency_penalty_in_the_chain_uses_the_repeat_window():
    x = np.array([0.0, 5.0, 4.0], np.float32)
    assert Sampler(params(temperature=0)).sample(x, history=[1, 1]) == 1
    assert Sampler(params(temperature=0, frequency_penalty=1.5)).sample(x, history=[1, 1]) == 2  # 5 - 3 < 4
    assert Sampler(params(temperature=0, frequency_penalty=0.25)).sample(x, history=[1, 1]) == 1  # 5 - 0.5 > 4
    assert Sampler(params(temperature=0, presence_penalty=1.5)).sample(x, history=[1, 1]) == 2    # 5 - 1.5 < 4
    assert Sampler(params(temperature=0, presence_penalty=0.75)).sample(x, history=[1, 1]) == 1   # 5 - 0.75 > 4
    # repeat_last_n bounds every penalty: the 1s lie outside the last 2 tokens
    assert Sampler(params(temperature=0, frequency_penalty=1.5, repeat_last_n=2)).sample(x, [1, 1, 0, 0]) == 1
    assert Sampler(params(temperature=0, frequency_penalty=1.5, repeat_last_n=0)).sample(x, [1, 1]) == 1
    # the sampled distribution sees the penalty too: presence 100 leaves token 1 no mass
    ids, probs = Sampler(params(presence_penalty=100.0)).probs(x, history=[1])
    assert probs[ids.tolist().index(1)] < 1e-30


def test_logit_bias_comes_first_in_the_chain():
    x = np.array([1.0, 2.0, 3.0], np.float32)
    assert Sampler(params(temperature=0, logit_bias={2: -100})).sample(x) == 1
    assert Sampler(params(temperature=0, logit_bias={0: 5, 2: -0.5})).sample(x) == 0
    assert Sampler(params(temperature=0, logit_bias=[(0, 5.0), (0, 0.5)])).sample(x) == 2  # the last pair wins
    # the bias, then the repeat penalty: (-1 + 3) / 4 = 0.5 (the other order would give -1 * 4 + 3 = -1)
    s = Sampler(params(logit_bias={0: 3.0}, repeat_penalty=4.0))
    assert s.adjusted(np.array([-1.0, 1.0], np.float32), [0]).tolist() == [0.5, 1.0]
    # a banned token is never drawn
    s = Sampler(params(logit_bias={0: -100.0}, seed=3))
    assert 0 not in {s.sample(np.zeros(4, np.float32)) for _ in range(200)}
    assert SamplingParams(logit_bias={3: 1, 1: -2}).logit_bias == ((1, -2.0), (3, 1.0))
    assert Sampler(params(logit_bias={3: 1.0})).plain_greedy is False and Sampler(params(temperature=0)).plain_greedy
    with pytest.raises(SamplingError, match="vocabulary has 3 tokens"):
        Sampler(params(logit_bias={3: 1.0})).sample(x)


def test_top_p_over_the_whole_vocabulary_matches_a_full_sort():
    # top_k off: the sampler tries the top 256 first and must give what a full sort gives
    rng = np.random.default_rng(0)
    for scale in (0.5, 3.0, 10.0):
        x = (rng.normal(size=5000) * scale).astype(np.float32)
        for p in (0.3, 0.9, 0.999):
            ids, _ = Sampler(params(top_p=p)).candidates(x)
            want = top_p(*top_k(x, 0), p)[0]
            assert ids.tolist() == want.tolist()


# ---- the chain ---------------------------------------------------------------------------------
def test_greedy_is_the_argmax_after_penalties():
    x = np.array([0.1, 5.0, 4.9, -1.0], np.float32)
    assert Sampler(params(temperature=0)).sample(x) == 1
    assert Sampler(params(temperature=0, repeat_penalty=1.1)).sample(x, history=[1]) == 2


def test_chain_order_top_p_and_min_p_see_probabilities_before_temperature():
    # probs 0.5 / 0.3 / 0.2: top_p 0.7 keeps two tokens whatever the temperature
    x = logits_of([0.5, 0.3, 0.2])
    for t in (0.1, 1.0, 5.0):
        ids, probs = Sampler(params(temperature=t, top_p=0.7)).probs(x)
        assert ids.tolist() == [0, 1]
    # temperature reshapes the draw among survivors: p0/p1 = (0.5/0.3)^(1/t)
    ids, probs = Sampler(params(temperature=2.0, top_p=0.7)).probs(x)
    assert probs[0] / probs[1] == pytest.approx((0.5 / 0.3) ** 0.5, rel=1e-6)
    # top-k runs before top-p: with k=1 nothing else survives
    assert Sampler(params(top_k=1, top_p=0.99)).probs(x)[0].tolist() == [0]


def test_seed_reproduces_and_differs():
    x = np.random.default_rng(1).normal(size=300).astype(np.float32)

    def draws(seed):
        s = Sampler(params(seed=seed))
        return [s.sample(x) for _ in range(50)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    a, b = Sampler(params(seed=None)), Sampler(params(seed=-1))
    assert a.seed != b.seed  # random seeds, reported so a run can be repeated


def test_sampling_frequencies_follow_the_distribution():
    # 4 tokens with probabilities 0.4 / 0.3 / 0.2 / 0.1: 20k draws, each frequency within 4 sigma
    p = np.array([0.4, 0.3, 0.2, 0.1])
    s = Sampler(params(seed=123))
    n = 20000
    counts = np.bincount([s.sample(logits_of(p)) for _ in range(n)], minlength=4)
    sigma = np.sqrt(n * p * (1 - p))
    assert (np.abs(counts - n * p) < 4 * sigma).all(), counts


def test_temperature_and_filters_statistically():
    p = np.array([0.4, 0.3, 0.2, 0.1])
    n = 20000
    # top_k=2 at temperature 1: only tokens 0 and 1, in ratio 4:3
    s = Sampler(params(top_k=2, seed=5))
    c = np.bincount([s.sample(logits_of(p)) for _ in range(n)], minlength=4)
    assert c[2] == c[3] == 0 and c[0] / n == pytest.approx(4 / 7, abs=0.015)
    # min_p=0.6: only tokens with p >= 0.24, i.e. 0 and 1
    s = Sampler(params(min_p=0.6, seed=6))
    c = np.bincount([s.sample(logits_of(p)) for _ in range(n)], minlength=4)
    assert c[2] == c[3] == 0
    # a low temperature concentrates the mass: t=0.25 turns 0.4:0.3 into (4/3)^4 = 3.16
    s = Sampler(params(temperature=0.25, seed=7))
    c = np.bincount([s.sample(logits_of(p)) for _ in range(n)], minlength=4)
    q = p ** 4 / (p ** 4).sum()
    assert np.abs(c / n - q).max() < 0.015


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(min_p=-0.1), dict(min_p=2.0), dict(repeat_penalty=0.0),
                                 dict(repeat_last_n=-2), dict(temperature=float("nan")), dict(seed=-5),
                                 dict(top_k=2.5), dict(presence_penalty=float("inf")),
                                 dict(frequency_penalty="1"), dict(logit_bias={-1: 1.0}), dict(logit_bias={"a": 1.0}),
                                 dict(logit_bias={1: float("nan")}), dict(logit_bias=[1, 2])])
def test_bad_values_are_named(bad):
    with pytest.raises(SamplingError, match=next(iter(bad)).split("_")[0]):
        params(**bad)


# ---- the top-p boundary: cum == p exactly ------------------------------------------------------
# Equal logits give probabilities that are exact binary fractions (1/4, 1/512 ...), so the running
# sum lands exactly on p and the `>=` of llama.cpp's rule (keep the smallest best-first prefix whose
# cumulative probability is >= p) is what decides; a `>` would keep one more token. Ties keep the
# lower id, so the kept set is a literal prefix of ids.
def _uniform_head(n_vocab: int, n_top: int) -> np.ndarray:
    # n_top equal logits; the rest so low that exp() underflows to exactly 0 in float64
    x = np.full(n_vocab, -1e4, np.float32)
    x[:n_top] = 0.0
    return x


@pytest.mark.parametrize("p, kept", [(0.25, 1), (0.5, 2), (0.75, 3), (0.7499, 3), (0.7501, 4)])
def test_top_p_boundary_is_inclusive_with_top_k(p, kept):
    # top_k > 0: the sampler runs top_k() then top_p() on its survivors
    x = _uniform_head(4, 4)
    ids, _ = Sampler(params(top_k=4, top_p=p)).candidates(x)
    assert ids.tolist() == list(range(kept))
    assert top_p(*top_k(x, 0), p)[0].tolist() == list(range(kept))


@pytest.mark.parametrize("p, kept", [(0.25, 1), (0.5, 2), (0.75, 3), (0.7501, 4)])
def test_top_p_boundary_is_inclusive_on_the_head_fast_path(p, kept):
    # top_k off, 1000 tokens: the top 256 already hold all the mass, so the head path answers
    x = _uniform_head(1000, 4)
    ids, _ = Sampler(params(top_p=p)).candidates(x)
    assert ids.tolist() == list(range(kept))


def test_top_p_boundary_is_inclusive_on_the_4096_head_path():
    # 512 equal tokens (1/512 each) in 5000: the top 256 hold only 0.5 < 0.75, the top 4096 hold
    # it all; 0.75 is reached exactly at 384 tokens
    x = _uniform_head(5000, 512)
    ids, _ = Sampler(params(top_p=0.75)).candidates(x)
    assert ids.tolist() == list(range(384))


def test_top_p_boundary_is_inclusive_after_the_full_sort_fallback():
    # 8192 equal tokens: even the top 4096 hold only 0.5 < 0.75, so the whole vocabulary is sorted
    x = np.zeros(8192, np.float32)
    ids, _ = Sampler(params(top_p=0.75)).candidates(x)
    assert ids.tolist() == list(range(6144))


@pytest.mark.parametrize("temperature", [1e308, 3e38, 1e-300, 5e-324, 1e-45])
def test_extreme_temperatures_take_their_limits_without_warnings(temperature):
    """A request may send any positive temperature: a huge one draws uniformly among the candidates,
    a tiny one is the argmax; no floating-point warning reaches the server's stderr."""
    import warnings

    x = np.random.default_rng(3).standard_normal(500).astype(np.float32) * 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = Sampler(SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=7))
        ids, p = s.probs(x)
        draws = [s.sample(x) for _ in range(200)]
    assert np.isfinite(p).all() and abs(p.sum() - 1) < 1e-9
    if temperature > 1:
        assert np.allclose(p, 1 / len(p)) and len(set(draws)) > 100
    else:
        assert set(draws) == {int(np.argmax(x))}
