"""cflow.serve.ray: the server scaled out on Ray Serve.

- Without Ray: a replica's app (build_app) loads its model before it is returned, says its name
  in the x-cflow-replica header and /health, and its check_health raises once its generator has
  stopped; `cflow serve` refuses the Ray flags without --ray, and --ray on port 0.
- With Ray (slow; skipped when ray[serve] is not installed): a local Ray cluster, 2 replicas of
  the built-in model (1 thread, 2 slots each) behind Ray Serve's proxy, started by `cflow serve
  --ray --replicas 2` (which Ctrl-C stops) and by cflow.serve.ray.application: concurrent requests are
  answered by both replicas (x-cflow-replica) with Engine.complete's greedy text; one replica
  killed (ray.kill of its actor): the service keeps answering every request, and Ray Serve
  brings the deployment back to 2 running replicas, a new one among them.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("starlette", reason="the serve extra is not installed: pip install 'cflow-lm[serve]'")

from cflow.runtime import DEFAULT_MODEL, Engine  # noqa: E402
from cflow.serve.batch import BatchGenerator  # noqa: E402

needs_builtin = pytest.mark.skipif(not DEFAULT_MODEL.is_file(), reason="built-in model not installed")
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They saw", "One day, a big red ball"]


def load_builtin() -> BatchGenerator:
    return BatchGenerator.load(None, parallel=2, threads=1, n_ctx=256)


# ---- without Ray -----------------------------------------------------------------------------------
@needs_builtin
def test_replica_app_loads_names_itself_and_checks_health():
    from starlette.testclient import TestClient

    from cflow.serve import ray as cray

    app = cray.build_app(load_builtin, {"model_name": "default.cflow"})
    server = app.server
    assert server.gen is not None  # loaded before the app is handed to Ray
    replica = server.replica
    cray.Replica().check_health()
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.headers["x-cflow-replica"] == replica
        h = client.get("/health")
        assert h.json()["replica"] == replica and h.headers["x-cflow-replica"] == replica
    server.close()
    with pytest.raises(RuntimeError, match="unhealthy"):
        cray.Replica().check_health()


@pytest.mark.parametrize("argv, flag", [(["--replicas", "2"], "--ray"), (["--max-replicas", "3"], "--ray"),
                                        (["--ray", "--port", "0"], "--port"),
                                        (["--ray", "--replicas", "2", "--max-replicas", "1"], "--max-replicas")])
def test_serve_refuses_bad_ray_flags(argv, flag):
    r = subprocess.run([sys.executable, "-m", "cflow", "serve", *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"error: {flag}:" in r.stderr, r.stderr


# ---- a local Ray cluster -----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), {"error": e.read().decode(errors="replace")}


@pytest.mark.slow
@needs_builtin
def test_cflow_serve_ray_command():
    """`cflow serve --ray --replicas 2`: its own local Ray cluster, both replicas answer on one port,
    Ctrl-C shuts it down (exit 0). Before the module's cluster below starts (one at a time)."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'cflow-lm[ray]'")
    import signal
    import threading

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cflow", "serve", "--ray", "--replicas", "2", "-np", "2", "-t", "1",
                             "-c", "512", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    ready, lines = threading.Event(), []

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if "ready:" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(300), "".join(lines)[-3000:]
        res = _spread(f"http://127.0.0.1:{port}", 12)
        assert all(s == 200 for s, _, _ in res) and len({r for _, r, _ in res}) == 2, res
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    assert code == 0, "".join(lines)[-3000:]


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'cflow-lm[ray]'")
    serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'cflow-lm[ray]'")
    if not DEFAULT_MODEL.is_file():
        pytest.skip("built-in model not installed")
    from cflow.serve.ray import APP_NAME, DEPLOYMENT, application

    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = application(functools.partial(BatchGenerator.load, None, parallel=2, threads=1, n_ctx=256), slots=2,
                          replicas=2, options={"model_name": "default.cflow"}, health_check_period_s=2.0)
        serve.run(app, name=APP_NAME, route_prefix="/")
        yield ray, serve, f"http://127.0.0.1:{port}", (APP_NAME, DEPLOYMENT)
    finally:
        serve.shutdown()
        ray.shutdown()


def _running(serve, names) -> int:
    app, dep = names
    st = serve.status().applications[app].deployments[dep]
    return int(st.replica_states.get("RUNNING", 0))


def _spread(url: str, n: int) -> list[tuple[int, str, str]]:
    """n concurrent greedy requests: (status, replica, text) each."""
    def one(i: int) -> tuple[int, str, str]:
        status, headers, body = post(url, {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 8, "temperature": 0})
        h = {k.lower(): v for k, v in headers.items()}
        return status, h.get("x-cflow-replica", ""), body["choices"][0]["text"] if status == 200 else str(body)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(n)))


@pytest.mark.slow
@needs_builtin
def test_two_replicas_share_the_load_and_survive_a_kill(ray_cluster):
    ray, serve, url, names = ray_cluster
    with Engine.load(threads=1, n_ctx=256) as eng:
        want = {p: eng.complete(p, 8, temperature=0).text for p in PROMPTS}
    got = _spread(url, 24)
    assert all(s == 200 for s, _, _ in got), got
    assert all(text == want[PROMPTS[i % len(PROMPTS)]] for i, (_, _, text) in enumerate(got))
    replicas = {r for _, r, _ in got}
    assert len(replicas) == 2, replicas  # both replicas answered

    # kill one replica's actor: the proxy routes around it, and Ray Serve starts a new one
    victim = sorted(replicas)[0]
    named = [a for a in ray.util.list_named_actors(all_namespaces=True) if victim in a["name"]]
    assert len(named) == 1, named
    ray.kill(ray.get_actor(named[0]["name"], namespace=named[0]["namespace"]), no_restart=True)
    after = []
    t_end = time.monotonic() + 60
    while time.monotonic() < t_end and len(after) < 20:
        after += _spread(url, 4)
    assert len(after) >= 20 and all(s == 200 for s, _, _ in after), after
    assert victim not in {r for _, r, _ in after}
    t_end = time.monotonic() + 180
    while time.monotonic() < t_end and _running(serve, names) < 2:
        time.sleep(1)
    assert _running(serve, names) == 2
    seen: set[str] = set()
    t_end = time.monotonic() + 60
    while time.monotonic() < t_end and len(seen) < 2:
        res = _spread(url, 8)
        assert all(s == 200 for s, _, _ in res), res
        seen |= {r for _, r, _ in res}
    assert len(seen) == 2 and victim not in seen and seen != replicas  # the replacement answers too
