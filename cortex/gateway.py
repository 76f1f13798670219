"""`cortex run`: prepare the runtime directory and start Envoy, ingest and extproc under one supervisor."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import aiohttp

from cortex.config import CortexConfig
from cortex.dataplane import envoy_binary, write_bootstrap
from cortex.supervisor import ChildSpec, Supervisor


def prepare_runtime(cfg: CortexConfig) -> Path:
    root = cfg.runtime_path()
    root.mkdir(parents=True, exist_ok=True)
    # Stale per-process metric files would be summed into /metrics as if those processes still ran.
    metrics = root / "metrics"
    shutil.rmtree(metrics, ignore_errors=True)
    metrics.mkdir()
    return write_bootstrap(cfg)


def child_specs(cfg: CortexConfig, config_path: Path, envoy_yaml: Path) -> list[ChildSpec]:
    env = {"PROMETHEUS_MULTIPROC_DIR": str(cfg.runtime_path() / "metrics"), "PYTHONUNBUFFERED": "1"}
    py = [sys.executable, "-m", "cortex.cli"]
    specs = [
        ChildSpec("ingest", [*py, "ingest", "-c", str(config_path)], env),
        *(ChildSpec(f"extproc-{i}", [*py, "extproc", "-c", str(config_path), "--index", str(i)], env)
          for i in range(cfg.extproc.process_count())),
        ChildSpec("envoy", [envoy_binary(), "-c", str(envoy_yaml), "--disable-hot-restart",
                            "--concurrency", str(min(2, os.cpu_count() or 1)), "-l", "warning",
                            "--log-format", "[envoy] [%l] %v"]),
    ]
    return specs


async def wait_ready(cfg: CortexConfig, timeout_s: float = 60.0, also: Sequence[str] = ()) -> bool:
    """True once ingest answers /health/ready, every extproc process behind Envoy has read ingest's view
    (Envoy spreads streams over them, so /cortex/health is asked often enough to reach each), and every URL
    in `also` answers 200."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    health = f"http://{cfg.listen.host}:{cfg.listen.port}/cortex/health"
    urls = [f"http://{cfg.ingest.host}:{cfg.ingest.port}/health/ready", *([health] * (2 * cfg.extproc.process_count())),
            *also]
    async with aiohttp.ClientSession() as session:
        while asyncio.get_running_loop().time() < deadline:
            ok = True
            for url in urls:
                try:
                    async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                        ok = ok and r.status == 200
                        if ok and url == health:
                            ok = bool((await r.json(content_type=None)).get("ledger_view"))
                except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
                    ok = False
            if ok:
                return True
            await asyncio.sleep(0.2)
    return False


def run_gateway(cfg: CortexConfig, config_path: Path, extra: list[ChildSpec] | None = None,
                on_ready: Callable[[], None] | None = None, ready_urls: Sequence[str] = ()) -> int:
    envoy_yaml = prepare_runtime(cfg)
    sup = Supervisor([*(extra or []), *child_specs(cfg, config_path, envoy_yaml)])

    async def announce() -> None:
        if await wait_ready(cfg, also=ready_urls):
            print(f"[cortex] ready: http://{cfg.listen.host}:{cfg.listen.port}  "
                  f"(admin http://{cfg.ingest.host}:{cfg.ingest.port}/cortex/workers, "
                  f"envoy admin http://{cfg.admin.host}:{cfg.admin.port})", file=sys.stderr, flush=True)
            if on_ready is not None:
                on_ready()
        else:
            print("[cortex] warning: not ready after 60 s; see the messages above", file=sys.stderr, flush=True)

    return asyncio.run(sup.run(ready=announce))
