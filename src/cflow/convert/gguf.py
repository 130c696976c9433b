"""GGUF (llama.cpp) Llama, Qwen2, Qwen3, Qwen3.5, Gemma 3, Gemma 4 and Mistral 3 models, dense and
mixture-of-experts (Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3.5-MoE, OLMoE, gpt-oss, DeepSeek) -> `.cflow`.

Owns reading a GGUF file (through the `gguf` package's GGUFReader, memory-mapped): its
hyperparameters -> ModelConfig, its tokenizer -> the header dict of cflow.tokenizer, and its
tensors -> `Source`s that cflow.convert.encoder encodes.

Choices:
- `general.architecture` "llama" (Llama, SmolLM, TinyLlama, Mistral, Mixtral ...), "qwen2"
  (Qwen2 / Qwen2.5: q/k/v biases -> attn.qkv_bias) and "qwen3" (dense Qwen3: per-head RMSNorm of q
  and k -> attn.q_norm / attn.k_norm, head_dim from attention.key_length). Anything else is a
  named error listing what is supported, never a best-effort guess; a vision projector (`clip`
  mmproj files, or vision tensors inside a text GGUF) is refused by name. "gemma4" (Gemma 4, dense
  and MoE), "deepseek2" and "qwen35" / "qwen35moe" have modules of their own
  (cflow.convert.gguf_gemma4, gguf_deepseek2, gguf_qwen35).
- "gpt-oss" (OpenAI's gpt-oss, as llama.cpp's llm_build_openai_moe_iswa runs it): q/k/v biases
  (qkv_bias), the output projection's bias (attn_output.bias -> attn.wo_bias: attn_out_bias), a
  learned sink logit per query head (attn_sinks.weight [n_heads] -> attn.sinks: attn_sinks), NEOX
  RoPE (not permuted) with the file's YaRN (below), head_dim from attention.key_length; every
  layer a MoE and no dense FFN, the norm before it `post_attention_norm` (-> moe_norm), the router
  ffn_gate_inp with its bias (-> moe.router_bias), the top-k chosen on the biased logits and
  weighted by the softmax over those k (moe_gating "softmax_topk", no renormalisation), experts
  of hidden size expert_feed_forward_length whose gate/up/down add the F32 biases
  ffn_{gate,up,down}_exps.bias [E, rows] (-> experts.{e}.b_gate_up, interleaved like the rows, and
  b_down: moe_bias) and run OpenAI's clamped SwiGLU (expert_act "swiglu_oai", alpha 1.702, limit
  7, as llama.cpp hard-codes them). With `attention.sliding_window` W the even layers attend to
  the last W positions and the odd ones to the whole context (llama.cpp's set_swa_pattern(2):
  sliding_window_pattern 2). The MXFP4 experts and Q8_0 attention keep their blocks.
- "mistral3" (Ministral 3, Mistral Small 3.x text; llama.cpp's llama_model_mistral3, dense only:
  a file with experts is refused): a Llama (Q/K permuted like llama files, undone here) whose
  rotated query at position p is multiplied by 1 + beta * ln(floor(p / n_orig) + 1) when the file
  has `attention.temperature_scale` beta (Llama 4's temperature; llama.cpp's offset for mistral3
  is 0), n_orig the YaRN original context (`rope.scaling.original_context_length`, else
  context_length): config attn_temp_scale / attn_temp_floor. Its YaRN carries
  `rope.scaling.yarn_log_multiplier` (mscale_all_dim), which the RoPE bullet below reads.
- "gemma3" (Gemma 3 text models, as llama.cpp's gemma3 graph runs them): the token embedding times
  sqrtf(d) (embed_scale); GeGLU FFN (ffn_act "gelu_tanh"); per-head RMSNorm of q and k before
  RoPE (attn_q_norm / attn_k_norm [hd]); an RMSNorm of the attention output and of the FFN output
  before each joins the residual (post_attention_norm -> attn_post_norm, post_ffw_norm ->
  ffn_post_norm: post_norms); NEOX RoPE (not permuted); head_dim from attention.key_length; tied
  embeddings (output.weight when present). Norm weights are used as stored: convert_hf_to_gguf
  adds Gemma3RMSNorm's 1 to every norm weight, so the GGUF holds (1 + w). With a
  `gemma3.attention.sliding_window` W > 0, layers alternate local and global as llama.cpp's swa
  pattern: `attention.sliding_window_pattern` N (default 6; a per-layer bool array is read as the
  period it repeats, else refused), layer l local iff l % N < N - 1 (sliding_window_pattern); the
  local layers attend to the last W positions and rotate with `rope.freq_base_swa` (llama.cpp's
  default 10000) unscaled (rope_theta_local), the global ones with rope.freq_base and the file's
  linear scaling. Without a window every layer is global. Scores are scaled by 1/sqrt(hd), or for
  a 62-layer (27B) model by 1/sqrt(d / n_heads) (llama.cpp's rule; attn_scale). Refused by name:
  final_logit_softcapping (llama.cpp applies it; no Gemma 3 checkpoint sets it), YaRN and
  rope_freqs scaling, SWA-specific head sizes. Not exact: llama.cpp's CPU GELU reads a table over
  fp16 inputs, cflow computes it in f32 (a 1e-3 relative difference inside the FFN).
- RoPE: plain; Llama 3's frequency factors (Llama 3.1+ GGUFs carry them as the F32 tensor
  rope_freqs.weight [head_dim/2]); linear scaling; YaRN (ext_factor 1, attn_factor 1). Each is,
  as llama.cpp's ggml_rope_ext computes it, a divisor of each rotation pair's frequency
  (config rope_freq_factors) and for YaRN a scale of cos and sin (rope_mscale): 1 + 0.1 ln(factor),
  or with a `yarn_log_multiplier` m, (1 + 0.1 ln f) / (1 + 0.1 m ln f) (llama.cpp's
  yarn_attn_factor for it, times ggml's own YaRN magnitude; DeepSeek-V2's special case aside).
  YaRN variants with other magnitude rules (attn_factor, ext_factor) and other scaling types
  (longrope ...) are refused by name.
- Sliding windows: a `llama.attention.sliding_window` (Mistral 7B v0.1 GGUFs carry one as arch
  "llama") is honoured: position p attends to the last W positions, as the model was trained and
  as HF transformers runs it. llama.cpp's llama graph ignores the key (a plain causal cache), so
  past W positions cflow and llama.cpp differ on such a file; `cflow convert --sliding-window 0`
  (convert_gguf(sliding_window=0)) gives llama.cpp's behaviour. gemma3's window is part of its
  local/global pattern (above) and runs as llama.cpp runs it; the override is refused there.
  Other architectures' windows are not read (Qwen2 configs carry a window
  with use_sliding_window off, which the GGUF does not record) and are noted in the metadata
  (source.sliding_window_ignored).
- Mixture-of-experts llama files (Mixtral and its merges: `llama.expert_count` > 0) become
  config `mixtral`: no dense FFN (d_ff = 0), E experts of hidden size feed_forward_length, top_k =
  expert_used_count, no delays, the MoE reading h = x + attention (moe_input "post_attn"), which is
  llama.cpp's graph: x' = h + MoE(rmsnorm(h) * ffn_norm). Routing is llama.cpp's for this
  architecture and cflow's own: softmax over all E router logits, top-k, the k weights
  renormalised to sum to 1. Per layer: `ffn_norm` -> moe_norm, `ffn_gate_inp` [E, d] -> router
  (stored F32 whatever its GGUF type), and expert e's slice of the 3-D `ffn_{gate,up,down}_exps`
  (ggml ne = [d, d_exp, E] for gate/up, [d_exp, d, E] for down: expert e's rows are one
  contiguous block of the tensor) -> experts.{e}.w_gate_up / w_down. The older per-expert layout
  (`ffn_gate.{e}` / `ffn_up.{e}` / `ffn_down.{e}`, 2-D each) is read too. Shared experts in a
  llama file and other MoE architectures (deepseek2, ...) are refused by the architecture check
  or by the tensor-name check, never dropped.
- Qwen MoE files ("qwen2moe", "qwen3moe") are read the same way (3-D expert stacks, router, the
  norm before the MoE), named after the architecture, with what llama.cpp's graphs for them do:
  qwen3moe renormalises the top-k weights, qwen2moe does not (moe_norm_topk off; llama.cpp
  hard-codes both, whatever a file's expert_weights_norm says). Their expert hidden size is
  expert_feed_forward_length, else feed_forward_length / expert_used_count (llama.cpp's fallback).
  qwen2moe adds a shared expert every token runs: `ffn_{gate,up,down}_shexp` ->
  moe.shared.w_gate_up / w_down, of hidden size expert_shared_feed_forward_length (else
  feed_forward_length), scaled by sigmoid(ffn_gate_inp_shexp . x) (`ffn_gate_inp_shexp` [d] ->
  moe.shared_gate, F32) -- x the normalised MoE input. Their attention is qwen2's / qwen3's.
- OLMoE ("olmoe") likewise, without renormalisation, its experts of hidden size
  feed_forward_length (llama.cpp does not read expert_feed_forward_length for it), NEOX RoPE
  (not permuted), and q/k RMSNorm over the whole q and k vectors (attn_q_norm [n_heads * hd],
  attn_k_norm [n_kv_heads * hd]): qk_norm_full, which the engine runs with a barrier between the
  projection and the norms.
- Q4_0 / Q4_1 / Q8_0 tensors go into tiles bit for bit (cflow's formats are GGML's), and so do
  the K-quant files' types and MXFP4 (the experts of gpt-oss and of llama.cpp's MXFP4_MOE files;
  cflow.kquant). Every other type (F16, F32, BF16, IQ* ...) is dequantized with `gguf.quants.dequantize` and quantized
  to --quant; the introduced error is measured and reported.
- convert_hf_to_gguf.py stores a llama file's Q and K (weights and biases) with the rows of each
  head permuted for ggml's adjacent-pair RoPE:  W_gguf = W.reshape(H, 2, hd/2, K).swapaxes(1, 2)
  .reshape(W.shape) (H = n_heads for Q, n_kv_heads for K). We invert it so the runtime uses the
  "half" (NeoX / HF) convention everywhere. It moves whole rows, so it is lossless on blocks.
  Qwen2 and Qwen3 files are not permuted: llama.cpp runs them with NEOX RoPE, which is cflow's.
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
from cflow.quant import STORED_QUANT, TILE, row_bytes
from cflow.tokenizer import Tokenizer, TokenizerError, unicode_to_bytes
from cflow.weights import Weight

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "olmoe", "gemma3", "mistral3", "gpt-oss",
                           "deepseek2", "gemma4", "qwen35", "qwen35moe")  # the last four: cflow.convert.gguf_<arch>
# Architectures with experts, and whether llama.cpp renormalises their top-k routing weights
# (gpt-oss: its softmax over the k chosen logits sums to 1 already).
_MOE_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False, "gpt-oss": False}
_MOE_ONLY = ("qwen2moe", "qwen3moe", "olmoe", "gpt-oss")  # every layer has experts (llama: only Mixtral files do)
# Architectures whose Q/K rows convert_hf_to_gguf permutes for ggml's adjacent-pair ("NORM") RoPE;
# the others listed above use NEOX RoPE, the "half" convention cflow runs, and are stored as is.
_PERMUTED_QK = ("llama", "mistral3")
# Known architectures cflow does not run yet, with what is missing.
# GGUF tensor-name prefixes of vision towers and projectors (llama.cpp's mmproj files use them).
_VISION_PREFIXES = ("v.", "mm.", "vision_", "mmproj.")
_NATIVE = {d.upper(): d for d in STORED_QUANT}  # GGML type name -> the dtype its blocks keep
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


class GGUFError(ConvertError):
    """A GGUF file cannot be read or describes something cflow does not support."""


class UnsupportedArchitectureError(GGUFError):
    """The GGUF's general.architecture is not one cflow can run."""


class GGUFTruncatedError(GGUFError):
    """The GGUF file ends before the tensor data its header describes (an unfinished download or copy)."""


def _reader_class():
    """gguf's GGUFReader, with the file's length checked against its tensor table before any tensor
    is mapped: a file cut short then says so, instead of failing to reshape the first short tensor."""
    from gguf import GGUFReader
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    class CheckedReader(GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list) -> None:
            need = start_offs
            for field in fields:
                _, _, _, dims, raw_dtype, offset = field.parts
                try:
                    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
                except (ValueError, KeyError):
                    continue  # an unknown type: the reader's own check names it
                n = int(np.prod(dims.astype(np.uint64), dtype=np.uint64))
                need = max(need, start_offs + int(offset[0]) + n * size // block)
            if need > len(self.data):
                raise GGUFTruncatedError(f"its header describes {need:,} bytes of tensors but the file has "
                                         f"{len(self.data):,} ({len(self.data) / need:.1%}): it is cut short, "
                                         "an unfinished download or copy; download it again")
            super()._build_tensors(start_offs, fields)

    return CheckedReader


# ---- reading ---------------------------------------------------------------------------------
class GGUFModel:
    """A GGUF file opened for conversion: metadata by key and tensors by name (memory-mapped)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"GGUF file {self.path} does not exist")
        try:
            reader = _reader_class()
        except ImportError:
            raise GGUFError("reading GGUF needs the `gguf` package: pip install gguf") from None
        with open(self.path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise GGUFError(f"{self.path} is not a GGUF file (it does not start with b'GGUF')")
        try:
            self.reader = reader(str(self.path))
        except GGUFTruncatedError as e:
            raise GGUFTruncatedError(f"{self.path}: {e}") from None
        except Exception as e:  # the reader raises ValueError/struct errors on bad files
            raise GGUFError(f"{self.path} is not a readable GGUF file ({type(e).__name__}: {e}); it is damaged "
                            "or cut short, download it again") from None
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

    def source(self, name: str, expert: int | None = None) -> Source:
        """The tensor `name` as a Source: blocks when its type is native, values otherwise.

        `expert`: the tensor is a 3-D expert stack (ggml ne = [cols, rows, E]) and the Source is
        expert `expert`'s [rows, cols] slice; its rows are one contiguous run of the tensor."""
        from gguf import GGMLQuantizationType

        t = self.tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.path.name} lacks the tensor {name!r}")
        # ggml lists dims innermost first: shape [cols, rows] for a matrix, [cols, rows, E] for
        # an expert stack; the reader's t.data has the numpy (outermost first) shape.
        dims = [int(x) for x in t.shape]
        origin = name
        if expert is None:
            cols, rows = dims[0], int(np.prod(dims[1:]))
        else:
            if len(dims) != 3:
                raise GGUFError(f"{self.path.name}: {name} has shape {dims}; an expert stack is 3-D "
                                "[inputs, outputs, experts]")
            cols, rows, n = dims
            if not 0 <= expert < n:
                raise GGUFError(f"{self.path.name}: {name} holds {n} experts, not expert {expert}")
            origin = f"{name}[{expert}]"
        qtype = GGMLQuantizationType(t.tensor_type)

        def data(t=t, n=1 if expert is None else dims[2]) -> np.ndarray:
            a = np.asarray(t.data)
            return a.reshape(n, rows, -1)[expert] if expert is not None else a

        if qtype.name in _NATIVE:
            dtype = _NATIVE[qtype.name]
            blocks = data().reshape(rows, row_bytes(dtype, cols))
            return Source(origin, qtype.name, rows, cols, dtype, blocks=blocks)

        def values(qtype=qtype) -> np.ndarray:
            from gguf.quants import dequantize

            return dequantize(data(), qtype).astype(np.float32).reshape(rows, cols)

        return Source(origin, qtype.name, rows, cols, values=values)

    def vector(self, name: str) -> np.ndarray:
        s = self.source(name)
        return s.floats().reshape(-1)

    def values(self, name: str) -> np.ndarray:
        """The tensor `name` dequantized to float32 in numpy order (outermost first: [rows, cols],
        [E, rows, cols]), for float references (cflow.model_qwen35) and tests."""
        from gguf.quants import dequantize

        t = self.tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.path.name} lacks the tensor {name!r}")
        shape = tuple(int(x) for x in reversed(list(t.shape)))
        return dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(shape)


# ---- hyperparameters -------------------------------------------------------------------------
def refuse_vision(g: GGUFModel) -> None:
    """A vision tower or projector is refused by name: cflow runs text models."""
    if g.architecture == "clip" or any(n.startswith(_VISION_PREFIXES) for n in g.tensors):
        what = g.get("clip.projector_type") or "vision"
        raise UnsupportedArchitectureError(
            f"{g.path.name} holds a vision tower ({what!r} projector: an mmproj file or vision tensors such as "
            f"{next((n for n in g.tensors if n.startswith(_VISION_PREFIXES)), 'v.*')}); cflow runs the text model "
            "only: convert the text GGUF without the projector")


def gguf_config(g: GGUFModel) -> ModelConfig:
    """ModelConfig of a llama, qwen2, qwen3, qwen2moe, qwen3moe, olmoe, gemma3 or mistral3 GGUF (SmolLM2-135M:
    30 layers, d=576, heads 9/3), named after the architecture, or "mixtral" for a llama one with
    experts (see the module docstring)."""
    arch = g.architecture
    refuse_vision(g)
    if arch == "gemma4":  # its per-layer shapes: a module of its own
        from cflow.convert.gguf_gemma4 import gemma4_config

        return gemma4_config(g)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{g.path.name} is a {arch!r} model; cflow converts GGUF architectures "
            f"{list(SUPPORTED_ARCHITECTURES)} (Llama 2/3, SmolLM, TinyLlama, Mistral, Mixtral, Qwen2, "
            "Qwen2.5, Qwen3, Qwen2-MoE, Qwen3-MoE, OLMoE, Gemma 3, Gemma 4, Ministral 3 / Mistral Small 3, gpt-oss)")
    p = f"{arch}."
    n_experts = int(g.get(p + "expert_count") or 0)
    ffn = int(g.require(p + "feed_forward_length"))
    if arch in _MOE_ONLY and n_experts <= 0:
        raise GGUFError(f"{g.path.name} is a {arch!r} model without experts ({p}expert_count); the file is "
                        "incomplete")
    if n_experts > 0:
        if arch not in _MOE_NORM_TOPK:
            raise UnsupportedArchitectureError(
                f"{g.path.name} is a {arch!r} model with {n_experts} experts; cflow runs mixture-of-experts "
                f"GGUFs of architectures {sorted(_MOE_NORM_TOPK)}")
        # (a stray shared-expert tensor is refused by the tensor-name check)
        if arch != "qwen2moe" and int(g.get(p + "expert_shared_count") or 0) > 0:
            raise GGUFError(f"{g.path.name} has shared experts ({p}expert_shared_count); cflow runs them in "
                            "qwen2moe files only")
        top_k = g.get(p + "expert_used_count")
        if top_k is None:
            raise GGUFError(f"{g.path.name} has {n_experts} experts but no {p}expert_used_count "
                            "(experts per token); the file is incomplete")
        scale = float(g.get(p + "expert_weights_scale") or 0.0)
        if scale not in (0.0, 1.0):
            raise GGUFError(f"{g.path.name} scales its routing weights by {scale} ({p}expert_weights_scale); "
                            "cflow does not")
        if arch == "olmoe":  # llama.cpp sizes its experts by feed_forward_length alone
            d_expert = ffn
        elif arch in ("llama", "gpt-oss"):
            # Mixtral's converter writes the expert hidden size as feed_forward_length; a few
            # newer ones also write expert_feed_forward_length, which then wins.
            d_expert = int(g.get(p + "expert_feed_forward_length") or ffn)
        else:
            d_expert = int(g.get(p + "expert_feed_forward_length") or ffn // max(int(top_k), 1))
        moe = dict(d_ff=0, n_experts=n_experts, top_k=int(top_k), d_expert=d_expert,
                   moe_norm_topk=_MOE_NORM_TOPK[arch], delta_dense=0, delta_expert=0, moe_input="post_attn",
                   name="mixtral" if arch == "llama" else arch)
        if arch == "qwen2moe":  # its shared expert is not optional (llama.cpp requires the tensors)
            moe["d_shared_expert"] = int(g.get(p + "expert_shared_feed_forward_length") or ffn)
    else:
        moe = dict(d_ff=ffn, name=arch)
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
    for key, same in (("attention.key_length_swa", head_dim), ("attention.value_length_swa", head_dim),
                      ("rope.dimension_count_swa", rot)):
        v = g.get(p + key)
        if v is not None and int(v) != same:
            raise GGUFError(f"{g.path.name}: {p}{key} = {v}, other than the global layers' {same}; cflow runs one "
                            "head size on every layer")
    if arch == "gemma3":
        _gemma3_checks(g, p)
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
            rope_theta=float(g.get(p + "rope.freq_base") or 10000.0),
            norm_eps=float(g.get(p + "attention.layer_norm_rms_epsilon") or 1e-5),
            max_seq_len=int(g.get(p + "context_length") or 2048),
            tie_embeddings="output.weight" not in g.tensors,
            qkv_bias="blk.0.attn_q.bias" in g.tensors, qk_norm="blk.0.attn_q_norm.weight" in g.tensors,
            qk_norm_full=arch == "olmoe",
            sliding_window=_window(g), **_rope_scaling(g, p, head_dim), **moe,
            **(_gemma3(g, p, d, n_heads) if arch == "gemma3" else {}),
            **(_temperature(g, p) if arch == "mistral3" else {}),
            **(dict(_GPTOSS, **_gptoss_pattern(g)) if arch == "gpt-oss" else {}))
    except ConfigError as e:
        raise GGUFError(f"{g.path.name}: its hyperparameters do not form a valid model: {e}") from None


def _rope_scaling(g: GGUFModel, p: str, head_dim: int) -> dict[str, Any]:
    """rope_freq_factors and rope_mscale (ModelConfig) from the file's RoPE scaling, as llama.cpp's
    ggml_rope_ext computes it: Llama 3's factors (the rope_freqs tensor, F32 [head_dim/2]) divide
    pair j's frequency; "linear" scaling divides every pair's by rope.scaling.factor; "yarn"
    (ext_factor 1, attn_factor 1) mixes, per pair, the interpolated (x freq_scale) and the
    extrapolated angle by a ramp between the pairs that turn beta_fast and beta_slow times over
    the original context, which is again a per-pair divisor, and scales cos/sin by
    1 + 0.1 ln(factor). YaRN variants with their own magnitude rules (yarn_log_multiplier, an
    attn_factor or ext_factor other than 1) are refused by name."""
    half = head_dim // 2
    t = g.tensors.get("rope_freqs.weight")
    factors = (np.asarray(t.data, np.float64).reshape(-1) if t is not None else np.ones(half))
    if factors.size != half:
        raise GGUFError(f"{g.path.name}: rope_freqs.weight has {factors.size} values; head_dim {head_dim} needs {half}")
    scaling, mscale = g.get(p + "rope.scaling.type"), 1.0
    if scaling not in (None, "none"):
        factor = float(g.require(p + "rope.scaling.factor"))
        if not factor > 0:
            raise GGUFError(f"{g.path.name}: {p}rope.scaling.factor must be positive, got {factor}")
        if scaling == "linear":
            factors = factors * factor
        elif scaling == "yarn":
            for key, neutral in (("rope.scaling.attn_factor", 1.0), ("rope.scaling.yarn_attn_factor", 1.0),
                                 ("rope.scaling.yarn_ext_factor", 1.0)):
                v = g.get(p + key)
                if v is not None and float(v) != neutral and not (key.endswith("ext_factor") and float(v) < 0):
                    raise GGUFError(f"{g.path.name} uses YaRN with {p}{key} = {v}; cflow implements YaRN with "
                                    f"ext_factor 1 and attn_factor 1 (and a log multiplier) only")
            theta = float(g.get(p + "rope.freq_base") or 10000.0)
            n_orig = float(g.require(p + "rope.scaling.original_context_length"))
            beta_fast = float(g.get(p + "rope.scaling.yarn_beta_fast") or 32.0)
            beta_slow = float(g.get(p + "rope.scaling.yarn_beta_slow") or 1.0)

            def corr_dim(turns: float) -> float:  # the pair index that turns `turns` times over n_orig
                return head_dim * np.log(n_orig / (turns * 2 * np.pi)) / (2 * np.log(theta))

            low = max(0.0, np.floor(corr_dim(beta_fast)))
            high = min(head_dim - 1.0, np.ceil(corr_dim(beta_slow)))
            j = np.arange(half, dtype=np.float64)
            mix = 1.0 - np.clip((j - low) / max(0.001, high - low), 0.0, 1.0)  # 1: extrapolate, 0: interpolate
            factors = factors / ((1.0 / factor) * (1.0 - mix) + mix)
            # ggml scales cos/sin by attn_factor * (1 + 0.1 ln f), and llama.cpp's context sets
            # attn_factor to mscale(f, 1) / mscale(f, m) / (1 + 0.1 ln f), m the log multiplier
            # (mscale_all_dim; 0 without one), mscale(f, m) = 1 + 0.1 m ln f (1 for f <= 1)
            log_mul = float(g.get(p + "rope.scaling.yarn_log_multiplier") or 0.0)
            ms = lambda m: 1.0 if factor <= 1 else 1.0 + 0.1 * m * np.log(factor)  # noqa: E731
            mscale = ms(1.0) / ms(log_mul)
        else:
            raise GGUFError(f"{g.path.name} uses {scaling} RoPE scaling; cflow implements plain RoPE, Llama 3's "
                            "frequency factors, linear and YaRN scaling")
    if t is None and scaling in (None, "none"):
        return {}
    return {"rope_freq_factors": tuple(float(x) for x in factors), "rope_mscale": float(mscale)}


def _window(g: GGUFModel) -> int:
    """The sliding window the model runs with: the file's, for arch llama (Mistral), gemma3 and
    gpt-oss; else 0 (module docstring)."""
    w = g.get(f"{g.architecture}.attention.sliding_window")
    return int(w) if w and g.architecture in ("llama", "gemma3", "gpt-oss") else 0


# The gpt-oss fields of ModelConfig (module docstring); its window, if any, is on the even layers.
_GPTOSS = dict(attn_sinks=True, attn_out_bias=True, moe_bias=True, moe_gating="softmax_topk", expert_act="swiglu_oai")


def _gptoss_pattern(g: GGUFModel) -> dict[str, Any]:
    """llama.cpp's set_swa_pattern(2) for gpt-oss: with a window, layer l is local iff l % 2 == 0."""
    return {"sliding_window_pattern": 2} if _window(g) else {}


def _temperature(g: GGUFModel, p: str) -> dict[str, Any]:
    """attn_temp_scale / attn_temp_floor of a mistral3 file, as llama_model_mistral3 reads them."""
    beta = float(g.get(p + "attention.temperature_scale") or 0.0)
    if beta == 0.0:
        return {}
    floor = int(g.get(p + "rope.scaling.original_context_length") or g.require(p + "context_length"))
    if floor <= 0:
        raise GGUFError(f"{g.path.name}: the attention temperature needs a positive original context length")
    return {"attn_temp_scale": beta, "attn_temp_floor": floor}


def _gemma3_checks(g: GGUFModel, p: str) -> None:
    """What a gemma3 file may carry that cflow does not run: refused by name (module docstring)."""
    cap = g.get(p + "final_logit_softcapping")
    if cap:
        raise GGUFError(f"{g.path.name} caps its logits ({p}final_logit_softcapping = {cap}); cflow does not "
                        "implement final logit soft-capping (no Gemma 3 checkpoint sets it)")
    if g.get(p + "attn_logit_softcapping"):
        raise GGUFError(f"{g.path.name} caps its attention logits ({p}attn_logit_softcapping); Gemma 3 does not, "
                        "and cflow does not implement it")
    scaling = g.get(p + "rope.scaling.type")
    if scaling not in (None, "none", "linear") or "rope_freqs.weight" in g.tensors:
        raise GGUFError(f"{g.path.name} is a gemma3 model with {scaling or 'rope_freqs'} RoPE scaling; cflow runs "
                        "gemma3 files with plain or linear RoPE scaling (what Gemma 3 uses)")


def _gemma3(g: GGUFModel, p: str, d: int, n_heads: int) -> dict[str, Any]:
    """The Gemma 3 fields of ModelConfig, as llama.cpp's llama_model_gemma3 reads the file (module
    docstring)."""
    n_layers = int(g.require(p + "block_count"))
    out: dict[str, Any] = dict(embed_scale=float(np.sqrt(np.float32(d))), post_norms=True, ffn_act="gelu_tanh")
    if n_layers == 62:  # llama.cpp: the 27B model scales by 1/sqrt(d / n_heads) (gemma_pytorch's config)
        out["attn_scale"] = float(np.float32(1.0) / np.sqrt(np.float32(d // n_heads)))
    window = int(g.get(p + "attention.sliding_window") or 0)
    if window <= 0:
        return out  # every layer global, with the file's RoPE (llama.cpp's LLAMA_SWA_TYPE_NONE)
    out["sliding_window_pattern"] = _swa_period(g, p, n_layers)
    base = float(g.get(p + "rope.freq_base_swa") or 10000.0)  # llama-hparams.h's default
    out["rope_theta_local"] = base
    return out


def _swa_period(g: GGUFModel, p: str, n_layers: int) -> int:
    """sliding_window_pattern from `attention.sliding_window_pattern`: a period N (default 6; 0: every
    layer local), or a per-layer array of local flags, which must repeat some period N the way
    llama.cpp's set_swa_pattern lays it out (l local iff l % N < N - 1)."""
    v = g.get(p + "attention.sliding_window_pattern")
    if v is None:
        return 6
    if not isinstance(v, (list, tuple)):
        return int(v)
    flags = [bool(x) for x in v][:n_layers]
    if len(flags) != n_layers:
        raise GGUFError(f"{g.path.name}: {p}attention.sliding_window_pattern has {len(v)} entries for {n_layers} "
                        "layers")
    for n in [0] + list(range(1, n_layers + 1)):
        if flags == [n == 0 or layer % n < n - 1 for layer in range(n_layers)]:
            return n
    raise GGUFError(f"{g.path.name}: {p}attention.sliding_window_pattern {flags} is not periodic (every N-th layer "
                    "global); cflow runs periodic local/global patterns")


# ---- tokenizer -------------------------------------------------------------------------------
def gguf_tokenizer(g: GGUFModel) -> dict[str, Any]:
    """The tokenizer header dict (docs/FORMAT.md) from the file's tokenizer.ggml.* keys.

    GGUF "gpt2" vocabularies become "bpe" headers, "llama" ones (SentencePiece) "spm" headers,
    "gemma4" ones "gemma4" headers.
    Where a key is absent we take llama.cpp's default (llama_vocab::impl::load): pre-tokenizer
    "default"; add_bos by pre-tokenizer for BPE, true for SPM; SPM BOS/EOS ids 1/2 and
    add_space_prefix true.
    """
    model = g.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama", "gemma4"):
        raise TokenizerError(f"{g.path.name} has a {model!r} tokenizer; cflow supports GGUF 'gpt2' "
                             "(byte-level BPE), 'llama' (SentencePiece-style) and 'gemma4' vocabularies")
    tokens = list(g.require("tokenizer.ggml.tokens"))
    types = [int(t) for t in (g.get("tokenizer.ggml.token_type") or [1] * len(tokens))]
    if len(types) != len(tokens):
        raise TokenizerError(f"{g.path.name} has {len(tokens)} tokens but {len(types)} token types")
    if model == "llama":
        return _gguf_spm_tokenizer(g, tokens, types)
    if model == "gemma4":
        return _gguf_gemma4_tokenizer(g, tokens, types)
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

    from cflow.tokenizer_pre import pre_tokenizer_spec

    pre = g.get("tokenizer.ggml.pre") or "default"  # llama.cpp's choice when the key is absent
    add_bos = g.get("tokenizer.ggml.add_bos_token")
    header = {"model": "bpe", "vocab": vocab, "merges": merges,
              "bos_id": _gguf_token_id(g, "bos", len(vocab), None),
              "eos_id": _gguf_token_id(g, "eos", len(vocab), None),
              "add_bos": bool(pre_tokenizer_spec(pre).add_bos if add_bos is None else add_bos),
              "chat_template": g.get("tokenizer.chat_template"),
              "special": special, "pre": pre}
    if added:
        header["added"] = added
    return header


def _gguf_token_id(g: GGUFModel, name: str, n: int, default: int | None) -> int | None:
    """tokenizer.ggml.{name}_token_id if it is a token id, else `default` if that is one."""
    v = g.get(f"tokenizer.ggml.{name}_token_id")
    v = default if v is None else int(v)
    return v if v is not None and 0 <= v < n else None


def _gguf_gemma4_tokenizer(g: GGUFModel, tokens: list[str], types: list[int]) -> dict[str, Any]:
    """The "gemma4" header of a GGUF "gemma4" vocabulary (cflow.tokenizer_gemma4): BPE ranks over
    SentencePiece-spelled pieces; llama.cpp has no default BOS/EOS ids for it."""
    from cflow import tokenizer_gemma4 as gemma4

    header = {"model": "gemma4", "vocab": tokens, "merges": list(g.get("tokenizer.ggml.merges") or []),
              "token_types": types, **_typed_tokens(g, tokens, types, bos=None, eos=None)}
    return _validated(g, header, gemma4.validate_gemma4, "a 'gemma4' tokenizer")


def _gguf_spm_tokenizer(g: GGUFModel, tokens: list[str], types: list[int]) -> dict[str, Any]:
    """The "spm" header of a GGUF "llama" (SentencePiece-style) vocabulary (cflow.tokenizer_spm)."""
    from cflow import tokenizer_spm as spm

    scores = g.get("tokenizer.ggml.scores")
    scores = [float(s) for s in scores] if scores is not None else [0.0] * len(tokens)
    prefix = g.get("tokenizer.ggml.add_space_prefix")
    header = {"model": "spm", "vocab": tokens, "merges": [], "scores": scores, "token_types": types,
              "add_space_prefix": True if prefix is None else bool(prefix),
              **_typed_tokens(g, tokens, types, bos=1, eos=2)}
    return _validated(g, header, spm.validate_spm, "a 'llama' tokenizer (SentencePiece)")


def _typed_tokens(g: GGUFModel, tokens: list[str], types: list[int], bos: int | None,
                  eos: int | None) -> dict[str, Any]:
    """The header fields the SentencePiece-style vocabularies ("llama", "gemma4") share: specials
    (control and unknown tokens) and added tokens (user-defined) by token type, BOS/EOS ids with
    llama.cpp's defaults `bos` / `eos`, BOS added unless the file says otherwise, the template."""
    from cflow import tokenizer_spm as spm

    special = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (spm.CONTROL, spm.UNKNOWN)}
    added = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == spm.USER_DEFINED}
    add_bos = g.get("tokenizer.ggml.add_bos_token")
    fields = {"bos_id": _gguf_token_id(g, "bos", len(tokens), bos),
              "eos_id": _gguf_token_id(g, "eos", len(tokens), eos),
              "add_bos": True if add_bos is None else bool(add_bos),
              "chat_template": g.get("tokenizer.chat_template"), "special": special, "pre": None}
    if added:
        fields["added"] = added
    return fields


def _validated(g: GGUFModel, header: dict[str, Any], validate: Any, what: str) -> dict[str, Any]:
    """`header` once `validate(header, TokenizerError)` accepts it; its complaint names the file."""
    try:
        validate(header, TokenizerError)
    except TokenizerError as e:
        raise TokenizerError(f"{g.path.name} has {what} that cflow cannot use: {e}") from None
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
               "attn.sinks": ("attn_sinks",),
               "attn.wo": ("attn_output",), "ffn_norm": ("ffn_norm",), "ffn.w_gate_up": ("ffn_gate", "ffn_up"),
               "ffn.w_down": ("ffn_down",), "moe.shared_gate": ("ffn_gate_inp_shexp",),
               "attn_post_norm": ("post_attention_norm",), "ffn_post_norm": ("post_ffw_norm",),
               "moe.shared.w_gate_up": ("ffn_gate_shexp", "ffn_up_shexp"), "moe.shared.w_down": ("ffn_down_shexp",)}
_SHARED = ("moe.shared_gate", "moe.shared.w_gate_up", "moe.shared.w_down")
# Plain tensors of the attention options, concatenated from these GGUF tensors (bq | bk | bv).
_GGUF_VECTORS = {"attn.qkv_bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
                 "attn.q_norm": ("attn_q_norm.weight",), "attn.k_norm": ("attn_k_norm.weight",),
                 "attn.wo_bias": ("attn_output.bias",), "moe.router_bias": ("ffn_gate_inp.bias",)}
_GGUF_GLOBAL = {"tok_emb": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}
# A MoE layer (Mixtral): the norm before the MoE is the file's ffn_norm, the router ffn_gate_inp,
# and each expert's gate/up/down either a slice of a 3-D stack ("merged", what convert_hf_to_gguf
# writes today) or one 2-D tensor per expert ("split", older files).
_GGUF_MOE = {"moe_norm": "ffn_norm", "moe.router": "ffn_gate_inp"}
_EXPERT_PARTS = {"w_gate_up": ("ffn_gate", "ffn_up"), "w_down": ("ffn_down",)}
# moe_bias (gpt-oss): each expert's biases, its row of the F32 [E, rows] stacks ffn_*_exps.bias
_EXPERT_BIASES = {"b_gate_up": ("ffn_gate_exps.bias", "ffn_up_exps.bias"), "b_down": ("ffn_down_exps.bias",)}


def _moe_norm_name(g: GGUFModel) -> str:
    """The file's norm before the MoE: gpt-oss names it post_attention_norm, the others ffn_norm."""
    return "post_attention_norm" if g.architecture == "gpt-oss" else _GGUF_MOE["moe_norm"]


def _expert_bias(g: GGUFModel, cfg: ModelConfig, layer: int, expert: int, slot: str) -> np.ndarray:
    """Expert `expert`'s bias `slot` (b_gate_up: gate and up interleaved per 8 rows, like w_gate_up)."""
    from cflow.quant import interleave_gate_up

    parts = []
    for name in _EXPERT_BIASES[slot]:
        full = f"blk.{layer}.{name}"
        v = g.vector(full)
        if v.size % cfg.n_experts:
            raise GGUFError(f"{g.path.name}: {full} holds {v.size} values, not one row per expert of {cfg.n_experts}")
        parts.append(v.reshape(cfg.n_experts, -1)[expert])
    if len(parts) == 2:
        return interleave_gate_up(parts[0][:, None], parts[1][:, None]).reshape(-1)
    return parts[0]


def plain_vector(g: GGUFModel, name: str, w: Weight) -> np.ndarray:
    """The file's float vector `name`, which must hold w's shape."""
    v = g.vector(name)
    if v.shape != w.shape:
        raise GGUFError(f"{g.path.name}: {name} holds {v.size} values, the config implies {w.shape[0]}")
    return v


def stacked_sources(srcs: list[Source], w: Weight) -> list[Source]:
    """`srcs`, the parts stacked row-wise into w (a fused gate|up, an expert's parts), each checked
    to be [w's rows / len(srcs), w's columns]: the encoder checks that the parts agree, the config
    says how large."""
    for s in srcs:
        _check_shape(s, (w.shape[0] // len(srcs), w.shape[1]))
    return srcs


def _expert_sources(g: GGUFModel, layer: int, expert: int, slot: str, layout: str) -> list[Source]:
    if layout == "merged":
        return [g.source(f"blk.{layer}.{n}_exps.weight", expert) for n in _EXPERT_PARTS[slot]]
    return [g.source(f"blk.{layer}.{n}.{expert}.weight") for n in _EXPERT_PARTS[slot]]


def moe_layout(g: GGUFModel) -> str:
    """"merged" (3-D ffn_*_exps stacks) or "split" (2-D ffn_*.{e} per expert), from layer 0."""
    return "merged" if "blk.0.ffn_gate_exps.weight" in g.tensors else "split"


def gguf_tensors(g: GGUFModel, cfg: ModelConfig, enc: Encoder) -> Iterator[Any]:
    """TensorData in .cflow order: embeddings, then layer by layer, then the final norm/lm_head."""
    _check_tensor_names(g, cfg)
    layout = moe_layout(g) if cfg.has_moe else None

    def parts(w: Weight) -> Any:
        if w.set is None:
            name = _GGUF_GLOBAL[w.name]
            return g.vector(name) if w.plain else [g.source(name)]
        if w.expert is not None and w.plain:
            v = _expert_bias(g, cfg, w.set, w.expert, w.slot.rsplit(".", 1)[1])
            if v.shape != w.shape:
                raise GGUFError(f"{g.path.name}: expert {w.expert}'s {w.slot.rsplit('.', 1)[1]} of layer {w.set} holds "
                                f"{v.size} values, the config implies {w.shape[0]}")
            return v
        if w.expert is not None:
            return stacked_sources(_expert_sources(g, w.set, w.expert, w.slot.rsplit(".", 1)[1], layout), w)
        if w.slot in _GGUF_VECTORS:
            names = [f"blk.{w.set}.{n}" for n in _GGUF_VECTORS[w.slot]]
            sizes = [cfg.q_dim, cfg.kv_dim, cfg.kv_dim] if w.slot == "attn.qkv_bias" else [w.shape[0]]
            parts = [g.vector(n) for n in names]
            for name, part, size in zip(names, parts, sizes):
                if part.size != size:
                    raise GGUFError(f"{g.path.name}: {name} holds {part.size} values, the config implies {size}")
            if w.slot == "attn.qkv_bias" and g.architecture in _PERMUTED_QK:  # permuted like the rows
                parts[0] = parts[0][unpermute_qk_index(cfg.q_dim, cfg.n_heads)]
                parts[1] = parts[1][unpermute_qk_index(cfg.kv_dim, cfg.n_kv_heads)]
            return np.concatenate(parts)
        if w.slot in _GGUF_MOE:
            name = f"blk.{w.set}.{_moe_norm_name(g) if w.slot == 'moe_norm' else _GGUF_MOE[w.slot]}.weight"
            if w.slot == "moe_norm":
                return g.vector(name)
            router = g.source(name)
            _check_shape(router, w.shape)
            return router.floats()  # [E, d], stored F32
        names = [f"blk.{w.set}.{n}.weight" for n in _GGUF_PARTS[w.slot]]
        if w.plain:
            return plain_vector(g, names[0], w)
        srcs = [g.source(n) for n in names]
        if w.slot in _SHARED:
            for s in srcs:
                _check_shape(s, (w.shape[0] // len(srcs), w.shape[1]))
        if w.fused == "qkv" and g.architecture in _PERMUTED_QK:  # Q, K rows permuted for ggml RoPE: undo
            q, k, v = srcs
            _check_rows(q, cfg.q_dim)
            _check_rows(k, cfg.kv_dim)
            srcs = [q.take_rows(unpermute_qk_index(q.rows, cfg.n_heads)),
                    k.take_rows(unpermute_qk_index(k.rows, cfg.n_kv_heads)), v]
        return srcs

    return encode_model(cfg, enc, parts)


_ATTN = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output")
_DENSE = ("ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
# Present in some llama GGUFs and safe to drop: precomputed RoPE tables the runtime recomputes.
_IGNORED_SUFFIXES = ("attn_rot_embd",)


def _check_tensor_names(g: GGUFModel, cfg: ModelConfig) -> None:
    expected = {"token_embd.weight", "output_norm.weight"}
    if "rope_freqs.weight" in g.tensors and cfg.rope_freq_factors:  # read into the config (_rope_scaling)
        expected.add("rope_freqs.weight")
    if not cfg.tie_embeddings:
        expected.add("output.weight")
    layout = moe_layout(g) if cfg.has_moe else None
    for i in range(cfg.n_layers):
        expected |= {f"blk.{i}.{n}.weight" for n in _ATTN}
        if cfg.qkv_bias:
            expected |= {f"blk.{i}.{n}" for n in _GGUF_VECTORS["attn.qkv_bias"]}
        if cfg.qk_norm:
            expected |= {f"blk.{i}.{n}" for n in _GGUF_VECTORS["attn.q_norm"] + _GGUF_VECTORS["attn.k_norm"]}
        if cfg.has_dense:
            expected |= {f"blk.{i}.{n}.weight" for n in _DENSE}
        if cfg.post_norms:
            expected |= {f"blk.{i}.{n}.weight" for n in ("post_attention_norm", "post_ffw_norm")}
        if cfg.has_shared_expert:
            expected |= {f"blk.{i}.{n}.weight" for slot in _SHARED for n in _GGUF_PARTS[slot]}
        if cfg.attn_out_bias:
            expected |= {f"blk.{i}.{n}" for n in _GGUF_VECTORS["attn.wo_bias"]}
        if cfg.attn_sinks:
            expected.add(f"blk.{i}.attn_sinks.weight")
        if cfg.moe_bias:
            expected |= {f"blk.{i}.{n}" for n in _GGUF_VECTORS["moe.router_bias"]}
            expected |= {f"blk.{i}.{n}" for names in _EXPERT_BIASES.values() for n in names}
        if cfg.has_moe:
            expected |= {f"blk.{i}.{n}.weight" for n in (_moe_norm_name(g), _GGUF_MOE["moe.router"])}
            if layout == "merged":
                expected |= {f"blk.{i}.{n}_exps.weight" for n in ("ffn_gate", "ffn_up", "ffn_down")}
            else:
                expected |= {f"blk.{i}.{n}.{e}.weight" for n in ("ffn_gate", "ffn_up", "ffn_down")
                             for e in range(cfg.n_experts)}
    missing = sorted(expected - set(g.tensors))
    extra = sorted(n for n in set(g.tensors) - expected if not any(s in n for s in _IGNORED_SUFFIXES))
    if missing:
        raise GGUFError(f"{g.path.name} lacks tensors {missing[:6]}{' ...' if len(missing) > 6 else ''}; "
                        f"is it a complete {cfg.name} model?")
    if extra:
        raise GGUFError(f"{g.path.name} has tensors cflow does not know how to use: {extra[:6]}; "
                        "converting would silently drop them")
    if layout == "merged":
        for i in range(cfg.n_layers):
            for n in ("ffn_gate", "ffn_up", "ffn_down"):
                shape = [int(x) for x in g.tensors[f"blk.{i}.{n}_exps.weight"].shape]
                if len(shape) != 3 or shape[2] != cfg.n_experts:
                    raise GGUFError(f"{g.path.name}: blk.{i}.{n}_exps.weight has shape {shape}; "
                                    f"{cfg.n_experts} experts ({g.architecture}.expert_count) need [inputs, outputs, "
                                    f"{cfg.n_experts}]")


def _check_rows(s: Source, rows: int) -> None:
    if s.rows != rows:
        raise GGUFError(f"{s.origin} has {s.rows} rows, the config implies {rows}")


def check_tensor_names(g: GGUFModel, expected: set[str], family: str) -> None:
    """The file holds exactly the tensors the conversion reads: one it lacks, or one cflow would
    drop, is refused by name."""
    missing, extra = sorted(expected - set(g.tensors)), sorted(set(g.tensors) - expected)
    if missing:
        raise GGUFError(f"{g.path.name} lacks tensors {missing[:6]}; is it a complete {family} model?")
    if extra:
        raise GGUFError(f"{g.path.name} has tensors cflow does not know how to use: {extra[:6]}; converting would "
                        "silently drop them")


def _check_shape(s: Source, shape: tuple[int, ...]) -> None:
    if (s.rows, s.cols) != tuple(shape):
        raise GGUFError(f"{s.origin} is [{s.rows}, {s.cols}] (outputs, inputs); the config implies "
                        f"{list(shape)}")


def convert_gguf(src: str | os.PathLike, dst: str | os.PathLike, *, quant: str = "q4_0",
                 tile: tuple[int, int] = TILE, order: str = "cflow", progress=None,
                 requantize: bool = True, sliding_window: int | None = None) -> ConversionResult:
    """Convert a llama / qwen2 / qwen3 / qwen2moe / qwen3moe / olmoe / gemma3 / mistral3 GGUF file into
    a .cflow/.vflow file.

    `quant` applies only to tensors that are not already Q4_0/Q4_1/Q8_0 (those stay bit-exact);
    requantize=False refuses tensors in other quantized formats (NotNativeError) instead.
    `progress`, if given, is passed to the writer (see cflow.fileformat.write_model).
    """
    t0 = time.perf_counter()
    check_quant(quant)
    g = GGUFModel(src)
    deepseek = g.architecture == "deepseek2"
    qwen35 = g.architecture in ("qwen35", "qwen35moe")
    if deepseek:
        from cflow.convert.gguf_deepseek2 import deepseek2_model_config

        cfg = deepseek2_model_config(g)
    elif qwen35:
        from cflow.convert.gguf_qwen35 import qwen35_config

        cfg = qwen35_config(g)
    else:
        cfg = gguf_config(g)
    if sliding_window is not None:  # the caller's choice over the file's (0: none, as llama.cpp runs it)
        if cfg.sliding_window_pattern:
            raise GGUFError(f"{g.path.name} alternates local and global layers ({g.architecture}); its window "
                            "is part of the model as llama.cpp runs it: convert it without a sliding window override")
        try:
            cfg = cfg.replace(sliding_window=int(sliding_window))
        except ConfigError as e:
            raise GGUFError(f"sliding window {sliding_window!r}: {e}") from None
    tok = gguf_tokenizer(g)
    Tokenizer(tok)  # fail now, not at load time, on a tokenizer the runtime cannot rebuild
    if len(tok["vocab"]) != cfg.vocab_size:
        raise GGUFError(f"{g.path.name}: the tokenizer has {len(tok['vocab'])} tokens but the "
                        f"embedding has {cfg.vocab_size} rows")
    enc = Encoder(quant, tile, requantize=requantize)
    source = {"format": "gguf", "file": g.path.name, "name": g.get("general.name"),
              "file_type": g.get("general.file_type"), "architecture": g.architecture,
              "family": cfg.name}
    if cfg.has_moe:
        source["expert_layout"] = "merged" if deepseek or qwen35 else moe_layout(g)
    window = g.get(f"{g.architecture}.attention.sliding_window")
    if window and not cfg.sliding_window:
        source["sliding_window_ignored"] = int(window)
    metadata = {"source": source,
                "converter": "cflow.convert.gguf"}
    if deepseek:
        from cflow.convert.gguf_deepseek2 import deepseek2_tensors

        tensors = deepseek2_tensors(g, cfg, enc)
    elif g.architecture == "gemma4":
        from cflow.convert.gguf_gemma4 import gemma4_tensors

        tensors = gemma4_tensors(g, cfg, enc)
    elif qwen35:
        from cflow.convert.gguf_qwen35 import qwen35_tensors

        tensors = qwen35_tensors(g, cfg, enc)
    else:
        tensors = gguf_tensors(g, cfg, enc)
    return write_conversion(src, dst, cfg, tok, tensors, enc, metadata, order=order, tile=tile,
                            progress=progress, started=t0)


__all__ = ["GGUFModel", "GGUFError", "GGUFTruncatedError", "UnsupportedArchitectureError", "SUPPORTED_ARCHITECTURES",
           "gguf_config", "gguf_tokenizer", "gguf_tensors", "moe_layout", "permute_qk_index",
           "unpermute_qk_index", "convert_gguf"]
