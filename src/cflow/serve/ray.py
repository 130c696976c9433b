"""Scale-out of `cflow serve` on Ray Serve: N replicas of the whole server, each a Ray actor with
its own model and BatchGenerator, behind Ray Serve's HTTP proxy (`cflow serve --ray --replicas N`,
or this module from Python). Needs the ray extra: pip install "cflow-lm[ray]".

    import functools
    from ray import serve
    from cflow.serve.batch import BatchGenerator
    from cflow.serve.ray import application

    load = functools.partial(BatchGenerator.load, "model.gguf", parallel=4, threads=2)
    serve.run(application(load, slots=4, replicas=2, max_replicas=4), route_prefix="/")
    # the OpenAI API is now on Ray Serve's proxy (default http://127.0.0.1:8000/v1/...)

What each piece is, and why:
- The ingress of every replica is cflow's own Starlette app (cflow.serve.app), built inside the
  replica by a builder function (serve.ingress accepts one; the app holds threads and a model,
  which cannot be pickled to the replica): every route, stream, error body and metric is the
  single-process server's, and Ray Serve adds routing, scaling and restarts. Ray Serve's OpenAI
  ingress (ray.serve.llm) is built around vLLM engines, so it does not fit a cflow backend.
- The model loads while the replica starts (Server.load_now), so Ray routes nothing to a replica
  before it can answer.
- Autoscaling on queue depth: Ray Serve counts each replica's ongoing requests (running in its
  slots plus queued in its BatchGenerator) and, with max_replicas > replicas, keeps that near
  `target_ongoing_requests` = the replica's slots: a replica with every slot busy and a queue
  asks for another. max_ongoing_requests (default 2 x slots) caps what one replica holds; the
  rest waits in Ray's router, which sends each request to the less loaded of two replicas.
- Health: Ray calls check_health every health_check_period_s; it raises while the replica's
  server cannot answer (its model failed to load, or its generator's worker stopped), and Ray
  replaces the replica. A replica that dies (killed, out of memory) is replaced too, and the
  proxy routes around it meanwhile.
- Which replica answered: the `x-cflow-replica` response header and /health's "replica" field
  (Ray's replica id).
- Prefix reuse is per replica (each has its own slots, cflow.serve.batch); Ray's default router
  does not route by prefix, so a shared system prompt is evaluated once per replica.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable

DEPLOYMENT = "cflow"
APP_NAME = "cflow"
HEALTH_PERIOD_S = 5.0      # Ray's check_health period
HEALTH_TIMEOUT_S = 30.0    # a check that takes longer fails

_server: Any = None  # this replica's cflow.serve.app.Server (one replica per actor process)


def _replica_id() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside a replica (a test building the app directly)
        return f"{socket.gethostname()}:{os.getpid()}"


def build_app(load: Callable[[], Any], options: dict[str, Any]) -> Any:
    """(In the replica.) cflow's ASGI app over the generator `load()` returns, loaded now, named
    after the replica; `options`: create_app's keyword arguments (model_name, aliases, api_key,
    defaults)."""
    global _server
    from cflow.serve.app import create_app

    app = create_app(load, replica=_replica_id(), **options)
    app.server.load_now()
    _server = app.server
    return app


class Replica:
    """The deployment class; serve.ingress gives it the app build_app makes."""

    def check_health(self) -> None:
        why = "the replica's app was not built" if _server is None else _server.healthy()
        if why is not None:
            raise RuntimeError(f"cflow replica unhealthy: {why}")


def application(load: Callable[[], Any], *, slots: int, replicas: int = 1, max_replicas: int | None = None,
                options: dict[str, Any] | None = None, num_cpus: float = 0.0,
                max_ongoing_requests: int | None = None, name: str = DEPLOYMENT,
                health_check_period_s: float = HEALTH_PERIOD_S,
                health_check_timeout_s: float = HEALTH_TIMEOUT_S) -> Any:
    """A Ray Serve application of `replicas` cflow servers (ray.serve.Application: give it to
    serve.run). `load`: a picklable callable that returns a BatchGenerator (each replica calls it
    once); `slots`: that generator's slots (the autoscaling target); `max_replicas` > replicas
    turns on autoscaling between the two; `options`: create_app's keyword arguments; `num_cpus`:
    what Ray reserves per replica (0: schedule regardless; the engine's threads are its own)."""
    from ray import serve

    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if max_replicas is not None and max_replicas < replicas:
        raise ValueError(f"max_replicas ({max_replicas}) must be >= replicas ({replicas})")
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    opts = dict(options or {})

    def builder() -> Any:  # a plain function: serve.ingress calls it in the replica (a partial would be
        return build_app(load, opts)  # taken for an ASGI app and pickled as one)

    cls = serve.ingress(builder)(Replica)
    kw: dict[str, Any] = {}
    if max_replicas is not None and max_replicas > replicas:
        kw["autoscaling_config"] = {"min_replicas": replicas, "initial_replicas": replicas,
                                    "max_replicas": max_replicas, "target_ongoing_requests": slots}
    else:
        kw["num_replicas"] = replicas
    dep = serve.deployment(cls, name=name, max_ongoing_requests=max_ongoing_requests or 2 * slots,
                           ray_actor_options={"num_cpus": num_cpus},
                           health_check_period_s=health_check_period_s,
                           health_check_timeout_s=health_check_timeout_s, **kw)
    return dep.bind()


def serve_forever(load: Callable[[], Any], *, host: str, port: int, slots: int, replicas: int = 1,
                  max_replicas: int | None = None, options: dict[str, Any] | None = None,
                  address: str | None = None, log: Callable[[str], None] = print) -> None:
    """`cflow serve --ray`: start (or join, `address`) a Ray cluster, run the application with Ray
    Serve's proxy on host:port, and block until Ctrl-C, then shut Serve down."""
    import ray
    from ray import serve

    ray.init(address=address, include_dashboard=False, logging_level="warning", log_to_driver=False)
    try:
        serve.start(http_options={"host": host, "port": port})
        app = application(load, slots=slots, replicas=replicas, max_replicas=max_replicas, options=options)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        shown = f"[{host}]" if ":" in host else host
        scale = f"{replicas}" if not max_replicas or max_replicas <= replicas else f"{replicas}..{max_replicas}"
        log(f"ready: {scale} replica(s) on Ray Serve, listening on http://{shown}:{port}")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
