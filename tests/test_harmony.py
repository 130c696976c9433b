"""gpt-oss's harmony chat format through cflow: the template, the vocabulary's structure tokens,
the answer's channels (reasoning_content, content, tool calls), and `cflow serve` end to end.

The template (tests/data/gpt_oss_chat_template.jinja) is OpenAI's harmony chat template for
gpt-oss (Apache-2.0), byte for byte as llama.cpp keeps it (models/templates/openai-gpt-oss-120b.jinja,
the llama.cpp that llama-cpp-python 0.3.36 vendors): model data, as a GGUF's
tokenizer.chat_template carries it.

The oracle of the rendering: llama.cpp's chat path for gpt-oss (common/chat, parsers/gpt-oss.cpp)
renders the file's template with its own Jinja engine after one change to the messages: an
assistant message's `reasoning_content` becomes `thinking` (and, when it has tool calls, its
`content` is dropped). llama-cpp-python's Jinja2ChatFormatter renders the same template with
jinja2, so it is the oracle here, fed the messages as llama.cpp hands them to the template
(written out by hand below, not computed with cflow's code); cflow gets the OpenAI request and
goes through its own path (cflow.serve.protocol, cflow.serve.tools.prepare,
Tokenizer.apply_chat_template). llama_chat_apply_template's built-in gpt-oss format (which
recognises `<|channel|>`) is not the oracle: it is a simplified form with no system preamble, no
developer message and no tools, which llama-server does not use for a template it can render.
Two things of llama-server's are not the renderer's and not done: it disables the template's
refusal of `<|channel|>` text inside an assistant content, and with add_generation_prompt false
it turns the last `<|return|>` into `<|end|>` (continuing a final message); cflow renders the
template as it is, as HF transformers and Jinja2ChatFormatter do.

llama.cpp's own chat path (common_chat_templates_apply and common_chat_parse of the
libllama-common that llama-cpp-python 0.3.36 ships, called from a small C++ program built
against its headers: not part of the suite, which cannot build one) gave the same prompts on
CASES, its clock's date aside, except the case with add_generation_prompt false (the `<|return|>`
above), and the same reasoning, content and calls on ANSWERS where it parses them; it refuses
text outside the structure, which cflow keeps as content.
"""

from __future__ import annotations

import ctypes
import json
import random
from datetime import datetime
from pathlib import Path

import pytest

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="the llama.cpp oracle is not installed: pip install 'llama-cpp-python>=0.3.16'")
gguf = pytest.importorskip("gguf")
pytest.importorskip("torch")

from test_convert_gguf import MERGES  # noqa: E402
from test_gptoss import write_gptoss_gguf  # noqa: E402

from cflow.reasoning import HarmonyParser, ThinkParser  # noqa: E402
from cflow.serve import protocol as P  # noqa: E402
from cflow.serve import tool_calls as TC  # noqa: E402
from cflow.serve import tools as T  # noqa: E402
from cflow.tokenizer import bytes_to_unicode  # noqa: E402

TEMPLATE = (Path(__file__).parent / "data" / "gpt_oss_chat_template.jinja").read_text(encoding="utf-8")
# gpt-oss's special tokens (o200k_harmony), in a tiny byte-level vocabulary
SERVE_CTX = 1024   # a chat with tools is ~600 tokens of this byte-level vocabulary
HARMONY = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
           "<|end|>", "<|message|>", "<|call|>"]


def harmony_vocab(specials: list[str], plain: tuple[str, ...] = ()) -> list[str]:
    b2u = bytes_to_unicode()
    return [b2u[b] for b in range(256)] + ["Ġt", "he", "Ġthe", *plain] + specials


def tokenizer_writer(specials: list[str], plain: tuple[str, ...] = ()):
    """(writer of the tokenizer keys, vocabulary size) for test_gptoss.write_gptoss_gguf: gpt-oss's
    specials as control tokens (and `plain` as normal ones), <|return|> the EOS, the harmony
    template."""
    vocab = harmony_vocab(specials, plain)

    def write(wr) -> None:
        wr.add_tokenizer_model("gpt2")
        wr.add_tokenizer_pre("smollm")
        wr.add_token_list(vocab)
        wr.add_token_types([1] * (len(vocab) - len(specials)) + [3] * len(specials))
        wr.add_token_merges(MERGES)
        wr.add_bos_token_id(vocab.index(specials[0]))
        wr.add_eos_token_id(vocab.index("<|return|>"))
        wr.add_add_bos_token(False)
        wr.add_chat_template(TEMPLATE)

    return write, len(vocab)


@pytest.fixture(scope="module")
def oss_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("harmony") / "oss.gguf"
    write_gptoss_gguf(path, seed=0, tokenizer=tokenizer_writer(HARMONY), ctx=SERVE_CTX)
    return path


@pytest.fixture(scope="module")
def tok(oss_file):
    from test_tokenizer_gguf import cflow_from_gguf

    return cflow_from_gguf(oss_file)


class FixedNow(datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2025, 3, 14, 9, 26)


@pytest.fixture
def fixed_date(monkeypatch):
    """strftime_now renders one date in cflow's environment and the oracle's."""
    import llama_cpp.llama_chat_format as lcf

    import cflow.tokenizer

    monkeypatch.setattr(cflow.tokenizer, "datetime", FixedNow)
    monkeypatch.setattr(lcf, "datetime", FixedNow)


# ---- the rendering -----------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city now",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city's name"},
        "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
        "days": {"type": "array", "items": {"type": "integer"}}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "time_now", "description": "The time", "parameters": {
    "type": "object", "properties": {}}}}
ARGS = {"city": "Paris", "unit": "c"}


def call(args, cid="call_1", name="get_weather"):
    return [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}]


# Each case: (the OpenAI request's fields, the messages as llama.cpp hands them to the template,
# add_generation_prompt). The second column is written out from llama.cpp's gpt-oss path:
# reasoning_content -> thinking; content dropped beside tool calls with reasoning; null content "";
# arguments as objects (minja's requires_object_arguments); a developer message as a developer's
# (cflow's protocol makes it a system one: the template reads both alike).
CASES = [
    ({"messages": [{"role": "user", "content": "Hello there!"}]},
     [{"role": "user", "content": "Hello there!"}], True),
    ({"messages": [{"role": "user", "content": "Hello there!"}]},
     [{"role": "user", "content": "Hello there!"}], False),
    ({"messages": [{"role": "system", "content": "Answer in one word."},
                   {"role": "user", "content": " Why? "},
                   {"role": "assistant", "content": "Because.", "reasoning_content": "They ask why."},
                   {"role": "user", "content": "日本 😀\nok"}], "reasoning_effort": "low"},
     [{"role": "system", "content": "Answer in one word."},
      {"role": "user", "content": " Why? "},
      {"role": "assistant", "content": "Because.", "reasoning_content": "They ask why.", "thinking": "They ask why."},
      {"role": "user", "content": "日本 😀\nok"}], True),
    # the last assistant turn with add_generation_prompt false: its thinking is rendered
    ({"messages": [{"role": "developer", "content": "Be kind."},
                   {"role": "user", "content": "2+2?"},
                   {"role": "assistant", "content": "4", "reasoning_content": "Add them: 4."}]},
     [{"role": "developer", "content": "Be kind."},
      {"role": "user", "content": "2+2?"},
      {"role": "assistant", "content": "4", "reasoning_content": "Add them: 4.", "thinking": "Add them: 4."}], False),
    # tools, a call with its reasoning (content null), the result, the generation prompt
    ({"messages": [{"role": "system", "content": "Use tools."},
                   {"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": None, "reasoning_content": "I need the weather tool.",
                    "tool_calls": call(json.dumps(ARGS))},
                   {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}],
      "tools": [WEATHER, CLOCK], "reasoning_effort": "high"},
     [{"role": "system", "content": "Use tools."},
      {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "reasoning_content": "I need the weather tool.", "thinking": "I need the weather tool.",
       "tool_calls": call(ARGS)},
      {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}], True),
    # a call with text and no reasoning (the template's analysis), its result, the final answer, more
    ({"messages": [{"role": "user", "content": "Time?"},
                   {"role": "assistant", "content": "Let me look.", "tool_calls": call("{}", "c9", "time_now")},
                   {"role": "tool", "tool_call_id": "c9", "content": "09:26"},
                   {"role": "assistant", "content": "It is 09:26.", "reasoning_content": "Read the tool."},
                   {"role": "user", "content": "Thanks"}],
      "tools": [CLOCK]},
     [{"role": "user", "content": "Time?"},
      {"role": "assistant", "content": "Let me look.", "tool_calls": call({}, "c9", "time_now")},
      {"role": "tool", "tool_call_id": "c9", "content": "09:26"},
      {"role": "assistant", "content": "It is 09:26.", "reasoning_content": "Read the tool.",
       "thinking": "Read the tool."},
      {"role": "user", "content": "Thanks"}], True),
]
WITH_REASONING = [i for i, c in enumerate(CASES) if any("thinking" in m for m in c[1])]


def cflow_render(tok, body: dict, add: bool) -> str:
    """The request through cflow's chat path: protocol, tools.prepare, the tokenizer's template."""
    spec = P.parse_chat(body, P.Defaults())
    fmt = T.detect_format(tok)
    messages, kw = T.prepare(fmt, spec.messages, spec.tools)
    if spec.reasoning_effort is not None:
        kw["reasoning_effort"] = spec.reasoning_effort
    return tok.apply_chat_template(messages, add_generation_prompt=add, **kw)


def oracle_render(tok, messages: list[dict], add: bool, body: dict) -> str:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    fmt = Jinja2ChatFormatter(TEMPLATE, eos_token=tok.vocab[tok.eos_id], bos_token=tok.vocab[tok.bos_id],
                              add_generation_prompt=add)
    kw = {"reasoning_effort": body["reasoning_effort"]} if "reasoning_effort" in body else {}
    return fmt(messages=messages, tools=body.get("tools"), **kw).prompt


@pytest.mark.parametrize("case", range(len(CASES)))
def test_template_renders_as_llama_cpp(tok, fixed_date, case):
    body, theirs, add = CASES[case]
    expected = oracle_render(tok, theirs, add, body)
    assert "Current date: 2025-03-14" in expected
    assert cflow_render(tok, body, add) == expected


def test_template_reads_the_features_it_is_given(tok, fixed_date):
    """What the cases exercise reaches the text: thinking on the analysis channel, the tool
    namespace, the call, its result, reasoning effort, the generation prompt."""
    body, _, add = CASES[4]
    text = cflow_render(tok, body, add)
    for part in ("Reasoning: high", "# Instructions\n\nUse tools.", "namespace functions {", "type get_weather = (_: {",
                 'unit?: "c" | "f", // default: c', "<|channel|>analysis<|message|>I need the weather tool.<|end|>",
                 '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", '
                 '"unit": "c"}<|call|>', '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
                 '"{\\"temp\\": 21}"<|end|>'):
        assert part in text, part
    assert text.endswith("<|start|>assistant")


def test_control_without_the_thinking_mapping_misses(tok, fixed_date, monkeypatch):
    """Dropping reasoning_content -> thinking (cflow.reasoning.template_messages) loses the
    analysis of every case whose thinking the template renders (a call's, the last turn's in
    training form; earlier turns' thoughts the template drops itself)."""
    import cflow.reasoning

    shown = []
    for case in WITH_REASONING:
        body, theirs, add = CASES[case]
        thoughts = [m["thinking"] for m in theirs if "thinking" in m]
        if any(f"<|channel|>analysis<|message|>{t}<|end|>" in oracle_render(tok, theirs, add, body) for t in thoughts):
            shown.append(case)
    assert len(shown) >= 2
    monkeypatch.setattr(cflow.reasoning, "template_messages", lambda template, messages: messages)
    for case in shown:
        body, theirs, add = CASES[case]
        assert cflow_render(tok, body, add) != oracle_render(tok, theirs, add, body), case


def test_template_refusals_are_named_errors(tok):
    from cflow.errors import CflowError

    with pytest.raises(CflowError, match="no previous assistant message with a tool call"):
        tok.apply_chat_template([{"role": "user", "content": "x"}, {"role": "tool", "content": "1"}])
    with pytest.raises(P.BadRequest, match="reasoning_content must be a string"):
        P.parse_chat({"messages": [{"role": "assistant", "content": "x", "reasoning_content": 3}]}, P.Defaults())
    with pytest.raises(P.BadRequest, match="reasoning_effort"):
        P.parse_chat({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "max"}, P.Defaults())


# ---- the vocabulary: what stops generation, what the detokenizer shows ------------------------
def llama_view(path: Path, n_special: int) -> tuple[set[int], dict[int, str]]:
    """llama.cpp's end-of-generation ids and the pieces of the last `n_special` ids (the
    specials) with specials not rendered."""
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        n = llama_cpp.llama_vocab_n_tokens(vocab)
        eog = {i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i)}
        pieces = {}
        buf = ctypes.create_string_buffer(64)
        for i in range(n - n_special, n):
            k = llama_cpp.llama_token_to_piece(vocab, i, buf, len(buf), 0, False)
            pieces[i] = buf.raw[:k].decode()
        return eog, pieces
    finally:
        llm.close()


@pytest.mark.parametrize("specials", [HARMONY, [t for t in HARMONY if t != "<|call|>"]],
                         ids=["harmony", "without-call"])
def test_stop_tokens_and_shown_specials_as_llama_cpp(tmp_path, specials):
    """llama.cpp ends generation at <|return|> and <|call|>, not at <|end|> (which closes one
    message of the answer), and renders the structure tokens even with specials off; without
    <|call|> in the vocabulary <|end|> stops again (the control)."""
    from test_tokenizer_gguf import cflow_from_gguf

    path = tmp_path / "oss.gguf"
    write_gptoss_gguf(path, seed=0, tokenizer=tokenizer_writer(specials))
    tok = cflow_from_gguf(path)
    eog, pieces = llama_view(path, len(specials))
    assert set(tok.stop_ids) == eog
    assert (tok.special["<|end|>"] in eog) == ("<|call|>" not in specials)
    for i, piece in pieces.items():
        assert tok.stream(skip_special=True).put(i) == piece, tok.vocab[i]
    assert pieces[tok.special["<|channel|>"]] == "<|channel|>" and pieces[tok.special["<|return|>"]] == ""


# every name llama.cpp's vocabulary loader makes an end-of-generation token (llama-vocab.cpp), and
# near names that must not stop (the controls)
EOG_NAMES = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|flush|>", "<|calls|>", "<EOT>",
             "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>",
             "<|tool_response>")
NOT_EOG = ("</s>", "<|im_start|>", "<|turn>", "<tool_response|>", "[EOT", "<end_of_turn")


@pytest.mark.parametrize("control", [True, False], ids=["control-tokens", "normal-tokens"])
def test_end_of_generation_names_as_llama_cpp(tmp_path, control):
    """Generation stops on the tokens llama.cpp's loader makes end-of-generation by name (Gemma 4's
    <turn|>, Kimi-K2's [EOT], ...), whether the vocabulary marks them control or normal; near
    names do not stop."""
    from test_tokenizer_gguf import cflow_from_gguf

    path = tmp_path / "eog.gguf"
    names = list(EOG_NAMES) + list(NOT_EOG)
    specials = HARMONY + names if control else HARMONY
    write_gptoss_gguf(path, seed=0, tokenizer=tokenizer_writer(specials, () if control else tuple(names)))
    tok = cflow_from_gguf(path)
    eog, _ = llama_view(path, len(specials))
    assert set(tok.stop_ids) == eog
    assert {tok.vocab[i] for i in eog} >= set(EOG_NAMES) and not {tok.vocab[i] for i in eog} & set(NOT_EOG)


# ---- the answer ---------------------------------------------------------------------------------
ANSWERS = [  # (generated text after the prompt's "<|start|>assistant", reasoning, content, calls)
    ("<|channel|>analysis<|message|>User greets. Reply.<|end|><|start|>assistant<|channel|>final<|message|>Hi! 😀",
     "User greets. Reply.", "Hi! 😀", []),
    ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>"
     'commentary json<|message|>{"city": "Paris"}', "Need weather.", "", [("get_weather", '{"city": "Paris"}')]),
    # the recipient after the channel, with <|constrain|> (how the model often writes it)
    ('<|channel|>commentary to=functions.time_now <|constrain|>json<|message|>{}', "", "", [("time_now", "{}")]),
    # the model opening its own message first
    ("<|start|>assistant<|channel|>final<|message|>Hi", "", "Hi", []),
    # a preamble on the commentary channel is content; two analysis messages join
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
     "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final"
     "<|message|>Done", "ab", "Checking.Done", []),
    # no structure at all: content as it is; cut off inside the analysis (max_tokens): reasoning so far
    ("Just text <| not a tag", "", "Just text <| not a tag", []),
    ("<|channel|>analysis<|message|>Thinking about <|e", "Thinking about <|e", "", []),
]


def _stream(parser, pieces):
    out = parser.feed("")
    for p in pieces:
        out += parser.feed(p)
    out += parser.finish()
    return out


@pytest.mark.parametrize("case", range(len(ANSWERS)))
def test_harmony_parser_at_every_cut(case):
    text, reasoning, content, calls = ANSWERS[case]
    whole = _stream(HarmonyParser(), [text])
    assert (whole.reasoning, whole.content, whole.calls) == (reasoning, content, calls)
    for cut in range(len(text) + 1):
        got = _stream(HarmonyParser(), [text[:cut], text[cut:]])
        assert (got.reasoning, got.content, got.calls) == (reasoning, content, calls), cut
    rng = random.Random(case)
    cuts = sorted(rng.sample(range(len(text)), min(8, len(text))))
    got = _stream(HarmonyParser(), [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    assert (got.reasoning, got.content, got.calls) == (reasoning, content, calls)


def test_harmony_reasoning_streams_before_the_end():
    p = HarmonyParser()
    assert p.feed("<|channel|>analysis<|message|>Step one").reasoning == "Step one"
    assert p.feed(" and<|").reasoning == " and"       # "<|" may begin <|end|>: held
    assert p.feed("end|><|start|>assistant<|channel|>final<|message|>Ok").content == "Ok"


def tool_req(choice="auto"):
    return T.parse_tool_request({"tools": [WEATHER, CLOCK], "tool_choice": choice})


def test_answer_parser_checks_the_calls():
    text = ANSWERS[1][0]
    reasoning, content, calls = TC.parse_answer("harmony", tool_req(), text)
    assert reasoning == "Need weather." and content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    # an unknown function, arguments that are no JSON object, or tools off: the body is content
    for t, req in ((text.replace("get_weather", "rain"), tool_req()),
                   (text.replace('{"city": "Paris"}', '{"city": '), tool_req()),
                   (text, tool_req("none")), (text, None)):
        reasoning, content, calls = TC.parse_answer("harmony", req, t)
        assert calls == [] and reasoning == "Need weather." and content.startswith('{"city": ')
    # other formats have no reasoning: the text is theirs
    assert TC.parse_answer("generic", None, ANSWERS[0][0]) == (None, ANSWERS[0][0], [])


def walk(constraint, ids) -> tuple[int, bool]:
    """How many of `ids` the constraint takes in order (all of them: the text fits so far), and
    whether it accepts the text there (a complete match)."""
    c = constraint.copy()
    for k, t in enumerate(ids):
        if not c.allows(t):
            return k, False
        c.advance(t)
    return len(ids), c.accepting


def test_detect_format_and_grammar(tok):
    """tool_choice "required": as llama.cpp's gpt-oss grammar, the call may follow an analysis
    message and a commentary preamble, its recipient before or after the channel; an answer
    without a call, or text after the call, does not fit (the controls)."""
    from cflow.constrain import compile_constraint

    assert T.detect_format(tok) == "harmony"
    forced = compile_constraint(T.constraint_for("harmony", tool_req("required"), tok), tok)
    named = compile_constraint(T.constraint_for(
        "harmony", T.parse_tool_request({"tools": [WEATHER, CLOCK], "tool_choice": {
            "type": "function", "function": {"name": "time_now"}}}), tok), tok)
    thought = "<|channel|>analysis<|message|>Need weather: call it {now}. <|x|>\n<|end|><|start|>assistant"
    preamble = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
    calls = [' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}',
             '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
             '<|channel|>analysis to=functions.get_weather<|message|>{"city": "Paris", "days": [1, 2]}',
             " to=functions.time_now<|channel|>commentary<|message|>{}"]
    for head in ("", thought, preamble, thought + preamble):
        for body in calls:
            ids = tok.encode(head + body)
            assert walk(forced, ids) == (len(ids), True), head + body
    ids = tok.encode(thought + calls[3])
    assert walk(named, ids) == (len(ids), True)
    # controls: a final answer instead of a call; the other function when one is named; the
    # preamble before the thought; arguments off the schema; more text after the call
    for text, c in ((ANSWERS[0][0], forced), (thought + calls[0], named), (preamble + thought + calls[0], forced),
                    (thought + calls[0].replace('"Paris"', "7"), forced), (calls[3] + "<|end|>", forced)):
        ids = tok.encode(text)
        assert walk(c, ids) != (len(ids), True), text


def test_harmony_schema_shapes_the_final_message(tok):
    """A JSON schema on a gpt-oss chat (response_format) constrains the final message, after an
    optional analysis message, as llama.cpp's grammar does; bare JSON with no channel, or a
    final message that is not the schema's, does not fit (the controls). Other constraints are
    the whole answer (unchanged)."""
    from cflow.constrain import ConstraintSpec, compile_constraint

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    c = compile_constraint(T.harmony_constraint(ConstraintSpec("json_schema", schema), tok), tok)
    thought = "<|channel|>analysis<|message|>The user wants a city.<|end|><|start|>assistant"
    for text in ('<|channel|>final<|message|>{"city": "Oslo"}', thought + '<|channel|>final<|message|>{"city": "Oslo"}',
                 thought + '<|channel|>final <|constrain|>json<|message|>{"city": "Oslo"}'):
        ids = tok.encode(text)
        assert walk(c, ids) == (len(ids), True), text
    for text in ('{"city": "Oslo"}', '<|channel|>final<|message|>{"town": "Oslo"}',
                 '<|channel|>final<|message|>Oslo', thought + '<|channel|>analysis<|message|>{"city": "Oslo"}'):
        ids = tok.encode(text)
        assert walk(c, ids) != (len(ids), True), text
    regex = ConstraintSpec("regex", "[a-z]+")
    assert T.harmony_constraint(regex, tok) is regex
    obj = compile_constraint(T.harmony_constraint(ConstraintSpec("json_object"), tok), tok)
    ids = tok.encode('<|channel|>final<|message|>{"any": [1]}')
    assert walk(obj, ids) == (len(ids), True)


# reasoning_format "none": what llama.cpp's gpt-oss parser leaves in the content (an analysis
# message from its header to its <|end|> inclusive; the role after <|start|> is not content)
THOUGHTS_AS_CONTENT = {
    0: "<|channel|>analysis<|message|>User greets. Reply.<|end|>Hi! 😀",
    1: "<|channel|>analysis<|message|>Need weather.<|end|>",
    2: "",
    4: "<|channel|>analysis<|message|>a<|end|><|channel|>analysis<|message|>b<|end|>Checking.Done",
    6: "<|channel|>analysis<|message|>Thinking about <|e",
}


@pytest.mark.parametrize("case", sorted(THOUGHTS_AS_CONTENT))
def test_harmony_thoughts_left_in_content(case):
    text, _, _, calls = ANSWERS[case]
    for cut in range(len(text) + 1):
        got = _stream(HarmonyParser(thoughts_in_content=True), [text[:cut], text[cut:]])
        assert (got.reasoning, got.content, got.calls) == ("", THOUGHTS_AS_CONTENT[case], calls), cut


THINKS = [  # (answer, the prompt opened the thought, (reasoning, content)): llama.cpp's deepseek format
    ("<think>\nPlan it.\n</think>\n\nAnswer", False, ("Plan it.", "Answer")),
    (" a  b \n</think> Answer</think>", True, ("a  b", "Answer</think>")),
    ("<think>\n\n</think>\n\nHi", False, ("", "Hi")),
    ("No thinking here <think>", False, ("", "No thinking here <think>")),
    ("<think>cut off  ", False, ("cut off", "")),
    # Gemma 4's thought channel: its own end, not </think>
    ("<|channel>thought\nPlan </think> it.\n<channel|>Answer", False, ("Plan </think> it.", "Answer")),
    ("<|channel>thought\n<channel|>Hi <|channel>", False, ("", "Hi <|channel>")),
    ("<|channel>though", False, ("", "<|channel>though")),
]


@pytest.mark.parametrize("case", range(len(THINKS)))
def test_think_parser_at_every_cut(case):
    text, opened, want = THINKS[case]
    for cut in range(len(text) + 1):
        got = _stream(ThinkParser(opened), [text[:cut], text[cut:]])
        assert (got.reasoning, got.content) == want, cut
    got = _stream(ThinkParser(opened), list(text))
    assert (got.reasoning, got.content) == want


def test_think_then_tool_calls():
    """A <think> block, then the family's tool call (hermes): reasoning, calls; without the think
    parsing (the control) the thought stays in the content."""
    from cflow.reasoning import prompt_opens_thought, thinks_in_tags

    text = '<think>\nThe weather tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": ' \
           '{"city": "Paris"}}\n</tool_call>'
    reasoning, content, calls = TC.parse_answer("hermes", tool_req(), text, think=False)
    assert reasoning == "The weather tool." and content is None and calls[0]["function"]["name"] == "get_weather"
    reasoning, content, calls = TC.parse_answer("hermes", tool_req(), text)
    assert reasoning is None and content.startswith("<think>") and len(calls) == 1
    assert thinks_in_tags("{{ '<think>' }}") and not thinks_in_tags(TEMPLATE) and not thinks_in_tags(None)
    assert prompt_opens_thought("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thought("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# ---- cflow chat -------------------------------------------------------------------------------
class StubEngine:
    """What cflow chat's _answer uses of an engine: a chat template, the rendered prompt, and a
    stream of pieces; it keeps the template variables it was given."""

    def __init__(self, template: str, pieces: list[str], prompt: str = ""):
        self.tokenizer = type("Tok", (), {"chat_template": template, "decode": lambda _, ids: prompt})()
        self.pieces = pieces
        self.template_kw: dict = {}

    def chat_tokens(self, messages, **template_kw):
        self.template_kw = template_kw
        return [0]

    def generate(self, prompt, max_tokens, **kw):
        return iter(self.pieces)


def test_cflow_chat_shows_thoughts_on_stderr_and_keeps_them_apart(capsys):
    from cflow.cli.chat import _answer

    text = ANSWERS[0][0]
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    eng = StubEngine(TEMPLATE, pieces)
    message = _answer(eng, [{"role": "user", "content": "Hi"}], None, {}, {"reasoning_effort": "high"})
    out, err = capsys.readouterr()
    assert message == {"role": "assistant", "content": "Hi! 😀", "reasoning_content": "User greets. Reply."}
    assert out == "Hi! 😀\n" and "User greets. Reply." in err
    assert eng.template_kw == {"reasoning_effort": "high"}   # --chat-template-kwargs reach the template
    # --reasoning-format none, and (control) a template without harmony's channels: the text as it came
    for eng, show in ((StubEngine(TEMPLATE, pieces), False), (StubEngine("{{ messages }}", pieces), True)):
        message = _answer(eng, [{"role": "user", "content": "Hi"}], None, {}, show_thoughts=show)
        assert message == {"role": "assistant", "content": text} and capsys.readouterr().out == text + "\n"
    # a <think> template whose prompt opened the thought
    eng = StubEngine("{{ '<think>' }}", ["Plan", ".</th", "ink>\n\nDone"], prompt="<|im_start|>assistant\n<think>\n")
    assert _answer(eng, [], None, {}) == {"role": "assistant", "content": "Done", "reasoning_content": "Plan."}


def test_chat_flags_refuse_bad_template_variables(capsys):
    from cflow.cli import main

    for value, says in (("{oops", "not valid JSON"), ("[1]", "must be a JSON object"),
                        ('{"add_generation_prompt": false}', "set by cflow itself")):
        assert main(["chat", "--chat-template-kwargs", value]) == 2
        assert says in capsys.readouterr().err


# ---- cflow serve, end to end ------------------------------------------------------------------
@pytest.fixture(scope="module")
def oss_server(oss_file, tmp_path_factory):
    """`cflow serve` on the random-weight gpt-oss file with the harmony vocabulary and template."""
    pytest.importorskip("starlette", reason="the serve extra is not installed: pip install 'cflow-lm[serve]'")
    pytest.importorskip("llguidance", reason="constraints need llguidance: pip install 'cflow-lm[structured]'")
    from test_serve import Live

    from cflow.convert import convert

    dst = tmp_path_factory.mktemp("harmony-serve") / "oss.cflow"
    convert(oss_file, dst)
    server = Live("-m", str(dst), "--alias", "oss", "-np", "1", "-c", str(SERVE_CTX), "-t", "1", ready_timeout=300)
    yield server
    server.stop()


def ask(server, body: dict) -> dict:
    from test_serve import request

    status, _, raw = request(server, "POST", "/v1/chat/completions", {"model": "oss", "temperature": 0, **body},
                             key=None)
    assert status == 200, raw
    return json.loads(raw)


def ask_streamed(server, body: dict) -> tuple[str, str, list[dict], str]:
    """(reasoning, content, calls, finish_reason) assembled from the stream's deltas."""
    from test_serve import request

    status, _, raw = request(server, "POST", "/v1/chat/completions",
                             {"model": "oss", "temperature": 0, "stream": True, **body}, key=None)
    assert status == 200, raw
    reasoning = content = finish = ""
    calls: list[dict] = []
    for line in raw.decode().splitlines():
        if not line.startswith("data: {"):
            continue
        choice = json.loads(line[6:])["choices"][0]
        d = choice["delta"]
        reasoning += d.get("reasoning_content") or ""
        content += d.get("content") or ""
        calls += [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in d.get("tool_calls", [])]
        finish = choice["finish_reason"] or finish
    return reasoning, content, calls, finish


UNIT = {"type": "function", "function": {"name": "set_unit", "description": "Choose the unit", "parameters": {
    "type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["unit"]}}}
QUESTION = [{"role": "user", "content": "Which unit?"}]


def test_served_tool_call_in_harmony(oss_server):
    """tool_choice naming a function: the harmony grammar makes the random model write the call
    (` to=functions.set_unit<|channel|>commentary json<|message|>{...}`), <|call|> ends it, and
    the answer carries it as an OpenAI tool call, streamed and not."""
    body = {"messages": QUESTION, "tools": [UNIT, CLOCK], "max_tokens": 100,
            "tool_choice": {"type": "function", "function": {"name": "set_unit"}}}
    ch = ask(oss_server, body)["choices"][0]
    assert ch["finish_reason"] == "tool_calls", ch
    (c,) = ch["message"]["tool_calls"]
    assert c["function"]["name"] == "set_unit" and json.loads(c["function"]["arguments"]) in ({"unit": "c"},
                                                                                             {"unit": "f"})
    assert ch["message"]["content"] is None and "reasoning_content" not in ch["message"]
    reasoning, content, calls, finish = ask_streamed(oss_server, body)
    assert (reasoning, content, finish) == ("", "", "tool_calls")
    assert calls == [{"name": "set_unit", "arguments": c["function"]["arguments"]}]


def test_served_reasoning_and_content(oss_server, tok):
    """A grammar (llama-server's `grammar` field) forcing an analysis message and a final one: the
    answer's reasoning_content and content, streamed and not; <|end|> between them does not stop
    generation."""
    s = tok.special
    grammar = (f'start: <[{s["<|channel|>"]}]> "analysis" <[{s["<|message|>"]}]> "Let me think." '
               f'<[{s["<|end|>"]}]> <[{s["<|start|>"]}]> "assistant" <[{s["<|channel|>"]}]> "final" '
               f'<[{s["<|message|>"]}]> "Hello!"')
    body = {"messages": QUESTION, "grammar": grammar, "max_tokens": 60}
    ch = ask(oss_server, body)["choices"][0]
    assert ch["finish_reason"] == "stop", ch
    assert ch["message"] == {"role": "assistant", "content": "Hello!", "reasoning_content": "Let me think."}
    assert ask_streamed(oss_server, body) == ("Let me think.", "Hello!", [], "stop")
    # reasoning_effort reaches the template (a request naming an effort the template knows works)
    assert ask(oss_server, {**body, "reasoning_effort": "low"})["choices"][0]["message"]["content"] == "Hello!"


def test_served_reasoning_format_none_and_template_kwargs(oss_server, tok):
    """reasoning_format "none" leaves the analysis message in the content as written (llama.cpp's
    gpt-oss parser with reasoning_format none), streamed and not; chat_template_kwargs reach the
    template (the prompt is the one rendered with them; reasoning_effort's own field wins over
    the same key there); malformed values get a 400 naming the field."""
    from test_serve import request

    s = tok.special
    grammar = (f'start: <[{s["<|channel|>"]}]> "analysis" <[{s["<|message|>"]}]> "Let me think." '
               f'<[{s["<|end|>"]}]> <[{s["<|start|>"]}]> "assistant" <[{s["<|channel|>"]}]> "final" '
               f'<[{s["<|message|>"]}]> "Hello!"')
    body = {"messages": QUESTION, "grammar": grammar, "max_tokens": 60, "reasoning_format": "none"}
    raw = "<|channel|>analysis<|message|>Let me think.<|end|>Hello!"
    assert ask(oss_server, body)["choices"][0]["message"] == {"role": "assistant", "content": raw}
    assert ask_streamed(oss_server, body) == ("", raw, [], "stop")

    def prompt_tokens(extra: dict) -> int:
        return ask(oss_server, {"messages": QUESTION, "max_tokens": 1, **extra})["usage"]["prompt_tokens"]

    def rendered(**kw) -> int:
        return len(tok.apply_chat_template(QUESTION, tokenize=True, **kw))

    identity = "You are a tiny test model."
    assert prompt_tokens({}) == rendered() != rendered(model_identity=identity)
    assert prompt_tokens({"chat_template_kwargs": {"model_identity": identity}}) == rendered(model_identity=identity)
    assert prompt_tokens({"chat_template_kwargs": {"reasoning_effort": "high"}, "reasoning_effort": "low"}) == \
        rendered(reasoning_effort="low") != rendered(reasoning_effort="high")
    for field, value in (("chat_template_kwargs", "x"), ("chat_template_kwargs", {"messages": []}),
                         ("chat_template_kwargs", {"tools": []}), ("chat_template_kwargs", {"not a name": 1}),
                         ("reasoning_format", "deepseek-legacy"), ("reasoning_format", 1)):
        status, _, out = request(oss_server, "POST", "/v1/chat/completions",
                                 {"messages": QUESTION, "max_tokens": 1, field: value}, key=None)
        assert status == 400 and json.loads(out)["error"]["param"] == field, (field, value, out)


def test_served_schema_in_the_final_message(oss_server, tok):
    """response_format on a gpt-oss chat: the schema shapes the final message (harmony_constraint),
    so the model writes the channel structure (counted in completion_tokens: bare JSON, as a
    schema over the whole answer would force, has none) and the content is the JSON."""
    schema = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["unit"]}
    body = {"messages": QUESTION, "max_tokens": 200,
            "response_format": {"type": "json_schema", "json_schema": {"name": "u", "schema": schema}}}
    answer = ask(oss_server, body)
    ch = answer["choices"][0]
    assert ch["finish_reason"] == "stop", ch
    assert json.loads(ch["message"]["content"]) in ({"unit": "c"}, {"unit": "f"}), ch
    # <|channel|>, "final" (5 tokens of this byte-level vocabulary), <|message|> at least
    assert answer["usage"]["completion_tokens"] >= len(tok.encode(ch["message"]["content"])) + 7
    reasoning, content, calls, finish = ask_streamed(oss_server, body)
    assert (content, calls, finish) == (ch["message"]["content"], [], "stop")
    assert reasoning == ch["message"].get("reasoning_content", "")


def test_serve_flags_set_the_defaults_requests_override(oss_file):
    """`cflow serve --reasoning-format none --chat-template-kwargs JSON`: every chat request's
    defaults, each field overridable by the request (its template variables merged over the
    server's); a bad flag is a usage error naming it before the server listens."""
    from cflow.cli import build_parser
    from cflow.cli import serve as cli_serve
    from cflow.cli.common import UsageError

    def defaults(*flags):
        args = build_parser().parse_args(["serve", "-m", str(oss_file), *flags])
        cli_serve._check(args)
        return cli_serve.app_options(args)["defaults"]

    d = defaults("--reasoning-format", "none", "--chat-template-kwargs", '{"enable_thinking": false, "x": 1}')
    spec = P.parse_chat({"messages": QUESTION}, d)
    assert (spec.reasoning_format, spec.template_kwargs) == ("none", {"enable_thinking": False, "x": 1})
    spec = P.parse_chat({"messages": QUESTION, "reasoning_format": "deepseek",
                         "chat_template_kwargs": {"x": 2}}, d)
    assert (spec.reasoning_format, spec.template_kwargs) == ("auto", {"enable_thinking": False, "x": 2})
    spec = P.parse_chat({"messages": QUESTION}, defaults())
    assert (spec.reasoning_format, spec.template_kwargs) == ("auto", {})
    for bad in ('{"tools": []}', "not json", "3"):
        with pytest.raises(UsageError) as e:
            defaults("--chat-template-kwargs", bad)
        assert e.value.flag == "--chat-template-kwargs"


# a Qwen3-style template: the generation prompt opens <think>, or closes an empty one when the
# caller passes enable_thinking false (chat_template_kwargs)
THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
                  "not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def think_server(oss_server, tmp_path_factory):
    """The same model served with THINK_TEMPLATE, thoughts left in the content by default."""
    from test_serve import Live

    folder = tmp_path_factory.mktemp("think-serve")
    (folder / "think.jinja").write_text(THINK_TEMPLATE, encoding="utf-8")
    model = [a for a in oss_server.proc.args if a.endswith(".cflow")][0]
    server = Live("-m", model, "--alias", "oss", "-np", "1", "-c", "512", "-t", "1", "--chat-template-file",
                  str(folder / "think.jinja"), "--reasoning-format", "none", ready_timeout=300)
    yield server
    server.stop()


def test_served_think_blocks(think_server):
    """A <think> model: with the server's --reasoning-format none the thought stays in the
    content; a request's "reasoning_format": "auto" splits it into reasoning_content (the prompt
    opened the thought); chat_template_kwargs {"enable_thinking": false} closes the thought in
    the prompt, so the answer is all content."""
    grammar = 'start: "Plan it.</think>\\n\\nDone"'
    body = {"messages": QUESTION, "grammar": grammar, "max_tokens": 40}
    assert ask(think_server, body)["choices"][0]["message"] == {"role": "assistant",
                                                                "content": "Plan it.</think>\n\nDone"}
    split = {**body, "reasoning_format": "auto"}
    want = {"role": "assistant", "content": "Done", "reasoning_content": "Plan it."}
    assert ask(think_server, split)["choices"][0]["message"] == want
    assert ask_streamed(think_server, split) == ("Plan it.", "Done", [], "stop")
    off = {**split, "grammar": 'start: "Done"', "chat_template_kwargs": {"enable_thinking": False}}
    assert ask(think_server, off)["choices"][0]["message"] == {"role": "assistant", "content": "Done"}
