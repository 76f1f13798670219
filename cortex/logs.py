"""Log set-up shared by every Cortex process: readable text lines for a person, or one JSON object per line for a
log shipper (`--log-format text|json`, `log.format` in cortex.yaml; docs/deployment.md "Logs").

Every process calls `configure()` once at start. The supervisor passes the format and level it resolved to each
child on its command line (`child_args()`), names each child in the `CORTEX_PROCESS` environment variable (the
`process` field), and gives Envoy the same JSON shape through spdlog's pattern (`envoy_args()`), so one run's
output is uniform whichever process wrote a line.

Standard library `logging` only: a record's structured fields are its `extra={...}` (names other than
LogRecord's own attributes). `json_line()` is the JSON shape as a pure function, for writers that do not go
through `logging` (the simulator's ready line; a per-request log line).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, TextIO

import orjson

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")

VOICE = "cortex"
"""The logger of the lines `cortex run` and `cortex demo` address to the person at the terminal (ready, stopping,
a child restarted): text shows them as `[cortex] ready: ...` (`[cortex] warning: ...` above INFO), as before
there were formats."""

PROCESS_ENV = "CORTEX_PROCESS"
"""Set by the supervisor for each child: the child's name (`ingest`, `extproc-0`, `replica-2/envoy`)."""

TEXT_PATTERN = "[%(name)s] %(levelname)s %(message)s"

# Attributes every LogRecord has: anything else on a record came from `extra={...}`.
_RECORD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}

_state: dict[str, str] = {}


def rfc3339(ts: float) -> str:
    """`2026-12-01T09:41:07.123Z`: UTC, milliseconds."""
    ms = int(ts * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z"


def _dumps(doc: Mapping[str, Any]) -> str:
    try:
        return orjson.dumps(doc, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        # orjson refuses integers beyond 64 bits (block hashes are 128-bit) before consulting `default`.
        return json.dumps(doc, default=str, ensure_ascii=False, separators=(",", ":"))


def json_line(msg: str, *, logger: str, level: str = "info", process: str = "", ts: float | None = None,
              exc: str | None = None, **fields: Any) -> str:
    """One log record as one line of JSON (no newline at the end): ts, level, logger, process, msg, then the
    structured fields, then `exc` (a traceback, its newlines escaped)."""
    return _line(msg, logger, level, process, ts, exc, fields)


def _line(msg: str, logger: str, level: str, process: str, ts: float | None, exc: str | None,
          fields: Mapping[str, Any]) -> str:
    doc: dict[str, Any] = {"ts": rfc3339(time.time() if ts is None else ts), "level": level, "logger": logger,
                           "process": process, "msg": msg}
    for key, value in fields.items():
        if key not in doc and key != "exc":  # a field never overwrites a core key
            doc[key] = value
    if exc:
        doc["exc"] = exc
    return _dumps(doc)


def process_name(default: str) -> str:
    return os.environ.get(PROCESS_ENV) or default


class JsonFormatter(logging.Formatter):
    """`json_line()` for a LogRecord: its `extra={...}` fields become top-level keys."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        fields = {k: v for k, v in record.__dict__.items() if k not in _RECORD_ATTRS and not k.startswith("_")}
        exc = None
        if record.exc_info:
            exc = self.formatException(record.exc_info)
        elif record.exc_text:
            exc = record.exc_text
        if record.stack_info:
            fields["stack"] = self.formatStack(record.stack_info)
        return _line(record.getMessage().rstrip(), record.name, record.levelname.lower(), self.process,
                     record.created, exc, fields)


class TextFormatter(logging.Formatter):
    """`[cortex.ingest] INFO worker sim-3 added ...`; the VOICE logger's lines read `[cortex] ready: ...`."""

    def __init__(self, pattern: str = TEXT_PATTERN) -> None:
        super().__init__(pattern)

    def format(self, record: logging.LogRecord) -> str:
        if record.name != VOICE:
            return super().format(record)
        head = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        line = f"[{VOICE}] {head}{record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def add_flags(parser: argparse.ArgumentParser, config: bool = True) -> None:
    """`--log-format` and `--log-level`, None when not given (then cortex.yaml's `log` section, then the default).
    `config`: the command reads a cortex.yaml (the help says where the default comes from)."""
    where = "log.{} in cortex.yaml, else " if config else ""
    parser.add_argument("--log-format", choices=FORMATS, default=None,
                        help="text: readable lines; json: one JSON object per line, every process's and Envoy's "
                             f"(default: {where.format('format')}text)")
    parser.add_argument("--log-level", type=str.lower, choices=LEVELS, default=None,
                        help=f"lowest level written (default: {where.format('level')}info)")


def resolve(flag_level: str | None, flag_format: str | None, verbose: bool = False, file_level: str = "info",
            file_format: str = "text") -> tuple[str, str]:
    """(level, format): a command-line flag wins over cortex.yaml's `log` section, which wins over the defaults;
    `-v` is `--log-level debug` unless a level is given."""
    return flag_level or ("debug" if verbose else file_level), flag_format or file_format


def _level(level: str | int) -> int:
    if isinstance(level, int):
        return level
    if level.lower() not in LEVELS and level.lower() != "critical":
        raise ValueError(f"log level {level!r}: expected one of {', '.join(LEVELS)}")
    return int(logging.getLevelName(level.upper()))


def configure(level: str | int = "info", fmt: str = "text", *, process: str = "", stream: TextIO | None = None,
              text_pattern: str = TEXT_PATTERN) -> None:
    """Route every logger of this process to one handler on stderr (or `stream`) in format `fmt`. Calling it
    again replaces the handler (a process configures from its flags first, then from its config file).

    `process` names this process in JSON lines unless the supervisor named it (CORTEX_PROCESS). With json,
    Python warnings and uncaught exceptions are records too, so nothing this process writes breaks the format."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(FORMATS)}")
    lvl = _level(level)
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_cortex", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler._cortex = True  # type: ignore[attr-defined]
    name = process_name(process)
    handler.setFormatter(JsonFormatter(name) if fmt == "json" else TextFormatter(text_pattern))
    root.addHandler(handler)
    root.setLevel(lvl)
    logging.captureWarnings(True)
    if fmt == "json":
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_thread_uncaught
    else:
        sys.excepthook = sys.__excepthook__
        threading.excepthook = threading.__excepthook__
    _state.update(format=fmt, level=logging.getLevelName(lvl).lower(), process=name)


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, exc, tb)
        return
    logging.getLogger(VOICE).critical("uncaught exception: %s", exc, exc_info=(kind, exc, tb))


def _log_thread_uncaught(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is None or issubclass(args.exc_type, SystemExit):
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger(VOICE).critical("uncaught exception in thread %s: %s", name, args.exc_value,
                                      exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


def current_format() -> str:
    return _state.get("format", "text")


def child_args() -> list[str]:
    """The flags that make a child Cortex process log as this one does (the format and level resolved once,
    here, from the command line and cortex.yaml)."""
    return ["--log-format", current_format(), "--log-level", _state.get("level", "info")]


ENVOY_TEXT = "[envoy] [%l] %v"


def envoy_args(process: str = "envoy") -> list[str]:
    """Envoy's `--log-format`: today's text, or the JSON shape of `json_line()` in spdlog's pattern (`%j` is the
    message JSON-escaped; its timestamp is local time, so Envoy runs with TZ=UTC: `ENVOY_ENV`)."""
    if current_format() != "json":
        return ["--log-format", ENVOY_TEXT]
    name = json.dumps(process).replace("%", "%%")
    pattern = ('{"ts":"%Y-%m-%dT%H:%M:%S.%eZ","level":"%l","logger":"envoy.%n","process":' + name +
               ',"msg":"%j"}')
    return ["--log-format", pattern]


ENVOY_ENV = {"TZ": "UTC"}
"""spdlog writes local time; the JSON `ts` says UTC (Z)."""


def say(msg: str, *args: object, level: int = logging.INFO, **fields: Any) -> None:
    """A line for the person running `cortex run` / `cortex demo` (the VOICE logger), with structured fields for
    JSON, shown whatever the level. Before `configure()` (Cortex used as a library) it is printed as text all the
    same: these lines (ready, stopped, a child given up on) must never vanish for want of a handler."""
    if not _state:
        head = "" if level < logging.WARNING else f"{logging.getLevelName(level).lower()}: "
        print(f"[{VOICE}] {head}{msg % args if args else msg}", file=sys.stderr, flush=True)
        return
    # Past the level check: the few lines addressed to the operator show at any --log-level (the `cortex`
    # logger's own level would be inherited by every cortex.* logger).
    voice = logging.getLogger(VOICE)
    voice.handle(voice.makeRecord(VOICE, level, "", 0, msg, args, None, extra=fields))


def fatal(msg: str, who: str = "cortex") -> None:
    """A refusal at the edge (bad config, broken model files): `cortex: <msg>` on stderr as before, or one JSON
    error record when JSON was asked for on the command line."""
    if current_format() == "json":
        print(json_line(msg, logger=VOICE, level="error", process=_state.get("process", "")), file=sys.stderr,
              flush=True)
    else:
        print(f"{who}: {msg}", file=sys.stderr, flush=True)
