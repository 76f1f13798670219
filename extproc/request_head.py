"""What a request's headers say, read once when its stream begins (pure: header pairs in, a frozen RequestHead out).

The headers phase reads this and nothing later writes it: the path, the identity a tenant is told apart by, the
session key, llm-d's headers by meaning. Identifying the tenant (which may refuse the request) is the headers
phase's own step, on what this returns."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from extproc import epp
from extproc.policies import session


@dataclass(frozen=True, slots=True)
class RequestHead:
    method: str = ""
    path: str = ""
    """Without its query string."""
    query: str = ""
    authorization: str | None = None
    tenant_value: str | None = None
    """The trusted tenant header's value (auth.tenant_header), or llm-d's fairness id standing in for it."""
    session: str | None = None
    """Its session key (cfg.session.headers, extproc/policies/session.py): the first configured header present and
    not blank."""
    llmd: Mapping[str, str] | None = None
    """llm-d's request headers it carried, by meaning (extproc/epp.py: LLMD_HEADERS); None: it carried none."""
    test_pick: str | None = None
    """The conformance suite's endpoint selection (picker mode with epp.conformance_test only)."""
    subset: tuple[str, ...] | None = None
    """The endpoints the gateway allows it (picker mode: envoy.lb.subset_hint); None: any."""


NO_HEAD = RequestHead()
"""A stream's head before its headers arrive (frozen, so one serves every stream)."""


def read(headers: Iterable[tuple[str, bytes]], tenant_header: str | None, session_headers: Iterable[str],
         test_selection: bool, subset: tuple[str, ...] | None = None) -> RequestHead:
    """The head of a request from its (lowercase name, raw value) header pairs. Values that name things (path,
    method, credentials) are Latin-1, as HTTP/1.1 sends them; free text (session keys, llm-d's values) is UTF-8."""
    wanted = tuple(session_headers)
    method = path = query = ""
    authorization = tenant_value = test_pick = None
    sessions: dict[str, str] = {}
    llmd: dict[str, str] | None = None
    for key, raw in headers:
        if key == ":path":
            path, _, query = raw.decode("latin-1").partition("?")
        elif key == ":method":
            method = raw.decode("latin-1")
        elif key == "authorization":
            authorization = raw.decode("latin-1")
        elif key == tenant_header:
            tenant_value = raw.decode("latin-1")
        elif key in wanted:
            sessions[key] = raw.decode("utf-8", "replace")
        elif key in epp.LLMD_HEADERS:
            if llmd is None:
                llmd = {}
            epp.llmd_value(llmd, key, raw.decode("utf-8", "replace").strip())
        elif key == epp.TEST_SELECTION and test_selection:
            test_pick = raw.decode("latin-1")
    if llmd is not None and tenant_value is None:
        tenant_value = epp.fairness_tenant(llmd, tenant_header)
    found = next((k for n in wanted if (k := session.key_of(sessions.get(n)))), None) if sessions else None
    return RequestHead(method, path, query, authorization, tenant_value, found, llmd, test_pick, subset)
