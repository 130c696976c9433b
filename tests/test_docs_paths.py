"""The committed docs and results name files, never where one machine kept them: no absolute path
under /work, /root, /home or /tmp (a command or report copied from a measuring machine shows the
file's name instead, as cflow's own report writers do)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MACHINE_PATH = re.compile(r"(?<![\w.])(?:/work|/root|/home/[^/\s]+|/tmp)/[^\s\"`'),|]+")


def doc_files() -> list[Path]:
    files = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").rglob("*")
                                          if p.suffix in (".md", ".json", ".txt", ".csv"))
    return [p for p in files if p.is_file()]


def test_the_pattern_finds_machine_paths_and_passes_others():
    assert MACHINE_PATH.findall("cflow bench -m /work/venv/x/SmolLM2.gguf -t 2") == ["/work/venv/x/SmolLM2.gguf"]
    assert MACHINE_PATH.findall('"model": "/tmp/moe/small.gguf"') == ["/tmp/moe/small.gguf"]
    assert not MACHINE_PATH.findall("docs/results/moe.md, src/cflow/tmp/x, https://host/tmp/x, ~/.cache/cflow")


@pytest.mark.skipif(not (ROOT / "docs").is_dir(), reason="run from a checkout: docs/ is not installed")
def test_no_doc_names_a_machine_local_path():
    found = [f"{p.relative_to(ROOT)}: {m}" for p in doc_files() for m in MACHINE_PATH.findall(p.read_text())]
    assert not found, found
