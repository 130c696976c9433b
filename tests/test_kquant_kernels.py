"""The C kernels of Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and MXFP4 (cflow._native) against cflow.kquant.

Two chains, as tests/test_native_kernels.py does for Q4_0 / Q4_1 / Q8_0:
- the "ref" table equals the numpy oracle kquant.matvec_k_q8_ref (the exact integer dots of
  kquant.kquant_dots, scaled), its quantize_act_k is kquant.quantize_act_k bit for bit and its
  embed_row is kquant.dequantize_k bit for bit;
- every ISA table ("avx2", "avxvnni", ...) equals the ref table and the oracle, and its batched
  kernels equal its own mat-vec bit for bit;
- the fast tables' K-quant mat-vecs and gate/ups (AVX2-family, and the avx512 table's own 512-bit
  ones from kernels_kquant_avx512.c) equal each other bit for bit, also at the integer extremes.
Shapes: rows that are not multiples of 8 (a short last group), band tails, several tiles across
with a narrower last one, tile shapes other than the default, partial group / pair ranges. Then
every tensor of the Q4_K_M / Q5_K_M / Q6_K files llama.cpp writes (tests/test_kquant.py's files).
"""

from __future__ import annotations

import numpy as np
import pytest

from cflow import _native
from cflow import kquant as K
from cflow import quant as Q
from cflow.errors import CflowError

from test_kquant import file_matrices, kquant_files, random_blocks  # noqa: F401 (a fixture)
from test_native_kernels import EXP_RTOL, MATVEC_RTOL, assert_close, rng_for, silu

ISAS = _native.available_isas()  # "ref" first, best last
FAST_ISAS = [i for i in ISAS if i != "ref"]
ALL_ISAS = ISAS + [None]  # None: the default table
NEW = list(K.KDTYPES)

# (rows, cols, tile) per family: short last groups (1, 7, 13, 203), band tails (129 = 128 + 1,
# 203 = 3 * 64 + 11), several tiles with a narrower last one (1280 = 512 + 512 + 256,
# 576 = 256 + 256 + 64, 992 = 3 * 288 + 128), non-default tiles.
SHAPES_K = [(1, 256, (128, 256)), (7, 512, (16, 512)), (13, 768, (8, 256)), (129, 256, (128, 256)),
            (136, 1280, (16, 512)), (203, 768, (64, 512)), (40, 1024, (24, 1024))]
SHAPES_32 = [(1, 32, (128, 256)), (7, 576, (128, 256)), (13, 288, (8, 64)), (129, 576, (128, 256)),
             (203, 992, (64, 288)), (40, 320, (24, 96))]
MM_BATCHES = (1, 2, 3, 5, 8, 16, 17)  # 16 / 17: the avx512 small-batch path's last / the batched kernels; 17: more than one pass of the AVX2 mat-mat's 16 activations


def shapes(dtype):
    return SHAPES_K if dtype in K.K_SUPER else SHAPES_32


def tiled(dtype, rows, cols, tile, seed):
    """Random blocks of every bit pattern (tests/test_kquant.py), tiled."""
    return K.tile_kquant(random_blocks(dtype, rows, cols, seed), dtype, rows, cols, tile)


def dense(t, dtype, rows, cols, tile):
    return K.dequantize_k(K.untile_kquant(t, dtype, rows, cols, tile), dtype, cols)


def xhat(dtype, x):
    """The activation as the kernels of `dtype` see it, dequantized (float64)."""
    if dtype in K.K_SUPER:
        qs, d, _ = K.quantize_act_k(x)
        return (qs.reshape(-1, K.QK_K).astype(np.float64) * d[:, None]).reshape(-1)
    qs, d, _ = Q.quantize_act(x)
    return (qs.reshape(-1, Q.QK).astype(np.float64) * d[:, None]).reshape(-1)


def bound(w, dtype, x):
    """sum_k |W[r,k]| * |x_hat[k]|: the scale of row r's dot product, for relative errors."""
    return np.abs(w.astype(np.float64)) @ np.abs(xhat(dtype, x)) + 1e-30


def kw(tile, isa):
    return dict(tile_rows=tile[0], tile_cols=tile[1], isa=isa)


# ---- the 256-block activation --------------------------------------------------------------
@pytest.mark.parametrize("isa", ALL_ISAS)
def test_quantize_act_k_bit_exact(isa):
    rng = rng_for("qak")
    n = 1792  # 7 blocks
    x = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 300.0], n)).astype(np.float32)
    x[:256] = 0.0  # d = 0, q = 0, sums 0
    x[256:512] = np.linspace(-126.5, 126.5, 256, dtype=np.float32).round() + 0.5  # exact halves
    x[256], x[511] = -127.0, 127.0  # max 127: 1/d = 1, every other value a tie
    x[512:768] = rng.choice([-127.0, 127.0], 256).astype(np.float32)  # every sum at its extreme
    x[768:1024] *= np.float32(1e-30)  # tiny inputs (d ~ 1e-32, still a normal float)
    x[1024:1280] *= np.float32(1e30)  # huge ones
    x[1300] = -5e4  # the largest |x| negative
    want = K.quantize_act_k(x)
    got = _native.quantize_act_k(x, isa=isa)
    for name, g, w in zip(("qk", "dk", "bsums"), got, want):
        assert g.dtype == w.dtype and np.array_equal(g, w), f"{name} differs from cflow.kquant"
    assert got[2][32:48].tolist() == K.quantize_act_k(x[512:768])[2].tolist()
    with pytest.raises(CflowError):
        _native.quantize_act_k(np.zeros(576, np.float32), isa=isa)


# ---- mat-vec -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", NEW)
def test_matvec_matches_oracle_and_ref(dtype):
    for i, (rows, cols, tile) in enumerate(shapes(dtype)):
        t = tiled(dtype, rows, cols, tile, seed=i)
        w = dense(t, dtype, rows, cols, tile)
        rng = rng_for("kmv", dtype, i)
        for x in (rng.standard_normal(cols, dtype=np.float32),
                  (rng.standard_normal(cols) * rng.choice([1e-3, 1.0, 1e3], cols)).astype(np.float32)):
            want = K.matvec_k_q8_ref(t, dtype, rows, cols, x, tile)
            scale = bound(w, dtype, x)
            ref = _native.matvec(t, K.KDTYPE_IDS[dtype], rows, cols, x, **kw(tile, "ref"))
            assert_close(ref, want, scale, MATVEC_RTOL, f"ref {dtype} {rows}x{cols} tile {tile}")
            for isa in FAST_ISAS + [None]:
                got = _native.matvec(t, K.KDTYPE_IDS[dtype], rows, cols, x, **kw(tile, isa))
                assert_close(got, want, scale, MATVEC_RTOL, f"{isa} {dtype} {rows}x{cols} tile {tile}")
                assert_close(got, ref, scale, 2 * MATVEC_RTOL, f"{isa} {dtype} {rows}x{cols} vs ref")


@pytest.mark.parametrize("dtype", NEW)
def test_matvec_zero_activation_and_ranges(dtype):
    rows, cols, tile = 203, 512 if dtype in K.K_SUPER else 576, (64, 256)  # 26 groups, 4 bands
    t = tiled(dtype, rows, cols, tile, seed=7)
    x = rng_for("krange", dtype).standard_normal(cols, dtype=np.float32)
    for isa in ISAS:
        assert not _native.matvec(t, K.KDTYPE_IDS[dtype], rows, cols, np.zeros(cols, np.float32), **kw(tile, isa)).any()
        full = _native.matvec(t, K.KDTYPE_IDS[dtype], rows, cols, x, **kw(tile, isa))
        pool = _native.Pool(3)
        assert np.array_equal(_native.matvec(t, K.KDTYPE_IDS[dtype], rows, cols, x, pool=pool, **kw(tile, isa)), full)
        for g0, g1 in [(0, 1), (3, 17), (7, 8), (8, 9), (25, 26), (7, 26), (5, 5)]:
            part = _native.matvec(t, K.KDTYPE_IDS[dtype], rows, cols, x, g0=g0, g1=g1, **kw(tile, isa))
            r0, r1 = g0 * 8, min(g1 * 8, rows)
            assert np.array_equal(part[r0:r1], full[r0:r1]), f"{isa}: rows of groups [{g0}, {g1}) differ"
            assert not part[:r0].any() and not part[r1:].any(), f"{isa}: wrote outside its rows"


@pytest.mark.parametrize("dtype", NEW)
def test_prefetch_does_not_change_results(dtype):
    """Q6_K prefetches on its own when no distance is set, every dtype with one when it is set:
    neither may change a bit (the same integers and float operations either way)."""
    rows, cols, tile = 136, 1280 if dtype in K.K_SUPER else 576, (16, 512 if dtype in K.K_SUPER else 256)
    t = tiled(dtype, rows, cols, tile, seed=9)
    x = rng_for("kpf", dtype).standard_normal(cols, dtype=np.float32)
    before = _native.get_prefetch()
    try:
        for isa in ISAS:
            _native.set_prefetch(0)
            want = _native.matvec(t, K.KDTYPE_IDS[dtype], rows, cols, x, **kw(tile, isa))
            for ahead in (64, 1024, 8192):
                _native.set_prefetch(ahead)
                got = _native.matvec(t, K.KDTYPE_IDS[dtype], rows, cols, x, **kw(tile, isa))
                assert np.array_equal(got, want), f"{isa} {dtype}: prefetch {ahead} changed the result"
    finally:
        _native.set_prefetch(before)


def extreme_blocks(dtype, rows, cols, quants, scales, seed):
    """random_blocks with every quant byte (qs / ql / qh) set to `quants` and every scale byte to
    `scales` (K-quants): the extremes of the integer partials (docs/kquants.md, bounds)."""
    b = random_blocks(dtype, rows, cols, seed).reshape(rows, cols // K.block_geometry(dtype)[0], -1)
    for name, (o, n) in K.GGML_FIELDS[dtype].items():
        if name in ("qs", "ql", "qh", "scales"):
            b[..., o:o + n] = scales if name == "scales" else quants
    return b.reshape(rows, -1)


@pytest.mark.parametrize("dtype", NEW)
def test_fast_tables_agree_bit_for_bit(dtype):
    """Every fast table's mat-vec and gate/up of these dtypes form the same exact integers and the
    same float operations per row (the 512-bit ones of the avx512 table included), so they agree
    bit for bit, here also at the extremes: largest quants (Q5_x / Q5_K: 31, Q6_K: 63) or smallest
    (Q6_K: 0, i.e. -32), scales 63 / -128 / 127, activations all +-127 of one sign (every per-4 sum
    and block sum at its bound), on odd shapes with short last groups, band tails and narrower last
    tiles."""
    if len(FAST_ISAS) < 2:
        pytest.skip("one fast table on this CPU")
    fills = [(0xFF, 0xFF), (0x00, 0x80), (0xFF, 0x7F), (0x00, 0x3F)]
    if dtype == "mxfp4":  # nibble 7 (+6, doubled 12): the largest unsigned operand, value + 12 = 24
        fills.append((0x77, 0x00))
    qb = K.block_geometry(dtype)[0]
    for i, (rows, cols, tile) in enumerate(shapes(dtype)):
        rng = rng_for("kagree", dtype, i)
        for j, blocks in enumerate([random_blocks(dtype, rows, cols, seed=40 + i)] +
                                   [extreme_blocks(dtype, rows, cols, q, sc, seed=50 + i) for q, sc in fills]):
            t = K.tile_kquant(blocks, dtype, rows, cols, tile)
            w = dense(t, dtype, rows, cols, tile)
            sign = np.where(rng.random(cols // qb) < 0.5, -1.0, 1.0).repeat(qb)
            for x in (rng.standard_normal(cols, dtype=np.float32), (sign * 3.0).astype(np.float32)):
                got = {isa: _native.matvec(t, K.KDTYPE_IDS[dtype], rows, cols, x, **kw(tile, isa)) for isa in FAST_ISAS}
                first = FAST_ISAS[0]
                for isa in FAST_ISAS[1:]:
                    assert np.array_equal(got[isa], got[first]), f"{isa} != {first}: {dtype} {rows}x{cols} case {j}"
                want = K.matvec_k_q8_ref(t, dtype, rows, cols, x, tile)
                assert_close(got[first], want, bound(w, dtype, x), MATVEC_RTOL, f"{dtype} {rows}x{cols} case {j}")
    gu_cases = ([(144, 768, (16, 512)), (80, 512, (24, 256))] if dtype in K.K_SUPER else
                [(144, 576, (16, 256)), (80, 320, (24, 96))])
    for i, (rows, cols, tile) in enumerate(gu_cases):  # gate/up matrices: 2 * d_ff rows
        x = rng_for("kagree_gu", dtype, i).standard_normal(cols, dtype=np.float32)
        for j, blocks in enumerate([random_blocks(dtype, rows, cols, seed=60 + i)] +
                                   [extreme_blocks(dtype, rows, cols, q, sc, seed=70 + i) for q, sc in fills]):
            t = K.tile_kquant(blocks, dtype, rows, cols, tile)
            gu = {isa: _native.gate_up(t, K.KDTYPE_IDS[dtype], rows, cols, x, **kw(tile, isa)) for isa in FAST_ISAS}
            for isa in FAST_ISAS[1:]:
                assert np.array_equal(gu[isa], gu[FAST_ISAS[0]]), f"{isa} gate_up {dtype} {rows}x{cols} case {j}"


# ---- the batched forms ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", NEW)
def test_matmat_equals_matvec(dtype):
    """matmat == matvec per activation bit for bit within each table (cflow.h), and the oracle."""
    for i, (rows, cols, tile) in enumerate(shapes(dtype)[1::2]):
        t = tiled(dtype, rows, cols, tile, seed=20 + i)
        w = dense(t, dtype, rows, cols, tile)
        rng = rng_for("kmm", dtype, i)
        X = rng.standard_normal((max(MM_BATCHES), cols), dtype=np.float32)
        X[1] *= 1e3  # activations of very different scale in one batch
        X[2] = 0.0
        want = np.stack([K.matvec_k_q8_ref(t, dtype, rows, cols, x, tile) for x in X])
        scale = np.stack([bound(w, dtype, x) for x in X])
        for isa in ALL_ISAS:
            mv = np.stack([_native.matvec(t, K.KDTYPE_IDS[dtype], rows, cols, x, **kw(tile, isa)) for x in X])
            for B in MM_BATCHES:
                got = _native.matmat(t, K.KDTYPE_IDS[dtype], rows, cols, X[:B], **kw(tile, isa))
                assert got.shape == (B, rows)
                assert np.array_equal(got, mv[:B]), f"{isa} matmat {dtype} {rows}x{cols} differs from matvec, B={B}"
            assert_close(got, want[:B], scale[:B], MATVEC_RTOL, f"{isa} matmat {dtype} {rows}x{cols}")
            ng = (rows + 7) // 8
            for g0, g1 in [(0, 1), (ng // 2, ng)]:
                part = _native.matmat(t, K.KDTYPE_IDS[dtype], rows, cols, X[:5], g0=g0, g1=g1, **kw(tile, isa))
                r0, r1 = g0 * 8, min(g1 * 8, rows)
                assert np.array_equal(part[:, r0:r1], mv[:5, r0:r1])
                assert not part[:, :r0].any() and not part[:, r1:].any()


def gate_up_matrix(dtype, d_ff, cols, tile, seed):
    gate = random_blocks(dtype, d_ff, cols, seed)
    up = random_blocks(dtype, d_ff, cols, seed + 1)
    return K.tile_kquant(Q.interleave_gate_up(gate, up), dtype, 2 * d_ff, cols, tile)


# silu of a large negative gate in numpy: exp overflows to inf and silu correctly goes to -0
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("dtype", NEW)
def test_gate_up_matches_matvec_and_oracle(dtype):
    cases = ([(8, 256, (128, 256)), (72, 768, (16, 512)), (40, 512, (24, 256))] if dtype in K.K_SUPER else
             [(8, 32, (128, 256)), (72, 576, (128, 256)), (40, 320, (24, 96))])
    for i, (d_ff, cols, tile) in enumerate(cases):
        rows = 2 * d_ff
        t = gate_up_matrix(dtype, d_ff, cols, tile, seed=30 + 2 * i)
        w = dense(t, dtype, rows, cols, tile)
        x = rng_for("kgu", dtype, i).standard_normal(cols, dtype=np.float32)
        g, u = Q.deinterleave_gate_up(K.matvec_k_q8_ref(t, dtype, rows, cols, x, tile))
        gs, us = Q.deinterleave_gate_up(bound(w, dtype, x))
        want = silu(g) * u
        # error of silu(g)*u from errors eg, eu: |silu'(g)| <= 1.1, so <= 1.1*eg*|u| + eu*|silu(g)|
        scale = 1.1 * gs * np.abs(u) + us * np.abs(silu(g)) + np.abs(want) * EXP_RTOL / MATVEC_RTOL + 1e-30
        for isa in ALL_ISAS:
            got = _native.gate_up(t, K.KDTYPE_IDS[dtype], rows, cols, x, **kw(tile, isa))
            assert_close(got, want, scale, MATVEC_RTOL, f"{isa} gate_up {dtype} d_ff={d_ff}")
            # silu(gate) * up from the same table's mat-vec
            mg, mu = Q.deinterleave_gate_up(_native.matvec(t, K.KDTYPE_IDS[dtype], rows, cols, x, **kw(tile, isa))
                                            .astype(np.float64))
            assert_close(got, silu(mg) * mu, scale, MATVEC_RTOL, f"{isa} gate_up {dtype} vs its matvec")
            half = rows // 16 // 2  # a pair range writes only its outputs
            part = _native.gate_up(t, K.KDTYPE_IDS[dtype], rows, cols, x, p0=half, p1=rows // 16, **kw(tile, isa))
            assert np.array_equal(part[half * 8:], got[half * 8:]) and not part[:half * 8].any()
            X = np.stack([x, 1e3 * x[::-1], np.zeros_like(x)] + [x * (b + 2) for b in range(14)]).astype(np.float32)
            one = np.stack([_native.gate_up(t, K.KDTYPE_IDS[dtype], rows, cols, xb, **kw(tile, isa)) for xb in X])
            for B in MM_BATCHES:
                mm = _native.gate_up_mm(t, K.KDTYPE_IDS[dtype], rows, cols, X[:B], **kw(tile, isa))
                assert np.array_equal(mm, one[:B]), f"{isa} gate_up_mm {dtype} B={B}"


# ---- embedding rows --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", NEW)
@pytest.mark.parametrize("isa", ALL_ISAS)
def test_embed_row_equals_dequantize_k(isa, dtype):
    for i, (rows, cols, tile) in enumerate(shapes(dtype)):
        t = tiled(dtype, rows, cols, tile, seed=40 + i)
        want = dense(t, dtype, rows, cols, tile)
        for r in sorted({0, rows - 1, rows // 2, min(rows - 1, 7), min(rows - 1, 8), min(rows - 1, 128)}):
            got = _native.embed_row(t, K.KDTYPE_IDS[dtype], rows, cols, r, **kw(tile, isa))
            assert got.tobytes() == want[r].tobytes(), f"{dtype} row {r} of {rows}x{cols} tile {tile}"


# ---- bad input -----------------------------------------------------------------------------------
def test_bad_shapes_are_refused():
    t = tiled("q4_k", 8, 512, (128, 256), seed=0)
    x = np.zeros(512, np.float32)
    with pytest.raises(CflowError, match="multiple of 256"):
        _native.matvec(t, K.KDTYPE_IDS["q4_k"], 8, 512, x, tile_cols=128)  # a tile splits a super-block
    with pytest.raises(CflowError, match="multiple of 256"):
        _native.matvec(np.zeros(8 * 18 * 22, np.uint8), K.KDTYPE_IDS["q6_k"], 8, 576, np.zeros(576, np.float32))
    with pytest.raises(CflowError, match="needs"):
        _native.matvec(t[:-1], K.KDTYPE_IDS["q4_k"], 8, 512, x)
    with pytest.raises(CflowError, match="not a quantized type"):
        _native.matvec(t, 10, 8, 512, x)  # GGML's Q2_K: no kernels


def test_tiled_bytes_of_every_dtype():
    for dtype in K.ALL_QUANT:
        qb, _ = K.block_geometry(dtype)
        for rows, cols in [(1, qb), (13, 4 * qb), (129, 1536)]:
            assert _native.tiled_bytes(K.KDTYPE_IDS.get(dtype) or Q.DTYPE_IDS[dtype], rows, cols) == \
                K.kquant_nbytes(dtype, (rows, cols))


# ---- the tensors llama.cpp writes ----------------------------------------------------------------
@pytest.mark.oracle
@pytest.mark.parametrize("model", ["k256", "w576"])
@pytest.mark.parametrize("ft", ["Q4_K_M", "Q5_K_M", "Q6_K"])
def test_llama_cpp_tensors(kquant_files, model, ft):
    """Every matrix of a real file, in whatever type llama.cpp chose for it (Q8_0 included):
    every table against the oracle, the batched kernel against the mat-vec, rows against
    dequantize_k."""
    for name, dtype, rows, cols, blocks in file_matrices(kquant_files[model, ft]):
        ids = {**Q.DTYPE_IDS, **K.KDTYPE_IDS}
        t = K.tile_kquant(blocks, dtype, rows, cols)
        w = K.dequantize_k(blocks, dtype, cols)
        X = rng_for("file", name, cols).standard_normal((3, cols), dtype=np.float32)
        want = K.matvec_k_q8_ref(t, dtype, rows, cols, X[0])
        scale = bound(w, dtype, X[0])
        for isa in ISAS:
            mv = np.stack([_native.matvec(t, ids[dtype], rows, cols, x, isa=isa) for x in X])
            assert_close(mv[0], want, scale, MATVEC_RTOL, f"{isa} {name} ({dtype})")
            assert np.array_equal(_native.matmat(t, ids[dtype], rows, cols, X, isa=isa), mv), f"{isa} {name}"
            for r in (0, rows - 1):
                assert _native.embed_row(t, ids[dtype], rows, cols, r, isa=isa).tobytes() == w[r].tobytes()


# ---- the avx512 table's Q6_K kernels, either way -----------------------------------------------
Q6K_BOTH_TABLES = """
import sys
sys.path.insert(0, {tests!r})
import numpy as np
from cflow import _native
from cflow import kquant as K
from test_kquant_kernels import MM_BATCHES, tiled, kw
from test_native_kernels import rng_for
dt = K.KDTYPE_IDS["q6_k"]
for rows, cols, tile in [(64, 512, (64, 256)), (203, 768, (64, 512))]:
    t = tiled("q6_k", rows, cols, tile, seed=5)
    X = rng_for("q6k-both", rows).standard_normal((max(MM_BATCHES), cols), dtype=np.float32)
    same = lambda f: np.array_equal(f("avx2"), f("avx512"))
    assert same(lambda i: _native.matvec(t, dt, rows, cols, X[0], **kw(tile, i)))
    for B in MM_BATCHES:
        assert same(lambda i: _native.matmat(t, dt, rows, cols, X[:B], **kw(tile, i))), B
    gu_rows = rows - rows % 16
    if gu_rows:
        tg = tiled("q6_k", gu_rows, cols, tile, seed=6)
        assert same(lambda i: _native.gate_up(tg, dt, gu_rows, cols, X[0], **kw(tile, i)))
        for B in MM_BATCHES:
            assert same(lambda i: _native.gate_up_mm(tg, dt, gu_rows, cols, X[:B], **kw(tile, i))), B
print(int(_native.avx512_q6k_streams()))
"""


@pytest.mark.skipif("avx512" not in ISAS or "avx2" not in ISAS, reason="needs the avx512 and avx2 tables")
def test_avx512_q6k_kernels_either_way():
    """The avx512 table runs its own Q6_K kernels, or (where they do not keep up with memory: Zen
    4, dispatch.c cf_avx512_q6k_streams) the AVX2 family's; CFLOW_AVX512_Q6K=1 / 0 forces each, in
    a fresh process (the table is built once): either way its Q6_K mat-vec, gate/up and batches of
    every size equal the avx2 table's bit for bit, and the process reports the choice it was
    forced to (the control that the switch is read)."""
    from pathlib import Path

    from fresh_process import check_each_forced

    check_each_forced(Q6K_BOTH_TABLES.format(tests=str(Path(__file__).parent)), "CFLOW_AVX512_Q6K", ("1", "0"),
                      timeout=300)
