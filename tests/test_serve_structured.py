"""Structured output and tool calls through a live `cflow serve` on SmolLM2, driven by the official
`openai` client.

- JSON mode and JSON schemas (nested objects, enums, arrays) through `response_format`, greedy and
  at temperature 1: every answer parses and validates (jsonschema); llama-server's `json_schema`
  and `grammar` fields and `regex` (extra_body), streamed and not, match an independent parser.
- Malformed schemas, grammars and regexes get 400 naming the field and the reason; two constraints
  in one request get 400; the server stays healthy and serves the next request.
- Constrained and free streams side by side: nothing a constrained client sends changes another
  client's answer (the free stream equals its answer alone).
"""

from __future__ import annotations

import json
import re
import threading

import pytest

pytest.importorskip("starlette", reason="the serve extra is not installed: pip install 'cflow-lm[serve]'")
pytest.importorskip("llguidance", reason="structured output needs llguidance: pip install 'cflow-lm[structured]'")
openai = pytest.importorskip("openai", reason="the openai client (test extra) is not installed")
jsonschema = pytest.importorskip("jsonschema")

from test_serve import Live, request  # noqa: E402

from test_constrain import PERSON  # noqa: E402

MODEL = "smol"


@pytest.fixture(scope="module")
def live(smollm2_converted):
    server = Live("-m", str(smollm2_converted), "--alias", MODEL, "-np", "4", "-c", "4096", "-t", "2",
                  ready_timeout=300)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- structured output ----------------------------------------------------------------------------------
def test_json_schema_answers_validate_greedy_and_sampled(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    answers = [client.chat.completions.create(model=MODEL, messages=_ask("Describe a person as JSON."),
                                              response_format=rf, max_tokens=200, temperature=0)]
    answers += [client.chat.completions.create(model=MODEL, messages=_ask("Describe a person as JSON."),
                                               response_format=rf, max_tokens=200, temperature=1.0, seed=s, n=2)
                for s in range(3)]
    texts = [c.message.content for a in answers for c in a.choices]
    for a in answers:
        assert all(c.finish_reason == "stop" for c in a.choices)
    for t in texts:
        jsonschema.validate(json.loads(t), PERSON)
    assert len(set(texts)) > 2


def test_json_mode_streamed(client):
    stream = client.chat.completions.create(model=MODEL, messages=_ask("A JSON object with a name and an age."),
                                            response_format={"type": "json_object"}, max_tokens=300,
                                            temperature=0, stream=True)
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_grammar_regex_and_llama_server_schema_fields(client, stream):
    def complete(prompt, **extra):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=1.0, seed=7,
                                      stream=stream, extra_body=extra)
        return "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text

    gbnf = 'root ::= ("yes" | "no") ", because " [a-z ]{3,30} "."'
    assert re.fullmatch(r"(yes|no), because [a-z ]{3,30}\.", complete("Is the sky blue? ", grammar=gbnf))
    assert re.fullmatch(r"\d{3}-\d{4}", complete("Call 555-", regex=r"\d{3}-\d{4}"))
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 9}},
              "required": ["ok", "n"]}
    jsonschema.validate(json.loads(complete("JSON: ", json_schema=schema)), schema)


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "invalid at type"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_object"),
    ({"grammar": "root ::= missing"}, "grammar", "missing"),
    ({"grammar": "root ::= [a-"}, "grammar", "grammar"),
    ({"regex": "(unclosed"}, "regex", "regex"),
    ({"json_schema": {"type": "object", "properties": {"a": {"type": 5}}}}, "json_schema", "invalid"),
    ({"regex": "a", "grammar": 'root ::= "a"'}, "regex", "at most one"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"structured_outputs": {"yaml": "x"}}, "structured_outputs", "not supported"),
])
def test_malformed_constraints_get_400_naming_the_problem(live, client, extra, param, words):
    status, _, raw = request(live, "POST", "/v1/chat/completions",
                             {"messages": _ask("Hi"), "max_tokens": 4, **extra}, key=None)
    assert status == 400, raw
    err = json.loads(raw)["error"]
    assert err["param"] == param and words in err["message"], err
    r = client.chat.completions.create(model=MODEL, messages=_ask("Hi"), max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_constrained_clients_do_not_change_a_free_stream(client):
    free = dict(model=MODEL, messages=_ask("Write two sentences about the sea."), max_tokens=48, temperature=0)
    alone = client.chat.completions.create(**free).choices[0].message.content
    out: dict[str, str] = {}

    def constrained(i):
        r = client.chat.completions.create(model=MODEL, messages=_ask("Describe a person as JSON."),
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "p", "schema": PERSON}},
                                           max_tokens=200, temperature=1.0, seed=i)
        out[f"c{i}"] = r.choices[0].message.content

    threads = [threading.Thread(target=constrained, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    out["free"] = client.chat.completions.create(**free).choices[0].message.content
    for t in threads:
        t.join()
    assert out["free"] == alone
    for i in range(3):
        jsonschema.validate(json.loads(out[f"c{i}"]), PERSON)


# ---- tool calls -----------------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                                    "b": {"type": "integer", "minimum": -999, "maximum": 999}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = _ask("What is the weather in Paris, in celsius?")


@pytest.fixture(scope="module", params=["own", "hermes", "llama3"])
def tool_server(request, smollm2_converted, tmp_path_factory):
    """SmolLM2 with its own ChatML template (no tools in it: the generic JSON format), and with
    Qwen2.5-like and Llama-3.1-like templates (--chat-template-file): the hermes and llama3 formats."""
    from test_tools import LLAMA31, QWEN

    args = ["-m", str(smollm2_converted), "--alias", MODEL, "-np", "2", "-c", "4096", "-t", "2"]
    if request.param != "own":
        path = tmp_path_factory.mktemp("tpl") / f"{request.param}.jinja"
        path.write_text(QWEN if request.param == "hermes" else LLAMA31)
        args += ["--chat-template-file", str(path)]
    server = Live(*args, ready_timeout=300)
    yield request.param, server, openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                               timeout=120)
    server.stop()


def _calls_valid(calls, names=None):
    assert calls, "no tool calls"
    for c in calls:
        assert c.type == "function" and c.id
        assert c.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def _streamed(client, **kw):
    """(content, tool calls assembled from the deltas as the openai client's users do, finish_reason)."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = tc.id or c["id"]
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_tool_calls(tool_server, choice):
    fmt, _, client = tool_server
    tc = "required" if choice == "required" else {"type": "function", "function": {"name": "add"}}
    names = None if choice == "required" else ["add"]
    for temperature, seed in ((0, None), (1.0, 1), (1.0, 2)):
        r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=tc,
                                           max_tokens=120, temperature=temperature, seed=seed)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", (fmt, ch)
        _calls_valid(ch.message.tool_calls, names)
        assert len(ch.message.tool_calls) == 1  # parallel_tool_calls defaults to false (llama-server's)
    content, calls, finish = _streamed(client, messages=QUESTION, tools=TOOLS, tool_choice=tc, max_tokens=120,
                                       temperature=0)
    assert finish == "tool_calls" and len(calls) == 1 and calls[0]["id"]
    assert calls[0]["name"] in (names or SCHEMAS)
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])
    # the greedy stream carries the same call as the greedy answer
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=tc, max_tokens=120,
                                       temperature=0)
    assert (calls[0]["name"], json.loads(calls[0]["arguments"])) == \
        (r.choices[0].message.tool_calls[0].function.name, json.loads(r.choices[0].message.tool_calls[0].function.arguments))


def test_auto_answers_or_calls_and_a_tool_result_continues_the_chat(tool_server):
    fmt, _, client = tool_server
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="auto",
                                       max_tokens=120, temperature=0)
    ch = r.choices[0]
    if ch.message.tool_calls:
        assert ch.finish_reason == "tool_calls"
        _calls_valid(ch.message.tool_calls)
    else:
        assert ch.finish_reason in ("stop", "length") and ch.message.content
        if fmt == "own" and ch.finish_reason == "stop":  # the generic format's answer is the response's text
            assert not ch.message.content.lstrip().startswith("{")
    # a second turn: the assistant's call and the tool's result go back through the template
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
    history = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=40, temperature=0,
                                       tool_choice="none")
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    content, calls, finish = _streamed(client, messages=history, tools=TOOLS, max_tokens=40, temperature=0,
                                       tool_choice="none")
    assert content == r.choices[0].message.content and not calls


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                            "properties": {"a": {"type": 3}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
])
def test_malformed_tools_get_400(live, extra, param):
    status, _, raw = request(live, "POST", "/v1/chat/completions", {"messages": _ask("Hi"), "max_tokens": 4, **extra},
                             key=None)
    assert status == 400, raw
    assert json.loads(raw)["error"]["param"] == param, raw


def test_bad_tool_history_gets_400(live):
    bad = QUESTION + [{"role": "assistant", "content": None,
                       "tool_calls": [{"id": "c", "type": "function",
                                       "function": {"name": "add", "arguments": "{not json"}}]}]
    status, _, raw = request(live, "POST", "/v1/chat/completions", {"messages": bad, "max_tokens": 4}, key=None)
    assert status == 400 and json.loads(raw)["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


def test_vllm_guided_fields(client):
    def chat(**extra):
        r = client.chat.completions.create(model=MODEL, messages=_ask("Pick a colour."), max_tokens=20, temperature=1.0,
                                           seed=3, extra_body=extra)
        return r.choices[0].message.content

    assert chat(guided_choice=["red", "green", "blue"]) in ("red", "green", "blue")
    assert chat(structured_outputs={"choice": ["cyan", "magenta"]}) in ("cyan", "magenta")
    assert re.fullmatch(r"#[0-9a-f]{6}", chat(structured_outputs={"regex": "#[0-9a-f]{6}"}))
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"]}
    jsonschema.validate(json.loads(chat(guided_json=schema)), schema)
