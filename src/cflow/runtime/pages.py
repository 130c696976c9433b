"""Where the weights live while the engine runs: the file's mapping, or a copy in 2 MiB pages.

    Engine.load(path, mmap=True, hugepages=True)   # the defaults

A decode step streams every weight once. Mapped, the weights sit in the page cache's 4 KiB pages:
one address-translation (TLB) miss per 4 KiB read, and on a virtual machine each miss walks two
levels of page tables (the guest's and the host's). A copy in anonymous memory advised
MADV_HUGEPAGE gets 2 MiB pages where the kernel grants them (transparent huge pages, "madvise" or
"always" in /sys/kernel/mm/transparent_hugepage/enabled): 512 times fewer misses. Measured
2026-12-06 on a 2-core Intel Xeon VM (SmolLM2-135M Q4_1; a mapped engine and a copied one in one
process, 32 steps each, alternated, 6 rounds): 2 threads 3.9 ms per step copied against 10.5
mapped (0.28-0.52x per round), 1 thread 11.1 against 18.2 (0.38-0.83x); the same copy in 4 KiB
pages (NUMPY_MADVISE_HUGEPAGE=0, transparent_hugepage "madvise") ran 0.65-1.18x the mapping's
time, so the pages make the difference, not the copy.

The choice (`placement`):
- mmap=False: copy, in 2 MiB pages unless hugepages=False.
- mmap=True, hugepages=True (default): copy in 2 MiB pages when the experts stay in memory and the
  file takes at most half of the memory this process may use (cflow.runtime.experts.probe_memory:
  the copy must leave room for the KV cache, scratch, other processes and the page cache the read
  fills); else map. A mapping loads lazily, shares its pages with other processes and the page
  cache, and can be evicted under memory pressure: the choice for models near the memory's size.
- mmap=True, hugepages=False: map.
With experts on disk the copy (mmap=False) leaves the experts' spans untouched and asks for no huge
pages: a 2 MiB page would bring expert bytes beside the dense ones into memory.

Engines over one open file (cflow serve's slots) share one copy: it is kept on the file object.
"""

from __future__ import annotations

import mmap as _mmap
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from cflow.runtime.errors import EngineError

MAX_SHARE = 0.5  # a copy may take at most this share of the memory the process may use


@dataclass(frozen=True)
class Placement:
    copy: bool  # True: the weights are read into anonymous memory; False: the file's mapping
    huge_pages: bool  # the copy is advised MADV_HUGEPAGE
    reason: str  # why, for Engine.weights_memory() and the logs


def placement(file_bytes: int, *, mmap: bool, hugepages: bool, experts_on_disk: bool,
              available: int | None) -> Placement:
    """Copy or map, and with which pages (module docstring). available: bytes this process may use
    (None: unknown, which keeps the mapping unless mmap=False asks for a copy)."""
    can_advise = _can_advise()  # reads the kernel's THP mode once
    huge = hugepages and not experts_on_disk and can_advise
    if not mmap:
        return Placement(True, huge, "mmap=False: read into memory" + (", 2 MiB pages" if huge else ""))
    if not hugepages:
        return Placement(False, False, "hugepages=False: the file's mapping")
    if experts_on_disk:
        return Placement(False, False, "experts on disk: the file's mapping")
    if not can_advise:
        return Placement(False, False, f"transparent huge pages {thp_mode() or 'absent'} on this system: the file's "
                                       f"mapping")
    if available is None:
        return Placement(False, False, "memory available unknown: the file's mapping")
    if file_bytes > MAX_SHARE * available:
        return Placement(False, False, f"the file ({file_bytes / 2**20:.0f} MiB) is more than {MAX_SHARE:.0%} of the "
                                       f"memory available ({available / 2**20:.0f} MiB): the file's mapping")
    return Placement(True, True, "copied into 2 MiB pages (fewer TLB misses than the mapping's 4 KiB pages)")


THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_ENABLED) -> str | None:
    """The kernel's transparent-huge-page mode: "always", "madvise", "never", or None (no THP)."""
    try:
        with open(path) as f:
            m = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return m.group(1) if m else None


def _can_advise() -> bool:
    """MADV_HUGEPAGE is there and the kernel honours it ("always" or "madvise")."""
    return hasattr(_mmap, "MADV_HUGEPAGE") and hasattr(_mmap.mmap, "madvise") and \
        thp_mode() in ("always", "madvise")


def copy_weights(cf: Any, skip_experts: bool = True, huge_pages: bool = False) -> np.ndarray:
    """The file's bytes in anonymous memory, read-only; with skip_experts every expert span is left
    as zero pages (never touched, so never resident). huge_pages: advise MADV_HUGEPAGE before the
    read (else MADV_NOHUGEPAGE, so that "off" is off whatever the system default). Read with pread,
    not through the file's mapping, so the bytes are not resident twice."""
    size = int(cf.buffer.size)
    # private anonymous memory, zero-filled, page-aligned (a shared one would be shmem, whose huge
    # pages follow another switch, shmem_enabled, "never" by default)
    mem = _mmap.mmap(-1, max(size, 1), flags=_mmap.MAP_PRIVATE | _mmap.MAP_ANONYMOUS)
    if _can_advise():
        try:
            mem.madvise(_mmap.MADV_HUGEPAGE if huge_pages else _mmap.MADV_NOHUGEPAGE)
        except OSError:
            pass  # a kernel without transparent huge pages: 4 KiB pages, same bytes
    buf = np.frombuffer(mem, np.uint8, count=size)
    view = memoryview(buf)
    spans = (sorted(cf.experts.values()) if skip_experts else []) + [(size, 0)]
    fd = os.open(cf.path, os.O_RDONLY)
    try:
        pos = 0
        for off, n in spans:
            while pos < off:
                got = os.preadv(fd, [view[pos:off]], pos)
                if got <= 0:
                    raise EngineError(f"{cf.path} ended at byte {pos}, its header says {size}: the file changed "
                                      f"while loading; load it again")
                pos += got
            pos = max(pos, off + n)
    finally:
        os.close(fd)
    view.release()
    buf.flags.writeable = False
    return buf


def shared_copy(cf: Any, skip_experts: bool, huge_pages: bool) -> np.ndarray:
    """copy_weights, made once per open file and settings: every engine over `cf` reads the same
    copy (kept on the file object, freed with it)."""
    key = (skip_experts, huge_pages)
    copies = cf.__dict__.setdefault("_weight_copies", {})
    if key not in copies:
        copies[key] = copy_weights(cf, skip_experts, huge_pages)
    return copies[key]


def smaps_fields(buf: np.ndarray, smaps: str = "/proc/self/smaps") -> list[dict[str, str]] | None:
    """The /proc/self/smaps fields (name -> the rest of its line) of each mapping `buf` spans, in
    address order; None where smaps cannot be read."""
    start = buf.__array_interface__["data"][0]
    end = start + max(buf.nbytes, 1)
    try:
        with open(smaps) as f:
            text = f.read()
    except OSError:
        return None
    out: list[dict[str, str]] = []
    fields: dict[str, str] | None = None
    for line in text.splitlines():
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            lo, hi = int(m.group(1), 16), int(m.group(2), 16)
            fields = {} if lo < end and hi > start else None
            if fields is not None:
                out.append(fields)
        elif fields is not None and ":" in line:
            name, rest = line.split(":", 1)
            fields[name] = rest.strip()
    return out


def huge_page_bytes(buf: np.ndarray, smaps: str = "/proc/self/smaps") -> int | None:
    """How many bytes of `buf` the kernel backs with huge pages now (AnonHugePages of the mappings
    it spans); None where /proc/self/smaps cannot be read."""
    maps = smaps_fields(buf, smaps)
    if maps is None:
        return None
    return sum(int(f.get("AnonHugePages", "0 kB").split()[0]) * 1024 for f in maps)
