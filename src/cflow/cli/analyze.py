"""`cflow analyze`: weight bytes per token, critical path and slack of one decode step (cflow.dag)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cflow.config import PRESETS, ModelConfig
from cflow.dag import CATEGORIES, QUANTS, Report, analyze, build_dag, to_dot
from cflow.cli.common import FileError, UsageError, add_command, write_text
from cflow.fsutil import check_writable


HELP = """\
bytes per token, critical path and slack of one decode step

Build the dependency DAG of one decode step (attention, dense FFN, router, the top-k experts,
lm_head; edges from the delta_dense / delta_expert delays) and report the weight bytes read per
token, the critical path (the bytes that must stream one after another even when independent
nodes overlap), their ratio, the split by category and each node's slack. This is arithmetic,
not a measurement. The delays never shrink the total bytes per token; they shorten the chain,
which lets the runtime overlap work.

--plan also prints the op list the engine runs per token (cflow.runtime.plan). MB = 10^6 bytes.

examples:
  cflow analyze --preset arch2_4_combined
  cflow analyze --preset arch1 --set n_layers=12 --set d_model=256 --quant q8_0
  cflow analyze --config runs/arch4/config.json --json
  cflow analyze --config smollm2.cflow --plan
  cflow analyze --preset arch5 --dot arch5.dot   # then: dot -Tsvg arch5.dot > arch5.svg
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "analyze", HELP)
    p.add_argument("--preset", choices=sorted(PRESETS), metavar="NAME",
                   help=f"start from a named architecture ({', '.join(sorted(PRESETS))})")
    p.add_argument("--config", metavar="FILE",
                   help="start from a config: a config.json, a checkpoint directory holding one, "
                   "or a .cflow/.vflow file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="override one config field (repeatable), e.g. --set n_layers=12")
    p.add_argument("--quant", choices=QUANTS, default="q4_0",
                   help="weight format the bytes are counted in (default q4_0; norms and router are f32)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--dot", metavar="FILE", help="also write the DAG as Graphviz source (critical path in red)")
    p.add_argument("--plan", action="store_true",
                   help="also print the engine's op plan for one token: one line per op, with the ring and "
                   "pending buffers the delays use (in --json: a \"plan\" list)")
    p.set_defaults(func=run)


def load_config(preset: str | None, config: str | None, overrides: list[str]) -> ModelConfig:
    if (preset is None) == (config is None):
        raise UsageError("give exactly one of --preset NAME or --config FILE")
    if preset is not None:
        cfg = ModelConfig.from_name(preset)
    else:
        cfg = _config_from_path(Path(config))
    return cfg.with_overrides(overrides) if overrides else cfg


def _config_from_path(path: Path) -> ModelConfig:
    if path.suffix in (".cflow", ".vflow"):
        from cflow.fileformat import open_model

        with open_model(path) as cf:
            return cf.config
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UsageError(f"config file {str(path)!r} does not exist; pass a config.json, a checkpoint "
                         f"directory or a .cflow file", flag="--config")
    try:
        return ModelConfig.from_json(path.read_text())
    except OSError as e:
        raise FileError(f"cannot read {path}: {e.strerror or e}") from None


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.preset, args.config, args.overrides)
    if args.dot:
        check_writable(args.dot, file=True)
    report = analyze(cfg, args.quant)
    plan = _plan_lines(cfg) if args.plan else None
    if args.dot:
        write_text(args.dot, to_dot(build_dag(cfg, args.quant)))
    if args.json:
        print(json.dumps(dict(report.to_dict(), **({"plan": plan} if plan is not None else {})), indent=2))
        return 0
    print_report(report, cfg)
    if plan is not None:
        print(f"\nop plan for one token ({len(plan)} ops; ring[i]: residual history, pending[i]: expert "
              f"outputs waiting for their delayed layer)")
        print("\n".join(plan))
    if args.dot:
        print(f"\nwrote {args.dot}")
    return 0


def _plan_lines(cfg: ModelConfig) -> list[str]:
    from cflow.runtime.plan import build_plan

    return build_plan(cfg).describe().splitlines()


def _mb(n: int) -> str:
    return f"{n / 1e6:10.3f}"


def print_report(r: Report, cfg: ModelConfig) -> None:
    moe = f"{cfg.n_experts} experts top-{cfg.top_k}" if cfg.has_moe else "no MoE"
    shared = f", {cfg.n_unique_layers} unique weight sets" if cfg.n_unique_layers < cfg.n_layers else ""
    print(f"config   {cfg.name}: {cfg.n_layers} layers, d_model {cfg.d_model}, d_ff {cfg.d_ff}, {moe}, "
          f"delta_dense {cfg.delta_dense}, delta_expert {cfg.delta_expert}, moe_input {cfg.moe_input}{shared}")
    print(f"quant    {r.quant} (norms and router f32)\n")
    print(f"total weight bytes/token   {_mb(r.total_bytes)} MB   (sequential schedule)")
    print(f"critical-path bytes/token  {_mb(r.critical_bytes)} MB")
    print(f"ratio total/critical       {r.ratio:10.3f} x\n")
    print(f"{'category':<12} {'total MB':>10} {'share':>7} {'critical MB':>12}")
    for c in CATEGORIES:
        share = r.split[c] / r.total_bytes
        print(f"{c:<12} {_mb(r.split[c])} {share:7.1%} {_mb(r.critical_split[c]):>12}")
    print(f"\ncritical path: {' -> '.join(r.critical_path)}\n")
    print(f"{'node':<14} {'MB':>10} {'earliest MB':>12} {'latest MB':>10} {'slack MB':>10}")
    for n in r.nodes:
        mark = "  *" if n.critical else ""
        print(f"{n.name:<14} {_mb(n.nbytes)} {_mb(n.earliest_start):>12} {_mb(n.latest_start)} "
              f"{_mb(n.slack)}{mark}")
    print("\n* on a critical path (slack 0). Starts and slack are measured in bytes streamed along "
          "the critical path.")
