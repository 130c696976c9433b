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

import sys
from pathlib import Path

from cflow.bench.synthetic import GEMMA3_1B, check_geometry, geometry_parser, write_gemma3_gguf


def main(argv: list[str] | None = None) -> int:
    p = geometry_parser(__doc__, GEMMA3_1B, "Gemma 3 1B")
    a = p.parse_args(argv)
    check_geometry(p, a)
    path = write_gemma3_gguf(a.out, layers=a.layers, d_model=a.d_model, d_ff=a.d_ff, heads=a.heads,
                             kv_heads=a.kv_heads, head_dim=a.head_dim, vocab=a.vocab, window=a.window, quant=a.quant,
                             seed=a.seed, ctx=a.ctx)
    print(f"wrote {path} ({Path(path).stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
