"""`cflow serve`: an OpenAI-compatible HTTP server that decodes concurrent requests together.

    backend    BatchBackend: n KV-cache slots over one model, prefill + step_batch (the C boundary);
               EngineSlots, one cflow.runtime.Engine per slot, implements it today
    batch      BatchGenerator: the scheduler (slots, bounded queue, chunked prefill, one batched
               decode step per iteration, per-sequence sampling, cancellation); the Python API
    protocol   the OpenAI request checks and response objects
    metrics    counters and histograms as Prometheus text
    call       one admitted request: its jobs' events -> a JSON answer or a server-sent event stream
    app        the Starlette app: routes, API key, loading (install the extra: pip install "cflow-lm[serve]")

The HTTP stack is Starlette + uvicorn; cflow.serve.app says why. `batch`, `backend`, `protocol` and
`metrics` need only what the runtime needs; only `call` and `app` (and the `cflow serve` command)
import the serve extra. The runtime never imports this package.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BatchGenerator", "BatchBackend", "EngineSlots", "QueueFullError", "RequestTimeoutError", "create_app"]


def __getattr__(name: str) -> Any:
    if name in ("BatchGenerator", "QueueFullError", "RequestTimeoutError"):
        from cflow.serve import batch

        return getattr(batch, name)
    if name in ("BatchBackend", "EngineSlots"):
        from cflow.serve import backend

        return getattr(backend, name)
    if name == "create_app":
        from cflow.serve.app import create_app

        return create_app
    raise AttributeError(f"module 'cflow.serve' has no attribute {name!r}")
