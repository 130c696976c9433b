"""Fuzzing the .cflow reader: mutated preambles, headers and tensor tables, and truncations.

The reader may only ever raise FormatError subclasses, and it may not succeed silently with a
tensor table (or expert table) that differs from the one written: every such edit must be caught,
structurally or by the (descriptor-covering) checksums under verify=True.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cflow import fileformat as F
from cflow import quant as Q
from cflow.config import ModelConfig

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _tiny_file(path) -> None:
    cfg = ModelConfig.from_name("arch2_4_combined", vocab_size=40, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1,
                                d_ff=64, n_experts=2, top_k=1, d_expert=32)
    rng = np.random.default_rng(0)
    tensors = []
    for k, (name, shape) in enumerate(F.model_tensors(cfg).items()):
        w = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 1 or name.endswith("router"):
            tensors.append(F.TensorData(name, "f32", shape, "rows", Q.to_plain(w, "f32")))
        else:
            dtype = ("q4_0", "q4_1", "q8_0")[k % 3]
            tensors.append(F.TensorData(name, dtype, shape, "tiled", Q.quantize_tiled(w, dtype), {"k": k}))
    F.write_model(path, config=cfg, tokenizer={"model": "bpe", "vocab": ["a", "b"]}, tensors=tensors,
                  metadata={"note": "fuzz"})


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    _tiny_file(d / "base.cflow")
    raw = (d / "base.cflow").read_bytes()
    with F.open_model(d / "base.cflow", verify=True) as cf:
        tables = _tables(cf)
    return {"raw": raw, "dir": d, "tables": tables, "hlen": struct.unpack("<Q", raw[16:24])[0]}


def _tables(cf: F.CflowFile):
    return dict(cf.tensors), dict(cf.experts)


def _open(base, data: bytes, verify: bool = True):
    """Open mutated bytes; return the tables on success, or None when a FormatError was raised.
    Any other exception propagates and fails the test."""
    p = base["dir"] / "mut.cflow"
    p.write_bytes(data)
    try:
        with F.open_model(p, verify=verify) as cf:
            return _tables(cf)
    except F.FormatError:
        return None


@FUZZ
@given(st.data())
def test_header_byte_mutations(base, data):
    raw = bytearray(base["raw"])
    end = 24 + base["hlen"]
    for _ in range(data.draw(st.integers(1, 4), label="n")):
        pos = data.draw(st.integers(0, end - 1), label="pos")
        raw[pos] = data.draw(st.integers(0, 255), label="byte")
    got = _open(base, bytes(raw))
    # success is allowed only when the tables are exactly the original ones
    assert got is None or got == base["tables"]


@FUZZ
@given(st.data())
def test_table_region_mutations(base, data):
    # aim at the tensor table itself: digits, quotes and letters inside its JSON text
    raw = bytearray(base["raw"])
    text = raw[24:24 + base["hlen"]]
    start = text.index(b'"tensors":') + 24
    stop = text.index(b'"metadata":') + 24
    for _ in range(data.draw(st.integers(1, 3), label="n")):
        pos = data.draw(st.integers(start, stop - 1), label="pos")
        raw[pos] = data.draw(st.sampled_from(b'0123456789abcdef"{}[],:.-_ qx'), label="byte")
    got = _open(base, bytes(raw))
    assert got is None or got == base["tables"]


@FUZZ
@given(st.integers(0, 10**9))
def test_truncation(base, n):
    raw = base["raw"]
    cut = n % len(raw)
    assert _open(base, raw[:cut], verify=False) is None


_VALUES = st.one_of(st.integers(-2**70, 2**70), st.integers(-5, 300_000), st.text(max_size=8), st.none(),
                    st.booleans(), st.floats(allow_nan=False), st.lists(st.integers(-3, 200), max_size=4),
                    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@FUZZ
@given(st.data())
def test_semantic_table_edits(base, data):
    header = json.loads(base["raw"][24:24 + base["hlen"]])
    names = list(header["tensors"])
    where = data.draw(st.sampled_from(["tensor", "expert", "drop", "rename"]), label="where")
    if where == "tensor":
        entry = header["tensors"][data.draw(st.sampled_from(names), label="name")]
        key = data.draw(st.sampled_from(sorted(entry)), label="key")
        new = data.draw(_VALUES, label="value")
        if json.dumps(new) == json.dumps(entry[key]):
            return
        entry[key] = new
    elif where == "expert":
        entry = header["experts"][data.draw(st.integers(0, len(header["experts"]) - 1), label="i")]
        key = data.draw(st.sampled_from(sorted(entry)), label="key")
        new = data.draw(_VALUES, label="value")
        if json.dumps(new) == json.dumps(entry[key]):
            return
        entry[key] = new
    elif where == "drop":
        header["tensors"].pop(data.draw(st.sampled_from(names), label="name"))
    else:
        old = data.draw(st.sampled_from(names), label="name")
        new_name = data.draw(st.text(min_size=1, max_size=12), label="new")
        if new_name in header["tensors"]:
            return
        header["tensors"] = {(new_name if k == old else k): v for k, v in header["tensors"].items()}
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
    if len(text) > base["hlen"]:
        return
    raw = base["raw"]
    mutated = raw[:24] + text + b" " * (base["hlen"] - len(text)) + raw[24 + base["hlen"]:]
    assert _open(base, mutated) is None  # every real change to the tables is caught


@FUZZ
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1),
       st.binary(min_size=8, max_size=8))
def test_preamble_fields(base, version, flags, hlen, magic):
    raw = base["raw"]
    m, v, f, h = struct.unpack("<8sIIQ", raw[:24])
    for field in range(4):  # one field changed at a time
        fields = [m, v, f, h]
        fields[field] = [magic, version, flags, hlen][field]
        if fields == [m, v, f, h]:
            continue
        assert _open(base, struct.pack("<8sIIQ", *fields) + raw[24:], verify=False) is None
