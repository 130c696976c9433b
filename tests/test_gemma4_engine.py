"""Gemma 4 (dense, text only) through cflow: the converter (cflow.convert.gguf_gemma4) and the engine
(native/engine_gemma4.c and the per-layer geometry), held against llama.cpp and the float reference
on tests/test_gemma4.py's file (its writer, its float64 reference of llama.cpp's graph).

The engine runs the file with its matrices Q8_0 (write_gemma4_gguf(native=True): both engines then
run the same weight blocks and round each mat-mul's input to int8 per 32 values). On this file the
scale-1 attention's peaked softmax amplifies that rounding: llama.cpp itself is 4.5% (median
max|dlogit|/std) from the float reference over the dequantized weights (tests/test_gemma4.py), so
the engine is held as tests/test_deepseek2.py holds its engine: its median distance from llama.cpp
and from the reference each at most 1.5x llama.cpp's own from the reference, and the argmax equal
to llama.cpp's at 90% of the positions where llama.cpp's top-1 margin exceeds 0.2 std. The
controls (the engine on a conversion whose config drops one feature) miss llama.cpp by over 3x that
bound. Features without a config knob to drop (the shared-KV layers' source, V from K's
projection, the per-layer head sizes and FFN widths) change tensor shapes: a wrong reading of those
is seen by the parity test itself.

Also: the converted config and tensors, prefill (blocks of rows, batched kernels) and batched rows
of two sequences equal the steps, copying a sequence's cache (laid out per layer at each layer's
head size), 1 and 2 threads give the same bits, every other kernel table (tests/isa_runner.py),
a tensor the conversion would not read refused by name. The MoE layers (test_gemma4's MoE file,
its expert stacks Q8_0 as well): the same parity rule, controls, prefill, threads, and experts
read from disk bit for bit as in RAM. A KV head count per layer kind (test_gemma4's per-layer-KV
MoE file, one seed): the same parity rule, a control with the global layer's KV heads swapped,
prefill, batched rows, a copied sequence, threads, disk, the q8_0 cache, and any other
head_count_kv layout refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.oracle  # compares against llama.cpp (llama-cpp-python)

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

import test_gemma4 as g4  # noqa: E402  (skips without llama_cpp)
from isa_runner import other_isas, run_under  # noqa: E402
from test_convert_gguf_moe import compare, teacher_forced  # noqa: E402
from test_moe_llamacpp import llama_cpp_logits  # noqa: E402

from cflow.convert import convert  # noqa: E402
from cflow.convert.gguf import GGUFError, GGUFModel, gguf_config  # noqa: E402

PARITY, MARGIN, AGREE = 1.5, 0.2, 0.9  # tests/test_deepseek2.py's rule (module docstring)


def engine_logits(path, toks, threads: int = 1, **opts) -> np.ndarray:
    from cflow.runtime import Engine

    with Engine.load(path, threads=threads, n_ctx=64, **opts) as eng:
        return teacher_forced(eng.step, toks)


@pytest.fixture(scope="module", params=[0, 1])
def run(request, tmp_path_factory):
    """(gguf, cflow, tokens, engine, llama.cpp, test_gemma4's float64 reference, cflow.model_gemma4's
    fp32 reference logits) of the Q8_0 file of one seed."""
    from cflow.model_gemma4 import Gemma4Reference

    seed = request.param
    d = tmp_path_factory.mktemp(f"gemma4_engine_{seed}")
    src, dst = d / "m.gguf", d / "m.cflow"
    g4.write_gemma4_gguf(src, seed, native=True)
    convert(src, dst)
    toks = g4.sequence(seed=30 + seed)
    return (src, dst, toks, engine_logits(dst, toks), llama_cpp_logits(src, toks), g4.reference_logits(src, toks),
            Gemma4Reference.from_cflow(dst).forward(toks))


def test_config_and_tensors(run):
    from cflow.fileformat import open_model

    src, dst = run[0], run[1]
    cfg = gguf_config(GGUFModel(src))
    assert (cfg.head_dim, cfg.head_dim_local, cfg.shared_kv_layers, cfg.d_ff, cfg.d_ff_shared_kv) == (
        g4.HD, g4.HD_SWA, g4.SHARED_KV, g4.FF[0], g4.FF[-1])
    assert (cfg.per_layer_dim, cfg.logit_softcap, cfg.attn_scale, cfg.rope_theta_local, cfg.sliding_window) == (
        g4.P, g4.SOFTCAP, 1.0, g4.THETA_SWA, g4.WINDOW)
    assert cfg.v_norm and cfg.layer_out_scale and cfg.post_norms and cfg.qk_norm and cfg.ffn_act == "gelu_tanh"
    assert [cfg.is_local(layer) for layer in range(g4.LAYERS)] == g4.LOCAL
    assert [cfg.kv_source(layer) for layer in range(g4.LAYERS)] == [g4.kv_source(layer) for layer in range(g4.LAYERS)]
    assert len(cfg.rope_freq_factors) == g4.HD // 2 and cfg.rope_freq_factors[g4.ROTATED_PAIRS] > 1e29
    f = open_model(dst, verify=True)
    shapes = {n: tuple(e.shape) for n, e in f.tensors.items()}
    assert shapes["layers.0.attn.wqkv"] == ((g4.HEADS + 2 * g4.KV_HEADS) * g4.HD_SWA, g4.D)
    assert shapes["layers.2.attn.wqkv"] == ((g4.HEADS + 2 * g4.KV_HEADS) * g4.HD, g4.D)
    assert shapes["layers.3.attn.wqkv"] == (g4.HEADS * g4.HD_SWA, g4.D) and "layers.3.attn.k_norm" not in shapes
    assert shapes["layers.5.ffn.w_down"] == (g4.D, g4.FF[5]) and shapes["ple_emb"][1] == g4.LAYERS * g4.P
    assert shapes["layers.4.out_scale"] == (1,) and shapes["layers.1.ple.w_proj"] == (g4.D, g4.P)


def test_v_is_ks_rows_where_attn_v_is_absent(run):
    """Layer 2 has no attn_v: its V rows are K's (V is normed without weights: llama.cpp's V)."""
    from cflow.convert.encoder import split_fused, stored_values
    from cflow.fileformat import open_model

    f = open_model(run[1])
    for layer, same in ((2, True), (1, False)):
        _, k, v = split_fused(stored_values(f, f"layers.{layer}.attn.wqkv"), f.tensors[f"layers.{layer}.attn.wqkv"].meta)
        assert np.array_equal(k, v) == same


def test_engine_matches_llama_cpp_and_reference(run):
    _, _, _, got, lc, ref, fp32 = run
    e_lc, margins, agree = compare(got, lc)
    e_ref, _, _ = compare(got, ref)
    e_fp32, _, _ = compare(got, fp32)
    lc_ref, _, _ = compare(lc, ref)
    msg = (f"engine vs llama.cpp {np.round(e_lc, 3)}\nengine vs reference {np.round(e_ref, 3)}\n"
           f"engine vs fp32 reference {np.round(e_fp32, 3)}\nllama.cpp vs reference {np.round(lc_ref, 3)}")
    bound = PARITY * np.median(lc_ref)
    assert np.median(e_lc) <= bound and np.median(e_ref) <= bound and np.median(e_fp32) <= bound, msg
    assert agree[margins > MARGIN].mean() >= AGREE, msg


def test_fp32_reference_is_the_graph(run):
    """cflow.model_gemma4 over the .cflow's weights (the GGUF's Q8_0 blocks, kept bit for bit) is
    test_gemma4's float64 graph, which that file holds to llama.cpp, within float32 rounding
    (test_gemma3's bound for two float forms of one model: 1e-4 of the logits' std)."""
    ref, fp32 = run[5], run[6]
    assert np.abs(fp32 - ref).max() / ref.std() < 1e-4


@pytest.mark.parametrize("drop", ["no per-layer embeddings", "V not normalised", "no layer output scale",
                                  "local layers with the global RoPE base", "no final soft cap"])
def test_fp32_reference_controls_miss(run, drop):
    """The fp32 reference reads its features from the config: without one it misses llama.cpp by far
    (the engine controls' bound)."""
    from cflow.fileformat import open_model
    from cflow.model_gemma4 import Gemma4Reference

    _, dst, toks, _, lc, ref, _ = run
    cfg = open_model(dst).config.replace(**ENGINE_CONTROLS[drop])
    errs, _, _ = compare(Gemma4Reference.from_cflow(dst, cfg).forward(toks), lc)
    lc_ref, _, _ = compare(lc, ref)
    assert np.median(errs) > 3 * PARITY * np.median(lc_ref), (drop, np.round(errs, 3))


ENGINE_CONTROLS = {
    "no per-layer embeddings": dict(per_layer_dim=0),
    "V not normalised": dict(v_norm=False),
    "scores scaled by 1/sqrt(head_dim)": dict(attn_scale=float(1 / np.sqrt(g4.HD))),
    "local layers without their window": dict(sliding_window=g4.CTX),
    "global layers without the RoPE factors": dict(rope_freq_factors=()),
    "local layers with the global RoPE base": dict(rope_theta_local=g4.THETA),
    "no layer output scale": dict(layer_out_scale=False),
    "no final soft cap": dict(logit_softcap=0.0),
}


@pytest.mark.parametrize("drop", list(ENGINE_CONTROLS))
def test_engine_controls_miss(run, drop, monkeypatch, tmp_path):
    """The engine on a conversion with one feature dropped misses llama.cpp by over 3x the bound
    test_engine_matches_llama_cpp_and_reference holds it to."""
    import cflow.convert.gguf_gemma4 as conv

    src, _, toks, _, lc, ref, _ = run
    real = conv.gemma4_config
    monkeypatch.setattr(conv, "gemma4_config", lambda g: real(g).replace(**ENGINE_CONTROLS[drop]))
    monkeypatch.setattr(conv, "check_gemma4_names", lambda g, used: None)  # the dropped tensors stay unread
    convert(src, tmp_path / "m.cflow")
    errs, _, _ = compare(engine_logits(tmp_path / "m.cflow", toks), lc)
    lc_ref, _, _ = compare(lc, ref)
    assert np.median(errs) > 3 * PARITY * np.median(lc_ref), (drop, np.round(errs, 3), np.median(lc_ref))


def test_prefill_equals_steps(run):
    """Prefill (block attention over both head sizes and the shared caches, the batched kernels, the
    per-layer inputs of a batch) and batched rows of two sequences equal the steps; a copied
    sequence continues as the original."""
    from test_engine import rel_err

    from cflow.runtime import Engine

    _, dst, toks, got = run[:4]
    eng = Engine.load(dst, threads=2, max_batch=7, n_ctx=64)
    for n in (g4.WINDOW - 1, g4.WINDOW + 3, g4.STEPS):
        assert rel_err(eng.prefill(toks[:n]), got[n - 1]) < 1e-5
    two = Engine.load(dst, threads=2, n_seq=2, n_ctx=64)
    two.prefill(toks[:20], seq=0)
    rows = two.step_rows([0, 0, 1], [toks[20], toks[21], toks[0]], [20, 21, 0])
    assert rel_err(rows[1], got[21]) < 1e-5 and rel_err(rows[2], got[0]) < 1e-5
    two.copy_seq(0, 1, 22)
    assert rel_err(two.step_rows([1], [toks[22]], [22])[0], got[22]) < 1e-5


def test_vflow_and_bytes_per_token(run, tmp_path):
    """The .vflow data order runs bit for bit as the .cflow; the weight bytes a token reads, by the
    tensor table (a row of ple_emb, ple_proj whole), are what the engine counts."""
    from cflow.runtime import Engine

    src, dst, toks, got = run[:4]
    convert(src, tmp_path / "m.vflow")
    np.testing.assert_array_equal(engine_logits(tmp_path / "m.vflow", toks[:6]), got[:6])
    eng = Engine.load(dst, threads=1, n_ctx=64)
    eng.step(toks[0], 0)
    counted = sum(v for k, v in eng.counters().items() if k in ("attn", "dense", "embed", "lm_head"))
    assert counted == pytest.approx(eng.weight_bytes_per_token(), rel=1e-3)


def test_q8_kv_cache(run):
    """The 8-bit KV cache, its rows sized per layer (32- and 64-wide heads: one and two blocks):
    close to the fp16 cache's logits (tests/test_gptoss_engine.py's bound: median <= 2x
    MEDIAN_TOL), and its prefill equals its steps."""
    from test_engine import rel_err
    from test_moe_llamacpp import MEDIAN_TOL

    from cflow.runtime import Engine

    _, dst, toks, fp16 = run[:4]
    kv = dict(cache_type_k="q8_0", cache_type_v="q8_0")
    got = engine_logits(dst, toks, **kv)
    errs = compare(got, fp16)[0]
    assert np.median(errs) <= 2 * MEDIAN_TOL, np.round(errs, 3)
    with Engine.load(dst, threads=2, max_batch=16, n_ctx=64, **kv) as eng:
        assert rel_err(eng.prefill(toks), got[-1]) < 1e-5


def test_every_tensor_has_a_byte_category(run):
    """`cflow inspect`'s byte split files every Gemma 4 tensor under a category (none under "other";
    the MoE file's: test_moe_config)."""
    from cflow.fileformat import open_model, tensor_category

    assert [n for n in open_model(run[1]).tensors if tensor_category(n) == "other"] == []


def test_engine_threads_agree(run):
    _, dst, toks, got = run[:4]
    np.testing.assert_array_equal(engine_logits(dst, toks[:12], threads=2), got[:12])


# ---- the MoE layers (26B-A4B's) --------------------------------------------------------------
@pytest.fixture(scope="module", params=[0, 1])
def moe_run(request, tmp_path_factory):
    """As `run`, for test_gemma4's MoE file (every layer also has experts) with its expert stacks
    Q8_0 too, so both engines run the same blocks."""
    from cflow.model_gemma4 import Gemma4Reference

    seed = request.param
    d = tmp_path_factory.mktemp(f"gemma4_moe_{seed}")
    src, dst = d / "m.gguf", d / "m.cflow"
    g4.write_gemma4_gguf(src, seed, native="experts", moe=True)
    convert(src, dst)
    toks = g4.sequence(seed=30 + seed)
    return (src, dst, toks, engine_logits(dst, toks), llama_cpp_logits(src, toks), g4.reference_logits(src, toks),
            Gemma4Reference.from_cflow(dst).forward(toks))


def test_moe_config(moe_run):
    cfg = gguf_config(GGUFModel(moe_run[0]))
    assert (cfg.n_experts, cfg.top_k, cfg.d_expert, cfg.d_ff, cfg.moe_input, cfg.expert_act) == (
        g4.E, g4.TOP_K, g4.F_EXP, g4.FF[0], "post_attn", "gelu_tanh")
    assert cfg.moe_router_norm and cfg.expert_scale and cfg.moe_out_norms and cfg.moe_norm_topk
    from cflow.fileformat import open_model, tensor_category

    assert [n for n in open_model(moe_run[1]).tensors if tensor_category(n) == "other"] == []


def test_moe_engine_matches_llama_cpp_and_reference(moe_run):
    """The rule of test_engine_matches_llama_cpp_and_reference; the fp32 reference is the float64
    graph within float32 rounding."""
    test_engine_matches_llama_cpp_and_reference(moe_run)
    test_fp32_reference_is_the_graph(moe_run)


MOE_CONTROLS = {"router on the experts' input norm": dict(moe_router_norm=False),
                "no per-expert output scale": dict(expert_scale=False)}


@pytest.mark.parametrize("drop", list(MOE_CONTROLS))
def test_moe_controls_miss(moe_run, drop, monkeypatch, tmp_path):
    """Without a MoE feature the engine misses llama.cpp by over 3x the parity bound (the top-k
    renormalisation has no control: moe_post_norm cancels it, tests/test_gemma4.py)."""
    import cflow.convert.gguf_gemma4 as conv

    src, _, toks, _, lc, ref, _ = moe_run
    real = conv.gemma4_config
    monkeypatch.setattr(conv, "gemma4_config", lambda g: real(g).replace(**MOE_CONTROLS[drop]))
    monkeypatch.setattr(conv, "check_gemma4_names", lambda g, used: None)
    convert(src, tmp_path / "m.cflow")
    errs, _, _ = compare(engine_logits(tmp_path / "m.cflow", toks), lc)
    lc_ref, _, _ = compare(lc, ref)
    assert np.median(errs) > 3 * PARITY * np.median(lc_ref), (drop, np.round(errs, 3), np.median(lc_ref))


def test_moe_prefill_equals_steps_and_threads_agree(moe_run):
    """Prefill (the routed rows gathered per expert, GeGLU over the batched kernels) equals the
    steps; 2 threads give the 1-thread bits."""
    from test_engine import rel_err

    from cflow.runtime import Engine

    _, dst, toks, got = moe_run[:4]
    with Engine.load(dst, threads=2, max_batch=7, n_ctx=64) as eng:
        for n in (g4.WINDOW + 3, g4.STEPS):
            assert rel_err(eng.prefill(toks[:n]), got[n - 1]) < 1e-5
    np.testing.assert_array_equal(engine_logits(dst, toks[:12], threads=2), got[:12])


@pytest.mark.parametrize("io", ["sync", "async"])
def test_moe_experts_on_disk_are_bit_identical(moe_run, io):
    """Experts read from the file into the smallest cache the engine takes (every step misses and
    evicts) give the logits of the experts in RAM, bit for bit."""
    from cflow.runtime import Engine

    _, dst, toks, got = moe_run[:4]
    with Engine.load(dst, threads=1, experts="disk", expert_cache=None, expert_io=io) as probe:
        c = probe.expert_cache
    disk = engine_logits(dst, toks[:12], experts="disk", expert_io=io, expert_cache=c["min_slots"] * c["slot_bytes"])
    np.testing.assert_array_equal(disk, got[:12])


# ---- a KV head count per layer (26B-A4B's and 31B's head_count_kv array) -------------------------
@pytest.fixture(scope="module")
def kv_run(tmp_path_factory):
    """As `moe_run`, for test_gemma4's per-layer-KV MoE file (KV_LOCAL KV heads on the local layers,
    KV_HEADS on the global ones), one seed."""
    from cflow.model_gemma4 import Gemma4Reference

    d = tmp_path_factory.mktemp("gemma4_kv")
    src, dst = d / "m.gguf", d / "m.cflow"
    g4.write_gemma4_gguf(src, 2, native="experts", moe=True, kv_local=g4.KV_LOCAL)
    convert(src, dst)
    toks = g4.sequence(seed=32)
    return (src, dst, toks, engine_logits(dst, toks), llama_cpp_logits(src, toks), g4.reference_logits(src, toks),
            Gemma4Reference.from_cflow(dst).forward(toks))


def test_kv_config_and_cache_layout(kv_run):
    """The array read as one count per kind; the fused QKV rows and the cache sized per layer (the
    shared-KV layers read their source's: none of their own)."""
    from cflow.fileformat import open_model
    from cflow.runtime.kvcache import cache_bytes

    src, dst = kv_run[0], kv_run[1]
    cfg = gguf_config(GGUFModel(src))
    assert (cfg.n_kv_heads, cfg.n_kv_heads_local) == (g4.KV_HEADS, g4.KV_LOCAL)
    assert [cfg.layer_kv_heads(layer) for layer in range(g4.LAYERS)] == [g4.kv_heads(layer, g4.KV_LOCAL)
                                                                          for layer in range(g4.LAYERS)]
    shapes = {n: tuple(e.shape) for n, e in open_model(dst).tensors.items()}
    assert shapes["layers.0.attn.wqkv"] == ((g4.HEADS + 2 * g4.KV_LOCAL) * g4.HD_SWA, g4.D)
    assert shapes["layers.2.attn.wqkv"] == ((g4.HEADS + 2 * g4.KV_HEADS) * g4.HD, g4.D)
    # layers 0, 1 local (4 heads of 32), layer 2 global (2 of 64): fp16 K and V rows, 64 positions
    assert cache_bytes(cfg, 64) == 64 * 2 * 2 * (2 * g4.KV_LOCAL * g4.HD_SWA + g4.KV_HEADS * g4.HD)


def test_kv_engine_matches_llama_cpp_and_reference(kv_run):
    """test_engine_matches_llama_cpp_and_reference's rule; the fp32 reference is the float64 graph."""
    test_engine_matches_llama_cpp_and_reference(kv_run)
    test_fp32_reference_is_the_graph(kv_run)


def test_kv_control_misses(kv_run, monkeypatch, tmp_path):
    """The control: the global KV layer's two KV heads swapped in the file the engine converts (K, and
    V, which is K's rows there), so each global layer's query head h reads KV head 1 - h // 2: the
    engine misses llama.cpp on the real file by over 3x the parity bound. The parity test sees which
    KV head every query head of a global layer reads."""
    src, _, toks, _, lc, ref, _ = kv_run
    real = g4.gemma4_weights

    def swapped(seed, moe=False, kv_local=None):
        w = real(seed, moe, kv_local)
        k = w["blk.2.attn_k.weight"]
        w["blk.2.attn_k.weight"] = np.concatenate([k[g4.HD:], k[: g4.HD]])
        return w

    monkeypatch.setattr(g4, "gemma4_weights", swapped)
    g4.write_gemma4_gguf(tmp_path / "m.gguf", 2, native="experts", moe=True, kv_local=g4.KV_LOCAL)
    convert(tmp_path / "m.gguf", tmp_path / "m.cflow")
    errs, _, _ = compare(engine_logits(tmp_path / "m.cflow", toks), lc)
    lc_ref, _, _ = compare(lc, ref)
    assert np.median(errs) > 3 * PARITY * np.median(lc_ref), (np.round(errs, 3), np.median(lc_ref))


def test_kv_prefill_threads_and_disk(kv_run):
    """Prefill, batched rows of two sequences and a copied sequence equal the steps (the caches of
    two head counts), 2 threads give the 1-thread bits, experts on disk the bits of experts in RAM."""
    test_prefill_equals_steps(kv_run)
    test_engine_threads_agree(kv_run)
    test_moe_experts_on_disk_are_bit_identical(kv_run, "sync")


def test_kv_q8_cache(kv_run):
    test_q8_kv_cache(kv_run)


def test_other_kv_head_layouts_are_refused(tmp_path, monkeypatch):
    """head_count_kv that differs among the global layers (here the shared layer 5 from its source,
    layer 2) is refused by name."""
    monkeypatch.setattr(g4, "kv_heads", lambda layer, kv_local=None: [4, 4, 2, 4, 4, 1][layer])
    path = tmp_path / "m.gguf"
    g4.write_gemma4_gguf(path, seed=0, kv_local=g4.KV_LOCAL)
    with pytest.raises(GGUFError, match=r"head_count_kv \[4, 4, 2, 4, 4, 1\]: cflow runs one KV head count on "
                                        "the local"):
        convert(path, tmp_path / "m.cflow")


def test_an_unread_tensor_is_refused(tmp_path, monkeypatch):
    """A tensor the conversion would not read (here attn_v on a shared-KV layer) is refused by name."""
    path = tmp_path / "m.gguf"
    real = g4.gemma4_weights

    def weights(seed, moe=False, kv_local=None):
        w = real(seed, moe, kv_local)
        w["blk.4.attn_v.weight"] = w["blk.0.attn_q.weight"][: g4.KV_HEADS * g4.HD_SWA]
        return w

    monkeypatch.setattr(g4, "gemma4_weights", weights)
    g4.write_gemma4_gguf(path, seed=0)
    with pytest.raises(GGUFError, match="does not know how to use.*blk.4.attn_v"):
        convert(path, tmp_path / "m.cflow")


# ---- every kernel table ------------------------------------------------------------------------
ISA_TESTS = [f"tests/test_gemma4_engine.py::{t}" for t in ("test_engine_matches_llama_cpp_and_reference",
                                                            "test_prefill_equals_steps",
                                                            "test_moe_engine_matches_llama_cpp_and_reference",
                                                            "test_moe_prefill_equals_steps_and_threads_agree",
                                                            "test_kv_engine_matches_llama_cpp_and_reference")]


@pytest.mark.parametrize("isa", other_isas())
def test_every_other_kernel_table(isa):
    run_under(isa, ISA_TESTS, 2 * len(ISA_TESTS) - 1)  # two seeds each, the per-layer-KV file one


def test_lm_head_of_the_hidden_states_is_the_soft_capped_logits(run):
    """cf_engine_lm_head (what multi-token heads' outputs go through) applies the soft cap as a pass does."""
    from cflow.runtime import Engine

    with Engine.load(run[1], threads=2, n_ctx=64) as eng:
        assert eng.config.logit_softcap > 0
        eng.keep_hidden = True
        logits = eng.prefill(run[2][:8]).copy()
        out = np.zeros((1, eng.config.vocab_size), np.float32)
        eng._native.lm_head(np.ascontiguousarray(eng.hidden()), out)
        assert np.array_equal(out[0], logits)
