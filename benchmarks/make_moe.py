"""Random-weight mixture-of-experts models at chosen sizes, for benchmarks (the command line of
cflow.bench.synthetic).

Writes one geometry in two forms:

  --gguf OUT.gguf    a Mixtral-layout GGUF that llama.cpp runs: general.architecture = llama with
                     llama.expert_count / llama.expert_used_count, per layer attn_norm, attn_q/k/v,
                     attn_output, ffn_norm, ffn_gate_inp (F32 [E, d]) and the 3-D ffn_gate_exps /
                     ffn_up_exps / ffn_down_exps (GGUF ne = [d, d_ff, E] and [d_ff, d, E]), then
                     token_embd, output_norm, output, and a small byte-level BPE tokenizer.
  --cflow OUT.cflow  a pipeline-native cflow model in the arch2_4_combined style (delta_dense = 1,
                     delta_expert = 2: expert outputs enter the residual two layers later), with the
                     same attention and experts plus the dense FFN the delays need (--dense-ff,
                     default d_ff; at the presets that makes the .cflow ~12% larger than the GGUF and
                     a token read ~1.4x the bytes, over a critical path half as long). A name ending
                     in .vflow writes the .vflow data order.

Weights are random but valid: quantized blocks are random bytes whose fp16 scales are set so that
every matrix's weights have standard deviation ~0.5/sqrt(inputs) (so each layer's outputs stay of
order one and logits are finite), norms are 1.0, routers small random F32 (routing varies by token). Every tensor
(every expert of a 3-D GGUF tensor) has its own RNG seeded from --seed and its name, so a file is
reproducible bit for bit. Both files stream to disk one tensor (one expert) at a time: a 26 GB
model is written on a machine with far less memory.

Examples:

  # the issue's geometries (Q4_0; GGUF + .cflow sizes)
  python benchmarks/make_moe.py --preset mixtral-small --gguf small.gguf --cflow small.cflow  # 2.7 + 3.0 GB
  python benchmarks/make_moe.py --preset mixtral-8x7b  --gguf 8x7b.gguf                       # 26.3 GB
  python benchmarks/make_moe.py --preset fine-small --gguf fine.gguf --cflow fine.cflow        # 2.9 + 2.9 GB

  # any geometry; --size picks the layer count for a target GGUF size
  python benchmarks/make_moe.py --layers 16 --d-model 2048 --experts 8 --top-k 2 --d-ff 5632 \\
      --heads 32 --kv-heads 8 --vocab 32000 --quant q4_0 --gguf out.gguf --cflow out.cflow
  python benchmarks/make_moe.py --preset mixtral-small --size 1G --gguf 1g.gguf

  # print the plan (sizes, bytes a token reads) without writing anything
  python benchmarks/make_moe.py --preset mixtral-8x7b --dry-run

Bytes a token reads are analytic: cflow.dag.analyze(config, quant).total_bytes, for the .cflow's
config and, with the same formula, for the GGUF's (a Llama+MoE config: no dense FFN, no delays).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from cflow import dag
from cflow.bench.synthetic import (CFLOW_ARCHES, DEFAULTS, PRESETS, QUANTS, RESIDUAL_WRITE_GAIN, Geometry, MakeMoeError, Written,
                                   cflow_data_bytes, gguf_data_bytes, layers_for_size, parse_size, write_cflow,
                                   write_gguf)


# ---- the command line ---------------------------------------------------------------------------
def _fmt(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def build_parser() -> argparse.ArgumentParser:
    presets = "\n".join(f"  {k:<14} " + ", ".join(f"{a.replace('_', '-')} {v}" for a, v in p.items())
                         for k, p in PRESETS.items())
    ap = argparse.ArgumentParser(
        prog="python benchmarks/make_moe.py", description=__doc__,
        epilog=f"presets (any flag given overrides the preset's value):\n{presets}\n\n"
               "Sizes are decimal (1 GB = 10^9 bytes), as cflow prints them.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), help="start from a named geometry (default: mixtral-small)")
    g = ap.add_argument_group("geometry (defaults: the preset's; values shown are mixtral-small's)")
    g.add_argument("--layers", type=int, help="transformer layers (16)")
    g.add_argument("--size", help="target GGUF size, e.g. 2.8G or 500M: picks --layers (overrides it)")
    g.add_argument("--d-model", type=int, help="model width (2048)")
    g.add_argument("--experts", type=int, help="experts per layer (8)")
    g.add_argument("--top-k", type=int, help="experts a token uses (2)")
    g.add_argument("--d-ff", type=int, help="each expert's SwiGLU hidden size (5632)")
    g.add_argument("--dense-ff", type=int,
                   help="the .cflow's dense FFN hidden size (default: --d-ff); the delays need a dense FFN, the "
                        "GGUF has none")
    g.add_argument("--heads", type=int, help="attention heads (32)")
    g.add_argument("--kv-heads", type=int, help="key/value heads, GQA (8)")
    g.add_argument("--vocab", type=int, help="vocabulary size, >= 259 (32000)")
    g.add_argument("--ctx", type=int, help="context length the files declare (default 4096)")
    g.add_argument("--residual-gain", type=float,
                   help=f"weight gain of the matrices that write into the residual (default {RESIDUAL_WRITE_GAIN}); "
                        "larger makes routing change more from layer to layer (harder to predict ahead)")
    g.add_argument("--arch", choices=CFLOW_ARCHES,
                   help="the .cflow's delays (default arch2_4_combined: dense FFN on x_l, experts two layers later; "
                        "arch4: experts two layers later; arch1: none); the same weights and bytes in each")
    o = ap.add_argument_group("output")
    o.add_argument("--quant", choices=QUANTS, default="q4_0", help="weight format (default q4_0)")
    o.add_argument("--gguf", metavar="OUT.gguf", help="write the Mixtral-layout GGUF here")
    o.add_argument("--cflow", metavar="OUT.cflow",
                   help="write the pipeline-native model here (a .vflow name writes the .vflow order)")
    o.add_argument("--seed", type=int, default=0, help="RNG seed; the same seed gives the same bytes (default 0)")
    o.add_argument("--dry-run", action="store_true", help="print the plan (sizes, bytes/token) and write nothing")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return ap


def geometry_from_args(a: argparse.Namespace) -> Geometry:
    base = dict(DEFAULTS)
    if a.preset:
        base.update(PRESETS[a.preset])
    for k in ("layers", "d_model", "experts", "top_k", "d_ff", "dense_ff", "heads", "kv_heads", "vocab", "ctx",
              "residual_gain", "arch"):
        v = getattr(a, k)
        if v is not None:
            base[k] = v
    g = Geometry(**base)
    if a.size:
        g = g.replace(layers=layers_for_size(g, a.quant, parse_size(a.size)))
    return g


def plan(g: Geometry, q: str) -> dict[str, Any]:
    gg, cc = dag.analyze(g.gguf_config(), q), dag.analyze(g.cflow_config(), q)
    return {"geometry": dataclasses.asdict(g), "quant": q,
            "gguf": {"data_bytes": gguf_data_bytes(g, q), "token_bytes": gg.total_bytes,
                     "critical_bytes": gg.critical_bytes, "config": g.gguf_config().to_dict()},
            "cflow": {"data_bytes": cflow_data_bytes(g, q), "token_bytes": cc.total_bytes,
                      "critical_bytes": cc.critical_bytes, "config": g.cflow_config().to_dict()}}


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        g = geometry_from_args(a)
    except MakeMoeError as e:
        ap.error(str(e))
    if not a.dry_run and not (a.gguf or a.cflow):
        ap.error("nothing to write: give --gguf OUT.gguf and/or --cflow OUT.cflow (or --dry-run to see the plan)")
    p = plan(g, a.quant)
    say = (lambda *x: None) if a.json else (lambda *x: print(*x, flush=True))
    say(f"geometry: {g.layers} layers, d_model {g.d_model}, {g.heads}/{g.kv_heads} heads, {g.experts} experts "
        f"top-{g.top_k}, d_ff {g.d_ff} (.cflow dense FFN {g.dense}), vocab {g.vocab}, {a.quant}, seed {a.seed}")
    results: list[Written] = []
    for kind, out in (("gguf", a.gguf), ("cflow", a.cflow)):
        if a.dry_run and kind in p:
            say(f"  {kind:<5}  ~{_fmt(p[kind]['data_bytes'])}, a token reads {_fmt(p[kind]['token_bytes'])} "
                f"(critical path {_fmt(p[kind]['critical_bytes'])})")
        if a.dry_run or not out:
            continue
        t = time.perf_counter()
        try:
            w = (write_gguf if kind == "gguf" else write_cflow)(out, g, a.quant, a.seed, not a.no_progress)
        except OSError as e:
            print(f"error: writing {out} failed: {e}", file=sys.stderr)
            return 1
        results.append(w)
        say(f"  {kind:<5}  {out}: {_fmt(w.file_bytes)} in {time.perf_counter() - t:.1f} s "
            f"({w.file_bytes / 1e9 / max(w.seconds, 1e-9):.2f} GB/s); a token reads {_fmt(w.token_bytes)} "
            f"(critical path {_fmt(w.critical_bytes)}; analytic, cflow.dag)")
    if a.json:
        print(json.dumps({**p, "written": [w.to_dict() for w in results]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
