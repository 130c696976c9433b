"""The training loop: AdamW, warmup + cosine, MoE auxiliary losses, eval, checkpoints, exact resume, DDP.

Owns `TrainConfig` (every knob of a run that is not the architecture) and `train()`.
- Loss = cross-entropy + lb_weight * load_balance + z_weight * router_z (the model's aux dict).
- AdamW with decoupled weight decay on matrices only: norms (1-D) and the token embedding are not
  decayed, since pulling them to zero shrinks the residual stream rather than regularising.
- Learning rate: linear warmup over `warmup` steps, cosine decay to `min_lr_ratio * lr` at the
  last step; the rate is a pure function of the step, so the schedule's state is the step.
- Exact resume: the checkpoint holds weights, optimizer moments, the sampler's generator state,
  torch's RNG and the step, so N/2 + resume + N/2 steps reproduce N straight steps loss for loss
  (same thread count; CPU kernels are deterministic for a fixed thread count).
- DDP: under torchrun (RANK / WORLD_SIZE in the environment) the loop joins a gloo process
  group and wraps the model in DistributedDataParallel. Every rank draws the same global batch
  and trains on its own slice, so gradients equal a single process's on the global batch. One
  exception: the load-balancing loss is computed per rank (it is a product of per-rank means),
  as in most data-parallel MoE training. Rank 0 logs and saves; evaluation is split over ranks.
- Checkpoints: every `save_every` steps (default 200), at the end, and on SIGINT/SIGTERM: the
  first signal lets the current step finish, saves there and raises TrainInterrupted (the CLI
  exits 130 / 143); a second one abandons the save, which leaves the previous checkpoint whole.
  Under DDP the ranks agree on the stop each step (an all-reduce), so all stop at the same step
  whichever rank was signalled; torchrun forwards a Ctrl-C to every worker once.
- Writes: `out_dir` is checked writable before any data is prepared; an OSError while writing the
  log or a checkpoint is a `cflow.fsutil.WriteError` (`cannot write PATH: REASON`).

The library never prints: progress=True shows a tqdm bar (rank 0), a callable receives events.
"""

from __future__ import annotations

import csv
import math
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from cflow import fsutil
from cflow.config import ModelConfig
from cflow.errors import CflowError
from cflow.train import checkpoint as ckpt
from cflow.train import data as tdata

LOG_FIELDS = ("step", "tokens", "lr", "loss", "ce", "load_balance", "router_z", "grad_norm",
              "val_loss", "val_ppl", "val_acc", "elapsed_s", "tok_per_s")
# These decide which batches a run sees: a resumed run must keep them.
PRECISIONS = ("auto", "bf16", "fp32")
RESUME_FIXED = ("batch_size", "seq_len", "seed", "data", "val_fraction", "tokenizer")


class TrainError(CflowError):
    """A training run is misconfigured (bad settings, resume mismatch, occupied output dir)."""


class TrainInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped training; `saved_step` is the step of the checkpoint now in `out_dir`.

    A KeyboardInterrupt, so a caller looping over runs (compare) stops too, and `except Exception`
    does not swallow it. `saved`: the checkpoint holds the step training stopped at (False after a
    second signal abandoned the save, or without out_dir).
    """

    def __init__(self, signum: int, step: int, total: int, out_dir: Path | None, saved_step: int | None,
                 rank: int = 0) -> None:
        self.signum, self.step, self.total, self.out_dir, self.saved_step = signum, step, total, out_dir, saved_step
        self.rank = rank
        self.signal_name = signal.Signals(signum).name
        self.saved = saved_step == step  # the checkpoint holds exactly where training stopped
        self.exit_status = 128 + signum  # what a shell reports for a process stopped by this signal
        where = f"the checkpoint in {out_dir} is step {saved_step}" if saved_step is not None else "no checkpoint"
        super().__init__(f"{self.signal_name} at step {step} of {total}; {where}")


@dataclass
class TrainConfig:
    steps: int = 2000  # optimizer steps (ignored when tokens > 0)
    tokens: int = 0  # token budget; > 0 sets steps = ceil(tokens / (batch_size * seq_len))
    batch_size: int = 16  # global sequences per step, split across DDP ranks
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0: no clipping
    lb_weight: float = 0.01  # MoE load-balancing loss weight
    z_weight: float = 0.001  # router z-loss weight
    # Weight of the multi-token prediction heads' mean cross-entropy (models with mtp_heads > 0):
    # small enough that the heads do not pull the shared trunk away from next-token prediction.
    mtp_weight: float = 0.3
    eval_every: int = 200  # 0: evaluate only at the end
    eval_windows: int = 64  # validation windows (of seq_len tokens) per evaluation
    # Periodic checkpoints bound the work a crash or kill -9 loses; 200 steps is the default
    # eval interval, so each periodic checkpoint carries a fresh evaluation. 0: only at the end
    # (and on SIGINT/SIGTERM).
    save_every: int = 200
    log_every: int = 10
    seed: int = 1337
    data: str | None = None  # None: shipped corpus; a .txt/.jsonl path; "tinystories[:N]"
    val_fraction: float = tdata.DEFAULT_VAL_FRACTION
    vocab_size: int = 0  # tokenizer vocabulary to train; 0: the model config's vocab_size
    # A GGUF model or HF tokenizer.json whose vocabulary to train with instead of a new BPE
    # (cflow.train.vocab): a draft model for speculative decoding must speak its target's.
    tokenizer: str | None = None
    threads: int = 0  # torch threads per process; 0: CPU cores / local processes
    cache_dir: str | None = None  # token and tokenizer cache; None: $CFLOW_CACHE or ~/.cache/cflow
    compile: bool = False  # the training step through torch.compile (evaluation stays eager)
    # "auto": a CUDA GPU when torch sees one, else the CPU. On a GPU the forward and backward run in
    # bf16 autocast (master weights, optimizer and loss stay fp32); on the CPU in fp32 throughout.
    device: str = "auto"
    # "auto": bf16 autocast on a GPU, fp32 on the CPU; "bf16": autocast on either (on a CPU with
    # AVX-512 BF16 it trained arch4-s 1.19x / 1.26x faster at 1 / 2 threads:
    # benchmarks/train_speed.py --bf16); "fp32": never.
    precision: str = "auto"

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise TrainError(msg)

        need(self.steps > 0 or self.tokens > 0, f"steps must be positive, got {self.steps}")
        need(self.tokens >= 0, f"tokens must be >= 0, got {self.tokens}")
        need(self.precision in PRECISIONS, f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        need(self.batch_size > 0 and self.seq_len > 0, "batch_size and seq_len must be positive")
        need(self.lr > 0 and 0 <= self.min_lr_ratio <= 1, "lr must be positive and min_lr_ratio in [0, 1]")
        need(self.warmup >= 0 and self.weight_decay >= 0 and self.grad_clip >= 0,
             "warmup, weight_decay and grad_clip must be >= 0")
        need(self.lb_weight >= 0 and self.z_weight >= 0, "lb_weight and z_weight must be >= 0")
        need(self.mtp_weight >= 0, f"mtp_weight must be >= 0, got {self.mtp_weight}")
        need(min(self.eval_every, self.save_every, self.threads) >= 0 and self.log_every > 0,
             "eval_every, save_every and threads must be >= 0, log_every positive")
        need(self.eval_windows > 0, "eval_windows must be positive")
        need(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        need(not (self.tokenizer and self.vocab_size),
             f"vocab_size {self.vocab_size} was given together with tokenizer {self.tokenizer!r}: a borrowed "
             "vocabulary has its own size; drop --vocab-size")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def total_steps(self) -> int:
        return math.ceil(self.tokens / self.tokens_per_step) if self.tokens > 0 else self.steps

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class TrainResult:
    model: torch.nn.Module  # the trained module (unwrapped from DDP)
    config: ModelConfig  # with vocab_size set to the tokenizer's
    history: list[dict[str, float]]  # one row per step run in this call
    evals: list[dict[str, float]]  # one row per evaluation
    n_params: int
    steps: int  # global step reached
    tokens_seen: int
    elapsed_s: float  # training time, summed over resumed segments
    out_dir: Path | None = None
    tokenizer_json: str = ""
    rank: int = 0
    world_size: int = 1


# ---- schedule and optimizer ------------------------------------------------------------------
def warmup_cosine(step: int, lr: float, warmup: int, total: int, min_lr_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine from lr to min_lr_ratio * lr at step total - 1."""
    if step < warmup:
        return lr * (step + 1) / warmup
    min_lr = lr * min_lr_ratio
    frac = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * frac))


def lr_at(step: int, tc: TrainConfig) -> float:
    """Learning rate for the update made at 0-based `step`."""
    return warmup_cosine(step, tc.lr, tc.warmup, tc.total_steps, tc.min_lr_ratio)


def make_optimizer(model: torch.nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.dim() < 2 or name.startswith("tok_emb") else decay).append(p)
    groups = [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=1e-8)


def compute_loss(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, tc: TrainConfig):
    """x, y int64 [B, T] -> (loss, ce, load_balance, router_z, mtp_ce); loss = ce + weighted aux
    terms + mtp_weight x mtp_ce, mtp_ce the mean of the multi-token heads' cross-entropies (a
    list of each head's, [] without heads)."""
    logits, aux = net(x)  # [B, T, V]
    ce = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
    lb = aux.get("load_balance", torch.zeros(()))
    rz = aux.get("router_z", torch.zeros(()))
    loss = ce + tc.lb_weight * lb + tc.z_weight * rz
    heads = mtp_losses(aux.get("mtp_logits", []), y)
    if heads:
        loss = loss + tc.mtp_weight * torch.stack(heads).mean()
    return loss, ce, lb, rz, heads


def mtp_targets(y: torch.Tensor, j: int) -> tuple[slice, torch.Tensor]:
    """Head j's targets: at position t it predicts token t+2+j, which is y[t+1+j] (y is x shifted
    by one); the last 1+j positions of a window have none and are left out. Returns (the
    positions' slice, their targets [B, T-1-j])."""
    return slice(0, y.size(1) - 1 - j), y[:, 1 + j:]


def mtp_losses(head_logits: list[torch.Tensor], y: torch.Tensor) -> list[torch.Tensor]:
    """Each multi-token head's mean cross-entropy over the positions that have a target."""
    out = []
    for j, lg in enumerate(head_logits):
        pos, tgt = mtp_targets(y, j)
        if tgt.numel():
            out.append(F.cross_entropy(lg[:, pos].float().reshape(-1, lg.size(-1)), tgt.reshape(-1)))
    return out


def resolve_device(tc: TrainConfig) -> torch.device:
    """The device tc.device names ("auto": the first CUDA GPU if torch sees one, else the CPU)."""
    if tc.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(tc.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TrainError(f"--device {tc.device}: torch sees no CUDA GPU here (torch {torch.__version__}, "
                         f"{'a CPU build' if torch.version.cuda is None else 'CUDA ' + torch.version.cuda}); "
                         "use --device cpu, or install a CUDA build of torch on a GPU machine")
    return dev


def uses_bf16(dev: torch.device, precision: str) -> bool:
    """Whether steps run in bf16 autocast: "auto" on a GPU only, "bf16" anywhere."""
    return precision == "bf16" or (precision == "auto" and dev.type == "cuda")


def autocast(dev: torch.device, precision: str = "auto"):
    """bf16 autocast (matmuls in bf16; master weights, reductions and the loss in fp32) where
    `precision` asks for it on this device (uses_bf16), else nothing."""
    return torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=uses_bf16(dev, precision))


def describe_device(dev: torch.device, precision: str = "auto") -> str:
    """The device and precision a run trains in, as meta.json and the compare table say it."""
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return f"{name} (bf16 autocast)" if uses_bf16(dev, precision) else name


def describe_machine(device: str, threads: int | None = None) -> str:
    """Where a run trains, as its meta.json and the compare table say it: architecture, CPU model
    (what /proc/cpuinfo names; a VM may name less), threads (default: torch's now) and device."""
    import platform

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{platform.machine()}, {cpu or 'unknown CPU'}, {threads or torch.get_num_threads()} thread(s), {device}"


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() counts a tied tensor once


# ---- distributed -----------------------------------------------------------------------------
@dataclass
class _Dist:
    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    owns_group: bool = False

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()

    def mean(self, values: list[float]) -> list[float]:
        if not self.active:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return (t / self.world_size).tolist()

    def max(self, value: int) -> int:
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())


class _StopSignals:
    """While active (main thread only): the first SIGINT/SIGTERM is recorded in `signum` for the loop
    to act on at the next step boundary; a second raises KeyboardInterrupt at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum = 0
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "_StopSignals":
        if threading.current_thread() is threading.main_thread():  # signal.signal works only there
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old if old is not None else signal.SIG_DFL)  # None: set outside Python
        self._old = {}

    def _handle(self, signum: int, frame) -> None:
        if self.signum:
            raise KeyboardInterrupt  # asked twice: quit now; an interrupted save keeps the old checkpoint
        self.signum = signum


def _init_distributed() -> _Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return _Dist()
    import torch.distributed as dist

    owns = False
    if not dist.is_initialized():
        # gloo: CPU training; torchrun sets MASTER_ADDR/PORT, RANK and WORLD_SIZE.
        dist.init_process_group("gloo")
        owns = True
    return _Dist(dist.get_rank(), dist.get_world_size(),
                 int(os.environ.get("LOCAL_WORLD_SIZE", str(world))), owns)


def _set_threads(tc: TrainConfig, d: _Dist) -> None:
    n = tc.threads or max(1, (os.cpu_count() or 1) // d.local_world_size)
    torch.set_num_threads(n)


# ---- data and tokenizer ----------------------------------------------------------------------
def _rank0_first(d: _Dist, fn: Callable[[], Any]) -> Any:
    """Run `fn` on rank 0, then on the others: it fills a cache the others then hit."""
    if d.rank == 0:
        out = fn()
        d.barrier()
    else:
        d.barrier()
        out = fn()
    return out


def _prepare(cfg: ModelConfig, tc: TrainConfig, d: _Dist, tokenizer_json: str | None, vocabulary: dict | None,
             progress: bool):
    """(corpus, tokenizer, token data, borrowed vocabulary header or None). A resumed run brings its
    tokenizer JSON and, with a borrowed vocabulary, that header (the checkpoint's, not the file's again)."""
    from cflow.train import bpe, vocab

    corpus = tdata.open_corpus(tc.data)
    if vocabulary is None and tokenizer_json is None and tc.tokenizer:
        vocabulary = vocab.read_vocabulary(tc.tokenizer)
    if vocabulary is not None:
        tok = vocab.training_tokenizer(vocabulary)
    elif tokenizer_json is not None:
        tok = bpe.tokenizer_from_str(tokenizer_json)
    else:
        size = tc.vocab_size or cfg.vocab_size
        tok = _rank0_first(d, lambda: tdata.get_tokenizer(corpus, size, cache_dir=tc.cache_dir,
                                                          val_fraction=tc.val_fraction, progress=progress))
    data = _rank0_first(d, lambda: tdata.prepare_data(corpus, tok, cache_dir=tc.cache_dir,
                                                      val_fraction=tc.val_fraction, vocabulary=vocabulary))
    return corpus, tok, data, vocabulary


# ---- evaluation ------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model: torch.nn.Module, tokens: np.ndarray, tc: TrainConfig, d: _Dist | None = None) -> dict[str, float]:
    """Validation loss, perplexity and top-1 accuracy over fixed, evenly spread windows; with
    multi-token heads also each head's (val_mtp{j}_loss, val_mtp{j}_acc: head j predicts the token
    2+j ahead, over the positions that have one)."""
    d = d or _Dist()
    starts = tdata.eval_windows(tokens, tc.seq_len, tc.eval_windows)
    n_heads = getattr(getattr(model, "cfg", None), "mtp_heads", 0)
    sums = torch.zeros(3 * (1 + n_heads), dtype=torch.float64)  # per (main, head j): [loss_sum, correct, count]
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    for x, y in tdata.eval_batches(tokens, starts, tc.seq_len, max(1, tc.batch_size // d.world_size),
                                   d.rank, d.world_size):
        xt, yt = torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev)  # [b, T]
        with autocast(dev, tc.precision):
            logits, aux = model(xt)  # [b, T, V]
        pairs = [(logits, yt)] + [(lg[:, pos], tgt) for j, lg in enumerate(aux.get("mtp_logits", []))
                                  for pos, tgt in [mtp_targets(yt, j)]]
        for k, (lg, tgt) in enumerate(pairs):
            flat = lg.float().reshape(-1, lg.size(-1))
            sums[3 * k] += F.cross_entropy(flat, tgt.reshape(-1), reduction="sum").item()
            sums[3 * k + 1] += (flat.argmax(-1) == tgt.reshape(-1)).sum().item()
            sums[3 * k + 2] += tgt.numel()
    model.train(was_training)
    if d.active:
        torch.distributed.all_reduce(sums)
    loss = (sums[0] / sums[2]).item()
    out = {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_acc": (sums[1] / sums[2]).item()}
    for j in range(n_heads):
        k = 3 * (j + 1)
        if sums[k + 2] > 0:
            out[f"val_mtp{j}_loss"] = (sums[k] / sums[k + 2]).item()
            out[f"val_mtp{j}_acc"] = (sums[k + 1] / sums[k + 2]).item()
    return out


# ---- logging ---------------------------------------------------------------------------------
class _CsvLog:
    """Append-only CSV log at DIR/train_log.csv (rank 0); checkpoints carry a copy."""

    def __init__(self, path: Path, truncate_after_step: int | None) -> None:
        self.path = path
        if truncate_after_step is not None and path.is_file():
            # Rows past the checkpoint came from a run that died after it: they will be redone.
            with open(path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= truncate_after_step]
            self._rewrite(rows)
        elif truncate_after_step is None and path.is_file():
            with fsutil.writing(path):
                path.unlink()
        self.f = None
        self.open()

    def _rewrite(self, rows: list[dict]) -> None:
        with fsutil.writing(self.path), open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, LOG_FIELDS)
            w.writeheader()
            w.writerows(rows)

    def open(self) -> None:
        new = not self.path.is_file()
        with fsutil.writing(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.f = open(self.path, "a", newline="")
            self.w = csv.DictWriter(self.f, LOG_FIELDS, extrasaction="ignore")
            if new:
                self.w.writeheader()

    def write(self, row: dict) -> None:
        with fsutil.writing(self.path):
            self.w.writerow({k: _fmt(row.get(k)) for k in LOG_FIELDS})
            self.f.flush()

    def close(self) -> None:
        if self.f:
            self.f.close()
            self.f = None


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


class _Progress:
    def __init__(self, progress: bool | Callable[[dict], None], total: int, initial: int, enabled: bool,
                 desc: str = "") -> None:
        self.cb = progress if callable(progress) else None
        self.bar = None
        if progress is True and enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, desc=desc)
        self.enabled = enabled

    def __call__(self, event: dict) -> None:
        if not self.enabled:
            return
        if self.cb:
            self.cb(event)
        if self.bar is not None:
            if event["event"] == "step":
                self.bar.update(1)
                self.bar.set_postfix(loss=f"{event['loss']:.3f}", tok_s=f"{event['tok_per_s']:.0f}", refresh=False)
            elif event["event"] == "eval":
                self.bar.write(f"step {event['step']}: val loss {event['val_loss']:.4f} "
                               f"ppl {event['val_ppl']:.2f} acc {event['val_acc']:.3f}")
            elif event["event"] == "stop":
                self.bar.write(f"{event['signal']}: stopping at step {event['step']}"
                               + (" and saving a checkpoint (Ctrl-C again to quit without it)"
                                  if event["save"] else ""))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---- the loop --------------------------------------------------------------------------------
def train(cfg: ModelConfig, tc: TrainConfig, *, out_dir: str | os.PathLike | None = None, resume: bool = False,
          overwrite: bool = False, progress: bool | Callable[[dict], None] = False,
          until_step: int | None = None, meta: dict[str, Any] | None = None) -> TrainResult:
    """Train `cfg` as `tc` says; checkpoints go to `out_dir` (rank 0).

    resume: continue the checkpoint in out_dir exactly. until_step: stop once this global step is
    reached (the schedule still spans tc.total_steps) and save there, as an interrupted run would.
    """
    from cflow.model import Transformer

    d = _init_distributed()
    run = None
    try:
        _set_threads(tc, d)
        out = Path(out_dir) if out_dir is not None else None
        state, tok_json = _check_out_dir(out, resume, overwrite, cfg, tc)
        if out is not None and d.rank == 0:
            fsutil.check_writable(out)  # now, not after the tokenizer and the first save_every steps
        vocabulary = state.get("vocabulary") if state is not None else None
        corpus, tok, data, vocabulary = _prepare(cfg, tc, d, tok_json, vocabulary, progress is True and d.rank == 0)
        cfg = cfg.replace(vocab_size=tok.get_vocab_size()) if cfg.vocab_size != tok.get_vocab_size() else cfg
        if tc.seq_len > cfg.max_seq_len:
            raise TrainError(f"seq_len {tc.seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}; "
                             f"pass --set max_seq_len={tc.seq_len} or a shorter --seq-len")
        if state is not None:
            _check_resume(state, cfg, tc, data, out)

        dev = resolve_device(tc)
        if dev.type == "cuda" and d.active:
            raise TrainError("training on CUDA runs in one process: start it without torchrun (several "
                             "processes train on the CPU only)")
        torch.manual_seed(tc.seed)
        model = Transformer(cfg)  # initialised on the CPU: the same weights whatever the device
        if state is not None:
            ckpt.load_weights(model, state["weights"])
        model.to(dev)
        opt = make_optimizer(model, tc)
        sampler = tdata.BatchSampler(data.train, tc.batch_size, tc.seq_len, tc.seed, d.rank, d.world_size)
        step, elapsed0 = 0, 0.0
        if state is not None:
            opt.load_state_dict(state["optimizer"])  # moves the moments to the parameters' device
            sampler.load_state_dict(state["sampler"])
            torch.set_rng_state(state["rng"]["torch"])
            step, elapsed0 = int(state["step"]), float(state.get("elapsed_s", 0.0))

        run = _Run(cfg, tc, d, model, opt, sampler, data, out, tok.to_str(), corpus.name, meta or {},
                   progress, step, elapsed0, resume, vocabulary)
        return run.loop(until_step)
    finally:
        if run is not None:
            run.release_ddp()
        if d.owns_group:
            torch.distributed.destroy_process_group()


def _check_out_dir(out: Path | None, resume: bool, overwrite: bool, cfg: ModelConfig, tc: TrainConfig):
    if out is None:
        if resume:
            raise TrainError("resume needs the checkpoint directory (--out DIR)")
        return None, None
    if out.exists() and not out.is_dir():
        raise TrainError(f"{out} is a file, not a checkpoint directory; choose another --out")
    if resume:
        c = ckpt.load_checkpoint(out)
        state = dict(c.train_state)
        state["weights"], state["config"], state["vocabulary"] = c.weights, c.config, c.vocabulary
        return state, c.tokenizer_json
    if ckpt.is_checkpoint(out) and not overwrite:
        raise TrainError(f"{out} already holds a checkpoint; pass --resume to continue it, --overwrite to "
                         "replace it, or choose another --out")
    return None, None


def _check_resume(state: dict, cfg: ModelConfig, tc: TrainConfig, data: tdata.TokenData, out: Path) -> None:
    saved_cfg: ModelConfig = state["config"]
    if saved_cfg != cfg:
        a, b = saved_cfg.to_dict(), cfg.to_dict()
        diff = {k: (a[k], b[k]) for k in a if a[k] != b[k] and k != "name"}
        raise TrainError(f"cannot resume {out}: the model config differs from the checkpoint's "
                         f"(checkpoint, now): {diff}")
    saved_tc = state.get("train_config", {})
    diff = {k: (saved_tc.get(k), getattr(tc, k)) for k in RESUME_FIXED if saved_tc.get(k) != getattr(tc, k)}
    if diff:
        raise TrainError(f"cannot resume {out} exactly: these settings differ from the checkpoint's "
                         f"(checkpoint, now): {diff}; keep them as they were")
    if state.get("data_key") not in (None, data.key):
        raise TrainError(f"cannot resume {out}: the training data (or its tokenization) changed since the "
                         "checkpoint was written")


class _Run:
    """The state of one training call; methods are the loop's steps."""

    def __init__(self, cfg, tc, d, model, opt, sampler, data, out, tok_json, data_name, meta, progress,
                 step, elapsed0, resumed, vocabulary=None) -> None:
        self.vocabulary = vocabulary
        self.cfg, self.tc, self.d = cfg, tc, d
        self.model, self.opt, self.sampler, self.data = model, opt, sampler, data
        self.device = next(model.parameters()).device
        self.device_name = describe_device(self.device, tc.precision)
        self.machine = describe_machine(self.device_name)  # once: it reads /proc/cpuinfo
        self.out, self.tok_json, self.data_name, self.meta = out, tok_json, data_name, meta
        self.step, self.elapsed0 = step, elapsed0
        self.n_params = count_params(model)
        self.total = tc.total_steps
        self.history: list[dict] = []
        self.evals: list[dict] = []
        self.last_eval: dict = {}
        self.saved_step = step if resumed else None  # step of the checkpoint in `out` that this run wrote or resumed
        self.signals = _StopSignals()
        self.log = None
        if out is not None and d.rank == 0:
            self.log = _CsvLog(out / ckpt.LOG_NAME, step if resumed else None)
        self.progress = _Progress(progress, self.total, step, d.rank == 0, desc=cfg.name)
        if d.active:
            from torch.nn.parallel import DistributedDataParallel as DDP

            # cflow.model runs every expert, even on zero tokens, so every parameter gets a
            # gradient each step and DDP need not search the graph for unused ones.
            self.net = DDP(model)
        else:
            self.net = model
        if tc.compile:
            # The expert dispatch stays eager (cflow.model.MoE._dispatch), so on the -s presets the
            # compiled step measured no faster than eager (1,863 against 1,856 tok/s over 40 steps,
            # one thread each, two runs side by side); it is here for larger, attention-heavy configs.
            self.net = torch.compile(self.net)

    def release_ddp(self) -> None:
        """Drop the DDP wrapper now, while the process group is still registered. Its reducer holds a
        reference to the group; were it the last one, freeing the reducer would destroy the group
        with the GIL held while a gloo worker thread may need the GIL to free a finished
        collective's tensors: a deadlock (torch's blocking destructors under pybind11). It happened
        when an exception's traceback kept this run alive until the caller's `except` ended."""
        self.net = None

    def loop(self, until_step: int | None) -> TrainResult:
        stop = self.total if until_step is None else min(self.total, until_step)
        self.t_start = time.perf_counter()
        self.t_win, self.win_steps = self.t_start, 0
        signum = 0
        with self.signals:
            try:
                while self.step < stop and not signum:
                    signum = self.one_step(stop)
            except KeyboardInterrupt:  # a second signal: the save (if under way) was abandoned
                raise self.interrupted(self.signals.signum or signal.SIGINT) from None
            finally:
                self.progress.close()
                if self.log:
                    self.log.close()
        if signum:
            raise self.interrupted(signum)
        return TrainResult(self.model, self.cfg, self.history, self.evals, self.n_params, self.step,
                           self.step * self.tc.tokens_per_step, self.elapsed0 + time.perf_counter() - self.t_start,
                           self.out, self.tok_json, self.d.rank, self.d.world_size)

    def one_step(self, stop: int) -> int:
        """Train a step; evaluate, log and save as due. Returns the stop signal all ranks agreed on (0: none)."""
        tc = self.tc
        row = self.train_step()
        self.win_steps += 1
        now = time.perf_counter()
        row["elapsed_s"] = self.elapsed0 + now - self.t_start
        row["tok_per_s"] = self.win_steps * tc.tokens_per_step / max(now - self.t_win, 1e-9)
        if self.step % tc.log_every == 0:
            self.t_win, self.win_steps = now, 0
        if (tc.eval_every and self.step % tc.eval_every == 0) or self.step == self.total:
            row.update(self.run_eval())
        # Checked after the eval, so a signal during it still stops here; agreed over the ranks,
        # so they all stop (and save) at the same step whichever of them was signalled.
        signum = self.d.max(self.signals.signum)
        last = self.step == stop or bool(signum)
        self.history.append(row)
        if self.log and (self.step % tc.log_every == 0 or "val_loss" in row or last):
            self.log.write(row)
        self.progress({"event": "step", **row})
        if signum:
            self.progress({"event": "stop", "signal": signal.Signals(signum).name, "step": self.step,
                           "save": self.out is not None})
        if self.out is not None and ((tc.save_every and self.step % tc.save_every == 0) or last):
            self.save(self.elapsed0 + time.perf_counter() - self.t_start)
        return signum

    def interrupted(self, signum: int) -> TrainInterrupted:
        return TrainInterrupted(signum, self.step, self.total, self.out, self.saved_step, self.d.rank)

    def train_step(self) -> dict:
        tc = self.tc
        lr = lr_at(self.step, tc)
        for g in self.opt.param_groups:
            g["lr"] = lr
        x, y = self.sampler.next()
        dev = self.device
        with autocast(dev, tc.precision):
            loss, ce, lb, rz, heads = compute_loss(self.net, torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev),
                                                   tc)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if tc.grad_clip > 0:
            gnorm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip))
        else:
            gnorm = float(torch.linalg.vector_norm(torch.stack(
                [p.grad.norm() for p in self.model.parameters() if p.grad is not None])))
        self.opt.step()
        self.step += 1
        loss_v, ce_v, lb_v, rz_v, *heads_v = self.d.mean([loss.item(), ce.item(), lb.detach().item(),
                                                           rz.detach().item(), *(h.item() for h in heads)])
        row = {"step": self.step, "tokens": self.step * tc.tokens_per_step, "lr": lr, "loss": loss_v,
               "ce": ce_v, "load_balance": lb_v, "router_z": rz_v, "grad_norm": gnorm}
        if heads_v:  # in the step rows (history, progress); the CSV keeps its columns for resumed old runs
            row["mtp_ce"] = sum(heads_v) / len(heads_v)
        return row

    def run_eval(self) -> dict:
        m = evaluate(self.model, self.data.val, self.tc, self.d)
        self.last_eval = {"step": self.step, "tokens": self.step * self.tc.tokens_per_step, **m}
        self.evals.append(self.last_eval)
        self.progress({"event": "eval", **self.last_eval})
        return m

    def save(self, elapsed: float) -> None:
        if self.d.rank == 0:
            state = {
                "step": self.step,
                "tokens_seen": self.step * self.tc.tokens_per_step,
                "optimizer": self.opt.state_dict(),
                "schedule": {"kind": "warmup_cosine", "step": self.step, "total_steps": self.total},
                "rng": {"torch": torch.get_rng_state()},
                "sampler": self.sampler.state_dict(),
                "train_config": self.tc.to_dict(),
                "data_key": self.data.key,
                "world_size": self.d.world_size,
                "elapsed_s": elapsed,
            }
            meta = {
                **self.meta,
                "preset": self.cfg.name,
                "step": self.step,
                "total_steps": self.total,
                "tokens_seen": self.step * self.tc.tokens_per_step,
                "params": self.n_params,
                "eval": self.last_eval,
                "data": self.data_name,
                "data_key": self.data.key,  # corpus contents + tokenizer + split (TokenData.key)
                "train_tokens": int(len(self.data.train)),
                "val_tokens": int(len(self.data.val)),
                "train_config": self.tc.to_dict(),
                "world_size": self.d.world_size,
                "device": self.device_name,
                "machine": self.machine,
                "elapsed_s": round(elapsed, 3),
            }
            if self.log:
                self.log.close()
            ckpt.save_checkpoint(self.out, weights=ckpt.model_weights(self.model), config=self.cfg,
                                 tokenizer_json=self.tok_json, train_state=state, meta=meta,
                                 log_file=self.out / ckpt.LOG_NAME if self.log else None, vocabulary=self.vocabulary)
            if self.log:
                self.log.open()
            self.progress({"event": "save", "step": self.step, "path": str(self.out)})
        self.d.barrier()
        self.saved_step = self.step


def resume_settings(out_dir: str | os.PathLike) -> tuple[ModelConfig, TrainConfig]:
    """The model and train configs a checkpoint was trained with (what `--resume` continues)."""
    c = ckpt.load_checkpoint(out_dir)
    return c.config, TrainConfig.from_dict(c.train_state.get("train_config", {}))
