"""Live reload of cortex.yaml, shared by ingest and extproc: notice an edit, load and check it off the event
loop, and hand back one new value for the caller to swap in whole, or nothing.

Each side builds what it needs from the new config (extproc: the model registry with its tokenizers; ingest:
the tokenizer-parity probes) inside `prepare`, so a bad edit is refused before anything changes: it is logged
and the running config stays. The caller swaps one reference; nothing writes into objects already in use.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from cortex.config import ConfigError, CortexConfig, check_models, load_config
from cortex.model_bundle import BundleCache, BundleError

log = logging.getLogger("cortex.config")

T = TypeVar("T")


class ConfigWatcher(Generic[T]):
    """`await poll()` returns `prepare(new_config)` once per edit of the file, or None (no edit, or a bad one).

    `prepare` runs in a worker thread (tokenizers take a while to load) and may raise ConfigError or
    BundleError to refuse the edit."""

    def __init__(self, path: Path | None, prepare: Callable[[CortexConfig], T],
                 bundles: BundleCache | None = None) -> None:
        """`bundles`: the process's loaded model bundles (shared with `prepare`), so an edit that changes no
        model's files loads no tokenizer: a load holds the GIL for ~0.6 s, thread or not."""
        self.path = path
        self._prepare = prepare
        self.bundles = bundles if bundles is not None else BundleCache()
        self._mtime = self._stat()

    def _stat(self) -> int:
        try:
            return os.stat(self.path).st_mtime_ns if self.path is not None else 0
        except OSError:
            return 0

    def _load(self, path: Path) -> T:
        cfg = load_config(path)
        check_models(cfg, self.bundles)  # the checks `cortex run` makes at start
        return self._prepare(cfg)

    async def poll(self) -> T | None:
        mtime = self._stat()
        if self.path is None or mtime == self._mtime:
            return None
        self._mtime = mtime
        try:
            return await asyncio.to_thread(self._load, self.path)
        except (ConfigError, BundleError) as exc:
            log.error("config change ignored, the running config stays: %s", exc)
            return None
