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

import argparse
import sys
from pathlib import Path

from cflow.bench.synthetic import write_dense_gguf

MINISTRAL3_3B = dict(layers=26, d_model=3072, d_ff=9216, heads=32, kv_heads=8, head_dim=128, vocab=131072)
KEYS = {"rope.scaling.type": "yarn", "rope.scaling.factor": 16.0,
        "rope.scaling.original_context_length": 16384, "rope.scaling.yarn_log_multiplier": 1.0,
        "attention.temperature_scale": 0.1}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="the GGUF to write")
    p.add_argument("--quant", default="q4_0", choices=("q4_0", "q4_1", "q8_0"), help="weight type (q4_0)")
    p.add_argument("--seed", type=int, default=0, help="weights' seed (0)")
    p.add_argument("--ctx", type=int, default=4096, help="the file's context length (4096)")
    for k, v in MINISTRAL3_3B.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=v, help=f"default {v} (Ministral 3 3B)")
    a = p.parse_args(argv)
    if a.heads % a.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    if a.d_model % 32 or a.d_ff % 32 or (a.heads * a.head_dim) % 32:
        p.error("--d-model, --d-ff and --heads x --head-dim must be multiples of 32 (the quantized block)")
    path = write_dense_gguf(a.out, layers=a.layers, d_model=a.d_model, d_ff=a.d_ff, heads=a.heads,
                            kv_heads=a.kv_heads, vocab=a.vocab, quant=a.quant, seed=a.seed, ctx=a.ctx,
                            arch="mistral3", head_dim=a.head_dim, rope_theta=1e6, keys=KEYS)
    print(f"wrote {path} ({Path(path).stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
