"""Where the weights live (cflow.runtime.pages): the file's mapping or a copy in 2 MiB pages.

The choice is a pure function of the options, the file's size and the memory available; the copy
holds the file's bytes and carries the advice asked for (VmFlags "hg" / "nh" in /proc/self/smaps,
what the kernel was told, whether or not it grants huge pages); every placement gives the same
logits; engines over one open file share one copy.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from cflow.runtime import Engine, EngineOptions  # noqa: E402
from cflow.runtime import experts as xp  # noqa: E402
from cflow.runtime import pages  # noqa: E402
from test_engine import small_config, write_random_model  # noqa: E402

MiB = 1 << 20
LINUX_ADVICE = sys.platform.startswith("linux") and pages._can_advise()  # and THP "always" or "madvise"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("pages") / "dense.cflow"
    write_random_model(path, small_config("llama", tied=False), "q8_0", (32, 64))
    return path


# ---- the choice ---------------------------------------------------------------------------------
@pytest.mark.skipif(not LINUX_ADVICE, reason="no MADV_HUGEPAGE here: the default keeps the mapping")
@pytest.mark.parametrize("kw, copy, huge, words", [
    (dict(mmap=True, hugepages=True, experts_on_disk=False, available=1000 * MiB), True, True, "2 MiB pages"),
    (dict(mmap=True, hugepages=True, experts_on_disk=False, available=199 * MiB), False, False, "more than 50%"),
    (dict(mmap=True, hugepages=True, experts_on_disk=False, available=200 * MiB), True, True, "2 MiB pages"),
    (dict(mmap=True, hugepages=True, experts_on_disk=False, available=None), False, False, "unknown"),
    (dict(mmap=True, hugepages=True, experts_on_disk=True, available=1000 * MiB), False, False, "experts on disk"),
    (dict(mmap=True, hugepages=False, experts_on_disk=False, available=1000 * MiB), False, False, "hugepages=False"),
    (dict(mmap=False, hugepages=True, experts_on_disk=False, available=None), True, True, "mmap=False"),
    (dict(mmap=False, hugepages=False, experts_on_disk=False, available=1000 * MiB), True, False, "mmap=False"),
    (dict(mmap=False, hugepages=True, experts_on_disk=True, available=1000 * MiB), True, False, "mmap=False"),
])
def test_placement(kw, copy, huge, words):
    """A 100 MiB file: copied into huge pages when it takes at most half the available memory (the
    boundary both ways), mapped when memory is unknown, experts go to disk or hugepages is off;
    mmap=False always copies, without huge pages when off or with experts on disk."""
    p = pages.placement(100 * MiB, **kw)
    assert (p.copy, p.huge_pages) == (copy, huge)
    assert words in p.reason


def test_thp_mode_reads_the_bracketed_choice(tmp_path):
    f = tmp_path / "enabled"
    for text, want in (("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                       ("always madvise [never]", "never")):
        f.write_text(text)
        assert pages.thp_mode(str(f)) == want
    assert pages.thp_mode(str(tmp_path / "absent")) is None


# ---- the copy -------------------------------------------------------------------------------------
def vm_flags(buf: np.ndarray) -> set[str]:
    """The VmFlags of the mapping holding buf's first byte."""
    maps = pages.smaps_fields(buf[:1])
    assert maps, "no mapping holds the buffer"
    return set(maps[0]["VmFlags"].split())


@pytest.mark.skipif(not LINUX_ADVICE, reason="needs Linux madvise")
def test_copy_holds_the_file_and_the_advice_asked_for(model):
    raw = np.fromfile(model, np.uint8)
    with Engine.load(model, threads=1, n_ctx=16, verify=False) as eng:
        for huge, flag, other in ((True, "hg", "nh"), (False, "nh", "hg")):
            buf = pages.copy_weights(eng.file, skip_experts=False, huge_pages=huge)
            assert np.array_equal(buf, raw) and not buf.flags.writeable
            flags = vm_flags(buf)
            assert flag in flags and other not in flags, flags


# ---- the engine ---------------------------------------------------------------------------------
def test_every_placement_gives_the_same_logits(model):
    """Mapped, copied in huge pages (the default here), copied without: the same bytes, so the same
    logits bit for bit; weights_memory says which placement each engine took."""
    got = {}
    for name, kw in {"map": dict(hugepages=False), "default": {}, "copy 4k": dict(mmap=False, hugepages=False)}.items():
        with Engine.load(model, threads=1, n_ctx=16, verify=False, **kw) as eng:
            got[name] = (eng.prefill([3, 4, 5, 6]), eng.weights_memory())
    assert got["map"][1]["placement"] == "map" and got["map"][1]["huge_page_bytes"] is None
    assert got["copy 4k"][1]["placement"] == "copy" and not got["copy 4k"][1]["huge_pages"]
    if LINUX_ADVICE:
        assert got["default"][1]["placement"] == "copy" and got["default"][1]["huge_pages"]
    for name in got:
        assert np.array_equal(got[name][0], got["map"][0]), name
        assert got[name][1]["bytes"] == model.stat().st_size


def test_too_little_memory_keeps_the_mapping(model, monkeypatch):
    size = model.stat().st_size
    monkeypatch.setattr(xp, "probe_memory", lambda *a: xp.MemoryProbe(size, "a test's cgroup"))
    with Engine.load(model, threads=1, n_ctx=16, verify=False) as eng:
        w = eng.weights_memory()
    assert w["placement"] == "map" and "more than 50%" in w["reason"]


@pytest.mark.skipif(not LINUX_ADVICE, reason="the default copies only where MADV_HUGEPAGE exists")
def test_engines_over_one_file_share_one_copy(model):
    """cflow serve's slots: Engines over the first one's open file read its copy, not a copy each."""
    with Engine.load(model, threads=1, n_ctx=16, verify=False) as first:
        second = Engine(first.file, EngineOptions(threads=1, n_ctx=16))
        assert first.weights_memory()["placement"] == second.weights_memory()["placement"] == "copy"
        assert second._weights is first._weights
        assert np.array_equal(second.prefill([7, 8]), first.prefill([7, 8]))
        other = Engine(first.file, EngineOptions(threads=1, n_ctx=16, mmap=False, hugepages=False))
        assert other._weights is not first._weights  # other pages asked for: its own copy
