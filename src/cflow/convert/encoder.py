"""Encoding a model's weights into `.cflow` tensors, shared by every converter.

Owns the step between "a source hands us weight matrices" and "the writer gets TensorData":
- which dtype each matrix is stored in (blocks already in a format the engine runs (Q4_0, Q4_1,
  Q8_0, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, MXFP4) pass through bit for bit; float weights are
  quantized to the requested format; other quantized formats are refused unless re-quantizing was asked for);
- the fused layouts of docs/DESIGN.md (q|k|v rows; gate/up interleaved per 8-row group), including
  the honest handling of fused parts that arrive in different dtypes (a tiled matrix has one dtype:
  q, k, v are then stored as three tensors, cflow.weights.QKV_PARTS, losslessly; gate and up,
  which llama.cpp never quantizes differently, are re-quantized only when asked, and reported);
- measuring the error every re-quantization introduces (`QuantReport`);
- the summary a converter returns (`ConversionResult`), with bytes by category.

Converters (gguf.py, checkpoint.py) only map each tensor of the table (cflow.weights) onto their
source's `Source`s; `encode_model` walks the table and `write_conversion` writes the file. No
torch here.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from cflow import quant, weights
from cflow.errors import CflowError

QUANT_CHOICES = quant.QUANT_DTYPES  # what --quant may produce: q4_0, q4_1, q8_0
# Source formats that are plain numbers: quantizing them is the normal first quantization.
FLOAT_SOURCES = ("F32", "F16", "BF16", "F64", "FLOAT32", "FLOAT16", "BFLOAT16")
# Higher is more precise (bits per weight); breaks ties when fused parts disagree on their dtype.
_PRECISION = {"mxfp4": -1, "q4_0": 0, "q4_1": 1, "q4_k": 2, "q5_0": 3, "q5_1": 4, "q5_k": 5, "q6_k": 6, "q8_0": 7}


class ConvertError(CflowError, ValueError):
    """A conversion input is missing, malformed or uses something cflow does not support."""


class NotNativeError(ConvertError):
    """A source tensor is quantized in a format cflow cannot run, and re-quantizing was not asked for."""


def check_quant(q: str) -> str:
    if q not in QUANT_CHOICES:
        raise ConvertError(f"unknown quantization {q!r}; choose one of {list(QUANT_CHOICES)}")
    return q


def parse_tile(text: str | Sequence[int]) -> tuple[int, int]:
    """'128x256' (or a pair) -> (128, 256), checked against the tile rules of cflow.quant."""
    if isinstance(text, str):
        parts = text.lower().split("x")
        try:
            tile = tuple(int(p) for p in parts)
        except ValueError:
            tile = ()
    else:
        tile = tuple(int(t) for t in text)
    if len(tile) != 2 or tile[0] <= 0 or tile[0] % quant.G or tile[1] <= 0 or tile[1] % quant.QK:
        raise ConvertError(f"tile {text!r} must be ROWSxCOLS with rows a multiple of {quant.G} and "
                           f"cols a multiple of {quant.QK}, e.g. 128x256")
    return tile  # type: ignore[return-value]


# ---- sources ---------------------------------------------------------------------------------
@dataclass
class Source:
    """One weight matrix [rows, cols] as the input holds it.

    Either `blocks` (GGML bytes [rows, row_bytes] in `dtype`, one of quant.STORED_QUANT: kept
    losslessly) or `values` (float32 [rows, cols], or a callable producing it on demand).
    """
    origin: str                    # the source's own name, for reports (e.g. "blk.0.attn_q.weight")
    src_dtype: str                 # the source's own dtype name (e.g. "Q4_1", "F16", "float32")
    rows: int
    cols: int
    dtype: str | None = None
    blocks: np.ndarray | None = None
    values: np.ndarray | Callable[[], np.ndarray] | None = None

    def floats(self) -> np.ndarray:
        """float32 [rows, cols]: the values, or the blocks dequantized."""
        if self.blocks is not None:
            return quant.dequantize(self.blocks, self.dtype, self.cols)
        v = self.values() if callable(self.values) else self.values
        v = np.asarray(v, dtype=np.float32).reshape(self.rows, self.cols)
        if not np.isfinite(v).all():
            raise ConvertError(f"{self.origin} holds NaN or infinite values; the source is corrupt")
        return v

    def take_rows(self, index: np.ndarray) -> "Source":
        """The matrix of the rows `index` picks, in that order (a permutation, or a selection: Gemma 4's
        merged gate_up stacks, Qwen3.5's query rows apart from its gate rows); moving whole rows is
        lossless on blocks."""
        rows = len(index)
        if self.blocks is not None:
            return Source(self.origin, self.src_dtype, rows, self.cols, self.dtype,
                          blocks=np.ascontiguousarray(self.blocks[index]))
        return Source(self.origin, self.src_dtype, rows, self.cols,
                      values=lambda: np.ascontiguousarray(self.floats()[index]))


# ---- error accounting ------------------------------------------------------------------------
@dataclass
class TensorError:
    """The error one re-quantization introduced, relative to the original weights."""
    tensor: str          # .cflow tensor it went into
    origin: str          # source name
    src_dtype: str
    dst_dtype: str
    n: int               # weights
    sq_err: float        # sum of squared errors
    sq_ref: float        # sum of squared original weights
    max_err: float       # max |error|
    max_ref: float       # max |original weight|

    @property
    def rms_rel(self) -> float:
        return math.sqrt(self.sq_err / self.sq_ref) if self.sq_ref > 0 else 0.0

    @property
    def max_rel(self) -> float:
        return self.max_err / self.max_ref if self.max_ref > 0 else 0.0


@dataclass
class QuantReport:
    """Which weights went into the file losslessly and what re-quantizing the others cost."""
    errors: list[TensorError] = field(default_factory=list)
    lossless_weights: int = 0
    notes: list[str] = field(default_factory=list)

    def measure(self, tensor: str, src: Source, dst_dtype: str, ref: np.ndarray, got: np.ndarray) -> None:
        diff = (got.astype(np.float64) - ref.astype(np.float64))
        ref64 = ref.astype(np.float64)
        self.errors.append(TensorError(
            tensor, src.origin, src.src_dtype, dst_dtype, int(ref.size),
            float(np.square(diff).sum()), float(np.square(ref64).sum()),
            float(np.abs(diff).max(initial=0.0)), float(np.abs(ref64).max(initial=0.0))))

    @property
    def requantized_weights(self) -> int:
        return sum(e.n for e in self.errors)

    @property
    def rms_rel(self) -> float:
        """RMS error over all re-quantized weights, relative to their RMS."""
        ref = sum(e.sq_ref for e in self.errors)
        return math.sqrt(sum(e.sq_err for e in self.errors) / ref) if ref > 0 else 0.0

    @property
    def max_rel(self) -> float:
        """The worst per-tensor max |error| / max |weight|."""
        return max((e.max_rel for e in self.errors), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"lossless_weights": self.lossless_weights, "requantized_weights": self.requantized_weights,
                "rms_rel": self.rms_rel, "max_rel": self.max_rel, "notes": list(self.notes),
                "tensors": [{"tensor": e.tensor, "origin": e.origin, "from": e.src_dtype, "to": e.dst_dtype,
                             "n": e.n, "rms_rel": e.rms_rel, "max_rel": e.max_rel} for e in self.errors]}


# ---- the encoder -----------------------------------------------------------------------------
class Encoder:
    """Turns Sources into TensorData in the DESIGN.md layouts, recording what re-quantizing cost."""

    def __init__(self, quant_dtype: str, tile: Sequence[int] = quant.TILE, report: QuantReport | None = None,
                 *, requantize: bool = True):
        self.quant = check_quant(quant_dtype)
        self.tile = tuple(tile)
        self.report = report if report is not None else QuantReport()
        # False: a source already quantized in a format cflow does not run (K-quants, Q5_0, ...) is
        # refused instead of silently re-quantized (it would lose precision a second time).
        self.requantize = requantize

    def target(self, src: Source) -> str:
        """The dtype a matrix is stored in on its own: its own blocks' dtype, else --quant."""
        if src.blocks is not None and src.dtype in quant.STORED_QUANT:
            return src.dtype
        if not self.requantize and src.src_dtype.upper() not in FLOAT_SOURCES:
            runs = ", ".join(d.upper() for d in quant.STORED_QUANT)
            raise NotNativeError(
                f"{src.origin} is {src.src_dtype}, a format cflow has no kernel for (it runs {runs} blocks as "
                f"they are). Converting means re-quantizing, which loses precision, so cflow does it only when "
                f"asked: `cflow convert MODEL.gguf OUT.cflow --quant q8_0` (q8_0 loses least; the summary "
                f"prints the error it introduces), or use a Q4_K_M/Q8_0 GGUF of this model")
        return self.quant

    def blocks(self, tensor: str, src: Source, dtype: str) -> np.ndarray:
        """GGML bytes [rows, row_bytes] of `src` in `dtype`: bit-exact when it already is, else
        quantized (from float values, or from dequantized blocks) and the error recorded."""
        if src.blocks is not None and src.dtype == dtype:
            self.report.lossless_weights += src.rows * src.cols
            return src.blocks
        ref = src.floats()                                   # [rows, cols] float32
        out = quant.quantize(ref, dtype)                     # [rows, row_bytes] uint8
        self.report.measure(tensor, src, dtype, ref, quant.dequantize(out, dtype, src.cols))
        return out

    def unify(self, tensor: str, parts: Sequence[Source]) -> str:
        """One dtype for a fused matrix: the one holding most weights; ties go to precision.
        Re-quantizing a part that arrives in another format happens only when the encoder may
        re-quantize (--quant given); otherwise it is refused."""
        targets = [self.target(p) for p in parts]
        if len(set(targets)) == 1:
            return targets[0]
        if not self.requantize:
            found = ", ".join(f"{p.origin} ({t})" for p, t in zip(parts, targets))
            raise NotNativeError(
                f"{tensor}: its parts arrive in different formats ({found}) and a fused tiled matrix has one "
                f"dtype; cflow re-quantizes only when asked: convert with --quant q8_0 (the summary prints the "
                f"error it introduces)")
        weight = {t: 0 for t in targets}
        for p, t in zip(parts, targets):
            weight[t] += p.rows * p.cols
        chosen = max(weight, key=lambda t: (weight[t], _PRECISION[t]))
        odd = [f"{p.origin} ({t})" for p, t in zip(parts, targets) if t != chosen]
        self.report.notes.append(f"{tensor}: parts arrive in different dtypes; re-quantized "
                                 f"{', '.join(odd)} to {chosen} because a tiled matrix has one dtype")
        return chosen

    # ---- tensors -----------------------------------------------------------------------------
    # Each method decides dtype and shape now (the writer plans the file from them) and encodes
    # later: TensorData.data is a callable the writer runs when it reaches the tensor, so only one
    # tensor is materialized at a time and the progress bar tracks the real work.
    def matrix(self, name: str, src: Source, meta: dict | None = None):
        _same_cols(name, (src,))
        dtype = self.target(src)
        return self._tiled(name, dtype, src.rows, src.cols, meta or {},
                           lambda: self.blocks(name, src, dtype))

    def qkv(self, name: str, q: Source, k: Source, v: Source) -> list:
        """Rows of wq, wk, wv in one tiled matrix [q_dim + 2*kv_dim, d]; or, when the three arrive
        in different formats (Q4_K_M's attn_v in Q6_K beside Q4_K q and k), the three as they are,
        named by cflow.weights.QKV_PARTS (lossless, where fusing would re-quantize)."""
        _same_cols(name, (q, k, v))
        targets = [self.target(s) for s in (q, k, v)]
        if len(set(targets)) > 1:
            base = name[: -len("attn.wqkv")]
            return [self.matrix(base + part, s) for part, s in zip(weights.QKV_PARTS, (q, k, v))]
        dtype = targets[0]
        return [self._tiled(name, dtype, q.rows + k.rows + v.rows, q.cols,
                            {"fused": "qkv", "splits": [q.rows, k.rows, v.rows]},
                            lambda: quant.fuse_qkv(*(self.blocks(name, s, dtype) for s in (q, k, v))))]

    def gate_up(self, name: str, gate: Source, up: Source):
        """gate and up interleaved per 8-row group in one tiled matrix [2*d_ff, d]."""
        _same_cols(name, (gate, up))
        if gate.rows != up.rows:
            raise ConvertError(f"{name}: gate has {gate.rows} rows but up has {up.rows}")
        if gate.rows % quant.G:
            raise ConvertError(f"{name}: the SwiGLU hidden size {gate.rows} is not a multiple of {quant.G}; "
                               "the interleaved gate/up layout needs that")
        dtype = self.unify(name, (gate, up))
        return self._tiled(name, dtype, 2 * gate.rows, gate.cols,
                           {"fused": "gate_up", "group": quant.G, "splits": [gate.rows, up.rows]},
                           lambda: quant.interleave_gate_up(self.blocks(name, gate, dtype),
                                                            self.blocks(name, up, dtype)))

    def vector(self, name: str, values: np.ndarray, meta: dict | None = None):
        """An F32 tensor stored row-major (norm weights [d], router [E, d])."""
        from cflow.fileformat import TensorData

        v = np.ascontiguousarray(values, dtype=np.float32)
        if not np.isfinite(v).all():
            raise ConvertError(f"{name} holds NaN or infinite values; the source is corrupt")
        return TensorData(name=name, dtype="f32", shape=tuple(v.shape), layout="rows",
                          data=quant.to_plain(v, "f32"), meta=meta or {})

    def _tiled(self, name: str, dtype: str, rows: int, cols: int, meta: dict,
               make_blocks: Callable[[], np.ndarray]):
        from cflow.fileformat import TensorData

        def data() -> np.ndarray:  # uint8 [nbytes], tile order
            return quant.tile_matrix(make_blocks(), dtype, rows, cols, self.tile)

        return TensorData(name=name, dtype=dtype, shape=(rows, cols), layout="tiled", data=data, meta=meta)


def _same_cols(name: str, parts: Sequence[Source]) -> None:
    cols = {p.cols for p in parts}
    if len(cols) != 1:
        raise ConvertError(f"{name}: fused parts have different input sizes {sorted(cols)}")
    for p in parts:
        if p.cols % quant.QK:
            raise ConvertError(f"{p.origin}: {p.cols} inputs is not a multiple of {quant.QK}; "
                               "cflow's block formats need that")


# ---- reading back (tests, inspect) -----------------------------------------------------------
def stored_values(cf: Any, name: str) -> np.ndarray:
    """float32 values (C-contiguous) of tensor `name` of an open model file (cflow.fileformat)."""
    e = cf.tensors[name]
    return np.ascontiguousarray(tensor_values(e.dtype, e.shape, e.layout, cf.array(name), cf.tile), dtype=np.float32)


def tensor_values(dtype: str, shape: Sequence[int], layout: str, data: np.ndarray,
                  tile: Sequence[int] = quant.TILE) -> np.ndarray:
    """float32 values of a stored tensor, in its stored row order (fused rows stay fused)."""
    shape = tuple(shape)
    if layout == "tiled":
        rows, cols = shape
        return quant.dequantize(quant.untile_matrix(data, dtype, rows, cols, tile), dtype, cols)
    if dtype in ("f32", "f16"):
        return quant.from_plain(data, dtype, shape).astype(np.float32)
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    return quant.dequantize(np.asarray(data).reshape(rows, -1), dtype, cols).reshape(shape)


def split_fused(values: np.ndarray, meta: dict) -> list[np.ndarray]:
    """The parts of a fused matrix's rows (values or blocks), per its `meta`."""
    kind = meta.get("fused")
    if kind == "qkv":
        a, b, _ = meta["splits"]
        return [values[:a], values[a:a + b], values[a + b:]]
    if kind == "gate_up":
        return list(quant.deinterleave_gate_up(values))
    return [values]


# ---- the whole model -------------------------------------------------------------------------
def encode_model(cfg: Any, enc: Encoder, parts: Callable[[weights.Weight], Any]) -> Iterator[Any]:
    """TensorData for every tensor of the table, in `.cflow` order. `parts(w)` is what a converter
    has for one tensor: the float values of a plain one (norms, router), [q, k, v] Sources for
    attn.wqkv, [gate, up] for a w_gate_up, [matrix] for any other."""
    for w in weights.model_weights(cfg):
        p = parts(w)
        if w.plain:
            yield enc.vector(w.name, p)
        elif w.fused == "qkv":
            yield from enc.qkv(w.name, *p)
        elif w.fused == "gate_up":
            yield enc.gate_up(w.name, *p)
        else:
            yield enc.matrix(w.name, *p)


def write_conversion(src: Any, dst: Any, cfg: Any, tokenizer: dict, tensors: Iterator[Any], enc: Encoder,
                     metadata: dict, *, order: str, tile: Sequence[int], progress: Any,
                     started: float) -> "ConversionResult":
    """Write the converted file and sum up what it holds and what it cost."""
    from cflow.fileformat import write_model

    counter = ByteCounter()
    summary = write_model(dst, config=cfg.to_dict(), tokenizer=tokenizer, tensors=counter(tensors), order=order,
                          tile=tile, metadata=metadata, progress=progress)
    return ConversionResult(str(src), str(dst), cfg, counter.by_category, os.path.getsize(dst),
                            time.perf_counter() - started, enc.report, summary)


# ---- summary -----------------------------------------------------------------------------
@dataclass
class ConversionResult:
    """What a conversion wrote and what it cost."""
    source: str
    output: str
    config: Any                        # ModelConfig
    bytes_by_category: dict[str, int]
    file_bytes: int
    seconds: float
    report: QuantReport
    summary: Any = None                # the writer's WriteSummary

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "output": self.output, "config": self.config.to_dict(),
                "bytes_by_category": dict(self.bytes_by_category), "file_bytes": self.file_bytes,
                "seconds": self.seconds, "quantization": self.report.to_dict()}


class ByteCounter:
    """Passes TensorData through while adding up their bytes by category (cflow.fileformat's)."""

    def __init__(self) -> None:
        self.by_category: dict[str, int] = {}

    def __call__(self, tensors):
        from cflow.fileformat import tensor_category

        for t in tensors:
            cat = tensor_category(t.name)
            self.by_category[cat] = self.by_category.get(cat, 0) + quant.tensor_nbytes(t.dtype, t.shape, t.layout)
            yield t
