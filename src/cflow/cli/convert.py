"""`cflow convert IN OUT`: a GGUF file or a training checkpoint directory -> .cflow / .vflow."""

from __future__ import annotations

import argparse
import json
import os
import sys

from cflow.convert import QUANT_CHOICES, ConversionResult
from cflow.errors import CflowError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert", help="convert a GGUF file or a training checkpoint into a .cflow/.vflow file",
        description="Convert a Llama-family GGUF file (llama.cpp) or a cflow training checkpoint directory "
        "into cflow's tiled model file. GGUF Q4_0/Q4_1/Q8_0 tensors are copied bit for bit; every other "
        "weight is quantized to --quant and the error this introduces is reported.",
        epilog="examples: cflow convert SmolLM2-135M-Instruct.Q4_1.gguf smollm2.cflow\n"
        "          cflow convert runs/arch2_4 arch2_4.vflow --quant q8_0",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="a .gguf file or a checkpoint directory (cflow train --out DIR)")
    p.add_argument("output", help="the model file to write (.cflow or .vflow)")
    add_common_flags(p, quant_default=None)
    p.add_argument("--format", choices=["cflow", "vflow"], default=None,
                   help="data order: layer by layer (cflow) or in decode-schedule order (vflow); "
                   "default: from the output's extension, else cflow")
    p.set_defaults(func=run)


def add_common_flags(p: argparse.ArgumentParser, quant_default: str | None) -> None:
    p.add_argument("--quant", choices=QUANT_CHOICES, default=quant_default,
                   help="format for weights that need quantizing (default q4_0; GGUF Q4_0/Q4_1/Q8_0 "
                   "tensors keep their own format)")
    p.add_argument("--tile", default="128x256", help="tile geometry ROWSxCOLS (default 128x256)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from cflow.convert import convert, parse_tile

    tile = parse_tile(args.tile)
    try:
        with progress_bar(args.quiet) as progress:
            result = convert(args.input, args.output, quant=args.quant, tile=tile, order=args.format,
                             progress=progress)
    except OSError as e:
        raise os_error(args.output, e) from None
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_summary(result))
    return 0


def os_error(output: str, e: OSError) -> CflowError:
    """An OS failure while converting (unwritable output, full disk, unreadable input) as one line."""
    name = os.fspath(e.filename) if e.filename else None
    if name and os.path.dirname(os.path.abspath(name)) != os.path.dirname(os.path.abspath(output)):
        return CflowError(f"{name}: {e.strerror or e}")  # not the output or its temp file: likely the input
    return CflowError(f"cannot write {output}: {e.strerror or e}")


class progress_bar:
    """A tqdm bar over bytes written, as the writer's progress(done, total, name) callback."""

    def __init__(self, quiet: bool):
        self.quiet, self.bar = quiet, None

    def __enter__(self):
        return None if self.quiet else self.update

    def update(self, done: int, total: int, name: str) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="writing",
                            file=sys.stderr, leave=False)
        self.bar.set_postfix_str(name, refresh=False)
        self.bar.update(done - self.bar.n)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def format_summary(r: ConversionResult) -> str:
    c = r.config
    lines = [f"wrote {r.output} ({_mib(r.file_bytes)}) from {r.source} in {r.seconds:.1f} s",
             f"model: {c.name}, {c.n_layers} layers, d={c.d_model}, heads {c.n_heads}/{c.n_kv_heads}, "
             f"vocab {c.vocab_size}" + (f", {c.n_experts} experts top-{c.top_k}" if c.has_moe else ""),
             "bytes by category:"]
    total = sum(r.bytes_by_category.values()) or 1
    for cat, n in sorted(r.bytes_by_category.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {cat:<11} {_mib(n):>14}  {100 * n / total:5.1f}%")
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
