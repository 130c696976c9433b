"""Multi-token prediction heads onto a trained model, its weights frozen: `cflow train heads`.

    cflow train heads model.cflow --mtp 3 --out model-mtp.cflow

Owns head self-distillation, in three steps:
1. collect: the C engine, on the file's own quantized weights, continues openings greedily, many
   sequences per pass (Engine.step_batch), and keeps each step's final normed hidden state h
   (Engine.hidden) beside the token its logits chose: exactly the pairs (h, what follows) that
   `--spec mtp` meets at decode time. The openings are the first tokens of the corpus's documents
   (a base model's text), or with `chat` story requests through the model's chat template (an
   instruct model's text is answers);
2. train: head j (cflow.model.MtpHead) learns the token j+1 after the one h chose, through the
   model's output matrix (dequantized, frozen): cross-entropy against the model's own choices, as
   Medusa-2 and EAGLE train their heads on the target's outputs;
3. write: a new .cflow with every tensor of the source byte for byte, the heads added (f32,
   docs/FORMAT.md), mtp_heads set in its config and the recipe in its metadata.

Why the model's own continuations and not the corpus: a proposal is kept when it equals the
model's greedy choice, not the text's next token, and a small model's continuation follows the
text only a third of the time. Heads trained with the trunk on the corpus (`cflow train --mtp N`)
learn the corpus; these learn the model (docs/results/speculative.md has both measured).

The source's weights are not touched, so its outputs are bit for bit what they were; only the
proposals change. The heads read the hidden states the engine hands back, so they are trained for
the quantization they run with.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from cflow import weights
from cflow.errors import CflowError


EVAL_CHUNK = 1024  # held-out positions scored at once
CHAT_VAL_SEED = 1_000_000_000  # --chat: held-out story requests start here (training ones at --seed)


class HeadsError(CflowError):
    """Head training was asked something it cannot do (a bad source, output or setting)."""


@dataclass(frozen=True)
class HeadsConfig:
    n_heads: int = 3  # heads to train: tokens 2..n_heads+1 after a hidden state's position
    tokens: int = 1_000_000  # continuation tokens collected for training
    val_tokens: int = 50_000  # ... and from held-out documents, for the report
    continuation: int = 192  # greedy tokens per opening (fewer when the model ends its text)
    prompt_min: int = 4  # an opening: the first n tokens of a document, n drawn in [min, max]
    prompt_max: int = 48
    chat: bool = False  # open with story requests through the chat template (instruct models), not documents
    n_seq: int = 32  # sequences continued together (one engine pass for all)
    steps: int = 3000
    batch_size: int = 512  # positions per step (every head sees the same ones)
    lr: float = 3e-3  # AdamW, linear warmup then cosine to 10%
    warmup: int = 100  # at most a tenth of the steps
    seed: int = 1
    threads: int | None = None  # engine and torch threads; None: every usable core

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise HeadsError(what)

        need(self.n_heads >= 1, f"--mtp must be >= 1, got {self.n_heads}")
        need(self.tokens >= 1000, f"--tokens must be >= 1000, got {self.tokens}")
        need(self.val_tokens >= 100, f"val_tokens must be >= 100, got {self.val_tokens}")
        need(self.continuation > self.n_heads + 1,
             f"continuation ({self.continuation}) must exceed --mtp + 1 ({self.n_heads + 1})")
        need(1 <= self.prompt_min <= self.prompt_max, f"prompt lengths must satisfy 1 <= min <= max, got "
             f"{self.prompt_min}, {self.prompt_max}")
        need(self.n_seq >= 1 and self.steps >= 1 and self.batch_size >= 1, "n_seq, --steps and --batch-size must be >= 1")
        need(self.lr > 0 and self.warmup >= 0, f"need lr > 0 and warmup >= 0, got {self.lr}, {self.warmup}")


@dataclass
class Continuations:
    """Greedy continuations, concatenated: h[i] [d] is the hidden state whose logits chose tokens[i];
    `lengths` are the continuations' lengths in order (a position's followers are in its own)."""

    h: np.ndarray  # float32 [n, d]
    tokens: np.ndarray  # int64 [n]
    lengths: np.ndarray  # int64 [m]

    def positions(self, ahead: int) -> np.ndarray:
        """The positions i whose continuation holds the token `ahead` after tokens[i]."""
        starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
        return np.concatenate([np.arange(s, s + n - ahead) for s, n in zip(starts, self.lengths) if n > ahead]
                              or [np.zeros(0, np.int64)])


@dataclass
class HeadsResult:
    path: str
    n_heads: int
    train_tokens: int
    val_tokens: int
    steps: int
    val_top1: list[float]  # head j's greedy agreement on held-out continuations
    val_chain: list[float]  # the fraction of positions where heads 0..j all agree
    collect_s: float
    train_s: float

    @property
    def accepted_per_round(self) -> float:
        """Proposals a greedy round keeps on average when it proposes every head's token."""
        return float(sum(self.val_chain))


# ---- 1. collect ----------------------------------------------------------------------------------
def document_openings(eng: Any, docs: Sequence[str], hc: HeadsConfig, rng: np.random.Generator) -> Iterator[list[int]]:
    """The first n tokens of each document in turn (cycling), n drawn in [prompt_min, prompt_max]."""
    if not docs:
        raise HeadsError("no documents to open continuations from; give a corpus with text in it (--data)")
    for i in itertools.count():
        ids = eng.encode(docs[i % len(docs)])[:int(rng.integers(hc.prompt_min, hc.prompt_max + 1))]
        yield ids or [eng.tokenizer.eos_id or 0]


def chat_openings(eng: Any, first_seed: int) -> Iterator[list[int]]:
    """Story requests through the model's chat template: the prompts the story corpus was written
    from (cflow.corpus.recipe), seeds first_seed, first_seed + 1, ... (for instruct models, whose
    text is answers)."""
    from cflow.corpus.recipe import prompt_for

    for seed in itertools.count(first_seed):
        yield eng.chat_tokens([{"role": "user", "content": prompt_for(seed).text}])


def collect(eng: Any, openings: Iterator[list[int]], tokens: int, hc: HeadsConfig, progress: bool = False,
            desc: str = "collect") -> Continuations:
    """Greedy continuations of `openings` (token ids) until `tokens` are kept, min(eng.n_seq,
    hc.n_seq) at a time; leaves every sequence of `eng` empty and keep_hidden off."""
    stop = eng.tokenizer.stop_ids
    hs: list[np.ndarray] = []
    toks: list[np.ndarray] = []
    lengths: list[int] = []
    total = 0
    bar = _bar(progress, tokens, desc, "tok")
    eng.keep_hidden = True
    try:
        while total < tokens:
            s_n = min(eng.n_seq, hc.n_seq)
            pos, last, seq_h, seq_t = [], [], [], []
            for s in range(s_n):
                ids = next(openings)[:eng.n_ctx - 2]
                eng.reset(s)
                logits = eng.prefill(ids, 0, seq=s)
                seq_h.append([eng.hidden()[-1].copy()])
                seq_t.append([int(np.argmax(logits))])
                pos.append(len(ids))
                last.append(seq_t[-1][0])
            live = [s for s in range(s_n) if last[s] not in stop]
            while live:
                logits = eng.step_batch(live, [last[s] for s in live], [pos[s] for s in live])
                hidden = eng.hidden()
                nxt = []
                for r, s in enumerate(live):
                    t = int(np.argmax(logits[r]))
                    seq_h[s].append(hidden[r].copy())
                    seq_t[s].append(t)
                    last[s], pos[s] = t, pos[s] + 1
                    if t not in stop and len(seq_t[s]) < hc.continuation and pos[s] < eng.n_ctx:
                        nxt.append(s)
                live = nxt
            for s in range(s_n):
                n = min(len(seq_t[s]), tokens - total)
                if n < 2:
                    continue
                hs.append(np.array(seq_h[s][:n], np.float32))
                toks.append(np.array(seq_t[s][:n], np.int64))
                lengths.append(n)
                total += n
                if bar is not None:
                    bar.update(n)
                if total >= tokens:
                    break
    finally:
        eng.keep_hidden = False
        for s in range(eng.n_seq):
            eng.reset(s)
        if bar is not None:
            bar.close()
    return Continuations(np.concatenate(hs), np.concatenate(toks), np.array(lengths, np.int64))


# ---- 2. train ------------------------------------------------------------------------------------
def train_heads(w_out: np.ndarray, train: Continuations, val: Continuations, hc: HeadsConfig,
                eps: float, progress: bool = False) -> tuple[list[dict[str, np.ndarray]], list[float], list[float]]:
    """Heads fitted to `train` through the frozen output matrix w_out [V, d]. Returns each head's
    tensors (w_up, w_down, norm as float32 arrays), and on `val` each head's top-1 agreement and
    the chained agreement (heads 0..j all right)."""
    import torch
    import torch.nn.functional as F

    from cflow.model import MtpHead
    from cflow.train.loop import TrainConfig, warmup_cosine

    n, d = hc.n_heads, w_out.shape[1]
    pos_train = train.positions(n)  # every head has its target at these
    if len(pos_train) < hc.batch_size:
        raise HeadsError(f"{len(pos_train)} training positions for {n} heads; collect more (--tokens)")
    torch.manual_seed(hc.seed)
    rng = np.random.default_rng(hc.seed)
    w = torch.from_numpy(np.ascontiguousarray(w_out, np.float32))
    h_all = torch.from_numpy(train.h)
    t_all = torch.from_numpy(train.tokens)
    heads = torch.nn.ModuleList(MtpHead(d, eps) for _ in range(n))
    # init as cflow.model.Transformer.reset_parameters' heads but with n (the heads) where it has
    # n_layers: w_down small, so a fresh head starts near a copy of the next-token prediction
    with torch.no_grad():
        for head in heads:
            head.w_up.weight.normal_(0.0, 0.02)
            head.w_down.weight.normal_(0.0, 0.02 / math.sqrt(2 * n))
    opt = torch.optim.AdamW(heads.parameters(), lr=hc.lr, weight_decay=0.0)
    warmup = min(hc.warmup, hc.steps // 10)
    bar = _bar(progress, hc.steps, "train heads", "step")
    try:
        for step in range(hc.steps):
            for g in opt.param_groups:
                # the cosine ends at the trainer's default share of lr
                g["lr"] = warmup_cosine(step, hc.lr, warmup, hc.steps, TrainConfig.min_lr_ratio)
            idx = torch.from_numpy(rng.choice(pos_train, hc.batch_size))
            x = h_all[idx]
            loss = sum(F.cross_entropy(head(x) @ w.T, t_all[idx + 1 + j]) for j, head in enumerate(heads)) / n
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if bar is not None:
                bar.update(1)
                if step % 50 == 0:
                    bar.set_postfix(loss=f"{loss.item():.3f}")
    finally:
        if bar is not None:
            bar.close()
    top1, chain = evaluate(heads, w, val, n)
    out = [{"w_up": head.w_up.weight.detach().numpy().copy(), "w_down": head.w_down.weight.detach().numpy().copy(),
            "norm": head.norm.weight.detach().numpy().copy()} for head in heads]
    return out, top1, chain


def evaluate(heads: Any, w: Any, val: Continuations, n: int) -> tuple[list[float], list[float]]:
    """Each head's top-1 agreement with the model's own next choices on `val`, and the chained one."""
    import torch

    pos = torch.from_numpy(val.positions(n))
    if len(pos) == 0:
        raise HeadsError("the held-out continuations are too short to evaluate the heads; collect more")
    tokens = torch.from_numpy(val.tokens)
    right = torch.zeros((n, len(pos)), dtype=torch.bool)
    with torch.no_grad():
        for c in range(0, len(pos), EVAL_CHUNK):  # [chunk, V] logits at a time: V is 49,152 for SmolLM2
            p = pos[c:c + EVAL_CHUNK]
            x = torch.from_numpy(val.h)[p]
            for j, head in enumerate(heads):
                right[j, c:c + len(p)] = (head(x) @ w.T).argmax(-1) == tokens[p + 1 + j]
    chained = torch.cumprod(right.to(torch.int64), dim=0).to(torch.float64)
    return right.to(torch.float64).mean(1).tolist(), chained.mean(1).tolist()


# ---- 3. write ------------------------------------------------------------------------------------
def write_with_heads(src: Any, dst: str | os.PathLike, heads: list[dict[str, np.ndarray]], metadata: dict) -> None:
    """`src` (an open CflowFile) again at `dst`, its tensors byte for byte, with `heads` as its
    multi-token prediction heads (replacing any it had)."""
    from cflow.convert.encoder import Encoder
    from cflow.fileformat import TensorData, write_model

    cfg = dataclasses.replace(src.config, mtp_heads=len(heads))
    kept = [TensorData(e.name, e.dtype, e.shape, e.layout, src.array(e.name), e.meta)
            for e in src.tensors.values() if not e.name.startswith("mtp.")]
    enc = Encoder("q4_0", tuple(src.header["quant"]["tile"]))  # heads are f32 vectors whatever the quant
    added = [enc.vector(weights.mtp_name(j, slot), head[slot]) for j, head in enumerate(heads)
             for slot in weights.MTP_SLOTS]
    meta = {**src.header.get("metadata", {}), "mtp": metadata}
    write_model(dst, config=cfg, tokenizer=src.header["tokenizer"], tensors=kept + added,
                order=src.header.get("order", "cflow"), tile=tuple(src.header["quant"]["tile"]), metadata=meta)


# ---- all three -----------------------------------------------------------------------------------
def train_model_heads(model: str | os.PathLike, out: str | os.PathLike, hc: HeadsConfig, *, data: str | None = None,
                      overwrite: bool = False, progress: bool = False, command: str | None = None) -> HeadsResult:
    """Collect, train and write (the module's docstring); `data`: cflow.train.data.open_corpus's source."""
    from cflow.fileformat import open_model

    model, out = Path(model), Path(out)
    if importlib.util.find_spec("torch") is None:  # found now, not after minutes of collecting
        raise HeadsError("training heads needs PyTorch, which the runtime does not install: pip install 'cflow[train]'")
    if hc.chat and data is not None:
        raise HeadsError("--chat opens the continuations with story requests, not documents: drop --data")
    if not model.is_file():
        raise HeadsError(f"{model} is not a file; give the .cflow model to add heads to")
    if out.exists() and out.resolve() == model.resolve():
        raise HeadsError(f"--out {out} is the source model itself; write the model with heads to a new file")
    if out.is_dir():
        raise HeadsError(f"--out {out} is a directory; give the new model's file name, e.g. {out / 'model-mtp.cflow'}")
    if out.exists() and not overwrite:
        raise HeadsError(f"{out} exists; pass --overwrite to replace it, or choose another --out")
    if not out.parent.is_dir():
        raise HeadsError(f"--out {out}: the folder {out.parent} does not exist; create it or choose another --out")
    try:
        src = open_model(model)
    except CflowError as e:
        raise HeadsError(f"{model} is not a .cflow model ({e}); convert it first (`cflow convert`) or give the "
                         "family model the heads are for") from None
    try:
        return _train_and_write(src, model, out, hc, data, progress, command)
    finally:
        src.close()


def _train_and_write(src: Any, model: Path, out: Path, hc: HeadsConfig, data: str | None, progress: bool,
                     command: str | None) -> HeadsResult:
    from cflow.convert.encoder import stored_values
    from cflow.runtime import Engine
    from cflow.runtime.options import EngineOptions
    from cflow.train.data import open_corpus, split_documents

    cfg = src.config
    # a chat opening is a story request in the template (~60-90 tokens for SmolLM2's)
    opening = 160 if hc.chat else hc.prompt_max
    opts = EngineOptions(threads=hc.threads, n_seq=hc.n_seq, n_ctx=min(cfg.max_seq_len, opening + hc.continuation))
    rng = np.random.default_rng(hc.seed)
    t0 = time.perf_counter()
    with Engine.load(model, opts) as eng:
        if hc.chat:  # held-out requests: seeds far from the training ones
            val_open, train_open = chat_openings(eng, CHAT_VAL_SEED + hc.seed), chat_openings(eng, hc.seed)
        else:
            train_docs, val_docs = split_documents(open_corpus(data).documents())
            val_open = document_openings(eng, val_docs or train_docs, hc, rng)
            train_open = document_openings(eng, train_docs, hc, rng)
        val = collect(eng, val_open, hc.val_tokens, hc, progress, "collect (held out)")
        train = collect(eng, train_open, hc.tokens, hc, progress, "collect (training)")
    collect_s = time.perf_counter() - t0
    w_out = stored_values(src, "tok_emb" if cfg.tie_embeddings else "lm_head")
    t1 = time.perf_counter()
    import torch

    threads = torch.get_num_threads()
    if hc.threads:
        torch.set_num_threads(hc.threads)
    try:
        heads, top1, chain = train_heads(w_out, train, val, hc, cfg.norm_eps, progress)
    finally:
        torch.set_num_threads(threads)
    train_s = time.perf_counter() - t1
    res = HeadsResult(str(out), hc.n_heads, len(train.tokens), len(val.tokens), hc.steps,
                      [round(x, 4) for x in top1], [round(x, 4) for x in chain], round(collect_s, 1), round(train_s, 1))
    meta = {"method": "self-distillation on the model's greedy continuations (cflow train heads)",
            "source": model.name, "config": dataclasses.asdict(hc), "train_tokens": res.train_tokens,
            "val_tokens": res.val_tokens, "val_top1": res.val_top1, "val_chain": res.val_chain,
            "accepted_per_round": round(res.accepted_per_round, 4)}
    if command:
        meta["command"] = command
    write_with_heads(src, out, heads, meta)
    return res


def _bar(progress: bool, total: int, desc: str, unit: str) -> Any:
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=False)
