"""The `.cflow` / `.vflow` container: write, read, validate, named errors (docs/FORMAT.md).

Owns the byte layout of a model file:

    preamble  24 bytes   magic b"\\x89CFLOW\\r\\n", u32 version, u32 flags (bit 0: vflow order),
                         u64 header length (all little-endian)
    header    JSON       config, tokenizer, quant/tile geometry, tensor table, expert table,
                         metadata; padded with spaces so the data starts on a 4096-byte boundary
    data                 every tensor (and so every expert block) starts on a 4096-byte boundary

`.cflow` orders the data layer by layer; `.vflow` in the order `cflow.dag.schedule(cfg)` runs the
decode step. Either way each expert's tensors are contiguous, so one expert is one aligned read.

Writes are atomic (temp file beside the target, fsync, rename). The reader validates everything
before handing out a byte, and each failure is its own `FormatError` subclass. Checksums are
xxh3_64 (fast enough to verify a model at memory speed) over the tensor's descriptor (name, dtype, shape, layout,
meta) followed by its bytes, so `verify=True` also catches a tensor table edited behind the data.

No torch here: the runtime imports this module.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import xxhash

from cflow import quant
from cflow.config import ConfigError, ModelConfig
from cflow.errors import CflowError
from cflow.fsutil import atomic_open

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
_MAX_INT = (1 << 63) - 1  # every size and offset must fit an int64 (the C core's off_t)

ProgressFn = Callable[[int, int, str], None]  # (bytes written, total bytes, tensor name)


# ---- errors --------------------------------------------------------------------------------
class FormatError(CflowError, ValueError):
    """A model file (or a write request) is not a valid cflow container."""


class FileTooShortError(FormatError):
    """The file is shorter than the 24-byte preamble."""


class BadMagicError(FormatError):
    """The file does not start with the cflow magic bytes."""


class UnsupportedVersionError(FormatError):
    """The format version is not one this cflow reads."""


class FlagsError(FormatError):
    """Unknown flag bits are set, or the flags disagree with the header's order."""


class HeaderTooLargeError(FormatError):
    """The declared header length exceeds the cap."""


class TruncatedFileError(FormatError):
    """The file ends before the header or the data it declares."""


class TrailingDataError(FormatError):
    """The file is longer than the header declares."""


class HeaderDecodeError(FormatError):
    """The header is not UTF-8 JSON object text (or repeats a key)."""


class HeaderSchemaError(FormatError):
    """A header key is missing, unknown, or of the wrong type or range."""


class InvalidConfigError(FormatError):
    """The model config in the header is inconsistent."""


class UnknownDtypeError(FormatError):
    """A tensor's dtype is not one cflow knows."""


class UnknownLayoutError(FormatError):
    """A tensor's layout is not one cflow knows."""


class ShapeMismatchError(FormatError):
    """A tensor's byte size disagrees with dtype x shape x layout, or its shape with the config."""


class MisalignedOffsetError(FormatError):
    """A tensor or expert block does not start on a 4096-byte boundary."""


class TensorOutOfBoundsError(FormatError):
    """A tensor or expert block lies (partly) outside the data region."""


class OverlapError(FormatError):
    """Two tensors share bytes."""


class DuplicateTensorError(FormatError):
    """Two tensors have the same name."""


class MissingTensorError(FormatError, KeyError):
    """A tensor the model needs (or the caller asked for) is not in the file."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ExpertTableError(FormatError):
    """The expert offset table disagrees with the expert tensors."""


class ChecksumError(FormatError):
    """A tensor's bytes (or descriptor) do not match its checksum."""


# ---- data model ----------------------------------------------------------------------------
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


# ---- canonical tensors and their orders ----------------------------------------------------
def _layer_tensors(cfg: ModelConfig, i: int,
                   experts: Iterable[int] | None = None) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Tensors of weight set i (and of the given experts, default all), grouped by the decode-step
    node that reads them."""
    d, p = cfg.d_model, f"layers.{i}."
    groups: dict[str, list[tuple[str, tuple[int, ...]]]] = {
        "attn": [(p + "attn_norm", (d,)), (p + "attn.wqkv", (cfg.q_dim + 2 * cfg.kv_dim, d)),
                 (p + "attn.wo", (d, cfg.q_dim))],
        "dense": [], "router": [], "experts": [],
    }
    if cfg.has_dense:
        groups["dense"] = [(p + "ffn_norm", (d,)), (p + "ffn.w_gate_up", (2 * cfg.d_ff, d)),
                           (p + "ffn.w_down", (d, cfg.d_ff))]
    if cfg.has_moe:
        groups["router"] = [(p + "moe_norm", (d,)), (p + "moe.router", (cfg.n_experts, d))]
        for e in range(cfg.n_experts) if experts is None else experts:
            q = f"{p}moe.experts.{e}."
            groups["experts"] += [(q + "w_gate_up", (2 * cfg.d_expert, d)), (q + "w_down", (d, cfg.d_expert))]
    return groups


def expected_count(cfg: ModelConfig) -> int:
    """How many tensors `model_tensors(cfg)` lists (computed without building it: a damaged header
    may claim billions of layers)."""
    per_layer = 3 + 3 * cfg.has_dense + (2 + 2 * cfg.n_experts) * cfg.has_moe
    return 2 + cfg.n_unique_layers * per_layer + (not cfg.tie_embeddings)


def expected_shape(cfg: ModelConfig, name: str) -> tuple[int, ...] | None:
    """The shape the config implies for a canonical tensor name; None for any other name."""
    if name in ("tok_emb", "lm_head", "norm"):
        return model_tensors(cfg, layers=False).get(name)
    parts = name.split(".")
    i = _index(parts[1]) if len(parts) >= 3 and parts[0] == "layers" else None
    if i is None or i >= cfg.n_unique_layers:
        return None
    key = expert_of(name)
    experts = [key[1]] if key is not None and key[1] < cfg.n_experts else []
    groups = _layer_tensors(cfg, i, experts)
    return dict(sum(groups.values(), [])).get(name)


def model_tensors(cfg: ModelConfig, layers: bool = True) -> dict[str, tuple[int, ...]]:
    """The tensors a model of this config stores, name -> shape, in `.cflow` (layer-major) order
    (layers=False: only the ones outside the layers)."""
    out = {"tok_emb": (cfg.vocab_size, cfg.d_model)}
    for i in range(cfg.n_unique_layers if layers else 0):
        for group in _layer_tensors(cfg, i).values():
            out.update(group)
    out["norm"] = (cfg.d_model,)
    if not cfg.tie_embeddings:
        out["lm_head"] = (cfg.vocab_size, cfg.d_model)
    return out


def node_tensors(cfg: ModelConfig, node: str) -> list[str]:
    """Tensor names one decode-step DAG node reads ("embed", "L{l}.attn", "L{l}.dense",
    "L{l}.router", "L{l}.experts", "lm_head"); layer l reads weight set l % n_unique_layers."""
    if node == "embed":
        return ["tok_emb"]
    if node == "lm_head":
        return ["norm", "tok_emb" if cfg.tie_embeddings else "lm_head"]
    layer, _, kind = node.partition(".")
    l = _index(layer[1:]) if layer[:1] == "L" else None
    if l is None or kind not in ("attn", "dense", "router", "experts"):
        raise FormatError(f"unknown DAG node {node!r}; expected embed, L<l>.attn|dense|router|experts, lm_head")
    return [n for n, _ in _layer_tensors(cfg, cfg.weight_layer(l))[kind]]


def _flatten_nodes(obj: Any) -> list[str]:
    # dag.schedule may return node names, node objects with .name, or stages (lists) of either.
    if isinstance(obj, str):
        return [obj]
    if hasattr(obj, "name") and isinstance(obj.name, str):
        return [obj.name]
    for attr in ("stages", "nodes", "order"):
        if hasattr(obj, attr) and not callable(getattr(obj, attr)):
            return _flatten_nodes(getattr(obj, attr))
    return [n for item in obj for n in _flatten_nodes(item)]


def schedule_order(cfg: ModelConfig) -> list[str]:
    """Tensor names in `.vflow` order: each at its first use in `cflow.dag.schedule(cfg)`."""
    try:
        from cflow import dag  # imported late: only vflow writing needs the scheduler
    except ImportError as e:
        raise FormatError(f"writing .vflow needs the scheduler (cflow.dag), which failed to import: {e}") from None

    seen: dict[str, None] = {}
    for node in _flatten_nodes(dag.schedule(cfg)):
        for name in node_tensors(cfg, node):
            seen.setdefault(name, None)
    return list(seen)


def _order_tensors(items: list[TensorData], cfg: ModelConfig, order: str) -> list[TensorData]:
    canon = schedule_order(cfg) if order == "vflow" else list(model_tensors(cfg))
    placed = set(canon)
    canon += [n for n in model_tensors(cfg) if n not in placed]  # anything the schedule skipped
    rank = {n: k for k, n in enumerate(canon)}
    # Unknown names go last in the order given (sorted() is stable).
    return sorted(items, key=lambda t: rank.get(t.name, len(rank)))


def tensor_category(name: str) -> str:
    """Byte-accounting category: embeddings, attention, dense, router, experts, norms, other."""
    if name in ("tok_emb", "lm_head"):
        return "embeddings"
    if name == "norm" or name.endswith("_norm"):
        return "norms"
    for key, cat in ((".attn.", "attention"), (".ffn.", "dense"), (".moe.experts.", "experts"),
                     (".moe.router", "router")):
        if key in name:
            return cat
    return "other"


def _index(s: str) -> int | None:
    # a canonical decimal index ("0", "17"; not "07", "²" or "-1")
    return int(s) if s.isascii() and s.isdigit() and str(int(s)) == s else None


def expert_of(name: str) -> tuple[int, int] | None:
    """(weight layer, expert) for `layers.{i}.moe.experts.{e}.*`, else None."""
    parts = name.split(".")
    if len(parts) >= 5 and parts[0] == "layers" and parts[2:4] == ["moe", "experts"]:
        i, e = _index(parts[1]), _index(parts[4])
        if i is not None and e is not None:
            return i, e
    return None


# ---- checksums -----------------------------------------------------------------------------
def _descriptor(name: str, dtype: str, shape: Sequence[int], layout: str, meta: dict) -> bytes:
    d = {"name": name, "dtype": dtype, "shape": list(shape), "layout": layout, "meta": meta}
    return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _checksum(desc: bytes, data: np.ndarray | memoryview) -> str:
    h = xxhash.xxh3_64()
    h.update(desc)
    h.update(data)
    return f"{CHECKSUM_ALGO}:{h.hexdigest()}"


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ---- writer --------------------------------------------------------------------------------
def _check_tensor(t: TensorData, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> int:
    if not isinstance(t.name, str) or not t.name:
        raise HeaderSchemaError(f"tensor names must be non-empty strings, got {t.name!r}")
    if t.dtype not in quant.DTYPE_IDS:
        raise UnknownDtypeError(f"tensor {t.name!r}: unknown dtype {t.dtype!r}; use one of {list(quant.DTYPES)}")
    if t.layout not in quant.LAYOUTS:
        raise UnknownLayoutError(f"tensor {t.name!r}: unknown layout {t.layout!r}; use one of {list(quant.LAYOUTS)}")
    try:
        nbytes = quant.tensor_nbytes(t.dtype, t.shape, t.layout)
    except quant.QuantError as e:
        raise ShapeMismatchError(f"tensor {t.name!r}: {e}") from None
    want = shapes.get(t.name)
    if want is not None and tuple(t.shape) != want:
        raise ShapeMismatchError(f"tensor {t.name!r} has shape {tuple(t.shape)} but the config needs "
                                 f"{want}; convert with the matching config")
    return nbytes


def _check_complete(names: Iterable[str], shapes: dict[str, tuple[int, ...]]) -> None:
    have = set(names)
    missing = [n for n in shapes if n not in have]
    if missing:
        raise MissingTensorError(f"the model needs {len(missing)} tensor(s) the file does not hold, e.g. "
                                 f"{missing[:3]}; re-convert the model")


def _build_header(cfg_dict: dict, tokenizer: dict, metadata: dict, order: str, tile: tuple[int, int],
                  entries: list[dict], experts: list[dict], file_bytes: int) -> dict:
    return {
        "format": "cflow", "version": VERSION, "order": order, "alignment": ALIGN, "file_bytes": file_bytes,
        "config": cfg_dict, "tokenizer": tokenizer,
        "quant": {"block": quant.QK, "group": quant.G, "tile": list(tile), "checksum": CHECKSUM_ALGO},
        "tensors": {e["name"]: {k: v for k, v in e.items() if k != "name"} for e in entries},
        "experts": experts, "metadata": metadata,
    }


def _dumps(obj: Any, what: str = "the header") -> bytes:
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:
        raise FormatError(f"{what} must be plain JSON data (str, int, finite float, bool, None, list, "
                          f"dict with str keys): {e}") from None


def _json_roundtrip(obj: Any, what: str) -> Any:
    if not isinstance(obj, dict):
        raise FormatError(f"{what} must be a dict, got {type(obj).__name__}")
    return json.loads(_dumps(obj, what))


def _tile_ok(tile: Sequence[int]) -> bool:
    return (len(tile) == 2 and all(_is_int(t) for t in tile) and 0 < tile[0] <= 1 << 20 and tile[0] % quant.G == 0
            and 0 < tile[1] <= 1 << 20 and tile[1] % quant.QK == 0)


def _layout_plan(items: list[TensorData], sizes: dict[str, int], data_start: int) -> tuple[dict[str, int], int]:
    offsets, pos = {}, data_start
    for t in items:
        offsets[t.name] = pos
        pos = _align(pos + sizes[t.name])
    return offsets, pos  # file ends padded to ALIGN so an O_DIRECT read of the last block stays inside


def _expert_table(items: list[TensorData], offsets: dict[str, int], sizes: dict[str, int]) -> list[dict]:
    spans: dict[tuple[int, int], list[int]] = {}
    for t in items:
        key = expert_of(t.name)
        if key is not None:
            a, b = offsets[t.name], offsets[t.name] + sizes[t.name]
            s = spans.setdefault(key, [a, b])
            s[0], s[1] = min(s[0], a), max(s[1], b)
    return [{"layer": k[0], "expert": k[1], "offset": a, "nbytes": b - a} for k, (a, b) in sorted(spans.items())]


def _tensor_bytes(t: TensorData, nbytes: int) -> np.ndarray:
    data = t.data() if callable(t.data) else t.data
    arr = np.asarray(data)
    if arr.dtype != np.uint8:
        raise FormatError(f"tensor {t.name!r}: data must be uint8 bytes already encoded as {t.dtype}/{t.layout}, "
                          f"got {arr.dtype}; encode it with cflow.quant first")
    if arr.size != nbytes:
        raise ShapeMismatchError(f"tensor {t.name!r}: {t.dtype} {tuple(t.shape)} {t.layout} is {nbytes} bytes, "
                                 f"but its data has {arr.size}")
    return np.ascontiguousarray(arr).reshape(-1)


def write_model(path: str | os.PathLike, *, config: dict | ModelConfig, tokenizer: dict,
                tensors: Iterable[TensorData], order: str = "cflow", tile: Sequence[int] = quant.TILE,
                metadata: dict | None = None, progress: ProgressFn | None = None,
                require_complete: bool = True) -> WriteSummary:
    """Write a model container atomically. Tensor metadata is planned first; data (arrays, or
    callables producing them) is then streamed in file order, each checksummed as it is written."""
    if order not in ORDERS:
        raise FormatError(f"order must be one of {list(ORDERS)}, got {order!r}")
    try:
        cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_dict(dict(config))
    except ConfigError as e:
        raise InvalidConfigError(f"cannot write a model with an invalid config: {e}") from None
    tile = (int(tile[0]), int(tile[1]))
    if not _tile_ok(tile):
        raise FormatError(f"tile must be positive multiples of ({quant.G}, {quant.QK}), got {tile}")
    shapes = model_tensors(cfg)
    items, sizes = [], {}
    for t in tensors:  # consumes a generator; data callables are not called yet
        meta = _json_roundtrip(t.meta or {}, f"tensor {t.name!r} meta")  # exactly what a reader will see
        t = TensorData(t.name, t.dtype, tuple(int(s) for s in t.shape), t.layout, t.data, meta)
        if t.name in sizes:
            raise DuplicateTensorError(f"tensor {t.name!r} was given twice; names must be unique")
        sizes[t.name] = _check_tensor(t, cfg, shapes)
        items.append(t)
    if require_complete:
        _check_complete(sizes, shapes)
    items = _order_tensors(items, cfg, order)
    cfg_dict, metadata = cfg.to_dict(), dict(metadata or {})

    # The header holds offsets that depend on the header's own length: iterate to a fixed point.
    data_start, checks = ALIGN, {t.name: f"{CHECKSUM_ALGO}:{'0' * CHECKSUM_HEX}" for t in items}
    while True:
        offsets, end = _layout_plan(items, sizes, data_start)
        entries = [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "layout": t.layout,
                    "offset": offsets[t.name], "nbytes": sizes[t.name], "checksum": checks[t.name],
                    "meta": t.meta} for t in items]
        header = _build_header(cfg_dict, tokenizer, metadata, order, tile, entries,
                               _expert_table(items, offsets, sizes), end)
        text = _dumps(header)
        need = _align(PREAMBLE.size + len(text))
        if need <= data_start:
            break
        data_start = need
    header_len = data_start - PREAMBLE.size
    if header_len > MAX_HEADER_BYTES:
        raise HeaderTooLargeError(f"the header would be {header_len} bytes, over the {MAX_HEADER_BYTES >> 20} MiB "
                                  "readers accept; move bulky metadata out of the model file")
    flags = FLAG_VFLOW if order == "vflow" else 0
    total = sum(sizes.values())

    with atomic_open(path, "wb") as f:
        f.write(PREAMBLE.pack(MAGIC, VERSION, flags, header_len))
        f.write(b" " * header_len)  # placeholder: checksums are known only after the data
        done = 0
        for t in items:
            arr = _tensor_bytes(t, sizes[t.name])
            f.seek(offsets[t.name])
            f.write(memoryview(arr))
            checks[t.name] = _checksum(_descriptor(t.name, t.dtype, t.shape, t.layout, t.meta), arr)
            done += arr.size
            if progress is not None:
                progress(done, total, t.name)
        f.truncate(end)
        for e in entries:
            e["checksum"] = checks[e["name"]]
        header["tensors"] = {e["name"]: {k: v for k, v in e.items() if k != "name"} for e in entries}
        text = _dumps(header)
        if len(text) > header_len:  # checksums have a fixed width, so this cannot grow
            raise FormatError("internal error: header grew after checksums were filled in")
        f.seek(PREAMBLE.size)
        f.write(text + b" " * (header_len - len(text)))
    return WriteSummary(str(path), order, end, header_len, total, end - data_start - total, len(items),
                        len(header["experts"]))


# ---- reader: validation --------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _get(d: dict, key: str, types: type, where: str) -> Any:
    if key not in d:
        raise HeaderSchemaError(f"{where}: missing key {key!r}; the file is damaged or not a cflow file")
    v = d[key]
    if types is int:
        ok = _is_int(v)
    elif types is bool:
        ok = isinstance(v, bool)
    else:
        ok = isinstance(v, types)
    if not ok:
        raise HeaderSchemaError(f"{where}: key {key!r} has the wrong type ({type(v).__name__}, expected "
                                f"{types.__name__}); the file is damaged, convert the model again")
    return v


def _get_count(d: dict, key: str, where: str) -> int:
    v = _get(d, key, int, where)
    if not 0 <= v <= _MAX_INT:
        raise HeaderSchemaError(f"{where}: {key}={v} is out of range; the file is damaged")
    return v


def _only_keys(d: dict, keys: set[str], where: str) -> None:
    extra = sorted(set(d) - keys)
    if extra:
        raise HeaderSchemaError(f"{where}: unknown key(s) {extra}; the file may come from a newer cflow, upgrade")


def _no_dup_pairs(pairs: list[tuple[str, Any]]) -> dict:
    d: dict = {}
    for k, v in pairs:
        if k in d:
            if isinstance(v, dict) and "offset" in v and "dtype" in v:
                raise DuplicateTensorError(f"the tensor table lists {k!r} twice; the file is damaged, convert it again")
            raise HeaderDecodeError(f"the header repeats the key {k!r}; the file is damaged, convert it again")
        d[k] = v
    return d


def _reject_constant(name: str) -> None:
    raise HeaderDecodeError(f"the header contains {name}, which is not JSON; the file is damaged")


def _read_preamble(raw: bytes, size: int) -> tuple[int, int]:
    if size < PREAMBLE.size:
        raise FileTooShortError(f"the file is {size} bytes, shorter than the {PREAMBLE.size}-byte preamble; "
                                "it is empty or cut short, download or convert it again")
    magic, version, flags, header_len = PREAMBLE.unpack(raw[:PREAMBLE.size])
    if magic != MAGIC:
        hint = ""
        if raw[:1] in (b"<", b"{") or raw[:9].lower().startswith((b"<!doctype", b"<html")):
            hint = " It looks like text (an HTML error page or JSON?), not a model download."
        elif raw.startswith(b"version https://git-lfs"):
            hint = " It is a git-lfs pointer: run `git lfs pull` to fetch the real file."
        elif raw.startswith(b"GGUF"):
            hint = " It is a GGUF file: convert it with `cflow convert FILE.gguf OUT.cflow`."
        raise BadMagicError(f"not a cflow model file (magic {magic!r}, expected {MAGIC!r}).{hint}")
    if version != VERSION:
        raise UnsupportedVersionError(f"format version {version} is not supported (this cflow reads version "
                                      f"{VERSION}); upgrade cflow or re-convert the model")
    if flags & ~KNOWN_FLAGS:
        raise FlagsError(f"unknown flag bits 0x{flags & ~KNOWN_FLAGS:x} are set; the file comes from a newer "
                         "cflow or is damaged")
    if header_len > MAX_HEADER_BYTES:
        raise HeaderTooLargeError(f"the header claims {header_len} bytes, over the {MAX_HEADER_BYTES >> 20} MiB "
                                  "cap; the file is damaged")
    if (PREAMBLE.size + header_len) % ALIGN:
        raise MisalignedOffsetError(f"the header length {header_len} does not end the header on a {ALIGN}-byte "
                                    "boundary, where the data must start; the file is damaged")
    if PREAMBLE.size + header_len > size:
        raise TruncatedFileError(f"the header runs to byte {PREAMBLE.size + header_len} but the file has only "
                                 f"{size}; the file is cut short, download or copy it again")
    return flags, header_len


def _parse_header(text: bytes) -> dict:
    try:
        s = text.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderDecodeError(f"the header is not UTF-8 ({e.reason} at byte {e.start}); "
                                "the file is damaged") from None
    try:
        h = json.loads(s, object_pairs_hook=_no_dup_pairs, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise HeaderDecodeError(f"the header is not valid JSON ({e.msg} at char {e.pos}); the file is damaged, "
                                "convert it again") from None
    except FormatError:
        raise
    except RecursionError:
        raise HeaderDecodeError("the header nests too deeply; the file is damaged") from None
    except ValueError as e:  # e.g. an integer literal beyond Python's digit limit
        raise HeaderDecodeError(f"the header holds an unreadable value ({e}); the file is damaged") from None
    if not isinstance(h, dict):
        raise HeaderDecodeError("the header must be a JSON object; the file is damaged")
    return h


HEADER_KEYS = {"format", "version", "order", "alignment", "file_bytes", "config", "tokenizer", "quant",
               "tensors", "experts", "metadata"}
TENSOR_KEYS = {"dtype", "shape", "layout", "offset", "nbytes", "checksum", "meta"}
EXPERT_KEYS = {"layer", "expert", "offset", "nbytes"}


def _check_top(h: dict, flags: int, size: int) -> tuple[str, int, tuple[int, int]]:
    _only_keys(h, HEADER_KEYS, "header")
    if _get(h, "format", str, "header") != "cflow":
        raise HeaderSchemaError(f"header format is {h['format']!r}, expected 'cflow'")
    if _get(h, "version", int, "header") != VERSION:
        raise HeaderSchemaError(f"header version {h['version']} disagrees with the preamble's {VERSION}")
    order = _get(h, "order", str, "header")
    if order not in ORDERS:
        raise HeaderSchemaError(f"header order {order!r} is not one of {list(ORDERS)}")
    if (order == "vflow") != bool(flags & FLAG_VFLOW):
        raise FlagsError(f"the preamble flags (0x{flags:x}) disagree with the header order {order!r}; "
                         "the file is damaged")
    if _get(h, "alignment", int, "header") != ALIGN:
        raise HeaderSchemaError(f"alignment {h['alignment']} is not {ALIGN}")
    file_bytes = _get_count(h, "file_bytes", "header")
    if size < file_bytes:
        raise TruncatedFileError(f"the file is {size} bytes but its header says {file_bytes}; it is cut short, "
                                 "download or copy it again")
    if size > file_bytes:
        raise TrailingDataError(f"the file is {size} bytes but its header says {file_bytes}; something was "
                                "appended or the header is damaged")
    for key in ("config", "tokenizer", "quant", "tensors", "metadata"):
        _get(h, key, dict, "header")
    _get(h, "experts", list, "header")
    q = h["quant"]
    _only_keys(q, {"block", "group", "tile", "checksum"}, "header.quant")
    if _get(q, "block", int, "quant") != quant.QK or _get(q, "group", int, "quant") != quant.G:
        raise HeaderSchemaError(f"quant block/group ({q['block']}, {q['group']}) are not ({quant.QK}, {quant.G})")
    if _get(q, "checksum", str, "quant") != CHECKSUM_ALGO:
        raise HeaderSchemaError(f"checksum algorithm {q['checksum']!r} is not {CHECKSUM_ALGO!r}")
    tile = _get(q, "tile", list, "quant")
    if not _tile_ok(tile):
        raise HeaderSchemaError(f"quant tile {tile!r} must be two positive multiples of ({quant.G}, {quant.QK})")
    return order, file_bytes, (tile[0], tile[1])


def _check_entry(name: str, e: Any, data_start: int, file_bytes: int) -> TensorEntry:
    where = f"tensor {name!r}"
    if not isinstance(e, dict):
        raise HeaderSchemaError(f"{where}: entry must be an object")
    _only_keys(e, TENSOR_KEYS, where)
    dtype, layout = _get(e, "dtype", str, where), _get(e, "layout", str, where)
    if dtype not in quant.DTYPE_IDS:
        raise UnknownDtypeError(f"{where}: unknown dtype {dtype!r} (known: {list(quant.DTYPES)}); "
                                "the file needs a newer cflow or is damaged")
    if layout not in quant.LAYOUTS:
        raise UnknownLayoutError(f"{where}: unknown layout {layout!r} (known: {list(quant.LAYOUTS)})")
    shape = _get(e, "shape", list, where)
    if len(shape) > 8 or not all(_is_int(s) and 0 <= s <= _MAX_INT for s in shape):
        raise HeaderSchemaError(f"{where}: shape {shape!r} must be at most 8 non-negative integers")
    offset, nbytes = _get_count(e, "offset", where), _get_count(e, "nbytes", where)
    checksum, meta = _get(e, "checksum", str, where), _get(e, "meta", dict, where)
    prefix = CHECKSUM_ALGO + ":"
    if len(checksum) != len(prefix) + CHECKSUM_HEX or not checksum.startswith(prefix) \
            or any(c not in "0123456789abcdef" for c in checksum[len(prefix):]):
        raise HeaderSchemaError(f"{where}: checksum {checksum!r} is not {prefix!r} and {CHECKSUM_HEX} hex digits")
    try:
        expect = quant.tensor_nbytes(dtype, shape, layout)
    except quant.QuantError as err:
        raise ShapeMismatchError(f"{where}: {err}; the file is damaged") from None
    if expect != nbytes:
        raise ShapeMismatchError(f"{where}: {dtype} {tuple(shape)} {layout} takes {expect} bytes, the table says "
                                 f"{nbytes}; the file is damaged, convert it again")
    if offset % ALIGN:
        raise MisalignedOffsetError(f"{where}: offset {offset} is not a multiple of {ALIGN}; the file is damaged")
    if offset < data_start or offset + nbytes > file_bytes:
        raise TensorOutOfBoundsError(f"{where}: bytes [{offset}, {offset + nbytes}) are outside the data region "
                                     f"[{data_start}, {file_bytes}); the file is damaged")
    return TensorEntry(name, dtype, tuple(shape), layout, offset, nbytes, checksum, meta)


def _check_overlaps(entries: dict[str, TensorEntry]) -> None:
    prev: TensorEntry | None = None
    for e in sorted(entries.values(), key=lambda e: (e.offset, e.nbytes)):
        if prev is not None and e.offset < prev.offset + prev.nbytes:
            raise OverlapError(f"tensors {prev.name!r} and {e.name!r} overlap at byte {e.offset}; the file is damaged")
        if e.nbytes:
            prev = e


def _check_experts(raw: list, entries: dict[str, TensorEntry], data_start: int,
                   file_bytes: int) -> dict[tuple[int, int], tuple[int, int]]:
    table: dict[tuple[int, int], tuple[int, int]] = {}
    for k, x in enumerate(raw):
        where = f"expert table entry {k}"
        if not isinstance(x, dict):
            raise HeaderSchemaError(f"{where}: must be an object")
        _only_keys(x, EXPERT_KEYS, where)
        key = (_get_count(x, "layer", where), _get_count(x, "expert", where))
        off, n = _get_count(x, "offset", where), _get_count(x, "nbytes", where)
        if off % ALIGN:
            raise MisalignedOffsetError(f"{where}: expert {key} starts at {off}, not a multiple of {ALIGN}")
        if off < data_start or off + n > file_bytes:
            raise TensorOutOfBoundsError(f"{where}: expert {key} bytes [{off}, {off + n}) lie outside the data region")
        if key in table:
            raise ExpertTableError(f"expert (layer {key[0]}, expert {key[1]}) is listed twice; the file is damaged")
        table[key] = (off, n)
    # The table is derived from the tensors: each expert block is exactly the span of its tensors.
    spans: dict[tuple[int, int], tuple[int, int]] = {}
    for e in entries.values():
        key = expert_of(e.name)
        if key is not None:
            a, b = spans.get(key, (e.offset, e.offset + e.nbytes))
            spans[key] = (min(a, e.offset), max(b, e.offset + e.nbytes))
    expect = {k: (a, b - a) for k, (a, b) in spans.items()}
    if table != expect:
        bad = sorted(set(table.items()) ^ set(expect.items()))[:2]
        raise ExpertTableError(f"the expert table disagrees with the expert tensors (e.g. {bad}); the file is "
                               "damaged, convert it again")
    return table


def _check_config(h: dict, entries: dict[str, TensorEntry], require_complete: bool) -> ModelConfig:
    try:
        cfg = ModelConfig.from_dict(h["config"])
    except (ConfigError, TypeError, ValueError) as e:
        raise InvalidConfigError(f"the model config in the header is invalid: {e}") from None
    for name, e in entries.items():
        want = expected_shape(cfg, name)
        if want is not None and e.shape != want:
            raise ShapeMismatchError(f"tensor {name!r} has shape {e.shape} but the config needs {want}; "
                                     "the file is damaged")
    if require_complete:
        n = expected_count(cfg)
        if n > len(entries):
            raise MissingTensorError(f"the config needs {n} tensors but the file holds {len(entries)}; "
                                     "the file is damaged or incomplete, convert it again")
        _check_complete(entries, model_tensors(cfg))
    return cfg


# ---- reader: the open file -----------------------------------------------------------------
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
            got = _checksum(_descriptor(e.name, e.dtype, e.shape, e.layout, e.meta), self.array(e.name))
            if got != e.checksum:
                raise ChecksumError(f"tensor {e.name!r}: checksum {got} does not match {e.checksum}; the file is "
                                    "corrupted, download or convert it again")

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
            flags, header_len = _read_preamble(head, size)
            text = f.read(header_len)
    except FileNotFoundError:
        raise FormatError(f"no such file: {path}") from None
    except IsADirectoryError:
        raise FormatError(f"{path} is a directory, not a model file") from None
    if len(text) != header_len:
        raise TruncatedFileError(f"{path} changed while reading its header")
    h = _parse_header(text)
    order, file_bytes, tile = _check_top(h, flags, size)
    data_start = PREAMBLE.size + header_len
    entries: dict[str, TensorEntry] = {}
    for name, e in h["tensors"].items():
        if not name:
            raise HeaderSchemaError("a tensor has an empty name; the file is damaged")
        entries[name] = _check_entry(name, e, data_start, file_bytes)
    _check_overlaps(entries)
    experts = _check_experts(h["experts"], entries, data_start, file_bytes)
    cfg = _check_config(h, entries, require_complete)
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
        _, header_len = _read_preamble(f.read(PREAMBLE.size), size)
        return _parse_header(f.read(header_len))


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
