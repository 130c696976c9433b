"""`cflow bench claims --only X` re-measures X and keeps the other sections of the report it updates.

T1 alone trains for about an hour, so the committed report is built in pieces: each section must say
when and on which commit it was measured, and a quick run must never be mixed into a full report.
The experiments here are stand-ins (monkeypatched `run`), so these tests take milliseconds.
"""

from __future__ import annotations

import json

import pytest

from cflow.bench.claims import c1_dag, c3_experts, core
from cflow.bench.claims.runner import ClaimsError, run_claims


def fake(claim_id: str, number: str):
    def run(ctx):
        return core.ClaimResult(claim_id, f"title {claim_id}", paper="p", paper_number="x", ours=f"ours {number}",
                                ours_number=number, verdict=core.CONFIRMED, reason="r", commands=[ctx.rerun(claim_id)],
                                tables=[core.Table("cap", ["a", "b"], [[1, number]])], data={"n": number})
    return run


@pytest.fixture
def fakes(monkeypatch):
    def use(c1: str, c3: str) -> None:
        monkeypatch.setattr(c1_dag, "run", fake("C1", c1))
        monkeypatch.setattr(c3_experts, "run", fake("C3", c3))
    return use


def claims(out) -> dict:
    return {c["id"]: c for c in json.loads((out / "report.json").read_text())["claims"]}


def test_only_keeps_the_other_sections(tmp_path, fakes):
    fakes("first", "first")
    run_claims(tmp_path, only="C1,C3")
    fakes("second", "second")
    run_claims(tmp_path, only="C3")
    got = claims(tmp_path)
    assert list(got) == ["C1", "C3"]  # report order, not run order
    assert got["C1"]["ours_number"] == "first" and got["C3"]["ours_number"] == "second"
    assert got["C1"]["tables"][0]["rows"] == [[1, "first"]]  # the kept section round-trips whole
    md = (tmp_path / "report.md").read_text()
    assert "ours first" in md and "ours second" in md and "ours first (number: first)" in md
    assert "Kept from earlier runs of this report: C1" in md
    assert all(c["date"] for c in got.values())  # every section says when it ran
    assert json.loads((tmp_path / "report.json").read_text())["kept"] == ["C1"]


def test_no_merge_replaces(tmp_path, fakes):
    fakes("first", "first")
    run_claims(tmp_path, only="C1,C3")
    run_claims(tmp_path, only="C3", merge=False)
    assert list(claims(tmp_path)) == ["C3"]


def test_quick_and_full_reports_are_never_mixed(tmp_path, fakes):
    fakes("full", "full")
    run_claims(tmp_path, only="C1,C3")
    said = []
    run_claims(tmp_path, only="C3", quick=True, progress=said.append)
    assert list(claims(tmp_path)) == ["C3"]
    assert any("not merging" in s and "full report" in s for s in said)


def test_a_damaged_report_stops_the_run_before_measuring(tmp_path, fakes, monkeypatch):
    (tmp_path / "report.json").write_text("{not json")
    ran = []
    monkeypatch.setattr(c3_experts, "run", lambda ctx: ran.append(1))
    with pytest.raises(ClaimsError, match="cannot merge with .*report.json.*--no-merge"):
        run_claims(tmp_path, only="C3")
    assert ran == []
    assert (tmp_path / "report.json").read_text() == "{not json"  # nothing overwritten


def test_committed_report_sections_load():
    """The committed docs/claims/report.json must stay mergeable (a later `--only T1` keeps the rest)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "docs" / "claims" / "report.json"
    for d in json.loads(path.read_text())["claims"]:
        r = core.ClaimResult.from_dict(d)
        assert r.id == d["id"] and r.verdict in core.VERDICTS
