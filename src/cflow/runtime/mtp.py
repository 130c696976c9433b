"""Multi-token prediction heads at decode time: the numpy side of `--spec mtp`.

Owns `MtpHeads`: a model's multi-token prediction heads (config mtp_heads = N > 0, tensors
`mtp.{j}.*` of the .cflow file, docs/FORMAT.md) and the output matrix they share with the model,
and the computation of their logits from a final normed hidden state h (what the lm_head reads):

    logits_j = W_out @ norm_j(h + w_down_j silu(w_up_j h))      head j: the token 2+j after h's

the same function as cflow.model.MtpHead. The C core hands h back (Engine.hidden, the native
engine's keep_hidden buffer), so the decode step itself is untouched and its logits stay bit for
bit what they were; the heads are not part of the step. Why numpy and not C: a head is two d x d
mat-vecs and one V x d one (d = 192, V = 4096 in the trained family: ~0.1 ms), next to a decode
step of milliseconds. W_out (lm_head, or tok_emb when tied) is dequantized to float32 once, when
the heads are first asked for, and kept.

No torch here: the runtime imports this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from cflow import weights
from cflow.runtime.errors import EngineError

if TYPE_CHECKING:
    from cflow.fileformat import CflowFile


class NoMtpHeadsError(EngineError):
    """Multi-token prediction was asked of a model that has no such heads."""


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class MtpHeads:
    """The heads of one model file, float32: w_up, w_down [N, d, d], norm [N, d], out [V, d]."""

    def __init__(self, cf: "CflowFile") -> None:
        from cflow.convert.encoder import stored_values  # numpy only (no torch)

        cfg = cf.config
        if cfg.mtp_heads < 1:
            raise NoMtpHeadsError(
                f"{cf.path} has no multi-token prediction heads (its config has mtp_heads = 0), so it cannot "
                f"speculate with --spec mtp: train heads into the model with `cflow train --mtp N ...` and export "
                f"it again (`cflow export RUN OUT.cflow`), or use --spec ngram (no heads needed)", flag="--spec")

        def val(name: str) -> np.ndarray:
            return stored_values(cf, name)

        self.n, self.eps = cfg.mtp_heads, cfg.norm_eps
        self.w_up = np.stack([val(weights.mtp_name(j, "w_up")) for j in range(self.n)])  # [N, d, d]
        self.w_down = np.stack([val(weights.mtp_name(j, "w_down")) for j in range(self.n)])  # [N, d, d]
        self.norm = np.stack([val(weights.mtp_name(j, "norm")) for j in range(self.n)])  # [N, d]
        self.out = val("tok_emb" if cfg.tie_embeddings else "lm_head")  # [V, d]

    def inputs(self, h: np.ndarray) -> np.ndarray:
        """h [d] (a final normed hidden state) -> each head's normed lm_head input [N, d]."""
        h = np.asarray(h, np.float32)
        # batched mat-vecs through matmul: einsum on these small shapes costs ~10x more
        u = _silu(self.w_up @ h)  # [N, d]
        z = h[None, :] + (self.w_down @ u[:, :, None])[:, :, 0]
        # RMSNorm as the model's: statistics in float32
        return (z / np.sqrt(np.mean(z * z, axis=-1, keepdims=True) + self.eps) * self.norm).astype(np.float32)

    def logits(self, h: np.ndarray) -> np.ndarray:
        """h [d] -> the heads' logits [N, V]: row j for the token 2+j after the one h predicts."""
        # one mat-vec per head: [N, d] @ out.T runs ~6x slower in numpy than N separate [V, d] @ [d]
        return np.stack([self.out @ x for x in self.inputs(h)])
