"""Inter-token latency: how the client measures it from a stream (a stub server streaming chunks), how the
figures carry it (percentiles across requests, each record's own), and where the tables show it. No timing is
asserted beyond what the stream's own order implies."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from cortexbench import client, metrics, report
from cortexbench.client import Record, RunResult


async def _stream(request: web.Request) -> web.StreamResponse:
    chunks = int(request.match_info["chunks"])
    resp = web.StreamResponse(headers={"content-type": "text/event-stream", "x-sim-worker": "w1"})
    await resp.prepare(request)
    for k in range(chunks):
        body = {"choices": [{"index": 0, "delta": {"content": f" t{k}"}}]}
        await resp.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        await asyncio.sleep(0.005)
    usage = {"choices": [], "usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 3}}}
    await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
    return resp


async def _one_with(chunks: int) -> tuple[Record, str]:
    """One request of `client.one` to a stub that streams `chunks` content chunks (the count in the path)."""
    app = web.Application()
    app.router.add_post("/{chunks}/v1/chat/completions", _stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    rec = Record(0, 0, 0.0)
    try:
        async with aiohttp.ClientSession() as http:
            text = await client.one(http, f"http://127.0.0.1:{port}/{chunks}", [{"role": "user", "content": "q"}],
                                    4, rec, 0.0)
    finally:
        await runner.cleanup()
    return rec, text


def test_client_measures_itl_between_content_chunks() -> None:
    rec, text = asyncio.run(_one_with(5))
    assert rec.error is None and text == " t0 t1 t2 t3 t4" and (rec.prompt_tokens, rec.cached_tokens) == (7, 3)
    assert rec.ttft is not None and rec.itl is not None and rec.e2e is not None
    assert rec.itl > 0 and rec.ttft + 4 * rec.itl <= rec.e2e + 1e-9  # four gaps after the first chunk, in the stream
    single, _ = asyncio.run(_one_with(1))
    assert single.error is None and single.ttft is not None and single.itl is None  # one chunk: no gap


def _rec(ttft: float | None, itl: float | None, error: str | None = None) -> Record:
    r = Record(0, 0, 0.0, ttft=ttft, e2e=None if ttft is None else ttft + 0.1, itl=itl, prompt_tokens=10,
               cached_tokens=5, worker="w", error=error)
    return r


def test_itl_percentiles_are_over_completed_requests_with_two_tokens_or_more() -> None:
    records = [_rec(0.1, 0.010), _rec(0.2, 0.020), _rec(0.3, 0.030), _rec(0.4, None), _rec(None, None, "boom"),
               _rec(0.5, 0.500, "cut")]
    s = metrics.summarize(RunResult(records, 2.0))
    assert s["itl_ms"] == {"p50": 20.0, "p90": 30.0, "p99": 30.0}
    assert s["ttft_ms"]["p50"] == 200.0 and s["errors"] == 2
    assert [r["itl_ms"] for r in metrics.records_json(records)] == [10.0, 20.0, 30.0, None, None, 500.0]


def _block(results: dict[str, Any]) -> dict[str, Any]:
    return {"params": {"requests": 3}, "results": results}


def test_tables_show_itl_beside_ttft_and_old_runs_read_as_dashes() -> None:
    r = metrics.summarize(RunResult([_rec(0.1, 0.010), _rec(0.2, 0.020), _rec(0.3, 0.030)], 1.0))
    r["gateway_cpu_ms_per_request"] = 1.0
    old = {k: v for k, v in r.items() if k != "itl_ms"}
    text = report.workload_table("x", _block({"new": r, "old": old, "gone": {"unavailable": "not installed"}}))
    head, rule, new_row, old_row, gone_row = text.strip().splitlines()[2:7]
    cols = [c.strip() for c in head.strip("|").split("|")]
    assert cols[6:8] == ["ITL p50", "ITL p90"] and len(cols) == 14 and rule.count("---") == 14
    cells = [c.strip() for c in new_row.strip("|").split("|")]
    assert cells[0] == "new" and cells[6:8] == ["20.0", "30.0"] and len(cells) == 14
    assert [c.strip() for c in old_row.strip("|").split("|")][6:8] == ["–", "–"]
    assert gone_row.count("|") == 15


def test_a_run_saved_before_blocks_named_their_workload_still_renders_its_goals() -> None:
    # docs/benchmarks.json predates the blocks' "workload" key: its goals are named by the table's key.
    # The best peer is another project's gateway: not round-robin, the oracle, or Cortex's old rule.
    r = {"hit_ratio": 0.5, "ttft_ms": {"p50": 1.0}}
    out = {"workloads": {"unique": {"results": {
        "cortex": r, "smg-cache-aware": {**r, "hit_ratio": 0.4, "ttft_ms": {"p50": 2.0}},
        "round-robin": {**r, "hit_ratio": 0.9}, "cortex-cache-aware": {**r, "hit_ratio": 0.9}}}}}
    rows = report.fleet_goals(out)
    assert [(g, ok) for g, _, ok in rows] == [
        ("unique, one gateway: hit ≥ 0.98 × the best peer (smg-cache-aware)", True),
        ("unique, one gateway: TTFT p50 ≤ the best peer's (smg-cache-aware)", True)]  # no p90 figure: no row


def test_issue_24_goals_take_the_best_peer_per_figure_at_one_and_four_replicas() -> None:
    def res(hit: float, p50: float, p90: float) -> dict[str, Any]:
        return {"hit_ratio": hit, "ttft_ms": {"p50": p50, "p90": p90}}

    results = {"cortex": res(0.50, 100.0, 300.0), "smg-cache-aware": res(0.52, 90.0, 400.0),
               "smg-prefix-hash": res(0.40, 120.0, 250.0), "round-robin": res(0.1, 50.0, 100.0)}
    out = {"workloads": {"trace (t), 4 replicas": {"workload": "trace (t)", "replicas": 4, "results": results},
                         "trace (t), 2 replicas": {"workload": "trace (t)", "replicas": 2, "results": results}}}
    rows = {g: ok for g, _, ok in report.fleet_goals(out)}
    assert rows == {"trace (t), 4 replicas: hit ≥ 0.98 × the best peer (smg-cache-aware)": False,  # 0.50 < 0.51
                    "trace (t), 4 replicas: TTFT p50 ≤ the best peer's (smg-cache-aware)": False,
                    "trace (t), 4 replicas: TTFT p90 ≤ the best peer's (smg-prefix-hash)": False}
