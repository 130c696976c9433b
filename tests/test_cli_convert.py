"""`cflow convert` / `cflow inspect` messages: sizes in one convention (decimal, through
cflow.runtime.files.format_size), the note when --quant was not applied to GGUF blocks kept bit for
bit, and an output named .gguf refused. The GGUFs are the tiny ones test_convert_gguf.py writes."""

from __future__ import annotations

import json
import re

import pytest

from cflow.cli import main
from cflow.runtime.files import format_size

gguf = pytest.importorskip("gguf")
from test_convert_gguf import T, write_gguf  # noqa: E402

from test_cli import one_error_line  # noqa: E402

ALL_Q8 = {name: T.Q8_0 for name in ("token_embd.weight", "output.weight")}  # the rest: MIXED's types


@pytest.fixture()
def q_gguf(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, types=ALL_Q8)
    return path


def test_sizes_are_decimal_everywhere(tmp_path, q_gguf, capsys):
    out = tmp_path / "m.cflow"
    assert main(["convert", str(q_gguf), str(out), "-q"]) == 0
    text = capsys.readouterr().out
    assert "MiB" not in text and "KiB" not in text
    assert f"wrote {out} ({format_size(out.stat().st_size)})" in text
    for line in text.split("bytes by category:")[1].splitlines()[1:]:
        if not line.startswith("  "):
            break
        assert re.search(r"\d\.\d (kB|MB|GB)|\d B", line), line
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert f", {format_size(out.stat().st_size)}, header " in text and "MiB" not in text


def test_quant_given_but_kept_gguf_blocks_are_named(tmp_path, q_gguf, capsys):
    out = tmp_path / "m.cflow"
    assert main(["convert", str(q_gguf), str(out), "--quant", "q4_0", "-q"]) == 0
    text = capsys.readouterr().out
    note = next(ln for ln in text.splitlines() if ln.startswith("note: --quant q4_0 was not applied"))
    assert "q8_0: tok_emb" in note and "bit for bit" in note and "never requantizes" in note

    from cflow.fileformat import open_model

    with open_model(out) as cf:
        kept = sorted(e.name for e in cf.tensors.values() if e.layout == "tiled" and e.dtype != "q4_0")
    assert f"not applied to {len(kept)} tensor(s)" in note and kept
    assert main(["convert", str(q_gguf), str(tmp_path / "j.cflow"), "--quant", "q4_0", "-q", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kept_gguf_types"]["quant"] == "q4_0"
    assert sorted(n for names in d["kept_gguf_types"]["tensors"].values() for n in names) == kept
    # no --quant asked for: nothing was refused, nothing to say
    assert main(["convert", str(q_gguf), str(tmp_path / "d.cflow"), "-q"]) == 0
    assert "was not applied" not in capsys.readouterr().out


def test_output_named_gguf_is_refused(tmp_path, q_gguf, capsys):
    out = tmp_path / "converted.gguf"
    assert main(["convert", str(q_gguf), str(out), "-q"]) == 2
    one_error_line(capsys.readouterr().err, "cflow convert: error:", "named .gguf", "not GGUF",
                   str(tmp_path / "converted.cflow"))
    assert not out.exists()
