"""High availability: several independent Cortex replicas (each its own Envoy, ingest and extproc) over the same
simulated vLLM workers, with no link between the replicas. Each subscribes to every worker's KV events, so each
ledger converges on what the workers hold (docs/deployment.md):

- what one replica routed, another routes to the same worker and claims exactly (it saw only the events);
- a replica started late catches up through the workers' replay buffers and routes like the others;
- when a worker's replay buffer no longer holds the oldest batches, a late replica under-claims, never over-claims;
- a replica killed outright costs the others nothing.

Every wait is a condition with a deadline; traffic loops are bounded in count.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from cortex.envoy_config import envoy_binary
from cortexctl.demo import ReplicaPorts, port_problem, replica_ports
from tests.faultkit import Traffic, check
from tests.harness import (
    MODEL,
    PY,
    Gateway,
    Sim,
    chat_once,
    free_ports,
    free_run,
    long_chat,
    start_gateway,
    start_sim,
    stop,
    wait_for,
)
from tests.test_cli import NOISE, _cmdline, _ctrl_c

pytestmark = pytest.mark.timeout(420)


def test_demo_rejects_bad_replica_counts_and_port_clashes(tmp_path: Path) -> None:
    for argv, message in ((["--replicas", "0"], "--replicas must be between 1 and 8, got 0"),
                          (["--replicas", "9"], "--replicas must be between 1 and 8, got 9"),
                          # replica 2's gateway port would be replica 1's ingest port
                          (["--replicas", "2", "--port", "7000", "--ingest-port", "7001"],
                           "port 7001 would be used twice: by replica-1 --ingest-port and by replica-2 --port")):
        r = subprocess.run([*PY, "demo", *argv, "--runtime-dir", str(tmp_path)], capture_output=True, timeout=60)
        assert r.returncode == 2 and message in r.stderr.decode(), r.stderr.decode()
    assert not list(tmp_path.iterdir())  # refused before anything started


def test_replica_port_layout() -> None:
    one = replica_ports(1, 8080, 9901, 9090, 50051, cores=4)
    assert one == [ReplicaPorts("", 8080, 9901, 9090, 50051, None)]  # a single gateway: as before
    three = replica_ports(3, 8080, 9901, 9090, 50051, cores=4)
    assert [(p.name, p.listen, p.admin, p.ingest, list(p.extproc_range(4))) for p in three] == [
        ("replica-1", 8080, 9901, 9090, [50051]),
        ("replica-2", 8081, 9902, 9091, [50052]),
        ("replica-3", 8082, 9903, 9092, [50053])]
    assert [p.peers for p in three] == [5801, 5802, 5803] and one[0].peers is None
    two = replica_ports(2, 8080, 9901, 9090, 50051, cores=4)  # the cores are shared: 2 extproc processes each
    assert [list(p.extproc_range(4)) for p in two] == [[50051, 50052], [50053, 50054]]
    assert port_problem(two, 4, 2, 8101, 5601, 5701) is None
    assert port_problem(two, 4, 2, 8081, 5601, 5701) == \
        "port 8081 would be used twice: by replica-2 --port and by sim-1 (--sim-base-port)"
    assert port_problem(replica_ports(2, 8080, 9901, 9090, 50051, 4, peer_port=5700), 4, 2, 8101, 5601, 5701) == \
        "port 5701 would be used twice: by replica-2 peering (--peer-base-port) and by sim-1 (--kv-replay-base-port)"
    assert port_problem(replica_ports(2, 65535, 9901, 9090, 50051, 4), 4, 1, 8101, 5601, 5701) == \
        "replica-2 --port would be port 65536, outside 1..65535"


@pytest.mark.timeout(420)
def test_demo_with_two_replicas(tmp_path: Path) -> None:
    """`cortex demo --replicas 2`: both gateways answer, a chat repeated through the other replica hits, the
    terminal stays quiet (each replica logs to its own file), and Ctrl-C stops everything."""
    runtime, out_path = tmp_path / "demo", tmp_path / "demo.log"
    cores = os.cpu_count() or 1
    # One free run holds every port the demo will bind (separate picks could overlap each other).
    base = free_run(18 + 2 * cores)
    gw, admin, ingest, sim1, kv1, replay1, observe = (base + 2 * i for i in range(7))
    extproc = base + 18  # two replicas' observers take observe .. observe + 3
    proc = subprocess.Popen([*PY, "demo", "--replicas", "2", "--port", str(gw), "--admin-port", str(admin),
                             "--ingest-port", str(ingest), "--sim-base-port", str(sim1), "--kv-base-port", str(kv1),
                             "--kv-replay-base-port", str(replay1), "--extproc-port", str(extproc),
                             "--observe-port", str(observe), "--peer-base-port", str(base + 16),
                             "--runtime-dir", str(runtime)],
                            stdout=out_path.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: b"Cortex demo is up" in out_path.read_bytes() or proc.poll() is not None, timeout=300,
                 what="the demo to announce itself")
        assert proc.poll() is None, out_path.read_text()
        # Announced only once both replicas are ready.
        for r in range(2):
            assert httpx.get(f"http://127.0.0.1:{ingest + r}/health/ready", timeout=5).status_code == 200
        a, b = (Gateway(root=runtime / f"replica-{r + 1}", sims=[], port=gw + r, admin_port=admin + r,
                        ingest_port=ingest + r, extproc_port=0) for r in range(2))
        messages = long_chat(300, seed=51)
        holder, _, _, _ = chat_once(a, messages)
        wait_for(lambda: holds(b, messages, holder), timeout=30, what="replica-2 to see replica-1's prompt cached")
        worker, mode, claimed, cached = chat_once(b, messages)
        assert (worker, mode) == (holder, "exact_kv_events") and claimed == cached > 0
        # The replicas are peered (docs/replicas.md): each hears the other.
        wait_for(lambda: all(peers_heard(ingest + r) == 1 for r in range(2)), timeout=30, what="peering")
    finally:
        _ctrl_c(proc)
    out = out_path.read_bytes()
    assert proc.returncode == 0, out.decode()[-2000:]
    for r in range(2):  # every replica's URL and ports are printed
        assert f"replica-{r + 1}  http://127.0.0.1:{gw + r}".encode() in out, out.decode()
        assert f"http://127.0.0.1:{ingest + r}".encode() in out and f"http://127.0.0.1:{admin + r}".encode() in out
    assert b"] INFO " not in out, out.decode()  # the replicas' start-up lines went to their log files
    logs = [runtime / f"replica-{r + 1}" / "cortex.log" for r in range(2)]
    assert all(b"extproc 0 serving" in p.read_bytes() for p in logs)
    for text in (out, *(p.read_bytes() for p in logs)):
        for noise in NOISE:
            assert noise not in text, text.decode()[-3000:]
    assert out.rstrip().endswith(b"[cortex] stopped"), out.decode()[-2000:]
    needles = [str(runtime).encode(), f"--port {sim1}".encode(), f"--port {sim1 + 1}".encode()]
    leftovers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and
                 any(n in _cmdline(p).replace(b"\0", b" ") for n in needles)]
    assert not leftovers


def peers_heard(ingest_port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{ingest_port}/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "cortex_peers")


@dataclass
class Fleet:
    root: Path
    sims: list[Sim]
    a: Gateway
    b: Gateway


def replica(root: Path, name: str, sims: list[Sim]) -> Gateway:
    """A gateway of its own (ports, runtime dir, processes) over the shared workers: one replica."""
    home = root / name
    home.mkdir()
    port, admin, ingest, extproc = free_ports(4)
    return Gateway(root=home, sims=sims, port=port, admin_port=admin, ingest_port=ingest, extproc_port=extproc)


@contextlib.contextmanager
def running(gw: Gateway) -> Iterator[Gateway]:
    try:
        start_gateway(gw)
        yield gw
    finally:
        stop(gw.proc)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("replicas")
    ports = free_ports(9)
    sims = [Sim(id=f"sim-{i + 1}", port=ports[3 * i], kv_port=ports[3 * i + 1], replay_port=ports[3 * i + 2])
            for i in range(3)]
    try:
        for s in sims:
            start_sim(s, root)
        with running(replica(root, "a", sims)) as a, running(replica(root, "b", sims)) as b:
            yield Fleet(root, sims, a, b)
    finally:
        for s in sims:
            stop(s.proc)


def route(gw: Gateway, messages: list[dict[str, str]]) -> dict[str, Any]:
    """The replica's decision for this prompt, nothing forwarded."""
    r = httpx.post(gw.explain_url, json={"model": MODEL, "messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def holds(gw: Gateway, messages: list[dict[str, str]], worker: str) -> dict[str, Any] | None:
    """The replica's decision once its ledger shows `worker` holding the prompt (events take a moment)."""
    d = route(gw, messages)
    return d if d["chosen"] == worker and d["mode"] == "exact_kv_events" and d["cache_hit_tokens"] > 0 else None


def test_replica_routes_what_another_replica_cached(fleet: Fleet) -> None:
    """B never sees the first request, only the worker's KV events; it still sends the repeat to the worker
    that cached it and claims exactly what that worker then reports."""
    for seed in (11, 12, 13):
        messages = long_chat(400, seed=seed)
        holder, mode, claimed, _ = chat_once(fleet.a, messages)
        assert (mode, claimed) == ("load_aware", 0)  # new to the whole fleet
        decision = wait_for(lambda: holds(fleet.b, messages, holder), timeout=30,  # noqa: B023
                            what=f"replica B's ledger to show {holder} holding the prompt")
        worker, mode, claimed, cached = chat_once(fleet.b, messages)
        assert (worker, mode) == (holder, "exact_kv_events")
        assert claimed == cached == decision["cache_hit_tokens"] > 0
        # And back: A claims what B's repeat left behind, the same blocks.
        worker, mode, claimed, cached = chat_once(fleet.a, messages)
        assert (worker, mode) == (holder, "exact_kv_events") and claimed == cached > 0


def by_id(gw: Gateway) -> dict[str, dict[str, Any]]:
    return {t["id"]: t for t in gw.targets().values()}


def test_late_replica_catches_up_through_replay(fleet: Fleet) -> None:
    """A replica started after traffic went through A knows every block A knows, and got it all from the
    workers' replay buffers: nothing was published after it started."""
    prompts = [long_chat(350, seed=seed) for seed in range(21, 27)]
    holders = [chat_once(fleet.a, m)[0] for m in prompts]
    for m, h in zip(prompts, holders, strict=True):
        wait_for(lambda m=m, h=h: holds(fleet.a, m, h), timeout=30, what="A's ledger to show the prompt")
    before = by_id(fleet.a)

    with running(replica(fleet.root, "late", fleet.sims)) as late:
        after, seen = by_id(fleet.a), by_id(late)
        for tid, t in seen.items():
            a = after[tid]
            assert a["last_seq"] == before[tid]["last_seq"] is not None  # no batch published since C started
            # Everything C applied came from the replay it asked for on connecting: batches 0..last_seq.
            assert t["reason"] == "replayed" and t["replays"] >= 1, t
            assert t["last_seq"] == a["last_seq"] and t["batches"] == a["last_seq"] + 1, (t, a)
            assert t["cached_blocks"] == a["cached_blocks"] > 0 and t["gaps"] == t["resyncs"] == 0, (t, a)
            assert t["subscription"]["state"] == "live", t
        # The same figures for Prometheus (docs/deployment.md names them).
        metrics = httpx.get(f"{late.ingest_url}/metrics", timeout=5).text
        for tid, t in seen.items():
            assert f'cortex_ingest_replays_total{{target="{tid}",worker="{tid}"}} {float(t["replays"])}' in metrics
            assert f'cortex_ingest_batches_total{{target="{tid}",worker="{tid}"}} {float(t["batches"])}' in metrics
            assert f'cortex_target_sync_state{{state="READY",target="{tid}",worker="{tid}"}} 1.0' in metrics
        for m, h in zip(prompts, holders, strict=True):
            mine, theirs = route(late, m), route(fleet.a, m)
            decision = (mine["chosen"], mine["mode"], mine["cache_hit_tokens"])
            assert decision == (theirs["chosen"], theirs["mode"], theirs["cache_hit_tokens"])
            assert decision[:2] == (h, "exact_kv_events"), decision
            worker, mode, claimed, cached = chat_once(late, m)
            assert (worker, mode) == (h, "exact_kv_events") and claimed == cached == theirs["cache_hit_tokens"] > 0


def test_late_replica_past_the_replay_buffer_under_claims(tmp_path: Path) -> None:
    """A worker's replay buffer is bounded (buffer_steps, 10 000 batches by default in both engines). A replica
    that starts after older batches left it never learns those blocks: it claims less than the worker holds,
    never more. The simulator keeps 2 batches here, and the traffic goes straight to the worker."""
    port, kv, replay = free_ports(3)
    sim = Sim(id="sim-1", port=port, kv_port=kv, replay_port=replay, args=("--kv-buffer-steps", "2"))
    try:
        start_sim(sim, tmp_path)
        prompts = [long_chat(300, seed=seed) for seed in range(31, 36)]
        for m in prompts:  # one batch of BlockStored per new prompt (max_tokens 1 completes no decode block)
            r = httpx.post(f"{sim.url}/v1/chat/completions", json={"model": MODEL, "messages": m, "max_tokens": 1},
                           timeout=60)
            assert r.status_code == 200
        with running(replica(tmp_path, "late", [sim])) as late:
            t = by_id(late)["sim-1"]
            # The replay answered only the newest 2 of at least 5 batches, and the target trusts it (READY).
            assert t["reason"] == "replayed" and t["exact_kv"] and t["batches"] == 2 and t["last_seq"] >= 4, t
            oldest, newest = prompts[0], prompts[-1]
            assert route(late, oldest)["cache_hit_tokens"] == 0
            _, mode, claimed, cached = chat_once(late, oldest)
            assert claimed == 0 < cached  # the worker had it all along: an under-claim
            _, mode, claimed, cached = chat_once(late, newest)
            assert mode == "exact_kv_events" and claimed == cached > 0  # the replayed batches are exact
            for m in prompts:
                _, _, claimed, cached = chat_once(late, m)
                assert claimed <= cached
    finally:
        stop(sim.proc)


def descendants(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def kill_replica(gw: Gateway) -> None:
    """SIGKILL every process of the replica, as a node loss would: the supervisor is frozen first so it cannot
    restart anything, then Envoy, ingest and extproc (each leads its own process group) and the supervisor."""
    assert gw.proc is not None
    os.kill(gw.proc.pid, signal.SIGSTOP)
    kids = descendants(gw.proc.pid)
    assert len(kids) >= 3, kids  # envoy, ingest, extproc
    for pid in kids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(gw.proc.pid, signal.SIGKILL)
    gw.proc.wait(timeout=30)
    wait_for(lambda: all(gone(p) for p in kids), timeout=30, what="the replica's processes gone")


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_killed_replica_loses_nothing_for_the_others(fleet: Fleet) -> None:
    prompts = [long_chat(300, seed=seed) for seed in range(41, 47)]
    counters = ("gaps", "resyncs", "restarts", "decode_errors")
    with running(replica(fleet.root, "doomed", fleet.sims)) as doomed:
        holders = [chat_once(doomed, m)[0] for m in prompts]  # cached through the doomed replica only
        before = {tid: {k: t[k] for k in counters} for tid, t in by_id(fleet.a).items()}
        through_a = Traffic(fleet.a.url, total=40, threads=2, prompts=4, words=(200, 500), seed=5).start()
        through_doomed = Traffic(doomed.url, total=400, threads=3, prompts=4, words=(200, 500), seed=6,
                                 deadline_s=10).start()
        through_doomed.wait_done(6, timeout=120)
        kill_replica(doomed)
        through_doomed.stop()
        outcomes = through_a.join(timeout=240)
        through_doomed.join(timeout=60)  # its own failures are expected: that replica is gone
    # Every request through A succeeded, none claimed more than the engine reported.
    assert len(outcomes) == 40
    check(outcomes)
    # A's subscriptions never noticed: no gap, no resync, no restart, every target still exact.
    after = by_id(fleet.a)
    assert {tid: {k: t[k] for k in counters} for tid, t in after.items()} == before
    assert all(t["exact_kv"] for t in after.values()), after
    # What only the dead replica routed is still an exact hit through A (bounded: 2 rounds).
    for _ in range(2):
        for m, h in zip(prompts, holders, strict=True):
            wait_for(lambda m=m, h=h: holds(fleet.a, m, h), timeout=30, what="A's ledger to show the prompt")
            worker, mode, claimed, cached = chat_once(fleet.a, m)
            assert (worker, mode) == (h, "exact_kv_events") and claimed == cached > 0
    # Requests cut off by the kill do not linger as load on the workers (A would steer around them forever).
    wait_for(lambda: all(t["load"]["running"] == 0 and t["load"]["waiting"] == 0 for t in by_id(fleet.a).values()),
             timeout=30, what="the workers' load back to zero")


def docs_front_envoy() -> dict[str, Any]:
    """The front Envoy configuration docs/deployment.md shows, parsed from the page itself."""
    text = (Path(__file__).parent.parent / "docs" / "deployment.md").read_text()
    section = text[text.index("### Envoy in front"):]
    block = section[section.index("```yaml") + len("```yaml"):]
    return yaml.safe_load(block[:block.index("```")])


def envoy_requests(gw: Gateway) -> int:
    stats = httpx.get(f"http://127.0.0.1:{gw.admin_port}/stats?filter=^http.cortex.downstream_rq_total$",
                      timeout=5).text
    return int(stats.split(":")[1])


def test_front_envoy_from_the_docs(fleet: Fleet, tmp_path: Path) -> None:
    """Two replicas behind the documented front Envoy (its addresses pointed at the test's replicas): every
    request succeeds, both replicas serve, and a repeat is an exact hit whichever replica it reaches."""
    cfg = docs_front_envoy()
    (front_port,) = free_ports(1)
    cfg["static_resources"]["listeners"][0]["address"]["socket_address"] = {"address": "127.0.0.1",
                                                                            "port_value": front_port}
    endpoints = cfg["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert len(endpoints) == 3 and all(e["endpoint"]["health_check_config"] == {"port_value": 9090}
                                       for e in endpoints)
    cfg["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": gw.port}},
                      "health_check_config": {"port_value": gw.ingest_port}}} for gw in (fleet.a, fleet.b)]
    path = tmp_path / "front-envoy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "front-envoy.log"
    proc = subprocess.Popen([envoy_binary(), "-c", str(path), "--disable-hot-restart", "--concurrency", "1",
                             "-l", "warning"], stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    front = Gateway(root=tmp_path, sims=[], port=front_port, admin_port=0, ingest_port=0, extproc_port=0)
    try:
        wait_for(lambda: httpx.get(f"{front.url}/v1/models", timeout=2).status_code == 200, timeout=60,
                 what=f"the front Envoy to pass traffic ({log})")
        prompts = [long_chat(250, seed=seed) for seed in range(61, 69)]
        served = [envoy_requests(fleet.a), envoy_requests(fleet.b)]
        holders = [chat_once(front, m)[0] for m in prompts]
        served = [envoy_requests(fleet.a) - served[0], envoy_requests(fleet.b) - served[1]]
        for m, h in zip(prompts, holders, strict=True):
            for gw in (fleet.a, fleet.b):  # each replica has seen the events, whichever one routed the prompt
                wait_for(lambda gw=gw, m=m, h=h: holds(gw, m, h), timeout=30, what="the prompt in both ledgers")
        before = [envoy_requests(fleet.a), envoy_requests(fleet.b)]
        for _ in range(2):
            for m, h in zip(prompts, holders, strict=True):
                worker, mode, claimed, cached = chat_once(front, m)
                assert (worker, mode) == (h, "exact_kv_events") and claimed == cached > 0
        served = [served[0] + envoy_requests(fleet.a) - before[0], served[1] + envoy_requests(fleet.b) - before[1]]
        # 24 requests, each to either replica: both served some (least-request picks at random among idle ones).
        assert sum(served) == 3 * len(prompts) and min(served) > 0, served
    finally:
        stop(proc)
    assert b"critical" not in log.read_bytes() and b"[error]" not in log.read_bytes(), log.read_text()
