"""Claims C5-C8 and T1 judge by rules fixed in code before the run, and each rule can say refuted.

One quick run of the five (about a minute and a half on 2 cores) is shared: every module-level Rule
of a claim must be judged on a measured value and on a control (an input built to fail it) whose
verdict is refuted (C5's timed controls: never confirmed, see QUICK_TIMED_CONTROLS), and the report
must print the rule beside the value. The judged value must be
the statistic the rule names (C5: the budget chosen from the sync calibration, not the best async
point; C6: default against off, not the best distance; C8: the default variant). T1 is judged from a
family table in the format `cflow train compare` writes (a fixture written here through its own
writer), and says what to run when there is none. Claims whose tools are missing here (the SmolLM2
GGUF, llama.cpp, transformers, torch, disk residency) are skipped, as in tests/test_claims.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import statistics
from pathlib import Path

import pytest

from cflow.bench.claims import core
from cflow.bench.claims.runner import CLAIMS, run_claims

from claims_report import check_report

IDS = ("C5", "C6", "C7", "C8", "T1")
# C5's controls are tok/s ratios with every expert cached (nothing to overlap: 1.0 by construction),
# and a quick run times them over 8 rounds of 32 tokens of a tiny model, milliseconds a round: on
# the 2-core VMs the one-read control measured 0.90, 0.90, 0.93 and 1.10 in four runs (2026-12-05),
# so a refute bound of 1.1 is a coin toss there and a unit test must not assert it (timings are the
# benchmark's: the full run's report judges the controls). What a quick run can assert: noise never
# confirms an effect that cannot exist (>= 1.3x / 1.5x).
QUICK_TIMED_CONTROLS = {"C5"}
HAVE_TORCH = importlib.util.find_spec("torch") is not None


def module(cid: str):
    return importlib.import_module(f"cflow.bench.claims.{CLAIMS[cid]}")


def family_fixture(path: Path, diffs: dict[str, list[float]], ref_losses=(3.56, 3.55, 3.57)) -> Path:
    """A family table written by cflow.train.compare's own writer: arch1 and the presets in `diffs`,
    one run per seed, each preset's final loss arch1's of the seed plus its difference."""
    pytest.importorskip("torch")
    from cflow.config import ModelConfig
    from cflow.train.compare import RunSummary, write_report
    from cflow.train.loop import TrainConfig

    runs = []
    for seed, ref in enumerate(ref_losses, 1):
        for preset, ds in {"arch1": [0.0] * len(ref_losses), **diffs}.items():
            loss = ref + ds[seed - 1]
            runs.append(RunSummary(preset=preset, params=1000, steps=10, tokens=40960, val_loss=loss,
                                   val_ppl=math.exp(loss), val_acc=0.25, train_s=1.0, tok_per_s=40960.0, dag=None,
                                   curve=[(4096, 8.0), (40960, loss)], warmup=1,
                                   val_curve=[(4096, loss + 1.5), (40960, loss)],
                                   config=ModelConfig.from_name(preset).to_dict(), seed=seed))
    write_report(runs, path, base=TrainConfig(batch_size=16, seq_len=256), tokens=40960, minutes_per_run=None,
                 overrides=[], command="cflow train compare (test fixture)")
    return path / "train_compare.json"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The quick run of C5-C8 and T1, once; T1 reads a fixture family table (competitive)."""
    out = tmp_path_factory.mktemp("claims_c5_t1")
    old = {k: os.environ.get(k) for k in ("CFLOW_CACHE", "CFLOW_CLAIMS_FAMILY")}
    os.environ["CFLOW_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    if HAVE_TORCH:
        os.environ["CFLOW_CLAIMS_FAMILY"] = str(family_fixture(tmp_path_factory.mktemp("family"),
                                                               {"arch4": [-0.03, -0.025, -0.028]}))
    try:
        results = {r.id: r for r in run_claims(out, quick=True, only=",".join(IDS))}
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out, results


def skip_unless_measured(res: core.ClaimResult) -> None:
    assert "traceback" not in res.data, res.data.get("traceback")
    if res.measured in ("pending", "failed") and not res.judged:
        pytest.skip(f"{res.id} could not run here: {res.reason}")


def needs(res: core.ClaimResult, rule: core.Rule) -> None:
    """Skip a rule whose reference is missing here (C7's SmolLM2 references, T1's torch)."""
    if res.id == "C7" and rule.name.endswith("llama.cpp") and importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama.cpp (llama-cpp-python) is not installed")
    if res.id == "C7" and "PyTorch" not in rule.name:
        from cflow.bench.claims.models import smollm2_gguf

        if smollm2_gguf() is None or importlib.util.find_spec("transformers") is None:
            pytest.skip("the SmolLM2 GGUF or transformers (the controls' perturbed model) is missing")
    if not HAVE_TORCH and (res.id == "T1" or "PyTorch" in rule.name):
        pytest.skip("torch is not installed")


@pytest.mark.parametrize("cid", IDS)
def test_every_rule_is_judged_and_its_control_is_refuted(quick, cid):
    out, results = quick
    res, mod = results[cid], module(cid)
    skip_unless_measured(res)
    rules = [v for v in vars(mod).values() if isinstance(v, core.Rule)]
    assert rules and set(rules) == set(mod.RULES), "every module-level Rule is one the claim judges"
    sec = (out / "report.md").read_text().split(f"## {cid} — ", 1)[1].split("\n## ", 1)[0]
    for rule in mod.RULES:
        needs(res, rule)
        got = [j for j in res.judged if j["name"] == rule.name]
        measured = [j for j in got if not j["control"]]
        controls = [j for j in got if j["control"]]
        assert len(measured) == 1 and len(controls) == 1, (rule.name, got)
        for j in got:
            assert j["rule"] == rule.text()
            assert (j["verdict"], j["reason"]) == rule.judge(j["value"])  # judged by this rule, nothing else
        assert measured[0]["value"] is not None, f"{rule.name}: not measured ({measured[0]['reason']})"
        if cid in QUICK_TIMED_CONTROLS:  # noise-level timing in a quick run: it must never confirm
            assert controls[0]["verdict"] != core.CONFIRMED, f"{rule.name}: the control is confirmed: {controls[0]}"
        else:
            assert controls[0]["verdict"] == core.REFUTED, f"{rule.name}: the control is not refuted: {controls[0]}"
        assert rule.text().replace("|", "/") in sec  # the report prints the rule beside its value
        assert f"| {rule.name} (control: an input built to fail it) | " in sec
    assert res.verdict == core.INCONCLUSIVE  # a quick run never gives a timing or smoke verdict


def test_quick_report_is_well_formed(quick):
    out, _ = quick
    check_report(out, list(IDS), quick=True)  # claims_report: every section, its plots, the summary row


def test_rules_can_reach_every_verdict():
    """No rule is built so that one verdict is out of reach (a rule that cannot fail is no rule)."""
    for cid in IDS:
        for rule in module(cid).RULES:
            lo, hi = sorted((rule.confirm, rule.refute))
            eps = max(abs(lo), abs(hi), 1.0) * 1e-3
            inside = rule.confirm - (eps if rule.higher_is_better else -eps)
            past = rule.refute + (-eps if rule.higher_is_better else eps)
            assert rule.judge(rule.confirm)[0] == core.CONFIRMED, rule.name
            assert rule.judge(past)[0] == core.REFUTED, rule.name
            if rule.confirm != rule.refute:
                assert rule.judge(inside)[0] == core.INCONCLUSIVE, rule.name


def test_c5_judges_the_point_the_sync_calibration_chose(quick):
    _, results = quick
    res = results["C5"]
    skip_unless_measured(res)
    from cflow.bench.claims import c5_async_io as c5

    d = res.data
    cal = d["calibration"]
    want = min(cal, key=lambda x: abs(x["io_share"] - c5.TARGET_IO_SHARE))["budget"]
    assert d["point"] == want, "the judged budget is the sync run's I/O share closest to 50%, not the best async"
    j = d["judged"]
    per_round = [a / s for a, s in zip(j[c5.ASYNC]["tps"], j[c5.SYNC]["tps"])]
    assert len(per_round) == c5.ROUNDS
    measured = next(x for x in res.judged if x["name"] == c5.RULE_ASYNC.name and not x["control"])
    assert measured["value"] == pytest.approx(statistics.median(per_round))
    assert d["control"][c5.SYNC]["budget"] > d["point"] and d["control"][c5.SYNC]["disk_bytes_per_token"] == 0
    assert d["trace"]["layers"] == 6 and d["trace"]["rows"] >= c5.WARMUP + c5.ROUNDS * c5.QUICK_PER_ROUND


def test_c6_judges_default_against_off(quick):
    _, results = quick
    res = results["C6"]
    skip_unless_measured(res)
    from cflow.bench.claims import c6_prefetch as c6

    tg = res.data["tg"]
    want = 100 * (statistics.median(d / o for d, o in zip(tg["default"], tg["off"])) - 1)
    measured = next(x for x in res.judged if x["name"] == c6.RULE_RAM.name and not x["control"])
    assert measured["value"] == pytest.approx(want)  # never the best distance of the sweep
    assert res.data["control_ref_kernels"]["isa"] == "ref"


def test_c8_judges_the_default_variant(quick):
    _, results = quick
    res = results["C8"]
    skip_unless_measured(res)
    from cflow.bench.claims import c8_vflow as c8

    want = statistics.median(c8.ratios(res.data["runs"], "/".join(c8.DEFAULT), "total_s"))
    measured = next(x for x in res.judged if not x["control"])
    assert measured["value"] == pytest.approx(want)


def test_t1_reads_the_table_it_is_pointed_at(quick):
    _, results = quick
    res = results["T1"]
    if not HAVE_TORCH:
        pytest.skip("torch is not installed")
    assert res.data["smoke"] is False and res.data["table"]["command"] == "cflow train compare (test fixture)"
    p = res.data["paired"]["arch4"]
    assert p["diffs"] == pytest.approx([-0.03, -0.025, -0.028])
    assert p["hi"] < 0.02 and p["score"] < -1
    assert [j["verdict"] for j in res.judged if not j["control"]] == [core.CONFIRMED, core.CONFIRMED]


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("diffs, verdict", [
    ([-0.03, -0.025, -0.028], core.CONFIRMED),   # the whole interval below +0.02: competitive
    ([0.10, 0.11, 0.09], core.REFUTED),          # the whole interval above +0.02: worse
    ([0.03, -0.05, 0.01], core.INCONCLUSIVE),    # an interval across the margin
])
def test_t1_full_verdict_follows_the_interval(tmp_path, monkeypatch, diffs, verdict):
    table = family_fixture(tmp_path / "family", {"arch4": diffs, "arch2_4_combined": [-0.01, -0.012, -0.02]})
    monkeypatch.setenv("CFLOW_CLAIMS_FAMILY", str(table))
    res = run_claims(tmp_path / "out", quick=False, only="T1")[0]
    assert res.verdict == verdict, res.reason
    from cflow.bench.claims.t1_train import mean_ci

    m, h = mean_ci(diffs)
    assert res.data["paired"]["arch4"]["score"] == pytest.approx((m - 0.02) / h)


def test_t1_without_a_table_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("CFLOW_CLAIMS_FAMILY", str(tmp_path / "nowhere.json"))
    res = run_claims(tmp_path, quick=False, only="T1")[0]
    assert res.verdict == core.INCONCLUSIVE and res.measured == "pending"
    assert "cflow train compare" in res.pending and "nowhere.json" in res.reason
    assert "**Pending:**" in (tmp_path / "report.md").read_text()


def test_t1_finds_the_family_table_of_the_report_repository(tmp_path, monkeypatch):
    from cflow.bench.claims.t1_train import find_table

    monkeypatch.delenv("CFLOW_CLAIMS_FAMILY", raising=False)
    table = tmp_path / "repo" / "docs" / "results" / "family" / "train_compare.json"
    table.parent.mkdir(parents=True)
    table.write_text(json.dumps({"runs": []}))
    assert find_table(tmp_path / "repo" / "docs" / "claims") == table
    assert find_table(tmp_path / "repo") == table
    assert find_table(tmp_path / "elsewhere") is None
