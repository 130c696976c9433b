"""Rerunning tests under each other kernel table: the one subprocess runner the engine tests share
(tests/test_every_isa.py, and the family tests' test_every_other_kernel_table).

dispatch.c reads CFLOW_ISA once per process, so a table the dispatcher does not pick on this CPU
is tested in a subprocess with CFLOW_ISA set. The subprocess prints the table it really runs (an
unknown name would silently fall back to the best one), then runs the tests in-process; the
caller says how many must pass, so a renamed test or a skip does not pass silently.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ("import sys, pytest\n"
          "from cflow import _native\n"
          "print('kernel table:', _native.isa(), flush=True)\n"
          "sys.exit(pytest.main(sys.argv[1:]))\n")


def other_isas() -> list:
    """pytest parameters: every kernel table this CPU runs but does not pick (a skipped one if none)."""
    from cflow import _native

    default = _native.isa()
    others = [isa for isa in _native.available_isas() if isa != default]
    return others or [pytest.param(None, marks=pytest.mark.skip(reason=f"{default} is the only kernel table "
                                                                       f"this CPU runs"))]


def run_under(isa: str, tests: list[str], passed: int) -> None:
    """Run `tests` (pytest node ids) under kernel table `isa` in a subprocess; exactly `passed` of
    them (parametrised ids count each) must pass and none be skipped. Inside such a subprocess
    (CFLOW_ISA already set) the caller skips instead of recursing."""
    if os.environ.get("CFLOW_ISA"):
        pytest.skip("already running under CFLOW_ISA (the subprocess of this test)")
    env = {**os.environ, "CFLOW_ISA": isa}
    r = subprocess.run([sys.executable, "-c", RUNNER, "-q", "-p", "no:cacheprovider", *tests],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    tail = out[-4000:]
    assert f"kernel table: {isa}\n" in out, f"the subprocess did not run the {isa} table:\n{tail}"
    assert r.returncode == 0, f"the tests fail on the {isa} kernel table:\n{tail}"
    m = re.search(r"(\d+) passed", out)
    assert m and int(m.group(1)) == passed and "skipped" not in out, tail
