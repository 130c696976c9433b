"""Borrowed vocabularies: training with an existing model's tokenizer instead of a new BPE.

Owns `cflow train --tokenizer FILE`: reading the vocabulary of a GGUF file or an HF
`tokenizer.json` into the tokenizer header of a `.cflow` file (docs/FORMAT.md), and the tokenizer
the training pipeline encodes with. Why a header and not a tokenizers JSON: a draft model for
speculative decoding must produce exactly the ids the engine produces for its target, and the
engine tokenizes a GGUF through `cflow.tokenizer.Tokenizer(header)` (which matches llama.cpp,
pre-tokenizer regexes included). Training through that same object makes the ids equal by
construction; the header is stored in the checkpoint (`vocabulary.json`, cflow.train.checkpoint)
and `cflow export` writes it unchanged, so the exported draft's vocabulary is the target's, token
for token, which is what the engine's draft check compares.

Documents in the training stream are separated by the vocabulary's EOS token (SmolLM2: <|im_end|>,
the token its chat answers end with) instead of the trained BPE's <|eos|>.

No torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from cflow.tokenizer import Tokenizer, TokenizerError


VOCABULARY_NAME = "vocabulary.json"  # the header's file in a checkpoint directory (cflow.train.checkpoint)


class VocabularyError(TokenizerError):
    """A --tokenizer file is missing, of an unknown kind, or carries no usable vocabulary."""


def read_vocabulary(path: str | os.PathLike) -> dict[str, Any]:
    """The tokenizer header of a GGUF model or an HF tokenizer.json, validated by cflow.tokenizer."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise VocabularyError(f"--tokenizer {p}: no such file; give a GGUF model (its tokenizer.ggml.* keys) or an "
                              "HF tokenizer.json")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        header = _gguf_header(p)
    elif p.suffix == ".json":
        from cflow.convert.hf_tokenizer import hf_json_to_header

        try:
            header = hf_json_to_header(p)
        except TokenizerError as e:
            raise VocabularyError(f"--tokenizer {p}: {e}") from None
    else:
        raise VocabularyError(f"--tokenizer {p} is neither a GGUF file (it does not start with b'GGUF') nor a "
                              ".json tokenizer file")
    if header["eos_id"] is None:
        raise VocabularyError(f"--tokenizer {p}: the vocabulary names no EOS token, which training needs to separate "
                              "documents")
    Tokenizer(header)  # validate now, not after the corpus is read
    return header


def _gguf_header(p: Path) -> dict[str, Any]:
    from cflow.convert.gguf import GGUFModel, gguf_tokenizer

    g = GGUFModel(p)
    if g.get("tokenizer.ggml.model") is None:
        raise VocabularyError(f"--tokenizer {p}: this GGUF file carries no tokenizer (no tokenizer.ggml.model key); "
                              "use the GGUF of a full model")
    try:
        header = gguf_tokenizer(g)
    except TokenizerError as e:
        raise VocabularyError(f"--tokenizer {p}: {e}") from None
    if header["model"] != "bpe":
        raise VocabularyError(f"--tokenizer {p}: its vocabulary is SentencePiece-style ('spm'); training supports "
                              "byte-level BPE vocabularies (GGUF 'gpt2') only")
    return header


def header_hash(header: dict[str, Any]) -> str:
    """SHA-256 of the header's canonical JSON: identifies a borrowed vocabulary (data cache key)."""
    return hashlib.sha256(json.dumps(header, sort_keys=True).encode("utf-8")).hexdigest()


def training_tokenizer(header: dict[str, Any]):
    """The HF `tokenizers` object the engine's Tokenizer encodes with, for the data pipeline.

    Encoding with it (add_special_tokens=False) is exactly `cflow.tokenizer.Tokenizer(header).encode`
    without BOS, so training sees the engine's ids; its JSON (to_str) is the checkpoint's tokenizer.json.
    """
    return Tokenizer(header).hf


def read_vocabulary_file(checkpoint_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The borrowed vocabulary's header stored in a checkpoint directory, or None when it trained its own BPE."""
    f = Path(checkpoint_dir) / VOCABULARY_NAME
    if not f.is_file():
        return None
    try:
        header = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise VocabularyError(f"{f} is unreadable ({e}); the checkpoint is damaged") from None
    if not isinstance(header, dict):
        raise VocabularyError(f"{f} is not a tokenizer header (a JSON object); the checkpoint is damaged")
    return header
