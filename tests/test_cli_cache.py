"""`cflow cache`: where the GGUF conversion cache is, what it holds against its limit, and
clearing all or part of it. The entries are made through cflow.runtime.files, the way the
engine records a conversion, so no GGUF needs converting here."""

from __future__ import annotations

import json

import pytest

from cflow.cli import main
from cflow.runtime import files

from test_cli import cflow, one_error_line


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """Two cached conversions: SmolLM2 (3 MB, used last) and TinyLlama (1.5 MB)."""
    monkeypatch.setenv("CFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CFLOW_CACHE_MAX", raising=False)
    d = files.gguf_dir()
    d.mkdir(parents=True)
    made = {}
    for name, nbytes in [("TinyLlama-1.1B.Q4_0", 1_500_000), ("SmolLM2-135M.Q4_1", 3_000_000)]:
        p = d / f"{name}-0123456789abcdef0123.cflow"
        p.write_bytes(b"\0" * nbytes)
        files.touch(p, tmp_path / "models" / f"{name}.gguf")
        made[name] = p
    return made


def test_list_shows_place_entries_total_and_limit(cache, capsys):
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert str(files.gguf_dir()) in out
    lines = out.splitlines()
    smol = next(ln for ln in lines if cache["SmolLM2-135M.Q4_1"].name in ln)
    assert "3.0 MB" in smol and "models/SmolLM2-135M.Q4_1.gguf" in smol
    tiny = next(ln for ln in lines if cache["TinyLlama-1.1B.Q4_0"].name in ln)
    assert "1.5 MB" in tiny
    assert lines.index(smol) < lines.index(tiny)  # most recently used first
    assert "2 conversion(s), 4.5 MB of the 20.0 GB limit" in out and "CFLOW_CACHE_MAX" in out
    assert main(["cache", "list"]) == 0 and capsys.readouterr().out == out


def test_list_json_and_the_limit_from_the_environment(cache, monkeypatch, capsys):
    monkeypatch.setenv("CFLOW_CACHE_MAX", "2G")
    assert main(["cache", "list", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["dir"] == str(files.gguf_dir()) and d["limit_bytes"] == 2_000_000_000
    assert d["total_bytes"] == 4_500_000
    assert [e["path"] for e in d["entries"]] == [str(cache["SmolLM2-135M.Q4_1"]), str(cache["TinyLlama-1.1B.Q4_0"])]
    assert d["entries"][0]["bytes"] == 3_000_000 and d["entries"][0]["source"].endswith("SmolLM2-135M.Q4_1.gguf")
    assert d["entries"][0]["last_used"].startswith("20")  # ISO date


def test_clear_matching_then_all(cache, capsys):
    assert main(["cache", "clear", "TinyLlama"]) == 0
    out = capsys.readouterr().out
    assert cache["TinyLlama-1.1B.Q4_0"].name in out and "freed 1.5 MB in 1 file(s)" in out
    assert not cache["TinyLlama-1.1B.Q4_0"].exists() and cache["SmolLM2-135M.Q4_1"].exists()
    assert main(["cache", "clear", "nothing-like-this"]) == 0
    assert "no conversion matches 'nothing-like-this'" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0
    assert "freed 3.0 MB in 1 file(s)" in capsys.readouterr().out
    assert files.entries() == []
    assert main(["cache"]) == 0
    assert "no conversions, 0 B of the 20.0 GB limit" in capsys.readouterr().out


def test_bad_limit_is_one_line(cache, monkeypatch):
    monkeypatch.setenv("CFLOW_CACHE_MAX", "lots")
    r = cflow("cache")
    assert r.returncode == 2 and r.stdout == ""
    one_error_line(r.stderr, "cflow cache: error:", "'lots'", "2G")


def test_unknown_action_is_argparse_usage(cache, capsys):
    with pytest.raises(SystemExit) as e:
        main(["cache", "purge"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "invalid choice: 'purge'" in err and "'clear'" in err
