"""`cflow bench` end to end on a tiny model: the report has every row and column it promises,
the byte counts come from the engine's counters, and bad requests give named errors.
No timing is asserted: speed is measured by benchmarks, not tests."""

from __future__ import annotations

import json

import pytest

from cflow.bench import BenchReport, bench
from cflow.bench.runner import BenchRow, synthetic_tokens
from cflow.cli import main
from cflow.errors import CflowError

from test_engine import small_config, write_random_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "tiny.cflow"
    cfg = small_config("arch2_4_combined", n_layers=3)
    write_random_model(path, cfg, "q4_0", (32, 64))
    return path, cfg


def test_report_rows_and_counted_bytes(tiny_model):
    path, cfg = tiny_model
    rep = bench(path, threads=[1, 2], pp=16, tg=8, reps=2, probe=False, footprint=False)
    assert [(r.engine, r.test, r.threads) for r in rep.rows] == [
        ("cflow", "pp16", 1), ("cflow", "tg8", 1), ("cflow", "pp16", 2), ("cflow", "tg8", 2)]
    for r in rep.rows:
        assert len(r.samples_ts) == 2 and all(ts > 0 for ts in r.samples_ts)
    tg = [r for r in rep.rows if r.test == "tg8"]
    # Only the top-k experts are read, so a token reads less than the whole file's weights.
    from cflow.runtime import Engine

    with Engine.load(path, threads=1) as eng:
        expected = eng.weight_bytes_per_token()
        all_experts = sum(t.nbytes for n, t in eng.file.tensors.items() if ".experts." in n)
    for r in tg:
        assert r.bytes_per_token is not None
        # counted bytes: top_k of n_experts experts per layer, the routed mix may differ from the average
        assert abs(r.bytes_per_token - expected) <= all_experts / cfg.n_experts * cfg.top_k * cfg.n_layers
    md = rep.to_markdown()
    assert "| cflow | 2 | tg8 |" in md and "weight MB/token" in md
    d = json.loads(rep.to_json())
    assert len(d["rows"]) == 4 and d["rows"][1]["effective_gbs"] > 0


def test_ratio_is_ours_over_baseline():
    rep = BenchReport(model="m", machine={}, rows=[
        BenchRow("cflow", "tg8", 2, 8, [300.0, 300.0]), BenchRow("llama.cpp", "tg8", 2, 8, [100.0, 100.0])])
    assert rep.ratio(rep.rows[1]) == pytest.approx(3.0)
    assert rep.ratio(rep.rows[0]) is None


def test_footprint_in_a_fresh_process(tiny_model):
    path, _ = tiny_model
    rep = bench(path, threads=[1], pp=0, tg=4, reps=1, warmup=False, probe=False, footprint=True)
    f = rep.footprint
    assert f["file_bytes"] == path.stat().st_size
    assert f["rss_after_first_token"] >= f["rss_before_load"] > 0
    assert f["ttft_s"] > 0 and f["prompt_tokens"] > 0


def test_cli_json_output(tiny_model, capsys):
    path, _ = tiny_model
    assert main(["bench", "-m", str(path), "-t", "1", "-p", "8", "-n", "4", "-r", "1", "--no-probe",
                 "--no-footprint", "-q", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [r["test"] for r in d["rows"]] == ["pp8", "tg4"] and d["machine"]["usable_cores"] >= 1


def test_synthetic_tokens_deterministic_and_in_range():
    a, b = synthetic_tokens(100, 300), synthetic_tokens(100, 300)
    assert (a == b).all() and a.min() >= 150 and a.max() < 300


def test_bad_requests(tiny_model, tmp_path, capsys):
    path, _ = tiny_model
    with pytest.raises(CflowError, match="not found"):
        bench(tmp_path / "missing.cflow")
    with pytest.raises(CflowError, match="reps"):
        bench(path, reps=0, probe=False, footprint=False)
    with pytest.raises(SystemExit) as e:
        main(["bench", "-m", str(path), "-t", "1,x"])
    assert e.value.code == 2
    assert "comma-separated integers" in capsys.readouterr().err
    with pytest.raises(CflowError, match="unknown baseline"):
        bench(path, compare="vllm", probe=False, footprint=False)


def test_threads_zero_means_every_usable_core(tiny_model):
    from cflow.runtime import usable_threads

    rep = bench(tiny_model[0], threads=[0], pp=0, tg=2, reps=1, warmup=False, probe=False, footprint=False)
    assert [r.threads for r in rep.rows] == [usable_threads()]


def test_depths_fill_the_context_first(tiny_model, capsys):
    """-d N runs each test after N untimed context tokens (llama-bench's -d): the tg steps run at
    positions N.., the counters count the test alone, and the context must hold N + the test."""
    from cflow.bench.runner import time_tg

    class Recorder:
        name = "rec"

        def reset(self):
            self.calls = []

        def prefill(self, tokens, pos0=0):
            self.calls.append(("prefill", len(tokens), pos0))

        def step(self, token, pos):
            self.calls.append(("step", pos))
            return token

    r = Recorder()
    time_tg(r, 3, first_token=5, context=list(range(7)))
    assert r.calls == [("prefill", 7, 0), ("step", 7), ("step", 8), ("step", 9)]
    path, cfg = tiny_model
    rep = bench(path, threads=[1], pp=8, tg=4, reps=1, probe=False, footprint=False, depths=[0, 24])
    assert [r.test for r in rep.rows] == ["pp8", "tg4", "pp8 @ d24", "tg4 @ d24"]
    by = {r.test: r for r in rep.rows}
    assert by["tg4 @ d24"].bytes_per_token is not None and by["tg4"].bytes_per_token is not None
    # The experts chosen differ between the two contexts, so the counts differ a little; had the
    # fill's 24 tokens been counted, the d24 figure would be ~7x smaller.
    assert by["tg4 @ d24"].bytes_per_token == pytest.approx(by["tg4"].bytes_per_token, rel=0.5)
    with pytest.raises(CflowError, match="depth"):
        bench(path, threads=[1], pp=8, tg=4, reps=1, probe=False, footprint=False, depths=[cfg.max_seq_len])
    with pytest.raises(SystemExit):
        main(["bench", "-m", str(path), "-t", "1", "-p", "0", "-n", "2", "-d", "0,x", "-q"])
    assert "-d/--n-depth" in capsys.readouterr().err


def test_tg_runs_every_step_whatever_the_token(tiny_model, capsys):
    from cflow.bench.runner import time_tg

    class AlwaysEos:  # a model whose every next token is its end-of-text id
        name, steps = "eos", 0

        def reset(self):
            self.steps = 0

        def step(self, token, pos):
            self.steps += 1
            return 0

    r = AlwaysEos()
    time_tg(r, 16, first_token=5)
    assert r.steps == 16
    # llama.cpp's --ignore-eos is accepted and documented: tg never stops at end of text anyway
    assert main(["bench", "-m", str(tiny_model[0]), "-t", "1", "-p", "0", "-n", "4", "-r", "1", "--no-probe",
                 "--no-footprint", "-q", "--json", "--ignore-eos"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["n_tokens"] == 4


def test_no_verify_skips_the_checksum_check(tiny_model, tmp_path, monkeypatch, capsys):
    from cflow.fileformat import open_model

    monkeypatch.setenv("CFLOW_CACHE", str(tmp_path / "cache"))  # no verdict cached for the copy
    path, _ = tiny_model
    with open_model(path) as cf:
        norm = next(e for e in cf.tensors.values() if e.dtype == "f32" and e.name.endswith("norm"))
    data = bytearray(path.read_bytes())
    data[norm.offset] ^= 0x01  # the lowest mantissa bit of one norm weight: still a working model
    bad = tmp_path / "damaged.cflow"
    bad.write_bytes(bytes(data))
    argv = ["bench", "-m", str(bad), "-t", "1", "-p", "0", "-n", "2", "-r", "1", "--no-probe", "-q", "--json"]
    assert main(argv) == 2
    assert "damaged" in capsys.readouterr().err
    assert main([*argv, "--no-verify"]) == 0  # the footprint's fresh process skips it too
    assert json.loads(capsys.readouterr().out)["footprint"]["file_bytes"] == bad.stat().st_size


def test_machine_features_are_what_the_dispatcher_probed():
    from cflow import _native
    from cflow.bench.machine import machine_info

    probed = _native.cpu_features()
    assert machine_info()["features"] == sorted(k for k, present in probed.items() if present)


def test_counted_bytes_are_cross_checked_against_the_tensor_table(tiny_model):
    from cflow.runtime import Engine
    from cflow.runtime.files import format_size

    path, _ = tiny_model
    rep = bench(path, threads=[1], pp=0, tg=4, reps=1, warmup=False, probe=False, footprint=False)
    with Engine.load(path, threads=1) as eng:
        assert rep.table_bytes_per_token == eng.weight_bytes_per_token()
    md = rep.to_markdown()
    assert f"the tensor table says {format_size(rep.table_bytes_per_token)}" in md
    assert f"({format_size(path.stat().st_size)})" in md.splitlines()[0]  # decimal sizes, as everywhere
    assert json.loads(rep.to_json())["table_bytes_per_token"] == rep.table_bytes_per_token


def test_cli_bench_reports_the_disk_tier(tiny_model, capsys):
    """`cflow bench --experts disk` runs the experts from the file through the bounded cache and
    the JSON rows carry the disk counters the issue names."""
    path, cfg = tiny_model
    assert main(["bench", "-m", str(path), "-t", "1", "-p", "0", "-n", "6", "-r", "1", "--no-probe",
                 "--no-footprint", "--experts", "disk", "--expert-cache", "1G", "--expert-io", "sync",
                 "--json", "-q"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    tg = [r for r in rows if r["test"] == "tg6"][0]
    assert tg["disk_bytes_per_token"] >= 0 and 0 <= tg["expert_cache_hit_rate"] <= 1
    assert tg["io_stall_ms_per_token"] >= 0
    # in RAM there is no disk tier to report
    assert main(["bench", "-m", str(path), "-t", "1", "-p", "0", "-n", "2", "-r", "1", "--no-probe",
                 "--no-footprint", "--experts", "ram", "--json", "-q"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0].get("disk_bytes_per_token") is None


def test_spec_test_runs_plain_and_speculative_side_by_side(smollm2_converted, capsys):
    """--spec ngram on SmolLM2: one speculative row per thread count, both decodings of exactly -n
    tokens from the default grounded prompt (a shipped story under the chat template), the same
    greedy tokens, the proposer's counts; JSON and markdown carry them."""
    from cflow.bench.speculative import GROUNDED_ASK
    from cflow.runtime.speculative import Speculative

    rep = bench(smollm2_converted, threads=[1], pp=0, tg=24, reps=2, probe=False, footprint=False,
                spec=Speculative("ngram"))
    (row,) = rep.spec_rows
    assert row.proposer == "ngram" and row.threads == 1 and row.n_tokens == 24 and row.prompt_tokens > 50
    assert len(row.plain_ts) == len(row.spec_ts) == 2 and row.identical
    assert row.rounds > 0 and 0 <= row.accepted <= row.drafted
    d = rep.to_dict()["speculative"][0]
    assert d["speedup"] > 0 and d["acceptance_rate"] == row.acceptance_rate
    assert "| 1 | ngram |" in rep.to_markdown()
    from cflow.bench.speculative import default_prompt
    from cflow.runtime import Engine

    with Engine.load(smollm2_converted, threads=1) as eng:
        ids = default_prompt(eng)
        text = eng.tokenizer.decode(ids)
    assert len(ids) == row.prompt_tokens and GROUNDED_ASK.strip() in text and "<|im_start|>user" in text
    assert main(["bench", "-m", str(smollm2_converted), "-t", "1", "-p", "0", "-n", "8", "-r", "1", "--no-probe",
                 "--no-footprint", "-q", "--json", "--spec", "ngram", "--spec-prompt",
                 "one two three four one two three four one two"]) == 0
    (got,) = json.loads(capsys.readouterr().out)["speculative"]
    assert got["n_tokens"] == 8 and got["identical"] and got["prompt_tokens"] >= 10


def test_spec_test_bad_requests(tiny_model, capsys):
    path, _ = tiny_model
    for args, want in ((["--spec-prompt", "x"], "--spec-prompt"), (["--spec", "ngram", "--profile"], "--spec"),
                       (["--spec", "mtp"], "--mtp"),  # a model without heads: refused before any test runs
                       (["--spec", "ngram", "--spec-prompt", "@/nonexistent/p.txt"], "--spec-prompt")):
        code = main(["bench", "-m", str(path), "-t", "1", "-p", "0", "-n", "4", "-r", "1", "--no-probe",
                     "--no-footprint", "-q", *args])
        err = capsys.readouterr().err
        assert code != 0 and want in err, (args, err)
    with pytest.raises(CflowError, match="-n >= 1"):
        from cflow.runtime.speculative import Speculative

        bench(path, threads=[1], pp=4, tg=0, reps=1, probe=False, footprint=False, spec=Speculative("ngram"))
