"""Stopping training with SIGINT / SIGTERM: a checkpoint at a step boundary that --resume continues
exactly; a second signal abandons the save but never the previous checkpoint."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from cflow.cli import main
from cflow.train import checkpoint as ckpt
from cflow.train import loop
from cflow.train.loop import TrainInterrupted, train
from test_train_loop import TINY_SETS, cache_dir, corpus_file, one_thread, tc, tiny_cfg  # noqa: F401 (fixtures)

SIGNALS = [signal.SIGINT, signal.SIGTERM]


@pytest.fixture
def signals_fail_the_test():
    """A signal that train() leaves unhandled fails the test instead of stopping (or killing) pytest."""
    def unhandled(signum, frame):
        raise AssertionError(f"{signal.Signals(signum).name} reached the test: train() did not handle it")

    old = {s: signal.signal(s, unhandled) for s in SIGNALS}
    yield unhandled
    for s, h in old.items():
        signal.signal(s, h)


def signal_at_step(monkeypatch, step: int, signum: int) -> None:
    """Send `signum` to this process just as training finishes `step` (inside the step)."""
    real = loop._Run.train_step

    def train_step(self):
        row = real(self)
        if self.step == step:
            os.kill(os.getpid(), signum)
        return row

    monkeypatch.setattr(loop._Run, "train_step", train_step)


def assert_same_run(a, b) -> None:
    for name, w in a.weights.items():
        assert torch.equal(w, b.weights[name]), name
    assert a.train_state["step"] == b.train_state["step"]


@pytest.mark.parametrize("signum", SIGNALS)
def test_signal_saves_at_the_step_and_resume_is_exact(tc, tmp_path, monkeypatch, signals_fail_the_test, signum):
    cfg = tiny_cfg("arch2_4_combined")
    straight = train(cfg, tc, out_dir=tmp_path / "a")
    signal_at_step(monkeypatch, 3, signum)
    with pytest.raises(TrainInterrupted) as info:
        train(cfg, tc, out_dir=tmp_path / "b")
    e = info.value
    assert (e.signum, e.step, e.total, e.saved, e.saved_step) == (signum, 3, 10, True, 3)
    assert e.exit_status == {signal.SIGINT: 130, signal.SIGTERM: 143}[signum]
    assert signal.getsignal(signal.SIGINT) is signals_fail_the_test  # handlers put back
    monkeypatch.undo()

    assert ckpt.load_checkpoint(tmp_path / "b").train_state["step"] == 3
    resumed = train(cfg, tc, out_dir=tmp_path / "b", resume=True)
    assert [r["step"] for r in resumed.history] == list(range(4, 11))
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in straight.history[3:]]
    assert_same_run(ckpt.load_checkpoint(tmp_path / "a"), ckpt.load_checkpoint(tmp_path / "b"))


def test_second_signal_abandons_the_save_and_keeps_the_previous_checkpoint(tc, tmp_path, monkeypatch,
                                                                          signals_fail_the_test):
    cfg = tiny_cfg("arch1")
    tc = dataclasses.replace(tc, save_every=2, eval_every=0)
    signal_at_step(monkeypatch, 3, signal.SIGINT)
    real_save = torch.save

    def save_with_second_ctrl_c(obj, f, *a, **k):  # train_state.pt, halfway through the checkpoint
        if isinstance(obj, dict) and obj.get("step") == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save_with_second_ctrl_c)
    with pytest.raises(TrainInterrupted) as info:
        train(cfg, tc, out_dir=tmp_path / "c")
    monkeypatch.undo()
    e = info.value
    assert (e.step, e.saved, e.saved_step, e.exit_status) == (3, False, 2, 130)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no half-written temporaries
    assert ckpt.load_checkpoint(tmp_path / "c").train_state["step"] == 2
    res = train(cfg, tc, out_dir=tmp_path / "c", resume=True, until_step=4)
    assert [r["step"] for r in res.history] == [3, 4]


# A `cflow train` whose step 2 waits (at most a minute) for the test's signal, so the stop lands at
# step 2 however slowly the processes run; a plain KeyboardInterrupt or death also ends the wait.
HOLD_AT_STEP_2 = """
import sys, time
from cflow.train import loop
real = loop._Run.train_step
def train_step(self):
    row = real(self)
    deadline = time.monotonic() + 60
    while self.step == 2 and not getattr(getattr(self, "signals", None), "signum", 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    return row
loop._Run.train_step = train_step
from cflow.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signum", SIGNALS)
def test_cli_signal_then_resume_matches_an_uninterrupted_run(capsys, tmp_path, corpus_file, cache_dir, signum):
    args = ["train", "--preset", "arch2_4_combined", *[a for s in TINY_SETS for a in ("--set", s)],
            "--steps", "5", "--eval-every", "3", "--eval-windows", "4", "--log-every", "1", "--batch-size", "4",
            "--seq-len", "32", "--data", corpus_file, "--cache-dir", cache_dir, "--vocab-size", "320",
            "--threads", "1", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "straight")]) == 0  # also fills the caches for the child
    out = tmp_path / "x"
    proc = subprocess.Popen([sys.executable, "-c", HOLD_AT_STEP_2, *args, "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = out / ckpt.LOG_NAME
    deadline = time.monotonic() + 120
    while not (log.is_file() and log.read_text().count("\n") >= 2):  # the header and step 1
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the child never logged step 1"
        time.sleep(0.02)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err
    name = signal.Signals(signum).name
    assert f"cflow train: {name}: stopped at step 2 of 5; checkpoint saved to {out}\n" in err
    assert f"cflow train: continue with: cflow train --out {out} --resume\n" in err and "Traceback" not in err
    assert ckpt.load_checkpoint(out).train_state["step"] == 2

    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert "step 5" in capsys.readouterr().out
    assert_same_run(ckpt.load_checkpoint(tmp_path / "straight"), ckpt.load_checkpoint(out))
    logs = [(d / ckpt.LOG_NAME).read_text().splitlines() for d in (tmp_path / "straight", out)]
    losses = [[row.split(",")[3] for row in rows[1:]] for rows in logs]  # elapsed and tok/s differ
    assert losses[0] == losses[1] and len(losses[0]) == 5
