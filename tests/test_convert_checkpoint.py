"""Training checkpoint -> .cflow: every preset (MoE experts one by one, arch5's shared sets),
every --quant, config and tokenizer preserved, the error report, and bad checkpoints.

Each checkpoint is a random cflow.model.Transformer saved by cflow.train.checkpoint, with a
byte-level BPE trained by cflow.train.bpe: the real producer of what `cflow export` reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from cflow import quant  # noqa: E402
from cflow.config import PRESETS, ModelConfig  # noqa: E402
from cflow.convert import ConvertError, convert  # noqa: E402
from cflow.convert.checkpoint import CheckpointFormatError, convert_checkpoint  # noqa: E402
from cflow.convert.encoder import split_fused, tensor_values  # noqa: E402
from cflow.fileformat import ALIGN, model_tensors, open_model  # noqa: E402
from cflow.tokenizer import Tokenizer  # noqa: E402

CORPUS = ["Once upon a time there was a little dog named Max. Max liked to run in the park.",
          "The sun was bright and the sky was blue. Lily saw a big red ball under the tree.",
          "They played together all day and were very happy. The end."] * 10
TEXTS = ["Once upon a time, Max ran.", "ünïcödé 🙂\n\n  spaced", "<|bos|>Lily<|eos|>"]
# Small but not degenerate: d=64 with a 96-wide FFN (three 32-blocks, twelve 8-row groups).
SMALL = dict(d_model=64, n_heads=2, n_kv_heads=1, n_layers=4, max_seq_len=64)


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    from cflow.train.bpe import train_bpe

    return train_bpe(CORPUS, vocab_size=300, min_frequency=1).to_str()


def make_checkpoint(path: Path, preset: str, tokenizer_json: str, seed: int = 0, **overrides) -> ModelConfig:
    from cflow.model import Transformer
    from cflow.train.checkpoint import model_weights, save_checkpoint

    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    extra = {"d_ff": 96, "d_expert": 64} if PRESETS[preset].get("n_experts") else {"d_ff": 96}
    cfg = ModelConfig.from_name(preset, vocab_size=len(vocab) + 2, **{**SMALL, **extra, **overrides})
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():  # norms away from 1 so a mixed-up norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    save_checkpoint(path, weights=model_weights(model), config=cfg, tokenizer_json=tokenizer_json,
                    meta={"preset": preset})
    return cfg


def weights_of(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path / "model.safetensors"))


def roundtrip(w: np.ndarray, dtype: str) -> np.ndarray:
    return quant.dequantize(quant.quantize(w, dtype), dtype, w.shape[1])


def values(f, name: str) -> list[np.ndarray]:
    e = f.tensors[name]
    return split_fused(tensor_values(e.dtype, e.shape, e.layout, f.array(name), f.tile), e.meta)


def expected_values(cfg: ModelConfig, w: dict[str, np.ndarray], q: str) -> dict[str, list[np.ndarray]]:
    """What each .cflow tensor must dequantize to: the originals quantized (matrices) or as is."""
    out = {"tok_emb": [roundtrip(w["tok_emb.weight"], q)], "norm": [w["norm.weight"]]}
    if not cfg.tie_embeddings:
        out["lm_head"] = [roundtrip(w["lm_head.weight"], q)]
    for i in range(cfg.n_unique_layers):
        p = f"layers.{i}."
        out[p + "attn_norm"] = [w[p + "attn_norm.weight"]]
        out[p + "attn.wqkv"] = [roundtrip(w[p + f"attn.{m}.weight"], q) for m in ("wq", "wk", "wv")]
        out[p + "attn.wo"] = [roundtrip(w[p + "attn.wo.weight"], q)]
        if cfg.has_dense:
            out[p + "ffn_norm"] = [w[p + "ffn_norm.weight"]]
            out[p + "ffn.w_gate_up"] = [roundtrip(w[p + f"ffn.w_{m}.weight"], q) for m in ("gate", "up")]
            out[p + "ffn.w_down"] = [roundtrip(w[p + "ffn.w_down.weight"], q)]
        if cfg.has_moe:
            out[p + "moe_norm"] = [w[p + "moe_norm.weight"]]
            out[p + "moe.router"] = [w[p + "moe.router.weight"]]
            for e in range(cfg.n_experts):
                x = f"{p}moe.experts.{e}."
                out[x + "w_gate_up"] = [roundtrip(w[p + f"moe.w_{m}"][e], q) for m in ("gate", "up")]
                out[x + "w_down"] = [roundtrip(w[p + "moe.w_down"][e], q)]
    return out


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_round_trips(preset, tokenizer_json, tmp_path):
    ckpt = tmp_path / "ckpt"
    cfg = make_checkpoint(ckpt, preset, tokenizer_json, tie_embeddings=preset != "arch3")
    result = convert(ckpt, tmp_path / "m.cflow")
    f = open_model(tmp_path / "m.cflow", verify=True)

    assert f.config == cfg and f.config.name == preset
    assert set(f.tensors) == set(model_tensors(cfg))
    w = weights_of(ckpt)
    for name, parts in expected_values(cfg, w, "q4_0").items():
        got = values(f, name)
        assert len(got) == len(parts), name
        for g, e in zip(got, parts):
            assert np.array_equal(g, e), name
        if f.tensors[name].layout == "tiled":
            assert f.tensors[name].dtype == "q4_0"

    tok = Tokenizer(f.tokenizer)
    from cflow.convert.hf_tokenizer import hf_json_to_header

    assert f.tokenizer == Tokenizer(hf_json_to_header(ckpt / "tokenizer.json")).to_header()
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_str(tokenizer_json)
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text).ids
    assert (tok.bos_id, tok.eos_id) == (0, 1)

    n_matrix = sum(v.size for k, v in w.items() if v.ndim >= 2 and "router" not in k)
    assert result.report.requantized_weights == n_matrix and result.report.lossless_weights == 0
    assert 0.05 < result.report.rms_rel < 0.2  # 4-bit on Gaussian weights
    assert result.config == cfg and result.file_bytes == (tmp_path / "m.cflow").stat().st_size


@pytest.mark.parametrize("preset", ["arch2_4_combined", "arch5"])
def test_experts_are_contiguous_blocks(preset, tokenizer_json, tmp_path):
    cfg = make_checkpoint(tmp_path / "c", preset, tokenizer_json)
    convert(tmp_path / "c", tmp_path / "m.cflow")
    f = open_model(tmp_path / "m.cflow")
    assert set(f.experts) == {(i, e) for i in range(cfg.n_unique_layers) for e in range(cfg.n_experts)}
    for (i, e), (off, n) in f.experts.items():
        gu = f.tensors[f"layers.{i}.moe.experts.{e}.w_gate_up"]
        down = f.tensors[f"layers.{i}.moe.experts.{e}.w_down"]
        assert off == gu.offset and off % ALIGN == 0
        assert down.offset == -(-(gu.offset + gu.nbytes) // ALIGN) * ALIGN  # right after, aligned
        assert n == down.offset + down.nbytes - off
    if preset == "arch5":  # four layers, two stored weight sets
        assert cfg.n_layers == 4 and not any(k.startswith(("layers.2.", "layers.3.")) for k in f.tensors)


def test_quant_choices(tokenizer_json, tmp_path):
    make_checkpoint(tmp_path / "c", "arch2_4_combined", tokenizer_json)
    w = weights_of(tmp_path / "c")
    errors = {}
    for q in ("q4_0", "q4_1", "q8_0"):
        r = convert_checkpoint(tmp_path / "c", tmp_path / f"{q}.cflow", quant=q)
        f = open_model(r.output, verify=True)
        assert {e.dtype for e in f.tensors.values() if e.layout == "tiled"} == {q}
        got = values(f, "layers.1.moe.experts.3.w_gate_up")
        assert np.array_equal(got[1], roundtrip(w["layers.1.moe.w_up"][3], q))
        errors[q] = r.report.rms_rel
        # the per-tensor report is the true error of what landed in the file
        e = next(x for x in r.report.errors if x.origin == "layers.0.attn.wo.weight")
        ref = w["layers.0.attn.wo.weight"].astype(np.float64)
        diff = values(f, "layers.0.attn.wo")[0] - ref
        assert e.rms_rel == pytest.approx(np.sqrt((diff ** 2).sum() / (ref ** 2).sum()), rel=1e-9)
    assert errors["q8_0"] < errors["q4_1"] < errors["q4_0"]
    assert errors["q8_0"] < 0.01


def test_vflow_export_and_cli(tokenizer_json, tmp_path, capsys):
    from cflow.cli import main

    make_checkpoint(tmp_path / "c", "arch4", tokenizer_json)
    assert main(["export", str(tmp_path / "c"), str(tmp_path / "m.vflow"), "-q"]) == 0
    out = capsys.readouterr().out
    assert "bytes by category" in out and "experts" in out and "RMS" in out
    v = open_model(tmp_path / "m.vflow", verify=True)
    assert v.order == "vflow"
    assert main(["convert", str(tmp_path / "c"), str(tmp_path / "m.cflow"), "--quant", "q8_0", "-q", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["quantization"]["lossless_weights"] == 0 and summary["config"]["name"] == "arch4"
    c = open_model(tmp_path / "m.cflow")
    assert c.order == "cflow" and set(c.tensors) == set(v.tensors)
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "x.cflow")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---- bad checkpoints -------------------------------------------------------------------------
@pytest.fixture()
def ckpt(tokenizer_json, tmp_path) -> Path:
    make_checkpoint(tmp_path / "c", "llama", tokenizer_json)
    return tmp_path / "c"


def test_missing_pieces(ckpt, tmp_path):
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(CheckpointFormatError, match="missing.*tokenizer.json"):
        convert_checkpoint(ckpt, tmp_path / "x.cflow")
    with pytest.raises(CheckpointFormatError, match="does not exist"):
        convert_checkpoint(tmp_path / "none", tmp_path / "x.cflow")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConvertError, match="without model.safetensors"):
        convert(tmp_path / "empty", tmp_path / "x.cflow")


def test_weights_that_do_not_match_the_config(ckpt, tmp_path):
    from safetensors.numpy import save_file

    w = weights_of(ckpt)
    save_file({**w, "layers.0.attn.extra.weight": np.zeros((2, 2), np.float32)}, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointFormatError, match="unexpected.*extra"):
        convert_checkpoint(ckpt, tmp_path / "x.cflow")
    bad = dict(w)
    bad["layers.1.ffn.w_up.weight"] = bad["layers.1.ffn.w_up.weight"][:-8]
    save_file(bad, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointFormatError, match="w_up.*shape"):
        convert_checkpoint(ckpt, tmp_path / "x.cflow")
    bad = dict(w)
    bad["norm.weight"] = np.full_like(bad["norm.weight"], np.nan)
    save_file(bad, str(ckpt / "model.safetensors"))
    with pytest.raises(ConvertError, match="NaN"):
        convert_checkpoint(ckpt, tmp_path / "x.cflow")
    assert not (tmp_path / "x.cflow").exists()


def test_bad_config_and_tokenizer(ckpt, tmp_path):
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "vocab_size": 100}))
    with pytest.raises(CheckpointFormatError):
        convert_checkpoint(ckpt, tmp_path / "x.cflow")
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointFormatError, match="config.json"):
        convert_checkpoint(ckpt, tmp_path / "x.cflow")
    (ckpt / "config.json").write_text(json.dumps(cfg))
    (ckpt / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordPiece"}}))
    with pytest.raises(CheckpointFormatError, match="tokenizer.json"):
        convert_checkpoint(ckpt, tmp_path / "x.cflow")


def test_tokenizer_larger_than_the_model(tokenizer_json, tmp_path):
    from cflow.model import Transformer
    from cflow.train.checkpoint import model_weights, save_checkpoint

    cfg = ModelConfig.from_name("llama", vocab_size=64, d_ff=96, **SMALL)
    save_checkpoint(tmp_path / "c", weights=model_weights(Transformer(cfg)), config=cfg, tokenizer_json=tokenizer_json)
    with pytest.raises(CheckpointFormatError, match="tokenizer has .* tokens but the model only 64"):
        convert_checkpoint(tmp_path / "c", tmp_path / "x.cflow")
