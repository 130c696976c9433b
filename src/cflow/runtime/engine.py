"""Engine: load a model, prefill, step, generate text: the Python face of the C decode engine.

    eng = Engine.load("smollm2.cflow")                   # or a .gguf, converted once into a cache
    for piece in eng.generate("Once upon a time", max_tokens=64, seed=1):
        print(piece, end="", flush=True)
    c = eng.complete("The capital of France is", temperature=0)   # Completion(text, tokens, ...)
    c = eng.chat([{"role": "user", "content": "Hi!"}])

Owns: loading (mmap by default; the file's tensor table becomes a descriptor array the C engine
validates), the thread-count and context defaults, the .gguf conversion cache, the KV-cache
prefix reuse between calls, the generation loop (stop ids, stop strings, streaming text) and
timings. One native call per token: `step()` runs the whole forward pass in C and writes the
logits into a numpy array that is reused, so the per-token Python cost is sampling plus a few
attribute lookups. Sampling lives in cflow.sampling, the op plan in cflow.scheduler.

No torch here (SPEC §11): running a converted model needs numpy, tokenizers and the C core.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from cflow import quant
from cflow.errors import CflowError
from cflow.sampling import Sampler, SamplingParams
from cflow.scheduler import OP_FIELDS, build_plan

DEFAULT_MAX_CTX = 4096
DEFAULT_MAX_BATCH = 64  # prefill tokens per native call
_DESC_FIELDS = 6
_GLOBAL = ("tok_emb", "norm", "lm_head")
_SLOTS = ("attn_norm", "attn.wqkv", "attn.wo", "ffn_norm", "ffn.w_gate_up", "ffn.w_down", "moe_norm",
          "moe.router")


class EngineError(CflowError, ValueError):
    """The engine cannot run this model or this request."""


class ModelNotFoundError(EngineError, FileNotFoundError):
    """The model path does not exist."""


class ModelFormatError(EngineError):
    """The file is not a model the engine can load (neither .cflow/.vflow nor .gguf)."""


class ContextOverflowError(EngineError):
    """The prompt (plus what must be generated) does not fit the engine's context."""


class NativeMissingError(EngineError, ImportError):
    """The compiled core (cflow._native) is not built or does not have the engine."""


@dataclass
class Timings:
    """Wall-clock split of one generation, llama.cpp style."""

    load_s: float = 0.0
    prompt_tokens: int = 0  # tokens actually evaluated (a reused prefix is not counted)
    prompt_s: float = 0.0
    gen_tokens: int = 0
    gen_s: float = 0.0  # decode steps + sampling
    sample_s: float = 0.0  # of which sampling
    reused_tokens: int = 0  # prompt tokens whose KV cache was kept from the previous call

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def gen_tps(self) -> float:
        return self.gen_tokens / self.gen_s if self.gen_s > 0 else 0.0


@dataclass
class Completion:
    text: str
    tokens: list[int]  # generated ids (a stop id is not included)
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string), "length" (max_tokens or context end)
    timings: Timings = field(default_factory=Timings)


# ---- defaults --------------------------------------------------------------------------------


def usable_threads() -> int:
    """Cores this process may use: the affinity mask, capped by a cgroup v2/v1 CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        n = min(n, max(1, int(np.ceil(quota))))
    return max(1, n)


def _cgroup_cpu_quota() -> float | None:
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:  # v2: "max 100000" or "200000 100000"
            q, p = f.read().split()[:2]
        return None if q == "max" else int(q) / int(p)
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            q = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            p = int(f.read())
        return None if q <= 0 else q / p
    except (OSError, ValueError):
        return None


def cache_dir() -> Path:
    """Where converted .gguf files are kept: $CFLOW_CACHE, else ~/.cache/cflow."""
    env = os.environ.get("CFLOW_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "cflow"


def _gguf_cache_path(src: Path) -> Path:
    # Keyed by what identifies this file's content cheaply: path, size, mtime and its first
    # 64 KiB (the GGUF header with all metadata); plus our version, since the format may change.
    from cflow import __version__

    st = src.stat()
    h = hashlib.sha256()
    h.update(f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}|{__version__}".encode())
    with open(src, "rb") as f:
        h.update(f.read(1 << 16))
    return cache_dir() / f"{src.stem}-{h.hexdigest()[:16]}.cflow"


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _native_module():
    try:
        from cflow import _native
    except ImportError as e:
        raise NativeMissingError(f"the compiled core cflow._native is not available ({e}); build it with "
                                 "`pip install -e .` (needs a C compiler and CMake)") from None
    if not hasattr(_native, "NativeEngine"):
        raise NativeMissingError("cflow._native was built without the decode engine; rebuild with "
                                 "`pip install -e .`")
    if (_native.ENGINE_DESC_FIELDS, _native.ENGINE_OP_FIELDS) != (_DESC_FIELDS, OP_FIELDS):
        raise NativeMissingError("cflow._native is older than this cflow (its engine tables differ); rebuild "
                                 "with `pip install -e .`")
    return _native


# ---- the engine --------------------------------------------------------------------------------


class Engine:
    """A loaded model ready to generate. Not thread-safe: one generation at a time per Engine."""

    def __init__(self, cf: Any, *, threads: int | None = None, n_ctx: int | None = None,
                 max_batch: int = DEFAULT_MAX_BATCH) -> None:
        from cflow.tokenizer import Tokenizer

        native = _native_module()
        self.file = cf
        self.config = cf.config
        self.path = cf.path
        self.threads = int(threads) if threads else usable_threads()
        # threads=None: decode picks its thread count from measurements (see ThreadTuner)
        if self.threads < 1:
            raise EngineError(f"threads must be >= 1, got {threads}")
        limit = self.config.max_seq_len
        self.n_ctx = int(n_ctx) if n_ctx else min(limit, DEFAULT_MAX_CTX)
        if self.n_ctx < 1:
            raise EngineError(f"context size must be >= 1, got {n_ctx}")
        if self.n_ctx > limit:
            raise EngineError(f"context size {self.n_ctx} exceeds the model's max_seq_len {limit}; "
                              f"use -c {limit} or less")
        self.plan = build_plan(self.config)
        try:
            self._native = native.NativeEngine(cf.buffer, self.config.to_dict(), self._descriptor(cf),
                                               self.plan.encode(), self.plan.n_ring, self.plan.n_pending,
                                               self.threads, self.n_ctx, int(max_batch))
        except ValueError as e:
            raise EngineError(f"{cf.path}: {e}") from None
        self.tokenizer = Tokenizer(cf.tokenizer)
        self.tuner = ThreadTuner(self.threads) if threads is None and self.threads > 1 else None
        self.isa: str = self._native.isa
        self._logits = np.zeros(self.config.vocab_size, np.float32)  # [V], reused every step
        self._cached: list[int] = []  # tokens whose K/V sit in the cache at positions 0..n-1
        self.last_timings = Timings()
        self.last_prompt_len = 0  # prompt tokens of the last generation
        self.last_finish_reason = ""  # "stop" or "length"
        self.seed: int | None = None  # the sampling seed the last generation used
        self.load_s = 0.0

    # ---- loading ---------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike, threads: int | None = None, n_ctx: int | None = None,
             mmap: bool = True, *, max_batch: int = DEFAULT_MAX_BATCH, verify: bool = False,
             progress: Callable[[int, int, str], None] | None = None,
             log: Callable[[str], None] | None = None) -> "Engine":
        """Load a .cflow/.vflow file, or a .gguf (converted once into `cache_dir()`; `log` is told).

        threads: default `usable_threads()`; n_ctx: default min(max_seq_len, 4096); mmap=False
        reads the file into memory instead of mapping it. `progress(done, total, name)` follows
        a conversion.
        """
        from cflow.fileformat import FormatError, open_model

        t0 = time.perf_counter()
        p = Path(path)
        if not p.exists():
            raise ModelNotFoundError(f"model file {p} does not exist; convert one with `cflow convert MODEL.gguf "
                                     f"OUT.cflow` or pass an existing .cflow/.gguf path")
        if p.is_dir():
            raise ModelFormatError(f"{p} is a directory; give a .cflow file (convert a checkpoint directory "
                                   f"with `cflow convert {p} OUT.cflow`)")
        gguf = p if _is_gguf(p) else None
        if gguf is not None:
            p = cls._converted(gguf, progress, log)
        try:
            cf = open_model(p, mmap=mmap, verify=verify)
        except FormatError as e:
            if gguf is None:
                raise ModelFormatError(f"{e} (the engine reads .cflow/.vflow files and .gguf files)") from None
            # A cached conversion this cflow cannot read (written by another version): convert again.
            if log:
                log(f"cached conversion {p} is unreadable ({e}); converting again")
            p.unlink(missing_ok=True)
            cf = open_model(cls._converted(gguf, progress, log), mmap=mmap, verify=verify)
        eng = cls(cf, threads=threads, n_ctx=n_ctx, max_batch=max_batch)
        eng.load_s = time.perf_counter() - t0
        return eng

    @staticmethod
    def _converted(src: Path, progress, log) -> Path:
        dst = _gguf_cache_path(src)
        if dst.exists():
            if log:
                log(f"using {dst} (converted from {src.name} earlier)")
            return dst
        from cflow.convert import convert

        if log:
            log(f"converting {src.name} into {dst} (once; later loads reuse it)")
        dst.parent.mkdir(parents=True, exist_ok=True)
        convert(src, dst, progress=progress)
        return dst

    @staticmethod
    def _descriptor(cf: Any) -> np.ndarray:
        """int64 [n, 6] rows (offset, dtype id, rows, cols, tile rows, tile cols) in the order of
        native/engine.h (cf_desc_index); dtype -1 marks a tensor the file lacks."""
        cfg = cf.config
        E = cfg.n_experts
        names = list(_GLOBAL)
        for i in range(cfg.n_unique_layers):
            names += [f"layers.{i}.{s}" for s in _SLOTS]
            for e in range(E):
                names += [f"layers.{i}.moe.experts.{e}.w_gate_up", f"layers.{i}.moe.experts.{e}.w_down"]
        desc = np.full((len(names), _DESC_FIELDS), -1, np.int64)
        for k, name in enumerate(names):
            t = cf.tensors.get(name)
            if t is None:
                continue
            if t.dtype not in quant.DTYPE_IDS:
                raise EngineError(f"tensor {name} has dtype {t.dtype!r}, which the engine cannot run")
            shape = tuple(t.shape)
            rows, cols = (1, shape[0]) if len(shape) == 1 else shape
            if t.dtype in ("f32", "f16"):
                tr = tc = 0
                if t.layout != "rows":
                    raise EngineError(f"tensor {name} is {t.dtype} in layout {t.layout!r}; expected rows")
            else:
                if t.layout != "tiled":
                    raise EngineError(f"tensor {name} is {t.dtype} in layout {t.layout!r}; the engine needs "
                                      f"tiled matrices: re-convert the model with `cflow convert`")
                tr, tc = t.meta.get("tile", cf.tile)
            desc[k] = (t.offset, quant.DTYPE_IDS[t.dtype], rows, cols, tr, tc)
        return desc

    def close(self) -> None:
        """Free the engine's memory (KV cache, threads) and unmap the file; the Engine is unusable after."""
        self.__dict__.pop("_native", None)
        self.file.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Engine({self.path!r}, {self.config.name}, threads={self.threads}, n_ctx={self.n_ctx}, "
                f"isa={self.isa})")

    # ---- low level ------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the sequence: the next call starts at position 0 (the KV cache is overwritten)."""
        self._cached = []

    def step(self, token: int, pos: int) -> np.ndarray:
        """Run one token at position `pos` (0..pos-1 must be in the cache); return the logits [V].

        The array is reused by the next call: copy it to keep it."""
        self._check_positions(pos, 1)
        if self.tuner is None:
            self._native.step(int(token), int(pos), self._logits)
        else:
            n = self.tuner.pick()
            if n != self._native.active_threads:
                self._native.active_threads = n
            t0 = time.perf_counter()
            self._native.step(int(token), int(pos), self._logits)
            self.tuner.record(n, time.perf_counter() - t0)
        del self._cached[pos:]
        self._cached.append(int(token))
        return self._logits

    def prefill(self, tokens: Sequence[int] | np.ndarray, pos0: int = 0) -> np.ndarray:
        """Run `tokens` at positions pos0.. in batches; return the logits after the last [V]."""
        toks = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64).ravel())
        if toks.size == 0:
            raise EngineError("prefill needs at least one token")
        if toks.min() < 0 or toks.max() >= self.config.vocab_size:
            raise EngineError(f"token ids must be in 0..{self.config.vocab_size - 1}")
        self._check_positions(pos0, toks.size)
        if self.tuner is not None:
            self._native.active_threads = self.tuner.best
        self._native.prefill(toks.astype(np.int32), int(pos0), self._logits)
        del self._cached[pos0:]
        self._cached.extend(int(t) for t in toks)
        return self._logits

    def _check_positions(self, pos0: int, n: int) -> None:
        if pos0 < 0 or pos0 > len(self._cached):
            raise EngineError(f"position {pos0} skips positions the cache does not hold "
                              f"(it holds {len(self._cached)} tokens); call reset() to start over")
        if pos0 + n > self.n_ctx:
            raise ContextOverflowError(f"{pos0 + n} tokens do not fit the context of {self.n_ctx}; "
                                       f"load the model with a larger context (-c / n_ctx, up to "
                                       f"{self.config.max_seq_len})")

    def eval(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits after `tokens`, reusing the cached prefix they share with the previous call."""
        toks = [int(t) for t in tokens]
        if not toks:
            raise EngineError("nothing to evaluate: the prompt is empty")
        keep = _common_prefix(self._cached, toks)
        keep = min(keep, len(toks) - 1)  # the last token must run to produce logits
        self.last_timings.reused_tokens = keep
        return self.prefill(toks[keep:], keep)

    def counters(self) -> dict[str, int]:
        """Weight bytes touched by category since reset_counters(), plus kv bytes, tokens, calls."""
        return dict(self._native.counters())

    def expert_hits(self) -> list[list[int]]:
        """Routing counts [layer][expert] since reset_counters()."""
        return self._native.expert_hits()

    def reset_counters(self) -> None:
        self._native.reset_counters()

    def weight_bytes_per_token(self) -> float:
        """Weight bytes one decode step reads (the top-k experts for MoE layers: the routed average
        once tokens have run, else top_k experts' worth)."""
        cfg, t = self.config, self.file.tensors
        nb = lambda name: t[name].nbytes if name in t else 0  # noqa: E731
        total = nb("norm") + nb("tok_emb") // cfg.vocab_size + nb("lm_head" if "lm_head" in t else "tok_emb")
        for layer in range(cfg.n_layers):
            p = f"layers.{cfg.weight_layer(layer)}."
            total += sum(nb(p + s) for s in _SLOTS)
            if cfg.has_moe:
                per = [nb(f"{p}moe.experts.{e}.w_gate_up") + nb(f"{p}moe.experts.{e}.w_down")
                       for e in range(cfg.n_experts)]
                total += cfg.top_k * sum(per) / len(per)
        return float(total)

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], max_tokens: int | None = 128, *,
                 temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 repeat_penalty: float = 1.0, repeat_last_n: int = 64, seed: int | None = None,
                 stop: Sequence[str] = (), add_bos: bool | None = None) -> Iterator[str]:
        """Stream the continuation of `prompt` as text pieces.

        Stops at an end-of-sequence/end-of-turn token, at a stop string (not included in the
        output), after `max_tokens` (None: until the context is full), or at the end of the
        context. Timings of the run are in `self.last_timings` once it ends."""
        for _, piece in self._run(prompt, max_tokens, SamplingParams(
                temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                repeat_last_n=repeat_last_n, seed=seed), stop, add_bos):
            if piece:
                yield piece

    def complete(self, prompt: str | Sequence[int], max_tokens: int | None = 128, **kw: Any) -> Completion:
        """Non-streaming generate(): the whole text, the generated ids, the finish reason, timings."""
        stop = kw.pop("stop", ())
        add_bos = kw.pop("add_bos", None)
        params = SamplingParams(**kw)
        ids: list[int] = []
        parts: list[str] = []
        run = self._run(prompt, max_tokens, params, stop, add_bos)
        for tok, piece in run:
            if tok >= 0:
                ids.append(tok)
            parts.append(piece)
        return Completion("".join(parts), ids, self.last_prompt_len, self.last_finish_reason, self.last_timings)

    def chat(self, messages: list[dict[str, Any]], max_tokens: int | None = 512, **kw: Any) -> Completion:
        """Answer a conversation with the file's chat template (non-streaming)."""
        return self.complete(self.chat_tokens(messages), max_tokens, **kw)

    def chat_stream(self, messages: list[dict[str, Any]], max_tokens: int | None = 512,
                    **kw: Any) -> Iterator[str]:
        """Stream the answer to a conversation, rendered with the file's chat template."""
        return self.generate(self.chat_tokens(messages), max_tokens, **kw)

    def chat_tokens(self, messages: list[dict[str, Any]]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))

    def _encode(self, prompt: str | Sequence[int], add_bos: bool | None) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_bos=add_bos)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise EngineError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                              f"(0..{self.config.vocab_size - 1})")
        return ids

    def _run(self, prompt: str | Sequence[int], max_tokens: int | None, params: SamplingParams,
             stop: Sequence[str], add_bos: bool | None) -> Iterator[tuple[int, str]]:
        """Yield (token id, newly visible text) per generated token; id -1 for a final flush."""
        if max_tokens is not None and max_tokens < 0:
            raise EngineError(f"max_tokens must be >= 0 (or None for no limit), got {max_tokens}")
        stop = [s for s in ([stop] if isinstance(stop, str) else stop) if s]
        ids = self._encode(prompt, add_bos)
        if not ids:
            raise EngineError("the prompt is empty and the tokenizer adds no BOS token; give some text")
        if len(ids) >= self.n_ctx:
            raise ContextOverflowError(f"the prompt has {len(ids)} tokens but the context holds {self.n_ctx}; "
                                       f"shorten the prompt or raise the context with -c / n_ctx (the model "
                                       f"allows up to {self.config.max_seq_len})")
        sampler = Sampler(params)
        stop_ids = self.tokenizer.stop_ids
        detok = self.tokenizer.stream(skip_special=True)
        held = _StopMatcher(stop)
        tm = self.last_timings = Timings(load_s=self.load_s)
        self.last_prompt_len, self.last_finish_reason = len(ids), "length"
        self.seed = sampler.seed

        t0 = time.perf_counter()
        logits = self.eval(ids)
        tm.prompt_tokens = len(ids) - tm.reused_tokens
        tm.prompt_s = time.perf_counter() - t0

        history = list(ids)
        # Every sampled token but the last runs through the model; the context bounds both.
        limit = self.n_ctx - len(ids) + 1
        if max_tokens is not None:
            limit = min(limit, max_tokens)
        t_gen = time.perf_counter()
        hit = False
        try:
            for i in range(limit):
                ts = time.perf_counter()
                tok = sampler.sample(logits, history)
                tm.sample_s += time.perf_counter() - ts
                tm.gen_tokens += 1
                if tok in stop_ids:
                    self.last_finish_reason = "stop"
                    break
                history.append(tok)
                text, hit = held.feed(detok.put(tok))
                yield tok, text
                if hit:
                    self.last_finish_reason = "stop"
                    break
                if i + 1 < limit:
                    logits = self.step(tok, len(history) - 1)
            if not hit:
                tail, _ = held.feed(detok.flush(), final=True)
                if tail:
                    yield -1, tail
        finally:
            tm.gen_s = time.perf_counter() - t_gen


class ThreadTuner:
    """Chooses how many of the engine's threads each decode step uses, from measured step times.

    Why: a static split over threads needs every thread at every barrier (~150 per token). When
    other processes take cores, a thread whose partner is descheduled waits at each one: on the
    2-core machine shared with one busy process, 2 threads took 5.0 ms per token and 1 thread 3.3
    ms; on an idle machine more threads win. So decode runs with the fastest count measured and
    re-measures the others for a few steps every PROBE_EVERY steps. Outputs do not depend on the
    count (each output row and head is computed identically by whichever thread gets it).
    Only used when the caller did not fix the thread count.
    """

    PROBE_EVERY = 64
    PROBE_STEPS = 3  # the first step of a probe only wakes the threads; it is not timed

    def __init__(self, n: int) -> None:
        self.choices = sorted({n, max(1, n // 2), 1})
        self.best = n
        self.seconds: dict[int, float] = {}  # choice -> smoothed seconds per step
        self.steps = 0
        self._probe, self._left = n, 0

    def pick(self) -> int:
        self.steps += 1
        if not self._left and (self.steps == 8 or self.steps % self.PROBE_EVERY == 0):
            others = [c for c in self.choices if c != self.best]
            self._probe = others[(self.steps // self.PROBE_EVERY) % len(others)]
            self._left = self.PROBE_STEPS
        return self._probe if self._left else self.best

    def record(self, used: int, seconds: float) -> None:
        if self._left:
            self._left -= 1
            if self._left == self.PROBE_STEPS - 1:
                return
        old = self.seconds.get(used)
        self.seconds[used] = seconds if old is None else 0.7 * old + 0.3 * seconds
        if not self._left:
            self.best = min(self.seconds, key=self.seconds.__getitem__)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _StopMatcher:
    """Holds back text that might be the start of a stop string; reports when one appears."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.buf = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, bool]:
        """(text safe to show now, whether a stop string was hit)."""
        self.buf += text
        if not self.stops:
            out, self.buf = self.buf, ""
            return out, False
        hits = [(self.buf.find(s), s) for s in self.stops if s in self.buf]
        if hits:
            at = min(i for i, _ in hits)
            out, self.buf = self.buf[:at], ""
            return out, True
        if final:
            out, self.buf = self.buf, ""
            return out, False
        keep = 0  # longest suffix of buf that is a proper prefix of some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.buf)), 0, -1):
                if self.buf.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        out = self.buf[:len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep:]
        return out, False
