"""llguidance against xgrammar on SmolLM2's vocabulary: what each costs to set up and per token.

    pip install llguidance xgrammar          # xgrammar pulls torch/transformers-level dependencies
    python benchmarks/constraint_libraries.py [--steps 200] [--out docs/results/constraint_libraries.md]

cflow enforces constraints with llguidance (cflow.constrain); this script is the measurement
behind that choice. For each library, on SmolLM2-135M's 49,152-token vocabulary (specials marked
as special, every stop id an end token): the time to build its view of the vocabulary, to compile
a JSON schema (an array of objects with strings, bounded integers and an enum) and a GBNF grammar,
and the time to compute one token mask at every step of one valid answer (the same token ids
replayed through both matchers, each also checked to allow the token it is given). Both compile
the schema to compact JSON with ", " and ": " separators and no free whitespace, as cflow does.
Medians and 99th percentiles of -r repetitions of the whole replay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

SCHEMA = {
    "type": "array", "minItems": 1, "maxItems": 20,
    "items": {"type": "object",
              "properties": {"name": {"type": "string", "maxLength": 16},
                             "age": {"type": "integer", "minimum": 0, "maximum": 99},
                             "pet": {"enum": ["cat", "dog", "fish", "none"]}},
              "required": ["name", "age", "pet"], "additionalProperties": False},
}
GBNF = r'''root ::= item ("; " item)*
item ::= name " is " age " and likes " thing
name ::= [A-Z] [a-z]{1,12}
age ::= [1-9] [0-9]?
thing ::= "cats" | "dogs" | "the sea" | "books"'''
ANSWER = '[{"name": "Ann", "age": 7, "pet": "cat"}, {"name": "Bob Smith", "age": 42, "pet": "dog"}, ' \
         '{"name": "Carla", "age": 19, "pet": "none"}]'
GBNF_ANSWER = "Ann is 7 and likes cats; Bob is 42 and likes the sea; Carla is 19 and likes books"


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def llguidance_side(tok, n_vocab, ids_json, ids_gbnf, reps):
    import llguidance
    import llguidance.numpy as lnp

    from cflow.constrain import JSON_OPTIONS, llg_tokenizer

    tok.__dict__.pop("_llg_tokenizers", None)
    lt, t_vocab = timed(lambda: llg_tokenizer(tok, n_vocab, json_slices=True))
    out = {"vocabulary s": t_vocab}
    for name, grammar_of, ids in (
            ("json", lambda: llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS), ids_json),
            ("gbnf", lambda: llguidance.grammar_from("grammar", GBNF), ids_gbnf)):
        tk = lt if name == "json" else llg_tokenizer(tok, n_vocab)
        m, t_compile = timed(lambda: llguidance.LLMatcher(tk, grammar_of(), log_level=0))
        assert not m.is_error(), m.get_error()
        mask = np.zeros((1, (n_vocab + 31) // 32), np.int32)
        times = []
        for _ in range(reps):
            m = llguidance.LLMatcher(tk, grammar_of(), log_level=0)
            for t in ids:
                t0 = time.perf_counter()
                lnp.fill_next_token_bitmask(m, mask, 0)
                times.append(time.perf_counter() - t0)
                assert (mask[0, t // 32] >> (t % 32)) & 1, f"llguidance refused token {t}"
                assert m.consume_token(t)
        out[f"{name} compile s"] = t_compile
        out[f"{name} mask ms"] = times
    return out


def xgrammar_side(tok, n_vocab, ids_json, ids_gbnf, reps):
    import xgrammar as xgr

    special = set(tok.special.values())
    # xgrammar's RAW vocabulary: each token's bytes; specials given as "" are never allowed as text
    vocab = [b"" if i in special else tok.token_to_bytes(i) for i in range(tok.vocab_size)]
    info, t_vocab = timed(lambda: xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=n_vocab,
                                                    stop_token_ids=sorted(tok.stop_ids)))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    out = {"vocabulary s": t_vocab}
    for name, compile_, ids in (
            ("json", lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                          separators=(", ", ": ")), ids_json),
            ("gbnf", lambda: compiler.compile_grammar(GBNF), ids_gbnf)):
        compiled, t_compile = timed(compile_)
        mask = xgr.allocate_token_bitmask(1, n_vocab)
        times = []
        for _ in range(reps):
            m = xgr.GrammarMatcher(compiled)
            for t in ids:
                t0 = time.perf_counter()
                m.fill_next_token_bitmask(mask)
                times.append(time.perf_counter() - t0)
                row = mask[0].numpy()
                assert (int(row[t // 32]) >> (t % 32)) & 1, f"xgrammar refused token {t}"
                assert m.accept_token(t)
        out[f"{name} compile s"] = t_compile
        out[f"{name} mask ms"] = times
    return out


def main() -> int:
    from cflow.bench.claims.models import smollm2_gguf
    from cflow.runtime import Engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="the model whose vocabulary is used (default: SmolLM2)")
    ap.add_argument("-r", "--reps", type=int, default=20, help="replays of each answer (default 20)")
    ap.add_argument("--out", default=None, help="write the table here (markdown) as well")
    args = ap.parse_args()
    path = args.model or smollm2_gguf()
    with Engine.load(path, threads=1, n_ctx=64) as eng:
        tok, n_vocab = eng.tokenizer, eng.config.vocab_size
    ids_json = tok.encode(ANSWER, add_bos=False)
    ids_gbnf = tok.encode(GBNF_ANSWER, add_bos=False)
    rows = {"llguidance": llguidance_side(tok, n_vocab, ids_json, ids_gbnf, args.reps)}
    try:
        rows["xgrammar"] = xgrammar_side(tok, n_vocab, ids_json, ids_gbnf, args.reps)
    except ImportError as e:
        print(f"xgrammar not measured ({e}): pip install xgrammar", file=sys.stderr)

    def ms(v):
        a = np.array(v) * 1e3
        return f"{np.median(a):.3f} / {np.mean(a):.3f} / {np.percentile(a, 99):.3f}"

    lines = ["| library | vocabulary (s) | JSON schema: compile (ms) | per-token mask, median / mean / p99 (ms) | "
             "GBNF: compile (ms) | per-token mask (ms) |", "|---|---|---|---|---|---|"]
    for lib, r in rows.items():
        lines.append(f"| {lib} | {r['vocabulary s']:.2f} | {r['json compile s'] * 1e3:.1f} | {ms(r['json mask ms'])} | "
                     f"{r['gbnf compile s'] * 1e3:.1f} | {ms(r['gbnf mask ms'])} |")
    head = (f"SmolLM2-135M vocabulary ({n_vocab} tokens); {len(ids_json)}-token JSON answer and {len(ids_gbnf)}-token "
            f"GBNF answer replayed {args.reps} times; one thread; {time.strftime('%Y-%m-%d')}. Command: "
            f"`python benchmarks/constraint_libraries.py -r {args.reps}`.")
    text = "\n".join([head, "", *lines, ""])
    print(text)
    if args.out:
        Path(args.out).write_text("# Constrained decoding libraries: llguidance and xgrammar\n\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
