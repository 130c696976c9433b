"""Route traces: the experts a model's routers chose, token by token, and what expert speculation
predicted for each later layer, recorded by the engine and replayed into another engine.

A trace moves learned routing onto other weights: record it from a trained model on real text,
replay it through a model of the same layer and expert count but realistic expert sizes on disk,
and the expert cache, its reads and speculation see the trained model's routing (with its
predictability) instead of a random model's. The C core does the work (native/engine.h,
cf_engine_set_routes); this module owns the arrays, their checks and the file they are kept in.

    chosen [rows, layers, top_k]         int32, the experts each route chose, in top-k order
    pred   [rows, layers, depth, top_k]  int32, the top_k predicted for layer l + 1 + j from
                                         route(l)'s input; -1 past the last layer

Replaying a run's own trace reproduces it bit for bit: the choices are the ones the routers made,
and the routing weights are the router's own probabilities of them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cflow.errors import CflowError

FORMAT = "cflow-route-trace/1"
RECORD, REPLAY = 1, 2  # native/engine.h CF_ROUTES_RECORD / CF_ROUTES_REPLAY; 0 is off


class RouteTraceError(CflowError, ValueError):
    """A route trace that does not fit the engine, or a file that is not a route trace."""


@dataclass
class RouteTrace:
    chosen: np.ndarray  # [rows, layers, top_k] int32
    pred: np.ndarray  # [rows, layers, depth, top_k] int32
    meta: dict[str, Any] = field(default_factory=dict)  # where it came from (model, text, tokens)

    def __post_init__(self) -> None:
        self.chosen = np.ascontiguousarray(self.chosen, dtype=np.int32)
        self.pred = np.ascontiguousarray(self.pred, dtype=np.int32)
        if self.chosen.ndim != 3 or self.pred.ndim != 4:
            raise RouteTraceError(f"chosen must be [rows, layers, top_k] and pred [rows, layers, depth, top_k], "
                                  f"got shapes {self.chosen.shape} and {self.pred.shape}")
        rows, layers, k = self.chosen.shape
        if self.pred.shape[:2] != (rows, layers) or self.pred.shape[3] != k:
            raise RouteTraceError(f"pred {self.pred.shape} does not match chosen {self.chosen.shape}")

    @property
    def rows(self) -> int:
        return self.chosen.shape[0]

    @property
    def n_layers(self) -> int:
        return self.chosen.shape[1]

    @property
    def top_k(self) -> int:
        return self.chosen.shape[2]

    @property
    def depth(self) -> int:
        return self.pred.shape[2]

    def check_fits(self, config: Any) -> None:
        """Raise RouteTraceError unless an engine of this config can replay the trace."""
        want = (config.n_layers, config.top_k)
        if not config.n_experts or (self.n_layers, self.top_k) != want:
            raise RouteTraceError(
                f"the trace has {self.n_layers} layers of top-{self.top_k} routing, the model "
                f"{config.n_layers} layers of top-{config.top_k} over {config.n_experts} experts: a trace "
                f"replays only into a model with the same layers and top_k")
        top = int(self.chosen.max(initial=-1))
        if top >= config.n_experts:
            raise RouteTraceError(f"the trace chooses expert {top}, the model has {config.n_experts}")

    def save(self, path: str | os.PathLike) -> Path:
        """Write the trace as an .npz (compressed); returns the path written."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez_compressed(f, chosen=self.chosen, pred=self.pred,
                                meta=np.array(json.dumps(dict(self.meta, format=FORMAT))))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RouteTrace":
        try:
            with np.load(path, allow_pickle=False) as z:
                chosen, pred, meta = z["chosen"], z["pred"], json.loads(str(z["meta"]))
        except (OSError, KeyError, ValueError) as e:
            raise RouteTraceError(f"{path} is not a route trace ({e}); write one with "
                                  f"Engine.record_routes / benchmarks/route_trace.py") from e
        if meta.get("format") != FORMAT:
            raise RouteTraceError(f"{path}: format {meta.get('format')!r} is not {FORMAT!r}")
        return cls(chosen, pred, meta)
