"""ingest/regret.py: which evictions the fleet regrets (a key evicted from a worker and stored again soon after,
anywhere), with vectors; and how the time model prices them (extproc/policies/ttft.py, the eviction term)."""

from __future__ import annotations

import random

import pytest

from cortex.config import SchedulerConfig
from extproc.candidates import regret_share
from extproc.policies import Ttft
from extproc.policies.base import Candidate, Facts
from extproc.policies.ttft import estimate
from ingest.regret import Regret


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, list[int]]] = []

    def add(self, worker: int, keys: list[int]) -> None:
        self.calls.append(("add", worker, keys))

    def remove(self, worker: int, keys: list[int]) -> None:
        self.calls.append(("remove", worker, keys))

    def clear_worker(self, worker: int) -> None:
        self.calls.append(("clear", worker, []))


def regret(**kw: float) -> tuple[Regret, Recorder, list[float]]:
    clock = [1000.0]
    sink = Recorder()
    return Regret(sink, 16, clock=lambda: clock[0], **kw), sink, clock  # type: ignore[arg-type]


def test_an_evicted_key_stored_again_is_regretted_by_the_worker_that_evicted_it() -> None:
    r, sink, clock = regret()
    r.remove(0, [1, 2, 3])
    clock[0] += 10
    r.add(2, [2, 3, 9])  # computed again on another worker: worker 0's eviction is what cost it
    r.add(0, [1])
    assert r.regretted(0) == 3 * 16 and r.regretted(2) == 0
    r.add(0, [1])  # stored again once more: counted once, when it came back
    assert r.regretted(0) == 3 * 16
    assert sink.calls == [("remove", 0, [1, 2, 3]), ("add", 2, [2, 3, 9]), ("add", 0, [1]), ("add", 0, [1])]


def test_only_within_the_window() -> None:
    r, _, clock = regret(window_s=60.0)
    r.remove(1, [5])
    r.remove(1, [6])
    clock[0] += 61
    r.remove(1, [7])  # the trim drops 5 and 6 on the way
    r.add(0, [5, 6, 7])
    assert r.regretted(1) == 16


def test_a_slot_shown_whole_again_is_no_store() -> None:
    """A stream back in sync shows its whole key set again (a clear, then every key): not a recompute."""
    r, _, _ = regret()
    r.remove(0, [1, 2])
    r.clear_worker(3)
    r.add(3, [1, 2])
    assert r.regretted(0) == 0
    r.add(3, [1])  # a later store of the slot is one
    assert r.regretted(0) == 16


def test_memory_is_bounded_and_a_reused_slot_starts_from_zero() -> None:
    r, _, _ = regret(max_keys=2)
    r.remove(0, [1, 2, 3])
    r.add(1, [1, 2, 3])
    assert r.regretted(0) == 2 * 16  # 1 was forgotten first
    r.forget([0])
    assert r.regretted(0) == 0


@pytest.mark.parametrize(("evicted", "regretted", "share"), [
    (None, None, 0.0), (0.0, 50.0, 0.0), (1000.0, 0.0, 0.0), (1000.0, 250.0, 0.25), (100.0, 400.0, 1.0)])
def test_regret_share(evicted: float | None, regretted: float | None, share: float) -> None:
    assert regret_share(evicted, regretted) == share


FLAT = SchedulerConfig(alpha_ms_per_token=0.05, attention_ms_per_token2=0.0, step_ms=10.0, step_tokens=8192,
                       running_ms_per_request=0.0, work_weight=0.25, eviction_weight=1.0)


def cand(i: int, share: float, matched: int = 0) -> Candidate:
    return Candidate(id=f"w{i}", slot=i, address=f"a:{i}", matched_blocks=matched, ledger_trusted=True,
                     engine_load=0.0, regret_share=share)


def test_the_eviction_term_prices_what_comes_back() -> None:
    facts = Facts(16, True, "no_cached_prefix", FLAT, prompt_tokens=4000)
    e = estimate(cand(0, 0.5), facts)
    assert e.prefill_ms == pytest.approx(10 + 200) and e.eviction_ms == pytest.approx(0.5 * 210)
    assert e.score == pytest.approx(210 + 0.25 * 210 + 0.5 * 210)
    assert estimate(cand(0, 0.5, matched=250), facts).eviction_ms == 0.0  # nothing new: nothing evicted
    free = SchedulerConfig(**{**FLAT.model_dump(), "eviction_weight": 0.0})
    assert estimate(cand(0, 0.5), Facts(16, True, "x", free, prompt_tokens=4000)).score == pytest.approx(1.25 * 210)


def test_new_work_goes_where_its_evictions_cost_least() -> None:
    """Two idle workers, neither holds the prompt: the one whose evictions come back half the time loses to the
    one evicting blocks nobody asks for again."""
    facts = Facts(16, True, "no_cached_prefix", FLAT, prompt_tokens=4000)
    for seed in range(6):
        for order in ([cand(0, 0.5), cand(1, 0.0)], [cand(1, 0.0), cand(0, 0.5)]):
            assert Ttft().decide(order, facts, random.Random(seed)).chosen.id == "w1"
