"""The family compared at equal budget (claim T1, and the MoE family's table): presets x seeds.

Owns `compare()`: it trains each preset (default arch1, arch2, arch3, arch4, arch2_4_combined,
arch5) for every seed with the same data, geometry, batch and token budget, each (preset, seed)
run in its own checkpoint directory `RUNS/PRESET/seedN`, then writes `OUT/train_compare.md` (a
table: val loss, perplexity, top-1 accuracy as mean with a 95% confidence interval over the seeds,
total and active parameters, weight bytes per token and the critical path from
`cflow.dag.analyze`, wall time and tokens/s; and the paired difference of every preset from the
first, seed by seed), `OUT/train_compare.json` (every run's numbers and loss curves) and
`OUT/train_compare_loss.png` (validation loss against tokens, every run).

Runs resume: a run whose checkpoint already holds its last step is read back, not trained again
(its curves come from its log); one that stopped part-way (Ctrl-C, a crash, a reboot) continues
exactly from its checkpoint; a directory holding a run with other settings is an error rather
than silently mixed in. So a comparison of many hours can be run again after any interruption and
picks up where it was. Each finished run also leaves a record, `OUT/runs/PRESET/seedN.json` (its
summary, curves, settings and machine: a few kilobytes, to commit beside the report), and a run
whose checkpoint is gone (another machine, a cleaned runs directory) is read back from its record
when the record's settings are the comparison's: a table of runs trained over days on different
machines survives the loss of the checkpoints.

Data: a finished run (checkpoint or record) is read back whatever the corpus file at its path
holds now, so every run's data key (corpus contents, tokenizer and split) is checked against the
others' as the runs come, and a table of runs that read different corpora is an error, raised at
the first run that disagrees, before any report is written.

Pairing: runs of one seed share that seed's initialisation stream and batch order, so a preset's
difference from the reference is taken seed by seed and its mean gets a t interval over the seeds
(n - 1 degrees of freedom): the noise shared by a seed's runs cancels.

Budget: `tokens` (the same for all: a fair quality comparison) or `minutes_per_run` (the same
wall time: each preset's step count comes from timing a few steps of it first).

The report directory and the runs directory are checked writable before the first run; a write
that fails later is a `cflow.fsutil.WriteError` naming the file.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from cflow.config import ModelConfig
from cflow.errors import CflowError
from cflow.fsutil import atomic_write_text, check_writable, writing
from cflow.train import checkpoint as ckpt
from cflow.train.loop import (RESUME_FIXED, TrainConfig, TrainResult, describe_device, describe_machine,
                              resolve_device, train)
from cflow.train.stats import mean_ci

DEFAULT_PRESETS = ("arch1", "arch2", "arch3", "arch4", "arch2_4_combined", "arch5")
REPORT = "train_compare.md"
JSON_REPORT = "train_compare.json"
PLOT = "train_compare_loss.png"
DAG_QUANT = "q4_0"
RECORDS = "runs"  # OUT/runs/PRESET/seedN.json: one finished run's summary and settings
RECORD_FORMAT = 1
# The settings runs of one table must share (besides the model config): a checkpoint or a record
# with others belongs to another comparison.
FIXED = (*RESUME_FIXED, "tokens", "steps", "lr", "warmup", "min_lr_ratio", "weight_decay", "lb_weight", "z_weight")


class CompareError(CflowError):
    """The comparison is misconfigured (no budget, unknown preset) or its runs directory holds other runs."""


@dataclass
class RunSummary:
    preset: str
    params: int
    steps: int
    tokens: int
    val_loss: float
    val_ppl: float
    val_acc: float
    train_s: float
    tok_per_s: float
    dag: dict[str, Any] | None  # total_bytes, critical_bytes, ratio (total / critical) at DAG_QUANT
    curve: list[tuple[int, float]] = field(default_factory=list)  # (tokens, train cross-entropy)
    warmup: int = 0
    val_curve: list[tuple[int, float]] = field(default_factory=list)  # (tokens, val loss)
    config: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    active_params: int = 0  # parameters a token's forward pass uses (top_k of the experts)
    run_dir: str = ""
    data_key: str = ""  # cflow.train.data.TokenData.key: corpus contents, tokenizer, split ("" unknown)
    train_tokens: int = 0  # tokens in the corpus's training split (one epoch), and in its held-out split
    val_tokens: int = 0
    machine: str = ""  # where it trained: architecture, CPU model, torch device and precision


def active_params(cfg: ModelConfig, total: int) -> int:
    """Parameters one token's forward pass touches: all but the experts it is not routed to."""
    if not cfg.has_moe:
        return total
    per_expert = 3 * cfg.d_model * cfg.d_expert
    return total - cfg.n_unique_layers * (cfg.n_experts - cfg.top_k) * per_expert


def compare(presets: tuple[str, ...] | list[str] = DEFAULT_PRESETS, *, base: TrainConfig | None = None,
            tokens: int | None = None, minutes_per_run: float | None = None, overrides: list[str] = (),
            runs_dir: str | Path = "runs/compare", out_dir: str | Path = "docs/results",
            seeds: tuple[int, ...] | list[int] | None = None, command: str | None = None,
            progress: bool | Callable[[dict], None] = False) -> list[RunSummary]:
    """Train every preset for every seed (default: base.seed alone) on the same budget, resuming what
    is already in `runs_dir`; write the report files; return one summary per run, seed by seed."""
    if (tokens is None) == (minutes_per_run is None):
        raise CompareError("give exactly one budget: tokens (same tokens per run) or minutes_per_run")
    base = base or TrainConfig()
    seeds = list(seeds) if seeds else [base.seed]
    configs = [ModelConfig.from_name(p).with_overrides(list(overrides)) for p in presets]
    runs, out = Path(runs_dir), Path(out_dir)
    for path in [out / REPORT, *(runs / c.name for c in configs)]:  # before hours of training, not after
        check_writable(path)
    summaries: list[RunSummary] = []
    check_one_corpus([_data_key(runs / c.name / f"seed{s}") for s in seeds for c in configs])
    for seed in seeds:
        for cfg in configs:
            if tokens is not None:
                tc = dataclasses.replace(base, tokens=tokens, seed=seed)
            else:
                tc = dataclasses.replace(base, tokens=0, seed=seed,
                                         steps=_steps_for_time(cfg, base, minutes_per_run * 60.0))
            # A warmup longer than a tenth of the run would leave a short run near lr 0 throughout.
            tc = dataclasses.replace(tc, eval_every=tc.eval_every or max(1, tc.total_steps // 10),
                                     warmup=min(tc.warmup, max(1, tc.total_steps // 10)))
            summaries.append(_run(cfg, tc, runs / cfg.name / f"seed{seed}", command, progress,
                                  record_path(out, cfg.name, seed)))
            check_one_corpus([(s.run_dir, s.data_key) for s in summaries])
    write_report(summaries, out, base=base, tokens=tokens, minutes_per_run=minutes_per_run,
                 overrides=list(overrides), command=command)
    return summaries


def _run(cfg: ModelConfig, tc: TrainConfig, run_dir: Path, command: str | None,
         progress: bool | Callable[[dict], None], record: Path) -> RunSummary:
    """One (preset, seed) run: read back when finished (from its checkpoint, else from its record),
    resumed when part-way, else trained; its record written once it is finished."""
    state = _existing(run_dir, cfg, tc)
    if state == "new" and record.is_file():
        state = "recorded"
    if callable(progress):
        progress({"event": "run", "preset": cfg.name, "seed": tc.seed, "steps": tc.total_steps,
                  "state": state, "dir": str(record if state == "recorded" else run_dir)})
    if state == "recorded":
        return read_record(record, cfg, tc, run_dir)
    if state == "done":
        summary = _summary_from_disk(run_dir, tc)
    else:
        res = train(cfg, tc, out_dir=run_dir, resume=state == "partial", overwrite=False, progress=progress,
                    meta={"command": command, "compare": True})
        summary = _summarize(cfg, res, tc, run_dir)
    write_record(record, summary, tc)
    return summary


# ---- records: a finished run without its checkpoint ------------------------------------------
def record_path(out: Path, preset: str, seed: int) -> Path:
    return Path(out) / RECORDS / preset / f"seed{seed}.json"


def write_record(path: Path, summary: RunSummary, tc: TrainConfig) -> None:
    """The run's summary (its run_dir left out: a path of the machine it trained on) and settings."""
    body = dataclasses.asdict(summary) | {"run_dir": ""}
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"format": RECORD_FORMAT, "train_config": {k: getattr(tc, k) for k in FIXED},
                                            "summary": body}, indent=1) + "\n")


def read_record(path: Path, cfg: ModelConfig, tc: TrainConfig, run_dir: Path) -> RunSummary:
    """The summary a record holds; CompareError when it is unreadable or its run had other settings."""
    try:
        rec = json.loads(path.read_text())
        saved, body = rec["train_config"], rec["summary"]
        if rec.get("format") != RECORD_FORMAT:
            raise ValueError(f"format {rec.get('format')!r}, this cflow reads {RECORD_FORMAT}")
        summary = RunSummary(**{**body, "run_dir": str(run_dir),
                                "curve": [tuple(p) for p in body.get("curve", [])],
                                "val_curve": [tuple(p) for p in body.get("val_curve", [])]})
        recorded = ModelConfig.from_dict(summary.config)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CompareError(f"{path}: not a readable run record ({e}); remove it to train that run again") from e
    diff = {k: (saved.get(k), getattr(tc, k)) for k in FIXED if saved.get(k) != getattr(tc, k)}
    if recorded.replace(vocab_size=cfg.vocab_size) != cfg:
        diff["model config"] = "differs"
    if diff:
        raise CompareError(f"{path} records a run with other settings (its, now): {diff}; give another --out, "
                           "or remove that record to train the run again")
    return summary


def _existing(run_dir: Path, cfg: ModelConfig, tc: TrainConfig) -> str:
    """"new", "partial" or "done"; CompareError when run_dir holds a run with other settings."""
    if not ckpt.is_checkpoint(run_dir):
        return "new"
    meta = json.loads((run_dir / "meta.json").read_text())
    saved = meta.get("train_config", {})
    diff = {k: (saved.get(k), getattr(tc, k)) for k in FIXED if saved.get(k) != getattr(tc, k)}
    c = ckpt.load_checkpoint(run_dir, with_train_state=False).config
    if c.replace(vocab_size=cfg.vocab_size) != cfg:
        diff["model config"] = "differs"
    if diff:
        raise CompareError(f"{run_dir} holds a run with other settings (its, now): {diff}; give another "
                           "--runs-dir, or remove that directory to train it again")
    return "done" if int(meta.get("step", 0)) >= tc.total_steps else "partial"


def _data_key(run_dir: Path) -> tuple[str, str]:
    """(run_dir, the data key its checkpoint was trained on); "" when there is no checkpoint yet."""
    if not ckpt.is_checkpoint(run_dir):
        return str(run_dir), ""
    key = json.loads((run_dir / "meta.json").read_text()).get("data_key")
    if key is None:  # a checkpoint written before meta.json carried the key: its train state has it
        key = ckpt.load_checkpoint(run_dir).train_state.get("data_key")
    return str(run_dir), key or ""


def check_one_corpus(keys: list[tuple[str, str]]) -> None:
    """CompareError unless every known data key in [(run_dir, key)] is the same ("" is unknown)."""
    groups: dict[str, list[str]] = {}
    for run_dir, key in keys:
        if key:
            groups.setdefault(key, []).append(run_dir)
    if len(groups) > 1:
        listed = "; ".join(f"data key {k[:12]}: {', '.join(dirs)}" for k, dirs in groups.items())
        raise CompareError(f"the runs were trained on different data (the corpus file at the same path "
                           f"changed, or its tokenization): {listed}. Remove the runs of the old corpus "
                           "to train them again on the current one, or give another --runs-dir")


def _summary_from_disk(run_dir: Path, tc: TrainConfig) -> RunSummary:
    c = ckpt.load_checkpoint(run_dir, with_train_state=False)
    meta = c.meta
    ev = meta.get("eval") or {}
    curve, val_curve = [], []
    log = run_dir / ckpt.LOG_NAME
    if log.is_file():
        with open(log, newline="") as f:
            for r in csv.DictReader(f):
                if r.get("ce"):
                    curve.append((int(r["tokens"]), float(r["ce"])))
                if r.get("val_loss"):
                    val_curve.append((int(r["tokens"]), float(r["val_loss"])))
    elapsed = float(meta.get("elapsed_s", 0.0))
    tokens = int(meta.get("tokens_seen", 0))
    data = {"data_key": _data_key(run_dir)[1], "train_tokens": int(meta.get("train_tokens", 0)),
            "val_tokens": int(meta.get("val_tokens", 0)),
            # a checkpoint older than meta's "machine" was written here, or the run could not resume
            "machine": meta.get("machine") or describe_machine(meta.get("device", "cpu"))}
    return _summary(c.config, int(meta.get("params", 0)), int(meta.get("step", 0)), tokens, ev, elapsed, curve,
                    val_curve, tc, run_dir, data)


def _steps_for_time(cfg: ModelConfig, tc: TrainConfig, seconds: float, probe_steps: int = 3) -> int:
    """Steps that fit in `seconds` for this preset: time a few forward/backward passes."""
    from cflow.model import Transformer
    from cflow.train.loop import make_optimizer

    torch.manual_seed(tc.seed)
    model = Transformer(cfg)
    opt = make_optimizer(model, tc)
    x = torch.randint(0, cfg.vocab_size, (tc.batch_size, tc.seq_len))  # [B, T]
    times = []
    for _ in range(probe_steps + 1):  # the first pass warms allocator and kernels up
        t0 = time.perf_counter()
        logits, aux = model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x.reshape(-1))
        opt.zero_grad(set_to_none=True)
        (loss + aux["load_balance"] + aux["router_z"]).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    per_step = sum(times[1:]) / probe_steps
    return max(1, int(seconds / per_step))


def _summarize(cfg: ModelConfig, res: TrainResult, tc: TrainConfig, run_dir: Path) -> RunSummary:
    """The run as its checkpoint and log hold it: a resumed run's curves span every segment."""
    if ckpt.is_checkpoint(run_dir):
        return _summary_from_disk(run_dir, tc)
    final = res.evals[-1] if res.evals else {}
    return _summary(res.config, res.n_params, res.steps, res.tokens_seen, final, res.elapsed_s,
                    [(int(h["tokens"]), float(h["ce"])) for h in res.history],  # CE: comparable with val loss
                    [(int(e["tokens"]), float(e["val_loss"])) for e in res.evals], tc, run_dir,
                    {"machine": describe_machine(describe_device(resolve_device(tc), tc.precision))})


def _summary(config: ModelConfig, params: int, steps: int, tokens: int, final: dict, train_s: float,
             curve: list, val_curve: list, tc: TrainConfig, run_dir: Path, data: dict | None = None) -> RunSummary:
    try:
        from cflow.dag import analyze

        rep = analyze(config, DAG_QUANT).to_dict()
        dag = {k: rep[k] for k in ("total_bytes", "critical_bytes", "ratio")}
    except ImportError:
        dag = None
    return RunSummary(
        preset=config.name, params=params, steps=steps, tokens=tokens,
        val_loss=final.get("val_loss", math.nan), val_ppl=final.get("val_ppl", math.nan),
        val_acc=final.get("val_acc", math.nan), train_s=train_s,
        tok_per_s=tokens / train_s if train_s > 0 else math.nan, dag=dag, curve=curve, val_curve=val_curve,
        config=config.to_dict(), warmup=tc.warmup, seed=tc.seed, active_params=active_params(config, params),
        run_dir=str(run_dir), **(data or {}),
    )


# ---- report ----------------------------------------------------------------------------------
def write_report(summaries: list[RunSummary], out: Path, *, base: TrainConfig, tokens: int | None,
                 minutes_per_run: float | None, overrides: list[str], command: str | None) -> Path:
    with writing(out):
        out.mkdir(parents=True, exist_ok=True)
    plot_ok = plot_losses(summaries, out / PLOT)
    with writing(out / JSON_REPORT):
        atomic_write_text(out / JSON_REPORT, json.dumps(
            {"command": command, "base": base.to_dict(), "tokens": tokens, "minutes_per_run": minutes_per_run,
             "overrides": overrides, "runs": [dataclasses.asdict(s) for s in summaries]}, indent=1) + "\n")
    with writing(out / REPORT):
        atomic_write_text(out / REPORT, render_markdown(summaries, base=base, tokens=tokens,
                                                        minutes_per_run=minutes_per_run, overrides=overrides,
                                                        command=command, plot=PLOT if plot_ok else None))
    return out / REPORT


def by_preset(summaries: list[RunSummary]) -> dict[str, list[RunSummary]]:
    """The runs of each preset, presets in first-seen order, runs in seed order."""
    out: dict[str, list[RunSummary]] = {}
    for x in summaries:
        out.setdefault(x.preset, []).append(x)
    for runs in out.values():
        runs.sort(key=lambda x: x.seed)
    return out


def paired_differences(summaries: list[RunSummary], metric: str = "val_loss") -> dict[str, dict[str, Any]]:
    """Each preset's `metric` minus the first preset's, seed by seed (only seeds both have):
    {preset: {"diffs": [...], "seeds": [...], "mean": m, "ci95": h}}."""
    groups = by_preset(summaries)
    if not groups:
        return {}
    ref_name, ref_runs = next(iter(groups.items()))
    ref = {x.seed: getattr(x, metric) for x in ref_runs}
    out = {}
    for name, runs in list(groups.items())[1:]:
        pairs = [(x.seed, getattr(x, metric) - ref[x.seed]) for x in runs if x.seed in ref]
        m, h = mean_ci([d for _, d in pairs])
        out[name] = {"reference": ref_name, "seeds": [s_ for s_, _ in pairs], "diffs": [d for _, d in pairs],
                     "mean": m, "ci95": h}
    return out


def _pm(m: float, h: float, fmt: str) -> str:
    return format(m, fmt) + ("" if math.isnan(h) else " ± " + format(h, fmt))


def _corpus_lines(summaries: list[RunSummary]) -> list[str]:
    """What every run read (compare checked it is one corpus): split sizes, epochs, data key."""
    known = [s for s in summaries if s.train_tokens]
    if not known:
        return []
    s0 = known[0]
    epochs = sorted({f"{s.tokens / s.train_tokens:.2f}" for s in known})
    key = f"; data key {s0.data_key[:12]} (corpus contents, tokenizer and split; the same for every run)" \
        if s0.data_key else ""
    return [f"Corpus: {s0.train_tokens:,} training tokens, {s0.val_tokens:,} held out; "
            f"{' / '.join(epochs)} epochs per run{key}.", ""]


def _machine_lines(summaries: list[RunSummary], base: TrainConfig) -> list[str]:
    """Where the runs trained: one machine, or each machine with its runs (records can come from several)."""
    here = describe_machine(describe_device(resolve_device(base), base.precision), base.threads)
    machines: dict[str, list[str]] = {}
    for s in summaries:
        machines.setdefault(s.machine or here, []).append(f"{s.preset} seed {s.seed}")
    if len(machines) <= 1:
        return [f"Machine: {next(iter(machines), here)}.", ""]
    return ["Machines (train s and tok/s compare only runs of one machine):", "",
            *(f"- {m}: {', '.join(runs)}" for m, runs in machines.items()), ""]


def render_markdown(summaries: list[RunSummary], *, base: TrainConfig, tokens: int | None,
                    minutes_per_run: float | None, overrides: list[str], command: str | None,
                    plot: str | None) -> str:
    groups = by_preset(summaries)
    geo = summaries[0].config if summaries else {}
    warmups = "/".join(sorted({str(s.warmup) for s in summaries})) or str(base.warmup)
    seeds = sorted({s.seed for s in summaries})
    budget = f"{tokens:,} tokens per run" if tokens is not None else f"{minutes_per_run:g} minutes per run"
    lines = [
        "# The architecture family trained at equal budget",
        "",
        f"Command: `{command}`" if command else "Command: (library call)",
        "",
        f"Budget: {budget}; global batch {base.batch_size} x seq_len {base.seq_len}; lr {base.lr:g} "
        f"(warmup {warmups} steps, cosine to {base.min_lr_ratio:g}x); seeds {', '.join(map(str, seeds))}; "
        f"lb_weight {base.lb_weight:g}, z_weight {base.z_weight:g}; data: {base.data or 'shipped stories corpus'}.",
        "",
        *_corpus_lines(summaries),
        f"Geometry (every preset): d_model {geo.get('d_model')}, {geo.get('n_layers')} layers, "
        f"{geo.get('n_heads')}/{geo.get('n_kv_heads')} heads, d_ff {geo.get('d_ff')}, "
        f"{geo.get('n_experts')} experts top-{geo.get('top_k')} of d_expert {geo.get('d_expert')}, "
        f"vocab {geo.get('vocab_size')}" + (f"; overrides {overrides}" if overrides else "") + ".",
        "",
        *_machine_lines(summaries, base),
        f"Written {time.strftime('%Y-%m-%d %H:%M')} with torch {torch.__version__}.",
        "",
        "Each value is the mean over the seeds ± the half-width of its 95% t interval (none with one seed).",
        "",
        f"| preset | runs | params (active) | val loss | val ppl | top-1 acc | weight bytes/token ({DAG_QUANT}) | "
        "critical path bytes | critical / total | tokens | train s | tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in groups.items():
        s0 = runs[0]
        if s0.dag:
            dag_cells = f"{s0.dag['total_bytes']:,} | {s0.dag['critical_bytes']:,} | " \
                        f"{s0.dag['critical_bytes'] / s0.dag['total_bytes']:.3f}"
        else:
            dag_cells = "n/a | n/a | n/a"
        loss, ppl, acc = (mean_ci([getattr(x, k) for x in runs]) for k in ("val_loss", "val_ppl", "val_acc"))
        secs = mean_ci([x.train_s for x in runs])[0]
        tps = mean_ci([x.tok_per_s for x in runs])[0]
        lines.append(f"| {name} | {len(runs)} | {s0.params:,} ({s0.active_params:,}) | {_pm(*loss, '.4f')} | "
                     f"{_pm(*ppl, '.2f')} | {_pm(*acc, '.4f')} | {dag_cells} | {s0.tokens:,} | {secs:,.0f} | "
                     f"{tps:,.0f} |")
    diffs = paired_differences(summaries)
    if diffs:
        ref = next(iter(diffs.values()))["reference"]
        lines += ["", f"Paired difference of validation loss from {ref} (same seed: same initial stream and "
                  "batches), nats; negative is better:", "",
                  "| preset | mean difference ± 95% CI | per seed |", "|---|---:|---|"]
        for name, d in diffs.items():
            per = ", ".join(f"{s_}: {v:+.4f}" for s_, v in zip(d["seeds"], d["diffs"]))
            lines.append(f"| {name} | {_pm(d['mean'], d['ci95'], '+.4f')} | {per} |")
    lines += [
        "",
        "How to read it: val loss / perplexity / top-1 accuracy are measured on the held-out stories "
        "(split by a hash of each story) at the end of each run. Weight bytes per token and the critical "
        "path come from `cflow.dag.analyze` (arithmetic, not a measurement): the delays do not shrink "
        "the total bytes per token, they shorten the chain of bytes that must stream one after another. "
        "arch5 counts its shared parameters once but streams every layer's set per token. "
        "A difference whose interval contains 0 is not distinguishable from run-to-run noise at this "
        "number of seeds. Train s and tok/s are each run's wall-clock time summed over its resumed "
        "segments, including any time it shared the CPU or was paused: they time these runs, not the "
        "training loop (benchmarks/train_speed.py measures that).",
    ]
    if plot:
        lines += ["", f"![loss curves]({plot})"]
    return "\n".join(lines) + "\n"


def plot_losses(summaries: list[RunSummary], path: Path) -> bool:
    """Training loss (smoothed) and validation loss against tokens, every run, one colour per
    preset; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, runs) in enumerate(by_preset(summaries).items()):
        colour = colours[i % len(colours)]
        for j, s in enumerate(runs):
            label = name if j == 0 else None
            if s.curve:
                xs, ys = zip(*s.curve)
                ax.plot(xs, _smooth(list(ys)), color=colour, linewidth=1.0, alpha=0.6, label=label)
                label = None
            if s.val_curve:
                vx, vy = zip(*s.val_curve)
                ax.plot(vx, vy, "o--", color=colour, markersize=3, linewidth=0.8, label=label)
    ax.set_xlabel("tokens")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("training cross-entropy (lines, smoothed) and validation loss (dots), every seed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        with writing(path):
            fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
    return True


def _smooth(ys: list[float], beta: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average (as TensorBoard's smoothing)."""
    out, avg = [], 0.0
    for i, y in enumerate(ys, 1):
        avg = beta * avg + (1 - beta) * y
        out.append(avg / (1 - beta**i))
    return out
