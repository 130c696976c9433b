"""Shared test setup: on a CPU whose llama.cpp AMX path crashes (cflow.bench.llamacpp.amx_advertised:
SIGILL at the first Q4_0 mat-mul), every llama.cpp the tests load in this process runs with its extra
buffer types off, as cflow's own baseline runner does there."""

from __future__ import annotations

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
