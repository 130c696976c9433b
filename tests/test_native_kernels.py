"""The C kernels (cflow._native) against their oracles.

Two chains, on odd sizes that hit every tail and ragged tile edge:
- every kernel table ("ref", "avx2", ...) equals the numpy oracle (cflow.quant.matvec_q8_ref,
  dequantize, float64 numpy math), so the layout has one definition: cflow.quant;
- every ISA table equals the scalar "ref" table.
Tests pass `isa=` explicitly, so they check every table this CPU can run whatever CFLOW_ISA
says; the default table (CFLOW_ISA honoured) is covered too. Run the file under CFLOW_ISA=ref
as well as without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

from cflow import _native
from cflow import quant as Q
from cflow.errors import CflowError

ISAS = _native.available_isas()  # "ref" first, best last
FAST_ISAS = [i for i in ISAS if i != "ref"]
ALL_ISAS = ISAS + [None]  # None: the default table

# Tolerances, relative to the matching magnitude bound (sum of |terms|), all in float32 units.
MATVEC_RTOL = 1e-5  # float32 accumulation over <= 48 blocks per row, 32 products per block
VEC_RTOL = 1e-5  # rmsnorm / matvec_f32 / rope / attention
EXP_RTOL = 2e-6  # softmax, silu: one vector exp (~2 ulp) plus a division

ROWS = [1, 3, 8, 31, 33, 255, 257, 1000]
COLS = [32, 64, 288, 576, 992, 1536]
NS = [1, 3, 31, 33, 255, 257, 1000]
QDTYPES = ["q4_0", "q4_1", "q8_0"]


def rng_for(*key) -> np.random.Generator:
    """A generator seeded by the test's parameters (stable across runs, unlike hash())."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def random_tiled(rng, rows, cols, dtype, tile=Q.TILE):
    w = rng.standard_normal((rows, cols), dtype=np.float32)
    w[rng.random(rows) < 0.1] *= 100  # rows of very different scale
    return Q.quantize_tiled(w, dtype, tile)


def bound(tiled, dtype, rows, cols, x, tile=Q.TILE):
    """sum_k |W[r,k]| * |x_q[k]|: the scale of row r's dot product, for relative errors."""
    w = Q.dequantize(Q.untile_matrix(tiled, dtype, rows, cols, tile), dtype, cols).astype(np.float64)
    qs, d, _ = Q.quantize_act(x)
    xq = qs.astype(np.float64) * np.repeat(d.astype(np.float64), Q.QK)
    return np.abs(w) @ np.abs(xq) + 1e-30


def assert_close(got, want, scale, rtol, what):
    err = np.abs(np.asarray(got, np.float64) - want) / scale
    assert err.max() <= rtol, f"{what}: max relative error {err.max():.3g} > {rtol:g} at {err.argmax()}"


def lo_of(p: int, window: int) -> int:
    """The first cache position the query at position p attends to (window 0: every one)."""
    return max(0, p - window + 1) if window else 0


def attention_oracle(q, k, v, n_heads, n_kv, pos0, window, sinks=None):
    """float64 causal attention of the queries q[i] (at positions pos0 + i, sliding window or 0)
    over the caches k, v [n_kv, seq, head_dim], and the bound its fp32 rounding is measured against;
    sinks: None, or [n_heads] logits that join each head's softmax denominator only (gpt-oss)."""
    hd = k.shape[2]
    k64, v64 = k.astype(np.float64), v.astype(np.float64)
    want, bound = np.zeros(q.shape), np.zeros(q.shape)
    for i in range(q.shape[0]):
        p = pos0 + i
        lo = lo_of(p, window)
        for h in range(n_heads):
            kv = h // (n_heads // n_kv)
            s = k64[kv, lo:p + 1] @ q[i, h * hd:(h + 1) * hd].astype(np.float64) / np.sqrt(hd)
            top = s.max() if sinks is None else max(s.max(), float(sinks[h]))
            w = np.exp(s - top)
            w /= w.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - top))
            want[i, h * hd:(h + 1) * hd] = w @ v64[kv, lo:p + 1]
            bound[i, h * hd:(h + 1) * hd] = w @ np.abs(v64[kv, lo:p + 1]) * (1 + np.abs(s).max())
    return want, bound + 1e-30


# ---- activation quantization ---------------------------------------------------------------
@pytest.mark.parametrize("n", [32, 64, 288, 992, 1536])
@pytest.mark.parametrize("isa", ALL_ISAS)
def test_quantize_act_bit_exact(isa, n):
    rng = rng_for("qa", n)
    x = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 300.0], n)).astype(np.float32)
    x[:32] = 0.0  # an all-zero block: d = 0, q = 0
    if n >= 64:  # a block with max 127, so 1/d = 1 and x lands on exact halves
        x[32:64] = np.linspace(-15.5, 15.5, 32, dtype=np.float32)
        x[63] = 127.0
    want = Q.quantize_act(x)
    got = _native.quantize_act(x, isa=isa)
    for name, g, w in zip(("qs", "d", "s"), got, want):
        assert g.dtype == w.dtype and np.array_equal(g, w), f"{name} differs from cflow.quant"


# ---- tiled mat-vec ---------------------------------------------------------------------------
@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", QDTYPES)
def test_matvec_matches_oracle_and_ref(dtype, rows, cols):
    rng = rng_for("mv", dtype, rows, cols)
    t = random_tiled(rng, rows, cols, dtype)
    x = rng.standard_normal(cols, dtype=np.float32)
    want = Q.matvec_q8_ref(t, dtype, rows, cols, x)
    scale = bound(t, dtype, rows, cols, x)
    ref = _native.matvec(t, Q.DTYPE_IDS[dtype], rows, cols, x, isa="ref")
    assert_close(ref, want, scale, MATVEC_RTOL, f"ref {dtype} {rows}x{cols}")
    for isa in FAST_ISAS + [None]:
        got = _native.matvec(t, Q.DTYPE_IDS[dtype], rows, cols, x, isa=isa)
        assert_close(got, want, scale, MATVEC_RTOL, f"{isa} {dtype} {rows}x{cols} vs oracle")
        assert_close(got, ref, scale, 2 * MATVEC_RTOL, f"{isa} {dtype} {rows}x{cols} vs ref")


@pytest.mark.parametrize("tile", [(8, 32), (16, 64), (24, 96), (128, 256), (256, 512)])
@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_matvec_other_tile_shapes(isa, dtype, tile):
    rows, cols = 61, 320  # ragged bands and tiles for every tile shape above
    rng = rng_for("tile", dtype, tile)
    t = random_tiled(rng, rows, cols, dtype, tile)
    x = rng.standard_normal(cols, dtype=np.float32)
    got = _native.matvec(t, Q.DTYPE_IDS[dtype], rows, cols, x, tile_rows=tile[0], tile_cols=tile[1], isa=isa)
    assert_close(got, Q.matvec_q8_ref(t, dtype, rows, cols, x, tile), bound(t, dtype, rows, cols, x, tile),
                 MATVEC_RTOL, f"{isa} {dtype} tile {tile}")


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_matvec_group_ranges_write_only_their_rows(isa, dtype):
    rows, cols = 203, 576  # 26 groups, the last one of 3 rows; 2 bands
    rng = rng_for("range", dtype)
    t = random_tiled(rng, rows, cols, dtype)
    x = rng.standard_normal(cols, dtype=np.float32)
    full = _native.matvec(t, Q.DTYPE_IDS[dtype], rows, cols, x, isa=isa)
    for g0, g1 in [(0, 1), (3, 17), (15, 16), (16, 17), (25, 26), (7, 26), (5, 5)]:
        part = _native.matvec(t, Q.DTYPE_IDS[dtype], rows, cols, x, isa=isa, g0=g0, g1=g1)
        r0, r1 = g0 * 8, min(g1 * 8, rows)
        assert np.array_equal(part[r0:r1], full[r0:r1]), f"rows of groups [{g0}, {g1}) differ"
        assert not part[:r0].any() and not part[r1:].any(), "wrote outside its rows"


def test_matvec_zero_and_extreme_activations():
    rows, cols = 40, 256
    rng = rng_for("extreme")
    for dtype in QDTYPES:
        t = random_tiled(rng, rows, cols, dtype)
        for x in (np.zeros(cols, np.float32), np.full(cols, -3e4, np.float32),
                  np.where(np.arange(cols) % 2, 1e-30, -1e4).astype(np.float32)):
            want = Q.matvec_q8_ref(t, dtype, rows, cols, x)
            for isa in ISAS:
                got = _native.matvec(t, Q.DTYPE_IDS[dtype], rows, cols, x, isa=isa)
                assert_close(got, want, bound(t, dtype, rows, cols, x), MATVEC_RTOL, f"{isa} {dtype}")


def test_matvec_q8_0_weight_minus_128():
    """GGML Q8_0 files may hold -128 (not produced by ggml's quantizer): |w| = 128 must work."""
    rows, cols = 8, 64
    blocks = Q.quantize(rng_for("m128").standard_normal((rows, cols), dtype=np.float32), "q8_0")
    blocks.reshape(rows, 2, 34)[:, :, 2:] = np.uint8(0x80)  # every weight -128
    t = Q.tile_matrix(blocks, "q8_0", rows, cols)
    x = np.linspace(-5, 5, cols, dtype=np.float32)
    want = Q.matvec_q8_ref(t, "q8_0", rows, cols, x)
    for isa in ISAS:
        got = _native.matvec(t, Q.DTYPE_IDS["q8_0"], rows, cols, x, isa=isa)
        assert_close(got, want, bound(t, "q8_0", rows, cols, x), MATVEC_RTOL, isa)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_simd_tables_agree_bitwise(dtype):
    """avx2 and avxvnni compute the same integer sums and the same float ops: identical bits."""
    if len(FAST_ISAS) < 2:
        pytest.skip(f"only {FAST_ISAS} on this CPU")
    rows, cols = 257, 992
    rng = rng_for("bitwise", dtype)
    t = random_tiled(rng, rows, cols, dtype)
    x = rng.standard_normal(cols, dtype=np.float32) * 50
    outs = [_native.matvec(t, Q.DTYPE_IDS[dtype], rows, cols, x, isa=isa) for isa in FAST_ISAS]
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def test_prefetch_switch_keeps_results():
    rows, cols = 300, 576
    rng = rng_for("prefetch")
    t = random_tiled(rng, rows, cols, "q4_0")
    x = rng.standard_normal(cols, dtype=np.float32)
    # every kernel, mode and table: tests/test_prefetch.py
    assert _native.get_prefetch() == _native.PREFETCH_DEFAULT, "prefetch starts in the kernels' default mode"
    off = {isa: _native.matvec(t, 2, rows, cols, x, isa=isa) for isa in ISAS}
    try:
        _native.set_prefetch(1024)
        assert _native.get_prefetch() == 1024
        for isa in ISAS:
            assert np.array_equal(_native.matvec(t, 2, rows, cols, x, isa=isa), off[isa])
    finally:
        _native.set_prefetch(_native.PREFETCH_DEFAULT)


# ---- batched mat-mat (prefill) ---------------------------------------------------------------
MM_BATCHES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17]  # every small-batch path of each table and its edges


@pytest.mark.parametrize("cols", [32, 288, 576, 1536])
@pytest.mark.parametrize("rows", [1, 3, 8, 31, 33, 257])
@pytest.mark.parametrize("dtype", QDTYPES)
def test_matmat_matches_oracle_and_matvec(dtype, rows, cols):
    """Every table's matmat equals cflow.quant per activation, and its own matvec bit for bit
    (same integer sums, same float operations per row), for every batch size."""
    rng = rng_for("mm", dtype, rows, cols)
    t = random_tiled(rng, rows, cols, dtype)
    X = rng.standard_normal((max(MM_BATCHES), cols), dtype=np.float32)
    X[1] *= 1e3  # activations of very different scale in one batch
    want = np.stack([Q.matvec_q8_ref(t, dtype, rows, cols, x) for x in X])
    scale = np.stack([bound(t, dtype, rows, cols, x) for x in X])
    for isa in ALL_ISAS:
        mv = np.stack([_native.matvec(t, Q.DTYPE_IDS[dtype], rows, cols, x, isa=isa) for x in X])
        for B in MM_BATCHES:
            got = _native.matmat(t, Q.DTYPE_IDS[dtype], rows, cols, X[:B], isa=isa)
            assert got.shape == (B, rows)
            assert_close(got, want[:B], scale[:B], MATVEC_RTOL, f"{isa} matmat {dtype} {rows}x{cols} B={B}")
            assert np.array_equal(got, mv[:B]), f"{isa} matmat differs from matvec, B={B}"


@pytest.mark.parametrize("tile", [(8, 32), (24, 96), (16, 544), (256, 1024)])
@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_matmat_tile_shapes_and_ranges(isa, dtype, tile):
    """Ragged bands and tiles, tiles wider than the unpack buffer (> 16 blocks: the other Q4
    path), and group ranges that write only their rows."""
    rows, cols = 203, 1088  # 26 groups, the last one of 3 rows
    rng = rng_for("mm-tile", dtype, tile)
    t = random_tiled(rng, rows, cols, dtype, tile)
    X = rng.standard_normal((7, cols), dtype=np.float32)
    kw = dict(tile_rows=tile[0], tile_cols=tile[1], isa=isa)
    mv = np.stack([_native.matvec(t, Q.DTYPE_IDS[dtype], rows, cols, x, **kw) for x in X])
    want = np.stack([Q.matvec_q8_ref(t, dtype, rows, cols, x, tile) for x in X])
    scale = np.stack([bound(t, dtype, rows, cols, x, tile) for x in X])
    full = _native.matmat(t, Q.DTYPE_IDS[dtype], rows, cols, X, **kw)
    assert_close(full, want, scale, MATVEC_RTOL, f"{isa} {dtype} tile {tile}")
    assert np.array_equal(full, mv)
    pool = _native.Pool(3)
    assert np.array_equal(_native.matmat(t, Q.DTYPE_IDS[dtype], rows, cols, X, pool=pool, **kw), full)
    for g0, g1 in [(0, 1), (3, 17), (15, 16), (25, 26), (7, 26), (5, 5)]:
        part = _native.matmat(t, Q.DTYPE_IDS[dtype], rows, cols, X, g0=g0, g1=g1, **kw)
        r0, r1 = g0 * 8, min(g1 * 8, rows)
        assert np.array_equal(part[:, r0:r1], full[:, r0:r1]), f"rows of groups [{g0}, {g1}) differ"
        assert not part[:, :r0].any() and not part[:, r1:].any(), "wrote outside its rows"


@pytest.mark.parametrize("d_ff,cols,tile", [(8, 32, Q.TILE), (72, 288, Q.TILE), (1536, 576, Q.TILE),
                                            (40, 96, (8, 32)), (56, 1088, (24, 1024))])
@pytest.mark.parametrize("dtype", QDTYPES)
def test_gate_up_mm_equals_gate_up(dtype, d_ff, cols, tile):
    """The batched fused SwiGLU front half equals the one-activation kernel bit for bit, for
    batches that do and do not fill its activation chunks, and for pair ranges."""
    rng = rng_for("gumm", dtype, d_ff, cols, tile)
    rows = 2 * d_ff
    t = random_tiled(rng, rows, cols, dtype, tile)
    X = rng.standard_normal((70, cols), dtype=np.float32)  # 70 = 64 + 6: a partial chunk
    kw = dict(tile_rows=tile[0], tile_cols=tile[1])
    for isa in ALL_ISAS:
        one = np.stack([_native.gate_up(t, Q.DTYPE_IDS[dtype], rows, cols, x, isa=isa, **kw) for x in X])
        for B in (1, 3, 6, 16, 64, 70):
            got = _native.gate_up_mm(t, Q.DTYPE_IDS[dtype], rows, cols, X[:B], isa=isa, **kw)
            assert np.array_equal(got, one[:B]), f"{isa} gate_up_mm {dtype} B={B}"
        n_pairs = rows // 16
        part = _native.gate_up_mm(t, Q.DTYPE_IDS[dtype], rows, cols, X, isa=isa, p0=n_pairs // 2, **kw)
        h = n_pairs // 2 * 8
        assert np.array_equal(part[:, h:], one[:, h:]) and not part[:, :h].any()


def test_matmat_bad_input():
    t = Q.quantize_tiled(np.ones((16, 64), np.float32), "q4_0")
    for f in (lambda: _native.matmat(t, 2, 16, 64, np.ones((2, 32), np.float32)),  # wrong width
              lambda: _native.matmat(t, 2, 16, 64, np.ones((0, 64), np.float32)),  # no rows
              lambda: _native.matmat(t, 2, 16, 64, np.ones((2, 64), np.float32), g0=1, g1=3),
              lambda: _native.gate_up_mm(t, 2, 16, 64, np.ones((2, 64), np.float32), p0=0, p1=2)):
        with pytest.raises(CflowError):
            f()


# ---- fused gate+up+SiLU --------------------------------------------------------------------
def silu(v):
    return v / (1.0 + np.exp(-v))


@pytest.mark.parametrize("d_ff,cols,tile", [(8, 32, Q.TILE), (24, 64, Q.TILE), (72, 288, Q.TILE),
                                            (1536, 576, Q.TILE), (40, 96, (8, 32)), (56, 320, (24, 64))])
@pytest.mark.parametrize("dtype", QDTYPES)
def test_gate_up_matches_oracle(dtype, d_ff, cols, tile):
    rng = rng_for("gu", dtype, d_ff, cols, tile)
    gate = Q.quantize(rng.standard_normal((d_ff, cols), dtype=np.float32), dtype)
    up = Q.quantize(rng.standard_normal((d_ff, cols), dtype=np.float32), dtype)
    rows = 2 * d_ff
    t = Q.tile_matrix(Q.interleave_gate_up(gate, up), dtype, rows, cols, tile)
    x = rng.standard_normal(cols, dtype=np.float32)
    g, u = Q.deinterleave_gate_up(Q.matvec_q8_ref(t, dtype, rows, cols, x, tile))
    gs, us = Q.deinterleave_gate_up(bound(t, dtype, rows, cols, x, tile))
    want = silu(g) * u
    # error of silu(g)*u from errors eg, eu: |silu'(g)| <= 1.1, so <= 1.1*eg*|u| + eu*|silu(g)|
    scale = 1.1 * gs * np.abs(u) + us * np.abs(silu(g)) + np.abs(want) * EXP_RTOL / MATVEC_RTOL + 1e-30
    ref = _native.gate_up(t, Q.DTYPE_IDS[dtype], rows, cols, x, tile_rows=tile[0], tile_cols=tile[1], isa="ref")
    assert_close(ref, want, scale, MATVEC_RTOL, f"ref gate_up {dtype}")
    for isa in FAST_ISAS + [None]:
        got = _native.gate_up(t, Q.DTYPE_IDS[dtype], rows, cols, x, tile_rows=tile[0], tile_cols=tile[1], isa=isa)
        assert_close(got, want, scale, MATVEC_RTOL, f"{isa} gate_up {dtype}")
        assert_close(got, ref, scale, 2 * MATVEC_RTOL, f"{isa} gate_up vs ref {dtype}")
        half = rows // 16 // 2  # a pair range writes only its outputs
        part = _native.gate_up(t, Q.DTYPE_IDS[dtype], rows, cols, x, tile_rows=tile[0], tile_cols=tile[1],
                               isa=isa, p0=half, p1=rows // 16)
        assert np.array_equal(part[half * 8:], got[half * 8:]) and not part[:half * 8].any()


# ---- embedding rows ------------------------------------------------------------------------
@pytest.mark.parametrize("rows,cols,tile", [(1, 32, Q.TILE), (203, 576, Q.TILE), (61, 320, (24, 96)),
                                            (1000, 1536, Q.TILE)])
@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_embed_row_equals_dequantize(isa, dtype, rows, cols, tile):
    rng = rng_for("emb", dtype, rows, cols)
    t = random_tiled(rng, rows, cols, dtype, tile)
    dense = Q.dequantize(Q.untile_matrix(t, dtype, rows, cols, tile), dtype, cols)
    for r in sorted({0, rows - 1, rows // 2, min(rows - 1, 7), min(rows - 1, 8)}):
        got = _native.embed_row(t, Q.DTYPE_IDS[dtype], rows, cols, r, tile_rows=tile[0], tile_cols=tile[1], isa=isa)
        assert np.array_equal(got, dense[r]), f"row {r} differs"  # exact: products fit in float32


# ---- fp32 vector kernels -------------------------------------------------------------------
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("isa", ALL_ISAS)
def test_vector_kernels(isa, n):
    rng = rng_for("vec", n)
    a = rng.standard_normal(n, dtype=np.float32) * 3
    a64 = a.astype(np.float64)
    w = rng.standard_normal(n, dtype=np.float32)
    want = a64 / np.sqrt(np.mean(a64 * a64) + 1e-5) * w
    got = _native.rmsnorm(a, w, 1e-5, isa=isa)
    assert_close(got, want, np.abs(want) + 1e-30, VEC_RTOL, "rmsnorm")
    e = np.exp(a64 - a64.max())
    assert_close(_native.softmax(a, isa=isa), e / e.sum(), e / e.sum() + 1e-30, EXP_RTOL * 4, "softmax")


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_geglu(isa):
    """gelu_tanh(gate) * up over interleaved pairs (gate group, up group) against float64, from
    deep negative (the output underflows to ~0) to large positive inputs (where gelu(x) = x)."""
    rng = rng_for("geglu", 40)
    x = np.concatenate([np.linspace(-12, 12, 161), rng.standard_normal(159) * 3]).astype(np.float32)
    u = rng.standard_normal(x.size, dtype=np.float32)
    gu = np.stack([x.reshape(-1, 8), u.reshape(-1, 8)], axis=1).reshape(-1)  # [pairs, gate 8 | up 8]
    x64, u64 = x.astype(np.float64), u.astype(np.float64)
    want = 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3))) * u64
    # the tanh form loses the relative digits of 1 + tanh for x << 0; the error stays below
    # float32's resolution of the operands
    assert_close(_native.geglu(gu, isa=isa), want, np.abs(x64 * u64) * 1e-1 + 1e-30, EXP_RTOL * 4, "geglu")
    with pytest.raises(ValueError, match="pairs of 8"):
        _native.geglu(gu[:12], isa=isa)


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_swiglu_oai(isa):
    """OpenAI's clamped SwiGLU (gpt-oss: alpha 1.702, limit 7) over interleaved pairs against
    float64, gates and ups from -12 to 12 so both clamps bite; and the clamps are seen: the same
    kernel with a limit past every input gives the unclamped values, far from the clamped ones."""
    rng = rng_for("swiglu_oai", 41)
    x = np.concatenate([np.linspace(-12, 12, 161), rng.standard_normal(159) * 5]).astype(np.float32)
    u = np.concatenate([np.linspace(12, -12, 161), rng.standard_normal(159) * 5]).astype(np.float32)
    gu = np.stack([x.reshape(-1, 8), u.reshape(-1, 8)], axis=1).reshape(-1)  # [pairs, gate 8 | up 8]

    def want(limit, alpha=1.702):
        g = np.minimum(x.astype(np.float64), limit)
        y = np.clip(u.astype(np.float64), -limit, limit)
        return g / (1 + np.exp(-alpha * g)) * (y + 1)

    w = want(7.0)
    got = _native.swiglu_oai(gu, 1.702, 7.0, isa=isa)
    assert_close(got, w, np.abs(w) + 1e-30, EXP_RTOL * 4, "swiglu_oai")
    loose = _native.swiglu_oai(gu, 1.702, 100.0, isa=isa)
    assert_close(loose, want(100.0), np.abs(want(100.0)) + 1e-30, EXP_RTOL * 4, "swiglu_oai unclamped")
    bites = np.abs(w - want(100.0)) > 0.1  # where a clamp changes the value (not where the gate is ~0)
    assert bites.sum() > 50 and np.all(np.abs(loose - got)[bites] > 0.05)
    with pytest.raises(ValueError, match="pairs of 8"):
        _native.swiglu_oai(gu[:12], isa=isa)


# one row: a plain dot product, over every vector-body / tail split (the router's E x d is small)
@pytest.mark.parametrize("rows,cols", [(1, n) for n in NS] + [(3, 33), (8, 576), (64, 257)])
@pytest.mark.parametrize("isa", ALL_ISAS)
def test_matvec_f32(isa, rows, cols):
    rng = rng_for("f32", rows, cols)
    W = rng.standard_normal((rows, cols), dtype=np.float32)
    x = rng.standard_normal(cols, dtype=np.float32)
    W64, x64 = W.astype(np.float64), x.astype(np.float64)
    assert_close(_native.matvec_f32(W, x, isa=isa), W64 @ x64, np.abs(W64) @ np.abs(x64), VEC_RTOL, "matvec_f32")


def test_softmax_extremes():
    x = np.array([-1e30, 0.0, 80.0, 80.0, -80.0, 1.0, 2.0, 3.0, 4.0], np.float32)
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max())
    for isa in ISAS:
        got = _native.softmax(x, isa=isa)
        assert np.all(np.isfinite(got)) and abs(got.sum() - 1) < 1e-6
        assert_close(got, e / e.sum(), e / e.sum() + 1e-30, EXP_RTOL * 4, isa)


# ---- rope and attention --------------------------------------------------------------------
def rope_oracle(x, n_heads, hd, pos, theta):
    j = np.arange(hd // 2)
    ang = pos * theta ** (-2.0 * j / hd)
    c, s = np.cos(ang), np.sin(ang)
    x = x.astype(np.float64).reshape(n_heads, hd)
    a, b = x[:, : hd // 2], x[:, hd // 2:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=1).reshape(-1)


@pytest.mark.parametrize("n_heads,hd", [(1, 2), (3, 6), (9, 64), (4, 34), (2, 128)])
@pytest.mark.parametrize("pos", [0, 1, 17, 2047])
@pytest.mark.parametrize("isa", ALL_ISAS)
def test_rope(isa, n_heads, hd, pos):
    x = rng_for("rope", n_heads, hd).standard_normal(n_heads * hd, dtype=np.float32)
    want = rope_oracle(x, n_heads, hd, pos, 10000.0)
    pair = np.abs(x.astype(np.float64)).reshape(n_heads, 2, hd // 2).sum(axis=1)
    scale = np.concatenate([pair, pair], axis=1).reshape(-1) + 1e-30
    assert_close(_native.rope(x, n_heads, hd, pos, 10000.0, isa=isa), want, scale, VEC_RTOL, "rope")


@pytest.mark.parametrize("n_heads,n_kv,hd", [(9, 3, 64), (4, 4, 32), (8, 1, 16), (6, 2, 24), (5, 1, 8),
                                             (2, 1, 12)])
@pytest.mark.parametrize("n_pos", [1, 7, 100])
@pytest.mark.parametrize("isa", ALL_ISAS)
def test_attention(isa, n_heads, n_kv, hd, n_pos):
    rng = rng_for("attn", n_heads, n_kv, hd, n_pos)
    max_seq = 128
    q = rng.standard_normal(n_heads * hd, dtype=np.float32)
    k = rng.standard_normal((n_kv, max_seq, hd)).astype(np.float16)
    v = rng.standard_normal((n_kv, max_seq, hd)).astype(np.float16)
    k[:, n_pos:] = np.float16(np.inf)  # positions past n_pos must never be read
    v[:, n_pos:] = np.float16(np.nan)
    want, b = attention_oracle(q[None], k, v, n_heads, n_kv, n_pos - 1, 0)  # the query at position n_pos - 1
    want, b = want[0], b[0]
    got = _native.attention(q, k, v, n_heads, n_kv, n_pos, isa=isa)
    assert_close(got, want, b, VEC_RTOL, f"attention {isa}")
    # head ranges that cut GQA groups (2 and 4 threads over 9 heads in 3 groups) must give the
    # same bits: a group processed together (K and V rows read once) computes each head as alone
    for n in (2, 3, 4):
        pool = _native.Pool(n)
        got_mt = _native.attention(q, k.view(np.uint16), v.view(np.uint16), n_heads, n_kv, n_pos, isa=isa,
                                   pool=pool)
        assert np.array_equal(got_mt, got), f"splitting heads over {n} threads changed the result"


# ---- top-k and fp16 ------------------------------------------------------------------------
@pytest.mark.parametrize("isa", ALL_ISAS)
def test_topk(isa):
    rng = rng_for("topk")
    # odd sizes around the 8-wide vector body and its tail; the stack-copy limit (256) and past it
    for n, k in [(1, 1), (3, 2), (7, 7), (8, 2), (9, 4), (31, 5), (33, 33), (64, 8), (256, 3), (300, 6)]:
        x = rng.standard_normal(n).astype(np.float32)
        idx, val = _native.topk(x, k, isa=isa)
        want = np.argsort(-x, kind="stable")[:k]
        assert np.array_equal(idx, want) and np.array_equal(val, x[want]), (n, k)
        ref_idx, _ = _native.topk(x, k, isa="ref")
        assert np.array_equal(idx, ref_idx)
    # ties go to the lower index, also across the vector body and the tail
    idx, _ = _native.topk(np.array([1, 3, 3, 2, 3], np.float32), 3, isa=isa)
    assert idx.tolist() == [1, 2, 4], "ties go to the lower index"
    x = np.zeros(19, np.float32)
    x[[2, 9, 17]] = 5.0
    assert _native.topk(x, 4, isa=isa)[0].tolist() == [2, 9, 17, 0]
    # infinities are ordinary values; all remaining -inf still picks the lowest untaken index
    x = np.full(12, -np.inf, np.float32)
    x[[4, 10]] = [np.inf, 1.0]
    assert _native.topk(x, 4, isa=isa)[0].tolist() == [4, 10, 0, 1]
    with pytest.raises(ValueError, match="NaN"):
        _native.topk(np.array([1.0, np.nan], np.float32), 1, isa=isa)


def all_halves():
    """Every fp16 bit pattern, and its float32 value (numpy's conversion, the oracle)."""
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    return bits, bits.view(np.float16).astype(np.float32)


def test_half_to_float_bit_exact():
    """cf_half_to_float, which every kernel reads fp16 scales and cached K/V with (the ISA
    kernels' vcvtph2ps is the hardware's own), on every fp16 bit pattern."""
    bits, want = all_halves()
    got = _native.f16_to_f32(bits)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan) and np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_f32_to_f16_bit_exact(isa):
    _, want = all_halves()
    nan = np.isnan(want)
    rng = rng_for("f16")
    fin = np.unique(want[np.isfinite(want)].astype(np.float64))  # all finite halves, ascending
    x = np.concatenate([
        want[~nan],  # every half value round-trips
        (fin[:-1] + np.diff(fin) / 2).astype(np.float32),  # every tie: must go to the even neighbour
        rng.standard_normal(1001).astype(np.float32) * np.float32(2.0) ** rng.integers(-30, 18, 1001),
        np.array([65504, 65519.99, 65520, -65520, 1e9, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0001, 3 * 2.0**-26,
                  5.96e-8, 6.1e-5, 6.097555e-5, np.inf, -np.inf, 0.0, -0.0], np.float32),
    ]).astype(np.float32)
    got = _native.f32_to_f16(x, isa=isa)
    with np.errstate(over="ignore"):  # numpy warns on the values that become inf, as it should
        want16 = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(got, want16), "fp32 -> fp16 must round to nearest even"
    assert np.isnan(_native.f32_to_f16(np.array([np.nan] * 9, np.float32), isa=isa).view(np.float16)).all()
    for n in NS:  # every vector-body / tail split, over the random and special values at the end
        assert np.array_equal(_native.f32_to_f16(x[-n:], isa=isa), want16[-n:]), n


# ---- dispatch and input checks -------------------------------------------------------------
def test_dispatch_reports_tables():
    assert ISAS[0] == "ref" and _native.isa() in ISAS
    feats = _native.cpu_features()
    if feats["avx2"] and feats["fma"] and feats["f16c"]:
        assert "avx2" in ISAS
    if all(feats[f] for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni")):
        assert ISAS[-1] == "avx512"  # the best table where the CPU (and the OS's xcr0) allow it
    with pytest.raises(CflowError):
        _native.softmax(np.ones(3, np.float32), isa="no-such-isa")


@pytest.mark.parametrize("env,want", [("ref", "ref"), ("auto", None), ("bogus", None)])
def test_cflow_isa_environment_variable(env, want):
    out = subprocess.run([sys.executable, "-c", "from cflow import _native; print(_native.isa())"],
                         env={**os.environ, "CFLOW_ISA": env}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == (want or ISAS[-1])


def test_bad_input_raises_named_errors():
    t = Q.quantize_tiled(np.ones((8, 64), np.float32), "q4_0")
    x = np.ones(64, np.float32)
    cases = [
        lambda: _native.matvec(t[:-1], 2, 8, 64, x),  # wrong byte count
        lambda: _native.matvec(t, 2, 8, 64, x[:32]),  # wrong x length
        lambda: _native.matvec(t, 5, 8, 64, x),  # unknown dtype
        lambda: _native.matvec(t, 2, 8, 60, x[:60]),  # cols not a multiple of 32
        lambda: _native.matvec(t, 2, 8, 64, x, tile_rows=12),  # tile rows not a multiple of 8
        lambda: _native.matvec(t, 2, 8, 64, x, g0=0, g1=2),  # group range past the end
        lambda: _native.gate_up(t, 2, 8, 64, x),  # 8 rows cannot hold gate and up groups
        lambda: _native.embed_row(t, 2, 8, 64, 8),
        lambda: _native.quantize_act(np.ones(33, np.float32)),
        lambda: _native.topk(x, 65),
        lambda: _native.attention(np.ones(64, np.float32), np.ones((1, 4, 64), np.float32),
                                  np.ones((1, 4, 64), np.float32), 1, 1, 1),  # fp32 caches
    ]
    for i, f in enumerate(cases):
        with pytest.raises(CflowError) as e:
            f()
        assert isinstance(e.value, ValueError) and str(e.value), f"case {i}"
