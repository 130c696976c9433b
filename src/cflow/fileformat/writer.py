"""Writing a container: check every tensor against the config, plan offsets (the header holds
offsets that depend on its own length), then stream the data in file order into a temp file that
is fsynced and renamed over the target, so a crash never leaves a half-written model."""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Sequence

import numpy as np

from cflow import quant, weights
from cflow.config import ConfigError, ModelConfig
from cflow.fileformat.errors import (DuplicateTensorError, FormatError, HeaderSchemaError, HeaderTooLargeError,
                                      InvalidConfigError, ShapeMismatchError, UnknownDtypeError,
                                      UnknownLayoutError)
from cflow.fileformat.layout import (ALIGN, CHECKSUM_ALGO, CHECKSUM_HEX, FLAG_VFLOW, MAGIC, MAX_HEADER_BYTES,
                                      ORDERS, PREAMBLE, VERSION, ProgressFn, TensorData, WriteSummary, align_up,
                                      tensor_checksum, checksum_descriptor, tile_ok, tile_problem)
from cflow.fileformat.tensors import (check_complete, check_mtp, expected_shape, order_tensors, expert_of,
                                       model_tensors)
from cflow.fsutil import atomic_open


def _check_tensor(t: TensorData, cfg: ModelConfig) -> int:
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
    want = expected_shape(cfg, t.name)
    if want is not None and tuple(t.shape) != want:
        raise ShapeMismatchError(f"tensor {t.name!r} has shape {tuple(t.shape)} but the config needs "
                                 f"{want}; convert with the matching config")
    return nbytes


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


def _layout_plan(items: list[TensorData], sizes: dict[str, int], data_start: int) -> tuple[dict[str, int], int]:
    offsets, pos = {}, data_start
    for t in items:
        offsets[t.name] = pos
        pos = align_up(pos + sizes[t.name])
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
    if os.path.isdir(path):  # found now, not after the whole model has been encoded
        raise FormatError(f"{os.fspath(path)} is a directory; give the model file's name, e.g. "
                          f"{os.path.join(os.fspath(path), 'model.cflow')}")
    if order not in ORDERS:
        raise FormatError(f"order must be one of {list(ORDERS)}, got {order!r}")
    try:
        cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_dict(dict(config))
    except ConfigError as e:
        raise InvalidConfigError(f"cannot write a model with an invalid config: {e}") from None
    tile = (int(tile[0]), int(tile[1]))
    if not tile_ok(tile):
        raise FormatError(f"tile must be positive multiples of ({quant.G}, {quant.QK}), got {tile}")
    items, sizes = [], {}
    for t in tensors:  # consumes a generator; data callables are not called yet
        meta = _json_roundtrip(t.meta or {}, f"tensor {t.name!r} meta")  # exactly what a reader will see
        t = TensorData(t.name, t.dtype, tuple(int(s) for s in t.shape), t.layout, t.data, meta)
        if t.name in sizes:
            raise DuplicateTensorError(f"tensor {t.name!r} was given twice; names must be unique")
        sizes[t.name] = _check_tensor(t, cfg)
        problem = tile_problem(t.dtype, t.layout, tile)
        if problem:
            raise FormatError(f"tensor {t.name!r}: {problem}; write the file with a tile whose columns are "
                              f"a multiple of 256 (the default 128x256 is)")
        items.append(t)
    check_mtp(cfg, sizes)
    if require_complete:
        check_complete(sizes, model_tensors(cfg, split_qkv=weights.split_qkv_sets(sizes)))
    items = order_tensors(items, cfg, order)
    cfg_dict, metadata = cfg.to_dict(), dict(metadata or {})
    # optional fields at their default are left out: such files stay what older cflow wrote, which
    # older readers accept
    if not cfg.mtp_heads:
        del cfg_dict["mtp_heads"]
    if not cfg.rope_freq_factors:
        del cfg_dict["rope_freq_factors"]
    if cfg.rope_mscale == 1.0:
        del cfg_dict["rope_mscale"]
    for key, default in (("sliding_window_pattern", 0), ("rope_theta_local", 0.0), ("attn_scale", 0.0),
                         ("embed_scale", 1.0), ("post_norms", False), ("ffn_act", "silu"), ("attn_temp_scale", 0.0),
                         ("attn_temp_floor", 0), ("attn_sinks", False), ("attn_out_bias", False), ("moe_bias", False),
                         ("moe_gating", "softmax"), ("expert_act", "silu"), ("kv_lora_rank", 0), ("q_lora_rank", 0),
                         ("qk_rope_dim", 0), ("v_head_dim", 0), ("n_dense_lead", 0), ("moe_router_bias", False),
                         ("moe_groups", 0), ("moe_groups_used", 0), ("moe_weights_scale", 1.0),
                         ("shared_expert_gate", True), ("head_dim_local", 0), ("n_kv_heads_local", 0),
                         ("shared_kv_layers", 0),
                         ("d_ff_shared_kv", 0), ("v_norm", False), ("per_layer_dim", 0), ("layer_out_scale", False),
                         ("logit_softcap", 0.0), ("moe_router_norm", False), ("expert_scale", False),
                         ("moe_out_norms", False), ("full_attn_interval", 0), ("ssm_k_heads", 0),
                         ("ssm_v_heads", 0), ("ssm_head_dim", 0), ("ssm_conv_kernel", 0), ("rope_dims", 0),
                         ("attn_out_gate", False)):
        if cfg_dict[key] == default:
            del cfg_dict[key]

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
        need = align_up(PREAMBLE.size + len(text))
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
            checks[t.name] = tensor_checksum(checksum_descriptor(t.name, t.dtype, t.shape, t.layout, t.meta), arr)
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
