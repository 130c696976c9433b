"""`cflow export CKPT OUT.cflow`: quantize a training checkpoint into a model file."""

from __future__ import annotations

import argparse

from cflow.cli.common import add_command
from cflow.cli.convert import add_common_flags, print_result, write_model_file


HELP = """\
quantize a training checkpoint into a .cflow/.vflow file

Export a checkpoint directory written by `cflow train --out DIR` to cflow's tiled, quantized
model file, reporting the quantization error. Same as `cflow convert DIR OUT --quant q4_0`.

examples:
  cflow export runs/arch2_4 arch2_4.cflow --quant q4_0
  cflow export runs/arch2_4 arch2_4.vflow       # data in decode-schedule order
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "export", HELP)
    p.add_argument("checkpoint", help="the checkpoint directory (model.safetensors, config.json, tokenizer.json)")
    p.add_argument("output", help="the model file to write (.cflow, or .vflow for schedule order)")
    add_common_flags(p, quant_default="q4_0", gguf=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cflow.convert import order_for, parse_tile
    from cflow.convert.checkpoint import convert_checkpoint

    tile = parse_tile(args.tile)
    result = write_model_file(args, lambda progress: convert_checkpoint(
        args.checkpoint, args.output, quant=args.quant, tile=tile, order=order_for(args.output, None),
        progress=progress))
    print_result(args, result)
    return 0
