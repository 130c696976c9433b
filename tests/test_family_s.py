"""The MoE family's "-s" presets at their own geometry (13.3M parameters, 8 experts top-2): a few
training steps lower the loss, the checkpoint exports, and the engine follows the PyTorch reference
teacher-forced on the exported weights, for each preset's delays (arch1: none, arch4: delta_expert 2,
arch2_4_combined: delta_dense 1 and delta_expert 2). Tolerances are test_engine's."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cflow.config import ModelConfig  # noqa: E402
from cflow.convert.checkpoint import convert_checkpoint  # noqa: E402
from cflow.model import ReferenceDecoder, Transformer  # noqa: E402
from cflow.runtime import Engine  # noqa: E402
from cflow.train.loop import TrainConfig, train  # noqa: E402

from test_engine import MAX_TOL, MEDIAN_TOL, rel_err  # noqa: E402

FAMILY = ("arch1-s", "arch4-s", "arch2_4_combined-s")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("preset", FAMILY)
def test_trains_exports_and_the_engine_follows_the_reference(preset, cache, tmp_path):
    cfg = ModelConfig.from_name(preset)
    assert cfg.n_experts == 8 and cfg.top_k == 2 and cfg.d_model == 192
    tc = TrainConfig(steps=12, batch_size=4, seq_len=64, lr=3e-3, warmup=2, eval_every=0, eval_windows=4,
                     log_every=1, threads=1, cache_dir=cache, vocab_size=1024)
    res = train(cfg, tc, out_dir=tmp_path / "ckpt")
    ce = [h["ce"] for h in res.history]
    assert np.mean(ce[-3:]) < np.mean(ce[:3]) - 0.3, ce
    path = tmp_path / "m.cflow"
    convert_checkpoint(tmp_path / "ckpt", path, quant="q8_0")
    ref = ReferenceDecoder(Transformer.from_cflow(path))
    with Engine.load(path, threads=1) as eng:
        assert (eng.config.delta_dense, eng.config.delta_expert) == (cfg.delta_dense, cfg.delta_expert)
        toks = eng.encode("Once upon a time, a little cat named Tom found a red ball in the big green park.")
        errs = []
        for pos, t in enumerate(toks[:48]):
            lr, le = ref.step(t).numpy(), eng.step(t, pos)
            errs.append(rel_err(le, lr))
    # A dozen steps leave the logits nearly flat (no position decisive enough to compare argmaxes, as
    # test_engine does on planted models): the logit error per position is the check here.
    errs = np.array(errs)
    msg = f"{preset}: max |dlogit| / std per position: {np.round(errs, 3)}"
    assert np.median(errs) <= MEDIAN_TOL and np.mean(errs <= MAX_TOL) >= 0.85, msg

