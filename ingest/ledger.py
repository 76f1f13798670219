"""The ledger: which Cortex block keys one event source's engine holds, per KV-cache group and per tier, built
only from its own events.

Cortex keys blocks by its own chained hash of token ids (cortex.blockkeys), so prompts and events meet on
the same keys whatever the engine's hash seed or algorithm. A *lane* is one copy set: the blocks one KV-cache
group holds on one tier (an offloading tier's copies also by locality and ownership: another owner's copy is
another copy, removed apart). Each lane maps the engine wire hashes it holds to the chain state after that engine
block: the Cortex key of the last full Cortex block, plus the tokens since (non-empty only when engine pages are
smaller than Cortex blocks, e.g. SGLang's page size 1 against Cortex's 16). That is how a BlockStored finds its
parent. The engine block whose tokens complete a Cortex block owns that key, which is how a BlockRemoved finds
what to drop: both engines evict leaf-first, so a block's earlier pages never leave before the page that completes
it. Cortex never splits an engine block (its block size is a multiple of the engine's page size), so a Cortex hit
never claims more than the engine can reuse.

Stores that say where their blocks are (a parent, or none for a chain start, and the tokens of every block) are
keyed from their tokens. Stores that do not are placed through the hashes the other lanes learned: a sliding-window
group's store skips the blocks outside its window (its hashes are fewer than its tokens' blocks), and an offloading
connector's location-only store carries a hash and nothing else (`token_ids=[]`, `block_size=0`); vLLM hashes a
block the same in every group and tier, so the full-attention group's store of the same step places them. Within a
batch a store that cannot be placed yet waits, with the rest of its lane's events, for the batch's other events.

What is published (to the shared view, one bitset column per slot): the target's slot holds the blocks of its
full-attention spec (every group of the spec, as vLLM's hit needs all of them); each other spec of a hybrid model
(a sliding window) and each lower tier (CPU, STORAGE) gets a slot of its own, allocated as it first appears, and
the target's layout (`layout()`, published in its TargetMeta) says which is which. extproc then applies the engine's
hit rule (cortex/hit_rule.py). A model with one full-attention group, the common case, has one lane and one slot,
and a lane's changes go straight to that slot.

vLLM may store one hash twice on one worker (it does not dedupe), so hashes are reference-counted per lane, and a
key leaves a lane only when its last owner goes. A reference must stand for a block the engine made: vLLM also
announces blocks it already holds (`kv_cache_report_mode: "full"` publishes a request's prefix hit as a chain start,
parent None, at each lookup), and their one eviction sends one BlockRemoved. So a chain start that repeats a hash
the lane holds adds no reference; where vLLM did make a second copy there (a prompt of one block, or one that skips
prefix-cache reads), the key then leaves with the first copy: a miss, never a false hit.

Invariant: what the ledger publishes is a subset of what the engine holds, as far as the received events show.
Anything that breaks that (an unknown parent, a page size that does not divide Cortex's block, a group kind whose
hit rule Cortex does not model) drops the event and is counted, never guessed; a layout Cortex cannot route
exactly (`unsupported`) takes the target out of exact-KV routing with the reason.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from cortex import engines, hit_rule
from cortex.blockkeys import block_key, chain_keys, chain_keys_with, event_suffixes, root_key, token_bytes
from cortex.contract import GroupSlot, TierSlot
from cortex.kv_events import MEDIUM_TIERS, TIER_GPU, TIERS
from ingest.events import AllBlocksCleared, BlockInactive, BlockRemoved, BlockStored, Event
from ingest.hash_parity import ParityCheck


class KeySink(Protocol):
    """Where per-slot key membership is published (the shared view's writer)."""

    def add(self, worker: int, keys: list[int]) -> None: ...
    def remove(self, worker: int, keys: list[int]) -> None: ...
    def clear_worker(self, worker: int) -> None: ...


SlotAllocator = Callable[[], int | None]
"""Gives the ledger a free view slot for another KV-cache spec or tier of its target (None: none left)."""

_EMPTY = b""
_FULL_KINDS = frozenset({None, "full_attention", "mla_attention", "sink_full_attention"})
"""Kinds vLLM looks up with FullAttentionManager (a prefix run); None: a publisher that does not say (one group)."""
_WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
_MAX_LABELS = 16
"""Distinct unknown media counted by name per target; the rest are counted as `other` (bounded metric labels)."""

LaneId = tuple[str, int, str | None, str | None]
"""(tier, KV-cache group, locality, ownership)."""


class _Delta:
    """The net change of one slot's key set within a deferred section."""

    __slots__ = ("added", "cleared", "removed")

    def __init__(self) -> None:
        self.cleared = False
        self.added: dict[int, None] = {}
        self.removed: dict[int, None] = {}

    def add(self, key: int) -> None:
        if key in self.removed:  # removed then stored again within the batch: present before and after
            del self.removed[key]
        else:
            self.added[key] = None

    def remove(self, key: int) -> None:
        if key in self.added:  # stored then removed within the batch: absent before and after
            del self.added[key]
        else:
            self.removed[key] = None

    def clear(self) -> None:
        self.cleared = True
        self.added.clear()
        self.removed.clear()

    def flush(self, slot: int, sink: KeySink) -> None:
        if self.cleared:
            sink.clear_worker(slot)
        if self.removed:
            sink.remove(slot, list(self.removed))
        if self.added:
            sink.add(slot, list(self.added))
        self.cleared = False
        self.added = {}
        self.removed = {}


class _Published:
    """One slot's key set: its one lane's, or the intersection (`every`: the groups of one spec) or union (the
    copies of one tier) of several lanes'."""

    __slots__ = ("counts", "delta", "every", "lanes", "slot")

    def __init__(self, slot: int, every: bool) -> None:
        self.slot = slot
        self.every = every
        self.lanes: list[Lane] = []
        self.delta = _Delta()
        self.counts: dict[int, int] = {}
        """With more than one lane: per key, how many of them hold it."""

    def join(self, lane: Lane) -> None:
        """A new lane (empty) joins. Into an intersection it removes every key (the new group holds none yet)."""
        if len(self.lanes) == 1:
            self.counts = dict.fromkeys(self.lanes[0].key_refs, 1)
        if self.every:
            for key in self.keys():
                self.delta.remove(key)
        self.lanes.append(lane)
        lane.gain, lane.lose = (self.delta.add, self.delta.remove) if len(self.lanes) == 1 else (self._gain, self._lose)
        if len(self.lanes) == 2:
            self.lanes[0].gain, self.lanes[0].lose = self._gain, self._lose

    def _gain(self, key: int) -> None:
        n = self.counts.get(key, 0) + 1
        self.counts[key] = n
        if n == (len(self.lanes) if self.every else 1):
            self.delta.add(key)

    def _lose(self, key: int) -> None:
        n = self.counts[key]
        if n == (len(self.lanes) if self.every else 1):
            self.delta.remove(key)
        if n == 1:
            del self.counts[key]
        else:
            self.counts[key] = n - 1

    def size(self) -> int:
        if len(self.lanes) == 1:
            return len(self.lanes[0].key_refs)
        need = len(self.lanes) if self.every else 1
        return sum(1 for n in self.counts.values() if n >= need)

    def keys(self) -> list[int]:
        if len(self.lanes) == 1:
            return list(self.lanes[0].key_refs)
        need = len(self.lanes) if self.every else 1
        return [k for k, n in self.counts.items() if n >= need]

    def forget(self) -> None:
        self.counts.clear()
        self.delta.clear()


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

    def owned(self, engine_hash: int) -> int | None:
        """The Cortex key this engine block completes (0: none), or None when the lane does not hold it."""
        owned = self.owns.get(engine_hash)
        if owned is None:
            owned = self.key_of.get(engine_hash)
        return owned


@dataclass(frozen=True, slots=True)
class _Spec:
    kind: str
    """hit_rule.FULL or hit_rule.WINDOW."""
    window: int = 0
    """WINDOW: the window in tokens."""


_FULL_SPEC = _Spec(hit_rule.FULL)


@dataclass
class Ledger:
    slot: int
    engine: str
    block_size: int
    """Cortex's key block size."""
    parity: ParityCheck | None = None
    alloc: SlotAllocator | None = None
    """Gives a slot for another spec or tier; None: this ledger may publish its target's slot only."""
    dropped: Counter[str] = field(default_factory=Counter)
    unknown_media: Counter[str] = field(default_factory=Counter)
    blocks_stored: int = 0
    blocks_removed: int = 0
    blocks_restated: int = 0
    """Blocks a chain start announced again while the ledger held them: counted, no new reference."""
    events_applied: int = 0
    events_inactive: int = 0
    """BlockInactive events seen (vLLM, in review): no change to what the engine holds."""
    lookahead: int = 0
    """The most tokens after a block any store folded into its hash (vLLM lookahead hashing)."""
    unsupported: str = ""
    """Why this target's layout cannot be routed exactly ('' when it can)."""
    layout_version: int = 0
    """Moves whenever a spec or tier gets a slot, or the layout becomes unsupported: republish the target."""
    _lanes: dict[LaneId, Lane] = field(default_factory=dict, repr=False)
    _specs: dict[_Spec, _Published] = field(default_factory=dict, repr=False)
    _group_spec: dict[int, _Spec] = field(default_factory=dict, repr=False)
    _tiers: dict[str, _Published] = field(default_factory=dict, repr=False)
    _depth: int = field(default=0, repr=False)
    _held: list[tuple[Lane, BlockStored | BlockRemoved]] | None = field(default=None, repr=False)
    """Events of lanes waiting for the end of the batch (a store not yet placeable, and what follows it)."""

    def __post_init__(self) -> None:
        self._primary = _Published(self.slot, every=True)
        self._main = Lane()
        """The GPU lane of the first full-attention group (an empty stand-in until one is seen)."""

    # -- what others read

    @property
    def hash_refs(self) -> dict[int, int]:
        """The main lane's (GPU, the first full-attention group) engine hash references."""
        return self._main.hash_refs

    @property
    def key_refs(self) -> dict[int, int]:
        return self._main.key_refs

    @property
    def blocks(self) -> int:
        """Cortex blocks the target's slot lists (its full-attention spec's)."""
        return self._primary.size() if self._primary.lanes else 0

    def layout(self) -> tuple[tuple[GroupSlot, ...], tuple[TierSlot, ...]]:
        """The target's KV-cache specs and tiers with their slots (empty: one full-attention spec on the GPU)."""
        groups: tuple[GroupSlot, ...] = ()
        if any(p is not self._primary for p in self._specs.values()):
            groups = tuple(GroupSlot(slot=p.slot, kind=s.kind,
                                     need=hit_rule.window_need(s.window, self.block_size) if s.window else 0)
                           for s, p in self._specs.items())
        tiers = tuple(TierSlot(slot=p.slot, medium=t) for t, p in self._tiers.items())
        return groups, tiers

    @property
    def hybrid(self) -> bool:
        """More than one KV-cache spec. Then a chain start repeating held hashes is a new copy: vLLM recomputes
        from block 0 whenever a sliding window lacks the blocks back from the full-attention run (a hit of 0),
        which is common, while its reported prefix hits (`kv_cache_report_mode: "full"`) also announce window
        blocks the group does not hold and cannot be followed on such a model at all (docs/ledger.md)."""
        return len(self._specs) > 1

    def slots(self) -> list[int]:
        """Every view slot this ledger publishes to (its target's, then its other specs' and tiers')."""
        return [p.slot for p in self._published()]

    def lanes(self) -> dict[str, int]:
        """Blocks held per lane, for /cortex/workers: `<tier>/<group>[/<locality>][/<ownership>]`."""
        return {"/".join(str(p) for p in lid if p is not None): len(lane.key_refs) for lid, lane in self._lanes.items()}

    # -- write sections

    @contextlib.contextmanager
    def deferred(self, sink: KeySink) -> Iterator[None]:
        """Collect the net effect of every apply/clear inside, and publish it in at most three view writes
        per slot at the end (each write is a section readers may have to wait out, and costs about the same for
        1 key or 100). Removals go before additions, so a reader between the two sees a subset of the
        worker's cache, never more."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                for pub in self._published():
                    pub.delta.flush(pub.slot, sink)

    def _published(self) -> list[_Published]:
        """The slots this ledger writes (a spec or tier left without a slot writes nowhere)."""
        pubs = [self._primary, *(p for p in self._specs.values() if p is not self._primary), *self._tiers.values()]
        return [p for p in pubs if p.slot >= 0]

    def apply(self, events: list[Event], sink: KeySink) -> None:
        with self.deferred(sink):
            self._held = None
            for event in events:
                if isinstance(event, BlockStored):
                    self._stored(event)
                elif isinstance(event, BlockRemoved):
                    self._removed(event)
                elif isinstance(event, AllBlocksCleared):
                    self._forget()
                    self._held = None  # what waited came before the clear
                elif isinstance(event, BlockInactive):
                    self.events_inactive += 1
                self.events_applied += 1
            held, self._held = self._held, None
            if held:
                # The batch's other events have placed what they could: the waiting ones go now, in order.
                for lane, ev in held:
                    if isinstance(ev, BlockStored):
                        self._store_in(lane, ev, last_chance=True)
                    else:
                        self._remove_from(lane, ev)

    def clear(self, sink: KeySink) -> None:
        with self.deferred(sink):
            self._forget()

    def hide(self, sink: KeySink) -> None:
        """Show nothing for this target in the view, keeping what the ledger knows. While a stream is not in
        sync (a gap, a silence probe), batches it has not applied yet may hold removals: the view must not
        offer those blocks to a reader that has not yet seen the target turn untrusted (extproc re-reads trust
        a refresh later)."""
        with self.deferred(sink):
            for pub in self._published():
                pub.delta.clear()

    def reveal(self, sink: KeySink) -> None:
        """Show the ledger's whole key set again (the stream is back in sync)."""
        with self.deferred(sink):
            for pub in self._published():
                pub.delta.clear()
                pub.delta.added = dict.fromkeys(pub.keys())

    def _forget(self) -> None:
        for lane in self._lanes.values():
            lane.forget()
        for pub in self._published():
            pub.forget()

    # -- the layout: lanes, specs, tiers and their slots

    def _unsupported(self, reason: str) -> None:
        if not self.unsupported:
            self.unsupported = reason
            self.layout_version += 1

    def _slot(self) -> int | None:
        slot = self.alloc() if self.alloc is not None else None
        if slot is None:
            self._unsupported("no free view slot for another KV-cache group or tier of this target "
                              "(raise ingest.max_workers)")
        return slot

    def _lane(self, lid: LaneId, spec: _Spec | None) -> Lane:
        """A new lane, joined to the slot it publishes to (a new slot if its spec or tier is new)."""
        lane = Lane()
        tier, group = lid[0], lid[1]
        before = self.layout()
        if tier == TIER_GPU:
            assert spec is not None
            pub = self._specs.get(spec)
            if pub is None:
                if spec.kind == hit_rule.FULL and not any(s.kind == hit_rule.FULL for s in self._specs):
                    pub = self._primary
                    self._main = lane
                else:
                    slot = self._slot()
                    pub = _Published(slot if slot is not None else -1, every=True)
                    pub.delta.clear()  # a slot another target may have used: start from a clean bitset
                self._specs[spec] = pub
            self._group_spec[group] = spec
        else:
            pub = self._tiers.get(tier)
            if pub is None:
                slot = self._slot()
                pub = self._tiers[tier] = _Published(slot if slot is not None else -1, every=False)
                pub.delta.clear()
        if pub.slot < 0:
            lane.gain = lane.lose = lambda _: None  # nowhere to publish (the target is marked unsupported)
        else:
            pub.join(lane)
        self._lanes[lid] = lane
        if self.layout() != before:
            # What extproc must know to read the slots changed (one full-attention group alone changes nothing).
            self.layout_version += 1
        return lane

    def _spec_of(self, event: BlockStored) -> _Spec | None:
        kind = event.kv_cache_spec_kind
        if kind in _FULL_KINDS:
            return _Spec(hit_rule.FULL)
        if kind in _WINDOW_KINDS and event.kv_cache_spec_sliding_window:
            if event.block_size != self.block_size:
                self._unsupported(f"sliding-window KV-cache group with {event.block_size}-token blocks: Cortex "
                                  f"matches windows only when block_size ({self.block_size}) equals the model's "
                                  "page size")
                return None
            return _Spec(hit_rule.WINDOW, event.kv_cache_spec_sliding_window)
        self._unsupported(f"KV-cache group of kind {kind!r}: Cortex does not model its cache-hit rule")
        return None

    def _lane_of(self, event: BlockStored | BlockRemoved) -> Lane | None:
        tier = MEDIUM_TIERS.get(event.medium)
        if tier is None:
            name = event.medium if len(self.unknown_media) < _MAX_LABELS or event.medium in self.unknown_media \
                else "other"
            self.unknown_media[str(name)] += 1
            self.dropped["unknown_medium"] += 1
            return None
        group = event.group_idx or 0
        lid: LaneId = (tier, group, event.locality, event.ownership) if tier != TIER_GPU else (tier, group, None, None)
        lane = self._lanes.get(lid)
        if lane is not None or not isinstance(event, BlockStored):
            return lane  # a removal from a lane never stored to has nothing to drop
        if tier == TIER_GPU:
            spec = self._spec_of(event)
            if spec is None:
                self.dropped["unsupported_group"] += 1
                return None
            return self._lane(lid, spec)
        # A lower tier counts only behind one full-attention group (its hit is a prefix lookup from the GPU hit).
        if self.hybrid or self._group_spec.get(group, _FULL_SPEC) != _FULL_SPEC or len(self._primary.lanes) > 1:
            self.dropped["tier_of_hybrid_model"] += 1
            return None
        return self._lane(lid, None)

    # -- events

    def _salt(self, event: BlockStored) -> str | None:
        return engines.adapter(self.engine).event_salt(event.cache_salt, event.extra_keys, event.lora_name)

    def _stored(self, event: BlockStored) -> None:
        lane = self._lane_of(event)
        if lane is None:
            return
        if event.lookahead > self.lookahead:
            self.lookahead = event.lookahead
            self.layout_version += 1
        held = self._held
        if held is not None and any(w is lane for w, _ in held):
            held.append((lane, event))  # behind an earlier store of its lane that waits
            return
        self._store_in(lane, event, last_chance=False)

    def _store_in(self, lane: Lane, event: BlockStored, *, last_chance: bool) -> None:
        page = event.block_size
        n = len(event.block_hashes)
        if n == 0:
            return
        if page > 0 and len(event.token_ids) == n * page:
            self._store_dense(lane, event)
        elif last_chance or self._placeable(event):
            self._store_placed(lane, event)
        else:
            if self._held is None:
                self._held = []
            self._held.append((lane, event))

    def _placeable(self, event: BlockStored) -> bool:
        return all(self._place(h) is not None for h in event.block_hashes)

    def _place(self, engine_hash: int) -> int | None:
        """The Cortex key an engine block completes, from any lane that holds it (None: no lane does)."""
        for lane in self._lanes.values():
            owned = lane.owned(engine_hash)
            if owned is not None:
                return owned
        return None

    def _store_dense(self, lane: Lane, event: BlockStored) -> None:
        page = event.block_size
        n = len(event.block_hashes)
        salt = self._salt(event)
        if (self.parity is not None and MEDIUM_TIERS.get(event.medium) == TIER_GPU
                and self._group_spec.get(event.group_idx or 0) == _FULL_SPEC):
            # A sliding-window group's chain starts are no chain starts (the blocks before its window are
            # skipped), and offloaded copies are the GPU's: only full attention on the GPU is checked.
            self.parity.observe(event, salt)
        if self.block_size % page:
            self.dropped["page_size_not_a_divisor"] += 1
            return
        # Media items and prompt embeds are in the engine's hash beside the tokens: their blocks' keys fold them in
        # (cortex/blockkeys.py), so they never meet a text-only block of the same tokens. Folded per engine page,
        # they are keyed only where a page is a Cortex block (extproc keys such prompts likewise).
        suffixes = event_suffixes(event.extra_keys)
        if suffixes and page != self.block_size:
            self.dropped["media_page_not_block"] += 1
            return
        parent = event.parent_block_hash
        if parent is None:
            key, pending = root_key(event.lora_name, salt), _EMPTY
        else:
            found = self._chain_state(lane, parent)
            if found is None:
                self.dropped["unknown_parent"] += 1
                return
            key, pending = found
        hashes = event.block_hashes
        refs, key_of, key_refs = lane.hash_refs, lane.key_of, lane.key_refs
        gain = lane.gain
        # A chain start may announce blocks the engine already holds (vLLM's reported prefix hits): a hash held
        # already is then no new block, and counting it would outlive the block's one BlockRemoved.
        restated = parent is None and not self.hybrid
        if page == self.block_size:
            keys = chain_keys_with(event.token_ids, page, key, suffixes) if suffixes else \
                chain_keys(event.token_ids, page, key)
            for engine_hash, k in zip(hashes, keys, strict=True):
                r = refs.get(engine_hash)
                if r is None:
                    refs[engine_hash] = 1
                    key_of[engine_hash] = k
                elif restated:
                    self.blocks_restated += 1
                    continue
                else:  # stored twice (vLLM does not dedupe): the first mapping stands
                    refs[engine_hash] = r + 1
                    k = key_of[engine_hash]
                kr = key_refs.get(k, 0)
                key_refs[k] = kr + 1
                if kr == 0:
                    gain(k)
        else:
            raw = token_bytes(event.token_ids)
            stride, full = page * 4, self.block_size * 4
            for i, engine_hash in enumerate(hashes):
                pending = pending + raw[i * stride:(i + 1) * stride]
                completed = 0
                if len(pending) == full:
                    key = block_key(pending, key)
                    completed, pending = key, _EMPTY
                r = refs.get(engine_hash)
                if r is None:
                    refs[engine_hash] = 1
                    key_of[engine_hash] = key
                    lane.owns[engine_hash] = completed
                    if pending:
                        lane.pending_of[engine_hash] = pending
                elif restated:
                    self.blocks_restated += 1
                    continue
                else:
                    refs[engine_hash] = r + 1
                    completed = lane.owns[engine_hash]
                if completed:
                    kr = key_refs.get(completed, 0)
                    key_refs[completed] = kr + 1
                    if kr == 0:
                        gain(completed)
        self.blocks_stored += n

    def _chain_state(self, lane: Lane, parent: int) -> tuple[int, bytes] | None:
        """(key, pending tokens) after the engine block `parent`: from this lane, else from any lane holding it
        (an offloaded copy's parent, a window group's continuation after a skipped block)."""
        key = lane.key_of.get(parent)
        if key is not None:
            return key, lane.pending_of.get(parent, _EMPTY)
        for other in self._lanes.values():
            key = other.key_of.get(parent)
            if key is not None:
                return key, other.pending_of.get(parent, _EMPTY)
        return None

    def _store_placed(self, lane: Lane, event: BlockStored) -> None:
        """A store whose blocks' positions come from other lanes (a window group's, a location-only copy)."""
        refs, key_of, key_refs = lane.hash_refs, lane.key_of, lane.key_refs
        restated = event.parent_block_hash is None and not self.hybrid
        for engine_hash in event.block_hashes:
            r = refs.get(engine_hash)
            if r is not None:
                if restated:
                    self.blocks_restated += 1
                    continue
                refs[engine_hash] = r + 1
                k = lane.owned(engine_hash) or 0
            else:
                placed = self._place(engine_hash)
                if placed is None:
                    self.dropped["unknown_position"] += 1
                    continue
                refs[engine_hash] = 1
                key_of[engine_hash] = placed
                k = placed
            self.blocks_stored += 1
            if k:
                kr = key_refs.get(k, 0)
                key_refs[k] = kr + 1
                if kr == 0:
                    lane.gain(k)

    def _removed(self, event: BlockRemoved) -> None:
        lane = self._lane_of(event)
        if lane is None:
            if MEDIUM_TIERS.get(event.medium) is not None:
                self.dropped["unknown_removal"] += len(event.block_hashes)
            return
        held = self._held
        if held is not None and any(w is lane for w, _ in held):
            held.append((lane, event))
            return
        self._remove_from(lane, event)

    def _remove_from(self, lane: Lane, event: BlockRemoved) -> None:
        refs, key_refs = lane.hash_refs, lane.key_refs
        for engine_hash in event.block_hashes:
            r = refs.get(engine_hash)
            if r is None:
                self.dropped["unknown_removal"] += 1
                continue
            owned = lane.owns.get(engine_hash)
            if owned is None:
                owned = lane.key_of[engine_hash]
            if r == 1:
                del refs[engine_hash]
                del lane.key_of[engine_hash]
                lane.pending_of.pop(engine_hash, None)
                lane.owns.pop(engine_hash, None)
            else:
                refs[engine_hash] = r - 1
            if owned:
                kr = key_refs[owned] - 1
                if kr == 0:
                    del key_refs[owned]
                    lane.lose(owned)
                else:
                    key_refs[owned] = kr
            self.blocks_removed += 1


__all__ = ["TIERS", "KeySink", "Lane", "Ledger", "SlotAllocator"]
