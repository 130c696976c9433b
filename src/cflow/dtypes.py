"""The dtype registry: every format a `.cflow` tensor may be stored in, one row each (its name, GGML
type id, block geometry and the fields of one block).

The one statement of these numbers in Python: cflow.quant and cflow.kquant derive their ids,
sizes and block layouts from `TABLE`, and the file format, the converters and the DAG reach them
through those modules. The C core states the same table in C (native/cflow.h `enum cf_dtype`,
formats.c `cf_dtype_names` and `cf_block_bytes`, cflow.h `cf_block_weights`) and exports it as
`cflow._native.DTYPE_TABLE`; cflow.runtime.abi compares that export with `native_rows()` when it
loads the compiled core and refuses a core that disagrees (DtypeTableMismatchError). The table
lives here rather than being read from the compiled core because writing and validating files
must work without it.

Pure Python, no numpy: anything may import it.
"""

from __future__ import annotations

from dataclasses import dataclass

QK = 32  # weights per block of the 32-block formats (and per activation block); C: CF_QK
QK_K = 256  # weights per super-block of the K-quants; C: CF_QK_K


@dataclass(frozen=True)
class Dtype:
    """One storage format. A block is `block_weights` consecutive weights of a row stored in
    `block_bytes` bytes; f32 / f16 count as 32-value "blocks" of one field, so that plain
    matrices tile by the same rule as quantized ones (docs/DESIGN.md "Tile layout")."""

    name: str
    ggml_id: int  # GGML's type id (gguf.GGMLQuantizationType), also C's enum cf_dtype
    block_weights: int
    block_bytes: int
    fields: tuple[tuple[str, int, int], ...]  # (field, offset, bytes) of one block, in GGML byte order
    plain: bool = False  # f32 / f16: values, no scales
    produced: bool = True  # cflow writes it (quantize, to_plain); False: only copied from GGUF files as they are

    @property
    def field_widths(self) -> tuple[int, ...]:
        return tuple(n for _, _, n in self.fields)


# Ordered as cflow lists them to users: what it writes, then what it only copies.
TABLE: tuple[Dtype, ...] = (
    Dtype("f32", 0, QK, 128, (("values", 0, 128),), plain=True),
    Dtype("f16", 1, QK, 64, (("values", 0, 64),), plain=True),
    Dtype("q4_0", 2, QK, 18, (("d", 0, 2), ("qs", 2, 16))),
    Dtype("q4_1", 3, QK, 20, (("d", 0, 2), ("m", 2, 2), ("qs", 4, 16))),
    Dtype("q8_0", 8, QK, 34, (("d", 0, 2), ("qs", 2, 32))),
    # The K-quants and the 32-block Q5_0 / Q5_1 llama.cpp writes beside them: run as GGUF files
    # store them, never produced (layouts and tiling: cflow.kquant, docs/kquants.md).
    Dtype("q5_0", 6, QK, 22, (("d", 0, 2), ("qh", 2, 4), ("qs", 6, 16)), produced=False),
    Dtype("q5_1", 7, QK, 24, (("d", 0, 2), ("m", 2, 2), ("qh", 4, 4), ("qs", 8, 16)), produced=False),
    Dtype("q4_k", 12, QK_K, 144, (("d", 0, 2), ("dmin", 2, 2), ("scales", 4, 12), ("qs", 16, 128)), produced=False),
    Dtype("q5_k", 13, QK_K, 176, (("d", 0, 2), ("dmin", 2, 2), ("scales", 4, 12), ("qh", 16, 32), ("qs", 48, 128)),
          produced=False),
    Dtype("q6_k", 14, QK_K, 210, (("ql", 0, 128), ("qh", 128, 64), ("scales", 192, 16), ("d", 208, 2)),
          produced=False),
    # OCP MXFP4 as ggml stores it (gpt-oss's experts): one E8M0 exponent byte, then 16 bytes of
    # E2M1 nibbles in Q4_0's order (byte j: weight j low, weight j + 16 high). Copied, never produced.
    Dtype("mxfp4", 39, QK, 17, (("e", 0, 1), ("qs", 1, 16)), produced=False),
)
BY_NAME: dict[str, Dtype] = {d.name: d for d in TABLE}


def native_rows(table: tuple[Dtype, ...] = TABLE) -> tuple[tuple[str, int, int, int], ...]:
    """The table as the C core exports it (`_native.DTYPE_TABLE`): (name, GGML id, block weights,
    block bytes) per dtype, by id. C has no field table (its kernels spell the offsets out, and the
    kernel tests hold them against this module's decoders), so fields are not compared."""
    return tuple((d.name, d.ggml_id, d.block_weights, d.block_bytes) for d in sorted(table, key=lambda d: d.ggml_id))
