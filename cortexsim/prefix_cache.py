"""A paged KV-cache block pool with vLLM 0.33 prefix-caching semantics and its KV events.

Model (``vllm/v1/core/block_pool.py``, ``kv_cache_manager.py``, ``single_type_kv_cache_manager.py``):

* ``num_blocks`` is vLLM's ``num_gpu_blocks``; block 0 is the null placeholder, so ``num_blocks - 1`` hold KV.
* A full block is identified by its chained engine hash (``cortex.engine_hashes``). The hash map may hold
  several blocks per hash: vLLM never dedupes, so two requests that computed the same prefix side by side
  each store (and later evict) their own copy, and each produces events.
* Lookup walks a request's prompt hashes from the start and stops at the first miss. The hit is capped at
  ``num_tokens - 1`` tokens (at least one token must be computed to get logits), i.e. at most
  ``(num_tokens - 1) // block_size`` blocks.
* A running request pins (ref-counts) its blocks. Blocks with ref 0 sit in the free queue, cached or not.
  Allocation pops the queue head and, if the popped block was cached, evicts it (one ``BlockRemoved``).
  A finishing request frees its blocks tail first, so a chain's leaves are evicted before its root and,
  across requests, the least recently freed block goes first.
* Full blocks enter the hash map as soon as the step that computes them is scheduled (``commit``, called by
  the engine when it schedules: vLLM's ``allocate_slots`` caches up to the tokens scheduled), prompt and output
  alike, one ``BlockStored`` per commit covering the newly cached blocks, with the parent being the block just
  before them. A request scheduled after it, in the same step or later, hits them; two requests store the
  same hash only when the second could not hit it (the ``len - 1`` cap recomputes a whole-block prompt's last
  block; vLLM also skips prefix-cache reads for prompt logprobs).
* A request with ``kv_cache_report_mode: "full"`` (vLLM's ``vllm_xargs``) also gets a ``BlockStored`` for the
  blocks it hit, parent None, at every lookup (``emit_cached_block_events``): the same hashes again, with no new
  block behind them, so the block's one eviction still produces one ``BlockRemoved``.

Simplification, on purpose: vLLM admits a request when its prompt fits and preempts running requests when
decode runs out of blocks. Here admission reserves the worst case (prompt + ``max_new_tokens - 1`` slots; the
last sampled token is never fed back), so running requests never starve and there is no preemption. The
blocks are still taken from the free queue only when a token needs them, so eviction happens when vLLM's
would.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from cortex.engine_hashes import (
    LoraRef,
    VllmBlockHasher,
    vllm_event_extra_keys,
    vllm_extra_keys,
    vllm_mm_keys,
    vllm_wire_hash,
)
from cortex.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from cortex.media import MediaSpan

KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class CapacityError(ValueError):
    """The request can never run on this pool, however much is evicted (a client error, not a wait)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(eq=False)
class _Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


@dataclass(eq=False)
class _Seq:
    request_id: str
    token_ids: list[int]
    block_hashes: list[bytes]
    cache_salt: str | None
    lora: LoraRef | None
    media: tuple[MediaSpan, ...] = ()
    blocks: list[_Block] = field(default_factory=list)
    num_cached_blocks: int = 0
    reserved: int = 0
    cacheable: bool = True


@dataclass(frozen=True)
class Admission:
    """What a successful admission tells the scheduler: how much of the prompt need not be computed."""

    num_cached_tokens: int
    num_hit_blocks: int


class PrefixCache:
    caches_on_schedule = True
    """vLLM caches a request's full blocks when it allocates them for a step, before they are computed."""

    def __init__(self, num_blocks: int, block_size: int = 16, *, hasher: VllmBlockHasher | None = None,
                 medium: str = MEDIUM_GPU, group_idx: int = 0, kv_cache_spec_kind: str | None = None,
                 int_block_hashes: bool = True) -> None:
        """`kv_cache_spec_kind` is None for BlockPool-level events and "full_attention" for what a served
        vLLM publishes (its KVCacheManager adds it); `int_block_hashes=False` mirrors
        VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (raw digests on the wire)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (one is the null block), got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.hasher = hasher or VllmBlockHasher()
        self.medium = medium
        self.group_idx = group_idx
        self.kv_cache_spec_kind = kv_cache_spec_kind
        self.int_block_hashes = int_block_hashes
        blocks = [_Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order; an OrderedDict gives O(1) popleft, append and removal.
        self._free: OrderedDict[int, _Block] = OrderedDict((b.block_id, b) for b in blocks[1:])
        self._cached: dict[bytes, dict[int, _Block]] = {}
        self._seqs: dict[str, _Seq] = {}
        self._reserved_total = 0
        self._events: list[KVEvent] = []
        self.query_tokens = 0
        self.hit_tokens = 0

    # --- read-only views -----------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def max_request_tokens(self) -> int:
        return self.num_usable_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: share of usable blocks pinned (a cached but free block is free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(v) for v in self._cached.values())

    def is_running(self, request_id: str) -> bool:
        return request_id in self._seqs

    def prompt_hashes(self, token_ids: list[int], *, cache_salt: str | None = None,
                      lora: LoraRef | None = None, media: Sequence[MediaSpan] = ()) -> list[bytes]:
        """Hashes of the prompt's full blocks; compute once per request and pass to lookup/admit."""
        return self.hasher.block_hashes(token_ids, self.block_size, cache_salt=cache_salt, lora=lora, media=media)

    def lookup(self, num_tokens: int, block_hashes: list[bytes]) -> int:
        """Prefix-hit length in tokens, without side effects."""
        return len(self._hit_blocks(num_tokens, block_hashes)) * self.block_size

    def prefix_match(self, token_ids: list[int], *, cache_salt: str | None = None, lora: LoraRef | None = None,
                     extra_key: str | None = None) -> int:
        """Tokens a request for `token_ids` would find cached right now (the `/sim/prefix_match` probe)."""
        return self.lookup(len(token_ids), self.prompt_hashes(token_ids, cache_salt=cache_salt, lora=lora))

    def check_fits(self, num_prompt_tokens: int, max_new_tokens: int = 1) -> None:
        if num_prompt_tokens <= 0:
            raise CapacityError("the prompt must contain at least one token")
        if max_new_tokens < 1:
            raise CapacityError("max_new_tokens must be at least 1")
        needed = self._total_blocks(num_prompt_tokens, max_new_tokens)
        if needed > self.num_usable_blocks:
            raise CapacityError(
                f"request needs {needed} KV blocks ({num_prompt_tokens} prompt + {max_new_tokens} new "
                f"tokens, block size {self.block_size}) but the cache holds only {self.num_usable_blocks}")

    # --- request lifecycle ---------------------------------------------------------------------

    def admit(self, request_id: str, token_ids: list[int], *, max_new_tokens: int = 1,
              block_hashes: list[bytes] | None = None, cache_salt: str | None = None,
              lora: LoraRef | None = None, extra_key: str | None = None,
              report_hits: bool = False, media: Sequence[MediaSpan] = ()) -> Admission | None:
        """Pin the prompt's cached prefix and allocate blocks for the rest of the prompt.

        Returns None when the blocks are not free now (the caller keeps the request waiting) and raises
        CapacityError when they never will be. `extra_key` is SGLang's and ignored here (vLLM has none).
        `report_hits` is vLLM's ``kv_cache_report_mode: "full"``: the hit is announced again as a BlockStored
        whenever it is looked up, admitted or not (vLLM emits it in ``get_computed_blocks``, before allocating).
        """
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} is already admitted")
        num_tokens = len(token_ids)
        self.check_fits(num_tokens, max_new_tokens)
        if block_hashes is None:
            block_hashes = self.prompt_hashes(token_ids, cache_salt=cache_salt, lora=lora, media=media)
        hits = self._hit_blocks(num_tokens, block_hashes)
        if report_hits and hits:
            self._events.append(self._stored_event(token_ids, block_hashes, 0, len(hits), cache_salt, lora,
                                                   tuple(media)))
        total = self._total_blocks(num_tokens, max_new_tokens)
        prompt_blocks = _cdiv(num_tokens, self.block_size)
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        # Touched hits leave the free queue too, so they count against what is free now.
        if (total - len(hits)) + evictable_hits > self.num_free_blocks - self._reserved_total:
            return None
        for block in hits:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1
        seq = _Seq(request_id, list(token_ids), list(block_hashes), cache_salt, lora, tuple(media), blocks=list(hits),
                   num_cached_blocks=len(hits))
        # Touch before popping: popping first could evict the very blocks this request just hit.
        for _ in range(prompt_blocks - len(hits)):
            seq.blocks.append(self._pop_free())
        seq.reserved = total - prompt_blocks
        self._reserved_total += seq.reserved
        self._seqs[request_id] = seq
        self.query_tokens += num_tokens
        self.hit_tokens += len(hits) * self.block_size
        return Admission(num_cached_tokens=len(hits) * self.block_size, num_hit_blocks=len(hits))

    def extend(self, request_id: str, new_token_ids: list[int]) -> None:
        """Append sampled tokens that are about to be computed, taking blocks for them as needed."""
        seq = self._seqs[request_id]
        seq.token_ids.extend(new_token_ids)
        for _ in range(_cdiv(len(seq.token_ids), self.block_size) - len(seq.blocks)):
            if seq.reserved > 0:
                seq.reserved -= 1
                self._reserved_total -= 1
            elif self.num_free_blocks - self._reserved_total <= 0:
                raise CapacityError(f"request {request_id!r} outgrew its reservation and no block is free")
            seq.blocks.append(self._pop_free())

    def commit(self, request_id: str, num_computed_tokens: int) -> None:
        """Cache the blocks that are full among the first `num_computed_tokens` (their KV now exists)."""
        seq = self._seqs[request_id]
        if num_computed_tokens > len(seq.token_ids):
            raise ValueError(f"request {request_id!r} has only {len(seq.token_ids)} tokens, "
                             f"cannot commit {num_computed_tokens}")
        if not seq.cacheable:
            return
        num_full = num_computed_tokens // self.block_size
        first = seq.num_cached_blocks
        if num_full <= first:
            return
        if len(seq.block_hashes) < num_full:
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.extend(self.hasher.block_hashes(
                seq.token_ids[: num_full * self.block_size], self.block_size,
                start_block=len(seq.block_hashes), parent=parent, cache_salt=seq.cache_salt, lora=seq.lora,
                media=seq.media))
        for idx in range(first, num_full):
            block = seq.blocks[idx]
            block.block_hash = seq.block_hashes[idx]
            self._cached.setdefault(block.block_hash, {})[block.block_id] = block
        seq.num_cached_blocks = num_full
        self._events.append(self._stored_event(seq.token_ids, seq.block_hashes, first, num_full, seq.cache_salt,
                                               seq.lora, seq.media))

    def _stored_event(self, token_ids: list[int], block_hashes: list[bytes], first: int, end: int,
                      cache_salt: str | None, lora: LoraRef | None, media: tuple[MediaSpan, ...] = ()) -> BlockStored:
        """vLLM's ``_build_block_stored_event`` for blocks first..end-1 (new ones, or a reported hit)."""
        bs = self.block_size
        return BlockStored(
            block_hashes=[self._wire(h) for h in block_hashes[first:end]],
            parent_block_hash=self._wire(block_hashes[first - 1]) if first > 0 else None,
            token_ids=token_ids[first * bs: end * bs],
            block_size=bs,
            lora_id=lora.int_id if lora else None,
            medium=self.medium,
            lora_name=lora.name if lora else None,
            extra_keys=[vllm_event_extra_keys(vllm_extra_keys(
                i * bs, cache_salt=cache_salt, lora=lora, media=vllm_mm_keys(media, i * bs, (i + 1) * bs)))
                for i in range(first, end)],
            group_idx=self.group_idx,
            kv_cache_spec_kind=self.kv_cache_spec_kind,
        )

    def free(self, request_id: str) -> None:
        """Unpin a finished or aborted request's blocks; cached ones stay hittable until evicted."""
        seq = self._seqs.pop(request_id)
        self._reserved_total -= seq.reserved
        # Tail first: the free queue is the eviction order, and leaves must go before their parents.
        for block in reversed(seq.blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def block_ids(self, request_id: str) -> list[int]:
        """The physical block ids a running (or held) request owns, as vLLM reports them to a KV connector."""
        return [b.block_id for b in self._seqs[request_id].blocks]

    def forget_all(self) -> None:
        """A restarted engine starts cold: forget every hash without an event (vLLM sends none at startup).

        Requests still running keep their blocks but no longer cache them: their chain is gone."""
        for seq in self._seqs.values():
            seq.cacheable = False
        for same in self._cached.values():
            for block in same.values():
                block.block_hash = None
        self._cached.clear()
        self._events.clear()

    def reset(self) -> bool:
        """vLLM's reset_prefix_cache: refuse while any block is pinned, else forget every hash."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self._free.values():
            block.block_hash = None
        self._cached.clear()
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    # --- internals -----------------------------------------------------------------------------

    def _total_blocks(self, num_prompt_tokens: int, max_new_tokens: int) -> int:
        # The last sampled token is returned but never fed back, so it needs no KV slot.
        return _cdiv(num_prompt_tokens + max(max_new_tokens, 1) - 1, self.block_size)

    def _hit_blocks(self, num_tokens: int, block_hashes: list[bytes]) -> list[_Block]:
        max_blocks = (num_tokens - 1) // self.block_size
        hits: list[_Block] = []
        for block_hash in block_hashes[:max_blocks]:
            same = self._cached.get(block_hash)
            if not same:
                break
            hits.append(next(iter(same.values())))
        return hits

    def _pop_free(self) -> _Block:
        _, block = self._free.popitem(last=False)
        if block.block_hash is not None:
            same = self._cached[block.block_hash]
            del same[block.block_id]
            if not same:
                del self._cached[block.block_hash]
            self._events.append(BlockRemoved(block_hashes=[self._wire(block.block_hash)], medium=self.medium,
                                             group_idx=self.group_idx))
            block.block_hash = None
        block.ref_cnt = 1  # the caller owns it
        return block

    def _wire(self, block_hash: bytes) -> int | bytes:
        return vllm_wire_hash(block_hash) if self.int_block_hashes else block_hash
