"""Load time, time to first token and resident memory of one engine, measured in a fresh process.

A fresh interpreter keeps the numbers honest: nothing else (a baseline, an earlier engine) sits in
the address space. `measure_in_subprocess` starts one (`python -c`) that calls `measure` and hands the
result back as JSON on its stdout; this module itself prints nothing.

Resident memory is split the way users misread it least: the process before loading (Python,
numpy, the C core), right after loading (mapped: almost nothing is paged in yet; copied into
2 MiB pages, cflow.runtime.pages: every weight), and after the first token (every weight page
touched once). The budget we hold ourselves to is
file size + KV cache + < 50 MB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

PROMPT = "Once upon a time, there was a little"


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(model: str, threads: int, n_ctx: int | None = None, verify: bool = True,
            hugepages: bool = True) -> dict:
    from cflow.runtime import Engine
    from cflow.runtime.kvcache import cache_bytes

    rss0 = _rss_bytes()
    t0 = time.perf_counter()
    eng = Engine.load(model, threads=threads, n_ctx=n_ctx, verify=verify, hugepages=hugepages)
    load_s = time.perf_counter() - t0
    rss_loaded = _rss_bytes()
    cfg = eng.config
    kv_bytes = cache_bytes(cfg, eng.n_ctx, eng.cache_type_k, eng.cache_type_v)  # K and V
    t1 = time.perf_counter()
    first = next(iter(eng.generate(PROMPT, max_tokens=1, temperature=0.0)), "")
    ttft_s = time.perf_counter() - t1
    return {
        "model": model, "threads": threads, "n_ctx": eng.n_ctx,
        "file_bytes": os.path.getsize(eng.path), "kv_cache_bytes": kv_bytes,
        "load_s": load_s, "ttft_s": ttft_s, "prompt_tokens": eng.last_prompt_len,
        "first_token": first, "weights": eng.weights_memory()["placement"],
        "rss_before_load": rss0, "rss_after_load": rss_loaded, "rss_after_first_token": _rss_bytes(),
    }


# The child's whole program: its arguments arrive as a JSON list on stdin, its result leaves as JSON.
_CHILD = ("import json, sys; from cflow.bench.footprint import measure; "
          "print(json.dumps(measure(*json.load(sys.stdin))))")


def measure_in_subprocess(model: str, threads: int, n_ctx: int | None = None, verify: bool = True,
                          hugepages: bool = True) -> dict:
    """`measure` in a fresh interpreter."""
    args = json.dumps([str(model), int(threads), n_ctx, bool(verify), bool(hugepages)])
    out = subprocess.run([sys.executable, "-c", _CHILD], input=args, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        from cflow.errors import CflowError

        raise CflowError(f"footprint measurement failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
