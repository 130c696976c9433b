"""Teacher-forced perplexity of a model file, measured through the engine, in two conventions:

- `evaluate_windows`: perplexity and top-1 accuracy over the training loop's validation windows
  (`cflow.train.data.eval_windows`), what the quantized model a user runs actually scores, to
  set beside the float checkpoint's numbers from training (`cflow bench`);
- `strided_perplexity`: llama.cpp's llama-perplexity convention (windows of n_ctx, the second
  half of each scored), so a number compares with llama.cpp's on the same text
  (`cflow perplexity -m FILE --file TEXT`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class EvalResult:
    loss: float  # mean next-token negative log-likelihood (nats)
    ppl: float
    top1: float
    n_tokens: int


def evaluate_windows(engine, tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> EvalResult:
    """Score tokens[s+1 : s+seq_len+1] given tokens[s : s+seq_len] for every start s."""
    from cflow.runtime.score import log_partition

    nll = 0.0
    hits = 0
    n = 0
    for s in starts:
        window = np.asarray(tokens[s:s + seq_len + 1], dtype=np.int64)
        engine.reset()
        for pos in range(seq_len):
            logits = engine.step(int(window[pos]), pos).astype(np.float64)  # [V]
            logz = float(log_partition(logits)[0])
            target = int(window[pos + 1])
            nll += logz - logits[target]
            hits += int(np.argmax(logits) == target)
            n += 1
    loss = nll / max(n, 1)
    return EvalResult(loss=loss, ppl=float(np.exp(loss)), top1=hits / max(n, 1), n_tokens=n)


# ---- llama-perplexity's convention -----------------------------------------------------------------
@dataclass
class StridedPerplexity:
    """llama-perplexity's result: ppl = exp(mean nll) over the scored tokens, err its standard error
    (llama.cpp's "+/-": sqrt(var(nll) / (n - 1)) * ppl), running[i] the PPL after chunk i + 1."""

    ppl: float
    err: float
    nll: float
    n_tokens: int
    n_ctx: int
    chunks: int
    running: list[float]


def min_tokens(n_ctx: int) -> int:
    """The fewest tokens llama-perplexity accepts for a context of n_ctx (two windows)."""
    return 2 * n_ctx


def strided_perplexity(engine, tokens, n_ctx: int, *, chunks: int | None = None, bos: int | None = None,
                       on_chunk=None) -> StridedPerplexity:
    """Perplexity as llama.cpp's llama-perplexity computes it, so the two programs' numbers compare:
    `tokens` (the whole text, tokenized with the model's BOS rule) is cut into len // n_ctx
    windows of n_ctx tokens (at most `chunks` of them), each evaluated from position 0 on its own
    with its first token replaced by `bos` when the model adds one (llama.cpp does the same), and
    only the second half of each window is scored: the logits at positions n_ctx/2 .. n_ctx-2
    predict the tokens after them (n_ctx/2 - 1 tokens per window, each with at least n_ctx/2
    tokens of context). `on_chunk(i, running_ppl)` after each window. Scoring is
    cflow.runtime.score.score (Engine.step_rows, the lm_head only where scored)."""
    from cflow.runtime.errors import EngineError
    from cflow.runtime.score import score

    if n_ctx < 4:
        raise EngineError(f"the perplexity context must be at least 4 tokens, got {n_ctx}")
    toks = [int(t) for t in tokens]
    if len(toks) < min_tokens(n_ctx):
        raise EngineError(f"the text has {len(toks)} tokens; a context of {n_ctx} needs at least "
                          f"{min_tokens(n_ctx)} (two windows, as llama-perplexity): give a longer text or a smaller "
                          f"-c")
    n_chunk = len(toks) // n_ctx if chunks is None or chunks < 0 else min(int(chunks), len(toks) // n_ctx)
    first = n_ctx // 2
    nll = nll2 = 0.0
    count = 0
    running: list[float] = []
    for i in range(n_chunk):
        window = toks[i * n_ctx:(i + 1) * n_ctx]
        if bos is not None:
            window[0] = bos
        s = score(engine, window, start=first + 1)
        for lp in s.logprobs[first + 1:]:
            nll -= lp
            nll2 += lp * lp
        count += n_ctx - first - 1
        running.append(math.exp(nll / count))
        if on_chunk is not None:
            on_chunk(i, running[-1])
    mean = nll / count
    ppl = math.exp(mean)
    var = nll2 / count - mean * mean
    err = math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else float("nan")
    return StridedPerplexity(ppl, err, mean, count, n_ctx, n_chunk, running)
