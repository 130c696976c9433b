"""The OpenAI wire format: request bodies checked and turned into a `GenSpec`, and the response and
stream-chunk objects built from the batch generator's events. No HTTP here (cflow.serve.app).

Every check raises `BadRequest` with the message, the parameter and an OpenAI error code, which
the server returns as 400 `{"error": {"message", "type": "invalid_request_error", "param", "code"}}`.
Types are checked strictly (a string where a number belongs is an error, not coerced). Fields
other servers honour and this one does not (UNSUPPORTED: suffix, audio, other samplers ...)
are refused with a 400 naming the field whenever
they hold anything but their no-op value, never silently ignored; fields that change nothing
here (user, metadata, store ...) and unknown ones are ignored, as OpenAI's and llama-server's are.

Sampling fields: temperature, top_p, top_k, min_p, repeat_penalty (or repetition_penalty),
repeat_last_n, presence_penalty, frequency_penalty, logit_bias ({"token id": bias}), seed, stop,
max_tokens (or max_completion_tokens, or llama-server's n_predict), ignore_eos (llama-server);
logprobs (completions: an int, the number of alternatives; chat: a bool, with top_logprobs);
n (choices, each decoded in its own slot; with a seed, choice i uses seed + i). Absent fields
take the server's defaults (`cflow serve --temp ...`).

echo (completions only, as OpenAI's legacy endpoint, vLLM and llama-server): the answer's text
starts with the prompt, and with `logprobs` its logprobs start with the prompt's tokens, the
first one's logprob and top_logprobs null (nothing predicts it); `max_tokens: 0` then scores the
prompt alone. This is how loglikelihood evaluations (lm-eval's local-completions model) score
text: prompt = context + continuation, sum the continuation's token_logprobs.

Reasoning (chat): an assistant message's `reasoning_content` is read (its thoughts, for templates
that show them), `reasoning_effort` ("low", "medium", "high") reaches the chat template, and a
reasoning model's answer carries `reasoning_content` beside `content` (cflow.reasoning), unless
`reasoning_format` (llama-server's; the server's --reasoning-format by default) is "none": the
thoughts then stay in `content` as the model wrote them ("auto" and "deepseek" split them).
`chat_template_kwargs` (llama-server's and vLLM's, e.g. {"enable_thinking": false} for Qwen3) are
extra variables for the chat template, over the server's --chat-template-kwargs; `reasoning_effort`
wins over a same-named key.

Structured output (cflow.constrain; at most one per request): OpenAI's `response_format`
({"type": "json_object"}, or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}};
llama-server's {"type": "json_object", "schema": ...} too), llama-server's `json_schema` (a schema)
and `grammar` (GBNF, or Lark), and `regex`; vLLM's `guided_json`, `guided_regex`, `guided_grammar`,
`guided_choice` and `structured_outputs` ({"json" | "regex" | "grammar" | "choice": ...}) are read
as the same. The constraint is compiled against the tokenizer before the request is
queued, so a malformed one is a 400 naming the field and llguidance's reason.

speculative (cflow's own; cflow.serve.speculate): the request's decode rows carry tokens a
proposer guesses, verified in the same call; the answer is what plain decoding gives. "ngram"
(prompt lookup: what its prompt and output suggest), "draft" (the server's --model-draft), "mtp"
(the model's multi-token heads), "off", true/false (true: "ngram"), or llama-server's object
{"n_max": N, "n_min": M} (at most N, at least M proposed tokens per step, with the server's
proposer, the n-gram lookup when it has none), also spelled as llama-server's flat keys
"speculative.n_max" / "speculative.n_min". Absent: the server's default (`cflow serve --spec
ngram|draft|mtp|off`, whose --draft-max, --draft-min and --spec-ngram-min/max a named or object
request starts from). A request with a structured-output constraint never speculates.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

from cflow.sampling import SamplingError, SamplingParams

MAX_STOP = 16             # stop strings per request
MAX_STOP_CHARS = 128      # characters per stop string (the stop matcher's cost per token grows with it)
MAX_LOGPROBS = 20         # alternatives per token
MAX_N = 128               # choices per request (OpenAI's limit); each takes a slot or a place in the queue
MAX_BIAS = 100.0          # |logit_bias| (OpenAI's range; -100 bans a token, +100 forces it)
MAX_PENALTY = 2.0         # |presence_penalty|, |frequency_penalty| (OpenAI's range)
ROLES = ("system", "developer", "user", "assistant", "tool")

# Fields that OpenAI or llama-server honour and this server does not: name -> (the values that
# change nothing, what to say). Any other value is refused with 400 naming the field.
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": (("",), "insertion (a suffix after the completion) is not supported"),
    "modalities": ((["text"],), "only text output is supported"),
    "audio": ((), "audio output is not supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "web_search_options": ((), "web search is not supported"),
    # llama-server's extra samplers
    "mirostat": ((0,), "mirostat sampling is not supported"),
    "typical_p": ((1,), "typical sampling is not supported"),
    "tfs_z": ((1,), "tail-free sampling is not supported"),
    "top_n_sigma": ((-1,), "top-n-sigma sampling is not supported"),
    "dynatemp_range": ((0,), "dynamic temperature is not supported"),
    "dry_multiplier": ((0,), "DRY sampling is not supported"),
    "xtc_probability": ((0,), "XTC sampling is not supported"),
    "n_probs": ((0,), "use 'logprobs' for token probabilities"),
    "samplers": ((), "a custom sampler order is not supported (the order is llama.cpp's default)"),
}


class BadRequest(Exception):
    """A request the server refuses (400 unless `status` says otherwise)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type_

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class Defaults:
    """What a request gets for the fields it leaves out."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None    # None: until end of text or the end of the slot's context
    speculative: Any = None          # a cflow.runtime.Speculative (None: off)
    reasoning_format: str = "auto"   # chat: "auto" (thoughts in reasoning_content) | "none" (left in content)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)   # chat: extra template variables


@dataclass
class GenSpec:
    """A checked generation request."""

    kind: str                               # "completion" | "chat"
    params: SamplingParams
    n: int                                  # choices
    max_tokens: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    logprobs: int | None                    # None: off; n: the chosen token's logprob and n alternatives
    prompt: str | list[int] | None = None   # completions
    messages: list[dict[str, Any]] | None = None   # chat, normalized to {"role", "content": str}
    model: str | None = None
    echo: bool = False                      # completions: the prompt (and its logprobs) before the answer
    constraint: Any = None                  # a cflow.constrain.ConstraintSpec (None: free text)
    constraint_param: str | None = None     # the request field it came from (for errors)
    tools: Any = None                       # chat: a cflow.serve.tools.ToolRequest (None: no tools)
    tool_format: str | None = None          # chat: the model's tool-call format (set by the server)
    reasoning_effort: str | None = None     # chat: "low" | "medium" | "high", for templates that read it (gpt-oss)
    think: bool | None = None               # chat: <think> tags parsed (None: not), True: the prompt opened one (set by the server)
    reasoning_format: str = "auto"          # chat: "auto" | "none" (the thoughts stay in the content)
    template_kwargs: dict[str, Any] = field(default_factory=dict)   # chat: extra chat-template variables
    speculative: Any = None                 # a cflow.runtime.Speculative, "draft", "mtp" or None: plain decoding

    @property
    def thoughts_in_content(self) -> bool:
        """Whether the answer's reasoning stays in its content (reasoning_format "none") instead of
        going to reasoning_content."""
        return self.reasoning_format == "none"


# ---- typed field access ------------------------------------------------------------------------
_MISSING = object()


def _field(body: dict[str, Any], name: str, kind: str, default: Any = None) -> Any:
    """body[name] checked to be of `kind` (int, number, bool, str, object, array); null or absent: default."""
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    ok = {"int": isinstance(v, int) and not isinstance(v, bool),
          "number": isinstance(v, (int, float)) and not isinstance(v, bool),
          "bool": isinstance(v, bool),
          "str": isinstance(v, str),
          "object": isinstance(v, dict),
          "array": isinstance(v, list)}[kind]
    if not ok:
        want = {"int": "an integer", "number": "a number", "bool": "a boolean", "str": "a string",
                "object": "an object", "array": "an array"}[kind]
        raise BadRequest(f"'{name}' must be {want}, got {_json_type(v)}", name, "invalid_type")
    if kind == "number" and not math.isfinite(v):
        raise BadRequest(f"'{name}' must be a finite number", name, "invalid_value")
    return v


def _json_type(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(v), type(v).__name__)


def _range(name: str, v: Any, lo: float | None = None, hi: float | None = None) -> None:
    if v is None:
        return
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        span = f"between {lo} and {hi}" if lo is not None and hi is not None else (
            f">= {lo}" if lo is not None else f"<= {hi}")
        raise BadRequest(f"'{name}' must be {span}, got {v}", name, "invalid_value")


# ---- the fields both endpoints share ---------------------------------------------------------
def _common(body: dict[str, Any], defaults: Defaults, names: Sequence[str], kind: str,
            vocab_size: int | None) -> dict[str, Any]:
    """`names`: the served id (what /v1/models lists) first, then the other names a request may use."""
    model = _field(body, "model", "str")
    if model is not None and names and model not in names:
        raise BadRequest(f"the model '{model}' does not exist here; this server serves '{names[0]}' "
                         f"(GET /v1/models)", "model", "model_not_found")
    for name, (noops, why) in UNSUPPORTED.items():
        v = body.get(name)
        if v is not None and not any(_same(v, ok) for ok in noops):
            raise BadRequest(f"'{name}' is not supported by this server: {why}", name, "unsupported_parameter")
    n = _field(body, "n", "int", 1)
    _range("n", n, 1, MAX_N)
    best_of = _field(body, "best_of", "int")
    if best_of is not None and best_of != n:
        raise BadRequest(f"'best_of' is not supported by this server (only best_of = n, here {n}, which returns "
                         f"every choice)", "best_of", "unsupported_parameter")

    # max_tokens and its other names
    mt: Any = _MISSING
    for name in ("max_tokens", "max_completion_tokens", "n_predict"):
        v = _field(body, name, "int", _MISSING)
        if v is not _MISSING:
            if name == "n_predict" and v == -1:
                v = None
            else:
                _range(name, v, 0)
            mt = v
            break
    max_tokens = defaults.max_tokens if mt is _MISSING else mt

    # sampling: each value checked by SamplingParams, so the message names the field
    sampling: dict[str, Any] = {}
    for name, kind_ in (("temperature", "number"), ("top_p", "number"), ("top_k", "int"), ("min_p", "number"),
                        ("repeat_last_n", "int"), ("presence_penalty", "number"), ("frequency_penalty", "number")):
        v = _field(body, name, kind_)
        if v is not None:
            sampling[name] = v
    for name in ("presence_penalty", "frequency_penalty"):
        _range(name, sampling.get(name), -MAX_PENALTY, MAX_PENALTY)
    bias = _logit_bias(body, vocab_size)
    if bias is not None:
        sampling["logit_bias"] = bias
    rp = _field(body, "repeat_penalty", "number")
    rp2 = _field(body, "repetition_penalty", "number")
    if rp is not None or rp2 is not None:
        sampling["repeat_penalty"] = rp if rp is not None else rp2
    seed = _field(body, "seed", "int")
    if seed is not None:
        _range("seed", seed, -1, 2**64 - 1)
        sampling["seed"] = None if seed == -1 else seed
    for name, v in sampling.items():
        try:
            SamplingParams(**{name: v})
        except SamplingError as e:
            param = "repeat_penalty" if name == "repeat_penalty" and rp is not None else (
                "repetition_penalty" if name == "repeat_penalty" else name)
            raise BadRequest(str(e), param, "invalid_value") from None
    base = {f.name: getattr(defaults.sampling, f.name) for f in fields(SamplingParams)}
    params = SamplingParams(**{**base, **sampling})  # seed -1 in the request: None, a fresh one

    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP:
            raise BadRequest(f"at most {MAX_STOP} stop strings, got {len(stop)}", "stop", "invalid_value")
        stops = list(stop)
    else:
        raise BadRequest("'stop' must be a string or an array of strings", "stop", "invalid_type")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise BadRequest(f"a stop string may have at most {MAX_STOP_CHARS} characters", "stop", "invalid_value")

    stream = _field(body, "stream", "bool", False)
    so = _field(body, "stream_options", "object", {})
    include_usage = _field(so, "include_usage", "bool", False) if so else False
    if include_usage and not stream:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", "stream_options",
                         "invalid_value")

    if kind == "chat":
        if _field(body, "logprobs", "bool", False):
            tl = _field(body, "top_logprobs", "int", 0)
            _range("top_logprobs", tl, 0, MAX_LOGPROBS)
            logprobs = tl
        else:
            if _field(body, "top_logprobs", "int") is not None:
                raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
            logprobs = None
    else:
        logprobs = _field(body, "logprobs", "int")
        _range("logprobs", logprobs, 0, MAX_LOGPROBS)

    constraint, constraint_param = _constraint(body)
    return dict(params=params, n=n, max_tokens=max_tokens, stop=stops, stream=stream, include_usage=include_usage,
                ignore_eos=_field(body, "ignore_eos", "bool", False), logprobs=logprobs, model=model,
                constraint=constraint, constraint_param=constraint_param,
                speculative=_speculative(body, defaults.speculative))


# ---- speculative decoding ------------------------------------------------------------------------
SPEC_KEYS = ("n_max", "n_min")
MAX_DRAFT = 64            # speculative.n_max at most: proposals ride in the call's rows (the backend's max_rows)


def _speculative(body: dict[str, Any], default: Any) -> Any:
    """The request's speculative settings or None (off): "ngram", "draft", "mtp", "off", a boolean,
    or {"n_max": N, "n_min": M}; absent or null: the server's default. A cflow.runtime.Speculative,
    or the name "draft" / "mtp" when the default is not that proposer (the generator resolves it
    and answers for what the server lacks: cflow.serve.speculate.Speculation)."""
    import dataclasses

    from cflow.runtime.speculative import Speculative, SpeculativeError

    v = body.get("speculative")
    flat = {k.split(".", 1)[1]: x for k, x in body.items() if k.startswith("speculative.")}
    if flat:  # llama-server's spelling: "speculative.n_max": N at the top level of the body
        if v is not None:
            raise BadRequest("give 'speculative' or llama-server's flat keys ('speculative.n_max', "
                             "'speculative.n_min'), not both", "speculative", "invalid_value")
        v = flat
    if v is None:
        return default
    base = default if default is not None else Speculative("ngram")
    if v is False or v == "off":
        return None
    if v is True:
        v = "ngram"
    if v in ("ngram", "draft", "mtp"):
        if default is not None and default.proposer == v:
            return default
        return Speculative("ngram") if v == "ngram" else v
    if isinstance(v, str):
        raise BadRequest(f"'speculative' must be \"ngram\", \"draft\", \"mtp\", \"off\", a boolean or "
                         f"{{\"n_max\": N, \"n_min\": M}}, got {v!r}"[:300], "speculative", "invalid_value")
    if not isinstance(v, dict):
        raise BadRequest(f"'speculative' must be \"ngram\", \"draft\", \"mtp\", \"off\", a boolean or "
                         f"{{\"n_max\": N, \"n_min\": M}}, got {_json_type(v)}", "speculative", "invalid_type")
    extra = [k for k in v if k not in SPEC_KEYS]
    if extra:
        raise BadRequest(f"'speculative' takes the keys {', '.join(SPEC_KEYS)}; got {extra[0]!r}"[:300], "speculative",
                         "invalid_value")
    change = {}
    for key, field_ in (("n_max", "draft_max"), ("n_min", "draft_min")):
        x = v.get(key)
        if x is None:
            continue
        if isinstance(x, bool) or not isinstance(x, int):
            raise BadRequest(f"'speculative.{key}' must be an integer, got {_json_type(x)}", "speculative",
                             "invalid_type")
        low = 1 if key == "n_max" else 0
        if not low <= x <= MAX_DRAFT:
            raise BadRequest(f"'speculative.{key}' must be between {low} and {MAX_DRAFT}, got {x}", "speculative",
                             "invalid_value")
        change[field_] = x
    try:
        return dataclasses.replace(base, **change)
    except SpeculativeError as e:
        msg = str(e).replace("draft_max", "n_max").replace("draft_min", "n_min")
        raise BadRequest(f"'speculative': {msg}", "speculative", "invalid_value") from None


# ---- structured output ---------------------------------------------------------------------------
_CONSTRAINT_FIELDS = {"json_schema": "json_schema", "guided_json": "json_schema", "grammar": "grammar",
                      "guided_grammar": "grammar", "regex": "regex", "guided_regex": "regex",
                      "guided_choice": "choice"}
_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}


def _constraint(body: dict[str, Any]) -> tuple[Any, str | None]:
    """The request's one constraint (cflow.constrain.ConstraintSpec) and the field that gave it."""
    from cflow.constrain import ConstraintError, ConstraintSpec

    found: list[tuple[str, str, Any]] = []  # (field, kind, source)
    rf = _field(body, "response_format", "object")
    if rf is not None:
        t = rf.get("type")
        if t == "json_object":
            schema = rf.get("schema")
            found.append(("response_format", "json_object", None) if schema is None else
                         ("response_format", "json_schema", schema))
        elif t == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise BadRequest("'response_format' of type json_schema needs a 'json_schema' object "
                                 "({\"name\": ..., \"schema\": {...}})", "response_format", "invalid_value")
            schema = js.get("schema")
            found.append(("response_format", "json_object", None) if schema is None else
                         ("response_format", "json_schema", schema))
        elif t != "text":
            raise BadRequest(f"'response_format.type' must be one of text, json_object, json_schema, got {t!r}"[:300],
                             "response_format", "invalid_value")
    for name, kind in _CONSTRAINT_FIELDS.items():
        v = body.get(name)
        if v is None or v == "" or (kind == "json_schema" and v == {}):
            continue  # llama-server sends these empty when unused
        found.append((name, kind, v))
    so = _field(body, "structured_outputs", "object")  # vLLM's newer form
    for key, v in (so or {}).items():
        if key == "json_object" and v:
            found.append(("structured_outputs", "json_object", None))
        elif key in _STRUCTURED_OUTPUTS and v is not None:
            found.append(("structured_outputs", _STRUCTURED_OUTPUTS[key], v))
        elif key not in ("json_object", "disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                         "whitespace_pattern"):
            raise BadRequest(f"'structured_outputs.{key}' is not supported (json, regex, grammar, choice, "
                             f"json_object are)"[:300], "structured_outputs", "unsupported_parameter")
    if not found:
        return None, None
    if len(found) > 1:
        raise BadRequest(f"give at most one of response_format (json), json_schema, grammar, regex; this request has "
                         f"{', '.join(f for f, _, _ in found)}", found[1][0], "invalid_value")
    name, kind, source = found[0]
    try:
        return ConstraintSpec(kind, source), name
    except ConstraintError as e:
        raise BadRequest(f"'{name}': {e}", name, "invalid_value") from None


def _same(v: Any, ok: Any) -> bool:
    """JSON equality (True is not 1 here, as it is in Python)."""
    return type(v) is type(ok) and v == ok if isinstance(v, bool) or isinstance(ok, bool) else v == ok


def _logit_bias(body: dict[str, Any], vocab_size: int | None) -> dict[int, float] | None:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}."""
    raw = _field(body, "logit_bias", "object")
    if raw is None:
        return None
    out = {}
    for key, v in raw.items():
        if not (key.isascii() and key.isdigit()):
            raise BadRequest(f"'logit_bias' keys must be token ids (decimal integers as strings), got {key!r}"[:300],
                             "logit_bias", "invalid_value")
        tid = int(key)
        if vocab_size is not None and tid >= vocab_size:
            raise BadRequest(f"'logit_bias' names token {tid} but the vocabulary has {vocab_size} tokens "
                             f"(0..{vocab_size - 1})", "logit_bias", "invalid_value")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or abs(v) > MAX_BIAS:
            raise BadRequest(f"'logit_bias' of token {tid} must be a number between -{MAX_BIAS:g} and {MAX_BIAS:g}, "
                             f"got {v!r}"[:300], "logit_bias", "invalid_value")
        out[tid] = float(v)
    return out


def parse_completion(body: Any, defaults: Defaults, names: Sequence[str] = (),
                     vocab_size: int | None = None) -> GenSpec:
    """POST /v1/completions. prompt: a string, an array of token ids, or an array holding one of those.
    `vocab_size` bounds the token ids logit_bias may name (None: unchecked here)."""
    body = _object(body)
    if "prompt" not in body:
        raise BadRequest("'prompt' is required", "prompt", "missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, list):
        if not p:
            raise BadRequest("'prompt' is empty", "prompt", "invalid_value")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise BadRequest("'prompt' must be a string or an array of token ids (several prompts in one request "
                             "are not supported: send one request each)", "prompt", "invalid_type")
    elif not isinstance(p, str):
        raise BadRequest(f"'prompt' must be a string or an array of token ids, got {_json_type(p)}", "prompt",
                         "invalid_type")
    echo = _field(body, "echo", "bool", False)
    return GenSpec("completion", prompt=p, echo=echo, **_common(body, defaults, names, "completion", vocab_size))


REASONING_EFFORTS = ("low", "medium", "high")   # what gpt-oss's template tells the model
# llama-server's --reasoning-format values cflow implements ("deepseek" is what "auto" does here)
REASONING_FORMATS = ("auto", "deepseek", "none")


def reasoning_format(value: Any, param: str = "reasoning_format") -> str:
    """A checked reasoning format, "deepseek" read as "auto"; BadRequest naming `param` otherwise."""
    if value not in REASONING_FORMATS:
        raise BadRequest(f"'{param}' must be one of {', '.join(REASONING_FORMATS)}, got {value!r}"[:300], param,
                         "invalid_value")
    return "auto" if value == "deepseek" else value


def template_kwargs(value: Any, param: str = "chat_template_kwargs") -> dict[str, Any]:
    """Checked extra chat-template variables (cflow.tokenizer.check_template_variables; `tools`
    is the request's own field); BadRequest naming `param` otherwise."""
    from cflow.tokenizer import ChatTemplateError, check_template_variables

    try:
        return check_template_variables(value, reserved=("tools",))
    except ChatTemplateError as e:
        raise BadRequest(f"'{param}': {e}", param, "invalid_type" if not isinstance(value, dict)
                         else "invalid_value") from None


def parse_chat(body: Any, defaults: Defaults, names: Sequence[str] = (),
               vocab_size: int | None = None) -> GenSpec:
    """POST /v1/chat/completions. messages: [{"role", "content": a string or text parts}]."""
    body = _object(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty array of {role, content} objects", "messages",
                         "invalid_type" if "messages" in body else "missing_required_parameter")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object, got {_json_type(m)}", where, "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}"[:300], f"{where}.role",
                             "invalid_value")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _content(m.get("content"), f"{where}.content"), **message_fields(m, where)})
    if _field(body, "echo", "bool", False):
        raise BadRequest("'echo' is only supported on /v1/completions (send the rendered prompt there to score "
                         "it)", "echo", "unsupported_parameter")
    tools = parse_tool_request(body)
    common = _common(body, defaults, names, "chat", vocab_size)
    if tools is not None and tools.choice != "none" and common["constraint"] is not None:
        raise BadRequest(f"'{common['constraint_param']}' cannot be combined with tools (the tool-call format is "
                         f"itself a constraint); send tool_choice 'none' or drop one", common["constraint_param"],
                         "invalid_value")
    effort = _field(body, "reasoning_effort", "str")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise BadRequest(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}"[:300],
                         "reasoning_effort", "invalid_value")
    fmt = body.get("reasoning_format")
    fmt = defaults.reasoning_format if fmt is None else reasoning_format(fmt)
    extra = body.get("chat_template_kwargs")
    extra = {**defaults.chat_template_kwargs, **({} if extra is None else template_kwargs(extra))}
    return GenSpec("chat", messages=out, tools=tools, reasoning_effort=effort, reasoning_format=fmt,
                   template_kwargs=extra, **common)


def parse_tool_request(body: dict[str, Any]) -> Any:
    from cflow.serve.tools import parse_tool_request as parse

    return parse(body)


def message_fields(m: dict[str, Any], where: str) -> dict[str, Any]:
    from cflow.serve.tools import message_fields as fields_

    return fields_(m, where)


def _content(c: Any, where: str) -> str:
    if c is None or isinstance(c, str):
        return c or ""
    if isinstance(c, list):
        parts = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}} (only text "
                                 f"is supported)", f"{where}[{j}]", "invalid_value")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{where} must be a string or an array of text parts, got {_json_type(c)}", where,
                     "invalid_type")


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {_json_type(body)}", None, "invalid_type")
    return body


# ---- the tokenizer routes (vLLM's and llama-server's) ---------------------------------------------
def parse_tokenize(body: Any) -> tuple[str, bool | None]:
    """POST /tokenize: {"prompt": text} (vLLM; llama-server's "content" too), "add_special_tokens"
    (default true: the model's own BOS rule; false: none). Returns (text, add_bos for encode)."""
    body = _object(body)
    name = "prompt" if "prompt" in body or "content" not in body else "content"
    text = _field(body, name, "str")
    if text is None:
        raise BadRequest("'prompt' is required: the text to tokenize", "prompt", "missing_required_parameter")
    special = _field(body, "add_special_tokens", "bool", True)
    return text, (None if special else False)


def parse_detokenize(body: Any, vocab_size: int) -> list[int]:
    """POST /detokenize: {"tokens": [ids]}."""
    body = _object(body)
    ids = _field(body, "tokens", "array")
    if ids is None:
        raise BadRequest("'tokens' is required: the token ids to turn into text", "tokens", "missing_required_parameter")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise BadRequest(f"'tokens' must be token ids in 0..{vocab_size - 1}", "tokens", "invalid_value")
    return ids


# ---- responses ---------------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0, drafted: int = 0,
          accepted: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; with speculation (drafted > 0), the proposed tokens the model kept and
    rejected as completion_tokens_details' accepted/rejected_prediction_tokens."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
    if drafted:
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                            "rejected_prediction_tokens": drafted - accepted}
    return out


class LogprobsBuilder:
    """Collects per-token logprobs and renders them the way each endpoint does."""

    def __init__(self, tokenizer: Any, kind: str) -> None:
        self.tok, self.kind = tokenizer, kind
        self.offset = 0

    def entries(self, pieces: list[Any]) -> Any:
        """The logprobs object for these Piece events (one stream chunk, or the whole answer)."""
        if self.kind == "chat":
            return {"content": [self._chat_entry(p) for p in pieces], "refusal": None}
        tokens, lps, tops, offsets = [], [], [], []
        for p in pieces:
            s = self.tok.token_to_piece(p.token)
            tokens.append(s)
            lps.append(p.logprob)
            # an echoed prompt's first token has no logprob, and no alternatives either (null, as OpenAI's)
            tops.append(None if p.logprob is None else {self.tok.token_to_piece(i): lp for i, lp in (p.top or [])})
            offsets.append(self.offset)
            self.offset += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def _chat_entry(self, p: Any) -> dict[str, Any]:
        def one(i: int, lp: float) -> dict[str, Any]:
            return {"token": self.tok.token_to_piece(i), "logprob": lp, "bytes": list(self.tok.token_to_bytes(i))}

        return {**one(p.token, p.logprob), "top_logprobs": [one(i, lp) for i, lp in (p.top or [])]}


def choice_object(kind: str, index: int, text: str | None, finish: str, logprobs: Any = None,
                  tool_calls: list[dict[str, Any]] | None = None, reasoning: str | None = None) -> dict[str, Any]:
    """One choice of a whole (not streamed) answer; a chat answer with tool calls has them in its
    message (content None when there is no text besides), finish_reason "tool_calls"; the
    model's reasoning, when it gave some, is the message's `reasoning_content` (llama-server's)."""
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning:
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["tool_calls"] = tool_calls
            finish = "tool_calls" if finish == "stop" else finish
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def completion_object(kind: str, rid: str, created: int, model: str, choices: list[dict[str, Any]],
                      usage_: dict[str, Any]) -> dict[str, Any]:
    obj = "chat.completion" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, "usage": usage_}


def chunk_object(kind: str, rid: str, created: int, model: str, text: str | None, finish: str | None,
                 logprobs: Any = None, include_usage: bool = False, role: bool = False,
                 index: int = 0, tool_calls: list[dict[str, Any]] | None = None,
                 first_call: int = 0, reasoning: str | None = None) -> dict[str, Any]:
    """One streamed chunk of choice `index` (text None: no content field, for the chat's final chunk).
    `tool_calls`: whole calls, sent as deltas numbered from `first_call` (OpenAI's streamed
    tool_calls: index, id, type, function {name, arguments}); `reasoning`: the delta's
    `reasoning_content` (llama-server's)."""
    if kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = [{"index": first_call + j, **c} for j, c in enumerate(tool_calls)]
        out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
    else:
        out = {"id": rid, "object": "text_completion", "created": created, "model": model,
               "choices": [{"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}]}
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(kind: str, rid: str, created: int, model: str, usage_: dict[str, Any]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_}


def now() -> int:
    return int(time.time())
