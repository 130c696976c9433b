"""cflow.bench.disk: the cold disk-read probe on small files. No speed is asserted (a shared machine),
only that it measures, reads what it says, falls back where O_DIRECT is refused (at open or at the
first read) and names its errors."""

from __future__ import annotations

import errno
import fcntl
import json
import os

import numpy as np
import pytest

from cflow.bench import disk
from cflow.errors import CflowError

MiB = 1 << 20


@pytest.fixture()
def small_file(tmp_path):
    p = tmp_path / "data.bin"
    data = np.random.default_rng(0).integers(0, 256, 8 * MiB + 12_288, dtype=np.uint8)  # not a chunk multiple
    with open(p, "wb") as f:
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())
    return p


def test_sequential_reads_the_whole_file(small_file):
    r = disk.probe(small_file, chunk="1M")
    size = small_file.stat().st_size
    assert r.gbs > 0 and r.seconds > 0
    assert r.bytes == size == r.file_bytes
    assert r.reads == -(-size // MiB) and r.pattern == "sequential" and not r.temp_file
    assert r.gbs == pytest.approx(r.bytes / r.seconds / 1e9)
    json.dumps(r.to_dict())


def test_random_reads_expert_sized_spans(small_file):
    r = disk.probe(small_file, pattern="random", chunk=2 * MiB, threads=2)
    assert r.gbs > 0 and r.reads == 4 and r.bytes == 8 * MiB and r.threads == 2


def test_random_spans_are_aligned_distinct_and_inside():
    rng = np.random.default_rng(5)
    size = 100 * MiB + 8192
    spans = disk._spans("random", size, 4 * MiB, 1 << 30, rng)
    assert len(spans) == 25
    offs = sorted(o for o, _ in spans)
    assert all(o % 4096 == 0 and o + n <= size for o, n in spans)
    assert all(b - a >= 4 * MiB for a, b in zip(offs, offs[1:]))       # no span read twice
    assert [o for o, _ in spans] != offs                                 # in a random order
    assert len(disk._spans("random", size, 4 * MiB, 40 * MiB, rng)) == 10  # max_bytes caps it


def test_max_bytes_caps_a_sequential_pass(small_file):
    r = disk.probe(small_file, chunk="1M", max_bytes="3M")
    assert r.bytes == 3 * MiB and r.reads == 3


def test_temp_file_is_made_and_deleted(tmp_path):
    r = disk.probe(size="4M", dir=tmp_path, chunk="1M")
    assert r.temp_file and r.bytes == 4 * MiB and r.gbs > 0
    assert list(tmp_path.iterdir()) == []


def _refuse_direct_open(monkeypatch):
    real_open = os.open

    def fake_open(path, flags, *a, **k):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(disk.os, "open", fake_open)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_falls_back_when_open_refuses_o_direct(small_file, monkeypatch):
    _refuse_direct_open(monkeypatch)
    r = disk.probe(small_file, chunk="1M")
    assert not r.direct and r.gbs > 0 and r.bytes == small_file.stat().st_size
    assert any("O_DIRECT refused" in n for n in r.notes)
    assert r.resident is None or 0.0 <= r.resident <= 1.0


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_falls_back_when_reads_refuse_o_direct(small_file, monkeypatch):
    real_preadv = os.preadv

    def fake_preadv(fd, bufs, off):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, bufs, off)

    monkeypatch.setattr(disk.os, "preadv", fake_preadv)
    r = disk.probe(small_file, pattern="random", chunk="2M")
    assert not r.direct and r.gbs > 0 and r.bytes == 8 * MiB
    assert any("refused" in n for n in r.notes)


def test_page_cache_residency_is_measured(small_file):
    if disk.filesystem_type(small_file) in disk.MEMORY_FILESYSTEMS:
        pytest.skip("the temp dir is memory-backed: nothing to evict")
    small_file.read_bytes()
    before = disk.resident_fraction(small_file)
    if before is None:
        pytest.skip("mincore is not available")
    assert before > 0.9
    disk.evict(small_file)
    assert disk.resident_fraction(small_file) < 0.1
    r = disk.probe(small_file, chunk="1M", direct=False)
    assert not r.direct and r.resident is not None and r.resident < 0.1 and r.cold


@pytest.mark.parametrize("make,err", [
    (lambda d: d / "missing.bin", "does not exist"),
    (lambda d: d, "is a directory"),
    (lambda d: (d / "tiny.bin").write_bytes(b"x" * 100) and d / "tiny.bin", "at least 4096"),
])
def test_unreadable_paths_have_named_errors(tmp_path, make, err):
    with pytest.raises(disk.UnreadableFileError, match=err) as e:
        disk.probe(make(tmp_path))
    assert isinstance(e.value, CflowError) and isinstance(e.value, disk.DiskProbeError)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_permission_denied_is_named(small_file):
    small_file.chmod(0)
    try:
        with pytest.raises(disk.UnreadableFileError, match="cannot open"):
            disk.probe(small_file)
    finally:
        small_file.chmod(0o644)


@pytest.mark.parametrize("kw,err", [
    (dict(pattern="zigzag"), "pattern"),
    (dict(chunk=5000), "multiple of 4096"),
    (dict(pattern="random", chunk="64M"), "at least that large"),
    (dict(threads=0), "threads"),
    (dict(chunk="fast"), "not a number"),
])
def test_bad_arguments_are_named(small_file, kw, err):
    with pytest.raises(disk.DiskProbeError, match=err):
        disk.probe(small_file, **kw)


def test_parse_size():
    assert disk.parse_size("1G") == 1 << 30 and disk.parse_size("16MiB") == 16 * MiB
    assert disk.parse_size("4096") == 4096 and disk.parse_size(123) == 123


def test_measure_and_cli(small_file, capsys):
    rep = disk.measure(small_file, chunk="1M", random_chunks=["1M", "4M", "64M"])  # 64M > file: skipped
    assert rep.sequential.gbs > 0 and [r.chunk for r in rep.random] == [MiB, 4 * MiB]
    assert "sequential" in rep.to_text() and "random" in rep.to_text()
    json.dumps(rep.to_dict())
    assert disk.main([str(small_file), "--chunk", "1M", "--random-chunk", "2M", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sequential"]["gbs"] > 0 and out["random"][0]["chunk"] == 2 * MiB
    assert disk.main([str(small_file.parent / "nope.bin")]) == 2
    assert "does not exist" in capsys.readouterr().err
