"""Prefill attention over a block of queries (the kernel table's attention_block, cflow.h).

- Kernel: every table's block kernel equals, bit for bit, the same table's per-query kernel run on
  each query alone over its span of the cache (the contract: the same summation order, so prefill
  and step-by-step decode give the same logits); both are close to a float64 oracle; every fast
  table is close to the reference. Shapes: head_dim 24/40/64/96/128/256 (and 20, which the fast tables
  hand to the reference), GQA ratios 1/3/4, blocks of 1..17 queries starting at p0 = 0 or later
  (a second prefill chunk), with and without a sliding window. Cache entries no query may read
  hold inf/nan, so a read past the causal edge or before the window shows.
- Engine: prefill in blocks equals the per-query path (CFLOW_ATTN_BLOCK=0) and step-by-step decode,
  with 1 and 2 threads, on a random GQA model with and without a sliding window and on SmolLM2.
"""

from __future__ import annotations

import numpy as np
import pytest

from cflow import _native

from test_native_kernels import FAST_ISAS, ISAS, assert_close, lo_of, rng_for
from test_native_kernels import attention_oracle as oracle

torch = pytest.importorskip("torch")  # the random models are built with the PyTorch reference

from cflow.bench.claims.models import small_config  # noqa: E402
from cflow.runtime import Engine  # noqa: E402
from test_engine import prompt_tokens, write_random_model  # noqa: E402

RTOL = 1e-5  # test_native_kernels.VEC_RTOL: fp32 sums of head_dim products against float64

# (n_heads, n_kv_heads, head_dim): GQA ratios 1, 3, 4; head_dim 20 is not a multiple of 8; 128 and
# 256 make the avx512 kernels' tiles (4096 floats) end inside the 48 positions (32 and 16 rows)
SHAPES = [(4, 4, 24), (6, 2, 40), (9, 3, 64), (8, 2, 96), (3, 1, 20), (8, 2, 128), (4, 1, 256)]


def caches(rng, n_kv, max_seq, hd, first, end):
    """fp16 caches with positions outside [first, end) poisoned."""
    k = rng.standard_normal((n_kv, max_seq, hd)).astype(np.float16)
    v = rng.standard_normal((n_kv, max_seq, hd)).astype(np.float16)
    k[:, end:], v[:, end:] = np.float16(np.inf), np.float16(np.nan)
    k[:, :first], v[:, :first] = np.float16(np.nan), np.float16(np.inf)
    return k, v


def per_query(q, k, v, n_heads, n_kv, pos0, window, isa):
    """The per-query kernel on each query alone: the block kernel's definition."""
    n_q = q.shape[0]
    out = np.empty_like(q)
    for i in range(n_q):
        p = pos0 + i
        lo = lo_of(p, window)
        ks, vs = np.ascontiguousarray(k[:, lo:p + 1]), np.ascontiguousarray(v[:, lo:p + 1])
        out[i] = _native.attention(q[i], ks, vs, n_heads, n_kv, p + 1 - lo, isa=isa)
    return out


@pytest.mark.parametrize("n_heads,n_kv,hd", SHAPES)
@pytest.mark.parametrize("pos0,window", [(0, 0), (13, 0), (0, 6), (21, 9)])
@pytest.mark.parametrize("isa", ISAS)
def test_block_equals_per_query(isa, n_heads, n_kv, hd, pos0, window):
    max_seq = 48
    for n_q in (1, 2, 3, 4, 5, 8, 16, 17):
        rng = rng_for("attn_block", n_heads, n_kv, hd, pos0, window, n_q)
        end = pos0 + n_q
        k, v = caches(rng, n_kv, max_seq, hd, lo_of(pos0, window), end)
        q = rng.standard_normal((n_q, n_heads * hd), dtype=np.float32)
        got = _native.attention_block(q.reshape(-1), k, v, n_heads, n_kv, pos0, window=window, isa=isa)
        got = got.reshape(n_q, -1)
        assert np.array_equal(got, per_query(q, k, v, n_heads, n_kv, pos0, window, isa)), \
            f"{isa}: block of {n_q} at {pos0} != per-query"
        want, bound = oracle(q, k, v, n_heads, n_kv, pos0, window)
        assert_close(got, want, bound, RTOL, f"attention_block {isa} n_q={n_q}")
        # heads split over threads (ranges that cut GQA groups), each range with its own scratch
        pool = _native.Pool(3)
        split = _native.attention_block(q.reshape(-1), k.view(np.uint16), v.view(np.uint16), n_heads, n_kv,
                                        pos0, window=window, isa=isa, pool=pool)
        assert np.array_equal(split.reshape(n_q, -1), got), f"{isa}: splitting heads changed the result"


@pytest.mark.parametrize("isa", FAST_ISAS)
def test_fast_tables_close_to_ref(isa):
    rng = rng_for("attn_block_isa", isa)
    for n_heads, n_kv, hd in SHAPES:
        k, v = caches(rng, n_kv, 64, hd, 0, 64)
        q = rng.standard_normal(40 * n_heads * hd, dtype=np.float32)  # 40 queries at 24..63
        ref = _native.attention_block(q, k, v, n_heads, n_kv, 24, isa="ref")
        got = _native.attention_block(q, k, v, n_heads, n_kv, 24, isa=isa)
        _, bound = oracle(q.reshape(40, -1), k, v, n_heads, n_kv, 24, 0)
        assert_close(got.reshape(40, -1), ref.reshape(40, -1), bound, RTOL, f"{isa} vs ref")


def test_bad_shapes_are_named_errors():
    k = np.zeros((2, 8, 16), np.float16)
    cases = [("do not fit", lambda: _native.attention_block(np.zeros(4 * 16 * 4, np.float32), k, k, 4, 2, 6)),
             ("whole queries", lambda: _native.attention_block(np.zeros(4 * 16 + 1, np.float32), k, k, 4, 2, 0)),
             ("window", lambda: _native.attention_block(np.zeros(4 * 16, np.float32), k, k, 4, 2, 0, window=-1)),
             ("multiple", lambda: _native.attention_block(np.zeros(3 * 16, np.float32), k, k, 3, 2, 0))]
    for what, f in cases:
        with pytest.raises(_native.KernelInputError, match=what):
            f()


# ---- the engine ------------------------------------------------------------------------------
def run_paths(path, toks, threads, max_batch, monkeypatch):
    """Last-token logits of a prefill in blocks, the same prefill through the per-query kernel,
    and step-by-step decode."""
    eng = Engine.load(path, threads=threads, max_batch=max_batch)
    block = eng.prefill(toks).copy()
    eng.reset()
    monkeypatch.setenv("CFLOW_ATTN_BLOCK", "0")
    per_query = eng.prefill(toks).copy()
    monkeypatch.delenv("CFLOW_ATTN_BLOCK")
    eng.reset()
    for pos, t in enumerate(toks):
        steps = eng.step(t, pos)
    return block, per_query, steps.copy()


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("threads", [1, 2])
def test_engine_prefill_blocks_equal_steps(tmp_path, monkeypatch, threads, window):
    # 6/2 heads of 16: GQA 3; 45 tokens in calls of 20 (the second and third calls start past 0,
    # and their blocks cut the 16-row work items)
    cfg = small_config("llama", tied=False, n_heads=6, n_kv_heads=2, sliding_window=window)
    path = tmp_path / "m.cflow"
    write_random_model(path, cfg, "q8_0", (64, 64))
    toks = prompt_tokens(cfg, 45, seed=11)
    block, per_query, steps = run_paths(path, toks, threads, 20, monkeypatch)
    assert np.array_equal(block, per_query)
    assert np.array_equal(block, steps)


@pytest.mark.parametrize("threads", [1, 2])
def test_smollm2_prefill_blocks_equal_steps(smollm2_converted, monkeypatch, threads):
    # 9/3 heads of 64 (GQA 3), 30 layers; 70 tokens in calls of 32
    toks = [int(t) for t in np.random.default_rng(5).integers(0, 49152, 70)]
    eng = Engine.load(smollm2_converted, threads=threads, n_ctx=128, max_batch=32)
    block = eng.prefill(toks).copy()
    eng.reset()
    monkeypatch.setenv("CFLOW_ATTN_BLOCK", "0")
    per_query = eng.prefill(toks).copy()
    monkeypatch.delenv("CFLOW_ATTN_BLOCK")
    eng.reset()
    for pos, t in enumerate(toks):
        steps = eng.step(t, pos)
    assert np.array_equal(block, per_query)
    assert np.array_equal(block, steps)


@pytest.mark.parametrize("n_heads,n_kv", [(3, 1), (6, 3), (6, 2)])
@pytest.mark.parametrize("threads", [2, 3])
def test_engine_rows_of_one_sequence_equal_steps(tmp_path, n_heads, n_kv, threads):
    # a verification call's shape: one block of rows of one sequence past a prompt. With few kv
    # heads for the threads each thread takes a range of query heads, a kv head's heads possibly
    # on two threads (engine.c, attn_blocks); every row's logits are still step-by-step decode's
    cfg = small_config("llama", tied=False, n_heads=n_heads, n_kv_heads=n_kv)
    path = tmp_path / "m.cflow"
    write_random_model(path, cfg, "q8_0", (64, 64))
    toks = prompt_tokens(cfg, 27, seed=3)
    eng = Engine.load(path, threads=threads)
    for r in (2, 5, 7):
        eng.reset()
        eng.prefill(toks[:20])
        rows = eng.step_rows([0] * r, toks[20:20 + r], list(range(20, 20 + r))).copy()
        eng.reset()
        steps = [eng.step(t, pos).copy() for pos, t in enumerate(toks[:20 + r])][20:]
        assert np.array_equal(rows, np.stack(steps)), r
