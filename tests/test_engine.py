"""The C decode engine (cflow.engine over native/engine.c) against the PyTorch reference.

Small random models of every preset are quantized into .cflow files; the reference decoder
(cflow.model.ReferenceDecoder) runs on the *dequantized* weights of the same file, so weight
quantization is not part of any difference. Two references:

- QuantAwareReference adds the engine's two deliberate roundings to ReferenceDecoder: each
  quantized mat-vec sees its input rounded to int8 per 32-block (DESIGN.md), and K/V are stored
  as fp16. What is left is float summation order, so logits must agree to ~1e-4 of their spread
  and greedy decoding must pick the same 64 tokens. This is the test of the engine's logic
  (plan/delays, RoPE, GQA attention, routing, fused layouts, tiles).
- ReferenceDecoder as is (fp32 activations) bounds what those roundings cost: int8 activations
  carry ~0.4% relative error per mat-vec, which grows over layers to a few percent of the logit
  spread (FLOAT_TOL below); argmax must agree wherever the reference's top-1 margin is clearly
  larger than that error. MoE routing can legitimately flip at a near-tie of router
  probabilities, so that comparison is made on the dense presets and on the MoE presets'
  logits only at positions where the routing margin is safe (checked through agreement rates).

Each preset uses a different quantization, tile shape and thread count, with odd sizes (vocab
300: a short last row group; d 96: a tile narrower than TK; 5 layers: expert outputs that land
past the last layer for delta_expert = 2).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cflow import quant  # noqa: E402
from cflow.config import ModelConfig  # noqa: E402
from cflow.convert.checkpoint import checkpoint_tensors  # noqa: E402
from cflow.convert.common import Encoder, split_fused, tensor_values  # noqa: E402
from cflow.engine import (ContextOverflowError, Engine, EngineError, ModelFormatError,  # noqa: E402
                          ModelNotFoundError)
from cflow.fileformat import open_model, write_model  # noqa: E402
from cflow.model import ReferenceDecoder, Transformer  # noqa: E402
from cflow.sampling import SamplingError  # noqa: E402
from cflow.tokenizer import bytes_to_unicode  # noqa: E402

# preset -> (weight format, tile (rows, cols), threads, tied embeddings)
VARIANTS = {
    "llama": ("q4_1", (128, 256), 2, True),
    "arch1": ("q4_0", (64, 64), 1, False),
    "arch3": ("q4_1", (16, 32), 3, False),
    "arch2": ("q8_0", (32, 64), 2, False),
    "arch4": ("q4_0", (128, 256), 2, False),
    "arch2_4_combined": ("q8_0", (64, 64), 2, False),
    "arch5": ("q4_1", (64, 64), 2, True),
}
GAIN = 3.0         # weights x3 over the default init, so the layers move the logits (not only the embedding)
QUANT_TOL = 2e-4   # engine vs QuantAwareReference: max |dlogit| / logit std (summation order only)
FLOAT_TOL = 0.08   # engine vs ReferenceDecoder: max |dlogit| / logit std (int8 activations, fp16 KV)
STEPS = 64


# ---- building models -------------------------------------------------------------------------
def tokenizer_header(vocab_size: int, eos: int | None = None) -> dict:
    base = list(bytes_to_unicode().values())
    vocab = (base + [f"w{i}" for i in range(vocab_size)])[:vocab_size]
    return {"model": "bpe", "vocab": vocab, "merges": [], "bos_id": None, "eos_id": eos, "add_bos": False,
            "chat_template": None, "special": {}, "pre": None}


def small_config(preset: str, tied: bool = True, **kw) -> ModelConfig:
    base = dict(vocab_size=300, d_model=96, n_layers=5, n_heads=3, n_kv_heads=1, d_ff=160, max_seq_len=96,
                tie_embeddings=tied)
    if preset != "llama":
        base.update(n_experts=4, top_k=2, d_expert=96)
    if preset == "arch5":
        base["n_unique_layers"] = 2
    base.update(kw)
    return ModelConfig.from_name(preset, **base)


def write_random_model(path, cfg: ModelConfig, dtype: str, tile, seed: int = 0, eos: int | None = None) -> None:
    torch.manual_seed(seed)
    m = Transformer(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(GAIN)
    w = {k: v.detach().numpy().astype(np.float32) for k, v in m.state_dict().items()}
    write_model(path, config=cfg.to_dict(), tokenizer=tokenizer_header(cfg.vocab_size, eos),
                tensors=list(checkpoint_tensors(cfg, w, Encoder(dtype, tile))), tile=tile)


def dequantized_model(path) -> Transformer:
    """The Transformer whose weights are exactly the .cflow file's, dequantized."""
    cf = open_model(path)
    cfg = cf.config

    def val(name: str) -> np.ndarray:
        e = cf.tensors[name]
        return tensor_values(e.dtype, e.shape, e.layout, cf.array(name), cf.tile)

    def parts(name: str) -> list[np.ndarray]:
        return split_fused(val(name), cf.tensors[name].meta)

    sd = {"tok_emb.weight": val("tok_emb"), "norm.weight": val("norm")}
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = val("lm_head")
    for i in range(cfg.n_unique_layers):
        p = f"layers.{i}."
        sd[p + "attn_norm.weight"] = val(p + "attn_norm")
        sd[p + "attn.wq.weight"], sd[p + "attn.wk.weight"], sd[p + "attn.wv.weight"] = parts(p + "attn.wqkv")
        sd[p + "attn.wo.weight"] = val(p + "attn.wo")
        if cfg.has_dense:
            sd[p + "ffn_norm.weight"] = val(p + "ffn_norm")
            sd[p + "ffn.w_gate.weight"], sd[p + "ffn.w_up.weight"] = parts(p + "ffn.w_gate_up")
            sd[p + "ffn.w_down.weight"] = val(p + "ffn.w_down")
        if cfg.has_moe:
            sd[p + "moe_norm.weight"] = val(p + "moe_norm")
            sd[p + "moe.router.weight"] = val(p + "moe.router")
            ex = [parts(f"{p}moe.experts.{e}.w_gate_up") + [val(f"{p}moe.experts.{e}.w_down")]
                  for e in range(cfg.n_experts)]
            for j, key in enumerate(("moe.w_gate", "moe.w_up", "moe.w_down")):
                sd[p + key] = np.stack([x[j] for x in ex])
    cf.close()
    return Transformer.from_state(cfg, {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()})


# ---- the quantization-aware reference --------------------------------------------------------
def _int8_round_trip(x: torch.Tensor) -> torch.Tensor:
    qs, d, _ = quant.quantize_act(x.detach().numpy().astype(np.float32))
    return torch.from_numpy(qs.reshape(-1, quant.QK).astype(np.float64) * d[:, None].astype(np.float64)).flatten()


class _Int8Input:
    """A weight matrix (or stack of expert matrices) whose `@ x` first rounds x as the engine does."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w.double()

    def __getitem__(self, i) -> "_Int8Input":
        return _Int8Input(self.w[i])

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w @ _int8_round_trip(x)).float()


class _F16Store(torch.Tensor):
    """A KV cache that stores what is written to it rounded to fp16, as the engine's cache does."""

    def __setitem__(self, idx, val) -> None:
        super().__setitem__(idx, torch.as_tensor(val).half().float())


class QuantAwareReference(ReferenceDecoder):
    """ReferenceDecoder plus the engine's int8 activation rounding and fp16 KV cache."""

    def __init__(self, model: Transformer, max_seq_len: int | None = None) -> None:
        super().__init__(model, max_seq_len)
        for W in self.sets:
            for k in list(W):
                if W[k].dim() >= 2 and "router" not in k:
                    W[k] = _Int8Input(W[k])
        self.out_w = _Int8Input(self.out_w)
        self.k_cache = self.k_cache.as_subclass(_F16Store)
        self.v_cache = self.v_cache.as_subclass(_F16Store)


# ---- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=list(VARIANTS))
def model(request, tmp_path_factory):
    preset = request.param
    dtype, tile, threads, tied = VARIANTS[preset]
    cfg = small_config(preset, tied)
    path = tmp_path_factory.mktemp(preset) / "m.cflow"
    write_random_model(path, cfg, dtype, tile)
    return preset, path, threads, dequantized_model(path)


def prompt_tokens(cfg: ModelConfig, n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, cfg.vocab_size, n)]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / b.std())


# ---- engine vs references --------------------------------------------------------------------
def test_greedy_matches_quant_aware_reference(model):
    preset, path, threads, tm = model
    eng = Engine.load(path, threads=threads)
    ref = QuantAwareReference(tm)
    cfg = eng.config
    prompt = prompt_tokens(cfg, 8)
    worst = 0.0
    ref_toks, eng_toks = [], []
    for pos, t in enumerate(prompt):
        lr, le = ref.step(t).numpy(), eng.step(t, pos)
        worst = max(worst, rel_err(le, lr))
    # Free-running greedy: each side feeds its own argmax back.
    tok_r = tok_e = int(np.argmax(lr))
    for i in range(STEPS):
        ref_toks.append(tok_r)
        eng_toks.append(tok_e)
        pos = len(prompt) + i
        lr = ref.step(tok_r).numpy()
        le = eng.step(tok_e, pos)
        if tok_r == tok_e:
            worst = max(worst, rel_err(le, lr))
        tok_r, tok_e = int(np.argmax(lr)), int(np.argmax(le))
    assert worst < QUANT_TOL, f"{preset}: max |dlogit| / std = {worst:.2e}"
    assert eng_toks == ref_toks, f"{preset}: greedy tokens diverge at step " \
                                 f"{next(i for i, (a, b) in enumerate(zip(eng_toks, ref_toks)) if a != b)}"
    assert len(set(eng_toks)) > 3, "degenerate model: greedy output is (nearly) constant"


def test_logits_close_to_float_reference(model):
    preset, path, threads, tm = model
    eng = Engine.load(path, threads=threads)
    ref = ReferenceDecoder(tm)
    cfg = eng.config
    errs, margins, agree = [], [], []
    for pos, t in enumerate(prompt_tokens(cfg, 48, seed=1)):
        lr, le = ref.step(t).numpy(), eng.step(t, pos).copy()
        errs.append(rel_err(le, lr))
        top2 = np.sort(lr)[-2:]
        margins.append((top2[1] - top2[0]) / lr.std())
        agree.append(int(np.argmax(lr)) == int(np.argmax(le)))
    errs, margins, agree = np.array(errs), np.array(margins), np.array(agree)
    if not eng.config.has_moe:
        assert errs.max() < FLOAT_TOL, f"{preset}: max |dlogit| / std = {errs.max():.3f}"
    else:
        # a routing flip at a near-tie changes one layer's expert: allow it at few positions
        assert np.median(errs) < FLOAT_TOL / 2 and np.mean(errs < FLOAT_TOL) >= 0.9, \
            f"{preset}: errors {np.round(errs, 3)}"
    safe = margins > 2 * FLOAT_TOL
    assert safe.sum() >= 10, "too few decisive positions to compare argmax"
    assert agree[safe].mean() >= (1.0 if not eng.config.has_moe else 0.95)


def test_prefill_equals_steps(model):
    preset, path, threads, _ = model
    cfg = open_model(path).config
    toks = prompt_tokens(cfg, 29, seed=2)
    a = Engine.load(path, threads=threads, max_batch=8)  # 29 = 8 + 8 + 8 + 5: partial last batch
    b = Engine.load(path, threads=threads)
    la = a.prefill(toks).copy()
    for pos, t in enumerate(toks):
        lb = b.step(t, pos)
    assert rel_err(la, lb) < 1e-5
    # and decoding continues identically from either cache
    assert rel_err(a.step(7, len(toks)), b.step(7, len(toks))) < 1e-5


def test_thread_counts_agree(model):
    preset, path, threads, _ = model
    cfg = open_model(path).config
    toks = prompt_tokens(cfg, 12, seed=3)
    pre, last = {}, {}
    for n in (1, 2, 3):  # 3: more threads than this machine may have cores
        eng = Engine.load(path, threads=n)
        pre[n] = eng.prefill(toks[:-1]).copy()
        last[n] = eng.step(toks[-1], len(toks) - 1).copy()
    for n in (2, 3):
        assert rel_err(pre[n], pre[1]) < 1e-5 and rel_err(last[n], last[1]) < 1e-5


# ---- byte counters (claim C3: only the top-k experts are read) -------------------------------
def test_counters_count_top_k_experts_only(tmp_path):
    cfg = small_config("arch2_4_combined", tied=False)
    path = tmp_path / "m.cflow"
    write_random_model(path, cfg, "q4_0", (64, 64))
    eng = Engine.load(path, threads=2)
    cf = eng.file
    nb = lambda n: cf.tensors[n].nbytes  # noqa: E731
    eng.reset_counters()
    eng.step(5, 0)
    c = eng.counters()
    L, E, k = cfg.n_layers, cfg.n_experts, cfg.top_k
    expert = nb("layers.0.moe.experts.0.w_gate_up") + nb("layers.0.moe.experts.0.w_down")
    assert c["experts"] == L * k * expert  # all experts have the same size
    assert c["experts"] < L * E * expert
    assert c["dense"] == L * (nb("layers.0.ffn.w_gate_up") + nb("layers.0.ffn.w_down"))
    assert c["attn"] == L * (nb("layers.0.attn.wqkv") + nb("layers.0.attn.wo"))
    assert c["lm_head"] == nb("lm_head")
    assert c["embed"] == nb("tok_emb") // cfg.vocab_size
    assert c["router"] == L * nb("layers.0.moe.router")
    assert c["tokens"] == 1 and c["calls"] == 1
    hits = np.array(eng.expert_hits())
    assert hits.shape == (L, E) and (hits.sum(axis=1) == k).all()
    assert eng.weight_bytes_per_token() == pytest.approx(
        sum(c[x] for x in ("attn", "dense", "router", "experts", "embed", "lm_head")) + nb("norm")
        + L * (nb("layers.0.attn_norm") + nb("layers.0.ffn_norm") + nb("layers.0.moe_norm")))


# ---- generation, errors ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    cfg = small_config("llama", max_seq_len=64)
    path = tmp_path_factory.mktemp("llama") / "m.cflow"
    write_random_model(path, cfg, "q8_0", (128, 256), eos=3)
    return path


def test_generate_streams_what_complete_returns(llama_path):
    eng = Engine.load(llama_path, threads=2)
    kw = dict(max_tokens=20, temperature=0.9, top_k=50, top_p=0.9, min_p=0.02, seed=11)
    streamed = "".join(eng.generate("abc", **kw))
    c = eng.complete("abc", **kw)
    assert streamed == c.text and len(c.tokens) <= 20
    assert c.text == eng.tokenizer.decode(c.tokens, skip_special=True)
    assert c.timings.gen_tokens >= len(c.tokens) and c.timings.prompt_tokens >= 1
    # the same seed reproduces, another seed (almost surely) does not
    assert eng.complete("abc", **kw).tokens == c.tokens
    assert eng.complete("abc", **{**kw, "seed": 12}).tokens != c.tokens


def test_greedy_complete_matches_steps_and_reuses_prefix(llama_path):
    eng = Engine.load(llama_path, threads=1)
    c = eng.complete([10, 20, 30], max_tokens=10, temperature=0)
    ref = Engine.load(llama_path, threads=1)
    logits = ref.prefill([10, 20, 30])
    toks = []
    for i in range(len(c.tokens)):
        toks.append(int(np.argmax(logits)))
        logits = ref.step(toks[-1], 3 + i)
    assert c.tokens == toks
    again = eng.complete([10, 20, 30], max_tokens=10, temperature=0)
    assert again.tokens == c.tokens and again.timings.reused_tokens == 2


def test_stop_string_and_eos(llama_path):
    eng = Engine.load(llama_path, threads=2)
    c = eng.complete([1, 2], max_tokens=30, temperature=0)
    assert c.text, "the model should say something"
    cut = c.text[len(c.text) // 2:][:2]
    s = eng.complete([1, 2], max_tokens=30, temperature=0, stop=[cut])
    assert s.finish_reason == "stop" and cut not in s.text and c.text.startswith(s.text)
    # an end-of-sequence id ends generation and is not part of the output: make the 4th greedy
    # token the EOS of this tokenizer
    eos = c.tokens[3]
    first = c.tokens[:c.tokens.index(eos)]
    eng.tokenizer.eos_id = eos
    e = eng.complete([1, 2], max_tokens=30, temperature=0)
    assert e.finish_reason == "stop" and e.tokens == first


def test_context_overflow_names_the_limit_and_flag(llama_path):
    eng = Engine.load(llama_path, threads=1, n_ctx=16)
    with pytest.raises(ContextOverflowError, match=r"16.*-c"):
        eng.complete(list(range(20)), max_tokens=1)
    with pytest.raises(ContextOverflowError):
        eng.prefill(list(range(17)))
    # generation that reaches the end of the context stops with "length"
    c = eng.complete(list(range(10)), max_tokens=100, temperature=0)
    assert c.finish_reason in ("length", "stop") and 10 + len(c.tokens) <= 17
    with pytest.raises(EngineError, match="max_seq_len"):
        Engine.load(llama_path, n_ctx=10_000)


def test_bad_inputs_raise_named_errors(llama_path, tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        Engine.load(tmp_path / "nope.cflow")
    junk = tmp_path / "junk.cflow"
    junk.write_bytes(b"not a model at all" * 10)
    with pytest.raises(ModelFormatError):
        Engine.load(junk)
    eng = Engine.load(llama_path, threads=1)
    with pytest.raises(SamplingError, match="top_p"):
        eng.complete("a", top_p=1.5)
    with pytest.raises(SamplingError, match="temperature"):
        eng.complete("a", temperature=-1)
    with pytest.raises(EngineError, match="vocabulary"):
        eng.complete([10_000])
    with pytest.raises(EngineError, match="skips"):
        eng.step(1, 5)


def test_descriptor_rejects_untiled_matrix(llama_path, tmp_path):
    # A header that claims a matrix is stored as plain rows: the engine refuses by name.
    cf = open_model(llama_path)
    e = cf.tensors["layers.0.attn.wo"]
    bad = type(e)(e.name, e.dtype, e.shape, "rows", e.offset, e.nbytes, e.checksum, e.meta)
    cf.tensors["layers.0.attn.wo"] = bad
    with pytest.raises(EngineError, match="layers.0.attn.wo"):
        Engine(cf, threads=1)
    assert json.dumps(cf.config.to_dict())  # the file object is still usable
