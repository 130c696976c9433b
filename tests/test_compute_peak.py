"""Prefill's ceiling: the int8 multiply-add peak probe and the GOP/s `cflow bench` reports.

The peak itself is a measurement (no value is asserted beyond "positive where the CPU has the
instruction"); what is checked is the arithmetic around it: the multiply-adds one prompt token
costs, counted here independently from the file's own tensor list, and the bench report's GOP/s
and share of the peak computed from them.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from cflow import _native
from cflow.bench import bandwidth, bench
from cflow.runtime import Engine

from test_bench import tiny_model  # noqa: F401  (the fixture: a 3-layer arch2_4_combined MoE model)


@pytest.mark.parametrize("isa", bandwidth.PEAK_ISAS)
def test_int8_peak_where_the_cpu_has_it(isa):
    got = bandwidth.int8_peak(isa, threads=1, reps=1)
    has = {"avx2": ["avx2"], "avxvnni": ["avx2", "avxvnni"],
           "avx512": ["avx512f", "avx512bw", "avx512vnni"]}[isa]
    if all(_native.cpu_features().get(f) for f in has):
        assert got is not None and math.isfinite(got) and got > 0
    else:
        assert got is None


def test_int8_peak_refuses_what_it_cannot_measure():
    assert bandwidth.int8_peak("ref") is None  # the scalar table has no multiply-add instruction form
    assert _native.int8_peak("no-such-isa", 1, 1) == -1.0


def test_macs_per_token_from_the_files_tensors(tiny_model):
    """Independent count: every 2-D tensor of a layer, experts weighted by top_k / n_experts."""
    path, cfg = tiny_model
    with Engine.load(path, threads=1) as eng:
        macs = eng.matmul_macs_per_token()
        with_head = eng.matmul_macs_per_token(logits=True)
        tensors = eng.file.tensors
    expected = 0.0
    for name, t in tensors.items():
        shape = tuple(t.shape)
        if len(shape) < 2 or not name.startswith("layers."):
            continue
        n = float(np.prod(shape))
        expected += n * cfg.top_k / cfg.n_experts if ".experts." in name else n
    assert macs == pytest.approx(expected, rel=1e-12)
    head = cfg.vocab_size * cfg.d_model
    assert with_head - macs == pytest.approx(head, rel=1e-12)


def test_bench_reports_prefill_gops_against_the_peak(tiny_model, monkeypatch):
    path, _ = tiny_model
    monkeypatch.setattr(bandwidth, "read_bandwidth", lambda threads=1, **kw: 10.0)
    monkeypatch.setattr(bandwidth, "int8_peak", lambda isa, threads=1, **kw: 100.0 * threads)
    rep = bench(path, threads=[1, 2], pp=16, tg=4, reps=1, warmup=False, footprint=False)
    with Engine.load(path, threads=1) as eng:
        macs = eng.matmul_macs_per_token()
    d = json.loads(rep.to_json())
    assert d["macs_per_token"] == pytest.approx(macs) and d["int8_peak_gops"] == {"1": 100.0, "2": 200.0}
    pp = [r for r in d["rows"] if r["test"] == "pp16"]
    assert len(pp) == 2
    for r in pp:
        gops = 2 * macs * r["avg_ts"] / 1e9
        assert r["gops"] == pytest.approx(gops)
        assert r["pct_of_int8_peak"] == pytest.approx(100 * gops / (100.0 * r["threads"]))
    assert all("gops" not in r for r in d["rows"] if r["test"].startswith("tg"))
    md = rep.to_markdown()
    assert "int8 multiply-add peak of the" in md and "cflow pp16 at 2 thr:" in md
