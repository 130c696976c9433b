"""Expert residency: where a mixture-of-experts model keeps its experts while it runs.

    Engine.load(path, experts="auto", expert_cache=None, expert_io="async", expert_speculation="auto")

    experts="ram"    every expert stays in the file's mapping, like every other weight
    experts="disk"   dense weights (attention, norms, routers, embeddings, lm_head, dense FFN) stay
                     in the mapping; experts are read from the file as the router chooses them, into
                     an expert cache of at most `expert_cache` bytes (native/experts.h)
    experts="auto"   (default) disk when the model file and its KV cache do not fit the memory this
                     process may use, else ram; the reason is kept in Engine.residency.reason and a
                     disk choice is logged

    expert_cache     bytes (int) or a size ("2G", "512MiB": cflow.runtime.files.parse_size);
                     None: what memory leaves after the dense weights, the KV cache and HEADROOM,
                     at least the minimum and at most every expert
    expert_io        "async": the reads of a layer's chosen experts start as soon as its router has
                     chosen, on reader threads, and the experts op waits only for the expert it
                     needs next; with delta_expert = de > 0 that op also moves to just before layer
                     l + de's residual update (cflow.runtime.plan, delay_experts), so the reads
                     overlap de layers of attention and dense FFN (expert_delay=False: not moved);
                     "sync": the experts op reads, then computes (the baseline)
    expert_speculation
                     (async only): when layer l's router has chosen, the engine also applies the
                     routers of the next layers to layer l's MoE input to predict their experts and
                     starts reading those the cache lacks, in the slots beyond the minimum (none:
                     off by itself); results are the same bit for bit, the counters
                     speculation_predicted / speculation_hits give its hit rate. N (an int, or its
                     digits as a string): up to N layers ahead (at most 16; predictions at each
                     distance, the next layer's too, start reads only while >= 90% of them prove
                     right: learned routing mostly stays below that, random weights pass); "next-layer" =
                     1; "auto" (default): AUTO_SPECULATION_DEPTH layers when the experts are on
                     disk with async I/O (with delta_expert = 0, as in plain Mixtral, nothing else
                     hides the reads; with a delay it adds to the window), else off; "off" = 0.
                     Not the kernels' software prefetch (Engine.load(prefetch=...),
                     cflow.runtime.prefetch), which issues PREFETCHT0 for weights in memory.

The memory this process may use (`probe_memory`) is the smallest of MemAvailable (/proc/meminfo) and
the room under its cgroup's memory limit (v2 memory.max, v1 memory.limit_in_bytes, minus what the
group uses, less its inactive page cache), over the group and its ancestors.

The cache holds whole experts in slots of the largest expert's size rounded up to 4096 bytes; it
never takes more than the budget. Every layer in flight pins its top_k experts until they ran, so
the smallest budget is top_k x (layers in flight) slots; a smaller one is refused with the
minimum. Dense models have no experts: "ram" and "auto" change nothing and "disk" is refused.

Reads use O_DIRECT where the filesystem takes it, else buffered pread with readahead off and the
pages dropped after each read; set CFLOW_EXPERT_DIRECT=0 to force the buffered path (the engine
reports which it uses: Engine.expert_cache["read"]). Async reads go through io_uring where the
kernel offers it (raw syscalls, Linux >= 5.11), else through a pool of pread threads, e.g. where a
container blocks io_uring (Engine.expert_cache["reader"], and "reader_note" says why not);
CFLOW_EXPERT_READER=threads forces the threads (for tests: uring-refused, a refused io_uring; inline,
every read done when it is submitted, so nothing depends on when reads land).

The cache's eviction policy replayed in Python, for the tests: tests/cachesim.py.
"""

from __future__ import annotations

import mmap as _mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cflow.runtime.abi import native_module
from cflow.runtime.errors import EngineError
from cflow.runtime.files import format_size, parse_size

MODES = ("ram", "disk", "auto")
IO_MODES = ("async", "sync")
SPECULATION_MODES = ("auto", "off", "next-layer")  # or a depth: N layers ahead
# "auto"'s depth: one expert of a Mixtral-sized model takes about ten layers' compute to read, so the
# read must start layers before its layer routes; the engine reads predictions (the next layer's too)
# only while they prove right (engine_spec.c, spec_trusted), so a deep horizon costs little where
# routing is hard to predict. Measured against off and next-layer, with and without an expert
# delay (docs/results/moe.md, "Async vs sync").
AUTO_SPECULATION_DEPTH = 16
NO_LIMIT = 1 << 60  # cgroup limits at or above this mean "none"


def headroom(available: int) -> int:
    """Memory left free besides the weights, cache and KV cache: the interpreter, tokenizer, scratch,
    and other processes' growth. 10% of what is available, at least 256 MiB."""
    return max(256 << 20, available // 10)


class ExpertIOError(EngineError):
    """Reading an expert from the model file failed (I/O error, short read), or the file changed on
    disk while the engine ran. The message names the file; load the model again."""


# ---- how much memory this process may use ----------------------------------------------------------
@dataclass(frozen=True)
class MemoryProbe:
    available: int | None  # bytes this process may still use; None: cannot tell
    source: str  # where that figure comes from


def probe_memory(root: str | os.PathLike = "/") -> MemoryProbe:
    """The smallest of MemAvailable and the room under every cgroup memory limit that applies.
    `root` lets tests point at a fake /proc and /sys tree."""
    root = Path(root)
    found: list[tuple[int, str]] = []
    avail = _meminfo_available(root / "proc/meminfo")
    if avail is not None:
        found.append((avail, "MemAvailable in /proc/meminfo"))
    found += _cgroup_rooms(root)
    if not found:
        return MemoryProbe(None, "no /proc/meminfo and no cgroup limit")
    room, source = min(found)
    return MemoryProbe(max(room, 0), source)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _meminfo_available(path: Path) -> int | None:
    for line in (_read(path) or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _stat_value(text: str | None, key: str) -> int:
    for line in (text or "").splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            return int(v)
    return 0


def _cgroup_rooms(root: Path) -> list[tuple[int, str]]:
    """(room, description) for each cgroup memory limit on this process's path, v2 and v1."""
    rooms = []
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, rel = parts
        if hid == "0" and controllers == "":  # v2: memory.max, memory.current
            base = root / "sys/fs/cgroup"
            files = ("memory.max", "memory.current", "memory.stat", "inactive_file")
        elif "memory" in controllers.split(","):  # v1
            base = root / "sys/fs/cgroup/memory"
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat", "total_inactive_file")
        else:
            continue
        for d in _ancestors(base, rel):
            limit = (_read(d / files[0]) or "").strip()
            if not limit or limit == "max" or not limit.isdigit() or int(limit) >= NO_LIMIT:
                continue
            used = (_read(d / files[1]) or "0").strip()
            used = int(used) if used.isdigit() else 0
            used -= _stat_value(_read(d / files[2]), files[3])  # page cache the group can drop
            rooms.append((int(limit) - max(used, 0), f"cgroup {files[0]} {format_size(int(limit))} ({d})"))
    return rooms


def _ancestors(base: Path, rel: str) -> list[Path]:
    """The group's directory and its parents up to the mount; just the mount when the group's path
    is not visible (a container sees its own group as the root)."""
    out, p = [], base / rel.strip("/")
    while True:
        if p.is_dir():
            out.append(p)
        if p == base or base not in p.parents:
            break
        p = p.parent
    return out or [base]


# ---- the decision ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSizes:
    """What the decision needs to know about a model file."""

    file_bytes: int
    expert_bytes: int  # the experts' spans, summed
    slot_bytes: int  # the largest expert rounded up to 4096: one cache slot
    n_keys: int  # weight sets x experts
    top_k: int
    inflight: int  # layers whose experts a step may pin at once
    kv_bytes: int  # the KV cache at the engine's context
    delta_expert: int = 0  # the architecture's expert delay: 0 leaves reads nothing to hide behind
    n_layers: int = 0  # caps the speculation depth (0: unknown)

    @property
    def min_slots(self) -> int:
        return native_module().expert_min_slots(self.top_k, self.inflight)  # the C core's rule (engine.h)

    @property
    def dense_bytes(self) -> int:
        return self.file_bytes - self.expert_bytes

    @property
    def min_cache(self) -> int:
        return self.min_slots * self.slot_bytes

    @property
    def full_cache(self) -> int:
        return self.n_keys * self.slot_bytes


def model_sizes(cf: Any, n_ctx: int, inflight: int, cache_type_k: str = "f16",
                cache_type_v: str = "f16") -> ModelSizes:
    from cflow.runtime.kvcache import cache_bytes

    cfg = cf.config
    spans = list(cf.experts.values())
    kv = cache_bytes(cfg, n_ctx, cache_type_k, cache_type_v)  # K and V of every position
    largest = max((n for _, n in spans), default=0)
    align = native_module().EXPERT_ALIGN  # a slot holds whole O_DIRECT blocks (experts.h CF_XALIGN)
    return ModelSizes(file_bytes=int(cf.buffer.size), expert_bytes=sum(n for _, n in spans),
                      slot_bytes=-(-largest // align) * align, n_keys=len(spans), top_k=cfg.top_k,
                      inflight=max(inflight, 1), kv_bytes=kv, delta_expert=cfg.delta_expert,
                      n_layers=cfg.n_layers)


@dataclass(frozen=True)
class Residency:
    mode: str  # "ram" | "disk"
    io: str  # "async" | "sync" (disk only)
    budget: int | None  # expert cache bytes (disk only)
    reason: str  # why this mode and budget, in words
    speculation_depth: int = 0  # expert speculation: layers ahead whose experts are predicted (disk, async only)


def parse_cache(value: int | str | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise EngineError(f"expert_cache must be a byte count or a size like '2G', got {value!r}", flag="--expert-cache")
    try:
        n = value if isinstance(value, int) else parse_size(value)
    except ValueError as e:
        raise EngineError(str(e), flag="--expert-cache") from None
    if n < 0:
        raise EngineError(f"the expert cache cannot be negative ({n})", flag="--expert-cache")
    return n


def decide(sizes: ModelSizes | None, *, experts: str = "auto", expert_cache: int | str | None = None,
           expert_io: str = "async", memory: MemoryProbe | None = None,
           expert_speculation: int | str = "auto") -> Residency:
    """Where the experts live, how large their cache is, and whether reads are speculated. sizes
    None: a model without experts. `memory` defaults to probe_memory() (read only when needed)."""
    if experts not in MODES:
        raise EngineError(f"experts must be one of {', '.join(MODES)}, got {experts!r}", flag="--experts")
    if expert_io not in IO_MODES:
        raise EngineError(f"expert_io must be one of {', '.join(IO_MODES)}, got {expert_io!r}", flag="--expert-io")
    depth = parse_speculation(expert_speculation)
    budget = parse_cache(expert_cache)
    if sizes is None:
        if experts == "disk":
            raise EngineError("this model has no experts (a dense model): there is nothing to keep on disk; "
                              "drop --experts disk", flag="--experts")
        return Residency("ram", expert_io, None, "a dense model: no experts")
    mode, why = experts, f"asked for experts={experts}"
    if experts == "auto":
        memory = memory or probe_memory()
        need = sizes.file_bytes + sizes.kv_bytes
        if memory.available is None:
            mode, why = "ram", f"cannot tell how much memory this process may use ({memory.source})"
        elif need + headroom(memory.available) <= memory.available:
            mode, why = "ram", (f"the model file ({format_size(sizes.file_bytes)}) and KV cache fit the "
                                f"{format_size(memory.available)} this process may use ({memory.source})")
        else:
            mode, why = "disk", (f"the model file ({format_size(sizes.file_bytes)}) and KV cache "
                                 f"({format_size(sizes.kv_bytes)}) do not fit the {format_size(memory.available)} "
                                 f"this process may use ({memory.source})")
    if mode == "ram":
        return Residency("ram", expert_io, None, why)
    if budget is None:
        memory = memory or probe_memory()
        if memory.available is None:
            budget, how = sizes.full_cache, "every expert (free memory unknown)"
        else:
            room = memory.available - sizes.dense_bytes - sizes.kv_bytes - headroom(memory.available)
            budget = min(max(room, sizes.min_cache), sizes.full_cache)
            how = ("every expert" if budget == sizes.full_cache else
                   "the minimum: memory is tight" if budget == sizes.min_cache else
                   "what memory leaves after the dense weights, KV cache and headroom")
        why += f"; expert cache {format_size(budget)}, {how}"
    elif budget < sizes.min_cache:
        raise EngineError(f"an expert cache of {budget} bytes is too small for this model: a step pins up to "
                          f"{sizes.min_slots} experts at once (top_k {sizes.top_k} x {sizes.inflight} layer(s) in "
                          f"flight) of {sizes.slot_bytes} bytes each, so it needs at least {sizes.min_cache} bytes "
                          f"({format_size(sizes.min_cache)}); raise the expert cache", flag="--expert-cache")
    else:
        why += f"; expert cache {format_size(budget)}"
    if depth is None:  # auto
        depth = AUTO_SPECULATION_DEPTH if expert_io == "async" else 0
    depth = min(depth, native_module().SPEC_MAX_DEPTH)  # the engine caps deeper asks (engine.h CF_SPEC_MAX_DEPTH)
    if sizes.n_layers:
        depth = min(depth, sizes.n_layers - 1)
    if depth and expert_io != "async":
        raise EngineError("expert speculation starts reads that run beside compute: it needs --expert-io async "
                          "(or --expert-speculation off)", flag="--expert-speculation")
    if depth:
        ahead = "the next layer's experts" if depth == 1 else f"the experts of the next {depth} layers"
        why += f"; expert speculation of {ahead}"
    return Residency("disk", expert_io, budget, why, depth)


def parse_speculation(value: int | str) -> int | None:
    """expert_speculation as a depth in layers (None: "auto"). Raises EngineError naming the flag."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if value in SPECULATION_MODES:
        return {"auto": None, "off": 0, "next-layer": 1}[value]
    raise EngineError(f"expert_speculation must be one of {', '.join(SPECULATION_MODES)} or a number of layers "
                      f"ahead (0 = off), got {value!r}", flag="--expert-speculation")


def direct_io_wanted() -> bool:
    """O_DIRECT unless CFLOW_EXPERT_DIRECT=0 (tests and benchmarks of the buffered path)."""
    return os.environ.get("CFLOW_EXPERT_DIRECT", "1").strip() not in ("0", "no", "false", "off")


def reader_wanted(native: Any) -> str:
    """CFLOW_EXPERT_READER: "auto" (default: io_uring where the kernel offers it, else pread threads),
    "threads", "uring-refused" (tests: the fallback path) or "inline" (tests: reads land at submission)."""
    want = os.environ.get("CFLOW_EXPERT_READER", "auto").strip() or "auto"
    if want not in native.EXPERT_READERS:
        raise EngineError(f"CFLOW_EXPERT_READER must be one of {', '.join(native.EXPERT_READERS)}, got {want!r}")
    return want


def io_threads(top_k: int, inflight: int) -> int:
    """Reader threads: enough for every read a layer's route submits at once, 2 to 4 (they sleep in
    the kernel, not on a core, but each in-flight read needs one)."""
    return min(4, max(2, top_k * max(inflight, 1)))


def plan_inflight(plan: Any, native: Any) -> int:
    """Layers whose experts a step may pin at once under `plan` (the C core counts them)."""
    from cflow.runtime.abi import encode_plan

    return int(native.plan_inflight(encode_plan(plan, native), plan.n_moe))


def native_options(cf: Any, res: Residency, inflight: int) -> dict:
    """The `experts` argument of NativeEngine for a disk residency."""

    cfg = cf.config
    # a layer without experts (DeepSeek's leading dense layers) has none in the table: empty spans
    span = np.array([cf.experts.get((i, x), (0, 0)) for i in range(cfg.n_unique_layers) for x in range(cfg.n_experts)],
                    np.int64).reshape(-1, 2)
    return {"path": os.fspath(cf.path), "span": np.ascontiguousarray(span), "budget": int(res.budget),
            "io": res.io, "io_threads": io_threads(cfg.top_k, inflight), "direct": direct_io_wanted(),
            "speculation_depth": res.speculation_depth, "reader": reader_wanted(native_module())}


# ---- the file's pages ----------------------------------------------------------------------------
def drop_expert_pages(cf: Any) -> None:
    """Best effort: unmap the experts' pages from this process and drop them from the page cache
    (verifying a file's checksums reads every byte; with experts on disk only the cache should hold
    them). Measured on a 372 MB model: the mapping then holds only dense pages."""
    spans = list(cf.experts.values())
    mm = getattr(getattr(cf.buffer, "base", None), "_mmap", None)
    page = _mmap.PAGESIZE
    try:
        if mm is not None and hasattr(mm, "madvise") and hasattr(_mmap, "MADV_DONTNEED"):
            for off, n in spans:
                start = off - off % page
                length = -(-(off + n - start) // page) * page
                mm.madvise(_mmap.MADV_DONTNEED, start, length)
        if hasattr(os, "posix_fadvise"):
            fd = os.open(cf.path, os.O_RDONLY)
            try:
                for off, n in spans:
                    os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    except (OSError, ValueError):
        pass


def describe(res: Residency, cache: dict | None) -> str:
    """One line for logs: where the experts are and why."""
    if res.mode == "ram" or not cache:
        return f"experts in RAM: {res.reason}"
    return (f"experts on disk: {res.reason}; {cache['slots']} slots of {format_size(cache['slot_bytes'])} "
            f"({format_size(cache['cache_bytes'])}), {cache['read']} reads, {cache['io']} I/O"
            + (f" ({cache['reader']})" if cache["io"] == "async" else "")
            + (f" [{cache['reader_note']}]" if cache.get("reader_note") else "") + speculation_note(res, cache))


def speculation_note(res: Residency, cache: dict) -> str:
    """", speculation ..." for logs: on (in how many slots), or asked for but off because the cache
    has no slot beyond the minimum."""
    if cache.get("speculation_depth"):
        ahead = "next-layer" if cache["speculation_depth"] == 1 else f"{cache['speculation']} ahead"
        return f", speculation {ahead} in up to {cache['speculation_slots']} spare slots"
    if res.speculation_depth:
        return ", speculation off (the cache has no slot beyond the minimum the plan pins)"
    return ""


def speculation_hit_rate(counters: dict) -> float | None:
    """Share of the experts speculation predicted for a layer (each layer's union of predictions)
    that its router then chose; None when nothing was predicted (speculation off, experts in RAM)."""
    n = counters.get("speculation_predicted", 0)
    return counters["speculation_hits"] / n if n else None



def reads_started(counters: dict) -> int:
    """Expert reads an engine has started: demand reads (misses no speculative read served) plus
    speculative reads (docs/DESIGN.md "Counting")."""
    return counters["cache_misses"] - counters["speculation_reads_used"] + counters["speculation_reads"]


def settle_reads(engine: Any, timeout: float = 10.0) -> dict:
    """Wait until every read `engine` started has landed (speculative reads nobody waited for land
    on their own time), or `timeout` seconds; the counters then. Benchmarks call it between runs so
    no read spills into the next one's time; tests, so the byte counts are final."""
    import time

    slot = engine.expert_cache["slot_bytes"]
    end = time.monotonic() + timeout
    while True:
        c = engine.counters()
        if c["disk_bytes"] >= reads_started(c) * slot or time.monotonic() > end:
            return c
        time.sleep(0.002)
