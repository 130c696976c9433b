"""EngineOptions (cflow.runtime.options): each bad value is refused when the options are made, with
a named error that names the flag; keyword arguments override an options object field by field;
and the command line, the benchmark suite and the server's backends hand the engine the same
options for the same flags (cflow.cli.common.engine_options is the one mapping)."""

from __future__ import annotations

import argparse
import dataclasses
import warnings

import pytest

from cflow.runtime import Engine, EngineError
from cflow.runtime.options import DEFAULT_MAX_BATCH, EngineOptions

from test_engine import small_config, write_random_model


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("options") / "dense.cflow"
    # head_dim 32: one q8_0 block per KV row, so the q8_0 cache flags apply
    write_random_model(path, small_config("llama", tied=False, d_model=192, n_heads=6, n_kv_heads=2), "q8_0",
                       (64, 64))
    return path


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("options") / "moe.cflow"
    write_random_model(path, small_config("arch2_4_combined", tied=False, n_experts=8, top_k=1), "q8_0", (32, 64))
    return path


# ---- the value itself ---------------------------------------------------------------------------
def test_defaults_are_engine_load_defaults():
    o = EngineOptions()
    assert o.to_dict() == dict(threads=None, n_ctx=None, n_seq=1, max_batch=DEFAULT_MAX_BATCH, mmap=True,
                               hugepages=True, verify=True, cache_type_k="f16", cache_type_v="f16", experts="auto",
                               expert_cache=None, expert_io="async", expert_delay=True, expert_speculation="auto",
                               readahead="auto", overlap=False, prefetch=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.threads = 2  # type: ignore[misc]


@pytest.mark.parametrize("field, value, flag, words", [
    ("threads", -1, "-t", "threads must be >= 1"),
    ("threads", "two", "-t", "whole number"),
    ("n_ctx", -5, "-c", "context size must be >= 1"),
    ("n_seq", 0, None, "n_seq (sequences, KV-cache slots) must be >= 1"),
    ("cache_type_k", "q4_0", "-ctk", "not a KV cache type"),
    ("cache_type_v", "bf16", "-ctv", "not a KV cache type"),
    ("experts", "gpu", "--experts", "experts must be one of ram, disk, auto"),
    ("expert_io", "mmap", "--expert-io", "expert_io must be one of async, sync"),
    ("expert_speculation", "always", "--expert-speculation", "expert_speculation must be one of"),
    ("expert_cache", "lots", "--expert-cache", "cannot read 'lots' as a size"),
    ("expert_cache", -1, "--expert-cache", "cannot be negative"),
    ("expert_cache", True, "--expert-cache", "byte count or a size"),
    ("readahead", "eager", "--readahead", "readahead must be one of"),
    ("prefetch", -3, "--prefetch", "prefetch distance must be 0 (off) or 1.."),
    ("prefetch", "1024", "--prefetch", "prefetch must be None"),
])
def test_bad_values_are_named_errors(field, value, flag, words):
    with pytest.raises(EngineError) as e:
        EngineOptions(**{field: value})
    assert e.value.flag == flag
    assert words in str(e.value)


def test_equal_choices_compare_equal():
    # the spellings different callers use for one choice become one value
    assert EngineOptions(threads=0, n_ctx=0) == EngineOptions()
    assert EngineOptions(expert_cache="2M") == EngineOptions(expert_cache=2_000_000)
    assert EngineOptions(expert_cache="1MiB").expert_cache == 1 << 20
    assert EngineOptions(expert_speculation="3") == EngineOptions(expert_speculation=3)
    assert EngineOptions(expert_speculation="off").expert_speculation == 0
    assert EngineOptions(expert_speculation="next-layer").expert_speculation == 1
    assert EngineOptions(mmap=0, overlap=1) == EngineOptions(mmap=False, overlap=True)
    assert hash(EngineOptions(n_seq=2)) == hash(EngineOptions(n_seq=2))


def test_replace_and_build_apply_overrides():
    base = EngineOptions(threads=2, experts="ram")
    o = base.replace(n_ctx=64)
    assert (o.threads, o.experts, o.n_ctx) == (2, "ram", 64) and base.n_ctx is None
    assert base.replace() is base
    assert EngineOptions.build(base, threads=1) == EngineOptions(threads=1, experts="ram")
    assert EngineOptions.build(None, n_seq=3) == EngineOptions(n_seq=3)
    with pytest.raises(EngineError, match="threads must be >= 1"):
        base.replace(threads=-2)  # an override is checked like any value
    with pytest.raises(TypeError, match="unknown engine option.*'thread'"):
        base.replace(thread=2)
    with pytest.raises(TypeError, match="options must be an EngineOptions"):
        EngineOptions.build(4)  # type: ignore[arg-type]


# ---- renamed options ----------------------------------------------------------------------------
DEPRECATED = "expert_prefetch is deprecated; use expert_speculation"


def test_expert_prefetch_keyword_is_expert_speculation_with_a_warning():
    """expert_speculation's old name still works, warns at the caller's line, and is no field."""
    with pytest.warns(DeprecationWarning, match=DEPRECATED) as w:
        opts = EngineOptions(expert_prefetch="next-layer")
    assert opts == EngineOptions(expert_speculation=1) and w[0].filename == __file__
    with pytest.warns(DeprecationWarning, match=DEPRECATED) as w:
        assert EngineOptions(threads=1).replace(expert_prefetch="4") == EngineOptions(threads=1, expert_speculation=4)
    assert w[0].filename == __file__
    with pytest.warns(DeprecationWarning, match=DEPRECATED):
        assert EngineOptions.build(None, expert_prefetch="off").expert_speculation == 0
    assert "expert_prefetch" not in EngineOptions.names() and "expert_prefetch" not in opts.to_dict()
    # a bad value through the old name is the new option's error
    with pytest.warns(DeprecationWarning), pytest.raises(EngineError, match="expert_speculation must be one of"):
        EngineOptions(expert_prefetch="always")
    # both names at once: which one was meant cannot be told
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="expert_prefetch is expert_speculation's old"):
        EngineOptions(expert_prefetch=1, expert_speculation=2)
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="give expert_speculation only"):
        EngineOptions().replace(expert_prefetch=1, expert_speculation=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name warns of nothing
        EngineOptions(expert_speculation=2).replace(expert_speculation="off")


def test_engine_load_takes_the_old_keyword(moe_model):
    with pytest.warns(DeprecationWarning, match=DEPRECATED) as w:
        old = Engine.load(moe_model, threads=1, n_ctx=32, experts="disk", verify=False, expert_prefetch="off")
    assert w[0].filename == __file__  # the warning points at this line, not into cflow
    with old, Engine.load(moe_model, threads=1, n_ctx=32, experts="disk", verify=False,
                          expert_speculation="off") as new:
        assert old.options == new.options and old.options.expert_speculation == 0
        assert old.expert_cache["speculation"] == new.expert_cache["speculation"] == "off"


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench"])
def test_expert_prefetch_flag_is_a_hidden_deprecated_alias(command, capsys):
    from cflow.cli.common import engine_options

    args = ["-m", "x.cflow"] + (["hello"] if command == "generate" else [])
    old = _parse(command, ["--expert-prefetch", "next-layer", *args])
    assert capsys.readouterr().err == "cflow: --expert-prefetch is deprecated; use --expert-speculation\n"
    new = _parse(command, ["--expert-speculation", "next-layer", *args])
    assert capsys.readouterr().err == ""
    assert engine_options(old) == engine_options(new) and engine_options(new).expert_speculation == 1
    assert _parse(command, args).expert_speculation == "auto"  # the alias changes no default
    with pytest.raises(SystemExit):
        _parse(command, ["--help"])
    shown = capsys.readouterr().out
    assert "--expert-speculation" in shown and "--expert-prefetch" not in shown


# ---- the engine ---------------------------------------------------------------------------------
def test_load_takes_options_and_keyword_overrides(dense_model):
    opts = EngineOptions(threads=1, n_ctx=32, overlap=True, prefetch=0)
    with Engine.load(dense_model, opts) as a, Engine.load(dense_model, opts, n_ctx=48) as b, \
            Engine.load(dense_model, threads=1, n_ctx=32, overlap=True, prefetch=0) as c:
        assert a.options == c.options == opts
        assert b.options == opts.replace(n_ctx=48)
        assert (a.n_ctx, b.n_ctx, a.threads, a.overlap, a.prefetch) == (32, 48, 1, True, 0)
        assert a.tuner is None  # a fixed thread count is not tuned
        assert a.complete([1, 2, 3], max_tokens=4, temperature=0).tokens == \
            c.complete([1, 2, 3], max_tokens=4, temperature=0).tokens


def test_bad_option_fails_before_the_file_is_opened(tmp_path):
    with pytest.raises(EngineError) as e:
        Engine.load(tmp_path / "missing.cflow", experts="gpu")
    assert e.value.flag == "--experts"
    with pytest.raises(TypeError, match="unknown engine option"):
        Engine.load(tmp_path / "missing.cflow", n_threads=2)


def test_engine_over_an_open_file_takes_options(dense_model):
    from cflow.fileformat import open_model

    cf = open_model(dense_model, mmap=True)
    with Engine(cf, EngineOptions(threads=1, n_ctx=16), n_seq=2) as eng:
        assert (eng.n_ctx, eng.n_seq, eng.threads) == (16, 2, 1)


def test_disk_residency_builds_its_plan_once(moe_model, monkeypatch):
    """With experts on disk the plan the cache was sized for is the plan the engine runs: built,
    and its layers in flight asked of the C core, once."""
    from cflow.runtime import engine as engine_mod
    from cflow.runtime import experts as xp

    built, asked = [], []
    real_build, real_inflight = engine_mod.build_plan, xp.plan_inflight
    monkeypatch.setattr(engine_mod, "build_plan", lambda *a, **k: built.append(k) or real_build(*a, **k))
    monkeypatch.setattr(xp, "plan_inflight", lambda *a, **k: asked.append(1) or real_inflight(*a, **k))
    with Engine.load(moe_model, threads=1, n_ctx=32, experts="disk", verify=False) as eng:
        assert eng.residency.mode == "disk" and eng.expert_cache is not None
    assert len(built) == 1 and len(asked) == 1
    built.clear()
    with Engine.load(moe_model, threads=1, n_ctx=32, experts="ram", verify=False) as eng:
        assert eng.residency.mode == "ram"
    assert len(built) == 2  # the cache-sizing plan, then the one RAM experts run (no delay)


# ---- one mapping from flags: the CLI, bench and serve agree -------------------------------------
# flags every engine-loading command has, and those only generate / chat / serve have
SHARED = ["--no-verify", "--no-hugepages", "-ctk", "q8_0", "--experts", "ram", "--expert-io", "sync", "--expert-speculation", "off",
          "--expert-cache", "64M"]
MODEL = ["-t", "1", "-c", "48", "--no-mmap", "--readahead", "off"]
FLAGS = MODEL + SHARED


def _parse(command: str, argv: list[str]) -> argparse.Namespace:
    from cflow.cli import build_parser

    return build_parser().parse_args([command, *argv])


def _recording(monkeypatch) -> list[EngineOptions]:
    """Every EngineOptions Engine.load resolves, in order (the loads still run)."""
    seen: list[EngineOptions] = []
    real = Engine.load.__func__

    def load(cls, path=None, options=None, **kw):
        seen.append(EngineOptions.build(options, **{k: v for k, v in kw.items() if k not in ("progress", "log")}))
        return real(cls, path, options, **kw)

    monkeypatch.setattr(Engine, "load", classmethod(load))
    return seen


def test_flags_map_to_options_in_one_place():
    from cflow.cli.common import engine_options

    args = _parse("generate", ["-m", "x.cflow", *FLAGS, "hello"])
    want = EngineOptions(threads=1, n_ctx=48, verify=False, mmap=False, hugepages=False, readahead="off", cache_type_k="q8_0",
                         experts="ram", expert_io="sync", expert_speculation=0, expert_cache="64M")
    assert engine_options(args) == want
    assert engine_options(_parse("generate", ["hello"])) == EngineOptions()
    with pytest.raises(EngineError) as e:
        engine_options(_parse("generate", ["--expert-speculation", "sometimes", "hello"]))
    assert e.value.flag == "--expert-speculation"


def test_cli_bench_and_serve_load_the_same_options(dense_model, monkeypatch):
    from cflow.bench import bench
    from cflow.cli import common
    from cflow.cli import bench as cli_bench
    from cflow.cli import serve as cli_serve
    from cflow.serve.backend import load_backend

    model = ["-m", str(dense_model)]
    seen = _recording(monkeypatch)
    gen = _parse("generate", [*model, *FLAGS, "hi"])
    with common.load_engine(gen):
        pass
    cli_opts = seen[-1]
    assert cli_opts == common.engine_options(gen)

    # serve: its -c is every slot's context together; everything else is the same option
    srv = _parse("serve", [*model, "-t", "1", "-c", "96", "--parallel", "2", *MODEL[4:], *SHARED])
    srv_opts = common.engine_options(srv, n_ctx=96 // 2)
    assert srv_opts == cli_opts
    for batched in (True, False):
        seen.clear()
        load_backend(srv.model, n_slots=2, options=srv_opts, batched=batched).close()
        assert seen[0] == cli_opts.replace(n_seq=2 if batched else 1)
    assert "engine_options(args, n_ctx=per_slot)" in open(cli_serve.__file__).read()

    # bench: -t is a list of counts and the context is sized to the tests (and it has no mapping
    # or read-ahead flags); the rest is the same
    bn = _parse("bench", [*model, "-t", "1", *SHARED])
    bench_opts = cli_bench._options(bn)
    like_bench = cli_opts.replace(threads=None, n_ctx=None, mmap=True, readahead="auto")
    assert bench_opts == like_bench
    seen.clear()
    rep = bench(bn.model, threads=bn.threads, pp=0, tg=2, reps=1, warmup=False, probe=False, footprint=False,
                options=bench_opts)
    assert seen and all(o.replace(threads=None, n_ctx=None) == like_bench and o.threads == 1 for o in seen)
    assert all(r.cache_type_k == "q8_0" for r in rep.rows)
    # the keyword form bench() always took gives the same loads
    seen_kw = list(seen)
    seen.clear()
    bench(bn.model, threads=[1], pp=0, tg=2, reps=1, warmup=False, probe=False, footprint=False,
          **{k: v for k, v in bench_opts.to_dict().items() if k not in ("threads", "n_ctx")})
    assert seen == seen_kw
