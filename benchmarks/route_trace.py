"""Record a trained model's learned routing as a route trace (cflow.runtime.routes), to replay it
through another model's expert cache (benchmarks/expert_io_ab.py --trace).

The engine decodes the corpus's held-out stories teacher-forced, one token per step (as decode
routes), in windows of --window tokens from position 0, and records each route's choices and what
expert speculation predicts for every later layer. The trace's summary: the share of each
distance's predictions that the later layer chose (the predictability the speculation gate sees).

    python benchmarks/route_trace.py runs/family/arch4-s/seed1.cflow --corpus data/stories-corpus.jsonl.xz \\
        --tokens 4096 --out /tmp/arch4-s.trace.npz

A checkpoint directory is exported to a temporary .cflow first (q4_0, as the family table counts).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np


def held_out_stream(eng, corpus: str, n_tokens: int) -> list[int]:
    """The first n_tokens tokens of the corpus's validation stories (the training split's rule),
    each story after an end-of-text token."""
    from cflow.train.data import DEFAULT_VAL_FRACTION, open_corpus, split_documents

    _, val = split_documents(open_corpus(corpus).documents(), DEFAULT_VAL_FRACTION)
    eos = eng.tokenizer.eos_id
    stream: list[int] = []
    for doc in val:
        stream += [eos, *eng.encode(doc, add_bos=False)]
        if len(stream) >= n_tokens:
            break
    return stream[:n_tokens]


def predictability(trace) -> dict[int, float]:
    """Per distance d: the share of experts predicted for layer l + d that layer l + d chose."""
    out = {}
    for j in range(trace.depth):
        hit = tot = 0
        for layer in range(trace.n_layers - 1 - j):
            p, c = trace.pred[:, layer, j], trace.chosen[:, layer + 1 + j]
            hit += int((p[:, :, None] == c[:, None, :]).any(-1).sum())
            tot += p.size
        if tot:
            out[j + 1] = round(hit / tot, 4)
    return out


def model_file(path: str, tmp: Path) -> str:
    p = Path(path)
    if not p.is_dir():
        return str(p)
    from cflow.convert.checkpoint import convert_checkpoint

    out = tmp / (p.name + ".cflow")
    convert_checkpoint(str(p), str(out), quant="q4_0")
    return str(out)


def record(path: str, corpus: str, n_tokens: int, window: int, threads: int, source: str | None = None):
    """The trace of `path` decoding the corpus's held-out stories; `source` names the model in it
    (default: path; a checkpoint's directory rather than the temporary file exported from it)."""
    from cflow.runtime import Engine

    with Engine.load(path, threads=threads, experts="ram", n_ctx=window) as eng:
        stream = held_out_stream(eng, corpus, n_tokens)
        eng.record_routes(len(stream))
        for i, t in enumerate(stream):
            eng.step(t, i % window)
        return eng.route_trace(source=source or str(path), corpus=corpus, tokens=len(stream), window=window)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a trained model: .cflow file or checkpoint directory")
    ap.add_argument("--corpus", required=True, help="the corpus whose held-out stories the model reads")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens to decode and record (default 4096)")
    ap.add_argument("--window", type=int, default=256, help="tokens per window from position 0 (default 256)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out", required=True, help="the trace file to write (.npz)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        trace = record(model_file(a.model, Path(tmp)), a.corpus, a.tokens, a.window, a.threads, source=a.model)
    trace.meta["predictability"] = predictability(trace)
    trace.save(a.out)
    print(json.dumps({"out": a.out, "rows": trace.rows, "layers": trace.n_layers, "top_k": trace.top_k,
                      "depth": trace.depth, "predictability": trace.meta["predictability"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
