"""A paged radix-tree prefix cache with SGLang 0.5.23 semantics and its KV events.

Model (``sglang/srt/mem_cache/radix_cache.py``, ``mem_cache/events.py``, ``mem_cache/common.py``):

* The pool holds ``num_pages`` pages of ``page_size`` tokens (SGLang's ``max_total_num_tokens / page_size``).
  Pages belong either to the tree (shared, evictable when no running request locks them) or privately to
  one running request (its uncached suffix and decode tail, plus a reservation for the rest of its output).
* Tree keys are page-aligned token runs in a namespace ``(extra_key, cache_salt)``: requests with another
  salt or LoRA adapter (whose id SGLang appends to ``extra_key``) never share a node. A match is capped at
  ``len(prompt) - 1`` tokens, page aligned, and splits a node where it ends inside one; splits emit nothing.
* What enters the tree, and when, follows the scheduler: each prefill chunk is inserted once computed
  (``checkpoint``), decode tokens only when the request finishes or is aborted (``release_kv_cache``), up to
  the last computed token. Inserting a prefix another request already inserted frees the duplicate pages
  (SGLang dedupes, unlike vLLM).
* Eviction takes least-recently-used unlocked leaves, a whole node at a time, until enough pages are free;
  a parent whose last child went becomes a leaf candidate.
* Events, as ``KVCacheEventRecorder``: one ``BlockStored`` per new node with all its page hashes and the
  parent node's last page hash, one ``BlockRemoved`` per evicted node, consecutive compatible events
  coalesced, ``AllBlocksCleared`` on construction and on every successful flush. Hashes are SGLang's
  SHA-256 page chain as signed int64 (``cortex.engine_hashes``): a salted chain starts from the salt prior,
  and LoRA namespaces are rehashed by ``namespaced_block_hash`` (in "dynamo" format every namespaced key is).

Simplifications, on purpose: no HiCache tiers, no priorities, no chunked-request bookkeeping beyond "insert
what is computed"; admission reserves the worst-case output instead of SGLang's estimated new-token ratio
and retraction, so a running request never runs out of pages.
"""

from __future__ import annotations

import heapq
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cortex.engine_hashes import (
    LoraRef,
    sglang_namespace_seed,
    sglang_namespaced_hash,
    sglang_page_hash,
    sglang_salt_prior,
    sglang_wire_hash,
)
from cortex.kv_events import MEDIUM_GPU, SglAllBlocksCleared, SglBlockRemoved, SglBlockStored
from cortex.media import MediaSpan
from cortexsim.prefix_cache import Admission, CapacityError

SglEvent = SglBlockStored | SglBlockRemoved | SglAllBlocksCleared
Namespace = tuple[str | None, str | None]


def sglang_lora_id(lora: LoraRef) -> str:
    """``LoRARef.deterministic_id``: the id SGLang gives a ``--lora-paths`` adapter (uuid5 of name and path)."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"{lora.name}\0{lora.path}").hex


def sglang_extra_key(extra_key: str | None, lora: LoraRef | None) -> str | None:
    """``Req.extra_key``: the request's own extra_key with the adapter id appended."""
    if lora is None:
        return extra_key
    return (extra_key or "") + sglang_lora_id(lora)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _common_prefix(a: list[int], b: list[int], b_off: int, limit: int) -> int:
    """Length of the common prefix of a[0:] and b[b_off:], at most `limit`; galloping slice compares."""
    n = min(len(a), len(b) - b_off, limit)
    lo, step = 0, 16
    while lo < n:
        hi = min(lo + step, n)
        if a[lo:hi] != b[b_off + lo: b_off + hi]:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if a[lo:mid] == b[b_off + lo: b_off + mid]:
                    lo = mid
                else:
                    hi = mid
            return lo
        lo = hi
        step *= 2
    return n


@dataclass(eq=False)
class _Node:
    parent: _Node | None
    ns: Namespace
    tokens: list[int]
    digests: list[bytes]
    wires: list[int]
    children: dict[Any, _Node] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0

    @property
    def pages(self) -> int:
        return len(self.digests)


@dataclass(eq=False)
class _Seq:
    request_id: str
    tokens: list[int]
    ns: Namespace
    lora_name: str | None
    prompt_len: int
    last_node: _Node
    tree_len: int
    own_pages: int
    reserved: int
    committed: int = 0
    cacheable: bool = True


class RadixCache:
    caches_on_schedule = False
    """SGLang inserts a chunk into the tree once it is computed (``checkpoint``)."""

    def __init__(self, num_pages: int, page_size: int = 1, *, enabled: bool = True, dynamo_format: bool = False,
                 medium: str = MEDIUM_GPU) -> None:
        """`enabled=False` is SGLang's ChunkCache (e.g. a decode server without
        ``--disaggregation-decode-enable-radix-cache``): pages are only allocated and freed, nothing is shared
        and no event is recorded, not even the construction-time clear."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if num_pages < 1:
            raise ValueError(f"num_pages must be at least 1, got {num_pages}")
        self.block_size = page_size
        self.num_blocks = num_pages
        self.enabled = enabled
        self.dynamo_format = dynamo_format
        self.medium = medium
        self._clock = 0
        self._seqs: dict[str, _Seq] = {}
        self._events: list[SglEvent] = []
        self._reserved_total = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self._lora_names: dict[str, str] = {}
        self._new_tree(num_pages)
        self._record(SglAllBlocksCleared())

    def _new_tree(self, free_pages: int) -> None:
        self.root = _Node(None, (None, None), [], [], [], lock_ref=1)
        self._free = free_pages
        self._evictable = 0
        self._leaves: set[_Node] = set()

    # --- read-only views -----------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks

    @property
    def max_request_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return self._free

    @property
    def num_evictable_blocks(self) -> int:
        return self._evictable

    @property
    def usage(self) -> float:
        """SGLang's ``token_usage``: share of the pool neither free nor evictable."""
        return (self.num_blocks - self._free - self._evictable) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            total += node.pages
            stack.extend(node.children.values())
        return total

    def is_running(self, request_id: str) -> bool:
        return request_id in self._seqs

    def prompt_hashes(self, token_ids: list[int], *, cache_salt: str | None = None,
                      lora: LoraRef | None = None, media: Sequence[MediaSpan] = ()) -> list[bytes]:
        # The tree hashes lazily, per new node; nothing to precompute.
        return []

    def lookup(self, num_tokens: int, token_ids: list[int], *, cache_salt: str | None = None,
               lora: LoraRef | None = None, extra_key: str | None = None) -> int:
        """Prefix-hit length in tokens (may split a node, as SGLang's match does, which changes no content)."""
        if not self.enabled:
            return 0
        matched, _ = self._match(token_ids, self._namespace(extra_key, cache_salt, lora), num_tokens - 1)
        return matched

    def prefix_match(self, token_ids: list[int], *, cache_salt: str | None = None, lora: LoraRef | None = None,
                     extra_key: str | None = None) -> int:
        """Tokens a request for `token_ids` would find cached right now (the `/sim/prefix_match` probe).

        Unlike `lookup` it neither splits a node nor refreshes access times: an observer asking must not
        change which pages are evicted next."""
        if not self.enabled:
            return 0
        ns, ps = self._namespace(extra_key, cache_salt, lora), self.block_size
        limit = max(len(token_ids) - 1, 0) // ps * ps
        node, pos = self.root, 0
        while pos < limit:
            child = node.children.get(self._child_key(ns, token_ids, pos))
            if child is None:
                break
            common = _common_prefix(child.tokens, token_ids, pos, limit - pos) // ps * ps
            pos += common
            if common < len(child.tokens):
                break
            node = child
        return pos

    def check_fits(self, num_prompt_tokens: int, max_new_tokens: int = 1) -> None:
        if num_prompt_tokens <= 0:
            raise CapacityError("the prompt must contain at least one token")
        if max_new_tokens < 1:
            raise CapacityError("max_new_tokens must be at least 1")
        needed = self._total_pages(num_prompt_tokens, max_new_tokens)
        if needed > self.num_blocks:
            raise CapacityError(
                f"request needs {needed} KV pages ({num_prompt_tokens} prompt + {max_new_tokens} new tokens, "
                f"page size {self.block_size}) but the pool holds only {self.num_blocks}")

    # --- request lifecycle ---------------------------------------------------------------------

    def admit(self, request_id: str, token_ids: list[int], *, max_new_tokens: int = 1,
              block_hashes: list[bytes] | None = None, cache_salt: str | None = None,
              lora: LoraRef | None = None, extra_key: str | None = None,
              report_hits: bool = False, media: Sequence[MediaSpan] = ()) -> Admission | None:
        # report_hits is vLLM's kv_cache_report_mode; SGLang has no such mode. Media is never admitted here (the
        # SGLang flavour refuses media parts).
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} is already admitted")
        num_tokens = len(token_ids)
        self.check_fits(num_tokens, max_new_tokens)
        ns = self._namespace(extra_key, cache_salt, lora)
        if lora is not None and ns[0] is not None:
            self._lora_names[ns[0]] = lora.name
        if self.enabled:
            matched, last = self._match(token_ids, ns, num_tokens - 1)
        else:
            matched, last = 0, self.root
        ps = self.block_size
        prompt_pages = _cdiv(num_tokens, ps)
        own_now = prompt_pages - matched // ps
        reserve = self._total_pages(num_tokens, max_new_tokens) - prompt_pages
        unlocked_on_path = 0
        node: _Node | None = last
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                unlocked_on_path += node.pages
            node = node.parent
        if own_now + reserve > self._free + self._evictable - unlocked_on_path - self._reserved_total:
            return None
        self._lock(last)
        self._take(own_now)
        self._seqs[request_id] = _Seq(request_id, list(token_ids), ns, lora.name if lora else None, num_tokens,
                                      last, matched, own_now, reserve, committed=matched)
        self._reserved_total += reserve
        self.query_tokens += num_tokens
        self.hit_tokens += matched
        return Admission(num_cached_tokens=matched, num_hit_blocks=matched // ps)

    def extend(self, request_id: str, new_token_ids: list[int]) -> None:
        seq = self._seqs[request_id]
        seq.tokens.extend(new_token_ids)
        need = _cdiv(len(seq.tokens), self.block_size) - seq.tree_len // self.block_size - seq.own_pages
        for _ in range(need):
            if seq.reserved > 0:
                seq.reserved -= 1
                self._reserved_total -= 1
            elif self._free + self._evictable - self._reserved_total <= 0:
                raise CapacityError(f"request {request_id!r} outgrew its reservation and no page is free")
            self._take(1)
            seq.own_pages += 1

    def commit(self, request_id: str, num_computed_tokens: int) -> None:
        """KV now exists for the first `num_computed_tokens`: prefill chunks enter the tree at once, decode
        tokens only at release."""
        seq = self._seqs[request_id]
        if num_computed_tokens > len(seq.tokens):
            raise ValueError(f"request {request_id!r} has only {len(seq.tokens)} tokens, "
                             f"cannot commit {num_computed_tokens}")
        seq.committed = max(seq.committed, num_computed_tokens)
        if num_computed_tokens <= seq.prompt_len:
            self._checkpoint(seq, num_computed_tokens)

    def free(self, request_id: str) -> None:
        """Release a finished or aborted request: insert what it computed, then give back its own pages."""
        seq = self._seqs.pop(request_id)
        self._checkpoint(seq, seq.committed)
        self._free += seq.own_pages
        self._reserved_total -= seq.reserved
        if seq.cacheable:
            self._unlock(seq.last_node)

    def block_ids(self, request_id: str) -> list[int]:
        return []

    def reset(self) -> bool:
        """``flush_cache``: refuse unless idle, else drop the tree and publish AllBlocksCleared."""
        if self._seqs:
            return False
        self._new_tree(self.num_blocks)
        self._record(SglAllBlocksCleared())
        return True

    def forget_all(self) -> None:
        """A restarted engine starts cold: drop the tree and pending events; what remains queued is the
        ``AllBlocksCleared`` a new SGLang cache records at construction (the first batch after a restart).

        Requests still running keep their pages as private ones and stop inserting (their chain is gone)."""
        own = 0
        for seq in self._seqs.values():
            seq.own_pages += seq.tree_len // self.block_size
            seq.tree_len = 0
            seq.cacheable = False
            seq.last_node = self.root
            own += seq.own_pages
        self._new_tree(self.num_blocks - own)
        self._events.clear()
        self._record(SglAllBlocksCleared())

    def take_events(self) -> list[SglEvent]:
        events, self._events = self._events, []
        return events

    # --- internals -----------------------------------------------------------------------------

    def _namespace(self, extra_key: str | None, cache_salt: str | None, lora: LoraRef | None) -> Namespace:
        return sglang_extra_key(extra_key, lora), cache_salt or None

    def _total_pages(self, num_prompt_tokens: int, max_new_tokens: int) -> int:
        # The last sampled token is returned but never fed back, so it needs no KV slot.
        return _cdiv(num_prompt_tokens + max(max_new_tokens, 1) - 1, self.block_size)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _child_key(self, ns: Namespace, tokens: list[int], pos: int) -> Any:
        ps = self.block_size
        page = tokens[pos] if ps == 1 else tuple(tokens[pos:pos + ps])
        return (ns, page)

    def _match(self, tokens: list[int], ns: Namespace, max_len: int) -> tuple[int, _Node]:
        ps = self.block_size
        limit = max(min(max_len, len(tokens)), 0) // ps * ps
        node, pos, now = self.root, 0, self._tick()
        while pos < limit:
            child = node.children.get(self._child_key(ns, tokens, pos))
            if child is None:
                break
            child.last_access = now
            common = _common_prefix(child.tokens, tokens, pos, limit - pos) // ps * ps
            if common < len(child.tokens):
                if common > 0:
                    node = self._split(child, common)
                    pos += common
                break
            node, pos = child, pos + common
        return pos, node

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut `child` after `at` tokens; the new upper node keeps the lock and the hashes already published."""
        pages = at // self.block_size
        assert child.parent is not None
        upper = _Node(child.parent, child.ns, child.tokens[:at], child.digests[:pages], child.wires[:pages],
                      lock_ref=child.lock_ref, last_access=child.last_access)
        child.parent.children[self._child_key(child.ns, child.tokens, 0)] = upper
        child.tokens, child.digests, child.wires = child.tokens[at:], child.digests[pages:], child.wires[pages:]
        child.parent = upper
        upper.children[self._child_key(child.ns, child.tokens, 0)] = child
        return upper

    def _insert(self, tokens: list[int], ns: Namespace) -> tuple[int, _Node]:
        """Insert the page-aligned `tokens`; returns (length that was already cached, node of the last page)."""
        matched, node = self._match(tokens, ns, len(tokens) + 1)
        if matched < len(tokens):
            rest = tokens[matched:]
            prior = node.digests[-1] if node.digests else (sglang_salt_prior(ns[1]) if ns[1] else None)
            digests: list[bytes] = []
            ps = self.block_size
            for start in range(0, len(rest), ps):
                prior = sglang_page_hash(prior, rest[start:start + ps])
                digests.append(prior)
            seed = self._seed(ns)
            wires = [self._wire(d, seed) for d in digests]
            new = _Node(node, ns, rest, digests, wires, last_access=self._tick())
            node.children[self._child_key(ns, rest, 0)] = new
            self._leaves.discard(node)
            self._evictable += new.pages
            self._leaves.add(new)
            self._record(SglBlockStored(
                block_hashes=list(wires), parent_block_hash=node.wires[-1] if node.wires else None,
                token_ids=list(rest), block_size=ps, lora_id=None, medium=self.medium,
                cache_salt=ns[1], lora_name=self._lora_name(ns)))
            node = new
        return matched, node

    def _checkpoint(self, seq: _Seq, up_to: int) -> None:
        if not (self.enabled and seq.cacheable):
            return
        key_len = min(up_to, len(seq.tokens)) // self.block_size * self.block_size
        if key_len <= seq.tree_len:
            return
        existing, node = self._insert(seq.tokens[:key_len], seq.ns)
        ps = self.block_size
        duplicates = max(existing - seq.tree_len, 0) // ps
        # Duplicates go back to the pool; the rest of the inserted pages now belong to the new node.
        self._free += duplicates
        seq.own_pages -= (key_len - seq.tree_len) // ps
        self._lock(node)
        self._unlock(seq.last_node)
        seq.last_node, seq.tree_len = node, key_len

    def _lock(self, node: _Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= node.pages
                self._leaves.discard(node)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def _unlock(self, node: _Node) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += node.pages
                if not node.children:
                    self._leaves.add(node)
            assert node.parent is not None
            node = node.parent

    def _take(self, pages: int) -> None:
        if pages > self._free:
            self._evict(pages - self._free)
        if pages > self._free:
            raise CapacityError(f"no room for {pages} pages although admission promised it")
        self._free -= pages

    def _evict(self, pages: int) -> None:
        heap = [(n.last_access, id(n), n) for n in self._leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < pages and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[self._child_key(node.ns, node.tokens, 0)]
            self._leaves.discard(node)
            self._evictable -= node.pages
            self._free += node.pages
            freed += node.pages
            self._record(SglBlockRemoved(block_hashes=list(node.wires), medium=self.medium))
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self._leaves.add(parent)
                heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def _seed(self, ns: Namespace) -> bytes | None:
        extra_key, salt = ns
        if self.dynamo_format:
            return sglang_namespace_seed(extra_key, salt) if (extra_key is not None or salt is not None) else None
        # Default format: only a LoRA namespace is rehashed; a salt already seeds the chain itself.
        if extra_key is not None and extra_key in self._lora_names:
            return sglang_namespace_seed(extra_key, None)
        return None

    @staticmethod
    def _wire(digest: bytes, seed: bytes | None) -> int:
        wire = sglang_wire_hash(digest)
        return sglang_namespaced_hash(wire, seed) if seed is not None else wire

    def _lora_name(self, ns: Namespace) -> str | None:
        return self._lora_names.get(ns[0]) if ns[0] is not None else None

    def _record(self, event: SglEvent) -> None:
        """``KVCacheEventRecorder.enqueue``: coalesce with a compatible tail."""
        if not self.enabled:
            return
        if self._events:
            tail = self._events[-1]
            if isinstance(tail, SglBlockRemoved) and isinstance(event, SglBlockRemoved):
                if tail.medium == event.medium:
                    tail.block_hashes.extend(event.block_hashes)
                    return
            elif (isinstance(tail, SglBlockStored) and isinstance(event, SglBlockStored)
                  and tail.medium == event.medium and tail.lora_id == event.lora_id
                  and tail.block_size == event.block_size and tail.cache_salt == event.cache_salt
                  and tail.session_id == event.session_id and tail.lora_name == event.lora_name
                  and tail.block_hashes and event.parent_block_hash == tail.block_hashes[-1]):
                tail.block_hashes.extend(event.block_hashes)
                tail.token_ids.extend(event.token_ids)
                return
        self._events.append(event)
