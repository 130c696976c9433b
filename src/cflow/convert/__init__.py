"""Converters into `.cflow` / `.vflow`: GGUF files (llama, qwen2, qwen3) and our training checkpoints.

    from cflow.convert import convert
    result = convert("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2.cflow")
    result = convert("runs/arch2_4", "arch2_4.cflow", quant="q4_0")

`convert` picks the converter from the input (a `.gguf` file, or a checkpoint directory) and the
data order from the output's extension unless `order` is given. The per-source modules
(`cflow.convert.gguf`, `cflow.convert.checkpoint`) do the mapping; `cflow.convert.encoder` encodes.
"""

from __future__ import annotations

import os
from pathlib import Path

from cflow.convert.encoder import (QUANT_CHOICES, ConversionResult, ConvertError, QuantReport,
                                  parse_tile)
from cflow.quant import TILE

__all__ = ["convert", "detect_input", "order_for", "ConversionResult", "ConvertError", "QuantReport",
           "QUANT_CHOICES", "parse_tile"]

_EXT_ORDER = {".cflow": "cflow", ".vflow": "vflow"}


def detect_input(src: str | os.PathLike) -> str:
    """'gguf' or 'checkpoint', by what `src` is on disk; ConvertError when neither."""
    p = Path(src)
    if not p.exists():
        raise ConvertError(f"input {p} does not exist; give a .gguf file or a training checkpoint directory")
    if p.is_dir():
        if (p / "model.safetensors").is_file():
            return "checkpoint"
        raise ConvertError(f"{p} is a directory without model.safetensors; a training checkpoint "
                           "(from `cflow train --out DIR`) has model.safetensors, config.json, tokenizer.json")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return "gguf"
    raise ConvertError(f"{p} is neither a GGUF file (no GGUF magic) nor a checkpoint directory")


def order_for(dst: str | os.PathLike, order: str | None) -> str:
    """The data order: the one given, else the output's extension (.vflow -> vflow), else cflow.
    A .gguf output name is refused: the file would not be a GGUF."""
    suffix = Path(dst).suffix.lower()
    if suffix == ".gguf":  # a .cflow file under a GGUF name would mislead every tool that opens it
        raise ConvertError(f"output {dst} is named .gguf, but cflow writes its own format, not GGUF; name it "
                           f"{Path(dst).with_suffix('.cflow')} (or .vflow for decode-schedule order)")
    implied = _EXT_ORDER.get(suffix)
    if order is None:
        return implied or "cflow"
    if order not in ("cflow", "vflow"):
        raise ConvertError(f"unknown format {order!r}; choose cflow or vflow")
    if implied is not None and implied != order:
        raise ConvertError(f"output {dst} has the .{implied} extension but --format {order} was asked; "
                           f"name it *.{order} or drop --format")
    return order


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, quant: str | None = None,
            tile: tuple[int, int] = TILE, order: str | None = None, progress=None,
            sliding_window: int | None = None) -> ConversionResult:
    """Convert a GGUF file or a checkpoint directory into a .cflow/.vflow file.

    `quant` is the format for weights that must be quantized: default q4_0. For GGUF input,
    tensors in a format the engine runs (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, MXFP4) keep it bit
    for bit whatever `quant` says (`cflow convert` says which did when --quant was given), float
    tensors are quantized to `quant`, and tensors in another quantized format (Q2_K, Q3_K, I-quants,
    ...) are re-quantized only when `quant` is given explicitly; otherwise NotNativeError names the
    tensor and says what to do. `sliding_window` (GGUF only): the attention window to run with
    instead of the file's (0: none, as llama.cpp runs a Mistral file).
    """
    kind = detect_input(src)
    order = order_for(dst, order)
    explicit, quant = quant is not None, quant or "q4_0"
    if Path(dst).resolve() == Path(src).resolve():
        raise ConvertError("the output path is the input path; choose another output file")
    if kind == "gguf":
        from cflow.convert.gguf import convert_gguf

        return convert_gguf(src, dst, quant=quant, tile=tile, order=order, progress=progress, requantize=explicit,
                            sliding_window=sliding_window)
    from cflow.convert.checkpoint import convert_checkpoint

    return convert_checkpoint(src, dst, quant=quant, tile=tile, order=order, progress=progress)
