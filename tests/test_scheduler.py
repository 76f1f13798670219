"""Hand-computed cases for the decision rule and the fallback chain."""

from __future__ import annotations

import random

import pytest

from extproc.scheduler import EXACT, LOAD_AWARE, P2C, ROUND_ROBIN, Candidate, decide, round_robin


def c(id: str, matched: int = 0, trusted: bool = True, load: float | None = 0.0, inflight: int = 0) -> Candidate:
    return Candidate(id=id, slot=int(id[1:]), address=f"127.0.0.1:{9000 + int(id[1:])}", matched_blocks=matched,
                     ledger_trusted=trusted, engine_load=load, inflight=inflight)


def test_longest_proven_prefix_wins_and_rest_follow_by_load() -> None:
    d = decide([c("w0", 2, load=0), c("w1", 5, load=3), c("w2", 0, load=1)], block_size=16,
               ledger_usable=True, why_not_exact="no_cached_prefix", turn=0)
    assert d.mode == EXACT and d.chosen.id == "w1" and d.hit_tokens == 80
    assert [x.id for x in d.order] == ["w1", "w0", "w2"]
    assert d.matched_tokens == {"w0": 32, "w1": 80, "w2": 0}


def test_equal_prefix_goes_to_lighter_worker() -> None:
    d = decide([c("w0", 4, load=5), c("w1", 4, load=1)], block_size=16, ledger_usable=True,
               why_not_exact="x", turn=0)
    assert d.chosen.id == "w1"


def test_untrusted_ledger_never_claims_a_hit() -> None:
    d = decide([c("w0", 9, trusted=False, load=3), c("w1", 0, load=1)], block_size=16, ledger_usable=True,
               why_not_exact="no_cached_prefix", turn=0)
    assert d.mode == LOAD_AWARE and d.hit_tokens == 0 and d.chosen.id == "w1"
    assert "w0" not in d.matched_tokens


def test_inflight_counts_when_engine_load_lags() -> None:
    d = decide([c("w0", load=0, inflight=4), c("w1", load=2, inflight=0)], block_size=16, ledger_usable=False,
               why_not_exact="ledger_unavailable", turn=0)
    assert d.mode == LOAD_AWARE and d.reason == "ledger_unavailable" and d.chosen.id == "w1"


def test_ties_rotate_between_equal_workers() -> None:
    cands = [c("w0"), c("w1"), c("w2")]
    chosen = {decide(cands, block_size=16, ledger_usable=True, why_not_exact="x", turn=t).chosen.id
              for t in range(3)}
    assert chosen == {"w0", "w1", "w2"}


def test_partly_unknown_load_uses_p2c_on_inflight() -> None:
    cands = [c("w0", load=None, inflight=9), c("w1", load=1, inflight=0)]
    d = decide(cands, block_size=16, ledger_usable=False, why_not_exact="x", turn=0, rng=random.Random(1))
    assert d.mode == P2C and d.chosen.id == "w1" and [x.id for x in d.order] == ["w1", "w0"]


def test_round_robin_rotates() -> None:
    cands = [c("w0"), c("w1")]
    assert [round_robin(cands, t, "r").chosen.id for t in range(3)] == ["w0", "w1", "w0"]
    assert round_robin(cands, 0, "r").mode == ROUND_ROBIN


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(ValueError):
        decide([], block_size=16, ledger_usable=True, why_not_exact="x", turn=0)


def test_prediction_steers_but_is_never_claimed() -> None:
    pred = Candidate(id="w1", slot=1, address="a:1", matched_blocks=0, predicted_blocks=6, ledger_trusted=True,
                     engine_load=3.0)
    d = decide([c("w0", load=0), pred], block_size=16, ledger_usable=True, why_not_exact="no_cached_prefix", turn=0)
    assert d.chosen.id == "w1" and d.mode == LOAD_AWARE and d.reason == "predicted_prefix" and d.hit_tokens == 0
    proven = Candidate(id="w2", slot=2, address="a:2", matched_blocks=2, predicted_blocks=2, ledger_trusted=True,
                       engine_load=0.0)
    d = decide([pred, proven], block_size=16, ledger_usable=True, why_not_exact="x", turn=0)
    assert d.chosen.id == "w1" and d.mode == LOAD_AWARE and d.hit_tokens == 0
    mixed = Candidate(id="w3", slot=3, address="a:3", matched_blocks=2, predicted_blocks=6, ledger_trusted=True,
                      engine_load=0.0)
    d = decide([pred, mixed], block_size=16, ledger_usable=True, why_not_exact="x", turn=0)
    assert d.chosen.id == "w3" and d.mode == EXACT and d.hit_tokens == 32
