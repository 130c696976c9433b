"""`cflow generate [PROMPT]`: stream a continuation to stdout, llama.cpp-style flags and timings;
with --json, one JSON object on stdout instead, for scripts."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

from cflow.cli.common import (UsageError, add_command, add_constraint_flags, add_model_flags, add_sampling_flags,
                              add_speculative_flags, check_model_flags, check_sampling, check_speculative,
                              constraint_from_flags, load_engine, load_speculative, print_timings, sampling_kwargs)


HELP = """\
generate text from a prompt (streams to stdout)

Continue a prompt with a .cflow model (or a .gguf, converted once into the cache). Flags follow
llama.cpp's names and defaults; the text goes to stdout, timings to stderr.

examples:
  cflow generate "Once upon a time" -n 64
  cflow generate -m smollm2.cflow -p "The capital of France is" --temp 0
  cflow generate -m smollm2.cflow -p "Hi" -n 16 --json | jq -r .text
  cflow generate -m smollm2.cflow -f article_and_question.txt --temp 0 --spec ngram
  cflow generate -m big.gguf --model-draft small.gguf --draft-max 6 -p "Once upon a time"
  cflow generate -m smollm2.gguf -p "A person as JSON:" --json-schema person.schema.json
  cflow generate -m smollm2.gguf -p "Is the sky blue? Answer:" --grammar 'root ::= " yes" | " no"'
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "generate", HELP)
    p.add_argument("prompt_arg", nargs="?", metavar="PROMPT", help="the prompt (or use -p / -f, or pipe it in)")
    p.add_argument("-p", "--prompt", help="the prompt")
    p.add_argument("-f", "--file", help="read the prompt from this file")
    p.add_argument("-n", "--n-predict", type=int, default=-1,
                   help="tokens to generate (default -1: until end of text or the context is full)")
    add_model_flags(p)
    add_sampling_flags(p)
    add_speculative_flags(p)
    add_constraint_flags(p)
    p.add_argument("--stop", "-r", "--reverse-prompt", action="append", default=[], metavar="TEXT",
                   help="stop when TEXT is generated (repeatable; TEXT is not printed)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the model's end-of-text token: always generate -n tokens "
                   "(llama.cpp's flag; for timing runs)")
    p.add_argument("--no-display-prompt", action="store_true", help="print only the generated text")
    p.add_argument("--no-perf", action="store_true", help="do not print timings to stderr")
    p.add_argument("--json", action="store_true",
                   help="print nothing while generating, then one JSON object on stdout: text, tokens, "
                   "prompt_tokens, finish_reason, timings (with speculation: acceptance_rate, mean_accepted), "
                   "seed, model (no timing report on stderr)")
    p.set_defaults(func=run)


def read_prompt(args: argparse.Namespace) -> str:
    given = [x for x in (args.prompt_arg, args.prompt) if x is not None]
    if args.file:
        try:
            given.append(Path(args.file).read_text(encoding="utf-8"))
        except OSError as e:
            raise UsageError(f"cannot read the prompt file {args.file}: {e.strerror or e}", flag="-f") from None
    if len(given) > 1:
        raise UsageError("give the prompt once: as an argument, with -p, or with -f")
    if given:
        return given[0]
    # sys.stdin is None when the shell closed it (`cflow generate <&-`)
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("no prompt: give one as an argument, with -p TEXT or -f FILE (or pipe it in)")
    return sys.stdin.read()


def run(args: argparse.Namespace) -> int:
    kw = sampling_kwargs(args)
    check_model_flags(args)
    check_sampling(kw)
    spec = check_speculative(args)
    constraint = constraint_from_flags(args)
    prompt = read_prompt(args)
    eng = load_engine(args)
    spec = load_speculative(args, spec, eng)
    max_tokens = None if args.n_predict < 0 else args.n_predict
    kw.update(stop=args.stop, ignore_eos=args.ignore_eos, speculative=spec, constraint=constraint)
    if args.json:
        c = eng.complete(prompt, max_tokens, **kw)
        t = c.timings
        timings = dict(dataclasses.asdict(t), prompt_tps=t.prompt_tps, gen_tps=t.gen_tps,
                       acceptance_rate=t.acceptance_rate, mean_accepted=t.mean_accepted)
        print(json.dumps({"text": c.text, "tokens": c.tokens, "prompt_tokens": c.prompt_tokens,
                          "finish_reason": c.finish_reason, "timings": timings, "seed": eng.seed,
                          "model": str(eng.path)}))
    else:
        stream_text(eng, prompt, max_tokens, kw, show_prompt=not args.no_display_prompt)
        if not args.no_perf:
            print_timings(eng, eng.last_timings, eng.last_prompt_len)
    t = eng.last_timings
    if (max_tokens is None or t.gen_tokens < max_tokens) and eng.last_finish_reason == "length":
        print(f"cflow: stopped at the end of the context ({eng.n_ctx} tokens); raise it with -c "
              f"(the model allows {eng.config.max_seq_len})", file=sys.stderr)
    return 0


def stream_text(eng, prompt: str, max_tokens: int | None, kw: dict, show_prompt: bool) -> None:
    out = sys.stdout
    stream = eng.generate(prompt, max_tokens, **kw)
    # The first step evaluates the prompt, so a prompt too long for the context fails before any output.
    first = next(stream, "")
    if show_prompt:
        out.write(prompt)
    for piece in itertools.chain([first], stream):
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
