"""How well a story model writes, measured three ways through the engine (docs/default_model.md).

- bits per byte of held-out stories: the model's teacher-forced negative log-likelihood of every
  token of a story (the first one given only a start of document), in bits, over the story's UTF-8
  bytes. It does not depend on the tokenizer, so models with different vocabularies, and the
  teacher itself, compare on the same text. Each story is first cut to its first `max_bytes` bytes
  (at a space), so that every model scores the same bytes whatever its context length; a story
  that still does not fit a model's context is an error, never a silent cut.
- perplexity over the same stories, per token of the model's own tokenizer.
- a teacher-judged score: the teacher's perplexity of stories the model samples (temperature 0.8
  and `cflow generate`'s other sampling defaults, fixed seeds, a start of document as the prompt), beside the teacher's perplexity of the held-out
  stories cut to the same number of the model's tokens. Their ratio says how far the samples are
  from text the teacher finds as likely as the corpus (1.0: as likely).

"A start of document" is the token each model saw between documents in training: `<|endoftext|>`
where the vocabulary has it as a special token (GPT-2-style vocabularies, SmolLM2's among them),
else the end-of-text token (cflow's trained tokenizers put `<|eos|>` after every story, so what
follows it is a new story), else BOS. Logits come from `Engine.step_rows`, up to the engine's
batch of rows of one sequence per call, so a story costs a few passes over the weights.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import numpy as np

from cflow.sampling import Sampler, SamplingParams

LN2 = math.log(2.0)


@dataclass
class TextScore:
    nats: float       # summed negative log-likelihood of the scored tokens
    tokens: int       # tokens scored
    bytes: int        # UTF-8 bytes of the text

    @property
    def bits_per_byte(self) -> float:
        return self.nats / LN2 / self.bytes if self.bytes else math.nan

    @property
    def ppl(self) -> float:
        return math.exp(self.nats / self.tokens) if self.tokens else math.nan

    def __add__(self, other: "TextScore") -> "TextScore":
        return TextScore(self.nats + other.nats, self.tokens + other.tokens, self.bytes + other.bytes)


def start_token(engine: Any) -> int:
    """The token that starts a document for this model (module docstring)."""
    tok = engine.tokenizer
    ids = tok.encode("<|endoftext|>", add_bos=False)
    if len(ids) == 1 and ids[0] in tok.stop_ids:
        return int(ids[0])
    for tid in (tok.eos_id, tok.bos_id):
        if tid is not None:
            return int(tid)
    raise ValueError(f"{engine.path}: the tokenizer has neither an end-of-text nor a BOS token")


def _log_softmax_rows(logits: np.ndarray) -> np.ndarray:
    from cflow.runtime.score import log_partition

    return logits.astype(np.float64) - log_partition(logits)


def token_nll(engine: Any, ids: Sequence[int]) -> float:
    """Summed -log p(ids[i] | start, ids[:i]) over every i, teacher-forced through the engine."""
    seq = [start_token(engine), *map(int, ids)]
    if len(seq) > engine.n_ctx:
        raise ValueError(f"{len(seq)} tokens do not fit the engine's context of {engine.n_ctx}")
    rows = int(engine._native.max_batch)
    engine.reset(0)
    nll = 0.0
    for p0 in range(0, len(seq) - 1, rows):
        chunk = seq[p0:min(p0 + rows, len(seq) - 1)]
        logp = _log_softmax_rows(engine.step_rows([0] * len(chunk), chunk, range(p0, p0 + len(chunk))))
        targets = seq[p0 + 1:p0 + 1 + len(chunk)]
        nll -= float(logp[np.arange(len(chunk)), targets].sum())
    return nll


def cut_text(text: str, max_bytes: int) -> str:
    """`text` cut to at most max_bytes UTF-8 bytes, at the last space before the limit (whole
    words; the text itself when it is short enough)."""
    raw = text.encode("utf-8")
    if len(raw) <= max_bytes:
        return text
    head = raw[:max_bytes].decode("utf-8", errors="ignore")
    return head[:head.rfind(" ")] if " " in head else head


def score_text(engine: Any, text: str) -> TextScore:
    """The model's teacher-forced score of `text` as one document, all of it."""
    ids = engine.encode(text, add_bos=False)
    if len(ids) > engine.n_ctx - 1:
        raise ValueError(f"a text of {len(ids)} tokens does not fit the context of {engine.path} "
                         f"({engine.n_ctx} positions, one for the start of document): cut the stories "
                         f"shorter (--max-bytes)")
    return TextScore(token_nll(engine, ids), len(ids), len(text.encode("utf-8")))


def score_texts(engine: Any, texts: Sequence[str], progress: Callable[[int], None] | None = None) -> TextScore:
    total = TextScore(0.0, 0, 0)
    for i, t in enumerate(texts):
        total = total + score_text(engine, t)
        if progress:
            progress(i + 1)
    return total


def sample_story(engine: Any, seed: int, max_tokens: int, temperature: float = 0.8) -> str:
    """One story the model writes from a start of document, as `cflow generate` samples it (its
    defaults: top-k 40, top-p 0.95, min-p 0.05) at `temperature`, `seed` fixed; it ends at the
    end-of-text token or after max_tokens."""
    sampler = Sampler(SamplingParams(temperature=temperature, seed=seed))
    stops = set(engine.tokenizer.stop_ids)
    engine.reset(0)
    tok, out = start_token(engine), []
    for pos in range(min(max_tokens, engine.n_ctx - 1)):
        nxt = sampler.sample(engine.step(tok, pos))
        if nxt in stops:
            break
        out.append(nxt)
        tok = nxt
    return engine.tokenizer.decode(out, skip_special=True).strip()


def head(engine: Any, text: str, n_tokens: int) -> str:
    """The first n_tokens of `text` in the model's tokens, as text (the corpus side of the judged score)."""
    return engine.tokenizer.decode(engine.encode(text, add_bos=False)[:n_tokens]).strip()


@dataclass
class QualityReport:
    model: str
    teacher: str
    stories: int               # held-out stories scored
    model_bpb: float
    model_ppl: float
    model_tokens: int
    teacher_bpb: float
    samples: int               # stories sampled for the judged score
    sample_tokens: int         # at most, per sample (model tokens)
    judged_samples_ppl: float  # teacher perplexity of the model's samples
    judged_corpus_ppl: float   # teacher perplexity of held-out stories cut to the same length
    bytes: int
    max_bytes: int             # each held-out story's first bytes, at most

    @property
    def judged_ratio(self) -> float:
        return self.judged_samples_ppl / self.judged_corpus_ppl

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "judged_ratio": self.judged_ratio}


def measure(model: Any, teacher: Any, held_out: Sequence[str], *, samples: int = 64, sample_tokens: int = 120,
            first_seed: int = 1, temperature: float = 0.8, max_bytes: int = 800,
            progress: Callable[[str, int, int], None] | None = None) -> QualityReport:
    """All three figures for the engine `model`, with the engine `teacher` as the judge."""
    say = (lambda what, i, n: progress(what, i, n)) if progress else (lambda *a: None)
    held_out = [cut_text(t, max_bytes) for t in held_out]
    mine = score_texts(model, held_out, lambda i: say("model scores held-out stories", i, len(held_out)))
    theirs = score_texts(teacher, held_out, lambda i: say("teacher scores held-out stories", i, len(held_out)))
    drawn = []
    for i in range(samples):
        drawn.append(sample_story(model, first_seed + i, sample_tokens, temperature))
        say("model samples stories", i + 1, samples)
    drawn = [d for d in drawn if d]
    judged = score_texts(teacher, drawn, lambda i: say("teacher judges the samples", i, len(drawn)))
    cut = [head(model, t, sample_tokens) for t in held_out[:samples]]
    corpus = score_texts(teacher, cut, lambda i: say("teacher judges the corpus stories", i, len(cut)))
    return QualityReport(str(model.path), str(teacher.path), len(held_out), mine.bits_per_byte, mine.ppl,
                         mine.tokens, theirs.bits_per_byte, len(drawn), sample_tokens, judged.ppl, corpus.ppl,
                         mine.bytes, max_bytes)
