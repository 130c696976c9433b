"""llama.cpp as a baseline, through llama-cpp-python (`pip install cflow-lm[bench]`).

It runs the same GGUF file with the same thread count, driven the same way cflow is driven:
a prompt batch for pp, then one llama_decode call per generated token for tg. The per-token
Python overhead of the binding is a few microseconds, well under 1% of a decode step.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

from cflow.errors import CflowError


class BaselineUnavailable(CflowError):
    """The llama.cpp baseline cannot run here."""


@contextlib.contextmanager
def _quiet_stderr():
    # llama.cpp logs model loading to fd 2 even with verbose=False in some builds.
    fd = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)


def amx_advertised() -> bool:
    """The CPU reports Intel AMX (`amx_tile` in /proc/cpuinfo). On such machines llama.cpp's AMX
    weights buffer, one of its extra buffer types, kills the process at the first mat-mul
    (llama-cpp-python 0.3.36): SIGILL on a Sapphire Rapids VM (a `tilezero` with no tile
    configuration loaded; dense and MoE alike, 2026-12-01), SIGSEGV on a Xeon VM with AMX-FP16
    (Q4_0 and Q4_1, 2026-12-06), there even with the process granted the tile state
    (arch_prctl ARCH_REQ_XCOMP_PERM) first. So llama.cpp runs there with its extra buffer types
    off (REPACK_OFF_REASON)."""
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_tile" in f.read()
    except OSError:
        return False


REPACK_OFF_REASON = ("llama.cpp's AMX path crashes on this CPU (SIGILL or SIGSEGV), so its extra buffer "
                     "types (AMX and the Q4_0 repack) are off, as --no-repack")


def repack_allowed(on: bool) -> bool:
    """Whether llama.cpp may use its extra buffer types: as asked, except where they crash (amx_advertised)."""
    return on and not amx_advertised()


@contextlib.contextmanager
def repacking(llama_cpp, on: bool):
    """llama.cpp repacks Q4_0 weights into an anonymous copy at load (its "extra buffer types").
    Under a memory limit that copy cannot fit, so memory-limited runs turn it off, as llama.cpp's
    `--no-repack` does; the binding has no argument for it, so its default params are wrapped. On a
    CPU whose AMX path crashes they are off whatever `on` says (repack_allowed)."""
    if repack_allowed(on):
        yield
        return
    lib = llama_cpp.llama_cpp
    real = lib.llama_model_default_params

    def params():
        p = real()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params
    try:
        yield
    finally:
        lib.llama_model_default_params = real


class LlamaCppRunner:
    """pp/tg runner over llama-cpp-python with the same interface as the cflow runner."""

    name = "llama.cpp"

    # cflow's KV cache types as GGML type ids (llama.cpp's -ctk/-ctv; llama_cpp.GGML_TYPE_F16 / _Q8_0)
    CACHE_TYPE_IDS = {"f16": 1, "q8_0": 8}

    def __init__(self, gguf_path: str, threads: int, n_ctx: int, *, repack: bool = True, cache_type_k: str = "f16",
                 cache_type_v: str = "f16", flash_attn: bool | None = None):
        """cache_type_k / cache_type_v: the KV cache types (cflow.runtime.kvcache's names). flash_attn:
        llama.cpp's flash attention; None (default) turns it on exactly when the cache is quantized
        (llama.cpp needs it for a quantized V cache) and leaves it off otherwise, as before."""
        try:
            import llama_cpp
        except ImportError:
            raise BaselineUnavailable(
                "llama-cpp-python is not installed; install the baseline with "
                "`pip install 'cflow-lm[bench]'` (it compiles llama.cpp, a few minutes)") from None
        if not str(gguf_path).endswith(".gguf"):
            raise BaselineUnavailable(
                f"--compare llama.cpp needs the model as a .gguf file (got {gguf_path}); pass the GGUF "
                "and cflow converts it for its own side")
        self._llama_cpp = llama_cpp
        for name in (cache_type_k, cache_type_v):
            if name not in self.CACHE_TYPE_IDS:
                raise BaselineUnavailable(f"KV cache type {name!r}: choose one of {', '.join(self.CACHE_TYPE_IDS)}")
        if flash_attn is None:
            flash_attn = (cache_type_k, cache_type_v) != ("f16", "f16")
        self.flash_attn = bool(flash_attn)
        with _quiet_stderr(), repacking(llama_cpp, repack):
            self.llm = llama_cpp.Llama(model_path=str(gguf_path), n_threads=threads, n_threads_batch=threads,
                                       n_ctx=n_ctx, n_batch=512, n_ubatch=512, verbose=False,
                                       logits_all=False, flash_attn=self.flash_attn,
                                       type_k=self.CACHE_TYPE_IDS[cache_type_k],
                                       type_v=self.CACHE_TYPE_IDS[cache_type_v])
        self.repack = repack_allowed(repack)
        self.version = getattr(llama_cpp, "__version__", "?")
        self.n_vocab = self.llm.n_vocab()

    def _decode(self, tokens: np.ndarray, pos0: int) -> None:
        lib = self._llama_cpp
        n = len(tokens)
        batch = lib.llama_batch_init(n, 0, 1)
        try:
            batch.n_tokens = n
            for i, t in enumerate(tokens):
                batch.token[i] = int(t)
                batch.pos[i] = pos0 + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i == n - 1
            rc = lib.llama_decode(self.llm.ctx, batch)
            if rc != 0:
                raise CflowError(f"llama_decode failed with code {rc}")
        finally:
            lib.llama_batch_free(batch)

    def reset(self) -> None:
        lib = self._llama_cpp
        mem = lib.llama_get_memory(self.llm.ctx)
        lib.llama_memory_clear(mem, True)

    def prefill(self, tokens: np.ndarray, pos0: int = 0) -> None:
        for start in range(0, len(tokens), 512):
            self._decode(tokens[start:start + 512], pos0 + start)

    def step(self, token: int, pos: int) -> int:
        self._decode(np.array([token]), pos)
        logits = self._llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        row = np.ctypeslib.as_array(logits, shape=(self.n_vocab,))
        return int(row.argmax())

    def close(self) -> None:
        self.llm.close() if hasattr(self.llm, "close") else None
