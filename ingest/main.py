"""`cortex ingest -c cortex.yaml`: run the ingest process (normally started by `cortex run`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path

from aiohttp import web

from cortex import gc_pauses
from cortex.config import CortexConfig
from ingest.admin import build_app
from ingest.service import Ingest

log = logging.getLogger("cortex.ingest")


async def serve(cfg: CortexConfig, config_path: Path | None = None, picker: bool = False) -> None:
    gc_pauses.watch()
    ingest = Ingest(cfg, config_path)
    await ingest.start()
    runner = web.AppRunner(build_app(ingest, picker), access_log=None)
    await runner.setup()
    ingest.frozen_objects = gc_pauses.settle()  # start-up's heap, out of every full collection's walk
    site = web.TCPSite(runner, cfg.ingest.host, cfg.ingest.port, reuse_address=True)
    await site.start()
    log.info("ingest listening on http://%s:%d (%d workers)", cfg.ingest.host, cfg.ingest.port, len(ingest.workers))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        with contextlib.suppress(Exception):
            await runner.cleanup()
        await ingest.stop()


def run(cfg: CortexConfig, config_path: Path | None = None, picker: bool = False) -> int:
    asyncio.run(serve(cfg, config_path, picker))
    return 0
