"""`cortex run`: prepare the runtime directory and start Envoy, ingest and extproc under one supervisor."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from cortex import grpc_health
from cortex.config import CortexConfig, check_models, reachable_host
from cortex.envoy_config import envoy_binary, write_bootstrap
from cortex.model_bundle import BundleError
from cortex.supervisor import ChildSpec, Supervisor

START_TIMEOUT_S = 120.0
"""How long a stage may take to come up (extproc loads and probes every tokenizer first)."""


def prepare_runtime(cfg: CortexConfig) -> Path:
    root = cfg.runtime_path()
    root.mkdir(parents=True, exist_ok=True)
    # Stale per-process metric files would be summed into /metrics as if those processes still ran.
    metrics = root / "metrics"
    shutil.rmtree(metrics, ignore_errors=True)
    metrics.mkdir()
    return write_bootstrap(cfg)


def child_specs(cfg: CortexConfig, config_path: Path, envoy_yaml: Path,
                ingest_gate: Callable[[], Awaitable[None]] | None = None, name: str = "",
                log: Path | None = None) -> list[ChildSpec]:
    """Ingest and the extproc processes first (stage 1), Envoy once every extproc process serves (stage 2):
    an Envoy started earlier fails its ext_proc streams open (requests routed without Cortex) and logs a
    "no healthy upstream" warning for each. `name` prefixes the children's names (one of several gateways
    under one supervisor); `log` takes their output (ChildSpec.log)."""
    env = {"PROMETHEUS_MULTIPROC_DIR": str(cfg.runtime_path() / "metrics"), "PYTHONUNBUFFERED": "1"}
    py = [sys.executable, "-m", "cortex.cli"]
    prefix = f"{name}/" if name else ""
    specs = [
        ChildSpec(f"{prefix}ingest", [*py, "ingest", "-c", str(config_path)], env, stage=1, gate=ingest_gate,
                  log=log),
        *(ChildSpec(f"{prefix}extproc-{i}", [*py, "extproc", "-c", str(config_path), "--index", str(i)], env,
                    stage=1, log=log)
          for i in range(cfg.extproc.process_count())),
        *([ChildSpec(f"{prefix}observe", [*py, "observe", "-c", str(config_path)], env, stage=1, log=log)]
          if cfg.observe.enabled else []),
        ChildSpec(f"{prefix}envoy", [envoy_binary(), "-c", str(envoy_yaml), "--disable-hot-restart",
                                     "--concurrency", str(min(2, os.cpu_count() or 1)), "-l", "warning",
                                     # `main` warns of every signal it is sent ("caught ENVOY_SIGTERM"): a
                                     # normal stop.
                                     "--component-log-level", "main:error",
                                     "--log-format", "[envoy] [%l] %v"],
                  stage=2, gate=lambda: wait_extprocs(cfg), log=log),
    ]
    return specs


async def wait_extprocs(cfg: CortexConfig, timeout_s: float = START_TIMEOUT_S) -> None:
    """Return once every extproc process answers SERVING (it listens and has read ingest's view)."""
    ep = cfg.extproc
    addresses = [f"{reachable_host(ep.host)}:{ep.base_port + i}" for i in range(ep.process_count())]
    channels = [grpc_health.channel(a) for a in addresses]
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        while True:
            results = await asyncio.gather(*(grpc_health.check(ch, "", 1.0) for ch in channels))
            waiting = [f"extproc {i} ({a}): {why}"
                       for i, (a, (ok, why)) in enumerate(zip(addresses, results, strict=True)) if not ok]
            if not waiting:
                return
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"not serving after {timeout_s:.0f} s: " + "; ".join(waiting))
            await asyncio.sleep(0.2)
    finally:
        for ch in channels:
            await ch.close()


async def wait_urls(urls: Sequence[str], timeout_s: float = START_TIMEOUT_S) -> None:
    """Return once every URL answers 200."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            missing = []
            for url in urls:
                try:
                    async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                        if r.status != 200:
                            missing.append(f"{url} answered {r.status}")
                except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                    missing.append(f"{url} ({type(exc).__name__})")
            if not missing:
                return
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"not answering after {timeout_s:.0f} s: " + "; ".join(missing))
            await asyncio.sleep(0.2)


async def wait_ready(cfg: CortexConfig, timeout_s: float = 60.0) -> tuple[bool, str]:
    """(True, "") once ingest's /health/ready answers 200 (Envoy, every extproc process and the ledger view
    are up: ingest/readiness.py); else (False, the last reason it gave)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    url = f"http://{reachable_host(cfg.ingest.host)}:{cfg.ingest.port}/health/ready"
    reason = "ingest not answering"
    async with aiohttp.ClientSession() as session:
        while asyncio.get_running_loop().time() < deadline:
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    body = await r.json(content_type=None)
                    if r.status == 200:
                        return True, ""
                    reason = str(body.get("reason", r.status))
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
                reason = f"ingest not answering ({type(exc).__name__})"
            await asyncio.sleep(0.2)
    return False, reason


def reset_workers(cfg: CortexConfig) -> None:
    """Forget the fleet changes made through the admin API (they are kept across restarts otherwise)."""
    state = cfg.runtime_path() / "workers.json"
    if state.exists():
        state.unlink()
        print(f"[cortex] workers added or removed through the admin API forgotten ({state} deleted)",
              file=sys.stderr, flush=True)


@dataclass(frozen=True)
class GatewaySpec:
    """One gateway (Envoy + ingest + extproc) of several run under one supervisor (`cortex demo --replicas`)."""

    cfg: CortexConfig
    config_path: Path
    name: str = ""
    """Prefix of its children's names and of its messages; "" for a gateway run alone."""
    log: Path | None = None
    """Where its processes' output goes (None: the terminal)."""


def run_gateway(cfg: CortexConfig, config_path: Path, extra: list[ChildSpec] | None = None,
                on_ready: Callable[[], None] | None = None, ready_urls: Sequence[str] = ()) -> int:
    """Start the gateway; `extra` children (the demo's simulated workers) start first, and ingest waits until
    every URL in `ready_urls` answers, so it meets a warm fleet."""
    return run_gateways([GatewaySpec(cfg, config_path)], extra, on_ready, ready_urls)


def run_gateways(gateways: Sequence[GatewaySpec], extra: list[ChildSpec] | None = None,
                 on_ready: Callable[[], None] | None = None, ready_urls: Sequence[str] = ()) -> int:
    """Start independent gateways under one supervisor (one Ctrl-C stops them all, Envoys first); `on_ready`
    runs once every one of them is ready."""
    try:
        for g in gateways:
            check_models(g.cfg)
    except BundleError as exc:
        print(f"cortex: {exc}", file=sys.stderr, flush=True)
        return 2
    gate = (lambda: wait_urls(ready_urls)) if ready_urls else None
    specs = [*(extra or [])]
    for g in gateways:
        specs += child_specs(g.cfg, g.config_path, prepare_runtime(g.cfg), ingest_gate=gate, name=g.name, log=g.log)
    sup = Supervisor(specs)

    async def announce() -> None:
        results = await asyncio.gather(*(wait_ready(g.cfg) for g in gateways))
        waiting = [(g, reason) for g, (ok, reason) in zip(gateways, results, strict=True) if not ok]
        if waiting:
            for g, reason in waiting:
                who = f"{g.name} " if g.name else ""
                print(f"[cortex] warning: {who}not ready after 60 s: {reason}", file=sys.stderr, flush=True)
            return
        if len(gateways) == 1:
            cfg = gateways[0].cfg
            print(f"[cortex] ready: http://{cfg.listen.host}:{cfg.listen.port}  "
                  f"(admin http://{cfg.ingest.host}:{cfg.ingest.port}/cortex/workers, "
                  f"envoy admin http://{cfg.admin.host}:{cfg.admin.port})", file=sys.stderr, flush=True)
        else:
            listing = ", ".join(f"{g.name or 'gateway'} http://{g.cfg.listen.host}:{g.cfg.listen.port}"
                                for g in gateways)
            print(f"[cortex] ready: {len(gateways)} gateways ({listing})", file=sys.stderr, flush=True)
        if on_ready is not None:
            on_ready()

    return asyncio.run(sup.run(ready=announce))
