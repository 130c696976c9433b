"""SentencePiece-style vocabularies (GGUF `tokenizer.ggml.model = "llama"`: Llama 2, Mistral,
Mixtral, TinyLlama): the header fields they add, and their encoder and decoder.

Owns what a `"model": "spm"` tokenizer header holds beyond the common keys (`scores`,
`token_types`, `add_space_prefix`; docs/FORMAT.md), its validation, the merges its scores imply,
the HF `tokenizers` model built from them, and the bytes each id decodes to. `cflow.tokenizer`
(the runtime Tokenizer) dispatches here on the header's model.

What llama.cpp does (src/llama-vocab.cpp, llm_tokenizer_spm), and how we reproduce it:
- Spaces become "▁" and, with add_space_prefix, each stretch of text between special tokens gets
  one "▁" in front. HF: normalizers Prepend("▁") + Replace(" ", "▁"), which run on each stretch
  between added tokens; no pre-tokenizer, the stretch is one word.
- Starting from characters, the adjacent pair whose concatenation is a token with the highest
  score merges first (ties: leftmost). HF BPE merges by rank, leftmost first, so the merges are
  every split (left, right) of a token into two tokens, ranked by the token's score, highest
  first; ties between different tokens of one score are ordered by id (llama.cpp would take the
  leftmost; real vocabularies give every merged piece its own score).
- A character that is not a token becomes its UTF-8 bytes as the tokens <0x00>..<0xFF> (byte
  fallback; HF: byte_fallback=True). We require all 256: without them llama.cpp aborts on such text.
- Decoding (llama.cpp's token_to_piece): a normal token is its text with "▁" as a space, a byte
  token its byte, control/unknown/user-defined tokens their text, unused tokens nothing.
"""

from __future__ import annotations

import re
from typing import Any

# llama.cpp's token types (tokenizer.ggml.token_type)
UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(7)
SPACE = "\u2581"  # "▁", SentencePiece's space
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_token(b: int) -> str:
    """The text of byte b's fallback token, as llama.cpp and HF look it up: <0x0A>."""
    return f"<0x{b:02X}>"


def validate_spm(h: dict[str, Any], error: type[Exception]) -> None:
    """Raise `error` unless the spm-only fields of header `h` are consistent with its vocab."""
    vocab, scores, types = h["vocab"], h.get("scores"), h.get("token_types")
    n = len(vocab)
    if not (isinstance(scores, list) and len(scores) == n
            and all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores)):
        raise error(f"an spm tokenizer needs 'scores': {n} numbers, one per token; re-convert the model")
    if not (isinstance(types, list) and len(types) == n
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= BYTE for t in types)):
        raise error(f"an spm tokenizer needs 'token_types': {n} llama.cpp token types (0..6), one per "
                    "token; re-convert the model")
    if not isinstance(h.get("add_space_prefix"), bool):
        raise error("an spm tokenizer needs 'add_space_prefix': true or false")
    if len(set(vocab)) != n:
        seen: set[str] = set()  # the first duplicate, for the message
        dup = next(t for t in vocab if t in seen or seen.add(t))
        raise error(f"token {dup!r} appears twice in the vocabulary (llama.cpp refuses this too)")
    for i, t in enumerate(types):
        if t == BYTE and not _BYTE_TOKEN.fullmatch(vocab[i]):
            raise error(f"token {i} {vocab[i]!r} has type BYTE but is not spelled <0xNN>")
    pieces = set(vocab)
    missing = [byte_token(b) for b in range(256) if byte_token(b) not in pieces]
    if missing:
        raise error(f"this SentencePiece vocabulary lacks the byte-fallback tokens {missing[:4]}"
                    f"{' ...' if len(missing) > 4 else ''} ({len(missing)} of 256); cflow needs all "
                    "<0x00>..<0xFF> to encode characters outside the vocabulary")


def spm_merges(vocab: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, the best-scored token's first (see module doc)."""
    ids = {t: i for i, t in enumerate(vocab)}
    ranked = []
    for i, tok in enumerate(vocab):
        for k in range(1, len(tok)):
            left, right = tok[:k], tok[k:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, k, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_spm(h: dict[str, Any]):
    """The HF `tokenizers` Tokenizer (model and normalizer; no added tokens yet) of header `h`."""
    from tokenizers import Tokenizer as HFTokenizer, models, normalizers

    vocab, types = h["vocab"], h["token_types"]
    unk = next((vocab[i] for i, t in enumerate(types) if t == UNKNOWN), None)
    model = models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=spm_merges(vocab, h["scores"]),
                       unk_token=unk, fuse_unk=True, byte_fallback=True)
    tk = HFTokenizer(model)
    steps = [normalizers.Replace(" ", SPACE)]
    if h["add_space_prefix"]:
        steps.insert(0, normalizers.Prepend(SPACE))
    tk.normalizer = normalizers.Sequence(steps)
    return tk


def spm_token_bytes(vocab: list[str], types: list[int]) -> list[bytes]:
    """The bytes each id decodes to (llama.cpp's token_to_piece with special=True)."""
    out = []
    for tok, ty in zip(vocab, types):
        if ty == NORMAL:
            out.append(tok.replace(SPACE, " ").encode("utf-8"))
        elif ty == BYTE:
            out.append(bytes([int(tok[3:5], 16)]))
        elif ty in (CONTROL, UNKNOWN, USER_DEFINED):
            out.append(tok.encode("utf-8"))
        else:  # unused and undefined tokens render as nothing
            out.append(b"")
    return out
