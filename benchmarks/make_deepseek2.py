"""Random-weight deepseek2 GGUFs for benchmarks: DeepSeek-V3's attention and expert shapes with few
layers and experts (docs/results/deepseek2.md).

    python benchmarks/make_deepseek2.py --out ds3.gguf            # d 7168, 128 heads, 3 layers, 32 experts, Q4_0
    python benchmarks/make_deepseek2.py --layers 2 --experts 16 --out ds3-small.gguf

then, side by side with llama.cpp on the same file:

    cflow bench -m ds3.gguf -t 1,2 --compare llama.cpp

The file is llama.cpp's deepseek2 layout (cflow.bench.synthetic_deepseek2.write_deepseek2_gguf:
multi-head latent attention with the split attn_k_b / attn_v_b, --dense-layers leading dense
layers, V3's grouped sigmoid routing, one shared expert; random blocks of std ~0.5/sqrt(inputs),
norms 1, a byte-level tokenizer of --vocab tokens). Same seed, same file, bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cflow.bench.synthetic import geometry_parser
from cflow.bench.synthetic_deepseek2 import DEEPSEEK_V3, write_deepseek2_gguf


def main(argv: list[str] | None = None) -> int:
    p = geometry_parser(__doc__, DEEPSEEK_V3, "DeepSeek-V3's widths; fewer layers and experts")
    a = p.parse_args(argv)
    if not 0 < a.dense_layers < a.layers:
        p.error("--dense-layers must leave at least one MoE layer (0 < dense < layers)")
    if a.experts % a.groups or not 1 <= a.groups_used <= a.groups or not 1 <= a.top_k <= a.experts:
        p.error("--groups must divide --experts, --groups-used be in 1..groups, --top-k in 1..experts")
    for k in ("d_model", "q_lora", "kv_lora", "qk_nope", "d_ff", "d_expert"):
        if getattr(a, k) % 32:
            p.error(f"--{k.replace('_', '-')} must be a multiple of 32 (the quantized block)")
    geo = {k: getattr(a, k) for k in DEEPSEEK_V3}
    path = write_deepseek2_gguf(a.out, **geo, quant=a.quant, seed=a.seed, ctx=a.ctx)
    print(f"wrote {path} ({Path(path).stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
