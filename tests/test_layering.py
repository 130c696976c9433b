"""The package's layering: the runtime sits at the bottom. `cflow bench`, the CLI, the server and
training build on cflow.runtime, never the other way round, so running a model pulls in none of
them, nor torch: a model runs on numpy and the C core alone.

Held two ways: every import statement of every module under cflow.runtime, lazy ones inside
functions included, read from its source (a new upward import fails here even on a path no test
runs); and a fresh interpreter that imports every runtime module, loads a model and generates,
after which none of those packages is in sys.modules (what the runtime imports through cflow.weights,
cflow.fileformat and the rest is counted too)."""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import cflow.runtime
from cflow.bench.claims.models import small_config, write_random_model

# the layers built on the runtime, and torch
NEVER = ("cflow.bench", "cflow.cli", "cflow.serve", "cflow.train", "torch")


def _runtime_modules() -> list[tuple[str, Path]]:
    found = [("cflow.runtime", Path(cflow.runtime.__file__))]
    for m in pkgutil.walk_packages(cflow.runtime.__path__, "cflow.runtime."):
        spec = m.module_finder.find_spec(m.name)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            found.append((m.name, Path(spec.origin)))
    return found


RUNTIME = _runtime_modules()


def _imported(module: str, path: Path) -> list[str]:
    """Every module name an import statement of `path` names, relative imports resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            # `from cflow import bench` imports cflow.bench: count the names as modules too
            names += [base] + [f"{base}.{a.name}" for a in node.names]
    return names


def _is_under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_scan_sees_every_runtime_module_and_every_kind_of_import(tmp_path):
    on_disk = set(Path(cflow.runtime.__file__).parent.rglob("*.py"))
    assert {p for _, p in RUNTIME} == on_disk and len(on_disk) > 10
    for text in ("from cflow.bench.profile import profile_engine\n", "import cflow.bench.suite as s\n",
                 "def f():\n    from cflow import bench\n", "from ..bench import suite\n"):
        (tmp_path / "x.py").write_text(text)
        assert any(_is_under(n, ("cflow.bench",)) for n in _imported("cflow.runtime.x", tmp_path / "x.py")), text


@pytest.mark.parametrize("module,path", RUNTIME, ids=[m for m, _ in RUNTIME])
def test_no_runtime_module_imports_a_layer_above_it(module, path):
    bad = sorted({n for n in _imported(module, path) if _is_under(n, NEVER)})
    assert not bad, f"{path} imports {bad}: the runtime must not depend on {', '.join(NEVER)}"


_RUN = """
import importlib, json, pkgutil, sys
import cflow.runtime
for m in pkgutil.walk_packages(cflow.runtime.__path__, "cflow.runtime."):
    importlib.import_module(m.name)
from cflow.runtime import Engine
with Engine.load(sys.argv[1], threads=1) as eng:
    text = eng.complete([1, 2, 3], 4, temperature=0).text
    for _ in eng.generate([4, 5], max_tokens=2, seed=1):
        pass
print(json.dumps(sorted(sys.modules)))
"""


def test_running_a_model_loads_nothing_above_the_runtime(tmp_path):
    path = write_random_model(tmp_path / "m.cflow", small_config("arch2_4_combined"), "q4_0")
    out = subprocess.run([sys.executable, "-c", _RUN, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.splitlines()[-1])
    assert "cflow.runtime.engine" in loaded
    bad = [m for m in loaded if _is_under(m, NEVER)]
    assert not bad, f"loading and running a model imported {bad}"
