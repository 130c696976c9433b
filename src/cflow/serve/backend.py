"""The model side of batched generation: `BatchBackend`, n independent KV-cache slots over one set
of weights, and its two implementations: `EngineBatch` (one `cflow.runtime.Engine` with n_seq = n
sequences; a decode step of B slots is ONE pass over the weights, the C core's cf_step_batch) and
`EngineSlots` (one Engine per slot, stepped one after the other: B passes; the reference).
`load_backend` picks EngineBatch unless told otherwise.

The scheduler (cflow.serve.batch) calls the model from one thread: one `step_rows` per iteration
when the backend has it (both here do), otherwise `prefill` per prompt chunk and one `step_batch`:

    prefill(slot, tokens, pos0) -> logits [V]
        Evaluate `tokens` at positions pos0 .. pos0+len-1 of `slot`'s sequence; return the logits
        after the last one. Positions 0 .. pos0-1 of that slot hold K/V written by earlier calls
        (prefill or step_batch) for this slot; everything at pos0 and after is overwritten, so
        pos0 = 0 starts a new sequence and 0 < pos0 reuses a cached prefix.
    step_batch(slot_ids, tokens, positions) -> logits [B, V]
        One decode step for B different slots at once: row i is the logits after `tokens[i]` ran
        at `positions[i]` of slot `slot_ids[i]` (same cache rule as prefill). The slots in one call
        are distinct; B is 1 .. n_slots.
    step_rows(slot_ids, tokens, positions, want) -> logits [W, V]   (optional)
        Rows of any slots in one call: row i runs `tokens[i]` at `positions[i]` of slot
        `slot_ids[i]`; a slot's rows come in order at consecutive positions (a prompt chunk beside
        other slots' decode rows). Returns the logits of the W rows with want[i] true, in row
        order. `max_rows` (optional attribute): rows one pass over the weights takes.
    copy_slot(src, dst, n)   (optional)
        Give slot `dst` the K/V of slot `src`'s positions 0..n-1 (which src holds), so dst goes on
        from position n: a prompt prefix another slot holds is copied, not evaluated again.
    truncate(slot, n)   (optional)
        Forget positions n.. of `slot` (speculative decoding's rollback of rejected proposals,
        cflow.serve.speculate): its bookkeeping then says it holds its first n tokens. No native
        work: a call at position p reads positions 0..p only and overwrites the K/V it runs, so
        the next call from position n writes over the stale rows.
    keep_hidden, hidden() -> [W, d], mtp   (optional)
        The final hidden states of the last call's W logits rows while keep_hidden is on, and the
        model's multi-token prediction heads: what speculation with the heads reads.

All may return arrays the next call reuses (callers copy what they keep). All raise
`cflow.runtime.EngineError` for a bad position or token (the slot then keeps positions < the
failed call's first position) and must be bit-exact per row: a row's logits do not depend on
which other slots share the call, so batched and single-sequence greedy decoding agree token for
token. The true batched C step (one pass over the weights for all B rows) implements this same
interface (`EngineBatch`); `EngineSlots` below loops over one Engine per slot and is the
reference for it.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from cflow.runtime.generate import common_prefix
from cflow.runtime.options import EngineOptions


@runtime_checkable
class BatchBackend(Protocol):
    """n_slots KV-cache slots of n_ctx positions each, over one model (see the module docstring)."""

    n_slots: int
    n_ctx: int              # positions per slot
    vocab_size: int
    path: Any               # the model file (named in error messages)
    tokenizer: Any          # cflow.tokenizer.Tokenizer: stop_ids, stream(), token_to_piece()

    def encode(self, prompt: str | Sequence[int], add_bos: bool | None = None) -> list[int]:
        """Token ids of a text prompt, or a list of ids checked against the vocabulary (thread-safe)."""
        ...

    def chat_tokens(self, messages: list[dict[str, Any]], **template_kw: Any) -> list[int]:
        """A conversation rendered with the model's chat template, generation prompt added (thread-safe);
        `template_kw` reach the template as variables (e.g. tools=)."""
        ...

    def prefill(self, slot: int, tokens: Sequence[int], pos0: int) -> np.ndarray:
        ...

    def step_batch(self, slot_ids: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        ...

    def close(self) -> None:
        ...


def _describe(backend: Any, engine: Any) -> None:
    """The facts a backend states about its model, taken from one of its engines."""
    backend.vocab_size = engine.config.vocab_size
    backend.config = engine.config
    backend.path = engine.path
    backend.threads = engine.threads
    backend.tokenizer = engine.tokenizer
    backend.load_s = engine.load_s


class EngineSlots:
    """BatchBackend with one Engine per slot: each has its own KV cache and thread pool, and all
    share the weights (one mapping of the file). `step_batch` runs the slots' steps one after the
    other, so it reads the weights B times; the batched C step will read them once."""

    def __init__(self, engines: Sequence[Any]) -> None:
        if not engines:
            raise ValueError("EngineSlots needs at least one engine")
        self.engines = list(engines)
        first = self.engines[0]
        self.n_slots = len(self.engines)
        self.n_ctx = min(e.n_ctx for e in self.engines)
        _describe(self, first)
        self._out = np.zeros((self.n_slots, self.vocab_size), np.float32)
        self._rows = np.zeros((self.n_slots, self.vocab_size), np.float32)  # step_rows' (grows)

    @property
    def engine(self) -> Any:
        """The first slot's Engine, whose file, config and weights every slot shares: what asks the
        backend for "its engine" (speculation's target and draft checks, the measured row cost)
        reads, as EngineBatch.engine."""
        return self.engines[0]

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, n_slots: int = 1, options: EngineOptions | None = None, *,
             progress: Callable[[int, int, str], None] | None = None, log: Callable[[str], None] | None = None,
             **overrides: Any) -> "EngineSlots":
        """Load the model once (Engine.load: GGUF conversion, verification, `options` and keyword
        overrides as there) and give it `n_slots` slots of n_ctx positions each (default: Engine's
        default context). The extra slots are Engines over the first one's open file, so they share
        its mapping of the weights (with mmap=False only the first slot copies them)."""
        from cflow.runtime import Engine

        if int(n_slots) < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        opts = EngineOptions.build(options, **overrides)
        first = Engine.load(path, opts, progress=progress, log=log)
        # The extra slots run the first one's options on its open file, except how that file is
        # read: they use its mapping (or copy) as it is, and the cold-start read-ahead is the first
        # engine's; n_seq is 1 (a slot is one sequence) and n_ctx the first one's resolved context.
        extra = opts.replace(n_ctx=first.n_ctx, n_seq=1, mmap=True, readahead="auto")
        engines = [first]
        try:
            for _ in range(int(n_slots) - 1):
                # the same open file: one mapping of the weights serves every slot
                engines.append(Engine(first.file, extra))
        except BaseException:
            for e in engines:
                e.close()
            raise
        return cls(engines)

    # ---- tokens (thread-safe: the tokenizer only) --------------------------------------------
    def encode(self, prompt: str | Sequence[int], add_bos: bool | None = None) -> list[int]:
        return self.engines[0].encode(prompt, add_bos)

    def chat_tokens(self, messages: list[dict[str, Any]], **template_kw: Any) -> list[int]:
        return self.engines[0].chat_tokens(messages, **template_kw)

    # ---- the two model calls (one thread) ----------------------------------------------------
    def prefill(self, slot: int, tokens: Sequence[int], pos0: int) -> np.ndarray:
        return self.engines[slot].prefill(tokens, pos0)

    def step_batch(self, slot_ids: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        b = len(slot_ids)
        if not (b == len(tokens) == len(positions)) or not 1 <= b <= self.n_slots:
            raise ValueError(f"step_batch takes 1..{self.n_slots} (slot, token, position) triples, got "
                             f"{len(slot_ids)}, {len(tokens)}, {len(positions)}")
        if len(set(slot_ids)) != b:
            raise ValueError(f"step_batch: a slot appears twice in {list(slot_ids)}")
        out = self._out[:b]
        for i in range(b):
            out[i] = self.engines[slot_ids[i]].step(tokens[i], positions[i])
        return out

    def step_rows(self, slot_ids: Sequence[int], tokens: Sequence[int], positions: Sequence[int],
                  want: Sequence[bool]) -> np.ndarray:
        """Each slot's rows through its own engine: a prefill per stretch of rows that ends at a
        wanted row (or at the slot's last row)."""
        b = len(slot_ids)
        if not (b == len(tokens) == len(positions) == len(want)) or b < 1:
            raise ValueError(f"step_rows takes 1 or more (slot, token, position, want) rows, got {len(slot_ids)}, "
                             f"{len(tokens)}, {len(positions)}, {len(want)}")
        rows: dict[int, list[int]] = {}
        for i, s in enumerate(slot_ids):
            rows.setdefault(int(s), []).append(i)
        got: dict[int, np.ndarray] = {}
        for s, idx in rows.items():
            if any(positions[j] != positions[idx[0]] + k for k, j in enumerate(idx)):
                raise ValueError(f"step_rows: the rows of slot {s} are not at consecutive positions in order")
            start = 0
            for k, j in enumerate(idx):
                if want[j] or k == len(idx) - 1:
                    part = idx[start:k + 1]
                    out = self.engines[s].prefill([tokens[i] for i in part], positions[part[0]])
                    if want[j]:
                        got[j] = out.copy()
                    start = k + 1
        order = [i for i in range(b) if want[i]]
        if self._rows.shape[0] < len(order):
            self._rows = np.zeros((len(order), self.vocab_size), np.float32)
        out = self._rows[:len(order)]
        for r, i in enumerate(order):
            out[r] = got[i]
        return out

    def truncate(self, slot: int, n: int) -> None:
        self.engines[slot].truncate(n)

    def copy_slot(self, src: int, dst: int, n: int) -> None:
        """The reference: dst's engine evaluates the tokens src holds (from what it shares with them)."""
        toks = self.engines[src].cached(0)[:n]
        if len(toks) != n:
            raise ValueError(f"copy_slot: slot {src} holds {len(toks)} positions, not {n}")
        have = self.engines[dst].cached(0)
        keep = common_prefix(have, toks)
        if keep < n:
            self.engines[dst].prefill(toks[keep:], keep)

    def close(self) -> None:
        for e in self.engines:
            e.close()

    def __repr__(self) -> str:
        return f"EngineSlots({self.path!r}, {self.n_slots} slots x {self.n_ctx} tokens, threads={self.threads})"


class EngineBatch:
    """BatchBackend over ONE Engine with n_seq = n_slots KV caches: `step_batch` advances every slot
    of the call in one pass over the weights (the batched mat-mat kernels read each weight tile once
    for all B rows; attention runs per row over that slot's own cache). Rows are bit-identical to
    the slot running alone (engine.h: every op is row-local and matmat equals matvec per row), so
    greedy output does not depend on which slots share a step. One thread pool serves all slots."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.n_slots = int(engine.n_seq)
        self.n_ctx = engine.n_ctx
        self.max_rows = int(engine._native.max_batch)  # rows of one pass over the weights
        _describe(self, engine)

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, n_slots: int = 1, options: EngineOptions | None = None, *,
             progress: Callable[[int, int, str], None] | None = None, log: Callable[[str], None] | None = None,
             **overrides: Any) -> "EngineBatch":
        """Load the model (Engine.load: GGUF conversion, verification, `options` and keyword
        overrides as there) with `n_slots` sequences of n_ctx positions each (default: Engine's
        default context)."""
        from cflow.runtime import Engine

        if int(n_slots) < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        opts = EngineOptions.build(options, **overrides).replace(n_seq=int(n_slots))
        return cls(Engine.load(path, opts, progress=progress, log=log))

    # ---- tokens (thread-safe: the tokenizer only) --------------------------------------------
    def encode(self, prompt: str | Sequence[int], add_bos: bool | None = None) -> list[int]:
        return self.engine.encode(prompt, add_bos)

    def chat_tokens(self, messages: list[dict[str, Any]], **template_kw: Any) -> list[int]:
        return self.engine.chat_tokens(messages, **template_kw)

    # ---- the two model calls (one thread) ----------------------------------------------------
    def prefill(self, slot: int, tokens: Sequence[int], pos0: int) -> np.ndarray:
        return self.engine.prefill(tokens, pos0, seq=slot)

    def step_batch(self, slot_ids: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        return self.engine.step_batch(slot_ids, tokens, positions)

    def step_rows(self, slot_ids: Sequence[int], tokens: Sequence[int], positions: Sequence[int],
                  want: Sequence[bool]) -> np.ndarray:
        return self.engine.step_rows(slot_ids, tokens, positions, want)

    def copy_slot(self, src: int, dst: int, n: int) -> None:
        self.engine.copy_seq(src, dst, n)

    def truncate(self, slot: int, n: int) -> None:
        self.engine.truncate(n, seq=slot)

    # ---- multi-token prediction heads (cflow.serve.speculate) -----------------------------------
    @property
    def keep_hidden(self) -> bool:
        """Whether each call keeps the final hidden states of its logits rows (hidden())."""
        return self.engine.keep_hidden

    @keep_hidden.setter
    def keep_hidden(self, on: bool) -> None:
        self.engine.keep_hidden = on

    def hidden(self) -> np.ndarray:
        """The last call's logits rows' final hidden states [W, d] (Engine.hidden; reused: copy)."""
        return self.engine.hidden()

    @property
    def mtp(self) -> Any:
        """The model's multi-token prediction heads (NoMtpHeadsError when it has none)."""
        return self.engine.mtp

    def close(self) -> None:
        self.engine.close()

    def __repr__(self) -> str:
        return f"EngineBatch({self.path!r}, {self.n_slots} slots x {self.n_ctx} tokens, threads={self.threads})"


def load_backend(path: str | os.PathLike | None = None, n_slots: int = 1, options: EngineOptions | None = None, *,
                 batched: bool = True, progress: Callable[[int, int, str], None] | None = None,
                 log: Callable[[str], None] | None = None, **overrides: Any) -> EngineBatch | EngineSlots:
    """The default backend for `n_slots` slots: EngineBatch (one pass over the weights per decode
    step), or EngineSlots (one Engine per slot, the reference) with batched=False. `options`
    (EngineOptions) and keyword overrides of its fields as Engine.load; n_seq is the backend's."""
    kind = EngineBatch if batched else EngineSlots
    return kind.load(path, n_slots=n_slots, options=options, progress=progress, log=log, **overrides)
