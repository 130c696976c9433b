"""Byte-level BPE tokenizer training (HF `tokenizers`), the tokenizer every trained model ships with.

Owns how a tokenizer is trained, saved, loaded and fingerprinted for the training pipeline.
Choices, and why:
- GPT-2 style byte level: the ByteLevel pre-tokenizer (add_prefix_space=False, so encoding never
  invents a leading space) maps every byte to a printable symbol, and the ByteLevel decoder maps
  it back; the initial alphabet holds all 256 byte symbols, so any text - accents, CJK, emoji,
  control characters, NUL - encodes without an unknown token and decodes to itself exactly.
- No normalizer: a normalizer (NFC, lowercase) would break the exact round trip.
- Special tokens `<|bos|>` (id 0) and `<|eos|>` (id 1) come first, so their ids do not depend
  on the corpus; `<|eos|>` separates documents in the training stream.
- Training is deterministic for a given corpus and settings, which lets the data cache key on
  the tokenizer's JSON hash.

This module does not import torch.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable

from cflow.tokenizer import TokenizerError  # the one tokenizer error, shared with the runtime

BOS = "<|bos|>"
EOS = "<|eos|>"
SPECIAL_TOKENS = (BOS, EOS)
DEFAULT_VOCAB_SIZE = 4096
# 256 byte symbols plus the special tokens: the smallest vocabulary that can encode everything.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


def _tokenizers():
    try:
        import tokenizers  # noqa: F401 - a hard dependency, but say so clearly if missing
    except ImportError:  # pragma: no cover - installed with cflow
        raise TokenizerError("the HF `tokenizers` package is missing: pip install tokenizers") from None
    return tokenizers


def train_bpe(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, *,
              min_frequency: int = 2, progress: bool = False):
    """Train a byte-level BPE on `texts`; returns a `tokenizers.Tokenizer`.

    The result may hold fewer than `vocab_size` tokens when the corpus runs out of pairs seen at
    least `min_frequency` times; callers size the model from `tok.get_vocab_size()`.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise TokenizerError(f"vocab_size must be at least {MIN_VOCAB_SIZE} (256 bytes + special tokens), "
                             f"got {vocab_size}")
    tk = _tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tk.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(texts, trainer)
    _check_specials(tok)
    return tok


def _check_specials(tok) -> None:
    for s in SPECIAL_TOKENS:
        if tok.token_to_id(s) is None:
            raise TokenizerError(f"tokenizer lacks the special token {s!r}; retrain it with cflow.train.bpe")


def save_tokenizer(tok, path: str | Path) -> None:
    Path(path).write_text(tok.to_str(), encoding="utf-8")


def load_tokenizer(path: str | Path):
    """Load a tokenizer.json written by `save_tokenizer` (or any byte-level BPE with our specials)."""
    tk = _tokenizers()
    p = Path(path)
    if not p.is_file():
        raise TokenizerError(f"tokenizer file {p} does not exist")
    try:
        tok = tk.Tokenizer.from_str(p.read_text(encoding="utf-8"))
    except Exception as e:  # the Rust side raises a bare Exception on malformed JSON
        raise TokenizerError(f"{p} is not a valid HF tokenizers JSON file: {e}") from None
    _check_specials(tok)
    return tok


def tokenizer_from_str(text: str):
    tk = _tokenizers()
    tok = tk.Tokenizer.from_str(text)
    _check_specials(tok)
    return tok


def tokenizer_hash(tok) -> str:
    """SHA-256 of the tokenizer's JSON: the tokenizer part of the data cache key."""
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def decode(tok, ids: list[int]) -> str:
    # Special tokens are kept so that decode(encode(s)) == s even when s spells one out.
    return tok.decode(ids, skip_special_tokens=False)
