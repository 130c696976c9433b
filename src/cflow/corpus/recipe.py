"""The TinyStories recipe: what one story's prompt asks for, drawn from a seed.

A prompt asks a chat model for a short story for a small child that uses a verb, a noun and an
adjective a 3-year-old knows, plus, most of the time, a feature (dialogue, a lesson, a twist, a
happy or sad ending, a problem solved). The words come from the lists shipped beside this module
(`words/*.txt`, one word a line); the choice is a function of the seed alone, so a seed names its
prompt, and a corpus can be regenerated or continued without repeating one.

`clean_story` is the one rule that turns a teacher's raw answer into a training document: an
answer cut at the token limit loses its unfinished last sentence, and what is left must be long
enough to be a story.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import numpy as np

PROMPT = ("Write a short story for a small child, using only simple words a 3-year-old knows. "
          'Use the verb "{verb}", the noun "{noun}" and the adjective "{adjective}". {feature}')
FEATURES = (
    "",
    "The story should contain some dialogue.",
    "The story should teach a simple lesson.",
    "The story should have a surprising twist.",
    "The story should have a happy ending.",
    "The story should have a sad ending.",
    "The story should include a problem that gets solved.",
)
MIN_STORY_CHARS = 200  # shorter answers are refusals, titles or fragments, not stories
_SENTENCE_END = re.compile(r"""[.!?]["'”’)]*(?=\s|$)""")


@lru_cache(maxsize=None)
def words(kind: str) -> tuple[str, ...]:
    """The shipped word list `kind` ("verbs", "nouns" or "adjectives")."""
    text = (resources.files("cflow.corpus") / "words" / f"{kind}.txt").read_text(encoding="utf-8")
    return tuple(w.strip() for w in text.splitlines() if w.strip())


@dataclass(frozen=True)
class StoryPrompt:
    seed: int
    verb: str
    noun: str
    adjective: str
    feature: str

    @property
    def text(self) -> str:
        return PROMPT.format(verb=self.verb, noun=self.noun, adjective=self.adjective,
                             feature=self.feature).rstrip()


def prompt_for(seed: int) -> StoryPrompt:
    """The prompt seed `seed` names: its words and feature, drawn from a generator seeded with it."""
    rng = np.random.default_rng(int(seed))
    verbs, nouns, adjectives = words("verbs"), words("nouns"), words("adjectives")
    return StoryPrompt(int(seed), verbs[rng.integers(len(verbs))], nouns[rng.integers(len(nouns))],
                       adjectives[rng.integers(len(adjectives))], FEATURES[rng.integers(len(FEATURES))])


def clean_story(text: str, finish: str) -> str | None:
    """The training document made of a teacher's answer, or None when it is not one.

    finish == "length" (cut at the token limit): everything after the last sentence end goes.
    Answers shorter than MIN_STORY_CHARS after that are dropped."""
    text = text.strip()
    if finish == "length":
        ends = list(_SENTENCE_END.finditer(text))
        text = text[:ends[-1].end()].rstrip() if ends else ""
    return text if len(text) >= MIN_STORY_CHARS else None
