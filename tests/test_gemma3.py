"""Gemma 3 (GGUF `general.architecture` "gemma3", text only), end to end.

A random-weight Gemma 3 GGUF is written here with gguf.GGUFWriter the way convert_hf_to_gguf.py
writes one (conversion/gemma.py, Gemma3Model): NEOX RoPE (Q/K not permuted), norms stored as
(1 + w) (so read as they are), attention.key_length 96 != d / n_heads, per-head attn_q_norm /
attn_k_norm, post_attention_norm and post_ffw_norm, tied embeddings, a sliding window of 8 with
`attention.sliding_window_pattern` 3 over 6 layers (local layers 0, 1, 3, 4; global 2, 5), linear
RoPE scaling (factor 8, as Gemma 3 4B and up carry) and a SentencePiece vocabulary without the
space prefix (what Gemma 3's tokenizer.model gives). d 256, GQA 4/2, weights Q8_0, norms F32.

Oracles, as tests/test_families.py's (and its tolerances: max|dlogit| / std(logits) per position,
median <= 4%, every position <= 7%, argmax equal where the oracle's margin exceeds 0.2 std):
- llama.cpp (llama-cpp-python 0.3.36, llama_model_gemma3's graph) on the same GGUF, teacher-forced
  over 32 positions, so the window of 8 binds;
- the PyTorch reference (cflow.model.ReferenceDecoder) over weights taken from the GGUF alone, with
  a config written here (not derived by the converter).
Controls: the reference without each feature the family adds (post-norms, the embedding scale,
GeGLU, the local layers' window (which must agree before position W), the pattern (every layer
local, every layer global), the local layers' RoPE base, the linear scaling of the global layers)
misses llama.cpp by far, so each comparison sees it.
The engine's prefill equals its step-by-step decoding bit for bit (1e-5), and the engine tests run
on every other kernel table this CPU has (in a subprocess with CFLOW_ISA, as test_every_isa.py).
The tokenizer: cflow's reading of the file's vocabulary tokenizes and detokenizes as llama.cpp on
the same gemma3 file, over test_tokenizer_gguf's tricky strings (a trained vocabulary of a few
hundred pieces plus Gemma's turn markers: no real Gemma vocabulary is available offline). The chat
template: Gemma 3's own, carried by the file, renders through cflow's jinja path as llama.cpp's
built-in gemma format does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cflow.config import ModelConfig
from cflow.convert import convert
from cflow.convert.gguf import GGUFError, GGUFModel, UnsupportedArchitectureError, gguf_config
from cflow.fileformat import open_model

pytestmark = pytest.mark.oracle  # llama.cpp (llama-cpp-python) is the oracle here, as in test_families

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from isa_runner import other_isas, run_under  # noqa: E402
from test_convert_gguf import add_tensor  # noqa: E402
from test_convert_gguf_moe import gguf_values, teacher_forced  # noqa: E402
from test_moe_llamacpp import MAX_TOL, MEDIAN_TOL, check, compare, far  # noqa: E402  (skips without llama_cpp)
from test_tokenizer_gguf import TRICKY, detokenize, trained_spm_vocab  # noqa: E402

T = gguf.GGMLQuantizationType
D, HEADS, KV_HEADS, HD, LAYERS, FF, CTX = 256, 4, 2, 96, 6, 512, 64
EPS, THETA, LOCAL_THETA, FACTOR = 1e-6, 1e6, 10000.0, 8.0
WINDOW, PATTERN, STEPS = 8, 3, 32


# Gemma 3's chat template (google/gemma-3-*-it tokenizer_config.json, which convert_hf_to_gguf
# copies into tokenizer.chat_template), written out here.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n")


def vocab() -> tuple[list[str], list[float], list[int]]:
    """test_tokenizer_gguf's trained SentencePiece vocabulary plus Gemma's turn markers (control)."""
    tokens, scores, types = trained_spm_vocab()
    return tokens + ["<start_of_turn>", "<end_of_turn>"], scores + [0.0, 0.0], types + [3, 3]


def gemma_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Float weights under GGUF names. Norm weights around 1 (the GGUF's 1 + w); q/k norms around 2,
    so attention is peaked and the rotation angles (hence the RoPE bases and the window) matter;
    embeddings small, as Gemma's are, so that sqrt(d) brings them to the blocks' scale."""
    rng = np.random.default_rng(seed)
    V, q, kv = len(vocab()[0]), HEADS * HD, KV_HEADS * HD

    def mat(*shape, gain=1.0):
        return (gain * rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def norm(n=D, mean=1.0, spread=0.1):
        return (mean + spread * rng.standard_normal(n)).astype(np.float32)

    w = {"token_embd.weight": (0.1 * rng.standard_normal((V, D))).astype(np.float32), "output_norm.weight": norm()}
    for i in range(LAYERS):
        b = f"blk.{i}."
        w.update({b + "attn_norm.weight": norm(), b + "attn_q.weight": mat(q, D), b + "attn_k.weight": mat(kv, D),
                  b + "attn_v.weight": mat(kv, D), b + "attn_output.weight": mat(D, q),
                  b + "attn_q_norm.weight": norm(HD, 1.0, 0.2), b + "attn_k_norm.weight": norm(HD, 1.0, 0.2),
                  b + "post_attention_norm.weight": norm(mean=0.3, spread=0.1), b + "ffn_norm.weight": norm(),
                  b + "ffn_gate.weight": mat(FF, D), b + "ffn_up.weight": mat(FF, D),
                  b + "ffn_down.weight": mat(D, FF), b + "post_ffw_norm.weight": norm(mean=0.3, spread=0.1)})
    return w


def write_gemma3_gguf(path: Path, seed: int = 0, *, window: int = WINDOW, pattern=PATTERN, keys: dict | None = None,
                      tensors: dict | None = None, layers: int = LAYERS, block_count: int | None = None) -> None:
    """The test's gemma3 GGUF. pattern: a period (uint32), a list of per-layer bools, or None (the
    key left out: llama.cpp's default 6). keys: more `gemma3.*` keys; tensors: more tensors; layers:
    the layers written (block_count: the count the header claims, default layers)."""
    w = gemma_weights(seed)
    toks, scores, types = vocab()
    wr = gguf.GGUFWriter(str(path), "gemma3")
    wr.add_name("tiny-gemma3")
    wr.add_block_count(layers if block_count is None else block_count)
    wr.add_context_length(CTX)
    wr.add_embedding_length(D)
    wr.add_feed_forward_length(FF)
    wr.add_head_count(HEADS)
    wr.add_head_count_kv(KV_HEADS)
    wr.add_key_length(HD)
    wr.add_value_length(HD)
    wr.add_rope_freq_base(THETA)
    wr.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    wr.add_rope_scaling_factor(FACTOR)
    wr.add_layer_norm_rms_eps(EPS)
    if window:
        wr.add_sliding_window(window)
    if isinstance(pattern, int):
        wr.add_uint32("gemma3.attention.sliding_window_pattern", pattern)
    elif pattern is not None:
        wr.add_array("gemma3.attention.sliding_window_pattern", [bool(x) for x in pattern])
    for key, v in (keys or {}).items():
        add = wr.add_string if isinstance(v, str) else wr.add_uint32 if isinstance(v, int) else wr.add_float32
        add(f"gemma3.{key}", v)
    wr.add_tokenizer_model("llama")
    wr.add_token_list(toks)
    wr.add_token_scores(scores)
    wr.add_token_types(types)
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    wr.add_add_space_prefix(False)  # Gemma3Model.set_vocab
    wr.add_chat_template(GEMMA3_TEMPLATE)
    for name, x in w.items():
        if name.startswith("blk.") and int(name.split(".")[1]) >= layers:
            continue
        add_tensor(wr, name, x, T.F32 if x.ndim == 1 else T.Q8_0)
    for name, x in (tensors or {}).items():
        wr.add_tensor(name, x)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


def expected_config(**overrides) -> ModelConfig:
    """The config llama.cpp's gemma3 graph implies for the test file, written out here."""
    cfg = ModelConfig(vocab_size=len(vocab()[0]), d_model=D, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS,
                      head_dim=HD, d_ff=FF, n_experts=0, top_k=0, d_expert=0, rope_theta=THETA,
                      rope_freq_factors=(FACTOR,) * (HD // 2), norm_eps=float(np.float32(EPS)), max_seq_len=CTX,
                      tie_embeddings=True, qk_norm=True, sliding_window=WINDOW, sliding_window_pattern=PATTERN,
                      rope_theta_local=LOCAL_THETA, embed_scale=float(np.sqrt(np.float32(D))), post_norms=True,
                      ffn_act="gelu_tanh", name="gemma3")
    return cfg.replace(**overrides)


def reference_state(path: Path, drop_post: bool = False) -> dict[str, np.ndarray]:
    """The PyTorch reference's parameters from the GGUF alone (drop_post: without the post-norms,
    for a config without them)."""
    g = GGUFModel(path)
    v = lambda n: gguf_values(g, n)  # noqa: E731
    sd = {"tok_emb.weight": v("token_embd.weight"), "norm.weight": v("output_norm.weight")}
    for i in range(LAYERS):
        b, p = f"blk.{i}.", f"layers.{i}."
        sd.update({p + "attn_norm.weight": v(b + "attn_norm.weight"), p + "attn.wq.weight": v(b + "attn_q.weight"),
                   p + "attn.wk.weight": v(b + "attn_k.weight"), p + "attn.wv.weight": v(b + "attn_v.weight"),
                   p + "attn.wo.weight": v(b + "attn_output.weight"),
                   p + "attn.q_norm.weight": v(b + "attn_q_norm.weight"),
                   p + "attn.k_norm.weight": v(b + "attn_k_norm.weight"),
                   p + "ffn_norm.weight": v(b + "ffn_norm.weight"), p + "ffn.w_gate.weight": v(b + "ffn_gate.weight"),
                   p + "ffn.w_up.weight": v(b + "ffn_up.weight"), p + "ffn.w_down.weight": v(b + "ffn_down.weight")})
        if not drop_post:
            sd[p + "attn_post_norm.weight"] = v(b + "post_attention_norm.weight")
            sd[p + "ffn_post_norm.weight"] = v(b + "post_ffw_norm.weight")
    return sd


def reference_logits(cfg: ModelConfig, sd: dict[str, np.ndarray], toks: list[int]) -> np.ndarray:
    from cflow.model import ReferenceDecoder, Transformer

    ref = ReferenceDecoder(Transformer.from_state(cfg, {k: torch.from_numpy(np.ascontiguousarray(x))
                                                         for k, x in sd.items()}))
    return teacher_forced(lambda t, pos: ref.step(t).numpy(), toks)


def engine_logits(path: Path, toks: list[int], threads: int = 1) -> np.ndarray:
    from cflow.runtime import Engine

    return teacher_forced(Engine.load(path, threads=threads).step, toks)


def sequence(n: int = STEPS, seed: int = 7) -> list[int]:
    """Token ids over the vocabulary's ordinary pieces (its bytes and pieces; not <unk>/<s>/</s>)."""
    return [int(t) for t in np.random.default_rng(seed).integers(3, len(vocab()[0]) - 2, n)]


def llama_cpp_logits(path: Path, toks: list[int]) -> np.ndarray:
    from test_moe_llamacpp import llama_cpp_logits as run

    return run(path, toks)


# ---- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma_run(tmp_path_factory):
    """(gguf path, cflow path, tokens, engine logits)."""
    d = tmp_path_factory.mktemp("gemma3")
    src, dst = d / "gemma3.gguf", d / "gemma3.cflow"
    write_gemma3_gguf(src)
    convert(src, dst)
    toks = sequence()
    return src, dst, toks, engine_logits(dst, toks)


@pytest.fixture(scope="module")
def llama_cpp_run(gemma_run):
    src, _, toks, _ = gemma_run
    return llama_cpp_logits(src, toks)


@pytest.fixture(scope="module")
def reference_run(gemma_run):
    src, _, toks, _ = gemma_run
    return reference_logits(expected_config(), reference_state(src), toks)


# ---- import ----------------------------------------------------------------------------------
def test_config_and_tensors(gemma_run):
    src, dst, _, _ = gemma_run
    want = expected_config()
    got = gguf_config(GGUFModel(src))
    np.testing.assert_allclose(got.rope_freq_factors, want.rope_freq_factors)
    assert got == want
    f = open_model(dst)
    assert f.config == want
    assert f.header["metadata"]["source"]["architecture"] == "gemma3"
    assert {"layers.5.attn_post_norm", "layers.5.ffn_post_norm", "layers.5.attn.q_norm"} <= set(f.tensors)
    assert "lm_head" not in f.tensors  # tied
    # the local / global layers llama.cpp's set_swa_pattern(3) gives: every third global
    assert [f.config.is_local(layer) for layer in range(LAYERS)] == [True, True, False, True, True, False]
    assert [f.config.layer_rope(layer)[0] for layer in range(LAYERS)] == [LOCAL_THETA, LOCAL_THETA, THETA] * 2
    f.close()


def test_post_norms_are_the_stored_values(gemma_run):
    """GGUF norms already hold Gemma's 1 + w: the .cflow keeps them exactly as stored."""
    from cflow.convert.encoder import stored_values

    src, dst, _, _ = gemma_run
    sd, f = reference_state(src), open_model(dst)
    for i in range(LAYERS):
        for n in ("attn_post_norm", "ffn_post_norm", "attn.q_norm", "attn_norm"):
            np.testing.assert_array_equal(stored_values(f, f"layers.{i}.{n}"), sd[f"layers.{i}.{n}.weight"])
    f.close()


@pytest.mark.parametrize("pattern, layers, want", [
    (None, 6, 6), (None, 4, 6), (2, 6, 2), (0, 6, 0), (1, 6, 1),
    ([True, True, False, True, True, False], 6, 3), ([True] * 4, 4, 0), ([False] * 4, 4, 1)])
def test_window_pattern_keys(tmp_path, pattern, layers, want):
    """attention.sliding_window_pattern as llama.cpp's load_swa_pattern reads it: absent -> 6, a
    period (0: every layer local), or a per-layer array, read as the period it repeats."""
    write_gemma3_gguf(tmp_path / "p.gguf", pattern=pattern, layers=layers)
    cfg = gguf_config(GGUFModel(tmp_path / "p.gguf"))
    assert cfg.sliding_window_pattern == want
    n = want
    assert [cfg.is_local(layer) for layer in range(layers)] == [n == 0 or layer % n < n - 1 for layer in range(layers)]


def test_window_and_local_base_keys(tmp_path):
    # no window: every layer global, one RoPE (llama.cpp's LLAMA_SWA_TYPE_NONE), the pattern unread
    write_gemma3_gguf(tmp_path / "a.gguf", window=0)
    cfg = gguf_config(GGUFModel(tmp_path / "a.gguf"))
    assert (cfg.sliding_window, cfg.sliding_window_pattern, cfg.rope_theta_local) == (0, 0, 0.0)
    assert not any(cfg.is_local(layer) for layer in range(LAYERS))
    # rope.freq_base_swa, when the file has one, is the local layers' base
    write_gemma3_gguf(tmp_path / "b.gguf", keys={"rope.freq_base_swa": 500.0})
    assert gguf_config(GGUFModel(tmp_path / "b.gguf")).rope_theta_local == 500.0


def test_27b_attention_scale(tmp_path):
    """llama.cpp scales a 62-layer (27B) model's scores by 1/sqrt(d / n_heads), every other by
    1/sqrt(head_dim): only the header is read here."""
    write_gemma3_gguf(tmp_path / "big.gguf", layers=0, block_count=62)
    cfg = gguf_config(GGUFModel(tmp_path / "big.gguf"))
    assert cfg.attn_scale == float(np.float32(1) / np.sqrt(np.float32(D // HEADS)))
    assert cfg.scores_scale != 1 / np.sqrt(HD)
    write_gemma3_gguf(tmp_path / "small.gguf", layers=0, block_count=26)
    assert gguf_config(GGUFModel(tmp_path / "small.gguf")).attn_scale == 0.0


@pytest.mark.parametrize("change, match", [
    (dict(keys={"final_logit_softcapping": 30.0}), "final_logit_softcapping = 30"),
    (dict(keys={"rope.scaling.type": "yarn"}), "gemma3 model with yarn RoPE scaling"),
    (dict(keys={"attention.key_length_swa": 64}), "key_length_swa = 64"),
    (dict(pattern=[True, False, True, True, False, True]), "is not periodic"),
    (dict(tensors={"v.patch_embd.weight": np.zeros((4, 32), np.float32)}), "vision tower"),
])
def test_what_cflow_does_not_run_is_refused_by_name(tmp_path, change, match):
    src = tmp_path / "m.gguf"
    write_gemma3_gguf(src, **change)
    with pytest.raises(UnsupportedArchitectureError if "tensors" in change else GGUFError, match=match):
        convert(src, tmp_path / "m.cflow")
    assert not (tmp_path / "m.cflow").exists()


def test_mmproj_and_gemma4_vision_are_refused_by_name(tmp_path):
    for arch, extra, match in (("clip", {"clip.projector_type": "gemma3"}, "vision tower \\('gemma3' projector"),
                               ("gemma4", {}, "vision tower \\('vision' projector.*v.patch_embd")):
        wr = gguf.GGUFWriter(str(tmp_path / f"{arch}.gguf"), arch)
        for key, v in extra.items():
            wr.add_string(key, v)
        wr.add_tensor("v.patch_embd.weight", np.zeros((4, 32), np.float32))
        wr.write_header_to_file()
        wr.write_kv_data_to_file()
        wr.write_tensors_to_file()
        wr.close()
        with pytest.raises(UnsupportedArchitectureError, match=match):
            convert(tmp_path / f"{arch}.gguf", tmp_path / f"{arch}.cflow")


def test_sliding_window_override_is_refused(tmp_path):
    write_gemma3_gguf(tmp_path / "m.gguf")
    with pytest.raises(GGUFError, match="alternates local and global layers"):
        convert(tmp_path / "m.gguf", tmp_path / "m.cflow", sliding_window=0)


# ---- the engine against the oracles ----------------------------------------------------------
def test_engine_matches_llama_cpp(gemma_run, llama_cpp_run):
    check(gemma_run[3], llama_cpp_run, moe=False)


def test_engine_matches_reference(gemma_run, reference_run):
    check(gemma_run[3], reference_run, moe=False)


def test_reference_matches_llama_cpp(reference_run, llama_cpp_run):
    check(reference_run, llama_cpp_run, moe=False)


CONTROLS = {
    "no post-norms": dict(post_norms=False),
    "no embedding scale": dict(embed_scale=1.0),
    "SwiGLU for GeGLU": dict(ffn_act="silu"),
    "local layers without their window": dict(sliding_window=10_000),  # wider than the context
    "every layer local (window and RoPE)": dict(sliding_window_pattern=0),
    "every layer global (no window, one RoPE)": dict(sliding_window=0, sliding_window_pattern=0, rope_theta_local=0.0),
    "local layers with the global RoPE": dict(rope_theta_local=0.0),
    "global layers without linear scaling": dict(rope_freq_factors=()),
}


@pytest.mark.parametrize("control", list(CONTROLS))
def test_reference_without_a_feature_misses_llama_cpp(gemma_run, llama_cpp_run, control):
    src, _, toks, _ = gemma_run
    cfg = expected_config(**CONTROLS[control])
    got = reference_logits(cfg, reference_state(src, drop_post=not cfg.post_norms), toks)
    if control == "local layers without their window":  # before position W the window hides nothing
        errs = compare(got[:WINDOW], llama_cpp_run[:WINDOW])[0]  # (too few positions for check's argmax rule)
        assert np.median(errs) <= MEDIAN_TOL and errs.max() <= MAX_TOL, np.round(errs, 3)
        got, want = got[WINDOW:], llama_cpp_run[WINDOW:]
    else:
        want = llama_cpp_run
    assert far(got, want), control


def test_whole_sequence_reference_matches_the_decoder(gemma_run, reference_run):
    """Transformer.forward (the training path: masks per layer, per-layer RoPE tables) agrees with
    the token-by-token decoder."""
    from cflow.model import Transformer

    src, _, toks, _ = gemma_run
    tm = Transformer.from_state(expected_config(), {k: torch.from_numpy(np.ascontiguousarray(x))
                                                    for k, x in reference_state(src).items()})
    with torch.no_grad():
        whole = tm(torch.tensor([toks]))[0][0].double().numpy()
    assert np.abs(whole - reference_run).max() / reference_run.std() < 1e-4


def test_prefill_equals_steps(gemma_run):
    """Prefill (block attention, batched kernels, GeGLU over the mat-mat) and batched rows equal
    the steps, across the window and both kinds of layer."""
    from test_engine import rel_err

    from cflow.runtime import Engine

    _, dst, toks, got = gemma_run
    eng = Engine.load(dst, threads=2, max_batch=7)
    for n in (WINDOW - 1, WINDOW + 3, STEPS):
        assert rel_err(eng.prefill(toks[:n]), got[n - 1]) < 1e-5
    two = Engine.load(dst, threads=2, n_seq=2)
    two.prefill(toks[:20], seq=0)
    rows = two.step_rows([0, 0, 1], [toks[20], toks[21], toks[0]], [20, 21, 0])
    assert rel_err(rows[1], got[21]) < 1e-5 and rel_err(rows[2], got[0]) < 1e-5


def test_engine_threads_agree(gemma_run):
    _, dst, toks, got = gemma_run
    np.testing.assert_array_equal(engine_logits(dst, toks[:12], threads=2), got[:12])


def test_tokenizer_matches_llama_cpp(gemma_run):
    """The file's SentencePiece vocabulary (no space prefix, as Gemma 3's) through cflow's reader
    and llama.cpp's gemma3 model load: ids with and without BOS, and detokenization."""
    import llama_cpp

    from test_tokenizer_gguf import cflow_from_gguf

    src = gemma_run[0]
    tok = cflow_from_gguf(src)
    assert tok.model == "spm" and not tok.add_space_prefix and tok.add_bos
    llm = llama_cpp.Llama(model_path=str(src), vocab_only=True, verbose=False)
    try:
        for text in TRICKY:
            for bos in (False, True):
                assert tok.encode(text, add_bos=bos) == llm.tokenize(text.encode(), add_bos=bos, special=True), text
            ids = llm.tokenize(text.encode(), add_bos=True, special=False)
            assert tok.decode(ids) == detokenize(llama_cpp, llm, ids, remove_special=False, unparse_special=True)
    finally:
        llm.close()


# ---- every kernel table ------------------------------------------------------------------------
ISA_TESTS = [f"tests/test_gemma3.py::{t}" for t in ("test_engine_matches_reference", "test_prefill_equals_steps")]


@pytest.mark.parametrize("isa", other_isas())
def test_every_other_kernel_table(isa):
    run_under(isa, ISA_TESTS, len(ISA_TESTS))


# ---- the chat template -------------------------------------------------------------------------
def test_chat_template_renders_as_llama_cpp(gemma_run):
    """The file's template through cflow's jinja path renders what llama.cpp's built-in gemma
    format (llama_chat_apply_template, which recognises the template by <start_of_turn>) gives,
    after the BOS the template writes itself; the turn end stops generation."""
    import ctypes

    import llama_cpp

    from cflow.runtime import Engine

    eng = Engine.load(gemma_run[1], threads=1)
    tok = eng.tokenizer
    assert tok.special["<end_of_turn>"] in tok.stop_ids
    chats = [[{"role": "user", "content": "Hello there!"}],
             [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": " Why? "},
              {"role": "assistant", "content": "Because."}, {"role": "user", "content": "日本 😀\nok"}]]
    for chat in chats:
        for add in (True, False):
            msgs = (llama_cpp.llama_chat_message * len(chat))(
                *[llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in chat])
            buf = ctypes.create_string_buffer(4096)
            n = llama_cpp.llama_chat_apply_template(GEMMA3_TEMPLATE.encode(), msgs, len(chat), add, buf, len(buf))
            assert 0 < n < len(buf)
            theirs = tok.vocab[tok.bos_id] + buf.raw[:n].decode()
            assert tok.apply_chat_template(chat, add_generation_prompt=add) == theirs
