"""The check every quick claims run's report passes (test_claims, test_claims_c1_c4,
test_claims_c5_t1 each run part of the claims once and check their report with it): every claim
in `ids` has a section with its verdict, the paper with its number, this machine's figure, the
commands and its plots (PNGs), a row in the summary table, and report.json says the same."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cflow.bench.claims import core

PNG = b"\x89PNG\r\n\x1a\n"


def check_report(out: Path, ids: list[str], quick: bool) -> dict:
    md = (out / "report.md").read_text()
    data = json.loads((out / "report.json").read_text())
    assert data["quick"] is quick
    assert [c["id"] for c in data["claims"]] == ids
    for c in data["claims"]:
        assert c["verdict"] in core.VERDICTS, c["id"]
        assert c["paper"] and c["paper_number"] and c["reason"] and c["commands"], c["id"]
        assert "traceback" not in c["data"], f"{c['id']} crashed:\n{c['data'].get('traceback')}"
        # its section: heading, verdict, the paper with its number, this machine, the commands
        sec = md.split(f"## {c['id']} — ", 1)[1].split("\n## ", 1)[0]
        assert re.search(rf"\*\*Verdict: {c['verdict']}\*\*", sec), c["id"]
        assert f"**The paper:** {c['paper']} (number: {c['paper_number']})" in sec
        assert "**This machine:**" in sec and c["ours"] in sec
        assert "**Commands:**" in sec and "```bash" in sec and c["commands"][0] in sec
        for p in c["plots"]:
            assert (out / p["file"]).read_bytes()[:8] == PNG, p["file"]
            assert f"]({p['file']})" in sec
        # the summary table's row
        assert re.search(rf"^\| \[{c['id']}\]\(#.*\*\*{c['verdict']}\*\*", md, re.M), c["id"]
    return data
