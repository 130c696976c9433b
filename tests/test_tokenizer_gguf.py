"""The tokenizers GGUF files carry: byte-level BPE pre-tokenizers by name and SentencePiece-style
("llama") vocabularies, against literal expectations and against llama.cpp on the same files.

- Pre-tokenizer splits: literal word lists written here, worked out by hand from llama.cpp's
  regexes (src/llama-vocab.cpp), one table per name.
- SentencePiece: a hand-built vocabulary with literal ids (score order, byte fallback, the space
  prefix, decoding bytes across streamed tokens); then a trained vocabulary of a few hundred
  pieces written into a small GGUF, tokenized by cflow and by llama.cpp (`llama_cpp`,
  vocab_only) over tricky strings: ids, per-token pieces, detokenization, round trips.
- Byte-level BPE: SmolLM2's real vocabulary and merges written into GGUFs under each
  `tokenizer.ggml.pre` name, tokenized by both.
llama.cpp comparisons are skipped when llama_cpp (the `bench` extra) is not importable.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cflow.tokenizer import Tokenizer, TokenizerError
from cflow.tokenizer_pre import PRE_TOKENIZERS
from cflow.tokenizer_spm import byte_token

gguf = pytest.importorskip("gguf")


def llama_cpp_or_skip():
    try:
        import llama_cpp
    except Exception as e:  # a broken native library raises OSError, not ImportError
        pytest.skip(f"llama_cpp is not importable ({type(e).__name__}: {e}); the llama.cpp oracle: pip install 'llama-cpp-python>=0.3.16'")
    return llama_cpp


# ---- pre-tokenizer splits, literal -------------------------------------------------------------
# The words (as text) each name cuts these strings into. How: GPT-2 keeps contractions only in
# lower case and gives a run of spaces all but its last space; "default" and "falcon" first cut
# punctuation runs (so "I'm" loses its contraction) and then digits by three; smollm cuts every
# digit; llama3 takes digits by up to three, case-insensitive contractions, one non-letter before
# a word, punctuation with its newlines; qwen2 is llama3 with single digits; tekken cuts words at
# case changes (llama.cpp's approximation: any non-ASCII letter counts as both cases); the
# deepseek ones cut newlines, letter runs, punctuation runs, CJK runs and digits in turn.
SENTENCE = "I'm 12345 DON'T stop!!\n\n  ok"
SPLITS = {
    "gpt-2": {SENTENCE: ["I", "'m", " 12345", " DON", "'", "T", " stop", "!!", "\n\n ", " ok"],
              "a\tb  c": ["a", "\t", "b", " ", " c"]},
    "default": {SENTENCE: ["I", "'", "m", " ", "123", "45", " DON", "'", "T", " stop", "!!", "\n\n ", " ok"],
                "x ٣٤٥ 1234": ["x", " ", "٣٤٥", " ", "123", "4"], "hi 😀👍!": ["hi", " 😀👍", "!"]},
    "falcon": {SENTENCE: ["I", "'", "m", " ", "123", "45", " DON", "'", "T", " stop", "!!", "\n\n ", " ok"],
               "x ٣٤٥ 1234": ["x", " ٣٤٥", " ", "123", "4"]},
    "smollm": {SENTENCE: ["I", "'m", " ", "1", "2", "3", "4", "5", " DON", "'", "T", " stop", "!!", "\n\n ", " ok"],
               "x² 10": ["x", "²", " ", "1", "0"]},
    "llama-bpe": {SENTENCE: ["I", "'m", " ", "123", "45", " DON", "'T", " stop", "!!\n\n", " ", " ok"],
                  "日本語 x  =1": ["日本語", " x", " ", " =", "1"], "hi 😀👍!": ["hi", " 😀👍!"]},
    "qwen2": {SENTENCE: ["I", "'m", " ", "1", "2", "3", "4", "5", " DON", "'T", " stop", "!!\n\n", " ", " ok"],
              "日本語 x  =1": ["日本語", " x", " ", " =", "1"]},
    "tekken": {SENTENCE: ["I", "'m", " ", "1", "2", "3", "4", "5", " DON", "'T", " stop", "!!\n\n", " ", " ok"],
               "HelloWorld XMLHttpRequest camelCase": ["Hello", "World", " XMLHttp", "Request", " camel", "Case"],
               "ÉCOLE école": ["É", "COLE", " école"]},
    "gpt-4o": {SENTENCE: ["I'm", " ", "123", "45", " DON'T", " stop", "!!\n\n", " ", " ok"],
               "HelloWorld XMLHttpRequest it's": ["Hello", "World", " XMLHttp", "Request", " it's"]},
    "deepseek-llm": {"Hello, 世界123!\n  ok 日本": ["Hello", ",", " ", "世界", "123", "!", "\n", " ", " ok", " ",
                                                  "日本"],
                     "x \u20031": ["x", " \u2003", "1"]},  # U+2003 lies in the CJK class's range, yet is no member
    "deepseek-coder": {"Hello, 世界123!\n  ok 日本": ["Hello", ",", " ", "世界", "1", "2", "3", "!", "\n", " ",
                                                    " ok", " ", "日本"]},
    # qwen35 keeps combining marks in words; deepseek-v3 lets one punctuation mark lead an ASCII word
    # only, cuts digits by three first and kana with kanji; kimi-k2 (llama.cpp's scanner) ignores case
    "qwen35": {"cafe\u0301 nai\u0308ve": ["cafe\u0301", " nai\u0308ve"]},
    "deepseek-v3": {"x.Привет x.Net 12345ab ひらがな漢字": ["x", ".", "Привет", " x", ".Net", " ", "123", "45", "ab", " ",
                                                      "ひらがな漢字"]},
    "kimi-k2": {"getUserName it's 汉字abc": ["getUserName", " it's", " ", "汉字", "abc"]},
}


def words(pre: str, text: str) -> list[str]:
    tok = Tokenizer({"model": "bpe", "vocab": ["a"], "merges": [], "bos_id": None, "eos_id": None,
                     "add_bos": False, "chat_template": None, "special": {}, "pre": pre})
    return [text[a:b] for _, (a, b) in tok._tk.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("pre, text, want", [(p, t, w) for p, table in SPLITS.items() for t, w in table.items()])
def test_pre_tokenizer_splits(pre, text, want):
    assert words(pre, text) == want


def test_aliases_split_alike():
    assert words("llama3", SENTENCE) == words("llama-bpe", SENTENCE) == words("dbrx", SENTENCE)
    assert words("deepseek-r1-qwen", SENTENCE) == words("qwen2", SENTENCE)
    assert words("starcoder", SENTENCE) == words("smollm", SENTENCE)
    assert words(None, SENTENCE) == words("gpt2", SENTENCE) == words("gpt-2", SENTENCE)


def test_unknown_pre_tokenizer_is_named():
    with pytest.raises(TokenizerError, match=r"unsupported pre-tokenizer 'llama5'.*'llama-bpe'.*'qwen2'"):
        words("llama5", "x")


# ---- SentencePiece, hand-built --------------------------------------------------------------------
BYTE = 3  # id of <0x00>; byte b is id BYTE + b
HAND_PIECES = [("▁", -10.0), ("a", -11.0), ("b", -12.0), ("c", -13.0), ("ab", -3.0), ("bc", -2.0),
               ("▁a", -5.0), ("abc", -1.0), ("▁▁", -4.0), ("<x>", 0.0)]
SP, A, B, C, AB, BC, SP_A, ABC, SP2, USER = range(259, 259 + len(HAND_PIECES))


def spm_header(add_space_prefix: bool = True) -> dict:
    vocab = ["<unk>", "<s>", "</s>"] + [byte_token(b) for b in range(256)] + [p for p, _ in HAND_PIECES]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(HAND_PIECES) - 1) + [4]
    return {"model": "spm", "vocab": vocab, "merges": [], "scores": [0.0] * 259 + [s for _, s in HAND_PIECES],
            "token_types": types, "add_space_prefix": add_space_prefix, "bos_id": 1, "eos_id": 2,
            "add_bos": True, "chat_template": None, "special": {"<unk>": 0, "<s>": 1, "</s>": 2},
            "added": {"<x>": USER}, "pre": None}


@pytest.mark.parametrize("text, want", [
    ("abc", [SP, ABC]),             # bc (-2) before ab (-3), then a+bc = abc (-1)
    ("ab", [SP, AB]),
    ("a b", [SP_A, SP, B]),         # spaces are ▁; "▁b" is no token
    ("  a", [SP2, SP_A]),           # "▁▁▁a": the leftmost ▁▁ merges first
    ("日", [SP, BYTE + 0xE6, BYTE + 0x97, BYTE + 0xA5]),  # not in the vocabulary: its UTF-8 bytes
    ("", []),
    ("a<x>a", [SP_A, USER, SP_A]),  # after an added token the text gets its own ▁
    ("<s>b", [1, SP, B]),
])
def test_spm_ids(text, want):
    tok = Tokenizer(spm_header())
    assert tok.encode(text, add_bos=False) == want
    assert tok.encode(text) == [1] + want  # add_bos is the default


def test_spm_without_space_prefix():
    tok = Tokenizer(spm_header(add_space_prefix=False))
    assert tok.encode("abc a", add_bos=False) == [ABC, SP_A]
    assert tok.decode([ABC, SP_A]) == "abc a"


def test_spm_decode():
    tok = Tokenizer(spm_header())
    assert tok.decode([SP_A, SP, B]) == "a b"             # the prefix space comes off again
    assert tok.decode([1, SP_A], skip_special=True) == "a"
    assert tok.decode([1, SP_A]) == "<s> a"
    assert tok.token_to_bytes(SP_A) == b" a" and tok.token_to_bytes(BYTE + 0x0A) == b"\n"
    assert tok.decode([BYTE + 0xE6, BYTE + 0x97, BYTE + 0xA5, USER]) == "日<x>"
    # streamed tokens continue a text: no space is stripped; a character split over byte tokens
    # appears once its last byte arrives
    s = tok.stream()
    assert [s.put(i) for i in [SP_A, BYTE + 0xE6, BYTE + 0x97, BYTE + 0xA5, SP]] + [s.flush()] == \
        [" a", "", "", "日", " ", ""]
    s = tok.stream()
    assert [s.put(i) for i in [BYTE + 0xE6, BYTE + 0x97, SP_A]] + [s.flush()] == ["", "", "\ufffd a", ""]


def test_spm_header_round_trips_through_json():
    tok = Tokenizer(spm_header())
    again = Tokenizer(json.loads(json.dumps(tok.to_header())))
    assert again.encode("a b 日") == tok.encode("a b 日")


@pytest.mark.parametrize("change, msg", [
    ({"scores": [0.0] * 5}, "'scores'"),
    ({"token_types": None}, "'token_types'"),
    ({"token_types": [9] * 269}, "'token_types'"),
    ({"add_space_prefix": None}, "add_space_prefix"),
    ({"merges": ["a b"]}, "no 'merges'"),
    ({"pre": "llama-bpe"}, "no 'pre'"),
    ({"model": "unigram"}, "'unigram' is not supported"),
])
def test_spm_header_errors(change, msg):
    with pytest.raises(TokenizerError, match=msg):
        Tokenizer({**spm_header(), **change})


def test_spm_vocabulary_errors():
    h = spm_header()
    h["vocab"] = h["vocab"][:BYTE + 0x41] + ["A"] + h["vocab"][BYTE + 0x42:]
    with pytest.raises(TokenizerError, match=r"BYTE but is not spelled"):
        Tokenizer(h)
    h["token_types"] = h["token_types"][:BYTE + 0x41] + [1] + h["token_types"][BYTE + 0x42:]
    with pytest.raises(TokenizerError, match=r"lacks the byte-fallback tokens \['<0x41>'\]"):
        Tokenizer(h)
    h = spm_header()
    h["vocab"] = h["vocab"][:-1] + ["abc"]
    h["added"] = {}
    with pytest.raises(TokenizerError, match="'abc' appears twice"):
        Tokenizer(h)


# ---- GGUF files and llama.cpp --------------------------------------------------------------------
def write_vocab_gguf(path: Path, model: str, tokens: list[str], types: list[int], *, scores=None, merges=None,
                     pre: str | None = None, extra=None, tensors=None) -> Path:
    """A llama GGUF (one layer, width 64) holding a tokenizer, and `tensors` if given (llama.cpp
    and cflow's tokenizer reader both load vocabularies alone)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    for key, fn in (extra or {}).items():
        getattr(w, key)(fn)
    for name, x in (tensors or {}).items():
        w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def detokenize(llama_cpp, llm, ids: list[int], *, remove_special: bool, unparse_special: bool) -> str:
    """llama.cpp's own llama_detokenize (llama_cpp.Llama.detokenize concatenates pieces instead
    and strips a space after BOS whatever the vocabulary says)."""
    import ctypes

    buf = ctypes.create_string_buffer(64 + 64 * len(ids))
    arr = (llama_cpp.llama_token * len(ids))(*ids)
    n = llama_cpp.llama_detokenize(llama_cpp.llama_model_get_vocab(llm.model), arr, len(ids), buf, len(buf),
                                   remove_special, unparse_special)
    assert n >= 0
    return buf.raw[:n].decode("utf-8", "replace")


def cflow_from_gguf(path: Path) -> Tokenizer:
    from cflow.convert.gguf import GGUFModel, gguf_tokenizer

    return Tokenizer(gguf_tokenizer(GGUFModel(path)))


TRICKY = ["Hello world", " Hello", "  leading spaces", "trailing  ", "a    b", "\n", "new\nline\n\n",
          "café 日本語 😀", "", " ", "   ", "The end.</s>Max<|user|>ok", "<s>the</s>", "Ωmega ñ ß",
          "\t\ttabs\t", "x<|user|> y", "<unk>", "I'm 12345 DON'T stop!!", "e\u0301 zero\u200bwidth \u00a0nbsp",
          "日本", " 日本 ", "1234567890", "emoji 👍🏽 🧑‍🚀 family 👨‍👩‍👧", "\r\n\r\n", "Привет, мир"]
CORPUS = ["Once upon a time there was a little dog named Max. Max liked to run in the park.",
          "The sun was bright and the sky was blue. Lily saw a big red ball under the tree.",
          "They played together all day and were very happy. The end. 123 456 7890",
          "Hello world! How are you?  Fine,   thanks.\n\nNew line here. café 日本 日本語"] * 20


def trained_spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """Llama 2's layout on a small scale: <unk> <s> </s>, the 256 byte tokens, merged pieces (the
    earlier the merge, the higher the score), single characters last; plus runs of "▁", "日本", a
    user-defined and a control token."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers, trainers

    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=320, show_progress=False))
    model = json.loads(tk.to_str())["model"]
    merged = ["".join(m) if isinstance(m, list) else m.replace(" ", "") for m in model["merges"]]
    chars = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if len(t) == 1]
    tokens = ["<unk>", "<s>", "</s>"] + [byte_token(b) for b in range(256)]
    types, scores = [2, 3, 3] + [6] * 256, [0.0] * 259
    for k, piece in enumerate(dict.fromkeys(merged + ["▁▁", "▁▁▁▁", "日本"])):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(k))
    for k, c in enumerate(c for c in chars if c not in tokens):
        tokens.append(c)
        types.append(1)
        scores.append(-1000.0 - k)
    return tokens + ["<|user|>", "<|end|>"], scores + [0.0, 0.0], types + [4, 3]


@pytest.fixture(scope="module")
def spm_vocab():
    tokens, scores, types = trained_spm_vocab()
    assert len(tokens) > 400 and "▁the" in tokens and "日本" in tokens
    return tokens, scores, types


@pytest.mark.oracle
@pytest.mark.parametrize("prefix", [None, False])
def test_spm_gguf_matches_llama_cpp(spm_vocab, tmp_path, prefix):
    llama_cpp = llama_cpp_or_skip()
    tokens, scores, types = spm_vocab
    extra = {"add_bos_token_id": 1, "add_eos_token_id": 2}
    if prefix is not None:
        extra["add_add_space_prefix"] = prefix
    path = write_vocab_gguf(tmp_path / "spm.gguf", "llama", tokens, types, scores=scores, extra=extra)
    tok = cflow_from_gguf(path)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    assert tok.model == "spm" and tok.add_bos and tok.bos_id == 1 and tok.eos_id == 2
    assert tok.add_space_prefix == (prefix is None)
    for text in TRICKY:
        for bos in (False, True):
            assert tok.encode(text, add_bos=bos) == llm.tokenize(text.encode(), add_bos=bos, special=True), text
        ids = llm.tokenize(text.encode(), add_bos=True, special=False)
        # llama_detokenize strips the prefix space from a text that does not start with BOS; we
        # also strip it after a skipped BOS (as HF and llama_cpp.Llama.detokenize do)
        theirs = detokenize(llama_cpp, llm, ids[1:], remove_special=True, unparse_special=False)
        assert tok.decode(ids, skip_special=True) == theirs, text
        for part in (ids, ids[1:]):
            assert tok.decode(part) == detokenize(llama_cpp, llm, part, remove_special=False, unparse_special=True)
        if theirs == text and tok.encode(text) == ids:  # llama.cpp round-trips, without specials
            assert tok.decode(tok.encode(text), skip_special=True) == tok.decode(ids[1:]) == text
        # a stream renders tokens as a continuation, piece by piece, keeping the prefix space
        assert "".join(tok.decode_stream(ids, skip_special=True)) == \
            llm.detokenize(ids[1:]).decode("utf-8", "replace"), text
    assert any(t.startswith("<0x") for t in (tokens[i] for i in tok.encode("😀")))  # byte fallback was exercised
    for i in range(len(tokens)):
        assert tok.token_to_bytes(i) == llm.detokenize([i], special=True), (i, tokens[i])


@pytest.mark.oracle
def test_spm_gguf_defaults_follow_llama_cpp(spm_vocab, tmp_path):
    # no bos/eos ids, no add_bos, no add_space_prefix: llama.cpp assumes 1, 2, true, true
    tokens, scores, types = spm_vocab
    tok = cflow_from_gguf(write_vocab_gguf(tmp_path / "d.gguf", "llama", tokens, types, scores=scores))
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_space_prefix) == (1, 2, True, True)
    assert tok.encode("the")[0] == 1


def test_spm_gguf_without_byte_tokens_is_refused(tmp_path):
    path = write_vocab_gguf(tmp_path / "n.gguf", "llama", ["<unk>", "<s>", "</s>", "▁a"], [2, 3, 3, 1],
                            scores=[0.0, 0.0, 0.0, -1.0])
    with pytest.raises(TokenizerError, match=r"n.gguf has a 'llama' tokenizer \(SentencePiece\) that cflow cannot "
                                             r"use.*<0x00>"):
        cflow_from_gguf(path)


def test_spm_model_converts_and_generates(spm_vocab, tmp_path):
    # a random one-layer Llama carrying the SentencePiece vocabulary: `cflow convert` keeps the
    # tokenizer in the .cflow, and the engine encodes like llama.cpp and streams text
    llama_cpp = llama_cpp_or_skip()
    import numpy as np

    from cflow.convert.gguf import convert_gguf
    from cflow.runtime import Engine

    tokens, scores, types = spm_vocab
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (len(tokens), 64), "output_norm.weight": (64,), "output.weight": (len(tokens), 64)}
    shapes.update({f"blk.0.{n}.weight": s for n, s in {
        "attn_norm": (64,), "attn_q": (64, 64), "attn_k": (64, 64), "attn_v": (64, 64), "attn_output": (64, 64),
        "ffn_norm": (64,), "ffn_gate": (128, 64), "ffn_up": (128, 64), "ffn_down": (64, 128)}.items()})
    weights = {n: (rng.standard_normal(s) * 0.1 + (len(s) == 1)).astype(np.float32) for n, s in shapes.items()}
    path = write_vocab_gguf(tmp_path / "m.gguf", "llama", tokens, types, scores=scores, tensors=weights,
                            extra={"add_bos_token_id": 1, "add_eos_token_id": 2})
    convert_gguf(path, tmp_path / "m.cflow", quant="q8_0")
    eng = Engine.load(tmp_path / "m.cflow", threads=1, n_ctx=64)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    assert eng.tokenizer.model == "spm"
    for text in TRICKY:
        assert eng.encode(text) == llm.tokenize(text.encode(), add_bos=True, special=True), text
    out = eng.complete("Once upon a time", max_tokens=6, temperature=0.0, ignore_eos=True)
    assert len(out.tokens) == 6
    tok = eng.tokenizer  # the stream renders pieces as a continuation (no space stripped), specials skipped
    assert out.text == b"".join(tok.token_to_bytes(i) for i in out.tokens if not tok.is_special(i)).decode(
        "utf-8", "replace")


@pytest.fixture(scope="module")
def smol_vocab(smollm2_gguf):
    from cflow.convert.gguf import GGUFModel, gguf_tokenizer

    g = GGUFModel(smollm2_gguf)
    return ([str(t) for t in g.get("tokenizer.ggml.tokens")], [int(t) for t in g.get("tokenizer.ggml.token_type")],
            [str(m) for m in g.get("tokenizer.ggml.merges")], gguf_tokenizer(g))


BPE_TRICKY = TRICKY + [
    "I'm sure they'll say THEY'RE fine, won't they? 'Tis", "12345678 and 1,000.5 v2024 ٣٤٥٦ x² ½",
    "line\n\n  two\r\n\tend \n", "日本語のテキスト、中文 Привет, мир! 한국어", "def f(x):\n    return x**2  # sq\n",
    "a\u00a0b\u3000c\u2003d", "<|im_start|>user\nHi<|im_end|>\n", "HelloWorld camelCase XMLHttpRequest ÉCOLE école",
    "price: $100+200=300 <a|b> ^~", "path/to/file.txt\n/usr/bin", "'s 'S 'ſ",
    "Ĳssel ǅ µ Ω K \u1f7d\u1fbe \u2126\u212a",
    "....!!!???", "中文123abc", "x\u0085y\u2028z", "           many", "1234567890123 ١٢٣٤٥", "it's it’s",
    "x \u20031 \u3000\u3000, a\u1680b\u205f\u2028c\u202f",
    # case changes, combining marks, kana beside kanji, Han outside the basic block, ASCII words led by punctuation
    "getUserName iPhone 汉字abc12345DEF e\u0301cole .Net #include <x> 𠀀𠀁x 豈a ひらがなカタカナ漢字 it's IT'S"]  # Unicode spaces: llama.cpp's literal classes never match them


@pytest.mark.oracle
@pytest.mark.parametrize("pre", ["default", "gpt-2", "smollm", "llama-bpe", "qwen2", "tekken", "deepseek-llm",
                                 "deepseek-coder", "falcon", "dbrx", "gpt-4o", "qwen35", "deepseek-v3", "kimi-k2",
                                 None])
def test_bpe_gguf_matches_llama_cpp(smol_vocab, tmp_path, pre):
    llama_cpp = llama_cpp_or_skip()
    tokens, types, merges, smol = smol_vocab
    path = write_vocab_gguf(tmp_path / "bpe.gguf", "gpt2", tokens, types, merges=merges, pre=pre,
                            extra={"add_bos_token_id": 1, "add_eos_token_id": 2})
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    # reading 49152 tokens back with gguf's reader takes seconds: SmolLM2's own header with the
    # name swapped in is what gguf_tokenizer gives for this file (test_every_name_... reads names)
    pre = pre or "default"  # llama.cpp's choice for a file without the key
    tok = Tokenizer({**smol, "pre": pre, "add_bos": PRE_TOKENIZERS[pre].add_bos})
    assert tok.add_bos == llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(llm.model))
    for text in BPE_TRICKY:
        ids = tok.encode(text, add_bos=False)
        assert ids == llm.tokenize(text.encode(), add_bos=False, special=True), text
        assert tok.decode(ids) == llm.detokenize(ids, special=True).decode("utf-8", "replace") == text


# The newer names beside the name each was derived from (the control), and texts on which the two
# split differently: combining marks inside words (qwen35, deepseek-v3), digits cut first, kana and
# CJK runs, a punctuation mark leading only ASCII words (deepseek-v3), Han runs and case-blind letter
# runs (kimi-k2).
_MARKS, _CYRILLIC, _KANA = "cafe\u0301 nai\u0308ve क्षत्रिय", "x.Привет .Net (мир) 12345abc", "ひらがなカタカナ漢字 汉字abc"
_CAMEL, _HAN = "getUserName iPhone XMLHttp it's IT'S", "𠀀𠀁x 豈a 12 345 6789"
_NEAR = {"qwen35": ("qwen2", [_MARKS]), "deepseek-v3": ("llama-bpe", [_MARKS, _CYRILLIC, _KANA, _HAN]),
         "kimi-k2": ("gpt-4o", [_CAMEL])}


def _whole_word_vocab(word_lists: list[list[str]]) -> tuple[list[str], list[str]]:
    """The byte alphabet plus, for every word (byte-level spelled), the merges that build it from
    the left one byte at a time: BPE then gives each word of a split one token, so two splits
    that differ give different token sequences."""
    from cflow.tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    tokens = [alphabet[b] for b in range(256)]
    seen, merges = set(tokens), []
    for word_list in word_lists:
        for w in word_list:
            s = "".join(alphabet[b] for b in w.encode())
            for k in range(2, len(s) + 1):
                if s[:k] not in seen:
                    seen.add(s[:k])
                    tokens.append(s[:k])
                    merges.append(f"{s[:k - 1]} {s[k - 1]}")
    return tokens, merges


@pytest.mark.oracle
@pytest.mark.parametrize("pre", sorted(_NEAR))
def test_newer_names_split_where_llama_cpp_splits(tmp_path, pre):
    # SmolLM2's merges seldom cross the places where these names differ from their neighbours, so
    # the vocabulary is built from the splits themselves (ours and the neighbour's words, whole);
    # the neighbour is the control, which llama.cpp must tell apart on the name's own texts.
    llama_cpp = llama_cpp_or_skip()
    from cflow.convert.gguf import GGUFModel, gguf_tokenizer

    near, own = _NEAR[pre]
    texts = [_MARKS, _CYRILLIC, _KANA, _CAMEL, _HAN]
    tokens, merges = _whole_word_vocab([words(p, t) for t in texts for p in (pre, near)])
    path = write_vocab_gguf(tmp_path / "v.gguf", "gpt2", tokens, [1] * len(tokens), merges=merges, pre=pre,
                            extra={"add_bos_token_id": 0})
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    header = gguf_tokenizer(GGUFModel(path))
    ours, control = Tokenizer(header), Tokenizer({**header, "pre": near})
    for text in texts:
        theirs = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert ours.encode(text, add_bos=False) == theirs, (pre, text, words(pre, text))
        if text in own:
            assert control.encode(text, add_bos=False) != theirs, (near, text)


@pytest.mark.oracle
def test_every_name_is_one_llama_cpp_accepts(tmp_path):
    # ...with llama.cpp's add_bos and ignore_merges. cflow's own "gpt2" (our trained tokenizers) is the one
    # name llama.cpp lacks.
    llama_cpp = llama_cpp_or_skip()
    from cflow.tokenizer import bytes_to_unicode

    # "Ġtt" is a token no merge builds: only names with llama.cpp's ignore_merges find it whole
    tokens = [bytes_to_unicode()[b] for b in range(256)] + ["Ġt", "Ġtt"]
    for pre in sorted(set(PRE_TOKENIZERS) - {"gpt2"}) + [None]:
        path = write_vocab_gguf(tmp_path / f"{pre or 'none'}.gguf", "gpt2", tokens, [1] * len(tokens), merges=["Ġ t"],
                                pre=pre, extra={"add_bos_token_id": 0})
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        tok = cflow_from_gguf(path)
        assert tok.pre == (pre or "default")  # llama.cpp's choice for a file without the key
        assert tok.add_bos == llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(llm.model)), pre
        assert tok.encode(" tt t") == llm.tokenize(b" tt t", add_bos=tok.add_bos, special=True), pre
        whole = PRE_TOKENIZERS[pre or "default"].ignore_merges
        assert tok.encode(" tt t", add_bos=False) == ([257, 256] if whole else [256, ord("t"), 256]), pre
