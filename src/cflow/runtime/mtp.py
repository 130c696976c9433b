"""Multi-token prediction heads at decode time: the numpy side of `--spec mtp`.

Owns `MtpHeads`: a model's multi-token prediction heads (config mtp_heads = N > 0, tensors
`mtp.{j}.*` of the .cflow file, docs/FORMAT.md) and the computation of their logits from a final
normed hidden state h (what the lm_head reads):

    logits_j = W_out @ norm_j(h + w_down_j silu(w_up_j h))      head j: the token 2+j after h's

the same function as cflow.model.MtpHead. The C core hands h back (Engine.hidden, the native
engine's keep_hidden buffer), so the decode step itself is untouched and its logits stay bit for
bit what they were; the heads are not part of the step. A head's residual MLP (two d x d mat-vecs)
runs here in numpy; the product with W_out (V x d, the larger part: 4096 x 192 in the trained
family) runs through the engine's own lm_head kernel when an engine is given (`lm_head`, the
native cf_engine_lm_head: the quantized matrix the decode step reads; for the family's 3 heads
~50 us against numpy's ~155 us), else against W_out dequantized to float32 (the reference, loaded
on first use).

No torch here: the runtime imports this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from cflow import weights
from cflow.runtime.errors import EngineError

if TYPE_CHECKING:
    from cflow.fileformat import CflowFile


class NoMtpHeadsError(EngineError):
    """Multi-token prediction was asked of a model that has no such heads."""


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def recorded_chain(meta: object, n: int) -> list[float] | None:
    """The chained agreement `cflow train heads` recorded in the file (metadata["mtp"]["val_chain"]:
    the share of held-out positions where heads 0..j all agreed with the model's own next choices),
    one rate per head; None when the file records none (heads trained with the model), or not
    n rates in [0, 1]."""
    chain = meta.get("val_chain") if isinstance(meta, dict) else None
    if not isinstance(chain, list) or len(chain) != n:
        return None
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0.0 <= x <= 1.0 for x in chain):
        return None
    return [float(x) for x in chain]


class MtpHeads:
    """The heads of one model file, float32: w_up, w_down [N, d, d], norm [N, d]; `lm_head(x, out)`
    (the native engine's) writes W_out's logits of the rows x [N, d] into out [N, V]; None: the
    numpy product with W_out dequantized (`out`, [V, d], read on first use). `chain`: their
    recorded chained agreement (recorded_chain), or None."""

    def __init__(self, cf: "CflowFile", lm_head: Callable[[np.ndarray, np.ndarray], None] | None = None) -> None:
        from cflow.convert.encoder import stored_values  # numpy only (no torch)

        cfg = cf.config
        if cfg.mtp_heads < 1:
            raise NoMtpHeadsError(
                f"{cf.path} has no multi-token prediction heads (its config has mtp_heads = 0), so it cannot "
                f"speculate with --spec mtp: add heads to it with `cflow train heads {cf.path} --out NEW.cflow`, or "
                f"train them with the model (`cflow train --mtp N ...`, then `cflow export`), or use --spec ngram "
                f"(no heads needed)", flag="--spec")

        def val(name: str) -> np.ndarray:
            return stored_values(cf, name)

        self.n, self.eps = cfg.mtp_heads, cfg.norm_eps
        self.w_up = np.stack([val(weights.mtp_name(j, "w_up")) for j in range(self.n)])  # [N, d, d]
        self.w_down = np.stack([val(weights.mtp_name(j, "w_down")) for j in range(self.n)])  # [N, d, d]
        self.norm = np.stack([val(weights.mtp_name(j, "norm")) for j in range(self.n)])  # [N, d]
        self._out_name = "tok_emb" if cfg.tie_embeddings else "lm_head"
        self._cf, self._lm_head = cf, lm_head
        self._logits = np.zeros((self.n, cfg.vocab_size), np.float32)
        self.chain = recorded_chain(cf.header.get("metadata", {}).get("mtp"), self.n)

    @property
    def out(self) -> np.ndarray:
        """W_out dequantized to float32 [V, d] (read once, when first asked for)."""
        w = self.__dict__.get("_out")
        if w is None:
            from cflow.convert.encoder import stored_values  # numpy only (no torch)

            w = self.__dict__["_out"] = stored_values(self._cf, self._out_name)
        return w

    def inputs(self, h: np.ndarray) -> np.ndarray:
        """h [d] (a final normed hidden state) -> each head's normed lm_head input [N, d]."""
        h = np.asarray(h, np.float32)
        # batched mat-vecs through matmul: einsum on these small shapes costs ~10x more
        u = _silu(self.w_up @ h)  # [N, d]
        z = h[None, :] + (self.w_down @ u[:, :, None])[:, :, 0]
        # RMSNorm as the model's: statistics in float32
        return (z / np.sqrt(np.mean(z * z, axis=-1, keepdims=True) + self.eps) * self.norm).astype(np.float32)

    def logits(self, h: np.ndarray) -> np.ndarray:
        """h [d] -> the heads' logits [N, V]: row j for the token 2+j after the one h predicts. With
        the engine's lm_head the array is reused by the next call: copy what you keep."""
        x = self.inputs(h)
        if self._lm_head is not None:
            self._lm_head(x, self._logits)
            return self._logits
        # one mat-vec per head: [N, d] @ out.T runs ~6x slower in numpy than N separate [V, d] @ [d]
        return np.stack([self.out @ row for row in x])
