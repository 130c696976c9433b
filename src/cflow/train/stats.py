"""The 95% interval of a mean over seeds, as the family table (cflow.train.compare) and the claims
report's T1 (cflow.bench.claims.t1_train) both state it. No torch: T1 reads a finished table."""

from __future__ import annotations

import math

# Two-sided 95% Student t quantiles by degrees of freedom (scipy is not a dependency).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t95(df: int) -> float:
    """The two-sided 95% Student t quantile for df degrees of freedom (nearest tabulated below)."""
    if df < 1:
        return math.nan
    return _T95[max(k for k in _T95 if k <= df)] if df <= 30 else 1.960


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% t interval); the half-width is nan for one value."""
    n = len(xs)
    if n == 0:
        return math.nan, math.nan
    m = sum(xs) / n
    if n == 1:
        return m, math.nan
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    return m, t95(n - 1) * sd / math.sqrt(n)
