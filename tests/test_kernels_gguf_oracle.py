"""The native mat-vec on weights that went through the GGUF converter, against gguf's own numpy
quantizer and dequantizer: an oracle that shares no code with cflow.quant.

tests/test_native_kernels.py checks the kernels against cflow.quant (its tiling and its
dequantizer), and tests/test_engine.py against a reference built from cflow.quant's dequantized
weights, so a bug in cflow.quant that the kernels faithfully follow is invisible there. Here the
weights start as `gguf.quants.quantize` blocks in a real GGUF file, travel the converter's path
(GGUFModel.source -> Encoder.matrix / Encoder.qkv -> tiled bytes) and the kernel's output is
compared with `gguf.quants.dequantize(blocks) @ x`. F16 and F32 tensors take the converter's
other path (re-quantized by cflow.quant.quantize, as checkpoints are too) and must equal what
ggml's quantizer gives. Both float types matter: from F16 values a Q4_0 scale (max / -8) is
exact, so a slip in how the scale is rounded shows only on F32 sources.

The activation x is chosen so that the kernels' int8 activation quantization is lossless: every
32-block holds integers in [-127, 127] with max |x| = 127 (so d = 1 and q = x) or is all zero.
What is left is float32 accumulation, ~1e-6 of the magnitude bound sum |w| |x|; one weight off
by one quantization step moves a row by ~1e-3 of it.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from cflow import _native

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GT  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

from cflow.convert.encoder import Encoder  # noqa: E402
from cflow.convert.gguf import GGUFModel  # noqa: E402

GGML = {"q4_0": GT.Q4_0, "q4_1": GT.Q4_1, "q8_0": GT.Q8_0}  # the type ids are the kernels' too
# rows x cols: one row; a short row group; two bands with a 3-row last group and a ragged last
# tile (576 = 256 + 256 + 64); three bands of 128 and 5, 25 blocks per row
SHAPES = [(1, 32), (13, 96), (203, 576), (261, 800)]
TILES = [(128, 256), (24, 96)]
ISAS = _native.available_isas() + [None]  # every table this CPU runs, and the default one
RTOL = 1e-5


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def weights(rows: int, cols: int, seed) -> np.ndarray:
    w = rng_for("w", rows, cols, seed).standard_normal((rows, cols)).astype(np.float32)
    w[::5] *= 30.0  # rows of very different scale
    if rows > 2:
        w[1, :32] = 0.0  # an all-zero block: d = 0
    return w


def lossless_x(cols: int, seed) -> np.ndarray:
    """Integers with max |x| = 127 in every 32-block (or a zero block): int8-exact activations."""
    rng = rng_for("x", cols, seed)
    x = rng.integers(-127, 128, cols).astype(np.float32)
    for b in range(cols // 32):
        x[32 * b + rng.integers(32)] = rng.choice([-127.0, 127.0])
    if cols >= 64:
        x[32:64] = 0.0
    return x


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A GGUF holding, per shape, the weights as gguf-quantized Q4_0/Q4_1/Q8_0 blocks, F16 and F32."""
    path = tmp_path_factory.mktemp("gguf-oracle") / "w.gguf"
    wr = gguf.GGUFWriter(str(path), "llama")
    for rows, cols in SHAPES:
        w = weights(rows, cols, 0)
        for dtype, t in GGML.items():
            wr.add_tensor(f"{dtype}.{rows}x{cols}", gguf_quantize(w, t), raw_dtype=t)
        wr.add_tensor(f"f16.{rows}x{cols}", w.astype(np.float16))
        wr.add_tensor(f"f32.{rows}x{cols}", w)
    for part, rows in (("q", 24), ("k", 8), ("v", 8)):  # a fused q|k|v, each part its own tensor
        wr.add_tensor(f"attn_{part}", gguf_quantize(weights(rows, 96, part), GT.Q4_1), raw_dtype=GT.Q4_1)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return GGUFModel(path)


def gguf_blocks(g: GGUFModel, name: str) -> np.ndarray:
    return np.asarray(g.tensors[name].data)


def check_matvec(tiled, dtype, rows, cols, tile, w_oracle, x, what):
    want = w_oracle.astype(np.float64) @ x.astype(np.float64)
    scale = np.abs(w_oracle.astype(np.float64)) @ np.abs(x.astype(np.float64)) + 1e-30
    for isa in ISAS:
        got = _native.matvec(tiled, int(GGML[dtype]), rows, cols, x, tile_rows=tile[0], tile_cols=tile[1],
                             isa=isa)
        err = np.abs(got.astype(np.float64) - want) / scale
        assert err.max() <= RTOL, f"{what} on {isa or 'default'}: relative error {err.max():.3g} " \
                                  f"at row {err.argmax()}"


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", list(GGML))
def test_gguf_blocks_through_the_converter(gguf_file, dtype, shape, tile):
    # blocks already in a cflow format go into the tiles bit for bit
    rows, cols = shape
    name = f"{dtype}.{rows}x{cols}"
    src = gguf_file.source(name)
    tiled = Encoder("q4_0", tile).matrix(name, src).data()  # --quant does not apply to native blocks
    w = gguf_dequantize(gguf_blocks(gguf_file, name), GGML[dtype])
    check_matvec(tiled, dtype, rows, cols, tile, w, lossless_x(cols, name), f"{name} tile {tile}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", list(GGML))
@pytest.mark.parametrize("src", ["f16", "f32"])
def test_floats_requantized_by_the_converter_equal_ggml(gguf_file, src, dtype, shape):
    # a float tensor is quantized to --quant by cflow.quant; it must be what ggml's quantizer makes
    rows, cols = shape
    name = f"{src}.{rows}x{cols}"
    tiled = Encoder(dtype).matrix(name, gguf_file.source(name)).data()
    values = gguf_blocks(gguf_file, name).astype(np.float32).reshape(rows, cols)
    w = gguf_dequantize(gguf_quantize(values, GGML[dtype]), GGML[dtype])
    check_matvec(tiled, dtype, rows, cols, (128, 256), w, lossless_x(cols, name), f"{name} -> {dtype}")


def test_fused_qkv_from_gguf_blocks(gguf_file):
    parts = ["attn_q", "attn_k", "attn_v"]
    (td,) = Encoder("q4_0", (16, 64)).qkv("attn.wqkv", *(gguf_file.source(p) for p in parts))
    assert td.dtype == "q4_1" and td.shape == (40, 96)
    w = np.concatenate([gguf_dequantize(gguf_blocks(gguf_file, p), GT.Q4_1) for p in parts])
    check_matvec(td.data(), "q4_1", 40, 96, (16, 64), w, lossless_x(96, "qkv"), "fused q|k|v")
