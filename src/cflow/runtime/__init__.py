"""The runtime: run a converted model on the C core. No torch here.

    engine     Engine: load (verify, GGUF cache), prefill, step, counters
    options    EngineOptions: every load/run option, its default and its checks, in one frozen value
    generate   the generation loop, stop strings, Timings, Completion
    speculative  speculative decoding: n-gram lookup and draft-model proposers, the acceptance rule
    score      scoring text: every token's logprob given the ones before it (Engine.score)
    plan       the per-token op plan (the delay semantics on the runtime side)
    abi        the boundary with cflow._native: descriptor and plan encoded by name
    threads    usable cores, thread-count checks, the decode thread tuner
    experts    where a MoE model's experts live (RAM or disk with a byte budget) and why, and
               expert speculation (later layers' experts predicted and read from disk early)
    pages      where the weights live: the file's mapping, or a copy in 2 MiB pages (hugepages=)
    prefetch   the kernels' software prefetch (PREFETCHT0) modes (Engine.load(prefetch=...), claim C6)
    files      the GGUF conversion cache and checksum verdicts on disk
    errors     the runtime's named errors
"""

from cflow.runtime.engine import DEFAULT_MODEL, Engine
from cflow.runtime.errors import (ContextOverflowError, CorruptModelError, EngineError, ModelFormatError,
                                  ModelNotFoundError, NativeMissingError)
from cflow.runtime.experts import ExpertIOError
from cflow.runtime.generate import Completion, Timings
from cflow.runtime.options import EngineOptions
from cflow.runtime.speculative import DraftVocabularyError, Speculative, SpeculativeError
from cflow.runtime.threads import usable_threads

__all__ = ["Engine", "EngineOptions", "DEFAULT_MODEL", "Completion", "Timings", "usable_threads", "EngineError", "ModelNotFoundError",
           "ModelFormatError", "ContextOverflowError", "CorruptModelError", "NativeMissingError", "ExpertIOError",
           "Speculative", "SpeculativeError", "DraftVocabularyError"]
