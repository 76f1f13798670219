"""Timeouts and keepalives through the real Envoy and a simulated worker.

A long silent prefill is not a stalled stream: with a stream idle timeout far shorter than the worker's prefill,
requests complete. The negative control sets a routed idle timeout as short: the same request is then cut, which
shows the test can see a cut and that Cortex's route setting is what saves it. TCP keepalive is checked on the
kernel's own sockets.
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import orjson
import pytest

from tests.harness import MODEL, cluster, long_chat, wait_for

pytestmark = pytest.mark.timeout(240)

# ~800 prompt tokens at 4 ms each: a prefill of about 3 s that sends nothing, against idle timeouts of 1 s.
PREFILL = ("--prefill-ms-per-token", "4")
IDLE_S = 1.0


def ask(url: str, seed: int, stream: bool) -> tuple[int, dict | None]:
    """Status and usage of one request (usage None when the stream was cut before it ended)."""
    body = {"model": MODEL, "messages": long_chat(600, seed=seed), "max_tokens": 4}
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        return r.status_code, r.json().get("usage") if r.status_code == 200 else None
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    usage = None
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = orjson.loads(line[6:])
                    usage = chunk.get("usage") or usage
            return r.status_code, usage
    except httpx.HTTPError:  # a cut stream (reset mid-body)
        return 0, None


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_silent_prefill_longer_than_the_stream_idle_timeout_completes(tmp_path: Path, stream: bool) -> None:
    with cluster(tmp_path, n_sims=1, sim_args=PREFILL, extra_config={"timeouts": {"stream_idle_s": IDLE_S}}) as gw:
        for seed in (1, 2):  # a new prompt each time: nothing cached, the whole prefill runs
            status, usage = ask(gw.url, 900 + seed + 10 * stream, stream)
            assert status == 200 and usage is not None and usage["prompt_tokens"] > 700
            assert usage["prompt_tokens"] * 4 / 1000 > 2 * IDLE_S  # the prefill alone outlasted the timeout


def test_a_routed_idle_timeout_shorter_than_the_prefill_cuts_it(tmp_path: Path) -> None:
    cfg = {"timeouts": {"stream_idle_s": IDLE_S, "routed_idle_s": IDLE_S}}
    with cluster(tmp_path, n_sims=1, sim_args=PREFILL, extra_config=cfg) as gw:
        status, usage = ask(gw.url, 950, stream=False)
        assert status == 504 and usage is None


def keepalive_sockets(port: int) -> set[str]:
    """Which ends of the established loopback connections involving `port` have their keepalive timer armed
    (/proc/net/tcp: state 01, timer 02): 'server' for a socket whose local port is `port`, 'client' for one
    connected to it."""
    ends = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        local, remote, state, timer = int(f[1].split(":")[1], 16), int(f[2].split(":")[1], 16), f[3], f[5]
        if state == "01" and timer.startswith("02:"):
            if local == port:
                ends.add("server")
            elif remote == port:
                ends.add("client")
    return ends


def test_tcp_keepalive_on_client_and_worker_connections(tmp_path: Path) -> None:
    """While a request is in its silent prefill, Envoy's accepted client socket and its connection to the worker
    both run TCP keepalive (the kernel's own view, not the config's)."""
    with cluster(tmp_path, n_sims=1, sim_args=("--prefill-ms-per-token", "10")) as gw:
        (sim,) = gw.sims
        done = threading.Event()

        def slow() -> None:
            try:
                ask(gw.url, 980, stream=False)  # ~8 s of silent prefill
            finally:
                done.set()

        t = threading.Thread(target=slow, daemon=True)
        t.start()
        try:
            # Envoy's side of the client connection is the 'server' end of the gateway port; Envoy's connection to
            # the worker is the 'client' end of the worker port (httpx and the simulator set no keepalive).
            wait_for(lambda: "server" in keepalive_sockets(gw.port) and "client" in keepalive_sockets(sim.port),
                     timeout=8, interval=0.05, what="keepalive timers on both of Envoy's sockets")
        finally:
            t.join(timeout=60)
        assert done.is_set()
