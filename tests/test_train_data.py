"""cflow.train.data and cflow.train.bpe: sources, split, tokenizer round trip, token cache, sampler."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cflow import fsutil
from cflow.train import bpe
from cflow.train import data as tdata
from cflow.train.data import BatchSampler, DataError

N_DOCS = 150  # documents of the shipped corpus used by these tests
VOCAB = 320


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return tdata.open_corpus(None).documents()[:N_DOCS]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory, docs) -> str:
    p = tmp_path_factory.mktemp("corpus") / "tiny.jsonl"
    p.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(p)


@pytest.fixture(scope="module")
def tok(docs):
    return bpe.train_bpe(docs, VOCAB)


# ---- sources ---------------------------------------------------------------------------------
def test_shipped_corpus_is_the_default():
    c = tdata.open_corpus(None)
    d = c.documents()
    assert len(d) == 2978
    assert all(isinstance(t, str) and t.strip() for t in d[:50])
    assert c.fingerprint.startswith("sha256:")


def test_txt_documents_are_separated_by_blank_lines(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text("first doc\nline two\n\n\n  \nsecond doc\n\nthird\n")
    assert tdata.open_corpus(p).documents() == ["first doc\nline two", "second doc", "third"]


def test_bad_sources_raise_named_errors(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="neither 'tinystories' nor an existing file"):
        tdata.open_corpus(tmp_path / "missing.txt")
    (tmp_path / "c.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported data file type"):
        tdata.open_corpus(tmp_path / "c.csv")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"title": "no text"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: each line needs a string 'text'"):
        tdata.open_corpus(bad).documents()
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        tdata.open_corpus(bad).documents()
    with pytest.raises(DataError, match="tinystories:N"):
        tdata.open_corpus("tinystories:lots")
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(DataError, match="pip install datasets"):
        tdata.open_corpus("tinystories:10").documents()


# ---- split -----------------------------------------------------------------------------------
def test_split_is_deterministic_by_document_and_order_free(docs):
    train, val = tdata.split_documents(docs, 0.1)
    assert tdata.split_documents(docs, 0.1) == (train, val)
    assert sorted(train + val) == sorted(docs) and not set(train) & set(val)
    assert 0.03 * len(docs) < len(val) < 0.2 * len(docs)
    shuffled = docs[:]
    random.Random(0).shuffle(shuffled)
    train2, val2 = tdata.split_documents(shuffled, 0.1)
    assert set(val2) == set(val) and set(train2) == set(train)
    # Removing documents never moves the others across the split.
    _, val3 = tdata.split_documents(docs[: len(docs) // 2], 0.1)
    assert set(val3) == set(val) & set(docs[: len(docs) // 2])


def test_split_of_tiny_corpora_keeps_both_sides():
    train, val = tdata.split_documents(["a story", "another story"], 0.01)
    assert len(train) == 1 and len(val) == 1
    with pytest.raises(DataError, match="at least 2"):
        tdata.split_documents(["alone"], 0.05)
    with pytest.raises(DataError, match="val_fraction"):
        tdata.split_documents(["a", "b"], 1.5)


# ---- tokenizer -------------------------------------------------------------------------------
ODD = [
    "", " ", "  leading and trailing  ", "tab\there\nnewline\r\ncrlf", "\x00\x01\x02\x7f nul and controls",
    "héllo wörld ñ ç ø", "日本語のテキスト、中文", "emoji 🎉🦀👩‍👩‍👧 flags 🇪🇸", "combining e\u0301 a\u0308",
    "zero\u200bwidth\ufeffbom", "math ∑∫√ and arrows → ⇒", "<|eos|> spelled out <|bos|>", "\U0010fffd last plane",
]


@pytest.mark.parametrize("text", ODD)
def test_tokenizer_round_trip_unicode_and_odd_bytes(tok, text):
    ids = bpe.encode(tok, text)
    assert bpe.decode(tok, ids) == text
    assert all(0 <= i < tok.get_vocab_size() for i in ids)


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=60))
def test_tokenizer_round_trip_any_text(tok, text):
    assert bpe.decode(tok, bpe.encode(tok, text)) == text


def test_tokenizer_training_is_deterministic_and_sized(docs, tok, tmp_path):
    assert tok.token_to_id(bpe.BOS) == 0 and tok.token_to_id(bpe.EOS) == 1
    assert tok.get_vocab_size() == VOCAB
    again = bpe.train_bpe(docs, VOCAB)
    assert bpe.tokenizer_hash(again) == bpe.tokenizer_hash(tok)
    # Even 62 merges compress English (no merges would give one token per byte).
    assert len(bpe.encode(tok, docs[0])) < 0.75 * len(docs[0].encode())
    bpe.save_tokenizer(tok, tmp_path / "t.json")
    assert bpe.tokenizer_hash(bpe.load_tokenizer(tmp_path / "t.json")) == bpe.tokenizer_hash(tok)
    with pytest.raises(bpe.TokenizerError, match="at least 258"):
        bpe.train_bpe(docs, 100)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(bpe.TokenizerError, match="not a valid"):
        bpe.load_tokenizer(tmp_path / "bad.json")


# ---- token cache -----------------------------------------------------------------------------
def test_token_cache_layout_hit_and_invalidation(corpus_file, docs, tok, tmp_path, monkeypatch):
    corpus = tdata.open_corpus(corpus_file)
    data = tdata.prepare_data(corpus, tok, cache_dir=tmp_path, val_fraction=0.1)
    assert data.train.dtype == np.uint16 and isinstance(data.train, np.memmap)
    train_docs, val_docs = tdata.split_documents(docs, 0.1)
    assert data.n_docs == (len(train_docs), len(val_docs))
    # The stream is the documents in order, each followed by <|eos|>.
    ids = np.asarray(data.val).tolist()
    assert ids.count(data.eos_id) == len(val_docs) and ids[-1] == data.eos_id
    pieces, cur = [], []
    for i in ids:
        if i == data.eos_id:
            pieces.append(bpe.decode(tok, cur))
            cur = []
        else:
            cur.append(i)
    assert pieces == val_docs

    # A second call is a cache hit: nothing is re-tokenized.
    monkeypatch.setattr(tdata, "_build_entry", lambda *a: pytest.fail("cache miss on unchanged inputs"))
    again = tdata.prepare_data(tdata.open_corpus(corpus_file), tok, cache_dir=tmp_path, val_fraction=0.1)
    assert again.key == data.key and np.array_equal(again.train, data.train)
    monkeypatch.undo()

    # Changing the data, the tokenizer or the split changes the key.
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:-1]))
    assert tdata.prepare_data(tdata.open_corpus(other), tok, cache_dir=tmp_path, val_fraction=0.1).key != data.key
    tok2 = bpe.train_bpe(docs, VOCAB - 7)
    assert tdata.prepare_data(corpus, tok2, cache_dir=tmp_path, val_fraction=0.1).key != data.key
    assert tdata.prepare_data(corpus, tok, cache_dir=tmp_path, val_fraction=0.2).key != data.key
    assert not list((tmp_path / "tokens").glob("*.tmp-*"))  # no temporaries left behind


def test_tokenizer_cache(corpus_file, tmp_path, monkeypatch):
    corpus = tdata.open_corpus(corpus_file)
    t1 = tdata.get_tokenizer(corpus, VOCAB, cache_dir=tmp_path)
    monkeypatch.setattr(bpe, "train_bpe", lambda *a, **k: pytest.fail("tokenizer retrained"))
    t2 = tdata.get_tokenizer(tdata.open_corpus(corpus_file), VOCAB, cache_dir=tmp_path)
    assert bpe.tokenizer_hash(t1) == bpe.tokenizer_hash(t2)


def test_cache_dir_follows_environment(corpus_file, tok, tmp_path, monkeypatch):
    # Without a cache_dir, tokenizers and tokens go where every cflow cache goes: fsutil.cache_dir().
    monkeypatch.setenv("CFLOW_CACHE", str(tmp_path / "c"))
    assert fsutil.cache_dir() == tmp_path / "c"
    corpus = tdata.open_corpus(corpus_file)
    tdata.get_tokenizer(corpus, VOCAB)
    data = tdata.prepare_data(corpus, tok)
    assert len(list((tmp_path / "c" / "tokenizers").glob("*.json"))) == 1
    assert (tmp_path / "c" / "tokens" / data.key[:24] / "meta.json").is_file()
    monkeypatch.delenv("CFLOW_CACHE")
    assert fsutil.cache_dir().parts[-2:] == (".cache", "cflow")


@pytest.mark.parametrize("where", ["proc", "under-a-file"])
def test_unwritable_cache_fails_before_any_tokenizing(corpus_file, tok, tmp_path, monkeypatch, where):
    # Both fail for root too (chmod would not stop it).
    if where == "proc":
        cache, reason = Path("/proc/cflow-test"), "No such file or directory"
    else:
        (tmp_path / "a-file").write_text("a regular file: nothing can be created under it")
        cache, reason = tmp_path / "a-file" / "cache", "Not a directory"
    corpus = tdata.open_corpus(corpus_file)
    monkeypatch.setattr(bpe, "train_bpe", lambda *a, **k: pytest.fail("trained a tokenizer it cannot keep"))
    with pytest.raises(fsutil.WriteError, match=rf"^cannot write {cache}/tokenizers/\w+\.json: {reason}$"):
        tdata.get_tokenizer(corpus, VOCAB, cache_dir=cache)
    monkeypatch.setattr(tdata, "_write_tokens", lambda *a, **k: pytest.fail("tokenized into a cache it cannot write"))
    with pytest.raises(fsutil.WriteError, match=rf"^cannot write {cache}/tokens/\w+: {reason}$"):
        tdata.prepare_data(corpus, tok, cache_dir=cache)


# ---- sampler ---------------------------------------------------------------------------------
def _stream(n: int = 1003) -> np.ndarray:
    return (np.arange(n) * 7 % 997).astype(np.uint16)


def test_sampler_windows_are_shifted_pairs():
    toks = _stream()
    s = BatchSampler(toks, batch_size=5, seq_len=13, seed=3)
    x, y = s.next()
    assert x.shape == y.shape == (5, 13) and x.dtype == np.int64
    assert np.array_equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x, y):
        start = np.flatnonzero(toks == row_x[0])  # values are distinct: the position is unique
        assert np.array_equal(toks[start[0]:start[0] + 14], np.r_[row_x, row_y[-1]])


def test_sampler_state_restores_exactly():
    toks = _stream()
    a = BatchSampler(toks, 4, 9, seed=11)
    for _ in range(3):
        a.next()
    state = a.state_dict()
    expected = [a.next() for _ in range(4)]
    b = BatchSampler(toks, 4, 9, seed=999)
    b.load_state_dict(state)
    got = [b.next() for _ in range(4)]
    for (xe, ye), (xg, yg) in zip(expected, got):
        assert np.array_equal(xe, xg) and np.array_equal(ye, yg)
    assert b.batches == a.batches == 7
    c = BatchSampler(toks, 4, 9, seed=12)
    for _ in range(3):
        c.next()
    assert not np.array_equal(c.next()[0], expected[0][0])  # the seed matters


def test_sampler_ranks_take_disjoint_slices_of_the_global_batch():
    toks = _stream()
    single = BatchSampler(toks, 6, 8, seed=5)
    ranks = [BatchSampler(toks, 6, 8, seed=5, rank=r, world_size=3) for r in range(3)]
    for _ in range(3):
        x, _ = single.next()
        parts = [r.next()[0] for r in ranks]
        assert all(p.shape == (2, 8) for p in parts)
        assert np.array_equal(np.concatenate(parts), x)
    with pytest.raises(DataError, match="not divisible"):
        BatchSampler(toks, 5, 8, seed=5, rank=0, world_size=2)
    with pytest.raises(DataError, match="fewer than seq_len"):
        BatchSampler(toks[:10], 2, 9, seed=5)


@pytest.mark.parametrize("n,max_w", [(1003, 5), (1003, 1000), (34, 8), (17, 3)])
def test_eval_windows_cover_evenly_without_overlap(n, max_w):
    T = 16
    starts = tdata.eval_windows(np.zeros(n), T, max_w)
    full = (n - 1) // T
    assert len(starts) == min(full, max_w)
    assert np.all(np.diff(starts) >= T) and starts[0] == 0 and starts[-1] + T + 1 <= n
    if full > max_w:
        assert starts[-1] == (full - 1) * T  # spread to the end, not just the first windows
    batches = list(tdata.eval_batches(np.arange(n), starts, T, 3, rank=1, world_size=2))
    assert sum(len(x) for x, _ in batches) == len(starts[1::2])


def test_eval_windows_error_on_tiny_validation():
    with pytest.raises(DataError, match="validation split"):
        tdata.eval_windows(np.zeros(10), 16, 4)
