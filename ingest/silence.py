"""Silent publishers: a worker that serves requests but whose KV events never reach Cortex (pure).

A wrong `kv_events` port, a firewall between ingest and the engine, or an engine started without
`--kv-events-config` all look the same from the outside: the worker answers requests and its own counters
move, but no event batch ever arrives. Its ledger then stays empty (or stuck), so Cortex would route to it
only by load and never say why. Like Dynamo's router flagging "workers that publish no events", ingest
names such a worker: `events: "silent"` with a reason in `/cortex/workers`, `cortex_target_events_silent`,
and a warning in the log; a silent target is also out of exact-KV routing (never a claimed hit on it).

Evidence, not guesses: an idle engine publishes nothing by design (both engines publish only when their
cache changes), an engine serving only fully cached prompts stores no block, and neither does one serving
only prompts shorter than a block (a readiness probe's "hello", a gateway's warm-up request). So a target is
silent only when the engine has been seen doing work that must have stored a block (`stored_a_block`, where
the engine reports the counts it needs; otherwise its activity counter moved or requests ran) and, for at
least `bound_s` since both the work and the current link state began, either

1. its KV-event endpoint is not connected (nothing accepts the TCP connection: a live engine's publisher
   always does, within ZMQ's 100 ms reconnect interval), or
2. it is connected but has not sent a single batch on this connection (the first prompt a cold engine
   computes always stores a block; a connection that has carried batches before is not judged here: the
   sequence and silence checks of ingest/sync.py cover it).

A batch, a new connection or an unhealthy verdict (a dead worker is down, not silent) ends the state.
"""

from __future__ import annotations

from dataclasses import dataclass

FLOWING = "flowing"
"""A batch arrived on the current connection."""
WAITING = "waiting"
"""No batch yet on this connection, and no evidence of a fault (idle, or not yet past the bound)."""
SILENT = "silent"
OFF = "off"
"""No kv_events endpoint configured: routed by load, by choice."""


@dataclass(frozen=True, slots=True)
class Observation:
    now: float
    healthy: bool
    connected: bool
    link_since: float
    """When the connection last changed state (connected or lost), or when the target was added."""
    last_batch_at: float
    """Arrival time of the newest batch (0: never)."""
    work_at: float
    """When the engine was first seen working since the newest batch (0: not seen)."""
    bound_s: float


def stored_a_block(uncached: float, finished: float, active: float, page: int) -> bool:
    """Whether `uncached` prompt tokens computed over a window must have filled at least one new KV block of
    `page` tokens: by pigeonhole over the requests that can have contributed them (`finished` in the window plus
    `active`, the engine's running and waiting now, an upper bound), some request computed at least `page`, and
    a request's computed tokens start at a block boundary (hits are whole blocks), so they fill one whole."""
    return uncached > (finished + active) * (page - 1)


def verdict(o: Observation) -> tuple[str, str]:
    """(status, reason) for one target whose KV events are configured."""
    if o.connected and o.last_batch_at >= o.link_since and o.last_batch_at > 0:
        return FLOWING, ""
    if not o.healthy or not o.work_at:
        return WAITING, ""
    quiet_for = o.now - max(o.link_since, o.work_at)
    if quiet_for < o.bound_s:
        return WAITING, ""
    since = o.now - o.link_since
    if not o.connected:
        return SILENT, (f"serves requests, but its KV-event endpoint has not accepted a connection for {since:.0f}s "
                        "(wrong kv_events port, a firewall, KV events not enabled on the engine, or an engine "
                        "endpoint without '*', which vLLM connects out from instead of binding)")
    return SILENT, (f"serves requests, but has published no KV-event batch in the {since:.0f}s since ingest "
                    "connected (KV events not enabled, or a kv_topic that does not match)")


CONNECTS_OUT = "connects_out"
"""The engine's replay socket answers but its event endpoint accepts no connection: it publishes by connecting."""
UNREACHABLE = "unreachable"


def unreachable(endpoint: str, replay: str | None, replay_answered: bool | None, since_s: float) -> tuple[str, str]:
    """(code, reason) for a KV-event endpoint that has accepted no connection for `since_s`, given whether the
    engine's replay socket answered a probe (None: no replay endpoint configured, or not asked).

    vLLM binds its event endpoint only when it has `*` or `::` in it (or is ipc:// / inproc://); any other address
    it *connects* to (`ZmqEventPublisher._is_bind_endpoint`), expecting the subscriber to bind, while it always
    binds its replay endpoint. So a replay socket that answers beside an event endpoint that refuses is that
    engine. Cortex does not bind in its place (docs/engines.md, "Publishers that connect")."""
    if replay_answered:
        return CONNECTS_OUT, (
            f"the engine's replay socket {replay} answers, but nothing accepts connections at {endpoint} for "
            f"{since_s:.0f}s: the engine publishes by connecting out (vLLM binds an event endpoint only when it has "
            f"'*' in it). Start it with \"endpoint\": \"tcp://*:{endpoint.rsplit(':', 1)[-1]}\" in "
            "--kv-events-config; routed by load until its events arrive")
    hint = ("" if replay_answered is None else f"; its replay socket {replay} does not answer either")
    return UNREACHABLE, (
        f"nothing accepts connections at {endpoint} for {since_s:.0f}s{hint} (wrong kv_events port, a firewall, KV "
        "events not enabled on the engine, or an engine endpoint without '*', which vLLM connects out from instead "
        "of binding); routed by load until its events arrive")
