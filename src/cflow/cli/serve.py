"""`cflow serve`: an OpenAI-compatible HTTP server (cflow.serve), llama-server's flag names.

The server listens at once and loads the model in the background (GET /health answers 503
until it is ready); a model that fails to load ends the command with the error, exit status 2.
Needs the serve extra (Starlette + uvicorn): pip install "cflow-lm[serve]".
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
from pathlib import Path
from typing import Any

from cflow.cli.common import (UsageError, add_chat_template_flags, add_command, add_model_flags, add_sampling_flags,
                              add_speculative_flags, check_model_flags, check_sampling, check_speculative,
                              engine_options, load_draft, load_error, log, progress_bar, sampling_kwargs,
                              template_kwargs_from_flags)

HELP = """\
serve the model over HTTP (OpenAI-compatible API)

An OpenAI-compatible server: POST /v1/completions and /v1/chat/completions (streamed as
server-sent events with "stream": true), GET /v1/models, /health (503 while the model loads)
and /metrics (Prometheus). Up to --parallel requests decode together, each in its own slot of
-c / --parallel context tokens; more wait in a queue of --max-queue, and beyond it a request
gets 429 with Retry-After. A request not finished after --timeout seconds (queue wait included)
is cancelled, its slot freed, and its client gets a 504 error (streamed: an error event, then
[DONE]). The sampling flags set the defaults a request's own fields override. A request body
larger than a slot's context could hold (6 x slot tokens x the longest token's bytes, + 64 KiB:
JSON escapes at most 6 characters a byte) gets 413 before it is read; prompts are tokenized off
the event loop, so /health and running streams answer while a long prompt is being read.
Needs the serve extra: pip install "cflow-lm[serve]".

examples:
  cflow serve -m SmolLM2-135M-Instruct.Q4_1.gguf --port 8080 --parallel 4
  cflow serve -m smollm2.cflow -c 8192 -np 8 --api-key secret --host 0.0.0.0
  curl -s localhost:8080/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}'
  cflow serve -m model.gguf --ray --replicas 2 --max-replicas 4 -np 4 -t 2 --port 8000
                                     # Ray Serve: 2..4 replicas behind one port (pip install "cflow-lm[ray]")

Speculative decoding (--spec ngram|draft|mtp, or a request's "speculative": "ngram" | "draft" |
"mtp" | "off" | {"n_max": N, "n_min": M}): each speculating request's decode row carries the
tokens its proposer guesses, verified in the same batched call as the other requests' rows; the
answer is plain decoding's (greedy: token for token). ngram: the lookup of its prompt and output
(fast when the answer repeats the prompt); draft: a smaller model with the same vocabulary
(--model-draft FILE, one slot per --parallel slot, run batched for every drafting request before
the target's call); mtp: the model's own multi-token heads (cflow train --mtp N). /metrics counts
cflow_spec_draft_tokens_total and cflow_spec_accepted_tokens_total.
  cflow serve -m SmolLM2-360M.gguf --model-draft SmolLM2-135M.gguf -np 4   # "speculative": "draft"

Structured output: "response_format" ({"type": "json_object"} or {"type": "json_schema",
"json_schema": {"schema": {...}}}), llama-server's "json_schema" and "grammar" (GBNF), "regex",
vLLM's "guided_json" / "guided_regex" / "guided_grammar" / "guided_choice" / "structured_outputs":
every token fits (llguidance masks), each request under its own constraint; a malformed one gets
400 naming it. Tool calls: "tools" with "tool_choice" auto | none | required | a named function,
"tool" messages in the history; the chat template decides the syntax (Qwen2.5/Hermes <tool_call>,
Qwen3.5's XML <tool_call>, Llama 3.1 JSON, Mistral [TOOL_CALLS] and v11 [TOOL_CALLS]name[ARGS]; any
other template gets llama.cpp's generic JSON format), and
the answer's calls come back as "tool_calls" (streamed as delta.tool_calls). --chat-template-file
serves a model with another template; --chat-template-kwargs (or a request's
"chat_template_kwargs") passes it variables such as {"enable_thinking": false}.

Reasoning models (gpt-oss's harmony channels, Qwen3 / DeepSeek-R1 <think> blocks): the answer's
thoughts come back as the message's "reasoning_content" beside "content" (streamed as
delta.reasoning_content); --reasoning-format none (or a request's "reasoning_format": "none")
leaves them in "content" as the model wrote them. A gpt-oss call forced by tool_choice, or a
JSON schema, may follow the model's analysis message, as llama-server's grammar allows.

Scoring (lm-eval's local-completions): POST /v1/completions with "echo": true, "logprobs": 1,
"max_tokens": 0 returns every prompt token's logprob (the first one null), equal to
Engine.score's; `cflow perplexity` scores a text file as llama-perplexity does.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "serve", HELP)
    add_model_flags(p)
    for action in p._actions:  # -c means the whole KV context here, shared by the slots (llama-server)
        if "-c" in action.option_strings:
            action.help = ("context tokens for all slots together, split evenly between the --parallel slots "
                           "(llama-server's rule); default 0: each slot gets min(the model's max_seq_len, 4096)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for "
                   "every interface)")
    g.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080; 0 = any free port, "
                   "printed at startup)")
    g.add_argument("-np", "--parallel", type=int, default=4, metavar="N",
                   help="sequences decoded together, each in its own KV-cache slot (default 4)")
    g.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="requests that may wait for a slot; beyond them: 429 with Retry-After (default 256)")
    g.add_argument("-b", "--batch-size", type=int, default=64, metavar="N",
                   help="prompt tokens evaluated per scheduler step, between the decode steps of the running "
                   "streams: a long prompt joins in chunks of N (default 64)")
    g.add_argument("--api-key", default=os.environ.get("CFLOW_API_KEY") or None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $CFLOW_API_KEY; "
                   "none: open)")
    g.add_argument("-a", "--alias", default=None, metavar="NAME",
                   help="the model's name in /v1/models and the 'model' field (default: the file's name)")
    g.add_argument("-to", "--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="cancel a request that has not finished this long after it arrived, queue wait included: "
                   "its slot is freed and its client gets a 504 error (default 600; 0 = no limit)")
    g.add_argument("-n", "--n-predict", type=int, default=-1,
                   help="default max_tokens of a request (default -1: until end of text or the slot's context)")
    g.add_argument("--chat-template-file", default=None, metavar="FILE",
                   help="render chats with this Jinja chat template instead of the model file's (llama-server's "
                   "flag): e.g. a template that lists `tools`, whose tool-call syntax (<tool_call> blocks, Llama 3 "
                   "JSON, [TOOL_CALLS]) the server then parses; a template that ignores `tools` gets the generic "
                   "JSON tool calls")
    g.add_argument("--verbose", action="store_true", help="log every request (uvicorn's access log)")
    add_chat_template_flags(g)
    r = p.add_argument_group("scale-out on Ray Serve (pip install \"cflow-lm[ray]\"; cflow.serve.ray)")
    r.add_argument("--ray", action="store_true",
                   help="run --replicas copies of this server (each its own model, --parallel slots and -t threads) "
                   "as Ray Serve replicas behind Ray Serve's HTTP proxy on --host:--port, which spreads requests "
                   "over them and replaces a replica that dies or fails its health check")
    r.add_argument("--replicas", type=int, default=1, metavar="N", help="replicas to start with (default 1)")
    r.add_argument("--max-replicas", type=int, default=None, metavar="M",
                   help="autoscale between --replicas and M on queue depth: Ray Serve adds a replica while each has "
                   "more requests than --parallel slots (running + queued), and removes one when they idle "
                   "(default: a fixed --replicas)")
    r.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (e.g. auto, or ray://head:10001) instead of starting a local one "
                   "(default: $RAY_ADDRESS, else a local cluster)")
    add_sampling_flags(p)
    add_speculative_flags(p)
    for action in p._actions:  # the server's meaning: a default that each request may override
        if "--spec" in action.option_strings:
            action.help = ("the default of every request (its 'speculative' field overrides it): off (default, or "
                           "draft with --model-draft): plain decoding; ngram: each request's decode row carries the "
                           "continuation of the latest earlier match of its last tokens in its prompt and output; "
                           "draft: the --model-draft model's guesses; mtp: the model's multi-token heads; all "
                           "verified in the same batched call")
        elif "--model-draft" in action.option_strings:
            action.help = ("a smaller model with the same vocabulary to speculate with (requests' \"speculative\": "
                           "\"draft\"; the default with no --spec): one KV slot per --parallel slot")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    check_model_flags(args)
    if args.parallel < 1:
        raise UsageError(f"must be >= 1, got {args.parallel}", flag="--parallel")
    if args.ctx_size and args.ctx_size // args.parallel < 2:
        raise UsageError(f"-c {args.ctx_size} leaves {args.ctx_size // args.parallel} tokens per slot with "
                         f"--parallel {args.parallel}; give at least 2 per slot", flag="-c")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"must be in 0..65535, got {args.port}", flag="--port")
    if args.max_queue < 0:
        raise UsageError(f"must be >= 0, got {args.max_queue}", flag="--max-queue")
    if args.batch_size < 1:
        raise UsageError(f"must be >= 1, got {args.batch_size}", flag="-b")
    if not (args.timeout >= 0 and math.isfinite(args.timeout)):
        raise UsageError(f"must be a number of seconds >= 0 (0 = no limit), got {args.timeout}", flag="--timeout")
    if args.chat_template_file is not None:
        args.chat_template = read_chat_template(args.chat_template_file)
    args.template_kwargs = template_kwargs_from_flags(args, reserved=("tools",))
    args.speculative = check_speculative(args)
    if args.model_draft is not None and not os.path.exists(args.model_draft):  # fail before listening
        raise UsageError(f"draft model file {args.model_draft} does not exist; give a .cflow/.vflow or .gguf file",
                         flag="--model-draft")
    if args.replicas < 1:
        raise UsageError(f"must be >= 1, got {args.replicas}", flag="--replicas")
    if args.max_replicas is not None and args.max_replicas < args.replicas:
        raise UsageError(f"must be >= --replicas ({args.replicas}), got {args.max_replicas}", flag="--max-replicas")
    if (args.replicas > 1 or args.max_replicas is not None or args.ray_address) and not args.ray:
        raise UsageError("--replicas, --max-replicas and --ray-address need --ray", flag="--ray")
    if args.ray and args.port == 0:
        raise UsageError("--ray needs a fixed port (Ray Serve's proxy listens on it)", flag="--port")
    if args.model is not None and not os.path.exists(args.model):  # fail before listening
        raise UsageError(f"model file {args.model} does not exist; give a .cflow/.vflow or .gguf file", flag="-m")


def read_chat_template(path: str) -> str:
    """The text of a --chat-template-file, checked to compile (UsageError naming the flag)."""
    from cflow.tokenizer import ChatTemplateError, _compile_template

    try:
        text = Path(path).read_text(encoding="utf-8")
        _compile_template(text)
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}", flag="--chat-template-file") \
            from None
    except ChatTemplateError as e:
        raise UsageError(f"{path}: {e}", flag="--chat-template-file") from None
    return text


def _listen(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise UsageError(f"cannot listen on {host}: {e.strerror or e}", flag="--host") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}", flag="--port") from None
    sock.set_inheritable(True)
    return sock


def model_name(args: argparse.Namespace) -> tuple[str, tuple[str, ...]]:
    """The served name and the other names a request's 'model' may use (the path, the file name)."""
    from cflow.runtime import DEFAULT_MODEL

    path = args.model or str(DEFAULT_MODEL)
    base = os.path.basename(path)
    stem = base.rsplit(".", 1)[0] if "." in base else base
    name = args.alias or base
    return name, tuple(n for n in {path, base, stem, name} if n)


def load_generator(args: argparse.Namespace) -> Any:
    """The BatchGenerator the flags ask for (the model loaded, its slots made). A module-level
    function of a plain Namespace, so a Ray replica can be handed it (functools.partial) and
    load the same server in its own process."""
    from cflow.runtime import EngineError
    from cflow.serve.backend import load_backend
    from cflow.serve.batch import BatchGenerator

    per_slot = args.ctx_size // args.parallel if args.ctx_size else None
    try:
        options = engine_options(args, n_ctx=per_slot)  # -c is every slot's context together
        with progress_bar() as progress:
            backend = load_backend(args.model, n_slots=args.parallel, options=options, progress=progress, log=log)
    except EngineError as e:
        if getattr(e, "flag", None) == "-c" and per_slot:
            raise EngineError(f"{e} (cflow serve's -c is the context of all {args.parallel} slots together: "
                              f"{per_slot} tokens per slot here)", flag="-c") from None
        raise
    except OSError as e:
        raise load_error(args.model, e) from None
    template = getattr(args, "chat_template", None)
    if template is not None:  # every tokenizer the backend renders chats with
        engines = list(getattr(backend, "engines", ())) + [getattr(backend, "engine", None)]
        for tok in {id(t): t for t in [backend.tokenizer] + [e.tokenizer for e in engines if e is not None]}.values():
            tok.chat_template = template
    draft = None
    try:
        if getattr(args, "model_draft", None):
            draft = _load_draft(args, backend)
        gen = BatchGenerator(backend, prefill_chunk=args.batch_size, max_queue=args.max_queue,
                             timeout=args.timeout or None, draft=draft)
    except BaseException:
        backend.close()
        if draft is not None:
            draft.close()
        raise
    try:  # the default speculation must run here (e.g. --spec mtp on a model without heads): say so now
        gen.speculation.resolve(getattr(args, "speculative", None))
    except BaseException:
        gen.close()
        raise
    return gen


def _load_draft(args: argparse.Namespace, backend: Any) -> Any:
    """The --model-draft model, one slot per target slot, with the target's context per slot (or
    the draft's own default when it allows less)."""
    from cflow.serve.backend import load_backend

    return load_draft(args, args.model_draft, backend.n_ctx,
                      lambda path, options, **kw: load_backend(path, n_slots=args.parallel, options=options, **kw))


def app_options(args: argparse.Namespace) -> dict[str, Any]:
    """create_app's keyword arguments the flags set: the model's names, the API key, the defaults."""
    from cflow.sampling import SamplingParams
    from cflow.serve.protocol import Defaults, reasoning_format

    name, aliases = model_name(args)
    defaults = Defaults(SamplingParams(**sampling_kwargs(args)), None if args.n_predict < 0 else args.n_predict,
                        speculative=getattr(args, "speculative", None),
                        reasoning_format=reasoning_format(args.reasoning_format, "--reasoning-format"),
                        chat_template_kwargs=getattr(args, "template_kwargs", {}))
    return dict(model_name=name, aliases=aliases, api_key=args.api_key, defaults=defaults)


def _run_ray(args: argparse.Namespace) -> int:
    import functools

    try:
        from ray import serve  # noqa: F401
    except ImportError as e:
        raise UsageError(f"--ray needs Ray Serve ({e.name or e} is missing): pip install \"cflow-lm[ray]\"",
                         flag="--ray") from None
    from cflow.serve.ray import serve_forever

    if args.model is not None:  # the replicas may start in other folders
        args.model = os.path.abspath(args.model)
    serve_forever(functools.partial(load_generator, args), host=args.host, port=args.port, slots=args.parallel,
                  replicas=args.replicas, max_replicas=args.max_replicas, options=app_options(args),
                  address=args.ray_address, log=log)
    return 0


def run(args: argparse.Namespace) -> int:
    kw = sampling_kwargs(args)
    _check(args)
    check_sampling(kw)
    try:
        import uvicorn

        from cflow.serve.app import create_app
    except ImportError as e:
        raise UsageError(f"cflow serve needs the serve extra ({e.name or e} is missing): "
                         f"pip install \"cflow-lm[serve]\"") from None
    if args.ray:
        return _run_ray(args)
    from cflow.serve.batch import BatchGenerator

    def load() -> BatchGenerator:
        return load_generator(args)

    failure: list[BaseException] = []
    server: Any = None

    def on_ready(gen: BatchGenerator) -> None:
        b = gen.backend
        log(f"ready: {b.path}, {gen.n_slots} slot(s) x {gen.n_ctx} tokens, {b.threads} threads"
            f"{'' if not args.api_key else ', API key required'}")

    def on_load_error(e: BaseException) -> None:
        failure.append(e)
        if server is not None:
            server.should_exit = True

    opts = app_options(args)
    name = opts["model_name"]
    app = create_app(load, on_ready=on_ready, on_load_error=on_load_error, **opts)
    sock = _listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    log(f"listening on http://{shown}:{port} (model {name}: loading)")
    sys.stderr.flush()
    config = uvicorn.Config(app, log_level="info" if args.verbose else "warning", access_log=args.verbose,
                            timeout_graceful_shutdown=3, lifespan="on")
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if failure:
        raise failure[0]
    return 0
