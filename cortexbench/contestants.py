"""Who is measured: each contestant is a way to put something in front of the same simulated workers.

Every contestant gets the same workers (caches emptied before each run), the same prompts and the same
arrival times; a gateway contestant is started fresh for each workload, so none starts with a warm view.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from cortexbench.launch import (
    HOST,
    MODEL,
    Procs,
    Worker,
    free_ports,
    start_cortex,
    start_envoy_alone,
    start_oracle,
    start_router,
    start_smg,
)


@dataclass(frozen=True, slots=True)
class Contestant:
    name: str
    what: str
    start: Callable[[Procs, list[Worker], int], list[str]]
    """Start whatever runs in front of the workers, as `replicas` independent gateways; return the URLs the
    client sends to: one per replica for a gateway (the client spreads requests over them as an L4 balancer
    would); for the gateway-less round-robin, the workers themselves; the oracle is never replicated."""
    replicable: bool = True
    """False: started once whatever --replicas says (the oracle, round-robin)."""
    gateway: bool = True
    """False: the client talks to the workers itself (no gateway overhead to measure)."""
    module: str | None = None
    """Python module that must be importable (an optional install)."""
    package: str | None = None

    def unavailable(self) -> str | None:
        """Why this contestant cannot run here, or None."""
        if self.module is not None and importlib.util.find_spec(self.module) is None:
            return f"{self.package} is not installed (pip install 'cortex-gateway[bench]')"
        return None


def _replicated(start_one: Callable[[Procs, list[Worker], str], str], name: str
                ) -> Callable[[Procs, list[Worker], int], list[str]]:
    """N independent copies of a gateway, none aware of the others (named name, name-2, ...), started at once
    (each start mostly waits for its processes to come up)."""
    def start(procs: Procs, workers: list[Worker], n: int) -> list[str]:
        names = [name if i == 0 else f"{name}-{i + 1}" for i in range(n)]
        with ThreadPoolExecutor(max_workers=n) as pool:
            return list(pool.map(lambda x: start_one(procs, workers, x), names))

    return start


def _cortex(name: str, *, events: bool = True, aware: bool = True, extra_config: dict[str, Any] | None = None
            ) -> Callable[[Procs, list[Worker], int], list[str]]:
    """N Cortex replicas over the same workers, as the docs tell an operator to run several (docs/replicas.md):
    each told their count (`scheduler.replicas`) and peered with the others on loopback (`peers`). `aware`
    False: N replicas that know nothing of each other, for comparison."""
    def start(procs: Procs, workers: list[Worker], n: int) -> list[str]:
        names = [name if i == 0 else f"{name}-{i + 1}" for i in range(n)]
        ports = free_ports(n) if n > 1 and aware else []

        def one(i: int) -> str:
            peers = {"host": HOST, "port": ports[i], "replica_id": names[i],
                     "connect": [f"{HOST}:{p}" for j, p in enumerate(ports) if j != i]} if ports else None
            return start_cortex(procs, workers, events=events, name=names[i], replicas=n if aware else 1,
                                peers=peers, extra_config=extra_config)
        with ThreadPoolExecutor(max_workers=n) as pool:
            return list(pool.map(one, range(n)))

    return start


def _router(module: str, policy: str, name: str, extra: Callable[[list[Worker]], tuple[str, ...]] = lambda w: ()
            ) -> Callable[[Procs, list[Worker], int], list[str]]:
    return _replicated(lambda procs, workers, n: start_router(procs, workers, module=module, policy=policy, name=n,
                                                              extra=extra(workers)), name)


CONTESTANTS: tuple[Contestant, ...] = (
    Contestant("cortex", "Cortex: Envoy + ext_proc, routing on the engines' KV events and load (defaults)",
               _cortex("cortex")),
    Contestant("cortex-cache-aware", "Cortex with its previous rule (scheduler.rule: cache_aware: cached tokens "
               "against request counts) instead of the time model, for comparison",
               _cortex("cortex-cache-aware", extra_config={"scheduler": {"rule": "cache_aware"}})),
    Contestant("cortex-load-only", "Cortex with exact-KV routing off: no KV-event endpoints configured, so it "
               "routes on load alone (its fallback mode)",
               _cortex("cortex-load-only", events=False)),
    Contestant("sglang-cache-aware", "sglang-router --policy cache_aware (approximate radix tree of past "
               "requests per worker, load-balance thresholds; router defaults)",
               _router("sglang_router", "cache_aware", "sglang-cache-aware"), module="sglang_router",
               package="sglang-router"),
    Contestant("sglang-round-robin", "sglang-router --policy round_robin",
               _router("sglang_router", "round_robin", "sglang-round-robin"), module="sglang_router",
               package="sglang-router"),
    Contestant("vllm-router-cache-aware", "vllm-router --policy cache_aware (the vLLM project's fork of the "
               "same Rust router; router defaults)",
               _router("vllm_router", "cache_aware", "vllm-router-cache-aware"), module="vllm_router",
               package="vllm-router"),
    Contestant("vllm-router-kv-aware", "vllm-router --policy kv_aware, fed the workers' KV events (ZMQ, block "
               "size 16): like Cortex, routes on what the engines report they cache",
               _router("vllm_router", "kv_aware", "vllm-router-kv-aware", lambda workers: (
                   *(a for w in workers for a in ("--kv-event-source", f"{w.url}={w.kv_events}")),
                   "--kv-event-block-size", "16" if workers[0].engine == "vllm" else "1", "--kv-event-model", MODEL)),
               module="vllm_router", package="vllm-router"),
    Contestant("smg-cache-aware", "SMG 1.13 (sglang-router's successor) --policy cache_aware with its defaults "
               "(approximate tree of the text sent to each worker, no KV events from HTTP workers); replicas are "
               "independent",
               lambda procs, workers, n: start_smg(procs, workers, n, name="smg-cache-aware", mesh=False),
               module="smg", package="smg"),
    Contestant("smg-cache-aware-mesh", "SMG 1.13 cache_aware, defaults, with its HA mesh on (--enable-mesh, every "
               "replica peered with the others on loopback): the replicas gossip their trees",
               lambda procs, workers, n: start_smg(procs, workers, n, name="smg-cache-aware-mesh", mesh=True),
               module="smg", package="smg"),
    Contestant("smg-prefix-hash", "SMG 1.13 --policy prefix_hash, defaults: a consistent-hash ring over the "
               "request's head (the first 256 tokens' worth of text), walked on load; no state, so independent "
               "replicas agree where a prefix goes",
               lambda procs, workers, n: start_smg(procs, workers, n, name="smg-prefix-hash", mesh=False,
                                                   policy="prefix_hash"),
               module="smg", package="smg"),
    Contestant("round-robin", "no gateway: the client itself sends request i to worker i mod N",
               lambda procs, workers, n: [w.url for w in workers], gateway=False, replicable=False),
    Contestant("oracle", "the harness's oracle: asks every worker its true cached prefix for the prompt and "
               "applies Cortex's scoring rule with exact in-flight counts (ceiling for hits)",
               lambda procs, workers, n: [start_oracle(procs, workers)], replicable=False),
)

# Run only when named (`--contestant`, or by `--saturation`): not a router of its own, the floor Cortex's Envoy
# starts from.
EXTRA: tuple[Contestant, ...] = (
    Contestant("envoy-alone", "Envoy alone, no ext_proc: a static listener -> one cluster of all workers, "
               "least_request (Envoy's own balancing, what Cortex falls back to; no cache awareness)",
               _replicated(lambda procs, workers, n: start_envoy_alone(procs, workers, name=n), "envoy-alone")),
    Contestant("cortex-independent", "Cortex (defaults) with replicas that know nothing of each other: not peered "
               "and not told their count (what `peers` and `scheduler.replicas` change; one replica is `cortex`)",
               _cortex("cortex-independent", aware=False)),
)

BY_NAME = {c.name: c for c in (*CONTESTANTS, *EXTRA)}
