"""A faster encoder for the text between added tokens, used only where it is proven to give the library's ids.

HF `tokenizers` spends ~4 µs a token here; tiktoken's Rust BPE does the same byte-level BPE several times
faster. A byte-level BPE tokenizer.json (GPT-2 byte map, a Split regex pre-tokenizer, BPE with merges; Qwen2,
Llama 3 and most current models) maps onto a tiktoken Encoding:

  * vocab: each token string is turned back into bytes through the GPT-2 byte map; its id is its rank;
  * merge order: tiktoken merges the adjacent pair whose concatenation has the lowest rank, the library the
    pair with the lowest index in `merges`; the two agree when the merged tokens' ids never decrease along
    `merges` (checked; several merges yielding one token keep the same rank);
  * the Split pattern becomes tiktoken's pattern; an NFC normalizer is applied in Python first;
  * added tokens are not given to it: Cortex cuts them out of the text itself (cortex/piecewise/), so a
    piece it encodes never holds one (a tokenizer whose added tokens are not all cut out is not accelerated).

Where the two could still differ:
  * tiktoken takes a word found whole in the vocabulary as one token; the library merges it (unless
    `ignore_merges`) and may spell it otherwise. Decided exactly, over the whole vocabulary, at load
    (`shortcut_unsafe`): a text whose tiktoken ids hold such a token is encoded by the library.
  * the regex engines (Oniguruma vs fancy-regex), Unicode tables, and merge priorities (tiktoken merges by
    the merged token's rank, the library by the pair's place in `merges`): this is what `prove()` looks for.
    At load, every probe piece, a generated corpus (`proof_corpus`: prose, code, whitespace runs, digits,
    contractions, CJK, emoji, combining marks, random code points) and texts made of vocabulary tokens are
    encoded both ways; one differing id and the fast encoder is not used. tests/test_fast_bpe.py also runs
    the BPE cores against each other on every vocabulary token with letters added around it.
Cortex then encodes with the library, and says why (`FastBPE.build` returns the reason; the encoder's status
carries it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

log = logging.getLogger("cortex.fast_bpe")

_BUILT: dict[str, tuple[FastBPE | None, str]] = {}
_BUILT_MAX = 4

TIKTOKEN = "tiktoken"
LIBRARY = "tokenizers"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable character map, reversed (the one ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class NotSupported(ValueError):
    """tokenizer.json has a shape the fast encoder does not reproduce."""


def _pattern(pre: Any) -> str:
    """The regex of a `Sequence[Split(Regex, Isolated), ByteLevel(use_regex=false)]` pre-tokenizer."""
    if not isinstance(pre, dict) or pre.get("type") != "Sequence":
        raise NotSupported(f"pre-tokenizer {_kind(pre)} is not Sequence[Split, ByteLevel]")
    steps = pre.get("pretokenizers") or []
    if len(steps) != 2 or steps[0].get("type") != "Split" or steps[1].get("type") != "ByteLevel":
        raise NotSupported(f"pre-tokenizer steps {[s.get('type') for s in steps]} are not [Split, ByteLevel]")
    split, level = steps
    if split.get("behavior") != "Isolated" or split.get("invert"):
        raise NotSupported(f"Split behavior {split.get('behavior')!r} (invert {split.get('invert')}) is not Isolated")
    regex = (split.get("pattern") or {}).get("Regex")
    if not isinstance(regex, str):
        raise NotSupported("Split pattern is not a regex")
    if level.get("add_prefix_space") or level.get("use_regex", True):
        raise NotSupported("ByteLevel adds a prefix space or splits again with its own regex")
    return regex


def _kind(x: Any) -> str:
    return repr(x.get("type")) if isinstance(x, dict) else repr(x)


def _normalizer(norm: Any) -> Callable[[str], str] | None:
    if norm is None:
        return None
    if isinstance(norm, dict) and norm.get("type") == "NFC":
        def nfc(text: str) -> str:
            return text if unicodedata.is_normalized("NFC", text) else unicodedata.normalize("NFC", text)
        return nfc
    raise NotSupported(f"normalizer {_kind(norm)} is not NFC or none")


def _ranks(model: Any) -> dict[bytes, int]:
    if not isinstance(model, dict) or model.get("type") != "BPE":
        raise NotSupported(f"model {_kind(model)} is not BPE")
    if model.get("dropout") or model.get("byte_fallback") or model.get("continuing_subword_prefix") \
            or model.get("end_of_word_suffix"):
        raise NotSupported("BPE with dropout, byte fallback or subword affixes")
    decode = _byte_decoder()
    ranks: dict[bytes, int] = {}
    vocab: dict[str, int] = model.get("vocab") or {}
    for token, rank in vocab.items():
        try:
            raw = bytes(decode[c] for c in token)
        except KeyError:
            raise NotSupported(f"vocab token {token!r} is not byte-level") from None
        if raw in ranks:
            raise NotSupported(f"two vocab tokens decode to the same bytes {raw!r}")
        ranks[raw] = rank
    if any(bytes([b]) not in ranks for b in range(256)):
        raise NotSupported("the vocab lacks some of the 256 single bytes")
    last = -1
    for i, merge in enumerate(model.get("merges") or []):
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        merged = vocab.get(a + b)
        if merged is None:
            raise NotSupported(f"merge {i} ({a!r}, {b!r}) yields no vocab token")
        if merged < last:
            raise NotSupported(f"merge {i} yields id {merged}, lower than an earlier merge's {last}: "
                               "merge order is not id order")
        last = merged
    return ranks


def shortcut_unsafe(tokenizer: Tokenizer, model: dict[str, Any]) -> frozenset[int]:
    """Ids of vocab tokens that the library's BPE does not produce from their own text.

    tiktoken returns a word found whole in the vocabulary as that one token without merging; the library
    merges it (unless `ignore_merges`), and a vocab whose merges were not derived from it can spell such a
    word in several tokens (588 of Llama 3.2's, e.g. " Belediyesi"). Checked on every token, so it is exact:
    a tiktoken result that holds none of these ids took no shortcut the library would not also take.
    """
    if model.get("ignore_merges"):
        return frozenset()  # the library takes the same shortcut
    bpe = tokenizer.model
    out = []
    for token, i in (model.get("vocab") or {}).items():
        got = bpe.tokenize(token)
        if len(got) != 1 or got[0].id != i:
            out.append(i)
    return frozenset(out)


@dataclass
class FastBPE:
    """tiktoken's BPE over a tokenizer.json's vocab, merges and pattern (see the module doc)."""

    _encode: Callable[[str], list[int]]
    _normalize: Callable[[str], str] | None
    _library: Callable[[str], list[int]]
    pattern: str
    unsafe: frozenset[int]
    """Vocab tokens the library's BPE does not produce from their own text (see `shortcut_unsafe`)."""
    redone: int = 0
    """Texts whose tiktoken ids held an unsafe token and were encoded by the library instead."""

    @classmethod
    def from_json(cls, spec: dict[str, Any], tokenizer: Tokenizer) -> FastBPE:
        """Raises NotSupported (or ImportError without tiktoken) when the tokenizer cannot be mapped."""
        import tiktoken

        normalize = _normalizer(spec.get("normalizer"))
        pattern = _pattern(spec.get("pre_tokenizer"))
        ranks = _ranks(spec.get("model"))
        enc = tiktoken.Encoding("cortex-fast-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
        # The core's own call raises on text UTF-8 cannot carry (lone surrogates), as the library does;
        # Encoding.encode_ordinary would quietly replace them with U+FFFD and yield other ids.
        core = getattr(enc, "_core_bpe", None)

        def library(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False).ids
        return cls(core.encode_ordinary if core is not None else enc.encode_ordinary, normalize, library, pattern,
                   shortcut_unsafe(tokenizer, spec.get("model") or {}))

    def encode(self, text: str) -> list[int]:
        """Ids of a text holding no added token, as the library's `encode(text, add_special_tokens=False)`."""
        if self._normalize is not None:
            text = self._normalize(text)
        ids = self._encode(text)
        if self.unsafe and not self.unsafe.isdisjoint(ids):
            # tiktoken may have taken a whole word straight from the vocabulary where the library's merges
            # spell it otherwise: this text is the library's to encode.
            self.redone += 1
            return self._library(text)
        return ids

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    @staticmethod
    def build(tokenizer: Tokenizer, probes: Sequence[str], *, corpus_seed: int = 14
              ) -> tuple[FastBPE | None, str]:
        """A fast encoder proven on `probes` and `proof_corpus()`, or None and the reason it is not used."""
        try:
            text = tokenizer.to_str()
        except Exception as exc:  # a tokenizer that cannot serialize itself is simply not accelerated
            return None, f"tokenizer.json unreadable: {exc}"
        # Built and proven on the corpus once per tokenizer in a process (a config reload, or a second model
        # of the same tokenizer, does not pay the ~1 s or the ~25 MiB again); each caller's own probes are
        # checked every time (a few hundred pieces).
        key = f"{hashlib.sha256(text.encode('utf-8', 'surrogatepass')).hexdigest()}/{corpus_seed}"
        built = _BUILT.pop(key, None)
        if built is None:
            built = FastBPE._build(tokenizer, json.loads(text), corpus_seed)
        _BUILT[key] = built  # most recently used last
        while len(_BUILT) > _BUILT_MAX:
            del _BUILT[next(iter(_BUILT))]
        fast, why = built
        if fast is None:
            return None, why
        failure = fast.prove(tokenizer, probes)
        return (None, failure) if failure is not None else (fast, "")

    @staticmethod
    def _build(tokenizer: Tokenizer, spec: dict[str, Any], corpus_seed: int) -> tuple[FastBPE | None, str]:
        try:
            fast = FastBPE.from_json(spec, tokenizer)
        except ImportError:
            return None, "tiktoken is not installed"
        except NotSupported as exc:
            return None, str(exc)
        except Exception as exc:  # e.g. a pattern tiktoken's regex engine rejects
            return None, f"tiktoken refused the tokenizer: {exc}"
        failure = fast.prove(tokenizer, [*proof_corpus(corpus_seed), *vocab_texts(spec, corpus_seed)])
        if failure is not None:
            return None, failure
        return fast, ""

    def prove(self, tokenizer: Tokenizer, texts: Iterable[str]) -> str | None:
        """The first text whose ids differ from the library's, described, or None when all agree."""
        lib = tokenizer.encode_batch_fast if hasattr(tokenizer, "encode_batch_fast") else tokenizer.encode_batch
        batch: list[str] = []
        for text in texts:
            batch.append(text)
            if len(batch) >= 256:
                failure = self._compare(lib, batch)
                if failure:
                    return failure
                batch = []
        return self._compare(lib, batch) if batch else None

    def _compare(self, lib: Callable[..., Any], texts: list[str]) -> str | None:
        for text, want in zip(texts, lib(texts, add_special_tokens=False), strict=True):
            try:
                got = self.encode(text)
            except Exception as exc:
                return f"tiktoken failed on probe {_short(text)!r}: {exc}"
            if got != want.ids:
                n = min(len(got), len(want.ids))
                at = next((i for i in range(n) if got[i] != want.ids[i]), n)
                return f"tiktoken ids differ from the library's at token {at} of probe {_short(text)!r}"
        return None


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


_WORDS = ("the", "The", "of", "and", "a", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on", "are",
          "with", "as", "I", "his", "they", "be", "at", "one", "have", "this", "from", "or", "had", "by", "Hello",
          "world", "café", "naïve", "résumé", "Zürich", "straße", "Ελληνικά", "русский", "язык", "עברית", "العربية",
          "हिन्दी", "ไทย", "한국어", "日本語", "中文", "汉字", "のテキスト", "😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "∑", "≤", "→",
          "don't", "I'm", "we'll", "they've", "she'd", "it's", "YOU'RE", "'S", "'ll", "O'Neil", "rock'n'roll")
_CODE = ("def f(x):\n    return x + 1\n", "if (a && b) { return c[i]; }\n", "for i in range(10):\n\tprint(i)\n",
         "x = {'k': [1, 2.5, -3e10], \"s\": None}\n", "#include <stdio.h>\nint main() {}\n", "SELECT * FROM t;",
         "    \n        \n", "</div>\n<div class=\"a\">", "$ ls -la | grep '\\.py$'\r\n", "a==b!=c<=d>=e->f=>g",
         "// TODO: fix\n/* block */", "0x1F 0b1010 1_000_000 3.14159 1e-9 2024-12-01T06:41:43Z", "```python\n```",
         "https://example.com/a?b=c&d=e#f", "user@example.com", "    - item\n    - item2\n", "\\n\\t\\\\")
_SPACES = (" ", "  ", "   ", "    ", "\t", "\n", "\n\n", "\r\n", " \n", "\n ", "  \n  ", "\u00a0", "\u3000", "\u2003",
           "\u200b", "\u2028", "\x0b", "\x0c", " \t \n")
_PUNCT = ("!", "?", ".", ",", ";", ":", "...", "—", "–", "-", "--", "---", "====", "####", "***", "(", ")", "[", "]",
          "{", "}", "<", ">", "/", "\\", "|", "'", "\"", "`", "«", "»", "“", "”", "‘", "’", "%", "&", "@", "#", "$",
          "€", "£", "¥", "+", "=", "_", "__", "~", "^")


PROOF_CORPUS_SIZE = 600


def proof_corpus(seed: int = 14, n: int = PROOF_CORPUS_SIZE) -> list[str]:
    """Deterministic texts where two byte-level BPE implementations could part ways: mixed scripts, whitespace
    runs (the `\\s+(?!\\S)` rule), digit runs (`\\p{N}{1,3}`), contractions in any case, combining marks
    (NFC), emoji sequences, code, long repeats (merge ties), and random code points from every plane."""
    rng = random.Random(seed)
    out: list[str] = []
    for _ in range(n):
        kind = rng.randrange(6)
        parts: list[str] = []
        for _ in range(rng.randint(1, 40)):
            r = rng.random()
            if kind == 0 or r < 0.35:
                parts.append(rng.choice(_WORDS))
            elif r < 0.5:
                parts.append(rng.choice(_SPACES))
            elif r < 0.6:
                parts.append(rng.choice(_PUNCT))
            elif r < 0.7:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 12))))
            elif r < 0.78:
                parts.append(rng.choice(_CODE))
            elif r < 0.84:
                parts.append(rng.choice("aeiouAEIOU") + "\u0301\u0308"[: rng.randint(1, 2)])
            elif r < 0.9:
                parts.append(rng.choice(" =-_*#.~0a\n\t") * rng.randint(2, 70))
            else:
                parts.append(_random_chars(rng, rng.randint(1, 6)))
            if kind != 3 and rng.random() < 0.6:
                parts.append(" ")
        out.append("".join(parts))
    return out


def vocab_texts(spec: dict[str, Any], seed: int = 14, n: int = 200, per_text: int = 12) -> list[str]:
    """Texts made of random vocabulary tokens (their text where it is whole UTF-8): every script the model
    knows, joined with and without spaces."""
    decode = _byte_decoder()
    tokens = list((spec.get("model") or {}).get("vocab") or {})
    if not tokens:
        return []
    rng = random.Random(seed)
    out = []
    for k in range(n):
        words = []
        for token in rng.sample(tokens, min(per_text, len(tokens))):
            try:
                words.append(bytes(decode[c] for c in token).decode("utf-8"))
            except (KeyError, UnicodeDecodeError):
                continue
        out.append(("" if k % 3 == 0 else " ").join(words))
    return out


def _random_chars(rng: random.Random, k: int) -> str:
    chars: list[str] = []
    while len(chars) < k:
        plane = rng.random()
        cp = rng.randint(0x20, 0x2FF) if plane < 0.4 else rng.randint(0x300, 0xFFFF) if plane < 0.85 \
            else rng.randint(0x10000, 0x10FFFF)
        if 0xD800 <= cp <= 0xDFFF:  # surrogates: no request text can carry them through UTF-8
            continue
        chars.append(chr(cp))
    return "".join(chars)
