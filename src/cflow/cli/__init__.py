"""The `cflow` command line: one module per subcommand, each exposing `register(subparsers)`;
what several share (flags, model loading, errors, writing files) is in cflow.cli.common.

A subcommand module only parses flags and calls the library; errors derived from `CflowError`
are printed as one clear line and exit with status 2, never as a traceback. An error that names
the flag behind it (`flag`, on the runtime's errors and the CLI's UsageError) is shown after it:
`cflow generate: error: -c: ...`.
"""

from __future__ import annotations

import os
import signal
import sys


def _interrupted_while_starting(signum: int, frame: object) -> None:
    """Ctrl-C before a command runs (imports, building the parser): exit 130 and say nothing. At
    once: nothing is open or half-written yet, and an exception raised here could surface wrapped in
    another (Python 3.11 wraps what a class body's __set_name__ raises in RuntimeError)."""
    os._exit(130)


# First, before the imports below (~0.3 s with the subcommands): main() hands Ctrl-C back to Python
# (KeyboardInterrupt, caught there) when the command starts. Only Python's default is replaced, so
# a host that set its own handler keeps it. Imported outside the main thread (a Ray Serve replica
# unpickling `cflow serve --ray`'s loader, cli.serve.load_generator), no command starts here and
# signal handlers cannot be set: leave them.
if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    try:
        signal.signal(signal.SIGINT, _interrupted_while_starting)
    except ValueError:  # not the main thread
        pass

import argparse  # noqa: E402
import importlib  # noqa: E402

from cflow import __version__  # noqa: E402
from cflow.errors import CflowError  # noqa: E402

# Extension modules the commands import only when they run (loading a model, chat's line editing).
# Their initialisation runs Python code and can drop a KeyboardInterrupt raised in it: a Ctrl-C
# landing while `cflow chat` imported cflow._native was lost, and chat went on to wait for input.
# main() imports them (~6 ms) while Ctrl-C still exits at once, so no command meets that window.
EXTENSIONS_IMPORTED_FIRST = ("cflow._native", "tokenizers", "readline")

# Subcommand modules, in the order `cflow --help` lists them.
COMMANDS = ["generate", "chat", "serve", "bench", "perplexity", "convert", "inspect", "cache", "analyze", "data", "train", "export"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cflow",
        description="Fast token-by-token LLM decode on CPUs, and the pipeline-native architectures "
        "it is co-designed with.",
        epilog="Run `cflow COMMAND --help` for the flags of one command.",
    )
    parser.add_argument("--version", action="version", version=f"cflow {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"cflow.cli.{name}").register(sub)
    return parser


def error_line(e: CflowError) -> str:
    """The message, after the flag that caused it when the error names one."""
    flag = getattr(e, "flag", None)
    return f"{flag}: {e}" if flag else str(e)


def _import_extensions_first() -> None:
    for name in EXTENSIONS_IMPORTED_FIRST:
        try:
            importlib.import_module(name)
        except ImportError:  # absent here: the command that needs it says so
            pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    try:
        if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:
            _import_extensions_first()
            signal.signal(signal.SIGINT, signal.default_int_handler)
        return int(args.func(args) or 0)
    except CflowError as e:
        print(f"cflow {args.command}: error: {error_line(e)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (e.g. `cflow inspect ... | head`): exit quietly like other CLI tools.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
