"""The batched decode step: one engine with n_seq KV-cache slots, `step_batch` advancing B different
sequences at their own positions in one pass over the weights (native cf_step_batch).

The guarantee is row independence, exactly (np.array_equal): every op of the forward pass is
row-local (norms, int8 activation quantization, the router, the per-token expert sums in ascending
expert order, attention over the row's own sequence) and the batched mat-mat kernels equal the
mat-vec per row bit for bit (cflow.h), so a row's logits depend neither on how many nor on which
other sequences share the call, nor on step_batch vs step vs prefill. Checked here for dense and
MoE models (experts in RAM and on disk), against the float reference within test_engine's
tolerances, with KV isolation between sequences, at the context end, with more rows than one
native call holds (max_batch), and through the server's scheduler (EngineBatch). `step_rows`
(prompt chunks beside decode rows, logits only where asked) equals the separate prefill and
step_batch calls of the same rows, exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_engine import MAX_TOL, MEDIAN_TOL, dequantized_model, prompt_tokens, rel_err, small_config, \
    write_random_model  # noqa: E402

from cflow import _native  # noqa: E402
from cflow.model import ReferenceDecoder  # noqa: E402
from cflow.runtime import DEFAULT_MODEL, ContextOverflowError, Engine, EngineError  # noqa: E402

# preset -> (weight format, tile, threads, tied): dense, MoE with both delays, MoE with shared layers
VARIANTS = {
    "llama": ("q4_1", (128, 256), 2, True),
    "arch2_4_combined": ("q8_0", (64, 64), 2, False),
    "arch5": ("q4_0", (16, 32), 3, True),
}
LENGTHS = (5, 11, 1, 17)  # prompt lengths of the 4 sequences
STEPS = 6


@pytest.fixture(scope="module", params=list(VARIANTS))
def model(request, tmp_path_factory):
    preset = request.param
    dtype, tile, threads, tied = VARIANTS[preset]
    cfg = small_config(preset, tied)
    path = tmp_path_factory.mktemp(preset + "-batch") / "m.cflow"
    write_random_model(path, cfg, dtype, tile)
    return preset, path, threads, cfg


def continuation(cfg, s: int) -> list[int]:
    return prompt_tokens(cfg, STEPS, seed=100 + s)


def batched_rows(eng, cfg, seqs, slot_of=None) -> dict[int, list[np.ndarray]]:
    """Prefill each sequence's prompt (sequence s in slot slot_of[s], default s), then STEPS batched
    steps of all of `seqs` together (teacher forced); each sequence's logits after every step."""
    slot = {s: s if slot_of is None else slot_of[s] for s in seqs}
    prompts = {s: prompt_tokens(cfg, LENGTHS[s], seed=s) for s in seqs}
    for s in seqs:
        if len(prompts[s]) > 1:
            eng.prefill(prompts[s][:-1], 0, seq=slot[s])
    out = {s: [] for s in seqs}
    feed = {s: prompts[s][-1:] + continuation(cfg, s) for s in seqs}
    for i in range(STEPS):
        rows = eng.step_batch([slot[s] for s in seqs], [feed[s][i] for s in seqs],
                              [LENGTHS[s] - 1 + i for s in seqs])
        assert rows.shape == (len(seqs), cfg.vocab_size)
        for j, s in enumerate(seqs):
            out[s].append(rows[j].copy())
    return out


def alone_steps(path, threads, cfg, s) -> list[np.ndarray]:
    """Sequence s on a single-sequence engine through step()."""
    eng = Engine.load(path, threads=threads)
    p = prompt_tokens(cfg, LENGTHS[s], seed=s)
    if len(p) > 1:
        eng.prefill(p[:-1])
    feed = p[-1:] + continuation(cfg, s)
    return [eng.step(feed[i], LENGTHS[s] - 1 + i).copy() for i in range(STEPS)]


# ---- row independence ---------------------------------------------------------------------------
def test_rows_equal_each_sequence_alone(model):
    preset, path, threads, cfg = model
    together = batched_rows(Engine.load(path, threads=threads, n_seq=4, max_batch=8), cfg, (0, 1, 2, 3))
    for s in range(4):
        one = batched_rows(Engine.load(path, threads=threads, n_seq=4), cfg, (s,))[s]  # B = 1, same slot
        other = batched_rows(Engine.load(path, threads=threads, n_seq=4), cfg, (s,), {s: 3 - s})[s]  # slot 3-s
        plain = alone_steps(path, threads, cfg, s)  # n_seq = 1, step()
        for i in range(STEPS):
            assert np.array_equal(together[s][i], one[i]), f"{preset}: seq {s} step {i}: B=4 != B=1"
            assert np.array_equal(one[i], other[i]), f"{preset}: seq {s} step {i}: the slot matters"
            assert np.array_equal(one[i], plain[i]), f"{preset}: seq {s} step {i}: step_batch != step"


def test_batch_composition_never_changes_a_row(model):
    preset, path, threads, cfg = model
    a = batched_rows(Engine.load(path, threads=threads, n_seq=4), cfg, (3, 1))
    b = batched_rows(Engine.load(path, threads=1, n_seq=4), cfg, (1, 2, 3, 0))  # other order, threads
    for s in (1, 3):
        assert all(np.array_equal(x, y) for x, y in zip(a[s], b[s])), f"{preset}: seq {s}"


def test_rows_match_the_float_reference(model):
    preset, path, threads, cfg = model
    got = batched_rows(Engine.load(path, threads=threads, n_seq=4), cfg, (0, 1, 2, 3))
    tm = dequantized_model(path)
    errs = []
    for s in range(4):
        ref = ReferenceDecoder(tm)
        seq = prompt_tokens(cfg, LENGTHS[s], seed=s) + continuation(cfg, s)
        logits = [ref.step(t).numpy() for t in seq]
        errs += [rel_err(got[s][i], logits[LENGTHS[s] - 1 + i]) for i in range(STEPS)]
    errs = np.array(errs)
    msg = f"{preset}: max |dlogit| / std per row: {np.round(errs, 3)}"
    assert np.median(errs) <= MEDIAN_TOL, msg
    if cfg.has_moe:
        assert np.mean(errs <= MAX_TOL) >= 0.85, msg
    else:
        assert errs.max() <= MAX_TOL, msg


def test_more_rows_than_one_native_call_holds(model):
    preset, path, threads, cfg = model
    small = batched_rows(Engine.load(path, threads=threads, n_seq=4, max_batch=3), cfg, (0, 1, 2, 3))
    big = batched_rows(Engine.load(path, threads=threads, n_seq=4, max_batch=64), cfg, (0, 1, 2, 3))
    for s in range(4):
        assert all(np.array_equal(x, y) for x, y in zip(small[s], big[s])), f"{preset}: seq {s}"


def test_experts_on_disk_batched_equals_ram(tmp_path):
    cfg = small_config("arch2_4_combined", tied=False)
    path = tmp_path / "m.cflow"
    write_random_model(path, cfg, "q4_0", (64, 64))
    ram = batched_rows(Engine.load(path, threads=2, experts="ram", n_seq=4), cfg, (0, 1, 2, 3))
    probe = Engine.load(path, threads=1, experts="disk")
    c = probe.expert_cache
    probe.close()
    for io in ("async", "sync"):
        # the smallest cache: 4 rows route to more experts than it holds, so they come in waves
        eng = Engine.load(path, threads=2, experts="disk", expert_io=io, n_seq=4,
                          expert_cache=c["min_slots"] * c["slot_bytes"])
        disk = batched_rows(eng, cfg, (0, 1, 2, 3))
        for s in range(4):
            assert all(np.array_equal(x, y) for x, y in zip(ram[s], disk[s])), f"{io}: seq {s}"
        assert eng.counters()["cache_misses"] > 0


# ---- mixed calls: prompt chunks beside decode rows (step_rows, native cf_step_rows) ---------------
def mixed_vs_separate(path, threads, cfg, max_batch):
    """Sequences 0 and 1 decode while sequence 2's prompt (16 tokens, in chunks of 9 and 7) joins:
    the same rows as separate calls (prefill + step_batch) and as step_rows calls. Returns both
    engines and the logits each way."""
    prompts = {s: prompt_tokens(cfg, LENGTHS[s], seed=s) for s in (0, 1)}
    new = prompt_tokens(cfg, 16, seed=9)
    feed = {s: continuation(cfg, s) for s in (0, 1)}
    sep, mix = (Engine.load(path, threads=threads, n_seq=4, max_batch=max_batch) for _ in range(2))
    for eng in (sep, mix):
        for s in (0, 1):
            eng.prefill(prompts[s], 0, seq=s)
    got_sep, got_mix = [], []
    for i, (lo, hi) in enumerate(((0, 9), (9, 16))):
        pos = [LENGTHS[0] + i, LENGTHS[1] + i]
        toks = [feed[0][i], feed[1][i]]
        mid = sep.prefill(new[lo:lo + 5], lo, seq=2).copy()  # a row asked for inside the chunk
        last = sep.prefill(new[lo + 5:hi], lo + 5, seq=2).copy()
        rows = sep.step_batch([0, 1], toks, pos).copy()
        got_sep.append([rows[0], mid, last, rows[1]])
        # decode row of 0, the chunk of 2, decode row of 1; logits for rows 0, lo+4, the chunk's last, 1
        n = hi - lo
        out = mix.step_rows([0] + [2] * n + [1], [toks[0]] + new[lo:hi] + [toks[1]], [pos[0]] + list(range(lo, hi))
                            + [pos[1]], [True] + [k == 4 or k == n - 1 for k in range(n)] + [True])
        assert out.shape == (4, cfg.vocab_size)
        got_mix.append([r.copy() for r in out])
    return sep, mix, got_sep, got_mix


@pytest.mark.parametrize("max_batch", [64, 3])
def test_step_rows_equal_separate_prefill_and_step_batch(model, max_batch):
    # max_batch 3: the call takes several passes, a sequence's rows spread over them
    preset, path, threads, cfg = model
    sep, mix, a, b = mixed_vs_separate(path, threads, cfg, max_batch)
    for i in range(2):
        for j in range(4):
            assert np.array_equal(a[i][j], b[i][j]), f"{preset}: call {i} logits row {j}"
    for s in (0, 1, 2):
        assert sep.cached(s) == mix.cached(s)
    # what follows the mixed calls is what follows the separate ones
    x = sep.step_batch([2, 0], [3, 4], [16, LENGTHS[0] + 2]).copy()
    y = mix.step_batch([2, 0], [3, 4], [16, LENGTHS[0] + 2])
    assert np.array_equal(x, y)


def test_step_rows_every_row_and_no_row(tmp_path):
    cfg = small_config("llama")
    path = tmp_path / "m.cflow"
    write_random_model(path, cfg, "q4_0", (128, 256))
    eng = Engine.load(path, threads=2, n_seq=2)
    p = prompt_tokens(cfg, 6, seed=4)
    every = eng.step_rows([1] * 6, p, range(6)).copy()  # want None: every row, like teacher forcing
    alone = Engine.load(path, threads=2)
    for k in range(6):
        assert np.array_equal(every[k], alone.prefill(p[k:k + 1], k)), k
    assert eng.step_rows([0, 0], p[:2], [0, 1], [False, False]).shape == (0, cfg.vocab_size)
    assert eng.cached(0) == p[:2] and eng.cached(1) == p


def test_step_rows_refuses_rows_out_of_order(tmp_path):
    cfg = small_config("llama")
    path = tmp_path / "m.cflow"
    write_random_model(path, cfg, "q4_0", (128, 256))
    eng = Engine.load(path, threads=1, n_seq=2, n_ctx=16)
    eng.prefill([1, 2, 3], 0, seq=0)
    for seqs, toks, pos, what in [
        ([0, 0], [1, 2], [3, 5], "consecutive"),       # a gap
        ([0, 0], [1, 2], [4, 3], "consecutive"),       # out of order
        ([0, 1, 0], [1, 2, 3], [3, 0, 3], "consecutive"),  # the same position twice
        ([1, 1], [1, 2], [1, 2], "skips positions"),   # sequence 1 holds nothing
        ([0] * 14, [1] * 14, list(range(3, 17)), "do not fit the context"),
        ([2], [1], [0], "does not exist"),
        ([0], [cfg.vocab_size], [3], "outside the vocabulary"),
        ([], [], [], "1 or more"),
    ]:
        with pytest.raises(EngineError, match=what):
            eng.step_rows(seqs, toks, pos)
    assert eng.cached(0) == [1, 2, 3] and eng.cached(1) == []
    nat = eng._native
    i32 = lambda *v: np.array(v, np.int32)  # noqa: E731
    z = np.zeros((2, cfg.vocab_size), np.float32)
    for seqs, toks, pos, what in [(i32(0, 0), i32(1, 1), i32(3, 5), "consecutive"),
                                  (i32(1, 0), i32(1, 1), i32(16, 3), "does not fit"),
                                  (i32(0, 5), i32(1, 1), i32(3, 0), "does not exist")]:
        with pytest.raises(ValueError, match=what):
            nat.step_rows(seqs, toks, pos, np.ones(2, np.uint8), z)
    with pytest.raises(ValueError, match="logits"):
        nat.step_rows(i32(0, 0), i32(1, 1), i32(3, 4), np.ones(2, np.uint8), z[:1])
    assert eng.step_rows([0, 1, 0], [4, 5, 6], [3, 0, 4], [True, True, False]).shape == (2, cfg.vocab_size)


@pytest.mark.parametrize("kv", [("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "f16")])
def test_copy_seq_goes_on_bit_for_bit(model, kv):
    """Copies move whole cache rows, whatever their type (fp16, or q8_0 blocks with their scales)."""
    preset, path, threads, cfg = model
    if cfg.head_dim % 32:
        pytest.skip("q8_0 rows need head_dim % 32 == 0")
    ct = dict(cache_type_k=kv[0], cache_type_v=kv[1])
    eng = Engine.load(path, threads=threads, n_seq=3, **ct)
    p = prompt_tokens(cfg, 12, seed=5)
    eng.prefill(p, 0, seq=0)
    eng.prefill(prompt_tokens(cfg, 20, seed=6), 0, seq=2)  # something to overwrite
    eng.copy_seq(0, 2, 9)  # a prefix
    eng.copy_seq(0, 1)     # everything sequence 0 holds
    assert eng.cached(2) == p[:9] and eng.cached(1) == p
    alone = Engine.load(path, threads=threads, **ct)
    alone.prefill(p[:9])
    want = alone.prefill(p[9:], 9).copy()
    got = eng.step_rows([2, 2, 2, 1], p[9:] + [4], [9, 10, 11, 12], [False, False, True, True]).copy()
    assert np.array_equal(got[0], want), preset
    assert np.array_equal(got[1], alone.step(4, 12)), preset
    with pytest.raises(EngineError, match="cannot copy 13"):
        eng.copy_seq(0, 1, 13)
    with pytest.raises(EngineError, match="does not exist"):
        eng.copy_seq(0, 3)
    with pytest.raises(ValueError, match="does not exist"):
        eng._native.copy_seq(0, 3, 1)
    eng.copy_seq(1, 1, 5)  # onto itself: nothing moves
    assert eng.cached(1) == p + [4]


# ---- KV isolation and positions -----------------------------------------------------------------
def test_a_sequence_ignores_the_other_caches(model):
    preset, path, threads, cfg = model
    eng = Engine.load(path, threads=threads, n_seq=3)
    p = prompt_tokens(cfg, 9, seed=7)
    eng.prefill(p[:-1], 0, seq=1)
    first = eng.step_batch([1], [p[-1]], [8]).copy()
    # overwrite every other sequence's cache, at the same positions and beyond
    for s in (0, 2):
        eng.prefill(prompt_tokens(cfg, 20, seed=50 + s), 0, seq=s)
    again = eng.step_batch([1], [p[-1]], [8]).copy()  # rewrites position 8 of seq 1 only
    assert np.array_equal(first, again)
    mixed = eng.step_batch([2, 1, 0], [3, p[-1], 4], [20, 8, 20])
    assert np.array_equal(mixed[1], first[0])
    assert eng.cached(1) == p and len(eng.cached(0)) == len(eng.cached(2)) == 21


def test_positions_at_the_context_end(tmp_path):
    cfg = small_config("llama")
    path = tmp_path / "m.cflow"
    write_random_model(path, cfg, "q4_0", (128, 256))
    n = 12
    eng = Engine.load(path, threads=2, n_ctx=n, n_seq=2)
    a, b = prompt_tokens(cfg, n, seed=1), prompt_tokens(cfg, n - 4, seed=2)
    eng.prefill(a[:-1], 0, seq=0)
    eng.prefill(b[:-1], 0, seq=1)
    rows = eng.step_batch([0, 1], [a[-1], b[-1]], [n - 1, n - 5]).copy()
    alone = Engine.load(path, threads=2, n_ctx=n)
    alone.prefill(a[:-1])
    assert np.array_equal(rows[0], alone.step(a[-1], n - 1))
    with pytest.raises(ContextOverflowError):
        eng.step_batch([1, 0], [1, 2], [n - 4, n])
    assert eng.cached(0) == a and eng.cached(1) == b  # a refused call changes nothing
    # the native layer checks too
    with pytest.raises(ValueError, match="does not fit the context"):
        eng._native.step_batch(np.array([0], np.int32), np.array([1], np.int32), np.array([n], np.int32),
                               np.zeros((1, cfg.vocab_size), np.float32))


def test_bad_batches_raise_engine_errors(tmp_path):
    cfg = small_config("llama")
    path = tmp_path / "m.cflow"
    write_random_model(path, cfg, "q4_0", (128, 256))
    eng = Engine.load(path, threads=1, n_seq=3)
    for seqs, toks, pos, what in [
        ([3], [1], [0], "does not exist"),                 # slot out of range
        ([-1], [1], [0], "does not exist"),
        ([0, 0], [1, 2], [0, 0], "twice"),                 # duplicate slot
        ([0, 1, 2, 0], [1, 1, 1, 1], [0, 0, 0, 0], "1..3"),  # B > n_seq
        ([], [], [], "1..3"),
        ([0, 1], [1], [0, 0], "1..3"),                     # lengths differ
        ([0], [cfg.vocab_size], [0], "outside the vocabulary"),
        ([0], [1], [1], "skips positions"),                # seq 0 holds nothing yet
        ([0], [1], [-1], "skips positions"),
    ]:
        with pytest.raises(EngineError, match=what):
            eng.step_batch(seqs, toks, pos)
    with pytest.raises(EngineError, match="does not exist"):
        eng.prefill([1, 2], 0, seq=3)
    with pytest.raises(EngineError, match="does not exist"):
        eng.reset(5)
    with pytest.raises(EngineError, match="n_seq"):
        Engine.load(path, n_seq=0)
    # the native engine refuses the same things by itself
    nat = eng._native
    z = np.zeros((4, cfg.vocab_size), np.float32)
    i32 = lambda *v: np.array(v, np.int32)  # noqa: E731
    for seqs, toks, pos, what in [(i32(0, 0), i32(1, 1), i32(0, 0), "twice"), (i32(3), i32(1), i32(0), "does not"),
                                  (i32(0, 1, 2, 0), i32(1, 1, 1, 1), i32(0, 0, 0, 0), "1..3"),
                                  (i32(0), i32(-2), i32(0), "vocabulary")]:
        with pytest.raises(ValueError, match=what):
            nat.step_batch(seqs, toks, pos, z)
    with pytest.raises(ValueError, match="logits"):
        nat.step_batch(i32(0, 1), i32(1, 1), i32(0, 0), np.zeros((1, cfg.vocab_size), np.float32))
    with pytest.raises(ValueError, match="does not exist"):
        nat.prefill(i32(1), 0, None, 3)
    # after all that, every sequence still works
    eng.prefill([5, 6], 0, seq=2)
    assert eng.step_batch([2, 0], [7, 8], [2, 0]).shape == (2, cfg.vocab_size)


def test_reset_and_cached_per_sequence(tmp_path):
    cfg = small_config("llama")
    path = tmp_path / "m.cflow"
    write_random_model(path, cfg, "q4_0", (128, 256))
    eng = Engine.load(path, threads=1, n_seq=2)
    eng.prefill([1, 2, 3], 0, seq=0)
    eng.prefill([4, 5], 0, seq=1)
    eng.step_batch([1, 0], [6, 7], [2, 3])
    assert eng.cached(0) == [1, 2, 3, 7] and eng.cached(1) == [4, 5, 6]
    assert eng._cached == [1, 2, 3, 7]  # the single-sequence calls' sequence
    eng.reset(1)
    assert eng.cached(0) == [1, 2, 3, 7] and eng.cached(1) == []
    eng.reset()
    assert eng.cached(0) == [] and eng.cached(1) == []


def test_one_sequence_engine_is_unchanged(tmp_path):
    cfg = small_config("arch2_4_combined", tied=False)
    path = tmp_path / "m.cflow"
    write_random_model(path, cfg, "q4_1", (64, 64))
    eng = Engine.load(path, threads=2)
    assert eng.n_seq == 1 and eng._native.n_seq == 1
    p = prompt_tokens(cfg, 8, seed=3)
    l1 = eng.prefill(p).copy()
    s1 = eng.step(9, 8).copy()
    eng.reset()
    assert np.array_equal(eng.prefill(p), l1)
    assert np.array_equal(eng.step_batch([0], [9], [8])[0], s1)
    assert eng._cached == p + [9]
    # the native constructor's positional signature is the old one; n_seq is a trailing keyword
    assert "n_seq" in _native.NativeEngine.__init__.__doc__


# ---- the server's backend -----------------------------------------------------------------------
needs_builtin = pytest.mark.skipif(not DEFAULT_MODEL.is_file(), reason="built-in model not installed")
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They saw",
           "One day, a big red ball", "x", "There was a cat named"]


@needs_builtin
def test_engine_batch_backend_greedy_equals_single_slot():
    from cflow.serve.backend import BatchBackend, EngineBatch, EngineSlots, load_backend
    from cflow.serve.batch import BatchGenerator

    be = load_backend(n_slots=4, threads=1)
    assert isinstance(be, EngineBatch) and isinstance(be, BatchBackend) and be.n_slots == 4
    with BatchGenerator(be, prefill_chunk=8) as g4, \
            BatchGenerator(EngineSlots.load(n_slots=1, threads=1)) as g1:
        got = g4.complete_many(PROMPTS, 32, temperature=0)
        one = [g1.complete_many([p], 32, temperature=0)[0] for p in PROMPTS]
        seeded = g4.complete_many(PROMPTS[:3], 16, temperature=1.0, seed=7)
        seeded1 = [g1.complete_many([p], 16, temperature=1.0, seed=7 + i)[0] for i, p in enumerate(PROMPTS[:3])]
    for p, a, b in zip(PROMPTS, got, one):
        assert (a.text, a.tokens, a.finish_reason) == (b.text, b.tokens, b.finish_reason), p
    assert [c.tokens for c in seeded] == [c.tokens for c in seeded1]
    assert isinstance(load_backend(n_slots=2, threads=1, batched=False), EngineSlots)


@needs_builtin
def test_engine_batch_backend_contract():
    from cflow.serve.backend import EngineBatch

    be = EngineBatch.load(n_slots=3, threads=1, n_ctx=32)
    try:
        p = be.encode("Once upon a time")
        a = be.prefill(0, p, 0).copy()
        b = be.prefill(2, p, 0).copy()
        assert np.array_equal(a, b)
        rows = be.step_batch([2, 0], [5, 5], [len(p), len(p)])
        assert rows.shape == (2, be.vocab_size) and np.array_equal(rows[0], rows[1])
        with pytest.raises(EngineError):
            be.step_batch([1], [5], [3])  # slot 1 holds nothing
        with pytest.raises(EngineError):
            be.step_batch([0, 0], [5, 5], [1, 1])
        with pytest.raises(ContextOverflowError):
            be.prefill(1, [5] * 33, 0)
    finally:
        be.close()
