"""Workers from Kubernetes, end to end: a fake API server (tests/k8s_fake.py) announces simulated workers as pods,
and the real gateway (Envoy, ingest, extproc) routes to them with exact-KV matching; a DELETED pod stops getting
requests, a MODIFIED pod with a new IP is followed (Envoy's pool and the routing target move, and its new
engine's KV events are subscribed).

Each "pod" is a simulator bound to its own loopback address (127.0.0.2, .3, .4) on the same ports, as pods
share their container ports and differ by IP."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from cortexbench.launch import free_ports
from ingest import k8s_discovery as kd
from tests.harness import MODEL, Gateway, Sim, long_chat, start_gateway, start_sim, stop, wait_for
from tests.k8s_fake import FakeKube, pod

pytestmark = pytest.mark.timeout(300)


@dataclass
class PodSim(Sim):
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def served(sim: PodSim) -> float:
    """Requests the simulator completed (its own vllm:request_success counter)."""
    text = httpx.get(f"{sim.url}/metrics", timeout=5).text
    return sum(float(m) for m in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M))


def chat(gw: Gateway, messages: list[dict[str, str]]) -> tuple[httpx.Headers, dict[str, Any]]:
    r = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.headers, r.json()["usage"]


def exact_hit(gw: Gateway, messages: list[dict[str, str]]) -> str:
    """Send a prompt until its repeat is an exact-KV hit proven by the engine; returns the worker."""
    chat(gw, messages)

    def repeat() -> str | None:
        h, usage = chat(gw, messages)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        if h["x-cortex-match-mode"] == "exact_kv_events" and int(h["x-cortex-cache-hit-tokens"]) == cached > 0:
            return str(h["x-cortex-assigned-worker"])
        return None

    # The holder's events may still be on their way when the repeat arrives: ask again until they are in. A
    # repeat sent before them may land on the other worker, which then holds the prompt too: the proof is the
    # claim the engine confirms, wherever it is.
    worker: str = wait_for(repeat, timeout=20, interval=0.2, what="an exact-KV hit on the repeat")
    return worker


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[tuple[FakeKube, dict[str, PodSim]]]:
    port, kv_port = free_ports(2)
    sims = {host: PodSim(id=f"pod-{host.rsplit('.', 1)[1]}", port=port, kv_port=kv_port, host=host)
            for host in ("127.0.0.2", "127.0.0.3", "127.0.0.4")}
    fake = FakeKube().start()
    try:
        for s in sims.values():
            start_sim(s, tmp_path, "--host", s.host)
        yield fake, sims
    finally:
        for s in sims.values():
            stop(s.proc)
        fake.stop()


def test_gateway_routes_to_pods_the_api_server_announces(tmp_path: Path,
                                                        pods: tuple[FakeKube, dict[str, PodSim]]) -> None:
    fake, sims = pods
    a, b, c = sims["127.0.0.2"], sims["127.0.0.3"], sims["127.0.0.4"]
    notes = {kd.KV_EVENTS_PORT: str(a.kv_port)}
    fake.put(pod("vllm-a", a.host, annotations=notes))
    fake.put(pod("vllm-b", b.host, annotations=notes))
    fake.put(pod("vllm-c", None, ready=False, annotations=notes))  # scheduled, not started: no worker
    token = tmp_path / "token"
    token.write_text("sa-token")
    gw_port, admin, ingest, extproc = free_ports(4)
    gw = Gateway(root=tmp_path, sims=[], port=gw_port, admin_port=admin, ingest_port=ingest, extproc_port=extproc,
                 extra_config={"discovery": {"kubernetes": [{
                     "namespace": "ns", "api_server": fake.url, "token_file": str(token),
                     "selector": {"app": "sim"}, "target_port": a.port, "model": MODEL, "engine": "vllm"}]}})
    try:
        start_gateway(gw)
        wait_for(lambda: {t["id"]: (t["address"], t["exact_kv"]) for t in gw.targets().values()} == {
            "vllm-a": (f"{a.host}:{a.port}", True), "vllm-b": (f"{b.host}:{b.port}", True)},
                 timeout=60, what="both announced pods in sync")
        assert {w["source"] for w in gw.workers().values()} == {"k8s"}

        # Exact-KV routing to discovered workers: the repeat lands on the holder, a hit the engine confirms.
        messages = long_chat(800, seed=3)
        holder = exact_hit(gw, messages)
        sim_of = {"vllm-a": a, "vllm-b": b}
        other = next(w for w in sim_of if w != holder)

        # DELETED: the holder leaves; its prompt now goes to the other worker, and the deleted one gets nothing.
        fake.delete(holder)
        wait_for(lambda: set(gw.targets()) == {other}, what=f"{holder} removed")
        # extproc's view follows ingest's: wait until a decision no longer names the deleted worker.
        wait_for(lambda: httpx.post(gw.explain_url, json={"model": MODEL, "messages": long_chat(200, seed=3)},
                                    timeout=30).json()["order"] == [other], what="extproc's view without it")
        gone_before = served(sim_of[holder])
        for seed in (3, 4, 5):
            h, _ = chat(gw, long_chat(200, seed=seed))
            assert h["x-cortex-assigned-worker"] == other
        assert served(sim_of[holder]) == gone_before

        # MODIFIED with a new IP: the other pod now answers at c's address; its old engine is stopped, so a request
        # that reached the old address would fail. The new engine's events are followed: exact-KV again.
        fake.put(pod(other, c.host, annotations=notes))
        wait_for(lambda: {t["id"]: (t["address"], t["exact_kv"]) for t in gw.targets().values()} == {
            other: (f"{c.host}:{c.port}", True)}, timeout=60, what=f"{other} at its new address, in sync")
        stop(sim_of[other].proc)
        before = served(c)
        assert exact_hit(gw, long_chat(800, seed=9)) == other
        assert served(c) >= before + 2
    finally:
        stop(gw.proc)
