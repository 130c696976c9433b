"""How many threads the engine runs: the cores this process may use (affinity mask, cgroup CPU
quota), the checks on a requested count, and the tuner that picks the decode thread count from
measured step times."""

from __future__ import annotations

import math
import os

from cflow.runtime.errors import EngineError


def usable_threads() -> int:
    """Cores this process may use: the affinity mask, capped by a cgroup v2/v1 CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time the cgroup allows (None: no quota)."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:  # v2: "max 100000" or "200000 100000"
            q, p = f.read().split()[:2]
        return None if q == "max" else int(q) / int(p)
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            q = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            p = int(f.read())
        return None if q <= 0 else q / p
    except (OSError, ValueError):
        return None


def resolve_threads(threads: int | None, max_threads: int) -> int:
    """The thread count to create the engine with: None or 0 means every usable core. More threads
    than cores is allowed (results do not change) but slow: each token waits for every thread at
    several barriers per layer, so a descheduled thread stalls all the others."""
    if threads is None or threads == 0:
        return usable_threads()
    n = int(threads)
    if n < 0:
        raise EngineError(f"threads must be >= 1 (or 0 for every usable core), got {n}", flag="-t")
    if n > max_threads:
        raise EngineError(f"{n} threads is more than the engine's limit of {max_threads} (its thread pool and "
                          f"per-thread scratch are sized for at most that many); this process may use "
                          f"{usable_threads()} core(s), and more threads than cores only slows decode",
                          flag="-t")
    return n


class ThreadTuner:
    """Chooses how many of the engine's threads each decode step uses, from measured step times.

    Why: a static split over threads needs every thread at every barrier (~150 per token). When
    other processes take cores, a thread whose partner is descheduled waits at each one: on the
    2-core machine shared with one busy process, 2 threads took 5.0 ms per token and 1 thread 3.3
    ms; on an idle machine more threads win. So decode runs with the fastest count measured and
    re-measures the others for a few steps every PROBE_EVERY steps. Outputs do not depend on the
    count (each output row and head is computed identically by whichever thread gets it).
    Only used when the caller did not fix the thread count.
    """

    PROBE_EVERY = 64
    PROBE_STEPS = 3  # the first step of a probe only wakes the threads; it is not timed

    def __init__(self, n: int) -> None:
        self.choices = sorted({n, max(1, n // 2), 1})
        self.best = n
        self.seconds: dict[int, float] = {}  # choice -> smoothed seconds per step
        self.steps = 0
        self._probe, self._left = n, 0

    def pick(self) -> int:
        self.steps += 1
        if not self._left and (self.steps == 8 or self.steps % self.PROBE_EVERY == 0):
            others = [c for c in self.choices if c != self.best]
            self._probe = others[(self.steps // self.PROBE_EVERY) % len(others)]
            self._left = self.PROBE_STEPS
        return self._probe if self._left else self.best

    def record(self, used: int, seconds: float) -> None:
        if self._left:
            self._left -= 1
            if self._left == self.PROBE_STEPS - 1:
                return
        old = self.seconds.get(used)
        self.seconds[used] = seconds if old is None else 0.7 * old + 0.3 * seconds
        if not self._left:
            self.best = min(self.seconds, key=self.seconds.__getitem__)
