"""The ledger: which Cortex block keys one event source's engine holds, per KV-cache group and per tier, built
only from its own events.

Cortex keys blocks by its own chained hash of token ids (cortex.blockkeys), so prompts and events meet on
the same keys whatever the engine's hash seed or algorithm. A *lane* is one copy set: the blocks one KV-cache
group holds on one tier (ingest/ledger_lanes.py: which lanes a target has, and the view slot each publishes to).
Each lane maps the engine wire hashes it holds to the chain state after that engine
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

What changes is published to the shared view in one write section per batch (ingest/ledger_publish.py).

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
from collections.abc import Iterator
from dataclasses import dataclass, field

from cortex import engines
from cortex.blockkeys import block_key, chain_keys, chain_keys_with, event_suffixes, root_key, token_bytes
from cortex.contract import GroupSlot, TierSlot
from cortex.kv_events import MEDIUM_TIERS, TIER_GPU
from ingest.events import AllBlocksCleared, BlockInactive, BlockRemoved, BlockStored, Event
from ingest.hash_parity import ParityCheck
from ingest.ledger_lanes import EMPTY, FULL_SPEC, Lane, LaneTable
from ingest.ledger_publish import KeySink, SlotAllocator


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
    _depth: int = field(default=0, repr=False)
    _held: list[tuple[Lane, BlockStored | BlockRemoved]] | None = field(default=None, repr=False)
    """Events of lanes waiting for the end of the batch (a store not yet placeable, and what follows it)."""

    def __post_init__(self) -> None:
        self._table = LaneTable(self.slot, self.block_size, self.alloc, self.dropped, self.unknown_media)

    # -- what others read

    @property
    def unsupported(self) -> str:
        """Why this target's layout cannot be routed exactly ('' when it can)."""
        return self._table.unsupported

    @property
    def layout_version(self) -> int:
        """Moves whenever a spec or tier gets a slot, or the layout becomes unsupported: republish the target."""
        return self._table.layout_version

    @property
    def hash_refs(self) -> dict[int, int]:
        """The main lane's (GPU, the first full-attention group) engine hash references."""
        return self._table.main.hash_refs

    @property
    def key_refs(self) -> dict[int, int]:
        return self._table.main.key_refs

    @property
    def blocks(self) -> int:
        """Cortex blocks the target's slot lists (its full-attention spec's)."""
        primary = self._table.primary
        return primary.size() if primary.lanes else 0

    def layout(self) -> tuple[tuple[GroupSlot, ...], tuple[TierSlot, ...]]:
        """The target's KV-cache specs and tiers with their slots (empty: one full-attention spec on the GPU)."""
        return self._table.layout()

    @property
    def hybrid(self) -> bool:
        """More than one KV-cache spec. Then a chain start repeating held hashes is a new copy: vLLM recomputes
        from block 0 whenever a sliding window lacks the blocks back from the full-attention run (a hit of 0),
        which is common, while its reported prefix hits (`kv_cache_report_mode: "full"`) also announce window
        blocks the group does not hold and cannot be followed on such a model at all (docs/ledger.md)."""
        return self._table.hybrid

    def slots(self) -> list[int]:
        """Every view slot this ledger publishes to (its target's, then its other specs' and tiers')."""
        return [p.slot for p in self._table.published()]

    def lanes(self) -> dict[str, int]:
        """Blocks held per lane, for /cortex/workers: `<tier>/<group>[/<locality>][/<ownership>]`."""
        return self._table.sizes()

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
                for pub in self._table.published():
                    pub.delta.flush(pub.slot, sink)

    def apply(self, events: list[Event], sink: KeySink) -> None:
        with self.deferred(sink):
            self._held = None
            for event in events:
                if isinstance(event, BlockStored):
                    self._stored(event)
                elif isinstance(event, BlockRemoved):
                    self._removed(event)
                elif isinstance(event, AllBlocksCleared):
                    self._table.forget()
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
            self._table.forget()

    def hide(self, sink: KeySink) -> None:
        """Show nothing for this target in the view, keeping what the ledger knows. While a stream is not in
        sync (a gap, a silence probe), batches it has not applied yet may hold removals: the view must not
        offer those blocks to a reader that has not yet seen the target turn untrusted (extproc re-reads trust
        a refresh later)."""
        with self.deferred(sink):
            for pub in self._table.published():
                pub.delta.clear()

    def reveal(self, sink: KeySink) -> None:
        """Show the ledger's whole key set again (the stream is back in sync)."""
        with self.deferred(sink):
            for pub in self._table.published():
                pub.delta.clear()
                pub.delta.added = dict.fromkeys(pub.keys())

    # -- events

    def _salt(self, event: BlockStored) -> str | None:
        return engines.adapter(self.engine).event_salt(event.cache_salt, event.extra_keys, event.lora_name)

    def _stored(self, event: BlockStored) -> None:
        lane = self._table.lane_of(event)
        if lane is None:
            return
        if event.lookahead > self.lookahead:
            self.lookahead = event.lookahead
            self._table.layout_version += 1  # the published lookahead changes
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
        place = self._table.place
        return all(place(h) is not None for h in event.block_hashes)

    def _store_dense(self, lane: Lane, event: BlockStored) -> None:
        page = event.block_size
        n = len(event.block_hashes)
        salt = self._salt(event)
        if (self.parity is not None and MEDIUM_TIERS.get(event.medium) == TIER_GPU
                and self._table.group_spec.get(event.group_idx or 0) == FULL_SPEC):
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
            key, pending = root_key(event.lora_name, salt), EMPTY
        else:
            found = self._table.chain_state(lane, parent)
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
                    completed, pending = key, EMPTY
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
                placed = self._table.place(engine_hash)
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
        lane = self._table.lane_of(event)
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


__all__ = ["Ledger"]
