"""The engine's parity tests on every kernel table this CPU can run, not only the one it picks.

tests/test_engine.py runs the engine on the default table (the best one, or CFLOW_ISA's), so a
bug in a table the dispatcher does not pick on this machine (say the AVX2 mat-vec on a VNNI CPU)
passes it, then ships to every CPU that does pick that table. The kernel tests call each table
directly, but only kernel by kernel; the engine chains them (mat-vec, mat-mat prefill, gate/up,
attention, routing). Here each other table reruns a few of the engine tests in a subprocess with
CFLOW_ISA set, because dispatch.c reads it once per process (tests/isa_runner.py).

The subset is the most sensitive and cheapest (~4 s per table): logits against the float
reference teacher-forced step by step (decode: mat-vec), and prefill against steps (prefill:
mat-mat, which must match the mat-vec), for a dense Q4_1 model (llama) and MoE models in Q4_0
(arch1) and Q8_0 (arch2), on three different tile shapes.
"""

from __future__ import annotations

import pytest

from isa_runner import other_isas, run_under

pytest.importorskip("torch")  # tests/test_engine.py's reference model

ENGINE_TESTS = [f"tests/test_engine.py::{test}[{variant}]"
                for test in ("test_logits_close_to_float_reference", "test_prefill_equals_steps")
                for variant in ("llama", "arch1", "arch2")] + [
    f"tests/test_engine.py::test_wide_tiles_prefill_equals_steps[{dtype}]" for dtype in ("q4_0", "q4_1", "q8_0")]


@pytest.mark.parametrize("isa", other_isas())
def test_engine_parity_on_every_other_table(isa):
    run_under(isa, ENGINE_TESTS, len(ENGINE_TESTS))
