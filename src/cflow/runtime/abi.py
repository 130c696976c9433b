"""The boundary with the C core: loading `cflow._native`, and encoding what Python hands the engine
(the tensor descriptor table and the op plan) by the names the C core exports.

The C core states each contract once and exports it: `OP_KINDS` and `SOURCES` (the plan's codes),
`GLOBAL_TENSORS` / `LAYER_SLOTS` / `EXPERT_SLOTS` (the order of descriptor rows), `DESC_FIELDS`,
`DTYPE_IDS`. Python never writes those numbers down: it looks every code up by name here, and
passes each descriptor row's tensor name along so that C checks the two sides agree row by row.

The dtype registry (names, GGML ids, block sizes) is stated on both sides, because the file
format needs it without the compiled core (cflow.dtypes): `native_module` compares it with the
core's `DTYPE_TABLE` before handing the core out, and refuses a core that disagrees.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cflow import dtypes
from cflow.runtime.errors import DtypeTableMismatchError, EngineError, NativeMissingError
from cflow.runtime.plan import Plan

_REBUILD = "rebuild it with `pip install -e .` (needs a C compiler and CMake)"


def native_module() -> Any:
    """`cflow._native`, checked to be the engine this Python code speaks to."""
    try:
        from cflow import _native
    except ImportError as e:
        raise NativeMissingError(f"the compiled core cflow._native is not available ({e}); {_REBUILD}") from None
    for attr in ("NativeEngine", "OP_KINDS", "SOURCES", "LAYER_SLOTS", "DESC_FIELDS", "MAX_THREADS", "EXPERT_ALIGN",
                 "DTYPE_TABLE", "SPEC_MAX_DEPTH", "PREFETCH_DEFAULT", "PREFETCH_MAX", "EXPERT_VISIT_SCORE"):
        if not hasattr(_native, attr):
            raise NativeMissingError(f"cflow._native is older than this cflow (it has no {attr}); {_REBUILD}")
    check_dtype_table(_native.DTYPE_TABLE)
    return _native


def check_dtype_table(native_rows: Any, python_rows: Any = None) -> None:
    """Raise DtypeTableMismatchError unless the core's (name, GGML id, block weights, block bytes)
    rows equal cflow.dtypes' (`python_rows`, default `dtypes.native_rows()`), naming each
    difference: a dtype one side lacks, or one whose numbers differ."""
    ours = {r[0]: tuple(r) for r in (dtypes.native_rows() if python_rows is None else python_rows)}
    theirs = {r[0]: tuple(r) for r in native_rows}
    if ours == theirs:
        return
    diffs = [f"{name}: cflow.dtypes has {ours.get(name)}, the compiled core {theirs.get(name)}"
             for name in sorted(ours.keys() | theirs.keys()) if ours.get(name) != theirs.get(name)]
    raise DtypeTableMismatchError("cflow's dtype table and its compiled core's disagree ((name, GGML id, block "
                                  f"weights, block bytes); None: no such dtype): {'; '.join(diffs)}; {_REBUILD}")


def encode_plan(plan: Plan, native: Any) -> np.ndarray:
    """int32 [n_ops, OP_FIELDS]: {kind, layer, a, b, c} with the C core's codes."""
    kinds = {k: i for i, k in enumerate(native.OP_KINDS)}
    rows = []
    for op in plan.ops:
        if op.kind not in kinds:
            raise NativeMissingError(f"the plan has a {op.kind!r} op, which cflow._native does not know; {_REBUILD}")
        if op.src is None:
            rows.append((kinds[op.kind], op.layer, op.a, op.b, op.c))
        else:  # dense / route: a = source code, b = ring slot when the source is the ring
            rows.append((kinds[op.kind], op.layer, native.SOURCES[op.src], op.a, 0))
    return np.ascontiguousarray(np.array(rows, dtype=np.int32).reshape(len(rows), len(rows[0])))


def descriptor_names(cfg: Any, native: Any) -> list[str]:
    """The tensor name of every descriptor row, in the C core's row order."""
    names = list(native.GLOBAL_TENSORS)
    for i in range(cfg.n_unique_layers):
        names += [f"layers.{i}.{s}" for s in native.LAYER_SLOTS]
        for e in range(cfg.n_experts):
            names += [f"layers.{i}.moe.experts.{e}.{s}" for s in native.EXPERT_SLOTS]
    return names


def descriptor(cf: Any, native: Any) -> tuple[np.ndarray, list[str]]:
    """(int64 [n, len(DESC_FIELDS)] rows, their tensor names). A tensor the file lacks has dtype -1."""
    names = descriptor_names(cf.config, native)
    fields = {f: k for k, f in enumerate(native.DESC_FIELDS)}
    desc = np.full((len(names), len(fields)), -1, np.int64)
    for k, name in enumerate(names):
        t = cf.tensors.get(name)
        if t is None:
            continue
        if t.dtype not in native.DTYPE_IDS:
            raise EngineError(f"tensor {name} has dtype {t.dtype!r}, which the engine cannot run "
                              f"(it runs {sorted(native.DTYPE_IDS)})")
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
        row = desc[k]
        row[fields["offset"]], row[fields["dtype"]] = t.offset, native.DTYPE_IDS[t.dtype]
        row[fields["rows"]], row[fields["cols"]] = rows, cols
        row[fields["tile_rows"]], row[fields["tile_cols"]] = tr, tc
    return desc, names
