"""Model files a user really gets wrong, each with its own one-line error found before any tensor is
read: a GGUF cut short (expected and present bytes), a file named .gguf that is not one (what it looks
like), a damaged .cflow (one piece of advice, once); and `--help` naming what the commands accept."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cflow.cli import main
from cflow.runtime import Engine
from cflow.runtime.errors import CorruptModelError, ModelFormatError

from test_cli import one_error_line

gguf = pytest.importorskip("gguf")


@pytest.fixture()
def small_gguf(tmp_path) -> Path:
    from test_convert_gguf import write_gguf

    path = tmp_path / "m.gguf"
    write_gguf(path)
    return path


pytestmark = pytest.mark.usefixtures("private_cache")  # CFLOW_CACHE in each test's tmp_path (conftest)


def test_a_truncated_gguf_says_it_is_cut_short(small_gguf, tmp_path, capsys):
    from cflow.convert.gguf import GGUFTruncatedError

    data = small_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * 0.6)])
    t0 = time.perf_counter()
    with pytest.raises(GGUFTruncatedError, match="it is cut short, an unfinished download") as e:
        Engine.load(cut)
    assert f"has {int(len(data) * 0.6):,}" in str(e.value) and "download it again" in str(e.value)
    assert time.perf_counter() - t0 < 10
    assert main(["convert", str(cut), str(tmp_path / "o.cflow")]) == 2
    one_error_line(capsys.readouterr().err, "cut short", f"{int(len(data) * 0.6):,}")
    assert not (tmp_path / "o.cflow").exists()


@pytest.mark.parametrize("head, says", [(b"\x8f\x11junk" * 100, "not the GGUF magic"),
                                        (b"<!DOCTYPE html><html>404</html>", "looks like text"),
                                        (b"version https://git-lfs.github.com/spec/v1\n", "git-lfs pointer"),
                                        (b"", "it is empty")])
def test_a_file_named_gguf_that_is_not_one(tmp_path, head, says):
    p = tmp_path / "model.gguf"
    p.write_bytes(head)
    with pytest.raises(ModelFormatError, match=f"is named .gguf but is not a GGUF file: .*{says}"):
        Engine.load(p)


def test_a_damaged_cflow_gives_its_advice_once(tmp_path):
    from cflow.runtime import DEFAULT_MODEL

    if not DEFAULT_MODEL.is_file():
        pytest.skip("built-in model not installed")
    from cflow.fileformat import open_model

    bad = tmp_path / "bad.cflow"
    data = bytearray(DEFAULT_MODEL.read_bytes())
    with open_model(DEFAULT_MODEL) as cf:
        t = max(cf.tensors.values(), key=lambda t: t.nbytes)
        data[t.offset + t.nbytes // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(CorruptModelError) as e:
        Engine.load(bad)
    msg = str(e.value)
    assert f"tensor {t.name!r} does not match its checksum" in msg
    assert msg.lower().count("download") == 1 and msg.count("convert") == 1, msg


def test_convert_help_names_every_architecture_it_converts(capsys):
    from cflow.convert.gguf import SUPPORTED_ARCHITECTURES

    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in text, arch
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    export = " ".join(capsys.readouterr().out.split())
    assert "GGUF" not in export.split("--quant", 1)[1].split("--tile")[0]  # export's --quant is about checkpoints
