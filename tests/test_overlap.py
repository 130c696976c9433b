"""Overlap of independent ops (Engine(overlap=True), engine.c "overlap"): attn(l) beside dense(l)
on two thread groups gives the same logits bit for bit as the serial plan, at every thread count,
for prefill and decode, and counts the same bytes."""

from __future__ import annotations

import numpy as np
import pytest

from cflow.bench.claims.models import write_random_model
from cflow.config import ModelConfig
from cflow.runtime import Engine

SMALL = dict(vocab_size=384, d_model=96, n_heads=4, n_kv_heads=2, d_ff=160, n_experts=5, top_k=2, d_expert=96,
             max_seq_len=64, n_layers=4, tie_embeddings=False)


@pytest.fixture(scope="module", params=["arch2_4_combined", "arch2", "arch1", "llama"])
def model(request, tmp_path_factory):
    cfg = ModelConfig.from_name(request.param, **SMALL)
    return write_random_model(tmp_path_factory.mktemp("ov") / "m.cflow", cfg, "q4_0", seed=11)


def run(path, threads: int, overlap: bool):
    eng = Engine.load(path, threads=threads, n_ctx=48, overlap=overlap)
    try:
        assert eng.overlap is overlap
        out = [eng.prefill([7, 3, 250, 11, 90, 4, 5]).copy()]
        tok = int(out[0].argmax())
        for i in range(6):
            out.append(eng.step(tok, 7 + i).copy())
            tok = int(out[-1].argmax())
        return np.stack(out), eng.counters()
    finally:
        eng.close()


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_overlap_is_bit_identical(model, threads):
    serial, c0 = run(model, threads, False)
    got, c1 = run(model, threads, True)
    np.testing.assert_array_equal(got, serial)
    assert c1 == c0  # the groups' counters are added back


def test_overlap_switches_between_calls(model):
    eng = Engine.load(model, threads=2, n_ctx=48)
    try:
        assert eng.overlap is False
        a = eng.prefill([1, 2, 3]).copy()
        eng.overlap = True
        b = eng.prefill([1, 2, 3]).copy()
        eng.overlap = False
        c = eng.prefill([1, 2, 3]).copy()
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    finally:
        eng.close()


def thread_kinds(eng, steps: int = 2) -> list[set[str]]:
    from cflow.bench.profile import EVENT_DTYPE
    from cflow.runtime import abi

    kinds = tuple(abi.native_module().PROFILE_KINDS)
    nat = eng._native
    nat.profile_start(8)
    for i in range(steps):
        eng.step(3 + i, i)
    nat.profile_stop()
    out = [{kinds[k] for k in np.frombuffer(nat.profile_events(t), EVENT_DTYPE)["kind"]}
           for t in range(nat.active_threads)]
    nat.profile_free()
    return out


def test_overlap_splits_attn_and_dense_between_the_groups(tmp_path):
    cfg = ModelConfig.from_name("arch2_4_combined", **SMALL)  # delta_dense = 1: pairs exist
    path = write_random_model(tmp_path / "m.cflow", cfg, "q4_0", seed=11)
    eng = Engine.load(path, threads=2, n_ctx=48)
    try:
        serial = thread_kinds(eng)
        assert all("dense.gate_up" in k and "attn.qkv" in k for k in serial)
        eng.overlap = True
        t0, t1 = thread_kinds(eng)
        assert "attn.qkv" in t0 and "dense.gate_up" not in t0
        assert "dense.gate_up" in t1 and "attn.qkv" not in t1
    finally:
        eng.close()
