"""Data-parallel training: 2 gloo processes on 127.0.0.1 against one process on the same global batch."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from cflow.config import ModelConfig
from cflow.train import checkpoint as ckpt
from cflow.train import data as tdata
from cflow.train import loop
from cflow.train.loop import TrainConfig, TrainInterrupted, train

WORLD = 2
CFG = dict(vocab_size=320, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=64, d_expert=32, max_seq_len=32)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, cfg: dict, tcs: list[dict], outs: list[str], result_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    # The worker owns the group, so one group serves both runs (train() joins an existing one).
    torch.distributed.init_process_group("gloo")
    try:
        for i, (tc, out) in enumerate(zip(tcs, outs)):
            res = train(ModelConfig.from_dict(cfg), TrainConfig.from_dict(tc), out_dir=out)
            torch.save({"params": {n: p.detach().clone() for n, p in res.model.named_parameters()},
                        "history": res.history, "evals": res.evals, "rank": res.rank, "world": res.world_size},
                       Path(result_dir) / f"run{i}-rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    docs = tdata.open_corpus(None).documents()[:120]
    (root / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    base = TrainConfig(steps=6, batch_size=4, seq_len=32, lr=3e-3, warmup=2, eval_every=3, eval_windows=8,
                       log_every=1, data=str(root / "c.jsonl"), vocab_size=320, threads=1,
                       cache_dir=str(root / "cache"))
    cfg = ModelConfig.from_name("arch2_4_combined", **CFG)
    return root, cfg, base


def test_ddp_two_processes_match_one(setup):
    """Run 0: lb_weight = 0, so the loss is linear in the tokens and two ranks of 2 sequences must
    reproduce one process of 4 (up to float summation order). Run 1: the default lb_weight, whose
    balance term is computed per rank (documented in cflow.train.loop): ranks must still agree."""
    root, cfg, base = setup
    tc0 = TrainConfig.from_dict({**base.to_dict(), "lb_weight": 0.0})
    tc1 = base
    torch.set_num_threads(1)
    single = train(cfg, tc0, out_dir=root / "single")  # also fills the data cache for the workers

    outs = [str(root / "ddp0"), str(root / "ddp1")]
    mp.spawn(_worker, args=(_free_port(), cfg.to_dict(), [tc0.to_dict(), tc1.to_dict()], outs, str(root)),
             nprocs=WORLD, join=True)
    runs = [[torch.load(root / f"run{i}-rank{r}.pt") for r in range(WORLD)] for i in range(2)]

    for r0, r1 in runs:
        assert (r0["rank"], r1["rank"], r0["world"]) == (0, 1, WORLD)
        for name, p in r0["params"].items():
            assert torch.equal(p, r1["params"][name]), f"ranks disagree on {name}"
        assert [h["loss"] for h in r0["history"]] == [h["loss"] for h in r1["history"]]

    ddp = runs[0][0]
    for name, p in single.model.named_parameters():
        diff = (p.detach() - ddp["params"][name]).abs().max().item()
        assert diff < 5e-6, f"{name}: DDP differs from one process by {diff}"
        assert not torch.equal(p.detach(), Transformer_init(cfg, base.seed)[name]), f"{name} never trained"
    for hs, hd in zip(single.history, ddp["history"]):
        assert hd["loss"] == pytest.approx(hs["loss"], rel=1e-5, abs=1e-6)
    for es, ed in zip(single.evals, ddp["evals"]):
        assert ed["val_loss"] == pytest.approx(es["val_loss"], rel=1e-5)
        assert ed["val_acc"] == pytest.approx(es["val_acc"], abs=1e-9)

    # Rank 0 saved one checkpoint per run, recording the world size.
    for out in outs:
        c = ckpt.load_checkpoint(out)
        assert c.train_state["world_size"] == WORLD and c.train_state["step"] == 6
    assert not list(root.glob("ddp*.tmp-*"))


def Transformer_init(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    from cflow.model import Transformer

    torch.manual_seed(seed)
    return {n: p.detach() for n, p in Transformer(cfg).named_parameters()}


def _stop_worker(rank: int, port: int, cfg: dict, tc: dict, out: str, result_dir: str) -> None:
    """Train until SIGTERM reaches rank 1 alone, after its step 2; record where each rank stopped."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    real = loop._Run.train_step

    def train_step(self):
        row = real(self)
        if self.d.rank == 1 and self.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return row

    loop._Run.train_step = train_step  # this process is the worker's own: nothing to undo
    real_release = loop._Run.release_ddp
    ddp_freed = []

    def release_ddp(self):
        # the DDP wrapper (and its reducer) must die here, before the group is destroyed, not later
        # with the exception's traceback: freed there, it deadlocked in the process group's destructor
        ref = weakref.ref(self.net)
        real_release(self)
        ddp_freed.append(ref() is None)

    loop._Run.release_ddp = release_ddp
    try:
        train(ModelConfig.from_dict(cfg), TrainConfig.from_dict(tc), out_dir=out)
        outcome = {"stopped": False}
    except TrainInterrupted as e:
        outcome = {"stopped": True, "step": e.step, "signum": e.signum, "saved_step": e.saved_step,
                   "ddp_freed_before_group": ddp_freed}
    torch.save(outcome, Path(result_dir) / f"stop-rank{rank}.pt")


def test_ddp_signal_to_one_rank_stops_all_at_the_same_step(setup):
    root, cfg, base = setup
    out = root / "ddp-stopped"
    mp.spawn(_stop_worker, args=(_free_port(), cfg.to_dict(), base.to_dict(), str(out), str(root)),
             nprocs=WORLD, join=True)
    outcomes = [torch.load(root / f"stop-rank{r}.pt") for r in range(WORLD)]
    assert outcomes == [{"stopped": True, "step": 2, "signum": signal.SIGTERM, "saved_step": 2,
                         "ddp_freed_before_group": [True]}] * WORLD
    c = ckpt.load_checkpoint(out)  # rank 0 saved, at the step every rank stopped at
    assert c.train_state["step"] == 2 and c.train_state["world_size"] == WORLD
    assert not list(root.glob("ddp-stopped.*"))


@pytest.mark.slow
def test_torchrun_cli(setup):
    """`torchrun -m cflow train` end to end (slow: two fresh interpreters plus torchrun's agent)."""
    root, cfg, base = setup
    out = root / "torchrun"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "-m", "cflow", "train", "--preset", "arch2_4_combined",
           *[a for k, v in CFG.items() for a in ("--set", f"{k}={v}")], "--steps", "4", "--batch-size", "4",
           "--seq-len", "32", "--data", base.data, "--cache-dir", base.cache_dir, "--vocab-size", "320",
           "--threads", "1", "--no-progress", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("trained arch2_4_combined") == 1 and "x 2 processes" in proc.stdout
    assert ckpt.load_checkpoint(out).train_state["world_size"] == 2
