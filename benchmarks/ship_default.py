"""Make a training checkpoint the built-in default model, with the evidence its test checks.

    python benchmarks/ship_default.py runs/family/arch2_4_combined-s/seed2

Writes, inside the package (src/cflow/models/):
- default.cflow: the checkpoint exported in Q4_0 tiles (`cflow export`), its metadata carrying the
  float checkpoint's loss and perplexity on the validation windows below;
- default_val.npy: those windows' tokens, int32 [W, seq_len + 1]: --windows evenly spread
  windows of the checkpoint's own validation split (the training loop's `eval_windows`).

tests/test_default_model.py runs the shipped file through the engine on exactly those windows and
checks its perplexity against the float one (within 3%), so the check needs nothing outside the
installed package. Refuses a file over --max-mb (the wheel carries it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

from cflow.convert.checkpoint import convert_checkpoint
from cflow.model import Transformer
from cflow.train import bpe
from cflow.train import checkpoint as ckpt
from cflow.train.data import eval_windows, open_corpus, prepare_data

MODELS = Path(__file__).resolve().parents[1] / "src" / "cflow" / "models"


def float_eval(model: Transformer, windows: np.ndarray) -> dict[str, float]:
    nll, hits, n = 0.0, 0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(windows), 8):
            w = torch.from_numpy(windows[i:i + 8].astype(np.int64))
            logits, _ = model(w[:, :-1])
            flat = logits.float().reshape(-1, logits.size(-1))
            y = w[:, 1:].reshape(-1)
            nll += torch.nn.functional.cross_entropy(flat, y, reduction="sum").item()
            hits += int((flat.argmax(-1) == y).sum())
            n += y.numel()
    return {"loss": nll / n, "ppl": math.exp(nll / n), "top1": hits / n, "tokens": n}


def portable(command: str | None) -> str | None:
    """The training command as the shipped file records it: an absolute path (a directory of the
    machine it trained on) shortened to .../its-name, as the family's run records leave run_dir out."""
    if not command:
        return command
    return " ".join(f".../{Path(t).name}" if t.startswith("/") else t for t in command.split(" "))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--windows", type=int, default=32, help="validation windows shipped (default 32)")
    ap.add_argument("--quant", default="q4_0")
    ap.add_argument("--max-mb", type=float, default=15.0)
    ap.add_argument("--out-dir", type=Path, default=MODELS)
    a = ap.parse_args(argv)
    a.out_dir.mkdir(parents=True, exist_ok=True)  # before the float evaluation, not after it
    c = ckpt.load_checkpoint(a.checkpoint, with_train_state=False)
    tc = c.meta.get("train_config", {})
    seq_len = int(tc.get("seq_len", 256))
    tok = bpe.load_tokenizer(a.checkpoint / "tokenizer.json")
    data = prepare_data(open_corpus(tc.get("data")), tok, val_fraction=tc.get("val_fraction", 0.05))
    starts = eval_windows(data.val, seq_len, a.windows)
    windows = np.stack([np.asarray(data.val[s:s + seq_len + 1], np.int32) for s in starts])
    model = Transformer.from_state(c.config, {k: torch.as_tensor(np.asarray(v)) for k, v in c.weights.items()})
    fe = float_eval(model, windows)
    out = a.out_dir / "default.cflow"
    extra = {"float_eval": {**fe, "windows": len(windows), "seq_len": seq_len, "file": "default_val.npy"},
             "trained": {**{k: c.meta.get(k) for k in ("preset", "tokens_seen", "params", "eval", "data",
                                                        "elapsed_s")}, "command": portable(c.meta.get("command"))}}
    res = convert_checkpoint(a.checkpoint, out, quant=a.quant, metadata=extra)
    mb = out.stat().st_size / 1e6
    if mb > a.max_mb:
        out.unlink()
        raise SystemExit(f"{out}: {mb:.1f} MB is over --max-mb {a.max_mb}; not shipped")
    np.save(a.out_dir / "default_val.npy", windows)
    print(json.dumps({"file": str(out), "mb": round(mb, 2), "float_eval": fe,
                      "quant_error_rms": res.report.rms_rel, "config": c.config.name}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
