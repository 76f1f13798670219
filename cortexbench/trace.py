"""Replay request traces with prefix (block-hash) structure, and generate small ones.

Two formats, told apart by content (`read`):

* **Mooncake** (FAST'25), JSON Lines, one request per line, as published by Mooncake and replayed by Dynamo:

      {"timestamp": 27482, "input_length": 1500, "output_length": 52, "hash_ids": [46, 47, 48]}

  `timestamp` is the arrival in milliseconds, `input_length` and `output_length` are tokens, and `hash_ids` name
  the prompt's blocks of `block_tokens` tokens (512 in Mooncake's traces) in order: two requests whose lists start
  with the same ids share that prefix. An optional `session_id` (string or integer) ties the turns of one
  conversation together (Mooncake's own traces have none: each line is its own session). Other keys are ignored.
* **WEKA agentic coding** (callanjfox/kv-cache-tester), one JSON object per conversation (a Claude Code session):
  `{"id", "block_size": 64, "hash_id_scope": "local", "requests": [{"t", "type", "in", "out", "hash_ids", ...}]}`,
  `t` in seconds from the conversation's start, `hash_ids` the ids of the prompt's whole 64-token blocks (the
  last partial block has none). An entry of type "subagent" holds its own `requests`, timed from its `t`. A
  directory of such files (`*.json`, in name order) or one file. Hash ids are local to a conversation, so each
  conversation's ids (its sub-agents' included) are put in a namespace of their own: two conversations never
  share a block. The tokens past the last whole block get a block of their own, unique to the request.
  Conversation k starts `conversation_gap_s` x k seconds after the first; within a conversation, a pause longer
  than `max_idle_s` (the user went away: some pause for a day) is cut to it. Each request is a session of one
  turn whose affinity key is the conversation's id.

The replay does what Dynamo's does: each hash id becomes a deterministic block of text, `block_tokens` words
drawn from the benchmark's vocabulary (each word one Qwen2.5 token, so words = tokens), the same text for the same
id in every line, run and process; a prompt is the blocks of its hash ids concatenated and cut to
`input_length` words (and to `max_input`, keeping its first blocks), sent as the user message after a short fixed
system prompt; `output_length` becomes `max_tokens`, capped (64 by default: decode time is not what a routing
benchmark measures, and an uncapped trace would take minutes); each line arrives at its timestamp after the
first of the window replayed (optionally time-scaled), as a session of one turn whose affinity key is its
`session_id`. Prompts are built when sent, from block texts joined once; the block texts themselves are built
before the run's clock starts (`warm`, through `LazyTurns.prepare`), so the client's event loop, which also
times every stream, only joins while the run lasts. The trace is the workload: the seed changes nothing in it
(several windows of it are the seeds of a cell: `cortex bench --trace-start 0,600,1200`).

    python -m cortexbench.trace generate --out perf/traces/mooncake-small.jsonl --seed 1
    python -m cortexbench.trace info perf/traces/mooncake-small.jsonl
    python -m cortexbench.trace info ../shared/traces/conversation_trace.jsonl --trace-start 600 --trace-seconds 90
    python -m cortexbench.trace info ../shared/traces/kv-cache-tester
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import random
import sys
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from cortexbench.sessions import WORDS, LazyTurns, Session, Workload, words

BLOCK_TOKENS = 512
"""Mooncake's block size; a WEKA file states its own (64)."""
MAX_TOKENS = 64
MAX_INPUT = 131072
"""Longest prompt replayed, in tokens: a longer line is cut to its first blocks (WEKA's reach 204K)."""
MAX_IDLE_S = 60.0
"""WEKA: the longest pause replayed between two requests of one conversation (seconds of trace time)."""
CONVERSATION_GAP_S = 30.0
"""WEKA: conversation k starts this many seconds (trace time) after conversation k - 1."""
WORKERS = 8
SMALL_KV_TOKENS = 16384
"""KV per worker for a trace whose longest prompt fits it (the shipped synthetic one)."""
LARGE_KV_TOKENS = 262144
"""KV per worker for the real traces (Mooncake's longest prompt is 126K tokens, WEKA's are capped at 131 072)."""
SYSTEM = "You are a helpful assistant."
_NAMESPACE_BITS = 40
"""A WEKA conversation's hash id h becomes namespace << 40 | h (its own ids stay below 2**39; the tail blocks
of partial prompts take the ids from 2**39 up)."""


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


def _int(doc: dict[str, Any], key: str, minimum: int) -> int:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{key} must be an integer, got {v!r}" if key in doc else f"missing {key}")
    if v < minimum:
        raise ValueError(f"{key} must be >= {minimum}, got {v}")
    return v


def _line(doc: Any, number: int, block_tokens: int) -> Line:
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
    ts = doc.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"timestamp must be a number of milliseconds >= 0, got {ts!r}"
                         if "timestamp" in doc else "missing timestamp")
    input_length = _int(doc, "input_length", 1)
    output_length = _int(doc, "output_length", 0)
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


@dataclass(frozen=True, slots=True)
class Trace:
    """A trace read from disk, in either format, as lines sorted by arrival."""

    format: str
    """"mooncake" or "weka"."""
    lines: list[Line]
    block_tokens: int
    conversations: int = 0
    """WEKA: conversations (files) read; 0 for Mooncake."""


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
        n_in, n_out = _int(r, "in", 1), _int(r, "out", 0)
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


def _weka_files(path: Path) -> list[Path]:
    files = sorted(p for p in path.glob("*.json") if p.is_file())
    if not files:
        raise TraceError(f"{path}: no WEKA trace files (*.json) in the directory")
    return files


def read(path: str | Path, *, block_tokens: int = BLOCK_TOKENS, max_idle_s: float = MAX_IDLE_S,
         conversation_gap_s: float = CONVERSATION_GAP_S) -> Trace:
    """A trace in either format, told apart by content: a directory holds WEKA files (`*.json`); a file that is
    one JSON object with a `requests` list is a WEKA conversation; anything else is read as Mooncake JSON Lines
    (of `block_tokens`-token blocks). The lines are sorted by arrival."""
    path = Path(path)
    if path.is_dir():
        docs = []
        for f in _weka_files(path):
            try:
                docs.append((str(f), orjson.loads(f.read_bytes())))
            except (OSError, orjson.JSONDecodeError) as exc:
                raise TraceError(f"{f}: cannot read the trace: {exc}") from None
        lines, bs = weka_lines(docs, max_idle_s=max_idle_s, conversation_gap_s=conversation_gap_s)
        return Trace("weka", lines, bs, len(docs))
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc}") from None
    if text.lstrip().startswith("{"):
        try:
            doc = orjson.loads(text)
        except orjson.JSONDecodeError:
            doc = None  # JSON Lines: several objects
        if isinstance(doc, dict) and "requests" in doc:
            lines, bs = weka_lines([(str(path), doc)], max_idle_s=max_idle_s,
                                   conversation_gap_s=conversation_gap_s)
            return Trace("weka", lines, bs, 1)
    lines = parse(text.splitlines(), str(path), block_tokens)
    return Trace("mooncake", sorted(lines, key=lambda ln: ln.timestamp_ms), block_tokens)


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


def default_kv_tokens(longest_prompt: int, max_tokens: int = MAX_TOKENS) -> int:
    """KV per worker a trace's fleet is given by default: 16 384 tokens when its longest prompt (plus the system
    prompt, the chat template and the answer) fits one worker's pool (the shipped synthetic trace), else 262 144
    (the real ones, whose prompts are cut to 131 072 tokens by default), or the next power of two that holds the
    longest (a larger --max-input)."""
    need = longest_prompt + words(SYSTEM) + max_tokens + 64
    if need <= SMALL_KV_TOKENS:
        return SMALL_KV_TOKENS
    return max(LARGE_KV_TOKENS, 1 << (need - 1).bit_length())


def _prompt(ln: Line, block_tokens: int, _turn: int) -> str:
    return prompt_text(ln, block_tokens)


def workload(path: str | Path, *, seed: int, requests: int | None = None, rate: float | None = None,
             duration_s: float | None = None, time_scale: float = 1.0, block_tokens: int = BLOCK_TOKENS,
             max_tokens: int = MAX_TOKENS, workers: int | None = None, kv_tokens: int | None = None,
             trace_start_s: float = 0.0, trace_seconds: float | None = None, max_input: int = MAX_INPUT,
             max_idle_s: float = MAX_IDLE_S, conversation_gap_s: float = CONVERSATION_GAP_S) -> Workload:
    """The trace (either format, `read`) as a workload: the window of lines arriving from `trace_start_s` for
    `trace_seconds` (trace time, from the trace's first arrival), of those the first `requests` (all by
    default), each cut to `max_input` tokens; their gaps multiplied by `time_scale`, or rescaled so they arrive
    at `rate` per second on average if given (which overrides `time_scale`), and only the lines that then
    arrive before `duration_s`. `max_tokens` caps each line's output_length. Each prompt is built when sent.

    The fleet it is designed for: `workers` (8) of `kv_tokens` per worker (`default_kv_tokens` of the longest
    prompt replayed: 16 384 for the shipped synthetic trace, 262 144 for the real ones), with the workers'
    context length the whole pool so the longest prompts are accepted; a line longer than that is refused by
    the workers and counted as an error."""
    if time_scale <= 0 or (rate is not None and rate <= 0) or max_input < 1 or trace_start_s < 0 \
            or (trace_seconds is not None and trace_seconds <= 0):
        raise TraceError("time_scale, rate, max_input and trace_seconds must be positive, trace_start_s >= 0")
    tr = read(path, block_tokens=block_tokens, max_idle_s=max_idle_s, conversation_gap_s=conversation_gap_s)
    block_tokens = tr.block_tokens
    lines = window(tr.lines, trace_start_s, trace_seconds)
    if not lines:
        raise TraceError(f"{path}: no request in the window of {trace_seconds} s from {trace_start_s} s "
                         f"(the trace spans {(tr.lines[-1].timestamp_ms - tr.lines[0].timestamp_ms) / 1000:.0f} s)")
    if requests:
        lines = lines[:requests]
    cut = sum(ln.input_length > max_input for ln in lines)
    lines = [cap(ln, max_input, block_tokens) for ln in lines]
    t0 = lines[0].timestamp_ms
    span = (lines[-1].timestamp_ms - t0) / 1000.0
    if rate and len(lines) > 1 and span > 0:
        time_scale = (len(lines) - 1) / (span * rate)
    starts = [(ln.timestamp_ms - t0) / 1000.0 * time_scale for ln in lines]
    if duration_s is not None:
        lines = [ln for ln, s in zip(lines, starts, strict=True) if s < duration_s]
        starts = starts[:len(lines)]
    sessions = tuple(Session(i, starts[i], SYSTEM,
                             LazyTurns(functools.partial(_prompt, ln, block_tokens), 1, (str(path), ln),
                                       prepare=functools.partial(warm, ln, block_tokens)),
                             max(1, min(ln.output_length, max_tokens)), affinity=ln.session_id)
                     for i, ln in enumerate(lines))
    replay_s = starts[-1] if starts else 0.0
    longest = max((ln.input_length for ln in lines), default=0)
    kv = kv_tokens or default_kv_tokens(longest, max_tokens)
    extra: dict[str, Any] = {}
    if tr.format == "weka":
        extra = {"conversations": len({ln.session_id for ln in lines}), "max_idle_s": max_idle_s,
                 "conversation_gap_s": conversation_gap_s}
    return Workload("trace", sessions, {
        "trace": str(path), "format": tr.format, "trace_lines": len(tr.lines), "requests": len(sessions),
        "seed": seed, "trace_start_s": trace_start_s, "trace_seconds": trace_seconds,
        "rate": round((len(sessions) - 1) / replay_s, 2) if replay_s > 0 else None,
        "replay_s": round(replay_s, 1), "time_scale": round(time_scale, 6), "block_tokens": block_tokens,
        "max_tokens": max_tokens, "max_input": max_input, "cut_to_max_input": cut, **extra,
        "sessions": len({ln.session_id for ln in lines if ln.session_id is not None}),
        "longest_prompt_tokens": longest,
        "working_set_tokens": distinct_tokens(lines, block_tokens) + words(SYSTEM),
        "prompt_tokens": sum(ln.input_length + words(SYSTEM) for ln in lines)},
        workers=workers or WORKERS, kv_tokens=kv, max_model_len=kv)


def same_fleet(windows: list[Workload]) -> list[Workload]:
    """Several windows of one trace (the seeds of a cell) on one fleet: the largest KV pool (and context length)
    any of them is designed for, given to each."""
    kv = max(w.kv_tokens or 0 for w in windows)
    if all(w.kv_tokens == kv for w in windows):
        return windows
    return [dataclasses.replace(w, kv_tokens=kv, max_model_len=kv) for w in windows]


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def generate(*, seed: int, sessions: int = 100, duration_s: float = 90.0, block_tokens: int = BLOCK_TOKENS,
             prefixes: int = 8, prefix_blocks: tuple[int, int] = (1, 4), no_prefix_share: float = 0.2,
             max_turns: int = 6, think_s: float = 6.0, first_median: int = 1200, turn_median: int = 300,
             output_median: int = 100, max_input: int = 10240) -> list[dict[str, Any]]:
    """A small synthetic trace: conversations that share hash-id prefixes, as Mooncake's do.

    `prefixes` shared system prompts of `prefix_blocks` whole blocks, Zipf-popular (weight 1 / rank); a share
    `no_prefix_share` of conversations has none. A conversation starts at a uniform time in the first 80 % of
    `duration_s` and has 1 to `max_turns` turns (fewer more likely), `think_s` seconds apart on average
    (exponential). Its first prompt adds a log-normal number of tokens (median `first_median`) to its system
    prompt; each later turn re-sends the whole context plus the last answer (its output_length) and a new
    message (median `turn_median`), so its hash ids extend the last turn's full blocks; the last, partial block
    gets a fresh id each turn, as a hash of different content would. Outputs are log-normal (median
    `output_median`). A conversation ends before its prompt would exceed `max_input` tokens; lines arriving
    after `duration_s` are dropped.

    The defaults are scaled to 8 simulated workers of 16 384 KV tokens: about 230 lines over 90 s (~2.7 per
    second, ~9 000 prompt tokens a second: the benchmark's oracle, which has every worker tokenize every
    prompt, fell behind at twice that on the 2-core machine), prompts of ~300 to 10 240 tokens (median ~2 700,
    mean ~3 100; a worker holds three of the longest), a working set of ~2 x the fleet's KV. From empty caches
    no router can hit more than ~0.6 of the prompt tokens (what the trace repeats)."""
    rng = random.Random(seed)
    ids = itertools.count()
    shared = [[next(ids) for _ in range(rng.randint(*prefix_blocks))] for _ in range(prefixes)]
    cum = list(itertools.accumulate(1.0 / (k + 1) for k in range(prefixes)))
    turn_weights = [1.0 / (k + 1) for k in range(max_turns)]
    out: list[dict[str, Any]] = []
    for n in range(sessions):
        t = rng.uniform(0.0, 0.8 * duration_s)
        full = [] if rng.random() < no_prefix_share else list(shared[rng.choices(range(prefixes), cum_weights=cum)[0]])
        length = len(full) * block_tokens
        turns = rng.choices(range(1, max_turns + 1), weights=turn_weights)[0]
        last_output = 0
        for turn in range(turns):
            new = (_lognormal(rng, first_median, 0.8, 64, max_input) if turn == 0
                   else last_output + _lognormal(rng, turn_median, 0.7, 16, max_input))
            output = _lognormal(rng, output_median, 0.8, 4, 1024)
            if turn:
                t += rng.expovariate(1.0 / think_s)
            if length + new > max_input or t >= duration_s:
                break
            length += new
            whole = length // block_tokens
            full.extend(next(ids) for _ in range(whole - len(full)))
            hash_ids = full[:whole] + ([next(ids)] if length % block_tokens else [])
            out.append({"timestamp": round(t * 1000), "input_length": length, "output_length": output,
                        "hash_ids": hash_ids, "session_id": f"s{n}"})
            last_output = output
    out.sort(key=lambda d: d["timestamp"])
    return out


def info(lines: list[Line], block_tokens: int = BLOCK_TOKENS) -> dict[str, Any]:
    span = (max(ln.timestamp_ms for ln in lines) - min(ln.timestamp_ms for ln in lines)) / 1000.0
    lengths = sorted(ln.input_length for ln in lines)
    return {"lines": len(lines), "span_s": round(span, 1),
            "rate": round((len(lines) - 1) / span, 2) if span > 0 else None,
            "sessions": len({ln.session_id for ln in lines if ln.session_id is not None}),
            "input_length": {"min": lengths[0], "p50": lengths[len(lengths) // 2], "max": lengths[-1],
                             "mean": round(sum(lengths) / len(lengths))},
            "output_length_mean": round(sum(ln.output_length for ln in lines) / len(lines)),
            "distinct_blocks": len({h for ln in lines for h in ln.hash_ids}),
            "working_set_tokens": distinct_tokens(lines, block_tokens)}


def _window_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS,
                   help="tokens per hash id of a Mooncake trace (default %(default)s; WEKA files state theirs)")
    p.add_argument("--trace-start", type=float, default=0.0, metavar="SECONDS",
                   help="skip the lines arriving before this offset from the first (default 0)")
    p.add_argument("--trace-seconds", type=float, default=None, metavar="SECONDS",
                   help="only the lines arriving within this many seconds from --trace-start (default: all)")
    p.add_argument("--max-input", type=int, default=MAX_INPUT, metavar="TOKENS",
                   help="cut longer prompts to their first blocks (default %(default)s)")
    p.add_argument("--max-idle", type=float, default=MAX_IDLE_S, metavar="SECONDS",
                   help="WEKA: cut longer pauses within a conversation to this (default %(default)s; inf: none)")
    p.add_argument("--conversation-gap", type=float, default=CONVERSATION_GAP_S, metavar="SECONDS",
                   help="WEKA: seconds between the starts of consecutive conversations (default %(default)s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cortexbench.trace", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="write a small synthetic Mooncake-format trace")
    g.add_argument("--out", required=True, help="JSONL file to write")
    g.add_argument("--seed", type=int, default=1)
    g.add_argument("--sessions", type=int, default=100, help="conversations (default %(default)s)")
    g.add_argument("--duration", type=float, default=90.0, help="seconds of arrivals (default %(default)s)")
    g.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS, help="tokens per hash id (default %(default)s)")
    g.add_argument("--prefixes", type=int, default=8, help="shared system prompts (default %(default)s)")
    g.add_argument("--max-turns", type=int, default=6, help="turns per conversation at most (default %(default)s)")
    g.add_argument("--max-input", type=int, default=10240, help="longest prompt in tokens (default %(default)s)")
    i = sub.add_parser("info", help="check a trace (Mooncake JSONL, a WEKA file or directory) and print its size, "
                                    "or a window's")
    i.add_argument("path")
    _window_args(i)
    args = p.parse_args(argv)
    if args.cmd == "generate":
        rows = generate(seed=args.seed, sessions=args.sessions, duration_s=args.duration,
                        block_tokens=args.block_tokens, prefixes=args.prefixes, max_turns=args.max_turns,
                        max_input=args.max_input)
        Path(args.out).write_text("".join(json.dumps(r, separators=(", ", ": ")) + "\n" for r in rows))
        print(json.dumps(info(parse((json.dumps(r) for r in rows), args.out, args.block_tokens), args.block_tokens)))
        return 0
    try:
        tr = read(args.path, block_tokens=args.block_tokens, max_idle_s=args.max_idle,
                  conversation_gap_s=args.conversation_gap)
        lines = window(tr.lines, args.trace_start, args.trace_seconds)
        if not lines:
            raise TraceError(f"{args.path}: no request in that window")
        cut = sum(ln.input_length > args.max_input for ln in lines)
        lines = [cap(ln, args.max_input, tr.block_tokens) for ln in lines]
        out: dict[str, Any] = {"format": tr.format, "block_tokens": tr.block_tokens, "trace_lines": len(tr.lines)}
        if tr.format == "weka":
            out["conversations"] = tr.conversations
        if args.trace_start or args.trace_seconds is not None:
            out["window"] = {"start_s": args.trace_start, "seconds": args.trace_seconds}
        out.update(info(lines, tr.block_tokens))
        longest = max(ln.input_length for ln in lines)
        out["cut_to_max_input"] = cut
        out["default_fleet"] = {"workers": WORKERS, "kv_tokens_per_worker": default_kv_tokens(longest)}
        print(json.dumps(out))
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
