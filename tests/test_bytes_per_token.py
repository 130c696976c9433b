"""Weight bytes per token, counted three ways that must agree: the DAG's analytic count from the
tensor table at a quantization (cflow.dag), the engine's analytic count from the file's own tensor
sizes (Engine.weight_bytes_per_token, also through cflow.weights), and the C engine's counters,
which measure what a decode step actually touched."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from test_engine import small_config, write_random_model  # noqa: E402

from cflow import dag, weights  # noqa: E402
from cflow.runtime import Engine  # noqa: E402

WEIGHT_COUNTERS = ("attn", "dense", "router", "experts", "embed", "lm_head")


@pytest.mark.parametrize("preset,tied,options", [("llama", True, False), ("llama", False, False), ("arch1", False, False),
                                                 ("arch2_4_combined", False, False), ("arch5", True, False),
                                                 ("llama", True, True), ("arch5", False, True)])
def test_dag_engine_and_counters_agree(tmp_path, preset, tied, options):
    # options: the options of the Qwen families (bias, q/k norms and a shared expert are weights too)
    cfg = small_config(preset, tied=tied).replace(qkv_bias=options, qk_norm=options)
    if options and cfg.has_moe:
        cfg = cfg.replace(d_shared_expert=64, moe_norm_topk=False)
    counts_agree(tmp_path, cfg)


def test_gemma_options_are_counted(tmp_path):
    """Gemma's post-norms are weights of the attn and dense nodes; its window pattern and GeGLU read
    the same matrices."""
    counts_agree(tmp_path, small_config("llama", tied=True).replace(
        qk_norm=True, post_norms=True, ffn_act="gelu_tanh", embed_scale=3.0, sliding_window=4,
        sliding_window_pattern=3, rope_theta_local=100.0))


def counts_agree(tmp_path, cfg):
    path = tmp_path / "m.cflow"
    write_random_model(path, cfg, "q4_0", (64, 64))
    eng = Engine.load(path, threads=1)
    eng.prefill([3, 4])
    eng.reset_counters()
    eng.step(5, 2)
    c = eng.counters()
    measured = sum(c[k] for k in WEIGHT_COUNTERS)
    analytic = dag.analyze(cfg, "q4_0").total_bytes
    assert measured == analytic == eng.weight_bytes_per_token()
    # and node by node: what the counters call a category is what the table puts on that node
    by_node = weights.token_bytes(cfg, lambda w: eng.file.tensors[w.name].nbytes)
    for kind in WEIGHT_COUNTERS:  # the counters are named after the DAG's node kinds
        assert c[kind] == by_node[kind], kind


def test_table_is_what_the_file_holds(tmp_path):
    cfg = small_config("arch2_4_combined", tied=False).replace(d_shared_expert=32)
    path = tmp_path / "m.cflow"
    write_random_model(path, cfg, "q8_0", (64, 64))
    eng = Engine.load(path, threads=1)
    table = {w.name: w.shape for w in weights.model_weights(cfg)}
    assert table == {n: tuple(e.shape) for n, e in eng.file.tensors.items()}
    assert len(table) == weights.count(cfg)
