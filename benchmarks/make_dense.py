"""Random-weight dense Llama GGUFs for benchmarks: the ~1B model of docs/results/dense.md.

    python benchmarks/make_dense.py --out 1b.gguf                 # TinyLlama-1.1B geometry, Q4_0 (~620 MB)
    python benchmarks/make_dense.py --out 1b-q8.gguf --quant q8_0
    python benchmarks/make_dense.py --out 1b-f16.gguf --quant f16   # a source for llama.cpp's quantizer
    python benchmarks/make_dense.py --layers 4 --d-model 512 --d-ff 1408 --heads 8 --kv-heads 2 --out small.gguf

then, side by side with llama.cpp on the same file:

    cflow bench -m 1b.gguf -t 1,2 --compare llama.cpp

The file is written with the `gguf` package (cflow.bench.synthetic.write_dense_gguf, with the random
blocks of the MoE models: every matrix's weights have std ~0.5/sqrt(inputs), so activations stay
of order one; a byte-level tokenizer of --vocab tokens). Same seed, same file, bit for bit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cflow.bench.synthetic import TINYLLAMA, write_dense_gguf


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="the GGUF to write")
    p.add_argument("--quant", default="q4_0", choices=("q4_0", "q4_1", "q8_0", "f16"), help="weight type (q4_0)")
    p.add_argument("--seed", type=int, default=0, help="weights' seed (0)")
    p.add_argument("--ctx", type=int, default=4096, help="the file's context length (4096)")
    for k, v in TINYLLAMA.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=v, help=f"default {v} (TinyLlama-1.1B)")
    a = p.parse_args(argv)
    if a.d_model % a.heads or a.heads % a.kv_heads:
        p.error("--d-model must be a multiple of --heads, and --heads of --kv-heads")
    if a.d_model % 32 or a.d_ff % 32:
        p.error("--d-model and --d-ff must be multiples of 32 (the quantized block)")
    path = write_dense_gguf(a.out, layers=a.layers, d_model=a.d_model, d_ff=a.d_ff, heads=a.heads,
                            kv_heads=a.kv_heads, vocab=a.vocab, quant=a.quant, seed=a.seed, ctx=a.ctx)
    print(f"wrote {path} ({Path(path).stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
