"""One decode step as a dependency DAG: bytes per token, critical path, slack, schedule.

Owns the node names every delay-aware consumer shares (the .vflow writer, the scheduler):

    embed            one row of tok_emb                       (x_0)
    L{l}.attn        attn_norm + wq, wk, wv, wo of layer l (+ qkv_bias, q_norm, k_norm when set)
    L{l}.dense       ffn_norm + w_gate, w_up, w_down          (when d_ff > 0)
    L{l}.router      moe_norm + router [E, d]                 (when n_experts > 0)
    L{l}.experts     the top_k active experts' gate, up, down (when n_experts > 0), and the
                     shared expert (d_shared_expert > 0)
    lm_head          final norm + the [vocab, d] output matrix (tok_emb when tied)
    x{l}, x_final    zero-byte joins: the residual entering layer l (l = 0..L), and x_L plus
                     the expert outputs that land past the last layer

Edges are the data dependencies of cflow.model with the delays (indices below 0 clamp to x_0):
L{l}.attn <- x{l}; L{l}.dense <- L{l}.attn (delta_dense == 0) or x{max(l+1-dd, 0)};
L{l}.router <- L{l}.attn (+ L{l}.dense when moe_input == "post_dense"); L{l}.experts <- router
(which also hands over norm(z_l)); x{l+1} <- L{l}.attn, L{l}.dense, L{l-de}.experts;
x_final <- x{L}, L{j}.experts for j + de >= L; lm_head <- x_final.

Node weight = bytes of weights the node reads at the chosen quantization: q4_0 18 B / 32 weights,
q4_1 20 B / 32, q8_0 34 B / 32, f16 2 B / weight; norm vectors and the router matrix are f32 (as
stored in .cflow, docs/DESIGN.md). KV-cache reads and activations are not counted: this is the
weight-streaming part of the bandwidth bill. arch5 shares weight sets, but each layer still
streams its set once per token, so its bytes/token equal the unshared model's (only a cache
large enough to hold the shared sets would change that, and this model does not assume one).

"Sequential schedule" means running the nodes one after another, as a standard transformer must
(arch1: every node lies on one chain, so critical == total). The critical path is the longest
path with node weights = bytes: the bytes that must stream one after another even when every
independent node runs concurrently. Honest caveat: the delays do NOT shrink the total bytes per
token; they shorten the chain, which lets the runtime overlap reads (and disk I/O) with compute.

What the equations give for the other presets, stated plainly: arch3's dense FFN and MoE both
read h_l, and arch2 and arch4 move work off the chain too, so all three come out with
critical < total here, whereas the paper's summary lists 1.00x for the arch1/arch3 baselines and
no reduction for arch4. The summary does not say how the paper counted those; this module
follows cflow.model's equations and nothing else.

Slack of a node = latest start - earliest start, in bytes along the critical-path clock. For a
middle layer's experts in arch2_4_combined (delta_dense=1 so a layer step is P = max(attn,
dense) bytes) the expert branch may finish as late as the join x{l+de+1}, so
slack = (de + 1) * P - (attn + router + experts): the de layer steps of the delay window, plus
the step of its own layer, minus the branch's own length. When the branch costs exactly one
step (attn + router + experts == P) the slack is exactly de * P: de layers' worth.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from cflow import weights
from cflow.config import ModelConfig
from cflow.errors import CflowError
from cflow.quant import BLOCK

QUANTS = ("q4_0", "q4_1", "q8_0", "f16")
KINDS = ("embed", "attn", "dense", "router", "experts", "lm_head", "join")
CATEGORY = {"embed": "embeddings", "lm_head": "embeddings", "attn": "attention", "dense": "dense",
            "router": "experts", "experts": "experts", "join": None}
CATEGORIES = ("attention", "dense", "experts", "embeddings")

class DagError(CflowError, ValueError):
    """The DAG cannot be built for this config/quantization."""


# ---- bytes -----------------------------------------------------------------------------------


def matrix_bytes(rows: int, cols: int, quant: str) -> int:
    """Bytes of W[rows, cols] at `quant` (f32 allowed for norms and the router)."""
    if quant == "f32":
        return 4 * rows * cols
    if quant == "f16":
        return 2 * rows * cols
    if quant not in BLOCK:
        raise DagError(f"unknown quantization {quant!r}; choose one of {list(QUANTS)}")
    per, nbytes = BLOCK[quant]
    if cols % per:
        raise DagError(f"{quant} stores rows in blocks of {per} weights, but a matrix here has "
                       f"{cols} columns; choose dimensions that are multiples of {per} or use --quant f16")
    return rows * (cols // per) * nbytes


def node_bytes(cfg: ModelConfig, kind: str, quant: str) -> int:
    """Weight bytes one decode step reads for a node of `kind` (0 for joins), from the tensor
    table (cflow.weights) at `quant` (norms and the router stay f32)."""
    if kind == "join":
        return 0
    if kind not in weights.NODE_KINDS:
        raise DagError(f"unknown node kind {kind!r}")
    if kind == "embed":
        return matrix_bytes(1, cfg.d_model, quant)  # one row of tok_emb

    def size(w: weights.Weight) -> int:
        rows, cols = (1, w.shape[0]) if len(w.shape) == 1 else w.shape
        return matrix_bytes(rows, cols, "f32" if w.plain else quant)

    ws = weights.node_weights(cfg, kind)
    if kind == "experts":  # top_k experts of one weight set, all the same size here, + the shared one
        return cfg.top_k * sum(size(w) for w in ws if w.expert == 0) + sum(size(w) for w in ws if w.expert is None)
    return sum(size(w) for w in ws)


# ---- the graph -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    name: str
    kind: str  # one of KINDS
    layer: int  # -1 for embed, n_layers for lm_head and x_final
    nbytes: int

    @property
    def category(self) -> str | None:
        return CATEGORY[self.kind]


@dataclass
class Dag:
    cfg: ModelConfig
    quant: str
    nodes: dict[str, Node] = field(default_factory=dict)  # insertion order is topological
    preds: dict[str, list[str]] = field(default_factory=dict)

    def add(self, name: str, kind: str, layer: int, preds: list[str]) -> None:
        for p in preds:  # keeps insertion order topological, which the analyses rely on
            if p not in self.nodes:
                raise DagError(f"internal: node {name} depends on {p}, which is not built yet")
        self.nodes[name] = Node(name, kind, layer, node_bytes(self.cfg, kind, self.quant))
        self.preds[name] = list(dict.fromkeys(preds))

    @property
    def edges(self) -> list[tuple[str, str]]:
        return [(p, n) for n, ps in self.preds.items() for p in ps]

    def succs(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {n: [] for n in self.nodes}
        for p, n in self.edges:
            out[p].append(n)
        return out

    def weight_nodes(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.kind != "join"]


def build_dag(cfg: ModelConfig, quant: str = "q4_0") -> Dag:
    """The per-token DAG of one decode step of `cfg` with node weights at `quant`."""
    if quant not in QUANTS:
        raise DagError(f"unknown quantization {quant!r}; choose one of {list(QUANTS)}")
    L, dd, de = cfg.n_layers, cfg.delta_dense, cfg.delta_expert
    g = Dag(cfg, quant)
    g.add("embed", "embed", -1, [])
    g.add("x0", "join", 0, ["embed"])
    for l in range(L):
        attn = f"L{l}.attn"
        g.add(attn, "attn", l, [f"x{l}"])
        into_next = [attn]  # x_{l+1} = h_l + f_l + delayed experts; h_l = x_l + a_l
        router_in = [attn]  # z_l = h_l (post_attn) or h_l + f_l (post_dense)
        if cfg.has_dense:
            dense = f"L{l}.dense"
            g.add(dense, "dense", l, [attn] if dd == 0 else [f"x{max(l + 1 - dd, 0)}"])
            into_next.append(dense)
            if cfg.moe_input == "post_dense":
                router_in.append(dense)
        if cfg.has_moe:
            g.add(f"L{l}.router", "router", l, router_in)
            g.add(f"L{l}.experts", "experts", l, [f"L{l}.router"])
            if l - de >= 0:
                into_next.append(f"L{l - de}.experts")
        g.add(f"x{l + 1}", "join", l + 1, into_next)
    late = [f"L{j}.experts" for j in range(max(L - de, 0), L)] if cfg.has_moe and de > 0 else []
    g.add("x_final", "join", L, [f"x{L}", *late])
    g.add("lm_head", "lm_head", L, ["x_final"])
    return g


# ---- critical path ---------------------------------------------------------------------------


@dataclass
class NodeTiming:
    name: str
    kind: str
    layer: int
    nbytes: int
    earliest_start: int  # bytes streamed on the longest path before this node can start
    latest_start: int  # latest start that does not lengthen the critical path
    slack: int  # latest_start - earliest_start

    @property
    def critical(self) -> bool:
        return self.slack == 0


@dataclass
class Report:
    name: str
    quant: str
    total_bytes: int  # the sequential schedule: every node one after another
    critical_bytes: int  # the longest path
    split: dict[str, int]  # total bytes by category
    critical_split: dict[str, int]  # bytes on the critical path by category
    critical_path: list[str]  # weight nodes along one longest path, in order
    nodes: list[NodeTiming]  # weight nodes, topological order
    config: dict[str, Any]

    @property
    def ratio(self) -> float:
        """total / critical: how much shorter the chain is than the sequential schedule."""
        return self.total_bytes / self.critical_bytes

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ratio"] = self.ratio
        return d


def timings(dag: Dag) -> dict[str, NodeTiming]:
    """Critical-path method with durations = bytes: earliest/latest start and slack per node."""
    es: dict[str, int] = {}
    for n, node in dag.nodes.items():  # topological
        es[n] = max((es[p] + dag.nodes[p].nbytes for p in dag.preds[n]), default=0)
    critical = max(es[n] + node.nbytes for n, node in dag.nodes.items())
    succs = dag.succs()
    ls: dict[str, int] = {}
    for n in reversed(dag.nodes):
        lf = min((ls[s] for s in succs[n]), default=critical)
        ls[n] = lf - dag.nodes[n].nbytes
    return {n: NodeTiming(n, node.kind, node.layer, node.nbytes, es[n], ls[n], ls[n] - es[n])
            for n, node in dag.nodes.items()}


def critical_path(dag: Dag, t: dict[str, NodeTiming] | None = None) -> list[str]:
    """One longest path (all nodes, joins included), source to sink; ties go to the first
    predecessor in build order, so the answer is deterministic."""
    t = t or timings(dag)
    end = max(dag.nodes, key=lambda n: t[n].earliest_start + t[n].nbytes)
    path = [end]
    while dag.preds[path[-1]]:
        n = path[-1]
        path.append(next(p for p in dag.preds[n]
                         if t[p].earliest_start + t[p].nbytes == t[n].earliest_start and t[p].critical))
    return path[::-1]


def analyze(cfg: ModelConfig, quant: str = "q4_0") -> Report:
    """Bytes per token, critical path, ratio, split and per-node slack for `cfg` at `quant`."""
    dag = build_dag(cfg, quant)
    t = timings(dag)
    path = [n for n in critical_path(dag, t) if dag.nodes[n].kind != "join"]
    split = dict.fromkeys(CATEGORIES, 0)
    crit_split = dict.fromkeys(CATEGORIES, 0)
    for node in dag.weight_nodes():
        split[node.category] += node.nbytes
    for n in path:
        crit_split[dag.nodes[n].category] += dag.nodes[n].nbytes
    return Report(
        name=cfg.name,
        quant=quant,
        total_bytes=sum(n.nbytes for n in dag.nodes.values()),
        critical_bytes=max(x.earliest_start + x.nbytes for x in t.values()),
        split=split,
        critical_split=crit_split,
        critical_path=path,
        nodes=[t[n.name] for n in dag.weight_nodes()],
        config=cfg.to_dict(),
    )


# ---- schedule --------------------------------------------------------------------------------

_KIND_ORDER = {k: i for i, k in enumerate(KINDS)}


def schedule(cfg: ModelConfig) -> list[list[str]]:
    """The stage order in which the delay-aware runtime consumes weights.

    Stage s holds the weight nodes whose longest chain of weight-reading predecessors has
    length s (as soon as possible, joins cost nothing), so nodes in one stage never depend on
    each other and every dependency lies in an earlier stage. Within a stage: by layer, then
    attn, dense, router, experts. For arch2_4_combined stage s (middle of the network) is
    [L{s-3}.experts, L{s-2}.router, L{s-1}.attn, L{s-1}.dense]: the dense FFN runs next to the
    attention of its layer and the experts of l next to layers l+1..l+de.

    Consumers map names to tensors: L{l}.* reads weight set l % n_unique_layers (a shared set
    appears once per layer that uses it), L{l}.experts stands for the layer's whole expert
    table (the DAG weights it by the top_k experts a token reads), embed and lm_head both read
    tok_emb when embeddings are tied. The structure does not depend on the quantization.
    """
    dag = build_dag(cfg, "f16")
    depth: dict[str, int] = {}
    for n, node in dag.nodes.items():  # topological
        depth[n] = max((depth[p] + (dag.nodes[p].kind != "join") for p in dag.preds[n]), default=0)
    stages: list[list[str]] = [[] for _ in range(max(depth.values()) + 1)]
    for node in dag.weight_nodes():
        stages[depth[node.name]].append(node.name)
    key = lambda n: (dag.nodes[n].layer, _KIND_ORDER[dag.nodes[n].kind])  # noqa: E731
    return [sorted(s, key=key) for s in stages if s]


# ---- Graphviz --------------------------------------------------------------------------------


def to_dot(dag: Dag) -> str:
    """Graphviz source of the DAG; node labels carry bytes, the critical path is drawn bold red."""
    t = timings(dag)
    path = critical_path(dag, t)
    on_path, path_edges = set(path), set(zip(path, path[1:]))
    lines = [f'digraph "{dag.cfg.name} {dag.quant}" {{', "  rankdir=TB;",
             '  node [shape=box, fontname="Helvetica", fontsize=10];']
    for n, node in dag.nodes.items():
        style = ', color="red", penwidth=2' if n in on_path else ""
        if node.kind == "join":
            lines.append(f'  "{n}" [shape=point, xlabel="{n}"{style}];')
        else:
            mb = node.nbytes / 1e6
            lines.append(f'  "{n}" [label="{n}\\n{mb:.3f} MB\\nslack {t[n].slack / 1e6:.3f} MB"{style}];')
    for p, n in dag.edges:
        style = ' [color="red", penwidth=2]' if (p, n) in path_edges else ""
        lines.append(f'  "{p}" -> "{n}"{style};')
    lines.append("}")
    return "\n".join(lines) + "\n"
