"""What ingest and its event shards say to each other (`ingest.event_shards`, docs/ledger.md "Event shards").

An event shard is a child process of ingest that follows some targets' KV-event streams end to end (the SUB and
replay sockets, the sequence state machine, the decoding, the ledger and its hash parity check) and sends ingest
the net key changes of each write section, with a snapshot of each source's state. Ingest stays the view's one
writer and the one owner of membership, probes and the target list; a shard holds no state ingest cannot rebuild
by assigning its targets again (their engines replay what they hold).

One PAIR connection per shard, msgpack frames (msgspec). Every key change carries the generation of the
assignment it was made under: ingest bumps a target's generation when it clears it, removes it or restarts its
shard, and applies no change of an older one, so nothing a shard sent before it learned of the change reaches the
view after it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from cortex.contract import GroupSlot, TierSlot

CLEAR, REMOVE, ADD = 0, 1, 2


# -- ingest -> shard


class Assign(msgspec.Struct, tag="assign"):
    """Follow this target's stream (again: a target assigned anew starts from an empty ledger and replays)."""

    tid: str
    gen: int
    slot: int
    engine: str
    block_size: int
    page_size: int
    hash_algo: str | None
    hash_seed: str | None
    endpoint: str | None
    replay_endpoint: str | None
    topic: str


class Drop(msgspec.Struct, tag="drop"):
    """Stop following the target (removed from the fleet): its sockets close, its ledger is gone."""

    tid: str


class Control(msgspec.Struct, tag="control"):
    """What ingest's probe loops ask of a source: `silent` (resync: the worker was busy and the stream quiet),
    `check_tail` (the worker worked: ask replay for what may have been lost), `clear` (the worker went down: forget
    what the ledger lists; `gen` is the target's new generation), `layout_published` (the target list describing
    layout `version` is in the view)."""

    tid: str
    op: Literal["silent", "check_tail", "clear", "layout_published"]
    gen: int = 0
    reason: str = ""
    version: int = 0


class Spares(msgspec.Struct, tag="spares"):
    """View slots the shard may give its ledgers for a hybrid model's other KV-cache specs and lower tiers."""

    slots: list[int]


ToShard = Assign | Drop | Control | Spares


# -- shard -> ingest


class KeyOp(msgspec.Struct, array_like=True):
    """One change of one view slot, in the order the ledger made it: CLEAR, REMOVE or ADD (keys)."""

    tid: str
    gen: int
    kind: int
    slot: int
    keys: list[int] = []


class SourceState(msgspec.Struct):
    """A source as ingest reads it (ingest/workers.py, ingest/admin.py): sync, parity, ledger and stream."""

    tid: str
    gen: int
    # sync (ingest/sync.py)
    state: str
    reason: str
    last_applied: int | None
    gaps: int
    replays: int
    resyncs: int
    restarts: int
    duplicates: int
    tail_recoveries: int
    # hash parity (ingest/hash_parity.py)
    parity_status: str
    parity_reason: str
    parity_checked: int
    parity_failures: int
    # ledger (ingest/ledger.py)
    blocks: int
    blocks_stored: int
    blocks_removed: int
    blocks_restated: int
    events_applied: int
    events_inactive: int
    unsupported: str
    layout_version: int
    groups: list[GroupSlot]
    tiers: list[TierSlot]
    slots: list[int]
    lanes: dict[str, int]
    dropped: dict[str, int]
    unknown_media: dict[str, int]
    lookahead: int
    # the stream (ingest/source.py)
    batches: int
    decode_errors: int
    tail_checks: int
    tail_connections: int
    lag_s: float
    link_up: bool
    link_since: float
    """time.monotonic(), as `last_event_at`: CLOCK_MONOTONIC is one clock for every process of the host."""
    diagnosis: tuple[str, str] | None
    last_event_at: float
    unknown_events: dict[str, int]
    shown: bool
    received: int


class Report(msgspec.Struct, tag="report"):
    """One turn of the shard's loop: the key changes in order, the states that changed, the engine timestamps of
    the batches applied (ingest observes the view's lag when it applies them)."""

    ops: list[KeyOp]
    states: list[SourceState]
    stamps: list[float]


ENCODER = msgspec.msgpack.Encoder()
TO_SHARD = msgspec.msgpack.Decoder(ToShard)
TO_INGEST = msgspec.msgpack.Decoder(Report)
