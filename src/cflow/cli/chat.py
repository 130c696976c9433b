"""`cflow chat`: an interactive terminal conversation using the model file's chat template.

Lines are read with readline (history kept in the cflow cache directory); the answer streams as
it is generated. A reasoning model's thoughts (gpt-oss's analysis channel, a <think> block:
cflow.reasoning) go to stderr and its answer to stdout; the conversation keeps them apart (`reasoning_content`). Commands: /exit (or Ctrl-D) quits, /reset forgets the conversation, /help.
Ctrl-C stops the current answer (a second Ctrl-C at the prompt quits). When the conversation no
longer fits the context, the oldest turns are dropped (the system prompt stays). Consecutive
turns reuse the KV cache of the common prefix, so each answer only evaluates the new tokens.
"""

from __future__ import annotations

import argparse
import sys

from cflow.cli.common import (UsageError, add_chat_template_flags, add_command, add_model_flags, add_sampling_flags,
                              add_speculative_flags, check_model_flags, check_sampling, check_speculative, load_engine,
                              load_speculative, sampling_kwargs, template_kwargs_from_flags)
from cflow.reasoning import answer_parser, prompt_tail, thinks_in_tags
from cflow.runtime import ContextOverflowError

IN_CHAT_HELP = "commands: /exit (or Ctrl-D) quit, /reset start over, /help this text"
NO_TEMPLATE = ("cflow chat: this model has no chat template, so a plain ChatML default is used and replies "
               "may be poor (instruction-tuned models such as SmolLM2 carry their own template)")


HELP = """\
chat with a model in the terminal

An interactive conversation rendered with the model's chat template. Commands: /exit (or
Ctrl-D) quits, /reset starts over, /help lists them. Without a terminal, each line of stdin is one
user turn.

examples:
  cflow chat -m smollm2.cflow -sys "You are a concise assistant."
  cflow chat -m SmolLM2-135M-Instruct.Q4_1.gguf --temp 0 --perf
  printf 'Hi!\\nWhat is 2+2?\\n' | cflow chat -m smollm2.cflow -n 32
  cflow chat -m smollm2.cflow --temp 0 --spec ngram --perf
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "chat", HELP)
    add_model_flags(p)
    p.add_argument("-sys", "--system", "--system-prompt", dest="system", default=None,
                   help="a system prompt opening the conversation")
    p.add_argument("-n", "--n-predict", type=int, default=-1,
                   help="at most this many tokens per answer (default -1: until end of turn)")
    add_sampling_flags(p)
    add_speculative_flags(p)
    p.add_argument("--perf", action="store_true", help="print tokens/s after each answer")
    add_chat_template_flags(p)
    p.set_defaults(func=run)


def _setup_readline():
    try:
        import readline
    except ImportError:  # not on every platform; input() still works
        return None
    from cflow.fsutil import cache_dir

    path = cache_dir() / "chat_history"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)
    return readline, path


def _save_history(rl) -> None:
    if rl is not None:
        try:
            rl[0].write_history_file(rl[1])
        except OSError:
            pass


def _answer(eng, messages: list[dict], max_tokens: int | None, kw: dict, template_kw: dict | None = None,
            show_thoughts: bool = True) -> dict:
    """Stream one answer, its assistant message; drops the oldest turns while the conversation
    does not fit. `template_kw`: extra chat-template variables; `show_thoughts` False: a reasoning
    model's thoughts are not taken apart from its answer (--reasoning-format none)."""
    template_kw = template_kw or {}
    while True:
        try:
            prompt = eng.chat_tokens(messages, **template_kw)
            stream = eng.generate(prompt, max_tokens, **kw)
            template = eng.tokenizer.chat_template
            # a <think> template's prompt may open the thought: the parser starts inside it then
            tail = prompt_tail(eng.tokenizer, prompt) if thinks_in_tags(template) else ""
            parser = answer_parser(template, tail) if show_thoughts else None
            parts, thoughts = [], []

            def show(reasoning: str, content: str) -> None:
                if reasoning:
                    sys.stderr.write(reasoning)
                    sys.stderr.flush()
                    thoughts.append(reasoning)
                if content:
                    if thoughts and not parts:
                        sys.stderr.write("\n")
                    sys.stdout.write(content)
                    sys.stdout.flush()
                    parts.append(content)

            def parsed(out) -> None:   # a harmony call has no tools to go to here: its text is shown
                show(out.reasoning, out.content + "".join(f"[{name}] {args}" for name, args in out.calls))
            try:
                for piece in stream:
                    if parser is None:
                        show("", piece)
                    else:
                        parsed(parser.feed(piece))
            except KeyboardInterrupt:
                sys.stdout.write(" [interrupted]")
            if parser is not None:
                parsed(parser.finish())
            sys.stdout.write("\n")
            message = {"role": "assistant", "content": "".join(parts)}
            return {**message, "reasoning_content": "".join(thoughts)} if thoughts else message
        except ContextOverflowError:
            first = 1 if messages and messages[0]["role"] == "system" else 0
            if len(messages) - first <= 1:
                raise
            del messages[first:first + 2]  # the oldest user turn and its answer
            print(f"[the conversation is longer than the context ({eng.n_ctx} tokens): dropped the oldest "
                  f"turn; -c raises the limit]", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    kw = sampling_kwargs(args)
    check_model_flags(args)
    check_sampling(kw)
    spec = check_speculative(args)
    template_kw = template_kwargs_from_flags(args)
    if sys.stdin is None:  # the shell closed it (`cflow chat <&-`): there is nothing to read turns from
        raise UsageError("stdin is closed, so there is no conversation to read; run cflow chat in a terminal, "
                         "or pipe the user turns into it, one per line")
    eng = load_engine(args)
    kw["speculative"] = load_speculative(args, spec, eng)
    if not eng.tokenizer.chat_template:
        print(NO_TEMPLATE, file=sys.stderr)
    max_tokens = None if args.n_predict < 0 else args.n_predict
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    rl = _setup_readline()
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"cflow chat: {eng.path} ({eng.threads} threads, context {eng.n_ctx}). {IN_CHAT_HELP}", file=sys.stderr)
    status = 0
    try:
        while True:
            try:
                line = input("> " if interactive else "")
            except EOFError:
                break
            except KeyboardInterrupt:  # at the prompt: leave, as a process stopped by Ctrl-C (a reply's
                print("", file=sys.stderr)  # Ctrl-C only ends that reply: _answer)
                status = 130
                break
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                messages = list(system)
                print("[conversation cleared]", file=sys.stderr)
                continue
            if text == "/help":
                print(IN_CHAT_HELP, file=sys.stderr)
                continue
            messages.append({"role": "user", "content": line})
            messages.append(_answer(eng, messages, max_tokens, kw, template_kw, args.reasoning_format != "none"))
            if args.perf:
                t = eng.last_timings
                spec = (f", {t.spec}: {100 * t.acceptance_rate:.0f}% of {t.drafted} proposed accepted, "
                        f"{t.mean_accepted:.2f} per call" if t.spec else "")
                print(f"[{t.prompt_tokens} prompt tokens at {t.prompt_tps:.1f} t/s, {t.gen_tokens} tokens at "
                      f"{t.gen_tps:.1f} t/s{spec}]", file=sys.stderr)
    finally:
        _save_history(rl)
    return status
