from __future__ import annotations

from extproc.predictions import Predictions


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_predicted_run_extends_confirmed_prefix_until_ttl() -> None:
    clock = Clock()
    p = Predictions(ttl_s=2.0, clock=clock)
    keys = [11, 12, 13, 14]
    p.record(5, keys[:3])
    assert p.extend(keys, 5, 0) == 3
    assert p.extend(keys, 5, 1) == 3  # continues after confirmed blocks
    assert p.extend(keys, 4, 0) == 0  # another slot holds nothing
    assert p.extend([99, *keys], 5, 0) == 0  # must be a leading run
    clock.now += 2.5
    assert p.extend(keys, 5, 0) == 0
    p.expire()
    assert len(p) == 0


def test_bounded_and_disabled() -> None:
    p = Predictions(ttl_s=2.0, max_keys=3)
    p.record(0, [1, 2, 3, 4, 5])
    assert len(p) == 3 and p.extend([1], 0, 0) == 0 and p.extend([5], 0, 0) == 1
    off = Predictions(ttl_s=0)
    off.record(0, [1])
    assert len(off) == 0
