"""Mixtral-layout GGUF (llama architecture with experts) -> .cflow -> the engine.

The GGUFs are written here with gguf.GGUFWriter the way convert_hf_to_gguf.py writes a Mixtral:
`llama.expert_count` / `llama.expert_used_count`, per layer `ffn_norm` (the norm before the MoE),
the router `ffn_gate_inp` [E, d] and the 3-D expert stacks `ffn_{gate,up,down}_exps` (ggml
ne = [d, d_exp, E] / [d_exp, d, E]); also the older per-expert layout `ffn_gate.{e}` etc.
Random weights sized so every layer moves the logits (see moe_weights), experts in Q4_0 / Q4_1 /
Q8_0 (down in another type than gate/up in two layers, as real mixes do), routers F32 and (last
layer) F16.

What is compared:
- the config and metadata the converter derives;
- every expert's blocks in the file, untiled and de-interleaved with cflow.quant, against the
  GGUF's own bytes of that expert (bit for bit), the router and norms against the GGUF's floats;
- the expert table: each expert one 4096-aligned contiguous span (also through `cflow inspect`);
- the per-expert (split) layout converts to the same bytes as the 3-D (merged) layout;
- the engine, loading the .gguf itself (converted into $CFLOW_CACHE), against a float PyTorch
  reference built straight from the GGUF (gguf.quants.dequantize, Q/K un-permuted here with the
  inverse of llama.cpp's permutation), not from the converted file, so a converter that mixed
  experts up would show. Tolerances are test_engine's (engine vs dequantized reference): median
  over positions of max|dlogit|/std(logits) <= 4%, >= 85% of positions within 6% (top-k routing
  flips at near-ties), argmax equal at >= 95% of the positions where the reference's top-1 margin
  exceeds 0.2 std. Two negative controls run the same comparison against references that drop
  the top-k renormalisation or swap two experts: both must fail these tolerances.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cflow import quant
from cflow.config import ModelConfig
from cflow.convert import convert
from cflow.convert.encoder import split_fused
from cflow.convert.gguf import GGUFError, GGUFModel, gguf_config
from cflow.fileformat import open_model

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from test_convert_gguf import add_tensor, add_tiny_tokenizer, llama_cpp_permute, tiny_vocab  # noqa: E402
from test_engine import MARGIN, MAX_TOL, MEDIAN_TOL  # noqa: E402

T = gguf.GGMLQuantizationType

D, HEADS, KV_HEADS, LAYERS, E, TOP_K, DX = 128, 4, 2, 3, 6, 2, 160
HD = D // HEADS
CTX = 256
# per layer: (gate and up, down, router) GGUF types
LAYER_TYPES = [(T.Q4_0, T.Q8_0, T.F32), (T.Q4_1, T.Q4_1, T.F32), (T.Q8_0, T.Q4_0, T.F16)]
NATIVE = {T.Q4_0: "q4_0", T.Q4_1: "q4_1", T.Q8_0: "q8_0"}
STEPS = 48


def moe_weights(seed: int = 0, n_experts: int = E, d_ff: int = DX) -> dict[str, np.ndarray]:
    """HF-order float weights under GGUF names (Q/K not yet permuted); expert stacks are 3-D
    [E, rows, cols] (numpy order). n_experts = 0: a dense llama with FFN size d_ff."""
    rng = np.random.default_rng(seed)
    V = len(tiny_vocab())

    def mat(*shape, gain=1.0):  # outputs of unit scale for inputs of unit RMS
        return (gain * rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def norm():
        return (1.0 + 0.1 * rng.standard_normal(D)).astype(np.float32)

    w = {"token_embd.weight": rng.standard_normal((V, D)).astype(np.float32),
         "output.weight": mat(V, D), "output_norm.weight": norm()}
    for i in range(LAYERS):
        b = f"blk.{i}."
        # Q/K at 0.6 (attention neither uniform nor one-hot) and the projections back into the
        # residual at 0.5: every layer moves the logits (dropping the MoE's renormalisation moves
        # them by ~30% of their spread) while the int8-activation error of the engines stays in the
        # 2-3% regime test_engine's tolerances are written for (at gain 1 it reaches 4-5%).
        w.update({b + "attn_norm.weight": norm(), b + "attn_q.weight": mat(D, D, gain=0.6),
                  b + "attn_k.weight": mat(KV_HEADS * HD, D, gain=0.6), b + "attn_v.weight": mat(KV_HEADS * HD, D),
                  b + "attn_output.weight": mat(D, D, gain=0.5), b + "ffn_norm.weight": norm()})
        if n_experts:
            w.update({b + "ffn_gate_inp.weight": mat(n_experts, D, gain=1.5),  # router logits of std ~1.5
                      b + "ffn_gate_exps.weight": mat(n_experts, d_ff, D),
                      b + "ffn_up_exps.weight": mat(n_experts, d_ff, D),
                      b + "ffn_down_exps.weight": mat(n_experts, D, d_ff, gain=0.5)})
        else:
            w.update({b + "ffn_gate.weight": mat(d_ff, D), b + "ffn_up.weight": mat(d_ff, D),
                      b + "ffn_down.weight": mat(D, d_ff, gain=0.5)})
    return w


def tensor_type(name: str) -> "T":
    if name.endswith("norm.weight"):
        return T.F32
    if name.startswith("blk."):
        gate_up, down, router = LAYER_TYPES[int(name.split(".")[1])]
        if "ffn_gate_inp" in name:
            return router
        if "ffn_down" in name:
            return down
        if "ffn_gate" in name or "ffn_up" in name:
            return gate_up
    return T.Q8_0


def write_moe_gguf(path: Path, *, layout: str = "merged", n_experts: int = E, top_k: int | None = TOP_K,
                   d_ff: int = DX, drop: tuple[str, ...] = (), extra: dict | None = None, shared: int = 0,
                   expert_count: int | None = None, seed: int = 0, edit=None) -> dict[str, np.ndarray]:
    """Write a small Mixtral-layout GGUF (n_experts = 0: a dense llama); returns the GGUF-order
    (Q/K permuted) float weights it was made from. `edit(weights)` may change them first."""
    w = moe_weights(seed, n_experts, d_ff)
    if edit is not None:
        edit(w)
    for i in range(LAYERS):  # what convert_hf_to_gguf.py does to Q and K (Mixtral is a LlamaModel)
        w[f"blk.{i}.attn_q.weight"] = llama_cpp_permute(w[f"blk.{i}.attn_q.weight"], HEADS)
        w[f"blk.{i}.attn_k.weight"] = llama_cpp_permute(w[f"blk.{i}.attn_k.weight"], KV_HEADS)
    wr = gguf.GGUFWriter(str(path), "llama")
    wr.add_name("tiny-mixtral" if n_experts else "tiny-llama")
    wr.add_block_count(LAYERS)
    wr.add_context_length(CTX)
    wr.add_embedding_length(D)
    wr.add_feed_forward_length(d_ff)
    wr.add_head_count(HEADS)
    wr.add_head_count_kv(KV_HEADS)
    wr.add_rope_freq_base(1e6)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_rope_dimension_count(HD)
    if n_experts:
        wr.add_expert_count(expert_count if expert_count is not None else n_experts)
        if top_k is not None:
            wr.add_expert_used_count(top_k)
        if shared:
            wr.add_expert_shared_count(shared)
    add_tiny_tokenizer(wr)

    def add(name: str, x: np.ndarray, t) -> None:
        if name not in drop:
            add_tensor(wr, name, x, t)

    for name, x in w.items():
        t = tensor_type(name)
        if layout == "split" and name.endswith("_exps.weight"):
            for e in range(x.shape[0]):  # llama.cpp's old LLM_TENSOR_FFN_*_EXP names: blk.N.ffn_gate.E.weight
                add(name.replace("_exps.weight", f".{e}.weight"), x[e], t)
        else:
            add(name, x, t)
    for name, x in (extra or {}).items():
        add(name, x, T.F32)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return w


def expert_blocks(g: GGUFModel, name: str, e: int) -> np.ndarray:
    """Expert e's GGML bytes [rows, row_bytes], cut out of the 3-D tensor independently of the
    converter: ggml ne = [cols, rows, E], so the reader's array is [E, rows, row_bytes]."""
    t = g.tensors[name]
    cols, rows, n = (int(x) for x in t.shape)
    assert n == E
    return np.asarray(t.data).reshape(n, rows, -1)[e]


def gguf_values(g: GGUFModel, name: str) -> np.ndarray:
    """float32 values in numpy order (outermost first): [rows, cols] or [E, rows, cols]."""
    return g.values(name)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama_cpp_permute, by inverting the index permutation it applies."""
    idx = llama_cpp_permute(np.arange(w.shape[0]), n_head)  # gguf row j = hf row idx[j]
    out = np.empty_like(w)
    out[idx] = w
    return out


def expected_config(tied: bool = False) -> ModelConfig:
    return ModelConfig(vocab_size=len(tiny_vocab()), d_model=D, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS,
                       head_dim=HD, d_ff=0, n_experts=E, top_k=TOP_K, d_expert=DX, delta_dense=0, delta_expert=0,
                       moe_input="post_attn", rope_theta=1e6, norm_eps=float(np.float32(1e-5)), max_seq_len=CTX,
                       tie_embeddings=tied, name="mixtral")


def gguf_reference_state(path: Path, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The PyTorch reference's parameters (docs/DESIGN.md names), from the GGUF alone."""
    g = GGUFModel(path)
    v = lambda n: gguf_values(g, n)  # noqa: E731
    sd = {"tok_emb.weight": v("token_embd.weight"), "norm.weight": v("output_norm.weight"),
          "lm_head.weight": v("output.weight")}
    for i in range(cfg.n_layers):
        b, p = f"blk.{i}.", f"layers.{i}."
        sd.update({p + "attn_norm.weight": v(b + "attn_norm.weight"),
                   p + "attn.wq.weight": unpermute(v(b + "attn_q.weight"), HEADS),
                   p + "attn.wk.weight": unpermute(v(b + "attn_k.weight"), KV_HEADS),
                   p + "attn.wv.weight": v(b + "attn_v.weight"), p + "attn.wo.weight": v(b + "attn_output.weight")})
        if cfg.has_moe:
            sd.update({p + "moe_norm.weight": v(b + "ffn_norm.weight"),
                       p + "moe.router.weight": v(b + "ffn_gate_inp.weight"),
                       p + "moe.w_gate": v(b + "ffn_gate_exps.weight"), p + "moe.w_up": v(b + "ffn_up_exps.weight"),
                       p + "moe.w_down": v(b + "ffn_down_exps.weight")})
        else:
            sd.update({p + "ffn_norm.weight": v(b + "ffn_norm.weight"),
                       p + "ffn.w_gate.weight": v(b + "ffn_gate.weight"), p + "ffn.w_up.weight": v(b + "ffn_up.weight"),
                       p + "ffn.w_down.weight": v(b + "ffn_down.weight")})
    return sd


def reference_decoder(cfg: ModelConfig, sd: dict[str, np.ndarray], renormalise: bool = True):
    """cflow.model.ReferenceDecoder over these weights; renormalise=False drops the top-k
    renormalisation (a negative control)."""
    from cflow.model import ReferenceDecoder, Transformer, _swiglu

    tm = Transformer.from_state(cfg, {k: torch.from_numpy(np.ascontiguousarray(x)) for k, x in sd.items()})
    ref = ReferenceDecoder(tm)
    if not renormalise:
        def experts(W, zn, k=cfg.top_k):  # ReferenceDecoder._experts without `w = w / w.sum()`
            w, idx = (W["moe.router.weight"] @ zn).softmax(dim=0).topk(k)
            m = torch.zeros_like(zn)
            for wi, e in zip(w.tolist(), idx.tolist()):
                m += wi * _swiglu(zn, W["moe.w_gate"][e], W["moe.w_up"][e], W["moe.w_down"][e])
            return m
        ref._experts = experts
    return ref


def tokens(n: int, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, len(tiny_vocab()), n)]


def teacher_forced(step, toks: list[int]) -> np.ndarray:
    """[n, V] logits of step(token, pos) over the sequence."""
    return np.stack([np.array(step(t, pos), dtype=np.float64, copy=True) for pos, t in enumerate(toks)])


def assert_disk_experts_bit_identical(path, toks: list[int], got: np.ndarray, threads: int = 1) -> None:
    """The engine with its experts read from disk (the smallest cache the model allows, async and
    sync reads) gives exactly `got`, the logits with the experts in RAM, teacher-forced over toks."""
    from cflow.runtime import Engine

    probe = Engine.load(path, threads=1, experts="disk", expert_cache=None, expert_io="async", max_batch=8)
    c = probe.expert_cache
    probe.close()
    budget = c["min_slots"] * c["slot_bytes"]
    for io in ("async", "sync"):
        with Engine.load(path, threads=threads, experts="disk", expert_cache=budget, expert_io=io, max_batch=8) as eng:
            assert np.array_equal(teacher_forced(eng.step, toks), got), io


def compare(got: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per position: max|dlogit| / std(ref logits), ref top-1 margin in stds, argmax agreement."""
    errs = np.abs(got - ref).max(axis=1) / ref.std(axis=1)
    top2 = np.sort(ref, axis=1)[:, -2:]
    margins = (top2[:, 1] - top2[:, 0]) / ref.std(axis=1)
    agree = got.argmax(axis=1) == ref.argmax(axis=1)
    return errs, margins, agree


def within_engine_tolerances(errs, margins, agree) -> bool:
    safe = margins > MARGIN
    return bool(np.median(errs) <= MEDIAN_TOL and np.mean(errs <= MAX_TOL) >= 0.85
                and agree[safe].mean() >= 0.95)


# ---- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    write_moe_gguf(d / "m.gguf")
    result = convert(d / "m.gguf", d / "m.cflow")
    return d / "m.gguf", result, open_model(d / "m.cflow", verify=True)


def file_blocks(f, name: str) -> list[np.ndarray]:
    e = f.tensors[name]
    return split_fused(quant.untile_matrix(f.array(name), e.dtype, *e.shape, f.tile), e.meta)


# ---- conversion ------------------------------------------------------------------------------
def test_config_and_metadata(moe):
    src, result, f = moe
    assert f.config == expected_config() and f.config.name == "mixtral"
    assert gguf_config(GGUFModel(src)) == expected_config()
    c = f.config
    assert not c.has_dense and c.has_moe and "layers.0.ffn_norm" not in f.tensors
    assert f.metadata["source"]["family"] == "mixtral" and f.metadata["source"]["expert_layout"] == "merged"
    assert f.metadata["source"]["architecture"] == "llama" and f.metadata["source"]["name"] == "tiny-mixtral"
    assert set(result.bytes_by_category) == {"embeddings", "attention", "router", "experts", "norms"}


def test_expert_blocks_are_bit_exact(moe):
    src, result, f = moe
    g = GGUFModel(src)
    for i, (gate_up_t, down_t, router_t) in enumerate(LAYER_TYPES):
        b, p = f"blk.{i}.", f"layers.{i}."
        for e in range(E):
            gu = f"{p}moe.experts.{e}.w_gate_up"
            dn = f"{p}moe.experts.{e}.w_down"
            assert f.tensors[gu].dtype == NATIVE[gate_up_t] and f.tensors[dn].dtype == NATIVE[down_t]
            assert f.tensors[gu].shape == (2 * DX, D) and f.tensors[dn].shape == (D, DX)
            gate, up = file_blocks(f, gu)
            assert np.array_equal(gate, expert_blocks(g, b + "ffn_gate_exps.weight", e)), (i, e)
            assert np.array_equal(up, expert_blocks(g, b + "ffn_up_exps.weight", e)), (i, e)
            assert np.array_equal(file_blocks(f, dn)[0], expert_blocks(g, b + "ffn_down_exps.weight", e)), (i, e)
        # router: F32 copied, F16 widened exactly; the MoE norm is the file's ffn_norm
        assert f.tensors[p + "moe.router"].dtype == "f32" and f.tensors[p + "moe.router"].shape == (E, D)
        assert np.array_equal(f.plain(p + "moe.router"), gguf_values(g, b + "ffn_gate_inp.weight"))
        assert np.array_equal(f.plain(p + "moe_norm"), gguf_values(g, b + "ffn_norm.weight"))
    # nothing was re-quantized
    assert result.report.requantized_weights == 0 and not result.report.notes
    V = len(tiny_vocab())
    assert result.report.lossless_weights == 2 * V * D + LAYERS * (
        2 * D * D + 2 * KV_HEADS * HD * D + 3 * E * DX * D)


def test_expert_table_contiguous_and_aligned(moe, capsys):
    src, _, f = moe
    assert sorted(f.experts) == [(i, e) for i in range(LAYERS) for e in range(E)]
    for (i, e), (off, nbytes) in f.experts.items():
        gu, dn = (f.tensors[f"layers.{i}.moe.experts.{e}.{s}"] for s in ("w_gate_up", "w_down"))
        assert off % 4096 == 0 and off == gu.offset
        assert dn.offset == -(-(gu.offset + gu.nbytes) // 4096) * 4096  # adjacent: the next aligned byte
        assert nbytes == dn.offset + dn.nbytes - off
    # the same through `cflow inspect --json`
    from cflow.cli import main

    assert main(["inspect", str(Path(f.path)), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    table = {(x["layer"], x["expert"]): (x["offset"], x["nbytes"]) for x in r["expert_table"]}
    assert table == dict(f.experts) and r["aligned"] and not r["missing_tensors"]
    assert r["experts"]["count"] == LAYERS * E


def test_split_layout_converts_to_the_same_file(moe, tmp_path):
    """Older files store each expert as its own 2-D tensor (blk.N.ffn_gate.E.weight)."""
    _, _, f = moe
    write_moe_gguf(tmp_path / "s.gguf", layout="split")
    g = GGUFModel(tmp_path / "s.gguf")
    assert "blk.0.ffn_gate.5.weight" in g.tensors and "blk.0.ffn_gate_exps.weight" not in g.tensors
    s = open_model(convert(tmp_path / "s.gguf", tmp_path / "s.cflow").output, verify=True)
    assert s.config == f.config and s.metadata["source"]["expert_layout"] == "split"
    assert list(s.tensors) == list(f.tensors)
    for name in f.tensors:
        assert np.array_equal(s.array(name), f.array(name)), name


def test_vflow_order(moe, tmp_path):
    src, _, f = moe
    v = open_model(convert(src, tmp_path / "m.vflow").output, verify=True)
    assert v.order == "vflow" and set(v.tensors) == set(f.tensors)
    assert sorted(v.experts) == sorted(f.experts)
    for name in f.tensors:
        assert np.array_equal(v.array(name), f.array(name)), name


# ---- refused inputs --------------------------------------------------------------------------
@pytest.mark.parametrize("kw,match", [
    (dict(drop=("blk.1.ffn_up_exps.weight",)), r"lacks tensors.*blk\.1\.ffn_up_exps"),
    (dict(layout="split", drop=("blk.2.ffn_down.3.weight",)), r"lacks tensors.*blk\.2\.ffn_down\.3"),
    (dict(drop=("blk.0.ffn_gate_inp.weight",)), r"lacks tensors.*blk\.0\.ffn_gate_inp"),
    (dict(extra={"blk.0.ffn_gate_inp_shexp.weight": np.ones(D, np.float32)}),
     r"does not know how to use.*ffn_gate_inp_shexp"),
    (dict(top_k=None), r"expert_used_count"),
    (dict(shared=1), r"shared experts"),
    (dict(expert_count=4), r"ffn_gate_exps.*\[128, 160, 6\].*4 experts"),
])
def test_refused_moe_files(tmp_path, kw, match):
    write_moe_gguf(tmp_path / "bad.gguf", **kw)
    with pytest.raises(GGUFError, match=match):
        convert(tmp_path / "bad.gguf", tmp_path / "bad.cflow")
    assert not (tmp_path / "bad.cflow").exists()


# ---- the engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_run(moe, tmp_path_factory):
    """The engine on the .gguf itself (converted into a private cache), teacher-forced."""
    from cflow.runtime import Engine

    src, _, _ = moe
    mp = pytest.MonkeyPatch()
    mp.setenv("CFLOW_CACHE", str(tmp_path_factory.mktemp("cache")))
    try:
        eng = Engine.load(src, threads=1)
        toks = tokens(STEPS)
        logits = teacher_forced(eng.step, toks)
    finally:
        mp.undo()
    return eng, toks, logits


def test_engine_loads_the_gguf_through_the_cache(engine_run, moe):
    eng, _, _ = engine_run
    _, _, f = moe
    assert eng.config == expected_config()
    assert Path(eng.path).suffix == ".cflow" and Path(eng.path) != Path(f.path)
    cached = open_model(eng.path)
    for name in f.tensors:  # the cached conversion is the same conversion
        assert np.array_equal(cached.array(name), f.array(name)), name


def test_engine_logits_match_gguf_reference(engine_run, moe):
    eng, toks, got = engine_run
    src, _, f = moe
    cfg = expected_config()
    sd = gguf_reference_state(src, cfg)
    ref = reference_decoder(cfg, sd)
    want = teacher_forced(lambda t, pos: ref.step(t).numpy(), toks)
    errs, margins, agree = compare(got, want)
    msg = f"max|dlogit|/std per position: {np.round(errs, 3)}"
    assert np.median(errs) <= MEDIAN_TOL, msg
    assert np.mean(errs <= MAX_TOL) >= 0.85, msg
    safe = margins > MARGIN
    assert safe.sum() >= 10, "too few decisive positions to compare argmax"
    assert agree[safe].mean() >= 0.95, msg
    assert within_engine_tolerances(errs, margins, agree)


@pytest.mark.parametrize("control", ["no_renormalisation", "experts_0_1_swapped", "top_1"])
def test_wrong_moe_semantics_fail_the_same_tolerances(engine_run, moe, control):
    """Negative controls: the comparison above notices each of these mistakes."""
    eng, toks, got = engine_run
    src, _, _ = moe
    cfg = expected_config()
    sd = gguf_reference_state(src, cfg)
    if control == "experts_0_1_swapped":
        for i in range(LAYERS):
            for k in ("moe.w_gate", "moe.w_up", "moe.w_down"):
                sd[f"layers.{i}.{k}"] = sd[f"layers.{i}.{k}"][[1, 0, 2, 3, 4, 5]]
    if control == "top_1":
        cfg = cfg.replace(top_k=1)
    ref = reference_decoder(cfg, sd, renormalise=control != "no_renormalisation")
    want = teacher_forced(lambda t, pos: ref.step(t).numpy(), toks)
    errs, margins, agree = compare(got, want)
    assert not within_engine_tolerances(errs, margins, agree), np.round(errs, 3)
    assert np.median(errs) > 2 * MEDIAN_TOL, np.round(errs, 3)


def test_engine_reads_only_top_k_experts(engine_run):
    eng, _, _ = engine_run
    eng.reset()
    eng.reset_counters()
    eng.step(5, 0)
    hits = np.array(eng.expert_hits())
    assert hits.shape == (LAYERS, E) and (hits.sum(axis=1) == TOP_K).all()
    c = eng.counters()
    t = eng.file.tensors
    assert c["experts"] == TOP_K * sum(t[f"layers.{i}.moe.experts.0.w_gate_up"].nbytes
                                       + t[f"layers.{i}.moe.experts.0.w_down"].nbytes for i in range(LAYERS))


def test_engine_generates(engine_run):
    eng, _, _ = engine_run
    c = eng.complete("the", max_tokens=8, temperature=0, ignore_eos=True)
    assert len(c.tokens) == 8
    again = eng.complete("the", max_tokens=8, temperature=0, ignore_eos=True)
    assert again.tokens == c.tokens
