"""The assistant's reasoning in a chat: its way into a chat template and out of generated text.

OpenAI-compatible servers (llama.cpp's llama-server, vLLM) carry a reasoning model's thoughts in
the assistant message's `reasoning_content`, beside `content`. This module owns both directions,
with no HTTP and no engine (cflow.serve.tool_calls picks the parser for a model's format,
cflow.serve.call and cflow.cli.chat run it):

- Into the template: `template_messages` hands `reasoning_content` to templates that read
  `thinking` instead (gpt-oss's harmony template), as llama.cpp's common/chat does for gpt-oss:
  `thinking` = `reasoning_content`, and an assistant message with tool calls then loses its
  `content` (the template refuses both; the thinking is what precedes the call); a null
  `content` becomes "" (llama.cpp never sends null content to a template).
- Out of the text: `HarmonyParser` splits gpt-oss's harmony answer (or, told
  `thoughts_in_content`, leaves its analysis messages in the content, as llama-server's
  reasoning_format "none" does). After the prompt's
  `<|start|>assistant` the model writes messages `HEADER<|message|>BODY<|end|>`, each after the
  first opened by `<|start|>assistant`; the header names the channel (`<|channel|>analysis`:
  reasoning; `final`, or `commentary` with no recipient: content) and, for a tool call, the
  recipient (` to=functions.NAME`, before or after the channel) and a content type
  (`<|constrain|>json` or `json`). The answer ends with <|return|> or, after a call, <|call|>;
  both stop generation, so the parser never sees them. The structure tokens are special tokens
  that cflow.tokenizer keeps in the detokenized text of a harmony vocabulary.
- `ThinkParser`: templates whose model thinks in `<think>...</think>` (Qwen3, DeepSeek-R1) or on
  Gemma 4's thought channel (`<|channel>thought ... <channel|>`, its markers kept in the text by
  cflow.tokenizer) before answering: the thought becomes `reasoning_content`, what follows its
  end the content (llama-server's --reasoning-format deepseek). A prompt that already opened
  `<think>` (the template's generation prompt) is told to the parser, which then starts inside
  the thought.

Both parsers stream: `feed(text)` returns what is decided now, `finish()` the rest, and the
result does not depend on how the text was cut into pieces. Choices: text that breaks the
structure is content, never dropped; a tool call's arguments are returned as the raw text the
model wrote (the caller checks names and JSON); an unfinished answer (max_tokens) keeps what it
has in the channel it was in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

START, CHANNEL, MESSAGE, END, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Gemma 4's thought: `<|channel>thought\n...\n<channel|>` before the answer
THOUGHT_CHANNEL_OPEN, THOUGHT_CHANNEL_CLOSE = "<|channel>thought", "<channel|>"
_THOUGHT_TAGS = {THINK_OPEN: THINK_CLOSE, THOUGHT_CHANNEL_OPEN: THOUGHT_CHANNEL_CLOSE}
_READS_THINKING = re.compile(r"""\.thinking\b|\[\s*['"]thinking['"]\s*\]|['"]thinking['"]\s+in\s+message""")
_HEADER_MAX = 256   # a header longer than this without <|message|> is not one: the text is content


def is_harmony(template: str | None) -> bool:
    """Whether a chat template writes gpt-oss's harmony format (llama.cpp's test: `<|channel|>`)."""
    return CHANNEL in (template or "")


def thinks_in_tags(template: str | None) -> bool:
    """Whether a chat template's model thinks in `<think>...</think>` (Qwen3, DeepSeek-R1) or on
    Gemma 4's thought channel."""
    return any(tag in (template or "") for tag in _THOUGHT_TAGS) and not is_harmony(template)


# How many of a rendered prompt's last tokens prompt_tail decodes: enough for `<think>` and the
# whitespace a template writes around it, whatever the tokenizer splits them into.
PROMPT_TAIL_TOKENS = 16


def prompt_tail(tokenizer: Any, ids: Sequence[int]) -> str:
    """The text of a rendered prompt's last tokens: what prompt_opens_thought and answer_parser read."""
    return tokenizer.decode(list(ids[-PROMPT_TAIL_TOKENS:]))


def prompt_opens_thought(prompt_tail: str) -> bool:
    """Whether a rendered prompt ends inside a thought (the generation prompt wrote `<think>`)."""
    return prompt_tail.rstrip().endswith(THINK_OPEN)


def answer_parser(template: str | None, prompt_tail: str = "") -> "HarmonyParser | ThinkParser | None":
    """The parser that splits a model's answers, from its chat template (and the end of the
    prompt it rendered): harmony's channels, `<think>` tags, or None (the answer is all content)."""
    if is_harmony(template):
        return HarmonyParser()
    return ThinkParser(prompt_opens_thought(prompt_tail)) if thinks_in_tags(template) else None


def template_messages(template: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as a template that reads `thinking` wants them (see the module docstring);
    other templates get them unchanged."""
    if not _READS_THINKING.search(template):
        return messages
    out = []
    for m in messages:
        m = dict(m)
        if "content" in m and m["content"] is None:
            m["content"] = ""
        r = m.get("reasoning_content")
        if isinstance(r, str) and r:
            m["thinking"] = r
            if m.get("tool_calls"):
                m.pop("content", None)
        out.append(m)
    return out


@dataclass
class Parsed:
    """A piece of a parsed answer: reasoning text, content text, and the tool calls completed,
    each (recipient function name, raw arguments text)."""
    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)

    def __iadd__(self, other: "Parsed") -> "Parsed":
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self


def held_back(buf: str, *marks: str) -> int:
    """How many characters at the end of `buf` could begin one of `marks` (held back in a stream)."""
    best = 0
    for mark in marks:
        for k in range(min(len(mark) - 1, len(buf)), best, -1):
            if mark.startswith(buf[-k:]):
                best = k
                break
    return best


class _StreamParser:
    """Text in as it streams (`feed`), the parsed part out; `finish` flushes what was held back.
    A subclass's `_run(final)` consumes `self.buf`."""

    buf: str

    def feed(self, text: str) -> Parsed:
        self.buf += text
        return self._run(False)

    def finish(self) -> Parsed:
        out = self._run(True)
        self.buf = ""
        return out

    def _run(self, final: bool) -> Parsed:
        raise NotImplementedError


class HarmonyParser(_StreamParser):
    """gpt-oss's harmony answer -> reasoning, content, tool calls, as it streams."""

    # what the first message may begin with: the prompt's "<|start|>assistant" goes on with a
    # header, or the model opens a message of its own
    _FIRST = (START, CHANNEL, " to=", "to=", CONSTRAIN)

    def __init__(self, thoughts_in_content: bool = False) -> None:
        self.buf = ""
        self.mode = "first"   # "first" | "next" (after <|end|>) | "header" | "body" | "plain"
        # the body's: "reasoning" | "content" | "call" | "raw" (an analysis message kept as content)
        self.channel = ""
        self.recipient = ""
        # llama-server's reasoning_format "none": an analysis message goes to the content as
        # written, header and <|end|> included (the role that opened it is not)
        self.thoughts_in_content = thoughts_in_content

    def _run(self, final: bool) -> Parsed:
        out = Parsed()
        while True:
            if self.mode in ("first", "next"):
                starts = self._FIRST if self.mode == "first" else (START,)
                if any(self.buf.startswith(s) for s in starts):
                    if self.buf.startswith(START):   # the role that follows is part of the header
                        self.buf = self.buf[len(START):]
                    self.mode = "header"
                    continue
                if not final and any(s.startswith(self.buf) for s in starts):
                    break   # undecided (empty, or a prefix of a header's start)
                if self.buf:
                    self.mode = "plain"
                    continue
                break
            if self.mode == "header":
                j = self.buf.find(MESSAGE)
                if 0 <= j <= _HEADER_MAX:
                    self._header(self.buf[:j])
                    if self.channel == "reasoning" and self.thoughts_in_content:
                        self.channel = "raw"
                        out.content += self.buf[:j].removeprefix("assistant") + MESSAGE
                    self.buf, self.mode = self.buf[j + len(MESSAGE):], "body"
                    continue
                if len(self.buf) > _HEADER_MAX or final:
                    self.mode = "plain"   # no header after all: the text as it is
                    continue
                break
            if self.mode == "body":
                j = self.buf.find(END)
                if j >= 0 or final:
                    body, self.buf = (self.buf, "") if j < 0 else (self.buf[:j], self.buf[j + len(END):])
                    self._body(out, body, whole=True)
                    if j >= 0 and self.channel == "raw":
                        out.content += END
                    if j < 0:
                        break
                    self.mode = "next"
                    continue
                if self.channel != "call":   # a call's arguments are given whole; text streams
                    cut = len(self.buf) - held_back(self.buf, END)
                    self._body(out, self.buf[:cut], whole=False)
                    self.buf = self.buf[cut:]
                break
            # "plain": text outside the structure is content, up to the end
            out.content += self.buf
            self.buf = ""
            break
        return out

    def _header(self, header: str) -> None:
        to = re.search(r"\bto=(\S+?)(?=<\||\s|$)", header)
        channel = re.search(re.escape(CHANNEL) + r"(\w+)", header)
        name = channel.group(1) if channel else ""
        self.recipient = to.group(1) if to else ""
        if self.recipient.startswith("functions."):
            self.channel = "call"
        elif name == "analysis":
            self.channel = "reasoning"
        else:   # final, a commentary preamble, or no channel
            self.channel = "content"

    def _body(self, out: Parsed, text: str, whole: bool) -> None:
        if self.channel == "call":
            if whole:
                out.calls.append((self.recipient[len("functions."):], text))
        elif self.channel == "reasoning":
            out.reasoning += text
        else:   # content, or a thought kept as content
            out.content += text


class ThinkParser(_StreamParser):
    """`<think>reasoning</think>content` (or Gemma 4's `<|channel>thought reasoning<channel|>`)
    -> reasoning and content, as it streams. `opened`: the prompt ended inside the thought (its
    generation prompt wrote `<think>`). The reasoning is
    stripped of surrounding whitespace (held back while it may be trailing) and the whitespace
    between </think> and the answer dropped, as llama.cpp's deepseek reasoning format does."""

    def __init__(self, opened: bool = False) -> None:
        self.buf = ""
        self.mode = "think" if opened else "start"   # "start" | "think" | "after" | "content"
        self.started = False                         # the reasoning has shown a non-space
        self.close = THINK_CLOSE                     # what ends the thought that opened

    def _run(self, final: bool) -> Parsed:
        out = Parsed()
        while True:
            if self.mode == "start":
                s = self.buf.lstrip()
                tag = next((t for t in _THOUGHT_TAGS if s.startswith(t)), None)
                if tag is not None:
                    self.buf, self.mode, self.close = s[len(tag):], "think", _THOUGHT_TAGS[tag]
                    continue
                if not final and any(t.startswith(s) for t in _THOUGHT_TAGS):
                    break   # nothing yet, or a prefix of an opening tag
                self.mode = "content"
                continue
            if self.mode == "think":
                j = self.buf.find(self.close)
                if j >= 0:
                    text, rest, closed = self.buf[:j], self.buf[j + len(self.close):], True
                else:
                    cut = len(self.buf) if final else len(self.buf) - held_back(self.buf, self.close)
                    text, rest, closed = self.buf[:cut], self.buf[cut:], final
                if not self.started:
                    text = text.lstrip()
                shown = text.rstrip()
                if not closed:   # trailing whitespace waits: it is dropped if </think> follows
                    rest = text[len(shown):] + rest
                out.reasoning += shown
                self.started = self.started or bool(shown)
                self.buf = rest
                if j >= 0:
                    self.mode = "after"
                    continue
                break
            if self.mode == "after":   # the whitespace between the thought and the answer is dropped
                self.buf = self.buf.lstrip()
                if not self.buf:
                    break
                self.mode = "content"
            out.content += self.buf
            self.buf = ""
            break
        return out
