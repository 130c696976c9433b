"""EleutherAI's lm-eval against a live `cflow serve` (slow; skipped without lm-eval: pip install
"cflow-lm[eval]").

The test writes a small multiple-choice task (a local task YAML over a local JSON Lines file) and
runs it through lm-eval's `local-completions` model, which tokenizes through the server's
/tokenize (its remote tokenizer backend, picked by itself) and scores each choice with echo +
logprobs on /v1/completions. Every per-choice loglikelihood lm-eval reports equals the Python API's
(Engine.score of the same tokens, summed over the continuation: 1e-9), and so does the accuracy;
with llama-cpp-python installed, the loglikelihoods are also within tolerance of llama.cpp's on the
same GGUF (different kernels: close, not equal; measured on these items: at most 0.37 nats per
token and 0.59 per choice apart, 0.13 per token on average, mostly on very unlikely choices), and
both pick the same choice for every item.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install 'cflow-lm[eval]'")
pytest.importorskip("starlette", reason="the serve extra is not installed: pip install 'cflow-lm[serve]'")

from cflow.runtime import Engine  # noqa: E402

ITEMS = [
    ("The capital of France is", ["Paris", "a banana", "the moon", "blue"], 0),
    ("Two plus two equals", ["four", "green", "Tuesday", "a horse"], 0),
    ("The sun rises in the", ["east", "fridge", "sock", "piano"], 0),
    ("Water freezes at zero degrees", ["Celsius", "elephant", "guitar", "yesterday"], 0),
    ("The opposite of hot is", ["cold", "chair", "seven", "window"], 0),
    ("A baby cat is called a", ["kitten", "lamp", "river", "spoon"], 0),
    ("The color of grass is", ["green", "loud", "square", "Friday"], 0),
    ("Bees make", ["honey", "bricks", "engines", "clouds"], 0),
]
TASK = """\
task: cflow_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def pair(eng: Engine, context: str, continuation: str) -> tuple[list[int], int]:
    """lm-eval's _encode_pair (trailing spaces of the context move to the continuation; both encoded
    without special tokens, as its remote tokenizer asks the server): (the ids, the context's length)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = eng.encode(context + continuation, add_bos=False)
    return whole, len(eng.encode(context, add_bos=False))


def llama_cpp_loglik(llm, ids: list[int], ctxlen: int) -> float:
    """log p(ids[ctxlen:] | ids[:ctxlen]) from llama.cpp's logits (a llama_cpp.Llama with logits_all)."""
    llm.reset()
    llm.eval(ids)
    total = 0.0
    for pos in range(ctxlen - 1, len(ids) - 1):
        x = np.asarray(llm.scores[pos], np.float64)
        m = x.max()
        total += x[ids[pos + 1]] - m - math.log(np.exp(x - m).sum())
    return total


def test_lm_eval_loglikelihoods_equal_the_python_api(tmp_path, smollm2_converted, monkeypatch):
    from test_serve import Live

    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in ITEMS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "cflow_mc.yaml").write_text(TASK.format(data=data))
    for var in ("HF_HOME", "HF_DATASETS_CACHE"):  # lm-eval's datasets write their cache there
        monkeypatch.setenv(var, str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    live = Live("-m", str(smollm2_converted), "-a", "smollm2", "-np", "2", "-c", "1024", "-t", "1")
    try:
        out = simple_evaluate(model="local-completions",
                              model_args=f"base_url={live.url}/v1/completions,model=smollm2,num_concurrent=2,"
                                         f"max_retries=1",
                              tasks=["cflow_mc"], task_manager=TaskManager(include_path=str(tasks)),
                              log_samples=True)
    finally:
        live.stop()
    samples = sorted(out["samples"]["cflow_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(ITEMS)
    hits = []
    with Engine.load(smollm2_converted, threads=1, n_ctx=256) as eng:
        refs = []
        for s, (question, choices, answer) in zip(samples, ITEMS):
            assert s["doc"]["question"] == question
            got = [r[0][0] for r in s["resps"]]
            want = []
            for (context, continuation), choice in zip(s["arguments"], choices):
                assert continuation.strip() == choice
                ids, ctxlen = pair(eng, context, continuation)
                want.append(eng.score(ids).total(ctxlen))
                refs.append((ids, ctxlen, want[-1]))
            assert got == pytest.approx(want, abs=1e-9), (question, got, want)
            hits.append(int(np.argmax(want)) == answer)
    assert out["results"]["cflow_mc"]["acc,none"] == pytest.approx(sum(hits) / len(hits), abs=1e-12)
    try:
        import llama_cpp
    except ImportError:
        return  # llama.cpp's side is optional (pip install "llama-cpp-python>=0.3.16")
    llm = llama_cpp.Llama(model_path=str(smollm2_converted), n_ctx=256, n_threads=1, logits_all=True, verbose=False)
    theirs = [llama_cpp_loglik(llm, ids, ctxlen) for ids, ctxlen, _ in refs]
    for (ids, ctxlen, ours), t in zip(refs, theirs):
        assert abs(ours - t) <= 0.2 + 0.3 * (len(ids) - ctxlen), (ids, ours, t)  # a wrong token or offset: nats
    per_item = len(ITEMS[0][1])
    for i in range(len(ITEMS)):
        mine = [r[2] for r in refs[i * per_item:(i + 1) * per_item]]
        assert int(np.argmax(mine)) == int(np.argmax(theirs[i * per_item:(i + 1) * per_item])), ITEMS[i]
