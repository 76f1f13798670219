"""The contract every routing policy keeps (the llm-d kv-cache `Index` conformance shape): one suite, run over
every policy in extproc/policies, on candidates built the one way production builds them (extproc/candidates.py).

  * never picks an unhealthy worker, and never a suspect one first while one in good standing exists;
  * a claim it cannot trust (an untrusted ledger's matches) changes nothing: the decision is the one it makes
    without the claim;
  * never claims a hit it cannot prove: a hit is exact_kv_events on a trusted worker, exactly its proven blocks;
  * ties are broken at random (seeded), not by a fixed order;
  * stable under hysteresis: between the watermarks the decision does not flip with the load;
  * deterministic given a seed.
Every invariant but the random tie-break also holds for a request that names a session (`sess`: the session's
worker is a tie-breaker and stickiness inside them, extproc/policies/session.py; its own vectors are in
tests/test_session_affinity.py).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from cortex.config import SchedulerConfig
from extproc import candidates
from extproc.cluster_view import TargetInfo
from extproc.policies import (
    CacheAware,
    LoadAware,
    Policies,
    Policy,
    PowerOfTwo,
    RoundRobin,
    Transparent,
    Ttft,
    explain,
    session,
)
from extproc.policies.base import EXACT, Candidate, Decision, Facts, still_hot
from extproc.predictions import Predictions


class TtftReplicas:
    """The time model as one of four replicas (scheduler.replicas: 4), each prompt with a home of its own (drawn
    from the seed): near_home's spread is in play."""

    name = "ttft"

    def decide(self, cands: Sequence[Candidate], facts: Facts, rng: random.Random) -> Decision:
        four = dataclasses.replace(facts, scoring=facts.scoring.model_copy(update={"replicas": 4}),
                                   home=rng.getrandbits(63))
        return Ttft().decide(cands, four, rng)


POLICIES: dict[str, Callable[[], Policy]] = {
    "cache_aware": CacheAware, "load_aware": LoadAware, "p2c": PowerOfTwo, "round_robin": RoundRobin,
    "transparent": Transparent, "ttft": Ttft, "ttft_replicas": TtftReplicas,
}
BS = 16
S = SchedulerConfig()
KEYS = list(range(1, 201))


@pytest.fixture(params=sorted(POLICIES))
def make(request: pytest.FixtureRequest) -> Callable[[], Policy]:
    return POLICIES[request.param]


@pytest.fixture(params=[None, "conv-7"], ids=["no_session", "session"])
def sess(request: pytest.FixtureRequest) -> int | None:
    return None if request.param is None else session.key_hash(request.param)


def target(i: int, *, load: float | None = 0.0, exact_kv: bool = True, healthy: bool = True,
           suspect: bool = False) -> TargetInfo:
    return TargetInfo(id=f"w{i}", worker=f"w{i}", rank=None, slot=i, model="m", engine="vllm",
                      address=f"127.0.0.1:{9000 + i}", exact_kv=exact_kv, healthy=healthy, engine_load=load,
                      why="" if exact_kv else "ledger_resyncing", suspect=suspect, added_at=None)


def decide(policy: Policy, targets: Sequence[TargetInfo], held: dict[int, int], seed: int, *,
           hysteresis: candidates.Hysteresis | None = None, inflight: Sequence[int] | None = None,
           predictions: Predictions | None = None, sess: int | None = None) -> Decision:
    """The production path: targets + the ledger's answer -> candidates -> facts -> the policy, and its hot flags
    carried to the next decision as a committed plan's are."""
    n = max(t.slot for t in targets) + 1
    matches = np.zeros(n, dtype=np.int64)
    for slot, blocks in held.items():
        matches[slot] = blocks
    hysteresis = hysteresis or candidates.Hysteresis()
    cands = candidates.build(targets, matches=matches, keys=KEYS,
                             inflight=np.array(inflight if inflight is not None else [0] * n),
                             alive=True, predictions=predictions or Predictions(), scoring=S, hysteresis=hysteresis)
    hysteresis.carry(cands)
    facts = Facts(BS, True, candidates.why_not_exact("no_cached_prefix", targets, matches, cands), S, None, sess,
                  prompt_tokens=len(KEYS) * BS)
    return policy.decide(cands, facts, random.Random(seed))


def summary(d: Decision) -> tuple[object, ...]:
    return tuple(c.id for c in d.order), d.mode, d.reason, d.hit_tokens


def random_fleet(rng: random.Random) -> tuple[list[TargetInfo], dict[int, int]]:
    n = rng.randint(1, 6)
    targets = [target(i, load=rng.choice([None, 0.0, 1.0, 3.0, 50.0]), exact_kv=rng.random() < 0.7,
                      healthy=rng.random() < 0.85, suspect=rng.random() < 0.2) for i in range(n)]
    if not any(t.healthy for t in targets):
        targets[0] = target(0)
    held = {i: rng.choice([0, 0, 3, 40, 200]) for i in range(n)}
    return targets, held


def test_never_picks_an_unhealthy_worker_nor_a_suspect_one_first(make: Callable[[], Policy],
                                                                 sess: int | None) -> None:
    rng = random.Random(1)
    for seed in range(300):
        targets, held = random_fleet(rng)
        d = decide(make(), targets, held, seed, sess=sess)
        healthy = {t.id for t in targets if t.healthy}
        assert {c.id for c in d.order} == healthy  # every healthy worker, as a retry target, and no other
        if any(t.healthy and not t.suspect for t in targets):
            assert not d.chosen.suspect


def test_an_untrusted_claim_changes_nothing(make: Callable[[], Policy], sess: int | None) -> None:
    # w0's ledger is not trusted and claims the whole prompt, on a worker one request busier than the rest.
    targets = [target(0, load=1.0, exact_kv=False), target(1), target(2)]
    for seed in range(50):
        claimed = decide(make(), targets, {0: 200}, seed, sess=sess)
        blind = decide(make(), targets, {}, seed, sess=sess)
        assert [c.id for c in claimed.order] == [c.id for c in blind.order]
        assert claimed.hit_tokens == 0 and claimed.mode != EXACT
        assert all(not c.ledger_trusted and c.matched_blocks == 0 for c in claimed.order if c.id == "w0")


def test_never_claims_a_hit_it_cannot_prove(make: Callable[[], Policy], sess: int | None) -> None:
    rng = random.Random(2)
    for seed in range(300):
        targets, held = random_fleet(rng)
        predictions = Predictions()
        predictions.record(rng.randrange(len(targets)), KEYS[: rng.choice([0, 50, 200])])
        d = decide(make(), targets, held, seed, predictions=predictions, sess=sess)
        chosen = d.chosen
        if d.hit_tokens:
            assert d.mode == EXACT and chosen.ledger_trusted
            assert d.hit_tokens == chosen.matched_blocks * BS == held[chosen.slot] * BS
        else:
            assert d.mode != EXACT
        # Only trusted ledgers' blocks are reported as matched.
        assert set(d.matched_tokens) <= {c.id for c in d.order if c.ledger_trusted}


# The rule each policy's candidates are explained by (route explain's `score.by`).
EXPLAINED_BY = {"cache_aware": {"cache_aware", "load_aware", "p2c"}, "load_aware": {"load_aware", "p2c"},
                "p2c": {"p2c"}, "round_robin": {"round_robin"}, "transparent": {"load_aware", "p2c"},
                "ttft": {"ttft", "load_aware", "p2c"},  # load_aware: the cold-start share (no estimate made)
                "ttft_replicas": {"ttft", "load_aware", "p2c"}}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_candidate_shows_what_placed_it(name: str) -> None:
    """Route explain's per-candidate `score`: every candidate of every decision says which rule placed it and
    what that rule weighed; a cache score's terms add up to the score the policy compared."""
    rng = random.Random(4)
    seen: set[str] = set()
    for seed in range(200):
        targets, held = random_fleet(rng)
        d = decide(POLICIES[name](), targets, held, seed)
        rule = "cache_aware" if name == "cache_aware" else "ttft"
        parts = explain.parts(d, rule, S, BS)
        assert set(parts) == {c.id for c in d.order}
        for c in d.order:
            why = parts[c.id]
            assert why["by"] in EXPLAINED_BY[name], (name, why)
            seen.add(why["by"])
            if why["by"] == "cache_aware":
                assert why["cache_ms"] + why["load_ms"] + why["queue_ms"] == pytest.approx(why["score"], abs=0.01)
                assert why["score"] == pytest.approx(c.score(S, BS), abs=0.01)
            elif why["by"] == "ttft":
                assert why["score"] == pytest.approx(d.estimates[c.id].score, abs=0.01)
            elif why["by"] == "p2c":
                assert why["inflight"] == c.inflight
            elif why["by"] == "load_aware":
                assert why["active"] == c.load
    assert seen == EXPLAINED_BY[name]  # each rule the policy can fall to was seen


def test_ties_are_broken_at_random(make: Callable[[], Policy]) -> None:
    targets = [target(i) for i in range(4)]
    picks = [decide(make(), targets, {}, seed).chosen.id for seed in range(64)]
    assert set(picks) == {"w0", "w1", "w2", "w3"}
    assert picks == [decide(make(), targets, {}, seed).chosen.id for seed in range(64)]  # seeded, not a counter


def test_stable_under_hysteresis(make: Callable[[], Policy], sess: int | None) -> None:
    """w0 holds the prompt; its load climbs through the high watermark and falls back through the low one. The hot
    flag follows the watermarks, and the decision changes only where the flag flips, never inside the band."""
    hysteresis = candidates.Hysteresis()
    loads = [20.0, 40.0, 47.0, 48.0, 44.0, 40.0, 47.0, 33.0, 32.0, 40.0, 47.0, 20.0]
    hot, chosen = [], []
    was = False
    for load in loads:
        targets = [target(0, load=load), target(1, load=0.0), target(2, load=0.0)]
        d = decide(make(), targets, {0: 1250}, 5, hysteresis=hysteresis, sess=sess)
        was = still_hot(was, load, S)
        hot.append(was)
        chosen.append(d.chosen.id)
    assert hot == [False, False, False, True, True, True, True, True, False, False, False, False]
    for i in range(1, len(loads)):
        if hot[i] == hot[i - 1]:
            assert chosen[i] == chosen[i - 1], (i, loads[i], chosen)


def test_cache_aware_follows_the_holder_only_while_it_is_cool() -> None:
    hysteresis = candidates.Hysteresis()
    picks = []
    for load in (40.0, 48.0, 40.0, 32.0, 40.0):
        targets = [target(0, load=load), target(1, load=0.0), target(2, load=0.0)]
        picks.append(decide(CacheAware(), targets, {0: 1250}, 5, hysteresis=hysteresis).chosen.id == "w0")
    assert picks == [True, False, False, True, True]


def test_deterministic_given_a_seed(make: Callable[[], Policy], sess: int | None) -> None:
    fleets = [random_fleet(random.Random(i)) for i in range(100)]

    def stream(seed: int) -> list[tuple[object, ...]]:
        policy, hysteresis = make(), candidates.Hysteresis()
        rng = random.Random(seed)
        return [summary(decide(policy, t, h, rng.randrange(2**32), hysteresis=hysteresis,
                               inflight=[rng.randrange(3) for _ in t], sess=sess)) for t, h in fleets]

    assert stream(11) == stream(11)
    assert stream(11) != stream(12)  # the retry order behind a session's worker is still the policy's own


def test_select_picks_the_step_of_the_chain_from_what_is_known() -> None:
    p = Policies()
    cands = candidates.build([target(0), target(1)], matches=None, keys=[], inflight=np.zeros(2, dtype=np.int64),
                             alive=False, predictions=Predictions(), hysteresis=candidates.Hysteresis(), scoring=S)
    busy = candidates.build([target(0), target(1)], matches=None, keys=[], inflight=np.array([1, 0]),
                            alive=False, predictions=Predictions(), hysteresis=candidates.Hysteresis(), scoring=S)
    # Only liveness known (ingest's view dead, nothing in flight): round robin, whatever the model.
    assert p.select(cands, transparent=True, alive=False, ledger_usable=False) is p.round_robin
    # An in-flight count tells the workers apart: the load-reading policies (p2c inside them for unknown loads).
    old = "cache_aware"
    assert p.select(busy, transparent=False, alive=False, ledger_usable=False, rule=old) is p.load_aware
    assert p.select(busy, transparent=True, alive=False, ledger_usable=False, rule=old) is p.transparent
    assert p.select(cands, transparent=False, alive=True, ledger_usable=True, rule=old) is p.cache_aware
    assert p.select(cands, transparent=False, alive=True, ledger_usable=False, rule=old) is p.load_aware
    assert p.select(cands, transparent=True, alive=True, ledger_usable=True, rule=old) is p.transparent
    # The time model (the default rule) decides with or without the ledger: without it the queues decide.
    assert p.select(busy, transparent=False, alive=False, ledger_usable=False) is p.ttft
    assert p.select(cands, transparent=False, alive=True, ledger_usable=True) is p.ttft
    assert p.select(cands, transparent=False, alive=True, ledger_usable=False) is p.ttft
    assert p.select(cands, transparent=True, alive=True, ledger_usable=True) is p.transparent
