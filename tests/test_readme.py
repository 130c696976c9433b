"""The README is what a newcomer runs: its Python example must run as written, and the test
command it gives must be the one CI runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _block_after(heading: str, lang: str) -> str:
    section = README.split(heading, 1)[1]
    m = re.search(rf"```{lang}\n(.*?)```", section, re.S)
    assert m, f"no ```{lang} block after {heading!r}"
    return m.group(1)


def test_python_api_example_runs(tmp_path):
    code = _block_after("## Python API", "python")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={**__import__("os").environ, "CFLOW_CACHE": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "tok/s prompt" in out.stdout and out.stdout.count("\n") >= 3


def test_ci_runs_the_readme_test_commands():
    commands = [line for line in _block_after("## Run the tests", "bash").splitlines() if line.strip()]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for line in commands:
        assert line in ci, f"README's {line!r} is not what .ci/run runs"


def test_the_package_reads_nothing_from_the_source_tree():
    """A newcomer's venv lives anywhere: no module of the package may load a file of the checkout
    (benchmarks/, src/) by path. What the claims need ships inside the package."""
    pkg = ROOT / "src" / "cflow"
    for py in pkg.rglob("*.py"):
        text = py.read_text()
        assert "spec_from_file_location" not in text, py
        assert '"benchmarks"' not in text and "'benchmarks'" not in text, py
    import cflow.bench.claims.c2_tiles as c2

    assert Path(c2.__file__).with_name("c2_tiles.c").is_file()
