"""Added latency of one request through Cortex (Envoy + extproc) versus straight to the worker.

Starts two simulated vLLM workers and a gateway on loopback, warms the cache, then alternates identical
requests (max_tokens=1, not streamed) direct to the worker that holds the prompt and through the gateway,
which routes to that same worker. The difference of the two latency distributions is what Cortex adds.

    .venv/bin/python perf/added_latency.py [--requests 300] [--words 60,1500,6000] [--json-schema]
                                           [--validate-responses]

Bounded: a few hundred sequential requests per prompt size, loopback only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cortex import headers as H
from tests.harness import MODEL, cluster, long_chat

# A typical extraction schema: a dozen typed fields, an enum, a nested list.
SCHEMA = {"type": "object", "required": ["name", "date", "items"], "additionalProperties": False, "properties": {
    **{f: {"type": "string", "maxLength": 200} for f in ("name", "vendor", "city", "country", "currency", "note")},
    "date": {"type": "string", "format": "date"}, "total": {"type": "number", "minimum": 0},
    "status": {"enum": ["paid", "open", "void"]}, "paid": {"type": "boolean"},
    "items": {"type": "array", "maxItems": 50, "items": {"type": "object", "required": ["sku", "qty"], "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z0-9-]{3,20}$"}, "qty": {"type": "integer", "minimum": 1},
        "price": {"type": "number"}}}}}}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def measure(client: httpx.Client, url: str, body: dict[str, object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        r = client.post(url, json=body)
        out.append((time.perf_counter() - t) * 1000)
        assert r.status_code == 200, r.text
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--words", default="60,1500,6000", help="prompt sizes (words of filler) to test")
    ap.add_argument("--json-schema", action="store_true",
                    help="requests carry a response_format json_schema (checked by Cortex, cached after the first)")
    ap.add_argument("--validate-responses", action="store_true",
                    help="structured_output.validate_responses on (Envoy waits for the header answer; answers of "
                         "requests with a schema are buffered and checked)")
    args = ap.parse_args()
    rows = []
    extra = {"structured_output": {"validate_responses": True}} if args.validate_responses else None
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}}
    with tempfile.TemporaryDirectory() as tmp, cluster(Path(tmp), extra_config=extra) as gw, \
            httpx.Client(timeout=60) as client:
        for words in (int(w) for w in args.words.split(",")):
            body = {"model": MODEL, "messages": long_chat(words, seed=words), "max_tokens": 1,
                    **(fmt if args.json_schema else {})}
            r = client.post(f"{gw.url}/v1/chat/completions", json=body)
            holder = next(s for s in gw.sims if s.id == r.headers[H.ASSIGNED_WORKER])
            tokens = r.json()["usage"]["prompt_tokens"]
            measure(client, f"{holder.url}/v1/chat/completions", body, 20)  # warm both paths
            measure(client, f"{gw.url}/v1/chat/completions", body, 20)
            direct, via = [], []
            for _ in range(args.requests // 10):  # interleave so drift hits both sides alike
                direct += measure(client, f"{holder.url}/v1/chat/completions", body, 10)
                via += measure(client, f"{gw.url}/v1/chat/completions", body, 10)
            rows.append((tokens, direct, via))
    print(f"{'prompt tokens':>13} | {'direct p50':>10} {'p90':>7} {'p99':>7} | {'cortex p50':>10} {'p90':>7} "
          f"{'p99':>7} | {'added p50':>9} {'mean':>7}")
    for tokens, direct, via in rows:
        print(f"{tokens:>13} | {pct(direct, .5):>10.2f} {pct(direct, .9):>7.2f} {pct(direct, .99):>7.2f} | "
              f"{pct(via, .5):>10.2f} {pct(via, .9):>7.2f} {pct(via, .99):>7.2f} | "
              f"{pct(via, .5) - pct(direct, .5):>9.2f} {statistics.mean(via) - statistics.mean(direct):>7.2f}")
    print("(milliseconds, sequential requests, max_tokens=1, cache warm on the chosen worker)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
