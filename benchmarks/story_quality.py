"""The three quality figures of a story model (cflow.bench.quality), with SmolLM2 as the teacher.

    python benchmarks/story_quality.py --model src/cflow/models/default.cflow \
        --teacher SmolLM2-135M-Instruct.Q4_1.gguf --corpus data/stories-corpus.jsonl.xz \
        --stories 300 --samples 64 --out docs/results/default_quality.json

Held-out stories are the corpus's validation split (cflow.train.data.split_documents, the split
training uses), the first --stories of them in corpus order, each cut to its first --max-bytes bytes. Prints one line per figure and writes
the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cflow.bench.quality import measure
from cflow.corpus.distill import file_sha256
from cflow.runtime import Engine
from cflow.train.data import DEFAULT_VAL_FRACTION, open_corpus, split_documents


def shown(path: str) -> str:
    """A file as the record names it: relative to the working directory when under it, else its
    file name (a machine's own directories say nothing to a reader of the committed record)."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(Path.cwd().resolve()))
    except ValueError:
        return p.name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the story model (.cflow)")
    p.add_argument("--teacher", required=True, help="the judge (.gguf or .cflow), e.g. SmolLM2-135M-Instruct")
    p.add_argument("--corpus", required=True, help="the corpus whose validation split is held out")
    p.add_argument("--stories", type=int, default=300, help="held-out stories to score (default 300)")
    p.add_argument("--samples", type=int, default=64, help="stories the model samples for the judge (default 64)")
    p.add_argument("--sample-tokens", type=int, default=120, help="tokens per sample, at most (default 120)")
    p.add_argument("--max-bytes", type=int, default=800,
                   help="score each held-out story's first N bytes, cut at a space, so that models with "
                        "short contexts score the same text as the teacher (default 800: fits 256 tokens "
                        "of a 4096-token vocabulary)")
    p.add_argument("--seed", type=int, default=1, help="first sampling seed (default 1)")
    p.add_argument("-t", "--threads", type=int, default=0, help="threads (default: every core)")
    p.add_argument("--out", type=Path, help="write the figures here as JSON")
    a = p.parse_args(argv)
    _, val = split_documents(open_corpus(a.corpus).documents(), DEFAULT_VAL_FRACTION)
    held = val[:a.stories]
    t0 = time.perf_counter()
    with Engine.load(a.model, threads=a.threads or None) as model, \
            Engine.load(a.teacher, threads=a.threads or None) as teacher:
        r = measure(model, teacher, held, samples=a.samples, sample_tokens=a.sample_tokens, first_seed=a.seed,
                    max_bytes=a.max_bytes)
    args = list(argv if argv is not None else sys.argv[1:])
    files = {f: shown(f) for f in (a.model, a.teacher, a.corpus, a.out and str(a.out)) if f}
    d = {**r.to_dict(), "model": shown(a.model), "model_sha256": file_sha256(a.model), "teacher": shown(a.teacher),
         "teacher_sha256": file_sha256(a.teacher), "corpus": shown(a.corpus), "seconds": round(time.perf_counter() - t0, 1),
         "command": "python benchmarks/story_quality.py " + " ".join(files.get(x, x) for x in args)}
    print(f"bits per byte: model {r.model_bpb:.4f}, teacher {r.teacher_bpb:.4f} ({r.stories} held-out stories, "
          f"{r.bytes:,} bytes, each at most {r.max_bytes})")
    print(f"perplexity (model tokens): {r.model_ppl:.2f} over {r.model_tokens:,} tokens")
    print(f"teacher-judged: samples {r.judged_samples_ppl:.2f}, corpus {r.judged_corpus_ppl:.2f}, "
          f"ratio {r.judged_ratio:.3f} ({r.samples} samples of <= {r.sample_tokens} tokens)")
    if a.out:
        a.out.write_text(json.dumps(d, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
