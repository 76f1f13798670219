"""Segment-wise tokenization: encode the text between a tokenizer's added tokens piece by piece, with a cache.

Why it is exact. `tokenizers` first cuts its input at every added token that is matched on the raw text
(`normalized: false`; leftmost-longest over all of them, special or not), and only then normalizes,
pre-tokenizes and runs the model on each remaining piece by itself. So

    ids(p0 + T1 + p1 + T2 + p2) == ids(p0) + [id(T1)] + ids(p1) + [id(T2)] + ids(p2)

as long as nothing in a piece's encoding depends on what lies outside it. Chat templates put such tokens
(`<|im_start|>`, `<|eot_id|>`, ...) between messages, so a repeated system prompt and a conversation's earlier
turns come back as the same pieces, and a bounded LRU cache of their ids turns them into lookups: only the
new tail is tokenized.

What can break the equivalence, and what is done about it:
  * a pre-tokenizer that treats the piece at offset 0 differently (Metaspace `prepend_scheme: first`): every
    later piece is encoded behind one boundary token, whose id is then dropped ("anchored" mode), which is
    exactly the position it has in the whole text;
  * added tokens with lstrip / rstrip / single_word reach into the text around them: Cortex never cuts at
    them (they stay inside their piece, where the library sees the same neighbours), but still matches them
    so overlapping tokens resolve as the library resolves them; single_word can still see a different
    neighbour at a piece edge, which the self-check catches;
  * `encode_special_tokens` (special tokens encoded as text): special tokens are not cut at;
  * truncation or padding configured in tokenizer.json: whole-text encoding only;
  * anything else, unforeseen: each tokenizer is checked at load over a set of probe texts (its own added
    tokens in many textual surroundings, plus conversations rendered with its chat template); a tokenizer
    that fails in both modes is encoded whole-text, and `reason` says why.

The per-request path does no tokenizer introspection: one precompiled regex split, dictionary lookups, one
encode call per piece not cached, and a list assembly. Pieces are encoded by tiktoken where cortex/fast_bpe.py
proved at load that it gives the library's ids (`backend`, `backend_reason` say which and why), else by one
batched `encode_batch_fast` call (no offsets computed; TOKENIZERS_PARALLELISM=false keeps it to one core).
Not thread-safe: one encoder per event loop (extproc is single-threaded per process).
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from prometheus_client import Gauge

from cortex.chain_cache import ChainCache
from cortex.fast_bpe import LIBRARY, PROOF_CORPUS_SIZE, TIKTOKEN, FastBPE

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from cortex.model_bundle import ModelBundle

log = logging.getLogger("cortex.piecewise_tokenize")

TOKENIZER_BACKEND = Gauge("cortex_tokenizer_backend", "1 for the library that encodes a model's prompt pieces: "
                          "tiktoken (proven at load to give the tokenizers library's ids) or tokenizers",
                          ["model", "backend"])

SEGMENTED = "segmented"
ANCHORED = "segmented_anchored"
WHOLE_TEXT = "whole_text"

# Approximate CPython cost of one cached entry: the list (8 bytes a slot) and its int objects (ids above
# 256 are distinct objects, 28-32 bytes), the key string, and the dictionary slots.
_BYTES_PER_ID = 40
_BYTES_PER_ENTRY = 200

# Text fragments placed around tokens in the self-check: whitespace runs (prefix-space and `\s+(?!\S)`
# rules), combining marks (NFC), CJK, emoji, digits, contractions, CRLF, punctuation that starts tokens.
_FRAGMENTS = (
    "", " ", "  ", "\n", "\n\n", " \n ", "\t", "x", " x", "x ", "Hello world", " Hello", "héllo wörld",
    "e\u0301", "\u0301x", "日本語のテキスト", "😀 emoji", "12345 678", "don't", "\r\n", "\u00a0nbsp", "<", ">",
    "|", "'s", "  indented\n    code()", "▁x", "ab\u200dcd",
)
_AROUND = (("", ""), ("x", "y"), (" ", " "), ("Hello ", "\nworld"), ("\n", "\n"), ("héllo", "e\u0301"),
           ("don't ", " 12345"), ("  ", "x"), ("x", "  "), ("日本", "語"), ("\u0301", "\u0301"))
_TOKEN_SAMPLE = 48
PREFIX_MIN_CHARS = 2048
"""An uncached piece at least this long is first encoded only in part (see SegmentEncoder._safe_prefix)."""
PREFIX_CHARS = 256
"""Characters encoded first from such a piece: 60-90 tokens of prose, a few blocks, enough to find a miss."""
_PREFIX_MARGIN = 16
# Conversations rendered with the model's chat template as probes: roles, whitespace edges, empty content.
_PROBE_CHATS: tuple[tuple[tuple[str, str], ...], ...] = (
    (("system", "You are a helpful assistant."), ("user", "Hi there!"), ("assistant", "Hello! How can I help?"),
     ("user", "Tell me a joke.")),
    (("user", "  leading and trailing spaces  "), ("assistant", "\n\nnewlines\n"), ("user", " ")),
    (("system", ""), ("user", "日本語 😀 e\u0301 don't 12345")),
    (("user", "x"),),
)


class _Mismatch(Exception):
    """An anchored piece did not start with its anchor: this request is encoded whole-text."""


SegmentMismatch = _Mismatch  # what a TokenCursor's caller catches to start over whole-text


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


def _trie_pattern(words: Iterable[str]) -> str:
    """One alternation that a backtracking regex matches leftmost-longest, factored as a trie.

    A flat alternation of hundreds of tokens that share a prefix (`<|reserved_special_token_N|>`) tries
    every branch at every `<` a user typed; the trie rejects a non-token after a character or two.
    """
    trie: dict[str, Any] = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = True

    def emit(node: dict[str, Any]) -> str:
        branches = [re.escape(ch) + emit(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if "" in node:
            # A token ends here but longer ones continue: try the longer first, as the library does.
            return "(?:" + body + ")?" if len(branches) == 1 else body[:-1] + "|)"
        return body

    return emit(trie)


class SegmentEncoder:
    """Token ids of a text equal to `tokenizer.encode(text, add_special_tokens=...).ids`, with a piece cache.

    `mode` is SEGMENTED, ANCHORED or WHOLE_TEXT; `reason` says why a tokenizer is not plainly segmented.
    `special_reason` says why `add_special_tokens=True` falls back to whole-text (its post-processor does
    not add a fixed prefix/suffix), "" when it is segmented too.
    """

    def __init__(self, tokenizer: Tokenizer, *, max_entries: int = 16384, max_bytes: int = 64 << 20,
                 probes: Sequence[str] = (), enabled: bool = True, fast: bool = True) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("max_entries and max_bytes must be positive")
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._max_entry_bytes = max_bytes // 8
        self._cache: OrderedDict[Any, list[int]] = OrderedDict()
        self._bytes = 0
        self.chains = ChainCache()
        # A number per cached piece, never reused: equal numbers mean equal text (the dictionary compared it).
        self._serials: dict[Any, int] = {}
        self._serial = 0
        """Prompt prefixes' key chains at boundary tokens (cortex/chain_cache.py): ids depend on this tokenizer."""
        self.hits = self.misses = self.hit_chars = self.miss_chars = self.evictions = self.uncached = 0
        self.miss_tokens = 0
        self._batch = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch
        # Who encodes the pieces: the library, or a faster BPE proven at load to give the same ids (fast_bpe).
        self._fast: FastBPE | None = None
        self.backend = LIBRARY
        self.backend_reason = "segmenting is off" if enabled else "segmenting turned off"
        self._want_fast = fast
        self.mode = WHOLE_TEXT
        self.reason = ""
        self.special_reason = ""
        self.probes_checked = 0
        self.fast_probes = 0
        self._affix: tuple[list[int], list[int]] | None = None
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
        if not enabled:
            self.reason = "segmenting turned off"
        else:
            self._setup(list(probes))

    @classmethod
    def for_bundle(cls, bundle: ModelBundle, **kwargs: Any) -> SegmentEncoder:
        """An encoder for a model bundle, checked also on conversations rendered with its chat template."""
        probes = list(kwargs.pop("probes", ()))
        probes += _template_probes(bundle)
        enc = cls(bundle.tokenizer, probes=probes, **kwargs)
        if enc.mode == SEGMENTED:
            log.info("model %r: segment-wise tokenization on (%d probes agree); long pieces begun alone: %s",
                     bundle.name, enc.probes_checked, enc.prefix_reason or "yes")
        elif enc.mode == ANCHORED:
            log.info("model %r: segment-wise tokenization on, anchored (%s)", bundle.name, enc.reason)
        else:
            log.warning("model %r: whole-text tokenization: %s", bundle.name, enc.reason)
        if enc.backend == TIKTOKEN:
            log.info("model %r: pieces are encoded with tiktoken (its ids equal the library's on %d probes)",
                     bundle.name, enc.fast_probes)
        else:
            log.info("model %r: pieces are encoded with the tokenizers library: %s", bundle.name, enc.backend_reason)
        for backend in (TIKTOKEN, LIBRARY):
            TOKENIZER_BACKEND.labels(bundle.name, backend).set(int(backend == enc.backend))
        if enc.enabled and enc.special_reason:
            log.info("model %r: prompts with special tokens added are encoded whole-text: %s", bundle.name,
                     enc.special_reason)
        return enc

    @property
    def enabled(self) -> bool:
        return self.mode != WHOLE_TEXT

    # -- hot path -------------------------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        if self.mode == WHOLE_TEXT or (add_special_tokens and self._affix is None):
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        try:
            ids = self._encode(text)
        except _Mismatch:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            assert self._affix is not None
            prefix, suffix = self._affix
            if prefix:
                ids[:0] = prefix
            ids += suffix
        return ids

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
        """A piece's ids from the library -> its ids in the prompt, counted and cached. Raises _Mismatch."""
        anchor = self._anchor
        text = key[0] if isinstance(key, tuple) else key
        if anchor is not None and not isinstance(key, tuple):
            if not ids or ids[0] != anchor[1]:
                raise _Mismatch
            del ids[0]
        self.misses += 1
        self.miss_chars += len(text)
        self.miss_tokens += len(ids)
        self._store(key, text, ids)
        return ids

    def cursor(self, text: str, *, add_special_tokens: bool = False) -> TokenCursor:
        """The ids of `encode(text)` produced piece by piece, so a caller can stop before the end."""
        if self.mode == WHOLE_TEXT or (add_special_tokens and self._affix is None):
            return TokenCursor.of_ids(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        prefix, suffix = self._affix if add_special_tokens and self._affix is not None else ([], [])
        return TokenCursor(self, self._split(text), prefix, suffix)

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

    # -- load-time self-check -------------------------------------------------------------------------------

    def _setup(self, extra_probes: list[str]) -> None:
        tok = self.tokenizer
        if tok.truncation is not None or tok.padding is not None:
            self.reason = "tokenizer.json configures truncation or padding, which apply to the whole text"
            return
        added = tok.get_added_tokens_decoder()
        split_on_special = not tok.encode_special_tokens
        # Matched on the raw text, as the library's first split does; `normalized` ones are found later,
        # inside the normalized pieces, so they are left to the per-piece encode.
        raw = {a.content: (i, a) for i, a in added.items() if not a.normalized and a.content}
        boundary = {c: [i] for c, (i, a) in raw.items()
                    if not (a.lstrip or a.rstrip or a.single_word) and (split_on_special or not a.special)}
        self._boundary = boundary
        self._merge = len(boundary) < len(raw)
        if boundary:
            self._rx = re.compile("(" + _trie_pattern(raw) + ")")
        complex_tokens = sorted(c for c in raw if c not in boundary)
        probes = _probe_texts(sorted(boundary, key=lambda c: boundary[c][0]), complex_tokens, extra_probes)
        failure = self._check(probes, SEGMENTED)
        if failure is None:
            self.mode = SEGMENTED
        else:
            plain_failure = failure
            anchor = next(iter(sorted(boundary, key=lambda c: (len(c), boundary[c][0]))), None)
            if anchor is not None:
                self._anchor = (anchor, boundary[anchor][0])
                failure = self._check(probes, ANCHORED)
            if failure is None:
                self.mode = ANCHORED
                self.reason = f"pieces encode differently at offset 0 (probe {plain_failure!r}); later pieces " \
                              f"are encoded behind {anchor!r}"
            else:
                self._anchor = None
                self.mode = WHOLE_TEXT
                self.reason = f"segment-wise ids differ from whole-text ids for probe {failure!r}"
                self.clear()
                return
        self._setup_fast(probes, normalized=any(a.normalized for a in added.values()))
        self._setup_specials(probes)
        self._setup_prefix(extra_probes)
        self.clear()
        self.hits = self.misses = self.hit_chars = self.miss_chars = self.evictions = self.uncached = 0
        self.miss_tokens = 0

    def _setup_fast(self, probes: list[str], *, normalized: bool) -> None:
        """Encode pieces with a faster BPE if it gives the library's ids on every probe piece and on the proof
        corpus (cortex/fast_bpe.py); otherwise keep the library and say why."""
        if not self._want_fast:
            self.backend_reason = "turned off"
            return
        if self.mode != SEGMENTED:
            self.backend_reason = f"only for plainly segmented tokenizers (mode {self.mode})"
            return
        if self._merge or normalized:
            # A piece could then hold an added token, which only the library's own split handles.
            self.backend_reason = "some added tokens are not cut out of the text (lstrip/rstrip/single_word, " \
                                  "normalized, or special tokens encoded as text)"
            return
        pieces = sorted({p for probe in probes for p in self._split(probe)[::2] if p})
        fast, why = FastBPE.build(self.tokenizer, pieces)
        if fast is None:
            self.backend_reason = why
            return
        self._fast = fast
        self.backend = TIKTOKEN
        self.backend_reason = ""
        self.fast_probes = len(pieces) + PROOF_CORPUS_SIZE

    def status(self) -> dict[str, Any]:
        """How this tokenizer is encoded, and why: for logs, metrics and status pages."""
        return {"mode": self.mode, "reason": self.reason, "backend": self.backend,
                "backend_reason": self.backend_reason, "long_pieces_begun_alone": self._prefix_ok,
                "prefix_reason": self.prefix_reason, "special_reason": self.special_reason}

    def _check(self, probes: list[str], mode: str) -> str | None:
        """The first probe whose segment-wise ids differ from the whole-text ids, or None."""
        self.clear()
        whole = self.tokenizer.encode
        for n, text in enumerate(probes, 1):
            try:
                got = self._encode(text)
            except _Mismatch:
                return _short(text)
            if got != whole(text, add_special_tokens=False).ids:
                return _short(text)
            self.probes_checked = n
        return None

    def _safe_prefix(self, text: str, cut: int) -> tuple[list[int], int] | None:
        """The leading ids of `text` that encoding only text[:cut] already gets right, and the characters
        they cover; None when there are none to trust.

        The library normalizes, splits into words (pre-tokenizes) and runs the model on each word alone, and
        the split is a left-to-right scan: only the words near the cut can come out differently from the whole
        text's. So the tokens of the last two words, and any ending within a margin of the cut, are dropped;
        an added token near the cut (or anywhere before it) makes the attempt give up. The load-time check
        (`_setup_prefix`) verifies the rule on every cut of its probe texts before it is used.
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

    def _setup_prefix(self, extra_probes: list[str]) -> None:
        """Check `_safe_prefix` at every cut of a set of probe pieces; turn it on only if every cut agrees."""
        if self.mode != SEGMENTED:
            self.prefix_reason = f"only for plainly segmented tokenizers (mode {self.mode})"
            return
        added = [a.content for a in self.tokenizer.get_added_tokens_decoder().values() if a.content]
        if added:
            self._added_rx = re.compile(_trie_pattern(added))
            self._added_len = max(map(len, added))
        texts = ["".join(_FRAGMENTS), " ".join(_FRAGMENTS), "\n".join(reversed(_FRAGMENTS)),
                 "  ".join(f + f for f in _FRAGMENTS[::2])]
        texts += sorted({p for probe in extra_probes for p in self._split(probe)[::2] if len(p) >= 16})[:40]
        whole = self.tokenizer.encode
        for text in texts:
            ids = whole(text, add_special_tokens=False).ids
            for cut in range(1, len(text) + 1):
                got = self._safe_prefix(text, cut)
                if got is not None and got[0] != ids[: len(got[0])]:
                    self.prefix_reason = f"a piece's beginning encodes differently alone (probe {_short(text)!r}, " \
                                         f"cut at {cut})"
                    return
        self._prefix_ok = True
        self.prefix_reason = ""

    def _setup_specials(self, probes: list[str]) -> None:
        """Find the fixed prefix/suffix the post-processor adds (e.g. BOS) and check it on every probe."""
        tok = self.tokenizer
        sample = "Hello world, this is a probe."
        plain = tok.encode(sample, add_special_tokens=False).ids
        full = tok.encode(sample, add_special_tokens=True).ids
        extra = len(full) - len(plain)
        start = next((k for k in range(extra + 1) if full[k:k + len(plain)] == plain), None) if extra >= 0 else None
        if start is None:
            self.special_reason = "the post-processor changes the ids themselves, not only their ends"
            return
        self._affix = (full[:start], full[start + len(plain):])
        for text in ["", *probes]:
            try:
                got = self.encode(text, add_special_tokens=True)
            except _Mismatch:
                got = None
            if got != tok.encode(text, add_special_tokens=True).ids:
                self._affix = None
                self.special_reason = f"special tokens are not a fixed prefix/suffix (probe {_short(text)!r})"
                return


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

    def __init__(self, enc: SegmentEncoder | None, parts: list[str], prefix: Sequence[int],
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
            raise _Mismatch

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


class EncoderSet:
    """One SegmentEncoder per tokenizer in use, shared by every model (and alias) that uses that tokenizer.

    `update()` builds encoders (and their load-time self-check) off the request path, e.g. on a config
    reload; `get()` is the per-request lookup. Keyed by the tokenizer object, not the model name: a reload may
    hand an unchanged bundle to a model of another name, and two models may share one tokenizer.
    """

    def __init__(self, bundles: Iterable[ModelBundle] = (), **kwargs: Any) -> None:
        self._kwargs = kwargs
        self._by_tokenizer: dict[int, SegmentEncoder] = {}
        self.update(bundles)

    def update(self, bundles: Iterable[ModelBundle]) -> None:
        """Keep the encoders (and their warm caches) of tokenizers still in use, build the new ones, drop the rest."""
        self.install(self.build(bundles))

    def install(self, built: dict[int, SegmentEncoder]) -> None:
        """Swap in what `build` returned (one assignment, on the thread that routes)."""
        self._by_tokenizer = built

    def build(self, bundles: Iterable[ModelBundle]) -> dict[int, SegmentEncoder]:
        """The encoders `bundles` need: those already built are kept, new tokenizers are checked (their load-time
        proofs take up to a second or two: call this off the event loop, then `install` the result)."""
        fresh: dict[int, SegmentEncoder] = {}
        for b in bundles:
            key = id(b.tokenizer)
            enc = fresh.get(key) or self._by_tokenizer.get(key)
            if enc is None or enc.tokenizer is not b.tokenizer:  # an id reused by a new object
                enc = SegmentEncoder.for_bundle(b, **self._kwargs)
            fresh[key] = enc
        return fresh

    def get(self, bundle: ModelBundle) -> SegmentEncoder:
        enc = self._by_tokenizer.get(id(bundle.tokenizer))
        if enc is None or enc.tokenizer is not bundle.tokenizer:
            # A bundle update() was not given: checked now, once, rather than failing the request.
            enc = self._by_tokenizer[id(bundle.tokenizer)] = SegmentEncoder.for_bundle(bundle, **self._kwargs)
        return enc

    def encoders(self) -> list[SegmentEncoder]:
        return list(self._by_tokenizer.values())


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _probe_texts(boundary: list[str], complex_tokens: list[str], extra: list[str]) -> list[str]:
    """Texts that put the tokenizer's added tokens in the surroundings where per-piece encoding could differ."""
    if len(boundary) > _TOKEN_SAMPLE:
        # The lowest ids (the ones templates use: BOS/EOS, role markers) plus an even spread of the rest.
        head = boundary[: _TOKEN_SAMPLE // 2]
        rest = boundary[_TOKEN_SAMPLE // 2:]
        step = max(1, len(rest) // (_TOKEN_SAMPLE // 2))
        sample = head + rest[::step]
    else:
        sample = list(boundary)
    # Tokens a template or the caller's probes actually use are always included.
    used = [t for t in boundary if t not in sample and any(t in p for p in extra)]
    sample += used
    probes: list[str] = list(_FRAGMENTS)
    probes.append("".join(_FRAGMENTS))
    n_frag = len(_FRAGMENTS)
    for i, t in enumerate(sample + complex_tokens):
        for a, b in _AROUND:
            probes.append(a + t + b)
        probes.append(_FRAGMENTS[i % n_frag] + t + _FRAGMENTS[(i * 7 + 3) % n_frag])
        probes.append(t + t + " " + t)
    for t1, t2 in zip(sample, sample[1:] + sample[:1], strict=True):
        probes += [t1 + t2, t1 + " x " + t2 + "y", "a" + t1 + "\n" + t2 + "\n\nb", t1 + "\u0301" + t2]
    for c in complex_tokens:
        for t in sample[:16]:
            probes += [t + c, c + t, t + " " + c + " " + t, "x" + c + "y" + t + "  " + c, t + "ab" + c + "cd" + t]
    probes += extra
    return probes


def _template_probes(bundle: ModelBundle) -> list[str]:
    """Conversations rendered with the bundle's chat template (skipped when it has none or refuses one)."""
    from cortex.model_bundle import TemplateError

    if not bundle.has_chat_template:
        return []
    try:
        tokens = [a.content for a in bundle.tokenizer.get_added_tokens_decoder().values() if a.content]
    except Exception:  # a tokenizer without added tokens needs no token-in-content probes
        tokens = []
    chats: list[list[dict[str, Any]]] = [[{"role": r, "content": c} for r, c in chat] for chat in _PROBE_CHATS]
    # Users type special-token strings; the template renders them verbatim into the prompt.
    chats.append([{"role": "user", "content": " ".join(tokens[:32]) + " and " + "".join(tokens[:8])}])
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    out: list[str] = []
    for chat in chats:
        for kwargs in ({"add_generation_prompt": True}, {"add_generation_prompt": False}, {"tools": tools}):
            try:
                out.append(bundle.render_chat(chat, **kwargs))
            except TemplateError:
                continue
    return out

