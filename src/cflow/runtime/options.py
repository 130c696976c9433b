"""EngineOptions: every choice that shapes how a model is loaded and run, in one frozen value.

    opts = EngineOptions(threads=2, n_ctx=512, experts="disk", expert_cache="2G")
    eng = Engine.load("model.cflow", opts)                  # or Engine.load(path, threads=2, ...)
    eng = Engine.load("model.cflow", opts, n_seq=4)         # keywords override fields of `opts`
    opts.replace(prefetch=0)                                # a changed copy, validated again

Owns: the option names, their defaults, and their checks. Each value is checked once, when the
options are made (`__post_init__`), with the runtime's named errors (EngineError, its `flag` the
command-line flag to change), so a bad value fails before a file is opened or converted. A few
spellings are normalised there so that equal choices compare equal whoever made them (the CLI,
the benchmark suite, the server): 0 threads and n_ctx 0 become None ("the default"), an
expert_cache size "2G" becomes its byte count, an expert_speculation depth written as digits
becomes an int, and the on/off switches become bools.

Two options are easy to mix up: `expert_speculation` predicts later layers' experts and starts
their disk reads early (cflow.runtime.experts); `prefetch` is the kernels' software prefetch,
PREFETCHT0 ahead of the weights they stream from memory (cflow.runtime.prefetch). A renamed option
(RENAMED: expert_prefetch, expert_speculation's old name) is still accepted, with a
DeprecationWarning, and sets its new field.

What depends on the model (n_ctx against its max_seq_len, a q8_0 cache against its head_dim,
threads against the C core's limit, experts="disk" for a dense model, an expert cache smaller than
the plan pins) is checked when the engine is built (cflow.runtime.engine, cflow.runtime.experts):
the options alone cannot know it. Callbacks (conversion progress, the log) are not options: they
are passed to Engine.load beside them.

The command line maps its flags to these fields in one place: cflow.cli.common.engine_options.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from dataclasses import InitVar, dataclass
from typing import Any

from cflow.runtime import experts as xp
from cflow.runtime import kvcache
from cflow.runtime import prefetch as prefetch_mod
from cflow.runtime import readahead as readahead_mod
from cflow.runtime.errors import EngineError

DEFAULT_MAX_BATCH = 64  # prefill tokens per native call
# old option name -> its new name: the old keyword is accepted with a DeprecationWarning
RENAMED = {"expert_prefetch": "expert_speculation"}


@dataclass(frozen=True)
class EngineOptions:
    """How to load and run a model; see Engine.load for what each field does."""

    threads: int | None = None  # None (or 0): every usable core, and decode tunes its count
    n_ctx: int | None = None  # positions per sequence; None (or 0): min(max_seq_len, 4096)
    n_seq: int = 1  # sequences (KV-cache slots) step_batch / step_rows advance together
    max_batch: int = DEFAULT_MAX_BATCH  # rows (prefill tokens) one native pass takes
    mmap: bool = True  # False: read the weights into memory instead of mapping the file
    hugepages: bool = True  # weights that fit go into 2 MiB pages instead of the mapping (cflow.runtime.pages)
    verify: bool = True  # check the file's checksums on its first use
    cache_type_k: str = "f16"  # the KV cache's row types (cflow.runtime.kvcache)
    cache_type_v: str = "f16"
    experts: str = "auto"  # "ram" | "disk" | "auto" (cflow.runtime.experts)
    expert_cache: int | None = None  # bytes ("2G" is accepted and stored as bytes); None: what memory leaves
    expert_io: str = "async"  # "async" | "sync"
    expert_delay: bool = True  # async reads: run layer l's experts just before layer l + delta_expert
    # expert speculation: how many layers ahead experts are predicted and read early, in layers or
    # "auto" / "off" / "next-layer" (cflow.runtime.experts)
    expert_speculation: int | str = "auto"
    readahead: str = "auto"  # cold start (cflow.runtime.readahead): "auto" | "off" | "order" | "sweep"
    overlap: bool = False  # attn(l) beside dense(l) on two thread groups (experimental)
    prefetch: int | None = None  # kernels' software prefetch (PREFETCHT0): None default, 0 off, N bytes ahead
    # deprecated: expert_speculation's old name, an init-only keyword that sets it (not a field: it
    # is in no to_dict(), and reading it gives None); replace() and Engine.load take it too
    expert_prefetch: InitVar[int | str | None] = None

    def __post_init__(self, expert_prefetch: int | str | None) -> None:
        if expert_prefetch is not None:
            _warn_renamed("expert_prefetch")
            if self.expert_speculation != "auto":
                raise TypeError(_both_names("expert_prefetch"))
            self._set("expert_speculation", expert_prefetch)
        # the order of the checks is the order Engine.load made them before there were options
        readahead_mod.check_mode(self.readahead)
        prefetch_mod.to_mode(self.prefetch)
        self._set("threads", _threads(self.threads))
        self._set("n_ctx", _n_ctx(self.n_ctx))
        self._set("n_seq", _n_seq(self.n_seq))
        self._set("max_batch", _max_batch(self.max_batch))
        self._set("cache_type_k", kvcache.check_cache_type(self.cache_type_k, "k"))
        self._set("cache_type_v", kvcache.check_cache_type(self.cache_type_v, "v"))
        if self.experts not in xp.MODES:
            raise EngineError(f"experts must be one of {', '.join(xp.MODES)}, got {self.experts!r}", flag="--experts")
        if self.expert_io not in xp.IO_MODES:
            raise EngineError(f"expert_io must be one of {', '.join(xp.IO_MODES)}, got {self.expert_io!r}",
                              flag="--expert-io")
        depth = xp.parse_speculation(self.expert_speculation)  # None: "auto"
        self._set("expert_speculation", "auto" if depth is None else depth)
        self._set("expert_cache", xp.parse_cache(self.expert_cache))
        for name in ("mmap", "hugepages", "verify", "expert_delay", "overlap"):
            self._set(name, bool(getattr(self, name)))

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: only __post_init__ normalises

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes: Any) -> "EngineOptions":
        """A copy with `changes` applied (and checked); TypeError naming an unknown option. A
        renamed option's old name (RENAMED) sets the new one, with a DeprecationWarning."""
        for old, new in RENAMED.items():
            if old in changes:
                _warn_renamed(old)
                if new in changes:
                    raise TypeError(_both_names(old))
                changes[new] = changes.pop(old)
        if not changes:
            return self
        unknown = sorted(set(changes) - set(self.names()))
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(map(repr, unknown))}; the options are "
                            f"{', '.join(self.names())}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every option by name (the keyword arguments Engine.load takes for them)."""
        return {name: getattr(self, name) for name in self.names()}

    @classmethod
    def build(cls, options: "EngineOptions | None" = None, **overrides: Any) -> "EngineOptions":
        """`options` (default: every default) with `overrides` applied: what Engine.load, Engine(),
        the benchmark suite and the server's backends do with what their callers pass."""
        if options is None:
            options = cls()
        elif not isinstance(options, cls):
            raise TypeError(f"options must be an EngineOptions (or None), got {type(options).__name__} "
                            f"{options!r}; pass threads, n_ctx, ... as keywords")
        return options.replace(**overrides)


def _warn_renamed(old: str) -> None:
    warnings.warn(f"{old} is deprecated; use {RENAMED[old]}", DeprecationWarning,
                  stacklevel=_stacklevel_outside_cflow())


def _both_names(old: str) -> str:
    return f"{old} is {RENAMED[old]}'s old name: give {RENAMED[old]} only"


def _stacklevel_outside_cflow() -> int:
    """The stacklevel, for a warnings.warn in the caller, of the first frame outside the cflow
    package: the warning names the user's line whether they made the options or passed the keyword
    to Engine.load (and Python's default filters show a DeprecationWarning only when that line is in
    __main__)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "cflow":
        frame, level = frame.f_back, level + 1
    return level


def _int(name: str, value: Any, flag: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            if isinstance(value, bool) or int(value) != value:
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise EngineError(f"{name} must be a whole number, got {value!r}", flag=flag) from None
    return value


def _threads(value: Any) -> int | None:
    if value is None:
        return None
    n = _int("threads", value, "-t")
    if n < 0:
        raise EngineError(f"threads must be >= 1 (or 0 for every usable core), got {n}", flag="-t")
    # the upper bound is the C core's (MAX_THREADS): checked when the engine is built
    return n or None


def _n_ctx(value: Any) -> int | None:
    if value is None:
        return None
    n = _int("n_ctx", value, "-c")
    if n < 0:
        raise EngineError(f"context size must be >= 1, got {n}", flag="-c")
    return n or None


def _n_seq(value: Any) -> int:
    n = _int("n_seq", value)
    if n < 1:
        raise EngineError(f"n_seq (sequences, KV-cache slots) must be >= 1, got {value}")
    return n


def _max_batch(value: Any) -> int:
    # the C core checks the range (it sizes its scratch by it) and its message names the file
    return _int("max_batch", value)
