"""`cflow convert IN OUT`: a GGUF file or a training checkpoint directory -> .cflow / .vflow; and the
flags and summary `cflow export` shares with it."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from cflow.cli.common import FileError, UsageError, add_command, cannot_write, progress_bar
from cflow.fsutil import check_writable, writing
from cflow.convert import QUANT_CHOICES, ConversionResult
from cflow.runtime.files import format_size


HELP = """\
convert a GGUF file or a training checkpoint into a .cflow/.vflow file

Convert a GGUF file (llama.cpp architectures: llama, qwen2, qwen3, qwen2moe, qwen3moe, olmoe, gemma3
(text), gemma4 (text), mistral3 (dense), gpt-oss, deepseek2 (DeepSeek-V2/V3), qwen35, qwen35moe (Qwen3.5,
text); the llama one covers Llama 2/3, SmolLM, TinyLlama, Mistral and Mixtral) or
a cflow training checkpoint directory into cflow's tiled model file. GGUF tensors in a format the
engine runs (Q4_0, Q4_1, Q8_0, the K-quant files' Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, and MXFP4) are copied bit for bit whatever --quant says: cflow
never requantizes them, and when --quant is given the summary lists the tensors that kept another
type. F32/F16/BF16 weights are quantized to --quant (default q4_0) and the error this introduces
is reported. GGUF tensors in a quantized format cflow has no kernel for (Q2_K, Q3_K, IQ*, ...)
would have to be re-quantized, losing precision a second time: cflow refuses them unless --quant
is given, and then reports the error. Sizes are decimal: MB = 10^6 bytes.

examples:
  cflow convert SmolLM2-135M-Instruct.Q4_1.gguf smollm2.cflow
  cflow convert model.Q4_K_M.gguf model.cflow                # every tensor keeps its type
  cflow convert runs/arch2_4 arch2_4.vflow --quant q8_0
  cflow convert model.Q3_K_M.gguf model.cflow --quant q8_0   # re-quantizes what has no kernel
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "convert", HELP)
    p.add_argument("input", help="a .gguf file or a checkpoint directory (cflow train --out DIR)")
    p.add_argument("output", help="the model file to write (.cflow or .vflow; not .gguf: it is not a GGUF)")
    add_common_flags(p, quant_default=None)
    p.add_argument("--format", choices=["cflow", "vflow"], default=None,
                   help="data order: layer by layer (cflow) or in decode-schedule order (vflow); "
                   "default: from the output's extension, else cflow")
    p.add_argument("--sliding-window", type=int, default=None, metavar="W",
                   help="GGUF: attend to the last W positions instead of the file's window (a Mistral file's "
                   "llama.attention.sliding_window is honoured by default; 0 = none, as llama.cpp runs it)")
    p.set_defaults(func=run)


def add_common_flags(p: argparse.ArgumentParser, quant_default: str | None, *, gguf: bool = True) -> None:
    if gguf:
        quant_help = ("format for weights that need quantizing (default q4_0); GGUF tensors in a format cflow "
                      "runs keep it bit for bit; given explicitly, also re-quantizes GGUF tensors in formats "
                      "cflow has no kernel for (refused otherwise)")
    else:
        quant_help = f"format of the exported weight matrices (default {quant_default}); the error it introduces is reported"
    p.add_argument("--quant", choices=QUANT_CHOICES, default=quant_default, help=quant_help)
    p.add_argument("--tile", default="128x256", help="tile geometry ROWSxCOLS (default 128x256)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--mkdir", action="store_true", help="create the output's missing folders (default: refuse, "
                   "so a mistyped path does not leave new folders behind)")


def run(args: argparse.Namespace) -> int:
    from cflow.convert import convert, detect_input, parse_tile

    kind = detect_input(args.input)
    tile = parse_tile(args.tile)
    if args.sliding_window is not None and (args.sliding_window < 0 or kind != "gguf"):
        raise UsageError("a window >= 0 (0 = none), for a GGUF input", flag="--sliding-window")
    result = write_model_file(args, lambda progress: convert(
        args.input, args.output, quant=args.quant, tile=tile, order=args.format, progress=progress,
        sliding_window=args.sliding_window))
    # --quant given for a GGUF whose Q4_0/Q4_1/Q8_0 blocks were kept as they are: say so
    kept = kept_gguf_types(args.output, args.quant) if kind == "gguf" and args.quant else {}
    print_result(args, result, kept={"quant": args.quant, "tensors": kept} if kept else None)
    return 0


def write_model_file(args: argparse.Namespace, make) -> ConversionResult:
    """Run a converter `make(progress)` that writes args.output, failing early and as one line when
    the output cannot be written."""
    from cflow.convert import order_for

    order_for(args.output, getattr(args, "format", None))  # a .gguf name or a --format conflict: before any work
    check_writable(args.output, file=True, mkdir=args.mkdir)
    try:
        if args.mkdir:
            with writing(args.output):
                Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        with progress_bar(args.quiet) as progress:
            return make(progress)
    except OSError as e:
        raise os_error(args.output, e) from None


def print_result(args: argparse.Namespace, result: ConversionResult, kept: dict | None = None) -> None:
    if args.json:
        print(json.dumps(dict(result.to_dict(), **({"kept_gguf_types": kept} if kept else {})), indent=2))
        return
    print(format_summary(result))
    if kept:
        print(f"note: {kept_note(kept['quant'], kept['tensors'])}")


def kept_gguf_types(output: str, quant: str) -> dict[str, list[str]]:
    """Tensors of the written file whose type is not `quant`, by type: GGUF blocks copied as they
    are (cflow.convert.encoder.Encoder.target keeps every type the engine runs)."""
    from cflow.fileformat import open_model

    kept: dict[str, list[str]] = {}
    with open_model(output) as cf:
        for t in sorted(cf.tensors.values(), key=lambda t: t.offset):
            if t.layout == "tiled" and t.dtype != quant:
                kept.setdefault(t.dtype, []).append(t.name)
    return kept


def kept_note(quant: str, kept: dict[str, list[str]]) -> str:
    n = sum(len(v) for v in kept.values())
    parts = [f"{dtype}: " + ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
             for dtype, names in sorted(kept.items())]
    return (f"--quant {quant} was not applied to {n} tensor(s) that keep their GGUF type ({'; '.join(parts)}). "
            f"cflow copies GGUF blocks it has kernels for (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, MXFP4) bit "
            f"for bit and never requantizes them; --quant applies only to weights that need quantizing (F16, "
            f"F32, BF16, and types without a kernel such as Q3_K). For {quant} throughout, convert an F16/F32 GGUF")


def os_error(output: str, e: OSError) -> FileError:
    """An OS failure while converting (unwritable output, full disk, unreadable input) as one line."""
    name = os.fspath(e.filename) if e.filename else None
    if name and os.path.dirname(os.path.abspath(name)) != os.path.dirname(os.path.abspath(output)):
        return FileError(f"{name}: {e.strerror or e}")  # not the output or its temp file: likely the input
    return cannot_write(output, e)


def format_summary(r: ConversionResult) -> str:
    c = r.config
    lines = [f"wrote {r.output} ({format_size(r.file_bytes)}) from {r.source} in {r.seconds:.1f} s",
             f"model: {c.name}, {c.n_layers} layers, d={c.d_model}, heads {c.n_heads}/{c.n_kv_heads}, "
             f"vocab {c.vocab_size}" + (f", {c.n_experts} experts top-{c.top_k}" if c.has_moe else ""),
             "bytes by category:"]
    total = sum(r.bytes_by_category.values()) or 1
    for cat, n in sorted(r.bytes_by_category.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {cat:<11} {format_size(n):>10}  {100 * n / total:5.1f}%")
    q = r.report
    n_all = q.lossless_weights + q.requantized_weights
    if q.requantized_weights == 0:
        lines.append(f"quantization: all {n_all:,} matrix weights copied bit-exact (no error introduced)")
    else:
        lines.append(f"quantization: {q.lossless_weights:,} weights copied bit-exact, {q.requantized_weights:,} "
                     f"quantized; error relative to the originals: RMS {q.rms_rel:.3%}, "
                     f"worst tensor max|err|/max|w| {q.max_rel:.3%}")
        shown = 8
        lines.append("  worst tensors (RMS error / RMS weight, max |error| / max |weight|):")
        for e in sorted(q.errors, key=lambda e: -e.rms_rel)[:shown]:
            lines.append(f"  {e.origin:<36} {e.src_dtype}->{e.dst_dtype}  RMS {e.rms_rel:.3%}  max {e.max_rel:.3%}")
        if len(q.errors) > shown:
            lines.append(f"  ... {len(q.errors) - shown} more tensors; --json lists every one")
    for note in q.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
