"""The disk's cold read bandwidth as the expert loader sees it: large sequential reads, and reads
of expert-sized spans at random 4096-aligned offsets (one expert of a `.cflow` file is one such
read, docs/FORMAT.md "Data order and experts").

Reads bypass the page cache with O_DIRECT into a page-aligned buffer (an anonymous mmap). Where
the filesystem refuses O_DIRECT, the probe evicts the file with posix_fadvise(DONTNEED) and reads
it through the cache instead, and says so (`direct=False`); how much of the file was still
resident when the timing started is measured with mincore (`resident`), so a "cold" number that
is really a memory number (tmpfs, or a file someone keeps mapped) is visible as such.

    from cflow.bench import disk
    r = disk.probe("model.cflow")                          # sequential, whole file (up to 1 GiB)
    r = disk.probe("model.cflow", pattern="random", chunk=16 << 20)
    r = disk.probe()                                       # a 1 GiB temp file in $TMPDIR, deleted after
    print(r.gbs, r.direct, r.resident)

    python -m cflow.bench.disk [PATH] [--size 1G] [--chunk 8M] [--random-chunk 4M,16M,64M] [--json]

O_DIRECT bypasses this machine's page cache, not a hypervisor's: in a VM, a file written or read
moments ago may come back from the host's cache, faster than the disk. The first pass over a file
left alone for a while is the honest cold number; repeat passes show the spread.

GB/s are decimal (10^9 bytes per second), as everywhere in cflow. One thread by default (queue
depth 1); `threads=N` keeps N reads in flight (a pread thread pool, as the engine's loader does).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import mmap
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from cflow.errors import CflowError

ALIGN = 4096                  # O_DIRECT offsets and lengths; also the .cflow tensor alignment
DEFAULT_SIZE = 1 << 30        # the temp file, and the most one probe reads by default
SEQ_CHUNK = 8 << 20           # sequential read size
RANDOM_CHUNK = 16 << 20       # an expert-sized read (one Mixtral-small expert is ~20 MB in Q4_0)
PATTERNS = ("sequential", "random")
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs", "shm"})


class DiskProbeError(CflowError, OSError):
    """The disk probe cannot run as asked (bad argument, no room for its temp file, read error)."""


class UnreadableFileError(DiskProbeError):
    """The file to probe does not exist, is not a regular file, cannot be opened, or is too small."""


@dataclass
class DiskResult:
    """One timed pass of reads."""

    path: str
    pattern: str             # "sequential" | "random"
    chunk: int               # bytes per read
    bytes: int               # bytes read in the timed pass
    reads: int
    seconds: float
    gbs: float               # bytes / seconds / 1e9
    direct: bool             # O_DIRECT (page cache bypassed); False: fadvise(DONTNEED) + buffered reads
    resident: float | None   # fraction of the file in the page cache when timing started (None: unknown)
    memory_backed: bool      # the file lives on tmpfs/ramfs: "disk" bandwidth is memory bandwidth
    threads: int
    file_bytes: int
    temp_file: bool          # the probe created (and deleted) the file
    notes: list[str] = field(default_factory=list)

    @property
    def cold(self) -> bool:
        """Whether the bytes came from the device: O_DIRECT, or an evicted file, not on tmpfs."""
        if self.memory_backed:
            return False
        return self.direct or (self.resident is not None and self.resident < 0.01)

    @property
    def mb_per_read(self) -> float:
        return self.chunk / 1e6

    def to_dict(self) -> dict:
        return {**asdict(self), "cold": self.cold}

    def summary(self) -> str:
        how = "O_DIRECT" if self.direct else "buffered after fadvise(DONTNEED)"
        res = "" if self.resident is None or self.direct else f", {self.resident:.0%} resident"
        mem = ", tmpfs (memory, not disk)" if self.memory_backed else ""
        return (f"{self.pattern:<10} {self.gbs:6.2f} GB/s  {self.bytes / 1e9:.2f} GB in {self.reads} reads of "
                f"{_fmt(self.chunk)} in {self.seconds:.2f} s, {self.threads} thread(s), {how}{res}{mem}")


# ---- the file --------------------------------------------------------------------------------
def _fmt(n: float) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:g} {unit}"
    return f"{n:g} B"


def parse_size(text: str | int) -> int:
    """'1G', '512M', '16MiB', '4096' -> bytes. K/M/G/T are binary here (probe sizes are buffer sizes)."""
    if isinstance(text, int):
        return text
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if s.endswith(suffix):
            s, mult = s[:-1], m
            break
    try:
        v = float(s)
    except ValueError:
        raise DiskProbeError(f"size {text!r} is not a number with an optional K/M/G/T suffix, e.g. 1G or 16M") \
            from None
    if not v > 0:
        raise DiskProbeError(f"size {text!r} must be positive")
    return int(v * mult)


def _check_readable(path: Path) -> int:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise UnreadableFileError(f"{path} does not exist; give an existing file, or no path to probe a "
                                  "temp file") from None
    except OSError as e:
        raise UnreadableFileError(f"cannot stat {path}: {e.strerror}") from None
    if path.is_dir():
        raise UnreadableFileError(f"{path} is a directory; give a file in it (e.g. a model), or no path and "
                                  f"dir={str(path)!r} to probe a temp file there")
    if not path.is_file():
        raise UnreadableFileError(f"{path} is not a regular file; the probe reads files")
    if st.st_size < ALIGN:
        raise UnreadableFileError(f"{path} holds {st.st_size} bytes; the probe needs at least {ALIGN}")
    try:
        os.close(os.open(path, os.O_RDONLY))
    except OSError as e:
        raise UnreadableFileError(f"cannot open {path} for reading: {e.strerror}") from None
    return st.st_size


def make_temp_file(size: int = DEFAULT_SIZE, dir: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """Write `size` bytes of incompressible data to a new temp file in `dir` (default $TMPDIR),
    fsync it and drop it from the page cache. The caller deletes it (see `probe_file`)."""
    size = _round_up(int(size), ALIGN)
    d = Path(dir) if dir is not None else Path(tempfile.gettempdir())
    if not d.is_dir():
        raise DiskProbeError(f"{d} is not a directory; give an existing directory for the probe's temp file")
    free = shutil.disk_usage(d).free
    if free < size + (256 << 20):
        raise DiskProbeError(f"{d} has {free / 1e9:.2f} GB free; the probe's temp file needs {size / 1e9:.2f} GB "
                             "(and some room to spare): pass a smaller size or another directory")
    try:
        fd, name = tempfile.mkstemp(prefix="cflow-disk-probe.", suffix=".bin", dir=d)
    except OSError as e:
        raise DiskProbeError(f"cannot create a temp file in {d}: {e.strerror}") from None
    rng = np.random.Generator(np.random.SFC64(seed))
    block = 16 << 20
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            done = 0
            while done < size:
                n = min(block, size - done)
                f.write(rng.integers(0, 2 ** 63, size=n // 8, dtype=np.int64).view(np.uint8))
                done += n
            os.fsync(f.fileno())
            _evict(f.fileno())
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise DiskProbeError(f"cannot write the probe's temp file {name}: {e.strerror}") from None
    return Path(name)


@contextlib.contextmanager
def probe_file(path: str | os.PathLike | None = None, *, size: int = DEFAULT_SIZE,
               dir: str | os.PathLike | None = None, seed: int = 0) -> Iterator[tuple[Path, bool]]:
    """(path, created): the given file, checked readable, or a temp file deleted on exit."""
    if path is not None:
        p = Path(path)
        _check_readable(p)
        yield p, False
        return
    p = make_temp_file(size, dir, seed)
    try:
        yield p, True
    finally:
        with contextlib.suppress(OSError):
            p.unlink()


# ---- page cache ------------------------------------------------------------------------------
def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _evict(fd: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def evict(path: str | os.PathLike) -> None:
    """Ask the kernel to drop the file's clean pages from the page cache (best effort)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        _evict(fd)
    finally:
        os.close(fd)


def resident_fraction(path: str | os.PathLike) -> float | None:
    """Fraction of the file's pages in the page cache (mincore), None where that cannot be asked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            page = mmap.PAGESIZE
            vec = np.zeros((size + page - 1) // page, np.uint8)
            if libc.mincore(addr, size, vec.ctypes.data) != 0:
                return None
            return float((vec & 1).mean())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def filesystem_type(path: str | os.PathLike) -> str | None:
    """The type of the filesystem holding `path` (from /proc/self/mountinfo), None if unknown."""
    try:
        target = os.path.realpath(path)
        best, fstype = "", None
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                parts = left.split()
                if len(parts) < 5 or not right:
                    continue
                mnt = parts[4].replace("\\040", " ")
                inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, fstype = mnt, right.split()[0]
        return fstype
    except OSError:
        return None


# ---- reading ---------------------------------------------------------------------------------
def _open(path: Path, direct: bool) -> tuple[int, bool, list[str]]:
    """(fd, direct?, notes): O_DIRECT when asked and allowed, else a plain descriptor."""
    notes: list[str] = []
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT), True, notes
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise UnreadableFileError(f"cannot open {path} for reading: {e.strerror}") from None
            notes.append(f"O_DIRECT refused ({e.strerror}); evicted with fadvise(DONTNEED), buffered reads")
    elif direct:
        notes.append("this platform has no O_DIRECT; evicted with fadvise(DONTNEED), buffered reads")
    try:
        return os.open(path, os.O_RDONLY), False, notes
    except OSError as e:
        raise UnreadableFileError(f"cannot open {path} for reading: {e.strerror}") from None


class _DirectRefused(Exception):
    pass


def _read_all(fd: int, spans: Sequence[tuple[int, int]], chunk: int, threads: int,
              direct: bool) -> tuple[int, float]:
    """Read every (offset, length) span; return (bytes read, seconds). Each thread has its own
    aligned buffer of `chunk` bytes (an anonymous mmap is page-aligned, which O_DIRECT needs),
    touched before the clock starts so page faults on it are not timed."""
    bufs = [mmap.mmap(-1, _round_up(chunk, ALIGN)) for _ in range(threads)]
    for b in bufs:
        b.write(bytes(len(b)))
    total = [0] * threads
    errors: list[BaseException] = []
    next_i = [0]
    lock = threading.Lock()

    def worker(k: int) -> None:
        view = memoryview(bufs[k])
        try:
            while not errors:
                with lock:
                    i = next_i[0]
                    next_i[0] += 1
                if i >= len(spans):
                    return
                off, n = spans[i]
                sub = view[:_round_up(n, ALIGN) if direct else n]
                try:
                    got = os.preadv(fd, [sub], off)
                except OSError as e:
                    if direct and e.errno == errno.EINVAL:
                        raise _DirectRefused() from None
                    raise
                finally:
                    sub.release()
                total[k] += min(got, n)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            errors.append(e)
        finally:
            view.release()

    try:
        t0 = time.perf_counter()
        if threads == 1:
            worker(0)
        else:
            ts = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        dt = time.perf_counter() - t0
    finally:
        for b in bufs:
            with contextlib.suppress(BufferError):  # a traceback may still hold a view: GC frees it
                b.close()
    if errors:
        raise errors[0]
    return sum(total), dt


def _spans(pattern: str, file_bytes: int, chunk: int, limit: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    if pattern == "sequential":
        end = min(file_bytes, limit)
        return [(off, min(chunk, end - off)) for off in range(0, end, chunk)]
    # random: non-overlapping chunk-sized slots (so no read is served by an earlier one's cache),
    # shifted together by a random multiple of 4096 and read in a random order.
    slots = file_bytes // chunk
    if slots < 1:
        raise DiskProbeError(f"random reads of {_fmt(chunk)} need a file at least that large; the file holds "
                             f"{file_bytes} bytes: use a smaller chunk or a larger file")
    n = max(1, min(slots, limit // chunk))
    slack = (file_bytes - slots * chunk) // ALIGN
    shift = int(rng.integers(0, slack + 1)) * ALIGN
    order = rng.permutation(slots)[:n]
    return [(int(s) * chunk + shift, chunk) for s in order]


def probe(path: str | os.PathLike | None = None, *, pattern: str = "sequential", chunk: int | str | None = None,
          max_bytes: int | str | None = None, size: int | str = DEFAULT_SIZE, threads: int = 1,
          direct: bool = True, dir: str | os.PathLike | None = None, seed: int = 0) -> DiskResult:
    """Time one cold pass of reads over `path` (no path: a temp file of `size` bytes in `dir`,
    deleted afterwards) and return a DiskResult (`.gbs`).

    pattern: "sequential" (from the start, `chunk` default 8 MiB) or "random" (`chunk`-sized reads,
    default 16 MiB, at random 4096-aligned offsets, no span read twice). At most `max_bytes`
    (default: the whole file, up to 1 GiB) are read. direct=False skips O_DIRECT and uses
    fadvise(DONTNEED) + buffered reads, as the fallback does where O_DIRECT is refused."""
    if pattern not in PATTERNS:
        raise DiskProbeError(f"pattern must be one of {list(PATTERNS)}, got {pattern!r}")
    chunk = parse_size(chunk) if chunk is not None else (SEQ_CHUNK if pattern == "sequential" else RANDOM_CHUNK)
    if chunk % ALIGN:
        raise DiskProbeError(f"chunk {chunk} must be a multiple of {ALIGN} (O_DIRECT needs aligned reads)")
    if not (isinstance(threads, int) and threads >= 1):
        raise DiskProbeError(f"threads must be a positive int, got {threads!r}")
    size = parse_size(size)
    with probe_file(path, size=size, dir=dir, seed=seed) as (p, created):
        return _probe(p, created, pattern, chunk, parse_size(max_bytes) if max_bytes is not None else DEFAULT_SIZE,
                      threads, direct, seed)


def _probe(p: Path, created: bool, pattern: str, chunk: int, limit: int, threads: int, direct: bool,
           seed: int) -> DiskResult:
    file_bytes = os.path.getsize(p)
    spans = _spans(pattern, file_bytes, chunk, limit, np.random.default_rng(seed))
    fstype = filesystem_type(p)
    memory_backed = fstype in MEMORY_FILESYSTEMS
    fd, used_direct, notes = _open(p, direct)
    try:
        _evict(fd)
        resident = resident_fraction(p)
        try:
            nbytes, dt = _read_all(fd, spans, chunk, threads, used_direct)
        except _DirectRefused:
            # accepted at open, refused at read (some filesystems do that): fall back.
            os.close(fd)
            fd, used_direct = os.open(p, os.O_RDONLY), False
            notes.append("O_DIRECT reads refused (EINVAL); evicted with fadvise(DONTNEED), buffered reads")
            _evict(fd)
            resident = resident_fraction(p)
            nbytes, dt = _read_all(fd, spans, chunk, threads, False)
        except OSError as e:
            raise DiskProbeError(f"reading {p} failed: {e.strerror or e}") from None
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    if memory_backed:
        notes.append(f"{p} is on {fstype}: this measures memory, not a disk")
    elif not used_direct and resident is not None and resident > 0.01:
        notes.append(f"{resident:.0%} of the file stayed in the page cache after fadvise(DONTNEED) "
                     "(mapped by another process?); the number is partly a memory number")
    dt = max(dt, 1e-9)
    return DiskResult(str(p), pattern, chunk, nbytes, len(spans), dt, nbytes / dt / 1e9, used_direct,
                      resident, memory_backed, threads, file_bytes, created, notes)


@dataclass
class DiskReport:
    """A sequential pass and random passes at several read sizes over the same file."""

    sequential: DiskResult
    random: list[DiskResult]

    def to_dict(self) -> dict:
        return {"sequential": self.sequential.to_dict(), "random": [r.to_dict() for r in self.random]}

    def to_text(self) -> str:
        head = self.sequential
        where = "temp file" if head.temp_file else head.path
        lines = [f"disk read bandwidth, cold: {where} ({head.file_bytes / 1e9:.2f} GB)",
                 "  " + head.summary()] + ["  " + r.summary() for r in self.random]
        notes = dict.fromkeys(n for r in [head, *self.random] for n in r.notes)
        return "\n".join(lines + [f"  note: {n}" for n in notes])


def measure(path: str | os.PathLike | None = None, *, size: int | str = DEFAULT_SIZE,
            chunk: int | str = SEQ_CHUNK, random_chunks: Sequence[int | str] = (4 << 20, RANDOM_CHUNK, 64 << 20),
            max_bytes: int | str | None = None, threads: int = 1, direct: bool = True,
            dir: str | os.PathLike | None = None, seed: int = 0) -> DiskReport:
    """Sequential and random probes over one file (a temp file made once when no path is given)."""
    size = parse_size(size)
    with probe_file(path, size=size, dir=dir, seed=seed) as (p, created):
        def one(pattern: str, c: int | str) -> DiskResult:
            r = probe(p, pattern=pattern, chunk=c, max_bytes=max_bytes, threads=threads, direct=direct, seed=seed)
            r.temp_file = created
            return r

        seq = one("sequential", chunk)
        rnd = [one("random", c) for c in random_chunks if parse_size(c) <= os.path.getsize(p)]
    return DiskReport(seq, rnd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cflow.bench.disk",
        description="Cold disk read bandwidth: sequential large reads, then expert-sized reads at random "
                    "4096-aligned offsets, with O_DIRECT (fadvise(DONTNEED) + buffered reads where refused).",
        epilog="Example: python -m cflow.bench.disk ~/models/mixtral.cflow --random-chunk 20M,100M")
    ap.add_argument("path", nargs="?", help="file to read (default: a temp file of --size, deleted afterwards)")
    ap.add_argument("--size", default="1G", help="temp file size when no path is given (default 1G)")
    ap.add_argument("--dir", help="directory of the temp file (default $TMPDIR): put it on the disk you mean")
    ap.add_argument("--chunk", default="8M", help="sequential read size (default 8M)")
    ap.add_argument("--random-chunk", default="4M,16M,64M",
                    help="comma-separated random read sizes; an expert is one read (default 4M,16M,64M)")
    ap.add_argument("--max-bytes", help="read at most this much per pass (default: the file, up to 1G)")
    ap.add_argument("--threads", type=int, default=1, help="reads in flight (default 1)")
    ap.add_argument("--no-direct", action="store_true", help="skip O_DIRECT: fadvise(DONTNEED) + buffered reads")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    try:
        rep = measure(a.path, size=a.size, chunk=a.chunk, random_chunks=[c for c in a.random_chunk.split(",") if c],
                      max_bytes=a.max_bytes, threads=a.threads, direct=not a.no_direct, dir=a.dir)
    except DiskProbeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rep.to_dict(), indent=2) if a.json else rep.to_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
