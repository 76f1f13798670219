"""The router: one routing decision per request, as a plan (extproc/plan.py), and the state decisions share.

    decide(req) = take a snapshot (snapshot.py) -> prepare (prepare.py) -> plan (plan.py: policy, PD planner)
    route(req)  = decide(req), then commit its plan's effects

It owns what carries from one request to the next, and is its only writer here: the predictions of blocks just
sent, the deferred prompt tails, the prefill queued per worker, the hot flags (all through `commit`; a PD
fallback's predictions through `served_alone`), the in-flight counts (`hold`, `let_go`, `leg`), the
per-tokenizer encoders and their caches, the policies and their rng. The same `decide` serves real traffic and
route explain, which never commits: the explain endpoint can neither disagree with what the gateway does nor
change it.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator

from cortex.config import CortexConfig
from cortex.model_bundle import ModelBundle
from cortex.piecewise.segment_encoder import EncoderSet, SegmentEncoder
from extproc import inference_paths, metrics, plan, prepare, snapshot
from extproc.backlog import Backlog
from extproc.breaker import Breakers, Listener
from extproc.candidates import Hysteresis
from extproc.cluster_view import ClusterView
from extproc.plan import RoutePlan
from extproc.policies import Policies
from extproc.policies.base import Decision
from extproc.predictions import Predictions
from extproc.prompt_walk import DeferredTail
from extproc.registry import ModelRegistry, Resolved
from extproc.request import ParsedRequest
from extproc.snapshot import Generation, Source


class Router:
    def __init__(self, cfg: CortexConfig, cluster: ClusterView, registry: ModelRegistry,
                 source: Source | None = None, on_breaker: Listener | None = None) -> None:
        self.cluster = cluster
        self.source = source or Source(cfg, registry)
        """The config generation in force: the one reference a reload swaps (shared with the server)."""
        self.predictions = Predictions(cfg.extproc.prediction_ttl_s, touches=cluster.touches)
        # Prompt tails past the first block no worker holds, finished into predictions after the answer.
        self.deferred = DeferredTail(self.predictions)
        # Per tokenizer: the text between special tokens encoded piece by piece with a cache, checked once.
        self.segments = EncoderSet(registry.bundles.values())
        self.backlog = Backlog(cluster.backlog)
        """The prefill work this process queued on each worker, and the typical request's (the time model)."""
        self.hysteresis = Hysteresis()
        self.policies = Policies()
        self.rng = random.Random()
        """Every random draw of a decision (ties, p2c, cold-start share): deterministic given its seed."""
        self.breakers = Breakers(cfg.breaker, on_breaker)
        """Each worker's circuit breaker, fed by the answers this process saw (extproc/breaker.py)."""

    @property
    def cfg(self) -> CortexConfig:
        return self.source.current.cfg

    @property
    def registry(self) -> ModelRegistry:
        return self.source.current.registry

    @property
    def bundles(self) -> dict[str, ModelBundle]:
        return self.source.current.registry.bundles

    def reload(self, cfg: CortexConfig, registry: ModelRegistry,
               encoders: dict[int, SegmentEncoder] | None = None) -> None:
        """Swap in a new config generation (built off the request path, with its encoders from
        `segments.build`): the next request's snapshot takes it."""
        self.source.swap(cfg, registry)
        # Caches derived from it: encoders (and their warm caches) are kept for tokenizers still in use, new ones
        # were checked off the loop; predictions made from now on live for the new TTL.
        self.segments.install(encoders if encoders is not None else self.segments.build(registry.bundles.values()))
        self.predictions.ttl_s = cfg.extproc.prediction_ttl_s
        self.breakers.cfg = cfg.breaker

    def snapshot(self, gen: Generation | None = None) -> snapshot.Snapshot:
        """`gen`: the generation the request was identified under (its stream pinned it at its headers), so a
        reload between its headers and its body cannot route it under rules it was not admitted by; default: the
        one in force."""
        return snapshot.take(self.source.current if gen is None else gen, self.cluster)

    def tokens(self, req: ParsedRequest, bundle: ModelBundle) -> tuple[list[int], bool]:
        """The prompt's token ids, and whether they were cut short for routing (prepare.tokens)."""
        return prepare.tokens(self.snapshot(), req, bundle, self.segments)

    def route(self, req: ParsedRequest) -> RoutePlan:
        """Decide a request of real traffic and commit the plan."""
        result = self.decide(req)
        self.commit(result)
        return result

    def decide(self, req: ParsedRequest, *, full_tokens: bool = False, rng: random.Random | None = None,
               gen: Generation | None = None) -> RoutePlan:
        """The plan, nothing of it committed. By default it stops tokenizing, hashing and looking up at the first
        block no worker holds or is predicted to hold, as real traffic does: the decision is the same as with the
        whole prompt, prompt_tokens is then estimated, and the rest becomes predictions after the answer (the
        plan's deferred tail). `full_tokens` computes the whole prompt and returns its token ids (route
        explain). `rng`: where the decision's random draws come from (default: the router's own sequence). `gen`: the
        stream's pinned generation (`snapshot`)."""
        snap = self.snapshot(gen)
        # Finishing deferred tails of earlier, committed requests is theirs to write, not this decision's.
        prep = prepare.prepare(snap, req, full_tokens=full_tokens, segments=self.segments,
                               predictions=self.predictions, deferred=self.deferred)
        return plan.plan(snap, prep, self, self.rng if rng is None else rng)

    def commit(self, result: RoutePlan) -> tuple[tuple[int, int], ...]:
        """Write what the plan's decisions would carry to the next request (plan.Effects). Returns the prefill it
        queued, (slot, receipt), for `settle` once the request has ended."""
        fx = result.effects
        queued = tuple((slot, self.backlog.commit(slot, prefill_ms)) for slot, prefill_ms in fx.queued)
        for p in fx.predicted:
            self.predictions.record(p.slot, p.keys, p.confirmed, p.array)
        if fx.tail is not None and not fx.tail.done:
            fx.tail.slot = fx.tail_slot
            self.deferred.submit(fx.tail)
        self.hysteresis.carry(fx.carried)
        return queued

    def settle(self, queued: tuple[tuple[int, int], ...]) -> None:
        """A committed request ended: the prefill its commit queued is done (Backlog.settle)."""
        for slot, receipt in queued:
            self.backlog.settle(slot, receipt)

    def served_alone(self, result: RoutePlan, decision: Decision) -> None:
        """A failed pair's fallback serves on `decision`'s worker: it is about to hold the prompt, so its siblings
        follow it there (as a committed decision's do)."""
        fallback = result.fallback
        if fallback is not None and fallback.keys and decision.chosen.ledger_trusted:
            self.predictions.record(decision.chosen.slot, fallback.keys)

    def hold(self, slot: int, instead_of: int | None = None) -> int:
        """A request counts as in flight on `slot` from now on (and no longer on `instead_of`): the counts every
        process's decisions read (cortex/inflight.py). Returns `slot`."""
        if instead_of is not None:
            self.cluster.inflight.dec(instead_of)
        self.cluster.inflight.inc(slot)
        return slot

    def let_go(self, slot: int) -> None:
        self.cluster.inflight.dec(slot)

    @contextlib.contextmanager
    def leg(self, slot: int) -> Iterator[None]:
        """A PD prefill leg in flight on `slot`: counted like any routed request, so a burst spreads over the
        prefill pool instead of waiting for the engines' next load report."""
        self.hold(slot)
        try:
            yield
        finally:
            self.let_go(slot)

    def route_any(self, worker_tag: str | None = None, gen: Generation | None = None) -> Decision | None:
        """A request that is no inference: the least loaded worker of the whole fleet (None: there is none), or
        first the worker a stored response's id names."""
        return plan.route_any(self.snapshot(gen), self, worker_tag)

    def route_tokenizer(self, path: str, name: str, gen: Generation | None = None
                        ) -> tuple[Resolved, Decision | None]:
        """A tokenizer endpoint's request naming model `name` (or its alias): the model resolved, and the least
        loaded of its workers (None: it has none). A ClientError(404) for a model that does not exist or whose
        engine has no such path."""
        snap = self.snapshot(gen)
        resolved = snap.gen.registry.resolve(name, lambda m: bool(snap.candidates(m)))
        inference_paths.check_served(path, resolved.model, snap.gen.registry)
        return resolved, plan.route_any(snap, self, model=resolved.model)

    def upkeep(self) -> None:
        """Background upkeep, off the request path."""
        self.predictions.expire()
        self.breakers.tick(time.monotonic())
        metrics.report_chain_caches(enc.chains for enc in self.segments.encoders())
        if self.cluster.synced:
            self.breakers.forget(self.cluster.by_address)  # workers that left the fleet
            metrics.breakers_known(t.worker for t in self.cluster.by_address.values())

