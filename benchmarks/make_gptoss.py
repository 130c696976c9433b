"""Random-weight gpt-oss GGUFs for benchmarks: gpt-oss-20b's layer geometry (docs/results/gptoss.md).

    python benchmarks/make_gptoss.py --out oss.gguf                  # gpt-oss-20b's geometry (12 GB)
    python benchmarks/make_gptoss.py --layers 4 --vocab 32768 --out oss-4l.gguf

then, side by side with llama.cpp on the same file:

    cflow bench -m oss-4l.gguf -t 1,2 --compare llama.cpp

The file is written with the `gguf` package in llama.cpp's gpt-oss layout
(cflow.bench.synthetic_gptoss.write_gptoss_gguf: MXFP4 experts, Q8_0 attention, embedding and output,
F32 biases and sinks, YaRN, a window on the even layers, a byte-level tokenizer of --vocab tokens).
Same seed, same file, bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cflow.bench.synthetic import check_geometry, geometry_parser
from cflow.bench.synthetic_gptoss import GPTOSS_20B, write_gptoss_gguf


def main(argv: list[str] | None = None) -> int:
    p = geometry_parser(__doc__, GPTOSS_20B, "gpt-oss-20b")
    a = p.parse_args(argv)
    check_geometry(p, a)
    if a.quant != "q4_0":  # the parser's default: gpt-oss files have one layout
        p.error("gpt-oss files are MXFP4 experts with Q8_0 attention; --quant does not apply")
    if a.top_k > a.experts:
        p.error("--top-k must be at most --experts")
    path = write_gptoss_gguf(a.out, layers=a.layers, d_model=a.d_model, d_ff=a.d_ff, heads=a.heads,
                             kv_heads=a.kv_heads, head_dim=a.head_dim, vocab=a.vocab, experts=a.experts,
                             top_k=a.top_k, window=a.window, seed=a.seed, ctx=a.ctx)
    print(f"wrote {path} ({Path(path).stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
