"""What machine and build a benchmark ran on: CPU model, usable cores, ISA features, versions.

Stamped on every benchmark result so numbers from different runs are never compared blindly.
"""

from __future__ import annotations

import os
import platform
import subprocess
from functools import lru_cache


def usable_cores() -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup v2/v1 CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        n = max(1, min(n, int(quota + 0.5)))
    return n


def _cgroup_cpu_quota() -> float | None:
    try:  # cgroup v2: "max 100000" or "200000 100000"
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota_us = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period_us = int(f.read())
        if quota_us > 0:
            return quota_us / period_us
    except (OSError, ValueError):
        pass
    return None


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
        "usable_cores": usable_cores(),
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
