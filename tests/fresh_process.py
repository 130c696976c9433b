"""Run a script in a fresh interpreter under each value of a switch the native library reads once
per process (CFLOW_AVX512_Q6K, CFLOW_AVX512_SMALL_BATCH, ...), for tests of both sides of it."""

from __future__ import annotations

import os
import subprocess
import sys


def check_each_forced(script: str, var: str, values: tuple[str, ...], timeout: float = 600) -> None:
    """For each value: run `script` with `var` set to it; it must exit 0 and print exactly that
    value (the script prints the choice the library reports: the control that the switch is read)."""
    for forced in values:
        r = subprocess.run([sys.executable, "-c", script], env={**os.environ, var: forced},
                           capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, (var, forced, r.stderr[-2000:])
        assert r.stdout.strip() == forced, (var, forced, r.stdout[-500:])
