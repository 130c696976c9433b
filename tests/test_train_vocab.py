"""`cflow train --tokenizer FILE` (cflow.train.vocab): training with SmolLM2's vocabulary, for a draft model.

- The ids in the training stream are the engine's ids for the target (and llama.cpp's on tricky
  text), document for document; a wrong pre-tokenizer (the control) gives other ids.
- The loss of a few steps falls; a resumed run keeps the checkpoint's vocabulary.
- The export carries the target's vocabulary token for token, the engine accepts it as the
  target's draft, and speculative greedy decoding is plain greedy decoding; without the stored
  vocabulary (the control) the export is refused by name.
- The token cache keys on the tokenizer: a borrowed vocabulary never shares an entry with a
  trained BPE's, nor with a header that separates documents differently.
- Bad input: --vocab-size with --tokenizer, a missing file, a file of no known kind, a GGUF
  without a tokenizer, each a named error.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from cflow.cli import main
from cflow.config import ModelConfig
from cflow.convert.checkpoint import CheckpointFormatError, read_checkpoint
from cflow.runtime import Engine, Speculative
from cflow.tokenizer import Tokenizer
from cflow.train import data as tdata
from cflow.train import vocab
from cflow.train.loop import TrainConfig, TrainError, train
from test_cli import cflow, one_error_line

gguf = pytest.importorskip("gguf")

# Text the ids must agree on: whitespace runs, digits, CJK, emoji, code, special tokens, accents.
VARIED = [
    "Once upon a time, a little fox found 12345 shiny stones.   Then    it ran!\n\n\tThe end.",
    "日本語のテキスト、中文 and 한국어 with emoji 😀👍🏽 and ½ x² ٣٤٥",
    "def f(x):\n    return x**2  # square\n\nprint(f(10_000))\r\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>",
    "I'm sure they'll say THEY'RE fine, won't they? École, naïve café — “quotes” …",
]
TINY_DRAFT = dict(d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=128, max_seq_len=256)


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> str:
    docs = tdata.open_corpus(None).documents()[:40] + VARIED * 4
    p = tmp_path_factory.mktemp("corpus") / "tiny.jsonl"
    p.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(p)


@pytest.fixture(scope="module")
def header(smollm2_gguf) -> dict:
    return vocab.read_vocabulary(smollm2_gguf)


@pytest.fixture(scope="module")
def trained(smollm2_gguf, corpus_file, tmp_path_factory):
    """A tiny model trained 30 steps with SmolLM2's vocabulary, and its export."""
    d = tmp_path_factory.mktemp("draft")
    tc = TrainConfig(steps=30, batch_size=4, seq_len=32, lr=1e-2, warmup=2, eval_every=0, eval_windows=4,
                     log_every=1, data=corpus_file, tokenizer=str(smollm2_gguf), threads=1,
                     cache_dir=str(d / "cache"))
    res = train(ModelConfig.from_name("draft-smollm2", **TINY_DRAFT), tc, out_dir=d / "ck")
    assert main(["export", str(d / "ck"), str(d / "draft.cflow"), "-q"]) == 0
    return res, d, tc


def test_training_ids_are_the_engine_ids_of_the_target(smollm2_converted, header, corpus_file, tmp_path):
    data = tdata.prepare_data(tdata.open_corpus(corpus_file), vocab.training_tokenizer(header),
                              cache_dir=tmp_path, vocabulary=header)
    target = Engine.load(smollm2_converted, threads=1, n_ctx=64)
    train_docs, val_docs = tdata.split_documents(tdata.open_corpus(corpus_file).documents())
    eos = target.tokenizer.eos_id
    for stream, docs in ((data.train, train_docs), (data.val, val_docs)):
        want = [i for doc in docs for i in target.tokenizer.encode(doc, add_bos=False) + [eos]]
        assert np.asarray(stream).tolist() == want
    assert data.eos_id == eos == target.tokenizer.special["<|im_end|>"] and data.vocab_size == 49152
    # the controls: the same vocabulary with another split (Llama 3's), and the BPE `cflow train`
    # trains without --tokenizer, give other ids
    text = "".join(VARIED)
    other_split = Tokenizer({**header, "pre": "llama3"}).encode(text, add_bos=False)
    trained_bpe = tdata.get_tokenizer(tdata.open_corpus(corpus_file), 320, cache_dir=tmp_path)
    for ids in (other_split, trained_bpe.encode(text, add_special_tokens=False).ids):
        assert ids != target.tokenizer.encode(text, add_bos=False)
    target.close()


@pytest.mark.oracle
def test_exported_draft_tokenizes_as_llama_cpp(trained, smollm2_gguf):
    from test_tokenizer_gguf import BPE_TRICKY, llama_cpp_or_skip

    llama_cpp = llama_cpp_or_skip()
    _, d, _ = trained
    llm = llama_cpp.Llama(model_path=str(smollm2_gguf), vocab_only=True, verbose=False)
    draft = Engine.load(d / "draft.cflow", threads=1)
    for text in VARIED + BPE_TRICKY:
        assert draft.tokenizer.encode(text, add_bos=False) == llm.tokenize(text.encode(), add_bos=False,
                                                                            special=True), text
    draft.close()


def test_loss_falls_and_the_checkpoint_keeps_the_vocabulary(trained, header):
    res, d, _ = trained
    losses = [r["loss"] for r in res.history]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0, losses
    assert res.config.vocab_size == 49152
    assert json.loads((d / "ck" / vocab.VOCABULARY_NAME).read_text()) == header


def test_resume_keeps_the_checkpoints_vocabulary(smollm2_gguf, corpus_file, tmp_path):
    tc = TrainConfig(steps=4, batch_size=2, seq_len=16, warmup=1, eval_every=0, eval_windows=2, data=corpus_file,
                     tokenizer=str(smollm2_gguf), threads=1, cache_dir=str(tmp_path / "cache"))
    cfg = ModelConfig.from_name("draft-smollm2", **TINY_DRAFT)
    train(cfg, tc, out_dir=tmp_path / "ck", until_step=2)
    res = train(cfg, tc, out_dir=tmp_path / "ck", resume=True)
    assert res.steps == 4 and vocab.read_vocabulary_file(tmp_path / "ck") is not None


def test_draft_is_accepted_and_speculative_greedy_is_plain_greedy(trained, smollm2_converted, header):
    _, d, _ = trained
    _, _, tok = read_checkpoint(d / "ck")
    assert tok == Tokenizer(header).to_header()
    target = Engine.load(smollm2_converted, threads=1, n_ctx=256)
    draft = Engine.load(d / "draft.cflow", threads=1)
    assert draft.tokenizer.vocab == target.tokenizer.vocab and draft.config.vocab_size == 49152
    for prompt in ("Once upon a time, there was a little", "def add(a, b):\n    return"):
        plain = target.complete(prompt, 24, temperature=0)
        got = target.complete(prompt, 24, temperature=0, speculative=Speculative(draft=draft, min_acceptance=0))
        assert got.tokens == plain.tokens and got.text == plain.text
        assert got.timings.spec == "draft" and got.timings.drafted > 0
    draft.close()
    target.close()


def test_export_without_the_stored_vocabulary_is_refused(trained, tmp_path):
    """The control: the checkpoint's tokenizer.json alone (the engine's split as HF Split regexes) is
    not a tokenizer.json export can rebuild, so dropping vocabulary.json fails by name."""
    _, d, _ = trained
    ck = tmp_path / "ck"
    shutil.copytree(d / "ck", ck)
    (ck / vocab.VOCABULARY_NAME).unlink()
    with pytest.raises(CheckpointFormatError, match="tokenizer.json"):
        read_checkpoint(ck)


def test_token_cache_keys_on_the_tokenizer(trained, header, corpus_file):
    _, d, tc = trained
    corpus = tdata.open_corpus(corpus_file)
    borrowed = tdata.prepare_data(corpus, vocab.training_tokenizer(header), cache_dir=tc.cache_dir,
                                  vocabulary=header)
    bpe = tdata.get_tokenizer(corpus, 320, cache_dir=tc.cache_dir)
    own = tdata.prepare_data(corpus, bpe, cache_dir=tc.cache_dir)
    other_eos = {**header, "eos_id": 0}
    separated = tdata.prepare_data(corpus, vocab.training_tokenizer(other_eos), cache_dir=tc.cache_dir,
                                   vocabulary=other_eos)
    assert len({borrowed.key, own.key, separated.key}) == 3
    assert len(list((Path(tc.cache_dir) / "tokens").iterdir())) == 3
    assert borrowed.eos_id == 2 and separated.eos_id == 0 and int(separated.train[-1]) == 0
    assert own.vocab_size == 320 and borrowed.vocab_size == 49152


def _gguf_without_tokenizer(path: Path) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_tokenizer_files_are_named(tmp_path, smollm2_gguf):
    with pytest.raises(vocab.VocabularyError, match="no such file"):
        vocab.read_vocabulary(tmp_path / "missing.gguf")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(vocab.VocabularyError, match="neither a GGUF"):
        vocab.read_vocabulary(tmp_path / "weights.bin")
    with pytest.raises(vocab.VocabularyError, match="carries no tokenizer"):
        vocab.read_vocabulary(_gguf_without_tokenizer(tmp_path / "bare.gguf"))
    (tmp_path / "bad.json").write_text('{"model": {"type": "Unigram"}}')
    with pytest.raises(vocab.VocabularyError, match="byte-level BPE"):
        vocab.read_vocabulary(tmp_path / "bad.json")
    with pytest.raises(TrainError, match="drop --vocab-size"):
        TrainConfig(tokenizer=str(smollm2_gguf), vocab_size=4096)
    from test_tokenizer_gguf import write_vocab_gguf

    spm = write_vocab_gguf(tmp_path / "spm.gguf", "llama", ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
                           + ["▁a"], [2, 3, 3] + [6] * 256 + [1], scores=[0.0] * 259 + [-1.0])
    with pytest.raises(vocab.VocabularyError, match="SentencePiece-style"):
        vocab.read_vocabulary(spm)


def test_an_hf_tokenizer_json_is_a_vocabulary_too(corpus_file, tmp_path):
    from cflow.train import bpe

    hf = bpe.train_bpe(tdata.open_corpus(corpus_file).documents(), 300)
    bpe.save_tokenizer(hf, tmp_path / "tokenizer.json")
    header = vocab.read_vocabulary(tmp_path / "tokenizer.json")
    assert header["eos_id"] == hf.token_to_id(bpe.EOS) and len(header["vocab"]) == hf.get_vocab_size()
    for text in VARIED:
        assert vocab.training_tokenizer(header).encode(text, add_special_tokens=False).ids == \
            hf.encode(text, add_special_tokens=False).ids


def test_cli_names_the_errors_and_documents_the_flag(tmp_path, smollm2_gguf):
    r = cflow("train", "--tokenizer", str(smollm2_gguf), "--vocab-size", "4096", "--out", str(tmp_path / "x"))
    assert r.returncode != 0 and one_error_line(r.stderr, "--vocab-size")
    r = cflow("train", "--tokenizer", str(_gguf_without_tokenizer(tmp_path / "bare.gguf")), "--steps", "1",
              "--out", str(tmp_path / "y"), "--cache-dir", str(tmp_path / "c"))
    assert r.returncode != 0 and one_error_line(r.stderr, "carries no tokenizer")
    r = cflow("train", "--help")
    assert r.returncode == 0 and "--tokenizer FILE" in r.stdout and "draft-smollm2" in r.stdout
