"""A fake Kubernetes API server on loopback for the discovery tests: pods (list, and watch as a stream of JSON
events: ADDED, MODIFIED, DELETED, BOOKMARK, ERROR) and InferencePool objects, as the real API server answers them.

It runs its own event loop in a thread, so sync tests (the gateway end to end) and async ones (asyncio.run)
drive it alike; every mutator is thread-safe and returns once the change is served.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import orjson
from aiohttp import web

T = TypeVar("T")


def pod(name: str, ip: str | None, *, ready: bool = True, phase: str = "Running",
        labels: Mapping[str, str] | None = None, annotations: Mapping[str, str] | None = None,
        deleting: bool = False) -> dict[str, Any]:
    """A pod object with only the fields discovery reads."""
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "labels": dict(labels or {"app": "sim"}),
                            "annotations": dict(annotations or {})}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": phase, "conditions": [{"type": "Ready", "status": str(ready)}]}
    if ip is not None:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": status}


def _matches(obj: Mapping[str, Any], selector: str) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    pairs = [term.split("=", 1) for term in selector.split(",") if term]
    return all(labels.get(k) == v for k, v in pairs)


class FakeKube:
    def __init__(self, namespace: str = "ns") -> None:
        self.namespace = namespace
        self.pods: dict[str, dict[str, Any]] = {}
        self.pools: dict[str, dict[str, Any]] = {}
        self.version = 100
        self.oldest = 0
        """A watch from a resourceVersion below this gets HTTP 410 (the history was compacted)."""
        self.requests: list[dict[str, str]] = []
        """Each request's path and query (and its Authorization header), in order."""
        self.fail_next = 0
        """Answer this many coming requests with 500."""
        self._watchers: list[tuple[str, asyncio.Queue[dict[str, Any] | None]]] = []
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.url = ""

    # -- lifecycle --

    def start(self) -> FakeKube:
        self._thread.start()
        self.url = self._call(self._start)
        return self

    def stop(self) -> None:
        self._call(self._stop)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> FakeKube:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    async def _start(self) -> str:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        app.router.add_get("/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/{name}", self._pool)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    async def _stop(self) -> None:
        for _, q in self._watchers:
            q.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()

    def _call(self, fn: Callable[[], Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(fn(), self._loop).result(timeout=10)

    def _do(self, fn: Callable[[], T]) -> T:
        async def run() -> T:
            return fn()
        return self._call(run)

    # -- what the tests change (each returns once served) --

    def _bump(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.version)
        return obj

    def _send(self, event: dict[str, Any], obj: Mapping[str, Any] | None = None) -> None:
        for selector, q in self._watchers:
            if obj is None or _matches(obj, selector):
                q.put_nowait(event)

    def put(self, p: dict[str, Any]) -> None:
        """Create or update a pod: ADDED or MODIFIED to the watchers."""
        def run() -> None:
            name = p["metadata"]["name"]
            kind = "MODIFIED" if name in self.pods else "ADDED"
            self.pods[name] = obj = self._bump(p)
            self._send({"type": kind, "object": obj}, obj)
        self._do(run)

    def delete(self, name: str) -> None:
        def run() -> None:
            obj = self._bump(self.pods.pop(name))
            self._send({"type": "DELETED", "object": obj}, obj)
        self._do(run)

    def put_silently(self, p: dict[str, Any]) -> None:
        """Change a pod without telling the watchers: only a new list shows it."""
        self._do(lambda: self.pods.__setitem__(p["metadata"]["name"], self._bump(p)))

    def delete_silently(self, name: str) -> None:
        def run() -> None:
            self.version += 1
            del self.pods[name]
        self._do(run)

    def bookmark(self) -> str:
        """A BOOKMARK at a new version; returns it."""
        def run() -> str:
            self.version += 1
            self._send({"type": "BOOKMARK", "object": {"kind": "Pod", "apiVersion": "v1",
                                                       "metadata": {"resourceVersion": str(self.version)}}})
            return str(self.version)
        return self._do(run)

    def expire(self) -> None:
        """An ERROR 410 event on every watch, and no watch from an older version (forces a list)."""
        def run() -> None:
            self.version += 1
            self.oldest = self.version
            self._send({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                    "message": "too old resource version", "reason": "Expired",
                                                    "code": 410}})
        self._do(run)

    def set_pool(self, name: str, labels: Mapping[str, str], ports: list[int]) -> None:
        obj = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
               "metadata": {"name": name, "namespace": self.namespace},
               "spec": {"selector": {"matchLabels": dict(labels)},
                        "targetPorts": [{"number": p} for p in ports],
                        "endpointPickerRef": {"name": "cortex-epp", "port": {"number": 9002}}}}
        self._do(lambda: self.pools.__setitem__(name, obj))

    def watching(self) -> int:
        return self._do(lambda: len(self._watchers))

    def watch_requests(self) -> list[dict[str, str]]:
        return [r for r in self._do(lambda: list(self.requests)) if r.get("watch") == "true"]

    # -- handlers --

    def _log(self, request: web.Request) -> web.Response | None:
        self.requests.append({"path": request.path, **request.query,
                              "authorization": request.headers.get("Authorization", "")})
        if request.match_info["ns"] != self.namespace:
            return web.json_response({"kind": "Status", "code": 403, "message": "forbidden"}, status=403)
        if self.fail_next > 0:
            self.fail_next -= 1
            return web.json_response({"kind": "Status", "code": 500, "message": "etcd is sad"}, status=500)
        return None

    async def _pool(self, request: web.Request) -> web.Response:
        if (refused := self._log(request)) is not None:
            return refused
        obj = self.pools.get(request.match_info["name"])
        if obj is None:
            return web.json_response({"kind": "Status", "code": 404, "message": "not found"}, status=404)
        return web.json_response(obj)

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._log(request)) is not None:
            return refused
        selector = request.query.get("labelSelector", "")
        if request.query.get("watch") != "true":
            items = [p for p in self.pods.values() if _matches(p, selector)]
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self.version)}, "items": items})
        since = int(request.query.get("resourceVersion") or self.version)
        if since < self.oldest:
            return web.json_response({"kind": "Status", "code": 410, "reason": "Expired",
                                      "message": "too old resource version"}, status=410)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        entry = (selector, q)
        self._watchers.append(entry)
        try:
            async with asyncio.timeout(float(request.query.get("timeoutSeconds", "300"))):
                while (event := await q.get()) is not None:
                    await resp.write(orjson.dumps(event) + b"\n")
                    if event["type"] == "ERROR":
                        break  # the real server ends the watch after an error event
        except TimeoutError:
            pass  # the server ends a watch at timeoutSeconds, as the real one does
        finally:
            self._watchers.remove(entry)
        return resp
