"""`cflow bench`: llama-bench-style pp/tg tokens/s, bandwidth context, optional llama.cpp side by side."""

from __future__ import annotations

import argparse
import sys

from cflow.cli.common import (UsageError, add_cache_flags, add_command, add_expert_flags, add_hugepages_flag,
                              add_speculative_flags,
                              add_verify_flag, check_speculative, engine_options, load_error, read_flag_file,
                              write_text)
from cflow.fsutil import check_writable


def _int_list(text: str, zero: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected integers >= 0 ({zero}), got {text!r}")
    return vals


def _thread_list(text: str) -> list[int]:
    return _int_list(text, "0 = every usable core")


def _depth_list(text: str) -> list[int]:
    return _int_list(text, "0 = an empty context")


def _prefetch(text: str) -> int | None:
    from cflow.runtime import prefetch

    try:
        return prefetch.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


HELP = """\
measure prompt (pp) and generation (tg) tokens/s, like llama-bench

Measure prompt processing (ppN) and generation (tgN) tokens/s, mean ± stddev over repetitions
after a warm-up, with the weight bytes per token the engine counted, effective GB/s and the share
of this machine's read bandwidth (measured by cflow's probe in the same run). With --compare
llama.cpp, llama-cpp-python runs the same GGUF with the same threads, interleaved with cflow, and
the table shows cflow's speed over the baseline's.

The tg test runs exactly -n decode steps, each feeding back the most likely token whatever it is
(end of text included), as llama-bench does. -d runs every test after that many context tokens
(filled untimed), as llama-bench's -d: "tg128 @ d4096" decodes with 4096 positions of KV cache
behind each step. Sizes are decimal: MB = 10^6 bytes.

examples:
  cflow bench -m SmolLM2-135M-Instruct.Q4_1.gguf -t 1,2 --compare llama.cpp
  cflow bench -m smollm2.cflow -p 0 -n 64 -r 3 --json --out tg64.json
  cflow bench -m SmolLM2-135M-Instruct.Q4_1.gguf -p 0 -d 0,1024,4096 --compare llama.cpp
  cflow bench -m smollm2.cflow -t 1,2 --profile --trace trace.json
  cflow bench -m smollm2.cflow -t 1 --prefetch 1024 --json --out pf1024.json
  cflow bench -m smollm2.cflow -t 2 -p 0 -n 32 --profile --batch 8   # + batched steps of 8 sequences
  cflow bench -m SmolLM2-135M-Instruct.Q4_1.gguf -t 2 -p 0 -n 128 --spec ngram --json
  cflow bench -m big.gguf --model-draft small.gguf -p 0 --spec-prompt @article_and_question.txt

With --spec (ngram, draft or mtp) every thread count also runs a speculative test: plain and
speculative greedy decoding each generate exactly -n tokens from --spec-prompt (by default a story
from the package's corpus and the request to repeat it: an input-grounded task), alternating; the
report gives both speeds, their ratio, the acceptance rate, the accepted tokens per verification
call and whether the two outputs were identical.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "bench", HELP)
    p.add_argument("-m", "--model", help="a .cflow file, or a .gguf (converted once into the cache); required "
                   "unless running `cflow bench claims`")
    p.add_argument("-t", "--threads", type=_thread_list, default=None, metavar="N[,N...]",
                   help="thread counts to test, comma-separated; 0 = every usable core (the default)")
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens for the pp test (0 skips it)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens for the tg test (0 skips it)")
    p.add_argument("-d", "--n-depth", type=_depth_list, default=[0], metavar="N[,N...]",
                   help="context depths: run each test after N context tokens (default 0)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="timed repetitions per test (default 5)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="accepted for llama.cpp command lines; always the case here: tg never stops at the "
                   "end-of-text token")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run")
    p.add_argument("--compare", choices=["llama.cpp"], default=None,
                   help="also run this baseline on the same GGUF (needs `pip install 'cflow-lm[bench]'`)")
    p.add_argument("--no-probe", action="store_true", help="skip the read-bandwidth probe")
    p.add_argument("--no-footprint", action="store_true",
                   help="skip the load-time / first-token / resident-memory measurement")
    add_verify_flag(p)
    add_hugepages_flag(p)
    add_cache_flags(p)
    add_expert_flags(p)
    add_speculative_flags(p)
    p.add_argument("--spec-prompt", default=None, metavar="TEXT|@FILE",
                   help="with --spec: the prompt the speculative test decodes from (@FILE reads a UTF-8 file); "
                   "default: a shipped story and the request to repeat it")
    p.add_argument("--prefetch", type=_prefetch, default=None, metavar="off|default|N",
                   help="software prefetch (PREFETCHT0) in cflow's kernels (claim C6; not --expert-speculation, "
                   "which reads experts from disk early): default = each kernel's own choice (mat-vec and gate/up "
                   "8 KiB ahead, none on Zen 4, 2 KiB on Intel; avx512 batched kernels 4 KiB), off = none anywhere, "
                   "N = PREFETCHT0 N bytes ahead in "
                   "every weight-streaming kernel (decode and prefill); recorded in the report")
    p.add_argument("-o", "--output", choices=["md", "json"], default="md", help="output format (default md)")
    p.add_argument("--json", action="store_true", help="same as -o json")
    p.add_argument("--out", metavar="FILE", default=None,
                   help="also write the report to this file (checked before the benchmark starts)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--profile", action="store_true",
                   help="instead of the pp/tg tests, show where the time goes: per-op time of a decode step "
                   "(-n steps) and of a prefill batch (-p prompt tokens) per thread, barrier waits included, "
                   "with bytes and GB/s per op")
    p.add_argument("--batch", type=int, default=0, metavar="N",
                   help="with --profile: also profile -n batched decode steps of N sequences (one pass over the "
                   "weights for N tokens, as `cflow serve` runs them)")
    p.add_argument("--trace", metavar="FILE.json", default=None,
                   help="with --profile: also write a Chrome trace (one track per thread, every op of every "
                   "layer) that Perfetto (ui.perfetto.dev) and chrome://tracing open")
    p.set_defaults(func=run)
    actions = p.add_subparsers(dest="bench_action", metavar="claims", title="the paper's claims",
                               description="`cflow bench claims --help`: re-measure every claim of the paper")
    c = add_command(actions, "claims", CLAIMS_HELP)
    c.add_argument("--out", default="docs/claims", metavar="DIR",
                   help="report directory: report.md, report.json and the plots (default docs/claims)")
    c.add_argument("--quick", action="store_true",
                   help="smoke test: tiny models, few repetitions, one thread; timing verdicts are inconclusive")
    c.add_argument("--only", default=None, metavar="C1,C3,...",
                   help="run only these claims (default: all); the other sections of an existing DIR/report.json "
                        "are kept, so one claim can be re-measured without the hour-long rest")
    c.add_argument("--no-merge", action="store_true",
                   help="with --only: replace the report instead of keeping the other claims' sections")
    c.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="threads (default: every usable core; 1 with --quick)")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    c.set_defaults(func=run_claims)


CLAIMS_HELP = """\
re-measure the paper's claims (C1-C8, T1) and write a report with a verdict for each

Run each claim's experiment and write DIR/report.md (per claim: what the paper says with its
number, what this machine shows, the commands, the verdict confirmed / refuted / inconclusive with the
reason), DIR/report.json (the data) and PNG plots. The full run wants an idle machine and an hour or
more (training, cachegrind, side-by-side runs against llama.cpp); --quick is a smoke test of a couple
of minutes whose timing verdicts are inconclusive by design. Progress lines go to stderr.

examples:
  cflow bench claims --out docs/claims
  cflow bench claims --quick --out /tmp/claims
  cflow bench claims --only C1,C2,C3 --out /tmp/claims
  cflow bench claims --only T1 --out docs/claims   # re-measure T1, keep the other sections
"""


def run_claims(args: argparse.Namespace) -> int:
    from cflow.bench.claims.runner import parse_only, run_claims as run_all

    if args.threads is not None and args.threads < 1:
        raise UsageError(f"must be >= 1, got {args.threads}", flag="-t")
    try:
        parse_only(args.only)
    except ValueError as e:
        raise UsageError(str(e), flag="--only") from None
    progress = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    results = run_all(args.out, quick=args.quick, only=args.only, threads=args.threads, progress=progress,
                      merge=not args.no_merge)
    for r in results:
        print(f"{r.id:3} {r.verdict:13} {r.title}")
    print(f"report: {args.out}/report.md")
    return 0


def _options(args: argparse.Namespace):
    """The engine options of the model flags. -t here is a list of counts the suite loads the
    model with one at a time, and the suite sizes the context to its tests: neither is an option."""
    return engine_options(args, threads=None, n_ctx=None)


def run(args: argparse.Namespace) -> int:
    from cflow.bench import bench

    if not args.model:
        raise UsageError("a model is required: -m FILE (a .cflow or .gguf); or `cflow bench claims`", flag="-m")

    for flag, n in (("-p", args.n_prompt), ("-n", args.n_gen)):
        if n < 0:
            raise UsageError(f"must be >= 0 (0 skips the test), got {n}", flag=flag)
    if args.trace and not args.profile:
        raise UsageError("--trace writes the profile's trace: add --profile", flag="--trace")
    if args.batch and not args.profile:
        raise UsageError("--batch profiles batched steps: add --profile", flag="--batch")
    if args.batch < 0 or args.batch == 1 or (args.batch and not args.n_gen):
        raise UsageError(f"--batch takes N >= 2 sequences and -n > 0 steps (got {args.batch}, -n {args.n_gen})",
                         flag="--batch")
    if args.profile and args.n_prompt + args.n_gen == 0:
        raise UsageError("nothing to profile: -p and -n are both 0", flag="--profile")
    spec = check_speculative(args)
    if spec is not None and args.profile:
        raise UsageError("--profile measures plain steps; drop --spec", flag="--spec")
    if args.spec_prompt is not None and spec is None:
        raise UsageError("--spec-prompt is the speculative test's prompt: add --spec ngram|draft|mtp",
                         flag="--spec-prompt")
    spec_prompt = args.spec_prompt
    if spec_prompt is not None and spec_prompt.startswith("@"):
        spec_prompt = read_flag_file(spec_prompt[1:], "--spec-prompt")
    if args.out:
        check_writable(args.out, file=True)  # before minutes of measuring, not after
    if args.trace:
        check_writable(args.trace, file=True)
    progress = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.profile:
        return _run_profile(args, progress)
    try:
        report = bench(args.model, threads=args.threads, pp=args.n_prompt, tg=args.n_gen,
                       reps=args.repetitions, warmup=not args.no_warmup, compare=args.compare,
                       probe=not args.no_probe, footprint=not args.no_footprint,
                       progress=progress, depths=args.n_depth, options=_options(args), spec=spec,
                       spec_prompt=spec_prompt)
    except OSError as e:  # the model unreadable, or the cache a .gguf is converted into unwritable
        raise load_error(args.model, e) from None
    text = report.to_json() if args.json or args.output == "json" else report.to_markdown()
    print(text)
    if args.out:
        write_text(args.out, text + "\n")
    return 0


def _run_profile(args: argparse.Namespace, progress) -> int:
    import json

    from cflow.bench.profile import profile_model, write_trace

    if args.compare:
        raise UsageError("--profile measures cflow alone; drop --compare", flag="--compare")
    try:
        profiles = profile_model(args.model, threads=args.threads, steps=args.n_gen, prefill=args.n_prompt,
                                 progress=progress, batch=args.batch, options=_options(args))
    except OSError as e:
        raise load_error(args.model, e) from None
    if args.json or args.output == "json":
        text = json.dumps({"profiles": [p.to_dict() for p in profiles]}, indent=2)
    else:
        text = "\n\n".join(p.to_markdown() for p in profiles)
    print(text)
    if args.out:
        write_text(args.out, text + "\n")
    if args.trace:
        write_trace(args.trace, profiles)
        if progress:
            progress(f"trace: {args.trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    return 0
