"""The training checkpoint directory (docs/DESIGN.md "Training checkpoint directory").

    DIR/model.safetensors   parameters, DESIGN.md names (a tied lm_head is not stored)
    DIR/config.json         ModelConfig.to_json()
    DIR/tokenizer.json      HF tokenizers JSON (byte-level BPE)
    DIR/vocabulary.json     only with a borrowed vocabulary (`cflow train --tokenizer`, cflow.train.vocab):
                            its .cflow tokenizer header, which export writes unchanged
    DIR/train_state.pt      optimizer, schedule, RNG, sampler state, step, train config (--resume)
    DIR/meta.json           preset, command line, tokens seen, eval metrics
    DIR/train_log.csv       the CSV log up to this checkpoint (the loop keeps appending to it)

A checkpoint is written whole into `DIR.tmp-*` and then renamed into place, so DIR is always a
complete checkpoint. Linux cannot atomically swap two directories with rename(2), so replacing an
existing DIR takes two renames (DIR -> DIR.old-*, tmp -> DIR); an exception (a second Ctrl-C)
between them puts DIR.old-* back, and a crash there leaves only DIR.old-*, which `load_checkpoint`
(and the next save) recovers. An OSError while saving is a `cflow.fsutil.WriteError` naming DIR.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cflow.config import ModelConfig
from cflow.errors import CflowError
from cflow.fsutil import fsync_dir, fsync_file, writing
from cflow.train.vocab import VOCABULARY_NAME, read_vocabulary_file

FILES = ("model.safetensors", "config.json", "tokenizer.json", "train_state.pt", "meta.json")
LOG_NAME = "train_log.csv"


class CheckpointError(CflowError):
    """A checkpoint directory is missing, incomplete or does not match the model."""


@dataclass
class Checkpoint:
    path: Path
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer_json: str
    train_state: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    vocabulary: dict[str, Any] | None = None  # a borrowed vocabulary's tokenizer header


# ---- weights ---------------------------------------------------------------------------------
def model_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by DESIGN.md name, detached and contiguous (safetensors refuses shared storage).

    named_parameters() lists a tied tensor once, under the name registered first (tok_emb), so a
    tied lm_head is left out, as DESIGN.md wants.
    """
    return {name: p.detach().cpu().contiguous() for name, p in model.named_parameters()}


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy `weights` into `model`; every parameter must be provided, nothing extra accepted."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(weights))
    unexpected = sorted(set(weights) - set(params))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint weights do not match the model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}; was it trained with another config?")
    with torch.no_grad():
        for name, p in params.items():
            w = weights[name]
            if tuple(w.shape) != tuple(p.shape):
                raise CheckpointError(f"checkpoint tensor {name} has shape {tuple(w.shape)}, "
                                      f"the model expects {tuple(p.shape)}")
            p.copy_(w)


# ---- save ------------------------------------------------------------------------------------
def save_checkpoint(out_dir: str | os.PathLike, *, weights: dict[str, torch.Tensor], config: ModelConfig,
                    tokenizer_json: str, train_state: dict[str, Any] | None = None,
                    meta: dict[str, Any] | None = None, log_file: str | os.PathLike | None = None,
                    vocabulary: dict[str, Any] | None = None) -> Path:
    """Write a complete checkpoint to a temporary directory, then rename it to `out_dir`."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    with writing(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        _recover(out)
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
        try:
            save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt", "producer": "cflow.train"})
            (tmp / "config.json").write_text(config.to_json() + "\n")
            (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
            if vocabulary is not None:
                (tmp / VOCABULARY_NAME).write_text(json.dumps(vocabulary, ensure_ascii=False), encoding="utf-8")
            torch.save(train_state or {}, tmp / "train_state.pt")
            (tmp / "meta.json").write_text(json.dumps(meta or {}, indent=2, sort_keys=True, default=str) + "\n")
            if log_file is not None and Path(log_file).is_file():
                shutil.copyfile(log_file, tmp / LOG_NAME)
            for f in tmp.iterdir():  # the data must be on disk before the rename makes it visible
                fsync_file(f)
            fsync_dir(tmp)
            _swap_into_place(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def _swap_into_place(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.rename(tmp, out)
        fsync_dir(out.parent)
        return
    old = Path(tempfile.mkdtemp(prefix=out.name + ".old-", dir=out.parent))
    os.rmdir(old)  # only its unique name is wanted
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:  # a second Ctrl-C lands here: the previous checkpoint goes back in place
        if not out.exists():
            os.rename(old, out)
        raise
    fsync_dir(out.parent)
    shutil.rmtree(old, ignore_errors=True)


def _recover(out: Path) -> None:
    """After a crash between the two renames only DIR.old-* exists: put it back."""
    if out.exists():
        return
    olds = sorted(out.parent.glob(out.name + ".old-*"), key=lambda p: p.stat().st_mtime)
    if olds and all((olds[-1] / f).is_file() for f in FILES):
        os.rename(olds[-1], out)


# ---- load ------------------------------------------------------------------------------------
def is_checkpoint(path: str | os.PathLike) -> bool:
    p = Path(path)
    return all((p / f).is_file() for f in FILES)


def load_checkpoint(path: str | os.PathLike, *, with_train_state: bool = True) -> Checkpoint:
    from safetensors.torch import load_file

    p = Path(path)
    _recover(p)
    if not p.is_dir():
        raise CheckpointError(f"checkpoint directory {p} does not exist; train one with `cflow train --out {p}`")
    missing = [f for f in FILES if not (p / f).is_file()]
    if missing:
        raise CheckpointError(f"{p} is not a complete cflow training checkpoint: missing {missing}")
    config = ModelConfig.from_json((p / "config.json").read_text())
    weights = load_file(str(p / "model.safetensors"))
    state = torch.load(p / "train_state.pt", map_location="cpu", weights_only=True) if with_train_state else {}
    meta = json.loads((p / "meta.json").read_text())
    return Checkpoint(p, config, weights, (p / "tokenizer.json").read_text(encoding="utf-8"), state, meta,
                      read_vocabulary_file(p))

