"""A trace as the benchmark replays it: `Line`s, one per request in the Mooncake shape (arrival, prompt and
answer lengths, the prompt's block hash ids, a session), whatever format they were read from
(cortexbench/trace_mooncake.py, cortexbench/trace_weka.py); and the windowing every replay applies to them: the
lines of a time window, each cut to a longest prompt.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Line:
    number: int
    """1-based line number in the file."""
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: str | None = None


def require_int(doc: dict[str, Any], key: str, minimum: int) -> int:
    """`doc[key]`, an integer (not a bool) of at least `minimum`; else ValueError saying what is wrong."""
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{key} must be an integer, got {v!r}" if key in doc else f"missing {key}")
    if v < minimum:
        raise ValueError(f"{key} must be >= {minimum}, got {v}")
    return v


def window(lines: list[Line], start_s: float = 0.0, seconds: float | None = None) -> list[Line]:
    """The lines (sorted by arrival) that arrive `start_s` seconds or more after the first line, and less than
    `start_s + seconds` after it (all of them from `start_s` on when `seconds` is None). Trace time, unscaled."""
    if not lines:
        return []
    t0 = lines[0].timestamp_ms
    lo, hi = start_s * 1000.0, None if seconds is None else (start_s + seconds) * 1000.0
    return [ln for ln in lines if ln.timestamp_ms - t0 >= lo and (hi is None or ln.timestamp_ms - t0 < hi)]


def cap(line: Line, max_input: int, block_tokens: int) -> Line:
    """The line cut to its first `max_input` tokens (and the blocks they span), or itself if no longer."""
    if line.input_length <= max_input:
        return line
    blocks = math.ceil(max_input / block_tokens)
    return dataclasses.replace(line, input_length=max_input, hash_ids=line.hash_ids[:blocks])
