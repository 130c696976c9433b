"""Ctrl-C at any instant of a command exits 130 with at most one line on stderr, never a traceback.

The `cflow` command installs its handler as the first thing its package does (cflow.cli), before
the ~0.3 s of imports and parser building, and hands Ctrl-C back to the command when it starts
(each prints one `interrupted` line, or its own one-line summary). A signal that lands before
Python has installed any handler kills the process by SIGINT (what a shell reports as 130); only
the interpreter's own start-up (its `site` import, before any cflow code runs: ~5 ms idle, up to
~30 ms measured on a loaded 2-core machine, past 100 ms with two training jobs beside the suite) is
out of reach. So the offsets tried here are 0 and then from 100 ms, a signal that still lands in
`site` (CPython's "Fatal Python error: init_import_site") is passed over, and a structural test
checks that nothing is imported before the handler.

`cflow chat` at its prompt exits 130 too; a Ctrl-C during a reply only ends that reply (a REPL's
convention, as llama.cpp's interactive mode), which test_cli covers.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time

import pytest

from cflow.runtime import DEFAULT_MODEL

OFFSETS = (0.0, 0.1, 0.15, 0.2, 0.3, 0.45, 0.6, 1.2)


def command(name: str) -> list[str]:
    exe = shutil.which("cflow")
    base = [exe] if exe else [sys.executable, "-m", "cflow"]
    if name == "chat":  # waits for input on a stdin that stays open
        return base + ["chat", "-m", str(DEFAULT_MODEL)]
    if name == "bench":  # runs for minutes on any machine, so every offset lands while it works
        return base + ["bench", "-m", str(DEFAULT_MODEL), "-t", "1", "-p", "64", "-n", "128", "-r", "5000", "-q", "--no-probe"]
    return base + ["analyze", "--preset", "arch2_4_combined", "--help"]  # parser only: over within ~0.3 s


def as_from_a_terminal() -> None:
    """In the child before exec: SIGINT at its default, as a shell at a terminal starts a command. A
    shell without job control starts background commands with SIGINT ignored, and an ignored
    SIGINT survives exec, so pytest run with `&` would hand that to every child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt(argv: list[str], after: float) -> tuple[int, str]:
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         preexec_fn=as_from_a_terminal)
    time.sleep(after)
    p.send_signal(signal.SIGINT)
    try:
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    return p.returncode, err


def startup_lines(argv: list[str]) -> list[str]:
    """What the command writes to stderr before it waits or works, uninterrupted (chat: its note
    that the model has no template; stdin closed at once ends it). The signal may land after any
    of these lines; only what comes after them is the interrupt's."""
    if "chat" not in argv:
        return []
    r = subprocess.run(argv, input="", capture_output=True, text=True, timeout=60, preexec_fn=as_from_a_terminal)
    return [line for line in r.stderr.splitlines() if line.strip()]


@pytest.mark.parametrize("name", ["chat", "bench", "help"])
def test_sigint_at_any_offset_exits_130_with_at_most_one_line(name):
    argv = command(name)
    startup = startup_lines(argv)
    for after in OFFSETS:
        rc, err = interrupt(argv, after)
        lines = [line for line in err.splitlines() if line.strip()]
        if err.startswith("Fatal Python error: init_import_site"):
            continue  # the interpreter was still importing `site` (a loaded machine): before any cflow code
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, (after, err)
        if name == "help" and rc == 0:
            continue  # it finished before the signal
        assert rc in (130, -signal.SIGINT), (after, rc, err)
        n = 0  # the startup lines already written when the signal came
        while n < len(startup) and n < len(lines) and lines[n] == startup[n]:
            n += 1
        assert len(lines) - n <= 1, (after, err)


def test_the_handler_comes_before_any_other_import():
    """`import cflow` imports nothing of cflow's, and cflow.cli installs its handler before its imports."""
    code = ("import signal, sys; before = set(sys.modules); import cflow; "
            "assert not [m for m in set(sys.modules) - before if m.startswith('cflow.')], sys.modules; "
            "import cflow.cli; assert signal.getsignal(signal.SIGINT) is cflow.cli._interrupted_while_starting")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       preexec_fn=as_from_a_terminal)
    assert r.returncode == 0, r.stderr
    import cflow.cli

    src = open(cflow.cli.__file__).read()
    assert src.index("signal.signal(signal.SIGINT, _interrupted_while_starting)") < src.index("\nimport argparse")


def test_no_extension_module_is_first_imported_after_ctrl_c_is_handed_back():
    """An extension module's initialisation can drop a KeyboardInterrupt raised in it (a Ctrl-C was
    lost while `cflow chat` imported cflow._native), so main() imports those a command uses before
    it hands Ctrl-C back to Python. chat, run to its end on an empty stdin, imports none after."""
    code = f"""
import signal, sys
import cflow.cli as cli
switch = signal.signal
seen = {{}}
def spy(sig, handler):
    if handler is signal.default_int_handler:
        seen["before"] = set(sys.modules)
    return switch(sig, handler)
cli.signal.signal = spy
rc = cli.main(["chat", "-m", {str(DEFAULT_MODEL)!r}])
late = sorted(m for m in set(sys.modules) - seen["before"]
              if str(getattr(sys.modules[m], "__file__", "")).endswith((".so", ".pyd")))
print(rc, late)
"""
    r = subprocess.run([sys.executable, "-c", code], input="", capture_output=True, text=True, timeout=60,
                       preexec_fn=as_from_a_terminal)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "[]"], (r.stdout, r.stderr)
