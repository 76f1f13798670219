"""SMG 1.13 as a `cortex bench` contestant: how the bench starts its replicas, what its mesh shares, and that
nothing of it listens beyond loopback or outlives the run.

Real SMG (the `smg` wheel from the bench extra) in front of real simulated workers on loopback.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from cortexbench.contestants import BY_NAME
from cortexbench.launch import MODEL, ClusterSpec, Procs, http, start_smg, start_workers
from tests.harness import wait_for

pytestmark = pytest.mark.skipif(importlib.util.find_spec("smg") is None, reason="smg is not installed (bench extra)")

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda"]


def _messages(prefix: int, question: int) -> list[dict[str, str]]:
    # ~1 600 tokens of system prompt that no other prefix shares, then a short distinct question.
    system = " ".join(f"{WORDS[(prefix + i) % len(WORDS)]}{prefix}" for i in range(800))
    return [{"role": "system", "content": system}, {"role": "user", "content": f"question {question}"}]


def _chat(url: str, prefix: int, question: int) -> float:
    """Send one request; the share of its prompt the worker served from cache, as the worker reports it."""
    status, body = http("POST", f"{url}/v1/chat/completions",
                        {"model": MODEL, "max_tokens": 2, "messages": _messages(prefix, question)}, timeout=30)
    assert status == 200, body
    usage = body["usage"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) / usage["prompt_tokens"]


def _metrics_port(proc: subprocess.Popen[bytes]) -> int:
    argv = [str(a) for a in proc.args]  # type: ignore[union-attr]
    return int(argv[argv.index("--prometheus-port") + 1])


def _metric(port: int, name: str) -> float:
    _, text = http("GET", f"http://127.0.0.1:{port}/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in str(text).splitlines() if line.startswith(name))


def _listening(pids: set[int]) -> list[str]:
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if any(f"pid={p}," in line for p in pids)]


def test_smg_contestants_are_registered() -> None:
    for name in ("smg-cache-aware", "smg-cache-aware-mesh", "smg-prefix-hash"):
        c = BY_NAME[name]
        assert c.replicable and c.gateway and c.unavailable() is None


@pytest.mark.timeout(180)
def test_mesh_replica_routes_to_where_another_replica_sent_a_prefix(tmp_path: Path) -> None:
    """Four prefixes go through replica 1 only; replica 2 must then find each on its worker. Without the mesh
    replica 2 has never seen them and places each by load alone (its `tree_match` count stays 0)."""
    with Procs(tmp_path) as procs:
        workers = start_workers(procs, ClusterSpec(workers=4))
        urls = start_smg(procs, workers, 2, name="smg", mesh=True)
        ports = [_metrics_port(dict(procs.procs)[n]) for n in ("smg", "smg-2")]
        second = ports[1]
        for prefix in range(4):
            _chat(urls[0], prefix, 0)
        # The trees travel in gossip rounds (about one a second), and SMG exports nothing that shows a received
        # tree; probing replica 2 would teach it the prefixes itself. So count rounds on the link (each side
        # counts the rounds it dials) and ask replica 2 once five more have passed.
        def rounds() -> float:
            return sum(_metric(p, "router_mesh_sync_round_duration_seconds_count") for p in ports)

        start = rounds()
        wait_for(lambda: rounds() >= start + 5, timeout=60, what="five gossip rounds between the replicas")
        before = _metric(second, 'smg_cache_aware_policy_branch_total{branch="tree_match"}')
        hits = [_chat(urls[1], prefix, 1) for prefix in range(4)]
        assert all(h > 0.9 for h in hits), hits
        assert _metric(second, 'smg_cache_aware_policy_branch_total{branch="tree_match"}') - before == 4


@pytest.mark.timeout(180)
def test_smg_listens_on_loopback_counts_as_router_and_stops_with_its_group(tmp_path: Path) -> None:
    with Procs(tmp_path) as sims:
        workers = start_workers(sims, ClusterSpec(workers=2))
        gateways = Procs(tmp_path)
        try:
            urls = start_smg(gateways, workers, 2, name="smg", mesh=True)
            pids = {proc.pid for _, proc in gateways.procs}
            addrs = _listening(pids)
            # HTTP, metrics and mesh for each replica, none on a wildcard address.
            assert len(addrs) == 3 * len(urls) and all(a.startswith("127.0.0.1:") for a in addrs), addrs
            _chat(urls[0], 0, 0)
            # SMG retitles itself `smg::router`: its CPU must land in the router part, not in "other".
            assert set(gateways.cpu_seconds()) == {"router"}
        finally:
            gateways.stop()
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert subprocess.run(["pgrep", "-s", ",".join(map(str, pids))], capture_output=True).returncode == 1
