"""`cflow generate` and `cflow chat` flags beyond the basics of test_cli.py: --json for scripts,
--ignore-eos, --no-verify, -t 0, errors shown with the flag behind them, and a closed stdin.

Runs through real processes where stdout/stderr/exit status are the contract, with the built-in
model (a generation takes well under a second)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cflow.cli import main
from cflow.runtime import DEFAULT_MODEL, EngineError, usable_threads

from test_cli import PROMPT, cflow, needs_builtin, one_error_line

pytestmark = [needs_builtin, pytest.mark.usefixtures("private_cache")]  # private_cache: conftest


# ---- --json ----------------------------------------------------------------------------------
def test_json_is_one_object_on_stdout_and_agrees_with_the_text():
    flags = [PROMPT, "-n", "6", "-s", "3", "--temp", "0.7", "-t", "1"]
    r = cflow("generate", *flags, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)  # the whole of stdout is one JSON document
    assert r.stdout.count("\n") == 1
    assert set(d) == {"text", "tokens", "prompt_tokens", "finish_reason", "timings", "seed", "model"}
    assert len(d["tokens"]) == 6 and d["finish_reason"] == "length" and d["prompt_tokens"] > 0
    assert d["seed"] == 3 and d["model"] == str(DEFAULT_MODEL)
    assert d["timings"]["gen_tokens"] == 6 and d["timings"]["gen_tps"] > 0 and d["timings"]["load_s"] > 0
    assert "eval time" not in r.stderr  # the timings are in the object
    # the same run streamed prints the same text
    plain = cflow("generate", *flags, "--no-display-prompt", "--no-perf")
    assert plain.stdout == d["text"] + "\n"


def test_json_reports_the_random_seed_it_drew():
    d = json.loads(cflow("generate", PROMPT, "-n", "5", "--temp", "1", "--json").stdout)
    again = cflow("generate", PROMPT, "-n", "5", "--temp", "1", "--json", "-s", str(d["seed"]))
    assert json.loads(again.stdout)["tokens"] == d["tokens"]


# ---- --ignore-eos ----------------------------------------------------------------------------
def test_ignore_eos_generates_past_the_end_of_text():
    # find a seed whose story ends with the model's end-of-text token before -n
    for seed in range(1, 40):
        r = cflow("generate", PROMPT, "-n", "250", "--temp", "0.8", "-s", str(seed), "-t", "1", "--json")
        d = json.loads(r.stdout)
        if d["finish_reason"] == "stop":
            break
    else:
        pytest.skip("no sampled story ended before 250 tokens")
    n = len(d["tokens"]) + 10
    r = cflow("generate", PROMPT, "-n", str(n), "--temp", "0.8", "-s", str(seed), "-t", "1", "--json",
              "--ignore-eos")
    e = json.loads(r.stdout)
    assert e["finish_reason"] == "length" and len(e["tokens"]) == n
    assert e["tokens"][:len(d["tokens"])] == d["tokens"]  # the same story, then on past its end


# ---- --no-verify -----------------------------------------------------------------------------
def _damaged_copy(tmp_path: Path) -> Path:
    """The built-in model with one low mantissa bit of a norm weight flipped: the checksum no
    longer matches, but the model still computes (the weight moves by ~1e-7 of itself)."""
    from cflow.fileformat import open_model

    with open_model(DEFAULT_MODEL) as cf:
        norm = next(e for e in cf.tensors.values() if e.dtype == "f32" and e.name.endswith("norm"))
        offset = norm.offset
    data = bytearray(DEFAULT_MODEL.read_bytes())
    data[offset] ^= 0x01  # little-endian: the lowest byte of the first float
    bad = tmp_path / "damaged.cflow"
    bad.write_bytes(bytes(data))
    return bad


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_no_verify_skips_the_first_use_checksum(tmp_path, command):
    bad = _damaged_copy(tmp_path)
    args = [command, "-m", str(bad), "-n", "2", "--temp", "0", "-t", "1"]
    args += [PROMPT, "--no-perf"] if command == "generate" else []
    stdin = "hello\n" if command == "chat" else None
    checked = cflow(*args, stdin=stdin)
    assert checked.returncode == 2 and checked.stdout == ""
    one_error_line(checked.stderr, f"cflow {command}: error:", "damaged", "checksum")
    skipped = cflow(*args, "--no-verify", stdin=stdin)
    assert skipped.returncode == 0, skipped.stderr
    assert skipped.stdout.strip() != ""


# ---- -t 0 ------------------------------------------------------------------------------------
def test_threads_zero_is_every_usable_core_and_help_says_so(capsys):
    r = cflow("generate", PROMPT, "-n", "2", "-t", "0", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert f", {usable_threads()} threads," in r.stderr
    for command in ("generate", "chat"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "0 = every usable core" in " ".join(capsys.readouterr().out.split())


def test_threads_over_the_limit_names_the_flag():
    r = cflow("generate", PROMPT, "-n", "2", "-t", "100000")
    assert r.returncode == 2 and r.stdout == ""
    one_error_line(r.stderr, "cflow generate: error: -t:", "512")


# ---- errors carry their flag -----------------------------------------------------------------
def test_an_engine_error_is_shown_with_its_flag_field(monkeypatch, capsys):
    # the message says nothing about which flag: the CLI takes it from the error's `flag` field
    def refuse(*a, **kw):
        raise EngineError("this value cannot work on this machine", flag="-c")

    monkeypatch.setattr("cflow.runtime.Engine.load", refuse)
    assert main(["generate", PROMPT, "-n", "1"]) == 2
    one_error_line(capsys.readouterr().err, "cflow generate: error: -c: this value cannot work")


@pytest.mark.parametrize("flags, shown", [
    (["--top-k", "-3"], "--top-k: top_k must be >= 0"),
    (["--min-p", "2"], "--min-p: min_p must be in [0, 1]"),
    (["--repeat-penalty", "0"], "--repeat-penalty: repeat_penalty must be > 0"),
    (["--repeat-last-n", "-2"], "--repeat-last-n: repeat_last_n must be >= -1"),
    (["-s", "-5"], "-s: seed"),
])
def test_sampling_errors_name_their_flag(capsys, flags, shown):
    assert main(["generate", PROMPT, *flags]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    one_error_line(err, "cflow generate: error:", shown)


# ---- a closed stdin --------------------------------------------------------------------------
def _closed_stdin(*args: str) -> subprocess.CompletedProcess:
    """`cflow ARGS <&-`: the shell closes fd 0 before starting cflow."""
    line = " ".join(["exec", sys.executable, "-m", "cflow", *args, "<&-"])
    return subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=60)


def test_chat_with_stdin_closed_is_one_error_line():
    r = _closed_stdin("chat", "-n", "4")
    assert r.returncode == 2 and r.stdout == ""
    one_error_line(r.stderr, "cflow chat: error:", "stdin is closed")


def test_generate_with_stdin_closed_and_no_prompt_is_one_error_line():
    r = _closed_stdin("generate", "-n", "4")
    assert r.returncode == 2 and r.stdout == ""
    one_error_line(r.stderr, "cflow generate: error:", "no prompt")
    r = _closed_stdin("generate", "-n", "2", "--no-perf", "Once")  # a prompt given: stdin is not needed
    assert r.returncode == 0 and r.stdout.startswith("Once"), r.stderr

