"""The KV cache's row types: "f16" (the default) or "q8_0", for K and V independently.

A q8_0 row (one position of one kv head) is head_dim / 32 GGML q8_0 blocks, {fp16 d; int8 qs[32]}:
the bytes of cflow.quant.quantize(row, "q8_0"), and llama.cpp's `-ctk/-ctv q8_0` (its type id 8).
The layout's one definition is cflow.h ("The 8-bit KV cache"); this module names the types, checks
a choice against a model, and sizes a cache (cflow.quant.row_bytes gives a row's bytes for both).
q8_0 stores 1.0625 bytes a value instead of 2, so decode at depth reads about 53% of the KV bytes;
its accuracy cost is measured in benchmarks/kv_cache.py and docs/DESIGN.md ("KV cache").
"""

from __future__ import annotations

from typing import Any

from cflow import quant
from cflow.runtime.errors import EngineError

CACHE_TYPES = ("f16", "q8_0")
FLAGS = {"k": "-ctk", "v": "-ctv"}  # the CLI flags (llama.cpp's names), for error messages


def check_cache_type(name: Any, which: str) -> str:
    """`name` as a cache type for K (which="k") or V ("v"); EngineError listing the choices."""
    if name not in CACHE_TYPES:
        raise EngineError(f"cache_type_{which} {name!r} is not a KV cache type; choose one of "
                          f"{', '.join(CACHE_TYPES)}", flag=FLAGS[which])
    return str(name)


def check_model(config: Any, type_k: str, type_v: str) -> None:
    """A q8_0 cache stores rows in blocks of 32 values: refuse a head_dim that is not a multiple."""
    if getattr(config, "kv_lora_rank", 0) and type_v != type_k:
        raise EngineError(f"this model's cache holds one latent row per token (multi-head latent attention), read "
                          f"as keys and as values: cache_type_k and cache_type_v must agree (got {type_k}, {type_v})",
                          flag=FLAGS["v"])
    mla = getattr(config, "kv_lora_rank", 0)
    width = config.kv_lora_rank + config.qk_rope_dim if mla else config.head_dim
    what = f"latent cache rows are {width} wide" if mla else f"head_dim is {width}"
    if getattr(config, "head_dim_local", 0) and config.head_dim_local % quant.QK:  # Gemma 4's local heads
        width, what = config.head_dim_local, f"local layers' head_dim is {config.head_dim_local}"
    for which, t in (("k", type_k), ("v", type_v)):
        if t == "q8_0" and width % quant.QK:
            raise EngineError(f"cache_type_{which} q8_0 stores rows in blocks of {quant.QK} values, and this "
                              f"model's {what}; use f16", flag=FLAGS[which])


def row_bytes(cache_type: str, head_dim: int) -> int:
    """Bytes of one cache row: cflow.h's cf_kv_row_bytes."""
    return quant.row_bytes(cache_type, head_dim)


def cache_bytes(config: Any, n_ctx: int, type_k: str = "f16", type_v: str = "f16") -> int:
    """Bytes of one sequence's K and V caches at n_ctx positions. Multi-head latent attention
    (config kv_lora_rank > 0) caches one row of kv_lora_rank + qk_rope_dim values per layer and
    position, which serves as key and as value (native/engine_mla.c)."""
    if getattr(config, "kv_lora_rank", 0):
        return config.n_layers * n_ctx * row_bytes(type_k, config.kv_lora_rank + config.qk_rope_dim)
    # per KV-owning layer at its own head size and count (Gemma 4's local / global heads, shared-KV layers)
    has_kv = getattr(config, "layer_has_kv", lambda layer: True)
    hd_of = getattr(config, "layer_head_dim", lambda layer: config.head_dim)
    heads_of = getattr(config, "layer_kv_heads", lambda layer: config.n_kv_heads)
    return sum(heads_of(l) * n_ctx * (row_bytes(type_k, hd_of(l)) + row_bytes(type_v, hd_of(l)))
               for l in range(config.n_layers) if has_kv(l))
