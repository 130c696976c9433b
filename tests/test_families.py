"""The GGUF families beyond Llama, end to end: Qwen2 (q/k/v biases, NEOX RoPE, tied embeddings),
Qwen3 (per-head RMSNorm of q and k before RoPE, head_dim != d_model / n_heads) and Mistral (arch
"llama" carrying `llama.attention.sliding_window`), a llama file with q/k/v biases (permuted with
Q/K, as convert_hf_to_gguf.py does), llama files with Llama 3's RoPE frequency factors (the
rope_freqs tensor) and with YaRN RoPE scaling (their control: the reference without the scaling
misses llama.cpp by far), Mistral 3 (arch "mistral3": permuted like llama, YaRN with a log
multiplier, and Llama 4's attention temperature, which llama.cpp applies to q from position
n_orig on: its control, the reference without it, agrees before n_orig and misses by far after),
plus cflow's own sliding-window attention.

Each GGUF is written here with gguf.GGUFWriter the way convert_hf_to_gguf.py writes that family
(Q/K rows permuted for llama only; weights Q8_0, norms and biases F32; d 256, 2 layers, GQA 4/2),
converted with cflow, and run by the C engine teacher-forced. Oracles:
- llama.cpp (llama-cpp-python) on the same GGUF;
- the PyTorch reference (cflow.model.ReferenceDecoder) over weights taken from the GGUF alone
  (gguf.quants.dequantize; Q/K un-permuted here for llama), with a config written here, not
  derived by the converter;
- HF transformers loading the GGUF (`from_pretrained(dir, gguf_file=...)`; it cannot load a Qwen3
  GGUF whose head_dim differs from d / n_heads, so that one is skipped with the reason and its
  Qwen3ForCausalLM runs on the reference's weights instead), and transformers' MistralForCausalLM
  with the same sliding window for cflow's windowed attention.
Tolerances are test_moe_llamacpp's dense ones (max|dlogit| / std(logits) per position: median
<= 4%, every position <= 7%, argmax equal where the oracle's top-1 margin exceeds 0.2 std).
Controls: the reference without the feature a family adds (biases, q/k norms, the window) must
miss llama.cpp / the windowed engine by far, so each comparison sees the feature.

Sliding window: the Mistral file's `llama.attention.sliding_window` (W = 16 of 32 positions) is
honoured on import, as the model is defined and transformers' MistralForCausalLM runs it.
llama.cpp's llama graph ignores the key (a plain causal KV cache), so the Mistral file is held
against llama.cpp (and transformers' GGUF loader, which reads it as a Llama) on the positions
before W, where a window changes nothing, and shown to differ from it after W; against the
reference and MistralForCausalLM on every position.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.oracle  # every test here compares against llama.cpp (llama-cpp-python)

from cflow.config import ModelConfig
from cflow.convert import convert
from cflow.convert.encoder import Encoder, tensor_values, write_conversion
from cflow.convert.gguf import (GGUFModel, UnsupportedArchitectureError, gguf_config, gguf_tensors,
                                gguf_tokenizer)
from cflow.fileformat import open_model

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from test_convert_gguf import add_tensor, add_tiny_tokenizer, llama_cpp_permute, tiny_vocab  # noqa: E402
from test_convert_gguf_moe import gguf_values, teacher_forced, tokens, unpermute  # noqa: E402

# Skips this module when llama_cpp is not importable: its tolerances are written against it.
from test_moe_llamacpp import check, far, llama_cpp_logits  # noqa: E402

T = gguf.GGMLQuantizationType
D, HEADS, KV_HEADS, LAYERS, FF, CTX = 256, 4, 2, 2, 512, 64
EPS, THETA = 1e-6, 1e6
WINDOW, STEPS = 16, 32
# llama_bias: a llama file with q/k/v biases (llama.cpp reads them as optional), permuted with Q/K;
# llama3: a llama file with Llama 3's RoPE frequency factors (the rope_freqs tensor); llama_yarn:
# one with YaRN RoPE scaling (factor 4 over an original context of 16 positions)
FAMILIES = ("qwen2", "qwen3", "mistral", "llama_bias", "llama3", "llama_yarn", "mistral3")
ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama", "llama_bias": "llama", "llama3": "llama",
        "llama_yarn": "llama", "mistral3": "mistral3"}
BIASED = ("qwen2", "llama_bias")
PERMUTED = ("mistral", "llama_bias", "llama3", "llama_yarn", "mistral3")
ROPE_SCALED = ("llama3", "llama_yarn", "mistral3")
YARN_FACTOR, YARN_ORIG = 4.0, 16
# mistral3: YaRN's log multiplier (mscale_all_dim; Ministral 3 has 1, which cancels the magnitude
# correction: 3 turns it to 0.80, far from plain YaRN's 1.14, so the rule is seen) and the
# temperature's beta (Ministral 3: 0.1; 0.5 moves the logits past position YARN_ORIG by far more
# than the tolerance)
LOG_MUL, TEMP_BETA = 3.0, 0.5


def yarn(hd: int) -> tuple[tuple, float]:
    """(per-pair divisors, mscale) of YaRN as ggml_rope_yarn_corr_dims / rope_yarn define it
    (beta_fast 32, beta_slow 1, ext_factor 1, attn_factor 1), written out here in float32 as ggml
    computes it."""
    f32 = np.float32

    def corr(beta):
        return f32(hd) * np.log(f32(YARN_ORIG) / (f32(beta) * f32(2 * np.pi))) / (f32(2) * np.log(f32(THETA)))

    low, high = max(f32(0), np.floor(corr(32.0))), min(f32(hd - 1), np.ceil(corr(1.0)))
    out = []
    for j in range(hd // 2):
        y = (f32(j) - low) / max(f32(0.001), high - low)
        ramp = f32(1) - min(f32(1), max(f32(0), y))
        out.append(float(1 / (f32(1 / YARN_FACTOR) * (1 - ramp) + ramp)))
    return tuple(out), float(1 + 0.1 * np.log(YARN_FACTOR))


def yarn_mscale(family: str) -> float:
    """The cos/sin scale llama.cpp's YaRN ends with: 1 + 0.1 ln f, or with a log multiplier m
    (mistral3) (1 + 0.1 ln f) / (1 + 0.1 m ln f) (its context's yarn_attn_factor times ggml's
    1 + 0.1 ln f), in float32 as llama.cpp computes it."""
    f32, lf = np.float32, np.log(np.float32(YARN_FACTOR))
    if family == "mistral3":
        return float(f32(f32(1) + f32(0.1) * lf) / f32(f32(1) + f32(0.1) * f32(LOG_MUL) * lf))
    return float(1 + 0.1 * np.log(YARN_FACTOR))


def rope_factors(family: str) -> tuple:
    """llama3: a factor per rotation pair, log-uniform in [1/16, 16] (Llama 3's own run from 1 on the
    fast pairs to 8 on the slow ones, which over 32 positions would barely move a logit: these move
    every pair by far, so a runtime that ignores them fails), float32 as the file stores them."""
    if family != "llama3":
        return ()
    rng = np.random.default_rng(11)
    f = np.exp(rng.uniform(np.log(1 / 16), np.log(16), head_dim(family) // 2)).astype(np.float32)
    return tuple(float(x) for x in f)


def head_dim(family: str) -> int:
    return 96 if family == "qwen3" else D // HEADS  # Qwen3's key_length differs from d / n_heads


def family_weights(family: str, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-order float weights under GGUF names (Q/K not permuted). Scales as test_convert_gguf_moe's
    (every layer moves the logits; engine rounding in the 2-3% regime); biases large enough that
    dropping them moves the logits by far more than the tolerance."""
    rng = np.random.default_rng(seed)
    V, hd = len(tiny_vocab()), head_dim(family)
    q, kv = HEADS * hd, KV_HEADS * hd

    def mat(*shape, gain=1.0):
        return (gain * rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def norm(n=D, spread=0.1):
        return (1.0 + spread * rng.standard_normal(n)).astype(np.float32)

    w = {"token_embd.weight": rng.standard_normal((V, D)).astype(np.float32), "output_norm.weight": norm()}
    if family != "qwen2":  # Qwen2.5's small models tie the embeddings
        w["output.weight"] = mat(V, D)
    for i in range(LAYERS):
        b = f"blk.{i}."
        # peaked attention, so the rotation angles matter; YaRN's mscale sharpens it 1.3x more, and at 2.0
        # the int8 engine's rounding would reach the tolerance on the float reference
        qk_gain = {"llama3": 2.0, "llama_yarn": 1.5, "mistral3": 1.5}.get(family, 0.6)
        w.update({b + "attn_norm.weight": norm(), b + "attn_q.weight": mat(q, D, gain=qk_gain),
                  b + "attn_k.weight": mat(kv, D, gain=qk_gain), b + "attn_v.weight": mat(kv, D),
                  b + "attn_output.weight": mat(D, q, gain=0.5), b + "ffn_norm.weight": norm(),
                  b + "ffn_gate.weight": mat(FF, D), b + "ffn_up.weight": mat(FF, D),
                  b + "ffn_down.weight": mat(D, FF, gain=0.5)})
        if family in BIASED:
            w.update({b + "attn_q.bias": (0.5 * rng.standard_normal(q)).astype(np.float32),
                      b + "attn_k.bias": (0.5 * rng.standard_normal(kv)).astype(np.float32),
                      b + "attn_v.bias": (0.3 * rng.standard_normal(kv)).astype(np.float32)})
        if family == "qwen3":
            w.update({b + "attn_q_norm.weight": norm(hd, 0.3), b + "attn_k_norm.weight": norm(hd, 0.3)})
    if family == "llama3":
        w["rope_freqs.weight"] = np.array(rope_factors(family), np.float32)
    return w


YARN_KEYS = {"rope.scaling.type": "yarn", "rope.scaling.factor": YARN_FACTOR,
             "rope.scaling.original_context_length": YARN_ORIG}


def write_family_gguf(path: Path, family: str, seed: int = 0, rope_keys: dict | None = None) -> None:
    """`rope_keys`: {key under the arch's prefix: value} written over the family's own RoPE scaling
    (llama_yarn: YARN_KEYS)."""
    w = family_weights(family, seed)
    hd = head_dim(family)
    if family in PERMUTED:  # a LlamaModel in convert_hf_to_gguf.py: Q and K permuted, biases too
        for i in range(LAYERS):
            for n, heads in (("q", HEADS), ("k", KV_HEADS)):
                for kind in ("weight", "bias"):
                    if f"blk.{i}.attn_{n}.{kind}" in w:
                        w[f"blk.{i}.attn_{n}.{kind}"] = llama_cpp_permute(w[f"blk.{i}.attn_{n}.{kind}"], heads)
    wr = gguf.GGUFWriter(str(path), ARCH[family])
    wr.add_name(f"tiny-{family}")
    wr.add_block_count(LAYERS)
    wr.add_context_length(CTX)
    wr.add_embedding_length(D)
    wr.add_feed_forward_length(FF)
    wr.add_head_count(HEADS)
    wr.add_head_count_kv(KV_HEADS)
    wr.add_rope_freq_base(THETA)
    wr.add_layer_norm_rms_eps(EPS)
    wr.add_rope_dimension_count(hd)
    if family == "qwen3":
        wr.add_key_length(hd)
        wr.add_value_length(hd)
    if family == "mistral":
        wr.add_sliding_window(WINDOW)
    extra = {"llama_yarn": YARN_KEYS, "mistral3": {**YARN_KEYS, "rope.scaling.yarn_log_multiplier": LOG_MUL,
                                                   "attention.temperature_scale": TEMP_BETA}}.get(family, {})
    for key, v in {**extra, **(rope_keys or {})}.items():
        add = wr.add_string if isinstance(v, str) else wr.add_uint32 if isinstance(v, int) else wr.add_float32
        add(f"{ARCH[family]}.{key}", v)
    add_tiny_tokenizer(wr)
    for name, x in w.items():
        add_tensor(wr, name, x, T.F32 if x.ndim == 1 else T.Q8_0)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


def expected_config(family: str, window: int | None = None) -> ModelConfig:
    window = (WINDOW if family == "mistral" else 0) if window is None else window
    return ModelConfig(vocab_size=len(tiny_vocab()), d_model=D, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS,
                       head_dim=head_dim(family), d_ff=FF, n_experts=0, top_k=0, d_expert=0, rope_theta=THETA,
                       norm_eps=float(np.float32(EPS)), max_seq_len=CTX, tie_embeddings=family == "qwen2",
                       qkv_bias=family in BIASED, qk_norm=family == "qwen3", sliding_window=window,
                       rope_freq_factors=rope_factors(family), name=ARCH[family],
                       **(dict(attn_temp_scale=TEMP_BETA, attn_temp_floor=YARN_ORIG) if family == "mistral3" else {}))


def expected_rope(family: str) -> dict:
    if family in ("llama_yarn", "mistral3"):
        factors, _ = yarn(head_dim(family))
        return dict(rope_freq_factors=factors, rope_mscale=yarn_mscale(family))
    return {}


def same_config(got: ModelConfig, want: ModelConfig, family: str) -> None:
    """Equal, the YaRN divisors to float32 precision (the converter computes them in float64)."""
    rope = expected_rope(family)
    if rope:
        np.testing.assert_allclose(got.rope_freq_factors, rope["rope_freq_factors"], rtol=1e-5)
        assert abs(got.rope_mscale - rope["rope_mscale"]) < 1e-6
        got = got.replace(rope_freq_factors=(), rope_mscale=1.0)
    assert got == want


def reference_state(path: Path, family: str, drop: str = "") -> dict[str, np.ndarray]:
    """The PyTorch reference's parameters from the GGUF alone; `drop` ("bias", "qk_norm") zeroes
    the biases or leaves the q/k norms out (the controls; the latter for a config without qk_norm)."""
    g = GGUFModel(path)
    v = lambda n: gguf_values(g, n)  # noqa: E731
    qk = (lambda x, h: unpermute(x, h)) if family in PERMUTED else (lambda x, h: x)
    sd = {"tok_emb.weight": v("token_embd.weight"), "norm.weight": v("output_norm.weight")}
    if family != "qwen2":
        sd["lm_head.weight"] = v("output.weight")
    for i in range(LAYERS):
        b, p = f"blk.{i}.", f"layers.{i}."
        sd.update({p + "attn_norm.weight": v(b + "attn_norm.weight"),
                   p + "attn.wq.weight": qk(v(b + "attn_q.weight"), HEADS),
                   p + "attn.wk.weight": qk(v(b + "attn_k.weight"), KV_HEADS),
                   p + "attn.wv.weight": v(b + "attn_v.weight"), p + "attn.wo.weight": v(b + "attn_output.weight"),
                   p + "ffn_norm.weight": v(b + "ffn_norm.weight"), p + "ffn.w_gate.weight": v(b + "ffn_gate.weight"),
                   p + "ffn.w_up.weight": v(b + "ffn_up.weight"), p + "ffn.w_down.weight": v(b + "ffn_down.weight")})
        if family in BIASED:
            for n, heads in (("q", HEADS), ("k", KV_HEADS), ("v", None)):
                x = v(b + f"attn_{n}.bias")
                sd[p + f"attn.w{n}.bias"] = (qk(x, heads) if heads else x) * (drop != "bias")
        if family == "qwen3" and drop != "qk_norm":
            for n in "qk":
                sd[p + f"attn.{n}_norm.weight"] = v(b + f"attn_{n}_norm.weight")
    return sd


def reference_logits(cfg: ModelConfig, sd: dict[str, np.ndarray], toks: list[int]) -> np.ndarray:
    from cflow.model import ReferenceDecoder, Transformer

    ref = ReferenceDecoder(Transformer.from_state(cfg, {k: torch.from_numpy(np.ascontiguousarray(x))
                                                         for k, x in sd.items()}))
    return teacher_forced(lambda t, pos: ref.step(t).numpy(), toks)


def engine_logits(path: Path, toks: list[int]) -> np.ndarray:
    from cflow.runtime import Engine

    return teacher_forced(Engine.load(path, threads=1).step, toks)


def write_windowed(src: Path, dst: Path, window: int) -> None:
    """src converted as `convert` does, with the config's sliding_window set to `window`."""
    g = GGUFModel(src)
    cfg = gguf_config(g).replace(sliding_window=window)
    enc = Encoder("q8_0")
    write_conversion(src, dst, cfg, gguf_tokenizer(g), gguf_tensors(g, cfg, enc), enc, {"source": {}},
                     order="cflow", tile=(128, 256), progress=None, started=0.0)


# ---- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=FAMILIES)
def family_run(request, tmp_path_factory):
    """(family, gguf path, cflow path, tokens, engine logits)."""
    family = request.param
    d = tmp_path_factory.mktemp(family)
    src, dst = d / f"{family}.gguf", d / f"{family}.cflow"
    write_family_gguf(src, family)
    convert(src, dst)
    toks = tokens(STEPS, seed=7)
    return family, src, dst, toks, engine_logits(dst, toks)


@pytest.fixture(scope="module")
def llama_cpp_run(family_run):
    family, src, _, toks, _ = family_run
    return llama_cpp_logits(src, toks)


# ---- import ----------------------------------------------------------------------------------
def test_config_and_metadata(family_run):
    family, src, dst, _, _ = family_run
    same_config(gguf_config(GGUFModel(src)), expected_config(family), family)
    f = open_model(dst)
    same_config(f.config, expected_config(family), family)
    source = f.header["metadata"]["source"]
    assert source["architecture"] == ARCH[family]
    assert "sliding_window_ignored" not in source  # the Mistral file's window is honoured
    names = set(f.tensors)
    assert ("layers.1.attn.qkv_bias" in names) == (family in BIASED)
    assert ("layers.1.attn.q_norm" in names) == ("layers.1.attn.k_norm" in names) == (family == "qwen3")
    f.close()


def test_biases_and_norms_are_the_gguf_values(family_run):
    """bq | bk | bv fused in that order, un-permuted with Q/K for llama only (qwen2 is NEOX); q/k
    norms as stored."""
    family, src, dst, _, _ = family_run
    if family in ("mistral",) + ROPE_SCALED:
        pytest.skip("no biases or q/k norms in this family")
    sd, f = reference_state(src, family), open_model(dst)

    def stored(name):
        e = f.tensors[name]
        return tensor_values(e.dtype, e.shape, e.layout, f.array(name), f.tile)

    for i in range(LAYERS):
        p = f"layers.{i}."
        if family in BIASED:
            want = np.concatenate([sd[p + f"attn.w{n}.bias"] for n in "qkv"])
            np.testing.assert_array_equal(stored(p + "attn.qkv_bias"), want)
        else:
            for n in "qk":
                np.testing.assert_array_equal(stored(p + f"attn.{n}_norm"), sd[p + f"attn.{n}_norm.weight"])
    f.close()


def test_config_checks_the_options():
    from cflow.config import ConfigError

    cfg = expected_config("qwen3")
    assert cfg.with_overrides(["sliding_window=8", "qkv_bias=true"]) == cfg.replace(sliding_window=8, qkv_bias=True)
    with pytest.raises(ConfigError, match="sliding_window must be >= 0"):
        cfg.replace(sliding_window=-1)
    with pytest.raises(ConfigError, match="qk_norm must be true or false"):
        cfg.replace(qk_norm=1)


@pytest.mark.parametrize("arch, match", [("gemma2", "'gemma2' model; cflow converts GGUF architectures"),
                                         ("qwen3vl", "'qwen3vl' model; cflow converts GGUF architectures")])
def test_refused_architectures(tmp_path, arch, match):
    wr = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    add_tiny_tokenizer(wr)
    wr.add_tensor("token_embd.weight", np.zeros((len(tiny_vocab()), 32), np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    with pytest.raises(UnsupportedArchitectureError, match=match):
        convert(tmp_path / "m.gguf", tmp_path / "m.cflow")
    assert not (tmp_path / "m.cflow").exists()


# ---- the engine against the oracles ----------------------------------------------------------
def test_engine_matches_reference(family_run):
    family, src, _, toks, got = family_run
    cfg = expected_config(family).replace(**expected_rope(family))
    check(got, reference_logits(cfg, reference_state(src, family), toks), moe=False)


def before_window(family: str, logits: np.ndarray) -> np.ndarray:
    """The positions where an oracle that ignores the Mistral file's window must agree with it."""
    return logits[:WINDOW] if family == "mistral" else logits


def test_engine_matches_llama_cpp(family_run, llama_cpp_run):
    family = family_run[0]
    check(before_window(family, family_run[4]), before_window(family, llama_cpp_run), moe=False)


def test_reference_matches_llama_cpp_and_needs_the_feature(family_run, llama_cpp_run):
    """llama.cpp and the float reference agree; without the family's feature they do not (the
    NEOX/permuted RoPE choice is covered too: a wrong one fails test_engine_matches_llama_cpp)."""
    family, src, _, toks, _ = family_run
    cfg = expected_config(family).replace(**expected_rope(family))
    ref = reference_logits(cfg, reference_state(src, family), toks)
    check(before_window(family, ref), before_window(family, llama_cpp_run), moe=False)
    if family == "mistral":
        # past W the window (which llama.cpp ignores) changes the logits by far
        assert far(ref[WINDOW:], llama_cpp_run[WINDOW:])
        # converted without it (cflow convert --sliding-window 0), the engine is llama.cpp's everywhere
        nowin = src.with_name("mistral-nowindow.cflow")
        convert(src, nowin, sliding_window=0)
        assert open_model(nowin).config.sliding_window == 0
        check(engine_logits(nowin, toks), llama_cpp_run, moe=False)
        check(reference_logits(cfg.replace(sliding_window=0), reference_state(src, family), toks), llama_cpp_run,
              moe=False)
    elif family in BIASED:
        assert far(reference_logits(cfg, reference_state(src, family, drop="bias"), toks), llama_cpp_run)
    elif family in ROPE_SCALED:
        if family == "mistral3":  # the temperature: 1 before position n_orig, far from it after
            cold = reference_logits(cfg.replace(attn_temp_scale=0.0, attn_temp_floor=0), reference_state(src, family),
                                    toks)
            np.testing.assert_array_equal(cold[:YARN_ORIG], ref[:YARN_ORIG])
            assert far(cold[YARN_ORIG:], llama_cpp_run[YARN_ORIG:])
            # and the log multiplier's magnitude rule: plain YaRN's (1 + 0.1 ln f) misses
            plain = cfg.replace(rope_mscale=float(1 + 0.1 * np.log(YARN_FACTOR)))
            assert far(reference_logits(plain, reference_state(src, family), toks), llama_cpp_run)
        assert far(reference_logits(cfg.replace(rope_freq_factors=(), rope_mscale=1.0), reference_state(src, family),
                                    toks), llama_cpp_run)
    else:
        assert far(reference_logits(cfg.replace(qk_norm=False), reference_state(src, family, drop="qk_norm"), toks),
                   llama_cpp_run)


@pytest.mark.parametrize("family_run", ["mistral3"], indirect=True)
def test_temperature_prefill_equals_steps(family_run):
    """The temperature is per row: prefill blocks that cross position YARN_ORIG and rows of several
    sequences give the steps' logits."""
    from test_engine import rel_err

    from cflow.runtime import Engine

    _, _, dst, toks, got = family_run
    eng = Engine.load(dst, threads=2, max_batch=5)
    for n in (YARN_ORIG - 1, YARN_ORIG + 3, STEPS):
        assert rel_err(eng.prefill(toks[:n]), got[n - 1]) < 1e-5
    two = Engine.load(dst, threads=2, n_seq=2)
    two.prefill(toks[:YARN_ORIG], seq=0)
    rows = two.step_rows([0, 0, 1], [toks[YARN_ORIG], toks[YARN_ORIG + 1], toks[0]], [YARN_ORIG, YARN_ORIG + 1, 0])
    assert rel_err(rows[1], got[YARN_ORIG + 1]) < 1e-5 and rel_err(rows[2], got[0]) < 1e-5


def test_transformers_loads_the_gguf(family_run):
    """HF transformers' own GGUF loader (dequantize, Q/K un-permuted for llama, its modelling code)
    as a third oracle; it reads the Mistral file as a Llama, without a window, as llama.cpp does,
    so there it is compared before W."""
    family, src, _, toks, got = family_run
    transformers = pytest.importorskip("transformers")
    if family in ROPE_SCALED:
        pytest.skip("transformers' GGUF loader drops the rope_freqs tensor and the YaRN keys (its RoPE scaling "
                    "is a parametric form of its own; this file's factors are arbitrary)")
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                               dtype=torch.float32)
    except Exception as e:  # an architecture this transformers cannot load from GGUF
        pytest.skip(f"transformers cannot load this {family} GGUF: {type(e).__name__}: {e}")
    if family in BIASED and hf.model.layers[0].self_attn.q_proj.bias is None:
        pytest.skip(f"transformers loads this {family} GGUF without its q/k/v biases "
                    "(its GGUF config for arch llama has no attention_bias)")
    with torch.no_grad():
        want = hf(torch.tensor([toks])).logits[0].double().numpy()
    check(before_window(family, got), before_window(family, want), moe=False)


# ---- sliding window --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def window_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("window")
    src, dst = d / "mistral.gguf", d / "mistral-w8.cflow"
    write_family_gguf(src, "mistral", seed=3)
    write_windowed(src, dst, WINDOW)
    toks = tokens(STEPS, seed=11)
    return src, dst, toks, engine_logits(dst, toks)


def test_sliding_window_matches_reference(window_run, tmp_path):
    src, dst, toks, got = window_run
    cfg = expected_config("mistral", WINDOW)
    assert open_model(dst).config == cfg
    sd = reference_state(src, "mistral")
    check(got, reference_logits(cfg, sd, toks), moe=False)
    # the whole-sequence (training) path masks the same keys as the token-by-token one
    from cflow.model import Transformer

    tm = Transformer.from_state(cfg, {k: torch.from_numpy(np.ascontiguousarray(x)) for k, x in sd.items()})
    with torch.no_grad():
        check(got, tm(torch.tensor([toks]))[0][0].double().numpy(), moe=False)
    # control: the same file without the window agrees before position W and is far after it
    write_windowed(src, tmp_path / "full.cflow", 0)
    full = engine_logits(tmp_path / "full.cflow", toks)
    np.testing.assert_array_equal(full[:WINDOW], got[:WINDOW])
    assert far(full[WINDOW:], got[WINDOW:])


def test_sliding_window_prefill_equals_steps(window_run):
    """The batched path (prefill, rows at different positions) applies the window per row."""
    from test_engine import rel_err

    from cflow.runtime import Engine

    _, dst, toks, got = window_run
    eng = Engine.load(dst, threads=2)
    for n in (WINDOW - 1, WINDOW + 3, STEPS):
        assert rel_err(eng.prefill(toks[:n]), got[n - 1]) < 1e-5


def test_sliding_window_matches_transformers(window_run):
    """transformers' Mistral (eager attention, sliding_window = W) on the reference's weights."""
    transformers = pytest.importorskip("transformers")
    src, _, toks, got = window_run
    hc = transformers.MistralConfig(sliding_window=WINDOW, **hf_config_kwargs("mistral"))
    check(got, hf_logits(transformers.MistralForCausalLM(hc), reference_state(src, "mistral"), toks), moe=False)


@pytest.mark.parametrize("family_run", ["qwen3"], indirect=True)
def test_qwen3_matches_transformers_modelling(family_run):
    """transformers cannot load a Qwen3 GGUF whose head_dim differs from d / n_heads (its GGUF config
    mapping drops key_length), so its Qwen3 modelling code runs on the reference's weights instead."""
    transformers = pytest.importorskip("transformers")
    family, src, _, toks, got = family_run
    hc = transformers.Qwen3Config(**hf_config_kwargs("qwen3"))
    check(got, hf_logits(transformers.Qwen3ForCausalLM(hc), reference_state(src, "qwen3"), toks), moe=False)


def hf_config_kwargs(family: str) -> dict:
    return dict(vocab_size=len(tiny_vocab()), hidden_size=D, intermediate_size=FF, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=head_dim(family),
                max_position_embeddings=CTX, rms_norm_eps=EPS, rope_theta=THETA, tie_word_embeddings=family == "qwen2",
                attn_implementation="eager")


def hf_logits(hf, sd: dict[str, np.ndarray], toks: list[int]) -> np.ndarray:
    """Logits [n, V] of a transformers Llama-like model loaded (strictly) with the reference's weights."""
    names = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
             "attn.wo.weight": "self_attn.o_proj.weight", "ffn.w_gate.weight": "mlp.gate_proj.weight",
             "ffn.w_up.weight": "mlp.up_proj.weight", "ffn.w_down.weight": "mlp.down_proj.weight",
             "attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight"}
    for n in "qkv":
        names |= {f"attn.w{n}.weight": f"self_attn.{n}_proj.weight", f"attn.w{n}.bias": f"self_attn.{n}_proj.bias"}
    state = {"model.embed_tokens.weight": sd["tok_emb.weight"], "model.norm.weight": sd["norm.weight"],
             "lm_head.weight": sd.get("lm_head.weight", sd["tok_emb.weight"])}
    for key, x in sd.items():
        if key.startswith("layers."):
            _, i, ours = key.split(".", 2)
            state[f"model.layers.{i}.{names[ours]}"] = x
    hf = hf.float().eval()
    hf.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(x)) for k, x in state.items()}, strict=True)
    with torch.no_grad():
        return hf(torch.tensor([toks])).logits[0].double().numpy()


# ---- every option on both QKV paths of the engine ----------------------------------------------
@pytest.mark.parametrize("n_heads, n_kv_heads", [(4, 2), (8, 2)])  # hd 24: head-split path; hd 12: the other
def test_all_options_against_the_dequantized_reference(tmp_path, n_heads, n_kv_heads):
    """A random model with biases, q/k norms and a window of 5, against the reference on the file's own
    dequantized weights, teacher-forced (steps) and through prefill."""
    from test_engine import dequantized_model, prompt_tokens, rel_err, small_config, write_random_model

    from cflow.model import ReferenceDecoder
    from cflow.runtime import Engine

    cfg = small_config("llama", tied=False, n_heads=n_heads, n_kv_heads=n_kv_heads).replace(
        qkv_bias=True, qk_norm=True, sliding_window=5)
    path = tmp_path / "m.cflow"
    write_random_model(path, cfg, "q8_0", (64, 64), spread=0.5)
    ref = ReferenceDecoder(dequantized_model(path))
    toks = prompt_tokens(cfg, 24, seed=4)
    got = teacher_forced(Engine.load(path, threads=2).step, toks)
    check(got, teacher_forced(lambda t, pos: ref.step(t).numpy(), toks), moe=False)
    assert rel_err(Engine.load(path, threads=2, max_batch=5).prefill(toks), got[-1]) < 1e-5


@pytest.mark.parametrize("extra, match", [
    ({"rope.scaling.type": "yarn", "rope.scaling.yarn_ext_factor": 0.5}, "yarn_ext_factor = 0.5"),
    ({"rope.scaling.type": "yarn", "rope.scaling.attn_factor": 0.5}, "attn_factor = 0.5"),
    ({"rope.scaling.type": "longrope"}, "longrope RoPE scaling"),
])
def test_rope_scalings_cflow_does_not_run_are_refused_by_name(tmp_path, extra, match):
    from cflow.convert.gguf import GGUFError

    src = tmp_path / "m.gguf"
    write_family_gguf(src, "llama_yarn", rope_keys=extra)
    with pytest.raises(GGUFError, match=match):
        convert(src, tmp_path / "m.cflow")
    assert not (tmp_path / "m.cflow").exists()
