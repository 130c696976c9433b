"""Validation perplexity of a .cflow model file through the engine, on the same windows the training
loop evaluates (shipped corpus split, seq_len, 64 windows), next to the float checkpoint's number.

    python benchmarks/eval_model_file.py MODEL.cflow CHECKPOINT_DIR [--windows 64] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cflow.bench.perplexity import evaluate_windows
from cflow.runtime import Engine
from cflow.train import bpe
from cflow.train.data import eval_windows, open_corpus, prepare_data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("checkpoint", type=Path, help="the training checkpoint (for its tokenizer and float metrics)")
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    meta = json.loads((args.checkpoint / "meta.json").read_text())
    tok = bpe.load_tokenizer(args.checkpoint / "tokenizer.json")
    data = prepare_data(open_corpus(meta["train_config"].get("data")), tok)
    starts = eval_windows(data.val, args.seq_len, args.windows)
    with Engine.load(args.model, threads=args.threads, n_ctx=args.seq_len) as eng:
        res = evaluate_windows(eng, data.val, starts, args.seq_len)
    print(json.dumps({
        "model": args.model, "windows": len(starts), "seq_len": args.seq_len, "tokens": res.n_tokens,
        "engine": {"loss": res.loss, "ppl": res.ppl, "top1": res.top1},
        "float_checkpoint": meta.get("eval"),
    }, indent=2))


if __name__ == "__main__":
    main()
