"""What machine and build a benchmark ran on: CPU model, usable cores, ISA features (as the C core's
dispatcher probed them), versions.

Stamped on every benchmark result so numbers from different runs are never compared blindly.
"""

from __future__ import annotations

import os
import platform
import subprocess
from functools import lru_cache

from cflow.runtime import usable_threads


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


def cpu_features() -> list[str]:
    """The ISA features the C core's dispatcher probed (what chooses its kernels), those present."""
    try:
        from cflow import _native

        return sorted(name for name, present in _native.cpu_features().items() if present)
    except (ImportError, AttributeError):  # no compiled core: no kernels to choose either
        return []


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
        "features": cpu_features(),
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
