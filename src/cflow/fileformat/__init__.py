"""The `.cflow` / `.vflow` container: write, read, validate, named errors (docs/FORMAT.md).

Owns the byte layout of a model file:

    preamble  24 bytes   magic b"\\x89CFLOW\\r\\n", u32 version, u32 flags (bit 0: vflow order),
                         u64 header length (all little-endian)
    header    JSON       config, tokenizer, quant/tile geometry, tensor table, expert table,
                         metadata; padded with spaces so the data starts on a 4096-byte boundary
    data                 every tensor (and so every expert block) starts on a 4096-byte boundary

`.cflow` orders the data layer by layer; `.vflow` in the order `cflow.dag.schedule(cfg)` runs the
decode step. Either way each expert's tensors are contiguous, so one expert is one aligned read.

Writes are atomic (temp file beside the target, fsync, rename). The reader validates everything
before handing out a byte, and each failure is its own `FormatError` subclass.

The package re-exports every public name (`from cflow.fileformat import ...`); the code is one
module per concern:
    errors    the FormatError hierarchy
    layout    constants, TensorData / TensorEntry / WriteSummary, checksums
    tensors   canonical tensor names and shapes, .cflow / .vflow orders, categories
    writer    write_model
    validate  preamble and header checks
    reader    open_model, CflowFile, read_header, summarize

No torch here: the runtime imports this module.
"""

from cflow.fileformat.errors import (BadMagicError, ChecksumError, DuplicateTensorError, ExpertTableError,
                                      FileTooShortError, FlagsError, FormatError, HeaderDecodeError,
                                      HeaderSchemaError, HeaderTooLargeError, InvalidConfigError,
                                      MisalignedOffsetError, MissingTensorError, MtpHeadsError, OverlapError, ShapeMismatchError,
                                      TensorOutOfBoundsError, TrailingDataError, TruncatedFileError,
                                      UnknownDtypeError, UnknownLayoutError, UnsupportedVersionError)
from cflow.fileformat.layout import (ALIGN, CHECKSUM_ALGO, CHECKSUM_HEX, FLAG_VFLOW, KNOWN_FLAGS, MAGIC,
                                      MAX_HEADER_BYTES, ORDERS, PREAMBLE, VERSION, ProgressFn, TensorData,
                                      TensorEntry, WriteSummary)
from cflow.fileformat.reader import CflowFile, open_model, read_header, summarize
from cflow.fileformat.tensors import (expected_count, expected_shape, expert_of, model_tensors, node_tensors,
                                       schedule_order, tensor_category)
from cflow.fileformat.validate import EXPERT_KEYS, HEADER_KEYS, TENSOR_KEYS
from cflow.fileformat.writer import write_model

__all__ = [
    "FormatError", "FileTooShortError", "BadMagicError", "UnsupportedVersionError", "FlagsError",
    "HeaderTooLargeError", "TruncatedFileError", "TrailingDataError", "HeaderDecodeError", "HeaderSchemaError",
    "InvalidConfigError", "UnknownDtypeError", "UnknownLayoutError", "ShapeMismatchError", "MisalignedOffsetError",
    "TensorOutOfBoundsError", "OverlapError", "DuplicateTensorError", "MissingTensorError", "MtpHeadsError", "ExpertTableError",
    "ChecksumError",
    "MAGIC", "VERSION", "FLAG_VFLOW", "KNOWN_FLAGS", "PREAMBLE", "ALIGN", "MAX_HEADER_BYTES", "ORDERS",
    "CHECKSUM_ALGO", "CHECKSUM_HEX", "ProgressFn", "TensorData", "TensorEntry", "WriteSummary",
    "expected_count", "expected_shape", "expert_of", "model_tensors", "node_tensors", "schedule_order",
    "tensor_category", "HEADER_KEYS", "TENSOR_KEYS", "EXPERT_KEYS",
    "write_model", "CflowFile", "open_model", "read_header", "summarize",
]
