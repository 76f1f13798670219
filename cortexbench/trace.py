"""Replay request traces with prefix (block-hash) structure, and generate small ones.

Two formats, told apart by content (`read`), each read as the same lines (cortexbench/trace_lines.py, with the
windowing every replay applies): **Mooncake** (FAST'25) JSON Lines, one request per line
(cortexbench/trace_mooncake.py), and **WEKA agentic coding** (callanjfox/kv-cache-tester), one JSON object per
conversation, a directory of them or one file (cortexbench/trace_weka.py), read as Mooncake lines. A synthetic
Mooncake-format trace comes from cortexbench/trace_synthetic.py.

The replay does what Dynamo's does: each hash id becomes a deterministic block of text (cortexbench/trace_prompts.py),
`block_tokens` words drawn from the benchmark's vocabulary (each word one Qwen2.5 token, so words = tokens), the same
text for the same id in every line, run and process; a prompt is the blocks of its hash ids concatenated and cut to
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
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from cortexbench.sessions import LazyTurns, Session, Workload, words
from cortexbench.trace_lines import Line, TraceError, cap, window
from cortexbench.trace_mooncake import BLOCK_TOKENS, parse
from cortexbench.trace_prompts import distinct_tokens, prompt_text, warm
from cortexbench.trace_synthetic import generate
from cortexbench.trace_weka import CONVERSATION_GAP_S, MAX_IDLE_S, weka_files, weka_lines

MAX_TOKENS = 64
MAX_INPUT = 131072
"""Longest prompt replayed, in tokens: a longer line is cut to its first blocks (WEKA's reach 204K)."""
WORKERS = 8
SMALL_KV_TOKENS = 16384
"""KV per worker for a trace whose longest prompt fits it (the shipped synthetic one)."""
LARGE_KV_TOKENS = 262144
"""KV per worker for the real traces (Mooncake's longest prompt is 126K tokens, WEKA's are capped at 131 072)."""
SYSTEM = "You are a helpful assistant."


@dataclass(frozen=True, slots=True)
class Trace:
    """A trace read from disk, in either format, as lines sorted by arrival."""

    format: str
    """"mooncake" or "weka"."""
    lines: list[Line]
    block_tokens: int
    conversations: int = 0
    """WEKA: conversations (files) read; 0 for Mooncake."""


def read(path: str | Path, *, block_tokens: int = BLOCK_TOKENS, max_idle_s: float = MAX_IDLE_S,
         conversation_gap_s: float = CONVERSATION_GAP_S) -> Trace:
    """A trace in either format, told apart by content: a directory holds WEKA files (`*.json`); a file that is
    one JSON object with a `requests` list is a WEKA conversation; anything else is read as Mooncake JSON Lines
    (of `block_tokens`-token blocks). The lines are sorted by arrival."""
    path = Path(path)
    if path.is_dir():
        docs = []
        for f in weka_files(path):
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
