"""The WEKA agentic-coding trace format (callanjfox/kv-cache-tester), read as Mooncake lines.

One JSON object per conversation (a Claude Code session):
`{"id", "block_size": 64, "hash_id_scope": "local", "requests": [{"t", "type", "in", "out", "hash_ids", ...}]}`,
`t` in seconds from the conversation's start, `hash_ids` the ids of the prompt's whole 64-token blocks (the
last partial block has none). An entry of type "subagent" holds its own `requests`, timed from its `t`. A
directory of such files (`*.json`, in name order) or one file. Hash ids are local to a conversation, so each
conversation's ids (its sub-agents' included) are put in a namespace of their own: two conversations never
share a block. The tokens past the last whole block get a block of their own, unique to the request.
Conversation k starts `conversation_gap_s` x k seconds after the first; within a conversation, a pause longer
than `max_idle_s` (the user went away: some pause for a day) is cut to it. Each request is a session of one
turn whose affinity key is the conversation's id.
"""

from __future__ import annotations

import itertools
import math
import zlib
from pathlib import Path
from typing import Any

from cortexbench.trace_lines import Line, TraceError, require_int

MAX_IDLE_S = 60.0
"""WEKA: the longest pause replayed between two requests of one conversation (seconds of trace time)."""
CONVERSATION_GAP_S = 30.0
"""WEKA: conversation k starts this many seconds (trace time) after conversation k - 1."""
_NAMESPACE_BITS = 40
"""A WEKA conversation's hash id h becomes namespace << 40 | h (its own ids stay below 2**39; the tail blocks
of partial prompts take the ids from 2**39 up)."""


def _namespace(conversation: str) -> int:
    return zlib.crc32(conversation.encode()) + 1


def _compress(times: list[float], max_idle_s: float) -> list[float]:
    """Offsets from the first of `times` (ascending) with every gap longer than `max_idle_s` cut to it."""
    out: list[float] = []
    for k, t in enumerate(times):
        out.append(0.0 if k == 0 else out[-1] + min(t - times[k - 1], max_idle_s))
    return out


def _weka_request(r: Any, where: str, block_tokens: int) -> tuple[int, int, list[int]]:
    if not isinstance(r, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(r).__name__}")
    try:
        n_in, n_out = require_int(r, "in", 1), require_int(r, "out", 0)
    except ValueError as exc:
        raise TraceError(f"{where}: {exc}") from None
    ids = r.get("hash_ids")
    # Checked at C speed (the WEKA files hold 4.5 million ids): every element an int (not a bool), within range.
    if not isinstance(ids, list) or not set(map(type, ids)) <= {int} or (ids and not 0 <= min(ids) <= max(ids)
                                                                         < 2 ** 39):
        raise TraceError(f"{where}: hash_ids must be a list of integers in [0, 2**39)")
    if len(ids) * block_tokens > n_in + block_tokens - 1:
        raise TraceError(f"{where}: {len(ids)} hash_ids x {block_tokens} tokens is more than in={n_in} needs")
    return n_in, n_out, ids


def _weka_t(r: Any, where: str) -> float:
    t = r.get("t") if isinstance(r, dict) else None
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
        raise TraceError(f"{where}: t must be a number of seconds >= 0, got {t!r}")
    return float(t)


def weka_lines(docs: list[tuple[str, Any]], *, max_idle_s: float = MAX_IDLE_S,
               conversation_gap_s: float = CONVERSATION_GAP_S) -> tuple[list[Line], int]:
    """WEKA conversations (source name, parsed JSON) as Mooncake lines, sorted by arrival, and their block size.

    Conversation k (in the order given) starts at k x `conversation_gap_s` seconds; its requests keep their `t`
    offsets, with every pause longer than `max_idle_s` between consecutive ones cut to it (a sub-agent's start
    counts as one of its parent's events; its own requests' pauses are cut the same way). Each conversation's
    hash ids h become `namespace << 40 | h`, the namespace a CRC of the conversation's id (refused if two
    collide), so no block is shared across conversations; the tokens past a prompt's whole blocks get fresh ids
    of the same namespace (from 2**39), one per request. session_id is the conversation's id."""
    if max_idle_s < 0 or conversation_gap_s < 0:
        raise TraceError("max_idle_s and conversation_gap_s must not be negative")
    lines: list[Line] = []
    block_sizes: set[int] = set()
    spaces: dict[int, str] = {}
    for k, (source, doc) in enumerate(docs):
        if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
            raise TraceError(f"{source}: not a WEKA trace (a JSON object with a requests list)")
        bs = doc.get("block_size", 64)
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise TraceError(f"{source}: block_size must be a positive integer, got {bs!r}")
        block_sizes.add(bs)
        if len(block_sizes) > 1:
            raise TraceError(f"{source}: block_size {bs} differs from the other files' {sorted(block_sizes - {bs})}")
        conv = str(doc.get("id") or Path(source).stem)
        space = 0 if doc.get("hash_id_scope") == "global" else _namespace(conv)
        if space and space in spaces:
            raise TraceError(f"{source}: conversation {conv!r} has the namespace of {spaces[space]!r} "
                             f"(the same id twice?)")
        spaces[space] = conv
        # (time in the conversation's own clock, where, request) for the parent's requests and sub-agent starts.
        events: list[tuple[float, str, Any]] = []
        for i, r in enumerate(doc["requests"]):
            where = f"{source}: requests[{i}]"
            events.append((_weka_t(r, where), where, r))
        events.sort(key=lambda e: e[0])
        at = _compress([e[0] for e in events], max_idle_s)
        timed: list[tuple[float, str, Any]] = []  # (seconds after the conversation's start, where, request)
        for (_, where, r), when in zip(events, at, strict=True):
            if r.get("type") != "subagent":
                timed.append((when, where, r))
                continue
            subs = r.get("requests")
            if not isinstance(subs, list):
                raise TraceError(f"{where}: a subagent entry needs a requests list")
            inner = sorted(((_weka_t(x, f"{where}.requests[{j}]"), f"{where}.requests[{j}]", x)
                            for j, x in enumerate(subs)), key=lambda e: e[0])
            offsets = _compress([e[0] for e in inner], max_idle_s)
            first = min(inner[0][0], max_idle_s) if inner else 0.0
            timed += [(when + first + off, w, x) for (_, w, x), off in zip(inner, offsets, strict=True)]
        start = k * conversation_gap_s
        tail = itertools.count(2 ** 39)
        for number, (when, where, r) in enumerate(timed, 1):
            n_in, n_out, ids = _weka_request(r, where, bs)
            offset = space << _NAMESPACE_BITS  # ids are below 2**39: adding is or-ing, and map runs at C speed
            full = [*map(offset.__add__, ids), *(offset + next(tail) for _ in range(math.ceil(n_in / bs) - len(ids)))]
            lines.append(Line(number, round((start + when) * 1000.0, 3), n_in, n_out, tuple(full), conv))
    lines.sort(key=lambda ln: ln.timestamp_ms)
    return lines, (block_sizes.pop() if block_sizes else 64)


def weka_files(path: Path) -> list[Path]:
    """The WEKA trace files of a directory, in name order."""
    files = sorted(p for p in path.glob("*.json") if p.is_file())
    if not files:
        raise TraceError(f"{path}: no WEKA trace files (*.json) in the directory")
    return files
