"""The `cflow` command end to end, as a user runs it.

Through a real process (`python -m cflow ...`) where the boundary matters: exit status, what goes
to stdout versus stderr, no traceback, stdin. In-process through `cflow.cli.main` otherwise.
Generation uses the built-in model (src/cflow/models/default.cflow, 6 layers, d=128), so each
run takes well under a second; the convert/inspect round trip builds a tiny checkpoint with
cflow.model.Transformer and cflow.train.checkpoint, the real producer of what `convert` reads.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cflow.cli import COMMANDS, main
from cflow.runtime import DEFAULT_MODEL

PROMPT = "Once upon a time"
needs_builtin = pytest.mark.skipif(not DEFAULT_MODEL.is_file(), reason="the built-in model is not installed")

# Flags each subcommand's --help must mention (the ones a user reaches for first).
KEY_FLAGS = {
    "generate": ["--model", "--n-predict", "--ctx-size", "--temp", "--top-k", "--top-p", "--seed", "--threads",
                 "--ignore-eos", "--no-verify", "--json"],
    "chat": ["--model", "--system", "--n-predict", "--temp", "--seed", "--no-verify"],
    "bench": ["-m", "-p", "-n", "-t", "--ignore-eos", "--no-verify", "--out", "--experts", "--expert-cache",
              "--expert-io"],
    "convert": ["--quant", "--tile", "--format", "--json", "--mkdir"],
    "inspect": ["--verify", "--json"],
    "cache": ["MATCH", "--json"],
    "analyze": ["--preset", "--quant", "--json", "--dot", "--plan"],
    "train": ["--preset", "--out", "--steps"],
    "export": ["--quant", "--tile", "--json", "--mkdir"],
    "data": ["stories", "build"],
    "serve": ["--model", "--port", "--host", "--parallel", "--api-key", "--ctx-size", "--threads", "--ray",
              "--replicas", "--max-replicas"],
    "perplexity": ["--model", "--file", "--ctx-size", "--chunks", "--threads", "--json"],
}


pytestmark = pytest.mark.usefixtures("private_cache")  # CFLOW_CACHE in each test's tmp_path (conftest)


def cflow(*args: str, stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `cflow ARGS` in a fresh process, as a shell would (stdin is a pipe or /dev/null)."""
    return subprocess.run([sys.executable, "-m", "cflow", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, stdin=None if stdin is not None else subprocess.DEVNULL)


def one_error_line(err: str, *needles: str) -> str:
    """The single stderr line of a failed command; it must name the problem and carry no traceback."""
    lines = err.strip().splitlines()
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def eval_runs(err: str) -> int:
    """Generated tokens, from the `eval time = ... / N runs` timing line."""
    m = re.search(r"\beval time\s*=.*/\s*(\d+) runs", err)
    assert m, err
    return int(m.group(1))


# ---- help ------------------------------------------------------------------------------------
def test_top_level_help_lists_every_command():
    r = cflow("--help")
    assert r.returncode == 0 and r.stderr == ""
    for name in COMMANDS:
        assert re.search(rf"^\s+{name}\s", r.stdout, re.M), f"{name} missing from cflow --help"


@pytest.mark.parametrize("command", COMMANDS)
def test_subcommand_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: cflow {command}")
    for flag in KEY_FLAGS[command]:
        assert re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", out), f"{flag} missing from cflow {command} --help"


@pytest.mark.parametrize("command", [[c] for c in COMMANDS if c != "data"]
                         + [["data", "stories"], ["data", "build"], ["train", "compare"]], ids=" ".join)
def test_subcommand_help_wraps_its_prose_and_keeps_its_examples(command, capsys, monkeypatch):
    """The description fits a terminal (argparse wraps it); the examples are command lines as
    written: a continued one keeps its line break (a backslash-newline that Python swallowed in
    the help string joins the two lines with a run of spaces in the middle)."""
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    out = capsys.readouterr().out
    prose, _, examples = out.partition("\nexamples:\n")
    assert examples, f"cflow {' '.join(command)} --help has no examples"
    assert max(len(line) for line in prose.splitlines()) <= 100, prose
    for line in examples.splitlines():  # mid-line, a run of spaces only lines up a comment
        assert all(m.group(1) == "#" for m in re.finditer(r"\S {3,}(\S)", line)), line


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 1
    assert "generate" in capsys.readouterr().out


# ---- generate with the built-in model ----------------------------------------------------------
@needs_builtin
def test_generate_builtin_model_streams_text_and_times_on_stderr():
    r = cflow("generate", PROMPT, "-n", "8", "-s", "1", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(PROMPT) and len(r.stdout.strip()) > len(PROMPT)
    assert "ms per token" not in r.stdout and "cflow:" not in r.stdout  # timings stay off stdout
    assert "prompt eval time" in r.stderr and "tokens per second" in r.stderr
    assert str(DEFAULT_MODEL) in r.stderr  # no -m: the built-in model was used
    assert eval_runs(r.stderr) == 8


@needs_builtin
def test_generate_same_seed_same_text():
    # a sampling temperature, so the seed (not greedy decoding) is what makes the runs agree
    a, b = (cflow("generate", PROMPT, "-n", "12", "-s", "7", "--temp", "1.0", "--no-perf") for _ in range(2))
    assert a.returncode == b.returncode == 0
    assert a.stdout == b.stdout and len(a.stdout) > len(PROMPT)


@needs_builtin
@pytest.mark.parametrize("n", [0, 1, 3])
def test_generate_n_bounds_the_tokens(n):
    r = cflow("generate", PROMPT, "-n", str(n), "-s", "1", "--temp", "0", "--no-display-prompt")
    assert r.returncode == 0, r.stderr
    assert eval_runs(r.stderr) == n
    assert (r.stdout.strip() == "") == (n == 0)


@needs_builtin
def test_generate_reads_the_prompt_from_stdin():
    piped = cflow("generate", "-n", "4", "-s", "1", "--temp", "0", "--no-perf", stdin=PROMPT)
    given = cflow("generate", PROMPT, "-n", "4", "-s", "1", "--temp", "0", "--no-perf")
    assert piped.returncode == 0 and piped.stdout == given.stdout


def _bad_flag_cases(tmp: Path) -> list[tuple[list[str], list[str]]]:
    text = tmp / "notes.txt"
    text.write_text("These are my notes, not a model file.\n" * 4)
    return [
        (["-n", "-2"], ["-n: must be >= 0"]),
        (["--temp", "-1"], ["--temp: temperature must be >= 0"]),
        (["--top-p", "2"], ["--top-p: top_p must be in (0, 1]"]),
        (["--top-k", "-1"], ["--top-k"]),
        (["-s", "-5"], ["seed"]),
        (["-m", str(tmp / "missing.cflow")], ["missing.cflow", "does not exist"]),
        (["-m", str(text)], ["not a cflow model file"]),
        (["-m", str(tmp)], ["is a directory"]),
        (["-c", "100000"], ["100000", "max_seq_len"]),
        (["-c", "-3"], ["-c: must be >= 0"]),
        (["-f", str(tmp / "nope.txt")], ["cannot read the prompt file"]),
        (["-n", "many"], ["argument -n/--n-predict", "invalid int value"]),  # argparse's own
    ]


@needs_builtin
def test_generate_bad_flags_exit_2_with_one_line(tmp_path):
    for flags, needles in _bad_flag_cases(tmp_path):
        args = [*flags] if "-f" in flags else [PROMPT, *flags]
        r = cflow("generate", *args, "--no-perf")
        assert r.returncode == 2, (flags, r.stderr)
        assert r.stdout == "", (flags, r.stdout)  # nothing printed before the error
        if needles[0].startswith("argument"):  # argparse prints usage, then one error line
            assert "Traceback" not in r.stderr and needles[1] in r.stderr.strip().splitlines()[-1]
        else:
            one_error_line(r.stderr, "cflow generate: error:", *needles)


@needs_builtin
def test_generate_prompt_too_long_for_the_context_prints_nothing():
    r = cflow("generate", "word " * 40, "-c", "8", "-n", "4", "--no-perf")
    assert r.returncode == 2 and r.stdout == ""
    one_error_line(r.stderr, "context", "-c")


# ---- chat ------------------------------------------------------------------------------------
@needs_builtin
def test_chat_through_stdin():
    flags = ["-n", "8", "-s", "1", "--temp", "0"]
    r = cflow("chat", *flags, stdin="hello\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() != ""
    # the built-in model has no chat template: said once, on stderr
    assert r.stderr.count("no chat template") == 1 and "ChatML" in r.stderr
    # /exit ends the conversation: what follows it is never answered
    more = cflow("chat", *flags, stdin="hello\n/exit\nand another question\n")
    assert more.returncode == 0 and more.stdout == r.stdout
    # Ctrl-D (end of input) ends it too, after answering every line
    two = cflow("chat", *flags, stdin="hello\n\n/help\nhi again\n")
    assert two.returncode == 0 and two.stdout.startswith(r.stdout) and len(two.stdout) > len(r.stdout)
    assert "/reset" in two.stderr  # /help went to stderr, not into the conversation


@needs_builtin
def test_chat_bad_flag_fails_before_loading():
    r = cflow("chat", "--top-p", "0", stdin="hello\n")
    assert r.returncode == 2 and r.stdout == ""
    one_error_line(r.stderr, "cflow chat: error:", "--top-p")


# ---- convert / export / inspect round trip ---------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict]:
    """A tiny random llama-shaped model saved as `cflow train` saves it (odd vocab, 3 layers)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from cflow.config import ModelConfig
    from cflow.model import Transformer
    from cflow.train.bpe import train_bpe
    from cflow.train.checkpoint import model_weights, save_checkpoint

    corpus = ["Once upon a time there was a little dog named Max.", "The sun was bright and the sky was blue."] * 8
    tok_json = train_bpe(corpus, vocab_size=280, min_frequency=1).to_str()
    vocab = len(json.loads(tok_json)["model"]["vocab"])
    cfg = ModelConfig.from_name("llama", vocab_size=vocab + 2, d_model=64, n_heads=2, n_kv_heads=1, n_layers=3,
                                d_ff=96, max_seq_len=64)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt") / "run"
    save_checkpoint(path, weights=model_weights(Transformer(cfg)), config=cfg, tokenizer_json=tok_json,
                    meta={"preset": "llama"})
    return path, cfg.to_dict()


def test_convert_then_inspect_verify_json(tmp_path, checkpoint):
    from cflow.config import ModelConfig
    from cflow.fileformat import model_tensors

    ckpt, cfg = checkpoint
    out = tmp_path / "tiny.cflow"
    r = cflow("convert", str(ckpt), str(out), "--quant", "q8_0", "-q", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["file_bytes"] == out.stat().st_size

    r = cflow("inspect", str(out), "--verify", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["verified"] and info["aligned"] and info["order"] == "cflow" and info["missing_tensors"] == []
    assert info["config"] == cfg
    assert {t["name"] for t in info["tensors"]} == set(model_tensors(ModelConfig.from_dict(cfg)))
    assert {t["dtype"] for t in info["tensors"] if len(t["shape"]) == 2} == {"q8_0"}

    # the converted model runs
    r = cflow("generate", "-m", str(out), "Max", "-n", "3", "--temp", "0", "--no-perf")
    assert r.returncode == 0 and r.stdout.startswith("Max"), r.stderr


def test_export_writes_vflow_by_extension(tmp_path, checkpoint, capsys):
    out = tmp_path / "tiny.vflow"
    assert main(["export", str(checkpoint[0]), str(out), "-q"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["order"] == "vflow" and not info["verified"]
    assert {t["dtype"] for t in info["tensors"] if len(t["shape"]) == 2} == {"q4_0"}  # export's default


def test_inspect_corrupted_file(tmp_path, checkpoint, capsys):
    good = tmp_path / "good.cflow"
    assert main(["convert", str(checkpoint[0]), str(good), "-q"]) == 0
    capsys.readouterr()
    data = bytearray(good.read_bytes())
    assert main(["inspect", str(good), "--json"]) == 0
    last = json.loads(capsys.readouterr().out)["tensors"][-1]
    bad = tmp_path / "bad.cflow"
    data[last["offset"] + 1] ^= 0x40  # one bit of the last tensor
    bad.write_bytes(bytes(data))

    assert main(["inspect", str(bad)]) == 0  # the layout is intact: only the checksum can tell
    capsys.readouterr()
    r = cflow("inspect", str(bad), "--verify")
    assert r.returncode == 2 and r.stdout == ""
    one_error_line(r.stderr, "cflow inspect: error:", last["name"], "checksum", "corrupted")

    cut = tmp_path / "cut.cflow"
    cut.write_bytes(bytes(data[: len(data) - 4096]))
    assert main(["inspect", str(cut)]) == 2
    one_error_line(capsys.readouterr().err, "cut short")


@pytest.mark.parametrize("name, needles", [
    ("nope.cflow", ["no such file"]),
    (".", ["is a directory"]),
    ("page.html", ["not a cflow model file", "HTML"]),  # a download that fetched an error page
])
def test_inspect_bad_input(tmp_path, capsys, name, needles):
    (tmp_path / "page.html").write_text("<!doctype html><p>404 not found</p>\n" * 4)
    assert main(["inspect", str(tmp_path / name)]) == 2
    one_error_line(capsys.readouterr().err, "cflow inspect: error:", *needles)


def test_convert_and_export_errors_are_one_line(tmp_path, checkpoint, capsys):
    ckpt = str(checkpoint[0])
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["convert", str(tmp_path / "missing.gguf"), str(tmp_path / "o.cflow")], ["does not exist"]),
        (["convert", str(empty), str(tmp_path / "o.cflow")], ["model.safetensors"]),
        (["convert", ckpt, str(empty)], ["is a directory"]),  # found before any work, nothing left behind
        (["convert", ckpt, str(tmp_path / "o.cflow"), "--tile", "3x5"], ["3x5", "ROWSxCOLS"]),
        (["export", str(empty), str(tmp_path / "o.cflow")], ["not a cflow training checkpoint"]),
        (["export", ckpt, "/proc/cflow-test/o.cflow"],  # unwritable place
         ["cannot write /proc/cflow-test/o.cflow: the folder /proc/cflow-test does not exist"]),
    ]
    for argv, needles in cases:
        assert main(argv) == 2, argv
        one_error_line(capsys.readouterr().err, f"cflow {argv[0]}: error:", *needles)
    assert os.listdir(empty) == [] and not (tmp_path / "o.cflow").exists()
    with pytest.raises(SystemExit) as e:  # argparse rejects an unknown --quant itself
        main(["convert", ckpt, str(tmp_path / "o.cflow"), "--quant", "q3_k"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
