"""Hand-computed cases for the scoring rule, the watermarks and the fallback chain.

Defaults used below: alpha 0.05 ms/token, beta 5 ms per active request, gamma 1 x 100 ms per queued
request, watermarks 48/32, near-minimum window 2, block size 16 (one block = 0.8 ms of prefill).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from cortex.config import SchedulerConfig as Scoring
from extproc.policies.base import EXACT, LOAD_AWARE, P2C, ROUND_ROBIN, Candidate, still_hot
from extproc.policies.cache_aware import decide
from extproc.policies.round_robin import round_robin

# The old rule's vectors (rule cache_aware) were written for 0.05 ms a token, its default until the time model.
S = Scoring(rule="cache_aware", alpha_ms_per_token=0.05)


def c(id: str, matched: int = 0, trusted: bool = True, load: float | None = 0.0, inflight: int = 0,
      waiting: float = 0.0, predicted: int = 0, hot: bool = False, new: bool = False) -> Candidate:
    n = int(id[1:])
    return Candidate(id=id, slot=n, address=f"127.0.0.1:{9000 + n}", matched_blocks=matched, ledger_trusted=trusted,
                     engine_load=load, inflight=inflight, engine_waiting=waiting,
                     predicted_blocks=max(predicted, matched), hot=hot, new=new)


def run(*cands: Candidate, usable: bool = True, turn: int = 0, rng: random.Random | None = None, **kw: float):
    return decide(list(cands), block_size=16, ledger_usable=usable, why_not_exact="no_cached_prefix", turn=turn,
                  scoring=Scoring(**kw) if kw else S, rng=rng or random.Random(0))


def test_scores_by_hand() -> None:
    # 100 blocks = 1600 tokens = 80 ms saved; 4 active = 20 ms; 1 queued = 100 ms.
    assert c("w0", matched=100, load=4).score(S, 16) == pytest.approx(80 - 20)
    assert c("w1", matched=100, load=5, waiting=1).score(S, 16) == pytest.approx(80 - 25 - 100)
    assert c("w2", load=1, inflight=3).score(S, 16) == pytest.approx(-15)  # in-flight count is larger


def test_longest_prefix_wins_when_load_is_close() -> None:
    d = run(c("w0", matched=2, load=0), c("w1", matched=50, load=3), c("w2", load=1))
    # w1: 40 - 15 = 25; w0: 1.6; w2: -5.
    assert d.mode == EXACT and d.chosen.id == "w1" and d.hit_tokens == 800 and d.reason == "longest_cached_prefix"
    assert [x.id for x in d.order] == ["w1", "w0", "w2"]
    assert d.matched_tokens == {"w0": 32, "w1": 800, "w2": 0}


def test_queue_outweighs_a_small_hit() -> None:
    # seed 004's example: A reuses 3000 tokens but 20 are queued; B reuses 500 and is idle.
    a = c("w0", matched=187, load=20, waiting=20)   # 149.6 - 100 - 2000
    b = c("w1", matched=31, load=0)                 # 24.8
    d = run(a, b)
    assert d.chosen.id == "w1" and d.mode == EXACT and d.reason == "cache_vs_load" and d.hit_tokens == 496


def test_near_minimum_window_prefers_the_holder() -> None:
    # w1 scores 8 - 10 = -2 < w0's 0, but sits within 2 requests of the minimum: the holder wins.
    d = run(c("w0", load=0), c("w1", matched=10, load=2))
    assert d.chosen.id == "w1" and d.mode == EXACT
    d = run(c("w0", load=0), c("w1", matched=10, load=3))  # outside the window, and the score says w0
    assert d.chosen.id == "w0" and d.mode == LOAD_AWARE and d.reason == "holder_too_loaded"


def test_hot_holder_gets_no_affinity_and_says_so() -> None:
    d = run(c("w0", matched=500, load=40, hot=True), c("w1", load=10))
    assert d.chosen.id == "w1" and d.mode == LOAD_AWARE and d.reason == "holder_over_high_watermark"
    assert d.hit_tokens == 0 and d.order[1].id == "w0"  # still the retry target


def test_watermark_hysteresis() -> None:
    assert not still_hot(False, 47, S) and still_hot(False, 48, S)
    assert still_hot(True, 40, S) and still_hot(True, 33, S) and not still_hot(True, 32, S)


def test_all_hot_still_serves_from_the_least_loaded() -> None:
    d = run(c("w0", matched=5, load=60, hot=True), c("w1", load=50, hot=True))
    assert d.chosen.id == "w1" and d.mode == LOAD_AWARE


def test_untrusted_ledger_never_claims_a_hit() -> None:
    d = run(c("w0", matched=9, trusted=False, load=3), c("w1", load=1))
    assert d.mode == LOAD_AWARE and d.hit_tokens == 0 and d.chosen.id == "w1" and d.reason == "no_cached_prefix"
    assert "w0" not in d.matched_tokens


def test_prediction_steers_but_is_never_claimed() -> None:
    # 60 predicted blocks (48 ms) against 1 active (5 ms): follow the burst, claim nothing.
    d = run(c("w0", load=0), c("w1", predicted=60, load=1))
    assert d.chosen.id == "w1" and d.mode == LOAD_AWARE and d.reason == "predicted_prefix" and d.hit_tokens == 0
    d = run(c("w1", predicted=60, load=1), c("w2", matched=2, predicted=60, load=1))
    assert d.chosen.id == "w2" and d.mode == EXACT and d.hit_tokens == 32


def test_cold_start_share_only_for_cacheless_requests() -> None:
    rng = random.Random(1)
    picks = [run(c("w0", load=0), c("w1", load=5, new=True), rng=rng, turn=t).chosen.id for t in range(400)]
    share = picks.count("w1") / len(picks)
    assert 0.05 < share < 0.16  # cold_start_share 0.1; w1 is never chosen by load otherwise
    # A request that some worker holds, or is about to hold, is not diverted; nor is anything when all are new.
    assert all(run(c("w0", matched=20, load=0), c("w1", new=True), rng=rng).chosen.id == "w0" for _ in range(50))
    assert all(run(c("w0", predicted=20, load=0), c("w1", new=True), rng=rng).chosen.id == "w0" for _ in range(50))
    assert all(run(c("w0", load=0, new=True), c("w1", load=5, new=True), rng=rng).chosen.id == "w0"
               for _ in range(50))


def test_ledger_not_usable_means_load_only() -> None:
    d = run(c("w0", load=0, inflight=4), c("w1", load=2), usable=False)
    assert d.mode == LOAD_AWARE and d.chosen.id == "w1" and d.reason == "no_cached_prefix"


def test_ties_rotate_between_equal_workers() -> None:
    cands = [c("w0"), c("w1"), c("w2")]
    assert {run(*cands, turn=t).chosen.id for t in range(3)} == {"w0", "w1", "w2"}


def test_unknown_load_follows_the_known_ones() -> None:
    # Before: one candidate without a load reading turned the whole decision into P2C (issue 11, defect 1).
    d = run(c("w0", load=None, inflight=0), c("w1", load=1, inflight=0), rng=random.Random(1))
    assert d.mode == LOAD_AWARE and d.reason == "no_cached_prefix" and [x.id for x in d.order] == ["w1", "w0"]


def test_a_dead_worker_does_not_take_the_hit_away() -> None:
    # w2 is unreachable: no load, nothing in flight (nobody routed to it), so it looks idle to P2C.
    d = run(c("w0", load=1), c("w1", matched=80, load=2), c("w2", load=None))
    assert d.mode == EXACT and d.reason == "longest_cached_prefix" and d.hit_tokens == 80 * 16
    assert [x.id for x in d.order] == ["w1", "w0", "w2"]
    # The same, over every tie-break: the unknown worker is never first, whatever the draw.
    for seed in range(50):
        d = run(c("w0", load=0), c("w1", load=0), c("w2", load=None), rng=random.Random(seed), turn=seed)
        assert d.order[-1].id == "w2" and d.mode == LOAD_AWARE


def test_unknown_load_workers_follow_by_inflight() -> None:
    d = run(c("w0", load=None, inflight=5), c("w1", load=3), c("w2", load=None, inflight=1))
    assert [x.id for x in d.order] == ["w1", "w2", "w0"] and d.mode == LOAD_AWARE


def test_a_proven_hit_on_an_unknown_load_worker_is_not_claimed() -> None:
    # Its load cannot be weighed against the hit: it follows, and nothing is claimed for it.
    d = run(c("w0", matched=50, load=None), c("w1", load=2))
    assert d.chosen.id == "w1" and d.mode == LOAD_AWARE and d.hit_tokens == 0
    assert d.matched_tokens == {"w0": 800, "w1": 0}


def test_p2c_only_when_no_load_is_known() -> None:
    d = run(c("w0", load=None, inflight=9), c("w1", load=None, inflight=0), rng=random.Random(1))
    assert d.mode == P2C and d.reason == "load_unknown" and [x.id for x in d.order] == ["w1", "w0"]
    d = run(c("w0", load=None, inflight=2))
    assert d.mode == P2C and d.reason == "load_unknown_single_candidate"


def test_a_suspect_worker_gets_no_first_attempt_while_one_in_good_standing_exists() -> None:
    def s(id: str, **kw: object) -> Candidate:
        return replace(c(id, **kw), suspect=True)  # type: ignore[arg-type]

    # w1 holds the prompt and is idle, but its last health probe failed: w0 serves, w1 is the retry target.
    d = run(c("w0", load=5), s("w1", matched=80, load=0))
    assert d.chosen.id == "w0" and d.mode == LOAD_AWARE and d.hit_tokens == 0
    assert [x.id for x in d.order] == ["w0", "w1"]
    # Good standing outranks a known load: w0 (unknown load) before w1 (known, failing probes).
    d = run(c("w0", load=None), s("w1", load=0), rng=random.Random(3))
    assert [x.id for x in d.order] == ["w0", "w1"] and d.mode == P2C
    # Behind the competing tier: good standing, then known load, then least active.
    d = run(c("w0", load=1), s("w1", load=None, inflight=0), s("w2", load=4), c("w3", load=None, inflight=3))
    assert [x.id for x in d.order] == ["w0", "w3", "w2", "w1"]
    # All suspect (e.g. at start, before the first probe): they compete alike, as before.
    d = run(s("w0", load=3), s("w1", matched=80, load=0))
    assert d.chosen.id == "w1" and d.mode == EXACT and d.hit_tokens == 1280


def test_round_robin_rotates() -> None:
    cands = [c("w0"), c("w1")]
    assert [round_robin(cands, t, "r").chosen.id for t in range(3)] == ["w0", "w1", "w0"]
    assert round_robin(cands, 0, "r").mode == ROUND_ROBIN


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(ValueError):
        decide([], block_size=16, ledger_usable=True, why_not_exact="x", turn=0)


def test_a_new_prompt_goes_home_on_every_replica() -> None:
    """Independent replicas (each its own tie-break draws) agree on where a prompt no one holds goes while the
    workers are equally loaded, so identical prompts arriving at different replicas at once stay together."""
    fleet = [c(f"w{i}") for i in range(8)]
    for home in (1, 2**40 + 7, 2**63 + 12345):
        picks = {decide(fleet, block_size=16, ledger_usable=True, why_not_exact="no_cached_prefix",
                        turn=t, scoring=S, rng=random.Random(t), home=home).chosen.id for t in range(20)}
        assert len(picks) == 1
    # Different prompts have different homes: spread over the fleet, not piled on one worker.
    homes = {decide(fleet, block_size=16, ledger_usable=True, why_not_exact="no_cached_prefix", turn=0,
                    scoring=S, rng=random.Random(0), home=h * 0x1F3B5).chosen.id for h in range(200)}
    assert len(homes) == 8


def test_home_never_outweighs_load_or_a_holder() -> None:
    idle = c("w0", load=0)
    busy = [c(f"w{i}", load=1) for i in range(1, 6)]
    for h in range(50):
        d = decide([*busy, idle], block_size=16, ledger_usable=True, why_not_exact="no_cached_prefix", turn=h,
                   scoring=S, rng=random.Random(h), home=h * 7919)
        assert d.chosen.id == "w0" and d.reason == "no_cached_prefix"
        held = decide([c("w1", matched=20, load=0), *(c(f"w{i}") for i in range(2, 6))], block_size=16,
                      ledger_usable=True, why_not_exact="no_cached_prefix", turn=h, scoring=S,
                      rng=random.Random(h), home=h * 7919)
        assert held.chosen.id == "w1" and held.mode == EXACT
