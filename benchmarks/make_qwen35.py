"""Random-weight Qwen3.5 GGUFs for benchmarks: Qwen3.5-9B's widths (qwen35), or with --moe
Qwen3.5-35B-A3B's (qwen35moe), with fewer layers, experts and a smaller vocabulary
(docs/results/qwen35.md).

    python benchmarks/make_qwen35.py --layers 8 --vocab 32768 --out q35-9b-8l.gguf
    python benchmarks/make_qwen35.py --moe --layers 8 --experts 64 --vocab 32768 --out q35moe-8l.gguf

then, side by side with llama.cpp on the same file:

    cflow bench -m q35-9b-8l.gguf -t 1,2 --compare llama.cpp

The file is llama.cpp's qwen35 / qwen35moe layout (cflow.bench.synthetic_qwen35.write_qwen35_gguf:
Gated DeltaNet layers with every --interval-th layer gated full attention, partial RoPE over a
quarter of each head; random blocks of std ~0.5/sqrt(inputs), norms 1, a byte-level tokenizer of
--vocab tokens). Same seed, same file, bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cflow.bench.synthetic import geometry_parser
from cflow.bench.synthetic_qwen35 import QWEN35_9B, QWEN35_35B_A3B, ROTATED_FRACTION, write_qwen35_gguf


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    moe = "--moe" in argv
    defaults = QWEN35_35B_A3B if moe else QWEN35_9B
    p = geometry_parser(__doc__, defaults, "Qwen3.5-35B-A3B" if moe else "Qwen3.5-9B")
    p.add_argument("--moe", action="store_true", help="qwen35moe at Qwen3.5-35B-A3B's widths (default: qwen35, 9B's)")
    a = p.parse_args(argv)
    if a.heads % a.kv_heads or a.ssm_v_heads % a.ssm_k_heads:
        p.error("--heads must be a multiple of --kv-heads, --ssm-v-heads of --ssm-k-heads")
    if not 1 <= a.interval <= a.layers:
        p.error("--interval must be in 1..layers: every interval-th layer is full attention")
    if a.head_dim % (2 * ROTATED_FRACTION):
        p.error(f"--head-dim must be a multiple of {2 * ROTATED_FRACTION}: a quarter of it turns, in pairs")
    widths = ["d_model", "ssm_head_dim", "d_expert", "d_shared"] if moe else ["d_model", "d_ff", "ssm_head_dim"]
    for k in widths:
        if getattr(a, k) % 32:
            p.error(f"--{k.replace('_', '-')} must be a multiple of 32 (the quantized block)")
    if moe and not 1 <= a.top_k <= a.experts:
        p.error("--top-k must be in 1..experts")
    geo = {k: getattr(a, k) for k in defaults}
    path = write_qwen35_gguf(a.out, **geo, quant=a.quant, seed=a.seed, ctx=a.ctx)
    print(f"wrote {path} ({Path(path).stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
