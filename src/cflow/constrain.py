"""Constrained decoding: which tokens a sequence may take next under a JSON schema, a grammar or a
regex, enforced token by token with llguidance (the library llama.cpp integrates).

Owns:
- `ConstraintSpec`: what a request asks for (kind + source), checked and compiled to llguidance's
  grammar form; `ConstraintError` for anything malformed, with llguidance's message;
- the bridge from cflow's `Tokenizer` to llguidance's `LLTokenizer` (built once per tokenizer:
  every id's bytes, special tokens marked with a 0xFF prefix as llguidance expects, every stop id
  an end-of-sequence token, so a finished grammar lets the model end its turn its own way);
- `Constraint`: one sequence's matcher and its token mask. `apply(logits)` bans the tokens the
  grammar forbids (their logits become -inf, so every sampler stage downstream only ever sees
  allowed tokens: the constrained distribution is the sampler's over the allowed tokens);
  `advance(tok)` moves the matcher; `prefetch([...])` computes the next masks on a background
  thread while the native step runs (llguidance releases the GIL), which takes the mask off the
  decode critical path, but only where a core is free for it (`overlap_pays`): measured on 2
  cores with a 2-thread step, the extra thread slowed the step itself by 10-30% (its workers wait
  at each barrier for the one the mask thread displaced), several times the masks' own cost, so
  there the masks are computed in place after the step;
- `sample(sampler, constraint, logits, history)`: the next token under a constraint. Greedy asks
  the matcher about the argmax alone first (~1 us) and computes a mask only when the argmax is
  forbidden, which is exact (the first maximum overall, when allowed, is the first maximum among
  the allowed) and skips the mask at most steps; a greedy sequence's constraint therefore
  computes no mask ahead (`eager` False).

Why llguidance and not xgrammar (measured: benchmarks/constraint_libraries.py): llguidance has no
dependencies (one abi3 wheel), takes GBNF (llama-server's `grammar`), Lark, regex and JSON schema
through one API, compiles a schema in ~1 ms and computes a mask in 0.01-0.05 ms on a 49k
vocabulary. xgrammar's masks are ~20x cheaper (it precomputes per schema), but importing it
imports torch and transformers, which the runtime and the server must not need.

JSON output is compact-but-readable (", " and ": " separators, no other whitespace): a small model
under a schema that allows free whitespace can emit newlines forever, and a fixed layout wastes no
tokens. A schema's own `x-guidance` options override this. As in llama.cpp's schema converter, an
object schema that lists `properties` and says nothing of `additionalProperties` gets none (the
spec's default allows any, and a small model then invents keys until max_tokens); say
"additionalProperties": true to allow them.

Kinds: "json_object" (any JSON object), "json_schema" (source: the schema, a dict or its JSON text),
"regex", "grammar" (GBNF as llama.cpp's grammars, or Lark), "lark" (llguidance's Lark dialect,
which embeds JSON schemas as `%json {...}` and names special tokens as `<[id]>`), "choice" (one of
a list of strings, vLLM's guided_choice).
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from cflow.errors import CflowError

KINDS = ("json_object", "json_schema", "regex", "grammar", "lark", "choice")
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SOURCE_CHARS = 1 << 20  # a schema or grammar larger than this is refused before compiling


class ConstraintError(CflowError, ValueError):
    """A JSON schema, grammar or regex is malformed, or cannot be enforced (the message says which
    and why); or constrained decoding was asked for without llguidance installed."""


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401 (the mask helpers)
    except ImportError:
        raise ConstraintError("structured output (JSON schemas, grammars, regexes) needs llguidance: "
                              "pip install 'cflow-lm[structured]'  (or: pip install llguidance)") from None
    return llguidance


# ---- what a request asks for ----------------------------------------------------------------------
@dataclass(frozen=True)
class ConstraintSpec:
    """A constraint as asked for. `source`: the schema (dict or JSON text) for "json_schema", the
    pattern for "regex", the grammar text for "grammar" / "lark", None for "json_object"."""

    kind: str
    source: Any = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {self.kind!r}; one of {', '.join(KINDS)}")
        if self.kind == "json_object":
            return
        if self.kind == "json_schema":
            if isinstance(self.source, str):
                try:
                    object.__setattr__(self, "source", json.loads(self.source))
                except ValueError as e:
                    raise ConstraintError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(self.source, dict):
                raise ConstraintError(f"a JSON schema must be an object, got {type(self.source).__name__}")
            size = len(json.dumps(self.source))
        elif self.kind == "choice":
            if (not isinstance(self.source, (list, tuple)) or not self.source
                    or not all(isinstance(x, str) and x for x in self.source)):
                raise ConstraintError("a choice constraint needs a non-empty list of non-empty strings")
            object.__setattr__(self, "source", tuple(self.source))
            size = sum(len(x) for x in self.source)
        else:
            if not isinstance(self.source, str) or not self.source.strip():
                raise ConstraintError(f"the {self.what} must be a non-empty string")
            size = len(self.source)
        if size > MAX_SOURCE_CHARS:
            raise ConstraintError(f"the {self.what} has {size} characters; at most {MAX_SOURCE_CHARS} are accepted")

    @property
    def what(self) -> str:
        return {"json_object": "JSON object constraint", "json_schema": "JSON schema", "regex": "regex",
                "grammar": "grammar", "lark": "Lark grammar", "choice": "choice"}[self.kind]

    def grammar(self) -> str:
        """llguidance's grammar for this constraint (not yet checked against a tokenizer)."""
        llg = _llguidance()
        m = llg.LLMatcher
        if self.kind in ("json_object", "json_schema"):
            schema = {"type": "object"} if self.kind == "json_object" else self.source
            _check_schema(schema)
            try:
                return m.grammar_from_json_schema(closed_objects(schema), defaults=JSON_OPTIONS)
            except ValueError as e:
                raise ConstraintError(f"the JSON schema cannot be used: {e}") from None
        if self.kind == "regex":
            return m.grammar_from_regex(self.source)
        if self.kind == "lark":
            return m.grammar_from_lark(self.source)
        if self.kind == "choice":
            return m.grammar_from_lark("start: " + " | ".join(json.dumps(x) for x in self.source))
        try:  # GBNF (llama.cpp) or Lark: llguidance tells them apart
            return llg.grammar_from("grammar", self.source)
        except Exception as e:  # its GBNF converter raises plain exceptions with a useful message
            raise ConstraintError(f"the grammar cannot be parsed: {e}") from None


_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalItems", "not", "if", "then", "else", "contains", "propertyNames")


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` where every object schema with `properties` and no word on extra keys
    (additionalProperties / unevaluatedProperties) allows none (llama.cpp's default)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SUBSCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: closed_objects(sub) for name, sub in out[k].items()}
    for k in _SUBSCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [closed_objects(sub) for sub in out[k]]
    for k in _SUBSCHEMA_ONE + ("additionalProperties",):
        if isinstance(out.get(k), dict):
            out[k] = closed_objects(out[k])
    if "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def _check_schema(schema: dict[str, Any]) -> None:
    """A malformed schema (e.g. "type": "strin") gets jsonschema's precise message where jsonschema
    is installed; llguidance then refuses what it cannot enforce."""
    try:
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise ConstraintError(f"the JSON schema is invalid at {where}: {e.message}") from None


# ---- the tokenizer bridge ------------------------------------------------------------------------
_BRIDGE_LOCK = threading.Lock()


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads from a tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        special = set(tokenizer.special.values())
        self.tokens = [(b"\xff" if i in special else b"") + tokenizer.token_to_bytes(i)
                       for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(special)
        stops = sorted(tokenizer.stop_ids)
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else (stops[0] if stops else 0)
        self.bos_token_id = tokenizer.bos_id
        self._tok = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        return self._tok.encode(text.decode("utf-8", errors="replace"), add_bos=False)


def llg_tokenizer(tokenizer: Any, n_vocab: int | None = None, json_slices: bool = False) -> Any:
    """llguidance's LLTokenizer for a cflow Tokenizer, built once (~0.5 s for 50k tokens) and kept
    on the tokenizer. `n_vocab`: the model's logit count when it pads past the vocabulary (the
    padding ids are never allowed). `json_slices`: the vocabulary partition llguidance tunes for
    JSON (measured on SmolLM2 under a schema: 0.037 ms per mask against 0.061 with the general one)."""
    llg = _llguidance()
    n = max(int(n_vocab or 0), tokenizer.vocab_size)
    with _BRIDGE_LOCK:
        cache = tokenizer.__dict__.setdefault("_llg_tokenizers", {})
        if n not in cache:
            stops = sorted(tokenizer.stop_ids) or None
            cache[n] = llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(tokenizer)), n_vocab=n, eos_token=stops)
        if json_slices and (n, "json") not in cache:
            cache[n, "json"] = cache[n].with_slices(llg.LLTokenizer.json_slices())
        return cache[n, "json"] if json_slices else cache[n]


# ---- one sequence's constraint -------------------------------------------------------------------
class Constraint:
    """A compiled constraint bound to a tokenizer: one matcher, one mask. Not thread-safe; one per
    sequence (`copy()` for another sequence under the same constraint, which skips compiling)."""

    def __init__(self, spec: ConstraintSpec, tokenizer: Any, n_vocab: int | None = None) -> None:
        llg = _llguidance()
        llg_tok = llg_tokenizer(tokenizer, n_vocab, json_slices=spec.kind in ("json_object", "json_schema"))
        grammar = spec.grammar()
        err = llg.LLMatcher.validate_grammar(grammar, llg_tok)
        if err and not err.startswith("WARNING"):
            raise ConstraintError(f"the {spec.what} is invalid: {err}")
        matcher = llg.LLMatcher(llg_tok, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"the {spec.what} is invalid: {matcher.get_error()}")
        self._bind(spec, llg_tok, matcher)

    def _bind(self, spec: ConstraintSpec, llg_tok: Any, matcher: Any) -> None:
        self.spec, self._llg_tok, self.matcher = spec, llg_tok, matcher
        self.n_vocab = llg_tok.vocab_size
        self.mask = np.full((1, (self.n_vocab + 31) // 32), -1, np.int32)
        self._ready = False              # the mask is that of the matcher's current state
        self._pending: Future | None = None
        self.eager = True                # prefetch computes this one's masks ahead (False: greedy)

    def copy(self) -> "Constraint":
        """The same constraint, from the same state, for another sequence (no second compile)."""
        self.wait()
        twin = Constraint.__new__(Constraint)
        twin._bind(self.spec, self._llg_tok, self.matcher.deep_copy())
        twin.eager = self.eager
        return twin

    # ---- state -----------------------------------------------------------------------------------
    @property
    def accepting(self) -> bool:
        """The text so far is a complete match (the model may end here)."""
        return self.matcher.is_accepting()

    @property
    def finished(self) -> bool:
        """Nothing may follow: the match is complete and the grammar allows no more text."""
        return self.matcher.is_stopped()

    def allows(self, tok: int) -> bool:
        """Whether `tok` may come next (asks the matcher about this token alone: no mask)."""
        return self.matcher.validate_tokens([int(tok)]) == 1

    def advance(self, tok: int) -> None:
        """Take the sampled token (one the mask allowed); the next mask is then stale."""
        self.wait()
        self._ready = False
        if not self.matcher.consume_token(int(tok)):
            raise ConstraintError(f"token {tok} does not fit the {self.spec.what}: {self.matcher.get_error()}")

    # ---- the mask --------------------------------------------------------------------------------
    def compute(self) -> None:
        """The mask of the current state, now (a no-op when already computed)."""
        if self._pending is not None:
            self.wait()
        if not self._ready:
            self._fill()

    def _fill(self) -> None:
        # no wait() here: prefetch's worker runs this while _pending holds its own future
        import llguidance.numpy as lnp

        lnp.fill_next_token_bitmask(self.matcher, self.mask, 0)
        self._ready = True

    def wait(self) -> None:
        """Finish a background mask computation (prefetch), re-raising what it raised."""
        fut, self._pending = self._pending, None
        if fut is not None:
            fut.result()

    def allowed(self) -> np.ndarray:
        """bool [n_vocab]: the tokens the constraint allows next."""
        self.compute()
        return np.unpackbits(self.mask[0].view(np.uint8), bitorder="little")[:self.n_vocab].astype(bool)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A copy of `logits` [V] with every forbidden token at -inf (logits past n_vocab too)."""
        ok = self.allowed()
        n = min(logits.shape[-1], ok.size)
        out = np.full(logits.shape, -np.inf, np.float32)
        np.copyto(out[:n], logits[:n], where=ok[:n])
        if not ok[:n].any():
            raise ConstraintError(f"the {self.spec.what} allows no token here: {self.matcher.get_error() or 'dead end'}")
        return out


# ---- masks off the critical path ----------------------------------------------------------------
def overlap_pays(threads: int) -> bool:
    """Whether computing masks beside a native step of `threads` threads pays: only when this
    process may use more cores than the step does (CFLOW_MASK_OVERLAP=1 or 0 forces it)."""
    forced = os.environ.get("CFLOW_MASK_OVERLAP")
    if forced in ("0", "1"):
        return forced == "1"
    from cflow.runtime.threads import usable_threads  # here: cflow.runtime imports this module

    return usable_threads() > threads


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cflow-mask")
        return _POOL


def prefetch(constraints: Sequence[Constraint]) -> None:
    """Start computing the next mask of each constraint on a background thread; `apply`/`allowed`
    wait for it. Call right before the native step whose logits the masks will filter: llguidance
    drops the GIL while it computes, so the mask and the step run at the same time."""
    todo = [c for c in constraints if c.eager and not c._ready and c._pending is None]
    if not todo:
        return

    fut = _pool().submit(_compute_all, todo)
    for c in todo:
        c._pending = fut


def _compute_all(todo: list[Constraint]) -> None:
    for c in todo:
        if not c._ready:
            c._fill()


def sample(sampler: Any, constraint: Constraint, logits: np.ndarray, history: Sequence[int]) -> int:
    """The next token from `logits` by `sampler` (cflow.sampling.Sampler), among the tokens
    `constraint` allows (see the module docstring for the greedy shortcut)."""
    if sampler.params.greedy:
        x = sampler.adjusted(logits, history)
        tok = int(np.argmax(x))
        if constraint.allows(tok):
            return tok
        return int(np.argmax(constraint.apply(x)))
    return sampler.sample(constraint.apply(logits), history)


def compile_constraint(spec: "ConstraintSpec | Constraint | None", tokenizer: Any,
                       n_vocab: int | None = None) -> Constraint | None:
    """`spec` compiled against `tokenizer` (a compiled Constraint passes through; None stays None):
    ConstraintError when it is malformed or not a constraint at all."""
    if spec is None or isinstance(spec, Constraint):
        return spec
    if not isinstance(spec, ConstraintSpec):
        raise ConstraintError(f"constraint must be a cflow.constrain.ConstraintSpec, got {type(spec).__name__}")
    return Constraint(spec, tokenizer, n_vocab)


def constraint_spec(json_schema: Any = None, grammar: str | None = None, regex: str | None = None,
                    constraint: "ConstraintSpec | Constraint | None" = None) -> "ConstraintSpec | Constraint | None":
    """The one constraint that the Python API's and CLI's keywords name (None: none). json_schema
    {} (or True) means any JSON object. ConstraintError when more than one is given."""
    given = [k for k, v in (("json_schema", json_schema), ("grammar", grammar), ("regex", regex),
                            ("constraint", constraint)) if v is not None]
    if len(given) > 1:
        raise ConstraintError(f"give at most one of json_schema, grammar, regex, constraint (got {', '.join(given)})")
    if constraint is not None:
        return constraint
    if json_schema is not None:
        return ConstraintSpec("json_object") if json_schema in ({}, True) else ConstraintSpec("json_schema", json_schema)
    if grammar is not None:
        return ConstraintSpec("grammar", grammar)
    if regex is not None:
        return ConstraintSpec("regex", regex)
    return None
