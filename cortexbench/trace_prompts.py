"""The text a trace's hash ids become, as Dynamo's replay builds it: each hash id a deterministic block of
`block_tokens` words drawn from the benchmark's vocabulary (each word one Qwen2.5 token, so words = tokens), the
same text for the same id in every line, run and process; a prompt is the blocks of its hash ids concatenated
and cut to its `input_length` words.

Block texts are built once and cached; `warm` builds a line's before the run's clock starts, so building its prompt
while the client sends is only a join.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable

from cortexbench.sessions import WORDS
from cortexbench.trace_lines import Line
from cortexbench.trace_mooncake import BLOCK_TOKENS

_WORD_OF_BYTE = tuple(WORDS[i % len(WORDS)] for i in range(256))
"""A vocabulary word per byte value (the first 76 words twice): a block's words are its digest's bytes."""


@functools.lru_cache(maxsize=8192)
def block_words(hash_id: int, block_tokens: int = BLOCK_TOKENS) -> tuple[str, ...]:
    """The text of one block: the same words for the same id everywhere, one per byte of a SHAKE-128 digest of
    the id (independent of PYTHONHASHSEED; ~5 x faster than drawing them from a seeded generator, which took
    ~0.7 ms per 512-token block here)."""
    digest = hashlib.shake_128(f"mooncake-block-{hash_id}".encode()).digest(block_tokens)
    return tuple(_WORD_OF_BYTE[b] for b in digest)


@functools.lru_cache(maxsize=65536)
def block_text(hash_id: int, block_tokens: int = BLOCK_TOKENS) -> str:
    """`block_words` joined by spaces, cached: a 130 000-token prompt is then one join of ~2 000 strings."""
    return " ".join(block_words(hash_id, block_tokens))


def warm(line: Line, block_tokens: int = BLOCK_TOKENS) -> None:
    """Build (into the caches) the text of every block `prompt_text(line)` joins, so building it later is only
    the join: done for every line before a run's clock starts (`LazyTurns.prepare`), not while the client sends."""
    whole = min(len(line.hash_ids), line.input_length // block_tokens)
    for h in line.hash_ids[:whole]:
        block_text(h, block_tokens)
    if whole < len(line.hash_ids):
        block_words(line.hash_ids[whole], block_tokens)


def prompt_text(line: Line, block_tokens: int = BLOCK_TOKENS) -> str:
    """The prompt of one line: its blocks' words, cut to input_length words."""
    whole = min(len(line.hash_ids), line.input_length // block_tokens)
    parts = [block_text(h, block_tokens) for h in line.hash_ids[:whole]]
    rest = line.input_length - whole * block_tokens
    if rest > 0 and whole < len(line.hash_ids):
        parts.append(" ".join(block_words(line.hash_ids[whole], block_tokens)[:rest]))
    return " ".join(parts)


def distinct_tokens(lines: Iterable[Line], block_tokens: int = BLOCK_TOKENS) -> int:
    """Distinct prompt tokens of a trace: each block once, as far as any line uses it."""
    whole: set[int] = set()
    partial: dict[int, int] = {}
    for ln in lines:
        n = min(len(ln.hash_ids), ln.input_length // block_tokens)
        whole.update(ln.hash_ids[:n])
        rest = ln.input_length - n * block_tokens
        if rest > 0 and n < len(ln.hash_ids):
            h = ln.hash_ids[n]
            partial[h] = max(partial.get(h, 0), rest)
    return len(whole) * block_tokens + sum(v for h, v in partial.items() if h not in whole)
