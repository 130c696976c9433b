"""`cflow bench --spec`: speculative decoding against plain greedy decoding, side by side.

Speculation pays only when the proposer guesses what the model would say, so unlike the tg test
(random context, any token fed back) this test decodes from a real prompt: `--spec-prompt` (text,
or @FILE, taken as raw text), by default an input-grounded task built from the package's shipped
story corpus: a story, then the request to repeat it, rendered with the model's chat template when
the file has one (raw text otherwise), so that most of the answer is in the prompt, the case
n-gram lookup is for. Per repetition, plain greedy decoding and speculative greedy decoding each generate
exactly -n tokens from that prompt (end of text ignored), one after the other in alternating
order, on the same engine; the row reports both speeds, their ratio (the median of the
per-repetition ratios), the proposer's acceptance (share of proposed tokens accepted, accepted
tokens per verification call) and whether the two outputs were token-for-token identical (greedy
speculation must not change the text).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any, Callable

GROUNDED_ASK = "\n\nRepeat the story above word for word."


def default_prompt(eng: Any) -> str | list[int]:
    """The first story of the shipped corpus, then the request to repeat it: as a user turn of the
    model's chat template when the file carries one, else as raw text."""
    path = resources.files("cflow") / "data" / "stories-smollm2.jsonl"
    with path.open("r", encoding="utf-8") as f:
        story = json.loads(f.readline())["text"]
    if eng.tokenizer.chat_template:
        return eng.chat_tokens([{"role": "user", "content": story + GROUNDED_ASK}])
    return story + GROUNDED_ASK + "\n\n"


@dataclass
class SpecRow:
    """One thread count's speculative test: plain and speculative greedy tok/s per repetition."""

    threads: int
    proposer: str
    n_tokens: int
    prompt_tokens: int
    plain_ts: list[float] = field(default_factory=list)
    spec_ts: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    identical: bool = True  # every repetition's speculative tokens equal the plain ones
    gate_note: str = ""  # why the gate started paused (Timings.gate_note), "" when it started open

    @property
    def speedup(self) -> float:
        """Median over repetitions of speculative tok/s over plain tok/s (each pair ran back to back)."""
        return statistics.median(s / p for s, p in zip(self.spec_ts, self.plain_ts))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(speedup=self.speedup, acceptance_rate=self.acceptance_rate, mean_accepted=self.mean_accepted,
                 plain_avg_ts=statistics.fmean(self.plain_ts), spec_avg_ts=statistics.fmean(self.spec_ts))
        return d

    def markdown_row(self) -> str:
        return (f"| {self.threads} | {self.proposer} | {self.prompt_tokens} | {self.n_tokens} | "
                f"{statistics.fmean(self.plain_ts):.2f} | {statistics.fmean(self.spec_ts):.2f} | "
                f"{self.speedup:.2f}× | {100 * self.acceptance_rate:.0f}% of {self.drafted} | "
                f"{self.mean_accepted:.2f} | {'yes' if self.identical else '**no**'} |")


MARKDOWN_HEAD = ("| threads | proposer | prompt tokens | generated | plain t/s | speculative t/s | speculative / plain "
                 "(median) | accepted | accepted per call | same tokens |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")


def run_spec_test(eng: Any, spec: Any, prompt: str | list[int], n: int, reps: int, warmup: bool = True,
                  progress: Callable[[str], None] | None = None) -> SpecRow:
    """Plain and speculative greedy decoding of exactly n tokens from `prompt` on `eng`, alternating
    (the order flips every repetition), after one untimed pair when `warmup`."""
    row = SpecRow(eng.threads, spec.proposer, n, len(eng.encode(prompt)))
    for rep in range(reps + (1 if warmup else 0)):
        order = ("plain", "spec") if rep % 2 == 0 else ("spec", "plain")
        got = {}
        for kind in order:
            eng.reset()
            c = eng.complete(prompt, n, temperature=0.0, ignore_eos=True,
                             speculative=spec if kind == "spec" else None)
            got[kind] = c
        if warmup and rep == 0:
            continue
        plain, fast = got["plain"], got["spec"]
        row.plain_ts.append(plain.timings.gen_tps)
        row.spec_ts.append(fast.timings.gen_tps)
        t = fast.timings
        row.drafted, row.accepted, row.rounds = row.drafted + t.drafted, row.accepted + t.accepted, row.rounds + t.rounds
        row.identical = row.identical and plain.tokens == fast.tokens
        row.gate_note = t.gate_note
        if progress:
            progress(f"spec {spec.proposer} t={eng.threads} rep {rep}: plain {plain.timings.gen_tps:.1f}, "
                     f"speculative {t.gen_tps:.1f} tok/s, {t.accepted}/{t.drafted} accepted")
    return row
