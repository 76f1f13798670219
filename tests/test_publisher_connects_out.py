"""An engine that publishes by connecting (vLLM with an event endpoint without '*') is named, not left silent.

vLLM binds its KV-event endpoint only when it has `*` or `::` in it (or is ipc:// / inproc://); any other address it
connects to, expecting the subscriber to bind (`ZmqEventPublisher._is_bind_endpoint`), while it always binds its
replay endpoint. Cortex connects to every worker and does not bind in its place (docs/engines.md, "Publishers that
connect"): a replica of an HA pair would get the events and the other none. What it does is diagnose: an event
endpoint that accepts no connection while the replay socket answers is such an engine, and /cortex/workers, the
readiness detail and the log say what to change. Driven by vLLM's own ZmqEventPublisher from the released wheel.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq.asyncio

from cortex.config import ConfigError, WorkerConfig
from ingest import silence, source
from ingest.hash_parity import ParityCheck
from ingest.ledger import Ledger
from ingest.source import EventSource
from ingest.sync import SourceSync
from tests.engine_wheels import PUBLISHER_FILES, PUBLISHER_STUBS, VLLM, extract
from tests.test_ledger import SetSink

# vLLM's publisher, as the engine builds it from --kv-events-config (nothing patched: its own bind-or-connect rule).
PUBLISHER = r'''
import sys
from vllm.distributed.kv_events import ZmqEventPublisher
pub = ZmqEventPublisher(0, endpoint=sys.argv[1], replay_endpoint=sys.argv[2])
print("ready", flush=True)
sys.stdin.read()
pub.shutdown()
'''


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def vllm_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    stubs = {k: v for k, v in PUBLISHER_STUBS.items() if k.startswith("vllm/")}
    return extract(tmp_path_factory.mktemp("vllm-src"), VLLM, PUBLISHER_FILES["vllm"], stubs)


async def _diagnose(endpoint: str, replay: str | None) -> tuple[EventSource, tuple[str, str] | None]:
    ctx = zmq.asyncio.Context()
    parity = ParityCheck(engine="vllm", page_size=16)
    events = EventSource("w0", Ledger(slot=0, engine="vllm", block_size=16, parity=parity), parity,
                         SourceSync(has_replay=replay is not None), ctx, SetSink(), endpoint=endpoint,
                         replay_endpoint=replay)
    task = asyncio.create_task(events.run())
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not events.link_up \
                and time.monotonic() - events.link_since < source.UNREACHABLE_S:
            await asyncio.sleep(0.05)
        events.check_link(time.monotonic())
        if events._diagnose_task is not None:
            await asyncio.wait_for(events._diagnose_task, 10)
        return events, events.diagnosis
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.destroy(linger=0)


def _publisher(src: Path, endpoint: str, replay: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER, endpoint, replay], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(src)})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _with_publisher(src: Path, engine_endpoint: str, port: int, replay: int) -> tuple[EventSource,
                                                                                    tuple[str, str] | None]:
    """Cortex's source at tcp://127.0.0.1:port beside vLLM's publisher configured with `engine_endpoint`."""
    proc = _publisher(src, engine_endpoint, f"tcp://*:{replay}")
    try:
        return asyncio.run(_diagnose(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}"))
    finally:
        proc.kill()
        proc.wait(30)


def test_an_engine_that_connects_out_is_diagnosed(vllm_src: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source, "UNREACHABLE_S", 0.3)
    port, replay = _port(), _port()
    # The operator's mistake: the worker's own address in the engine's config (it connects there, to nothing).
    events, got = _with_publisher(vllm_src, f"tcp://127.0.0.1:{port}", port, replay)
    assert not events.link_up and got is not None
    code, reason = got
    assert code == silence.CONNECTS_OUT
    assert f"tcp://*:{port}" in reason and "connecting out" in reason


def test_an_engine_that_binds_needs_no_diagnosis(vllm_src: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source, "UNREACHABLE_S", 0.3)
    port, replay = _port(), _port()
    events, got = _with_publisher(vllm_src, f"tcp://*:{port}", port, replay)
    assert events.link_up and got is None


def test_nothing_there_at_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source, "UNREACHABLE_S", 0.3)
    port, replay = _port(), _port()
    _, got = asyncio.run(_diagnose(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}"))
    assert got is not None and got[0] == silence.UNREACHABLE and "does not answer either" in got[1]
    _, got = asyncio.run(_diagnose(f"tcp://127.0.0.1:{port}", None))
    assert got is not None and got[0] == silence.UNREACHABLE and "without '*'" in got[1]


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://0.0.0.0:5557"])
def test_a_bind_address_in_cortexs_config_is_refused(endpoint: str) -> None:
    with pytest.raises((ConfigError, ValueError), match="bind address"):
        WorkerConfig(id="w", url="http://10.0.0.5:8000", model="m", kv_events=endpoint)
