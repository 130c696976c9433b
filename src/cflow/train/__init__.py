"""Training the pipeline-native family (PyTorch): data, tokenizer, loop, checkpoints, comparison.

- `data`: corpus sources, the split by document hash, the token cache, the resumable batch sampler.
- `bpe`: byte-level BPE tokenizer training with HF `tokenizers`.
- `vocab`: a borrowed vocabulary (`--tokenizer` GGUF / tokenizer.json) instead of a trained BPE.
- `loop`: `TrainConfig` and `train()` (AdamW, warmup + cosine, MoE aux losses, eval, DDP, resume).
- `checkpoint`: the checkpoint directory of docs/DESIGN.md, written atomically.
- `stats`: the 95% t interval of a mean over seeds (no torch; claim T1 uses it too).
- `compare`: train the presets on one budget and write OUT/train_compare.md (the family table: docs/results/family/).

Importing this package does not import torch; `loop`, `checkpoint` and `compare` do.
"""

from __future__ import annotations

__all__ = ["TrainConfig", "train", "load_checkpoint", "compare"]


def __getattr__(name: str):
    if name in ("TrainConfig", "train"):
        from cflow.train import loop

        return getattr(loop, name)
    if name == "load_checkpoint":
        from cflow.train.checkpoint import load_checkpoint

        return load_checkpoint
    if name == "compare":
        from cflow.train.compare import compare

        return compare
    raise AttributeError(f"module 'cflow.train' has no attribute {name!r}")
