"""Random-weight models at chosen sizes, for benchmarks and the claims report: mixture-of-experts
models in two forms, and dense Llama GGUFs.

One MoE geometry (`Geometry`, `PRESETS`) is written as

  write_gguf(OUT.gguf, g)    a Mixtral-layout GGUF that llama.cpp runs: general.architecture = llama with
                             llama.expert_count / llama.expert_used_count, per layer attn_norm, attn_q/k/v,
                             attn_output, ffn_norm, ffn_gate_inp (F32 [E, d]) and the 3-D ffn_gate_exps /
                             ffn_up_exps / ffn_down_exps (GGUF ne = [d, d_ff, E] and [d_ff, d, E]), then
                             token_embd, output_norm, output, and a small byte-level BPE tokenizer.
  write_cflow(OUT.cflow, g)  a pipeline-native cflow model in the arch2_4_combined style (delta_dense = 1,
                             delta_expert = 2: expert outputs enter the residual two layers later), with the
                             same attention and experts plus the dense FFN the delays need (`dense_ff`,
                             default d_ff; at the presets that makes the .cflow ~12% larger than the GGUF and
                             a token read ~1.4x the bytes, over a critical path half as long). A name ending
                             in .vflow writes the .vflow data order.

`write_dense_gguf` writes a dense Llama GGUF (TINYLLAMA: TinyLlama-1.1B's geometry, the ~1B model of
the benchmarks) with the same random blocks and tokenizer.

Weights are random but valid: quantized blocks are random bytes whose fp16 scales are set so that
every matrix's weights have standard deviation ~0.5/sqrt(inputs) (so each layer's outputs stay of
order one and logits are finite), norms are 1.0, routers small random F32 (routing varies by token). Every tensor
(every expert of a 3-D GGUF tensor) has its own RNG seeded from the seed and its name, so a file is
reproducible bit for bit. Files stream to disk one tensor (one expert) at a time: a 26 GB
model is written on a machine with far less memory. The command lines over this module are
benchmarks/make_moe.py and benchmarks/make_dense.py.

Bytes a token reads are analytic: cflow.dag.analyze(config, quant).total_bytes, for the .cflow's
config and, with the same formula, for the GGUF's (a Llama+MoE config: no dense FFN, no delays).

No claim judges a random model's text: random weights test mechanisms (bytes, time, caches, parity).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import tempfile
import time
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from cflow import dag, quant, weights
from cflow.config import ARCHITECTURES, ModelConfig
from cflow.fileformat import TensorData, write_model
from cflow.quant import row_bytes
from cflow.tokenizer import bytes_to_unicode

QUANTS = ("q4_0", "q4_1", "q8_0")
CFLOW_ARCHES = ("arch2_4_combined", "arch4", "arch1")  # the delays a .cflow may have (Geometry.arch)
GAIN = 0.5  # weight std = GAIN / sqrt(inputs): a unit-RMS input gives outputs of RMS ~GAIN
# Why some tensors differ. With every matrix at GAIN, random attention returns about the running
# mean of V and the residual soon forgets the token: every token then routes to the same experts,
# and an expert cache of any size hits ~100% (measured: 64/64 tokens on the same 2 experts). So
# embeddings get elements of std 1 (a unit-RMS row, like trained models) and the projections that
# write into the residual (wo, the FFN and expert down) a small gain, so each token's own
# embedding stays visible and routing varies by token and layer, as in a trained model.
EMBED_STD = 1.0
RESIDUAL_WRITE_GAIN = 0.05


def tensor_gain(name: str, cols: int, residual_gain: float = RESIDUAL_WRITE_GAIN) -> float:
    """The GAIN of one tensor (GGUF or .cflow name): weight std = gain / sqrt(cols)."""
    if name in ("token_embd.weight", "tok_emb"):
        return EMBED_STD * math.sqrt(cols)
    if any(k in name for k in ("attn_output", "attn.wo", "ffn_down", "w_down")):
        return residual_gain
    return GAIN
# std of the integer part of a random block: Q4 nibbles (q - 8, or q - 7.5 for Q4_1) and Q8 int8
_Q_STD = {"q4_0": math.sqrt((16 ** 2 - 1) / 12), "q4_1": math.sqrt((16 ** 2 - 1) / 12),
          "q8_0": math.sqrt((256 ** 2 - 1) / 12)}
GGUF_ALIGN = 32  # gguf's default data alignment

PRESETS: dict[str, dict[str, int]] = {
    # Mixtral's shape at half the width and half the depth: 2.66 GB GGUF in Q4_0
    "mixtral-small": dict(layers=16, d_model=2048, experts=8, top_k=2, d_ff=5632, heads=32, kv_heads=8,
                          vocab=32000),
    # Mixtral-8x7B itself: 26.3 GB GGUF in Q4_0
    "mixtral-8x7b": dict(layers=32, d_model=4096, experts=8, top_k=2, d_ff=14336, heads=32, kv_heads=8,
                         vocab=32000),
    # Many small experts, as Qwen3-MoE / OLMoE route (top-8 of 64, d_ff 768) at mixtral-small's width
    # and depth: 2.9 GB GGUF in Q4_0; one expert is 2.7 MB (mixtral-small's: 19.5 MB), so a read
    # takes a few layers' compute instead of a token's
    "fine-small": dict(layers=16, d_model=2048, experts=64, top_k=8, d_ff=768, heads=32, kv_heads=4,
                       vocab=32000),
}
DEFAULTS = dict(PRESETS["mixtral-small"], dense_ff=0, ctx=4096, rope_theta=1e6, norm_eps=1e-5)

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2; 0 is BOS and EOS
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class MakeMoeError(ValueError):
    """A geometry or argument the generator cannot honour (says what to change)."""


# ---- geometry ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Geometry:
    layers: int
    d_model: int
    experts: int
    top_k: int
    d_ff: int            # each expert's SwiGLU hidden size (GGUF feed_forward_length)
    heads: int
    kv_heads: int
    vocab: int
    dense_ff: int = 0    # the .cflow's dense FFN hidden size; 0: d_ff
    ctx: int = 4096
    # How much each layer writes into the residual (RESIDUAL_WRITE_GAIN). Small: the residual, and so
    # the routing, changes little from layer to layer, and a later layer's router applied to an
    # earlier layer's input predicts its experts almost always (expert speculation); larger values
    # make routing less predictable across layers, as it may be in trained models.
    residual_gain: float = RESIDUAL_WRITE_GAIN
    rope_theta: float = 1e6
    norm_eps: float = 1e-5
    # The .cflow's delays (cflow.config.ARCHITECTURES): arch2_4_combined (dense FFN on x_l, experts
    # land two layers later), arch4 (experts two layers later), arch1 (no delays). Same weights,
    # same bytes per token: only where outputs land, and so how long a read's window is, changes.
    arch: str = "arch2_4_combined"

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise MakeMoeError(msg)

        need(self.arch in CFLOW_ARCHES, f"arch {self.arch!r} is not one of {', '.join(CFLOW_ARCHES)}")
        for f in ("layers", "d_model", "experts", "top_k", "d_ff", "heads", "kv_heads", "vocab", "ctx"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) > 0, f"{f} must be a positive integer")
        need(isinstance(self.dense_ff, int) and self.dense_ff >= 0, "dense-ff must be 0 (= d-ff) or positive")
        need(0 < self.residual_gain <= 2, f"residual-gain {self.residual_gain} must be in (0, 2]")
        need(self.top_k <= self.experts, f"top-k {self.top_k} must be at most the number of experts {self.experts}")
        need(self.d_model % self.heads == 0, f"d-model {self.d_model} must be divisible by heads {self.heads}")
        need(self.heads % self.kv_heads == 0, f"heads {self.heads} must be divisible by kv-heads {self.kv_heads}")
        need(self.head_dim % 2 == 0, f"head dim {self.head_dim} (d-model / heads) must be even for RoPE")
        for f in ("d_model", "d_ff", "dense"):
            v = self.dense if f == "dense" else getattr(self, f)
            need(v % quant.QK == 0, f"{f.replace('_', '-')} {v} must be a multiple of {quant.QK} (the quant block)")
        need(self.vocab >= len(SPECIALS) + 256,
             f"vocab {self.vocab} must hold the {len(SPECIALS)} specials and 256 byte tokens (>= {len(SPECIALS) + 256})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def dense(self) -> int:
        return self.dense_ff or self.d_ff

    def replace(self, **kw: Any) -> "Geometry":
        return dataclasses.replace(self, **kw)

    def cflow_config(self) -> ModelConfig:
        """The .cflow's model: a dense FFN and the experts, with `arch`'s delays (by default
        arch2_4_combined: the dense FFN reads x_l, experts land 2 layers later)."""
        return ModelConfig(vocab_size=self.vocab, d_model=self.d_model, n_layers=self.layers, n_heads=self.heads,
                           n_kv_heads=self.kv_heads, d_ff=self.dense, n_experts=self.experts, top_k=self.top_k,
                           d_expert=self.d_ff, **ARCHITECTURES[self.arch],
                           rope_theta=self.rope_theta, norm_eps=self.norm_eps, max_seq_len=self.ctx,
                           tie_embeddings=False, name=self.arch)

    def gguf_config(self) -> ModelConfig:
        """The GGUF's model in cflow's terms: Llama attention + MoE (Mixtral), no dense FFN, no delays."""
        return ModelConfig(vocab_size=self.vocab, d_model=self.d_model, n_layers=self.layers, n_heads=self.heads,
                           n_kv_heads=self.kv_heads, d_ff=0, n_experts=self.experts, top_k=self.top_k,
                           d_expert=self.d_ff, delta_dense=0, delta_expert=0, moe_input="post_dense",
                           rope_theta=self.rope_theta, norm_eps=self.norm_eps, max_seq_len=self.ctx,
                           tie_embeddings=False, name="mixtral")


# ---- the GGUF's tensors --------------------------------------------------------------------------
@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]   # numpy order ([E, rows, cols] for experts); GGUF stores it reversed
    kind: str                # "norm" | "router" | "matrix" | "experts"

    @property
    def cols(self) -> int:
        return self.shape[-1]

    @property
    def rows(self) -> int:
        return self.shape[-2] if len(self.shape) >= 2 else 1

    def nbytes(self, q: str) -> int:
        if self.kind in ("norm", "router"):
            return 4 * math.prod(self.shape)
        return math.prod(self.shape[:-1]) * quant.row_bytes(q, self.cols)


def gguf_tensors(g: Geometry) -> list[GgufTensor]:
    d, kv, E, F = g.d_model, g.kv_heads * g.head_dim, g.experts, g.d_ff
    out = [GgufTensor("token_embd.weight", (g.vocab, d), "matrix")]
    for i in range(g.layers):
        b = f"blk.{i}."
        out += [GgufTensor(b + "attn_norm.weight", (d,), "norm"),
                GgufTensor(b + "attn_q.weight", (d, d), "matrix"),
                GgufTensor(b + "attn_k.weight", (kv, d), "matrix"),
                GgufTensor(b + "attn_v.weight", (kv, d), "matrix"),
                GgufTensor(b + "attn_output.weight", (d, d), "matrix"),
                GgufTensor(b + "ffn_norm.weight", (d,), "norm"),
                GgufTensor(b + "ffn_gate_inp.weight", (E, d), "router"),
                GgufTensor(b + "ffn_gate_exps.weight", (E, F, d), "experts"),
                GgufTensor(b + "ffn_down_exps.weight", (E, d, F), "experts"),
                GgufTensor(b + "ffn_up_exps.weight", (E, F, d), "experts")]
    out += [GgufTensor("output_norm.weight", (d,), "norm"), GgufTensor("output.weight", (g.vocab, d), "matrix")]
    return out


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def gguf_data_bytes(g: Geometry, q: str) -> int:
    """The GGUF's tensor data (each tensor padded to 32 bytes); the file adds a ~1 MB header."""
    return sum(_align(t.nbytes(q), GGUF_ALIGN) for t in gguf_tensors(g))


def cflow_data_bytes(g: Geometry, q: str) -> int:
    """The .cflow's tensor data (each tensor padded to 4096 bytes); the file adds its JSON header."""
    cfg = g.cflow_config()
    return sum(_align(quant.tensor_nbytes("f32" if w.plain else q, w.shape), 4096)
               for w in weights.model_weights(cfg))


def layers_for_size(g: Geometry, q: str, target: int) -> int:
    """The layer count whose GGUF comes closest to `target` bytes (at least 1)."""
    one, two = gguf_data_bytes(g.replace(layers=1), q), gguf_data_bytes(g.replace(layers=2), q)
    per_layer, fixed = two - one, 2 * one - two
    return max(1, round((target - fixed) / per_layer))


def parse_size(text: str) -> int:
    """'2.8G', '2.8GB', '500M', '26e9' -> bytes (decimal units, as cflow prints sizes; 'GiB' binary)."""
    s = text.strip()
    units = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12,
             "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}
    body = s.upper().removesuffix("B")
    for u in sorted(units, key=len, reverse=True):
        if u and body.endswith(u):
            body, mult = body[:-len(u)], units[u]
            break
    else:
        mult = 1
    try:
        v = float(body)
    except ValueError:
        raise MakeMoeError(f"size {text!r} is not a number with an optional unit (K, M, G, T; KiB...), "
                           "e.g. 2.8G") from None
    if not v > 0:
        raise MakeMoeError(f"size {text!r} must be positive")
    return int(v * mult)


# ---- random weights ---------------------------------------------------------------------------
class LiveBytes:
    """Bytes of generated weight buffers alive right now, and the most ever alive at once: how a
    test proves the writers stream (hold a tensor or two, never the model)."""

    def __init__(self) -> None:
        self.now = self.peak = self.buffers = 0

    def track(self, arr: np.ndarray) -> np.ndarray:
        n = int(arr.nbytes)
        self.now += n
        self.peak = max(self.peak, self.now)
        self.buffers += 1
        weakref.finalize(arr, self._free, n)
        return arr

    def _free(self, n: int) -> None:
        self.now -= n

    def reset(self) -> None:
        self.peak = self.now
        self.buffers = 0


LIVE = LiveBytes()


def tensor_rng(seed: int, name: str, *more: int) -> np.random.Generator:
    """The RNG of one tensor (or one expert of a 3-D tensor): independent of the writing order."""
    return np.random.Generator(np.random.SFC64(np.random.SeedSequence([seed, zlib.crc32(name.encode()), *more])))


def scale_tables(q: str, cols: int, gain: float = GAIN) -> tuple[np.ndarray, np.ndarray | None]:
    """256 fp16 scales (as uint16) spread +-25% around the one giving weight std gain/sqrt(cols), half
    of them negative;
    and for Q4_1 the matching mins (-7.5 d, so the weights are centred)."""
    base = gain / math.sqrt(cols) / _Q_STD[q]
    # Half the scales negative: random Q4_0 nibbles (q - 8) and Q8_0 bytes average -0.5, so with
    # positive scales every row would share a bias (-0.5 d sum(x)); over layers those biases add
    # into one vector common to every token, and the routers stop telling tokens apart.
    d = (base * np.linspace(0.75, 1.25, 256) * np.where(np.arange(256) % 2, -1.0, 1.0)).astype(np.float16)
    m = (-7.5 * d.astype(np.float32)).astype(np.float16).view(np.uint16) if q == "q4_1" else None
    return d.view(np.uint16), m


def _random_bytes(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    words = LIVE.track(rng.integers(0, 2 ** 64 - 1, size=(nbytes + 7) // 8, dtype=np.uint64, endpoint=True))
    return words.view(np.uint8)[:nbytes]


def _set_scales(u16: np.ndarray, q: str, cols: int, width: int, gain: float = GAIN) -> None:
    """Overwrite the scale fields of random blocks: u16 rows are blocks (width 1) or 8-row tile
    chunks (width 8), their first `width` uint16 the d's, then (Q4_1) `width` m's."""
    d_lut, m_lut = scale_tables(q, cols, gain)
    idx = u16[:, :width] & 0xFF  # the random scale bits pick a table entry
    u16[:, :width] = d_lut[idx]
    if m_lut is not None:
        u16[:, width:2 * width] = m_lut[idx]


def random_rows(rng: np.random.Generator, q: str, rows: int, cols: int, gain: float = GAIN) -> np.ndarray:
    """Random GGML blocks [rows, row_bytes] (GGUF row order)."""
    rb = quant.row_bytes(q, cols)
    data = _random_bytes(rng, rows * rb)
    B = quant.block_bytes(q)
    _set_scales(data.view(np.uint16).reshape(-1, B // 2), q, cols, 1, gain)
    return data.reshape(rows, rb)


def random_tiled(rng: np.random.Generator, q: str, rows: int, cols: int,
                 tile: tuple[int, int] = quant.TILE, gain: float = GAIN) -> np.ndarray:
    """Random weights in cflow's tile layout (flat uint8). When every row group is full (rows a
    multiple of 8) the layout is a run of 8-row chunks, each `8 x block` bytes with the 8 scales
    first (docs/DESIGN.md "Tile layout"): random bytes with those scales set are a random tiled
    matrix, made at memory speed. Otherwise the blocks are made in row order and tiled."""
    if rows % quant.G:
        blocks = random_rows(rng, q, rows, cols, gain)
        return LIVE.track(quant.tile_matrix(blocks, q, rows, cols, tile))
    data = _random_bytes(rng, rows * quant.row_bytes(q, cols))
    chunk = quant.G * quant.block_bytes(q)
    _set_scales(data.view(np.uint16).reshape(-1, chunk // 2), q, cols, quant.G, gain)
    return data


def router_values(rng: np.random.Generator, experts: int, d: int) -> np.ndarray:
    """F32 router [E, d]: logits of std ~1 for a unit-RMS input, so routing varies by token."""
    return (rng.standard_normal((experts, d), dtype=np.float32) / np.float32(math.sqrt(d)))


# ---- the tokenizer --------------------------------------------------------------------------
def tokenizer_parts(vocab: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, GGUF token types, merges) of a byte-level BPE vocabulary of exactly `vocab` tokens:
    3 specials, the 256 byte tokens, then merges of byte pairs (common characters first), then of
    pair + byte, as many as the size needs. Every merge's result is in the vocabulary."""
    b2u = bytes_to_unicode()
    common = [ord(c) for c in " etaoinshrdlucmfwypvbgkjqxz"] + list(range(ord("A"), ord("Z") + 1)) + \
        list(range(ord("0"), ord("9") + 1))
    order = [b2u[b] for b in dict.fromkeys(common + list(range(256)))]
    tokens = list(SPECIALS) + [b2u[b] for b in range(256)]
    types = [3] * len(SPECIALS) + [1] * 256
    need = vocab - len(tokens)
    merges: list[str] = []

    def pairs() -> Iterator[tuple[str, str]]:
        for k in range(256):
            yield from _diag(order, k)
        for left in (a + b for k in range(256) for a, b in _diag(order, k)):
            for c in order:
                yield left, c

    if need > 0:
        for a, b in pairs():
            merges.append(f"{a} {b}")
            tokens.append(a + b)
            types.append(1)
            if len(merges) == need:
                break
    if len(tokens) != vocab:
        raise MakeMoeError(f"cannot build a vocabulary of {vocab} tokens")
    return tokens, types, merges


def _diag(order: list[str], k: int) -> Iterator[tuple[str, str]]:
    """The pairs whose rarer character is order[k] (so common characters merge first)."""
    for j in range(k):
        yield order[k], order[j]
        yield order[j], order[k]
    yield order[k], order[k]


def start_gguf(tmp: str | os.PathLike, arch: str, name: str, *, layers: int, ctx: int, d_model: int,
               d_ff: int | list[int], heads: int, kv_heads: int, rope_theta: float, eps: float, file_type: Any,
               key_length: int | None = None, value_length: int | None = None,
               rope_dims: int | None = None) -> Any:
    """A GGUFWriter on `tmp` holding the header every random-weight family file shares (name, block
    count, context, widths (`d_ff` per layer where a list), heads, RoPE base, RMS eps, file type;
    key/value length and rotated dims where given). `file_type`: a weight type name ("q4_0", "q4_1",
    "q8_0", "f16") or a gguf.LlamaFileType. The caller adds its family's keys, the tokenizer and the tensors."""
    import gguf

    if isinstance(file_type, str):
        file_type = {"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "f16": gguf.LlamaFileType.MOSTLY_F16}[file_type]
    wr = gguf.GGUFWriter(str(tmp), arch)
    wr.add_name(name)
    wr.add_block_count(layers)
    wr.add_context_length(ctx)
    wr.add_embedding_length(d_model)
    wr.add_feed_forward_length(d_ff)
    wr.add_head_count(heads)
    wr.add_head_count_kv(kv_heads)
    if key_length is not None:
        wr.add_key_length(key_length)
    if value_length is not None:
        wr.add_value_length(value_length)
    if rope_dims is not None:
        wr.add_rope_dimension_count(rope_dims)
    wr.add_rope_freq_base(rope_theta)
    wr.add_layer_norm_rms_eps(eps)
    wr.add_file_type(int(file_type))
    wr.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return wr


def add_tokenizer(wr: Any, vocab: int) -> None:
    """Write the byte-level BPE tokenizer of `tokenizer_parts(vocab)` into a GGUFWriter's metadata."""
    tokens, types, merges = tokenizer_parts(vocab)
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("gpt-2")
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_merges(merges)
    wr.add_bos_token_id(0)
    wr.add_eos_token_id(0)
    wr.add_add_bos_token(False)


def cflow_tokenizer(vocab: int) -> dict[str, Any]:
    tokens, _, merges = tokenizer_parts(vocab)
    return {"model": "bpe", "vocab": tokens, "merges": merges, "bos_id": 0, "eos_id": 0, "add_bos": False,
            "chat_template": CHAT_TEMPLATE, "special": {t: i for i, t in enumerate(SPECIALS)}, "pre": "gpt-2"}


# ---- writers ------------------------------------------------------------------------------------
@dataclass
class Written:
    path: str
    kind: str               # "gguf" | "cflow"
    file_bytes: int
    seconds: float
    config: dict[str, Any]  # cflow ModelConfig (for the GGUF: its Llama+MoE equivalent)
    token_bytes: int        # analytic bytes a token reads (cflow.dag)
    critical_bytes: int     # bytes on the decode step's critical path (cflow.dag)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000, dynamic_ncols=True,
                leave=True, file=sys.stderr)


def _analysis(cfg: ModelConfig, q: str) -> tuple[int, int]:
    r = dag.analyze(cfg, q)
    return int(r.total_bytes), int(r.critical_bytes)


def write_gguf(path: str | os.PathLike, g: Geometry, q: str = "q4_0", seed: int = 0,
               progress: bool = True) -> Written:
    """Write the Mixtral-layout GGUF, streaming: tensor infos first, then the data one tensor (one
    expert of a 3-D tensor) at a time, into a temp file renamed over `path` when complete."""
    import gguf

    if q not in QUANTS:
        raise MakeMoeError(f"quant {q!r}: choose one of {list(QUANTS)}")
    t0 = time.perf_counter()
    T = gguf.GGMLQuantizationType
    qtype = {"q4_0": T.Q4_0, "q4_1": T.Q4_1, "q8_0": T.Q8_0}[q]
    ftype = {"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[q]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; give the file normal permissions
    os.close(fd)
    tensors = gguf_tensors(g)
    try:
        wr = start_gguf(tmp, "llama", f"random MoE {g.layers}L d{g.d_model} {g.experts}x{g.d_ff} top{g.top_k} {q}",
                        layers=g.layers, ctx=g.ctx, d_model=g.d_model, d_ff=g.d_ff, heads=g.heads,
                        kv_heads=g.kv_heads, rope_theta=g.rope_theta, eps=g.norm_eps, file_type=ftype,
                        rope_dims=g.head_dim)
        wr.add_description(f"random weights from cflow.bench.synthetic, seed {seed}")
        wr.add_expert_count(g.experts)
        wr.add_expert_used_count(g.top_k)
        wr.add_vocab_size(g.vocab)
        add_tokenizer(wr, g.vocab)
        wr.add_chat_template(CHAT_TEMPLATE)
        for t in tensors:
            if t.kind in ("norm", "router"):
                wr.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes(q))
            else:
                wr.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes(q), raw_dtype=qtype)
        wr.write_header_to_file()
        wr.write_kv_data_to_file()
        wr.write_ti_data_to_file()
        f = wr.fout[0]
        wr.write_padding(f, f.tell())  # the data section starts aligned
        bar = _bar(sum(t.nbytes(q) for t in tensors), f"writing {path.name}", progress)
        for t in tensors:
            for piece in _gguf_pieces(t, q, seed, g.residual_gain):
                f.write(memoryview(piece))
                if bar is not None:
                    bar.update(piece.nbytes)
                del piece
            wr.write_padding(f, t.nbytes(q))
        if bar is not None:
            bar.close()
        f.flush()
        os.fsync(f.fileno())
        wr.close()
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    cfg = g.gguf_config()
    tb, cb = _analysis(cfg, q)
    return Written(str(path), "gguf", path.stat().st_size, time.perf_counter() - t0, cfg.to_dict(), tb, cb)


def _gguf_pieces(t: GgufTensor, q: str, seed: int, residual_gain: float) -> Iterator[np.ndarray]:
    """The tensor's bytes in file order, one piece at a time (one expert of a 3-D tensor)."""
    if t.kind == "norm":
        yield np.ones(t.shape, np.float32).view(np.uint8).reshape(-1)
    elif t.kind == "router":
        yield router_values(tensor_rng(seed, t.name), *t.shape).view(np.uint8).reshape(-1)
    elif t.kind == "matrix":
        yield random_rows(tensor_rng(seed, t.name), q, t.rows, t.cols,
                          tensor_gain(t.name, t.cols, residual_gain)).reshape(-1)
    else:
        for e in range(t.shape[0]):
            yield random_rows(tensor_rng(seed, t.name, e), q, t.rows, t.cols,
                              tensor_gain(t.name, t.cols, residual_gain)).reshape(-1)


def cflow_tensors(g: Geometry, q: str = "q4_0", seed: int = 0,
                  tile: tuple[int, int] = quant.TILE) -> Iterator[TensorData]:
    """TensorData for every tensor of the .cflow's config (cflow.weights' table), each a callable
    that makes its random bytes when the writer reaches it."""
    cfg = g.cflow_config()
    for w in weights.model_weights(cfg):
        if w.plain:
            if w.name.endswith("moe.router"):
                make = (lambda w=w: quant.to_plain(router_values(tensor_rng(seed, w.name), *w.shape), "f32"))
            else:
                make = (lambda w=w: quant.to_plain(np.ones(w.shape, np.float32), "f32"))
            yield TensorData(w.name, "f32", w.shape, "rows", make, {})
            continue
        rows, cols = w.shape
        if w.fused == "qkv":
            meta = {"fused": "qkv", "splits": [cfg.q_dim, cfg.kv_dim, cfg.kv_dim]}
        elif w.fused == "gate_up":
            meta = {"fused": "gate_up", "group": quant.G, "splits": [rows // 2, rows // 2]}
        else:
            meta = {}
        # Gate and up rows (q, k and v rows) all have `cols` inputs, so one scale table serves the
        # fused matrix and random bytes in the tiled order are a random fused matrix.
        make = (lambda w=w, rows=rows, cols=cols: random_tiled(tensor_rng(seed, w.name), q, rows, cols, tile,
                                                               tensor_gain(w.name, cols, g.residual_gain)))
        yield TensorData(w.name, q, w.shape, "tiled", make, meta)


def write_cflow(path: str | os.PathLike, g: Geometry, q: str = "q4_0", seed: int = 0, progress: bool = True,
                tile: tuple[int, int] = quant.TILE) -> Written:
    """Write the pipeline-native model with cflow.fileformat.write_model (which streams: each
    tensor's bytes are made when it is written, checksummed and dropped). A path ending in .vflow
    gets the .vflow data order."""
    if q not in QUANTS:
        raise MakeMoeError(f"quant {q!r}: choose one of {list(QUANTS)}")
    t0 = time.perf_counter()
    cfg = g.cflow_config()
    order = "vflow" if str(path).endswith(".vflow") else "cflow"
    total = sum(quant.tensor_nbytes("f32" if w.plain else q, w.shape) for w in weights.model_weights(cfg))
    bar = _bar(total, f"writing {Path(path).name}", progress)
    last = [0]

    def on_progress(done: int, total: int, name: str) -> None:
        if bar is not None:
            bar.update(done - last[0])
            last[0] = done

    try:
        write_model(path, config=cfg, tokenizer=cflow_tokenizer(g.vocab), tensors=cflow_tensors(g, q, seed, tile),
                    order=order, tile=tile, progress=on_progress,
                    metadata={"source": "random weights", "generator": "cflow.bench.synthetic", "seed": seed,
                              "geometry": dataclasses.asdict(g)})
    finally:
        if bar is not None:
            bar.close()
    tb, cb = _analysis(cfg, q)
    return Written(str(path), "cflow", Path(path).stat().st_size, time.perf_counter() - t0, cfg.to_dict(), tb, cb)


# ---- dense Llama GGUFs ------------------------------------------------------------------------
# TinyLlama-1.1B's geometry: the ~1B dense model of the benchmarks (docs/results/dense.md, C4, quants.py)
TINYLLAMA = dict(layers=22, d_model=2048, d_ff=5632, heads=32, kv_heads=4, vocab=32000)


def _write_tensors(wr: Any, tensors: list[tuple[str, tuple[int, ...], str]], nbytes: Callable, qtype: Any,
                   matrix: Callable[[str, tuple[int, ...]], np.ndarray], tmp: Path, path: Path) -> Path:
    """The rest of a GGUF whose metadata `wr` holds: the tensor table, then each tensor's data (kind
    "n": an F32 norm of ones, the file's 1 + w for Gemma; "f": `matrix(name, shape)`'s F32 values;
    any other kind: `matrix(name, shape)`'s bytes, raw type `qtype`, or `qtype[kind]` when it is a
    dict of kinds), fsynced, moved from `tmp` to `path`."""
    for name, shape, kind in tensors:
        if kind in ("n", "f"):
            wr.add_tensor_info(name, shape, np.dtype(np.float32), nbytes(shape, kind))
        else:
            raw = qtype[kind] if isinstance(qtype, dict) else qtype
            wr.add_tensor_info(name, shape, np.dtype(np.float32), nbytes(shape, kind), raw_dtype=raw)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_ti_data_to_file()
    f = wr.fout[0]
    wr.write_padding(f, f.tell())
    for name, shape, kind in tensors:
        if kind == "n":
            f.write(np.ones(shape, np.float32).tobytes())
        elif kind == "f":
            f.write(np.ascontiguousarray(matrix(name, shape), np.float32).tobytes())
        else:
            f.write(memoryview(matrix(name, shape).reshape(-1).view(np.uint8)))
        wr.write_padding(f, nbytes(shape, kind))
    f.flush()
    os.fsync(f.fileno())
    wr.close()
    os.replace(tmp, path)
    return path


def write_dense_gguf(path: str | os.PathLike, *, layers: int, d_model: int, d_ff: int, heads: int,
                     kv_heads: int, vocab: int, quant: str = "q4_0", seed: int = 0, ctx: int = 2048,
                     arch: str = "llama", head_dim: int = 0, rope_theta: float = 10000.0,
                     keys: dict | None = None) -> Path:
    """A random-weight Llama GGUF (dense, e.g. TinyLlama-1.1B's geometry), written with the gguf
    package and this module's random blocks and tokenizer.
    quant "f16": float weights of the quantized files' per-tensor std (the source llama.cpp's quantizer turns
    into K-quant files, benchmarks/quants.py). arch: "llama", or another architecture of the same
    tensors ("mistral3"); head_dim: the heads' width when not d_model / heads (written as
    key_length); keys: more `{arch}.` metadata (RoPE scaling, the attention temperature ...)."""
    import gguf

    T = gguf.GGMLQuantizationType
    qtype = {"q4_0": T.Q4_0, "q4_1": T.Q4_1, "q8_0": T.Q8_0, "f16": T.F16}[quant]
    hd = head_dim or d_model // heads
    kv, q_dim = kv_heads * hd, heads * hd
    tensors: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (vocab, d_model), "m")]
    for i in range(layers):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", (d_model,), "n"), (b + "attn_q.weight", (q_dim, d_model), "m"),
                    (b + "attn_k.weight", (kv, d_model), "m"), (b + "attn_v.weight", (kv, d_model), "m"),
                    (b + "attn_output.weight", (d_model, q_dim), "m"), (b + "ffn_norm.weight", (d_model,), "n"),
                    (b + "ffn_gate.weight", (d_ff, d_model), "m"), (b + "ffn_up.weight", (d_ff, d_model), "m"),
                    (b + "ffn_down.weight", (d_model, d_ff), "m")]
    tensors += [("output_norm.weight", (d_model,), "n"), ("output.weight", (vocab, d_model), "m")]

    def nbytes(shape: tuple[int, ...], kind: str) -> int:
        return 4 * shape[0] if kind == "n" else shape[0] * row_bytes(quant, shape[1])

    def matrix(name: str, rows: int, cols: int) -> np.ndarray:
        rng = tensor_rng(seed, name)
        if quant == "f16":
            std = GAIN / np.sqrt(cols)  # the std random_rows gives the quantized files
            return (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)).astype(np.float16)
        return random_rows(rng, quant, rows, cols)

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    wr = start_gguf(tmp, arch, f"random dense {layers}L d{d_model} ff{d_ff} {quant}", layers=layers, ctx=ctx,
                    d_model=d_model, d_ff=d_ff, heads=heads, kv_heads=kv_heads, rope_theta=rope_theta, eps=1e-5,
                    file_type=quant, key_length=hd if head_dim else None,
                    value_length=hd if head_dim else None, rope_dims=hd)
    wr.add_vocab_size(vocab)
    for key, v in (keys or {}).items():
        add = wr.add_string if isinstance(v, str) else wr.add_uint32 if isinstance(v, int) else wr.add_float32
        add(f"{arch}.{key}", v)
    add_tokenizer(wr, vocab)
    return _write_tensors(wr, tensors, nbytes, qtype, lambda name, shape: matrix(name, shape[0], shape[1]), tmp, path)


GEMMA3_1B = dict(layers=26, d_model=1152, d_ff=6912, heads=4, kv_heads=1, head_dim=256, vocab=262144, window=512)


def write_gemma3_gguf(path: str | os.PathLike, *, layers: int, d_model: int, d_ff: int, heads: int, kv_heads: int,
                      head_dim: int, vocab: int, window: int, quant: str = "q4_0", seed: int = 0,
                      ctx: int = 4096) -> Path:
    """A random-weight Gemma 3 text GGUF (e.g. Gemma 3 1B's geometry) in llama.cpp's gemma3 layout:
    head_dim from key_length, per-head q/k norms, post-attention and post-FFN norms, tied
    embeddings, `window` on the local layers (llama.cpp's default pattern: every 6th layer global),
    this module's random blocks and byte-level tokenizer. Norm weights are 1 (the file's 1 + w), so
    activations stay of order one through the post-norms."""
    import gguf

    T = gguf.GGMLQuantizationType
    qtype = {"q4_0": T.Q4_0, "q4_1": T.Q4_1, "q8_0": T.Q8_0}[quant]
    q_dim, kv = heads * head_dim, kv_heads * head_dim
    tensors: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (vocab, d_model), "m")]
    for i in range(layers):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", (d_model,), "n"), (b + "attn_q.weight", (q_dim, d_model), "m"),
                    (b + "attn_k.weight", (kv, d_model), "m"), (b + "attn_v.weight", (kv, d_model), "m"),
                    (b + "attn_q_norm.weight", (head_dim,), "n"), (b + "attn_k_norm.weight", (head_dim,), "n"),
                    (b + "attn_output.weight", (d_model, q_dim), "m"),
                    (b + "post_attention_norm.weight", (d_model,), "n"),
                    (b + "ffn_norm.weight", (d_model,), "n"), (b + "ffn_gate.weight", (d_ff, d_model), "m"),
                    (b + "ffn_up.weight", (d_ff, d_model), "m"), (b + "ffn_down.weight", (d_model, d_ff), "m"),
                    (b + "post_ffw_norm.weight", (d_model,), "n")]
    tensors.append(("output_norm.weight", (d_model,), "n"))

    def nbytes(shape: tuple[int, ...], kind: str) -> int:
        return 4 * shape[0] if kind == "n" else shape[0] * row_bytes(quant, shape[1])

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    wr = start_gguf(tmp, "gemma3", f"random gemma3 {layers}L d{d_model} ff{d_ff} hd{head_dim} {quant}", layers=layers,
                    ctx=ctx, d_model=d_model, d_ff=d_ff, heads=heads, kv_heads=kv_heads, rope_theta=1e6, eps=1e-6,
                    file_type=quant, key_length=head_dim, value_length=head_dim)
    wr.add_sliding_window(window)
    add_tokenizer(wr, vocab)
    return _write_tensors(wr, tensors, nbytes, qtype,
                          lambda name, shape: random_rows(tensor_rng(seed, name), quant, shape[0], shape[1]), tmp, path)


def geometry_parser(doc: str, defaults: dict[str, int], label: str):
    """The command line of a benchmarks/make_<family>.py script: --out, --quant, --seed, --ctx and
    one integer flag per geometry field of `defaults` (the real model `label`'s values)."""
    import argparse

    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="the GGUF to write")
    p.add_argument("--quant", default="q4_0", choices=("q4_0", "q4_1", "q8_0"), help="weight type (q4_0)")
    p.add_argument("--seed", type=int, default=0, help="weights' seed (0)")
    p.add_argument("--ctx", type=int, default=4096, help="the file's context length (4096)")
    for k, v in defaults.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=v, help=f"default {v} ({label})")
    return p


def check_geometry(p: Any, a: Any) -> None:
    """geometry_parser's arguments: heads in whole KV groups, widths in whole quant blocks."""
    if a.heads % a.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    if a.d_model % 32 or a.d_ff % 32 or (a.heads * a.head_dim) % 32:
        p.error("--d-model, --d-ff and --heads x --head-dim must be multiples of 32 (the quantized block)")
