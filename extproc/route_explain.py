"""Route explain: the decision a request would get, as JSON, nothing forwarded and nothing committed (the
router's `decide` without its `commit`). Asked on the ext_proc path (POST /v1/route/explain with
extproc.public_route_explain, trusted tenants only) or on ingest's admin port (cortex/api_paths.py:
explain_socket)."""

from __future__ import annotations

import random
import time
from typing import Any

import orjson
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from cortex import api_paths
from cortex.api_paths import TENANT_VIEW_HEADER
from cortex.errors import ClientError
from extproc import inference_paths, isolation
from extproc.acting import Acting
from extproc.answers import immediate
from extproc.policies import session
from extproc.policies.explain import parts as explain_parts
from extproc.snapshot import Generation
from extproc.stream_state import StreamState
from extproc.tenants import Tenant


def answer(act: Acting, st: StreamState, body: bytes) -> pb.ProcessingResponse:
    if not isolation.sees_routing(st.tenant):
        raise ClientError(403, "Route explain is open only to tenants marked trusted.")
    query = dict(p.partition("=")[::2] for p in st.head.query.split("&"))
    return immediate(200, explain(act, body, st.tenant, st.head.session, query.get("tokens") == "1", query.get("path"),
                                  st.gen))


def explain(act: Acting, body: bytes, tenant: Tenant | None, session_key: str | None, with_tokens: bool,
            path: str | None = None, gen: Generation | None = None) -> bytes:
    """The decision a request would get, as JSON, nothing forwarded: the same `route` real traffic takes, in
    the tenant's own view (its salted blocks). `path`: the inference path it would come on (`?path=`; default:
    a chat completion when the body has messages, else a completion). `gen`: the generation its stream was
    identified under (default: the one in force). Raises ClientError for a body that would be refused."""
    gen = act.source.current if gen is None else gen
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError:
        raw = None
    if path not in inference_paths.PATHS:  # a chat or a completion, by its body
        path = api_paths.CHAT if isinstance(raw, dict) and "messages" in raw else api_paths.COMPLETIONS
    parsed = inference_paths.parse(path, body, gen.registry)
    parsed.session_key = session_key
    isolation.isolate(parsed, tenant)
    # Its own rng: an explain call draws nothing from the sequence real traffic's ties are broken with.
    result = act.router.decide(parsed, full_tokens=True, rng=random.Random(), gen=gen)
    d = result.decision
    why = explain_parts(d, gen.cfg.scheduler.rule, gen.cfg.scheduler, act.cluster.block_size)
    now = time.monotonic()
    doc: dict[str, Any] = {
        "prompt_tokens": result.prompt_tokens,
        "prompt_truncated_for_routing": result.truncated,
        "model": result.model,
        "lora": result.lora,
        "block_size": act.cluster.block_size,
        "chosen": d.chosen.id,
        "order": [c.id for c in d.order],
        "mode": d.mode,
        "reason": d.reason,
        "cache_hit_tokens": d.hit_tokens,
        "workers": [{"id": c.id, "matched_tokens": d.matched_tokens.get(c.id),
                     **({"window_withheld_tokens": result.withheld[c.slot] * act.cluster.block_size}
                        if c.slot in result.withheld else {}),
                     **({"lower_tier_tokens": {m: n * act.cluster.block_size for m, n in c.tier_media},
                         "lower_tier_claimed_tokens": c.tier_claimed * act.cluster.block_size}
                        if c.tier_media else {}),
                     "predicted_tokens": c.predicted_blocks * act.cluster.block_size,
                     "ledger_trusted": c.ledger_trusted, "engine_load": c.engine_load,
                     "inflight": c.inflight, "suspect": c.suspect, "hot": c.hot, "kv_usage": c.kv_usage,
                     "breaker": act.breakers.state(c.address, now).value,
                     "kv_capacity_tokens": c.kv_capacity_tokens, "evicted_tokens_per_s": c.evicted_tokens_per_s,
                     "last_sent": None if c.last_sent is None else
                     {"age_s": round(c.last_sent.age_s, 3), "evicted_tokens_since": c.last_sent.evicted_tokens},
                     "score": why[c.id],
                     **({"time_model": d.estimates[c.id].to_json()} if c.id in d.estimates else {})}
                    for c in d.order],
        "timings_ms": {k: round(getattr(result.timings, k) * 1000, 3)
                       for k in ("tokenize_s", "hash_s", "lookup_s", "score_s")},
    }
    if with_tokens:
        doc["token_ids"] = result.token_ids
    return orjson.dumps(doc)


async def explain_http(act: Acting, request: web.Request) -> web.Response:
    """Route explain for ingest's admin port (cortex/api_paths.py: explain_socket): ingest checked the admin
    token; the admin may ask for a tenant's view."""
    gen = act.source.current
    name = request.headers.get(TENANT_VIEW_HEADER)
    tenant = gen.tenants.by_id.get(name) if name else gen.tenants.default
    if tenant is None:
        return _json_error(ClientError(404, "No tenant of that id is configured.", TENANT_VIEW_HEADER))
    headers = {k.lower(): v for k, v in request.headers.items()}
    key = next((k for n in gen.cfg.session.headers if (k := session.key_of(headers.get(n)))), None)
    try:
        doc = explain(act, await request.read(), tenant, key, request.query.get("tokens") == "1",
                      request.query.get("path"), gen)
    except ClientError as exc:
        return _json_error(exc)
    return web.Response(body=doc, content_type="application/json")


def _json_error(exc: ClientError) -> web.Response:
    return web.Response(status=exc.status, body=exc.body(), content_type="application/json")
