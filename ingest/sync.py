"""Per-source stream synchronisation: the state machine between a ZMQ event stream and the ledger (pure).

A source is one publisher: one worker, or one data-parallel rank of it. Engines number batches from 0
per publisher process, so the sequence number says whether a batch is next, old, missing or from a
restarted publisher. The ledger may only be used for exact-KV routing while it has applied a gap-free
run of batches since its last clear (READY); every other condition is visible as a state and a reason.

    any --connection lost--> clear ledger --> CONNECTING (a restarted engine reconnects as a new publisher)
    CONNECTING --connected, replay on--> SYNCING --replay done--> READY
    CONNECTING --connected, no replay--> READY (cold: empty ledger, a subset of any cache)
    READY --gap / batch out of order--> STALE --missing batches arrive (replay or late)--> READY
    STALE --replay cannot fill the hole / timed out--> clear ledger --> READY (cold)
    SYNCING / STALE --replay cut short after some batches--> STALE, replay the rest
    READY --sequence went back (publisher restarted)--> clear ledger --> READY / SYNCING
    READY --silent while the worker is busy--> STALE --replay shows nothing missed--> READY

Batches are reassembled by sequence number in a small buffer, so a batch that arrives late (reordered)
or through replay fills the hole it belongs to; duplicates and replay overlap are dropped by number.
The machine returns actions (apply, clear, request replay); the caller performs them. No I/O here.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum

import xxhash

REORDER_WINDOW = 1024
"""A sequence number this far below the newest one means a restarted publisher, not a late batch."""
MAX_BUFFERED = 20_000
"""Batches held while waiting for a hole to fill; past this the hole is given up (clear, cold start)."""


class SyncState(Enum):
    CONNECTING = "CONNECTING"
    SYNCING = "SYNCING"
    READY = "READY"
    STALE = "STALE"


@dataclass(frozen=True, slots=True)
class Apply:
    seq: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class Clear:
    reason: str
    publisher_restart: bool = False


@dataclass(frozen=True, slots=True)
class RequestReplay:
    from_seq: int


Action = Apply | Clear | RequestReplay


@dataclass
class SourceSync:
    has_replay: bool
    state: SyncState = SyncState.CONNECTING
    reason: str = "not connected"
    last_applied: int | None = None
    newest_seen: int | None = None
    replay_pending: bool = False
    buffer: dict[int, bytes] = field(default_factory=dict)
    recent: OrderedDict[int, int] = field(default_factory=OrderedDict)
    """Digests of recently applied batches by sequence number: a repeated number with the same bytes is a
    duplicate, with other bytes a restarted publisher (both start at 0, so the number alone cannot tell)."""
    gaps: int = 0
    restarts: int = 0
    duplicates: int = 0
    replays: int = 0
    resyncs: int = 0
    """Holes given up on: the ledger was cleared and rebuilt from live events."""
    tail_recoveries: int = 0
    """Batches lost on the live stream and found by a tail check before any later batch revealed the loss."""
    fresh: int = 0
    """Batches the replay under way has delivered that were new (not applied or held yet)."""

    # -- inputs ----------------------------------------------------------------------------------------

    def connected(self) -> list[Action]:
        self.buffer.clear()
        if self.has_replay:
            return self._replay(SyncState.SYNCING, "replaying the publisher's buffer", 0)
        self.state, self.reason = SyncState.READY, "subscribed (no replay endpoint: batches sent earlier are unknown)"
        return []

    def _is_restart(self, seq: int, payload: bytes) -> bool:
        newest = self.newest_seen
        if newest is None or seq > newest:
            return False
        if seq < newest - REORDER_WINDOW:
            return True
        known = self.recent.get(seq)
        if known is not None:
            return known != xxhash.xxh3_64_intdigest(payload)
        held = self.buffer.get(seq)
        if held is not None:
            return held != payload
        return seq == 0 < newest

    def live(self, seq: int, payload: bytes) -> list[Action]:
        actions: list[Action] = []
        newest = self.newest_seen
        if self._is_restart(seq, payload):
            self.restarts += 1
            actions.append(Clear(f"publisher restarted (sequence went from {newest} to {seq})", publisher_restart=True))
            self.last_applied = self.newest_seen = None
            self.buffer.clear()
            self.recent.clear()
            if seq != 0 and self.has_replay:
                # Batches 0..seq-1 of the new publisher are in its replay buffer.
                self.buffer[seq] = payload
                self.newest_seen = seq
                return actions + self._replay(SyncState.SYNCING, "publisher restarted: replaying", 0)
            self.replay_pending = False
            self.state, self.reason = SyncState.READY, "publisher restarted: ledger cleared"
        self.newest_seen = seq if self.newest_seen is None else max(self.newest_seen, seq)
        if self.last_applied is not None and seq <= self.last_applied:
            self.duplicates += 1
            return actions
        if seq in self.buffer:
            self.duplicates += 1
            return actions
        self.buffer[seq] = payload
        if self.state is SyncState.SYNCING:
            return actions + self._overflow_check()
        if self.last_applied is not None and seq > self.last_applied + 1 and self.state is SyncState.READY:
            self.gaps += 1
            self.state, self.reason = SyncState.STALE, f"batches {self.last_applied + 1}..{seq - 1} missing"
            if self.has_replay and not self.replay_pending:
                actions += self._replay(SyncState.STALE, self.reason, self.last_applied + 1)
        actions += self._drain()
        if self.state is SyncState.STALE and not self.has_replay:
            actions += self._give_up("no replay endpoint to fill the gap")
        return actions + self._overflow_check()

    def replayed(self, seq: int, payload: bytes) -> list[Action]:
        if self.state is SyncState.CONNECTING:
            return []  # asked of a publisher whose connection has dropped since: maybe another process
        if (self.last_applied is not None and seq <= self.last_applied) or seq in self.buffer:
            return []
        self.fresh += 1
        self.buffer[seq] = payload
        self.newest_seen = seq if self.newest_seen is None else max(self.newest_seen, seq)
        if self.state is SyncState.SYNCING:
            return self._overflow_check()
        return self._drain() + self._overflow_check()

    def replay_done(self, complete: bool = True) -> list[Action]:
        """The replay answered its end marker (complete) or timed out / failed (not complete)."""
        if self.state is SyncState.CONNECTING:
            return []  # the connection it was asked on has dropped; the next one replays from 0
        # Cut short after delivering batches: the publisher may hold newer ones, removals among them, that
        # neither this replay nor the live stream delivered (an idle worker sends nothing live that would show
        # the gap). Trusted as it stands, the ledger would list blocks the worker has since evicted: ask for
        # the rest, hidden meanwhile. Each round applies at least one new batch, so this ends. Only the replay
        # under way can be cut: a late "no answer" for a request a later replay already served changes nothing.
        cut = not complete and self.replay_pending and self.fresh > 0
        self.replay_pending = False
        self.fresh = 0
        actions: list[Action] = []
        if self.state is SyncState.SYNCING:
            # Nothing was known before this sync, so wherever the buffer starts is a valid start.
            if self.buffer:
                self.last_applied = min(self.buffer) - 1
            self.state = SyncState.READY
            self.reason = "replayed" if complete else "replay unavailable: starting from live batches"
            actions += self._drain()
            if self.buffer:  # a hole inside what was buffered
                actions += self._give_up("hole in the replayed batches")
            elif cut:
                actions += self._replay(SyncState.STALE, "replay cut short: asking for the rest",
                                        0 if self.last_applied is None else self.last_applied + 1)
            return actions
        actions += self._drain()
        if self.state is SyncState.STALE:
            actions += self._give_up("replay could not supply the missing batches" if complete
                                     else "replay did not answer")
        elif cut and not self.buffer:
            actions += self._replay(SyncState.STALE, "replay cut short: asking for the rest",
                                    0 if self.last_applied is None else self.last_applied + 1)
        return actions

    def tail_checked(self, batches: list[tuple[int, bytes]]) -> list[Action]:
        """A replay asked after the stream went quiet returned these (everything after last_applied).

        The loss of the newest batch cannot show as a gap until a later batch arrives; when traffic stops,
        that may be never. Asking the publisher's replay buffer for anything newer closes the window."""
        if self.state is SyncState.CONNECTING:
            return []
        actions: list[Action] = []
        for seq, payload in batches:
            if self.last_applied is not None and seq > self.last_applied and seq not in self.buffer:
                self.tail_recoveries += 1
            actions += self.replayed(seq, payload)
        if self.state is SyncState.READY and self.buffer and self.last_applied is not None:
            # The answer skips numbers after last_applied: the publisher's buffer, which holds every batch in
            # order, has none of them (never sent, or gone from its ring), so no replay can fill the hole. Left
            # READY, the ledger would stay trusted without the buffered batches' removals, and their late live
            # copies would be dropped as duplicates.
            self.gaps += 1
            actions += self._give_up(f"replay skips batches {self.last_applied + 1}..{min(self.buffer) - 1}")
        return actions

    def silent(self, why: str) -> list[Action]:
        """No batch for too long while the worker was busy: events may be getting lost."""
        if self.state is not SyncState.READY:
            return []
        self.state, self.reason = SyncState.STALE, why
        if self.has_replay and not self.replay_pending:
            return self._replay(SyncState.STALE, why, 0 if self.last_applied is None else self.last_applied + 1)
        return []

    def disconnected(self, why: str) -> list[Action]:
        """The connection to the publisher dropped. It may come back as a new process whose numbers
        continue where the old ones stopped, which no sequence check can see: forget everything."""
        self.state, self.reason = SyncState.CONNECTING, why
        self.replay_pending = False
        self.buffer.clear()
        self.recent.clear()
        self.last_applied = self.newest_seen = None
        return [Clear(why, publisher_restart=True)]  # it may come back as another process

    # -- internals -------------------------------------------------------------------------------------

    def _replay(self, state: SyncState, reason: str, from_seq: int) -> list[Action]:
        self.state, self.reason = state, reason
        self.replay_pending = True
        self.fresh = 0
        self.replays += 1
        return [RequestReplay(from_seq)]

    def _drain(self) -> list[Action]:
        actions: list[Action] = []
        if self.last_applied is None and self.buffer and self.state is not SyncState.SYNCING:
            self.last_applied = min(self.buffer) - 1
        while self.last_applied is not None and self.last_applied + 1 in self.buffer:
            self.last_applied += 1
            payload = self.buffer.pop(self.last_applied)
            self.recent[self.last_applied] = xxhash.xxh3_64_intdigest(payload)
            if len(self.recent) > REORDER_WINDOW:
                self.recent.popitem(last=False)
            actions.append(Apply(self.last_applied, payload))
        if self.state is SyncState.STALE and not self.buffer:
            self.state, self.reason = SyncState.READY, "gap filled"
        return actions

    def _give_up(self, why: str) -> list[Action]:
        """Forget the ledger: a hole may hold removals. Restart from the last gap-free run of buffered
        batches (anything before a later hole would be cleared again anyway)."""
        self.resyncs += 1
        actions: list[Action] = [Clear(f"{why}; ledger cleared and rebuilt from live batches")]
        self.last_applied = None
        if self.buffer:
            start = max(self.buffer)
            while start - 1 in self.buffer:
                start -= 1
            for seq in [q for q in self.buffer if q < start]:
                del self.buffer[seq]
            self.last_applied = start - 1
        self.state, self.reason = SyncState.READY, f"{why}: rebuilt from live batches (cold)"
        return actions + self._drain()

    def _overflow_check(self) -> list[Action]:
        if len(self.buffer) <= MAX_BUFFERED:
            return []
        self.replay_pending = False
        if self.state is SyncState.SYNCING:
            self.state = SyncState.STALE
        return self._give_up(f"more than {MAX_BUFFERED} batches waiting for a hole to fill")
