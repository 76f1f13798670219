"""SegmentEncoder: a PieceCache whose cut is proven at load to give the tokenizer library's own ids, and the one
encoder per tokenizer that every model using it shares (EncoderSet).

The boundary rules live here: which added tokens the text is cut at, whether pieces are encoded behind an anchor,
whether tiktoken may encode them, whether special tokens are a fixed prefix/suffix, whether a long piece may be
begun alone; each is turned on only when the probe texts (cortex/piecewise/probes.py) agree. Why cutting is exact
and what can break it: cortex/piecewise/__init__.py.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import Gauge

from cortex.fast_bpe import LIBRARY, PROOF_CORPUS_SIZE, TIKTOKEN, FastBPE
from cortex.piecewise.piece_cache import PieceCache, SegmentMismatch
from cortex.piecewise.probes import FRAGMENTS, probe_texts, template_probes
from cortex.piecewise.token_cursor import TokenCursor

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from cortex.model_bundle import ModelBundle

# Log lines keep the logger name of the module this came from (extproc/serve.py quiets it by that name).
log = logging.getLogger("cortex.piecewise_tokenize")

TOKENIZER_BACKEND = Gauge("cortex_tokenizer_backend", "1 for the library that encodes a model's prompt pieces: "
                          "tiktoken (proven at load to give the tokenizers library's ids) or tokenizers",
                          ["model", "backend"])

SEGMENTED = "segmented"
ANCHORED = "segmented_anchored"
WHOLE_TEXT = "whole_text"


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


class SegmentEncoder(PieceCache):
    """Token ids of a text equal to `tokenizer.encode(text, add_special_tokens=...).ids`, with a piece cache.

    `mode` is SEGMENTED, ANCHORED or WHOLE_TEXT; `reason` says why a tokenizer is not plainly segmented.
    `special_reason` says why `add_special_tokens=True` falls back to whole-text (its post-processor does
    not add a fixed prefix/suffix), "" when it is segmented too.
    """

    def __init__(self, tokenizer: Tokenizer, *, max_entries: int = 16384, max_bytes: int = 64 << 20,
                 probes: Sequence[str] = (), enabled: bool = True, fast: bool = True) -> None:
        super().__init__(tokenizer, max_entries=max_entries, max_bytes=max_bytes)
        self.backend = LIBRARY
        self.backend_reason = "segmenting is off" if enabled else "segmenting turned off"
        self._want_fast = fast
        self.mode = WHOLE_TEXT
        self.reason = ""
        self.special_reason = ""
        self.probes_checked = 0
        self.fast_probes = 0
        self._affix: tuple[list[int], list[int]] | None = None
        if not enabled:
            self.reason = "segmenting turned off"
        else:
            self._setup(list(probes))

    @classmethod
    def for_bundle(cls, bundle: ModelBundle, **kwargs: Any) -> SegmentEncoder:
        """An encoder for a model bundle, checked also on conversations rendered with its chat template."""
        probes = list(kwargs.pop("probes", ()))
        probes += template_probes(bundle)
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
        except SegmentMismatch:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            assert self._affix is not None
            prefix, suffix = self._affix
            if prefix:
                ids[:0] = prefix
            ids += suffix
        return ids

    def cursor(self, text: str, *, add_special_tokens: bool = False) -> TokenCursor:
        """The ids of `encode(text)` produced piece by piece, so a caller can stop before the end."""
        if self.mode == WHOLE_TEXT or (add_special_tokens and self._affix is None):
            return TokenCursor.of_ids(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        prefix, suffix = self._affix if add_special_tokens and self._affix is not None else ([], [])
        return TokenCursor(self, self._split(text), prefix, suffix)

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
        probes = probe_texts(sorted(boundary, key=lambda c: boundary[c][0]), complex_tokens, extra_probes)
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
            except SegmentMismatch:
                return _short(text)
            if got != whole(text, add_special_tokens=False).ids:
                return _short(text)
            self.probes_checked = n
        return None

    def _setup_prefix(self, extra_probes: list[str]) -> None:
        """Check `_safe_prefix` at every cut of a set of probe pieces; turn it on only if every cut agrees."""
        if self.mode != SEGMENTED:
            self.prefix_reason = f"only for plainly segmented tokenizers (mode {self.mode})"
            return
        added = [a.content for a in self.tokenizer.get_added_tokens_decoder().values() if a.content]
        if added:
            self._added_rx = re.compile(_trie_pattern(added))
            self._added_len = max(map(len, added))
        texts = ["".join(FRAGMENTS), " ".join(FRAGMENTS), "\n".join(reversed(FRAGMENTS)),
                 "  ".join(f + f for f in FRAGMENTS[::2])]
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
            except SegmentMismatch:
                got = None
            if got != tok.encode(text, add_special_tokens=True).ids:
                self._affix = None
                self.special_reason = f"special tokens are not a fixed prefix/suffix (probe {_short(text)!r})"
                return


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
