"""`cortex run`: prepare the runtime directory and start Envoy, ingest and extproc under one supervisor."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from cortex import admin_auth, extproc_tls, grpc_health, logs
from cortex.admin_auth import TokenError
from cortex.config import ConfigError, CortexConfig, check_models, reachable_host
from cortex.envoy_config import envoy_binary, write_bootstrap
from cortex.model_bundle import BundleError
from cortex.upstream_tls import WorkerTls
from cortexctl.supervisor import ChildSpec, Supervisor

START_TIMEOUT_S = 120.0
"""How long a stage may take to come up (extproc loads and probes every tokenizer first)."""


def prepare_runtime(cfg: CortexConfig, envoy: bool = True) -> Path | None:
    """The runtime directory, emptied of last run's metric files; returns the Envoy bootstrap written there (None
    for `cortex epp`, which runs no Envoy)."""
    root = cfg.runtime_path()
    root.mkdir(parents=True, exist_ok=True)
    # Stale per-process metric files would be summed into /metrics as if those processes still ran.
    metrics = root / "metrics"
    shutil.rmtree(metrics, ignore_errors=True)
    metrics.mkdir()
    return write_bootstrap(cfg) if envoy else None


def child_specs(cfg: CortexConfig, config_path: Path, envoy_yaml: Path | None,
                ingest_gate: Callable[[], Awaitable[None]] | None = None, name: str = "",
                log: Path | None = None) -> list[ChildSpec]:
    """Ingest and the extproc processes first (stage 1), Envoy once every extproc process serves (stage 2):
    an Envoy started earlier fails its ext_proc streams open (requests routed without Cortex) and logs a
    "no healthy upstream" warning for each. `name` prefixes the children's names (one of several gateways
    under one supervisor); `log` takes their output (ChildSpec.log). No `envoy_yaml` (`cortex epp`): ingest and
    extproc only, for a gateway that is not Cortex's; its Envoy calls extproc and its access log is not Cortex's to
    read, so no observer either."""
    env = {"PROMETHEUS_MULTIPROC_DIR": str(cfg.runtime_path() / "metrics"), "PYTHONUNBUFFERED": "1"}
    py = [sys.executable, "-m", "cortexctl.cli"]
    prefix = f"{name}/" if name else ""
    flags = logs.child_args()  # the log format and level resolved once, by the supervisor
    if envoy_yaml is None:
        flags = [*flags, "--picker"]
    specs = [
        ChildSpec(f"{prefix}ingest", [*py, "ingest", "-c", str(config_path), *flags], env, stage=1,
                  gate=ingest_gate, log=log),
        *(ChildSpec(f"{prefix}extproc-{i}", [*py, "extproc", "-c", str(config_path), "--index", str(i), *flags],
                    env, stage=1, log=log)
          for i in range(cfg.extproc.process_count())),
    ]
    if envoy_yaml is None:
        return specs
    specs += [
        *([ChildSpec(f"{prefix}observe", [*py, "observe", "-c", str(config_path), *flags], env, stage=1, log=log)]
          if cfg.observe.enabled else []),
        ChildSpec(f"{prefix}envoy", [envoy_binary(), "-c", str(envoy_yaml), "--disable-hot-restart",
                                     "--concurrency", str(min(2, os.cpu_count() or 1)), "-l", "warning",
                                     # `main` warns of every signal it is sent ("caught ENVOY_SIGTERM"): a
                                     # normal stop.
                                     "--component-log-level", "main:error",
                                     *logs.envoy_args(f"{prefix}envoy")],
                  logs.ENVOY_ENV, stage=2, gate=lambda: wait_extprocs(cfg), log=log),
    ]
    return specs


async def wait_extprocs(cfg: CortexConfig, timeout_s: float = START_TIMEOUT_S) -> None:
    """Return once every extproc process answers SERVING (it listens and has read ingest's view)."""
    ep = cfg.extproc
    addresses = [extproc_tls.health_address(cfg, i, reachable_host(ep.host)) for i in range(ep.process_count())]
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


async def wait_ready(cfg: CortexConfig, timeout_s: float = 60.0) -> tuple[bool, str, dict[str, Any]]:
    """(True, "", its body) once ingest's /health/ready answers 200 (Envoy, every extproc process and the ledger
    view are up: ingest/readiness.py); else (False, the last reason it gave, {})."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    url = f"http://{reachable_host(cfg.ingest.host)}:{cfg.ingest.port}/health/ready"
    reason = "ingest not answering"
    async with aiohttp.ClientSession() as session:
        while asyncio.get_running_loop().time() < deadline:
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    body = await r.json(content_type=None)
                    if r.status == 200:
                        return True, "", body if isinstance(body, dict) else {}
                    reason = str(body.get("reason", r.status))
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
                reason = f"ingest not answering ({type(exc).__name__})"
            await asyncio.sleep(0.2)
    return False, reason, {}


def ready_fields(cfg: CortexConfig, body: dict[str, Any]) -> dict[str, Any]:
    """What the ready line says, as JSON fields: where to connect, the fleet as ingest sees it (workers restored
    from workers.json included), the models."""
    workers = [w.get("id", "?") for w in body.get("workers", [])] if "workers" in body else [
        w.id for w in cfg.workers]
    return {"listen": f"http://{cfg.listen.host}:{cfg.listen.port}",
            "admin": f"http://{cfg.ingest.host}:{cfg.ingest.port}",
            "envoy_admin": f"http://{cfg.admin.host}:{cfg.admin.port}",
            "workers": workers, "models": [m.name for m in cfg.models],
            "extproc_processes": cfg.extproc.process_count(),
            "routing": str(body.get("detail", ""))}


def ready_message(f: dict[str, Any]) -> str:
    """`ready: http://127.0.0.1:8080  2 workers (sim-1, sim-2), 1 model (Qwen/...), 2 extproc processes: all targets
    on exact-KV routing  (admin ..., envoy admin ...)`: one line a person reads to know where to send requests and
    what is behind."""
    n, m, x = len(f["workers"]), len(f["models"]), f["extproc_processes"]
    fleet = f"{n} worker{'s' * (n != 1)} ({', '.join(f['workers']) or 'none yet'})"
    models = f"{m} model{'s' * (m != 1)} ({', '.join(f['models'])})"
    routing = f": {f['routing']}" if f["routing"] else ""
    return (f"ready: {f['listen']}  {fleet}, {models}, {x} extproc process{'es' * (x != 1)}{routing}  "
            f"(admin {f['admin']}/cortex/workers, envoy admin {f['envoy_admin']})")


def start_refusal(cfg: CortexConfig, picker: bool) -> str | None:
    """Why the processes must not start (one line), checked before any does: a model's files, the admin token
    file, the upstream certificates, and extproc.tls (`cortex epp` only, with readable files); None: start."""
    try:
        check_models(cfg)
        admin_auth.admin_token(cfg)  # a bad token file stops the start, not ingest
        WorkerTls(cfg.upstream_tls)  # so does an unreadable CA or client certificate
    except (BundleError, TokenError, ConfigError) as exc:
        return str(exc)
    if picker:
        return extproc_tls.check_files(cfg)
    if cfg.extproc.tls is not None:
        return ("extproc.tls is for `cortex epp` (a gateway on another host calls extproc); under `cortex run` "
                "Envoy calls extproc on the same host: remove extproc.tls")
    return None


def provide_admin_token(cfg: CortexConfig, name: str = "") -> None:
    """An admin port beyond loopback without a configured token gets one for this run (admin_auth.generate_token).
    The token itself goes to the terminal of the person who started the gateway, as Jupyter shows its own, and
    nowhere else: not to a log (a container's output is collected and kept), only its file is named there."""
    token = admin_auth.generate_token(cfg)
    if token is None:
        return
    where = ", ".join(admin_auth.exposed(cfg))
    path = admin_auth.generated_path(cfg)
    if sys.stderr.isatty():
        print(f"[cortex] {name + ': ' if name else ''}admin token for this run: {token}  (send "
              "`Authorization: Bearer <token>`; a browser asks for it as the password)", file=sys.stderr, flush=True)
    logs.say("%s%s is beyond loopback and no ingest.admin_token_file is set: every admin route needs the token "
             "generated for this run, in %s (mode 0600; never logged)", f"{name}: " if name else "", where, path,
             level=logging.WARNING, token_file=str(path))


def reset_workers(cfg: CortexConfig) -> None:
    """Forget the fleet changes made through the admin API (they are kept across restarts otherwise)."""
    state = cfg.runtime_path() / "workers.json"
    if state.exists():
        state.unlink()
        logs.say("workers added or removed through the admin API forgotten (%s deleted)", state)


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
    for g in gateways:
        provide_admin_token(g.cfg, g.name)
        if (why := start_refusal(g.cfg, picker=False)) is not None:
            logs.fatal(why)
            return 2
    gate = (lambda: wait_urls(ready_urls)) if ready_urls else None
    specs = [*(extra or [])]
    for g in gateways:
        specs += child_specs(g.cfg, g.config_path, prepare_runtime(g.cfg), ingest_gate=gate, name=g.name, log=g.log)
    sup = Supervisor(specs)

    async def announce() -> None:
        results = await asyncio.gather(*(wait_ready(g.cfg) for g in gateways))
        waiting = [(g, reason) for g, (ok, reason, _) in zip(gateways, results, strict=True) if not ok]
        for g, reason in waiting:
            logs.say("%snot ready after 60 s: %s; still waiting", f"{g.name} " if g.name else "", reason,
                     level=logging.WARNING, gateway=g.name, reason=reason)
        if waiting:
            # Still announced once it comes: a slow start must not leave the person without a ready line.
            later = await asyncio.gather(*(wait_ready(g.cfg, timeout_s=24 * 3600) for g, _ in waiting))
            results = [later.pop(0) if not r[0] else r for r in results]
            if not all(ok for ok, _, _ in results):
                return
        if len(gateways) == 1:
            fields = ready_fields(gateways[0].cfg, results[0][2])
            logs.say("%s", ready_message(fields), **fields)
        else:
            listing = ", ".join(f"{g.name or 'gateway'} http://{g.cfg.listen.host}:{g.cfg.listen.port}"
                                for g in gateways)
            logs.say("ready: %d gateways (%s)", len(gateways), listing,
                     gateways=[ready_fields(g.cfg, r[2]) for g, r in zip(gateways, results, strict=True)])
        if on_ready is not None:
            on_ready()

    return asyncio.run(sup.run(ready=announce))


def picker_ready_message(cfg: CortexConfig, body: dict[str, Any]) -> str:
    """`ready (endpoint picker): ext_proc (TLS) on 0.0.0.0:9002  2 workers (...), models ...: <routing>  (admin)`."""
    f = ready_fields(cfg, body)
    ep = cfg.extproc
    n = ep.process_count()
    ports = f"{ep.base_port}" if n == 1 else f"{ep.base_port}-{ep.base_port + n - 1}"
    workers = f"{len(f['workers'])} worker{'s' * (len(f['workers']) != 1)} ({', '.join(f['workers']) or 'none yet'})"
    routing = f": {f['routing']}" if f["routing"] else ""
    tls = " (TLS)" if ep.tls is not None else ""
    return (f"ready (endpoint picker): ext_proc{tls} on {ep.host}:{ports}  {workers}, models {', '.join(f['models'])}"
            f"{routing}  (admin {f['admin']}/cortex/workers)")


def run_picker(cfg: CortexConfig, config_path: Path) -> int:
    """`cortex epp`: ingest and extproc, serving the endpoint-picker protocol to a gateway run by someone else."""
    provide_admin_token(cfg)
    if (why := start_refusal(cfg, picker=True)) is not None:
        logs.fatal(why)
        return 2
    specs = child_specs(cfg, config_path, prepare_runtime(cfg, envoy=False))
    extproc_tls.ensure_self_signed(cfg)  # before any extproc process: they all serve this one

    async def announce() -> None:
        ok, reason, body = await wait_ready(cfg)
        while not ok:
            logs.say("not ready after 60 s: %s; still waiting", reason, level=logging.WARNING, reason=reason)
            ok, reason, body = await wait_ready(cfg, timeout_s=3600)
        logs.say("%s", picker_ready_message(cfg, body), **ready_fields(cfg, body))

    return asyncio.run(Supervisor(specs).run(ready=announce))
