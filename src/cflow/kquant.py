"""K-quant block formats (Q4_K, Q5_K, Q6_K), the 32-block fallbacks llama.cpp writes beside
them (Q5_0, Q5_1) and MXFP4 (gpt-oss's experts): the numpy references the C kernels are tested
against (docs/kquants.md).

Owns:
- the GGML byte layouts of these types (`KBLOCK`, `GGML_FIELDS`: views of the registry in
  cflow.dtypes), decoded bit-exactly as `gguf.quants` decodes them (`dequantize_k`);
- their tile layout (`tile_kquant` / `untile_kquant`, `tile_kquant_loops`): the rule of
  `cflow.quant.tile_matrix` with a super-block of 256 weights in place of a 32-block, and the
  fields of each block stored struct-of-arrays in `TILE_FIELDS` order (scales first);
- the activation format of the K-quant kernels (`quantize_act_k`: 256-value int8 blocks, one
  float32 scale, int16 sums of each 16 values; cflow's equivalent of llama.cpp's Q8_K);
- the oracles `matvec_k_ref` (float64 over dequantized weights) and `matvec_k_q8_ref` (integer
  dot products per sub-block, scaled: the arithmetic the C kernels must reproduce).

Every function here also accepts cflow's existing q4_0 / q4_1 / q8_0 (delegating to
`cflow.quant`), so a mixed Q4_K_M file (Q4_K, Q6_K, Q5_0, Q8_0 per tensor) runs through one API.
Nothing in cflow's file format, converter or engine knows these dtypes yet; no torch here.
"""

from __future__ import annotations

from math import prod
from typing import Sequence

import numpy as np

from cflow import dtypes, quant
from cflow.quant import G, TILE, QuantError, round_half_away

QK_K = dtypes.QK_K  # weights per K-quant super-block
QK = quant.QK  # weights per 32-block (Q5_0 / Q5_1, and the K-quants' sub-blocks of Q4_K / Q5_K)
K_SCALE_SIZE = 12  # bytes of packed 6-bit scales and mins in Q4_K / Q5_K

# The formats of this module: cflow.dtypes' rows that cflow only copies from GGUF files.
_ROWS = tuple(d for d in dtypes.TABLE if not d.produced)
# dtype -> (weights per block, bytes per block), as gguf.constants.GGML_QUANT_SIZES.
KBLOCK: dict[str, tuple[int, int]] = {d.name: (d.block_weights, d.block_bytes) for d in _ROWS}
# GGML type ids (gguf.GGMLQuantizationType): cflow.quant's registry holds them.
KDTYPE_IDS: dict[str, int] = quant.KQUANT_IDS
KDTYPES = tuple(KBLOCK)
K_SUPER = tuple(d.name for d in _ROWS if d.block_weights == QK_K)  # the super-block (256) formats
# Every quantized dtype this module handles (the existing ones delegate to cflow.quant).
ALL_QUANT = quant.QUANT_DTYPES + KDTYPES

# Fields of one block in GGML byte order: name -> (offset, bytes).
GGML_FIELDS: dict[str, dict[str, tuple[int, int]]] = {d.name: {f: (o, n) for f, o, n in d.fields} for d in _ROWS}
# The order a tile chunk stores the fields in (g rows of each field, one field after another):
# the fp16 super-block scales, then the packed sub-block scales, then the quant bits. Only Q6_K
# differs from GGML's order (GGML puts its scales and d after the quants).
TILE_FIELDS: dict[str, tuple[str, ...]] = {
    "q5_0": ("d", "qh", "qs"),
    "q5_1": ("d", "m", "qh", "qs"),
    "q4_k": ("d", "dmin", "scales", "qs"),
    "q5_k": ("d", "dmin", "scales", "qh", "qs"),
    "q6_k": ("d", "scales", "ql", "qh"),
    "mxfp4": ("e", "qs"),
}

# MXFP4's E2M1 values doubled, by nibble (ggml's kvalues_mxfp4): 0, .5, 1, 1.5, 2, 3, 4, 6 and
# their negatives times 2, so they are int8 and the kernels can take integer dots; the block
# scale is halved to match (`e8m0_half`). Nibble 8 is -0, stored as 0.
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """An E8M0 exponent byte -> float32 2^(e - 128), half the block scale 2^(e - 127) (ggml's
    GGML_E8M0_TO_FP32_HALF): e >= 2 as the normal float with exponent field e - 1, e = 0 and 1 as
    the subnormals 2^-128 and 2^-127 (no NaN: e = 255 is 2^127)."""
    e = np.asarray(e, np.uint8).astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


# ---- sizes ---------------------------------------------------------------------------------
def check_kdtype(dtype: str) -> str:
    if dtype not in ALL_QUANT:
        raise QuantError(f"unknown quantized dtype {dtype!r}; expected one of {list(ALL_QUANT)}")
    return dtype


def block_geometry(dtype: str) -> tuple[int, int]:
    """(weights, bytes) of one block: (256, 144/176/210) for the K-quants, (32, 18..34) otherwise."""
    check_kdtype(dtype)
    return KBLOCK[dtype] if dtype in KBLOCK else quant.BLOCK[dtype]


def row_bytes_k(dtype: str, cols: int) -> int:
    """Bytes of one row of `cols` weights; K-quants need cols % 256 == 0 (as GGML does)."""
    qb, bb = block_geometry(dtype)
    if cols % qb:
        raise QuantError(f"{dtype} rows need a multiple of {qb} columns, got {cols}"
                         + ("; llama.cpp stores such rows as q5_0 / q5_1 / q8_0" if qb == QK_K else ""))
    return cols // qb * bb


def kquant_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes a tensor occupies, rows or tiled (tiling never pads): prod(shape[:-1]) * row bytes."""
    shape = tuple(int(s) for s in shape)
    if not shape or any(s < 0 for s in shape):
        raise QuantError(f"bad shape {shape}")
    return prod(shape[:-1]) * row_bytes_k(dtype, shape[-1])


def _field(b: np.ndarray, dtype: str, name: str) -> np.ndarray:
    o, s = GGML_FIELDS[dtype][name]
    return b[..., o:o + s]


def _f16(b: np.ndarray, dtype: str, name: str) -> np.ndarray:
    """An fp16 field of blocks [..., B] as float32 [...]."""
    return np.ascontiguousarray(_field(b, dtype, name)).view(np.float16)[..., 0].astype(np.float32)


# ---- unpacking the quant bits (integers, GGML order of weights) ------------------------------
def scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of Q4_K / Q5_K [..., 12] -> 6-bit (sc, m) [..., 8] as uint8 (ggml's
    get_scale_min_k4): j < 4: sc = s[j] & 63, m = s[j+4] & 63; j >= 4:
    sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4, m = (s[j+4] >> 4) | (s[j] >> 6) << 4."""
    s = scales
    lo_sc, lo_m, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo_sc & 63, (hi & 15) | ((lo_sc >> 6) << 4)], axis=-1)
    m = np.concatenate([lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return sc, m


def unpack_q(b: np.ndarray, dtype: str) -> np.ndarray:
    """Unsigned quants of blocks [n, B] -> uint8 [n, weights] in weight order: 0..31 (q5_0,
    q5_1, q5_k), 0..15 (q4_k; mxfp4: the index into MXFP4_VALUES), 0..63 (q6_k; the weight is
    q - 32)."""
    n = b.shape[0]
    if dtype == "mxfp4":  # nibble indices into MXFP4_VALUES, Q4_0's order
        qs = _field(b, dtype, "qs")
        return np.concatenate([qs & 15, qs >> 4], axis=1)
    if dtype in ("q5_0", "q5_1"):
        qs = _field(b, dtype, "qs")
        lo = np.concatenate([qs & 15, qs >> 4], axis=1)  # weight j: qs[j] & 15, j+16: qs[j] >> 4
        qh = np.ascontiguousarray(_field(b, dtype, "qh")).view("<u4")  # (n, 1): bit j -> weight j
        hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        return lo | (hi << 4)
    if dtype in ("q4_k", "q5_k"):
        # qs: 4 chunks of 32 bytes; chunk c holds sub-block 2c (low nibbles), 2c+1 (high)
        qs = _field(b, dtype, "qs").reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 15).reshape(n, QK_K)
        if dtype == "q5_k":  # qh[l] bit i: high bit of weight 32*i + l
            qh = _field(b, dtype, "qh").reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            q = q | ((qh & 1).reshape(n, QK_K) << 4)
        return q
    if dtype == "q6_k":
        # two halves of 128 weights; ql[64h + l]: low nibble -> weight 128h + l, high -> 128h + 64 + l;
        # qh[32h + l] bits 2s..2s+1 -> weight 128h + 32s + l
        ql = _field(b, dtype, "ql").reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        qh = _field(b, dtype, "qh").reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        return (ql & 15).reshape(n, QK_K) | ((qh & 3).reshape(n, QK_K) << 4)
    raise QuantError(f"unpack_q covers {list(KDTYPES)}, got {dtype!r}")


# ---- decoding --------------------------------------------------------------------------------
def dequantize_k(blocks: np.ndarray, dtype: str, cols: int) -> np.ndarray:
    """Decode GGML bytes [R, row_bytes] to float32 [R, cols], bit-exact with gguf.quants (the
    same float32 operations in the same order: Q4_K/Q5_K (d*sc)*q - dmin*m; Q6_K (d*sc)*(q-32);
    Q5_0 d*(q-16); Q5_1 d*q + m; MXFP4 e8m0_half(e) * MXFP4_VALUES[q])."""
    if dtype in quant.QUANT_DTYPES:
        return quant.dequantize(blocks, dtype, cols)
    blocks = quant.check_blocks(blocks, dtype, cols, row_bytes_k)
    R = blocks.shape[0]
    qb, bb = KBLOCK[dtype]
    b = blocks.reshape(R * (cols // qb), bb)
    n = b.shape[0]
    q = unpack_q(b, dtype)
    if dtype == "mxfp4":
        with np.errstate(over="ignore"):  # e near 255 overflows to inf, as in ggml and gguf
            w = e8m0_half(_field(b, dtype, "e")) * MXFP4_VALUES[q].astype(np.float32)
        return w.reshape(R, cols).astype(np.float32)
    d = _f16(b, dtype, "d")[:, None]
    if dtype == "q5_0":
        w = d * (q.astype(np.int8) - np.int8(16)).astype(np.float32)
    elif dtype == "q5_1":
        w = d * q.astype(np.float32) + _f16(b, dtype, "m")[:, None]
    elif dtype in ("q4_k", "q5_k"):
        sc, m = scale_min_k4(_field(b, dtype, "scales"))
        dl = (d * sc.astype(np.float32)).reshape(n, 8, 1)
        ml = (_f16(b, dtype, "dmin")[:, None] * m.astype(np.float32)).reshape(n, 8, 1)
        w = dl * q.reshape(n, 8, 32).astype(np.float32) - ml
    else:  # q6_k
        sc = _field(b, dtype, "scales").view(np.int8).astype(np.float32)
        dl = (d * sc).reshape(n, 16, 1)
        w = dl * (q.astype(np.int8) - np.int8(32)).reshape(n, 16, 16).astype(np.float32)
    return w.reshape(R, cols).astype(np.float32)


# ---- tile layout -------------------------------------------------------------------------------
def check_tile_k(dtype: str, tile: Sequence[int] = TILE) -> tuple[int, int]:
    """(TR, TK): TR a positive multiple of 8; TK a positive multiple of the block (256 for the
    K-quants: a tile holds whole super-blocks)."""
    qb, _ = block_geometry(dtype)
    TR, TK = (int(t) for t in tile)
    if TR <= 0 or TR % G or TK <= 0 or TK % qb:
        raise QuantError(f"{dtype} tiles (rows, cols) must be positive multiples of ({G}, {qb}), got {tuple(tile)}")
    return TR, TK


def _tile_fields(dtype: str) -> list[tuple[int, int]]:
    """(GGML offset, bytes) of each field, in the order a tile chunk stores them."""
    return [GGML_FIELDS[dtype][f] for f in TILE_FIELDS[dtype]]


def tile_kquant(blocks: np.ndarray, dtype: str, rows: int, cols: int, tile: Sequence[int] = TILE) -> np.ndarray:
    """GGML row blocks [rows, row_bytes] -> the tile layout (flat uint8, same size): bands of TR
    rows, tiles of TK inputs, row groups of 8; one chunk per (group, block) holds the group's
    blocks field by field in TILE_FIELDS order. For q4_0/q4_1/q8_0 this is quant.tile_matrix."""
    if dtype in quant.QUANT_DTYPES:
        return quant.tile_matrix(blocks, dtype, rows, cols, tile)
    TR, TK = check_tile_k(dtype, tile)
    blocks = quant.check_blocks(blocks, dtype, cols, row_bytes_k)
    if blocks.shape[0] != rows:
        raise QuantError(f"expected {rows} rows of blocks, got {blocks.shape[0]}")
    qb, B = KBLOCK[dtype]
    return quant.tile_blocks(blocks.reshape(rows, cols // qb, B), TR, TK // qb, _tile_fields(dtype))


def untile_kquant(tiled: np.ndarray, dtype: str, rows: int, cols: int, tile: Sequence[int] = TILE) -> np.ndarray:
    """Inverse of `tile_kquant`: flat tiled bytes -> GGML row blocks [rows, row_bytes]."""
    if dtype in quant.QUANT_DTYPES:
        return quant.untile_matrix(tiled, dtype, rows, cols, tile)
    TR, TK = check_tile_k(dtype, tile)
    tiled = np.asarray(tiled)
    rbytes = row_bytes_k(dtype, cols)
    if tiled.dtype != np.uint8 or tiled.size != rows * rbytes:
        raise QuantError(f"a tiled {dtype} [{rows}, {cols}] matrix is {rows * rbytes} uint8 bytes, "
                         f"got {tiled.size} of {tiled.dtype}")
    qb, B = KBLOCK[dtype]
    return quant.untile_blocks(tiled.reshape(-1), rows, cols // qb, B, TR, TK // qb,
                               _tile_fields(dtype)).reshape(rows, rbytes)


def tile_kquant_loops(blocks: np.ndarray, dtype: str, rows: int, cols: int, tile: Sequence[int] = TILE) -> np.ndarray:
    """The tile rule as a literal loop nest (docs/kquants.md): slow, the reference for tests."""
    TR, TK = check_tile_k(dtype, tile)
    blocks = quant.check_blocks(blocks, dtype, cols, row_bytes_k)
    qb, B = block_geometry(dtype)
    fields = _tile_fields(dtype) if dtype in KBLOCK else quant.block_fields(dtype)
    out = bytearray()
    for r0, r1 in quant.split_steps(rows, TR):
        for k0, k1 in quant.split_steps(cols // qb, TK // qb):
            for g0, g1 in quant.split_steps(r1 - r0, G):
                for kb in range(k0, k1):
                    for o, s in fields:
                        for r in range(r0 + g0, r0 + g1):
                            out += blocks[r, kb * B + o:kb * B + o + s].tobytes()
    return np.frombuffer(bytes(out), np.uint8)


# ---- activations ----------------------------------------------------------------------------
def quantize_act_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize an activation [K] (K % 256 == 0) for the K-quant kernels: per 256-block
    d = max|x| / 127 (float32), q = round_half_away(x * id) with id = d ? 1.0f/d : 0 (float32;
    the rule of quant.quantize_act over 256 values instead of 32), and bsums = the int16 sum of
    each 16 consecutive q (|sum| <= 2032).
    Returns (qs int8 [K], d float32 [K/256], bsums int16 [K/16])."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 1 or x.size % QK_K:
        raise QuantError(f"a K-quant activation is a vector whose length is a multiple of {QK_K}, got shape {x.shape}")
    b = x.reshape(-1, QK_K)
    d = (np.abs(b).max(axis=1) / np.float32(127)).astype(np.float32)
    q = round_half_away(b * quant.inverse_or_zero(d)[:, None]).astype(np.int8)
    bsums = q.reshape(-1, 16).astype(np.int32).sum(axis=1).astype(np.int16)
    return q.reshape(-1), d, bsums


# ---- the mat-vec oracles ------------------------------------------------------------------------
def matvec_k_ref(tiled: np.ndarray, dtype: str, rows: int, cols: int, x: np.ndarray,
                 tile: Sequence[int] = TILE) -> np.ndarray:
    """The numerical oracle: dequantized weights (float64) times x (float64) -> y [rows]."""
    x = quant.check_vector(x, cols).astype(np.float64)
    w = dequantize_k(untile_kquant(tiled, dtype, rows, cols, tile), dtype, cols).astype(np.float64)
    return w @ x


def kquant_dots(blocks: np.ndarray, dtype: str, qx: np.ndarray, bsums: np.ndarray) -> dict[str, np.ndarray]:
    """The integers a K-quant kernel forms per (row, super-block), exact, as int64 [R, nsb]:
    - q4_k / q5_k: "sum_qd" = sum_s sc_s * dot(q_s, qx_s) over the 8 sub-blocks of 32, and
      "sum_mb" = sum_s m_s * (bsums[2s] + bsums[2s+1]);
    - q6_k: "sum_qd" = sum_s sc_s * (dot(q_s, qx_s) - 32 * bsums[s]) over the 16 sub-blocks of 16
      (q_s the unsigned 0..63 quants). Every partial fits int32 (docs/kquants.md bounds them)."""
    R = blocks.shape[0]
    _, B = KBLOCK[dtype]
    nsb = blocks.shape[1] // B
    b = blocks.reshape(R * nsb, B)
    q = unpack_q(b, dtype).astype(np.int64)  # [R*nsb, 256]
    qx = qx.reshape(nsb, QK_K).astype(np.int64)
    bs = bsums.reshape(nsb, 16).astype(np.int64)
    if dtype in ("q4_k", "q5_k"):
        sc, m = (a.astype(np.int64).reshape(R, nsb, 8) for a in scale_min_k4(_field(b, dtype, "scales")))
        dots = np.einsum("rksi,ksi->rks", q.reshape(R, nsb, 8, 32), qx.reshape(nsb, 8, 32))
        b32 = bs.reshape(nsb, 8, 2).sum(axis=2)
        return {"sum_qd": (sc * dots).sum(axis=2), "sum_mb": (m * b32[None]).sum(axis=2)}
    if dtype == "q6_k":
        sc = _field(b, dtype, "scales").view(np.int8).astype(np.int64).reshape(R, nsb, 16)
        dots = np.einsum("rksi,ksi->rks", q.reshape(R, nsb, 16, 16), qx.reshape(nsb, 16, 16))
        return {"sum_qd": (sc * (dots - 32 * bs[None])).sum(axis=2)}
    raise QuantError(f"kquant_dots covers {list(K_SUPER)}, got {dtype!r}")


def matvec_k_q8_ref(tiled: np.ndarray, dtype: str, rows: int, cols: int, x: np.ndarray,
                    tile: Sequence[int] = TILE) -> np.ndarray:
    """What the C kernels compute, in float64, with x quantized as they will quantize it:
    - q4_k / q5_k: x by `quantize_act_k`; per super-block
        y += d * dx * sum_qd - dmin * dx * sum_mb     (`kquant_dots`)
    - q6_k: x by `quantize_act_k`; per super-block y += d * dx * sum_qd
    - q5_0 / q5_1: x by `quant.quantize_act` (32-blocks: these rows are not multiples of 256);
      per 32-block y += d * dx * dot(q, qx) - 16 * d * s  (q5_0)  or  + m * s  (q5_1),
      s = dx * sum(qx) as for Q4_0 / Q4_1;
    - mxfp4: x by `quant.quantize_act`; per 32-block y += e8m0_half(e) * dx * dot(v, qx), v the
      doubled int8 values (MXFP4_VALUES), the dot exact in integers;
    - q4_0 / q4_1 / q8_0: `quant.matvec_q8_ref`."""
    if dtype in quant.QUANT_DTYPES:
        return quant.matvec_q8_ref(tiled, dtype, rows, cols, x, tile)
    check_kdtype(dtype)
    x = quant.check_vector(x, cols)
    blocks = untile_kquant(tiled, dtype, rows, cols, tile)
    qb, B = KBLOCK[dtype]
    nb = cols // qb
    b = blocks.reshape(rows, nb, B)
    if dtype == "mxfp4":
        qx, dx, _ = quant.quantize_act(x)
        v = MXFP4_VALUES[unpack_q(b.reshape(rows * nb, B), dtype)].reshape(rows, nb, QK).astype(np.int64)
        dots = np.einsum("rki,ki->rk", v, qx.reshape(nb, QK).astype(np.int64)).astype(np.float64)
        d = e8m0_half(_field(b, dtype, "e")[..., 0]).astype(np.float64)
        return (d * dx.astype(np.float64) * dots).sum(axis=1)
    d = _f16(b, dtype, "d").astype(np.float64)  # [rows, nb]
    if dtype in K_SUPER:
        qx, dx, bsums = quantize_act_k(x)
        ints = kquant_dots(blocks, dtype, qx, bsums)
        dx64 = dx.astype(np.float64)
        acc = d * dx64 * ints["sum_qd"].astype(np.float64)
        if dtype != "q6_k":
            acc -= _f16(b, dtype, "dmin").astype(np.float64) * dx64 * ints["sum_mb"].astype(np.float64)
        return acc.sum(axis=1)
    qx, dx, sx = quant.quantize_act(x)
    q = unpack_q(b.reshape(rows * nb, B), dtype).reshape(rows, nb, QK).astype(np.int64)
    dots = np.einsum("rki,ki->rk", q, qx.reshape(nb, QK).astype(np.int64)).astype(np.float64)
    acc = d * dx.astype(np.float64) * dots
    if dtype == "q5_0":
        acc -= 16.0 * d * sx.astype(np.float64)
    else:
        acc += _f16(b, dtype, "m").astype(np.float64) * sx.astype(np.float64)
    return acc.sum(axis=1)
