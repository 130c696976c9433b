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

The verdict comes from the rules below, fixed before anything is measured: for each reference, the
argmax agreement where the reference is decisive and the largest relative logit error. Each rule is
also judged on a control, a model with perturbed weights standing in for the engine (every weight
matrix plus Gaussian noise of PERTURB times its own standard deviation): the PyTorch reference's own
perturbed copy against it, and a perturbed copy of the HF model against HF and against llama.cpp.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math

import numpy as np

from cflow.bench.claims.core import CONFIRMED, INCONCLUSIVE, REFUTED, ClaimResult, Context, Rule, Table, pyplot, save
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
FULL_STEPS, QUICK_STEPS = 48, 32  # teacher-forced positions per preset against the PyTorch reference
PERTURB = 0.5  # the controls: noise of this many standard deviations of each weight matrix

# ---- the verdict rules, fixed before the run --------------------------------------------------
# Confirm at the bounds tests/test_engine.py and tests/test_engine_smollm2.py assert (what the engine's
# int8 activation rounding leaves); refute beyond them by a margin a rounding difference does not reach
# but a semantic one (a wrong delay, RoPE, norm or routing) exceeds many times: such errors are of the
# order of the logits' own spread at most positions and flip most decisive argmaxes.
_REF = (f"random models of the presets (every preset of VARIANTS in a full run, arch2_4_combined in a quick run), "
        f"{FULL_STEPS} teacher-forced random tokens each ({QUICK_STEPS} quick), the engine against "
        f"cflow.model.ReferenceDecoder (fp32) on the same dequantized weights")
RULE_REF_ERR = Rule("logit error vs the PyTorch reference",
                    f"the largest over the presets of the median over positions of max|dlogit| / std(reference "
                    f"logits); {_REF}", confirm=REF_MEDIAN_TOL, refute=REF_MAX_TOL, higher_is_better=False, unit="")
RULE_REF_ARGMAX = Rule("argmax agreement vs the PyTorch reference",
                       f"the share of positions, pooled over the presets, where the engine's argmax is the "
                       f"reference's, counted where the reference's top-1 leads its top-2 by more than {REF_MARGIN} "
                       f"std; {_REF}", confirm=0.95, refute=0.90, unit="")
_SMOL = ("SmolLM2-135M-Instruct Q4_1, teacher-forced on the prompts and cflow's greedy continuation (6 prompts x 24 "
         "tokens; 1 x 16 quick), the same GGUF")


def _smol_rules(ref: str) -> tuple[Rule, Rule]:
    return (Rule(f"argmax agreement vs {ref}",
                 f"the share of positions where cflow's argmax is {ref}'s, counted where {ref}'s top-1 leads its top-2 "
                 f"by more than {SMOL_MARGIN} logits; {_SMOL}", confirm=SMOL_AGREEMENT, refute=0.95, unit=""),
            Rule(f"largest logit error vs {ref}",
                 f"the largest over positions of max|dlogit| / std({ref}'s logits); {_SMOL}", confirm=SMOL_MAX_REL,
                 refute=2.0, higher_is_better=False, unit=""))


HF_NAME, LLAMA_NAME = "HF transformers (fp32)", "llama.cpp"
RULE_HF_ARGMAX, RULE_HF_ERR = _smol_rules("HF transformers")
RULE_LLAMA_ARGMAX, RULE_LLAMA_ERR = _smol_rules("llama.cpp")
RULES = (RULE_REF_ERR, RULE_REF_ARGMAX, RULE_HF_ARGMAX, RULE_HF_ERR, RULE_LLAMA_ARGMAX, RULE_LLAMA_ERR)
SMOL_RULES = {HF_NAME: (RULE_HF_ARGMAX, RULE_HF_ERR), LLAMA_NAME: (RULE_LLAMA_ARGMAX, RULE_LLAMA_ERR)}
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


def perturb_(model, seed: int) -> None:
    """Add Gaussian noise of PERTURB x each weight matrix's own std to it, in place (norms untouched)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (PERTURB * float(p.float().std())))


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
    # the control: the reference's own weights, perturbed, standing in for the engine
    wrong = _dequantized(path)
    perturb_(wrong, seed=7)
    bad = ReferenceDecoder(wrong)
    ctl = np.stack([bad.step(t).numpy() for t in toks])
    c = compare_logits(ctl.astype(np.float64), theirs.astype(np.float64), REF_MARGIN, True)
    r["control"] = {"median_max_rel": float(np.median(c["max_rel"])), "agree": c["agree"], "decisive": c["decisive"]}
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
    # the controls' engine: this model with perturbed weights, on the same sequences
    perturb_(hf, seed=7)
    with torch.no_grad():
        wrong = [hf(torch.tensor([p + g])).logits[0].numpy().astype(np.float64)[:-1] for p, g in seqs]
    r["_logits"], r["_perturbed"] = np.concatenate(ref_all), np.concatenate(wrong)
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
    r["_logits"] = np.concatenate(ref_all)
    return r


def _same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run(ctx: Context) -> ClaimResult:
    from cflow.runtime import Engine

    res = ClaimResult(ID, TITLE, paper=PAPER, paper_number=PAPER_NUMBER)
    res.commands = [ctx.rerun(ID), "python -m pytest tests/test_engine.py tests/test_engine_smollm2.py "
                                   "tests/test_moe_llamacpp.py -q -s"]
    have_torch = importlib.util.find_spec("torch") is not None
    have_hf = have_torch and importlib.util.find_spec("transformers") is not None
    have_llama = importlib.util.find_spec("llama_cpp") is not None
    verdicts: list[str] = []
    small = False
    # (a) the PyTorch reference
    if have_torch:
        presets = ["arch2_4_combined"] if ctx.quick else list(VARIANTS)
        steps = QUICK_STEPS if ctx.quick else FULL_STEPS
        refs = []
        for p in presets:
            r = reference_parity(ctx, p, steps)
            refs.append(r)
            ctx.log(ID, f"reference {p}: median max-rel {r['median_max_rel']:.4f}, argmax {r['agree']}/{r['decisive']}"
                        f"; perturbed control {r['control']['median_max_rel']:.3f}, "
                        f"{r['control']['agree']}/{r['control']['decisive']}")
        res.data["reference"] = refs

        def pooled(rs: list[dict]) -> float | None:
            n = sum(r["decisive"] for r in rs)
            return sum(r["agree"] for r in rs) / n if n else None

        v_err, why_err = res.apply(RULE_REF_ERR, max(r["median_max_rel"] for r in refs))
        res.apply(RULE_REF_ERR, max(r["control"]["median_max_rel"] for r in refs), control=True)
        v_arg, why_arg = res.apply(RULE_REF_ARGMAX, pooled(refs))
        res.apply(RULE_REF_ARGMAX, pooled([r["control"] for r in refs]), control=True)
        verdicts += [v_err, v_arg]
        res.tables.append(Table(
            f"Engine vs the PyTorch reference decoder on the same (dequantized) weights: random models of each preset "
            f"(vocab 300, d 96, 5 layers), {steps} teacher-forced positions; the control: the reference's weights "
            f"perturbed by {PERTURB} std, against the reference",
            ["preset", "weights", "tile", "median max|dlogit|/std", "max", "positions within 6%",
             f"argmax agree (margin > {REF_MARGIN} std)", "control: median max|dlogit|/std", "control: argmax"],
            [[r["preset"], r["dtype"], "x".join(map(str, r["tile"])), f"{r['median_max_rel']:.4f}",
              f"{max(r['max_rel']):.4f}", f"{100 * r['within_max_tol']:.0f}%", f"{r['agree']}/{r['decisive']}",
              f"{r['control']['median_max_rel']:.3f}", f"{r['control']['agree']}/{r['control']['decisive']}"]
             for r in refs]))
        worst = CONFIRMED if v_err == v_arg == CONFIRMED else REFUTED if REFUTED in (v_err, v_arg) else INCONCLUSIVE
        res.parts.append({"name": "PyTorch reference", "verdict": worst, "reason": f"{why_err}; {why_arg}"})
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
        perturbed = None
        with Engine.load(gguf, threads=ctx.threads, n_ctx=512) as eng:
            seqs = smollm2_sequences(ctx, eng, prompts, n_gen)
            for name, have, fn in ((HF_NAME, have_hf, hf_parity), (LLAMA_NAME, have_llama, llamacpp_parity)):
                if not have:
                    res.parts.append({"name": f"SmolLM2 vs {name}", "verdict": INCONCLUSIVE,
                                      "reason": "not installed here: skipped"})
                    continue
                ctx.log(ID, f"SmolLM2 vs {name}: {len(seqs)} prompt(s) x {n_gen} tokens")
                r = fn(ctx, gguf, eng, seqs)
                r["reference"] = name
                perturbed = r.pop("_perturbed", perturbed)
                smol.append(r)
                small = small or r["decisive"] < 100
        for r in smol:
            ref_logits = r.pop("_logits")
            rule_arg, rule_err = SMOL_RULES[r["reference"]]
            va, wa = res.apply(rule_arg, r["agreement"] if r["decisive"] else None)
            ve, we = res.apply(rule_err, float(np.max(r["max_rel"])))
            # the control: the perturbed HF model in the engine's place (none without transformers)
            c = compare_logits(perturbed, ref_logits, SMOL_MARGIN, False) if perturbed is not None else None
            r["control"] = None if c is None else {"agreement": c["agreement"], "agree": c["agree"],
                                                   "decisive": c["decisive"], "max_rel": float(np.max(c["max_rel"]))}
            res.apply(rule_arg, c["agreement"] if c and c["decisive"] else None, control=True)
            res.apply(rule_err, float(np.max(c["max_rel"])) if c else None, control=True)
            verdicts += [va, ve]
            res.parts.append({"name": f"SmolLM2 vs {r['reference']}",
                              "verdict": CONFIRMED if va == ve == CONFIRMED else REFUTED if REFUTED in (va, ve)
                              else INCONCLUSIVE, "reason": f"{wa}; {we}"})
        res.data["smollm2"] = smol
        res.tables.append(Table(
            f"SmolLM2-135M-Instruct Q4_1, teacher-forced on {len(prompts)} prompt(s) + {n_gen} greedy tokens of cflow "
            f"({ctx.threads} thread(s)); the control: the HF model with its weights perturbed by {PERTURB} std in "
            f"cflow's place",
            ["reference", "positions", f"argmax agree (margin > {SMOL_MARGIN} logits)", "mean of mean|dlogit|/std",
             "max of max|dlogit|/std", "free-running: same tokens before first divergence", "control: argmax",
             "control: max of max|dlogit|/std"],
            [[r["reference"], r["positions"], f"{r['agree']}/{r['decisive']} ({100 * r['agreement']:.1f}%)",
              f"{np.mean(r['mean_rel']):.4f}", f"{np.max(r['max_rel']):.3f}",
              f"{sum(r['free_running_same'])}/{sum(r['free_running_total'])}",
              "–" if not r["control"] else f"{r['control']['agree']}/{r['control']['decisive']}",
              "–" if not r["control"] else f"{r['control']['max_rel']:.2f}"] for r in smol]))
    if not verdicts:
        res.verdict, res.reason, res.measured = INCONCLUSIVE, "no reference available here (see parts)", "failed"
        res.ours = "nothing compared"
        return res
    refs = res.data.get("reference", [])
    bits = []
    if refs:
        bits.append(f"vs the PyTorch reference: median max-rel {min(r['median_max_rel'] for r in refs):.3f}–"
                    f"{max(r['median_max_rel'] for r in refs):.3f} over {len(refs)} preset(s), argmax "
                    f"{sum(r['agree'] for r in refs)}/{sum(r['decisive'] for r in refs)} where decisive")
    for r in smol:
        bits.append(f"SmolLM2 vs {r['reference']}: argmax {100 * r['agreement']:.1f}% of {r['decisive']} decisive "
                    f"positions, largest rel err {np.max(r['max_rel']):.3f}")
    res.ours = "; ".join(bits) + "."
    res.ours_number = "; ".join(
        ([f"ref: {max(r['median_max_rel'] for r in refs):.3f} max-rel"] if refs else [])
        + [f"{r['reference'].split(' ')[0]}: {100 * r['agreement']:.1f}% argmax" for r in smol])
    if all(v == CONFIRMED for v in verdicts):
        res.verdict = CONFIRMED
        res.reason = ("every rule is confirmed with every reference available: the remaining difference is the "
                      "engine's int8 activation rounding (and, for MoE, the occasional near-tie in routing), not a "
                      "semantic difference; free-running greedy text diverges only at near-ties, which is why it is "
                      "information, not a criterion")
    elif REFUTED in verdicts:
        res.verdict, res.reason = REFUTED, "at least one rule is refuted (see the rules and parts)"
    else:
        res.verdict, res.reason = INCONCLUSIVE, "no rule is refuted, but not every rule is confirmed (see the parts)"
    if ctx.quick and small:
        fewest = min(r["decisive"] for r in smol)
        res.verdict, res.reason = INCONCLUSIVE, (f"quick run: too few decisive positions to judge ({fewest} < 100); "
                                                 f"on these numbers the rules would say {res.verdict}: {res.reason}")
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
