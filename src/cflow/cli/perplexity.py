"""`cflow perplexity -m FILE --file TEXT`: a model's perplexity on a text file in llama.cpp's
llama-perplexity convention (cflow.bench.perplexity.strided_perplexity), printed as that tool
prints it, so the two programs' numbers can be set side by side."""

from __future__ import annotations

import argparse
import json
import sys
import time

from cflow.cli.common import FileError, UsageError, add_command, add_model_flags, load_engine, log

DEFAULT_WINDOW = 512  # llama-perplexity's customary -c (the numbers people quote are at 512)

HELP = f"""\
perplexity of a model on a text file, as llama.cpp's llama-perplexity computes it

The file is tokenized whole (with a BOS token first when the model adds one) and cut into
windows of -c tokens (default {DEFAULT_WINDOW}); each window is evaluated on its own from position 0,
its first token replaced by BOS when the model uses one, and only its second half is scored:
every token from position c/2 + 1 on, each with at least c/2 tokens of context. The PPL is
exp(mean negative log-likelihood) over all scored tokens, the "+/-" its standard error. The
running PPL after each window prints as [1]x,[2]y,... and the last line as llama-perplexity's:

  Final estimate: PPL = 12.3456 +/- 0.12345

Use the same -c and text for both programs to compare them. The text needs at least 2c tokens.

examples:
  cflow perplexity -m SmolLM2-135M-Instruct.Q4_1.gguf --file wiki.test.raw
  cflow perplexity -m model.gguf --file story.txt -c 256 --chunks 10 --json
  llama-perplexity -m model.gguf -f story.txt -c 256 --chunks 10      # llama.cpp's, to compare
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "perplexity", HELP)
    add_model_flags(p)
    for action in p._actions:  # -c is the window here, as in llama-perplexity
        if action.dest == "ctx_size":
            action.default = DEFAULT_WINDOW
            action.help = (f"tokens per window (default {DEFAULT_WINDOW}, llama-perplexity's usual -c); the second "
                           f"half of each window is scored")
    p.add_argument("-f", "--file", required=True, metavar="TEXT", help="the text file (UTF-8) to score")
    p.add_argument("--chunks", type=int, default=-1, metavar="N",
                   help="score at most N windows (default -1: every whole window in the file)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of llama-perplexity's lines")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cflow.bench.perplexity import min_tokens, strided_perplexity

    if args.ctx_size < 4:
        raise UsageError(f"must be >= 4 tokens, got {args.ctx_size}", flag="-c")
    try:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise FileError(f"cannot read {args.file}: {getattr(e, 'strerror', None) or e}") from None
    eng = load_engine(args)
    try:
        tok = eng.tokenizer
        t0 = time.perf_counter()
        ids = eng.encode(text)  # the model's BOS rule, as llama-perplexity's common_tokenize(..., true)
        log(f"tokenized {args.file}: {len(ids)} tokens in {(time.perf_counter() - t0) * 1e3:.0f} ms")
        if len(ids) < min_tokens(args.ctx_size):
            raise UsageError(f"{args.file} has {len(ids)} tokens; a window of {args.ctx_size} needs at least "
                             f"{min_tokens(args.ctx_size)}: give a longer text or a smaller -c", flag="-c")
        n = len(ids) // args.ctx_size if args.chunks < 0 else min(args.chunks, len(ids) // args.ctx_size)
        log(f"calculating perplexity over {n} chunks, n_ctx={args.ctx_size}")
        bos = tok.bos_id if tok.add_bos else None
        t0 = time.perf_counter()

        def shown(i: int, ppl: float) -> None:
            if not args.json:
                print(f"[{i + 1}]{ppl:.4f},", end="", flush=True)

        r = strided_perplexity(eng, ids, args.ctx_size, chunks=args.chunks, bos=bos, on_chunk=shown)
        secs = time.perf_counter() - t0
    finally:
        eng.close()
    if args.json:
        print(json.dumps({"file": args.file, "model": str(eng.path), "n_ctx": r.n_ctx, "chunks": r.chunks,
                          "scored_tokens": r.n_tokens, "ppl": r.ppl, "ppl_err": r.err, "nll": r.nll,
                          "running": r.running, "seconds": secs}))
    else:
        print()
        print(f"Final estimate: PPL = {r.ppl:.4f} +/- {r.err:.5f}")
        print(f"cflow: {r.n_tokens} tokens scored in {secs:.1f} s", file=sys.stderr)
    return 0
