"""Decide: one request's plan from its snapshot, prepare -> policy -> PD planner -> RoutePlan.

The plan is one value: the decision (the first attempt and its retry order), the PD pair or why the request
skips it, the precomputed fallback for a pair that fails before the client got a byte, and the body changes.
The server maps it onto Envoy's header and body mutations and runs the PD legs; it never asks for another
decision. Nothing here writes the state decisions share: what committing the plan would write into it (the
prefill queued on the chosen worker, the blocks it is predicted to hold, the prompt's deferred tail, the hot
flags) is part of the plan, `Effects`, and only the router's `commit` applies it, so route explain, which never
commits, cannot change what the next request sees. Its random draws come from the rng it is given.
Nothing does I/O.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from cortex.errors import ClientError
from extproc import candidates, pd, response_ids
from extproc.backlog import Backlog
from extproc.breaker import Breakers
from extproc.candidates import Hysteresis
from extproc.cluster_view import TargetInfo
from extproc.policies import Policies, ttft
from extproc.policies.base import Candidate, Decision, Facts, Policy, by_activity
from extproc.predictions import Predictions
from extproc.prepare import Prepared, Timings
from extproc.prompt_walk import Tail
from extproc.snapshot import Snapshot


class State(Protocol):
    """What decisions read of the state carried from one request to the next (extproc/router.py owns and writes
    it); `rng` is what route_any draws from (a plan draws from the rng it is given)."""

    predictions: Predictions
    backlog: Backlog
    hysteresis: Hysteresis
    policies: Policies
    rng: random.Random
    breakers: Breakers


@dataclass(frozen=True, slots=True)
class Predicted:
    """`keys` were sent to `slot` (Predictions.record): the first `confirmed` the ledger shows held there."""

    slot: int
    keys: Sequence[int]
    confirmed: int = 0
    array: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class Effects:
    """What committing a plan writes into the state decisions share (extproc/router.py: Router.commit)."""

    queued: tuple[tuple[int, float], ...] = ()
    """(slot, prefill ms): the chosen worker's prefill, queued behind what this process sent there (backlog.py)."""
    predicted: tuple[Predicted, ...] = ()
    tail: Tail | None = None
    """The prompt past where the walk stopped, to become `tail_slot`'s predictions after the answer."""
    tail_slot: int = -1
    carried: tuple[Candidate, ...] = ()
    """Every candidate the plan's decisions saw: their hot flags carry over (candidates.Hysteresis.carry)."""

    def flags_only(self) -> Effects:
        """These effects once the request goes to another worker than the plan chose (a gateway's subset): what
        they say of the chosen worker is not true of it."""
        return Effects(carried=self.carried)


@dataclass(slots=True)
class _Draft:
    """Effects as a plan's decisions add to them."""

    queued: list[tuple[int, float]] = field(default_factory=list)
    predicted: list[Predicted] = field(default_factory=list)
    tail: Tail | None = None
    tail_slot: int = -1
    carried: list[Candidate] = field(default_factory=list)

    def freeze(self) -> Effects:
        return Effects(tuple(self.queued), tuple(self.predicted), self.tail, self.tail_slot, tuple(self.carried))


BREAKER_OPEN = "breaker_open"
"""The reason of a decision whose first choice would have been a worker its circuit breaker skips."""


def decide(policy: Policy, cands: Sequence[Candidate], facts: Facts, rng: random.Random,
           skip: frozenset[str]) -> Decision:
    """The policy's decision with the workers whose breaker is open (addresses in `skip`) out of first choice: they
    follow every other candidate, as last-resort retry targets. The policy decides over them all first: when its
    first choice is not skipped, that decision stands (the reason is the policy's, the skipped go last); when it is,
    the policy decides again without them and the reason is `breaker_open`. With every candidate skipped they all
    compete alike. Only while some breaker is open does a decision cost two policy runs."""
    if not skip:
        return policy.decide(cands, facts, rng)
    usable = [c for c in cands if c.address not in skip]
    natural = policy.decide(cands, facts, rng)
    if not usable:
        return natural
    if natural.chosen.address not in skip:
        return replace(natural, order=(*(c for c in natural.order if c.address not in skip),
                                       *(c for c in natural.order if c.address in skip)))
    first = policy.decide(usable, facts, rng)
    return replace(first, order=(*first.order, *by_activity(c for c in cands if c.address in skip)),
                   reason=BREAKER_OPEN)


@dataclass(frozen=True, slots=True)
class Fallback:
    """Where a request whose PD pair failed before its first byte is served alone, decided with the plan (seed 000
    §2.4): the fallback pool's candidates as the snapshot saw them, and the decision over all of them. Which of the
    pair's workers to leave out is only known once it failed: `without` decides again over the rest, purely."""

    pool: tuple[TargetInfo, ...]
    cands: tuple[Candidate, ...]
    facts: Facts
    why: str
    """prepare's reason, refined again for the workers left (candidates.why_not_exact)."""
    matches: np.ndarray | None
    policy: Policy
    decision: Decision
    keys: tuple[int, ...]
    """The prompt's block keys: the serving worker's predictions, once it serves."""
    seed: int

    def without(self, exclude: frozenset[str]) -> Decision:
        """The decision with the workers (ids without a rank) of `exclude` left out, unless nothing else is left."""
        workers = [t for t in self.pool if t.worker not in exclude]
        if not workers or len(workers) == len(self.pool):
            return self.decision
        kept_ids = {t.id for t in workers}
        kept = [c for c in self.cands if c.id in kept_ids]
        if not kept:
            return self.decision
        facts = replace(self.facts, why_not_exact=candidates.why_not_exact(self.why, workers, self.matches, kept))
        return self.policy.decide(kept, facts, random.Random(self.seed))


@dataclass(frozen=True, slots=True)
class RoutePlan:
    decision: Decision
    """The first attempt and its retry order (a pair's decode leg when there is a pair)."""
    prompt_tokens: int
    token_ids: list[int] | None
    timings: Timings = field(default_factory=Timings)
    truncated: bool = False
    """The prompt was longer than extproc.max_tokenize_chars; prompt_tokens counts only the routed prefix."""
    model: str = ""
    """The configured model that serves it (differs from the request's when an alias was used)."""
    alias: str | None = None
    """The public name the client used, when it was an alias."""
    lora: str | None = None
    """The LoRA adapter whose blocks the prompt was matched against (None: the base model's)."""
    pd: pd.PdPlan | None = None
    """Set when the model has a PD pool: the pair (prefill and decode decisions) or why the request skips it."""
    prompt_tokens_estimated: bool = False
    """Routing stopped before the end of the prompt (token_ids is None): prompt_tokens is an estimate."""
    fallback: Fallback | None = None
    """With a pair: where the request goes alone if the pair fails first (None: no worker serves it alone)."""
    changes: dict[str, object] = field(default_factory=dict)
    """Fields spliced into the body for every worker (the served model when the client named an alias)."""
    generation: int = 0
    """The config generation it was decided with."""
    head_ids: list[int] = field(default_factory=list)
    """The prompt's first ids and its fingerprint (Prepared's), for the request log."""
    prompt_hash: str = ""
    withheld: dict[int, int] = field(default_factory=dict)
    """Per hybrid slot: blocks its full-attention run held that its sliding windows did not (Prepared's)."""
    effects: Effects = field(default_factory=Effects)
    """What committing it writes (Router.commit); route explain leaves it unapplied."""


def _inputs(snap: Snapshot, prep: Prepared, workers: Sequence[TargetInfo], state: State,
            fx: _Draft) -> tuple[list[Candidate], Facts, Policy]:
    matches, keys = prep.matches, prep.keys
    scoring = snap.cfg.scheduler
    typical = state.backlog.typical_ms
    cands = candidates.build(workers, matches=matches, keys=keys, inflight=snap.inflight, alive=snap.alive,
                             predictions=state.predictions, hysteresis=state.hysteresis, scoring=scoring,
                             backlog_ms=snap.backlog_ms, calibration=snap.calibration if scoring.calibrate else None,
                             typical_prefill_ms=typical, lower=prep.lower)
    fx.carried.extend(cands)
    facts = Facts(block_size=snap.block_size, ledger_usable=matches is not None,
                  why_not_exact=candidates.why_not_exact(prep.why, workers, matches, cands), scoring=scoring,
                  home=home_key(keys, matches) if scoring.prompt_home else None, session=prep.session,
                  prompt_tokens=prep.prompt_tokens, typical_prefill_ms=typical)
    policy = state.policies.select(cands, transparent=prep.transparent, alive=snap.alive,
                                   ledger_usable=matches is not None, rule=scoring.rule)
    return cands, facts, policy


def home_key(keys: Sequence[int], matches: np.ndarray | None) -> int | None:
    """The key a prompt's rendezvous home is drawn from: the first block past the longest prefix any worker
    holds. Prompts that share only a system prompt then get homes of their own (their first block would send all
    of them to one worker on every replica at once), while identical prompts still share one. The walk always
    computes that key, so an early-stopped decision and a whole-prompt one draw the same home."""
    if not keys:
        return None
    held = int(matches.max()) if matches is not None and len(matches) else 0
    return keys[min(held, len(keys) - 1)]


def _queued(decision: Decision, facts: Facts) -> tuple[int, float]:
    """The chosen worker's prefill, to queue behind what was sent there: the time model's estimate, also for a
    decision another policy made, so switching rules keeps the queue right."""
    est = decision.estimates.get(decision.chosen.id) or ttft.estimate(decision.chosen, facts)
    return decision.chosen.slot, est.calibration * est.prefill_ms


def choose(snap: Snapshot, prep: Prepared, workers: Sequence[TargetInfo], state: State, rng: random.Random,
           fx: _Draft, *, answer: bool, queue: bool | None = None, holder: str | None = None) -> Decision:
    """One pool's decision for a prepared prompt (a pool whose workers publish no events simply holds nothing in
    the ledger, so it is chosen by load). For the request's `answer`, the effects name the chosen target's
    coming blocks as predicted and queue its prefill (`queue`, default `answer`: a PD prefill leg queues work
    without being the answer). `holder`: the tag of the worker that stored the previous response, chosen first
    when it is a candidate (response_ids.pin), before the effects name it."""
    t0 = time.perf_counter()
    cands, facts, policy = _inputs(snap, prep, workers, state, fx)
    skip = state.breakers.skipped((c.address for c in cands), time.monotonic())
    decision = response_ids.pin(decide(policy, cands, facts, rng, skip), holder)
    prep.timings.score_s += time.perf_counter() - t0
    if answer if queue is None else queue:
        fx.queued.append(_queued(decision, facts))
    keys = prep.keys
    if answer and keys and decision.chosen.ledger_trusted:
        slot = decision.chosen.slot
        fx.predicted.append(Predicted(slot, keys, int(prep.matches[slot]) if prep.matches is not None else 0,
                                      prep.key_array))
        if prep.tail is not None and not prep.tail.done:
            fx.tail, fx.tail_slot = prep.tail, slot  # the rest of the prompt, after the answer
    return decision


def _pd(snap: Snapshot, prep: Prepared, pools: pd.Pools, state: State, rng: random.Random, fx: _Draft
        ) -> pd.PdPlan:
    """The PD planner step: the pair, or why one worker serves the request alone (docs/pd.md)."""
    cfg = snap.cfg.pd(prep.model)
    stream = isinstance(prep.body, dict) and prep.body.get("stream") is True

    queued = len(fx.queued)

    def skip(why: str) -> pd.PdPlan:
        del fx.queued[queued:]  # a pair that does not stand queues nothing on its prefill worker
        return pd.PdPlan(None, why, pools.engine, prep.model, cfg, stream)
    single = pools.single
    # The PD legs speak chat completions and completions only (extproc/pd_dispatch.py).
    shape = pd.request_shape_skip(prep.body, pools.engine) if prep.api in ("chat", "completion") else pd.SKIP_API
    if shape is not None and (single or shape == pd.SKIP_API):
        return skip(shape)
    prefill = choose(snap, prep, pools.prefill, state, rng, fx, answer=False, queue=True)
    if single:
        # The uncached part is measured on the worker that would serve alone (the one the policy picks, load
        # included), not on the best holder: a skip to a cold worker computes the whole prompt again.
        alone = choose(snap, prep, single, state, rng, fx, answer=False).chosen
        bs = snap.block_size
        why = pd.skip_reason(prompt_tokens=prep.prompt_tokens,
                             prefill_cached_tokens=round(prefill.chosen.affinity_blocks * bs),
                             single_cached_tokens=round(alone.affinity_blocks * bs), cfg=cfg)
        if why is not None:
            return skip(why)
    if prep.keys and prefill.chosen.ledger_trusted:
        fx.predicted.append(Predicted(prefill.chosen.slot, prep.keys))
    decode = choose(snap, prep, pools.decode, state, rng, fx, answer=False)
    targets = {t.id: t for t in (*pools.prefill, *pools.decode)}
    return pd.PdPlan(pd.Pair(prefill, decode, targets), "", pools.engine, prep.model, cfg, stream)


def _fallback(snap: Snapshot, prep: Prepared, pools: pd.Pools, state: State, rng: random.Random, fx: _Draft
              ) -> Fallback | None:
    pool = pd.fallback_pool(pools)
    if not pool:
        return None
    cands, facts, policy = _inputs(snap, prep, pool, state, fx)
    seed = rng.getrandbits(64)
    decision = policy.decide(cands, facts, random.Random(seed))
    return Fallback(tuple(pool), tuple(cands), facts, prep.why, prep.matches, policy, decision, tuple(prep.keys),
                    seed)


def plan(snap: Snapshot, prep: Prepared, state: State, rng: random.Random) -> RoutePlan:
    pools = prep.pools
    fx = _Draft()
    pd_plan = _pd(snap, prep, pools, state, rng, fx) if pools is not None and pools.pd_ready else None
    fallback = None
    if pd_plan is not None and pd_plan.pair is not None:
        assert pools is not None
        decision = pd_plan.pair.decode
        fallback = _fallback(snap, prep, pools, state, rng, fx)
    else:
        # No pair: the workers that serve a request alone (all of them in transparent mode).
        workers = prep.workers if pools is None else pools.single
        if not workers:
            assert pools is not None  # prepare() refused a model without healthy workers
            raise ClientError(503, pd.no_pool_message(prep.model, pools), "model", reason="no_worker")
        decision = choose(snap, prep, workers, state, rng, fx, answer=True, holder=prep.response_holder)
    # The worker serves the model, not the public alias; a Responses answer is named after its worker.
    changes: dict[str, object] = {"model": prep.model} if prep.alias is not None else {}
    if prep.mint_response_id:
        changes["request_id"] = response_ids.mint(decision.chosen.address, rng)
    return RoutePlan(decision=decision, prompt_tokens=prep.prompt_tokens,
                     token_ids=None if prep.walked else prep.ids, timings=prep.timings, truncated=prep.truncated,
                     model=prep.model, alias=prep.alias, lora=prep.lora, pd=pd_plan,
                     prompt_tokens_estimated=prep.estimated, fallback=fallback,
                     changes=changes, generation=snap.gen.number,
                     head_ids=prep.head_ids, prompt_hash=prep.prompt_hash, withheld=prep.withheld,
                     effects=fx.freeze())


def route_any(snap: Snapshot, state: State, worker_tag: str | None = None, model: str | None = None) -> Decision | None:
    """A request that is no inference: the least loaded worker of the whole fleet, or of `model` when it names one
    (None: there is none), first the worker `worker_tag` names (a stored response's, extproc/response_ids.py)."""
    targets = snap.all_candidates() if model is None else snap.candidates(model)
    cands = candidates.whole_workers(targets, inflight=snap.inflight, alive=snap.alive)
    if not cands:
        return None
    facts = Facts(block_size=snap.block_size, ledger_usable=False, why_not_exact="not_an_inference_request",
                  scoring=snap.cfg.scheduler)
    return response_ids.pin(state.policies.load_aware.decide(cands, facts, state.rng), worker_tag)
