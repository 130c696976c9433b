"""Byte-level BPE pre-tokenizers by name: how text is cut into words before BPE merges them.

Owns the table of `tokenizer.ggml.pre` names cflow reproduces (`PRE_TOKENIZERS`) and building the
HF `tokenizers` pre-tokenizer of one. The names, the regexes and the per-name flags are
llama.cpp's (src/llama-vocab.cpp, `llm_tokenizer_bpe` and `llama_vocab::impl::load`), because a
GGUF file is tokenized the way llama.cpp tokenizes it:
- each name has a list of regexes applied in turn, every match and every unmatched stretch
  between matches becoming a word (llama.cpp's unicode_regex_split; HF: Split "isolated"), then
  each word is spelled in GPT-2's byte alphabet;
- `ignore_merges`: a word that is a whole token is that token, before any merging (llama3, tekken);
- `add_bos`: whether llama.cpp adds BOS when the file has no `tokenizer.ggml.add_bos_token`.

An unknown name is a TokenizerError listing the known ones. llama.cpp refuses unknown names too
("unknown pre-tokenizer type"); a file without the key gets llama.cpp's "default" (a warning
there), which is not GPT-2's split: it also cuts punctuation runs and groups digits by three.
`"gpt2"` is cflow's own name for GPT-2's split (our trained tokenizers; llama.cpp says "gpt-2"),
and a header `pre` of null means the same, as it did in files written before names were checked.
"""

from __future__ import annotations

from dataclasses import dataclass

# llama.cpp's regexes, verbatim (C++ escapes undone; deepseek's classes: see _CJK). Its llama3 and qwen2 spell the
# contractions (?:'[sS]|...) where tokenizer.json says (?i:'s|...); we keep llama.cpp's.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")
TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
          r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (gpt-4o, gpt-oss): tekken's case-change words with an optional contraction, digits by three
GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
         r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# qwen35: qwen2's split with combining marks (\p{M}) kept inside words
QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
# deepseek-v3 (also hunyuan-dense, joyai-llm): digits by three, then kana and the CJK block, then
# words (one ASCII punctuation mark may lead an ASCII word), punctuation and symbol runs, spaces
DEEPSEEK3 = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
             r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
             r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# kimi-k2: llama.cpp does not run Moonshot's pattern but a hand-written scanner in its place
# (unicode_regex_split_custom_kimi_k2) that drops the pattern's case classes: a word is any run of
# non-Han letters ("getUserName" stays whole), Han runs are words of their own. Han is llama.cpp's
# unicode_cpt_is_han ranges, not the Unicode script.
_HAN = ("\u4e00-\u9fff\u3400-\u4dbf\U00020000-\U0002a6df\U0002a700-\U0002b73f\U0002b740-\U0002b81f"
        "\U0002b820-\U0002ceaf\U0002ceb0-\U0002ebef\uf900-\ufaff\U0002f800-\U0002fa1f")
KIMI_K2 = (f"[{_HAN}]+|[^\\r\\n\\p{{L}}\\p{{N}}]?[\\p{{L}}&&[^{_HAN}]]+(?:'[sStTmMdD]|'[rR][eE]|'[vV][eE]|'[lL][lL])?"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Code points that Unicode normalization would replace (Greek with oxia, Ohm, Kelvin) are escaped,
# so that no editor can silently turn a range into another or an empty one.
_DEEPSEEK_LETTERS = (
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛ"
    "ὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄ"
    "Ⰰ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗ"
    "Ａ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃")
# llama.cpp matches these literal classes (std::wregex) with every non-ASCII whitespace character
# replaced by U+000B, so that \s finds it; the classes therefore never contain one. Ours leave out
# what their ranges would otherwise take in (U+1680, U+2000-U+200A, U+2028/9, U+202F, U+205F, U+3000).
_CJK = "[一-龥ࠀ-\u167f\u1681-\u1fff\u200b-\u2027\u202a-\u202e\u2030-\u205e\u2060-\u2fff\u3001-一가-퟿]+"


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is a whole token is looked up before merging
    add_bos: bool = False        # llama.cpp's add_bos when the file does not say


_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_GPT2 = PreTokenizer((GPT2,))
_DIGITS = PreTokenizer((r"\p{N}", GPT2))  # each digit a word, then GPT-2's split
_LLAMA3 = PreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizer((QWEN2,))

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    "gpt2": _GPT2, "gpt-2": _GPT2, "phi-2": _GPT2, "mpt": _GPT2, "olmo": _GPT2, "jais": _GPT2,
    "trillion": _GPT2, "exaone4": _GPT2, "gigachat": _GPT2, "a.x-4.0": _GPT2, "mellum": _GPT2,
    "smollm": _DIGITS, "starcoder": _DIGITS, "refact": _DIGITS, "command-r": _DIGITS,
    "codeshell": _DIGITS, "exaone": _DIGITS, "minerva-7b": _DIGITS,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3,
    "falcon-h1": _LLAMA3, "pixtral": _LLAMA3, "midm-2.0": _LLAMA3, "lfm2": _LLAMA3,
    "dbrx": PreTokenizer((LLAMA3,)), "smaug-bpe": PreTokenizer((LLAMA3,)),  # same split, no lookup
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "stablelm2": _QWEN2, "megrez": _QWEN2,
    "hunyuan": _QWEN2,
    "tekken": PreTokenizer((TEKKEN,), ignore_merges=True, add_bos=True),
    "gpt-4o": PreTokenizer((GPT4O,)),
    "qwen35": PreTokenizer((QWEN35,)),
    "deepseek-v3": PreTokenizer(DEEPSEEK3), "hunyuan-dense": PreTokenizer(DEEPSEEK3),
    "joyai-llm": PreTokenizer(DEEPSEEK3),
    "kimi-k2": PreTokenizer((KIMI_K2,)),
    "deepseek-llm": PreTokenizer(("[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+", "\\s?[!-/:-~！-／：-～‘-‟\u3001-。]+",
                                  r"\s+$", _CJK, r"\p{N}+")),
    "deepseek-coder": PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]")),
}


def pre_tokenizer_spec(pre: str | None) -> PreTokenizer:
    """The PreTokenizer of name `pre` (None: GPT-2's), or TokenizerError naming the known ones."""
    from cflow.tokenizer import TokenizerError  # lazily: cflow.tokenizer imports this module

    spec = PRE_TOKENIZERS.get("gpt2" if pre is None else pre)
    if spec is None:
        raise TokenizerError(
            f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre); cflow reproduces "
            f"{sorted(PRE_TOKENIZERS)}. llama.cpp refuses unknown names as well; add its regexes "
            "(src/llama-vocab.cpp) to cflow.tokenizer_pre.PRE_TOKENIZERS.")
    return spec


def build_pre_tokenizer(pre: str | None):
    """The HF `tokenizers` pre-tokenizer of name `pre`: its regex splits, then byte-level spelling."""
    from tokenizers import Regex, pre_tokenizers as pt

    spec = pre_tokenizer_spec(pre)
    splits = [pt.Split(Regex(r), behavior="isolated") for r in spec.regexes]
    return pt.Sequence(splits + [pt.ByteLevel(add_prefix_space=False, use_regex=False)])

