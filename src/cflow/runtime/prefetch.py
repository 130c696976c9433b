"""Software prefetch (PREFETCHT0) in the weight-streaming kernels (claim C6): the modes and their spellings.

    Engine.load(path, prefetch=None)     # None: each kernel's default (mat-vec 8 KiB, none on Zen 4; avx512 batched 4 KiB ahead)
    Engine.load(path, prefetch=0)        # off: no PREFETCH instruction in any kernel
    Engine.load(path, prefetch=1024)     # PREFETCHT0 1024 bytes ahead in every weight-streaming kernel
    cflow bench -m MODEL --prefetch off|default|N

What a distance covers (src/cflow/native/cflow.h, cf_set_prefetch): the tiled mat-vec, the fused
gate/up, the batched matmat and gate_up_mm of the avx2, avxvnni and avx512 tables, every dtype,
dense and expert weights alike, and the fp32 router mat-vec; one PREFETCHT0 per cache line of the
weight bytes N ahead of those about to be read, never past the tensor's end. Deliberately not
covered: the KV-cache reads of attention (not weights; short rows the hardware prefetcher follows,
and a different kernel family), the embedding row (one row per token: no stream to run ahead of)
and the `_ref` kernels (they define the semantics, not the speed). Prefetch never changes a
result.

"Prefetch" in cflow means this alone: PREFETCHT0 for weights already in memory. Reading a MoE
model's experts from disk before their layer routes is expert speculation (Engine.load's
expert_speculation, cflow.runtime.experts), a different mechanism with its own option.

The C side keeps one process-wide mode that the kernels read; each engine has its own mode and
makes it the process-wide one at the start of every native call, so engines with different modes
in one process each run with theirs unless their calls overlap in time (then only speed changes).
A C mode is an int: the core's PREFETCH_DEFAULT (-1), 0 off, N > 0 bytes ahead up to its
PREFETCH_MAX (1 MiB: a distance past that would outrun any cache); this module asks the core for
both bounds rather than keeping copies. Python's own spelling of "off" is 0 (`OFF`), the same
number C uses (tests hold it against PREFETCH_OFF), so 0 and distances pass through unchanged.
"""

from __future__ import annotations

from cflow.runtime.abi import native_module
from cflow.runtime.errors import EngineError

OFF = 0


def max_bytes() -> int:
    """The farthest distance the kernels accept (the C core's CF_PREFETCH_MAX)."""
    return native_module().PREFETCH_MAX


def default_mode() -> int:
    """The C mode meaning "each kernel's own choice" (CF_PREFETCH_DEFAULT)."""
    return native_module().PREFETCH_DEFAULT


def to_mode(prefetch: int | None) -> int:
    """Engine.load's `prefetch` (None, 0 or bytes ahead) as the C mode; EngineError if invalid."""
    if prefetch is None:
        return default_mode()
    if isinstance(prefetch, bool) or not isinstance(prefetch, int):
        raise EngineError(f"prefetch must be None (the kernels' default), 0 (off) or bytes ahead "
                          f"(1..{max_bytes()}), got {prefetch!r}", flag="--prefetch")
    if not 0 <= prefetch <= max_bytes():
        raise EngineError(f"prefetch distance must be 0 (off) or 1..{max_bytes()} bytes ahead, got {prefetch}",
                          flag="--prefetch")
    return int(prefetch)


def from_mode(mode: int) -> int | None:
    """The C mode back as Engine.load's `prefetch` value (None for the default)."""
    return None if mode == default_mode() else mode


def parse(text: str) -> int | None:
    """The command line's spelling: "default" -> None, "off" (or "0") -> 0, "N" -> N bytes ahead.
    ValueError with the accepted forms otherwise (argparse shows it)."""
    t = text.strip().lower()
    if t == "default":
        return None
    if t == "off":
        return OFF
    try:
        n = int(t)
    except ValueError:
        raise ValueError(f"expected off, default or a distance in bytes (1..{max_bytes()}), got {text!r}") from None
    if not 0 <= n <= max_bytes():
        raise ValueError(f"the distance must be 1..{max_bytes()} bytes (or off / default), got {text!r}")
    return n


def label(prefetch: int | None) -> str:
    """A mode as the command line spells it (parse's inverse): "default", "off" or "N" (bytes)."""
    if prefetch is None or prefetch == default_mode():
        return "default"
    return "off" if prefetch == OFF else str(prefetch)
