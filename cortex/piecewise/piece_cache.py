"""A tokenizer's text cut into pieces at its boundary tokens, and the pieces' ids in a bounded LRU cache.

PieceCache is everything the per-request path reads (cortex/piecewise/token_cursor.py walks it): the cut, the
cache, the library (or proven faster BPE) that encodes a piece not cached, and the rule for encoding only a long
piece's beginning. It holds no proof: SegmentEncoder (cortex/piecewise/segment_encoder.py) sets the cut and the
shortcuts only once its load-time self-check showed they give the library's own ids; until then the text is
one piece. Why cutting is exact: cortex/piecewise/__init__.py.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from cortex.chain_cache import ChainCache
from cortex.fast_bpe import FastBPE

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# Approximate CPython cost of one cached entry: the list (8 bytes a slot) and its int objects (ids above
# 256 are distinct objects, 28-32 bytes), the key string, and the dictionary slots.
_BYTES_PER_ID = 40
_BYTES_PER_ENTRY = 200
PREFIX_MIN_CHARS = 2048
"""An uncached piece at least this long is first encoded only in part (see PieceCache._safe_prefix)."""
PREFIX_CHARS = 256
"""Characters encoded first from such a piece: 60-90 tokens of prose, a few blocks, enough to find a miss."""
_PREFIX_MARGIN = 16


class SegmentMismatch(Exception):
    """An anchored piece did not start with its anchor, or a long piece's beginning encoded alone disagreed with
    the whole piece: this request is encoded whole-text (what a TokenCursor's caller catches to start over)."""


@dataclass(frozen=True, slots=True)
class SegmentStats:
    hits: int
    misses: int
    hit_chars: int
    miss_chars: int
    entries: int
    bytes: int
    evictions: int
    uncached: int
    """Pieces too large to cache (over an eighth of the byte budget)."""


class PieceCache:
    """The pieces of a text and their ids: hits looked up, misses encoded in one batch, counted and cached.

    The cut (`_rx`, `_boundary`, `_merge`, `_anchor`), the faster encoder (`_fast`) and the long-piece rule
    (`_prefix_ok`, `_added_rx`) start off; SegmentEncoder turns on what its self-check proved.
    """

    def __init__(self, tokenizer: Tokenizer, *, max_entries: int, max_bytes: int) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("max_entries and max_bytes must be positive")
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._max_entry_bytes = max_bytes // 8
        self._cache: OrderedDict[Any, list[int]] = OrderedDict()
        self._bytes = 0
        self.chains = ChainCache()
        """Prompt prefixes' key chains at boundary tokens (cortex/chain_cache.py): ids depend on this tokenizer."""
        # A number per cached piece, never reused: equal numbers mean equal text (the dictionary compared it).
        self._serials: dict[Any, int] = {}
        self._serial = 0
        self.hits = self.misses = self.hit_chars = self.miss_chars = self.evictions = self.uncached = 0
        self.miss_tokens = 0
        self._batch = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch
        # Who encodes the pieces: the library, or a faster BPE proven at load to give the same ids (fast_bpe).
        self._fast: FastBPE | None = None
        self._anchor: tuple[str, int] | None = None
        self._rx: re.Pattern[str] | None = None
        self._boundary: dict[str, list[int]] = {}
        self._merge = False
        # Encoding a long piece's beginning alone (routing stops at the first block no worker holds).
        self.prefix_min_chars = PREFIX_MIN_CHARS
        self.prefix_chars = PREFIX_CHARS
        self.prefix_reason = "segmenting is off"
        self._prefix_ok = False
        self._added_rx: re.Pattern[str] | None = None
        self._added_len = 0

    def pieces(self, text: str) -> list[str]:
        """The text cut as the encoder cuts it: text pieces at even indices, boundary tokens at odd ones."""
        return self._split(text)

    def _split(self, text: str) -> list[str]:
        if self._rx is None:
            return [text]
        parts: list[str] = self._rx.split(text)
        if not self._merge or len(parts) == 1:
            return parts
        # Tokens that reach into their neighbours (or are not split at all) stay inside their piece.
        boundary = self._boundary
        merged = [parts[0]]
        for j in range(1, len(parts), 2):
            if parts[j] in boundary:
                merged += (parts[j], parts[j + 1])
            else:
                merged[-1] = merged[-1] + parts[j] + parts[j + 1]
        return merged

    def _encode(self, text: str) -> list[int]:
        parts = self._split(text)
        cache = self._cache
        boundary = self._boundary
        anchored = self._anchor is not None
        chunks: list[list[int]] = []
        todo: dict[Any, list[int]] = {}
        for i, part in enumerate(parts):
            if i & 1:
                chunks.append(boundary[part])
                continue
            if not part:
                continue
            # Anchored: the first piece (offset 0) encodes differently from the same text later on.
            key: Any = (part,) if anchored and i == 0 else part
            ids = cache.get(key)
            if ids is None:
                todo.setdefault(key, []).append(len(chunks))
                chunks.append(ids := [])
            else:
                cache.move_to_end(key)
                self.hits += 1
                self.hit_chars += len(part)
                chunks.append(ids)
        if todo:
            self._fill(todo, chunks)
        out: list[int] = []
        for chunk in chunks:
            out += chunk
        return out

    def _fill(self, todo: dict[Any, list[int]], chunks: list[list[int]]) -> None:
        keys = list(todo)
        encodings = self._encode_pieces([self._raw_text(k) for k in keys])
        for key, got in zip(keys, encodings, strict=True):
            ids = self._accept(key, got)
            for pos in todo[key]:
                chunks[pos] = ids

    def _encode_pieces(self, texts: list[str]) -> list[list[int]]:
        """The library's ids of texts holding no boundary token, without special tokens (fast when proven)."""
        fast = self._fast
        if fast is not None:
            try:
                return [fast.encode(t) for t in texts]
            except Exception:  # e.g. a lone surrogate: the library gives its own answer (or error) below
                pass
        return [e.ids for e in self._batch(texts, add_special_tokens=False)]

    def _raw_text(self, key: Any) -> str:
        """What the library is given for a piece's cache key (anchored pieces go behind their anchor)."""
        if isinstance(key, tuple):
            return str(key[0])
        return key if self._anchor is None else self._anchor[0] + key

    def _accept(self, key: Any, ids: list[int]) -> list[int]:
        """A piece's ids from the library -> its ids in the prompt, counted and cached. Raises SegmentMismatch."""
        anchor = self._anchor
        text = key[0] if isinstance(key, tuple) else key
        if anchor is not None and not isinstance(key, tuple):
            if not ids or ids[0] != anchor[1]:
                raise SegmentMismatch
            del ids[0]
        self.misses += 1
        self.miss_chars += len(text)
        self.miss_tokens += len(ids)
        self._store(key, text, ids)
        return ids

    def _store(self, key: Any, text: str, ids: list[int]) -> None:
        cost = len(text) + _BYTES_PER_ID * len(ids) + _BYTES_PER_ENTRY
        if cost > self._max_entry_bytes:
            self.uncached += 1
            return
        cache = self._cache
        cache[key] = ids
        self._serial += 1
        self._serials[key] = self._serial
        self._bytes += cost
        while len(cache) > self.max_entries or self._bytes > self.max_bytes:
            old_key, old_ids = cache.popitem(last=False)
            del self._serials[old_key]
            old_text = old_key[0] if isinstance(old_key, tuple) else old_key
            self._bytes -= len(old_text) + _BYTES_PER_ID * len(old_ids) + _BYTES_PER_ENTRY
            self.evictions += 1

    def stats(self) -> SegmentStats:
        return SegmentStats(hits=self.hits, misses=self.misses, hit_chars=self.hit_chars,
                            miss_chars=self.miss_chars, entries=len(self._cache), bytes=self._bytes,
                            evictions=self.evictions, uncached=self.uncached)

    def clear(self) -> None:
        self._cache.clear()
        self._serials.clear()
        self._bytes = 0
        self.chains.clear()

    def serial(self, index: int, part: str) -> int | None:
        """A number that stands for `parts[index]` exactly (the key chain cache's digest input): for a text piece
        its cache entry's (None when not cached), for a boundary token its id."""
        if index & 1:
            return -1 - self._boundary[part][0]
        if not part:
            return 0
        key = (part,) if index == 0 and self._anchor is not None else part
        got = self._serials.get(key)
        if got is not None:
            # Kept warm as if encoded: a chain skips its pieces, and their eviction would break the chain.
            self._cache.move_to_end(key)
        return got

    def _safe_prefix(self, text: str, cut: int) -> tuple[list[int], int] | None:
        """The leading ids of `text` that encoding only text[:cut] already gets right, and the characters
        they cover; None when there are none to trust.

        The library normalizes, splits into words (pre-tokenizes) and runs the model on each word alone, and
        the split is a left-to-right scan: only the words near the cut can come out differently from the whole
        text's. So the tokens of the last two words, and any ending within a margin of the cut, are dropped;
        an added token near the cut (or anywhere before it) makes the attempt give up. The load-time check
        (SegmentEncoder._setup_prefix) verifies the rule on every cut of its probe texts before it is used.
        """
        rx = self._added_rx
        if rx is not None and rx.search(text, 0, min(len(text), cut + self._added_len)):
            return None
        enc = self.tokenizer.encode(text[:cut], add_special_tokens=False)
        words = enc.word_ids
        if not words or None in words:
            return None
        known = cast("list[int]", words)  # no None, checked above
        last = known[-1] - 1
        limit = cut - _PREFIX_MARGIN
        keep = 0
        for word, (_, end) in zip(known, enc.offsets, strict=True):
            if word >= last or end > limit:
                break
            keep += 1
        if not keep:
            return None
        return enc.ids[:keep], enc.offsets[keep - 1][1]
