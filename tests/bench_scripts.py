"""The benchmark scripts the tests run, loaded by path from the checkout's benchmarks/ (beside
tests/): not put on sys.path, where benchmarks/kernels.py would shadow the `kernels` package that
transformers imports when it finds one. Also the checks every make_<family>.py test makes of the file
it writes (same bytes again, llama.cpp runs it)."""

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


def assert_rewrites_same_bytes(main, args: list[str], out: Path, again: Path) -> None:
    """A make_<family>.py `main` writes `out` from `args` again, to `again`, byte for byte."""
    assert main([*args, "--out", str(again)]) == 0
    assert out.read_bytes() == again.read_bytes(), f"{out.name}: a second run wrote other bytes"


def assert_llama_cpp_runs(path: Path, n_vocab: int) -> None:
    """llama.cpp loads the file (its tensor layout and keys) and evaluates a token; nothing when the
    oracle (llama-cpp-python) is not installed."""
    try:
        import llama_cpp
    except Exception:
        return
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=32, verbose=False)
    try:
        llm.eval([5])
        assert llm.n_vocab() == n_vocab
    finally:
        llm.close()
