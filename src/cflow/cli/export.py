"""`cflow export CKPT OUT.cflow`: quantize a training checkpoint into a model file."""

from __future__ import annotations

import argparse
import json

from cflow.cli.convert import add_common_flags, format_summary, progress_bar, os_error


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="quantize a training checkpoint into a .cflow/.vflow file",
        description="Export a checkpoint directory written by `cflow train --out DIR` to cflow's tiled, "
        "quantized model file, reporting the quantization error. Same as `cflow convert DIR OUT`.",
        epilog="example: cflow export runs/arch2_4 arch2_4.cflow --quant q4_0")
    p.add_argument("checkpoint", help="the checkpoint directory (model.safetensors, config.json, tokenizer.json)")
    p.add_argument("output", help="the model file to write (.cflow, or .vflow for schedule order)")
    add_common_flags(p, quant_default="q4_0")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cflow.convert import order_for, parse_tile
    from cflow.convert.checkpoint import convert_checkpoint

    tile = parse_tile(args.tile)
    try:
        with progress_bar(args.quiet) as progress:
            result = convert_checkpoint(args.checkpoint, args.output, quant=args.quant, tile=tile,
                                        order=order_for(args.output, None), progress=progress)
    except OSError as e:
        raise os_error(args.output, e) from None
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_summary(result))
    return 0
