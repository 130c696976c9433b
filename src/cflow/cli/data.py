"""`cflow data stories` (distill a chat model into a story directory) and `cflow data build`
(clean, deduplicate and split story directories into one corpus file): cflow.corpus."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from cflow.cli.common import UsageError, add_command

HELP = """\
make training corpora: distill a chat model into stories, then build a deduplicated corpus

`cflow data stories` asks a chat model (the teacher) for short stories for small children, the
TinyStories recipe: each prompt names a verb, a noun and an adjective a 3-year-old knows and, most
of the time, a feature (dialogue, a lesson, a twist, a happy or sad ending). Stories decode
together through cflow's batched engine and are written as JSONL shards with a manifest (the
teacher's hash, the sampling, the seeds, the counts). A second run on the same directory continues
it; Ctrl-C stops cleanly and loses only the stories still decoding.

`cflow data build` turns story directories (and JSONL files of the same schema) into one
training corpus: unfinished last sentences cut, short answers dropped, exact and near duplicates
removed (MinHash LSH over word 3-grams), the train/validation split counted. Train on it with
`cflow train --data CORPUS.jsonl.xz`.

examples:
  cflow data stories -m SmolLM2-135M-Instruct.Q4_1.gguf --tokens 5000000 --out data/stories
  cflow data stories -m SmolLM2-135M-Instruct.Q4_1.gguf --tokens 10000000 --out data/stories  # continue
  cflow data build data/stories extra.jsonl --out data/stories-corpus.jsonl.xz
"""

STORIES_HELP = """\
distill a chat model into a story directory (resumable)

Generates stories until the directory holds --tokens generated tokens. Each story is one seed
(its prompt words and its sampling both follow from it), seeds are used in order, and those
already in the directory are skipped, so continuing never repeats one. The sampling settings are
part of the directory: continuing it with other settings is refused.

examples:
  cflow data stories -m SmolLM2-135M-Instruct.Q4_1.gguf --tokens 5000000 --out data/stories
  cflow data stories -m teacher.gguf --tokens 20000 --out /tmp/try -np 8 --temp 1.0
"""

BUILD_HELP = """\
clean, deduplicate and split stories into one corpus file (.jsonl.xz)

Reads story directories written by `cflow data stories` and JSONL files (a `text` field per line;
`finish` = "length" marks a story cut at the token limit), in the order given; the first copy of a
duplicate is kept. Writes CORPUS.jsonl.xz and CORPUS.json (every count) beside it.

examples:
  cflow data build data/stories --out data/stories-corpus.jsonl.xz
  cflow data build data/stories data/seed/stories-smollm2.jsonl.xz --out corpus.jsonl.xz --threshold 0.7
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "data", HELP)
    inner = p.add_subparsers(dest="data_command", metavar="{stories,build}")
    s = add_command(inner, "stories", STORIES_HELP)
    s.add_argument("-m", "--model", required=True, help="the teacher: a chat model (.gguf or .cflow)")
    s.add_argument("--tokens", type=int, required=True, help="generated tokens the directory should hold")
    s.add_argument("--out", required=True, help="the story directory (created if its parent exists; continued "
                   "if it holds a manifest)")
    s.add_argument("-np", "--parallel", type=int, default=16, help="stories decoding together (default 16)")
    s.add_argument("-t", "--threads", type=int, default=0, help="threads (default 0: every usable core)")
    s.add_argument("--temp", type=float, default=0.8, help="sampling temperature (default 0.8)")
    s.add_argument("--top-p", type=float, default=0.95, help="default 0.95")
    s.add_argument("--top-k", type=int, default=40, help="default 40")
    s.add_argument("--min-p", type=float, default=0.05, help="default 0.05")
    s.add_argument("--repeat-penalty", type=float, default=1.15, help="default 1.15")
    s.add_argument("-n", "--max-tokens", type=int, default=320, help="longest story in tokens (default 320)")
    s.add_argument("--first-seed", type=int, default=None, help="the first story's seed (default 10000000)")
    s.add_argument("--shard-stories", type=int, default=2000, help="stories per sealed shard (default 2000)")
    s.set_defaults(func=run_stories)
    b = add_command(inner, "build", BUILD_HELP)
    b.add_argument("sources", nargs="+", help="story directories and .jsonl / .jsonl.xz files")
    b.add_argument("--out", required=True, help="the corpus file to write (.jsonl.xz)")
    b.add_argument("--threshold", type=float, default=0.8,
                   help="Jaccard similarity of word 3-grams at which a story counts as a near duplicate (default 0.8)")
    b.add_argument("--val-fraction", type=float, default=None, help="held-out share to count (default 0.05, "
                   "the split `cflow train` uses)")
    b.set_defaults(func=run_build)
    p.set_defaults(func=lambda args: (p.print_help(), 1)[1])


def run_stories(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from cflow.corpus.distill import FIRST_SEED, StorySampling, distill
    from cflow.sampling import SamplingParams

    if args.tokens < 1:
        raise UsageError(f"must be >= 1, got {args.tokens}", flag="--tokens")
    if args.parallel < 1:
        raise UsageError(f"must be >= 1, got {args.parallel}", flag="-np")
    if args.max_tokens < 1:
        raise UsageError(f"must be >= 1, got {args.max_tokens}", flag="-n")
    sampling = StorySampling(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                             repeat_penalty=args.repeat_penalty, max_tokens=args.max_tokens)
    SamplingParams(**{k: v for k, v in vars(sampling).items() if k != "max_tokens"})  # checks before loading
    stop = threading.Event()
    bar = None

    def on_sigint(signum: int, frame: object) -> None:
        if stop.is_set():  # a second Ctrl-C: quit now (the directory stays whole-lined)
            raise KeyboardInterrupt
        stop.set()
        print("\nstopping: sealing the open shard (Ctrl-C again to quit at once)", file=sys.stderr)

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, initial=done, unit="tok", unit_scale=True, desc="stories", smoothing=0.05,
                       file=sys.stderr)
        bar.update(done - bar.n)

    old = signal.signal(signal.SIGINT, on_sigint)
    try:
        r = distill(args.model, args.out, args.tokens, parallel=args.parallel, threads=args.threads or None,
                    sampling=sampling, first_seed=FIRST_SEED if args.first_seed is None else args.first_seed,
                    shard_stories=args.shard_stories, progress=progress, stop=stop,
                    log=lambda m: print(m, file=sys.stderr))
    finally:
        signal.signal(signal.SIGINT, old)
        if bar is not None:
            bar.close()
    print(f"{r.out}: {r.stories} stories, {r.tokens} tokens; this run {r.new_stories} stories, "
          f"{r.new_tokens} tokens in {r.seconds:.0f} s ({r.tok_s:.0f} tok/s)"
          + (f"; {r.torn_lines} torn line cut from a crashed run" if r.torn_lines else ""))
    if r.interrupted:
        print("interrupted: continue with the same command", file=sys.stderr)
        return 130
    return 0


def run_build(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from cflow.corpus.build import build, report_path

    with tqdm(unit=" stories", desc="building", file=sys.stderr) as bar:
        r = build(args.sources, args.out, threshold=args.threshold, val_fraction=args.val_fraction,
                  progress=bar.update)
    print(f"{r.out}: {r.documents} documents ({r.characters / 1e6:.1f} M characters; train {r.train_documents}, "
          f"validation {r.val_documents}) from {r.answers} answers ({r.teacher_tokens} teacher tokens): "
          f"{r.too_short} too short, {r.exact_duplicates} exact and {r.near_duplicates} near duplicates "
          f"dropped, {r.cut_at_length} cut at the length limit; report {report_path(Path(r.out))}")
    return 0
