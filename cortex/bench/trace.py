"""Replay a Mooncake-format request trace, and generate small ones.

A trace is JSON Lines, one request per line, as published by Mooncake (FAST'25) and replayed by Dynamo:

    {"timestamp": 27482, "input_length": 1500, "output_length": 52, "hash_ids": [46, 47, 48]}

`timestamp` is the arrival in milliseconds, `input_length` and `output_length` are tokens, and `hash_ids` name the
prompt's blocks of `block_tokens` tokens (512 in Mooncake's traces) in order: two requests whose lists start with
the same ids share that prefix. An optional `session_id` (string or integer) ties the turns of one
conversation together. Other keys are ignored.

The replay does what Dynamo's does: each hash id becomes a deterministic block of text, `block_tokens` words
drawn from the benchmark's vocabulary (each word one Qwen2.5 token, so words = tokens), the same text for the same
id in every line, run and process; a prompt is the blocks of its hash ids concatenated and cut to
`input_length` words, sent as the user message after a short fixed system prompt; `output_length` becomes
`max_tokens`, capped (64 by default: decode time is not what a routing benchmark measures, and an uncapped
trace would take minutes); each line arrives at its timestamp after the first (optionally time-scaled), as a
session of one turn whose affinity key is its `session_id`. The trace is the workload: the seed changes
nothing in it.

    python -m cortex.bench.trace generate --out perf/traces/mooncake-small.jsonl --seed 1
    python -m cortex.bench.trace info perf/traces/mooncake-small.jsonl
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import random
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cortex.bench.workloads import WORDS, Session, Workload, words

BLOCK_TOKENS = 512
MAX_TOKENS = 64
SYSTEM = "You are a helpful assistant."


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
    try:
        with open(path, encoding="utf-8") as f:
            return parse(f, str(path), block_tokens)
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc}") from None


@functools.lru_cache(maxsize=8192)
def block_words(hash_id: int, block_tokens: int = BLOCK_TOKENS) -> tuple[str, ...]:
    """The text of one block: the same words for the same id everywhere (a string seed is hashed with SHA-512,
    independent of PYTHONHASHSEED)."""
    rng = random.Random(f"mooncake-block-{hash_id}")
    return tuple(rng.choice(WORDS) for _ in range(block_tokens))


def prompt_text(line: Line, block_tokens: int = BLOCK_TOKENS) -> str:
    """The prompt of one line: its blocks' words, cut to input_length words."""
    need = line.input_length
    out: list[str] = []
    for h in line.hash_ids:
        out.extend(block_words(h, block_tokens)[:need - len(out)])
        if len(out) >= need:
            break
    return " ".join(out)


def distinct_tokens(lines: Iterable[Line], block_tokens: int = BLOCK_TOKENS) -> int:
    """Distinct prompt tokens of a trace: each block once, as far as any line uses it."""
    used: dict[int, int] = {}
    for ln in lines:
        for k, h in enumerate(ln.hash_ids):
            n = min(block_tokens, ln.input_length - k * block_tokens)
            if n <= 0:
                break
            used[h] = max(used.get(h, 0), n)
    return sum(used.values())


def workload(path: str | Path, *, seed: int, requests: int | None = None, rate: float | None = None,
             duration_s: float | None = None, time_scale: float = 1.0, block_tokens: int = BLOCK_TOKENS,
             max_tokens: int = MAX_TOKENS, workers: int = 8, kv_tokens: int = 16384) -> Workload:
    """The trace as a workload: the first `requests` lines by arrival (all by default), their gaps multiplied by
    `time_scale`, or rescaled so they arrive at `rate` per second on average if given, and only the lines that
    arrive before `duration_s`. `max_tokens` caps each line's output_length.

    Designed for 8 workers of 16 384 KV tokens (32 Mooncake blocks each), the fleet the generator scales its
    traces to; a line longer than a worker's KV is refused by the workers and counted as an error."""
    lines = sorted(load(path, block_tokens), key=lambda ln: ln.timestamp_ms)
    total = len(lines)
    if requests:
        lines = lines[:requests]
    t0 = lines[0].timestamp_ms
    span = (lines[-1].timestamp_ms - t0) / 1000.0
    if rate and len(lines) > 1 and span > 0:
        time_scale = (len(lines) - 1) / (span * rate)
    starts = [(ln.timestamp_ms - t0) / 1000.0 * time_scale for ln in lines]
    if duration_s is not None:
        lines = [ln for ln, s in zip(lines, starts, strict=True) if s < duration_s]
        starts = starts[:len(lines)]
    sessions = tuple(Session(i, starts[i], SYSTEM, (prompt_text(ln, block_tokens),),
                             max(1, min(ln.output_length, max_tokens)), affinity=ln.session_id)
                     for i, ln in enumerate(lines))
    replay_s = starts[-1] if starts else 0.0
    return Workload("trace", sessions, {
        "trace": str(path), "trace_lines": total, "requests": len(sessions), "seed": seed,
        "rate": round((len(sessions) - 1) / replay_s, 2) if replay_s > 0 else None,
        "replay_s": round(replay_s, 1), "time_scale": round(time_scale, 4), "block_tokens": block_tokens,
        "max_tokens": max_tokens, "sessions": len({ln.session_id for ln in lines if ln.session_id is not None}),
        "working_set_tokens": distinct_tokens(lines, block_tokens) + words(SYSTEM),
        "prompt_tokens": sum(ln.input_length + words(SYSTEM) for ln in lines)},
        workers=workers, kv_tokens=kv_tokens)


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cortex.bench.trace", description=__doc__.split("\n\n")[0])
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
    i = sub.add_parser("info", help="check a trace and print its size")
    i.add_argument("path")
    i.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS)
    args = p.parse_args(argv)
    if args.cmd == "generate":
        rows = generate(seed=args.seed, sessions=args.sessions, duration_s=args.duration,
                        block_tokens=args.block_tokens, prefixes=args.prefixes, max_turns=args.max_turns,
                        max_input=args.max_input)
        Path(args.out).write_text("".join(json.dumps(r, separators=(", ", ": ")) + "\n" for r in rows))
        print(json.dumps(info(parse((json.dumps(r) for r in rows), args.out, args.block_tokens), args.block_tokens)))
        return 0
    try:
        print(json.dumps(info(load(args.path, args.block_tokens), args.block_tokens)))
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
