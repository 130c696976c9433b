"""The engine's parity tests on every kernel table this CPU can run, not only the one it picks.

tests/test_engine.py runs the engine on the default table (the best one, or CFLOW_ISA's), so a
bug in a table the dispatcher does not pick on this machine (say the AVX2 mat-vec on a VNNI CPU)
passes it, then ships to every CPU that does pick that table. The kernel tests call each table
directly, but only kernel by kernel; the engine chains them (mat-vec, mat-mat prefill, gate/up,
attention, routing). Here each other table reruns a few of the engine tests in a subprocess with
CFLOW_ISA set, because dispatch.c reads it once per process.

The subset is the most sensitive and cheapest (~4 s per table): logits against the float
reference teacher-forced step by step (decode: mat-vec), and prefill against steps (prefill:
mat-mat, which must match the mat-vec), for a dense Q4_1 model (llama) and MoE models in Q4_0
(arch1) and Q8_0 (arch2), on three different tile shapes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cflow import _native

pytest.importorskip("torch")  # tests/test_engine.py's reference model

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = _native.isa()  # the table this process, and so tests/test_engine.py, runs on
OTHERS = [isa for isa in _native.available_isas() if isa != DEFAULT]
ENGINE_TESTS = [f"tests/test_engine.py::{test}[{variant}]"
                for test in ("test_logits_close_to_float_reference", "test_prefill_equals_steps")
                for variant in ("llama", "arch1", "arch2")] + [
    f"tests/test_engine.py::test_wide_tiles_prefill_equals_steps[{dtype}]" for dtype in ("q4_0", "q4_1", "q8_0")]

# Runs in the subprocess: report the table this very process uses, then the tests, in-process.
_RUNNER = ("import sys, pytest\n"
           "from cflow import _native\n"
           "print('kernel table:', _native.isa(), flush=True)\n"
           "sys.exit(pytest.main(sys.argv[1:]))\n")


@pytest.mark.parametrize("isa", OTHERS or [pytest.param(None, marks=pytest.mark.skip(
    reason=f"{DEFAULT} is the only kernel table this CPU runs"))])
def test_engine_parity_on_every_other_table(isa):
    env = {**os.environ, "CFLOW_ISA": isa}
    r = subprocess.run([sys.executable, "-c", _RUNNER, "-q", "-p", "no:cacheprovider", *ENGINE_TESTS],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    tail = out[-4000:]
    # an unknown name would silently fall back to the best table: check what really ran
    assert f"kernel table: {isa}\n" in out, f"the subprocess did not run the {isa} table:\n{tail}"
    assert r.returncode == 0, f"engine tests fail on the {isa} kernel table:\n{tail}"
    # every listed test ran and passed (a renamed test or a skip must not pass silently)
    m = re.search(r"(\d+) passed", out)
    assert m and int(m.group(1)) == len(ENGINE_TESTS) and "skipped" not in out, tail
