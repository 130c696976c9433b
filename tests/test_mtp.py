"""Multi-token prediction heads, end to end: `cflow train --mtp N` -> `cflow export` -> `--spec mtp`.

- training: a tiny model with 2 heads trains a few steps; the main and the heads' losses fall, and
  the evaluation reports each head;
- export: the heads' tensors (f32) and mtp_heads in the header; a file without heads keeps the
  header older cflow wrote (no mtp_heads key) and loads unchanged;
- engine: the final hidden state the C core hands back turns into the heads' logits the PyTorch
  model gives on the same (teacher-forced) input, within the engine-vs-float tolerance of
  tests/test_engine.py; keeping it leaves the main logits bit for bit unchanged; step_rows'
  per-row states are the single steps';
- speculation: greedy `speculative="mtp"` is token for token plain greedy, and every proposal was
  made from the hidden state of the row whose logits chose the newest token;
- named errors: a file declaring heads without their tensors (MtpHeadsError, reader and writer),
  `mtp` asked of a model without heads (NoMtpHeadsError, naming `cflow train --mtp`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from cflow.config import ModelConfig  # noqa: E402
from cflow.convert.checkpoint import convert_checkpoint  # noqa: E402
from cflow.fileformat import MtpHeadsError, TensorData, open_model, read_header, write_model  # noqa: E402
from cflow.model import Transformer  # noqa: E402
from cflow.runtime import Engine, ModelFormatError, Speculative  # noqa: E402
from cflow.runtime import speculative as sp  # noqa: E402
from cflow.runtime.mtp import NoMtpHeadsError  # noqa: E402
from cflow.train import data as tdata  # noqa: E402
from cflow.train.loop import TrainConfig, train  # noqa: E402

TINY = dict(vocab_size=320, d_model=64, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=96, max_seq_len=128)
MEDIAN_TOL, MAX_TOL = 0.04, 0.06  # tests/test_engine.py's engine-vs-float tolerances


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Tiny runs on the shipped stories, each exported: "mtp" 2 heads, 40 steps; "plain" no heads."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("mtp")
    docs = tdata.open_corpus(None).documents()[:200]
    corpus = d / "tiny.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    tc = TrainConfig(steps=40, batch_size=8, seq_len=64, lr=1e-2, warmup=4, eval_every=0, eval_windows=8,
                     log_every=1, data=str(corpus), vocab_size=320, threads=1, cache_dir=str(d / "cache"),
                     save_every=0)
    out = {}
    try:
        for name, heads, steps in (("mtp", 2, 40), ("plain", 0, 2)):
            cfg = ModelConfig.from_name("arch1", **TINY, mtp_heads=heads)
            res = train(cfg, dataclasses.replace(tc, steps=steps), out_dir=d / name)
            path = d / f"{name}.cflow"
            convert_checkpoint(d / name, path, quant="q8_0")
            out[name] = (res, path)
    finally:
        torch.set_num_threads(n)
    return out


# ---- training ------------------------------------------------------------------------------------
def test_training_lowers_main_and_head_losses(runs):
    res, _ = runs["mtp"]
    h = res.history
    first, last = np.mean([r["mtp_ce"] for r in h[:3]]), np.mean([r["mtp_ce"] for r in h[-3:]])
    assert last < first - 1.0, f"the heads' loss did not fall: {first:.3f} -> {last:.3f}"
    assert np.mean([r["ce"] for r in h[-3:]]) < np.mean([r["ce"] for r in h[:3]]) - 1.0
    # the loss is ce + the router's aux terms + mtp_weight x the heads' mean
    r = h[-1]
    assert r["loss"] == pytest.approx(r["ce"] + 0.01 * r["load_balance"] + 0.001 * r["router_z"]
                                      + 0.3 * r["mtp_ce"], rel=1e-5)
    ev = res.evals[-1]
    for j in range(2):
        assert 0 < ev[f"val_mtp{j}_loss"] < 10 and 0 <= ev[f"val_mtp{j}_acc"] <= 1
    assert "mtp_ce" not in runs["plain"][0].history[-1]


# ---- export --------------------------------------------------------------------------------------
def test_export_carries_heads_and_old_files_keep_their_header(runs):
    cf = open_model(runs["mtp"][1])
    assert cf.config.mtp_heads == 2
    names = sorted(n for n in cf.tensors if n.startswith("mtp."))
    assert names == sorted(f"mtp.{j}.{s}" for j in range(2) for s in ("w_up", "w_down", "norm"))
    assert all(cf.tensors[n].dtype == "f32" for n in names)
    plain = read_header(runs["plain"][1])
    assert "mtp_heads" not in plain["config"]  # what older cflow wrote, so older readers read it
    assert not any(n.startswith("mtp.") for n in plain["tensors"])
    eng = Engine.load(runs["plain"][1], threads=1)
    assert eng.config.mtp_heads == 0
    eng.close()


def _rewrite(src: Path, dst: Path, keep, complete: bool = True) -> None:
    cf = open_model(src)
    ts = [TensorData(n, e.dtype, e.shape, e.layout, np.asarray(cf.array(n)).view(np.uint8).ravel(), e.meta)
          for n, e in cf.tensors.items() if keep(n)]
    write_model(dst, config=cf.config, tokenizer=cf.header["tokenizer"], tensors=ts, tile=cf.tile,
                require_complete=complete)


def test_file_declaring_heads_without_their_tensors_is_refused(runs, tmp_path, monkeypatch):
    src = runs["mtp"][1]
    with pytest.raises(MtpHeadsError, match="mtp_heads=2"):  # the writer refuses to write one
        _rewrite(src, tmp_path / "w.cflow", lambda n: not n.startswith("mtp.1."))
    import cflow.fileformat.writer as writer

    monkeypatch.setattr(writer, "check_mtp", lambda cfg, names: None)  # an old or foreign writer
    _rewrite(src, tmp_path / "bad.cflow", lambda n: not n.startswith("mtp.1."), complete=False)
    with pytest.raises(MtpHeadsError, match="lacks 3 of their tensors"):
        open_model(tmp_path / "bad.cflow")
    with pytest.raises(ModelFormatError, match="declares mtp_heads=2"):  # the engine's wrapping of it
        Engine.load(tmp_path / "bad.cflow", threads=1)


# ---- engine --------------------------------------------------------------------------------------
def _tokens(cf_path: Path, n: int) -> list[int]:
    eng = Engine.load(cf_path, threads=1)
    ids = eng.tokenizer.encode("Once upon a time there was a little girl named Lily. She liked to play")
    eng.close()
    return ids[:n]


def test_engine_heads_match_the_pytorch_heads(runs):
    path = runs["mtp"][1]
    toks = _tokens(path, 16)
    model = Transformer.from_cflow(path).eval()
    with torch.no_grad():
        logits, aux = model(torch.tensor([toks]))
    ref = [lg[0].numpy() for lg in aux["mtp_logits"]]  # 2 x [T, V]
    eng = Engine.load(path, threads=1)
    eng.keep_hidden = True
    errs = []
    for p, t in enumerate(toks):
        eng.step(t, p)
        got = eng.mtp.logits(eng.hidden()[0])  # [2, V]
        for j in range(2):
            r = ref[j][p]
            errs.append(float(np.abs(got[j] - r).max() / r.std()))
            assert np.argmax(got[j]) == np.argmax(r) or np.sort(r)[-1] - np.sort(r)[-2] < 0.05 * r.std()
    errs = np.array(errs)
    assert np.median(errs) <= MEDIAN_TOL and errs.max() <= MAX_TOL, np.round(errs, 3)
    eng.close()


def test_keeping_the_hidden_state_changes_no_logit_and_rows_match_steps(runs):
    path = runs["mtp"][1]
    toks = _tokens(path, 12)
    off, on = Engine.load(path, threads=1), Engine.load(path, threads=1)
    on.keep_hidden = True
    hs = []
    for p, t in enumerate(toks):
        a, b = off.step(t, p).copy(), on.step(t, p)
        assert np.array_equal(a, b), f"position {p}: the logits changed with keep_hidden"
        hs.append(on.hidden()[0].copy())
    # one call of several rows: every row's state is the single step's, bit for bit
    on.truncate(4)
    on.step_rows([0] * 8, toks[4:], range(4, 12))
    assert np.array_equal(on.hidden(), np.stack(hs[4:]))
    # the prompt's last row after a prefill
    on.reset()
    on.prefill(toks)
    assert np.array_equal(on.hidden(), hs[-1][None])
    with pytest.raises(Exception, match="keep_hidden"):
        off.hidden()
    off.close()
    on.close()


# ---- speculation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spoil", [False, True])
def test_greedy_mtp_speculation_is_plain_greedy_and_proposes_from_the_right_row(runs, spoil, monkeypatch):
    """spoil: every other round's last proposal is made wrong, so rounds also end on a rejection
    before their last row (the tiny model's text is repetitive enough that its heads are often
    right throughout): the row whose state proposes next then differs from the last row."""
    path = runs["mtp"][1]
    eng = Engine.load(path, threads=1)
    prompt = "Once upon a time there was a little girl named Lily."
    plain = eng.complete(prompt, max_tokens=48, temperature=0, ignore_eos=True)
    seen: list[tuple[int, np.ndarray]] = []
    propose = sp.MtpProposer.propose

    def spy(self, history, k, rng, k_max=None):
        if self.h is not None:
            seen.append((len(history), self.h.copy()))
        out, qs = propose(self, history, k, rng, k_max)
        if spoil and len(out) == 2 and len(seen) % 2:
            out[-1] = (out[-1] + 1) % eng.config.vocab_size
            qs[-1] = (np.array([out[-1]]), np.array([1.0]))  # greedy's q: the point mass at it
        return out, qs

    monkeypatch.setattr(sp.MtpProposer, "propose", spy)
    spec = eng.complete(prompt, max_tokens=48, temperature=0, ignore_eos=True,
                        speculative=Speculative("mtp", min_acceptance=0))
    assert spec.tokens == plain.tokens
    t = eng.last_timings
    assert t.spec == "mtp" and t.rounds > 0 and t.drafted > 0
    assert t.accepted > 0, "the trained heads never guessed right"
    if spoil:
        assert t.accepted < t.drafted - 4
    # each proposal came from the state of position len(history) - 2: the row whose logits chose
    # the newest token (len(history) - 1 is where that token runs next)
    text = list(eng.cached())  # prompt + output as the cache holds it (the last token not run)
    ref = Engine.load(path, threads=1)
    ref.keep_hidden = True
    states = []
    for p, tok in enumerate(text):
        ref.step(tok, p)
        states.append(ref.hidden()[0].copy())
    assert len(seen) >= t.rounds
    for n, h in seen:
        assert np.array_equal(h, states[n - 2]), f"a proposal after {n} tokens used another row's state"
    assert not eng.keep_hidden  # restored after the generation
    eng.close()
    ref.close()


def test_sampled_mtp_speculation_runs_and_reproduces(runs):
    eng = Engine.load(runs["mtp"][1], threads=1)
    a = eng.complete("Lily saw a", max_tokens=24, temperature=0.8, seed=3, speculative="mtp")
    b = eng.complete("Lily saw a", max_tokens=24, temperature=0.8, seed=3, speculative="mtp")
    assert a.tokens == b.tokens and len(a.tokens) == 24
    eng.close()


def test_server_speculates_with_the_heads(runs, monkeypatch):
    """cflow serve's generator (cflow.serve.speculate): jobs with speculative="mtp" beside a plain
    one, at once: greedy jobs give plain greedy's tokens, seeded sampled ones draw exactly what
    Engine.complete(speculative="mtp") draws with the same counts, and every proposal was made
    from the hidden state of the row whose logits chose that job's newest token (spoiled
    proposals make rounds end on rejections too, as in the single-sequence test above)."""
    from cflow.serve.batch import BatchGenerator, Failed
    from cflow.sampling import SamplingParams

    from test_serve_batch import run_job_events

    path = runs["mtp"][1]
    spec = Speculative("mtp", min_acceptance=0)
    sample = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
    texts = ["Once upon a time there was a little girl named Lily.", "Lily saw a", "The dog ran to the park and"]
    with Engine.load(path, threads=1) as eng:
        ids = [eng.encode(t) for t in texts]
        greedy = [eng.complete(i, 32, temperature=0, ignore_eos=True).tokens for i in ids]
        sampled = [eng.complete(i, 24, seed=3 + k, ignore_eos=True, speculative=spec, **sample)
                   for k, i in enumerate(ids)]
    seen: list[tuple[list[int], np.ndarray]] = []
    propose = sp.MtpProposer.propose

    def spy(self, history, k, rng, k_max=None):
        if self.h is not None:
            seen.append((list(history), self.h.copy()))
        out, qs = propose(self, history, k, rng, k_max)
        if len(out) == 2 and len(seen) % 3 == 0 and not self.sampler.params.temperature:
            out[-1] = (out[-1] + 1) % self.heads.out.shape[0]
        return out, qs

    monkeypatch.setattr(sp.MtpProposer, "propose", spy)
    with BatchGenerator.load(path, parallel=3, threads=1, n_ctx=128) as gen:
        jobs = [(i, dict(max_tokens=32, ignore_eos=True, params=SamplingParams(temperature=0),
                         speculative=spec if k != 1 else None)) for k, i in enumerate(ids)]
        pieces, ends = run_job_events(gen, jobs)
        assert not any(isinstance(e, Failed) for e in ends), ends
        for k, (ps, end) in enumerate(zip(pieces, ends)):
            assert [x.token for x in ps] == greedy[k], k
            assert (end.drafted > 0) == (k != 1)
        assert 0 < sum(e.accepted for e in ends) < sum(e.drafted for e in ends)
        outputs = [i + [x.token for x in ps] for i, ps in zip(ids, pieces)]
        jobs = [(i, dict(max_tokens=24, ignore_eos=True, speculative=spec, params=SamplingParams(**sample, seed=3 + k)))
                for k, i in enumerate(ids)]
        pieces, ends = run_job_events(gen, jobs)
        for ps, end, ref in zip(pieces, ends, sampled):
            assert [x.token for x in ps] == ref.tokens
            assert (end.drafted, end.accepted) == (ref.timings.drafted, ref.timings.accepted)
    # the greedy jobs' proposals: the state of position len(history) - 2 of that job's text
    ref = Engine.load(path, threads=1)
    ref.keep_hidden = True
    states = []
    for text in outputs:
        st = []
        for p, tok in enumerate(text):
            ref.step(tok, p)
            st.append(ref.hidden()[0].copy())
        states.append(st)
    ref.close()
    greedy_seen = [(h, x) for h, x in seen if any(o[:len(h)] == h for o in outputs)]
    assert len(greedy_seen) > 10
    for history, h in greedy_seen:
        j = next(j for j, o in enumerate(outputs) if o[:len(history)] == history)
        assert np.array_equal(h, states[j][len(history) - 2]), "a proposal used another row's state"


def test_mtp_without_heads_is_a_named_error(runs):
    eng = Engine.load(runs["plain"][1], threads=1)
    with pytest.raises(NoMtpHeadsError, match="cflow train --mtp"):
        eng.complete("Once", max_tokens=4, speculative="mtp")
    with pytest.raises(sp.SpeculativeError, match="mtp"):
        Speculative("mtp", draft=eng)
    eng.close()


def test_cli_spec_mtp(runs, capsys):
    from cflow.cli import main

    rc = main(["generate", "-m", str(runs["mtp"][1]), "-p", "Once upon a time", "-n", "16", "--temp", "0",
               "--spec", "mtp", "-t", "1"])
    assert rc == 0
    rc = main(["generate", "-m", str(runs["plain"][1]), "-p", "Once", "-n", "4", "--spec", "mtp", "-t", "1"])
    assert rc != 0
    assert "cflow train --mtp" in capsys.readouterr().err
