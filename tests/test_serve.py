"""`cflow serve` against live servers on free local ports (127.0.0.1), driven by the official
`openai` client and by raw HTTP.

- Built-in model, 4 slots, an API key: completions and chat, streamed and not, equal to
  Engine.complete / Engine.chat (greedy, and seeded sampling); stop strings; usage counts;
  logprobs; logit_bias, presence and frequency penalties change the answer as Engine.complete's
  do; n choices, streamed and not, are seeds seed, seed + 1, ...; 64 concurrent streaming
  clients all get their own single-request answer (batched decoding changes nothing, and no
  stream sees another's text); 401 without the key; 400 with an OpenAI error body for bad
  requests, and for every field the server does not implement unless it holds its no-op value;
  a bounded fuzz of malformed bodies and headers gets only 4xx and the server stays healthy and
  correct; /metrics parses as Prometheus text.
- SmolLM2 (its own chat template), 1 slot, a queue of 1: the chat answer equals Engine.chat; a
  client that disconnects cancels its sequence and frees the slot; beyond the queue: 429 with
  Retry-After. With --timeout 1: a long request gets 504 (streamed: an error event, then
  [DONE]) and the only slot serves the next request.
- In-process: /health answers 503 while the model loads, then 200.
"""

from __future__ import annotations

import asyncio
import collections
import http.client
import json
import random
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("starlette", reason="the serve extra is not installed: pip install 'cflow-lm[serve]'")
pytest.importorskip("uvicorn", reason="the serve extra is not installed: pip install 'cflow-lm[serve]'")
openai = pytest.importorskip("openai", reason="the openai client (test extra) is not installed")

from cflow.runtime import DEFAULT_MODEL, Engine  # noqa: E402
from cflow.sampling import SamplingParams  # noqa: E402

KEY = "test-key-123"
MODEL = "default.cflow"
SLOT_CTX = 256  # -c 1024 over 4 slots (the built-in model allows 512)
needs_builtin = pytest.mark.skipif(not DEFAULT_MODEL.is_file(), reason="built-in model not installed")


# ---- live servers ----------------------------------------------------------------------------------
class Live:
    """`python -m cflow serve ... --port 0` in a subprocess; url from its startup line."""

    def __init__(self, *args: str, ready_timeout: float = 120) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "cflow", "serve", "--host", "127.0.0.1", "--port", "0",
                                      *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._listening = threading.Event()
        self._ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(ready_timeout):
            self.stop()
            raise AssertionError("server did not become ready:\n" + "".join(self.lines))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                self._listening.set()
            if "ready:" in line:
                self._ready.set()

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def request(live: Live, method: str, path: str, body: bytes | str | dict | None = None, key: str | None = KEY,
            headers: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, dict[str, str], bytes]:
    host, port = live.host_port
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    h = {"Content-Type": "application/json"} if body is not None else {}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    h.update(headers or {})
    if isinstance(body, dict):
        body = json.dumps(body)
    try:
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def metrics(live: Live) -> dict[str, float]:
    status, _, body = request(live, "GET", "/metrics")
    assert status == 200
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.fixture(scope="module")
def server():
    if not DEFAULT_MODEL.is_file():
        pytest.skip("built-in model not installed")
    live = Live("-np", "4", "-c", str(4 * SLOT_CTX), "-t", "1", "--api-key", KEY, "--max-queue", "64")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine():
    if not DEFAULT_MODEL.is_file():
        pytest.skip("built-in model not installed")
    with Engine.load(threads=1, n_ctx=SLOT_CTX) as eng:
        yield eng


# ---- basics --------------------------------------------------------------------------------------------
def test_models_health_and_metrics_parse(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, _, body = request(server, "GET", "/health", key=None)  # /health needs no key
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, headers, body = request(server, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    parser = pytest.importorskip("prometheus_client.parser")
    families = {f.name: f for f in parser.text_string_to_metric_families(body.decode())}
    for name in ("cflow_requests", "cflow_generated_tokens", "cflow_queue_depth", "cflow_batch_size",
                 "cflow_generation_tokens_per_second", "cflow_time_to_first_token_seconds", "cflow_slots"):
        assert name in families, name
    assert families["cflow_slots"].samples[0].value == 4


def test_completion_equals_engine(client, engine):
    prompt = "Once upon a time, there was a little girl"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    ref = engine.complete(prompt, 24, temperature=0)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.object == "text_completion" and r.model == MODEL
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (ref.prompt_tokens, len(ref.tokens), ref.prompt_tokens + len(ref.tokens))
    # token ids as the prompt, and the model's other names
    r2 = client.completions.create(model="default", prompt=engine.encode(prompt), max_tokens=24, temperature=0)
    assert r2.choices[0].text == ref.text


def test_completion_stream_with_usage(client, engine):
    prompt = "The little dog"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    ref = engine.complete(prompt, 30, temperature=0)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.tokens)
    assert chunks[-1].usage.prompt_tokens == ref.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streamed_and_not_equal_engine_chat(client, engine):
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "A story about a cat"}]
    ref = engine.chat(messages, 32, temperature=0)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(engine.chat_tokens(messages)) and r.usage.completion_tokens == len(ref.tokens)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_stop_strings(client, engine):
    prompt = "Once upon a time"
    full = engine.complete(prompt, 40, temperature=0).text
    stop = full[10:14]  # a piece of the greedy answer
    ref = engine.complete(prompt, 40, temperature=0, stop=[stop])
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "zzz"],
                                      stream=stream)
        chunks = list(r) if stream else [r]
        text = "".join(c.choices[0].text for c in chunks)
        assert text == ref.text == full[:full.index(stop)] and stop not in text
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproduces(client, engine):
    kw = dict(model=MODEL, prompt="Tom saw a bird", max_tokens=24, temperature=1.0, top_p=1.0,
              extra_body={"top_k": 0, "min_p": 0})  # llama-server's fields
    a, b, c = (client.completions.create(seed=s, **kw).choices[0].text for s in (42, 42, 43))
    assert a == b == engine.complete("Tom saw a bird", 24, temperature=1.0, top_p=1.0, top_k=0, min_p=0,
                                     seed=42).text
    assert a != c


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) == 3 and max(top.values()) == pytest.approx(chosen)  # greedy: the best
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)


def _first_greedy_token(engine, prompt) -> int:
    return engine.complete(prompt, 1, temperature=0).tokens[0]


def test_logit_bias_changes_the_answer_as_in_the_engine(client, engine):
    prompt = "Once upon a time"
    tok = _first_greedy_token(engine, prompt)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                       logit_bias={str(tok): -100})
    ref = engine.complete(prompt, 12, temperature=0, logit_bias={tok: -100})
    assert banned.choices[0].text == ref.text != plain.choices[0].text and ref.tokens[0] != tok
    # a +100 bias forces a token the model would not pick
    forced = engine.encode(" zebra", add_bos=False)[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0.8, seed=1,
                                  logit_bias={str(forced): 100}, logprobs=0)
    assert r.choices[0].logprobs.tokens == [engine.tokenizer.token_to_piece(forced)] * 3
    messages = [{"role": "user", "content": "Tell me a story"}]
    chat_tok = engine.chat(messages, 1, temperature=0).tokens[0]
    c = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                       logit_bias={str(chat_tok): -100})
    assert c.choices[0].message.content == engine.chat(messages, 8, temperature=0, logit_bias={chat_tok: -100}).text


def test_presence_and_frequency_penalties_as_in_the_engine(client, engine):
    prompt = "The dog ran and the dog ran and the dog"
    greedy = engine.complete(prompt, 30, temperature=0)
    for kw in (dict(frequency_penalty=2.0), dict(presence_penalty=2.0), dict(frequency_penalty=-0.5)):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, **kw)
        ref = engine.complete(prompt, 30, temperature=0, **kw)
        assert r.choices[0].text == ref.text and r.usage.completion_tokens == len(ref.tokens), kw
        if kw.get("frequency_penalty", 0) > 0 or kw.get("presence_penalty", 0) > 0:
            assert ref.tokens != greedy.tokens, kw  # the penalty changed the answer
    kw = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=1.0, top_k=0, frequency_penalty=1.2, seed=9)
    a, b = (client.completions.create(**{k: v for k, v in kw.items() if k != "top_k"}, extra_body={"top_k": 0})
            for _ in range(2))
    ref = engine.complete(prompt, 24, temperature=1.0, top_k=0, frequency_penalty=1.2, seed=9)
    assert a.choices[0].text == b.choices[0].text == ref.text


def test_n_choices_draw_consecutive_seeds(client, engine):
    prompt = "Lily found a box"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, top_p=1.0, n=3, seed=5,
                                  extra_body={"top_k": 0, "min_p": 0})
    refs = [engine.complete(prompt, 16, temperature=1.0, top_p=1.0, top_k=0, min_p=0, seed=5 + i) for i in range(3)]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [ref.text for ref in refs]
    assert [c.finish_reason for c in r.choices] == [ref.finish_reason for ref in refs]
    assert r.usage.prompt_tokens == refs[0].prompt_tokens  # the prompt counts once
    assert r.usage.completion_tokens == sum(len(ref.tokens) for ref in refs)
    assert len({c.text for c in r.choices}) == 3
    # streamed chat, two choices interleaved in one stream
    messages = [{"role": "user", "content": "A story about a fox"}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0.9,
                                                 n=2, seed=11, stream=True, stream_options={"include_usage": True}))
    texts, finish, roles = ["", ""], [None, None], [0, 0]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            roles[ch.index] += ch.delta.role == "assistant"
            finish[ch.index] = ch.finish_reason or finish[ch.index]
    refs = [engine.chat(messages, 12, temperature=0.9, seed=11 + i) for i in range(2)]
    assert texts == [ref.text for ref in refs] and finish == [ref.finish_reason for ref in refs]
    assert roles == [1, 1] and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == sum(len(ref.tokens) for ref in refs)
    # n greedy choices are all the greedy answer
    g = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, n=2, logprobs=1)
    want = engine.complete(prompt, 8, temperature=0).text
    assert [c.text for c in g.choices] == [want, want] and "".join(g.choices[1].logprobs.tokens) == want


UNSUPPORTED = [  # (endpoint, field, value): each refused with 400 naming the field
    ("c", "suffix", " the end"), ("c", "best_of", 3),
    ("c", "mirostat", 2), ("c", "typical_p", 0.5), ("c", "n_probs", 3),
    ("c", "dry_multiplier", 0.8), ("c", "samplers", ["top_k"]),
    ("chat", "modalities", ["text", "audio"]), ("chat", "audio", {"voice": "alloy", "format": "wav"}),
    ("chat", "prediction", {"type": "content", "content": "x"}), ("chat", "web_search_options", {}),
    ("chat", "echo", True),  # echo is the completions endpoint's (tests/test_serve_score.py)
]
NOOPS = [  # fields at their no-op value, and fields that change nothing here: accepted
    ("c", {"echo": False, "suffix": "", "best_of": 1, "response_format": {"type": "text"}, "user": "u",
           "mirostat": 0, "typical_p": 1.0, "grammar": "", "n_probs": 0, "metadata": {"a": "b"}}),
    ("c", {"n": 2, "best_of": 2}),
    ("chat", {"tool_choice": "none", "tools": [], "functions": None, "modalities": ["text"], "store": False,
              "parallel_tool_calls": True, "response_format": {"type": "text"}, "service_tier": "auto"}),
]


def test_unsupported_fields_are_refused_naming_the_field(server, client):
    base = {"c": ("/v1/completions", {"prompt": "Once", "max_tokens": 2}),
            "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})}
    for kind, name, value in UNSUPPORTED:
        path, body = base[kind]
        status, _, raw = request(server, "POST", path, {**body, name: value})
        assert status == 400, (name, raw)
        err = json.loads(raw)["error"]
        assert err["param"] == name and err["code"] == "unsupported_parameter" and f"'{name}'" in err["message"]
        assert err["type"] == "invalid_request_error"
    for kind, extra in NOOPS:
        path, body = base[kind]
        status, _, raw = request(server, "POST", path, {**body, **extra})
        assert status == 200, (extra, raw)
        assert len(json.loads(raw)["choices"]) == extra.get("n", 1)


# ---- concurrency ------------------------------------------------------------------------------------
def test_64_concurrent_streams_each_get_their_own_answer(server, engine):
    names = ["Lily", "Tom", "Ben", "Sue", "Max", "Anna", "Sam", "Mia"]
    things = ["a red ball", "a big tree", "a little cat", "the park", "a toy car", "the sea", "a cake", "a bird"]
    jobs = []
    for i in range(64):
        prompt = f"{names[i % 8]} saw {things[i // 8]}" + (" and" if i % 3 == 0 else ".")
        kw = dict(max_tokens=8 + (i * 7) % 40, temperature=0.0) if i % 2 == 0 else \
            dict(max_tokens=8 + (i * 5) % 40, temperature=0.9, seed=1000 + i)
        jobs.append((prompt, kw))

    async def one(ac, prompt, kw):
        parts, finish, usage = [], None, None
        stream = await ac.completions.create(model=MODEL, prompt=prompt, stream=True,
                                             stream_options={"include_usage": True}, **kw)
        async for c in stream:
            if c.choices:
                parts.append(c.choices[0].text)
                finish = c.choices[0].finish_reason or finish
            if c.usage:
                usage = c.usage
        return "".join(parts), finish, usage

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*(one(ac, p, kw) for p, kw in jobs))

    t0 = time.perf_counter()
    results = asyncio.run(main())
    elapsed = time.perf_counter() - t0
    for (prompt, kw), (text, finish, usage) in zip(jobs, results):
        ref = engine.complete(prompt, kw["max_tokens"], temperature=kw["temperature"], seed=kw.get("seed"))
        assert text == ref.text, (prompt, kw)
        assert finish == ref.finish_reason and usage.completion_tokens == len(ref.tokens)
    m = metrics(server)
    assert m["cflow_queue_depth"] == 0 and m["cflow_requests_running"] == 0
    steps, seqs = m["cflow_decode_steps_total"], m["cflow_decode_sequences_total"]
    assert seqs / steps > 1.5, "the streams were not decoded together"
    print(f"64 streams in {elapsed:.2f} s, mean batch {seqs / steps:.2f}")


# ---- refusals ------------------------------------------------------------------------------------
def test_api_key_required(server):
    for key in (None, "wrong", ""):
        status, headers, body = request(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}, key=key)
        assert status == 401 and headers.get("www-authenticate") == "Bearer"
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert request(server, "GET", "/metrics", key=None)[0] == 401
    assert request(server, "GET", "/v1/models", key="nope")[0] == 401
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=1)


BAD = [
    (b"{not json", None), (b"[1, 2]", None), (b"", None), (b'{"prompt": NaN}', None), (b"\xff\xfe{}", None),
    ({}, "prompt"), ({"prompt": 5}, "prompt"), ({"prompt": [1.5, 2]}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": []}, "prompt"), ({"prompt": [10 ** 9]}, "prompt"), ({"prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"), ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"), ({"prompt": "x", "top_p": 2}, "top_p"),
    ({"prompt": "x", "top_k": "all"}, "top_k"), ({"prompt": "x", "min_p": 7}, "min_p"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"), ({"prompt": "x", "seed": -5}, "seed"),
    ({"prompt": "x", "seed": "s"}, "seed"), ({"prompt": "x", "stop": 3}, "stop"), ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 129}, "n"), ({"prompt": "x", "n": 1.0}, "n"),
    ({"prompt": "x", "stop": ["a" * 500]}, "stop"), ({"prompt": "x", "stop": ["."] * 17}, "stop"),
    ({"prompt": "x", "stream": "yes"}, "stream"), ({"prompt": "x", "logprobs": 99}, "logprobs"),
    ({"prompt": "x", "model": "gpt-4"}, "model"), ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": "1"}, "frequency_penalty"),
    ({"prompt": "x", "logit_bias": [1]}, "logit_bias"), ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias"), ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": "1"}}, "logit_bias"), ({"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "once " * 400}, "prompt"),
]
BAD_CHAT = [
    ({}, "messages"), ({"messages": []}, "messages"), ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": [{"role": "user", "content": "x " * 600}]}, "messages"),
]


@pytest.mark.parametrize("path, cases", [("/v1/completions", BAD), ("/v1/chat/completions", BAD_CHAT)])
def test_bad_requests_get_400_with_an_openai_error(server, path, cases):
    for body, param in cases:
        status, headers, raw = request(server, "POST", path, body)
        assert status == 400, (body, status, raw)
        err = json.loads(raw)["error"]
        assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param, (body, err)
    status, _, raw = request(server, "POST", "/v1/completions", {"prompt": "once " * 400})
    assert json.loads(raw)["error"]["code"] == "context_length_exceeded"
    assert request(server, "GET", "/v1/completions")[0] == 405
    assert request(server, "GET", "/v2/nothing")[0] == 404
    assert request(server, "POST", "/v1/completions", b"x" * (9 * 2**20))[0] == 413


def _raw(server, data: bytes, half_close: bool, timeout: float = 10) -> int | None:
    """Send raw bytes; the status of the answer, or None when the server closed without one.
    half_close: end our side after the data (the server then takes the client as gone, and
    answers only what it could answer at once: malformed requests)."""
    host, port = server.host_port
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(data)
        if half_close:
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        buf = b""
        try:
            while b"\r\n" not in buf:
                chunk = s.recv(4096)
                if not chunk:
                    break
                buf += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    m = re.match(rb"HTTP/1\.[01] (\d{3})", buf)
    return int(m.group(1)) if m else None


def test_fuzz_gets_only_4xx_and_the_server_stays_healthy(server, client, engine):
    rng = random.Random(1234)
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    valid = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "stop": ["."], "seed": 1}
    valid_chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    junk_values = [None, True, -1, 0, 2**70, 1e308, -1e-9, "", "x" * 1000, [], {}, [[[]]], {"a": {"b": []}},
                   "\ud800", "\u0000", [1, "a", None], 3.5]
    codes: list[int | None] = []
    for i in range(160):
        kind = i % 8
        path = "/v1/chat/completions" if i % 2 else "/v1/completions"
        base = dict(valid_chat if i % 2 else valid)
        if kind in (0, 1, 2):  # a field gets a junk value, or a junk field appears
            key = rng.choice([*base, "stream", "logprobs", "top_k", "n", "stream_options", "model", "junk"])
            base[key] = rng.choice(junk_values)
            body = json.dumps(base, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
        elif kind == 3:  # truncated or bit-flipped JSON
            body = bytearray(json.dumps(base).encode())
            if rng.random() < 0.5:
                body = body[:rng.randrange(len(body))]
            else:
                for _ in range(3):
                    body[rng.randrange(len(body))] = rng.randrange(256)
            body = bytes(body)
        elif kind == 4:  # random bytes
            body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
        elif kind == 5:  # deep nesting
            body = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
        else:
            body = json.dumps(base).encode()
        if kind == 6:  # malformed headers around a valid body
            variants = [b"Content-Length: abc\r\n", b"Content-Length: -5\r\n", b"Content-Length: 99999\r\n",
                        b"Transfer-Encoding: chunked\r\n", b"Content-Length: 3\r\nContent-Length: 4\r\n",
                        b"X-Bad header\r\n", b"Host: \xff\xfe\r\n", b"A" * 20000 + b": b\r\n"]
            head = rng.choice(variants)
            data = b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + auth + head + b"\r\n" + body
        elif kind == 7:  # a broken request line or method
            data = rng.choice([b"GARBAGE\r\n\r\n", b"POST\r\n\r\n", b"GET /health HTTP/9.9\r\n\r\n",
                               b"BREW /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n",
                               b"POST /v1/completions?x=%zz HTTP/1.1\r\nHost: x\r\n" + auth +
                               b"Content-Length: 2\r\n\r\n{}", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"])
        else:
            data = (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + auth +
                    b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() +
                    b"\r\nConnection: close\r\n\r\n" + body)
        code = _raw(server, data, half_close=kind in (6, 7))
        codes.append(code)
        assert code is None or code < 500 or code == 505, (i, data[:200], code)  # 505: h11 on HTTP/9.9
    print(sorted(collections.Counter(codes).items(), key=str))
    assert sum(c is not None and 400 <= c < 500 for c in codes) > 100
    assert codes.count(None) <= 20  # only connections h11 drops on malformed headers or request lines
    status, _, body = request(server, "GET", "/health", key=None)
    assert status == 200
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0)
    assert r.choices[0].text == engine.complete("Once upon a time", 16, temperature=0).text
    assert server.proc.poll() is None


# ---- SmolLM2: a chat template, one slot, a queue of one ----------------------------------------
@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    live = Live("-m", str(smollm2_gguf), "-np", "1", "-c", "2048", "-t", "1", "--max-queue", "1", ready_timeout=300)
    yield live
    live.stop()


def _stream_long(live: Live) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streamed request that would run for thousands of tokens; returns once its first token came."""
    host, port = live.host_port
    conn = http.client.HTTPConnection(host, port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": "Count: 1, 2, 3,", "max_tokens": 1900, "ignore_eos": True, "stream": True}),
        headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    assert r.readline().startswith(b"data: ")
    return conn, r


def _wait(cond, timeout: float = 20) -> None:
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.05)


def test_smollm2_chat_uses_the_file_template(smol, smollm2_gguf):
    # a question the model answers with a margin: its first token leads by 1.2-1.7 logits on the
    # ref, avx2 and avx512 tables, whose logits for one prompt differ by up to ~0.8 (int8
    # activations turn last-bit differences into whole quantization steps); "Which city is the
    # capital of France?" was a 0.1-0.2 logit tie between "The" and "Le" that a table could tip
    messages = [{"role": "user", "content": "Name the capital of France."}]
    c = openai.OpenAI(base_url=smol.url + "/v1", api_key="none", max_retries=0, timeout=60)
    r = c.chat.completions.create(model=smollm2_gguf.name, messages=messages, max_tokens=16, temperature=0)
    with Engine.load(smollm2_gguf, threads=1, n_ctx=2048) as eng:
        ref = eng.chat(messages, 16, temperature=0)
    assert r.choices[0].message.content == ref.text and "Paris" in ref.text


def test_disconnect_cancels_and_frees_the_slot(smol):
    before = metrics(smol).get('cflow_requests_total{endpoint="completions",result="cancelled"}', 0)
    conn, r = _stream_long(smol)
    assert metrics(smol)["cflow_requests_running"] == 1
    t0 = time.time()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    _wait(lambda: metrics(smol)["cflow_requests_running"] == 0)
    assert time.time() - t0 < 5
    m = metrics(smol)
    assert m['cflow_requests_total{endpoint="completions",result="cancelled"}'] == before + 1
    assert m["cflow_generated_tokens_total"] < 1500  # it did not run to the end
    status, _, body = request(smol, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 4}, key=None)
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] >= 1


def test_queue_full_gets_429_with_retry_after(smol):
    conn, r = _stream_long(smol)  # holds the only slot
    queued: list = []
    waiter = threading.Thread(target=lambda: queued.append(
        request(smol, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, key=None)))
    waiter.start()
    try:
        _wait(lambda: metrics(smol)["cflow_queue_depth"] == 1)
        status, headers, body = request(smol, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, key=None)
        assert status == 429 and int(headers["retry-after"]) >= 1
        err = json.loads(body)["error"]
        assert err["type"] == "rate_limit_error" and "busy" in err["message"]
        assert metrics(smol)['cflow_requests_rejected_total{reason="queue_full"}'] >= 1
    finally:
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    waiter.join(30)
    assert queued and queued[0][0] == 200  # the queued request ran once the slot was free


@pytest.fixture(scope="module")
def smol_timeout(smollm2_gguf):
    live = Live("-m", str(smollm2_gguf), "-np", "1", "-c", "2048", "-t", "1", "--timeout", "1", ready_timeout=300)
    yield live
    live.stop()


def test_timeout_cancels_the_request_and_frees_the_slot(smol_timeout):
    live = smol_timeout
    long = {"prompt": "Count: 1, 2, 3,", "max_tokens": 1900, "ignore_eos": True}
    t0 = time.time()
    status, _, raw = request(live, "POST", "/v1/completions", long, key=None)
    assert status == 504 and 1 <= time.time() - t0 < 10
    err = json.loads(raw)["error"]
    assert err["code"] == "request_timeout" and err["type"] == "timeout_error" and "timeout of 1 s" in err["message"]
    # streamed: tokens, then an error event, then [DONE]
    status, headers, raw = request(live, "POST", "/v1/completions", {**long, "stream": True}, key=None)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert len(events) > 3 and all("choices" in json.loads(e) for e in events[:-2])
    # the only slot is free: the next request is served, within the limit
    c = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)
    r = c.completions.create(model=smol_gguf_name(live), prompt="Hello", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(model=smol_gguf_name(live), prompt="Count: 1, 2,", max_tokens=1900,
                             extra_body={"ignore_eos": True})
    assert e.value.status_code == 504
    m = metrics(live)
    assert m['cflow_requests_total{endpoint="completions",result="timeout"}'] == 3
    assert m["cflow_requests_running"] == 0 and m['cflow_requests_total{endpoint="completions",result="length"}'] == 1


def smol_gguf_name(live: Live) -> str:
    status, _, raw = request(live, "GET", "/v1/models", key=None)
    return json.loads(raw)["data"][0]["id"]


def test_prerendered_stream_chunks_equal_the_chunk_objects():
    # a streamed token's chunk is head + JSON string + tail, rendered once per choice: byte for byte
    # what rendering the whole chunk object gives
    from cflow.serve import protocol as P
    from cflow.serve.call import Call, sse

    server = type("S", (), {"model_name": 'm"\\odel \u00e9'})()
    for kind in ("completion", "chat"):
        for inc in (False, True):
            spec = P.GenSpec(kind, SamplingParams(), 3, None, [], True, inc, False, None)
            call = Call(server, None, spec, "x", 5, mailbox=None)
            for i, t in enumerate(call._templates()):
                assert t is not None
                for text in ("a", ' "q" \\ \n\t', "\u00e9\u4e2d\U0001f600", "\x00\x1f", "\ufffd"):
                    want = sse(P.chunk_object(kind, call.rid, call.created, server.model_name, text, None, None, inc,
                                              index=i))
                    assert t[0] + json.dumps(text, ensure_ascii=False, separators=(",", ":")).encode() + t[1] == want


# ---- loading ---------------------------------------------------------------------------------------
@needs_builtin
def test_health_is_503_while_loading_then_200():
    import uvicorn

    from cflow.serve import BatchGenerator, create_app

    release = threading.Event()

    def load():
        release.wait(30)
        return BatchGenerator.load(parallel=1, threads=1)

    app = create_app(load, model_name=MODEL)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    live = type("L", (), {"host_port": ("127.0.0.1", port)})()
    try:
        _wait(lambda: server.started)
        status, _, body = request(live, "GET", "/health", key=None)
        assert status == 503 and json.loads(body)["error"]["message"] == "Loading model"
        status, _, body = request(live, "POST", "/v1/completions", {"prompt": "x"}, key=None)
        assert status == 503 and json.loads(body)["error"]["type"] == "unavailable_error"
        release.set()
        _wait(lambda: request(live, "GET", "/health", key=None)[0] == 200)
        status, _, body = request(live, "POST", "/v1/completions", {"prompt": "Once", "max_tokens": 3}, key=None)
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3
    finally:
        release.set()
        server.should_exit = True
        t.join(20)
        sock.close()
    assert not t.is_alive() and app.server.gen is None


@needs_builtin
def test_cli_refuses_bad_flags_and_a_model_that_cannot_load():
    def serve(*args):
        return subprocess.run([sys.executable, "-m", "cflow", "serve", "--port", "0", "-t", "1", *args],
                              capture_output=True, text=True, timeout=60)

    r = serve("-np", "0")
    assert r.returncode == 2 and "--parallel: must be >= 1" in r.stderr
    r = serve("--timeout", "-1")
    assert r.returncode == 2 and "--timeout: must be a number of seconds >= 0" in r.stderr
    r = serve("--frequency-penalty", "nan")
    assert r.returncode == 2 and "--frequency-penalty: frequency_penalty must be a finite number" in r.stderr
    r = serve("-m", "/nonexistent/model.gguf")
    assert r.returncode == 2 and "-m: model file /nonexistent/model.gguf does not exist" in r.stderr
    r = serve("-c", "4000", "-np", "4")  # 1000 tokens per slot; the built-in model allows 512
    assert r.returncode == 2 and "1000 tokens per slot" in r.stderr and "listening on" in r.stderr
