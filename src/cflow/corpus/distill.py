"""Distill a chat model into a story corpus through cflow's own batched decode.

    report = distill("SmolLM2-135M-Instruct.Q4_1.gguf", "data/stories", tokens=5_000_000)

Each story is one seed: cflow.corpus.recipe.prompt_for(seed) gives its prompt, which goes through
the teacher's chat template, and the seed also seeds the story's sampler. The stories decode
together in `parallel` KV-cache slots of one engine (cflow.serve.batch.BatchGenerator over
Engine(n_seq=parallel): one pass over the weights advances every slot; a row is bit for bit what
that story gives alone), so a seed reproduces its story whatever else ran beside it.

Seeds are used in order from `first_seed`, skipping those already in the directory, so a run that
stopped (Ctrl-C, a crash, the token target) continues where it was: stories that were still
decoding are redone, none is written twice. The directory keeps every answer raw
(cflow.corpus.shards); what becomes a training document is decided by cflow.corpus.build.

The run ends when the directory holds `tokens` generated tokens; new stories stop being started
once the written and in-flight tokens reach that, and those in flight finish, so nothing decoded
is thrown away.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from cflow.corpus import recipe
from cflow.corpus.shards import CorpusError, StoryStore

FIRST_SEED = 10_000_000  # above the seeds of the corpora the project started from
DEFAULT_PARALLEL = 16
DEFAULT_SHARD_STORIES = 2000


@dataclass(frozen=True)
class StorySampling:
    """How the teacher samples a story (llama.cpp's names); part of a directory's identity."""

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.15
    repeat_last_n: int = 64
    max_tokens: int = 320


@dataclass
class DistillReport:
    out: Path
    stories: int          # answers in the directory now
    tokens: int           # generated tokens in the directory now
    new_stories: int      # written by this run
    new_tokens: int
    seconds: float
    interrupted: bool
    torn_lines: int       # cut off a crashed run's open shard on opening

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def identity(teacher: Path, sampling: StorySampling, first_seed: int) -> dict[str, Any]:
    """What a story directory must agree on to be continued: the teacher's bytes, the sampling,
    the seeds and the recipe (prompt, features, word lists)."""
    lists = {k: hashlib.sha256("\n".join(recipe.words(k)).encode()).hexdigest()[:16]
             for k in ("verbs", "nouns", "adjectives")}
    return {"teacher": {"file": teacher.name, "sha256": file_sha256(teacher), "bytes": teacher.stat().st_size},
            "sampling": dataclasses.asdict(sampling), "first_seed": int(first_seed),
            "recipe": {"prompt": recipe.PROMPT, "features": list(recipe.FEATURES), "words": lists}}


def _seeds(first: int, done: set[int]) -> Iterator[int]:
    return (s for s in itertools.count(first) if s not in done)


def distill(teacher: str | os.PathLike, out: str | os.PathLike, tokens: int, *, parallel: int = DEFAULT_PARALLEL,
            threads: int | None = None, sampling: StorySampling = StorySampling(), first_seed: int = FIRST_SEED,
            shard_stories: int = DEFAULT_SHARD_STORIES, progress: Callable[[int, int], None] | None = None,
            stop: threading.Event | None = None, log: Callable[[str], None] | None = None) -> DistillReport:
    """Generate stories with `teacher` (a .gguf or .cflow chat model) into the directory `out`
    until it holds `tokens` generated tokens. progress(done, total) follows the tokens; setting
    `stop` (or Ctrl-C) ends the run cleanly: stories in flight are dropped (the next run redoes
    them), the open shard is sealed, the manifest written."""
    from cflow.sampling import SamplingParams
    from cflow.serve.batch import BatchGenerator, Failed, Finished, Piece

    teacher = Path(teacher)
    if not teacher.is_file():
        raise CorpusError(f"teacher model {teacher} does not exist; give a .gguf or .cflow chat model")
    if tokens < 1 or parallel < 1 or shard_stories < 1:
        raise CorpusError(f"tokens, parallel and shard_stories must be >= 1, got {tokens}, {parallel}, {shard_stories}")
    store = StoryStore.open(out, identity(teacher, sampling, first_seed))
    t0 = time.perf_counter()
    start_stories, start_tokens = store.stories, store.tokens
    report = lambda interrupted: DistillReport(  # noqa: E731
        store.root, store.stories, store.tokens, store.stories - start_stories, store.tokens - start_tokens,
        time.perf_counter() - t0, interrupted, store.torn_lines)
    if store.tokens >= tokens:
        store.close()
        return report(False)

    seeds = _seeds(first_seed, store.seeds())
    gen = BatchGenerator.load(teacher, parallel=parallel, threads=threads,
                              n_ctx=min(1024, 256 + sampling.max_tokens), max_queue=4 * parallel)
    events: queue.SimpleQueue = queue.SimpleQueue()
    flight: dict[int, dict[str, Any]] = {}  # seed -> the answer being decoded
    jobs: dict[int, Any] = {}
    stop = stop or threading.Event()
    params = {k: v for k, v in dataclasses.asdict(sampling).items() if k != "max_tokens"}

    def start() -> None:
        p = recipe.prompt_for(next(seeds))
        ids = gen.backend.chat_tokens([{"role": "user", "content": p.text}])
        flight[p.seed] = {"seed": p.seed, "verb": p.verb, "noun": p.noun, "adjective": p.adjective,
                          "feature": p.feature, "parts": [], "tokens": 0}
        jobs[p.seed] = gen.submit(ids, lambda ev, s=p.seed: events.put((s, ev)), max_tokens=sampling.max_tokens,
                                  params=SamplingParams(**params, seed=p.seed))

    def decoded() -> int:
        """Tokens written, plus what the stories in flight are expected to reach (the mean length so
        far, or 250 before any finished): the target is not overshot by a whole batch of stories."""
        mean = store.tokens / store.stories if store.stories else 250
        return store.tokens + sum(max(a["tokens"], mean) for a in flight.values())

    if log:
        log(f"teacher {teacher.name}: {parallel} stories decode together, {gen.backend.engine.threads} threads, "
            f"{gen.backend.engine.isa}; {store.stories} stories ({store.tokens} tokens) already in {store.root}")
    interrupted = False
    try:
        while len(flight) < 2 * parallel and decoded() < tokens:
            start()
        while flight:
            if stop.is_set():
                interrupted = True
                break
            try:
                seed, ev = events.get(timeout=0.2)
            except queue.Empty:
                continue
            a = flight[seed]
            if isinstance(ev, Piece):
                a["parts"].append(ev.text)
                a["tokens"] += 1
                if progress:
                    progress(store.tokens + sum(x["tokens"] for x in flight.values()), tokens)
            elif isinstance(ev, Finished):
                del flight[seed], jobs[seed]
                a["parts"].append(ev.tail)
                answer = {k: a[k] for k in ("seed", "verb", "noun", "adjective", "feature")}
                answer.update(text="".join(a["parts"]), finish=ev.reason, tokens=ev.completion_tokens)
                store.append(answer)
                store.settle(shard_stories)
                while len(flight) < 2 * parallel and decoded() < tokens:
                    start()
            elif isinstance(ev, Failed):
                raise ev.error
    except KeyboardInterrupt:
        interrupted = True
    finally:
        for j in jobs.values():
            j.cancel()
        gen.close()
        r = report(interrupted)
        store.manifest["runs"].append({
            "ended": time.strftime("%Y-%m-%dT%H:%M:%S"), "seconds": round(r.seconds, 1),
            "new_stories": r.new_stories, "new_tokens": r.new_tokens, "tok_s": round(r.tok_s, 1),
            "parallel": parallel, "threads": gen.backend.engine.threads if hasattr(gen.backend, "engine") else None,
            "isa": getattr(getattr(gen.backend, "engine", None), "isa", None), "interrupted": interrupted})
        store.close()
    return report(interrupted)
