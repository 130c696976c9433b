"""Build a training corpus from story directories and JSONL files: clean, deduplicate, split.

    report = build(["data/stories", "data/seed/stories-smollm2.jsonl.xz"], "data/stories-corpus.jsonl.xz")

1. Clean: each answer through cflow.corpus.recipe.clean_story (an answer cut at the token limit
   loses its unfinished last sentence; what is then shorter than a story is dropped). Lines of a
   plain JSONL file (no `finish` field) are taken as finished stories.
2. Exact duplicates: the same text after lower-casing and collapsing white space; the first seen
   is kept (sources in the order given, lines in file order).
3. Near duplicates: MinHash signatures (datasketch, `num_perm` permutations) of each document's
   word 3-grams. An LSH index at a lower Jaccard (CANDIDATE_THRESHOLD) finds candidates, and a
   document whose estimated similarity to a kept candidate reaches `threshold` is dropped: LSH
   alone, banded for the threshold itself, misses a fair share of pairs just above it (measured:
   a pair at Jaccard 0.90 slipped through an index banded for 0.8). 3-grams of words, because stories for small
   children share most single words and many pairs; a shared run of three words is what copying
   leaves. Measured by the build itself: its report counts each kind.
4. The split is the one training uses (cflow.train.data.doc_fraction: a document's hash alone),
   counted here so the corpus file's report says how many documents each side gets.

The corpus is one xz-compressed JSONL file (`text` plus the recipe fields), written atomically,
and a report `<name>.json` beside it with every count and the sources' hashes.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from cflow import fsutil
from cflow.corpus.recipe import clean_story
from cflow.corpus.shards import MANIFEST, CorpusError, StoryStore, read_lines

DEFAULT_THRESHOLD = 0.8
CANDIDATE_THRESHOLD = 0.5
DEFAULT_NUM_PERM = 128
_WORD = re.compile(r"[a-z0-9']+")
_KEEP = ("text", "seed", "verb", "noun", "adjective", "feature")


@dataclass
class BuildReport:
    out: str
    sources: list[dict[str, Any]] = field(default_factory=list)
    answers: int = 0           # lines read
    teacher_tokens: int = 0    # generated tokens behind them (where the source says)
    cut_at_length: int = 0     # answers whose unfinished last sentence was cut
    too_short: int = 0         # dropped by clean_story
    exact_duplicates: int = 0
    near_duplicates: int = 0
    documents: int = 0         # in the corpus
    characters: int = 0
    train_documents: int = 0
    val_documents: int = 0
    val_fraction: float = 0.0
    threshold: float = DEFAULT_THRESHOLD
    num_perm: int = DEFAULT_NUM_PERM


def _answers(source: Path) -> Iterator[dict[str, Any]]:
    if source.is_dir():
        if not (source / MANIFEST).is_file():
            raise CorpusError(f"{source} is a directory without {MANIFEST}: not a story directory")
        for p in StoryStore(source, json.loads((source / MANIFEST).read_text())).files():
            yield from read_lines(p)
    elif source.name.endswith((".jsonl", ".jsonl.xz")):
        yield from read_lines(source)
    else:
        raise CorpusError(f"{source}: give a story directory, a .jsonl or a .jsonl.xz file")


def _source_hash(source: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(source.iterdir()) if source.is_dir() else [source]:
        if p.is_file() and p.name != MANIFEST:
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


def shingles(text: str, n: int = 3) -> set[bytes]:
    words = _WORD.findall(text.lower())
    if len(words) < n:
        return {" ".join(words).encode()}
    return {" ".join(words[i:i + n]).encode() for i in range(len(words) - n + 1)}


def build(sources: list[str | os.PathLike], out: str | os.PathLike, *, threshold: float = DEFAULT_THRESHOLD,
          num_perm: int = DEFAULT_NUM_PERM, val_fraction: float | None = None,
          progress: Callable[[int], None] | None = None) -> BuildReport:
    """Clean, deduplicate and write the corpus `out` (.jsonl.xz) from `sources`; progress(n) after
    every n answers read."""
    try:
        from datasketch import MinHash, MinHashLSH
    except ImportError:
        raise CorpusError("near-duplicate removal needs datasketch: pip install 'cflow-lm[data]'") from None
    from cflow.train.data import DEFAULT_VAL_FRACTION, doc_fraction

    out = Path(out)
    if not out.name.endswith(".jsonl.xz"):
        raise CorpusError(f"{out}: the corpus file must end in .jsonl.xz")
    if not 0 < threshold <= 1:
        raise CorpusError(f"threshold must be in (0, 1], got {threshold}")
    val_fraction = DEFAULT_VAL_FRACTION if val_fraction is None else float(val_fraction)
    paths = [Path(s) for s in sources]
    for p in paths:
        if not p.exists():
            raise CorpusError(f"{p} does not exist")
    fsutil.check_writable(out, file=True)
    report = BuildReport(str(out), threshold=threshold, num_perm=num_perm, val_fraction=val_fraction)
    lsh = MinHashLSH(threshold=min(threshold, CANDIDATE_THRESHOLD), num_perm=num_perm)
    signatures: dict[str, Any] = {}
    seen: set[str] = set()
    kept: list[dict[str, Any]] = []
    for p in paths:
        n0 = report.answers
        for a in _answers(p):
            report.answers += 1
            report.teacher_tokens += int(a.get("tokens", 0))
            finish = a.get("finish", "stop")
            text = clean_story(a.get("text", ""), finish)
            if progress and report.answers % 1000 == 0:
                progress(1000)
            if text is None:
                report.too_short += 1
                continue
            report.cut_at_length += finish == "length"
            key = hashlib.sha256(_normal(text).encode()).hexdigest()
            if key in seen:
                report.exact_duplicates += 1
                continue
            seen.add(key)
            m = MinHash(num_perm=num_perm)
            m.update_batch(list(shingles(text)))
            if any(m.jaccard(signatures[k]) >= threshold for k in lsh.query(m)):
                report.near_duplicates += 1
                continue
            lsh.insert(key, m)
            signatures[key] = m
            doc = {k: a[k] for k in _KEEP if k in a}
            doc["text"] = text
            kept.append(doc)
        report.sources.append({"path": str(p), "answers": report.answers - n0, "sha256": _source_hash(p)})
    report.documents = len(kept)
    report.characters = sum(len(d["text"]) for d in kept)
    report.val_documents = sum(doc_fraction(d["text"]) < val_fraction for d in kept)
    report.train_documents = report.documents - report.val_documents
    buf = io.BytesIO()
    with lzma.open(buf, "wt", encoding="utf-8", preset=9) as z:
        for d in kept:
            z.write(json.dumps(d, ensure_ascii=False) + "\n")
    with fsutil.writing(out):
        fsutil.atomic_write_bytes(out, buf.getvalue())
        fsutil.atomic_write_text(report_path(out), json.dumps(asdict(report), indent=1) + "\n")
    return report


def report_path(corpus: Path) -> Path:
    return corpus.with_name(corpus.name.removesuffix(".jsonl.xz") + ".json")
