"""Structured output (cflow.constrain) through the Python API and the batch generator.

- ConstraintSpec refuses malformed schemas, grammars and regexes with the reason; closed_objects
  closes object schemas as llama.cpp's converter does.
- On SmolLM2 (the real vocabulary: byte-level BPE, specials, 49k tokens): every output under a JSON
  schema (nested objects, enums, arrays, bounded numbers and strings) parses and validates with
  jsonschema, greedy and at temperature 1 over many seeds; GBNF and regex outputs match an
  independent parser (Python's re); JSON mode gives a JSON object.
- A constraint that allows every text changes nothing: greedy output is token for token plain
  greedy (the mask bans nothing it should not, and the overlapped mask is the right one).
- The mask computed in the background equals the mask computed in place, at every step.
- Batched: constrained jobs beside an unconstrained one each get their own constraint; the free
  job's greedy text equals Engine.complete's (no mask leaks into another row).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

pytest.importorskip("llguidance", reason="structured output needs llguidance: pip install 'cflow-lm[structured]'")
jsonschema = pytest.importorskip("jsonschema")

from cflow.constrain import (Constraint, ConstraintError, ConstraintSpec, closed_objects,  # noqa: E402
                             constraint_spec, prefetch)
from cflow.runtime import Engine  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "address", "tags", "active"],
}


# ---- the spec ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, source, words", [
    ("json_schema", {"type": "strin"}, "invalid at type"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", [1, 2], "must be an object"),
    ("regex", "", "non-empty"),
    ("grammar", 'root ::= undefined_rule', "undefined_rule"),
    ("nonsense", "x", "unknown constraint kind"),
])
def test_malformed_specs_are_refused_with_the_reason(kind, source, words):
    with pytest.raises(ConstraintError, match=re.escape(words)):
        ConstraintSpec(kind, source).grammar()


def test_constraint_spec_keywords_take_one():
    assert constraint_spec() is None
    assert constraint_spec(json_schema={}).kind == "json_object"
    assert constraint_spec(regex="a+").source == "a+"
    with pytest.raises(ConstraintError, match="at most one"):
        constraint_spec(json_schema={}, grammar='root ::= "a"')


def test_closed_objects_closes_only_what_is_silent():
    s = closed_objects({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}},
                                                          "c": {"type": "array", "items": {"properties": {"d": {}}}}},
                        "$defs": {"x": {"properties": {}, "additionalProperties": True}}})
    assert s["additionalProperties"] is False
    assert s["properties"]["a"]["additionalProperties"] is False
    assert s["properties"]["c"]["items"]["additionalProperties"] is False
    assert s["$defs"]["x"]["additionalProperties"] is True  # said explicitly: kept
    assert "additionalProperties" not in s["properties"]["a"]["properties"]["b"]  # no properties: not an object schema


# ---- on SmolLM2 ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol(smollm2_converted):
    eng = Engine.load(smollm2_converted, threads=2, n_ctx=1024)
    yield eng
    eng.close()


def _chat(eng, text):
    return eng.chat_tokens([{"role": "user", "content": text}])


def test_every_output_under_a_schema_validates(smol):
    prompt = _chat(smol, "Describe a person as JSON.")
    outs = [smol.complete(prompt, 200, json_schema=PERSON, temperature=0)]
    outs += [smol.complete(prompt, 200, json_schema=PERSON, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=s)
             for s in range(8)]
    for c in outs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
    assert len({c.text for c in outs}) > 3  # sampling really sampled


def test_json_mode_gives_an_object(smol):
    c = smol.complete(_chat(smol, "Give me JSON about a dog."), 300, json_schema={}, temperature=0)
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.text), dict)
    else:  # an unbounded object may run to max_tokens; what was written is still a JSON object's start
        assert c.text.startswith("{")


@pytest.mark.parametrize("seed", range(4))
def test_grammar_and_regex_outputs_match_an_independent_parser(smol, seed):
    gbnf = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{3,30} "."'
    c = smol.complete("Is the sky blue?", 60, grammar=gbnf, temperature=1.0, seed=seed)
    assert re.fullmatch(r"(yes|no) because [a-z ]{3,30}\.", c.text), c.text
    assert c.finish_reason == "stop"
    c = smol.complete("Call me at", 30, regex=r" \(\d{3}\) \d{3}-\d{4}", temperature=1.0, seed=seed)
    assert re.fullmatch(r" \(\d{3}\) \d{3}-\d{4}", c.text), c.text


def test_a_constraint_allowing_everything_changes_nothing(smol):
    prompt = _chat(smol, "Write one sentence about the sea.")
    plain = smol.complete(prompt, 40, temperature=0)
    free = smol.complete(prompt, 40, temperature=0, regex=r"[\s\S]*")
    assert free.tokens == plain.tokens


def test_background_masks_equal_masks_computed_in_place(smol):
    spec = ConstraintSpec("json_schema", PERSON)
    a, b = Constraint(spec, smol.tokenizer, smol.config.vocab_size), Constraint(spec, smol.tokenizer,
                                                                                smol.config.vocab_size)
    text = '{"name": "Ann", "age": 7, "pet": "cat", "address": {"city": "Oslo", "zip": "01234"}, ' \
           '"tags": ["x"], "active": true}'
    ids = smol.tokenizer.encode(text, add_bos=False)
    for tok in ids:
        prefetch([a])
        assert np.array_equal(a.allowed(), b.allowed())
        assert a.allowed()[tok]
        a.advance(tok)
        b.advance(tok)
    assert a.accepting and b.accepting
    bad = smol.tokenizer.encode('{"name": 5', add_bos=False)
    c = Constraint(spec, smol.tokenizer, smol.config.vocab_size)
    with pytest.raises(ConstraintError, match="does not fit"):
        for tok in bad:
            c.advance(tok)


def test_masked_logits_ban_exactly_the_forbidden_tokens(smol):
    c = Constraint(ConstraintSpec("regex", "[0-9]+"), smol.tokenizer, smol.config.vocab_size)
    logits = np.random.default_rng(0).standard_normal(smol.config.vocab_size).astype(np.float32)
    out = c.apply(logits)
    ok = c.allowed()
    assert np.array_equal(np.isfinite(out), ok) and np.array_equal(out[ok], logits[ok])
    digits = [i for i in range(smol.tokenizer.vocab_size) if ok[i]]
    assert digits and all(smol.tokenizer.token_to_bytes(i).isdigit() for i in digits)


def test_speculation_with_a_constraint_is_refused_by_name(smol):
    from cflow.runtime.errors import EngineError

    with pytest.raises(EngineError, match="speculative decoding under a JSON schema"):
        smol.complete("Hi", 4, regex="a+", speculative="ngram")


# ---- batched ---------------------------------------------------------------------------------------------
def test_batched_jobs_each_keep_their_own_constraint(smol, smollm2_converted):
    from cflow.serve.batch import BatchGenerator, Finished, Piece
    from cflow.sampling import SamplingParams

    prompt = _chat(smol, "Describe a person as JSON.")
    free_prompt = _chat(smol, "Write one sentence about the sea.")
    want_free = smol.complete(free_prompt, 32, temperature=0).text
    results: dict[int, list] = {}

    def sink(k):
        return lambda ev: results.setdefault(k, []).append(ev)

    with BatchGenerator.load(smollm2_converted, parallel=4, threads=2, n_ctx=2048) as gen:
        jobs = gen.submit_n(prompt, [sink(0), sink(1), sink(2)], max_tokens=200,
                            params=SamplingParams(temperature=1.0, seed=3), constraint=ConstraintSpec("json_schema", PERSON))
        jobs.append(gen.submit(free_prompt, sink(3), max_tokens=32, params=SamplingParams(temperature=0)))
        import time

        deadline = time.time() + 300
        while not all(j.done for j in jobs) and time.time() < deadline:
            time.sleep(0.05)
    texts = {}
    for k, evs in results.items():
        end = evs[-1]
        assert isinstance(end, Finished), end
        texts[k] = "".join(e.text for e in evs if isinstance(e, Piece)) + end.tail
    for k in range(3):
        jsonschema.validate(json.loads(texts[k]), PERSON)
    assert len({texts[0], texts[1], texts[2]}) > 1  # seeds seed, seed+1, seed+2: three draws
    assert texts[3] == want_free
