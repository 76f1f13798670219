"""The Mooncake trace format (FAST'25): JSON Lines, one request per line, as published by Mooncake and replayed by
Dynamo:

    {"timestamp": 27482, "input_length": 1500, "output_length": 52, "hash_ids": [46, 47, 48]}

`timestamp` is the arrival in milliseconds, `input_length` and `output_length` are tokens, and `hash_ids` name
the prompt's blocks of `block_tokens` tokens (512 in Mooncake's traces) in order: two requests whose lists start
with the same ids share that prefix. An optional `session_id` (string or integer) ties the turns of one
conversation together (Mooncake's own traces have none: each line is its own session). Other keys are ignored.

Every trace is replayed as such lines (cortexbench/trace_lines.py): a WEKA trace becomes Mooncake lines
(cortexbench/trace_weka.py); cortexbench/trace.py reads either and replays them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cortexbench.trace_lines import Line, TraceError, require_int

BLOCK_TOKENS = 512
"""Mooncake's block size; a WEKA file states its own (64)."""


def _line(doc: Any, number: int, block_tokens: int) -> Line:
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
    ts = doc.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"timestamp must be a number of milliseconds >= 0, got {ts!r}"
                         if "timestamp" in doc else "missing timestamp")
    input_length = require_int(doc, "input_length", 1)
    output_length = require_int(doc, "output_length", 0)
    ids = doc.get("hash_ids")
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"hash_ids must be a non-empty list of integers, got {ids!r}"
                         if "hash_ids" in doc else "missing hash_ids")
    bad = [h for h in ids if isinstance(h, bool) or not isinstance(h, int) or h < 0]
    if bad:
        raise ValueError(f"hash_ids must be integers >= 0, got {bad[0]!r}")
    if input_length > len(ids) * block_tokens:
        raise ValueError(f"input_length {input_length} is longer than its {len(ids)} hash_ids x {block_tokens} "
                         f"tokens (is the trace's block size {block_tokens}?)")
    sid = doc.get("session_id")
    if sid is not None and (isinstance(sid, bool) or not isinstance(sid, str | int)):
        raise ValueError(f"session_id must be a string or an integer, got {sid!r}")
    return Line(number, float(ts), input_length, output_length, tuple(ids), None if sid is None else str(sid))


def parse(lines: Iterable[str], source: str = "<trace>", block_tokens: int = BLOCK_TOKENS) -> list[Line]:
    """Every request of a trace, in file order; blank lines are skipped. Raises TraceError naming the first bad
    line as `source:line: problem`."""
    out = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            out.append(_line(json.loads(raw), number, block_tokens))
        except json.JSONDecodeError as exc:
            raise TraceError(f"{source}:{number}: not JSON: {exc.msg} (column {exc.colno})") from None
        except ValueError as exc:
            raise TraceError(f"{source}:{number}: {exc}") from None
    if not out:
        raise TraceError(f"{source}: no requests in the trace")
    return out


def load(path: str | Path, block_tokens: int = BLOCK_TOKENS) -> list[Line]:
    """A Mooncake-format JSONL trace's requests, in file order."""
    try:
        with open(path, encoding="utf-8") as f:
            return parse(f, str(path), block_tokens)
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc}") from None
