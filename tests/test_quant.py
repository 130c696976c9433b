"""cflow.quant: GGML bit-exactness (vs gguf.quants, random and SmolLM2 tensors), the tile layout
(vs DESIGN.md's literal loop nest), fused arrangements, activation quantization and the mat-vec
oracles (vs plain dense numpy)."""

from __future__ import annotations


import numpy as np
import pytest

from cflow import dtypes
from cflow import kquant as K
from cflow import quant as Q

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GT  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

GGML_TYPES = {"q4_0": GT.Q4_0, "q4_1": GT.Q4_1, "q8_0": GT.Q8_0}
ROWS = [1, 7, 8, 9, 129, 576]
COLS = [32, 64, 288, 576, 1536]


def _rand(shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _tricky_matrix() -> np.ndarray:
    """Blocks that hit the formats' edge cases: zeros, constants, negative max, ties, tiny values."""
    w = _rand((12, 64), seed=1)
    w[0] = 0.0                                   # d == 0 everywhere
    w[1] = 3.25                                  # constant block: Q4_1 d == 0, min == value
    w[2, :32] = -np.linspace(0, 5, 32)           # max |x| is negative
    w[3, :32] = np.arange(32) - 15.5             # lots of exact halves after scaling
    w[4] = 1e-30                                 # subnormal scale in fp16
    w[5] = 7e4                                   # scale overflows fp16 range for q4_1 min
    w[6, :32] = np.where(np.arange(32) % 2, 127.0, -127.0)
    w[6, 32:] = np.arange(32) * 0.5 - 8          # halves for q8_0 with d == 0.0630
    return w


# ---- GGML bit-exactness --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(GGML_TYPES))
@pytest.mark.parametrize("seed,shape,scale", [(0, (37, 288), 1.0), (1, (5, 1536), 0.02), (2, (64, 32), 100.0)])
def test_quantize_matches_gguf_random(dtype, seed, shape, scale):
    w = _rand(shape, seed, scale)
    ours = Q.quantize(w, dtype)
    ref = gguf_quantize(w, GGML_TYPES[dtype])
    assert ours.dtype == np.uint8 and ours.shape == ref.shape == (shape[0], Q.row_bytes(dtype, shape[1]))
    np.testing.assert_array_equal(ours, ref)
    np.testing.assert_array_equal(Q.dequantize(ours, dtype, shape[1]), gguf_dequantize(ref, GGML_TYPES[dtype]))


@pytest.mark.parametrize("dtype", list(GGML_TYPES))
def test_quantize_matches_gguf_edge_cases(dtype):
    w = _tricky_matrix()
    with np.errstate(over="ignore"):
        ref = gguf_quantize(w, GGML_TYPES[dtype])
        ours = Q.quantize(w, dtype)
    np.testing.assert_array_equal(ours, ref)
    np.testing.assert_array_equal(Q.dequantize(ours, dtype, 64), gguf_dequantize(ref, GGML_TYPES[dtype]))


@pytest.mark.parametrize("dtype", list(GGML_TYPES))
def test_dequantize_random_bytes_matches_gguf(dtype):
    # any byte pattern is a valid block except non-finite fp16 scales; keep scales finite
    raw = np.random.default_rng(3).integers(0, 256, (9, Q.row_bytes(dtype, 96)), dtype=np.uint8)
    b = raw.reshape(9, 3, Q.BLOCK[dtype][1])
    n_scales = 2 if dtype == "q4_1" else 1
    scales = np.random.default_rng(4).standard_normal((9, 3, n_scales)).astype(np.float16)
    b[..., : 2 * n_scales] = scales.view(np.uint8)
    np.testing.assert_array_equal(Q.dequantize(raw, dtype, 96), gguf_dequantize(raw, GGML_TYPES[dtype]))


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return {t.name: t for t in gguf.GGUFReader(smollm2_gguf).tensors}


@pytest.mark.parametrize("name,nrows", [("blk.0.attn_q.weight", None), ("blk.3.ffn_down.weight", None),
                                        ("blk.7.attn_k.weight", None), ("token_embd.weight", 300)])
def test_smollm2_tensors_bit_exact(smollm2, name, nrows):
    t = smollm2[name]
    dtype = t.tensor_type.name.lower()
    blocks = np.asarray(t.data)[:nrows]  # uint8 [rows, row_bytes]
    cols = int(t.shape[0])  # GGUF lists dims fastest first
    w = Q.dequantize(blocks, dtype, cols)
    np.testing.assert_array_equal(w, gguf_dequantize(blocks, t.tensor_type))
    # re-quantizing the decoded values must agree with ggml's quantizer, whatever it returns
    np.testing.assert_array_equal(Q.quantize(w, dtype), gguf_quantize(w, t.tensor_type))
    tiled = Q.tile_matrix(blocks, dtype, blocks.shape[0], cols)
    np.testing.assert_array_equal(Q.untile_matrix(tiled, dtype, blocks.shape[0], cols), blocks)
    x = _rand(cols, seed=4)
    np.testing.assert_allclose(Q.matvec_ref(tiled, dtype, blocks.shape[0], cols, x),
                               w.astype(np.float64) @ x.astype(np.float64), rtol=1e-12, atol=1e-12)


# ---- F16 / F32 pass-through ----------------------------------------------------------------
@pytest.mark.parametrize("dtype,np_dtype", [("f32", np.float32), ("f16", np.float16)])
def test_plain_round_trip(dtype, np_dtype):
    w = _rand((7, 33), seed=5)
    raw = Q.to_plain(w, dtype)
    assert raw.dtype == np.uint8 and raw.size == Q.tensor_nbytes(dtype, (7, 33))
    np.testing.assert_array_equal(Q.from_plain(raw, dtype, (7, 33)), w.astype(np_dtype))
    assert raw.tobytes() == w.astype("<" + np.dtype(np_dtype).str[1:]).tobytes()


# ---- sizes ---------------------------------------------------------------------------------
def test_sizes():
    assert Q.BLOCK == {"q4_0": (32, 18), "q4_1": (32, 20), "q8_0": (32, 34)}
    assert Q.DTYPE_IDS == {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 8,
                           "q5_0": 6, "q5_1": 7, "q4_k": 12, "q5_k": 13, "q6_k": 14, "mxfp4": 39}
    assert [Q.block_bytes(d) for d in ("q4_0", "q4_1", "q8_0", "f16", "f32")] == [18, 20, 34, 64, 128]
    assert Q.tensor_nbytes("q4_0", (576, 1536), "tiled") == 576 * 48 * 18
    assert Q.tensor_nbytes("q8_0", (4, 9, 64)) == 36 * 68
    assert Q.tensor_nbytes("f32", (5,)) == 20
    assert Q.tensor_nbytes("f16", (3, 7)) == 42
    for bad in [("q4_0", (4, 33), "rows"), ("f32", (64,), "tiled"), ("q9", (4, 32), "rows"),
                ("q4_0", (4, 32), "cols"), ("f32", (-1, 4), "rows")]:
        with pytest.raises(Q.QuantError):
            Q.tensor_nbytes(*bad)


def test_dtype_table_is_ggmls():
    """cflow.dtypes, the one table cflow.quant and cflow.kquant read: GGML's ids and block sizes
    (f32 / f16 in 32-value blocks of one field), each block's fields laid end to end."""
    assert [d.name for d in dtypes.TABLE] == list(Q.DTYPES) and set(dtypes.BY_NAME) == set(Q.DTYPES)
    for d in dtypes.TABLE:
        ggml = GT[d.name.upper()]
        qb, bb = gguf.GGML_QUANT_SIZES[ggml]
        assert d.ggml_id == int(ggml), d.name
        assert (d.block_weights, d.block_bytes) == ((Q.QK, Q.QK * bb) if d.plain else (qb, bb)), d.name
        ends = [0] + [o + n for _, o, n in d.fields]
        assert [o for _, o, _ in d.fields] == ends[:-1] and ends[-1] == d.block_bytes, d.name
    # the views each module keeps are the table's rows
    assert {**Q.BLOCK, **K.KBLOCK} == {d.name: (d.block_weights, d.block_bytes) for d in dtypes.TABLE if not d.plain}
    assert Q.KQUANT_IDS == K.KDTYPE_IDS == {d.name: d.ggml_id for d in dtypes.TABLE if not d.produced}
    assert K.K_SUPER == ("q4_k", "q5_k", "q6_k") and K.QK_K == dtypes.QK_K == 256


# ---- tile layout ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["q4_0", "q4_1", "q8_0", "f16", "f32"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("cols", COLS)
def test_tile_round_trip_default_tile(dtype, rows, cols):
    rng = np.random.default_rng(rows * 10007 + cols)
    blocks = rng.integers(0, 256, (rows, Q.row_bytes(dtype, cols)), dtype=np.uint8)
    tiled = Q.tile_matrix(blocks, dtype, rows, cols)
    assert tiled.shape == (blocks.size,)
    np.testing.assert_array_equal(Q.untile_matrix(tiled, dtype, rows, cols), blocks)
    if rows * cols <= 129 * 576:
        np.testing.assert_array_equal(tiled, Q.tile_matrix_loops(blocks, dtype, rows, cols))


@pytest.mark.parametrize("dtype", ["q4_0", "q4_1", "q8_0", "f32"])
@pytest.mark.parametrize("tile", [(8, 32), (16, 64), (24, 96), (128, 256)])
@pytest.mark.parametrize("rows,cols", [(1, 32), (9, 96), (41, 160), (50, 288)])
def test_tile_matches_loop_nest_small_tiles(dtype, tile, rows, cols):
    rng = np.random.default_rng(rows + cols + tile[0])
    blocks = rng.integers(0, 256, (rows, Q.row_bytes(dtype, cols)), dtype=np.uint8)
    tiled = Q.tile_matrix(blocks, dtype, rows, cols, tile)
    np.testing.assert_array_equal(tiled, Q.tile_matrix_loops(blocks, dtype, rows, cols, tile))
    np.testing.assert_array_equal(Q.untile_matrix(tiled, dtype, rows, cols, tile), blocks)


def test_tile_first_chunk_is_scales_then_nibbles():
    # Spelled out by hand for Q4_0: the first chunk is rows 0..7 of block 0, 8 scales then 8x16 nibbles.
    blocks = np.random.default_rng(6).integers(0, 256, (9, Q.row_bytes("q4_0", 64)), dtype=np.uint8)
    tiled = Q.tile_matrix(blocks, "q4_0", 9, 64)
    assert tiled[:16].tobytes() == b"".join(blocks[r, 0:2].tobytes() for r in range(8))
    assert tiled[16:144].tobytes() == b"".join(blocks[r, 2:18].tobytes() for r in range(8))
    # next chunk: the same group, block 1
    assert tiled[144:146].tobytes() == blocks[0, 18:20].tobytes()
    # the short last group (row 8 alone) follows the full group's two chunks
    assert tiled[288:290].tobytes() == blocks[8, 0:2].tobytes()
    assert tiled[290:306].tobytes() == blocks[8, 2:18].tobytes()


def test_tile_rejects_bad_input():
    blocks = np.zeros((4, 18), np.uint8)
    with pytest.raises(Q.QuantError):
        Q.tile_matrix(blocks, "q4_0", 5, 32)
    with pytest.raises(Q.QuantError):
        Q.tile_matrix(blocks, "q4_0", 4, 32, tile=(12, 32))
    with pytest.raises(Q.QuantError):
        Q.tile_matrix(blocks, "q4_0", 4, 32, tile=(8, 48))
    with pytest.raises(Q.QuantError):
        Q.untile_matrix(np.zeros(71, np.uint8), "q4_0", 4, 32)
    with pytest.raises(Q.QuantError):
        Q.quantize(np.zeros((2, 40), np.float32), "q8_0")
    with pytest.raises(Q.QuantError):
        Q.quantize(np.zeros((2, 32), np.float32), "q5_0")


# ---- fused matrices ------------------------------------------------------------------------
def test_fuse_qkv_is_row_concat():
    q, k, v = (np.full((n, 18), i, np.uint8) for i, n in ((1, 16), (2, 8), (3, 8)))
    f = Q.fuse_qkv(q, k, v)
    assert f.shape == (32, 18) and (f[:16] == 1).all() and (f[16:24] == 2).all() and (f[24:] == 3).all()
    with pytest.raises(Q.QuantError):
        Q.fuse_qkv(q, k, np.zeros((8, 20), np.uint8))


def test_interleave_gate_up():
    F = 24
    gate = np.arange(F)[:, None].repeat(3, 1).astype(np.int32)
    up = gate + 1000
    f = Q.interleave_gate_up(gate, up)
    expect = np.concatenate([gate[0:8], up[0:8], gate[8:16], up[8:16], gate[16:24], up[16:24]])
    np.testing.assert_array_equal(f, expect)
    g2, u2 = Q.deinterleave_gate_up(f)
    np.testing.assert_array_equal(g2, gate)
    np.testing.assert_array_equal(u2, up)
    with pytest.raises(Q.QuantError):
        Q.interleave_gate_up(gate[:20], up[:20])


# ---- activations -----------------------------------------------------------------------------
def _quantize_act_loops(x: np.ndarray):
    f32 = np.float32
    qs, ds, ss = [], [], []
    for b in range(0, x.size, 32):
        blk = x[b:b + 32]
        amax = f32(0)
        for v in blk:
            amax = max(amax, f32(abs(v)))
        d = f32(amax / f32(127))
        inv = f32(1) / d if d != 0 else f32(0)
        q = []
        for v in blk:
            t = float(f32(v * inv))
            q.append(int(np.sign(t) * np.floor(abs(t) + 0.5)))
        qs += q
        ds.append(d)
        ss.append(f32(d * f32(sum(q))))
    return np.array(qs, np.int8), np.array(ds, np.float32), np.array(ss, np.float32)


@pytest.mark.parametrize("n,seed", [(32, 0), (96, 1), (1536, 2)])
def test_quantize_act_matches_loops(n, seed):
    x = _rand(n, seed)
    x[:32] *= 0 if n == 96 else 1  # one all-zero block
    q, d, s = Q.quantize_act(x)
    q2, d2, s2 = _quantize_act_loops(x)
    assert q.dtype == np.int8 and d.dtype == np.float32 and s.dtype == np.float32
    np.testing.assert_array_equal(q, q2)
    np.testing.assert_array_equal(d, d2)
    np.testing.assert_array_equal(s, s2)


def test_quantize_act_rounds_half_away_and_zero_block():
    x = np.zeros(64, np.float32)
    x[0] = 127.0  # d == 1 exactly, so x * id keeps its halves
    x[1:5] = [2.5, -2.5, 0.5, -0.5]
    q, d, s = Q.quantize_act(x)
    assert d[0] == 1.0 and list(q[:5]) == [127, 3, -3, 1, -1]
    assert d[1] == 0.0 and s[1] == 0.0 and not q[32:].any()
    assert s[0] == np.float32(127 + 3 - 3 + 1 - 1)


# ---- mat-vec oracles -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(GGML_TYPES))
@pytest.mark.parametrize("rows,cols", [(1, 32), (9, 288), (129, 576), (200, 1536)])
def test_matvec_ref_vs_dense(dtype, rows, cols):
    w = _rand((rows, cols), seed=rows)
    x = _rand(cols, seed=cols)
    tiled = Q.quantize_tiled(w, dtype)
    dense = Q.dequantize(Q.quantize(w, dtype), dtype, cols).astype(np.float64)
    y = Q.matvec_ref(tiled, dtype, rows, cols, x)
    assert y.dtype == np.float64 and y.shape == (rows,)
    np.testing.assert_allclose(y, dense @ x.astype(np.float64), rtol=1e-12, atol=1e-12)
    # the int8-activation oracle equals dense weights times the dequantized int8 activation
    qx, dx, _ = Q.quantize_act(x)
    xq = (qx.reshape(-1, 32).astype(np.float64) * dx[:, None].astype(np.float64)).reshape(-1)
    y8 = Q.matvec_q8_ref(tiled, dtype, rows, cols, x)
    np.testing.assert_allclose(y8, dense @ xq, rtol=1e-6, atol=1e-6 * np.abs(dense).sum(1).max())
    # and the activation quantization moves the result by no more than its error bound
    bound = np.abs(dense).sum(1) * (np.abs(x).max() / 127 / 2) * 1.01 + 1e-9
    assert (np.abs(y8 - y) <= bound).all()
    # the real quantization error is visible (the oracle does not just echo the float answer)
    assert not np.array_equal(y, w.astype(np.float64) @ x.astype(np.float64))


def test_matvec_ref_with_small_tiles_and_f32():
    w = _rand((41, 160), seed=9)
    x = _rand(160, seed=10)
    tiled = Q.tile_matrix(Q.quantize(w, "f32"), "f32", 41, 160, (16, 64))
    np.testing.assert_allclose(Q.matvec_ref(tiled, "f32", 41, 160, x, (16, 64)),
                               w.astype(np.float64) @ x.astype(np.float64), rtol=1e-12)
    with pytest.raises(Q.QuantError):
        Q.matvec_ref(tiled, "f32", 41, 160, x[:64], (16, 64))
