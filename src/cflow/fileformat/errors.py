"""The named errors of the `.cflow` / `.vflow` container: one `FormatError` subclass per way a
file (or a write request) can be wrong, so callers and tests can tell them apart."""

from __future__ import annotations

from cflow.errors import CflowError


class FormatError(CflowError, ValueError):
    """A model file (or a write request) is not a valid cflow container."""


class FileTooShortError(FormatError):
    """The file is shorter than the 24-byte preamble."""


class BadMagicError(FormatError):
    """The file does not start with the cflow magic bytes."""


class UnsupportedVersionError(FormatError):
    """The format version is not one this cflow reads."""


class FlagsError(FormatError):
    """Unknown flag bits are set, or the flags disagree with the header's order."""


class HeaderTooLargeError(FormatError):
    """The declared header length exceeds the cap."""


class TruncatedFileError(FormatError):
    """The file ends before the header or the data it declares."""


class TrailingDataError(FormatError):
    """The file is longer than the header declares."""


class HeaderDecodeError(FormatError):
    """The header is not UTF-8 JSON object text (or repeats a key)."""


class HeaderSchemaError(FormatError):
    """A header key is missing, unknown, or of the wrong type or range."""


class InvalidConfigError(FormatError):
    """The model config in the header is inconsistent."""


class UnknownDtypeError(FormatError):
    """A tensor's dtype is not one cflow knows."""


class UnknownLayoutError(FormatError):
    """A tensor's layout is not one cflow knows."""


class ShapeMismatchError(FormatError):
    """A tensor's byte size disagrees with dtype x shape x layout, or its shape with the config."""


class MisalignedOffsetError(FormatError):
    """A tensor or expert block does not start on a 4096-byte boundary."""


class TensorOutOfBoundsError(FormatError):
    """A tensor or expert block lies (partly) outside the data region."""


class OverlapError(FormatError):
    """Two tensors share bytes."""


class DuplicateTensorError(FormatError):
    """Two tensors have the same name."""


class MtpHeadsError(FormatError):
    """The multi-token prediction heads a file's config declares (mtp_heads) are not exactly the
    `mtp.{j}.*` tensors it carries."""


class MissingTensorError(FormatError, KeyError):
    """A tensor the model needs (or the caller asked for) is not in the file."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ExpertTableError(FormatError):
    """The expert offset table disagrees with the expert tensors."""


class ChecksumError(FormatError):
    """A tensor's bytes (or descriptor) do not match its checksum. `tensor`: its name."""

    def __init__(self, message: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor
