"""The decode-step DAG (cflow.dag): byte accounting, critical path, slack, schedule, `cflow analyze`."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest

from cflow.cli import main
from cflow.config import PRESETS, ModelConfig
from cflow.dag import (QUANTS, DagError, analyze, build_dag, critical_path,
                       node_bytes, schedule, timings, to_dot)

DELAYED = ["arch2", "arch4", "arch2_4_combined", "arch5"]

# A geometry under which arch2_4_combined's critical path is exactly half of the sequential
# schedule at q4_0: 8,999,680 -> 4,499,840 bytes/token, i.e. the paper's "9.00 -> 4.50 MB/token"
# to its printed precision (MB = 10^6 B). Exactly 9,000,000 is out of reach under this byte
# accounting: with f32 norms every node's size is fixed modulo 9, and no integer geometry with
# 32-multiple dimensions up to d_model 2048 hits it (nor 9 MiB).
# Why it is exactly half. With delta_dense=1 the attention and the dense FFN of layer l both read
# x_l, so one layer step costs P = max(attn, dense) = dense here. With delta_expert=2 the expert
# branch of layer l (attn -> router -> experts, S bytes) has until x_{l+3}, so it stays off the
# chain while S <= 3P; only the last layer's branch extends the chain, by S - P. So
#   total    = e + L * (dense + S)        (e = embed + lm_head bytes)
#   critical = e + L * P + (S - P)
# and critical == total / 2  <=>  (L - 2) * (S - P) == e. Here (d_model 320, 13 layers, GQA 10/2
# heads, d_ff 480, 4 experts top-1 of d_expert 384, vocab 5663): attn 139,520 B, dense 260,480 B,
# router 6,400 B, experts 207,360 B, so S - P = 92,800 B and 11 * 92,800 == 1,020,800 == e
# (embed 180 B + lm_head 1,020,620 B). tests/test_dag.py checks it.
HALF_GEOMETRY: dict[str, Any] = dict(
    vocab_size=5663, d_model=320, n_layers=13, n_heads=10, n_kv_heads=2, d_ff=480,
    n_experts=4, top_k=1, d_expert=384, delta_dense=1, delta_expert=2, moe_input="post_attn",
    tie_embeddings=True,
)
HALF_QUANT = "q4_0"



def half_cfg() -> ModelConfig:
    return ModelConfig(name="half", **HALF_GEOMETRY)


# A geometry where one arch2_4_combined layer step P = dense bytes equals the expert branch
# attn + router + experts exactly (q4_0): d 128, GQA 4/1 heads (attn 23,552 B), d_ff 256 (dense
# 55,808 B), 8 experts (router 4,608 B) top-1 of d_expert 128 (experts 27,648 B); 23,552 + 4,608
# + 27,648 == 55,808.
BALANCED = dict(vocab_size=1000, d_model=128, n_layers=8, n_heads=4, n_kv_heads=1, d_ff=256, n_experts=8,
                top_k=1, d_expert=128, delta_dense=1, delta_expert=2, moe_input="post_attn")


# ---- bytes -------------------------------------------------------------------------------------


def test_node_bytes_by_hand() -> None:
    cfg = ModelConfig.from_name("arch1")  # d 128, 4 heads of 32, 2 kv heads, d_ff 256, 4 experts of 256
    # q4_0: 18 bytes per 32 weights; norms 4 bytes per weight
    assert node_bytes(cfg, "embed", "q4_0") == 128 // 32 * 18
    assert node_bytes(cfg, "attn", "q4_0") == 128 * 4 + (128 + 64 + 64) * 4 * 18 + 128 * 4 * 18
    assert node_bytes(cfg, "dense", "q4_0") == 128 * 4 + 2 * 256 * 4 * 18 + 128 * 8 * 18
    assert node_bytes(cfg, "router", "q4_0") == 128 * 4 + 4 * 128 * 4
    assert node_bytes(cfg, "experts", "q4_0") == 1 * (2 * 256 * 4 * 18 + 128 * 8 * 18)
    assert node_bytes(cfg, "lm_head", "q4_0") == 128 * 4 + 4096 * 4 * 18
    assert node_bytes(cfg, "attn", "q8_0") == 128 * 4 + (256 + 128) * 4 * 34
    assert node_bytes(cfg, "attn", "q4_1") == 128 * 4 + (256 + 128) * 4 * 20
    assert node_bytes(cfg, "attn", "f16") == 128 * 4 + (256 + 128) * 128 * 2
    assert node_bytes(cfg.replace(top_k=3), "experts", "q4_0") == 3 * node_bytes(cfg, "experts", "q4_0")


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("quant", QUANTS)
def test_total_is_the_sum_of_node_bytes(name: str, quant: str) -> None:
    cfg = ModelConfig.from_name(name)
    dag = build_dag(cfg, quant)
    r = analyze(cfg, quant)
    assert r.total_bytes == sum(n.nbytes for n in dag.nodes.values())
    assert r.total_bytes == sum(r.split.values())
    # every layer contributes its nodes once: L * (attn + dense + router + experts) + embed + lm_head
    per_layer = sum(node_bytes(cfg, k, quant) for k in ("attn", "dense", "router", "experts")
                    if k in {n.kind for n in dag.nodes.values()})
    assert r.total_bytes == cfg.n_layers * per_layer + node_bytes(cfg, "embed", quant) + node_bytes(cfg, "lm_head", quant)


def test_delays_do_not_change_total_bytes() -> None:
    totals = {analyze(ModelConfig.from_name(n)).total_bytes for n in ["arch1", "arch3", *DELAYED]}
    assert len(totals) == 1


# ---- critical path -----------------------------------------------------------------------------


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("over", [{}, {"top_k": 2, "n_layers": 3}, {"n_experts": 0, "top_k": 0, "d_expert": 0}])
def test_arch1_critical_equals_total(quant: str, over: dict) -> None:
    r = analyze(ModelConfig.from_name("arch1", **over), quant)
    assert r.critical_bytes == r.total_bytes and r.ratio == 1.0
    assert all(n.slack == 0 for n in r.nodes)
    assert r.critical_split == r.split


def longest_path_by_recursion(dag) -> int:
    # An independent longest path: memoised recursion from each node towards the sinks.
    succs = dag.succs()

    @functools.lru_cache(maxsize=None)
    def tail(n: str) -> int:
        return dag.nodes[n].nbytes + max((tail(s) for s in succs[n]), default=0)

    return max(tail(n) for n in dag.nodes)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_critical_path_against_independent_longest_path(name: str) -> None:
    cfg = ModelConfig.from_name(name)
    dag = build_dag(cfg, "q4_0")
    r = analyze(cfg, "q4_0")
    assert r.critical_bytes == longest_path_by_recursion(dag)
    assert sum(dag.nodes[n].nbytes for n in r.critical_path) == r.critical_bytes
    path = critical_path(dag)
    assert all(p in dag.preds[n] for p, n in zip(path, path[1:]))  # a real path
    assert all(n.slack >= 0 for n in r.nodes)
    assert all(t.slack == 0 for t in r.nodes if t.name in r.critical_path)
    assert r.critical_bytes <= r.total_bytes


@pytest.mark.parametrize("name", DELAYED + ["arch3"])
def test_delays_shorten_the_chain(name: str) -> None:
    assert analyze(ModelConfig.from_name(name)).ratio > 1.0


def test_documented_geometry_halves_the_critical_path() -> None:
    r = analyze(half_cfg(), HALF_QUANT)
    assert 2 * r.critical_bytes == r.total_bytes  # exactly half, in integer bytes
    assert (r.total_bytes, r.critical_bytes) == (8_999_680, 4_499_840)
    assert (f"{r.total_bytes / 1e6:.2f}", f"{r.critical_bytes / 1e6:.2f}") == ("9.00", "4.50")
    assert r.ratio == 2.0
    # the same geometry without the delays is sequential: the halving comes from the delays
    plain = analyze(half_cfg().replace(delta_dense=0, delta_expert=0, moe_input="post_dense"), HALF_QUANT)
    assert plain.critical_bytes == plain.total_bytes == r.total_bytes


def test_half_geometry_closed_form() -> None:
    cfg = half_cfg()
    b = {k: node_bytes(cfg, k, HALF_QUANT) for k in ("embed", "attn", "dense", "router", "experts", "lm_head")}
    P = max(b["attn"], b["dense"])
    S = b["attn"] + b["router"] + b["experts"]
    e = b["embed"] + b["lm_head"]
    assert P < S <= 3 * P  # experts off the chain except in the last layer
    assert (cfg.n_layers - 2) * (S - P) == e
    assert analyze(cfg, HALF_QUANT).critical_bytes == e + cfg.n_layers * P + (S - P)


def test_expert_slack_is_de_layers_worth() -> None:
    # Definition: a layer step is P = max(attn, dense) bytes (delta_dense=1: both read x_l). The
    # experts of a middle layer l may finish as late as x_{l+de+1}, so their slack is
    # (de + 1) * P - (attn + router + experts); when the expert branch costs exactly one step
    # (BALANCED) that is exactly de * P.
    cfg = ModelConfig(name="balanced", **BALANCED)
    b = {k: node_bytes(cfg, k, "q4_0") for k in ("attn", "dense", "router", "experts")}
    P = max(b["attn"], b["dense"])
    assert b["attn"] + b["router"] + b["experts"] == P == b["dense"]
    t = timings(build_dag(cfg, "q4_0"))
    de = cfg.delta_expert
    for layer in range(cfg.n_layers - de - 1):  # middle layers: their target join is on the chain
        assert t[f"L{layer}.experts"].slack == de * P
        assert t[f"L{layer}.router"].slack == de * P
    assert t[f"L{cfg.n_layers - 1}.experts"].slack == 0  # the last layer's experts are critical

    cfg = half_cfg()
    b = {k: node_bytes(cfg, k, HALF_QUANT) for k in ("attn", "dense", "router", "experts")}
    P = max(b["attn"], b["dense"])
    t = timings(build_dag(cfg, HALF_QUANT))
    want = (de + 1) * P - (b["attn"] + b["router"] + b["experts"])
    assert {t[f"L{layer}.experts"].slack for layer in range(cfg.n_layers - de - 1)} == {want}


def test_edges_follow_the_delays() -> None:
    dag = build_dag(ModelConfig.from_name("arch2_4_combined"))  # 6 layers, dd 1, de 2, post_attn
    assert dag.preds["L3.dense"] == ["x3"]  # dense reads x_l
    assert dag.preds["L3.router"] == ["L3.attn"]  # router reads h_l
    assert dag.preds["x5"] == ["L4.attn", "L4.dense", "L2.experts"]  # m_2 joins x_5
    assert dag.preds["x_final"] == ["x6", "L4.experts", "L5.experts"]
    dd2 = build_dag(ModelConfig.from_name("arch2_4_combined", delta_dense=2))
    assert dd2.preds["L0.dense"] == ["x0"] and dd2.preds["L3.dense"] == ["x2"]  # x_{l-1}, clamped
    a1 = build_dag(ModelConfig.from_name("arch1"))
    assert a1.preds["L2.dense"] == ["L2.attn"] and a1.preds["L2.router"] == ["L2.attn", "L2.dense"]
    assert a1.preds["x3"] == ["L2.attn", "L2.dense", "L2.experts"]


# ---- schedule ----------------------------------------------------------------------------------


def ancestors_of_weight_nodes(dag, n: str) -> set[str]:
    out: set[str] = set()
    stack = list(dag.preds[n])
    while stack:
        p = stack.pop()
        if dag.nodes[p].kind == "join":
            stack.extend(dag.preds[p])
        elif p not in out:
            out.add(p)
    return out


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_schedule_is_topological_and_complete(name: str) -> None:
    cfg = ModelConfig.from_name(name)
    stages = schedule(cfg)
    dag = build_dag(cfg)
    flat = [n for s in stages for n in s]
    assert sorted(flat) == sorted(n.name for n in dag.weight_nodes())  # each weight node once
    stage_of = {n: i for i, s in enumerate(stages) for n in s}
    for n in flat:
        assert all(stage_of[p] < stage_of[n] for p in ancestors_of_weight_nodes(dag, n))
    assert stages[0] == ["embed"] and stages[-1] == ["lm_head"]


def test_schedule_shapes() -> None:
    assert all(len(s) == 1 for s in schedule(ModelConfig.from_name("arch1")))  # strictly sequential
    s = schedule(ModelConfig.from_name("arch2_4_combined"))
    assert s[1] == ["L0.attn", "L0.dense"]
    assert s[4] == ["L1.experts", "L2.router", "L3.attn", "L3.dense"]  # experts of l next to l+1..l+de
    assert schedule(ModelConfig.from_name("arch5")) == s  # sharing weights does not change the order


# ---- errors, dot, CLI --------------------------------------------------------------------------


def test_bad_quant_and_geometry() -> None:
    with pytest.raises(DagError, match="unknown quantization 'q3_k'"):
        analyze(ModelConfig.from_name("arch1"), "q3_k")
    with pytest.raises(DagError, match="48 columns.*--quant f16"):
        analyze(ModelConfig.from_name("arch1", d_model=48), "q4_0")
    assert analyze(ModelConfig.from_name("arch1", d_model=48), "f16").ratio == 1.0


def test_to_dot() -> None:
    dag = build_dag(ModelConfig.from_name("arch2_4_combined"))
    dot = to_dot(dag)
    assert dot.startswith("digraph") and dot.rstrip().endswith("}")
    for p, n in dag.edges:
        assert f'"{p}" -> "{n}"' in dot
    assert dot.count("->") == len(dag.edges)
    assert '"L0.dense" -> "x1" [color="red"' in dot and '"L0.attn" -> "x1";' in dot


def test_report_to_dict_is_json() -> None:
    d = json.loads(json.dumps(analyze(ModelConfig.from_name("arch4")).to_dict()))
    assert d["ratio"] == d["total_bytes"] / d["critical_bytes"]
    assert {n["name"] for n in d["nodes"]} >= {"embed", "L0.attn", "L5.experts", "lm_head"}


def test_cli_analyze_json(capsys, tmp_path) -> None:
    dot = tmp_path / "g.dot"
    assert main(["analyze", "--preset", "arch2_4_combined", "--json", "--dot", str(dot)]) == 0
    out = json.loads(capsys.readouterr().out)
    r = analyze(ModelConfig.from_name("arch2_4_combined"))
    assert out["total_bytes"] == r.total_bytes and out["critical_bytes"] == r.critical_bytes
    assert dot.read_text() == to_dot(build_dag(ModelConfig.from_name("arch2_4_combined")))


def test_cli_analyze_config_file_and_text(capsys, tmp_path) -> None:
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(half_cfg().to_json())
    assert main(["analyze", "--config", str(tmp_path), "--quant", "q4_0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    line = {ln.split("  ")[0]: ln for ln in lines if "bytes/token" in ln or ln.startswith("ratio")}
    assert line["total weight bytes/token"].split()[3:5] == ["9.000", "MB"]
    assert line["critical-path bytes/token"].split()[2:4] == ["4.500", "MB"]
    assert line["ratio total/critical"].split()[2:4] == ["2.000", "x"]
    assert any(ln.startswith("L12.experts") and ln.endswith("*") for ln in lines)
    assert main(["analyze", "--config", str(cfg_file), "--set", "delta_expert=0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["delta_expert"] == 0


@pytest.mark.parametrize("argv, message", [
    (["analyze"], "exactly one of --preset"),
    (["analyze", "--preset", "arch1", "--config", "x.json"], "exactly one of --preset"),
    (["analyze", "--config", "/nonexistent/config.json"], "does not exist"),
    (["analyze", "--preset", "arch1", "--set", "nope=1"], "unknown config key"),
])
def test_cli_analyze_errors(capsys, argv: list[str], message: str) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err
