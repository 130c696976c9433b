"""`cflow bench`: llama-bench-style pp/tg tokens/s, bandwidth context, optional llama.cpp side by side."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="measure prompt (pp) and generation (tg) tokens/s, like llama-bench",
        description="Measure prompt processing (ppN) and generation (tgN) tokens/s, mean ± stddev over "
        "repetitions after a warm-up, with weight bytes per token, effective GB/s and the share of "
        "this machine's read bandwidth (measured by cflow's probe in the same run). With --compare "
        "llama.cpp, llama-cpp-python runs the same GGUF with the same threads, interleaved with cflow, "
        "and the table shows cflow's speed over the baseline's.",
        epilog="example: cflow bench -m SmolLM2-135M-Instruct.Q4_1.gguf -t 1,2 --compare llama.cpp")
    p.add_argument("-m", "--model", required=True, help="a .cflow file, or a .gguf (converted once into the cache)")
    p.add_argument("-t", "--threads", type=_int_list, default=None,
                   help="thread counts to test, comma-separated (default: the cores this process may use)")
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens for the pp test (0 skips it)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens for the tg test (0 skips it)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="timed repetitions per test (default 5)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run")
    p.add_argument("--compare", choices=["llama.cpp"], default=None,
                   help="also run this baseline on the same GGUF (needs `pip install 'cflow-lm[bench]'`)")
    p.add_argument("--no-probe", action="store_true", help="skip the read-bandwidth probe")
    p.add_argument("--no-footprint", action="store_true",
                   help="skip the load-time / first-token / resident-memory measurement")
    p.add_argument("-o", "--output", choices=["md", "json"], default="md", help="output format (default md)")
    p.add_argument("--json", action="store_true", help="same as -o json")
    p.add_argument("--out", type=Path, default=None, help="also write the report to this file")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cflow.bench import bench

    progress = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    report = bench(args.model, threads=args.threads, pp=args.n_prompt, tg=args.n_gen,
                   reps=args.repetitions, warmup=not args.no_warmup, compare=args.compare,
                   probe=not args.no_probe, footprint=not args.no_footprint,
                   progress=progress)
    text = report.to_json() if args.json or args.output == "json" else report.to_markdown()
    print(text)
    if args.out:
        from cflow.fsutil import atomic_write_text

        atomic_write_text(args.out, text + "\n")
    return 0
