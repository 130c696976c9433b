"""The machine's read bandwidth as cflow sees it: a STREAM-like read-only sum in the C core,
best of several passes over a buffer far larger than the last-level cache."""

from __future__ import annotations

from cflow.errors import CflowError

DEFAULT_BYTES = 1 << 30  # 1.07 GB: far beyond any L3 this runs on


def read_bandwidth(threads: int = 1, nbytes: int = DEFAULT_BYTES, reps: int = 5) -> float:
    """Best-of-`reps` read bandwidth in GB/s with `threads` threads."""
    from cflow import _native

    gbs = _native.read_bandwidth(nbytes, threads, reps)
    if gbs < 0:
        from cflow.runtime.files import format_size

        raise CflowError(f"could not allocate {format_size(nbytes)} for the bandwidth probe; "
                         "pass a smaller size")
    return gbs
