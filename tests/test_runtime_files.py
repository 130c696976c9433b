"""What the runtime keeps on disk (cflow.runtime.files) and what it does with damaged models: the
GGUF conversion cache keyed by content and bounded in size, checksums verified on a file's first
use, and non-finite logits ending generation with a named error instead of garbage."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")

from test_convert_gguf import write_gguf  # noqa: E402
from test_engine import small_config, write_random_model  # noqa: E402

from cflow.fileformat import open_model, write_model  # noqa: E402
from cflow.runtime import CorruptModelError, Engine, files  # noqa: E402


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("CFLOW_CACHE", str(root))
    monkeypatch.delenv("CFLOW_CACHE_MAX", raising=False)
    return root


# ---- sizes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,n", [("512M", 512_000_000), ("2G", 2_000_000_000), ("1.5GiB", 1.5 * 2**30),
                                    ("300000", 300_000), ("4 kB", 4000), ("1T", 10**12)])
def test_parse_size(text, n):
    assert files.parse_size(text) == int(n)


@pytest.mark.parametrize("bad", ["", "G", "-1G", "2X", "1..5G"])
def test_parse_size_refuses_nonsense(bad):
    with pytest.raises(files.CacheError, match="size"):
        files.parse_size(bad)


def test_format_size_is_decimal():
    assert files.format_size(98_400_000) == "98.4 MB"
    assert files.format_size(512) == "512 B"
    assert files.format_size(2_500_000_000) == "2.5 GB"


# ---- the conversion cache ----------------------------------------------------------------------
def _load(path, logs):
    eng = Engine.load(path, threads=1, n_ctx=32, log=logs.append)
    eng.close()
    return eng


def test_copied_or_touched_gguf_reuses_its_conversion(tmp_path, cache):
    src = tmp_path / "m.gguf"
    write_gguf(src)
    logs: list[str] = []
    first = _load(src, logs)
    assert "converting" in logs[-1]
    os.utime(src, (1, 1))  # touched: same content
    copy = tmp_path / "elsewhere" / "copy.gguf"
    copy.parent.mkdir()
    shutil.copy(src, copy)
    for again in (src, copy):
        eng = _load(again, logs)
        assert "using" in logs[-1] and eng.path == first.path, logs
    assert len(files.entries()) == 1


def test_changed_gguf_is_converted_again(tmp_path):
    src = tmp_path / "m.gguf"
    write_gguf(src)
    logs: list[str] = []
    a = _load(src, logs)
    write_gguf(src, tied=True)  # other content under the same name
    b = _load(src, logs)
    assert "converting" in logs[-1] and a.path != b.path
    assert len(files.entries()) == 2


def test_cache_is_bounded_least_recently_used_first(tmp_path, monkeypatch):
    paths = []
    for i, tied in enumerate((False, True)):
        p = tmp_path / f"m{i}.gguf"
        write_gguf(p, tied=tied)
        paths.append(p)
    logs: list[str] = []
    one = _load(paths[0], logs)
    size = os.path.getsize(one.path)
    # room for one conversion only: adding the second evicts the first
    monkeypatch.setenv("CFLOW_CACHE_MAX", str(size + os.path.getsize(paths[1]) - 1))
    two = _load(paths[1], logs)
    assert any("removed" in line for line in logs), logs
    assert [e.path.name for e in files.entries()] == [os.path.basename(two.path)]


def test_clear_removes_matching_entries(tmp_path):
    for i, tied in enumerate((False, True)):
        p = tmp_path / f"model{i}.gguf"
        write_gguf(p, tied=tied)
        _load(p, [])
    gone = files.clear("model0")
    assert len(gone) == 1 and "model0" in gone[0].path.name
    assert len(files.entries()) == 1
    assert len(files.clear()) == 1 and files.entries() == []


# ---- damaged files -----------------------------------------------------------------------------
@pytest.fixture
def model_file(tmp_path):
    cfg = small_config("llama")
    path = tmp_path / "m.cflow"
    write_random_model(path, cfg, "q4_0", (64, 64))
    return path


def _damage(path, name="layers.1.attn.wqkv"):
    cf = open_model(path)
    e = cf.tensors[name]
    cf.close()
    with open(path, "r+b") as f:  # 100 random bytes in the middle of a tensor, as the issue found
        f.seek(e.offset + e.nbytes // 2)
        f.write(np.random.default_rng(0).integers(0, 256, 100, dtype=np.uint8).tobytes())


def test_damaged_file_is_refused_on_first_use(model_file):
    _damage(model_file)
    with pytest.raises(CorruptModelError, match=r"damaged.*inspect --verify"):
        Engine.load(model_file, threads=1)
    Engine.load(model_file, threads=1, verify=False).close()  # the user may insist


def test_verdict_is_cached_and_redone_when_the_file_changes(model_file, monkeypatch):
    Engine.load(model_file, threads=1).close()
    assert files.is_verified(model_file)
    calls = []
    real = Engine._verify
    monkeypatch.setattr(Engine, "_verify", staticmethod(lambda cf: (calls.append(cf.path), real(cf))))
    Engine.load(model_file, threads=1).close()
    assert calls == []  # verified once, not again
    _damage(model_file)  # written in place: a new mtime
    assert not files.is_verified(model_file)
    with pytest.raises(CorruptModelError):
        Engine.load(model_file, threads=1)
    assert calls == [str(model_file)]


def test_damaged_cached_conversion_is_converted_again(tmp_path):
    src = tmp_path / "m.gguf"
    write_gguf(src)
    logs: list[str] = []
    conv = _load(src, logs).path
    _damage(conv, "layers.0.attn.wo")
    os.utime(conv, (1, 1))  # and unknown to the verdict cache
    _load(src, logs)
    assert "unusable" in logs[-2] and "converting" in logs[-1], logs


def _nan_model(path):
    """A file with valid checksums whose final norm is NaN, so every logit is (a broken export:
    the converters refuse NaN, so the file is assembled here tensor by tensor)."""
    from cflow import quant
    from cflow.fileformat import TensorData

    cfg = small_config("llama")
    write_random_model(path, cfg, "q4_0", (64, 64))
    cf = open_model(path)
    tensors = [TensorData(e.name, e.dtype, tuple(e.shape), e.layout, np.array(cf.array(e.name)), dict(e.meta))
               for e in cf.tensors.values()]
    tensors = [t if t.name != "norm" else
               TensorData("norm", "f32", t.shape, "rows", quant.to_plain(np.full(t.shape, np.nan, np.float32), "f32"))
               for t in tensors]
    config, tok = cf.config.to_dict(), cf.tokenizer
    cf.close()
    write_model(path, config=config, tokenizer=tok, tensors=tensors, tile=(64, 64))


@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_non_finite_logits_end_generation_with_a_named_error(tmp_path, temp):
    path = tmp_path / "nan.cflow"
    _nan_model(path)
    eng = Engine.load(path, threads=1)
    with pytest.raises(CorruptModelError, match="non-finite logits.*inspect --verify"):
        eng.complete([1, 2, 3], max_tokens=4, temperature=temp)
