"""Gemma 4's vocabularies (GGUF `tokenizer.ggml.model = "gemma4"`): SentencePiece-spelled pieces
merged by BPE ranks. The header fields they add, and their encoder.

Owns what a `"model": "gemma4"` tokenizer header holds beyond the common keys (`token_types`;
docs/FORMAT.md), its validation and the HF `tokenizers` model built from it. `cflow.tokenizer`
(the runtime Tokenizer) dispatches here on the header's model; decoding is SentencePiece's
(`cflow.tokenizer_spm.spm_token_bytes`): the pieces are spelled alike.

What llama.cpp does (src/llama-vocab.cpp: a BPE vocabulary with the "gemma4" pre-tokenizer and
byte_encode off), and how we reproduce it:
- Spaces become "▁" (U+2581) before anything else, no space prefix. HF: normalizer Replace.
- The text is cut into runs of newlines and runs of anything else (`[^\\n]+|[\\n]+`), so no merge
  spans a newline boundary. HF: pre-tokenizer Split on "\\n+", isolated.
- Within a run, characters (not GPT-2's byte alphabet) merge by the rank of `tokenizer.ggml.merges`,
  lowest first, leftmost on ties. HF BPE over the merges as given.
- A character that is not a token becomes its UTF-8 bytes as <0x00>..<0xFF> (byte fallback).
- BOS is added unless the file says otherwise.
"""

from __future__ import annotations

from typing import Any

from cflow import tokenizer_spm as spm


def split_merge(m: str, error: type[Exception]) -> tuple[str, str]:
    """A merge "left right" split as llama.cpp does: at the first space after the first character
    (so a left piece may itself be a space)."""
    k = m.find(" ", 1)
    if k < 0 or k == len(m) - 1:
        raise error(f"merge {m!r} is not two tokens separated by a space")
    return m[:k], m[k + 1:]


def validate_gemma4(h: dict[str, Any], error: type[Exception]) -> None:
    """Raise `error` unless the gemma4-only fields of header `h` are consistent with its vocab."""
    vocab, types = h["vocab"], h.get("token_types")
    n = len(vocab)
    if not (isinstance(types, list) and len(types) == n
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= spm.BYTE for t in types)):
        raise error(f"a gemma4 tokenizer needs 'token_types': {n} llama.cpp token types (0..6), one per "
                    "token; re-convert the model")
    if not h["merges"]:
        raise error("a gemma4 tokenizer needs its 'merges' (BPE ranks); re-convert the model")
    if h["pre"] is not None:
        raise error("a gemma4 tokenizer has no 'pre' (its newline split is fixed); write null")
    ids = set(vocab)
    for m in h["merges"]:
        left, right = split_merge(m, error)
        if left not in ids or right not in ids or left + right not in ids:
            raise error(f"merge {m!r} joins pieces that are not all tokens of the vocabulary")
    missing = [spm.byte_token(b) for b in range(256) if spm.byte_token(b) not in ids]
    if missing:
        raise error(f"this gemma4 vocabulary lacks the byte-fallback tokens {missing[:4]}"
                    f"{' ...' if len(missing) > 4 else ''} ({len(missing)} of 256); cflow needs all "
                    "<0x00>..<0xFF> to encode characters outside the vocabulary")


def build_gemma4(h: dict[str, Any], error: type[Exception]):
    """The HF `tokenizers` Tokenizer (model, normalizer, pre-tokenizer; no added tokens yet) of
    header `h`."""
    from tokenizers import Regex, Tokenizer as HFTokenizer, models, normalizers, pre_tokenizers

    vocab = h["vocab"]
    model = models.BPE(vocab={t: i for i, t in enumerate(vocab)},
                       merges=[split_merge(m, error) for m in h["merges"]], fuse_unk=False, byte_fallback=True)
    tk = HFTokenizer(model)
    tk.normalizer = normalizers.Replace(" ", spm.SPACE)
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")
    return tk
