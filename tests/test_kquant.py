"""cflow.kquant: K-quant (Q4_K, Q5_K, Q6_K) and Q5_0 / Q5_1 blocks against gguf.quants (random
blocks of every bit pattern, and every tensor of real Q4_K_M / Q5_K_M / Q6_K files that llama.cpp
wrote from a random F32 GGUF), the tile layout (inverse, literal loop nest, chunk contents), the
256-block activation quantizer and the mat-vec oracles (against each other, gguf's dequantize @ x
and the dequantized activation) on odd row counts, band tails and narrow last tiles."""

from __future__ import annotations

import numpy as np
import pytest

from cflow import kquant as K
from cflow import quant as Q

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GT  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

GGML = {"q4_0": GT.Q4_0, "q4_1": GT.Q4_1, "q8_0": GT.Q8_0, "q5_0": GT.Q5_0, "q5_1": GT.Q5_1,
        "q4_k": GT.Q4_K, "q5_k": GT.Q5_K, "q6_k": GT.Q6_K, "mxfp4": GT.MXFP4}
NEW = list(K.KDTYPES)
# (rows, cols) with band tails (129 = 128 + 1), short groups (7, 13), and narrow last tiles
SHAPES = [(1, 256), (7, 512), (13, 768), (129, 256), (136, 1280)]
TILES = [(128, 256), (16, 512), (8, 1024)]


def random_blocks(dtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Blocks of uniformly random bytes (every quant, scale and high-bit pattern, Q6_K's -128
    scale included), with the fp16 fields overwritten by finite values of either sign."""
    rng = np.random.default_rng(seed)
    qb, bb = K.block_geometry(dtype)
    b = rng.integers(0, 256, (rows, cols // qb, bb), dtype=np.uint8)
    fields = K.GGML_FIELDS.get(dtype, {"d": (0, 2), "m": (2, 2)} if dtype == "q4_1" else {"d": (0, 2)})
    for name in ("d", "dmin", "m"):
        if name in fields:
            o, _ = fields[name]
            v = (rng.standard_normal((rows, cols // qb)) * 0.01).astype(np.float16)
            b[..., o:o + 2] = v[..., None].view(np.uint8).reshape(rows, cols // qb, 2)
    if dtype == "mxfp4":  # exponents of real weights' scales (2^-20 .. 2^4): every product finite
        b[..., 0] = rng.integers(107, 132, (rows, cols // qb), dtype=np.uint8)
    return b.reshape(rows, -1)


def gguf_floats(blocks: np.ndarray, dtype: str, cols: int) -> np.ndarray:
    return gguf_dequantize(blocks, GGML[dtype]).astype(np.float32).reshape(-1, cols)


# ---- sizes and layouts -------------------------------------------------------------------------
def test_block_geometry_matches_gguf():
    for dt, (qb, bb) in K.KBLOCK.items():
        assert gguf.GGML_QUANT_SIZES[GGML[dt]] == (qb, bb)
        assert K.KDTYPE_IDS[dt] == int(GGML[dt])
        f = K.GGML_FIELDS[dt]
        assert sorted(o for o, _ in f.values()) == [o for o, _ in sorted(f.values())]
        assert sum(s for _, s in f.values()) == bb and set(K.TILE_FIELDS[dt]) == set(f)
        spans = sorted(f.values())  # fields tile the block exactly
        assert all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:])) and spans[0][0] == 0


def test_sizes_and_width_rules():
    assert K.kquant_nbytes("q4_k", (512, 256)) == 512 * 144
    assert K.kquant_nbytes("q6_k", (3, 4, 768)) == 12 * 3 * 210
    assert K.kquant_nbytes("q5_0", (576, 576)) == 576 * 18 * 22
    assert K.kquant_nbytes("q4_0", (8, 64)) == Q.tensor_nbytes("q4_0", (8, 64))
    with pytest.raises(Q.QuantError, match="q5_0 / q5_1 / q8_0"):
        K.row_bytes_k("q4_k", 576)
    with pytest.raises(Q.QuantError, match="multiples of"):
        K.tile_kquant(random_blocks("q6_k", 8, 256), "q6_k", 8, 256, tile=(8, 128))
    with pytest.raises(Q.QuantError, match="unknown"):
        K.block_geometry("q3_k")


# ---- decoding: bit-exact with gguf.quants ------------------------------------------------------------
@pytest.mark.parametrize("dtype", NEW)
def test_dequantize_random_blocks_bit_exact(dtype):
    for seed, (rows, cols) in enumerate([(5, 256), (33, 1024), (2, 2560)]):
        b = random_blocks(dtype, rows, cols, seed)
        got = K.dequantize_k(b, dtype, cols)
        assert got.dtype == np.float32 and got.shape == (rows, cols)
        assert got.tobytes() == gguf_floats(b, dtype, cols).tobytes()


@pytest.mark.parametrize("dtype", ["q5_0", "q5_1"])
def test_dequantize_gguf_quantized_q5(dtype):
    w = np.random.default_rng(3).standard_normal((9, 576)).astype(np.float32)
    w[0] = 0
    b = gguf_quantize(w, GGML[dtype])
    assert K.dequantize_k(b, dtype, 576).tobytes() == gguf_floats(b, dtype, 576).tobytes()


def test_mxfp4_by_hand_and_extreme_exponents():
    """ggml's layout: byte 0 the E8M0 exponent, byte 1 + j weight j (low nibble) and j + 16 (high);
    values E2M1 (0, .5, 1, 1.5, 2, 3, 4, 6, sign in bit 3) times 2^(e - 127). Exponents 0 and 1 are
    subnormal halves (2^-128, 2^-127), 255 is 2^127 with no NaN: all bit for bit as gguf."""
    b = np.zeros((1, 17), np.uint8)
    b[0, 0] = 127  # scale 1
    b[0, 1:17] = np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4)
    w = K.dequantize_k(b, "mxfp4", 32)[0]
    e2m1 = [0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6]
    assert list(w[:16]) == e2m1 and list(w[16:]) == e2m1[::-1]
    assert list(K.e8m0_half(np.array([0, 1, 2, 127, 128, 255], np.uint8))) == [
        2.0 ** -128, 2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0 ** 127]
    e = np.array([0, 1, 2, 126, 127, 128, 200, 254], np.uint8)
    blocks = np.random.default_rng(7).integers(0, 256, (8, 17), dtype=np.uint8)
    blocks[:, 0] = e
    assert K.dequantize_k(blocks, "mxfp4", 32).tobytes() == gguf_floats(blocks, "mxfp4", 32).tobytes()
    w = np.random.default_rng(8).standard_normal((5, 96)).astype(np.float32)
    q = gguf_quantize(w, GT.MXFP4)  # gguf's own quantizer: cflow decodes its blocks as gguf does
    assert K.dequantize_k(q, "mxfp4", 96).tobytes() == gguf_floats(q, "mxfp4", 96).tobytes()
    assert np.abs(K.dequantize_k(q, "mxfp4", 96) - w).max() < 0.5 * np.abs(w).max()


def test_scale_min_unpacking_by_hand():
    # scales j<4 in the low 6 bits of bytes j (sc) and j+4 (m); j>=4 split over byte j+4 and the
    # top two bits of bytes j-4 / j.
    s = np.zeros((1, 12), np.uint8)
    s[0, 0], s[0, 4], s[0, 8] = 0b11_000101, 0b10_000011, 0b1001_0110
    sc, m = K.scale_min_k4(s)
    assert (sc[0, 0], m[0, 0]) == (5, 3)
    assert (sc[0, 4], m[0, 4]) == (0b11_0110, 0b10_1001)


# ---- the tile layout ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", NEW + ["q4_0"])
def test_tile_roundtrip_and_loop_nest(dtype):
    for i, (rows, cols) in enumerate(SHAPES):
        for tile in TILES:
            b = random_blocks(dtype, rows, cols, seed=i)
            t = K.tile_kquant(b, dtype, rows, cols, tile)
            assert t.dtype == np.uint8 and t.size == K.kquant_nbytes(dtype, (rows, cols)) == b.size
            assert np.array_equal(K.untile_kquant(t, dtype, rows, cols, tile), b)
            if rows <= 13 or tile == (128, 256):
                assert np.array_equal(t, K.tile_kquant_loops(b, dtype, rows, cols, tile))
            if dtype == "q4_0":
                assert np.array_equal(t, Q.tile_matrix(b, dtype, rows, cols, tile))


@pytest.mark.parametrize("dtype", K.K_SUPER)
def test_first_chunk_is_scales_then_quants(dtype):
    rows, cols = 12, 512
    b = random_blocks(dtype, rows, cols, seed=5)
    t = K.tile_kquant(b, dtype, rows, cols, (16, 256))
    B = K.KBLOCK[dtype][1]
    pos = 0
    for name in K.TILE_FIELDS[dtype]:  # chunk (group 0 = rows 0..7, super-block 0)
        o, s = K.GGML_FIELDS[dtype][name]
        for r in range(8):
            assert np.array_equal(t[pos:pos + s], b[r, o:o + s]), (name, r)
            pos += s
    assert pos == 8 * B
    assert K.TILE_FIELDS[dtype][0] == "d"
    # the next chunk is group 1 (rows 8..11) of the same tile, then the second tile starts
    o, s = K.GGML_FIELDS[dtype]["d"]
    assert np.array_equal(t[pos:pos + s], b[8, o:o + s])
    assert np.array_equal(t[rows * B:rows * B + s], b[0, B + o:B + o + s])


# ---- activations -------------------------------------------------------------------------------------
def test_quantize_act_k():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(768).astype(np.float32)
    x[256:512] = 0  # a zero block
    x[5] = -9.0     # the largest |x| is negative
    qs, d, bsums = K.quantize_act_k(x)
    assert (qs.dtype, d.dtype, bsums.dtype) == (np.int8, np.float32, np.int16)
    assert (qs.shape, d.shape, bsums.shape) == ((768,), (3,), (48,))
    assert d[1] == 0 and not qs[256:512].any()
    assert d[0] == np.float32(9.0) / np.float32(127) and qs[5] == -127
    assert np.array_equal(bsums, qs.reshape(48, 16).astype(np.int32).sum(1))
    assert np.abs(qs.astype(np.int32)).max() <= 127
    # same rounding rule as quant.quantize_act (halves away from zero), over 256 values
    y = np.zeros(256, np.float32)
    y[:4] = [127.0, 2.5, -2.5, 0.5]
    qy, dy, _ = K.quantize_act_k(y)
    assert dy[0] == 1.0 and list(qy[:4]) == [127, 3, -3, 1]
    xr = (qs.astype(np.float32).reshape(3, 256) * d[:, None]).reshape(-1)
    assert np.abs(xr - x).max() <= d.max() / 2 * 1.0001
    with pytest.raises(Q.QuantError):
        K.quantize_act_k(np.zeros(576, np.float32))


def test_integer_partials_fit_int32():
    """Worst cases the C kernels accumulate in int32: every quant and scale at its extreme."""
    qx = np.full(256, -127, np.int8)
    bs = np.full(16, -127 * 16, np.int16)
    for dtype in K.K_SUPER:
        b = np.full((1, K.KBLOCK[dtype][1]), 0xFF, np.uint8)
        if dtype == "q6_k":
            o, s = K.GGML_FIELDS[dtype]["scales"]
            b[0, o:o + s] = 0x80  # -128
            b[0, :192] = 0  # ql = qh = 0: every weight q - 32 = -32, against -127
        for name in ("d", "dmin"):
            if name in K.GGML_FIELDS[dtype]:
                o, _ = K.GGML_FIELDS[dtype][name]
                b[0, o:o + 2] = np.array([1], np.float16).view(np.uint8)
        ints = {k: int(v[0, 0]) for k, v in K.kquant_dots(b, dtype, qx, bs).items()}
        qmax = 15 if dtype == "q4_k" else 31
        expect = ({"sum_qd": -128 * 16 * 16 * (-32) * (-127)} if dtype == "q6_k" else
                  {"sum_qd": 8 * 63 * 32 * qmax * -127, "sum_mb": 8 * 63 * 32 * -127})
        assert ints == expect and all(abs(v) < 2 ** 31 for v in ints.values())


# ---- mat-vec oracles ---------------------------------------------------------------------------------
def _xhat(dtype: str, x: np.ndarray) -> np.ndarray:
    """The activation as the kernel sees it, dequantized (float64)."""
    if dtype in K.K_SUPER:
        qs, d, _ = K.quantize_act_k(x)
        return (qs.reshape(-1, 256).astype(np.float64) * d[:, None]).reshape(-1)
    qs, d, _ = Q.quantize_act(x)
    return (qs.reshape(-1, 32).astype(np.float64) * d[:, None]).reshape(-1)


def check_matvecs(blocks: np.ndarray, dtype: str, rows: int, cols: int, tile=(128, 256), seed=0):
    x = np.random.default_rng(seed).standard_normal(cols).astype(np.float32)
    t = K.tile_kquant(blocks, dtype, rows, cols, tile)
    w = gguf_floats(blocks, dtype, cols).astype(np.float64)
    y = K.matvec_k_ref(t, dtype, rows, cols, x, tile)
    assert y.shape == (rows,) and y.dtype == np.float64
    assert np.array_equal(y, w @ x.astype(np.float64))
    yq = K.matvec_k_q8_ref(t, dtype, rows, cols, x, tile)
    # exact algebra: the integer dots, scaled, are W @ x_hat (up to float32 rounding in W)
    xh = _xhat(dtype, x)
    bound = np.abs(w) @ np.abs(xh)
    assert np.all(np.abs(yq - w @ xh) <= 1e-6 * bound + 1e-30)
    # and x_hat is within half a step of x in each block
    step = np.abs(xh - x).max()
    assert np.all(np.abs(yq - y) <= step * np.abs(w).sum(axis=1) + 1e-12)
    return y, yq


@pytest.mark.parametrize("dtype", NEW)
def test_matvec_odd_shapes_random_blocks(dtype):
    for i, (rows, cols) in enumerate(SHAPES):
        check_matvecs(random_blocks(dtype, rows, cols, seed=10 + i), dtype, rows, cols,
                      tile=TILES[i % len(TILES)], seed=i)


def test_matvec_q5_fallback_widths():
    """Q5_0 / Q5_1 exist for widths that are not multiples of 256: 576 = 256 + 256 + 64 tiles."""
    for dtype in ("q5_0", "q5_1"):
        w = np.random.default_rng(4).standard_normal((137, 576)).astype(np.float32) * 0.02
        b = gguf_quantize(w, GGML[dtype])
        y, yq = check_matvecs(b, dtype, 137, 576)
        assert np.abs(yq - y).max() < 0.02 * np.abs(y).max()


def test_matvec_agrees_with_existing_types():
    w = np.random.default_rng(1).standard_normal((9, 576)).astype(np.float32)
    for dtype in ("q4_0", "q4_1", "q8_0"):
        t = Q.quantize_tiled(w, dtype)
        x = np.random.default_rng(2).standard_normal(576).astype(np.float32)
        assert np.array_equal(K.matvec_k_q8_ref(t, dtype, 9, 576, x), Q.matvec_q8_ref(t, dtype, 9, 576, x))
        b = Q.quantize(w, dtype)
        assert np.array_equal(K.dequantize_k(b, dtype, 576), Q.dequantize(b, dtype, 576))


# ---- real K-quant files, written by llama.cpp ------------------------------------------------------------
FTYPES = ("Q4_K_M", "Q5_K_M", "Q6_K")
MODELS = {"k256": (256, 512, 4, 2), "w576": (576, 1536, 9, 3)}  # d, ff, heads, kv heads


def write_f32_gguf(path, d: int, ff: int, heads: int, kv: int, layers: int = 2, vocab: int = 300, seed: int = 0):
    rng = np.random.default_rng(seed)
    hd = d // heads
    wr = gguf.GGUFWriter(str(path), "llama")
    wr.add_block_count(layers)
    wr.add_context_length(128)
    wr.add_embedding_length(d)
    wr.add_feed_forward_length(ff)
    wr.add_head_count(heads)
    wr.add_head_count_kv(kv)
    wr.add_rope_freq_base(10000.0)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_rope_dimension_count(hd)
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("default")
    wr.add_token_list([f"t{i}" for i in range(vocab)])
    wr.add_token_types([1] * vocab)
    wr.add_token_merges([])
    wr.add_bos_token_id(0)
    wr.add_eos_token_id(1)

    def add(name, shape):
        w = rng.standard_normal(shape).astype(np.float32)
        wr.add_tensor(name, w * 0.02 if len(shape) == 2 else w + 1)

    add("token_embd.weight", (vocab, d))
    for i in range(layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", (d,))
        add(b + "attn_q.weight", (d, d))
        add(b + "attn_k.weight", (kv * hd, d))
        add(b + "attn_v.weight", (kv * hd, d))
        add(b + "attn_output.weight", (d, d))
        add(b + "ffn_norm.weight", (d,))
        add(b + "ffn_gate.weight", (ff, d))
        add(b + "ffn_up.weight", (ff, d))
        add(b + "ffn_down.weight", (d, ff))
    add("output_norm.weight", (d,))
    add("output.weight", (vocab, d))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


@pytest.fixture(scope="module")
def kquant_files(tmp_path_factory):
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="the llama.cpp oracle is not installed: pip install 'llama-cpp-python>=0.3.16'")
    d = tmp_path_factory.mktemp("kquant")
    out = {}
    for model, dims in MODELS.items():
        src = d / f"{model}.gguf"
        write_f32_gguf(src, *dims)
        for ft in FTYPES:
            p = llama_cpp.llama_model_quantize_default_params()
            p.nthread = 1
            p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ft}")
            dst = d / f"{model}-{ft}.gguf"
            assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), p) == 0
            out[model, ft] = gguf.GGUFReader(str(dst))
    return out


def file_matrices(reader):
    """(name, cflow dtype, rows, cols, blocks [rows, row_bytes]) of every 2-D tensor."""
    for t in reader.tensors:
        if len(t.shape) != 2:
            continue
        cols = int(t.shape[0])
        dtype = t.tensor_type.name.lower()
        yield t.name, dtype, int(t.shape[1]), cols, np.asarray(t.data).reshape(int(t.shape[1]), -1)


@pytest.mark.oracle
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("ft", FTYPES)
def test_llama_cpp_files_every_tensor(kquant_files, model, ft):
    seen = {}
    for name, dtype, rows, cols, blocks in file_matrices(kquant_files[model, ft]):
        seen[name] = dtype
        assert dtype in K.ALL_QUANT, (name, dtype)
        assert blocks.shape[1] == K.row_bytes_k(dtype, cols)
        assert K.dequantize_k(blocks, dtype, cols).tobytes() == gguf_floats(blocks, dtype, cols).tobytes(), name
        t = K.tile_kquant(blocks, dtype, rows, cols)
        assert np.array_equal(K.untile_kquant(t, dtype, rows, cols), blocks), name
        check_matvecs(blocks, dtype, rows, cols, seed=rows)
    kinds = set(seen.values())
    if model == "k256":  # every width a multiple of 256: K-quants only
        assert kinds == {"q4_k": {"q4_k", "q6_k"}, "q5_k": {"q5_k", "q6_k"}, "q6_k": {"q6_k"}}[ft.lower()[:4]]
    else:
        # width 576 rules out K-quants for every tensor reading d inputs; ffn_down reads 1536
        for name, dtype in seen.items():
            assert (dtype in K.K_SUPER) == name.endswith("ffn_down.weight"), (name, dtype)
        fallback = {"Q4_K_M": {"q5_0", "q8_0"}, "Q5_K_M": {"q5_1", "q8_0"}, "Q6_K": {"q8_0"}}[ft]
        assert kinds - set(K.K_SUPER) == fallback
