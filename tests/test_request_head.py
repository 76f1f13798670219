"""request_head.read: what a request's headers say, as vectors (header pairs in, the frozen head out)."""

from __future__ import annotations

import dataclasses

import pytest

from extproc import epp
from extproc.policies import session
from extproc.request_head import NO_HEAD, RequestHead, read


def head(*pairs: tuple[str, str | bytes], tenant_header: str | None = "x-tenant",
         sessions: tuple[str, ...] = ("x-session-id", "x-user"), test_selection: bool = False) -> RequestHead:
    raw = [(k, v if isinstance(v, bytes) else v.encode("utf-8")) for k, v in pairs]
    return read(raw, tenant_header, sessions, test_selection)


def test_the_path_loses_its_query_and_names_are_latin_1() -> None:
    h = head((":method", "POST"), (":path", "/v1/route/explain?tokens=1&path=x"), ("authorization", b"Bearer \xe9"))
    assert (h.method, h.path, h.query) == ("POST", "/v1/route/explain", "tokens=1&path=x")
    assert h.authorization == "Bearer \u00e9"  # HTTP/1.1's bytes as they came, never a decoding error


def test_nothing_said_is_the_empty_head() -> None:
    assert head() == NO_HEAD == RequestHead()


@pytest.mark.parametrize(("pairs", "key"), [
    ((("x-session-id", "  s-1 "),), "s-1"),
    ((("x-user", "u"), ("x-session-id", "s")), "s"),  # the first configured header wins, not the first sent
    ((("x-session-id", "   "), ("x-user", "u")), "u"),  # a blank one does not count
    ((("x-other", "s"),), None),
])
def test_the_session_key_is_the_first_configured_header_present_and_not_blank(
        pairs: tuple[tuple[str, str], ...], key: str | None) -> None:
    assert head(*pairs).session == key


def test_a_long_session_key_is_its_digest() -> None:
    long = "k" * (session.MAX_KEY_BYTES + 1)
    assert head(("x-session-id", long)).session == session.key_of(long) != long


def test_llmd_headers_by_meaning_the_current_name_beats_the_deprecated() -> None:
    h = head(("x-gateway-inference-objective", "old"), ("x-llm-d-inference-objective", " new "),
             ("x-gateway-inference-objective", "old-again"))
    assert h.llmd == {epp.OBJECTIVE: "new"}
    assert head(("x-tenant", "t")).llmd is None


def test_the_fairness_id_stands_in_for_the_tenant_header_only_when_that_is_its_header() -> None:
    fairness = "x-gateway-inference-fairness-id"
    assert head((fairness, "team-a"), tenant_header=fairness).tenant_value == "team-a"
    assert head((fairness, "team-a")).tenant_value is None  # the tenant header is another one
    both = head(("x-tenant", "t"), (fairness, "team-a"), tenant_header="x-tenant")
    assert both.tenant_value == "t"


def test_the_conformance_selection_is_read_only_when_followed() -> None:
    pairs = ((epp.TEST_SELECTION, "10.0.0.1:8000"),)
    assert head(*pairs).test_pick is None
    assert head(*pairs, test_selection=True).test_pick == "10.0.0.1:8000"


def test_the_head_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        head((":path", "/v1/models")).path = "/admin"  # type: ignore[misc]
