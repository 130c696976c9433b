"""`cflow bench claims`: the report of the paper's claims is produced and well formed.

A quick run is the smoke test a CI can afford: every claim's experiment runs on tiny inputs and its
section must render with the paper's number, ours, the commands and a verdict; report.json must
parse and name the same; every plot the report links must be a PNG (claims_report.check_report).
Each claim's quick run happens once in the suite: C3 and T1 here through the command line, C1-C4
and C5-T1 in their own modules beside their rules. Claims whose tools are missing here (llama.cpp,
valgrind, torch, the SmolLM2 GGUF) still get a section, inconclusive, saying what is missing: what
must never happen is an experiment crashing.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from cflow.bench.claims import core, report
from cflow.bench.claims.runner import CLAIMS, parse_only, run_claims

from claims_report import check_report


def cflow(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cflow", *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env=env)


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    """A quick run of C3 and T1 through the command line, once for the module: T1 with no family
    table to read, so its smoke training runs. Every other claim's quick run, and each claim's
    exact parts, are checked where its rules are (test_claims_c1_c4, test_claims_c5_t1)."""
    import os

    out = tmp_path_factory.mktemp("claims")
    env = dict(os.environ, CFLOW_CACHE=str(tmp_path_factory.mktemp("cache")))
    env.pop("CFLOW_CLAIMS_FAMILY", None)
    r = cflow("bench", "claims", "--quick", "--only", "C3,T1", "--out", str(out), env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


def test_quick_run_writes_a_well_formed_report(quick_report):
    out, r = quick_report
    data = check_report(out, ["C3", "T1"], quick=True)
    assert "Quick run" in (out / "report.md").read_text()
    # progress went to stderr, the verdict list to stdout
    assert "[C3]" in r.stderr and "[T1]" in r.stderr
    for c in data["claims"]:
        assert re.search(rf"^{c['id']}\s+{c['verdict']}\s", r.stdout, re.M), r.stdout


def test_quick_run_what_is_exact_holds(quick_report):
    """The parts that are arithmetic or exact counting give their answer even in a quick run; a
    smoke training gives no verdict."""
    out, _ = quick_report
    claims = {c["id"]: c for c in json.loads((out / "report.json").read_text())["claims"]}
    ram = claims["C3"]["data"]["ram"]
    assert all(r["measured_over_analytic"] == 1.0 for r in ram)
    assert any(r["E"] == 64 and r["all_over_measured"] == 16.0 for r in ram)
    assert claims["T1"]["data"]["smoke"] is True and claims["T1"]["verdict"] == core.INCONCLUSIVE


def test_only_runs_the_named_claims_through_the_cli(tmp_path):
    r = cflow("bench", "claims", "--quick", "--only", "c1,C3", "--out", str(tmp_path), "-q")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # -q
    check_report(tmp_path, ["C1", "C3"], quick=True)
    assert (tmp_path / "c1_dag.png").is_file()


def test_cli_errors_are_one_line(tmp_path):
    r = cflow("bench", "claims", "--only", "C9", "--out", str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--only: unknown claim C9" in r.stderr
    r = cflow("bench")  # the llama-bench form still needs a model
    assert r.returncode == 2 and "-m" in r.stderr and "Traceback" not in r.stderr


def test_parse_only():
    assert parse_only(None) == list(CLAIMS)
    assert parse_only("t1, c2") == ["C2", "T1"]  # report order, any case
    with pytest.raises(ValueError, match="unknown claim"):
        parse_only(["C1", "X"])


def test_pending_disk_mode_is_said_not_skipped(tmp_path, monkeypatch):
    """Without disk residency, C5 says what it waits on, with verdict inconclusive."""
    from cflow.bench.claims import c5_async_io

    monkeypatch.setattr(c5_async_io, "disk_mode_available", lambda: (False, "Engine.load has no experts= yet"))
    res = run_claims(tmp_path, quick=True, only="C5")
    assert res[0].verdict == core.INCONCLUSIVE and res[0].measured == "pending"
    md = (tmp_path / "report.md").read_text()
    assert "**Pending:** pending: Engine.load has no experts= yet" in md


def test_a_crashing_experiment_still_gets_a_section(tmp_path, monkeypatch):
    from cflow.bench.claims import c8_vflow

    def boom(ctx):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(c8_vflow, "run", boom)
    res = run_claims(tmp_path, quick=True, only="C1,C8")
    assert [r.id for r in res] == ["C1", "C8"]
    assert res[1].verdict == core.INCONCLUSIVE and res[1].measured == "failed"
    md = (tmp_path / "report.md").read_text()
    assert "## C8 — " in md and "the experiment failed: RuntimeError: disk on fire" in md
    assert json.loads((tmp_path / "report.json").read_text())["claims"][1]["data"]["error"].endswith("disk on fire")


def test_every_claim_renders_from_a_result(tmp_path):
    """Rendering alone: each claim id with a table, a part, a note, a pending line; NaN becomes null."""
    results = [core.ClaimResult(cid, f"title {cid}", paper=f"paper says {cid}", paper_number="7.29x", ours="ours",
                                ours_number="1.0x", verdict=v, reason="because", commands=["cflow x"],
                                tables=[core.Table("t", ["a|b", "c"], [[1, "x|y"]])],
                                parts=[{"name": "p", "verdict": v, "reason": "r"}], notes=["n"],
                                pending="disk residency" if cid == "C5" else None, data={"x": float("nan")})
               for cid, v in zip(CLAIMS, list(core.VERDICTS) * 3)]
    report.write(tmp_path, results, {"command": "c", "quick": False, "machine": {}, "date": "d", "duration_s": 1})
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["claims"][0]["data"]["x"] is None
    md = (tmp_path / "report.md").read_text()
    for r in results:
        assert f"## {r.id} — title {r.id}" in md and f"**Verdict: {r.verdict}**" in md
    assert "| a\\|b | c |" in md and "| 1 | x\\|y |" in md
    assert "**Pending:** disk residency" in md


def test_cachegrind_output_is_read_per_function(tmp_path):
    from cflow.bench.claims.c2_tiles import parse_cachegrind

    f = tmp_path / "cg.out"
    f.write_text("desc: I1 cache: 32768 B\ncmd: x\nevents: Ir I1mr ILmr Dr D1mr DLmr Dw D1mw DLmw\nfl=a.c\n"
                 "fn=main\n0 5 1 1 2 1 1 0 0 0\nfn=mv_q8_tiled\n0 100 0 0 40 7 3 1 0 0\n12 10 0 0 4 2 0 0 0 0\n"
                 "fl=b.c\nfn=memcpy\n0 9 9 9 9 9 9 9 9 9\nsummary: 124 10 10 55 19 13 10 9 9\n")
    got = parse_cachegrind(f, "mv_q8_tiled")
    assert got["Ir"] == 110 and got["D1mr"] == 9 and got["Dr"] == 44
    with pytest.raises(RuntimeError):
        parse_cachegrind(f, "mv_f32_rows")


def test_c2_without_its_tools_says_so(tmp_path, monkeypatch):
    """No valgrind and no hardware counters (a minimal CI image): a section saying so, not a crash."""
    from cflow.bench.claims import c2_tiles

    monkeypatch.setattr(c2_tiles.shutil, "which", lambda name: None)
    res = run_claims(tmp_path, quick=True, only="C2")
    assert res[0].verdict == core.INCONCLUSIVE and res[0].measured == "failed"
    assert "valgrind" in res[0].reason and "traceback" not in res[0].data


def test_rule_judges_both_ways_and_says_why():
    up = core.Rule("speedup", "median of 5 rounds of new / old", confirm=1.5, refute=1.1)
    assert up.judge(1.5)[0] == core.CONFIRMED and up.judge(1.09)[0] == core.REFUTED
    assert up.judge(1.2)[0] == core.INCONCLUSIVE and up.judge(None)[0] == core.INCONCLUSIVE
    assert up.judge(float("nan"))[0] == core.INCONCLUSIVE
    down = core.Rule("cost", "mean slowdown", confirm=0.02, refute=0.05, higher_is_better=False, unit="")
    assert down.judge(0.01)[0] == core.CONFIRMED and down.judge(0.06)[0] == core.REFUTED
    assert down.judge(0.03)[0] == core.INCONCLUSIVE
    assert "confirmed if >= 1.5x, refuted if < 1.1x" in up.text()
    assert "confirmed if <= 0.02, refuted if > 0.05" in down.text()
    with pytest.raises(ValueError, match="on the confirmed side"):
        core.Rule("bad", "x", confirm=1.0, refute=2.0)


def test_judged_rules_are_printed_beside_their_values(tmp_path):
    res = core.ClaimResult(id="C5", title="t", paper="p", paper_number="1.68x", ours="o", reason="r",
                           commands=["cflow x"])
    rule = core.Rule("async over sync", "median async / sync", confirm=1.5, refute=1.1)
    assert res.apply(rule, 1.62) == (core.CONFIRMED, "async over sync: 1.62x reaches 1.5x")
    assert res.apply(rule, 1.0, control=True)[0] == core.REFUTED
    res.verdict = core.CONFIRMED
    report.write(tmp_path, [res], {"command": "c", "quick": False, "machine": {}, "date": "d", "duration_s": 1})
    md = (tmp_path / "report.md").read_text()
    assert "| **async over sync**: median async / sync: confirmed if >= 1.5x" in md and "| 1.62x | confirmed |" in md
    assert "(control: an input built to fail it)" in md and "| 1x | refuted |" in md
    again = core.ClaimResult.from_dict(json.loads((tmp_path / "report.json").read_text())["claims"][0])
    assert again.judged == res.judged
