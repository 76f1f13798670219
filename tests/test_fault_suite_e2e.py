"""The fault suite: the faults a production fleet throws, end to end through the real Envoy, ingest and
extproc in front of simulated vLLM workers.

Every case drives bounded concurrent traffic (a few client threads, a fixed request count, a deadline per
request; shared-prefix multi-turn chats, SSE and JSON) through the gateway while the fault happens, and
asserts with one checker (tests/faultkit.py `violation`):

(a) no request fails, except one in flight on a worker that was killed (its stream is cut; Envoy retries
    what had not started answering) or, for the Envoy case, one in flight between Envoy's death and its
    replacement listening;
(b) no response claims more cached tokens (`x-cortex-cache-hit-tokens`) than the engine itself reports
    (`usage.prompt_tokens_details.cached_tokens`).

One gateway (three workers with replay endpoints, two extproc processes) is shared by the cases; each case
puts the fleet back as it found it. docs/reliability.md describes each case.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.faultkit import Traffic, check, in_flight_during, killed_mid_flight, one_request
from tests.harness import (
    MODEL,
    Gateway,
    Sim,
    free_ports,
    free_run,
    long_chat,
    serving,
    start_sim,
    stop,
    wait_for,
)

pytestmark = pytest.mark.timeout(300)

SILENCE_BOUND_S = 2.0
"""ingest.event_silence_s for this gateway: the silent-publisher case waits it out (the default is 10 s)."""


@dataclass
class SuiteGateway(Gateway):
    ingest_extra: dict[str, Any] = field(default_factory=dict)

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg["ingest"] |= self.ingest_extra
        return cfg


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SuiteGateway]:
    root = tmp_path_factory.mktemp("suite")
    ports = free_ports(3 * 3 + 3)
    sims = [Sim(id=f"sim-{i + 1}", port=ports[3 * i], kv_port=ports[3 * i + 1], replay_port=ports[3 * i + 2])
            for i in range(3)]
    g = SuiteGateway(root=root, sims=sims, port=ports[9], admin_port=ports[10], ingest_port=ports[11],
                     extproc_port=free_run(2), extproc_processes=2,
                     ingest_extra={"event_silence_s": SILENCE_BOUND_S})
    with serving(g):
        yield g


def kill_sim(sim: Sim) -> float:
    assert sim.proc is not None
    os.killpg(sim.proc.pid, signal.SIGKILL)
    at = time.monotonic()
    sim.proc.wait(10)
    return at


def all_exact(gw: Gateway) -> bool:
    ids = {s.id for s in gw.sims}
    return all(t["exact_kv"] for t in gw.targets().values() if t["worker"] in ids)


def settle(gw: Gateway) -> None:
    """Back to the shared fleet's normal state: every worker healthy and on exact-KV routing."""
    wait_for(lambda: all_exact(gw) and all(w["healthy"] for w in gw.workers().values()), timeout=60,
             interval=0.2, what="fleet back to exact-KV routing")


def accepts(port: int) -> bool:
    """True once something listens on `port` (until then the connection raises, which wait_for retries)."""
    socket.create_connection(("127.0.0.1", port), timeout=1).close()
    return True


def test_worker_killed_mid_stream(gw: SuiteGateway) -> None:
    traffic = Traffic(gw.url, total=48, threads=4, stream_every=1, max_tokens=96, seed=1).start()
    streaming = wait_for(lambda: next((s for s in gw.sims if traffic.streaming_on(s.id)), None), timeout=60,
                         interval=0.01, what="a stream in flight")
    kills = {streaming.id: [kill_sim(streaming)]}
    try:
        outcomes = traffic.join(timeout=180)
    finally:
        start_sim(streaming, gw.root)  # same URL, empty cache: the fleet is whole again for the next case
    check(outcomes, killed_mid_flight(kills))
    cut = [o for o in outcomes if o.worker == streaming.id and not o.completed]
    assert cut, "the kill was meant to cut a stream in flight"
    settle(gw)


def test_worker_restarted_with_an_empty_cache(gw: SuiteGateway) -> None:
    messages = long_chat(900, seed=int(time.time()) % 10_000)
    with httpx.Client(timeout=60) as client:
        first = one_request(client, gw.url, 0, messages, stream=False)
        holder = next(s for s in gw.sims if s.id == first.worker)
        warm = wait_for(lambda: (lambda o: o if o.mode == "exact_kv_events" else None)(
            one_request(client, gw.url, 1, messages, stream=False)), timeout=30, interval=0.1, what="a cached repeat")
        assert warm.worker == holder.id and warm.claimed and warm.claimed == warm.cached
        traffic = Traffic(gw.url, total=40, threads=3, seed=2).start()
        traffic.wait_done(5)
        kills = {holder.id: [kill_sim(holder)]}
        start_sim(holder, gw.root)  # back at the same URL within a second or so, with an empty cache
        # The very first repeats after the restart: the old claims must already be gone (the ZMQ connection
        # dropped with the old process) or be no more than what the new engine reports.
        repeats = [one_request(client, gw.url, 100 + i, messages, stream=bool(i % 2)) for i in range(6)]
    outcomes = traffic.join(timeout=180)
    check(outcomes + repeats, killed_mid_flight(kills))
    for o in repeats:
        assert o.completed, o
        if o.worker == holder.id:
            assert o.cached is not None, o
            assert (o.claimed or 0) <= o.cached, o
    settle(gw)


@pytest.fixture
def extra_sim(gw: SuiteGateway) -> Iterator[Sim]:
    port, kv, replay = free_ports(3)
    sim = Sim(id="sim-extra", port=port, kv_port=kv, replay_port=replay)
    start_sim(sim, gw.root)
    yield sim
    httpx.delete(f"{gw.ingest_url}/cortex/workers/{sim.id}", timeout=10)
    stop(sim.proc)


def test_worker_added_and_removed_under_load(gw: SuiteGateway, extra_sim: Sim) -> None:
    traffic = Traffic(gw.url, total=60, threads=4, seed=3).start()
    traffic.wait_done(5)
    r = httpx.post(f"{gw.ingest_url}/cortex/workers", json=extra_sim.worker_config(), timeout=10)
    assert r.status_code == 201, r.text
    wait_for(lambda: gw.targets()["sim-extra"]["exact_kv"], timeout=30, what="new worker in sync")
    # A prompt the new worker alone holds: the gateway follows it there, claims checked.
    messages = long_chat(500, seed=int(time.time()) % 10_000 + 1)
    httpx.post(f"{extra_sim.url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2},
               timeout=30).raise_for_status()
    # Once the ledger lists it there (its events arrive under load), never before: until then it is a new
    # prompt, and the worker that computes it first holds it too.
    docs = []
    def listed() -> bool:
        docs.append(httpx.post(gw.explain_url, json={"model": MODEL, "messages": messages},
                               timeout=30).json())
        return docs[-1]["chosen"] == "sim-extra"
    try:
        wait_for(listed, timeout=30, what="ledger lists it")
    except TimeoutError:
        raise AssertionError((docs[-1], gw.targets()["sim-extra"])) from None
    tries = []
    with httpx.Client(timeout=60) as client:
        def routed_there() -> object:
            tries.append(one_request(client, gw.url, 200, messages, stream=False))
            return tries[-1] if tries[-1].worker == "sim-extra" else None
        try:
            landed = wait_for(routed_there, timeout=30, interval=0.2, what="a request routed to the new worker")
        except TimeoutError:
            raise AssertionError([(o.worker, o.mode, o.reason, o.claimed, o.cached) for o in tries[-3:]]) from None
    r = httpx.delete(f"{gw.ingest_url}/cortex/workers/sim-extra", timeout=10)
    assert r.status_code == 200, r.text
    removed_at = time.monotonic()
    outcomes = traffic.join(timeout=180)
    check([*outcomes, landed])  # nothing was killed: nothing may fail
    assert landed.claimed and landed.claimed <= landed.cached
    # Removal reaches extproc within its view upkeep (100-250 ms): nothing new is assigned to it after.
    late = [o for o in outcomes if o.worker == "sim-extra" and o.started > removed_at + 1.0]
    assert not late, late[:3]
    assert "sim-extra" not in gw.workers()


@pytest.mark.parametrize("variant", ["wrong_port", "wrong_topic"])
def test_silent_publisher_is_flagged_and_never_claimed(gw: SuiteGateway, variant: str) -> None:
    port, kv, wrong = free_ports(3)
    sim = Sim(id=f"sim-silent-{variant.replace('_', '-')}", port=port, kv_port=kv)
    start_sim(sim, gw.root)
    wid = sim.id
    cfg = sim.worker_config()
    if variant == "wrong_port":
        cfg["kv_events"] = f"tcp://127.0.0.1:{wrong}"  # nothing listens there (a typo, or a firewall)
    else:
        cfg["kv_topic"] = "kv@other"  # connects, but subscribes to a topic the engine never sends
    try:
        r = httpx.post(f"{gw.ingest_url}/cortex/workers", json=cfg, timeout=10)
        assert r.status_code == 201, r.text
        # It serves: a prompt computed on it directly (its counters move), then traffic through the gateway.
        messages = long_chat(400, seed=int(time.time()) % 10_000 + 2)
        httpx.post(f"{sim.url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2},
                   timeout=30).raise_for_status()
        traffic = Traffic(gw.url, total=30, threads=3, seed=4, prompts=10).start()
        worker = wait_for(lambda: (lambda w: w if w["events"] == "silent" else None)(gw.workers()[wid]),
                          timeout=30, interval=0.2, what="the silent publisher flagged")
        (target,) = worker["targets"]
        assert target["events"] == "silent" and not target["exact_kv"]
        assert ("not accepted a connection" if variant == "wrong_port" else "no KV-event batch") in \
            target["events_reason"]
        assert target["why"] == "events_silent" or target["why"].startswith("ledger_")
        metrics = httpx.get(f"{gw.ingest_url}/metrics", timeout=10).text
        assert f'cortex_target_events_silent{{target="{wid}",worker="{wid}"}} 1.0' in metrics
        assert 'cortex_target_events_silent{target="sim-1",worker="sim-1"} 0.0' in metrics
        wait_for(lambda: f"worker {wid} (target {wid}) publishes no KV events" in gw.log.read_text(),
                 timeout=10, what="the warning in the log")
        with httpx.Client(timeout=60) as client:
            direct = [one_request(client, gw.url, 300 + i, messages, stream=bool(i % 2)) for i in range(4)]
        outcomes = traffic.join(timeout=180)
    finally:
        httpx.delete(f"{gw.ingest_url}/cortex/workers/{wid}", timeout=10)
        stop(sim.proc)
    check(outcomes + direct)
    # Whatever reached it was routed by load: never a claimed hit on a worker whose events never arrive.
    on_it = [o for o in outcomes + direct if o.worker == wid]
    assert all(o.claimed == 0 and o.mode != "exact_kv_events" for o in on_it), on_it[:3]


@pytest.mark.parametrize("child", ["extproc", "ingest", "envoy"])
def test_gateway_process_killed_under_load(gw: SuiteGateway, child: str) -> None:
    needle = "envoy" if child == "envoy" else f"cortexctl.cli {child}"
    traffic = Traffic(gw.url, total=60, threads=4, seed=5 + len(child)).start()
    traffic.wait_done(8)
    pid = gw.child_pids(needle)[0]
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: [p for p in gw.child_pids(needle) if p != pid], timeout=30, what=f"{child} restarted")
    wait_for(lambda: accepts(gw.port), timeout=30, what="the gateway listening")
    back_at = time.monotonic()
    outcomes = traffic.join(timeout=180)
    # extproc and ingest: Envoy keeps serving (fail-open route, or by load while the ledger view is stale),
    # so nothing may fail. Envoy: every connection it held dies with it, so a request in flight at the kill
    # may fail, and so may one sent in the few milliseconds the dying process's listening socket still
    # completes handshakes, or on a keep-alive connection it held (the client sees a reset and cannot know
    # the request went nowhere). A refused connection is retried by the client, as a load balancer in front
    # of the gateway does. So: failures only within [kill, listening again]; every request after succeeds.
    check(outcomes, in_flight_during([(killed_at, back_at)]) if child == "envoy" else lambda o: False)
    if child == "envoy":
        # The requests after the new listener are the proof that the gateway is back; there must be some.
        assert sum(o.started > back_at for o in outcomes) >= 10, "traffic ended before Envoy came back"
    assert re.search(rf"{child}(-\d)? exited with code -9; restarting", gw.log.read_text())
    settle(gw)
    messages = long_chat(300, seed=int(time.time()) % 10_000 + 3)
    with httpx.Client(timeout=60) as client:
        one_request(client, gw.url, 400, messages, stream=False)
        back = wait_for(lambda: (lambda o: o if o.mode == "exact_kv_events" else None)(
            one_request(client, gw.url, 401, messages, stream=True)), timeout=40, interval=0.2,
            what="exact routing back")
    assert back.claimed and back.claimed <= back.cached


class HangingServer:
    """Accepts TCP connections on loopback and never answers (a wedged worker process)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                conn, _ = self.sock.accept()
                self.conns.append(conn)  # held open, never read, never answered

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for c in self.conns:
            c.close()
        self.sock.close()


def test_hanging_worker_added(gw: SuiteGateway) -> None:
    hang = HangingServer()
    kv = free_ports(1)[0]
    cfg = {"id": "sim-hang", "url": f"http://127.0.0.1:{hang.port}", "model": MODEL, "engine": "vllm",
           "kv_events": f"tcp://127.0.0.1:{kv}"}
    try:
        r = httpx.post(f"{gw.ingest_url}/cortex/workers", json=cfg, timeout=10)
        assert r.status_code == 201, r.text
        probe = {"model": MODEL, "messages": long_chat(50, seed=7)}
        wait_for(lambda: "sim-hang" in {w["id"] for w in httpx.post(
            gw.explain_url, json=probe, timeout=30).json()["workers"]}, timeout=30,
            what="extproc to see the hanging worker")
        # Requests take well under a second here; 20 s is far beyond any healthy answer, and short of
        # Envoy's 300 s idle timeout, which a request sent to the hanging worker would wait out.
        traffic = Traffic(gw.url, total=40, threads=4, seed=6, deadline_s=20.0).start()
        outcomes = traffic.join(timeout=240)
    finally:
        httpx.delete(f"{gw.ingest_url}/cortex/workers/sim-hang", timeout=10)
        hang.close()
    check(outcomes)
    assert not [o for o in outcomes if o.worker == "sim-hang"]
    # The healthy workers kept exact-KV routing for the prompts they hold.
    assert sum(o.mode == "exact_kv_events" for o in outcomes) >= len(outcomes) // 2
    settle(gw)

