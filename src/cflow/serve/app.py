"""The HTTP layer of `cflow serve`: an ASGI app (Starlette) over a BatchGenerator.

Why Starlette + uvicorn: it is the stack the Python OpenAI-compatible servers are built on (vLLM,
SGLang and llama-cpp-python's server use FastAPI, which is Starlette plus pydantic), so its
streaming, keep-alive and HTTP parsing are well exercised; uvicorn (h11, or httptools when
installed) parses HTTP, limits headers and answers malformed requests with 400 before they
reach us. ASGI gives a handler the raw `receive` channel, so a client that disconnects is seen
at once, mid-stream or while a non-streamed answer is being generated, and its sequence is
cancelled. We use Starlette without FastAPI: requests are checked by cflow.serve.protocol (strict
types, OpenAI-shaped 400s; pydantic would answer 422 and coerce "1" to 1), and the extra stays
two small pure-Python packages. aiohttp would do as well, but brings its own HTTP stack and
client, and is rarer among these servers.

Concurrency: one event loop handles every connection; the model runs in the generator's worker
thread; events come back through a Mailbox (cflow.serve.call: one loop wake-up per burst of
events) to each request's Call, which renders its answer. Work that grows with a request's size
runs off the loop: large bodies are parsed and every prompt is tokenized in a worker thread (the
tokenizer releases the GIL), so a long prompt does not hold up /health or other streams. A body
larger than any slot's context could use (body_limit: n_ctx tokens of the longest token, each
byte JSON-escaped, plus 64 KiB) is refused with 413 before it is read.

Routes (each also without the /v1 prefix, as llama-server):
    POST /v1/completions, POST /v1/chat/completions    (stream: true -> server-sent events, then [DONE])
    GET  /v1/models, GET /health (503 while loading), GET /metrics (Prometheus text)
    POST /tokenize, POST /detokenize, GET /tokenizer_info   (vLLM's shapes; /tokenize also takes
         llama-server's "content"): the model's tokenizer over HTTP, so a client such as lm-eval
         (tokenizer_backend "remote", which it picks by itself when these answer) needs no local copy
With an API key every route but /health needs `Authorization: Bearer KEY` (401 otherwise).
A server given a `replica` name (one replica of several behind a proxy: cflow.serve.ray) says it
in an `x-cflow-replica` header on every response and in /health, so a client or a test can see
which replica answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import os
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from cflow.constrain import ConstraintError, compile_constraint
from cflow.errors import CflowError
from cflow.reasoning import prompt_opens_thought, prompt_tail, thinks_in_tags
from cflow.runtime.errors import ContextOverflowError
from cflow.runtime.mtp import NoMtpHeadsError
from cflow.runtime.speculative import SpeculativeError
from cflow.serve import protocol as P
from cflow.serve import tools as tools_mod
from cflow.serve.batch import BatchGenerator, GeneratorClosedError, QueueFullError
from cflow.serve.call import Call, ClientGone, JSONResponse, Mailbox, nothing
from cflow.serve.metrics import Metrics

JSON_ESCAPE = 6                # a byte of text is at most 6 characters of JSON (\u00XX)
BODY_SLACK = 64 * 1024         # the request's other fields
JSON_OFF_LOOP = 64 * 1024      # bodies at least this large are parsed in a worker thread


def body_limit(n_ctx: int, max_token_bytes: int) -> int:
    """The largest request body worth reading: a slot's whole context of the longest token's bytes,
    every byte escaped, plus the other fields. A larger body cannot fit any slot, so it is refused
    with 413 before it is read or tokenized."""
    return JSON_ESCAPE * n_ctx * max_token_bytes + BODY_SLACK
PUBLIC = ("/health", "/v1/health")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


BULK_WORKERS = 2  # threads that parse and tokenize requests; more requests queue for them
BULK_NICE = 10  # how far below the event loop and the decode threads they run


def _bulk_thread_init() -> None:
    """Work proportional to a request's size (parsing, tokenizing) runs at a lower priority, so
    that it cannot take the cores from the event loop and the decode threads: on 2 cores, three
    1.5 MB prompts tokenized beside a decode held /health back ~0.3 s at normal priority. Linux
    sets the priority of one thread by its id; elsewhere the thread keeps the process's."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BULK_NICE)


class Server:
    """The app's state: the generator (None while loading), metrics, settings. `app` is the ASGI app."""

    def __init__(self, load: Callable[[], BatchGenerator], *, model_name: str, aliases: tuple[str, ...] = (),
                 api_key: str | None = None, defaults: P.Defaults | None = None,
                 on_ready: Callable[[BatchGenerator], None] | None = None,
                 on_load_error: Callable[[BaseException], None] | None = None, replica: str | None = None) -> None:
        self._load = load
        self.replica = replica
        self.model_name = model_name
        self.names = (model_name, *sorted(set(aliases) - {model_name}))  # the served id first
        self.api_key = api_key.encode("utf-8") if api_key else None
        self.defaults = defaults or P.Defaults()
        self.metrics = Metrics()
        self.gen: BatchGenerator | None = None
        self.max_body = BODY_SLACK  # set from the model's context when it has loaded (body_limit)
        self.load_error: BaseException | None = None
        self._on_ready, self._on_load_error = on_ready, on_load_error
        self._loader: threading.Thread | None = None
        self._closed = False
        self._mailbox: Mailbox | None = None
        self._tool_format: str | None = None  # the model's tool-call format (cflow.serve.tools), read once
        self.created = int(time.time())
        self._bulk = ThreadPoolExecutor(BULK_WORKERS, thread_name_prefix="cflow-bulk", initializer=_bulk_thread_init)
        routes = []
        for prefix in ("/v1", ""):
            routes += [Route(f"{prefix}/completions", self.completions, methods=["POST"]),
                       Route(f"{prefix}/chat/completions", self.chat_completions, methods=["POST"]),
                       Route(f"{prefix}/models", self.models, methods=["GET"]),
                       Route(f"{prefix}/health", self.health, methods=["GET"]),
                       Route(f"{prefix}/tokenize", self.tokenize, methods=["POST"]),
                       Route(f"{prefix}/detokenize", self.detokenize, methods=["POST"]),
                       Route(f"{prefix}/tokenizer_info", self.tokenizer_info, methods=["GET"])]
        routes.append(Route("/metrics", self.metrics_text, methods=["GET"]))
        inner = Starlette(routes=routes, lifespan=self._lifespan,
                          exception_handlers={HTTPException: self._http_error, Exception: self._server_error})
        self.app = _Guard(inner, self)

    # ---- lifecycle -----------------------------------------------------------------------------
    def start_loading(self) -> None:
        """Load the model in a background thread (GET /health answers 503 until it is ready)."""
        if self._loader is None:
            self._loader = threading.Thread(target=self._load_model, name="cflow-load", daemon=True)
            self._loader.start()

    def _load_model(self) -> None:
        try:
            gen = self._load()
        except BaseException as e:  # reported by /health and the on_load_error callback
            self.load_error = e
            if self._on_load_error:
                self._on_load_error(e)
            return
        if self._closed:
            gen.close()
            return
        gen.metrics = self.metrics
        self.max_body = body_limit(gen.n_ctx, gen.backend.tokenizer.max_token_bytes)
        self.gen = gen
        if self._on_ready:
            self._on_ready(gen)

    def load_now(self) -> BatchGenerator:
        """Load the model in this thread's time (start_loading, then wait for it); raise its error."""
        self.start_loading()
        assert self._loader is not None
        self._loader.join()
        if self.gen is None:
            raise self.load_error or RuntimeError("the server was closed while the model loaded")
        return self.gen

    def healthy(self) -> str | None:
        """Why this server cannot answer generation requests (None: it can): loading, failed, or its
        generator's worker has stopped."""
        if self.load_error is not None:
            return f"the model failed to load: {self.load_error}"
        if self.gen is None:
            return "the model is loading" if not self._closed else "the server is closed"
        if not self.gen.alive:
            return "the batch generator's worker thread has stopped"
        return None

    def close(self) -> None:
        """Stop the generator (running and queued requests end); a load still running is dropped."""
        self._closed = True
        self._bulk.shutdown(wait=False, cancel_futures=True)
        if self.gen is not None:
            self.gen.close()
            self.gen = None

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Any):
        self.start_loading()
        try:
            yield
        finally:
            await asyncio.to_thread(self.close)

    # ---- plain routes --------------------------------------------------------------------------
    def _unavailable(self) -> Response:
        msg = "Loading model" if self.load_error is None else f"the model failed to load: {self.load_error}"
        return JSONResponse({"error": {"code": 503, "message": msg, "type": "unavailable_error"}}, 503)

    async def health(self, request: Request) -> Response:
        if self.gen is None:
            return self._unavailable()
        g = self.gen
        body = {"status": "ok", "slots_idle": g.n_slots - g.running, "slots_processing": g.running,
                "queue": g.queue_depth}
        if self.replica is not None:
            body["replica"] = self.replica
        return JSONResponse(body)

    def _ready(self) -> BatchGenerator:
        if self.gen is None:
            raise P.BadRequest("the model is still loading; retry shortly" if self.load_error is None else
                               f"the model failed to load: {self.load_error}", None, "model_loading",
                               status=503, type_="unavailable_error")
        return self.gen

    async def tokenize(self, request: Request) -> Response:
        try:
            gen = self._ready()
            text, add_bos = P.parse_tokenize(await self._read_json(request))
            try:
                ids = await self._off_loop(gen.backend.encode, text, add_bos)
            except Exception as e:  # the tokenizer refusing the text (e.g. unpaired surrogates)
                raise P.BadRequest(f"cannot tokenize the prompt: {type(e).__name__}: {str(e)[:200]}", "prompt",
                                   "invalid_value") from None
        except P.BadRequest as e:
            return self._error(e)
        except ClientGone:
            return nothing
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": gen.n_ctx})

    async def detokenize(self, request: Request) -> Response:
        try:
            gen = self._ready()
            ids = P.parse_detokenize(await self._read_json(request), gen.backend.vocab_size)
            text = await self._off_loop(gen.backend.tokenizer.decode, ids)
        except P.BadRequest as e:
            return self._error(e)
        except ClientGone:
            return nothing
        return JSONResponse({"prompt": text, "content": text})

    async def tokenizer_info(self, request: Request) -> Response:
        """vLLM's /tokenizer_info: the special tokens and the chat template (lm-eval's remote
        tokenizer reads eos_token and bos_token here, and renders chat_template itself)."""
        if self.gen is None:
            return self._unavailable()
        tok = self.gen.backend.tokenizer

        def piece(i: int | None) -> str | None:
            return None if i is None else tok.token_to_piece(i)

        return JSONResponse({"tokenizer_class": "cflow", "eos_token": piece(tok.eos_id), "bos_token": piece(tok.bos_id),
                             "pad_token": None, "add_bos_token": bool(tok.add_bos), "chat_template": tok.chat_template,
                             "model_max_length": self.gen.n_ctx, "vocab_size": tok.vocab_size})

    async def models(self, request: Request) -> Response:
        if self.gen is None:
            return self._unavailable()
        b = self.gen.backend
        meta = {"n_ctx_slot": self.gen.n_ctx, "n_slots": self.gen.n_slots, "n_vocab": b.vocab_size}
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                         "created": self.created, "owned_by": "cflow",
                                                         "meta": meta}]})

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(self.gen, loading=self.gen is None and self.load_error is None),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- errors --------------------------------------------------------------------------------
    def _error(self, e: P.BadRequest, headers: dict[str, str] | None = None) -> Response:
        if e.status == 400:
            self.metrics.rejected("bad_request")
        return JSONResponse(e.body(), e.status, headers=headers)

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = exc.status_code
        kind = "not_found_error" if code == 404 else "invalid_request_error"
        return JSONResponse(P.error_body(f"{request.method} {request.url.path}: {exc.detail}", kind, None, code),
                            code, headers=getattr(exc, "headers", None))

    async def _server_error(self, request: Request, exc: Exception) -> Response:
        traceback.print_exception(exc, file=sys.stderr)
        return JSONResponse(P.error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error", None, 500),
                            500)

    # ---- generation ----------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _generate(self, request: Request, kind: str) -> Any:
        endpoint = "chat_completions" if kind == "chat" else "completions"
        try:
            gen = self._ready()
            body = await self._read_json(request)
            parse = P.parse_chat if kind == "chat" else P.parse_completion
            spec = parse(body, self.defaults, self.names, gen.backend.vocab_size)
            ids = await self._tokens(gen, spec)
            constraint = await self._constraint(gen, spec)
            loop = asyncio.get_running_loop()
            if self._mailbox is None or self._mailbox.loop is not loop:
                self._mailbox = Mailbox(loop)
            call = Call(self, gen.backend.tokenizer, spec, endpoint, len(ids), self._mailbox)
            try:
                call.start(gen.submit_n(ids, [call.sink(i) for i in range(spec.n)], max_tokens=spec.max_tokens,
                                        params=spec.params, stop=spec.stop, ignore_eos=spec.ignore_eos,
                                        logprobs=spec.logprobs, echo=spec.echo, constraint=constraint,
                                        speculative=spec.speculative))
            except QueueFullError as e:
                return self._error(P.BadRequest(str(e), None, "rate_limit_exceeded", status=429,
                                                type_="rate_limit_error"), {"Retry-After": str(e.retry_after)})
            except GeneratorClosedError as e:
                raise P.BadRequest(str(e), None, "shutting_down", status=503, type_="unavailable_error") from None
            except ContextOverflowError as e:
                raise P.BadRequest(str(e), "messages" if kind == "chat" else "prompt",
                                   "context_length_exceeded") from None
            except (SpeculativeError, NoMtpHeadsError) as e:  # "draft" without --model-draft, "mtp" without heads
                raise P.BadRequest(str(e), "speculative", "invalid_value") from None
            except CflowError as e:
                raise P.BadRequest(str(e), "prompt", "invalid_value") from None
        except P.BadRequest as e:
            return self._error(e)
        except ClientGone:
            return nothing
        if spec.stream:
            return call.stream
        return await call.collect(request.receive)

    def _too_large(self, size: str) -> P.BadRequest:
        n_ctx = self.gen.n_ctx if self.gen is not None else 0
        return P.BadRequest(f"the request body is {size} bytes; a slot's context of {n_ctx} tokens holds at most "
                            f"{self.max_body} bytes of request (see `cflow serve --help`); shorten the prompt",
                            None, "body_too_large", status=413)

    async def _read_json(self, request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise self._too_large(declared)
        parts, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body:
                    raise self._too_large(f"more than {size}")
                parts.append(chunk)
        except ClientDisconnect:
            raise ClientGone() from None
        raw = b"".join(parts)
        if not raw.strip():
            raise P.BadRequest("the request body is empty; send a JSON object", None, "invalid_json")
        try:
            if len(raw) < JSON_OFF_LOOP:
                return json.loads(raw, parse_constant=_reject_constant)
            return await self._off_loop(json.loads, raw, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise P.BadRequest(f"the request body is not valid JSON: {str(e)[:200]}", None, "invalid_json") from None

    async def _off_loop(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """fn(*args, **kw) on a bulk thread (below the loop's priority), awaited."""
        return await asyncio.get_running_loop().run_in_executor(self._bulk, functools.partial(fn, *args, **kw))

    async def _constraint(self, gen: BatchGenerator, spec: P.GenSpec) -> Any:
        """The request's constraint compiled against the tokenizer, off the event loop (the first one
        builds llguidance's view of the vocabulary, ~0.5 s); 400 naming the field when malformed."""
        wanted, param = spec.constraint, spec.constraint_param
        if wanted is None and spec.tools is not None:  # the tool-call syntax, when the model must call
            wanted, param = tools_mod.constraint_for(spec.tool_format, spec.tools, gen.backend.tokenizer), "tools"
        elif wanted is not None and spec.tool_format == "harmony":   # a schema shapes the final message only
            wanted = tools_mod.harmony_constraint(wanted, gen.backend.tokenizer)
        if wanted is None:
            return None
        try:
            return await self._off_loop(compile_constraint, wanted, gen.backend.tokenizer, gen.backend.vocab_size)
        except ConstraintError as e:
            raise P.BadRequest(f"'{param}': {e}", param, "invalid_value") from None

    async def _tokens(self, gen: BatchGenerator, spec: P.GenSpec) -> list[int]:
        backend = gen.backend

        def work() -> list[int]:
            if spec.kind == "chat":
                if self._tool_format is None:
                    self._tool_format = tools_mod.detect_format(backend.tokenizer)
                spec.tool_format = self._tool_format
                messages, template_kw = tools_mod.prepare(spec.tool_format, spec.messages, spec.tools)
                template_kw = {**spec.template_kwargs, **template_kw}
                if spec.reasoning_effort is not None:   # the template reads it (gpt-oss's) or ignores it
                    template_kw["reasoning_effort"] = spec.reasoning_effort
                ids = backend.chat_tokens(messages, **template_kw)
                if not spec.thoughts_in_content and thinks_in_tags(backend.tokenizer.chat_template):
                    # the answer's <think> block is reasoning
                    spec.think = prompt_opens_thought(prompt_tail(backend.tokenizer, ids))
                return ids
            return backend.encode(spec.prompt)

        try:
            return await self._off_loop(work)
        except CflowError as e:
            raise P.BadRequest(str(e), "messages" if spec.kind == "chat" else "prompt", "invalid_value") from None
        except Exception as e:  # the tokenizer refusing the text (e.g. unpaired surrogates)
            raise P.BadRequest(f"cannot tokenize the {'messages' if spec.kind == 'chat' else 'prompt'}: "
                               f"{type(e).__name__}: {str(e)[:200]}", None, "invalid_value") from None


class _Guard:
    """ASGI middleware: the API key check (401) and the count of responses by status code."""

    def __init__(self, app: Any, server: Server) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        metrics = self.server.metrics
        key = self.server.api_key
        if key is not None and scope.get("path") not in PUBLIC:
            token = b""
            for name, value in scope.get("headers", ()):
                if name == b"authorization":
                    scheme, _, token = value.partition(b" ")
                    if scheme.lower() != b"bearer":
                        token = b""
                    token = token.strip()
                    break
            if not hmac.compare_digest(token, key):
                metrics.rejected("unauthorized")
                metrics.response(401)
                msg = "Invalid API key" if token else "Missing API key: send 'Authorization: Bearer KEY'"
                resp = JSONResponse(P.error_body(msg, "invalid_request_error", None, "invalid_api_key"), 401,
                                    headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return

        replica = None if self.server.replica is None else self.server.replica.encode("latin-1", "replace")

        async def counted(message: Any) -> None:
            if message["type"] == "http.response.start":
                metrics.response(message["status"])
                if replica is not None:
                    message = {**message, "headers": [*message.get("headers", ()), (b"x-cflow-replica", replica)]}
            await send(message)

        await self.app(scope, receive, counted)


def create_app(load: Callable[[], BatchGenerator], **kw: Any) -> Any:
    """The ASGI app; `kw` as Server's. The app's `.server` is the Server."""
    server = Server(load, **kw)
    server.app.server = server
    return server.app
