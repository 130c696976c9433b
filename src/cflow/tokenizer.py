"""The runtime tokenizer: byte-level BPE or SentencePiece-style, and chat templates, rebuilt from
a `.cflow` header.

Owns the tokenizer dict of the file header (docs/FORMAT.md): its validation, and everything done
with it at run time: encode, decode, streaming detokenization, chat-template rendering, and the
token-id range check (`check_token_ids`). No torch and no transformers here; the BPE itself runs
in HF `tokenizers` (a runtime dependency), which we build from the vocabulary and merges (or, for
"spm" vocabularies, the scores: `cflow.tokenizer_spm`) so the file stays self-contained. Making a
header from foreign descriptions (an HF tokenizer.json, a GGUF vocabulary) is the converters' job:
`cflow.convert.hf_tokenizer`, `cflow.convert.gguf`. `TokenizerError` is the one error of both
sides and of tokenizer training (`cflow.train.bpe`).

Choices:
- Three models, all llama.cpp's: "bpe" (GPT-2 byte-level BPE, GGUF "gpt2"), "spm"
  (SentencePiece-style pieces with scores and byte fallback, GGUF "llama"; cflow.tokenizer_spm)
  and "gemma4" (SentencePiece-spelled pieces merged by BPE ranks, GGUF "gemma4";
  cflow.tokenizer_gemma4).
- The byte-level pre-tokenizer (how text is cut into words before BPE) is not part of the
  vocabulary; GGUF names it in `tokenizer.ggml.pre` and we keep that name in the header (`pre`).
  `cflow.tokenizer_pre.PRE_TOKENIZERS` maps names to llama.cpp's regex splits; an unknown name is
  an error rather than a silent GPT-2 fallback, because a wrong split gives plausible-looking but
  wrong ids.
- Special tokens are "added tokens": matched whole in the input before BPE, never split.
- Decoding works on bytes: each id maps to the bytes it stands for, so the streaming
  detokenizer can hold back an incomplete UTF-8 sequence until the token that completes it.
- Chat templates are Jinja, rendered in a sandbox with the globals HF templates expect.
"""

from __future__ import annotations

import codecs
import json
from datetime import datetime
from functools import cached_property, lru_cache
from typing import Any, Iterable, Iterator

import numpy as np

from cflow import tokenizer_gemma4 as gemma4, tokenizer_spm as spm
from cflow.errors import CflowError
from cflow.tokenizer_pre import build_pre_tokenizer, pre_tokenizer_spec


class TokenizerError(CflowError, ValueError):
    """A tokenizer cannot be built, trained, loaded or used as asked: a malformed description, a
    feature cflow does not support, or a token id outside the vocabulary."""


class ChatTemplateError(CflowError, ValueError):
    """A chat template failed to render (bad messages, or the template raised)."""


# ---- byte-level spelling ---------------------------------------------------------------------
@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (every byte gets a visible char)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


# ---- chat templates --------------------------------------------------------------------------
# Used when the file carries no template: plain ChatML, as HF transformers used to default to.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Tokens that end a turn in common chat formats; generation stops on them as well as on EOS. The
# names llama.cpp's vocabulary loader makes end-of-generation tokens whatever their type
# (llama-vocab.cpp), e.g. <|eom_id|> (Llama 3.1 ends a tool call with it), <|return|> / <|call|>
# (gpt-oss's harmony answer / tool call), [EOT] / [EOS] (Kimi-K2), <turn|> and <|tool_response>
# (Gemma 4's turn end, and its call awaiting a result).
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>")
# Harmony's message structure (gpt-oss): special tokens, but the answer's parser needs them
# (cflow.reasoning), so the detokenizer shows them even when it drops specials, as llama.cpp's
# vocabulary does (it makes them "user defined"). <|end|> only ends one message of an answer
# there, so it is neither a stop token nor hidden when <|return|> and <|call|> are in the vocabulary.
_HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>")
# Mistral's v11 tool calls, `[TOOL_CALLS]NAME[ARGS]{...}` (cflow.serve.tools "mistral11"): the
# parser needs both markers, so a vocabulary whose template writes `[ARGS]` shows them
# (llama.cpp keeps them in the answer as that format's preserved tokens).
_MISTRAL_CALL_MARKERS = ("[TOOL_CALLS]", "[ARGS]")
# Gemma 4's thought channel, `<|channel>thought ... <channel|>` (cflow.reasoning.ThinkParser): shown
# when the template writes it, so that the answer's thought can be told from its content.
_THOUGHT_CHANNEL_MARKERS = ("<|channel>", "<channel|>")


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which changes prompts; HF overrides it like this.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile_template(source: str):
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from None


# ---- the tokenizer ---------------------------------------------------------------------------
class Tokenizer:
    """Byte-level BPE or SentencePiece-style tokenizer built from a header dict (docs/FORMAT.md).

    >>> tok = Tokenizer(cflow_file.tokenizer)
    >>> ids = tok.encode("Hello")            # list[int]
    >>> tok.decode(ids)                      # "Hello"
    """

    def __init__(self, header: dict[str, Any]):
        self.header = _validated(header)
        h = self.header
        self.model: str = h["model"]
        self.vocab: list[str] = h["vocab"]
        self.merges: list[str] = h["merges"]
        self.bos_id: int | None = h["bos_id"]
        self.eos_id: int | None = h["eos_id"]
        self.add_bos: bool = h["add_bos"]
        self._chat_template: str | None = h["chat_template"]
        self.special: dict[str, int] = h["special"]
        self.added: dict[str, int] = h.get("added") or {}
        self.pre: str | None = h["pre"]
        # SentencePiece puts a "▁" before the text; decode() takes that space off again
        self.add_space_prefix: bool = self.model == "spm" and h["add_space_prefix"]
        self._special_ids = self._hidden_ids()
        self._bytes = self._token_bytes()
        self._tk = self._build()

    # ---- construction ------------------------------------------------------------------------
    def _build(self):
        from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models

        if self.model == "spm":
            tk = spm.build_spm(self.header)
        elif self.model == "gemma4":
            tk = gemma4.build_gemma4(self.header, TokenizerError)
        else:
            vocab = {tok: i for i, tok in enumerate(self.vocab)}
            merges = [_split_merge(m) for m in self.merges]
            tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                        ignore_merges=pre_tokenizer_spec(self.pre).ignore_merges))
            tk.pre_tokenizer = build_pre_tokenizer(self.pre)
            tk.decoder = decoders.ByteLevel()
        # Added tokens are matched whole in the raw text, longest first, before any splitting.
        tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in self.special])
        if self.added:
            tk.add_tokens([AddedToken(t, normalized=False, special=False) for t in self.added])
        return tk

    def _token_bytes(self) -> list[bytes]:
        """The bytes each id decodes to: specials and added tokens as their text, others un-spelled."""
        if self.model in ("spm", "gemma4"):  # both spell pieces with "▁" and <0xXX> byte tokens
            return spm.spm_token_bytes(self.vocab, self.header["token_types"])
        inv = unicode_to_bytes()
        literal = {i: t for t, i in {**self.special, **self.added}.items()}
        out = []
        for i, tok in enumerate(self.vocab):
            if i in literal:
                out.append(literal[i].encode("utf-8"))
            elif all(c in inv for c in tok):
                out.append(bytes(inv[c] for c in tok))
            else:
                out.append(tok.encode("utf-8"))  # not byte-level spelled: take it literally
        return out

    def to_header(self) -> dict[str, Any]:
        return dict(self.header)

    @property
    def hf(self):
        """The HF `tokenizers` object encode() runs (without BOS): what training borrows to see these ids."""
        return self._tk

    # ---- properties --------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def harmony(self) -> bool:
        """Whether the vocabulary is gpt-oss's harmony one: <|return|>, <|call|> and <|end|> specials,
        where <|end|> only closes one message of an answer (llama.cpp's test, llama-vocab.cpp)."""
        return all(t in self.special for t in ("<|return|>", "<|call|>", "<|end|>"))

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        # (`cflow serve --chat-template-file` replaces it) which specials show depends on it
        self._chat_template = template
        self._special_ids = self._hidden_ids()

    def _hidden_ids(self) -> frozenset[int]:
        """The ids decode(skip_special=True) and stream(skip_special=True) leave out."""
        return frozenset(i for t, i in self.special.items() if t not in self._visible_specials())

    def _visible_specials(self) -> tuple[str, ...]:
        t = self.chat_template or ""
        calls = _MISTRAL_CALL_MARKERS if "[ARGS]" in t else ()
        thought = _THOUGHT_CHANNEL_MARKERS if "<|channel>" in t else ()
        return _HARMONY_MARKERS + (("<|end|>",) if self.harmony else ()) + calls + thought

    @cached_property
    def _end_of_turn_ids(self) -> frozenset[int]:
        ends = {t for t in _END_OF_TURN if not (self.harmony and t == "<|end|>")}
        return frozenset(i for i, t in enumerate(self.vocab) if t in ends)   # any type, as llama.cpp's

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end generation: EOS plus the end-of-turn tokens the vocabulary has (not
        harmony's <|end|>: see `harmony`)."""
        return self._end_of_turn_ids | ({self.eos_id} if self.eos_id is not None else set())

    def is_special(self, token_id: int) -> bool:
        """Whether skip_special leaves the token out: a special token, but not harmony's structure."""
        return token_id in self._special_ids

    # ---- encode / decode ---------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their ids."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode() takes a str, got {type(text).__name__}")
        # encode_batch, not encode: it releases the GIL (same ids), so a long text tokenized in a worker
        # thread does not stop the server's event loop (measured: 5 MB held it 5.6 s; now < 0.2 s)
        ids = self._tk.encode_batch([text], add_special_tokens=False)[0].ids
        if (self.add_bos if add_bos is None else add_bos):
            if self.bos_id is None:
                raise TokenizerError("add_bos was requested but this tokenizer has no BOS token")
            ids = [self.bos_id] + ids
        return ids

    @property
    def max_token_bytes(self) -> int:
        """Bytes of the longest token's text (special tokens included): what one token can cover."""
        return max((len(b) for b in self._bytes), default=1)

    def token_to_bytes(self, token_id: int) -> bytes:
        return self._bytes[self.check_ids((token_id,))[0]]

    def token_to_piece(self, token_id: int) -> str:
        """The text of one token; a piece that is part of a multi-byte character shows as U+FFFD."""
        return self.token_to_bytes(token_id).decode("utf-8", errors="replace")

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of `ids`, so that decode(encode(s)) == s.

        With SentencePiece's add_space_prefix, the first piece loses one leading space, the one
        encode() put there. llama.cpp's llama_detokenize does so unless the ids start with BOS; we
        also do it after a skipped BOS, as HF and llama_cpp.Llama.detokenize do, so that
        decode(encode(s), skip_special=True) == s. To render tokens that continue a text
        (generation), use stream(), which never strips. Spaces before punctuation are kept: the
        clean-up llama_detokenize applies for some BPE vocabularies (clean_spaces) is not done.
        """
        parts = [self._bytes[i] for i in self.check_ids(ids)
                 if not (skip_special and i in self._special_ids)]
        if self.add_space_prefix and parts and parts[0].startswith(b" "):
            parts[0] = parts[0][1:]
        return b"".join(parts).decode("utf-8", errors="replace")

    def decode_stream(self, ids: Iterable[int], skip_special: bool = False) -> Iterator[str]:
        """Yield text as the ids arrive, each piece only once its UTF-8 characters are complete."""
        stream = self.stream(skip_special=skip_special)
        for i in ids:
            text = stream.put(i)
            if text:
                yield text
        tail = stream.flush()
        if tail:
            yield tail

    def stream(self, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special=skip_special)

    def check_ids(self, ids: Iterable[int] | np.ndarray) -> list[int]:
        """`ids` as Python ints, or TokenizerError when one is not a token id of this vocabulary."""
        return check_token_ids(ids, len(self._bytes))

    # ---- chat --------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs: Any) -> str | list[int]:
        """Render `messages` with the file's chat template (ChatML when it has none).

        Extra keyword arguments reach the template as variables (e.g. `tools=`,
        `reasoning_effort=`). An assistant message's `reasoning_content` reaches templates that
        read `thinking` under that name (cflow.reasoning.template_messages). With
        `tokenize=True` returns ids; no BOS is added because templates write their own.
        """
        _check_messages(messages)
        from cflow.reasoning import template_messages

        messages = template_messages(self.chat_template or "", messages)
        template = _compile_template(self.chat_template or DEFAULT_CHAT_TEMPLATE)
        names = {"bos_token": self.bos_id, "eos_token": self.eos_id}
        variables = {k: (self.vocab[v] if v is not None else "") for k, v in names.items()}
        variables.update(kwargs)
        from jinja2 import TemplateError

        try:
            text = template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **variables)
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template refused these messages: {e}") from None
        return self.encode(text, add_bos=False) if tokenize else text


class StreamDecoder:
    """Incremental detokenizer: `put(id)` returns the newly completed text ('' while a character
    is still incomplete); `flush()` returns what is left, invalid bytes as U+FFFD.

    Concatenating every `put` and the final `flush` equals `Tokenizer.decode` of the same ids,
    except for the leading space decode() strips from SentencePiece text: the stream renders
    tokens as the continuation of a text, as llama.cpp's token_to_piece does.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._skip = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def put(self, token_id: int) -> str:
        if self._skip and self._tok.is_special(token_id):
            return ""
        return self._utf8.decode(self._tok.token_to_bytes(token_id))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


# ---- token ids and header validation ---------------------------------------------------------
def check_token_ids(ids: Iterable[int] | np.ndarray, vocab_size: int, *,
                    error: type[Exception] = TokenizerError) -> list[int]:
    """`ids` (any iterable or array of integers) as a list of Python ints; raises `error` naming
    the first offenders when one is not an integer in 0..vocab_size-1.

    The one token-id range check: the tokenizer uses it, and the engine and the reference model
    can pass their own error class so callers see the error of the API they called.
    """
    if not isinstance(ids, np.ndarray):
        ids = list(ids)  # a generator would otherwise become a 0-d object array
    arr = np.asarray(ids).reshape(-1)
    if arr.size == 0:
        return []
    if arr.dtype.kind not in "iu":  # floats, bools, strings, ints too large for int64 (object)
        raise error(f"token ids must be integers, got {arr.dtype} values such as {arr[:3].tolist()}")
    bad = arr[(arr < 0) | (arr >= vocab_size)]
    if bad.size:
        raise error(f"token ids {bad[:5].tolist()} are outside the vocabulary (0..{vocab_size - 1})")
    return arr.tolist()


_HEADER_KEYS = ("model", "vocab", "merges", "bos_id", "eos_id", "add_bos", "chat_template", "special", "pre")


def _validated(h: Any) -> dict[str, Any]:
    if not isinstance(h, dict):
        raise TokenizerError("the tokenizer header must be a JSON object; re-convert the model")
    missing = [k for k in _HEADER_KEYS if k not in h]
    if missing:
        raise TokenizerError(f"the tokenizer header lacks {missing}; re-convert the model with this cflow")
    if h["model"] not in ("bpe", "spm", "gemma4"):
        raise TokenizerError(f"tokenizer model {h['model']!r} is not supported; cflow has byte-level "
                             "'bpe', SentencePiece-style 'spm' and Gemma 4's 'gemma4'")
    vocab, merges = h["vocab"], h["merges"]
    if not (isinstance(vocab, list) and vocab and all(isinstance(t, str) for t in vocab)):
        raise TokenizerError("tokenizer 'vocab' must be a non-empty list of strings")
    if not (isinstance(merges, list) and all(isinstance(m, str) for m in merges)):
        raise TokenizerError("tokenizer 'merges' must be a list of 'left right' strings")
    if h["model"] == "spm":
        if merges or h["pre"] is not None:
            raise TokenizerError("an spm tokenizer has no 'merges' (its scores imply them) and no 'pre'; "
                                 "write [] and null")
        spm.validate_spm(h, TokenizerError)
    elif h["model"] == "gemma4":
        gemma4.validate_gemma4(h, TokenizerError)
    else:
        pre_tokenizer_spec(h["pre"])
    n = len(vocab)
    for key in ("bos_id", "eos_id"):
        v = h[key]
        if v is not None and not (isinstance(v, int) and 0 <= v < n):
            raise TokenizerError(f"tokenizer {key} {v!r} is not a token id (vocabulary size {n})")
    for key in ("special", "added"):
        table = h.get(key) or {}
        if not isinstance(table, dict):
            raise TokenizerError(f"tokenizer {key!r} must map token text to id")
        for t, i in table.items():
            if not (isinstance(i, int) and 0 <= i < n and vocab[i] == t):
                raise TokenizerError(f"tokenizer {key} token {t!r} -> {i!r} does not match the vocabulary")
    if h["chat_template"] is not None and not isinstance(h["chat_template"], str):
        raise TokenizerError("tokenizer 'chat_template' must be a string or null")
    return h


def _split_merge(m: str) -> tuple[str, str]:
    parts = m.split(" ")
    if len(parts) != 2 or not all(parts):
        raise TokenizerError(f"merge {m!r} is not two tokens separated by one space")
    return parts[0], parts[1]


# the variables apply_chat_template sets itself: extra template variables may not replace them
TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tokenize")


def check_template_variables(value: Any, reserved: tuple[str, ...] = ()) -> dict[str, Any]:
    """Extra chat-template variables checked (llama.cpp's --chat-template-kwargs, e.g.
    {"enable_thinking": false}): an object whose keys are names, none that the template call sets
    itself (TEMPLATE_VARIABLES, and the caller's `reserved`); ChatTemplateError naming the problem."""
    if not isinstance(value, dict):
        raise ChatTemplateError(f"chat template variables must be a JSON object, got {type(value).__name__}")
    for k in value:
        if not isinstance(k, str) or not k.isidentifier():
            raise ChatTemplateError(f"chat template variable names must be identifiers, got {k!r}"[:200])
        if k in TEMPLATE_VARIABLES or k in reserved:
            raise ChatTemplateError(f"the chat template variable {k!r} is set by cflow itself and cannot be given")
    return dict(value)


def _check_messages(messages: Any) -> None:
    # Content may be absent (e.g. a tool call); the template decides what it needs.
    if not isinstance(messages, list):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ChatTemplateError(f"message {i} must be a dict with a 'role', got {m!r}")
