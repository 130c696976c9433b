"""deepseek2 (DeepSeek-V2/V3, Kimi-K2: multi-head latent attention and DeepSeek's MoE) as llama.cpp
runs it: a random-weight GGUF in llama.cpp's exact layout at small geometry, cflow's float
reference (cflow.model_deepseek2) held to llama.cpp teacher-forced, its absorbed latent-cache form
held to its expanded form, and controls that drop one feature each and must miss.

The file (`write_deepseek2_gguf`): d 128, 4 heads, q_lora 64 (or 0: a plain attn_q), kv_lora 32,
qk_nope 32, qk_rope 16, v_head 32; 1 leading dense layer then 3 MoE layers of 8 experts top-2 in
2 groups (1 used), 1 shared expert, hidden 64; the split attn_k_b / attn_v_b of current converters
(head_count_kv 1, key_length kv_lora + qk_rope, key_length_mla / value_length_mla), or the legacy
attn_kv_b; YaRN (factor 4, mscale_all_dim 1) on the rotated part. "v3": sigmoid scores with the
exp_probs_b correction bias, weights renormalised and scaled 2.5; "v2": softmax scores, no bias,
no renormalisation, scale 16 (DeepSeek-V2's routed_scaling_factor).

The oracle is checked on the all-F32 file (llama.cpp then runs float weights on float activations,
K in fp16: nothing else separates it from the reference).

The engine (native/engine_mla.c: the absorbed form over a latent cache) is held to llama.cpp on
a file whose matrices are Q8_0 (both engines then run the same weight blocks and round activations
to int8) with "tame" weights (every layer matrix of gain 1: with the oracle file's gains int8
activations alone, llama.cpp's as much as cflow's, move the logits by O(1)). There the two differ
from each other by about as much as each differs from the float reference, as for every family
(tests/test_moe_llamacpp.py); this small geometry (32-wide heads, a 0.2 std top-1 margin is rare)
rounds a little more: measured median engine vs llama.cpp 7-12%, llama.cpp vs reference 6-10%
(seeds 0, 1). The check: the engine's median distance from llama.cpp at most 1.5x llama.cpp's own
from the float reference, and its distance from the reference at most 1.5x llama.cpp's; the
controls (a file of another seed) are 10x farther.
"""

from __future__ import annotations


import numpy as np
import pytest

pytestmark = pytest.mark.oracle  # compares against llama.cpp (llama-cpp-python)

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="the llama.cpp oracle is not installed: pip install 'llama-cpp-python>=0.3.16'")
gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from isa_runner import other_isas, run_under  # noqa: E402
from test_convert_gguf import add_tensor, add_tiny_tokenizer, tiny_vocab  # noqa: E402
from test_convert_gguf_moe import compare, teacher_forced, tokens  # noqa: E402
from test_moe_llamacpp import MEDIAN_TOL, llama_cpp_logits  # noqa: E402

from cflow.convert import convert  # noqa: E402
from cflow.convert.gguf import GGUFError, GGUFModel  # noqa: E402
from cflow.convert.gguf_deepseek2 import deepseek2_config, deepseek2_weights  # noqa: E402
from cflow.model_deepseek2 import DeepSeek2Cache, DeepSeek2Reference  # noqa: E402

T = gguf.GGMLQuantizationType
ARCH = "deepseek2"
D, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V_HEAD = 128, 4, 64, 32, 32, 16, 32
LAYERS, LEAD, FF, E, TOP_K, FE, GROUPS, GROUPS_USED, SHARED = 4, 1, 192, 8, 2, 64, 2, 1, 1
CTX, THETA, EPS = 256, 10000.0, 1e-6
YARN = dict(factor=4.0, n_orig=64, mscale_all_dim=1.0)
STEPS = 40
VARIANTS = {
    "v3": dict(gating=2, bias=True, norm=True, scale=2.5),
    "v2": dict(gating=1, bias=False, norm=False, scale=16.0),
}
# The oracle's tolerances on the all-F32 file, as tests/test_gptoss.py's: median <= 2%, >= 95% of
# positions <= 4%.
F32_MEDIAN_TOL, F32_MAX_TOL, F32_WITHIN = 0.02, 0.04, 0.95


def deepseek2_weights_random(seed: int, q_lora: int = Q_LORA, legacy_kv_b: bool = False,
                             bias: bool = True, tame: bool = False) -> dict[str, np.ndarray]:
    """Float weights under GGUF names (numpy order), sized so each feature moves the logits; tame:
    every layer matrix of gain 1 (the engine's check: with the default gains the attention is so
    peaked and the routing so close that int8 activations alone, llama.cpp's or cflow's, move the
    logits by O(1))."""
    rng = np.random.default_rng(seed)
    V = len(tiny_vocab())

    def mat(*shape, gain=1.0):
        if tame and shape[0] != V:
            gain = 1.0
        return (rng.standard_normal(shape) * gain / np.sqrt(shape[-1])).astype(np.float32)

    def vec(n, scale):
        return (rng.standard_normal(n) * scale).astype(np.float32)

    w = {"token_embd.weight": mat(V, D, gain=np.sqrt(D)), "output_norm.weight": 1 + vec(D, 0.1),
         "output.weight": mat(V, D, gain=4.0)}
    for i in range(LAYERS):
        b = f"blk.{i}."
        w[b + "attn_norm.weight"] = 1 + vec(D, 0.1)
        if q_lora:
            w.update({b + "attn_q_a.weight": mat(q_lora, D), b + "attn_q_a_norm.weight": 1 + vec(q_lora, 0.1),
                      b + "attn_q_b.weight": mat(HEADS * (NOPE + ROPE), q_lora, gain=3.0)})
        else:
            w[b + "attn_q.weight"] = mat(HEADS * (NOPE + ROPE), D, gain=3.0)
        w[b + "attn_kv_a_mqa.weight"] = mat(KV_LORA + ROPE, D, gain=3.0)
        w[b + "attn_kv_a_norm.weight"] = 1 + vec(KV_LORA, 0.1)
        k_b, v_b = mat(HEADS, KV_LORA, NOPE, gain=2.0), mat(HEADS, V_HEAD, KV_LORA)
        if legacy_kv_b:  # [H (nope + v), kv_lora]: per head the k_nope rows (k_b transposed), then v's
            w[b + "attn_kv_b.weight"] = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, KV_LORA)
        else:
            w[b + "attn_k_b.weight"], w[b + "attn_v_b.weight"] = k_b, v_b
        w[b + "attn_output.weight"] = mat(D, HEADS * V_HEAD)
        w[b + "ffn_norm.weight"] = 1 + vec(D, 0.1)
        if i < LEAD:
            w.update({b + "ffn_gate.weight": mat(FF, D), b + "ffn_up.weight": mat(FF, D),
                      b + "ffn_down.weight": mat(D, FF)})
            continue
        w[b + "ffn_gate_inp.weight"] = mat(E, D, gain=2.0)
        if bias:
            w[b + "exp_probs_b.bias"] = vec(E, 0.3)
        w.update({b + "ffn_gate_exps.weight": mat(E, FE, D, gain=2.0), b + "ffn_up_exps.weight": mat(E, FE, D),
                  b + "ffn_down_exps.weight": mat(E, D, FE),
                  b + "ffn_gate_shexp.weight": mat(FE * SHARED, D), b + "ffn_up_shexp.weight": mat(FE * SHARED, D),
                  b + "ffn_down_shexp.weight": mat(D, FE * SHARED)})
    return w


def write_deepseek2_gguf(path, seed: int = 0, variant: str = "v3", q_lora: int = Q_LORA, layers: int = LAYERS,
                         legacy_kv_b: bool = False, yarn: bool = True, keys: dict | None = None,
                         weights: dict | None = None, quantized: bool = False) -> dict[str, np.ndarray]:
    """The file of the module docstring (every tensor F32, or with quantized=True the matrices Q8_0,
    as the engine runs them); returns the weights it holds."""
    var = VARIANTS[variant]
    w = weights if weights is not None else deepseek2_weights_random(seed, q_lora, legacy_kv_b, var["bias"])
    wr = gguf.GGUFWriter(str(path), ARCH)
    wr.add_name(f"tiny-deepseek2-{variant}")
    wr.add_block_count(layers)
    wr.add_context_length(CTX)
    wr.add_embedding_length(D)
    wr.add_feed_forward_length(FF)
    wr.add_head_count(HEADS)
    if legacy_kv_b:  # the pre-MLA layout: every head's K and V expanded
        wr.add_head_count_kv(HEADS)
        wr.add_key_length(NOPE + ROPE)
        wr.add_value_length(V_HEAD)
    else:  # current converters: one latent "KV head"
        wr.add_head_count_kv(1)
        wr.add_key_length(KV_LORA + ROPE)
        wr.add_value_length(KV_LORA)
        wr.add_key_length_mla(NOPE + ROPE)
        wr.add_value_length_mla(V_HEAD)
    wr.add_rope_dimension_count(ROPE)
    wr.add_rope_freq_base(THETA)
    wr.add_layer_norm_rms_eps(EPS)
    if q_lora:
        wr.add_q_lora_rank(q_lora)
    wr.add_kv_lora_rank(KV_LORA)
    wr.add_leading_dense_block_count(LEAD)
    wr.add_expert_count(E)
    wr.add_expert_used_count(TOP_K)
    wr.add_expert_feed_forward_length(FE)
    wr.add_expert_shared_count(SHARED)
    wr.add_expert_weights_scale(var["scale"])
    wr.add_expert_weights_norm(var["norm"])
    u32 = gguf.GGUFValueType.UINT32
    keys = {"expert_gating_func": (var["gating"], u32), "expert_group_count": (GROUPS, u32),
            "expert_group_used_count": (GROUPS_USED, u32), **(keys or {})}
    if yarn:
        wr.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        wr.add_rope_scaling_factor(YARN["factor"])
        wr.add_rope_scaling_orig_ctx_len(YARN["n_orig"])
        wr.add_rope_scaling_yarn_log_mul(0.1 * YARN["mscale_all_dim"])  # as convert_hf_to_gguf.py writes it
    for k, v in keys.items():
        wr.add_key_value(f"{ARCH}.{k}", v[0], v[1])
    add_tiny_tokenizer(wr)
    for name, x in w.items():
        add_tensor(wr, name, x, T.Q8_0 if quantized and x.ndim >= 2 and x.shape[-1] % 32 == 0 else T.F32)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return w


def reference(path, **drop):
    g = GGUFModel(path)
    cfg = deepseek2_config(g)
    return DeepSeek2Reference(cfg.__class__(**{**cfg.__dict__, **drop}) if drop else cfg, deepseek2_weights(g))


class RopeFirst(DeepSeek2Reference):
    """A control: the rotated part taken from the front of each query head and of the latent
    projection's output instead of their ends."""

    def _query(self, h, b):
        q_nope, q_pe = super()._query(h, b)
        q = torch.cat([q_nope, q_pe], -1)
        return q[..., ROPE:], q[..., :ROPE]

    def _latent(self, h, b, pos):
        from cflow.model_deepseek2 import rms, rope_pairs

        ck = h @ self.w[b + "attn_kv_a_mqa.weight"].T
        return rms(ck[:, ROPE:], self.w[b + "attn_kv_a_norm.weight"], EPS), rope_pairs(ck[:, :ROPE], pos, self.cfg)


def neox_rope(x, pos, cfg):
    """A control: the "half" RoPE convention (pairs j, j + rope/2) instead of ggml's adjacent pairs."""
    from cflow.model import apply_rope, rope_cos_sin

    cos, sin = rope_cos_sin(int(pos.max()) + 1, cfg.qk_rope, cfg.rope_theta, cfg.rope_freq_factors)
    return apply_rope(x, cos[pos].double(), sin[pos].double())


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def run(request, tmp_path_factory):
    """One variant's all-F32 file, its tokens, and llama.cpp's teacher-forced logits on it."""
    variant = request.param
    path = tmp_path_factory.mktemp(f"deepseek2_{variant}") / "m.gguf"
    write_deepseek2_gguf(path, seed=0, variant=variant)
    toks = tokens(STEPS, seed=30)
    return variant, path, toks, llama_cpp_logits(path, toks)


def within_oracle(errs) -> bool:
    return bool(np.median(errs) <= F32_MEDIAN_TOL and np.mean(errs <= F32_MAX_TOL) >= F32_WITHIN)


def test_reference_matches_llama_cpp(run):
    """Measured (llama-cpp-python 0.3.36, AVX-512): median 0.6% (v3) and 0.7% (v2) of the logits'
    std, the worst position 3.5% / 5.0%."""
    variant, path, toks, lc = run
    errs, margins, agree = compare(reference(path).forward(toks), lc)
    msg = f"{variant}: max|dlogit|/std per position: {np.round(errs, 4)}"
    assert within_oracle(errs), msg
    assert agree[margins > 0.2].all(), msg


CONTROLS = {
    "no group limit": dict(n_groups=1),
    "no YaRN mscale": dict(mscale=1.0),
    "no shared expert": dict(n_shared=0),
    "no weights scale": dict(weights_scale=1.0),
    "other gating": "gating",
}


@pytest.mark.parametrize("drop", [*CONTROLS, "no correction bias", "rope first", "rope neox"])
def test_each_feature_matters(run, drop, monkeypatch):
    """Without any one feature the reference misses llama.cpp by far (median over 3x
    tests/test_moe_llamacpp.py's tolerance): the file exercises each and the oracle sees each.
    (v2 files have no correction bias: that control runs on v3 only.)"""
    variant, path, toks, lc = run
    g = GGUFModel(path)
    cfg, w = deepseek2_config(g), deepseek2_weights(g)
    over = CONTROLS.get(drop, {})
    if over == "gating":
        over = dict(gating="softmax" if cfg.gating == "sigmoid" else "sigmoid")
    cfg = cfg.__class__(**{**cfg.__dict__, **over})
    if drop == "no correction bias":
        if variant != "v3":
            pytest.skip("v2 files carry no correction bias")
        w = {k: v for k, v in w.items() if not k.endswith("exp_probs_b.bias")}
    if drop == "rope neox":
        monkeypatch.setattr("cflow.model_deepseek2.rope_pairs", neox_rope)
    ref = (RopeFirst if drop == "rope first" else DeepSeek2Reference)(cfg, w)
    errs, _, _ = compare(ref.forward(toks), lc)
    assert np.median(errs) > 3 * MEDIAN_TOL, (drop, np.round(errs, 3))


def test_latent_cache_form_equals_expanded_form(run):
    """The absorbed decode (llama.cpp's MLA: scores against the cached latent, W_v_b after the mix)
    computes the expanded graph's logits, and its cache holds kv_lora_rank + qk_rope floats per
    layer and token, not per head."""
    _, path, toks, _ = run
    ref = reference(path)
    cache = DeepSeek2Cache(ref)
    steps = np.stack([cache.step(t) for t in toks])
    np.testing.assert_allclose(steps, ref.forward(toks), rtol=0, atol=1e-9 * np.abs(steps).max())
    assert cache.cache_floats() == (KV_LORA + ROPE) * LAYERS * len(toks) == ref.cfg.cache_floats_per_token * LAYERS * len(toks)
    assert ref.cfg.cache_floats_per_token < HEADS * (NOPE + ROPE + V_HEAD)  # what an expanded cache would hold


@pytest.mark.parametrize("layout", ["legacy attn_kv_b", "plain attn_q"])
def test_other_layouts(tmp_path, layout):
    """The legacy layout (one attn_kv_b, every head's K and V expanded by llama.cpp: its MHA path)
    and the plain query (attention.q_lora_rank 0: one attn_q, as V2-Lite) read and run as llama.cpp
    runs them."""
    path = tmp_path / "m.gguf"
    if layout == "legacy attn_kv_b":
        write_deepseek2_gguf(path, seed=1, legacy_kv_b=True)
    else:
        write_deepseek2_gguf(path, seed=1, q_lora=0, keys={"attention.q_lora_rank": (0, gguf.GGUFValueType.UINT32)})
    toks = tokens(STEPS, seed=31)
    cfg = deepseek2_config(GGUFModel(path))
    assert (cfg.q_lora_rank, cfg.qk_nope, cfg.qk_rope, cfg.v_head) == (0 if "attn_q" in layout else Q_LORA, NOPE, ROPE, V_HEAD)
    errs, _, _ = compare(reference(path).forward(toks), llama_cpp_logits(path, toks))
    assert within_oracle(errs), (layout, np.round(errs, 4))


def test_variants_llama_cpp_reads_differently_are_refused_by_name(tmp_path):
    """A 26-layer file is DeepSeek-V2-Lite to llama.cpp (a plain attn_q, q_lora_rank ignored): one
    with the low-rank query is refused rather than read otherwise; so is the softmax-over-the-chosen
    gating (3) and a group count that does not split the experts."""
    w = deepseek2_weights_random(0)
    lite = {k: v for k, v in w.items() if not k.startswith("blk.")}
    for i in range(26):
        lite.update({k.replace("blk.1.", f"blk.{i}."): v for k, v in w.items() if k.startswith("blk.1.")})
    path = tmp_path / "lite.gguf"
    write_deepseek2_gguf(path, layers=26, weights=lite)
    with pytest.raises(GGUFError, match="26 layers.*DeepSeek-V2-Lite.*low-rank query"):
        deepseek2_config(GGUFModel(path))
    path = tmp_path / "gating.gguf"
    write_deepseek2_gguf(path, keys={"expert_gating_func": (3, gguf.GGUFValueType.UINT32)})
    with pytest.raises(GGUFError, match="expert_gating_func 3"):
        deepseek2_config(GGUFModel(path))
    path = tmp_path / "groups.gguf"
    write_deepseek2_gguf(path, keys={"expert_group_count": (3, gguf.GGUFValueType.UINT32)})
    with pytest.raises(GGUFError, match="3 expert groups"):
        deepseek2_config(GGUFModel(path))


# ---- the engine -----------------------------------------------------------------------------
def write_engine_file(path, seed: int, variant: str) -> None:
    bias = VARIANTS[variant]["bias"]
    write_deepseek2_gguf(path, seed, variant, quantized=True, weights=deepseek2_weights_random(seed, bias=bias, tame=True))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def engine_run(request, tmp_path_factory):
    """One variant's Q8_0 file converted, its tokens, llama.cpp's and the reference's logits."""
    variant = request.param
    d = tmp_path_factory.mktemp(f"deepseek2_engine_{variant}")
    write_engine_file(d / "m.gguf", 0, variant)
    result = convert(d / "m.gguf", d / "m.cflow")
    toks = tokens(STEPS, seed=30)
    return variant, d, result, toks, llama_cpp_logits(d / "m.gguf", toks), reference(d / "m.gguf").forward(toks)


def engine_logits(path, toks, threads: int = 1, **kw) -> np.ndarray:
    from cflow.runtime import Engine

    eng = Engine.load(path, threads=threads, **kw)
    return teacher_forced(eng.step, toks)


def test_converter_reads_deepseek2(engine_run):
    variant, _, result, _, _, _ = engine_run
    c = result.config
    assert (c.kv_lora_rank, c.q_lora_rank, c.qk_rope_dim, c.v_head_dim, c.head_dim, c.n_kv_heads) == (
        KV_LORA, Q_LORA, ROPE, V_HEAD, NOPE + ROPE, 1)
    assert (c.n_dense_lead, c.n_experts, c.top_k, c.d_expert, c.d_shared_expert, c.shared_expert_gate) == (
        LEAD, E, TOP_K, FE, FE * SHARED, False)
    assert (c.moe_gating, c.moe_router_bias, c.moe_groups, c.moe_groups_used, c.moe_weights_scale,
            c.moe_norm_topk) == ("sigmoid" if variant == "v3" else "softmax", variant == "v3", GROUPS, GROUPS_USED,
                                 VARIANTS[variant]["scale"], VARIANTS[variant]["norm"])
    from cflow import weights  # the tensor count a header check uses, without listing the tensors

    for cfg in (c, c.replace(q_lora_rank=0), c.replace(moe_router_bias=False, d_shared_expert=0)):
        assert weights.count(cfg) == len(list(weights.model_weights(cfg)))


def test_engine_matches_llama_cpp_and_reference(engine_run):
    variant, d, _, toks, lc, ref = engine_run
    got = engine_logits(d / "m.cflow", toks)
    e_lc, margins, agree = compare(got, lc)
    e_ref, _, _ = compare(got, ref)
    lc_ref, _, _ = compare(lc, ref)
    msg = (f"{variant}: engine vs llama.cpp {np.round(e_lc, 3)}\nengine vs reference {np.round(e_ref, 3)}\n"
           f"llama.cpp vs reference {np.round(lc_ref, 3)}")
    assert np.median(e_lc) <= 1.5 * np.median(lc_ref) and np.median(e_ref) <= 1.5 * np.median(lc_ref), msg
    assert agree[margins > 0.2].mean() >= 0.9, msg
    # the control: llama.cpp on a file of another seed is far from this engine
    other = d / "other.gguf"
    write_engine_file(other, 5, variant)
    e_other, _, _ = compare(got, llama_cpp_logits(other, toks))
    assert np.median(e_other) > 10 * np.median(lc_ref), (np.median(e_other), msg)


def test_prefill_equals_steps_and_threads_agree(engine_run):
    """A prompt prefilled (blocks of consecutive rows through attention_block over the latent
    cache) gives the steps' logits bit for bit; 1 and 2 threads give the same bits."""
    from cflow.runtime import Engine

    _, d, _, toks, _, _ = engine_run
    one = engine_logits(d / "m.cflow", toks, threads=1)
    np.testing.assert_array_equal(one, engine_logits(d / "m.cflow", toks, threads=2))
    for threads in (1, 2):
        eng = Engine.load(d / "m.cflow", threads=threads)
        last = np.array(eng.prefill(toks), dtype=np.float64)
        np.testing.assert_array_equal(last, one[-1])


def test_kv_cache_is_the_latent(engine_run):
    """What the engine reads from its KV cache per step is (kv_lora_rank + qk_rope) fp16 values per
    layer and cached position, not per head: its kv counter, and cflow.runtime.kvcache's size."""
    from cflow.runtime import Engine
    from cflow.runtime.kvcache import cache_bytes

    _, d, result, toks, _, _ = engine_run
    eng = Engine.load(d / "m.cflow", threads=1)
    for pos, t in enumerate(toks[:5]):
        eng.reset_counters()
        eng.step(t, pos)
        assert eng.counters()["kv"] == (pos + 1) * LAYERS * (KV_LORA + ROPE) * 2
    assert cache_bytes(result.config, 100) == 100 * LAYERS * (KV_LORA + ROPE) * 2


@pytest.mark.parametrize("io", ["sync", "async"])
def test_experts_on_disk_are_bit_identical(engine_run, io):
    _, d, _, toks, _, _ = engine_run
    ram = engine_logits(d / "m.cflow", toks[:12], threads=2, experts="ram")
    disk = engine_logits(d / "m.cflow", toks[:12], threads=2, experts="disk", expert_io=io, expert_cache="1M")
    np.testing.assert_array_equal(ram, disk)


def test_converter_refuses_what_llama_cpp_reads_differently(tmp_path):
    """The lite/full ambiguity reaches the converter too (it reads the geometry through
    deepseek2_config): the file is refused by name and nothing is written."""
    w = deepseek2_weights_random(0)
    lite = {k: v for k, v in w.items() if not k.startswith("blk.")}
    for i in range(26):
        lite.update({k.replace("blk.1.", f"blk.{i}."): v for k, v in w.items() if k.startswith("blk.1.")})
    write_deepseek2_gguf(tmp_path / "lite.gguf", layers=26, weights=lite)
    with pytest.raises(GGUFError, match="DeepSeek-V2-Lite"):
        convert(tmp_path / "lite.gguf", tmp_path / "m.cflow")
    assert not (tmp_path / "m.cflow").exists()


# ---- every kernel table ------------------------------------------------------------------------
ISA_TESTS = [f"tests/test_deepseek2.py::{t}" for t in ("test_engine_matches_llama_cpp_and_reference",
                                                       "test_prefill_equals_steps_and_threads_agree")]


@pytest.mark.parametrize("isa", other_isas())
def test_every_other_kernel_table(isa):
    """The engine tests above under each other kernel table (CFLOW_ISA=ref, avx2, ...)."""
    run_under(isa, ISA_TESTS, 2 * len(ISA_TESTS))


ENGINE_CONTROLS = {
    "no group limit": dict(moe_groups=0, moe_groups_used=0),
    "no YaRN mscale": dict(attn_scale=1 / np.sqrt(NOPE + ROPE)),
    "no correction bias": dict(moe_router_bias=False),
    "no shared expert": dict(d_shared_expert=0),
    "rope rows not reordered": {},
}


@pytest.mark.parametrize("drop", sorted(ENGINE_CONTROLS))
def test_engine_controls_miss(engine_run, drop, monkeypatch, tmp_path):
    """The engine on a conversion with one feature dropped misses llama.cpp by far (median over 3x
    the bound test_engine_matches_llama_cpp_and_reference holds it to): each feature is one the
    engine runs, and the comparison sees it. (v2 files have no correction bias.)"""
    import cflow.convert.gguf_deepseek2 as ds

    variant, d, _, toks, lc, ref = engine_run
    if drop == "no correction bias" and variant != "v3":
        pytest.skip("v2 files carry no correction bias")
    over = ENGINE_CONTROLS[drop]
    real = ds.deepseek2_model_config
    monkeypatch.setattr(ds, "deepseek2_model_config", lambda g: real(g).replace(**over))
    monkeypatch.setattr(ds, "_check_deepseek2_names", lambda g, cfg: None)  # the dropped tensors stay unread
    if drop == "rope rows not reordered":
        monkeypatch.setattr(ds, "_half_rope_rows", lambda rows, *a: np.arange(rows))
    convert(d / "m.gguf", tmp_path / "m.cflow")
    lc_ref, _, _ = compare(lc, ref)
    errs, _, _ = compare(engine_logits(tmp_path / "m.cflow", toks), lc)
    assert np.median(errs) > 3 * 1.5 * np.median(lc_ref), (drop, np.round(errs, 3), np.median(lc_ref))


@pytest.mark.parametrize("layout", ["legacy attn_kv_b", "plain attn_q"])
def test_engine_runs_the_other_layouts(tmp_path, layout):
    """The legacy attn_kv_b (split into the per-head up-projections at conversion) and the plain
    query (one attn_q, the engine's wq path) through the engine, as test_engine_matches_llama_cpp_
    and_reference holds the split layout."""
    path = tmp_path / "m.gguf"
    kw = dict(legacy_kv_b=True) if layout == "legacy attn_kv_b" else dict(
        q_lora=0, keys={"attention.q_lora_rank": (0, gguf.GGUFValueType.UINT32)})
    w = deepseek2_weights_random(2, q_lora=kw.get("q_lora", Q_LORA), legacy_kv_b=kw.get("legacy_kv_b", False), tame=True)
    write_deepseek2_gguf(path, quantized=True, weights=w, **kw)
    convert(path, tmp_path / "m.cflow")
    toks = tokens(STEPS, seed=32)
    lc, ref = llama_cpp_logits(path, toks), reference(path).forward(toks)
    got = engine_logits(tmp_path / "m.cflow", toks)
    e_lc, _, _ = compare(got, lc)
    lc_ref, _, _ = compare(lc, ref)
    assert np.median(e_lc) <= 1.5 * np.median(lc_ref), (layout, np.round(e_lc, 3), np.round(lc_ref, 3))


def test_vflow_order_runs_the_same(engine_run, tmp_path):
    """The decode-schedule order (.vflow) of a deepseek2 file holds the same tensors and gives the
    same logits bit for bit."""
    _, d, _, toks, _, _ = engine_run
    convert(d / "m.gguf", tmp_path / "m.vflow")
    np.testing.assert_array_equal(engine_logits(tmp_path / "m.vflow", toks[:8]), engine_logits(d / "m.cflow", toks[:8]))
