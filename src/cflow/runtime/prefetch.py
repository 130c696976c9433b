"""Software prefetch of the weight-streaming kernels (claim C6): the modes and their spellings.

    Engine.load(path, prefetch=None)     # None: each kernel's default (mat-vec 8 KiB, avx512 batched 4 KiB ahead)
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

The C side keeps one process-wide mode that the kernels read; each engine has its own mode and
makes it the process-wide one at the start of every native call, so engines with different modes
in one process each run with theirs unless their calls overlap in time (then only speed changes).
Here a mode is an int: -1 default, 0 off, N > 0 bytes ahead (C's encoding).
"""

from __future__ import annotations

from cflow.runtime.errors import EngineError

DEFAULT = -1  # CF_PREFETCH_DEFAULT
OFF = 0
MAX_BYTES = 1 << 20  # CF_PREFETCH_MAX: a distance past 1 MiB would outrun any cache


def to_mode(prefetch: int | None) -> int:
    """Engine.load's `prefetch` (None, 0 or bytes ahead) as the C mode; EngineError if invalid."""
    if prefetch is None:
        return DEFAULT
    if isinstance(prefetch, bool) or not isinstance(prefetch, int):
        raise EngineError(f"prefetch must be None (the kernels' default), 0 (off) or bytes ahead "
                          f"(1..{MAX_BYTES}), got {prefetch!r}", flag="--prefetch")
    if not 0 <= prefetch <= MAX_BYTES:
        raise EngineError(f"prefetch distance must be 0 (off) or 1..{MAX_BYTES} bytes ahead, got {prefetch}",
                          flag="--prefetch")
    return int(prefetch)


def from_mode(mode: int) -> int | None:
    """The C mode back as Engine.load's `prefetch` value (None for the default)."""
    return None if mode == DEFAULT else mode


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
        raise ValueError(f"expected off, default or a distance in bytes (1..{MAX_BYTES}), got {text!r}") from None
    if not 0 <= n <= MAX_BYTES:
        raise ValueError(f"the distance must be 1..{MAX_BYTES} bytes (or off / default), got {text!r}")
    return n


def label(prefetch: int | None) -> str:
    """A mode as the command line spells it (parse's inverse): "default", "off" or "N" (bytes)."""
    if prefetch is None or prefetch == DEFAULT:
        return "default"
    return "off" if prefetch == OFF else str(prefetch)
