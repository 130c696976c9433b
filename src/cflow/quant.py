"""Block quantization formats and the tile layout: the numpy reference that every other part of
cflow (writer, reader, C kernels, tests) is checked against.

Owns, in one place:
- the block formats (GGML semantics and type ids, bit-exact with ggml-quants.c's `_ref`
  quantizers): Q4_0, Q4_1, Q8_0, plus F16/F32 pass-through;
- the views of the dtype registry (cflow.dtypes) that the rest of cflow reads: `DTYPE_IDS` (every
  dtype a file may store), `BLOCK` and `BLOCK_FIELDS` (the formats encoded here), `KQUANT_IDS`
  (the formats cflow runs as it is but never produces: Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, MXFP4;
  their decoding and tiling are cflow.kquant's, to which the functions here delegate);
- the tile layout of a weight matrix (docs/DESIGN.md "Tile layout"): row bands of TR rows, tiles
  of TK inputs, row groups of G=8 rows whose blocks are stored struct-of-arrays (scales first);
- the fused-matrix row arrangements (`fuse_qkv`, `interleave_gate_up`);
- int8 activation quantization as the C kernels do it (`quantize_act`);
- the numerical oracles `matvec_ref` (float64, dequantized weights) and `matvec_q8_ref` (float64,
  with the activation int8-quantized exactly as the C kernel sees it).

Arrays of blocks are uint8 `[R, K//32 * block_bytes]`: each row is GGML's block bytes for that
row. A tiled matrix is a flat uint8 array of the same total size (tiling never pads).

No torch here: the runtime imports this module.
"""

from __future__ import annotations

from math import prod
from typing import Sequence

import numpy as np

from cflow import dtypes
from cflow.errors import CflowError

QK = dtypes.QK  # weights per block of every format this module encodes
G = 8  # rows per interleaved row group inside a tile
TILE = (128, 256)  # default (TR rows, TK inputs)

# Every dtype below is a view of cflow.dtypes.TABLE, the one statement of ids and block sizes.
# dtype -> (weights per block, bytes per block): the 32-block formats `quantize` produces.
BLOCK: dict[str, tuple[int, int]] = {d.name: (d.block_weights, d.block_bytes) for d in dtypes.TABLE
                                     if d.produced and not d.plain}
# GGML types a file may hold and the engine runs as they are, but that cflow never produces itself:
# the K-quants and the 32-block Q5_0 / Q5_1 llama.cpp writes beside them. Their byte and tile
# layouts are defined in cflow.kquant (docs/kquants.md); the functions below delegate to it.
KQUANT_IDS: dict[str, int] = {d.name: d.ggml_id for d in dtypes.TABLE if not d.produced}
# GGML type ids (also the C enum cf_dtype).
DTYPE_IDS: dict[str, int] = {d.name: d.ggml_id for d in dtypes.TABLE}
DTYPES = tuple(DTYPE_IDS)
QUANT_DTYPES = tuple(BLOCK)  # the formats `quantize` produces
STORED_QUANT = QUANT_DTYPES + tuple(KQUANT_IDS)  # every quantized format a file may store
LAYOUTS = ("rows", "tiled")

# Fields of one 32-weight block, in GGML byte order, as byte widths. A tile chunk stores each
# field for the g rows of a group one after another (scales first). F16/F32 are treated as a
# single 64/128-byte field so that plain matrices can be tiled the same way.
BLOCK_FIELDS: dict[str, tuple[int, ...]] = {d.name: d.field_widths for d in dtypes.TABLE if d.produced}
_ELEM_BYTES = {d.name: d.block_bytes // d.block_weights for d in dtypes.TABLE if d.plain}  # f32 4, f16 2


class QuantError(CflowError, ValueError):
    """A quantization or tiling request is malformed (unknown dtype, bad shape, bad sizes)."""


# ---- sizes ---------------------------------------------------------------------------------
def check_dtype(dtype: str) -> str:
    if dtype not in DTYPE_IDS:
        raise QuantError(f"unknown dtype {dtype!r}; cflow stores one of {list(DTYPES)}")
    return dtype


def block_bytes(dtype: str) -> int:
    """Bytes of one 32-weight block (18, 20, 34; 64 for f16; 128 for f32); the K-quant formats'
    blocks are in cflow.kquant (`block_geometry`)."""
    if check_dtype(dtype) in KQUANT_IDS:
        raise QuantError(f"{dtype} is not a 32-weight block format; see cflow.kquant.block_geometry")
    return sum(BLOCK_FIELDS[dtype])


def _kquant():
    # imported late: cflow.kquant builds on this module
    from cflow import kquant
    return kquant


def row_bytes(dtype: str, cols: int) -> int:
    """Bytes of one row of `cols` weights (quantized formats need cols % 32 == 0)."""
    check_dtype(dtype)
    if dtype in _ELEM_BYTES:
        return cols * _ELEM_BYTES[dtype]
    if dtype in KQUANT_IDS:
        return _kquant().row_bytes_k(dtype, cols)
    if cols % QK:
        raise QuantError(f"{dtype} rows need a multiple of {QK} columns, got {cols}")
    return cols // QK * BLOCK[dtype][1]


def tensor_nbytes(dtype: str, shape: Sequence[int], layout: str = "rows") -> int:
    """Bytes a tensor occupies. Tiling never pads, so both layouts have the same size; a tiled
    tensor must be 2-D (or 3-D stacked matrices) with the last dim a multiple of 32."""
    check_dtype(dtype)
    if layout not in LAYOUTS:
        raise QuantError(f"unknown layout {layout!r}; expected one of {list(LAYOUTS)}")
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise QuantError(f"negative dimension in shape {shape}")
    if layout == "tiled" and (len(shape) < 2 or shape[-1] % QK):
        raise QuantError(f"a tiled tensor needs >= 2 dims with the last a multiple of {QK}, got {shape}")
    if dtype in _ELEM_BYTES and layout == "rows":
        return prod(shape) * _ELEM_BYTES[dtype]
    if not shape:
        raise QuantError(f"{dtype} tensors need at least one dimension")
    return prod(shape[:-1]) * row_bytes(dtype, shape[-1])


# ---- GGML block formats --------------------------------------------------------------------
def round_half_away(x: np.ndarray) -> np.ndarray:
    """C's roundf: halves round away from zero (np.round would round half to even)."""
    a = np.abs(x)
    fl = np.floor(a)
    return np.sign(x) * (fl + np.floor(2 * (a - fl)))


def _as_blocks(w: np.ndarray) -> tuple[np.ndarray, int, int]:
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise QuantError(f"expected a 2-D matrix [rows, cols], got shape {w.shape}")
    R, K = w.shape
    if K % QK:
        raise QuantError(f"quantized rows need a multiple of {QK} columns, got {K}")
    return w.reshape(R * (K // QK), QK), R, K


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    # q: (n, 32) uint8 in 0..15 -> (n, 16): byte j = q[j] | q[j+16] << 4 (GGML order)
    return q[:, :16] | (q[:, 16:] << np.uint8(4))


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    # qs: (n, 16) -> (n, 32) uint8 in 0..15
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)


def inverse_or_zero(d: np.ndarray) -> np.ndarray:
    """1/d, and 0 where d is 0 (an all-zero block quantizes to zeros)."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _quantize_q4_0(b: np.ndarray) -> np.ndarray:
    # ggml quantize_row_q4_0_ref: d = (value of max |x|) / -8, q = min(15, (int8)(x/d + 8.5))
    imax = np.abs(b).argmax(axis=1)[:, None]
    d = (np.take_along_axis(b, imax, axis=1) / np.float32(-8)).astype(np.float32)
    q = np.trunc(b * inverse_or_zero(d) + np.float32(8.5)).astype(np.int32).clip(0, 15).astype(np.uint8)
    return np.concatenate([d.astype(np.float16).view(np.uint8), _pack_nibbles(q)], axis=1)


def _quantize_q4_1(b: np.ndarray) -> np.ndarray:
    # ggml quantize_row_q4_1_ref: d = (max - min) / 15, q = min(15, (int8)((x - min)/d + 0.5))
    mn = b.min(axis=1, keepdims=True)
    d = ((b.max(axis=1, keepdims=True) - mn) / np.float32(15)).astype(np.float32)
    q = np.trunc((b - mn) * inverse_or_zero(d) + np.float32(0.5)).astype(np.int32).clip(0, 15).astype(np.uint8)
    return np.concatenate(
        [d.astype(np.float16).view(np.uint8), mn.astype(np.float16).view(np.uint8), _pack_nibbles(q)], axis=1
    )


def _quantize_q8_0(b: np.ndarray) -> np.ndarray:
    # ggml quantize_row_q8_0_ref: d = max|x| / 127, q = roundf(x * (1/d))
    d = (np.abs(b).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float32)
    q = round_half_away(b * inverse_or_zero(d)).astype(np.int8)
    return np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], axis=1)


def quantize(w: np.ndarray, dtype: str) -> np.ndarray:
    """Encode a float matrix [R, K] as GGML bytes [R, row_bytes(dtype, K)] (bit-exact with ggml)."""
    check_dtype(dtype)
    if dtype in KQUANT_IDS:
        raise QuantError(f"cflow does not quantize to {dtype} (it runs {dtype} blocks from GGUF files as they "
                         f"are); quantize to one of {list(QUANT_DTYPES)}")
    if dtype in _ELEM_BYTES:
        w = np.asarray(w)
        if w.ndim != 2:
            raise QuantError(f"expected a 2-D matrix [rows, cols], got shape {w.shape}")
        return to_plain(w, dtype).reshape(w.shape[0], -1)
    b, R, K = _as_blocks(w)
    enc = {"q4_0": _quantize_q4_0, "q4_1": _quantize_q4_1, "q8_0": _quantize_q8_0}[dtype]
    return enc(b).reshape(R, row_bytes(dtype, K))


def check_blocks(blocks: np.ndarray, dtype: str, cols: int, row_bytes_of=None) -> np.ndarray:
    """`blocks` as contiguous uint8 [R, row_bytes] rows of `dtype` (a flat array is reshaped);
    `row_bytes_of(dtype, cols)` gives a format's row size (default: this module's formats)."""
    blocks = np.asarray(blocks)
    if blocks.dtype != np.uint8:
        raise QuantError(f"encoded blocks must be uint8, got {blocks.dtype}")
    rb = (row_bytes_of or row_bytes)(dtype, cols)
    if blocks.ndim == 1 and rb and blocks.size % rb == 0:
        blocks = blocks.reshape(-1, rb)
    if blocks.ndim != 2 or blocks.shape[1] != rb:
        raise QuantError(f"{dtype} rows of {cols} columns take {rb} bytes, got array of shape {blocks.shape}")
    return np.ascontiguousarray(blocks)


def dequantize(blocks: np.ndarray, dtype: str, cols: int) -> np.ndarray:
    """Decode GGML bytes [R, row_bytes] to float32 [R, cols]."""
    if dtype in KQUANT_IDS:
        return _kquant().dequantize_k(blocks, dtype, cols)
    blocks = check_blocks(blocks, dtype, cols)
    R = blocks.shape[0]
    if dtype in _ELEM_BYTES:
        return from_plain(blocks, dtype, (R, cols)).astype(np.float32)
    b = blocks.reshape(R * (cols // QK), BLOCK[dtype][1])
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # (n, 1)
    if dtype == "q4_0":
        w = d * (_unpack_nibbles(b[:, 2:]).astype(np.float32) - np.float32(8))
    elif dtype == "q4_1":
        m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        w = d * _unpack_nibbles(b[:, 4:]).astype(np.float32) + m
    else:
        w = d * b[:, 2:].view(np.int8).astype(np.float32)
    return w.reshape(R, cols)


# ---- F16 / F32 pass-through ----------------------------------------------------------------
def to_plain(w: np.ndarray, dtype: str) -> np.ndarray:
    """Little-endian bytes of `w` as f32 or f16, flat uint8."""
    if dtype not in _ELEM_BYTES:
        raise QuantError(f"to_plain handles f32/f16, got {dtype!r}")
    np_dtype = np.dtype("<f4") if dtype == "f32" else np.dtype("<f2")
    return np.ascontiguousarray(w, dtype=np_dtype).reshape(-1).view(np.uint8)


def from_plain(data: np.ndarray, dtype: str, shape: Sequence[int]) -> np.ndarray:
    """View little-endian f32/f16 bytes as an array of `shape` (no copy when aligned)."""
    if dtype not in _ELEM_BYTES:
        raise QuantError(f"from_plain handles f32/f16, got {dtype!r}")
    np_dtype = np.dtype("<f4") if dtype == "f32" else np.dtype("<f2")
    data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    if data.size != prod(shape) * np_dtype.itemsize:
        raise QuantError(f"{data.size} bytes do not hold a {dtype} tensor of shape {tuple(shape)}")
    return data.view(np_dtype).reshape(tuple(shape))


# ---- tile layout ---------------------------------------------------------------------------
def _check_tile(tile: Sequence[int]) -> tuple[int, int]:
    TR, TK = (int(t) for t in tile)
    if TR <= 0 or TR % G or TK <= 0 or TK % QK:
        raise QuantError(f"tile (rows, cols) must be positive multiples of ({G}, {QK}), got {tuple(tile)}")
    return TR, TK


def split_steps(n: int, step: int) -> list[tuple[int, int]]:
    """[0, n) cut into consecutive (start, end) pieces of `step` (the last may be shorter)."""
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def block_fields(dtype: str) -> list[tuple[int, int]]:
    """(offset, bytes) of each field of a `dtype` block, in GGML order (scales first)."""
    out, o = [], 0
    for s in BLOCK_FIELDS[dtype]:
        out.append((o, s))
        o += s
    return out


def _pack_groups(sub: np.ndarray, g: int, fields: list[tuple[int, int]]) -> np.ndarray:
    # sub: (nb, ng*g, tb, B) block bytes -> (nb, ng*tb*g*B) in chunk order (group, kb, field, row)
    nb, r, tb, B = sub.shape
    x = sub.reshape(nb, r // g, g, tb, B).transpose(0, 1, 3, 2, 4)  # (nb, ng, tb, g, B)
    parts = [x[..., o:o + s].reshape(nb, r // g, tb, g * s) for o, s in fields]
    return np.concatenate(parts, axis=3).reshape(nb, -1)


def _unpack_groups(flat: np.ndarray, nb: int, r: int, tb: int, g: int, fields: list[tuple[int, int]]) -> np.ndarray:
    # inverse of _pack_groups, for fields stored in any order: (nb, r*tb*B) -> (nb, r, tb, B)
    B = sum(s for _, s in fields)
    x = flat.reshape(nb, r // g, tb, g * B)
    y = np.empty((nb, r // g, tb, g, B), np.uint8)
    o_chunk = 0
    for o, s in fields:
        y[..., o:o + s] = x[..., o_chunk:o_chunk + g * s].reshape(nb, r // g, tb, g, s)
        o_chunk += g * s
    return y.transpose(0, 1, 3, 2, 4).reshape(nb, r, tb, B)


def _band_rows(rb: int) -> list[tuple[int, int, int]]:
    # (start, rows, group size) of the full-group part and the short last group of a band of rb rows
    full = rb // G * G
    return [(a, n, g) for a, n, g in ((0, full, G), (full, rb - full, rb - full)) if n > 0]


def _bands(rows: int, TR: int) -> list[tuple[int, int, int]]:
    # (first row, number of bands, rows per band): the full bands together, then the short one
    n_full = rows // TR
    return [(r0, nb, rb) for r0, nb, rb in ((0, n_full, TR), (n_full * TR, 1 if rows % TR else 0, rows % TR))
            if nb > 0]


def tile_blocks(b3: np.ndarray, TR: int, tile_blocks_per_row: int, fields: list[tuple[int, int]]) -> np.ndarray:
    """The tile rule over blocks of any format: b3 [rows, blocks per row, B] -> flat uint8. Bands
    of TR rows, tiles of `tile_blocks_per_row` blocks, row groups of 8; a chunk per (group, block)
    holds the group's blocks field by field, in the order `fields` ((offset, bytes) in the block)
    lists them. Full bands are identical in shape, so they are packed together."""
    rows, nkb, B = b3.shape
    out: list[np.ndarray] = []
    for r0, nbands, rb in _bands(rows, TR):
        band = b3[r0:r0 + nbands * rb].reshape(nbands, rb, nkb, B)
        per_tile = []
        for k0, k1 in split_steps(nkb, tile_blocks_per_row):
            sub = band[:, :, k0:k1]
            parts = [_pack_groups(sub[:, a:a + n], g, fields) for a, n, g in _band_rows(rb)]
            per_tile.append(np.concatenate(parts, axis=1))
        out.append(np.concatenate(per_tile, axis=1).reshape(-1))
    return np.concatenate(out) if out else np.zeros(0, np.uint8)


def untile_blocks(tiled: np.ndarray, rows: int, nkb: int, B: int, TR: int, tile_blocks_per_row: int,
                  fields: list[tuple[int, int]]) -> np.ndarray:
    """Inverse of `tile_blocks`: flat uint8 -> [rows, nkb, B]."""
    out = np.empty((rows, nkb, B), np.uint8)
    pos = 0
    for r0, nbands, rb in _bands(rows, TR):
        band_bytes = rb * nkb * B
        bands = tiled[pos:pos + nbands * band_bytes].reshape(nbands, band_bytes)
        dst = out[r0:r0 + nbands * rb].reshape(nbands, rb, nkb, B)
        o = 0
        for k0, k1 in split_steps(nkb, tile_blocks_per_row):
            for a, n, g in _band_rows(rb):
                nbytes = n * (k1 - k0) * B
                dst[:, a:a + n, k0:k1] = _unpack_groups(bands[:, o:o + nbytes], nbands, n, k1 - k0, g, fields)
                o += nbytes
        pos += nbands * band_bytes
    return out


def tile_matrix(blocks: np.ndarray, dtype: str, rows: int, cols: int, tile: Sequence[int] = TILE) -> np.ndarray:
    """Rearrange GGML row blocks [rows, row_bytes] into the tile layout (flat uint8, same size)."""
    if dtype in KQUANT_IDS:
        return _kquant().tile_kquant(blocks, dtype, rows, cols, tile)
    TR, TK = _check_tile(tile)
    blocks = check_blocks(blocks, dtype, cols)
    if blocks.shape[0] != rows:
        raise QuantError(f"expected {rows} rows of blocks, got {blocks.shape[0]}")
    if cols % QK:
        raise QuantError(f"a tiled matrix needs a multiple of {QK} columns, got {cols}")
    B, nkb = block_bytes(dtype), cols // QK
    return tile_blocks(blocks.reshape(rows, nkb, B), TR, TK // QK, block_fields(dtype))


def untile_matrix(tiled: np.ndarray, dtype: str, rows: int, cols: int, tile: Sequence[int] = TILE) -> np.ndarray:
    """Inverse of `tile_matrix`: flat tiled bytes -> GGML row blocks [rows, row_bytes]."""
    if dtype in KQUANT_IDS:
        return _kquant().untile_kquant(tiled, dtype, rows, cols, tile)
    TR, TK = _check_tile(tile)
    tiled = np.asarray(tiled)
    rb_bytes = row_bytes(dtype, cols)
    if tiled.dtype != np.uint8 or tiled.size != rows * rb_bytes:
        raise QuantError(f"a tiled {dtype} [{rows}, {cols}] matrix is {rows * rb_bytes} uint8 bytes, "
                         f"got {tiled.size} of {tiled.dtype}")
    if cols % QK:
        raise QuantError(f"a tiled matrix needs a multiple of {QK} columns, got {cols}")
    B, nkb = block_bytes(dtype), cols // QK
    return untile_blocks(tiled.reshape(-1), rows, nkb, B, TR, TK // QK, block_fields(dtype)).reshape(rows, rb_bytes)


def tile_matrix_loops(blocks: np.ndarray, dtype: str, rows: int, cols: int, tile: Sequence[int] = TILE) -> np.ndarray:
    """The tile layout written as DESIGN.md's literal loop nest: slow, the reference for tests."""
    TR, TK = _check_tile(tile)
    blocks = check_blocks(blocks, dtype, cols)
    B = block_bytes(dtype)
    out = bytearray()
    for r0, r1 in split_steps(rows, TR):
        for k0, k1 in split_steps(cols // QK, TK // QK):
            for g0, g1 in split_steps(r1 - r0, G):
                for kb in range(k0, k1):
                    for o, s in block_fields(dtype):
                        for r in range(r0 + g0, r0 + g1):
                            out += blocks[r, kb * B + o:kb * B + o + s].tobytes()
    return np.frombuffer(bytes(out), np.uint8)


# ---- fused matrices ------------------------------------------------------------------------
def fuse_qkv(q_blocks: np.ndarray, k_blocks: np.ndarray, v_blocks: np.ndarray) -> np.ndarray:
    """Rows of wq, then wk, then wv: one mat-vec yields q|k|v."""
    widths = {a.shape[1] for a in (q_blocks, k_blocks, v_blocks)}
    if len(widths) != 1:
        raise QuantError(f"q, k, v must have the same row width in bytes, got {sorted(widths)}")
    return np.concatenate([q_blocks, k_blocks, v_blocks], axis=0)


def interleave_gate_up(gate_blocks: np.ndarray, up_blocks: np.ndarray) -> np.ndarray:
    """Rows gate[0:8], up[0:8], gate[8:16], up[8:16], ...: the kernel's SwiGLU epilogue pairs
    each gate group with its up group, and a thread's row-group range always holds both."""
    if gate_blocks.shape != up_blocks.shape:
        raise QuantError(f"gate and up must have the same shape, got {gate_blocks.shape} and {up_blocks.shape}")
    F, W = gate_blocks.shape
    if F % G:
        raise QuantError(f"the SwiGLU hidden size must be a multiple of {G} to interleave, got {F}")
    pair = np.stack([gate_blocks.reshape(F // G, G, W), up_blocks.reshape(F // G, G, W)], axis=1)
    return pair.reshape(2 * F, W)


def deinterleave_gate_up(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of `interleave_gate_up` (also works on float outputs of shape [2F] or [2F, K])."""
    n = blocks.shape[0]
    if n % (2 * G):
        raise QuantError(f"an interleaved gate/up matrix has a multiple of {2 * G} rows, got {n}")
    x = blocks.reshape(n // (2 * G), 2, G, *blocks.shape[1:])
    return x[:, 0].reshape(n // 2, *blocks.shape[1:]), x[:, 1].reshape(n // 2, *blocks.shape[1:])


# ---- activations and the mat-vec oracles ---------------------------------------------------
def quantize_act(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize an activation [K] per 32-block to int8, as the C kernels do.

    d = max|x| / 127 (float32), q = round_half_away(x * (1/d)) (ggml's quantize_row_q8_0_ref, but
    d stays float32), q = 0 where d == 0, s = d * sum(q) (float32).
    Returns (qs int8 [K], d float32 [K/32], s float32 [K/32]).
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 1 or x.size % QK:
        raise QuantError(f"an activation is a vector whose length is a multiple of {QK}, got shape {x.shape}")
    b = x.reshape(-1, QK)
    d = (np.abs(b).max(axis=1) / np.float32(127)).astype(np.float32)
    q = round_half_away(b * inverse_or_zero(d)[:, None]).astype(np.int8)
    s = (d * q.astype(np.int32).sum(axis=1).astype(np.float32)).astype(np.float32)
    return q.reshape(-1), d, s


def check_vector(x: np.ndarray, cols: int) -> np.ndarray:
    """`x` as an array, checked to be the [cols] input vector of a mat-vec."""
    x = np.asarray(x)
    if x.shape != (cols,):
        raise QuantError(f"x must have shape ({cols},), got {x.shape}")
    return x


def matvec_ref(tiled: np.ndarray, dtype: str, rows: int, cols: int, x: np.ndarray,
               tile: Sequence[int] = TILE) -> np.ndarray:
    """The numerical oracle: dequantized weights (float64) times x (float64) -> y [rows]."""
    x = check_vector(x, cols).astype(np.float64)
    w = dequantize(untile_matrix(tiled, dtype, rows, cols, tile), dtype, cols).astype(np.float64)
    return w @ x


def matvec_q8_ref(tiled: np.ndarray, dtype: str, rows: int, cols: int, x: np.ndarray,
                  tile: Sequence[int] = TILE) -> np.ndarray:
    """What the C kernel computes, in float64: x is int8-quantized by `quantize_act`, each block
    contributes an integer dot product scaled by the weight and activation scales, and Q4_0's -8
    and Q4_1's +m are applied once per block through s = d_x * sum(q_x)."""
    if dtype not in QUANT_DTYPES:
        raise QuantError(f"matvec_q8_ref covers {list(QUANT_DTYPES)}, got {dtype!r}")
    qx, dx, sx = quantize_act(check_vector(x, cols))
    nkb = cols // QK
    b = untile_matrix(tiled, dtype, rows, cols, tile).reshape(rows, nkb, BLOCK[dtype][1])
    dw = b[..., 0:2].copy().view(np.float16).astype(np.float64)[..., 0]  # [rows, nkb]
    qx64 = qx.reshape(nkb, QK).astype(np.int64)
    if dtype == "q8_0":
        qw = b[..., 2:].view(np.int8).astype(np.int64)  # [rows, nkb, 32]
    else:
        off = 2 if dtype == "q4_0" else 4
        qw = _unpack_nibbles(b[..., off:].reshape(-1, 16)).reshape(rows, nkb, QK).astype(np.int64)
    dots = np.einsum("rki,ki->rk", qw, qx64).astype(np.float64)  # exact integer dots
    acc = dw * dx.astype(np.float64) * dots
    if dtype == "q4_0":
        acc -= 8.0 * dw * sx.astype(np.float64)
    elif dtype == "q4_1":
        m = b[..., 2:4].copy().view(np.float16).astype(np.float64)[..., 0]
        acc += m * sx.astype(np.float64)
    return acc.sum(axis=1)


def quantize_tiled(w: np.ndarray, dtype: str, tile: Sequence[int] = TILE) -> np.ndarray:
    """Convenience: float matrix [R, K] -> quantized, tiled flat bytes."""
    R, K = np.shape(w)
    return tile_matrix(quantize(w, dtype), dtype, R, K, tile)
