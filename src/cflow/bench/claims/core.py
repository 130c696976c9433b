"""What every claim module shares: the result record, the run context, verdict wording, timing and
plotting helpers.

A claim module exposes `ID`, `TITLE` and `run(ctx) -> ClaimResult`; cflow.bench.claims runs them and
cflow.bench.claims.report renders the results. A result always carries a verdict, one of
`confirmed`, `refuted`, `inconclusive`, with the reason in words; a part of a claim that waits on
something not built yet says what in `pending`.
"""

from __future__ import annotations

import math
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

CONFIRMED, REFUTED, INCONCLUSIVE = "confirmed", "refuted", "inconclusive"
VERDICTS = (CONFIRMED, REFUTED, INCONCLUSIVE)


@dataclass
class Table:
    caption: str
    header: list[str]
    rows: list[list[Any]]

    def to_markdown(self) -> str:
        def cell(v: Any) -> str:
            return str(v).replace("|", "\\|").replace("\n", " ")

        lines = [f"*{self.caption}*", "", "| " + " | ".join(cell(h) for h in self.header) + " |",
                 "|" + "|".join("---" if i == 0 else "---:" for i in range(len(self.header))) + "|"]
        lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in self.rows]
        return "\n".join(lines)


@dataclass(frozen=True)
class Rule:
    """A claim's verdict rule, written in code before the run and printed beside the number it judges.

    `statistic` says exactly which number is judged: the quantity, the point of a sweep chosen in
    advance (never the best point), the repetitions and how they combine. `judge` is the only way a
    measured value becomes a verdict: confirmed when it reaches `confirm`, refuted when it is past
    `refute` on the wrong side, inconclusive in between (or when there is no value).
    """

    name: str                # the part of the claim it decides, e.g. "async over sync at I/O = compute"
    statistic: str           # what is judged, e.g. "median over 5 interleaved rounds of async / sync tok/s ..."
    confirm: float           # confirmed at or beyond this
    refute: float            # refuted beyond this on the other side
    higher_is_better: bool = True
    unit: str = "x"

    def __post_init__(self) -> None:
        ordered = self.refute <= self.confirm if self.higher_is_better else self.refute >= self.confirm
        if not ordered:
            raise ValueError(f"rule {self.name!r}: refute {self.refute} is on the confirmed side of {self.confirm}")

    def _fmt(self, v: float) -> str:
        return f"{v:.4g}{self.unit}"

    def text(self) -> str:
        ge, lt = (">=", "<") if self.higher_is_better else ("<=", ">")
        return (f"{self.statistic}: confirmed if {ge} {self._fmt(self.confirm)}, refuted if {lt} "
                f"{self._fmt(self.refute)}, otherwise inconclusive")

    def judge(self, value: float | None) -> tuple[str, str]:
        if value is None or not math.isfinite(value):
            return INCONCLUSIVE, f"{self.name}: not measured"
        sign = 1 if self.higher_is_better else -1
        if sign * value >= sign * self.confirm:
            return CONFIRMED, f"{self.name}: {self._fmt(value)} reaches {self._fmt(self.confirm)}"
        if sign * value < sign * self.refute:
            return REFUTED, f"{self.name}: {self._fmt(value)} is {'below' if sign > 0 else 'above'} {self._fmt(self.refute)}"
        return INCONCLUSIVE, (f"{self.name}: {self._fmt(value)} is between {self._fmt(self.refute)} (refuted) and "
                              f"{self._fmt(self.confirm)} (confirmed)")


@dataclass
class ClaimResult:
    id: str                      # "C1" .. "C8", "T1"
    title: str
    paper: str                   # what the paper says, in words, with its number
    paper_number: str            # the number alone (the summary table's column)
    ours: str = ""               # what this machine shows, one or two sentences
    ours_number: str = ""        # the number alone
    verdict: str = INCONCLUSIVE
    reason: str = ""
    commands: list[str] = field(default_factory=list)   # exact commands that reproduce it
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)      # paragraphs
    plots: list[tuple[str, str]] = field(default_factory=list)  # (file in the report dir, caption)
    parts: list[dict[str, str]] = field(default_factory=list)   # sub-findings: name, verdict, reason
    # every Rule this run judged: name, rule (its text), value, verdict, reason, control (True: an input
    # built to fail the rule, judged to show the rule can say refuted)
    judged: list[dict[str, Any]] = field(default_factory=list)
    pending: str | None = None   # what a part that cannot be measured yet waits on
    measured: str = "measured"   # "measured" | "analytic" | "pending" | "partial" | "failed"
    data: dict[str, Any] = field(default_factory=dict)
    quick: bool = False
    duration_s: float = 0.0
    date: str = ""               # when this claim ran (a merged report holds sections of several runs)
    commit: str = ""             # the cflow commit it ran on

    def apply(self, rule: Rule, value: float | None, control: bool = False) -> tuple[str, str]:
        """Judge `value` by `rule` and record it (the report prints every judged rule beside its
        value); returns (verdict, reason). control=True marks an input built to fail the rule."""
        verdict, reason = rule.judge(value)
        self.judged.append({"name": rule.name, "rule": rule.text(), "value": value, "unit": rule.unit,
                            "verdict": verdict, "reason": reason, "control": control})
        return verdict, reason

    def check(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"{self.id}: verdict {self.verdict!r} is not one of {VERDICTS}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tables"] = [asdict(t) for t in self.tables]
        d["plots"] = [{"file": f, "caption": c} for f, c in self.plots]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ClaimResult":
        """The inverse of to_dict (a section kept from an earlier report.json)."""
        known = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in d.items() if k in known}
        kw["tables"] = [Table(t["caption"], list(t["header"]), [list(r) for r in t["rows"]])
                        for t in d.get("tables", [])]
        kw["plots"] = [(p["file"], p["caption"]) for p in d.get("plots", [])]
        res = cls(**kw)
        res.check()
        return res


@dataclass
class Context:
    out: Path                    # the report directory (plots go here)
    work: Path                   # scratch space for models and inputs, deleted after the run
    quick: bool
    threads: int
    progress: Callable[[str], None] | None = None
    claims_command: str = "cflow bench claims"
    commit: str = ""             # the cflow commit being measured (stamped on each result)

    def log(self, claim: str, msg: str) -> None:
        if self.progress:
            self.progress(f"[{claim}] {msg}")

    def rerun(self, claim_id: str) -> str:
        """The command that re-runs just this claim in the same mode."""
        return f"cflow bench claims --only {claim_id}" + (" --quick" if self.quick else "") + " --out DIR"


def quick_verdict(ctx: Context, verdict: str, reason: str, what: str) -> tuple[str, str]:
    """Timing-based verdicts are not given on a quick run: the numbers are reported, the verdict is
    inconclusive, and the reason says what the full run's rule would have said."""
    if not ctx.quick:
        return verdict, reason
    return INCONCLUSIVE, (f"quick run ({what}): a smoke test, not a measurement to judge by; "
                          f"on these numbers the full run's rule would say {verdict}: {reason}")


# ---- statistics ------------------------------------------------------------------------------
def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def sd(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def pm(xs: list[float], fmt: str = ".2f") -> str:
    return f"{mean(xs):{fmt}} ± {sd(xs):{fmt}}" if len(xs) > 1 else f"{mean(xs):{fmt}}"


def interleaved(fns: dict[str, Callable[[], float]], reps: int, warmup: int = 1,
                log: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Call every fn once per repetition, alternating, so drift of a shared machine hits all alike;
    the first `warmup` rounds are dropped."""
    out: dict[str, list[float]] = {k: [] for k in fns}
    for rep in range(warmup + reps):
        for k, fn in fns.items():
            v = fn()
            if rep >= warmup:
                out[k].append(v)
                if log:
                    log(f"{k} rep {rep - warmup + 1}/{reps}: {v:.4g}")
    return out


def decode_tps(engine: Any, n: int, first: int = 5, prompt: list[int] | None = None) -> float:
    """Tokens/s of n greedy decode steps (after an optional prompt, untimed)."""
    engine.reset()
    pos = 0
    tok = first
    if prompt:
        logits = engine.prefill(prompt)
        pos = len(prompt)
        tok = int(logits.argmax())
    t0 = time.perf_counter()
    for i in range(n):
        tok = int(engine.step(tok, pos + i).argmax())
    return n / (time.perf_counter() - t0)


def forced_tps(engine: Any, n: int, seed: int = 0) -> float:
    """Tokens/s of n decode steps fed random token ids (teacher-forced, not greedy): a random-weight
    model fed its own argmax soon repeats one token, which routes every step to the same experts."""
    import numpy as np

    toks = np.random.default_rng(seed).integers(0, engine.config.vocab_size, n)
    engine.reset()
    t0 = time.perf_counter()
    for pos, t in enumerate(toks):
        engine.step(int(t), pos)
    return n / (time.perf_counter() - t0)


# ---- plots and commands ----------------------------------------------------------------------
def pyplot():
    """matplotlib.pyplot with the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(fig: Any, path: Path) -> None:
    plt = pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def shell(argv: list[str]) -> str:
    return " ".join(shlex.quote(str(a)) for a in argv)


def python_cmd() -> str:
    return Path(sys.executable).name if Path(sys.executable).name.startswith("python") else "python"


def fmt_bytes(n: float) -> str:
    """Decimal units, as everywhere in cflow."""
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n:.0f} B"


def signature_has(fn: Any, *names: str) -> bool:
    """Whether `fn` takes every keyword in `names`: its own parameters, and when it takes
    `options` plus **overrides (Engine.load, bench), every field of EngineOptions."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    accepted = set(params)
    if "options" in params and any(p.kind is p.VAR_KEYWORD for p in params.values()):
        from cflow.runtime.options import EngineOptions

        accepted |= set(EngineOptions.names())
    return all(n in accepted for n in names)
