"""Claim T1: train the architecture family on one budget and compare quality and bandwidth.

Owns `compare()`: it trains each preset (default arch1, arch2, arch3, arch4, arch2_4_combined,
arch5) with the same data, seed, geometry, batch and token budget, then writes
`OUT/train_compare.md` (a table: val loss, perplexity, top-1 accuracy, parameters, weight bytes
per token and the critical path from `cflow.dag.analyze`), `OUT/train_compare.json` (the same
numbers plus loss curves) and `OUT/train_compare_loss.png` (training and validation loss
against tokens).

Geometry: the presets' own (config.py `_SMALL` + `_MOE`): vocab 4096, d_model 128, 6 layers, 4
heads / 2 kv heads, dense d_ff 256, 4 experts top-1 of d_expert 256, tied embeddings: about
3.8M parameters (arch5 shares 2 weight sets across the 6 layers: about 1.6M unique parameters,
same compute and same bytes streamed per token). `overrides` changes every preset alike.

Budget: `tokens` (the same for all: a fair quality comparison) or `minutes_per_run` (the same
wall time: each preset's step count comes from timing a few steps of it first).

The report directory and the runs directory are checked writable before the first run; a write
that fails later is a `cflow.fsutil.WriteError` naming the file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from cflow.config import ModelConfig
from cflow.errors import CflowError
from cflow.fsutil import atomic_write_text, check_writable, writing
from cflow.train.loop import TrainConfig, TrainResult, train

DEFAULT_PRESETS = ("arch1", "arch2", "arch3", "arch4", "arch2_4_combined", "arch5")
REPORT = "train_compare.md"
JSON_REPORT = "train_compare.json"
PLOT = "train_compare_loss.png"
DAG_QUANT = "q4_0"


class CompareError(CflowError):
    """The comparison is misconfigured (no budget, unknown preset)."""


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


def compare(presets: tuple[str, ...] | list[str] = DEFAULT_PRESETS, *, base: TrainConfig | None = None,
            tokens: int | None = None, minutes_per_run: float | None = None, overrides: list[str] = (),
            runs_dir: str | Path = "runs/compare", out_dir: str | Path = "docs/results",
            command: str | None = None, progress: bool | Callable[[dict], None] = False) -> list[RunSummary]:
    """Train every preset on the same budget; write the report files; return one summary per preset."""
    if (tokens is None) == (minutes_per_run is None):
        raise CompareError("give exactly one budget: tokens (same tokens per run) or minutes_per_run")
    base = base or TrainConfig()
    configs = [ModelConfig.from_name(p).with_overrides(list(overrides)) for p in presets]
    runs, out = Path(runs_dir), Path(out_dir)
    for path in [out / REPORT, *(runs / c.name for c in configs)]:  # before hours of training, not after
        check_writable(path)
    summaries = []
    for cfg in configs:
        if tokens is not None:
            tc = dataclasses.replace(base, tokens=tokens)
        else:
            tc = dataclasses.replace(base, tokens=0, steps=_steps_for_time(cfg, base, minutes_per_run * 60.0))
        # A warmup longer than a tenth of the run would leave a short run near lr 0 throughout.
        tc = dataclasses.replace(tc, eval_every=tc.eval_every or max(1, tc.total_steps // 10),
                                 warmup=min(tc.warmup, max(1, tc.total_steps // 10)))
        if callable(progress):
            progress({"event": "run", "preset": cfg.name, "steps": tc.total_steps})
        res = train(cfg, tc, out_dir=runs / cfg.name, overwrite=True, progress=progress,
                    meta={"command": command, "compare": True})
        summaries.append(_summarize(cfg, res, tc))
    write_report(summaries, out, base=base, tokens=tokens, minutes_per_run=minutes_per_run,
                 overrides=list(overrides), command=command)
    return summaries


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


def _summarize(cfg: ModelConfig, res: TrainResult, tc: TrainConfig) -> RunSummary:
    final = res.evals[-1] if res.evals else {}
    train_s = res.elapsed_s
    try:
        from cflow.dag import analyze

        rep = analyze(res.config, DAG_QUANT).to_dict()
        dag = {k: rep[k] for k in ("total_bytes", "critical_bytes", "ratio")}
    except ImportError:
        dag = None
    return RunSummary(
        preset=cfg.name, params=res.n_params, steps=res.steps, tokens=res.tokens_seen,
        val_loss=final.get("val_loss", math.nan), val_ppl=final.get("val_ppl", math.nan),
        val_acc=final.get("val_acc", math.nan), train_s=train_s,
        tok_per_s=res.tokens_seen / train_s if train_s > 0 else math.nan, dag=dag,
        curve=[(int(h["tokens"]), float(h["ce"])) for h in res.history],  # CE: comparable with val loss
        val_curve=[(int(e["tokens"]), float(e["val_loss"])) for e in res.evals],
        config=res.config.to_dict(), warmup=tc.warmup,
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


def render_markdown(summaries: list[RunSummary], *, base: TrainConfig, tokens: int | None,
                    minutes_per_run: float | None, overrides: list[str], command: str | None,
                    plot: str | None) -> str:
    geo = summaries[0].config if summaries else {}
    warmups = "/".join(sorted({str(s.warmup) for s in summaries})) or str(base.warmup)
    budget = f"{tokens:,} tokens per run" if tokens is not None else f"{minutes_per_run:g} minutes per run"
    lines = [
        "# Training comparison of the architecture family (claim T1)",
        "",
        f"Command: `{command}`" if command else "Command: (library call)",
        "",
        f"Budget: {budget}; global batch {base.batch_size} x seq_len {base.seq_len}; lr {base.lr:g} "
        f"(warmup {warmups} steps, cosine to {base.min_lr_ratio:g}x); seed {base.seed}; "
        f"lb_weight {base.lb_weight:g}, z_weight {base.z_weight:g}; data: {base.data or 'shipped stories corpus'}.",
        "",
        f"Geometry (every preset): d_model {geo.get('d_model')}, {geo.get('n_layers')} layers, "
        f"{geo.get('n_heads')}/{geo.get('n_kv_heads')} heads, d_ff {geo.get('d_ff')}, "
        f"{geo.get('n_experts')} experts top-{geo.get('top_k')} of d_expert {geo.get('d_expert')}, "
        f"vocab {geo.get('vocab_size')}" + (f"; overrides {overrides}" if overrides else "") + ".",
        "",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}; "
        f"written {time.strftime('%Y-%m-%d %H:%M')}.",
        "",
        f"| preset | params | val loss | val ppl | top-1 acc | weight bytes/token ({DAG_QUANT}) | "
        "critical path bytes | critical / total | steps | tokens | train s | tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        if s.dag:
            dag_cells = f"{s.dag['total_bytes']:,} | {s.dag['critical_bytes']:,} | " \
                        f"{s.dag['critical_bytes'] / s.dag['total_bytes']:.3f}"
        else:
            dag_cells = "n/a | n/a | n/a"
        lines.append(f"| {s.preset} | {s.params:,} | {s.val_loss:.4f} | {s.val_ppl:.2f} | {s.val_acc:.4f} | "
                     f"{dag_cells} | {s.steps:,} | {s.tokens:,} | {s.train_s:.1f} | {s.tok_per_s:,.0f} |")
    lines += [
        "",
        "How to read it: val loss / perplexity / top-1 accuracy are measured on the held-out stories "
        "(split by a hash of each story) at the end of the run. Weight bytes per token and the critical "
        "path come from `cflow.dag.analyze` (arithmetic, not a measurement): the delays do not shrink "
        "the total bytes per token, they shorten the chain of bytes that must stream one after another. "
        "arch5 counts its shared parameters once but streams every layer's set per token. "
        "On a small budget, differences of a few hundredths in loss are within run-to-run noise.",
    ]
    if plot:
        lines += ["", f"![loss curves]({plot})"]
    return "\n".join(lines) + "\n"


def plot_losses(summaries: list[RunSummary], path: Path) -> bool:
    """Training loss (smoothed) and validation loss against tokens; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for s in summaries:
        if not s.curve:
            continue
        xs, ys = zip(*s.curve)
        line, = ax.plot(xs, _smooth(list(ys)), label=f"{s.preset} (train)", linewidth=1.2)
        if s.val_curve:
            vx, vy = zip(*s.val_curve)
            ax.plot(vx, vy, "o--", color=line.get_color(), markersize=3, linewidth=0.8)
    ax.set_xlabel("tokens")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("training cross-entropy (lines, smoothed) and validation loss (dots)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        with writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)
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
