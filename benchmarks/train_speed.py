"""Training throughput of a family preset against this machine's measured fp32 matmul peak.

The peak: torch's own fp32 matmul on square 1024-2048 matrices at the same thread count (the best of
a few repetitions, the kernel at its most efficient). The step: the training loop's own pieces
(cflow.train.loop.compute_loss, AdamW as make_optimizer builds it, gradient clipping) on random
tokens, timed over --steps after --warmup. The work: 6 x the active parameters that multiply
activations (every matrix but the embedding lookup: forward 2, backward 4 FLOPs per weight and
token) plus attention's scores and values (causal: half of T x T per head, 12 FLOPs per element
over forward and backward).

    python benchmarks/train_speed.py --preset arch4-s --threads 1 2

Prints one JSON object per thread count: tok/s, model GFLOP/s, the matmul peak, the fraction, and
the share of step time the top profiled operators take (with --profile).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def matmul_peak(threads: int, reps: int = 5) -> float:
    import torch

    torch.set_num_threads(threads)
    best = 0.0
    for n in (1024, 2048):
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        for _ in range(reps):
            t = time.perf_counter()
            a @ b
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t) / 1e9)
    return best


def flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs per token: 6 per active matrix weight (forward 2, backward 4), plus causal
    attention's scores and values (2 x head_dim MACs per head and visible key, half the window)."""
    d, L = cfg.d_model, cfg.n_layers
    attn = d * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * d
    dense = 3 * d * cfg.d_ff if cfg.has_dense else 0
    moe = (d * cfg.n_experts + cfg.top_k * 3 * d * cfg.d_expert) if cfg.has_moe else 0
    macs = L * (attn + dense + moe) + d * cfg.vocab_size  # the lm_head too
    attn_macs = L * cfg.n_heads * 2 * cfg.head_dim * seq_len / 2
    return 6.0 * (macs + attn_macs)


def step_speed(preset: str, threads: int, steps: int, warmup: int, batch: int, seq_len: int,
               profile: bool, bf16: bool = False) -> dict:
    import torch

    from cflow.config import ModelConfig
    from cflow.model import Transformer
    from cflow.train.loop import TrainConfig, compute_loss, make_optimizer

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = ModelConfig.from_name(preset)
    model = Transformer(cfg)
    tc = TrainConfig(batch_size=batch, seq_len=seq_len)
    opt = make_optimizer(model, tc)
    gen = torch.Generator().manual_seed(1)

    def step() -> None:
        xy = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=gen)
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, *_ = compute_loss(model, xy[:, :-1], xy[:, 1:], tc)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()

    for _ in range(warmup):
        step()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    dt = time.perf_counter() - t
    tok_s = steps * batch * seq_len / dt
    out = {"preset": preset, "threads": threads, "precision": "bf16 autocast" if bf16 else "fp32",
           "tok_per_s": round(tok_s, 1),
           "model_gflop_per_token": round(flops_per_token(cfg, seq_len) / 1e9, 5)}
    out["model_gflops"] = round(tok_s * flops_per_token(cfg, seq_len) / 1e9, 1)
    if profile:
        from torch.profiler import ProfilerActivity, profile as tprofile

        with tprofile(activities=[ProfilerActivity.CPU]) as p:
            step()
        total = sum(e.self_cpu_time_total for e in p.key_averages())
        top = sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
        out["profile_share"] = {e.key: round(e.self_cpu_time_total / total, 3) for e in top}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="arch4-s")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--profile", action="store_true", help="also the top operators' share of one step")
    ap.add_argument("--bf16", action="store_true",
                    help="also time the step in CPU bf16 autocast (matmuls in bf16, master weights fp32), "
                    "alternating with fp32; the peak stays fp32's, so its fraction can exceed 1")
    a = ap.parse_args(argv)
    for n in a.threads:
        peak = round(matmul_peak(n), 1)
        for bf16 in ((False, True) if a.bf16 else (False,)):
            r = step_speed(a.preset, n, a.steps, a.warmup, a.batch_size, a.seq_len, a.profile, bf16)
            r["matmul_peak_gflops"] = peak
            r["fraction_of_peak"] = round(r["model_gflops"] / peak, 3)
            print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
