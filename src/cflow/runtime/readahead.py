"""Cold start: reading a mapped model file ahead of the compute, in its file order.

A model that is mapped but not in the page cache pays, on its first step, one page fault per
missing read-around window: the compute stops, the kernel reads a few hundred kB, the compute
goes on. The disk then works at queue depth one, and never while the CPU does. The sweeper is a
background thread that asks the kernel for the file's pages in file order
(posix_fadvise(WILLNEED), which only queues the reads) a bounded window ahead of what is already
resident, so the reads run while the step computes and the faults find their pages there.

That only pays when the file order is the order the step touches the pages: a `.vflow` file is
stored in the order `cflow.dag.schedule` runs one step and the engine then runs its plan in that
order (cflow.runtime.plan, file_order); a `.cflow` file is stored layer by layer, which is the
order of the default plan. Engine.load(readahead=...) chooses (docs/DESIGN.md, "Read order"):

    "off"    nothing (the default for `.cflow`)
    "order"  a `.vflow` file's plan runs in file order; no sweeper
    "sweep"  the plan as "order", and sweep the mapped weights in file order, cold or not
    "auto"   for a `.vflow` file: run the plan in file order, and sweep when less than half of
             the weights it maps are in the page cache (mincore) and they fit the memory this
             process may use; for a `.cflow` file: off

With experts on disk the experts' spans are not swept: they are read with O_DIRECT by the expert
cache (cflow.runtime.experts), into its own buffers, in ascending file offset within a layer
(the chosen experts in ascending index, which is ascending offset in both orders). The plan then
keeps its experts where the expert cache wants them: every plan touches the dense weights, the only
ones the mapping serves, in the `.vflow` order already.
"""

from __future__ import annotations

import ctypes
import mmap as _mmap
import os
import threading
import time
from typing import Iterable, Sequence

import numpy as np

from cflow.runtime.errors import EngineError

MODES = ("auto", "off", "order", "sweep")
CHUNK = 2 << 20    # one WILLNEED request
WINDOW = 64 << 20  # at most this much asked for and not yet resident
COLD = 0.5         # auto sweeps when less than this fraction of the swept spans is resident
_POLL_S = 0.002  # the poll holds the GIL a moment: not too often


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise EngineError(f"readahead must be one of {', '.join(MODES)}, got {mode!r}", flag="--readahead")
    return mode


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):
        return None


def resident(buffer: np.ndarray, spans: Iterable[tuple[int, int]]) -> float | None:
    """Fraction of the pages under `spans` (offset, bytes) of the mapped `buffer` that are in the
    page cache (mincore on the engine's own mapping); None where that cannot be asked."""
    libc = _libc()
    if libc is None:
        return None
    page, base = _mmap.PAGESIZE, buffer.ctypes.data
    have = total = 0
    for off, n in spans:
        start = (base + off) // page * page
        npages = -(-(base + off + n - start) // page)
        vec = np.zeros(max(npages, 1), np.uint8)
        if libc.mincore(ctypes.c_void_p(start), npages * page, vec.ctypes.data) != 0:
            return None
        have += int((vec & 1).sum())
        total += npages
    return have / total if total else 1.0


def merge(spans: Iterable[tuple[int, int]], gap: int = 1 << 16) -> list[tuple[int, int]]:
    """Spans (offset, bytes) sorted by offset, neighbours less than `gap` apart joined."""
    out: list[list[int]] = []
    for off, n in sorted(spans):
        if out and off <= out[-1][0] + out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], off + n - out[-1][0])
        else:
            out.append([off, n])
    return [(o, n) for o, n in out]


def chunks(spans: Sequence[tuple[int, int]], size: int = CHUNK) -> list[tuple[int, int]]:
    """The spans cut into requests of at most `size` bytes, in file order."""
    return [(o + k, min(size, n - k)) for o, n in spans for k in range(0, n, size)]


class Sweeper:
    """A thread that WILLNEEDs `spans` of the file in file order, at most `window` bytes ahead of
    what mincore shows resident, once; `stop()` ends it early. `stats()` says what it did."""

    def __init__(self, path: str, buffer: np.ndarray, spans: Sequence[tuple[int, int]],
                 window: int = WINDOW, chunk: int = CHUNK) -> None:
        self.path, self.buffer, self.window = path, buffer, window
        self.todo = chunks(merge(spans), chunk)
        self.advised = 0
        self.waits = 0
        self.seconds = 0.0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cflow-readahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            self.error = str(e)
            return
        try:
            ahead: list[tuple[int, int]] = []  # asked for, not yet seen resident (oldest first)
            for off, n in self.todo:
                while ahead and sum(k for _, k in ahead) + n > self.window:
                    if self._stop.is_set():
                        return
                    if (resident(self.buffer, ahead[:1]) or 0.0) >= 1.0:
                        ahead.pop(0)
                    else:
                        self.waits += 1
                        time.sleep(_POLL_S)
                if self._stop.is_set():
                    return
                os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
                ahead.append((off, n))
                self.advised += n
        except OSError as e:  # advice is best effort: the faults still read what is missing
            self.error = str(e)
        finally:
            os.close(fd)
            self.seconds = time.perf_counter() - t0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def stats(self) -> dict:
        return {"bytes_advised": self.advised, "bytes_total": sum(n for _, n in self.todo), "waits": self.waits,
                "seconds": self.seconds, "running": not self.done(), "error": self.error}


def swept_spans(cf, skip_experts: bool) -> list[tuple[int, int]]:
    """The spans of the file the engine maps: every tensor, or all but the experts (on disk)."""
    experts = set(cf.experts.values()) if skip_experts else set()
    spans = [(e.offset, e.nbytes) for e in cf.tensors.values()]
    if experts:
        spans = [s for s in spans if not any(o <= s[0] < o + n for o, n in experts)]
    return spans


def start(cf, mode: str, *, mapped: bool, skip_experts: bool) -> tuple[bool, Sweeper | None, float | None]:
    """Decide for an opened file: (run the plan in file order, the sweeper if one runs, the
    resident fraction that decided it). Nothing for a file read into memory (mapped False)."""
    check_mode(mode)
    file_order = mode != "off" and cf.order == "vflow"
    if mode in ("off", "order") or not mapped or not hasattr(os, "posix_fadvise"):
        return file_order, None, None
    spans = swept_spans(cf, skip_experts)
    frac = resident(cf.buffer, merge(spans))
    if mode == "auto" and (cf.order != "vflow" or (frac is not None and frac >= COLD) or not fits(spans)):
        return file_order, None, frac
    return file_order, Sweeper(cf.path, cf.buffer, spans), frac


def fits(spans: Sequence[tuple[int, int]]) -> bool:
    """Whether the swept bytes fit the memory this process may use (cflow.runtime.experts): a sweep
    over more than that would evict its own pages before the compute reaches them."""
    from cflow.runtime.experts import headroom, probe_memory

    room = probe_memory().available
    need = sum(n for _, n in spans)
    return room is None or need + headroom(room) <= room
