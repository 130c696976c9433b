"""Random-weight Ministral 3 (mistral3) GGUFs for benchmarks: Ministral 3 3B's geometry
(docs/results/mistral3.md).

    python benchmarks/make_mistral3.py --out m3-3b.gguf               # Ministral 3 3B geometry, Q4_0 (2.1 GB)
    python benchmarks/make_mistral3.py --layers 8 --out m3-8l.gguf    # the same layers, fewer of them

then, side by side with llama.cpp on the same file:

    cflow bench -m m3-8l.gguf -t 1,2 --compare llama.cpp

The file is cflow.bench.synthetic.write_dense_gguf's random Llama under arch "mistral3", with
head_dim 128 (key_length) and Ministral 3's RoPE and attention temperature keys: YaRN factor 16
over an original context of 16384 with log multiplier 1, base 1e6, temperature beta 0.1. Same seed,
same file, bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cflow.bench.synthetic import check_geometry, geometry_parser, write_dense_gguf

MINISTRAL3_3B = dict(layers=26, d_model=3072, d_ff=9216, heads=32, kv_heads=8, head_dim=128, vocab=131072)
KEYS = {"rope.scaling.type": "yarn", "rope.scaling.factor": 16.0,
        "rope.scaling.original_context_length": 16384, "rope.scaling.yarn_log_multiplier": 1.0,
        "attention.temperature_scale": 0.1}


def main(argv: list[str] | None = None) -> int:
    p = geometry_parser(__doc__, MINISTRAL3_3B, "Ministral 3 3B")
    a = p.parse_args(argv)
    check_geometry(p, a)
    path = write_dense_gguf(a.out, layers=a.layers, d_model=a.d_model, d_ff=a.d_ff, heads=a.heads,
                            kv_heads=a.kv_heads, vocab=a.vocab, quant=a.quant, seed=a.seed, ctx=a.ctx,
                            arch="mistral3", head_dim=a.head_dim, rope_theta=1e6, keys=KEYS)
    print(f"wrote {path} ({Path(path).stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
