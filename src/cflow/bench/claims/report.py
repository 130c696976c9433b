"""report.md and report.json of a claims run: one section per claim (the paper's statement and
number, what this machine shows, the commands, the verdict and its reason, tables, plots)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from cflow.bench.claims.core import ClaimResult

REPORT_MD = "report.md"
REPORT_JSON = "report.json"


def _clean(v: Any) -> Any:
    """JSON has no NaN/inf: they become null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if hasattr(v, "item") and callable(v.item):  # numpy scalars
        return _clean(v.item())
    return v


def to_json(results: list[ClaimResult], meta: dict[str, Any]) -> str:
    return json.dumps(_clean({**meta, "claims": [r.to_dict() for r in results]}), indent=1) + "\n"


def _section(r: ClaimResult) -> list[str]:
    lines = [f"## {r.id} — {r.title}", "",
             f"**Verdict: {r.verdict}**" + (" (quick run)" if r.quick else "") + f" — {r.reason}", "",
             f"**The paper:** {r.paper} (number: {r.paper_number})", "",
             f"**This machine:** {r.ours}" + (f" (number: {r.ours_number})" if r.ours_number else ""), ""]
    if r.pending:
        lines += [f"**Pending:** {r.pending}", ""]
    lines += ["**Commands:**", "", "```bash", *r.commands, "```", ""]
    if r.judged:
        lines += ["| rule, fixed in code before the run | value | verdict |", "|---|---:|---|"]
        for j in r.judged:
            v = "–" if j["value"] is None else f"{j['value']:.4g}{j['unit']}"
            if j["control"]:  # the rule's text is on its own row already
                what = f"{j['name']} (control: an input built to fail it)"
            else:
                what = f"**{j['name']}**: {j['rule'].replace('|', '/')}"
            lines.append(f"| {what} | {v} | {j['verdict']} |")
        lines.append("")
    if r.parts:
        lines += ["| part | verdict | why |", "|---|---|---|"]
        lines += [f"| {p['name']} | {p['verdict']} | {p['reason'].replace('|', '/')} |" for p in r.parts]
        lines.append("")
    for t in r.tables:
        lines += [t.to_markdown(), ""]
    for f, caption in r.plots:
        lines += [f"![{caption}]({f})", "", f"*{caption}*", ""]
    for n in r.notes:
        lines += [n, ""]
    when = (f" on {r.date}" if r.date else "") + (f", commit {r.commit}" if r.commit else "")
    lines += [f"<sub>{r.id}: {r.measured}; ran in {r.duration_s:.1f} s{when}.</sub>", ""]
    return lines


def to_markdown(results: list[ClaimResult], meta: dict[str, Any]) -> str:
    m = meta.get("machine", {})
    quick = meta.get("quick")
    lines = ["# The paper's claims, re-measured on this machine", ""]
    if quick:
        lines += ["> **Quick run** (`--quick`): a smoke test with tiny models and few repetitions. Timing-based "
                  "verdicts are *inconclusive* by design; the reasons say what the full run's rules would conclude "
                  "from these numbers. Run without `--quick` on an idle machine for the real report.", ""]
    lines += [f"Command: `{meta.get('command')}`  ",
              f"Date: {meta.get('date')}; took {meta.get('duration_s', 0):.0f} s.  ",
              *([f"Kept from earlier runs of this report: {', '.join(meta['kept'])} (each section's footer gives "
                 f"the date and commit it was measured on).  "] if meta.get("kept") else []),
              f"Machine: {m.get('cpu')}, {m.get('usable_cores')} usable cores, kernels {m.get('isa')}, "
              f"cflow {m.get('cflow')} (commit {m.get('commit')}), Python {m.get('python')}.", "",
              "The paper is \"Pipeline-Native Transformers: Co-Designing Model Architecture and CPU Inference for "
              "Bandwidth-Efficient Autoregressive Decode\". Ratios are measured side by "
              "side in one run; absolute times on a shared machine drift.", "",
              "| claim | the paper | this machine | verdict | status |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| [{r.id}](#{_anchor(r)}) {r.title} | {r.paper_number} | {r.ours_number or '–'} | "
                     f"**{r.verdict}** | {r.measured}{' (pending: see section)' if r.pending else ''} |")
    lines.append("")
    for r in results:
        lines += _section(r)
    return "\n".join(lines).rstrip() + "\n"


def _anchor(r: ClaimResult) -> str:
    text = f"{r.id} — {r.title}".lower()
    keep = "".join(c for c in text if c.isalnum() or c in " -_")
    return keep.replace(" ", "-")


def write(out: Path, results: list[ClaimResult], meta: dict[str, Any]) -> tuple[Path, Path]:
    from cflow.fsutil import atomic_write_text, writing

    out.mkdir(parents=True, exist_ok=True)
    md, js = out / REPORT_MD, out / REPORT_JSON
    with writing(js):
        atomic_write_text(js, to_json(results, meta))
    with writing(md):
        atomic_write_text(md, to_markdown(results, meta))
    return md, js


def load(out: Path) -> dict[str, Any]:
    return json.loads((Path(out) / REPORT_JSON).read_text())
