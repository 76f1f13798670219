"""Structured output (seed 004 §3.3): find the JSON schema a request constrains its answer with, refuse it (400)
when it is not a valid JSON Schema, and optionally count whether non-streamed answers match it.

Where the engines read a schema (their source: vLLM 0.33 `entrypoints/generate/base/protocol.py`,
`sampling_params.py`, `entrypoints/serve/engine/protocol.py`; SGLang 0.5.23 `srt/entrypoints/openai/protocol.py`,
`serving_chat.py`, `serving_completions.py`), in the engines' order of precedence:

- `response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`, chat and completions,
  both engines; `schema` typed as an object by both (a boolean schema is refused by their pydantic models).
  `type: json_object` and `text` carry no schema. It wins over the fields below (vLLM replaces
  `structured_outputs` with it; SGLang overwrites its `json_schema` sampling parameter).
- `response_format: {"type": "json_schema", "schema": {...}}` without `json_schema`: SGLang's chat moves it into
  `json_schema` itself; vLLM refuses the request (json_schema missing), so checking it refuses nothing served.
- `structured_outputs: {"json": <object or JSON text>}`: vLLM only (SGLang ignores the unknown field).
- `json_schema: "<JSON text>"`: SGLang's completions only (its chat has no such field; vLLM ignores it).
- The Responses API's `text.format` and the Messages API's `output_config.format` (`{"type": "json_schema",
  "schema": {...}}`), which vLLM turns into the same constraint; their answers are not checked.
- `guided_json`: read by neither. vLLM removed it (it logs "output will NOT be constrained" and serves the
  request), SGLang never had it: it is counted (`ignored`), never refused and never used to check answers.

A field only some engines read is checked when every engine the request's `model` can land on reads it (known
from the config: the model, its LoRA adapters, an alias's targets); otherwise the engine of the chosen worker
judges it, as extproc/request.py does where the engines disagree.

What the engines refuse (their code and a run of xgrammar 0.2.8 and llguidance 1.9.1, the grammar compilers
they use): neither validates against the metaschema; both compile the schema into a grammar and refuse (400)
what the compiler rejects: vLLM before queueing (xgrammar, then llguidance in `auto` mode), SGLang in the
scheduler (an aborted request, 400). The compilers reject most metaschema violations (a bad `type`, `required`
not a list, `properties` not an object, a bad `pattern`, non-numeric bounds, ...) but accept a few: `title` or
`description` not a string, duplicate `required` entries, `$defs` not an object (both); a negative `minLength` /
`minItems` or an empty `anyOf` (xgrammar). Cortex refuses those too (docs/tenancy/structured-output.md:
the issue asks for a metaschema check; such a schema is a client bug either way). Drafts: the engines ignore
`$schema` (xgrammar) or know 2020-12 and 07-era keywords (llguidance); Cortex validates with the draft `$schema`
names (3, 4, 6, 7, 2019-09, 2020-12) and 2020-12 when it names none or one it does not know.
"""

from __future__ import annotations

import hashlib
import json
import logging
import signal
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import orjson
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from jsonschema.protocols import Validator
from jsonschema.validators import validator_for
from prometheus_client import Counter

from cortex import engines
from cortex.config import StructuredOutputConfig
from cortex.errors import ClientError
from extproc.request import ParsedRequest

log = logging.getLogger("cortex.extproc")

ALL_ENGINES = frozenset(engines.ENGINE_NAMES)
BUDGET_S = 0.1
"""Longest a schema check or an answer check may run: both run client-chosen regular expressions on extproc's
event loop, and Python's `re` backtracks without bound. Past it the check gives up (never a refusal)."""
REPEAT_S = 0.005
"""Past the budget the timer fires again every REPEAT_S of CPU: a signal that lands in a gc callback or a
finalizer, where Python drops what the handler raises, is followed by one that stops the check."""

SCHEMA_CACHE = Counter("cortex_structured_output_schema_cache", "schema checks answered from the cache (hit) or "
                       "computed (miss)", ["result"])
SCHEMA_CHECKS = Counter("cortex_structured_output_schema_checks", "JSON schemas found in requests, by field and "
                        "outcome: valid, invalid (refused with 400), unchecked (check over its time budget or too "
                        "deep), ignored (a field no engine reads)", ["field", "outcome"])
ANSWERS = Counter("cortex_structured_output_answers", "non-streamed answers checked against their request's schema, "
                  "per choice: valid, invalid, not_json; per answer: too_large, error", ["model", "outcome"])


@dataclass(frozen=True, slots=True)
class Found:
    """A schema where an engine will read it."""

    param: str
    """The request field the 400 names."""
    where: str
    """Its path, for messages."""
    value: Any
    text: bool
    """The field carries JSON text (parsed here), not an object."""


@dataclass(frozen=True, slots=True)
class Verdict:
    digest: str
    error: str | None
    """Why the schema is invalid (never quoting it); None: valid, or unchecked."""
    validator: Any = None
    """The schema's jsonschema validator when it is valid, for the answers."""
    unchecked: bool = False
    """The check ran out of its time budget (or stack): the engine judges the schema."""


@dataclass(frozen=True, slots=True)
class Expected:
    """A non-streamed request whose answer is to be checked against its (valid) schema."""

    model: str
    """The metrics label: a configured model or alias name, never a free client string."""
    chat: bool
    validator: Any


# -- where the schema is ----------------------------------------------------------------------------------------

def _engines_for(model: str, registry: Any) -> tuple[str, frozenset[str]]:
    """The configured name `model` stands for (metrics label) and the engines it can be served by, resolved as
    ModelRegistry.resolve does; an unknown name may land anywhere (the router refuses it with 404)."""
    adapters = registry.engines
    if model in adapters:
        return model, frozenset({adapters[model].name})
    base = registry.loras_as_model.get(model)
    if base is not None:
        return base, frozenset({adapters[base].name})
    head, sep, adapter = model.partition(":")
    if sep and adapter and head in adapters and adapters[head].lora_as_suffix:
        return head, frozenset({adapters[head].name})
    alias = registry.aliases.get(model)
    if alias is not None:
        names = [*alias.models, *([alias.fallback] if alias.fallback else [])]
        return model, frozenset(adapters[m].name for m in names if m in adapters)
    return "", ALL_ENGINES


def _nested(body: dict[str, Any], outer: str) -> Any:
    """body[outer]["format"] when both are objects (the Responses API's `text`, the Messages API's output_config)."""
    value = body.get(outer)
    return value.get("format") if isinstance(value, dict) else None


def find_schema(body: dict[str, Any], chat: bool, served_by: frozenset[str], api: str = "chat") -> Found | None:
    """The schema the engine will constrain the answer with, in the engines' precedence (module docstring)."""
    if api in ("responses", "messages"):
        # Responses: text.format {"type": "json_schema", "schema"} (vLLM's to_sampling_params); Messages:
        # output_config.format {"type": "json_schema", "schema"} (vLLM's _handle_output_config).
        outer = "text" if api == "responses" else "output_config"
        fmt = _nested(body, outer)
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and fmt.get("schema") is not None:
            return Found(outer, f"{outer}.format.schema", fmt["schema"], False)
        return None
    if api not in ("chat", "completion"):
        return None
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        if isinstance(spec, dict):
            if spec.get("schema") is not None:
                return Found("response_format", "response_format.json_schema.schema", spec["schema"], False)
            return None  # both engines refuse a json_schema without a schema themselves
        if spec is None and fmt.get("schema") is not None:
            return Found("response_format", "response_format.schema", fmt["schema"], False)
        return None
    outputs = body.get("structured_outputs")
    if served_by <= {"vllm"} and isinstance(outputs, dict) and outputs.get("json") is not None:
        return Found("structured_outputs", "structured_outputs.json", outputs["json"], isinstance(outputs["json"], str))
    text = body.get("json_schema")
    if served_by <= {"sglang"} and not chat and isinstance(text, str) and text:
        return Found("json_schema", "json_schema", text, True)
    return None


# -- checking a schema -------------------------------------------------------------------------------------------

class _OverBudget(Exception):
    pass


_armed = threading.local()
_T = TypeVar("_T")


def _on_alarm(signum: int, frame: Any) -> None:
    if getattr(_armed, "on", False):
        raise _OverBudget


def bounded(fn: Callable[[], _T], budget_s: float | None = None) -> _T:
    """fn(), raising _OverBudget past budget_s (default BUDGET_S) of CPU time. `re` checks for signals while it
    backtracks, so a timer signal stops a runaway pattern; outside the main thread (where signals are not handled)
    fn runs unbounded. The timer counts the process's CPU time (ITIMER_PROF), not the wall clock: on a machine
    where the check waits for a core, the wait is not the pattern's work, and a normal schema given up because the
    machine was busy would be let through unchecked. A timer and handler already in place are put back."""
    if threading.current_thread() is not threading.main_thread():
        return fn()
    previous = signal.signal(signal.SIGPROF, _on_alarm)
    old_delay, old_interval = 0.0, 0.0
    started = time.process_time()
    try:
        _armed.on = True  # before the timer starts: a budget shorter than this call still counts
        old_delay, old_interval = signal.setitimer(signal.ITIMER_PROF, budget_s or BUDGET_S, REPEAT_S)
        return fn()
    finally:
        # Disarmed before the timer stops: a signal already on its way is then ignored, not raised out of here.
        _armed.on = False
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous if previous is not None else signal.SIG_DFL)
        if old_delay:
            left = old_delay - (time.process_time() - started)
            signal.setitimer(signal.ITIMER_PROF, max(left, 0.001), old_interval)


def digest(schema: Any) -> str:
    """Of the schema's canonical bytes (sorted keys, no spaces): the same schema as an object or as text, with
    keys in any order, is one cache entry."""
    try:
        canonical = orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # integers past 64 bits, from JSON text parsed by Python's json (as the engines parse it)
        canonical = json.dumps(schema, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
    return hashlib.blake2b(canonical, digest_size=16).hexdigest()


def _draft(schema: Any) -> type[Validator]:
    uri = schema.get("$schema") if isinstance(schema, dict) else None
    if not isinstance(uri, str):
        return Draft202012Validator  # a non-string $schema is then reported by the 2020-12 metaschema
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # an unknown $schema: the default, as documented
        cls: type[Validator] = validator_for(schema, default=Draft202012Validator)
    return cls


_DRAFT_NAMES = {"Draft3Validator": "draft 3", "Draft4Validator": "draft 4", "Draft6Validator": "draft 6",
                "Draft7Validator": "draft 7", "Draft201909Validator": "draft 2019-09",
                "Draft202012Validator": "draft 2020-12"}


def _describe(error: Any) -> str:
    """What is wrong, by location and rule, without the offending value (it is the client's own text)."""
    path = "/".join(str(p)[:64] for p in error.absolute_path)
    at = f"at '/{path}'" if path else "at the top level"
    rule, expected = error.validator, error.validator_value
    if rule == "type":
        what = f"must be of type {' or '.join(expected) if isinstance(expected, list) else expected}"
    elif rule in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "minItems", "minLength"):
        what = f"fails the metaschema's '{rule}: {expected}'"
    elif rule == "anyOf" and error.absolute_path and error.absolute_path[-1] == "type":
        what = "must be a type name (array, boolean, integer, null, number, object, string) or a list of them"
    elif rule == "enum":
        what = f"must be one of {', '.join(map(str, expected))}"
    elif rule == "format":
        what = f"must be a valid {expected}"
    else:
        what = f"fails the metaschema's '{rule}' rule"
    return f"{at} {what}"


def check_schema(schema: Any, key: str = "") -> Verdict:
    """The verdict on one schema (not cached). Raises _OverBudget or RecursionError when it cannot tell."""
    key = key or digest(schema)
    if not isinstance(schema, dict | bool):
        return Verdict(key, "must be a JSON object or boolean")
    cls = _draft(schema)
    meta = cls(cls.META_SCHEMA, format_checker=cls.FORMAT_CHECKER)
    error = best_match(meta.iter_errors(schema))
    if error is not None:
        return Verdict(key, f"is not a valid JSON Schema ({_DRAFT_NAMES.get(cls.__name__, cls.__name__)}): "
                            f"{_describe(error)}")
    return Verdict(key, None, cls(schema, format_checker=cls.FORMAT_CHECKER))


class SchemaCache:
    """Verdicts by schema digest, least recently used out first. Invalid schemas are kept too: a client retrying
    the same bad schema costs a lookup, not a metaschema walk."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[str, Verdict] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def resize(self, size: int) -> None:
        self.size = size
        while len(self._entries) > size:
            self._entries.popitem(last=False)

    def verdict(self, schema: Any) -> Verdict:
        key = digest(schema) if self.size else ""
        hit = self._entries.get(key) if self.size else None
        if hit is not None:
            self._entries.move_to_end(key)
            SCHEMA_CACHE.labels("hit").inc()
            return hit
        SCHEMA_CACHE.labels("miss").inc()
        try:
            found = bounded(partial(check_schema, schema, key))
        except (_OverBudget, RecursionError):
            # Kept like any verdict: the same oversized schema again costs a lookup, not another budget.
            found = Verdict(key or digest(schema), None, unchecked=True)
        if self.size:
            self._entries[found.digest] = found
            if len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return found


CACHE = SchemaCache(StructuredOutputConfig().cache_size)
"""This process's cache (one per extproc process, like the rest of its state)."""


def check_request(cfg: StructuredOutputConfig, req: ParsedRequest, registry: Any,
                  cache: SchemaCache | None = None) -> Expected | None:
    """Raise ClientError(400) for a request whose schema is not a valid JSON Schema; return what its answer is to
    be checked against when `validate_responses` is on and the answer comes whole (not streamed). `registry` is
    the ModelRegistry in force (its engines, LoRA names and aliases)."""
    body, chat = req.body, req.kind == "chat"
    if not cfg.check_schema or not body:
        return None
    if "guided_json" in body:
        SCHEMA_CHECKS.labels("guided_json", "ignored").inc()
    label, served_by = _engines_for(req.model, registry)
    found = find_schema(body, chat, served_by, req.api)
    if found is None:
        return None
    value = found.value
    if found.text:
        try:
            value = json.loads(value)  # Python's json, as both engines parse schema text
        except (ValueError, RecursionError):
            SCHEMA_CHECKS.labels(found.param, "invalid").inc()
            raise ClientError(400, f"'{found.where}' must be a JSON Schema as JSON text, and is not valid JSON",
                              found.param) from None
    elif not isinstance(value, dict):
        SCHEMA_CHECKS.labels(found.param, "invalid").inc()
        raise ClientError(400, f"'{found.where}' must be a JSON object", found.param)
    cache = cache if cache is not None else CACHE
    if cache.size != cfg.cache_size:
        cache.resize(cfg.cache_size)
    try:
        verdict = cache.verdict(value)
    except RecursionError:  # too deep even to digest
        verdict = Verdict("", None, unchecked=True)
    if verdict.unchecked:
        # Cortex cannot tell in time: the engine judges it, as it would without Cortex.
        SCHEMA_CHECKS.labels(found.param, "unchecked").inc()
        return None
    if verdict.error is not None:
        SCHEMA_CHECKS.labels(found.param, "invalid").inc()
        raise ClientError(400, f"'{found.where}' {verdict.error}", found.param)
    SCHEMA_CHECKS.labels(found.param, "valid").inc()
    # Answers are checked in the chat / completions shapes only.
    if not cfg.validate_responses or req.stream or not label or req.api not in ("chat", "completion"):
        return None
    return Expected(label, chat, verdict.validator)


# -- checking the answer ------------------------------------------------------------------------------------------

# Envoy takes a mode override only in the answer to a headers message (ext_proc.cc: inHeaderProcessState), and only
# while send_body_without_waiting_for_header_response is off (cortex/envoy_config.py turns it off, and
# allow_mode_override on, when validate_responses is on). So it is sent with the response headers, for this one
# request, once its status and length are known. The request-side modes repeat the filter's: the override
# replaces both directions' modes.
BUFFER_BODY = ProcessingMode(
    request_header_mode=ProcessingMode.SEND, response_header_mode=ProcessingMode.SEND,
    request_body_mode=ProcessingMode.BUFFERED, response_body_mode=ProcessingMode.BUFFERED,
    request_trailer_mode=ProcessingMode.SKIP, response_trailer_mode=ProcessingMode.SKIP)


def _header(headers: Iterable[Any], name: str) -> str | None:
    for h in headers:
        if h.key == name:
            return (h.raw_value or h.value.encode()).decode("latin-1")
    return None


def ask_for_body(answer: pb.ProcessingResponse, expected: Expected | None, response_headers: Any,
                 max_bytes: int) -> bool:
    """Have Envoy send this answer's body (BUFFERED) when it is a whole 2xx answer of known length within
    max_bytes. An answer of unknown length or past it is counted and left alone: a buffered body past Envoy's
    buffer limit would turn into an error for the client."""
    if expected is None or not answer.HasField("response_headers"):
        return False
    headers = response_headers.headers.headers
    status = _header(headers, ":status") or ""
    if not status.startswith("2"):
        return False  # the engine refused or failed: there is no answer to check
    length = _header(headers, "content-length")
    if length is None or not length.isdigit() or int(length) > max_bytes:
        ANSWERS.labels(expected.model, "too_large").inc()
        return False
    answer.mode_override.CopyFrom(BUFFER_BODY)
    return True


_NOT_JSON = object()


def answer_outcomes(expected: Expected, body: bytes) -> list[str]:
    """One outcome per choice: valid, invalid or not_json (its text is not JSON: cut by max_tokens, or the engine
    did not constrain it). Raises ValueError for a body that is not an OpenAI answer."""
    doc = orjson.loads(body)
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not isinstance(choices, list):
        raise ValueError("no choices")
    outcomes = []
    for choice in choices:
        if not isinstance(choice, dict):
            raise ValueError("choice is not an object")
        message = choice.get("message") if expected.chat else None
        text = message.get("content") if isinstance(message, dict) else choice.get("text")
        try:
            value = orjson.loads(text) if isinstance(text, str) else _NOT_JSON
        except orjson.JSONDecodeError:
            value = _NOT_JSON
        if value is _NOT_JSON:
            outcomes.append("not_json")
        else:
            outcomes.append("valid" if bounded(partial(expected.validator.is_valid, value)) else "invalid")
    return outcomes


def check_answer(expected: Expected, body: bytes) -> None:
    """Count the answer's outcomes; the answer itself always goes to the client unchanged."""
    try:
        outcomes = answer_outcomes(expected, body)
    except Exception:  # a malformed answer, a regex over budget: counted, never the client's problem
        ANSWERS.labels(expected.model, "error").inc()
        return
    for outcome in outcomes:
        ANSWERS.labels(expected.model, outcome).inc()
