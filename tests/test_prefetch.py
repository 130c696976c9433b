"""The software-prefetch switch (claim C6): modes, reach, and that it never changes a result.

Every weight-streaming kernel of every table this CPU runs (mat-vec, gate/up, matmat, gate_up_mm,
all dtypes, and the fp32 mat-vec) must give the same bits with prefetch off, in the default mode
and at several distances (not multiples of a line, past the tensor's end), on odd shapes; the
getter reports the mode; bad values are refused with the mode unchanged; Engine.load(prefetch=...)
and `cflow bench --prefetch` reach it, an engine's calls run with its own mode, and its logits do
not depend on it. No timing here (c6_prefetch.py measures).
"""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

import numpy as np
import pytest

from cflow import _native
from cflow import kquant as K
from cflow import quant as Q
from cflow.runtime import EngineError
from cflow.runtime import prefetch as P

ISAS = _native.available_isas()
DEFAULT, MAX_BYTES = _native.PREFETCH_DEFAULT, _native.PREFETCH_MAX  # the C core's modes (runtime.prefetch asks it)
# the default mode, off, a sub-line distance, odd distances, Q6_K's own 8 KiB, and the largest
# (far past the end of every matrix here: nothing is asked for there)
MODES = [DEFAULT, P.OFF, 1, 100, 1000, 4097, 8192, MAX_BYTES]
QDTYPES = ["q4_0", "q4_1", "q8_0"]
KDTYPES = list(K.KDTYPES)
# (rows, cols, tile): short last groups, band tails, several tiles with a narrower last one
SHAPES_32 = [(203, 992, (64, 288)), (77, 544, (128, 256)), (130, 1056, (128, 544))]
SHAPES_K = [(13, 768, (8, 256)), (203, 768, (64, 512)), (136, 1280, (16, 512))]
BATCHES = (1, 5, 67)  # one token, a ragged micro-kernel, more than one 64-token pass


@pytest.fixture(autouse=True)
def restore_mode():
    before = _native.get_prefetch()
    yield
    _native.set_prefetch(before)


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def matrix(dtype, rows, cols, tile):
    """Q4_0 / Q4_1 / Q8_0 quantized from random floats; the K-family as random bytes with finite
    fp16 scales (every bit pattern; tests/test_kquant.py's random_blocks, without its gguf need);
    MXFP4 as random nibbles with E8M0 exponents near 2^0 (a random exponent byte reaches 2^127,
    whose sums overflow to inf and NaN, and NaN never compares equal)."""
    rng = rng_for(dtype, rows, cols, tile)
    if dtype in QDTYPES:
        return Q.quantize_tiled(rng.standard_normal((rows, cols), dtype=np.float32), dtype, tile)
    qb, bb = K.block_geometry(dtype)
    b = rng.integers(0, 256, (rows, cols // qb, bb), dtype=np.uint8)
    fields = K.GGML_FIELDS[dtype]
    for name in ("d", "dmin", "m"):
        if name in fields:
            o = fields[name][0]
            v = (rng.standard_normal((rows, cols // qb)) * 0.01).astype(np.float16)
            b[..., o:o + 2] = v[..., None].view(np.uint8).reshape(rows, cols // qb, 2)
    if "e" in fields:  # MXFP4's scale byte: 2^(e - 128)
        b[..., fields["e"][0]] = rng.integers(118, 131, (rows, cols // qb), dtype=np.uint8)
    return K.tile_kquant(b.reshape(rows, -1), dtype, rows, cols, tile)


def all_modes(fn):
    """fn() in every mode; asserts the getter reports each mode while it runs."""
    out = {}
    for m in MODES:
        _native.set_prefetch(m)
        assert _native.get_prefetch() == m
        out[m] = fn()
    return out


def assert_same(outs, what):
    base = outs[P.OFF]
    for m, got in outs.items():
        assert got.dtype == base.dtype and np.array_equal(got, base), f"{what}: mode {m} differs from off"


def cases():
    for dtype in QDTYPES + KDTYPES:
        for rows, cols, tile in SHAPES_K if dtype in K.K_SUPER else SHAPES_32:
            yield dtype, rows, cols, tile


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype,rows,cols,tile", list(cases()))
def test_tiled_kernels_same_bits_in_every_mode(isa, dtype, rows, cols, tile):
    t = matrix(dtype, rows, cols, tile)
    dt, kw = Q.DTYPE_IDS[dtype], dict(tile_rows=tile[0], tile_cols=tile[1], isa=isa)
    X = rng_for("x", dtype, cols).standard_normal((max(BATCHES), cols), dtype=np.float32)
    ng = (rows + 7) // 8
    assert_same(all_modes(lambda: _native.matvec(t, dt, rows, cols, X[0], **kw)), f"matvec {dtype} {isa}")
    assert_same(all_modes(lambda: _native.matvec(t, dt, rows, cols, X[0], g0=1, g1=ng, **kw)),
                f"matvec {dtype} {isa} groups 1..")
    for B in BATCHES:
        assert_same(all_modes(lambda: _native.matmat(t, dt, rows, cols, X[:B], **kw)), f"matmat {dtype} {isa} B={B}")
    gu_rows = max(16, rows // 16 * 16)  # an interleaved gate/up matrix: 2 d_ff rows, d_ff a multiple of 8
    g = matrix(dtype, gu_rows, cols, tile)
    assert_same(all_modes(lambda: _native.gate_up(g, dt, gu_rows, cols, X[0], **kw)), f"gate_up {dtype} {isa}")
    for B in BATCHES:
        assert_same(all_modes(lambda: _native.gate_up_mm(g, dt, gu_rows, cols, X[:B], **kw)),
                    f"gate_up_mm {dtype} {isa} B={B}")


@pytest.mark.parametrize("isa", ISAS)
def test_threads_and_f32_matvec_same_bits_in_every_mode(isa):
    rows, cols, tile = 203, 992, (64, 288)
    t = matrix("q4_1", rows, cols, tile)
    kw = dict(tile_rows=tile[0], tile_cols=tile[1], isa=isa, pool=_native.Pool(3))
    X = rng_for("xt").standard_normal((9, cols), dtype=np.float32)
    assert_same(all_modes(lambda: _native.matmat(t, Q.DTYPE_IDS["q4_1"], rows, cols, X, **kw)), f"matmat pool {isa}")
    W = rng_for("f32").standard_normal((37, 101), dtype=np.float32)
    assert_same(all_modes(lambda: _native.matvec_f32(W, X[0, :101], isa=isa)), f"matvec_f32 {isa}")


def test_modes_getter_and_bad_values():
    assert (P.default_mode(), P.OFF, P.max_bytes()) == (DEFAULT, _native.PREFETCH_OFF, MAX_BYTES) == (-1, 0, 1 << 20)
    for m in (DEFAULT, P.OFF, 64, MAX_BYTES):
        _native.set_prefetch(m)
        assert _native.get_prefetch() == m
    for bad in (-2, MAX_BYTES + 1):
        with pytest.raises(ValueError, match="prefetch must be"):
            _native.set_prefetch(bad)
        assert _native.get_prefetch() == MAX_BYTES  # unchanged


def test_default_matvec_distance_follows_the_cpu():
    """The default mode's one-row mat-vec distance (dispatch.c, cf_matvec_default_ahead): none on
    Zen 4 (AMD family 19h with AVX-512: measured 25-40% slower with it), 2 KiB on Intel (4 KiB and
    more measured up to 1.9x slower than 2 KiB on a Xeon), 8 KiB elsewhere; Q6_K keeps 8 KiB
    everywhere (its interleaved streams defeat the hardware prefetcher)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    field = lambda k: next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith(k)), "")
    zen4 = (field("vendor_id") == "AuthenticAMD" and field("cpu family") == "25"
            and " avx512f " in f" {field('flags')} ")
    intel = field("vendor_id") == "GenuineIntel"
    assert _native.matvec_default_ahead(Q.DTYPE_IDS["q4_0"]) == (0 if zen4 else 2048 if intel else 8192)
    assert _native.matvec_default_ahead(Q.DTYPE_IDS["q4_1"]) == _native.matvec_default_ahead(Q.DTYPE_IDS["q8_0"])
    assert _native.matvec_default_ahead(Q.DTYPE_IDS["q6_k"]) == 8192


def test_every_kernel_prefetch_goes_through_the_one_helper():
    """Structure, not disassembly: the kernels issue software prefetch only through
    cf_prefetch_ahead (kernels_internal.h), whose distance is 0 when the mode is off, so "off"
    means no PREFETCH instruction executes in any kernel."""
    native = Path(__file__).resolve().parents[1] / "src" / "cflow" / "native"
    raw = re.compile(r"_mm_prefetch|__builtin_prefetch|prefetch[tn]")
    for f in sorted(native.glob("kernels_*.c")):
        assert not raw.search(f.read_text()), f"{f.name} prefetches without cf_prefetch_ahead"
    helper = (native / "kernels_internal.h").read_text()
    assert helper.count("__builtin_prefetch") == 1 and "if (dist <= 0) return;" in helper


def test_python_spellings():
    assert [P.parse(s) for s in ("default", "off", "0", "1024", " OFF ")] == [None, 0, 0, 1024, 0]
    for bad in ("on", "-1", "1.5", str(MAX_BYTES + 1), ""):
        with pytest.raises(ValueError, match="off|default|distance"):
            P.parse(bad)
    assert [P.label(v) for v in (None, DEFAULT, 0, 512)] == ["default", "default", "off", "512"]
    assert [P.to_mode(v) for v in (None, 0, 512)] == [DEFAULT, 0, 512]
    for bad in (-1, True, 1.0, "512", MAX_BYTES + 1):
        with pytest.raises(EngineError) as e:
            P.to_mode(bad)
        assert e.value.flag == "--prefetch"


# ---- end to end: Engine and `cflow bench` ----------------------------------------------------------
@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """A small MoE model (router mat-vec, experts, dense FFN): every weight-streaming path."""
    pytest.importorskip("torch")
    from test_engine import small_config, write_random_model

    path = tmp_path_factory.mktemp("prefetch") / "moe.cflow"
    write_random_model(path, small_config("arch2_4_combined", n_layers=3), "q4_1", (32, 64))
    return path


def run_engine(eng, prompt, steps):
    eng.reset()
    out = [eng.prefill(prompt).copy()]
    tok, pos = int(np.argmax(out[0])), len(prompt)
    for _ in range(steps):
        out.append(eng.step(tok, pos).copy())
        tok, pos = int(np.argmax(out[-1])), pos + 1
    return np.stack(out)


@pytest.mark.parametrize("experts", ["ram", "disk"])
def test_engine_logits_same_bits_in_every_mode(moe_model, experts):
    from cflow.runtime import Engine

    prompt = list(range(5, 26))
    kw = dict(threads=2, n_ctx=48, max_batch=8, experts=experts)
    if experts == "disk":
        kw.update(expert_cache="1G", expert_io="sync")
    with Engine.load(moe_model, prefetch=0, **kw) as eng:
        assert eng.prefetch == 0
        base = run_engine(eng, prompt, 6)
        for value in (None, 64, 1000, MAX_BYTES):
            eng.prefetch = value
            assert eng.prefetch == value
            got = run_engine(eng, prompt, 6)
            # every call makes the engine's mode the process-wide one the kernels read
            assert _native.get_prefetch() == P.to_mode(value)
            assert np.array_equal(got, base), f"prefetch {value} changes the logits"


def test_engine_refuses_bad_values_before_loading(moe_model, tmp_path):
    from cflow.runtime import Engine

    for bad in (-1, 2 * MAX_BYTES, "1024", True):
        with pytest.raises(EngineError, match="prefetch") as e:
            Engine.load(moe_model, prefetch=bad)
        assert e.value.flag == "--prefetch"
    with Engine.load(moe_model, threads=1) as eng:
        assert eng.prefetch is None
        with pytest.raises(EngineError):
            eng.prefetch = -5
        assert eng.prefetch is None


def test_bench_records_the_mode(moe_model, capsys):
    from cflow.bench import bench
    from cflow.cli import main

    rep = bench(moe_model, threads=[1], pp=8, tg=4, reps=1, warmup=False, probe=False, footprint=False, prefetch=256)
    d = json.loads(rep.to_json())
    assert d["prefetch"] == "256" and all(r["prefetch"] == "256" for r in d["rows"])
    assert "PREFETCHT0 256 B ahead" in rep.to_markdown()
    assert main(["bench", "-m", str(moe_model), "-t", "1", "-p", "8", "-n", "2", "-r", "1", "--no-probe",
                 "--no-footprint", "--no-warmup", "-q", "--json", "--prefetch", "off"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["prefetch"] for r in rows] == ["off", "off"]
    assert main(["bench", "-m", str(moe_model), "-t", "1", "-p", "0", "-n", "2", "-r", "1", "--no-probe",
                 "--no-footprint", "--no-warmup", "-q", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["prefetch"] == "default"
    with pytest.raises(SystemExit):
        main(["bench", "-m", str(moe_model), "--prefetch", "sometimes"])
    assert "expected off, default or a distance" in capsys.readouterr().err
