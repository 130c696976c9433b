"""The chat templates of the families after gpt-oss through cflow, against llama.cpp's handling of
each: DeepSeek-V3.1 and Kimi-K2 (deepseek2), Ministral 3 (mistral3), Qwen3.5 (qwen35, qwen35moe),
Gemma 4 (gemma4). Gemma 3's is tests/test_gemma3.py's, gpt-oss's tests/test_harmony.py's.

The templates (tests/data/*_chat_template.jinja) are model data, byte for byte as the models'
GGUF `tokenizer.chat_template` carries them:
- deepseek_v3_1: DeepSeek-V3.1's (DeepSeek, MIT), as llama.cpp keeps it
  (models/templates/deepseek-ai-DeepSeek-V3.1.jinja).
- kimi_k2: Kimi-K2-Instruct's (Moonshot AI, modified MIT), as llama.cpp keeps it
  (models/templates/moonshotai-Kimi-K2.jinja), its CRLF line ends included.
- ministral_3: Ministral-3-14B-Instruct-2512's (Mistral AI, Apache-2.0), as its Q4_0 GGUF carries
  it, kept by ardanlabs/jinja (Apache-2.0) as testdata/templates/Ministral-3-14B-Instruct-2512-Q4_0.jinja.
  llama.cpp keeps none of Ministral 3; its Mistral-Small-3.1 template is the older form (tool
  calls as a JSON array after `[TOOL_CALLS]`), not this family's `[TOOL_CALLS]name[ARGS]{...}`.
- qwen3_5: Qwen3.5-35B-A3B's (Qwen, Apache-2.0), as its Q8_0 GGUF carries it (ardanlabs/jinja,
  testdata/templates/Qwen3.5-35B-A3B-Q8_0.jinja); llama.cpp keeps none. (Unsloth's Qwen3.5
  GGUFs carry an edited one that walks a call's arguments with `is mapping` instead of `|items`.)
- gemma4: Gemma 4 26B-A4B-it's (Google, Apache-2.0), as unsloth's UD-Q8_K_XL GGUF carries it
  (ardanlabs/jinja, testdata/templates/gemma-4-26B-A4B-it-UD-Q8_K_XL.jinja). llama.cpp's
  models/templates/gemma4.jinja is another revision (12,133 characters against 16,448), not read.

Oracle 1, plain chats: llama_chat_apply_template of the installed libllama (llama-cpp-python
0.3.36), whose built-in formats are picked by markers in the template. Where llama-server has a
template it renders it with its own Jinja engine; the built-ins are its fallback, simpler, and
they differ from these templates in exactly these places (each test below checks the rule):
- DeepSeek-V3.1 selects `deepseek3`, the V3 / R1 format: it writes no BOS, a system message
  followed by a blank line, and `<｜Assistant｜>` alone. V3.1's template writes the BOS, the system
  prompt with no blank line, and `</think>` after every `<｜Assistant｜>` (non-thinking mode; with
  `enable_thinking` the generation prompt opens `<think>` instead).
- Kimi-K2 selects `kimi-k2`: the same text when the chat has a system message; without one the
  template first writes its default system turn ("You are a helpful assistant"), the built-in none.
- Ministral 3's markers (`[INST]`, `[SYSTEM_PROMPT]`) select `mistral-v7`, the SentencePiece form
  with a space after each tag; the template is the Tekken form, llama.cpp's `mistral-v7-tekken`
  (which it picks by name only). The template writes the BOS and, without a system message, its
  default system prompt (its {today} and {yesterday} as written: the template fills neither).
- Qwen3.5 selects `chatml`: the template trims every message, and its generation prompt opens a
  thought (`<think>\\n`, or the empty `<think>\\n\\n</think>\\n\\n` when `enable_thinking` is false).
- Gemma 4: no built-in (the installed libllama has none; it refuses the template: -1).
Oracle 2, what the built-ins lack (tools, calls and results, reasoning_content, enable_thinking):
llama-cpp-python's Jinja2ChatFormatter renders the template with jinja2 as HF transformers does;
it gets the messages written out by hand as llama.cpp hands them to the template (a call's
arguments an object where the template reads them as one, a string for DeepSeek's, which
concatenates them), cflow the OpenAI request through its serving path for Qwen3.5, else the
template directly with the same messages.

The answer side: which tool-call format and reasoning parser each template gets
(cflow.serve.tools.detect_format, cflow.reasoning.answer_parser), the thought split of the
families that think in `<think>` tags as llama.cpp's deepseek reasoning format splits it, and
Gemma 4's thought channel split the same way.
"""

from __future__ import annotations

import ctypes
import json
import re
from pathlib import Path

import pytest

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="the llama.cpp oracle is not installed: pip install 'llama-cpp-python>=0.3.16'")

from cflow.reasoning import ThinkParser, answer_parser  # noqa: E402
from cflow.serve import protocol as P  # noqa: E402
from cflow.serve import tool_calls as TC  # noqa: E402
from cflow.serve import tools as T  # noqa: E402
from cflow.tokenizer import Tokenizer, bytes_to_unicode  # noqa: E402


def template(name: str) -> str:
    with open(Path(__file__).parent / "data" / f"{name}_chat_template.jinja", encoding="utf-8", newline="") as f:
        return f.read()   # newline="": Kimi-K2's CRLF stays as the file has it


DS_BOS, DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
# family -> (template, the vocabulary's special tokens, BOS, EOS)
FAMILIES = {
    "deepseek_v3_1": (template("deepseek_v3_1"), [DS_BOS, DS_EOS, "<｜User｜>", "<｜Assistant｜>"], DS_BOS, DS_EOS),
    "kimi_k2": (template("kimi_k2"), ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                                      "<|im_system|>", "<|im_middle|>"], "[BOS]", "[EOS]"),
    "ministral_3": (template("ministral_3"), ["<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                                              "[/SYSTEM_PROMPT]", "[TOOL_CALLS]", "[ARGS]"], "<s>", "</s>"),
    "qwen3_5": (template("qwen3_5"), ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>"),
    "gemma4": (template("gemma4"), ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|channel>", "<channel|>"],
               "<bos>", "<eos>"),
}


def family_tokenizer(family: str) -> Tokenizer:
    """A byte-level stand-in vocabulary with the family's special tokens and its template."""
    tmpl, specials, bos, eos = FAMILIES[family]
    b2u = bytes_to_unicode()
    vocab = [b2u[b] for b in range(256)] + specials
    return Tokenizer({"model": "bpe", "vocab": vocab, "merges": [], "bos_id": vocab.index(bos) if bos else None,
                      "eos_id": vocab.index(eos), "add_bos": False, "chat_template": tmpl,
                      "special": {t: vocab.index(t) for t in specials}, "pre": "gpt2"})


def builtin(tmpl: str, chat: list[dict], add: bool) -> str | None:
    """llama_chat_apply_template: `tmpl` a template (its markers pick the built-in) or a built-in's
    name; None when it knows no format for it."""
    msgs = (llama_cpp.llama_chat_message * len(chat))(
        *[llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in chat])
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_chat_apply_template(tmpl.encode(), msgs, len(chat), add, buf, len(buf))
    assert n < len(buf)
    return buf.raw[:n].decode() if n >= 0 else None


def jinja_oracle(family: str, messages: list[dict], add: bool, **kw) -> str:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    tmpl, _, bos, eos = FAMILIES[family]
    fmt = Jinja2ChatFormatter(tmpl, eos_token=eos, bos_token=bos or "", add_generation_prompt=add)
    return fmt(messages=messages, **kw).prompt


# plain chats, each ending with a user turn (after an assistant's, the templates and built-ins
# disagree on the generation prompt by design: V3.1 writes none, Qwen3.5 a think block)
CHATS = [
    [{"role": "user", "content": "Hello there!"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": " Why? "},
     {"role": "assistant", "content": "Because."}, {"role": "user", "content": "日本 😀\nok"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": " 4\n"}, {"role": "user", "content": "½?"}],
]
PLAIN = [(c, add) for c in range(len(CHATS)) for add in (True, False)]


def system_of(chat: list[dict]) -> str | None:
    return chat[0]["content"] if chat[0]["role"] == "system" else None


# ---- which built-in each template selects ------------------------------------------------------
@pytest.mark.parametrize("family, name", [("deepseek_v3_1", "deepseek3"), ("kimi_k2", "kimi-k2"),
                                          ("ministral_3", "mistral-v7"), ("qwen3_5", "chatml"), ("gemma4", None)])
def test_builtin_the_template_selects(family, name):
    """The markers pick the named built-in (the same text as asking for it by name), and no other
    of the candidates; Gemma 4's template gets none."""
    tmpl = FAMILIES[family][0]
    for chat, add in PLAIN:
        got = builtin(tmpl, CHATS[chat], add)
        if name is None:
            assert got is None
            continue
        assert got == builtin(name, CHATS[chat], add)
    others = {"deepseek3", "kimi-k2", "mistral-v7", "mistral-v7-tekken", "chatml", "gemma"} - {name}
    chat = CHATS[1]
    assert all(builtin(tmpl, chat, True) != builtin(o, chat, True) for o in others)


# ---- DeepSeek-V3.1 -----------------------------------------------------------------------------
def v31_from_builtin(text: str, system: str | None, thinking: bool, add: bool) -> str:
    """deepseek3's text as V3.1's template writes it (the module docstring's rule)."""
    if system is not None:
        assert text.startswith(system + "\n\n")
        text = system + text[len(system) + 2:]
    text = DS_BOS + text.replace("<｜Assistant｜>", "<｜Assistant｜></think>")
    if thinking and add:
        text = text[:-len("</think>")] + "<think>"
    return text


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("chat, add", PLAIN)
def test_deepseek_v31_renders_as_llama_cpp(chat, add, thinking):
    tok = family_tokenizer("deepseek_v3_1")
    chat = CHATS[chat]
    theirs = builtin("deepseek3", chat, add)
    mine = tok.apply_chat_template(chat, add_generation_prompt=add, enable_thinking=thinking)
    assert mine == v31_from_builtin(theirs, system_of(chat), thinking, add)
    # controls: the built-in as it is (V3's form), the rule without its BOS, the other mode
    assert mine != theirs and mine != v31_from_builtin(theirs, system_of(chat), thinking, add)[len(DS_BOS):]
    if add:
        assert mine != v31_from_builtin(theirs, system_of(chat), not thinking, add)


def test_deepseek_v31_tool_calls_and_results_render_as_jinja2():
    """Calls and results, which the built-in has no form for: V3.1 writes a call's arguments as
    the string they are (it concatenates them), then its result; thinking on."""
    tok = family_tokenizer("deepseek_v3_1")
    msgs = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
            {"role": "assistant", "content": "21 °C."}, {"role": "user", "content": "Thanks"}]
    mine = tok.apply_chat_template(msgs, enable_thinking=True)
    assert mine == jinja_oracle("deepseek_v3_1", msgs, True, enable_thinking=True)
    assert ('<｜Assistant｜></think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
            '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time') in mine
    assert mine.endswith('<｜tool▁output▁begin｜>{"temp": 21}<｜tool▁output▁end｜>21 °C.<｜end▁of▁sentence｜>'
                         '<｜User｜>Thanks<｜Assistant｜><think>')
    assert mine != jinja_oracle("deepseek_v3_1", msgs, True)   # control: thinking off


# ---- Kimi-K2 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("chat, add", PLAIN)
def test_kimi_k2_renders_as_llama_cpp(chat, add):
    tok = family_tokenizer("kimi_k2")
    chat = CHATS[chat]
    default = [] if system_of(chat) is not None else [{"role": "system", "content": "You are a helpful assistant"}]
    mine = tok.apply_chat_template(chat, add_generation_prompt=add)
    assert mine == builtin("kimi-k2", default + chat, add)
    # control: the built-in without the template's default system turn, or without the chat's own
    assert mine != builtin("kimi-k2", chat if default else chat[1:], add)


# ---- Ministral 3 -------------------------------------------------------------------------------
def ministral_default_system() -> str:
    m = re.search(r"set default_system_message = '((?:[^'\\]|\\.)*)'", FAMILIES["ministral_3"][0])
    return m.group(1).replace("\\n", "\n").replace("\\'", "'")


@pytest.mark.parametrize("chat, add", PLAIN)
def test_ministral_3_renders_as_llama_cpp(chat, add):
    tok = family_tokenizer("ministral_3")
    chat = CHATS[chat]
    default = [] if system_of(chat) is not None else [{"role": "system", "content": ministral_default_system()}]
    mine = tok.apply_chat_template(chat, add_generation_prompt=add)
    assert mine == "<s>" + builtin("mistral-v7-tekken", default + chat, add)
    # controls: the built-in the markers select (spaces after the tags), no BOS, no default system
    assert mine != "<s>" + builtin("mistral-v7", default + chat, add)
    assert mine != builtin("mistral-v7-tekken", default + chat, add)
    if default:
        assert mine != "<s>" + builtin("mistral-v7-tekken", chat, add)


# ---- Qwen3.5 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("chat, add", PLAIN)
def test_qwen3_5_renders_as_llama_cpp(chat, add, thinking):
    tok = family_tokenizer("qwen3_5")
    chat = CHATS[chat]
    kw = {} if thinking is None else {"enable_thinking": thinking}
    trimmed = [{**m, "content": m["content"].strip()} for m in chat]
    opens = ("<think>\n" if thinking is not False else "<think>\n\n</think>\n\n") if add else ""
    mine = tok.apply_chat_template(chat, add_generation_prompt=add, **kw)
    assert mine == builtin("chatml", trimmed, add) + opens
    # controls: the generation prompt the other way, the messages untrimmed (where they have
    # spaces), the other thinking mode
    assert mine != builtin("chatml", trimmed, not add) + opens
    if trimmed != chat:
        assert mine != builtin("chatml", chat, add) + opens
    if add:
        assert mine != tok.apply_chat_template(chat, add_generation_prompt=add, enable_thinking=thinking is False)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city now (it's <b>live</b> & free)",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city's name"},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "array", "items": {"type": "integer"}}}, "required": ["city"]}}}
CALL_ARGS = {"city": "Paris", "unit": "c", "days": [1, 2]}


def call(args, cid="call_1"):
    return [{"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": args}}]


# Qwen3.5 through cflow's serving path: (the OpenAI request, the messages as llama.cpp hands them
# to the template: arguments as objects, add_generation_prompt)
QWEN_CASES = [
    ({"messages": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": None, "reasoning_content": "I need the weather tool.",
                    "tool_calls": call(json.dumps(CALL_ARGS))},
                   {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}],
      "tools": [WEATHER]},
     [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": None, "reasoning_content": "I need the weather tool.",
       "tool_calls": call(CALL_ARGS)},
      {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 21}'}], True),
    # a thought before the last user turn is dropped, the call's after it kept with its text;
    # thinking off for the answer
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
                   {"role": "user", "content": "Weather?"},
                   {"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.",
                    "tool_calls": call("{\"city\": \"Rome\"}", "c9")},
                   {"role": "tool", "tool_call_id": "c9", "content": "sunny"}],
      "tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": False}},
     [{"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
      {"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.",
       "tool_calls": call({"city": "Rome"}, "c9")},
      {"role": "tool", "tool_call_id": "c9", "name": "get_weather", "content": "sunny"}], True),
    # the last turn an assistant's (add_generation_prompt false): its thought is written
    ({"messages": [{"role": "user", "content": "2+2?"},
                   {"role": "assistant", "content": "4", "reasoning_content": "Add them."}]},
     [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "Add them."}],
     False),
]


def serve_render(tok: Tokenizer, body: dict, add: bool) -> str:
    """The request through cflow's chat path: protocol, tools.prepare, the tokenizer's template."""
    spec = P.parse_chat(body, P.Defaults())
    messages, kw = T.prepare(T.detect_format(tok), spec.messages, spec.tools)
    return tok.apply_chat_template(messages, add_generation_prompt=add, **kw, **spec.template_kwargs)


@pytest.mark.parametrize("case", range(len(QWEN_CASES)))
def test_qwen3_5_tools_and_reasoning_render_as_jinja2(case):
    tok = family_tokenizer("qwen3_5")
    body, theirs, add = QWEN_CASES[case]
    expected = jinja_oracle("qwen3_5", theirs, add, tools=body.get("tools"), **body.get("chat_template_kwargs", {}))
    assert serve_render(tok, body, add) == expected
    # controls: the tools left out (where the request has them); the thoughts left out
    if "tools" in body:
        assert tok.apply_chat_template(T.prepare("qwen3coder", P.parse_chat(body, P.Defaults()).messages, None)[0],
                                       add_generation_prompt=add, **body.get("chat_template_kwargs", {})) != expected
    bare = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in theirs]
    assert jinja_oracle("qwen3_5", bare, add, tools=body.get("tools"), **body.get("chat_template_kwargs", {})) \
        != expected


def test_qwen3_5_features_reach_the_text():
    tok = family_tokenizer("qwen3_5")
    text = serve_render(tok, *QWEN_CASES[0][::2])
    for part in ("<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>", "\n\nUse tools.<|im_end|>",
                 "<think>\nI need the weather tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
                 "<parameter=city>\nParis\n</parameter>\n<parameter=unit>\nc\n</parameter>\n"
                 "<parameter=days>\n[1, 2]\n</parameter>\n</function>\n</tool_call><|im_end|>",
                 '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n'):
        assert part in text, part
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    text = serve_render(tok, *QWEN_CASES[1][::2])
    assert "Greet back." not in text
    assert "<think>\nUse the tool.\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n" in text
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


# ---- the other templates' features -------------------------------------------------------------
# (family, messages as both renderers get them, add_generation_prompt, template variables, other
# variables that must change the text: the control)
FEATURES = [
    ("kimi_k2", [{"role": "user", "content": "Weather?"}], True, {"tools": [WEATHER]}, {}),
    ("ministral_3", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                     {"role": "assistant", "content": "", "tool_calls": call(CALL_ARGS)},
                     {"role": "tool", "tool_call_id": "call_1", "content": "21"},
                     {"role": "assistant", "content": "21 °C."}, {"role": "user", "content": "Merci"}],
     True, {"tools": [WEATHER]}, {}),
    ("gemma4", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
                 "tool_calls": call(CALL_ARGS)},
                {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 21}'}],
     True, {"tools": [WEATHER], "enable_thinking": True}, {"tools": [WEATHER]}),
    ("gemma4", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": " Again "}], True, {"enable_thinking": False}, {"enable_thinking": True}),
    ("gemma4", [{"role": "user", "content": "日本 😀"}], False, {}, {"enable_thinking": True}),
]


@pytest.mark.parametrize("case", range(len(FEATURES)))
def test_template_features_render_as_jinja2(case):
    """The templates' tools, calls, results and thinking through cflow's template environment
    equal HF's (Jinja2ChatFormatter): tojson without HTML escapes, Python string methods, the
    sandbox's `message.get`; each case's variables reach the text (control: other ones differ)."""
    family, msgs, add, kw, other = FEATURES[case]
    tok = family_tokenizer(family)
    expected = jinja_oracle(family, msgs, add, **kw)
    assert tok.apply_chat_template(msgs, add_generation_prompt=add, **kw) == expected
    assert tok.apply_chat_template(msgs, add_generation_prompt=add, **other) != expected


def test_tojson_control_html_escapes_miss(monkeypatch):
    """Control of the environment: with Jinja's own tojson (HTML-escaping <, >, &, ') the tools'
    JSON of Kimi-K2 and Ministral 3 no longer matches."""
    import jinja2.utils

    import cflow.tokenizer

    monkeypatch.setattr(cflow.tokenizer, "_tojson", lambda x, **kw: str(jinja2.utils.htmlsafe_json_dumps(x, **kw)))
    cflow.tokenizer._compile_template.cache_clear()
    try:
        for family, msgs, add, kw, _ in FEATURES[:2]:
            assert family_tokenizer(family).apply_chat_template(msgs, add_generation_prompt=add, **kw) != \
                jinja_oracle(family, msgs, add, **kw)
    finally:
        cflow.tokenizer._compile_template.cache_clear()


# ---- the answer side ---------------------------------------------------------------------------
@pytest.mark.parametrize("family, fmt, parser", [
    ("deepseek_v3_1", "generic", ThinkParser), ("kimi_k2", "generic", type(None)),
    ("ministral_3", "mistral11", type(None)), ("qwen3_5", "qwen3coder", ThinkParser),
    ("gemma4", "generic", ThinkParser)])
def test_tool_format_and_answer_parser(family, fmt, parser):
    """The tool-call format and reasoning parser each template gets: Qwen3.5's XML calls and
    Ministral 3's [TOOL_CALLS]name[ARGS]{...} natively; "generic" where cflow has no parser for the
    family's own call syntax (DeepSeek's <｜tool▁calls▁begin｜>, Kimi-K2's
    <|tool_calls_section_begin|>, Gemma 4's <|tool_call>): the tools go in a system message and
    the answer is schema-constrained JSON, and the template is not also given `tools` (it would
    describe them twice)."""
    tok = family_tokenizer(family)
    assert T.detect_format(tok) == fmt
    assert isinstance(answer_parser(tok.chat_template), parser)
    req = T.parse_tool_request({"tools": [WEATHER]})
    msgs, kw = T.prepare(fmt, [{"role": "user", "content": "Weather?"}], req)
    text = tok.apply_chat_template(msgs, **kw)
    described = text.count("The weather of a city now")
    assert described == 1, text
    if re.search(r"\btools\b", tok.chat_template):
        # control: a template that reads `tools`, given them beside the generic description, has both
        msgs, _ = T.prepare("generic", [{"role": "user", "content": "Weather?"}], req)
        assert tok.apply_chat_template(msgs, tools=req.tools).count("The weather of a city now") == 2


# (family, template variables, the model's answer after the prompt, reasoning, content)
THOUGHTS = [
    ("deepseek_v3_1", {"enable_thinking": True}, "The user greets.\n</think>\n\nHello! 😀", "The user greets.",
     "Hello! 😀"),
    ("deepseek_v3_1", {}, "Hello! 😀", "", "Hello! 😀"),
    ("qwen3_5", {}, "The user greets.\n</think>\n\nHello! 😀", "The user greets.", "Hello! 😀"),
    ("qwen3_5", {"enable_thinking": False}, "Hello! 😀", "", "Hello! 😀"),
]


@pytest.mark.parametrize("case", range(len(THOUGHTS)))
def test_thoughts_split_as_llama_cpp(case):
    """After the prompt each template renders, the answer splits as llama.cpp's deepseek
    reasoning format splits it: a generation prompt that opened <think> starts the answer inside
    the thought; with thinking off the whole answer is content. Controls: a parser not told of the
    opened thought leaves it in the content; one told of a thought that is not open takes the
    answer for one."""
    family, kw, answer, reasoning, content = THOUGHTS[case]
    tok = family_tokenizer(family)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], **kw)
    p = answer_parser(tok.chat_template, prompt[-32:])
    got = p.feed(answer)
    got += p.finish()
    assert (got.reasoning, got.content) == (reasoning, content)
    p = ThinkParser(opened=not reasoning)
    got = p.feed(answer)
    got += p.finish()
    assert (got.reasoning, got.content) != (reasoning, content)


def test_qwen3_5_answer_with_thought_and_xml_call():
    """A Qwen3.5 answer after its thinking prompt: the thought is reasoning_content, the XML call a
    tool call with its arguments typed by the schema (a string stays a string, the list is JSON).
    Control: read as the hermes format it used to get, the call stays content."""
    tok = family_tokenizer("qwen3_5")
    req = T.parse_tool_request({"tools": [WEATHER]})
    prompt = serve_render(tok, {"messages": [{"role": "user", "content": "Weather in Paris?"}],
                                "tools": [WEATHER]}, True)
    think = answer_parser(tok.chat_template, prompt[-32:]).mode == "think"
    answer = ("I need the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n2024\n"
              "</parameter>\n<parameter=days>\n[1, 2]\n</parameter>\n</function>\n</tool_call>")
    reasoning, content, calls = TC.parse_answer(T.detect_format(tok), req, answer, think=think)
    assert (reasoning, content) == ("I need the weather.", None)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "2024", "days": [1, 2]})]
    reasoning, content, calls = TC.parse_answer("hermes", req, answer, think=think)
    assert calls == [] and content.startswith("<tool_call>\n<function=get_weather>")


def test_ministral_3_answer_with_calls():
    """Ministral 3's calls as the model writes them (the markers special tokens, which its
    vocabulary shows in the text) come out as tool calls. Control: read as the older Mistral
    format (a JSON array after [TOOL_CALLS]), they stay content."""
    tok = family_tokenizer("ministral_3")
    req = T.parse_tool_request({"tools": [WEATHER]})
    tc, args = tok.special["[TOOL_CALLS]"], tok.special["[ARGS]"]
    ids = (tok.encode("Checking. ") + [tc] + tok.encode("get_weather") + [args] + tok.encode('{"city": "Paris"}')
           + [tc] + tok.encode("get_weather") + [args] + tok.encode('{"city": "Rome", "days": [3]}'))
    text = tok.decode(ids, skip_special=True)
    reasoning, content, calls = TC.parse_answer(T.detect_format(tok), req, text)
    assert (reasoning, content) == (None, "Checking. ")
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Rome", "days": [3]}]
    assert TC.parse_answer("mistral", req, text) == (None, text, [])


@pytest.mark.parametrize("thinking", [True, False])
def test_gemma4_thought_channel_splits(thinking):
    """Gemma 4 with enable_thinking writes `<|channel>thought\\n...\\n<channel|>` before its
    answer (special tokens its vocabulary shows in the text); the thought is reasoning_content.
    Without, the template closes an empty thought in the prompt and the answer is content.
    Controls: a vocabulary that drops the markers (another template) leaves the thought in the
    content; a parser told of an opened thought takes the plain answer for one."""
    tok = family_tokenizer("gemma4")
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], enable_thinking=thinking)
    assert prompt.endswith("<|turn>model\n" if thinking else "<|turn>model\n<|channel>thought\n<channel|>")
    answer = "<|channel>thought\nThe user greets.\n<channel|>Hello! 😀" if thinking else "Hello! 😀"
    text = tok.decode(tok.encode(answer), skip_special=True)
    p = answer_parser(tok.chat_template, prompt[-32:])
    got = p.feed(text)
    got += p.finish()
    assert (got.reasoning, got.content) == (("The user greets." if thinking else ""), "Hello! 😀")
    if thinking:
        plain = Tokenizer({**tok.to_header(), "chat_template": FAMILIES["qwen3_5"][0]})
        p = answer_parser(tok.chat_template, prompt[-32:])
        got = p.feed(plain.decode(plain.encode(answer), skip_special=True))
        got += p.finish()
        assert got.reasoning == "" and "The user greets." in got.content
    else:   # control: a parser told the prompt opened a thought takes the answer for one
        p = ThinkParser(opened=True)
        got = p.feed(text)
        got += p.finish()
        assert (got.reasoning, got.content) == ("Hello! 😀", "")
