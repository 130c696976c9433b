"""Training data: corpus sources, the train/validation split, the token cache and the batch sampler.

Owns everything between "a corpus" and "a batch of token ids":
- Sources (`open_corpus`): the story corpus shipped inside the package (the default; offline),
  a local PATH (`.txt`: documents separated by blank lines; `.jsonl`, `.jsonl.xz` or `.jsonl.gz`:
  one object per line with a `text` field, as `cflow data build` writes) and `tinystories` (roneneldan/TinyStories streamed through HF `datasets`;
  `tinystories:N` takes the first N stories, `tinystories:all` takes all).
- The split is by document and depends only on the document's text: a document goes to
  validation when the first 8 bytes of its BLAKE2b hash, read as a fraction, fall below
  `val_fraction`. Reordering, adding or removing other documents never moves a document across.
- Tokens are cached as flat uint16 (uint32 for vocabularies over 65536) arrays, `<|eos|>` (a
  borrowed vocabulary's EOS, cflow.train.vocab) after every document, memory-mapped at run time.
  The cache key hashes the corpus fingerprint (file contents, or path+size+mtime for very large
  files), the tokenizer JSON (and a borrowed vocabulary's header) and the split, so a change in
  any of them re-tokenizes, and a borrowed vocabulary's tokens never share an entry with a
  trained BPE's. Cache entries are written to a temporary directory and renamed into place, so a
  crash or a concurrent writer never leaves a half-written entry. The cache lives in
  `cflow.fsutil.cache_dir()` unless a directory is given; a cache that cannot be written raises
  `cflow.fsutil.WriteError` before any tokenizing is done.
- `BatchSampler` draws random windows with a seeded numpy generator whose state can be saved
  and restored (exact resume). Every rank draws the same global batch and keeps its own disjoint
  slice, so a DDP run sees exactly the batches of a single-process run.

No torch here: batches are numpy int64 arrays; the training loop wraps them.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import lzma
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from cflow import fsutil
from cflow.errors import CflowError
from cflow.train import bpe

SHIPPED_CORPUS = "stories-smollm2.jsonl"
DEFAULT_VAL_FRACTION = 0.05
DEFAULT_TINYSTORIES_DOCS = 500_000
# Hash whole files below this size; above it, path + size + mtime is the fingerprint (cheap).
_HASH_LIMIT = 512 << 20
_CACHE_FORMAT = 1


class DataError(CflowError):
    """A corpus cannot be read, is empty, or a cached token file is unusable."""


# ---- corpus sources --------------------------------------------------------------------------
@dataclass(frozen=True)
class Corpus:
    """A named document source; `documents()` is lazy so a warm cache never re-reads it."""

    name: str
    fingerprint: str  # changes whenever the documents may have changed
    documents: Callable[[], list[str]]


def shipped_corpus_path() -> Path:
    ref = resources.files("cflow") / "data" / SHIPPED_CORPUS
    p = Path(str(ref))
    if not p.is_file():
        raise DataError(f"the shipped corpus {SHIPPED_CORPUS} is missing from the cflow package; "
                        "reinstall cflow or pass --data PATH")
    return p


def open_corpus(source: str | os.PathLike | None = None) -> Corpus:
    """Resolve a data source: None/'stories' (shipped), 'tinystories[:N|:all]', or a file path."""
    if source is None or str(source) in ("", "stories", "default"):
        p = shipped_corpus_path()
        return Corpus(f"shipped:{SHIPPED_CORPUS}", _file_fingerprint(p), _once(lambda: _read_jsonl(p)))
    s = str(source)
    if s == "tinystories" or s.startswith("tinystories:"):
        return _tinystories_corpus(s)
    p = Path(s).expanduser()
    if not p.is_file():
        raise DataError(f"data source {s!r} is neither 'tinystories' nor an existing file; "
                        "pass a .txt or .jsonl path, 'tinystories', or omit --data for the shipped corpus")
    if p.name.endswith((".jsonl", ".jsonl.xz", ".jsonl.gz")):
        reader = _read_jsonl
    elif p.suffix == ".txt":
        reader = _read_txt
    else:
        raise DataError(f"{p}: unsupported data file type {p.suffix!r}; use .txt (documents separated by "
                        "blank lines) or .jsonl (a 'text' field per line; .jsonl.xz / .jsonl.gz compressed, as "
                        "`cflow data build` writes)")
    return Corpus(f"file:{p.resolve()}", _file_fingerprint(p), _once(lambda: reader(p)))


def _once(load: Callable[[], list[str]]) -> Callable[[], list[str]]:
    """Read a corpus at most once: the tokenizer and the token cache may both need it."""
    memo: list[list[str]] = []

    def documents() -> list[str]:
        if not memo:
            memo.append(load())
        return memo[0]

    return documents


def _file_fingerprint(p: Path) -> str:
    st = p.stat()
    if st.st_size > _HASH_LIMIT:
        return f"stat:{p.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return f"sha256:{h.hexdigest()}"


def _open_text(p: Path):
    """A text file, read through xz or gzip when its name says it is compressed."""
    if p.suffix == ".xz":
        return lzma.open(p, "rt", encoding="utf-8")
    if p.suffix == ".gz":
        return gzip.open(p, "rt", encoding="utf-8")
    return open(p, encoding="utf-8")


def _read_jsonl(p: Path) -> list[str]:
    try:
        return _jsonl_texts(p)
    except (lzma.LZMAError, EOFError, gzip.BadGzipFile, UnicodeDecodeError) as e:
        raise DataError(f"{p}: cannot be read ({type(e).__name__}: {e}); the file is damaged or cut short") from None


def _jsonl_texts(p: Path) -> list[str]:
    docs = []
    with _open_text(p) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object") from None
            text = obj.get("text") if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{p}:{lineno}: each line needs a string 'text' field")
            if text.strip():
                docs.append(text)
    return docs


def _read_txt(p: Path) -> list[str]:
    text = p.read_text(encoding="utf-8")
    # A document is a run of lines; one or more blank lines separate documents.
    docs, cur = [], []
    for line in text.splitlines():
        if line.strip():
            cur.append(line)
        elif cur:
            docs.append("\n".join(cur))
            cur = []
    if cur:
        docs.append("\n".join(cur))
    return docs


def _tinystories_corpus(spec: str) -> Corpus:
    limit_s = spec.partition(":")[2] or str(DEFAULT_TINYSTORIES_DOCS)
    if limit_s == "all":
        limit = None
    else:
        try:
            limit = int(limit_s)
        except ValueError:
            raise DataError(f"bad data source {spec!r}: use tinystories, tinystories:N or tinystories:all") from None
        if limit <= 0:
            raise DataError(f"bad data source {spec!r}: N must be positive")

    def load() -> list[str]:
        try:
            import datasets
        except ImportError:
            raise DataError("the 'tinystories' source needs the HF datasets package (pip install datasets) "
                            "and network access; or pass --data PATH, or omit --data for the shipped corpus") from None
        try:
            stream = datasets.load_dataset("roneneldan/TinyStories", split="train", streaming=True)
            docs = []
            for row in stream:
                if row["text"].strip():
                    docs.append(row["text"])
                if limit is not None and len(docs) >= limit:
                    break
        except Exception as e:  # offline, hub errors, ...: all mean "cannot get TinyStories here"
            raise DataError(f"cannot stream roneneldan/TinyStories ({type(e).__name__}: {e}); check network "
                            "access, or pass --data PATH, or omit --data for the shipped corpus") from None
        return docs

    # The hub gives no cheap content hash; the name and size identify the slice.
    name = f"hf:roneneldan/TinyStories:train:{limit_s}"
    return Corpus(name, name, _once(load))


# ---- split -----------------------------------------------------------------------------------
def doc_fraction(text: str) -> float:
    """A stable pseudo-random number in [0, 1) derived from the document text alone."""
    h = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2.0**64


def split_documents(docs: list[str], val_fraction: float = DEFAULT_VAL_FRACTION) -> tuple[list[str], list[str]]:
    """Split by document hash: (train, validation), each in corpus order.

    When the rule leaves validation empty (tiny corpora) the document with the smallest hash goes
    there, which keeps the choice independent of order.
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if len(docs) < 2:
        raise DataError(f"the corpus has {len(docs)} document(s); at least 2 are needed for a train/validation split")
    fr = [doc_fraction(d) for d in docs]
    is_val = [f < val_fraction for f in fr]
    if not any(is_val):
        is_val[int(np.argmin(fr))] = True
    if all(is_val):
        is_val[int(np.argmax(fr))] = False
    train = [d for d, v in zip(docs, is_val) if not v]
    val = [d for d, v in zip(docs, is_val) if v]
    return train, val


# ---- tokenizer (trained on the training split, cached) ---------------------------------------
def get_tokenizer(corpus: Corpus, vocab_size: int, *, cache_dir: str | os.PathLike | None = None,
                  val_fraction: float = DEFAULT_VAL_FRACTION, progress: bool = False):
    """The BPE tokenizer for `corpus`: loaded from the cache, or trained on its training split."""
    cache = Path(cache_dir) if cache_dir is not None else fsutil.cache_dir()
    key = _hash_key({"corpus": corpus.fingerprint, "vocab_size": vocab_size, "val_fraction": val_fraction,
                     "specials": list(bpe.SPECIAL_TOKENS), "format": _CACHE_FORMAT})
    path = cache / "tokenizers" / f"{key[:24]}.json"
    if path.is_file():
        return bpe.load_tokenizer(path)
    fsutil.check_writable(path, file=True, mkdir=True)  # before training the tokenizer, not after
    train_docs, _ = split_documents(corpus.documents(), val_fraction)
    tok = bpe.train_bpe(train_docs, vocab_size, progress=progress)
    with fsutil.writing(path):
        fsutil.atomic_write_text(path, tok.to_str(), mkdir=True)
    return tok


# ---- token cache -----------------------------------------------------------------------------
@dataclass
class TokenData:
    """Tokenized train and validation streams (memory-mapped), each document followed by eos."""

    train: np.ndarray  # [N_train] uint16|uint32
    val: np.ndarray  # [N_val]
    eos_id: int
    vocab_size: int
    key: str  # the cache key: identifies corpus + tokenizer + split
    n_docs: tuple[int, int]  # (train, validation)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def prepare_data(corpus: Corpus, tokenizer, *, cache_dir: str | os.PathLike | None = None,
                 val_fraction: float = DEFAULT_VAL_FRACTION, vocabulary: dict | None = None) -> TokenData:
    """Tokenize `corpus` once (cached under cache_dir/tokens/KEY) and memory-map the result.

    vocabulary: the tokenizer header of a borrowed vocabulary (cflow.train.vocab), whose EOS then
    separates documents; None: a trained BPE, separated by its <|eos|>.
    """
    cache = Path(cache_dir) if cache_dir is not None else fsutil.cache_dir()
    vocab_size = tokenizer.get_vocab_size()
    eos_id = tokenizer.token_to_id(bpe.EOS) if vocabulary is None else vocabulary["eos_id"]
    parts = {"corpus": corpus.fingerprint, "tokenizer": bpe.tokenizer_hash(tokenizer),
             "val_fraction": val_fraction, "format": _CACHE_FORMAT}
    if vocabulary is not None:
        # The tokenizer JSON already differs from any trained BPE's; the header also fixes the
        # separator (eos_id), which that JSON does not carry. Trained BPEs keep their old keys.
        from cflow.train.vocab import header_hash

        parts["vocabulary"] = header_hash(vocabulary)
    key = _hash_key(parts)
    entry = cache / "tokens" / key[:24]
    if not (entry / "meta.json").is_file():
        train_docs, val_docs = split_documents(corpus.documents(), val_fraction)
        with fsutil.writing(entry):
            _build_entry(entry, corpus.name, train_docs, val_docs, tokenizer, eos_id)
    return _open_entry(entry, key, eos_id, vocab_size)


def _build_entry(entry: Path, corpus_name: str, train_docs: list[str], val_docs: list[str], tokenizer,
                 eos_id: int) -> None:
    dtype = token_dtype(tokenizer.get_vocab_size())
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=entry.name + ".tmp-", dir=entry.parent))
    try:
        meta = {"corpus": corpus_name, "dtype": dtype.name, "eos_id": eos_id, "format": _CACHE_FORMAT}
        for split, docs in (("train", train_docs), ("val", val_docs)):
            meta[f"{split}_docs"] = len(docs)
            meta[f"{split}_tokens"] = _write_tokens(tmp / f"{split}.bin", docs, tokenizer, dtype, eos_id)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        try:
            os.rename(tmp, entry)
        except OSError:
            if not (entry / "meta.json").is_file():  # not a concurrent writer finishing first: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_tokens(path: Path, docs: list[str], tokenizer, dtype: np.dtype, eos_id: int,
                  chunk: int = 2048) -> int:
    n = 0
    with open(path, "wb") as f:
        for i in range(0, len(docs), chunk):
            encs = tokenizer.encode_batch(docs[i:i + chunk], add_special_tokens=False)
            ids = []
            for e in encs:
                ids.extend(e.ids)
                ids.append(eos_id)
            arr = np.asarray(ids, dtype=dtype)
            f.write(arr.tobytes())
            n += arr.size
    return n


def _open_entry(entry: Path, key: str, eos_id: int, vocab_size: int) -> TokenData:
    try:
        meta = json.loads((entry / "meta.json").read_text())
        dtype = np.dtype(meta["dtype"])
        arrays = []
        for split in ("train", "val"):
            n = int(meta[f"{split}_tokens"])
            p = entry / f"{split}.bin"
            if p.stat().st_size != n * dtype.itemsize:
                raise DataError(f"cached token file {p} has the wrong size; delete {entry} and rerun")
            arrays.append(np.memmap(p, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype))
    except (OSError, KeyError, ValueError) as e:
        raise DataError(f"token cache entry {entry} is unreadable ({e}); delete it and rerun") from None
    return TokenData(arrays[0], arrays[1], eos_id, vocab_size, key, (meta["train_docs"], meta["val_docs"]))


def _hash_key(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


# ---- sampling --------------------------------------------------------------------------------
class BatchSampler:
    """Random windows of `seq_len + 1` tokens; each rank keeps a disjoint slice of the global batch.

    All ranks run the same generator, so the global batch at step s is the same for every world
    size that divides it: a DDP run and a single-process run train on identical data.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int,
                 rank: int = 0, world_size: int = 1) -> None:
        if batch_size % world_size:
            raise DataError(f"global batch size {batch_size} is not divisible by world size {world_size}")
        if len(tokens) < seq_len + 2:
            raise DataError(f"the training split has {len(tokens)} tokens, fewer than seq_len + 2 = {seq_len + 2}; "
                            "use a shorter --seq-len or more data")
        self.tokens = tokens
        self.batch_size, self.seq_len = batch_size, seq_len
        self.rank, self.world_size = rank, world_size
        self.local_batch = batch_size // world_size
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.batches = 0

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        """(x, y), each int64 [B_local, T]; y is x shifted by one token."""
        starts = self.rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)  # [B_global]
        mine = starts[self.rank * self.local_batch:(self.rank + 1) * self.local_batch]  # [B_local]
        self.batches += 1
        win = np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1]) for s in mine]).astype(np.int64)
        return win[:, :-1], win[:, 1:]

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state, "batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.batches = int(state["batches"])


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> np.ndarray:
    """Start offsets of non-overlapping validation windows, evenly spread, at most `max_windows`."""
    n = (len(tokens) - 1) // seq_len
    if n <= 0:
        raise DataError(f"the validation split has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
                        "use a shorter --seq-len, a larger val_fraction or more data")
    picks = np.arange(n) if n <= max_windows else np.linspace(0, n - 1, max_windows).round().astype(np.int64)
    return picks * seq_len  # [W]


def eval_batches(tokens: np.ndarray, starts: np.ndarray, seq_len: int, batch_size: int,
                 rank: int = 0, world_size: int = 1) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (x, y) int64 [b, T] over this rank's share (round robin) of the validation windows."""
    mine = starts[rank::world_size]
    for i in range(0, len(mine), batch_size):
        win = np.stack([np.asarray(tokens[s:s + seq_len + 1]) for s in mine[i:i + batch_size]]).astype(np.int64)
        yield win[:, :-1], win[:, 1:]
