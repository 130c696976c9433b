"""The per-token plan: which nodes of one decode step run when, and through which buffers.

Owns the delay semantics on the runtime side. `build_plan(cfg)` compiles a config into a short
list of ops that the C engine (native/engine.c) executes for every token; the engine itself knows
nothing of delta_dense, delta_expert or moe_input, so this file and `cflow.model.ReferenceDecoder`
are the two statements of the architecture's equations (cflow.model) that the tests hold against each other.

Buffers the ops name (all float32, one row per token of the call):

    ring[H]      residual history, H = cfg.history_depth = max(dd, de) + 1; x_l lives in
                 ring[l % H]. Layer l's dense FFN reads x_{l+1-dd} (clamped to x_0), at most
                 dd layers old, and writing x_{l+1} evicts x_{l+1-H}, which nobody reads again.
    h, f         h_l = x_l + attention, f_l = dense FFN output (of the layer being run)
    pending[P+1] expert outputs waiting for their target layer t = l + de: slot t % P with
                 P = de + 1 (a slot is consumed by layer t and then reused by target t + P);
                 slot P collects outputs whose target is past the last layer ("late", added
                 before the final norm).
    moe[M]       routings: layer l's normalised MoE input and chosen experts, slot l % M. M = 1
                 unless the experts are delayed (below): then M = de + 1.

Ops (engine.h has the encoding; cflow.runtime.abi turns a Plan into it by name):

    embed            ring[0] = tok_emb[token]
    attn(l)          h = x_l + Attn_l(norm(x_l))
    dense(l)         f = FFN_l(norm(h or x_{l+1-dd}))
    route(l)         moe[l % M] = norm(h or h + f), its top-k experts (and the shared expert's
                     per-row weight sigmoid(shared_gate . moe[l % M]) when d_shared_expert > 0)
    experts(l)       pending[slot(l + de)] += [g shared(moe[l % M])] + sum_k w_k expert_k(moe[l % M])
    resid(l)         x_{l+1} = h + f + pending[l % P]; that slot is cleared
    final            logits = lm_head(norm(x_L + pending[late]))

The ops run in list order. experts(l) normally follows route(l). With `delay_experts` (experts on
disk with async reads: cflow.runtime.engine) it is placed just before resid(l + de), the first op
that needs its output (before final when l + de is past the last layer): the reads route(l)
started then overlap the attention and dense FFN of layers l+1..l+de. The results are the same bit
for bit: each pending slot receives the same terms in the same order. With `file_order` (a
`.vflow` file, cflow.runtime.readahead) experts(l) goes where `dag.schedule` puts it, which is
where the file stores its tensors, so a step reads the file front to back. Up to de + 1 routings are
then alive at once, hence M = de + 1 moe slots; the C core counts the layers in flight from the plan
(cf_plan_inflight) and sizes the smallest expert cache from it.

Each op that reads weights is one node of `cflow.dag` (same names:
"L3.attn", "L3.dense", "L3.router", "L3.experts", "embed", "lm_head"), and `Plan.stages` is
`dag.schedule(cfg)`: nodes in one stage do not depend on each other. The C engine today runs
one op at a time with all threads on each mat-vec (on few cores that already keeps the memory
bus busy), except that with `Engine.overlap` on an attn(l) followed by a dense(l) reading the ring
runs beside it on half the threads (engine.c, "overlap"); running other nodes of a stage side by
side (experts(l) beside attn(l+1)) needs per-node h/f buffers.

`Op.src` names where dense and route read their input ("h", "ring", "hf"); the C core exports
the codes of those names and of the op kinds (`_native.SOURCES`, `_native.OP_KINDS`), and
cflow.runtime.abi encodes by name, so neither number is written down twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from cflow.config import ModelConfig

@dataclass(frozen=True)
class Op:
    """One step of the plan. `a`, `b`, `c` are buffer slots, meaning per kind (see module doc);
    `src` is the input of dense and route ("h", "ring" with `a` the ring slot, or "hf")."""

    kind: str
    layer: int = 0
    a: int = 0  # route: the moe slot it writes
    b: int = 0  # experts: the moe slot it reads
    c: int = 0
    src: str | None = None

    @property
    def node(self) -> str | None:
        """The cflow.dag node this op realises (None for the residual update)."""
        return {"embed": "embed", "final": "lm_head", "resid": None, "route": f"L{self.layer}.router",
                "ple": f"L{self.layer}.dense"}.get(self.kind, f"L{self.layer}.{self.kind}")

    def describe(self) -> str:
        a, b, c, l = self.a, self.b, self.c, self.layer
        src = {"h": "h", "ring": f"ring[{a}]", "hf": "h+f"}.get(self.src or "", "")
        if self.kind == "embed":
            return f"ring[{a}] = tok_emb[token]"
        if self.kind == "attn":
            return f"h = ring[{a}] + attn{l}(norm(ring[{a}]))"
        if self.kind == "dense":
            return f"f = ffn{l}(norm({src}))"
        if self.kind == "route":
            return f"moe_in = norm({src}); top-k of router{l}" + (f" -> moe[{a}]" if a else "")
        if self.kind == "experts":
            return f"pending[{a}] += experts{l}(moe_in" + (f" of moe[{b}])" if b else ")")
        if self.kind == "ple":  # Gemma 4's per-layer-embedding block (its tensors are the dense node's)
            return f"ring[{a}] = (ring[{a}] + ple{l}(ring[{a}])) * out_scale{l}"
        if self.kind == "resid":
            parts = ["h"] + (["f"] if b else []) + ([f"pending[{c}]"] if c >= 0 else [])
            return f"ring[{a}] = {' + '.join(parts)}" + (f"; pending[{c}] = 0" if c >= 0 else "")
        return f"logits = lm_head(norm(ring[{a}]" + (f" + pending[{b}]" if b >= 0 else "") + "))"


@dataclass(frozen=True)
class Plan:
    ops: tuple[Op, ...]
    n_ring: int
    n_pending: int
    stages: tuple[tuple[str, ...], ...]  # cflow.dag.schedule(cfg): independent nodes per stage
    n_moe: int = 1  # routing slots (de + 1 when the experts are delayed)

    def describe(self) -> str:
        """One line per op (`cflow analyze --plan`, failing tests)."""
        return "\n".join(f"{i:4d}  {o.kind:<8} {o.describe()}" for i, o in enumerate(self.ops))


def build_plan(cfg: ModelConfig, delay_experts: bool = False, file_order: bool = False) -> Plan:
    """The op list for one forward pass of `cfg` (see the module docstring). delay_experts: place
    experts(l) just before the op that first needs its output instead of right after route(l).
    file_order: place experts(l) where `cflow.dag.schedule(cfg)` puts it, i.e. where a `.vflow`
    file stores its tensors, so one step reads a `.vflow` front to back (delay_experts wins when
    both are given: with experts on disk their bytes do not come from the mapping)."""
    L, dd, de = cfg.n_layers, cfg.delta_dense, cfg.delta_expert
    H = cfg.history_depth
    P = de + 1
    late = P
    delay = delay_experts and cfg.has_moe and de > 0
    by_schedule = file_order and not delay and cfg.has_moe and de > 0
    M = de + 1 if delay or by_schedule else 1

    def experts(l: int) -> Op:
        target = l + de
        return Op("experts", l, target % P if target < L else late, l % M)

    ops = [Op("embed", 0, 0)]
    for l in range(L):
        ops.append(Op("attn", l, l % H))
        if cfg.n_dense_lead:  # DeepSeek: the leading layers dense, the others MoE (undelayed)
            moe = l >= cfg.n_dense_lead
            ops += [Op("route", l, 0, src="h"), Op("experts", l, 0, 0)] if moe else [Op("dense", l, src="h")]
            ops.append(Op("resid", l, (l + 1) % H, int(not moe), 0 if moe else -1))
            continue
        if cfg.has_dense:
            if dd == 0:
                ops.append(Op("dense", l, src="h"))
            else:
                ops.append(Op("dense", l, max(l + 1 - dd, 0) % H, src="ring"))
        if cfg.has_moe:
            post_dense = cfg.moe_input == "post_dense" and cfg.has_dense
            ops.append(Op("route", l, l % M, src="hf" if post_dense else "h"))
            if not delay:
                ops.append(experts(l))
            elif l - de >= 0:  # the experts whose output this layer's residual update adds
                ops.append(experts(l - de))
        ops.append(Op("resid", l, (l + 1) % H, int(cfg.has_dense), l % P if cfg.has_moe else -1))
        if cfg.per_layer_dim or cfg.layer_out_scale:
            ops.append(Op("ple", l, (l + 1) % H))
    if delay:  # outputs whose target is past the last layer: before the final norm
        ops += [experts(l) for l in range(max(L - de, 0), L)]
    ops.append(Op("final", L - 1, L % H, late if cfg.has_moe else -1))
    stages = _stages(cfg)
    if by_schedule:
        ops = _experts_by_schedule(ops, stages, de, L)
    return Plan(tuple(ops), H, P + 1 if cfg.has_moe else 0, stages, M)


def _experts_by_schedule(ops: list[Op], stages: tuple[tuple[str, ...], ...], de: int, L: int) -> list[Op]:
    """Move each experts(l) of a layer-major plan to its place in the schedule: just before the
    first op whose node the schedule runs after it, but never before route(l) (its input) nor
    after resid(l + de) / final (its reader). Every pending slot still receives the same terms
    in the same order (one source layer per target slot; the late slot's in ascending l), so
    the results are the same bit for bit."""
    rank = {n: i for i, n in enumerate(n for s in stages for n in s)}
    waiting: list[Op] = []  # experts whose route has run, in ascending layer
    out: list[Op] = []
    for op in (o for o in ops if o.kind != "experts"):
        node_rank = rank.get(op.node) if op.node is not None else None
        # the last waiting experts that must or may run before `op`; the earlier ones go with it,
        # so they still run in ascending layer (the order the late slot sums them in)
        n_go = 0
        for i, x in enumerate(waiting):
            deadline = op.kind == "final" or (op.kind == "resid" and op.layer == x.layer + de)
            if deadline or (node_rank is not None and node_rank > rank[x.node]):
                n_go = i + 1
        out += waiting[:n_go]
        waiting = waiting[n_go:]
        out.append(op)
        if op.kind == "route":
            waiting.append(next(o for o in ops if o.kind == "experts" and o.layer == op.layer))
    return out


def _stages(cfg: ModelConfig) -> tuple[tuple[str, ...], ...]:
    from cflow import dag

    return tuple(tuple(s) for s in dag.schedule(cfg))
