"""Speculative decoding per request inside continuous batching (cflow.serve.batch).

A speculating sequence's decode row becomes a block of k + 1 rows of the iteration's one
`step_rows` call: its next token, then the k tokens its proposer guesses after it, at consecutive
positions of its own slot, every row wanted, beside the other sequences' decode rows and prompt
chunks. Row i's logits judge proposal i + 1 with cflow.runtime.speculative's rule (`judge`, over
`verify`: greedy keeps a proposal while it is the argmax; sampling keeps it with probability
min(1, p(d) / q(d)) and replaces a rejected one by a draw from the residual; when all k are kept,
the last row gives the bonus token). The scheduler sends each emitted token down the plain decode
path (stop ids, stop strings, logprobs of its own row, max_tokens, the events) and stops the block
at the first token that ends the sequence.

The three proposers of cflow.runtime.speculative, per sequence:
- "ngram": the prompt lookup over the sequence's own prompt and output (q: a point mass);
- "draft": the generator's draft model (`DraftSlots`: a second BatchBackend with one KV slot per
  target slot, whose cache follows each sequence's accepted text). Before the target call, the
  draft runs in batched calls of its own: one that catches every drafting sequence up with its
  text (the rows its slot does not hold yet: the whole prompt the first time), then one row per
  sequence per further proposal. q is the draft's distribution under the sequence's sampling
  settings, drawn with the sequence's own random stream;
- "mtp": the target's own multi-token prediction heads (cflow.runtime.mtp) on the final hidden
  state of the row whose logits chose the sequence's newest token, which the generator hands over
  after each call (`SeqSpec.observe`; the backend keeps the hidden states of the call's logits
  rows while any sequence uses heads).
With the same seed and no row cap in the way, a sequence draws exactly what Engine.complete(...,
speculative=the same settings) draws: the same proposals, acceptance tests and corrections from
the same random stream in the same order.

Owns: `Speculation` (what a generator can speculate with and what a job's `speculative=` means
there), `DraftSlots`, `SeqSpec` (one sequence's proposer, Gate, DraftLength and counts: each
sequence speculates, pauses and grows its proposals on its own); one row's decision is
cflow.runtime.speculative.judge, the loop's own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from cflow.runtime.generate import check_finite, common_prefix
from cflow.runtime.speculative import (DRAFT_START, DraftLength, MtpProposer, NgramProposer, Speculative,
                                       SpeculativeError, check_draft, check_rewindable, make_gate,
                                       proposals_counted)
from cflow.sampling import Sampler, SamplingParams, draw

Q = tuple[np.ndarray, np.ndarray]  # a proposal's distribution: (ids, probabilities)


# ---- what a generator speculates with ------------------------------------------------------------
class Speculation:
    """The proposers a BatchGenerator has: the n-gram lookup always; a draft model when it was
    given one (`draft`: a BatchBackend over a model with the target's vocabulary, at least as many
    slots); the target's multi-token heads when its backend exposes them with its hidden states
    (EngineBatch over a model trained with `cflow train --mtp N`)."""

    def __init__(self, backend: Any, draft: Any = None) -> None:
        self.backend = backend
        self.target = getattr(backend, "engine", None)  # EngineBatch / EngineSlots.engine; None: not an Engine
        self.draft = DraftSlots(draft, backend) if draft is not None else None

    def resolve(self, value: Any) -> Speculative | None:
        """The settings a job's `speculative=` means: None, False or "off": none; True or "ngram":
        the n-gram lookup with the defaults; "draft": the generator's draft model; "mtp": the
        target's heads; a Speculative as it is (its draft, a path or an Engine, stands for the
        generator's draft model: a job cannot bring its own). SpeculativeError for what this
        generator cannot run."""
        if value is None or value is False or value == "off":
            return None
        check_rewindable(self.target)
        if value is True or value == "ngram":
            return Speculative("ngram")
        if value in ("draft", "mtp"):
            value = Speculative(value, draft=self._draft_engine() if value == "draft" else None)
        if not isinstance(value, Speculative):
            raise SpeculativeError(f"speculative takes None, 'off', 'ngram', 'draft', 'mtp' or a Speculative, got "
                                   f"{value!r}"[:200], flag="--spec")
        if value.proposer == "draft":
            mine = self._draft_engine()
            return value if value.draft is mine else dataclasses.replace(value, draft=mine)
        if value.proposer == "mtp":
            self.heads()
        return value

    def _draft_engine(self) -> Any:
        if self.draft is None:
            raise SpeculativeError("speculative \"draft\": this server has no draft model; start it with "
                                   "--model-draft FILE (Python: BatchGenerator(backend, draft=load_backend(FILE, "
                                   "n_slots))), or use \"ngram\"", flag="--model-draft")
        return self.draft.engine

    def heads(self) -> Any:
        """The target's multi-token prediction heads (NoMtpHeadsError when it has none)."""
        if not (hasattr(self.backend, "mtp") and hasattr(self.backend, "hidden")):
            raise SpeculativeError("speculative \"mtp\" needs the batched backend (EngineBatch), which hands back "
                                   "the hidden states the heads read", flag="--spec")
        return self.backend.mtp

    def sequence(self, spec: Speculative, params: SamplingParams) -> "SeqSpec":
        """A new sequence's speculation state under `spec` (resolved) and its sampling settings."""
        return SeqSpec(spec, params, self)


# ---- the draft model's slots ---------------------------------------------------------------------
class DraftSlots:
    """A draft model over its own BatchBackend: slot s drafts for the target's slot s. `held[s]` is
    the text whose K/V the draft's slot s holds (a call at a position overwrites from there, so
    following a sequence's accepted text is a matter of where the next call starts)."""

    def __init__(self, backend: Any, target: Any) -> None:
        if not hasattr(backend, "step_rows"):
            raise SpeculativeError(f"the draft model's backend {backend!r} has no step_rows", flag="--model-draft")
        if backend.n_slots < target.n_slots:
            raise SpeculativeError(f"the draft model has {backend.n_slots} slots for the target's {target.n_slots}; "
                                   f"load it with n_slots={target.n_slots}", flag="--model-draft")
        self.backend = backend
        self.engine = getattr(backend, "engine", None)
        target_engine = getattr(target, "engine", None)
        if self.engine is None or target_engine is None:
            raise SpeculativeError(f"a draft model needs Engine backends on both sides (EngineBatch or EngineSlots, "
                                   f"with .engine); got {backend!r} for the draft and {target!r} for the target",
                                   flag="--model-draft")
        check_draft(target_engine, self.engine)
        self.held: list[list[int]] = [[] for _ in range(backend.n_slots)]

    def propose(self, asks: Sequence[tuple["SeqSpec", int, list[int], int, np.random.Generator]]) -> dict[int, Any]:
        """Fill each asking sequence's proposals (SeqSpec.drafts, .qs): asks are (its SeqSpec, its
        slot, its text so far, how many, its random stream). Batched: one call catches every asker
        up with its text, then one row per asker per further proposal. Returns {slot: exception}
        for the askers whose draft computation failed (their proposals stay empty)."""
        b = self.backend
        live: list[list[Any]] = []   # [SeqSpec, slot, text + proposals, k, rng]
        slots: list[int] = []
        toks: list[int] = []
        poss: list[int] = []
        want: list[bool] = []
        for st, slot, history, k, rng in asks:
            st.drafts, st.qs = [], []
            k = min(k, b.n_ctx - len(history) + 1)  # the last proposal is not run: it needs no position
            if k < 1:
                continue
            held = self.held[slot]
            c = min(common_prefix(held, history), len(history) - 1)
            del held[c:]
            rows = history[c:]
            slots += [slot] * len(rows)
            toks += rows
            poss += range(c, len(history))
            want += [False] * (len(rows) - 1) + [True]
            live.append([st, slot, list(history), k, rng])
        failed: dict[int, Any] = {}
        while live:
            try:
                logits = b.step_rows(slots, toks, poss, want)
            except Exception as e:  # what the call wrote is unknown: forget those slots' drafts
                for st, slot, *_ in live:
                    self.held[slot].clear()
                    st.drafts, st.qs = [], []
                    failed[slot] = e
                return failed
            for slot, t in zip(slots, toks):
                self.held[slot].append(t)
            nxt: list[list[Any]] = []
            slots, toks, poss, want = [], [], [], []
            for row, a in zip(logits, live):
                st, slot, text, k, rng = a
                try:
                    check_finite(self.engine, row, f"in the draft model at position {len(text) - 1}")
                except Exception as e:
                    st.drafts, st.qs = [], []
                    failed[slot] = e
                    continue
                x, q = st.draw(row, text, rng)
                st.drafts.append(x)
                st.qs.append(q)
                text.append(x)
                if len(st.drafts) < k:
                    slots.append(slot)
                    toks.append(x)
                    poss.append(len(text) - 1)
                    want.append(True)
                    nxt.append(a)
            live = nxt
        return failed


# ---- one sequence --------------------------------------------------------------------------------
class SeqSpec:
    """One sequence's speculation: its proposer (an n-gram index over its prompt and output, the
    target's heads, or its share of the draft model), its Gate (pauses while its proposals lose),
    its DraftLength (proposals follow its accepted runs), the proposals of the current iteration
    with their distributions, and its counts."""

    def __init__(self, spec: Speculative, params: SamplingParams, where: Speculation) -> None:
        self.spec = spec
        self.kind = spec.proposer
        self.sampler = Sampler(params)  # q only: draws use the sequence's own random stream
        self.greedy = self.sampler.plain_greedy
        self.proposer: NgramProposer | MtpProposer | None = None
        if self.kind == "ngram":
            self.proposer = NgramProposer(spec.ngram_min, spec.ngram_max)
        elif self.kind == "mtp":
            self.proposer = MtpProposer(where.backend, params)  # reads where.backend.mtp
        self.observes = self.kind == "mtp"
        self.gate = make_gate(spec, where.target, where.backend.mtp if self.kind == "mtp" else None)
        self.length = DraftLength(spec.draft_max, DRAFT_START)
        self.k_max: int | None = None  # this iteration's most proposals (plan)
        self.drafts: list[int] = []  # this iteration's proposals (rows after the next token)
        self.qs: list[Q | None] = []  # their distributions (None: a point mass)
        self.drafted = 0             # proposals verified (cflow.runtime.speculative.proposals_counted)
        self.accepted = 0            # of which kept
        self.rounds = 0              # verification blocks
        self.paused = 0              # decode rows taken plainly because the Gate had paused speculation
        self._block = [0, 0]         # the current block's counted and kept proposals

    def plan(self, left: int, room: int) -> int:
        """How many proposals this iteration asks for (0: a plain decode row): at most the
        DraftLength, `left` (tokens the sequence may emit after this iteration's first) and `room`
        (rows the call has left), as cflow.runtime.speculative.run; the Gate may say none."""
        s = self.spec
        self.drafts, self.qs = [], []
        k, self.k_max = self.length.limits(min(left, room), s.adaptive)  # k_max: an n-gram match may go up to it
        if k >= max(1, s.draft_min):
            if self.gate.open():
                return k
            self.paused += 1
        return 0

    def propose(self, history: Sequence[int], k: int, rng: np.random.Generator) -> None:
        """Proposals of the n-gram lookup or the heads (the draft model's come from DraftSlots)."""
        drafts, qs = self.proposer.propose(history, k, rng, self.k_max)
        self.drafts, self.qs = list(drafts), list(qs) if qs else [None] * len(drafts)

    def settle(self) -> list[int]:
        """The proposals that ride in the call: none when fewer than draft_min came."""
        if len(self.drafts) < self.spec.draft_min:
            self.drafts, self.qs = [], []
        return self.drafts

    def draw(self, logits: np.ndarray, text: Sequence[int], rng: np.random.Generator) -> tuple[int, Q | None]:
        """A draft model's proposal from its logits after `text`: the argmax for plain greedy
        decoding, else a draw from q (the sequence's sampling settings on the draft's logits)."""
        if self.greedy:
            return int(logits.argmax()), None
        ids, q = self.sampler.probs(logits, text)
        return draw(ids, q, rng), (ids, q)

    def observe(self, h: np.ndarray | None) -> None:
        """The hidden state of the row whose logits chose the newest token (None: not available,
        so the next iteration decodes plainly and gets one)."""
        if h is None:
            self.proposer.h = None
        else:
            self.proposer.observe(h)

    def judged(self, i: int, kept: bool) -> int:
        """Proposal i of the block decided; how many proposals that counts as drafted
        (proposals_counted: a rejection counts the ones after it too). Counted at once: the token
        it emits may end the sequence, whose Finished event carries the counts."""
        counted = proposals_counted(len(self.drafts), i, kept)
        self.drafted += counted
        self.accepted += kept
        self._block[0] += counted
        self._block[1] += kept
        return counted

    def end_block(self) -> tuple[int, int]:
        """The block is verified: the Gate and the DraftLength learn from it; (proposed, kept)."""
        proposed, kept = self._block
        self.gate.record(proposed, kept)
        self.length.record(proposed, kept)
        self.rounds += 1
        self.drafts, self.qs, self._block = [], [], [0, 0]
        return proposed, kept
