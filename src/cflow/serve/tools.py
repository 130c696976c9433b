"""OpenAI tool (function) calling: the request's `tools` checked, the chat history's tool calls
and results made ready for the chat template, and the constraint that makes the model call a tool
when it must; cflow.serve.tool_calls finds the calls in generated text. No HTTP and no engine here
(cflow.serve.protocol reads the body, cflow.serve.app wires this in, cflow.constrain enforces).

A model family calls tools in the syntax it was trained on; `detect_format` reads it off the chat
template, and each format has its template input, grammar and parser:

- "hermes" (Qwen2.5/Qwen3, SmolLM3, Hermes): text around blocks
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; `<tool_call>` is an added
  (non-special) token, so it survives detokenization and the parser sees it.
- "qwen3coder" (Qwen3.5, Qwen3-Coder): the same `<tool_call>` blocks, each holding XML rather
  than JSON: `<function=NAME>`, then per argument `<parameter=KEY>\nVALUE\n</parameter>`, then
  `</function>` (a VALUE is the argument's text: a string as it is, other types as JSON).
- "llama3" (Llama 3.1+ JSON tool calling): the answer is `{"name": ..., "parameters": {...}}`,
  sometimes after the special `<|python_tag|>` (which the detokenizer drops).
- "mistral" (v3 templates): the special `[TOOL_CALLS]` (dropped), then a JSON array of
  `{"name", "arguments"}`.
- "mistral11" (Mistral's tokenizer v11 and later: Mistral Small 3.2, Magistral, Ministral 3):
  content, then each call as `[TOOL_CALLS]NAME[ARGS]{...}`; both markers are special tokens that
  cflow.tokenizer shows in the detokenized text of such a vocabulary (llama.cpp's preserved
  tokens), so the parser finds them. The calls end the answer (EOS follows).
- "harmony" (gpt-oss): the answer is channelled messages (cflow.reasoning.HarmonyParser), a
  call one addressed ` to=functions.NAME` on the commentary channel whose body is the arguments,
  ended by <|call|>; the analysis channel is the reasoning (`reasoning_content`), the final
  channel the content. The parser runs on every answer of such a model, tools or not.
  `required` or a named function forces a call, after an analysis message (the reasoning) and
  a commentary preamble if the model writes them (llama.cpp's gpt-oss grammar); a JSON schema
  (`harmony_constraint`) shapes the final message the same way.
- "generic" (every other template, e.g. SmolLM2's plain ChatML; llama.cpp's generic handler):
  the tools are described in a system message and the whole answer is one JSON object,
  `{"tool_calls": [{"name", "arguments"}]}` or `{"response": "..."}`, always schema-constrained.

`tool_choice: "none"` hides the tools from the model (and cflow.serve.tool_calls parses nothing).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from cflow.reasoning import CHANNEL, CONSTRAIN, END, MESSAGE, START, is_harmony
from cflow.serve.protocol import BadRequest, _json_type

FORMATS = ("hermes", "qwen3coder", "llama3", "mistral", "mistral11", "harmony", "generic")
MAX_TOOLS = 128                      # OpenAI's limit
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, PARAMETER = "<function=", "<parameter="   # qwen3coder's XML inside <tool_call>
PYTHON_TAG, TOOL_CALLS, ARGS = "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict]     # each {"type": "function", "function": {"name", "description"?, "parameters"?}}
    choice: str           # "auto" | "none" | "required" | "function"
    name: str | None      # the named function when choice == "function"
    parallel: bool        # parallel_tool_calls (default False, as llama-server's: small models repeat calls)


# ---- the request -------------------------------------------------------------------------------
def parse_tool_request(body: dict) -> ToolRequest | None:
    """The tool fields of a chat request (`tools`, `tool_choice`, `parallel_tool_calls`, or the
    legacy `functions`, `function_call`), checked. None when the request has no tools."""
    if body.get("tools") is not None and body.get("functions") is not None:
        raise BadRequest("give 'tools' or the legacy 'functions', not both", "functions", "invalid_value")
    if body.get("tool_choice") is not None and body.get("function_call") is not None:
        raise BadRequest("give 'tool_choice' or the legacy 'function_call', not both", "function_call",
                         "invalid_value")
    legacy = body.get("functions") is not None
    key = "functions" if legacy else "tools"
    raw = body.get(key)
    raw = [] if raw is None else raw
    if not isinstance(raw, list):
        raise BadRequest(f"'{key}' must be an array of function tools, got {_json_type(raw)}", key, "invalid_type")
    if len(raw) > MAX_TOOLS:
        raise BadRequest(f"at most {MAX_TOOLS} tools, got {len(raw)}", key, "invalid_value")
    tools, seen = [], set()
    for i, t in enumerate(raw):
        where = f"{key}[{i}]"
        if not isinstance(t, dict):
            raise BadRequest(f"{where} must be an object, got {_json_type(t)}", where, "invalid_type")
        if legacy:
            f = t
        else:
            if t.get("type") != "function":
                raise BadRequest(f"{where}.type must be 'function', got {t.get('type')!r}"[:300], f"{where}.type",
                                 "invalid_value")
            f, where = t.get("function"), f"{where}.function"
            if not isinstance(f, dict):
                raise BadRequest(f"{where} must be an object {{name, description, parameters}}", where,
                                 "invalid_type" if f is not None else "missing_required_parameter")
        fn = _function(f, where)
        if fn["name"] in seen:
            raise BadRequest(f"{where}.name: the function '{fn['name']}' is defined twice", f"{where}.name",
                             "invalid_value")
        seen.add(fn["name"])
        tools.append({"type": "function", "function": fn})

    choice, name = _choice(body, legacy)
    if name is not None and name not in seen:
        param = "function_call" if legacy or body.get("function_call") is not None else "tool_choice"
        raise BadRequest(f"'{param}' names the function '{name}', which is not among the tools", param,
                         "invalid_value")
    if not tools:
        if choice == "required":
            raise BadRequest("'tool_choice' is 'required' but no tools are given", "tool_choice", "invalid_value")
        return None
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest(f"'parallel_tool_calls' must be a boolean, got {_json_type(parallel)}",
                         "parallel_tool_calls", "invalid_type")
    # the legacy API returns one function_call per answer
    # OpenAI defaults parallel_tool_calls to true; llama-server to false, which we follow: a small
    # model allowed several calls tends to repeat the one it just made until max_tokens
    return ToolRequest(tools, choice, name, False if parallel is None else parallel)


def _function(f: dict, where: str) -> dict:
    name = f.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BadRequest(f"{where}.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}"[:300],
                         f"{where}.name", "invalid_value" if name is not None else "missing_required_parameter")
    out: dict[str, Any] = {"name": name}
    desc = f.get("description")
    if desc is not None:
        if not isinstance(desc, str):
            raise BadRequest(f"{where}.description must be a string, got {_json_type(desc)}", f"{where}.description",
                             "invalid_type")
        out["description"] = desc
    params = f.get("parameters")
    if params is not None:
        p = f"{where}.parameters"
        if not isinstance(params, dict):
            raise BadRequest(f"{p} must be a JSON schema object, got {_json_type(params)}", p, "invalid_type")
        if params.get("type", "object") != "object":
            raise BadRequest(f"{p} must describe an object (type 'object'), got type {params['type']!r}"[:300], p,
                             "invalid_value")
        import jsonschema

        try:
            jsonschema.validators.validator_for(params).check_schema(params)
        except jsonschema.SchemaError as e:
            at = "".join(f"[{x!r}]" for x in e.path)
            raise BadRequest(f"{p} is not a valid JSON schema: {e.message}{' at ' + at if at else ''}"[:500], p,
                             "invalid_value") from None
        out["parameters"] = params
    return out


def _choice(body: dict, legacy: bool) -> tuple[str, str | None]:
    if body.get("function_call") is not None:
        key, v = "function_call", body["function_call"]
        named = isinstance(v, dict) and set(v) <= {"name"}
        name = v.get("name") if named else None
        modes = ("none", "auto")
    else:
        key, v = "tool_choice", body.get("tool_choice")
        named = isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict)
        name = v["function"].get("name") if named else None
        modes = ("none", "auto", "required")
    if v is None:
        return "auto", None
    if isinstance(v, str) and v in modes:
        return v, None
    if named and isinstance(name, str):
        return "function", name
    shape = '{"name": ...}' if key == "function_call" else '{"type": "function", "function": {"name": ...}}'
    raise BadRequest(f"'{key}' must be one of {', '.join(repr(m) for m in modes)} or {shape}, got "
                     f"{json.dumps(v)}"[:300], key, "invalid_value")


# ---- the history -------------------------------------------------------------------------------
def message_fields(m: dict, where: str) -> dict:
    """The tool fields of one incoming chat message, checked, as templates read them: an assistant's
    `tool_calls` (arguments parsed into a dict: templates write `arguments | tojson`) and
    `reasoning_content` (its thoughts: cflow.reasoning.template_messages), a tool result's
    `tool_call_id` and `name`. {} when there are none."""
    role = m.get("role")
    if role == "assistant":
        reasoning = m.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise BadRequest(f"{where}.reasoning_content must be a string, got {_json_type(reasoning)}",
                             f"{where}.reasoning_content", "invalid_type")
        thought = {"reasoning_content": reasoning} if reasoning else {}
        tcs = m.get("tool_calls")
        if tcs is None or tcs == []:
            return thought
        if not isinstance(tcs, list):
            raise BadRequest(f"{where}.tool_calls must be an array, got {_json_type(tcs)}", f"{where}.tool_calls",
                             "invalid_type")
        out = []
        for j, tc in enumerate(tcs):
            w = f"{where}.tool_calls[{j}]"
            if not isinstance(tc, dict):
                raise BadRequest(f"{w} must be an object, got {_json_type(tc)}", w, "invalid_type")
            if not isinstance(tc.get("id"), str):
                raise BadRequest(f"{w}.id must be a string", f"{w}.id",
                                 "missing_required_parameter" if tc.get("id") is None else "invalid_type")
            if tc.get("type", "function") != "function":
                raise BadRequest(f"{w}.type must be 'function', got {tc.get('type')!r}"[:300], f"{w}.type",
                                 "invalid_value")
            f = tc.get("function")
            if not isinstance(f, dict):
                raise BadRequest(f"{w}.function must be an object {{name, arguments}}", f"{w}.function",
                                 "invalid_type" if f is not None else "missing_required_parameter")
            if not isinstance(f.get("name"), str) or not f["name"]:
                raise BadRequest(f"{w}.function.name must be a non-empty string", f"{w}.function.name",
                                 "invalid_type")
            out.append({"id": tc["id"], "type": "function",
                        "function": {"name": f["name"], "arguments": _arguments(f.get("arguments"),
                                                                                f"{w}.function.arguments")}})
        return {**thought, "tool_calls": out}
    if role == "tool":
        tid, name = m.get("tool_call_id"), m.get("name")
        if not isinstance(tid, str):
            raise BadRequest(f"{where}.tool_call_id must be a string: the id of the call this answers",
                             f"{where}.tool_call_id", "missing_required_parameter" if tid is None else "invalid_type")
        if name is not None and not isinstance(name, str):
            raise BadRequest(f"{where}.name must be a string, got {_json_type(name)}", f"{where}.name",
                             "invalid_type")
        return {"tool_call_id": tid, **({"name": name} if name is not None else {})}
    return {}


def _arguments(a: Any, where: str) -> dict:
    # OpenAI sends a JSON string; a dict is accepted as it is, and "" (some clients' "no
    # arguments") as {}
    if isinstance(a, dict):
        return a
    if not isinstance(a, str):
        raise BadRequest(f"{where} must be a string holding a JSON object, got {_json_type(a)}", where,
                         "invalid_type" if a is not None else "missing_required_parameter")
    if not a.strip():
        return {}
    try:
        v = json.loads(a)
    except ValueError as e:
        raise BadRequest(f"{where} is not valid JSON ({e})"[:300], where, "invalid_value") from None
    if not isinstance(v, dict):
        raise BadRequest(f"{where} must be a JSON object, got {_json_type(v)}", where, "invalid_value")
    return v


# ---- the format --------------------------------------------------------------------------------
def detect_format(tokenizer: Any) -> str:
    """The tool-call format of a model, read off its chat template (`tokenizer.chat_template`):

    - writes harmony's `<|channel|>` (gpt-oss): "harmony", tools or not;
    - no template, or one that never reads `tools`: "generic";
    - mentions `[TOOL_CALLS]` and `[ARGS]` (the v11 syntax `[TOOL_CALLS]name[ARGS]{...}`):
      "mistral11"; `[TOOL_CALLS]` alone (a JSON array of calls): "mistral";
    - mentions `<tool_call>` and `<function=` (XML calls, Qwen3.5): "qwen3coder";
    - mentions `<tool_call>`: "hermes";
    - mentions `<|python_tag|>`, "Environment: ipython" or writes `"parameters": ` JSON calls:
      "llama3";
    - anything else: "generic".
    """
    t = getattr(tokenizer, "chat_template", None) or ""
    if is_harmony(t):
        return "harmony"
    if not re.search(r"\btools\b", t):
        return "generic"
    if TOOL_CALLS in t:
        return "mistral11" if ARGS in t else "mistral"
    if OPEN in t:
        return "qwen3coder" if FUNCTION in t else "hermes"
    if PYTHON_TAG in t or "Environment: ipython" in t or '"parameters": ' in t:
        return "llama3"
    return "generic"


def prepare(fmt: str, messages: list[dict], req: ToolRequest | None) -> tuple[list[dict], dict]:
    """(messages to render, extra chat-template kwargs). Native formats get `tools=` (not with
    tool_choice "none": the model is not shown tools it may not call); "generic" gets the
    tools in a system message and its history's calls and results as the JSON text it answers in.
    `req` None (no tools in this request) is "none"."""
    msgs = [dict(m) for m in messages]
    on = req is not None and req.choice != "none"
    if fmt == "generic":
        msgs = _generic_history(msgs)
        if on:
            text = _generic_system(req)
            if msgs and msgs[0].get("role") == "system":
                msgs[0]["content"] = ((msgs[0].get("content") or "") + "\n\n" + text).lstrip()
            else:
                msgs.insert(0, {"role": "system", "content": text})
        return msgs, {}
    _name_results(msgs)
    if fmt == "mistral":
        _mistral_ids(msgs)
    return msgs, ({"tools": req.tools} if on else {})


def _name_results(msgs: list[dict]) -> None:
    # Some templates print a tool result's name; clients often send only tool_call_id.
    names = {}
    for m in msgs:
        for tc in m.get("tool_calls") or ():
            names[tc["id"]] = tc["function"]["name"]
        if m.get("role") == "tool" and "name" not in m and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]


def _mistral_ids(msgs: list[dict]) -> None:
    # Mistral's templates refuse any call id but 9 letters or digits; map ours ("call_...") the
    # same way in the call and in its result, so they still match.
    def short(i: str) -> str:
        return i if re.fullmatch(r"[a-zA-Z0-9]{9}", i) else hashlib.sha256(i.encode()).hexdigest()[:9]
    for m in msgs:
        if m.get("tool_calls"):
            m["tool_calls"] = [{**tc, "id": short(tc["id"])} for tc in m["tool_calls"]]
        if m.get("role") == "tool" and isinstance(m.get("tool_call_id"), str):
            m["tool_call_id"] = short(m["tool_call_id"])


def _generic_history(msgs: list[dict]) -> list[dict]:
    """Calls and results as text a template with no tool support prints (minja's polyfills):
    the assistant's JSON answer, and results as one user message per run of tool messages
    (a user turn, because strict templates refuse other roles and two user turns in a row)."""
    out: list[dict] = []
    prev_tool = False
    for m in msgs:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            obj: dict[str, Any] = {"response": m["content"]} if m.get("content") else {}
            obj["tool_calls"] = [{"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}
                                 for tc in m["tool_calls"]]
            out.append({"role": "assistant", "content": json.dumps(obj, ensure_ascii=False)})
        elif m.get("role") == "tool":
            r = {k: m[k] for k in ("tool_call_id", "name") if k in m}
            text = json.dumps({"tool_response": {**r, "content": m.get("content") or ""}}, ensure_ascii=False)
            if prev_tool:
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
        prev_tool = m.get("role") == "tool"
    return out


def _generic_system(req: ToolRequest) -> str:
    funcs = json.dumps([t["function"] for t in req.tools], ensure_ascii=False, indent=2)
    call = '{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}]}'
    if req.choice == "function":
        call = call.replace("<function name>", req.name)
        how = f'You must call the function "{req.name}", answering {call}.'
    elif req.choice == "required":
        how = f"You must call at least one tool, answering {call}."
    else:
        how = f'To call tools answer {call}; to reply to the user directly answer {{"response": "<your reply>"}}.'
    once = "" if req.parallel else " Call one tool at a time."
    return (f"You can call these tools (functions), described in JSON with their parameters' JSON schemas:\n"
            f"{funcs}\n\nAnswer with one JSON object and nothing else. {how}{once}")


# ---- what to enforce ---------------------------------------------------------------------------
def constraint_for(fmt: str, req: ToolRequest | None, tokenizer: Any) -> Any:
    """The cflow.constrain.ConstraintSpec to decode under, or None for free text: "generic"
    always answers schema-constrained JSON (`generic_schema`); native formats are free with
    tool_choice "auto" (the parser picks the calls out) and forced into the family's call syntax
    with "required" or a named function (`native_grammar`, Lark)."""
    if req is None or req.choice == "none":
        return None
    if fmt != "generic" and req.choice == "auto":
        return None
    from cflow.constrain import ConstraintSpec

    if fmt == "generic":
        return ConstraintSpec("json_schema", generic_schema(req))
    return ConstraintSpec("lark", native_grammar(fmt, req, tokenizer))


def _selected(req: ToolRequest) -> list[dict]:
    return [t for t in req.tools if req.choice != "function" or t["function"]["name"] == req.name]


def _args(fn: dict) -> dict:
    """The arguments' schema: the tool's parameters, always an object; {"type": "object"} when
    llguidance cannot compile them (an unsupported keyword such as `not`): the arguments are then
    free, as they are in OpenAI's non-strict function calling, rather than the request failing."""
    p = fn.get("parameters")
    if p is None:
        return {"type": "object"}
    p = {k: v for k, v in p.items() if k != "$schema"}
    p.setdefault("type", "object")
    return p if _compiles(json.dumps(p, sort_keys=True)) else {"type": "object"}


@lru_cache(maxsize=256)
def _compiles(schema: str) -> bool:
    try:
        import llguidance
    except ImportError:
        return True
    try:
        return llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema)) == ""
    except Exception:
        return False


def generic_schema(req: ToolRequest) -> dict:
    """The JSON schema of a "generic" answer: {"tool_calls": [call, ...]} (at least one; one when
    not parallel), or also {"response": text} with tool_choice "auto". A call is
    {"name": const, "arguments": that tool's parameters}, in that order."""
    calls, defs = [], {}
    for i, t in enumerate(_selected(req)):
        args = _args(t["function"])
        if _has_ref(args):
            # A parameters schema's "#/..." refs point at its own root: move it under $defs and
            # re-aim them, as it is nested in a bigger schema here.
            defs[f"tool{i}"] = _rebase(args, f"#/$defs/tool{i}")
            args = {"$ref": f"#/$defs/tool{i}"}
        calls.append({"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "arguments": args},
                      "required": ["name", "arguments"], "additionalProperties": False})
    items = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    if not req.parallel:
        items["maxItems"] = 1
    schema: dict[str, Any] = {"type": "object", "properties": {"tool_calls": items}, "required": ["tool_calls"],
                              "additionalProperties": False}
    if req.choice == "auto":
        schema = {"anyOf": [{"type": "object", "properties": {"response": {"type": "string"}},
                             "required": ["response"], "additionalProperties": False}, schema]}
    if defs:
        schema["$defs"] = defs
    return schema


def _has_ref(x: Any) -> bool:
    if isinstance(x, dict):
        return any(k == "$ref" or _has_ref(v) for k, v in x.items())
    return isinstance(x, list) and any(_has_ref(v) for v in x)


def _rebase(x: Any, root: str) -> Any:
    if isinstance(x, dict):
        return {k: (root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebase(v, root))
                for k, v in x.items()}
    return [_rebase(v, root) for v in x] if isinstance(x, list) else x


def _token(tokenizer: Any, text: str, literal: bool) -> str | None:
    """`text` in a Lark grammar: a special token by id (it is not text to llguidance), an added
    token as its text; when the vocabulary lacks it, the text if `literal`, else None."""
    special = getattr(tokenizer, "special", None) or {}
    added = getattr(tokenizer, "added", None) or {}
    n = getattr(tokenizer, "vocab_size", None)
    if text in special and (n is None or special[text] < n):
        return f"<[{special[text]}]>"
    return json.dumps(text) if text in added or literal else None


def native_grammar(fmt: str, req: ToolRequest, tokenizer: Any) -> str:
    """Lark (llguidance's dialect) forcing one call, or several when parallel, in the family's
    syntax, each `{"name": "<name>", "arguments": <%json of its parameters>}` ("parameters" for
    llama3). Each call's arguments are their own %json so a schema's "#/..." refs stay valid."""
    # The arguments get what a "json_schema" constraint gets (cflow.constrain): compact JSON with
    # ", " and ": " (as these templates' `tojson` writes calls), objects closed to unlisted keys.
    from cflow.constrain import JSON_OPTIONS, closed_objects

    key = "parameters" if fmt == "llama3" else "arguments"
    rules = []
    tools = _selected(req)
    for i, t in enumerate(tools):
        head = json.dumps(f'{{"name": {json.dumps(t["function"]["name"])}, "{key}": ')
        args = closed_objects(_args(t["function"]))
        args = {"x-guidance": JSON_OPTIONS, **args}
        rules.append(f'call_{i}: {head} args_{i} "}}"')
        rules.append(f"args_{i}: %json {json.dumps(args)}")
    rules.insert(0, "call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    if fmt == "qwen3coder":
        rules = _xml_call_rules(tools)
    if fmt == "mistral11":
        # [TOOL_CALLS]NAME[ARGS]{...}, the call's arguments the tool's schema; several in a row
        # when parallel (the template writes a turn's calls so, nothing between them)
        marks = {m: _token(tokenizer, m, True) for m in (TOOL_CALLS, ARGS)}
        rules = ["call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
        for i, t in enumerate(tools):
            args = {"x-guidance": JSON_OPTIONS, **closed_objects(_args(t["function"]))}
            rules.append(f'call_{i}: {marks[TOOL_CALLS]} {json.dumps(t["function"]["name"])} {marks[ARGS]} args_{i}')
            rules.append(f"args_{i}: %json {json.dumps(args)}")
    if fmt in ("hermes", "qwen3coder"):
        block = f'{_token(tokenizer, OPEN, True)} "\\n" call "\\n" {_token(tokenizer, CLOSE, True)}'
        start = ['start: block ("\\n" block)*' if req.parallel else "start: block", f"block: {block}"]
    elif fmt == "llama3":
        # Llama 3.1 writes one call per turn (its template refuses more), so one even when parallel
        tag = _token(tokenizer, PYTHON_TAG, False)
        start = [f"start: {tag}? call" if tag else "start: call"]
    elif fmt == "harmony":
        # the prompt ends with "<|start|>assistant"; as llama.cpp's gpt-oss grammar: an analysis
        # message (the reasoning) and a commentary preamble may come first, each ended by <|end|>
        # and followed by a new "<|start|>assistant"; then the call, its recipient before the
        # channel (` to=functions.NAME<|channel|>commentary json<|message|>`, as the template
        # writes a call) or after it (`<|channel|>commentary to=functions.NAME <|constrain|>json
        # <|message|>`, harmony's own order), on the commentary or analysis channel. One call per
        # answer (it ends with <|call|>, a stop token), so one even when parallel.
        tok = {m: _token(tokenizer, m, True) for m in (CHANNEL, MESSAGE, CONSTRAIN, START, END)}
        rules = []
        for i, t in enumerate(tools):
            name = json.dumps(t["function"]["name"])
            args = {"x-guidance": JSON_OPTIONS, **closed_objects(_args(t["function"]))}
            rules.append(f'call_{i}: " to=functions." {name} channel ctype {tok[MESSAGE]} args_{i} '
                         f'| channel " to=functions." {name} ctype {tok[MESSAGE]} args_{i}')
            rules.append(f"args_{i}: %json {json.dumps(args)}")
        rules.insert(0, "call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
        rules += [f'channel: {tok[CHANNEL]} ("commentary" | "analysis")',
                  f'ctype: (" " {tok[CONSTRAIN]}? "json")?',
                  *_harmony_messages(tok)]
        start = ["start: (thought next)? (preamble next)? call"]
    elif fmt == "mistral11":
        start = ["start: call+" if req.parallel else "start: call"]
    elif fmt == "mistral":
        tag = _token(tokenizer, TOOL_CALLS, False)
        more = ' (", " call)*' if req.parallel else ""
        start = [f'start: {tag + " " if tag else ""}" "? "[" call{more} "]"']
    else:
        raise ValueError(f"no grammar for tool-call format {fmt!r} (one of hermes, qwen3coder, llama3, mistral, "
                         "mistral11, harmony)")
    return "\n".join(start + rules) + "\n"


def _xml_call_rules(tools: list[dict]) -> list[str]:
    """qwen3coder's calls in Lark, as the Qwen3.5 template writes them: `<function=NAME>\\n`, the
    parameters in the schema's order (the required ones always, the others when the model writes
    them), `</function>`. A string parameter's value is text in which no line starts with "<" (so
    that `\\n</parameter>` ends it; one regex, so the lexer never has to guess where it ends);
    any other type is %json of its schema."""
    from cflow.constrain import JSON_OPTIONS, closed_objects

    rules = []
    for i, t in enumerate(tools):
        params = _args(t["function"])
        required = set(params.get("required") or ())
        parts = []
        for k, (key, schema) in enumerate((params.get("properties") or {}).items()):
            head = json.dumps(PARAMETER + key + ">" + chr(10))
            enum = schema.get("enum") if isinstance(schema, dict) else None
            if isinstance(enum, list) and enum and all(isinstance(w, str) for w in enum):
                # the template writes a string as it is, quotes and all left out
                words = " | ".join(json.dumps(w) for w in enum)
                rules.append(f'p_{i}_{k}: {head} ({words}) "\\n</parameter>\\n"')
                parts.append(f"p_{i}_{k}" + ("" if key in required else "?"))
            elif isinstance(schema, dict) and schema.get("type") == "string":
                rules.append(f"P_{i}_{k}: /{_regex_literal(PARAMETER + key + '>')}\\n(?:[^<\\n][^\\n]*)?"
                             f"(?:\\n+[^<\\n][^\\n]*)*\\n<\\/parameter>\\n/")
                parts.append(f"P_{i}_{k}" + ("" if key in required else "?"))
            else:
                # the parameters' "#/..." refs point at their root: its definitions come along
                shared = {d: params[d] for d in ("$defs", "definitions") if d in params}
                value = {"x-guidance": JSON_OPTIONS, **closed_objects({**(schema if isinstance(schema, dict) else {}),
                                                                       **shared})}
                rules.append(f'p_{i}_{k}: {head} v_{i}_{k} "\\n</parameter>\\n"')
                rules.append(f"v_{i}_{k}: %json {json.dumps(value)}")
                parts.append(f"p_{i}_{k}" + ("" if key in required else "?"))
        rules.append(f'call_{i}: {json.dumps(FUNCTION + t["function"]["name"] + ">" + chr(10))} '
                     f'{" ".join(parts)} "</function>"')
    rules.insert(0, "call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    return rules


def _regex_literal(text: str) -> str:
    """`text` matched literally inside a Lark /regex/ (llguidance's syntax): letters and digits
    as they are, every other character as \\x{..}."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def _harmony_messages(tok: dict[str, str]) -> list[str]:
    """Lark rules of the harmony messages that may come before what a grammar forces: `thought`
    (an analysis message), `preamble` (a commentary message), `next` (the next message's opening).
    Their text is any text: the special tokens are not text, so <|end|> ends it."""
    return [f'thought: {tok[CHANNEL]} "analysis" {tok[MESSAGE]} TEXT {tok[END]}',
            f'preamble: {tok[CHANNEL]} "commentary" {tok[MESSAGE]} TEXT {tok[END]}',
            f'next: {tok[START]} "assistant"',
            "TEXT: /(?s:.*)/"]


def harmony_constraint(spec: Any, tokenizer: Any) -> Any:
    """A harmony model's structured output: the request's JSON schema (or JSON object) shapes
    the final message, after an optional analysis message, as llama.cpp's gpt-oss grammar does
    (`<|channel|>final [<|constrain|>json]<|message|>` then the JSON); other constraint kinds
    (a grammar, a regex) are the caller's whole answer and pass through unchanged."""
    from cflow.constrain import JSON_OPTIONS, ConstraintSpec, closed_objects

    if spec.kind not in ("json_object", "json_schema"):
        return spec
    spec.grammar()   # the schema's own checks and named errors, before it is wrapped
    schema = {"type": "object"} if spec.kind == "json_object" else spec.source
    tok = {m: _token(tokenizer, m, True) for m in (CHANNEL, MESSAGE, CONSTRAIN, START, END)}
    body = {"x-guidance": JSON_OPTIONS, **closed_objects(schema)}
    rules = ["start: (thought next)? final",
             f'final: {tok[CHANNEL]} "final" (" " {tok[CONSTRAIN]}? "json")? {tok[MESSAGE]} answer',
             f"answer: %json {json.dumps(body)}", *_harmony_messages(tok)]
    return ConstraintSpec("lark", "\n".join(rules) + "\n")
