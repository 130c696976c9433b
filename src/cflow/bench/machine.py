"""What machine and build a benchmark ran on: CPU model, usable cores, ISA features, versions.

Stamped on every benchmark result so numbers from different runs are never compared blindly.
"""

from __future__ import annotations

import os
import platform
import subprocess
from functools import lru_cache

from cflow.engine import usable_threads


@lru_cache(maxsize=1)
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict:
    """A JSON-able stamp of machine and build."""
    from cflow import __version__

    info = {
        "cpu": cpu_model(),
        "machine": platform.machine(),
        "logical_cpus": os.cpu_count(),
        "usable_cores": usable_threads(),
        "features": sorted(f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni")
                           if f in cpu_flags()),
        "python": platform.python_version(),
        "cflow": __version__,
        "commit": _git_commit(),
    }
    try:
        from cflow import _native

        info["isa"] = _native.isa()
    except (ImportError, AttributeError):
        info["isa"] = None
    return info
