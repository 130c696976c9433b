"""C7: numerical parity of the engine with references.

Measured as the paper prescribes (and tests/test_engine*.py assert): teacher-forced, i.e. every
engine reads the same token sequence and the logits are compared position by position: max and mean
|difference| relative to the spread (std) of the reference's logits, and argmax agreement counted
only where the reference's top-1 leads its top-2 by a stated margin (a fast engine quantizes
activations to 8 bits, so it cannot follow an fp32 reference through a near-tie). Three references:

- the PyTorch reference decoder (cflow.model.ReferenceDecoder, fp32) on the dequantized weights of
  small random models of the presets (the paper's "parity with PyTorch references");
- HF transformers on SmolLM2-135M-Instruct (the same GGUF, dequantized, fp32);
- llama.cpp (llama-cpp-python) on the same GGUF.

Free-running greedy agreement (tokens before the first divergence) is reported as information.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math

import numpy as np

from cflow.bench.claims.core import CONFIRMED, INCONCLUSIVE, REFUTED, ClaimResult, Context, Table, pyplot, save
from cflow.bench.claims.models import SMOLLM2_MISSING, small_config, smollm2_gguf, write_random_model

ID, TITLE = "C7", "Numerical parity with the references"
PAPER = "the paper's runtime (written in Rust) achieves numerical parity with the PyTorch references"
PAPER_NUMBER = "parity (no number given)"
# the random models of tests/test_engine.py: preset -> (weights, tile, tied)
VARIANTS = {"llama": ("q4_1", (128, 256), True), "arch1": ("q4_0", (64, 64), False), "arch3": ("q4_1", (16, 32), False),
            "arch2": ("q8_0", (32, 64), False), "arch4": ("q4_0", (128, 256), False),
            "arch2_4_combined": ("q8_0", (64, 64), False), "arch5": ("q4_1", (64, 64), True)}
GAIN = 1.5
REF_MARGIN = 0.2      # reference: argmax compared where top-1 leads by this many stds
REF_MEDIAN_TOL, REF_MAX_TOL = 0.04, 0.06
SMOL_MARGIN = 0.5     # SmolLM2: argmax compared where top-1 leads by this many logits
SMOL_AGREEMENT, SMOL_MEAN_REL, SMOL_MAX_REL = 0.99, 0.08, 1.0
PROMPTS = [
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine. "
    "One day, she saw a big",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Water boils at 100 degrees Celsius. Ice melts at 0 degrees Celsius. The human body temperature is about",
    "<|im_start|>user\nWhat is the largest planet in the solar system?<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
]


def compare_logits(ours: np.ndarray, ref: np.ndarray, margin: float, margin_in_std: bool) -> dict:
    """Per-position relative errors and argmax agreement where the reference is decisive."""
    spread = ref.std(axis=1)
    diff = np.abs(ours - ref)
    max_rel, mean_rel = diff.max(axis=1) / spread, diff.mean(axis=1) / spread
    top2 = np.sort(ref, axis=1)[:, -2:]
    gap = top2[:, 1] - top2[:, 0]
    decisive = gap > (margin * spread if margin_in_std else margin)
    agree = ours.argmax(axis=1) == ref.argmax(axis=1)
    return {"positions": int(len(ref)), "decisive": int(decisive.sum()), "agree": int(agree[decisive].sum()),
            "agreement": float(agree[decisive].mean()) if decisive.any() else math.nan,
            "agreement_all": float(agree.mean()), "max_rel": max_rel.tolist(), "mean_rel": mean_rel.tolist()}


def _dequantized(path):
    """The Transformer whose weights are exactly the .cflow file's, dequantized."""
    from cflow.model import Transformer

    return Transformer.from_cflow(path)


def reference_parity(ctx: Context, preset: str, steps: int) -> dict:
    import torch

    from cflow.model import ReferenceDecoder, Transformer
    from cflow.runtime import Engine

    dtype, tile, tied = VARIANTS[preset]
    cfg = small_config(preset, tied)
    torch.manual_seed(0)
    m = Transformer(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(GAIN)
    w = {k: v.detach().numpy().astype(np.float32) for k, v in m.state_dict().items()}
    path = write_random_model(ctx.work / f"c7_{preset}.cflow", cfg, dtype, tile, params=w)
    ref = ReferenceDecoder(_dequantized(path))
    toks = [int(t) for t in np.random.default_rng(1).integers(0, cfg.vocab_size, steps)]
    with Engine.load(path, threads=ctx.threads, verify=False) as eng:
        ours = np.stack([eng.step(t, pos).copy() for pos, t in enumerate(toks)])
    theirs = np.stack([ref.step(t).numpy() for t in toks])
    r = compare_logits(ours.astype(np.float64), theirs.astype(np.float64), REF_MARGIN, True)
    errs = np.array(r["max_rel"])
    r.update(preset=preset, dtype=dtype, tile=list(tile), moe=cfg.has_moe, median_max_rel=float(np.median(errs)),
             within_max_tol=float(np.mean(errs <= REF_MAX_TOL)))
    ok = r["median_max_rel"] <= REF_MEDIAN_TOL and (r["within_max_tol"] >= 0.85 if cfg.has_moe
                                                    else errs.max() <= REF_MAX_TOL)
    ok = ok and r["decisive"] >= 10 and r["agreement"] >= (0.95 if cfg.has_moe else 1.0)
    r["pass"] = bool(ok)
    return r


def smollm2_sequences(ctx: Context, eng, prompts: list[str], n_gen: int) -> list[tuple[list[int], list[int]]]:
    out = []
    for text in prompts:
        prompt = eng.tokenizer.encode(text)
        gen = eng.complete(prompt, max_tokens=n_gen, temperature=0, ignore_eos=True).tokens
        out.append((prompt, list(gen)))
    return out


def cflow_teacher_forced(eng, seq: list[int]) -> np.ndarray:
    eng.reset()
    return np.stack([eng.step(t, pos).astype(np.float64) for pos, t in enumerate(seq[:-1])])


def hf_parity(ctx: Context, gguf, eng, seqs) -> dict:
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with contextlib.redirect_stderr(io.StringIO()):  # its GGUF loader draws a progress bar regardless
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32)
    hf.eval()
    ours_all, ref_all, free = [], [], []
    for prompt, gen in seqs:
        seq = prompt + gen
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0].numpy().astype(np.float64)[:-1]
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=len(gen), do_sample=False)[0, len(prompt):]
        ours_all.append(cflow_teacher_forced(eng, seq))
        ref_all.append(ref)
        free.append(_same_prefix(gen, theirs.tolist()))
    r = compare_logits(np.concatenate(ours_all), np.concatenate(ref_all), SMOL_MARGIN, False)
    r["free_running_same"] = free
    r["free_running_total"] = [len(g) for _, g in seqs]
    return r


def llamacpp_parity(ctx: Context, gguf, eng, seqs) -> dict:
    import llama_cpp

    from cflow.bench.llamacpp import _quiet_stderr, repacking

    with _quiet_stderr(), repacking(llama_cpp, True):  # its default, unless that crashes here
        llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=512, logits_all=True, n_threads=ctx.threads,
                              n_threads_batch=ctx.threads, verbose=False)
    try:
        ours_all, ref_all, free = [], [], []
        for prompt, gen in seqs:
            seq = prompt + gen
            llm.reset()
            rows = []
            for t in seq[:-1]:  # one decode per token: llama.cpp's decode path, like Engine.step
                llm.eval([t])
                rows.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64))
            ours_all.append(cflow_teacher_forced(eng, seq))
            ref_all.append(np.stack(rows))
            # free-running greedy of llama.cpp from the prompt
            llm.reset()
            llm.eval(prompt)
            theirs = []
            for _ in range(len(gen)):
                tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                theirs.append(tok)
                llm.eval([tok])
            free.append(_same_prefix(gen, theirs))
    finally:
        llm.close()
    r = compare_logits(np.concatenate(ours_all), np.concatenate(ref_all), SMOL_MARGIN, False)
    r["free_running_same"] = free
    r["free_running_total"] = [len(g) for _, g in seqs]
    return r


def _same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _smol_pass(r: dict) -> bool:
    return (r["decisive"] >= 1 and r["agreement"] >= SMOL_AGREEMENT and float(np.mean(r["mean_rel"])) <= SMOL_MEAN_REL
            and float(np.max(r["max_rel"])) <= SMOL_MAX_REL)


def run(ctx: Context) -> ClaimResult:
    from cflow.runtime import Engine

    res = ClaimResult(ID, TITLE, paper=PAPER, paper_number=PAPER_NUMBER)
    res.commands = [ctx.rerun(ID), "python -m pytest tests/test_engine.py tests/test_engine_smollm2.py "
                                   "tests/test_moe_llamacpp.py -q -s"]
    have_torch = importlib.util.find_spec("torch") is not None
    have_hf = have_torch and importlib.util.find_spec("transformers") is not None
    have_llama = importlib.util.find_spec("llama_cpp") is not None
    verdicts: list[bool] = []
    small = False
    # (a) the PyTorch reference
    if have_torch:
        presets = ["arch2_4_combined"] if ctx.quick else list(VARIANTS)
        steps = 32 if ctx.quick else 48
        refs = []
        for p in presets:
            r = reference_parity(ctx, p, steps)
            refs.append(r)
            ctx.log(ID, f"reference {p}: median max-rel {r['median_max_rel']:.4f}, argmax {r['agree']}/{r['decisive']}")
        res.data["reference"] = refs
        res.tables.append(Table(
            f"Engine vs the PyTorch reference decoder on the same (dequantized) weights: random models of each preset "
            f"(vocab 300, d 96, 5 layers), {steps} teacher-forced positions",
            ["preset", "weights", "tile", "median max|dlogit|/std", "max", "positions within 6%",
             f"argmax agree (margin > {REF_MARGIN} std)", "within the tests' bounds"],
            [[r["preset"], r["dtype"], "x".join(map(str, r["tile"])), f"{r['median_max_rel']:.4f}",
              f"{max(r['max_rel']):.4f}", f"{100 * r['within_max_tol']:.0f}%", f"{r['agree']}/{r['decisive']}",
              "yes" if r["pass"] else "**no**"] for r in refs]))
        verdicts += [r["pass"] for r in refs]
        res.parts.append({"name": "PyTorch reference",
                          "verdict": CONFIRMED if all(r["pass"] for r in refs) else REFUTED,
                          "reason": f"{sum(r['pass'] for r in refs)}/{len(refs)} presets within the bounds of "
                                    f"tests/test_engine.py (median <= {REF_MEDIAN_TOL:.0%}, max <= {REF_MAX_TOL:.0%} "
                                    f"or 85% of positions for MoE, argmax where decisive)"})
    else:
        res.parts.append({"name": "PyTorch reference", "verdict": INCONCLUSIVE,
                          "reason": "torch is not installed (`pip install 'cflow-lm[train]'`): skipped"})
    # (b), (c) SmolLM2 against HF transformers and llama.cpp
    gguf = smollm2_gguf()
    smol = []
    if gguf is None:
        res.parts.append({"name": "SmolLM2", "verdict": INCONCLUSIVE, "reason": SMOLLM2_MISSING})
    elif have_hf or have_llama:
        prompts, n_gen = (PROMPTS[:1], 16) if ctx.quick else (PROMPTS, 24)
        with Engine.load(gguf, threads=ctx.threads, n_ctx=512) as eng:
            seqs = smollm2_sequences(ctx, eng, prompts, n_gen)
            for name, have, fn in (("HF transformers (fp32)", have_hf, hf_parity),
                                   ("llama.cpp", have_llama, llamacpp_parity)):
                if not have:
                    res.parts.append({"name": f"SmolLM2 vs {name}", "verdict": INCONCLUSIVE,
                                      "reason": "not installed here: skipped"})
                    continue
                ctx.log(ID, f"SmolLM2 vs {name}: {len(seqs)} prompt(s) x {n_gen} tokens")
                r = fn(ctx, gguf, eng, seqs)
                r["reference"] = name
                r["pass"] = _smol_pass(r)
                smol.append(r)
                verdicts.append(r["pass"])
                small = small or r["decisive"] < 100
                res.parts.append({"name": f"SmolLM2 vs {name}", "verdict": CONFIRMED if r["pass"] else REFUTED,
                                  "reason": f"argmax {r['agree']}/{r['decisive']} where the margin > "
                                            f"{SMOL_MARGIN}; mean rel {np.mean(r['mean_rel']):.4f}, max rel "
                                            f"{np.max(r['max_rel']):.3f}"})
        res.data["smollm2"] = smol
        res.tables.append(Table(
            f"SmolLM2-135M-Instruct Q4_1, teacher-forced on {len(prompts)} prompt(s) + {n_gen} greedy tokens of cflow "
            f"({ctx.threads} thread(s))",
            ["reference", "positions", f"argmax agree (margin > {SMOL_MARGIN} logits)", "mean of mean|dlogit|/std",
             "max of max|dlogit|/std", "free-running: same tokens before first divergence"],
            [[r["reference"], r["positions"], f"{r['agree']}/{r['decisive']} ({100 * r['agreement']:.1f}%)",
              f"{np.mean(r['mean_rel']):.4f}", f"{np.max(r['max_rel']):.3f}",
              f"{sum(r['free_running_same'])}/{sum(r['free_running_total'])}"] for r in smol]))
    if not verdicts:
        res.verdict, res.reason, res.measured = INCONCLUSIVE, "no reference available here (see parts)", "failed"
        res.ours = "nothing compared"
        return res
    ok = all(verdicts)
    refs = res.data.get("reference", [])
    bits = []
    if refs:
        bits.append(f"vs the PyTorch reference: {sum(r['pass'] for r in refs)}/{len(refs)} presets within the tests' "
                    f"bounds (median max-rel {min(r['median_max_rel'] for r in refs):.3f}–"
                    f"{max(r['median_max_rel'] for r in refs):.3f})")
    for r in smol:
        bits.append(f"SmolLM2 vs {r['reference']}: argmax {100 * r['agreement']:.1f}% of {r['decisive']} decisive "
                    f"positions, mean rel err {np.mean(r['mean_rel']):.3f}")
    res.ours = "; ".join(bits) + "."
    res.ours_number = "; ".join(
        ([f"ref: {sum(r['pass'] for r in refs)}/{len(refs)} presets"] if refs else [])
        + [f"{r['reference'].split(' ')[0]}: {100 * r['agreement']:.1f}% argmax" for r in smol])
    if ok:
        res.verdict = CONFIRMED
        res.reason = ("teacher-forced logits agree within the stated bounds with every reference available: the "
                      "remaining difference is the engine's int8 activation rounding (and, for MoE, the occasional "
                      "near-tie in routing), not a semantic difference; free-running greedy text diverges only at "
                      "near-ties, which is why it is information, not a criterion")
    else:
        res.verdict = REFUTED
        res.reason = "at least one comparison falls outside the bounds (see parts)"
    if ctx.quick and small:
        fewest = min(r["decisive"] for r in smol)
        res.verdict, res.reason = INCONCLUSIVE, (f"quick run: too few decisive positions to judge ({fewest} < 100); "
                                                 f"on these numbers the rule would say {res.verdict}: {res.reason}")
    plt = pyplot()
    if plt is not None and smol:
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in smol:
            ax.hist(r["mean_rel"], bins=30, alpha=0.6, label=f"vs {r['reference']}")
        ax.set_xlabel("mean |dlogit| / std(logits) per position")
        ax.set_ylabel("positions")
        ax.set_title("SmolLM2: teacher-forced logit error of cflow")
        ax.legend(fontsize=8)
        save(fig, ctx.out / "c7_parity.png")
        res.plots.append(("c7_parity.png", "Distribution over positions of cflow's mean logit error relative to the "
                                           "logit spread, against each reference."))
    return res
