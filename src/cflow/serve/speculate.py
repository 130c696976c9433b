"""Speculative decoding per request inside continuous batching (cflow.serve.batch).

A speculating sequence's decode row becomes a block of k + 1 rows of the iteration's one
`step_rows` call: its next token, then the k tokens its proposer guesses after it, at consecutive
positions of its own slot, every row wanted, beside the other sequences' decode rows and prompt
chunks. Row i's logits judge proposal i + 1 with cflow.runtime.speculative's rule (`judge` here,
`verify` there: greedy keeps a proposal while it is the argmax; sampling keeps it with probability
p(d) (the n-gram lookup is a point mass) and replaces a rejected one by a draw from the residual;
when all k are kept, the last row gives the bonus token). The scheduler sends each emitted token
down the plain decode path (stop ids, stop strings, logprobs of its own row, max_tokens, the
events) and stops the block at the first token that ends the sequence.

Owns: `resolve` (what submit's `speculative=` means here: the n-gram lookup only; a draft model
and multi-token heads are single-sequence for now, cflow.runtime.speculative), `SeqSpec` (one
sequence's proposer, Gate, DraftLength and counts: each sequence speculates, pauses and grows
its proposals on its own) and `judge` (one row's decision). With the same seed and no row cap
in the way, a sequence draws what Engine.complete(..., speculative=the same settings) draws.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from cflow.runtime.generate import check_finite
from cflow.runtime.speculative import (DRAFT_START, DraftLength, Gate, NgramProposer, Speculative, SpeculativeError,
                                       min_rate, verify)
from cflow.sampling import Sampler, draw

SINGLE_SEQUENCE = ("the server speculates with the n-gram lookup only (speculative: \"ngram\"); a draft model and "
                   "multi-token prediction heads are single-sequence for now (cflow generate / Engine.complete "
                   "with --spec draft or --spec mtp)")


def resolve(value: Any) -> Speculative | None:
    """The settings a job's `speculative=` means: None, False or "off": none; True or "ngram": the
    n-gram lookup with the defaults; a Speculative with proposer "ngram" as it is. A draft model
    or "mtp" raises SpeculativeError (single-sequence only for now)."""
    if value is None or value is False or value == "off":
        return None
    if value is True or value == "ngram":
        return Speculative("ngram")
    if isinstance(value, Speculative):
        if value.proposer != "ngram":
            raise SpeculativeError(f"speculative proposer {value.proposer!r}: {SINGLE_SEQUENCE}", flag="--spec")
        return value
    if isinstance(value, str):
        if value in ("draft", "mtp"):
            raise SpeculativeError(f"speculative {value!r}: {SINGLE_SEQUENCE}", flag="--spec")
        raise SpeculativeError(f"speculative takes 'off' or 'ngram', got {value!r}", flag="--spec")
    raise SpeculativeError(f"speculative takes None, 'off', 'ngram' or a Speculative with the ngram proposer "
                           f"({SINGLE_SEQUENCE}), got {type(value).__name__}", flag="--spec")


class SeqSpec:
    """One sequence's speculation: its n-gram index over its prompt and output, its Gate (pauses
    while its proposals lose), its DraftLength (proposals follow its accepted runs), the
    proposals of the current iteration and its counts."""

    def __init__(self, spec: Speculative) -> None:
        self.spec = spec
        self.proposer = NgramProposer(spec.ngram_min, spec.ngram_max)
        self.gate = Gate(min_rate(spec, None))  # the n-gram lookup's threshold needs no engine
        self.length = DraftLength(spec.draft_max, DRAFT_START)
        self.drafts: list[int] = []  # this iteration's proposals (rows after the next token)
        self.drafted = 0             # proposals judged (those after a token that ended the sequence are not)
        self.accepted = 0            # of which kept
        self.rounds = 0              # verification blocks
        self._block = [0, 0]         # the current block's judged and kept proposals

    def propose(self, history: Sequence[int], left: int, room: int, rng: np.random.Generator) -> list[int]:
        """This iteration's proposals after history[-1] (the next token, not yet run); [] for a
        plain decode row. At most the DraftLength, `left` (tokens the sequence may emit after this
        iteration's first) and `room` (rows the call has left), as cflow.runtime.speculative.run."""
        s = self.spec
        k = min(self.length.k if s.adaptive else s.draft_max, left, room)
        self.drafts = []
        if k >= max(1, s.draft_min) and self.gate.open():
            drafts, _ = self.proposer.propose(history, k, rng)
            if len(drafts) >= s.draft_min:
                self.drafts = drafts
        return self.drafts

    def judged(self, kept: bool) -> None:
        """One proposal decided (counted at once: the token it emits may end the sequence, whose
        Finished event carries the counts)."""
        self.drafted += 1
        self.accepted += kept
        self._block[0] += 1
        self._block[1] += kept

    def end_block(self) -> tuple[int, int]:
        """The block is verified: the Gate and the DraftLength learn from it; (judged, kept)."""
        judged, kept = self._block
        self.gate.record(judged, kept)
        self.length.record(judged, kept)
        self.rounds += 1
        self.drafts, self._block = [], [0, 0]
        return judged, kept


def judge(sampler: Sampler, row: np.ndarray, history: Sequence[int], draft: int | None, backend: Any,
          pos: int) -> tuple[bool, int]:
    """(kept, the token emitted there) for the logits `row` of position `pos` (predicting the
    next one) against the proposed `draft`; draft None: the bonus row, sampled as a plain row.
    `history`: the text up to and including the token at `pos`. Raises for non-finite logits."""
    if sampler.plain_greedy:  # the argmax; the chosen logit doubles as the finiteness check
        tok = int(row.argmax())
        check_finite(backend, row[tok:tok + 1], f"at position {pos}")
        return draft == tok, tok
    check_finite(backend, row, f"at position {pos}")
    ids, p = sampler.probs(row, history)
    if draft is None:
        return False, draw(ids, p, sampler.rng)
    return verify(ids, p, draft, None, None, sampler.rng)  # q None: the lookup's point mass
