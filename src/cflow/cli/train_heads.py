"""`cflow train heads`: multi-token prediction heads onto a trained .cflow model (cflow.train.heads)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from cflow.cli.common import add_command

HELP = """\
train multi-token prediction heads onto a trained model, whose weights stay as they are

The model continues openings of the corpus's documents greedily (the C engine, on the file's own
weights) and each head learns, from the hidden state the engine hands back, the token 2, 3, ...
after it: the model's own choices, which is what `--spec mtp` is judged against. The heads are
written with the model into a new file (its tensors byte for byte), ready for
`cflow generate --spec mtp`. Expect a few minutes on 2 cores for a family model at the defaults.

examples:
  cflow train heads model.cflow --out model-mtp.cflow                 # 3 heads, 1M tokens
  cflow train heads model.cflow --mtp 2 --tokens 300000 --out m2.cflow
  cflow convert SmolLM2-135M-Instruct.Q4_1.gguf smollm2.cflow && \
      cflow train heads smollm2.cflow --chat --out smollm2-mtp.cflow  # an instruct model: its own answers
  cflow generate -m model-mtp.cflow --spec mtp -p "Once upon a time"

The report gives each head's agreement with the model's next choices on held-out continuations,
and the proposals a greedy round would keep on average (the heads' chained agreement). Memory: the
collected hidden states take --tokens x d_model x 4 bytes (1M tokens of SmolLM2's 576: 2.3 GB),
and each training step multiplies by the whole output matrix (vocabulary x d_model).
"""


def register(tsub: argparse._SubParsersAction) -> None:
    from cflow.train.heads import HeadsConfig

    dflt = HeadsConfig()
    h = add_command(tsub, "heads", HELP)
    h.add_argument("model", type=Path, help="the trained .cflow model (e.g. from `cflow export`)")
    h.add_argument("--out", type=Path, required=True, help="the new .cflow file: the model with its heads")
    h.add_argument("--mtp", type=int, default=dflt.n_heads, metavar="N",
                   help=f"heads to train: tokens 2..N+1 ahead (default {dflt.n_heads})")
    h.add_argument("--tokens", type=int, default=dflt.tokens,
                   help=f"greedy continuation tokens to train on (default {dflt.tokens:,})")
    h.add_argument("--val-tokens", type=int, default=dflt.val_tokens,
                   help=f"continuation tokens of held-out openings, for the report (default {dflt.val_tokens:,})")
    h.add_argument("--steps", type=int, default=dflt.steps, help=f"optimizer steps (default {dflt.steps})")
    h.add_argument("--batch-size", type=int, default=dflt.batch_size,
                   help=f"positions per step (default {dflt.batch_size})")
    h.add_argument("--lr", type=float, default=dflt.lr, help=f"peak learning rate, AdamW (default {dflt.lr:g})")
    h.add_argument("--data", help="corpus whose documents open the continuations: a .jsonl[.xz|.gz] or .txt file, "
                   "or omit for the shipped stories (the family's training corpus)")
    h.add_argument("--chat", action="store_true",
                   help="for instruct models: open each continuation with a story request through the model's chat "
                   "template (the prompts the story corpus was written from) instead of a document's first tokens")
    h.add_argument("--seed", type=int, default=dflt.seed, help=f"seed (default {dflt.seed})")
    h.add_argument("-t", "--threads", type=int, help="threads for the engine and torch (default: every usable core)")
    h.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    h.add_argument("--no-progress", action="store_true", help="no progress bars")
    h.set_defaults(func=run)


def _command(args: argparse.Namespace) -> str:
    """The command line, rebuilt from the parsed flags (recorded in the file's metadata): sys.argv is
    not it when cflow.cli.main is called with arguments."""
    words = ["cflow", "train", "heads", str(args.model), "--out", str(args.out), "--mtp", str(args.mtp),
             "--tokens", str(args.tokens), "--val-tokens", str(args.val_tokens), "--steps", str(args.steps),
             "--batch-size", str(args.batch_size), "--lr", f"{args.lr:g}", "--seed", str(args.seed)]
    words += ["--data", args.data] if args.data is not None else []
    words += ["--chat"] if args.chat else []
    words += ["--threads", str(args.threads)] if args.threads is not None else []
    return shlex.join(words)


def run(args: argparse.Namespace) -> int:
    from cflow.errors import CflowError
    from cflow.train.heads import HeadsConfig, train_model_heads

    try:
        hc = HeadsConfig(n_heads=args.mtp, tokens=args.tokens, val_tokens=args.val_tokens, steps=args.steps, batch_size=args.batch_size,
                         lr=args.lr, seed=args.seed, threads=args.threads, chat=args.chat)
        res = train_model_heads(args.model, args.out, hc, data=args.data, overwrite=args.overwrite,
                                progress=not args.no_progress, command=_command(args))
    except CflowError as e:
        print(f"cflow train heads: error: {e}", file=sys.stderr)
        return 2
    print(f"trained {res.n_heads} heads on {res.train_tokens:,} continuation tokens ({res.collect_s:.0f} s collecting, "
          f"{res.train_s:.0f} s training)")
    for j, (a, c) in enumerate(zip(res.val_top1, res.val_chain)):
        print(f"  head {j} (token {2 + j} ahead): agrees with the model {a:.3f}, heads 0..{j} all agree {c:.3f}")
    print(f"a greedy round proposing all {res.n_heads} keeps {res.accepted_per_round:.2f} on average (held out)")
    print(f"model with heads: {res.path}  (cflow generate -m {shlex.quote(res.path)} --spec mtp -p ...)")
    return 0
