"""Early stop: tokenize, hash and look up a prompt only as far as some worker could hold it.

Block keys are chained, so once no worker holds block i in the ledger view, and no prediction of this process
says one is about to, no worker can hold any later block either: every worker's matched prefix is known
without the rest of the prompt. `walk()` interleaves tokenize -> hash -> lookup in prompt order, piece by
piece, and stops there. Its result equals what hashing and matching the whole prompt gives (the tests compare
both on random ledgers).

The rest of the prompt still matters for one thing: the chosen worker's predicted blocks, which keep a burst
of new siblings on one worker. `DeferredTail` finishes it after the answer went to Envoy -- the remaining
pieces are encoded on a thread (tiktoken and the library both release the GIL), the event loop hashes them and
records the predictions -- with a bound on what may wait, and only when a prediction can use it (predictions
on, the chosen worker's ledger trusted): otherwise the rest of the prompt is never tokenized. A sibling that
arrives first and reaches the block where an unfinished request stopped finishes that request's tail itself
before deciding, so it sees the predictions the whole computation would have recorded; unrelated requests never
pay for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from prometheus_client import Counter

from cortex.blockkeys import chain_keys
from cortex.chain_cache import ChainRun, ChainState, keys_array
from cortex.observation import FIRST_IDS_LOGGED as HEAD_IDS
from cortex.piecewise.piece_cache import SegmentMismatch
from cortex.piecewise.token_cursor import TokenCursor
from extproc.predictions import Predictions

log = logging.getLogger("cortex.extproc")

PROBE_BLOCKS = 8
"""Blocks hashed and looked up first from a long chunk: most all-new prompts miss on the first block, and
whole-text chunks would otherwise be hashed to the end for nothing."""
MAX_CATCH_UP = 2
"""Unfinished siblings a request may finish itself before deciding: bounds the hot-path cost of a burst."""

TAIL_JOBS = Counter("cortex_deferred_tail_jobs",
                    "prompt tails finished after the routing answer, by outcome (done: in the background; "
                    "caught_up: by a sibling that needed its predictions; dropped: over the queue bound; "
                    "failed: raised, logged; skipped: not tokenized, predictions are off)", ["outcome"])


class Timed(Protocol):
    tokenize_s: float
    hash_s: float
    lookup_s: float


@dataclass(slots=True)
class Tail:
    """What is left of a prompt where the walk stopped, to be turned into the chosen worker's predictions."""

    cursor: TokenCursor
    carry: np.ndarray
    """Ids returned by the cursor but not hashed yet; they start at a block boundary."""
    seen: int
    """Ids returned by the cursor so far."""
    parent: int
    """Key of the last hashed block: the rest chains from it."""
    n_keys: int
    holdback: int
    block_size: int
    root: int
    whole: Callable[[], list[int]]
    """The whole-text ids of the same text, for a piece that turns out not to encode segment-wise."""
    slot: int = -1
    done: bool = False
    cost: int = 0
    """Its share of DeferredTail's bound, fixed when submitted."""
    chain: ChainRun | None = None
    """Where the deepest boundary's key chain is cached once the rest is hashed (cortex/chain_cache.py)."""
    prior: list[int] = field(default_factory=list)
    """The keys the walk hashed (n_keys of them)."""
    prior_array: np.ndarray | None = None
    """Their leading part as an array, when the walk started from a cached chain."""
    head: list[int] = field(default_factory=list)

    @property
    def frontier(self) -> int:
        return self.parent

    def size(self) -> int:
        return self.cursor.backlog + int(self.carry.size)

    def keys(self, encoded: dict[Any, list[int]] | None = None) -> list[int]:
        """Keys of the blocks after the ones the walk hashed (all of them, from the root, after a mismatch)."""
        bs = self.block_size
        try:
            rest = self.cursor.rest(encoded)
        except SegmentMismatch:
            ids = self.whole()
            return chain_keys(ids, bs, self.root, max_blocks=max(0, (len(ids) - self.holdback) // bs))
        n = max(0, (self.seen + len(rest) - self.holdback) // bs) - self.n_keys
        if n <= 0:
            return []
        tokens = np.concatenate((self.carry, np.asarray(rest, dtype=np.uint32)))
        keys = chain_keys(tokens, bs, self.parent, max_blocks=n)
        mark = self.cursor.mark
        if self.chain is not None and mark is not None and mark[1] > self.seen and self.chain.wants(mark[0]):
            self._save(mark, tokens, keys)
        return keys

    def _save(self, mark: tuple[int, int, int], tokens: np.ndarray, keys: list[int]) -> None:
        """Cache the chain at the prompt's deepest boundary (`tokens` start at block n_keys; `keys` follow)."""
        assert self.chain is not None
        part, upto, chars = mark
        bs = self.block_size
        n = max(0, (upto - self.holdback) // bs)
        if n < self.n_keys or n > self.n_keys + len(keys):
            return
        base = self.n_keys * bs
        head = self.head
        if len(head) < HEAD_IDS:
            head = head + tokens[len(head) - base: HEAD_IDS - base].tolist()
        chained = self.prior[:self.n_keys] + keys[:n - self.n_keys]
        self.chain.save(ChainState(part, chars, upto, chained, keys_array(self.prior_array, chained, n),
                                   tokens[n * bs - base: upto - base].copy(), tuple(head[:upto])))


@dataclass(slots=True)
class WalkResult:
    keys: list[int]
    matches: np.ndarray | None
    """Leading blocks held per slot (as ClusterView.match), None when there was nothing to look up or the
    view could not be read."""
    prompt_tokens: int
    estimated: bool
    """prompt_tokens is estimated from the characters not tokenized (the walk stopped early)."""
    tail: Tail | None = None
    """Set when the walk stopped before the end of a routable prompt."""
    reach: dict[int, int] = field(default_factory=dict)
    """Per trusted slot, its confirmed-then-predicted run (Predictions.extend from its match)."""
    head: list[int] = field(default_factory=list)
    """The prompt's first HEAD_IDS token ids (fewer when it is shorter): the request log's."""
    array: np.ndarray | None = None
    """`keys` as uint64, when the walk started from a cached chain (most of them were an array already)."""


def walk(cursor: TokenCursor, *, block_size: int, root: int, holdback: int,
         lookup: Callable[[Any], np.ndarray | None], predictions: Predictions, watched: Sequence[int],
         trusted: Collection[int], timings: Timed,
         catch_up: Callable[[list[int], dict[int, int]], bool] | None = None,
         whole: Callable[[], list[int]] | None = None, chain: ChainRun | None = None) -> WalkResult:
    """Keys and per-slot matches of the prompt's leading blocks, computed only up to the first block that no
    watched slot holds (confirmed, or predicted for a trusted slot); other slots' matches may stop short.
    Blocks count up to (tokens - holdback) // size: holdback is 1 because an engine always computes the
    last prompt token, more when the prompt was cut. `chain`: the prompt's boundaries against the key chain
    cache (cortex/chain_cache.py): the walk starts at the deepest one cached, and caches the deepest it passes.

    Raises SegmentMismatch (from the cursor) when the text must be encoded whole: start over then.
    """
    bs = block_size
    keys: list[int] = []
    counts: np.ndarray | None = None
    reach = dict.fromkeys(trusted, 0)
    watch = np.asarray(watched, dtype=np.intp)
    carry = np.empty(0, dtype=np.uint32)
    seen = 0
    parent = root
    perf = time.perf_counter
    catch_ups = 0
    head: list[int] = []
    prior: np.ndarray | None = None
    pending: tuple[int, int, int, int, np.ndarray] | None = None
    """The deepest boundary passed, to cache once its blocks are hashed: (part, tokens, chars, blocks, carry)."""

    def check(new: list[int] | np.ndarray, start: int) -> WalkResult | None:
        """Look up keys[start:] (`new`); a result when no watched slot can hold more, None to walk on."""
        nonlocal counts, catch_ups
        t3 = perf()
        held = lookup(new)
        timings.lookup_s += perf() - t3
        if held is None:  # the view cannot be read now: the decision will not use it at all
            return WalkResult(keys, None, _estimate(seen, cursor), not cursor.done, head=head)
        counts = _advance(counts, held, start)
        alive = bool((counts[watch] == len(keys)).any())
        for s, r in reach.items():
            if r == start:
                c = int(counts[s])
                reach[s] = r = c if c == len(keys) else predictions.extend(keys, s, max(c, start))
            alive = alive or r == len(keys)
        if not alive and catch_up is not None and catch_ups < MAX_CATCH_UP and catch_up(keys, reach):
            # A sibling's tail was finished just now: its predictions may carry runs further.
            catch_ups += 1
            for s, r in reach.items():
                reach[s] = r = predictions.extend(keys, s, r)
                alive = alive or r == len(keys)
        if alive:
            return None
        save()
        tail = Tail(cursor, carry, seen, parent, len(keys), holdback, bs, root, whole or _no_whole,
                    chain=chain, prior=keys, prior_array=prior, head=head)
        return WalkResult(keys, counts, _estimate(seen, cursor), not cursor.done, tail, reach, head,
                          as_array())

    def as_array() -> np.ndarray | None:
        return keys_array(prior, keys, len(keys)) if prior is not None else None

    def save() -> None:
        if chain is None or pending is None or pending[3] > len(keys):
            return
        part, tokens, chars, n, ids = pending
        t = perf()
        chain.save(ChainState(part, chars, tokens, keys[:n], keys_array(prior, keys, n), ids,
                              tuple(head[:tokens])))
        timings.hash_s += perf() - t

    if chain is not None:
        t0 = perf()
        state = chain.restore()
        if state is not None:
            cursor.skip(state.part, state.chars, state.tokens)
            keys = list(state.keys)
            prior = state.array
            carry = state.carry
            seen = state.tokens
            parent = keys[-1] if keys else root
            head = list(state.head)
            timings.hash_s += perf() - t0
            if keys:
                found = check(state.array, 0)
                if found is not None:
                    return found
        else:
            timings.hash_s += perf() - t0
    while True:
        t0 = perf()
        chunk = cursor.next()
        t1 = perf()
        timings.tokenize_s += t1 - t0
        if chunk is None:
            break
        if len(head) < HEAD_IDS:
            head += chunk[:HEAD_IDS - len(head)]
        before = seen
        seen += len(chunk)
        ids = np.asarray(chunk, dtype=np.uint32)
        carry = np.concatenate((carry, ids)) if carry.size else ids
        mark = cursor.mark
        if chain is not None and mark is not None and before < mark[1] and chain.wants(mark[0]):
            # carry starts at block len(keys): the ids after the mark's last full block are cut out now.
            n = max(0, (mark[1] - holdback) // bs)
            lo = n * bs - len(keys) * bs
            pending = (mark[0], mark[1], mark[2], n, carry[lo: mark[1] - len(keys) * bs].copy())
        timings.hash_s += perf() - t1
        while (avail := max(0, (seen - holdback) // bs) - len(keys)) > 0:
            n = min(avail, PROBE_BLOCKS) if not keys else avail
            t2 = perf()
            new = chain_keys(carry[: n * bs], bs, parent)
            carry = carry[n * bs:]
            parent = new[-1]
            start = len(keys)
            keys += new
            timings.hash_s += perf() - t2
            found = check(new, start)
            if found is not None:
                return found
    save()
    return WalkResult(keys, counts if keys else None, seen, False, None, reach, head, as_array())


def _advance(counts: np.ndarray | None, held: np.ndarray, start: int) -> np.ndarray:
    """Extend the per-slot leading runs that reached `start` by the run each slot holds in the new keys."""
    if counts is None:
        return held.astype(np.int64)
    live = counts == start
    counts[live] += held[live]
    return counts


def _estimate(seen: int, cursor: TokenCursor) -> int:
    """Tokens of the whole prompt: the ones produced, plus the untokenized text at the estimated ratio."""
    left = cursor.remaining_chars
    if left <= 0:
        return seen
    return seen + round(left * cursor.tokens_per_char())


def _no_whole() -> list[int]:
    raise RuntimeError("no whole-text encoding given for this prompt")


class DeferredTail:
    """Tails waiting to become predictions, finished in arrival order off the request path, bounded.

    Jobs run on the event loop that submitted them (a task started on demand); without a running loop they
    wait for `run_pending()` (tests, benchmarks). Over `max_jobs` or `max_chars` of waiting text the oldest
    are dropped and counted: their predictions are lost, which can only scatter a burst, never misroute.
    """

    def __init__(self, predictions: Predictions, *, max_jobs: int = 256, max_chars: int = 8 << 20) -> None:
        self.predictions = predictions
        self.max_jobs = max_jobs
        self.max_chars = max_chars
        self._jobs: OrderedDict[int, Tail] = OrderedDict()
        self._by_frontier: dict[int, Tail] = {}
        self._chars = 0
        self._task: asyncio.Task[None] | None = None
        self._pool: ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        return len(self._jobs)

    def submit(self, tail: Tail) -> None:
        if self.predictions.ttl_s <= 0:
            # Predictions are off (extproc.prediction_ttl_s: 0): the tail's only use is gone, so its text is
            # never tokenized. (A chosen worker whose ledger is not trusted gets no tail: plan.choose.)
            tail.done = True
            TAIL_JOBS.labels("skipped").inc()
            return
        tail.cost = tail.size()
        self._jobs[id(tail)] = tail
        self._by_frontier[tail.frontier] = tail
        self._chars += tail.cost
        while self._jobs and (len(self._jobs) > self.max_jobs or self._chars > self.max_chars):
            self._forget(next(iter(self._jobs.values())))
            TAIL_JOBS.labels("dropped").inc()
        self._kick()

    def catch_up(self, keys: list[int], reach: dict[int, int]) -> bool:
        """Finish the unfinished tails whose stopping block ends one of these runs; True if any was."""
        ran = False
        for r in set(reach.values()):
            tail = self._by_frontier.get(keys[r - 1]) if r > 0 else None
            if tail is not None and not tail.done:
                ran = self._finish(tail, None, "caught_up") or ran
        return ran

    def run_pending(self) -> int:
        """Finish every waiting tail now, on this thread; returns how many were finished."""
        n = 0
        while self._jobs:
            n += self._finish(next(iter(self._jobs.values())), None, "done")
        return n

    def _forget(self, tail: Tail) -> None:
        if self._jobs.pop(id(tail), None) is not None:
            self._chars -= tail.cost
        if self._by_frontier.get(tail.frontier) is tail:
            del self._by_frontier[tail.frontier]
        tail.done = True

    def _finish(self, tail: Tail, encoded: dict[Any, list[int]] | None, outcome: str) -> bool:
        self._forget(tail)
        try:
            keys = tail.keys(encoded)
            self.predictions.record(tail.slot, keys)
        except Exception:
            log.exception("finishing a prompt's tail after routing failed; its predictions are lost")
            TAIL_JOBS.labels("failed").inc()
            return False
        TAIL_JOBS.labels(outcome).inc()
        return True

    def _kick(self) -> None:
        if self._task is not None and not self._task.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._task = loop.create_task(self._drain())

    async def _drain(self) -> None:
        # Created while the routing answer is being produced; the first await lets it go out first.
        loop = asyncio.get_running_loop()
        await asyncio.sleep(0)
        while self._jobs:
            tail = next(iter(self._jobs.values()))
            encoded: dict[Any, list[int]] | None = None
            try:
                missing = tail.cursor.missing()
                if missing:
                    if self._pool is None:
                        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cortex-tail")
                    ids = await loop.run_in_executor(self._pool, tail.cursor.raw_encode, [t for _, t in missing])
                    encoded = {k: v for (k, _), v in zip(missing, ids, strict=True)}
            except Exception:
                log.exception("tokenizing a prompt's tail after routing failed; its predictions are lost")
                TAIL_JOBS.labels("failed").inc()
                self._forget(tail)
                continue
            if not tail.done:  # finished by a sibling, or dropped, while the library worked
                self._finish(tail, encoded, "done")
            await asyncio.sleep(0)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
