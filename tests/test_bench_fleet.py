"""The fleet benchmark's pure parts: disruption specs, how the client spreads sessions over replicas and
bypasses the gateway, how seeds are combined, and when a goal counts as met. The end-to-end run with replicas
and a disruption is in tests/test_bench_smoke.py."""

from __future__ import annotations

import pytest

from cortexbench.client import Routing
from cortexbench.launch import Worker
from cortexbench.metrics import combine
from cortexbench.report import verdict
from cortexbench.runner import Disruption, parse_disruptions
from cortexbench.workloads import Session

WORKERS = [Worker(f"sim-{i}", f"http://w{i}", f"tcp://e{i}", "vllm") for i in range(4)]


def _sessions(n: int, affinity: str | None = None) -> list[Session]:
    return [Session(i, 0.0, "sys", ("q",), 4, affinity=affinity) for i in range(n)]


def test_disruption_specs() -> None:
    assert parse_disruptions("restart@15, flush@30:2") == [Disruption("restart", 15.0), Disruption("flush", 30.0, 1)]
    assert parse_disruptions("") == []
    for bad in ("reboot@3", "restart", "restart@x", "flush@-1", "flush@3:0"):
        with pytest.raises(ValueError, match="--restart-workers"):
            parse_disruptions(bad)


def test_requests_alternate_over_replicas_without_stickiness() -> None:
    picker = Routing(["a", "b", "c"]).picker(WORKERS)
    s1, s2 = _sessions(2)
    pick1, bypass1 = picker(s1)
    pick2, _ = picker(s2)
    # Every request goes to the next replica, whichever session it belongs to (an L4 balancer's connections).
    assert [pick1(), pick1(), pick2(), pick1()] == ["a", "b", "c", "a"] and not bypass1


def test_sticky_keeps_a_session_and_shares_an_affinity_key() -> None:
    picker = Routing(["a", "b", "c", "d"], sticky=True).picker(WORKERS)
    homes = set()
    for s in _sessions(20):
        pick, _ = picker(s)
        turns = {pick() for _ in range(5)}
        assert len(turns) == 1
        homes |= turns
    assert len(homes) > 1  # sessions are spread, each kept on one
    same = [picker(s)[0]() for s in _sessions(6, affinity="user-7")]
    assert len(set(same)) == 1


def test_bypass_share_is_seeded_and_goes_to_workers() -> None:
    def draw(seed: int) -> list[str | None]:
        picker = Routing(["gw"], bypass=0.3, seed=seed).picker(WORKERS)
        out: list[str | None] = []
        for s in _sessions(400):
            pick, bypass = picker(s)
            url = pick()
            assert bypass == (url != "gw")
            out.append(url if bypass else None)
        return out

    a = draw(5)
    assert a == draw(5) and a != draw(6)
    share = sum(x is not None for x in a) / len(a)
    assert 0.24 < share < 0.36
    assert {x for x in a if x} == {w.url for w in WORKERS}


def _summary(hit: float, p50: float) -> dict[str, object]:
    return {"hit_ratio": hit, "ttft_ms": {"p50": p50, "p90": p50 * 2, "p99": p50 * 3},
            "e2e_ms": {"p50": 1.0, "p90": 2.0}, "gateway_cpu_ms_per_request": 1.0, "imbalance": 1.1, "rps": 2.0,
            "requests": 10, "completed": 10, "errors": 0, "prompt_tokens": 100, "cached_tokens": int(hit * 100)}


def test_seeds_combine_into_mean_and_half_range() -> None:
    c = combine({1: _summary(0.8, 10.0), 2: _summary(0.6, 20.0), 3: _summary(0.7, 30.0)})
    assert c["hit_ratio"] == pytest.approx(0.7) and c["spread"]["hit_ratio"] == pytest.approx(0.1)
    assert c["ttft_ms"]["p50"] == pytest.approx(20.0) and c["spread"]["ttft_ms.p50"] == pytest.approx(10.0)
    assert c["requests"] == 30 and set(c["seeds"]) == {"1", "2", "3"}
    one = combine({4: _summary(0.5, 9.0)})
    assert one["hit_ratio"] == 0.5 and one["spread"]["hit_ratio"] == 0.0 and "seeds" not in one
    failed = combine({1: _summary(0.8, 10.0), 2: {"failed": "boom"}})
    assert failed["failed_seeds"] == ["2"] and failed["hit_ratio"] == pytest.approx(0.8)


def test_a_win_must_exceed_the_spread() -> None:
    assert verdict((0.9, 0.01), (0.6, 0.01), 1.3, higher=True) is True
    assert verdict((0.80, 0.05), (0.6, 0.05), 1.3, higher=True) == "within spread"
    assert verdict((0.7, 0.0), (0.6, 0.0), 1.3, higher=True) is False
    assert verdict((19.0, 1.0), (30.0, 1.0), 0.7, higher=False) is True
    assert verdict((19.0, 2.0), (28.0, 2.0), 0.7, higher=False) == "within spread"
    assert verdict((None, 0.0), (1.0, 0.0), 1.0, higher=True) is None
