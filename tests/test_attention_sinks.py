"""Attention sinks (gpt-oss; cflow.h cf_attn_shape.sinks) in every attention kernel of every table.

Head h's softmax holds one more logit, sinks[h], which joins its max and denominator and whose
share is dropped. On GQA 1/3/4, head_dim 64/96/128, fp16 and q8_0 K and V (each), the per-query
kernel is close to a float64 oracle with the sinks (test_native_kernels.attention_oracle), the
block kernel equals the per-query kernel bit for bit (prefill == decode) across windows, and
splitting heads over threads changes nothing. Control: the oracle without the sinks misses by far,
so the comparison sees them (each sink near its head's largest score).
"""

from __future__ import annotations

import numpy as np
import pytest

from cflow import _native

from test_kv_q8 import cache
from test_native_kernels import ISAS, assert_close, lo_of, rng_for
from test_native_kernels import attention_oracle as oracle

RTOL = 1e-5  # test_native_kernels.VEC_RTOL: fp32 sums of head_dim products against float64
TYPES = [("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "f16"), ("f16", "q8_0")]
SHAPES = [(2, 2, 64), (9, 3, 64), (8, 2, 96), (4, 1, 128)]


def sinks_for(rng, q: np.ndarray, k64: np.ndarray, n_heads: int, lo: int, hi: int) -> np.ndarray:
    """One logit per head near the head's largest score over positions [lo, hi) (of the last
    query in q), so the sink takes a real share of every softmax (the caches' outlier
    channel makes scores large)."""
    hd, n_kv = k64.shape[2], k64.shape[0]
    qh = np.asarray(q, np.float64).reshape(-1, n_heads, hd)[-1]
    top = [(k64[h // (n_heads // n_kv), lo:hi] @ qh[h]).max() / np.sqrt(hd) for h in range(n_heads)]
    return (np.array(top) + rng.standard_normal(n_heads)).astype(np.float32)


@pytest.mark.parametrize("kt,vt", TYPES)
@pytest.mark.parametrize("n_heads,n_kv,hd", SHAPES)
@pytest.mark.parametrize("isa", ISAS)
def test_per_query_with_sinks(isa, n_heads, n_kv, hd, kt, vt):
    for n_pos in (1, 7, 33, 77):  # odd position counts: tails of every unrolled loop
        rng = rng_for("sinks_q", isa, kt, vt, n_heads, hd, n_pos)
        k, k64 = cache(rng, n_kv, 80, hd, kt, 0, n_pos)
        v, v64 = cache(rng, n_kv, 80, hd, vt, 0, n_pos)
        q = rng.standard_normal(n_heads * hd, dtype=np.float32)
        sinks = sinks_for(rng, q, k64, n_heads, 0, n_pos)
        got = _native.attention(q, k, v, n_heads, n_kv, n_pos, isa=isa, k_type=kt, v_type=vt, sinks=sinks)
        want, bound = oracle(q[None], k64, v64, n_heads, n_kv, n_pos - 1, 0, sinks)
        assert_close(got, want[0], bound[0], RTOL, f"{isa} K {kt} V {vt} n_pos={n_pos}")
        plain, _ = oracle(q[None], k64, v64, n_heads, n_kv, n_pos - 1, 0)  # the control
        # without the sinks the comparison above would fail by 10x its tolerance or more
        assert (np.abs(got - plain[0]) / bound[0]).max() > 10 * RTOL, "the sinks change nothing?"
        split = _native.attention(q, k, v, n_heads, n_kv, n_pos, isa=isa, k_type=kt, v_type=vt, sinks=sinks,
                                  pool=_native.Pool(3))
        assert np.array_equal(split, got), f"{isa}: splitting heads changed the result"


@pytest.mark.parametrize("kt,vt", TYPES)
@pytest.mark.parametrize("n_heads,n_kv,hd", SHAPES)
@pytest.mark.parametrize("pos0,window", [(0, 0), (13, 0), (0, 6), (21, 9)])
@pytest.mark.parametrize("isa", ISAS)
def test_block_with_sinks_equals_per_query(isa, n_heads, n_kv, hd, pos0, window, kt, vt):
    max_seq = 48
    for n_q in (1, 3, 16, 17):
        rng = rng_for("sinks_block", n_heads, n_kv, hd, pos0, window, n_q, kt, vt)
        end, first = pos0 + n_q, lo_of(pos0, window)
        k, k64 = cache(rng, n_kv, max_seq, hd, kt, first, end)
        v, v64 = cache(rng, n_kv, max_seq, hd, vt, first, end)
        q = rng.standard_normal((n_q, n_heads * hd), dtype=np.float32)
        sinks = sinks_for(rng, q, k64, n_heads, lo_of(end - 1, window), end)
        got = _native.attention_block(q.reshape(-1), k, v, n_heads, n_kv, pos0, window=window, isa=isa,
                                      k_type=kt, v_type=vt, sinks=sinks).reshape(n_q, -1)
        for i in range(n_q):
            p = pos0 + i
            lo = lo_of(p, window)
            ks, vs = np.ascontiguousarray(k[:, lo:p + 1]), np.ascontiguousarray(v[:, lo:p + 1])
            one = _native.attention(q[i], ks, vs, n_heads, n_kv, p + 1 - lo, isa=isa, k_type=kt, v_type=vt,
                                    sinks=sinks)
            assert np.array_equal(got[i], one), f"{isa}: query {i} of a block of {n_q} at {pos0} != per-query"
        want, bound = oracle(q, k64, v64, n_heads, n_kv, pos0, window, sinks)
        assert_close(got, want, bound, RTOL, f"attention_block {isa} K {kt} V {vt} n_q={n_q}")


def test_sinks_must_match_the_heads():
    q = np.ones(4 * 64, np.float32)
    k = np.ones((2, 8, 64), np.float16)
    with pytest.raises(ValueError, match="sinks"):
        _native.attention(q, k, k, 4, 2, 8, sinks=np.zeros(3, np.float32))
