"""C8's cold-start experiment (cflow.bench.claims.c8_vflow) in its quick form: every read variant
runs, cold, and the report carries the table and the disk probe."""

from __future__ import annotations

import json

from cflow.bench.claims import c8_vflow
from cflow.bench.claims.runner import run_claims


def test_c8_quick_measures_every_variant(tmp_path):
    (res,) = run_claims(tmp_path, quick=True, only="C8")
    assert res.measured == "measured", res.reason
    runs = res.data["runs"]
    assert list(runs) == [f"{o}/{m}" for o, m in c8_vflow.VARIANTS]
    for key, rs in runs.items():
        assert len(rs) == res.data["reps"]
        order, mode = key.split("/")
        for r in rs:
            assert r["readahead"]["mode"] == mode
            assert r["readahead"]["file_order"] is (order == "vflow" and mode != "off")
            assert r["first_token_s"] > 0 and r["cold_tps"] > 0
            if mode == "sweep":  # swept whatever the cache held
                assert r["readahead"]["bytes_total"] > 0
    assert res.data["disk_probe"]["gbs"] > 0
    (table,) = res.tables
    assert [row[0] for row in table.rows] == [f".{k}" for k in runs]
    report = json.loads((tmp_path / "report.json").read_text())
    assert any(c["id"] == "C8" for c in report["claims"])
