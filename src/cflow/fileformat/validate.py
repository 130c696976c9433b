"""Validating a container's preamble and header before any byte of data is handed out: every
key, type, range, offset, size, overlap, expert block and the config are checked, and each
failure raises its own `FormatError` subclass saying what is wrong and what to do."""

from __future__ import annotations

import json
from typing import Any

from cflow import quant, weights
from cflow.config import ConfigError, ModelConfig
from cflow.fileformat.errors import (BadMagicError, DuplicateTensorError, ExpertTableError, FileTooShortError,
                                      FlagsError, FormatError, HeaderDecodeError, HeaderSchemaError,
                                      HeaderTooLargeError, InvalidConfigError, MisalignedOffsetError,
                                      MissingTensorError, OverlapError, ShapeMismatchError,
                                      TensorOutOfBoundsError, TrailingDataError, TruncatedFileError,
                                      UnknownDtypeError, UnknownLayoutError, UnsupportedVersionError)
from cflow.fileformat.layout import (MAX_INT, ALIGN, CHECKSUM_ALGO, CHECKSUM_HEX, FLAG_VFLOW, KNOWN_FLAGS, MAGIC,
                                      MAX_HEADER_BYTES, ORDERS, PREAMBLE, VERSION, TensorEntry, is_int, tile_ok,
                                      tile_problem)
from cflow.fileformat.tensors import (check_complete, check_mtp, expected_count, expected_shape, expert_of,
                                       model_tensors)


def _get(d: dict, key: str, types: type, where: str) -> Any:
    if key not in d:
        raise HeaderSchemaError(f"{where}: missing key {key!r}; the file is damaged or not a cflow file")
    v = d[key]
    if types is int:
        ok = is_int(v)
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
    if not 0 <= v <= MAX_INT:
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


def read_preamble(raw: bytes, size: int) -> tuple[int, int]:
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


def parse_header(text: bytes) -> dict:
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


def check_top(h: dict, flags: int, size: int) -> tuple[str, int, tuple[int, int]]:
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
    if not tile_ok(tile):
        raise HeaderSchemaError(f"quant tile {tile!r} must be two positive multiples of ({quant.G}, {quant.QK})")
    return order, file_bytes, (tile[0], tile[1])


def check_entry(name: str, e: Any, data_start: int, file_bytes: int,
                tile: tuple[int, int] = quant.TILE) -> TensorEntry:
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
    if len(shape) > 8 or not all(is_int(s) and 0 <= s <= MAX_INT for s in shape):
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
    problem = tile_problem(dtype, layout, tile)
    if problem:
        raise ShapeMismatchError(f"{where}: {problem}; the file is damaged")
    if expect != nbytes:
        raise ShapeMismatchError(f"{where}: {dtype} {tuple(shape)} {layout} takes {expect} bytes, the table says "
                                 f"{nbytes}; the file is damaged, convert it again")
    if offset % ALIGN:
        raise MisalignedOffsetError(f"{where}: offset {offset} is not a multiple of {ALIGN}; the file is damaged")
    if offset < data_start or offset + nbytes > file_bytes:
        raise TensorOutOfBoundsError(f"{where}: bytes [{offset}, {offset + nbytes}) are outside the data region "
                                     f"[{data_start}, {file_bytes}); the file is damaged")
    return TensorEntry(name, dtype, tuple(shape), layout, offset, nbytes, checksum, meta)


def check_overlaps(entries: dict[str, TensorEntry]) -> None:
    prev: TensorEntry | None = None
    for e in sorted(entries.values(), key=lambda e: (e.offset, e.nbytes)):
        if prev is not None and e.offset < prev.offset + prev.nbytes:
            raise OverlapError(f"tensors {prev.name!r} and {e.name!r} overlap at byte {e.offset}; the file is damaged")
        if e.nbytes:
            prev = e


def check_experts(raw: list, entries: dict[str, TensorEntry], data_start: int,
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


def check_config(h: dict, entries: dict[str, TensorEntry], require_complete: bool) -> ModelConfig:
    try:
        cfg = ModelConfig.from_dict(h["config"])
    except (ConfigError, TypeError, ValueError) as e:
        raise InvalidConfigError(f"the model config in the header is invalid: {e}") from None
    for name, e in entries.items():
        want = expected_shape(cfg, name)
        if want is not None and e.shape != want:
            raise ShapeMismatchError(f"tensor {name!r} has shape {e.shape} but the config needs {want}; "
                                     "the file is damaged")
    check_mtp(cfg, entries)
    if require_complete:
        split = weights.split_qkv_sets(entries)
        n = expected_count(cfg, split)
        if n > len(entries):
            raise MissingTensorError(f"the config needs {n} tensors but the file holds {len(entries)}; "
                                     "the file is damaged or incomplete, convert it again")
        check_complete(entries, model_tensors(cfg, split_qkv=split))
    return cfg
