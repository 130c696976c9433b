"""The CLI's shared pieces (cflow.cli.common, cflow.cli.__init__): every subcommand module is
registered (a missing one is an error, not a silently absent command), errors are shown with the
flag they carry, the `--plan` of analyze, and the bench package's face."""

from __future__ import annotations

import json

import pytest

import cflow.cli as cli
from cflow.cli import build_parser, error_line, main
from cflow.cli.common import UsageError
from cflow.errors import CflowError
from cflow.runtime import EngineError


def test_a_missing_subcommand_module_is_an_error(monkeypatch):
    monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, "no_such_command"])
    with pytest.raises(ModuleNotFoundError):
        build_parser()


def test_error_line_puts_the_flag_first():
    assert error_line(EngineError("too many", flag="-t")) == "-t: too many"
    assert error_line(UsageError("must be >= 0, got -2", flag="-n")) == "-n: must be >= 0, got -2"
    assert error_line(CflowError("no flag here")) == "no flag here"
    assert issubclass(UsageError, CflowError)


def test_usage_errors_are_not_engine_errors(capsys, monkeypatch):
    # a bad -n is the command line's fault, found before any engine exists
    def no_engine(*a, **kw):
        raise AssertionError("the model must not load for a bad flag")

    monkeypatch.setattr("cflow.runtime.Engine.load", no_engine)
    with pytest.raises(UsageError) as e:
        from cflow.cli.common import check_model_flags

        check_model_flags(build_parser().parse_args(["generate", "-n", "-5", "x"]))
    assert e.value.flag == "-n" and not isinstance(e.value, EngineError)
    assert main(["chat", "-c", "-1"]) == 2
    assert "cflow chat: error: -c: must be >= 0" in capsys.readouterr().err


def test_analyze_plan_prints_the_engine_op_list(capsys):
    from cflow.config import ModelConfig
    from cflow.runtime.plan import build_plan

    want = build_plan(ModelConfig.from_name("arch2_4_combined")).describe().splitlines()
    assert main(["analyze", "--preset", "arch2_4_combined", "--plan"]) == 0
    out = capsys.readouterr().out.splitlines()
    at = next(i for i, ln in enumerate(out) if ln.startswith("op plan for one token"))
    assert f"({len(want)} ops;" in out[at] and out[at + 1:at + 1 + len(want)] == want
    assert main(["analyze", "--preset", "arch2_4_combined", "--plan", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"] == want
    assert main(["analyze", "--preset", "arch2_4_combined"]) == 0
    assert "op plan" not in capsys.readouterr().out  # only when asked


def test_bench_package_face_reexports_the_suite():
    import inspect

    import cflow.bench as bench_pkg
    from cflow.bench import suite

    assert bench_pkg.bench is suite.bench and bench_pkg.BenchReport is suite.BenchReport
    assert "def " not in inspect.getsource(bench_pkg)  # the package only names what its modules hold


def test_library_modules_have_no_command_line_entry_points():
    import inspect

    from cflow.bench import footprint

    src = inspect.getsource(footprint)
    assert "__main__" not in src and "sys.argv" not in src
