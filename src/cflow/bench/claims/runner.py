"""The claims run: the registry of claim modules, running each with its failures caught, and the
report written at the end (cflow.bench.claims.report). `cflow bench claims` calls `run_claims`."""

from __future__ import annotations

import datetime as _dt
import importlib
import json
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Sequence

from cflow.bench.claims.core import INCONCLUSIVE, ClaimResult, Context
from cflow.errors import CflowError

CLAIMS = {"C1": "c1_dag", "C2": "c2_tiles", "C3": "c3_experts", "C4": "c4_llamacpp", "C5": "c5_async_io",
          "C6": "c6_prefetch", "C7": "c7_parity", "C8": "c8_vflow", "T1": "t1_train"}


class ClaimsError(CflowError, ValueError):
    """The claims run was asked for something it cannot do (an unknown claim id)."""


def parse_only(only: str | Sequence[str] | None) -> list[str]:
    """Claim ids from "C1,c3" or a list; every claim when None or empty."""
    if not only:
        return list(CLAIMS)
    items = only.split(",") if isinstance(only, str) else list(only)
    ids = [s.strip().upper() for s in items if s.strip()]
    bad = [i for i in ids if i not in CLAIMS]
    if bad:
        raise ClaimsError(f"unknown claim {', '.join(bad)}; choose from {','.join(CLAIMS)}")
    return [i for i in CLAIMS if i in ids]  # report order


def run_claim(claim_id: str, ctx: Context) -> ClaimResult:
    mod = importlib.import_module(f"cflow.bench.claims.{CLAIMS[claim_id]}")
    t0 = time.perf_counter()
    ctx.log(claim_id, f"{mod.TITLE} ...")
    try:
        res = mod.run(ctx)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # the report still gets a section saying what broke
        res = ClaimResult(claim_id, mod.TITLE, paper=getattr(mod, "PAPER", "(not stated)"),
                          paper_number=getattr(mod, "PAPER_NUMBER", "–"), ours="the experiment failed",
                          verdict=INCONCLUSIVE, reason=f"the experiment failed: {type(e).__name__}: {e}",
                          commands=[ctx.rerun(claim_id)], measured="failed",
                          data={"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        ctx.log(claim_id, f"FAILED: {type(e).__name__}: {e}")
    res.quick = ctx.quick
    res.duration_s = time.perf_counter() - t0
    res.date = _dt.datetime.now().isoformat(timespec="seconds")
    res.commit = ctx.commit
    res.check()
    ctx.log(claim_id, f"verdict {res.verdict} ({res.duration_s:.1f} s)")
    return res


def kept_sections(out: Path, ids: Sequence[str], quick: bool,
                  progress: Callable[[str], None] | None = None) -> list[ClaimResult]:
    """The sections of an earlier DIR/report.json that this run does not re-measure, so that
    `--only T1` updates one claim of a report instead of replacing it. A quick report and a full one
    are never mixed (a quick run's verdicts are inconclusive by design). Checked before measuring:
    a damaged report.json stops the run here, not after an hour."""
    from cflow.bench.claims.report import REPORT_JSON

    path = Path(out) / REPORT_JSON
    if not path.exists():
        return []
    try:
        old = json.loads(path.read_text())
        if bool(old.get("quick")) != bool(quick):
            if progress:
                progress(f"not merging with {path}: it is a {'quick' if old.get('quick') else 'full'} report "
                         f"and this is a {'quick' if quick else 'full'} run; it will be replaced")
            return []
        kept = []
        for d in old.get("claims", []):
            if d.get("id") in CLAIMS and d["id"] not in ids:
                r = ClaimResult.from_dict(d)
                r.date = r.date or str(old.get("date", ""))
                r.commit = r.commit or str(old.get("machine", {}).get("commit", ""))
                kept.append(r)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ClaimsError(f"cannot merge with {path}: {type(e).__name__}: {e}; fix or delete it, or pass "
                          f"--no-merge to replace the report") from None
    return kept


def run_claims(out: str | Path = "docs/claims", *, quick: bool = False, only: str | Sequence[str] | None = None,
               threads: int | None = None, progress: Callable[[str], None] | None = None,
               command: str | None = None, merge: bool = True) -> list[ClaimResult]:
    """Run the claims' experiments and write DIR/report.md, DIR/report.json and the plots. With
    `only` and `merge` (the default), the other claims' sections of an existing report are kept."""
    from cflow.bench.claims import report
    from cflow.bench.machine import machine_info
    from cflow.fsutil import check_writable
    from cflow.runtime import usable_threads

    ids = parse_only(only)
    out = Path(out)
    check_writable(out)  # before an hour of measuring, not after
    kept = kept_sections(out, ids, quick, progress) if merge and only else []
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    command = command or ("cflow bench claims" + (" --quick" if quick else "")
                          + (f" --only {','.join(ids)}" if only else "") + f" --out {out}")
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="cflow-claims-"))
    results: list[ClaimResult] = []
    try:
        # A quick run uses one thread unless told otherwise: it is a smoke test that may share the machine,
        # and spin barriers across threads degrade badly when another process holds a core.
        ctx = Context(out=out, work=work, quick=quick, threads=threads or (1 if quick else usable_threads()),
                      progress=progress, commit=str(machine.get("commit", "")))
        for cid in ids:
            results.append(run_claim(cid, ctx))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    meta = {"command": command, "quick": quick, "only": ids, "kept": [r.id for r in kept],
            "date": _dt.datetime.now().isoformat(timespec="seconds"), "duration_s": time.perf_counter() - t0,
            "machine": machine, "threads": ctx.threads}
    order = list(CLAIMS)
    report.write(out, sorted(results + kept, key=lambda r: order.index(r.id)), meta)
    if progress:
        progress(f"wrote {out / report.REPORT_MD} and {out / report.REPORT_JSON} ({meta['duration_s']:.0f} s)")
    return results


__all__ = ["CLAIMS", "ClaimResult", "ClaimsError", "parse_only", "run_claims"]
