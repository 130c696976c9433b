"""Reading a container: `open_model` validates the file (cflow.fileformat.validate) and returns a
`CflowFile` whose tensors are read-only views of the mapped bytes; `read_header` and `summarize`
serve tools such as `cflow inspect`."""

from __future__ import annotations

import os

import numpy as np

from cflow import quant
from cflow.config import ModelConfig
from cflow.fileformat.errors import (ChecksumError, FormatError, HeaderSchemaError, MissingTensorError,
                                      TruncatedFileError)
from cflow.fileformat.layout import ALIGN, PREAMBLE, VERSION, TensorEntry, tensor_checksum, checksum_descriptor
from cflow.fileformat.tensors import tensor_category
from cflow.fileformat.validate import (check_config, check_entry, check_experts, check_overlaps, check_top,
                                        parse_header, read_preamble)


class CflowFile:
    """An open, validated model file. `array(name)` is a read-only view of the file's bytes."""

    def __init__(self, path: str, header: dict, entries: dict[str, TensorEntry], cfg: ModelConfig,
                 experts: dict[tuple[int, int], tuple[int, int]], order: str, tile: tuple[int, int],
                 header_len: int, buffer: np.ndarray) -> None:
        self.path, self.header, self.tensors, self.config = path, header, entries, cfg
        self.experts, self.order, self.tile, self.header_len = experts, order, tile, header_len
        self.tokenizer: dict = header["tokenizer"]
        self.metadata: dict = header["metadata"]
        self.version = VERSION
        self.buffer = buffer  # uint8 [file_bytes], read-only
        self.closed = False

    @property
    def data_start(self) -> int:
        return PREAMBLE.size + self.header_len

    def entry(self, name: str) -> TensorEntry:
        if self.closed:
            raise FormatError(f"{self.path} is closed; open it again with open_model()")
        try:
            return self.tensors[name]
        except KeyError:
            near = [n for n in self.tensors if n.split(".")[-1] == name.split(".")[-1]][:3]
            raise MissingTensorError(f"no tensor {name!r} in {self.path}" + (f"; similar: {near}" if near else ""))

    def array(self, name: str) -> np.ndarray:
        """The tensor's encoded bytes, uint8 [nbytes]: a view, no copy."""
        e = self.entry(name)
        return self.buffer[e.offset:e.offset + e.nbytes]

    def plain(self, name: str) -> np.ndarray:
        """An f32/f16 tensor in `rows` layout as a read-only float array of its shape (a view)."""
        e = self.entry(name)
        if e.layout != "rows" or e.dtype not in ("f32", "f16"):
            raise FormatError(f"tensor {name!r} is {e.dtype}/{e.layout}; plain() reads f32/f16 rows tensors")
        return quant.from_plain(self.array(name), e.dtype, e.shape)

    def verify(self) -> None:
        """Recompute every tensor's checksum; raise ChecksumError on the first mismatch."""
        for e in self.tensors.values():
            got = tensor_checksum(checksum_descriptor(e.name, e.dtype, e.shape, e.layout, e.meta), self.array(e.name))
            if got != e.checksum:
                raise ChecksumError(f"tensor {e.name!r}: checksum {got} does not match {e.checksum}; the file is "
                                    "corrupted, download or convert it again", tensor=e.name)

    def close(self) -> None:
        """Drop this object's reference to the bytes; the mapping is unmapped once no view handed
        out by array() is alive any more (closing it under a live view would crash its user)."""
        self.buffer, self.closed = np.zeros(0, np.uint8), True

    def __enter__(self) -> "CflowFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CflowFile({self.path!r}, order={self.order}, tensors={len(self.tensors)})"


def _load_buffer(path: str, size: int, mmap: bool) -> np.ndarray:
    if mmap:
        # a plain ndarray view of the mapping (views keep the mapping alive through .base)
        return np.asarray(np.memmap(path, dtype=np.uint8, mode="r", shape=(size,)))
    buf = np.empty(size, np.uint8)
    with open(path, "rb") as f:
        got = f.readinto(memoryview(buf))
    if got != size:
        raise TruncatedFileError(f"read {got} of {size} bytes from {path}; the file changed while reading")
    buf.flags.writeable = False
    return buf


def open_model(path: str | os.PathLike, *, verify: bool = False, mmap: bool = True,
               require_complete: bool = True) -> CflowFile:
    """Open and validate a `.cflow`/`.vflow` file. Every check runs before any tensor is handed out;
    `verify=True` also recomputes the checksums (reads every byte)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(PREAMBLE.size)
            flags, header_len = read_preamble(head, size)
            text = f.read(header_len)
    except FileNotFoundError:
        raise FormatError(f"no such file: {path}") from None
    except IsADirectoryError:
        raise FormatError(f"{path} is a directory, not a model file") from None
    if len(text) != header_len:
        raise TruncatedFileError(f"{path} changed while reading its header")
    h = parse_header(text)
    order, file_bytes, tile = check_top(h, flags, size)
    data_start = PREAMBLE.size + header_len
    entries: dict[str, TensorEntry] = {}
    for name, e in h["tensors"].items():
        if not name:
            raise HeaderSchemaError("a tensor has an empty name; the file is damaged")
        entries[name] = check_entry(name, e, data_start, file_bytes, tile)
    check_overlaps(entries)
    experts = check_experts(h["experts"], entries, data_start, file_bytes)
    cfg = check_config(h, entries, require_complete)
    cf = CflowFile(path, h, entries, cfg, experts, order, tile, header_len, _load_buffer(path, size, mmap))
    if verify:
        try:
            cf.verify()
        except BaseException:
            cf.close()
            raise
    return cf


def read_header(path: str | os.PathLike) -> dict:
    """The raw header dict after the preamble checks only (for tools that show damaged files)."""
    with open(os.fspath(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        _, header_len = read_preamble(f.read(PREAMBLE.size), size)
        return parse_header(f.read(header_len))


def summarize(cf: CflowFile) -> dict:
    """Bytes by category, expert table summary, alignment and order: what `cflow inspect` shows."""
    by_cat: dict[str, int] = {}
    for e in cf.tensors.values():
        by_cat[tensor_category(e.name)] = by_cat.get(tensor_category(e.name), 0) + e.nbytes
    ex = list(cf.experts.values())
    return {
        "path": cf.path, "order": cf.order, "version": cf.version, "file_bytes": int(cf.buffer.size),
        "header_bytes": cf.header_len, "data_start": cf.data_start, "tile": list(cf.tile),
        "n_tensors": len(cf.tensors), "bytes_by_category": by_cat,
        "experts": {"count": len(ex), "layers": len({k[0] for k in cf.experts}),
                    "min_bytes": min((n for _, n in ex), default=0), "max_bytes": max((n for _, n in ex), default=0),
                    "total_bytes": sum(n for _, n in ex)},
        "aligned": all(e.offset % ALIGN == 0 for e in cf.tensors.values())
        and all(o % ALIGN == 0 for o, _ in ex),
        "padding_bytes": int(cf.buffer.size) - cf.data_start - sum(e.nbytes for e in cf.tensors.values()),
    }
