"""The C thread pool (cflow._native.Pool): every thread runs exactly once per call, across many
calls and pool sizes; splitting work over it never changes a result; idle workers sleep."""

from __future__ import annotations

import time

import numpy as np
import pytest

from cflow import _native
from cflow import quant as Q
from cflow.errors import CflowError

CALLS = 3000
IDLE_CPU_BUDGET_S = 0.05  # CPU the whole process may burn while a 4-thread pool sits idle 0.3 s


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_thread_runs_once_per_call(n):
    pool = _native.Pool(n)
    assert pool.size == n
    counts, violations = pool.selftest(CALLS)
    assert violations == 0, f"{violations} (call, thread) checks failed"
    assert counts.tolist() == [CALLS] * n


def test_more_threads_than_cores_and_reuse():
    pool = _native.Pool(7)  # oversubscribed on small machines: the sleep path must still be exact
    for _ in range(3):  # counts are per selftest call
        counts, violations = pool.selftest(300)
        assert violations == 0 and counts.tolist() == [300] * 7


def test_many_pools_start_and_stop():
    for i in range(40):
        pool = _native.Pool(1 + i % 4)
        _, violations = pool.selftest(5)
        assert violations == 0
        del pool


def test_runs_after_idle_sleep():
    pool = _native.Pool(3)
    pool.selftest(10)
    time.sleep(0.05)  # past the spin budget: workers are asleep on the futex
    counts, violations = pool.selftest(10)
    assert violations == 0 and counts.tolist() == [10] * 3


def test_idle_pool_does_not_burn_cpu():
    pool = _native.Pool(4)
    pool.selftest(100)
    time.sleep(0.05)  # let the spin budget (CFLOW_SPIN_US, 100 us by default) run out
    c0 = time.process_time()
    time.sleep(0.3)
    burned = time.process_time() - c0
    assert burned < IDLE_CPU_BUDGET_S, f"idle pool used {burned:.3f} s of CPU in 0.3 s"
    assert pool.selftest(1)[1] == 0


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["q4_0", "q4_1", "q8_0"])
def test_split_matvec_is_bit_identical(dtype, n):
    rng = np.random.default_rng(n)
    rows, cols = 1008, 576  # 2 * d_ff rows with d_ff = 504, so it is also a gate/up matrix
    t = Q.quantize_tiled(rng.standard_normal((rows, cols), dtype=np.float32), dtype)
    x = rng.standard_normal(cols, dtype=np.float32)
    pool = _native.Pool(n)
    for isa in _native.available_isas():
        one = _native.matvec(t, Q.DTYPE_IDS[dtype], rows, cols, x, isa=isa)
        many = _native.matvec(t, Q.DTYPE_IDS[dtype], rows, cols, x, isa=isa, pool=pool)
        assert np.array_equal(one, many), f"{isa}: splitting rows over {n} threads changed y"
        gu_one = _native.gate_up(t, Q.DTYPE_IDS[dtype], rows, cols, x, isa=isa)
        gu_many = _native.gate_up(t, Q.DTYPE_IDS[dtype], rows, cols, x, isa=isa, pool=pool)
        assert np.array_equal(gu_one, gu_many)


def test_bad_size_is_a_named_error():
    with pytest.raises(CflowError):
        _native.Pool(0)
