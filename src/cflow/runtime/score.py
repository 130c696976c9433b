"""Scoring text: the log-probability the model gives each token of a sequence given the tokens before
it (teacher forcing), the quantity loglikelihood evaluations (EleutherAI's lm-eval), the server's
`echo` + `logprobs` and perplexity are made of.

    from cflow.runtime import Engine
    eng = Engine.load("model.gguf")
    s = eng.score("The capital of France is Paris")   # or score(eng, ids, top=5)
    s.tokens, s.logprobs          # logprobs[0] is None (nothing predicts the first token)
    sum(s.logprobs[k:])           # log p(tokens[k:] | tokens[:k])

Owns the two definitions every scorer here uses:
- `token_logprobs(logits, token, n)`: log p(token) under softmax(logits) in float64, and the n
  most likely alternatives (the server's completion logprobs use it too);
- `score(engine, tokens)`: the logits of every position from `Engine.step_rows` (all rows wanted,
  in chunks of at most SCORE_ROWS rows so the [rows, V] logits block stays small). step_rows rows
  are bit for bit what step/prefill give and do not depend on the other rows of the call, so a
  score equals what a server computes for the same tokens in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from cflow.runtime.errors import ContextOverflowError, EngineError

SCORE_ROWS = 64  # positions per step_rows call: logits of 64 rows of a 49k vocabulary are 12.6 MB


def log_partition(logits: np.ndarray) -> np.ndarray:
    """log sum exp over the last axis, in float64, kept as an axis of size 1: logits - this is the
    log-softmax. The one definition the scoring, the server and cflow bench's perplexity share."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def token_logprobs(logits: np.ndarray, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """log p(token) under softmax(logits) (the model's distribution, before sampling filters) and
    the n most likely (id, logprob), best first (ties: the lower id first)."""
    x = logits.astype(np.float64)
    lse = float(log_partition(x)[0])
    top: list[tuple[int, float]] = []
    if n > 0:
        n = min(n, x.size)
        idx = np.argpartition(-x, n - 1)[:n] if n < x.size else np.arange(x.size)
        idx = idx[np.lexsort((idx, -x[idx]))]
        top = [(int(i), float(x[i] - lse)) for i in idx]
    return float(x[token] - lse), top


@dataclass
class Scores:
    """Per-token scores of `tokens`: logprobs[i] = log p(tokens[i] | tokens[:i]) (None for i = 0),
    top[i] the `top` most likely tokens at position i as (id, logprob) (None for i = 0), greedy[i]
    whether tokens[i] is the model's argmax there (None for i = 0)."""

    tokens: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None] = field(default_factory=list)
    greedy: list[bool | None] = field(default_factory=list)

    def total(self, start: int = 1) -> float:
        """log p(tokens[start:] | tokens[:start]) (start >= 1)."""
        if start < 1:
            raise ValueError(f"start must be >= 1 (nothing predicts the first token), got {start}")
        return float(sum(self.logprobs[start:]))  # type: ignore[arg-type]


def score(engine: Any, tokens: Sequence[int] | str, *, top: int = 0, seq: int = 0, add_bos: bool | None = None,
          start: int = 1, rows: int = SCORE_ROWS) -> Scores:
    """Score the tokens of `tokens` (ids, or text encoded with the model's BOS rule unless `add_bos`
    says otherwise) from position `start` on (>= 1; earlier ones get None and their rows skip the
    lm_head), run on sequence `seq` of `engine` from position 0; `top`: alternatives per position.
    The sequence's cache then holds the tokens. Raises EngineError for an empty input or bad ids,
    ContextOverflowError when the tokens do not fit the engine's context."""
    ids = engine.encode(tokens, add_bos) if isinstance(tokens, str) else engine.encode(list(tokens))
    if not ids:
        raise EngineError("nothing to score: no tokens")
    if start < 1:
        raise ValueError(f"start must be >= 1 (nothing predicts the first token), got {start}")
    if len(ids) > engine.n_ctx:
        raise ContextOverflowError(f"{len(ids)} tokens do not fit the context of {engine.n_ctx}; load the model "
                                   f"with a larger context (-c / n_ctx)", flag="-c")
    skip = min(start, len(ids))
    out = Scores(list(ids), [None] * skip, [None] * skip, [None] * skip)
    for p0 in range(0, len(ids), rows):
        n = min(rows, len(ids) - p0)
        # row j predicts position j + 1: wanted from position start - 1 on, up to the last but one
        want = [start - 1 <= j < len(ids) - 1 for j in range(p0, p0 + n)]
        logits = engine.step_rows([seq] * n, ids[p0:p0 + n], range(p0, p0 + n), want)
        for r, j in enumerate(j for j, w in zip(range(p0, p0 + n), want) if w):
            append_score(out, logits[r], ids[j + 1], top)
    return out


def append_score(out: Scores, logits: np.ndarray, token: int, top: int) -> None:
    """Add the score of `token` at the next position of `out` from the logits that predict it."""
    lp, alts = token_logprobs(logits, token, max(top, 1))
    out.logprobs.append(lp)
    out.top.append(alts[:top])
    out.greedy.append(int(np.argmax(logits)) == token)
