"""Every command that writes a file fails on a place it cannot write as one line,
`cflow CMD: error: cannot write PATH: <reason>`, before its long work, never with a traceback.

Tests run as root, which ignores permission bits, so the unwritable places are ones no user can
write to: a folder under /proc that does not exist (missing folders are never created unless asked)
and a path whose parent is a regular file. What a writer may replace (regular files only; symlinks
written through) is tested in test_write_targets.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cflow.cli import main
from cflow.fsutil import WriteError, check_writable
from cflow.runtime import DEFAULT_MODEL

from test_cli import cflow, needs_builtin, one_error_line

PROC = "/proc/cflow-test/out.file"
MISSING = "the folder /proc/cflow-test does not exist"


def not_a_dir(path: str) -> str:
    return f"{Path(path).parent} is not a directory"


pytestmark = pytest.mark.usefixtures("private_cache")  # CFLOW_CACHE in each test's tmp_path (conftest)


@pytest.fixture()
def under_a_file(tmp_path) -> str:
    (tmp_path / "plain").write_text("a file, not a folder\n")
    return str(tmp_path / "plain" / "out.file")


def test_analyze_dot_unwritable(under_a_file):
    for path, reason in [(PROC, MISSING), (under_a_file, not_a_dir(under_a_file))]:
        r = cflow("analyze", "--preset", "arch1", "--dot", path)
        assert r.returncode == 2 and r.stdout == "", r.stderr  # checked before the report is printed
        one_error_line(r.stderr, f"cflow analyze: error: cannot write {path}: {reason}")


def test_analyze_dot_refuses_missing_folders(tmp_path, capsys):
    dot = tmp_path / "new" / "dir" / "g.dot"
    assert main(["analyze", "--preset", "arch1", "--dot", str(dot)]) == 2
    one_error_line(capsys.readouterr().err, f"cannot write {dot}: the folder {dot.parent} does not exist")
    assert os.listdir(tmp_path) == []  # nothing created


@needs_builtin
def test_bench_out_unwritable_fails_before_measuring(under_a_file):
    for path, reason in [(PROC, MISSING), (under_a_file, not_a_dir(under_a_file))]:
        # without -q every step of a benchmark that ran would print a progress line on stderr
        r = cflow("bench", "-m", str(DEFAULT_MODEL), "-p", "8", "-n", "4", "-r", "1", "--out", path)
        assert r.returncode == 2 and r.stdout == ""
        one_error_line(r.stderr, f"cflow bench: error: cannot write {path}: {reason}")


@needs_builtin
def test_bench_out_writes_the_report(tmp_path):
    out = tmp_path / "b.json"
    r = cflow("bench", "-m", str(DEFAULT_MODEL), "-t", "1", "-p", "8", "-n", "4", "-r", "1", "--no-probe",
              "--no-footprint", "-q", "--json", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text()) == json.loads(r.stdout)


def test_convert_unwritable_output(tmp_path, under_a_file, capsys):
    src = tmp_path / "in.gguf"
    src.write_bytes(b"GGUF" + b"\0" * 64)  # never read: the output is refused first
    for path, reason in [(PROC, MISSING), (under_a_file, not_a_dir(under_a_file))]:
        assert main(["convert", str(src), path + ".cflow"]) == 2
        one_error_line(capsys.readouterr().err, f"cflow convert: error: cannot write {path}.cflow: {reason}")


def test_check_writable_leaves_nothing_behind(tmp_path):
    check_writable(tmp_path / "a.txt", file=True)
    check_writable(tmp_path / "not" / "yet" / "a.txt")  # a run directory, which its writer creates
    check_writable(tmp_path / "not" / "yet" / "a.txt", file=True, mkdir=True)
    assert os.listdir(tmp_path) == []
    with pytest.raises(WriteError, match="does not exist"):
        check_writable(tmp_path / "not" / "yet" / "a.txt", file=True)
    with pytest.raises(WriteError, match="is a directory"):
        check_writable(tmp_path, file=True)


def test_write_failure_after_the_check_is_still_one_line(tmp_path, monkeypatch, capsys):
    # the disk fills (or the folder vanishes) between the check and the write
    def full(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("cflow.fsutil.atomic_write_text", full)
    dot = tmp_path / "g.dot"
    assert main(["analyze", "--preset", "arch1", "--dot", str(dot)]) == 2
    one_error_line(capsys.readouterr().err, f"cflow analyze: error: cannot write {dot}: No space left on device")
    assert not Path(dot).exists()


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_unwritable_conversion_cache_is_one_error_line(tmp_path, monkeypatch, command):
    pytest.importorskip("gguf")
    from test_convert_gguf import write_gguf

    src = tmp_path / "m.gguf"
    write_gguf(src)
    monkeypatch.setenv("CFLOW_CACHE", "/proc/cflow-test")  # where the .gguf would be converted into
    args = ["-p", "hi", "-n", "2"] if command == "generate" else ["-p", "4", "-n", "2", "-r", "1", "-q"]
    r = cflow(command, "-m", str(src), *args)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    # the engine may first say it is converting; the failure itself is one line
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"cflow {command}: error: cannot write /proc/cflow-test") and "CFLOW_CACHE" in last
