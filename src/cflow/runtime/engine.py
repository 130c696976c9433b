"""Engine: load a model, prefill, step: the Python face of the C decode engine.

    eng = Engine.load("smollm2.cflow")                   # or a .gguf; no argument: the built-in model
    for piece in eng.generate("Once upon a time", max_tokens=64, seed=1):
        print(piece, end="", flush=True)
    c = eng.complete("The capital of France is", temperature=0)   # Completion(text, tokens, ...)
    c = eng.chat([{"role": "user", "content": "Hi!"}])

Owns: loading (mmap by default; checksums verified on a file's first use; a .gguf converted once
into the cache of cflow.runtime.files), the thread-count and context defaults, the KV-cache prefix
reuse between calls, and the native step. What it loads and runs with (threads, context,
sequences, KV-cache types, expert residency and speculation, read-ahead, software prefetch, ...) is one
cflow.runtime.options.EngineOptions, checked when it is made; Engine.load's keyword arguments
override its fields. One native call per token: `step()` runs the whole forward pass in C and
writes the logits into a numpy array that is reused. The generation loop is
cflow.runtime.generate, the op plan cflow.runtime.plan, the encoding for C cflow.runtime.abi, where
a MoE model keeps its experts (RAM, or disk through a bounded cache) cflow.runtime.experts.

Several sequences: Engine.load(..., n_seq=N) keeps N KV caches; `prefill(tokens, pos0, seq=s)` fills
one and `step_batch(seqs, tokens, positions)` advances several in one pass over the weights (the C
core's cf_step_batch), each row bit-identical to that sequence running alone; `step_rows(seqs,
tokens, positions, want)` also takes several consecutive rows of one sequence (a prompt chunk
beside other sequences' decode rows, cf_step_rows) and computes logits only where wanted. The server's
backend (cflow.serve.backend.EngineBatch) is built on it.

No torch here: running a converted model needs numpy, tokenizers and the C core.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from cflow import weights
from cflow.fileformat.layout import MAGIC
from cflow.runtime import abi, files
from cflow.runtime import experts as xp
from cflow.runtime import prefetch as prefetch_mod
from cflow.runtime import kvcache, pages
from cflow.runtime import readahead as readahead_mod
from cflow.runtime.errors import (ContextOverflowError, CorruptModelError, EngineError, ModelFormatError,
                                  ModelNotFoundError, RecurrentStateError)
from cflow.constrain import constraint_spec
from cflow.runtime.generate import Completion, Timings, common_prefix, run
from cflow.runtime.options import DEFAULT_MAX_BATCH, EngineOptions  # noqa: F401 (DEFAULT_MAX_BATCH: its old home)
from cflow.runtime.plan import build_plan
from cflow.runtime import routes as routes_mod
from cflow.runtime.threads import ThreadTuner, resolve_threads
from cflow.sampling import SamplingParams
from cflow.tokenizer import check_token_ids

DEFAULT_MAX_CTX = 4096
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "default.cflow"


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _not_a_gguf(path: Path) -> str:
    """Why a file named .gguf is not one: what its first bytes look like."""
    with open(path, "rb") as f:
        head = f.read(64)
    if not head:
        what = "it is empty"
    elif head.startswith(b"version https://git-lfs"):
        what = "it is a git-lfs pointer (run `git lfs pull` to fetch the real file)"
    elif head.lstrip()[:1] in (b"<", b"{"):
        what = "it looks like text (an HTML error page or JSON?), not a model download"
    elif head.startswith(MAGIC):
        what = "it is a cflow model file under a .gguf name; rename it to .cflow"
    else:
        what = f"it starts with {head[:4]!r}, not the GGUF magic b'GGUF'"
    return f"{path} is named .gguf but is not a GGUF file: {what}; download it again"


# ---- the engine --------------------------------------------------------------------------------


class Engine:
    """A loaded model ready to generate. Not thread-safe: one generation at a time per Engine."""

    def __init__(self, cf: Any, options: EngineOptions | None = None, *, log: Callable[[str], None] | None = None,
                 **overrides: Any) -> None:
        """An engine over an open CflowFile, run as `options` say (cflow.runtime.options; keywords
        override its fields, as in Engine.load, which documents each). A copy of the weights
        (mmap=False, or hugepages; with experts on disk: all but the experts) is made once per open
        file and shared by the engines over it (cflow.runtime.pages); verify is
        Engine.load's business (the file is already open). n_seq: KV-cache slots (sequences) of
        n_ctx positions each, for step_batch; the single-sequence calls use sequence 0."""
        from cflow.tokenizer import Tokenizer

        opts = EngineOptions.build(options, **overrides)  # every value checked before any work
        native = abi.native_module()
        self.options = opts
        self.file = cf
        self.config = cf.config
        self.path = cf.path
        # threads None: every usable core, and decode picks its count from measurements (ThreadTuner)
        self.threads = resolve_threads(opts.threads, native.MAX_THREADS)
        limit = self.config.max_seq_len
        self.n_ctx = opts.n_ctx or min(limit, DEFAULT_MAX_CTX)
        self.n_seq = opts.n_seq
        self.cache_type_k, self.cache_type_v = opts.cache_type_k, opts.cache_type_v
        kvcache.check_model(self.config, self.cache_type_k, self.cache_type_v)  # before anything is allocated
        if self.n_ctx > limit:
            raise EngineError(f"context size {self.n_ctx} exceeds the model's max_seq_len {limit}; "
                              f"use -c {limit} or less", flag="-c")
        # where the experts live, decided once, before the plan, which depends on it. The decision
        # sizes the expert cache for the plan experts on disk would run, so that plan is built (and
        # the C core asked how many layers it keeps in flight) once here and kept when the experts
        # do go to disk. (Async reads: experts(l) waits until resid(l + delta_expert) needs it, so
        # the reads overlap the layers between; that keeps delta_expert + 1 layers' experts pinned.)
        delay = opts.expert_delay and opts.expert_io == "async"
        sizes = disk_plan = None
        if self.config.has_moe:
            disk_plan = build_plan(self.config, delay_experts=delay)
            sizes = xp.model_sizes(cf, self.n_ctx * self.n_seq,  # every sequence's KV cache
                                    xp.plan_inflight(disk_plan, native), self.cache_type_k, self.cache_type_v)
        self.residency = xp.decide(sizes, experts=opts.experts, expert_cache=opts.expert_cache,
                                   expert_io=opts.expert_io, expert_speculation=opts.expert_speculation)
        disk = self.residency.mode == "disk"
        buffer = cf.buffer
        mapped = isinstance(getattr(buffer, "base", None), np.memmap)
        # the file's mapping, or a copy in 2 MiB pages (cflow.runtime.pages)
        self.placement = pages.placement(int(buffer.size), mmap=opts.mmap, hugepages=opts.hugepages,
                                         experts_on_disk=disk, available=xp.probe_memory().available)
        if self.placement.copy and mapped:
            buffer = pages.shared_copy(cf, skip_experts=disk, huge_pages=self.placement.huge_pages)
        self._weights = buffer
        if disk:
            xp.drop_expert_pages(cf)
        # cold start (cflow.runtime.readahead): a .vflow runs its plan in file order, and a sweeper
        # may read the mapped weights ahead of the first steps
        file_order, self._sweeper, resident = readahead_mod.start(cf, opts.readahead,
                                                                  mapped=mapped and not self.placement.copy,
                                                                  skip_experts=disk)
        # with experts on disk only the dense weights come from the mapping, and every plan already
        # touches those in the .vflow order (the cache was sized for that plan: keep it)
        file_order = file_order and not disk
        self._readahead = {"mode": opts.readahead, "file_order": file_order, "resident_before": resident}
        experts = None
        if disk:
            self.plan = disk_plan
            experts = xp.native_options(cf, self.residency, sizes.inflight)
        else:
            self.plan = build_plan(self.config, file_order=file_order)
        desc, names = abi.descriptor(cf, native)
        try:
            self._native = native.NativeEngine(buffer, self.config.to_dict(), desc, names,
                                               abi.encode_plan(self.plan, native), self.plan.n_ring,
                                               self.plan.n_pending, self.threads, self.n_ctx, opts.max_batch,
                                               self.plan.n_moe, experts, self.n_seq,
                                               native.DTYPE_IDS[self.cache_type_k], native.DTYPE_IDS[self.cache_type_v])
        except ValueError as e:
            self._stop_sweeper()
            raise EngineError(f"{cf.path}: {e}") from None
        self._native.overlap = opts.overlap
        self._native.prefetch = prefetch_mod.to_mode(opts.prefetch)
        if disk and log:
            log(xp.describe(self.residency, self._native.expert_cache))
        self.tokenizer = Tokenizer(cf.tokenizer)
        self.tuner = ThreadTuner(self.threads) if opts.threads is None and self.threads > 1 else None
        self.isa: str = self._native.isa
        self._logits = np.zeros(self.config.vocab_size, np.float32)  # [V], reused every step
        # per sequence: the tokens whose K/V sit in its cache at positions 0..n-1
        self._seqs: list[list[int]] = [[] for _ in range(self.n_seq)]
        self._batch_logits = np.zeros((self.n_seq, self.config.vocab_size), np.float32)  # step_batch's
        self._rows_logits = np.zeros((self.n_seq, self.config.vocab_size), np.float32)  # step_rows' (grows)
        self.last_timings = Timings()
        self._routes: tuple[str, np.ndarray, np.ndarray] | None = None  # a route trace's mode and arrays
        self.last_prompt_len = 0  # prompt tokens of the last generation
        self.last_finish_reason = ""  # "stop" or "length"
        self.seed: int | None = None  # the sampling seed the last generation used
        self.load_s = 0.0

    # ---- loading ---------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike | None = None, options: EngineOptions | None = None, *,
             progress: Callable[[int, int, str], None] | None = None,
             log: Callable[[str], None] | None = None, **overrides: Any) -> "Engine":
        """Load a .cflow/.vflow file, or a .gguf (converted once into the cache; `log` is told);
        no path: the built-in model.

        `options` (cflow.runtime.options.EngineOptions; default: every default) says how to load and
        run it, and keyword arguments override its fields one by one: Engine.load(path, threads=2)
        is Engine.load(path, EngineOptions(threads=2)). Every value is checked before the file is
        opened. The fields:

        threads: default (None or 0) every usable core; n_ctx: default min(max_seq_len, 4096);
        max_batch: rows one native call runs (prefill tokens per call; default 64);
        hugepages (default True) reads the weights into 2 MiB pages instead of mapping the file when
        they take at most half the memory the process may use and the experts stay in memory (fewer
        TLB misses: decode up to ~2.5x faster on a VM; cflow.runtime.pages); mmap=False always reads
        them into memory, hugepages=False with mmap keeps the mapping. verify: check the checksums
        on the file's first use (cached by path, size, mtime and inode; False skips).
        `progress(done, total, name)` follows a conversion.

        Mixture-of-experts models (cflow.runtime.experts): experts="ram" keeps every expert in memory;
        "disk" reads experts from the file as the router chooses them, into a cache of at most
        `expert_cache` bytes (an int, or "2G"; default: what memory leaves); "auto" (default) is
        disk when the model does not fit the memory this process may use (`log` is told why).
        expert_io="async" starts a layer's reads as soon as its router has chosen; "sync" reads,
        then computes. With async reads and delta_expert > 0 the experts of layer l run just before
        layer l + delta_expert needs them, so their reads overlap the layers between (expert_delay=
        False runs them right after the router, for comparison); results are the same bit for bit.
        expert_speculation=N (expert speculation, async only) also predicts the experts of layers up
        to l+N when layer l routes (their routers applied to layer l's MoE input) and starts their
        reads early, in cache slots beyond the minimum; beyond the next layer only while those
        predictions prove right ("next-layer" = 1, at most 16); "auto" (default) = 16 with async
        reads, "off" = 0. Bit for bit the same results; counters() reports speculation_predicted /
        speculation_hits. (expert_prefetch=, its old name, still works with a DeprecationWarning.)

        n_seq: independent sequences (KV-cache slots of n_ctx positions each) that `step_batch`
        advances together in one pass over the weights; memory grows by one KV cache per sequence.

        readahead (cold starts, cflow.runtime.readahead): "auto" (default) runs a .vflow file's
        plan in its file order and, when less than half of its mapped weights are in the page cache,
        reads them ahead of the compute in that order from a background thread; "order" only the
        first; "sweep" both, for any mapped file, cold or not; "off" neither. A .cflow file under "auto" is
        read as before. Same results bit for bit; `readahead_stats()` says what was done.

        overlap=True (experimental, off by default): with delta_dense >= 1, attn(l) and dense(l) run
        side by side on two halves of the threads (docs/DESIGN.md, "Overlapping independent nodes");
        same results bit for bit. `Engine.overlap` switches it between calls.

        prefetch (software prefetch (PREFETCHT0) in the kernels, claim C6; cflow.runtime.prefetch; not
        expert speculation, which reads experts from disk): None (default) keeps each kernel's own
        choice (the mat-vec and gate/up 8 KiB ahead, none on Zen 4, 2 KiB on Intel; the avx512 batched
        kernels 4 KiB); 0 turns every PREFETCH instruction off; N > 0 (at most 1 MiB) makes every
        weight-streaming kernel (mat-vec, gate/up, the batched prefill kernels, all tables and dtypes,
        dense and expert weights) issue PREFETCHT0 N bytes ahead of its reads. Same results bit for
        bit. The kernels read one process-wide mode: the engine sets its own at the start of every
        native call, so two engines stepping at the same moment in different threads may run with
        each other's mode (speed only). `Engine.prefetch` switches it between calls.
        cache_type_k, cache_type_v: the KV cache's row types, "f16" (default) or "q8_0" (llama.cpp's
        `-ctk/-ctv q8_0`: blocks of 32 int8 with an fp16 scale, 53% of the bytes; cflow.runtime.kvcache),
        each on its own. q8_0 changes the logits a little (docs/results/kv_cache_accuracy.md has the measured
        table) and needs head_dim a multiple of 32; decode at long context reads about half the KV bytes.
        """
        from cflow.fileformat import ChecksumError, FormatError, open_model

        opts = EngineOptions.build(options, **overrides)  # checked before a conversion, not after
        t0 = time.perf_counter()
        p = Path(path) if path is not None else DEFAULT_MODEL
        if not p.exists():
            raise ModelNotFoundError(f"model file {p} does not exist; convert one with `cflow convert MODEL.gguf "
                                     f"OUT.cflow` or pass an existing .cflow/.gguf path", flag="-m")
        if p.is_dir():
            raise ModelFormatError(f"{p} is a directory; give a .cflow file (convert a checkpoint directory "
                                   f"with `cflow convert {p} OUT.cflow`)", flag="-m")
        gguf = p if _is_gguf(p) else None
        if gguf is None and p.suffix.lower() == ".gguf":
            raise ModelFormatError(_not_a_gguf(p), flag="-m")
        if gguf is not None:
            p = cls._converted(gguf, progress, log)
        # open mapped: the engine copies what it reads when it does not map (cflow.runtime.pages)
        mapped = True
        try:
            cf = open_model(p, mmap=mapped)
            if opts.verify and not files.is_verified(p):
                cls._verify(cf)
        except FormatError as e:
            if gguf is None:
                if isinstance(e, ChecksumError):
                    raise CorruptModelError(f"{p} is damaged: tensor {e.tensor!r} does not match its checksum. "
                                            f"Re-download or re-convert it (`cflow inspect --verify {p}` checks a "
                                            "file)") from None
                raise ModelFormatError(f"{e} (the engine reads .cflow/.vflow files and .gguf files)") from None
            # A cached conversion this cflow cannot read (another version, or damaged): convert again.
            if log:
                log(f"cached conversion {p} is unusable ({e}); converting again")
            p.unlink(missing_ok=True)
            cf = open_model(cls._converted(gguf, progress, log), mmap=mapped)
        try:
            eng = cls(cf, opts, log=log)
        except BaseException:
            cf.close()
            raise
        eng.load_s = time.perf_counter() - t0
        return eng

    @staticmethod
    def _verify(cf: Any) -> None:
        try:
            cf.verify()
        except BaseException:
            cf.close()
            raise
        files.mark_verified(Path(cf.path))

    @staticmethod
    def _converted(src: Path, progress, log) -> Path:
        key = files.content_key(src)
        dst = files.cached_path(src, key)
        if dst.exists():
            if log:
                log(f"using {dst} (converted from {src.name} earlier)")
            files.touch(dst, src)
            return dst
        from cflow.convert import convert

        if log:
            log(f"converting {src.name} into {dst} (once; later loads reuse it)")
        # the conversion is about as large as the GGUF's weights: make room for that much
        files.make_room(src.stat().st_size, log=log)
        dst.parent.mkdir(parents=True, exist_ok=True)
        convert(src, dst, progress=progress)
        files.mark_verified(dst)  # just written from checksummed data
        files.touch(dst, src)
        return dst

    def close(self) -> None:
        """Free the engine's memory (KV cache, threads) and unmap the file; the Engine is unusable after."""
        self._stop_sweeper()  # it reads the mapping's residency: before the unmap
        self.__dict__.pop("_native", None)
        self.file.close()

    def _stop_sweeper(self) -> None:
        sweeper = self.__dict__.pop("_sweeper", None)
        if sweeper is not None:
            self._readahead.update(sweeper.stats())
            sweeper.stop()

    @property
    def overlap(self) -> bool:
        """attn(l) beside dense(l) on two thread groups (delta_dense >= 1); see Engine.load."""
        return bool(self._native.overlap)

    @overlap.setter
    def overlap(self, on: bool) -> None:
        self._native.overlap = bool(on)

    @property
    def prefetch(self) -> int | None:
        """Software prefetch (PREFETCHT0) of this engine's calls: None (the kernels' default), 0 (off)
        or bytes ahead; see Engine.load. Settable between calls; results do not depend on it."""
        return prefetch_mod.from_mode(self._native.prefetch)

    @prefetch.setter
    def prefetch(self, value: int | None) -> None:
        self._native.prefetch = prefetch_mod.to_mode(value)

    def weights_memory(self) -> dict[str, Any]:
        """Where the weights live (cflow.runtime.pages): placement "copy" or "map", huge_pages (the
        copy was advised MADV_HUGEPAGE), huge_page_bytes (what the kernel backs with 2 MiB pages now;
        None: unknown or mapped), bytes, and the reason for the choice."""
        pl = self.placement
        granted = pages.huge_page_bytes(self._weights) if pl.copy else None
        return {"placement": "copy" if pl.copy else "map", "huge_pages": pl.huge_pages,
                "huge_page_bytes": granted, "bytes": int(self._weights.size), "reason": pl.reason}

    def readahead_stats(self) -> dict[str, Any]:
        """The cold-start choice (cflow.runtime.readahead): mode, file_order (the plan runs in the
        file's order), resident_before (fraction of the mapped weights in the page cache at load;
        None: not asked), and with a sweeper: bytes_advised, bytes_total, waits, seconds, running."""
        sweeper = self.__dict__.get("_sweeper")
        return {**self._readahead, **(sweeper.stats() if sweeper is not None else {})}

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kv = "" if self.cache_type_k == self.cache_type_v == "f16" else \
            f", cache_type_k={self.cache_type_k}, cache_type_v={self.cache_type_v}"
        return (f"Engine({self.path!r}, {self.config.name}, threads={self.threads}, n_ctx={self.n_ctx}{kv}, "
                f"isa={self.isa})")

    # ---- low level ------------------------------------------------------------------------------
    @property
    def _cached(self) -> list[int]:
        """Sequence 0's cached tokens (the single-sequence calls' sequence)."""
        return self._seqs[0]

    def cached(self, seq: int = 0) -> list[int]:
        """The tokens whose K/V sequence `seq` holds at positions 0..n-1 (a copy)."""
        return list(self._seqs[self._seq_index(seq)])

    def reset(self, seq: int | None = None) -> None:
        """Forget a sequence (None: every one): its next call starts at position 0 (the KV cache is
        overwritten)."""
        for i in range(self.n_seq) if seq is None else (self._seq_index(seq),):
            self._seqs[i].clear()

    def truncate(self, n: int, seq: int = 0) -> None:
        """Forget positions n.. of a sequence (speculative decoding's rollback of rejected tokens):
        it then holds its first n tokens, and the next call may start at any position up to n. No
        native work: a call at position p attends to positions 0..p only and overwrites the K/V it
        runs, so the stale rows past n are never read."""
        cached = self._seqs[self._seq_index(seq)]
        if not 0 <= n <= len(cached):
            raise EngineError(f"truncate: sequence {seq} holds {len(cached)} positions, cannot keep {n}")
        if self.config.recurrent and 0 < n < len(cached):
            raise RecurrentStateError(
                f"truncate: {self.config.name} keeps a recurrent (Gated DeltaNet) state per sequence, not a cache "
                f"of positions; it cannot go back from {len(cached)} to {n} positions (speculative decoding, prefix "
                "reuse and rewinds need a model without recurrent layers): reset() the sequence and run it again")
        del cached[n:]

    def _seq_index(self, seq: int) -> int:
        if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)) or not 0 <= seq < self.n_seq:
            raise EngineError(f"sequence {seq!r} does not exist: this engine has {self.n_seq} "
                              f"(0..{self.n_seq - 1}; Engine.load(..., n_seq=N) for more)")
        return int(seq)

    def step(self, token: int, pos: int) -> np.ndarray:
        """Run one token of sequence 0 at position `pos` (0..pos-1 must be in the cache); return the
        logits [V].

        The array is reused by the next call: copy it to keep it."""
        self._check_positions(pos, 1)
        try:
            if self.tuner is None:
                self._native.step(int(token), int(pos), self._logits)
            else:
                n = self.tuner.pick()
                if n != self._native.active_threads:
                    self._native.active_threads = n
                t0 = time.perf_counter()
                self._native.step(int(token), int(pos), self._logits)
                self.tuner.record(n, time.perf_counter() - t0)
        except (OSError, ValueError) as e:
            raise self._failed(e, pos) from None
        del self._cached[pos:]
        self._cached.append(int(token))
        return self._logits

    def step_batch(self, seqs: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """One decode step for B distinct sequences in one pass over the weights: row b runs
        tokens[b] at positions[b] of sequence seqs[b] (its positions 0..positions[b]-1 must be in
        its cache); return the logits [B, V]. Row b is bit for bit what that sequence gives alone
        (step_batch with B = 1, or step/prefill for sequence 0): no row depends on the others.

        The array is reused by the next call: copy what you keep."""
        b = len(seqs)
        if not (b == len(tokens) == len(positions)) or not 1 <= b <= self.n_seq:
            raise EngineError(f"step_batch takes 1..{self.n_seq} (sequence, token, position) triples, got "
                              f"{len(seqs)}, {len(tokens)}, {len(positions)}")
        sq = [self._seq_index(s) for s in seqs]
        if len(set(sq)) != b:
            raise EngineError(f"step_batch: a sequence appears twice in {sq}")
        toks = check_token_ids(tokens, self.config.vocab_size, error=EngineError)
        pos = [int(p) for p in positions]
        for s, p in zip(sq, pos):
            self._check_positions(p, 1, s)
        if self.tuner is not None:  # a batch is prefill-like: the count measured best for decode
            self._native.active_threads = self.tuner.best
        out = self._batch_logits[:b]
        try:
            self._native.step_batch(np.asarray(sq, np.int32), np.asarray(toks, np.int32), np.asarray(pos, np.int32),
                                    out)
        except (OSError, ValueError) as e:
            for s, p in zip(sq, pos):
                del self._seqs[s][p:]
            raise self._failed(e, None) from None
        for s, p, t in zip(sq, pos, toks):
            cached = self._seqs[s]
            del cached[p:]
            cached.append(t)
        return out

    def step_rows(self, seqs: Sequence[int], tokens: Sequence[int], positions: Sequence[int],
                  want: Sequence[bool] | None = None) -> np.ndarray:
        """B rows of any sequences in one pass over the weights (the C core's cf_step_rows): row b
        runs tokens[b] at positions[b] of sequence seqs[b]. A sequence may have several rows (a
        chunk of a prompt riding along with other sequences' decode steps): they come in order at
        consecutive positions, and its positions before its first row must be in its cache.
        Return the logits [W, V] of the W rows with want[b] true (None: every row), in row order;
        rows not wanted skip the lm_head. Every row is bit for bit what step / prefill /
        step_batch give for it.

        The array is reused by the next call: copy what you keep."""
        b = len(seqs)
        flags = [True] * b if want is None else [bool(w) for w in want]
        if not (b == len(tokens) == len(positions) == len(flags)) or b < 1:
            raise EngineError(f"step_rows takes 1 or more (sequence, token, position, want) rows, got "
                              f"{len(seqs)}, {len(tokens)}, {len(positions)}, {len(flags)}")
        sq = [self._seq_index(s) for s in seqs]
        toks = check_token_ids(tokens, self.config.vocab_size, error=EngineError)
        pos = [int(p) for p in positions]
        first: dict[int, tuple[int, int]] = {}  # sequence -> (its first position, its rows)
        for s, p in zip(sq, pos):
            p0, n = first.get(s, (p, 0))
            if p != p0 + n:
                raise EngineError(f"step_rows: the rows of sequence {s} must be at consecutive positions in order; "
                                  f"position {p} follows {p0 + n - 1}")
            first[s] = (p0, n + 1)
        for s, (p0, n) in first.items():
            self._check_positions(p0, n, s)
        n_out = sum(flags)
        if self._rows_logits.shape[0] < n_out:
            self._rows_logits = np.zeros((n_out, self.config.vocab_size), np.float32)
        if self.tuner is not None:  # prefill-like: the count measured best for decode
            self._native.active_threads = self.tuner.best
        out = self._rows_logits[:n_out]
        try:
            self._native.step_rows(np.asarray(sq, np.int32), np.asarray(toks, np.int32), np.asarray(pos, np.int32),
                                   np.asarray(flags, np.uint8), out)
        except (OSError, ValueError) as e:
            for s, (p0, _) in first.items():
                del self._seqs[s][p0:]
            raise self._failed(e, None) from None
        for s, (p0, _) in first.items():
            del self._seqs[s][p0:]
        for s, t in zip(sq, toks):
            self._seqs[s].append(t)
        return out

    def copy_seq(self, src: int, dst: int, n: int | None = None) -> None:
        """Give sequence `dst` the K/V of sequence `src`'s first `n` positions (default: all it
        holds), copied, not recomputed: dst then goes on from position n exactly as if it had run
        those tokens itself (n choices on one prompt, or prompts sharing a prefix, evaluate it once)."""
        s, d = self._seq_index(src), self._seq_index(dst)
        held = len(self._seqs[s])
        n = held if n is None else int(n)
        if not 0 <= n <= held:
            raise EngineError(f"copy_seq: sequence {s} holds {held} positions, cannot copy {n}")
        try:
            self._native.copy_seq(s, d, n)
        except ValueError as e:
            raise EngineError(f"{self.path}: {e}") from None
        if s != d:
            self._seqs[d][:] = self._seqs[s][:n]

    def prefill(self, tokens: Sequence[int] | np.ndarray, pos0: int = 0, seq: int = 0) -> np.ndarray:
        """Run `tokens` at positions pos0.. of sequence `seq` in batches; return the logits after the
        last [V]."""
        s = self._seq_index(seq)
        toks = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64).ravel())
        if toks.size == 0:
            raise EngineError("prefill needs at least one token")
        check_token_ids(toks, self.config.vocab_size, error=EngineError)
        self._check_positions(pos0, toks.size, s)
        if self.tuner is not None:
            self._native.active_threads = self.tuner.best
        try:
            self._native.prefill(toks.astype(np.int32), int(pos0), self._logits, s)
        except (OSError, ValueError) as e:
            raise self._failed(e, pos0, s) from None
        cached = self._seqs[s]
        del cached[pos0:]
        cached.extend(int(t) for t in toks)
        return self._logits

    def _failed(self, e: Exception, pos0: int | None, seq: int = 0) -> EngineError:
        """The error a failed native call raises. The cache keeps positions before pos0 (a call
        writes K/V only at its own positions), so the sequence can go on from there."""
        if pos0 is not None:
            # a recurrent state (Gated DeltaNet) holds no earlier positions: the sequence starts over
            del self._seqs[seq][0 if self.config.recurrent else pos0:]
        if isinstance(e, OSError):  # expert I/O, or the file changed: the message names the file
            return xp.ExpertIOError(str(e))
        return EngineError(f"{self.path}: {e}")

    def _check_positions(self, pos0: int, n: int, seq: int = 0) -> None:
        held = len(self._seqs[seq])
        if pos0 < 0 or pos0 > held:
            where = "" if self.n_seq == 1 else f" of sequence {seq}"
            raise EngineError(f"position {pos0} skips positions the cache{where} does not hold "
                              f"(it holds {held} tokens); call reset() to start over")
        if pos0 + n > self.n_ctx:
            raise ContextOverflowError(f"{pos0 + n} tokens do not fit the context of {self.n_ctx}; "
                                       f"load the model with a larger context (-c / n_ctx, up to "
                                       f"{self.config.max_seq_len})", flag="-c")

    def score(self, tokens: Sequence[int] | str, *, top: int = 0, seq: int = 0, add_bos: bool | None = None,
              start: int = 1) -> Any:
        """Each token's log-probability given the ones before it, from position `start` on (earlier
        ones None), and `top` alternatives per position, run from position 0 of sequence `seq`: a
        cflow.runtime.score.Scores (cflow.runtime.score.score)."""
        from cflow.runtime.score import score

        return score(self, tokens, top=top, seq=seq, add_bos=add_bos, start=start)

    def eval(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits after `tokens`, reusing the cached prefix they share with the previous call."""
        toks = [int(t) for t in tokens]
        if not toks:
            raise EngineError("nothing to evaluate: the prompt is empty")
        keep = common_prefix(self._cached, toks)
        keep = min(keep, len(toks) - 1)  # the last token must run to produce logits
        if self.config.recurrent and keep != len(self._cached):
            keep = 0  # a recurrent state only goes on from where it stopped: anything else starts over
        self.last_timings.reused_tokens = keep
        return self.prefill(toks[keep:], keep)

    def counters(self) -> dict[str, int]:
        """Weight bytes touched by category since reset_counters(), plus kv bytes (the K and V cache
        rows attention read, at the cache types' row sizes: cflow.runtime.kvcache), tokens, calls; with
        experts on disk also disk_bytes (read from the file), cache_hits, cache_misses (experts found
        in / read into the cache) and io_stall_ns (time the step waited for expert bytes); with
        expert speculation speculation_predicted (experts predicted for later layers),
        speculation_hits (those the layer's router then chose), speculation_reads (reads started
        for predictions) and speculation_reads_used (cache misses such a read served; also in
        cache_misses)."""
        return dict(self._native.counters())

    @property
    def expert_cache(self) -> dict[str, Any] | None:
        """With experts on disk: slots, slot_bytes, cache_bytes (<= budget), budget, min_slots,
        layers_in_flight, io ("async" | "sync"), io_threads, read ("O_DIRECT" | "buffered"),
        expert speculation in effect: speculation ("off" | "next-layer" | "N layers"),
        speculation_depth (0: off), speculation_slots (slots it may use), keep_depth; reader,
        reader_note. None when the experts are in RAM."""
        c = self._native.expert_cache
        return None if c is None else dict(c, budget=self.residency.budget)

    def expert_resident(self) -> list[tuple[int, int]]:
        """(layer, expert) of every expert the disk cache holds now ([] in RAM)."""
        return [tuple(k) for k in self._native.expert_resident()]

    def expert_hits(self) -> list[list[int]]:
        """Routing counts [layer][expert] since reset_counters()."""
        return self._native.expert_hits()

    def reset_counters(self) -> None:
        self._native.reset_counters()

    # ---- route traces (cflow.runtime.routes) ------------------------------------------------------
    def record_routes(self, rows: int, depth: int | None = None) -> None:
        """Record the next `rows` routed rows (a decode step is one, a prefill one per token): each
        route's choices and speculation's predictions `depth` layers ahead (default: every later
        layer, at most the engine's deepest speculation). route_trace() returns what is recorded."""
        cfg = self.config
        if not cfg.n_experts:
            raise routes_mod.RouteTraceError("the model routes no experts: there is no route trace to record")
        if rows < 1:
            raise routes_mod.RouteTraceError(f"rows must be at least 1, got {rows}")
        deepest = abi.native_module().SPEC_MAX_DEPTH  # the engine's deepest speculation (engine.h)
        depth = min(cfg.n_layers - 1, deepest) if depth is None else depth
        if not 0 <= depth <= deepest:
            raise routes_mod.RouteTraceError(f"depth must be 0..{deepest}, got {depth}")
        chosen = np.full((rows, cfg.n_layers, cfg.top_k), -1, np.int32)
        pred = np.full((rows, cfg.n_layers, depth, cfg.top_k), -1, np.int32)
        self._native.set_routes(routes_mod.RECORD, chosen, pred)
        self._routes = ("record", chosen, pred)

    def replay_routes(self, trace: routes_mod.RouteTrace) -> None:
        """Route the next calls by `trace` (row after row, from its first; wrapping around) instead of
        the routers' own top-k; speculation predicts from the trace's predictions. Logits change unless
        the trace is this model's own on the same tokens; what is read from disk follows the trace."""
        trace.check_fits(self.config)
        try:
            self._native.set_routes(routes_mod.REPLAY, trace.chosen, trace.pred)
        except ValueError as e:
            raise routes_mod.RouteTraceError(str(e)) from None
        self._routes = ("replay", trace.chosen, trace.pred)

    def route_trace(self, **meta: Any) -> routes_mod.RouteTrace:
        """The rows recorded since record_routes (a copy; recording goes on), with `meta` attached."""
        mode = self._routes
        if not mode or mode[0] != "record":
            raise routes_mod.RouteTraceError("no route trace is being recorded: call record_routes first")
        n = min(self._native.routes_pos, mode[1].shape[0])
        return routes_mod.RouteTrace(mode[1][:n].copy(), mode[2][:n].copy(),
                                     dict(meta, model=self.config.name, rows=n))

    def stop_routes(self) -> None:
        """Route by the routers again and stop recording (route_trace() is no longer available)."""
        self._native.set_routes(0, None, None)
        self._routes = None

    # ---- the final hidden state (multi-token prediction, cflow.runtime.mtp) -------------------------
    @property
    def keep_hidden(self) -> bool:
        """Whether each native call keeps the final normed hidden state (what the lm_head reads) of
        the rows it computes logits for, for hidden(). Off by default; the logits do not depend on it."""
        return bool(self._native.keep_hidden)

    @keep_hidden.setter
    def keep_hidden(self, on: bool) -> None:
        self._native.keep_hidden = bool(on)

    def hidden(self) -> np.ndarray:
        """The final normed hidden states [n, d] of the rows the last call computed logits for, in
        the order of its logits rows (step, prefill: the last row; step_rows: the wanted rows; a
        call of more rows than max_batch: those of its last max_batch rows). Needs keep_hidden.
        The array is reused by the next call: copy what you keep."""
        if not self.keep_hidden:
            raise EngineError("hidden() needs Engine.keep_hidden = True before the call it reads")
        buf = self.__dict__.get("_hidden_buf")
        if buf is None:
            buf = self.__dict__["_hidden_buf"] = np.empty((self._native.max_batch, self.config.d_model), np.float32)
        return buf[:self._native.hidden(buf)]

    @property
    def mtp(self) -> "Any":
        """The model's multi-token prediction heads (cflow.runtime.mtp.MtpHeads; loaded on first use),
        their logits through this engine's lm_head. NoMtpHeadsError when the model has none."""
        heads = self.__dict__.get("_mtp")
        if heads is None:
            from cflow.runtime.mtp import MtpHeads

            heads = self.__dict__["_mtp"] = MtpHeads(self.file, lm_head=self._native.lm_head)
        return heads

    def weight_bytes_per_token(self) -> float:
        """Weight bytes one decode step reads (the file's own tensor sizes through the tensor table,
        cflow.weights.token_bytes; MoE layers count top_k experts of average size)."""
        t = self.file.tensors
        return float(sum(weights.token_bytes(self.config, lambda w: t[w.name].nbytes if w.name in t else 0,
                                             weights.split_qkv_sets(t)).values()))

    def matmul_macs_per_token(self, *, logits: bool = False) -> float:
        """Multiply-adds one token costs in the weight matrices (attention projections, dense FFN,
        router, top_k experts of average size; the lm_head only with `logits`, since prefill
        computes logits for the last token alone). Attention over the KV cache is not included:
        at pp512 on a 1B model it is about 2% of this. Used to report prefill GOP/s."""
        t = self.file.tensors
        elems = lambda w: int(np.prod(w.shape)) if w.name in t and len(w.shape) >= 2 else 0  # noqa: E731
        by = weights.token_bytes(self.config, elems, weights.split_qkv_sets(t))
        return float(sum(by[k] for k in ("attn", "dense", "router", "experts"))
                     + (by["lm_head"] if logits else 0.0))

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], max_tokens: int | None = 128, *,
                 temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 repeat_penalty: float = 1.0, repeat_last_n: int = 64, seed: int | None = None,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 logit_bias: Any = (), stop: Sequence[str] = (), add_bos: bool | None = None,
                 ignore_eos: bool = False, speculative: Any = None, json_schema: Any = None,
                 grammar: str | None = None, regex: str | None = None, constraint: Any = None) -> Iterator[str]:
        """Stream the continuation of `prompt` as text pieces.

        Sampling as cflow.sampling.SamplingParams (logit_bias: {token id: bias} or (id, bias) pairs).
        Stops at an end-of-sequence/end-of-turn token (unless ignore_eos), at a stop string (not
        included in the output), after `max_tokens` (None: until the context is full), or at the
        end of the context. Timings of the run are in `self.last_timings` once it ends.

        speculative (cflow.runtime.speculative; default None, off): "ngram" (prompt lookup), a draft
        Engine with the same vocabulary, or a Speculative with the settings. The output is what
        plain decoding gives: greedy token for token, sampling with the same distribution; the
        timings add the acceptance rate and the mean accepted length.

        Structured output (cflow.constrain, needs llguidance): json_schema (a dict or its JSON
        text; {} for any JSON object), grammar (GBNF as llama.cpp's, or Lark), regex, or a
        ConstraintSpec as `constraint`; at most one. Every token then fits it (the forbidden ones
        are masked before sampling) and generation ends when the constraint is complete.
        ConstraintError when it is malformed."""
        constraint = constraint_spec(json_schema, grammar, regex, constraint)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed,
                                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                logit_bias=logit_bias)
        for _, piece in run(self, prompt, max_tokens, params, stop, add_bos, ignore_eos, speculative, constraint):
            if piece:
                yield piece

    def complete(self, prompt: str | Sequence[int], max_tokens: int | None = 128, **kw: Any) -> Completion:
        """Non-streaming generate(): the whole text, the generated ids, the finish reason, timings
        (the keywords are generate()'s, speculative= included)."""
        stop = kw.pop("stop", ())
        add_bos = kw.pop("add_bos", None)
        ignore_eos = kw.pop("ignore_eos", False)
        speculative = kw.pop("speculative", None)
        constraint = constraint_spec(kw.pop("json_schema", None), kw.pop("grammar", None), kw.pop("regex", None),
                                     kw.pop("constraint", None))
        ids: list[int] = []
        parts: list[str] = []
        for tok, piece in run(self, prompt, max_tokens, SamplingParams(**kw), stop, add_bos, ignore_eos,
                              speculative, constraint):
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

    def chat_tokens(self, messages: list[dict[str, Any]], **template_kw: Any) -> list[int]:
        """The conversation rendered with the file's chat template, generation prompt added;
        `template_kw` reach the template as variables (e.g. tools=)."""
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       **template_kw))

    def encode(self, prompt: str | Sequence[int], add_bos: bool | None = None) -> list[int]:
        """Token ids of a text prompt, or a list of ids checked against the vocabulary."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_bos=add_bos)
        return check_token_ids(prompt, self.config.vocab_size, error=EngineError)
