"""Our training checkpoints -> `.cflow` (`cflow export`, and `cflow convert DIR ...`).

Owns reading a checkpoint directory (docs/DESIGN.md "Training checkpoint directory": only
model.safetensors, config.json and tokenizer.json are needed, and vocabulary.json where the run
borrowed a model's vocabulary) and mapping its parameters onto the
.cflow tensor names: fused wqkv, interleaved w_gate_up, experts stored one by one (each expert's
gate_up then down, so its tiles are contiguous), router and norms as F32. arch5 stores only its
`n_unique_layers` weight sets, exactly as the checkpoint does.

The weights are float, so every matrix is quantized to --quant and the error is reported.
Reading uses safetensors' numpy loader; torch is only touched for bf16 checkpoints.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from cflow import weights
from cflow.config import ConfigError, ModelConfig
from cflow.convert.encoder import (ConversionResult, ConvertError, Encoder, Source, check_quant, encode_model,
                                   write_conversion)
from cflow.convert.hf_tokenizer import hf_json_to_header
from cflow.fsutil import read_json_dict
from cflow.quant import TILE
from cflow.tokenizer import Tokenizer, TokenizerError
from cflow.train.vocab import VOCABULARY_NAME, read_vocabulary_file
from cflow.weights import Weight

NEEDED = ("model.safetensors", "config.json", "tokenizer.json")


class CheckpointFormatError(ConvertError):
    """A checkpoint directory is incomplete or its weights do not match its config."""


# ---- reading ---------------------------------------------------------------------------------
# Checkpoint parameter names (the PyTorch reference's, docs/DESIGN.md) of the parts of each tensor
# of the table (cflow.weights), per layer slot; an expert's parts are rows [e] of stacked parameters.
_CKPT_PARTS = {"attn_norm": ("attn_norm.weight",), "attn.wqkv": ("attn.wq.weight", "attn.wk.weight", "attn.wv.weight"),
               "attn.qkv_bias": ("attn.wq.bias", "attn.wk.bias", "attn.wv.bias"),
               "attn.q_norm": ("attn.q_norm.weight",), "attn.k_norm": ("attn.k_norm.weight",),
               "attn.wo": ("attn.wo.weight",), "attn_post_norm": ("attn_post_norm.weight",),
               "ffn_post_norm": ("ffn_post_norm.weight",), "ffn_norm": ("ffn_norm.weight",),
               "ffn.w_gate_up": ("ffn.w_gate.weight", "ffn.w_up.weight"), "ffn.w_down": ("ffn.w_down.weight",),
               "moe_norm": ("moe_norm.weight",), "moe.router": ("moe.router.weight",),
               "moe.shared_gate": ("moe.shared_gate",),
               "moe.shared.w_gate_up": ("moe.shared.w_gate.weight", "moe.shared.w_up.weight"),
               "moe.shared.w_down": ("moe.shared.w_down.weight",),
               "w_gate_up": ("moe.w_gate", "moe.w_up"), "w_down": ("moe.w_down",)}


def _parts(cfg: ModelConfig, w: Weight) -> list[tuple[str, tuple[int, ...]]]:
    """(checkpoint parameter, the part's shape) for each part of `w`, in fused order."""
    if w.set is None:
        return [(w.name + ".weight", w.shape)]
    rows, cols = (w.shape + (0,))[:2]
    split = {"qkv": (cfg.q_dim, cfg.kv_dim, cfg.kv_dim), "gate_up": (rows // 2, rows // 2)}.get(w.fused or "")
    slot = w.slot.rsplit(".", 1)[1] if w.expert is not None else w.slot
    names = [f"layers.{w.set}.{n}" for n in _CKPT_PARTS[slot]]
    if slot == "attn.qkv_bias":  # bq | bk | bv, stored as one vector
        return list(zip(names, [(cfg.q_dim,), (cfg.kv_dim,), (cfg.kv_dim,)]))
    shapes = [(r, cols) for r in split] if split else [w.shape]
    return list(zip(names, shapes))


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name of docs/DESIGN.md with its shape, for this config (experts' parameters
    are stacked [E, ...])."""
    out: dict[str, tuple[int, ...]] = {}
    for w in weights.model_weights(cfg):
        for name, shape in _parts(cfg, w):
            out[name] = (cfg.n_experts, *shape) if w.expert is not None else shape
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
    params = read_weights(p / "model.safetensors")
    check_weights(cfg, params)
    # A borrowed vocabulary (cflow train --tokenizer) is written as it was read from its model, so
    # the exported file's vocabulary is that model's; else the trained BPE's tokenizer.json.
    vocab_file = p / VOCABULARY_NAME
    try:
        borrowed = read_vocabulary_file(p)
        tok = Tokenizer(borrowed if borrowed is not None else hf_json_to_header(p / "tokenizer.json")).to_header()
    except TokenizerError as e:
        raise CheckpointFormatError(f"{vocab_file if vocab_file.is_file() else p / 'tokenizer.json'}: {e}") from None
    if len(tok["vocab"]) > cfg.vocab_size:
        raise CheckpointFormatError(f"{p}: the tokenizer has {len(tok['vocab'])} tokens but the model "
                                    f"only {cfg.vocab_size} embeddings")
    return cfg, params, tok


def check_weights(cfg: ModelConfig, params: dict[str, np.ndarray]) -> None:
    want = expected_shapes(cfg)
    missing = sorted(set(want) - set(params))
    extra = sorted(set(params) - set(want))
    if missing or extra:
        raise CheckpointFormatError(f"checkpoint weights do not match its config.json: missing {missing[:5]}, "
                                    f"unexpected {extra[:5]}")
    for name, shape in want.items():
        if tuple(params[name].shape) != shape:
            raise CheckpointFormatError(f"checkpoint tensor {name} has shape {tuple(params[name].shape)}, "
                                        f"its config implies {shape}")


# ---- mapping onto .cflow tensors -------------------------------------------------------------
def checkpoint_tensors(cfg: ModelConfig, w: dict[str, np.ndarray], enc: Encoder) -> Iterator[Any]:
    """TensorData in .cflow order: embeddings, then each stored layer, then the final norm/lm_head.
    Each expert's gate_up then down come back to back, so its tiles are contiguous in the file."""

    def parts(t: Weight) -> Any:
        srcs = []
        for name, _ in _parts(cfg, t):
            values, origin = (w[name], name) if t.expert is None else (w[name][t.expert], f"{name}[{t.expert}]")
            srcs.append(values if t.plain else
                        Source(origin, "float32", values.shape[0], values.shape[1], values=values))
        return np.concatenate(srcs) if t.plain else srcs  # a plain tensor of parts: the bias bq | bk | bv

    return encode_model(cfg, enc, parts)


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, quant: str = "q4_0",
                       tile: tuple[int, int] = TILE, order: str = "cflow", progress=None,
                       metadata: dict | None = None) -> ConversionResult:
    """Quantize a training checkpoint directory into a .cflow/.vflow file; `metadata` joins the
    header's metadata (JSON-serialisable)."""
    t0 = time.perf_counter()
    check_quant(quant)
    cfg, params, tok = read_checkpoint(src)
    enc = Encoder(quant, tile)
    train_meta = read_json_dict(Path(src) / "meta.json")  # informational: a missing one is fine
    header_meta = {"source": {"format": "cflow-checkpoint", "dir": Path(src).name, "preset": train_meta.get("preset")},
                   "converter": "cflow.convert.checkpoint", **(metadata or {})}
    return write_conversion(src, dst, cfg, tok, checkpoint_tensors(cfg, params, enc), enc, header_meta, order=order,
                            tile=tile, progress=progress, started=t0)
