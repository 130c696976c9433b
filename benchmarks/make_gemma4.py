"""Random-weight Gemma 4 text GGUFs (dense) for benchmarks: Gemma 4 E2B's widths (docs/results/gemma4.md).

    python benchmarks/make_gemma4.py --layers 10 --shared-kv 5 --vocab 32768 --out g4-e2b-10l.gguf

then, side by side with llama.cpp on the same file:

    cflow bench -m g4-e2b-10l.gguf -t 1,2 --compare llama.cpp

The file is written with the `gguf` package in llama.cpp's gemma4 layout
(cflow.bench.synthetic_gemma4.write_gemma4_gguf: random blocks of std ~0.5/sqrt(inputs), norms 1, a
byte-level tokenizer of --vocab tokens). Same seed, same file, bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cflow.bench.synthetic import check_geometry, geometry_parser
from cflow.bench.synthetic_gemma4 import GEMMA4_E2B, write_gemma4_gguf


def main(argv: list[str] | None = None) -> int:
    p = geometry_parser(__doc__, GEMMA4_E2B, "Gemma 4 E2B")
    a = p.parse_args(argv)
    check_geometry(p, a)
    if a.d_ff_shared % 32 or a.per_layer % 32 or (a.heads * a.head_dim_local) % 32:
        p.error("--d-ff-shared, --per-layer and --heads x --head-dim-local must be multiples of 32")
    if not 0 <= a.shared_kv < a.layers or a.pattern < 2 or (a.layers - a.shared_kv) % a.pattern:
        p.error("--layers minus --shared-kv must be a positive multiple of --pattern (>= 2): the shared layers read "
                "the last KV-owning local and global layers")
    path = write_gemma4_gguf(a.out, **{k: getattr(a, k) for k in GEMMA4_E2B}, quant=a.quant, seed=a.seed, ctx=a.ctx)
    print(f"wrote {path} ({Path(path).stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
