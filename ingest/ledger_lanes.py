"""A ledger's lanes, and the view slots they publish to (pure).

A *lane* is one copy set: the blocks one KV-cache group holds on one tier (an offloading tier's copies also by
locality and ownership: another owner's copy is another copy, removed apart). How a lane's blocks change with
the events is the ledger's (ingest/ledger.py); which lanes a target has, and where each publishes, is this module's.

What is published (to the shared view, one bitset column per slot): the target's slot holds the blocks of its
full-attention spec (every group of the spec, as vLLM's hit needs all of them); each other spec of a hybrid model
(a sliding window) and each lower tier (CPU, STORAGE) gets a slot of its own, allocated as it first appears, and
the target's layout (`layout()`, published in its TargetMeta) says which is which. extproc then applies the engine's
hit rule (cortex/hit_rule.py). A model with one full-attention group, the common case, has one lane and one slot,
and a lane's changes go straight to that slot (ingest/ledger_publish.py).

A layout Cortex cannot route exactly (a group kind whose hit rule Cortex does not model, no free slot) takes the
target out of exact-KV routing with the reason (`unsupported`); the events of such a lane are dropped and counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from cortex import hit_rule
from cortex.contract import GroupSlot, TierSlot
from cortex.kv_events import MEDIUM_TIERS, TIER_GPU
from ingest.events import BlockRemoved, BlockStored
from ingest.ledger_publish import PublishedSlot, SlotAllocator

EMPTY = b""
_FULL_KINDS = frozenset({None, "full_attention", "mla_attention", "sink_full_attention"})
"""Kinds vLLM looks up with FullAttentionManager (a prefix run); None: a publisher that does not say (one group)."""
_WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
_MAX_LABELS = 16
"""Distinct unknown media counted by name per target; the rest are counted as `other` (bounded metric labels)."""

LaneId = tuple[str, int, str | None, str | None]
"""(tier, KV-cache group, locality, ownership)."""


@dataclass
class Lane:
    """The blocks one KV-cache group holds on one tier (module docstring)."""

    hash_refs: dict[int, int] = field(default_factory=dict)
    key_of: dict[int, int] = field(default_factory=dict)
    """engine hash -> Cortex key of the last full Cortex block at or before the end of that engine block."""
    pending_of: dict[int, bytes] = field(default_factory=dict)
    """engine hash -> tokens after that key, as little-endian uint32 bytes (only for engine pages smaller
    than a Cortex block)."""
    owns: dict[int, int] = field(default_factory=dict)
    """engine hash -> the Cortex key its tokens completed, 0 for none; absent when it is key_of's (pages
    as large as Cortex blocks, the common case, need no second map)."""
    key_refs: dict[int, int] = field(default_factory=dict)
    gain: Callable[[int], None] = field(default=lambda _: None, repr=False)
    """Called when the lane starts holding a key (set by the slot it publishes to)."""
    lose: Callable[[int], None] = field(default=lambda _: None, repr=False)

    def forget(self) -> None:
        self.hash_refs.clear()
        self.key_of.clear()
        self.pending_of.clear()
        self.owns.clear()
        self.key_refs.clear()

    def hook(self, gain: Callable[[int], None], lose: Callable[[int], None]) -> None:
        self.gain, self.lose = gain, lose

    def owned(self, engine_hash: int) -> int | None:
        """The Cortex key this engine block completes (0: none), or None when the lane does not hold it."""
        owned = self.owns.get(engine_hash)
        if owned is None:
            owned = self.key_of.get(engine_hash)
        return owned


@dataclass(frozen=True, slots=True)
class Spec:
    kind: str
    """hit_rule.FULL or hit_rule.WINDOW."""
    window: int = 0
    """WINDOW: the window in tokens."""


FULL_SPEC = Spec(hit_rule.FULL)


@dataclass
class LaneTable:
    """One target's lanes by KV-cache group and tier, each joined to the slot it publishes to, and the layout
    that says which slot is which."""

    slot: int
    """The target's own slot (its full-attention spec's)."""
    block_size: int
    alloc: SlotAllocator | None
    """Gives a slot for another spec or tier; None: the target's slot only."""
    dropped: Counter[str]
    """The ledger's drop counts (shared: the events this table cannot place in a lane are counted there)."""
    unknown_media: Counter[str]
    unsupported: str = ""
    """Why this target's layout cannot be routed exactly ('' when it can)."""
    layout_version: int = 0
    """Moves whenever a spec or tier gets a slot, or the layout becomes unsupported: republish the target."""
    lanes: dict[LaneId, Lane] = field(default_factory=dict, repr=False)
    group_spec: dict[int, Spec] = field(default_factory=dict, repr=False)
    _specs: dict[Spec, PublishedSlot] = field(default_factory=dict, repr=False)
    _tiers: dict[str, PublishedSlot] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.primary = PublishedSlot(self.slot, every=True)
        self.main = Lane()
        """The GPU lane of the first full-attention group (an empty stand-in until one is seen)."""

    def layout(self) -> tuple[tuple[GroupSlot, ...], tuple[TierSlot, ...]]:
        """The target's KV-cache specs and tiers with their slots (empty: one full-attention spec on the GPU)."""
        groups: tuple[GroupSlot, ...] = ()
        if any(p is not self.primary for p in self._specs.values()):
            groups = tuple(GroupSlot(slot=p.slot, kind=s.kind,
                                     need=hit_rule.window_need(s.window, self.block_size) if s.window else 0)
                           for s, p in self._specs.items())
        tiers = tuple(TierSlot(slot=p.slot, medium=t) for t, p in self._tiers.items())
        return groups, tiers

    @property
    def hybrid(self) -> bool:
        """More than one KV-cache spec (Ledger.hybrid)."""
        return len(self._specs) > 1

    def sizes(self) -> dict[str, int]:
        """Blocks held per lane, named `<tier>/<group>[/<locality>][/<ownership>]`."""
        return {"/".join(str(p) for p in lid if p is not None): len(lane.key_refs) for lid, lane in self.lanes.items()}

    def published(self) -> list[PublishedSlot]:
        """The slots this table writes (a spec or tier left without a slot writes nowhere)."""
        pubs = [self.primary, *(p for p in self._specs.values() if p is not self.primary), *self._tiers.values()]
        return [p for p in pubs if p.slot >= 0]

    def forget(self) -> None:
        for lane in self.lanes.values():
            lane.forget()
        for pub in self.published():
            pub.forget()

    def mark_unsupported(self, reason: str) -> None:
        if not self.unsupported:
            self.unsupported = reason
            self.layout_version += 1

    def lane_of(self, event: BlockStored | BlockRemoved) -> Lane | None:
        """The lane an event changes, made (with its slot) at a lane's first store; None: dropped and counted."""
        tier = MEDIUM_TIERS.get(event.medium)
        if tier is None:
            name = event.medium if len(self.unknown_media) < _MAX_LABELS or event.medium in self.unknown_media \
                else "other"
            self.unknown_media[str(name)] += 1
            self.dropped["unknown_medium"] += 1
            return None
        group = event.group_idx or 0
        lid: LaneId = (tier, group, event.locality, event.ownership) if tier != TIER_GPU else (tier, group, None, None)
        lane = self.lanes.get(lid)
        if lane is not None or not isinstance(event, BlockStored):
            return lane  # a removal from a lane never stored to has nothing to drop
        if tier == TIER_GPU:
            spec = self._spec_of(event)
            if spec is None:
                self.dropped["unsupported_group"] += 1
                return None
            return self._lane(lid, spec)
        # A lower tier counts only behind one full-attention group (its hit is a prefix lookup from the GPU hit).
        if self.hybrid or self.group_spec.get(group, FULL_SPEC) != FULL_SPEC or len(self.primary.lanes) > 1:
            self.dropped["tier_of_hybrid_model"] += 1
            return None
        return self._lane(lid, None)

    def place(self, engine_hash: int) -> int | None:
        """The Cortex key an engine block completes, from any lane that holds it (None: no lane does)."""
        for lane in self.lanes.values():
            owned = lane.owned(engine_hash)
            if owned is not None:
                return owned
        return None

    def chain_state(self, lane: Lane, parent: int) -> tuple[int, bytes] | None:
        """(key, pending tokens) after the engine block `parent`: from this lane, else from any lane holding it
        (an offloaded copy's parent, a window group's continuation after a skipped block)."""
        key = lane.key_of.get(parent)
        if key is not None:
            return key, lane.pending_of.get(parent, EMPTY)
        for other in self.lanes.values():
            key = other.key_of.get(parent)
            if key is not None:
                return key, other.pending_of.get(parent, EMPTY)
        return None

    def _slot(self) -> int | None:
        slot = self.alloc() if self.alloc is not None else None
        if slot is None:
            self.mark_unsupported("no free view slot for another KV-cache group or tier of this target "
                                  "(raise ingest.max_workers)")
        return slot

    def _lane(self, lid: LaneId, spec: Spec | None) -> Lane:
        """A new lane, joined to the slot it publishes to (a new slot if its spec or tier is new)."""
        lane = Lane()
        tier, group = lid[0], lid[1]
        before = self.layout()
        if tier == TIER_GPU:
            assert spec is not None
            pub = self._specs.get(spec)
            if pub is None:
                if spec.kind == hit_rule.FULL and not any(s.kind == hit_rule.FULL for s in self._specs):
                    pub = self.primary
                    self.main = lane
                else:
                    slot = self._slot()
                    pub = PublishedSlot(slot if slot is not None else -1, every=True)
                    pub.delta.clear()  # a slot another target may have used: start from a clean bitset
                self._specs[spec] = pub
            self.group_spec[group] = spec
        else:
            pub = self._tiers.get(tier)
            if pub is None:
                slot = self._slot()
                pub = self._tiers[tier] = PublishedSlot(slot if slot is not None else -1, every=False)
                pub.delta.clear()
        if pub.slot < 0:
            lane.gain = lane.lose = lambda _: None  # nowhere to publish (the target is marked unsupported)
        else:
            pub.join(lane)
        self.lanes[lid] = lane
        if self.layout() != before:
            # What extproc must know to read the slots changed (one full-attention group alone changes nothing).
            self.layout_version += 1
        return lane

    def _spec_of(self, event: BlockStored) -> Spec | None:
        kind = event.kv_cache_spec_kind
        if kind in _FULL_KINDS:
            return Spec(hit_rule.FULL)
        if kind in _WINDOW_KINDS and event.kv_cache_spec_sliding_window:
            if event.block_size != self.block_size:
                self.mark_unsupported(f"sliding-window KV-cache group with {event.block_size}-token blocks: Cortex "
                                      f"matches windows only when block_size ({self.block_size}) equals the model's "
                                      "page size")
                return None
            return Spec(hit_rule.WINDOW, event.kv_cache_spec_sliding_window)
        self.mark_unsupported(f"KV-cache group of kind {kind!r}: Cortex does not model its cache-hit rule")
        return None
