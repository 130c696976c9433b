"""How a MoE model routes, layer by layer, on held-out text: what the expert cache and the engine's
speculative reads depend on.

    python benchmarks/routing_stats.py runs/family/arch2_4_combined-s/seed1 --random small-pn.cflow \
        --corpus data/stories-corpus.jsonl.xz --tokens 20000 --out docs/results/routing

For each model (a training checkpoint directory or a .cflow file, read into the PyTorch reference
with its weights exactly as stored), over the first --tokens tokens of the corpus's held-out stories
(each story started after the end-of-text token, in windows of the model's context):

- load: the share of the N*k routing slots each expert of each layer takes; the entropy of that
  share over log(E) (1.0: perfectly even);
- reuse: of a token's k experts at a layer, the share the previous token also chose there;
- predictability at distance d = 1..8: the share of layer l+d's chosen experts that the engine's
  predictor (top-k of softmax(router_{l+d}(rmsnorm(z_l) * moe_norm_{l+d})), engine_spec.c, expert
  speculation) finds from layer l's MoE input, averaged over every l with l+d in the model (so d
  stops at n_layers - 1); a guess at random finds k/E of them.

Writes OUT.json, OUT.md (a table per model) and OUT.png (predictability against d, every model).
Random-weight models (cflow.bench.synthetic, `--residual-gain`) route unlike trained ones; put both
on one page to see how.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

from cflow.model import Transformer

MAX_D = 8


def random_geometry(path: str) -> dict | None:
    """What a random-weight .cflow was made with (its metadata), so the report says how to remake it."""
    if Path(path).is_dir():
        return None
    from cflow.fileformat import open_model

    with open_model(path) as cf:
        return cf.metadata.get("geometry") if cf.metadata.get("generator") == "cflow.bench.synthetic" else None


def load_model(path: str) -> Transformer:
    p = Path(path)
    if p.is_dir():
        from cflow.train import checkpoint as ckpt

        c = ckpt.load_checkpoint(p, with_train_state=False)
        return Transformer.from_state(c.config, {k: torch.from_numpy(np.asarray(v)) if isinstance(v, np.ndarray)
                                                 else v for k, v in c.weights.items()})
    return Transformer.from_cflow(p)


def trace(model: Transformer, windows: list[list[int]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per MoE layer (in layer order): the chosen experts [N, k] and the normalised MoE inputs
    [N, d] (rmsnorm without the layer's weight, so any layer's moe_norm can be applied)."""
    cfg = model.cfg
    chosen: list[list[np.ndarray]] = [[] for _ in range(cfg.n_layers)]
    inputs: list[list[np.ndarray]] = [[] for _ in range(cfg.n_layers)]
    calls: list[int] = []

    def wrap(blk):
        inner = blk.experts

        def experts(z):
            layer = len(calls)
            calls.append(layer)
            x = z.reshape(-1, z.shape[-1]).float()
            normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
            logits = blk.moe.router(normed * blk.moe_norm.weight)
            chosen[layer].append(logits.topk(cfg.top_k, dim=-1).indices.numpy())
            inputs[layer].append(normed.numpy())
            return inner(z)
        return experts

    saved = [blk.experts for blk in model.layers]
    for blk in model.layers:
        blk.experts = wrap(blk)
    try:
        with torch.no_grad():
            for w in windows:
                calls.clear()
                model(torch.tensor([w]))
    finally:
        for blk, f in zip(model.layers, saved):
            blk.experts = f
    return [np.concatenate(c) for c in chosen], [np.concatenate(i) for i in inputs]


def stats(model: Transformer, chosen: list[np.ndarray], inputs: list[np.ndarray], starts: np.ndarray) -> dict:
    cfg = model.cfg
    E, k, L = cfg.n_experts, cfg.top_k, cfg.n_layers
    out: dict = {"layers": [], "predictability": {}}
    for layer in range(L):
        c = chosen[layer]
        share = np.bincount(c.ravel(), minlength=E) / c.size
        nz = share[share > 0]
        entropy = float(-(nz * np.log(nz)).sum() / math.log(E))
        prev = np.roll(c, 1, axis=0)
        same = np.array([len(set(a) & set(b)) / k for a, b in zip(c, prev)])
        same = same[~starts]  # a window's first token has no previous one
        out["layers"].append({"layer": layer, "load": share.round(4).tolist(), "load_entropy": round(entropy, 4),
                              "reuse": round(float(same.mean()), 4)})
    for d in range(1, MAX_D + 1):
        hits = []
        for layer in range(L - d):
            target = model.block(layer + d)
            x = torch.from_numpy(inputs[layer])
            with torch.no_grad():
                pred = target.moe.router(x * target.moe_norm.weight).topk(k, dim=-1).indices.numpy()
            act = chosen[layer + d]
            hits.append(np.mean([len(set(a) & set(b)) / k for a, b in zip(pred, act)]))
        if hits:
            out["predictability"][d] = round(float(np.mean(hits)), 4)
    return out


def held_out_windows(model: Transformer, tokenizer, corpus: str, n_tokens: int) -> tuple[list[list[int]], np.ndarray]:
    from cflow.train.data import DEFAULT_VAL_FRACTION, open_corpus, split_documents

    _, val = split_documents(open_corpus(corpus).documents(), DEFAULT_VAL_FRACTION)
    eos = tokenizer.eos_id
    stream: list[int] = []
    for doc in val:
        stream += [eos, *tokenizer.encode(doc, add_bos=False)]
        if len(stream) >= n_tokens:
            break
    T = min(256, model.cfg.max_seq_len)
    windows = [stream[i:i + T] for i in range(0, min(len(stream), n_tokens) - T + 1, T)]
    starts = np.zeros(len(windows) * T, bool)
    starts[::T] = True
    return windows, starts


def random_windows(model: Transformer, n_tokens: int, seed: int) -> tuple[list[list[int]], np.ndarray]:
    T = min(256, model.cfg.max_seq_len)
    rng = np.random.default_rng(seed)
    windows = [rng.integers(0, model.cfg.vocab_size, T).tolist() for _ in range(max(1, n_tokens // T))]
    starts = np.zeros(len(windows) * T, bool)
    starts[::T] = True
    return windows, starts


def tokenizer_of(path: str):
    from cflow.fileformat import open_model
    from cflow.tokenizer import Tokenizer

    p = Path(path)
    if p.is_dir():
        from cflow.convert.hf_tokenizer import hf_json_to_header

        return Tokenizer(hf_json_to_header(p / "tokenizer.json"))
    with open_model(p) as cf:
        return Tokenizer(cf.tokenizer)


def _chance(results: dict) -> float | None:
    """k/E when every model has the same k and E, else None."""
    ks = {(s["config"]["top_k"], s["config"]["n_experts"]) for s in results.values()}
    if len(ks) != 1:
        return None
    k, e = next(iter(ks))
    return k / e


def render_markdown(results: dict, n_tokens: int, argv: list[str]) -> str:
    definitions = "\n\n".join(__doc__.split("\n\n")[2:4])  # the load / reuse / predictability bullets, defined once
    ds = list(next(iter(results.values()))["predictability"]) if results else []
    lines = [f"# Routing on {n_tokens:,} tokens per model", "",
             "Command: `python benchmarks/routing_stats.py " + " ".join(argv) + "`", "", definitions, "",
             "## Predictability at distance d, every model", "",
             *([f"A guess at random finds k/E = {chance:.3f} of them."] if (chance := _chance(results)) else []), "",
             "| model | text | " + " | ".join(f"d={d}" for d in ds) + " |", "|---|---|" + "---:|" * len(ds)]
    for path, s in results.items():
        lines.append(f"| {s['config']['name']} ({path}) | {s['text']} | "
                     + " | ".join(f"{s['predictability'][d]:.3f}" for d in ds) + " |")
    lines.append("")
    for path, s in results.items():
        c = s["config"]
        lines += [f"## {path}", "", f"{c['name']}: {c['n_layers']} layers, {c['n_experts']} experts top-{c['top_k']}, "
                  f"delta_dense {c['delta_dense']}, delta_expert {c['delta_expert']}, {c['moe_input']}; "
                  f"{s['tokens']:,} tokens of {s['text']}.", ""]
        g = s.get("geometry")
        if g:
            flags = {"layers": "--layers", "d_model": "--d-model", "experts": "--experts", "top_k": "--top-k",
                     "d_ff": "--d-ff", "heads": "--heads", "kv_heads": "--kv-heads", "vocab": "--vocab",
                     "ctx": "--ctx", "residual_gain": "--residual-gain"}
            made = " ".join(f"{flag} {g[k]}" for k, flag in flags.items() if g.get(k) is not None)
            lines += [f"Random weights, made by `python benchmarks/make_moe.py {made} --cflow {Path(path).name}`.", ""]
        lines += ["| layer | load entropy | reuse (previous token) | busiest expert's share |", "|---:|---:|---:|---:|"]
        for x in s["layers"]:
            lines.append(f"| {x['layer']} | {x['load_entropy']:.3f} | {x['reuse']:.3f} | {max(x['load']):.3f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", help="trained MoE models (checkpoint directories or .cflow files): "
                    "they read the corpus's held-out stories")
    ap.add_argument("--random", action="append", default=[], metavar="MODEL",
                    help="a random-weight MoE model (cflow.bench.synthetic); it reads random token ids (repeatable)")
    ap.add_argument("--corpus", help="the corpus whose held-out stories the trained models read")
    ap.add_argument("--tokens", type=int, default=20000, help="tokens per model (default 20000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="OUT stem: OUT.json, OUT.md, OUT.png")
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = {}
    if a.models and not a.corpus:
        ap.error("trained models read held-out stories: give --corpus")
    for path, trained in [(m, True) for m in a.models] + [(m, False) for m in a.random]:
        model = load_model(path).eval()
        if not model.cfg.has_moe:
            ap.error(f"{path} has no experts")
        windows, starts = (held_out_windows(model, tokenizer_of(path), a.corpus, a.tokens) if trained
                           else random_windows(model, a.tokens, a.seed))
        chosen, inputs = trace(model, windows)
        s = stats(model, chosen, inputs, starts)
        s.update(config={k: getattr(model.cfg, k) for k in ("name", "n_layers", "d_model", "n_experts", "top_k",
                                                             "delta_dense", "delta_expert", "moe_input")},
                 tokens=int(starts.size), text="held-out stories" if trained else "random token ids",
                 geometry=None if trained else random_geometry(path))
        results[path] = s
        print(f"{path}: predictability d=1..{MAX_D}: {s['predictability']}; reuse by layer "
              f"{[x['reuse'] for x in s['layers']]}; load entropy {[x['load_entropy'] for x in s['layers']]}")
    a.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    a.out.with_suffix(".md").write_text(render_markdown(results, a.tokens, argv if argv is not None else sys.argv[1:]))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for path, s in results.items():
            ds = [int(d) for d in s["predictability"]]
            ax.plot(ds, list(s["predictability"].values()), "o-", label=f"{s['config']['name']} ({Path(path).name})")
        ax.set_xlabel("distance d (layers ahead)")
        ax.set_ylabel("share of layer l+d's experts predicted from layer l")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(a.out.with_suffix(".png"), dpi=120)
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
