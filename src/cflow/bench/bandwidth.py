"""The machine's ceilings as cflow sees them: read bandwidth (a STREAM-like read-only sum in the C
core, best of several passes over a buffer far larger than the last-level cache), which bounds
decode, and the int8 multiply-add peak of the kernels' instruction form, which bounds prefill."""

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


PEAK_ISAS = ("avx2", "avxvnni", "avx512")  # kernel tables built on an int8 multiply-add instruction


def int8_peak(isa: str, threads: int = 1, reps: int = 3) -> float | None:
    """Best-of-`reps` int8 multiply-add throughput in GOP/s of the instruction the `isa` kernel
    table's batched kernels are built on (vpdpbusd zmm for avx512, ymm for avxvnni, the
    vpmaddubsw/vpmaddwd pair for avx2), on `threads` threads, with no memory traffic. None for
    the scalar reference table or a form this build or CPU lacks."""
    from cflow import _native

    if isa not in PEAK_ISAS:
        return None
    feats = _native.cpu_features()
    need = {"avx2": ("avx2",), "avxvnni": ("avx2", "avxvnni"), "avx512": ("avx512f", "avx512bw", "avx512vnni")}[isa]
    if not all(feats.get(f) for f in need):
        return None
    gops = _native.int8_peak(isa, threads, reps)
    return gops if gops > 0 else None
