"""What one request decides on, taken once at its start and never changed under it.

`Source` holds the one config reference a reload swaps (a `Generation`: config and model registry, built off
the request path by cortex/config_watch.py). `take` pairs the current generation with ClusterView's latest
published state: the target list (ClusterView replaces it whole on every change, never edits it in place), the
view's liveness and block size, Cortex's in-flight totals read once, and the view handle for ledger lookups.
Every step of a decision (prepare, the policies, the PD planner, the precomputed fallback) reads this one value,
so a reload or a refresh between two of them cannot mix two states into one plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from cortex.config import CortexConfig, ModelConfig
from extproc.cluster_view import ClusterView, TargetInfo
from extproc.registry import ModelRegistry
from extproc.tenants import Directory


@dataclass(frozen=True, slots=True)
class Generation:
    """One config generation: what a reload swaps, whole."""

    number: int
    cfg: CortexConfig
    registry: ModelRegistry
    tenants: Directory = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenants", Directory(self.cfg))


class Source:
    """The one reference to the running config generation (extproc's side of item 4: reload swaps it)."""

    def __init__(self, cfg: CortexConfig, registry: ModelRegistry) -> None:
        self.current = Generation(0, cfg, registry)

    def swap(self, cfg: CortexConfig, registry: ModelRegistry) -> Generation:
        # One assignment: a request that already took the old generation keeps it to its end.
        self.current = Generation(self.current.number + 1, cfg, registry)
        return self.current


@dataclass(frozen=True, slots=True)
class Snapshot:
    gen: Generation
    targets: Mapping[str, list[TargetInfo]]
    """Routing targets by model, as ingest last published them (healthy or not)."""
    alive: bool
    """Ingest's view is live: engine loads and ledger matches can be used."""
    block_size: int
    inflight: np.ndarray
    """Cortex's in-flight requests per slot (all extproc processes), read once for this request."""
    backlog_ms: np.ndarray
    """This replica's prefill work per slot not done yet (ms), read once for this request."""
    calibration: Mapping[str, float]
    """Observed over predicted TTFT per worker id, as last read (cortex/calibration.py)."""
    view: ClusterView
    """The ledger lookup handle (match); nothing else of ClusterView is read after `take`."""

    @property
    def cfg(self) -> CortexConfig:
        return self.gen.cfg

    def candidates(self, model: str) -> list[TargetInfo]:
        """The model's healthy targets."""
        return [t for t in self.targets.get(model, ()) if t.healthy]

    def all_candidates(self) -> list[TargetInfo]:
        return [t for ts in self.targets.values() for t in ts if t.healthy]

    def model(self, name: str) -> ModelConfig | None:
        return self.gen.cfg.model(name)

    def transparent(self, model: str) -> bool:
        """Another scheduler places this model (models[].scheduling: transparent)."""
        m = self.gen.cfg.model(model)
        return m is not None and m.scheduling == "transparent"

    def match(self, keys: list[int]) -> np.ndarray | None:
        return self.view.match(keys) if self.alive else None

    def match_detail(self, keys: list[int], slots: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        return self.view.match_detail(keys, slots) if self.alive else None


def take(gen: Generation, view: ClusterView) -> Snapshot:
    return Snapshot(gen=gen, targets=view.targets, alive=view.alive, block_size=view.block_size,
                    inflight=view.inflight.totals(), backlog_ms=view.backlog.backlog_ms(),
                    calibration=view.calibration.factors, view=view)
