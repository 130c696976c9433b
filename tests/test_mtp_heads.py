"""`cflow train heads`: multi-token prediction heads onto a trained model (cflow.train.heads), and
the engine's lm_head for the heads' outputs (cf_engine_lm_head).

- the engine's lm_head of a pass's own hidden states is that pass's logits, bit for bit (any
  thread count, one row or several);
- on the shipped default model, a short run writes a file whose every tensor but the heads is the
  source's byte for byte, whose logits are the source's bit for bit, whose heads agree with the
  model's own next choices far above untrained heads (~0.02), and whose greedy `--spec mtp` output
  is plain greedy's; the report carries the recipe;
- refusals: the source as --out, an existing --out without --overwrite, a source that is not a
  .cflow file, a bad setting (each a HeadsError naming the fix; the CLI exits 2).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cflow.fileformat import open_model, read_header  # noqa: E402
from cflow.runtime import Engine  # noqa: E402
from cflow.train import heads as hmod  # noqa: E402

DEFAULT = Path(hmod.__file__).resolve().parents[1] / "models" / "default.cflow"
SMALL = hmod.HeadsConfig(n_heads=2, tokens=6000, val_tokens=1500, continuation=64, n_seq=16, steps=150,
                         batch_size=256, warmup=10, threads=1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("heads") / "default-mtp.cflow"
    res = hmod.train_model_heads(DEFAULT, out, SMALL, command="test")
    return res, out


# ---- the engine's lm_head ------------------------------------------------------------------------
@pytest.mark.parametrize("threads", [1, 2])
def test_lm_head_of_the_hidden_states_is_the_pass_logits_bit_for_bit(threads):
    eng = Engine.load(DEFAULT, threads=threads)
    eng.keep_hidden = True
    toks = eng.encode("Once upon a time, a small fox found a key")
    logits = eng.prefill(toks).copy()
    out = np.zeros((1, eng.config.vocab_size), np.float32)
    eng._native.lm_head(np.ascontiguousarray(eng.hidden()), out)
    assert np.array_equal(out[0], logits)
    n = len(toks)
    rows = eng.step_rows([0] * 3, [5, 6, 7], range(n, n + 3)).copy()
    out = np.zeros((3, eng.config.vocab_size), np.float32)
    eng._native.lm_head(np.ascontiguousarray(eng.hidden()), out)
    assert np.array_equal(out, rows)
    with pytest.raises(ValueError, match="lm_head"):
        eng._native.lm_head(np.zeros((1, 7), np.float32), out[:1])
    eng.close()


# ---- cflow train heads ---------------------------------------------------------------------------
def test_the_new_file_is_the_source_byte_for_byte_plus_heads(trained):
    res, out = trained
    src, new = open_model(DEFAULT), open_model(out, verify=True)
    assert new.config.mtp_heads == 2 and src.config.mtp_heads == 0
    assert dataclasses.replace(new.config, mtp_heads=0) == src.config
    assert set(new.tensors) - set(src.tensors) == {f"mtp.{j}.{s}" for j in range(2) for s in ("w_up", "w_down", "norm")}
    for name in src.tensors:
        assert np.array_equal(new.array(name), src.array(name)), name
    meta = read_header(out)["metadata"]["mtp"]
    assert meta["train_tokens"] == res.train_tokens == SMALL.tokens and meta["command"] == "test"
    assert meta["val_top1"] == res.val_top1 and len(res.val_top1) == 2
    src.close()
    new.close()


def test_heads_learn_the_model_and_speculation_stays_plain_greedy(trained):
    res, out = trained
    # untrained heads start as copies of the next-token prediction: ~0.02 agreement two ahead
    assert res.val_top1[0] > 0.25, res.val_top1
    assert res.val_chain[1] <= res.val_chain[0] and res.accepted_per_round == pytest.approx(sum(res.val_chain))
    a, b = Engine.load(DEFAULT, threads=1), Engine.load(out, threads=1)
    toks = a.encode("The little robot looked at the moon and")
    assert np.array_equal(a.prefill(toks), b.prefill(toks))
    for prompt in ("Once upon a time, there was a girl named Lily.", "The little robot looked at the moon and"):
        a.reset()
        b.reset()
        plain = a.complete(prompt, 60, temperature=0)
        spec = b.complete(prompt, 60, temperature=0, speculative="mtp")
        assert spec.tokens == plain.tokens
        assert spec.timings.drafted > 0
    a.close()
    b.close()


def test_refusals_name_the_fix(tmp_path, trained):
    _, out = trained
    with pytest.raises(hmod.HeadsError, match="source model itself"):
        hmod.train_model_heads(out, out, SMALL)
    with pytest.raises(hmod.HeadsError, match="--overwrite"):
        hmod.train_model_heads(DEFAULT, out, SMALL)
    bad = tmp_path / "notes.cflow"
    bad.write_text("not a model")
    with pytest.raises(hmod.HeadsError, match="not a .cflow model"):
        hmod.train_model_heads(bad, tmp_path / "x.cflow", SMALL)
    with pytest.raises(hmod.HeadsError, match="not a file"):
        hmod.train_model_heads(tmp_path / "missing.cflow", tmp_path / "x.cflow", SMALL)
    with pytest.raises(hmod.HeadsError, match="--mtp"):
        hmod.HeadsConfig(n_heads=0)


def test_cli_reports_errors_with_exit_2(tmp_path, capsys):
    from cflow.cli import main

    rc = main(["train", "heads", str(DEFAULT), "--out", str(DEFAULT), "--no-progress"])
    assert rc == 2
    assert "source model itself" in capsys.readouterr().err
    rc = main(["train", "heads", str(DEFAULT), "--out", str(tmp_path / "x.cflow"), "--mtp", "0"])
    assert rc == 2
    assert "--mtp must be >= 1" in capsys.readouterr().err
