"""The engines' own KV-event publishers feeding the real gateway: a worker stays trusted across batches
(issue 11, defect 8).

The simulator runs with vLLM 0.33.0's or SGLang 0.5.23's own ``ZmqEventPublisher`` class (loaded from the
released wheel as in tests/sim/test_real_engine_decode.py, with a replay endpoint) in place of its own, so the
PUB socket, the replay ROUTER, the publisher thread's 100 ms poll and the sequence numbering are the engine's.
Requests through the real Envoy make the engine store blocks and, its pool being small, evict them: both
BlockStored and BlockRemoved batches. A sampler reads the target's state in ingest (`/cortex/workers`) and
the route explain of extproc continuously; once the first sync is done, not one sample may show the worker
untrusted (`exact_kv` false, state other than READY, or `matched_tokens: null`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from cortex.engine_hashes import VllmBlockHasher, vllm_wire_hash
from tests.engine_wheels import PUBLISHER_FILES, PUBLISHER_STUBS, SGLANG, VLLM, extract
from tests.harness import MODEL, Gateway, Sim, free_ports, long_chat, start_gateway, start_sim, stop, wait_for

pytestmark = pytest.mark.timeout(300)

SOURCES = {engine: (spec, PUBLISHER_FILES[engine],
                   {k: v for k, v in PUBLISHER_STUBS.items() if k.startswith(f"{engine}/")})
           for engine, spec in (("vllm", VLLM), ("sglang", SGLANG))}

# The simulator's server with the engine's publisher class swapped in (run as a child interpreter).
LAUNCHER = r'''
import sys, time, types
engine = sys.argv[1]
if engine == "vllm":
    from vllm.distributed.kv_events import ZmqEventPublisher as Real
    # vLLM binds only wildcard/ipc endpoints and connects to the rest; bind loopback instead of *.
    Real._is_bind_endpoint = staticmethod(lambda endpoint: True)
    extra = {}
else:
    try:
        import psutil  # noqa: F401  (imported by sglang's network.py, unused by the publisher)
    except ImportError:
        sys.modules["psutil"] = types.ModuleType("psutil")
    from sglang.srt.disaggregation.kv_events import ZmqEventPublisher as Real
    extra = {"bind": True}
import cortexsim.server as server


class EnginePublisher:
    """The simulator's publisher interface over the engine's class (publish, flush, close)."""

    def __init__(self, port, *, host, replay_port=None, topic="", buffer_steps=10_000, data_parallel_rank=0,
                 faults=None, context=None):  # the engine's class makes its own ZMQ context
        self.endpoint = f"tcp://{host}:{port}"
        self.replay_endpoint = None if replay_port is None else f"tcp://{host}:{replay_port}"
        self._pub = Real(data_parallel_rank, endpoint=self.endpoint, replay_endpoint=self.replay_endpoint,
                         topic=topic, buffer_steps=buffer_steps, **extra)

    def publish(self, batch):
        self._pub.publish(batch)

    def flush(self, timeout=None):
        deadline = time.monotonic() + (10.0 if timeout is None else timeout)
        while self._pub._event_queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._pub._event_queue.unfinished_tasks

    def close(self, timeout=5.0):
        self._pub.shutdown()

    def restart(self):
        raise RuntimeError("a restart is a new engine process here")


server.ZmqEventPublisher = EnginePublisher
from cortexsim.cli import main
sys.exit(main(sys.argv[2:]))
'''


@dataclass
class Samples:
    """What the sampler saw: every reading of the target in ingest and of its explain entry in extproc."""

    ingest: list[tuple[bool, str, str]] = field(default_factory=list)
    explain: list[tuple[Any, bool]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def untrusted(self) -> list[Any]:
        return ([s for s in self.ingest if not s[0] or s[1] != "READY"]
                + [s for s in self.explain if s[0] is None or not s[1]])


def _sample(gw: Gateway, wid: str, prompt: list[dict[str, str]], out: Samples, stop_at: threading.Event) -> None:
    with httpx.Client(timeout=10) as client:
        while not stop_at.is_set():
            try:
                doc = client.get(f"{gw.ingest_url}/cortex/workers").json()
                t = next(t for w in doc["workers"] for t in w["targets"] if t["worker"] == wid)
                out.ingest.append((t["exact_kv"], t["state"], t["reason"]))
                r = client.post(gw.explain_url, json={"model": MODEL, "messages": prompt})
                w = next(w for w in r.json()["workers"] if w["id"] == wid)
                out.explain.append((w["matched_tokens"], w["ledger_trusted"]))
            except Exception as exc:  # recorded, and fails the test: a sample that could not be read
                out.errors.append(repr(exc))


def _more_samples(samples: Samples, k: int) -> None:
    n = len(samples.explain)
    wait_for(lambda: len(samples.explain) >= n + k, what=f"{k} more samples")


def _wait_batches(gw: Gateway, wid: str, n: int) -> None:
    wait_for(lambda: gw.targets()[wid]["batches"] >= n, what=f"{n} batches applied")


@pytest.fixture(params=["vllm", "sglang"])
def engine_gateway(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Gateway, Sim]]:
    engine = request.param
    spec, members, stubs = SOURCES[engine]
    src = extract(tmp_path / "engine-src", spec, members, stubs)
    launcher = tmp_path / "engine_publisher_sim.py"
    launcher.write_text(LAUNCHER)
    port, kv, replay, gw_port, admin, ingest, extproc = free_ports(7)
    sim = Sim(id="w1", port=port, kv_port=kv, replay_port=replay, engine=engine)
    gw = Gateway(root=tmp_path, sims=[sim], port=gw_port, admin_port=admin, ingest_port=ingest,
                 extproc_port=extproc)
    here = str(Path(__file__).resolve().parents[1])
    # A small pool (vLLM 40 blocks of 16, SGLang 640 tokens): a few prompts make the engine evict.
    pool = ["--num-blocks", "40"] if engine == "vllm" else ["--max-total-tokens", "640"]
    sim.proc = subprocess.Popen(
        [sys.executable, str(launcher), engine, "--engine", engine, "--port", str(port), "--worker-id", sim.id,
         "--model", MODEL, "--kv-events-port", str(kv), "--kv-replay-port", str(replay), *pool],
        stdout=open(tmp_path / "sim.log", "ab"), stderr=subprocess.STDOUT,  # noqa: SIM115 - closed with it
        start_new_session=True, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(src), here])})
    try:
        wait_for(lambda: httpx.get(f"{sim.url}/health", timeout=1).status_code == 200, what="simulator health")
        start_gateway(gw)
        yield engine, gw, sim
    finally:
        stop(gw.proc)
        stop(sim.proc)


def test_engine_publisher_batches_never_make_the_worker_untrusted(
        engine_gateway: tuple[str, Gateway, Sim]) -> None:
    engine, gw, sim = engine_gateway
    # The first sync (connect + replay from 0) is done: start_gateway waited for exact_kv.
    first = gw.targets()[sim.id]
    assert first["exact_kv"] and first["state"] == "READY" and first["replays"] == 1, first
    prompts = [long_chat(120, seed=700 + i) for i in range(8)]
    samples = Samples()
    stop_at = threading.Event()
    sampler = threading.Thread(target=_sample, args=(gw, sim.id, prompts[-1], samples, stop_at), daemon=True)
    sampler.start()
    try:
        for i, prompt in enumerate(prompts):
            body = {"model": MODEL, "messages": prompt, "max_tokens": 4}
            r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            # Each request's blocks reach the ledger (a BlockStored batch, and BlockRemoved once the pool is
            # full); keep sampling through every batch and a while after it.
            _wait_batches(gw, sim.id, i + 1)
            _more_samples(samples, 20)
        t = gw.targets()[sim.id]
        assert t["blocks_stored"] > 0 and t["blocks_removed"] > 0, t  # both kinds of batch happened
        # The last prompt is cached: the explain sampled for it must show the proven blocks by now.
        wait_for(lambda: (samples.explain[-1][0] or 0) > 0, what="the ledger's value for the cached prompt")
    finally:
        stop_at.set()
        sampler.join(30)
    t = gw.targets()[sim.id]
    assert not samples.errors, samples.errors[:5]
    assert len(samples.ingest) >= 160 and len(samples.explain) >= 160
    bad = samples.untrusted()
    assert not bad, f"{engine}: {len(bad)} of {len(samples.ingest) + len(samples.explain)} samples untrusted: {bad[:5]}"
    # Steady state needs no replay after the first sync: no gap, no restart, no resync.
    assert (t["replays"], t["gaps"], t["restarts"], t["resyncs"]) == (1, 0, 0, 0), t
    # The tail checks after each burst were answered by the engine's own ROUTER on the connection kept from one to
    # the next (a check that goes unanswered closes it; a few may on a loaded machine, not most).
    assert t["tail_checks"] >= 4 and t["tail_connections"] <= t["tail_checks"] // 2, t


# vLLM's publisher alone, driven line by line: {"op": "store"|"remove", ...} -> one KVEventBatch each.
BARE = r'''
import json, sys, time
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher
ZmqEventPublisher._is_bind_endpoint = staticmethod(lambda endpoint: True)
pub = ZmqEventPublisher(0, endpoint=sys.argv[1], replay_endpoint=sys.argv[2])
print("ready", flush=True)
for line in sys.stdin:
    c = json.loads(line)
    if c["op"] == "store":
        ev = BlockStored(block_hashes=c["hashes"], parent_block_hash=None, token_ids=c["tokens"],
                         block_size=c["block_size"], lora_id=None, medium="GPU", lora_name=None)
    else:
        ev = BlockRemoved(block_hashes=c["hashes"], medium="GPU")
    pub.publish(KVEventBatch(ts=time.time(), events=[ev]))
    print("ok", flush=True)
pub.shutdown()
'''


class BarePublisher:
    def __init__(self, src: Path, endpoint: str, replay: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", BARE, endpoint, replay], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(src)})
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


@dataclass
class EventsOnly(Sim):
    """A simulator serving HTTP (health, load, tokenize) whose KV events come from another publisher."""

    events_endpoint: str = ""
    replay_endpoint: str = ""

    def worker_config(self) -> dict[str, Any]:
        return {"id": self.id, "url": self.url, "model": MODEL, "engine": "vllm",
                "kv_events": self.events_endpoint, "kv_replay": self.replay_endpoint}


def test_vllm_publisher_store_and_remove_batches_keep_the_worker_trusted(tmp_path: Path) -> None:
    """The issue's own scenario: single BlockStored and BlockRemoved batches from vLLM's class."""
    spec, members, stubs = SOURCES["vllm"]
    src = extract(tmp_path / "engine-src", spec, members, stubs)
    port, kv, replay, gw_port, admin, ingest, extproc = free_ports(7)
    endpoint, replay_endpoint = f"tcp://127.0.0.1:{kv}", f"tcp://127.0.0.1:{replay}"
    pub = BarePublisher(src, endpoint, replay_endpoint)
    sim = EventsOnly(id="w1", port=port, kv_port=kv, events_endpoint=endpoint, replay_endpoint=replay_endpoint)
    gw = Gateway(root=tmp_path, sims=[sim], port=gw_port, admin_port=admin, ingest_port=ingest,
                 extproc_port=extproc)
    samples, stop_at = Samples(), threading.Event()
    try:
        start_sim(sim, tmp_path, "--kv-events-port", "0")  # the simulator publishes nothing itself
        start_gateway(gw)
        prompt = long_chat(200, seed=5)
        doc = httpx.post(f"{gw.explain_url}?tokens=1", json={"model": MODEL, "messages": prompt},
                         timeout=30).json()
        ids = doc["token_ids"]
        assert len(ids) >= 128
        hashes = [vllm_wire_hash(h) for h in VllmBlockHasher().block_hashes(ids[:128], 16)]
        sampler = threading.Thread(target=_sample, args=(gw, sim.id, prompt, samples, stop_at), daemon=True)
        sampler.start()

        def shows(tokens: int) -> bool:
            _more_samples(samples, 1)
            return samples.explain[-1][0] == tokens

        for _ in range(3):
            pub.send(op="store", hashes=hashes, tokens=ids[:128], block_size=16)
            wait_for(lambda: shows(128), what="the stored blocks in route explain")
            _more_samples(samples, 20)
            pub.send(op="remove", hashes=hashes)
            wait_for(lambda: shows(0), what="the removal in route explain")
            _more_samples(samples, 20)
        stop_at.set()
        sampler.join(30)
        assert not samples.errors, samples.errors[:5]
        bad = samples.untrusted()
        assert not bad, f"{len(bad)} of {len(samples.ingest) + len(samples.explain)} samples untrusted: {bad[:5]}"
        t = gw.targets()[sim.id]
        assert (t["replays"], t["gaps"], t["resyncs"], t["parity"]["status"]) == (1, 0, 0, "ok"), t

        # A new publisher process on the same ports is a restarted engine: its predecessor's blocks are
        # forgotten at the disconnect, and a batch it sends before the subscription is back (slow joiner) is
        # recovered by the replay on reconnect, with no later batch needed.
        pub.send(op="store", hashes=hashes, tokens=ids[:128], block_size=16)
        wait_for(lambda: gw.targets()[sim.id]["cached_blocks"] == 8, what="stored before the restart")
        pub.kill()
        wait_for(lambda: gw.targets()[sim.id]["cached_blocks"] == 0, what="ledger cleared at the disconnect")
        pub = BarePublisher(src, endpoint, replay_endpoint)
        pub.send(op="store", hashes=hashes[:4], tokens=ids[:64], block_size=16)
        t = wait_for(lambda: (lambda t: t if t["exact_kv"] and t["cached_blocks"] == 4 else None)(
            gw.targets()[sim.id]), what="the new publisher's batch")
        assert t["replays"] >= 2, t
        wait_for(lambda: explain_tokens(gw, prompt, sim.id) == 64, what="route explain after the restart")
    finally:
        stop_at.set()
        pub.kill()
        stop(gw.proc)
        stop(sim.proc)


def explain_tokens(gw: Gateway, prompt: list[dict[str, str]], wid: str) -> Any:
    r = httpx.post(gw.explain_url, json={"model": MODEL, "messages": prompt}, timeout=30)
    return next(w for w in r.json()["workers"] if w["id"] == wid)["matched_tokens"]
