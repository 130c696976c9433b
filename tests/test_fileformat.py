"""cflow.fileformat: write -> read round trips in both orders, atomic writes, and every named
error triggered by a crafted file."""

from __future__ import annotations

import json
import os
import struct
import sys
import types

import numpy as np
import pytest

from cflow import fileformat as F
from cflow import quant as Q
from cflow.config import ModelConfig
from cflow.errors import CflowError
from cflow.fileformat.layout import align_up

TOKENIZER = {"model": "bpe", "vocab": ["a", "b", "Ġc", "<|im_start|>"], "merges": ["a b"], "bos_id": None,
             "eos_id": 3, "add_bos": False, "chat_template": "{{ messages }}", "special": {"<|im_start|>": 3},
             "pre": None}
_DTYPE_CYCLE = ["q4_0", "q4_1", "q8_0", "f16"]


def small_config(preset: str = "arch2_4_combined", **kw) -> ModelConfig:
    # odd sizes: 100 vocab rows (short last row group), d = 96 (one 96-wide tile at TK=256)
    base = dict(vocab_size=100, d_model=96, n_layers=3, n_heads=3, n_kv_heads=1)
    if preset != "llama":
        base.update(d_ff=160, n_experts=3, top_k=1, d_expert=64)
    else:
        base.update(d_ff=224)
    base.update(kw)
    return ModelConfig.from_name(preset, **base)


def make_tensors(cfg: ModelConfig, seed: int = 0, tile=Q.TILE) -> list[F.TensorData]:
    """Random tensors for every name the config needs: F32 rows for norms/router, tiled matrices
    cycling through the quantized dtypes (and f16) otherwise."""
    rng = np.random.default_rng(seed)
    out = []
    for k, (name, shape) in enumerate(F.model_tensors(cfg).items()):
        w = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 1 or name.endswith("moe.router"):
            out.append(F.TensorData(name, "f32", shape, "rows", Q.to_plain(w, "f32")))
            continue
        dtype = _DTYPE_CYCLE[k % len(_DTYPE_CYCLE)]
        meta = {"fused": "qkv", "splits": [cfg.q_dim, cfg.kv_dim, cfg.kv_dim]} if name.endswith("wqkv") else {}
        out.append(F.TensorData(name, dtype, shape, "tiled", Q.tile_matrix(Q.quantize(w, dtype), dtype, *shape, tile),
                                meta))
    return out


def write(path, cfg=None, tensors=None, **kw) -> F.WriteSummary:
    cfg = cfg or small_config()
    tensors = make_tensors(cfg) if tensors is None else tensors
    return F.write_model(path, config=cfg, tokenizer=TOKENIZER, tensors=tensors, **kw)


# ---- round trips -----------------------------------------------------------------------------
def _check_round_trip(path, cfg, tensors, order):
    for mmap in (True, False):
        with F.open_model(path, verify=True, mmap=mmap) as cf:
            assert cf.order == order and cf.config == cfg and cf.tokenizer == TOKENIZER
            assert cf.metadata == {"source": "test"}
            assert set(cf.tensors) == {t.name for t in tensors}
            for t in tensors:
                e = cf.tensors[t.name]
                assert (e.dtype, e.shape, e.layout, e.meta) == (t.dtype, tuple(t.shape), t.layout, t.meta)
                assert e.offset % F.ALIGN == 0 and e.nbytes == t.data.size
                a = cf.array(t.name)
                assert a.dtype == np.uint8 and not a.flags.writeable
                assert np.shares_memory(a, cf.buffer)  # a view, not a copy
                np.testing.assert_array_equal(a, t.data)
            assert cf.buffer.size == os.path.getsize(path) and cf.buffer.size % F.ALIGN == 0
            # the bytes round-trip down to the float values
            name = "layers.1.attn.wo"
            e = cf.tensors[name]
            np.testing.assert_array_equal(
                Q.untile_matrix(cf.array(name), e.dtype, *e.shape),
                Q.untile_matrix(next(t.data for t in tensors if t.name == name), e.dtype, *e.shape))
            norm = next(t.data for t in tensors if t.name == "norm")
            np.testing.assert_array_equal(cf.plain("norm"), Q.from_plain(norm, "f32", (cfg.d_model,)))
    with open(path, "rb") as f:
        magic, version, flags, hlen = struct.unpack("<8sIIQ", f.read(24))
    assert (magic, version, flags) == (F.MAGIC, F.VERSION, int(order == "vflow"))
    assert (24 + hlen) % F.ALIGN == 0


def _file_order(path) -> list[str]:
    with F.open_model(path) as cf:
        return [e.name for e in sorted(cf.tensors.values(), key=lambda e: e.offset)]


def _check_experts_contiguous(path, cfg):
    with F.open_model(path) as cf:
        assert len(cf.experts) == cfg.n_unique_layers * cfg.n_experts
        for (i, e), (off, n) in cf.experts.items():
            gu = cf.tensors[f"layers.{i}.moe.experts.{e}.w_gate_up"]
            dn = cf.tensors[f"layers.{i}.moe.experts.{e}.w_down"]
            assert off == gu.offset and off % F.ALIGN == 0
            assert dn.offset == align_up(gu.offset + gu.nbytes)  # nothing else in between
            assert off + n == dn.offset + dn.nbytes


def test_round_trip_cflow(tmp_path):
    cfg = small_config()
    tensors = make_tensors(cfg)
    s = write(tmp_path / "m.cflow", cfg, tensors, metadata={"source": "test"})
    assert s.n_tensors == len(tensors) and s.data_bytes == sum(t.data.size for t in tensors)
    assert s.file_bytes == os.path.getsize(tmp_path / "m.cflow")
    _check_round_trip(tmp_path / "m.cflow", cfg, tensors, "cflow")
    assert _file_order(tmp_path / "m.cflow") == list(F.model_tensors(cfg))  # layer-major
    _check_experts_contiguous(tmp_path / "m.cflow", cfg)


def test_round_trip_ignores_input_order(tmp_path):
    cfg = small_config("llama")
    tensors = make_tensors(cfg)
    write(tmp_path / "m.cflow", cfg, list(reversed(tensors)), metadata={"source": "test"})
    assert _file_order(tmp_path / "m.cflow") == list(F.model_tensors(cfg))
    _check_round_trip(tmp_path / "m.cflow", cfg, tensors, "cflow")


@pytest.mark.parametrize("preset", ["arch2_4_combined", "arch5", "llama", "arch1"])
def test_round_trip_vflow_follows_dag_schedule(tmp_path, preset):
    dag = pytest.importorskip("cflow.dag")
    cfg = small_config(preset, n_layers=4, **({"n_unique_layers": 2} if preset == "arch5" else {}))
    tensors = make_tensors(cfg)
    write(tmp_path / "m.vflow", cfg, tensors, order="vflow", metadata={"source": "test"})
    _check_round_trip(tmp_path / "m.vflow", cfg, tensors, "vflow")
    order = _file_order(tmp_path / "m.vflow")
    # expected: walk the schedule, each node's tensors at their first use
    expect: list[str] = []
    for stage in dag.schedule(cfg):
        for node in stage:
            expect += [n for n in F.node_tensors(cfg, node) if n not in expect]
    assert order == expect and sorted(order) == sorted(F.model_tensors(cfg))
    if cfg.has_moe:
        _check_experts_contiguous(tmp_path / "m.vflow", cfg)
        if cfg.delta_dense or cfg.delta_expert:
            assert order != list(F.model_tensors(cfg))  # the delays really reorder the file


def test_vflow_with_fake_schedule(tmp_path, monkeypatch):
    # the node -> tensor mapping on its own, against a hand-written stage list
    cfg = small_config("arch2_4_combined", n_layers=2)
    fake = types.ModuleType("cflow.dag")
    fake.schedule = lambda c: [["embed"], ["L1.attn", "L0.attn"], ["L0.experts", "L0.dense"], ["lm_head"]]
    monkeypatch.setitem(sys.modules, "cflow.dag", fake)
    import cflow
    monkeypatch.setattr(cflow, "dag", fake, raising=False)
    write(tmp_path / "m.vflow", cfg, order="vflow")
    order = _file_order(tmp_path / "m.vflow")
    l0, l1 = "layers.0.", "layers.1."
    head = ["tok_emb", l1 + "attn_norm", l1 + "attn.wqkv", l1 + "attn.wo", l0 + "attn_norm", l0 + "attn.wqkv",
            l0 + "attn.wo"] + [f"{l0}moe.experts.{e}.{w}" for e in range(3) for w in ("w_gate_up", "w_down")] + \
           [l0 + "ffn_norm", l0 + "ffn.w_gate_up", l0 + "ffn.w_down", "norm"]
    assert order[:len(head)] == head
    # what the schedule never mentions follows in layer-major order
    rest = [n for n in F.model_tensors(cfg) if n not in head]
    assert order[len(head):] == rest


def test_node_tensors_mapping():
    cfg = small_config("arch5", n_layers=4, n_unique_layers=2)
    assert F.node_tensors(cfg, "L3.attn") == ["layers.1.attn_norm", "layers.1.attn.wqkv", "layers.1.attn.wo"]
    assert F.node_tensors(cfg, "L2.router") == ["layers.0.moe_norm", "layers.0.moe.router"]
    assert len(F.node_tensors(cfg, "L0.experts")) == 2 * cfg.n_experts
    assert F.node_tensors(cfg, "lm_head") == ["norm", "tok_emb"]
    assert F.node_tensors(small_config(tie_embeddings=False), "lm_head") == ["norm", "lm_head"]
    with pytest.raises(F.FormatError):
        F.node_tensors(cfg, "L0.bogus")


def test_expected_shapes_and_counts():
    for preset in ("arch1", "arch5", "llama"):
        cfg = small_config(preset, tie_embeddings=preset != "arch1")
        shapes = F.model_tensors(cfg)
        assert F.expected_count(cfg) == len(shapes)
        for name, shape in shapes.items():
            assert F.expected_shape(cfg, name) == shape
    cfg = small_config()
    assert F.expected_shape(cfg, "layers.9.attn.wo") is None
    assert F.expected_shape(cfg, "layers.0.moe.experts.7.w_down") is None
    assert F.expected_shape(cfg, "lm_head") is None  # tied
    assert F.tensor_category("layers.0.moe.experts.1.w_down") == "experts"
    assert F.tensor_category("layers.0.moe.router") == "router"
    assert F.tensor_category("layers.0.ffn_norm") == "norms"
    assert F.tensor_category("tok_emb") == "embeddings"


def test_lazy_data_and_progress(tmp_path):
    cfg = small_config("llama")
    tensors = make_tensors(cfg)
    calls: list[str] = []

    def lazy(t):
        def produce():
            calls.append(t.name)
            return t.data
        return F.TensorData(t.name, t.dtype, t.shape, t.layout, produce, t.meta)

    seen: list[tuple[int, int, str]] = []
    write(tmp_path / "m.cflow", cfg, (lazy(t) for t in reversed(tensors)),
          progress=lambda done, total, name: seen.append((done, total, name)))
    assert calls == list(F.model_tensors(cfg))  # called once each, in file order
    total = sum(t.data.size for t in tensors)
    assert [s[2] for s in seen] == calls and seen[-1][:2] == (total, total)
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))
    with F.open_model(tmp_path / "m.cflow", verify=True) as cf:
        np.testing.assert_array_equal(cf.array("tok_emb"), tensors[0].data)


# ---- atomic writes ---------------------------------------------------------------------------
def _dir_listing(d) -> list[str]:
    return sorted(os.listdir(d))


def test_failing_generator_leaves_nothing(tmp_path):
    cfg = small_config()
    tensors = make_tensors(cfg)

    def gen():
        yield from tensors[:5]
        raise RuntimeError("source broke")

    with pytest.raises(RuntimeError, match="source broke"):
        write(tmp_path / "m.cflow", cfg, gen())
    assert _dir_listing(tmp_path) == []


def test_failure_mid_write_leaves_old_file_and_no_temp(tmp_path):
    cfg = small_config()
    tensors = make_tensors(cfg)
    out = tmp_path / "m.cflow"
    write(out, cfg, tensors, metadata={"source": "test"})
    before = out.read_bytes()

    def boom():
        raise OSError("disk on fire")

    broken = list(tensors)
    broken[7] = F.TensorData(broken[7].name, broken[7].dtype, broken[7].shape, broken[7].layout, boom)
    with pytest.raises(OSError, match="disk on fire"):
        write(out, cfg, broken)
    assert _dir_listing(tmp_path) == ["m.cflow"] and out.read_bytes() == before

    new = tmp_path / "new.cflow"
    with pytest.raises(OSError):
        write(new, cfg, broken)
    assert _dir_listing(tmp_path) == ["m.cflow"]
    # a wrong-sized array discovered mid-write is a named error, and also leaves nothing
    bad = list(tensors)
    bad[-1] = F.TensorData(bad[-1].name, bad[-1].dtype, bad[-1].shape, bad[-1].layout, bad[-1].data[:-4])
    with pytest.raises(F.ShapeMismatchError):
        write(new, cfg, bad)
    assert _dir_listing(tmp_path) == ["m.cflow"]


_KILLED_WRITER = """
import sys, time
sys.path.insert(0, {tests!r})
from test_fileformat import F, make_tensors, small_config, write
cfg = small_config()
tensors = make_tensors(cfg)

def stall():
    print("writing", flush=True)  # the preamble, header and earlier tensors are in the temp file
    time.sleep(60)

t = tensors[6]
tensors[6] = F.TensorData(t.name, t.dtype, t.shape, t.layout, stall)
write({out!r}, cfg, tensors)
"""


def test_killed_writer_leaves_no_output(tmp_path):
    """SIGKILL mid-write (no cleanup runs): OUT never appears, an existing OUT is untouched."""
    import signal
    import subprocess

    out = tmp_path / "m.cflow"
    for existing in (False, True):
        if existing:
            write(out)
        before = out.read_bytes() if existing else None
        code = _KILLED_WRITER.format(tests=os.path.dirname(__file__), out=str(out))
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "writing"
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            proc.kill()
        assert proc.returncode == -signal.SIGKILL
        if existing:
            assert out.read_bytes() == before
        else:
            assert not out.exists()
        # the only trace is the hidden temp file the killed process could not remove
        assert all(n == "m.cflow" or (n.startswith(".m.cflow.") and n.endswith(".tmp"))
                   for n in _dir_listing(tmp_path))


def test_written_file_has_normal_permissions(tmp_path):
    write(tmp_path / "m.cflow")
    mask = os.umask(0)
    os.umask(mask)
    assert os.stat(tmp_path / "m.cflow").st_mode & 0o777 == 0o666 & ~mask


# ---- writer input errors ---------------------------------------------------------------------
def _replace(tensors, name, **kw):
    out = []
    for t in tensors:
        if t.name == name:
            d = dict(name=t.name, dtype=t.dtype, shape=t.shape, layout=t.layout, data=t.data, meta=t.meta)
            d.update(kw)
            t = F.TensorData(**d)
        out.append(t)
    return out


@pytest.mark.parametrize("mutate,err", [
    (lambda ts: ts + [ts[0]], F.DuplicateTensorError),
    (lambda ts: [t for t in ts if t.name != "norm"], F.MissingTensorError),
    (lambda ts: _replace(ts, "norm", dtype="bf16"), F.UnknownDtypeError),
    (lambda ts: _replace(ts, "norm", layout="cols"), F.UnknownLayoutError),
    (lambda ts: _replace(ts, "norm", shape=(95,)), F.ShapeMismatchError),
    (lambda ts: _replace(ts, "norm", data=np.zeros(96, np.float32)), F.FormatError),
    (lambda ts: _replace(ts, "layers.0.attn.wo", shape=(96, 95)), F.ShapeMismatchError),
])
def test_writer_rejects_bad_tensors(tmp_path, mutate, err):
    cfg = small_config()
    with pytest.raises(err):
        write(tmp_path / "m.cflow", cfg, mutate(make_tensors(cfg)))
    assert _dir_listing(tmp_path) == []


def test_writer_rejects_bad_arguments(tmp_path):
    cfg = small_config()
    with pytest.raises(F.FormatError):
        write(tmp_path / "m.cflow", cfg, order="zflow")
    with pytest.raises(F.InvalidConfigError):
        F.write_model(tmp_path / "m.cflow", config={**cfg.to_dict(), "n_kv_heads": 2}, tokenizer={}, tensors=[])
    with pytest.raises(F.FormatError):
        write(tmp_path / "m.cflow", cfg, tile=(100, 256))
    assert _dir_listing(tmp_path) == []
    # partial files are allowed on request, and then opened on request
    write(tmp_path / "p.cflow", cfg, make_tensors(cfg)[:4], require_complete=False)
    with pytest.raises(F.MissingTensorError):
        F.open_model(tmp_path / "p.cflow")
    with F.open_model(tmp_path / "p.cflow", require_complete=False) as cf:
        assert len(cf.tensors) == 4


# ---- crafted files: every named reader error -------------------------------------------------
@pytest.fixture(scope="module")
def good_file(tmp_path_factory) -> bytes:
    p = tmp_path_factory.mktemp("good") / "m.cflow"
    write(p, metadata={"source": "test"})
    return p.read_bytes()


def split(raw: bytes) -> tuple[int, int, int, dict]:
    _, version, flags, hlen = struct.unpack("<8sIIQ", raw[:24])
    return version, flags, hlen, json.loads(raw[24:24 + hlen])


def _dumps(h: dict) -> bytes:
    return json.dumps(h, ensure_ascii=False, separators=(",", ":")).encode()


def rebuild(raw: bytes, header: dict | bytes) -> bytes:
    """Same file with another header text, padded to the same length (the data stays put)."""
    _, _, hlen, _ = split(raw)
    text = header if isinstance(header, bytes) else _dumps(header)
    assert len(text) <= hlen
    return raw[:24] + text + b" " * (hlen - len(text)) + raw[24 + hlen:]


def patch_preamble(raw: bytes, version=None, flags=None, hlen=None, magic=None) -> bytes:
    m, v, f, h = struct.unpack("<8sIIQ", raw[:24])
    return struct.pack("<8sIIQ", magic or m, v if version is None else version, f if flags is None else flags,
                       h if hlen is None else hlen) + raw[24:]


def edit(raw: bytes, fn) -> bytes:
    h = split(raw)[3]
    fn(h)
    return rebuild(raw, h)


def _tensor(h, name="layers.0.attn.wo"):
    return h["tensors"][name]


def _names(h):
    return list(h["tensors"])


CRAFTED = {
    "too_short": (lambda r: r[:10], F.FileTooShortError),
    "empty": (lambda r: b"", F.FileTooShortError),
    "html": (lambda r: b"<!DOCTYPE html><html><body>404 Not Found</body></html>\n" * 10, F.BadMagicError),
    "bad_magic": (lambda r: b"XXXXXXXX" + r[8:], F.BadMagicError),
    "version": (lambda r: patch_preamble(r, version=2), F.UnsupportedVersionError),
    "unknown_flag": (lambda r: patch_preamble(r, flags=0b10), F.FlagsError),
    "flag_vs_order": (lambda r: patch_preamble(r, flags=1), F.FlagsError),
    "header_too_large": (lambda r: patch_preamble(r, hlen=1 << 40), F.HeaderTooLargeError),
    "header_len_misaligned": (lambda r: patch_preamble(r, hlen=split(r)[2] - 8), F.MisalignedOffsetError),
    "header_past_end": (lambda r: r[:4000], F.TruncatedFileError),
    "data_truncated": (lambda r: r[:-F.ALIGN], F.TruncatedFileError),
    "data_truncated_1": (lambda r: r[:-1], F.TruncatedFileError),
    "trailing": (lambda r: r + b"\0" * 100, F.TrailingDataError),
    "not_utf8": (lambda r: rebuild(r, b'{"a": "\xff"}'), F.HeaderDecodeError),
    "bad_json": (lambda r: rebuild(r, b'{"format": "cflow",'), F.HeaderDecodeError),
    "json_array": (lambda r: rebuild(r, b"[1, 2]"), F.HeaderDecodeError),
    "nan": (lambda r: rebuild(r, b'{"x": NaN}'), F.HeaderDecodeError),
    "dup_key": (lambda r: rebuild(r, b'{"format": "cflow", "format": "cflow"}'), F.HeaderDecodeError),
    "huge_int": (lambda r: rebuild(r, b'{"x": ' + b"9" * 5000 + b"}"), F.HeaderDecodeError),
    # another tensor's entry renamed "norm": a duplicate name in a header no longer than the original
    "dup_tensor": (lambda r: rebuild(r, _dumps(split(r)[3]).replace(b'"layers.0.attn_norm":', b'"norm":', 1)),
                   F.DuplicateTensorError),
    "missing_key": (lambda r: edit(r, lambda h: h.pop("experts")), F.HeaderSchemaError),
    "unknown_key": (lambda r: edit(r, lambda h: h.update(extra=1)), F.HeaderSchemaError),
    "wrong_type": (lambda r: edit(r, lambda h: h.update(tensors=[])), F.HeaderSchemaError),
    "bool_as_int": (lambda r: edit(r, lambda h: _tensor(h).update(offset=True)), F.HeaderSchemaError),
    "negative_offset": (lambda r: edit(r, lambda h: _tensor(h).update(offset=-4096)), F.HeaderSchemaError),
    "bad_tile": (lambda r: edit(r, lambda h: h["quant"].update(tile=[100, 256])), F.HeaderSchemaError),
    "bad_checksum_text": (lambda r: edit(r, lambda h: _tensor(h).update(checksum="md5:1")), F.HeaderSchemaError),
    "tensor_unknown_key": (lambda r: edit(r, lambda h: _tensor(h).update(strides=[1])), F.HeaderSchemaError),
    "bad_config": (lambda r: edit(r, lambda h: h["config"].update(n_kv_heads=2)), F.InvalidConfigError),
    "config_unknown_key": (lambda r: edit(r, lambda h: h["config"].update(foo=1)), F.InvalidConfigError),
    "config_bad_type": (lambda r: edit(r, lambda h: h["config"].update(rope_theta="x")), F.InvalidConfigError),
    "dtype": (lambda r: edit(r, lambda h: _tensor(h).update(dtype="q3_k")), F.UnknownDtypeError),
    "layout": (lambda r: edit(r, lambda h: _tensor(h).update(layout="cols")), F.UnknownLayoutError),
    "nbytes": (lambda r: edit(r, lambda h: _tensor(h).update(nbytes=_tensor(h)["nbytes"] + 1)),
               F.ShapeMismatchError),
    "shape_vs_dtype": (lambda r: edit(r, lambda h: _tensor(h).update(shape=[96, 33])), F.ShapeMismatchError),
    "shape_vs_config": (lambda r: edit(r, lambda h: _tensor(h, "norm").update(shape=[48, 2])),
                        F.ShapeMismatchError),
    "misaligned": (lambda r: edit(r, lambda h: _tensor(h).update(offset=_tensor(h)["offset"] + 64)),
                   F.MisalignedOffsetError),
    "past_end": (lambda r: edit(r, lambda h: _tensor(h).update(offset=h["file_bytes"])),
                 F.TensorOutOfBoundsError),
    "in_header": (lambda r: edit(r, lambda h: _tensor(h).update(offset=0)), F.TensorOutOfBoundsError),
    "overlap": (lambda r: edit(r, lambda h: _tensor(h).update(offset=_tensor(h, "layers.0.attn.wqkv")["offset"])),
                F.OverlapError),
    "missing_tensor": (lambda r: edit(r, lambda h: h["tensors"].pop("norm")), F.MissingTensorError),
    "expert_nbytes": (lambda r: edit(r, lambda h: h["experts"][1].update(nbytes=h["experts"][1]["nbytes"] + 4)),
                      F.ExpertTableError),
    "expert_missing": (lambda r: edit(r, lambda h: h["experts"].pop()), F.ExpertTableError),
    "expert_dup": (lambda r: edit(r, lambda h: h["experts"].__setitem__(-1, dict(h["experts"][0]))), F.ExpertTableError),
    "expert_misaligned": (lambda r: edit(r, lambda h: h["experts"][0].update(offset=h["experts"][0]["offset"] + 8)),
                          F.MisalignedOffsetError),
    "expert_past_end": (lambda r: edit(r, lambda h: h["experts"][0].update(offset=h["file_bytes"])),
                        F.TensorOutOfBoundsError),
    # a config that declares multi-token prediction heads the file does not carry
    "mtp_heads_missing": (lambda r: edit(r, lambda h: h["config"].update(mtp_heads=1)), F.MtpHeadsError),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_file_raises_named_error(tmp_path, good_file, case):
    make, err = CRAFTED[case]
    p = tmp_path / "bad.cflow"
    p.write_bytes(make(good_file))
    with pytest.raises(err) as info:
        F.open_model(p)
    assert isinstance(info.value, F.FormatError) and isinstance(info.value, CflowError)
    assert len(str(info.value)) > 20  # says what is wrong (and what to do)


def test_every_named_error_is_exercised():
    named = {c for c in vars(F).values() if isinstance(c, type) and issubclass(c, F.FormatError)} - {F.FormatError}
    crafted = {err for _, err in CRAFTED.values()} | {F.ChecksumError}  # checksums: test_checksums
    assert named == crafted


def test_bad_magic_hints(tmp_path, good_file):
    p = tmp_path / "bad.cflow"
    for content, hint in [(b"<html><body>Not found</body></html>" * 4, "HTML"),
                          (b"version https://git-lfs.github.com/spec/v1\noid sha256:00\n", "git lfs pull"),
                          (b"GGUF\x03\x00\x00\x00" + b"\0" * 40, "cflow convert")]:
        p.write_bytes(content)
        with pytest.raises(F.BadMagicError, match=hint):
            F.open_model(p)


def test_good_file_opens_and_crafting_is_faithful(tmp_path, good_file):
    # rebuild() with the unmodified header must give a file that opens: the crafted errors above
    # come from the edits, not from the re-serialization.
    p = tmp_path / "same.cflow"
    p.write_bytes(edit(good_file, lambda h: None))
    with F.open_model(p, verify=True) as cf:
        assert cf.metadata == {"source": "test"}


def test_checksums(tmp_path, good_file):
    p = tmp_path / "c.cflow"
    _, _, _, h = split(good_file)
    off = h["tensors"]["layers.1.attn.wqkv"]["offset"]
    raw = bytearray(good_file)
    raw[off + 5] ^= 0x01
    p.write_bytes(bytes(raw))
    F.open_model(p).close()  # structure is fine: only verify reads the data
    with pytest.raises(F.ChecksumError, match="layers.1.attn.wqkv"):
        F.open_model(p, verify=True)
    # the descriptor is covered too: an edited table entry with intact data fails verification
    p.write_bytes(edit(good_file, lambda h: _tensor(h, "layers.0.attn.wqkv")["meta"].update(splits=[96, 64, 64])))
    with pytest.raises(F.ChecksumError):
        F.open_model(p, verify=True)
    p.write_bytes(edit(good_file, lambda h: _tensor(h).update(layout="rows")))  # same size either way
    with pytest.raises(F.ChecksumError):
        F.open_model(p, verify=True)


def test_missing_tensor_lookup_and_closed_file(tmp_path, good_file):
    p = tmp_path / "m.cflow"
    p.write_bytes(good_file)
    cf = F.open_model(p, mmap=False)
    with pytest.raises(F.MissingTensorError, match="no tensor 'layers.0.attn.wk'"):
        cf.array("layers.0.attn.wk")
    with pytest.raises(F.FormatError):
        cf.plain("layers.0.attn.wo")  # tiled quantized: not a plain float tensor
    view = cf.array("norm")
    cf.close()
    assert view.size == 384  # views handed out stay valid
    with pytest.raises(F.FormatError, match="closed"):
        cf.array("norm")
    with pytest.raises(F.FormatError, match="no such file"):
        F.open_model(tmp_path / "nope.cflow")


def test_summarize(tmp_path, good_file):
    p = tmp_path / "m.cflow"
    p.write_bytes(good_file)
    with F.open_model(p) as cf:
        s = F.summarize(cf)
        assert s["aligned"] and s["order"] == "cflow" and s["n_tensors"] == len(cf.tensors)
        assert sum(s["bytes_by_category"].values()) == sum(e.nbytes for e in cf.tensors.values())
        assert s["experts"]["count"] == len(cf.experts) and s["experts"]["total_bytes"] > 0
        assert s["bytes_by_category"]["experts"] <= s["experts"]["total_bytes"]


def test_cli_inspect(tmp_path, good_file, capsys):
    from cflow.cli import main

    p = tmp_path / "m.cflow"
    p.write_bytes(good_file)
    assert main(["inspect", str(p), "--verify", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["order"] == "cflow" and r["verified"] and r["aligned"] and r["missing_tensors"] == []
    assert [t["name"] for t in r["tensors"]][:2] == ["tok_emb", "layers.0.attn_norm"]
    assert len(r["expert_table"]) == 9 and r["tokenizer"]["vocab"] == len(TOKENIZER["vocab"])
    assert main(["inspect", str(p)]) == 0
    text = capsys.readouterr().out
    assert "layers.2.moe.experts.2.w_down" in text and "bytes by category" in text and "order cflow" in text
    p.write_bytes(good_file[:100])
    assert main(["inspect", str(p)]) == 2
    assert "error:" in capsys.readouterr().err


def test_writer_rejects_non_json_metadata(tmp_path):
    cfg = small_config("llama")
    with pytest.raises(F.FormatError, match="JSON"):
        write(tmp_path / "m.cflow", cfg, metadata={"loss": float("nan")})
    with pytest.raises(F.FormatError, match="JSON"):
        write(tmp_path / "m.cflow", cfg, metadata={"arr": np.zeros(2)})
    ts = make_tensors(cfg)
    ts[1] = F.TensorData(ts[1].name, ts[1].dtype, ts[1].shape, ts[1].layout, ts[1].data, {"x": {1, 2}})
    with pytest.raises(F.FormatError, match="meta"):
        write(tmp_path / "m.cflow", cfg, ts)
    assert _dir_listing(tmp_path) == []
    # tuples become lists, int keys become strings: the entry read back is what the file says
    ts[1] = F.TensorData(ts[1].name, ts[1].dtype, ts[1].shape, ts[1].layout, ts[1].data, {"splits": (1, 2), 3: "a"})
    write(tmp_path / "m.cflow", cfg, ts)
    with F.open_model(tmp_path / "m.cflow", verify=True) as cf:
        assert cf.tensors[ts[1].name].meta == {"splits": [1, 2], "3": "a"}


def test_older_files_load_with_the_options_off(tmp_path):
    """A file written before the three config keys existed loads, with all three off: the shipped
    model's header with the keys taken out (spaces keep the data where the offsets say)."""
    import importlib.resources

    from cflow.fileformat.layout import PREAMBLE

    raw = bytearray((importlib.resources.files("cflow") / "models" / "default.cflow").read_bytes())
    header_len = PREAMBLE.unpack(raw[:PREAMBLE.size])[3]
    header = json.loads(raw[PREAMBLE.size:PREAMBLE.size + header_len])
    for key in ("qkv_bias", "qk_norm", "sliding_window"):
        header["config"].pop(key, None)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    assert len(text) <= header_len
    raw[PREAMBLE.size:PREAMBLE.size + header_len] = text.ljust(header_len)
    (tmp_path / "older.cflow").write_bytes(raw)

    f = F.open_model(tmp_path / "older.cflow")
    assert not {"qkv_bias", "qk_norm", "sliding_window"} & set(f.header["config"])
    assert (f.config.qkv_bias, f.config.qk_norm, f.config.sliding_window) == (False, False, 0)
    f.close()
