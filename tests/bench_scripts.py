"""The benchmark scripts the tests run, loaded by path from the checkout's benchmarks/ (beside
tests/): not put on sys.path, where benchmarks/kernels.py would shadow the `kernels` package that
transformers imports when it finds one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """benchmarks/NAME.py as a fresh module."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
