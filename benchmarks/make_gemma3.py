"""Random-weight Gemma 3 text GGUFs for benchmarks: Gemma 3 1B's geometry (docs/results/gemma3.md).

    python benchmarks/make_gemma3.py --out g3-1b.gguf                # Gemma 3 1B geometry, Q4_0
    python benchmarks/make_gemma3.py --layers 8 --vocab 32768 --out g3-8l.gguf

then, side by side with llama.cpp on the same file:

    cflow bench -m g3-1b.gguf -t 1,2 --compare llama.cpp

The file is written with the `gguf` package in llama.cpp's gemma3 layout
(cflow.bench.synthetic.write_gemma3_gguf: every matrix's weights random blocks of std ~0.5/sqrt(inputs),
norms 1, a byte-level tokenizer of --vocab tokens). Same seed, same file, bit for bit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cflow.bench.synthetic import GEMMA3_1B, write_gemma3_gguf


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="the GGUF to write")
    p.add_argument("--quant", default="q4_0", choices=("q4_0", "q4_1", "q8_0"), help="weight type (q4_0)")
    p.add_argument("--seed", type=int, default=0, help="weights' seed (0)")
    p.add_argument("--ctx", type=int, default=4096, help="the file's context length (4096)")
    for k, v in GEMMA3_1B.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=v, help=f"default {v} (Gemma 3 1B)")
    a = p.parse_args(argv)
    if a.heads % a.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    if a.d_model % 32 or a.d_ff % 32 or (a.heads * a.head_dim) % 32:
        p.error("--d-model, --d-ff and --heads x --head-dim must be multiples of 32 (the quantized block)")
    path = write_gemma3_gguf(a.out, layers=a.layers, d_model=a.d_model, d_ff=a.d_ff, heads=a.heads,
                             kv_heads=a.kv_heads, head_dim=a.head_dim, vocab=a.vocab, window=a.window, quant=a.quant,
                             seed=a.seed, ctx=a.ctx)
    print(f"wrote {path} ({Path(path).stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
