"""The contracts between Python and the C engine, as the compiled core exports them.

Each contract (op kinds, plan sources, descriptor fields and row order, tensor names, dtype ids,
counter names) is one enum with one name table beside it in native/engine.h / engine_build.c (dtypes:
cflow.h / formats.c); cflow._native exports the tables and Python looks codes up by name. These
tests pin the exported names, hold them against the enums' counts, against cflow.quant (and
cflow.kquant for the K-quant dtypes) and the .cflow tensor names (cflow.fileformat.model_tensors),
and check that NativeEngine refuses a descriptor whose rows are named otherwise than the engine
expects, even when every shape fits. What Python states for the file format, which must work
without the compiled core (cflow.dtypes' table, cflow.weights' tensor names, the file's alignment
and a tile's row group), is held equal to the core's; a wrong dtype table is refused by name; and
the core's limits are read from it where they are used, with no copy left in Python.
"""

from __future__ import annotations

import numpy as np
import pytest

from cflow import _native, dtypes, weights
from cflow import kquant as K
from cflow import quant as Q
from cflow.config import ModelConfig
from cflow.fileformat import model_tensors
from cflow.runtime import abi
from cflow.runtime.errors import DtypeTableMismatchError, NativeMissingError

EXPECTED = {
    "OP_KINDS": ("embed", "attn", "dense", "route", "experts", "resid", "final", "ple"),
    "DESC_FIELDS": ("offset", "dtype", "rows", "cols", "tile_rows", "tile_cols"),
    "GLOBAL_TENSORS": ("tok_emb", "norm", "lm_head", "ple_emb", "ple_proj", "ple_norm"),
    "LAYER_SLOTS": ("attn_norm", "attn.wqkv", "attn.wo", "ffn_norm", "ffn.w_gate_up", "ffn.w_down", "moe_norm",
                    "moe.router", "attn.qkv_bias", "attn.q_norm", "attn.k_norm", "attn.wq", "attn.wk", "attn.wv",
                    "moe.shared_gate", "moe.shared.w_gate_up", "moe.shared.w_down", "attn_post_norm", "ffn_post_norm",
                    "attn.wq_a", "attn.q_a_norm", "attn.wq_b", "attn.wkv_a", "attn.kv_a_norm", "attn.wk_b", "attn.wv_b",
                    "moe.router_bias", "attn.wo_bias", "attn.sinks", "ple.w_gate", "ple.w_proj", "ple_post_norm",
                    "out_scale", "moe.router_norm", "moe.expert_scale", "ffn_post_norm_1", "moe_post_norm",
                    "attn.w_gate", "ssm.w_qkv", "ssm.w_z", "ssm.w_alpha", "ssm.w_beta", "ssm.conv", "ssm.dt_bias",
                    "ssm.a", "ssm.norm", "ssm.w_out"),
    "EXPERT_SLOTS": ("w_gate_up", "w_down", "b_gate_up", "b_down"),
    "COUNTER_NAMES": ("attn", "dense", "router", "experts", "embed", "lm_head", "kv", "tokens", "calls",
                      "disk_bytes", "cache_hits", "cache_misses", "io_stall_ns",
                      "speculation_predicted", "speculation_hits", "speculation_reads", "speculation_reads_used"),
    "IO_FAULTS": ("none", "eio", "short"),
    "EXPERT_READERS": ("auto", "threads", "uring-refused", "inline"),
    "PROFILE_KINDS": ("setup", "embed", "norm", "attn.qkv", "attn.cache", "attn.wo", "dense.gate_up", "dense.down",
                      "route", "experts.gate_up", "experts.down", "experts.io", "resid", "lm_head", "wait"),
}
# export -> the C enum count it must have as many entries as
ENUM_OF = {"OP_KINDS": "CF_OP_KINDS", "SOURCES": "CF_SRC_KINDS", "DESC_FIELDS": "CF_DESC_FIELDS",
           "GLOBAL_TENSORS": "CF_T_GLOBAL", "LAYER_SLOTS": "CF_SLOTS_PER_SET", "EXPERT_SLOTS": "CF_EXPERT_SLOTS",
           "COUNTER_NAMES": "CF_COUNTERS", "IO_FAULTS": "CF_XFAULT_KINDS",
           "EXPERT_READERS": "CF_XREADER_KINDS",
           "PROFILE_KINDS": "CF_PROF_KINDS"}
TILE = (16, 32)  # small tiles: several bands and tiles even in this tiny model


# ---- the exported names ----------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_name_tables(name):
    got = getattr(_native, name)
    assert isinstance(got, tuple) and got == EXPECTED[name]


def test_codes():
    assert _native.SOURCES == {"h": 0, "ring": 1, "hf": 2}
    assert _native.OP_FIELDS == 5 and isinstance(_native.OP_FIELDS, int)
    assert _native.MAX_THREADS == 512


def test_tables_match_the_enum_counts():
    counts = _native.ENUM_COUNTS
    for export, enum in ENUM_OF.items():
        assert len(getattr(_native, export)) == counts[enum], export
    assert sorted(_native.SOURCES.values()) == list(range(counts["CF_SRC_KINDS"]))
    assert max(_native.DTYPE_IDS.values()) < counts["CF_DTYPE_IDS"]


def test_dtype_ids_are_cflow_quants():
    # the 32-block dtypes (cflow.quant) and the K-quant files' (cflow.kquant, docs/kquants.md)
    ids = {**Q.DTYPE_IDS, **K.KDTYPE_IDS}
    assert _native.DTYPE_IDS == ids
    assert _native.DTYPES == tuple(sorted(ids, key=ids.get))


# ---- the Python statements the file format keeps, held against the C core's -------------------
def test_dtype_table_is_the_c_cores():
    """cflow.dtypes (what cflow.quant and cflow.kquant read) row for row as the core sizes tensors."""
    assert _native.DTYPE_TABLE == dtypes.native_rows()
    assert [row[:2] for row in _native.DTYPE_TABLE] == sorted(_native.DTYPE_IDS.items(), key=lambda kv: kv[1])
    abi.check_dtype_table(_native.DTYPE_TABLE)  # what native_module() runs before handing the core out
    for name, dtype_id, block_weights, _ in _native.DTYPE_TABLE:
        shape = (3, 2 * block_weights)
        assert _native.tiled_bytes(dtype_id, *shape) == Q.tensor_nbytes(name, shape), name


def wrong_tables() -> dict[str, tuple[list, str]]:
    """Copies of the Python table, each wrong in one way, and the difference the error must name."""
    rows = list(dtypes.native_rows())
    swap = lambda name, row: [row if r[0] == name else r for r in rows]  # noqa: E731
    return {
        "resized": (swap("q4_k", ("q4_k", 12, 256, 145)),
                    "q4_k: cflow.dtypes has ('q4_k', 12, 256, 145), the compiled core ('q4_k', 12, 256, 144)"),
        "renumbered": (swap("q8_0", ("q8_0", 9, 32, 34)),
                       "q8_0: cflow.dtypes has ('q8_0', 9, 32, 34), the compiled core ('q8_0', 8, 32, 34)"),
        "missing": (rows[:-1], f"{rows[-1][0]}: cflow.dtypes has None, the compiled core {rows[-1]}"),
        "extra": (rows + [("q2_k", 10, 256, 84)],
                  "q2_k: cflow.dtypes has ('q2_k', 10, 256, 84), the compiled core None"),
    }


@pytest.mark.parametrize("case", sorted(wrong_tables()))
def test_a_wrong_dtype_table_is_refused(case):
    python_rows, difference = wrong_tables()[case]
    with pytest.raises(DtypeTableMismatchError) as e:
        abi.check_dtype_table(_native.DTYPE_TABLE, python_rows)
    assert difference in str(e.value) and "pip install -e ." in str(e.value)
    assert isinstance(e.value, NativeMissingError)  # callers that catch a stale core catch this too


def test_a_core_with_another_dtype_table_is_not_handed_out(monkeypatch):
    abi.native_module()
    monkeypatch.setattr(_native, "DTYPE_TABLE", wrong_tables()["resized"][0])
    with pytest.raises(DtypeTableMismatchError, match="q4_k: "):
        abi.native_module()


def test_tensor_names_are_the_c_cores():
    """The file format's names (cflow.weights) are the descriptor's: the same set of slots, in file
    order on one side and in the core's row order on the other (bound by name, so orders may differ)."""
    assert weights.GLOBAL_NAMES == _native.GLOBAL_TENSORS
    assert weights.EXPERT_SLOTS == _native.EXPERT_SLOTS
    ours = weights.LAYER_SLOTS + weights.QKV_PARTS + weights.MLA_SLOTS + weights.SSM_SLOTS
    assert sorted(ours) == sorted(_native.LAYER_SLOTS)
    assert len(set(ours)) == len(_native.LAYER_SLOTS)


def test_layer_slots_are_the_file_order():
    cfg = tiny_config(False).replace(qkv_bias=True, qk_norm=True, d_shared_expert=32)
    slots = [w.slot for w in weights.layer_weights(cfg, 0) if w.expert is None]
    post = ("attn_post_norm", "ffn_post_norm")  # Gemma's post-norms exist in dense models only
    # gpt-oss's (DeepSeek's router bias too), and Gemma 4's per-layer block (tests/test_gemma4_engine.py)
    gptoss = ("attn.wo_bias", "attn.sinks", "moe.router_bias", "ple.w_gate", "ple.w_proj", "ple_post_norm",
              "out_scale", "moe.router_norm", "moe.expert_scale", "ffn_post_norm_1", "moe_post_norm")
    qwen35 = ("attn.w_gate",)  # Qwen3.5's attention output gate
    assert slots == [s for s in weights.LAYER_SLOTS if s not in post + gptoss + qwen35]
    oss = tiny_config(False).replace(qkv_bias=True, attn_sinks=True, attn_out_bias=True, moe_bias=True)
    slots = [w.slot for w in weights.layer_weights(oss, 0) if w.expert is None]
    assert slots == ["attn_norm", "attn.wqkv", "attn.qkv_bias", "attn.wo", "attn.wo_bias", "attn.sinks", "ffn_norm",
                     "ffn.w_gate_up", "ffn.w_down", "moe_norm", "moe.router", "moe.router_bias"]
    assert [w.slot.rsplit(".", 1)[1] for w in weights.layer_weights(oss, 0) if w.expert == 1] == list(
        weights.EXPERT_SLOTS)
    dense = cfg.replace(n_experts=0, top_k=0, d_expert=0, d_shared_expert=0, delta_dense=0, moe_input="post_dense",
                        post_norms=True)
    slots = [w.slot for w in weights.layer_weights(dense, 0)]
    assert slots == [s for s in weights.LAYER_SLOTS if not s.startswith("moe") and s not in gptoss + qwen35]
    by_parts = [w.slot for w in weights.layer_weights(cfg, 0, split_qkv=True) if w.expert is None]
    k = weights.LAYER_SLOTS.index("attn.wqkv")
    assert by_parts == [s for s in (*weights.LAYER_SLOTS[:k], *weights.QKV_PARTS, *weights.LAYER_SLOTS[k + 1:])
                        if s not in post + gptoss + qwen35]


def test_file_format_constants_equal_the_c_cores():
    """Constants the file format keeps for itself (it must work without the compiled core)."""
    from cflow.fileformat.layout import ALIGN

    assert Q.G == _native.ROW_GROUP  # a tile's row group: the file's "quant.group", the kernels' CF_G
    assert ALIGN == _native.EXPERT_ALIGN  # O_DIRECT reads of expert spans need the file's alignment


def test_limits_are_asked_of_the_c_core(monkeypatch):
    """No Python copy of the core's limits is left: each is read from _native where it is used."""
    import cachesim  # tests/cachesim.py: the policy replayed
    from cflow.runtime import experts as xp
    from cflow.runtime import prefetch as P

    for module, copy in ((xp, "SPEC_MAX_DEPTH"), (P, "MAX_BYTES"), (P, "DEFAULT"), (cachesim, "VISIT_SCORE")):
        assert not hasattr(module, copy), f"{module.__name__}.{copy}"
    sizes = xp.ModelSizes(file_bytes=1 << 30, expert_bytes=1 << 29, slot_bytes=4096, n_keys=64, top_k=2, inflight=1,
                          kv_bytes=0, delta_expert=1, n_layers=48)
    monkeypatch.setattr(_native, "SPEC_MAX_DEPTH", 3)
    assert xp.decide(sizes, experts="disk", expert_cache=1 << 20, expert_speculation=20).speculation_depth == 3
    monkeypatch.setattr(_native, "PREFETCH_MAX", 4096)
    monkeypatch.setattr(_native, "PREFETCH_DEFAULT", -7)
    assert (P.to_mode(None), P.to_mode(4096), P.from_mode(-7), P.label(-7)) == (-7, 4096, None, "default")
    with pytest.raises(ValueError, match=r"1\.\.4096 bytes"):
        P.to_mode(4097)
    # the cache replay's scores (two layers, each on its own clock, where the core's policy keeps an
    # expert LRU evicts): with a routing worth nothing, "lrfu" is left with its ties, broken by recency
    trace = [[[0], [0]], [[2], [0]], [[0], [1]], [[2], [0]]]  # [step][layer] -> experts
    hits = {p: cachesim.simulate(trace, 3, p, n_experts=3, n_unique=2).hits for p in ("lrfu", "lru")}
    assert hits == {"lrfu": 3, "lru": 2}
    monkeypatch.setattr(_native, "EXPERT_VISIT_SCORE", 0)
    assert cachesim.simulate(trace, 3, "lrfu", n_experts=3, n_unique=2).hits == hits["lru"]


# ---- a tiny engine built straight from the exported names -----------------------------------
def tiny_config(tied: bool) -> ModelConfig:
    return ModelConfig.from_name("arch2", vocab_size=50, d_model=64, n_layers=3, n_heads=2, n_kv_heads=1,
                                 d_ff=64, n_experts=3, top_k=2, d_expert=32, n_unique_layers=2, max_seq_len=32,
                                 tie_embeddings=tied)


def row_names(cfg: ModelConfig) -> list[str]:
    """Descriptor row names by the rule the exports state: globals, then per weight set its slots,
    then per expert the expert slots."""
    names = [*_native.GLOBAL_TENSORS]
    for i in range(cfg.n_unique_layers):
        names += [f"layers.{i}.{s}" for s in _native.LAYER_SLOTS]
        for e in range(cfg.n_experts):
            names += [f"layers.{i}.moe.experts.{e}.{s}" for s in _native.EXPERT_SLOTS]
    return names


def build_weights(cfg: ModelConfig):
    """(buffer, desc, row names) for random weights: norms and routers f32 rows, matrices q8_0 tiled."""
    F = {f: k for k, f in enumerate(_native.DESC_FIELDS)}
    shapes = model_tensors(cfg)
    names = row_names(cfg)
    rng = np.random.default_rng(0)
    desc = np.full((len(names), len(F)), -1, np.int64)
    chunks, offset = [], 0
    for k, name in enumerate(names):
        if name not in shapes:
            continue  # lm_head of a tied model: the row stays, dtype -1
        rows, cols = (1, shapes[name][0]) if len(shapes[name]) == 1 else shapes[name]
        w = rng.standard_normal((rows, cols), dtype=np.float32) * 0.2
        if name.endswith(("norm", "router", "bias")):
            w += name.endswith("norm")  # norm weights near 1
            data, dtype, tile = w.view(np.uint8).reshape(-1), "f32", (0, 0)
        else:
            data, dtype, tile = Q.quantize_tiled(w, "q8_0", TILE), "q8_0", TILE
        row = desc[k]
        row[F["offset"]], row[F["dtype"]], row[F["rows"]], row[F["cols"]] = offset, _native.DTYPE_IDS[dtype], rows, cols
        row[F["tile_rows"]], row[F["tile_cols"]] = tile
        pad = -len(data) % 64
        chunks += [data, np.zeros(pad, np.uint8)]
        offset += len(data) + pad
    return np.concatenate(chunks), desc, names


def plan_for(cfg: ModelConfig) -> np.ndarray:
    """A valid plan (not any preset's delays): per layer attention, dense FFN, router on h + f,
    experts into pending slot 0, residual update; encoded with the exported codes."""
    K, S = {k: i for i, k in enumerate(_native.OP_KINDS)}, _native.SOURCES
    ops = [(K["embed"], 0, 0, 0, 0)]
    for l in range(cfg.n_layers):
        ops += [(K["attn"], l, 0, 0, 0), (K["dense"], l, S["h"], 0, 0), (K["route"], l, S["hf"], 0, 0),
                (K["experts"], l, 0, 0, 0), (K["resid"], l, 0, 1, 0)]
    ops.append((K["final"], 0, 0, -1, 0))
    return np.array(ops, np.int32).reshape(-1, _native.OP_FIELDS)


def make_engine(cfg: ModelConfig, buf, desc, names, threads: int = 2):
    return _native.NativeEngine(buf, cfg.to_dict(), desc, names, plan_for(cfg), 1, 1, threads, 16, 4)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("options", [False, True])
def test_row_names_are_the_file_formats(tied, options):
    """Every tensor a .cflow file of the config holds has its descriptor row, under its name (q|k|v
    fused, or stored by parts); the rows left over are exactly those of what the config turns off
    (tied lm_head, attention options, the shared expert; Gemma's post-norms, which MoE models lack;
    DeepSeek's latent attention and router bias, tests/test_deepseek2.py)."""
    cfg = tiny_config(tied).replace(qkv_bias=options, qk_norm=options, d_shared_expert=32 if options else 0)
    names = row_names(cfg)
    assert len(names) == len(set(names))
    unused = {"lm_head"} if tied else set()
    unused |= {"ple_emb", "ple_proj", "ple_norm"}  # Gemma 4's (tests/test_gemma4_engine.py)
    unused |= {f"layers.{i}.{s}" for i in range(cfg.n_unique_layers)
               for s in ("attn_post_norm", "ffn_post_norm", "moe.router_bias", "ple.w_gate", "ple.w_proj",
                         "ple_post_norm", "out_scale", "moe.router_norm", "moe.expert_scale", "ffn_post_norm_1",
                         "moe_post_norm") + weights.MLA_SLOTS}
    # gpt-oss's tensors, which these configs do not turn on (test_gptoss_engine runs them)
    unused |= {f"layers.{i}.{s}" for i in range(cfg.n_unique_layers) for s in ("attn.wo_bias", "attn.sinks")}
    # Qwen3.5's output gate and Gated DeltaNet tensors (tests/test_qwen35_engine.py runs them)
    unused |= {f"layers.{i}.{s}" for i in range(cfg.n_unique_layers) for s in ("attn.w_gate",) + weights.SSM_SLOTS}
    unused |= {f"layers.{i}.moe.experts.{e}.{s}" for i in range(cfg.n_unique_layers) for e in range(cfg.n_experts)
               for s in ("b_gate_up", "b_down")}
    if not options:
        unused |= {f"layers.{i}.{s}" for i in range(cfg.n_unique_layers)
                   for s in ("attn.qkv_bias", "attn.q_norm", "attn.k_norm", "moe.shared_gate", "moe.shared.w_gate_up",
                             "moe.shared.w_down")}
    sets = range(cfg.n_unique_layers)
    assert set(model_tensors(cfg)) | set(model_tensors(cfg, split_qkv=sets)) == set(names) - unused


@pytest.mark.parametrize("tied", [True, False])
def test_engine_accepts_the_canonical_names_and_runs(tied):
    cfg = tiny_config(tied)
    buf, desc, names = build_weights(cfg)
    eng = make_engine(cfg, buf, desc, names)
    logits = np.zeros(cfg.vocab_size, np.float32)
    eng.prefill(np.array([1, 7, 49, 3, 0, 11], np.int32), 0, logits)  # two batches of max_batch 4
    eng.step(5, 6, logits)
    assert np.isfinite(logits).all() and logits.any()
    counters = eng.counters()
    assert tuple(counters) == _native.COUNTER_NAMES
    assert (counters["tokens"], counters["calls"]) == (7, 3)


def test_swapped_names_are_refused():
    """attn_norm and ffn_norm have the same shape [1, d]: only the names tell the rows apart."""
    cfg = tiny_config(True)
    buf, desc, names = build_weights(cfg)
    a, b = names.index("layers.0.attn_norm"), names.index("layers.0.ffn_norm")
    names[a], names[b] = names[b], names[a]
    desc[[a, b]] = desc[[b, a]]  # the rows follow their names: every shape still fits
    with pytest.raises(ValueError) as e:
        make_engine(cfg, buf, desc, names)
    msg = str(e.value)
    assert msg == (f"descriptor row {a} is named 'layers.0.ffn_norm', the engine expects 'layers.0.attn_norm' there "
                   "(cflow and its compiled core disagree; rebuild with `pip install -e .`)")


def test_names_must_cover_every_row():
    cfg = tiny_config(True)
    buf, desc, names = build_weights(cfg)
    with pytest.raises(ValueError, match="names has"):
        make_engine(cfg, buf, desc, names[:-1])
    names[-1] = "layers.1.moe.experts.2.w_up"
    with pytest.raises(ValueError, match=r"descriptor row \d+ is named 'layers.1.moe.experts.2.w_up', the engine "
                                         r"expects 'layers.1.moe.experts.2.b_down' there"):
        make_engine(cfg, buf, desc, names)


def test_sequences_are_a_trailing_keyword():
    """n_seq (KV-cache slots for step_batch) defaults to 1, so the old positional call is unchanged;
    step_batch writes [B, vocab] rows and counts one call for the B tokens."""
    cfg = tiny_config(False)
    buf, desc, names = build_weights(cfg)
    assert make_engine(cfg, buf, desc, names).n_seq == 1
    eng = _native.NativeEngine(buf, cfg.to_dict(), desc, names, plan_for(cfg), 1, 1, 2, 16, 4, n_seq=3)
    assert eng.n_seq == 3
    i32 = lambda *v: np.array(v, np.int32)  # noqa: E731
    eng.prefill(i32(1, 7), 0, None, 2)
    eng.reset_counters()
    rows = np.zeros((3, cfg.vocab_size), np.float32)
    eng.step_batch(i32(2, 0), i32(5, 9), i32(2, 0), rows)
    assert np.isfinite(rows[:2]).all() and rows[:2].any() and not rows[2].any()
    assert (eng.counters()["tokens"], eng.counters()["calls"]) == (2, 1)
    for bad in (0, -1, 5000):
        with pytest.raises(ValueError, match="sequences"):
            _native.NativeEngine(buf, cfg.to_dict(), desc, names, plan_for(cfg), 1, 1, 2, 16, 4, n_seq=bad)


def test_the_expert_cache_rules_are_the_c_cores():
    """Python sizes expert slots and the smallest cache by the C core's own rules, not copies."""
    from cflow.runtime.experts import ModelSizes

    assert _native.expert_min_slots(2, 3) == 6
    sizes = ModelSizes(file_bytes=0, expert_bytes=0, slot_bytes=4096, n_keys=8, top_k=2, inflight=3, kv_bytes=0)
    assert sizes.min_slots == _native.expert_min_slots(2, 3) and sizes.min_cache == 6 * 4096
