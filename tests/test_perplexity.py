"""`cflow perplexity` and cflow.bench.perplexity.strided_perplexity: llama-perplexity's convention.

- On the built-in model, strided_perplexity equals an independent computation from Engine.step:
  windows of n_ctx tokens, each from position 0 with its first token replaced by BOS when asked,
  the tokens from position n_ctx/2 + 1 on scored; the error is llama.cpp's formula.
- The command prints the running PPL per window and llama-perplexity's last line with the same
  number; a text shorter than two windows is refused naming -c.
- With llama-cpp-python (marker oracle): cflow's number on SmolLM2 within 2% of one computed the
  same way from llama.cpp's logits (different kernels: not bit-equal).
"""

from __future__ import annotations

import math
import re
import subprocess
import sys

import numpy as np
import pytest

from cflow.bench.perplexity import strided_perplexity
from cflow.runtime import DEFAULT_MODEL, Engine, EngineError

needs_builtin = pytest.mark.skipif(not DEFAULT_MODEL.is_file(), reason="built-in model not installed")
TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play in the park with her dog. "
        "One day, the dog saw a big red ball under a tree. Lily laughed and ran after it. The sun was warm, "
        "the birds sang, and her mom called them home for cake. They ate it at the big table and then "
        "Lily read a book about a brave little fox who lived in the woods.")


def by_hand(step, ids: list[int], n_ctx: int, bos: int | None) -> tuple[float, float, int]:
    """(ppl, err, scored) from `step(token, pos) -> logits`, written out from llama-perplexity's loop."""
    nll, nll2, count = 0.0, 0.0, 0
    first = n_ctx // 2
    for c in range(len(ids) // n_ctx):
        w = ids[c * n_ctx:(c + 1) * n_ctx]
        if bos is not None:
            w = [bos] + w[1:]
        for pos in range(n_ctx - 1):
            x = step(w[pos], pos).astype(np.float64)
            if pos >= first:
                m = x.max()
                lp = x[w[pos + 1]] - m - math.log(np.exp(x - m).sum())
                nll -= lp
                nll2 += lp * lp
                count += 1
    mean = nll / count
    ppl = math.exp(mean)
    return ppl, math.sqrt((nll2 / count - mean * mean) / (count - 1)) * ppl, count


@pytest.fixture(scope="module")
def engine():
    if not DEFAULT_MODEL.is_file():
        pytest.skip("built-in model not installed")
    with Engine.load(threads=1, n_ctx=64) as eng:
        yield eng


@needs_builtin
@pytest.mark.parametrize("bos", [None, 1])
def test_strided_perplexity_equals_llama_perplexity_loop(engine, bos):
    ids = engine.encode(TEXT)
    n_ctx = 32
    assert len(ids) // n_ctx == 2
    running = []
    r = strided_perplexity(engine, ids, n_ctx, bos=bos, on_chunk=lambda i, p: running.append((i, p)))
    engine.reset()
    ppl, err, count = by_hand(engine.step, ids, n_ctx, bos)
    assert (r.chunks, r.n_tokens, r.n_ctx) == (2, count, n_ctx) and count == 2 * (n_ctx // 2 - 1)
    assert r.ppl == pytest.approx(ppl, rel=1e-9) and r.err == pytest.approx(err, rel=1e-6)
    assert [i for i, _ in running] == [0, 1] and running[-1][1] == r.ppl == r.running[-1]
    one = strided_perplexity(engine, ids, n_ctx, bos=bos, chunks=1)
    assert one.chunks == 1 and one.ppl == pytest.approx(r.running[0], rel=1e-12)
    with pytest.raises(EngineError, match="at least 128"):
        strided_perplexity(engine, ids, 64)


@needs_builtin
def test_perplexity_command(tmp_path, engine):
    text = tmp_path / "story.txt"
    text.write_text(TEXT)
    ids = engine.encode(TEXT)
    tok = engine.tokenizer
    want = strided_perplexity(engine, ids, 32, bos=tok.bos_id if tok.add_bos else None)
    r = subprocess.run([sys.executable, "-m", "cflow", "perplexity", "--file", str(text), "-c", "32", "-t", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert re.search(r"\[1\][0-9.]+,\[2\][0-9.]+,", r.stdout), r.stdout
    m = re.search(r"^Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)$", r.stdout, re.M)
    assert m and float(m.group(1)) == pytest.approx(want.ppl, abs=6e-5), r.stdout
    short = subprocess.run([sys.executable, "-m", "cflow", "perplexity", "--file", str(text), "-c", "64", "-t", "1"],
                           capture_output=True, text=True, timeout=300)
    assert short.returncode == 2 and "error: -c:" in short.stderr and "at least 128" in short.stderr, short.stderr
    missing = subprocess.run([sys.executable, "-m", "cflow", "perplexity", "--file", str(tmp_path / "nope.txt")],
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "cannot read" in missing.stderr


@pytest.mark.oracle
def test_perplexity_near_llama_cpp(smollm2_converted):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install "
                                                        "'llama-cpp-python>=0.3.16')")
    n_ctx = 64
    with Engine.load(smollm2_converted, threads=1, n_ctx=n_ctx) as eng:
        ids = eng.encode(TEXT * 2)
        tok = eng.tokenizer
        ours = strided_perplexity(eng, ids, n_ctx, bos=tok.bos_id if tok.add_bos else None)
    llm = llama_cpp.Llama(model_path=str(smollm2_converted), n_ctx=n_ctx, n_threads=1, logits_all=True, verbose=False)

    def step(t, pos):
        if pos == 0:
            llm.reset()
        llm.eval([t])
        return np.asarray(llm.scores[pos], np.float64)

    ppl, _, _ = by_hand(step, ids, n_ctx, tok.bos_id if tok.add_bos else None)
    assert ours.ppl == pytest.approx(ppl, rel=0.02)
