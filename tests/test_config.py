"""ModelConfig: presets, (de)serialization, derived fields, and every named ConfigError."""

from __future__ import annotations

import pytest

from cflow.config import PRESETS, ConfigError, ModelConfig, parse_overrides
from cflow.errors import CflowError

SPEC_TABLE = {  # the paper's table: preset -> (delta_dense, delta_expert, moe_input)
    "arch1": (0, 0, "post_dense"),
    "arch3": (0, 0, "post_attn"),
    "arch2": (1, 0, "post_attn"),
    "arch4": (0, 2, "post_attn"),
    "arch2_4_combined": (1, 2, "post_attn"),
    "arch5": (1, 2, "post_attn"),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_is_valid_and_round_trips(name: str) -> None:
    cfg = ModelConfig.from_name(name)
    assert cfg.name == name
    back = ModelConfig.from_json(cfg.to_json())
    assert back == cfg and back.name == name
    assert back.to_dict() == cfg.to_dict()
    assert cfg.head_dim * cfg.n_heads == cfg.q_dim


@pytest.mark.parametrize("name", sorted(SPEC_TABLE))
def test_presets_match_the_spec_table(name: str) -> None:
    cfg = ModelConfig.from_name(name)
    assert (cfg.delta_dense, cfg.delta_expert, cfg.moe_input) == SPEC_TABLE[name]
    assert cfg.has_moe and cfg.has_dense
    assert cfg.history_depth == max(cfg.delta_dense, cfg.delta_expert) + 1
    shared = name == "arch5"
    assert (cfg.n_unique_layers < cfg.n_layers) == shared


def test_llama_preset_is_plain() -> None:
    cfg = ModelConfig.from_name("llama")
    assert not cfg.has_moe and cfg.delta_dense == cfg.delta_expert == 0 and cfg.history_depth == 1


def test_derived_fields() -> None:
    cfg = ModelConfig(d_model=96, n_heads=6, n_kv_heads=2)
    assert cfg.head_dim == 16 and cfg.q_dim == 96 and cfg.kv_dim == 32
    assert cfg.n_unique_layers == cfg.n_layers
    # head_dim and n_unique_layers follow the fields they were derived from...
    wider = cfg.replace(d_model=192)
    assert wider.head_dim == 32
    deeper = cfg.replace(n_layers=7)
    assert deeper.n_unique_layers == 7
    # ...but explicit choices survive.
    explicit = ModelConfig(d_model=96, n_heads=4, n_kv_heads=2, head_dim=40)
    assert explicit.replace(d_model=128).head_dim == 40 and explicit.q_dim == 160
    arch5 = ModelConfig.from_name("arch5")
    assert arch5.replace(n_layers=8).n_unique_layers == arch5.n_unique_layers
    assert [arch5.weight_layer(l) for l in range(4)] == [0, 1, 0, 1]


def test_overrides_are_typed() -> None:
    cfg = ModelConfig.from_name("arch1").with_overrides(
        ["d_model=64", "rope_theta=5e5", "tie_embeddings=false", "moe_input=post_attn", "name=x"])
    assert cfg.d_model == 64 and cfg.head_dim == 16
    assert cfg.rope_theta == 500000.0 and cfg.tie_embeddings is False
    assert cfg.moe_input == "post_attn" and cfg.name == "x"
    assert parse_overrides(["top_k = 2"]) == {"top_k": 2}


def test_int_given_for_float_is_normalised() -> None:
    cfg = ModelConfig.from_json('{"rope_theta": 500000}')
    assert isinstance(cfg.rope_theta, float) and cfg.rope_theta == 500000.0


BAD_CONFIGS = {
    "n_heads % n_kv_heads": (dict(n_heads=4, n_kv_heads=3), "divisible by n_kv_heads"),
    "negative delta_dense": (dict(delta_dense=-1), "delta_dense must be >= 0"),
    "negative delta_expert": (dict(n_experts=4, top_k=1, d_expert=64, delta_expert=-2),
                              "delta_expert must be >= 0"),
    "top_k > n_experts": (dict(n_experts=4, top_k=5, d_expert=64), "top_k must be in 1..n_experts"),
    "top_k 0 with experts": (dict(n_experts=4, top_k=0, d_expert=64), "top_k must be in 1..n_experts"),
    "top_k without experts": (dict(top_k=1), "top_k must be 0 without experts"),
    "d_expert missing": (dict(n_experts=4, top_k=1), "d_expert must be positive"),
    "delta_expert without experts": (dict(delta_expert=1), "delta_expert needs experts"),
    "delta_dense without dense": (dict(d_ff=0, n_experts=2, top_k=1, d_expert=32, delta_dense=1),
                                  "delta_dense needs a dense FFN"),
    "no FFN at all": (dict(d_ff=0), "needs a dense FFN (d_ff > 0) or experts"),
    "moe_input": (dict(moe_input="pre_attn"), "moe_input must be one of"),
    "n_unique_layers > n_layers": (dict(n_layers=4, n_unique_layers=5), "n_unique_layers must be in 1..n_layers"),
    "d_model not divisible by heads": (dict(d_model=100, n_heads=3, n_kv_heads=1), "head_dim must be positive"),
    "odd head_dim": (dict(d_model=36, n_heads=4, n_kv_heads=2), "head_dim must be even"),
    "vocab_size 0": (dict(vocab_size=0), "vocab_size must be positive"),
    "n_kv_heads 0": (dict(n_kv_heads=0), "n_heads and n_kv_heads must be positive"),
    "negative d_ff": (dict(d_ff=-8), "d_ff must be >= 0"),
    "rope_theta 0": (dict(rope_theta=0.0), "rope_theta must be positive"),
    "norm_eps 0": (dict(norm_eps=0.0), "norm_eps must be positive"),
    "max_seq_len 0": (dict(max_seq_len=0), "max_seq_len must be positive"),
    "int field given a float": (dict(d_model=128.0), "d_model must be an int"),
    "int field given a bool": (dict(n_layers=True), "n_layers must be an int"),
    "int field given a string": (dict(d_model="128"), "d_model must be an int"),
    "float field given a string": (dict(rope_theta="big"), "rope_theta must be a finite number"),
    "float field not finite": (dict(norm_eps=float("nan")), "norm_eps must be a finite number"),
    "bool field given a string": (dict(tie_embeddings="no"), "tie_embeddings must be true or false"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_raises_named_error(case: str) -> None:
    kwargs, message = BAD_CONFIGS[case]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(**kwargs)


BAD_OVERRIDES = {
    "unknown key": (["d_modle=64"], "unknown config key 'd_modle'"),
    "no equals sign": (["d_model"], "must look like key=value"),
    "int given text": (["n_layers=six"], "n_layers='six': expected a value of type int"),
    "int given a float": (["n_layers=2.5"], "expected a value of type int"),
    "float given text": (["rope_theta=high"], "expected a value of type float"),
    "bool given text": (["tie_embeddings=maybe"], "expected a value of type bool"),
    "valid type, invalid value": (["top_k=9"], "top_k must be 0 without experts"),
}


@pytest.mark.parametrize("case", sorted(BAD_OVERRIDES))
def test_bad_override_raises_named_error(case: str) -> None:
    assignments, message = BAD_OVERRIDES[case]
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_name("llama").with_overrides(assignments)


def test_unknown_preset() -> None:
    with pytest.raises(ConfigError, match="unknown preset 'arch9'"):
        ModelConfig.from_name("arch9")


@pytest.mark.parametrize("text, message", [
    ('{"d_model": 64, "colour": "red"}', r"unknown config keys \['colour'\]"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be an object"),
    ('{"n_heads": 4, "n_kv_heads": 3}', "divisible"),
])
def test_bad_json(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_json(text)


def test_config_error_is_a_cflow_error() -> None:
    assert issubclass(ConfigError, CflowError) and issubclass(ConfigError, ValueError)
