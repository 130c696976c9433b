"""cflow.serve.tools: OpenAI tool calling. Request checks, the history as each family's template
reads it, format detection, the constraints (every grammar validated by llguidance and run on
byte-level vocabularies built like the real families'), and the parser, streamed at every cut."""

from __future__ import annotations

import json
import random
from functools import lru_cache
from pathlib import Path

import pytest

from cflow.serve import tool_calls as TC
from cflow.serve import tools as T
from cflow.serve.protocol import BadRequest
from cflow.tokenizer import Tokenizer, bytes_to_unicode

llguidance = pytest.importorskip("llguidance")

# ---- templates, after each family's real one ---------------------------------------------------
QWEN = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen.' }}{%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}{{- '<|im_start|>system\nYou are Qwen.<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

LLAMA31 = r"""{{- bos_token }}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}{{- "Environment: ipython\n" }}{%- endif %}
{{- system_message }}{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {%- set first_user_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\n\n" }}{%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}{{- raise_exception("This model only supports single tool-calls at once!") }}{%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}{{- '"parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}" }}{{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}{{- message.content }}{{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

MISTRAL = r"""{%- if messages[0]["role"] == "system" %}{%- set system_message = messages[0]["content"] %}{%- set loop_messages = messages[1:] %}
{%- else %}{%- set loop_messages = messages %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}{{- tool | tojson }}{%- if not loop.last %}{{- ", " }}{%- endif %}{%- endfor %}
            {{- "][/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {{- "[INST] " + message["content"] + "[/INST]" }}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool" %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""



def real_template(name: str) -> str:
    """A model's own template from tests/data (sources in tests/test_chat_templates.py)."""
    with open(Path(__file__).parent / "data" / f"{name}_chat_template.jinja", encoding="utf-8", newline="") as f:
        return f.read()


QWEN35 = real_template("qwen3_5")          # XML calls in <tool_call>
MINISTRAL3 = real_template("ministral_3")  # [TOOL_CALLS]name[ARGS]{...}
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# (template, special tokens (the first is EOS), added non-special tokens)
FAMILIES = {
    "hermes": (QWEN, ["<|im_end|>", "<|im_start|>", "<|endoftext|>"], ["<tool_call>", "</tool_call>"]),
    "qwen3coder": (QWEN35, ["<|im_end|>", "<|im_start|>", "<|endoftext|>"], ["<tool_call>", "</tool_call>"]),
    "llama3": (LLAMA31, ["<|eot_id|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                         "<|python_tag|>", "<|eom_id|>"], []),
    "mistral": (MISTRAL, ["</s>", "<s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                          "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], []),
    "mistral11": (MINISTRAL3, ["</s>", "<s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]", "[AVAILABLE_TOOLS]",
                               "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]",
                               "[/SYSTEM_PROMPT]"], []),
    "generic": (CHATML, ["<|im_end|>", "<|im_start|>"], []),
}


@lru_cache(maxsize=None)
def tokenizer(fmt: str) -> Tokenizer:
    """A byte-level BPE vocabulary (no merges: one token per byte) with the family's tokens."""
    template, special, added = FAMILIES[fmt]
    b2u = bytes_to_unicode()
    vocab = [b2u[b] for b in range(256)] + special + added
    bos = special[1] if fmt in ("llama3", "mistral", "mistral11") else None
    return Tokenizer({"model": "bpe", "vocab": vocab, "merges": [], "bos_id": vocab.index(bos) if bos else None,
                      "eos_id": 256, "add_bos": False, "chat_template": template,
                      "special": {t: vocab.index(t) for t in special},
                      "added": {t: vocab.index(t) for t in added}, "pre": "gpt2"})


class _Vocab:
    """What llguidance.TokenizerWrapper reads: each id's bytes, specials as 0xFF + text."""

    def __init__(self, tok: Tokenizer):
        sp = set(tok.special.values())
        self.tokens = [bytes([i]) if i < 256 else (b"\xff" if i in sp else b"") + t.encode()
                       for i, t in enumerate(tok.vocab)]
        self.eos_token_id, self.bos_token_id, self.special_token_ids = tok.eos_id, tok.bos_id, sorted(sp)

    def __call__(self, b: bytes) -> list[int]:
        return list(b)


@lru_cache(maxsize=None)
def lltok(fmt: str):
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab(tokenizer(fmt))))


def lark(text: str) -> str:
    g = llguidance.LLMatcher.grammar_from_lark(text)
    assert llguidance.LLMatcher.validate_grammar(g) == ""
    return g


def schema_grammar(schema: dict) -> str:
    from cflow.constrain import ConstraintSpec

    g = ConstraintSpec("json_schema", schema).grammar()   # as the server compiles it
    assert llguidance.LLMatcher.validate_grammar(g) == ""
    return g


def accepts(fmt: str, grammar: str, text: str, pre: tuple[int, ...] = ()) -> bool:
    """Whether the grammar takes exactly this text (after the token ids `pre`) and may stop there."""
    m = llguidance.LLMatcher(lltok(fmt), grammar, log_level=0)
    ok = m.consume_tokens(list(pre) + tokenizer(fmt).encode(text))
    return ok and not m.is_error() and m.is_accepting()


# ---- tools ---------------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
PING = {"type": "function", "function": {"name": "ping"}}   # no parameters
# pydantic-style $defs and $ref: the refs point at the parameters' own root
BOOK = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {"when": {"$ref": "#/$defs/Slot"}}, "required": ["when"],
    "$defs": {"Slot": {"type": "object", "properties": {"day": {"type": "integer"}}, "required": ["day"]}}}}}


def treq(choice="auto", tools=(WEATHER, TIME), parallel=True) -> T.ToolRequest:
    body: dict = {"tools": list(tools), "tool_choice": choice}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    r = T.parse_tool_request(body)
    assert r is not None
    return r


def named(name: str, **kw) -> T.ToolRequest:
    return treq({"type": "function", "function": {"name": name}}, **kw)


# ---- the request ---------------------------------------------------------------------------------
def test_parse_tool_request_reads_tools_choice_and_parallel():
    r = treq(parallel=None)
    assert (r.choice, r.name, r.parallel) == ("auto", None, False)  # llama-server's default, not OpenAI's
    r = treq()
    assert (r.choice, r.name, r.parallel) == ("auto", None, True)
    assert [t["function"]["name"] for t in r.tools] == ["get_weather", "get_time"]
    assert r.tools[0] == WEATHER
    r = named("get_time", parallel=False)
    assert (r.choice, r.name, r.parallel) == ("function", "get_time", False)
    assert treq("required").choice == "required"
    assert treq("none").choice == "none"      # the tools are known, and none may be called
    assert T.parse_tool_request({"tools": [PING]}).tools == [PING]


@pytest.mark.parametrize("body", [{}, {"tools": None}, {"tools": []}, {"tools": [], "tool_choice": "none"},
                                  {"tools": [], "tool_choice": "auto"}, {"functions": []}])
def test_no_tools_is_none(body):
    assert T.parse_tool_request(body) is None


def test_legacy_functions_become_tools():
    r = T.parse_tool_request({"functions": [WEATHER["function"]], "function_call": {"name": "get_weather"}})
    assert r.tools == [WEATHER] and (r.choice, r.name) == ("function", "get_weather")
    assert r.parallel is False   # the legacy API answers one function_call
    assert T.parse_tool_request({"functions": [WEATHER["function"]], "function_call": "none"}).choice == "none"


LONG = "x" * 65
BAD_REQUESTS = [
    ({"tools": "get_weather"}, "tools"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [5]}, "tools[0]"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"function": WEATHER["function"]}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": "get_weather"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": LONG}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": 7}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]},
     "tools[0].function.description"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": 5}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"required": "a"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER] * 129}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": 3}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"name": "get_weather"}}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "functions": [TIME["function"]]}, "functions"),
    ({"functions": [{"name": "x y"}]}, "functions[0].name"),
    ({"functions": [5]}, "functions[0]"),
    ({"functions": [WEATHER["function"]], "function_call": {"name": "nope"}}, "function_call"),
    ({"functions": [WEATHER["function"]], "function_call": "required"}, "function_call"),
    ({"tools": [WEATHER], "tool_choice": "auto", "function_call": "auto"}, "function_call"),
]


@pytest.mark.parametrize("body,param", BAD_REQUESTS)
def test_bad_tool_requests_name_the_param(body, param):
    with pytest.raises(BadRequest) as e:
        T.parse_tool_request(body)
    assert e.value.param == param
    assert e.value.status == 400 and e.value.code and e.value.message


def test_invalid_parameters_schema_says_what_is_wrong():
    with pytest.raises(BadRequest, match="not a valid JSON schema.*strin"):
        T.parse_tool_request({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "strin"}}}}}]})


# ---- the history ---------------------------------------------------------------------------------
CALL = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CALL2 = {"id": "call_def", "type": "function", "function": {"name": "get_time", "arguments": '{"tz":"CET"}'}}


def conversation(calls=(CALL,)) -> list[dict]:
    """An OpenAI chat with tool calls and results, made into template messages as the server does."""
    raw = [{"role": "system", "content": "Be brief."},
           {"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": list(calls)}]
    raw += [{"role": "tool", "tool_call_id": c["id"], "content": f"result of {c['function']['name']}"} for c in calls]
    out = []
    for i, m in enumerate(raw):
        out.append({"role": m["role"], "content": m["content"] or "", **T.message_fields(m, f"messages[{i}]")})
    return out


def test_message_fields_parse_arguments_for_templates():
    f = T.message_fields({"role": "assistant", "content": None, "tool_calls": [CALL, CALL2]}, "messages[2]")
    assert f == {"tool_calls": [
        {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_def", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}}]}
    assert T.message_fields({"role": "tool", "tool_call_id": "call_abc", "content": "x"}, "m") == \
        {"tool_call_id": "call_abc"}
    assert T.message_fields({"role": "tool", "tool_call_id": "call_abc", "name": "get_weather"}, "m") == \
        {"tool_call_id": "call_abc", "name": "get_weather"}
    for m in ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"},
              {"role": "assistant", "content": "hi", "tool_calls": []}, {"role": "system", "content": "s"}):
        assert T.message_fields(m, "m") == {}
    # "" (no arguments) and an already-parsed object are taken too
    f = T.message_fields({"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "ping", "arguments": ""}}]},
                         "m")
    assert f["tool_calls"][0]["function"]["arguments"] == {}


def test_arguments_render_through_tojson():
    msgs, kw = T.prepare("hermes", conversation(), treq())
    text = tokenizer("hermes").apply_chat_template(msgs, **kw)
    # the template's `arguments | tojson` writes the object, not a quoted string
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nresult of get_weather\n</tool_response>" in text
    assert json.dumps(WEATHER) in text and text.endswith("<|im_start|>assistant\n")


BAD_MESSAGES = [
    ({"role": "assistant", "tool_calls": {"id": "a"}}, "messages[3].tool_calls"),
    ({"role": "assistant", "tool_calls": ["call"]}, "messages[3].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [{**CALL, "id": None}]}, "messages[3].tool_calls[0].id"),
    ({"role": "assistant", "tool_calls": [{**CALL, "id": 5}]}, "messages[3].tool_calls[0].id"),
    ({"role": "assistant", "tool_calls": [{**CALL, "type": "code"}]}, "messages[3].tool_calls[0].type"),
    ({"role": "assistant", "tool_calls": [{"id": "a", "type": "function"}]}, "messages[3].tool_calls[0].function"),
    ({"role": "assistant", "tool_calls": [{"id": "a", "function": {"arguments": "{}"}}]},
     "messages[3].tool_calls[0].function.name"),
    ({"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{city: Paris}"}}]},
     "messages[3].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "[1, 2]"}}]},
     "messages[3].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": 5}}]},
     "messages[3].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}}]},
     "messages[3].tool_calls[0].function.arguments"),
    ({"role": "tool", "content": "x"}, "messages[3].tool_call_id"),
    ({"role": "tool", "content": "x", "tool_call_id": 1}, "messages[3].tool_call_id"),
    ({"role": "tool", "content": "x", "tool_call_id": "a", "name": 1}, "messages[3].name"),
]


@pytest.mark.parametrize("m,param", BAD_MESSAGES)
def test_bad_tool_messages_name_the_param(m, param):
    with pytest.raises(BadRequest) as e:
        T.message_fields(m, "messages[3]")
    assert e.value.param == param


# ---- detection and prompts -------------------------------------------------------------------------
class Stub:
    def __init__(self, chat_template, special=None, added=None, vocab_size=1000):
        self.chat_template, self.special, self.added, self.vocab_size = chat_template, special or {}, added or {}, \
            vocab_size


@pytest.mark.parametrize("fmt", list(FAMILIES))
def test_detect_format_of_each_family(fmt):
    assert T.detect_format(tokenizer(fmt)) == fmt
    assert T.detect_format(Stub(FAMILIES[fmt][0])) == fmt


def test_detect_format_edge_cases():
    assert T.detect_format(Stub(None)) == "generic"
    assert T.detect_format(Stub("")) == "generic"
    # mentions <tool_call> but never reads tools: the model cannot be told of tools natively
    assert T.detect_format(Stub("{{ messages[0].content }} <tool_call>")) == "generic"
    assert T.detect_format(Stub("{% if tools %}{{ tools|tojson }}{% endif %}")) == "generic"
    assert T.detect_format(Stub("{% if tools %}<|python_tag|>{% endif %}")) == "llama3"
    # Mistral's v11 syntax ([TOOL_CALLS]name[ARGS]{...}) against v3's (a JSON array after the marker)
    assert T.detect_format(Stub("{% if tools %}[TOOL_CALLS]{{ name }}[ARGS]{% endif %}")) == "mistral11"
    assert T.detect_format(Stub("{% if tools %}[TOOL_CALLS] [{{ calls }}]{% endif %}")) == "mistral"


@pytest.mark.parametrize("fmt", ["hermes", "qwen3coder", "llama3", "mistral", "mistral11"])
def test_prepare_native_passes_tools_to_the_template(fmt):
    calls = (CALL,) if fmt == "llama3" else (CALL, CALL2)   # Llama 3.1's template takes one call a turn
    msgs, kw = T.prepare(fmt, conversation(calls), treq())
    assert kw == {"tools": treq().tools}
    text = tokenizer(fmt).apply_chat_template(msgs, **kw)
    assert "The weather in a city." in text and "result of get_weather" in text
    assert {"hermes": '"arguments": {"city": "Paris"}', "qwen3coder": "<function=get_weather>\n<parameter=city>\n"
            "Paris\n</parameter>\n</function>", "llama3": '"parameters": {"city": "Paris"}',
            "mistral": '"arguments": {"city": "Paris"}, "id": ',
            "mistral11": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}'
                         '</s>'}[fmt] in text
    # tool_choice "none": the model is not shown the tools
    msgs, kw = T.prepare(fmt, conversation(calls), treq("none"))
    assert kw == {}
    assert "The weather in a city." not in tokenizer(fmt).apply_chat_template(msgs, **kw)


def test_prepare_mistral_ids_are_nine_characters_in_call_and_result():
    msgs, _ = T.prepare("mistral", conversation((CALL, CALL2)), treq())
    ids = [tc["id"] for tc in msgs[2]["tool_calls"]]
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 2
    assert [m["tool_call_id"] for m in msgs[3:]] == ids
    assert [m["name"] for m in msgs[3:]] == ["get_weather", "get_time"]   # filled in from the calls
    assert conversation((CALL, CALL2))[2]["tool_calls"][0]["id"] == "call_abc"   # the input is not changed


def test_prepare_generic_describes_tools_and_writes_history_as_json():
    msgs, kw = T.prepare("generic", conversation((CALL, CALL2)), treq())
    assert kw == {}
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]   # two results, one turn
    assert msgs[0]["content"].startswith("Be brief.\n\nYou can call these tools")
    assert json.dumps([WEATHER["function"], TIME["function"]], indent=2) in msgs[0]["content"]
    assert '{"response": "<your reply>"}' in msgs[0]["content"]
    assert json.loads(msgs[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}},
                                                             {"name": "get_time", "arguments": {"tz": "CET"}}]}
    first, second = msgs[3]["content"].split("\n")
    assert json.loads(first) == {"tool_response": {"tool_call_id": "call_abc", "content": "result of get_weather"}}
    assert json.loads(second)["tool_response"]["content"] == "result of get_time"
    text = tokenizer("generic").apply_chat_template(msgs, **kw)
    assert text.count("<|im_start|>") == 5 and '{"tool_calls": [{"name": "get_weather"' in text
    assert all("tool_calls" not in m and "tool_call_id" not in m for m in msgs)


def test_prepare_generic_choices():
    user = [{"role": "user", "content": "hi"}]
    msgs, _ = T.prepare("generic", user, treq("required", parallel=False))
    assert msgs[0]["role"] == "system" and "You must call at least one tool" in msgs[0]["content"]
    assert "one tool at a time" in msgs[0]["content"] and msgs[1:] == user
    msgs, _ = T.prepare("generic", user, named("get_time"))
    assert 'You must call the function "get_time"' in msgs[0]["content"]
    # "none": no tools described; the history still shows what happened
    assert T.prepare("generic", user, treq("none")) == (user, {})
    assert T.prepare("generic", user, None) == (user, {})
    msgs, _ = T.prepare("generic", conversation(), treq("none"))
    assert msgs[0]["content"] == "Be brief." and '"tool_calls"' in msgs[2]["content"]


# ---- constraints -----------------------------------------------------------------------------------
def spec(fmt, req):
    return T.constraint_for(fmt, req, tokenizer(fmt))


def test_constraint_for_kinds():
    for fmt in FAMILIES:
        assert spec(fmt, treq("none")) is None and spec(fmt, None) is None
    for fmt in ("hermes", "llama3", "mistral"):
        assert spec(fmt, treq("auto")) is None     # free text; the parser picks the calls out
        for r in (treq("required"), named("get_time")):
            s = spec(fmt, r)
            assert s.kind == "lark" and s.source == T.native_grammar(fmt, r, tokenizer(fmt))
    for r in (treq("auto"), treq("required"), named("get_time")):
        s = spec("generic", r)
        assert s.kind == "json_schema" and s.source == T.generic_schema(r)


REQS = [treq("required"), treq("required", parallel=False), named("get_time"), named("book", tools=(WEATHER, BOOK)),
        treq("required", tools=(WEATHER, TIME, PING, BOOK))]


@pytest.mark.parametrize("fmt", ["hermes", "qwen3coder", "llama3", "mistral", "mistral11"])
@pytest.mark.parametrize("i", range(len(REQS)))
def test_native_grammars_validate(fmt, i):
    g = lark(T.native_grammar(fmt, REQS[i], tokenizer(fmt)))
    assert llguidance.LLMatcher.validate_grammar(g, lltok(fmt)) == ""
    g = lark(T.native_grammar(fmt, REQS[i], Stub(None)))   # no special tokens at all
    assert llguidance.LLMatcher.validate_grammar(g) == ""


@pytest.mark.parametrize("r", REQS + [treq("auto"), treq("auto", tools=(BOOK, PING), parallel=False)])
def test_generic_schemas_validate(r):
    schema = T.generic_schema(r)
    import jsonschema

    jsonschema.validators.validator_for(schema).check_schema(schema)
    assert llguidance.LLMatcher.validate_grammar(schema_grammar(schema), lltok("generic")) == ""


def test_native_grammar_shapes():
    g = T.native_grammar("hermes", treq("required"), tokenizer("hermes"))
    assert g.startswith('start: block ("\\n" block)*\nblock: "<tool_call>" "\\n" call "\\n" "</tool_call>"')
    assert 'call_0: "{\\"name\\": \\"get_weather\\", \\"arguments\\": " args_0 "}"' in g
    assert "args_0: %json {" in g
    py = tokenizer("llama3").special["<|python_tag|>"]
    assert T.native_grammar("llama3", treq("required"), tokenizer("llama3")).startswith(f"start: <[{py}]>? call\n")
    assert T.native_grammar("llama3", treq("required"), Stub(None)).startswith("start: call\n")
    tc = tokenizer("mistral").special["[TOOL_CALLS]"]
    assert T.native_grammar("mistral", treq("required"), tokenizer("mistral")).startswith(
        f'start: <[{tc}]> " "? "[" call (", " call)* "]"\n')
    # a token the vocabulary has as plain (added) text is matched as that text
    assert T.native_grammar("mistral", named("get_time", parallel=False), Stub(None, added={"[TOOL_CALLS]": 7})).startswith(
        'start: "[TOOL_CALLS]" " "? "[" call "]"\n')
    with pytest.raises(ValueError):
        T.native_grammar("generic", treq("required"), Stub(None))


def hermes_call(name, args):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args, ensure_ascii=False)}}}\n</tool_call>'


def test_hermes_grammar_accepts_calls_and_refuses_others():
    g = lark(T.native_grammar("hermes", treq("required"), tokenizer("hermes")))
    one = hermes_call("get_weather", {"city": "Paris"})
    assert accepts("hermes", g, one)
    assert accepts("hermes", g, one + "\n" + hermes_call("get_time", {"tz": "UTC"}))
    assert accepts("hermes", g, hermes_call("get_weather", {"city": "Paris", "unit": "c"}))
    assert not accepts("hermes", g, hermes_call("get_wether", {"city": "Paris"}))     # no such function
    assert not accepts("hermes", g, hermes_call("get_weather", {"city": 5}))          # a number for a string
    assert not accepts("hermes", g, hermes_call("get_weather", {}))                   # city is required
    assert not accepts("hermes", g, hermes_call("get_weather", {"city": "P", "unit": "k"}))
    assert not accepts("hermes", g, hermes_call("get_weather", {"city": "P", "extra": 1}))   # closed objects
    assert not accepts("hermes", g, "Sure! " + one)                                   # a call, at once
    assert not accepts("hermes", g, "<tool_call>\n")                                  # not finished
    g1 = lark(T.native_grammar("hermes", named("get_time", parallel=False), tokenizer("hermes")))
    assert accepts("hermes", g1, hermes_call("get_time", {"tz": "UTC"}))
    assert not accepts("hermes", g1, one)
    assert not accepts("hermes", g1, hermes_call("get_time", {"tz": "UTC"}) + "\n" + hermes_call("get_time", {"tz": "X"}))
    gb = lark(T.native_grammar("hermes", named("book", tools=(BOOK,)), tokenizer("hermes")))
    assert accepts("hermes", gb, hermes_call("book", {"when": {"day": 3}}))           # "$ref" followed
    assert not accepts("hermes", gb, hermes_call("book", {"when": {"day": "Monday"}}))


def qwen_call(name, args):
    """A call as Qwen3.5's template writes one: strings as they are, other values as JSON."""
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                     for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def test_qwen3coder_grammar_accepts_calls_and_refuses_others():
    g = lark(T.native_grammar("qwen3coder", treq("required"), tokenizer("qwen3coder")))
    one = qwen_call("get_weather", {"city": "Paris"})
    assert accepts("qwen3coder", g, one)
    assert accepts("qwen3coder", g, one + "\n" + qwen_call("get_time", {"tz": "UTC"}))
    assert accepts("qwen3coder", g, qwen_call("get_weather", {"city": "Rio de\n\nJaneiro <3", "unit": "c"}))
    assert not accepts("qwen3coder", g, qwen_call("get_wether", {"city": "Paris"}))      # no such function
    assert not accepts("qwen3coder", g, qwen_call("get_weather", {}))                    # city is required
    assert not accepts("qwen3coder", g, qwen_call("get_weather", {"city": "P", "unit": "k"}))
    assert not accepts("qwen3coder", g, qwen_call("get_weather", {"city": "P", "extra": "1"}))
    assert not accepts("qwen3coder", g, qwen_call("get_weather", {"city": "a\n<b"}))    # a line opening a tag
    assert not accepts("qwen3coder", g, "Sure! " + one)
    assert not accepts("qwen3coder", g, hermes_call("get_weather", {"city": "Paris"}))  # JSON in the block
    gb = lark(T.native_grammar("qwen3coder", named("book", tools=(BOOK,)), tokenizer("qwen3coder")))
    assert accepts("qwen3coder", gb, qwen_call("book", {"when": {"day": 3}}))           # "$ref" followed
    assert not accepts("qwen3coder", gb, qwen_call("book", {"when": {"day": "Monday"}}))
    gp = lark(T.native_grammar("qwen3coder", named("ping", tools=(PING,)), tokenizer("qwen3coder")))
    assert accepts("qwen3coder", gp, "<tool_call>\n<function=ping>\n</function>\n</tool_call>")


def test_mistral11_grammar_with_its_special_tokens():
    tok = tokenizer("mistral11")
    tc, ar = tok.special["[TOOL_CALLS]"], tok.special["[ARGS]"]

    def ids(*calls):   # each call as the model writes it: the markers are special tokens
        return [i for name, args in calls for i in [tc] + tok.encode(name) + [ar] + tok.encode(json.dumps(args))]

    g = lark(T.native_grammar("mistral11", treq("required"), tok))
    m = llguidance.LLMatcher(lltok("mistral11"), g, log_level=0)

    def takes(seq):
        m.reset()
        return m.consume_tokens(seq) and not m.is_error() and m.is_accepting()

    assert takes(ids(W)) and takes(ids(W, TM))
    assert not takes(ids(("get_wether", {"city": "Paris"})))           # no such function
    assert not takes(ids(("get_weather", {"city": 5})))               # a number for a string
    assert not takes(tok.encode("[TOOL_CALLS]get_weather[ARGS]{}"))   # the markers' text is not the tokens
    assert not takes(tok.encode("Sure. ") + ids(W))                   # a call, at once
    g1 = lark(T.native_grammar("mistral11", named("get_time", parallel=False), tok))
    m = llguidance.LLMatcher(lltok("mistral11"), g1, log_level=0)
    assert takes(ids(TM)) and not takes(ids(W)) and not takes(ids(TM, TM))


def test_mistral11_markers_show_in_the_answer_text():
    """The vocabulary of a template that writes [ARGS] keeps both markers in the detokenized text
    (the parser needs them); with another template they are dropped as specials (the control)."""
    tok = tokenizer("mistral11")
    ids = [tok.special["[TOOL_CALLS]"]] + tok.encode("ping") + [tok.special["[ARGS]"]] + tok.encode("{}")
    assert tok.decode(ids, skip_special=True) == "[TOOL_CALLS]ping[ARGS]{}"
    assert "".join(map(tok.stream(skip_special=True).put, ids)) == "[TOOL_CALLS]ping[ARGS]{}"
    assert tok.decode([tok.special["</s>"]], skip_special=True) == ""
    tok = Tokenizer({**tok.to_header(), "chat_template": MISTRAL})
    assert tok.decode(ids, skip_special=True) == "ping{}"
    tok.chat_template = MINISTRAL3   # as `cflow serve --chat-template-file` replaces it
    assert tok.decode(ids, skip_special=True) == "[TOOL_CALLS]ping[ARGS]{}"


def test_generic_schema_accepts_answers_and_refuses_others():
    auto = schema_grammar(T.generic_schema(treq()))
    call = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
    assert accepts("generic", auto, '{"response": "Hello there"}')
    assert accepts("generic", auto, call)
    assert accepts("generic", auto, call[:-2] + ', {"name": "get_time", "arguments": {"tz": "UTC"}}]}')
    assert not accepts("generic", auto, call.replace("get_weather", "get_wether"))
    assert not accepts("generic", auto, call.replace('"Paris"', "5"))
    assert not accepts("generic", auto, '{"tool_calls": []}')
    assert not accepts("generic", auto, '{"answer": "Hi"}')
    req = schema_grammar(T.generic_schema(treq("required", parallel=False)))
    assert accepts("generic", req, call)
    assert not accepts("generic", req, '{"response": "Hello there"}')
    assert not accepts("generic", req, call[:-2] + ', {"name": "get_time", "arguments": {"tz": "UTC"}}]}')
    one = schema_grammar(T.generic_schema(named("get_time")))
    assert not accepts("generic", one, call)
    assert accepts("generic", one, '{"tool_calls": [{"name": "get_time", "arguments": {"tz": "UTC"}}]}')
    book = schema_grammar(T.generic_schema(treq("required", tools=(WEATHER, BOOK, PING))))
    assert accepts("generic", book, '{"tool_calls": [{"name": "book", "arguments": {"when": {"day": 3}}}]}')
    assert not accepts("generic", book, '{"tool_calls": [{"name": "book", "arguments": {"when": {"day": "x"}}}]}')
    assert accepts("generic", book, '{"tool_calls": [{"name": "ping", "arguments": {}}]}')


def test_llama3_and_mistral_grammars_with_their_special_tokens():
    py = tokenizer("llama3").special["<|python_tag|>"]
    g = lark(T.native_grammar("llama3", treq("required"), tokenizer("llama3")))
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert accepts("llama3", g, call) and accepts("llama3", g, call, pre=(py,))
    assert not accepts("llama3", g, call.replace("parameters", "arguments"))
    m = llguidance.LLMatcher(lltok("llama3"), g, log_level=0)   # the tag's text is not the special token
    assert not m.consume_tokens(list(("<|python_tag|>" + call).encode()))
    tc = tokenizer("mistral").special["[TOOL_CALLS]"]
    g = lark(T.native_grammar("mistral", treq("required"), tokenizer("mistral")))
    calls = ' [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"tz": "A"}}]'
    assert accepts("mistral", g, calls, pre=(tc,)) and accepts("mistral", g, calls[1:], pre=(tc,))
    assert not accepts("mistral", g, calls)
    assert not accepts("mistral", g, calls.replace("get_time", "get_tme"), pre=(tc,))


def test_unenforceable_parameters_are_loosened_not_refused():
    odd = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}   # llguidance has no "not"
    r = treq("required", tools=(odd, WEATHER))
    assert T.generic_schema(r)["properties"]["tool_calls"]["items"]["anyOf"][0]["properties"]["arguments"] == \
        {"type": "object"}
    g = lark(T.native_grammar("hermes", r, tokenizer("hermes")))
    assert accepts("hermes", g, hermes_call("odd", {"a": "anything"}))


@pytest.mark.parametrize("fmt", ["hermes", "qwen3coder", "llama3", "mistral", "mistral11", "generic"])
def test_constrained_output_round_trips_through_the_parser(fmt):
    """What a model writes under the constraint, detokenized as the server does (specials
    dropped), parses back into the calls."""
    tok = tokenizer(fmt)
    r = treq("required")
    args = {"city": "Zürich \"centre\""}
    text = {"hermes": hermes_call("get_weather", args), "qwen3coder": qwen_call("get_weather", args),
            "llama3": '{"name": "get_weather", "parameters": ' + json.dumps(args, ensure_ascii=False) + "}",
            "mistral": ' [{"name": "get_weather", "arguments": ' + json.dumps(args, ensure_ascii=False) + "}]",
            "mistral11": "get_weather",
            "generic": '{"tool_calls": [{"name": "get_weather", "arguments": ' + json.dumps(args, ensure_ascii=False) + "}]}"}[fmt]
    pre = {"llama3": ("<|python_tag|>",), "mistral": ("[TOOL_CALLS]",), "mistral11": ("[TOOL_CALLS]",)}.get(fmt, ())
    ids = [tok.special[p] for p in pre] + tok.encode(text)
    if fmt == "mistral11":
        ids += [tok.special["[ARGS]"]] + tok.encode(json.dumps(args, ensure_ascii=False))
    s = T.constraint_for(fmt, r, tok)
    g = schema_grammar(s.source) if s.kind == "json_schema" else lark(s.source)
    m = llguidance.LLMatcher(lltok(fmt), g, log_level=0)
    assert m.consume_tokens(ids) and m.is_accepting()
    content, calls = TC.parse_all(fmt, r, tok.decode(ids, skip_special=True))
    assert content is None and len(calls) == 1
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == args


# ---- the parser ------------------------------------------------------------------------------------
W = ("get_weather", {"city": "Paris"})
TM = ("get_time", {"tz": "UTC"})
HW = hermes_call(*W)
HT = hermes_call(*TM)
LW = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LT = '{"name": "get_time", "parameters": {"tz": "UTC"}}'
MW = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
QW = qwen_call(*W)
QT = qwen_call(*TM)
MT = '{"name": "get_time", "arguments": {"tz": "UTC"}}'

# (format, generated text, content, calls)
CASES = [
    ("hermes", "Let me check.\n\n" + HW, "Let me check.", [W]),
    ("hermes", HW + "\n" + HT, None, [W, TM]),
    ("hermes", HW + "\n" + HT + "\n", None, [W, TM]),
    ("hermes", "Sure.\n" + HW + "\nDone, as asked.", "Sure.Done, as asked.", [W]),
    ("hermes", "Hello <b>world</b>, a < b and <tool> too.", "Hello <b>world</b>, a < b and <tool> too.", []),
    ("hermes", "x <tool_ca", "x <tool_ca", []),
    ("hermes", "  spaced  \n", "  spaced  \n", []),
    ("hermes", HW.replace("get_weather", "launch"), HW.replace("get_weather", "launch"), []),   # unknown name
    ("hermes", "A\n" + HW.replace('"Paris"}', '"Paris"'), "A\n" + HW.replace('"Paris"}', '"Paris"'), []),
    ("hermes", "A\n" + HW[:40], "A\n" + HW[:40], []),          # cut off by max_tokens
    ("hermes", HW[:-len("\n</tool_call>")], None, [W]),         # the closing tag never came: the JSON did
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>', None, [TM]),
    ("hermes", HW.replace("arguments", "parameters"), None, [W]),
    ("hermes", '<tool_call>\n{"name": "ping"}\n</tool_call>', None, [("ping", {})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>', []),
    ("hermes", HW + "\n" + HT.replace("get_time", "nope"), HT.replace("get_time", "nope"), [W]),
    ("qwen3coder", "Let me check.\n\n" + QW, "Let me check.", [W]),
    ("qwen3coder", QW + "\n" + QT, None, [W, TM]),
    ("qwen3coder", qwen_call("book", {"when": {"day": 3}, "n": 2, "note": "x"}), None,
     [("book", {"when": {"day": 3}, "n": 2, "note": "x"})]),
    ("qwen3coder", qwen_call("get_weather", {"city": "42"}), None, [("get_weather", {"city": "42"})]),  # a string
    ("qwen3coder", qwen_call("get_weather", {"city": "a\nb", "unit": "c"}), None,
     [("get_weather", {"city": "a\nb", "unit": "c"})]),
    ("qwen3coder", "<tool_call>\n<function=ping>\n</function>\n</tool_call>", None, [("ping", {})]),
    ("qwen3coder", QW.replace("get_weather", "launch"), QW.replace("get_weather", "launch"), []),   # unknown name
    ("qwen3coder", QW.replace("</parameter>", "</param>"), QW.replace("</parameter>", "</param>"), []),
    ("qwen3coder", QW.replace("<function=", "junk <function="), QW.replace("<function=", "junk <function="), []),
    ("qwen3coder", HW, HW, []),                                  # JSON in the block is not this format
    ("qwen3coder", "A\n" + QW[:30], "A\n" + QW[:30], []),          # cut off by max_tokens
    ("mistral11", "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(W[1]), None, [W]),
    ("mistral11", "Let me check. [TOOL_CALLS]get_weather[ARGS]" + json.dumps(W[1]) + "[TOOL_CALLS]get_time[ARGS]"
     + json.dumps(TM[1]) + "\n", "Let me check. ", [W, TM]),
    ("mistral11", "[TOOL_CALLS]ping[ARGS]{}", None, [("ping", {})]),
    ("mistral11", "Plain [answer] with [ARGS] and [TOOL_CALL", "Plain [answer] with [ARGS] and [TOOL_CALL", []),
    ("mistral11", "[TOOL_CALLS]launch[ARGS]{}", "[TOOL_CALLS]launch[ARGS]{}", []),             # unknown name
    ("mistral11", "[TOOL_CALLS]get_weather[ARGS]{\"city\": ", "[TOOL_CALLS]get_weather[ARGS]{\"city\": ", []),
    ("mistral11", "[TOOL_CALLS]get_weather[ARGS][1]", "[TOOL_CALLS]get_weather[ARGS][1]", []),
    ("mistral11", "[TOOL_CALLS]get_weather{}", "[TOOL_CALLS]get_weather{}", []),              # no [ARGS]
    ("mistral11", "[TOOL_CALLS]get_weather[ARGS]{} and more", "[TOOL_CALLS]get_weather[ARGS]{} and more", []),
    ("llama3", LW, None, [W]),
    ("llama3", "\n" + LW + "; " + LT, None, [W, TM]),
    ("llama3", "<|python_tag|>" + LW, None, [W]),               # a vocabulary with the tag as text
    ("llama3", LW.replace("parameters", "arguments"), None, [W]),
    ("llama3", "The weather is fine.", "The weather is fine.", []),
    ("llama3", "<b>bold</b>", "<b>bold</b>", []),
    ("llama3", '{"a": 1}', '{"a": 1}', []),
    ("llama3", LW[:30], LW[:30], []),
    ("llama3", LW + " and more", LW + " and more", []),
    ("llama3", LW.replace("get_weather", "launch"), LW.replace("get_weather", "launch"), []),
    ("llama3", "   ", "   ", []),
    ("mistral", " [" + MW + "]", None, [W]),
    ("mistral", "[" + MW + ", " + MT + "]", None, [W, TM]),
    ("mistral", '[{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]', None, [W]),
    ("mistral", "[TOOL_CALLS] [" + MW + "]", None, [W]),
    ("mistral", "[link](http://x) is it.", "[link](http://x) is it.", []),
    ("mistral", "[" + MW, "[" + MW, []),
    ("mistral", "Plain answer.", "Plain answer.", []),
    ("generic", '{"response": "Hi \\"there\\" \\u00e9 \\ud83d\\ude00\\n\\/done"}', 'Hi "there" é 😀\n/done', []),
    ("generic", '{ "response" :\n "spaced" }', "spaced", []),
    ("generic", '{"response": "lone \\ud83d and \\udc00 end"}', "lone \ufffd and \ufffd end", []),
    ("generic", '{"response": "cut off', "cut off", []),
    ("generic", '{"response": "cut \\u00', "cut \\u00", []),
    ("generic", '{"response": "bad \\q escape"}', 'bad \\q escape"}', []),
    ("generic", '{"response": "x", "extra": 1}', 'x, "extra": 1}', []),
    ("generic", '{"tool_calls": [' + MW + "]}", None, [W]),
    ("generic", '{"tool_calls": [' + MW + ", " + MT + "]}", None, [W, TM]),
    ("generic", '{"tool_call": ' + MT + "}", None, [TM]),
    ("generic", '{"tool_calls": [' + MW[:25], '{"tool_calls": [' + MW[:25], []),
    ("generic", '{"tool_calls": [' + MW.replace("get_weather", "nope") + "]}",
     '{"tool_calls": [' + MW.replace("get_weather", "nope") + "]}", []),
    ("generic", '{"tool_calls": []}', '{"tool_calls": []}', []),
    ("generic", '{"respond": "x"}', '{"respond": "x"}', []),
    ("generic", "Just text.", "Just text.", []),
    ("generic", "", "", []),
]


def summary(content, calls):
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) == 29
        assert c["function"]["arguments"] == json.dumps(json.loads(c["function"]["arguments"]), separators=(",", ":"),
                                                        ensure_ascii=False)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def stream(fmt, req, pieces):
    p = TC.ToolCallParser(fmt, req)
    content, calls = "", []
    for piece in pieces:
        c, k = p.feed(piece)
        content, calls = content + c, calls + k
    c, k = p.finish()
    content, calls = content + c, calls + k
    return (None if calls and not content.strip() else content), calls


REQ = treq(tools=(WEATHER, TIME, PING, BOOK))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_parse_all(case):
    fmt, text, content, calls = CASES[case]
    assert summary(*TC.parse_all(fmt, REQ, text)) == (content, calls)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_streaming_matches_parse_all_at_every_cut(case):
    fmt, text, content, calls = CASES[case]
    want = (content, calls)
    for i in range(len(text) + 1):
        assert summary(*stream(fmt, REQ, [text[:i], text[i:]])) == want, i
    assert summary(*stream(fmt, REQ, list(text))) == want
    rng = random.Random(case)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert summary(*stream(fmt, REQ, pieces)) == want, cuts


def test_streaming_shows_content_as_soon_as_it_is_decided():
    p = TC.ToolCallParser("hermes", REQ)
    assert p.feed("Hello world ") == ("Hello world", [])        # the space may precede a call
    assert p.feed("and <tool") == (" and", [])
    assert p.feed("_call>\n" + '{"name": "get_time", "arguments": {"tz": "UTC"}}\n') == ("", [])
    c, k = p.feed("</tool_call>")
    assert c == "" and summary(c, k)[1] == [TM]
    assert p.finish() == ("", [])
    p = TC.ToolCallParser("generic", REQ)
    assert p.feed('{"resp') == ("", [])
    assert p.feed('onse": "Hel') == ("Hel", [])
    assert p.feed('lo \\') == ("lo ", [])
    assert p.feed('n"}') == ("\n", [])
    assert p.finish() == ("", [])
    p = TC.ToolCallParser("llama3", REQ)
    assert p.feed(" ") == ("", []) and p.feed("Hi") == (" Hi", []) and p.feed(" {x") == (" {x", [])
    p = TC.ToolCallParser("llama3", REQ)
    assert p.feed(LW) == ("", []) and summary(*p.finish())[1] == [W]


def test_choice_none_and_no_request_parse_nothing():
    for fmt, text, _, _ in CASES:
        assert TC.parse_all(fmt, treq("none"), text) == (text, [])
        assert TC.parse_all(fmt, None, text) == (text, [])


def test_call_ids_are_unique():
    _, calls = TC.parse_all("hermes", REQ, "\n".join([HW] * 20))
    assert len({c["id"] for c in calls}) == 20
