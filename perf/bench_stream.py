"""What one ext_proc stream costs inside extproc, in process: ExtProc.process over real ProcessingRequest messages
(request headers, buffered body, response headers) on a router over a view file written as ingest would; no
Envoy, no gRPC. The same short chat each time (the view holds nothing, so routing is by load after the prompt's
first block), so the figure is the stream's own code plus one routing decision.

    .venv/bin/python perf/bench_stream.py [--streams 2000] [--rounds 5]

Prints the median over rounds of the mean µs per stream, and the machine's own cost per stream
(extproc/stream.py: five events fed) when it exists. Bounded: streams x rounds, one process, no sockets.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.test_stream_transport import MODEL, _app, _chat


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        app, writer = _app(Path(root))
        body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "how long is a stream?"}]})
        messages = _chat(body)

        async def one() -> None:
            async def feed() -> AsyncIterator[Any]:
                for m in messages:
                    yield m
            async for _ in app.process(feed(), None):
                pass

        async def rounds() -> list[float]:
            means = []
            for _ in range(args.rounds):
                writer.heartbeat()
                app.cluster.refresh()
                t0 = time.perf_counter()
                for _ in range(args.streams):
                    await one()
                means.append((time.perf_counter() - t0) / args.streams * 1e6)
            return means

        means = asyncio.run(rounds())
        print(f"stream through ExtProc.process: {statistics.median(means):.1f} µs/stream "
              f"(rounds: {', '.join(f'{m:.1f}' for m in means)})")
    try:
        from extproc import stream as s
    except ImportError:
        return 0
    limits = s.Limits(1 << 24, 5.0, 70)

    def machine_only() -> None:
        m: s.Stream[str] = s.Stream(limits)
        m.feed(s.RequestHeaders(s.Answer("h")))
        m.feed(s.RequestBody(b"{}"))
        m.feed(s.Decided(s.Answer("r")))
        m.feed(s.ResponseHeaders(s.Answer("h"), 0.0))
        m.feed(s.Closed())

    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        machine_only()
    print(f"the machine alone (5 events): {(time.perf_counter() - t0) / n * 1e6:.2f} µs/stream")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
