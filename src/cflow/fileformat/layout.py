"""The container's fixed byte layout (preamble, alignment, limits), the records the writer takes
and the reader hands out, and the checksum every tensor carries (docs/FORMAT.md).

Checksums are xxh3_64 (fast enough to verify a model at memory speed) over the tensor's
descriptor (name, dtype, shape, layout, meta) followed by its bytes, so verifying also catches a
tensor table edited behind the data.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import xxhash

from cflow import quant

MAGIC = b"\x89CFLOW\r\n"  # high bit + CRLF catch 7-bit and newline-translating transfers (as PNG)
VERSION = 1
FLAG_VFLOW = 1 << 0
KNOWN_FLAGS = FLAG_VFLOW
PREAMBLE = struct.Struct("<8sIIQ")  # magic, version, flags, header length
ALIGN = 4096
MAX_HEADER_BYTES = 256 << 20
ORDERS = ("cflow", "vflow")
CHECKSUM_ALGO = "xxh3_64"
CHECKSUM_HEX = 16  # hex digits of the digest
MAX_INT = (1 << 63) - 1  # every size and offset must fit an int64 (the C core's off_t)

ProgressFn = Callable[[int, int, str], None]  # (bytes written, total bytes, tensor name)

@dataclass
class TensorData:
    """What a converter hands the writer. `data` is uint8 already encoded in `layout`, or a
    zero-argument callable returning it, called once when the writer reaches the tensor (so a
    converter need not hold the whole model in memory)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    layout: str  # "rows" | "tiled"
    data: np.ndarray | Callable[[], np.ndarray]
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    layout: str
    offset: int  # absolute file offset, a multiple of ALIGN
    nbytes: int
    checksum: str  # "xxh3_64:" + 16 hex digits
    meta: dict = field(default_factory=dict, compare=True, hash=False)


@dataclass(frozen=True)
class WriteSummary:
    path: str
    order: str
    file_bytes: int
    header_bytes: int
    data_bytes: int  # sum of tensor nbytes
    padding_bytes: int  # alignment padding in the data region
    n_tensors: int
    n_experts: int


def checksum_descriptor(name: str, dtype: str, shape: Sequence[int], layout: str, meta: dict) -> bytes:
    d = {"name": name, "dtype": dtype, "shape": list(shape), "layout": layout, "meta": meta}
    return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def tensor_checksum(desc: bytes, data: np.ndarray | memoryview) -> str:
    h = xxhash.xxh3_64()
    h.update(desc)
    h.update(data)
    return f"{CHECKSUM_ALGO}:{h.hexdigest()}"


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def tile_ok(tile: Sequence[int]) -> bool:
    return (len(tile) == 2 and all(is_int(t) for t in tile) and 0 < tile[0] <= 1 << 20 and tile[0] % quant.G == 0
            and 0 < tile[1] <= 1 << 20 and tile[1] % quant.QK == 0)


def tile_problem(dtype: str, layout: str, tile: Sequence[int]) -> str | None:
    """Why a tensor of `dtype` cannot be tiled with `tile` (a K-quant tile holds whole 256-weight
    super-blocks, so its TK must be a multiple of 256), or None."""
    if layout != "tiled" or dtype not in quant.KQUANT_IDS:
        return None
    from cflow import kquant  # late: only files with K-quant tensors need it

    try:
        kquant.check_tile_k(dtype, tile)
    except quant.QuantError as e:
        return str(e)
    return None
