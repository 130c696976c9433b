"""One admitted generation request of `cflow serve`: the events of its job(s) in the batch
generator turned into a JSON answer or a server-sent event stream (cflow.serve.app routes the
requests; cflow.serve.protocol defines the objects).

Events cross from the generator's worker thread to the event loop through a `Mailbox`: one
wake-up of the loop carries every event that arrived since the previous one, so a decode step of
B sequences costs one `call_soon_threadsafe` (a write to the loop's self-pipe), not B. Each
`Call` keeps its events in a plain list and one future to wake its handler; the handler also
watches the ASGI `receive` channel, so a client that disconnects is seen at once and its jobs are
cancelled (their slots freed).

With n choices (OpenAI's `n`) a call has n jobs, one slot each; events carry their choice index.
The answer ends when every choice has ended; the first failure ends it for all (an error object,
or in a stream an error event then `data: [DONE]`). A job past the server's --timeout fails with
RequestTimeoutError: 504 with code "request_timeout".

With `echo` (completions) each choice's job first delivers a Prompt event: the prompt's text
(the request's own string, or its token ids decoded) goes before the answer's text, and with
`logprobs` the prompt's token scores before the answer's (streamed: one chunk carrying both).
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, Callable

from starlette.responses import JSONResponse as _StarletteJSON
from starlette.responses import Response

from cflow.serve import protocol as P
from cflow.serve.tool_calls import AnswerParser, parse_answer
from cflow.serve.batch import Failed, Finished, GeneratorClosedError, Piece, Prompt, RequestTimeoutError

_MARK = "\x00"  # stands for the text in a pre-rendered chunk (JSON writes it as \u0000, never else here)


class ClientGone(Exception):
    pass


def json_bytes(obj: Any) -> bytes:
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate a client sent, echoed in an error message: escape it
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class JSONResponse(_StarletteJSON):
    """Starlette's JSONResponse, compact, and safe for any str a client could make us echo."""

    def render(self, content: Any) -> bytes:
        return json_bytes(content)


def sse(obj: Any) -> bytes:
    return b"data: " + json_bytes(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


class Mailbox:
    """Events from the worker thread to the calls on one event loop, one loop wake-up per burst."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[Call, Any]] = []

    def put(self, call: "Call", item: Any) -> None:
        """(Any thread.) Queue `item` for `call`; wakes the loop unless a wake-up is already on its way."""
        with self._lock:
            self._items.append((call, item))
            if len(self._items) > 1:
                return
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for call, item in items:
            call.push(item)


class Call:
    """One request's jobs -> its answer. `sink(i)` is choice i's event sink for the generator;
    `start(jobs)` once they are submitted; then `collect(receive)` or the ASGI app `stream`."""

    def __init__(self, server: Any, tokenizer: Any, spec: P.GenSpec, endpoint: str, n_prompt: int,
                 mailbox: Mailbox) -> None:
        self.server, self.spec, self.endpoint, self.mailbox = server, spec, endpoint, mailbox
        self.kind, self.n = spec.kind, spec.n
        self.rid, self.created, self.model = P.new_id(spec.kind), P.now(), server.model_name
        self.n_prompt = n_prompt
        self.logprobs = ([P.LogprobsBuilder(tokenizer, spec.kind) for _ in range(self.n)]
                         if spec.logprobs is not None else None)
        self.tokenizer = tokenizer
        # a chat with tools, or any chat of a model that reasons (harmony channels, <think> tags):
        # each choice's text goes through a parser that takes the calls and the reasoning out
        tools_on = spec.kind == "chat" and spec.tools is not None and spec.tools.choice != "none"
        reasons = spec.kind == "chat" and (spec.tool_format == "harmony" or spec.think is not None)
        self.parsers = ([AnswerParser(spec.tool_format or "generic", spec.tools, spec.think,
                                      thoughts_in_content=spec.thoughts_in_content) for _ in range(self.n)]
                        if tools_on or reasons else None)
        self.jobs: list[Any] = []
        self.result = "cancelled"
        self._inbox: list[tuple[int, Any]] = []
        self._waiter: asyncio.Future | None = None

    def sink(self, i: int) -> Callable[[Any], None]:
        put, call = self.mailbox.put, self
        return lambda ev: put(call, (i, ev))

    def start(self, jobs: list[Any]) -> None:
        self.jobs = jobs

    def _echo(self, ev: Prompt) -> tuple[str, list[Piece]]:
        """An echoed prompt: its text, and its tokens as Pieces carrying their scores."""
        text = self.spec.prompt if isinstance(self.spec.prompt, str) else self.tokenizer.decode(ev.scores.tokens)
        s = ev.scores
        return text, [Piece(t, "", lp, top) for t, lp, top in zip(s.tokens, s.logprobs, s.top)]

    def push(self, item: tuple[int, Any]) -> None:
        """(The event loop.) One (choice, event) from the mailbox."""
        self._inbox.append(item)
        self._wake()

    def _wake(self, *_: Any) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _events(self, receive: Callable[[], Any]):
        """Yield lists of the (choice, event) pairs available now, until every choice has ended or
        one has failed; raise ClientGone when the client disconnects."""
        watcher = asyncio.ensure_future(_disconnected(receive))
        watcher.add_done_callback(self._wake)
        loop = asyncio.get_running_loop()
        open_ = self.n
        try:
            while True:
                if watcher.done():
                    raise ClientGone()
                if not self._inbox:
                    self._waiter = loop.create_future()
                    await self._waiter
                    self._waiter = None
                    continue
                batch, self._inbox = self._inbox, []
                for _, ev in batch:
                    if isinstance(ev, Failed):
                        open_ = 0
                    elif isinstance(ev, Finished):
                        open_ -= 1
                yield batch
                if open_ <= 0:
                    return
        finally:
            watcher.cancel()

    def _done(self) -> None:
        for job in self.jobs:
            job.cancel()  # a no-op for a job that has finished
        self.server.metrics.request_done(self.endpoint, self.result)

    def _ended(self, ev: Any) -> None:
        if isinstance(ev, Failed):
            self.result = "timeout" if isinstance(ev.error, RequestTimeoutError) else "error"
        elif self.result == "cancelled":  # the first choice to end names the result
            self.result = ev.reason

    # ---- not streamed ------------------------------------------------------------------------
    async def collect(self, receive: Callable[[], Any]) -> Response | Callable[..., Any]:
        n = self.n
        parts: list[list[str]] = [[] for _ in range(n)]
        pieces: list[list[Piece]] = [[] for _ in range(n)]
        ends: list[Any] = [None] * n
        failed: Failed | None = None
        try:
            async for batch in self._events(receive):
                for i, ev in batch:
                    if isinstance(ev, Piece):
                        parts[i].append(ev.text)
                        pieces[i].append(ev)
                    elif isinstance(ev, Prompt):
                        text, prompt_pieces = self._echo(ev)
                        parts[i].insert(0, text)
                        pieces[i][:0] = prompt_pieces
                    else:
                        ends[i] = ev
                        self._ended(ev)
                        if isinstance(ev, Failed) and failed is None:
                            failed = ev
        except ClientGone:
            return nothing  # nobody is there to read an answer
        finally:
            self._done()
        if failed is not None:
            return failure(failed.error)
        choices = []
        for i in range(n):
            text, calls, reasoning = "".join(parts[i]) + ends[i].tail, None, None
            if self.parsers:
                reasoning, text, calls = parse_answer(self.spec.tool_format or "generic", self.spec.tools, text,
                                                      self.spec.think,
                                                      thoughts_in_content=self.spec.thoughts_in_content)
            choices.append(P.choice_object(self.kind, i, text, ends[i].reason,
                                           self.logprobs[i].entries(pieces[i]) if self.logprobs else None,
                                           tool_calls=calls, reasoning=reasoning))
        return JSONResponse(P.completion_object(self.kind, self.rid, self.created, self.model, choices,
                                                self._usage(ends)))

    def _usage(self, ends: list[Finished]) -> dict[str, Any]:
        # the prompt is counted once, as OpenAI does, however many choices decoded it
        return P.usage(self.n_prompt, sum(e.completion_tokens for e in ends), min(e.cached_tokens for e in ends),
                       sum(e.drafted for e in ends), sum(e.accepted for e in ends))

    # ---- streamed ------------------------------------------------------------------------------
    def _templates(self) -> list[tuple[bytes, bytes] | None]:
        """Per choice, the bytes around the text of a plain text chunk, rendered once: a token's
        chunk is then head + its JSON string + tail (the same bytes chunk_object would give)."""
        out: list[tuple[bytes, bytes] | None] = []
        for i in range(self.n):
            raw = sse(P.chunk_object(self.kind, self.rid, self.created, self.model, _MARK, None, None,
                                     self.spec.include_usage, index=i))
            parts = raw.split(json_bytes(_MARK))
            out.append((parts[0], parts[1]) if len(parts) == 2 else None)
        return out

    async def stream(self, scope: Any, receive: Callable[[], Any], send: Callable[[Any], Any]) -> None:
        """The ASGI app of a `stream: true` answer (server-sent events)."""
        k, rid, created, model = self.kind, self.rid, self.created, self.model
        inc = self.spec.include_usage
        templates = self._templates()
        ends: list[Any] = [None] * self.n
        parsers = self.parsers
        n_calls = [0] * self.n  # tool calls sent per choice

        def tool_chunks(i: int, reasoning: str, text: str, calls: list, lp: Any = None) -> list[bytes]:
            out_ = []
            if reasoning or text or lp is not None or calls:
                out_.append(sse(P.chunk_object(k, rid, created, model, text if text or lp is not None else None,
                                               None, lp, inc, index=i, tool_calls=calls, first_call=n_calls[i],
                                               reasoning=reasoning)))
                n_calls[i] += len(calls)
            return out_
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            if k == "chat":
                first = b"".join(sse(P.chunk_object(k, rid, created, model, "", None, None, inc, role=True, index=i))
                                 for i in range(self.n))
                await send({"type": "http.response.body", "body": first, "more_body": True})
            async for batch in self._events(receive):
                out = []
                for i, ev in batch:
                    if isinstance(ev, Prompt):
                        text, prompt_pieces = self._echo(ev)
                        lp = self.logprobs[i].entries(prompt_pieces) if self.logprobs else None
                        out.append(sse(P.chunk_object(k, rid, created, model, text, None, lp, inc, index=i)))
                    elif isinstance(ev, Piece) and parsers:
                        reasoning, text, calls = parsers[i].feed(ev.text)
                        out += tool_chunks(i, reasoning, text, calls,
                                           self.logprobs[i].entries([ev]) if self.logprobs else None)
                    elif isinstance(ev, Piece):
                        if self.logprobs:
                            lp = self.logprobs[i].entries([ev])
                            out.append(sse(P.chunk_object(k, rid, created, model, ev.text, None, lp, inc, index=i)))
                        elif ev.text:
                            t = templates[i]
                            out.append(t[0] + json_bytes(ev.text) + t[1] if t else
                                       sse(P.chunk_object(k, rid, created, model, ev.text, None, None, inc, index=i)))
                    elif isinstance(ev, Finished):
                        ends[i] = ev
                        self._ended(ev)
                        reason = ev.reason
                        if parsers:
                            r1, text, calls = parsers[i].feed(ev.tail)
                            r2, rest, more = parsers[i].finish()
                            out += tool_chunks(i, r1 + r2, text + rest, calls + more)
                            if n_calls[i] and reason == "stop":
                                reason = "tool_calls"
                        elif ev.tail:
                            out.append(sse(P.chunk_object(k, rid, created, model, ev.tail, None, None, inc, index=i)))
                        out.append(sse(P.chunk_object(k, rid, created, model, None if k == "chat" else "",
                                                      reason, None, inc, index=i)))
                        if all(e is not None for e in ends):
                            if inc:
                                out.append(sse(P.usage_chunk(k, rid, created, model, self._usage(ends))))
                            out.append(DONE)
                    else:
                        self._ended(ev)
                        out.append(sse(failure_body(ev.error)[1]))
                        out.append(DONE)
                        break
                if out:
                    await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (ClientGone, OSError):
            pass  # the client went away: the jobs are cancelled below
        finally:
            self._done()


async def nothing(scope: Any, receive: Any, send: Any) -> None:
    """The response to a client that has gone away: none (uvicorn sends nothing to a closed connection)."""


async def _disconnected(receive: Callable[[], Any]) -> None:
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return


def failure_body(e: BaseException) -> tuple[int, dict[str, Any]]:
    """The status and error object for a job that failed inside the generator."""
    if isinstance(e, RequestTimeoutError):
        return 504, P.error_body(f"{e} (the server's --timeout)", "timeout_error", None, "request_timeout")
    if isinstance(e, GeneratorClosedError):
        return 503, P.error_body(str(e), "unavailable_error", None, 503)
    return 500, P.error_body(f"generation failed: {e}", "server_error", None, 500)


def failure(e: BaseException) -> Response:
    status, body = failure_body(e)
    return JSONResponse(body, status)
