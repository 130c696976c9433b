"""The file's view of the tensor table (`cflow.weights` states it): name -> shape lookups for
validation, the orders tensors are laid out in (`.cflow` layer by layer, `.vflow` in the order
`cflow.dag.schedule(cfg)` runs the decode step), the byte-accounting category of a tensor name and
the expert a name belongs to."""

from __future__ import annotations

from typing import Any, Collection, Iterable

from cflow import weights
from cflow.config import ModelConfig
from cflow.fileformat.errors import FormatError, MissingTensorError, MtpHeadsError
from cflow.fileformat.layout import TensorData


def expected_count(cfg: ModelConfig, split_qkv: Collection[int] = ()) -> int:
    """How many tensors `model_tensors(cfg, split_qkv=...)` lists (see `cflow.weights.count`)."""
    return weights.count(cfg, len(split_qkv))


def expected_shape(cfg: ModelConfig, name: str) -> tuple[int, ...] | None:
    """The shape the config implies for a canonical tensor name; None for any other name."""
    if name in weights.GLOBAL_NAMES:
        return model_tensors(cfg, layers=False).get(name)
    if name.startswith("mtp."):
        return {w.name: w.shape for w in weights.mtp_weights(cfg)}.get(name)
    parts = name.split(".")
    i = _index(parts[1]) if len(parts) >= 3 and parts[0] == "layers" else None
    if i is None or i >= cfg.n_unique_layers:
        return None
    key = expert_of(name)
    experts = [key[1]] if key is not None and key[1] < cfg.n_experts else []
    fused_or_parts = weights.layer_weights(cfg, i, experts) + weights.layer_weights(cfg, i, [], split_qkv=True)
    return {w.name: w.shape for w in fused_or_parts}.get(name)


def model_tensors(cfg: ModelConfig, layers: bool = True, split_qkv: Collection[int] = ()) -> dict[str, tuple[int, ...]]:
    """The tensors a model of this config stores, name -> shape, in `.cflow` (layer-major) order
    (layers=False: only the ones outside the layers; split_qkv: the weight sets whose projection
    is stored by parts, `cflow.weights.split_qkv_sets`)."""
    if layers:
        return {w.name: w.shape for w in weights.model_weights(cfg, split_qkv)}
    head, tail = weights.global_weights(cfg)
    return {w.name: w.shape for w in head + tail}


def node_tensors(cfg: ModelConfig, node: str, split_qkv: Collection[int] = ()) -> list[str]:
    """Tensor names one decode-step DAG node reads ("embed", "L{l}.attn", "L{l}.dense",
    "L{l}.router", "L{l}.experts", "lm_head"); layer l reads weight set l % n_unique_layers."""
    if node in ("embed", "lm_head"):
        return [w.name for w in weights.node_weights(cfg, node)]
    layer, _, kind = node.partition(".")
    l = _index(layer[1:]) if layer[:1] == "L" else None
    if l is None or kind not in ("attn", "dense", "router", "experts"):
        raise FormatError(f"unknown DAG node {node!r}; expected embed, L<l>.attn|dense|router|experts, lm_head")
    return [w.name for w in weights.node_weights(cfg, kind, cfg.weight_layer(l), split_qkv)]


def _flatten_nodes(obj: Any) -> list[str]:
    # dag.schedule may return node names, node objects with .name, or stages (lists) of either.
    if isinstance(obj, str):
        return [obj]
    if hasattr(obj, "name") and isinstance(obj.name, str):
        return [obj.name]
    for attr in ("stages", "nodes", "order"):
        if hasattr(obj, attr) and not callable(getattr(obj, attr)):
            return _flatten_nodes(getattr(obj, attr))
    return [n for item in obj for n in _flatten_nodes(item)]


def schedule_order(cfg: ModelConfig, split_qkv: Collection[int] = ()) -> list[str]:
    """Tensor names in `.vflow` order: each at its first use in `cflow.dag.schedule(cfg)`."""
    try:
        from cflow import dag  # imported late: only vflow writing needs the scheduler
    except ImportError as e:
        raise FormatError(f"writing .vflow needs the scheduler (cflow.dag), which failed to import: {e}") from None

    seen: dict[str, None] = {}
    for node in _flatten_nodes(dag.schedule(cfg)):
        for name in node_tensors(cfg, node, split_qkv):
            seen.setdefault(name, None)
    return list(seen)


def order_tensors(items: list[TensorData], cfg: ModelConfig, order: str) -> list[TensorData]:
    split = weights.split_qkv_sets(t.name for t in items)
    canon = schedule_order(cfg, split) if order == "vflow" else list(model_tensors(cfg, split_qkv=split))
    placed = set(canon)
    canon += [n for n in model_tensors(cfg, split_qkv=split) if n not in placed]  # anything the schedule skipped
    rank = {n: k for k, n in enumerate(canon)}
    # Unknown names go last in the order given (sorted() is stable).
    return sorted(items, key=lambda t: rank.get(t.name, len(rank)))


def tensor_category(name: str) -> str:
    """Byte-accounting category: embeddings, attention, dense, router, experts, shared_expert
    (RAM-resident like dense), norms, other."""
    if name in ("tok_emb", "lm_head", "ple_emb", "ple_proj"):  # ple_*: Gemma 4's per-layer embeddings
        return "embeddings"
    if name == "norm" or name.endswith(("_norm", "_norm_1", ".out_scale")):
        return "norms"
    for key, cat in ((".attn.", "attention"), (".ffn.", "dense"), (".ple.", "dense"), (".moe.experts.", "experts"),
                     (".moe.shared.", "shared_expert"), (".moe.router", "router"), (".moe.shared_gate", "router"),
                     (".moe.expert_scale", "router")):
        if key in name:
            return cat
    return "other"


def _index(s: str) -> int | None:
    # a canonical decimal index ("0", "17"; not "07", "²" or "-1")
    return int(s) if s.isascii() and s.isdigit() and str(int(s)) == s else None


def expert_of(name: str) -> tuple[int, int] | None:
    """(weight layer, expert) for `layers.{i}.moe.experts.{e}.*`, else None."""
    parts = name.split(".")
    if len(parts) >= 5 and parts[0] == "layers" and parts[2:4] == ["moe", "experts"]:
        i, e = _index(parts[1]), _index(parts[4])
        if i is not None and e is not None:
            return i, e
    return None


def check_mtp(cfg: ModelConfig, names: Iterable[str]) -> None:
    """A file carries exactly the multi-token prediction heads its config declares: the tensors
    mtp.{j}.w_up / w_down / norm for j < mtp_heads, and no other `mtp.` name."""
    want = {w.name for w in weights.mtp_weights(cfg)}
    have = {n for n in names if n.startswith("mtp.")}
    if have == want:
        return
    missing, extra = sorted(want - have), sorted(have - want)
    what = []
    if missing:
        what.append(f"lacks {len(missing)} of their tensors, e.g. {missing[:3]}")
    if extra:
        what.append(f"holds {len(extra)} tensor(s) of no declared head, e.g. {extra[:3]}")
    raise MtpHeadsError(f"the config declares mtp_heads={cfg.mtp_heads} multi-token prediction head(s) but the "
                        f"file {' and '.join(what)}; export the checkpoint again (`cflow export DIR OUT.cflow`)")


def check_complete(names: Iterable[str], shapes: dict[str, tuple[int, ...]]) -> None:
    have = set(names)
    missing = [n for n in shapes if n not in have]
    if missing:
        raise MissingTensorError(f"the model needs {len(missing)} tensor(s) the file does not hold, e.g. "
                                 f"{missing[:3]}; re-convert the model")
