"""The Qwen mixture-of-experts GGUF families, end to end (GGUF -> .cflow -> C engine -> tokens):

- Qwen2-MoE (`qwen2moe`): q/k/v biases, NEOX RoPE, top-k over the softmax WITHOUT renormalising
  the k weights, and a shared expert (`ffn_{gate,up,down}_shexp`) every token runs, its output
  scaled by sigmoid(ffn_gate_inp_shexp . x);
- Qwen3-MoE (`qwen3moe`): per-head q/k RMSNorm (head_dim from key_length, != d / n_heads here),
  top-k with renormalisation, no shared expert, tied embeddings.

Each GGUF is written here with gguf.GGUFWriter the way convert_hf_to_gguf.py writes that family
(expert stacks 3-D, expert_feed_forward_length, expert_shared_feed_forward_length; weights Q8_0,
norms, biases, routers and the shared gate F32; d 128, 2 layers, 8 experts top-2 of hidden 64, the
shared expert's hidden 96). Oracles, with test_moe_llamacpp's MoE tolerances (max|dlogit| /
std(logits) per position: median <= 4%, >= 85% of positions <= 7%, argmax equal at >= 95% of the
positions where the oracle's top-1 margin exceeds 0.2 std):
- llama.cpp (llama-cpp-python) on the same GGUF;
- the PyTorch reference (cflow.model.ReferenceDecoder) over weights taken from the GGUF alone
  (gguf.quants.dequantize), with a config written here, not derived by the converter;
- HF transformers' Qwen2-MoE / Qwen3-MoE modelling code on those weights (its GGUF loader cannot
  load these files).
Controls: the reference with the other routing normalisation, or without the shared expert, must
miss llama.cpp by far (median > 3x the tolerance), so each comparison sees what the family adds.
Experts on disk give logits bit-identical to experts in RAM (the shared expert stays in RAM).

OLMoE (`olmoe`: q/k RMSNorm over the whole q and k vectors, not per head; no renormalisation;
experts of hidden size feed_forward_length) converts, and the reference on the converted file
matches llama.cpp; the C engine refuses it by name (its attention op normalises per head only).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.oracle  # every test here compares against llama.cpp (llama-cpp-python)

from cflow.config import ModelConfig
from cflow.convert import convert
from cflow.convert.gguf import GGUFModel, gguf_config
from cflow.fileformat import open_model

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from test_convert_gguf import add_tensor, add_tiny_tokenizer, tiny_vocab  # noqa: E402
from test_convert_gguf_moe import gguf_values, teacher_forced, tokens  # noqa: E402

# Skips this module when llama_cpp is not importable: its tolerances are written against it.
from test_moe_llamacpp import check, far, llama_cpp_logits  # noqa: E402

T = gguf.GGMLQuantizationType
D, HEADS, KV_HEADS, LAYERS, E, TOP_K, DX, DSH, CTX = 128, 4, 2, 2, 8, 2, 64, 96, 256
FF = 256  # feed_forward_length: not the experts' size here (expert_feed_forward_length is)
EPS, THETA = 1e-6, 1e6
STEPS = 48
FAMILIES = ("qwen2moe", "qwen3moe")


def head_dim(family: str) -> int:
    return 64 if family == "qwen3moe" else D // HEADS


def kv_heads(family: str) -> int:
    return HEADS if family == "olmoe" else KV_HEADS  # llama.cpp sizes OLMoE's k norm [d]: no GQA


def family_weights(family: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Float weights under GGUF names, expert stacks [E, rows, cols] (numpy order). Scales as
    test_convert_gguf_moe's: every layer moves the logits, routers give logits of std ~1.5."""
    rng = np.random.default_rng(seed)
    V, hd = len(tiny_vocab()), head_dim(family)
    q, kv = HEADS * hd, kv_heads(family) * hd

    def mat(*shape, gain=1.0):
        return (gain * rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def norm(n=D, spread=0.1):
        return (1.0 + spread * rng.standard_normal(n)).astype(np.float32)

    w = {"token_embd.weight": rng.standard_normal((V, D)).astype(np.float32), "output_norm.weight": norm()}
    if family != "qwen3moe":  # llama.cpp requires output.weight for qwen2moe and olmoe
        w["output.weight"] = mat(V, D)
    for i in range(LAYERS):
        b = f"blk.{i}."
        w.update({b + "attn_norm.weight": norm(), b + "attn_q.weight": mat(q, D, gain=0.6),
                  b + "attn_k.weight": mat(kv, D, gain=0.6), b + "attn_v.weight": mat(kv, D),
                  b + "attn_output.weight": mat(D, q, gain=0.5), b + "ffn_norm.weight": norm(),
                  b + "ffn_gate_inp.weight": mat(E, D, gain=1.5),
                  b + "ffn_gate_exps.weight": mat(E, DX, D), b + "ffn_up_exps.weight": mat(E, DX, D),
                  b + "ffn_down_exps.weight": mat(E, D, DX, gain=0.7)})
        if family == "qwen2moe":
            w.update({b + "attn_q.bias": (0.5 * rng.standard_normal(q)).astype(np.float32),
                      b + "attn_k.bias": (0.5 * rng.standard_normal(kv)).astype(np.float32),
                      b + "attn_v.bias": (0.3 * rng.standard_normal(kv)).astype(np.float32),
                      b + "ffn_gate_inp_shexp.weight": mat(D, gain=1.5),  # sigmoid gates spread over (0, 1)
                      b + "ffn_gate_shexp.weight": mat(DSH, D), b + "ffn_up_shexp.weight": mat(DSH, D),
                      b + "ffn_down_shexp.weight": mat(D, DSH, gain=0.7)})
        elif family == "olmoe":  # over the whole vectors
            w.update({b + "attn_q_norm.weight": norm(q, 0.3), b + "attn_k_norm.weight": norm(kv, 0.3)})
        else:
            w.update({b + "attn_q_norm.weight": norm(hd, 0.3), b + "attn_k_norm.weight": norm(hd, 0.3)})
    return w


def write_family_gguf(path: Path, family: str, seed: int = 0) -> None:
    w = family_weights(family, seed)
    hd = head_dim(family)
    wr = gguf.GGUFWriter(str(path), family)
    wr.add_name(f"tiny-{family}")
    wr.add_block_count(LAYERS)
    wr.add_context_length(CTX)
    wr.add_embedding_length(D)
    wr.add_feed_forward_length(DX if family == "olmoe" else FF)
    wr.add_head_count(HEADS)
    wr.add_head_count_kv(kv_heads(family))
    wr.add_rope_freq_base(THETA)
    wr.add_layer_norm_rms_eps(EPS)
    wr.add_rope_dimension_count(hd)
    wr.add_expert_count(E)
    wr.add_expert_used_count(TOP_K)
    if family != "olmoe":
        wr.add_expert_feed_forward_length(DX)
    if family == "qwen2moe":
        wr.add_expert_shared_feed_forward_length(DSH)
    elif family == "qwen3moe":
        wr.add_key_length(hd)
        wr.add_value_length(hd)
    add_tiny_tokenizer(wr)
    for name, x in w.items():
        add_tensor(wr, name, x, T.F32 if x.ndim == 1 or "ffn_gate_inp" in name else T.Q8_0)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


def expected_config(family: str) -> ModelConfig:
    qwen2, qwen3 = family == "qwen2moe", family == "qwen3moe"
    return ModelConfig(vocab_size=len(tiny_vocab()), d_model=D, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=kv_heads(family),
                       head_dim=head_dim(family), d_ff=0, n_experts=E, top_k=TOP_K, d_expert=DX,
                       delta_dense=0, delta_expert=0, moe_input="post_attn", rope_theta=THETA,
                       norm_eps=float(np.float32(EPS)), max_seq_len=CTX, tie_embeddings=qwen3,
                       qkv_bias=qwen2, qk_norm=not qwen2, qk_norm_full=family == "olmoe", moe_norm_topk=qwen3,
                       d_shared_expert=DSH if qwen2 else 0, name=family)


def reference_state(path: Path, family: str) -> dict[str, np.ndarray]:
    """The PyTorch reference's parameters (docs/DESIGN.md names) from the GGUF alone."""
    g = GGUFModel(path)
    v = lambda n: gguf_values(g, n)  # noqa: E731
    sd = {"tok_emb.weight": v("token_embd.weight"), "norm.weight": v("output_norm.weight")}
    if family != "qwen3moe":
        sd["lm_head.weight"] = v("output.weight")
    for i in range(LAYERS):
        b, p = f"blk.{i}.", f"layers.{i}."
        sd.update({p + "attn_norm.weight": v(b + "attn_norm.weight"), p + "attn.wq.weight": v(b + "attn_q.weight"),
                   p + "attn.wk.weight": v(b + "attn_k.weight"), p + "attn.wv.weight": v(b + "attn_v.weight"),
                   p + "attn.wo.weight": v(b + "attn_output.weight"), p + "moe_norm.weight": v(b + "ffn_norm.weight"),
                   p + "moe.router.weight": v(b + "ffn_gate_inp.weight"),
                   p + "moe.w_gate": v(b + "ffn_gate_exps.weight"), p + "moe.w_up": v(b + "ffn_up_exps.weight"),
                   p + "moe.w_down": v(b + "ffn_down_exps.weight")})
        if family == "qwen2moe":
            sd.update({p + f"attn.w{n}.bias": v(b + f"attn_{n}.bias") for n in "qkv"})
            sd.update({p + "moe.shared_gate": v(b + "ffn_gate_inp_shexp.weight"),
                       p + "moe.shared.w_gate.weight": v(b + "ffn_gate_shexp.weight"),
                       p + "moe.shared.w_up.weight": v(b + "ffn_up_shexp.weight"),
                       p + "moe.shared.w_down.weight": v(b + "ffn_down_shexp.weight")})
        else:
            sd.update({p + f"attn.{n}_norm.weight": v(b + f"attn_{n}_norm.weight") for n in "qk"})
    return sd


def reference_logits(cfg: ModelConfig, sd: dict[str, np.ndarray], toks: list[int]) -> np.ndarray:
    from cflow.model import ReferenceDecoder, Transformer

    ref = ReferenceDecoder(Transformer.from_state(cfg, {k: torch.from_numpy(np.ascontiguousarray(x))
                                                         for k, x in sd.items()}))
    return teacher_forced(lambda t, pos: ref.step(t).numpy(), toks)


# ---- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=FAMILIES)
def family_run(request, tmp_path_factory):
    """(family, gguf path, cflow path, tokens, engine logits)."""
    from cflow.runtime import Engine

    family = request.param
    d = tmp_path_factory.mktemp(family)
    src, dst = d / f"{family}.gguf", d / f"{family}.cflow"
    write_family_gguf(src, family)
    convert(src, dst)
    toks = tokens(STEPS, seed=5)
    return family, src, dst, toks, teacher_forced(Engine.load(dst, threads=1).step, toks)


@pytest.fixture(scope="module")
def llama_cpp_run(family_run):
    _, src, _, toks, _ = family_run
    return llama_cpp_logits(src, toks)


# ---- import ----------------------------------------------------------------------------------
def test_config_and_tensors(family_run):
    family, src, dst, _, _ = family_run
    assert gguf_config(GGUFModel(src)) == expected_config(family)
    with open_model(dst) as f:
        assert f.config == expected_config(family)
        assert f.header["metadata"]["source"]["architecture"] == family
        shared = {n for n in f.tensors if ".moe.shared" in n}
        if family == "qwen2moe":
            assert shared == {f"layers.{i}.moe.{s}" for i in range(LAYERS)
                              for s in ("shared_gate", "shared.w_gate_up", "shared.w_down")}
        else:
            assert not shared
        # the expert table holds the E routed experts of each layer, nothing of the shared one
        assert sorted(f.experts) == [(i, e) for i in range(LAYERS) for e in range(E)]
        for name in shared:
            t = f.tensors[name]
            for off, n in f.experts.values():
                assert t.offset + t.nbytes <= off or t.offset >= off + n, name


def test_shared_expert_is_the_gguf_values(family_run):
    """gate and up interleaved (the gate/up layout of every SwiGLU), down and the gate as stored."""
    from cflow.convert.encoder import split_fused, tensor_values

    family, src, dst, _, _ = family_run
    if family != "qwen2moe":
        pytest.skip("qwen2moe only")
    sd = reference_state(src, family)
    with open_model(dst) as f:
        def stored(name):
            e = f.tensors[name]
            return tensor_values(e.dtype, e.shape, e.layout, f.array(name), f.tile)

        for i in range(LAYERS):
            p = f"layers.{i}.moe."
            gate, up = split_fused(stored(p + "shared.w_gate_up"), f.tensors[p + "shared.w_gate_up"].meta)
            np.testing.assert_array_equal(gate, sd[p + "shared.w_gate.weight"])
            np.testing.assert_array_equal(up, sd[p + "shared.w_up.weight"])
            np.testing.assert_array_equal(stored(p + "shared.w_down"), sd[p + "shared.w_down.weight"])
            np.testing.assert_array_equal(stored(p + "shared_gate"), sd[p + "shared_gate"])


# ---- the engine against the oracles ----------------------------------------------------------
def test_engine_matches_reference(family_run):
    family, src, _, toks, got = family_run
    check(got, reference_logits(expected_config(family), reference_state(src, family), toks), moe=True)


def test_engine_matches_llama_cpp(family_run, llama_cpp_run):
    check(family_run[4], llama_cpp_run, moe=True)


def test_reference_matches_llama_cpp_and_needs_the_routing(family_run, llama_cpp_run):
    """llama.cpp and the float reference agree; with the other top-k normalisation (renormalising
    qwen2moe, not renormalising qwen3moe) or without qwen2moe's shared expert they do not."""
    family, src, _, toks, _ = family_run
    cfg, sd = expected_config(family), reference_state(src, family)
    check(reference_logits(cfg, sd, toks), llama_cpp_run, moe=True)
    assert far(reference_logits(cfg.replace(moe_norm_topk=not cfg.moe_norm_topk), sd, toks), llama_cpp_run)
    if family == "qwen2moe":
        no_shared = {k: x for k, x in sd.items() if ".moe.shared" not in k}
        assert far(reference_logits(cfg.replace(d_shared_expert=0), no_shared, toks), llama_cpp_run)


def test_engine_generates(family_run):
    from cflow.runtime import Engine

    _, _, dst, toks, got = family_run
    eng = Engine.load(dst, threads=2, max_batch=4)
    assert np.array_equal(np.argmax(eng.prefill(toks[:8])), np.argmax(got[7]))


# ---- experts on disk ---------------------------------------------------------------------------
@pytest.mark.parametrize("io", ["async", "sync"])
def test_disk_experts_bit_identical_to_ram(family_run, io):
    """Routed experts read through the cache (the smallest one, so they are evicted and re-read),
    the shared expert from RAM: every logit bit for bit as with every expert in RAM, step by step
    and through batched prefill."""
    from cflow.runtime import Engine

    _, _, dst, toks, _ = family_run

    def run(eng):
        out = [eng.prefill(toks[:13]).copy()]
        out += [eng.step(t, 13 + i).copy() for i, t in enumerate(toks[13:24])]
        return out

    for threads in (1, 2):
        want = run(Engine.load(dst, threads=threads, experts="ram", max_batch=8))
        probe = Engine.load(dst, threads=1, experts="disk", expert_io=io, max_batch=8)
        c = probe.expert_cache
        probe.close()
        eng = Engine.load(dst, threads=threads, experts="disk", expert_io=io, max_batch=8,
                          expert_cache=c["min_slots"] * c["slot_bytes"])
        got = run(eng)
        for i, (g, w) in enumerate(zip(got, want)):
            assert np.array_equal(g, w), f"{io} threads={threads}: call {i} differs"
        assert eng.counters()["cache_misses"] > 0
        eng.close()


# ---- the shared expert and routing options on cflow's own delayed architectures ------------------
@pytest.mark.parametrize("norm_topk", [False, True])
def test_shared_expert_with_delays(tmp_path, norm_topk):
    """A random arch2_4_combined model (experts land 2 layers later, dense beside attention) with a
    shared expert: the engine against the reference on the file's dequantized weights, teacher-forced
    and through prefill, and disk experts (async: experts run late in their window) bit for bit
    as in RAM."""
    from test_engine import dequantized_model, prompt_tokens, rel_err, small_config, write_random_model

    from cflow.model import ReferenceDecoder
    from cflow.runtime import Engine

    cfg = small_config("arch2_4_combined", tied=False).replace(d_shared_expert=96, moe_norm_topk=norm_topk)
    path = tmp_path / "m.cflow"
    write_random_model(path, cfg, "q8_0", (64, 64), spread=0.5)
    ref = ReferenceDecoder(dequantized_model(path))
    toks = prompt_tokens(cfg, 24, seed=2)
    got = teacher_forced(Engine.load(path, threads=2).step, toks)
    check(got, teacher_forced(lambda t, pos: ref.step(t).numpy(), toks), moe=True)
    assert rel_err(Engine.load(path, threads=2, max_batch=5).prefill(toks), got[-1]) < 1e-5
    disk = Engine.load(path, threads=2, experts="disk", expert_io="async")
    assert np.array_equal(teacher_forced(disk.step, toks), got)
    disk.close()


# ---- HF transformers' modelling code ---------------------------------------------------------------
def test_transformers_modelling(family_run):
    """transformers' Qwen2MoeForCausalLM / Qwen3MoeForCausalLM on the reference's weights (its GGUF
    loader cannot load these files: its config mapping drops expert_feed_forward_length, so the
    expert stacks do not fit), a third oracle written by other people: its routing (norm_topk_prob),
    its shared expert and its gate."""
    transformers = pytest.importorskip("transformers")
    family, src, _, toks, got = family_run
    qwen2 = family == "qwen2moe"
    kw = dict(vocab_size=len(tiny_vocab()), hidden_size=D, intermediate_size=FF, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=CTX,
              rms_norm_eps=EPS, rope_theta=THETA, num_experts=E, num_experts_per_tok=TOP_K,
              moe_intermediate_size=DX, norm_topk_prob=not qwen2, tie_word_embeddings=not qwen2,
              attn_implementation="eager")
    if qwen2:
        hc, cls = transformers.Qwen2MoeConfig(shared_expert_intermediate_size=DSH, **kw), transformers.Qwen2MoeForCausalLM
    else:
        hc, cls = transformers.Qwen3MoeConfig(head_dim=head_dim(family), **kw), transformers.Qwen3MoeForCausalLM
    sd = reference_state(src, family)
    state = {"model.embed_tokens.weight": sd["tok_emb.weight"], "model.norm.weight": sd["norm.weight"],
             "lm_head.weight": sd.get("lm_head.weight", sd["tok_emb.weight"])}
    for i in range(LAYERS):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        state |= {h + "input_layernorm.weight": sd[p + "attn_norm.weight"],
                  h + "post_attention_layernorm.weight": sd[p + "moe_norm.weight"],
                  h + "self_attn.o_proj.weight": sd[p + "attn.wo.weight"], h + "mlp.gate.weight": sd[p + "moe.router.weight"],
                  h + "mlp.experts.gate_up_proj": np.concatenate([sd[p + "moe.w_gate"], sd[p + "moe.w_up"]], axis=1),
                  h + "mlp.experts.down_proj": sd[p + "moe.w_down"]}
        for n in "qkv":
            state[h + f"self_attn.{n}_proj.weight"] = sd[p + f"attn.w{n}.weight"]
            if qwen2:
                state[h + f"self_attn.{n}_proj.bias"] = sd[p + f"attn.w{n}.bias"]
        if qwen2:
            state |= {h + "mlp.shared_expert_gate.weight": sd[p + "moe.shared_gate"][None],
                      **{h + f"mlp.shared_expert.{n}_proj.weight": sd[p + f"moe.shared.w_{n}.weight"]
                         for n in ("gate", "up", "down")}}
        else:
            state |= {h + f"self_attn.{n}_norm.weight": sd[p + f"attn.{n}_norm.weight"] for n in "qk"}
    hf = cls(hc).float().eval()
    hf.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(x)) for k, x in state.items()}, strict=True)
    with torch.no_grad():
        want = hf(torch.tensor([toks])).logits[0].double().numpy()
    check(got, want, moe=True)


# ---- OLMoE: whole-vector q/k norms ---------------------------------------------------------------
@pytest.fixture(scope="module")
def olmoe_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("olmoe")
    src, dst = d / "olmoe.gguf", d / "olmoe.cflow"
    write_family_gguf(src, "olmoe")
    convert(src, dst)
    toks = tokens(STEPS, seed=5)
    return src, dst, toks, llama_cpp_logits(src, toks)


def test_olmoe_converts_and_its_reference_matches_llama_cpp(olmoe_run):
    """The converted file's own weights (Transformer.from_cflow) through the reference match llama.cpp
    on the GGUF; per-head norms (the norms left out: a per-head version of [q_dim] weights does not
    exist), or renormalising the top-k, are far."""
    from cflow.model import ReferenceDecoder, Transformer

    src, dst, toks, lc = olmoe_run
    cfg = expected_config("olmoe")
    assert gguf_config(GGUFModel(src)) == cfg
    with open_model(dst) as f:
        assert f.config == cfg
    ref = ReferenceDecoder(Transformer.from_cflow(dst))
    check(teacher_forced(lambda t, pos: ref.step(t).numpy(), toks), lc, moe=True)
    sd = reference_state(src, "olmoe")
    check(reference_logits(cfg, sd, toks), lc, moe=True)
    assert far(reference_logits(cfg.replace(moe_norm_topk=True), sd, toks), lc)
    no_norms = {k: x for k, x in sd.items() if "_norm.weight" not in k or "attn." not in k}
    assert far(reference_logits(cfg.replace(qk_norm=False, qk_norm_full=False), no_norms, toks), lc)


def test_olmoe_engine_matches_llama_cpp_and_the_reference(olmoe_run):
    """The C engine runs OLMoE's whole-vector q/k norms (a barrier between the projection and the
    norms, then RoPE per head): against llama.cpp and the reference on the converted file, at 1
    and 2 threads; batched prefill gives the step-by-step logits bit for bit."""
    from cflow.model import ReferenceDecoder, Transformer
    from cflow.runtime import Engine

    src, dst, toks, lc = olmoe_run
    for threads in (1, 2):
        with Engine.load(dst, threads=threads) as eng:
            got = teacher_forced(eng.step, toks)
        check(got, lc, moe=True)
        with Engine.load(dst, threads=threads, max_batch=8) as eng:
            assert np.array_equal(eng.prefill(toks[:16]), got[15])
    ref = ReferenceDecoder(Transformer.from_cflow(dst))
    check(got, teacher_forced(lambda t, pos: ref.step(t).numpy(), toks), moe=True)
