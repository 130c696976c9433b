"""`cflow train` (one preset, optionally under torchrun) and `cflow train compare` (the family, claim T1);
`cflow train heads` lives in cflow.cli.train_heads.

Parses flags into a ModelConfig (preset + `--set key=value` overrides, validated by
ModelConfig.with_overrides) and a TrainConfig, then calls cflow.train; prints the outcome. A run
stopped by Ctrl-C or SIGTERM (cflow.train.loop.TrainInterrupted) prints where its checkpoint is
and how to continue, and exits 130 / 143 as a process killed by that signal would.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cflow.cli import train_heads
from cflow.cli.common import add_command
from cflow.config import PRESETS

if TYPE_CHECKING:
    from cflow.train.loop import TrainInterrupted

DEFAULT_PRESET = "arch2_4_combined"

COMPARE_HELP = """\
train several presets x seeds on one budget and write OUT/train_compare.md with its plot

Train each preset for each seed with the same data, geometry, batch and budget, each run in
RUNS_DIR/PRESET/seedN; write a markdown table (val loss, perplexity, top-1 accuracy as means with
95% intervals over the seeds, total and active params, weight bytes per token and critical path
from cflow.dag, wall time, tok/s), each preset's paired difference from the first one seed by
seed, a JSON file and a loss-curve PNG.

Run it again after an interruption: finished runs are read back, a run stopped part-way continues
from its checkpoint. Runs that read different data (the corpus file at --data changed since a run
was trained) are refused, never paired in one table.

examples:
  cflow train compare --tokens 20000000 --threads 2
  cflow train compare --presets arch1-s arch4-s arch2_4_combined-s --seeds 1 2 3 \\
      --tokens 8000000 --data data/stories-corpus.jsonl.xz --runs-dir runs/family
  cflow train compare --presets arch1 arch2_4_combined --minutes-per-run 5
"""

HELP = """\
train a pipeline-native model; `cflow train compare` trains the whole family, `cflow train heads`
adds multi-token prediction heads to a trained model

Train a model of the architecture family on the shipped stories (default), a local file or
TinyStories, with a byte-level BPE tokenizer trained on the same data (or, with --tokenizer FILE,
the vocabulary of an existing model). Writes a checkpoint directory (model.safetensors,
config.json, tokenizer.json, train_state.pt, meta.json, train_log.csv) that --resume continues
exactly and `cflow export` converts.

examples:
  cflow train --preset arch2_4_combined --steps 2000 --out runs/a24
  cflow train --preset arch1 --set d_model=192 --set n_layers=8 --tokens 5000000 --out runs/a1
  cflow train --out runs/a24 --resume                       # continue exactly where it stopped
  cflow train --data tinystories:200000 --out runs/ts       # needs `pip install datasets` + network
  torchrun --standalone --nproc_per_node 2 -m cflow train --preset arch2_4_combined --out runs/ddp
  cflow train compare --tokens 20000000                     # the whole family, same budget
  cflow export runs/a24 a24.cflow                           # then run it with cflow generate
  cflow train --preset arch4-s --mtp 2 --out runs/a4-mtp    # + 2 multi-token prediction heads
  cflow export runs/a4-mtp a4.cflow && cflow generate -m a4.cflow --spec mtp -p "Once upon a time"
  cflow train heads a4.cflow --out a4-mtp.cflow             # heads onto a trained model, from its own text
  cflow train --preset draft-smollm2 --tokenizer SmolLM2-135M-Instruct.Q4_1.gguf \\
      --data data/stories-corpus.jsonl.xz --out runs/draft          # a draft that speaks SmolLM2's vocabulary
  cflow export runs/draft draft.cflow && \\
      cflow generate -m SmolLM2-135M-Instruct.Q4_1.gguf --spec draft --model-draft draft.cflow -p "Once"

--batch-size is the global batch: under torchrun each process takes batch_size / world_size.
Ctrl-C (or SIGTERM) finishes the current step, saves a checkpoint there and exits (130 / 143);
continue it with --resume. A second Ctrl-C quits at once and keeps the previous checkpoint.
"""

# flag dest -> TrainConfig field (identical names); None defaults mean "not given".
_TRAIN_FIELDS = ("steps", "tokens", "batch_size", "seq_len", "lr", "min_lr_ratio", "warmup", "weight_decay",
                 "grad_clip", "lb_weight", "z_weight", "mtp_weight", "eval_every", "eval_windows", "save_every", "log_every",
                 "seed", "data", "val_fraction", "vocab_size", "tokenizer", "threads", "cache_dir", "compile",
                 "device", "precision")


def _add_hparams(p: argparse.ArgumentParser, *, budget: bool) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a ModelConfig field, e.g. --set d_model=192 (repeatable)")
    g.add_argument("--vocab-size", type=int, help="tokenizer vocabulary to train (default: the preset's, 4096)")
    g.add_argument("--tokenizer", metavar="FILE",
                   help="train with the vocabulary of an existing model instead of a new BPE: a GGUF file (its "
                   "tokenizer.ggml.* keys) or an HF tokenizer.json. Text is tokenized by the engine's own tokenizer "
                   "for that file, so the ids are the ones the engine gives that model; the checkpoint keeps the "
                   "vocabulary (vocabulary.json) and `cflow export` writes it, so the model can serve as that "
                   "model's draft (--spec draft --model-draft). The vocabulary sets vocab_size: not with "
                   "--vocab-size. Byte-level BPE vocabularies only")
    g.add_argument("--mtp", type=int, metavar="N",
                   help="add N multi-token prediction heads (--set mtp_heads=N): head j predicts the token 2+j "
                   "ahead from the last hidden state through the shared lm_head, trained jointly (--mtp-weight); "
                   "exported into the .cflow file, they make `cflow generate --spec mtp` speculate with no "
                   "second model (default 0: none)")
    g = p.add_argument_group("data")
    g.add_argument("--data", help="PATH (.txt: documents separated by blank lines; .jsonl: a 'text' field), "
                   "'tinystories[:N|:all]' (HF datasets, needs network), or omit for the shipped story corpus")
    g.add_argument("--val-fraction", type=float, help="share of documents held out for validation (default 0.05)")
    g.add_argument("--cache-dir", help="token/tokenizer cache (default $CFLOW_CACHE or ~/.cache/cflow)")
    g = p.add_argument_group("optimisation")
    if budget:
        b = g.add_mutually_exclusive_group()
        b.add_argument("--steps", type=int, help="optimizer steps (default 2000)")
        b.add_argument("--tokens", type=int, help="token budget instead of --steps")
    _add_flags(g, _OPT_FLAGS)
    g = p.add_argument_group("eval, checkpoints, machine")
    _add_flags(g, _MACHINE_FLAGS)
    g.add_argument("--compile", action="store_true", default=None,
                   help="run the training step through torch.compile (needs a C++ compiler; the first step "
                   "compiles for about a minute; the expert dispatch stays eager, and on the MoE presets the "
                   "compiled step measured no faster than eager)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


# (flag, type, help) of TrainConfig fields that need no more than a type; defaults: TrainConfig's.
_OPT_FLAGS = (
    ("--batch-size", int, "global sequences per step (default 16)"),
    ("--seq-len", int, "tokens per sequence (default 256; at most max_seq_len)"),
    ("--lr", float, "peak learning rate (default 2e-3)"),
    ("--min-lr-ratio", float, "final lr as a fraction of the peak (default 0.1)"),
    ("--warmup", int, "linear warmup steps (default 100)"),
    ("--weight-decay", float, "AdamW decay of matrices (default 0.1)"),
    ("--grad-clip", float, "gradient norm clip, 0 disables (default 1.0)"),
    ("--lb-weight", float, "MoE load-balancing loss weight (default 0.01)"),
    ("--z-weight", float, "router z-loss weight (default 0.001)"),
    ("--mtp-weight", float, "weight of the multi-token heads' mean cross-entropy in the loss (default 0.3; --mtp)"),
    ("--seed", int, "seed of init and batch sampling (default 1337)"),
)
_MACHINE_FLAGS = (
    ("--eval-every", int, "steps between evaluations, 0: only at the end (default 200)"),
    ("--eval-windows", int, "validation windows per evaluation (default 64)"),
    ("--log-every", int, "steps between CSV log rows (default 10)"),
    ("--threads", int, "torch threads per process (default: cores / processes)"),
    ("--device", str, "auto (default: a CUDA GPU when torch sees one, else the CPU), cpu, cuda or cuda:N; on a "
                      "GPU the steps run in bf16 autocast"),
    ("--precision", str, "auto (default: bf16 autocast on a GPU, fp32 on the CPU), bf16 (autocast on the CPU too: "
                         "1.2-1.3x faster where the CPU has AVX-512 BF16) or fp32"),
)


def _add_flags(g: argparse._ArgumentGroup, flags: tuple[tuple[str, type, str], ...]) -> None:
    for flag, typ, text in flags:
        g.add_argument(flag, type=typ, help=text)


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "train", HELP)
    p.add_argument("--preset", choices=sorted(PRESETS), metavar="PRESET",
                   help=f"architecture preset (default {DEFAULT_PRESET}): {', '.join(sorted(PRESETS))}")
    p.add_argument("--out", type=Path, help="checkpoint directory (default runs/PRESET)")
    p.add_argument("--resume", action="store_true",
                   help="continue the checkpoint in --out with its saved settings; flags given override them "
                   "(a new --steps/--tokens reshapes the cosine from the current step on)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint in --out")
    p.add_argument("--save-every", type=int, help="steps between checkpoints, 0: only at the end and on "
                   "Ctrl-C/SIGTERM (default 200)")
    _add_hparams(p, budget=True)
    p.set_defaults(func=run)

    tsub = p.add_subparsers(dest="train_command", metavar="{compare,heads}")
    c = add_command(tsub, "compare", COMPARE_HELP)
    c.add_argument("--presets", nargs="+", choices=sorted(PRESETS), metavar="PRESET",
                   help="presets to train; the first is the reference of the paired differences (default: "
                   "arch1 arch2 arch3 arch4 arch2_4_combined arch5)")
    c.add_argument("--seeds", nargs="+", type=int, metavar="SEED",
                   help="one run of every preset per seed (default: --seed alone)")
    b = c.add_mutually_exclusive_group(required=True)
    b.add_argument("--tokens", type=int, help="the same token budget for every preset")
    b.add_argument("--minutes-per-run", type=float, help="the same wall time for every preset")
    c.add_argument("--out", type=Path, default=Path("docs/results/family"),
                   help="report directory (default docs/results/family, where the family table lives); each "
                   "finished run's record goes to OUT/runs/PRESET/seedN.json, and a run whose checkpoint is gone "
                   "is read back from its record")
    c.add_argument("--runs-dir", type=Path, default=Path("runs/compare"),
                   help="where each preset's checkpoint goes (default runs/compare)")
    _add_hparams(c, budget=False)
    c.set_defaults(func=run_compare)
    train_heads.register(tsub)


def _overrides(args: argparse.Namespace) -> list[str]:
    """The config overrides: --set's, then --mtp as mtp_heads."""
    return list(args.overrides) + ([f"mtp_heads={args.mtp}"] if args.mtp is not None else [])


def _given(args: argparse.Namespace) -> dict:
    return {f: getattr(args, f) for f in _TRAIN_FIELDS if getattr(args, f, None) is not None}


def _command(args: argparse.Namespace) -> str:
    """The command line, rebuilt from the parsed flags (recorded in meta.json and the report)."""
    words = ["cflow", "train"]
    if getattr(args, "train_command", None) == "compare":
        words.append("compare")
        words += ["--presets", *(args.presets or [])] if args.presets else []
        words += ["--tokens", str(args.tokens)] if args.tokens is not None else \
                 ["--minutes-per-run", f"{args.minutes_per_run:g}"]
        words += ["--seeds", *map(str, args.seeds)] if args.seeds else []
        words += ["--out", str(args.out), "--runs-dir", str(args.runs_dir)]
    else:
        words += ["--preset", args.preset] if args.preset else []
        words += ["--out", str(args.out)] if args.out else []
        words += [f for f, on in (("--resume", args.resume), ("--overwrite", args.overwrite)) if on]
        words += ["--save-every", str(args.save_every)] if args.save_every is not None else []
    for s in args.overrides:
        words += ["--set", s]
    words += ["--mtp", str(args.mtp)] if args.mtp is not None else []
    for f, v in _given(args).items():
        if f == "compile":
            words += ["--compile"] if v else []
        elif not (f == "tokens" and words[2:3] == ["compare"]):
            words += ["--" + f.replace("_", "-"), str(v)]
    return shlex.join(words)


def run(args: argparse.Namespace) -> int:
    from cflow.config import ModelConfig
    from cflow.train.loop import TrainConfig, TrainInterrupted, resume_settings, train

    if args.resume:
        if args.out is None:
            print("cflow train: error: --resume needs --out DIR (the checkpoint to continue)", file=sys.stderr)
            return 2
        cfg, tc = resume_settings(args.out)
        if args.preset is not None and args.preset != cfg.name:
            cfg = ModelConfig.from_name(args.preset, vocab_size=cfg.vocab_size)  # the loop reports the mismatch
        given = _given(args)
        if "steps" in given:
            given["tokens"] = 0  # --steps replaces a saved token budget
        tc = dataclasses.replace(tc, **given)
    else:
        cfg = ModelConfig.from_name(args.preset or DEFAULT_PRESET)
        tc = TrainConfig(**_given(args))
    cfg = cfg.with_overrides(_overrides(args))
    out = args.out or Path("runs") / cfg.name
    try:
        res = train(cfg, tc, out_dir=out, resume=args.resume, overwrite=args.overwrite,
                    progress=not args.no_progress, meta={"command": _command(args)})
    except TrainInterrupted as e:
        return _report_interrupt(e)
    if res.rank == 0:
        ev = res.evals[-1] if res.evals else {}
        print(f"trained {cfg.name}: {res.n_params:,} parameters, step {res.steps}, {res.tokens_seen:,} tokens, "
              f"{res.elapsed_s:.1f} s" + (f" x {res.world_size} processes" if res.world_size > 1 else ""))
        if ev:
            print(f"validation: loss {ev['val_loss']:.4f}, perplexity {ev['val_ppl']:.2f}, "
                  f"top-1 accuracy {ev['val_acc']:.4f}")
            for j in range(cfg.mtp_heads):
                if f"val_mtp{j}_loss" in ev:
                    print(f"  mtp head {j} (token {2 + j} ahead): loss {ev[f'val_mtp{j}_loss']:.4f}, "
                          f"top-1 accuracy {ev[f'val_mtp{j}_acc']:.4f}")
        print(f"checkpoint: {out}  (export: cflow export {out} {out.name}.cflow)")
    return 0


def _report_interrupt(e: TrainInterrupted) -> int:
    """Say (rank 0) where the interrupted run's checkpoint is and how to continue it."""
    if e.rank == 0:
        head = f"cflow train: {e.signal_name}: stopped at step {e.step} of {e.total}"
        if e.saved:
            print(f"{head}; checkpoint saved to {e.out_dir}", file=sys.stderr)
        elif e.saved_step is not None:
            print(f"{head} without saving; {e.out_dir} holds the checkpoint of step {e.saved_step}", file=sys.stderr)
        else:
            print(f"{head} without saving; there is no checkpoint to resume", file=sys.stderr)
        if e.saved_step is not None:
            print(f"cflow train: continue with: cflow train --out {shlex.quote(str(e.out_dir))} --resume",
                  file=sys.stderr)
    return e.exit_status


def run_compare(args: argparse.Namespace) -> int:
    from cflow.train.compare import DEFAULT_PRESETS, REPORT, compare
    from cflow.train.loop import TrainConfig, TrainInterrupted

    given = _given(args)
    given.pop("tokens", None)
    base = TrainConfig(**given)
    presets = args.presets or list(DEFAULT_PRESETS)
    progress = not args.no_progress
    try:
        summaries = compare(presets, base=base, tokens=args.tokens, minutes_per_run=args.minutes_per_run,
                            overrides=_overrides(args), runs_dir=args.runs_dir, out_dir=args.out, seeds=args.seeds,
                            command=_command(args), progress=progress)
    except TrainInterrupted as e:
        where = f"its checkpoint is step {e.saved_step}" if e.saved_step is not None else "no checkpoint yet"
        print(f"cflow train compare: {e.signal_name}: stopped during the run in {e.out_dir} at step {e.step} "
              f"({where}); no report written. Continue with the same command: finished runs are kept, this "
              "one resumes", file=sys.stderr)
        return e.exit_status
    for s in summaries:
        print(f"{s.preset:20s} seed {s.seed:<6} params {s.params:>10,}  val loss {s.val_loss:.4f}  "
              f"ppl {s.val_ppl:8.2f}  acc {s.val_acc:.4f}  ({s.tokens:,} tokens, {s.train_s:.1f} s)")
    print(f"report: {args.out / REPORT}")
    return 0
