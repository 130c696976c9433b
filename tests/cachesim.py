"""A test helper: the expert cache's eviction policy in Python, on routing traces: what the C core's
cache (native/experts.c) decides, replayed, and the alternatives it was chosen against.

`routing_trace` records the experts an engine chooses per token and layer; `simulate` replays such a
trace through a cache of n slots under a policy ("lrfu": recency-weighted frequency on each layer's
own clock, the C core's; LRU; a global LFU with aging; Belady's optimum for reference), with the
C core's pins, its keep ranks and its minimum slots. tests/test_experts_disk.py checks the engine's
hits and misses against it. It lives beside the tests, not in the package, because nothing the
package runs (the engine, `cflow bench`, its claims) replays a trace; to try a policy without the
disk, import it from here (`sys.path` holding tests/).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from cflow.runtime.abi import native_module

AGE_PER_KEY = 4  # the "lfu" alternative: counts halve every AGE_PER_KEY x n_keys accesses
# ---- policies on a routing trace ------------------------------------------------------------------
POLICIES = ("lrfu", "lru", "lfu", "opt")


def routing_trace(engine: Any, tokens: Sequence[int], pos0: int = 0) -> list[list[list[int]]]:
    """Decode `tokens` one at a time from position pos0 and record, per step and layer, the experts
    the router chose (ascending): trace[step][layer] = [e, ...]."""
    cfg = engine.config
    trace = []
    prev = np.array(engine.expert_hits())
    for i, t in enumerate(tokens):
        engine.step(int(t), pos0 + i)
        now = np.array(engine.expert_hits())
        d = now - prev
        prev = now
        trace.append([[int(x) for x in np.nonzero(d[l])[0]] for l in range(cfg.n_layers)])
    return trace


@dataclass
class SimResult:
    hits: int = 0
    misses: int = 0
    layer_misses: list[int] = field(default_factory=list)  # [layer] misses there

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


def simulate(trace: Sequence[Sequence[Sequence[int]]], n_slots: int, policy: str = "lrfu", *, n_experts: int,
             n_unique: int | None = None, inflight: int = 1, keep: Sequence[int] | None = None) -> SimResult:
    """Replay a decode routing trace (routing_trace) through a cache of n_slots experts, the way the
    engine acquires and pins them: each layer's experts are acquired together (ascending) and stay
    pinned until `inflight` - 1 later layers have been acquired (1: released right away); nothing is
    pinned across steps. Policies (the victim is the lowest key, ties by least recent use):
      "lrfu"  the C core's, exactly (the engine's counters must match it): when a layer routes, its
              experts' scores halve and the chosen ones gain _native.EXPERT_VISIT_SCORE; evict the
              lowest score
      "lru"   least recently used
      "lfu"   use counts, halved every AGE_PER_KEY x n_keys accesses (a global clock)
      "opt"   Belady's: evict the one used furthest in the future (an upper bound)
    keep: the cache's keep ranks per weight set (cf_xstore_keep; the engine's keep_ranks gives set l
    max(0, d - l) with speculation trusted d layers ahead): victims come from the lowest rank first,
    then by the policy."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}")
    n_layers = len(trace[0]) if trace else 0
    n_unique = n_unique or n_layers
    n_keys = n_unique * n_experts
    seq = [(l % n_unique) * n_experts + x for step in trace for l, xs in enumerate(step) for x in xs]
    next_use = [0] * len(seq)  # for opt: index of the key's next access
    last_seen: dict[int, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        next_use[i] = last_seen.get(seq[i], len(seq))
        last_seen[seq[i]] = i
    slot_key = [-1] * n_slots
    slot_of: dict[int, int] = {}
    pins = [0] * n_slots
    last_use = [0] * n_slots
    nxt = [0] * n_slots
    freq = [0] * n_keys  # lfu: counts; lrfu: scores
    # lrfu: a routing's weight in a score is the C core's own (experts.h CF_XVISIT_SCORE): the replay must match it
    visit_score = native_module().EXPERT_VISIT_SCORE if policy == "lrfu" else 0
    tick = accesses = 0
    age = AGE_PER_KEY * n_keys
    rank = [0] * n_keys if keep is None else [int(keep[k // n_experts]) for k in range(n_keys)]
    r = SimResult(layer_misses=[0] * n_layers)
    i = 0
    for step in trace:
        held: deque[list[int]] = deque()
        for l, xs in enumerate(step):
            if policy == "lrfu":  # the layer's clock ticks (cf_xstore_visit)
                base = (l % n_unique) * n_experts
                for x in range(n_experts):
                    freq[base + x] >>= 1
                for x in xs:
                    freq[base + x] += visit_score
            group = []
            for x in xs:
                key = (l % n_unique) * n_experts + x
                s = slot_of.get(key)
                if s is None:
                    r.misses += 1
                    r.layer_misses[l] += 1
                    s = _victim(policy, slot_key, pins, freq, last_use, nxt, rank)
                    if s < 0:
                        raise ValueError(f"{n_slots} slots cannot hold the experts pinned at once")
                    if slot_key[s] >= 0:
                        del slot_of[slot_key[s]]
                    slot_key[s] = key
                    slot_of[key] = s
                else:
                    r.hits += 1
                if policy == "lfu":
                    freq[key] += 1
                    accesses += 1
                    if accesses >= age:
                        freq = [f >> 1 for f in freq]
                        accesses = 0
                tick += 1
                last_use[s] = tick
                nxt[s] = next_use[i]
                i += 1
                pins[s] += 1
                group.append(s)
            held.append(group)
            if len(held) >= inflight:
                for s in held.popleft():
                    pins[s] -= 1
        for g in held:
            for s in g:
                pins[s] -= 1
    return r


def _victim(policy: str, slot_key: list[int], pins: list[int], freq: list[int], last_use: list[int],
            nxt: list[int], rank: list[int]) -> int:
    best = -1
    for s, key in enumerate(slot_key):
        if pins[s]:
            continue
        if key < 0:
            return s
        if best < 0:
            best = s
        elif rank[key] != rank[slot_key[best]]:
            if rank[key] < rank[slot_key[best]]:
                best = s
        elif policy in ("lfu", "lrfu"):
            if (freq[key], last_use[s]) < (freq[slot_key[best]], last_use[best]):
                best = s
        elif policy == "lru":
            if last_use[s] < last_use[best]:
                best = s
        elif nxt[s] > nxt[best]:
            best = s
    return best


