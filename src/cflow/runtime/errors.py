"""The runtime's named errors. Each says what is wrong and what to do; `flag` names the command-line
flag a user would change to fix it (the CLI shows it; library users can ignore it)."""

from __future__ import annotations

from cflow.errors import CflowError


class EngineError(CflowError, ValueError):
    """The engine cannot run this model or this request."""

    def __init__(self, message: str, *, flag: str | None = None) -> None:
        super().__init__(message)
        self.flag = flag  # e.g. "-t", "-c": the CLI flag behind a bad value, when there is one


class ModelNotFoundError(EngineError, FileNotFoundError):
    """The model path does not exist."""


class ModelFormatError(EngineError):
    """The file is not a model the engine can load (neither .cflow/.vflow nor .gguf)."""


class ContextOverflowError(EngineError):
    """The prompt (plus what must be generated) does not fit the engine's context."""


class RecurrentStateError(EngineError):
    """A sequence of a model with recurrent layers (Qwen3.5's Gated DeltaNet) was asked to go back
    or skip positions: its state holds only the latest one, so it must start over instead."""


class CorruptModelError(EngineError):
    """The model's bytes are damaged: a checksum does not match, or the model computes non-finite
    logits (what damaged weights do)."""


class NativeMissingError(EngineError, ImportError):
    """The compiled core (cflow._native) is not built, or was built from another cflow."""


class DtypeTableMismatchError(NativeMissingError):
    """The compiled core's dtype table (ids, block sizes) differs from cflow.dtypes: the two were
    built from different sources, and running would misread every tensor of the differing dtypes."""
