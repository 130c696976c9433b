"""The server's counters, rendered as Prometheus text (exposition format 0.0.4) for GET /metrics.

Written by hand (a few counters, gauges and histograms) so the serve extra needs no metrics
library. Updated from the batch worker thread and the HTTP event loop, so every update takes a lock.

    cflow_requests_total{endpoint,result}     finished requests (result: stop, length, cancelled, error)
    cflow_http_responses_total{code}          responses by status code (4xx included)
    cflow_requests_rejected_total{reason}     queue_full (429), unauthorized (401), bad_request (400)
    cflow_prompt_tokens_total                 prompt tokens of admitted requests
    cflow_prompt_tokens_cached_total          of which reused from a slot's KV cache (not evaluated)
    cflow_generated_tokens_total              tokens generated
    cflow_decode_steps_total                  batched decode steps
    cflow_decode_sequences_total              sequences advanced by them (/ steps = mean batch size)
    cflow_spec_draft_tokens_total             speculation: proposed tokens the model verified
    cflow_spec_accepted_tokens_total          of which accepted (/ draft tokens = acceptance rate)
    cflow_spec_rounds_total                   verification blocks (a sequence's next token + its proposals)
    cflow_spec_paused_steps_total             decode rows taken plainly while the acceptance gate paused speculation
    cflow_queue_depth                         requests waiting for a slot (gauge)
    cflow_requests_running                    requests in a slot (gauge)
    cflow_slots                               slots (--parallel) (gauge)
    cflow_batch_size                          sequences in the last decode step (gauge)
    cflow_generation_tokens_per_second        generated tokens/s over the last 10 s (gauge)
    cflow_prompt_tokens_per_second            evaluated prompt tokens/s over the last 10 s (gauge)
    cflow_time_to_first_token_seconds         histogram: request arrival -> first token
    cflow_queue_wait_seconds                  histogram: request arrival -> slot
    cflow_request_duration_seconds            histogram: request arrival -> end
"""

from __future__ import annotations

import bisect
import collections
import threading
import time
from typing import Any

WINDOW_S = 10.0
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: +Inf only
        self.sum = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, cum = [], 0
        for b, c in zip(self.buckets, self.counts):
            cum += c
            out.append(f'{name}_bucket{{le="{b:g}"}} {cum}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out.append(f"{name}_sum {self.sum:.6f}")
        out.append(f"{name}_count {self.n}")
        return out


class _Rate:
    """Events per second over the last WINDOW_S seconds."""

    def __init__(self) -> None:
        self.events: collections.deque[tuple[float, int]] = collections.deque()
        self.total = 0

    def add(self, n: int, now: float) -> None:
        self.events.append((now, n))
        self.total += n
        self._prune(now)

    def _prune(self, now: float) -> None:
        while self.events and self.events[0][0] < now - WINDOW_S:
            self.total -= self.events.popleft()[1]

    def rate(self, now: float) -> float:
        self._prune(now)
        return self.total / WINDOW_S


class Metrics:
    """What the batch generator and the HTTP layer count; `render(generator)` for /metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: collections.Counter[tuple[str, str]] = collections.Counter()
        self.responses: collections.Counter[int] = collections.Counter()
        self.rejects: collections.Counter[str] = collections.Counter({"queue_full": 0, "unauthorized": 0,
                                                                       "bad_request": 0})
        self.prompt_tokens = 0
        self.prompt_cached = 0
        self.generated_tokens = 0
        self.steps = 0
        self.step_sequences = 0
        self.spec_drafted = 0
        self.spec_accepted = 0
        self.spec_rounds = 0
        self.spec_paused = 0
        self.gen_rate = _Rate()
        self.prompt_rate = _Rate()
        self.ttft = _Histogram(LATENCY_BUCKETS)
        self.queue_wait = _Histogram(LATENCY_BUCKETS)
        self.duration = _Histogram(DURATION_BUCKETS)

    # ---- from the batch generator (worker thread) --------------------------------------------
    def rejected(self, reason: str) -> None:
        with self._lock:
            self.rejects[reason] += 1

    def admitted(self, queue_s: float, prompt_tokens: int, cached: int) -> None:
        with self._lock:
            self.queue_wait.observe(queue_s)
            self.prompt_tokens += prompt_tokens
            self.prompt_cached += cached

    def prompt_evaluated(self, n: int, seconds: float) -> None:
        with self._lock:
            self.prompt_rate.add(n, time.monotonic())

    def decode_step(self, batch: int, seconds: float) -> None:
        with self._lock:
            self.steps += 1
            self.step_sequences += batch

    def speculation_round(self) -> None:
        """One sequence's verification block came back."""
        with self._lock:
            self.spec_rounds += 1

    def speculation_paused(self) -> None:
        """A speculating sequence's decode row went plain: its acceptance gate had paused it."""
        with self._lock:
            self.spec_paused += 1

    def speculation_judged(self, counted: int, kept: bool) -> None:
        """One proposal of a block judged (kept or not), counting `counted` proposals as drafted
        (cflow.runtime.speculative.proposals_counted). Counted as it is judged, before its token
        is emitted: that token may end the request, and a client that reads /metrics after the
        answer must find the answer's proposals counted."""
        with self._lock:
            self.spec_drafted += counted
            self.spec_accepted += int(kept)

    def first_token(self, ttft_s: float) -> None:
        with self._lock:
            self.ttft.observe(ttft_s)

    def generated(self, n: int) -> None:
        with self._lock:
            self.generated_tokens += n
            self.gen_rate.add(n, time.monotonic())

    def finished(self, result: str, duration_s: float) -> None:
        with self._lock:
            self.duration.observe(duration_s)

    # ---- from the HTTP layer ------------------------------------------------------------------
    def request_done(self, endpoint: str, result: str) -> None:
        with self._lock:
            self.requests[(endpoint, result)] += 1

    def response(self, code: int) -> None:
        with self._lock:
            self.responses[int(code)] += 1

    # ---- exposition ----------------------------------------------------------------------------
    def render(self, gen: Any = None, loading: bool = False) -> str:
        now = time.monotonic()
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(samples)

        with self._lock:
            metric("cflow_requests_total", "counter", "Finished generation requests by endpoint and result.",
                   [f'cflow_requests_total{{endpoint="{e}",result="{r}"}} {n}'
                    for (e, r), n in sorted(self.requests.items())])
            metric("cflow_http_responses_total", "counter", "HTTP responses by status code.",
                   [f'cflow_http_responses_total{{code="{c}"}} {n}' for c, n in sorted(self.responses.items())])
            metric("cflow_requests_rejected_total", "counter", "Requests refused, by reason.",
                   [f'cflow_requests_rejected_total{{reason="{r}"}} {n}' for r, n in sorted(self.rejects.items())])
            metric("cflow_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
                   [f"cflow_prompt_tokens_total {self.prompt_tokens}"])
            metric("cflow_prompt_tokens_cached_total", "counter",
                   "Prompt tokens reused from a slot's KV cache instead of evaluated.",
                   [f"cflow_prompt_tokens_cached_total {self.prompt_cached}"])
            metric("cflow_generated_tokens_total", "counter", "Generated tokens.",
                   [f"cflow_generated_tokens_total {self.generated_tokens}"])
            metric("cflow_decode_steps_total", "counter", "Batched decode steps.",
                   [f"cflow_decode_steps_total {self.steps}"])
            metric("cflow_decode_sequences_total", "counter",
                   "Sequences advanced by the decode steps (divided by the steps: the mean batch size).",
                   [f"cflow_decode_sequences_total {self.step_sequences}"])
            metric("cflow_spec_draft_tokens_total", "counter",
                   "Speculative decoding: proposed tokens the model verified (after a rejection too).",
                   [f"cflow_spec_draft_tokens_total {self.spec_drafted}"])
            metric("cflow_spec_accepted_tokens_total", "counter",
                   "Speculative decoding: proposed tokens accepted (divided by the draft tokens: the acceptance "
                   "rate).", [f"cflow_spec_accepted_tokens_total {self.spec_accepted}"])
            metric("cflow_spec_rounds_total", "counter",
                   "Speculative decoding: verification blocks (a sequence's next token and its proposals in one "
                   "call).", [f"cflow_spec_rounds_total {self.spec_rounds}"])
            metric("cflow_spec_paused_steps_total", "counter",
                   "Speculative decoding: decode rows of speculating sequences taken plainly because their acceptance "
                   "gate had paused speculation (it pauses while proposals lose).",
                   [f"cflow_spec_paused_steps_total {self.spec_paused}"])
            running = gen.running if gen is not None else 0
            queued = gen.queue_depth if gen is not None else 0
            metric("cflow_queue_depth", "gauge", "Requests waiting for a slot.", [f"cflow_queue_depth {queued}"])
            metric("cflow_requests_running", "gauge", "Requests in a slot.", [f"cflow_requests_running {running}"])
            metric("cflow_slots", "gauge", "Sequence slots (--parallel).",
                   [f"cflow_slots {gen.n_slots if gen is not None else 0}"])
            metric("cflow_batch_size", "gauge", "Sequences in the last decode step.",
                   [f"cflow_batch_size {gen.last_batch if gen is not None else 0}"])
            metric("cflow_generation_tokens_per_second", "gauge",
                   f"Generated tokens per second over the last {WINDOW_S:g} s.",
                   [f"cflow_generation_tokens_per_second {self.gen_rate.rate(now):.3f}"])
            metric("cflow_prompt_tokens_per_second", "gauge",
                   f"Evaluated prompt tokens per second over the last {WINDOW_S:g} s.",
                   [f"cflow_prompt_tokens_per_second {self.prompt_rate.rate(now):.3f}"])
            metric("cflow_time_to_first_token_seconds", "histogram", "Request arrival to its first token.",
                   self.ttft.lines("cflow_time_to_first_token_seconds"))
            metric("cflow_queue_wait_seconds", "histogram", "Request arrival to its slot.",
                   self.queue_wait.lines("cflow_queue_wait_seconds"))
            metric("cflow_request_duration_seconds", "histogram", "Request arrival to its end.",
                   self.duration.lines("cflow_request_duration_seconds"))
            metric("cflow_model_loading", "gauge", "1 while the model loads.",
                   [f"cflow_model_loading {int(loading)}"])
        return "\n".join(lines) + "\n"
