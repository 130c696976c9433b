"""cflow's Gated DeltaNet token step (src/cflow/native/deltanet.c, the scalar reference of the pieces
the engine's qwen35 layers run: engine_deltanet.c) against the float reference of llama.cpp's layer
(cflow.model_qwen35.delta_net, held to llama.cpp by tests/test_qwen35.py), token by token with the
conv and recurrent state carried in the caller's arrays, at Qwen3.5's head layout and at odd sizes;
and the kernel table's deltanet_head of every table against the scalar reference."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cflow.model_qwen35 import delta_net  # noqa: E402

from cflow import _native  # noqa: E402

D, STEPS, EPS = 48, 24, 1e-6


def layer_weights(rng, hk: int, hv: int, dh: int, kconv: int) -> dict[str, np.ndarray]:
    """One delta-net layer's weights under GGUF names, scaled as tests/test_qwen35.py's."""
    conv_dim, value_dim = (2 * hk + hv) * dh, hv * dh

    def mat(*shape, gain=1.0):
        return (rng.standard_normal(shape) * gain / np.sqrt(shape[-1])).astype(np.float32)

    return {"attn_qkv.weight": mat(conv_dim, D, gain=2.0), "attn_gate.weight": mat(value_dim, D, gain=2.0),
            "ssm_conv1d.weight": mat(conv_dim, kconv, gain=1.5), "ssm_alpha.weight": mat(hv, D),
            "ssm_dt.bias": (rng.standard_normal(hv) * 0.5).astype(np.float32),
            "ssm_a": -np.exp(-0.5 + 0.3 * rng.standard_normal(hv)).astype(np.float32),
            "ssm_beta.weight": mat(hv, D, gain=1.5), "ssm_norm.weight": (1 + 0.2 * rng.standard_normal(dh)).astype(np.float32),
            "ssm_out.weight": mat(D, value_dim, gain=2.0)}


def native_outputs(w: dict[str, np.ndarray], hk: int, h: np.ndarray, carry: bool = True) -> np.ndarray:
    """[n, d]: ssm_out times cflow's step output per token; carry=False starts every token from
    fresh (zero) state, the control."""
    hv, dh, kconv = w["ssm_a"].shape[0], w["ssm_norm.weight"].shape[0], w["ssm_conv1d.weight"].shape[1]
    conv_dim = w["ssm_conv1d.weight"].shape[0]
    conv_state = np.zeros((kconv - 1) * conv_dim, np.float32)
    ssm_state = np.zeros(hv * dh * dh, np.float32)
    outs = []
    for row in h.astype(np.float32):
        if not carry:
            conv_state[:], ssm_state[:] = 0, 0
        o = _native.deltanet_step(w["ssm_conv1d.weight"], w["ssm_dt.bias"], w["ssm_a"], w["ssm_norm.weight"], hk, EPS,
                                  conv_state, ssm_state, w["attn_qkv.weight"] @ row, w["attn_gate.weight"] @ row,
                                  w["ssm_alpha.weight"] @ row, w["ssm_beta.weight"] @ row)
        outs.append(w["ssm_out.weight"] @ o)
    return np.stack(outs)


def reference_outputs(w: dict[str, np.ndarray], h: np.ndarray, **drop) -> np.ndarray:
    v = lambda n: torch.from_numpy(w[n].astype(np.float64))  # noqa: E731
    return delta_net(v, "", torch.from_numpy(h.astype(np.float64)), EPS, **drop).numpy()


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / want.std())


# (Hk, Hv, dh, d_conv): Qwen3.5's layout (Hv = 2 Hk, dh a multiple of 16), odd sizes, one head,
# and the degenerate one-tap conv (no conv state)
SIZES = [(2, 4, 32, 4), (3, 6, 20, 3), (1, 1, 7, 4), (5, 5, 9, 2), (2, 6, 12, 1)]


@pytest.mark.parametrize("hk, hv, dh, kconv", SIZES)
def test_step_matches_reference(hk, hv, dh, kconv):
    rng = np.random.default_rng(hk * 100 + hv * 10 + dh)
    w = layer_weights(rng, hk, hv, dh, kconv)
    h = rng.standard_normal((STEPS, D))
    want = reference_outputs(w, h)
    got = native_outputs(w, hk, h)
    assert rel_err(got, want) < 1e-4, rel_err(got, want)


@pytest.mark.parametrize("hk, hv, dh, kconv", SIZES[:2])
def test_the_carried_state_matters(hk, hv, dh, kconv):
    """Controls: the step without its carried state, and the reference without the conv or with
    the v heads interleaved over the q/k heads, miss by far (the comparison sees each)."""
    rng = np.random.default_rng(hk * 100 + hv * 10 + dh)
    w = layer_weights(rng, hk, hv, dh, kconv)
    h = rng.standard_normal((STEPS, D))
    got = native_outputs(w, hk, h)
    assert rel_err(native_outputs(w, hk, h, carry=False), reference_outputs(w, h)) > 0.1
    assert rel_err(got, reference_outputs(w, h, conv=False)) > 0.1
    if hk != hv:
        assert rel_err(got, reference_outputs(w, h, tiled=False)) > 0.1


def test_bad_sizes_are_named():
    rng = np.random.default_rng(0)
    w = layer_weights(rng, 2, 4, 8, 4)
    with pytest.raises(ValueError, match="n_k_heads > 0 dividing"):
        native_outputs(w, 3, rng.standard_normal((1, D)))
    with pytest.raises(ValueError, match="u has"):
        _native.deltanet_step(w["ssm_conv1d.weight"], w["ssm_dt.bias"], w["ssm_a"], w["ssm_norm.weight"], 2, EPS,
                              np.zeros(3 * 64, np.float32), np.zeros(4 * 64, np.float32), np.zeros(5, np.float32),
                              np.zeros(32, np.float32), np.zeros(4, np.float32), np.zeros(4, np.float32))


@pytest.mark.parametrize("dh", [1, 7, 8, 13, 16, 32, 37, 128, 129, 200])
def test_every_kernel_tables_head_matches_the_reference(dh):
    """The kernel table's deltanet_head (the engine's inner loops) of every table this CPU runs
    equals the scalar reference within float rounding, several tokens in a row, at odd head dims
    (the vector tables' scalar tails and masked vectors) and past 128 (the avx512 table's second
    column block); a head without the decay misses (the control)."""
    rng = np.random.default_rng(dh)
    steps = [(rng.standard_normal(dh), rng.standard_normal(dh), rng.standard_normal(dh), float(rng.uniform(0.2, 0.95)),
              float(rng.uniform(0.1, 0.9))) for _ in range(6)]

    def run(isa, decay_on=True):
        S, outs = np.zeros(dh * dh, np.float32), []
        for q, k, v, g, b in steps:
            q, k = (x / np.linalg.norm(x) for x in (q, k))
            outs.append(_native.deltanet_head(isa, S, q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                                              g if decay_on else 1.0, b))
        return np.stack(outs), S

    want, S_want = run("ref")
    for isa in _native.available_isas():
        got, S_got = run(isa)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=isa)
        np.testing.assert_allclose(S_got, S_want, rtol=1e-5, atol=1e-5, err_msg=isa)
    assert np.abs(run("ref", decay_on=False)[0] - want).max() > 1e-2
