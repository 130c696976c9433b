"""Soak (slow marker): `cflow serve` with SmolLM2 under 16 concurrent clients for 10 minutes
(CFLOW_SOAK_SECONDS), with random cancellations and malformed requests mixed in. Nothing is lost
(every accepted request completes, or is cancelled by its own client), the server's resident memory
stays within 5% after the warm-up, and /health answers every time it is asked (every second).
The figures go to CFLOW_SOAK_OUT (JSON) when set: docs/results/serve.md quotes them.

    CFLOW_SOAK_OUT=/tmp/soak.json python -m pytest -m slow tests/test_serve_soak.py -s
"""

from __future__ import annotations

import http.client
import json
import os
import random
import threading
import time

import pytest

pytest.importorskip("starlette", reason="the serve extra is not installed: pip install 'cflow-lm[serve]'")
pytest.importorskip("uvicorn", reason="the serve extra is not installed: pip install 'cflow-lm[serve]'")

from test_serve import Live, request  # noqa: E402

pytestmark = pytest.mark.slow

CLIENTS = 16
WARMUP_S = 60
MALFORMED = [b"{not json", b'{"prompt": 5}', b'{"prompt": "x", "max_tokens": -3}', b'{"prompt": "x", "temperature": "hot"}',
             b"[]", b'{"messages": "hi"}']


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.problems: list[str] = []

    def add(self, key: str, problem: str | None = None) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1
            if problem:
                self.problems.append(problem)


def client(live: Live, seed: int, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    host, port = live.host_port
    while time.time() < until:
        roll = rng.random()
        if roll < 0.1:  # malformed: a 4xx, never a 5xx or a hang
            status, _, _ = request(live, "POST", "/v1/completions", rng.choice(MALFORMED), key=None, timeout=60)
            tally.add("malformed", None if 400 <= status < 500 else f"malformed request got {status}")
            continue
        chat = rng.random() < 0.5
        body = {"max_tokens": rng.randint(8, 96), "temperature": 0.8, "seed": rng.randint(0, 10**6),
                "stream": rng.random() < 0.6}
        if chat:
            body["messages"] = [{"role": "user", "content": f"Tell me a short story about a {rng.choice(['cat', 'dog', 'boat', 'star'])}."}]
        else:
            body["prompt"] = "Once upon a time, " * rng.randint(1, 20)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        cancel_after = rng.randint(1, 6) if body["stream"] and rng.random() < 0.2 else None
        conn = http.client.HTTPConnection(host, port, timeout=120)
        try:
            conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status == 429:
                r.read()
                tally.add("busy")
                time.sleep(0.2)
                continue
            if r.status != 200:
                tally.add("error", f"{path} got {r.status}: {r.read()[:200]!r}")
                continue
            if not body["stream"]:
                out = json.loads(r.read())
                ok = out["choices"][0]["finish_reason"] in ("stop", "length")
                tally.add("completed" if ok else "lost", None if ok else f"no finish_reason: {out}")
                continue
            chunks, done = 0, False
            for line in r:
                if line.startswith(b"data: [DONE]"):
                    done = True
                    break
                if line.startswith(b"data: "):
                    chunks += 1
                    if cancel_after is not None and chunks >= cancel_after:
                        break
            if cancel_after is not None and not done:
                tally.add("cancelled")
            else:
                tally.add("completed" if done else "lost", None if done else "a stream ended without [DONE]")
        except (OSError, http.client.HTTPException, ValueError) as e:
            tally.add("lost", f"{type(e).__name__}: {e}")
        finally:
            conn.close()


def test_soak(smollm2_gguf):
    seconds = float(os.environ.get("CFLOW_SOAK_SECONDS", "600"))
    live = Live("-m", str(smollm2_gguf), "-np", str(CLIENTS), "-c", str(CLIENTS * 512), "--max-queue", "64",
                ready_timeout=300)
    try:
        tally = Tally()
        t0 = time.time()
        until = t0 + seconds
        threads = [threading.Thread(target=client, args=(live, i, until, tally)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        rss, health = [], []
        while time.time() < until:
            h0 = time.perf_counter()
            status, _, _ = request(live, "GET", "/health", key=None, timeout=30)
            health.append((time.perf_counter() - h0) * 1000)
            assert status == 200, status
            rss.append((time.time() - t0, _rss_kb(live.proc.pid)))
            time.sleep(1.0)
        for t in threads:
            t.join(timeout=300)
        after = [kb for t, kb in rss if t >= WARMUP_S] or [kb for _, kb in rss]
        figures = {"seconds": seconds, "clients": CLIENTS, "counts": tally.counts,
                   "rss_mb_after_warmup": [min(after) / 1024, max(after) / 1024],
                   "rss_growth": max(after) / min(after) - 1, "health_ms_max": max(health),
                   "health_ms_p50": sorted(health)[len(health) // 2], "health_checks": len(health),
                   "rss_mb_every_30s": [round(kb / 1024, 1) for t, kb in rss[::30]]}
        if os.environ.get("CFLOW_SOAK_OUT"):
            with open(os.environ["CFLOW_SOAK_OUT"], "w") as f:
                json.dump(figures, f, indent=1)
        print(json.dumps(figures))
        assert not tally.problems, tally.problems[:10]
        assert tally.counts.get("lost", 0) == 0 and tally.counts.get("completed", 0) > 50, tally.counts
        assert figures["rss_growth"] <= 0.05, figures
    finally:
        live.stop()
