"""GGUF (llama.cpp) Llama-family models -> `.cflow`.

Owns reading a GGUF file (through the `gguf` package's GGUFReader, memory-mapped): its
hyperparameters -> ModelConfig, its tokenizer -> the header dict of cflow.tokenizer, and its
tensors -> `Source`s that cflow.convert.encoder encodes.

Choices:
- Only `general.architecture == "llama"` (Llama, SmolLM, TinyLlama, Mistral-without-SWA ...);
  anything else is a named error listing what is supported, never a best-effort guess.
- Q4_0 / Q4_1 / Q8_0 tensors go into tiles bit for bit (cflow's formats are GGML's). Every other
  type (F16, F32, BF16, K-quants ...) is dequantized with `gguf.quants.dequantize` and quantized
  to --quant; the introduced error is measured and reported.
- convert_hf_to_gguf.py stores Q and K with the rows of each head permuted for ggml's
  adjacent-pair RoPE:  W_gguf = W.reshape(H, 2, hd/2, K).swapaxes(1, 2).reshape(W.shape)
  (H = n_heads for Q, n_kv_heads for K). We invert it so the runtime uses the "half" (NeoX / HF)
  convention everywhere. It moves whole rows, so it is lossless on blocks.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from cflow.config import ConfigError, ModelConfig
from cflow.convert.encoder import (ConversionResult, ConvertError, Encoder, Source, check_quant, encode_model,
                                   write_conversion)
from cflow.convert.hf_tokenizer import byte_level_spelling
from cflow.quant import TILE, row_bytes
from cflow.tokenizer import Tokenizer, TokenizerError, unicode_to_bytes
from cflow.weights import Weight

SUPPORTED_ARCHITECTURES = ("llama",)
_NATIVE = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


class GGUFError(ConvertError):
    """A GGUF file cannot be read or describes something cflow does not support."""


class UnsupportedArchitectureError(GGUFError):
    """The GGUF's general.architecture is not one cflow can run."""


# ---- reading ---------------------------------------------------------------------------------
class GGUFModel:
    """A GGUF file opened for conversion: metadata by key and tensors by name (memory-mapped)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"GGUF file {self.path} does not exist")
        try:
            from gguf import GGUFReader
        except ImportError:
            raise GGUFError("reading GGUF needs the `gguf` package: pip install gguf") from None
        try:
            self.reader = GGUFReader(str(self.path))
        except Exception as e:  # the reader raises ValueError/struct errors on bad files
            raise GGUFError(f"{self.path} is not a readable GGUF file: {e}") from None
        self.tensors = {t.name: t for t in self.reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def require(self, key: str) -> Any:
        v = self.get(key)
        if v is None:
            raise GGUFError(f"{self.path.name} lacks the metadata key {key!r}; the file is incomplete")
        return v

    @property
    def architecture(self) -> str:
        return self.require("general.architecture")

    def source(self, name: str) -> Source:
        """The tensor `name` as a Source: blocks when its type is native, values otherwise."""
        from gguf import GGMLQuantizationType

        t = self.tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.path.name} lacks the tensor {name!r}")
        # ggml lists dims innermost first: shape [cols, rows] for a matrix.
        dims = [int(x) for x in t.shape]
        cols, rows = dims[0], int(np.prod(dims[1:]))
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype.name in _NATIVE:
            dtype = _NATIVE[qtype.name]
            blocks = np.asarray(t.data).reshape(rows, row_bytes(dtype, cols))
            return Source(name, qtype.name, rows, cols, dtype, blocks=blocks)

        def values(t=t, qtype=qtype) -> np.ndarray:
            from gguf.quants import dequantize

            return dequantize(np.asarray(t.data), qtype).astype(np.float32).reshape(rows, cols)

        return Source(name, qtype.name, rows, cols, values=values)

    def vector(self, name: str) -> np.ndarray:
        s = self.source(name)
        return s.floats().reshape(-1)


# ---- hyperparameters -------------------------------------------------------------------------
def gguf_config(g: GGUFModel) -> ModelConfig:
    """ModelConfig of a llama-architecture GGUF (SmolLM2-135M: 30 layers, d=576, heads 9/3)."""
    arch = g.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{g.path.name} is a {arch!r} model; cflow converts GGUF architectures "
            f"{list(SUPPORTED_ARCHITECTURES)} (Llama family: Llama 2/3, SmolLM, TinyLlama, ...)")
    p = f"{arch}."
    if (g.get(p + "expert_count") or 0) > 0:
        raise GGUFError(f"{g.path.name} is a mixture-of-experts Llama (Mixtral-style); cflow's GGUF "
                        "converter supports dense Llama models only")
    scaling = g.get(p + "rope.scaling.type")
    if (scaling not in (None, "none")) or "rope_freqs.weight" in g.tensors:
        raise GGUFError(f"{g.path.name} uses RoPE scaling ({scaling or 'rope_freqs'}); cflow implements "
                        "plain RoPE only")
    d = int(g.require(p + "embedding_length"))
    n_heads = int(g.require(p + "attention.head_count"))
    n_kv = int(g.get(p + "attention.head_count_kv") or n_heads)
    head_dim = int(g.get(p + "attention.key_length") or (d // n_heads))
    rot = int(g.get(p + "rope.dimension_count") or head_dim)
    if rot != head_dim:
        raise GGUFError(f"{g.path.name} rotates {rot} of {head_dim} head dims (partial RoPE); "
                        "cflow rotates whole heads")
    if int(g.get(p + "attention.value_length") or head_dim) != head_dim:
        raise GGUFError(f"{g.path.name} has value heads of a different size than key heads; unsupported")
    emb = g.tensors.get("token_embd.weight")
    if emb is None:
        raise GGUFError(f"{g.path.name} lacks token_embd.weight")
    vocab = int(emb.shape[1])
    declared = g.get(p + "vocab_size")
    if declared is not None and int(declared) != vocab:
        raise GGUFError(f"{g.path.name}: {p}vocab_size says {declared} but token_embd has {vocab} rows")
    try:
        return ModelConfig(
            vocab_size=vocab, d_model=d, n_layers=int(g.require(p + "block_count")),
            n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
            d_ff=int(g.require(p + "feed_forward_length")),
            rope_theta=float(g.get(p + "rope.freq_base") or 10000.0),
            norm_eps=float(g.get(p + "attention.layer_norm_rms_epsilon") or 1e-5),
            max_seq_len=int(g.get(p + "context_length") or 2048),
            tie_embeddings="output.weight" not in g.tensors, name="llama")
    except ConfigError as e:
        raise GGUFError(f"{g.path.name}: its hyperparameters do not form a valid model: {e}") from None


# ---- tokenizer -------------------------------------------------------------------------------
def gguf_tokenizer(g: GGUFModel) -> dict[str, Any]:
    """The tokenizer header dict (docs/DESIGN.md) from the file's tokenizer.ggml.* keys."""
    model = g.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise TokenizerError(f"{g.path.name} has a {model!r} tokenizer; cflow supports byte-level BPE "
                             "('gpt2' in GGUF terms) only")
    tokens = list(g.require("tokenizer.ggml.tokens"))
    types = list(g.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = list(g.get("tokenizer.ggml.merges") or [])
    if not merges:
        raise TokenizerError(f"{g.path.name} has a byte-level vocabulary but no merges; cannot rebuild BPE")
    alphabet = unicode_to_bytes()
    vocab, special, added = [], {}, {}
    for i, (tok, ty) in enumerate(zip(tokens, types)):
        if ty == _CONTROL and all(c in alphabet for c in tok):
            special[tok] = i
            vocab.append(tok)
        elif ty == _USER_DEFINED:
            added[tok] = i  # matched whole in the text, decoded as its text (as llama.cpp does)
            vocab.append(tok)
        else:
            # A "control" token spelled outside the byte alphabet is a llama.cpp mislabel; keep it
            # as an ordinary token, like transformers does.
            vocab.append(byte_level_spelling(tok))

    def token_id(key: str) -> int | None:
        v = g.get(key)
        return int(v) if v is not None and 0 <= int(v) < len(vocab) else None

    header = {"model": "bpe", "vocab": vocab, "merges": merges,
              "bos_id": token_id("tokenizer.ggml.bos_token_id"),
              "eos_id": token_id("tokenizer.ggml.eos_token_id"),
              "add_bos": bool(g.get("tokenizer.ggml.add_bos_token") or False),
              "chat_template": g.get("tokenizer.chat_template"),
              "special": special, "pre": g.get("tokenizer.ggml.pre")}
    if added:
        header["added"] = added
    return header


# ---- Q/K row permutation ---------------------------------------------------------------------
def permute_qk_index(rows: int, n_heads: int) -> np.ndarray:
    """Row index that turns HF-order Q/K rows into GGUF order (llama.cpp's `permute`):
    gguf = hf[index]."""
    hd = _head_dim(rows, n_heads)
    return np.arange(rows).reshape(n_heads, 2, hd // 2).swapaxes(1, 2).reshape(-1)


def unpermute_qk_index(rows: int, n_heads: int) -> np.ndarray:
    """Row index that undoes the GGUF permutation: hf = gguf[index]."""
    hd = _head_dim(rows, n_heads)
    return np.arange(rows).reshape(n_heads, hd // 2, 2).swapaxes(1, 2).reshape(-1)


def _head_dim(rows: int, n_heads: int) -> int:
    if n_heads <= 0 or rows % n_heads or (rows // n_heads) % 2:
        raise GGUFError(f"cannot split {rows} Q/K rows into {n_heads} heads of even size")
    return rows // n_heads


# ---- conversion ------------------------------------------------------------------------------
# GGUF names of the parts of each tensor of the table (cflow.weights), per layer slot.
_GGUF_PARTS = {"attn_norm": ("attn_norm",), "attn.wqkv": ("attn_q", "attn_k", "attn_v"),
               "attn.wo": ("attn_output",), "ffn_norm": ("ffn_norm",), "ffn.w_gate_up": ("ffn_gate", "ffn_up"),
               "ffn.w_down": ("ffn_down",)}
_GGUF_GLOBAL = {"tok_emb": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}


def gguf_tensors(g: GGUFModel, cfg: ModelConfig, enc: Encoder) -> Iterator[Any]:
    """TensorData in .cflow order: embeddings, then layer by layer, then the final norm/lm_head."""
    _check_tensor_names(g, cfg)

    def parts(w: Weight) -> Any:
        if w.set is None:
            name = _GGUF_GLOBAL[w.name]
            return g.vector(name) if w.plain else [g.source(name)]
        names = [f"blk.{w.set}.{n}.weight" for n in _GGUF_PARTS[w.slot]]
        if w.plain:
            return g.vector(names[0])
        srcs = [g.source(n) for n in names]
        if w.fused == "qkv":  # llama.cpp stores Q and K rows permuted for its RoPE: undo it
            q, k, v = srcs
            _check_rows(q, cfg.q_dim)
            _check_rows(k, cfg.kv_dim)
            srcs = [q.take_rows(unpermute_qk_index(q.rows, cfg.n_heads)),
                    k.take_rows(unpermute_qk_index(k.rows, cfg.n_kv_heads)), v]
        return srcs

    return encode_model(cfg, enc, parts)


_PER_LAYER = tuple(n for names in _GGUF_PARTS.values() for n in names)
# Present in some llama GGUFs and safe to drop: precomputed RoPE tables the runtime recomputes.
_IGNORED_SUFFIXES = ("attn_rot_embd",)


def _check_tensor_names(g: GGUFModel, cfg: ModelConfig) -> None:
    expected = {"token_embd.weight", "output_norm.weight"}
    if not cfg.tie_embeddings:
        expected.add("output.weight")
    for i in range(cfg.n_layers):
        expected |= {f"blk.{i}.{n}.weight" for n in _PER_LAYER}
    missing = sorted(expected - set(g.tensors))
    extra = sorted(n for n in set(g.tensors) - expected if not any(s in n for s in _IGNORED_SUFFIXES))
    if missing:
        raise GGUFError(f"{g.path.name} lacks tensors {missing[:6]}{' ...' if len(missing) > 6 else ''}; "
                        "is it a complete llama model?")
    if extra:
        raise GGUFError(f"{g.path.name} has tensors cflow does not know how to use: {extra[:6]}; "
                        "converting would silently drop them")


def _check_rows(s: Source, rows: int) -> None:
    if s.rows != rows:
        raise GGUFError(f"{s.origin} has {s.rows} rows, the config implies {rows}")


def convert_gguf(src: str | os.PathLike, dst: str | os.PathLike, *, quant: str = "q4_0",
                 tile: tuple[int, int] = TILE, order: str = "cflow", progress=None) -> ConversionResult:
    """Convert a llama GGUF file into a .cflow/.vflow file.

    `quant` applies only to tensors that are not already Q4_0/Q4_1/Q8_0 (those stay bit-exact).
    `progress`, if given, is passed to the writer (see cflow.fileformat.write_model).
    """
    t0 = time.perf_counter()
    check_quant(quant)
    g = GGUFModel(src)
    cfg = gguf_config(g)
    tok = gguf_tokenizer(g)
    Tokenizer(tok)  # fail now, not at load time, on a tokenizer the runtime cannot rebuild
    if len(tok["vocab"]) != cfg.vocab_size:
        raise GGUFError(f"{g.path.name}: the tokenizer has {len(tok['vocab'])} tokens but the "
                        f"embedding has {cfg.vocab_size} rows")
    enc = Encoder(quant, tile)
    metadata = {"source": {"format": "gguf", "file": g.path.name,
                           "name": g.get("general.name"), "file_type": g.get("general.file_type")},
                "converter": "cflow.convert.gguf"}
    return write_conversion(src, dst, cfg, tok, gguf_tensors(g, cfg, enc), enc, metadata, order=order, tile=tile,
                            progress=progress, started=t0)


__all__ = ["GGUFModel", "GGUFError", "UnsupportedArchitectureError", "SUPPORTED_ARCHITECTURES",
           "gguf_config", "gguf_tokenizer", "gguf_tensors", "permute_qk_index", "unpermute_qk_index",
           "convert_gguf"]
