"""cflow.bench.quality: every model scores exactly the same bytes of each held-out story, whatever
its context, and a story that does not fit is an error, never a silent cut."""

from __future__ import annotations

import pytest

from cflow.bench.quality import cut_text, measure, score_text
from cflow.runtime import DEFAULT_MODEL, Engine

pytestmark = pytest.mark.skipif(not DEFAULT_MODEL.is_file(), reason="built-in model not installed")

STORIES = ["Once upon a time there was a little fox who loved the moon. Every night she climbed the hill "
           "to look at it, and one night the moon looked back and smiled. " * 4,
           "Tom had a red ball. He threw it high, and a bird caught it. \"Give it back!\" said Tom. "
           "The bird laughed and dropped it in the pond."]


def test_cut_text_keeps_whole_words_within_the_byte_limit():
    text = "héllo wörld " * 50
    for n in (7, 64, 101, 599, 10_000):
        cut = cut_text(text, n)
        assert len(cut.encode("utf-8")) <= n and text.startswith(cut)
        if n < len(text.encode("utf-8")):
            assert text[len(cut)] == " "  # cut at a space, not inside a word
    assert cut_text(text, 10_000) == text
    assert cut_text("unbroken", 3) == "unb"  # no space to cut at: the bytes that fit


def test_the_same_engine_as_model_and_teacher_scores_the_same_bits_per_byte():
    with Engine.load(threads=1) as eng:
        r = measure(eng, eng, STORIES, samples=2, sample_tokens=12, max_bytes=200)
    assert r.bytes == sum(len(cut_text(s, 200).encode("utf-8")) for s in STORIES)
    assert r.model_bpb == pytest.approx(r.teacher_bpb, rel=1e-12)
    assert r.max_bytes == 200 and r.samples == 2


def test_a_story_longer_than_the_context_is_an_error():
    with Engine.load(threads=1) as eng:
        with pytest.raises(ValueError, match="does not fit the context"):
            score_text(eng, "and then the fox ran on " * 400)
