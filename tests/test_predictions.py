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


def test_expire_drops_exactly_the_expired_keys_in_any_recording_order() -> None:
    # Records at different times, re-records of old keys on another slot, a TTL change in between: expire()
    # must leave every live (key, slot) usable and, once the longest TTL has passed, nothing behind.
    import random

    rng = random.Random(7)
    for _ in range(50):
        clock = Clock()
        p = Predictions(ttl_s=2.0, clock=clock)
        live: dict[tuple[int, int], float] = {}
        for _step in range(40):
            if rng.random() < 0.1:
                p.ttl_s = rng.choice([0.5, 2.0, 4.0])
            slot, keys = rng.randrange(3), [rng.randrange(30) for _ in range(rng.randint(1, 5))]
            p.record(slot, keys)
            for k in keys:
                live[(k, slot)] = clock.now + p.ttl_s
            clock.now += rng.choice([0.0, 0.1, 0.7, 1.5])
            p.expire()
            for (k, s), exp in live.items():
                assert (p.extend([k], s, 0) == 1) == (exp > clock.now), (k, s, exp, clock.now)
        clock.now += 5.0
        p.expire()
        assert len(p) == 0
