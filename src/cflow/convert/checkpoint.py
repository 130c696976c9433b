"""Our training checkpoints -> `.cflow` (`cflow export`, and `cflow convert DIR ...`).

Owns reading a checkpoint directory (docs/DESIGN.md "Training checkpoint directory": only
model.safetensors, config.json and tokenizer.json are needed) and mapping its parameters onto the
.cflow tensor names: fused wqkv, interleaved w_gate_up, experts stored one by one (each expert's
gate_up then down, so its tiles are contiguous), router and norms as F32. arch5 stores only its
`n_unique_layers` weight sets, exactly as the checkpoint does.

The weights are float, so every matrix is quantized to --quant and the error is reported.
Reading uses safetensors' numpy loader; torch is only touched for bf16 checkpoints.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from cflow.config import ConfigError, ModelConfig
from cflow.convert.common import (ByteCounter, ConversionResult, ConvertError, Encoder, Source,
                                  check_quant)
from cflow.convert.hf_tokenizer import hf_json_to_header
from cflow.quant import TILE
from cflow.tokenizer import Tokenizer, TokenizerError

NEEDED = ("model.safetensors", "config.json", "tokenizer.json")


class CheckpointFormatError(ConvertError):
    """A checkpoint directory is incomplete or its weights do not match its config."""


# ---- reading ---------------------------------------------------------------------------------
def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name of docs/DESIGN.md with its shape, for this config."""
    d, q, kv = cfg.d_model, cfg.q_dim, cfg.kv_dim
    out: dict[str, tuple[int, ...]] = {"tok_emb.weight": (cfg.vocab_size, d), "norm.weight": (d,)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.n_unique_layers):
        p = f"layers.{i}."
        out.update({p + "attn_norm.weight": (d,), p + "attn.wq.weight": (q, d),
                    p + "attn.wk.weight": (kv, d), p + "attn.wv.weight": (kv, d),
                    p + "attn.wo.weight": (d, q)})
        if cfg.has_dense:
            f = cfg.d_ff
            out.update({p + "ffn_norm.weight": (d,), p + "ffn.w_gate.weight": (f, d),
                        p + "ffn.w_up.weight": (f, d), p + "ffn.w_down.weight": (d, f)})
        if cfg.has_moe:
            E, x = cfg.n_experts, cfg.d_expert
            out.update({p + "moe_norm.weight": (d,), p + "moe.router.weight": (E, d),
                        p + "moe.w_gate": (E, x, d), p + "moe.w_up": (E, x, d), p + "moe.w_down": (E, d, x)})
    return out


def read_weights(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a safetensors file as float32 numpy arrays."""
    from safetensors import safe_open

    out: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():
                out[name] = np.asarray(f.get_tensor(name), dtype=np.float32)
        return out
    except TypeError:
        pass  # numpy has no bfloat16: read through torch, which the training side has anyway
    except Exception as e:
        raise CheckpointFormatError(f"{path} is not a readable safetensors file: {e}") from None
    import torch
    from safetensors.torch import load_file

    return {k: v.to(torch.float32).numpy() for k, v in load_file(str(path)).items()}


def read_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray], dict[str, Any]]:
    """(config, weights by DESIGN.md name, tokenizer header) of a checkpoint directory."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointFormatError(f"checkpoint directory {p} does not exist")
    missing = [f for f in NEEDED if not (p / f).is_file()]
    if missing:
        raise CheckpointFormatError(f"{p} is not a cflow training checkpoint: missing {missing} "
                                    "(train one with `cflow train --out DIR`)")
    try:
        cfg = ModelConfig.from_json((p / "config.json").read_text())
    except ConfigError as e:
        raise CheckpointFormatError(f"{p / 'config.json'}: {e}") from None
    weights = read_weights(p / "model.safetensors")
    check_weights(cfg, weights)
    try:
        tok = Tokenizer(hf_json_to_header(p / "tokenizer.json")).to_header()
    except TokenizerError as e:
        raise CheckpointFormatError(f"{p / 'tokenizer.json'}: {e}") from None
    if len(tok["vocab"]) > cfg.vocab_size:
        raise CheckpointFormatError(f"{p}: the tokenizer has {len(tok['vocab'])} tokens but the model "
                                    f"only {cfg.vocab_size} embeddings")
    return cfg, weights, tok


def check_weights(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> None:
    want = expected_shapes(cfg)
    missing = sorted(set(want) - set(weights))
    extra = sorted(set(weights) - set(want))
    if missing or extra:
        raise CheckpointFormatError(f"checkpoint weights do not match its config.json: missing {missing[:5]}, "
                                    f"unexpected {extra[:5]}")
    for name, shape in want.items():
        if tuple(weights[name].shape) != shape:
            raise CheckpointFormatError(f"checkpoint tensor {name} has shape {tuple(weights[name].shape)}, "
                                        f"its config implies {shape}")


# ---- mapping onto .cflow tensors -------------------------------------------------------------
def _src(name: str, w: np.ndarray) -> Source:
    return Source(name, "float32", w.shape[0], w.shape[1], values=w)


def checkpoint_tensors(cfg: ModelConfig, w: dict[str, np.ndarray], enc: Encoder) -> Iterator[Any]:
    """TensorData in .cflow order: embeddings, then each stored layer, then the final norm/lm_head."""
    yield enc.matrix("tok_emb", _src("tok_emb.weight", w["tok_emb.weight"]))
    for i in range(cfg.n_unique_layers):
        p = o = f"layers.{i}."  # checkpoint prefix, .cflow prefix (the same today)
        yield enc.vector(o + "attn_norm", w[p + "attn_norm.weight"])
        yield enc.qkv(o + "attn.wqkv", *(_src(p + f"attn.{m}.weight", w[p + f"attn.{m}.weight"])
                                         for m in ("wq", "wk", "wv")))
        yield enc.matrix(o + "attn.wo", _src(p + "attn.wo.weight", w[p + "attn.wo.weight"]))
        if cfg.has_dense:
            yield enc.vector(o + "ffn_norm", w[p + "ffn_norm.weight"])
            yield enc.gate_up(o + "ffn.w_gate_up", _src(p + "ffn.w_gate.weight", w[p + "ffn.w_gate.weight"]),
                              _src(p + "ffn.w_up.weight", w[p + "ffn.w_up.weight"]))
            yield enc.matrix(o + "ffn.w_down", _src(p + "ffn.w_down.weight", w[p + "ffn.w_down.weight"]))
        if cfg.has_moe:
            yield enc.vector(o + "moe_norm", w[p + "moe_norm.weight"])
            yield enc.vector(o + "moe.router", w[p + "moe.router.weight"])
            for e in range(cfg.n_experts):
                x = f"{o}moe.experts.{e}."
                # gate_up then down, back to back: the writer keeps one expert's tiles contiguous
                yield enc.gate_up(x + "w_gate_up", _src(f"{p}moe.w_gate[{e}]", w[p + "moe.w_gate"][e]),
                                  _src(f"{p}moe.w_up[{e}]", w[p + "moe.w_up"][e]))
                yield enc.matrix(x + "w_down", _src(f"{p}moe.w_down[{e}]", w[p + "moe.w_down"][e]))
    yield enc.vector("norm", w["norm.weight"])
    if not cfg.tie_embeddings:
        yield enc.matrix("lm_head", _src("lm_head.weight", w["lm_head.weight"]))


def _read_meta(path: Path) -> dict[str, Any]:
    # meta.json is informational only; a missing or odd one must not block an export
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, quant: str = "q4_0",
                       tile: tuple[int, int] = TILE, order: str = "cflow", progress=None) -> ConversionResult:
    """Quantize a training checkpoint directory into a .cflow/.vflow file."""
    from cflow.fileformat import write_model

    t0 = time.perf_counter()
    check_quant(quant)
    cfg, weights, tok = read_checkpoint(src)
    enc = Encoder(quant, tile)
    counter = ByteCounter()
    train_meta = _read_meta(Path(src) / "meta.json")
    metadata = {"source": {"format": "cflow-checkpoint", "dir": Path(src).name,
                           "preset": train_meta.get("preset")},
                "converter": "cflow.convert.checkpoint"}
    summary = write_model(dst, config=cfg.to_dict(), tokenizer=tok,
                          tensors=counter(checkpoint_tensors(cfg, weights, enc)), order=order, tile=tile,
                          metadata=metadata, progress=progress)
    return ConversionResult(str(src), str(dst), cfg, counter.by_category, os.path.getsize(dst),
                            time.perf_counter() - t0, enc.report, summary)
