"""The built-in default model: a trained pipeline-native MoE (delta_expert > 0) in Q4 tiles, at most
15 MB, that loads and generates offline, and whose validation perplexity through the engine is
within 3% of its float checkpoint's on the windows shipped beside it (benchmarks/ship_default.py
recorded the float number in the file's metadata)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from cflow.bench.perplexity import evaluate_windows
from cflow.runtime import DEFAULT_MODEL, Engine

pytestmark = pytest.mark.skipif(not DEFAULT_MODEL.is_file(), reason="built-in model not installed")


def test_the_default_is_a_pipeline_native_moe_in_q4_tiles():
    with Engine.load(threads=1) as eng:
        c = eng.config
        assert c.has_moe and c.delta_expert > 0 and c.top_k >= 2 and c.n_experts >= 8
        assert {t.dtype for t in eng.file.tensors.values() if t.layout == "tiled"} <= {"q4_0", "q4_1"}
    assert DEFAULT_MODEL.stat().st_size <= 15e6


def test_it_generates_a_story():
    with Engine.load(threads=1) as eng:
        c = eng.complete("Once upon a time", max_tokens=40, temperature=0)
    assert len(c.tokens) >= 10 and len(c.text.split()) >= 8


def test_engine_perplexity_within_3_percent_of_the_float_checkpoint():
    with Engine.load(threads=1) as eng:
        fe = eng.file.metadata["float_eval"]
        windows = np.load(Path(str(resources.files("cflow") / "models" / fe["file"])))
        assert windows.shape == (fe["windows"], fe["seq_len"] + 1)
        flat = windows.reshape(-1)
        starts = np.arange(len(windows)) * windows.shape[1]
        res = evaluate_windows(eng, flat, starts, fe["seq_len"])
    assert res.n_tokens == fe["tokens"]
    assert abs(res.ppl / fe["ppl"] - 1) <= 0.03, (res.ppl, fe["ppl"])
