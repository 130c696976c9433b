"""The C decode engine (cflow.engine over native/engine.c) against the PyTorch reference.

Small random models of every preset are quantized into .cflow files; the reference decoder
(cflow.model.ReferenceDecoder, fp32) runs on the *dequantized* weights of the same file, so weight
quantization is not part of any difference. What remains is the engine's own rounding: every
quantized mat-vec sees its input rounded to int8 per 32-block (DESIGN.md), about 0.4% relative
error per mat-vec, and K/V are stored as fp16. Over 5 layers that is ~2-3% of the logits' spread
(std over the vocabulary), so the stated tolerances are (teacher-forced, per position):

    median  max|dlogit| / std(logits)  <= MEDIAN_TOL (4%)   every preset
    max     max|dlogit| / std(logits)  <= MAX_TOL (6%)      presets without MoE
    MoE: >= 85% of positions within MAX_TOL. Top-k routing is discontinuous: at a near-tie of two
    router probabilities the 0.4% input error can pick the other expert, which changes that
    layer's output by O(1) at that position (and slightly, through its K/V, at later ones).

For scale: running the wrong delays (delta_dense 1 -> 0, delta_expert 2 -> 1, moe_input swapped)
gives medians of 9-45% on these models. Argmax must agree wherever the reference's top-1 margin
exceeds 0.2 std (10x the typical error).

Greedy decoding is compared token for token on "planted" models whose lm_head makes the next token
a fixed function of the current one by a wide margin (>= 0.5 std, 20x the error) while the layers
still move every logit; random models have near-ties that int8 activations legitimately resolve
the other way (claim C7).

Each preset uses a different quantization, tile shape and thread count, with odd sizes (vocab
300: a short last row group; d 96: a tile narrower than TK; 5 layers: expert outputs that land
past the last layer for delta_expert = 2).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cflow.config import ModelConfig  # noqa: E402
from cflow.convert.checkpoint import checkpoint_tensors  # noqa: E402
from cflow.bench.claims.models import small_config, tokenizer_header  # noqa: E402
from cflow.convert.encoder import Encoder  # noqa: E402
from cflow.runtime import (ContextOverflowError, Engine, EngineError, ModelFormatError,  # noqa: E402
                          ModelNotFoundError)
from cflow.fileformat import open_model, write_model  # noqa: E402
from cflow.model import ReferenceDecoder, Transformer  # noqa: E402
from cflow.sampling import SamplingError  # noqa: E402

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
GAIN = 1.5         # weights x1.5 over the default init, so the layers move the logits
MEDIAN_TOL = 0.04  # see the module docstring
MAX_TOL = 0.06
MARGIN = 0.2       # argmax compared where the reference's top-1 margin exceeds this many stds
STEPS = 64


# ---- building models -------------------------------------------------------------------------
def planted_next(t: int, vocab_size: int) -> int:
    return (t + 37) % vocab_size  # 37 is coprime to the test vocabulary (300): a 300-token cycle


def write_random_model(path, cfg: ModelConfig, dtype: str, tile, seed: int = 0, eos: int | None = None,
                       plant: bool = False, spread: float = 0.0) -> None:
    """Random weights (default init x GAIN). plant=True (untied only) sets lm_head[next(t)] = tok_emb[t],
    so the model's argmax is planted_next(current token) by a wide margin while the layers still
    shift every logit: greedy decoding has no near-ties, so it can be compared token for token.
    spread > 0: biases (init 0) ~ N(0, spread) and norm weights (init 1) get +N(0, spread) too."""
    torch.manual_seed(seed)
    m = Transformer(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(GAIN)
            if spread and name.endswith(("norm.weight", ".bias")):
                p.add_(spread * torch.randn_like(p))
        if plant:
            V = cfg.vocab_size
            nxt = torch.tensor([planted_next(t, V) for t in range(V)])
            m.lm_head.weight[nxt] = m.tok_emb.weight
    w = {k: v.detach().numpy().astype(np.float32) for k, v in m.state_dict().items()}
    write_model(path, config=cfg.to_dict(), tokenizer=tokenizer_header(cfg.vocab_size, eos),
                tensors=list(checkpoint_tensors(cfg, w, Encoder(dtype, tile))), tile=tile)


def dequantized_model(path) -> Transformer:
    """The Transformer whose weights are exactly the .cflow file's, dequantized."""
    return Transformer.from_cflow(path)


# ---- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=list(VARIANTS))
def model(request, tmp_path_factory):
    preset = request.param
    dtype, tile, threads, tied = VARIANTS[preset]
    cfg = small_config(preset, tied)
    path = tmp_path_factory.mktemp(preset) / "m.cflow"
    write_random_model(path, cfg, dtype, tile)
    return preset, path, threads, dequantized_model(path)


@pytest.fixture(scope="module", params=list(VARIANTS))
def planted(request, tmp_path_factory):
    preset = request.param
    dtype, tile, threads, _ = VARIANTS[preset]
    cfg = small_config(preset, tied=False)
    path = tmp_path_factory.mktemp(preset + "-planted") / "m.cflow"
    write_random_model(path, cfg, dtype, tile, plant=True)
    return preset, path, threads, dequantized_model(path)


def prompt_tokens(cfg: ModelConfig, n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, cfg.vocab_size, n)]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / b.std())


# ---- engine vs references --------------------------------------------------------------------
def test_greedy_tokens_match_reference(planted):
    preset, path, threads, tm = planted
    eng = Engine.load(path, threads=threads)
    ref = ReferenceDecoder(tm)
    V = eng.config.vocab_size
    ref_toks, eng_toks = [], []
    tok_r = tok_e = 5
    for pos in range(STEPS):  # each side feeds its own argmax back
        lr, le = ref.step(tok_r).numpy(), eng.step(tok_e, pos)
        tok_r, tok_e = int(np.argmax(lr)), int(np.argmax(le))
        ref_toks.append(tok_r)
        eng_toks.append(tok_e)
    assert eng_toks == ref_toks, f"{preset}: greedy tokens diverge at step " \
                                 f"{next(i for i, (a, b) in enumerate(zip(eng_toks, ref_toks)) if a != b)}"
    # not a trivial sequence, and mostly (not only) the planted successor: the layers matter
    assert len(set(eng_toks)) > STEPS // 2
    planted_hits = sum(b == planted_next(a, V) for a, b in zip([5] + eng_toks, eng_toks))
    assert planted_hits >= STEPS // 2


def test_logits_close_to_float_reference(model):
    preset, path, threads, tm = model
    eng = Engine.load(path, threads=threads)
    ref = ReferenceDecoder(tm)
    errs, margins, agree = [], [], []
    for pos, t in enumerate(prompt_tokens(eng.config, 48, seed=1)):
        lr, le = ref.step(t).numpy(), eng.step(t, pos)
        errs.append(rel_err(le, lr))
        top2 = np.sort(lr)[-2:]
        margins.append((top2[1] - top2[0]) / lr.std())
        agree.append(int(np.argmax(lr)) == int(np.argmax(le)))
    errs, margins, agree = np.array(errs), np.array(margins), np.array(agree)
    msg = f"{preset}: max |dlogit| / std per position: {np.round(errs, 3)}"
    assert np.median(errs) <= MEDIAN_TOL, msg
    if eng.config.has_moe:
        assert np.mean(errs <= MAX_TOL) >= 0.85, msg
    else:
        assert errs.max() <= MAX_TOL, msg
    safe = margins > MARGIN
    assert safe.sum() >= 10, "too few decisive positions to compare argmax"
    assert agree[safe].mean() >= (0.95 if eng.config.has_moe else 1.0), msg


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


@pytest.mark.parametrize("dtype", ["q4_0", "q4_1", "q8_0"])
def test_wide_tiles_prefill_equals_steps(tmp_path, dtype):
    # Tiles wider than 512 columns take their own batched (prefill) kernel path; the variants above
    # have narrow matrices, so this model has a 640-wide w_down stored in 1024-column tiles.
    cfg = small_config("llama", tied=False, d_ff=640)
    path = tmp_path / "m.cflow"
    write_random_model(path, cfg, dtype, (64, 1024))
    toks = prompt_tokens(cfg, 13, seed=5)
    a = Engine.load(path, threads=2, max_batch=8)
    b = Engine.load(path, threads=2)
    la = a.prefill(toks).copy()
    for pos, t in enumerate(toks):
        lb = b.step(t, pos)
    assert rel_err(la, lb) < 1e-5
    ref = ReferenceDecoder(dequantized_model(path))
    ref_last = [ref.step(t) for t in toks][-1].numpy()
    assert rel_err(la, ref_last) <= MAX_TOL


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


def test_head_dim_not_a_multiple_of_8(tmp_path):
    # hd = 12: the QKV rows of one head do not fill whole 8-row groups, so the engine cannot split
    # the projection by heads and takes its other path (separate RoPE phase)
    cfg = small_config("arch2_4_combined", tied=False, n_heads=8, n_kv_heads=2)
    assert cfg.head_dim == 12
    path = tmp_path / "m.cflow"
    write_random_model(path, cfg, "q8_0", (64, 64))
    ref = ReferenceDecoder(dequantized_model(path))
    eng = Engine.load(path, threads=2, max_batch=5)
    toks = prompt_tokens(cfg, 16, seed=4)
    errs = [rel_err(eng.step(t, pos), ref.step(t).numpy()) for pos, t in enumerate(toks)]
    assert np.median(errs) <= MEDIAN_TOL, np.round(errs, 3)
    last = eng.step(toks[0], len(toks)).copy()
    eng.reset()
    eng.prefill(toks)
    assert rel_err(eng.step(toks[0], len(toks)), last) < 1e-5


# ---- the plan (cflow.runtime.plan) --------------------------------------------------------------
@pytest.mark.parametrize("dd", [0, 1, 2, 3])
@pytest.mark.parametrize("de", [0, 1, 2, 3])
@pytest.mark.parametrize("moe_input", ["post_dense", "post_attn"])
def test_plan_feeds_every_op_what_spec_section_3_says(dd, de, moe_input):
    """Run the plan symbolically: ring slots hold 'x{j}', pending slots sets of 'm{j}'."""
    from cflow import _native
    from cflow.runtime.abi import encode_plan
    from cflow.runtime.plan import build_plan

    for L in (1, 2, 5, 7):
        cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=L, n_heads=2, n_kv_heads=1, d_ff=32,
                          n_experts=2, top_k=1, d_expert=32, delta_dense=dd, delta_expert=de,
                          moe_input=moe_input)
        plan = build_plan(cfg)
        ring: list = [None] * plan.n_ring
        pending: list[set] = [set() for _ in range(plan.n_pending)]
        cur = None  # the layer whose h/f are in the buffers
        for op in plan.ops:
            l = op.layer
            if op.kind == "embed":
                ring[op.a] = "x0"
            elif op.kind == "attn":
                assert ring[op.a] == f"x{l}"
                cur = l
            elif op.kind == "dense":
                assert cur == l
                want = "h" if dd == 0 else f"x{max(l + 1 - dd, 0)}"
                assert (op.src == "h" and want == "h") or (op.src == "ring" and ring[op.a] == want)
            elif op.kind == "route":
                assert op.src == ("hf" if moe_input == "post_dense" else "h")
            elif op.kind == "experts":
                pending[op.a].add(f"m{l}")
            elif op.kind == "resid":
                assert op.b == 1 and pending[op.c] == {f"m{j}" for j in range(L) if j + de == l}
                pending[op.c] = set()
                ring[op.a] = f"x{l + 1}"
            else:
                assert op.kind == "final" and op is plan.ops[-1]
                assert ring[op.a] == f"x{L}" and pending[op.b] == {f"m{j}" for j in range(L) if j + de >= L}
        assert plan.n_ring == cfg.history_depth
        assert [o.node for o in plan.ops if o.node] == [n for n in ["embed"] + [
            f"L{l}.{k}" for l in range(L) for k in ("attn", "dense", "router", "experts")] + ["lm_head"]]
        flat = [n for stage in plan.stages for n in stage]
        assert sorted(flat) == sorted(o.node for o in plan.ops if o.node)
        assert encode_plan(plan, _native).shape == (len(plan.ops), _native.OP_FIELDS)


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
    assert c["dense"] == L * (nb("layers.0.ffn_norm") + nb("layers.0.ffn.w_gate_up") + nb("layers.0.ffn.w_down"))
    assert c["attn"] == L * (nb("layers.0.attn_norm") + nb("layers.0.attn.wqkv") + nb("layers.0.attn.wo"))
    assert c["lm_head"] == nb("norm") + nb("lm_head")
    assert c["embed"] == nb("tok_emb") // cfg.vocab_size
    assert c["router"] == L * (nb("layers.0.moe_norm") + nb("layers.0.moe.router"))
    assert c["tokens"] == 1 and c["calls"] == 1
    hits = np.array(eng.expert_hits())
    assert hits.shape == (L, E) and (hits.sum(axis=1) == k).all()
    assert eng.weight_bytes_per_token() == sum(c[x] for x in ("attn", "dense", "router", "experts", "embed",
                                                              "lm_head"))


# ---- generation, errors ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    cfg = small_config("llama", max_seq_len=256)
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


def test_generate_takes_every_sampling_field(llama_path):
    """generate() passes the penalties and logit_bias on as complete() does: banning the greedy
    first token changes it, and the streamed text still equals complete()'s."""
    eng = Engine.load(llama_path, threads=1)
    greedy = eng.complete([10, 20, 30], max_tokens=6, temperature=0)
    kw = dict(max_tokens=6, temperature=0, logit_bias={greedy.tokens[0]: -100}, frequency_penalty=0.5,
              presence_penalty=0.5)
    banned = eng.complete([10, 20, 30], **kw)
    assert banned.tokens[0] != greedy.tokens[0]
    assert "".join(eng.generate([10, 20, 30], **kw)) == banned.text


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
    with pytest.raises(ContextOverflowError, match="raise the context") as e:
        eng.complete(list(range(20)), max_tokens=1)
    assert e.value.flag == "-c"
    # at the model's own limit, "raise it with -c" would send the user in a circle
    top = Engine.load(llama_path, threads=1, n_ctx=eng.config.max_seq_len)
    with pytest.raises(ContextOverflowError, match="already the model's maximum") as e:
        top.complete(list(range(eng.config.max_seq_len + 1)), max_tokens=1)
    assert "raise the context" not in str(e.value)
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


# ---- threads ------------------------------------------------------------------------------------
def test_active_threads_do_not_change_results(llama_path):
    eng = Engine.load(llama_path, threads=3)
    toks = [5, 9, 200, 17]
    outs = []
    for n in (3, 1, 2):
        eng._native.active_threads = n
        assert eng._native.active_threads == n
        eng.reset()
        eng.prefill(toks[:2])
        outs.append(eng.step(toks[2], 2).copy())
    assert all(np.array_equal(o, outs[0]) for o in outs)  # bit for bit: same code per row and head
    eng._native.active_threads = 99
    assert eng._native.active_threads == 3  # clamped to the pool


def test_no_mmap_gives_the_same_logits(llama_path):
    a = Engine.load(llama_path, threads=1)
    b = Engine.load(llama_path, threads=1, mmap=False)
    assert not isinstance(b.file.buffer, np.memmap)
    assert np.array_equal(a.prefill([3, 4, 5]), b.prefill([3, 4, 5]))


def test_default_threads_and_context(llama_path):
    import os

    from cflow.runtime import usable_threads

    n = usable_threads()
    assert 1 <= n <= (os.cpu_count() or 1)
    eng = Engine.load(llama_path)
    assert eng.threads == n and eng.n_ctx == min(eng.config.max_seq_len, 4096)
    assert (eng.tuner is None) == (n == 1)  # auto threads: decode measures what is fastest


def test_thread_tuner_follows_the_faster_count():
    from cflow.runtime.threads import ThreadTuner

    t = ThreadTuner(2)
    cost = {1: 3.0, 2: 5.0}  # a busy machine: one thread is faster
    used = []
    for _ in range(200):
        n = t.pick()
        used.append(n)
        t.record(n, cost[n])
    assert t.best == 1 and used[-1] == 1 and used.count(2) < 30
    cost = {1: 3.0, 2: 1.5}  # the machine quiets down: the next probes move back to 2 threads
    for _ in range(200):
        n = t.pick()
        t.record(n, cost[n])
    assert t.best == 2
    assert ThreadTuner(1).choices == [1]


# ---- the command line ---------------------------------------------------------------------------
def test_cli_generate_streams_and_reports(llama_path, capsys):
    from cflow.cli import main

    rc = main(["generate", "-m", str(llama_path), "-p", "abc", "-n", "12", "--temp", "0", "-t", "1"])
    out, err = capsys.readouterr()
    assert rc == 0
    eng = Engine.load(llama_path, threads=1)
    want = eng.complete("abc", max_tokens=12, temperature=0).text
    assert out == "abc" + want + "\n"
    assert "prompt eval time" in err and "eval time" in err and "tokens per second" in err
    rc = main(["generate", "-m", str(llama_path), "abc", "-n", "12", "--temp", "0", "--no-display-prompt",
               "--no-perf", "-c", "8"])
    out, err = capsys.readouterr()
    assert rc == 0 and out == want[: len(out) - 1] + "\n" and "end of the context (8 tokens)" in err


def test_cli_errors_are_one_line(llama_path, tmp_path, capsys):
    from cflow.cli import main

    assert main(["generate", "-m", str(tmp_path / "missing.cflow"), "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "-m", str(llama_path), "hi", "--top-p", "2"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert main(["generate", "-m", str(llama_path), "x" * 200, "-c", "16"]) == 2
    err = capsys.readouterr().err
    assert "context" in err and "-c" in err and "Traceback" not in err


def test_cli_chat_reads_turns_until_exit(llama_path, monkeypatch, capsys):
    import io

    from cflow.cli import main

    monkeypatch.setenv("CFLOW_CACHE", str(llama_path.parent))  # readline history goes here
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/reset\nhello\n/exit\nnot read\n"))
    rc = main(["chat", "-m", str(llama_path), "-n", "5", "--temp", "0", "-sys", "be brief"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    eng = Engine.load(llama_path, threads=1)
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    answer = eng.chat(first, 5, temperature=0).text
    assert answer and out == answer + "\n" + answer + "\n"  # /reset: the same answer again
    assert "[conversation cleared]" in err
    # a context that holds one turn but not two: the oldest turn is dropped, with a note
    one = len(eng.chat_tokens(first))
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nhello\n"))
    rc = main(["chat", "-m", str(llama_path), "-n", "5", "--temp", "0", "-sys", "be brief", "-c", str(one + 8)])
    out, err = capsys.readouterr()
    assert rc == 0 and "dropped the oldest turn" in err and out == answer + "\n" + answer + "\n"


def test_d_split_partitions_the_rows_and_keeps_bands_whole_where_it_can():
    """engine.c's d_split (the rows of wo / down, and of the RESID op, per thread), for a one-row
    call (whole bands where it can) and a call of many rows (an even split by groups): every row
    group owned by exactly one thread, at most two ranges each, no thread over 5/4 of an even share
    (one group of rounding aside); at 2 threads on the shapes measured (d 576, 1152, 2880: a part
    band or an odd band left over) a one-row call splits no 16-group band between threads, and a
    call of many rows gives the threads shares within one group of each other."""
    from cflow import _native

    band = 16
    for whole in (True, False):
        for nth in range(1, 9):
            for ng in range(0, 400):
                owned, shares = [], []
                for ith in range(nth):
                    ranges = _native.d_split(ng, ith, nth, whole)
                    assert len(ranges) <= 2 and all(lo < hi for lo, hi in ranges)
                    shares.append(sum(hi - lo for lo, hi in ranges))
                    assert shares[-1] <= 1.25 * ng / nth + 1, (ng, ith, nth, ranges)
                    owned += [g for lo, hi in ranges for g in range(lo, hi)]
                assert sorted(owned) == list(range(ng)), (ng, nth)
                if not whole:
                    assert max(shares) - min(shares) <= 1, (ng, nth, shares)
    for d in (576, 1152, 2880):
        ng = d // 8
        for ith in range(2):
            for lo, hi in _native.d_split(ng, ith, 2, True):
                assert lo % band == 0 and (hi % band == 0 or hi == ng), (d, ith, lo, hi)
    with pytest.raises(ValueError):
        _native.d_split(10, 2, 2)
