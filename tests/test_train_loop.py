"""cflow.train.loop / checkpoint / compare and `cflow train`: learning, exact resume, files, errors."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from cflow import fsutil
from cflow.cli import main
from cflow.config import PRESETS, ModelConfig
from cflow.errors import CflowError
from cflow.model import Transformer
from cflow.train import checkpoint as ckpt
from cflow.train import compare as tcompare
from cflow.train import data as tdata
from cflow.train import loop
from cflow.train.loop import TrainConfig, TrainError, compute_loss, lr_at, make_optimizer, train

TINY = dict(vocab_size=320, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=32)
TINY_MOE = dict(d_expert=32)
TINY_SETS = [f"{k}={v}" for k, v in {**TINY, **TINY_MOE}.items()]


def tiny_cfg(preset: str, **kw) -> ModelConfig:
    over = dict(TINY, **({} if PRESETS[preset]["n_experts"] == 0 else TINY_MOE), **kw)
    return ModelConfig.from_name(preset, **over)


@pytest.fixture(autouse=True)
def one_thread():
    # The tiny models gain nothing from threads, and the test machine is shared.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> str:
    docs = tdata.open_corpus(None).documents()[:120]
    p = tmp_path_factory.mktemp("corpus") / "tiny.jsonl"
    p.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(p)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def tc(corpus_file, cache_dir) -> TrainConfig:
    return TrainConfig(steps=10, batch_size=4, seq_len=32, lr=3e-3, warmup=2, eval_every=5, eval_windows=8,
                       log_every=1, data=corpus_file, vocab_size=320, threads=1, cache_dir=cache_dir)


# ---- schedule, optimizer, loss ---------------------------------------------------------------
def test_lr_schedule_warmup_then_cosine_to_floor():
    tc = TrainConfig(steps=50, lr=1e-2, warmup=5, min_lr_ratio=0.1)
    lrs = [lr_at(s, tc) for s in range(50)]
    assert lrs[:5] == pytest.approx([2e-3, 4e-3, 6e-3, 8e-3, 1e-2])
    assert lrs[5] == pytest.approx(1e-2) and lrs[-1] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[5:], lrs[6:]))
    assert lrs[27] == pytest.approx(1e-3 + 0.5 * 9e-3, rel=0.05)  # halfway down the cosine
    assert TrainConfig(tokens=1000, batch_size=4, seq_len=32).total_steps == 8  # ceil(1000 / 128)


def test_no_weight_decay_on_norms_and_embeddings():
    model = Transformer(tiny_cfg("arch2_4_combined", tie_embeddings=False))
    opt = make_optimizer(model, TrainConfig(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    plain = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert "tok_emb.weight" in plain and "norm.weight" in plain and "layers.0.attn_norm.weight" in plain
    assert {"layers.0.attn.wq.weight", "layers.1.moe.w_gate", "lm_head.weight"} <= decayed
    assert decayed.isdisjoint(plain) and len(decayed | plain) == len(list(model.parameters()))


def test_loss_adds_weighted_aux_terms():
    torch.manual_seed(0)
    model = Transformer(tiny_cfg("arch1"))
    x = torch.randint(0, 320, (2, 16))
    y = torch.randint(0, 320, (2, 16))
    tc = TrainConfig(lb_weight=0.5, z_weight=0.25)
    loss, ce, lb, rz, _ = compute_loss(model, x, y, tc)
    logits, aux = model(x)
    ref_ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 320), y.reshape(-1))
    assert ce.item() == pytest.approx(ref_ce.item(), rel=1e-6)
    assert loss.item() == pytest.approx(ref_ce.item() + 0.5 * aux["load_balance"].item()
                                        + 0.25 * aux["router_z"].item(), rel=1e-6)
    assert lb.item() > 0.5 and rz.item() > 0  # balance loss is ~1 when roughly uniform


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_overfits_a_tiny_batch(preset):
    torch.manual_seed(0)
    cfg = tiny_cfg(preset)
    model = Transformer(cfg)
    tc = TrainConfig(lr=1e-2, weight_decay=0.0)
    opt = make_optimizer(model, tc)
    seq = torch.randint(2, cfg.vocab_size, (3, 17))  # [B, T+1] random tokens: only memorising helps
    x, y = seq[:, :-1], seq[:, 1:]
    losses = []
    for _ in range(60):
        loss, ce, *_ = compute_loss(model, x, y, tc)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(ce.item())
    assert losses[0] == pytest.approx(math.log(cfg.vocab_size), rel=0.1)  # starts near uniform
    assert losses[-1] < losses[0] / 8, f"{preset}: {losses[0]:.3f} -> {losses[-1]:.3f}"


# ---- the loop: learning, checkpoint files, exact resume --------------------------------------
def test_train_learns_and_writes_a_design_checkpoint(tc, tmp_path):
    cfg = tiny_cfg("arch2_4_combined")
    tc = dataclasses.replace(tc, steps=30, lr=1e-2, eval_every=10)
    res = train(cfg, tc, out_dir=tmp_path / "run", meta={"command": "test"})
    assert [e["step"] for e in res.evals] == [10, 20, 30]
    losses = [e["val_loss"] for e in res.evals]
    assert losses == sorted(losses, reverse=True) and losses[-1] < math.log(320) - 1.2  # uniform: ln V
    assert res.evals[-1]["val_ppl"] == pytest.approx(math.exp(res.evals[-1]["val_loss"]))
    assert 0 < res.evals[-1]["val_acc"] < 1
    assert res.steps == 30 and res.tokens_seen == 30 * 4 * 32

    out = tmp_path / "run"
    assert ckpt.is_checkpoint(out) and (out / ckpt.LOG_NAME).is_file()
    assert not list(tmp_path.glob("run.*"))  # no temporaries left
    c = ckpt.load_checkpoint(out)
    assert c.config == res.config and c.config.vocab_size == 320
    names = set(c.weights)
    assert "tok_emb.weight" in names and "lm_head.weight" not in names  # tied
    assert {"layers.2.attn.wq.weight", "layers.2.ffn.w_gate.weight", "layers.2.moe.router.weight",
            "layers.2.moe.w_down", "layers.2.moe_norm.weight", "norm.weight"} <= names
    assert c.weights["layers.0.moe.w_gate"].shape == (4, 32, 32)
    assert c.meta["tokens_seen"] == 3840 and c.meta["eval"]["step"] == 30 and c.meta["command"] == "test"
    assert c.train_state["step"] == 30 and "optimizer" in c.train_state
    # The saved weights reproduce the trained model exactly.
    reloaded = Transformer.from_state(c.config, c.weights)
    x = torch.randint(0, 320, (2, 32))
    assert torch.equal(reloaded(x)[0], res.model(x)[0])
    with open(out / ckpt.LOG_NAME) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 31))
    assert float(rows[9]["val_loss"]) == pytest.approx(res.evals[0]["val_loss"], rel=1e-5)


@pytest.mark.parametrize("preset", ["arch2_4_combined", "llama"])
def test_resume_continues_exactly(tc, tmp_path, preset):
    cfg = tiny_cfg(preset)
    straight = train(cfg, tc, out_dir=tmp_path / "a")
    first = train(cfg, tc, out_dir=tmp_path / "b", until_step=5)
    assert first.steps == 5 and ckpt.load_checkpoint(tmp_path / "b").train_state["step"] == 5
    second = train(cfg, tc, out_dir=tmp_path / "b", resume=True)
    assert [r["step"] for r in second.history] == list(range(6, 11))
    assert [r["loss"] for r in first.history + second.history] == [r["loss"] for r in straight.history]
    assert [e["val_loss"] for e in second.evals] == [e["val_loss"] for e in straight.evals[1:]]
    for (n, p), (_, q) in zip(straight.model.named_parameters(), second.model.named_parameters()):
        assert torch.equal(p, q), n
    with open(tmp_path / "b" / ckpt.LOG_NAME) as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(1, 11))


def test_resume_drops_log_rows_past_the_checkpoint(tc, tmp_path):
    cfg = tiny_cfg("arch1")
    train(cfg, dataclasses.replace(tc, save_every=4), out_dir=tmp_path / "r", until_step=4)
    with open(tmp_path / "r" / ckpt.LOG_NAME, "a") as f:  # a run that died after logging step 5
        f.write("5,640,0.003,9.9,9.9,1,1,1,,,,1,1\n")
    train(cfg, tc, out_dir=tmp_path / "r", resume=True, until_step=6)
    with open(tmp_path / "r" / ckpt.LOG_NAME) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6] and float(rows[4]["loss"]) != 9.9


def test_run_errors_are_named_and_helpful(tc, tmp_path):
    cfg = tiny_cfg("arch1")
    train(cfg, dataclasses.replace(tc, steps=2, eval_every=0), out_dir=tmp_path / "x")
    with pytest.raises(TrainError, match="already holds a checkpoint"):
        train(cfg, tc, out_dir=tmp_path / "x")
    with pytest.raises(TrainError, match="batch_size"):
        train(cfg, dataclasses.replace(tc, batch_size=8), out_dir=tmp_path / "x", resume=True)
    with pytest.raises(TrainError, match="d_model"):
        train(tiny_cfg("arch1", d_model=48), tc, out_dir=tmp_path / "x", resume=True)
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        train(cfg, tc, out_dir=tmp_path / "nothing", resume=True)
    with pytest.raises(TrainError, match="max_seq_len"):
        train(cfg, dataclasses.replace(tc, seq_len=64), out_dir=None)
    with pytest.raises(TrainError, match="steps must be positive"):
        TrainConfig(steps=0)


def test_checkpoint_save_is_atomic_and_recovers(tc, tmp_path, monkeypatch):
    cfg = tiny_cfg("arch1")
    res = train(cfg, dataclasses.replace(tc, steps=2, eval_every=0), out_dir=tmp_path / "c")
    before = (tmp_path / "c" / "model.safetensors").read_bytes()

    import safetensors.torch

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(fsutil.WriteError, match=f"^cannot write {tmp_path / 'c'}: disk full$"):
        ckpt.save_checkpoint(tmp_path / "c", weights=ckpt.model_weights(res.model), config=cfg,
                             tokenizer_json=res.tokenizer_json)
    monkeypatch.undo()
    assert (tmp_path / "c" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    # A crash between the two renames leaves only c.old-*: loading puts it back.
    (tmp_path / "c").rename(tmp_path / "c.old-abc")
    assert ckpt.load_checkpoint(tmp_path / "c").config == res.config


def test_interrupt_between_the_renames_puts_the_previous_checkpoint_back(tc, tmp_path, monkeypatch):
    cfg = tiny_cfg("arch1")
    res = train(cfg, dataclasses.replace(tc, steps=2, eval_every=0), out_dir=tmp_path / "c")
    before = (tmp_path / "c" / "model.safetensors").read_bytes()
    real_rename, renames = os.rename, []

    def rename(src, dst):  # a second Ctrl-C lands after c -> c.old-*, before c.tmp-* -> c
        renames.append(dst)
        if len(renames) == 2:
            raise KeyboardInterrupt
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path / "c", weights=ckpt.model_weights(res.model), config=cfg,
                             tokenizer_json=res.tokenizer_json)
    monkeypatch.undo()
    assert ckpt.is_checkpoint(tmp_path / "c") and sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    assert (tmp_path / "c" / "model.safetensors").read_bytes() == before


def test_checkpoints_are_periodic_by_default(capsys):
    assert TrainConfig().save_every == 200
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "Ctrl-C/SIGTERM (default 200)" in " ".join(capsys.readouterr().out.split())


# ---- locations that cannot be written: one line, before any training ------------------------
def _not_a_directory(tmp_path):
    (tmp_path / "a-file").write_text("a regular file, so nothing can be created under it, even by root")
    return tmp_path / "a-file" / "run", "Not a directory"


UNWRITABLE = {  # name -> (tmp_path -> (path, the reason the OS gives)); each fails for root as well
    "proc": lambda tmp_path: (Path("/proc/cflow-test/run"), "No such file or directory"),
    "under-a-file": _not_a_directory,
}


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory on a read-only tmpfs (chmod does not stop root; a read-only mount does)."""
    d = tmp_path / "ro"
    d.mkdir()
    if not shutil.which("mount") or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)],
                                                   capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here")
    yield d
    subprocess.run(["umount", str(d)], check=True)


@pytest.mark.parametrize("where", sorted(UNWRITABLE))
def test_unwritable_out_fails_before_training(tc, tmp_path, monkeypatch, where):
    out, reason = UNWRITABLE[where](tmp_path)
    monkeypatch.setattr(loop, "_prepare", lambda *a: pytest.fail("prepared data for a run it cannot save"))
    with pytest.raises(fsutil.WriteError, match=f"^cannot write {out}: {reason}$") as info:
        train(tiny_cfg("arch1"), tc, out_dir=out)
    assert isinstance(info.value, CflowError) and isinstance(info.value, OSError)


def _cli_error(capsys, out: Path, corpus_file: str, cache_dir: str) -> str:
    """Run a tiny `cflow train --out OUT` that must fail with status 2; return its stderr."""
    rc = main(["train", "--preset", "arch1", *[a for s in TINY_SETS for a in ("--set", s)], "--steps", "2",
               "--data", corpus_file, "--cache-dir", cache_dir, "--vocab-size", "320", "--batch-size", "4",
               "--seq-len", "32", "--threads", "1", "--no-progress", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2, err
    return err


def test_cli_read_only_out_is_one_line(capsys, read_only_dir, corpus_file, cache_dir):
    out = read_only_dir / "run"
    err = _cli_error(capsys, out, corpus_file, cache_dir)
    assert err == f"cflow train: error: cannot write {out}: Read-only file system\n"


@pytest.mark.parametrize("where", sorted(UNWRITABLE))
def test_cli_unwritable_out_is_one_line(capsys, tmp_path, corpus_file, cache_dir, where):
    out, reason = UNWRITABLE[where](tmp_path)
    assert _cli_error(capsys, out, corpus_file, cache_dir) == f"cflow train: error: cannot write {out}: {reason}\n"


def test_compare_checks_its_directories_before_training(tmp_path, monkeypatch):
    monkeypatch.setattr(tcompare, "train", lambda *a, **k: pytest.fail("trained for a report it cannot write"))
    report, reason = _not_a_directory(tmp_path)
    with pytest.raises(fsutil.WriteError, match=f"^cannot write {report}/train_compare.md: {reason}$"):
        tcompare.compare(["arch1"], tokens=640, out_dir=report, runs_dir=tmp_path / "runs")
    with pytest.raises(fsutil.WriteError, match=f"^cannot write {report}/arch1: {reason}$"):
        tcompare.compare(["arch1"], tokens=640, out_dir=tmp_path / "res", runs_dir=report)


def test_loss_plot_that_cannot_be_written_is_a_write_error(tmp_path):
    pytest.importorskip("matplotlib")
    s = tcompare.RunSummary("arch1", 1, 2, 256, 5.0, 148.4, 0.1, 1.0, 256.0, None, curve=[(128, 5.5), (256, 5.0)])
    path, reason = _not_a_directory(tmp_path)
    with pytest.raises(fsutil.WriteError, match=f"^cannot write {path}/loss.png: {reason}$"):
        tcompare.plot_losses([s], path / "loss.png")


# ---- CLI -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,msg", [
    (["--set", "not_a_field=3"], "unknown config key 'not_a_field'"),
    (["--set", "d_model=wide"], "d_model='wide': expected a value of type int"),
    (["--set", "tie_embeddings=maybe"], "tie_embeddings"),
    (["--set", "d_model"], "must look like key=value"),
    (["--set", "n_kv_heads=3"], "divisible by n_kv_heads"),
])
def test_cli_rejects_bad_overrides(capsys, tmp_path, bad, msg):
    rc = main(["train", "--preset", "arch1", "--out", str(tmp_path / "o"), "--steps", "1", *bad])
    err = capsys.readouterr().err
    assert rc == 2 and msg in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_cli_train_then_resume(capsys, tmp_path, corpus_file, cache_dir):
    common = ["--data", corpus_file, "--cache-dir", cache_dir, "--vocab-size", "320", "--batch-size", "4",
              "--seq-len", "32", "--threads", "1", "--no-progress", "--eval-windows", "4"]
    out = tmp_path / "cli"
    rc = main(["train", "--preset", "arch4", *[a for s in TINY_SETS for a in ("--set", s)],
               "--steps", "6", "--eval-every", "3", "--out", str(out), *common])
    text = capsys.readouterr().out
    assert rc == 0 and "trained arch4" in text and "validation: loss" in text
    assert ckpt.load_checkpoint(out).config.d_model == 32
    # --resume takes the saved settings; flags given override them (here: a longer run).
    rc = main(["train", "--out", str(out), "--resume", "--steps", "8", "--no-progress"])
    assert rc == 0 and "step 8" in capsys.readouterr().out
    c = ckpt.load_checkpoint(out)
    assert c.train_state["step"] == 8 and c.config.name == "arch4"


def test_cli_help_lists_flags(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for flag in ("--preset", "--set", "--data", "--out", "--steps", "--tokens", "--batch-size", "--seq-len",
                 "--lr", "--warmup", "--eval-every", "--save-every", "--resume", "--seed", "--lb-weight",
                 "--z-weight", "--threads", "--vocab-size", "torchrun"):
        assert flag in text


# ---- comparison ------------------------------------------------------------------------------
def test_compare_writes_table_json_and_plot(tc, tmp_path, capsys):
    rc = main(["train", "compare", "--presets", "arch1", "arch5", "--tokens", "640",
               *[a for s in TINY_SETS for a in ("--set", s)], "--data", tc.data, "--cache-dir", tc.cache_dir,
               "--vocab-size", "320", "--batch-size", "4", "--seq-len", "32", "--threads", "1", "--warmup", "1",
               "--eval-windows", "4", "--no-progress", "--out", str(tmp_path / "res"),
               "--runs-dir", str(tmp_path / "runs")])
    assert rc == 0 and "report:" in capsys.readouterr().out
    md = (tmp_path / "res" / "train_compare.md").read_text()
    table = md.split("| preset | runs |", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| arch")]
    assert [r.split("|")[1].strip() for r in rows] == ["arch1", "arch5"]
    assert "cflow train compare" in md and "640 tokens per run" in md
    data = json.loads((tmp_path / "res" / "train_compare.json").read_text())
    a1, a5 = data["runs"]
    assert a1["tokens"] == a5["tokens"] == 640 and a1["steps"] == 5
    assert a5["params"] < a1["params"]  # arch5 shares 2 weight sets across 3 layers
    assert a1["dag"]["critical_bytes"] == a1["dag"]["total_bytes"]  # arch1 is one sequential chain
    assert a5["dag"]["critical_bytes"] < a5["dag"]["total_bytes"]
    assert math.isfinite(a1["val_loss"]) and 0 <= a1["val_acc"] <= 1
    png = (tmp_path / "res" / "train_compare_loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_compare_pairs_seeds_and_resumes_what_is_on_disk(tc, tmp_path, monkeypatch):
    """Two presets x two seeds; run again, nothing is trained (the runs are read back, same numbers);
    a run stopped part-way continues to its end; a runs directory of another budget is refused."""
    base = dataclasses.replace(tc, eval_every=0, warmup=1, eval_windows=4)
    over = TINY_SETS
    runs, res = tmp_path / "runs", tmp_path / "res"
    first = tcompare.compare(["arch1", "arch4"], base=base, tokens=640, overrides=over, seeds=[1, 2],
                             runs_dir=runs, out_dir=res)
    assert [(s.preset, s.seed) for s in first] == [("arch1", 1), ("arch4", 1), ("arch1", 2), ("arch4", 2)]
    assert all(s.steps == 5 and len(s.curve) == 5 and math.isfinite(s.val_loss) for s in first)
    md = (res / "train_compare.md").read_text()
    d = tcompare.paired_differences(first)["arch4"]
    assert d["seeds"] == [1, 2] and d["diffs"] == [first[1].val_loss - first[0].val_loss,
                                                   first[3].val_loss - first[2].val_loss]
    assert "Paired difference of validation loss from arch1" in md and f"1: {d['diffs'][0]:+.4f}" in md
    assert first[0].active_params < first[0].params  # top-1 of 2 experts
    assert len({s.data_key for s in first}) == 1 and first[0].data_key and first[0].train_tokens > 640
    assert f"Corpus: {first[0].train_tokens:,} training tokens, {first[0].val_tokens:,} held out; " \
           f"{640 / first[0].train_tokens:.2f} epochs per run; data key {first[0].data_key[:12]}" in md
    monkeypatch.setattr(tcompare, "train", lambda *a, **k: pytest.fail("a finished run was trained again"))
    again = tcompare.compare(["arch1", "arch4"], base=base, tokens=640, overrides=over, seeds=[1, 2],
                             runs_dir=runs, out_dir=res)
    assert [(s.val_loss, s.curve) for s in again] == [(s.val_loss, s.curve) for s in first]
    monkeypatch.undo()
    # a run that stopped at step 2 of 5 resumes: its curve spans both segments
    from cflow.train.loop import train

    cfg = ModelConfig.from_name("arch1").with_overrides(over)
    part = dataclasses.replace(base, tokens=640, seed=3, eval_every=5, warmup=1)
    train(cfg, part, out_dir=tmp_path / "runs2" / "arch1" / "seed3", until_step=2)
    resumed = tcompare.compare(["arch1"], base=base, tokens=640, overrides=over, seeds=[3],
                               runs_dir=tmp_path / "runs2", out_dir=res)
    assert resumed[0].steps == 5 and [t for t, _ in resumed[0].curve] == [128, 256, 384, 512, 640]
    with pytest.raises(tcompare.CompareError, match="holds a run with other settings"):
        tcompare.compare(["arch1"], base=base, tokens=1280, overrides=over, seeds=[1], runs_dir=runs, out_dir=res)


def test_compare_refuses_runs_of_a_corpus_that_changed_at_the_same_path(tc, tmp_path, monkeypatch):
    """A finished run is read back, not retrained; if the file at --data now holds another corpus,
    the table would pair runs of two corpora: refused at the first run that disagrees, no report."""
    corpus = tmp_path / "corpus.jsonl"
    docs = Path(tc.data).read_text().splitlines(keepends=True)
    corpus.write_text("".join(docs))
    base = dataclasses.replace(tc, data=str(corpus), eval_every=0, warmup=1, eval_windows=4)
    runs, res = tmp_path / "runs", tmp_path / "res"
    first = tcompare.compare(["arch1"], base=base, tokens=640, overrides=TINY_SETS, seeds=[1], runs_dir=runs,
                             out_dir=res)
    report = (res / "train_compare.md").read_text()
    corpus.write_text("".join(docs[: len(docs) * 3 // 4]))  # same path, another corpus
    with pytest.raises(tcompare.CompareError, match=r"trained on different data .*seed1.*seed2"):
        tcompare.compare(["arch1"], base=base, tokens=640, overrides=TINY_SETS, seeds=[1, 2], runs_dir=runs,
                         out_dir=res)
    assert (res / "train_compare.md").read_text() == report  # the mixed table was not written
    second = json.loads((runs / "arch1" / "seed2" / "meta.json").read_text())
    assert second["data_key"] != first[0].data_key
    # the same runs again: refused before anything is trained (the keys on disk already disagree)
    monkeypatch.setattr(tcompare, "train", lambda *a, **k: pytest.fail("trained although the runs disagree"))
    with pytest.raises(tcompare.CompareError, match="trained on different data"):
        tcompare.compare(["arch1"], base=base, tokens=640, overrides=TINY_SETS, seeds=[1, 2, 3], runs_dir=runs,
                         out_dir=res)
    # a checkpoint whose meta.json predates the key is checked by its train state's key
    meta_path = runs / "arch1" / "seed1" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["data_key"]
    meta_path.write_text(json.dumps(meta))
    assert tcompare._data_key(runs / "arch1" / "seed1")[1] == first[0].data_key


def test_compare_reads_a_finished_run_back_from_its_record_when_the_checkpoint_is_gone(tc, tmp_path, monkeypatch):
    """Every finished run leaves OUT/runs/PRESET/seedN.json; with its checkpoint deleted (another
    machine) the table is rebuilt from the record alone, same numbers, nothing retrained; a record of
    other settings or an unreadable one is a CompareError naming the file."""
    base = dataclasses.replace(tc, eval_every=0, warmup=1, eval_windows=4)
    runs, res = tmp_path / "runs", tmp_path / "res"
    first = tcompare.compare(["arch1", "arch4"], base=base, tokens=640, overrides=TINY_SETS, seeds=[1],
                             runs_dir=runs, out_dir=res)
    rec = res / "runs" / "arch4" / "seed1.json"
    body = json.loads(rec.read_text())
    assert body["summary"]["run_dir"] == "" and body["train_config"]["tokens"] == 640
    assert body["summary"]["machine"] and "thread(s)" in body["summary"]["machine"]
    shutil.rmtree(runs)
    monkeypatch.setattr(tcompare, "train", lambda *a, **k: pytest.fail("retrained a recorded run"))
    again = tcompare.compare(["arch1", "arch4"], base=base, tokens=640, overrides=TINY_SETS, seeds=[1],
                             runs_dir=runs, out_dir=res)
    for a, b in zip(first, again):
        assert (a.preset, a.val_loss, a.val_curve, a.curve, a.data_key) == (b.preset, b.val_loss, b.val_curve,
                                                                            b.curve, b.data_key)
    assert again[1].run_dir == str(runs / "arch4" / "seed1")
    # another budget: the record is not this comparison's run
    with pytest.raises(tcompare.CompareError, match=r"seed1.json records a run with other settings.*tokens"):
        tcompare.compare(["arch1"], base=base, tokens=960, overrides=TINY_SETS, seeds=[1], runs_dir=runs,
                         out_dir=res)
    with pytest.raises(tcompare.CompareError, match="model config"):
        tcompare.compare(["arch4"], base=base, tokens=640, overrides=[*TINY_SETS, "d_expert=24"], seeds=[1],
                         runs_dir=runs, out_dir=res)
    rec.write_text(rec.read_text()[:100])
    with pytest.raises(tcompare.CompareError, match=r"seed1.json: not a readable run record"):
        tcompare.compare(["arch4"], base=base, tokens=640, overrides=TINY_SETS, seeds=[1], runs_dir=runs,
                         out_dir=res)


def test_the_report_lists_each_machine_when_the_runs_come_from_several(tc):
    def run(seed, machine):
        return tcompare.RunSummary(preset="arch1", params=1, steps=1, tokens=1, val_loss=1.0, val_ppl=2.7,
                                   val_acc=0.1, train_s=1.0, tok_per_s=1.0, dag=None, seed=seed, machine=machine)
    one = tcompare.render_markdown([run(1, "m1"), run(2, "m1")], base=tc, tokens=1, minutes_per_run=None,
                                   overrides=[], command=None, plot=None)
    assert "Machine: m1." in one and "Machines" not in one
    two = tcompare.render_markdown([run(1, "m1"), run(2, "m2")], base=tc, tokens=1, minutes_per_run=None,
                                   overrides=[], command=None, plot=None)
    assert "- m1: arch1 seed 1" in two and "- m2: arch1 seed 2" in two


def test_mean_ci_uses_the_t_quantile():
    m, h = tcompare.mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and abs(h - 4.303 * 1.0 / math.sqrt(3)) < 1e-9
    assert math.isnan(tcompare.mean_ci([1.0])[1])


@pytest.mark.slow
def test_compiled_training_learns_and_checkpoints(tc, tmp_path):
    """--compile (torch.compile of the training step) trains, saves and resumes like the eager loop."""
    from cflow.train.loop import train

    cfg = tiny_cfg("arch2_4_combined")
    run = dataclasses.replace(tc, steps=6, eval_every=3, compile=True)
    res = train(cfg, run, out_dir=tmp_path / "c", until_step=3)
    assert res.steps == 3 and math.isfinite(res.history[-1]["loss"])
    done = train(cfg, run, out_dir=tmp_path / "c", resume=True)
    assert done.steps == 6 and done.evals[-1]["val_loss"] < res.history[0]["ce"]


# ---- the device ------------------------------------------------------------------------------
def test_device_auto_is_the_cpu_without_a_gpu_and_a_named_gpu_is_refused(tc, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert loop.resolve_device(tc) == torch.device("cpu")  # "auto"
    with pytest.raises(TrainError, match="no CUDA GPU"):
        train(tiny_cfg("arch1"), dataclasses.replace(tc, device="cuda"), out_dir=tmp_path / "g")
    assert not (tmp_path / "g").exists() or not ckpt.is_checkpoint(tmp_path / "g")
    with pytest.raises(TrainError, match="device must be"):
        dataclasses.replace(tc, device="tpu")


def test_an_explicit_cpu_device_trains_as_auto_does_without_a_gpu(tc, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = tiny_cfg("arch4")
    a = train(cfg, dataclasses.replace(tc, steps=4), out_dir=tmp_path / "a")
    b = train(cfg, dataclasses.replace(tc, steps=4, device="cpu"), out_dir=tmp_path / "b")
    assert [r["loss"] for r in a.history] == [r["loss"] for r in b.history]
    assert ckpt.load_checkpoint(tmp_path / "b", with_train_state=False).meta["device"] == "cpu"


def test_bf16_precision_on_the_cpu_trains_in_autocast_and_says_so(tc, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = tiny_cfg("arch4")
    fp32 = train(cfg, dataclasses.replace(tc, steps=6), out_dir=tmp_path / "fp32")
    seen = []
    real = loop.compute_loss

    def spy(model, x, y, tc_):
        seen.append(torch.is_autocast_enabled("cpu"))
        return real(model, x, y, tc_)

    monkeypatch.setattr(loop, "compute_loss", spy)
    bf16 = train(cfg, dataclasses.replace(tc, steps=6, precision="bf16"), out_dir=tmp_path / "bf16")
    assert seen and all(seen), "the steps did not run in autocast"
    losses = [r["loss"] for r in bf16.history]
    assert losses != [r["loss"] for r in fp32.history]  # bf16 matmuls round differently
    assert losses[-1] < losses[0]  # and it still learns
    assert ckpt.load_checkpoint(tmp_path / "bf16", with_train_state=False).meta["device"] == "cpu (bf16 autocast)"
    assert ckpt.load_checkpoint(tmp_path / "fp32", with_train_state=False).meta["device"] == "cpu"
    with pytest.raises(TrainError, match="precision must be one of auto, bf16, fp32"):
        dataclasses.replace(tc, precision="fp16")
