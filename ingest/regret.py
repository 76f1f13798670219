"""Evictions the fleet regrets: blocks an engine evicted that an engine had to compute again soon after.

A request that lands on a worker whose pool is full evicts that many tokens of the least recently used blocks
there. Whether that costs anything depends on what those blocks were: junk nobody asks for again, or the history
of a conversation whose next turn will have to prefill it again. The ledger sees both halves: the BlockRemoved
that evicted a key, and, if the key is needed again, a BlockStored of the same key on some worker (the engine
computed it again: a worker that still held it would not store it). So ingest counts, per worker, the tokens it
evicted that were stored again within `WINDOW_S`, and publishes their rate beside the eviction rate: their ratio
is the share of what that worker evicts that comes back, the price per token of evicting there
(extproc/policies/ttft.py: the score's eviction term).

`Regret` sits in front of the view's writer as the ledger's key sink: it forwards every change and watches the
net removals and additions of each batch. A slot's key set shown again whole (a stream back in sync: a clear
followed by the whole set) is no store and is not counted.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from ingest.ledger_publish import KeySink

WINDOW_S = 300.0
"""A key stored again later than this after its eviction is not counted: the next turn of a conversation or an
agent's next step comes within minutes; later reuse is a new visit."""
MAX_KEYS = 500_000
"""Evicted keys remembered at once (~60 MB at most); the oldest go first."""


class Regret:
    """The ledger's key sink in front of `sink`, counting per slot the evicted tokens stored again."""

    def __init__(self, sink: KeySink, block_size: int, *, window_s: float = WINDOW_S, max_keys: int = MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sink = sink
        self.block_size = block_size
        self.window_s = window_s
        self.max_keys = max_keys
        self.clock = clock
        self.tokens: dict[int, float] = {}
        """Per slot: tokens it evicted that were stored again within the window, since ingest started."""
        self._evicted: OrderedDict[int, tuple[int, float]] = OrderedDict()
        self._shown_whole: int | None = None

    def regretted(self, slot: int) -> float:
        return self.tokens.get(slot, 0.0)

    def remove(self, worker: int, keys: list[int]) -> None:
        self.sink.remove(worker, keys)
        self._shown_whole = None
        now, evicted = self.clock(), self._evicted
        for key in keys:
            evicted[key] = (worker, now)
            evicted.move_to_end(key)
        self._trim(now)

    def add(self, worker: int, keys: list[int]) -> None:
        self.sink.add(worker, keys)
        if self._shown_whole == worker:  # the slot's whole set shown again after a clear: no store
            self._shown_whole = None
            return
        self._shown_whole = None
        now, evicted, window, bs = self.clock(), self._evicted, self.window_s, self.block_size
        for key in keys:
            seen = evicted.pop(key, None)
            if seen is not None and now - seen[1] <= window:
                self.tokens[seen[0]] = self.tokens.get(seen[0], 0.0) + bs

    def clear_worker(self, worker: int) -> None:
        self.sink.clear_worker(worker)
        self._shown_whole = worker

    def forget(self, slots: Iterable[int]) -> None:
        """Slots given to new targets start from zero."""
        for slot in slots:
            self.tokens.pop(slot, None)

    def _trim(self, now: float) -> None:
        evicted = self._evicted
        while evicted and (len(evicted) > self.max_keys or now - next(iter(evicted.values()))[1] > self.window_s):
            evicted.popitem(last=False)
