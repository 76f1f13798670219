"""The waiting room through the real Envoy, with simulated workers (docs/tenancy/waiting-room.md).

Deterministic by construction: the fleet is filled with streams the test holds open on their own connections
(a streamed answer of thousands of slow tokens keeps its worker's slot until the test closes the connection), so
"every worker is full" is a state the test sets, not a race. Closing one held stream frees exactly one slot, and
the request it releases is itself held, so releases happen one at a time and their order is observable. Every
wait is for a condition, with a deadline; nothing asserts on speed.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from extproc.tenants import digest
from tests.harness import MODEL, Gateway, Sim, cluster, free_ports, start_sim, stop, wait_for

pytestmark = pytest.mark.timeout(300)

HIGH = 2
KEYS = {"a": "key-tenant-a", "b": "key-tenant-b", "vip": "key-tenant-vip"}
TENANTS = [{"id": "a", "api_keys": [digest(KEYS["a"])], "weight": 2.0},
           {"id": "b", "api_keys": [digest(KEYS["b"])], "weight": 1.0},
           {"id": "vip", "api_keys": [digest(KEYS["vip"])], "priority": 5}]
MAX_REQUESTS = 7


class Held:
    """One request on its own connection, left open: a streamed answer keeps its worker's slot until close()."""

    def __init__(self, gw: Gateway, tag: str, tenant: str | None = None, *, max_tokens: int = 2000,
                 stream: bool = True, pad: int = 0) -> None:
        self.tag = tag
        body = json.dumps({"model": MODEL, "max_tokens": max_tokens, "stream": stream,
                           "messages": [{"role": "user", "content": f"Request {tag}. {'pad ' * pad}"}]}).encode()
        auth = f"Authorization: Bearer {KEYS[tenant]}\r\n" if tenant else ""
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: cortex\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n{auth}\r\n").encode()
        self.sock = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
        self.sock.sendall(head + body)
        self.sock.settimeout(0.02)
        self.buf = b""
        self.sent_at = time.monotonic()
        self.answered_at: float | None = None
        self._status: int | None = None
        self.headers: dict[str, str] = {}

    def status(self) -> int | None:
        """The answer's status once its headers arrived (None: still waiting)."""
        if self._status is None and b"\r\n\r\n" not in self.buf:
            try:
                chunk = self.sock.recv(65536)
            except (TimeoutError, BlockingIOError):
                chunk = b""
            self.buf += chunk
        if self._status is None and b"\r\n\r\n" in self.buf:
            head = self.buf.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
            self._status = int(head[0].split()[1])
            self.headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in head[1:])}
            self.answered_at = time.monotonic()
        return self._status

    def body(self) -> dict[str, Any]:
        """The whole JSON body of a non-streamed answer (or an immediate one)."""
        self.sock.settimeout(10)
        length = int(self.headers["content-length"])
        rest = self.buf.split(b"\r\n\r\n", 1)[1]
        while len(rest) < length:
            rest += self.sock.recv(65536)
        return dict(json.loads(rest[:length]))

    def close(self) -> None:
        self.sock.close()


def metric(gw: Gateway, name: str) -> dict[str, float]:
    """Samples of one series from the gateway's /metrics (extproc's, summed over processes), by label text."""
    text = httpx.get(f"{gw.ingest_url}/metrics", timeout=10).text
    out = {}
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        out[m.group(1) or ""] = float(m.group(2))
    return out


def depth(gw: Gateway) -> int:
    return int(sum(metric(gw, "cortex_queue_depth").values()))


def wait_depth(gw: Gateway, n: int) -> None:
    wait_for(lambda: depth(gw) == n, timeout=30, interval=0.1, what=f"{n} requests waiting")


def hold_fleet(gw: Gateway, n: int) -> list[Held]:
    """n streams admitted and running (the fleet's capacity at the watermark)."""
    held = []
    for i in range(n):
        h = Held(gw, f"holder-{i}-{time.monotonic_ns()}")
        wait_for(lambda h=h: h.status() is not None, timeout=60, what="a holder admitted")
        assert h.status() == 200, h.buf[:500]
        held.append(h)
    return held


class PeakWatch:
    """Cortex's own in-flight count per target, the figure the watermark governs, sampled in a thread."""

    def __init__(self, gw: Gateway) -> None:
        self.board = gw.root / "rt" / "inflight" / "0.bin"
        self.peak = np.zeros(64, dtype=np.int64)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            np.maximum(self.peak, np.fromfile(self.board, dtype=np.int64, count=64), out=self.peak)
            time.sleep(0.001)

    def __enter__(self) -> PeakWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, transport: str) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("waiting-room")
    extra = {"scheduler": {"high_watermark": HIGH, "low_watermark": 1},
             "tenants": TENANTS,
             "admission": {"waiting_room": {"ttl_s": 120, "max_requests": MAX_REQUESTS, "max_bytes": 1 << 20}}}
    # 50 ms a token: a held stream of 2000 tokens outlasts the test by far.
    with cluster(root, n_sims=2, sim_args=("--decode-ms-per-token", "50"), extra_config=extra) as g:
        yield g


def dropped(h: Held, reason: str) -> None:
    assert h.status() == 503, h.buf[:500]
    assert h.headers["x-cortex-dropped-reason"] == reason
    assert h.headers["x-llm-d-request-dropped-reason"] == reason
    assert h.headers["retry-after"] == "1"
    err = h.body()["error"]
    assert err["code"] == 503 and err["type"] == "service_unavailable_error", err


def test_a_burst_waits_in_band_and_weighted_order_and_is_served_as_load_falls(gw: Gateway) -> None:
    with PeakWatch(gw) as watch:
        holders = hold_fleet(gw, 2 * HIGH)
        queued: list[Held] = []
        try:
            # Arrivals in a known order: a (weight 2) x4, b (weight 1) x2, then vip (priority 5).
            for tag, tenant in [("a1", "a"), ("a2", "a"), ("a3", "a"), ("a4", "a"), ("b1", "b"), ("b2", "b"),
                                ("vip1", "vip")]:
                queued.append(Held(gw, tag, tenant))
                wait_depth(gw, len(queued))
            assert all(h.status() is None for h in queued)  # every worker is full: they all wait
            # Past max_requests: the tenant holding the most is refused at once, while the others still wait.
            extra = Held(gw, "a5", "a")
            wait_for(lambda: extra.status() is not None, timeout=30, what="the refusal")
            dropped(extra, "queue_full")
            extra.close()
            assert depth(gw) == MAX_REQUESTS
            # A tenant holding two fewer makes a full room displace the largest holder's newest (a4).
            a4 = queued[3]
            b3 = Held(gw, "b3", "b")
            wait_for(lambda: a4.status() is not None, timeout=30, what="a4 displaced")
            dropped(a4, "queue_full")
            a4.close()
            queued[3] = b3
            assert depth(gw) == MAX_REQUESTS and b3.status() is None
            # Free one slot at a time: exactly one waiting request is released each time, and it holds the slot.
            order = []
            for step in range(len(queued)):
                holders.pop(0).close()
                wait_for(lambda step=step: sum(h.status() is not None for h in queued) > step,
                         timeout=30, what="one release")
                started = [h for h in queued if h.status() is not None and h.tag not in order]
                assert len(started) == 1, [h.tag for h in started]
                assert started[0].status() == 200, started[0].buf[:500]
                order.append(started[0].tag)
                holders.append(started[0])
            # The priority band first; then a serves two per turn to b's one; FIFO within each tenant.
            assert order == ["vip1", "a1", "a2", "b1", "a3", "b2", "b3"]
            wait_depth(gw, 0)
        finally:
            for h in holders + queued:
                h.close()
    slots = {t["id"]: t["slot"] for t in gw.targets().values()}
    peak = {wid: int(watch.peak[s]) for wid, s in slots.items()}
    assert max(peak.values()) <= HIGH, peak  # the room held the burst: no worker went past its watermark
    waits = metric(gw, "cortex_queue_wait_seconds_count")
    assert waits.get('{band="0"}', 0) >= 6 and waits.get('{band="5"}', 0) >= 1, waits
    rejected = metric(gw, "cortex_admission_rejections_total")
    assert rejected.get('{reason="queue_full",tenant="a"}', 0) >= 2, rejected


def test_a_burst_of_short_requests_waits_and_each_is_served_as_load_falls(gw: Gateway) -> None:
    wait_depth(gw, 0)
    with PeakWatch(gw) as watch:
        holders = hold_fleet(gw, 2 * HIGH)
        burst = [Held(gw, f"burst{i}", max_tokens=10, stream=False) for i in range(MAX_REQUESTS)]
        try:
            wait_depth(gw, MAX_REQUESTS)
            for h in holders:
                h.close()
            # Each answer frees a slot for the next: all of them are served, none is refused or dropped.
            for h in burst:
                wait_for(lambda h=h: h.status() is not None, timeout=60, what="an answer")
                assert h.status() == 200, h.buf[:500]
                assert h.body()["choices"][0]["message"]["content"]
            wait_depth(gw, 0)
        finally:
            for h in holders + burst:
                h.close()
    slots = {t["id"]: t["slot"] for t in gw.targets().values()}
    assert max(int(watch.peak[s]) for s in slots.values()) <= HIGH, watch.peak


def test_the_room_is_bounded_in_bytes_and_a_client_that_leaves_leaves_it(gw: Gateway) -> None:
    wait_depth(gw, 0)
    holders = hold_fleet(gw, 2 * HIGH)
    try:
        # ~400 KB bodies: two fit in the room's 1 MiB, a third does not (far below max_requests).
        big = []
        for i in range(2):
            big.append(Held(gw, f"big{i}", "a", pad=100_000))
            wait_for(lambda: depth(gw) == len(big) or big[-1].status() is not None, timeout=30,
                     what="the request waiting")
            assert big[-1].status() is None, big[-1].buf[:1000]
        third = Held(gw, "big2", "a", pad=100_000)
        wait_for(lambda: third.status() is not None, timeout=30, what="the refusal")
        dropped(third, "queue_full")
        third.close()
        # Another tenant's arrival displaces a's newest: the bytes bound holds, and a cannot fill the room.
        other = Held(gw, "big3", "b", pad=100_000)
        wait_for(lambda: big[1].status() is not None, timeout=30, what="big1 displaced")
        dropped(big[1], "queue_full")
        big[1].close()
        big[1] = other
        assert depth(gw) == 2
        # The clients give up: their requests leave the room (and never reach a worker).
        assert all(h.status() is None for h in big)
        for h in big:
            h.close()
        wait_depth(gw, 0)
    finally:
        for h in holders:
            h.close()


# -- scale from zero and the time-to-live --------------------------------------------------------------------

TTL = 8.0


@pytest.fixture(scope="module")
def empty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway whose model has no worker at all yet."""
    root = tmp_path_factory.mktemp("scale-from-zero")
    with cluster(root, n_sims=0, extra_config={"admission": {"waiting_room": {"ttl_s": TTL}}}) as g:
        yield g


def test_with_no_worker_a_request_waits_its_ttl_then_gets_503(empty: Gateway) -> None:
    h = Held(empty, "lonely", max_tokens=4, stream=False)
    try:
        wait_depth(empty, 1)
        wait_for(lambda: h.status() is not None, timeout=TTL + 30, what="the time-to-live")
        assert h.answered_at is not None and h.answered_at - h.sent_at >= TTL - 0.5  # held, not refused at once
        dropped(h, "queue_ttl")
        wait_depth(empty, 0)
        assert metric(empty, "cortex_admission_rejections_total").get('{reason="queue_ttl",tenant="default"}') == 1
    finally:
        h.close()


def test_a_request_waiting_for_a_model_with_no_worker_is_served_when_one_appears(empty: Gateway) -> None:
    port, kv = free_ports(2)
    sim = Sim(id="late", port=port, kv_port=kv)
    start_sim(sim, empty.root)  # up, but the gateway does not know it yet
    h = Held(empty, "early", max_tokens=4, stream=False)
    try:
        wait_depth(empty, 1)
        assert h.status() is None
        r = httpx.post(f"{empty.ingest_url}/cortex/workers", json=sim.worker_config(), timeout=10)
        assert r.status_code in (200, 201), r.text
        wait_for(lambda: h.status() is not None, timeout=TTL + 30, what="the answer")
        assert h.status() == 200, h.buf[:500]
        assert h.headers["x-cortex-assigned-worker"] == "late"
        assert h.body()["choices"][0]["message"]["content"]
        wait_depth(empty, 0)
    finally:
        h.close()
        stop(sim.proc)
