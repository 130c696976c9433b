"""Teacher-forced perplexity and top-1 accuracy of a model file, measured through the engine.

This is what the quantized model a user runs actually scores, to set beside the float
checkpoint's numbers from training. Windows are the training loop's validation windows
(`cflow.train.data.eval_windows`), so the two are directly comparable.
"""

from __future__ import annotations

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
    nll = 0.0
    hits = 0
    n = 0
    for s in starts:
        window = np.asarray(tokens[s:s + seq_len + 1], dtype=np.int64)
        engine.reset()
        for pos in range(seq_len):
            logits = engine.step(int(window[pos]), pos).astype(np.float64)  # [V]
            top = logits.max()
            logz = top + np.log(np.exp(logits - top).sum())
            target = int(window[pos + 1])
            nll += logz - logits[target]
            hits += int(np.argmax(logits) == target)
            n += 1
    loss = nll / max(n, 1)
    return EvalResult(loss=loss, ppl=float(np.exp(loss)), top1=hits / max(n, 1), n_tokens=n)
