"""Workers from Kubernetes: the pods of a pool (a label selector, or an InferencePool's), kept current by a
list-then-watch of the Kubernetes API, handed to ingest as the worker configs the pool should have now.

The rules (docs/deployment.md, "Workers from Kubernetes"):
- A pod is a worker while it is Running, Ready, not being deleted, and has an IP; otherwise it is none (GIE's
  endpoint pickers keep only ready pods too). A worker per target port: one port gives the pod's name as the
  worker id, several (an InferencePool may list up to 8, one per data-parallel API server) give `<pod>-rank-<i>`.
- url http(s)://<podIP>:<port> (`scheme`); KV events tcp://<podIP>:<kv port> where the kv port is the pod's
  `cortex.io/kv-events-port` annotation, else the pool's `kv_events_port`, else none (routed by load); with
  several target ports, the i-th port's worker publishes on the kv port + i (as DP ranks do). The same for
  `cortex.io/kv-replay-port` / `kv_replay_port`. `cortex.io/role`, `cortex.io/dp-size`,
  `cortex.io/bootstrap-port` and `cortex.io/kv-topic` set the worker fields of those names.
- A pod whose annotations are invalid is no worker (logged with the reason), never a crash.
- Any change of a pod's worker config (new IP, port, annotation) replaces the worker: ingest removes and adds it
  through the admin API's membership path, so its ledger is dropped exactly as for an admin removal (a new IP
  is a new pod, whose cache starts empty).

The watch: list (resourceVersion R), then watch from R with bookmarks, renewed from the newest version seen
when the server ends the stream; an ERROR event or HTTP status 410 (Gone: R is too old) starts over with a
list. Errors back off from 1 s to 30 s. The token file is re-read for every request (projected service account
tokens rotate).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp
import orjson
from pydantic import ValidationError

from cortex.config import KubernetesPool, WorkerConfig

log = logging.getLogger("cortex.ingest")

KV_EVENTS_PORT = "cortex.io/kv-events-port"
KV_REPLAY_PORT = "cortex.io/kv-replay-port"
KV_TOPIC = "cortex.io/kv-topic"
ROLE = "cortex.io/role"
DP_SIZE = "cortex.io/dp-size"
BOOTSTRAP_PORT = "cortex.io/bootstrap-port"

INFERENCE_POOL_API = "apis/inference.networking.k8s.io/v1"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")

WATCH_TIMEOUT_S = 60
"""Server-side length of one watch request: how often an InferencePool is re-read and the watch renewed."""
RETRY_MAX_S = 30.0

Desired = dict[str, WorkerConfig]
"""The workers a pool should have now, by id."""


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Gone(Exception):
    """The resourceVersion watched from is too old (410): list again."""


# -- pods to workers (pure) ------------------------------------------------------------------------------------

def _ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _port(value: str, what: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise ValueError(f"{what}: {value!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"{what}: {port} is not a port number")
    return port


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def pod_workers(pod: Mapping[str, Any], pool: KubernetesPool, ports: Sequence[int]) -> tuple[list[WorkerConfig], str]:
    """The workers a pod is, and '' or, when it is none, why not."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    name = meta.get("name") or ""
    if not name:
        return [], "no name"
    if meta.get("deletionTimestamp"):
        return [], "terminating"
    if status.get("phase") != "Running":
        return [], f"phase {status.get('phase')}"
    if not _ready(pod):
        return [], "not ready"
    ip = status.get("podIP")
    if not ip:
        return [], "no pod IP"
    try:
        ipaddress.ip_address(ip)
    except ValueError:
        return [], f"pod IP {ip!r} is not an IP address"
    if not ports:
        return [], "no target port"
    notes: Mapping[str, str] = meta.get("annotations") or {}
    try:
        kv = _port(notes[KV_EVENTS_PORT], KV_EVENTS_PORT) if KV_EVENTS_PORT in notes else pool.kv_events_port
        replay = _port(notes[KV_REPLAY_PORT], KV_REPLAY_PORT) if KV_REPLAY_PORT in notes else pool.kv_replay_port
        fields: dict[str, Any] = {}
        if ROLE in notes:
            fields["role"] = notes[ROLE]
        if DP_SIZE in notes:
            fields["dp_size"] = notes[DP_SIZE]
        if BOOTSTRAP_PORT in notes:
            fields["bootstrap_port"] = _port(notes[BOOTSTRAP_PORT], BOOTSTRAP_PORT)
        if KV_TOPIC in notes:
            fields["kv_topic"] = notes[KV_TOPIC]
        out = []
        for i, port in enumerate(ports):
            out.append(WorkerConfig.model_validate({
                "id": name if len(ports) == 1 else f"{name}-rank-{i}",
                "url": f"{pool.scheme}://{_host(ip)}:{port}", "model": pool.model, "engine": pool.engine,
                "kv_events": None if kv is None else f"tcp://{_host(ip)}:{kv + i}",
                "kv_replay": None if replay is None else f"tcp://{_host(ip)}:{replay + i}", **fields}))
    except ValidationError as exc:
        what = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'worker'}: {e['msg']}" for e in exc.errors())
        return [], f"invalid worker from its annotations: {what}"
    except ValueError as exc:
        return [], f"invalid annotation {exc}"
    return out, ""


def changes(applied: Mapping[str, WorkerConfig], desired: Mapping[str, WorkerConfig]) -> tuple[
        list[str], list[WorkerConfig]]:
    """(ids to remove: gone or changed; configs to add: new or changed). An unchanged worker is left alone."""
    remove = [wid for wid, wcfg in applied.items() if desired.get(wid) != wcfg]
    return remove, [wcfg for wid, wcfg in desired.items() if applied.get(wid) != wcfg]


def pool_spec(obj: Mapping[str, Any]) -> tuple[dict[str, str], list[int]]:
    """An InferencePool's (matchLabels, target ports); ValueError when it has neither."""
    spec = obj.get("spec") or {}
    selector = spec.get("selector") or {}
    labels = selector.get("matchLabels", selector)  # v1: {matchLabels: ...}; v1alpha2: the map itself
    ports = [int(p["number"]) for p in spec.get("targetPorts") or [] if isinstance(p, dict) and "number" in p]
    if not ports and "targetPortNumber" in spec:  # v1alpha2
        ports = [int(spec["targetPortNumber"])]
    if not isinstance(labels, dict) or not labels or not all(isinstance(v, str) for v in labels.values()):
        raise ValueError("spec.selector.matchLabels is missing or empty")
    if not ports:
        raise ValueError("spec.targetPorts is missing or empty")
    return dict(labels), ports


def label_selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


# -- the watch -------------------------------------------------------------------------------------------------

class PoolWatch:
    """One pool: list, then watch, its pods; `apply(desired)` after the list and after every pod event."""

    def __init__(self, pool: KubernetesPool, session: aiohttp.ClientSession,
                 apply: Callable[[Desired], Awaitable[None]], *, watch_timeout_s: int = WATCH_TIMEOUT_S,
                 retry_max_s: float = RETRY_MAX_S) -> None:
        self.pool = pool
        self.session = session
        self.apply = apply
        self.watch_timeout_s = watch_timeout_s
        self.retry_max_s = retry_max_s
        self.server = (pool.api_server or "").rstrip("/")
        self.namespace = pool.namespace or _own_namespace()
        self.pods: dict[str, dict[str, Any]] = {}
        self.labels: dict[str, str] = dict(pool.selector)
        self.ports: list[int] = [pool.target_port] if pool.target_port is not None else []
        self.lists = 0
        """Lists done (the first, and one after each 410 or error)."""
        self._reasons: dict[str, str] = {}
        self._ssl: ssl.SSLContext | None = None

    @property
    def name(self) -> str:
        return (f"inferencepool {self.namespace}/{self.pool.inference_pool}" if self.pool.inference_pool
                else f"pods {self.namespace}/{label_selector(self.labels)}")

    def desired(self) -> Desired:
        out: Desired = {}
        for pod_name, pod in sorted(self.pods.items()):
            workers, reason = pod_workers(pod, self.pool, self.ports)
            if reason != self._reasons.get(pod_name, ""):
                # Logged when it changes only: a watch replays the same verdicts often.
                if reason:
                    log.info("%s: pod %s is no worker: %s", self.name, pod_name, reason)
                self._reasons[pod_name] = reason
            out.update((w.id, w) for w in workers)
        for gone in set(self._reasons) - set(self.pods):
            del self._reasons[gone]
        return out

    async def run(self) -> None:
        if not self.server:
            try:
                self.server = _in_cluster_server()
            except RuntimeError as exc:
                log.error("%s", exc)
                return
        delay = 1.0
        listed_at = 0.0
        while True:
            try:
                version = await self._list()
                listed_at, delay = time.monotonic(), 1.0
                while True:
                    version = await self._watch(version)
                    if self.pool.inference_pool and await self._pool_changed():
                        break  # a new selector or port: list again
            except Gone:
                log.info("%s: watch expired (410), listing again", self.name)
                if time.monotonic() - listed_at < 1.0:
                    await asyncio.sleep(1.0)  # a server that expires every fresh list must not spin us
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the API server may fail in any way: keep the fleet, retry
                log.warning("%s: Kubernetes API: %s; retrying in %.0f s (the workers found so far stay)",
                            self.name, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max_s)

    # -- requests --

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        with contextlib.suppress(OSError):
            token = Path(self.pool.token_file).read_text().strip()
            if token:
                headers["Authorization"] = f"Bearer {token}"
        return headers

    def _tls(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https://"):
            return True  # plain http (loopback only, checked by the config): no TLS to set up
        if self._ssl is None:
            ca = Path(self.pool.ca_file)
            self._ssl = ssl.create_default_context(cafile=str(ca) if ca.is_file() else None)
        return self._ssl

    async def _get(self, path: str, query: Mapping[str, str] | None = None) -> Any:
        url = f"{self.server}/{path}" + (f"?{urlencode(query)}" if query else "")
        async with self.session.get(url, headers=self._headers(), ssl=self._tls(),
                                    timeout=aiohttp.ClientTimeout(total=30)) as resp:
            body = await resp.read()
            if resp.status == 410:
                raise Gone()
            if resp.status != 200:
                raise ApiError(resp.status, _status_message(body))
            return orjson.loads(body)

    async def _pool_changed(self) -> bool:
        """Re-read the InferencePool; True when its selector or ports changed."""
        doc = await self._get(f"{INFERENCE_POOL_API}/namespaces/{self.namespace}/inferencepools/"
                              f"{self.pool.inference_pool}")
        labels, ports = pool_spec(doc)
        if (labels, ports) == (self.labels, self.ports):
            return False
        log.info("%s: selector %s, target ports %s", self.name, label_selector(labels), ports)
        self.labels, self.ports = labels, ports
        return True

    async def _list(self) -> str:
        if self.pool.inference_pool:
            await self._pool_changed()
        doc = await self._get(f"api/v1/namespaces/{self.namespace}/pods",
                              {"labelSelector": label_selector(self.labels)})
        self.pods = {p["metadata"]["name"]: p for p in doc.get("items") or []
                     if isinstance(p, dict) and (p.get("metadata") or {}).get("name")}
        self.lists += 1
        desired = self.desired()
        log.info("%s: %d pod(s), %d worker(s)", self.name, len(self.pods), len(desired))
        await self.apply(desired)
        return str((doc.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, version: str) -> str:
        """One watch request from `version`; returns the newest version seen when the server ends it."""
        query = {"labelSelector": label_selector(self.labels), "watch": "true", "allowWatchBookmarks": "true",
                 "timeoutSeconds": str(self.watch_timeout_s)}
        if version:
            query["resourceVersion"] = version
        url = f"{self.server}/api/v1/namespaces/{self.namespace}/pods?{urlencode(query)}"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=self.watch_timeout_s + 30)
        async with self.session.get(url, headers=self._headers(), ssl=self._tls(), timeout=timeout) as resp:
            if resp.status == 410:
                raise Gone()
            if resp.status != 200:
                raise ApiError(resp.status, _status_message(await resp.read()))
            while line := await resp.content.readline():
                if not line.strip():
                    continue
                event = orjson.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone()
                    raise ApiError(int(obj.get("code") or 500), str(obj.get("message") or obj))
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind == "BOOKMARK":
                    continue
                name = (obj.get("metadata") or {}).get("name")
                if not name:
                    continue
                if kind == "DELETED":
                    self.pods.pop(name, None)
                elif kind in ("ADDED", "MODIFIED"):
                    self.pods[name] = obj
                else:
                    continue
                await self.apply(self.desired())
        return version


def _status_message(body: bytes) -> str:
    with contextlib.suppress(ValueError):
        doc = orjson.loads(body)
        if isinstance(doc, dict) and doc.get("message"):
            return str(doc["message"])
    return body[:200].decode(errors="replace")


def _in_cluster_server() -> str:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise RuntimeError("discovery.kubernetes: no api_server configured and not running in a pod "
                           "(KUBERNETES_SERVICE_HOST is unset)")
    return f"https://{_host(host)}:{port}"


def _own_namespace() -> str:
    try:
        return (SERVICE_ACCOUNT / "namespace").read_text().strip() or "default"
    except OSError:
        return "default"
