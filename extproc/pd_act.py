"""Acting on a PD plan: start the pair (the prefill leg is extproc's own, extproc/pd_dispatch.py), hand Envoy the
decode leg, stamp the pair's answer, and, when a pair fails before the client got a byte, serve the plan's
precomputed fallback on one worker (seed 000 §2.4, docs/pd.md). It never asks the router for another decision."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3.http_status_pb2 import HttpStatus

from cortex import engines, observation
from cortex import headers as H
from cortex.envoy_config import pool_cluster
from cortex.errors import ClientError
from extproc import epp, isolation, metrics
from extproc.acting import Acting
from extproc.answers import (
    claim_facts,
    error,
    header,
    headers_answer,
    observe_claim,
    observe_facts,
    prompt_facts,
    set_body,
    status_of,
    tenant_facts,
)
from extproc.pd_dispatch import Phase, splice
from extproc.policies.base import EXACT, LOAD_AWARE
from extproc.stream_state import DecodeFallback, HoldHeaders, PendingPair, StreamState

log = logging.getLogger("cortex.extproc")

# The event that failed a pair -> the x-cortex-pd fallback reason.
_FALLBACK_WHY = {"watchdog": "bootstrap_timeout", "prefill_failed": "prefill_failed", "decode_failed": "decode_failed"}
# Hop-by-hop or recomputed by Envoy: never copied from the fallback worker's answer.
_NOT_COPIED = frozenset({"content-length", "transfer-encoding", "content-encoding", "connection", "keep-alive",
                         "date", "server"})


async def start_pair(act: Acting, st: StreamState, pending: PendingPair) -> pb.ProcessingResponse:
    """Send the prefill leg, then hand Envoy the decode leg; a pair that cannot start falls back to a worker
    that serves the request alone, or to a clear error when there is none."""
    result, plan, body, changes = pending.result, pending.plan, pending.body, pending.changes
    pair = plan.pair
    assert pair is not None
    try:
        if engines.adapter(plan.engine).pd_legs == "concurrent":
            started = await act.pd.sglang(plan, pair, body, st.head.path, changes)
        else:
            started = await act.pd.vllm(plan, pair, body, pending.doc, st.head.path, changes)
    except Exception:  # never fail the request because orchestration raised: a single worker takes it
        log.exception("PD dispatch failed")
        metrics.INTERNAL_ERRORS.inc()
        started = None
    if started is None:
        st.pd_note = "fallback:prefill_failed"
        metrics.PD_DECISIONS.labels(plan.engine, st.pd_note).inc()
        fallback = result.fallback
        if fallback is None:
            return error(ClientError(
                502, f"prefill/decode pair for model `{result.model}` could not start: prefill worker(s) "
                     f"{', '.join(c.id for c in pair.prefill.order[:2])} failed and no worker serves the "
                     "model alone", reason="pd_prefill_failed"))
        # Nothing was sent to a decoder yet: Envoy serves the request on one worker, streaming as usual.
        decision = fallback.without(frozenset(pair.targets[c.id].worker for c in pair.prefill.order[:2]))
        act.router.served_alone(result, decision)
        return act.single(st, decision, result.model, body, changes)
    st.pd = started
    st.pd_pending = pending
    st.pd_note = "pair:repicked" if started.repicked else "pair"
    st.pd_prefill_decision = pair.prefill
    metrics.PD_DECISIONS.labels(plan.engine, st.pd_note).inc()
    # The decode leg: the decode pool's order, so a failed connect goes to the next decoder with the same room
    # or transfer params (the first never saw them); no retry on 5xx or reset (x-cortex-pd route).
    st.decision = pair.decode
    act.count(st, started.decode.slot)
    response = act.routing_response(st, "request_body", pool_cluster(result.model))
    common = response.request_body.response
    common.header_mutation.set_headers.append(header(H.PD_ROUTE, "1"))
    for k, v in started.decode_headers.items():
        common.header_mutation.set_headers.append(header(k, v))
    set_body(response, started.decode_body)
    observe_facts(response, {observation.MODEL: result.model, observation.STREAM: pending.doc.get("stream") is True,
                             observation.USAGE_INJECTED: False, **prompt_facts(result), **tenant_facts(st)})
    return response


def response_headers(act: Acting, st: StreamState, req: Any,
                     served: str) -> pb.ProcessingResponse | DecodeFallback | HoldHeaders:
    pair, prefill = st.pd, st.pd_prefill_decision
    assert pair is not None and prefill is not None and st.decision is not None
    status = status_of(req)
    failed = not status.startswith(b"2")
    pair.legs.event("decode_failed" if failed else "decode_ok")
    if status.startswith(b"5") or (not failed and pair.legs.phase is Phase.FAILED):
        # A 4xx is the request's own fault: another worker would refuse it too. A 2xx from a pair that already
        # failed (its decode was aborted) would end early: that falls back too.
        fallback = fallback_of(st)
        if fallback is not None:
            return fallback
    elif not failed and pair.legs.phase is Phase.DECODE_STARTED and st.pd_pending is not None:
        cfg = st.pd_pending.plan.cfg
        # The watchdog settles the pair by then; one second more covers its scheduling.
        return HoldHeaders(pair.legs.started + cfg.bootstrap_timeout_s + 1.0)
    return pair_headers(act, st, req)


def settled(act: Acting, st: StreamState, req: Any) -> pb.ProcessingResponse | DecodeFallback:
    """Held decode headers, once the prefill side is over: a failed pair falls back, a good one streams."""
    assert st.pd is not None
    if st.pd.legs.phase is Phase.FAILED:
        fallback = fallback_of(st)
        if fallback is not None:
            return fallback
    return pair_headers(act, st, req)


def fallback_of(st: StreamState) -> DecodeFallback | None:
    """Seed 000 §2.4: a pair that failed before the first byte falls back to one worker from a cold start. The
    decoder(s) that answered are left out when others exist; so is the prefill worker when the pair failed
    on its side."""
    pair, pending = st.pd, st.pd_pending
    if pair is None or pending is None:
        return None
    why = _FALLBACK_WHY.get(pair.legs.failure, "decode_failed")
    exclude = {d.worker for d in pair.legs.decodes}
    if why != "decode_failed":
        exclude.add(pair.legs.prefill.worker)
    fallback = pending.result.fallback
    return DecodeFallback(why, fallback.without(frozenset(exclude))) if fallback is not None else None


def pair_headers(act: Acting, st: StreamState, req: Any) -> pb.ProcessingResponse:
    pair, prefill = st.pd, st.pd_prefill_decision
    assert pair is not None and prefill is not None and st.decision is not None
    served = epp.served(req)
    decode = next((c for c in st.decision.order if c.address == served), pair.decode)
    if decode is not pair.decode:
        act.count(st, decode.slot)
    # The hit is the prefill side's: it computes the prompt, and both engines report its cached tokens in
    # the decode's usage. A re-picked prefill was not the one the ledger proved.
    hit = prefill.hit_tokens if not pair.repicked else 0
    mode = prefill.mode if not pair.repicked or prefill.mode != EXACT else LOAD_AWARE
    headers = [header(H.ASSIGNED_WORKER, f"prefill={pair.legs.prefill.id},decode={decode.id}"),
               header(H.CACHE_HIT_TOKENS, str(hit)), header(H.MATCH_MODE, mode),
               header(H.ROUTE_REASON, f"pd:{prefill.reason}"), header(H.PD, st.pd_note)]
    response = headers_answer(st, req, headers, act.cfg_of(st).extproc.routing_headers)
    if pair.legs.failure and not status_of(req).startswith(b"2"):
        # The pair failed and no single worker took over: the error (often Envoy's, for the decode leg Cortex
        # cut) says why in the pair's terms, for every caller.
        reason = f"pd_{_FALLBACK_WHY.get(pair.legs.failure, 'decode_failed')}"
        response.response_headers.response.header_mutation.set_headers.extend(
            [header(H.DROPPED_REASON, reason), header(H.LLMD_DROPPED_REASON, reason)])
    # The decode worker answers (and reports the usage); the pair's prefill is kept beside it.
    observe_facts(response, {**claim_facts(headers), observation.WORKER: decode.id,
                             observation.PREFILL: pair.legs.prefill.id})
    return response


async def decode_fallback(act: Acting, st: StreamState, req: Any, fb: DecodeFallback) -> pb.ProcessingResponse:
    """Serve a request whose pair failed before the client got a byte on one worker, from a cold start.

    Envoy cannot send a request upstream again once it answered (ext_proc has no restart), so extproc sends it
    itself, with the client's own body (no room, no transfer params), and answers with the worker's whole
    response as an immediate response: a streamed request gets its SSE events at once, at the end. One more
    worker is tried after a failed connect or a 5xx, as Envoy's route does. When none answers, the pair's
    own error goes to the client."""
    pending, pair = st.pd_pending, st.pd
    assert pending is not None and pair is not None
    plan = pending.plan
    st.pd_note = f"fallback:{fb.why}"
    metrics.PD_DECISIONS.labels(plan.engine, st.pd_note).inc()
    decision = fb.decision
    act.router.served_alone(pending.result, decision)
    timeout = aiohttp.ClientTimeout(total=plan.cfg.fallback_timeout_s, sock_connect=2.0)
    tried: set[str] = set()
    for cand in decision.order:
        if cand.address in tried or len(tried) == 2:
            continue
        tried.add(cand.address)
        act.count(st, cand.slot)
        changes = dict(pending.changes)
        headers = {"content-type": "application/json"}
        if cand.rank is not None:
            eng = engines.adapter(cand.engine)
            changes.update(eng.rank_body(cand.rank))
            headers.update(eng.rank_headers(cand.rank))
        target = act.cluster.by_address.get(cand.address)
        if target is None:  # left the fleet meanwhile: how to reach it (TLS or not) is no longer known
            continue
        try:
            async with act.pd.post(target, st.head.path, data=splice(pending.body, changes),
                                   headers=headers, timeout=timeout) as resp:
                status, resp_headers = resp.status, resp.headers
                body = await _read_capped(resp, act.cfg_of(st).extproc.max_body_bytes)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.warning("PD fallback on %s failed: %r", cand.id, exc)
            continue
        if status >= 500 or body is None:
            log.warning("PD fallback on %s answered HTTP %d%s", cand.id, status,
                        "" if body is not None else " larger than extproc.max_body_bytes")
            continue
        log.info("PD pair prefill=%s failed (%s); served alone on %s", pair.legs.prefill.id, fb.why, cand.id)
        chosen = cand is decision.chosen
        mode = decision.mode if chosen or decision.mode != EXACT else LOAD_AWARE
        shown = isolation.sees_routing(st.tenant)
        hidden = set() if shown else set(isolation.upstream_cortex_headers(k.lower() for k in resp_headers))
        out = [header(k.lower(), v) for k, v in resp_headers.items()
               if k.lower() not in _NOT_COPIED and k.lower() not in hidden]
        routing = [header(H.ASSIGNED_WORKER, cand.id),
                   header(H.CACHE_HIT_TOKENS, str(decision.hit_tokens if chosen else 0)),
                   header(H.MATCH_MODE, mode),
                   header(H.ROUTE_REASON, decision.reason if chosen else f"retried:{decision.reason}"),
                   header(H.PD, st.pd_note)]
        response = pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
            status=HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=out + routing if shown else out), body=body,
            details="cortex_pd_fallback"))
        observe_claim(response, routing)
        return response
    log.warning("PD pair prefill=%s failed (%s) and no single worker answered; the pair's error stands",
                pair.legs.prefill.id, fb.why)
    st.pd_note = f"fallback_failed:{fb.why}"
    metrics.PD_DECISIONS.labels(plan.engine, st.pd_note).inc()
    return pair_headers(act, st, req)


async def _read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The whole body, or None past `limit` bytes (it could not travel back to Envoy in one message)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)
