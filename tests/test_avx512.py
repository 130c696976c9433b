"""The "avx512" kernel table (kernels_avx512.c) on the shapes its own blocking creates.

The per-table tests (test_native_kernels.py, test_kquant_kernels.py, test_every_isa.py) already
run it against the ref table; this file aims at what is specific to it: 4 tokens x 2 group pairs
per micro-kernel, batches of 64 tokens, a lone last group of a band or range (half a zmm), tiles
of exactly 16 blocks (the buffer) and wider (the inherited kernel), the copy of the base table
it starts from, and the small-batch path (B <= 32: blocks unpacked into registers, rows in a
lane order of its own, passes of at most 8 tokens) at every B, at the weights' integer extremes,
with its one-group form for B <= 3 (two blocks of a group per zmm: odd block counts per tile, a
one-block tile, and one-block groups are in SMALL_SHAPES). Skipped on CPUs without AVX-512 F/BW/VL + VNNI.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from cflow import _native
from cflow import quant as Q

pytestmark = pytest.mark.skipif("avx512" not in _native.available_isas(),
                                reason="this CPU (or build) has no avx512 table")

QDTYPES = ["q4_0", "q4_1", "q8_0"]
MATVEC_RTOL = 1e-5  # as in test_native_kernels.py


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def random_case(key, rows, cols, dtype, tile, n_tokens):
    rng = rng_for(*key)
    w = rng.standard_normal((rows, cols), dtype=np.float32)
    w[rng.random(rows) < 0.1] *= 100
    X = rng.standard_normal((n_tokens, cols), dtype=np.float32)
    X[rng.random(n_tokens) < 0.2] *= 1e3  # tokens of very different scale in one batch
    return Q.quantize_tiled(w, dtype, tile), X


def bound(t, dtype, rows, cols, X, tile):
    w = Q.dequantize(Q.untile_matrix(t, dtype, rows, cols, tile), dtype, cols).astype(np.float64)
    out = []
    for x in X:
        qs, d, _ = Q.quantize_act(x)
        out.append(np.abs(w) @ np.abs(qs.astype(np.float64) * np.repeat(d.astype(np.float64), Q.QK)))
    return np.stack(out) + 1e-30


def base_isa() -> str:
    """The AVX2-family table avx512 copies: the best one below it."""
    isas = _native.available_isas()
    return isas[isas.index("avx512") - 1]


# rows: a lone last group per band (tile_rows 24 = 3 groups), 5 groups a band (a 4-group chunk
# and a lone one), a short last group, one group; cols: 16 blocks (the buffer, exactly), ragged
# tiles, a tile wider than the buffer (the base table's kernel).
SHAPES = [(203, 1088, (24, 96)), (203, 512, (40, 512)), (77, 544, (128, 256)), (8, 32, (8, 32)),
          (130, 1056, (128, 544)), (264, 576, (128, 256))]


@pytest.mark.parametrize("rows,cols,tile", SHAPES)
@pytest.mark.parametrize("dtype", QDTYPES)
def test_matmat_every_batch_size_equals_matvec(dtype, rows, cols, tile):
    """B = 1..17 (every remainder of the 4-token micro-kernel) and 63..65, 129 (the 64-token
    batches): equal to the table's own mat-vec bit for bit and to the ref table within rounding."""
    t, X = random_case(("mm", dtype, rows, cols, tile), rows, cols, dtype, tile, 129)
    dt, kw = Q.DTYPE_IDS[dtype], dict(tile_rows=tile[0], tile_cols=tile[1])
    mv = np.stack([_native.matvec(t, dt, rows, cols, x, isa="avx512", **kw) for x in X])
    ref = np.stack([_native.matvec(t, dt, rows, cols, x, isa="ref", **kw) for x in X])
    scale = bound(t, dtype, rows, cols, X, tile)
    for B in list(range(1, 18)) + [63, 64, 65, 129]:
        got = _native.matmat(t, dt, rows, cols, X[:B], isa="avx512", **kw)
        assert np.array_equal(got, mv[:B]), f"matmat {dtype} {rows}x{cols} tile {tile} B={B} != matvec"
        err = np.abs(got.astype(np.float64) - ref[:B]) / scale[:B]
        assert err.max() <= 2 * MATVEC_RTOL, f"B={B}: {err.max():.3g} from the ref table"


def check_group_ranges(t, dt, rows, cols, X, kw):
    """matmat of row groups [g0, g1) (odd starts and ends, inside and across bands of a 203-row
    matrix) writes only those rows, with the whole call's values; a pool of 3 changes nothing.
    Returns the whole call's output."""
    full = _native.matmat(t, dt, rows, cols, X, **kw)
    assert np.array_equal(_native.matmat(t, dt, rows, cols, X, pool=_native.Pool(3), **kw), full)
    for g0, g1 in [(1, 2), (1, 4), (3, 8), (4, 9), (5, 26), (24, 26), (25, 26), (0, 25)]:
        part = _native.matmat(t, dt, rows, cols, X, g0=g0, g1=g1, **kw)
        r0, r1 = g0 * 8, min(g1 * 8, rows)
        assert np.array_equal(part[:, r0:r1], full[:, r0:r1]), f"groups [{g0}, {g1}) differ"
        assert not part[:, :r0].any() and not part[:, r1:].any(), f"[{g0}, {g1}) wrote outside its rows"
    return full


@pytest.mark.parametrize("dtype", QDTYPES)
def test_matmat_group_ranges_and_threads(dtype):
    """Ranges that start and end on odd groups, inside and across bands, write only their rows
    and the same values; a pool splitting the rows changes nothing."""
    rows, cols, tile = 203, 1088, (40, 96)
    t, X = random_case(("ranges", dtype), rows, cols, dtype, tile, 21)
    dt, kw = Q.DTYPE_IDS[dtype], dict(tile_rows=tile[0], tile_cols=tile[1], isa="avx512")
    check_group_ranges(t, dt, rows, cols, X, kw)


@pytest.mark.parametrize("d_ff,cols,tile", [(8, 32, (8, 32)), (24, 96, (24, 96)), (40, 512, (40, 512)),
                                            (72, 576, (128, 256)), (56, 1088, (24, 1024))])
@pytest.mark.parametrize("dtype", QDTYPES)
def test_gate_up_mm_equals_gate_up(dtype, d_ff, cols, tile):
    """An odd number of pairs per pass (the lone last pair of a zmm), batches of 1..9 and past
    64, pair ranges: equal to the inherited one-token gate_up bit for bit."""
    rows = 2 * d_ff
    t, X = random_case(("gu", dtype, d_ff, cols, tile), rows, cols, dtype, tile, 67)
    dt, kw = Q.DTYPE_IDS[dtype], dict(tile_rows=tile[0], tile_cols=tile[1], isa="avx512")
    one = np.stack([_native.gate_up(t, dt, rows, cols, x, **kw) for x in X])
    for B in list(range(1, 10)) + [64, 67]:
        assert np.array_equal(_native.gate_up_mm(t, dt, rows, cols, X[:B], **kw), one[:B]), f"B={B}"
    n_pairs = rows // 16
    for p0, p1 in [(0, 1), (n_pairs // 2, n_pairs), (1, n_pairs)]:
        if p0 >= p1:
            continue
        part = _native.gate_up_mm(t, dt, rows, cols, X[:9], p0=p0, p1=p1, **kw)
        assert np.array_equal(part[:, 8 * p0:8 * p1], one[:9, 8 * p0:8 * p1])
        assert not part[:, :8 * p0].any() and not part[:, 8 * p1:].any()


def test_table_inherits_the_base_tables_other_kernels():
    """Only the batched Q4_0/Q4_1/Q8_0 kernels are its own: its mat-vec (which its matmat must
    equal) is the base table's, bit for bit, so the one-token path does not change with it."""
    rows, cols, tile = 257, 576, Q.TILE
    base = base_isa()
    for dtype in QDTYPES:
        t, X = random_case(("inherit", dtype), rows, cols, dtype, tile, 3)
        for x in X:
            a = _native.matvec(t, Q.DTYPE_IDS[dtype], rows, cols, x, isa="avx512")
            assert np.array_equal(a, _native.matvec(t, Q.DTYPE_IDS[dtype], rows, cols, x, isa=base))


# ---- K-quants (Q4_K, Q5_K, Q6_K: 256-weight super-blocks, at most 2 per tile row in the buffer) ----
K_SHAPES = [(203, 768, (24, 256)), (77, 1024, (40, 512)), (136, 1280, (16, 512)), (8, 256, (8, 256)),
            (40, 1024, (24, 1024))]  # the last: 4 super-blocks per tile row, the base kernel


@pytest.mark.parametrize("rows,cols,tile", K_SHAPES)
@pytest.mark.parametrize("dtype", ["q4_k", "q5_k", "q6_k"])
def test_kquant_matmat_every_batch_size_equals_matvec(dtype, rows, cols, tile):
    """Random blocks of every bit pattern (signed Q6_K scales, all 6-bit Q4_K/Q5_K scales and mins, Q5_K's 5th bits),
    B = 1..9, 16, 17: equal to the table's mat-vec bit for bit, and to the ref table within
    rounding; odd group ranges write only their rows."""
    from cflow import kquant as K
    from test_kquant import random_blocks

    t = K.tile_kquant(random_blocks(dtype, rows, cols, 7), dtype, rows, cols, tile)
    dt, kw = K.KDTYPE_IDS[dtype], dict(tile_rows=tile[0], tile_cols=tile[1])
    X = rng_for("kq", dtype, rows, cols, tile).standard_normal((17, cols), dtype=np.float32)
    X[1] *= 1e3
    X[2] = 0.0
    mv = np.stack([_native.matvec(t, dt, rows, cols, x, isa="avx512", **kw) for x in X])
    ref = np.stack([_native.matvec(t, dt, rows, cols, x, isa="ref", **kw) for x in X])
    for B in list(range(1, 10)) + [16, 17]:
        got = _native.matmat(t, dt, rows, cols, X[:B], isa="avx512", **kw)
        assert np.array_equal(got, mv[:B]), f"matmat {dtype} {rows}x{cols} tile {tile} B={B} != matvec"
    scale = np.abs(ref).max(axis=1, keepdims=True) + 1e-30
    assert (np.abs(got - ref) / scale).max() <= 1e-4, "matmat far from the ref table"
    ng = (rows + 7) // 8
    for g0, g1 in [(1, 2), (1, 4), (3, ng), (ng - 1, ng)]:
        if not 0 <= g0 < g1 <= ng:
            continue
        part = _native.matmat(t, dt, rows, cols, X[:6], g0=g0, g1=g1, isa="avx512", **kw)
        r0, r1 = g0 * 8, min(g1 * 8, rows)
        assert np.array_equal(part[:, r0:r1], mv[:6, r0:r1]), f"groups [{g0}, {g1})"
        assert not part[:, :r0].any() and not part[:, r1:].any()


@pytest.mark.parametrize("d_ff,cols,tile", [(8, 256, (8, 256)), (40, 512, (24, 256)), (72, 768, (16, 512))])
@pytest.mark.parametrize("dtype", ["q4_k", "q5_k", "q6_k"])
def test_kquant_gate_up_mm_equals_gate_up(dtype, d_ff, cols, tile):
    from cflow import kquant as K
    from test_kquant import random_blocks

    gate, up = random_blocks(dtype, d_ff, cols, 11), random_blocks(dtype, d_ff, cols, 12)
    rows = 2 * d_ff
    t = K.tile_kquant(Q.interleave_gate_up(gate, up), dtype, rows, cols, tile)
    dt, kw = K.KDTYPE_IDS[dtype], dict(tile_rows=tile[0], tile_cols=tile[1], isa="avx512")
    X = rng_for("kgu", dtype, d_ff).standard_normal((67, cols), dtype=np.float32)
    one = np.stack([_native.gate_up(t, dt, rows, cols, x, **kw) for x in X])
    for B in (1, 2, 3, 5, 64, 67):
        assert np.array_equal(_native.gate_up_mm(t, dt, rows, cols, X[:B], **kw), one[:B]), f"B={B}"
    n_pairs = rows // 16
    if n_pairs > 1:
        part = _native.gate_up_mm(t, dt, rows, cols, X[:5], p0=1, p1=n_pairs, **kw)
        assert np.array_equal(part[:, 8:], one[:5, 8:]) and not part[:, :8].any()


def test_cflow_isa_selects_it_and_the_tables_below():
    """CFLOW_ISA=avx512 picks it (it is also the default here, the best table); naming the base
    table instead runs that one, so the AVX2-family tables stay reachable for comparison."""
    import os
    import subprocess
    import sys

    assert _native.available_isas()[-1] == "avx512"
    for name in ("avx512", base_isa()):
        out = subprocess.run([sys.executable, "-c", "from cflow import _native; print(_native.isa())"],
                             env={**os.environ, "CFLOW_ISA": name}, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == name


# ---- the small-batch path (B <= 32: blocks unpacked into registers, passes of at most 8 tokens;
# B <= 3: one group at a time, blocks kb and kb + 1 in one zmm) ----
SMALL_SHAPES = [(203, 1088, (24, 96)),   # 3 groups a band: a lone group per band; a short last group
                (77, 544, (40, 256)),    # 5 groups a band; ragged last tile (1 block)
                (136, 512, (128, 512)),  # 17 groups: one lone group; tiles of 16 blocks (the buffer's)
                (8, 32, (8, 32)),        # one group, one block
                (264, 576, (128, 256))]  # SmolLM2-like tiles, a lone group in the last band


def extreme_case(key, rows, cols, dtype, tile, n_tokens):
    """Weights at the ends of their integer range (Q4 nibbles 0 and 15, Q8_0 -127..127 with -128
    where the format allows it) and activations of very different scales, zeros and spikes."""
    rng = rng_for(*key)
    w = rng.choice(np.array([-1.0, 1.0, 0.0], np.float32), size=(rows, cols)) * rng.uniform(0.5, 2, (rows, 1))
    w[:, ::7] = np.abs(w[:, ::7]).max()  # each block's extremes
    X = rng.standard_normal((n_tokens, cols), dtype=np.float32)
    X[0] = 0.0
    X[1, ::5] = 1e4
    X[2] = np.sign(X[2]) * 3.0  # every int8 at +-127
    return Q.quantize_tiled(w.astype(np.float32), dtype, tile), X


@pytest.mark.parametrize("rows,cols,tile", SMALL_SHAPES)
@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("case", [random_case, extreme_case])
def test_small_batch_path_equals_matvec(case, dtype, rows, cols, tile):
    """Every B of one and two passes (1..8: one pass, 9..16: 5+4 .. 8+8), three and four passes
    (17, 23, 24, 25, 31, 32) and 33 (the buffer path again): bit for bit the table's mat-vec row
    by row, within rounding of the ref table."""
    t, X = case(("small", case.__name__, dtype, rows, cols, tile), rows, cols, dtype, tile, 33)
    dt, kw = Q.DTYPE_IDS[dtype], dict(tile_rows=tile[0], tile_cols=tile[1])
    mv = np.stack([_native.matvec(t, dt, rows, cols, x, isa="avx512", **kw) for x in X])
    ref = np.stack([_native.matvec(t, dt, rows, cols, x, isa="ref", **kw) for x in X])
    scale = bound(t, dtype, rows, cols, X, tile)
    for B in list(range(1, 18)) + [23, 24, 25, 31, 32, 33]:
        got = _native.matmat(t, dt, rows, cols, X[:B], isa="avx512", **kw)
        assert np.array_equal(got, mv[:B]), f"matmat {dtype} {rows}x{cols} tile {tile} B={B} != matvec"
        err = np.abs(got.astype(np.float64) - ref[:B]) / scale[:B]
        assert err.max() <= 2 * MATVEC_RTOL, f"B={B}: {err.max():.3g} from the ref table"


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("B", [1, 3, 8, 9, 16, 32])
def test_small_batch_group_ranges_and_threads(dtype, B):
    """Ranges starting or ending on odd groups (a lone first or last pair of a share), inside and
    across bands, in one pass and in two: only their rows, the same values; a pool changes nothing."""
    rows, cols, tile = 203, 1088, (40, 96)
    t, X = random_case(("small ranges", dtype, B), rows, cols, dtype, tile, B)
    dt, kw = Q.DTYPE_IDS[dtype], dict(tile_rows=tile[0], tile_cols=tile[1], isa="avx512")
    full = check_group_ranges(t, dt, rows, cols, X, kw)
    assert np.array_equal(full, np.stack([_native.matvec(t, dt, rows, cols, x, **kw) for x in X]))


@pytest.mark.parametrize("d_ff,cols,tile", [(24, 96, (24, 96)), (72, 576, (128, 256)), (56, 1088, (24, 1024))])
@pytest.mark.parametrize("dtype", QDTYPES)
def test_small_batch_gate_up_mm_equals_gate_up(dtype, d_ff, cols, tile):
    """gate_up_mm at every B of one and two passes and at 31..33 (its passes of pairs run the small
    path up to 32 tokens): the one-token gate_up bit for bit."""
    rows = 2 * d_ff
    t, X = random_case(("small gu", dtype, d_ff, cols, tile), rows, cols, dtype, tile, 33)
    dt, kw = Q.DTYPE_IDS[dtype], dict(tile_rows=tile[0], tile_cols=tile[1], isa="avx512")
    one = np.stack([_native.gate_up(t, dt, rows, cols, x, **kw) for x in X])
    for B in list(range(1, 17)) + [31, 32, 33]:
        assert np.array_equal(_native.gate_up_mm(t, dt, rows, cols, X[:B], **kw), one[:B]), f"B={B}"


SMALL_BATCH_BOTH_WAYS = """
import sys
sys.path.insert(0, {tests!r})
from cflow import _native
import test_avx512 as T
for case in (T.random_case, T.extreme_case):
    for dtype in T.QDTYPES:
        for rows, cols, tile in T.SMALL_SHAPES:
            T.test_small_batch_path_equals_matvec(case, dtype, rows, cols, tile)
for dtype in T.QDTYPES:
    for B in (2, 3, 8, 9, 16):
        T.test_small_batch_group_ranges_and_threads(dtype, B)
    for d_ff, cols, tile in [(24, 96, (24, 96)), (72, 576, (128, 256))]:
        T.test_small_batch_gate_up_mm_equals_gate_up(dtype, d_ff, cols, tile)
print(_native.avx512_small_batch())
"""


def test_small_batch_path_either_way():
    """Batches of 2-16 tokens read one group per ymm on Zen 4 and two groups per zmm elsewhere
    (dispatch.c, cf_avx512_small_batch_groups); CFLOW_AVX512_SMALL_BATCH=group / pair forces each
    in a fresh process (the table is built once): either way the small-batch tests above hold (bit
    for bit the mat-vec), and the process reports the choice it was forced to (the control that the
    switch is read)."""
    from pathlib import Path

    from fresh_process import check_each_forced

    check_each_forced(SMALL_BATCH_BOTH_WAYS.format(tests=str(Path(__file__).parent)), "CFLOW_AVX512_SMALL_BATCH",
                      ("group", "pair"))
