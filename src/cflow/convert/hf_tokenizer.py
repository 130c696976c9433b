"""Foreign tokenizer descriptions -> the tokenizer header dict of a `.cflow` file (docs/FORMAT.md).

Owns the import side of tokenizers, which only the converters need: reading an HF `tokenizers`
JSON (our training checkpoints' `tokenizer.json`, `cflow.convert.checkpoint`) and respelling
GGUF vocabulary entries into the byte-level alphabet (`cflow.convert.gguf`). What the runtime
does with the resulting header (encode, decode, chat templates) is `cflow.tokenizer`'s, which
never imports this module: a converted file is self-contained.

Choices:
- Only byte-level BPE is accepted, and only with a pre-tokenizer cflow.tokenizer can rebuild
  (`cflow.tokenizer_pre.PRE_TOKENIZERS`); anything else is a named TokenizerError, because an approximate split gives
  plausible-looking but wrong ids.
- BOS/EOS come from the JSON when it says (a TemplateProcessing post-processor that prepends a
  special token means add_bos), else from the usual token names, else from the caller.
"""

from __future__ import annotations

import json
import os
from typing import Any

from cflow.tokenizer import TokenizerError, bytes_to_unicode, unicode_to_bytes

# The Split patterns tokenizer.json files carry (Meta's Llama 3, Qwen2), by the PRE_TOKENIZERS name
# that reproduces them. llama.cpp (and so cflow's runtime) spells the contractions out instead of
# (?i:...), which differs only on case-folding oddities such as "'ſ".
HF_SPLIT_REGEXES: dict[str, str] = {
    "llama3": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}

__all__ = ["byte_level_spelling", "hf_json_to_header"]


def byte_level_spelling(token: str) -> str:
    """`token` in the byte-level alphabet: unchanged if it already is, else its UTF-8 bytes spelled.

    Some GGUF writers store a few tokens as raw text (e.g. a token of real spaces); BPE needs
    every ordinary token spelled in the byte alphabet or its merges can never produce it.
    """
    alphabet = unicode_to_bytes()
    if all(c in alphabet for c in token):
        return token
    table = bytes_to_unicode()
    return "".join(table[b] for b in token.encode("utf-8"))


_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|bos|>", "<bos>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|eos|>", "<eos>", "<|endoftext|>", "<|im_end|>")


def hf_json_to_header(path_or_str: str | os.PathLike, *, chat_template: str | None = None,
                      bos: str | None = None, eos: str | None = None) -> dict[str, Any]:
    """Header dict of an HF `tokenizers` byte-level BPE JSON (a path, or the JSON text itself).

    `bos`/`eos` name the tokens when the JSON alone does not say (it has no such fields);
    otherwise BOS comes from a post-processor that prepends a special token, and EOS from the
    usual names. Build the runtime tokenizer with `cflow.tokenizer.Tokenizer(header)`.
    """
    text = str(path_or_str)
    if not text.lstrip().startswith("{"):
        try:
            with open(text, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise TokenizerError(f"cannot read tokenizer JSON {path_or_str}: {e.strerror}") from None
    try:
        j = json.loads(text)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"tokenizer JSON is not valid JSON: {e}") from None
    model = j.get("model") or {}
    if model.get("type") != "BPE":
        raise TokenizerError(f"tokenizer.json model is {model.get('type')!r}; cflow supports byte-level BPE")
    if (j.get("decoder") or {}).get("type") != "ByteLevel":
        raise TokenizerError("tokenizer.json is not byte-level (its decoder is not ByteLevel)")
    by_id = {i: t for t, i in model["vocab"].items()}
    for a in j.get("added_tokens", []):
        by_id[a["id"]] = a["content"]
    n = len(by_id)
    if sorted(by_id) != list(range(n)):
        raise TokenizerError("tokenizer.json ids are not 0..n-1 without gaps")
    vocab = [by_id[i] for i in range(n)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    special = {a["content"]: a["id"] for a in j.get("added_tokens", []) if a.get("special")}
    added = {a["content"]: a["id"] for a in j.get("added_tokens", []) if not a.get("special")}

    bos_id = _bos_from_post_processor(j.get("post_processor"), special)
    add_bos = bos_id is not None
    if bos is not None:
        bos_id = _named_id(bos, special, "bos")
    elif bos_id is None:
        bos_id = next((special[t] for t in _BOS_NAMES if t in special), None)
    eos_id = (_named_id(eos, special, "eos") if eos is not None
              else next((special[t] for t in _EOS_NAMES if t in special), None))
    header = {"model": "bpe", "vocab": vocab, "merges": merges, "bos_id": bos_id, "eos_id": eos_id,
              "add_bos": add_bos, "chat_template": chat_template, "special": special,
              "pre": _pre_name_of_hf(j.get("pre_tokenizer"))}
    if added:
        header["added"] = added
    return header


def _pre_name_of_hf(pre: dict | None) -> str:
    """Which PRE_TOKENIZERS entry an HF pre_tokenizer JSON is, or TokenizerError."""
    def is_bytelevel(p: dict, use_regex: bool) -> bool:
        return (p.get("type") == "ByteLevel" and not p.get("add_prefix_space", False)
                and bool(p.get("use_regex", True)) == use_regex)

    if pre and is_bytelevel(pre, True):
        return "gpt2"
    if pre and pre.get("type") == "Sequence":
        seq = pre.get("pretokenizers", [])
        if (len(seq) == 2 and seq[0] == {"type": "Digits", "individual_digits": True}
                and is_bytelevel(seq[1], True)):
            return "smollm"
        if len(seq) == 2 and seq[0].get("type") == "Split" and is_bytelevel(seq[1], False):
            regex = seq[0].get("pattern", {}).get("Regex")
            for name, r in HF_SPLIT_REGEXES.items():
                if regex == r:
                    return name
    raise TokenizerError(
        f"tokenizer.json uses a pre-tokenizer cflow cannot reproduce: {json.dumps(pre)[:200]}; "
        "train it with tokenizers' ByteLevel(add_prefix_space=False)")


def _named_id(name: str, special: dict[str, int], what: str) -> int:
    if name not in special:
        raise TokenizerError(f"{what} token {name!r} is not a special token of this tokenizer; "
                             f"special tokens: {sorted(special)}")
    return special[name]


def _bos_from_post_processor(pp: dict | None, special: dict[str, int]) -> int | None:
    """The id a TemplateProcessing post-processor puts first, if it puts a special token first."""
    if not pp or pp.get("type") != "TemplateProcessing" or not pp.get("single"):
        return None
    first = pp["single"][0]
    tok = first.get("SpecialToken", {}).get("id")
    return special.get(tok) if tok else None
