"""Speculative decoding: guess several tokens cheaply, then let the model check them all in one call.

    eng.complete(prompt, temperature=0, speculative="ngram")             # prompt lookup, no second model
    eng.complete(prompt, speculative="mtp")          # the model's own multi-token heads (cflow train --mtp N)
    draft = Engine.load("small.gguf")                                      # same vocabulary as eng
    eng.complete(prompt, speculative=Speculative(draft=draft, draft_max=6))

Each round a proposer guesses up to `draft_max` tokens d_1..d_k after the text so far; the model
(the "target") runs the newest emitted token and d_1..d_k as k+1 consecutive rows of one native
call (Engine.step_rows: one pass over the weights, each row bit for bit what step() gives), which
scores all k+1 positions. Then, position by position, the standard rule decides:

- greedy: d_i is kept while it equals the target's argmax there; the first mismatch is replaced by
  the argmax. The output is token for token plain greedy decoding.
- sampling: d_i is kept with probability min(1, p(d_i) / q(d_i)), p the target's distribution
  there (the engine's Sampler: logit bias, penalties over the history up to that position, top-k,
  top-p, min-p, temperature, exactly what plain sampling would use) and q the proposer's. A
  rejected d_i is replaced by a draw from max(0, p - q), normalised; when all k are kept, one more
  token (the bonus) is drawn from p at position k+1. The output has exactly the target's
  distribution (Leviathan et al. 2023, Chen et al. 2023). A deterministic proposer (the n-gram
  lookup) is a point mass: q(d_i) = 1, so d_i is kept with probability p(d_i).

Every call thus emits 1 + (accepted) tokens. How many tokens a round proposes follows the accepted
runs (DraftLength) and, for the n-gram lookup, the length of the match, and the Gate pauses
speculation while it loses. Positions of rejected tokens are rolled back: the engine's bookkeeping
forgets them (Engine.truncate) and the next call overwrites their K/V. Every emitted token goes
through cflow.runtime.generate.Generation.emit, the plain loop's own rules for stop ids, stop
strings, max_tokens and the context end, so generation stops exactly where plain decoding does; a
round never proposes more tokens than are left to emit. One random stream (the Sampler's, seeded)
serves the draft's draws, the acceptance tests and the corrections, in a fixed order, so a seed
reproduces a run.

Owns: the settings (Speculative, and `resolve`, which turns what a caller passed into them), the
proposers (NgramProposer: prompt lookup decoding, llama.cpp's `lookup`; DraftProposer: a second
Engine with the same vocabulary, whose KV cache follows the accepted text; MtpProposer: the
model's own multi-token prediction heads, cflow.runtime.mtp, run on the final hidden state the
target call just computed), the acceptance rule
(`accept_probability`, `residual`, `verify`, and `judge`, one row's decision: one definition, used by
the loop, cflow.serve and the tests), the
Gate that pauses speculation while it loses (make_gate: its thresholds, measured), and the loop
(`run`).

When it helps: a round costs one target call of k+1 rows instead of one row; on a CPU a decode
step streams the weights once, so the extra rows cost little (docs/results/speculative.md has the
measured cost curve) and each accepted token saves a whole step. The n-gram lookup wins when the
output repeats the input (summaries, rewrites, code edits, extraction); on free text it finds few
matches and costs nothing then (no match: a plain step). A draft model wins when it is much
smaller than the target and agrees with it often. Multi-token heads need no second model (two
small mat-vecs per head on a hidden state the target computed anyway, then N rows of the lm_head,
which on a small model or an AVX2 machine is a large share of a step: the Gate charges it) and
guess free text too, but only as far ahead as the model has heads.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

from cflow.runtime.errors import EngineError
from cflow.runtime.generate import Generation, check_finite
from cflow.sampling import Sampler, SamplingParams, draw

if TYPE_CHECKING:
    from cflow.runtime.engine import Engine

PROPOSERS = ("ngram", "draft", "mtp")
# Rounds of at most 8 rows (7 proposals + the newest token): the avx512 table's small-batch kernels
# run up to 8 rows in one pass over the weights (kernels_avx512.c, SB_NB) and a 9th row starts a
# second pass. Measured 2026-12-05, SmolLM2 Q4_1, 2 threads (benchmarks/small_batch_ab.py): an
# 8-row call 2.26x a 1-row step, 9 rows 2.75x, so a round that keeps everything emits 8 tokens per
# 2.26 steps at k = 7 against 9 per 2.75 at k = 8.
DEFAULT_DRAFT_MAX = 7
DEFAULT_NGRAM_MAX = 3
DEFAULT_NGRAM_MIN = 2  # a one-token match predicts poorly (docs/results/speculative.md)
# The gate (see Gate): rounds it looks back over, the first pause (plain steps) and the longest.
GATE_WINDOW = 8
GATE_PAUSE = 16
GATE_MAX_PAUSE = 256
DRAFT_START = 4  # the first round's proposals (DraftLength)
SHORT_MATCH_DRAFT = 2  # n-gram proposals at most after a match of only ngram_min tokens (NgramProposer)
# What one more row costs in a target call, as a share of a one-row step: speculation pays while
# the acceptance rate exceeds it. Measured per engine and thread count (engine_row_cost) from a
# one-row step and a call of ROW_COST_ROWS rows (a round of the first proposals' length); ROW_COST
# stands in where nothing was measured (a backend that is not an Engine, no room in the context).
ROW_COST = 0.2
ROW_COST_ROWS = 1 + DRAFT_START
ROW_COST_REPEATS = 3  # each call timed this many times, alternating; the fastest of each counts
# The measured cost is rounded to this grid, so that runs of one setup get the same threshold (and
# a seeded run the same gate decisions) however the clock jitters between them.
ROW_COST_GRID = 0.05
HEADS_COST_MAX = 4.0  # the most a heads' proposal is taken to cost, in one-row steps (engine_heads_cost)


class SpeculativeError(EngineError):
    """Speculative decoding was asked for with settings it cannot run."""


class DraftVocabularyError(SpeculativeError):
    """The draft model's vocabulary is not the target's, so its tokens would mean other text."""


def check_rewindable(eng: Any) -> None:
    """SpeculativeError when `eng` cannot forget rejected tokens: a model with recurrent layers
    (Qwen3.5's Gated DeltaNet) holds the state after its last token only (Engine.truncate)."""
    cfg = getattr(eng, "config", None)
    if getattr(cfg, "recurrent", False):
        raise SpeculativeError(f"speculative decoding rolls rejected tokens back, and {cfg.name} keeps a recurrent "
                               "(Gated DeltaNet) state per sequence that cannot go back; decode it without "
                               "speculation (--spec off)", flag="--spec")


# ---- settings --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Speculative:
    """How to speculate. proposer: "ngram" (prompt lookup), "draft" (the `draft` Engine) or "mtp"
    (the model's multi-token prediction heads: at most mtp_heads tokens a round); None: "draft"
    when a draft is given, else "ngram". draft_max: tokens proposed per round at most
    (llama.cpp's --draft-max); draft_min: a round with fewer proposed tokens is a plain step
    instead (--draft-min). ngram_max, ngram_min: the n-gram lookup tries suffixes of these lengths,
    longest first. min_acceptance: the Gate's threshold (None: the target's measured row cost,
    engine_row_cost, for the n-gram lookup and the heads, the heads' own cost per round charged
    too and their recorded agreement deciding the start (make_gate); that plus the draft's weight
    bytes per token over the target's for a draft model); a value given is the threshold alone, and
    0 keeps speculation always on. adaptive: each round's length follows the accepted runs
    (DraftLength: starts at DRAFT_START, doubles while all are kept, drops to one more than
    were kept after a rejection) and, for the n-gram lookup, the match's length (NgramProposer:
    a longer match proposes draft_max); False: always draft_max."""

    proposer: str | None = None
    draft: Any = None  # an Engine
    draft_max: int = DEFAULT_DRAFT_MAX
    draft_min: int = 0
    ngram_max: int = DEFAULT_NGRAM_MAX
    ngram_min: int = DEFAULT_NGRAM_MIN
    min_acceptance: float | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        name = self.proposer if self.proposer is not None else ("draft" if self.draft is not None else "ngram")
        if name not in PROPOSERS:
            raise SpeculativeError(f"unknown speculative proposer {name!r}: use one of {', '.join(PROPOSERS)} "
                                   f"(ngram: prompt lookup, no second model; draft: a smaller model with the same "
                                   f"vocabulary, --model-draft FILE; mtp: the model's own multi-token prediction "
                                   f"heads, trained with `cflow train --mtp N`)", flag="--spec")
        if name == "draft" and self.draft is None:
            raise SpeculativeError("speculation with a draft model needs the draft model: --model-draft FILE "
                                   "(Python: Speculative(draft=Engine.load(FILE)))", flag="--model-draft")
        if name != "draft" and self.draft is not None:
            raise SpeculativeError(f"a draft model was given with the {name} proposer; use --spec draft (or leave "
                                   "--spec out: --model-draft implies it)", flag="--spec")
        object.__setattr__(self, "proposer", name)
        for field, flag, low in (("draft_max", "--draft-max", 1), ("draft_min", "--draft-min", 0),
                                 ("ngram_min", "--spec-ngram-min", 1), ("ngram_max", "--spec-ngram-max", 1)):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                raise SpeculativeError(f"{field} must be an int >= {low}, got {v!r}", flag=flag)
        if self.draft_min > self.draft_max:
            raise SpeculativeError(f"draft_min ({self.draft_min}) is larger than draft_max ({self.draft_max}), so "
                                   f"no round could ever speculate", flag="--draft-min")
        if self.ngram_min > self.ngram_max:
            raise SpeculativeError(f"ngram_min ({self.ngram_min}) is larger than ngram_max ({self.ngram_max})",
                                   flag="--spec-ngram-min")
        m = self.min_acceptance
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m <= 1):
            raise SpeculativeError(f"min_acceptance must be in [0, 1] (0: never pause), got {m!r}")


def resolve(value: Any, eng: "Engine") -> Speculative | None:
    """The Speculative a caller's `speculative=` means: None, False or "off": none; "ngram"; "mtp";
    an Engine: that engine as the draft model; a Speculative as it is. The draft's vocabulary is
    checked against `eng`'s; for "mtp", that `eng` has heads (cflow.runtime.mtp.NoMtpHeadsError)."""
    from cflow.runtime.engine import Engine

    if value is None or value is False or value == "off":
        return None
    if isinstance(value, str):
        spec = Speculative(proposer=value)
    elif isinstance(value, Engine):
        spec = Speculative(draft=value)
    elif isinstance(value, Speculative):
        spec = value
    else:
        raise SpeculativeError(f"speculative= takes None, 'ngram', 'mtp', a draft Engine or a Speculative, got "
                               f"{type(value).__name__}")
    if spec.proposer == "mtp":
        eng.mtp  # noqa: B018 (loads the heads now: a model without them is refused before generating)
    if spec.draft is not None:
        if spec.draft is eng:  # one KV cache cannot hold both the text and the draft's guesses
            raise SpeculativeError("the draft model must be an Engine of its own, not the target itself: load the "
                                   "file a second time (Engine.load(path)) to use a model as its own draft")
        check_draft(eng, spec.draft)
    return spec


def check_draft(eng: "Engine", draft: "Engine") -> None:
    """A draft model must speak the target's vocabulary: the same number of tokens, the same text for each."""
    a, b = eng.tokenizer.vocab, draft.tokenizer.vocab
    same = eng.config.vocab_size == draft.config.vocab_size and (a is b or a == b)
    if not same:
        differ = (f"{draft.config.vocab_size} tokens against the target's {eng.config.vocab_size}"
                  if draft.config.vocab_size != eng.config.vocab_size or len(a) != len(b)
                  else f"the same size ({len(a)}) but other tokens (first at id "
                       f"{next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)})")
        raise DraftVocabularyError(
            f"the draft model {draft.path} does not share the vocabulary of {eng.path}: it has {differ}. A draft "
            f"must use the target's tokenizer: take a smaller model of the same family (e.g. SmolLM2-135M for "
            f"SmolLM2-1.7B), or use --spec ngram, which needs no second model", flag="--model-draft")


# ---- the acceptance rule -------------------------------------------------------------------------
def prob_of(ids: np.ndarray, p: np.ndarray, x: int) -> float:
    """p(x) of a distribution given as (ids, probabilities); 0 for an id outside it."""
    return float(p[ids == x].sum())


def accept_probability(px: float, qx: float) -> float:
    """The chance of keeping a proposed token x: min(1, p(x) / q(x)) (q(x) > 0: x was drawn from q)."""
    return 1.0 if px >= qx else px / qx


def residual(p_ids: np.ndarray, p: np.ndarray, q_ids: np.ndarray | None, q: np.ndarray | None,
             x: int) -> np.ndarray:
    """max(0, p - q) over p's ids (not normalised: draw() scales): where the replacement of a
    rejected x is drawn from. q None: the point mass at x (a deterministic proposer)."""
    if q is None:
        return np.where(p_ids == x, 0.0, p)
    n = int(max(p_ids.max(), q_ids.max())) + 1
    dense = np.zeros(n)
    dense[q_ids] = q
    return np.maximum(p - dense[p_ids], 0.0)


def verify(p_ids: np.ndarray, p: np.ndarray, x: int, q_ids: np.ndarray | None, q: np.ndarray | None,
           rng: np.random.Generator) -> tuple[bool, int]:
    """Speculative rejection sampling of one proposed token x at one position: (kept, the token
    emitted there). A uniform is drawn only when the decision is random (0 < acceptance < 1), so
    greedy decoding draws nothing."""
    qx = 1.0 if q is None else prob_of(q_ids, q, x)
    a = accept_probability(prob_of(p_ids, p, x), qx)
    if a >= 1.0 or (a > 0.0 and rng.random() < a):
        return True, x
    r = residual(p_ids, p, q_ids, q, x)
    if not r.sum() > 0:  # p == q to rounding: a rejection had probability ~0; draw from p itself
        r = p
    return False, draw(p_ids, r, rng)


def judge(sampler: Sampler, row: np.ndarray, history: Sequence[int], draft: int | None,
          q: tuple[np.ndarray, np.ndarray] | None, eng: Any, pos: int) -> tuple[bool, int]:
    """One verification row's decision: (kept, the token emitted there) for the logits `row` of
    position `pos` (predicting the next one) against the proposed `draft` drawn from q (None: a
    point mass); draft None: the bonus row, sampled as a plain row. `history`: the text up to and
    including the token at `pos`. Raises for non-finite logits (`eng` names the model). Plain
    greedy decoding (no bias, no penalties) takes the argmax straight from the row: no
    distribution is built, and the chosen logit doubles as the finiteness check (argmax finds a
    NaN or +inf first), so a round of k + 1 rows costs k + 1 argmaxes of Python time."""
    if sampler.plain_greedy:
        tok = int(row.argmax())
        check_finite(eng, row[tok:tok + 1], f"at position {pos}")
        return draft == tok, tok
    check_finite(eng, row, f"at position {pos}")
    ids, p = sampler.probs(row, history)
    if draft is None:
        return False, draw(ids, p, sampler.rng)
    return verify(ids, p, draft, *(q if q is not None else (None, None)), sampler.rng)


def proposals_counted(n: int, i: int, kept: bool) -> int:
    """How many of a call's n proposals the judgement of proposal i (0-based) counts as drafted: a
    kept one itself; a rejected one itself and every proposal after it (their rows were verified
    for nothing), as llama.cpp and vLLM count drafted tokens. Proposals after a token that ends
    generation are never judged, so never counted: they cost a row but had no chance to be kept.
    The acceptance rate (accepted / drafted) is thus kept tokens per proposal that mattered."""
    return 1 if kept else n - i


# ---- proposers -----------------------------------------------------------------------------------
class NgramProposer:
    """Prompt lookup decoding: find the latest earlier occurrence of the text's last n tokens (n from
    ngram_max down to ngram_min) in the prompt and the output so far, and propose what followed it.
    A continuation that runs into the text's end repeats periodically (a loop in the output is
    proposed as a loop). Deterministic: q is the point mass at each proposed token.

    How many it proposes follows the match's length when the loop adapts the length (k_max given):
    a match longer than ngram_min tokens (the text repeats a longer span: the output is copying)
    proposes k_max; a match of just ngram_min tokens at most SHORT_MATCH_DRAFT and at most k (the
    DraftLength's). Replayed on SmolLM2's answers (docs/results/speculative.md), a two-token match
    kept its first proposal 44% of the time and its third 16%, a longer one 93% and 80%.

    The index maps each n-gram to the position after its latest occurrence, updated with every
    new token: O(ngram_max) dictionary operations per token, whatever the context length."""

    name = "ngram"

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.sizes = range(ngram_max, ngram_min - 1, -1)
        self.index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.done = 0  # n-grams ending before position `done` (continuation at done or before) are indexed

    def propose(self, history: Sequence[int], k: int, rng: np.random.Generator,
                k_max: int | None = None) -> tuple[list[int], None]:
        end = len(history)
        # index the n-grams whose continuation starts at e in [done + 1, end) (the text's own last
        # n-gram has none yet); zip keeps a long prompt's indexing at C speed, later e overwrite earlier
        for n in self.sizes:
            lo = max(self.done + 1, n)
            if lo < end:
                grams = zip(*(history[lo - n + i:end - n + i] for i in range(n)))
                self.index[n].update(zip(grams, range(lo, end)))
        self.done = max(self.done, end - 1)
        for n in self.sizes:
            if end < n:
                continue
            c = self.index[n].get(tuple(history[end - n:]))
            if c is not None:
                if k_max is not None:
                    # one token past the n matched: is the match longer than the shortest lookup?
                    longer = n > self.sizes[-1] or (c - n - 1 >= 0 and history[c - n - 1] == history[end - n - 1])
                    k = k_max if longer else min(k, SHORT_MATCH_DRAFT)
                out: list[int] = []
                for i in range(k):
                    j = c + i
                    out.append(history[j] if j < end else out[j - end])
                return out, None
        return [], None


class DraftProposer:
    """A draft model (its own Engine, same vocabulary) proposes by sampling from its own distribution
    q with the generation's sampling parameters (greedy when the target is greedy), each token
    after the text so far and the tokens it proposed before. Its KV cache follows the accepted
    text: each round's Engine.eval keeps the prefix it shares with the text and runs the rest."""

    name = "draft"

    def __init__(self, draft: "Engine", params: SamplingParams) -> None:
        self.eng = draft
        self.sampler = Sampler(params)  # for q only: draws use the generation's random stream

    def propose(self, history: Sequence[int], k: int, rng: np.random.Generator,
                k_max: int | None = None) -> tuple[list[int], list[tuple[np.ndarray, np.ndarray]]]:
        d = self.eng
        # the last proposed token is not run: its positions end at len(history) + k - 2
        k = min(k, d.n_ctx - len(history) + 1)
        if k < 1:
            return [], []
        logits = d.eval(history)
        seq = list(history)
        out: list[int] = []
        qs: list[tuple[np.ndarray, np.ndarray]] = []
        for i in range(k):
            check_finite(d, logits, f"in the draft model at position {len(seq) - 1}")
            ids, q = self.sampler.probs(logits, seq)
            x = draw(ids, q, rng)
            out.append(x)
            qs.append((ids, q))
            seq.append(x)
            if i + 1 < k:
                logits = d.step(x, len(seq) - 1)
        return out, qs


class MtpProposer:
    """Self-speculation with the model's multi-token prediction heads (cflow.runtime.mtp): head j
    maps the final hidden state h of the position whose logits chose the newest token t to a
    distribution over the token 2+j ahead of h's position, i.e. over the token j+1 after t. The
    round's proposals are drawn from the heads in turn (q: each head's distribution under the
    generation's sampling parameters, the sampler seeing the proposals before it, as a draft model
    would; greedy: each head's argmax). At most mtp_heads proposals a round.

    Which h: the loop hands over (`observe`) the hidden state of the row whose logits emitted the
    newest token: the prompt's last row after prefill, a plain step's row, and in a verification
    round the row of the last token it emitted (a kept proposal's row is the position before the
    next one, so after the first rejection at row i, row i's h; when all were kept, the last row's).
    The engine keeps every logits row's h while speculating (Engine.keep_hidden)."""

    name = "mtp"

    def __init__(self, eng: "Engine", params: SamplingParams) -> None:
        self.heads = eng.mtp
        self.sampler = Sampler(params)  # for q only: draws use the generation's random stream
        self.h: np.ndarray | None = None

    def observe(self, h: np.ndarray) -> None:
        """The final hidden state of the row whose logits chose the newest token (copied)."""
        self.h = np.array(h, np.float32)

    def propose(self, history: Sequence[int], k: int, rng: np.random.Generator,
                k_max: int | None = None) -> tuple[list[int], list[tuple[np.ndarray, np.ndarray]]]:
        if self.h is None:
            return [], []
        logits = self.heads.logits(self.h)  # [N, V]
        seq = list(history)
        out: list[int] = []
        qs: list[tuple[np.ndarray, np.ndarray]] = []
        for j in range(min(k, self.heads.n)):
            ids, q = self.sampler.probs(logits[j], seq)
            x = draw(ids, q, rng)
            out.append(x)
            qs.append((ids, q))
            seq.append(x)
        self.h = None  # used: the next proposal needs the next call's h
        return out, qs


def make_proposer(spec: Speculative, params: SamplingParams,
                  eng: "Engine") -> NgramProposer | DraftProposer | MtpProposer:
    if spec.proposer == "draft":
        return DraftProposer(spec.draft, params)
    if spec.proposer == "mtp":
        return MtpProposer(eng, params)
    return NgramProposer(spec.ngram_min, spec.ngram_max)


# ---- the gate ------------------------------------------------------------------------------------
class Gate:
    """Turns speculation off while it loses. After each verification round it looks at the last
    `window` rounds; when they are all in and their acceptance rate (accepted / proposed) is below
    `min_rate`, the next `pause` steps are plain steps, and the window starts empty again. A pause
    that is followed by another failing window lasts twice as long (up to `max_pause`); a window
    that passes resets the pause to its first length.

    Why acceptance and not time: a round of k proposed tokens costs about 1 + c x k + r plain
    steps, c the row cost (engine_row_cost: measured once per engine and thread count, before any
    round, plus a draft model's own cost per proposed token: min_rate) and r what proposing costs
    once a round (`round_cost`: the heads' computation, engine_heads_cost; 0 for the lookup and
    the draft), and emits 1 + accepted tokens, so the window pays when its kept proposals exceed
    c x proposed + r x rounds; and counts, unlike clocks, keep a seeded run reproducible: the
    timings set the thresholds, on a coarse grid, and every decision after them compares counts.

    `start_paused`: begin with the longest pause (max_pause plain steps; a window that then fails
    pauses as long again, one that passes returns the gate to its usual pauses), for a proposer
    whose recorded agreement already says no round can pay (make_gate): it then only probes now
    and then, in case this text suits it better."""

    def __init__(self, min_rate: float, window: int = GATE_WINDOW, pause: int = GATE_PAUSE,
                 max_pause: int = GATE_MAX_PAUSE, round_cost: float = 0.0, start_paused: bool = False) -> None:
        self.min_rate, self.window, self.first_pause, self.max_pause = min_rate, window, pause, max_pause
        self.round_cost = round_cost
        self.recent: deque[tuple[int, int]] = deque(maxlen=window)
        self.pause = pause  # the next pause's length
        self.paused = 0  # plain steps left in the current pause
        self.pauses = 0  # pauses so far
        self.note = ""  # why it started paused (make_gate), for the timings
        if start_paused:
            self.pause = self.paused = max_pause
            self.pauses = 1

    def open(self) -> bool:
        """Whether this step may speculate; a closed gate counts the step against its pause."""
        if self.paused:
            self.paused -= 1
            return False
        return True

    def record(self, drafted: int, accepted: int) -> None:
        self.recent.append((drafted, accepted))
        if len(self.recent) < self.window:
            return
        drafted_sum = sum(d for d, _ in self.recent)
        if sum(a for _, a in self.recent) < self.min_rate * drafted_sum + self.round_cost * len(self.recent):
            self.paused = self.pause
            self.pauses += 1
            self.pause = min(2 * self.pause, self.max_pause)
            self.recent.clear()
        else:
            self.pause = self.first_pause


class DraftLength:
    """How many tokens the next round proposes (at most draft_max): after a round that kept every
    proposal, twice as many; after a rejection, one more than were kept. A proposed token that is
    rejected costs a row of the target call (the row cost, a share of a step) for nothing, so the length follows
    the runs of accepted tokens: long while the output copies its input, short when it does not."""

    def __init__(self, draft_max: int, start: int | None = None) -> None:
        self.max = draft_max
        self.k = draft_max if start is None else max(1, min(start, draft_max))

    def record(self, drafted: int, accepted: int) -> None:
        self.k = min(self.max, 2 * drafted if accepted == drafted else accepted + 1)

    def limits(self, left: int, adaptive: bool = True) -> tuple[int, int | None]:
        """This round's (k, k_max): k_max the most proposals it may hold (draft_max, and at most
        `left`), k the length the accepted runs suggest; a proposer with evidence of its own may go
        up to k_max (NgramProposer). Not adaptive: always k_max, and no k_max to go up to (None)."""
        k_max = min(self.max, left)
        return (min(self.k, k_max), k_max) if adaptive else (k_max, None)


def _fastest_pair(first: Callable[[], Any], second: Callable[[], Any], repeats: int,
                  clock: Callable[[], float]) -> tuple[float, float]:
    """The fastest of `repeats` timings of each call, the two alternating (so that both see the
    same machine)."""
    t = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, call in enumerate((first, second)):
            t0 = clock()
            call()
            t[i] = min(t[i], clock() - t0)
    return t[0], t[1]


def _on_grid(cost: float, top: float) -> float:
    return min(top, max(0.0, round(cost / ROW_COST_GRID) * ROW_COST_GRID))


def measure_row_cost(one_row: Callable[[], Any], rows_call: Callable[[], Any], rows: int,
                     repeats: int = ROW_COST_REPEATS, clock: Callable[[], float] = time.perf_counter) -> float:
    """What each row after the first of a `rows`-row call costs, as a share of a one-row call:
    (t_rows - t_1) / ((rows - 1) t_1), each time the fastest of `repeats` calls (the two kinds
    alternating), rounded to ROW_COST_GRID and kept in [0, 1]."""
    if rows < 2:
        raise ValueError(f"measuring a row cost needs a call of 2 or more rows, got {rows}")
    t1, tk = _fastest_pair(one_row, rows_call, repeats, clock)
    return _on_grid((tk - t1) / ((rows - 1) * t1) if t1 > 0 else 1.0, 1.0)


def measure_call_cost(one_row: Callable[[], Any], call: Callable[[], Any], repeats: int = ROW_COST_REPEATS,
                      clock: Callable[[], float] = time.perf_counter) -> float:
    """What `call` costs as a share of a one-row call (the fastest of `repeats` each, alternating),
    rounded to ROW_COST_GRID and kept in [0, HEADS_COST_MAX]."""
    t1, tc = _fastest_pair(one_row, call, repeats, clock)
    return _on_grid(tc / t1 if t1 > 0 else HEADS_COST_MAX, HEADS_COST_MAX)


_row_costs: "weakref.WeakKeyDictionary[Any, dict[int, float]]" = weakref.WeakKeyDictionary()
_heads_costs: "weakref.WeakKeyDictionary[Any, dict[int, float]]" = weakref.WeakKeyDictionary()


def _measured_once(costs: "weakref.WeakKeyDictionary[Any, dict[int, float]]", eng: Any, rows: int, need: int,
                   default: float, measure: Callable[[int, int], float]) -> float:
    """`measure(held, rows)`'s cost for `eng` (an Engine) at its thread count, measured on first use
    and kept in `costs` for the engine's life: its calls run on sequence 0 just past what it holds
    (up to `rows` positions, at least `need`), which are forgotten after (Engine.truncate, as a
    round forgets its rejected tokens: the next call overwrites their K/V), so the sequence's text
    is unchanged. `default` for what is not an Engine, or when the context has no room."""
    from cflow.runtime.engine import Engine

    if not isinstance(eng, Engine):
        return default
    per_threads = costs.setdefault(eng, {})
    if eng.threads in per_threads:
        return per_threads[eng.threads]
    held = len(eng.cached(0))
    rows = min(rows, eng.n_ctx - held)
    if rows < need:
        return default
    try:
        cost = measure(held, rows)
    finally:
        eng.truncate(held)
    per_threads[eng.threads] = cost
    return cost


def engine_row_cost(eng: Any) -> float:
    """The row cost of `eng` (an Engine) at its thread count (measure_row_cost of a one-row step
    and a ROW_COST_ROWS-row step_rows), measured once (_measured_once); ROW_COST for what is not an
    Engine, or when the context has no room for 2 rows."""
    tok = 0  # any valid id: the logits are thrown away

    def measure(held: int, rows: int) -> float:
        return measure_row_cost(lambda: eng.step(tok, held),
                                lambda: eng.step_rows([0] * rows, [tok] * rows, range(held, held + rows)), rows)

    return _measured_once(_row_costs, eng, ROW_COST_ROWS, 2, ROW_COST, measure)


def engine_heads_cost(eng: Any, heads: Any) -> float:
    """What one proposal of the multi-token heads costs (`heads.logits` of one hidden state: their
    residual MLPs and N rows of the lm_head), in one-row steps of `eng` at its thread count
    (measure_call_cost), measured once (_measured_once); 0 for what is not an Engine, or when the
    context has no room."""
    def measure(held: int, rows: int) -> float:
        h = np.full(eng.config.d_model, 1.0, np.float32)  # any normed state: the cost does not depend on it
        return measure_call_cost(lambda: eng.step(0, held), lambda: heads.logits(h))

    return _measured_once(_heads_costs, eng, 1, 1, 0.0, measure)


def rounds_lose(chain: Sequence[float], rate: float, round_cost: float, k_max: int) -> bool:
    """Whether no round length can pay by the heads' recorded chained agreement (MtpHeads.chain:
    chain[j], the share of positions where heads 0..j are all right): a round of k proposals keeps
    sum(chain[:k]) of them on average and costs rate x k + round_cost steps more than a plain step,
    for every k from 1 to k_max (and the heads' count)."""
    n = min(k_max, len(chain))
    return n >= 1 and all(sum(chain[:k]) <= rate * k + round_cost for k in range(1, n + 1))


def make_gate(spec: Speculative, eng: Any, heads: Any = None) -> Gate:
    """The Gate of one generation (or one served sequence) speculating with `spec` on target `eng`;
    `heads`: the target's MtpHeads when the proposer is "mtp". Its threshold is min_rate; with the
    heads, their own cost per round (engine_heads_cost) is added to what a window must keep, and
    when their recorded chained agreement says no round length can pay (rounds_lose) the gate
    starts paused. A min_acceptance setting is taken as it is: no added cost, no starting pause."""
    rate = min_rate(spec, eng)
    if heads is None or spec.min_acceptance is not None:
        return Gate(rate)
    round_cost = engine_heads_cost(eng, heads)
    chain = getattr(heads, "chain", None)
    lose = chain is not None and rounds_lose(chain, rate, round_cost, spec.draft_max)
    gate = Gate(rate, round_cost=round_cost, start_paused=lose)
    if lose:
        gate.note = (f"it started paused: the heads' recorded agreement ({' / '.join(f'{x:.2f}' for x in chain)}) "
                     f"cannot cover a round here (a verification row costs {rate:.2f} of a step, the heads' "
                     f"proposal {round_cost:.2f})")
    return gate


def min_rate(spec: Speculative, eng: "Engine", row_cost: float | None = None) -> float:
    """The gate's threshold: spec.min_acceptance, or by default what one proposed token costs in
    plain steps: `row_cost` (None: engine_row_cost(eng), measured once), plus for a draft model
    its weight bytes per token over the target's (a decode step on a CPU streams the weights: its
    time follows their bytes)."""
    if spec.min_acceptance is not None:
        return float(spec.min_acceptance)
    cost = engine_row_cost(eng) if row_cost is None else float(row_cost)
    if spec.proposer == "draft":
        return min(1.0, cost + spec.draft.weight_bytes_per_token() / eng.weight_bytes_per_token())
    return cost


# ---- the loop ------------------------------------------------------------------------------------
def run(gen: Generation, spec: Speculative) -> Iterator[tuple[int, str]]:
    """cflow.runtime.generate.run's loop with speculation: yields (token id, newly visible text)
    per emitted token, id -1 for the final flush, exactly as the plain loop does."""
    eng, sampler, tm = gen.eng, gen.sampler, gen.timings
    rng = sampler.rng
    check_rewindable(eng)
    proposer = make_proposer(spec, sampler.params, eng)
    # the engine's first use measures its row cost (engine_row_cost), and the heads' (engine_heads_cost)
    gate = make_gate(spec, eng, proposer.heads if isinstance(proposer, MtpProposer) else None)
    length = DraftLength(spec.draft_max, DRAFT_START)
    tm.spec, tm.gate_note = proposer.name, gate.note
    # a proposer that reads the target's hidden states (MtpProposer) gets, after each call, the
    # one of the row whose logits chose the newest token
    observe = getattr(proposer, "observe", None)
    kept_hidden = eng.keep_hidden
    if observe is not None:
        eng.keep_hidden = True
    t_gen = None
    try:
        logits = gen.prefill()
        if observe is not None:
            observe(eng.hidden()[-1])
        t_gen = time.perf_counter()
        done = gen.limit == 0
        if not done:
            tok = gen.sample(logits)
            piece, done = gen.emit(tok)
            if piece is not None:
                yield tok, piece
        while not done:
            # tok, the newest emitted token, is not in the cache yet: it runs at `pos` this round
            pos = len(gen.history) - 1
            # at most as many proposals as there are tokens left to emit after this round's first
            k, k_max = length.limits(gen.limit - gen.emitted - 1, spec.adaptive)
            drafts: list[int] = []
            qs = None
            if k >= max(1, spec.draft_min):
                if gate.open():
                    t0 = time.perf_counter()
                    drafts, qs = proposer.propose(gen.history, k, rng, k_max)
                    tm.draft_s += time.perf_counter() - t0
                    if len(drafts) < spec.draft_min:
                        drafts = []
                else:
                    tm.paused_steps += 1
            if not drafts:  # a plain step
                logits = eng.step(tok, pos)
                check_finite(eng, logits, f"at position {pos}")
                if observe is not None and not gate.paused:  # a paused next step proposes nothing
                    observe(eng.hidden()[0])
                tok = gen.sample(logits)
                piece, done = gen.emit(tok)
                if piece is not None:
                    yield tok, piece
                continue
            n = len(drafts)
            rows = eng.step_rows([0] * (n + 1), [tok] + drafts, range(pos, pos + n + 1))
            tm.rounds += 1
            proposed = accepted = 0  # proposals counted (proposals_counted), and kept
            for i in range(n + 1):
                ts = time.perf_counter()
                draft = drafts[i] if i < n else None  # None: every proposal kept, the bonus token
                kept, tok = judge(sampler, rows[i], gen.history, draft, qs[i] if qs and draft is not None else None,
                                  eng, pos + i)
                if draft is not None:
                    counted = proposals_counted(n, i, kept)
                    proposed += counted
                    accepted += kept
                    tm.drafted += counted
                    tm.accepted += kept
                tm.sample_s += time.perf_counter() - ts
                if observe is not None and (i == n or not kept):  # tok came from row i: its h proposes next
                    observe(eng.hidden()[i])
                piece, done = gen.emit(tok)
                if piece is not None:
                    yield tok, piece
                if done or not kept:
                    break
            gate.record(proposed, accepted)
            length.record(proposed, accepted)
            if not done:  # roll back: keep the text up to the newest token, which runs next round
                eng.truncate(len(gen.history) - 1)
        tail = gen.finish()
        if tail:
            yield -1, tail
    finally:
        if t_gen is not None:  # the prompt's time is prompt_s, not generation
            tm.gen_s = time.perf_counter() - t_gen
        if observe is not None:
            eng.keep_hidden = kept_hidden
