"""The PyTorch reference (cflow.model): plain-transformer equivalence, decode == forward for every
preset, hand-computed delayed injection, arch5 weight sharing, parameter names, aux losses."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from cflow.config import PRESETS, ModelConfig
from cflow.model import ModelError, ReferenceDecoder, Transformer, apply_rope, rope_cos_sin

# Odd, tiny sizes: fast, and no dimension is a convenient power of two.
TINY = dict(vocab_size=67, d_model=48, n_heads=4, n_kv_heads=2, max_seq_len=40, n_layers=5)
TINY_FFN = dict(d_ff=40)
TINY_MOE = dict(d_ff=40, n_experts=3, d_expert=24)
N_POS = 33  # decode positions compared (>= 32)
TOL = 1e-4  # max |decode - forward| relative to the logit spread (fp32)


def tiny(name: str, **over) -> ModelConfig:
    base = PRESETS[name]
    extra = TINY_MOE if base.get("n_experts", 0) else TINY_FFN
    return ModelConfig.from_name(name, **{**TINY, **extra, **over})


def seeded_model(cfg: ModelConfig, seed: int = 0, std: float = 0.08) -> Transformer:
    # A larger init than training's 0.02 so that every path (attention mixing, routing, the delayed
    # residuals) visibly moves the logits; a wiring error then cannot hide under the tolerance.
    torch.manual_seed(seed)
    model = Transformer(cfg)
    model.reset_parameters(std=std)
    return model.eval()


def tokens(n: int, vocab: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / (ref.max() - ref.min())).item()


# ---- an independent plain transformer (delays 0), written from the formulas ---------------------


def plain_forward(cfg: ModelConfig, sd: dict[str, torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """Sequential pre-norm blocks: x += attn(norm x); then FFN and MoE per moe_input. Uses a
    complex-number rotary, an explicit causal mask and a dense all-experts MoE."""
    T, nh, nkv, hd = idx.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def norm(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * w

    def rope(x):  # x [T, H, hd]: pair j with j + hd/2, as a complex number rotated by pos*freq_j
        half = hd // 2
        freq = torch.tensor([cfg.rope_theta ** (-2 * j / hd) for j in range(half)], dtype=torch.float64)
        ang = torch.arange(T, dtype=torch.float64)[:, None] * freq  # [T, half]
        rot = torch.polar(torch.ones_like(ang), ang).to(torch.complex64)[:, None, :]
        z = torch.complex(x[..., :half], x[..., half:]) * rot
        return torch.cat([z.real, z.imag], dim=-1)

    def swiglu(x, g, u, dn):
        return (F.silu(x @ g.T) * (x @ u.T)) @ dn.T

    def attention(x, p):
        q = rope((x @ sd[p + "attn.wq.weight"].T).view(T, nh, hd))
        k = rope((x @ sd[p + "attn.wk.weight"].T).view(T, nkv, hd))
        v = (x @ sd[p + "attn.wv.weight"].T).view(T, nkv, hd)
        mask = torch.ones(T, T).tril().bool()
        out = torch.empty(T, nh, hd)
        for h in range(nh):
            g = h // (nh // nkv)
            s = (q[:, h] @ k[:, g].T) / math.sqrt(hd)
            out[:, h] = s.masked_fill(~mask, float("-inf")).softmax(-1) @ v[:, g]
        return out.reshape(T, nh * hd) @ sd[p + "attn.wo.weight"].T

    def moe(x, p):
        probs = (x @ sd[p + "moe.router.weight"].T).softmax(-1)  # [T, E]
        kth = probs.topk(cfg.top_k, dim=-1).values[:, -1:]
        gate = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        gate = gate / gate.sum(-1, keepdim=True)
        outs = torch.stack([swiglu(x, sd[p + "moe.w_gate"][e], sd[p + "moe.w_up"][e], sd[p + "moe.w_down"][e])
                            for e in range(cfg.n_experts)], dim=1)  # [T, E, d]
        return (gate[:, :, None] * outs).sum(1)

    x = sd["tok_emb.weight"][idx]
    for layer in range(cfg.n_layers):
        p = f"layers.{layer}."
        x = x + attention(norm(x, sd[p + "attn_norm.weight"]), p)
        f = swiglu(norm(x, sd[p + "ffn_norm.weight"]), sd[p + "ffn.w_gate.weight"], sd[p + "ffn.w_up.weight"],
                   sd[p + "ffn.w_down.weight"]) if cfg.has_dense else 0
        if not cfg.has_moe:
            x = x + f
        elif cfg.moe_input == "post_dense":
            x = x + f
            x = x + moe(norm(x, sd[p + "moe_norm.weight"]), p)
        else:  # parallel: dense and MoE both read h
            x = x + f + moe(norm(x, sd[p + "moe_norm.weight"]), p)
    out_w = sd["tok_emb.weight"] if cfg.tie_embeddings else sd["lm_head.weight"]
    return norm(x, sd["norm.weight"]) @ out_w.T


@pytest.mark.parametrize("name, over", [
    ("llama", {}),
    ("llama", {"tie_embeddings": False}),
    ("arch1", {}),
    ("arch1", {"top_k": 2, "tie_embeddings": False}),
    ("arch3", {"top_k": 2}),
])
def test_delays_zero_equals_plain_transformer(name: str, over: dict) -> None:
    cfg = tiny(name, **over)
    assert cfg.delta_dense == cfg.delta_expert == 0
    model = seeded_model(cfg)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}  # weights copied over
    idx = tokens(23, cfg.vocab_size)
    with torch.no_grad():
        logits, _ = model(idx[None])
    ref = plain_forward(cfg, sd, idx)
    assert rel_err(logits[0], ref) < 1e-5


def test_plain_transformer_check_can_fail() -> None:
    # The same comparison with one delay switched on must disagree, or the check above is vacuous.
    cfg = tiny("arch3", top_k=2)
    model = seeded_model(cfg.replace(delta_expert=1))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    idx = tokens(23, cfg.vocab_size)
    with torch.no_grad():
        logits, _ = model(idx[None])
    assert rel_err(logits[0], plain_forward(cfg, sd, idx)) > 1e-2


# ---- incremental decode == full forward --------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_reference_decoder_matches_forward(name: str) -> None:
    cfg = tiny(name)
    model = seeded_model(cfg)
    idx = tokens(N_POS, cfg.vocab_size)
    with torch.no_grad():
        full, _ = model(idx[None])  # [1, T, V]
    dec = ReferenceDecoder(model)
    steps = torch.stack([dec.step(int(t)) for t in idx])  # [T, V]
    assert steps.dtype == torch.float32 and steps.shape == (N_POS, cfg.vocab_size)
    assert rel_err(steps, full[0]) < TOL
    # reset() starts a new sequence that reproduces the first positions exactly
    dec.reset()
    again = torch.stack([dec.step(int(t)) for t in idx[:5]])
    assert torch.equal(again, steps[:5])


def test_decoder_with_larger_window_than_training() -> None:
    cfg = tiny("arch2_4_combined", max_seq_len=8)
    model = seeded_model(cfg)
    dec = ReferenceDecoder(model, max_seq_len=12)
    for t in tokens(12, cfg.vocab_size):
        dec.step(int(t))
    with pytest.raises(ModelError, match="decoder is full"):
        dec.step(0)
    with pytest.raises(ModelError, match="outside the vocabulary"):
        ReferenceDecoder(model).step(cfg.vocab_size)


# ---- hand-computed delayed injection -----------------------------------------------------------


def run_toy(cfg: ModelConfig) -> dict[str, list[torch.Tensor]]:
    """Stub every sublayer of a 3-layer model with a constant so the residual wiring is visible.

    x_0 = 0; attention adds 0; the dense FFN of layer l adds g_l = onehot(l); the MoE of layer l
    outputs c_l = 10 * onehot(3 + l). Records what each part reads (x_l, u_l, z_l) and the final
    residual entering the final norm."""
    model = Transformer(cfg)
    with torch.no_grad():
        model.tok_emb.weight.zero_()
    d = cfg.d_model
    seen: dict[str, list[torch.Tensor]] = {"x": [], "u": [], "z": [], "final": []}

    def onehot(i: int, scale: float = 1.0) -> torch.Tensor:
        return scale * F.one_hot(torch.tensor(i), d).float()

    for layer, blk in enumerate(model.layers):
        blk.attend = lambda x, cos, sin, *rest: (seen["x"].append(x[0, 0].clone()), torch.zeros_like(x))[1]
        blk.dense = lambda u, l=layer: (seen["u"].append(u[0, 0].clone()), onehot(l).expand_as(u))[1]
        blk.experts = lambda z, l=layer: (seen["z"].append(z[0, 0].clone()),
                                          (onehot(3 + l, 10.0).expand_as(z), {}))[1]
    model.norm.forward = lambda x: (seen["final"].append(x[0, 0].clone()), x)[1]
    model._mean_aux = lambda aux, like: {}
    model(torch.zeros(1, 1, dtype=torch.long))
    return seen


def vec(*entries: tuple[int, float], d: int = 8) -> torch.Tensor:
    v = torch.zeros(d)
    for i, val in entries:
        v[i] = val
    return v


def test_delayed_injection_hand_computed() -> None:
    # 3 layers, delta_dense=1, delta_expert=2, router after attention (arch2_4_combined wiring).
    cfg = ModelConfig(vocab_size=5, d_model=8, n_heads=2, n_kv_heads=1, n_layers=3, d_ff=8, n_experts=2,
                      top_k=1, d_expert=8, delta_dense=1, delta_expert=2, moe_input="post_attn")
    s = run_toy(cfg)
    g0, g1, g2 = (0, 1.0), (1, 1.0), (2, 1.0)
    c0, c1, c2 = (3, 10.0), (4, 10.0), (5, 10.0)
    # x_{l+1} = h_l + g_l + c_j for j + 2 == l: c_0 joins x_3; c_1, c_2 land past the last layer.
    assert torch.equal(s["x"][0], vec())
    assert torch.equal(s["x"][1], vec(g0))
    assert torch.equal(s["x"][2], vec(g0, g1))
    # dense reads x_l (delta_dense=1); the router reads h_l = x_l (attention adds 0).
    assert all(torch.equal(u, x) for u, x in zip(s["u"], s["x"]))
    assert all(torch.equal(z, x) for z, x in zip(s["z"], s["x"]))
    assert torch.equal(s["final"][0], vec(g0, g1, g2, c0, c1, c2))


def test_delayed_injection_other_delays() -> None:
    # delta_dense=2 (dense of layer l reads x_{l-1}, clamped to x_0), delta_expert=1, router after
    # the dense FFN (z_l = h_l + f_l).
    cfg = ModelConfig(vocab_size=5, d_model=8, n_heads=2, n_kv_heads=1, n_layers=3, d_ff=8, n_experts=2,
                      top_k=1, d_expert=8, delta_dense=2, delta_expert=1, moe_input="post_dense")
    s = run_toy(cfg)
    g0, g1, g2 = (0, 1.0), (1, 1.0), (2, 1.0)
    c0, c1, c2 = (3, 10.0), (4, 10.0), (5, 10.0)
    # x_1 = g0; x_2 = x_1 + g1 + c0; x_3 = x_2 + g2 + c1; final = x_3 + c2
    assert [x.tolist() for x in s["x"]] == [vec().tolist(), vec(g0).tolist(), vec(g0, g1, c0).tolist()]
    # u_0 = x_{-1} -> x_0, u_1 = x_0, u_2 = x_1
    assert [u.tolist() for u in s["u"]] == [vec().tolist(), vec().tolist(), vec(g0).tolist()]
    # z_l = x_l + g_l
    assert [z.tolist() for z in s["z"]] == [vec(g0).tolist(), vec(g0, g1).tolist(), vec(g0, g1, c0, g2).tolist()]
    assert torch.equal(s["final"][0], vec(g0, g1, g2, c0, c1, c2))


# ---- arch5 sharing, names, init, aux, loading ---------------------------------------------------


def test_arch5_really_shares_parameters() -> None:
    cfg = tiny("arch5", n_layers=6)
    model = Transformer(cfg)
    assert len(model.layers) == cfg.n_unique_layers == 2
    for layer in range(cfg.n_layers):
        assert model.block(layer) is model.layers[layer % 2]
    assert model.block(4).attn.wq.weight is model.block(0).attn.wq.weight
    assert {k.split(".")[1] for k in model.state_dict() if k.startswith("layers.")} == {"0", "1"}
    unshared = Transformer(cfg.replace(n_unique_layers=cfg.n_layers))
    per_block = sum(p.numel() for p in model.layers[0].parameters())
    assert unshared.num_params() - model.num_params() == 4 * per_block
    # gradients from every layer that uses a set accumulate into that one set
    logits, _ = model(tokens(7, cfg.vocab_size)[None])
    logits.sum().backward()
    assert model.layers[1].moe.router.weight.grad is not None


def design_names(cfg: ModelConfig) -> set[str]:
    names = {"tok_emb.weight", "norm.weight"} | (set() if cfg.tie_embeddings else {"lm_head.weight"})
    for i in range(cfg.n_unique_layers):
        p = f"layers.{i}."
        names |= {p + n for n in ("attn_norm.weight", "attn.wq.weight", "attn.wk.weight", "attn.wv.weight",
                                  "attn.wo.weight")}
        if cfg.has_dense:
            names |= {p + n for n in ("ffn_norm.weight", "ffn.w_gate.weight", "ffn.w_up.weight", "ffn.w_down.weight")}
        if cfg.has_moe:
            names |= {p + n for n in ("moe_norm.weight", "moe.router.weight", "moe.w_gate", "moe.w_up", "moe.w_down")}
    return names


@pytest.mark.parametrize("name, tie", [("arch1", True), ("arch5", True), ("llama", False)])
def test_parameter_names_and_shapes_follow_design(name: str, tie: bool) -> None:
    cfg = tiny(name, tie_embeddings=tie, head_dim=10)  # q_dim 40 != d_model 48
    sd = Transformer(cfg).state_dict()
    assert set(sd) == design_names(cfg)
    assert sd["layers.0.attn.wq.weight"].shape == (cfg.q_dim, cfg.d_model)
    assert sd["layers.0.attn.wk.weight"].shape == (cfg.kv_dim, cfg.d_model)
    assert sd["layers.0.attn.wo.weight"].shape == (cfg.d_model, cfg.q_dim)
    if cfg.has_moe:
        E, dx, d = cfg.n_experts, cfg.d_expert, cfg.d_model
        assert sd["layers.0.moe.w_gate"].shape == (E, dx, d) and sd["layers.0.moe.w_down"].shape == (E, d, dx)
        assert sd["layers.0.moe.router.weight"].shape == (E, d)


def test_init_scales_residual_projections() -> None:
    cfg = ModelConfig.from_name("arch1")  # d_model 128, 6 layers
    torch.manual_seed(0)
    model = Transformer(cfg)
    blk = model.layers[0]
    assert abs(blk.attn.wq.weight.std().item() / 0.02 - 1) < 0.05
    want = 0.02 / math.sqrt(2 * cfg.n_layers)
    for w in (blk.attn.wo.weight, blk.ffn.w_down.weight, blk.moe.w_down):
        assert abs(w.std().item() / want - 1) < 0.05
    assert torch.equal(blk.attn_norm.weight, torch.ones(cfg.d_model))


def test_aux_losses() -> None:
    cfg = tiny("arch2_4_combined")
    model = seeded_model(cfg)
    logits, aux = model(tokens(17, cfg.vocab_size)[None])
    assert set(aux) == {"load_balance", "router_z"}
    assert all(torch.isfinite(v) and v.ndim == 0 for v in aux.values())
    # Switch balance is E * sum f_e P_e: between 0 and E, and exactly 1 when routing is uniform
    assert 0 < aux["load_balance"].item() <= cfg.n_experts and aux["router_z"].item() > 0
    (logits.square().mean() + aux["load_balance"] + aux["router_z"]).backward()
    # every expert gets a gradient tensor, routed to or not (DDP needs no unused parameters)
    assert all(p.grad is not None for p in model.parameters())
    _, none = seeded_model(tiny("llama"))(tokens(5, 67)[None])
    assert none["load_balance"].item() == 0 and none["router_z"].item() == 0


@pytest.mark.parametrize("n_tok", [1, 2, 37])
def test_moe_dispatch_matches_a_token_by_token_reference_with_gradients(n_tok: int) -> None:
    """The grouped dispatch (sort by expert, one gather, split, one index_add) gives each token the
    weighted sum of its top-k experts, and the same gradients for x and every expert, as a plain
    loop over tokens and their chosen experts; with few tokens some experts get none (empty splits)."""
    from cflow.model import MoE

    torch.manual_seed(3)
    moe = MoE(tiny("arch4", n_experts=5, top_k=2))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(n_tok, moe.router.in_features, requires_grad=True)
    y, _ = moe(x)
    ref_moe = copy.deepcopy(moe)
    xr = x.detach().clone().requires_grad_(True)
    _, _, w, idx = ref_moe.route(xr)
    rows = []
    for t in range(n_tok):
        rows.append(sum(w[t, j] * ref_moe.expert(int(idx[t, j]), xr[t:t + 1])[0] for j in range(moe.top_k)))
    ref = torch.stack(rows)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    for (name, p), pr in zip(moe.named_parameters(), ref_moe.parameters()):
        # summed over tokens in another order: float rounding, ~1e-6 of gradients of order 0.1-1
        torch.testing.assert_close(p.grad, pr.grad if pr.grad is not None else torch.zeros_like(p), rtol=1e-4,
                                   atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_load_balance_is_one_for_uniform_routing() -> None:
    cfg = tiny("arch1")
    model = seeded_model(cfg)
    with torch.no_grad():
        for blk in model.layers:
            blk.moe.router.weight.zero_()  # uniform probs; topk ties pick expert 0: f = (1, 0, 0)
    _, aux = model(tokens(9, cfg.vocab_size)[None])
    assert aux["load_balance"].item() == pytest.approx(1.0, abs=1e-6)
    assert aux["router_z"].item() == pytest.approx(math.log(cfg.n_experts) ** 2, rel=1e-5)


def test_rope_is_the_half_convention() -> None:
    hd, pos, theta = 8, 3, 10000.0
    x = torch.arange(1.0, hd + 1)  # [hd]
    cos, sin = rope_cos_sin(pos + 1, hd, theta)
    y = apply_rope(x[None], cos[pos : pos + 1], sin[pos : pos + 1])[0]
    for j in range(hd // 2):
        a = pos * theta ** (-2 * j / hd)
        x1, x2 = x[j].item(), x[j + hd // 2].item()
        assert y[j].item() == pytest.approx(x1 * math.cos(a) - x2 * math.sin(a), abs=1e-5)
        assert y[j + hd // 2].item() == pytest.approx(x2 * math.cos(a) + x1 * math.sin(a), abs=1e-5)


def test_from_state_round_trip_and_errors() -> None:
    cfg = tiny("arch4")
    model = seeded_model(cfg)
    idx = tokens(6, cfg.vocab_size)[None]
    back = Transformer.from_state(cfg, model.state_dict())
    assert torch.equal(back(idx)[0], model(idx)[0])
    with pytest.raises(ModelError, match="missing"):
        Transformer.from_state(cfg.replace(tie_embeddings=False), model.state_dict())
    with pytest.raises(ModelError, match="shape"):
        Transformer.from_state(cfg.replace(d_ff=48), model.state_dict())


def test_sequence_longer_than_context_is_refused() -> None:
    cfg = tiny("llama", max_seq_len=8)
    with pytest.raises(ModelError, match="exceeds max_seq_len 8"):
        Transformer(cfg)(torch.zeros(1, 9, dtype=torch.long))
