"""Random-weight Gemma 4 text GGUFs for benchmarks: Gemma 4 E2B's widths (dense, per-layer inputs,
shared-KV layers) or 26B-A4B's (`--preset 26b-a4b`: experts beside the dense MLP, 8 KV heads on the
local layers and 2 on the global ones), docs/results/gemma4.md.

    python benchmarks/make_gemma4.py --layers 10 --shared-kv 5 --vocab 32768 --out g4-e2b-10l.gguf
    python benchmarks/make_gemma4.py --preset 26b-a4b --layers 6 --experts 32 --vocab 32768 --out g4-26b-6l.gguf

then, side by side with llama.cpp on the same file:

    cflow bench -m g4-e2b-10l.gguf -t 1,2 --compare llama.cpp

The file is written with the `gguf` package in llama.cpp's gemma4 layout
(cflow.bench.synthetic_gemma4.write_gemma4_gguf: random blocks of std ~0.5/sqrt(inputs), norms 1, a
byte-level tokenizer of --vocab tokens). The preset gives every flag's default; a flag overrides
it. Same seed, same file, bit for bit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cflow.bench.synthetic import check_geometry, geometry_parser
from cflow.bench.synthetic_gemma4 import PRESETS, write_gemma4_gguf

LABELS = {"e2b": "Gemma 4 E2B", "26b-a4b": "Gemma 4 26B-A4B"}


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=list(PRESETS), default="e2b")
    preset = pre.parse_known_args(argv)[0].preset
    p = geometry_parser(__doc__, PRESETS[preset], LABELS[preset])
    p.add_argument("--preset", choices=list(PRESETS), default="e2b",
                   help="the real model whose geometry the flags default to (e2b)")
    a = p.parse_args(argv)
    check_geometry(p, a)
    if a.d_ff_shared % 32 or a.per_layer % 32 or (a.heads * a.head_dim_local) % 32 or a.d_expert % 32:
        p.error("--d-ff-shared, --per-layer, --d-expert and --heads x --head-dim-local must be multiples of 32")
    if a.kv_heads_local < 1 or a.heads % a.kv_heads_local:
        p.error("--kv-heads-local must divide --heads")
    if a.experts and not 0 < a.top_k <= a.experts or a.experts and not a.d_expert or a.experts < 0:
        p.error("--experts needs --top-k in 1..--experts and --d-expert > 0")
    if not 0 <= a.shared_kv < a.layers or a.pattern < 2 or (a.layers - a.shared_kv) % a.pattern:
        p.error("--layers minus --shared-kv must be a positive multiple of --pattern (>= 2): the shared layers read "
                "the last KV-owning local and global layers")
    path = write_gemma4_gguf(a.out, **{k: getattr(a, k) for k in PRESETS[preset]}, quant=a.quant, seed=a.seed,
                             ctx=a.ctx)
    print(f"wrote {path} ({Path(path).stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
