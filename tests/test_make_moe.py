"""cflow.bench.synthetic (and its command line, benchmarks/make_moe.py): random-weight MoE models, as
a Mixtral-layout GGUF and a pipeline-native .cflow. Tiny geometries (about 1 MB a file): the GGUF's keys, shapes and types as gguf reads them,
llama.cpp loading and evaluating it (when llama-cpp-python is installed), the .cflow verifying and
running in the engine, the GGUF converted by cflow agreeing with llama.cpp, valid random blocks in the tile layout, reproducibility by seed, streaming
(at most two tensors' bytes alive at once, and resident memory far below the file size), the CLI."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from cflow import dag, quant
from cflow.bench import synthetic as mm
from cflow.fileformat import open_model

gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "make_moe.py"


def _load_cli():
    """The command line lives in the checkout's benchmarks/ (beside these tests), the library in the package."""
    spec = importlib.util.spec_from_file_location("make_moe", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_moe"] = mod
    spec.loader.exec_module(mod)
    return mod


cli = _load_cli()

# 3 layers so that an expert output lands inside the stack (layer 0 -> 2) and past its end;
# vocab 300 is not a multiple of 8 rows, so tok_emb/lm_head take the row-then-tile path, every
# other matrix the direct tiled one; d_ff 384 spans two 256-wide tiles.
TINY = mm.Geometry(layers=3, d_model=128, experts=4, top_k=2, d_ff=384, heads=4, kv_heads=2, vocab=300,
                   ctx=256)


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    g = mm.write_gguf(d / "m.gguf", TINY, "q4_0", seed=0, progress=False)
    c = mm.write_cflow(d / "m.cflow", TINY, "q4_0", seed=0, progress=False)
    return d, g, c


# ---- the GGUF ---------------------------------------------------------------------------------
def field(r, key):
    return r.fields[key].contents()


def test_gguf_keys_and_tensors(files):
    d, g, _ = files
    r = gguf.GGUFReader(d / "m.gguf")
    assert field(r, "general.architecture") == "llama"
    assert field(r, "llama.expert_count") == 4 and field(r, "llama.expert_used_count") == 2
    assert field(r, "llama.block_count") == 3 and field(r, "llama.embedding_length") == 128
    assert field(r, "llama.feed_forward_length") == 384
    assert field(r, "llama.attention.head_count") == 4 and field(r, "llama.attention.head_count_kv") == 2
    assert field(r, "llama.context_length") == 256
    assert field(r, "general.file_type") == int(gguf.LlamaFileType.MOSTLY_Q4_0)
    T = gguf.GGMLQuantizationType
    t = {x.name: x for x in r.tensors}
    assert len(t) == 3 + 10 * 3
    want = {  # GGUF ne order (numpy order reversed)
        "token_embd.weight": ([128, 300], T.Q4_0), "output.weight": ([128, 300], T.Q4_0),
        "output_norm.weight": ([128], T.F32),
        "blk.2.attn_norm.weight": ([128], T.F32), "blk.2.ffn_norm.weight": ([128], T.F32),
        "blk.2.attn_q.weight": ([128, 128], T.Q4_0), "blk.2.attn_k.weight": ([128, 64], T.Q4_0),
        "blk.2.attn_v.weight": ([128, 64], T.Q4_0), "blk.2.attn_output.weight": ([128, 128], T.Q4_0),
        "blk.2.ffn_gate_inp.weight": ([128, 4], T.F32),
        "blk.2.ffn_gate_exps.weight": ([128, 384, 4], T.Q4_0), "blk.2.ffn_up_exps.weight": ([128, 384, 4], T.Q4_0),
        "blk.2.ffn_down_exps.weight": ([384, 128, 4], T.Q4_0),
    }
    for name, (shape, ty) in want.items():
        assert t[name].shape.tolist() == shape, name
        assert t[name].tensor_type == ty, name
    for i in range(3):
        assert {f"blk.{i}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")} <= set(t)
    assert g.file_bytes == (d / "m.gguf").stat().st_size
    assert 0 < g.file_bytes - mm.gguf_data_bytes(TINY, "q4_0") < 200_000  # data + a small header


def test_gguf_values_are_sane_and_follow_the_seed(files):
    d, _, _ = files
    r = gguf.GGUFReader(d / "m.gguf")
    t = {x.name: x for x in r.tensors}
    np.testing.assert_array_equal(np.asarray(t["blk.1.attn_norm.weight"].data), np.ones(128, np.float32))
    router = np.asarray(t["blk.1.ffn_gate_inp.weight"].data).reshape(4, 128)
    np.testing.assert_array_equal(router, mm.router_values(mm.tensor_rng(0, "blk.1.ffn_gate_inp.weight"), 4, 128))
    for name, cols in (("blk.0.ffn_gate_exps.weight", 128), ("blk.0.ffn_down_exps.weight", 384),
                       ("token_embd.weight", 128)):
        x = t[name]
        w = gguf.quants.dequantize(np.asarray(x.data), x.tensor_type)
        assert np.isfinite(w).all()
        assert w.std() == pytest.approx(mm.tensor_gain(name, cols) / np.sqrt(cols), rel=0.1), name
    # expert e of a 3-D tensor is its own stream: regenerate expert 3 alone
    x = t["blk.0.ffn_down_exps.weight"]
    e3 = np.asarray(x.data).reshape(4, -1)[3]
    np.testing.assert_array_equal(
        e3, mm.random_rows(mm.tensor_rng(0, "blk.0.ffn_down_exps.weight", 3), "q4_0", 128, 384,
                           mm.tensor_gain("blk.0.ffn_down_exps.weight", 384)).reshape(-1))


def test_routing_varies_by_token_and_layer(tmp_path):
    """An expert-cache benchmark means nothing if every token picks the same experts (what random
    weights at one gain do: attention averages the tokens away). Every layer must spread its
    choices over the experts."""
    from cflow.runtime import Engine

    d = tmp_path
    # 8 layers: a bias common to every token grows with depth, so a shallow model would not show it
    mm.write_cflow(d / "m.cflow", TINY.replace(layers=8), "q4_0", seed=0, progress=False)
    with Engine.load(d / "m.cflow", threads=1, n_ctx=128) as eng:
        eng.reset_counters()
        eng.prefill([int(t) for t in np.random.default_rng(0).integers(0, 300, 64)])
        hits = np.array(eng.expert_hits())  # [layer, expert]
    share = hits / hits.sum(axis=1, keepdims=True)
    assert (hits > 0).all(), hits  # every expert of every layer is chosen by some token
    assert share.max() < 0.4, hits  # top-2 of 4: a uniform router gives 0.25 each


def test_tokenizer_is_a_consistent_byte_level_bpe(files):
    tokens, types, merges = mm.tokenizer_parts(300)
    assert len(tokens) == len(types) == 300 and len(set(tokens)) == 300
    assert types[:3] == [3, 3, 3] and set(types[3:]) == {1}
    assert len(merges) == 300 - 3 - 256
    vocab = set(tokens)
    for m in merges:
        a, b = m.split(" ")
        assert a in vocab and b in vocab and a + b in vocab
    big, _, big_merges = mm.tokenizer_parts(70_000)  # past the 65,536 byte pairs: pair + byte merges
    assert len(big) == 70_000 and len(set(big)) == 70_000 and len(big_merges[-1].split(" ")[0]) == 2
    d, _, _ = files
    r = gguf.GGUFReader(d / "m.gguf")
    assert field(r, "tokenizer.ggml.model") == "gpt2"
    assert list(field(r, "tokenizer.ggml.tokens")) == tokens
    assert list(field(r, "tokenizer.ggml.merges")) == merges


@pytest.mark.oracle
def test_llama_cpp_loads_and_evaluates_the_gguf(files):
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="the llama.cpp oracle is not installed: pip install 'llama-cpp-python>=0.3.16'")
    d, _, _ = files
    llm = llama_cpp.Llama(model_path=str(d / "m.gguf"), n_ctx=64, n_threads=1, verbose=False, logits_all=True)
    try:
        assert llm.n_vocab() == 300
        toks = llm.tokenize(b"the quick brown fox", add_bos=False)
        assert len(toks) >= 3
        llm.eval(toks)
        logits = np.asarray(llm.scores[:llm.n_tokens])
        assert logits.shape == (len(toks), 300)
        assert np.isfinite(logits).all() and logits.std() > 1e-3
    finally:
        llm.close()


def test_gguf_converts_and_matches_llama_cpp(files, tmp_path):
    """cflow's converter imports the GGUF, and (with llama-cpp-python) both engines agree on it."""
    from cflow.convert import convert
    from cflow.runtime import Engine

    d, _, _ = files
    convert(d / "m.gguf", tmp_path / "conv.cflow")
    f = open_model(tmp_path / "conv.cflow", verify=True)
    assert (f.config.n_experts, f.config.top_k, f.config.d_expert) == (4, 2, 384)
    toks = [3 + (7 * i) % 290 for i in range(12)]
    with Engine(f, threads=1, n_ctx=64) as eng:
        got = np.stack([np.array(eng.step(t, i)) for i, t in enumerate(toks)])
    assert np.isfinite(got).all()
    try:
        import llama_cpp
    except ImportError:
        return
    # the same random model in both engines: the generated GGUF means the same thing to each
    llm = llama_cpp.Llama(model_path=str(d / "m.gguf"), n_ctx=64, n_threads=1, verbose=False, logits_all=True)
    try:
        llm.eval(toks)
        ref = np.asarray(llm.scores[:len(toks)])
    finally:
        llm.close()
    assert np.abs(got - ref).max() < 0.15 * ref.std()
    assert np.corrcoef(got.ravel(), ref.ravel())[0, 1] > 0.999


# ---- the .cflow -------------------------------------------------------------------------------
def test_cflow_verifies_and_runs(files):
    from cflow.runtime import Engine

    d, _, c = files
    f = open_model(d / "m.cflow", verify=True)
    cfg = f.config
    assert (cfg.delta_dense, cfg.delta_expert, cfg.moe_input) == (1, 2, "post_attn")
    assert (cfg.n_layers, cfg.d_model, cfg.n_experts, cfg.top_k, cfg.d_expert, cfg.d_ff) == (3, 128, 4, 2, 384, 384)
    assert not cfg.tie_embeddings and cfg.vocab_size == len(f.tokenizer["vocab"]) == 300
    assert len(f.experts) == 3 * 4
    assert f.tensors["layers.0.attn.wqkv"].meta == {"fused": "qkv", "splits": [128, 64, 64]}
    assert f.tensors["layers.2.moe.experts.3.w_gate_up"].meta == {"fused": "gate_up", "group": 8,
                                                                  "splits": [384, 384]}
    assert f.tensors["layers.1.moe.router"].dtype == "f32"
    assert c.file_bytes == (d / "m.cflow").stat().st_size
    assert c.token_bytes == dag.analyze(cfg, "q4_0").total_bytes
    with Engine(f, threads=1, n_ctx=64) as eng:
        assert eng.weight_bytes_per_token() == c.token_bytes
        ids = eng.tokenizer.encode("the quick brown fox")
        logits = np.array(eng.eval(ids))
        assert np.isfinite(logits).all() and logits.std() > 1e-3
        out = eng.complete("the quick", max_tokens=6, temperature=0, ignore_eos=True)
        assert len(out.tokens) == 6


def _check_blocks(blocks: np.ndarray, q: str, cols: int, gain: float = mm.GAIN) -> None:
    B = quant.block_bytes(q)
    b = blocks.reshape(-1, B)
    d = b[:, 0:2].copy().view(np.uint16).ravel()
    lut, m_lut = mm.scale_tables(q, cols, gain)
    assert np.isin(d, lut).all()                       # every block's scale is one of the table's
    assert len(np.unique(d)) > min(100, d.size // 4)   # and they vary
    if q == "q4_1":
        m = b[:, 2:4].copy().view(np.uint16).ravel()
        where = {int(v): i for i, v in enumerate(lut)}
        np.testing.assert_array_equal(m, m_lut[[where[int(x)] for x in d]])
    w = quant.dequantize(blocks, q, cols)
    assert np.isfinite(w).all()
    assert w.std() == pytest.approx(gain / np.sqrt(cols), rel=0.1)


@pytest.mark.parametrize("q", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("rows,cols", [(256, 384), (300, 128), (20, 64)])
def test_random_tiled_is_valid_in_the_tile_layout(q, rows, cols):
    tiled = mm.random_tiled(mm.tensor_rng(1, "x"), q, rows, cols)
    assert tiled.dtype == np.uint8 and tiled.size == quant.tensor_nbytes(q, (rows, cols), "tiled")
    _check_blocks(quant.untile_matrix(tiled, q, rows, cols), q, cols)


def test_cflow_tensors_hold_valid_blocks(files):
    d, _, _ = files
    f = open_model(d / "m.cflow")
    for name in ("tok_emb", "lm_head", "layers.0.attn.wqkv", "layers.1.ffn.w_down",
                 "layers.2.moe.experts.1.w_gate_up", "layers.2.moe.experts.1.w_down"):
        e = f.tensors[name]
        _check_blocks(quant.untile_matrix(f.array(name), e.dtype, *e.shape, f.tile), e.dtype, e.shape[1],
                      mm.tensor_gain(name, e.shape[1]))
    np.testing.assert_array_equal(f.plain("layers.0.moe_norm"), np.ones(128, np.float32))


def test_vflow_name_writes_the_vflow_order(tmp_path):
    mm.write_cflow(tmp_path / "m.vflow", TINY, "q8_0", seed=0, progress=False)
    f = open_model(tmp_path / "m.vflow", verify=True)
    assert f.order == "vflow" and f.tensors["layers.0.attn.wo"].dtype == "q8_0"


# ---- reproducibility and streaming --------------------------------------------------------------
def test_same_seed_same_bytes_other_seed_other_bytes(files, tmp_path):
    d, _, _ = files
    mm.write_gguf(tmp_path / "a.gguf", TINY, "q4_0", seed=0, progress=False)
    mm.write_cflow(tmp_path / "a.cflow", TINY, "q4_0", seed=0, progress=False)
    assert sha(tmp_path / "a.gguf") == sha(d / "m.gguf")
    assert sha(tmp_path / "a.cflow") == sha(d / "m.cflow")
    mm.write_gguf(tmp_path / "b.gguf", TINY, "q4_0", seed=1, progress=False)
    assert sha(tmp_path / "b.gguf") != sha(d / "m.gguf")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left behind


def test_writers_hold_at_most_two_tensors(tmp_path):
    g = mm.Geometry(layers=4, d_model=256, experts=8, top_k=2, d_ff=512, heads=4, kv_heads=2, vocab=512, ctx=64)
    for write, name in ((mm.write_gguf, "s.gguf"), (mm.write_cflow, "s.cflow")):
        mm.LIVE.reset()
        before = mm.LIVE.now
        w = write(tmp_path / name, g, "q4_0", seed=0, progress=False)
        biggest = max(quant.row_bytes("q4_0", 256) * 2 * 512, quant.row_bytes("q4_0", 256) * 512)  # a w_gate_up
        assert mm.LIVE.buffers >= 4 * 8 * 2           # every expert made its own buffer
        assert mm.LIVE.peak - before <= 2 * biggest, name
        assert mm.LIVE.peak - before < w.file_bytes / 20, name
        assert mm.LIVE.now == before                  # nothing kept after the write


RSS_CHILD = textwrap.dedent("""
    import json, resource, sys
    from cflow.bench import synthetic as mm
    import tqdm, cflow.dag, cflow.fileformat  # imports before the baseline
    g = mm.Geometry(layers=6, d_model=512, experts=8, top_k=2, d_ff=1024, heads=8, kv_heads=4, vocab=1024, ctx=64)
    # warm-up on one layer: allocator pools and lazily imported modules count in the baseline
    mm.write_gguf(sys.argv[1] + "/w.gguf", g.replace(layers=1), "q4_0", 0, False)
    mm.write_cflow(sys.argv[1] + "/w.cflow", g.replace(layers=1), "q4_0", 0, False)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    a = mm.write_gguf(sys.argv[1] + "/r.gguf", g, "q4_0", 0, False)
    b = mm.write_cflow(sys.argv[1] + "/r.cflow", g, "q4_0", 0, False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"growth": peak - base, "base": base, "gguf": a.file_bytes, "cflow": b.file_bytes}))
""")


def test_resident_memory_stays_far_below_the_file_size(tmp_path):
    """~40 MB per file in a fresh process: peak RSS grows by a few tensors, not by a file."""
    out = subprocess.run([sys.executable, "-c", RSS_CHILD, str(tmp_path)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["gguf"] > 30e6 and r["cflow"] > 30e6
    assert r["growth"] < min(r["gguf"], r["cflow"]) / 4, r


# ---- sizes and the command line -----------------------------------------------------------------
def test_presets_have_the_issue_sizes():
    small = mm.Geometry(**{**mm.DEFAULTS, **mm.PRESETS["mixtral-small"]})
    big = mm.Geometry(**{**mm.DEFAULTS, **mm.PRESETS["mixtral-8x7b"]})
    assert 2.5e9 < mm.gguf_data_bytes(small, "q4_0") < 2.9e9
    assert 25e9 < mm.gguf_data_bytes(big, "q4_0") < 27e9
    fine = mm.Geometry(**{**mm.DEFAULTS, **mm.PRESETS["fine-small"]})
    assert 2.7e9 < mm.gguf_data_bytes(fine, "q4_0") < 3.1e9 and (fine.experts, fine.top_k) == (64, 8)
    assert mm.layers_for_size(small, "q4_0", mm.parse_size("2.8G")) == 17
    assert mm.layers_for_size(small, "q4_0", mm.parse_size("1G")) == 6
    assert mm.layers_for_size(small, "q4_0", 1) == 1
    assert mm.parse_size("2.8GB") == 2_800_000_000 and mm.parse_size("1GiB") == 1 << 30
    assert mm.parse_size("500M") == 500_000_000 and mm.parse_size("26e9") == 26_000_000_000
    with pytest.raises(mm.MakeMoeError):
        mm.parse_size("lots")


def test_cli_dry_run_json(capsys):
    assert cli.main(["--preset", "mixtral-8x7b", "--dry-run", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["geometry"]["layers"] == 32 and p["geometry"]["d_ff"] == 14336
    assert 25e9 < p["gguf"]["data_bytes"] < 27e9
    assert p["gguf"]["token_bytes"] == p["gguf"]["critical_bytes"]          # no delays: one chain
    assert p["cflow"]["critical_bytes"] < p["cflow"]["token_bytes"] / 2     # arch2_4: the chain shrinks
    assert p["cflow"]["config"]["delta_expert"] == 2


def test_cli_writes_both_files(tmp_path, capsys):
    args = ["--layers", "2", "--d-model", "64", "--heads", "2", "--kv-heads", "1", "--experts", "2", "--top-k", "1",
            "--d-ff", "64", "--vocab", "260", "--ctx", "64", "--quant", "q8_0", "--seed", "3", "--no-progress",
            "--gguf", str(tmp_path / "x.gguf"), "--cflow", str(tmp_path / "x.cflow")]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "x.gguf" in text and "x.cflow" in text and "a token reads" in text
    assert cli.main(args + ["--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert [w["kind"] for w in p["written"]] == ["gguf", "cflow"]
    assert all(w["file_bytes"] == Path(w["path"]).stat().st_size for w in p["written"])
    assert open_model(tmp_path / "x.cflow", verify=True).metadata["seed"] == 3


def test_residual_gain_scales_only_the_residual_writers(tmp_path):
    """--residual-gain sets the std of attn_output and the experts' down projections (what makes routing
    harder to predict across layers) and leaves every other tensor's bytes as they were."""
    g2 = TINY.replace(residual_gain=0.4)
    mm.write_gguf(tmp_path / "a.gguf", TINY, "q4_0", seed=0, progress=False)
    mm.write_gguf(tmp_path / "b.gguf", g2, "q4_0", seed=0, progress=False)
    a = {x.name: x for x in gguf.GGUFReader(tmp_path / "a.gguf").tensors}
    b = {x.name: x for x in gguf.GGUFReader(tmp_path / "b.gguf").tensors}
    writers = [n for n in a if "attn_output" in n or "ffn_down" in n]
    assert len(writers) == 2 * TINY.layers
    for name in a:
        same = np.array_equal(np.asarray(a[name].data), np.asarray(b[name].data))
        assert same == (name not in writers), name
    x = b["blk.1.ffn_down_exps.weight"]
    w = gguf.quants.dequantize(np.asarray(x.data), x.tensor_type)
    assert w.std() == pytest.approx(0.4 / np.sqrt(384), rel=0.1)
    with pytest.raises(mm.MakeMoeError, match="residual-gain"):
        TINY.replace(residual_gain=0.0)


@pytest.mark.parametrize("args,msg", [
    ([], "nothing to write"),
    (["--residual-gain", "-1", "--dry-run"], "residual-gain"),
    (["--d-model", "100", "--dry-run"], "divisible"),
    (["--d-ff", "100", "--dry-run"], "multiple of 32"),
    (["--top-k", "9", "--dry-run"], "top-k"),
    (["--vocab", "100", "--dry-run"], "vocab"),
    (["--size", "big", "--dry-run"], "size"),
])
def test_cli_errors_say_what_to_change(args, msg, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_help_teaches():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for word in ("--preset", "mixtral-small", "mixtral-8x7b", "--size", "--gguf", "--cflow", "--seed", "Example"):
        assert word in out.stdout


@pytest.mark.parametrize("arch,delays", [("arch4", (0, 2)), ("arch1", (0, 0))])
def test_cflow_arch_sets_the_delays_and_nothing_else(tmp_path, arch, delays):
    """Geometry.arch: the same tensors, bytes per token and (seeded) bytes; only the delays differ."""
    from cflow.runtime import Engine

    c = mm.write_cflow(tmp_path / "m.cflow", TINY.replace(arch=arch), "q4_0", seed=0, progress=False)
    base = mm.write_cflow(tmp_path / "b.cflow", TINY, "q4_0", seed=0, progress=False)
    f, fb = open_model(tmp_path / "m.cflow", verify=True), open_model(tmp_path / "b.cflow", verify=True)
    assert (f.config.delta_dense, f.config.delta_expert) == delays
    assert c.token_bytes == base.token_bytes and sorted(f.tensors) == sorted(fb.tensors)
    assert all(f.tensors[n].nbytes == fb.tensors[n].nbytes for n in f.tensors)
    with Engine(f, threads=1, n_ctx=32) as eng:
        assert np.isfinite(np.array(eng.eval(eng.tokenizer.encode("the fox")))).all()
    with pytest.raises(mm.MakeMoeError, match="arch"):
        TINY.replace(arch="arch9")
