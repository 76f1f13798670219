"""Membership: which workers ingest runs, from the config file, the admin API and what was persisted; and
Envoy's pools, which must always list the same workers.

Workers come from the config, the admin API and Kubernetes discovery (ingest/k8s_discovery.py). API changes are
kept in `<runtime_dir>/workers.json` (`{"added": [worker configs], "removed": [config worker ids]}`), so a
restarted ingest (the supervisor restarts it) comes back with the same fleet; `cortex run --reset-workers`
forgets them. Every membership change also rewrites Envoy's EDS files (cortex.envoy_config.write_xds). The rules
are pure functions here; ingest/service.py runs them (it owns the running workers, their tasks and the ledger
view).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

import orjson

from cortex.config import CortexConfig, WorkerConfig
from cortex.envoy_config import atomic_write, write_xds
from ingest.workers import Worker

log = logging.getLogger("cortex.ingest")

CONFIG, API, K8S = "config", "api", "k8s"
"""Where a worker came from (Worker.source). Discovered workers are never persisted: a restarted ingest lists
the pods again."""


class MembershipError(ValueError):
    """A membership change refused, with the HTTP status the admin API answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def state_file(cfg: CortexConfig) -> Path:
    return cfg.runtime_path() / "workers.json"


def restore(cfg: CortexConfig, path: Path) -> list[tuple[WorkerConfig, str]]:
    """The fleet to start with: the config's workers minus those removed through the API, plus those added
    through it (each with its source), as persisted in `path`. An unreadable file is logged and ignored."""
    added: list[WorkerConfig] = []
    removed: set[str] = set()
    if path.is_file():
        try:
            doc = orjson.loads(path.read_bytes())
            added = [WorkerConfig.model_validate(w) for w in doc.get("added", [])]
            removed = set(doc.get("removed", []))
        except (ValueError, TypeError) as exc:
            log.error("ignoring unreadable %s: %s", path, exc)
    out = [(w, CONFIG) for w in cfg.workers if w.id not in removed]
    ids = {w.id for w, _ in out}
    out += [(w, API) for w in added if w.id not in ids]
    restored = [w.id for w, src in out if src == API]
    if restored or removed:
        # Persistence is deliberate (a restarted ingest keeps its fleet), but must never surprise anyone.
        log.info("fleet changes made through the admin API restored from %s: added %s, removed %s "
                 "(`cortex run --reset-workers` forgets them)", path, restored or "none", sorted(removed) or "none")
    return out


def save(path: Path, cfg: CortexConfig, workers: Iterable[Worker]) -> None:
    """Persist in `path` what the admin API changed relative to the config (replaced atomically)."""
    running = list(workers)
    config_ids = {w.id for w in cfg.workers}
    doc = {"added": [w.cfg.model_dump(mode="json") for w in running if w.source == API],
           "removed": sorted(config_ids - {w.id for w in running})}
    atomic_write(path, orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())


def sync_envoy(cfg: CortexConfig, workers: Iterable[Worker]) -> None:
    """Envoy's pools (EDS files) from the running workers, at the address each one is routed to (a hostname
    resolved again here could answer another address than the one extproc names)."""
    running = list(workers)
    # The url keeps its host: an https worker's certificate is checked against that name, not the address.
    write_xds(cfg, [w.cfg for w in running], {w.id: w.address for w in running})


def check_removal(worker: Worker) -> None:
    """Admin API: a discovered worker follows its pod; removing it here would last until the pod changes."""
    if worker.source == K8S:
        raise MembershipError(409, f"worker {worker.id!r} is discovered from Kubernetes: delete or relabel its "
                                   "pod (or change discovery.kubernetes) instead")


def address_moved(current: str, resolved: Iterable[str]) -> str | None:
    """A worker named by a hostname, after resolving it again: the address to move to, or None to stay.
    It stays while the address in use is still among the answers (round-robin DNS reorders them; moving
    would drop the ledger for nothing) and when there is no answer (a DNS failure must not move or drop a
    worker); otherwise it moves to the first answer."""
    answers = list(dict.fromkeys(resolved))
    if not answers or current in answers:
        return None
    return answers[0]


def format_address(ip: str, port: int) -> str:
    """ip:port as WorkerConfig.address writes it."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def check_addition(cfg: CortexConfig, wcfg: WorkerConfig, running: Mapping[str, Worker]) -> None:
    """Admin API: a new worker must have a fresh id and serve a configured model with that model's engine."""
    if wcfg.id in running:
        raise MembershipError(409, f"worker {wcfg.id!r} already exists")
    model = cfg.model(wcfg.model)
    if model is None:
        raise MembershipError(422, f"model {wcfg.model!r} is not one of the configured models "
                                   f"{[m.name for m in cfg.models]}")
    if model.engine != wcfg.engine:
        raise MembershipError(422, f"worker engine {wcfg.engine!r} but model {wcfg.model!r} is served by "
                                   f"{model.engine!r}")


def config_change(old: CortexConfig, new: CortexConfig,
                  running: Mapping[str, Worker]) -> tuple[list[str], list[WorkerConfig]]:
    """What a config reload changes: (ids of running config workers to remove: gone or edited; workers to
    add: new, edited, or config workers not running). Workers added through the API are left alone."""
    old_by_id = {w.id: w for w in old.workers}
    new_by_id = {w.id: w for w in new.workers}
    remove = [wid for wid, wcfg in old_by_id.items()
              if (current := running.get(wid)) is not None and current.source == CONFIG and new_by_id.get(wid) != wcfg]
    left = set(running) - set(remove)
    return remove, [wcfg for wid, wcfg in new_by_id.items() if wid not in left]
