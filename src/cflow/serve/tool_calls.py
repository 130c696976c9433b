"""Tool calls in generated text: the model's answer (special tokens already dropped) split into
content and OpenAI tool calls as it streams, in the syntax of the format cflow.serve.tools
detected from the chat template (that module's docstring describes each), and for harmony answers
after cflow.reasoning.HarmonyParser's channels; `<think>` reasoning first where the prompt asks.

Choices: calls with unknown names or unparsable arguments are left as content, never guessed at;
a truncated answer stays content rather than being lost; `tool_choice: "none"` parses nothing.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import Any

from cflow.reasoning import held_back
from cflow.serve.tools import ARGS, CLOSE, FORMATS, OPEN, PYTHON_TAG, TOOL_CALLS, ToolRequest

_ID_CHARS = string.ascii_letters + string.digits
_XML_CALL = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*", re.S)  # qwen3coder's XML in a block
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def new_call(name: str, arguments: dict) -> dict:
    return {"id": "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24)), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))}}


class ToolCallParser:
    """Splits generated text (special tokens already dropped) into content and tool calls as it
    streams. `feed` returns the content that is safe to show now and the calls completed now,
    holding back what may still turn out to be a call (a partial `<tool_call>`, a leading `{`);
    `finish` returns the rest. The result does not depend on how the text was cut into pieces."""

    def __init__(self, fmt: str, req: ToolRequest | None):
        self.fmt = fmt
        self.names = {t["function"]["name"] for t in req.tools} if req else set()
        self.params = {t["function"]["name"]: t["function"].get("parameters") or {} for t in req.tools} if req else {}
        # harmony answers go through AnswerParser (channels, then calls): here they are text
        self.off = req is None or req.choice == "none" or fmt not in FORMATS or fmt == "harmony"
        self.buf = ""
        # hermes, qwen3coder: "start" | "call"; others: "start" | "text" | "hold" | "resp" | "tail"
        self.mode = "start"
        self.after_call = False  # hermes: whitespace after a call is dropped
        self.ws = ""             # hermes: the whitespace before the open call, shown if it is no call

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.off:
            return text, []
        self.buf += text
        if self.fmt == "mistral11":
            return self._marked(False)
        return self._hermes(False) if self.fmt in ("hermes", "qwen3coder") else self._leading(False)

    def finish(self) -> tuple[str, list[dict]]:
        if self.off:
            return "", []
        if self.fmt == "mistral11":
            out = self._marked(True)
        else:
            out = self._hermes(True) if self.fmt in ("hermes", "qwen3coder") else self._leading(True)
        self.buf = ""
        return out

    # -- hermes: content with <tool_call> blocks anywhere --
    def _hermes(self, final: bool) -> tuple[str, list[dict]]:
        content, calls = [], []
        while True:
            if self.mode == "call":
                j = self.buf.find(CLOSE)
                if j < 0 and not final:
                    break
                body, self.buf = (self.buf, "") if j < 0 else (self.buf[:j], self.buf[j + len(CLOSE):])
                call = self._call(body)   # an unclosed block at the end counts if complete
                if call:
                    calls.append(call)
                    self.after_call = True
                else:
                    content.append(self._text(self.ws + OPEN + body + (CLOSE if j >= 0 else "")))
                self.mode = "start"
                continue
            i = self.buf.find(OPEN)
            if i >= 0:
                text, self.buf, self.mode = self.buf[:i], self.buf[i + len(OPEN):], "call"
                kept = text.rstrip()
                self.ws = text[len(kept):]
                content.append(self._text(kept))
                continue
            cut = len(self.buf)
            if not final:
                # hold back what could begin a <tool_call>, and trailing whitespace (dropped if one follows)
                cut -= next((k for k in range(min(len(OPEN) - 1, cut), 0, -1) if OPEN.startswith(self.buf[-k:])), 0)
                while cut and self.buf[cut - 1].isspace():
                    cut -= 1
            content.append(self._text(self.buf[:cut]))
            self.buf = self.buf[cut:]
            break
        return "".join(content), calls

    def _text(self, s: str) -> str:
        if self.after_call:
            s = s.lstrip()
            self.after_call = not s
        return s

    def _call(self, body: str) -> dict | None:
        if self.fmt == "qwen3coder":
            return self._xml_call(body)
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        return self._valid(obj)

    def _xml_call(self, body: str) -> dict | None:
        """A qwen3coder block's `<function=NAME>` and `<parameter=KEY>VALUE</parameter>`s as a call;
        None when anything but whitespace lies around them. A value is its text when the tool's
        schema says string (or it is no JSON), else the JSON it spells (as llama.cpp's Qwen3-Coder
        XML handler reads them: string parameters as text, the others as JSON)."""
        m = _XML_CALL.fullmatch(body)
        if not m:
            return None
        name, inner = m.group(1).strip(), m.group(2)
        props = (self.params.get(name) or {}).get("properties") or {}
        args: dict[str, Any] = {}
        pos = 0
        for pm in _XML_PARAM.finditer(inner):
            if inner[pos:pm.start()].strip():
                return None
            key, raw = pm.group(1).strip(), pm.group(2)
            value: Any = raw
            if (props.get(key) or {}).get("type") != "string":
                try:
                    value = json.loads(raw)
                except ValueError:
                    pass
            args[key] = value
            pos = pm.end()
        return self._valid({"name": name, "arguments": args}) if not inner[pos:].strip() else None

    def _valid(self, obj: Any) -> dict | None:
        """A call object {"name", "arguments" (or "parameters": Llama)} naming a known tool, as an
        OpenAI tool call; None when it is anything else."""
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):   # some models write the arguments as a JSON string
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                return None
        return new_call(obj["name"], args) if isinstance(args, dict) else None

    # -- mistral11: content, then from the first [TOOL_CALLS] on the calls, to the end --
    def _marked(self, final: bool) -> tuple[str, list[dict]]:
        content = ""
        if self.mode == "start":
            i = self.buf.find(TOOL_CALLS)
            if i < 0:   # content, but for what may begin the marker
                cut = len(self.buf) if final else len(self.buf) - held_back(self.buf, TOOL_CALLS)
                content, self.buf = self.buf[:cut], self.buf[cut:]
                return content, []
            content, self.buf, self.mode = self.buf[:i], self.buf[i:], "call"
        if not final:
            return content, []
        calls = self._marked_calls(self.buf)
        content, self.buf = (content, "") if calls is not None else (content + self.buf, "")
        return content, calls or []

    def _marked_calls(self, text: str) -> list[dict] | None:
        """`[TOOL_CALLS]NAME[ARGS]{...}` repeated, whitespace around, as calls; None when any part
        is not a call of a known tool with a JSON object of arguments (the text is then content)."""
        calls = []
        for part in text.split(TOOL_CALLS)[1:]:
            name, sep, rest = part.partition(ARGS)
            rest = rest.strip()
            try:
                args, end = json.JSONDecoder().raw_decode(rest)
            except ValueError:
                return None
            call = self._valid({"name": name.strip(), "arguments": args}) if sep and end == len(rest) else None
            if call is None:
                return None
            calls.append(call)
        return calls

    # -- llama3, mistral, generic: the answer is a call when it starts with JSON --
    def _leading(self, final: bool) -> tuple[str, list[dict]]:
        content: list[str] = []
        calls: list[dict] = []
        while True:
            if self.mode == "start":
                s = self.buf.lstrip()
                for tag in (PYTHON_TAG, TOOL_CALLS):   # when the vocabulary has them as plain text
                    if s.startswith(tag):
                        s = s[len(tag):].lstrip()
                    elif tag.startswith(s) and s and not final:
                        return "", []
                if not s:
                    if final:
                        content.append(self.buf)
                        self.buf = ""
                    break
                if self.fmt == "generic":
                    at = _match_prefix(s, ["{", None, '"response"', None, ":", None, '"'])
                    if at == -1 and not final:
                        break
                    if at is not None and at >= 0:
                        self.mode, self.buf = "resp", s[at:]
                        continue
                self.mode = "hold" if s[0] == {"llama3": "{", "mistral": "["}.get(self.fmt, "{") else "text"
                continue
            if self.mode == "text":
                content.append(self.buf)
                self.buf = ""
            elif self.mode == "resp":
                text, used, state = _json_string_chunk(self.buf)
                content.append(text)
                self.buf = self.buf[used:]
                if state != "open":
                    self.mode = "tail" if state == "closed" else "text"
                    continue
                if final:
                    content.append(self.buf)   # an escape cut off at the end: as it was
                    self.buf = ""
            elif self.mode == "tail":
                if final and self.buf.strip() != "}":
                    content.append(self.buf)
                    self.buf = ""
            elif final:  # "hold": the whole answer is the candidate
                text, found = self._whole(self.buf)
                content.append(text)
                calls += found
                self.buf = ""
            break
        return "".join(content), calls

    def _whole(self, raw: str) -> tuple[str, list[dict]]:
        """Calls when the whole answer is valid call JSON, else the answer as content."""
        s = raw.strip()
        for tag in (PYTHON_TAG, TOOL_CALLS):
            if s.startswith(tag):
                s = s[len(tag):].lstrip()
        objs = _json_values(s)
        if objs is None:
            return raw, []
        if self.fmt == "generic":
            if len(objs) != 1 or not isinstance(objs[0], dict):
                return raw, []
            o = objs[0]
            text = o.get("response", "")
            items = o.get("tool_calls", [o["tool_call"]] if "tool_call" in o else [])
            if not isinstance(text, str) or not isinstance(items, list) or not (items or "response" in o) \
                    or set(o) - {"response", "tool_calls", "tool_call"}:
                return raw, []
        else:  # llama3: objects separated by ";" (vLLM's convention); mistral: an array of them
            items = [x for o in objs for x in (o if isinstance(o, list) else [o])]
            text = ""
        calls = [self._valid(x) for x in items]
        if not all(calls) or (not calls and self.fmt != "generic"):
            return raw, []
        return text, calls  # type: ignore[return-value]


def parse_all(fmt: str, req: ToolRequest | None, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole answer; content None when there are calls and no text,
    as OpenAI's."""
    p = ToolCallParser(fmt, req)
    c1, k1 = p.feed(text)
    c2, k2 = p.finish()
    content, calls = c1 + c2, k1 + k2
    return (None if calls and not content.strip() else content), calls


class AnswerParser:
    """One choice's generated text -> (reasoning, content, tool calls), as it streams: the
    channels of a harmony answer (cflow.reasoning.HarmonyParser), its calls checked as every
    format's are (a known tool, arguments a JSON object; anything else is content); other
    formats' calls are ToolCallParser's, found in what follows the `<think>` block when `think`
    is not None (cflow.reasoning.ThinkParser; True: the prompt opened the thought).
    `thoughts_in_content`: a harmony answer's analysis messages stay in the content as written
    (reasoning_format "none"); a `<think>` block does when `think` is None."""

    def __init__(self, fmt: str, req: ToolRequest | None, think: bool | None = None,
                 thoughts_in_content: bool = False):
        from cflow.reasoning import HarmonyParser, ThinkParser

        self.harmony = HarmonyParser(thoughts_in_content) if fmt == "harmony" else None
        self.think = ThinkParser(think) if think is not None and self.harmony is None else None
        self.tools = ToolCallParser(fmt, req)
        self.names = {t["function"]["name"] for t in req.tools} if req and req.choice != "none" else set()

    def feed(self, text: str) -> tuple[str, str, list[dict]]:
        if self.harmony is not None:
            return self._checked(self.harmony.feed(text))
        if self.think is None:
            return ("", *self.tools.feed(text))
        part = self.think.feed(text)
        return (part.reasoning, *self.tools.feed(part.content))

    def finish(self) -> tuple[str, str, list[dict]]:
        if self.harmony is not None:
            return self._checked(self.harmony.finish())
        reasoning = ""
        if self.think is not None:
            part = self.think.finish()
            reasoning, (content, calls) = part.reasoning, self.tools.feed(part.content)
        else:
            content, calls = "", []
        rest, more = self.tools.finish()
        return reasoning, content + rest, calls + more

    def _checked(self, parsed: Any) -> tuple[str, str, list[dict]]:
        content, calls = parsed.content, []
        for name, raw in parsed.calls:
            call = None
            if name in self.names:
                try:
                    args = json.loads(raw) if raw.strip() else {}
                except ValueError:
                    args = None
                call = new_call(name, args) if isinstance(args, dict) else None
            if call:
                calls.append(call)
            else:
                content += raw
        return parsed.reasoning, content, calls


def parse_answer(fmt: str, req: ToolRequest | None, text: str, think: bool | None = None,
                 thoughts_in_content: bool = False) -> tuple[str | None, str | None, list[dict]]:
    """(reasoning, content, tool calls) of a whole answer (`think`, `thoughts_in_content` as
    AnswerParser's): reasoning None when there is none; content None when there are calls and no
    text, as OpenAI's."""
    p = AnswerParser(fmt, req, think, thoughts_in_content)
    r1, c1, k1 = p.feed(text)
    r2, c2, k2 = p.finish()
    content, calls = c1 + c2, k1 + k2
    return (r1 + r2) or None, (None if calls and not content.strip() else content), calls


# ---- text helpers ------------------------------------------------------------------------------
def _match_prefix(s: str, parts: list[str | None]) -> int | None:
    """Where `s` matches the literals in `parts` (None: optional whitespace) in full: the index
    after the match; -1 when `s` ends before the match does (undecided); None when it differs."""
    i = 0
    for p in parts:
        if p is None:
            while i < len(s) and s[i] in " \t\r\n":
                i += 1
            continue
        n = min(len(p), len(s) - i)
        if s[i:i + n] != p[:n]:
            return None
        if n < len(p):
            return -1
        i += n
    return i


_ESC = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LOW_PREFIX = re.compile(r"(\\(u([dD]([c-fC-F][0-9a-fA-F]{0,2})?)?)?)?")
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")


def _json_string_chunk(s: str) -> tuple[str, int, str]:
    """Decode the inside of a JSON string from the start of `s` as far as it is complete:
    (text, characters used, state): "closed" (used includes the closing quote), "open" (more
    may follow; an escape cut off at the end is not used), "bad" (an invalid escape at `used`).
    Each decision looks only at characters present, so any cut of the stream decodes alike."""
    out, i, n = [], 0, len(s)
    while i < n:
        c = s[i]
        if c == '"':
            return "".join(out), i + 1, "closed"
        if c != "\\":
            out.append(c)
            i += 1
            continue
        if i + 1 >= n:
            break
        e = s[i + 1]
        if e in _ESC:
            out.append(_ESC[e])
            i += 2
            continue
        h = s[i + 2:i + 6]
        if e != "u" or not re.fullmatch(r"[0-9a-fA-F]*", h):
            return "".join(out), i, "bad"
        if len(h) < 4:
            break
        cp = int(h, 16)
        if 0xD800 <= cp < 0xDC00:   # a high surrogate: its pair is the next escape
            nxt = s[i + 6:i + 12]
            if len(nxt) < 6 and _LOW_PREFIX.fullmatch(nxt):
                break
            if nxt[:2] == "\\u" and _HEX4.fullmatch(nxt[2:]) and 0xDC00 <= int(nxt[2:], 16) < 0xE000:
                out.append(chr(0x10000 + ((cp - 0xD800) << 10) + int(nxt[2:], 16) - 0xDC00))
                i += 12
                continue
            cp = 0xFFFD
        out.append("\ufffd" if 0xDC00 <= cp < 0xE000 else chr(cp))
        i += 6
    return "".join(out), i, "open"


def _json_values(s: str) -> list[Any] | None:
    """The JSON values `s` consists of, separated by whitespace or ";"; None if it is anything else."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(s) and (s[i].isspace() or (s[i] == ";" and out)):
            i += 1
        if i == len(s):
            return out or None
        try:
            v, i = dec.raw_decode(s, i)
        except ValueError:
            return None
        out.append(v)
