"""The waiting room's glue (docs/tenancy/waiting-room.md): when a routed request must wait (every worker it could
go to is full), its seat in the room (extproc/waiting_room.py, pure), and the wake-up that expires seats past
their time-to-live and releases them, pool by pool, while a pool has room. It routes nothing: `releases` yields
each request to let go, and its caller (ExtProc.wake) decides it anew from what its body phase admitted and sends
back what that came to, before the next one is weighed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import metrics
from extproc.acting import Acting
from extproc.admission import refusal
from extproc.answers import error
from extproc.plan import RoutePlan
from extproc.policies.base import active_of
from extproc.policies.transparent import REASON as TRANSPARENT
from extproc.stream_state import PendingPair, PoolFacts, Seat, StreamState, Waiting
from extproc.waiting_room import Entry, WaitingRoom, full


class RoomGlue:
    def __init__(self, act: Acting, max_hold_s: float) -> None:
        self.act = act
        wr = act.cfg.admission.waiting_room
        self.room: WaitingRoom[Seat] = WaitingRoom(wr.max_requests, wr.max_bytes)
        """Requests waiting for a worker with room: this process's own (docs/tenancy/waiting-room.md)."""
        self.facts: dict[str, PoolFacts] = {}
        self.max_hold_s = max_hold_s
        """Envoy's max_message_timeout, fixed when Envoy started: a reload cannot lengthen a wait past it."""
        self._bands: set[int] = set()

    def _full(self, active: float, waiting: float) -> bool:
        cfg = self.act.cfg
        return full(active, waiting, cfg.scheduler.high_watermark, cfg.admission.waiting_room.queue_depth)

    def must_wait(self, pool: str, result: RoutePlan) -> bool:
        """Every worker the request could go to is full: the policy's first choice is (it takes a full worker only
        when no other is left in its tier). A model another scheduler places is never held."""
        d = result.decision
        if not self.act.cfg.admission.waiting_room.enabled or d.reason == TRANSPARENT:
            return False
        chosen = d.chosen
        if not self._full(active_of(chosen), chosen.engine_waiting):
            return False
        self.facts[pool] = PoolFacts(result.model, frozenset(c.slot for c in d.order),
                                     frozenset(t.slot for t in self.act.cluster.targets.get(result.model, ())))
        return True

    def enter(self, st: StreamState, pool: str) -> pb.ProcessingResponse | Waiting:
        gen = self.act.source.current
        wr = gen.cfg.admission.waiting_room
        tenant = st.tenant or gen.tenants.default
        room = self.room
        room.max_requests, room.max_bytes = wr.max_requests, wr.max_bytes
        # Envoy's deadline for the message was fixed at start: a TTL raised by a reload waits no longer than it.
        ttl = max(1.0, min(wr.ttl_s, self.max_hold_s - gen.cfg.longest_extproc_hold_s(waiting_room=False)))
        assert st.admitted is not None  # only an admitted request waits
        seat = Seat(st, asyncio.get_running_loop().create_future())
        displaced: list[Entry[Seat]] = []
        now = time.monotonic()
        band = st.priority if st.priority is not None else tenant.priority  # an llm-d objective's, else its tenant's
        entry = room.offer(pool, tenant.id, band, tenant.weight, len(st.admitted.body), now, ttl, seat, displaced)
        for gone in displaced:  # a full room made way for this one (extproc/waiting_room.py: victim)
            metrics.QUEUE_WAIT_SECONDS.labels(str(gone.band)).observe(now - gone.arrived)
            if not gone.payload.answer.done():
                gone.payload.answer.set_result(self._dropped(gone.payload.st, "queue_full"))
        if entry is None:
            return self._dropped(st, "queue_full")
        st.waiting = entry
        self.changed()
        return Waiting(entry)

    def releases(self) -> Generator[Seat, pb.ProcessingResponse | PendingPair | Waiting, None]:
        """Expire what waited too long, then yield, pool by pool and as long as the pool has room, each request to
        release; the caller routes it anew, with the ledger and loads as they are now, and sends back the outcome,
        which answers the seat. Routed before the next is weighed: its check must see this one counted. Driven
        from the upkeep loop (every UPKEEP_S while requests wait), when a stream ends and when a request enters."""
        room = self.room
        if not room:
            return
        now = time.monotonic()
        changed = False
        for gone in room.expire(now):
            changed = True
            metrics.QUEUE_WAIT_SECONDS.labels(str(gone.band)).observe(now - gone.arrived)
            seat = gone.payload
            if not seat.answer.done():
                seat.answer.set_result(self._dropped(seat.st, "queue_ttl"))
        for pool in room.pools():
            while (e := room.peek(pool)) is not None and self._has_room(pool):
                room.release(e)
                changed = True
                seat = e.payload
                seat.st.queued_s = time.monotonic() - e.arrived
                metrics.QUEUE_WAIT_SECONDS.labels(str(e.band)).observe(seat.st.queued_s)
                # Routed now, not once its stream resumes: the next one's check must see this one counted.
                answer = yield seat
                assert not isinstance(answer, Waiting)  # a released request is never sent back in
                if not seat.answer.done():
                    seat.answer.set_result(answer)
                if isinstance(answer, PendingPair):
                    break  # a pair's decode is counted once it starts: one per wake, so the check stays true
        if changed:
            self.changed()

    def _has_room(self, pool: str) -> bool:
        """One of the pool's workers (or one that joined its model since) is not full, by the figures routing
        uses (candidates.py: the larger of the engine's count and Cortex's in-flight count)."""
        facts = self.facts.get(pool)
        if facts is None:
            return True
        totals = self.act.cluster.inflight.totals()
        alive = self.act.cluster.alive
        for t in self.act.cluster.targets.get(facts.model, ()):
            if t.healthy and (t.slot in facts.slots or t.slot not in facts.known):
                load, waiting = t.load_now(float(totals[t.slot]), alive)
                active = max(load or 0.0, float(totals[t.slot]))
                if not self._full(active, waiting):
                    return True
        return False

    def changed(self) -> None:
        depth = self.room.depth()
        self._bands.update(depth)
        for band in self._bands:
            metrics.QUEUE_DEPTH.labels(str(band)).set(depth.get(band, 0))

    def _dropped(self, st: StreamState, reason: str) -> pb.ProcessingResponse:
        """503 from the waiting room: full at arrival, or no worker had room within the time-to-live."""
        tenant = st.tenant or self.act.source.current.tenants.default
        retry = self.act.cfg.admission.retry_after_s
        if reason == "queue_full":
            message = f"Every worker serving this model is busy and the waiting room is full; retry after {retry} s."
        else:
            message = ("Every worker serving this model stayed busy (or none was up) for as long as a request may "
                       f"wait; retry after {retry} s.")
        return error(refusal(tenant.id, reason, 503, message, retry), st)
