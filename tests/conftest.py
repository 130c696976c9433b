"""Shared test setup, and the fixtures more than one test file uses.

- On a CPU whose llama.cpp AMX path crashes (cflow.bench.llamacpp.amx_advertised: SIGILL at the
  first Q4_0 mat-mul), every llama.cpp the tests load in this process runs with its extra buffer
  types off, as cflow's own baseline runner does there (autouse, the whole session).
- private_cache: CFLOW_CACHE in the test's tmp_path. Not autouse: a module that wants it for every
  test says `pytestmark = pytest.mark.usefixtures("private_cache")`.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _llama_cpp_without_amx():
    from cflow.bench.llamacpp import repacking, amx_advertised

    if not amx_advertised():
        yield
        return
    try:
        import llama_cpp
    except Exception:  # not installed (the oracle tests skip) or not loadable
        yield
        return
    with repacking(llama_cpp, False):
        yield


@pytest.fixture()
def private_cache(tmp_path, monkeypatch) -> Path:
    """CFLOW_CACHE in this test's tmp_path: the CLI keeps readline history there and converts GGUFs
    into it, and neither may touch ~/.cache."""
    root = tmp_path / "cache"
    monkeypatch.setenv("CFLOW_CACHE", str(root))
    return root

