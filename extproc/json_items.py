"""Decoding a request body whose conversation repeats from one request to the next.

An agent's next turn re-sends every earlier message byte for byte: at 128K tokens of text that is 0.4-0.8 MB of
JSON, and decoding it all again (orjson: 0.75 ms when about one word in five has a non-ASCII letter, whose Python
strings are wider) was the largest stage of a seen turn's decision (docs/performance.md, "Long contexts").
`load` splits a body with non-ASCII text into its top-level values without decoding them (msgspec's `Raw`), and the
conversation's array into its elements; an element seen before, byte for byte, is taken from a bounded LRU keyed
by the XXH3-128 digest of its bytes; everything else is decoded by orjson exactly as before.

Strictness is orjson's: every value is decoded by it (a cached element was, when first seen, from the same bytes),
and a body the split refuses is handed to orjson whole, which decides and words the error. The cached elements are
shared by every request that repeats them: nothing downstream may mutate a decoded body (tests/test_json_items.py
holds that for every inference path).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec
import orjson
import xxhash

MIN_BYTES = 512
"""Elements shorter than this are decoded every time: a dictionary entry costs more than decoding them."""

_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])


class ItemCache:
    """Decoded conversation elements by the digest of their bytes, least recently used first out; bounded by the
    bytes they were decoded from (their decoded size is 1-4 times that: Python strings of wide characters)."""

    def __init__(self, max_bytes: int = 32 << 20, max_entries: int = 65_536) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._items: OrderedDict[int, tuple[Any, int]] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def decode(self, raw: msgspec.Raw) -> Any:
        view = memoryview(raw)
        size = len(view)
        if size < MIN_BYTES:
            return orjson.loads(view)
        key = xxhash.xxh3_128_intdigest(view)
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
            self.hits += 1
            return found[0]
        self.misses += 1
        value = orjson.loads(view)
        if size <= self.max_bytes:
            self._items[key] = (value, size)
            self.bytes += size
            while self.bytes > self.max_bytes or len(self._items) > self.max_entries:
                _, (_, dropped) = self._items.popitem(last=False)
                self.bytes -= dropped
        return value

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0


ITEMS = ItemCache()
"""The process's cache (extproc serves one stream at a time per event loop; the parse is synchronous)."""


def load(raw: bytes, items: str, cache: ItemCache = ITEMS) -> Any:
    """The body decoded as `orjson.loads(raw)` would, its `items` array's long elements through `cache`. Raises
    orjson's JSONDecodeError for what orjson refuses."""
    if raw.isascii():
        # ASCII text decodes as fast as the split can find the elements' ends (orjson: 0.17 ms for 0.5 MB, the
        # split's two passes 0.25): the cache cannot win. Wide characters are what make decoding slow.
        return orjson.loads(raw)
    try:
        top = _TOP.decode(raw)
        out: dict[str, Any] = {}
        for name, value in top.items():
            if name == items:
                try:
                    elements = _ITEMS.decode(value)
                except msgspec.DecodeError:  # not an array: as it is, for the parser to refuse or take
                    out[name] = orjson.loads(memoryview(value))
                    continue
                out[name] = [cache.decode(e) for e in elements]
            else:
                out[name] = orjson.loads(memoryview(value))
        return out
    except (msgspec.DecodeError, orjson.JSONDecodeError):
        # Not a JSON object, or malformed somewhere: orjson decides on the whole body, and words the error with
        # its position in the body.
        return orjson.loads(raw)
