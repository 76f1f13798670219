"""The time model through the real stack (Envoy, extproc, ingest, observe, two simulated vLLM workers): one
worker prefills ten times slower than the model assumes; Cortex must learn that from the TTFTs its observer
sees (cortex/calibration.py) and stop sending it work it would serve slowly. Assertions are on what was
learned and decided, never on how fast anything was."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import MODEL, Gateway, Sim, free_ports, long_chat, serving, wait_for

pytestmark = pytest.mark.timeout(300)

SLOW = "sim-2"


def stream_chat(gw: Gateway, messages: list[dict[str, str]]) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{gw.url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for _ in r.iter_lines():
            pass
        return r.headers["x-cortex-assigned-worker"]


def explain(gw: Gateway, messages: list[dict[str, str]]) -> dict[str, Any]:
    r = httpx.post(gw.explain_url, json={"model": MODEL, "messages": messages}, headers=gw.admin_headers,
                   timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_slow_worker_learns_its_own_rate_and_loses_the_work(tmp_path: Path) -> None:
    ports = free_ports(8)
    sims = [Sim(id="sim-1", port=ports[0], kv_port=ports[1]),
            Sim(id=SLOW, port=ports[2], kv_port=ports[3], args=("--prefill-ms-per-token", "0.5"))]
    gw = Gateway(root=tmp_path, sims=sims, port=ports[4], admin_port=ports[5], ingest_port=ports[6],
                 extproc_port=ports[7], extra_config={"scheduler": {"cold_start_s": 0}})
    with serving(gw):
        # Pairs of distinct ~1 300-token prompts at once: the second of a pair finds the first's prefill queued
        # on its worker and goes to the other, so both workers serve and both are observed.
        with ThreadPoolExecutor(2) as pool:
            for k in range(12):
                list(pool.map(lambda s: stream_chat(gw, long_chat(1000, seed=s)), (2 * k, 2 * k + 1)))
        path = gw.root / "rt" / "calibration.json"
        doc = wait_for(lambda: (d := json.loads(path.read_text()))["factors"].get(SLOW) and d, timeout=30,
                       what="the observer's calibration of the slow worker")
        factors = doc["factors"]
        assert factors[SLOW] > 3 * factors.get("sim-1", 1.0), factors

        def learned() -> dict[str, Any] | None:
            d = explain(gw, long_chat(1000, seed=999))
            parts = {w["id"]: w["time_model"] for w in d["workers"]}
            return d if parts[SLOW]["calibration"] > 3 * parts["sim-1"]["calibration"] else None

        d = wait_for(learned, timeout=30, what="extproc reading the calibration")
        parts = {w["id"]: w["time_model"] for w in d["workers"]}
        assert d["chosen"] == "sim-1", d
        assert parts[SLOW]["predicted_ttft_ms"] > 3 * parts["sim-1"]["predicted_ttft_ms"], parts
        # Each candidate's `score` names the rule that placed it, with what it weighed.
        assert all(w["score"] == {"by": "ttft", **w["time_model"]} for w in d["workers"]), d["workers"]
        # Both idle, both cold: from now on the slow worker gets none of the new prompts sent one at a time.
        served = [stream_chat(gw, long_chat(1000, seed=500 + i)) for i in range(6)]
        assert served == ["sim-1"] * 6, served
