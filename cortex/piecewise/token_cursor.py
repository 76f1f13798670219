"""The walk over a prompt's pieces: its ids in prompt order, tokenized piece by piece only as far as they are
asked for (routing stops at the first block no worker holds), the rest finished later, possibly on a thread."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from cortex.piecewise.piece_cache import PieceCache, SegmentMismatch

# Log lines keep the logger name of the module this came from (extproc/serve.py quiets it by that name).
log = logging.getLogger("cortex.piecewise_tokenize")


class TokenCursor:
    """The ids of one text in prompt order, tokenized piece by piece only as far as they are asked for.

    The chunks of `next()` followed by `rest()` concatenate to `SegmentEncoder.encode(text)`. Each `next()`
    returns every cached piece and boundary token up to and including the next uncached piece, which it
    tokenizes then: routing stops asking once no worker can hold the next block, so text past that point
    costs nothing before the answer. The rest is finished later: `missing()` lists what the library must
    still encode, `raw_encode()` of those texts may run on another thread (it touches only the Rust
    tokenizer, which releases the GIL in batch calls), and `rest()` assembles the remaining ids on the
    encoder's own thread, caching them. A cursor raises SegmentMismatch where `encode()` would have fallen
    back to whole-text; the caller starts over with a whole-text cursor.
    """

    __slots__ = ("_enc", "_partial", "_parts", "_pos", "_ready", "_suffix", "chars", "mark", "tokens", "total_chars")

    def __init__(self, enc: PieceCache | None, parts: list[str], prefix: Sequence[int],
                 suffix: Sequence[int]) -> None:
        self._enc = enc
        self._parts = parts
        self._pos = 0
        self._ready: list[int] = list(prefix)
        self._suffix: list[int] = list(suffix)
        # A long piece whose beginning alone was returned: (cache key, text, ids returned, characters covered).
        self._partial: tuple[Any, str, list[int], int] | None = None
        self.chars = 0
        """Characters of text turned into ids so far."""
        self.tokens = 0
        """Ids returned so far."""
        self.total_chars = sum(map(len, parts))
        self.mark: tuple[int, int, int] | None = None
        """The deepest boundary token returned so far: (index of the part after it, ids and characters up to it
        included), where a key chain can be cached (cortex/chain_cache.py)."""

    @property
    def parts(self) -> list[str]:
        """The text as cut: text pieces at even indices, boundary tokens at odd ones (empty for known ids)."""
        return self._parts

    def skip(self, part: int, chars: int, tokens: int) -> None:
        """Continue after the boundary ending before `parts[part]`, whose ids (`tokens` of them, covering `chars`
        characters, any prefix included) the caller has from a cache; only a fresh cursor can skip."""
        assert self._pos == 0 and self._partial is None and part & 1 == 0 and 0 < part <= len(self._parts)
        self._pos = part
        self._ready = []
        self.chars = chars
        self.tokens = tokens
        self.mark = (part, tokens, chars)

    @classmethod
    def of_ids(cls, ids: list[int]) -> TokenCursor:
        """A cursor over ids known already (whole-text encoding, or a prompt given as ids): one chunk."""
        cur = cls(None, [], (), ())
        cur._ready = ids
        return cur

    @property
    def done(self) -> bool:
        return not self._ready and self._pos >= len(self._parts) and not self._suffix and self._partial is None

    @property
    def remaining_chars(self) -> int:
        return self.total_chars - self.chars

    def tokens_per_char(self) -> float:
        """This text's tokens per character so far, drawn toward the encoder's running ratio: a few hundred
        characters alone vary by a third either way."""
        enc = self._enc
        prior = enc.miss_tokens / enc.miss_chars if enc is not None and enc.miss_chars else 0.25
        weight = 4096
        return (self.tokens + weight * prior) / (self.chars + weight)

    @property
    def backlog(self) -> int:
        """Work left, in characters to tokenize plus ids produced but not returned."""
        return self.total_chars - self.chars + len(self._ready)

    def next(self) -> list[int] | None:
        """The next chunk of ids (ending with at most one newly tokenized piece), None once all were returned."""
        if self.done:
            return None
        out = self._ready
        self._ready = []
        parts = self._parts
        n = len(parts)
        i = self._pos
        enc = self._enc
        if self._partial is not None:
            out += self._complete()  # the rest of the long piece begun last time: this call's new piece
        elif i < n:
            assert enc is not None
            cache = enc._cache
            boundary = enc._boundary
            anchored = enc._anchor is not None
            while i < n:
                part = parts[i]
                i += 1
                if not i & 1:  # odd index in parts: a boundary token
                    out += boundary[part]
                    self.chars += len(part)
                    self.mark = (i, self.tokens + len(out), self.chars)
                    continue
                if not part:
                    continue
                key: Any = (part,) if anchored and i == 1 else part
                ids = cache.get(key)
                if ids is not None:
                    cache.move_to_end(key)
                    enc.hits += 1
                    enc.hit_chars += len(part)
                    self.chars += len(part)
                    out += ids
                    continue
                if enc._prefix_ok and len(part) >= enc.prefix_min_chars:
                    begun = enc._safe_prefix(part, enc.prefix_chars)
                    if begun is not None:
                        self._partial = (key, part, begun[0], begun[1])
                        self.chars += begun[1]
                        out += begun[0]
                        break
                self.chars += len(part)
                out += enc._accept(key, enc._encode_pieces([enc._raw_text(key)])[0])
                break
            self._pos = i
        if i >= n and self._suffix and self._partial is None:
            out += self._suffix
            self._suffix = []
        self.tokens += len(out)
        return out

    def _complete(self) -> list[int]:
        """The ids of the begun piece after its returned beginning, the piece now encoded whole."""
        assert self._partial is not None and self._enc is not None
        key, part, begun, covered = self._partial
        enc = self._enc
        ids = enc._cache.get(key)
        if ids is None:
            ids = enc._accept(key, enc._encode_pieces([enc._raw_text(key)])[0])
        self._partial = None
        self._verify(begun, ids)
        self.chars += len(part) - covered
        return ids[len(begun):]

    def _verify(self, begun: list[int], ids: list[int]) -> None:
        # Checked at load on every cut of the probes; if a real prompt still disagrees, stop using it.
        if ids[: len(begun)] != begun:
            assert self._enc is not None
            self._enc._prefix_ok = False
            self._enc.prefix_reason = "a piece's beginning encoded alone disagreed with the whole piece"
            log.error("tokenizer: %s; encoding long pieces whole from now on", self._enc.prefix_reason)
            raise SegmentMismatch

    def _keys(self) -> Iterable[tuple[int, Any]]:
        enc = self._enc
        if enc is None:
            return
        anchored = enc._anchor is not None
        parts = self._parts
        for i in range(self._pos, len(parts)):
            if i & 1:
                yield i, None
            elif parts[i]:
                yield i, (parts[i],) if anchored and i == 0 else parts[i]

    def missing(self) -> list[tuple[Any, str]]:
        """(cache key, text for the library) of each remaining piece not cached, once each."""
        enc = self._enc
        out: dict[Any, str] = {}
        if enc is not None:
            if self._partial is not None and self._partial[0] not in enc._cache:
                out[self._partial[0]] = enc._raw_text(self._partial[0])
            for _, key in self._keys():
                if key is not None and key not in enc._cache and key not in out:
                    out[key] = enc._raw_text(key)
        return list(out.items())

    def raw_encode(self, texts: list[str]) -> list[list[int]]:
        """The library's ids for `missing()` texts. Touches no Python state of the encoder: safe on a thread."""
        if self._enc is None or not texts:
            return []
        return self._enc._encode_pieces(texts)

    def rest(self, encoded: dict[Any, list[int]] | None = None) -> list[int]:
        """All ids not returned yet; `encoded` maps `missing()` keys to `raw_encode()` results (others are
        encoded here). Raises SegmentMismatch like `next()`."""
        out = self._ready
        self._ready = []
        enc = self._enc
        partial = self._partial
        if enc is not None and (self._pos < len(self._parts) or partial is not None):
            cache = enc._cache
            got: dict[Any, list[int]] = {}
            for key, fresh in (encoded or {}).items():
                # Another request may have cached the piece meanwhile: keep that entry, counted once.
                got[key] = cache[key] if key in cache else enc._accept(key, fresh)
            todo: dict[Any, list[int]] = {}
            chunks: list[list[int]] = []
            parts = self._parts
            order = ([(-1, partial[0])] if partial is not None else []) + list(self._keys())
            for i, key in order:
                if key is None:
                    chunks.append(enc._boundary[parts[i]])
                    continue
                ids: list[int] | None = got.get(key)
                if ids is None:
                    ids = cache.get(key)
                if ids is None:
                    todo.setdefault(key, []).append(len(chunks))
                    chunks.append([])
                else:
                    chunks.append(ids)
            if todo:
                enc._fill(todo, chunks)
            if partial is not None:
                self._partial = None
                self._verify(partial[2], chunks[0])
                chunks[0] = chunks[0][len(partial[2]):]
            last = -1  # the deepest boundary among them
            for n, (i, _) in enumerate(order):
                if i > 0 and i & 1:
                    last = n
            for n, chunk in enumerate(chunks):
                out += chunk
                if n == last:
                    i = order[n][0]
                    self.mark = (i + 1, self.tokens + len(out), sum(map(len, parts[:i + 1])))
            self.chars = self.total_chars
            self._pos = len(parts)
        out += self._suffix
        self._suffix = []
        self.tokens += len(out)
        return out
